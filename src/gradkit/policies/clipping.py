"""Gradient clipping on the step's one-pass statistics: the clippers as plain torch objects, and their math.

Each clipper is a policy of the step pipeline (:mod:`gradkit.step.pipeline`): in ``decide`` it reads the total norm that
the pipeline measured once (no second pass over the gradients), writes a coefficient or a bound into the step's
``Decision``, and the pipeline multiplies the gradients once, with no host sync. The same objects work behind every
door: a plain loop or Fabric (:class:`~gradkit.GradKit`), and the Lightning ``Trainer``, whose callbacks of the same
names (:mod:`lightning_gradkit.callbacks.clip_callbacks`) subclass these classes. One class per algorithm, no base
class: what they share is a composed :class:`ClipLedger`, which each clipper's hooks call.

:class:`ClipGradNorm` and :class:`ClipGradValue` are here; :class:`~gradkit.AutoClip` and
:class:`~gradkit.ZClip`, whose threshold follows the history of norms, in
:mod:`gradkit.policies.history_clipping`; the unit-wise :class:`~gradkit.AdaptiveGradClip` in
:mod:`gradkit.policies.agc`.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradkit._util.arguments import check_float, validate_norm_type
from gradkit.step.plan import Decision, StepOutcome, StepStats
from gradkit.step.protocol import Stage, StatsRequest, StepContext

__all__ = [
    "NORM_EPS",
    "ClipDecision",
    "ClipGradNorm",
    "ClipGradValue",
    "ClipLedger",
    "LedgerHooks",
    "clip_coefficient",
    "clip_to_threshold",
    "describe",
    "norm_ratio",
]

#: Added to the total norm before dividing, as ``torch.nn.utils.clip_grad_norm_`` does.
NORM_EPS = 1e-6

#: Clipped-step flags wait in a list and are summed on device once per this many steps (and when logged or saved),
#: not with an add kernel every step.
_COUNT_EVERY = 64


# -- the math: device tensors in, device tensors out, no host sync -------------------------------------------------
def clip_coefficient(total_norm: Tensor, max_norm: float | Tensor) -> Tensor:
    """The coefficient of ``torch.nn.utils.clip_grad_norm_``: ``min(1, max_norm / (total_norm + 1e-6))``.

    Clamped on device, with no Python branch, so no host sync.

    Example::

        >>> clip_coefficient(torch.tensor(4.0), 2.0)
        tensor(0.5000)
    """
    return torch.clamp(max_norm / (total_norm + NORM_EPS), max=1.0)


def clip_to_threshold(total_norm: Tensor, threshold: Tensor | float) -> Tensor:
    """Scale to ``threshold`` only when the norm exceeds it: ``threshold / (total_norm + 1e-6)``, else exactly 1.

    Unlike :func:`clip_coefficient` a norm at or below the threshold is left bit-for-bit untouched (the rule of the
    ZClip reference implementation). An infinite norm gives 0, a NaN norm gives 1 (nothing to compare).
    """
    return torch.where(total_norm > threshold, threshold / (total_norm + NORM_EPS), torch.ones_like(total_norm))


def norm_ratio(post: Tensor | Callable[[], Tensor], pre: Tensor) -> Tensor:
    """``post / pre``, 1 where ``pre`` is 0: the single coefficient a per-unit or element-wise clip amounts to."""
    post = post() if callable(post) else post
    return torch.where(pre > 0, post / pre, torch.ones_like(pre))


# -- what a clipper keeps of its steps -------------------------------------------------------------------------------
#: A logged value: a tensor, or one worked out on logging steps only (a ``functools.partial`` of a module-level
#: function or a picklable callable object, never a closure: a clipper, and a Trainer holding it, must pickle).
_Deferred = Tensor | Callable[[], Tensor]


@dataclass
class ClipDecision:
    """What a clipper decided for one step, kept for logging (device tensors or deferred values).

    Attributes:
        pre: the total norm before the clip.
        post: the total norm after it.
        coef: the clip coefficient (for a per-unit or element-wise clip, ``post / pre``).
        clipped: the step's bool flag; ``None`` when it is ``pre > clip_above``, worked out when the counts are summed,
            for many steps in one comparison.
        threshold: the norm above which the step is clipped (logged by the adaptive clippers).
        clip_above: see ``clipped``.
        target: the norm a later evaluation of the step's closure is clipped to (``None``: not clipped).
    """

    pre: Tensor
    post: _Deferred
    coef: _Deferred
    clipped: Tensor | None
    threshold: _Deferred | None = None
    clip_above: float | None = None
    target: Tensor | float | None = None


def _resolve(value: _Deferred) -> Tensor:
    return value() if callable(value) else value


class ClipLedger:
    """What a clipper keeps of its steps, per optimizer (by index): the last decision, for the logged values, and
    the count of clipped steps since the last log, saved in checkpoints with the clipper's own per-optimizer state.

    Every clipper composes one; its ``decide`` calls :meth:`record`; the hooks that only pass on to it (``observe``,
    which calls :meth:`log` on logging steps, ``metrics``, ``state_dict``, ``load_state_dict``) come from
    :class:`LedgerHooks`.
    """

    def __init__(self) -> None:
        self.last: dict[int, ClipDecision] = {}
        self.clipped: dict[int, Tensor] = {}
        self.steps: dict[int, int] = {}
        self._uncounted: dict[tuple[int, float | None], list[Tensor]] = {}

    def record(self, stats: StepStats, decision: Decision, clip: ClipDecision) -> None:
        """Keep the step's clip and its clipped flag (the flags are summed every ``_COUNT_EVERY`` steps); mark the
        step's ``decision`` as decided by a clipper."""
        idx = stats.optimizer_idx
        if not decision.clipped:  # a clip form written marked the decision already
            decision.decide_clip()
        self.last[idx] = clip
        key = (idx, clip.clip_above if clip.clipped is None else None)
        pending = self._uncounted.setdefault(key, [])
        pending.append(clip.pre if clip.clipped is None else clip.clipped)
        if len(pending) >= _COUNT_EVERY:
            self.count_now(idx)
        self.steps[idx] = self.steps.get(idx, 0) + 1

    def count_now(self, idx: int) -> None:
        """Sum the waiting clipped flags of optimizer ``idx`` into its device counter (no host sync)."""
        for key in [k for k in self._uncounted if k[0] == idx]:
            stacked = torch.stack(self._uncounted.pop(key))
            above = key[1]
            added = (stacked if above is None else stacked > above).sum()
            count = self.clipped.get(idx)
            self.clipped[idx] = added if count is None else count.to(added.device) + added

    def clip_again(self, stats: StepStats, decision: Decision, norm_type: float) -> None:
        """Clip a later evaluation of the step's closure to the norm its first evaluation was clipped to, without
        feeding the clipper's statistics again."""
        clip = self.last.get(stats.optimizer_idx)
        if clip is not None and clip.target is not None:
            decision.clip_by(clip_to_threshold(decision.scaled(stats.norms[norm_type].total), clip.target))

    def log(self, idx: int, ctx: StepContext) -> None:
        """Log the step's values of optimizer ``idx`` (a logging step) and start a new clipped count."""
        if idx not in self.last:
            return
        suffix = f"/opt{idx}" if len(ctx.optimizers) > 1 else ""
        ctx.log({k + suffix: v for k, v in self.metrics(idx).items()})
        # A fresh counter: the logged fraction may still refer to the old one until the logger reads it.
        self.clipped.pop(idx, None)
        self.steps[idx] = 0

    def metrics(self, idx: int) -> dict[str, Tensor]:
        """The values logged for the last step of optimizer ``idx``, as device tensors (no host sync).

        ``grad_clip/pre_clip_norm`` and ``grad_clip/post_clip_norm`` (the total norm before and after clipping, in
        the clipper's norm), ``grad_clip/coef`` (the clip coefficient; for per-unit or element-wise clipping, the
        ratio of the two norms), ``grad_clip/clipped_fraction`` (the fraction of optimizer steps clipped since the
        previous log) and, for the adaptive clippers (``AutoClip``, ``ZClip``), ``grad_clip/threshold``.
        """
        decision = self.last[idx]
        steps = max(self.steps.get(idx, 0), 1)
        self.count_now(idx)
        clipped = self.clipped.get(idx)
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

    def state_dict(self, policies: dict[int, dict[str, Any]] | None = None) -> dict[str, Any]:
        """The checkpointed state: ``policies`` (the clipper's state per optimizer; empty ones for a stateless
        clipper), the clipped counts and the steps since the last log."""
        for idx in list(self.steps):
            self.count_now(idx)
        return {
            "policies": {i: {} for i in self.steps} if policies is None else policies,
            "clipped": {i: c.detach().cpu() for i, c in self.clipped.items()},
            "steps": dict(self.steps),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> dict[int, dict[str, Any]]:
        """Restore :meth:`state_dict`; returns the clipper's saved state per optimizer index."""
        self.clipped = {int(i): c.clone() for i, c in state_dict.get("clipped", {}).items()}
        self._uncounted.clear()
        self.steps = {int(i): int(n) for i, n in state_dict.get("steps", {}).items()}
        return {int(i): state for i, state in state_dict.get("policies", {}).items()}


def describe(clipper: object, **config: object) -> str:
    """``Name(arg=value, ...)``: a clipper as its constructor call."""
    return f"{type(clipper).__name__}({', '.join(f'{k}={v!r}' for k, v in config.items())})"


# -- the clippers ----------------------------------------------------------------------------------------------------
class LedgerHooks:
    """The pipeline hooks every clipper takes from its :class:`ClipLedger` (``self._ledger``) as they are: ``observe``
    (log on logging steps), ``metrics``, ``state_dict`` and ``load_state_dict``. A clipper with state of its own
    (AutoClip's history, ZClip's statistics) overrides the last two. Methods of a base class, not module functions
    assigned as methods: the pipeline keeps hooks as bound methods, and a bound method pickles by its name."""

    _ledger: ClipLedger

    def observe(self, stats: StepStats, outcome: StepOutcome, ctx: StepContext) -> None:
        if stats.logging_step:
            self._ledger.log(stats.optimizer_idx, ctx)

    def metrics(self, optimizer_idx: int = 0) -> dict[str, Tensor]:
        """The values the class logs for the last step of an optimizer, as device tensors (no host sync)."""
        return self._ledger.metrics(optimizer_idx)

    def state_dict(self) -> dict[str, Any]:
        return self._ledger.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._ledger.load_state_dict(state_dict)


class ClipGradNorm(LedgerHooks):
    r"""Clip gradients by their total p-norm: the same result as ``torch.nn.utils.clip_grad_norm_``.

    Every optimizer step, the gradients are multiplied by ``min(1, max_norm / (total_norm + 1e-6))``. The total norm
    is the one the shared statistics measured (no second pass over the gradients), after the AMP unscale and over
    the whole accumulation window; under DDP, FSDP1 and FSDP2 it is the global norm and every rank applies the same
    coefficient. With a fused optimizer behind a gate the coefficient goes to the kernel as its ``grad_scale``: no
    write pass at all.

    Logged on logging steps: ``grad_clip/pre_clip_norm``, ``grad_clip/post_clip_norm``, ``grad_clip/coef`` and
    ``grad_clip/clipped_fraction`` (steps clipped since the previous log); ``/opt{i}`` is appended with several
    optimizers. No ``grad_clip/threshold``: it would be ``max_norm`` at every step (the adaptive clippers log
    theirs). No clipper writes events: a clipped step is routine, not an incident.

    Args:
        max_norm: the largest total norm, > 0.
        norm_type: the p of the norm, ``>= 1`` or ``float("inf")``; 2.0 by default.

    Raises:
        ValueError: if ``max_norm`` <= 0 or ``norm_type`` < 1.

    Example::

        >>> import torch
        >>> from gradkit import ClipGradNorm, GradKit
        >>> model = torch.nn.Linear(4, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> kit = GradKit(model, optimizer, ClipGradNorm(max_norm=1.0))
        >>> model(torch.ones(2, 4)).sum().backward()
        >>> kit.step(optimizer)
        True
    """

    stage = Stage.CLIP

    def __init__(self, max_norm: float, norm_type: float = 2.0) -> None:
        self.max_norm = check_float("max_norm", max_norm, above=0.0)
        self.norm_type = validate_norm_type(norm_type)
        self._ledger = ClipLedger()

    def __repr__(self) -> str:
        return describe(self, max_norm=self.max_norm, norm_type=self.norm_type)

    def request_stats(self, request: StatsRequest) -> None:
        request.norm_types.add(self.norm_type)

    def decide(self, stats: StepStats, decision: Decision, ctx: StepContext) -> None:
        if not stats.has_gradients:
            return
        pre = decision.scaled(stats.norms[self.norm_type].total)
        coef = clip_coefficient(pre, self.max_norm)
        decision.clip_by(coef)
        # The clipped flag is `pre > max_norm`, compared for many steps at once when counted. No threshold is logged.
        post = functools.partial(operator.mul, pre, coef)
        self._ledger.record(stats, decision, ClipDecision(pre, post, coef, None, clip_above=self.max_norm))

    def decide_again(self, stats: StepStats, decision: Decision, first: Decision, ctx: StepContext) -> None:
        # Every evaluation of a re-evaluating closure is clipped, as Lightning's `gradient_clip_val` clips each one.
        if stats.has_gradients:
            decision.clip_by(clip_coefficient(decision.scaled(stats.norms[self.norm_type].total), self.max_norm))


class ClipGradValue(LedgerHooks):
    r"""Clip every gradient element to ``[-clip_value, clip_value]``, as ``torch.nn.utils.clip_grad_value_``.

    The clamp is applied by the pipeline right after its single multiply (accumulation scaling), after the AMP
    unscale; while the gradients still carry the loss scale (a fused optimizer under 16-mixed AMP) the bound is
    scaled by it, so it means the same. The logged norms are inf-norms (the largest absolute element), the quantity
    value clipping bounds: the post-clip value is ``min(pre, clip_value)``, derived without reading the gradients
    again. Logs the keys of :class:`ClipGradNorm`; writes no events.

    Args:
        clip_value: the bound, > 0.

    Raises:
        ValueError: if ``clip_value`` <= 0.

    Example::

        >>> import torch
        >>> from gradkit import ClipGradValue, GradKit
        >>> model = torch.nn.Linear(4, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> kit = GradKit(model, optimizer, ClipGradValue(clip_value=0.5))
    """

    stage = Stage.CLIP
    #: The norm it reads: the largest absolute element, to report whether a step was clipped.
    norm_type = math.inf

    def __init__(self, clip_value: float) -> None:
        self.clip_value = check_float("clip_value", clip_value, above=0.0)
        self._ledger = ClipLedger()

    def __repr__(self) -> str:
        return describe(self, clip_value=self.clip_value)

    def request_stats(self, request: StatsRequest) -> None:
        request.norm_types.add(self.norm_type)

    def decide(self, stats: StepStats, decision: Decision, ctx: StepContext) -> None:
        if not stats.has_gradients:
            return
        pre = decision.scaled(stats.norms[math.inf].total)
        decision.clamp(self.clip_value)
        post = torch.clamp(pre, max=self.clip_value)
        coef = functools.partial(norm_ratio, post, pre)
        self._ledger.record(stats, decision, ClipDecision(pre, post, coef, pre > self.clip_value))

    def decide_again(self, stats: StepStats, decision: Decision, first: Decision, ctx: StepContext) -> None:
        if stats.has_gradients:
            decision.clamp(self.clip_value)
