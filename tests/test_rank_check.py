"""The same-parameter-layout check: unit tests of the description, and 2-process runs where rank 1 differs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradkit.step import rank_check as _layout
from gradkit.step.rank_check import first_mismatch, parameter_layout, verify_same_layout
from helpers import MLPModule, loader, make_trainer, run_distributed
from lightning_gradkit import GradNormMonitor, trainer_door


def test_layout_lists_trainable_parameters_in_optimizer_order() -> None:
    model = MLPModule(param_groups=True)
    model.encoder[0].bias.requires_grad_(False)
    optimizer = model.configure_optimizers()
    names = {id(p): n for n, p in model.named_parameters()}
    expected = [
        f"group {g}: {names[id(p)]} shape={tuple(p.shape)}"
        for g, group in enumerate(optimizer.param_groups)
        for p in group["params"]
        if p.requires_grad
    ]
    layout = parameter_layout([optimizer], names)
    assert len(layout) == len(expected)
    for line, start in zip(layout, expected, strict=True):
        assert line.startswith(f"optimizer 0, {start} dtype=torch.float32 device=cpu")


def test_first_mismatch_names_position_and_every_differing_rank() -> None:
    same = ["a", "b", "c"]
    assert first_mismatch([same, same, same]) is None
    message = first_mismatch([same, ["a", "x", "c"], same, ["a", "b"]])
    assert message == "position 1: rank 0 has `b`; rank 1 has `x`"
    assert first_mismatch([same, ["a", "b"]]) == "position 2: rank 0 has `c`; rank 1 has `<no parameter>`"


def test_single_process_fit_skips_the_check_and_trains_as_plain_lightning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks, described = [], []
    monkeypatch.setattr(trainer_door, "verify_same_layout", lambda *a: checks.append(a) or verify_same_layout(*a))
    monkeypatch.setattr(_layout, "parameter_layout", lambda *a: described.append(a) or parameter_layout(*a))
    torch.manual_seed(0)
    model = MLPModule()
    trainer = make_trainer(tmp_path / "gradkit", max_steps=2, callbacks=[GradNormMonitor()])
    trainer.fit(model, loader())
    torch.manual_seed(0)
    plain = MLPModule()
    make_trainer(tmp_path / "plain", max_steps=2).fit(plain, loader())

    assert len(checks) == 1 and described == []  # the check ran once, and returned before describing or gathering
    assert trainer.global_step == 2
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True))


@pytest.mark.distributed
def test_rank_with_a_different_layout_fails_naming_the_first_mismatch(tmp_path: Path) -> None:
    ranks = run_distributed("layout_script.py", tmp_path, timeout=180)
    names = [n for n, _ in MLPModule().named_parameters()]
    assert ranks[0] == ranks[1]  # every rank raises the same error, none hangs in a mismatched collective

    # DDP accepts a different optimizer order (it checks the module's shapes): the check names position 0.
    message = ranks[0]["ddp_order"]
    assert message is not None and "position 0" in message
    assert f"rank 0 has `optimizer 0, group 0: {names[0]} shape=" in message
    assert f"rank 1 has `optimizer 0, group 0: {names[-1]} shape=" in message

    # FSDP2: rank 1 has an extra layer; the parameters line up until it, then rank 1 has one more.
    message = ranks[0]["fsdp2_extra"]
    assert message is not None and f"position {len(names)}: rank 0 has `<no parameter>`" in message
    assert "rank 1 has `optimizer 0, group 0: extra.weight shape=(16, 16)" in message
