"""Closure re-evaluation: optimizers that evaluate their closure several times within one step.

``LBFGS``, SAM and line searches call ``closure()`` more than once inside ``optimizer.step``. In Lightning each call
runs ``training_step`` and ``backward`` again and then the callbacks' ``on_before_optimizer_step``, so the gradkit
engine meets new gradients for a step it has already run. The rule, stated here once for the whole package:

- **The step is decided on its first evaluation.** The skip, the guards' statistics, the threshold of an adaptive
  clipper and every logged value belong to it. With a GradKit strategy the gate runs that evaluation itself, before
  it calls the optimizer (:func:`first_evaluation`), so the skip is known before anything can be applied; the
  optimizer's own first call of the closure returns that evaluation's result, whose gradients are already in place.
- **A later evaluation is scaled and clipped, never decided.** Every later call of the closure runs the real one.
  The engine gives its fresh gradients the step's accumulation scale and each policy's ``decide_again``
  (:func:`decide_again`): clippers clip them, as Lightning's ``gradient_clip_val`` clips every evaluation, with the
  threshold of the first evaluation; every policy forgets what the evaluation's micro-batch hooks collected (token
  counts, window losses), which belongs to no decision. Nothing is guarded, counted or logged again: once the
  optimizer runs, the step is applied.
- **How the pipeline tells them apart** (:meth:`gradkit.step.pipeline.Pipeline.run`): every ``backward`` advances
  ``Pipeline.generation`` (``on_before_backward``, which Lightning calls for closure re-evaluations too). A run for
  an optimizer step that was run already is a later evaluation, unless no backward happened since (same generation)
  or, with several optimizers, the backward since did not touch this optimizer's gradients (same gradient
  versions): then it is the same set of gradients again and the engine does nothing.

The model's own state follows plain Lightning in a later evaluation (its buffers, RNG draws and ``self.log`` calls
count): it is not a replay (:mod:`gradkit.step.replay`), the optimizer consumes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gradkit.step.plan import Decision, StepStats
    from gradkit.step.protocol import StepContext

__all__ = ["decide_again", "first_evaluation"]


def decide_again(
    stats: StepStats,
    decision: Decision,
    first: Decision,
    hooks: list[Callable[[StepStats, Decision, Decision, StepContext], None]],
    ctx: StepContext,
) -> None:
    """The decide phase of a later evaluation (its ``stats`` and ``decision``): the accumulation scale of the step's
    first evaluation (``first``), then each policy's ``decide_again`` (``hooks``, in stage order)."""
    if first.scale is not None:
        decision.multiply_scale(first.scale)
    for decide_again_ in hooks:
        decide_again_(stats, decision, first, ctx)


def first_evaluation(closure: Callable[[], Any]) -> tuple[Any, Callable[[], Any]]:
    """Run the step's first evaluation of ``closure``; return its result and the closure to hand the optimizer.

    The closure handed on returns that result at its first call (its gradients are in place) and runs ``closure``
    again at every later call, for fresh gradients.

    Example::

        >>> calls = []
        >>> result, handed = first_evaluation(lambda: calls.append(1) or len(calls))
        >>> result, handed(), handed(), len(calls)
        (1, 1, 2, 2)
    """
    # As torch's optimizers run a closure (`with torch.enable_grad(): loss = closure()`): the gate runs it in their
    # place, and `optimizer.step` may be entered with gradients off.
    with torch.enable_grad():
        result = closure()
    calls = 0

    def evaluate() -> Any:
        nonlocal calls
        calls += 1
        return result if calls == 1 else closure()

    return result, evaluate
