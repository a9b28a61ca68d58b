"""The two training-health diagnostics, each a callback and the plain-PyTorch machinery it drives.

- :mod:`~lightning_gradkit.diagnostics.sync_audit`: :class:`~lightning_gradkit.SyncAudit`, the user's source lines
  that make the host wait for the device; machinery in :mod:`~lightning_gradkit.diagnostics.host_sync`.
- :mod:`~lightning_gradkit.diagnostics.graph_leak`: :class:`~lightning_gradkit.GraphLeakGuard`, tensors that keep
  autograd graphs alive from one step into the next; machinery in :mod:`~lightning_gradkit.diagnostics.autograd_graph`.
- :mod:`~lightning_gradkit.diagnostics.sources`: which code a frame belongs to (user, framework, library), for both.
- :mod:`~lightning_gradkit.diagnostics.op_count`: :class:`~lightning_gradkit.diagnostics.op_count.OpCounter`, the aten
  operations, kernel launches and bytes a stretch of code dispatches (the hot-path tests and benchmark use it).
"""
