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
- **How the engine tells them apart** (:class:`Evaluations`): every ``backward`` advances ``Engine.generation``
  (``on_after_backward``, which Lightning calls for closure re-evaluations too). A run for an optimizer step that
  was run already is a later evaluation, unless no backward happened since (same generation) or, with several
  optimizers, the backward since did not touch this optimizer's gradients (same gradient versions): then it is the
  same set of gradients again and the engine does nothing.

The model's own state follows plain Lightning in a later evaluation (its buffers, RNG draws and ``self.log`` calls
count): it is not a replay (:mod:`gradkit.replay`), the optimizer consumes it.

Used by :mod:`lightning_gradkit.strategy` (the gate's half: :func:`first_evaluation`) and
:mod:`lightning_gradkit.engine` (the engine's half: :class:`Evaluations`, :func:`decide_again`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

if TYPE_CHECKING:
    from gradkit.pipeline import StepContext, StepPlan

__all__ = ["Evaluation", "Evaluations", "decide_again", "first_evaluation"]


class Evaluation(Enum):
    """What a run of the engine for an optimizer step meets."""

    FIRST = "first"  # the step's first gradients: measure, reduce, decide, apply, observe
    LATER = "later"  # a closure evaluated again within the step: scale and clip the fresh gradients only
    SAME = "same"  # the gradients the engine already wrote for this step: nothing to do


@dataclass(frozen=True)
class _Run:
    """When the engine last ran for an optimizer: its step, the backward generation, its gradients after the write."""

    step: tuple[int, ...]
    generation: int
    versions: tuple[tuple[int, int], ...] | None


class Evaluations:
    """Per optimizer, the engine's last run: tells a step's first evaluation from a later one (see the module)."""

    def __init__(self) -> None:
        self._runs: dict[int, _Run] = {}

    def clear(self) -> None:
        self._runs.clear()

    def ran(self, optimizer: Optimizer, step: tuple[int, ...]) -> bool:
        """Whether the engine has run for ``optimizer`` at ``step``."""
        run = self._runs.get(id(optimizer))
        return run is not None and run.step == step

    def classify(self, optimizer: Optimizer, step: tuple[int, ...], generation: int) -> Evaluation:
        """What a run for ``optimizer`` at ``step``, after backward number ``generation``, meets."""
        run = self._runs.get(id(optimizer))
        if run is None or run.step != step:
            return Evaluation.FIRST
        if run.generation == generation or (run.versions is not None and run.versions == _grad_versions(optimizer)):
            return Evaluation.SAME
        return Evaluation.LATER

    def record(self, optimizer: Optimizer, step: tuple[int, ...], generation: int, shared: bool) -> None:
        """Note a run for ``optimizer`` at ``step``, once its gradients are written.

        ``shared``: whether several optimizers share the backward passes. With one optimizer every backward within
        its step writes its gradients, so the generation alone tells a new evaluation; reading the versions of every
        gradient would cost a host call per tensor every step.
        """
        self._runs[id(optimizer)] = _Run(step, generation, _grad_versions(optimizer) if shared else None)


def _grad_versions(optimizer: Optimizer) -> tuple[tuple[int, int], ...]:
    """Identity and in-place version of every gradient of ``optimizer``: a backward that wrote into them (or new
    ones after ``zero_grad``) changes it, a backward into other parameters does not. Host metadata only."""
    return tuple(
        (id(p.grad), p.grad._version) for group in optimizer.param_groups for p in group["params"] if p.grad is not None
    )


def decide_again(
    plan: StepPlan,
    first: StepPlan,
    hooks: list[Callable[[StepPlan, StepPlan, StepContext], None]],
    ctx: StepContext,
) -> None:
    """The decide phase of a later evaluation: the step's accumulation scale, then each policy's ``decide_again``.

    Args:
        plan: the later evaluation's plan (its fresh gradients' statistics).
        first: the step's plan, decided on its first evaluation.
        hooks: the ``decide_again`` hooks of the step's policies, in stage order.
        ctx: the loop the step runs in.
    """
    plan.scale = first.scale
    for decide_again_ in hooks:
        decide_again_(plan, first, ctx)


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
