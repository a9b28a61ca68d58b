"""The value a spike detector watches each optimizer step: the window's mean loss, or the total gradient norm.

:class:`~lightning_gradkit.SpikeGuard` and :class:`~lightning_gradkit.SpikeRollback` both watch it, so it lives here
once:

- :func:`unscaled_loss`: a micro-batch loss as ``training_step`` returned it (without the fp16 loss scale).
- :class:`WindowLoss`: the mean loss of an accumulation window, summed on device (no host sync).
- :class:`WatchesLossOrGradNorm`: the engine wiring that turns either into one value, identical on every rank.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from torch import Tensor

from gradkit.accumulate import mean_window_scale
from gradkit.norms import loss_scale
from gradkit.protocol import StepContext
from lightning_gradkit.engine import GradKitCallback, StatsRequest, StepPlan, world_size

__all__ = ["WatchesLossOrGradNorm", "WindowLoss", "unscaled_loss"]


def unscaled_loss(trainer: pl.Trainer, loss: Tensor) -> Tensor:
    """The loss as ``training_step`` returned it (``on_before_backward`` sees it multiplied by the fp16 scale)."""
    scale = loss_scale(getattr(trainer.precision_plugin, "scaler", None))
    loss = loss.detach().float()
    return loss if scale is None else loss / scale.to(loss.device)


class WindowLoss:
    """The mean loss of an accumulation window, summed on device from ``on_before_backward`` (no host sync).

    Used by every callback that monitors the loss per optimizer step (``SpikeGuard``, ``SpikeRollback``): the
    loss as ``training_step`` returned it (without the fp16 scale), averaged over the micro-batches actually in the
    window, the short last window of an epoch included.
    """

    def __init__(self) -> None:
        self.sum: Tensor | None = None
        self.count = 0

    def add(self, loss: Tensor) -> None:
        """Add a micro-batch loss, without the AMP loss scale (see :func:`unscaled_loss`)."""
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


class WatchesLossOrGradNorm(GradKitCallback):
    """The value ``SpikeGuard`` and ``SpikeRollback`` watch each optimizer step, identical on every rank.

    ``monitor="loss"``: the window's mean loss (:class:`WindowLoss`) averaged over ranks through the engine's one
    collective; ``"grad_norm"``: the total 2-norm of the gradients the optimizer would step with. Subclasses set
    ``monitor``, ``_key`` (unique in the collective) and ``_window_loss``.
    """

    monitor: str
    _key: str
    _window_loss: WindowLoss
    _window_had_loss: bool = True

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self.monitor == "loss":
            self._window_loss.add(unscaled_loss(trainer, loss))

    def note_loss(self, loss: Tensor, ctx: StepContext) -> None:
        if self.monitor == "loss":
            self._window_loss.add(loss)

    def request_stats(self, request: StatsRequest) -> None:
        if self.monitor == "grad_norm":
            request.norm_types.add(2.0)

    def reduce_request(self, ctx: StepContext) -> dict[str, Tensor]:
        if self.monitor != "loss":
            return {}
        # A window without a loss handed over (a loop door without `note_loss`) has no value: its NaN is not a fault.
        self._window_had_loss = self._window_loss.count > 0
        return {self._key: self._window_loss.take(ctx)}

    def _watched_value(self, plan: StepPlan) -> Tensor:
        if self.monitor == "loss":
            x = plan.reduced[self._key].reshape(()).to(plan.primary.total.device)
            return x / world_size() if world_size() > 1 else x
        return plan.scaled(plan.stats[2.0].total)
