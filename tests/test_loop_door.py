"""The Fabric and plain-PyTorch door (`GradKit`) on its own: how it takes its arguments, which schedulers it steps,
what it logs per step and what it says when a loop bypasses it.

Each test compares against an independent reference: a hand-written two-optimizer loop, `torch.nn.utils`'s norm,
or the same loop written the documented way.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from torch import Tensor, nn

from gradkit.doors.loop import GradKit
from lightning_gradkit import ClipGradNorm, GradNormMonitor, NonFiniteGuard, SpikeGuard, SpikeRollback

pytestmark = pytest.mark.filterwarnings("ignore:NonFiniteGuard:UserWarning")


def _batches(n: int = 6, nan_at: int | None = None) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        if i == nan_at:
            x[0, 0] = math.nan
        out.append((x, y))
    return out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


# -- policies: one, or a list ----------------------------------------------------------------------------------------
def _run_one_or_list(single: bool) -> tuple[dict[str, Tensor], list[dict[str, float]]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows: list[dict[str, float]] = []
    clip = ClipGradNorm(max_norm=0.5)
    kit = GradKit(model, opt, clip if single else [clip], log=lambda m, s: rows.append(m), log_every_n_steps=1)
    for x, y in _batches():
        nn.functional.mse_loss(model(x), y).backward()
        kit.step(opt)
        opt.zero_grad(set_to_none=True)
    return model.state_dict(), rows


def test_a_single_policy_works_as_a_list_of_one() -> None:
    single_state, single_rows = _run_one_or_list(single=True)
    list_state, list_rows = _run_one_or_list(single=False)
    assert single_rows == list_rows and len(single_rows) == 6
    for key, value in list_state.items():
        assert torch.equal(single_state[key], value), key
    # The policy acted: the reference, clip_grad_norm_ in a hand-written loop, gives the same parameters.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches():
        nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(single_state[key], value, rtol=1e-6, atol=1e-7)


def test_a_single_policy_class_is_refused_with_the_fix() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"holds the class `GradNormMonitor`.*use `GradNormMonitor\(\)`"):
        GradKit(model, opt, GradNormMonitor)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`policies` must be a gradkit policy or a list of them, got an int"):
        GradKit(model, opt, 3)  # type: ignore[arg-type]


# -- LR schedulers: each belongs to the optimizer it was built on ----------------------------------------------------
class _TwoPart(nn.Module):
    """Two halves trained by two optimizers, as a GAN's generator and discriminator: each loss reaches one half."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gen = nn.Linear(4, 1)
        self.disc = nn.Linear(4, 1)


def _two_optimizers(model: _TwoPart) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer, list[object]]:
    opt_g = torch.optim.SGD(model.gen.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(model.disc.parameters(), lr=0.2)
    sched_g = torch.optim.lr_scheduler.StepLR(opt_g, step_size=1, gamma=0.5)
    sched_d = torch.optim.lr_scheduler.LambdaLR(opt_d, lambda step: 1.0 / (1 + step))
    return opt_g, opt_d, [sched_g, sched_d]


def _half_losses(model: _TwoPart, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """The discriminator's loss and the generator's; a NaN input reaches the discriminator only."""
    return nn.functional.mse_loss(model.disc(x), y), nn.functional.mse_loss(model.gen(torch.nan_to_num(x)), y)


def _gan_reference(skip_disc_at: int | None) -> tuple[_TwoPart, list[float]]:
    """A hand-written two-optimizer loop: each scheduler steps right after its own optimizer, and a skipped
    discriminator step skips the discriminator's scheduler step only."""
    model = _TwoPart()
    opt_g, opt_d, schedulers = _two_optimizers(model)
    sched_g, sched_d = schedulers
    for i, (x, y) in enumerate(_batches(nan_at=skip_disc_at)):
        loss_d, loss_g = _half_losses(model, x, y)
        if i != skip_disc_at:
            loss_d.backward()
            opt_d.step()
            sched_d.step()  # type: ignore[attr-defined]
            opt_d.zero_grad(set_to_none=True)
        loss_g.backward()
        opt_g.step()
        sched_g.step()  # type: ignore[attr-defined]
        opt_g.zero_grad(set_to_none=True)
    return model, [opt_g.param_groups[0]["lr"], opt_d.param_groups[0]["lr"]]


def _gan_door(skip_disc_at: int | None) -> tuple[_TwoPart, list[float]]:
    model = _TwoPart()
    opt_g, opt_d, schedulers = _two_optimizers(model)
    kit = GradKit(model, [opt_g, opt_d], [NonFiniteGuard(action="skip")], schedulers=schedulers)
    for x, y in _batches(nan_at=skip_disc_at):
        loss_d, loss_g = _half_losses(model, x, y)
        loss_d.backward()
        kit.step(opt_d)
        opt_d.zero_grad(set_to_none=True)
        loss_g.backward()
        kit.step(opt_g)
        opt_g.zero_grad(set_to_none=True)
    return model, [opt_g.param_groups[0]["lr"], opt_d.param_groups[0]["lr"]]


@pytest.mark.parametrize("skip_disc_at", [None, 2])
def test_each_scheduler_steps_and_holds_with_its_own_optimizer(skip_disc_at: int | None) -> None:
    model, lrs = _gan_door(skip_disc_at)
    reference, reference_lrs = _gan_reference(skip_disc_at)
    assert lrs == reference_lrs
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    # The reference itself: 6 steps of StepLR(gamma=0.5) and 6 (or 5) of LambdaLR(1 / (1 + step)).
    assert reference_lrs == pytest.approx([0.1 * 0.5**6, 0.2 / (7 if skip_disc_at is None else 6)], rel=1e-12)


def test_a_scheduler_of_an_optimizer_the_loop_does_not_step_is_refused() -> None:
    model = _TwoPart()
    opt_g, _, schedulers = _two_optimizers(model)
    with pytest.raises(ValueError, match=r"`schedulers` holds a LambdaLR built on an optimizer .* not one of"):
        GradKit(model, opt_g, [GradNormMonitor()], schedulers=schedulers)


def test_reduce_lr_on_plateau_is_refused_with_the_fix() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    with pytest.raises(ValueError, match=r"`schedulers` holds a ReduceLROnPlateau.*step it yourself") as err:
        GradKit(model, opt, [GradNormMonitor()], schedulers=plateau)
    assert "scheduler.step(val_loss)" in str(err.value) and "returned True" in str(err.value)
    with pytest.raises(ValueError, match="ReduceLROnPlateau"):
        GradKit(model, opt, [GradNormMonitor()], schedulers=[plateau])


# -- logging: one call of `log` per step -----------------------------------------------------------------------------
# What the monitor, the clipper and the pipeline's skip count logged before, in three calls of `log` per step.
_STEP_KEYS = {
    "grad_norm/module/0",
    "grad_norm/module/2",
    "grad_norm/total",
    "grad_norm/total_post_clip",
    "grad_clip/clipped_fraction",
    "grad_clip/coef",
    "grad_clip/post_clip_norm",
    "grad_clip/pre_clip_norm",
    "gradkit/skipped_steps",
}


def test_log_is_called_once_per_step_with_every_policys_values() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[tuple[int, dict[str, float]]] = []
    policies = [GradNormMonitor(), ClipGradNorm(max_norm=0.5), NonFiniteGuard(action="skip")]
    kit = GradKit(model, opt, policies, log=lambda metrics, step: calls.append((step, metrics)), log_every_n_steps=2)
    for x, y in _batches():
        nn.functional.mse_loss(model(x), y).backward()
        kit.step(opt)
        opt.zero_grad(set_to_none=True)

    # Steps 1, 3, 5 by the period (and step 0: the monitor logs its first step), each in one call.
    assert [step for step, _ in calls] == [0, 1, 3, 5]
    for step, metrics in calls[1:]:
        assert metrics.keys() == _STEP_KEYS, step

    # The values: the reference, clip_grad_norm_ in a hand-written loop, returns the same pre-clip norms.
    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    norms = []
    for x, y in _batches():
        nn.functional.mse_loss(reference(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    for step, metrics in calls:
        assert metrics["grad_norm/total"] == pytest.approx(norms[step], rel=1e-6)
    assert all(metrics["gradkit/skipped_steps"] == 0.0 for _, metrics in calls[1:])


# -- the guards' events: by default in Fabric's logger directory or ./gradkit_logs, or where asked, or not saved -------
def _nan_loop(log_dir: Path | Literal[False] | None, fabric: Any = None) -> list[str]:
    """A plain loop with a NaN batch under `NonFiniteGuard(action="skip")`: the guard's warnings."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kit = GradKit(model, opt, [NonFiniteGuard(action="skip")], log_dir=log_dir, fabric=fabric)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in _batches(nan_at=2):
            nn.functional.mse_loss(model(x), y).backward()
            kit.step(opt)
            opt.zero_grad(set_to_none=True)
        kit.finish()
    assert kit.skipped_steps == 1
    return [str(w.message) for w in caught if str(w.message).startswith("NonFiniteGuard")]


def _event_of(message: str, events: Path) -> dict[str, Any]:
    """The one event in ``events``, after checking that the warning names that file."""
    assert message.endswith(f" Events: {events}."), message
    (event,) = [json.loads(line) for line in events.read_text().splitlines()]
    return event


def test_guard_events_are_written_by_default_where_asked_or_not_at_all(tmp_path: Path) -> None:
    # conftest runs each test in a fresh working directory: the default folder is ./gradkit_logs there.
    (message,) = _nan_loop(None)
    assert _event_of(message, Path.cwd() / "gradkit_logs" / "gradkit_events.jsonl")["step"] == 2

    (message,) = _nan_loop(tmp_path / "run")
    assert _event_of(message, tmp_path / "run" / "gradkit_events.jsonl")["step"] == 2

    (message,) = _nan_loop(False)
    assert message.endswith(" (No events file: pass GradKit(log_dir=...) to save the events.)"), message
    assert [p.name for p in Path.cwd().iterdir()] == ["gradkit_logs"] and [p.name for p in tmp_path.iterdir()] == [
        "run"
    ]


def test_guard_events_go_to_fabrics_logger_directory(tmp_path: Path) -> None:
    from lightning.fabric import Fabric
    from lightning.fabric.loggers import CSVLogger

    fabric = Fabric(accelerator="cpu", devices=1, loggers=CSVLogger(tmp_path / "csv"))
    (message,) = _nan_loop(None, fabric)
    assert _event_of(message, Path(fabric.logger.log_dir) / "gradkit_events.jsonl")["step"] == 2
    assert not (Path.cwd() / "gradkit_logs").exists()


# -- a loop that bypasses the door: told, once, with what to do -------------------------------------------------------
_NO_STEP = "GradKit.finish(): no optimizer step went through kit.step(...)"
_NO_LOSS = "SpikeGuard(monitor='loss') saw no loss: call kit.note_loss(loss) each micro-batch"


def _door_warnings(through_kit: bool, note_loss: bool) -> list[list[str]]:
    """A plain loop under `SpikeGuard("loss")`: the door's warnings, per step and at `finish()` (the last list)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kit = GradKit(model, opt, [GradNormMonitor(), SpikeGuard("loss", action="warn")], log_dir=None)
    out = []
    for x, y in [*_batches(), *_batches()]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if note_loss:
                kit.note_loss(loss)
            kit.step(opt) if through_kit else opt.step()
            opt.zero_grad(set_to_none=True)
        out.append([str(w.message) for w in caught])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kit.finish()
    return [*out, [str(w.message) for w in caught]]


def _with(messages: list[list[str]], start: str) -> list[int]:
    """Where (at which step, or finish: the last index) a message starting with ``start`` came, once per message."""
    return [i for i, step in enumerate(messages) for m in step if m.startswith(start)]


def test_finish_warns_when_no_step_went_through_the_door() -> None:
    bypassed = _door_warnings(through_kit=False, note_loss=True)
    assert _with(bypassed, _NO_STEP) == [12]
    assert "Call kit.step(optimizer) in place of optimizer.step()" in bypassed[12][0]
    # The reference: the same loop written the documented way is not warned.
    assert _with(_door_warnings(through_kit=True, note_loss=True), "GradKit") == []


def test_a_loss_spike_guard_without_note_loss_is_warned_once_at_the_first_step() -> None:
    assert _with(_door_warnings(through_kit=True, note_loss=False), _NO_LOSS) == [0]
    assert _with(_door_warnings(through_kit=True, note_loss=True), "SpikeGuard(monitor=") == []


# -- SpikeRollback behind the loop door -------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:SpikeRollback\\(monitor='loss'\\) saw no loss")
def test_spike_rollback_without_note_loss_leaves_clean_training_alone() -> None:
    """A loop that never calls `note_loss`: the window loss is "no value", not a non-finite loss. It used to roll
    back clean training at step 1 and raise at step 3. Reference: the same loop without gradkit."""

    def run(door: bool) -> tuple[nn.Module, GradKit | None]:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rollback = SpikeRollback(warmup_steps=2, nonfinite_patience=1, snapshot_every_n_steps=2)
        kit = GradKit(model, opt, rollback, log_every_n_steps=0) if door else None
        for x, y in _batches():
            nn.functional.mse_loss(model(x), y).backward()
            kit.step(opt) if kit is not None else opt.step()
            opt.zero_grad(set_to_none=True)
        return model, kit

    ours, kit = run(door=True)
    reference, _ = run(door=False)
    assert kit is not None and kit.skipped_steps == 0
    for a, b in zip(ours.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:SpikeRollback:UserWarning")
def test_a_rollback_after_resume_restores_the_loaded_weights_whatever_the_load_order() -> None:
    """`kit.load_state_dict` before `model.load_state_dict`: the resume-time snapshot is taken at the first forward,
    after both, so a rollback to it restores the loaded (trained) weights, not the untrained ones."""
    trained = _model()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(1.0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rollback = SpikeRollback(warmup_steps=2, nonfinite_patience=1)
    kit = GradKit(model, opt, rollback, log_every_n_steps=0)
    kit.load_state_dict(kit.state_dict())
    model.load_state_dict(trained.state_dict())  # after the door's state: the order the review found broken
    x, y = _batches(1, nan_at=0)[0]
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    kit.note_loss(loss)
    kit.step(opt)  # a non-finite loss: the rollback restores the resume-time snapshot
    assert rollback.state_dict()["rollbacks"] == 1
    for a, b in zip(model.parameters(), trained.parameters(), strict=True):
        assert torch.equal(a, b)
