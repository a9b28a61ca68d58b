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

The stages of a pipeline train other parameters by design: declared with :func:`~gradkit.pipeline_parallel`, only
the ranks of the same stage (its data-parallel copies) must agree, and every rank must have declared it alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from gradkit.step.params import clean_name
from gradkit.step.pp_stages import declared_pipeline

__all__ = ["first_mismatch", "layout_mismatch", "parameter_layout", "pipeline_mismatch", "verify_same_layout"]


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


def first_mismatch(layouts: Sequence[Sequence[str]], ranks: Sequence[int] | None = None) -> str | None:
    """A message naming the first position where the ranks' layouts differ and which ranks differ from the first, or
    ``None`` when all agree. ``ranks``: the rank of each layout (``0, 1, ...`` when ``None``).

    Example::

        >>> first_mismatch([["a", "b"], ["a", "c"]])
        'position 1: rank 0 has `b`; rank 1 has `c`'
        >>> first_mismatch([["a"], ["a"]]) is None
        True
        >>> first_mismatch([["a"], ["b"]], ranks=[1, 3])
        'position 0: rank 1 has `a`; rank 3 has `b`'
    """
    ranks = list(range(len(layouts))) if ranks is None else ranks
    length = max(len(layout) for layout in layouts)
    for i in range(length):
        at = [layout[i] if i < len(layout) else "<no parameter>" for layout in layouts]
        if any(entry != at[0] for entry in at):
            differing = [k for k, entry in enumerate(at) if entry != at[0]]
            others = "; ".join(f"rank {ranks[k]} has `{at[k]}`" for k in differing)
            return f"position {i}: rank {ranks[0]} has `{at[0]}`; {others}"
    return None


def _stage_tag(model: nn.Module | None) -> str:
    """Which pipeline stage a rank trains, as every rank compares it: ``""`` without a declaration."""
    group = declared_pipeline(model)
    return "" if group is None else f"stage {dist.get_rank(group)} of {dist.get_world_size(group)}"


def pipeline_mismatch(tags: Sequence[str]) -> str | None:
    """The error when some ranks declared a pipeline stage and others did not, or declared other stage counts."""
    kinds = {tag.split(" of ")[-1] if tag else "" for tag in tags}
    if len(kinds) == 1:
        return None
    undeclared = [r for r, tag in enumerate(tags) if not tag]
    described = "; ".join(f"rank {r}: {tag or 'none'}" for r, tag in enumerate(tags))
    return (
        f"gradkit: the ranks do not declare the same pipeline ({described}). Declare every rank's stage with "
        "`gradkit.pipeline_parallel(stage_module, pp_group)` before the door starts, with the same pipeline group "
        f"size on every rank{f' (not declared on ranks {undeclared})' if undeclared else ''}."
    )


def verify_same_layout(
    optimizers: Sequence[Optimizer], names_by_id: dict[int, str], model: nn.Module | None = None
) -> None:
    """Raise on every rank unless all ranks train the same parameters in the same order: all ranks, or under a
    :func:`~gradkit.pipeline_parallel` declaration on ``model`` the ranks of each stage. Collective: every rank of
    the default process group must call it. One ``all_gather_object`` of a 64-character hash when they agree.

    Raises:
        RuntimeError: naming the first parameter that differs and the ranks that hold something else, or the ranks
            that declare another pipeline than the others.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    layout = parameter_layout(optimizers, names_by_id)
    digest = hashlib.sha256("\n".join(layout).encode()).hexdigest()
    entries: list[tuple[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(entries, (_stage_tag(model), digest))
    tags = [entry[0] if entry else "" for entry in entries]
    mixed = pipeline_mismatch(tags)
    if mixed is not None:
        raise RuntimeError(mixed)
    if len(set(entries)) == len(set(tags)):  # one layout per stage (the whole world without a pipeline)
        return
    layouts: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, layout)
    raise RuntimeError(layout_mismatch(tags, [gathered or [] for gathered in layouts]))


def layout_mismatch(tags: Sequence[str], layouts: Sequence[Sequence[str]]) -> str:
    """The error for the first stage (the whole world without a pipeline) whose ranks' layouts differ."""
    for tag in dict.fromkeys(tags):
        ranks = [r for r, t in enumerate(tags) if t == tag]
        where = first_mismatch([layouts[r] for r in ranks], ranks)
        if where is None:
            continue
        if tag:
            return (
                f"gradkit: the ranks of pipeline {tag} do not train the same parameters in the same order, at "
                f"{where}. The ranks of one stage are its data-parallel copies: build the same stage on each, and "
                "give the optimizer its parameters in a deterministic order (a list, not a set)."
            )
        return (
            f"gradkit: the ranks do not train the same parameters in the same order, at {where}. The gradkit engine "
            "sums one vector of per-parameter norms across ranks every step, so its positions must mean the same "
            "parameter everywhere. Build the same model on every rank, apply the same `configure_model`, and give "
            "the optimizer its parameters in a deterministic order (a list, not a set); freeze the same parameters "
            "on every rank. If the ranks train different stages of a pipeline, declare each rank's stage before the "
            "door starts: `gradkit.pipeline_parallel(stage_module, pp_group)`."
        )
    raise AssertionError("the layouts' hashes differ but the layouts do not")
