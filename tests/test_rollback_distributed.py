"""SpikeRollback on 2 CPU processes (gloo), DDP and FSDP2, with the spike on rank 1 only: every rank rolls back at
the same step, its local state (FSDP2: its own shards) after the rollback equals the snapshot bitwise, and the run
ends like a single-process Adam loop that never saw the rewound and stepped-over global batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from helpers import MLPModule, regression_data, run_distributed
from test_rollback import assert_bitwise

pytestmark = pytest.mark.distributed

N_BATCHES, BAD, FACTOR = 16, (9, 10), 50.0


def spiky_global_data() -> TensorDataset:
    """Global batch k holds samples 8k..8k+7; in the bad batches, rank 1's samples (the odd ones) get targets x50."""
    x, y = regression_data(N_BATCHES * 8).tensors
    y = y.clone()
    for k in BAD:
        y[8 * k + 1 : 8 * k + 8 : 2] *= FACTOR
    return TensorDataset(x, y)


def reference_params(kept: list[int]) -> dict[str, torch.Tensor]:
    """Single process: Adam + per-step StepLR over the global batches ``kept`` (DDP's 2 x 4 interleaved samples are
    8 contiguous ones); the bad batches are left out, so their corruption does not matter here."""
    torch.manual_seed(0)
    model = MLPModule(lr=0.01)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    x, y = spiky_global_data().tensors
    for k in kept:
        opt.zero_grad()
        nn.functional.mse_loss(model(x[8 * k : 8 * k + 8]), y[8 * k : 8 * k + 8]).backward()
        opt.step()
        sched.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def test_rollback_is_identical_on_every_rank_and_exact_under_ddp_and_fsdp2(tmp_path: Path) -> None:
    ranks = run_distributed("rollback_script.py", tmp_path, timeout=300)
    # Rewound: global batches 8-10 (the snapshot of step 8 is from before batch 8); stepped over: 11 and 12.
    expected = reference_params([*range(8), *range(13, N_BATCHES)])
    for case in ("ddp", "fsdp2"):
        first, second = ranks[0][case], ranks[1][case]
        (event,) = first["events"]
        assert (event["step"], event["from_step"], event["to_step"], event["skip_batches"]) == (10, 11, 8, 2), case
        for r in (first, second):
            assert r["restored_equals_snapshot"] and r["spike_changed_state"], case  # bitwise, each rank's shards
            assert r["adam_steps"] and set(r["adam_steps"]) == {N_BATCHES - 5.0}, case
            assert r["global_step"] == N_BATCHES and r["snapshot_bytes"] > 0, case
        assert_bitwise(first["params"], second["params"], case)  # every rank ends with the same model
        for name, values in first["params"].items():
            torch.testing.assert_close(torch.tensor(values), expected[name], rtol=1e-5, atol=1e-6, msg=case)
    # FSDP2: each rank holds its shards only, so its snapshot is about half of the DDP one; a checkpoint (rank 0's
    # callback state) could not hold them, so `save_snapshots=True` is refused at setup on every rank.
    assert ranks[0]["fsdp2"]["snapshot_bytes"] < ranks[0]["ddp"]["snapshot_bytes"]
    for r in ranks:
        assert "save_snapshots=False" in r["fsdp2_save_snapshots"], r["fsdp2_save_snapshots"]


def test_escalation_is_identical_on_every_rank_under_ddp_and_follows_the_single_process_run(tmp_path: Path) -> None:
    """The LR fault of ``test_rollback_escalation`` under DDP (each rank half of every global batch): both ranks
    roll back and escalate at the same steps, cut and reset alike, and end with the same parameters, those of the
    single-process escalated run (up to the rounding of DDP's gradient average)."""
    from test_rollback_escalation import escalating, fit

    (tmp_path / "ddp").mkdir()
    ranks = run_distributed("escalation_script.py", tmp_path / "ddp", timeout=300)
    single, _ = fit(tmp_path / "single", escalating(escalate_reset_moments="spiking"))
    first, second, escalation = ranks[0]["events"]
    assert [e["what"] for e in (first, second, escalation)] == ["rollback", "rollback", "escalation"]
    assert (first["step"], second["step"], second["to_step"], escalation["step"]) == (27, 31, 24, 31)
    assert escalation["lr_factor"] == 0.02 and escalation["reset_modules"] == ["net.blocks", "net.head"]
    assert ranks[0]["ramp"] == ranks[1]["ramp"] == [0.02, 64 - 32, 1]
    assert_bitwise(ranks[0]["params"], ranks[1]["params"])
    for name, p in single.named_parameters():
        torch.testing.assert_close(torch.tensor(ranks[0]["params"][name]), p.detach(), rtol=1e-4, atol=1e-5, msg=name)
