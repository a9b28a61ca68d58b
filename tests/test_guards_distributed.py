"""The fault matrix on 2 CPU processes (gloo), fault on rank 1 only: every rank skips the same step, parameters and
Adam state are bitwise unchanged by it, ranks stay identical, training completes like a single-process loop that
never saw the bad global batch, and the event file (rank 0) names the module that rank 1 poisoned."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import MLPModule, loader, run_distributed

pytestmark = pytest.mark.distributed


def reference_params(skip: int) -> dict[str, torch.Tensor]:
    """Single-process Adam on the global batches (DDP's 2 x 4 interleaved samples are 8 contiguous ones)."""
    torch.manual_seed(0)
    model = MLPModule(lr=0.01)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for i, (x, y) in enumerate(loader(n=64, batch_size=8)):
        if i != skip:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return {n: p.detach().reshape(-1) for n, p in model.named_parameters()}


def test_fault_on_one_rank_is_skipped_identically_on_all_ranks(tmp_path: Path) -> None:
    ranks = run_distributed("guards_script.py", tmp_path, timeout=600)
    expected = reference_params(skip=2)
    for case, first in ranks[0].items():
        second = ranks[1][case]
        assert first["params"] == second["params"], case  # all ranks hold identical parameters
        assert first["unchanged"] and second["unchanged"], case  # bitwise: parameters and Adam state
        assert first["later_changed"] and first["global_step"] == 8, case
        if case == "spike":
            continue
        if case.startswith("fsdp2"):
            # Sharded: no replay; the event names the ranks with a bad loss, and the loss as where it was seen.
            (event,) = first["events"]
            assert event["step"] == 2 and event["rank"] == [1] and event["what"] == "nonfinite_loss_and_grads"
            assert event["culprit"] == "<loss>" and event["culprit_source"] == "loss"
            assert event["values"]["forensics"][0]["phase"] == "unavailable"
            for name, values in first["params"].items():
                torch.testing.assert_close(torch.tensor(values), expected[name], rtol=1e-5, atol=1e-6, msg=case)
            continue
        for name, values in first["params"].items():
            torch.testing.assert_close(torch.tensor(values), expected[name], rtol=1e-5, atol=1e-6, msg=case)
        (event,) = first["events"]
        assert event["step"] == 2, case
        kind = case.split("-")[0]
        if kind == "loss":
            assert event["rank"] == [1] and event["culprit"] == "<loss>", case
        elif kind == "grad":
            assert event["culprit"] == first["target"], case
            # 6e19 on rank 1 is finite, its square is not: a norm overflow, not a non-finite gradient.
            assert event["what"] == ("norm_overflow" if case == "grad-overflow" else "nonfinite_grads"), case
        else:
            assert event["culprit"] == first["target"], case
            by_rank = {f["rank"]: f for f in event["values"]["forensics"]}
            assert by_rank[1]["culprit"] == first["target"] and by_rank[1]["phase"] == "forward", case
            assert by_rank[0]["phase"] == "not_reproduced", case  # rank 0's batch was clean
    (event,) = ranks[0]["spike"]["events"]
    assert event["what"] == "loss_spike" and event["step"] == 5
