r"""Attention heads whose query and key weights are DTensors (FSDP2, tensor parallelism, both): which rows of each
weight a rank holds, and which heads its forward computes. What :class:`~gradkit.QKClip` needs to rescale the local
shards by the rule computed for the whole weight, and to place the maxima of a tensor-parallel rank's heads.

- :func:`local_row_index`: the global indices of the rows (along a slab's dimension) that the local shard of a
  DTensor holds, from its mesh and placements, for any split of those rows (``Shard``, FSDP2-over-TP's
  ``_StridedShard``, several mesh dimensions, uneven chunks); ``None`` where it holds every row.
- :func:`forward_heads`: the query heads a tensor-parallel forward computes on this rank (its weights as the forward
  sees them: ``ColwiseParallel``'s ``Shard(0)`` rows), refused where they are not whole heads.

Pure PyTorch; no Lightning here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from gradkit.policies.attention_heads import Heads, Unreadable

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

__all__ = ["forward_heads", "local_row_index"]


def _dtensor(t: Tensor) -> DTensor | None:
    """``t`` where it is a DTensor (imported only then: a build without ``torch.distributed`` never gets here)."""
    if getattr(t, "placements", None) is None:
        return None
    from torch.distributed.tensor import DTensor

    return t if isinstance(t, DTensor) else None


def _row_placement(placement: Placement, dim: int) -> Placement:
    """The placement of a DTensor seen by a 1-D vector of its rows along ``dim``: its split of those rows (its
    ``split_factor`` kept for ``_StridedShard``), ``Replicate`` where it splits another dimension or none."""
    from torch.distributed.tensor import Replicate, Shard

    if placement.is_partial():
        raise Unreadable(f"a weight placed {placement} (a partial sum) cannot be rescaled row by row")
    if getattr(placement, "dim", None) != dim:  # Replicate, or a split of another dimension
        return Replicate()
    split_factor = getattr(placement, "split_factor", None)  # `_StridedShard`: `is_shard()` is False for it
    if split_factor is not None:
        return type(placement)(0, split_factor=split_factor)
    return Shard(0)


def local_row_index(param: Tensor, dim: int) -> Tensor | None:
    """The global index (along ``dim``) of each row of the local shard of DTensor ``param``, on its device; ``None``
    for a plain tensor or a DTensor whose shard holds every row (split along another dimension, or replicated).

    Exact by construction: ``torch.arange`` of the rows, distributed with the placements of ``param`` restricted to
    ``dim`` and no communication (``src_data_rank=None``), is split by the same code that split ``param``. Once, at
    ``attach``.

    Raises:
        Unreadable: a partial placement, or a shard whose rows differ in count from the index's.
    """
    sharded = _dtensor(param)
    if sharded is None:
        return None
    from torch.distributed.tensor import distribute_tensor

    placements = [_row_placement(p, dim) for p in sharded.placements]
    if all(p.is_replicate() for p in placements):
        return None
    rows = torch.arange(sharded.shape[dim])
    index = distribute_tensor(rows, sharded.device_mesh, placements, src_data_rank=None).to_local()
    local = sharded.to_local()
    if index.numel() != local.shape[dim]:
        raise Unreadable(
            f"its local shard holds {local.shape[dim]} rows where its placements {sharded.placements} give "
            f"{index.numel()}"
        )
    return index.to(local.device)


def _row_split(param: Tensor, dim: int) -> tuple[int, int] | None:
    """``(mesh dimension, size)`` of the one plain ``Shard(dim)`` that splits ``param``'s rows in a forward, ``None``
    where none does.

    Raises:
        Unreadable: rows split by several mesh dimensions or by a strided shard.
    """
    sharded = _dtensor(param)
    if sharded is None:
        return None
    from torch.distributed.tensor import Shard

    splits = [i for i, p in enumerate(sharded.placements) if getattr(p, "dim", None) == dim]
    if not splits:
        return None
    if len(splits) > 1 or type(sharded.placements[splits[0]]) is not Shard:  # not `_StridedShard`: strided rows
        raise Unreadable(
            f"its forward sees query or key rows placed {sharded.placements}; QKClip reads a tensor-parallel "
            "forward whose rows are split once, as `ColwiseParallel` does (`Shard(0)`)"
        )
    return splits[0], sharded.device_mesh.size(splits[0])


def forward_heads(now: Heads, heads: Heads) -> tuple[int, int]:
    """``(first, count)``: the query heads ``first ... first + count - 1`` that this rank's forward computes, from
    ``now``, the module's heads with its weights as the forward sees them (tensor parallelism: ``Shard(0)`` rows of
    the query and key projections over one mesh dimension; FSDP2 gathers its shards before the forward), and
    ``heads``, those found at ``attach``. ``(0, heads.heads)`` where the forward sees every row.

    Raises:
        Unreadable: rows split other than once by ``Shard``, query and key rows split differently, a fused
            projection split (its local rows are not ``[q | k | v]``), or heads that do not split evenly.
    """
    q, k = now.q[0], now.k[0]
    q_split, k_split = _row_split(q.param, q.dim), _row_split(k.param, k.dim)
    if q_split is None and k_split is None:
        return 0, heads.heads
    if q_split is None or k_split is None or q_split != k_split or q.param is k.param:
        raise Unreadable(
            "its forward splits the query and key rows differently (or splits a fused [q | k | v] projection); "
            "QKClip reads a tensor-parallel forward where both projections are `ColwiseParallel` on the same mesh"
        )
    mesh_dim, size = q_split
    if heads.heads % size or heads.kv_heads % size:
        raise Unreadable(
            f"its {heads.heads} query heads and {heads.kv_heads} key heads do not split evenly over {size} "
            "tensor-parallel ranks"
        )
    count = heads.heads // size
    mesh = q.param.device_mesh  # type: ignore[attr-defined]  # a DTensor: `_row_split` found its split
    return mesh.get_local_rank(mesh_dim) * count, count
