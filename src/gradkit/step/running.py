"""NaN-masked running statistics of a scalar stream: an exponential moving average or a sliding window.

Both track the mean and the (population) variance. Non-finite values are *masked*: they change nothing (OLMo-core's
loss-spike window, by contrast, keeps a NaN for the whole window, so one bad step disables the detector for that
long). The same rules on device (:func:`ema_update`, :func:`spike_decision`, :func:`spike_step`,
:class:`RunningMoments`: no value read to the host, for ``SpikeRollback``) and on the host (:class:`HostMoments`:
Python floats fed each value one step late, :mod:`gradkit.step.host_lag`, for ``SpikeGuard``). Both stateful forms
round-trip through ``state_dict`` exactly, so a resumed run continues identically.
"""

from __future__ import annotations

import math
from collections import deque

import torch
from torch import Tensor

from gradkit.step.norms import finite_mask

__all__ = [
    "HostMoments",
    "RunningMoments",
    "ema_update",
    "spike_decision",
    "spike_step",
    "std_of",
]


# A standard deviation below this fraction of |mean| (plus an absolute epsilon) is treated as this value, so a
# constant stream does not turn every tiny fluctuation into an infinite z-score.
_RELATIVE_STD_FLOOR = 1e-6
_ABSOLUTE_STD_FLOOR = 1e-12


def ema_update(mean: Tensor, var: Tensor, count: Tensor, x: Tensor, alpha: float) -> tuple[Tensor, Tensor, Tensor]:
    r"""One NaN-masked step of the exponentially weighted mean and variance: the new ``(mean, var, count)``.

    The weight of the new value is :math:`w = \max(1/n, 1 - \alpha)` where :math:`n` counts the finite values
    seen so far: the first values are averaged with equal weights (Welford's algorithm: exact mean and population
    variance), later ones exponentially with decay ``alpha``. The update follows Finch (2009), "Incremental
    calculation of weighted mean and variance", eq. 143:

    .. math::
        \delta = x - \mu,\quad \mu' = \mu + w\delta,\quad \sigma'^2 = (1 - w)(\sigma^2 + w\delta^2)

    A non-finite ``x`` leaves all three unchanged.

    Example::

        >>> m, v, n = torch.zeros(()), torch.zeros(()), torch.zeros(())
        >>> for x in (1.0, float("nan"), 3.0):
        ...     m, v, n = ema_update(m, v, n, torch.tensor(x), alpha=0.9)
        >>> m, v, n
        (tensor(2.), tensor(1.), tensor(2.))
    """
    x = _like(x, mean)
    valid = torch.isfinite(x)
    n = count + valid
    # max(1/n, 1 - alpha) where valid, else 0: fewer, fused ops (this runs every step).
    w = torch.where(valid, n.clamp_min(1.0).reciprocal().clamp_min(1.0 - alpha), 0.0)
    delta = torch.where(valid, x - mean, 0.0)
    incr = w * delta
    return mean + incr, (1.0 - w) * torch.addcmul(var, delta, incr), n


def _like(x: Tensor, ref: Tensor) -> Tensor:
    x = x.detach()
    return x if x.dtype == ref.dtype else x.to(ref.dtype)


def std_of(mean: Tensor, var: Tensor) -> Tensor:
    """The standard deviation, floored at ``1e-6 * |mean| + 1e-12`` (a constant stream has no zero divisor)."""
    floor = mean.abs().mul_(_RELATIVE_STD_FLOOR).add_(_ABSOLUTE_STD_FLOOR)
    return torch.maximum(var.clamp_min(0.0).sqrt_(), floor)


def spike_decision(
    x: Tensor, mean: Tensor, var: Tensor, count: Tensor, z_threshold: float, warmup: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Decide whether ``x`` is an upward spike, and the value to feed the running statistics with.

    ``z = (x - mean) / std``; a spike is a finite ``x`` with ``z > z_threshold`` once ``count >= warmup``. The
    value to record is ``x`` clamped to ``mean + z_threshold * std`` (after warm-up), as ZClip (Kumar et al.,
    2025, "ZClip: Adaptive Spike Mitigation for LLM Pre-Training") feeds its EMA with the clipped norm: one spike
    does not inflate the statistics, and a lasting level shift is absorbed gradually instead of being flagged
    forever.

    Returns:
        ``(spike, z, value_to_record, std)``, device tensors (``z`` is 0 before warm-up and for non-finite ``x``).
    """
    x = _like(x, mean)
    std = std_of(mean, var)
    decide = (count >= warmup) & torch.isfinite(x)
    z = torch.where(decide, (x - mean) / std, 0.0)
    spike = z > z_threshold
    record = torch.where(decide, torch.minimum(x, torch.add(mean, std, alpha=z_threshold)), x)
    return spike, z, record, std


def spike_step(
    x: Tensor, mean: Tensor, var: Tensor, count: Tensor, z_threshold: float, warmup: int, alpha: float
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`spike_decision` then :func:`ema_update` with the value it records, sharing their terms: about half the
    device operations (kernel launches) of the two calls, equal up to rounding (the clamp is applied to the deviation
    ``x - mean`` instead of the value).

    Returns:
        ``(spike, z, std, mean, var, count)``: the decision as :func:`spike_decision` returns it (``std`` of the
        statistics before the step), then the updated statistics.
    """
    x = _like(x, mean)
    valid = finite_mask(x)
    std = std_of(mean, var)
    delta = x - mean
    z = torch.where(valid & (count >= warmup), delta / std, 0.0)
    spike = z > z_threshold
    deviation = torch.where(spike, std * z_threshold, torch.where(valid, delta, 0.0))
    n = count + valid
    # max(1/n, 1 - alpha) where valid (then n >= 1), else 0, as in `ema_update`.
    w = torch.where(valid, n.reciprocal().clamp_min(1.0 - alpha), 0.0)
    incr = w * deviation
    return spike, z, std, mean + incr, (1.0 - w) * torch.addcmul(var, deviation, incr), n


class RunningMoments:
    """NaN-masked exponentially weighted mean and variance of a scalar stream, on device (see :func:`ema_update`).

    Args:
        alpha: decay of the history, in ``(0, 1)``; the effective memory is about ``1 / (1 - alpha)`` values.
    """

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.mean = torch.zeros(())
        self.var = torch.zeros(())
        self.count = torch.zeros(())

    def to(self, device: torch.device) -> RunningMoments:
        self.mean, self.var, self.count = (t.to(device) for t in (self.mean, self.var, self.count))
        return self

    def moments(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(mean, var, count)`` as device scalars."""
        return self.mean, self.var, self.count

    def update(self, x: Tensor) -> None:
        self.mean, self.var, self.count = ema_update(self.mean, self.var, self.count, x, self.alpha)

    def spike_step(self, x: Tensor, z_threshold: float, warmup: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Decide whether ``x`` is a spike and record it (:func:`spike_step`); ``(spike, z, mean, std)`` with the
        mean and standard deviation from before ``x``."""
        mean = self.mean
        spike, z, std, self.mean, self.var, self.count = spike_step(
            x, mean, self.var, self.count, z_threshold, warmup, self.alpha
        )
        return spike, z, mean, std

    def state_dict(self) -> dict[str, Tensor]:
        return {"mean": self.mean.cpu(), "var": self.var.cpu(), "count": self.count.cpu()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        device = self.mean.device
        self.mean, self.var, self.count = (state[k].to(device) for k in ("mean", "var", "count"))


class HostMoments:
    """The statistics of :class:`RunningMoments` (``alpha``) or of the last ``window`` finite values, in Python floats,
    for a detector that reads each value on the host one step late
    (:class:`~gradkit.step.host_lag.HostLag`): the same rules (:func:`ema_update`, :func:`std_of`,
    :func:`spike_decision`'s clamp), no device operation, and the same ``state_dict`` format.

    Args:
        alpha: decay of the EMA, in ``(0, 1)``.
        window: keep the last ``window`` finite values instead of an EMA.
    """

    def __init__(self, alpha: float, window: int | None = None) -> None:
        self.alpha = alpha
        self.window = window
        self._mean = 0.0
        self._var = 0.0
        self._count = 0
        self._values: deque[float] = deque(maxlen=window)
        self._written = 0  # finite values written to the window so far (its ring position)

    def moments(self) -> tuple[float, float, int]:
        """``(mean, var, count)``: of the window's values, or the EMA's."""
        if self.window is None:
            return self._mean, self._var, self._count
        n = len(self._values)
        mean = sum(self._values) / n if n else 0.0
        var = sum((v - mean) ** 2 for v in self._values) / n if n else 0.0
        return mean, var, n

    def std(self) -> float:
        """:func:`std_of` of the current statistics."""
        mean, var, _ = self.moments()
        return max(math.sqrt(max(var, 0.0)), abs(mean) * _RELATIVE_STD_FLOOR + _ABSOLUTE_STD_FLOOR)

    def threshold(self, z_threshold: float, warmup: int) -> float:
        """The value above which the next value is a spike (``z > z_threshold``); ``inf`` during warm-up."""
        mean, _, count = self.moments()
        return mean + z_threshold * self.std() if count >= warmup else math.inf

    def record(self, x: float, spike: bool, z_threshold: float) -> None:
        """Feed a value: a spike is recorded clamped to ``mean + z_threshold * std``; a non-finite one is not."""
        if not math.isfinite(x):
            return
        if spike:
            x = min(x, self.moments()[0] + z_threshold * self.std())
        if self.window is not None:
            self._values.append(x)
            self._written += 1
            return
        self._count += 1
        w = max(1.0 / self._count, 1.0 - self.alpha)
        delta = x - self._mean
        incr = w * delta
        self._mean += incr
        self._var = (1.0 - w) * (self._var + delta * incr)

    def state_dict(self) -> dict[str, Tensor]:
        if self.window is None:
            return {
                "mean": torch.tensor(self._mean, dtype=torch.float64),
                "var": torch.tensor(self._var, dtype=torch.float64),
                "count": torch.tensor(float(self._count)),
            }
        ring = torch.full((self.window,), math.nan, dtype=torch.float64)
        for i, v in enumerate(self._values):  # a ring buffer, NaN where empty: slot = position % window
            ring[(self._written - len(self._values) + i) % self.window] = v
        return {"values": ring, "position": torch.tensor(self._written, dtype=torch.long)}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        if self.window is None:
            self._mean, self._var, self._count = float(state["mean"]), float(state["var"]), int(state["count"])
            return
        ring = state["values"]
        if ring.numel() != self.window:
            raise ValueError(
                f"The saved window holds {ring.numel()} values but this one holds {self.window}. Resume with the same "
                "`window`."
            )
        written = int(state["position"])
        kept = min(written, self.window)
        flat = ring.tolist()
        self._values = deque((flat[i % self.window] for i in range(written - kept, written)), maxlen=self.window)
        self._written = written
