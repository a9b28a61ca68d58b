"""One "node" of a 2-node CPU job (gloo): ``num_nodes=2, devices=1``, ``strategy="gradkit_ddp"``, started once per
node by the test with ``NODE_RANK``/``MASTER_ADDR``/``MASTER_PORT`` as on a cluster. Monitor, NonFiniteGuard (skip)
and ClipGradNorm; node 1's loss is NaN at one step. Each node records its decisions, logged norms and parameters.
"""

from __future__ import annotations

import warnings

import torch
from mesh2d_script import Record

from helpers import distributed_trainer, rank_loader, script_parser, write_rank_result
from lightning_gradkit import ClipGradNorm, GradNormMonitor, NonFiniteGuard
from test_multinode_distributed import MAX_NORM, NodeFault


def main() -> None:
    args = script_parser().parse_args()
    torch.manual_seed(0)
    model = NodeFault()
    record = Record()
    callbacks = [GradNormMonitor(depth=1), NonFiniteGuard(action="skip"), ClipGradNorm(MAX_NORM), record]
    trainer = distributed_trainer(strategy="gradkit_ddp", num_nodes=2, devices=1, callbacks=callbacks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, rank_loader(trainer.global_rank))
    out = {
        "node_rank": trainer.node_rank,
        "global_rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "steps": record.steps,
        "params": {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()},
    }
    write_rank_result(args.out, trainer.global_rank, out)


if __name__ == "__main__":
    main()
