"""The clipping math and the torch clippers behind ``GradKit`` (no Trainer), against numpy, ``torch.nn.utils``, timm's
AGC and the papers' formulas."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from clip_reference import AGCRef, NormRef, ValueRef, ZClipRef
from gradkit.doors.loop import GradKit
from gradkit.policies.agc import AdaptiveGradClip, agc_coefficients
from gradkit.policies.clipping import ClipGradNorm, ClipGradValue, clip_coefficient, clip_to_threshold
from gradkit.policies.history_clipping import AutoClip, ZClip, nan_percentile
from gradkit.step.norms import row_norms
from helpers import run_without_lightning


# -- the math ------------------------------------------------------------------------------------------------------
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


def test_clip_to_threshold_leaves_a_norm_at_or_below_the_threshold_exactly_alone() -> None:
    norms = torch.tensor([0.5, 2.0, 3.0, math.inf, math.nan])
    coef = clip_to_threshold(norms, 2.0)
    assert coef[:2].tolist() == [1.0, 1.0]
    assert coef[2].item() == pytest.approx(2.0 / (3.0 + 1e-6), rel=1e-7)
    assert coef[3].item() == 0.0 and coef[4].item() == 1.0  # an Inf norm is zeroed, a NaN one left alone


@pytest.mark.parametrize("shape", [(6, 4), (3, 2, 5, 5), (8,), ()])
def test_agc_coefficients_reproduce_timm_bitwise(shape: tuple[int, ...]) -> None:
    weight = torch.nn.Parameter(torch.randn(shape))
    weight.grad = torch.randn(shape) * torch.rand(shape) * 0.3
    if len(shape) > 1:
        weight.data[0].zero_()  # a zero unit: the eps floor applies
    grad = weight.grad.clone()
    # The unit norms as the pipeline measures them: one per row for a weight, one for a bias, gain or scalar.
    units = row_norms if len(shape) > 1 else torch.linalg.vector_norm
    coef = agc_coefficients(units(grad), units(weight.detach()), 0.05, 1e-3)
    coef = coef.view(-1, *[1] * (len(shape) - 1)) if len(shape) > 1 else coef
    AGCRef(0.05)(torch.nn.ParameterList([weight]))
    assert torch.equal(grad * coef, weight.grad)
    assert (coef < 1).any() or shape == ()


# -- the clippers behind GradKit, one norm at a time ---------------------------------------------------------------
class _Vector(nn.Module):
    """One parameter of two elements: a gradient ``[v, 0]`` has the total norm ``|v|`` in every p-norm."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))


def drive(clipper: Any, norms: list[float]) -> list[dict[str, Any]]:
    """Step ``clipper`` behind :class:`GradKit` (SGD with ``lr=0``: the weights stay) on gradients of the given total
    norms; per step, the gradient's first element after the clip (``v * coef``) and what the clipper logged."""
    model = _Vector()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    logged: list[dict[str, float]] = []
    kit = GradKit(model, optimizer, clipper, log=lambda metrics, step: logged.append(metrics), log_every_n_steps=1)
    out = []
    for v in norms:
        model.w.grad = torch.tensor([v, 0.0])
        kit.step(optimizer)
        out.append({"grad": model.w.grad[0].item(), **logged[-1]})
    return out


def test_autoclip_clips_to_the_percentile_of_a_ring_of_finite_norms() -> None:
    """Seetharaman et al. 2020: the norm joins the history, then the percentile of the history is the threshold."""
    clipper = AutoClip(percentile=50.0, history_size=3)
    norms = [4.0, math.inf, 1.0, math.nan, 3.0, 2.0, 8.0]
    kept: list[float] = []
    for v, row in zip(norms, drive(clipper, norms), strict=True):
        if not math.isfinite(v):
            assert not math.isfinite(row["grad"])  # clipping does not make an Inf or NaN gradient finite
            continue
        kept = [*kept, v][-3:]
        threshold = float(np.percentile(kept, 50.0))
        assert row["grad_clip/threshold"] == pytest.approx(threshold)
        assert row["grad"] == pytest.approx(v * min(1.0, threshold / (v + 1e-6)))
        assert row["grad_clip/clipped_fraction"] == float(v > threshold)
    state = clipper.state_dict()["policies"][0]
    assert int(state["count"]) == 5 and sorted(state["history"].tolist()) == sorted(kept)


def test_zclip_inf_and_nan_norms_leave_the_statistics_untouched() -> None:
    norms = [1.0, 1.2, 0.9, 1.1, 5.0, 1.0]
    noisy_norms = [*norms[:2], math.inf, math.nan, *norms[2:5], math.inf, math.nan, norms[5]]
    clean, noisy = ZClip(alpha=0.9, warmup_steps=3), ZClip(alpha=0.9, warmup_steps=3)
    drive(clean, norms)
    rows = drive(noisy, noisy_norms)
    assert not any(math.isfinite(row["grad"]) for v, row in zip(noisy_norms, rows, strict=True) if not math.isfinite(v))
    ours, theirs = clean.state_dict()["policies"][0], noisy.state_dict()["policies"][0]
    for name in ("mean", "var", "count"):
        assert torch.equal(ours[name], theirs[name]), name


def test_zclip_warmup_statistics_are_the_population_mean_and_variance() -> None:
    clipper = ZClip(warmup_steps=4)
    values = [1.0, 2.0, 4.0, 3.0]
    for v, row in zip(values, drive(clipper, values), strict=True):
        assert row["grad"] == v and row["grad_clip/clipped_fraction"] == 0.0
        assert row["grad_clip/threshold"] == math.inf
    state = clipper.state_dict()["policies"][0]
    assert state["mean"].item() == pytest.approx(np.mean(values))
    assert state["var"].item() == pytest.approx(np.var(values))


def test_zclip_spike_is_clipped_to_the_reciprocal_threshold() -> None:
    """Kumar et al. 2025, zscore mode with adaptive scaling: ``g* = mu + z_t**2 * sigma / z``, and the EMA takes
    ``g*``."""
    clipper = ZClip(alpha=0.97, z_threshold=2.5, warmup_steps=4)
    g = 10.0
    row = drive(clipper, [1.0, 2.0, 4.0, 3.0, g])[-1]
    mean, std = 2.5, math.sqrt(1.25)
    z = (g - mean) / (std + 1e-6)
    target = mean + 2.5**2 * std / z
    assert row["grad_clip/clipped_fraction"] == 1.0
    assert row["grad_clip/threshold"] == pytest.approx(mean + 2.5 * std, rel=1e-6)  # the z-score one, not the target
    assert row["grad"] == pytest.approx(g * target / (g + 1e-6), rel=1e-6)
    assert row["grad_clip/post_clip_norm"] == pytest.approx(target, rel=1e-6)
    state = clipper.state_dict()["policies"][0]
    new_mean = 0.97 * mean + 0.03 * target
    assert state["mean"].item() == pytest.approx(new_mean, rel=1e-6)
    assert state["var"].item() == pytest.approx(0.97 * 1.25 + 0.03 * (target - new_mean) ** 2, rel=1e-6)


def test_zclip_state_round_trips_exactly() -> None:
    """A clone loaded from the state decides every later step as the original does, spike included."""
    original = ZClip(warmup_steps=2)
    drive(original, [1.0, 2.0, 1.5, 9.0])
    clone = ZClip(warmup_steps=2)
    clone.load_state_dict(original.state_dict())
    later = [3.0, 40.0, 2.0]
    assert drive(original, later) == drive(clone, later)
    ours, theirs = original.state_dict()["policies"][0], clone.state_dict()["policies"][0]
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_autoclip_refuses_a_history_of_another_size() -> None:
    clipper = AutoClip(history_size=3)
    drive(clipper, [1.0])
    with pytest.raises(ValueError, match=r"holds 3 norms but `history_size=5`"):
        AutoClip(history_size=5).load_state_dict(clipper.state_dict())


# -- whole models behind GradKit, against the references of tests/clip_reference.py ----------------------------------
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 1))


def _batches(steps: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    # Every fourth batch is larger: its norm spikes (ZClip clips it), the others stay below most thresholds.
    scales = [1 + 3 * (k % 4 == 3) for k in range(steps)]
    return [(torch.randn(8, 6, generator=g) * s, torch.randn(8, 1, generator=g)) for s in scales]


def _train(clip: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    """SGD on :func:`_batches`; ``clip`` is a gradkit clipper (stepped through ``GradKit``), a reference
    ``clip(model)`` called before a plain step, or ``None``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kit = GradKit(model, optimizer, clip, log_every_n_steps=0) if clip is not None and not callable(clip) else None
    for x, y in _batches():
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if kit is not None:
            kit.step(optimizer)
            continue
        if clip is not None:
            clip(model)
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


CASES = {
    "norm-2": (lambda: ClipGradNorm(0.5), lambda: NormRef(0.5)),
    "norm-inf": (lambda: ClipGradNorm(0.1, norm_type=math.inf), lambda: NormRef(0.1, math.inf)),
    "value": (lambda: ClipGradValue(0.02), lambda: ValueRef(0.02)),
    "agc": (lambda: AdaptiveGradClip(clip_factor=0.02, exclude=["re:^4"]), lambda: AGCRef(0.02, exclude=r"^4\.")),
    "zclip": (lambda: ZClip(alpha=0.9, z_threshold=0.5, warmup_steps=3), lambda: ZClipRef(0.9, 0.5, 3)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_torch_clippers_behind_gradkit_train_like_the_reference_loop(case: str) -> None:
    make_clipper, make_ref = CASES[case]
    got, expected, unclipped = _train(make_clipper(), _mlp()), _train(make_ref(), _mlp()), _train(None, _mlp())
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)
    assert any(not torch.allclose(expected[n], unclipped[n], rtol=0, atol=1e-5) for n in expected)


def test_one_zclip_for_two_optimizers_keeps_one_state_per_optimizer() -> None:
    """Each optimizer is clipped by its own statistics, as two independent references would."""
    model, twin = _mlp(), _mlp()
    parts, twin_parts = (model[0], model[2:]), (twin[0], twin[2:])
    optimizers = [torch.optim.SGD(p.parameters(), lr=0.1) for p in parts]
    references = [torch.optim.SGD(p.parameters(), lr=0.1) for p in twin_parts]
    clipper, refs = ZClip(alpha=0.9, z_threshold=0.5, warmup_steps=3), [ZClipRef(0.9, 0.5, 3) for _ in parts]
    kit = GradKit(model, optimizers, clipper, log_every_n_steps=0)
    for x, y in _batches():
        for net, opts in ((model, optimizers), (twin, references)):
            for opt in opts:
                opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
        for opt, ref_opt, ref, part in zip(optimizers, references, refs, twin_parts, strict=True):
            kit.step(opt)
            ref(part)
            ref_opt.step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    assert set(clipper.state_dict()["policies"]) == {0, 1}


_NO_LIGHTNING = """
import math
import torch
from torch import nn
from clip_reference import AGCRef, AutoClipRef, NormRef, ValueRef, ZClipRef
from gradkit.policies.agc import AdaptiveGradClip
from gradkit.policies.clipping import ClipGradNorm, ClipGradValue
from gradkit.policies.history_clipping import AutoClip, ZClip
from gradkit.doors.loop import GradKit

def train(clip):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kit = None if callable(clip) else GradKit(model, optimizer, clip, log_every_n_steps=0)
    g = torch.Generator().manual_seed(1)
    for k in range(10):
        x, y = torch.randn(8, 6, generator=g) * (1 + 3 * (k % 3 == 2)), torch.randn(8, 1, generator=g)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if kit is None:
            clip(model)
            optimizer.step()
        else:
            kit.step(optimizer)
    return [p.detach() for p in model.parameters()]

pairs = [
    (ClipGradNorm(0.5), NormRef(0.5)),
    (ClipGradValue(0.02), ValueRef(0.02)),
    (AdaptiveGradClip(clip_factor=0.02), AGCRef(0.02)),
    (AutoClip(percentile=30.0, history_size=5), AutoClipRef(30.0, 5)),
    (ZClip(alpha=0.9, z_threshold=0.5, warmup_steps=3), ZClipRef(0.9, 0.5, 3)),
]
for clipper, reference in pairs:
    worst = max((a - b).abs().max().item() for a, b in zip(train(clipper), train(reference)))
    print(type(clipper).__name__, worst <= 1e-6)
"""


def test_torch_clippers_run_behind_gradkit_without_lightning_loaded() -> None:
    """A fresh interpreter: each clipper trains like its reference, and nothing of Lightning was imported."""
    lines = run_without_lightning(_NO_LIGHTNING).split("\n")
    names = ["ClipGradNorm", "ClipGradValue", "AdaptiveGradClip", "AutoClip", "ZClip"]
    assert lines[:5] == [f"{name} True" for name in names]
