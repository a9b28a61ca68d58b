"""Device values on the host one step later, without a host sync: what lets a detector keep its statistics in
Python floats.

A running statistic (ZClip's EMA of the gradient norm, SpikeGuard's EMA of the loss) needs every past value, but the
decision of step ``t`` only needs the statistics *up to* step ``t - 1``. :class:`HostLag` copies step ``t``'s few
values to pinned host memory with a non-blocking copy (one ``cudaMemcpyAsync`` of a few bytes, queued behind the
kernels that computed them) and hands them to the host at step ``t + 1``, when the copy has long finished in a loop
whose host runs ahead of the device by less than a step. The statistics are then updated in Python floats (no device
operation at all), and the decision of step ``t`` costs a comparison with a Python number: a handful of kernel
launches instead of thirty. If the copy has not finished when the values are asked for (a device more than a step
behind the host), the host waits for that copy only (``cudaEventSynchronize``), not for the device's queue.

On the CPU the values are already on the host: nothing is copied. Outside CUDA and the CPU (MPS, XLA) the values
are copied with ``.to("cpu")``, which synchronizes there.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["HostLag", "as_float32", "host_to_device"]


class HostLag:
    """One step's small device vector, read on the host at the next step.

    Example::

        >>> lag = HostLag()
        >>> lag.push(torch.tensor([1.5, 0.0]))
        >>> lag.pop()
        [1.5, 0.0]
        >>> lag.pop() is None
        True
    """

    def __init__(self) -> None:
        self._host: Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._pending = False

    @property
    def pending(self) -> bool:
        """Whether values were pushed and not popped yet."""
        return self._pending

    def push(self, values: Tensor) -> None:
        """Start the copy of ``values`` (a 0-dim or 1-D device tensor) to the host. Replaces values not popped yet."""
        if values.device.type == "cpu":
            self._host = values
        elif values.device.type == "cuda":
            host = self._host
            if host is None or host.shape != values.shape or host.dtype != values.dtype or not host.is_pinned():
                host = self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            if self._event is None:
                self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = values.to("cpu")
        self._pending = True

    def pop(self) -> list[float] | None:
        """The values pushed last, as Python floats (``None`` if none are pending); waits for their copy if needed."""
        if not self._pending or self._host is None:
            return None
        self._pending = False
        if self._event is not None and self._host.is_pinned() and not self._event.query():
            # The device is more than a step behind the host: wait for this copy only (its stream up to it). In a
            # host-bound loop the copy finished long ago and `query` (no wait) said so.
            self._event.synchronize()
        # A host tensor read on the host: no device synchronization, so no sync detector should count it.
        with torch._C.DisableTorchFunction():
            values = self._host.tolist()
        return values if isinstance(values, list) else [values]  # a 0-dim tensor: pushed without a view op

    def clear(self) -> None:
        """Forget the pending values (a state loaded from a checkpoint replaces what they would have updated)."""
        self._pending = False


def as_float32(value: float) -> float:
    """``value`` rounded to float32: what a device comparison of a float32 tensor with the Python number compares
    with. A host test of a value read one step late against the same threshold then gives the device's answer.

    Example::

        >>> as_float32(0.1) == 0.1, as_float32(0.1)
        (False, 0.10000000149011612)
    """
    return struct.unpack("f", struct.pack("f", value))[0] if math.isfinite(value) else value


def host_to_device(values: Sequence[float], dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """A tensor of host ``values`` on ``device``, without making the host wait for the device.

    ``torch.tensor(values, device="cuda")`` copies from pageable host memory: a blocking copy, which synchronizes
    (and raises under ``torch.cuda.set_sync_debug_mode("error")``). Here the values go to pinned memory and the copy
    is queued with ``non_blocking=True``; PyTorch's caching host allocator keeps the pinned buffer alive until the
    copy has run. Other devices get an ordinary copy.

    Example::

        >>> host_to_device([0, 2], torch.long, "cpu")
        tensor([0, 2])
    """
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
