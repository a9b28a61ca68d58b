"""Set-up mistakes fail at once with a message that names the fix: a callback class given instead of an instance
(``callbacks=[ZClip]``), with or without a gradkit strategy, and the Hugging Face door installed twice."""

from __future__ import annotations

from pathlib import Path

import lightning
import pytest
from packaging.version import Version

from helpers import MLPModule, loader, make_trainer
from lightning_gradkit import GradNormMonitor, NonFiniteGuard, SyncAudit, ZClip

FIX = "`callbacks=[ZClip()]`"

# Lightning before 2.6 refuses a class in `Trainer(callbacks=...)` itself (`ValueError: Expected a parent`, from
# `_validate_callbacks_list`), before any gradkit code runs; 2.6 passes `parent=Callback` there and lets it through.
needs_lightning_26 = pytest.mark.skipif(
    Version(lightning.__version__) < Version("2.6"), reason="Lightning < 2.6 refuses a callback class in Trainer()"
)


@needs_lightning_26
def test_callback_class_with_a_gradkit_strategy_names_the_instance_to_pass(tmp_path: Path) -> None:
    """Caught when the strategy connects, before Lightning calls any callback hook on the class."""
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[ZClip, NonFiniteGuard()])
    with pytest.raises(TypeError) as info:
        trainer.fit(MLPModule(), loader())
    message = str(info.value)
    assert "holds the class `ZClip`, not an instance" in message and FIX in message
    # Our error is the one raised: not replaced by Lightning calling the class's `on_exception` unbound.
    assert info.value.__context__ is None


@needs_lightning_26
def test_callback_class_after_a_gradkit_callback_is_caught_in_its_setup(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[GradNormMonitor(), ZClip, NonFiniteGuard])
    with pytest.raises(TypeError) as info:
        trainer.fit(MLPModule(), loader())
    message = str(info.value)
    assert "holds the classes `ZClip`, `NonFiniteGuard`" in message
    assert "`callbacks=[ZClip(), NonFiniteGuard()]`" in message
    assert info.value.__context__ is None
    assert all(not isinstance(cb, type) for cb in trainer.callbacks)


@needs_lightning_26
@pytest.mark.parametrize(
    ("callbacks", "name"),
    [([ZClip], "ZClip"), ([ZClip, GradNormMonitor()], "ZClip"), ([SyncAudit, NonFiniteGuard()], "SyncAudit")],
    ids=["alone", "first", "a-plain-callback"],
)
def test_callback_class_without_a_gradkit_strategy_is_refused_at_its_own_setup(
    tmp_path: Path, callbacks: list[object], name: str
) -> None:
    """No gradkit strategy and no gradkit instance before it: the class's own `setup`, which Lightning calls first,
    refuses it (it used to fail as "on_exception() missing 1 required positional argument")."""
    trainer = make_trainer(tmp_path, callbacks=callbacks)
    with pytest.raises(TypeError) as info:
        trainer.fit(MLPModule(), loader())
    message = str(info.value)
    assert f"holds the class `{name}`, not an instance" in message and f"`callbacks=[{name}()]`" in message
    assert info.value.__context__ is None
    assert trainer.global_step == 0 and all(not isinstance(cb, type) for cb in trainer.callbacks)


def test_the_hugging_face_door_installed_twice_is_refused_naming_the_trainer_and_the_fix(tmp_path: Path) -> None:
    """A second door used to be accepted: both wrapped the Trainer, and the first warned at the end that no step went
    through `kit.step(optimizer)`."""
    transformers = pytest.importorskip("transformers")
    from gradkit.doors.huggingface import HFGradKit, install
    from hf_fixtures import MODELS, training_args

    trainer = transformers.Trainer(MODELS["norm"](), training_args(tmp_path))
    install(trainer, [GradNormMonitor(), NonFiniteGuard(action="skip")])
    with pytest.raises(ValueError, match=r"^`trainer` already has gradkit's door \(with GradNormMonitor, NonFinite"):
        install(trainer, [ZClip()])
    with pytest.raises(ValueError, match=r"Call `install\(trainer, \[...\]\)` once, with every policy in the list"):
        install(trainer, [])
    assert sum(isinstance(cb, HFGradKit) for cb in trainer.callback_handler.callbacks) == 1
