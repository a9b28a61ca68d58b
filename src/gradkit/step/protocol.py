"""The protocol between the step pipeline, the policies and the front doors: what each reads of the others.

- :class:`Policy`: what a policy is to the pipeline (a plain object with a ``stage`` and any of the hooks); gradkit's
  policies are plain torch classes that do not derive from it.
- :class:`StepContext`: what the policies read of the loop at every hook (14 members); :class:`Door`: the same and
  the services a door keeps on its side (the model, the step accounting, the schedulers, the loggers, ...), which the
  pipeline reads and a policy receives at ``attach`` (one subclass per front door: the Trainer's in
  :mod:`lightning_gradkit.trainer_door`, the loop door's in :mod:`gradkit.doors.loop`).
- :class:`Stage` (the order of decisions within a step), :class:`StatsRequest` (what the measure phase reads for the
  policies), :class:`Roster` (a step's policies and each phase's hooks), :class:`MicroBatch` (what a door keeps of
  a micro-batch for the culprit replay).

What a policy reads and writes at each step (``StepStats``, ``Decision``, ``StepOutcome``) is
:mod:`gradkit.step.plan`; the pipeline that runs a step on them is :mod:`gradkit.step.pipeline`. Nothing here imports
Lightning, and nothing here imports the modules that import it (no cycle, not even a type-level one).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from gradkit._util.arguments import name_list
from gradkit._util.torch_compat import handles_found_inf
from gradkit._util.user_frame import warn_user
from gradkit.step.norms import world_size

if TYPE_CHECKING:
    from gradkit.step.accounting import StepAccounting
    from gradkit.step.plan import Decision, StepOutcome, StepStats
    from gradkit.step.snapshot import RNGState, Snapshot

__all__ = [
    "Door",
    "MicroBatch",
    "Policy",
    "Roster",
    "Stage",
    "StatsRequest",
    "StepContext",
    "fresh_state_note",
    "gone_state_note",
    "hook",
    "is_policy",
    "policy_key",
    "served",
    "state_key",
    "unwrapped",
    "values_to_host",
]


class Stage(IntEnum):
    """The order in which policies decide within one step."""

    SCALE = 0
    GUARD = 1
    CLIP = 2
    OBSERVE = 3


@dataclass
class StatsRequest:
    """What the measure phase reads this step: the union of the policies' ``request_stats``.

    Attributes:
        norm_types: the norm types of the per-parameter norms (2.0 when no policy asks for one).
        depth: module depth of the per-module norms (``ParamIndex`` groups).
        unit_norm_names: parameters whose unit-wise 2-norms are measured (AGC), see :class:`UnitNorms`.
        rank_flags: make the finite flag global: every rank's local flag travels in the step's collective.
        finite_check: measure ``GradStats.found_nonfinite`` in the gradient read: ``torch.isfinite`` over every
            element, exactly, which the fp32 norms cannot tell (one more read of the gradients off the Triton path).
    """

    norm_types: set[float] = field(default_factory=set)
    depth: int = 0
    unit_norm_names: set[str] = field(default_factory=set)
    rank_flags: bool = False
    finite_check: bool = False


def values_to_host(metrics: dict[str, Tensor]) -> dict[str, float]:
    """Step values (device scalars) as Python floats, in one device-to-host transfer (logging steps only). Values
    already on the host (a policy's host statistics) are read where they are."""
    on_device = {k: v for k, v in metrics.items() if v.device.type != "cpu"} or metrics
    first = next(iter(on_device.values()))
    stacked = torch.stack([v.detach().reshape(()).to(first.device, torch.float32) for v in on_device.values()])
    values = dict(zip(on_device, stacked.tolist(), strict=True))
    return {k: values[k] if k in values else float(v) for k, v in metrics.items()}


@dataclass
class MicroBatch:
    """A micro-batch of the step as a door keeps it for the culprit replay (:mod:`gradkit.policies.culprit`).

    Attributes:
        batch_idx: its index, as the door counts it.
        compute_loss: runs its forward again and returns its loss (``None``: it cannot be replayed, ``unavailable``
            says why). Called inside :func:`~gradkit.step.replay.replay`, under ``torch.enable_grad()``.
        rng: the torch RNG states before its forward (the replay repeats its dropout masks), or ``None``.
        ids: the sample ids its batch carries (:func:`~gradkit.policies.culprit.sample_ids`), or ``None``.
        unavailable: why there is no ``compute_loss``.
    """

    batch_idx: int
    compute_loss: Callable[[], Tensor | None] | None = None
    rng: RNGState | None = None
    ids: Any = None
    unavailable: str | None = None


# -- what the pipeline reads of the loop and of the policies --------------------------------------------------------
class StepContext:
    """The loop a step runs in, as the policies read it at every hook: 14 members, the same behind every door.

    The door's own services (the model, the step accounting, the other policies, the LR schedulers, the AMP scaler,
    the loggers, ...) are not here: they are on :class:`~gradkit.step.protocol.Door`, which a policy that needs one
    receives, typed, as the ``ctx`` of ``Policy.attach`` (and keeps). The Lightning ``Trainer`` door answers from the
    Trainer (:class:`~lightning_gradkit.trainer_door.TrainerContext`), the Fabric and plain-PyTorch door from its own
    step counter (:class:`~gradkit.doors.loop.LoopContext`).

    Attributes:
        micro_batch: the micro-batch whose loss the door hands to ``note_loss``, kept for the culprit replay
            (``None`` where the door keeps none): the loop door's ``note_loss(loss, replay=...)``, the Trainer's
            batch of ``training_step``.
    """

    micro_batch: MicroBatch | None = None

    @property
    def log_dir(self) -> Path | None:
        """The directory of the guards' event file and the monitor's report (the Trainer's log directory; ``None``:
        the loop has none)."""
        return None

    @property
    def optimizers(self) -> Sequence[Optimizer]:
        """Every optimizer of the loop, in a fixed order (the index of one names its logged metrics)."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        """The device of the model's parameters on this rank."""
        raise NotImplementedError

    @property
    def global_step(self) -> int:
        """Optimizer steps attempted before the current one (skipped ones included)."""
        raise NotImplementedError

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if world_size() > 1 else 0

    @property
    def batch_idx(self) -> int:
        """The current batch of the epoch, as the loop counts it (the step, where the loop has no epochs)."""
        return self.global_step

    @property
    def accumulate_grad_batches(self) -> int:
        """The micro-batches per optimizer step whose losses the loop divides before ``backward`` (1 if none)."""
        return 1

    def step_key(self) -> tuple[int, ...]:
        """What identifies the current optimizer step: equal for all calls within it, different for the next."""
        raise NotImplementedError

    def param_names(self) -> dict[int, str]:
        """``id(parameter) -> name`` for every parameter of the model."""
        raise NotImplementedError

    def is_logging_step(self, every_n_steps: int | None = None) -> bool:
        """Whether the current step logs: ``every_n_steps`` or the loop's own period (each door has its rule:
        Lightning's behind the Trainer, the step counter behind the loop door)."""
        raise NotImplementedError

    def log(self, metrics: dict[str, Tensor], every_n_steps: int | None = None) -> None:
        """Send step values (device tensors) to the loop's loggers; called on logging steps only."""
        raise NotImplementedError

    def log_values(self, values: dict[str, float]) -> None:
        """Send values already on the host to the loop's loggers at the current step (a step off the period)."""
        raise NotImplementedError

    def warn(self, message: str) -> None:
        """A warning, from rank 0 only, at the user's line (the first frame outside gradkit, Lightning and torch)."""
        if self.global_rank == 0:
            warn_user(message)


class Door(StepContext):
    """A front door: the policy-facing :class:`StepContext` and the services the door keeps on its side.

    The pipeline reads these (the AMP scale, the sharding, the fused fold); a policy that needs one (the monitor's
    loggers and progress bar, a guard's replay of the model, a rollback's snapshots of the model, the LR schedulers,
    the other policies, the step state and the count of skipped steps) gets the door as the ``ctx`` of
    ``Policy.attach``, typed, and keeps it. One subclass per door:
    :class:`~lightning_gradkit.trainer_door.TrainerContext`, :class:`~gradkit.doors.loop.LoopContext`.

    """

    @property
    def progress_bar(self) -> Callable[[dict[str, float]], None] | None:
        """Shows step values (host floats) in the loop's progress bar; ``None`` where it has none."""
        return None

    @property
    def loggers(self) -> Sequence[Any]:
        """The loop's Lightning loggers (``trainer.loggers``, ``fabric.loggers``; empty where it has none): what the
        monitor's report goes to besides its PNG (:mod:`gradkit.report.loggers`)."""
        return ()

    @property
    def window_buffers(self) -> Snapshot | None:
        """The module buffers as the current accumulation window found them (what a skip puts back), where the door
        holds them (while a policy may skip); ``None`` otherwise."""
        return None

    @property
    def log_every_n_steps(self) -> int:
        raise NotImplementedError

    @property
    def log_step(self) -> int:
        """The step the loop's loggers file the current step's values under."""
        return self.global_step

    def flat_sharded(self) -> bool:
        """Whether every gradient is a flat local shard (FSDP1 over several ranks)."""
        return False

    def loss_scale(self, optimizer: Optimizer) -> Tensor | None:
        """The AMP loss scale ``optimizer``'s gradients still carry (a device tensor), or ``None``."""
        return None

    def loss_scale_source(self) -> object | None:
        """The loop's fp16 ``GradScaler``, or ``None``."""
        return None

    def steps_through_gate(self) -> bool:
        """Whether every optimizer step of the loop goes through :func:`~gradkit.step.gate.step_as_decided`
        (the door gates ``optimizer.step``)."""
        return False

    def folds_into(self, optimizer: Optimizer) -> bool:
        """Whether a decision's common factor can go to ``optimizer``'s fused kernel (its ``grad_scale``) instead of a
        write pass: the door gates the step and the optimizer is fused."""
        return self.steps_through_gate() and handles_found_inf(optimizer)

    def is_last_step(self) -> bool:
        """Whether the current step is known to be the loop's last one."""
        return False

    def checkpoint_note(self) -> str:
        """Where to resume from, for an error that stops training (the Trainer names its last checkpoints)."""
        return "keep checkpoints of the loop to resume from"

    @property
    def model(self) -> torch.nn.Module:
        """The module being trained (its buffers are part of a step's state)."""
        raise NotImplementedError

    @property
    def steps(self) -> StepAccounting:
        """The loop's step accounting (:class:`~gradkit.step.accounting.StepAccounting`): its count of skipped steps
        is part of a step's state, which a guard restores and a rollback rewinds."""
        raise NotImplementedError

    def policies(self) -> list[Policy]:
        """Every policy of the loop."""
        raise NotImplementedError

    def schedulers(self) -> list[object]:
        """The LR schedulers of the loop (``state_dict``/``load_state_dict``), in a fixed order."""
        return []

    def step_state(self) -> dict[str, object]:
        """What the door itself changes per step besides the above (the Trainer's LR-schedule counts)."""
        return {}

    def load_step_state(self, state: dict[str, object]) -> None:
        """Rewind :meth:`step_state` at the current batch."""

    def policies_owner(self) -> str:
        """How an error names what holds the loop's policies (a sentence's subject and verb)."""
        return "`policies` holds"

    def optimizer_index(self, optimizer: Optimizer) -> int:
        """The position of ``optimizer`` (or of the optimizer a wrapper holds) in :attr:`optimizers`, 0 if absent."""
        for i, opt in enumerate(self.optimizers):
            if opt is optimizer or unwrapped(opt) is optimizer:
                return i
        return 0


def served(door: Door | None, policy: object) -> Door:
    """The door ``policy`` kept at ``Policy.attach`` (for the services it reads later).

    Raises:
        RuntimeError: the policy was not attached to a door.
    """
    if door is None:
        raise RuntimeError(
            f"{type(policy).__name__} reads its door's services, and no door attached it: a door (the Trainer, "
            "`GradKit(...)`, the Hugging Face door) calls `attach(ctx, model)` before the first step."
        )
    return door


def unwrapped(optimizer: Optimizer) -> Optimizer:
    """The optimizer a wrapper holds (Lightning's ``LightningOptimizer._optimizer``, Fabric's
    ``_FabricOptimizer.optimizer``), or the optimizer itself."""
    inner = getattr(optimizer, "_optimizer", None) or getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, Optimizer) else optimizer


class Policy(Protocol):
    """What a policy is to the pipeline and the doors: a plain object with a ``stage`` and any of the hooks below.

    A policy does not derive from this class (gradkit's own do not: one class per algorithm, no base); it is a
    :class:`typing.Protocol`, and :func:`is_policy` tells whether an object is one (it has a ``stage``). Every hook a
    door or the pipeline calls is declared here, typed, with its no-op default (what a policy that leaves it out
    gets); the doors and the pipeline call only the hooks a policy defines, looked up by name in one place,
    :class:`Roster` (a hook left out costs nothing: ``note_loss`` is not even prepared). Each hook reads the loop
    through the :class:`StepContext`, so a policy decides the same way behind every door. A class that subclasses
    ``Policy`` explicitly inherits the no-op hooks below.

    The protocol, in the order of a step:

    - ``attach(ctx, model)``: the door is set up (the Trainer's ``setup``, ``GradKit(...)``, ``load_state_dict``);
      raise ``ValueError`` if the policy, as configured, cannot work behind this door.
    - ``before_first_forward(ctx)``: the first forward after the door was built or loaded is about to run.
    - ``drops_batch(ctx)``: whether the current optimizer step's batches are dropped (``StepsToSkip``).
    - ``note_loss(loss, ctx)``: a micro-batch loss (before any division, without the AMP scale).
    - ``request_stats(request)``, ``primary_norm_type()``, ``reduce_request(ctx)``: what the measure and reduce
      phases read for it.
    - ``decide(stats, decision, ctx)`` / ``decide_again(stats, decision, first, ctx)``: reads the step's
      measurements (:class:`~gradkit.step.plan.StepStats`) and writes its decision through the step's
      :class:`~gradkit.step.plan.Decision`; no gradient is read, nothing syncs.
    - ``observe(stats, outcome, ctx)``: after the write, with the decision and what came of it
      (:class:`~gradkit.step.plan.StepOutcome`, read only); logs on logging steps.
    - ``after_step(ctx)``: after the optimizer step (applied or skipped) and the LR schedulers of the batch.
    - ``finish(ctx)``: the loop ended.
    - ``may_skip()``: whether it may ask for a step to be skipped (the door must be able to skip).
    - ``state_dict()`` / ``load_state_dict(state)`` and ``state_key``: its state, one format behind every door;
      ``rank_local_keys()``: the entries of that state each rank holds its own values of (a distributed checkpoint
      saves them per rank: :mod:`gradkit.doors.distributed_checkpoint`).
    - ``detach(ctx)``: remove what ``attach`` registered (hooks on the model); the loop door's ``close`` calls it.
    """

    stage: Stage

    def may_skip(self) -> bool:
        """Whether this policy may ask for an optimizer step to be skipped (the door must be able to skip)."""
        return False

    def request_stats(self, request: StatsRequest) -> None:
        """Measure: add the norm types and module depth this policy reads."""

    def primary_norm_type(self) -> float | None:
        """The norm type whose statistics are logged as the step's gradient norm (the monitor's)."""
        return None

    def reduce_request(self, ctx: StepContext) -> dict[str, Tensor]:
        """Reduce: per-rank scalars to be summed across ranks in the step's single collective (keys must be unique)."""
        return {}

    def decide(self, stats: StepStats, decision: Decision, ctx: StepContext) -> None:
        """Decide: read the step's statistics and write through ``decision`` (its methods: one clip form per step).
        Must not read gradients or sync."""

    def decide_again(self, stats: StepStats, decision: Decision, first: Decision, ctx: StepContext) -> None:
        """Decide, for a later evaluation of the closure within the same optimizer step (``LBFGS``, SAM; see
        :mod:`gradkit.step.closure`): ``stats`` are the fresh gradients' statistics, ``decision`` (already holding
        the step's accumulation scale) is this evaluation's, ``first`` the step's decision. Write what applies to
        every evaluation's gradients (clipping); forget what this evaluation's micro-batch hooks collected for a
        decision (the step was decided on the first evaluation). Must not read gradients or sync."""

    def observe(self, stats: StepStats, outcome: StepOutcome, ctx: StepContext) -> None:
        """Observe, after the gradients are written: ``outcome`` is the step's decision and what came of it (the
        post-clip norm, the skip on the host). Log on logging steps."""

    def note_loss(self, loss: Tensor, ctx: StepContext) -> None:
        """A micro-batch loss as the loop computed it (before any division, without the AMP scale)."""

    def drops_batch(self, ctx: StepContext) -> bool:
        """Whether the batches of the current optimizer step are dropped: not run at all, the step counted and
        nothing applied (the doors ask, any number of times per step)."""
        return False

    def finish(self, ctx: StepContext) -> None:
        """The loop ended: report what is still pending."""

    def after_step(self, ctx: StepContext) -> None:
        """After the optimizer step (applied or skipped) and the LR schedulers of the batch."""

    def before_first_forward(self, ctx: StepContext) -> None:
        """The first forward after the door was built or loaded is about to run (the model's weights and buffers are
        loaded by then, in whatever order the loop loaded them)."""

    def attach(self, ctx: Door, model: torch.nn.Module) -> None:
        """The door is set up: prepare what needs the model. ``ctx`` is the door itself, with its services (the
        policy-facing context of the other hooks, and the model, the step accounting, the loggers, ...): a policy that
        needs one of them later keeps it.

        Raises:
            ValueError: if the policy, as configured, cannot work behind this door.
        """

    def detach(self, ctx: StepContext) -> None:
        """Remove what :meth:`attach` registered (hooks on the model or the optimizers); the door is not used again
        (the loop door's ``close``, the Trainer's ``teardown`` and ``on_exception``)."""

    def state_dict(self) -> dict[str, Any]:
        """The policy's state, in one format behind every door (kept under its ``state_key``). A policy without
        state leaves it out."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the state :meth:`state_dict` returned."""

    def rank_local_keys(self) -> tuple[str, ...]:
        """The keys of :meth:`state_dict` whose values differ from rank to rank (``SpikeRollback``'s snapshots: each
        rank's own FSDP2 shards, buffers and RNG states). The others are the same on every rank, saved once."""
        return ()


def state_key(policy: object, **identity: object) -> str:
    """The key of ``policy``'s state in a checkpoint, the same behind every door: Lightning's
    ``Callback._generate_state_key`` format (class name, then the arguments that tell two instances apart), so that a
    Trainer checkpoint's ``"callbacks"`` entry and :meth:`~gradkit.GradKit.state_dict` use one key."""
    return f"{type(policy).__qualname__}{identity!r}" if identity else type(policy).__qualname__


def policy_key(policy: object) -> str:
    """The key of ``policy``'s state behind every door: its ``state_key`` (a Lightning callback's, or a torch policy's
    own, made by :func:`state_key`), else its class name, as Lightning's ``Callback.state_key`` defaults to."""
    key = getattr(policy, "state_key", None)
    return key if isinstance(key, str) else type(policy).__qualname__


def fresh_state_note(keys: Sequence[str]) -> str:
    """The warning of a resume whose state has nothing for the policies ``keys`` (their ``state_key``): added at the
    restart (``StepsToSkip(steps=steps_from_events(run_dir))``), or built with other arguments. They start fresh;
    every door says it in these words (the loop door, the Hugging Face door, the Trainer's gradkit callbacks)."""
    was, starts = ("it was", "it starts") if len(keys) == 1 else ("they were", "they start")
    return (
        f"Resuming with no saved state for {name_list(keys)}: {was} not in the run that saved the checkpoint (added "
        f"at this restart, or built with other arguments), so {starts} fresh, as constructed. The other policies "
        "resume their saved state."
    )


def gone_state_note(keys: Sequence[str]) -> str:
    """The warning of a resume whose state holds the states ``keys`` of policies the run no longer has: they are not
    loaded (the run goes on without them), as the Lightning ``Trainer`` ignores, with a warning, the state of a
    callback that is gone."""
    it, is_, policies = ("it", "it is", "that policy") if len(keys) == 1 else ("them", "they are", "those policies")
    return (
        f"The checkpoint holds the state of {name_list(keys)}, which this run does not have: {is_} not loaded. To "
        f"resume {it}, add {policies} back with the arguments of the saved run; to train without, nothing to do."
    )


def is_policy(obj: object) -> bool:
    """Whether ``obj`` is a policy instance: it has a :class:`Stage` as ``stage`` (a class is not an instance)."""
    return not isinstance(obj, type) and isinstance(getattr(obj, "stage", None), Stage)


def hook(policy: object, name: str) -> Callable[..., Any] | None:
    """``policy``'s protocol hook ``name`` (bound), or ``None`` when it does not define it: the one by-name lookup of
    a hook (:class:`Roster` makes it; doors and the pipeline read the roster's typed lists)."""
    return getattr(policy, name, None)


def _bound(policies: Sequence[object], name: str) -> list[Any]:
    found = [m for p in policies if (m := hook(p, name)) is not None]
    if name in _STEP_HOOKS:
        for method in found:
            function = getattr(method, "__func__", None)  # a bound method: its `self` is not an argument
            _refuse_plan_signature(method if function is None else function, name, function is not None)
    return found


#: The step hooks: how many arguments each takes, its signature, and the signature before `StepPlan` was split.
_STEP_HOOKS = {
    "decide": (3, "decide(self, stats, decision, ctx)", "decide(self, plan, ctx)"),
    "decide_again": (4, "decide_again(self, stats, decision, first, ctx)", "decide_again(self, plan, first, ctx)"),
    "observe": (3, "observe(self, stats, outcome, ctx)", "observe(self, plan, ctx)"),
}


@functools.lru_cache(maxsize=256)
def _refuse_plan_signature(function: Callable[..., Any], name: str, bound: bool) -> None:
    """Refuse a step hook written for ``StepPlan`` (one argument fewer), once per function: the old ``plan`` is split
    in the read-only ``StepStats`` and the ``Decision`` the hook writes, so an old hook cannot be called right.

    Raises:
        TypeError: ``function`` takes fewer positional arguments than the hook ``name`` is given.
    """
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # a builtin or a C callable: nothing to read, the call itself will say
        return
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    arity, new, old = _STEP_HOOKS[name]
    if len(positional) - bound < arity:
        raise TypeError(
            f"`{getattr(function, '__qualname__', name)}` has the signature of gradkit before `StepPlan` was split, "
            f"`{old}`. Write `{new}`: the measurements are the read-only `stats` (`gradkit.StepStats`; `plan.stats` "
            "is `stats.norms`), the decision is written through `decision` (`gradkit.Decision`; `plan.add_skip(flag)` "
            "is `decision.add_skip(flag)`, `plan.pre_clip_total(p)` is `decision.scaled(stats.norms[p].total)`), and "
            "`observe` reads `outcome` (`outcome.decision`, `outcome.post_clip_total()`, `outcome.was_skipped()`)."
        )


class Roster:
    """Policies and the protocol hooks each defines, looked up once: the one place that finds a hook by its name.

    The pipeline's phases (``request_stats`` ... ``observe``) and ``finish`` run in stage order; the door's own hooks
    (``attach`` ... ``detach``) in the order the loop was given the policies, as a Trainer calls its callbacks. Built
    once per set of policies (:meth:`Pipeline._roster`, a door's construction) or per policy (:meth:`of`: a Trainer
    callback forwarding a hook to itself): a phase calls only the policies that take part in it.

    Attributes:
        policies: the policies in stage order.
        saves_state: the policies that keep a state (``state_dict``), in the given order.
        loads_state: the policies that resume one (``load_state_dict``), in the given order.
    """

    __slots__ = (
        "_primary",
        "_request",
        "after_step",
        "attach",
        "before_first_forward",
        "decide",
        "decide_again",
        "detach",
        "drops_batch",
        "finish",
        "loads_state",
        "may_skip",
        "note_loss",
        "observe",
        "policies",
        "reduce_request",
        "saves_state",
    )

    def __init__(self, policies: Sequence[object]) -> None:
        given = list(policies)
        self.policies: list[Policy] = sorted(given, key=lambda policy: policy.stage)  # type: ignore[attr-defined]
        ordered = self.policies
        self.decide: list[Callable[[StepStats, Decision, StepContext], None]] = _bound(ordered, "decide")
        self.decide_again: list[Callable[[StepStats, Decision, Decision, StepContext], None]] = _bound(
            ordered, "decide_again"
        )
        self.observe: list[Callable[[StepStats, StepOutcome, StepContext], None]] = _bound(ordered, "observe")
        self.reduce_request: list[Callable[[StepContext], dict[str, Tensor]]] = _bound(ordered, "reduce_request")
        self.finish: list[Callable[[StepContext], None]] = _bound(ordered, "finish")
        self.attach: list[Callable[[Door, torch.nn.Module], None]] = _bound(given, "attach")
        self.before_first_forward: list[Callable[[StepContext], None]] = _bound(given, "before_first_forward")
        self.note_loss: list[Callable[[Tensor, StepContext], None]] = _bound(given, "note_loss")
        self.drops_batch: list[Callable[[StepContext], bool]] = _bound(given, "drops_batch")
        self.after_step: list[Callable[[StepContext], None]] = _bound(given, "after_step")
        self.detach: list[Callable[[StepContext], None]] = _bound(given, "detach")
        self.may_skip: list[Callable[[], bool]] = _bound(given, "may_skip")
        self.saves_state: list[Policy] = [p for p in given if hook(p, "state_dict") is not None]  # type: ignore[misc]
        self.loads_state: list[Policy] = [p for p in given if hook(p, "load_state_dict") is not None]  # type: ignore[misc]
        self._request: StatsRequest | None = None
        self._primary: list[float | None] = []

    def rank_local(self) -> dict[str, tuple[str, ...]]:
        """Each policy's :meth:`Policy.rank_local_keys`, by its :func:`policy_key` (those with none left out)."""
        found = ((policy_key(p), keys()) for p in self.saves_state if (keys := hook(p, "rank_local_keys")) is not None)
        return {key: tuple(names) for key, names in found if names}

    @classmethod
    def of(cls, policy: object) -> Roster:
        """The hooks of one policy."""
        return cls((policy,))

    def any_may_skip(self) -> bool:
        """Whether any of the policies may ask for an optimizer step to be skipped."""
        return any(may_skip() for may_skip in self.may_skip)

    @property
    def request(self) -> StatsRequest:
        """What the measure phase reads for these policies: the union of their ``request_stats`` (read once)."""
        if self._request is None:
            request = StatsRequest()
            for add in _bound(self.policies, "request_stats"):
                add(request)
            if not request.norm_types:
                request.norm_types.add(2.0)
            self._request = request
        return self._request

    @property
    def primary(self) -> float | None:
        """The first ``primary_norm_type`` a policy names, in stage order (``None``: none names one)."""
        if not self._primary:
            found = (f() for f in _bound(self.policies, "primary_norm_type"))
            self._primary.append(next((v for v in found if v is not None), None))
        return self._primary[0]
