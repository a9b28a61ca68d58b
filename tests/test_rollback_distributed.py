"""SpikeRollback on 2 CPU processes (gloo), DDP and FSDP2, with the spike on rank 1 only: every rank rolls back at
the same step, its local state (FSDP2: its own shards) after the rollback equals the snapshot bitwise, and the run
ends like a single-process Adam loop that never saw the rewound and stepped-over global batches. Under FSDP2 with
``save_snapshots=True`` a distributed checkpoint keeps each rank's snapshots, so a run resumed from it (behind the
Trainer and behind the loop door) ends as the uninterrupted one, bitwise."""

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
#: The SpikeRollback of the job (``distributed/rollback_script.py``), and the step of its distributed checkpoints:
#: after the snapshot of step 8, before the spike (a resumed run must restore step 8's state from the checkpoint).
ROLLBACK: dict[str, Any] = dict(
    z_threshold=4.0, alpha=0.9, warmup_steps=4, patience=2, snapshot_every_n_steps=4, skip_batches=2
)
SAVE_AT = 9


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


@pytest.fixture(scope="module")
def rollback_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """One launch of ``rollback_script.py``: its output folder (the checkpoints) and each rank's results."""
    out = tmp_path_factory.mktemp("rollback")
    return out, run_distributed("rollback_script.py", out, timeout=300)


def kept_batches() -> list[int]:
    """Rewound: global batches 8-10 (the snapshot of step 8 is from before batch 8); stepped over: 11 and 12."""
    return [*range(8), *range(13, N_BATCHES)]


def test_rollback_is_identical_on_every_rank_and_exact_under_ddp_and_fsdp2(
    rollback_job: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, ranks = rollback_job
    expected = reference_params(kept_batches())
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
    # FSDP2: each rank holds its shards only, so its snapshot is about half of the DDP one; a checkpoint that is one
    # file from rank 0 (`save_distributed_checkpoint=False`) could not hold them: refused at setup on every rank.
    assert ranks[0]["fsdp2"]["snapshot_bytes"] < ranks[0]["ddp"]["snapshot_bytes"]
    for r in ranks:
        assert (
            "`save_distributed_checkpoint=False` Lightning writes the checkpoint from rank 0"
            in (r["fsdp2_save_snapshots"])
        ), r["fsdp2_save_snapshots"]


def test_a_trainer_resumed_from_a_distributed_checkpoint_rolls_back_as_the_uninterrupted_fsdp2_run(
    rollback_job: tuple[Path, list[dict[str, Any]]],
) -> None:
    """``GradKitModelParallelStrategy`` (``save_distributed_checkpoint=True``): the checkpoint of step 9 keeps each
    rank's snapshots (its own shards) in its ``gradkit_rank_local`` folder, written by that rank, not in rank 0's
    ``meta.pt``; the run resumed from it restores the snapshot of step 8 (a resume without the ring would restore the
    state of step 9) and ends with every rank's shards, Adam state and LR schedule equal to the uninterrupted run's."""
    _, ranks = rollback_job
    for rank, r in enumerate(ranks):
        resumed = r["fsdp2_resumed"]
        assert resumed["history"] == r["fsdp2"]["history"] and resumed["history"][0]["to_step"] == 8
        assert resumed["same_end_state"], rank  # bitwise
        assert not resumed["meta_has_snapshots"] and resumed["written_by"] == f"__{rank}_0.distcp"


def test_a_plain_loop_resumed_through_distributed_state_rolls_back_as_the_uninterrupted_fsdp2_loop(
    rollback_job: tuple[Path, list[dict[str, Any]]],
) -> None:
    """``GradKit.distributed_state()`` in ``torch.distributed.checkpoint.save/load`` beside the model's and the
    optimizer's state: each rank's snapshots saved by that rank; the resumed loop (from step 9) rolls back to step 8
    and ends with every rank's local state equal to the uninterrupted loop's bitwise, whose parameters are those of
    the single-process Adam loop without the rewound and stepped-over batches."""
    _, ranks = rollback_job
    expected = reference_params(kept_batches())
    for rank, r in enumerate(ranks):
        straight, resumed = r["loop"], r["loop_resumed"]
        assert resumed["first_step"] == SAVE_AT and resumed["same_end_state"], rank
        assert resumed["history"] == straight["history"] and straight["history"][0]["to_step"] == 8
        assert straight["written_by"] == resumed["written_by"] == f"__{rank}_0.distcp"
        assert_bitwise(resumed["params"], straight["params"], "loop")
    for name, values in ranks[0]["loop"]["params"].items():
        torch.testing.assert_close(torch.tensor(values), expected[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning")
def test_a_resume_on_another_number_of_ranks_is_refused_with_rank_local_state_and_works_without(
    rollback_job: tuple[Path, list[dict[str, Any]]],
) -> None:
    """The loop's 2-rank checkpoint loaded by one process: with ``save_snapshots=True`` the kit refuses (each rank's
    snapshots hold its own shards), naming both world sizes; without, the states the ranks share load (the
    statistics, as rank 0 saved them)."""
    import torch.distributed.checkpoint as dcp

    from gradkit import GradKit
    from gradkit.policies.rollback import SpikeRollback

    out, ranks = rollback_job

    def kit(save_snapshots: bool) -> tuple[GradKit, SpikeRollback]:
        model = MLPModule(lr=0.01)
        rollback = SpikeRollback("loss", **ROLLBACK, save_snapshots=save_snapshots)
        return GradKit(model, torch.optim.Adam(model.parameters()), [rollback], log_dir=False), rollback

    refused, _ = kit(True)
    with pytest.raises(ValueError, match=r"saved by 2 rank\(s\), and this run has 1") as info:
        dcp.load({"gradkit": refused.distributed_state()}, checkpoint_id=out / "loop_ckpt")
    assert "Resume with 2 ranks, or with `save_snapshots=False`" in str(info.value)
    resumed, rollback = kit(False)
    dcp.load({"gradkit": resumed.distributed_state()}, checkpoint_id=out / "loop_ckpt")
    assert resumed.state_dict()["step"] == SAVE_AT
    saved = ranks[0]["loop"]["saved_stats"]
    assert {k: v.tolist() for k, v in rollback.state_dict()["stats"].items()} == saved and saved["count"] > 0


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
