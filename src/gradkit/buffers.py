"""The module buffers of a model as they were at a point, put back exactly: what a skipped step and a replay undo.

A skipped optimizer step leaves the parameters and the optimizer state alone, but the forward passes of its
accumulation window have already run, and a forward in training mode writes module buffers: BatchNorm's
``running_mean``, ``running_var`` and ``num_batches_tracked``, or any buffer a model updates itself (an EMA of its
inputs, a codebook, a step counter). A NaN batch makes every BatchNorm running statistic NaN, and every later
eval-mode forward returns NaN. A replay of ``training_step`` (the culprit search, the checkpointing measurement)
writes the same buffers and must leave no trace either.

One definition serves both (:class:`BufferState`): every buffer *slot* (the owning module and the name) with the
tensor object it held and a copy of its values. Putting it back puts the object back in its slot (a buffer the
code *replaced*, ``self.ema = 0.9 * self.ema + x``, gets its old object again) and its values back into that object
(a buffer written in place, through ``.data`` or by a kernel that does not count the write, gets its old values).
Nothing is inferred from write counters (``Tensor._version``): a ``.data`` write does not bump them and a restore
does, so any inference either misses writes or reports false ones. The copy is one ``torch._foreach_copy_`` per
(device, dtype) group of all buffers: a few kernel launches and the buffers' bytes (BatchNorm statistics, position
ids, rotary tables: kilobytes to a few megabytes), the price of knowing the state for sure.

Two ways to put it back, matching the two ways a skip is known:

- on the host (an ordinary optimizer, whose skip flag is read once per step): a copy back, only on a skipped step;
- on the device (a fused optimizer, whose skip flag never reaches the host): every buffer becomes
  ``skip ? saved : current`` bit for bit, computed on integer views of the bytes (``current + skip * (saved -
  current)``, wrapping, which is exact for any dtype, NaN and Inf included): three multi-tensor operations per
  element size, no host synchronization. A replaced buffer's slot cannot be chosen on device: such a slot gets its
  old object back with the new values chosen into it.

Pure PyTorch; no Lightning here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["BufferGuard", "BufferState"]

# The integer type of each element size: the bytes of any buffer, viewed as integers, for an exact device select.
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class _Slot:
    """One buffer slot: the module that owns it, its name there, and what it held when captured."""

    module: nn.Module
    name: str
    qualname: str
    tensor: Tensor | None = None
    saved: Tensor | None = None


class BufferState:
    """Every buffer of a module (all of its submodules'), by slot: captured, then put back exactly.

    Args:
        module: the model whose buffers are captured.

    Example::

        >>> net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        >>> state = BufferState(net)
        >>> state.capture()
        >>> _ = net(torch.tensor([[1.0, float("nan")], [0.0, 1.0]]))
        >>> state.restore()
        >>> net[1].running_mean, int(net[1].num_batches_tracked)
        (tensor([0., 0.]), 0)
    """

    def __init__(self, module: nn.Module) -> None:
        self._slots = [
            _Slot(owner, name, f"{prefix}.{name}" if prefix else name)
            for prefix, owner in module.named_modules()
            for name, buf in owner._buffers.items()
            if buf is not None and buf.device.type != "meta"
        ]
        self._captured = False

    @property
    def captured(self) -> bool:
        """Whether a state is held (captured and not put back or dropped since)."""
        return self._captured

    def capture(self) -> None:
        """Remember every slot's tensor object and copy its values (one multi-tensor copy per device/dtype group)."""
        targets: list[Tensor] = []
        sources: list[Tensor] = []
        for slot in self._slots:
            current = slot.tensor = slot.module._buffers.get(slot.name)
            if current is None:
                continue
            if slot.saved is None or slot.saved.shape != current.shape or slot.saved.dtype != current.dtype:
                slot.saved = torch.empty_like(current)
            targets.append(slot.saved)
            sources.append(current)
        if targets:
            with torch.no_grad():
                torch._foreach_copy_(targets, sources)
        self._captured = True

    def restore(self, skip: Tensor | None = None) -> None:
        """Put the captured state back: every slot's object and its values.

        Args:
            skip: ``None`` to put it back (the decision is known on the host); a bool device scalar to put it back
                only where it is true, on device, with no host synchronization.
        """
        if not self._captured:
            return
        self._captured = False
        with torch.no_grad():
            if skip is None:
                self._restore_on_host()
            else:
                self._restore_on_device(skip)

    def state_dict(self) -> dict[str, Tensor]:
        """The captured values by buffer name (on the CPU), for a checkpoint saved while a state is held."""
        if not self._captured:
            return {}
        return {
            slot.qualname: slot.saved.cpu()
            for slot in self._slots
            if slot.saved is not None and slot.tensor is not None
        }

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Hold ``state`` (from :meth:`state_dict`) as captured for the buffers now in their slots; a buffer it does
        not name is captured as it is now."""
        self.capture()
        with torch.no_grad():
            for slot in self._slots:
                saved = state.get(slot.qualname)
                if saved is not None and slot.saved is not None and saved.shape == slot.saved.shape:
                    slot.saved.copy_(saved)

    def drop(self) -> None:
        """Forget the captured state (the window's writes are kept)."""
        self._captured = False
        for slot in self._slots:
            slot.tensor = None

    def _restore_on_host(self) -> None:
        targets: list[Tensor] = []
        sources: list[Tensor] = []
        for slot in self._slots:
            if slot.tensor is None or slot.saved is None:
                continue
            if slot.module._buffers.get(slot.name) is not slot.tensor:
                slot.module._buffers[slot.name] = slot.tensor  # replaced by the window: the old object goes back
            targets.append(slot.tensor)
            sources.append(slot.saved)
            slot.tensor = None
        if targets:
            torch._foreach_copy_(targets, sources)

    def _restore_on_device(self, skip: Tensor) -> None:
        groups: dict[tuple[torch.device, int], tuple[list[Tensor], list[Tensor]]] = {}
        for slot in self._slots:
            if slot.tensor is None or slot.saved is None:
                continue
            tensor, slot.tensor = slot.tensor, None
            current = slot.module._buffers.get(slot.name)
            if current is not tensor:
                if current is not None and current.shape != tensor.shape:
                    continue  # replaced by one of another shape: only the host could choose; the new one stays
                # Replaced by the window: the old object returns to its slot with the new values in it, so that
                # the select below chooses between the two on device.
                if current is not None:
                    tensor.copy_(current)
                slot.module._buffers[slot.name] = tensor
            size = tensor.element_size()
            if size not in _INT_OF_SIZE:  # complex128: no integer type of its size
                tensor.copy_(torch.where(skip.to(tensor.device), slot.saved, tensor))
                continue
            now, saved = groups.setdefault((tensor.device, size), ([], []))
            now.append(tensor.view(_INT_OF_SIZE[size]))
            saved.append(slot.saved.view(_INT_OF_SIZE[size]))
        for (device, size), (now, saved) in groups.items():
            # current + skip * (saved - current) on the integer views: exact, whatever the floats hold.
            flag = skip.to(device=device, dtype=_INT_OF_SIZE[size])
            delta = torch._foreach_sub(saved, now)
            torch._foreach_mul_(delta, flag)
            torch._foreach_add_(now, delta)


class BufferGuard(BufferState):
    """The buffers of an accumulation window: captured before its first forward, put back if its step is skipped.

    Example::

        >>> bn = nn.BatchNorm1d(2)
        >>> guard = BufferGuard(bn)
        >>> guard.capture()
        >>> _ = bn(torch.ones(2, 2))
        >>> guard.close(skipped=True)
        >>> int(bn.num_batches_tracked), guard.open
        (0, False)
    """

    @property
    def open(self) -> bool:
        """Whether a window was captured and not closed yet."""
        return self.captured

    def close(self, skipped: bool | None, skip: Tensor | None = None) -> None:
        """End the window as its optimizer step went: put the buffers back if it was skipped, keep them if applied.

        Args:
            skipped: the skip decision as read on the host, or ``None`` when only the device knows it (a fused
                optimizer skipped through ``found_inf``): then ``skip``, the device flag, chooses on device.
            skip: the step's bool device flag; needed when ``skipped`` is ``None``.
        """
        if not self.captured:
            return
        if skipped is None:
            assert skip is not None, "a skip known only on device needs its flag"
            self.restore(skip)
        elif skipped:
            self.restore()
        else:
            self.drop()
