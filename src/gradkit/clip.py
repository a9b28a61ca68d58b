"""Gradient-clipping algorithms as small tensor functions and small stateful policies.

No Lightning in here: the functions take norms (device tensors) and return clip coefficients (device tensors), with
no host synchronization, so they run unchanged in a plain PyTorch loop, in the callbacks of
:mod:`lightning_gradkit.callbacks.clipping` and in :func:`lightning_gradkit.clip_gradients`.

Each policy turns the statistics of one optimizer step into a decision:

- :class:`GradNormPolicy`: a scalar coefficient from the total norm (``torch.nn.utils.clip_grad_norm_``).
- :class:`GradValuePolicy`: an element-wise bound (``torch.nn.utils.clip_grad_value_``).
- :class:`AdaptiveGradClipPolicy`: one coefficient per output unit (AGC, Brock et al. 2021).
- :class:`AutoClipPolicy`: a scalar coefficient from a percentile of past total norms (Seetharaman et al. 2020).
- :class:`ZClipPolicy`: a scalar coefficient from an EMA z-score of the total norm (Kumar et al. 2025).

The stateful ones keep their state as device tensors, updated with ``torch.where`` instead of Python branches, and
round-trip it through ``state_dict``/``load_state_dict`` exactly.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from gradkit._arguments import check_float, check_int, validate_norm_type
from gradkit.host_lag import HostLag, as_float32
from gradkit.norms import finite_mask

__all__ = [
    "MAX_HISTORY",
    "NORM_EPS",
    "AdaptiveGradClipPolicy",
    "AutoClipPolicy",
    "ClipPolicy",
    "GradNormPolicy",
    "GradValuePolicy",
    "ScalarClipPolicy",
    "ZClipPolicy",
    "agc_coefficients",
    "clip_coefficient",
    "clip_to_threshold",
    "nan_percentile",
]


#: Maximum ``AutoClip`` history: 10 million norms are 40 MB of device memory, far beyond any percentile's need.
MAX_HISTORY = 10_000_000

#: Added to the total norm before dividing, as ``torch.nn.utils.clip_grad_norm_`` does.
NORM_EPS = 1e-6


def _positive(name: str, value: float) -> float:
    return check_float(name, value, above=0.0)


# -- pure functions ------------------------------------------------------------------------------------------------
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


def agc_coefficients(grad_norms: Tensor, weight_norms: Tensor, clip_factor: float, eps: float = 1e-3) -> Tensor:
    """Unit-wise AGC coefficients: ``min(1, clip_factor * max(|W_i|, eps) / max(|G_i|, 1e-6))``.

    Brock et al. 2021, "High-Performance Large-Scale Image Recognition Without Normalization", eq. 3: a unit's
    gradient is rescaled when ``|G_i| / max(|W_i|, eps) > clip_factor``. The ``eps`` floor lets zero-initialised
    units (e.g. a zeroed last layer of a residual branch) still update. Multiplying by these coefficients gives
    bit-for-bit the result of ``timm.utils.agc.adaptive_clip_grad``.

    A unit is a row along dim 0 of a weight (an output unit: :func:`~gradkit.norms.row_norms`), or a
    whole bias, gain or scalar (its norm).

    Args:
        grad_norms: unit-wise norms of the gradients (any shape).
        weight_norms: unit-wise norms of the weights, same shape.
        clip_factor: the ``lambda`` of the paper.
        eps: floor of the weight norm.
    """
    max_norm = weight_norms.clamp(min=eps) * clip_factor
    return torch.clamp(max_norm / grad_norms.clamp(min=NORM_EPS), max=1.0)


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


# -- policies ------------------------------------------------------------------------------------------------------
class ClipPolicy:
    """Base of the clipping policies: a configuration plus, for adaptive ones, device-tensor state."""

    #: the p of the norm the policy reads (``inf`` for value clipping: the largest absolute element).
    norm_type: float = 2.0

    def state_dict(self) -> dict[str, Any]:
        """The policy's state (tensors on the CPU); empty for stateless policies."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (tensors move to the gradients' device on the next step)."""

    def fresh(self) -> ClipPolicy:
        """A new policy with the same configuration and empty state (one per optimizer)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}({args})"

    def _config(self) -> dict[str, Any]:
        raise NotImplementedError


class ScalarClipPolicy(ClipPolicy):
    """A policy that clips with one coefficient for all gradients, computed from their total norm."""

    def __call__(self, total_norm: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Decide one step.

        Args:
            total_norm: the total norm (``norm_type``) of the gradients the optimizer would receive, a device scalar.

        Returns:
            ``(coef, clipped, threshold)``: the coefficient to multiply every gradient by, a bool scalar (the norm
            exceeded the threshold) and the threshold used (all device scalars, fp32).
        """
        raise NotImplementedError


class GradNormPolicy(ScalarClipPolicy):
    """Clip the total p-norm to ``max_norm``, exactly as ``torch.nn.utils.clip_grad_norm_``.

    Args:
        max_norm: the largest total norm, > 0.
        norm_type: the p of the norm, ``>= 1`` or ``float("inf")``.

    Raises:
        ValueError: if ``max_norm`` is not a positive finite number or ``norm_type`` < 1.
    """

    def __init__(self, max_norm: float, norm_type: float = 2.0) -> None:
        self.max_norm = _positive("max_norm", max_norm)
        self.norm_type = validate_norm_type(norm_type)
        self._threshold: Tensor | None = None

    def _config(self) -> dict[str, Any]:
        return {"max_norm": self.max_norm, "norm_type": self.norm_type}

    def fresh(self) -> GradNormPolicy:
        return GradNormPolicy(**self._config())

    def threshold(self, total_norm: Tensor) -> Tensor:
        """``max_norm`` as a device scalar like ``total_norm``: made once per device and dtype, not a fill kernel
        every step."""
        threshold = self._threshold
        if threshold is None or threshold.device != total_norm.device or threshold.dtype != total_norm.dtype:
            threshold = self._threshold = torch.full_like(total_norm, self.max_norm)
        return threshold

    def __call__(self, total_norm: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return clip_coefficient(total_norm, self.max_norm), total_norm > self.max_norm, self.threshold(total_norm)


class GradValuePolicy(ClipPolicy):
    """Clamp every gradient element to ``[-clip_value, clip_value]``, as ``torch.nn.utils.clip_grad_value_``.

    It reads the inf-norm (the largest absolute element) only to report whether the step was clipped.

    Args:
        clip_value: the bound, > 0.

    Raises:
        ValueError: if ``clip_value`` is not a positive finite number.
    """

    norm_type = math.inf

    def __init__(self, clip_value: float) -> None:
        self.clip_value = _positive("clip_value", clip_value)

    def _config(self) -> dict[str, Any]:
        return {"clip_value": self.clip_value}

    def fresh(self) -> GradValuePolicy:
        return GradValuePolicy(**self._config())


class AdaptiveGradClipPolicy(ClipPolicy):
    """Unit-wise adaptive gradient clipping (AGC), Brock et al. 2021 (see :func:`agc_coefficients`).

    Args:
        clip_factor: the ``lambda`` of the paper (0.01 by default, as in the paper and timm), > 0.
        eps: floor of the unit weight norm (1e-3 by default, as in the paper and timm), > 0.

    Raises:
        ValueError: if ``clip_factor`` or ``eps`` is not a positive finite number.
    """

    def __init__(self, clip_factor: float = 0.01, eps: float = 1e-3) -> None:
        self.clip_factor = _positive("clip_factor", clip_factor)
        self.eps = _positive("eps", eps)

    def _config(self) -> dict[str, Any]:
        return {"clip_factor": self.clip_factor, "eps": self.eps}

    def fresh(self) -> AdaptiveGradClipPolicy:
        return AdaptiveGradClipPolicy(**self._config())

    def __call__(self, grad_norms: Tensor, weight_norms: Tensor) -> Tensor:
        """Coefficients for unit norms of the gradients (as the optimizer would see them) and of the weights."""
        return agc_coefficients(grad_norms, weight_norms, self.clip_factor, self.eps)


class AutoClipPolicy(ScalarClipPolicy):
    """Clip to a percentile of the history of total norms (AutoClip, Seetharaman et al. 2020).

    "AutoClip: Adaptive Gradient Clipping for Source Separation Networks" (MLSP 2020): every step the total norm
    joins the history, then gradients are clipped (as ``clip_grad_norm_``) to the ``percentile``-th percentile of the
    history, current norm included; the paper recommends ``percentile=10``. The paper keeps the whole history; here
    it is a ring buffer of the last ``history_size`` finite norms, on the gradients' device (NaN marks empty slots).
    Non-finite norms never enter the history.

    Args:
        percentile: in ``(0, 100]``; 10 by default.
        history_size: number of past norms kept (10000 by default), >= 1.

    Raises:
        ValueError: if ``percentile`` is outside ``(0, 100]`` or ``history_size`` is not an integer in
            ``[1, 10_000_000]``.
    """

    def __init__(self, percentile: float = 10.0, history_size: int = 10000) -> None:
        self.percentile = check_float(
            "percentile", percentile, above=0.0, maximum=100.0, hint="The paper recommends 10 (in (0, 100])."
        )
        self.history_size = check_int(
            "history_size", history_size, 1, MAX_HISTORY, hint="It is a device buffer of that many floats."
        )
        self.history: Tensor | None = None
        self.count: Tensor | None = None

    def _config(self) -> dict[str, Any]:
        return {"percentile": self.percentile, "history_size": self.history_size}

    def fresh(self) -> AutoClipPolicy:
        return AutoClipPolicy(**self._config())

    def _ensure_state(self, device: torch.device) -> tuple[Tensor, Tensor]:
        if self.history is None or self.count is None:
            self.history = torch.full((self.history_size,), math.nan, dtype=torch.float32, device=device)
            self.count = torch.zeros((), dtype=torch.long, device=device)
        elif self.history.device != device:
            self.history, self.count = self.history.to(device), self.count.to(device)
        return self.history, self.count

    def __call__(self, total_norm: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        norm = total_norm.to(torch.float32)
        history, count = self._ensure_state(norm.device)
        finite = finite_mask(norm)
        slot = (count % self.history_size).reshape(1)
        kept = history.gather(0, slot)
        history.scatter_(0, slot, torch.where(finite, norm.reshape(1), kept))
        count.add_(finite.to(count.dtype))
        threshold = nan_percentile(history, self.percentile)
        # No finite norm seen yet: nothing to clip against.
        coef = torch.where(torch.isnan(threshold), torch.ones_like(norm), clip_coefficient(norm, threshold))
        return coef, norm > threshold, threshold

    def state_dict(self) -> dict[str, Any]:
        if self.history is None or self.count is None:
            return {}
        return {"history": self.history.detach().cpu(), "count": self.count.detach().cpu()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            self.history = self.count = None
            return
        history = state_dict["history"].to(torch.float32)
        if history.numel() != self.history_size:
            raise ValueError(
                f"AutoClip: the saved history holds {history.numel()} norms but `history_size={self.history_size}`. "
                "Resume with the same `history_size`."
            )
        self.history, self.count = history.clone(), state_dict["count"].clone()


class ZClipPolicy(ScalarClipPolicy):
    """Z-score clipping against an EMA of the total norm (ZClip, Kumar et al. 2025).

    "ZClip: Adaptive Spike Mitigation for LLM Pre-Training" (arXiv:2504.02507), the ``zscore`` mode with
    ``adaptive_scaling`` of the reference implementation:

    - warm-up: the first ``warmup_steps`` norms initialise the mean and (population) variance; only ``max_norm``
      clips during warm-up.
    - then, with ``sigma = sqrt(var)`` and ``z = (g - mu) / (sigma + 1e-6)``: when ``z > z_threshold`` the norm is
      clipped to ``g* = mu + z_threshold**2 * sigma / z`` (the reciprocal rule: the larger the spike, the closer to
      the mean), otherwise ``g* = g``; with ``max_norm`` the target is ``min(g*, max_norm)``.
    - the statistics are updated with ``g*`` (not the raw spike): ``mu <- alpha mu + (1 - alpha) g*``, then
      ``var <- alpha var + (1 - alpha) (g* - mu)**2`` with the new ``mu``.

    The threshold it returns (and ZClip logs as ``grad_clip/threshold``) is the norm above which a step is clipped,
    ``mu + z_threshold * (sigma + 1e-6)`` from the statistics before the step (``z > z_threshold`` exactly when the
    norm exceeds it), capped by ``max_norm``; during warm-up ``max_norm`` (``inf`` without one). The norm a clipped
    step is scaled to, ``min(g*, max_norm)``, is kept in :attr:`target`.

    Defaults ``alpha=0.97``, ``z_threshold=2.5``, ``warmup_steps=25`` are the paper's. Unlike the reference code,
    no step reads a value to the host (no ``.item()``), a non-finite norm never enters the statistics (one Inf would
    otherwise poison the mean forever), and the state survives checkpoints.

    The statistics are Python floats, updated with each norm one step later: a step's decision needs the statistics
    of the steps before it only, so its norm reaches the host through a non-blocking copy
    (:class:`~gradkit.host_lag.HostLag`) and is folded in at the next step (or when the statistics are
    read: :attr:`mean`, :meth:`state_dict`). On the device a step costs a comparison with a Python number and, past
    warm-up, the reciprocal rule: about 10 operations instead of 35 for the same decision on device statistics.

    Args:
        alpha: EMA smoothing factor in ``(0, 1)``.
        z_threshold: z-score above which a norm is a spike, > 0.
        warmup_steps: number of finite norms that initialise the statistics, >= 1.
        max_norm: optional absolute ceiling on the total norm, > 0.

    Raises:
        ValueError: for ``alpha`` outside ``(0, 1)``, non-positive ``z_threshold`` or ``max_norm``, or
            ``warmup_steps`` < 1.
    """

    eps = 1e-6

    def __init__(
        self, alpha: float = 0.97, z_threshold: float = 2.5, warmup_steps: int = 25, max_norm: float | None = None
    ) -> None:
        self.alpha = check_float("alpha", alpha, above=0.0, below=1.0, hint="The paper uses 0.97.")
        self.z_threshold = _positive("z_threshold", z_threshold)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 1, hint="The paper uses 25.")
        self.max_norm = None if max_norm is None else _positive("max_norm", max_norm)
        self._mean = 0.0
        self._var = 0.0
        self._count = 0
        # The norm of the last step, on its way to the host, and the spike threshold it was compared with.
        self._lag = HostLag()
        self._spike_above = math.inf
        #: The norm the last step was clipped to when it was clipped (the reciprocal rule's ``g*``, or ``max_norm``):
        #: a tensor, a float, or ``None`` (not clipped); a later evaluation of the same step is clipped to it too.
        self.target: Tensor | float | None = None

    def _config(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "z_threshold": self.z_threshold,
            "warmup_steps": self.warmup_steps,
            "max_norm": self.max_norm,
        }

    def fresh(self) -> ZClipPolicy:
        return ZClipPolicy(**self._config())

    # -- the statistics (host floats) -----------------------------------------------------------------------------
    @property
    def mean(self) -> Tensor:
        """The EMA of the norm (fp64 scalar), every norm passed so far included."""
        self._fold()
        return torch.tensor(self._mean, dtype=torch.float64)

    @property
    def var(self) -> Tensor:
        """The EMA variance of the norm (fp64 scalar), every norm passed so far included."""
        self._fold()
        return torch.tensor(self._var, dtype=torch.float64)

    @property
    def count(self) -> Tensor:
        """The number of finite norms seen (long scalar)."""
        self._fold()
        return torch.tensor(self._count, dtype=torch.long)

    def _fold(self) -> None:
        """Update the statistics with the norm still on its way to the host (the previous step's)."""
        values = self._lag.pop()
        if values is None:
            return
        g = values[0]
        if not math.isfinite(g):
            return
        if self._count < self.warmup_steps:  # Welford: the population mean and variance of the first norms
            self._count += 1
            delta = g - self._mean
            self._mean += delta / self._count
            self._var += (delta * (g - self._mean) - self._var) / self._count
            return
        # The device compared the fp32 norm with the fp32 rounding of the threshold: the same test here.
        if g > as_float32(self._spike_above):
            std = math.sqrt(self._var)
            g = self._mean + self.z_threshold**2 * std * (std + self.eps) / (g - self._mean)
        self._count += 1
        self._mean = self.alpha * self._mean + (1 - self.alpha) * g
        self._var = self.alpha * self._var + (1 - self.alpha) * (g - self._mean) ** 2

    # -- one step ---------------------------------------------------------------------------------------------------
    def decide(self, total_norm: Tensor) -> tuple[Tensor | None, Tensor | None, float]:
        """Decide one step with as few device operations as the rule allows.

        Returns:
            ``(coef, clipped, threshold)``: the coefficient (``None``: nothing to clip, during warm-up without
            ``max_norm``), the clipped flag (``None``: the norm exceeded ``threshold``, compared when counted) and
            the threshold (a float).
        """
        self._fold()
        g = total_norm if total_norm.dtype == torch.float32 else total_norm.to(torch.float32)
        self._lag.push(g.reshape(1))
        ceiling = math.inf if self.max_norm is None else self.max_norm
        if self._count < self.warmup_steps:  # only `max_norm` clips
            self._spike_above = math.inf
            self.target = self.max_norm
            return (None if self.max_norm is None else clip_to_threshold(g, self.max_norm)), None, ceiling
        std = math.sqrt(self._var)
        self._spike_above = self._mean + self.z_threshold * (std + self.eps)
        spike = g > self._spike_above
        # The reciprocal rule, `mu + z_threshold**2 * sigma / z` with `z = (g - mu) / (sigma + eps)`.
        adjusted = torch.reciprocal(g - self._mean).mul_(self.z_threshold**2 * std * (std + self.eps)).add_(self._mean)
        target = torch.where(spike, adjusted, g)
        if self.max_norm is not None:
            target = target.clamp_max(self.max_norm)
            clipped = g > target
        else:
            clipped = spike  # a spike is pulled below its norm; anything else is left alone
        self.target = target
        coef = (target / (g + NORM_EPS)).masked_fill_(~clipped, 1.0)  # at or below the target: exactly 1
        return coef, clipped, min(self._spike_above, ceiling)

    def __call__(self, total_norm: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        coef, clipped, threshold = self.decide(total_norm)
        g = total_norm.to(torch.float32)
        if coef is None:
            coef = torch.ones_like(g)
        if clipped is None:
            clipped = g > threshold
        return coef, clipped, torch.full_like(g, threshold)

    def state_dict(self) -> dict[str, Any]:
        self._fold()
        if self._count == 0:
            return {}
        return {
            "mean": torch.tensor(self._mean, dtype=torch.float64),
            "var": torch.tensor(self._var, dtype=torch.float64),
            "count": torch.tensor(self._count, dtype=torch.long),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._lag.clear()
        self.target = None
        if not state_dict:
            self._mean, self._var, self._count = 0.0, 0.0, 0
            return
        self._mean = float(state_dict["mean"])
        self._var = float(state_dict["var"])
        self._count = int(state_dict["count"])
