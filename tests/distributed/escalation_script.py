"""2-process CPU job: SpikeRollback's escalation under DDP, from the persistent LR fault of
``tests/test_rollback_escalation.py``. Each rank trains on half of every global batch (the even or the odd samples);
the rollbacks, the escalation (LR cut and the moment reset of the spiking modules) and the final parameters must be
the same on every rank.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any

import torch
from torch.utils.data import DataLoader

from helpers import distributed_trainer, script_parser, write_rank_result
from lightning_gradkit import GradKitDDPStrategy
from test_guards import events
from test_rollback_escalation import FaultyScheduleModule, data, escalating


def rank_loader(rank: int) -> DataLoader:
    """Global batch k (32 samples) split between the ranks: rank r gets its samples r, r + 2, ..."""
    return DataLoader([{"x": x[rank::2], "y": y[rank::2]} for x, y in data()], batch_size=None)


class DictBatchModule(FaultyScheduleModule):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return super().training_step((batch["x"], batch["y"]), batch_idx)


def main() -> None:
    args = script_parser().parse_args()
    torch.manual_seed(0)
    model = DictBatchModule()
    callback = escalating(escalate_reset_moments="spiking")
    strategy = GradKitDDPStrategy(timeout=timedelta(seconds=60))
    trainer = distributed_trainer(strategy=strategy, default_root_dir=args.out / "ddp", callbacks=[callback])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, rank_loader(trainer.global_rank))
    state: dict[str, Any] = callback.state_dict()
    write_rank_result(
        args.out,
        trainer.global_rank,
        {
            "events": [e for e in events(args.out / "ddp") if e["what"] in ("rollback", "escalation")]
            if trainer.global_rank == 0
            else [],
            "params": {n: p.detach().tolist() for n, p in model.named_parameters()},
            "ramp": [state["ramp_start"], state["ramp_done"], state["escalations"]],
            "losses": model.losses,
        },
    )


if __name__ == "__main__":
    main()
