"""Under ``torch.distributed`` (2 CPU processes, gloo): EarlyWarning decides on reduced values, so every rank logs
and warns the same; StepsToSkip drops the same steps on every rank of a ``gradkit_ddp`` Trainer, without a hang; QKClip
rescales by the maxima of every rank's batches (one all-reduce), as one process on the global batch does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from helpers import run_processes

pytestmark = pytest.mark.distributed

LOGGING_STEPS = (1, 3, 5)  # log_every_n_steps=2 over 6 steps


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_processes("early_warning_script.py", tmp_path_factory.mktemp("early_warning"), timeout=240)


def test_every_rank_logs_and_warns_the_same_reduced_values(ranks: list[dict[str, Any]]) -> None:
    first, second = (r["early_warning"] for r in ranks)
    assert first["logged"] == second["logged"] and len(first["logged"]) == len(LOGGING_STEPS)
    assert first["warnings"] == second["warnings"] and first["warnings"]
    for name in ("blocks.0.attn", "blocks.1.attn"):
        mine, theirs = first["local"][name], second["local"][name]
        assert mine != theirs  # each rank's own batches: the reduction is what makes the logged values equal
        expected = [max(mine[step], theirs[step]) for step in LOGGING_STEPS]
        logged = [row[f"signals/attn_logit_max/{name}"] for row in first["logged"]]
        assert logged == pytest.approx(expected, rel=1e-5)


def test_steps_to_skip_drops_the_same_steps_on_every_rank_of_a_ddp_trainer(ranks: list[dict[str, Any]]) -> None:
    first, second = (r["steps_to_skip"] for r in ranks)
    assert first["global_step"] == second["global_step"] == 6
    assert first["trained"] == second["trained"] == [0, 3, 4, 5]
    assert first["params"] == second["params"]


def test_qk_clip_rescales_every_rank_by_the_maxima_of_the_global_batch(ranks: list[dict[str, Any]]) -> None:
    # Reference: one process, the same model and steps on the concatenation of the ranks' batches (DDP's mean of the
    # ranks' mean losses is the global mean; the largest logit of the global batch is the largest of the ranks').
    from gradkit import GradKit, QKClip
    from lightning_gradkit.demos import GPTConfig, TinyGPT

    first, second = (r["qk_clip"] for r in ranks)
    assert first == second
    assert all(row["qk_clip/clipped_heads"] > 0 for row in first["logged"])
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=32))  # the script's
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with GradKit(model, optimizer, QKClip(threshold=0.2), log_dir=False) as kit:
        for step in range(3):  # the script's `qk_clip_batches(step)`, every rank's
            x = torch.randint(256, (2, 4, 16), generator=torch.Generator().manual_seed(200 + step)).flatten(0, 1)
            F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
            kit.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
    for name, param in model.named_parameters():
        torch.testing.assert_close(torch.tensor(first["params"][name]), param.detach().flatten(), msg=name)
