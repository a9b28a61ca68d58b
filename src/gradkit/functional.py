"""The math of gradkit's clippers as plain functions of tensors, composed the way ``torch.nn.utils.clip_grad`` is.

Each function is two steps: a measurement (:func:`grad_norm`, :func:`unit_norms`) and a coefficient
(:func:`clip_coefficient`, :func:`agc_coefficients`), then one multiply. The policies run the same functions on the
step's one read of the gradients (the pipeline measures once for every policy and writes once); these are for a
reader who wants the rule, and for code that clips a few tensors outside a training step.

Example::

    >>> import torch
    >>> from gradkit import functional as GF
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> w.grad = torch.full((3,), 4.0)
    >>> GF.clip_grad_norm_([w], max_norm=1.0)
    tensor(6.9282)
    >>> round(float(torch.linalg.vector_norm(w.grad)), 4)
    1.0
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from gradkit.policies.agc import agc_coefficients
from gradkit.policies.clipping import clip_coefficient
from gradkit.step.norms import per_tensor_norms, row_norms, total_norm

__all__ = [
    "adaptive_clip_grad_",
    "agc_coefficients",
    "clip_coefficient",
    "clip_grad_norm_",
    "clip_grads_by_",
    "grad_norm",
    "unit_norms",
]


def _grads(parameters: Tensor | Iterable[Tensor]) -> list[Tensor]:
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    return [p.grad for p in params if p.grad is not None]


def grad_norm(grads: list[Tensor], norm_type: float = 2.0) -> Tensor:
    """The total p-norm of ``grads`` (``torch.nn.utils.get_total_norm``): the per-tensor norms in one multi-tensor
    call per (device, dtype) run (``gradkit.step.norms.per_tensor_norms``), then their norm."""
    return total_norm(per_tensor_norms(grads, norm_type), norm_type)


def clip_grads_by_(grads: list[Tensor], coef: Tensor) -> None:
    """Multiply every gradient by ``coef`` (a device scalar, kept fp32 as ``clip_grads_with_norm_`` does)."""
    for grad in grads:
        grad.mul_(coef.to(grad.device))


def clip_grad_norm_(parameters: Tensor | Iterable[Tensor], max_norm: float, norm_type: float = 2.0) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (the rule of :class:`~gradkit.ClipGradNorm`): returns the total norm before
    clipping; no host sync."""
    grads = _grads(parameters)
    total = grad_norm(grads, norm_type)
    clip_grads_by_(grads, clip_coefficient(total, max_norm))
    return total


def unit_norms(t: Tensor) -> Tensor:
    """The 2-norm of each output unit of ``t`` (a row along dim 0; a bias or a gain is one unit), fp32."""
    return row_norms(t) if t.ndim > 1 else torch.linalg.vector_norm(t.float()).reshape(1)


def adaptive_clip_grad_(parameters: Tensor | Iterable[Tensor], clip_factor: float = 0.01, eps: float = 1e-3) -> None:
    """Unit-wise adaptive gradient clipping (the rule of :class:`~gradkit.AdaptiveGradClip`; Brock et al. 2021, as
    ``timm.utils.agc.adaptive_clip_grad``): each unit's gradient is scaled by
    ``min(1, clip_factor * max(|W_i|, eps) / |G_i|)``."""
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    for p in (p for p in params if p.grad is not None):
        coefs = agc_coefficients(unit_norms(p.grad), unit_norms(p.detach()), clip_factor, eps)
        p.grad.mul_(coefs.reshape((-1,) + (1,) * (p.grad.ndim - 1) if p.grad.ndim > 1 else ()))
