"""``gradkit.functional``: the clippers' rules as functions, against torch's and timm's own (written out here)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradkit import functional as GF


def _model_with_grads(seed: int, scale: float) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    (model(torch.randn(4, 6)).square().sum() * scale).backward()
    return model


def _copy(model: nn.Module) -> nn.Module:
    twin = _model_with_grads(0, 1.0)
    twin.load_state_dict(model.state_dict())
    for mine, theirs in zip(twin.parameters(), model.parameters(), strict=True):
        mine.grad = theirs.grad.clone()
    return twin


@pytest.mark.parametrize(("max_norm", "norm_type"), [(0.5, 2.0), (1e6, 2.0), (0.1, 1.0), (0.2, float("inf"))])
def test_clip_grad_norm_equals_torch_bitwise(max_norm: float, norm_type: float) -> None:
    model = _model_with_grads(0, 10.0)
    reference = _copy(model)
    total = GF.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
    assert torch.equal(total, expected)
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine.grad, theirs.grad)


def _timm_adaptive_clip_grad(parameters, clip_factor: float, eps: float) -> None:
    """``timm.utils.agc.adaptive_clip_grad`` as timm writes it (timm is not a dependency)."""

    def unitwise_norm(x: torch.Tensor) -> torch.Tensor:
        return x.norm(2.0) if x.ndim <= 1 else x.norm(2.0, dim=tuple(range(1, x.ndim)), keepdim=True)

    for p in parameters:
        if p.grad is None:
            continue
        max_norm = unitwise_norm(p.detach()).clamp_(min=eps).mul_(clip_factor)
        grad_norm = unitwise_norm(p.grad.detach())
        clipped = p.grad.detach() * (max_norm / grad_norm.clamp(min=1e-6))
        p.grad.detach().copy_(torch.where(grad_norm < max_norm, p.grad.detach(), clipped))


@pytest.mark.parametrize("clip_factor", [0.01, 0.5, 1e6])
def test_adaptive_clip_grad_equals_timm_bitwise(clip_factor: float) -> None:
    model = _model_with_grads(1, 3.0)
    model[0].bias.data.zero_()  # a zero unit: the eps floor decides its clip
    reference, before = _copy(model), _copy(model)
    GF.adaptive_clip_grad_(model.parameters(), clip_factor, eps=1e-3)
    _timm_adaptive_clip_grad(reference.parameters(), clip_factor, eps=1e-3)
    changed = 0
    for mine, theirs, old in zip(model.parameters(), reference.parameters(), before.parameters(), strict=True):
        assert torch.equal(mine.grad, theirs.grad)
        changed += not torch.equal(mine.grad, old.grad)
    assert (changed > 0) == (clip_factor < 1e6)


def test_grad_norm_of_no_gradients_is_zero() -> None:
    assert GF.clip_grad_norm_(nn.Linear(2, 2).parameters(), 1.0).item() == 0.0
