"""Lightning callbacks of lightning_gradkit, one per file."""

from lightning_gradkit.callbacks.checkpointing import ActivationCheckpointing
from lightning_gradkit.callbacks.monitor import GradNormMonitor

__all__ = ["ActivationCheckpointing", "GradNormMonitor"]
