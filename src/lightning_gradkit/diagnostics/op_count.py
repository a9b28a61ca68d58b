"""Count what a stretch of PyTorch code dispatches: aten operations, the kernel launches among them, and the bytes
they allocate.

On a GPU each aten operation that is not a view launches a kernel, a few microseconds of host time each; in a
host-bound loop (a small model's step on an H100) they add straight to the step. On the CPU the same operations are
dispatched, deterministically, so counting them there predicts the GPU's host cost without a GPU: the test suite
counts gradkit's step this way (``tests/test_hot_path_counts.py``), and ``benchmarks/bench_hot_path.py`` prints it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter"]


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while active, those of them that launch a kernel on a GPU (all but
    pure views: ``view``, ``detach``, ``reshape`` aliases), and the bytes of the tensors they allocate.

    An output is allocated by the operation when the schema says it aliases no input (not a view, not in place).

    Example::

        >>> import torch
        >>> x = torch.ones(4)
        >>> with OpCounter() as counter:
        ...     y = x.view(2, 2) * 2
        >>> dict(counter.ops), counter.launches, counter.bytes
        ({'view': 1, 'mul': 1}, 1, 16)
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.launches = 0
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops[func.overloadpacket.__name__] += 1
        returns = func._schema.returns
        view = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        self.launches += not view
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        fresh = [r.alias_info is None for r in returns] if len(returns) == len(outputs) else [False] * len(outputs)
        if len(returns) == 1 and isinstance(out, (tuple, list)):  # a Tensor[] return: one schema entry, n tensors
            fresh = [returns[0].alias_info is None] * len(outputs)
        for t, new in zip(outputs, fresh, strict=True):
            if new and isinstance(t, Tensor):
                self.bytes += t.numel() * t.element_size()
        return out

    @property
    def total(self) -> int:
        return sum(self.ops.values())
