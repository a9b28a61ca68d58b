"""The gradient writes a step needs beyond one common factor: per-parameter factors (AGC), value clamps, sparse
gradients, and the post-clip norms a logging step measures when they cannot be derived.

:meth:`~gradkit.StepPlan.apply` multiplies dense gradients by the plan's common factor itself (the write of
most steps); it calls :func:`write` when the plan asks for more.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from gradkit.step.norms import fill_present, local_tensor, per_tensor_norms, reduce_sharded, sparse_values

if TYPE_CHECKING:
    from gradkit.step.pipeline import StepPlan

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


def write(plan: StepPlan, common: Tensor | None) -> None:
    """Multiply the gradients by ``common`` (fp32, or ``None``) and by the plan's per-parameter factors, then clamp.

    Per-parameter factors (AGC) are multiplied by ``common`` in fp32, then cast to their own gradient's dtype (and
    broadcast over it: unit-wise factors); sparse gradients are written through their values.
    """
    if plan.param_coefs:
        runs, sparse_grads = _write_param_coefs(plan, common)
    else:
        runs, sparse_grads = split_runs(plan._grads, plan.run_ids)
    if common is not None:
        for run in runs:
            torch._foreach_mul_(run, common.to(run[0].device))
        for g in sparse_grads:
            _scale_sparse_(g, common)
    if plan.clamp_value is not None and plan._grads:
        _clamp(plan, plan.clamp_value)


def _write_param_coefs(plan: StepPlan, common: Tensor | None) -> tuple[list[list[Tensor]], list[Tensor]]:
    """Multiply each gradient that has its own factor (AGC) by it times ``common``; returns the other gradients, as
    :func:`split_runs` groups them, for the common factor alone."""
    uniform: list[Tensor] = []
    uniform_ids: list[int] = []
    own: list[tuple[Tensor, Tensor, bool]] = []
    for i, g, run in zip(plan.present, plan._grads, plan.run_ids, strict=True):
        coef = plan.param_coefs.get(i)
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


def _clamp(plan: StepPlan, clamp_value: float) -> None:
    """Value clipping: clamp every gradient element (the values of a sparse gradient) to the bound."""
    runs, sparse = split_runs(plan._grads, plan.run_ids)
    runs += [[sparse_values(g)] for g in sparse]
    if plan.loss_scale is None:
        for run in runs:
            _clamp_(run, clamp_value)
        return
    # The gradients still carry the loss scale: so does the bound (a device scalar, no host sync). The scaler looks
    # for overflows only inside `step`, after this: a clamp must not turn an Inf into a finite value, so a step with a
    # non-finite gradient gets NaN bounds (all NaN, which it skips).
    finite = next(iter(plan.stats.values())).finite
    bound = torch.where(finite, plan.loss_scale * clamp_value, math.nan)
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


def measure_grads(plan: StepPlan, norm_type: float) -> Tensor:
    """Read the plan's gradients as they are now: global per-parameter norms (every stage's under pipeline
    parallelism, as :func:`~gradkit.step.norms.reduce_sharded` returns them), without the loss scale.

    A second read of the gradients: only for post-clip values that cannot be derived (callers use it on logging steps
    only). Under sharding this performs a collective, so every rank must call it.

    Raises:
        RuntimeError: if the plan's gradients are gone (the optimizer's ``zero_grad`` ran since the step).
    """
    grads, present = plan._grads, plan.present
    if plan.released:
        params = plan.index.params
        present = [i for i, p in enumerate(params) if p.grad is not None]
        if present != plan.present:
            raise RuntimeError(
                "The gradients of this optimizer step are no longer there (`zero_grad` ran since the step): post-clip "
                "norms can only be measured until the next `zero_grad`. Read them on the step itself, as the gradkit "
                "callbacks log them."
            )
        grads = [local_tensor(g.coalesce() if g.is_sparse else g) for g in (params[i].grad for i in present)]
    local = per_tensor_norms(grads, norm_type).to(plan.index.shard_weight.device)
    local = fill_present(local, present, plan.index.num_params)
    if plan.loss_scale is not None:
        local = local / plan.loss_scale
    return reduce_sharded(plan.index, {norm_type: local})[0][norm_type]
