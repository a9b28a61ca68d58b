"""Roll a run back to a good state when a loss or gradient-norm spike persists, and step over the bad data.

Large-model teams do this by hand from disk checkpoints, hours later (PaLM, Chowdhery et al. 2022, section 5.1:
"we re-started training from a checkpoint roughly 100 steps before the spike started, and skipped roughly 200-500
data batches"; the OPT-175B and BLOOM logbooks describe the same). :class:`SpikeRollback` does it inside the run,
from snapshots in host memory, on every rank alike.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from gradkit._arguments import check_bool, check_choice, check_float, check_int, name_list
from gradkit.events import EventLog, EventWriter
from gradkit.monitor import auto_module_keys, module_rows, repeated_blocks
from gradkit.norms import ParamIndex, grouped_norms, host_to_device, local_tensor, nonfinite_mask
from gradkit.params import clean_name
from gradkit.protocol import StepContext, unwrapped
from gradkit.replay import RNGState, capture_rng, restore_rng
from gradkit.running import RunningMoments, spike_decision
from gradkit.snapshot import HostSnapshot, trained_parameters
from lightning_gradkit._deepspeed import refuse_under_deepspeed
from lightning_gradkit.callbacks.loss_window import WatchesLossOrGradNorm, WindowLoss
from lightning_gradkit.engine import Engine, GradKitCallback, Stage, StatsRequest, StepPlan, events_dir
from lightning_gradkit.strategy import GradKitStrategyMixin, gradkit_strategy_hint

__all__ = ["SpikeRollback", "reset_optimizer_state_", "rewarmup_factor"]


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


def rewarmup_factor(start: float, done: int, steps: int) -> float:
    """The learning-rate multiplier of the optimizer step that follows ``done`` applied steps since an escalation.

    Linear from ``start`` (the first step after the escalation) to 1 over ``steps`` optimizer steps, then 1.

    Example::

        >>> [rewarmup_factor(0.25, k, 3) for k in range(5)]
        [0.25, 0.5, 0.75, 1.0, 1.0]
    """
    if done >= steps:
        return 1.0
    return start + (1.0 - start) * done / steps


def reset_optimizer_state_(optimizer: Optimizer, params: Sequence[Tensor]) -> int:
    """Reset the optimizer state of ``params`` to what a fresh optimizer of the same class and param-group settings
    holds: the next step is then that optimizer's first step for these parameters.

    For torch's optimizers that initialize their state lazily at the first step (Adam, AdamW, NAdam, RAdam, Rprop,
    ASGD, SGD, ...), the parameter's state is removed and the optimizer builds it again at its next step, exactly as
    a fresh one does: NAdam's ``mu_product`` of 1, Rprop's ``step_size`` of ``lr``, ASGD's ``eta`` and ``mu``, no SGD
    momentum buffer (its first step takes the gradient whole, without ``dampening``), step counts of 0. Zeroing
    every tensor would not be a fresh state for these. An optimizer that builds its state in its constructor
    (Adagrad's ``sum`` of ``initial_accumulator_value``) gets the state a fresh instance builds, copied into the
    existing tensors in place. The fresh instance is constructed on a detached alias of the parameter (no copy of
    its values) with the param group's settings that its constructor accepts; an optimizer class that cannot be
    constructed so is reset to no state (the lazy initialization). A parameter without state is left as it is.

    Returns:
        The number of parameters whose state was reset.

    Example::

        >>> net = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.NAdam(net.parameters())
        >>> net(torch.ones(1, 2)).sum().backward()
        >>> opt.step()
        >>> reset_optimizer_state_(opt, [net.weight])
        1
        >>> dict(opt.state[net.weight]), sorted(opt.state[net.bias])
        ({}, ['exp_avg', 'exp_avg_sq', 'mu_product', 'step'])
    """
    groups = {id(q): group for group in optimizer.param_groups for q in group["params"]}
    count = 0
    for p in params:
        state = optimizer.state.get(p)
        if not state:
            continue
        fresh = _fresh_state(optimizer, p, groups[id(p)])
        if not fresh:
            del optimizer.state[p]
        else:
            for key in [k for k in state if k not in fresh]:
                del state[key]
            for key, value in fresh.items():
                old = state.get(key)
                if isinstance(old, Tensor) and isinstance(value, Tensor) and _same_layout(old, value):
                    local_tensor(old).copy_(local_tensor(value))  # in place: references to the state stay valid
                else:
                    state[key] = value
        count += 1
    return count


def _fresh_state(optimizer: Optimizer, p: Tensor, group: dict[str, Any]) -> dict[str, Any]:
    """The state a fresh optimizer of ``optimizer``'s class and ``group``'s settings holds for ``p`` before its first
    step: empty for a lazily initialized optimizer."""
    cls = type(optimizer)
    signature = inspect.signature(cls.__init__).parameters
    any_keyword = any(arg.kind is inspect.Parameter.VAR_KEYWORD for arg in signature.values())
    # Not every key of a param group is a constructor argument: an LR scheduler adds `initial_lr`.
    accepted = set(signature) | (set(optimizer.defaults) if any_keyword else set())
    settings = {k: v for k, v in group.items() if k != "params" and k in accepted}
    alias = p.detach()  # shares the parameter's storage: constructors only read it
    try:
        fresh = cls([alias], **settings)
    except (TypeError, ValueError):
        return {}
    return dict(fresh.state.get(alias, {}))


def _same_layout(a: Tensor, b: Tensor) -> bool:
    la, lb = local_tensor(a), local_tensor(b)
    return la.shape == lb.shape and la.dtype == lb.dtype and la.device == lb.device


def _scale_lrs(optimizer: Optimizer, factor: float) -> list[Any]:
    """Multiply every param group's ``lr`` by ``factor``; returns the values to put back (a tensor ``lr`` in place)."""
    saved: list[Any] = []
    for group in optimizer.param_groups:
        lr = group["lr"]
        if isinstance(lr, Tensor):
            saved.append(lr.clone())
            lr.mul_(factor)
        else:
            saved.append(lr)
            group["lr"] = lr * factor
    return saved


def _put_back_lrs(optimizer: Optimizer, saved: list[Any]) -> None:
    for group, lr in zip(optimizer.param_groups, saved, strict=True):
        if isinstance(lr, Tensor):
            group["lr"].copy_(lr)
        else:
            group["lr"] = lr


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


class SpikeRollback(WatchesLossOrGradNorm, EventWriter):
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
    the buffers they wrote (BatchNorm running statistics included) are put back as for any skipped step (by the
    strategy), and the RNG states and gradkit callback states are restored from the snapshot after each, so the
    run continues as one that never saw them (their compute is
    spent, as with any skipped step); an LR scheduler with a ``frequency`` steps as in that run too. After
    ``max_rollbacks`` rollbacks the next trigger stops training with a ``RuntimeError``.

    **The same snapshot twice.** A rollback restores the snapshot the previous rollback restored again only when the
    run from it got further than the time before: its flagged steps began more steps after the previous rollback's
    resume point (after its stepped-over batches) than the previous spike began after that snapshot (or after the
    resume that restored it). A spike that comes back as soon or sooner suggests that the state itself carries the
    fault (a snapshot taken after the damage was done, before it showed): the rollback takes the older snapshot
    instead, or stops when none is left (an escalating rollback, below, may restore the same one: its run from it
    differs). A spike that comes back later is a new occurrence: a fault that recurs (a bad stretch of data, a
    periodic learning-rate burst) is met from the newest snapshot taken before it, instead of throwing the run back
    one snapshot further per occurrence (to the start of training with ``keep=2``). The trade-off: a fault that
    recurs sooner after each restore than the first time is treated as carried by the state, and a state whose
    damage shows later after each restore is restored again until ``max_rollbacks`` stops the run;
    ``escalate_lr_factor`` damps a recurring fault.

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

    **Escalation** (off by default). When a spike comes back after a rollback, rolling back again the same way
    meets it again: PaLM, OPT and BLOOM restarted with a lower learning rate after persistent spikes, and SPAM
    (Huang et al., 2025, "SPAM: Spike-Aware Adam with Momentum Reset") resets the Adam moments. A spike *comes back*
    when a rollback fires within ``escalate_within_steps`` optimizer steps (``trainer.global_step``) after the end of
    the previous rollback, i.e. after its last stepped-over batch (``from_step + skip_batches`` of its event). That
    rollback *escalates*: after restoring the snapshot (it may restore the same one as the previous rollback: the
    run from it now differs), it

    - cuts the learning rate (``escalate_lr_factor``): the optimizer steps with ``lr * f`` in every param group,
      where ``lr`` is what the LR scheduler set and ``f`` ramps linearly from the factor back to 1 over
      ``escalate_rewarmup_steps`` applied optimizer steps (skipped steps do not count): :func:`rewarmup_factor`.
      The factor is applied inside ``optimizer.step`` (a step pre-hook) and the scheduler's value put back after it
      (a post-hook), so any scheduler composes with it, chainable ones included, and the param groups (a checkpoint,
      ``LearningRateMonitor``) hold the schedule's value. An escalation during a ramp compounds: it starts from the
      factor times the ramp's current multiplier;
    - resets the optimizer moments (``escalate_reset_moments``) of the restored state: ``"all"`` parameters, or
      the ``"spiking"`` modules: every optimizer step, the gradient 2-norm of each module (the rows of
      ``GradNormMonitor(depth="auto")``: one per repeated block, plus the other top-level modules) gets a z-score
      against its own running statistics (the EMA, ``alpha`` and ``warmup_steps`` of the trigger); a module spikes
      when its largest z-score over the run of flagged steps that fired exceeds ``z_threshold`` or its norm is
      non-finite; when none does, the module with the largest z-score. Those parameters' optimizer state becomes
      what a fresh optimizer of the same class and param-group settings holds (:func:`reset_optimizer_state_`): for
      Adam, no state, so the next step builds zero moments and a step count of 0; NAdam, Rprop, ASGD, SGD with
      momentum and Adagrad likewise restart exactly as fresh (for those parameters ``global_step - skipped_steps`` is
      then no longer the step count).

    Each escalation is an event (``what="escalation"``, with ``lr_factor``, the multiplier of the next optimizer
    step, ``rewarmup_steps``, ``reset_moments``, ``reset_modules`` and their ``module_z``, ``reset_params``, the
    ``rollback`` it belongs to and ``steps_since_previous``), a marker in the gradient report and a warning. Its
    state (the ramp, the module statistics) is saved in checkpoints and is the same on every rank.

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

    stage = Stage.GUARD

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
        self.escalate_lr_factor = (
            None
            if escalate_lr_factor is None
            else check_float(
                "escalate_lr_factor",
                escalate_lr_factor,
                above=0.0,
                below=1.0,
                hint="E.g. `escalate_lr_factor=0.5` halves the learning rate; None (default) leaves it as scheduled.",
            )
        )
        self.escalate_rewarmup_steps = check_int(
            "escalate_rewarmup_steps",
            escalate_rewarmup_steps,
            1,
            hint="E.g. `escalate_rewarmup_steps=100`: the cut learning rate is back on schedule 100 steps later.",
        )
        self.escalate_reset_moments = check_choice(
            "escalate_reset_moments", escalate_reset_moments, ("none", "all", "spiking")
        )
        self.escalate_within_steps = check_int(
            "escalate_within_steps",
            escalate_within_steps,
            1,
            hint="E.g. `escalate_within_steps=1000`: a rollback within 1000 steps of the previous one escalates.",
        )
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
        # Steps from the last restored snapshot (or the resume from it) to the start of the spike that restored it.
        self._reach: int | None = None
        self._next_snapshot_at: int | None = None
        self._history: list[dict[str, Any]] = []
        # Escalation: the end of the previous rollback (global step of its first trained step), the LR ramp and the
        # per-module statistics of the "spiking" moment reset.
        self._resumed_at: int | None = None
        self._capture_pending: _Origin | None = None
        self._escalations = 0
        self._ramp_start = 1.0
        self._ramp_done = 0
        self._module_stats = RunningMoments(self.alpha)
        self._module_zmax: Tensor | None = None
        # Per step, host only: the multiplier of this step's learning rate, and the schedule's values to put back.
        self._step_factor = 1.0
        self._saved_lrs: list[Any] | None = None
        self._hooks: list[RemovableHandle] = []
        self._blocks: list[str] = []
        self._model_order: list[str] = []
        self._rows: tuple[ParamIndex, list[str], Tensor] | None = None
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

    # -- Lightning hooks ---------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        refuse_under_deepspeed(
            trainer,
            "`SpikeRollback(...)`",
            "it restores the parameters and optimizer state from a snapshot and skips the triggering step, but the "
            "DeepSpeed engine owns the optimizer state (partitioned under ZeRO) and its step",
            "DeepSpeed has no rollback (no config key does it). Save checkpoints (`ModelCheckpoint(every_n_train_steps="
            "...)`) and resume from the last good one with `trainer.fit(..., ckpt_path=...)`.",
        )
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
        self._open_events(events_dir(trainer), trainer.global_rank)
        self._read_model(pl_module)

    def _read_model(self, model: torch.nn.Module) -> None:
        """For ``escalate_reset_moments="spiking"``: the rows of ``GradNormMonitor(depth="auto")``, named as the
        engine cleans the parameter names."""
        if self.escalate_reset_moments == "spiking":
            self._model_order = [clean_name(n) for n, _ in model.named_parameters()]
            self._blocks = repeated_blocks((clean_name(n), m) for n, m in model.named_modules())
            self._rows = None

    def attach(self, ctx: StepContext, model: torch.nn.Module) -> None:
        # The Fabric / plain-PyTorch door: what `setup` and `on_train_start` do under a Trainer.
        if sum(isinstance(p, SpikeRollback) for p in ctx.policies()) > 1:
            raise ValueError("`policies` holds more than one SpikeRollback; each would restore its own snapshots.")
        self._open_events(ctx.log_dir, ctx.global_rank)
        self._engine = ctx.pipeline  # whose skip count the state saves
        self._read_model(model)
        # The first snapshot waits for the first forward (`before_first_forward`): the model's weights may be loaded
        # after `GradKit(...)` or `kit.load_state_dict(...)`, and the snapshot must hold them.
        self._start(ctx, capture=False)

    def before_first_forward(self, ctx: StepContext) -> None:
        if self._capture_pending is not None:
            origin, self._capture_pending = self._capture_pending, None
            self._capture(ctx, origin)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(Engine.of(trainer).context(trainer, pl_module))

    def _start(self, ctx: StepContext, capture: bool = True) -> None:
        """Where training starts or resumes: the statistics on the device, the LR hooks, the first snapshot (now,
        or with ``capture=False`` at ``before_first_forward``)."""
        device = ctx.device
        self._stats.to(device)
        self._module_stats.to(device)
        if self._module_zmax is not None:
            self._module_zmax = self._module_zmax.to(device)
        self._remove_hooks()
        if self.escalate_lr_factor is not None:
            for optimizer in ctx.optimizers:
                optimizer = unwrapped(optimizer)
                self._hooks.append(optimizer.register_step_pre_hook(self._cut_lr))
                self._hooks.append(optimizer.register_step_post_hook(self._restore_lr))
        self._run = torch.tensor(float(self._run), device=device)
        self._nonfinite_run = torch.tensor(float(self._nonfinite_run), device=device)
        if self._restored_skips is not None:
            ctx.pipeline.skipped_steps = torch.tensor(self._restored_skips, device=device)
            self._restored_skips = None
        self._ring = self._ring[: self.keep] + [_Slot() for _ in range(self.keep - len(self._ring))]
        for slot in self._ring:
            slot.id = -1
        self._pending = None
        saved, self._saved_ring = self._saved_ring, None
        resumed, self._resumed = self._resumed, False
        if saved:
            # The newest `keep` snapshots of the checkpoint: the ring of the uninterrupted run.
            callbacks = {cb.state_key: cb for cb in self._stateful(ctx)}
            newest = sorted(saved, key=lambda state: int(state["id"]), reverse=True)[: self.keep]
            for slot, state in zip(self._ring, newest, strict=False):
                slot.load_state_dict(state, callbacks, device)
        else:
            # No snapshots came with the run: the state it starts or resumes from is the first one.
            origin: _Origin = "resume" if resumed else "start"
            if capture:
                self._capture(ctx, origin)
            else:
                self._capture_pending = origin
        # While batches are still to be stepped over, the state to return to after each of them: the snapshot the
        # rollback restored (the newest: those after it were dropped, and none is taken while stepping over).
        self._anchor = max(self._ring, key=lambda s: s.id) if self._skip_left > 0 else None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _cut_lr(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """Step pre-hook: the learning rate the schedule set, times this step's escalation multiplier."""
        if self._step_factor != 1.0:
            self._saved_lrs = _scale_lrs(optimizer, self._step_factor)

    def _restore_lr(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """Step post-hook: the schedule's values back, before the LR scheduler (which may read them) steps."""
        if self._saved_lrs is not None:
            _put_back_lrs(optimizer, self._saved_lrs)
            self._saved_lrs = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # After the optimizer step (skipped or not) and the LR schedulers, before ModelCheckpoint (which Lightning
        # always calls last): a checkpoint saved at this batch holds the restored state.
        self.after_step(Engine.of(trainer).context(trainer, pl_module))

    def after_step(self, ctx: StepContext) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending["kind"] == "snapshot":
            self._capture(ctx)
        elif pending["kind"] == "skip":
            assert self._anchor is not None
            self._restore(ctx, self._anchor, full=False)
            self._skip_left -= 1
        else:
            self._roll_back(ctx, pending)

    # -- engine steps ------------------------------------------------------------------------------------------
    def may_skip(self) -> bool:
        return True

    def request_stats(self, request: StatsRequest) -> None:
        super().request_stats(request)
        if self.escalate_reset_moments == "spiking":
            request.norm_types.add(2.0)

    def decide(self, plan: StepPlan, ctx: StepContext) -> None:
        device = plan.primary.total.device
        if self._skip_left > 0:
            # Stepping over a batch after a rollback: no statistics, no trigger; the strategy skips the step.
            plan.add_skip(torch.ones((), dtype=torch.bool, device=device))
            self._trigger = None
            return
        x = self._watched_value(plan)
        spike, z, mean, std = self._stats.spike_step(x, self.z_threshold, self.warmup_steps)
        # No loss handed over this window (no `note_loss` behind the loop door): the NaN stands for "no value", not
        # a non-finite loss; the statistics mask it either way.
        nonfinite = (nonfinite_mask(x) | ~plan.primary.finite) if self._window_had_loss else ~plan.primary.finite
        flagged = spike | nonfinite
        run = torch.where(flagged, self._run + 1, 0.0)
        nonfinite_run = torch.where(nonfinite, self._nonfinite_run + 1, 0.0)
        self._run, self._nonfinite_run = run, nonfinite_run
        fire = (run >= self.patience) | (nonfinite_run >= self.nonfinite_patience)
        plan.add_skip(fire)
        if self.escalate_reset_moments == "spiking":
            self._track_modules(plan, flagged)
        self._trigger = _Trigger(fire, flagged, run, nonfinite_run, x.float(), z, mean, std)

    def _track_modules(self, plan: StepPlan, flagged: Tensor) -> None:
        """Per-module gradient norms against their running statistics; the largest z-score of the flagged run."""
        names, row_of = self._module_rows(plan)
        norms = grouped_norms(plan.scaled(plan.stats[2.0].param_norms), row_of, len(names), 2.0)
        if self._module_stats.mean.shape != norms.shape:  # the first step, or the trained parameters changed
            self._module_stats = RunningMoments(self.alpha).to(norms.device)
            self._module_zmax = None
        mean, var, count = self._module_stats.moments()
        _, z, record, _ = spike_decision(norms, mean, var, count, self.z_threshold, self.warmup_steps)
        self._module_stats.update(record)
        z = torch.where(torch.isfinite(norms), z, math.inf)
        previous = self._module_zmax if self._module_zmax is not None else torch.full_like(z, -math.inf)
        self._module_zmax = torch.where(flagged, torch.maximum(previous, z), -math.inf)

    def _module_rows(self, plan: StepPlan) -> tuple[list[str], Tensor]:
        """The module (row) names and the row of every parameter of the plan's index, built once per index."""
        if self._rows is None or self._rows[0] is not plan.index:
            names = plan.index.names
            rows, positions = module_rows(auto_module_keys(names, self._blocks), names, self._model_order)
            self._rows = (plan.index, rows, host_to_device(positions, torch.long, plan.index.shard_weight.device))
        return self._rows[1], self._rows[2]

    def _spiking_modules(self) -> tuple[list[str], list[Tensor], dict[str, float]]:
        """The modules whose norms spiked in the run that fired (one host read), their parameters and z-scores."""
        assert self._rows is not None and self._module_zmax is not None
        index, rows, row_of = self._rows
        zmax = self._module_zmax.tolist()
        chosen = [i for i, z in enumerate(zmax) if z > self.z_threshold]
        if not chosen:
            chosen = [max(range(len(zmax)), key=lambda i: zmax[i])]
        params = [p for p, row in zip(index.params, row_of.tolist(), strict=True) if row in chosen]
        return [rows[i] for i in chosen], params, {rows[i]: zmax[i] for i in chosen}

    def _escalates(self, step: int) -> bool:
        """Whether a rollback firing at ``step`` escalates: the spike came back soon after the previous rollback."""
        enabled = self.escalate_lr_factor is not None or self.escalate_reset_moments != "none"
        return enabled and self._resumed_at is not None and step - self._resumed_at < self.escalate_within_steps

    def observe(self, plan: StepPlan, ctx: StepContext) -> None:
        step = ctx.global_step
        t = self._trigger
        self._step_factor = 1.0
        if t is None:
            self._pending = {"kind": "skip"}
            return
        if not plan.skip_on_host():
            # An applied step: it takes the ramp's multiplier (set on the optimizer by the step pre-hook).
            self._step_factor = rewarmup_factor(self._ramp_start, self._ramp_done, self.escalate_rewarmup_steps)
            self._ramp_done += 1
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
            escalate = self._escalates(step)
            slot = self._choose(ctx, step, start, values, allow_last=escalate)
            self._pending = {
                "kind": "rollback",
                "step": step,
                "start": start,
                "slot": slot,
                "values": values,
                "escalate": escalate,
                # Read now: the rollback starts a new run of flagged steps.
                "spiking": self._spiking_modules() if escalate and self.escalate_reset_moments == "spiking" else None,
            }
        elif step + 1 >= self._next_snapshot_at and not plan.skip_on_host() and not bool(t.flagged):
            self._pending = {"kind": "snapshot"}

    # -- snapshots ---------------------------------------------------------------------------------------------
    def _next_multiple(self, step: int) -> int:
        n = self.snapshot_every_n_steps
        return (step // n + 1) * n

    def _stateful(self, ctx: StepContext) -> list[Callback]:
        """The other gradkit callbacks that keep a state (their own ``state_dict``)."""
        return [
            cb
            for cb in ctx.policies()
            if isinstance(cb, GradKitCallback) and cb is not self and type(cb).state_dict is not Callback.state_dict
        ]

    def _capture(self, ctx: StepContext, origin: _Origin = "schedule") -> _Slot:
        slot = min(self._ring, key=lambda s: s.id)  # an empty slot (id -1), else the oldest snapshot
        # The host-side states first: their `state_dict` calls read device values (a synchronization), which then
        # does not wait for the tensor copies queued below.
        slot.callbacks = [(cb, copy.deepcopy(cb.state_dict())) for cb in self._stateful(ctx)]
        slot.stats = copy.deepcopy(self._stats_state())
        slot.schedulers = [copy.deepcopy(scheduler.state_dict()) for scheduler in ctx.schedulers()]
        slot.strategy = ctx.step_state()
        slot.rng = capture_rng(full=True)
        skipped = ctx.pipeline.skipped_steps
        slot.skipped = None if skipped is None else skipped.clone()
        optimizers = [unwrapped(opt) for opt in ctx.optimizers]
        slot.tensors.capture(trained_parameters(optimizers), list(ctx.model.buffers()), optimizers)
        slot.id, slot.step, slot.origin = self._next_id, ctx.global_step, origin
        self._next_id += 1
        self._next_snapshot_at = self._next_multiple(ctx.global_step)
        return slot

    def _choose(
        self, ctx: StepContext, step: int, start: int, values: dict[str, Any], allow_last: bool = False
    ) -> _Slot:
        """The newest snapshot taken before the spike began; failing that, the state of a resume inside the run of
        flagged steps (from a checkpoint without snapshots). Not the one the previous rollback restored unless the run
        from it got further than the time before (or the rollback escalates, ``allow_last``): a spike that comes back
        as soon suggests that the state itself carries the fault."""
        if self._rollbacks >= self.max_rollbacks:
            self._stop(
                ctx,
                step,
                values,
                f"the budget of `max_rollbacks={self.max_rollbacks}` is spent. Look for the cause in the events "
                "(a learning rate too high, bad data), or raise `max_rollbacks`.",
            )
        # A spike that begins later after the resume than the previous one began after that snapshot is a new
        # occurrence: a fault that recurs every few hundred steps must not throw the run back one snapshot per spike.
        further = self._reach is not None and self._resumed_at is not None and start - self._resumed_at > self._reach
        again = allow_last or further
        usable = [s for s in self._ring if s.valid and (again or s.id != self._last_restored_id)]
        candidates = [s for s in usable if s.step <= start] or [s for s in usable if s.origin == "resume"]
        if not candidates:
            kept = sorted(s.step for s in self._ring if s.valid)
            self._stop(
                ctx,
                step,
                values,
                f"no snapshot is left to restore (snapshots at steps {kept}; the last rollback restored the newest "
                "good one already, and the spike came back as soon after it as the time before: that state may carry "
                "the fault, so it is not restored again). Raise `keep` or `snapshot_every_n_steps`, set "
                "`escalate_lr_factor`, or look for the cause in the events.",
            )
        return max(candidates, key=lambda s: s.id)

    def _stop(self, ctx: StepContext, step: int, values: dict[str, Any], why: str) -> None:
        if self._events is not None:
            self._events.write(
                step=step,
                batch_idx=ctx.batch_idx,
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
            f"The step was not applied.{self._events_note}"
        )

    def _restore(self, ctx: StepContext, slot: _Slot, full: bool) -> None:
        """Put back a snapshot: everything (``full``), or what a stepped-over batch may have touched besides the
        module buffers, which the strategy puts back for every skipped step (``core.buffers.BufferGuard``)."""
        if full:
            optimizers = [unwrapped(opt) for opt in ctx.optimizers]
            slot.tensors.restore(trained_parameters(optimizers), list(ctx.model.buffers()), optimizers)
            for scheduler, state in zip(ctx.schedulers(), slot.schedulers, strict=True):
                scheduler.load_state_dict(copy.deepcopy(state))
            ctx.load_step_state(slot.strategy)
            self._load_stats(copy.deepcopy(slot.stats))
        assert slot.rng is not None
        restore_rng(slot.rng)
        for cb, state in slot.callbacks:
            cb.load_state_dict(copy.deepcopy(state))

    def _roll_back(self, ctx: StepContext, pending: dict[str, Any]) -> None:
        slot: _Slot = pending["slot"]
        self._restore(ctx, slot, full=True)
        for other in self._ring:
            if other.id > slot.id:  # states of the abandoned stretch
                other.id = -1
        device = ctx.device
        self._run = torch.zeros((), device=device)
        self._nonfinite_run = torch.zeros((), device=device)
        self._module_zmax = None
        self._rollbacks += 1
        # How far the run from this snapshot got before the spike began: from the previous resume when that one
        # restored the same snapshot, else from the snapshot itself.
        resumed_from = self._resumed_at if slot.id == self._last_restored_id else None
        self._reach = pending["start"] - (resumed_from if resumed_from is not None else slot.step)
        self._last_restored_id = slot.id
        self._anchor = slot
        self._skip_left = self.skip_batches
        self._next_snapshot_at = self._next_multiple(ctx.global_step + self.skip_batches)
        from_step = ctx.global_step
        previous_end, self._resumed_at = self._resumed_at, from_step + self.skip_batches
        # The rewound steps join the skipped ones: `global_step - skipped_steps` stays the optimizer's step count.
        rewound = torch.tensor(float(from_step - slot.step), device=device)
        ctx.pipeline.skipped_steps = rewound if slot.skipped is None else slot.skipped + rewound
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
                batch_idx=ctx.batch_idx,
                rank=None,
                what="rollback",
                culprit=None,
                values=pending["values"],
                source=type(self).__name__,
                **record,
            )
        if pending["escalate"]:
            assert previous_end is not None
            self._escalate(ctx, pending, record, pending["step"] - previous_end)
        v = pending["values"]
        ctx.warn(
            f"SpikeRollback: {v['reason']} for {v['consecutive']} step(s) since step {pending['start']} "
            f"({self.monitor} {v['value']:.6g}, z {v['z']:.1f}); rolled back from step {from_step} to the snapshot "
            f"of step {slot.step} ({record['rewound_steps']} steps rewound) and stepping over {self.skip_batches} more "
            f"batch(es). Rollback {self._rollbacks} of at most {self.max_rollbacks}.{_resume_note(slot, pending)} "
            f"{self._events_note}"
        )

    def _escalate(self, ctx: StepContext, pending: dict[str, Any], record: dict[str, Any], since: int) -> None:
        """Cut the learning rate and/or reset optimizer moments of the restored state; one event and a warning."""
        self._escalations += 1
        lr_factor = None
        if self.escalate_lr_factor is not None:
            current = rewarmup_factor(self._ramp_start, self._ramp_done, self.escalate_rewarmup_steps)
            self._ramp_start, self._ramp_done = self.escalate_lr_factor * current, 0
            lr_factor = self._ramp_start
        modules: list[str] = []
        module_z: dict[str, float] = {}
        reset = 0
        optimizers = [unwrapped(opt) for opt in ctx.optimizers]
        if self.escalate_reset_moments == "all":
            params = trained_parameters(optimizers)
            reset = sum(reset_optimizer_state_(opt, params) for opt in optimizers)
        elif self.escalate_reset_moments == "spiking":
            modules, params, module_z = pending["spiking"]
            reset = sum(reset_optimizer_state_(opt, params) for opt in optimizers)
        fields = {
            "step": pending["step"],
            "rollback": self._rollbacks,
            "escalation": self._escalations,
            "steps_since_previous": since,
            "lr_factor": lr_factor,
            "rewarmup_steps": self.escalate_rewarmup_steps if lr_factor is not None else None,
            "reset_moments": self.escalate_reset_moments,
            "reset_modules": modules,
            "module_z": module_z,
            "reset_params": reset,
            "to_step": record["to_step"],
        }
        if self._events is not None:
            self._events.write(
                batch_idx=ctx.batch_idx,
                rank=None,
                what="escalation",
                culprit=modules[0] if modules else None,
                values=pending["values"],
                source=type(self).__name__,
                **fields,
            )
        actions = []
        if lr_factor is not None:
            actions.append(
                f"learning rate x{lr_factor:.3g}, back to the schedule over {self.escalate_rewarmup_steps} steps"
            )
        if self.escalate_reset_moments == "all":
            actions.append(f"optimizer moments reset for all {reset} parameters")
        elif self.escalate_reset_moments == "spiking":
            actions.append(f"optimizer moments reset for {reset} parameters of {name_list(modules, quote=True)}")
        ctx.warn(
            f"SpikeRollback: the spike came back {since} step(s) after the previous rollback; escalating "
            f"(escalation {self._escalations}): {'; '.join(actions)}.{self._events_note}"
        )

    def _stats_state(self) -> dict[str, Tensor]:
        """This callback's statistics: the trigger's, and the per-module ones of the "spiking" moment reset."""
        state = self._stats.state_dict()
        if self.escalate_reset_moments == "spiking":
            state.update({f"module_{k}": v for k, v in self._module_stats.state_dict().items()})
        return state

    def _load_stats(self, state: dict[str, Tensor]) -> None:
        self._stats.load_state_dict(state)
        if "module_mean" in state:
            self._module_stats.load_state_dict({k: state[f"module_{k}"] for k in ("mean", "var", "count")})

    # -- state -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        engine = getattr(self, "_engine", None)
        skipped = self._restored_skips if engine is None or self._restored_skips is not None else engine.skipped_steps
        state = {
            "stats": self._stats_state(),
            "run": float(self._run),
            "nonfinite_run": float(self._nonfinite_run),
            "skip_left": self._skip_left,
            "rollbacks": self._rollbacks,
            "next_id": self._next_id,
            "last_restored_id": self._last_restored_id,
            "reach": self._reach,
            "next_snapshot_at": self._next_snapshot_at,
            "history": copy.deepcopy(self._history),
            "skipped_steps": float(skipped) if skipped is not None else 0.0,
            "resumed_at": self._resumed_at,
            "escalations": self._escalations,
            "ramp_start": self._ramp_start,
            "ramp_done": self._ramp_done,
            "module_zmax": None if self._module_zmax is None else self._module_zmax.cpu(),
        }
        if self.save_snapshots:
            state["snapshots"] = [slot.state_dict() for slot in self._ring if slot.valid]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._load_stats(state_dict["stats"])
        self._resumed_at = state_dict.get("resumed_at")  # absent from older checkpoints: no escalation state
        self._escalations = int(state_dict.get("escalations", 0))
        self._ramp_start = float(state_dict.get("ramp_start", 1.0))
        self._ramp_done = int(state_dict.get("ramp_done", 0))
        self._module_zmax = state_dict.get("module_zmax")
        self._run = float(state_dict["run"])
        self._nonfinite_run = float(state_dict["nonfinite_run"])
        self._skip_left = int(state_dict["skip_left"])
        self._rollbacks = int(state_dict["rollbacks"])
        self._next_id = int(state_dict["next_id"])
        self._last_restored_id = int(state_dict["last_restored_id"])
        # Absent from older checkpoints: the last restored snapshot is not restored again (the earlier rule).
        self._reach = state_dict.get("reach")
        self._next_snapshot_at = state_dict["next_snapshot_at"]
        self._history = copy.deepcopy(state_dict["history"])
        skipped = state_dict.get("skipped_steps")  # absent from older checkpoints: the guards' count stands
        self._restored_skips = None if skipped is None else float(skipped)
        self._saved_ring = state_dict.get("snapshots")
        self._resumed = True


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
