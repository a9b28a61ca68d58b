"""The two guards as Lightning Trainer callbacks: the torch policies (:class:`gradkit.NonFiniteGuard`,
:class:`gradkit.SpikeGuard`) behind :class:`~lightning_gradkit.trainer_door.GradKitCallback`.

What is here is what only a Trainer has: the strategy checks at ``setup``, the batch that ``training_step`` replays
(kept at ``on_train_batch_start`` as the door's :class:`~gradkit.policies.culprit.MicroBatch`), ``NonFiniteGuard``'s
validation checks, and its checks under Lightning's ``DeepSpeedStrategy``.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch import Tensor
from torch.optim import Optimizer

import gradkit.policies.guards
import gradkit.policies.spike_guard
from gradkit.policies.culprit import MicroBatch, sample_ids
from gradkit.step.replay import capture_rng
from lightning_gradkit._deepspeed import SKIPPING_INSTEAD, deepspeed_step, refuse_under_deepspeed, uses_deepspeed
from lightning_gradkit._docstring import with_policy_docstring
from lightning_gradkit.strategy import GradKitStrategyMixin, gradkit_strategy_hint
from lightning_gradkit.trainer_door import GradKitCallback, TrainerPipeline

__all__ = ["NonFiniteGuard", "SpikeGuard", "training_step_batch"]


def _check_strategy(guard: NonFiniteGuard | SpikeGuard, trainer: pl.Trainer) -> None:
    """``action="skip"`` needs a strategy that can hold back an optimizer step (not DeepSpeed's)."""
    name = type(guard).__name__
    if guard.action == "skip":
        refuse_under_deepspeed(
            trainer,
            f"`{name}(action='skip')`",
            "no callback can hold back the DeepSpeed engine's optimizer step (Lightning calls `engine.step()` "
            "right after `on_before_optimizer_step`, and the engine steps, counts and zeroes the gradients inside "
            "it)",
            f"{SKIPPING_INSTEAD} Or use `action='warn'`/`'raise'`.",
        )
    if guard.action == "skip" and not isinstance(trainer.strategy, GradKitStrategyMixin):
        raise RuntimeError(
            f"{name}(action='skip') needs a strategy that can skip an optimizer step, but the "
            f"Trainer uses {type(trainer.strategy).__name__}. Use {gradkit_strategy_hint(trainer.strategy)}, "
            "or `action='warn'`/`'raise'`, which work with any strategy."
        )


def training_step_batch(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, replay: bool = True
) -> MicroBatch:
    """The Trainer's micro-batch for the culprit replay: ``training_step(batch, batch_idx)`` under the precision
    plugin's autocast, with the torch RNG state of now (call it before ``training_step``); or why it cannot replay.

    The LightningModule is called directly (not through the DDP wrapper): the replay issues no collective of its
    own, but ``training_step`` may (``self.all_gather``); every rank then replays the same micro-batches in order.

    Args:
        trainer: the running Trainer.
        pl_module: the LightningModule.
        batch: the batch as ``training_step`` receives it.
        batch_idx: its index.
        replay: keep what the replay needs (``False``: the batch's sample ids only).
    """
    ids = sample_ids(batch)
    if not replay:
        return MicroBatch(batch_idx, ids=ids)
    if isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy)):
        return MicroBatch(
            batch_idx, ids=ids, unavailable="sharded parameters: a replay would need the strategy's collectives"
        )
    if not pl_module.automatic_optimization:
        return MicroBatch(
            batch_idx, ids=ids, unavailable="manual optimization: the training step steps optimizers itself"
        )

    def compute_loss() -> Tensor | None:
        with trainer.precision_plugin.train_step_context():
            out = pl_module.training_step(batch, batch_idx)
        out = out.get("loss") if isinstance(out, dict) else out
        return out if isinstance(out, Tensor) else None

    return MicroBatch(batch_idx, compute_loss, capture_rng(full=False), ids)


@with_policy_docstring
class NonFiniteGuard(gradkit.NonFiniteGuard, GradKitCallback):
    r"""The Trainer callback of :class:`gradkit.NonFiniteGuard`: its docstring, then what follows.

    Behind the Trainer it replays ``training_step``, checks the validation losses (``check_validation``) and works
    under Lightning's ``DeepSpeedStrategy`` (``"warn"`` and ``"raise"``).

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import NonFiniteGuard
        >>> trainer = Trainer(strategy="gradkit", accelerator="cpu", callbacks=[NonFiniteGuard(action="skip")])
    """

    # Under DeepSpeed: the engine's step and skip counts at the last batch end, the flagged steps counted on device
    # (warn) and how many of them were reported.
    _deepspeed = False
    _ds_steps = _ds_skipped = _ds_reported = _ds_skipped_reported = 0
    _ds_flagged: Tensor | None = None
    _ds_warned_no_norm = False
    # Whether a batch of this validation run had a non-finite loss, and the first value of the first such batch.
    _val_bad: Tensor | None = None
    _val_first: Tensor | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._deepspeed = uses_deepspeed(trainer)
        if stage == "fit":
            _check_strategy(self, trainer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self._deepspeed or not self._reporter.keeps_micro_batches():  # nothing of the batch is needed
            return
        # A reference to the batch (no copy) and the torch RNG state, so a replay repeats its dropout masks. A fused
        # optimizer's skip is replayed one step late: the guard keeps the reference until then.
        replay = self.replay_allowed(trainer.global_step)
        ctx = TrainerPipeline.of(trainer).context(trainer, pl_module)
        ctx.micro_batch = training_step_batch(trainer, pl_module, batch, batch_idx, replay)

    # -- under DeepSpeed: the loss before its step, its global norm after -----------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._deepspeed:
            super().on_fit_start(trainer, pl_module)
            return
        self.attach(TrainerPipeline.of(trainer).context(trainer, pl_module), pl_module)
        step = deepspeed_step(trainer.strategy)
        self._ds_steps, self._ds_skipped = step.steps, step.skipped
        self._ds_flagged = None
        self._ds_reported = 0
        self._ds_skipped_reported = step.skipped

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if not self._deepspeed:
            super().on_before_optimizer_step(trainer, pl_module, optimizer)
        elif self.action == "raise" and self._loss_bad is not None and bool(self._loss_bad):
            self._deepspeed_flagged(
                trainer, pl_module, "loss", "DeepSpeed has not stepped: the parameters are unchanged."
            )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._deepspeed:
            self._check_deepspeed_step(trainer, pl_module)
        else:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            TrainerPipeline.of(trainer).context(
                trainer, pl_module
            ).micro_batch = None  # the batch is not kept past its step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._deepspeed:
            self._report_deepspeed(trainer, pl_module)
        else:
            super().on_train_end(trainer, pl_module)

    def _check_deepspeed_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After a DeepSpeed optimizer step: flag a non-finite loss of its window or a non-finite global norm.

        DeepSpeed's optimizers that measure the norm skip a step whose norm is not finite (``engine.skipped_steps``
        moves, the norm reads ``inf``); under fp16 that is the loss scaler's routine overflow and is not flagged for
        its gradients. ``raise`` reads the flag every step; ``warn`` counts on device and reports on logging steps.
        """
        step = deepspeed_step(trainer.strategy)
        if step.steps == self._ds_steps:  # inside an accumulation window: the loss flag waits for the step
            return
        skipped_by_deepspeed = step.skipped > self._ds_skipped
        self._ds_steps, self._ds_skipped = step.steps, step.skipped
        loss_bad = self._loss_bad
        self._forget_window()
        fp16 = str(trainer.precision_plugin.precision).startswith("16")
        grads_bad = None
        if self.check_grads and step.grad_norm is not None and not (skipped_by_deepspeed and fp16):
            grads_bad = ~torch.isfinite(step.grad_norm)
        elif self.check_grads and step.grad_norm is None and not self._ds_warned_no_norm:
            self._ds_warned_no_norm = True
            TrainerPipeline.of(trainer).context(trainer, pl_module).warn(
                "NonFiniteGuard: the DeepSpeed engine computed no global gradient norm (ZeRO stage 0 in full "
                "precision steps the torch optimizer directly), so only the loss is checked under this config."
            )
        flags = [f for f in (loss_bad, grads_bad) if f is not None]
        if not flags:
            return
        device = flags[0].device
        bad = torch.stack([f.to(device) for f in flags]).any()
        if self.action == "raise":
            if bool(bad):
                applied = "DeepSpeed skipped this step itself." if skipped_by_deepspeed else "DeepSpeed applied it."
                self._deepspeed_flagged(trainer, pl_module, "loss or global gradient norm", applied)
            return
        bad = bad.to(torch.float32)
        self._ds_flagged = bad if self._ds_flagged is None else self._ds_flagged + bad
        if self._context(trainer, pl_module).is_logging_step():
            self._report_deepspeed(trainer, pl_module)

    def _deepspeed_flagged(self, trainer: pl.Trainer, pl_module: pl.LightningModule, what: str, applied: str) -> None:
        """``action="raise"`` under DeepSpeed: record the event and raise."""
        ctx = TrainerPipeline.of(trainer).context(trainer, pl_module)
        self._reporter.write(ctx, rank=None, what="nonfinite", culprit=None, values={"deepspeed_step": self._ds_steps})
        raise RuntimeError(
            f"NonFiniteGuard: non-finite {what} at optimizer step {trainer.global_step} under DeepSpeed. {applied} "
            "Under DeepSpeed the guard checks each micro-batch's loss before the step and DeepSpeed's global norm "
            f"after it (no replay names the culprit module). {ctx.checkpoint_note()}. Events: {self.events_path}."
        )

    def _report_deepspeed(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``action="warn"`` under DeepSpeed: one host read of the device count; warn about new flagged steps."""
        if self._ds_flagged is None:
            return
        count = int(self._ds_flagged)
        new, self._ds_reported = count - self._ds_reported, count
        skipped, self._ds_skipped_reported = self._ds_skipped - self._ds_skipped_reported, self._ds_skipped
        if new > 0:
            ctx = TrainerPipeline.of(trainer).context(trainer, pl_module)
            self._reporter.write(ctx, rank=None, what="nonfinite", culprit=None, values={"flagged_steps": new})
            ctx.warn(
                f"NonFiniteGuard: {new} DeepSpeed optimizer step(s) up to step {trainer.global_step} had a non-finite "
                f"loss or global gradient norm. DeepSpeed skipped {skipped} step(s) itself since the last report "
                f"(its overflow check, `deepspeed/skipped_steps`) and applied the others. Events: {self.events_path}."
            )

    # -- validation: a non-finite validation loss, reported once per validation run ------------------------------
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
        # On device (no host sync): whether a batch was non-finite, and the first value of the first such batch.
        bad = ~torch.isfinite(loss.detach()).all()
        if self._val_bad is None:
            self._val_bad, self._val_first = bad, loss.detach().float().reshape(-1)[:1]
        else:
            self._val_first = torch.where(self._val_bad, self._val_first, loss.detach().float().reshape(-1)[:1])
            self._val_bad = self._val_bad | bad

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The ranks' findings gathered once (with the logged ``val*loss*`` metrics), then one event and one
        warning; training stops if asked to."""
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
        ctx = TrainerPipeline.of(trainer).context(trainer, pl_module)
        self._reporter.write(ctx, rank=bad_ranks, what="nonfinite_val_loss", culprit=None, values=values, stopped=stop)
        message = (
            f"NonFiniteGuard: non-finite validation loss at step {trainer.global_step} on rank(s) {bad_ranks}"
            f"{' (' + ', '.join(bad_metrics) + ')' if bad_metrics else ''}."
        )
        if stop:
            trainer.should_stop = True
            message += " Training stops (`stop_on_nonfinite_validation=True`)."
        TrainerPipeline.of(trainer).context(trainer, pl_module).warn(f"{message}{self._reporter.note}")


@with_policy_docstring
class SpikeGuard(gradkit.SpikeGuard, GradKitCallback):
    r"""The Trainer callback of :class:`gradkit.SpikeGuard`: its docstring, then what follows.

    ``action="skip"`` needs a GradKit strategy. Under Lightning's ``DeepSpeedStrategy`` it is refused at setup: it
    decides from the gradients in ``.grad``, which DeepSpeed keeps in its own buffers.

    Raises:
        RuntimeError: at setup, under ``DeepSpeedStrategy``.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import SpikeGuard
        >>> trainer = Trainer(strategy="gradkit", accelerator="cpu", callbacks=[SpikeGuard("loss", action="skip")])
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        skip = self.action == "skip"
        refuse_under_deepspeed(
            trainer,
            f"`SpikeGuard(monitor={self.monitor!r}, action={self.action!r})`",
            "it decides inside gradkit's per-step engine, before the optimizer steps, from the gradients in `.grad`; "
            "the DeepSpeed engine keeps the gradients in its own buffers (ZeRO) and steps in `engine.step()`, so that "
            "engine does not run" + (", and no callback can hold back DeepSpeed's step" if skip else ""),
            (
                f"DeepSpeed has no spike skip: {SKIPPING_INSTEAD}"
                if skip
                else "Watch the spikes in GradNormMonitor's `grad_norm/total` (DeepSpeed's global norm) instead."
            ),
        )
        _check_strategy(self, trainer)
