"""StepsToSkip: the batches of declared step ranges are drawn and dropped, behind the loop door and the Trainer; the
reference is a hand-written loop over the same batches that leaves those out. The ranges travel in checkpoints, the
events list them, and SpikeRollback's rollback events list what it left out in the same form."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gradkit.doors.loop import GradKit
from gradkit.policies.rollback import SpikeRollback
from gradkit.policies.steps_to_skip import StepsToSkip, merge_ranges, steps_from_events
from helpers import MLPModule, loader, make_trainer
from lightning_gradkit import StepsToSkip as StepsToSkipCallback
from test_guards import events

DROPPED = [[2, 4]]  # steps 2 and 3 of 6


def _batches() -> list[tuple[Tensor, Tensor]]:
    return list(loader(n=48, batch_size=8))


def _reference(
    skip: set[int], lr: float = 0.05, batches: list[tuple[Tensor, Tensor]] | None = None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A hand-written loop over the same batches that steps Adam, and its LR schedule, on the kept ones only."""
    torch.manual_seed(0)
    model = MLPModule()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    for step, (x, y) in enumerate(_batches() if batches is None else batches):
        if step in skip:
            continue
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        schedule.step()
    return model, optimizer


def test_ranges_are_checked_and_merged_with_the_argument_named() -> None:
    assert merge_ranges([[10, 12], [0, 3], [3, 5]]) == [[0, 5], [10, 12]]
    with pytest.raises(ValueError, match=r"`steps` entries are \[start, stop\) optimizer-step ranges.*got 7"):
        StepsToSkip(steps=[7])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"`steps` entry \[5, 5\] needs 0 <= start < stop"):
        StepsToSkip(steps=[[5, 5]])


def _loop_door(policy: StepsToSkip, log_dir: Path | bool = False) -> tuple[nn.Module, GradKit, list[int]]:
    torch.manual_seed(0)
    model = MLPModule()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    kit = GradKit(model, optimizer, policy, schedulers=schedule, log_dir=log_dir)
    forwards: list[int] = []
    for step, (x, y) in enumerate(_batches()):
        if not kit.drops_batch:
            forwards.append(step)
            nn.functional.mse_loss(model(x), y).backward()
        kit.step(optimizer)
        optimizer.zero_grad()
    return model, kit, forwards


def test_the_loop_door_drops_the_declared_steps_as_a_loop_that_leaves_them_out(tmp_path: Path) -> None:
    policy = StepsToSkip(steps=DROPPED)
    model, kit, forwards = _loop_door(policy, tmp_path)
    reference, _ = _reference({2, 3})
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    assert forwards == [0, 1, 4, 5] and kit.state_dict()["step"] == 6
    assert kit.skipped_steps == 2 and policy.dropped == 2
    assert kit.ctx.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**4)  # the schedule held twice
    (event,) = [e for e in events(tmp_path) if e["what"] == "steps_skipped"]
    assert (event["step"], event["steps_to_skip"], event["source"]) == (2, [[2, 4]], "StepsToSkip")


def test_a_forward_run_regardless_leaves_no_gradient_nor_buffer_write_behind() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kit = GradKit(model, optimizer, StepsToSkip(steps=[[0, 1]]), log_dir=False)
    before = copy.deepcopy(model.state_dict())
    model(torch.randn(8, 4)).sum().backward()  # the loop did not ask `drops_batch`
    assert kit.step(optimizer) is False
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_the_ranges_and_the_count_travel_in_the_state_and_merge_with_new_ones() -> None:
    policy = StepsToSkip(steps=[[2, 4]])
    _, kit, _ = _loop_door(policy)
    state = copy.deepcopy(kit.state_dict())
    restarted = StepsToSkip(steps=[[8, 9]])
    restarted.load_state_dict(state["policies"]["StepsToSkip"])
    assert restarted.steps == [[2, 4], [8, 9]] and restarted.dropped == 2


def test_a_resume_inside_a_range_keeps_dropping_until_its_end() -> None:
    torch.manual_seed(0)
    model = MLPModule()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    kit = GradKit(model, optimizer, StepsToSkip(steps=DROPPED), schedulers=schedule, log_dir=False)
    batches = _batches()
    for x, y in batches[:3]:  # steps 0, 1 and the dropped step 2
        if not kit.drops_batch:
            nn.functional.mse_loss(model(x), y).backward()
        kit.step(optimizer)
        optimizer.zero_grad()
    states = {"kit": kit, "model": model, "opt": optimizer, "lr": schedule}
    saved = copy.deepcopy({key: value.state_dict() for key, value in states.items()})
    model2 = MLPModule()
    model2.load_state_dict(saved["model"])
    optimizer2 = torch.optim.Adam(model2.parameters(), lr=0.05)
    schedule2 = torch.optim.lr_scheduler.LambdaLR(optimizer2, lambda step: 0.5**step)
    optimizer2.load_state_dict(saved["opt"])  # after the scheduler is built: its first step sets the LR
    schedule2.load_state_dict(saved["lr"])
    kit2 = GradKit(model2, optimizer2, StepsToSkip(), schedulers=schedule2, log_dir=False)
    kit2.load_state_dict(saved["kit"])
    for x, y in batches[3:]:
        if not kit2.drops_batch:
            nn.functional.mse_loss(model2(x), y).backward()
        kit2.step(optimizer2)
        optimizer2.zero_grad()
    reference, _ = _reference({2, 3})
    assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), reference.parameters(), strict=True))


# -- behind the Trainer ----------------------------------------------------------------------------------------------
class _Module(MLPModule):
    """Adam and a per-step LR schedule; counts the batches its ``training_step`` ran."""

    def __init__(self) -> None:
        super().__init__(lr=0.05, optimizer="adam")
        self.trained: list[int] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.trained.append(batch_idx)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_trainer_drops_the_declared_steps_as_a_loop_that_leaves_them_out(tmp_path: Path, accumulate: int) -> None:
    torch.manual_seed(0)
    module = _Module()
    policy = StepsToSkipCallback(steps=DROPPED)
    trainer = make_trainer(
        tmp_path,
        strategy="gradkit",
        callbacks=[policy],
        accumulate_grad_batches=accumulate,
        logger=False,
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a small run's Lightning warnings
        trainer.fit(module, loader(n=48, batch_size=8 // accumulate))  # 6 optimizer steps of 8 samples
    assert trainer.global_step == 6
    dropped = {2 * accumulate + i for i in range(2 * accumulate)}  # every micro-batch of steps 2 and 3
    assert module.trained == [b for b in range(6 * accumulate) if b not in dropped]
    reference, _ = _reference({2, 3})
    if accumulate == 1:
        assert all(torch.equal(a, b) for a, b in zip(module.parameters(), reference.parameters(), strict=True))
    else:  # the window's mean gradient: equal up to the rounding of summing two halves
        pairs = zip(module.parameters(), reference.parameters(), strict=True)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in pairs)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**4)
    assert policy.dropped == 2 and trainer.strategy.gradkit_state_dict()["lr_schedule"][0][2] == 4 * accumulate
    (event,) = [e for e in events(tmp_path) if e["what"] == "steps_skipped"]
    assert event["steps_to_skip"] == [[2, 4]]


def test_the_trainer_refuses_a_strategy_that_cannot_drop_a_step(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[StepsToSkipCallback(steps=DROPPED)], logger=False, max_steps=1)
    with pytest.raises(RuntimeError, match=r'StepsToSkip drops .* GradKit strategy.*strategy="gradkit"'):
        trainer.fit(_Module(), loader())


def test_the_trainer_refuses_manual_optimization_and_says_what_to_do_instead(tmp_path: Path) -> None:
    module = _Module()
    module.automatic_optimization = False
    trainer = make_trainer(
        tmp_path, strategy="gradkit", callbacks=[StepsToSkipCallback(steps=DROPPED)], logger=False, max_steps=1
    )
    with pytest.raises(RuntimeError, match=r"StepsToSkip needs automatic optimization.*range_of\(self.global_step\)"):
        trainer.fit(module, loader())
    assert module.trained == []  # refused at setup, before any batch


# -- the rollback's left-out steps, in the same form -----------------------------------------------------------------
def test_a_rollback_event_lists_the_steps_it_left_out_and_steps_from_events_reads_them(tmp_path: Path) -> None:
    """A loss spike that persists from step 8 on: the rollback fires at step 10, restores the snapshot taken before
    step 8 and steps over 2 more batches (steps 11 and 12): the model holds none of the batches of steps 8 to 12."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rollback = SpikeRollback("loss", warmup_steps=3, patience=3, snapshot_every_n_steps=4, skip_batches=2)
    kit = GradKit(model, optimizer, rollback, log_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(13):
            loss = model(torch.ones(2, 4)).square().mean() * (1 + 0.01 * (step % 3)) + (100.0 if step >= 8 else 0.0)
            loss.backward()
            kit.note_loss(loss)
            kit.step(optimizer)
            optimizer.zero_grad()
    (event,) = [e for e in events(tmp_path) if e["what"] == "rollback"]
    assert event["steps_to_skip"] == [[event["to_step"], event["from_step"] + event["skip_batches"]]]
    assert event["steps_to_skip"] == [[8, 13]]
    assert steps_from_events(tmp_path) == [[8, 13]]


def test_a_restart_from_before_a_rollback_skips_its_steps_as_a_loop_that_leaves_them_out(tmp_path: Path) -> None:
    """The restart of docs/jobs/early_warning.md behind the loop door: a run rolls back over a stretch of bad data; a
    checkpoint taken before it is resumed with ``StepsToSkip(steps=steps_from_events(run_dir))`` added to the
    policies. The added policy starts fresh (one warning; the loop door used to raise a KeyError), and the resumed run
    ends as a hand-written loop over the same batches that leaves those steps out."""
    batches = list(loader(n=128, batch_size=8))  # 16 steps; the batches of steps 8 to 12 spike the loss

    def loss_of(model: nn.Module, step: int) -> Tensor:
        x, y = batches[step]
        return nn.functional.mse_loss(model(x), y) + (100.0 if 8 <= step <= 12 else 0.0)

    def rollback() -> SpikeRollback:
        return SpikeRollback("loss", warmup_steps=3, patience=3, snapshot_every_n_steps=4, skip_batches=2)

    def run(kit: GradKit, model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            if not kit.drops_batch:
                loss = loss_of(model, step)
                loss.backward()
                kit.note_loss(loss)
            kit.step(optimizer)
            optimizer.zero_grad()

    def build(policies: list[Any], log_dir: Path, saved: dict[str, Any] | None = None) -> tuple[Any, ...]:
        torch.manual_seed(0)
        model = MLPModule()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
        if saved is not None:
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["opt"])
            schedule.load_state_dict(saved["lr"])
        return model, optimizer, schedule, GradKit(model, optimizer, policies, schedulers=schedule, log_dir=log_dir)

    model, optimizer, schedule, kit = build([rollback()], tmp_path / "first")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the rollback's own warnings
        run(kit, model, optimizer, range(4))
        states = {"kit": kit, "model": model, "opt": optimizer, "lr": schedule}
        saved = copy.deepcopy({key: value.state_dict() for key, value in states.items()})  # before the rollback
        run(kit, model, optimizer, range(4, 16))
    left_out = steps_from_events(tmp_path / "first")
    assert left_out == [[8, 13]]  # the rollback at step 10 went back to step 8 and stepped over steps 11 and 12

    declared = StepsToSkip(steps=left_out)
    model, optimizer, _, kit = build([rollback(), declared], tmp_path / "restart", saved)
    with pytest.warns(UserWarning, match=r"^Resuming with no saved state for StepsToSkip: .* it starts fresh") as w:
        kit.load_state_dict(saved["kit"])
    assert len(w) == 1
    run(kit, model, optimizer, range(4, 16))
    reference, _ = _reference(set(range(8, 13)), batches=batches)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    assert declared.dropped == 5 and kit.skipped_steps == 5 and kit.state_dict()["step"] == 16
