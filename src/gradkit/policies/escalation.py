r"""What a rollback does when the spike comes back: ``SpikeRollback(escalate_...)``, off by default.

When a spike comes back after a rollback, rolling back again the same way meets it again: PaLM, OPT and BLOOM
restarted with a lower learning rate after persistent spikes, and SPAM (Huang et al., 2025, "SPAM: Spike-Aware Adam
with Momentum Reset") resets the Adam moments. A spike *comes back* when a rollback fires within
``escalate_within_steps`` optimizer steps after the end of the previous rollback (its last stepped-over batch). That
rollback *escalates* (:class:`Escalation`): after restoring the snapshot (maybe the same one: the run from it now
differs), it

- cuts the learning rate (``escalate_lr_factor``): the optimizer steps with ``lr * f``, ``lr`` what the scheduler set
  and ``f`` ramping linearly from the factor back to 1 over ``escalate_rewarmup_steps`` applied steps
  (:func:`rewarmup_factor`). The factor is applied inside ``optimizer.step`` (a step pre-hook) and the scheduler's
  value put back after it (a post-hook), so any scheduler composes with it and the param groups (a checkpoint,
  ``LearningRateMonitor``) hold the schedule's value. An escalation during a ramp compounds;
- resets the optimizer moments (``escalate_reset_moments``) of the restored state: ``"all"`` parameters, or the
  ``"spiking"`` modules: each module's gradient 2-norm (the rows of ``GradNormMonitor(depth="auto")``) gets a z-score
  every step against its own running statistics (the trigger's ``alpha`` and ``warmup_steps``); a module spikes when
  its largest z-score over the flagged run exceeds ``z_threshold`` or its norm is non-finite (none: the module with
  the largest). Those parameters' optimizer state becomes what a fresh optimizer of the same class and settings
  holds (:func:`reset_optimizer_state_`: Adam, NAdam, Rprop, ASGD, SGD with momentum and Adagrad restart exactly as
  fresh; ``global_step - skipped_steps`` is then no longer their step count).

Each escalation is an event (``what="escalation"``, with ``lr_factor``, ``rewarmup_steps``, ``reset_moments``,
``reset_modules`` and their ``module_z``, ``reset_params``, ``rollback`` and ``steps_since_previous``), a marker in
the gradient report and a warning. Its state (the ramp, the module statistics) is saved in checkpoints and is the
same on every rank.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from gradkit._util.arguments import check_choice, check_float, check_int, name_list
from gradkit.step.norms import ParamIndex, grouped_norms, host_to_device, local_tensor
from gradkit.step.params import clean_name
from gradkit.step.plan import Decision, StepStats
from gradkit.step.protocol import StepContext, unwrapped
from gradkit.step.running import RunningMoments, spike_decision
from gradkit.step.selection import auto_module_keys, module_rows, repeated_blocks
from gradkit.step.snapshot import trained_parameters

__all__ = ["Escalation", "FindingSink", "module_params", "reset_optimizer_state_", "rewarmup_factor"]

#: What :meth:`Escalation.spiking_modules` returns: the modules, their parameters and their largest z-scores.
_Spiking = tuple[list[str], list[Tensor], dict[str, float]]


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

    For torch's optimizers that initialize their state lazily (Adam, AdamW, NAdam, RAdam, Rprop, ASGD, SGD, ...) the
    parameter's state is removed and rebuilt at the next step exactly as a fresh one does (NAdam's ``mu_product`` of
    1, Rprop's ``step_size`` of ``lr``, no SGD momentum buffer): zeroing every tensor would not be a fresh state. An
    optimizer that builds its state in its constructor (Adagrad's ``sum``) gets the state a fresh instance, built on a
    detached alias of the parameter with the group's settings its constructor accepts, holds, copied in place; one
    that cannot be constructed so is reset to no state. A parameter without state is left as it is.

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


def module_params(model: nn.Module, modules: Sequence[str]) -> list[Tensor]:
    """The parameters of the named modules of ``model`` (a module's qualified name, cleaned as the pipeline cleans it,
    or a parameter's own name): what ``escalate_reset_moments="spiking"`` resets for the modules a finding names."""
    prefixes = [m + "." for m in modules]
    return [
        p
        for n, p in model.named_parameters()
        if (name := clean_name(n)) in modules or any(name.startswith(prefix) for prefix in prefixes)
    ]


def _same_layout(a: Tensor, b: Tensor) -> bool:
    la, lb = local_tensor(a), local_tensor(b)
    return la.shape == lb.shape and la.dtype == lb.dtype and la.device == lb.device


class FindingSink(Protocol):
    """What :class:`~gradkit.EarlyWarning` and :class:`~gradkit.SpikeRollback` tell the loop's
    :class:`~gradkit.EscalationLadder` (which sets itself on them at its ``attach``): a finding, and a stop."""

    def report(self, reason: str, source: str = "user", modules: Sequence[str] = ()) -> None: ...

    def stop(self, reason: str, source: str = "user", step: int | None = None) -> None: ...


class Escalation:
    """An escalating rollback's settings and state: the learning-rate ramp (``ramp_start``, ``ramp_done``), the
    per-module statistics of ``"spiking"`` and the count of escalations.

    Args:
        lr_factor, rewarmup_steps, reset_moments, within_steps: ``SpikeRollback``'s ``escalate_*`` arguments.
        alpha, z_threshold, warmup_steps: the trigger's, which the per-module statistics use too.

    Raises:
        ValueError: naming the ``escalate_*`` argument and the value.
    """

    def __init__(
        self,
        lr_factor: float | None,
        rewarmup_steps: int,
        reset_moments: str,
        within_steps: int,
        alpha: float,
        z_threshold: float,
        warmup_steps: int,
    ) -> None:
        self.lr_factor = (
            None
            if lr_factor is None
            else check_float(
                "escalate_lr_factor",
                lr_factor,
                above=0.0,
                below=1.0,
                hint="E.g. `escalate_lr_factor=0.5` halves the learning rate; None (default) leaves it as scheduled.",
            )
        )
        self.rewarmup_steps = check_int(
            "escalate_rewarmup_steps",
            rewarmup_steps,
            1,
            hint="E.g. `escalate_rewarmup_steps=100`: the cut learning rate is back on schedule 100 steps later.",
        )
        self.reset_moments = check_choice("escalate_reset_moments", reset_moments, ("none", "all", "spiking"))
        self.within_steps = check_int(
            "escalate_within_steps",
            within_steps,
            1,
            hint="E.g. `escalate_within_steps=1000`: a rollback within 1000 steps of the previous one escalates.",
        )
        self.alpha, self.z_threshold, self.warmup_steps = alpha, z_threshold, warmup_steps
        self.count = 0
        self.ramp_start = 1.0
        self.ramp_done = 0
        #: The learning-rate multiplier of the current optimizer step (set before the optimizer steps).
        self.step_factor = 1.0
        self._saved_lrs: list[Any] | None = None
        self._hooks: list[RemovableHandle] = []
        self.module_stats = RunningMoments(alpha)
        #: Per module, the largest z-score of the current run of flagged steps (a device vector).
        self.module_zmax: Tensor | None = None
        self._blocks: list[str] = []
        self._model_order: list[str] = []
        self._rows: tuple[ParamIndex, list[str], Tensor] | None = None

    def escalates(self, step: int, resumed_at: int | None) -> bool:
        """Whether a rollback firing at ``step`` escalates: the spike came back soon after the previous rollback, whose
        stepped-over batches ended at ``resumed_at``."""
        enabled = self.lr_factor is not None or self.reset_moments != "none"
        return enabled and resumed_at is not None and step - resumed_at < self.within_steps

    def read_model(self, model: nn.Module) -> None:
        """For ``"spiking"``: the model's repeated blocks and parameter order, named as the pipeline cleans them."""
        if self.reset_moments == "spiking":
            self._model_order = [clean_name(n) for n, _ in model.named_parameters()]
            self._blocks = repeated_blocks((clean_name(n), m) for n, m in model.named_modules())
            self._rows = None

    def start(self, ctx: StepContext) -> None:
        """Training starts or resumes: the module statistics on the loop's device, the LR hooks on its optimizers."""
        self.module_stats.to(ctx.device)
        if self.module_zmax is not None:
            self.module_zmax = self.module_zmax.to(ctx.device)
        self.remove_hooks()
        if self.lr_factor is not None:
            # The multiplier is applied inside `optimizer.step` and the schedule's values put back after it.
            for optimizer in (unwrapped(opt) for opt in ctx.optimizers):
                self._hooks.append(optimizer.register_step_pre_hook(self._cut_lr))
                self._hooks.append(optimizer.register_step_post_hook(self._restore_lr))

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def step_applied(self) -> None:
        """The current optimizer step applies: it takes the ramp's multiplier, and the ramp moves on."""
        self.step_factor = rewarmup_factor(self.ramp_start, self.ramp_done, self.rewarmup_steps)
        self.ramp_done += 1

    def ramp_step(self, skipped: Callable[[], bool]) -> None:
        """Before an optimizer step (a policy's ``observe``): during a ramp, the step takes the ramp's multiplier unless
        ``skipped()`` (a host read of the step's skip flag, made during a ramp only)."""
        ramping = self.ramp_start < 1.0 and self.ramp_done < self.rewarmup_steps
        if ramping or self.step_factor != 1.0:
            self.step_factor = 1.0
            if not skipped():
                self.step_applied()

    def _cut_lr(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """Step pre-hook: every param group's ``lr`` (what the schedule set) times this step's multiplier."""
        if self.step_factor == 1.0:
            return
        self._saved_lrs = []
        for group in optimizer.param_groups:
            lr = group["lr"]
            self._saved_lrs.append(lr.clone() if isinstance(lr, Tensor) else lr)
            if isinstance(lr, Tensor):
                lr.mul_(self.step_factor)  # a tensor learning rate stays the object the optimizer holds
            else:
                group["lr"] = lr * self.step_factor

    def _restore_lr(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """Step post-hook: the schedule's values back, before the LR scheduler (which may read them) steps."""
        if self._saved_lrs is None:
            return
        for group, lr in zip(optimizer.param_groups, self._saved_lrs, strict=True):
            if isinstance(lr, Tensor):
                group["lr"].copy_(lr)
            else:
                group["lr"] = lr
        self._saved_lrs = None

    def track_modules(self, stats: StepStats, decision: Decision, flagged: Tensor) -> None:
        """For ``"spiking"``: per-module gradient 2-norms against their running statistics; the largest z-score of
        each module over the run of flagged steps."""
        names, row_of = self._module_rows(stats.index)
        norms = grouped_norms(decision.scaled(stats.norms[2.0].param_norms), row_of, len(names), 2.0)
        if self.module_stats.mean.shape != norms.shape:  # the first step, or the trained parameters changed
            self.module_stats = RunningMoments(self.alpha).to(norms.device)
            self.module_zmax = None
        mean, var, count = self.module_stats.moments()
        _, z, record, _ = spike_decision(norms, mean, var, count, self.z_threshold, self.warmup_steps)
        self.module_stats.update(record)
        z = torch.where(torch.isfinite(norms), z, math.inf)
        previous = self.module_zmax if self.module_zmax is not None else torch.full_like(z, -math.inf)
        self.module_zmax = torch.where(flagged, torch.maximum(previous, z), -math.inf)

    def _module_rows(self, index: ParamIndex) -> tuple[list[str], Tensor]:
        """The module (row) names and the row of every parameter of ``index``, built once per index."""
        if self._rows is None or self._rows[0] is not index:
            names = index.names
            rows, positions = module_rows(auto_module_keys(names, self._blocks), names, self._model_order)
            self._rows = (index, rows, host_to_device(positions, torch.long, index.shard_weight.device))
        return self._rows[1], self._rows[2]

    def spiking_modules(self) -> _Spiking:
        """The modules whose norms spiked in the run that fired (one host read), their parameters and z-scores."""
        assert self._rows is not None and self.module_zmax is not None
        index, rows, row_of = self._rows
        zmax = self.module_zmax.tolist()
        chosen = [i for i, z in enumerate(zmax) if z > self.z_threshold]
        if not chosen:
            chosen = [max(range(len(zmax)), key=lambda i: zmax[i])]
        params = [p for p, row in zip(index.params, row_of.tolist(), strict=True) if row in chosen]
        return [rows[i] for i in chosen], params, {rows[i]: zmax[i] for i in chosen}

    def escalate(
        self, ctx: StepContext, spiking: _Spiking | None, step: int, rollback: int, since: int, to_step: int
    ) -> tuple[dict[str, Any], str]:
        """Cut the learning rate and/or reset the optimizer moments of the restored state (``spiking``: what
        :meth:`spiking_modules` read when the rollback fired). Returns the event's fields (``step``: the step that
        fired, ``rollback``: its number, ``since``: steps since the previous rollback ended, ``to_step``: the snapshot's
        step) and, for the warning, what was done."""
        self.count += 1
        lr_factor = None
        if self.lr_factor is not None:
            # An escalation during a ramp compounds: from the factor times the ramp's current multiplier.
            current = rewarmup_factor(self.ramp_start, self.ramp_done, self.rewarmup_steps)
            self.ramp_start, self.ramp_done = self.lr_factor * current, 0
            lr_factor = self.ramp_start
        modules: list[str] = []
        module_z: dict[str, float] = {}
        reset = 0
        optimizers = [unwrapped(opt) for opt in ctx.optimizers]
        if self.reset_moments != "none":
            if spiking is not None:
                modules, params, module_z = spiking
            else:
                params = trained_parameters(optimizers)
            reset = sum(reset_optimizer_state_(opt, params) for opt in optimizers)
        actions = []
        if lr_factor is not None:
            actions.append(f"learning rate x{lr_factor:.3g}, back to the schedule over {self.rewarmup_steps} steps")
        if self.reset_moments == "all":
            actions.append(f"optimizer moments reset for all {reset} parameters")
        elif self.reset_moments == "spiking":
            actions.append(f"optimizer moments reset for {reset} parameters of {name_list(modules, quote=True)}")
        fields = {
            "step": step,
            "rollback": rollback,
            "escalation": self.count,
            "steps_since_previous": since,
            "lr_factor": lr_factor,
            "rewarmup_steps": self.rewarmup_steps if lr_factor is not None else None,
            "reset_moments": self.reset_moments,
            "reset_modules": modules,
            "module_z": module_z,
            "reset_params": reset,
            "to_step": to_step,
        }
        return fields, "; ".join(actions)

    def state_dict(self) -> dict[str, Any]:
        return {
            "escalations": self.count,
            "ramp_start": self.ramp_start,
            "ramp_done": self.ramp_done,
            "module_zmax": None if self.module_zmax is None else self.module_zmax.cpu(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt :meth:`state_dict`'s keys of ``state`` (a checkpoint from before escalations existed: never)."""
        self.count = int(state.get("escalations", 0))
        self.ramp_start = float(state.get("ramp_start", 1.0))
        self.ramp_done = int(state.get("ramp_done", 0))
        self.module_zmax = state.get("module_zmax")
