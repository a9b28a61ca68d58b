"""The value a spike policy watches each optimizer step (the window's loss or the gradient norm), identical on every
rank: a small object that ``SpikeGuard`` and ``SpikeRollback`` compose (not a base class they inherit).

``monitor="loss"``: the window's mean loss (:class:`WindowLoss`), averaged over ranks through the pipeline's one
collective; ``"grad_norm"``: the total 2-norm of the gradients the optimizer would step with.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gradkit.step.accumulate import mean_window_scale
from gradkit.step.norms import world_size
from gradkit.step.plan import Decision, StepStats
from gradkit.step.protocol import StatsRequest, StepContext

__all__ = ["WatchedValue", "WindowLoss"]


class WindowLoss:
    """The mean loss of an accumulation window (without the fp16 scale) over the micro-batches actually in it, the
    short last window of an epoch included, summed on device from each micro-batch (no host sync)."""

    def __init__(self) -> None:
        self.sum: Tensor | None = None
        self.count = 0

    def add(self, loss: Tensor) -> None:
        """Add a micro-batch loss, without the AMP loss scale."""
        loss = loss.detach().float().reshape(())
        self.sum = loss if self.sum is None else self.sum.to(loss.device) + loss
        self.count += 1

    def take(self, ctx: StepContext) -> Tensor:
        """The window's mean loss on this rank, shape ``(1,)`` (NaN for a window without a loss); starts a new one.

        Lightning divides each micro-batch loss by N before ``on_before_backward`` (automatic optimization only,
        ``ctx.accumulate_grad_batches``): the window's sum is then k / N of its mean, too small for the short last
        window of an epoch.
        """
        value = self.sum
        if value is None:
            value = torch.full((), math.nan, device=ctx.device)
        else:
            factor = mean_window_scale(ctx.accumulate_grad_batches, self.count)
            if factor != 1.0:
                value = value * factor
        self.sum, self.count = None, 0
        return value.reshape(1).to(ctx.device)


class WatchedValue:
    """What a spike policy watches (``monitor``: ``"loss"`` or ``"grad_norm"``): its ``note_loss``, ``request_stats``
    and ``reduce_request`` hooks delegate here; ``key`` is the window loss's key in the step's collective."""

    def __init__(self, monitor: str, key: str) -> None:
        self.monitor = monitor
        self.key = key
        self.window = WindowLoss()
        #: Whether the last window had a loss handed over (a loop door without `note_loss` has none: not a fault).
        self.had_loss = True

    def note_loss(self, loss: Tensor) -> None:
        if self.monitor == "loss":
            self.window.add(loss)

    def request_stats(self, request: StatsRequest) -> None:
        if self.monitor == "grad_norm":
            request.norm_types.add(2.0)

    def reduce_request(self, ctx: StepContext) -> dict[str, Tensor]:
        if self.monitor != "loss":
            return {}
        self.had_loss = self.window.count > 0
        return {self.key: self.window.take(ctx)}

    def value(self, stats: StepStats, decision: Decision) -> Tensor:
        """The step's watched value (a device scalar), the same on every rank: the loss, or the total gradient 2-norm
        with the step's accumulation scale."""
        if self.monitor == "loss":
            x = stats.reduced[self.key].reshape(()).to(stats.primary.total.device)
            return x / world_size() if world_size() > 1 else x
        return decision.scaled(stats.norms[2.0].total)
