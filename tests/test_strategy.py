"""The GradKit strategies: registry names, device resolution, a user's own mixin subclass, and no change at all
to training when no callback asks for step control."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from helpers import MLPModule, count_syncs, loader, make_trainer
from lightning_gradkit import (
    GradKitDDPStrategy,
    GradKitFSDPStrategy,
    GradKitModelParallelStrategy,
    GradKitSingleDeviceStrategy,
    GradKitStrategyMixin,
    GradNormMonitor,
    NonFiniteGuard,
)
from test_guards import Fault, FaultModule, state_equal


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("gradkit", GradKitSingleDeviceStrategy),
        ("gradkit_ddp", GradKitDDPStrategy),
        ("gradkit_ddp_spawn", GradKitDDPStrategy),
        ("gradkit_fsdp", GradKitFSDPStrategy),
        ("gradkit_model_parallel", GradKitModelParallelStrategy),
    ],
)
def test_names_are_registered_on_import(name: str, cls: type) -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    strategy = StrategyRegistry.get(name)
    assert type(strategy) is cls and isinstance(strategy, GradKitStrategyMixin)
    if name.startswith("gradkit_ddp"):
        assert strategy._start_method == ("spawn" if name.endswith("spawn") else "popen")


def test_gradkit_resolves_the_trainer_device_and_refuses_several(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, strategy="gradkit", accelerator="cpu")
    assert isinstance(trainer.strategy, GradKitSingleDeviceStrategy)
    assert trainer.strategy.root_device == torch.device("cpu")
    with pytest.raises(ValueError, match='strategy="gradkit_ddp"'):
        make_trainer(tmp_path, strategy="gradkit", accelerator="cpu", devices=2)


def test_ddp_trainer_gets_the_gradkit_ddp_strategy(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, strategy="gradkit_ddp", accelerator="cpu", devices=2)
    assert isinstance(trainer.strategy, GradKitDDPStrategy) and trainer.strategy.num_processes == 2


def test_without_step_control_training_is_bitwise_identical_to_lightning(tmp_path: Path) -> None:
    runs = []
    for strategy in ("auto", "gradkit"):
        torch.manual_seed(0)
        model = FaultModule(None)
        make_trainer(tmp_path / strategy, strategy=strategy, callbacks=[GradNormMonitor()]).fit(model, loader())
        runs.append(model)
    for (name, a), b in zip(runs[0].named_parameters(), runs[1].parameters(), strict=True):
        assert torch.equal(a, b), name
    assert state_equal(runs[0].snapshots[7], runs[1].snapshots[7])


def test_gate_is_off_and_sync_free_without_a_skipping_callback(tmp_path: Path) -> None:
    trainer = make_trainer(
        tmp_path, strategy="gradkit", callbacks=[NonFiniteGuard(action="warn")], log_every_n_steps=100
    )
    with count_syncs() as counter:
        counter.watch(trainer.strategy, "optimizer_step")
        trainer.fit(MLPModule(), loader())
    assert counter.total == 0, counter.counts
    assert not trainer.strategy._gradkit_gate_active


class MyStrategy(GradKitStrategyMixin, SingleDeviceStrategy):
    """A user's own strategy subclass with the mixin in front."""


def test_mixin_works_in_a_user_strategy_subclass(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = FaultModule(Fault("loss", float("nan")))
    trainer = make_trainer(tmp_path, strategy=MyStrategy(device="cpu"), callbacks=[NonFiniteGuard()])
    with pytest.warns(UserWarning, match="NonFiniteGuard"):
        trainer.fit(model, loader())
    assert state_equal(model.snapshots[2], model.snapshots[3])
    assert "step" not in trainer.optimizers[0].__dict__  # the gate is removed after each step
