"""2-process CPU job (gloo): the three front doors under DDP, with a NaN on rank 1 only at one step.

Started once per rank with ``LOCAL_RANK``/``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set, as
``torchrun`` starts a job (:func:`helpers.run_processes`). The plain door initializes ``torch.distributed`` itself
and wraps the model in ``DistributedDataParallel``; the Trainer (``strategy="gradkit_ddp"``) and Fabric
(``strategy="ddp"``) then find the processes created externally and the process group already up, as under
``torchrun``. Each rank records, per case and door, its final state (parameters and BatchNorm buffers) and the
gradkit series it logged.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.utils.data import DataLoader

from helpers import distributed_trainer, script_parser, write_rank_result
from lightning_gradkit.loop import GradKit
from test_front_doors import (
    Net,
    NetModule,
    RecordingFabricLogger,
    RecordingLogger,
    _initial_state,
    _optimizer,
    _series,
)
from test_front_doors_distributed import CASES, STEPS, WORLD, policies, rank_batches


def state(module: nn.Module) -> dict[str, list[float]]:
    return {k: v.detach().double().reshape(-1).tolist() for k, v in module.state_dict().items()}


def train(model: nn.Module, opt: Any, kit: GradKit, backward: Callable[[Tensor], None], rank: int) -> None:
    model.train()
    for x, y in rank_batches(rank):
        loss = nn.functional.mse_loss(model(x), y)
        backward(loss)
        kit.note_loss(loss)
        kit.step(opt)
        opt.zero_grad(set_to_none=True)
    kit.finish()


def run_plain(clipper: str, optimizer: str, rank: int) -> dict[str, Any]:
    net = Net()
    net.load_state_dict(_initial_state())
    model = nn.parallel.DistributedDataParallel(net)
    opt = _optimizer(optimizer, model.parameters())
    rows: list[dict[str, float]] = []
    log = lambda metrics, step: rows.append(metrics)  # noqa: E731
    kit = GradKit(model, opt, policies(clipper), log=log, log_every_n_steps=1, max_steps=STEPS)
    train(model, opt, kit, Tensor.backward, rank)
    return {"state": state(net), "logs": _series(rows)}


def run_fabric(clipper: str, optimizer: str, rank: int) -> dict[str, Any]:
    logger = RecordingFabricLogger()
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy="ddp", loggers=[logger])
    fabric.launch()
    assert fabric.global_rank == rank
    net = Net()
    net.load_state_dict(_initial_state())
    model, opt = fabric.setup(net, _optimizer(optimizer, net.parameters()))
    kit = GradKit(model, opt, policies(clipper), fabric=fabric, log_every_n_steps=1, max_steps=STEPS)
    train(model, opt, kit, fabric.backward, rank)
    return {"state": state(net), "logs": _series(logger.rows)}


def run_trainer(clipper: str, optimizer: str, rank: int) -> dict[str, Any]:
    module = NetModule(optimizer)
    module.load_state_dict(_initial_state())
    logger = RecordingLogger()
    trainer = distributed_trainer(
        strategy="gradkit_ddp", callbacks=policies(clipper), logger=logger, max_steps=STEPS, default_root_dir="."
    )
    assert trainer.global_rank == rank
    trainer.fit(module, DataLoader(rank_batches(rank), batch_size=None))
    return {"state": state(module), "logs": _series(logger.rows), "global_step": trainer.global_step}


def main() -> None:
    args = script_parser().parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    doors = {"plain": run_plain, "trainer": run_trainer, "fabric": run_fabric}
    results: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for clipper, optimizer in CASES:
            case = f"{clipper}-{optimizer}"
            for door, run in doors.items():
                pl.seed_everything(0, verbose=False)
                results[f"{case}/{door}"] = run(clipper, optimizer, rank)
    write_rank_result(args.out, rank, results)


if __name__ == "__main__":
    main()
