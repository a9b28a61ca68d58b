"""The Trainer callback of :class:`gradkit.GradNormMonitor`: its Lightning-only hooks."""

from __future__ import annotations

import inspect
import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.optim import Optimizer

import gradkit.policies.monitor
from lightning_gradkit._deepspeed import deepspeed_step, refuse_under_deepspeed, uses_deepspeed
from lightning_gradkit._docstring import with_policy_docstring
from lightning_gradkit.trainer_door import GradKitCallback, TrainerPipeline

__all__ = ["GradNormMonitor"]


@with_policy_docstring
class GradNormMonitor(gradkit.GradNormMonitor, GradKitCallback):
    r"""The Trainer callback of :class:`gradkit.GradNormMonitor`: its docstring, then what follows.

    Behind the Trainer the values go to ``trainer.loggers`` in one host transfer per logging step (not ``self.log``:
    it would re-send stale values off its period), a run shorter than the period gets a warning at train start, and
    the report is drawn after every callback's ``on_train_end`` (the guards' events). With ``noise_scale=True`` and no
    ``noise_scale_batch_size``, each rank counts the examples of its micro-batches per optimizer step in
    ``on_train_batch_start`` with Lightning's ``extract_batch_size`` (host metadata only).

    **Under Lightning's** ``DeepSpeedStrategy`` the DeepSpeed engine owns the step (see
    :mod:`lightning_gradkit._deepspeed`): after each DeepSpeed optimizer step (``engine.global_steps``) on logging
    steps, the monitor logs ``grad_norm/total``, DeepSpeed's global 2-norm after unscaling and before its
    ``gradient_clipping`` (``inf`` on a step it skipped; none, with one warning, under ZeRO stage 0 in full
    precision), and ``deepspeed/skipped_steps``, the steps DeepSpeed did not apply (fp16 overflow). A non-logging
    step reads two Python ints of the engine and nothing from the device. ``depth`` is not used; options other than
    their defaults (``norm_type=2``, ``param_groups``, ``weight_norms``, ``update_ratio``, ``report``, ``prog_bar``)
    are refused at setup.

    Raises:
        ValueError: at setup, for a second ``GradNormMonitor`` in the Trainer.
        RuntimeError: at setup, under ``DeepSpeedStrategy``, for an option other than its default (see above).
        ValueError: at a batch, with ``noise_scale=True`` and no ``noise_scale_batch_size``, if Lightning finds no
            tensor in it to count its examples.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import GradNormMonitor
        >>> trainer = Trainer(callbacks=[GradNormMonitor(param_groups=True, report=True)])
    """

    _counts_batches = True  # `on_train_batch_start` sees the batches: the noise scale's batch is counted
    # Under DeepSpeed: the engine's step count at the last batch end, and whether a missing norm was reported.
    _deepspeed = False
    _deepspeed_steps = 0
    _warned_no_deepspeed_norm = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        monitors = [cb for cb in trainer.callbacks if isinstance(cb, GradNormMonitor)]
        if len(monitors) > 1:
            raise ValueError(
                f"The Trainer has {len(monitors)} GradNormMonitor callbacks: each would log the same `grad_norm/*` "
                "keys. Keep exactly one and give it every option you need (`depth`, `param_groups`, `weight_norms`, "
                "`update_ratio`, `report`, `prog_bar`)."
            )
        self._deepspeed = uses_deepspeed(trainer)
        if self._deepspeed and stage == "fit":
            self._refuse_deepspeed_options(trainer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._deepspeed:
            self._first_pending = True
            self._deepspeed_steps = deepspeed_step(trainer.strategy).steps
            return
        super().on_fit_start(trainer, pl_module)
        if not trainer.loggers:  # no logs for the row order in `gradkit_run.json` to go next to
            self._metadata_dir = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        period = trainer.log_every_n_steps if self.log_every_n_steps is None else self.log_every_n_steps
        try:
            total = trainer.estimated_stepping_batches
        except MisconfigurationException:  # an accumulation schedule: no single estimate
            return
        if period and math.isfinite(total) and 0 < total < period:
            TrainerPipeline.of(trainer).context(trainer, pl_module).warn(
                f"GradNormMonitor: this run has {int(total)} optimizer step(s), fewer than the logging period of "
                f"{period} (`log_every_n_steps`, counted in optimizer steps): gradient norms are logged on the first "
                "and the last step only. Lower `Trainer(log_every_n_steps=...)` or "
                "`GradNormMonitor(log_every_n_steps=...)` to see more."
            )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self._noise is not None and self.noise_scale_batch_size is None:
            self._noise.count(_examples(batch), trainer.global_step)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if not self._deepspeed:  # DeepSpeed measures inside `engine.step()`, which comes after this hook
            super().on_before_optimizer_step(trainer, pl_module, optimizer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._deepspeed:
            self._log_deepspeed(trainer, pl_module)
        else:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Nothing here: the report waits for ``on_fit_end``, when every callback's ``on_train_end`` has run."""

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        path = self.finish(TrainerPipeline.of(trainer).context(trainer, pl_module))
        if path is not None:
            rank_zero_info(f"GradNormMonitor: gradient report written to {path}")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._drop_step_hooks()  # a fit that raised inside a logging step's batch
        self._before.clear()
        self.detach(TrainerPipeline.of(trainer).context(trainer, pl_module))  # the noise scale's hook on the DDP module

    # -- under DeepSpeed: the engine's own values, after its step -------------------------------------------------
    def _refuse_deepspeed_options(self, trainer: pl.Trainer) -> None:
        """Refuse the options DeepSpeed's one global 2-norm per step cannot serve: anything but their defaults."""
        defaults = inspect.signature(gradkit.GradNormMonitor).parameters
        names = ("norm_type", "param_groups", "weight_norms", "update_ratio", "report", "prog_bar", "noise_scale")
        for name in names:
            value, supported = getattr(self, name), defaults[name].default
            if value != supported:
                refuse_under_deepspeed(
                    trainer,
                    f"`GradNormMonitor({name}={value!r})`",
                    "under DeepSpeed the monitor logs what the DeepSpeed engine measures inside its step, one global "
                    "2-norm per optimizer step (`engine.get_global_grad_norm()`), since the gradients live in "
                    "DeepSpeed's own buffers (ZeRO)",
                    f"Leave `{name}={supported!r}` (the default): `grad_norm/total` and `deepspeed/skipped_steps` "
                    "are logged.",
                )

    def _log_deepspeed(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Log DeepSpeed's global norm and skipped steps after a DeepSpeed optimizer step, on logging steps only.

        Counted in DeepSpeed optimizer steps (``engine.global_steps``): with ``accumulate_grad_batches``, Lightning
        calls ``engine.step()`` after every micro-batch and DeepSpeed steps once per window. A non-logging step reads
        two Python ints of the engine and nothing from the device.
        """
        step = deepspeed_step(trainer.strategy)
        if step.steps == self._deepspeed_steps:  # inside an accumulation window: DeepSpeed did not step
            return
        self._deepspeed_steps = step.steps
        period = trainer.log_every_n_steps if self.log_every_n_steps is None else self.log_every_n_steps
        last = trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps
        if period == 0 or not (step.steps % period == 0 or self._first_pending or last or trainer.should_stop):
            return
        self._first_pending = False
        metrics: dict[str, float] = {}
        if step.grad_norm is not None:
            metrics["grad_norm/total"] = float(step.grad_norm)  # the one device read, on logging steps only
        elif not self._warned_no_deepspeed_norm:
            self._warned_no_deepspeed_norm = True
            TrainerPipeline.of(trainer).context(trainer, pl_module).warn(
                "GradNormMonitor: the DeepSpeed engine computed no global gradient norm "
                "(`engine.get_global_grad_norm()` is None), so `grad_norm/total` is not logged. DeepSpeed computes it "
                "under ZeRO stage 1-3 or with fp16/bf16; with ZeRO stage 0 in full precision it steps the torch "
                "optimizer directly and measures nothing."
            )
        metrics["deepspeed/skipped_steps"] = float(step.skipped)
        TrainerPipeline.of(trainer).context(trainer, pl_module).log_values(metrics)


def _examples(batch: Any) -> int:
    """The examples of a micro-batch, as Lightning's ``self.log`` infers a batch size (the first tensor's length).

    Raises:
        ValueError: Lightning finds no tensor in the batch.
    """
    try:
        return extract_batch_size(batch)
    except MisconfigurationException as err:
        raise ValueError(
            f"GradNormMonitor(noise_scale=True) counts each rank's examples per optimizer step from its batches, and "
            f"Lightning finds no tensor in this one (a {type(batch).__name__}): pass "
            "`GradNormMonitor(noise_scale_batch_size=...)`, the examples (or tokens) one rank trains on per optimizer "
            "step, every micro-batch together."
        ) from err
