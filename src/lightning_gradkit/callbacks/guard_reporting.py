"""How a guard learns of a flagged step and reports it: at the step (a host read), or one step later, sync-free.

Both guards (:class:`~lightning_gradkit.NonFiniteGuard`, :class:`~lightning_gradkit.SpikeGuard`) decide on device,
in the engine's ``GUARD`` stage. What differs is when the host learns the decision:

- ``action="skip"`` with an ordinary optimizer: the strategy reads the step's skip flag once anyway; the guard
  shares that read and reads more only on a skipped step (to report it).
- ``action="raise"``: one host read per step, before the optimizer steps (the bad update is never applied).
- ``action="warn"``, and ``action="skip"`` with a fused optimizer (which skips on device through ``found_inf``):
  each step's flags reach the host one step later through a non-blocking copy
  (:class:`~gradkit.host_lag.HostLag`); the flagged steps are kept on the host (``NonFiniteGuard``'s
  :class:`_Ledger`, ``SpikeGuard``'s list) and reported on logging steps (and at the end of training); the report
  covers every step flagged since the previous one.

In this file: :class:`_Ledger` (the host record between two reports) and :class:`GuardBase` (the wiring both
guards share: the strategy check, the event log, which of the two ways applies, the saved count of skipped steps).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from gradkit.events import EventLog, EventWriter
from gradkit.host_lag import HostLag
from gradkit.protocol import StepContext, unwrapped
from lightning_gradkit._deepspeed import SKIPPING_INSTEAD, refuse_under_deepspeed
from lightning_gradkit.engine import Engine, GradKitCallback, Stage, StepPlan, events_dir
from lightning_gradkit.strategy import GradKitStrategyMixin, gradkit_strategy_hint, handles_found_inf

__all__ = ["GuardBase"]


class _Ledger:
    """The steps a guard flagged between two reports, learnt on the host one step late: recording never
    synchronizes.

    Each step pushes its flags (a 1-D device tensor, the step's flag first) through a
    :class:`~gradkit.host_lag.HostLag` together with what to read if it turns out flagged (device
    tensors, kept by reference: nothing is copied); the next step folds them in on the host. :meth:`read` (on logging
    steps and at the end of training, where waiting for the last step's copy is allowed) summarizes the period: the
    number of flagged steps, the first and last, the longest run of consecutive flagged steps with its first and last
    step (a run that goes on across reads keeps its start), and the flags and kept values of the first flagged step.
    """

    def __init__(self) -> None:
        self._lag = HostLag()
        self._pending: tuple[int, Any] | None = None
        self._flagged: list[tuple[int, list[float], Any]] = []
        self._run = 0  # the run of flagged steps going on, its first and last step, and the period's longest run
        self._run_first = -1
        self._run_last = -1
        self._longest = (0, -1, -1)

    def record(self, step: int, flags: Tensor, keep: Any = None) -> None:
        """Note step ``step``'s ``flags`` (``flags[0] > 0``: flagged) and what to read on a flagged step."""
        self.fold()
        self._lag.push(flags)
        self._pending = (step, keep)

    def fold(self) -> None:
        """Take in the step whose flags are on their way to the host."""
        values = self._lag.pop()
        if values is None or self._pending is None:
            return
        (step, keep), self._pending = self._pending, None
        if not values[0] > 0:
            self._run = 0
            return
        self._flagged.append((step, values, keep))
        if self._run == 0:
            self._run_first = step
        self._run += 1
        self._run_last = step
        if self._run >= self._longest[0]:
            self._longest = (self._run, self._run_first, step)

    def read(self) -> dict[str, Any] | None:
        """The period's summary (``count``, ``first``, ``last``, ``max_run``, ``max_run_first``, ``max_run_last``,
        ``flags`` and ``keep`` of the first flagged step), then start a new period; ``None`` if nothing was flagged."""
        self.fold()
        flagged, self._flagged = self._flagged, []
        longest = self._longest
        # The next period's longest run starts as the run still going on (with its start, possibly before).
        self._longest = (self._run, self._run_first, self._run_last) if self._run else (0, -1, -1)
        if not flagged:
            return None
        step, flags, keep = flagged[0]
        return {
            "count": len(flagged),
            "first": step,
            "last": flagged[-1][0],
            "max_run": longest[0],
            "max_run_first": longest[1],
            "max_run_last": longest[2],
            "flags": flags,
            "keep": keep,
        }


class GuardBase(EventWriter, GradKitCallback):
    """The wiring both guards share: the strategy check, the event log, host-read or ledger reporting.

    A subclass decides in ``decide`` and then either reads its flag at the step (``_reads_on_host()``: through
    ``_flagged_on_host``) or learns it one step late (``_ledger``, :class:`~gradkit.host_lag.HostLag`)
    and reports in ``_report_ledger`` on logging steps and at the end of training.
    """

    stage = Stage.GUARD

    def __init__(self, action: str) -> None:
        self.action = action
        self._events: EventLog | None = None
        self._ledger = _Ledger()
        self._fused = False
        self._restored_skips: float | None = None
        self._trainer_ref: pl.Trainer | None = None

    # -- Lightning hooks ---------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            self._refuse_deepspeed(trainer)
        if stage == "fit" and self.action == "skip" and not isinstance(trainer.strategy, GradKitStrategyMixin):
            raise RuntimeError(
                f"{type(self).__name__}(action='skip') needs a strategy that can skip an optimizer step, but the "
                f"Trainer uses {type(trainer.strategy).__name__}. Use {gradkit_strategy_hint(trainer.strategy)}, "
                "or `action='warn'`/`'raise'`, which work with any strategy."
            )
        self._open_events(events_dir(trainer), trainer.global_rank)
        self._trainer_ref = trainer

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(Engine.of(trainer).context(trainer, pl_module))
        if self._restored_skips is not None:
            engine = Engine.of(trainer)
            engine.skipped_steps = torch.tensor(self._restored_skips, device=pl_module.device)
            self._restored_skips = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.finish(Engine.of(trainer).context(trainer, pl_module))

    # -- outside a Trainer (the Fabric and plain-PyTorch door) ---------------------------------------------------
    def attach(self, ctx: StepContext, model: torch.nn.Module) -> None:
        self._open_events(ctx.log_dir, ctx.global_rank)
        self._start(ctx)

    def _start(self, ctx: StepContext) -> None:
        """Where training starts: which way the guard learns of a flagged step."""
        self._fused = any(handles_found_inf(unwrapped(opt)) for opt in ctx.optimizers)

    def finish(self, ctx: StepContext) -> None:
        if not self._reads_on_host():
            self._report_ledger(ctx)

    # -- shared helpers ----------------------------------------------------------------------------------------
    def _refuse_deepspeed(self, trainer: pl.Trainer) -> None:
        """Under DeepSpeed a guard cannot skip: the engine steps in ``engine.step()``, which no callback can hold."""
        if self.action == "skip":
            refuse_under_deepspeed(
                trainer,
                f"`{type(self).__name__}(action='skip')`",
                "no callback can hold back the DeepSpeed engine's optimizer step (Lightning calls `engine.step()` "
                "right after `on_before_optimizer_step`, and the engine steps, counts and zeroes the gradients inside "
                "it)",
                f"{SKIPPING_INSTEAD} Or use `action='warn'`/`'raise'`.",
            )

    def may_skip(self) -> bool:
        return self.action == "skip"

    def _reads_on_host(self) -> bool:
        """Whether this guard learns of a flagged step at that step (else: one step later, reported on logging
        steps)."""
        return self.action == "raise" or (self.action == "skip" and not self._fused)

    def _flagged_on_host(self, plan: StepPlan, flag: Tensor, within_skip: bool = True) -> bool:
        """Read this guard's flag when it acts at the step; shares the strategy's read of the skip decision.

        ``within_skip``: the flag raised means the step is skipped, so a step the plan applies needs no read of the
        flag. Otherwise (a flag whose steps the GradScaler skips, not the plan) both are read in one transfer.
        """
        if self.action != "skip":
            return bool(flag)
        if within_skip:
            return plan.skip_on_host() and bool(flag)
        return plan.flag_on_host_with_skip(flag)

    def _write(self, ctx: StepContext, **fields: Any) -> None:
        if self._events is not None:
            fields.setdefault("step", ctx.global_step)
            fields.setdefault("batch_idx", ctx.batch_idx)
            self._events.write(source=type(self).__name__, action=self.action, **fields)

    def _report_ledger(self, ctx: StepContext) -> None:
        """Lazy mode: read what was counted on device since the last read and report it."""

    def _skipped_state(self) -> dict[str, float]:
        """The engine's count of skipped steps, saved by every guard (all hold the same value)."""
        count = Engine.of(self._trainer_ref).skipped_steps if self._trainer_ref is not None else None
        return {"skipped_steps": float(count) if count is not None else 0.0}
