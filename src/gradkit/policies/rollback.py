"""Roll a run back to a good state when a loss or gradient-norm spike persists, and step over the bad data.

Large-model teams do this by hand from disk checkpoints, hours later (PaLM, Chowdhery et al. 2022, section 5.1:
"we re-started training from a checkpoint roughly 100 steps before the spike started, and skipped roughly 200-500
data batches"; the OPT-175B and BLOOM logbooks describe the same). :class:`SpikeRollback` does it inside the run,
from snapshots in host memory (:class:`StepSnapshot`), on every rank alike, behind every door: a
``Trainer`` (``lightning_gradkit.SpikeRollback``), Fabric or a plain loop (:class:`~gradkit.GradKit`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from gradkit._util.arguments import check_bool, check_choice, check_float, check_int
from gradkit.policies.escalation import Escalation, FindingSink
from gradkit.report.events import EventLog
from gradkit.step.accounting import StepAccounting
from gradkit.step.norms import nonfinite_mask
from gradkit.step.plan import Decision, StepOutcome, StepStats
from gradkit.step.protocol import (
    Door,
    Roster,
    Stage,
    StatsRequest,
    StepContext,
    policy_key,
    served,
    state_key,
    unwrapped,
)
from gradkit.step.running import RunningMoments
from gradkit.step.snapshot import RNGState, Snapshot, capture_rng, restore_rng
from gradkit.step.watch import WatchedValue

__all__ = ["SpikeRollback", "StepSnapshot"]


# How a snapshot came to be: at the start of training, every `snapshot_every_n_steps` steps, or at a resume from a
# checkpoint that held no snapshots (a state the uninterrupted run did not keep).
_Origin = Literal["start", "schedule", "resume"]
_NO_EVENTS = " (No events file: pass GradKit(log_dir=...) to save the events.)"
# A spike that begins within this many steps trained from a restored state comes back "at once": the state's own loss
# (its first step) or its first update (the second step's loss) spikes, so the state may carry the fault. Later, the
# state trained cleanly first: the spike is a new occurrence of the fault, met from the newest snapshot before it.
_AT_ONCE = 2


class SpikeRollback:
    r"""When a loss or gradient-norm spike persists, restore the newest good snapshot and step over the bad data.

    **Snapshots.** At the start of training and after every ``snapshot_every_n_steps`` optimizer steps (a step that
    applied its update and was not flagged, else the next such step), everything a training step may change is
    copied into a ring of ``keep`` snapshots in host memory (:class:`StepSnapshot`): the trained
    parameters, the module buffers, the optimizer state, the LR schedulers and the GradKit strategy's counts for
    their ``frequency``, the RNG states, the ``state_dict`` of the other stateful gradkit policies (``ZClip``,
    ``SpikeGuard``: their counters rewind too, the events they wrote stay), the count of skipped steps and this
    policy's statistics. On a GPU the host buffers are pinned, allocated once and filled with ``non_blocking``
    copies; under FSDP2 every rank copies its own shards. Host memory: ``keep`` x (trained parameters + optimizer
    state + buffers) per rank, about 6x the fp32 parameter bytes with Adam and ``keep=2``.

    **Trigger.** Each optimizer step the monitored value (the loss averaged over the accumulation window and the
    ranks, or the total gradient 2-norm) gets a z-score against NaN-masked running statistics, as in
    :class:`~lightning_gradkit.SpikeGuard` with ``relative_floor=0`` (no floor on the rise): ``z > z_threshold``
    after ``warmup_steps`` finite values is a spike, and the statistics are fed the value clamped to
    ``mean + z_threshold * std``; the value of a step that was skipped (by this policy or another: ``SpikeGuard``,
    ``NonFiniteGuard``) is not fed at all, as if its batch never came (the step still counts as flagged, below).
    A step is *flagged* when it spikes or when the loss or the gradients are non-finite. A rollback fires after
    ``patience`` consecutive flagged steps, or after ``nonfinite_patience`` consecutive non-finite ones. The default 2
    lets ``NonFiniteGuard(action="skip")`` cure a single bad batch by skipping it, and rolls back when skipping did
    not cure it (the next step is non-finite too). The values travel in the engine's single collective, so every
    rank takes the same decision.

    **Rollback.** The step that fires is not applied (the door skips it), then the newest snapshot taken before the
    spike began is restored bitwise, in place, and snapshots newer than it are dropped. The data stream is not
    rewound, and ``skip_batches`` more optimizer steps' batches are stepped over: their steps are skipped (buffers
    put back by the door) and the RNG and policy states restored after each, so the run continues as one that never
    saw them (an LR scheduler with a ``frequency`` too). After ``max_rollbacks`` rollbacks the next trigger stops
    training with a ``RuntimeError``.

    **A recurring fault.** The run resumes from the restored state when the stepped-over batches end: that state
    counts from then on as the snapshot of that step (``to_step`` of a later rollback to it), so a later rollback
    rewinds only the steps trained since. A spike that comes back *at once* (it begins in the first two steps trained
    from the restored state: its loss, or its first update, spikes) says the state itself may carry the fault: the next
    rollback takes the snapshot before it, or the run stops when none is left. A spike that begins later met a state
    that trained cleanly: a fault that recurs (a bad stretch of data, a periodic learning-rate burst) is met from the
    newest snapshot before it, so such a rollback rewinds fewer than ``snapshot_every_n_steps + patience`` steps (more
    only while a due snapshot waits for a step that is not flagged), whatever the period of the fault. The trade-off:
    a state whose damage shows later than that is restored until ``max_rollbacks`` stops the run, unless an escalation
    changes the run from it.

    ``skip_batches`` counts optimizer steps *beyond* the rewound ones: a rollback leaves out ``rewound_steps +
    skip_batches`` steps' batches in all (the event's ``batches_skipped``). PaLM's "skipped roughly 200-500 data
    batches" counts both (the ~100 batches between its restart checkpoint and the spike included): for the same
    total, set ``skip_batches`` to it less the steps a rollback rewinds (``patience`` to about
    ``snapshot_every_n_steps + patience``).

    ``trainer.global_step`` keeps counting attempted optimizer steps (``max_steps`` and logging periods follow
    batches), while the model, the optimizer's step counts and the LR schedule return to the snapshot's.
    ``gradkit/skipped_steps`` counts the attempted steps whose update the model does not hold (skipped, stepped over,
    and each rollback's ``rewound_steps``, counted once), so ``global_step - skipped_steps`` stays the number of
    optimizer steps in the model, e.g. Adam's ``state[p]["step"]``.

    Every rollback is one event in ``gradkit_events.jsonl`` (``what="rollback"``, with ``from_step``, ``to_step``,
    ``rewound_steps``, ``skip_batches``, ``batches_skipped``, ``snapshot_origin`` and the trigger values), shown
    as a marker in the gradient report, and a warning.

    **Escalation** (off by default): a rollback that fires soon after the previous one also cuts the learning rate
    and/or resets optimizer moments, as PaLM, OPT, BLOOM and SPAM did; :mod:`gradkit.policies.escalation` says how. It
    cures a fault the restored state carries (a learning-rate schedule that the rollback rewinds into the fault again);
    on a fault that recurs on its own schedule a cut learning rate measured worse than none (``benchmarks/RESULTS.md``,
    issue 39), hence off. With an :class:`~gradkit.EscalationLadder` in the loop the ladder owns the escalation: each
    rollback is reported to it, its ``rollback`` rung rolls back through ``roll_back_now`` (counted in
    ``rollbacks``), and a trigger after ``max_rollbacks`` stops through its ``stop`` rung (its exit code) where it
    has one; the ladder's state is left out of the snapshots.

    **Resume.** The ``state_dict`` holds the statistics, counters, the count of skipped steps and the batches left to
    step over, so a run checkpointed after a rollback resumes exactly. With ``save_snapshots=True`` it holds the
    snapshot ring too (the checkpoint grows by :attr:`snapshot_bytes`, e.g. from 3x to 9x the fp32 parameter bytes
    with Adam and ``keep=2``), and a resumed run rolls back as the uninterrupted one, also from a checkpoint saved
    inside a run of flagged steps. With ``save_snapshots=False`` (the default) a resumed run takes its first snapshot
    of the state it resumed from (``snapshot_origin="resume"``, else ``"start"`` or ``"schedule"``) and differs from
    the uninterrupted run there only: a rollback restores that state where the uninterrupted run would take an older
    snapshot or stop, and the warning says so. With several ranks each rank's ring is its own (under FSDP2: its
    shards, buffers and RNG states), saved per rank in a distributed checkpoint (``torch.distributed.checkpoint``):
    ``GradKitModelParallelStrategy(save_distributed_checkpoint=True)`` behind the Trainer, ``kit.distributed_state()``
    in a loop of your own (:mod:`gradkit.doors.distributed_checkpoint`); such a checkpoint resumes on the same number
    of ranks only.

    Cost: one host read of the step's skip flag (shared with the strategy's read, which an ordinary optimizer does
    anyway; with a fused optimizer, this read is the one host synchronization per step), a second read on skipped
    steps, one read of the step's flag when a snapshot is due, and the copies of a snapshot (the callbacks'
    ``state_dict`` calls synchronize once per snapshot).

    Args:
        monitor: ``"loss"`` or ``"grad_norm"``.
        z_threshold: spike threshold in standard deviations (> 0).
        alpha: EMA decay of the running statistics, in ``(0, 1)``.
        warmup_steps: finite values seen before any spike decision (>= 2).
        patience: consecutive flagged steps that trigger a rollback (>= 1).
        nonfinite_patience: consecutive non-finite steps that trigger a rollback (>= 1).
        snapshot_every_n_steps: optimizer steps between snapshots (>= 1).
        keep: snapshots kept in host memory (>= 1).
        skip_batches: optimizer steps' batches stepped over after a rollback, beyond the rewound ones (>= 0).
        max_rollbacks: rollbacks allowed; the next trigger raises (>= 0).
        save_snapshots: keep the snapshot ring in checkpoints, so a resumed run rolls back as the uninterrupted one
            (see **Resume** for the size).
        escalate_lr_factor: on an escalation, multiply the learning rate by this factor in ``(0, 1)``, ramping back
            to the schedule (``None``: no cut).
        escalate_rewarmup_steps: applied optimizer steps over which the cut ramps back to 1 (>= 1).
        escalate_reset_moments: on an escalation, reset the optimizer state of ``"all"`` parameters, of the
            ``"spiking"`` modules, or ``"none"``.
        escalate_within_steps: a rollback escalates when it fires within this many optimizer steps after the end
            of the previous one (>= 1).

    Raises:
        ValueError: at construction, for an unknown ``monitor``, a non-finite or non-positive ``z_threshold``,
            ``alpha`` outside ``(0, 1)``, ``escalate_lr_factor`` outside ``(0, 1)``, an unknown
            ``escalate_reset_moments``, or an integer argument that is not an ``int`` or below its minimum; at
            ``attach``, for a second ``SpikeRollback`` in the loop.
        RuntimeError: during training, when a rollback fires after ``max_rollbacks`` rollbacks or finds no snapshot
            to restore.

    Example::

        >>> import torch
        >>> from gradkit import GradKit, SpikeRollback
        >>> model = torch.nn.Linear(4, 1)
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> rollback = SpikeRollback("loss", patience=3, snapshot_every_n_steps=100, skip_batches=200)
        >>> kit = GradKit(model, optimizer, [rollback], log_dir=None)
        >>> loss = model(torch.ones(2, 4)).square().mean()
        >>> loss.backward()
        >>> kit.note_loss(loss)
        >>> kit.step(optimizer)
        True
    """

    stage = Stage.GUARD

    def __init__(  # noqa: PLR0913 (a public constructor: one argument per documented option)
        self,
        monitor: Literal["loss", "grad_norm"] = "loss",
        z_threshold: float = 6.0,
        alpha: float = 0.97,
        warmup_steps: int = 25,
        patience: int = 3,
        nonfinite_patience: int = 2,
        snapshot_every_n_steps: int = 100,
        keep: int = 2,
        skip_batches: int = 0,
        max_rollbacks: int = 5,
        save_snapshots: bool = False,
        escalate_lr_factor: float | None = None,
        escalate_rewarmup_steps: int = 100,
        escalate_reset_moments: Literal["none", "all", "spiking"] = "none",
        escalate_within_steps: int = 1000,
    ) -> None:
        self.monitor = check_choice("monitor", monitor, ("loss", "grad_norm"))
        self.z_threshold = check_float(
            "z_threshold", z_threshold, above=0.0, hint="E.g. `z_threshold=6.0` (SpikeGuard's default)."
        )
        self.alpha = check_float("alpha", alpha, above=0.0, below=1.0, hint="E.g. `alpha=0.97`.")
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 2, hint="E.g. `warmup_steps=25`.")
        self.patience = check_int("patience", patience, 1, hint="Use 1 to roll back at the first spiking step.")
        self.nonfinite_patience = check_int(
            "nonfinite_patience", nonfinite_patience, 1, hint="Use 1 to roll back at the first non-finite step."
        )
        self.snapshot_every_n_steps = check_int(
            "snapshot_every_n_steps", snapshot_every_n_steps, 1, hint="E.g. `snapshot_every_n_steps=100`."
        )
        self.keep = check_int("keep", keep, 1, hint="Keep at least one snapshot, e.g. `keep=2`.")
        self.skip_batches = check_int("skip_batches", skip_batches, 0, hint="Use 0 to resume on the next batch.")
        self.max_rollbacks = check_int(
            "max_rollbacks", max_rollbacks, 0, hint="Use 0 to stop training at the first persistent spike."
        )
        self.save_snapshots = check_bool("save_snapshots", save_snapshots)
        self._escalation = Escalation(
            escalate_lr_factor,
            escalate_rewarmup_steps,
            escalate_reset_moments,
            escalate_within_steps,
            self.alpha,
            self.z_threshold,
            self.warmup_steps,
        )
        self.escalate_lr_factor = self._escalation.lr_factor
        self.escalate_rewarmup_steps = self._escalation.rewarmup_steps
        self.escalate_reset_moments = self._escalation.reset_moments
        self.escalate_within_steps = self._escalation.within_steps
        #: The loop's EscalationLadder, which hears of every rollback and of a stop (set by the ladder's ``attach``).
        self._ladder: FindingSink | None = None
        self._start_run_state()

    def _start_run_state(self) -> None:
        """What a run accumulates (statistics, the ring of snapshots, the bookkeeping saved in checkpoints): empty."""
        self._stats = RunningMoments(self.alpha)
        self._watch = WatchedValue(self.monitor, f"{self.state_key}/loss_sum")
        self._ring: list[StepSnapshot] = []
        self._events: EventLog | None = None
        self._events_note = ""
        self._steps: StepAccounting | None = None  # the loop's step accounting, whose count of skipped steps is saved
        self._door: Door | None = None
        self._starting = False
        # What the step found, on device (read to the host only when the step is skipped): whether it fires, whether it
        # is flagged, and the run lengths, value, z-score, mean and std.
        self._trigger: tuple[Tensor, Tensor, list[Tensor]] | None = None
        # The statistics before the step's value entered them (references: no copy), put back if the step is skipped.
        self._before_step: tuple[tuple[Tensor, ...], RunningMoments, tuple[Tensor, ...]] | None = None
        self._pending: dict[str, Any] | None = None
        # Bookkeeping saved in checkpoints.
        self._run: Tensor | float = 0.0
        self._nonfinite_run: Tensor | float = 0.0
        self._skip_left = 0
        self._rollbacks = 0
        self._next_id = 0
        self._last_restored_id = -1
        self._rolled_back_at: int | None = None  # the door's step count at the last rollback
        self._next_snapshot_at: int | None = None
        self._history: list[dict[str, Any]] = []
        # The end of the previous rollback (global step of its first trained step): when a spike comes back soon after.
        self._resumed_at: int | None = None
        # From a checkpoint, adopted at the start of training.
        self._resumed = False
        self._saved_ring: list[dict[str, Any]] | None = None
        self._restored_skips: float | None = None

    @property
    def state_key(self) -> str:
        return state_key(self, monitor=self.monitor)

    @property
    def rollbacks(self) -> int:
        """The number of rollbacks so far."""
        return self._rollbacks

    @property
    def snapshot_bytes(self) -> int:
        """Host memory held by this rank's snapshot buffers."""
        return sum(entry.tensors.nbytes for entry in self._ring)

    @property
    def events_path(self) -> Path | None:
        """The ``gradkit_events.jsonl`` file this policy writes to (known after ``attach``)."""
        return self._events.path if self._events is not None else None

    # -- the loop ----------------------------------------------------------------------------------------------
    def attach(self, ctx: Door, model: nn.Module) -> None:
        """The door is set up: the event file and the model's modules; the first snapshot waits for the start of
        training (``before_first_forward``): the weights may be loaded after the door is built or loaded."""
        if sum(isinstance(p, SpikeRollback) for p in ctx.policies()) > 1:
            where = ctx.policies_owner()
            raise ValueError(f"{where} more than one SpikeRollback; each would restore its own snapshots. Keep one.")
        self._events = EventLog(ctx.log_dir, rank=ctx.global_rank) if ctx.log_dir is not None else None
        self._events_note = f" Events: {self._events.path}." if self._events is not None else _NO_EVENTS
        self._steps = ctx.steps
        self._door = ctx  # the model, the LR schedulers, the other policies and the step state a snapshot holds
        self._escalation.read_model(model)
        self._starting = True

    def before_first_forward(self, ctx: StepContext) -> None:
        if self._starting:
            self._start(ctx)

    def _start(self, ctx: StepContext) -> None:
        """Where training starts or resumes: the statistics on the device, the LR hooks, the ring and its first
        snapshot (the state it starts or resumes from, unless the checkpoint held the ring)."""
        self._starting = False
        device = ctx.device
        self._stats.to(device)
        self._escalation.start(ctx)
        self._run = torch.tensor(float(self._run), device=device)
        self._nonfinite_run = torch.tensor(float(self._nonfinite_run), device=device)
        if self._restored_skips is not None:
            served(self._door, self).steps.restore(self._restored_skips, device)
            self._restored_skips = None
        self._ring = [StepSnapshot(Snapshot(served(self._door, self).model, host=True)) for _ in range(self.keep)]
        self._pending = None
        saved, self._saved_ring = self._saved_ring, None
        resumed, self._resumed = self._resumed, False
        if saved:
            # The newest `keep` snapshots of the checkpoint: the ring of the uninterrupted run.
            policies = {policy_key(p): p for p in self._stateful()}
            newest = sorted(saved, key=lambda state: int(state["id"]), reverse=True)[: self.keep]
            for entry, state in zip(self._ring, newest, strict=False):
                entry.load_state_dict(state, policies, device)
        else:
            # No snapshots came with the run: the state it starts or resumes from is the first one.
            self._capture(ctx, "resume" if resumed else "start")

    def note_loss(self, loss: Tensor, ctx: StepContext) -> None:
        self._watch.note_loss(loss)

    def after_step(self, ctx: StepContext) -> None:
        # After the optimizer step (skipped or not) and the LR schedulers, before a checkpoint of this batch (the
        # Trainer calls ModelCheckpoint last): a checkpoint saved at this batch holds the restored state.
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending["kind"] == "snapshot":
            self._capture(ctx)
        elif pending["kind"] == "skip":
            # A stepped-over batch: back to the snapshot the rollback restored (the newest: those after it were
            # dropped, and none is taken while stepping over).
            restored = max(self._ring, key=lambda s: s.id)
            restored.restore(served(self._door, self), full=False)
            self._skip_left -= 1
            if self._skip_left == 0:
                self._resume_from(restored, ctx)
        else:
            self._roll_back(ctx, pending)

    def finish(self, ctx: StepContext) -> None:
        self._escalation.remove_hooks()

    detach = finish  # `GradKit.close()`, also after an error: the learning-rate hooks leave the optimizers

    # -- the step's pipeline -----------------------------------------------------------------------------------
    def may_skip(self) -> bool:
        return True

    def request_stats(self, request: StatsRequest) -> None:
        self._watch.request_stats(request)
        if self.escalate_reset_moments == "spiking":
            request.norm_types.add(2.0)

    def reduce_request(self, ctx: StepContext) -> dict[str, Tensor]:
        return self._watch.reduce_request(ctx)

    def decide(self, stats: StepStats, decision: Decision, ctx: StepContext) -> None:
        if self._skip_left > 0:
            # Stepping over a batch after a rollback: no statistics, no trigger; the door skips the step.
            decision.add_skip(torch.ones((), dtype=torch.bool, device=stats.primary.total.device))
            self._trigger = None
            return
        x = self._watch.value(stats, decision)
        modules = self._escalation.module_stats
        self._before_step = (self._stats.moments(), modules, modules.moments())
        spike, z, mean, std = self._stats.spike_step(x, self.z_threshold, self.warmup_steps)
        # No loss handed over this window (no `note_loss` behind the loop door): the NaN stands for "no value", not
        # a non-finite loss; the statistics mask it either way.
        nonfinite = (nonfinite_mask(x) | ~stats.primary.finite) if self._watch.had_loss else ~stats.primary.finite
        flagged = spike | nonfinite
        run = torch.where(flagged, self._run + 1, 0.0)
        nonfinite_run = torch.where(nonfinite, self._nonfinite_run + 1, 0.0)
        self._run, self._nonfinite_run = run, nonfinite_run
        fire = (run >= self.patience) | (nonfinite_run >= self.nonfinite_patience)
        decision.add_skip(fire)
        if self.escalate_reset_moments == "spiking":
            self._escalation.track_modules(stats, decision, flagged)
        self._trigger = (fire, flagged, [run, nonfinite_run, x.float(), z, mean, std])

    def observe(self, stats: StepStats, outcome: StepOutcome, ctx: StepContext) -> None:
        step = ctx.global_step
        t = self._trigger
        self._escalation.step_factor = 1.0
        if t is None:
            self._pending = {"kind": "skip"}
            return
        if not outcome.skip_on_host():
            # An applied step: it takes the ramp's multiplier (set on the optimizer by the step pre-hook).
            self._escalation.step_applied()
        elif self._before_step is not None:
            # A skipped step (this policy's or another's) leaves the statistics as if its batch never came; it stays
            # in the run of flagged steps (a spike that other guards skip step after step still rolls back).
            (mean, var, count), modules, (m_mean, m_var, m_count) = self._before_step
            self._stats.mean, self._stats.var, self._stats.count = mean, var, count
            self._escalation.module_stats = modules
            modules.mean, modules.var, modules.count = m_mean, m_var, m_count
        self._before_step = None
        fire, flagged, read = t
        if outcome.skip_on_host() and bool(fire):
            run, nonfinite_run, value, z, mean, std = torch.stack(read).tolist()
            reason = "nonfinite" if nonfinite_run >= self.nonfinite_patience else "spike"
            start = step - int(run) + 1
            values = {
                "monitor": self.monitor,
                "reason": reason,
                "value": value,
                "z": z,
                "mean": mean,
                "std": std,
                "z_threshold": self.z_threshold,
                "consecutive": int(run),
                "nonfinite_consecutive": int(nonfinite_run),
            }
            escalate = self._escalation.escalates(step, self._resumed_at)
            entry = self._choose(ctx, step, start, values)
            # Read now: the rollback starts a new run of flagged steps.
            spiking = escalate and self.escalate_reset_moments == "spiking"
            self._pending = {
                "kind": "rollback",
                "step": step,
                "start": start,
                "slot": entry,
                "values": values,
                "escalate": escalate,
                "spiking": self._escalation.spiking_modules() if spiking else None,
            }
        elif step + 1 >= self._next_snapshot_at and not outcome.skip_on_host() and not bool(flagged):
            self._pending = {"kind": "snapshot"}

    # -- snapshots ---------------------------------------------------------------------------------------------
    def _next_multiple(self, step: int) -> int:
        n = self.snapshot_every_n_steps
        return (step // n + 1) * n

    def _stateful(self) -> list[Any]:
        """The loop's other policies that keep a state (``state_dict`` / ``load_state_dict``), but those whose state is
        the run's history rather than the model's (``survives_rollback``: the EscalationLadder's rung)."""
        hooks = Roster(served(self._door, self).policies())
        loads = set(map(id, hooks.loads_state))
        return [
            p
            for p in hooks.saves_state
            if p is not self and id(p) in loads and getattr(p, "survives_rollback", False) is not True
        ]

    def _capture(self, ctx: StepContext, origin: _Origin = "schedule") -> None:
        entry = min(self._ring, key=lambda s: s.id)  # an empty entry (id -1), else the oldest snapshot
        entry.capture(served(self._door, self), self._stateful(), self._stats_state())
        entry.id, entry.origin = self._next_id, origin
        self._next_id += 1
        self._next_snapshot_at = self._next_multiple(ctx.global_step)

    def _choose(self, ctx: StepContext, step: int, start: int, values: dict[str, Any]) -> StepSnapshot:
        """The newest snapshot taken before the spike began (else a resume's inside the run of flagged steps), or the
        one before it when the spike came back at once from it (the class docstring's **A recurring fault**)."""
        if self._rollbacks >= self.max_rollbacks:
            self._stop(
                ctx,
                step,
                values,
                f"the budget of `max_rollbacks={self.max_rollbacks}` is spent. Look for the cause in the events "
                "(a learning rate too high, bad data), or raise `max_rollbacks`.",
            )
        usable = [s for s in self._ring if s.valid]
        candidates = [s for s in usable if s.step <= start] or [s for s in usable if s.origin == "resume"]
        newest = max(candidates, key=lambda s: s.id, default=None)
        if newest is not None and newest.id == self._last_restored_id and start - newest.step < _AT_ONCE:
            # The previous rollback restored it and the run from it spiked at once: it may carry the fault.
            newest = max((s for s in candidates if s is not newest), key=lambda s: s.id, default=None)
        if newest is None:
            kept = sorted(s.step for s in usable)
            self._stop(
                ctx,
                step,
                values,
                f"no snapshot is left to restore (snapshots at steps {kept}; the spike came back within {_AT_ONCE} "
                "steps after the last rollback resumed from the newest: that state may carry the fault, so it is not "
                "restored again). Raise `keep`, or look for the cause in the events.",
            )
        return newest

    def _stop(self, ctx: StepContext, step: int, values: dict[str, Any], why: str) -> None:
        self._event(ctx, "rollback_stopped", values, step=step, rollbacks=self._rollbacks)
        if self._ladder is not None:  # the ladder's 'stop' rung ends the process with its exit code
            self._ladder.stop(f"SpikeRollback cannot roll back: {why}", source=type(self).__name__, step=step)
        raise RuntimeError(
            f"SpikeRollback: the {values['reason']} at step {step} persisted {values['consecutive']} step(s) "
            f"({self.monitor} {values['value']:.6g}, z {values['z']:.1f}), and cannot roll back: {why} "
            f"The step was not applied.{self._events_note}"
        )

    def _roll_back(self, ctx: StepContext, pending: dict[str, Any]) -> None:
        slot: StepSnapshot = pending["slot"]
        slot.restore(served(self._door, self), full=True)
        self._load_stats(copy.deepcopy(slot.stats))
        for other in self._ring:
            if other.id > slot.id:  # states of the abandoned stretch
                other.id = -1
        device = ctx.device
        self._run = torch.zeros((), device=device)
        self._nonfinite_run = torch.zeros((), device=device)
        self._escalation.module_zmax = None
        self._rollbacks += 1
        self._last_restored_id = slot.id
        self._rolled_back_at = ctx.global_step
        self._skip_left = self.skip_batches
        self._next_snapshot_at = self._next_multiple(ctx.global_step + self.skip_batches)
        from_step = ctx.global_step
        previous_end, self._resumed_at = self._resumed_at, from_step + self.skip_batches
        # The rewound steps join the skipped ones: `global_step - skipped_steps` stays the optimizer's step count.
        served(self._door, self).steps.rewind(slot.skipped, from_step - slot.step, device)
        record = {
            "step": pending["step"],
            "from_step": from_step,
            "to_step": slot.step,
            "spike_start": pending["start"],
            "rewound_steps": from_step - slot.step,
            "skip_batches": self.skip_batches,
            "batches_skipped": from_step - slot.step + self.skip_batches,
            "steps_to_skip": [[slot.step, from_step + self.skip_batches]],  # in `StepsToSkip(steps=...)`'s form
            "rollback": self._rollbacks,
            "snapshot_origin": slot.origin,
        }
        self._history.append(record)
        self._event(ctx, "rollback", pending["values"], **record)
        if pending["escalate"]:
            assert previous_end is not None
            self._escalate(ctx, pending, pending["step"] - previous_end, slot.step)
        v = pending["values"]
        if v["reason"] == "escalation_ladder":
            ctx.warn(
                f"SpikeRollback: the escalation ladder rolled back from step {from_step} to the snapshot of step "
                f"{slot.step} ({record['rewound_steps']} steps rewound) and steps over {self.skip_batches} more "
                f"batch(es): {v['ladder']}.{_resume_note(slot, pending)} {self._events_note}"
            )
        else:
            self._warn_rollback(ctx, pending, record)
            if self._ladder is not None:
                self._ladder.report(
                    f"SpikeRollback rolled back at step {pending['step']} ({v['reason']})", source=type(self).__name__
                )
        if self.skip_batches == 0:
            self._resume_from(slot, ctx)

    def _escalate(self, ctx: StepContext, pending: dict[str, Any], since: int, restored_step: int) -> None:
        """The spike came back ``since`` steps after the previous rollback: cut the learning rate and/or reset the
        optimizer moments of the restored state."""
        fields, actions = self._escalation.escalate(
            ctx, pending["spiking"], pending["step"], self._rollbacks, since, restored_step
        )
        self._event(ctx, "escalation", pending["values"], next(iter(fields["reset_modules"]), None), **fields)
        ctx.warn(
            f"SpikeRollback: the spike came back {since} step(s) after the previous rollback; escalating "
            f"(escalation {self._escalation.count}): {actions}.{self._events_note}"
        )

    def _warn_rollback(self, ctx: StepContext, pending: dict[str, Any], record: dict[str, Any]) -> None:
        v, slot, from_step = pending["values"], pending["slot"], record["from_step"]
        ctx.warn(
            f"SpikeRollback: {v['reason']} for {v['consecutive']} step(s) since step {pending['start']} "
            f"({self.monitor} {v['value']:.6g}, z {v['z']:.1f}); rolled back from step {from_step} to the snapshot "
            f"of step {slot.step} ({record['rewound_steps']} steps rewound) and stepping over {self.skip_batches} more "
            f"batch(es). Rollback {self._rollbacks} of at most {self.max_rollbacks}.{_resume_note(slot, pending)} "
            f"{self._events_note}"
        )

    def roll_back_now(self, ctx: StepContext, start: int, reason: str) -> bool:
        """Roll back at once, after a step (the EscalationLadder's ``rollback`` rung): restore the newest snapshot taken
        before step ``start`` (the ladder's first finding: the state that step trained from showed it), else the
        oldest kept, and step over ``skip_batches`` batches, as a rollback of its own does; counted in
        :attr:`rollbacks`.

        Returns:
            Whether it rolled back: not when this step rolls back already (its own trigger), while stepping over a
            rollback's batches (the state is a snapshot's), or before the first snapshot.
        """
        pending = self._pending or {}
        if self._skip_left > 0 or self._rolled_back_at == ctx.global_step or pending.get("kind") == "rollback":
            return False
        usable = [s for s in self._ring if s.valid]
        if not usable:
            return False
        before = [s for s in usable if s.step < start]
        slot = max(before, key=lambda s: s.id) if before else min(usable, key=lambda s: s.id)
        self._pending = None  # a snapshot due at this step would hold the state the rollback gives up
        values = {"reason": "escalation_ladder", "ladder": reason}
        step = ctx.global_step - 1  # the step just done
        rollback = {"step": step, "start": start, "slot": slot, "values": values, "escalate": False, "spiking": None}
        self._roll_back(ctx, rollback)
        return True

    def _resume_from(self, slot: StepSnapshot, ctx: StepContext) -> None:
        """The stepped-over batches are done: the run resumes from the restored state, which is the snapshot's, so the
        snapshot counts as taken here (a later rollback to it rewinds only the steps trained from now on)."""
        slot.step = ctx.global_step
        skipped = served(self._door, self).steps.skipped
        slot.skipped = None if skipped is None else skipped.clone()

    def _event(self, ctx: StepContext, what: str, values: dict[str, Any], culprit: Any = None, **fields: Any) -> None:
        """One event in the event file (when there is one), from rank 0."""
        if self._events is not None:
            head = {"batch_idx": ctx.batch_idx, "rank": None, "what": what, "culprit": culprit, "values": values}
            self._events.write(**head, source=type(self).__name__, **fields)

    def _stats_state(self) -> dict[str, Tensor]:
        """This callback's statistics: the trigger's, and the per-module ones of the "spiking" moment reset."""
        state = self._stats.state_dict()
        if self.escalate_reset_moments == "spiking":
            state.update({f"module_{k}": v for k, v in self._escalation.module_stats.state_dict().items()})
        return state

    def _load_stats(self, state: dict[str, Tensor]) -> None:
        self._stats.load_state_dict(state)
        if "module_mean" in state:
            self._escalation.module_stats.load_state_dict({k: state[f"module_{k}"] for k in ("mean", "var", "count")})

    # -- state ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        skipped = self._restored_skips
        if skipped is None and self._steps is not None:
            skipped = self._steps.skipped
        state = {
            "stats": self._stats_state(),
            "run": float(self._run),
            "nonfinite_run": float(self._nonfinite_run),
            "skip_left": self._skip_left,
            "rollbacks": self._rollbacks,
            "next_id": self._next_id,
            "last_restored_id": self._last_restored_id,
            "next_snapshot_at": self._next_snapshot_at,
            "history": copy.deepcopy(self._history),
            "skipped_steps": float(skipped) if skipped is not None else 0.0,
            "resumed_at": self._resumed_at,
            **self._escalation.state_dict(),
        }
        if self.save_snapshots:
            state["snapshots"] = [slot.state_dict() for slot in self._ring if slot.valid]
        return state

    def rank_local_keys(self) -> tuple[str, ...]:
        """``("snapshots",)`` with ``save_snapshots=True``: each rank's snapshots hold its own FSDP2 shards, module
        buffers and RNG states, so a distributed checkpoint saves each rank's ring (``GradKit.distributed_state()``,
        ``GradKitModelParallelStrategy``); the rest of the state is the same on every rank."""
        return ("snapshots",) if self.save_snapshots else ()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._load_stats(state_dict["stats"])
        self._resumed_at = state_dict.get("resumed_at")  # absent from older checkpoints: no escalation state
        self._escalation.load_state_dict(state_dict)
        self._run = float(state_dict["run"])
        self._nonfinite_run = float(state_dict["nonfinite_run"])
        self._skip_left = int(state_dict["skip_left"])
        self._rollbacks = int(state_dict["rollbacks"])
        self._next_id = int(state_dict["next_id"])
        self._last_restored_id = int(state_dict["last_restored_id"])
        self._next_snapshot_at = state_dict["next_snapshot_at"]
        self._history = copy.deepcopy(state_dict["history"])
        skipped = state_dict.get("skipped_steps")  # absent from older checkpoints: the guards' count stands
        self._restored_skips = None if skipped is None else float(skipped)
        self._saved_ring = state_dict.get("snapshots")
        self._resumed = True


def _resume_note(slot: StepSnapshot, pending: dict[str, Any]) -> str:
    """What a rollback to a resume-time snapshot does differently from the uninterrupted run (empty otherwise)."""
    if slot.origin != "resume":
        return ""
    after = f", after the spike began at step {pending['start']}" if slot.step > pending["start"] else ""
    return (
        f" The snapshot is the state the run resumed from{after}: the checkpoint held no snapshots "
        "(`save_snapshots=True` keeps them), so this rollback may differ from the uninterrupted run's, which restores "
        "the newest snapshot of its schedule taken before the spike began."
    )


# -- a step's whole state, as a snapshot of the ring holds it ------------------------------------------------------
@dataclass
class StepSnapshot:
    """Everything a training step may change, as the loop (a :class:`~gradkit.step.protocol.Door`) holds it.

    The model's buffers and the optimizers' parameters and states (``tensors``, in host memory: a
    :class:`~gradkit.step.snapshot.Snapshot`), the LR schedulers, the door's own step state (``strategy``: the GradKit
    strategy's schedule counts), the RNG states, the other policies' states (``callbacks``), the owner's statistics
    (``stats``) and the door's count of skipped steps (``skipped``). ``SpikeRollback`` keeps a ring of them (``id``:
    its order of capture, -1 for an empty one).
    """

    tensors: Snapshot
    id: int = -1
    step: int = -1
    origin: str = "schedule"
    schedulers: list[dict[str, Any]] = field(default_factory=list)
    strategy: dict[str, Any] = field(default_factory=dict)
    rng: RNGState | None = None
    callbacks: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)
    stats: dict[str, Tensor] = field(default_factory=dict)
    skipped: Tensor | None = None

    @property
    def valid(self) -> bool:
        return self.id >= 0

    def capture(self, ctx: Door, policies: Sequence[Any], stats: dict[str, Tensor]) -> None:
        """Take the step's state: ``policies`` are the other stateful policies (one whose state is empty has nothing
        to rewind), ``stats`` the owner's (copied)."""
        # The host-side states first: their `state_dict` calls read device values (a synchronization), which then
        # does not wait for the tensor copies queued below.
        states = [(policy, policy.state_dict()) for policy in policies]
        self.callbacks = [(policy, copy.deepcopy(state)) for policy, state in states if state]
        self.stats = copy.deepcopy(stats)
        self.schedulers = [copy.deepcopy(scheduler.state_dict()) for scheduler in ctx.schedulers()]
        self.strategy = ctx.step_state()
        self.rng = capture_rng(full=True)
        skipped = ctx.steps.skipped
        self.skipped = None if skipped is None else skipped.clone()
        self.tensors.capture([unwrapped(opt) for opt in ctx.optimizers])
        self.step = ctx.global_step

    def restore(self, ctx: Door, full: bool) -> None:
        """Put the state back: everything but ``stats`` and ``skipped`` (``full``), or what a stepped-over batch may
        have touched besides the module buffers, which the door puts back for every skipped step: the RNG states and
        the other policies' states."""
        if full:
            self.tensors.restore([unwrapped(opt) for opt in ctx.optimizers])
            for scheduler, state in zip(ctx.schedulers(), self.schedulers, strict=True):
                scheduler.load_state_dict(copy.deepcopy(state))
            ctx.load_step_state(self.strategy)
        assert self.rng is not None
        restore_rng(self.rng)
        for policy, state in self.callbacks:
            policy.load_state_dict(copy.deepcopy(state))

    def state_dict(self) -> dict[str, Any]:
        """Plain values and host tensors (they load with ``torch.load(weights_only=True)``); reads ``skipped``."""
        assert self.rng is not None
        return {
            "id": self.id,
            "step": self.step,
            "origin": self.origin,
            "tensors": self.tensors.state_dict(),
            "schedulers": self.schedulers,
            "strategy": self.strategy,
            "rng": self.rng.state_dict(),
            "callbacks": {policy_key(policy): state for policy, state in self.callbacks},
            "stats": self.stats,
            "skipped": None if self.skipped is None else float(self.skipped),
        }

    def load_state_dict(self, state: dict[str, Any], policies: dict[str, Any], device: torch.device) -> None:
        """Adopt a :meth:`state_dict`; ``policies`` are the other stateful policies by their
        :func:`~gradkit.step.protocol.policy_key`."""
        self.id, self.step, self.origin = int(state["id"]), int(state["step"]), state["origin"]
        self.tensors.load_state_dict(state["tensors"])
        self.schedulers = list(state["schedulers"])
        self.strategy = dict(state["strategy"])
        self.rng = RNGState.from_state_dict(state["rng"])
        self.callbacks = [(policies[key], value) for key, value in state["callbacks"].items() if key in policies]
        self.stats = dict(state["stats"])
        skipped = state["skipped"]
        self.skipped = None if skipped is None else torch.tensor(skipped, device=device)
