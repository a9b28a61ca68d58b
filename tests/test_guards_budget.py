"""NonFiniteGuard in a long run and in the console: the culprit replay's budget (a second, independent NaN much later
gets a replay of its own) and a warning whose first line is short and names the user's line, not gradkit's."""

from __future__ import annotations

import inspect
import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from gradkit.doors.loop import GradKit
from helpers import MLPModule, loader, make_trainer
from lightning_gradkit import NonFiniteGuard
from test_guards import events


class Switch(nn.Module):
    """Passes its input through, or NaN while ``on`` (for a whole step: the replay sees the fault too)."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def forward(self, x: Tensor) -> Tensor:
        return x * math.nan if self.on else x


def train_loop(tmp_path: Path, steps: int, faulty: set[int], guard: NonFiniteGuard) -> tuple[list[dict], list[str]]:
    """A plain loop of ``steps`` optimizer steps whose ``Switch`` is on at the ``faulty`` steps; the events and the
    guard's warnings."""
    torch.manual_seed(0)
    switch = Switch()
    model = nn.Sequential(nn.Linear(4, 4), switch, nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    kit = GradKit(model, optimizer, guard, log_every_n_steps=0, log_dir=tmp_path)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            switch.on = step in faulty
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            kit.note_loss(loss, replay=lambda: nn.functional.mse_loss(model(x), y))
            kit.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
        kit.finish()
    return events(tmp_path), [str(w.message) for w in caught if str(w.message).startswith("NonFiniteGuard")]


def test_a_second_independent_nan_900_steps_later_gets_its_own_replay_and_one_in_between_does_not(
    tmp_path: Path,
) -> None:
    """The issue's case with the default budget (one replay per 500 steps): NaNs at steps 5, 905 and 950."""
    events, warned = train_loop(tmp_path, 960, {5, 905, 950}, NonFiniteGuard(action="skip"))
    found = [(e["step"], e["culprit"], e["culprit_source"]) for e in events]
    assert found == [
        (5, "1", "replay"),  # the Switch, module "1" of the Sequential
        (905, "1", "replay"),  # 900 steps later: its own replay (before the budget: `<loss>`)
        (950, "<loss>", "loss"),  # 45 steps after the last replay: none
    ]
    assert [e["reproducible_reason"] for e in events][2] == "no replay ran"
    assert "the last replay ran at step 905: at most one per 500 steps (`replay_every_n_steps`)" in warned[2]


def test_replay_every_n_steps_none_replays_the_first_detection_only(tmp_path: Path) -> None:
    events, _ = train_loop(tmp_path, 30, {2, 25}, NonFiniteGuard(action="skip", replay_every_n_steps=None))
    assert [(e["step"], e["culprit_source"]) for e in events] == [(2, "replay"), (25, "loss")]


def test_replay_every_n_steps_is_checked_and_a_checkpoint_from_before_the_budget_keeps_its_replay_step() -> None:
    with pytest.raises(ValueError, match="replay_every_n_steps"):
        NonFiniteGuard(replay_every_n_steps=0)
    # A state saved before the budget existed: one replay ran, at the first finding (step 7).
    old = {"consecutive": [], "forensics_done": True, "first_finding": {"step": 7, "culprit": "a", "described": "x"}}
    guard = NonFiniteGuard(replay_every_n_steps=100)
    guard.load_state_dict({**old, "skipped_steps": 1.0})
    assert not guard.replay_allowed(106) and guard.replay_allowed(107)
    assert guard.state_dict()["last_replay_step"] == 7
    fresh = NonFiniteGuard()
    fresh.load_state_dict({"consecutive": [], "forensics_done": False, "first_finding": None})
    assert fresh.replay_allowed(0)


# -- the warning: a short first line at the user's line --------------------------------------------------------------
class ManyParameters(MLPModule):
    """53 parameter tensors (the issue's count) and a NaN loss at step 1."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.ParameterList([nn.Parameter(torch.ones(2)) for _ in range(47)])

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx) + sum(p.sum() for p in self.extra) * 0.0
        return loss * math.nan if self.trainer.global_step == 1 else loss


def test_the_nan_warning_has_a_short_first_line_at_the_users_line_and_no_parameter_list(tmp_path: Path) -> None:
    model = ManyParameters()
    assert len(list(model.parameters())) == 53
    trainer = make_trainer(tmp_path, strategy="gradkit", max_steps=3, callbacks=[NonFiniteGuard(action="skip")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_line = inspect.currentframe().f_lineno + 1
        trainer.fit(model, loader())
    (warning,) = [w for w in caught if str(w.message).startswith("NonFiniteGuard")]
    assert (warning.filename, warning.lineno) == (__file__, fit_line)
    first, *details = str(warning.message).splitlines()
    assert first == (
        "NonFiniteGuard: non-finite loss and gradients at step 1, culprit `<loss>` (from the replay); "
        "the optimizer step was skipped."
    )
    text = "\n".join(details)
    assert "Non-finite gradients in 53 parameter(s)" in text and "extra.48" not in text
    assert text.endswith(f"Events: {Path(trainer.log_dir) / 'gradkit_events.jsonl'}.")
    (event,) = events(trainer)
    assert len(event["values"]["nonfinite_param_grads"]) == 50  # the names are in the event (its first 50)


def test_the_loop_doors_warning_names_the_kit_step_line(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kit = GradKit(model, optimizer, NonFiniteGuard(action="skip"), log_dir=tmp_path)
    model(torch.tensor([[math.nan, 1.0]])).sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step_line = inspect.currentframe().f_lineno + 1
        kit.step(optimizer)
    (warning,) = caught
    assert (warning.filename, warning.lineno) == (__file__, step_line)
    first = str(warning.message).splitlines()[0]
    assert first == (
        "NonFiniteGuard: non-finite gradients at step 0, culprit `weight` (first non-finite gradient, no replay); "
        "the optimizer step was skipped."
    )
