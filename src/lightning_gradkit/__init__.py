"""lightning_gradkit: Lightning callbacks and a strategy mixin for the gradient path of a training run.

Public API only; see DESIGN in the README for the architecture ("measure once, decide once, touch the gradients
once").
"""

from lightning_gradkit.callbacks.clipping import (
    AdaptiveGradClip,
    AutoClip,
    ClipGradNorm,
    ClipGradValue,
    ZClip,
    clip_gradients,
)
from lightning_gradkit.callbacks.monitor import GradNormMonitor
from lightning_gradkit.stats import GradStats

__version__ = "0.1.0.dev0"

__all__ = [
    "AdaptiveGradClip",
    "AutoClip",
    "ClipGradNorm",
    "ClipGradValue",
    "GradNormMonitor",
    "GradStats",
    "ZClip",
    "clip_gradients",
]
