"""NonFiniteGuard under adversarial use, single process: messages that agree with the events and with what was
injected, and a forensic replay that does not count torchmetrics updates twice."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from torch import Tensor

from helpers import loader, make_trainer
from lightning_gradkit import NonFiniteGuard
from test_guards import INF, NAN, AlwaysNaN, Fault, FaultModule, events


class FlaggedSteps(pl.Callback):
    """The independent record: the optimizer steps whose micro-batches had a non-finite loss."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if not torch.isfinite(loss).all() and trainer.global_step not in self.steps:
            self.steps.append(trainer.global_step)


def _fit(tmp_path: Path, model: FaultModule, *callbacks: pl.Callback, **kwargs: Any) -> tuple[pl.Trainer, list[str]]:
    trainer = make_trainer(tmp_path, callbacks=list(callbacks), **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader())
    return trainer, [str(w.message) for w in caught if "NonFiniteGuard" in str(w.message)]


def test_warn_mode_gives_up_naming_the_whole_run_of_flagged_steps(tmp_path: Path) -> None:
    torch.manual_seed(0)
    flagged = FlaggedSteps()
    # The NaN update of step 1 is applied (warn), so every later step is non-finite too; reports every 3 steps.
    trainer = make_trainer(
        tmp_path, callbacks=[NonFiniteGuard(action="warn", max_consecutive=5), flagged], log_every_n_steps=3
    )
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="consecutive") as info:
        trainer.fit(AlwaysNaN(Fault("activation", NAN)), loader())
    run = flagged.steps
    assert run == list(range(run[0], run[-1] + 1))  # one unbroken run, as the reference sees it
    assert f"{len(run)} consecutive optimizer steps had non-finite values (steps {run[0]}-{run[-1]})" in str(info.value)


def test_giving_up_lists_the_non_finite_gradients_once(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = AlwaysNaN(Fault("activation", NAN))
    guard = NonFiniteGuard(max_consecutive=3)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="consecutive") as info:
        make_trainer(tmp_path, strategy="gradkit", callbacks=[guard]).fit(model, loader())
    message = str(info.value)
    names = [n for n, _ in model.named_parameters()]
    # Every gradient is non-finite (the loss is); the list appears once, the culprit is named on its own.
    for name in names[1:]:
        assert message.count(f"`{name}`") == 1, name
    assert "3 consecutive optimizer steps had non-finite values (steps 1-3)" in message


def test_console_event_and_forensics_name_the_same_step_and_batch(tmp_path: Path) -> None:
    accumulate = 4
    fault = Fault("activation", NAN, batch_idx=5)
    torch.manual_seed(0)
    trainer, warned = _fit(
        tmp_path,
        FaultModule(fault),
        NonFiniteGuard(action="skip"),
        strategy="gradkit",
        accumulate_grad_batches=accumulate,
    )
    step = fault.batch_idx // accumulate  # the reference: where the fault was injected
    first, last = step * accumulate, step * accumulate + accumulate - 1
    (event,) = events(trainer)
    assert event["step"] == step and event["batch_idx"] == fault.batch_idx and event["batches"] == [first, last]
    assert event["values"]["forensics"][0]["batch_idx"] == fault.batch_idx
    assert event["culprit"] == fault.target and event["culprit_source"] == "replay"
    (line,) = warned
    assert f"step {step}: batch {fault.batch_idx} (the step's batches {first}-{last})" in line
    assert f"culprit `{fault.target}`" in line and f"replay of batch {fault.batch_idx}" in line


def test_raise_error_says_what_the_console_and_the_event_say(tmp_path: Path) -> None:
    fault = Fault("activation", NAN, batch_idx=5)
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, callbacks=[NonFiniteGuard(action="raise")], accumulate_grad_batches=4)
    with pytest.raises(RuntimeError) as info:
        trainer.fit(FaultModule(fault), loader())
    (event,) = events(trainer)
    assert f"step {event['step']}: batch {event['batch_idx']} (the step's batches 4-7)" in str(info.value)
    assert f"culprit `{event['culprit']}`" in str(info.value)


MODES = {
    "skip": dict(action="skip", strategy="gradkit", fused=False),
    "raise": dict(action="raise", strategy="auto", fused=False),
    "warn": dict(action="warn", strategy="auto", fused=False),
    "skip_fused": dict(action="skip", strategy="gradkit", fused=True),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_culprit_has_one_meaning_in_every_mode(tmp_path: Path, mode: str) -> None:
    """A gradient poisoned by a hook: the first non-finite value IS that parameter's gradient, in every mode.
    A poisoned loss: ``<loss>`` in every mode, localized by a replay where one runs, seen in the loss otherwise.
    Reference: the parameter and the loss the test poisons."""
    config = MODES[mode]
    for kind, value, target in (("grad", INF, "head.bias"), ("loss", NAN, "")):
        torch.manual_seed(0)
        model = FaultModule(Fault(kind, value, target=target), optimizer="adam", fused=config["fused"])
        guard = NonFiniteGuard(action=config["action"])
        trainer = make_trainer(tmp_path / kind, strategy=config["strategy"], callbacks=[guard], log_every_n_steps=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if config["action"] == "raise":
                with pytest.raises(RuntimeError, match=r"culprit `"):
                    trainer.fit(model, loader())
            else:
                trainer.fit(model, loader())
        event = events(trainer)[0]
        replayed = "forensics" in event["values"]
        # Every mode that skips or raises replays (a fused optimizer's skip one step late); "warn" applied the update,
        # and its event says how to get a replay.
        assert replayed == (config["action"] != "warn"), mode
        assert replayed or "use action='skip' or 'raise'" in event["reproducible_reason"], mode
        if kind == "grad":
            assert event["culprit"] == "head.bias", mode
            assert event["culprit_source"] == ("replay" if replayed else "gradients"), mode
        else:
            assert event["culprit"] == "<loss>", mode
            assert event["culprit_source"] == ("replay" if replayed else "loss"), mode


class CountingModule(FaultModule):
    """Counts the samples it trains on with torchmetrics: a tensor state (sum) and a list state (cat)."""

    def __init__(self, fault: Fault) -> None:
        super().__init__(fault)
        self.seen = torchmetrics.SumMetric()
        self.firsts = torchmetrics.CatMetric()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, _ = batch
        self.seen.update(torch.tensor(float(x.shape[0])))
        self.firsts.update(x[:, 0])
        return super().training_step(batch, batch_idx)


def test_replay_does_not_count_torchmetrics_updates_twice(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = CountingModule(Fault("activation", NAN, batch_idx=2))
    trainer, _ = _fit(tmp_path, model, NonFiniteGuard(action="skip"), strategy="gradkit")
    assert "forensics" in events(trainer)[0]["values"]  # the bad batch was replayed
    # The reference: what the loader yielded, each batch once.
    xs = torch.cat([x for x, _ in loader()])
    assert model.seen.compute() == xs.shape[0]
    torch.testing.assert_close(model.firsts.compute(), xs[:, 0], rtol=0, atol=0)
