"""NonFiniteGuard's validation checks: a non-finite validation loss is reported once per validation run.

The training-step checks live in :mod:`~lightning_gradkit.callbacks.guards`; this file holds the validation side only
(``check_validation``, ``stop_on_nonfinite_validation``): the loss of every validation batch is checked on device
(the tensor ``validation_step`` returns, or its ``"loss"`` entry), together with the logged metrics whose name starts
with ``val`` and contains ``loss``; at the end of the validation run the ranks' findings are gathered once, then
written as one event and one warning, and training stops if asked to.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from gradkit._arguments import check_bool
from lightning_gradkit.callbacks.guard_reporting import GuardBase
from lightning_gradkit.engine import Engine

__all__ = ["NonFiniteValidationCheck"]


class NonFiniteValidationCheck(GuardBase):
    """The validation hooks of :class:`~lightning_gradkit.NonFiniteGuard` (see its ``check_validation``).

    Args:
        action: the guard's ``action`` (validation never skips anything: it is recorded in the event only).
        check_validation: report non-finite validation losses.
        stop_on_nonfinite_validation: stop training on a non-finite validation loss.

    Raises:
        ValueError: if either flag is not a bool.
    """

    def __init__(self, action: str, check_validation: bool, stop_on_nonfinite_validation: bool) -> None:
        super().__init__(action)
        self.check_validation = check_bool("check_validation", check_validation)
        self.stop_on_nonfinite_validation = check_bool("stop_on_nonfinite_validation", stop_on_nonfinite_validation)
        # Whether a batch of this validation run had a non-finite loss, and the first value of the first such batch.
        self._val_bad: Tensor | None = None
        self._val_first: Tensor | None = None

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not self.check_validation:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, Tensor):
            return
        bad = ~torch.isfinite(loss.detach()).all()
        if self._val_bad is None:
            self._val_bad, self._val_first = bad, loss.detach().float().reshape(-1)[:1]
        else:
            self._val_first = torch.where(self._val_bad, self._val_first, loss.detach().float().reshape(-1)[:1])
            self._val_bad = self._val_bad | bad

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.check_validation:
            return
        device = pl_module.device
        local = torch.zeros(2, device=device)
        if self._val_bad is not None:
            local = torch.cat([self._val_bad.float().reshape(1), self._val_first.reshape(1)]).to(device)
        metrics = {
            k: float(v)
            for k, v in trainer.callback_metrics.items()
            if k.startswith("val") and "loss" in k and isinstance(v, Tensor) and v.numel() == 1
        }
        bad_metrics = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        local[0] = max(float(local[0]), float(bool(bad_metrics)))
        self._val_bad = self._val_first = None
        gathered = trainer.strategy.all_gather(local).reshape(-1, 2).tolist()
        bad_ranks = [r for r, (flag, _) in enumerate(gathered) if flag > 0]
        if not bad_ranks:
            return
        stop = self.stop_on_nonfinite_validation and not trainer.sanity_checking
        values = {"first_nonfinite_loss": {str(r): gathered[r][1] for r in bad_ranks}, "logged": bad_metrics}
        ctx = Engine.of(trainer).context(trainer, pl_module)
        self._write(ctx, rank=bad_ranks, what="nonfinite_val_loss", culprit=None, values=values, stopped=stop)
        message = (
            f"NonFiniteGuard: non-finite validation loss at step {trainer.global_step} on rank(s) {bad_ranks}"
            f"{' (' + ', '.join(bad_metrics) + ')' if bad_metrics else ''}."
        )
        if stop:
            trainer.should_stop = True
            message += " Training stops (`stop_on_nonfinite_validation=True`)."
        rank_zero_warn(f"{message}{self._events_note}")
