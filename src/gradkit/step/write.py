"""The gradient writes a step needs beyond one common factor: per-parameter factors (AGC), value clamps, sparse
gradients, and the post-clip norms a logging step measures when they cannot be derived.

:meth:`~gradkit.step.pipeline.StepRecord.apply` multiplies dense gradients by the decision's common factor itself
(the write of most steps); it calls :func:`write` when the decision asks for more. The gradients come from the
pipeline's read of the step, the one holder of them; what the policies decided comes from the ``Decision`` they
wrote.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from gradkit.step.norms import fill_present, local_tensor, per_tensor_norms, reduce_sharded, sparse_values

if TYPE_CHECKING:
    from gradkit.step.plan import Decision, StepStats

__all__ = ["measure_grads", "split_runs", "write"]


def split_runs(grads: list[Tensor], run_ids: list[int]) -> tuple[list[list[Tensor]], list[Tensor]]:
    """Dense gradients in runs that share device and dtype (one ``_foreach`` call each), and the sparse ones."""
    runs: list[list[Tensor]] = []
    sparse: list[Tensor] = []
    last = -1
    for g, run in zip(grads, run_ids, strict=True):
        if run < 0:
            sparse.append(g)
        elif run == last:
            runs[-1].append(g)
        else:
            runs.append([g])
            last = run
    return runs, sparse


def write(grads: list[Tensor], run_ids: list[int], stats: StepStats, decision: Decision, common: Tensor | None) -> None:
    """Multiply the step's gradients (``grads``, of the parameters at ``stats.present``, in the (device, dtype)
    groups ``run_ids``) by ``common`` (fp32, or ``None``) and by the decision's per-parameter factors, then clamp.

    Per-parameter factors (AGC) are multiplied by ``common`` in fp32, then cast to their own gradient's dtype (and
    broadcast over it: unit-wise factors); sparse gradients are written through their values.
    """
    if decision.param_coefs:
        runs, sparse_grads = _write_param_coefs(grads, run_ids, stats.present, decision.param_coefs, common)
    else:
        runs, sparse_grads = split_runs(grads, run_ids)
    if common is not None:
        for run in runs:
            torch._foreach_mul_(run, common.to(run[0].device))
        for g in sparse_grads:
            _scale_sparse_(g, common)
    if decision.clamp_value is not None and grads:
        _clamp(grads, run_ids, stats, decision.clamp_value)


def _write_param_coefs(
    grads: list[Tensor], run_ids: list[int], present: list[int], param_coefs: dict[int, Tensor], common: Tensor | None
) -> tuple[list[list[Tensor]], list[Tensor]]:
    """Multiply each gradient that has its own factor (AGC) by it times ``common``; returns the other gradients, as
    :func:`split_runs` groups them, for the common factor alone."""
    uniform: list[Tensor] = []
    uniform_ids: list[int] = []
    own: list[tuple[Tensor, Tensor, bool]] = []
    for i, g, run in zip(present, grads, run_ids, strict=True):
        coef = param_coefs.get(i)
        if coef is None:
            uniform.append(g)
            uniform_ids.append(run)
        else:
            own.append((g, coef, run < 0))
    coefs = [c for _, c, _ in own]
    if common is not None:
        coefs = torch._foreach_mul(coefs, common)
    own = [(g, c if c.dtype == g.dtype else c.to(g.dtype), s) for (g, _, s), c in zip(own, coefs, strict=True)]
    dense = [(g, c) for g, c, sparse in own if not sparse]
    if dense:
        torch._foreach_mul_([g for g, _ in dense], [c for _, c in dense])
    for g, c, sparse in own:
        if sparse:
            _scale_sparse_(g, c)
    return split_runs(uniform, uniform_ids)


def _clamp(grads: list[Tensor], run_ids: list[int], stats: StepStats, clamp_value: float) -> None:
    """Value clipping: clamp every gradient element (the values of a sparse gradient) to the bound."""
    runs, sparse = split_runs(grads, run_ids)
    runs += [[sparse_values(g)] for g in sparse]
    if stats.loss_scale is None:
        for run in runs:
            _clamp_(run, clamp_value)
        return
    # The gradients still carry the loss scale: so does the bound (a device scalar, no host sync). The scaler looks
    # for overflows only inside `step`, after this: a clamp must not turn an Inf into a finite value, so a step with a
    # non-finite gradient gets NaN bounds (all NaN, which it skips).
    finite = next(iter(stats.norms.values())).finite
    bound = torch.where(finite, stats.loss_scale * clamp_value, math.nan)
    for run in runs:
        high = bound.to(run[0].device, run[0].dtype)  # one cast of the bound per (device, dtype) run
        low = -high
        for g in run:
            g.clamp_(min=low, max=high)


def _scale_sparse_(grad: Tensor, factor: Tensor) -> None:
    """Multiply a coalesced sparse COO gradient in place by a scalar or by one factor per row (dim 0)."""
    values = grad._values()
    if factor.numel() == 1:
        values.mul_(factor.reshape(()).to(values.device))
    else:
        rows = factor.reshape(-1)[grad._indices()[0]]
        values.mul_(rows.view(-1, *([1] * (values.ndim - 1))))


def _clamp_(tensors: list[Tensor], bound: float) -> None:
    """Clamp every tensor to ``[-bound, bound]`` in place: one ``_foreach`` call per bound where the fused
    multi-tensor kernel exists (CUDA), one ``clamp_`` pass per tensor on CPU, where ``_foreach`` would read each
    tensor twice."""
    if tensors[0].device.type == "cpu":
        for t in tensors:
            t.clamp_(-bound, bound)
    else:
        torch._foreach_clamp_min_(tensors, -bound)
        torch._foreach_clamp_max_(tensors, bound)


def measure_grads(stats: StepStats, norm_type: float) -> Tensor:
    """Read a step's gradients as they are now, from the parameters, until the optimizer's ``zero_grad``: global
    per-parameter norms (every stage's under pipeline parallelism, as :func:`~gradkit.step.norms.reduce_sharded`
    returns them), without the loss scale.

    A second read of the gradients: only for post-clip values that cannot be derived (callers use it on logging steps
    only). Under sharding this performs a collective, so every rank must call it.

    Raises:
        RuntimeError: if the step's gradients are gone (the optimizer's ``zero_grad`` ran since the step).
    """
    params = stats.index.params
    present = [i for i, p in enumerate(params) if p.grad is not None]
    if present != stats.present:
        raise RuntimeError(
            "The gradients of this optimizer step are no longer there (`zero_grad` ran since the step): post-clip "
            "norms can only be measured until the next `zero_grad`. Read them on the step itself, as the gradkit "
            "callbacks log them."
        )
    grads = [local_tensor(g.coalesce() if g.is_sparse else g) for g in (params[i].grad for i in present)]
    local = per_tensor_norms(grads, norm_type).to(stats.index.shard_weight.device)
    local = fill_present(local, present, stats.index.num_params)
    if stats.loss_scale is not None:
        local = local / stats.loss_scale
    return reduce_sharded(stats.index, {norm_type: local})[0][norm_type]
