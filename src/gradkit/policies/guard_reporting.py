"""How a guard learns of a flagged step and reports it: at the step (a host read), or one step later, sync-free.

Both guards (:class:`~gradkit.NonFiniteGuard`, :class:`~gradkit.SpikeGuard`) decide on device,
in the pipeline's ``GUARD`` stage. What differs is when the host learns the decision:

- ``action="skip"`` with an ordinary optimizer: the door reads the step's skip flag once anyway; the guard shares
  that read and reads more only on a skipped step (to report it).
- ``action="raise"``: one host read per step, before the optimizer steps (the bad update is never applied).
- ``action="warn"``, and ``action="skip"`` with a fused optimizer (which skips on device through ``found_inf``):
  each step's flags reach the host one step later through a non-blocking copy
  (:class:`~gradkit.step.host_lag.HostLag`); the flagged steps are kept on the host (``NonFiniteGuard``'s
  :class:`Ledger`, ``SpikeGuard``'s list) and reported on logging steps (and at the end of training); the report
  covers every step flagged since the previous one.
- ``action="skip"`` with a fused optimizer is also replayed one step late (:meth:`Reporter.replays_late`): the skip
  left the parameters as they were, and the flag of step ``t`` reaches the host in step ``t + 1``'s pipeline,
  before step ``t + 1``'s optimizer step, so the parameters are still step ``t``'s. Step ``t``'s micro-batches are
  kept by reference (:class:`Kept`) until then, and replayed against the buffers of step ``t``'s window start.

In this file: :class:`Ledger` (the host record between two reports), :class:`Kept` (what a step keeps for it) and
:class:`Reporter` (what both guards compose: the event file, which of the ways applies, the saved count of skipped
steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from torch import Tensor

from gradkit._util.torch_compat import handles_found_inf
from gradkit.policies.culprit import MicroBatch
from gradkit.report.events import EventLog
from gradkit.step.accounting import StepAccounting
from gradkit.step.host_lag import HostLag
from gradkit.step.norms import GradStats
from gradkit.step.plan import StepOutcome
from gradkit.step.protocol import Door, StepContext, unwrapped

__all__ = ["Flagged", "Kept", "Ledger", "Period", "Reporter", "overflow_summary", "write_norm_overflow"]


class Ledger:
    """The steps a guard flagged between two reports, learnt on the host one step late: recording never
    synchronizes.

    Each step pushes its flags (a 1-D device tensor, the step's flag first) through a
    :class:`~gradkit.step.host_lag.HostLag` together with what to read if it turns out flagged (device
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

    def record(self, step: int, flags: Tensor, keep: Any = None) -> Flagged | None:
        """Note step ``step``'s ``flags`` (``flags[0] > 0``: flagged) and what to read on a flagged step; returns the
        previous step if its flags, now on the host, say it was flagged (:meth:`fold`)."""
        flagged = self.fold()
        self._lag.push(flags)
        self._pending = (step, keep)
        return flagged

    def fold(self) -> Flagged | None:
        """Take in the step whose flags are on their way to the host; return it if it was flagged."""
        values = self._lag.pop()
        if values is None or self._pending is None:
            return None
        (step, keep), self._pending = self._pending, None
        if not values[0] > 0:
            self._run = 0
            return None
        self._flagged.append((step, values, keep))
        if self._run == 0:
            self._run_first = step
        self._run += 1
        self._run_last = step
        if self._run >= self._longest[0]:
            self._longest = (self._run, self._run_first, step)
        return Flagged(step, values, keep)

    def read(self) -> Period | None:
        """The period's summary, then start a new period; ``None`` if nothing was flagged."""
        self.fold()
        flagged, self._flagged = self._flagged, []
        longest = self._longest
        # The next period's longest run starts as the run still going on (with its start, possibly before).
        self._longest = (self._run, self._run_first, self._run_last) if self._run else (0, -1, -1)
        if not flagged:
            return None
        step, flags, keep = flagged[0]
        return Period(len(flagged), step, flagged[-1][0], *longest, flags, keep)


class Flagged(NamedTuple):
    """A step whose flags reached the host and say it was flagged: its step, its flags, what it kept."""

    step: int
    flags: list[float]
    keep: Any


@dataclass
class Kept:
    """What ``NonFiniteGuard`` keeps of a step until its flags reach the host one step later, by reference: nothing
    is copied, so a clean step pays nothing for it.

    Attributes:
        param_norms: the step's per-parameter norms (a device vector), to name the first non-finite gradient.
        micro_batches: the step's micro-batches as the door kept them (where it is replayed late, within the replay
            budget): they hold the batch (its tensors), the closure that runs its forward again and the torch RNG
            state before it alive through the next step's forward and backward, then are let go.
        window: the step's micro-batch indices.
        ids: each micro-batch's sample ids, as the batch holds them (a device tensor stays there until reported).
        per_rank: after the late replay, every rank's finding (for :func:`~gradkit.policies.culprit.locate_culprit`).
    """

    param_norms: Tensor
    micro_batches: list[MicroBatch] = field(default_factory=list)
    window: list[int] = field(default_factory=list)
    ids: list[Any] = field(default_factory=list)
    per_rank: list[dict[str, Any]] | None = None


class Period(NamedTuple):
    """What :meth:`Ledger.read` found: the number of flagged steps, the first and last, the longest run of consecutive
    flagged steps with its first and last step, and the flags and kept values of the first flagged step."""

    count: int
    first: int
    last: int
    longest_run: int
    run_first: int
    run_last: int
    flags: list[float]
    keep: Any


class Reporter:
    """What a guard reports through: its event file, when it learns of a flagged step, the count of skipped steps.

    Args:
        source: the guard's class name (the events' ``source``).
        action: the guard's ``action``.
    """

    def __init__(self, source: str, action: str) -> None:
        self.source = source
        self.action = action
        self.events: EventLog | None = None
        self.fused = False
        self.restored_skips: float | None = None
        self._steps: StepAccounting | None = None

    def attach(self, ctx: Door) -> None:
        """The door is set up: open the event file, learn whether an optimizer skips on device, put back the saved
        count of skipped steps."""
        directory = ctx.log_dir
        self.events = EventLog(directory, rank=ctx.global_rank) if directory is not None else None
        self.fused = any(handles_found_inf(unwrapped(opt)) for opt in ctx.optimizers)
        self._steps = ctx.steps
        self.restore_skips(ctx)

    def restore_skips(self, ctx: StepContext) -> None:
        """Put back the count of skipped steps a checkpoint held: at ``attach``, and again before the first forward
        (a Trainer whose strategy restores checkpoints after setup, FSDP or DeepSpeed, loads the state later)."""
        if self.restored_skips is not None and self._steps is not None:  # the door's accounting, kept at `attach`
            self._steps.restore(self.restored_skips, ctx.device)
            self.restored_skips = None

    @property
    def path(self) -> Path | None:
        """The ``gradkit_events.jsonl`` file the guard writes to (known once the door is set up)."""
        return self.events.path if self.events is not None else None

    @property
    def note(self) -> str:
        """`` Events: <file>.`` for messages; where no event file is written (``GradKit(log_dir=False)``), how to get
        one."""
        if self.events is None:
            return " (No events file: pass GradKit(log_dir=...) to save the events.)"
        return f" Events: {self.events.path}."

    def write(self, ctx: StepContext, **fields: Any) -> None:
        """Append one event (``step`` and ``batch_idx`` default to the context's)."""
        if self.events is not None:
            fields.setdefault("step", ctx.global_step)
            fields.setdefault("batch_idx", ctx.batch_idx)
            self.events.write(source=self.source, action=self.action, **fields)

    def reads_on_host(self) -> bool:
        """Whether the guard learns of a flagged step at that step (else: one step later, on logging steps)."""
        return self.action == "raise" or (self.action == "skip" and not self.fused)

    def replays_late(self) -> bool:
        """Whether a flagged step is replayed when its flag reaches the host, one step late: a skip on device (a fused
        optimizer's ``found_inf``) left the parameters as the bad step had them, until the next optimizer step. A
        ``"warn"`` step was applied: its parameters are gone, so it is not replayed."""
        return self.action == "skip" and self.fused

    def keeps_micro_batches(self) -> bool:
        """Whether the door's micro-batches are kept for a replay: at the step, or one step late."""
        return self.reads_on_host() or self.replays_late()

    def flagged_on_host(self, outcome: StepOutcome, flag: Tensor, within_skip: bool = True) -> bool:
        """Read the guard's flag when it acts at the step; shares the door's read of the skip decision.

        ``within_skip``: the flag raised means the step is skipped, so a step the decision applies needs no read of
        the flag. Otherwise (a flag whose steps the GradScaler skips, not the decision) both are read in one transfer.
        """
        if self.action != "skip":
            return bool(flag)
        if within_skip:
            return outcome.skip_on_host() and bool(flag)
        return outcome.flag_on_host_with_skip(flag)

    def skipped_state(self) -> dict[str, float]:
        """The door's count of skipped steps, saved by every guard (all hold the same value)."""
        count = self._steps.skipped if self._steps is not None else None
        return {"skipped_steps": float(count) if count is not None else 0.0}


def overflow_summary(step: int, culprit: str | None, overflowed: list[str]) -> str:
    """The console line of a step flagged for a gradient norm overflow (every element finite, the norm inf).

    Example::

        >>> overflow_summary(5, None, [])
        "gradient norm overflow at step 5: every gradient element is finite, the norm past float32's range (inf)."
    """
    where = f"; largest in `{culprit}`" if culprit is not None else ""
    own = f", whose own norm overflowed ({len(overflowed)} parameter(s))" if overflowed else ""
    return (
        f"gradient norm overflow at step {step}: every gradient element is finite, the norm past float32's range "
        f"(inf){where}{own}."
    )


def write_norm_overflow(reporter: Reporter, ctx: StepContext, stats: GradStats, consecutive: int) -> str:
    """Write the event of a step flagged for a gradient norm overflow and return its console line: the culprit is the
    parameter with the largest norm, the event lists those whose own norm is inf (no replay: nothing non-finite)."""
    norms, names = stats.model_norms.cpu(), stats.model_names  # every stage's under pipeline parallelism
    overflowed = [names[i] for i in (norms == math.inf).nonzero().flatten().tolist()]
    culprit = names[int(norms.argmax())] if names else None
    reporter.write(
        ctx,
        rank=None,  # no rank's loss or elements were non-finite
        what="norm_overflow",
        culprit=culprit,
        culprit_source="gradients" if culprit is not None else None,
        reproducible=None,
        reproducible_reason="no replay: every gradient element was finite",
        values={"grad_norm": float(stats.total), "overflow_param_grads": overflowed[:50], "consecutive": consecutive},
    )
    return overflow_summary(ctx.global_step, culprit, overflowed)
