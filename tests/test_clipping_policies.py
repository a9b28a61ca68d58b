"""The pure clipping functions and policies against numpy, torch.nn.utils and the papers' formulas (no Trainer)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from clip_reference import AGCRef
from gradkit.clip import (
    AutoClipPolicy,
    ZClipPolicy,
    agc_coefficients,
    clip_coefficient,
    nan_percentile,
)
from gradkit.norms import row_norms


@pytest.mark.parametrize("n", [1, 2, 7, 50])
@pytest.mark.parametrize("q", [0.5, 10.0, 37.5, 90.0, 100.0])
def test_nan_percentile_equals_numpy_on_the_non_nan_entries(n: int, q: float) -> None:
    values = torch.rand(n) * 10
    padded = torch.cat([values, torch.full((5,), math.nan)])[torch.randperm(n + 5)]
    assert nan_percentile(padded, q).item() == pytest.approx(np.percentile(values.numpy(), q), rel=1e-6)


def test_nan_percentile_of_no_value_is_nan() -> None:
    assert math.isnan(nan_percentile(torch.full((4,), math.nan), 10.0).item())


def test_clip_coefficient_matches_clip_grad_norm() -> None:
    grads = [torch.randn(5, 3) * 4, torch.randn(7)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(params, 1.0)
    coef = clip_coefficient(total, 1.0)
    for p, g in zip(params, grads, strict=True):
        assert torch.equal(p.grad, g * coef)


@pytest.mark.parametrize("shape", [(6, 4), (3, 2, 5, 5), (8,), ()])
def test_agc_coefficients_reproduce_timm_bitwise(shape: tuple[int, ...]) -> None:
    weight = torch.nn.Parameter(torch.randn(shape))
    weight.grad = torch.randn(shape) * torch.rand(shape) * 0.3
    if len(shape) > 1:
        weight.data[0].zero_()  # a zero unit: the eps floor applies
    grad = weight.grad.clone()
    # The unit norms as the engine measures them: one per row for a weight, one for a bias, gain or scalar.
    units = row_norms if len(shape) > 1 else torch.linalg.vector_norm
    coef = agc_coefficients(units(grad), units(weight.detach()), 0.05, 1e-3)
    coef = coef.view(-1, *[1] * (len(shape) - 1)) if len(shape) > 1 else coef
    AGCRef(0.05)(torch.nn.ParameterList([weight]))
    assert torch.equal(grad * coef, weight.grad)
    assert (coef < 1).any() or shape == ()


def test_autoclip_history_is_a_ring_of_finite_norms() -> None:
    policy = AutoClipPolicy(percentile=50.0, history_size=3)
    kept: list[float] = []
    for v in [4.0, math.inf, 1.0, math.nan, 3.0, 2.0, 8.0]:
        coef, clipped, threshold = policy(torch.tensor(v))
        if math.isfinite(v):
            kept = [*kept, v][-3:]
            assert threshold.item() == pytest.approx(np.percentile(kept, 50.0))
            assert coef.item() == pytest.approx(min(1.0, threshold.item() / (v + 1e-6)))
            assert clipped.item() == (v > threshold.item())
    assert int(policy.count) == 5


def test_zclip_inf_and_nan_norms_leave_the_statistics_untouched() -> None:
    clean, noisy = ZClipPolicy(alpha=0.9, warmup_steps=3), ZClipPolicy(alpha=0.9, warmup_steps=3)
    norms = [1.0, 1.2, 0.9, 1.1, 5.0, 1.0]
    for i, v in enumerate(norms):
        clean(torch.tensor(v))
        noisy(torch.tensor(v))
        if i in (1, 4):
            coef, _, _ = noisy(torch.tensor(math.inf))
            assert not torch.isfinite(math.inf * coef)  # clipping does not make an Inf gradient finite
            noisy(torch.tensor(math.nan))
    for name in ("mean", "var", "count"):
        assert torch.equal(getattr(clean, name), getattr(noisy, name)), name


def test_zclip_warmup_statistics_are_the_population_mean_and_variance() -> None:
    policy = ZClipPolicy(warmup_steps=4)
    values = [1.0, 2.0, 4.0, 3.0]
    for v in values:
        coef, clipped, _ = policy(torch.tensor(v))
        assert coef.item() == 1.0 and not clipped.item()
    assert policy.mean.item() == pytest.approx(np.mean(values))
    assert policy.var.item() == pytest.approx(np.var(values))


def test_zclip_spike_is_clipped_to_the_reciprocal_threshold() -> None:
    policy = ZClipPolicy(alpha=0.97, z_threshold=2.5, warmup_steps=4)
    for v in [1.0, 2.0, 4.0, 3.0]:
        policy(torch.tensor(v))
    mean, std = 2.5, math.sqrt(1.25)
    g = 10.0
    z = (g - mean) / (std + 1e-6)
    coef, clipped, threshold = policy(torch.tensor(g))
    target = mean + 2.5**2 * std / z
    assert clipped.item() and policy.target.item() == pytest.approx(target, rel=1e-6)
    assert threshold.item() == pytest.approx(mean + 2.5 * std, rel=1e-6)  # the z-score threshold, not the target
    assert coef.item() == pytest.approx(target / (g + 1e-6), rel=1e-6)
    new_mean = 0.97 * mean + 0.03 * target
    assert policy.mean.item() == pytest.approx(new_mean, rel=1e-6)
    assert policy.var.item() == pytest.approx(0.97 * 1.25 + 0.03 * (target - new_mean) ** 2, rel=1e-6)
