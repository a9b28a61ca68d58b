"""Lightning callbacks of lightning_gradkit, one per file."""

from lightning_gradkit.callbacks.graph_leak import GraphLeakGuard
from lightning_gradkit.callbacks.monitor import GradNormMonitor
from lightning_gradkit.callbacks.sync_audit import SyncAudit

__all__ = ["GradNormMonitor", "GraphLeakGuard", "SyncAudit"]
