"""Gradient-clipping callbacks on the shared one-pass statistics, and the manual-optimization entry point.

Every clipping callback decides at the optimizer-step boundary (``on_before_optimizer_step``: after the AMP unscale,
the DDP all-reduce and the accumulation window) from the norms the engine measured once, writes a coefficient into
the step's plan, and the engine multiplies the gradients once, with no host sync. The algorithms themselves live in
:mod:`gradkit.clip`.

Map of this file, in order: what a clipper keeps of a step for logging (``_Decision``, ``_Lazy``); the shared base
``_GradClipCallback`` (per-optimizer policies, the one-clipper check, logging, state, and ``decide_again`` for the
later closure evaluations of :mod:`gradkit._closure`); the scalar clippers on the total norm
(:class:`ClipGradNorm`, :class:`AutoClip`, :class:`ZClip`); :class:`ClipGradValue`; the unit-wise
:class:`AdaptiveGradClip` and its parameter selection; :func:`clip_gradients`, the manual-optimization entry point,
which runs the engine with the clipper as an ``extra`` policy.
"""

from __future__ import annotations

import functools
import math
import operator
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.optim import Optimizer

from gradkit.clip import (
    AdaptiveGradClipPolicy,
    AutoClipPolicy,
    ClipPolicy,
    GradNormPolicy,
    GradValuePolicy,
    ScalarClipPolicy,
    ZClipPolicy,
    clip_coefficient,
    clip_to_threshold,
)
from gradkit.norms import ParamIndex, host_to_device, local_tensor, per_tensor_norms, reduce_sharded, row_norms
from gradkit.params import clean_name, replication
from gradkit.protocol import StepContext
from gradkit.selection import NamePattern, no_match_hint, parameters_selected, parse_patterns
from lightning_gradkit._deepspeed import clipping_instead, refuse_under_deepspeed
from lightning_gradkit.engine import (
    Engine,
    GradKitCallback,
    Stage,
    StatsRequest,
    StepPlan,
    world_size,
)

__all__ = ["AdaptiveGradClip", "AutoClip", "ClipGradNorm", "ClipGradValue", "ZClip", "clip_gradients"]


#: Clipped-step flags wait in a list and are summed on device once per this many steps (and when logged or saved),
#: not with an add kernel every step.
_COUNT_EVERY = 64


@dataclass
class _Decision:
    """What a clipping callback decided for one step, kept for logging (device tensors).

    ``post`` and ``coef`` are tensors, or values worked out on logging steps only: ``functools.partial`` of a
    module-level function or a :class:`_Lazy`, never a closure, so that the callback (and a Trainer holding it)
    pickles and deep-copies (``torch.save(trainer)``). :func:`_resolve` reads either. ``clipped`` is the step's bool
    flag; ``None`` when it is ``pre > clip_above``, which is then worked out when the counts are summed, for many steps
    in one comparison. ``threshold`` is the norm above which the step is clipped (logged), ``target`` the norm a
    later evaluation of the step is clipped to (the threshold itself, except for ZClip's reciprocal rule)."""

    pre: Tensor
    post: Tensor | Callable[[], Tensor]
    coef: Tensor | Callable[[], Tensor]
    clipped: Tensor | None
    threshold: Tensor | Callable[[], Tensor] | None = None
    clip_above: float | None = None
    target: Tensor | float | None = None


def _host_scalar(value: float) -> Tensor:
    """A threshold kept as a Python float, as the 0-dim tensor logged on logging steps."""
    return torch.tensor(value, dtype=torch.float32)


def _resolve(value: Tensor | Callable[[], Tensor]) -> Tensor:
    """A :class:`_Decision` value: the tensor itself, or the deferred one worked out now."""
    return value() if callable(value) else value


def _ratio(post: Tensor | Callable[[], Tensor], pre: Tensor) -> Tensor:
    """``post / pre``, 1 where ``pre`` is 0: the single coefficient a per-unit or element-wise clip amounts to."""
    post = _resolve(post)
    return torch.where(pre > 0, post / pre, torch.ones_like(pre))


class _Lazy:
    """``fn(*args)``, worked out on the first call (a logging step) and kept; picklable when ``fn`` and ``args`` are.

    Example::

        >>> total = _Lazy(operator.add, torch.tensor(1.0), torch.tensor(2.0))
        >>> total()
        tensor(3.)
    """

    def __init__(self, fn: Callable[..., Tensor], *args: Any) -> None:
        self._fn = fn
        self._args = args
        self._value: Tensor | None = None

    def __call__(self) -> Tensor:
        if self._value is None:
            self._value = self._fn(*self._args)
        return self._value


class _GradClipCallback(GradKitCallback):
    """Shared base of the gradient-clipping callbacks: conflicts, per-optimizer policies, logging and state.

    Subclasses implement :meth:`_clip`, which reads the plan's statistics and writes the clip into it. The public
    callbacks only build their policy from their arguments; :func:`clip_gradients` constructs the private classes
    around a policy object it is given (``policy_owner=None``).

    Args:
        policy: the clipping policy.
        policy_owner: the optimizer whose state ``policy`` itself carries; every other optimizer gets a fresh copy
            (statistics never mix across optimizers). 0 for a callback (its checkpointed state is keyed by optimizer
            index); ``None`` for the first optimizer clipped (a policy object given to :func:`clip_gradients`).
    """

    stage = Stage.CLIP

    def __init__(self, policy: ClipPolicy, *, policy_owner: int | None = 0) -> None:
        self.policy = policy
        self._policy_owner = policy_owner
        self._set_up = False
        self._policies: dict[int, ClipPolicy] = {}
        self._clipped: dict[int, Tensor] = {}
        self._uncounted: dict[tuple[int, float | None], list[Tensor]] = {}
        self._steps: dict[int, int] = {}
        self._last: dict[int, _Decision] = {}
        self._prepared_for: weakref.ref[pl.Trainer] | None = None

    # -- Lightning hooks --------------------------------------------------------------------------------------
    @property
    def state_key(self) -> str:
        """The class name, as Lightning's default, once a Trainer has set this callback up (checkpoints are written
        and read after ``setup``).

        Before that, the key is unique to the instance: ``Trainer(...)`` rejects stateful callbacks that share a key
        with a generic message, before any hook runs, so two clipping callbacks would never reach the ``setup``
        check that says why only one may clip.
        """
        if self._set_up:
            return type(self).__qualname__
        return f"{type(self).__qualname__}@{id(self):x}"

    def __getstate__(self) -> dict[str, Any]:
        # The weak reference to the Trainer prepared for cannot be pickled; a copy prepares again for its Trainer
        # (as Lightning's `LightningModule.__getstate__` drops `_trainer`).
        state = dict(vars(self))
        state["_prepared_for"] = None
        return state

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._set_up = True
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            refuse_under_deepspeed(
                trainer,
                f"`{self._setting()}`",
                "the DeepSpeed engine clips inside `engine.step()`, after every callback hook, and under ZeRO stage "
                "2/3 the gradients are not in `.grad` before it",
                clipping_instead(self._deepspeed_max_norm()),
            )
        _check_single_clipper(trainer)

    def _setting(self) -> str:
        """The callback as an error message names it."""
        return f"{type(self).__name__}(...)"

    def _deepspeed_max_norm(self) -> float | None:
        """The ``gradient_clipping`` value that does what this callback does under DeepSpeed, if one does."""
        return None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._prepare(Engine.of(trainer).context(trainer, pl_module), pl_module)
        self._prepared_for = weakref.ref(trainer)

    def state_dict(self) -> dict[str, Any]:
        for idx in list(self._steps):
            self._count_now(idx)
        return {
            "policies": {i: p.state_dict() for i, p in self._policies.items()},
            "clipped": {i: c.detach().cpu() for i, c in self._clipped.items()},
            "steps": dict(self._steps),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for i, state in state_dict.get("policies", {}).items():
            self._policy_for(int(i)).load_state_dict(state)
        self._clipped = {int(i): c.clone() for i, c in state_dict.get("clipped", {}).items()}
        self._uncounted.clear()
        self._steps = {int(i): int(n) for i, n in state_dict.get("steps", {}).items()}

    # -- engine steps -----------------------------------------------------------------------------------------
    def _prepare(self, ctx: StepContext, model: torch.nn.Module) -> None:
        """Model-dependent checks and selections, once the model is configured (sharded, wrapped)."""

    def _prepare_once(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._prepared_for is None or self._prepared_for() is not trainer:
            self._prepare(Engine.of(trainer).context(trainer, pl_module), pl_module)
            self._prepared_for = weakref.ref(trainer)

    def attach(self, ctx: StepContext, model: torch.nn.Module) -> None:
        self._prepare(ctx, model)

    def request_stats(self, request: StatsRequest) -> None:
        request.norm_types.add(self.policy.norm_type)

    def decide(self, plan: StepPlan, ctx: StepContext) -> None:
        if not plan.grads:
            return
        idx = plan.optimizer_idx
        plan.clip_decided = True
        decision = self._clip(self._policy_for(idx), plan)
        self._last[idx] = decision
        key = (idx, decision.clip_above if decision.clipped is None else None)
        pending = self._uncounted.setdefault(key, [])
        pending.append(decision.pre if decision.clipped is None else decision.clipped)
        if len(pending) >= _COUNT_EVERY:
            self._count_now(idx)
        self._steps[idx] = self._steps.get(idx, 0) + 1

    def _count_now(self, idx: int) -> None:
        """Sum the waiting clipped flags of optimizer ``idx`` into its device counter (no host sync)."""
        for key in [k for k in self._uncounted if k[0] == idx]:
            stacked = torch.stack(self._uncounted.pop(key))
            above = key[1]
            added = (stacked if above is None else stacked > above).sum()
            count = self._clipped.get(idx)
            self._clipped[idx] = added if count is None else count.to(added.device) + added

    def decide_again(self, plan: StepPlan, first: StepPlan, ctx: StepContext) -> None:
        # Every evaluation of a re-evaluating closure is clipped, as Lightning's `gradient_clip_val` clips each one;
        # nothing is counted or logged again, and adaptive policies are fed once per step (see `_clip_again`).
        if plan.grads:
            self._clip_again(self._policy_for(plan.optimizer_idx), plan)

    def _clip_again(self, policy: ClipPolicy, plan: StepPlan) -> None:
        """Clip a later evaluation's gradients; stateless policies (the default here) simply decide again."""
        self._clip(policy, plan)

    def observe(self, plan: StepPlan, ctx: StepContext) -> None:
        idx = plan.optimizer_idx
        decision = self._last.get(idx)
        if not plan.logging_step or decision is None:
            return
        suffix = f"/opt{idx}" if len(ctx.optimizers) > 1 else ""
        ctx.log({k + suffix: v for k, v in self.metrics(idx).items()})
        # A fresh counter: the logged fraction may still refer to the old one until Lightning reads it.
        self._clipped.pop(idx, None)
        self._steps[idx] = 0

    def metrics(self, optimizer_idx: int = 0) -> dict[str, Tensor]:
        """The values logged for the last step of an optimizer, as device tensors (no host sync).

        ``grad_clip/pre_clip_norm`` and ``grad_clip/post_clip_norm`` (the total norm before and after clipping,
        in the policy's norm), ``grad_clip/coef`` (the clip coefficient; for per-unit or element-wise clipping,
        the ratio of the two norms), ``grad_clip/clipped_fraction`` (the fraction of optimizer steps clipped since
        the previous log) and, for the adaptive policies (:class:`AutoClip`, :class:`ZClip`), whose threshold moves
        with the history, ``grad_clip/threshold``; :class:`ClipGradNorm` does not log its constant ``max_norm``.
        """
        decision = self._last[optimizer_idx]
        steps = max(self._steps.get(optimizer_idx, 0), 1)
        self._count_now(optimizer_idx)
        clipped = self._clipped.get(optimizer_idx)
        if clipped is None:
            clipped = torch.zeros((), dtype=torch.long, device=decision.pre.device)
        out = {
            "grad_clip/pre_clip_norm": decision.pre,
            "grad_clip/post_clip_norm": _resolve(decision.post),
            "grad_clip/coef": _resolve(decision.coef),
            "grad_clip/clipped_fraction": clipped.to(torch.float32) / steps,
        }
        if decision.threshold is not None:
            out["grad_clip/threshold"] = _resolve(decision.threshold)
        return out

    def _policy_for(self, optimizer_idx: int) -> ClipPolicy:
        """The policy holding ``optimizer_idx``'s state: ``self.policy`` for its owner, a fresh copy for the others."""
        policy = self._policies.get(optimizer_idx)
        if policy is None:
            if self._policy_owner is None:
                self._policy_owner = optimizer_idx
            owned = optimizer_idx == self._policy_owner
            policy = self._policies[optimizer_idx] = self.policy if owned else self.policy.fresh()
        return policy

    def _clip(self, policy: ClipPolicy, plan: StepPlan) -> _Decision:
        raise NotImplementedError


def _check_single_clipper(trainer: pl.Trainer) -> None:
    clippers = [cb for cb in trainer.callbacks if isinstance(cb, _GradClipCallback)]
    if len(clippers) > 1:
        names = ", ".join(type(cb).__name__ for cb in clippers)
        raise ValueError(
            f"The Trainer has {len(clippers)} gradient-clipping callbacks ({names}); each would rescale the "
            "gradients the other already clipped. Keep exactly one of them."
        )
    if clippers and trainer.gradient_clip_val:
        raise ValueError(
            f"`Trainer(gradient_clip_val={trainer.gradient_clip_val!r})` and the {type(clippers[0]).__name__} "
            "callback both clip gradients. Use one: remove `gradient_clip_val` from the Trainer (the callback clips "
            "after the AMP unscale, also with fused optimizers, and logs its norms), or remove the callback."
        )


class _ScalarClip(_GradClipCallback):
    """Clipping with one coefficient for all gradients, from the total norm."""

    policy: ScalarClipPolicy

    def _clip(self, policy: ClipPolicy, plan: StepPlan) -> _Decision:
        assert isinstance(policy, ScalarClipPolicy)
        pre = plan.pre_clip_total(policy.norm_type)
        clip_above = None
        if type(policy) is GradNormPolicy:
            # `policy(pre)` would also compare with max_norm every step: the clipped count does that when it sums.
            # No threshold is logged: it would be `max_norm` at every step (only adaptive clippers log theirs).
            coef, clipped, threshold = clip_coefficient(pre, policy.max_norm), None, None
            clip_above = policy.max_norm
        elif isinstance(policy, ZClipPolicy):
            coef, clipped, above = policy.decide(pre)
            clip_above = above if clipped is None else None
            threshold = functools.partial(_host_scalar, above)
        else:
            coef, clipped, threshold = policy(pre)
        plan.clip_coef = coef
        return _Decision(
            pre=pre,
            post=pre if coef is None else functools.partial(operator.mul, pre, coef),
            coef=functools.partial(torch.ones_like, pre) if coef is None else coef,
            clipped=clipped,
            threshold=threshold,
            clip_above=clip_above,
            target=policy.target if isinstance(policy, ZClipPolicy) else threshold,
        )

    def _clip_again(self, policy: ClipPolicy, plan: StepPlan) -> None:
        if isinstance(policy, GradNormPolicy):
            self._clip(policy, plan)
            return
        # Adaptive: the threshold chosen on the step's first evaluation, without feeding the statistics again.
        decision = self._last.get(plan.optimizer_idx)
        if decision is not None and decision.target is not None:
            plan.clip_coef = clip_to_threshold(plan.pre_clip_total(policy.norm_type), decision.target)


class ClipGradNorm(_ScalarClip):
    r"""Clip gradients by their total p-norm: the same result as ``torch.nn.utils.clip_grad_norm_``.

    Every optimizer step, the gradients are multiplied by ``min(1, max_norm / (total_norm + 1e-6))``. The total norm
    is the one the shared statistics measured (no second pass over the gradients), after the AMP unscale and over
    the whole accumulation window; under DDP, FSDP1 and FSDP2 it is the global norm and every rank applies the same
    coefficient. Unlike ``Trainer(gradient_clip_val=...)``, it also clips with fused optimizers under 16-mixed AMP,
    logs the norms, and runs with manual optimization too (see :func:`lightning_gradkit.clip_gradients`).

    Logged on logging steps: ``grad_clip/pre_clip_norm``, ``grad_clip/post_clip_norm``, ``grad_clip/coef`` and
    ``grad_clip/clipped_fraction`` (steps clipped since the previous log); ``/opt{i}`` is appended with several
    optimizers. No ``grad_clip/threshold``: it would be ``max_norm`` at every step (the adaptive clippers log
    theirs).

    Args:
        max_norm: the largest total norm, > 0.
        norm_type: the p of the norm, ``>= 1`` or ``float("inf")``; 2.0 by default.

    Raises:
        ValueError: at construction, if ``max_norm`` <= 0 or ``norm_type`` < 1; at setup, if another clipping
            callback or ``Trainer(gradient_clip_val=...)`` is also present.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import ClipGradNorm
        >>> trainer = Trainer(callbacks=[ClipGradNorm(max_norm=1.0)])
    """

    def __init__(self, max_norm: float, norm_type: float = 2.0) -> None:
        super().__init__(GradNormPolicy(max_norm, norm_type))

    def _setting(self) -> str:
        return f"ClipGradNorm(max_norm={self.max_norm!r}, norm_type={self.norm_type!r})"

    def _deepspeed_max_norm(self) -> float | None:
        return self.max_norm if self.norm_type == 2.0 else None

    @property
    def max_norm(self) -> float:
        return self.policy.max_norm

    @property
    def norm_type(self) -> float:
        return self.policy.norm_type


class _ValueClip(_GradClipCallback):
    """Clipping of every gradient element by a :class:`GradValuePolicy` (the engine applies the clamp)."""

    policy: GradValuePolicy

    def _clip(self, policy: ClipPolicy, plan: StepPlan) -> _Decision:
        assert isinstance(policy, GradValuePolicy)
        pre = plan.pre_clip_total(math.inf)
        plan.clamp_value = policy.clip_value
        post = torch.clamp(pre, max=policy.clip_value)
        return _Decision(
            pre=pre,
            post=post,
            coef=functools.partial(_ratio, post, pre),
            clipped=pre > policy.clip_value,
        )


class ClipGradValue(_ValueClip):
    r"""Clip every gradient element to ``[-clip_value, clip_value]``, as ``torch.nn.utils.clip_grad_value_``.

    The clamp is applied by the engine right after its single multiply (accumulation scaling), after the AMP
    unscale; with a fused optimizer under 16-mixed AMP the bound is scaled by the loss scale, so it means the same.
    The logged norms are inf-norms (the largest absolute element), the quantity value clipping bounds: the post-clip
    value is ``min(pre, clip_value)``, derived without reading the gradients again.

    Args:
        clip_value: the bound, > 0.

    Raises:
        ValueError: at construction, if ``clip_value`` <= 0; at setup, if another clipping callback or
            ``Trainer(gradient_clip_val=...)`` is also present.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import ClipGradValue
        >>> trainer = Trainer(callbacks=[ClipGradValue(clip_value=0.5)])
    """

    def __init__(self, clip_value: float) -> None:
        super().__init__(GradValuePolicy(clip_value))

    def _setting(self) -> str:
        return f"ClipGradValue(clip_value={self.clip_value!r})"

    @property
    def clip_value(self) -> float:
        return self.policy.clip_value


class AutoClip(_ScalarClip):
    r"""Clip to a percentile of the history of total gradient norms (AutoClip).

    Seetharaman, Wichern, Pardo, Le Roux, "AutoClip: Adaptive Gradient Clipping for Source Separation Networks"
    (IEEE MLSP 2020): each step the total 2-norm joins the history, then the gradients are clipped (as
    ``clip_grad_norm_``) to the ``percentile``-th percentile of all norms seen so far, the current one included.
    The paper recommends ``percentile=10``. The history is a ring buffer of the last ``history_size`` finite norms,
    kept on the gradients' device (no host sync); non-finite norms never enter it. It is saved in checkpoints.

    Logs, besides the keys of :class:`ClipGradNorm`, ``grad_clip/threshold`` (the percentile).

    Args:
        percentile: in ``(0, 100]``; 10.0 by default.
        history_size: number of past norms kept, >= 1; 10000 by default.

    Raises:
        ValueError: at construction, if ``percentile`` is outside ``(0, 100]`` or ``history_size`` is not an
            integer in ``[1, 10_000_000]``; at setup, if another clipping callback or
            ``Trainer(gradient_clip_val=...)`` is also present.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import AutoClip
        >>> trainer = Trainer(callbacks=[AutoClip(percentile=10.0)])
    """

    def __init__(self, percentile: float = 10.0, history_size: int = 10000) -> None:
        super().__init__(AutoClipPolicy(percentile, history_size))


class ZClip(_ScalarClip):
    r"""Clip gradient-norm spikes detected by a z-score against an EMA of the total norm (ZClip).

    Kumar, Owen, Roy Chowdhury, Güra, "ZClip: Adaptive Spike Mitigation for LLM Pre-Training" (arXiv:2504.02507,
    2025), the paper's ``zscore`` mode with reciprocal ("adaptive scaling") clipping, defaults ``alpha=0.97``,
    ``z_threshold=2.5``, ``warmup_steps=25``:

    - the first ``warmup_steps`` total 2-norms initialise the mean ``mu`` and variance ``sigma**2`` (only
      ``max_norm`` clips meanwhile);
    - then ``z = (g - mu) / (sigma + 1e-6)``; when ``z > z_threshold`` the gradients are scaled to the norm
      ``g* = mu + z_threshold**2 * sigma / z`` (never above ``max_norm`` when given), otherwise left untouched;
    - ``mu`` and ``sigma**2`` follow an EMA of ``g*`` (the clipped norm, so a spike does not inflate them).

    Unlike the reference callback, the statistics stay on the device (no ``.item()`` per step), a non-finite norm
    never enters them (one Inf would poison the mean forever), and they are saved in checkpoints.

    Logs, besides the keys of :class:`ClipGradNorm`, ``grad_clip/threshold``: the norm above which the step is
    clipped, ``mu + z_threshold * sigma`` (capped by ``max_norm``; ``max_norm``, or ``inf`` without one, during
    warm-up).

    Args:
        alpha: EMA smoothing factor in ``(0, 1)``.
        z_threshold: z-score above which the norm is clipped, > 0.
        warmup_steps: number of finite norms that initialise the statistics, >= 1.
        max_norm: optional absolute ceiling on the total norm, > 0; ``None`` (default) for none. The reference
            implementation defaults to ``max_grad_norm=1.0``, which also clips every step whose norm exceeds 1
            (during warm-up too): pass ``max_norm=1.0`` to match it.

    Raises:
        ValueError: at construction, for ``alpha`` outside ``(0, 1)``, ``z_threshold`` or ``max_norm`` <= 0, or
            ``warmup_steps`` < 1; at setup, if another clipping callback or ``Trainer(gradient_clip_val=...)`` is
            also present.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import ZClip
        >>> trainer = Trainer(callbacks=[ZClip(alpha=0.97, z_threshold=2.5)])
    """

    def __init__(
        self, alpha: float = 0.97, z_threshold: float = 2.5, warmup_steps: int = 25, max_norm: float | None = None
    ) -> None:
        super().__init__(ZClipPolicy(alpha, z_threshold, warmup_steps, max_norm))


class _UnitwiseClip(_GradClipCallback):
    """Unit-wise clipping by an :class:`AdaptiveGradClipPolicy` (the machinery of :class:`AdaptiveGradClip`).

    Args:
        policy: the policy; it carries the state of optimizer ``policy_owner`` (see :class:`_GradClipCallback`).
        exclude: patterns of parameters left unclipped, as in :class:`AdaptiveGradClip`.
    """

    policy: AdaptiveGradClipPolicy
    _REDUCE_KEY = "AdaptiveGradClip/sharded_weight_sq"

    def __init__(
        self, policy: AdaptiveGradClipPolicy, exclude: list[str] | None = None, *, policy_owner: int | None = 0
    ) -> None:
        super().__init__(policy, policy_owner=policy_owner)
        self._exclude = parse_patterns("exclude", exclude)
        self.exclude = [pattern.text for pattern in self._exclude]
        self._selected: set[str] | None = None
        self._sharded_1d: list[tuple[str, Tensor, float]] = []
        self._sharded_1d_factors: Tensor | None = None
        self._cache: dict[tuple[Any, ...], Any] = {}
        self._cache_index: ParamIndex | None = None

    def _prepare(self, ctx: StepContext, model: torch.nn.Module) -> None:
        if ctx.flat_sharded():
            raise RuntimeError(
                "AdaptiveGradClip needs every parameter in its original shape to find its output units, and FSDP1 "
                "(`strategy='fsdp'`) flattens them into shards. Use FSDP2 (`ModelParallelStrategy` with "
                "`fully_shard` in `configure_model`) or a norm-based clipping callback such as ClipGradNorm."
            )
        self._selected = _select_parameters(model, self._exclude)
        self._sharded_1d = []
        self._sharded_1d_factors = None
        self._cache = {}
        self._cache_index = None
        for name, param in model.named_parameters():
            name = clean_name(name)
            placements = getattr(param, "placements", None)
            if name not in self._selected or placements is None:
                continue
            # Every placement that splits the tensor: `is_shard()` misses `_StridedShard` (FSDP2 over TP).
            sharded_dims = {p.dim for p in placements if not p.is_replicate() and hasattr(p, "dim")}
            if param.ndim > 1 and sharded_dims - {0}:
                raise RuntimeError(
                    f"AdaptiveGradClip: parameter `{name}` is sharded along dim(s) {sorted(sharded_dims)}; its output "
                    f"units (dim 0) are split across ranks. Exclude it (`exclude=['re:{re.escape(name)}']`) or shard "
                    "it along dim 0 only (FSDP2's default)."
                )
            if param.ndim <= 1 and sharded_dims:
                self._sharded_1d.append((name, param, 1.0 / replication(param)))

    def request_stats(self, request: StatsRequest) -> None:
        request.norm_types.add(2.0)
        if self._selected is not None:
            request.unit_norm_names |= self._selected

    def reduce_request(self, ctx: StepContext) -> dict[str, Tensor]:
        # Sharded biases and gains are one unit spread over ranks: their weight norms join the step's all-reduce.
        if not self._sharded_1d or world_size() == 1:
            return {}
        weights = [local_tensor(p.detach()) for _, p, _ in self._sharded_1d]
        if self._sharded_1d_factors is None:
            factors = [w for _, _, w in self._sharded_1d]
            self._sharded_1d_factors = host_to_device(factors, torch.float32, weights[0].device)
        return {self._REDUCE_KEY: per_tensor_norms(weights, 2.0).pow(2) * self._sharded_1d_factors}

    def _cached(self, plan: StepPlan, key: tuple[Any, ...]) -> Any:
        """A value cached for the step's parameter index; the cache is emptied when the index is rebuilt (parameters
        joined or left the optimizer)."""
        if plan.index is not self._cache_index:
            self._cache = {}
            self._cache_index = plan.index
        return self._cache.get(key)

    def _one_dim_positions(self, plan: StepPlan) -> tuple[list[int], Tensor | None, list[int]]:
        """Selected parameters with at most one dim that have a gradient, an index tensor of them, and for each the
        slot of its reduced weight norm (-1: not sharded). Cached: the set only changes when gradients go missing."""
        key = ("one_dim", tuple(plan.present))
        cached = self._cached(plan, key)
        if cached is None:
            assert self._selected is not None
            index = plan.index
            slots = {name: k for k, (name, _, _) in enumerate(self._sharded_1d)}
            positions = [i for i in plan.present if index.params[i].ndim <= 1 and index.names[i] in self._selected]
            tensor = host_to_device(positions, torch.long, index.shard_weight.device) if positions else None
            cached = self._cache[key] = (positions, tensor, [slots.get(index.names[i], -1) for i in positions])
        return cached

    def _clip(self, policy: ClipPolicy, plan: StepPlan) -> _Decision:
        assert isinstance(policy, AdaptiveGradClipPolicy)
        if self._selected is None:
            raise RuntimeError("AdaptiveGradClip was not prepared for this model.")
        index = plan.index
        stats = plan.stats[2.0]
        units = plan.unit_norms
        pos_nd = units.positions if units is not None else []
        pos_1d, pos_1d_tensor, reduced_slots = self._one_dim_positions(plan)
        if not pos_nd and not pos_1d:
            pre = plan.pre_clip_total(2.0)
            return _Decision(pre, pre, functools.partial(torch.ones_like, pre), torch.zeros((), dtype=torch.bool))

        grad_parts: list[Tensor] = []
        weight_parts: list[Tensor] = []
        if units is not None:
            grad_parts.append(units.flat)
            weight_parts.extend(row_norms(local_tensor(index.params[i].detach())) for i in pos_nd)
        if pos_1d_tensor is not None:
            grad_parts.append(stats.param_norms[pos_1d_tensor])
            weight_parts.append(self._one_dim_weight_norms(plan, pos_1d, reduced_slots))
        grad_units = plan.scaled(torch.cat(grad_parts))
        coefs = policy(grad_units, torch.cat(weight_parts))

        sizes = (units.sizes if units is not None else []) + [1] * len(pos_1d)
        pieces = list(coefs.split(sizes))
        for k, shape in self._coef_shapes(plan, pos_nd, pos_1d):
            pieces[k] = pieces[k].view(shape)
        plan.param_coefs.update(zip([*pos_nd, *pos_1d], pieces, strict=True))

        pre = plan.pre_clip_total(2.0)
        post = _Lazy(
            self._post_clip_total, index, plan.scale, stats.param_norms, grad_units, coefs, pos_nd, sizes, pos_1d_tensor
        )
        if plan.primary_norm_type == 2.0:
            plan.post_clip_total_fn = post
        return _Decision(pre=pre, post=post, coef=functools.partial(_ratio, post, pre), clipped=(coefs < 1).any())

    def _coef_shapes(self, plan: StepPlan, pos_nd: list[int], pos_1d: list[int]) -> list[tuple[int, tuple[int, ...]]]:
        """``(k, shape)`` for the coefficient pieces that need a view to broadcast over their gradient: unit-wise ones
        of parameters with more than one dim, and scalar parameters (cached per layout; other pieces, of shape
        ``(1,)``, broadcast as they are)."""
        key = ("shapes", tuple(pos_nd), tuple(pos_1d))
        shapes = self._cached(plan, key)
        if shapes is None:
            ndims = dict(zip(plan.present, (g.ndim for g in plan.grads), strict=True))
            shapes = [(k, (-1,) + (1,) * (ndims[i] - 1)) for k, i in enumerate(pos_nd)]
            shapes += [(len(pos_nd) + k, ()) for k, i in enumerate(pos_1d) if ndims[i] == 0]
            self._cache[key] = shapes
        return shapes

    def _one_dim_weight_norms(self, plan: StepPlan, positions: list[int], reduced_slots: list[int]) -> Tensor:
        local = per_tensor_norms([local_tensor(plan.index.params[i].detach()) for i in positions], 2.0)
        reduced = plan.reduced.get(self._REDUCE_KEY)
        if reduced is None or all(s < 0 for s in reduced_slots):
            return local
        parts = [reduced[s].sqrt() if s >= 0 else local[k] for k, s in enumerate(reduced_slots)]
        return torch.stack(parts)

    @staticmethod
    def _post_clip_total(
        index: ParamIndex,
        scale: Tensor | None,
        param_norms: Tensor,
        grad_units: Tensor,
        coefs: Tensor,
        pos_nd: list[int],
        sizes: list[int],
        pos_1d: Tensor | None,
    ) -> Tensor:
        """Total 2-norm after the clip, from the unit norms: no read of the gradients (logging steps only).

        Unit norms of multi-dimensional parameters are local to a rank under FSDP2: their squares are summed across
        ranks (one scalar all-reduce); all other norms here are already global. ``scale`` is the step's accumulation
        scale (``StepPlan.scale``), which ``grad_units`` already carry and the per-parameter ``param_norms`` do not.
        """
        post_units = grad_units * coefs
        device = post_units.device
        n_nd = sum(sizes[: len(pos_nd)])
        sq_nd = post_units[:n_nd].square()
        sq_global = post_units[n_nd:].square().sum()
        clipped_mask = torch.zeros(index.num_params, dtype=torch.bool, device=device)
        if pos_nd:
            per_param = torch.stack([s.sum() for s in sq_nd.split(sizes[: len(pos_nd)])])
            nd_tensor = host_to_device(pos_nd, torch.long, device)
            weight = index.shard_weight[nd_tensor]
            sq_global = sq_global + (per_param * (weight == 0)).sum()
            sharded = (per_param * weight).sum()
            if index.any_sharded:
                sharded = reduce_sharded(index, {}, {"sharded": sharded})[1]["sharded"]
            sq_global = sq_global + sharded
            clipped_mask[nd_tensor] = True
        if pos_1d is not None:
            clipped_mask[pos_1d] = True
        others = (param_norms if scale is None else param_norms * scale).square() * ~clipped_mask
        return (sq_global + others.sum()).sqrt()


class AdaptiveGradClip(_UnitwiseClip):
    r"""Unit-wise adaptive gradient clipping (AGC).

    Brock, De, Smith, Simonyan, "High-Performance Large-Scale Image Recognition Without Normalization" (ICML 2021),
    as in ``timm.utils.agc``: for every output unit ``i`` of a parameter (a row of a linear weight, an output channel
    of a conv; a bias or gain is one unit), the gradient is rescaled when
    ``|G_i| / max(|W_i|, eps) > clip_factor``, to ``clip_factor * max(|W_i|, eps) / |G_i| * G_i``. The ``eps`` floor
    lets zero-initialised parameters still update. The paper does not clip the final classifier: name it in
    ``exclude``. Defaults ``clip_factor=0.01``, ``eps=1e-3`` are the paper's and timm's.

    The unit-wise gradient norms are measured in the engine's single read of the gradients (the per-parameter norms
    of the shared statistics are derived from them); the weights are read once for their unit norms. Under FSDP2
    (``fully_shard``, dim-0 sharding) each rank clips its own rows; the norms of sharded 1-D parameters travel in
    the step's single all-reduce. FSDP1 flattens parameters, which loses the units: not supported. A sparse gradient
    (``nn.Embedding(sparse=True)``) is clipped row by row from the norms of its coalesced rows. Frozen parameters are
    selected too, so a module unfrozen during the fit (``BackboneFinetuning``) is clipped from the step it joins.

    Logs the keys of :class:`ClipGradNorm` (2-norms; ``grad_clip/coef`` is post / pre), a step counting as clipped
    when any unit (on rank 0, under sharding) was rescaled.

    Args:
        clip_factor: the ``lambda`` of the paper, > 0.
        eps: floor of the unit weight norm, > 0.
        exclude: parameters left unclipped, in gradkit's selection grammar (:mod:`gradkit.selection`):
            module class names (``"Linear"``, matching subclasses; every parameter inside such a module) or
            ``"re:<regex>"`` patterns that match the whole qualified name of a parameter or of a module that holds it
            (``"re:head"``, ``"re:lm_head"``, ``"re:.*\.bias"``); one string is one pattern. Default: none, so the
            final layer is clipped too, unlike the paper and timm's training script: name it here.

    Raises:
        ValueError: at construction, for non-positive ``clip_factor`` or ``eps`` or an invalid regex; at setup, for an
            ``exclude`` pattern that matches no parameter, or another clipping callback or
            ``Trainer(gradient_clip_val=...)`` also present.
        RuntimeError: at setup, under FSDP1 or for a parameter sharded along a dimension other than 0.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import AdaptiveGradClip
        >>> trainer = Trainer(callbacks=[AdaptiveGradClip(clip_factor=0.01, exclude=["re:head"])])
    """

    def __init__(self, clip_factor: float = 0.01, eps: float = 1e-3, exclude: list[str] | None = None) -> None:
        super().__init__(AdaptiveGradClipPolicy(clip_factor, eps), exclude)

    @property
    def clip_factor(self) -> float:
        return self.policy.clip_factor

    @property
    def eps(self) -> float:
        return self.policy.eps


def _select_parameters(pl_module: torch.nn.Module, exclude: tuple[NamePattern, ...]) -> set[str]:
    """Names (cleaned) of the parameters not selected by any ``exclude`` pattern, frozen ones included.

    A frozen parameter may be unfrozen during the fit (``BackboneFinetuning``): it is then clipped like the others.
    Only the parameters an optimizer steps are ever clipped, so selecting frozen ones costs nothing.

    Raises:
        ValueError: naming a pattern that selects no parameter, the names nearest to it and a pattern that would.
    """
    params = [clean_name(n) for n, _ in pl_module.named_parameters()]
    modules = [(clean_name(n), m) for n, m in pl_module.named_modules()]
    excluded: set[str] = set()
    for pattern in exclude:
        matched = parameters_selected(pattern, modules, params)
        if not matched:
            names = [name for name, _ in modules if name] + params
            hint = no_match_hint(pattern, names, [type(m).__name__ for _, m in modules])
            raise ValueError(
                f"AdaptiveGradClip: `exclude` pattern '{pattern.text}' matches no trainable parameter of "
                f"`{type(pl_module).__name__}`, nor a frozen one: {hint}"
            )
        excluded |= matched
    return set(params) - excluded


# The callback class that applies a policy object given to `clip_gradients` (the public callbacks subclass these
# and only build the policy from their arguments).
_POLICY_CALLBACKS: dict[type[ClipPolicy], type[_ScalarClip | _ValueClip | _UnitwiseClip]] = {
    GradNormPolicy: _ScalarClip,
    GradValuePolicy: _ValueClip,
    AdaptiveGradClipPolicy: _UnitwiseClip,
    AutoClipPolicy: _ScalarClip,
    ZClipPolicy: _ScalarClip,
}
_WRAPPERS: weakref.WeakKeyDictionary[ClipPolicy, _GradClipCallback] = weakref.WeakKeyDictionary()


def clip_gradients(module: pl.LightningModule, optimizer: Optimizer, policy: _GradClipCallback | ClipPolicy) -> Tensor:
    r"""Clip the gradients of ``optimizer`` in a manual-optimization ``training_step`` and return their norm.

    Call it after ``self.manual_backward(loss)`` and before ``optimizer.step()``. It measures the gradients once,
    clips them with ``policy`` (one in-place multiply, no host sync), logs on logging steps like the callbacks, and
    returns the total norm before clipping (a device tensor, in the policy's norm; 2-norm for AGC, inf-norm for
    value clipping). Every other gradkit callback of the Trainer runs in the same pass, and the step is not measured
    or clipped again when ``optimizer.step()`` reaches ``on_before_optimizer_step``.

    Under 16-mixed AMP the gradients are still multiplied by the loss scale at this point (Lightning unscales inside
    ``optimizer.step()``, and calling ``GradScaler.unscale_`` here would make that call fail): norms and thresholds
    are computed on the unscaled values, from the scaler's scale tensor, so ``max_norm=1.0`` means the same as
    without AMP (``LightningModule.clip_gradients`` clips the scaled values instead, Lightning issue #18089).

    Args:
        module: the LightningModule (``self``).
        optimizer: the optimizer about to step, as returned by ``self.optimizers()``.
        policy: one of the clipping callbacks (``ZClip(...)``; if it is also in the Trainer's ``callbacks``, its
            state is saved in checkpoints) or a policy from :mod:`gradkit.clip`
            (``GradNormPolicy(1.0)``). Keep the same object across steps: adaptive policies carry state. One object
            may serve several optimizers: each optimizer keeps its own state, as with a callback. A callback keys
            it by optimizer index (``policy`` itself is optimizer 0's) and, when it is in the Trainer's ``callbacks``,
            saves all of them in checkpoints; a policy object carries the state of the first optimizer it clips,
            and the other optimizers' states live in gradkit, unsaved.

    Returns:
        The total gradient norm before clipping, a device scalar.

    Raises:
        RuntimeError: with automatic optimization (use the callbacks there).
        ValueError: if the Trainer has a different clipping callback, or ``policy`` is not a clipping policy.

    Example::

        class GAN(LightningModule):
            def __init__(self):
                super().__init__()
                self.automatic_optimization = False
                self.clip = ZClip()

            def training_step(self, batch, batch_idx):
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(self.loss(batch))
                norm = clip_gradients(self, opt, self.clip)
                opt.step()
    """
    trainer = module.trainer
    if module.automatic_optimization:
        raise RuntimeError(
            "`clip_gradients` is for manual optimization (`self.automatic_optimization = False`). With automatic "
            "optimization add the clipping callback to the Trainer instead: `Trainer(callbacks=[ClipGradNorm(1.0)])`."
        )
    if isinstance(policy, _GradClipCallback):
        clipper = policy
    elif isinstance(policy, ClipPolicy) and type(policy) in _POLICY_CALLBACKS:
        clipper = _WRAPPERS.get(policy)
        if clipper is None:
            # `policy` carries the state of the first optimizer it clips; every other optimizer gets its own.
            clipper = _WRAPPERS[policy] = _POLICY_CALLBACKS[type(policy)](policy, policy_owner=None)
    else:
        raise ValueError(
            f"`policy` must be a gradkit clipping callback or a policy from `gradkit.clip`, got "
            f"{type(policy).__name__}."
        )
    attached = [cb for cb in trainer.callbacks if isinstance(cb, _GradClipCallback)]
    if attached and attached[0] is not clipper:
        raise ValueError(
            f"The Trainer already has the clipping callback {type(attached[0]).__name__}; `clip_gradients` with "
            f"another policy ({type(policy).__name__}) would clip twice. Pass that callback as `policy` instead."
        )
    raw = getattr(optimizer, "_optimizer", optimizer)
    engine = Engine.of(trainer)
    if not attached:
        clipper._prepare_once(trainer, module)
    plan = engine.run(trainer, module, raw, extra=() if attached else (clipper,))
    if plan is None:
        plan = engine.last_plans[id(raw)]
    return plan.pre_clip_total(clipper.policy.norm_type)
