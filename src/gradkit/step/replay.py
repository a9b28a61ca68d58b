"""One replay context: whatever runs ``training_step`` again comes out as if it never ran.

Three features of the package run a batch's ``training_step`` a second time:

- the culprit replay of :class:`~gradkit.NonFiniteGuard` (:mod:`gradkit.policies.forensics`);
- the measuring forwards of :class:`~lightning_gradkit.ActivationCheckpointing` (``measure=True``);
- the later closure evaluations of an optimizer that evaluates its closure several times per step (``LBFGS``,
  SAM).

The first two are *replays*: the training never sees them. :func:`replay` runs them with

- the RNG states (torch CPU and every initialized CUDA device, Python's ``random``, NumPy's global generator)
  restored afterwards, and optionally set to a saved state for the replay (dropout masks repeat);
- every module buffer (BatchNorm running statistics), every ``.grad``, the train/eval mode of every submodule and
  the state of every ``torchmetrics`` metric among the submodules restored;
- ``self.log`` / ``self.log_dict`` doing nothing;
- ``torch.compile`` off (``torch.compiler.set_stance("force_eager")``, torch >= 2.6): a compiled model runs its eager
  code, whose every operator the culprit replay's dispatch mode sees, and dynamo's caches are not touched, so the
  steps after a replay run the same compiled graphs as before it (``docs/compile.md``);
- :func:`replaying` true, so the gradkit pieces that see ``training_step`` itself ignore them: the token count
  of ``AccumulationGuard(normalize="tokens")`` (read from its output) and the window-start buffer capture of the
  GradKit strategies (in ``Strategy.training_step``). The statistics fed by Lightning's backward hooks (the window
  loss of ``SpikeGuard`` / ``SpikeRollback``, the losses ``NonFiniteGuard`` checks) never see a replay: a replay
  runs no Lightning hook (the culprit replay differentiates with ``torch.autograd.grad``, the measuring forwards
  have no backward).

A later closure evaluation is not a replay: the optimizer consumes it (:mod:`gradkit.step.closure`).

What no context can undo: other Python side effects of ``training_step`` (a counter on ``self``, a print, a list
it appends to) happen once more per replay.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from gradkit._util.torch_compat import metric_state_names
from gradkit.step.gate import shadowed
from gradkit.step.snapshot import RNGState, Snapshot, capture_rng, restore_rng

# The RNG states belong to a step's state (`gradkit.step.snapshot`); the replay sets and restores them, and names them
# here.
__all__ = ["RNGState", "capture_rng", "replay", "replaying", "restore_rng"]


_depth = 0


def replaying() -> bool:
    """Whether a replay is running: per-micro-batch statistics must ignore it."""
    return _depth > 0


# -- module state -------------------------------------------------------------------------------------------------
# Attributes of a torchmetrics ``Metric`` besides its declared states that ``update``/``forward`` change.
_METRIC_BOOKKEEPING = ("_update_count", "_computed", "_forward_cache")


def _copied(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_copied(v) for v in value]
    return value


def _metric_states(module: nn.Module) -> list[tuple[nn.Module, dict[str, Any]]]:
    """A copy of the state of every ``torchmetrics.Metric`` among ``module``'s submodules.

    Metric states are plain attributes (not buffers): ``update`` adds to them in place or appends to lists.
    """
    torchmetrics = sys.modules.get("torchmetrics")
    if torchmetrics is None:  # no metric can exist
        return []
    saved = []
    for m in module.modules():
        if isinstance(m, torchmetrics.Metric):
            names = [*metric_state_names(m), *(a for a in _METRIC_BOOKKEEPING if hasattr(m, a))]
            saved.append((m, {name: _copied(getattr(m, name)) for name in names}))
    return saved


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


def _eager() -> AbstractContextManager[Any]:
    """``torch.compile`` off for the replay (``torch.compiler.set_stance("force_eager")``, torch >= 2.6): compiled
    code runs eagerly inside, and dynamo is not called at all.

    Why: the culprit replay's dispatch mode must see every aten operator, which a compiled graph hides; and a frame
    that dynamo meets while a dispatch mode is active (a cache miss: the replay's forward hooks, its grad mode) is
    marked to run eagerly for good: the model would stay uncompiled for the rest of the process (every later step
    then computes eagerly, numerically apart from the compiled run). Under ``force_eager`` nothing of dynamo's state
    changes: the steps after a replay run the same compiled graphs as before it.
    """
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else nullcontext()


@contextmanager
def replay(module: nn.Module, rng: RNGState | None = None) -> Iterator[None]:
    """The replay context: run ``training_step`` again and leave no trace on ``module`` (see the module docstring),
    with the RNG states ``rng`` set for the replay when given (e.g. captured before the original ``training_step``).

    Example::

        >>> bn = nn.BatchNorm1d(2)
        >>> with replay(bn):
        ...     _ = bn(bn.running_var.new_ones(4, 2))
        ...     replaying()
        True
        >>> bn.running_mean, int(bn.num_batches_tracked), replaying()
        (tensor([0., 0.]), 0, False)
    """
    global _depth
    saved_rng = capture_rng(full=True)
    buffers = Snapshot(module)  # by slot: a buffer the replay replaces gets its old object back too
    buffers.capture()
    grads = [(p, p.grad) for p in module.parameters()]
    modes = [(m, m.training) for m in module.modules()]
    metrics = _metric_states(module)
    _depth += 1
    try:
        with _eager():
            if rng is not None:
                restore_rng(rng)
            # `self.log` / `self.log_dict` of a LightningModule do nothing inside (instance attributes shadow them).
            with shadowed(module, log=_no_log, log_dict=_no_log):
                yield
    finally:
        _depth -= 1
        restore_rng(saved_rng)
        buffers.restore()
        for p, g in grads:
            p.grad = g
        for m, training in modes:
            m.training = training
        for metric, state in metrics:
            for name, value in state.items():
                setattr(metric, name, value)
