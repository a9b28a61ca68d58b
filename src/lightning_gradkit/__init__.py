"""lightning_gradkit: Lightning callbacks and a strategy mixin for the gradient path of a training run.

Public API only; see DESIGN in the README for the architecture ("measure once, decide once, touch the gradients
once"). Importing the package registers the strategy names ``"gradkit"``, ``"gradkit_ddp"``,
``"gradkit_ddp_spawn"``, ``"gradkit_fsdp"`` and ``"gradkit_model_parallel"`` with Lightning.
"""

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
from lightning_gradkit.diagnostics.graph_leak import GraphLeakGuard
from lightning_gradkit.diagnostics.sync_audit import SyncAudit
from lightning_gradkit.strategy import (
    GradKitDDPStrategy,
    GradKitFSDPStrategy,
    GradKitModelParallelStrategy,
    GradKitSingleDeviceStrategy,
    GradKitStrategyMixin,
    register_strategies,
)

register_strategies()

__version__ = "0.1.0.dev0"

__all__ = [
    "AccumulationGuard",
    "ActivationCheckpointing",
    "AdaptiveGradClip",
    "AutoClip",
    "ClipGradNorm",
    "ClipGradValue",
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
    "SpikeGuard",
    "SpikeRollback",
    "SyncAudit",
    "ZClip",
    "clip_gradients",
    "inject_activation_checkpointing",
]
