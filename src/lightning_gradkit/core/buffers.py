"""Put back the module buffers a skipped step's forward passes wrote.

A skipped optimizer step leaves the parameters and the optimizer state alone, but the forward passes of its
accumulation window have already run, and a forward in training mode writes module buffers: BatchNorm's
``running_mean``, ``running_var`` and ``num_batches_tracked``, or any buffer a model updates itself (an EMA of
its inputs, a step counter). A NaN batch makes every BatchNorm running statistic NaN, and every later eval-mode
forward returns NaN. :class:`BufferGuard` keeps the values from before the window's first forward and puts them
back when the step is skipped.

Only what is written is copied. Every tensor counts its in-place writes (``Tensor._version``), so the guard
learns which buffers a forward writes: the first window copies every buffer, later windows only those written so
far. The unit is the module: BatchNorm's kernel updates ``running_mean`` and ``running_var`` without counting
the write (only ``num_batches_tracked.add_(1)`` counts), so every buffer of a module with one counted write is
taken as written, and so is every buffer of a norm layer that tracks running statistics in training mode
(``_NormBase``: BatchNorm, SyncBatchNorm, InstanceNorm with ``track_running_stats=True``). A model without
BatchNorm (or another written buffer) copies nothing and pays a Python read of one integer per buffer per window.
A buffer that is first written later (a BatchNorm put back into training mode when a backbone is unfrozen) is
picked up at that step; if that very step is skipped, its old value is unknown and :meth:`BufferGuard.restore`
names it. A buffer *replaced* by its module (``self.ema = 0.9 * self.ema + x`` instead of an in-place
``mul_``/``add_``) is put back as the object it was. A kernel that writes a buffer without counting the write
(as BatchNorm's does) in a module that is not a ``_NormBase`` and has no other counted write is not seen.

Two ways to restore, matching the two ways a skip is known (see :mod:`lightning_gradkit.strategy`):

- on the host (an ordinary optimizer, whose skip flag is read once per step): nothing runs unless the step was
  skipped;
- on the device (a fused optimizer, whose skip flag never reaches the host): ``torch.where(skip, saved, current)``
  per written buffer, no host synchronization.

Pure PyTorch; no Lightning here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

__all__ = ["BufferGuard", "missed_buffers_message"]


@dataclass
class _Entry:
    """One buffer slot: the module that owns it, its name there, and what was captured at the window start."""

    module: nn.Module
    name: str
    qualname: str
    tensor: Tensor | None = None
    version: int = -1
    saved: Tensor | None = None


class BufferGuard:
    """The module buffers of a model as they were before an accumulation window's first forward.

    Args:
        module: the model whose buffers (all of its submodules') are guarded.

    Example::

        >>> net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        >>> guard = BufferGuard(net)
        >>> guard.capture()
        >>> _ = net(torch.tensor([[1.0, float("nan")], [0.0, 1.0]]))
        >>> bool(net[1].running_mean.isnan().any())
        True
        >>> guard.restore()
        []
        >>> net[1].running_mean, int(net[1].num_batches_tracked)
        (tensor([0., 0.]), 0)
    """

    def __init__(self, module: nn.Module) -> None:
        self._entries = [
            _Entry(owner, name, f"{prefix}.{name}" if prefix else name)
            for prefix, owner in module.named_modules(remove_duplicate=True)
            for name, buf in owner._buffers.items()
            if buf is not None and buf.device.type != "meta"
        ]
        # Before the first window every buffer is watched; afterwards only those a forward has written.
        self._watched = list(range(len(self._entries)))
        self._learned = False
        self._open = False

    @property
    def open(self) -> bool:
        """Whether a window was captured and not closed yet (by :meth:`restore` or :meth:`keep`)."""
        return self._open

    @property
    def watched(self) -> list[str]:
        """Qualified names of the buffers copied at each window start."""
        return [self._entries[i].qualname for i in self._watched]

    def capture(self) -> None:
        """Remember every buffer's object and write count, and copy the values of the watched ones (on device)."""
        for entry in self._entries:
            entry.tensor = entry.module._buffers.get(entry.name)
            entry.version = entry.tensor._version if entry.tensor is not None else -1
        sources, targets = [], []
        for i in self._watched:
            entry = self._entries[i]
            current = entry.tensor
            if current is None:
                continue
            if entry.saved is None or entry.saved.shape != current.shape or entry.saved.dtype != current.dtype:
                entry.saved = torch.empty_like(current)
            sources.append(current)  # under no_grad (the callers), so nothing to detach
            targets.append(entry.saved)
        if targets:
            with torch.no_grad():
                torch._foreach_copy_(targets, sources)
        self._open = True

    def keep(self) -> list[str]:
        """Close the window with its writes kept (the step was applied); learn which buffers were written.

        Returns:
            The names of buffers written for the first time in this window (not watched, so not copied).
        """
        return self._close()

    def restore(self, skip: Tensor | None = None) -> list[str]:
        """Put the watched buffers this window wrote back to their captured values, and close the window.

        Args:
            skip: ``None`` to restore unconditionally (the skip is known on the host); a bool device scalar to
                restore only where it is true, with ``torch.where`` on device and no host synchronization.

        Returns:
            The names of buffers this window wrote that were not watched: their values before the window are
            unknown, so they keep the window's writes.
        """
        if not self._open:
            return []
        written = self._written()
        with torch.no_grad():
            for i in self._watched:
                entry = self._entries[i]
                if entry.tensor is None or entry.saved is None or i not in written:
                    continue
                current = entry.module._buffers.get(entry.name)
                if skip is None:
                    if current is not entry.tensor:
                        entry.module._buffers[entry.name] = entry.tensor
                    entry.tensor.copy_(entry.saved)
                elif current is entry.tensor or current is None:
                    entry.tensor.copy_(torch.where(skip, entry.saved, entry.tensor))
                else:  # replaced: choose between the captured object (restored) and the new one, on device
                    entry.tensor.copy_(torch.where(skip, entry.saved, current.to(entry.saved.dtype)))
                    entry.module._buffers[entry.name] = entry.tensor
        return self._close()

    def close(self, skipped: bool | None, skip: Tensor | None = None) -> list[str]:
        """End the window as its optimizer step went: :meth:`restore` if it was skipped, :meth:`keep` if applied.

        Args:
            skipped: the skip decision as read on the host, or ``None`` when only the device knows it (a fused
                optimizer skipped through ``found_inf``): then ``skip``, the device flag, chooses on device.
            skip: the step's bool device flag; needed when ``skipped`` is ``None``.

        Returns:
            On a skip read on the host, the buffers the window wrote that cannot be put back (see :meth:`restore`).
        """
        if not self._open:
            return []
        if skipped is None:
            assert skip is not None, "a skip known only on device needs its flag"
            self.restore(skip)
            return []
        if skipped:
            return self.restore()
        self.keep()  # the names it returns were written by an applied step: nothing to put back
        return []

    def _written(self) -> set[int]:
        """The entries this window wrote: every buffer of a module with a counted write or a replaced buffer, and
        of a norm layer that tracks running statistics in training mode."""
        modules = {id(entry.module) for entry in self._entries if _wrote(entry)}
        return {i for i, entry in enumerate(self._entries) if id(entry.module) in modules}

    def _close(self) -> list[str]:
        if not self._open:
            return []
        self._open = False
        watched = set(self._watched)
        written = self._written()
        missed = sorted(written - watched)
        if not self._learned:
            self._watched, self._learned = sorted(written), True
            missed = []
        elif missed:
            self._watched = sorted(watched | written)
        for i, entry in enumerate(self._entries):
            entry.tensor = None
            if i not in self._watched:
                entry.saved = None
        return [self._entries[i].qualname for i in missed]


def _wrote(entry: _Entry) -> bool:
    """Whether the buffer was written since the capture, or belongs to a norm layer that updates its running
    statistics without counting the write."""
    current = entry.module._buffers.get(entry.name)
    if current is not entry.tensor or (current is not None and current._version != entry.version):
        return True
    module = entry.module
    return isinstance(module, _NormBase) and module.track_running_stats and module.training


def missed_buffers_message(step: int, missed: list[str]) -> str:
    """The warning for the buffers a skipped step wrote that no earlier step wrote (:meth:`BufferGuard.close`)."""
    return (
        f"gradkit: the skipped step at global step {step} wrote module buffers that no earlier step wrote "
        f"({', '.join(missed[:5])}), so their values from before it are unknown and they keep this step's writes. "
        "Later skips restore them."
    )
