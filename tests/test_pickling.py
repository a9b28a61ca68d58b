"""Every public callback and every gradkit policy, and the Trainer or loop holding them, pickles and deep-copies before
and after ``fit``, as plain Lightning's Trainer does (``torch.save(trainer)``), and a copy carries on exactly as the
original."""

from __future__ import annotations

import copy
import importlib
import inspect
import io
import pickle
import pkgutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

import gradkit
from gradkit.doors.loop import GradKit
from gradkit.policies.guards import NonFiniteGuard as TorchNonFiniteGuard
from gradkit.policies.monitor import GradNormMonitor as TorchGradNormMonitor
from gradkit.policies.rollback import SpikeRollback as TorchSpikeRollback
from gradkit.policies.spike_guard import SpikeGuard as TorchSpikeGuard
from gradkit.step.protocol import Policy, Stage
from helpers import MLPModule, exported_callbacks, loader, make_trainer
from lightning_gradkit import (
    AccumulationGuard,
    ActivationCheckpointing,
    AdaptiveGradClip,
    AutoClip,
    CheckpointGuard,
    ClipGradNorm,
    ClipGradValue,
    EarlyWarning,
    EscalationLadder,
    GradKitDDPStrategy,
    GradKitFSDPStrategy,
    GradKitModelParallelStrategy,
    GradKitSingleDeviceStrategy,
    GradNormMonitor,
    GraphLeakGuard,
    InferenceModeValidation,
    ManualAccumulator,
    NonFiniteGuard,
    QKClip,
    SpikeGuard,
    SpikeRollback,
    StepsToSkip,
    SyncAudit,
    UpdateClip,
    ZClip,
    clip_gradients,
)

# Each exported callback in its typical configuration, with the Trainer arguments it is typically used with.
CASES: dict[str, tuple[Callable[[], Callback], dict[str, Any]]] = {
    "AccumulationGuard": (lambda: AccumulationGuard(), {"accumulate_grad_batches": 2}),
    "ActivationCheckpointing": (lambda: ActivationCheckpointing(["Linear"]), {}),
    "AdaptiveGradClip": (lambda: AdaptiveGradClip(clip_factor=0.01, exclude=["re:head"]), {}),
    "AutoClip": (lambda: AutoClip(percentile=10.0, history_size=100), {}),
    "CheckpointGuard": (lambda: CheckpointGuard(), {"enable_checkpointing": True}),
    "ClipGradNorm": (lambda: ClipGradNorm(max_norm=0.1), {}),
    "ClipGradValue": (lambda: ClipGradValue(clip_value=0.01), {}),
    "EarlyWarning": (lambda: EarlyWarning(attention=None, output="head"), {}),
    "EscalationLadder": (lambda: EscalationLadder(rungs=["warn", "lr_cut", "stop"]), {}),
    "GradNormMonitor": (lambda: GradNormMonitor(param_groups=True, weight_norms=True, prog_bar=True), {}),
    "GraphLeakGuard": (lambda: GraphLeakGuard(check_every_n_steps=2), {}),
    "InferenceModeValidation": (lambda: InferenceModeValidation(), {}),
    "NonFiniteGuard": (lambda: NonFiniteGuard(action="skip"), {}),
    "SpikeGuard": (lambda: SpikeGuard(warmup_steps=2, action="skip"), {}),
    "SpikeRollback": (lambda: SpikeRollback(warmup_steps=2, snapshot_every_n_steps=2), {}),
    "StepsToSkip": (lambda: StepsToSkip(steps=[[1, 2]]), {}),
    "QKClip": (lambda: QKClip(threshold=50.0), {}),
    "SyncAudit": (lambda: SyncAudit(every_n_steps=2), {}),
    "UpdateClip": (lambda: UpdateClip(history_size=4, warmup_steps=2, modules="auto"), {}),
    "ZClip": (lambda: ZClip(warmup_steps=2, max_norm=1.0), {}),
}


def _exported_callbacks() -> set[str]:
    return set(exported_callbacks())


def _pickled(obj: Any) -> Any:
    return pickle.loads(pickle.dumps(obj))


def _torch_saved(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _assert_same(actual: Any, expected: Any, where: str = "state_dict", ignore: frozenset[str] = frozenset()) -> None:
    """Equal nested state, tensors compared bitwise (dtype and device included, NaN equal to NaN); dict entries
    named in ``ignore`` are left out."""
    assert type(actual) is type(expected), where
    if isinstance(expected, Tensor):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=where)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key in expected.keys() - ignore:
            _assert_same(actual[key], expected[key], f"{where}[{key!r}]", ignore)
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_same(a, e, f"{where}[{i}]", ignore)
    else:
        assert actual == expected, where


def _fit(tmp_path: Path, model: pl.LightningModule, callbacks: Callback | list[Callback], **kwargs: Any) -> pl.Trainer:
    torch.manual_seed(0)
    callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
    trainer = make_trainer(tmp_path, callbacks=callbacks, strategy="gradkit", limit_val_batches=2, **kwargs)
    trainer.fit(model, loader(), loader(n=16))
    return trainer


def test_every_exported_callback_is_covered() -> None:
    assert _exported_callbacks() == set(CASES)


def test_plain_lightning_trainer_pickles_and_deep_copies_after_fit(tmp_path: Path) -> None:
    """The reference the tests below hold gradkit to."""
    trainer = make_trainer(tmp_path, limit_val_batches=2)
    trainer.fit(MLPModule(), loader(), loader(n=16))
    assert isinstance(_torch_saved(trainer), pl.Trainer)
    assert isinstance(_pickled(trainer), pl.Trainer)
    assert isinstance(copy.deepcopy(trainer), pl.Trainer)


@pytest.mark.filterwarnings("ignore:QKClip found no attention module:UserWarning")  # the models have none
@pytest.mark.filterwarnings("ignore:EscalationLadder. no EarlyWarning or SpikeRollback:UserWarning")  # alone on purpose
@pytest.mark.parametrize("name", sorted(CASES))
def test_callback_and_its_trainer_pickle_and_deep_copy_before_and_after_fit(tmp_path: Path, name: str) -> None:
    make, trainer_kwargs = CASES[name]
    callback = make()
    for duplicate in (_pickled(callback), copy.deepcopy(callback)):
        _assert_same(duplicate.state_dict(), callback.state_dict())

    model = MLPModule()
    trainer = _fit(tmp_path / "first", model, callback, **trainer_kwargs)
    saved = _torch_saved(trainer)
    assert isinstance(_pickled(trainer), pl.Trainer) and isinstance(copy.deepcopy(trainer), pl.Trainer)
    (saved_callback,) = [cb for cb in saved.callbacks if type(cb) is type(callback)]
    duplicates = [saved_callback, _pickled(callback), copy.deepcopy(callback)]
    for duplicate in duplicates:
        _assert_same(duplicate.state_dict(), callback.state_dict())

    # A copy carries on as the original does: one more epoch each, on twin models, ends on equal parameters.
    twin = copy.deepcopy(model)
    _fit(tmp_path / "original", model, callback, **trainer_kwargs)
    _fit(tmp_path / "copy", twin, duplicates[1], **trainer_kwargs)
    for (key, expected), actual in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(actual, expected), key
    # SyncAudit's table adds up the wall-clock seconds of the audited steps, which differ from run to run.
    _assert_same(duplicates[1].state_dict(), callback.state_dict(), ignore=frozenset({"seconds"}))


class ManualZClipModule(MLPModule):
    """Manual optimization with gradkit's helpers kept on the module: a ManualAccumulator and a ZClip policy."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.accumulator = ManualAccumulator(window=2)
        self.clip = ZClip(warmup_steps=2)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        if self.accumulator.backward(self, nn.functional.mse_loss(self(x), y), batch_idx):
            clip_gradients(self, self.optimizers(), self.clip)
            self.accumulator.step(self.optimizers())


def test_manual_optimization_helpers_on_the_module_pickle_with_the_trainer(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, strategy="gradkit")
    model = ManualZClipModule()
    trainer.fit(model, loader())
    saved = _torch_saved(trainer).lightning_module
    _assert_same(saved.clip.state_dict(), model.clip.state_dict())
    assert isinstance(_pickled(trainer), pl.Trainer)
    # The copy trains on: its accumulator takes the (copied) module up at its next window end.
    twin = copy.deepcopy(model)
    for module in (model, twin):
        torch.manual_seed(0)
        make_trainer(tmp_path, strategy="gradkit").fit(module, loader())
    for (key, expected), actual in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(actual, expected), key


@pytest.mark.parametrize(
    "strategy",
    [
        lambda: GradKitSingleDeviceStrategy(),
        lambda: GradKitDDPStrategy(process_group_backend="gloo"),
        lambda: GradKitFSDPStrategy(),
        lambda: GradKitModelParallelStrategy(),
    ],
    ids=["single", "ddp", "fsdp", "model_parallel"],
)
def test_strategies_pickle_and_deep_copy_as_lightnings_own(strategy: Callable[[], pl.strategies.Strategy]) -> None:
    original = strategy()
    parent = next(c for c in type(original).__mro__[1:] if c.__module__.startswith("lightning."))
    for duplicate in (_pickled(original), copy.deepcopy(original)):
        assert type(duplicate) is type(original)
        assert isinstance(duplicate, parent)


# -- a clipper beside a skipping guard: the pipeline the guard keeps holds every policy's bound hooks ----------------
# The clippers, by their class's stage: a Trainer (and a loop) takes one at a time.
CLIPPERS = sorted(name for name, cls in exported_callbacks().items() if getattr(cls, "stage", None) is Stage.CLIP)


class NaNAtBatch(MLPModule):
    """A NaN loss at one batch: the guards skip that step, so the skip path has run before the Trainer is saved."""

    def __init__(self, nan_batch: int = 5) -> None:
        super().__init__()
        self.nan_batch = nan_batch

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx == self.nan_batch else loss


@pytest.mark.filterwarnings("ignore:QKClip found no attention module:UserWarning")  # the models have none
@pytest.mark.filterwarnings("ignore:NonFiniteGuard:UserWarning")  # the NaN step is planted
@pytest.mark.parametrize("clipper", CLIPPERS)
def test_fitted_trainer_with_a_clipper_and_every_other_callback_survives_torch_save_and_load(
    tmp_path: Path, clipper: str
) -> None:
    """Lightning's own ``test_model_torch_save`` on a Trainer that holds the clipper, a skipping guard and every
    other public callback (one fit for all), under ``strategy="gradkit"``; the reference is the fitted original."""
    callbacks = [make() for name, (make, _) in CASES.items() if name == clipper or name not in CLIPPERS]
    for callback in callbacks:
        for duplicate in (_pickled(callback), copy.deepcopy(callback)):
            _assert_same(duplicate.state_dict(), callback.state_dict())
    model = NaNAtBatch()
    trainer = _fit(tmp_path, model, callbacks, accumulate_grad_batches=2)
    guard = next(cb for cb in callbacks if isinstance(cb, NonFiniteGuard))
    # Two batches a step: step 1 (batches 2 and 3) dropped by StepsToSkip, the NaN step 2 skipped by the guards.
    assert guard.state_dict()["skipped_steps"] == 2.0

    path = tmp_path / "trainer.pt"
    torch.save(trainer.model, path)
    torch.save(trainer, path)
    loaded = torch.load(path, weights_only=False)
    for duplicate in (loaded, _pickled(trainer), copy.deepcopy(trainer)):
        assert type(duplicate.strategy) is type(trainer.strategy)
        for key, value in duplicate.lightning_module.state_dict().items():
            assert torch.equal(value, model.state_dict()[key]), key
        assert [type(cb) for cb in duplicate.callbacks] == [type(cb) for cb in trainer.callbacks]
        for copied, original in zip(duplicate.callbacks, trainer.callbacks, strict=True):
            _assert_same(copied.state_dict(), original.state_dict(), type(original).__name__)


# -- the torch policies behind the loop door -------------------------------------------------------------------------
# Each gradkit policy in its typical configuration; `WindowScale` is made by `ManualAccumulator` for one window only
# (the manual-optimization test above pickles the accumulator).
TORCH_CASES: dict[str, Callable[[], Policy]] = {
    "AdaptiveGradClip": lambda: gradkit.AdaptiveGradClip(clip_factor=0.01, exclude=["re:2"]),
    "AutoClip": lambda: gradkit.AutoClip(percentile=10.0, history_size=100),
    "ClipGradNorm": lambda: gradkit.ClipGradNorm(max_norm=0.1),
    "ClipGradValue": lambda: gradkit.ClipGradValue(clip_value=0.01),
    "EarlyWarning": lambda: gradkit.EarlyWarning(attention=None, output="2"),
    "EscalationLadder": lambda: gradkit.EscalationLadder(rungs=["warn", "lr_cut", "stop"]),
    "GradNormMonitor": lambda: TorchGradNormMonitor(param_groups=True, weight_norms=True, update_ratio=True),
    "NonFiniteGuard": lambda: TorchNonFiniteGuard(action="skip"),
    "SpikeGuard": lambda: TorchSpikeGuard(warmup_steps=2, action="skip"),
    "SpikeRollback": lambda: TorchSpikeRollback(warmup_steps=2, snapshot_every_n_steps=2),
    "StepsToSkip": lambda: gradkit.StepsToSkip(steps=[[1, 2]]),
    "QKClip": lambda: gradkit.QKClip(threshold=50.0),
    "UpdateClip": lambda: gradkit.UpdateClip(history_size=4, warmup_steps=2),
    "ZClip": lambda: gradkit.ZClip(warmup_steps=2, max_norm=1.0),
}
NOT_GIVEN_TO_A_LOOP = {"WindowScale"}


def _gradkit_policies() -> set[str]:
    """Every public policy class of every ``gradkit`` module (a class with a :class:`Stage`), found by walking the
    package and its subpackages, so that a new one fails :func:`test_every_torch_policy_is_covered` until it is added
    here."""
    found = set()
    for info in pkgutil.walk_packages(gradkit.__path__, "gradkit."):
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if inspect.isclass(obj) and isinstance(getattr(obj, "stage", None), Stage):
                found.add(name)
    return found


def _log_nowhere(metrics: dict[str, float], step: int) -> None:
    """The loop's ``log``: a module-level function, as a user's logger would be, so the loop itself pickles."""


def _state(policy: object) -> dict[str, Any]:
    state_dict = getattr(policy, "state_dict", None)
    return state_dict() if state_dict is not None else {}


def _loop(policies: list[Policy], model: nn.Module, tmp_path: Path, steps: range) -> None:
    """Train ``model`` behind the loop door with ``policies`` on a fixed batch, with a NaN loss at step 3 (the loop's
    step; a new loop counts its own steps from 0)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kit = GradKit(model, optimizer, policies, log=_log_nowhere, log_every_n_steps=2, log_dir=tmp_path)
    x = torch.linspace(-1.0, 1.0, 32).reshape(4, 8)
    for step in steps:
        if not kit.drops_batch:  # StepsToSkip's declared steps: no forward, no backward
            loss = model(x).pow(2).mean() * (float("nan") if step == 3 else 1.0)
            kit.note_loss(loss)
            loss.backward()
        kit.step(optimizer)
        optimizer.zero_grad()
    kit.finish()


def test_every_torch_policy_is_covered() -> None:
    assert _gradkit_policies() == set(TORCH_CASES) | NOT_GIVEN_TO_A_LOOP


@pytest.mark.filterwarnings("ignore:QKClip found no attention module:UserWarning")  # the models have none
@pytest.mark.filterwarnings("ignore:NonFiniteGuard:UserWarning")  # the NaN step is planted
@pytest.mark.parametrize("clipper", CLIPPERS)
def test_torch_policies_pickle_and_deep_copy_before_and_after_a_loop_door_run(tmp_path: Path, clipper: str) -> None:
    """The clipper and every other gradkit policy, in one loop: duplicates hold the original's state before and after
    the run, and a pickled copy of the fitted set carries on as the original does."""
    policies = [make() for name, make in TORCH_CASES.items() if name == clipper or name not in CLIPPERS]
    for policy in policies:
        for duplicate in (_pickled(policy), copy.deepcopy(policy)):
            _assert_same(_state(duplicate), _state(policy), type(policy).__name__)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    _loop(policies, model, tmp_path / "first", range(6))
    guard = next(p for p in policies if isinstance(p, TorchNonFiniteGuard))
    assert guard.state_dict()["skipped_steps"] == 2.0  # step 1 dropped (StepsToSkip), the NaN step 3 skipped
    pickled, deep = _pickled(policies), copy.deepcopy(policies)
    for duplicates in (pickled, deep):
        for copied, original in zip(duplicates, policies, strict=True):
            _assert_same(_state(copied), _state(original), type(original).__name__)

    twin = copy.deepcopy(model)
    _loop(policies, model, tmp_path / "original", range(6, 9))
    _loop(pickled, twin, tmp_path / "copy", range(6, 9))
    for (key, expected), actual in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(actual, expected), key
