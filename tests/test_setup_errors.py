"""A callback class given instead of an instance (``callbacks=[ZClip]``) fails with a message that names the fix."""

from __future__ import annotations

from pathlib import Path

import lightning
import pytest
from packaging.version import Version

from helpers import MLPModule, loader, make_trainer
from lightning_gradkit import GradNormMonitor, NonFiniteGuard, ZClip

FIX = "`callbacks=[ZClip()]`"

# Lightning before 2.6 refuses a class in `Trainer(callbacks=...)` itself (`ValueError: Expected a parent`, from
# `_validate_callbacks_list`), before any gradkit code runs; 2.6 passes `parent=Callback` there and lets it through.
pytestmark = pytest.mark.skipif(
    Version(lightning.__version__) < Version("2.6"), reason="Lightning < 2.6 refuses a callback class in Trainer()"
)


def test_callback_class_with_a_gradkit_strategy_names_the_instance_to_pass(tmp_path: Path) -> None:
    """Caught when the strategy connects, before Lightning calls any callback hook on the class."""
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[ZClip, NonFiniteGuard()])
    with pytest.raises(TypeError) as info:
        trainer.fit(MLPModule(), loader())
    message = str(info.value)
    assert "holds the class `ZClip`, not an instance" in message and FIX in message
    # Our error is the one raised: not replaced by Lightning calling the class's `on_exception` unbound.
    assert info.value.__context__ is None


def test_callback_class_after_a_gradkit_callback_is_caught_in_its_setup(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[GradNormMonitor(), ZClip, NonFiniteGuard])
    with pytest.raises(TypeError) as info:
        trainer.fit(MLPModule(), loader())
    message = str(info.value)
    assert "holds the classes `ZClip`, `NonFiniteGuard`" in message
    assert "`callbacks=[ZClip(), NonFiniteGuard()]`" in message
    assert info.value.__context__ is None
    assert all(not isinstance(cb, type) for cb in trainer.callbacks)
