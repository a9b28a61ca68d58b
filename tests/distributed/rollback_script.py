"""2-process CPU job: SpikeRollback under DDP and under FSDP2 (``fully_shard``), the spike on rank 1 only.

Global batches 9 and 10 spike (rank 1's targets x50); with ``patience=2`` the rollback fires at step 10 on every
rank, restores the snapshot of step 8 and steps over 2 more batches. Each rank records its own *local* state
(FSDP2: its shards) at the end of every batch and compares the state after the rollback with the snapshot's
bitwise; it also reports the final parameters (gathered whole) for the single-process reference.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Subset

from gradkit.step.norms import local_tensor
from helpers import MLPModule, ShardedMLP, distributed_trainer, pg_timeout, script_parser, write_rank_result
from lightning_gradkit import GradKitDDPStrategy, GradKitModelParallelStrategy, SpikeRollback
from test_guards import events
from test_rollback_distributed import N_BATCHES, spiky_global_data


def rank_loader(rank: int) -> DataLoader:
    data = spiky_global_data()
    return DataLoader(Subset(data, range(rank, len(data), 2)), batch_size=4)


def local_state(module: pl.LightningModule) -> dict[str, Any]:
    trainer = module.trainer
    opt = trainer.optimizers[0]
    return {
        "params": [local_tensor(p.detach()).clone() for p in module.parameters()],
        "optimizer": [
            {k: local_tensor(v).clone() if isinstance(v, Tensor) else v for k, v in opt.state[p].items()}
            for p in module.parameters()
            if p in opt.state
        ],
        "lr": [g["lr"] for g in opt.param_groups],
        "scheduler": copy.deepcopy(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
    }


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


class RollbackMLP(MLPModule):
    """Adam and a per-step StepLR; the local state recorded at every batch end, keyed by global step."""

    def __init__(self) -> None:
        super().__init__(lr=0.01, optimizer="adam")
        self.records: dict[int, dict[str, Any]] = {}

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.records[self.trainer.global_step] = local_state(self)


class ShardedRollbackMLP(RollbackMLP, ShardedMLP):
    """The same, with the encoder and the head sharded by FSDP2 in ``configure_model``."""


def run(out: Path, name: str, model: RollbackMLP, strategy: Any) -> dict[str, Any]:
    callback = SpikeRollback(
        "loss", z_threshold=4.0, alpha=0.9, warmup_steps=4, patience=2, snapshot_every_n_steps=4, skip_batches=2
    )
    trainer = distributed_trainer(strategy=strategy, default_root_dir=out / name, callbacks=[callback])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, rank_loader(trainer.global_rank))
    found = [e for e in events(trainer.default_root_dir) if e["what"] == "rollback"] if trainer.global_rank == 0 else []
    # The test checks (rank 0's event) that the rollback fired at step 10 and restored the snapshot of step 8.
    return {
        "rank": trainer.global_rank,
        "restored_equals_snapshot": equal(model.records[11], model.records[8]),
        "spike_changed_state": not equal(model.records[10], model.records[8]),
        "adam_steps": [float(s["step"]) for s in model.records[N_BATCHES]["optimizer"]],
        "params": {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().tolist()
            for n, p in model.named_parameters()
        },
        "events": found,
        "global_step": trainer.global_step,
        "snapshot_bytes": callback.snapshot_bytes,
    }


def refused_save_snapshots(out: Path) -> str:
    """The setup error of ``save_snapshots=True`` under FSDP2 (each rank's snapshots hold its own shards)."""
    strategy = GradKitModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=pg_timeout())
    callback = SpikeRollback(save_snapshots=True)
    trainer = distributed_trainer(strategy=strategy, default_root_dir=out / "refused", callbacks=[callback])
    try:
        trainer.fit(ShardedRollbackMLP(), rank_loader(trainer.global_rank))
    except ValueError as error:
        return str(error)
    return ""


def main() -> None:
    args = script_parser().parse_args()
    results: dict[str, Any] = {}
    torch.manual_seed(0)
    results["ddp"] = run(args.out, "ddp", RollbackMLP(), GradKitDDPStrategy(timeout=pg_timeout()))
    torch.manual_seed(0)
    fsdp2 = GradKitModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=pg_timeout())
    results["fsdp2"] = run(args.out, "fsdp2", ShardedRollbackMLP(), fsdp2)
    results["fsdp2_save_snapshots"] = refused_save_snapshots(args.out)
    write_rank_result(args.out, results["ddp"]["rank"], results)


if __name__ == "__main__":
    main()
