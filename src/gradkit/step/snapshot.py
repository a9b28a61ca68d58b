"""A training step's state, captured and put back exactly: the one definition that a skipped step, a replay and a
rollback share.

- A skipped optimizer step (the GradKit strategies, :class:`~gradkit.GradKit`) leaves the parameters and the
  optimizer state alone, but the forwards of its accumulation window have run, and a forward in training mode writes
  module buffers: BatchNorm's running statistics, or any buffer a model updates itself (an EMA of its inputs, a
  codebook, a step counter). A NaN batch makes every BatchNorm statistic NaN, and every later eval-mode forward NaN.
- A replay of ``training_step`` (:func:`gradkit.step.replay.replay`: the culprit search, the checkpointing measurement)
  writes the same buffers and draws from the RNGs.
- A rollback (``SpikeRollback``) puts back everything a step changes
  (:class:`~gradkit.policies.rollback.StepSnapshot`, which holds a :class:`Snapshot`).

:class:`Snapshot` copies the tensors. **Buffers by slot**: every buffer *slot* (the owning module and the name) with
the tensor object it held and a copy of its values; putting it back puts the object back in its slot (a buffer the
code *replaced*, ``self.ema = 0.9 * self.ema + x``) and its values into that object (a buffer written in place).
Nothing is inferred from write counters (``Tensor._version``): a ``.data`` write does not bump them and a restore
does. **Parameters and optimizer state** of the optimizers passed to :meth:`~Snapshot.capture`, tensors and
hyperparameters. Only *local* tensors are copied (a DTensor's shard under FSDP2): no collective.

**Where the copies live.** By default beside the tensors (one ``torch._foreach_copy_`` per capture); with
``host=True`` in host memory, on a GPU pinned and filled by ``non_blocking`` copies, with a CUDA event the host waits
on only before it reads or overwrites the copies. Copies are allocated once and reused by every capture.

**Two ways to put it back**, as a skip is known: on the host (a copy back; ``copy_`` within a dtype is exact), or on
the device when only the device knows the skip (a fused optimizer's ``found_inf``): every tensor becomes ``skip ?
saved : current`` bit for bit, computed on integer views of the bytes (``current + skip * (saved - current)``,
wrapping, exact for any dtype, NaN and Inf included): three multi-tensor operations per element size, no host
synchronization. A replaced buffer's slot cannot be chosen on device: its old object returns with the new values
chosen into it.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from gradkit.step.norms import local_tensor

__all__ = ["RNGState", "Snapshot", "capture_rng", "restore_rng", "trained_parameters"]

# The integer type of each element size: the bytes of any tensor, viewed as integers, for an exact device select.
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class _Slot:
    """One buffer slot: the module that owns it, its name there, and the object it held at the capture."""

    module: nn.Module
    name: str
    qualname: str
    tensor: Tensor | None = None


@dataclass
class _ParamState:
    """One parameter's optimizer state: positions of its tensors among the copies, and its other values."""

    tensors: dict[str, int] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    # Where each tensor lived, to build it again if the optimizer dropped the state since the capture (a reset to a
    # fresh optimizer's state): "param" (like the parameter: its shape, device and DTensor layout), "device" (the
    # parameter's device, another shape) or "cpu".
    places: dict[str, str] = field(default_factory=dict)


@dataclass
class _OptimizerState:
    """An optimizer's state in a snapshot: per parameter (param-group order) its state, ``None`` if it had none."""

    params: list[_ParamState | None]
    groups: list[dict[str, Any]]


def trained_parameters(optimizers: Sequence[Optimizer]) -> list[Tensor]:
    """The parameters the optimizers update, each once, in param-group order (a snapshot leaves the others out)."""
    return list({id(p): p for opt in optimizers for group in opt.param_groups for p in group["params"]}.values())


class Snapshot:
    """A module's buffers (every submodule's, by slot), and optionally the optimizers' parameters and states: captured,
    then put back exactly, in place.

    Args:
        module: the model whose buffers are captured (``None``: none).
        host: keep the copies in host memory (pinned on a GPU) instead of beside the tensors.

    Example::

        >>> net = nn.Sequential(nn.Linear(2, 1), nn.BatchNorm1d(1))
        >>> opt = torch.optim.Adam(net.parameters())
        >>> snap = Snapshot(net, host=True)
        >>> snap.capture([opt])
        >>> before = net[0].weight.detach().clone()
        >>> net(torch.ones(2, 2)).sum().backward()
        >>> opt.step()
        >>> snap.restore([opt])
        >>> torch.equal(net[0].weight, before), opt.state_dict()["state"], int(net[1].num_batches_tracked)
        (True, {}, 0)
    """

    def __init__(self, module: nn.Module | None = None, host: bool = False) -> None:
        self.host = host
        self._slots = [
            _Slot(owner, name, f"{prefix}.{name}" if prefix else name)
            for prefix, owner in (module.named_modules() if module is not None else ())
            for name, buf in owner._buffers.items()
            if buf is not None and buf.device.type != "meta"
        ]
        # The copies, in this order: the parameters, the buffers of the captured slots, the optimizer state tensors.
        self._copies: list[Tensor] = []
        self._num_params = 0
        self._num_buffers = 0
        self._optimizers: list[_OptimizerState] = []
        self._event: torch.cuda.Event | None = None
        self._captured = False

    @property
    def captured(self) -> bool:
        """Whether a state is held (captured, or loaded, and not closed or dropped since)."""
        return self._captured

    @property
    def nbytes(self) -> int:
        """Memory held by the copies (allocated once, reused by every capture)."""
        return sum(t.numel() * t.element_size() for t in self._copies)

    def capture(self, optimizers: Sequence[Optimizer] = ()) -> None:
        """Copy every buffer slot's values (and remember its object), and the parameters and states (tensors and
        hyperparameters, learning rates included) of ``optimizers``."""
        self._wait()
        params = trained_parameters(optimizers)
        for slot in self._slots:
            slot.tensor = slot.module._buffers.get(slot.name)
        buffers = [local_tensor(slot.tensor) for slot in self._slots if slot.tensor is not None]
        sources = [*(local_tensor(p.detach()) for p in params), *buffers]
        self._optimizers = [_optimizer_state(optimizer, sources) for optimizer in optimizers]
        # On a GPU every host copy is pinned, also those of tensors the optimizer keeps on the host (a non-fused,
        # non-capturable Adam's `step` counts): a snapshot is pinned as a whole, whatever a source's device.
        pin = self.host and any(source.is_cuda for source in sources)
        copies = self._copies
        del copies[len(sources) :]
        for i, source in enumerate(sources):
            if i == len(copies):
                copies.append(_new_copy(source, self.host, pin))
            elif not _fits(copies[i], source, self.host, pin):
                copies[i] = _new_copy(source, self.host, pin)
        if sources:
            with torch.no_grad():
                torch._foreach_copy_(copies, sources, non_blocking=pin)
        self._num_params, self._num_buffers = len(params), len(buffers)
        self._captured = True
        self._record(sources)

    def restore(self, optimizers: Sequence[Optimizer] = (), *, skip: Tensor | None = None) -> None:
        """Put the captured state back, in place; the capture stays (a snapshot can be restored again).

        Args:
            optimizers: the optimizers captured (the same ones, in the same order).
            skip: ``None`` to put it back (the decision is known on the host); a bool device scalar to put it back
                only where it is true, on device, with no host synchronization (copies kept beside the tensors only).

        Raises:
            ValueError: if the tensors no longer match the capture (another model, or an optimizer whose parameters or
                state keys changed since).
        """
        if not self._captured:
            return
        assert skip is None or not self.host, "a device select needs the copies beside the tensors"
        self._wait()
        params = trained_parameters(optimizers)
        if len(params) != self._num_params or len(optimizers) != len(self._optimizers):
            raise ValueError(
                f"The snapshot holds {self._num_params} parameters and {len(self._optimizers)} optimizer(s), the "
                f"restore got {len(params)} and {len(optimizers)}: restore into the model and optimizers captured."
            )
        with torch.no_grad():
            pairs = [(local_tensor(p.detach()), c) for p, c in zip(params, self._copies[: len(params)], strict=True)]
            pairs += self._buffer_pairs(on_device=skip is not None)
            for optimizer, saved in zip(optimizers, self._optimizers, strict=True):
                pairs += self._optimizer_pairs(optimizer, saved)
            if not pairs:
                return
            if skip is not None:
                _select_(pairs, skip)
                return
            for target, saved_copy in pairs:
                if target.shape != saved_copy.shape or target.dtype != saved_copy.dtype:
                    raise ValueError(
                        f"A tensor of shape {tuple(target.shape)} ({target.dtype}) does not match the snapshot's "
                        f"{tuple(saved_copy.shape)} ({saved_copy.dtype}): restore into the model and optimizers "
                        "captured."
                    )
            targets = [target for target, _ in pairs]
            torch._foreach_copy_(targets, [c for _, c in pairs], non_blocking=self.host)
        self._record(targets)

    def close(self, skipped: bool | None, skip: Tensor | None = None) -> None:
        """End an accumulation window as its optimizer step went: put the buffers back if it was skipped, keep them if
        it was applied; then hold nothing.

        Args:
            skipped: the skip decision as read on the host, or ``None`` when only the device knows it (a fused
                optimizer skipped through ``found_inf``): then ``skip``, the device flag, chooses on device.
            skip: the step's bool device flag; needed when ``skipped`` is ``None``.
        """
        if not self._captured:
            return
        if skipped is None:
            assert skip is not None, "a skip known only on device needs its flag"
            self.restore(skip=skip)
        elif skipped:
            self.restore()
        self.drop()

    def drop(self) -> None:
        """Forget the captured state (what changed since is kept)."""
        self._captured = False
        for slot in self._slots:
            slot.tensor = None

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The captured values, for a checkpoint: the copies themselves (not copies of them) and plain values.

        Everything in it loads with ``torch.load(weights_only=True)``. The tensors are this snapshot's copies: a later
        capture overwrites them, so save the state before the next capture.
        """
        self._wait()
        return {
            "host": list(self._copies),
            "num_params": self._num_params,
            "num_buffers": self._num_buffers,
            "optimizers": [dataclasses.asdict(o) for o in self._optimizers],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Adopt the values of :meth:`state_dict` (its tensors without a copy) as captured, for the buffers now in
        their slots. On a GPU the next capture replaces host copies that are not pinned by pinned ones."""
        self._wait()
        self._copies = list(state_dict["host"])
        self._num_params = int(state_dict["num_params"])
        self._num_buffers = int(state_dict["num_buffers"])
        self._optimizers = [
            _OptimizerState([None if e is None else _ParamState(**e) for e in o["params"]], list(o["groups"]))
            for o in state_dict["optimizers"]
        ]
        for slot in self._slots:
            slot.tensor = slot.module._buffers.get(slot.name)
        self._captured = True

    def buffers_state_dict(self) -> dict[str, Tensor]:
        """The captured buffers by name, on the CPU (a checkpoint saved inside an accumulation window)."""
        if not self._captured:
            return {}
        return {slot.qualname: saved.cpu() for slot, saved in self._captured_buffers()}

    def load_buffers_state_dict(self, state: dict[str, Tensor]) -> None:
        """Hold ``state`` (from :meth:`buffers_state_dict`) as captured; a buffer it does not name is captured as it
        is now."""
        self.capture()
        with torch.no_grad():
            for slot, saved in self._captured_buffers():
                value = state.get(slot.qualname)
                if value is not None and value.shape == saved.shape:
                    saved.copy_(value)

    # -- internals ------------------------------------------------------------------------------------------------
    def _captured_buffers(self) -> list[tuple[_Slot, Tensor]]:
        """The captured slots with their copies."""
        slots = [slot for slot in self._slots if slot.tensor is not None]
        if len(slots) != self._num_buffers:
            raise ValueError(f"The snapshot holds {self._num_buffers} buffers, the model has {len(slots)} now.")
        return list(zip(slots, self._copies[self._num_params : self._num_params + self._num_buffers], strict=True))

    def _buffer_pairs(self, on_device: bool) -> list[tuple[Tensor, Tensor]]:
        """Every captured slot's object back in its slot; (tensor, copy) pairs to put the values back."""
        pairs = []
        for slot, saved in self._captured_buffers():
            tensor = slot.tensor
            assert tensor is not None
            current = slot.module._buffers.get(slot.name)
            if current is not tensor:
                if on_device and current is not None:
                    if current.shape != tensor.shape:
                        continue  # replaced by one of another shape: only the host could choose; the new one stays
                    # The old object returns to its slot with the new values in it: the select chooses between them.
                    tensor.copy_(current)
                slot.module._buffers[slot.name] = tensor
            pairs.append((local_tensor(tensor), saved))
        return pairs

    def _optimizer_pairs(self, optimizer: Optimizer, saved: _OptimizerState) -> list[tuple[Tensor, Tensor]]:
        """Put back the non-tensor state and hyperparameters; return (tensor, copy) pairs for the tensors."""
        params = trained_parameters([optimizer])
        if len(params) != len(saved.params) or len(optimizer.param_groups) != len(saved.groups):
            raise ValueError("The optimizer's parameters changed since the snapshot: restore into the same optimizer.")
        pairs: list[tuple[Tensor, Tensor]] = []
        for p, entry in zip(params, saved.params, strict=True):
            if entry is None:
                # No state yet at the capture (before the parameter's first step): the optimizer starts afresh.
                optimizer.state.pop(p, None)
                continue
            state = optimizer.state.get(p)
            if not state:
                # Dropped since the capture (reset to a fresh optimizer's state, which builds itself at the next step).
                state = optimizer.state[p] = {key: self._rebuilt(p, entry, key) for key in entry.tensors}
            if set(state) != set(entry.tensors) | set(entry.values):
                raise ValueError(
                    f"The optimizer state keys changed since the snapshot ({sorted(state)} now, "
                    f"{sorted(set(entry.tensors) | set(entry.values))} then): restore into the same optimizer."
                )
            for key, value in entry.values.items():
                state[key] = copy.deepcopy(value)
            pairs += [(local_tensor(state[key].detach()), self._copies[i]) for key, i in entry.tensors.items()]
        for group, values in zip(optimizer.param_groups, saved.groups, strict=True):
            for key, value in values.items():
                current = group.get(key)
                if isinstance(current, Tensor) and isinstance(value, Tensor):
                    current.copy_(value)  # a tensor learning rate stays the object the optimizer holds
                else:
                    group[key] = copy.deepcopy(value)
        return pairs

    def _rebuilt(self, p: Tensor, entry: _ParamState, key: str) -> Tensor:
        """An empty tensor where the optimizer kept ``p``'s state ``key`` at the capture, for the restore to fill."""
        saved = self._copies[entry.tensors[key]]
        local = local_tensor(p.detach())
        # A checkpoint from before `places` was saved: a tensor of the parameter's shape is like it, others on the host.
        place = entry.places.get(key, "param" if saved.shape == local.shape else "cpu")
        if place == "param":
            return torch.empty_like(p.detach(), dtype=saved.dtype)  # a DTensor under FSDP2, as the optimizer builds
        return torch.empty(saved.shape, dtype=saved.dtype, device=local.device if place == "device" else "cpu")

    def _record(self, tensors: Sequence[Tensor]) -> None:
        """Remember the host copies queued on a GPU stream: wait for them before the copies are touched again."""
        device = next((t.device for t in tensors if t.is_cuda), None) if self.host else None
        if device is None:
            return
        with torch.cuda.device(device):
            self._event = torch.cuda.Event()
            self._event.record()

    def _wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None


def _optimizer_state(optimizer: Optimizer, sources: list[Tensor]) -> _OptimizerState:
    """``optimizer``'s state and hyperparameters; its tensors are appended to ``sources`` (their positions kept)."""
    per_param: list[_ParamState | None] = []
    for p in trained_parameters([optimizer]):
        state = optimizer.state.get(p)
        if not state:
            per_param.append(None)
            continue
        entry = _ParamState()
        for key, value in state.items():
            if isinstance(value, Tensor):
                entry.tensors[key] = len(sources)
                sources.append(local_tensor(value.detach()))
                entry.places[key] = _place(sources[-1], local_tensor(p.detach()))
            else:
                entry.values[key] = copy.deepcopy(value)
        per_param.append(entry)
    groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return _OptimizerState(per_param, groups)


def _select_(pairs: list[tuple[Tensor, Tensor]], skip: Tensor) -> None:
    """Every target becomes ``skip ? saved : target``, bit for bit, on device (see the module docstring)."""
    groups: dict[tuple[torch.device, int], tuple[list[Tensor], list[Tensor]]] = {}
    for target, saved in pairs:
        size = target.element_size()
        if size not in _INT_OF_SIZE:  # complex128: no integer type of its size
            target.copy_(torch.where(skip.to(target.device), saved, target))
            continue
        now, then = groups.setdefault((target.device, size), ([], []))
        now.append(target.view(_INT_OF_SIZE[size]))
        then.append(saved.view(_INT_OF_SIZE[size]))
    for (device, size), (now, then) in groups.items():
        # current + skip * (saved - current) on the integer views: exact, whatever the floats hold.
        flag = skip.to(device=device, dtype=_INT_OF_SIZE[size])
        delta = torch._foreach_sub(then, now)
        torch._foreach_mul_(delta, flag)
        torch._foreach_add_(now, delta)


def _fits(saved: Tensor, source: Tensor, host: bool, pin: bool) -> bool:
    """Whether the copy ``saved`` can take ``source``'s values: same shape and dtype; beside the source on its device,
    or in host memory, pinned when ``pin`` (a copy loaded from a checkpoint is not: the first capture on a GPU
    replaces it)."""
    if saved.shape != source.shape or saved.dtype != source.dtype:
        return False
    return (not pin or saved.is_pinned()) if host else saved.device == source.device


def _new_copy(like: Tensor, host: bool, pin: bool) -> Tensor:
    """An empty tensor for ``like``'s values: in host memory (pinned when ``pin``) or beside it."""
    if host:
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
    return torch.empty_like(like)


def _place(value: Tensor, param: Tensor) -> str:
    """Where an optimizer state tensor lives relative to its parameter (both local tensors): see ``_ParamState``."""
    if value.device != param.device and value.device.type == "cpu":
        return "cpu"
    return "param" if value.shape == param.shape else "device"


# -- RNG ------------------------------------------------------------------------------------------------------------
@dataclass
class RNGState:
    """RNG states of torch (CPU, every initialized CUDA device), Python's ``random`` and NumPy's global generator."""

    torch_cpu: Tensor
    torch_cuda: list[Tensor] | None
    python: Any = None
    numpy: Any = None

    def state_dict(self) -> dict[str, Any]:
        """The states as values ``torch.load(weights_only=True)`` accepts (NumPy's key array as a list)."""
        numpy = None
        if self.numpy is not None:
            name, keys, pos, has_gauss, cached = self.numpy
            numpy = (name, [int(k) for k in keys], pos, has_gauss, cached)
        return {"torch_cpu": self.torch_cpu, "torch_cuda": self.torch_cuda, "python": self.python, "numpy": numpy}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> RNGState:
        """The states of :meth:`state_dict` (the CUDA ones only where CUDA is available)."""
        cuda = state["torch_cuda"] if torch.cuda.is_available() else None
        return cls(state["torch_cpu"], cuda, state["python"], state["numpy"])


def capture_rng(full: bool = True) -> RNGState:
    """The current RNG states; ``full=False`` takes only torch's (cheap enough for every batch)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    state = RNGState(torch.get_rng_state(), cuda)
    if full:
        state.python = random.getstate()
        np = sys.modules.get("numpy")
        if np is not None:
            state.numpy = np.random.get_state()
    return state


def restore_rng(state: RNGState) -> None:
    """Set the RNG states captured by :func:`capture_rng` (those it did not take are left alone)."""
    torch.set_rng_state(state.torch_cpu)
    if state.torch_cuda is not None:
        torch.cuda.set_rng_state_all(state.torch_cuda)
    if state.python is not None:
        random.setstate(state.python)
    np = sys.modules.get("numpy")
    if state.numpy is not None and np is not None:
        np.random.set_state(state.numpy)
