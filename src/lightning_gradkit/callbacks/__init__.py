"""Lightning callbacks of lightning_gradkit, one per file."""

from lightning_gradkit.callbacks.guards import NonFiniteGuard, SpikeGuard
from lightning_gradkit.callbacks.monitor import GradNormMonitor

__all__ = ["GradNormMonitor", "NonFiniteGuard", "SpikeGuard"]
