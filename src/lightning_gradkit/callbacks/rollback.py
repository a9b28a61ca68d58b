"""Roll a run back to a good state when a loss or gradient-norm spike persists, and step over the bad data.

Large-model teams do this by hand from disk checkpoints, hours later (PaLM, Chowdhery et al. 2022, section 5.1:
"we re-started training from a checkpoint roughly 100 steps before the spike started, and skipped roughly 200-500
data batches"; the OPT-175B and BLOOM logbooks describe the same). :class:`SpikeRollback` does it inside the run,
from snapshots in host memory, on every rank alike.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_gradkit._arguments import check_bool, check_choice, check_float, check_int
from lightning_gradkit.callbacks.loss_window import WatchesLossOrGradNorm, WindowLoss
from lightning_gradkit.core.running import RunningMoments, spike_decision
from lightning_gradkit.engine import Engine, GradKitCallback, Stage, StepPlan
from lightning_gradkit.events import EventLog, events_dir
from lightning_gradkit.replay import RNGState, capture_rng, restore_rng
from lightning_gradkit.snapshot import HostSnapshot, trained_parameters
from lightning_gradkit.strategy import GradKitStrategyMixin, gradkit_strategy_hint

__all__ = ["SpikeRollback"]


# How a snapshot came to be: at the start of training, every `snapshot_every_n_steps` steps, or at a resume from a
# checkpoint that held no snapshots (a state the uninterrupted run did not keep).
_Origin = Literal["start", "schedule", "resume"]


@dataclass
class _Slot:
    """One snapshot of the ring: tensors on the host, plus the small host-side states taken with them.

    Together they are the whole state a training step may change: parameters, optimizer state, module buffers
    (``tensors``), LR schedulers (``schedulers``) and the strategy's schedule counts (``strategy``), the RNG states,
    the gradkit callbacks' states (``callbacks``, ``stats``) and the engine's count of skipped steps (``skipped``).
    """

    tensors: HostSnapshot = field(default_factory=HostSnapshot)
    id: int = -1
    step: int = -1
    origin: _Origin = "schedule"
    schedulers: list[dict[str, Any]] = field(default_factory=list)
    strategy: dict[str, Any] = field(default_factory=dict)
    rng: RNGState | None = None
    callbacks: list[tuple[Callback, dict[str, Any]]] = field(default_factory=list)
    stats: dict[str, Tensor] = field(default_factory=dict)
    skipped: Tensor | None = None

    @property
    def valid(self) -> bool:
        return self.id >= 0

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
            "rng": _rng_state_dict(self.rng),
            "callbacks": {cb.state_key: state for cb, state in self.callbacks},
            "stats": self.stats,
            "skipped": None if self.skipped is None else float(self.skipped),
        }

    def load_state_dict(self, state: dict[str, Any], callbacks: dict[str, Callback], device: torch.device) -> None:
        """Adopt a :meth:`state_dict`; ``callbacks`` are the Trainer's stateful gradkit callbacks by ``state_key``."""
        self.id, self.step, self.origin = int(state["id"]), int(state["step"]), state["origin"]
        self.tensors.load_state_dict(state["tensors"])
        self.schedulers = list(state["schedulers"])
        self.strategy = dict(state["strategy"])
        self.rng = _rng_from_state_dict(state["rng"])
        self.callbacks = [(callbacks[key], value) for key, value in state["callbacks"].items() if key in callbacks]
        self.stats = dict(state["stats"])
        skipped = state["skipped"]
        self.skipped = None if skipped is None else torch.tensor(skipped, device=device)


@dataclass
class _Trigger:
    """What a step found, as device tensors (read to the host only when the step is skipped)."""

    fire: Tensor
    flagged: Tensor
    run: Tensor
    nonfinite_run: Tensor
    value: Tensor
    z: Tensor
    mean: Tensor
    std: Tensor


def _rng_state_dict(rng: RNGState) -> dict[str, Any]:
    """RNG states as values ``torch.load(weights_only=True)`` accepts (NumPy's key array as a list)."""
    numpy = None
    if rng.numpy is not None:
        name, keys, pos, has_gauss, cached = rng.numpy
        numpy = (name, [int(k) for k in keys], pos, has_gauss, cached)
    return {"torch_cpu": rng.torch_cpu, "torch_cuda": rng.torch_cuda, "python": rng.python, "numpy": numpy}


def _rng_from_state_dict(state: dict[str, Any]) -> RNGState:
    cuda = state["torch_cuda"] if torch.cuda.is_available() else None
    return RNGState(state["torch_cpu"], cuda, state["python"], state["numpy"])


class SpikeRollback(WatchesLossOrGradNorm):
    r"""When a loss or gradient-norm spike persists, restore the newest good snapshot and step over the bad data.

    **Snapshots.** After every ``snapshot_every_n_steps`` optimizer steps (``trainer.global_step`` a multiple of
    it, and at the start of training), the state is copied into a ring of ``keep`` snapshots in host memory. It is
    everything a training step may change: the parameters the optimizer trains, the module buffers (BatchNorm
    running statistics), the optimizer state (moments, step counts, hyperparameters), the LR schedulers'
    ``state_dict`` and the GradKit strategy's counts for their ``frequency`` (``gradkit_state_dict``), the
    torch/CUDA/Python/NumPy RNG states, the ``state_dict`` of the other stateful gradkit callbacks (e.g. the
    statistics of ``ZClip``, ``AutoClip``, ``SpikeGuard``; restored whole, so their counters rewind too, while the
    events they wrote stay), the count of skipped steps and this callback's own statistics. Other callbacks'
    states are not part of it. A snapshot is only taken after a step that applied its update and was not flagged
    (else at the next such step). On a GPU the host buffers are pinned, allocated once, and filled with
    ``non_blocking`` copies: the step does not wait for them. Under FSDP2 every rank copies its own shards. Host
    memory: ``keep`` x (trained parameters + optimizer state + buffers) per rank, e.g. about 6x the fp32 parameter
    bytes with Adam and ``keep=2``.

    **Trigger.** Each optimizer step the monitored value (the loss averaged over the accumulation window and the
    ranks, or the total gradient 2-norm) gets a z-score against NaN-masked running statistics on device, exactly
    as in :class:`~lightning_gradkit.SpikeGuard`: ``z > z_threshold`` after ``warmup_steps`` finite values is a
    spike, and the statistics are fed the value clamped to ``mean + z_threshold * std``. A step is *flagged* when
    it spikes or when the loss or the gradients are non-finite. A rollback fires after ``patience`` consecutive
    flagged steps, or after ``nonfinite_patience`` consecutive non-finite ones. The default 2 lets
    ``NonFiniteGuard(action="skip")`` cure a single bad batch by skipping it, and rolls back when skipping did
    not cure it (the next step is non-finite too). The values travel in the engine's single collective, so every
    rank takes the same decision.

    **Rollback.** The step that fires is not applied (the GradKit strategy skips it), then the newest snapshot
    taken before the spike began is restored bitwise, in place, and snapshots newer than it are dropped. The data
    stream is not rewound: the batches consumed since the snapshot are not replayed, and ``skip_batches`` more
    optimizer steps' batches are stepped over: they run forward and backward, their optimizer steps are skipped,
    and the buffers (BatchNorm running statistics included), RNG states and gradkit callback states they touched
    are restored from the snapshot after each, so the run continues as one that never saw them (their compute is
    spent, as with any skipped step); an LR scheduler with a ``frequency`` steps as in that run too. A rollback
    never restores the snapshot that the previous rollback restored (it takes the older one, or stops), and after
    ``max_rollbacks`` rollbacks the next trigger stops training with a ``RuntimeError``.

    ``skip_batches`` counts optimizer steps, each of ``accumulate_grad_batches`` batches per rank, *beyond* the
    rewound ones: a rollback leaves out ``rewound_steps + skip_batches`` optimizer steps' batches in all (the
    event's ``batches_skipped``). PaLM's "skipped roughly 200-500 data batches" counts both: its 200-500 include
    the ~100 batches between its restart checkpoint and the spike, and those of the spike itself, which here are
    the rewound steps. For the same total, set ``skip_batches`` to it less the steps a rollback rewinds (from
    ``patience`` to about ``snapshot_every_n_steps + patience``).

    ``trainer.global_step`` keeps counting attempted optimizer steps, as for any skipped step: the rewound and the
    stepped-over steps count, so ``max_steps`` and logging/checkpoint periods follow batches. The model, the
    optimizer's step counts and the LR schedule return to the snapshot's. ``gradkit/skipped_steps`` counts the
    attempted steps whose update the model does not hold: the skipped ones (the stepped-over ones included) and,
    at each rollback, its ``rewound_steps`` (the steps since the snapshot, the one that fired included), counted
    once even where a guard had skipped one of them. So ``global_step - skipped_steps`` stays the number of
    optimizer steps in the model, e.g. Adam's ``state[p]["step"]``, after any rollback.

    Every rollback is one event in ``gradkit_events.jsonl`` (``what="rollback"``, with ``from_step``, ``to_step``,
    ``rewound_steps``, ``skip_batches``, ``batches_skipped``, ``snapshot_origin`` and the trigger values), shown
    as a marker in the gradient report, and a warning.

    **Resume.** The callback's ``state_dict`` holds its statistics, counters, the count of skipped steps and the
    remaining batches to step over, so a run checkpointed after a rollback resumes exactly. With
    ``save_snapshots=True`` it holds the snapshot ring too, and a resumed run rolls back exactly as the
    uninterrupted one: to the same snapshot, also from a checkpoint saved inside a run of flagged steps. The cost is
    the checkpoint's size: it grows by :attr:`snapshot_bytes` (``keep`` snapshots of parameters, buffers and
    optimizer state), e.g. from 3x to 9x the fp32 parameter bytes with Adam and ``keep=2``. Not under FSDP/FSDP2
    with several ranks, where each rank's snapshots hold its own shards and Lightning saves callback states from
    rank 0 only. With ``save_snapshots=False`` (the default) a resumed run takes its first snapshot of the state it
    resumed from (``snapshot_origin="resume"``), and differs from the uninterrupted run exactly there: a rollback
    that the uninterrupted run would take to an older snapshot restores the resumed state instead when that is the
    newest one taken before the spike began, and a run resumed inside a run of flagged steps (no snapshot of it is
    from before the spike) restores the resumed state rather than stopping. The event's ``snapshot_origin`` is then
    ``"resume"`` and the warning says so. Snapshots are otherwise ``"start"`` (the start of training) or
    ``"schedule"``.

    **Why a callback of its own** rather than ``SpikeGuard(action="rollback")``: a rollback costs host memory
    (the snapshots) and periodic copies, which a guard that warns or skips does not, so it should be a separate,
    visible choice. It composes with the guards instead of replacing them: ``SpikeGuard(action="skip")`` skips a
    single bad batch at once, ``NonFiniteGuard(action="skip")`` skips a non-finite one, and ``SpikeRollback``
    acts only when skipping did not cure the run, with its own ``patience``, thresholds and budget.

    Cost: one host read of the step's skip flag (shared with the strategy's read, which an ordinary optimizer does
    anyway; with a fused optimizer, this read is the one host synchronization per step), a second read on skipped
    steps, one read of the step's flag when a snapshot is due, and the copies of a snapshot (the callbacks'
    ``state_dict`` calls synchronize once per snapshot). Needs a GradKit strategy and automatic optimization.

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

    Raises:
        ValueError: at construction, for an unknown ``monitor``, a non-finite or non-positive ``z_threshold``,
            ``alpha`` outside ``(0, 1)``, or an integer argument that is not an ``int`` or below its minimum; at
            setup, for a second ``SpikeRollback`` on the Trainer, or ``save_snapshots=True`` under FSDP/FSDP2 with
            several ranks.
        RuntimeError: at setup, on a strategy that cannot skip an optimizer step (the message names the GradKit
            strategy to use) or under manual optimization; during training, when a rollback fires after
            ``max_rollbacks`` rollbacks or finds no snapshot to restore.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import NonFiniteGuard, SpikeGuard, SpikeRollback
        >>> trainer = Trainer(
        ...     strategy="gradkit",
        ...     accelerator="cpu",
        ...     callbacks=[
        ...         NonFiniteGuard(action="skip"),
        ...         SpikeGuard("loss", action="skip"),
        ...         SpikeRollback("loss", patience=3, snapshot_every_n_steps=100, skip_batches=200),
        ...     ],
        ... )
    """

    _stage = Stage.GUARD

    def __init__(
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
        self._stats = RunningMoments(self.alpha)
        self._ring: list[_Slot] = []
        self._events: EventLog | None = None
        self._window_loss = WindowLoss()
        self._key = f"{self.state_key}/loss_sum"
        self._trigger: _Trigger | None = None
        self._pending: dict[str, Any] | None = None
        self._anchor: _Slot | None = None
        # Bookkeeping saved in checkpoints.
        self._run: Tensor | float = 0.0
        self._nonfinite_run: Tensor | float = 0.0
        self._skip_left = 0
        self._rollbacks = 0
        self._next_id = 0
        self._last_restored_id = -1
        self._next_snapshot_at: int | None = None
        self._history: list[dict[str, Any]] = []
        # From a checkpoint, adopted at the start of training.
        self._resumed = False
        self._saved_ring: list[dict[str, Any]] | None = None
        self._restored_skips: float | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(monitor=self.monitor)

    @property
    def rollbacks(self) -> int:
        """The number of rollbacks so far."""
        return self._rollbacks

    @property
    def snapshot_bytes(self) -> int:
        """Host memory held by this rank's snapshot buffers."""
        return sum(slot.tensors.nbytes for slot in self._ring)

    @property
    def events_path(self) -> Path | None:
        """The ``gradkit_events.jsonl`` file the rollbacks are written to (known after ``setup``)."""
        return self._events.path if self._events is not None else None

    # -- Lightning hooks ---------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        if not isinstance(trainer.strategy, GradKitStrategyMixin):
            raise RuntimeError(
                f"SpikeRollback skips the optimizer step that triggers a rollback, which needs a GradKit strategy, but "
                f"the Trainer uses {type(trainer.strategy).__name__}. Use {gradkit_strategy_hint(trainer.strategy)}."
            )
        if not pl_module.automatic_optimization:
            raise RuntimeError(
                "SpikeRollback needs automatic optimization (one optimizer step per batch that the GradKit strategy "
                "can skip), but the LightningModule sets `automatic_optimization = False`."
            )
        if any(isinstance(cb, SpikeRollback) and cb is not self for cb in trainer.callbacks):
            raise ValueError(
                "The Trainer has more than one SpikeRollback callback; each would restore its own snapshots. Keep one."
            )
        sharded = isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy)) and trainer.world_size > 1
        if self.save_snapshots and sharded:
            raise ValueError(
                f"SpikeRollback(save_snapshots=True) saves the snapshots in its checkpoint state, which Lightning "
                f"saves from rank 0 only, but under {type(trainer.strategy).__name__} every rank's snapshots hold its "
                "own shards. Use `save_snapshots=False`: a resumed run then takes its first snapshot at the resume."
            )
        self._events = EventLog(events_dir(trainer), rank=trainer.global_rank)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = pl_module.device
        self._stats.to(device)
        self._run = torch.tensor(float(self._run), device=device)
        self._nonfinite_run = torch.tensor(float(self._nonfinite_run), device=device)
        if self._restored_skips is not None:
            Engine.of(trainer).skipped_steps = torch.tensor(self._restored_skips, device=device)
            self._restored_skips = None
        self._ring = self._ring[: self.keep] + [_Slot() for _ in range(self.keep - len(self._ring))]
        for slot in self._ring:
            slot.id = -1
        self._pending = None
        saved, self._saved_ring = self._saved_ring, None
        resumed, self._resumed = self._resumed, False
        if saved:
            # The newest `keep` snapshots of the checkpoint: the ring of the uninterrupted run.
            callbacks = {cb.state_key: cb for cb in self._stateful(trainer)}
            newest = sorted(saved, key=lambda state: int(state["id"]), reverse=True)[: self.keep]
            for slot, state in zip(self._ring, newest, strict=False):
                slot.load_state_dict(state, callbacks, device)
        else:
            # No snapshots came with the run: the state it starts or resumes from is the first one.
            self._capture(trainer, pl_module, "resume" if resumed else "start")
        # While batches are still to be stepped over, the state to return to after each of them: the snapshot the
        # rollback restored (the newest: those after it were dropped, and none is taken while stepping over).
        self._anchor = max(self._ring, key=lambda s: s.id) if self._skip_left > 0 else None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # After the optimizer step (skipped or not) and the LR schedulers, before ModelCheckpoint (which Lightning
        # always calls last): a checkpoint saved at this batch holds the restored state.
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending["kind"] == "snapshot":
            self._capture(trainer, pl_module)
        elif pending["kind"] == "skip":
            assert self._anchor is not None
            self._restore(trainer, pl_module, self._anchor, full=False)
            self._skip_left -= 1
        else:
            self._roll_back(trainer, pl_module, pending)

    # -- engine steps ------------------------------------------------------------------------------------------
    def _needs_step_control(self) -> bool:
        return True

    def _decide(self, plan: StepPlan, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = plan.primary.total.device
        if self._skip_left > 0:
            # Stepping over a batch after a rollback: no statistics, no trigger; the strategy skips the step.
            plan.add_skip(torch.ones((), dtype=torch.bool, device=device))
            self._trigger = None
            return
        x = self._watched_value(plan)
        mean, var, count = self._stats.moments()
        spike, z, record, std = spike_decision(x, mean, var, count, self.z_threshold, self.warmup_steps)
        self._stats.update(record)
        nonfinite = ~torch.isfinite(x) | ~plan.primary.finite
        flagged = spike | nonfinite
        run = torch.where(flagged, self._run + 1, 0.0)
        nonfinite_run = torch.where(nonfinite, self._nonfinite_run + 1, 0.0)
        self._run, self._nonfinite_run = run, nonfinite_run
        fire = (run >= self.patience) | (nonfinite_run >= self.nonfinite_patience)
        plan.add_skip(fire)
        self._trigger = _Trigger(fire, flagged, run, nonfinite_run, x.float(), z, mean, std)

    def _observe(self, plan: StepPlan, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        t = self._trigger
        if t is None:
            self._pending = {"kind": "skip"}
            return
        if plan.skip_on_host() and bool(t.fire):
            run, nonfinite_run, value, z, mean, std = torch.stack(
                [t.run, t.nonfinite_run, t.value, t.z, t.mean, t.std]
            ).tolist()
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
            slot = self._choose(trainer, step, start, values)
            self._pending = {"kind": "rollback", "step": step, "start": start, "slot": slot, "values": values}
        elif step + 1 >= self._next_snapshot_at and not plan.skip_on_host() and not bool(t.flagged):
            self._pending = {"kind": "snapshot"}

    # -- snapshots ---------------------------------------------------------------------------------------------
    def _next_multiple(self, step: int) -> int:
        n = self.snapshot_every_n_steps
        return (step // n + 1) * n

    def _stateful(self, trainer: pl.Trainer) -> list[Callback]:
        """The other gradkit callbacks that keep a state (their own ``state_dict``)."""
        return [
            cb
            for cb in trainer.callbacks
            if isinstance(cb, GradKitCallback) and cb is not self and type(cb).state_dict is not Callback.state_dict
        ]

    def _capture(self, trainer: pl.Trainer, pl_module: pl.LightningModule, origin: _Origin = "schedule") -> _Slot:
        slot = min(self._ring, key=lambda s: s.id)  # an empty slot (id -1), else the oldest snapshot
        # The host-side states first: their `state_dict` calls read device values (a synchronization), which then
        # does not wait for the tensor copies queued below.
        slot.callbacks = [(cb, copy.deepcopy(cb.state_dict())) for cb in self._stateful(trainer)]
        slot.stats = copy.deepcopy(self._stats.state_dict())
        slot.schedulers = [copy.deepcopy(config.scheduler.state_dict()) for config in trainer.lr_scheduler_configs]
        slot.strategy = _gradkit_strategy(trainer).gradkit_state_dict()
        slot.rng = capture_rng(full=True)
        skipped = Engine.of(trainer).skipped_steps
        slot.skipped = None if skipped is None else skipped.clone()
        optimizers = trainer.optimizers
        slot.tensors.capture(trained_parameters(optimizers), list(pl_module.buffers()), optimizers)
        slot.id, slot.step, slot.origin = self._next_id, trainer.global_step, origin
        self._next_id += 1
        self._next_snapshot_at = self._next_multiple(trainer.global_step)
        return slot

    def _choose(self, trainer: pl.Trainer, step: int, start: int, values: dict[str, Any]) -> _Slot:
        """The newest snapshot taken before the spike began, not the one the previous rollback restored; failing
        that, the state of a resume inside the run of flagged steps (from a checkpoint without snapshots)."""
        if self._rollbacks >= self.max_rollbacks:
            self._stop(
                trainer,
                step,
                values,
                f"the budget of `max_rollbacks={self.max_rollbacks}` is spent. Look for the cause in the events "
                "(a learning rate too high, bad data), or raise `max_rollbacks`.",
            )
        usable = [s for s in self._ring if s.valid and s.id != self._last_restored_id]
        candidates = [s for s in usable if s.step <= start] or [s for s in usable if s.origin == "resume"]
        if not candidates:
            kept = sorted(s.step for s in self._ring if s.valid)
            self._stop(
                trainer,
                step,
                values,
                f"no snapshot is left to restore (snapshots at steps {kept}; the last rollback restored the newest "
                "good one already, and a rollback never restores the same snapshot twice in a row). Raise `keep` "
                "or `snapshot_every_n_steps`, or look for the cause in the events.",
            )
        return max(candidates, key=lambda s: s.id)

    def _stop(self, trainer: pl.Trainer, step: int, values: dict[str, Any], why: str) -> None:
        if self._events is not None:
            self._events.write(
                step=step,
                batch_idx=trainer.fit_loop.epoch_loop.batch_idx,
                rank=None,
                what="rollback_stopped",
                culprit=None,
                values=values,
                source=type(self).__name__,
                rollbacks=self._rollbacks,
            )
        raise RuntimeError(
            f"SpikeRollback: the {values['reason']} at step {step} persisted {values['consecutive']} step(s) "
            f"({self.monitor} {values['value']:.6g}, z {values['z']:.1f}), and cannot roll back: {why} "
            f"The step was not applied. Events: {self.events_path}."
        )

    def _restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule, slot: _Slot, full: bool) -> None:
        """Put back a snapshot: everything (``full``), or what a stepped-over batch may have touched."""
        buffers = list(pl_module.buffers())
        if full:
            optimizers = trainer.optimizers
            slot.tensors.restore(trained_parameters(optimizers), buffers, optimizers)
            for config, state in zip(trainer.lr_scheduler_configs, slot.schedulers, strict=True):
                config.scheduler.load_state_dict(copy.deepcopy(state))
            _gradkit_strategy(trainer).gradkit_load_state_dict(slot.strategy)
            self._stats.load_state_dict(copy.deepcopy(slot.stats))
        else:
            slot.tensors.restore_buffers(buffers)
        assert slot.rng is not None
        restore_rng(slot.rng)
        for cb, state in slot.callbacks:
            cb.load_state_dict(copy.deepcopy(state))

    def _roll_back(self, trainer: pl.Trainer, pl_module: pl.LightningModule, pending: dict[str, Any]) -> None:
        slot: _Slot = pending["slot"]
        self._restore(trainer, pl_module, slot, full=True)
        for other in self._ring:
            if other.id > slot.id:  # states of the abandoned stretch
                other.id = -1
        device = pl_module.device
        self._run = torch.zeros((), device=device)
        self._nonfinite_run = torch.zeros((), device=device)
        self._rollbacks += 1
        self._last_restored_id = slot.id
        self._anchor = slot
        self._skip_left = self.skip_batches
        self._next_snapshot_at = self._next_multiple(trainer.global_step + self.skip_batches)
        from_step = trainer.global_step
        # The rewound steps join the skipped ones: `global_step - skipped_steps` stays the optimizer's step count.
        rewound = torch.tensor(float(from_step - slot.step), device=device)
        engine = Engine.of(trainer)
        engine.skipped_steps = rewound if slot.skipped is None else slot.skipped + rewound
        record = {
            "step": pending["step"],
            "from_step": from_step,
            "to_step": slot.step,
            "spike_start": pending["start"],
            "rewound_steps": from_step - slot.step,
            "skip_batches": self.skip_batches,
            "batches_skipped": from_step - slot.step + self.skip_batches,
            "rollback": self._rollbacks,
            "snapshot_origin": slot.origin,
        }
        self._history.append(record)
        if self._events is not None:
            self._events.write(
                batch_idx=trainer.fit_loop.epoch_loop.batch_idx,
                rank=None,
                what="rollback",
                culprit=None,
                values=pending["values"],
                source=type(self).__name__,
                **record,
            )
        v = pending["values"]
        rank_zero_warn(
            f"SpikeRollback: {v['reason']} for {v['consecutive']} step(s) since step {pending['start']} "
            f"({self.monitor} {v['value']:.6g}, z {v['z']:.1f}); rolled back from step {from_step} to the snapshot "
            f"of step {slot.step} ({record['rewound_steps']} steps rewound) and stepping over {self.skip_batches} more "
            f"batch(es). Rollback {self._rollbacks} of at most {self.max_rollbacks}.{_resume_note(slot, pending)} "
            f"Events: {self.events_path}."
        )

    # -- state -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        engine = getattr(self, "_engine", None)
        skipped = self._restored_skips if engine is None or self._restored_skips is not None else engine.skipped_steps
        state = {
            "stats": self._stats.state_dict(),
            "run": float(self._run),
            "nonfinite_run": float(self._nonfinite_run),
            "skip_left": self._skip_left,
            "rollbacks": self._rollbacks,
            "next_id": self._next_id,
            "last_restored_id": self._last_restored_id,
            "next_snapshot_at": self._next_snapshot_at,
            "history": copy.deepcopy(self._history),
            "skipped_steps": float(skipped) if skipped is not None else 0.0,
        }
        if self.save_snapshots:
            state["snapshots"] = [slot.state_dict() for slot in self._ring if slot.valid]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._stats.load_state_dict(state_dict["stats"])
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


def _gradkit_strategy(trainer: pl.Trainer) -> GradKitStrategyMixin:
    strategy = trainer.strategy
    assert isinstance(strategy, GradKitStrategyMixin)  # checked at setup
    return strategy


def _resume_note(slot: _Slot, pending: dict[str, Any]) -> str:
    """What a rollback to a resume-time snapshot does differently from the uninterrupted run (empty otherwise)."""
    if slot.origin != "resume":
        return ""
    after = f", after the spike began at step {pending['start']}" if slot.step > pending["start"] else ""
    return (
        f" The snapshot is the state the run resumed from{after}: the checkpoint held no snapshots "
        "(`save_snapshots=True` keeps them), so this rollback may differ from the uninterrupted run's, which restores "
        "the newest snapshot of its schedule taken before the spike began."
    )
