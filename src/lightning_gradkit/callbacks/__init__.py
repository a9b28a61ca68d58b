"""Lightning callbacks of lightning_gradkit, one per file."""

from lightning_gradkit.callbacks.accumulation import AccumulationGuard
from lightning_gradkit.callbacks.checkpointing import ActivationCheckpointing
from lightning_gradkit.callbacks.clipping import (
    AdaptiveGradClip,
    AutoClip,
    ClipGradNorm,
    ClipGradValue,
    ZClip,
    clip_gradients,
)
from lightning_gradkit.callbacks.graph_leak import GraphLeakGuard
from lightning_gradkit.callbacks.guards import NonFiniteGuard, SpikeGuard
from lightning_gradkit.callbacks.monitor import GradNormMonitor
from lightning_gradkit.callbacks.rollback import SpikeRollback
from lightning_gradkit.callbacks.sync_audit import SyncAudit
from lightning_gradkit.callbacks.validation import InferenceModeValidation

__all__ = [
    "AccumulationGuard",
    "ActivationCheckpointing",
    "AdaptiveGradClip",
    "AutoClip",
    "ClipGradNorm",
    "ClipGradValue",
    "GradNormMonitor",
    "GraphLeakGuard",
    "InferenceModeValidation",
    "NonFiniteGuard",
    "SpikeGuard",
    "SpikeRollback",
    "SyncAudit",
    "ZClip",
    "clip_gradients",
]
