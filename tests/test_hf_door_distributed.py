"""The Hugging Face door on 2 CPU processes (gloo), in one job: under DDP a non-finite loss on one rank is a skipped
step on both; under FSDP2 the door clips, skips and resumes as HF's own FSDP2 run without the bad step.

Skipped without ``transformers``. The job: ``tests/distributed/hf_door_script.py`` (DDP), then
``tests/distributed/hf_fsdp2.py`` (FSDP2) in the same processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from helpers import run_processes
from hf_fixtures import CULPRITS
from test_guards import events

pytestmark = pytest.mark.distributed

WORLD = 2


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("hf")
    return out, run_processes("hf_door_script.py", out, nprocs=WORLD, timeout=300)


def test_a_nan_loss_on_one_rank_is_skipped_on_both(job: tuple[Path, list[dict[str, Any]]]) -> None:
    ranks = [r["ddp"] for r in job[1]]
    assert all(r["distributed_type"] == "MULTI_CPU" and r["wrapped"] == "DistributedDataParallel" for r in ranks)
    # Only rank 1 met the poisoned sample, in step 1 (0-based, HF's global_step before it); its gradients stayed finite.
    assert ranks[0]["poison_seen_at_steps"] == [] and ranks[1]["poison_seen_at_steps"] == [1]
    for r in ranks:
        assert r["skipped_steps"] == 1
        assert r["scheduler_steps"] == 3  # HF held the scheduler of each rank on the skipped step
        skipped = [r["rows"][str(step)]["gradkit/skipped_steps"] for step in (1, 2, 3, 4)]
        assert skipped == ["0.0", "1.0", "1.0", "1.0"]
    # Both ranks skipped the same step: their models stayed the same, bit for bit.
    assert ranks[0]["digest"] == ranks[1]["digest"]
    assert ranks[0]["rows"] == ranks[1]["rows"]


def test_under_fsdp2_the_door_clips_and_skips_as_hf_without_the_bad_step(
    job: tuple[Path, list[dict[str, Any]]],
) -> None:
    # The reference: HF's own FSDP2 run (accelerate's clip_grad_norm_ of the DTensor gradients, max_grad_norm=0.5)
    # on the data without step 1's samples, one step fewer. The door's run is it with step 1 skipped: HF's rows of
    # steps 1, 3, 4 are the reference's rows of steps 1, 2, 3.
    out, ranks = job
    for r in (r["fsdp2"] for r in ranks):
        assert (r["distributed_type"], r["is_fsdp2"], r["parameter_type"]) == ("FSDP", True, "DTensor")
        door, reference = r["whole"], r["reference"]
        assert door["2"]["grad_norm"] is None and r["skipped_steps"][0] == 1  # NaN, skipped on both ranks
        for step, ref_step in (("1", "1"), ("3", "2"), ("4", "3")):
            # The pre-clip norm, the door's (one all-reduce of the shards' sums of squares) against torch's
            # DTensor norm: the same to float32 rounding of the two summation orders.
            assert door[step]["grad_norm"] == pytest.approx(reference[ref_step]["grad_norm"], rel=1e-6, abs=0)
            assert door[step]["grad_norm"] > 0.5  # every step clipped
            # HF held its scheduler on the skip: the same learning rate at the same update.
            assert door[step]["learning_rate"] == reference[ref_step]["learning_rate"]
            assert door[step]["loss"] == pytest.approx(reference[ref_step]["loss"], rel=1e-6, abs=0)
        # HF's grad_norm is the monitor's total, which the clip used: post-clip norm max_grad_norm.
        rows = r["whole_door_rows"]
        assert all(repr(door[s]["grad_norm"]) == rows[s]["grad_norm/total"] for s in ("1", "3", "4"))
        assert all(float(rows[s]["grad_norm/total_post_clip"]) == pytest.approx(0.5, rel=1e-6) for s in ("1", "3", "4"))
        assert r["scheduler_steps"] == [3, 3, 3]
        # The parameters: float32 rounding of the two clips (one ulp of the norm) apart, nothing more.
        assert r["params_max_difference"] < 1e-7
    # The guard's replay named the module where the NaN began, through the FSDP2 forward (a DTensor parameter has no
    # storage of its own: the replay used to fail on it).
    (event,) = events(out / "fsdp2" / "whole")
    assert (event["step"], event["action"], event["culprit"]) == (1, "skip", CULPRITS["gpt2"])
    assert ranks[0]["fsdp2"]["whole_door_rows"] == ranks[1]["fsdp2"]["whole_door_rows"]


def test_under_fsdp2_a_resumed_run_equals_the_uninterrupted_one(job: tuple[Path, list[dict[str, Any]]]) -> None:
    # HF's sharded FSDP checkpoint of step 2 (after the skip): the door's state file beside it, written by rank 0.
    # Resumed, the run is the uninterrupted one bit for bit: parameters, the policies' state and every logged row.
    for r in (r["fsdp2"] for r in job[1]):
        assert r["state_file"]
        assert r["digests"][0] == r["digests"][1]
        assert r["same_kit_state"] and r["skipped_steps"] == [1, 1]
        assert r["resumed_door_rows"] == r["whole_door_rows"]


def test_fsdp1_deepspeed_and_rank_local_snapshots_under_fsdp2_are_refused_with_the_fix(
    job: tuple[Path, list[dict[str, Any]]],
) -> None:
    for r in (r["fsdp2"] for r in job[1]):
        assert "FSDP1" in r["fsdp1"] and "fsdp_config={'version': 2}" in r["fsdp1"]
        assert "DEEPSPEED: DeepSpeed clips and skips inside its engine" in r["deepspeed"]
        assert "SpikeRollback(save_snapshots=True)" in r["rollback"] and "save_snapshots=False" in r["rollback"]
