"""InferenceModeValidation with Lightning's real Trainer: the grad mode inside validation, module modes, inference
tensors left on modules, non-finite metrics."""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy
from torch import Tensor, nn

from gradkit.report.events import EVENTS_FILENAME as EVENTS_FILE
from helpers import MLPModule, loader, make_trainer
from lightning_gradkit import InferenceModeValidation
from lightning_gradkit.callbacks.validation import find_inference_tensors, inference_mode_unsafe_reason


class ModeRecorder(MLPModule):
    """Records the grad mode and module modes seen inside ``validation_step`` and at each training batch start."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Dropout(0.5).eval()  # a submodule the user keeps in eval mode during training
        self.seen: list[dict[str, bool]] = []
        self.train_modes: list[tuple[bool, bool]] = []

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.seen.append(
            {
                "sanity": self.trainer.sanity_checking,
                "inference": torch.is_inference_mode_enabled(),
                "grad": torch.is_grad_enabled(),
                "output_is_inference": loss.is_inference(),
                "all_eval": not any(m.training for m in self.modules()),
            }
        )
        self.log("val_loss", loss)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.train_modes.append((self.training, self.frozen.training))


# Lightning warns about ModeRecorder's `frozen` submodule, kept in eval mode on purpose.
FROZEN_IN_EVAL = pytest.mark.filterwarnings(r"ignore:Found 1 module\(s\) in eval mode at the start of training")


def fit_recorder(tmp_path: Path, callbacks: list[pl.Callback]) -> ModeRecorder:
    model = ModeRecorder()
    trainer = make_trainer(
        tmp_path, max_epochs=2, num_sanity_val_steps=2, limit_val_batches=2, val_check_interval=4, callbacks=callbacks
    )
    trainer.fit(model, loader(n=64), loader(n=32))
    return model


@FROZEN_IN_EVAL
def test_validation_step_runs_under_inference_mode_during_fit(tmp_path: Path) -> None:
    model = fit_recorder(tmp_path, [InferenceModeValidation()])
    assert [s["sanity"] for s in model.seen[:2]] == [True, True]
    assert len(model.seen) == 2 + 2 * 2 * 2  # sanity + 2 validations per epoch x 2 epochs x 2 batches
    assert all(s["inference"] and not s["grad"] and s["output_is_inference"] for s in model.seen)

    # Control: Lightning alone validates inside fit under no_grad, not inference mode.
    plain = fit_recorder(tmp_path, [])
    assert all(not s["inference"] and not s["grad"] and not s["output_is_inference"] for s in plain.seen)


@FROZEN_IN_EVAL
def test_model_is_in_eval_inside_and_modes_restored_after(tmp_path: Path) -> None:
    model = fit_recorder(tmp_path, [InferenceModeValidation()])
    assert all(s["all_eval"] for s in model.seen)
    # Every training batch (including those right after a validation) sees train mode, and the submodule the
    # user froze in eval mode stays in eval mode.
    assert len(model.train_modes) == 16
    assert set(model.train_modes) == {(True, False)}


@FROZEN_IN_EVAL
def test_fit_restores_lightning_validation_mode_afterwards(tmp_path: Path) -> None:
    model = ModeRecorder()
    trainer = make_trainer(tmp_path, limit_val_batches=1, callbacks=[InferenceModeValidation()])
    trainer.fit(model, loader(n=16), loader(n=8))
    assert [s["inference"] for s in model.seen] == [True]
    assert trainer.fit_loop.epoch_loop.val_loop.inference_mode is False


class CachingModule(MLPModule):
    """Caches tensors during validation (a reassigned buffer, a list and a dict attribute) and uses them in
    training in ops that save them for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(1))
        self.history: list[Tensor] = []
        self.cache: dict[str, Tensor] = {}

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        features = torch.tanh(self.encoder(x))
        self.scale = 1.0 + 0.1 * features.abs().mean().reshape(1)
        self.history.append(features.mean(0))
        self.cache["center"] = features.mean(0)
        self.cache["alias"] = self.cache["center"]
        self.log("val_loss", nn.functional.mse_loss(self.head(features), y))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        features = torch.tanh(self.encoder(x))
        if self.cache:
            features = features * self.cache["center"]  # saves the cached tensor for backward
        return nn.functional.mse_loss(self.head(features) * self.scale, y)


def caching_trainer(tmp_path: Path, callbacks: list[pl.Callback]) -> pl.Trainer:
    return make_trainer(tmp_path, max_epochs=2, num_sanity_val_steps=1, limit_val_batches=2, callbacks=callbacks)


def test_tensors_cached_in_validation_are_usable_by_training(tmp_path: Path) -> None:
    model = CachingModule()
    trainer = caching_trainer(tmp_path, [InferenceModeValidation()])
    trainer.fit(model, loader(n=32), loader(n=16))
    assert trainer.global_step == 8
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # The caches were made by inference-mode validation and then replaced by normal tensors (aliases kept).
    assert len(model.history) == 1 + 2 * 2
    assert not model.scale.is_inference() and not model.history[0].is_inference()
    assert model.cache["alias"] is model.cache["center"]


def test_control_inference_mode_validation_without_repair_crashes_training(tmp_path: Path) -> None:
    # What a bare switch to inference mode does: the first training step after the sanity check fails.
    trainer = caching_trainer(tmp_path, [])
    trainer.fit_loop.epoch_loop.val_loop.inference_mode = True
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        trainer.fit(CachingModule(), loader(n=32), loader(n=16))


def test_trainer_validate_before_fit_leaves_caches_that_the_callback_repairs(tmp_path: Path) -> None:
    model = CachingModule()
    make_trainer(tmp_path, limit_val_batches=1).validate(model, loader(n=16))  # Lightning: inference mode
    assert model.cache["center"].is_inference()
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        make_trainer(tmp_path, limit_val_batches=0).fit(model, loader(n=16))

    model = CachingModule()
    make_trainer(tmp_path, limit_val_batches=1).validate(model, loader(n=16))
    trainer = make_trainer(tmp_path, limit_val_batches=0, callbacks=[InferenceModeValidation()])
    trainer.fit(model, loader(n=16))
    assert trainer.global_step == 2


def test_on_inference_tensors_raise_names_them(tmp_path: Path) -> None:
    trainer = caching_trainer(tmp_path, [InferenceModeValidation(on_inference_tensors="raise")])
    with pytest.raises(
        RuntimeError, match=r"left inference tensors on the model: scale, history\[0\], cache\['center'\]"
    ):
        trainer.fit(CachingModule(), loader(n=32), loader(n=16))


def test_parameter_replaced_during_validation_raises(tmp_path: Path) -> None:
    class ReplacesBias(MLPModule):
        def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
            self.head.bias = nn.Parameter(self.head.bias.detach().clone())

    trainer = caching_trainer(tmp_path, [InferenceModeValidation()])
    with pytest.raises(RuntimeError, match=r"parameter\(s\) head\.bias were replaced during validation"):
        trainer.fit(ReplacesBias(), loader(n=32), loader(n=16))


def test_find_inference_tensors_walks_nested_containers() -> None:
    module = nn.Sequential(nn.Linear(2, 2))
    with torch.inference_mode():
        inner = torch.ones(2)
    module[0].state = ([inner, torch.zeros(1)], {"k": (inner,)})
    module[0].register_buffer("buf", inner)
    params, found = find_inference_tensors(module, clone=False)
    assert params == []
    assert sorted(found) == ["0.buf", "0.state[0][0]", "0.state[1]['k'][0]"]
    assert find_inference_tensors(module, clone=True)[1] == found
    assert find_inference_tensors(module)[1] == []
    state = module[0].state
    assert state[0][0] is state[1]["k"][0] is module[0].buf  # one clone per tensor: aliases survive


class _Cache:
    """A plain Python object the model keeps its cache in."""

    def __init__(self) -> None:
        self.center: Tensor | None = None


@dataclass(slots=True)
class _SlottedStats:
    scale: Tensor


class ObjectCaching(MLPModule):
    """Caches tensors during validation on plain Python objects (one with a ``__dict__``, one with ``__slots__``) and
    uses them in training in ops that save them for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = _Cache()
        self.stats = _SlottedStats(torch.ones(1))

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        features = torch.tanh(self.encoder(batch[0]))
        self.cache.center = features.mean(0)
        self.stats.scale = 1.0 + 0.1 * features.abs().mean().reshape(1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        features = torch.tanh(self.encoder(x))
        if self.cache.center is not None:
            features = features * self.cache.center
        return nn.functional.mse_loss(self.head(features) * self.stats.scale, y)


def test_tensors_cached_on_plain_objects_are_repaired_and_training_matches_plain_lightning(tmp_path: Path) -> None:
    states = {}
    for name, callbacks in (("plain", []), ("inference", [InferenceModeValidation()])):
        torch.manual_seed(0)
        model = ObjectCaching()
        trainer = caching_trainer(tmp_path / name, callbacks)
        trainer.fit(model, loader(n=32), loader(n=16))
        assert trainer.global_step == 8
        states[name] = model.state_dict()
        assert not model.cache.center.is_inference() and not model.stats.scale.is_inference()
    for key, expected in states["plain"].items():
        assert torch.equal(states["inference"][key], expected), key


@functools.lru_cache(maxsize=8)
def _positions(n: int) -> Tensor:
    return torch.linspace(0.5, 1.5, n)


@functools.cache
def _unbounded_positions(n: int) -> Tensor:
    return torch.linspace(0.5, 1.5, n)


_TABLES: dict[str, Tensor] = {}


def _table(n: int) -> Tensor:
    if "positions" not in _TABLES:
        _TABLES["positions"] = torch.linspace(0.5, 1.5, n)
    return _TABLES["positions"]


class ModuleLevelCaching(MLPModule):
    """Gets a tensor from a cache outside the model (an ``lru_cache`` function or a module global), first called in
    validation, and uses it in training in an op that saves it for backward."""

    def __init__(self, cached: Callable[[int], Tensor]) -> None:
        super().__init__()
        self.cached = cached

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.cached(16)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(torch.tanh(self.encoder(x)) * self.cached(16)), y)


@pytest.fixture
def empty_module_caches() -> Iterator[None]:
    _empty_module_caches()
    yield
    _empty_module_caches()


def _empty_module_caches() -> None:
    _positions.cache_clear()
    _unbounded_positions.cache_clear()
    _TABLES.clear()


@pytest.mark.usefixtures("empty_module_caches")
@pytest.mark.parametrize(
    ("cached", "owner", "fix"),
    [
        (_positions, f"the lru_cache of {__name__}._positions", "_positions.cache_clear()"),
        (
            _unbounded_positions,
            f"the lru_cache of {__name__}._unbounded_positions",
            "_unbounded_positions.cache_clear()",
        ),
        (_table, f"the global {__name__}._TABLES['positions']", "torch.inference_mode(False)"),
    ],
    ids=["lru_cache", "cache", "module_global"],
)
def test_tensor_cached_outside_the_model_is_named_in_the_training_error(
    tmp_path: Path, cached: Callable[[int], Tensor], owner: str, fix: str
) -> None:
    # Plain Lightning validates under no_grad: the cached tensor is a normal one and training runs.
    trainer = caching_trainer(tmp_path / "plain", [])
    trainer.fit(ModuleLevelCaching(cached), loader(n=32), loader(n=16))
    assert trainer.global_step == 8

    _empty_module_caches()
    trainer = caching_trainer(tmp_path / "inference", [InferenceModeValidation()])
    with pytest.raises(RuntimeError) as error, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(ModuleLevelCaching(cached), loader(n=32), loader(n=16))
    # The search walks every object: none of them warns (torch's `reduce_op` warns on any attribute read).
    assert not [str(w.message) for w in caught if "torch.distributed" in str(w.message)]
    message = str(error.value)
    assert message.startswith("Inference tensors cannot be saved for backward")  # torch's error, kept
    assert f"Inference tensors are kept by: {owner}." in message
    assert "created under `torch.inference_mode`" in message and fix in message
    assert trainer.global_step == 0  # the first training step, right after the sanity check


class NaNValidation(MLPModule):
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        bad = loss * float("nan") if self.current_epoch == 1 else loss
        self.log("val_loss", bad)
        self.log("val_ok", loss)


def test_non_finite_validation_metric_is_reported(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, max_epochs=2, limit_val_batches=2, callbacks=[InferenceModeValidation()])
    with pytest.warns(
        UserWarning, match=r"non-finite validation metric\(s\) in epoch 1 \(global step 8\): val_loss=nan"
    ):
        trainer.fit(NaNValidation(), loader(n=32), loader(n=16))
    lines = (Path(trainer.logger.log_dir) / EVENTS_FILE).read_text().splitlines()
    events = [json.loads(line) for line in lines]
    assert len(events) == 1
    event = events[0]
    assert (event["what"], event["step"], event["epoch"], event["sanity_check"]) == (
        "validation_non_finite",
        8,
        1,
        False,
    )
    assert event["values"] == {"val_loss": "nan"}


def test_non_finite_metric_in_sanity_check_is_reported(tmp_path: Path) -> None:
    class NaNAtStart(NaNValidation):
        def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
            self.log("val_loss", torch.tensor(float("inf")))

    trainer = make_trainer(tmp_path, num_sanity_val_steps=1, limit_val_batches=1, callbacks=[InferenceModeValidation()])
    with (
        pytest.warns(UserWarning, match=r"in the sanity check .*val_loss=inf"),
        pytest.warns(UserWarning, match=r"in epoch 0 \(global step 2\): val_loss=inf"),
    ):
        trainer.fit(NaNAtStart(), loader(n=16), loader(n=16))


def test_unsafe_setups_are_named() -> None:
    cpu = CPUAccelerator()
    assert "FSDP1" in inference_mode_unsafe_reason(FSDPStrategy(), cpu, MLPModule())
    assert inference_mode_unsafe_reason(SingleDeviceStrategy("cpu"), cpu, MLPModule()) is None
    assert inference_mode_unsafe_reason(DDPStrategy(), cpu, MLPModule()) is None  # no gloo group initialized


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fallback": "ignore"}, r"`fallback` must be one of \['no_grad', 'raise'\], got 'ignore'"),
        ({"on_inference_tensors": "keep"}, r"`on_inference_tensors` must be one of \['clone', 'raise'\]"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        InferenceModeValidation(**kwargs)
