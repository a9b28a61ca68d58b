"""The Fabric and plain-PyTorch door (`GradKit`) on its own: how it takes its arguments, which schedulers it steps,
what it logs per step and what it says when a loop bypasses it.

Each test compares against an independent reference: a hand-written two-optimizer loop, `torch.nn.utils`'s norm,
or the same loop written the documented way.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

from lightning_gradkit import ClipGradNorm, GradNormMonitor
from lightning_gradkit.loop import GradKit

pytestmark = pytest.mark.filterwarnings("ignore:NonFiniteGuard:UserWarning")


def _batches(n: int = 6, nan_at: int | None = None) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        if i == nan_at:
            x[0, 0] = math.nan
        out.append((x, y))
    return out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


# -- policies: one, or a list ----------------------------------------------------------------------------------------
def _run_one_or_list(single: bool) -> tuple[dict[str, Tensor], list[dict[str, float]]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows: list[dict[str, float]] = []
    clip = ClipGradNorm(max_norm=0.5)
    kit = GradKit(model, opt, clip if single else [clip], log=lambda m, s: rows.append(m), log_every_n_steps=1)
    for x, y in _batches():
        nn.functional.mse_loss(model(x), y).backward()
        kit.step(opt)
        opt.zero_grad(set_to_none=True)
    return model.state_dict(), rows


def test_a_single_policy_works_as_a_list_of_one() -> None:
    single_state, single_rows = _run_one_or_list(single=True)
    list_state, list_rows = _run_one_or_list(single=False)
    assert single_rows == list_rows and len(single_rows) == 6
    for key, value in list_state.items():
        assert torch.equal(single_state[key], value), key
    # The policy acted: the reference, clip_grad_norm_ in a hand-written loop, gives the same parameters.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches():
        nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(single_state[key], value, rtol=1e-6, atol=1e-7)


def test_a_single_policy_class_is_refused_with_the_fix() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"holds the class `GradNormMonitor`.*use `GradNormMonitor\(\)`"):
        GradKit(model, opt, GradNormMonitor)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`policies` must be a gradkit policy or a list of them, got an int"):
        GradKit(model, opt, 3)  # type: ignore[arg-type]
