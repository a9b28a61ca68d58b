"""Exact gradient accumulation for manual optimization: :class:`ManualAccumulator`."""

from __future__ import annotations

import weakref
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor
from torch.optim import Optimizer

from gradkit._util.arguments import check_int, validate_normalize
from gradkit.step.accumulate import Normalize, TokenCount, WindowScale, is_window_boundary
from lightning_gradkit.trainer_door import GradKitCallback, TrainerPipeline

__all__ = ["ManualAccumulator"]


class ManualAccumulator:
    r"""Exact gradient accumulation for manual optimization (``self.automatic_optimization = False``).

    Call :meth:`backward` once per micro-batch instead of ``self.manual_backward``; it returns ``True`` on the last
    micro-batch of a window (the window is full or the epoch ends). Then call :meth:`step`: the accumulated
    gradients become the window mean (``normalize="mean"``) or the summed per-token loss divided by the token count
    of the whole window across all ranks (``normalize="tokens"``), the optimizer steps (through Lightning, so
    precision plugins and gradkit callbacks run) and the gradients are freed (``zero_grad(set_to_none=True)``), so
    a window never starts dirty.

    The window scale is a factor of the gradkit engine's plan (:class:`~gradkit.step.accumulate.WindowScale`), not a
    write of its own: whoever runs the engine for the step (:func:`~lightning_gradkit.clip_gradients` between the last
    backward and :meth:`step`, a gradkit callback's ``on_before_optimizer_step``, or :meth:`step` itself) folds it
    into the single multiply of the gradients, so clipping reads the norm of the window mean.

    Losses are passed undivided: the mean of each micro-batch (``"mean"``) or the SUM of its per-token losses
    (``"tokens"``). Under DDP, backward synchronization happens on the boundary micro-batch only (``no_sync``); the
    window's token count is summed over ranks in the engine's one collective. Nothing reads a device value on the host.

    With several optimizers, each accumulator serves the optimizer it first steps (the only one, if the module has
    a single optimizer); until then, the window's scale goes to the first optimizer the engine processes.

    Args:
        window: micro-batches per optimizer step (the manual counterpart of ``accumulate_grad_batches``).
        normalize: ``"mean"`` (default) or ``"tokens"``.

    Raises:
        ValueError: if ``window`` < 1 or ``normalize`` is unknown; from :meth:`backward`, if token mode gets no
            token count.

    Example::

        >>> from lightning.pytorch import LightningModule
        >>> from lightning_gradkit import ManualAccumulator
        >>> class LitLM(LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.automatic_optimization = False
        ...         self.accumulator = ManualAccumulator(window=4, normalize="tokens")
        ...
        ...     def training_step(self, batch, batch_idx):
        ...         token_losses, mask = self.token_losses(batch)
        ...         loss_sum = (token_losses * mask).sum()
        ...         if self.accumulator.backward(self, loss_sum, batch_idx, num_tokens=mask.sum()):
        ...             self.accumulator.step(self.optimizers())
    """

    def __init__(self, window: int, normalize: Normalize = "mean") -> None:
        self.window = check_int("window", window, 1, hint="It is the number of micro-batches per optimizer step.")
        self.normalize = validate_normalize(normalize)
        self._micro_batches = 0
        self._tokens = TokenCount()
        self._pending: WindowScale | None = None
        self._module: weakref.ref[pl.LightningModule] | None = None
        self._optimizer: Optimizer | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The module that holds this accumulator is reached through a weak reference, which cannot be pickled: a copy
        # (`torch.save(trainer)`, `copy.deepcopy(module)`) takes it up again at its next window end.
        state = dict(vars(self))
        state["_module"] = None
        return state

    def backward(
        self,
        module: pl.LightningModule,
        loss: Tensor,
        batch_idx: int,
        num_tokens: int | float | Tensor | None = None,
    ) -> bool:
        """Back-propagate one micro-batch's loss; return whether the window ends with it (then call :meth:`step`).

        Args:
            module: the LightningModule (its ``manual_backward`` applies precision scaling).
            loss: the micro-batch loss, undivided: its mean (``"mean"``) or the sum of its token losses
                (``"tokens"``).
            batch_idx: the ``batch_idx`` of ``training_step``.
            num_tokens: the number of tokens in ``loss`` (required in token mode).
        """
        if self.normalize == "tokens":
            if num_tokens is None:
                raise ValueError(
                    "ManualAccumulator(normalize='tokens') needs the micro-batch's token count: call "
                    "`accumulator.backward(self, loss_sum, batch_idx, num_tokens=n)` with `loss_sum` the SUM of the "
                    "per-token losses and `n` the number of tokens in it (e.g. `mask.sum()`)."
                )
            self._tokens.add(num_tokens)
        self._micro_batches += 1
        boundary = is_window_boundary(batch_idx, self.window, module.trainer.num_training_batches)
        strategy = module.trainer.strategy
        if not boundary and isinstance(strategy, ParallelStrategy):
            with strategy.block_backward_sync():
                module.manual_backward(loss)
        else:
            module.manual_backward(loss)
        if boundary:
            self._end_window(module)
        return boundary

    def _end_window(self, module: pl.LightningModule) -> None:
        """Hand the window's scale to the engine, which applies it in the step's single multiply."""
        tokens = self._tokens.total(module.device) if self.normalize == "tokens" else None
        pending = WindowScale(self.normalize, self._micro_batches, tokens)
        optimizers = module.trainer.optimizers
        # The optimizer this accumulator stepped, if it is one of this fit's (a new fit builds new optimizers).
        known = next((o for o in optimizers if o is self._optimizer), None)
        target = known if known is not None else optimizers[0] if len(optimizers) == 1 else None
        engine = TrainerPipeline.of(module.trainer)
        if self._pending is not None:
            engine.discard_pending_scale(self._pending)
        engine.add_pending_scale(pending, target)
        self._pending = pending
        self._module = weakref.ref(module)
        self._micro_batches = 0
        self._tokens.reset()

    def scale(self, optimizer: Optimizer) -> None:
        """Apply the ended window's scale to ``optimizer``'s gradients now (the engine, with the Trainer's gradkit
        callbacks, in one multiply), unless the engine already did."""
        pending, module = self._pending, self._module() if self._module is not None else None
        if pending is None or pending.applied or module is None:
            return
        trainer = module.trainer
        inner = getattr(optimizer, "optimizer", optimizer)
        TrainerPipeline.of(trainer).run(trainer, module, inner)
        if not pending.applied:
            raise RuntimeError(
                "ManualAccumulator: the gradkit engine already processed this step's gradients without the window "
                "scale. Call `accumulator.step(optimizer)` right after the backward that ends the window, before "
                "stepping any other optimizer."
            )

    def step(self, optimizer: Optimizer) -> None:
        """Scale the window's gradients, step ``optimizer`` and free the gradients (``set_to_none=True``).

        Pass the optimizer from ``self.optimizers()`` so Lightning's precision plugin and callbacks run.
        """
        inner = getattr(optimizer, "optimizer", optimizer)
        self._optimizer = inner
        pending, module = self._pending, self._module() if self._module is not None else None
        hooks_run_engine = (
            isinstance(optimizer, LightningOptimizer)
            and module is not None
            and any(isinstance(cb, GradKitCallback) for cb in module.trainer.callbacks)
        )
        if not hooks_run_engine:
            self.scale(inner)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if pending is not None and module is not None:
            # Not used by a run (e.g. the engine ran for another optimizer): it must not leak into the next window.
            TrainerPipeline.of(module.trainer).discard_pending_scale(pending)
        self._pending = None
