"""Lightning callbacks of lightning_gradkit, one per file."""

from lightning_gradkit.callbacks.accumulation import AccumulationGuard
from lightning_gradkit.callbacks.guards import NonFiniteGuard, SpikeGuard
from lightning_gradkit.callbacks.monitor import GradNormMonitor
from lightning_gradkit.callbacks.validation import InferenceModeValidation

__all__ = ["AccumulationGuard", "GradNormMonitor", "InferenceModeValidation", "NonFiniteGuard", "SpikeGuard"]
