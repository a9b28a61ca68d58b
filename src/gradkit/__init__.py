"""gradkit: the gradient path of a training run in plain PyTorch; no Lightning is imported.

The step pipeline (measure -> reduce -> decide -> apply -> observe), the policies as plain torch objects and the
loop door :class:`~gradkit.loop.GradKit` for a Fabric or plain-PyTorch loop. The Lightning ``Trainer`` callbacks of
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

from gradkit.agc import AdaptiveGradClip
from gradkit.clipping import ClipGradNorm, ClipGradValue
from gradkit.early_warning import EarlyWarning
from gradkit.guards import NonFiniteGuard
from gradkit.history_clipping import AutoClip, ZClip
from gradkit.loop import GradKit
from gradkit.monitor import GradNormMonitor
from gradkit.norms import GradStats
from gradkit.pipeline import StepPlan
from gradkit.protocol import Policy, Stage, StepContext
from gradkit.qk_clip import QKClip
from gradkit.replicas import expert_parallel
from gradkit.rollback import SpikeRollback
from gradkit.spike_guard import SpikeGuard
from gradkit.steps_to_skip import StepsToSkip

__all__ = [
    "AdaptiveGradClip",
    "AutoClip",
    "ClipGradNorm",
    "ClipGradValue",
    "EarlyWarning",
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
    "StepPlan",
    "StepsToSkip",
    "ZClip",
    "expert_parallel",
]
