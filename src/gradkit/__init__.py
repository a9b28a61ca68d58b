"""gradkit: the gradient path of a training run in plain PyTorch; no Lightning is imported.

The step pipeline (measure -> reduce -> decide -> apply -> observe), the policies as plain torch objects and the
loop door :class:`~gradkit.GradKit` for a Fabric or plain-PyTorch loop. The Lightning ``Trainer`` callbacks of
the same policies (same names, same arguments, same checkpoint keys) are in ``lightning_gradkit``, which ships beside
this package.

Example::

    >>> import torch
    >>> import gradkit
    >>> model = torch.nn.Linear(4, 1)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with gradkit.GradKit(model, optimizer, [gradkit.ClipGradNorm(1.0)], log_every_n_steps=0) as kit:
    ...     model(torch.ones(2, 4)).sum().backward()
    ...     kit.step(optimizer)
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gradkit._util.moved import register as _register_moved
from gradkit._util.moved import step_plan_moved as _step_plan_moved
from gradkit.doors.loop import GradKit
from gradkit.policies.agc import AdaptiveGradClip
from gradkit.policies.clipping import ClipGradNorm, ClipGradValue
from gradkit.policies.early_warning import EarlyWarning
from gradkit.policies.guards import NonFiniteGuard
from gradkit.policies.history_clipping import AutoClip, ZClip
from gradkit.policies.ladder import EscalationLadder, TrainingStopped
from gradkit.policies.monitor import GradNormMonitor
from gradkit.policies.qk_clip import QKClip
from gradkit.policies.rollback import SpikeRollback
from gradkit.policies.spike_guard import SpikeGuard
from gradkit.policies.steps_to_skip import StepsToSkip
from gradkit.policies.update_clip import UpdateClip
from gradkit.step.norms import GradStats
from gradkit.step.plan import Decision, StepOutcome, StepStats
from gradkit.step.pp_stages import pipeline_parallel
from gradkit.step.protocol import Policy, Stage, StepContext
from gradkit.step.replicas import expert_parallel
from gradkit.step.state_check import FiniteCheck, checkpoint_is_finite

if TYPE_CHECKING:
    from transformers import Trainer

    from gradkit.doors.huggingface import HFGradKit

__all__ = [
    "AdaptiveGradClip",
    "AutoClip",
    "ClipGradNorm",
    "ClipGradValue",
    "Decision",
    "EarlyWarning",
    "EscalationLadder",
    "FiniteCheck",
    "GradKit",
    "GradNormMonitor",
    "GradStats",
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
    "TrainingStopped",
    "UpdateClip",
    "ZClip",
    "checkpoint_is_finite",
    "expert_parallel",
    "install",
    "pipeline_parallel",
]


def install(
    trainer: Trainer, policies: Policy | Sequence[Policy], *, events: bool = True, check_checkpoints: bool = True
) -> HFGradKit:
    """The Hugging Face ``transformers.Trainer`` door: :func:`gradkit.doors.huggingface.install` (which needs
    ``transformers``; importing :mod:`gradkit` does not load it)."""
    from gradkit.doors.huggingface import install as install_hf

    return install_hf(trainer, policies, events=events, check_checkpoints=check_checkpoints)


def __getattr__(name: str) -> object:
    if name == "StepPlan":  # for one release: the plan was split in `StepStats` and `Decision`
        return _step_plan_moved(__name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_register_moved(__name__)
