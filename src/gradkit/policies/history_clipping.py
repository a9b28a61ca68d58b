"""The clippers whose threshold follows the history of the total gradient norm: :class:`AutoClip` (a percentile of
the past norms) and :class:`ZClip` (an EMA z-score), as plain torch objects.

Like every clipper (:mod:`gradkit.policies.clipping`), each reads the total norm the pipeline measured once, writes a
coefficient into the step's decision and keeps what it logs in a :class:`~gradkit.policies.clipping.ClipLedger`; the
statistics are kept per optimizer and saved by ``state_dict`` so that a resumed run clips exactly as an uninterrupted
one.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gradkit._util.arguments import check_float, check_int
from gradkit.policies.clipping import (
    NORM_EPS,
    ClipDecision,
    ClipLedger,
    LedgerHooks,
    clip_coefficient,
    clip_to_threshold,
    describe,
)
from gradkit.step.host_lag import HostLag, as_float32
from gradkit.step.norms import finite_mask
from gradkit.step.plan import Decision, StepOutcome, StepStats
from gradkit.step.protocol import Stage, StatsRequest, StepContext

__all__ = ["MAX_HISTORY", "AutoClip", "ZClip", "nan_percentile"]

#: Maximum ``AutoClip`` history: 10 million norms are 40 MB of device memory, far beyond any percentile's need.
MAX_HISTORY = 10_000_000


def nan_percentile(values: Tensor, percentile: float) -> Tensor:
    """The ``percentile`` (0-100) of the non-NaN entries of a 1-D tensor, interpolated linearly like
    ``numpy.percentile``; NaN when every entry is NaN.

    Computed with a sort and a gather on the tensor's device (``torch.nanquantile`` validates its arguments on the
    host in some builds); no host sync.

    Example::

        >>> nan_percentile(torch.tensor([3.0, float("nan"), 1.0, 2.0]), 50.0)
        tensor(2.)
    """
    ordered, _ = torch.sort(values)  # NaN sorts last
    count = (~torch.isnan(values)).sum()
    rank = (count - 1).clamp(min=0).to(values.dtype) * (percentile / 100.0)
    low = rank.floor()
    high = torch.minimum(low + 1, (count - 1).clamp(min=0).to(values.dtype))
    lo_val = ordered.gather(0, low.long().reshape(1)).squeeze(0)
    hi_val = ordered.gather(0, high.long().reshape(1)).squeeze(0)
    result = lo_val + (hi_val - lo_val) * (rank - low)
    return torch.where(count > 0, result, torch.full_like(result, math.nan))


def _host_scalar(value: float) -> Tensor:
    """A threshold kept as a Python float, as the 0-dim tensor logged on logging steps."""
    return torch.tensor(value, dtype=torch.float32)


@dataclass
class _NormHistory:
    """One optimizer's AutoClip history: a ring of the last finite norms (NaN: an empty slot) and their count."""

    norms: Tensor
    count: Tensor


class AutoClip(LedgerHooks):
    r"""Clip to a percentile of the history of total gradient norms (AutoClip).

    Seetharaman, Wichern, Pardo, Le Roux, "AutoClip: Adaptive Gradient Clipping for Source Separation Networks"
    (IEEE MLSP 2020): each step the total 2-norm joins the history, then the gradients are clipped (as
    ``clip_grad_norm_``) to the ``percentile``-th percentile of all norms seen so far, the current one included.
    The paper recommends ``percentile=10``. The paper keeps the whole history; here it is a ring buffer of the last
    ``history_size`` finite norms, kept on the gradients' device (no host sync), one per optimizer; non-finite norms
    never enter it, nor the norm of a step a policy skipped (``NonFiniteGuard``, ``SpikeGuard``, ...): the history
    is the run's without that batch. It is saved in checkpoints.

    Logs, besides the keys of :class:`~gradkit.ClipGradNorm`, ``grad_clip/threshold`` (the percentile);
    writes no events.

    Args:
        percentile: in ``(0, 100]``; 10.0 by default.
        history_size: number of past norms kept, >= 1; 10000 by default.

    Raises:
        ValueError: if ``percentile`` is outside ``(0, 100]`` or ``history_size`` is not an integer in
            ``[1, 10_000_000]``; at ``load_state_dict``, for a history saved with another ``history_size``.

    Example::

        >>> from gradkit import AutoClip
        >>> clipper = AutoClip(percentile=10.0)
    """

    stage = Stage.CLIP
    norm_type = 2.0

    def __init__(self, percentile: float = 10.0, history_size: int = 10000) -> None:
        self.percentile = check_float(
            "percentile", percentile, above=0.0, maximum=100.0, hint="The paper recommends 10 (in (0, 100])."
        )
        self.history_size = check_int(
            "history_size", history_size, 1, MAX_HISTORY, hint="It is a device buffer of that many floats."
        )
        self._ledger = ClipLedger()
        self._histories: dict[int, _NormHistory | None] = {}

    def __repr__(self) -> str:
        return describe(self, percentile=self.percentile, history_size=self.history_size)

    def request_stats(self, request: StatsRequest) -> None:
        request.norm_types.add(self.norm_type)

    def _history(self, idx: int, device: torch.device) -> _NormHistory:
        history = self._histories.get(idx)
        if history is None:
            norms = torch.full((self.history_size,), math.nan, dtype=torch.float32, device=device)
            history = self._histories[idx] = _NormHistory(norms, torch.zeros((), dtype=torch.long, device=device))
        elif history.norms.device != device:
            history.norms, history.count = history.norms.to(device), history.count.to(device)
        return history

    def decide(self, stats: StepStats, decision: Decision, ctx: StepContext) -> None:
        if not stats.has_gradients:
            return
        pre = decision.scaled(stats.norms[2.0].total)
        norm = pre.to(torch.float32)
        history = self._history(stats.optimizer_idx, norm.device)
        joins = finite_mask(norm)
        if decision.skip is not None:
            # Every skip is decided by now (the guards' stage runs before the clippers'): a skipped step's norm stays
            # out of the history, as if its batch never came (it is not clipped: the step is not applied).
            joins = joins & ~decision.skip
        slot = (history.count % self.history_size).reshape(1)
        kept = history.norms.gather(0, slot)
        history.norms.scatter_(0, slot, torch.where(joins, norm.reshape(1), kept))
        history.count.add_(joins.to(history.count.dtype))
        threshold = nan_percentile(history.norms, self.percentile)
        # No finite norm seen yet: nothing to clip against.
        coef = torch.where(torch.isnan(threshold), torch.ones_like(norm), clip_coefficient(norm, threshold))
        decision.clip_by(coef)
        post = functools.partial(operator.mul, pre, coef)
        clip = ClipDecision(pre, post, coef, norm > threshold, threshold, target=threshold)
        self._ledger.record(stats, decision, clip)

    def decide_again(self, stats: StepStats, decision: Decision, first: Decision, ctx: StepContext) -> None:
        # A later evaluation of the step's closure is clipped to the first one's target; the history is fed once.
        if stats.has_gradients:
            self._ledger.clip_again(stats, decision, self.norm_type)

    def state_dict(self) -> dict[str, Any]:
        """Per optimizer, the ``history`` (NaN: an empty slot) and the ``count`` of norms it took, on the CPU."""
        policies = {
            i: {} if h is None else {"history": h.norms.detach().cpu(), "count": h.count.detach().cpu()}
            for i, h in self._histories.items()
        }
        return self._ledger.state_dict(policies)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._histories = {}
        for idx, state in self._ledger.load_state_dict(state_dict).items():
            if not state:
                self._histories[idx] = None
                continue
            norms = state["history"].to(torch.float32)
            if norms.numel() != self.history_size:
                raise ValueError(
                    f"AutoClip: the saved history holds {norms.numel()} norms but `history_size={self.history_size}`. "
                    "Resume with the same `history_size`."
                )
            self._histories[idx] = _NormHistory(norms.clone(), state["count"].clone())


@dataclass
class _ZStatistics:
    """One optimizer's ZClip statistics, host floats, and its last step: the norm on its way to the host
    (:class:`~gradkit.step.host_lag.HostLag`), the step's outcome once it was applied (asked whether the step was
    skipped before its norm is folded in), the spike threshold it was compared with, and the norm it was clipped to
    (the reciprocal rule's ``g*``, or ``max_norm``; ``None``: not clipped), which a later evaluation of the same
    step's closure is clipped to too."""

    mean: float = 0.0
    var: float = 0.0
    count: int = 0
    lag: HostLag = field(default_factory=HostLag)
    outcome: StepOutcome | None = None
    spike_above: float = math.inf
    target: Tensor | float | None = None


class ZClip(LedgerHooks):
    r"""Clip gradient-norm spikes detected by a z-score against an EMA of the total norm (ZClip).

    Kumar, Owen, Roy Chowdhury, Güra, "ZClip: Adaptive Spike Mitigation for LLM Pre-Training" (arXiv:2504.02507,
    2025), the ``zscore`` mode with reciprocal ("adaptive scaling") clipping of the reference implementation,
    defaults ``alpha=0.97``, ``z_threshold=2.5``, ``warmup_steps=25``:

    - the first ``warmup_steps`` finite total 2-norms initialise the mean ``mu`` and (population) variance
      ``sigma**2`` (only ``max_norm`` clips meanwhile);
    - then ``z = (g - mu) / (sigma + 1e-6)``; when ``z > z_threshold`` the gradients are scaled to the norm
      ``g* = mu + z_threshold**2 * sigma / z`` (the larger the spike, the closer to the mean; never above
      ``max_norm`` when given), otherwise left bit-for-bit untouched;
    - ``mu <- alpha mu + (1 - alpha) g*``, then ``sigma**2 <- alpha sigma**2 + (1 - alpha) (g* - mu)**2`` with the
      new ``mu``: the clipped norm, so a spike does not inflate them.

    Unlike the reference code, no step reads a value to the host (no ``.item()``), a non-finite norm never enters
    the statistics (one Inf would poison the mean forever), nor the norm of a step a policy skipped
    (``NonFiniteGuard``, ``SpikeGuard``, ...: the statistics are the run's without that batch), each optimizer has its
    own, and they are saved in checkpoints. The statistics are Python floats, updated with each norm one step later:
    a step's decision needs the statistics of the steps before it only, so its norm reaches the host through a
    non-blocking copy (:class:`~gradkit.step.host_lag.HostLag`) and is folded in at the next step, or when the state is
    read, once the step's fate is known (a fused optimizer's skip flag travels the same way). On the
    device a step costs a comparison with a Python number and, past warm-up, the reciprocal rule: about 10
    operations instead of 35 for the same decision on device statistics.

    Logs, besides the keys of :class:`~gradkit.ClipGradNorm`, ``grad_clip/threshold``: the norm above
    which the step is clipped, ``mu + z_threshold * (sigma + 1e-6)`` from the statistics before the step (capped by
    ``max_norm``; ``max_norm``, or ``inf`` without one, during warm-up). It writes no events.

    Args:
        alpha: EMA smoothing factor in ``(0, 1)``.
        z_threshold: z-score above which the norm is clipped, > 0.
        warmup_steps: number of finite norms that initialise the statistics, >= 1.
        max_norm: optional absolute ceiling on the total norm, > 0; ``None`` (default) for none. The reference
            implementation defaults to ``max_grad_norm=1.0``, which also clips every step whose norm exceeds 1
            (during warm-up too): pass ``max_norm=1.0`` to match it.

    Raises:
        ValueError: for ``alpha`` outside ``(0, 1)``, ``z_threshold`` or ``max_norm`` <= 0, or ``warmup_steps`` < 1.

    Example::

        >>> from gradkit import ZClip
        >>> clipper = ZClip(alpha=0.97, z_threshold=2.5)
    """

    stage = Stage.CLIP
    norm_type = 2.0
    eps = 1e-6

    def __init__(
        self, alpha: float = 0.97, z_threshold: float = 2.5, warmup_steps: int = 25, max_norm: float | None = None
    ) -> None:
        self.alpha = check_float("alpha", alpha, above=0.0, below=1.0, hint="The paper uses 0.97.")
        self.z_threshold = check_float("z_threshold", z_threshold, above=0.0)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 1, hint="The paper uses 25.")
        self.max_norm = None if max_norm is None else check_float("max_norm", max_norm, above=0.0)
        self._ledger = ClipLedger()
        self._statistics: dict[int, _ZStatistics] = {}
        #: The statistics whose norm this step pushed, given the step's outcome at `observe`.
        self._awaiting: _ZStatistics | None = None

    def __repr__(self) -> str:
        config = {"alpha": self.alpha, "z_threshold": self.z_threshold, "warmup_steps": self.warmup_steps}
        return describe(self, **config, max_norm=self.max_norm)

    def request_stats(self, request: StatsRequest) -> None:
        request.norm_types.add(self.norm_type)

    def _fold(self, stats: _ZStatistics) -> None:
        """Update the statistics with the norm still on its way to the host (the previous step's), unless a policy
        skipped that step: the statistics stay as if its batch never came."""
        values = stats.lag.pop()
        outcome, stats.outcome = stats.outcome, None
        if values is None or not math.isfinite(g := values[0]) or (outcome is not None and outcome.was_skipped()):
            return
        if stats.count < self.warmup_steps:  # Welford: the population mean and variance of the first norms
            stats.count += 1
            delta = g - stats.mean
            stats.mean += delta / stats.count
            stats.var += (delta * (g - stats.mean) - stats.var) / stats.count
            return
        # The device compared the fp32 norm with the fp32 rounding of the threshold: the same test here.
        if g > as_float32(stats.spike_above):
            std = math.sqrt(stats.var)
            g = stats.mean + self.z_threshold**2 * std * (std + self.eps) / (g - stats.mean)
        stats.count += 1
        stats.mean = self.alpha * stats.mean + (1 - self.alpha) * g
        stats.var = self.alpha * stats.var + (1 - self.alpha) * (g - stats.mean) ** 2

    def _clip(self, stats: _ZStatistics, total_norm: Tensor) -> tuple[Tensor | None, Tensor | None, float]:
        """One step, with as few device operations as the rule allows: ``(coef, clipped, threshold)``, the
        coefficient (``None``: nothing to clip, in warm-up without ``max_norm``), the clipped flag (``None``: the norm
        exceeded ``threshold``, compared when counted) and the threshold."""
        self._fold(stats)
        g = total_norm if total_norm.dtype == torch.float32 else total_norm.to(torch.float32)
        stats.lag.push(g.reshape(1))
        self._awaiting = stats  # its outcome comes at `observe`
        ceiling = math.inf if self.max_norm is None else self.max_norm
        if stats.count < self.warmup_steps:  # only `max_norm` clips
            stats.spike_above = math.inf
            stats.target = self.max_norm
            return (None if self.max_norm is None else clip_to_threshold(g, self.max_norm)), None, ceiling
        std = math.sqrt(stats.var)
        stats.spike_above = stats.mean + self.z_threshold * (std + self.eps)
        spike = g > stats.spike_above
        # The reciprocal rule, `mu + z_threshold**2 * sigma / z` with `z = (g - mu) / (sigma + eps)`.
        scale = self.z_threshold**2 * std * (std + self.eps)
        adjusted = torch.reciprocal(g - stats.mean).mul_(scale).add_(stats.mean)
        target = torch.where(spike, adjusted, g)
        if self.max_norm is not None:
            target = target.clamp_max(self.max_norm)
            clipped = g > target
        else:
            clipped = spike  # a spike is pulled below its norm; anything else is left alone
        stats.target = target
        coef = (target / (g + NORM_EPS)).masked_fill_(~clipped, 1.0)  # at or below the target: exactly 1
        return coef, clipped, min(stats.spike_above, ceiling)

    def decide(self, stats: StepStats, decision: Decision, ctx: StepContext) -> None:
        if not stats.has_gradients:
            return
        own = self._statistics.get(stats.optimizer_idx)
        if own is None:
            own = self._statistics[stats.optimizer_idx] = _ZStatistics()
        pre = decision.scaled(stats.norms[2.0].total)
        coef, clipped, above = self._clip(own, pre)
        if coef is not None:  # None: the warm-up, which leaves the gradients
            decision.clip_by(coef)
        clip = ClipDecision(
            pre=pre,
            post=pre if coef is None else functools.partial(operator.mul, pre, coef),
            coef=functools.partial(torch.ones_like, pre) if coef is None else coef,
            clipped=clipped,
            threshold=functools.partial(_host_scalar, above),
            clip_above=above if clipped is None else None,
            target=own.target,
        )
        self._ledger.record(stats, decision, clip)

    def decide_again(self, stats: StepStats, decision: Decision, first: Decision, ctx: StepContext) -> None:
        # A later evaluation of the step's closure is clipped to the first one's target; the history is fed once.
        if stats.has_gradients:
            self._ledger.clip_again(stats, decision, self.norm_type)

    def observe(self, stats: StepStats, outcome: StepOutcome, ctx: StepContext) -> None:
        awaiting, self._awaiting = self._awaiting, None
        if awaiting is not None:  # asked whether the step was skipped when its norm reaches the host
            awaiting.outcome = outcome
        super().observe(stats, outcome, ctx)

    def state_dict(self) -> dict[str, Any]:
        """Per optimizer, the ``mean`` and ``var`` (float64) and ``count`` of the statistics, every norm passed so far
        included (empty before the first finite norm)."""
        policies: dict[int, dict[str, Any]] = {}
        for idx, stats in self._statistics.items():
            self._fold(stats)
            policies[idx] = (
                {}
                if stats.count == 0
                else {
                    "mean": torch.tensor(stats.mean, dtype=torch.float64),
                    "var": torch.tensor(stats.var, dtype=torch.float64),
                    "count": torch.tensor(stats.count, dtype=torch.long),
                }
            )
        return self._ledger.state_dict(policies)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._statistics = {}
        for idx, state in self._ledger.load_state_dict(state_dict).items():
            stats = self._statistics[idx] = _ZStatistics()
            if state:
                stats.mean, stats.var, stats.count = float(state["mean"]), float(state["var"]), int(state["count"])
