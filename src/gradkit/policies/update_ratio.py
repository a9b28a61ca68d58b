"""The update-to-weight ratio ``||w - w_before|| / ||w_before||`` of :class:`~gradkit.GradNormMonitor`'s
``update_ratio=True``, measured on logging steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gradkit.step.norms import (
    ParamIndex,
    combine_sharded,
    grouped_norms,
    local_tensor,
    per_tensor_norms,
    powered,
    reduce_sharded,
    stage_columns,
    total_norm,
)

__all__ = ["update_ratios"]


def update_ratios(
    index: ParamIndex, before: list[Tensor], weight_norms: Tensor, rows: tuple[list[str], Tensor] | None
) -> dict[str, Tensor]:
    """The update-to-weight ratios ``||w - w_before|| / ||w_before||`` (2-norms), total and per row.

    Overwrites ``before`` with the update (one ``_foreach_sub_``), takes its per-parameter norms (one
    ``_foreach_norm`` per device/dtype group) and, when some parameter is sharded, sums the shards' squares in one
    all-reduce (:func:`~gradkit.step.norms.reduce_sharded`, the weights' squares riding along as an extra).

    Args:
        index: the parameters of one optimizer.
        before: copies of this rank's (local) parameters, taken before the step, in ``index`` order.
        weight_norms: this rank's per-parameter 2-norms of ``before``.
        rows: the per-module rows and the row of every parameter, or None for the total only.

    Example::

        >>> from gradkit.step.params import build_param_index
        >>> w = torch.nn.Parameter(torch.full((4,), 2.0))
        >>> index = build_param_index([{"params": [w]}], {id(w): "w"}, 0, torch.device("cpu"))
        >>> before = [w.detach().clone()]
        >>> with torch.no_grad():
        ...     _ = w.sub_(0.004)
        >>> update_ratios(index, before, per_tensor_norms(before, 2.0), None)["update_ratio/total"]
        tensor(0.0020)
    """
    device = index.shard_weight.device
    torch._foreach_sub_(before, [local_tensor(p.detach()) for p in index.params])
    update_local = per_tensor_norms(before, 2.0, index.run_bounds).to(device)
    squares = stage_columns(index, powered(weight_norms, 2.0) * index.shard_weight)
    extras = {_WEIGHT_SQUARES: squares} if index.any_sharded else {}
    norms, reduced = reduce_sharded(index, {2.0: update_local}, extras)
    update = norms[2.0]  # every stage's under pipeline parallelism: so are the weights'
    if index.pp is not None:
        weights = reduced[_WEIGHT_SQUARES].sqrt()
    else:
        weights = (
            combine_sharded(weight_norms, index.shard_weight, reduced[_WEIGHT_SQUARES], 2.0) if extras else weight_norms
        )
    out = {"update_ratio/total": total_norm(update, 2.0) / total_norm(weights, 2.0)}
    if rows is not None:
        names, row_index = rows
        ratio = grouped_norms(update, row_index, len(names), 2.0) / grouped_norms(weights, row_index, len(names), 2.0)
        out.update({f"update_ratio/module/{name}": ratio[i] for i, name in enumerate(names)})
    return out


_WEIGHT_SQUARES = "update_ratio.weight_squares"


@dataclass
class _Before:
    """What a logging step keeps of one optimizer's parameters for the update ratio: the copies until the step
    returns, then the ratios until they are logged (``step``: the step they are logged under)."""

    index: ParamIndex
    params: list[Tensor]
    weight_norms: Tensor
    rows: tuple[list[str], Tensor] | None
    suffix: str
    on_period: bool
    step: int
    ratios: dict[str, Tensor] | None = None
