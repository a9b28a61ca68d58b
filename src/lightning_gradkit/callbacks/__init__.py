"""Every Lightning callback of lightning_gradkit, importable from one place.

The gradient-path callbacks live here, one module per job: ``monitor`` (norm logging), ``clipping`` (the five
clippers and :func:`clip_gradients`), ``guard_callbacks`` (non-finite values and spikes), ``rollback``,
``accumulation`` (:class:`AccumulationGuard` and :class:`~lightning_gradkit.ManualAccumulator`) and ``validation``
(inference-mode validation). The diagnostics' callbacks live in :mod:`lightning_gradkit.diagnostics` and activation
checkpointing's in :mod:`lightning_gradkit.activation_checkpointing`; they are re-exported here.
"""

from lightning_gradkit.activation_checkpointing.callback import ActivationCheckpointing
from lightning_gradkit.callbacks.accumulation import AccumulationGuard
from lightning_gradkit.callbacks.clipping import (
    AdaptiveGradClip,
    AutoClip,
    ClipGradNorm,
    ClipGradValue,
    ZClip,
    clip_gradients,
)
from lightning_gradkit.callbacks.guard_callbacks import NonFiniteGuard, SpikeGuard
from lightning_gradkit.callbacks.monitor import GradNormMonitor
from lightning_gradkit.callbacks.rollback import SpikeRollback
from lightning_gradkit.callbacks.validation import InferenceModeValidation
from lightning_gradkit.diagnostics.graph_leak import GraphLeakGuard
from lightning_gradkit.diagnostics.sync_audit import SyncAudit

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
