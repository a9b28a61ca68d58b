"""lightning_gradkit: Lightning callbacks and a strategy mixin for the gradient path of a training run.

Public API only; see docs/architecture.md ("measure once, decide once, touch the gradients once").

Two import roots ship together:

- :mod:`gradkit`, torch only: the step pipeline, the policies as plain torch objects and the Fabric / plain-PyTorch
  door (:class:`~gradkit.GradKit`). ``import gradkit`` loads no Lightning.
- ``lightning_gradkit`` (this package), the Lightning layer: the policies as ``Trainer`` callbacks (thin adapters
  with the names, arguments and checkpoint keys users know), the strategies and the Trainer-only callbacks. It
  imports Lightning, and registers the strategy names ``"gradkit"``, ``"gradkit_ddp"``, ``"gradkit_ddp_spawn"``,
  ``"gradkit_fsdp"`` and ``"gradkit_model_parallel"`` with Lightning's ``StrategyRegistry``.
"""

from __future__ import annotations

from gradkit._util.moved import step_plan_moved as _step_plan_moved
from gradkit.doors.loop import GradKit
from gradkit.policies.ladder import TrainingStopped
from gradkit.step.norms import GradStats
from gradkit.step.plan import Decision, StepOutcome, StepStats
from gradkit.step.protocol import Policy, Stage, StepContext
from gradkit.step.replicas import expert_parallel
from lightning_gradkit._compat import register_strategy_names
from lightning_gradkit.activation_checkpointing.callback import ActivationCheckpointing
from lightning_gradkit.activation_checkpointing.injection import inject_activation_checkpointing
from lightning_gradkit.callbacks.accumulation import AccumulationGuard
from lightning_gradkit.callbacks.checkpoint_guard import CheckpointGuard
from lightning_gradkit.callbacks.clip_callbacks import (
    AdaptiveGradClip,
    AutoClip,
    ClipGradNorm,
    ClipGradValue,
    ZClip,
    clip_gradients,
)
from lightning_gradkit.callbacks.guard_callbacks import NonFiniteGuard, SpikeGuard
from lightning_gradkit.callbacks.manual_accumulation import ManualAccumulator
from lightning_gradkit.callbacks.monitor_callback import GradNormMonitor
from lightning_gradkit.callbacks.rollback_callback import SpikeRollback
from lightning_gradkit.callbacks.validation import InferenceModeValidation
from lightning_gradkit.callbacks.warning_callbacks import (
    EarlyWarning,
    EscalationLadder,
    QKClip,
    StepsToSkip,
    UpdateClip,
)
from lightning_gradkit.diagnostics.graph_leak import GraphLeakGuard
from lightning_gradkit.diagnostics.sync_audit import SyncAudit
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
from lightning_gradkit.trainer_door import GradKitCallback

__version__ = "0.1.0.dev0"

__all__ = [
    "AccumulationGuard",
    "ActivationCheckpointing",
    "AdaptiveGradClip",
    "AutoClip",
    "CheckpointGuard",
    "ClipGradNorm",
    "ClipGradValue",
    "Decision",
    "EarlyWarning",
    "EscalationLadder",
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
    "QKClip",
    "SpikeGuard",
    "SpikeRollback",
    "Stage",
    "StepContext",
    "StepOutcome",
    "StepStats",
    "StepsToSkip",
    "SyncAudit",
    "TrainingStopped",
    "UpdateClip",
    "ZClip",
    "clip_gradients",
    "expert_parallel",
    "inject_activation_checkpointing",
]

register_strategy_names()


def __getattr__(name: str) -> object:
    if name == "StepPlan":  # for one release: the plan was split in `StepStats` and `Decision`
        return _step_plan_moved(__name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
