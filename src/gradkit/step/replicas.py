"""Which ranks hold the same copy of a parameter where no DTensor says so: expert parallelism, and the check of every
copy gradkit assumes.

The engine's one all-reduce per step sums every rank's p-th power of each parameter's gradient norm, weighted by one
over the number of ranks holding that piece (:attr:`~gradkit.step.norms.ParamIndex.shard_weight`), so each piece counts
once over the world. A DTensor says which ranks hold which piece (:func:`~gradkit.step.params.replication`). A plain
tensor says nothing: it is taken as the same on every rank, as DDP keeps it. Plain parameters that differ across ranks
by design, the local experts of a hand-written mixture-of-experts, are declared with :func:`expert_parallel`.

What is assumed and not declared is checked once, at the first step of every parameter set (:class:`ReplicaCheck`):
a plain parameter must have the same gradient norm on every rank, a DTensor on a sub-mesh (FSDP2 over the
data-parallel ranks of a larger mesh) the same on the ranks of the other sub-meshes at its coordinate, and a declared
parameter the same on the ranks at the same position of their groups. The ranks' norms ride in that step's one
all-reduce, and a mismatch stops the run on every rank with the fix instead of a silently wrong norm.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from gradkit._util.arguments import name_list
from gradkit.step.host_lag import host_to_device

__all__ = [
    "CheckRow",
    "ReplicaCheck",
    "check_rows",
    "declared_groups",
    "declared_replication",
    "expert_parallel",
    "mesh_group",
    "mesh_pieces",
    "replica_check",
    "replica_mismatch",
]

# Where `expert_parallel` writes a module's or parameter's group. On the module, it survives FSDP2's `fully_shard`,
# which replaces the module's parameters by new DTensor parameters (an attribute set on the old ones is lost).
_ATTRIBUTE = "_gradkit_expert_group"

# Copies are compared within this relative tolerance: DDP leaves them bitwise equal, but tensor-parallel ranks compute
# a replicated LayerNorm's gradient apart (1e-6 apart in fp32); two experts' norms are rarely within 0.1%.
_RTOL = 1e-3
# ... and this fraction of the largest norm, for gradients that cancel to nearly zero on every copy.
_ATOL_FRACTION = 1e-6


def mesh_group(group: object, dimension: str, which: str, example: str) -> dist.ProcessGroup:
    """The process group of ``group`` (a ``ProcessGroup`` or a 1-D ``DeviceMesh``), which must hold this rank; the
    errors name the mesh ``dimension`` to pass (``"the dimension over which the experts differ, e.g. `mesh['ep']`"``),
    ``which`` group it is and an ``example`` of building one."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"`group` must be a process group or a 1-D DeviceMesh, got a {group.ndim}-D mesh {group!r}: pass "
                f"{dimension}."
            )
        group = group.get_group()
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"`group` must be a torch.distributed ProcessGroup or a 1-D DeviceMesh, got {type(group).__name__} "
            f"{group!r}. Pass {which}, e.g. {example}."
        )
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"`group` does not hold this rank ({dist.get_rank()}): pass {which} this rank belongs to (every rank "
            "passes its own group)."
        )
    return group


def expert_parallel(
    modules_or_params: nn.Module | Tensor | Iterable[nn.Module | Tensor], group: dist.ProcessGroup | DeviceMesh
) -> None:
    """Declare parameters that differ across the ranks of ``group``: the local experts of expert parallelism.

    A plain parameter (not a DTensor) is taken as the same on every rank, as DDP keeps it. A hand-written
    mixture-of-experts holds other experts on each rank of its expert-parallel group, with the same names and shapes;
    counted as copies, each rank's gradient norm would miss the other ranks' experts, each rank would clip by its own
    factor and the replicated parameters would drift apart. Declared, each rank's piece counts once: a parameter
    held by ``world / group size`` ranks (its expert-data-parallel copies) weighs ``group size / world`` in the
    engine's one all-reduce per step, so the total and per-module norms, the clip coefficient and every skip are
    those of one process holding all experts (the local experts of group rank ``k`` standing for rows
    ``k * E_local`` to ``(k + 1) * E_local`` of the stacked expert tensors). An undeclared parameter whose gradient
    differs across ranks stops the run at the first step with this fix (:class:`ReplicaCheck`).

    Call it on every rank, before the first optimizer step (in ``configure_model`` under the Trainer, or before the
    loop), with the module that holds the experts: the declaration on a module also covers the parameters that
    FSDP2's ``fully_shard`` puts in place of its own (a declaration on a parameter is lost with it). Experts that are
    DTensors sharded over the expert-parallel mesh dimension need no declaration: their placements say it.

    Args:
        modules_or_params: a module (all its parameters), a parameter, or a list of them.
        group: the process group (or 1-D ``DeviceMesh``) across whose ranks these parameters differ: the
            expert-parallel group. Its rank ``k`` holds the same experts on every such group.

    Raises:
        TypeError: if ``group`` is not a process group or 1-D mesh, or an item is not a module or a tensor.
        ValueError: if ``group`` does not hold this rank, or nothing to declare was given.

    Example::

        mesh = init_device_mesh("cuda", (dp, ep), mesh_dim_names=("dp", "ep"))
        self.experts = LocalExperts(num_experts // ep)   # w1: [E_local, d, h], the same names on every rank
        gradkit.expert_parallel(self.experts, mesh["ep"])
    """
    group = mesh_group(
        group,
        "the dimension over which the experts differ, e.g. `mesh['ep']`",
        "the expert-parallel group",
        "`dist.new_group(ranks)` or `init_device_mesh(...)['ep']`",
    )
    items = [modules_or_params] if isinstance(modules_or_params, nn.Module | Tensor) else list(modules_or_params)
    if not items:
        raise ValueError("`modules_or_params` is empty: pass the module that holds the experts, or its parameters.")
    for item in items:
        if not isinstance(item, nn.Module | Tensor):
            raise TypeError(
                f"`modules_or_params` takes modules and parameters, got {type(item).__name__} {item!r}: pass the "
                "module that holds the experts."
            )
        setattr(item, _ATTRIBUTE, group)


def declared_groups(model: nn.Module) -> dict[int, dist.ProcessGroup]:
    """``id(parameter) -> group`` for every parameter of ``model`` declared by :func:`expert_parallel` (a module's
    declaration covers its parameters; the innermost declaration wins)."""
    found: dict[int, dist.ProcessGroup] = {}
    for module in model.modules():  # parents before children: a child's declaration overrides its parent's
        group = module.__dict__.get(_ATTRIBUTE)
        if group is not None:
            found.update((id(p), group) for p in module.parameters())
    for param in model.parameters():
        group = param.__dict__.get(_ATTRIBUTE)
        if group is not None:
            found[id(param)] = group
    return found


def mesh_pieces(param: Tensor) -> tuple[int, int]:
    """``(pieces, piece)``: how many distinct pieces a DTensor's placements cut it into on its own mesh, and which of
    them this rank holds; ``(1, 0)`` for a plain tensor.

    The pieces are the product of the mesh sizes along which the placement does not replicate. Not ``is_shard()``:
    FSDP2 over TP places ``_StridedShard``, for which it is False (torch 2.13). A parameter is never Partial, so every
    placement that does not replicate splits the tensor.
    """
    placements = getattr(param, "placements", None)
    mesh = getattr(param, "device_mesh", None)
    if placements is None or mesh is None:
        return 1, 0
    coordinate = mesh.get_coordinate() or [0] * mesh.ndim
    pieces, piece = 1, 0
    for dim, placement in enumerate(placements):
        if not placement.is_replicate():
            pieces *= mesh.size(dim)
            piece = piece * mesh.size(dim) + coordinate[dim]
    return pieces, piece


def declared_replication(param: Tensor, group: dist.ProcessGroup, world: int, name: str) -> int:
    """How many ranks of the world hold the same piece of a parameter declared over ``group``.

    Its distinct pieces are the group's size times the pieces of its own mesh (a DTensor that FSDP2 shards over the
    expert-data-parallel ranks); each is held by ``world / distinct`` ranks.

    Raises:
        ValueError: if the parameter is a DTensor whose mesh already spans ranks of ``group`` (it would be split
            twice), or its distinct pieces do not divide the world.
    """
    size = dist.get_world_size(group)
    mesh = getattr(param, "device_mesh", None)
    if mesh is not None and set(mesh.mesh.flatten().tolist()) & set(dist.get_process_group_ranks(group)) != {
        dist.get_rank()
    }:
        raise ValueError(
            f"`{name}` is declared expert-parallel over a group of {size} ranks, but it is a DTensor whose device mesh "
            f"{tuple(mesh.shape)} already spans ranks of that group (placements {tuple(param.placements)}): its "
            "placements already say how it is split. Declare only plain local experts (or ones FSDP2 shards over "
            "the other ranks), not DTensors sharded over the expert-parallel dimension."
        )
    distinct = size * mesh_pieces(param)[0]
    if world % distinct:
        raise ValueError(
            f"`{name}` is declared expert-parallel over a group of {size} ranks and cut into {distinct} distinct "
            f"pieces, which does not divide the world of {world} ranks: every rank must hold one piece, each held by "
            "the same number of ranks. Build the expert-parallel groups as one dimension of a world-sized mesh."
        )
    return world // distinct


def _piece_key(param: Tensor, group: dist.ProcessGroup | None, world: int) -> int | None:
    """Which piece of ``param`` this rank holds, as a number the ranks holding a copy of it share; ``None`` when
    nothing is assumed (a DTensor whose mesh spans the world places every copy itself)."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is not None and group is None and mesh.size() == world:
        return None
    pieces, piece = mesh_pieces(param)
    return piece if group is None else dist.get_rank(group) * pieces + piece


def _assumption(param: Tensor, group: dist.ProcessGroup | None, world: int) -> str:
    """What gradkit assumes of a checked parameter's copies, for the error of :func:`replica_mismatch`."""
    if group is not None:
        return (
            f"declared expert-parallel over a group of {dist.get_world_size(group)} ranks, so gradkit counts the "
            "ranks at the same position of their groups as holding copies"
        )
    mesh = getattr(param, "device_mesh", None)
    if mesh is not None:
        return (
            f"a DTensor on a device mesh of {mesh.size()} of the {world} ranks, so gradkit counts the ranks of the "
            "other meshes at the same coordinate as holding copies of its pieces"
        )
    return "a plain tensor, so gradkit counts it as one copy held by every rank (as DDP keeps it)"


@dataclass(eq=False)
class ReplicaCheck:
    """The first-step check of the copies gradkit assumes (see the module docstring), for one parameter index.

    Each rank writes its row (gradient norms, piece keys and shard weights of the checked parameters) into a
    ``[world, 3, C]`` block of zeros (12 bytes per rank and parameter) that rides last in the step's one all-reduce
    (a sum in which one rank writes each row is a gather); :meth:`verify` compares on the device and reads one flag
    to the host. Under pipeline parallelism the ``C`` columns are every stage's checked parameters
    (:class:`~gradkit.step.pp_stages.PipelineStages`): a rank writes its stage's from ``offset`` on and NaN as the norm
    and weight of the others, which it does not hold (a non-finite norm is never compared).

    Attributes:
        positions: index positions of the checked parameters.
        keys: the piece each of them is on this rank (ranks with equal keys hold copies).
        weights: their shard weights (every rank must agree: a declaration made on some ranks only differs).
        names: the names of the columns; assumed: what gradkit assumes of each one's copies.
        rank, world: this rank and the world size.
        offset: the column of this rank's first checked parameter (0 but under pipeline parallelism).
        done: set once checked (whatever the outcome), so the check runs once per index.
    """

    positions: Tensor
    keys: Tensor
    weights: Tensor
    names: list[str]
    assumed: list[str]
    rank: int
    world: int
    offset: int = 0
    done: bool = False

    def contribution(self, norms: Tensor) -> Tensor:
        """This rank's flattened ``[world, 3, C]`` block from its ``[P]`` local norms (no host sync)."""
        block = torch.zeros(self.world, 3, len(self.names), dtype=torch.float32, device=norms.device)
        mine = slice(self.offset, self.offset + len(self.keys))
        if len(self.keys) != len(self.names):  # other stages' columns: not held here
            block[self.rank, 0::2] = math.nan
        block[self.rank, 0, mine] = norms.index_select(0, self.positions).to(torch.float32)
        block[self.rank, 1, mine] = self.keys
        block[self.rank, 2, mine] = self.weights
        return block.reshape(-1)

    def verify(self, reduced: Tensor) -> None:
        """Compare the gathered block (one host read, at the first step only); raise on every rank alike.

        Raises:
            RuntimeError: naming the first parameter whose copies differ, each rank's norm and the fix.
        """
        self.done = True
        table = reduced.reshape(self.world, 3, len(self.names))
        if not bool((_disagreeing(table) | _differing(table).any(1)).any()):  # the check's one host read
            return
        message = replica_mismatch(self.names, self.assumed, table.cpu())
        assert message is not None
        raise RuntimeError(message)


#: A checked parameter: ``(index position, piece key, shard weight, name, what is assumed of its copies)``.
CheckRow = tuple[int, int, float, str, str]


def check_rows(
    params: Sequence[Tensor], names: Sequence[str], groups: dict[int, dist.ProcessGroup], weights: Sequence[float]
) -> list[CheckRow]:
    """The parameters of an index whose copies :class:`ReplicaCheck` compares (``groups`` from
    :func:`declared_groups`): all but DTensors on a world-sized mesh (FSDP2, HSDP), whose placements say it all."""
    world = dist.get_world_size()
    rows = []
    for i, param in enumerate(params):
        group = groups.get(id(param))
        key = _piece_key(param, group, world)
        if key is not None:
            rows.append((i, key, weights[i], names[i], _assumption(param, group, world)))
    return rows


def replica_check(
    rows: Sequence[CheckRow],
    device: torch.device,
    columns: tuple[Sequence[str], Sequence[str]] | None = None,
    offset: int = 0,
) -> ReplicaCheck | None:
    """The :class:`ReplicaCheck` of an index's :func:`check_rows`, or ``None`` when nothing is assumed.

    Args:
        rows: this rank's checked parameters.
        device: where the check's tensors live.
        columns: under pipeline parallelism, the names of every stage's checked parameters and what is assumed of
            each (:class:`~gradkit.step.pp_stages.PipelineStages`), of which this rank's start at ``offset``.
    """
    names, assumed = columns if columns is not None else ([r[3] for r in rows], [r[4] for r in rows])
    if not names:
        return None
    return ReplicaCheck(
        positions=host_to_device([r[0] for r in rows], torch.long, device),
        keys=host_to_device([float(r[1]) for r in rows], torch.float32, device),
        weights=host_to_device([r[2] for r in rows], torch.float32, device),
        names=list(names),
        assumed=list(assumed),
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        offset=offset,
    )


def _differing(table: Tensor) -> Tensor:
    """``[C, world]`` bool: whether the copies of checked parameter ``c`` that hold piece key ``k`` have finite norms
    further apart than the tolerance. Device operations only (no host read).

    Vectorized over ranks and parameters (10,000 parameters on 1,024 ranks are ten million entries): each (parameter,
    key) pair is one holder set, whose largest and smallest finite norm are taken with ``scatter_reduce``. A key is
    below the world size (a parameter has at most that many distinct pieces).
    """
    norms, keys = table[:, 0], table[:, 1].long().clamp(0, table.shape[0] - 1)
    world, count = norms.shape
    finite = torch.isfinite(norms)  # a non-finite norm is the guards' matter, not a sign of a missing declaration
    atol = _ATOL_FRACTION * norms.abs().where(finite, 0.0).max()
    slot = (torch.arange(count, device=norms.device).expand(world, count) * world + keys).reshape(-1)
    blank = torch.full((count * world,), math.inf, dtype=norms.dtype, device=norms.device)
    high = blank.neg().scatter_reduce(0, slot, norms.where(finite, -math.inf).reshape(-1), "amax")
    low = blank.scatter_reduce(0, slot, norms.where(finite, math.inf).reshape(-1), "amin")
    held = torch.zeros_like(slot).index_add(0, slot, finite.reshape(-1).long()) > 1
    apart = held & (high - low > _RTOL * torch.maximum(high.abs(), low.abs()) + atol)
    return apart.reshape(count, world)


def _disagreeing(table: Tensor) -> Tensor:
    """``[C]`` bool: whether the ranks that hold each checked parameter disagree on its shard weight (NaN: a rank of
    another pipeline stage, which does not hold it)."""
    weights = table[:, 2]
    held = ~weights.isnan()
    return weights.where(held, -math.inf).amax(0) > weights.where(held, math.inf).amin(0)


def replica_mismatch(names: Sequence[str], assumed: Sequence[str], table: Tensor) -> str | None:
    """The error for the first parameter whose copies differ, or ``None`` when every copy agrees.

    Args:
        names: the checked parameters; assumed: what gradkit assumes of each one's copies.
        table: ``[world, 3, C]``, per rank the norms, piece keys and shard weights of the checked parameters: ranks
            with equal keys hold copies, whose norms must agree within 0.1% (non-finite ones are left to the
            guards); every rank must have the same weight.

    Example::

        >>> norms_keys_weights = torch.tensor([[[1.0], [0.0], [0.0]], [[2.0], [0.0], [0.0]]])
        >>> replica_mismatch(["fc.weight"], ["a plain tensor"], norms_keys_weights)[:40]
        'gradkit: the gradient of `fc.weight` dif'
    """
    disagree = _disagreeing(table).nonzero().flatten().tolist()
    if disagree:
        c = disagree[0]
        return (
            f"gradkit: the ranks disagree on how many of them hold a copy of `{names[c]}` (shard weights "
            f"{sorted({w for w in table[:, 2, c].tolist() if not math.isnan(w)})}): it is declared with "
            "`gradkit.expert_parallel` on some ranks "
            "only. Declare it on every rank, with each rank's own expert-parallel group."
        )
    apart = _differing(table)
    differing = apart.any(1).nonzero().flatten().tolist()
    if not differing:
        return None
    c = differing[0]
    key = int(apart[c].nonzero()[0])
    # The ranks holding the copies that differ (a NaN weight: another pipeline stage's rank, which holds none).
    holders = ((table[:, 1, c] == key) & ~table[:, 2, c].isnan()).nonzero().flatten().tolist()
    shown = ", ".join(f"rank {r} {table[r, 0, c].item():.6g}" for r in holders)
    others = [names[d] for d in differing[1:]]
    also = (
        f" The gradients of {len(others)} other parameter(s) differ too: {name_list(others, quote=True)}."
        if others
        else ""
    )
    if assumed[c].startswith("declared"):
        fix = (
            "Each copy must get the same gradient: all-reduce the experts' gradients over the ranks that hold the "
            "same experts (the expert-data-parallel group) before gradkit's step."
        )
    else:
        fix = (
            "If it differs across ranks by design (the local experts of expert parallelism), declare it before the "
            "first step: `gradkit.expert_parallel(module, group)` with the module that holds it and the process "
            "group (or 1-D DeviceMesh) across which it differs; if the ranks train different stages of a pipeline, "
            "declare each rank's stage before the door starts: `gradkit.pipeline_parallel(stage_module, pp_group)`. "
            "If it should be the same on every rank, its gradient is not all-reduced: wrap the module in DDP or "
            "`fully_shard`, or all-reduce the gradient before the step. Under context parallelism every "
            "context-parallel rank holds a copy too (each computes the gradient of its part of the sequence): reduce "
            "over the cp ranks as well, with `fully_shard` over the flattened data x context mesh "
            "(`mesh['dp', 'cp']._flatten('dp_shard_cp')`, as torchtitan does) rather than `mesh['dp']`, or DDP "
            "over the cp group."
        )
    return (
        f"gradkit: the gradient of `{names[c]}` differs between ranks that gradkit counts as holding copies of it, "
        f"at the first step ({shown}). It is {assumed[c]}; summed that way, its norm, the clip coefficient and every "
        f"skip decision would be silently wrong, and the replicated parameters would drift apart. {fix}{also}"
    )
