"""The Hugging Face door under DDP on 2 CPU processes (gloo): a non-finite loss on one rank is a skipped step on both.

Skipped without ``transformers``. The job: ``tests/distributed/hf_door_script.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from helpers import run_processes

pytestmark = pytest.mark.distributed


def test_a_nan_loss_on_one_rank_is_skipped_on_both(tmp_path: Path) -> None:
    ranks = run_processes("hf_door_script.py", tmp_path, timeout=300)
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
