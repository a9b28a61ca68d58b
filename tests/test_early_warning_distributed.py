"""Under ``torch.distributed`` (2 CPU processes, gloo): EarlyWarning decides on reduced values, so every rank logs
and warns the same; StepsToSkip drops the same steps on every rank of a ``gradkit_ddp`` Trainer, without a hang."""

from __future__ import annotations

from typing import Any

import pytest

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
