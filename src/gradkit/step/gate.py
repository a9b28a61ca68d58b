"""Step the optimizer, or do not, as the step's policies decided: the one rule behind every front door.

The Lightning strategy mixin (:class:`~lightning_gradkit.GradKitStrategyMixin`) and the Fabric / plain-PyTorch door
(:class:`~gradkit.GradKit`) both put :func:`step_as_decided` in place of ``optimizer.step`` for the
duration of the step, so that whatever calls it (the precision plugin, a ``GradScaler``, Fabric's strategy) reaches
the same decision:

- no policy asked for a skip (``Decision.skip is None``): the optimizer steps, nothing is read;
- fused optimizer (``Adam/AdamW/SGD/Adagrad(fused=True)``): the flag is passed as the optimizer's ``found_inf``
  (combined with the ``GradScaler``'s), and the fused kernel skips the update on device: no host synchronization;
  the decision's common factor (clip coefficient times accumulation scale), when the pipeline left it unwritten
  (``Decision.folded``), goes in as the kernel's ``grad_scale``: no write pass over the gradients. One
  exception, a step that creates optimizer state (the first step, or the first after a moment reset): torch's fused
  step keeps the state it created even when ``found_inf`` skipped the kernel (``_fused_sgd``'s momentum buffers are
  ``torch.empty_like``, garbage), so there the flag is read on the host once and a skipped step's new state removed
  (:func:`_forget_state_of_skipped_step`);
- otherwise one host read of the flag (shared with whoever asks next,
  :meth:`~gradkit.step.pipeline.StepRecord.skip_on_host`): on a skip
  the optimizer is not called, so parameters and optimizer state stay bitwise as they were.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from gradkit._util.torch_compat import handles_found_inf

if TYPE_CHECKING:
    from gradkit.step.pipeline import StepRecord
    from gradkit.step.snapshot import Snapshot

__all__ = ["close_step", "fused_step", "shadowed", "step_as_decided"]

_MISSING = object()


def step_as_decided(
    optimizer: Optimizer,
    inner: Callable[..., Any],
    record: StepRecord | None,
    kwargs: dict[str, Any],
    skipped_result: Any = None,
) -> Any:
    """Call ``inner`` (``optimizer``'s own ``step``; the optimizer itself, not a wrapper) with ``kwargs`` unless
    ``record``'s decision (``None``: the pipeline did not run for the step) skips the step; a skipped step returns
    ``skipped_result`` (PyTorch's optimizers return the closure's result)."""
    fused = handles_found_inf(optimizer)
    if record is None or (record.decision.skip is None and record.decision.folded is None):  # no skip, all written
        if fused and optimizer.__dict__.get("found_inf") is not None:  # a GradScaler's own skip, same exposure
            return fused_step(optimizer, inner, None, kwargs)
        return inner(**kwargs)
    if fused:
        # The kernel reads the flag on device: no host sync, and the skip is as exact as the GradScaler's.
        return fused_step(optimizer, inner, record.decision.skip, kwargs, record.decision.folded)
    if record.skip_on_host():  # the one host read the design allows, shared with whoever asks next
        return skipped_result
    return inner(**kwargs)


def close_step(optimizer: Optimizer, record: StepRecord | None, window: Snapshot | None) -> bool | None:
    """The tail of a gated optimizer step, the same behind every door: whether it was skipped (``None`` when only
    the device knows, a fused optimizer's skip), the skipped step's gradients freed, and the buffers the step's
    forwards wrote put back on a skip (on device from the flag when only the device knows)."""
    skipped = record.skip_known_on_host() if record is not None else False
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    if window is not None:
        window.close(skipped, record.decision.skip if record is not None else None)
    return skipped


def fused_step(
    optimizer: Optimizer,
    inner: Callable[..., Any],
    skip: Tensor | None,
    kwargs: dict[str, Any],
    factor: Tensor | None = None,
) -> Any:
    """Step a fused optimizer with ``found_inf`` raised on a skip (its kernel then leaves parameters and state alone)
    and the gradients' pending ``factor`` (``Decision.folded``) folded into ``grad_scale``, which the kernel
    divides every gradient by as it reads it. A ``GradScaler`` sets both attributes for the duration of its
    ``step``; its values are combined with ours, and whatever the instance had is put back afterwards."""
    attributes: dict[str, Tensor] = {}
    if skip is not None:
        existing = optimizer.__dict__.get("found_inf")
        flag = skip.to(torch.float32)
        attributes["found_inf"] = flag if existing is None else torch.maximum(existing, flag.to(existing.device))
    if factor is not None:
        existing = optimizer.__dict__.get("grad_scale")  # the loss scale the gradients still carry, if any
        attributes["grad_scale"] = (
            torch.reciprocal(factor) if existing is None else existing / factor.to(existing.device)
        )
    with shadowed(optimizer, **attributes):
        flag = optimizer.__dict__.get("found_inf")  # ours, the GradScaler's, or both: what the kernel skips on
        stateless = _stateless_params(optimizer) if flag is not None else {}
        result = inner(**kwargs)
    if stateless:
        _forget_state_of_skipped_step(optimizer, stateless, flag)
    return result


def _stateless_params(optimizer: Optimizer) -> dict[Tensor, bool]:
    """The parameters about to be stepped that have no optimizer state yet (a first step, or one after
    :func:`~gradkit.policies.escalation.reset_optimizer_state_`), each with whether ``optimizer.state`` holds an (empty)
    entry for it. A plain Python pass over the parameters: no tensor is read."""
    state = optimizer.state
    return {
        p: p in state
        for group in optimizer.param_groups
        for p in group["params"]
        if p.grad is not None and not state.get(p)
    }


def _forget_state_of_skipped_step(optimizer: Optimizer, stateless: dict[Tensor, bool], flag: Tensor) -> None:
    """Undo the state a skipped fused step created, so that the next step is the optimizer's first one again, as in
    a run without the skipped batch (the reference). torch's fused ``step`` initializes lazy state before its kernel
    reads ``found_inf`` and keeps it on a skip: ``_fused_sgd`` keeps ``torch.empty_like`` momentum buffers (garbage
    the next step reads as momentum), ``_fused_adam`` zero moments and a step count of 0. A ``GradScaler`` skipping
    the same step leaves the same. The host read of the flag happens only on a step that created state (the first
    of each parameter, or the first after a moment reset), never in the steady state."""
    state = optimizer.state
    created = [p for p in stateless if state.get(p)]
    if not created or not bool(flag):  # the one host read, once per created state
        return
    for p in created:
        if stateless[p]:
            state[p] = {}  # it held an empty entry before: put back exactly that
        else:
            del state[p]


@contextmanager
def shadowed(obj: object, **attributes: Any) -> Iterator[None]:
    """Set instance attributes of ``obj`` for the body, then put back what the instance had: one that was not in
    ``obj.__dict__`` is deleted afterwards, so the class attribute shows through again.

    Example::

        >>> class Plain:
        ...     def log(self):
        ...         return "logged"
        >>> p = Plain()
        >>> with shadowed(p, log=lambda: None):
        ...     p.log()
        >>> p.log(), "log" in vars(p)
        ('logged', False)
    """
    previous = {name: obj.__dict__.get(name, _MISSING) for name in attributes}
    for name, value in attributes.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
