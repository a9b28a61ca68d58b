"""Lightning callbacks of lightning_gradkit, one per file."""

from lightning_gradkit.callbacks.clipping import AdaptiveGradClip, AutoClip, ClipGradNorm, ClipGradValue, ZClip
from lightning_gradkit.callbacks.monitor import GradNormMonitor

__all__ = ["AdaptiveGradClip", "AutoClip", "ClipGradNorm", "ClipGradValue", "GradNormMonitor", "ZClip"]
