"""lightning_gradkit: Lightning callbacks and a strategy mixin for the gradient path of a training run.

Public API only; see DESIGN in the README for the architecture ("measure once, decide once, touch the gradients
once").

Importing the package imports no Lightning, so ``import lightning_gradkit.core`` (pure tensor code) works without
it:

- the public names below load on first access (``from lightning_gradkit import ZClip`` imports the clipping
  callbacks, and with them Lightning, then), or at once when Lightning is already imported (so LightningCLI
  resolves short class names such as ``class_path: ZClip``, which it looks up among imported classes);
- importing the package registers the strategy names ``"gradkit"``, ``"gradkit_ddp"``, ``"gradkit_ddp_spawn"``,
  ``"gradkit_fsdp"`` and ``"gradkit_model_parallel"`` with Lightning's ``StrategyRegistry``: at once when Lightning
  is already imported, else as soon as it is, in whichever order the two are imported. So
  ``import lightning_gradkit`` then ``Trainer(strategy="gradkit")``, and ``trainer.strategy: gradkit`` in a
  LightningCLI config that names a gradkit callback, work as they always did (see
  :mod:`lightning_gradkit._compat`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_gradkit import _compat

if TYPE_CHECKING:
    from lightning_gradkit.activation_checkpointing.callback import ActivationCheckpointing
    from lightning_gradkit.activation_checkpointing.injection import inject_activation_checkpointing
    from lightning_gradkit.callbacks.accumulation import AccumulationGuard, ManualAccumulator
    from lightning_gradkit.callbacks.clipping import (
        AdaptiveGradClip,
        AutoClip,
        ClipGradNorm,
        ClipGradValue,
        ZClip,
        clip_gradients,
    )
    from lightning_gradkit.callbacks.guards import NonFiniteGuard, SpikeGuard
    from lightning_gradkit.callbacks.monitor import GradNormMonitor
    from lightning_gradkit.callbacks.rollback import SpikeRollback
    from lightning_gradkit.callbacks.validation import InferenceModeValidation
    from lightning_gradkit.core.norms import GradStats
    from lightning_gradkit.core.pipeline import Policy, Stage, StepContext, StepPlan
    from lightning_gradkit.diagnostics.graph_leak import GraphLeakGuard
    from lightning_gradkit.diagnostics.sync_audit import SyncAudit
    from lightning_gradkit.engine import GradKitCallback
    from lightning_gradkit.loop import GradKit
    from lightning_gradkit.strategy import (
        GradKitDDPStrategy,
        GradKitFSDPStrategy,
        GradKitModelParallelStrategy,
        GradKitSingleDeviceStrategy,
        GradKitStrategyMixin,
    )
    from lightning_gradkit.strategy import (
        register_strategies as register_strategies,
    )

__version__ = "0.1.0.dev0"

# Public name: the module that defines it (imported on first access by `__getattr__`).
_SOURCES = {
    "AccumulationGuard": "callbacks.accumulation",
    "ActivationCheckpointing": "activation_checkpointing.callback",
    "AdaptiveGradClip": "callbacks.clipping",
    "AutoClip": "callbacks.clipping",
    "ClipGradNorm": "callbacks.clipping",
    "ClipGradValue": "callbacks.clipping",
    "GradKit": "loop",
    "GradKitCallback": "engine",
    "GradKitDDPStrategy": "strategy",
    "GradKitFSDPStrategy": "strategy",
    "GradKitModelParallelStrategy": "strategy",
    "GradKitSingleDeviceStrategy": "strategy",
    "GradKitStrategyMixin": "strategy",
    "GradNormMonitor": "callbacks.monitor",
    "GradStats": "core.norms",
    "GraphLeakGuard": "diagnostics.graph_leak",
    "InferenceModeValidation": "callbacks.validation",
    "ManualAccumulator": "callbacks.accumulation",
    "NonFiniteGuard": "callbacks.guards",
    "Policy": "core.pipeline",
    "SpikeGuard": "callbacks.guards",
    "SpikeRollback": "callbacks.rollback",
    "Stage": "core.pipeline",
    "StepContext": "core.pipeline",
    "StepPlan": "core.pipeline",
    "SyncAudit": "diagnostics.sync_audit",
    "ZClip": "callbacks.clipping",
    "clip_gradients": "callbacks.clipping",
    "inject_activation_checkpointing": "activation_checkpointing.injection",
    "register_strategies": "strategy",  # importable as before, not in `__all__`
}

__all__ = [
    "AccumulationGuard",
    "ActivationCheckpointing",
    "AdaptiveGradClip",
    "AutoClip",
    "ClipGradNorm",
    "ClipGradValue",
    "GradKit",
    "GradKitCallback",
    "GradKitDDPStrategy",
    "GradKitFSDPStrategy",
    "GradKitModelParallelStrategy",
    "GradKitSingleDeviceStrategy",
    "GradKitStrategyMixin",
    "GradNormMonitor",
    "GradStats",
    "GraphLeakGuard",
    "InferenceModeValidation",
    "ManualAccumulator",
    "NonFiniteGuard",
    "Policy",
    "SpikeGuard",
    "SpikeRollback",
    "Stage",
    "StepContext",
    "StepPlan",
    "SyncAudit",
    "ZClip",
    "clip_gradients",
    "inject_activation_checkpointing",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access (PEP 562) and keep the name in the package namespace."""
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{source}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


_compat.register_when_lightning_loads()
if _compat.lightning_loaded():
    # Lightning is there anyway: load every public class now, so LightningCLI (jsonargparse) resolves short class
    # names in configs (`class_path: ZClip`, `--trainer.callbacks+=GradNormMonitor`) as it did before the lazy
    # package: it finds them among the imported subclasses of `Callback`.
    for _name in __all__:
        __getattr__(_name)
