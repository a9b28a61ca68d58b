"""2-process CPU job: faults that used to crash, hang or split the ranks under ``gradkit_ddp``.

- ``gather``: ``training_step`` issues a collective (``self.all_gather`` of the batch, ``self.log(sync_dist=True)``),
  accumulation over 2 micro-batches, and rank 1's loss is NaN in the FIRST micro-batch of the window: the forensic
  replay must pair the collectives of both ranks.
- ``after_reduce`` / ``after_reduce_no_loss_check``: rank 1 writes a NaN into a gradient in ``on_after_backward``,
  after the DDP all-reduce: both ranks must skip the step.

Every fit uses a 60 s process-group timeout, so a hang fails fast. Each rank records, per case: whether the bad step
left parameters and Adam state bitwise unchanged, its final parameters, and (rank 0) the events.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from guards_script import record
from torch import Tensor

from helpers import distributed_trainer, pg_timeout, rank_loader, script_parser, write_rank_result
from lightning_gradkit import GradKitDDPStrategy, NonFiniteGuard
from test_guards import NAN, Fault, FaultModule


class GatherModule(FaultModule):
    """Inputs centred on the global batch mean, gathered from every rank in ``training_step``."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        mean = self.all_gather(x).mean(dim=(0, 1))  # a collective inside training_step
        loss = super().training_step((x - mean, y), batch_idx)
        self.log("train_loss", loss, sync_dist=True)  # another one (silenced during a replay on every rank)
        return loss


class AfterReduceModule(FaultModule):
    """Rank 1 writes a NaN into one gradient after the backward (after DDP's all-reduce) of one batch."""

    def on_after_backward(self) -> None:
        if self._batch_idx == self.fault.batch_idx and self.trainer.global_rank == self.fault.rank:
            self.encoder[0].weight.grad[0, 0] = NAN


def fit(out: Path, name: str, model: FaultModule, guard: NonFiniteGuard, **kwargs: Any) -> pl.Trainer:
    trainer = distributed_trainer(
        strategy=GradKitDDPStrategy(timeout=pg_timeout()),
        default_root_dir=out / name,
        log_every_n_steps=50,
        callbacks=[guard],
        **kwargs,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, rank_loader(trainer.global_rank, n=64))
    return trainer


def main() -> None:
    args = script_parser().parse_args()
    results: dict[str, Any] = {}

    torch.manual_seed(0)
    model = GatherModule(Fault("loss", NAN, batch_idx=4, rank=1))  # first micro-batch of window (step) 2
    trainer = fit(args.out, "gather", model, NonFiniteGuard(action="skip"), accumulate_grad_batches=2)
    results["gather"] = record(trainer, model, 4, 6)

    for name, guard in (
        ("after_reduce", NonFiniteGuard(action="skip")),
        ("after_reduce_no_loss_check", NonFiniteGuard(action="skip", check_loss=False)),
    ):
        torch.manual_seed(0)
        model = AfterReduceModule(Fault("after_reduce", NAN, batch_idx=2, rank=1, target="encoder.0.weight"))
        trainer = fit(args.out, name, model, guard)
        results[name] = record(trainer, model, 2, 3)

    write_rank_result(args.out, trainer.global_rank, results)


if __name__ == "__main__":
    main()
