"""2-process CPU job: the fault matrix under DDP with the fault on rank 1 only, plus a one-rank loss spike.

Both ranks run the same sequence of fits (Lightning starts rank 1 on the first fit; later fits reuse the process
group). Each rank records, per case: whether the bad step left parameters and Adam state bitwise unchanged, its
final parameters, and (rank 0) the events file.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from helpers import distributed_trainer, rank_loader, script_parser, write_rank_result
from lightning_gradkit import GradKitModelParallelStrategy, NonFiniteGuard, SpikeGuard
from test_guards import Fault, FaultModule, events, make_fault, plain, state_equal
from test_guards_spike import SpikyModule

NAN, INF = float("nan"), float("inf")


class ShardedFaultModule(FaultModule):
    """FSDP2 (``fully_shard``) on the encoder and the head."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        for module in (self.encoder, self.head):
            fully_shard(module, mesh=self.device_mesh["data_parallel"])


class OneRankSpike(SpikyModule):
    """Adam; the loss of batch 5 is multiplied by 50 on rank 1 only."""

    def __init__(self) -> None:
        super().__init__(spike_at=5)
        self.optimizer_name = "adam"
        self.lr = 0.01

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_rank == 0:
            self.spike_at = None
        return super().training_step(batch, batch_idx)


def fit(
    out: Path, name: str, model: FaultModule, callback: pl.Callback, strategy: Any = "gradkit_ddp"
) -> tuple[pl.Trainer, FaultModule]:
    trainer = distributed_trainer(
        strategy=strategy, default_root_dir=out / name, log_every_n_steps=50, callbacks=[callback]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, rank_loader(trainer.global_rank, n=64))
    return trainer, model


def record(trainer: pl.Trainer, model: FaultModule, k: int, after: int | None = None) -> dict[str, Any]:
    """Whether the step between the snapshots at batches ``k`` and ``after`` (``k + 1``) left the state unchanged,
    whether the next one changed it, the final parameters, the events (rank 0) and the step count."""
    after = k + 1 if after is None else after
    following = model.snapshots.get(after + 1)
    return {
        "unchanged": state_equal(model.snapshots[k], model.snapshots[after]),
        "later_changed": following is not None and not state_equal(model.snapshots[after], following),
        "params": {n: plain(p).reshape(-1).tolist() for n, p in model.named_parameters()},
        "events": events(trainer.default_root_dir) if trainer.global_rank == 0 else None,
        "global_step": trainer.global_step,
    }


def main() -> None:
    args = script_parser().parse_args()
    results: dict[str, Any] = {}
    rank = 0
    for kind in ("loss", "grad", "activation"):
        for value in (NAN, INF):
            name = f"{kind}-{'nan' if math.isnan(value) else 'inf'}"
            torch.manual_seed(0)
            fault = make_fault(kind, value, rank=1)
            trainer, model = fit(args.out, name, FaultModule(fault), NonFiniteGuard(action="skip"))
            rank = trainer.global_rank
            results[name] = {**record(trainer, model, fault.batch_idx), "target": fault.target}
    # Finite, and so is the all-reduced mean (3e19): its square passes fp32, a norm overflow on every rank.
    torch.manual_seed(0)
    fault = Fault("grad", 6e19, rank=1, target="encoder.0.weight")
    trainer, model = fit(args.out, "grad-overflow", FaultModule(fault), NonFiniteGuard(action="skip"))
    results["grad-overflow"] = {**record(trainer, model, fault.batch_idx), "target": fault.target}
    torch.manual_seed(0)
    trainer, model = fit(
        args.out, "spike", OneRankSpike(), SpikeGuard("loss", z_threshold=4.0, warmup_steps=3, action="skip")
    )
    results["spike"] = record(trainer, model, 5)
    torch.manual_seed(0)
    fsdp2 = GradKitModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    fault = make_fault("loss", NAN, rank=1)
    trainer, model = fit(args.out, "fsdp2-loss-nan", ShardedFaultModule(fault), NonFiniteGuard(), strategy=fsdp2)
    results["fsdp2-loss-nan"] = record(trainer, model, fault.batch_idx)
    write_rank_result(args.out, rank, results)


if __name__ == "__main__":
    main()
