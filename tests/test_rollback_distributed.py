"""SpikeRollback on 2 CPU processes (gloo), DDP and FSDP2, with the spike on rank 1 only: every rank rolls back at
the same step, its local state (FSDP2: its own shards) after the rollback equals the snapshot bitwise, and the run
ends like a single-process Adam loop that never saw the rewound and stepped-over global batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


@pytest.fixture(scope="module")
def escalation_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One launch of ``escalation_script.py`` (DDP, then FSDP2) for the escalation tests below."""
    return run_distributed("escalation_script.py", tmp_path_factory.mktemp("escalation"), timeout=300)


@pytest.fixture(scope="module")
def single_escalated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The final parameters of the single-process escalated run of ``test_rollback_escalation``."""
    from test_rollback_escalation import escalating, fit

    model, _ = fit(tmp_path_factory.mktemp("single"), escalating(escalate_reset_moments="spiking"))
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", ["ddp", "fsdp2"])
def test_escalation_is_identical_on_every_rank_under_ddp_and_fsdp2_and_follows_the_single_process_run(
    escalation_ranks: list[dict[str, Any]], single_escalated: dict[str, torch.Tensor], case: str
) -> None:
    """The LR fault of ``test_rollback_escalation`` on 2 ranks (each half of every global batch): both ranks roll
    back and escalate at the same steps, cut and reset alike, and end with the same (FSDP2: gathered) parameters,
    those of the single-process escalated run (up to the rounding of the gradient average over the ranks)."""
    ranks = [r[case] for r in escalation_ranks]
    first, second, escalation = ranks[0]["events"]
    assert [e["what"] for e in (first, second, escalation)] == ["rollback", "rollback", "escalation"]
    assert (first["step"], second["step"], second["to_step"], escalation["step"]) == (27, 31, 28, 31)
    assert escalation["lr_factor"] == 0.02 and escalation["reset_modules"] == ["net.blocks", "net.head"]
    assert escalation["reset_params"] == len(single_escalated)
    assert ranks[0]["ramp"] == ranks[1]["ramp"] == [0.02, 64 - 32, 1]
    assert_bitwise(ranks[0]["params"], ranks[1]["params"], case)
    for name, p in single_escalated.items():
        torch.testing.assert_close(torch.tensor(ranks[0]["params"][name]), p, rtol=1e-4, atol=1e-5, msg=name)


def test_escalation_under_fsdp2_resets_every_ranks_shard_of_the_moments_to_a_fresh_adams(
    escalation_ranks: list[dict[str, Any]],
) -> None:
    """Each rank holds a shard of every parameter and of its Adam state (the shards add up to the whole); the snapshot
    of step 24 has moments; after the escalation at step 31 (its restore, then the reset of both modules) every rank
    holds a fresh Adam's state, none (Adam builds it at the next step); after that step, every rank's shard of the
    moments is rebuilt on its own shard of the parameter (a DTensor), with a step count of 1. Empty shards (the 1-row
    head on rank 1) stay empty."""
    ranks = [r["fsdp2"]["moments"] for r in escalation_ranks]
    assert ranks[0]["24"].keys() == ranks[0]["32"].keys() == ranks[1]["32"].keys() == ranks[1]["33"].keys()
    for name, whole in ranks[0]["33"].items():
        assert sum(r["33"][name]["local_numel"] for r in ranks) == whole["numel"], name
        assert whole["local_numel"] > 0 and whole["state"].keys() == {"step", "exp_avg", "exp_avg_sq"}, name
        for r in ranks:
            before, reset, after = r["24"][name], r["32"][name], r["33"][name]
            assert before["state"]["step"] == 24 and reset["state"] == {}, name
            assert after["state"]["step"] == 1, name
            for key in ("exp_avg", "exp_avg_sq"):
                assert after["state_numel"][key] == after["local_numel"] and after["dtensor"][key], (name, key)
                if after["local_numel"]:
                    assert before["state"][key] > 0, (name, key)
                else:
                    assert before["state"][key] is None and after["state"][key] is None, (name, key)
    # FSDP2 really sharded: the blocks' weights are split between the ranks, half each.
    assert ranks[1]["32"]["net.blocks.0.weight"]["local_numel"] == ranks[0]["32"]["net.blocks.0.weight"]["numel"] // 2
