"""Whether a checkpoint of the training state would hold only finite values: the check behind every door's
checkpoint gate (the Trainer's :class:`~lightning_gradkit.CheckpointGuard`, the Hugging Face door's saves,
:meth:`gradkit.GradKit.checkpoint_is_finite` and :func:`checkpoint_is_finite` in a loop of your own).

The state is what a checkpoint holds and a skipped step puts back (:mod:`~gradkit.step.snapshot`): the parameters,
the module buffers and the optimizer state. One inf-norm per tensor (:func:`~gradkit.step.norms.per_tensor_norms`:
one multi-tensor pass per device and dtype) gives one fp32 vector; a maximum of magnitudes cannot overflow, so an entry
is non-finite exactly when the tensor holds a NaN or an infinity (a 2-norm would call a finite 3e38 infinite). Under
``torch.distributed`` the vector of flags travels in one all-reduce (MAX), so every rank takes the same decision and
names the same tensors; a DTensor (FSDP2) is read through its local shard. The host reads the flags once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from gradkit.step.norms import local_tensor, nonfinite_mask, per_tensor_norms, world_size
from gradkit.step.protocol import unwrapped

__all__ = ["CHECKPOINT_REFUSED", "FiniteCheck", "checkpoint_is_finite", "refusal_message"]

#: The ``what`` of the event a door writes when it refuses (or is told to refuse) a checkpoint of non-finite state.
CHECKPOINT_REFUSED = "checkpoint_refused"

# Optimizer-state entries that are counts, not values (Adam's, AdamW's, ... `step`): never read.
_COUNTS = frozenset({"step"})
# How many names a message lists; the event holds all of them.
_LISTED = 3


@dataclass(frozen=True)
class FiniteCheck:
    """What :func:`checkpoint_is_finite` found: the names of the tensors that hold a NaN or an infinity, by kind.

    True (``bool(check)``) when every tensor is finite, so ``if checkpoint_is_finite(model, optimizer):`` reads as
    it says.

    Attributes:
        parameters: the non-finite parameters, by their name in the model (``"encoder.0.weight"``).
        buffers: the non-finite module buffers (``"norm.running_var"``).
        optimizer_state: the non-finite optimizer-state tensors, as ``"<parameter name>.<state key>"``
            (``"head.weight.exp_avg_sq"``), prefixed with ``"optimizer <i>: "`` when several optimizers are checked.
    """

    parameters: tuple[str, ...] = ()
    buffers: tuple[str, ...] = ()
    optimizer_state: tuple[str, ...] = ()

    @property
    def finite(self) -> bool:
        """Whether every parameter, buffer and optimizer-state tensor is finite."""
        return not (self.parameters or self.buffers or self.optimizer_state)

    def __bool__(self) -> bool:
        return self.finite

    def first(self) -> str | None:
        """The first non-finite tensor's name (a parameter before a buffer before an optimizer state), or ``None``."""
        return next(iter((*self.parameters, *self.buffers, *self.optimizer_state)), None)

    def describe(self) -> str:
        """The non-finite tensors in a few words: ``"parameters `head.weight`; optimizer state `head.weight.exp_avg`"``
        (at most three names per kind, with how many more)."""
        parts = []
        for kind, names in (
            ("parameters", self.parameters),
            ("buffers", self.buffers),
            ("optimizer state", self.optimizer_state),
        ):
            if names:
                listed = ", ".join(f"`{n}`" for n in names[:_LISTED])
                more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
                parts.append(f"{kind} {listed}{more}")
        return "; ".join(parts) if parts else "nothing"

    def as_event(self) -> dict[str, list[str]]:
        """Every name, by kind: the ``values`` of the ``checkpoint_refused`` event."""
        return {
            "parameters": list(self.parameters),
            "buffers": list(self.buffers),
            "optimizer_state": list(self.optimizer_state),
        }


def checkpoint_is_finite(
    model: nn.Module,
    optimizers: Optimizer | Sequence[Optimizer] = (),
    *,
    group: dist.ProcessGroup | None = None,
) -> FiniteCheck:
    """Whether a checkpoint of ``model`` and ``optimizers`` would hold only finite values, and if not which tensors are
    non-finite: one pass over the parameters, the buffers and the optimizer state on their device, one host read.

    Call it before you save, on every rank (under ``torch.distributed`` it is a collective: the flags of all ranks
    are combined, so each rank gets the same answer), and save only when it is true. The optimizer's ``step`` counts
    are not read; integer tensors are always finite. Every rank must hold the same list of tensors (DDP, and FSDP2's
    shards, do): the flags travel as one vector.

    Args:
        model: the module whose parameters and buffers a checkpoint holds (a ``DistributedDataParallel`` wrapper is
            fine: the names are the module's own).
        optimizers: the optimizer, or a list of them, whose state a checkpoint holds; none for a weights-only check.
        group: the process group whose ranks must agree; ``None``: the default one, when ``torch.distributed`` is
            initialized with more than one rank.

    Returns:
        A :class:`FiniteCheck`: true when every tensor is finite, else the names of the non-finite ones.

    Example::

        >>> import torch
        >>> from gradkit import checkpoint_is_finite
        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.Adam(model.parameters())
        >>> bool(checkpoint_is_finite(model, optimizer))
        True
        >>> with torch.no_grad():
        ...     model.bias.fill_(float("nan"))
        Parameter containing:
        tensor([nan], requires_grad=True)
        >>> checkpoint_is_finite(model, optimizer).parameters
        ('bias',)
    """
    kinds, names, tensors = _state_tensors(model, optimizers)
    if not tensors:
        return FiniteCheck()
    # Accelerator tensors first: the vector then lives on the accelerator, whose stream the host read waits for.
    order = sorted(range(len(tensors)), key=lambda i: (tensors[i].device.type == "cpu", str(tensors[i].dtype)))
    norms = per_tensor_norms([tensors[i] for i in order], math.inf)
    flags = nonfinite_mask(norms).to(torch.float32)
    if (world_size() > 1 and group is None) or (group is not None and dist.get_world_size(group) > 1):
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    bad = flags.tolist()  # the one host read
    found: dict[str, list[str]] = {"parameters": [], "buffers": [], "optimizer_state": []}
    for position in sorted(order[j] for j, flag in enumerate(bad) if flag):
        found[kinds[position]].append(names[position])
    return FiniteCheck(*(tuple(found[k]) for k in ("parameters", "buffers", "optimizer_state")))


def _state_tensors(
    model: nn.Module, optimizers: Optimizer | Sequence[Optimizer]
) -> tuple[list[str], list[str], list[Tensor]]:
    """The floating-point tensors a checkpoint holds, each with its kind and its name, in a fixed order (the same on
    every rank): the parameters, the buffers, then each optimizer's state in its ``param_groups`` order."""
    kinds: list[str] = []
    names: list[str] = []
    tensors: list[Tensor] = []

    def add(kind: str, name: str, tensor: object) -> None:
        if isinstance(tensor, Tensor) and (tensor.is_floating_point() or tensor.is_complex()):
            kinds.append(kind)
            names.append(name)
            tensors.append(_readable(local_tensor(tensor.detach())))

    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module  # its names, without DDP's `module.` prefix
    for name, parameter in model.named_parameters():
        add("parameters", name, parameter)
    for name, buffer in model.named_buffers():
        add("buffers", name, buffer)
    param_names = {id(p): n for n, p in model.named_parameters()}
    listed = [optimizers] if isinstance(optimizers, Optimizer) else list(optimizers)
    for i, optimizer in enumerate(unwrapped(o) for o in listed):
        prefix = f"optimizer {i}: " if len(listed) > 1 else ""
        state = getattr(optimizer, "state", {})
        for g, param_group in enumerate(optimizer.param_groups):
            for j, parameter in enumerate(param_group["params"]):
                name = param_names.get(id(parameter), f"param_groups[{g}][{j}]")
                for key, value in state.get(parameter, {}).items():
                    if key not in _COUNTS:
                        add("optimizer_state", f"{prefix}{name}.{key}", value)
    return kinds, names, tensors


def _readable(t: Tensor) -> Tensor:
    """``t`` in a form the norm kernels take: a complex tensor as its real view, a float8 one widened (no kernel
    reduces float8; widening keeps NaN and infinity)."""
    if t.is_complex():
        return torch.view_as_real(t)
    if t.element_size() == 1:
        return t.to(torch.bfloat16)
    return t


def refusal_message(who: str, check: FiniteCheck, step: int, what: str, events: Path | None) -> str:
    """The warning of a refused checkpoint: who refused it, at which step, what was non-finite, where the event is
    (``events``: the events file, ``None`` when the run writes none), and the cure."""
    where = f" Every name is in the `{CHECKPOINT_REFUSED}` event of {events}." if events is not None else ""
    return (
        f"{who}: the checkpoint of step {step} holds non-finite values ({check.describe()}): {what}.{where} The "
        "training state itself is non-finite: NonFiniteGuard(action='skip') keeps a non-finite step from being "
        "applied, SpikeRollback restores a snapshot from before it."
    )
