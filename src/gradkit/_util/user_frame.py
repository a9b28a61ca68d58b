"""Warnings that point at the user's line: the first frame outside gradkit, Lightning, torch and HF's Trainer.

``warnings.warn(message, stacklevel=3)`` from inside a policy names a gradkit file (``.../engine.py:198:``), which
tells a user nothing: the policy runs three to twenty frames below the user's ``trainer.fit(...)``,
``kit.step(optimizer)`` or ``cli = LightningCLI(...)`` line, depending on the door and the hook. :func:`warn_user`
counts the frames up to the first one whose file lies outside these packages, so the warning names that line
(Python 3.12's ``skip_file_prefixes`` does the same; the package supports 3.10).
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings
from pathlib import Path

__all__ = ["user_stacklevel", "warn_user"]

# The packages whose frames sit between the user's line and a gradkit warning: gradkit and its Lightning adapters,
# Lightning (the Trainer's loops, Fabric's wrappers, LightningCLI), torch (an optimizer step hook, a module hook), and
# Hugging Face's Trainer and accelerate (the HF door's steps run inside `Trainer.train`): a warning names the user's
# `trainer.train()` line, or a method of the user's own Trainer subclass when the warning comes from inside it.
_GRADKIT_ROOT = Path(__file__).resolve().parents[1]  # this file is gradkit/_util/user_frame.py
_INTERNAL_PACKAGES = (
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "lightning_utilities",
    "torch",
    "transformers",
    "accelerate",
)


def _internal_prefixes() -> tuple[str, ...]:
    """The directories of the packages above (those imported so far: a package never imported has no frame)."""
    roots = [_GRADKIT_ROOT, _GRADKIT_ROOT.parent / "lightning_gradkit"]
    for name in _INTERNAL_PACKAGES:
        module = sys.modules.get(name)
        origin = getattr(module, "__file__", None)
        if origin:
            roots.append(Path(origin).resolve().parent)
    return tuple(str(root) + os.sep for root in roots)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` call in the caller of this function name the first frame
    outside gradkit, Lightning and torch; the caller's caller when every frame is inside them."""
    prefixes = _internal_prefixes()
    here = inspect.currentframe()
    frame = here.f_back if here is not None else None  # the caller: stacklevel 1
    level = 1
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (os.path.isabs(filename) and os.path.realpath(filename).startswith(prefixes)):
            return level
        frame = frame.f_back
        level += 1
    return 2


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` at the user's line (see :func:`user_stacklevel`)."""
    warnings.warn(message, category, stacklevel=user_stacklevel())
