"""AccumulationGuard, ManualAccumulator and InferenceModeValidation on 2 CPU processes (gloo), against
single-process plain-PyTorch references. One launch runs every check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import run_distributed
from test_accumulation import reference_mlp, reference_token_lm

pytestmark = pytest.mark.distributed


def assert_state_close(got: dict[str, list], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for key, ref in expected.items():
        assert torch.allclose(torch.tensor(got[key]), ref, rtol=0, atol=1e-6), key


def test_ddp_accumulation_and_validation(tmp_path: Path) -> None:
    ranks = run_distributed("accum_script.py", tmp_path)

    # Token mode: the stepped gradient is grad(total window loss over both ranks) / (total tokens over both ranks),
    # i.e. one big batch of 2 ranks x 2 micro-batches x 4 sequences per window (the last window: 2 x 1 x 4).
    tokens_ref = reference_token_lm(n=40, global_batch=8, window=2)
    for rank in ranks:
        assert rank["tokens_steps"] == 3
        assert_state_close(rank["tokens"], tokens_ref)
        # The window's token count rides in the engine's single all-reduce: one collective per step, no host sync
        # but the first step's one read of its check that the plain parameters are copies (gradkit.step.replicas).
        assert rank["tokens_all_reduces"] == 3
        assert rank["tokens_syncs"] == 1
        # The manual helper reaches the same parameters.
        assert_state_close(rank["manual_tokens"], tokens_ref)
        # Mean mode: windows 4, 4, 2 of global batches of 8, each averaged over its actual micro-batches.
        assert_state_close(rank["mean"], reference_mlp(10, 4, divide_by_actual=True))

        # gloo: validation falls back to no_grad (and says why when told to raise).
        assert rank["val_modes"] == [[False, False]] * 2
        assert "gloo" in rank["raise_message"] and "fallback='no_grad'" in rank["raise_message"]
        assert "FSDP2" in rank["fsdp2_message"]
