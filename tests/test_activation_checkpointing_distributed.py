"""ActivationCheckpointing on 2 CPU processes (gloo): DDP and FSDP2 gradients equal those without checkpointing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import run_distributed

pytestmark = pytest.mark.distributed

BLOCKS = ["model.blocks.0", "model.blocks.1", "model.blocks.2"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_checkpointed_gradients_equal_unchecked_gradients_on_every_rank(tmp_path: Path, strategy: str) -> None:
    ranks = run_distributed("ckpt_script.py", tmp_path, "--strategy", strategy, timeout=600)
    assert ranks[0] == ranks[1]  # same selection, and rank 0's budget plan on both ranks
    report = ranks[0]
    for rank in range(2):
        reference = torch.load(tmp_path / f"grads_none_rank{rank}.pt")
        assert len(reference) == 2
        for name, info in report.items():
            assert info["steps"] == 2
            got = torch.load(tmp_path / f"grads_{name}_rank{rank}.pt")
            for step, (g, e) in enumerate(zip(got, reference, strict=True)):
                assert g.keys() == e.keys()
                for key in e:
                    torch.testing.assert_close(g[key], e[key], rtol=0, atol=1e-6, msg=f"{name} step {step} {key}")
    # the configurations really checkpointed what they claim
    assert report["none"]["injected_in_first_step"] == []
    for name, info in report.items():
        if name == "none":
            continue
        assert info["after"] < info["before"]
        if name == "budget":
            assert info["after"] <= 0.5 * info["before"]
            assert 0 < len(info["checkpointed"]) < 3
        else:
            assert info["checkpointed"] == BLOCKS
        assert info["injected_in_first_step"] == info["checkpointed"]
