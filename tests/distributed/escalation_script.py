"""2-process CPU job: SpikeRollback's escalation under DDP and under FSDP2 (``fully_shard``), from the persistent LR
fault of ``tests/test_rollback_escalation.py``. Each rank trains on half of every global batch (the even or the odd
samples); the rollbacks, the escalation (LR cut and the moment reset of the spiking modules) and the final parameters
must be the same on every rank. Each rank also records its own *local* optimizer state (FSDP2: its shards) at the
snapshot the escalation restores, right after the escalation and after the next step, for the test to see the
reset of every shard.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from gradkit.step.norms import local_tensor
from helpers import distributed_trainer, pg_timeout, script_parser, write_rank_result
from lightning_gradkit import GradKitDDPStrategy, GradKitModelParallelStrategy
from test_guards import events
from test_rollback_escalation import FaultyScheduleModule, data, escalating

# The escalation restores the snapshot of step 24 at step 31; the state at the end of that batch is keyed 32, and
# after the next (applied) step 33.
RECORDED_STEPS = (24, 32, 33)


def rank_loader(rank: int) -> DataLoader:
    """Global batch k (32 samples) split between the ranks: rank r gets its samples r, r + 2, ..."""
    return DataLoader([{"x": x[rank::2], "y": y[rank::2]} for x, y in data()], batch_size=None)


def largest(local: torch.Tensor) -> float | None:
    """The largest absolute value of a local tensor; ``None`` for an empty shard."""
    return float(local.abs().max()) if local.numel() else None


class DictBatchModule(FaultyScheduleModule):
    """Records, at the steps ``RECORDED_STEPS``, each parameter's local shape and the largest absolute value of each
    tensor of its local optimizer state."""

    def __init__(self) -> None:
        super().__init__()
        self.moments: dict[int, dict[str, Any]] = {}

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return super().training_step((batch["x"], batch["y"]), batch_idx)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = self.trainer.global_step
        if step not in RECORDED_STEPS:
            return
        opt = self.trainer.optimizers[0]
        self.moments[step] = {
            name: {
                "local_numel": local_tensor(p.detach()).numel(),
                "numel": p.numel(),
                "state": {k: largest(local_tensor(v)) for k, v in opt.state[p].items()},
                "state_numel": {k: local_tensor(v).numel() for k, v in opt.state[p].items()},
                "dtensor": {k: type(v).__name__ == "DTensor" for k, v in opt.state[p].items()},
            }
            for name, p in self.named_parameters()
        }


class ShardedDictBatchModule(DictBatchModule):
    """The same, with ``net.blocks`` and ``net.head`` sharded by FSDP2 in ``configure_model``."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for module in (self.net.blocks, self.net.head):
            fully_shard(module, mesh=mesh)


def run(out: Path, name: str, model: DictBatchModule, strategy: Any) -> dict[str, Any]:
    callback = escalating(escalate_reset_moments="spiking")
    trainer = distributed_trainer(strategy=strategy, default_root_dir=out / name, callbacks=[callback])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, rank_loader(trainer.global_rank))
    state: dict[str, Any] = callback.state_dict()
    found = events(out / name) if trainer.global_rank == 0 else []
    return {
        "rank": trainer.global_rank,
        "events": [e for e in found if e["what"] in ("rollback", "escalation")],
        "params": {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().tolist()
            for n, p in model.named_parameters()
        },
        "moments": model.moments,
        "ramp": [state["ramp_start"], state["ramp_done"], state["escalations"]],
        "losses": model.losses,
    }


def main() -> None:
    args = script_parser().parse_args()
    results: dict[str, Any] = {}
    torch.manual_seed(0)
    results["ddp"] = run(args.out, "ddp", DictBatchModule(), GradKitDDPStrategy(timeout=pg_timeout()))
    torch.manual_seed(0)
    fsdp2 = GradKitModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=pg_timeout())
    results["fsdp2"] = run(args.out, "fsdp2", ShardedDictBatchModule(), fsdp2)
    write_rank_result(args.out, results["ddp"]["rank"], results)


if __name__ == "__main__":
    main()
