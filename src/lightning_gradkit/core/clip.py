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

from lightning_gradkit._arguments import check_float, check_int, validate_norm_type
from lightning_gradkit.core.norms import finite_mask

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


def clip_to_threshold(total_norm: Tensor, threshold: Tensor) -> Tensor:
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

    A unit is a row along dim 0 of a weight (an output unit: :func:`~lightning_gradkit.core.norms.row_norms`), or a
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
        finite = torch.isfinite(norm)
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
    everything stays on the device (no ``.item()``), a non-finite norm never enters the statistics (one Inf would
    otherwise poison the mean forever), and the state survives checkpoints.

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
        self.mean: Tensor | None = None
        self.var: Tensor | None = None
        self.count: Tensor | None = None
        #: The norm the last step was clipped to when it was clipped (the reciprocal rule's ``g*``, or
        #: ``max_norm``); a later evaluation of the same step is clipped to it too.
        self.target: Tensor | None = None

    def _config(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "z_threshold": self.z_threshold,
            "warmup_steps": self.warmup_steps,
            "max_norm": self.max_norm,
        }

    def fresh(self) -> ZClipPolicy:
        return ZClipPolicy(**self._config())

    def _ensure_state(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        if self.mean is None or self.var is None or self.count is None:
            self.mean = torch.zeros((), dtype=torch.float32, device=device)
            self.var = torch.zeros((), dtype=torch.float32, device=device)
            self.count = torch.zeros((), dtype=torch.long, device=device)
        elif self.mean.device != device:
            self.mean, self.var, self.count = self.mean.to(device), self.var.to(device), self.count.to(device)
        return self.mean, self.var, self.count

    def __call__(self, total_norm: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        g = total_norm.to(torch.float32)
        mean, var, count = self._ensure_state(g.device)
        finite = finite_mask(g)
        warming = count < self.warmup_steps
        after = ~warming
        zt = self.z_threshold

        # The reciprocal z-score rule (after warm-up): a spike is pulled to `mu + z_threshold**2 * sigma / z`.
        std = var.sqrt()
        std_eps = std + self.eps
        z = (g - mean) / std_eps
        adjusted = torch.where(z > zt, mean + (std * zt**2) / z, g)

        # One update for both phases, with weight w and the value x it records:
        #   warm-up (Welford): x = g, w = 1 / k,      mu' = mu + w d,  var' = var + w (d (x - mu') - var)
        #   after (EMA):       x = g*, w = 1 - alpha, mu' = mu + w d,  var' = var + w ((x - mu')^2 - var)
        # with d = x - mu: the EMA lines are `alpha mu + (1 - alpha) x` and `alpha var + (1 - alpha) (x - mu')^2`.
        x = torch.where(warming, g, adjusted)
        w = (count + 1).reciprocal().masked_fill(after, 1.0 - self.alpha)
        d = x - mean
        new_mean = torch.addcmul(mean, w, d)
        r = x - new_mean
        new_var = torch.addcmul(var, w, r * torch.where(warming, d, r) - var)

        # The norm above which this step is clipped (`z > z_threshold`, or above `max_norm`), and the norm it is
        # then clipped to (the reciprocal rule's `g*`, or `max_norm`); during warm-up only `max_norm` clips.
        threshold = torch.add(mean, std_eps, alpha=zt)
        if self.max_norm is not None:
            threshold = threshold.clamp_max(self.max_norm)
            adjusted = adjusted.clamp_max(self.max_norm)
        ceiling = math.inf if self.max_norm is None else self.max_norm
        threshold = threshold.masked_fill(warming, ceiling)
        target = adjusted.masked_fill(warming, ceiling)
        clipped = g > target
        coef = (target / (g + NORM_EPS)).masked_fill(~clipped, 1.0)  # at or below the target: exactly 1
        self.target = target
        # A non-finite norm never enters the statistics.
        self.mean = torch.where(finite, new_mean, mean)
        self.var = torch.where(finite, new_var, var)
        self.count = count + finite
        return coef, clipped, threshold

    def state_dict(self) -> dict[str, Any]:
        if self.mean is None or self.var is None or self.count is None:
            return {}
        return {"mean": self.mean.detach().cpu(), "var": self.var.detach().cpu(), "count": self.count.detach().cpu()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            self.mean = self.var = self.count = None
            return
        self.mean = state_dict["mean"].clone()
        self.var = state_dict["var"].clone()
        self.count = state_dict["count"].clone()
