"""gradkit: the gradient path of a training run in plain PyTorch; no Lightning is imported.

The step pipeline (measure -> reduce -> decide -> apply -> observe), the policies as torch objects and the loop door
:class:`~gradkit.loop.GradKit` for a Fabric or plain-PyTorch loop. The Lightning ``Trainer`` callbacks of the same
policies are in ``lightning_gradkit``, which ships beside this package.
"""

from __future__ import annotations

from gradkit.loop import GradKit
from gradkit.norms import GradStats
from gradkit.pipeline import StepPlan
from gradkit.protocol import Policy, Stage, StepContext

__all__ = ["GradKit", "GradStats", "Policy", "Stage", "StepContext", "StepPlan"]
