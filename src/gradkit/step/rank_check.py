"""Check, once per fit, that every rank trains the same parameters in the same order.

The engine's one collective per step sums a vector with one slot per trainable parameter (in optimizer order, grouped
by device and dtype). That is only meaningful when position ``i`` is the same parameter on every rank. DDP verifies
shapes of the module's parameters, but not the optimizer's order (``configure_optimizers`` building groups from a
``set``, rank-dependent freezing); FSDP2 and tensor parallelism verify nothing. A misaligned vector gives wrong norms
silently, or a collective of mismatched sizes that hangs. So at the start of a fit each rank hashes a description of
its parameters and the hashes are gathered once; only when they differ are the full descriptions gathered, to name
the first parameter that differs and the ranks that disagree.

Same names, shapes and placements do not make plain parameters copies: the local experts of expert parallelism pass
this check and hold other values on every rank. That is checked at the first step, from the gradients
(:class:`~gradkit.step.replicas.ReplicaCheck`), and declared with :func:`~gradkit.expert_parallel`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from gradkit.step.params import clean_name

__all__ = ["first_mismatch", "parameter_layout", "verify_same_layout"]


def _describe_parameter(param: torch.nn.Parameter, name: str) -> str:
    """What must agree across ranks for one parameter: name, global shape, dtype, device type and placements.

    The device index is left out (rank ``r`` trains on ``cuda:r``); for a DTensor the shape is the global one and the
    mesh is described by its shape and dimension names.
    """
    text = f"{name} shape={tuple(param.shape)} dtype={param.dtype} device={param.device.type}"
    placements = getattr(param, "placements", None)
    mesh = getattr(param, "device_mesh", None)
    if placements is not None and mesh is not None:
        text += f" placements={tuple(placements)} mesh={tuple(mesh.shape)}{tuple(mesh.mesh_dim_names or ())}"
    return text


def parameter_layout(optimizers: Sequence[Optimizer], names_by_id: dict[int, str]) -> list[str]:
    """One line per trainable parameter, in optimizer order: ``optimizer k, group g: <description>``."""
    lines = []
    for k, optimizer in enumerate(optimizers):
        for g, group in enumerate(optimizer.param_groups):
            for j, param in enumerate(group["params"]):
                if param.requires_grad:
                    name = clean_name(names_by_id.get(id(param), f"param_group{g}.param{j}"))
                    lines.append(f"optimizer {k}, group {g}: {_describe_parameter(param, name)}")
    return lines


def first_mismatch(layouts: Sequence[Sequence[str]]) -> str | None:
    """A message naming the first position where the ranks' layouts differ and which ranks differ from rank 0, or
    ``None`` when all agree.

    Example::

        >>> first_mismatch([["a", "b"], ["a", "c"]])
        'position 1: rank 0 has `b`; rank 1 has `c`'
        >>> first_mismatch([["a"], ["a"]]) is None
        True
    """
    length = max(len(layout) for layout in layouts)
    for i in range(length):
        at = [layout[i] if i < len(layout) else "<no parameter>" for layout in layouts]
        if any(entry != at[0] for entry in at):
            differing = [r for r, entry in enumerate(at) if entry != at[0]]
            others = "; ".join(f"rank {r} has `{at[r]}`" for r in differing)
            return f"position {i}: rank 0 has `{at[0]}`; {others}"
    return None


def verify_same_layout(optimizers: Sequence[Optimizer], names_by_id: dict[int, str]) -> None:
    """Raise on every rank unless all ranks train the same parameters in the same order. Collective: every rank of
    the default process group must call it. One ``all_gather_object`` of a 64-character hash when they agree.

    Raises:
        RuntimeError: naming the first parameter that differs and the ranks that hold something else.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    layout = parameter_layout(optimizers, names_by_id)
    digest = hashlib.sha256("\n".join(layout).encode()).hexdigest()
    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if all(d == digest for d in digests):
        return
    layouts: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, layout)
    where = first_mismatch([entries or [] for entries in layouts])
    raise RuntimeError(
        f"gradkit: the ranks do not train the same parameters in the same order, at {where}. The gradkit engine sums "
        "one vector of per-parameter norms across ranks every step, so its positions must mean the same parameter "
        "everywhere. Build the same model on every rank, apply the same `configure_model`, and give the optimizer "
        "its parameters in a deterministic order (a list, not a set); freeze the same parameters on every rank."
    )
