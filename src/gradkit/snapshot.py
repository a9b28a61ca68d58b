"""Host-memory copies of a training state that restore bitwise, in place.

A :class:`HostSnapshot` copies the tensors a rank holds (parameters, buffers, optimizer state) into host buffers
that it allocates once and reuses: each later capture overwrites them. A rank copies only its *local* tensors: the
local shard of a DTensor (FSDP2), the tensor itself otherwise; so under sharding every rank holds its own shard and
no collective is needed.

A restore copies the host buffers back *into the existing tensors*: the optimizer's references to its parameters,
FSDP2's sharded storage behind each DTensor and any other alias stay valid, and ``copy_`` between tensors of one
dtype is exact, so the state after a restore equals the captured one bitwise.

On a GPU the host buffers are pinned (all of them: also those of tensors an optimizer keeps on the host, such as a
non-fused Adam's ``step`` counts) and the copies of device tensors are ``non_blocking``: a capture only queues the
copies on the current stream (the training step does not wait for them) and records a CUDA event; the host waits on
that event only before it reads the buffers (a restore) or overwrites them (the next capture). Later kernels on the
same stream (the next optimizer step) are ordered after the copies, so they read the values of the capture.

:meth:`HostSnapshot.state_dict` hands the host buffers and plain values to a checkpoint (they load with
``torch.load(weights_only=True)``), and :meth:`HostSnapshot.load_state_dict` adopts them in a resumed run.

Pure PyTorch: no Lightning here; :mod:`lightning_gradkit.callbacks.rollback` wires it to a Trainer.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from gradkit.norms import local_tensor

__all__ = ["HostSnapshot", "trained_parameters"]


@dataclass
class _ParamState:
    """One parameter's optimizer state: positions of its tensors in the host buffers, and its other values."""

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
    """The parameters the optimizers update, each once, in param-group order.

    Parameters outside every optimizer do not train: a snapshot leaves them out and saves their memory.
    """
    seen: set[int] = set()
    out: list[Tensor] = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
    return out


class HostSnapshot:
    """A reusable host copy of parameters, buffers and optimizer states.

    Example::

        >>> net = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.Adam(net.parameters())
        >>> snap = HostSnapshot()
        >>> snap.capture(list(net.parameters()), [], [opt])
        >>> before = net.weight.detach().clone()
        >>> net(torch.ones(1, 2)).sum().backward()
        >>> opt.step()
        >>> snap.restore(list(net.parameters()), [], [opt])
        >>> torch.equal(net.weight, before), opt.state_dict()["state"]
        (True, {})
    """

    def __init__(self) -> None:
        self._host: list[Tensor] = []
        self._num_params = 0
        self._num_buffers = 0
        self._event: torch.cuda.Event | None = None
        self._optimizers: list[_OptimizerState] = []

    @property
    def nbytes(self) -> int:
        """Host memory held by the buffers (allocated once, reused by every capture)."""
        return sum(t.numel() * t.element_size() for t in self._host)

    def capture(self, params: Sequence[Tensor], buffers: Sequence[Tensor], optimizers: Sequence[Optimizer]) -> None:
        """Copy ``params``, ``buffers`` and the optimizers' states (tensors and hyperparameters) to the host.

        Args:
            params: the parameters (usually :func:`trained_parameters`), in a fixed order.
            buffers: the module buffers, in a fixed order.
            optimizers: the optimizers; their ``param_groups`` (learning rates included) are copied too.
        """
        self._wait()
        sources = [local_tensor(t.detach()) for t in (*params, *buffers)]
        self._optimizers = []
        for optimizer in optimizers:
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
            self._optimizers.append(_OptimizerState(per_param, groups))
        # On a GPU every buffer is pinned, also those of tensors the optimizer keeps on the host (a non-fused,
        # non-capturable Adam's `step` counts): a snapshot is pinned as a whole, whatever a source's device.
        pin = any(source.is_cuda for source in sources)
        for i, source in enumerate(sources):
            if i == len(self._host):
                self._host.append(_host_buffer(source, pin))
            elif not _fits(self._host[i], source, pin):
                self._host[i] = _host_buffer(source, pin)
            self._host[i].copy_(source, non_blocking=source.is_cuda)
        self._num_params, self._num_buffers = len(params), len(buffers)
        self._record(sources)

    def restore(self, params: Sequence[Tensor], buffers: Sequence[Tensor], optimizers: Sequence[Optimizer]) -> None:
        """Copy the captured values back into ``params``, ``buffers`` and the optimizers' states, in place.

        Pass the same sequences as to :meth:`capture`.

        Raises:
            ValueError: if the tensors no longer match the capture (another model, or an optimizer whose state keys
                changed since).
        """
        if len(params) != self._num_params or len(optimizers) != len(self._optimizers):
            raise ValueError(
                f"The snapshot holds {self._num_params} parameters and {len(self._optimizers)} optimizer(s), the "
                f"restore got {len(params)} and {len(optimizers)}: restore into the model and optimizers captured."
            )
        pairs = list(zip(params, range(len(params)), strict=True))
        for optimizer, saved in zip(optimizers, self._optimizers, strict=True):
            pairs += self._optimizer_targets(optimizer, saved)
        self._copy_back([*pairs, *self._buffer_pairs(buffers)])

    def state_dict(self) -> dict[str, Any]:
        """The captured values, for a checkpoint: the host tensors themselves (not copies) and plain values.

        Everything in it loads with ``torch.load(weights_only=True)``. The tensors are this snapshot's buffers: a
        later capture overwrites them, so save the state before the next capture.

        Example::

            >>> net = torch.nn.Linear(2, 1)
            >>> snap = HostSnapshot()
            >>> snap.capture(list(net.parameters()), [], [])
            >>> copy = HostSnapshot()
            >>> copy.load_state_dict(snap.state_dict())
            >>> with torch.no_grad():
            ...     _ = net.weight.zero_()
            >>> copy.restore(list(net.parameters()), [], [])
            >>> bool(net.weight.abs().sum() > 0)
            True
        """
        self._wait()
        optimizers = [
            {
                "params": [
                    None if e is None else {"tensors": dict(e.tensors), "values": e.values, "places": dict(e.places)}
                    for e in o.params
                ],
                "groups": o.groups,
            }
            for o in self._optimizers
        ]
        return {
            "host": list(self._host),
            "num_params": self._num_params,
            "num_buffers": self._num_buffers,
            "optimizers": optimizers,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Adopt the values of :meth:`state_dict` (host tensors included, without a copy), as if captured here.

        On a GPU the next capture replaces host tensors that are not pinned by pinned ones.
        """
        self._wait()
        self._host = list(state_dict["host"])
        self._num_params = int(state_dict["num_params"])
        self._num_buffers = int(state_dict["num_buffers"])
        self._optimizers = [
            _OptimizerState(
                [
                    None if e is None else _ParamState(dict(e["tensors"]), dict(e["values"]), dict(e.get("places", {})))
                    for e in o["params"]
                ],
                list(o["groups"]),
            )
            for o in state_dict["optimizers"]
        ]

    # -- internals ------------------------------------------------------------------------------------------------
    def _buffer_pairs(self, buffers: Sequence[Tensor]) -> list[tuple[Tensor, int]]:
        if len(buffers) != self._num_buffers:
            raise ValueError(f"The snapshot holds {self._num_buffers} buffers, the restore got {len(buffers)}.")
        return [(b, self._num_params + i) for i, b in enumerate(buffers)]

    def _copy_back(self, pairs: list[tuple[Tensor, int]]) -> None:
        self._wait()
        targets = [local_tensor(t.detach()) for t, _ in pairs]
        with torch.no_grad():
            for target, (_, slot) in zip(targets, pairs, strict=True):
                host = self._host[slot]
                if target.shape != host.shape or target.dtype != host.dtype:
                    raise ValueError(
                        f"A tensor of shape {tuple(target.shape)} ({target.dtype}) does not match the snapshot's "
                        f"{tuple(host.shape)} ({host.dtype}): restore into the model and optimizers captured."
                    )
                target.copy_(host, non_blocking=target.is_cuda)
        self._record(targets)

    def _optimizer_targets(self, optimizer: Optimizer, saved: _OptimizerState) -> list[tuple[Tensor, int]]:
        """Put back the non-tensor state and hyperparameters; return (tensor, host slot) pairs to copy into."""
        params = trained_parameters([optimizer])
        if len(params) != len(saved.params) or len(optimizer.param_groups) != len(saved.groups):
            raise ValueError("The optimizer's parameters changed since the snapshot: restore into the same optimizer.")
        pairs: list[tuple[Tensor, int]] = []
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
            pairs += [(state[key], slot) for key, slot in entry.tensors.items()]
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
        host = self._host[entry.tensors[key]]
        local = local_tensor(p.detach())
        # A checkpoint from before `places` was saved: a tensor of the parameter's shape is like it, others on the host.
        place = entry.places.get(key, "param" if host.shape == local.shape else "cpu")
        if place == "param":
            return torch.empty_like(p.detach(), dtype=host.dtype)  # a DTensor under FSDP2, as the optimizer builds
        return torch.empty(host.shape, dtype=host.dtype, device=local.device if place == "device" else "cpu")

    def _record(self, tensors: Sequence[Tensor]) -> None:
        """Remember the copies queued on a GPU stream: wait for them before the host buffers are touched again."""
        device = next((t.device for t in tensors if t.is_cuda), None)
        if device is None:
            return
        with torch.cuda.device(device):
            self._event = torch.cuda.Event()
            self._event.record()

    def _wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None


def _fits(host: Tensor, source: Tensor, pin: bool) -> bool:
    """Whether ``host`` can take ``source``'s values: same shape and dtype, and pinned when ``pin`` (a buffer loaded
    from a checkpoint is not: the first capture on a GPU replaces it)."""
    return host.shape == source.shape and host.dtype == source.dtype and (not pin or host.is_pinned())


def _place(value: Tensor, param: Tensor) -> str:
    """Where an optimizer state tensor lives relative to its parameter (both local tensors): see ``_ParamState``."""
    if value.device != param.device and value.device.type == "cpu":
        return "cpu"
    return "param" if value.shape == param.shape else "device"


def _host_buffer(like: Tensor, pin: bool) -> Tensor:
    """A host tensor for ``like``'s values, pinned when ``pin`` (asynchronous copies need it)."""
    return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
