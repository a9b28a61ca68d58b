"""A backbone frozen with ``requires_grad_(False)`` while in the optimizer and unfrozen with ``requires_grad_(True)``,
on 2 CPU processes (gloo), under FSDP2 and DDP: every gradient the optimizer applies on the first unfrozen step is
measured, clipped and guarded, against a single-process plain PyTorch loop that freezes and unfreezes the same way.

Under FSDP2 the flag lands on the unsharded parameters (the backbone is its own FSDP root and, frozen, is never
resharded by a backward), while the optimizer's sharded ones keep ``requires_grad=False`` and still receive the
gradient. Plain FSDP2 trains them on that one step only: the test pins that behaviour, which the
``GradKitModelParallelStrategy`` docstring documents.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from helpers import loader, run_distributed

pytestmark = pytest.mark.distributed

BATCHES = 4  # per epoch: step 4 is the first unfrozen step
LR = 0.1
MAX_NORM = 0.05
BACKBONE = ["backbone.0.weight", "backbone.0.bias", "backbone.2.weight", "backbone.2.bias"]


def _model() -> nn.Module:
    """The script's ``UnfreezingModel`` layers, built in the same order from the same seed."""
    torch.manual_seed(0)
    model = nn.Module()
    model.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
    model.head = nn.Linear(16, 1)
    return model


def reference() -> list[dict[str, dict[str, Tensor] | float]]:
    """Plain PyTorch on the global batches (2 ranks x 4 interleaved samples are 8 contiguous ones): per step the total
    norm, the clipped gradients and the parameters before and after the step."""
    model = _model()
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(params.values(), lr=LR)
    steps = []
    for epoch in range(2):
        model.backbone.requires_grad_(epoch >= 1)
        for x, y in loader(n=BATCHES * 8, batch_size=8):
            opt.zero_grad()
            nn.functional.mse_loss(model.head(model.backbone(x)), y).backward()
            with_grad = {n: p for n, p in params.items() if p.grad is not None}
            total = torch.nn.utils.clip_grad_norm_(with_grad.values(), MAX_NORM).item()
            before = {n: p.detach().clone() for n, p in params.items()}
            applied = {n: p.grad.clone() for n, p in with_grad.items()}
            opt.step()
            after = {n: p.detach().clone() for n, p in params.items()}
            steps.append({"total": total, "applied": applied, "before": before, "after": after})
    return steps


def test_first_unfrozen_step_is_measured_clipped_and_skipped_like_plain_pytorch(tmp_path: Path) -> None:
    ranks = run_distributed("late_parameters_script.py", tmp_path)
    ref = reference()
    step = ref[BATCHES]
    assert set(step["applied"]) == {*BACKBONE, "head.weight", "head.bias"}
    for strategy in ("fsdp2", "ddp"):
        clean = [r[f"{strategy}-clean"] for r in ranks]
        got = clean[0]
        # Logged on rank 0: the total before the clip covers the backbone from its first unfrozen step on.
        unfrozen_steps = BATCHES + 1 if strategy == "fsdp2" else 2 * BATCHES
        expected_totals = [s["total"] for s in ref[:unfrozen_steps]]
        assert got["total"][:unfrozen_steps] == pytest.approx(expected_totals, rel=1e-5), strategy
        assert got["post_clip"][BATCHES] == pytest.approx(MAX_NORM, rel=1e-5), strategy
        # The gradients the optimizer applies (clipped), and the update it makes, equal the reference's.
        assert clean[1]["applied"] == got["applied"] and clean[1]["after"] == got["after"], strategy
        for name, expected in step["applied"].items():
            torch.testing.assert_close(torch.tensor(got["applied"][name]), expected.reshape(-1), msg=name)
            update = torch.tensor(got["after"][name]) - torch.tensor(got["before"][name])
            expected_update = (step["after"][name] - step["before"][name]).reshape(-1)
            torch.testing.assert_close(update, expected_update, rtol=1e-5, atol=1e-8, msg=name)
            torch.testing.assert_close(torch.tensor(got["before"][name]), step["before"][name].reshape(-1), msg=name)

        # A NaN in rank 1's piece of a backbone gradient on that step: both ranks skip it, bitwise.
        poisoned = [r[f"{strategy}-nan"] for r in ranks]
        assert [r["poisoned"] for r in poisoned] == [False, True], strategy
        assert [r["skipped"] for r in poisoned] == [1.0, 1.0], strategy
        assert poisoned[0]["unchanged"] and poisoned[1]["unchanged"], strategy
        assert all(math.isfinite(t) for t in poisoned[0]["total"][BATCHES + 1 :]), strategy  # training goes on

    fsdp2, ddp = ranks[0]["fsdp2-clean"], ranks[0]["ddp-clean"]
    assert ddp["with_grad"][BATCHES:] == [[*BACKBONE, "head.weight", "head.bias"]] * BATCHES
    assert ddp["warnings"] == []
    # Plain FSDP2 copies the sharded parameters' `requires_grad=False` back onto the unsharded ones at the next
    # all-gather: the backbone gets a gradient on the first unfrozen step only. gradkit follows and says so.
    assert fsdp2["with_grad"][BATCHES] == [*BACKBONE, "head.weight", "head.bias"]
    assert fsdp2["with_grad"][BATCHES + 1 :] == [["head.weight", "head.bias"]] * (BATCHES - 1)
    (warning,) = fsdp2["warnings"]
    assert "4 parameter(s)" in warning and all(name in warning for name in BACKBONE)
    assert "module.reshard()" in warning
