"""Every public callback, and the Trainer holding it, pickles and deep-copies before and after ``fit``, as plain
Lightning's Trainer does (``torch.save(trainer)``), and a copy carries on exactly as the original."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from helpers import MLPModule, exported_callbacks, loader, make_trainer
from lightning_gradkit import (
    AccumulationGuard,
    ActivationCheckpointing,
    AdaptiveGradClip,
    AutoClip,
    ClipGradNorm,
    ClipGradValue,
    EarlyWarning,
    GradKitDDPStrategy,
    GradKitFSDPStrategy,
    GradKitModelParallelStrategy,
    GradKitSingleDeviceStrategy,
    GradNormMonitor,
    GraphLeakGuard,
    InferenceModeValidation,
    ManualAccumulator,
    NonFiniteGuard,
    SpikeGuard,
    SpikeRollback,
    StepsToSkip,
    SyncAudit,
    ZClip,
    clip_gradients,
)

# Each exported callback in its typical configuration, with the Trainer arguments it is typically used with.
CASES: dict[str, tuple[Callable[[], Callback], dict[str, Any]]] = {
    "AccumulationGuard": (lambda: AccumulationGuard(), {"accumulate_grad_batches": 2}),
    "ActivationCheckpointing": (lambda: ActivationCheckpointing(["Linear"]), {}),
    "AdaptiveGradClip": (lambda: AdaptiveGradClip(clip_factor=0.01, exclude=["re:head"]), {}),
    "AutoClip": (lambda: AutoClip(percentile=10.0, history_size=100), {}),
    "ClipGradNorm": (lambda: ClipGradNorm(max_norm=0.1), {}),
    "ClipGradValue": (lambda: ClipGradValue(clip_value=0.01), {}),
    "EarlyWarning": (lambda: EarlyWarning(attention=None, output="head"), {}),
    "GradNormMonitor": (lambda: GradNormMonitor(param_groups=True, weight_norms=True, prog_bar=True), {}),
    "GraphLeakGuard": (lambda: GraphLeakGuard(check_every_n_steps=2), {}),
    "InferenceModeValidation": (lambda: InferenceModeValidation(), {}),
    "NonFiniteGuard": (lambda: NonFiniteGuard(action="skip"), {}),
    "SpikeGuard": (lambda: SpikeGuard(warmup_steps=2, action="skip"), {}),
    "SpikeRollback": (lambda: SpikeRollback(warmup_steps=2, snapshot_every_n_steps=2), {}),
    "StepsToSkip": (lambda: StepsToSkip(steps=[[1, 2]]), {}),
    "SyncAudit": (lambda: SyncAudit(every_n_steps=2), {}),
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


def _fit(tmp_path: Path, model: pl.LightningModule, callback: Callback, **kwargs: Any) -> pl.Trainer:
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, callbacks=[callback], strategy="gradkit", limit_val_batches=2, **kwargs)
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
