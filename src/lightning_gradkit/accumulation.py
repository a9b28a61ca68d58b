"""Exact gradient accumulation: window scale factors, token normalization and a manual-optimization helper.

With gradient accumulation, the gradient an optimizer step receives should be the mean over the micro-batches of
the window (``normalize="mean"``) or, for sequence models, the gradient of the summed per-token loss divided by
the number of tokens in the whole window across all ranks (``normalize="tokens"``). Lightning divides every
micro-batch loss by ``accumulate_grad_batches`` (N) and DDP averages over the W ranks, so a boundary holds

    (1 / (W * N)) * sum over ranks r and micro-batches i of grad(L_ri)

which is too small by k / N for a short last window of k < N micro-batches (Lightning #19987), and which weights
every micro-batch equally whatever its number of tokens (Lightning #20350; the bug class Hugging Face fixed in
``transformers`` 4.46). The factors here turn that sum into the intended gradient with one multiply at the
boundary, with no look-ahead over batches:

- mean: ``N / k`` (:func:`mean_window_scale`);
- tokens: ``W * N / T`` with ``T`` the token count of the window summed over ranks (:func:`token_window_scale`).

The functions are pure tensor math with no Lightning in them; :class:`~lightning_gradkit.AccumulationGuard`
wires them into the Trainer, :class:`ManualAccumulator` into manual optimization.
"""

from __future__ import annotations

import weakref
from typing import Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor
from torch.optim import Optimizer

from lightning_gradkit._engine import GradKitCallback, Stage, StepPlan, _Engine, world_size
from lightning_gradkit._validation import check_choice, check_int
from lightning_gradkit.stats import local_tensor, per_tensor_norms

Normalize = Literal["mean", "tokens"]

#: The key under which ``training_step`` returns the token count of its micro-batch in ``normalize="tokens"``.
TOKENS_KEY = "num_tokens"


def validate_normalize(normalize: str) -> str:
    """Return ``normalize`` if it is a known normalization mode.

    Raises:
        ValueError: if ``normalize`` is not ``"mean"`` or ``"tokens"``.
    """
    return check_choice(
        "normalize",
        normalize,
        get_args(Normalize),
        hint="Use 'mean' to average the micro-batches of each window, 'tokens' to divide the summed per-token loss by "
        "the window's global token count.",
    )


def micro_batches_in_window(batch_idx: int, window: int) -> int:
    """How many micro-batches the window that contains ``batch_idx`` holds up to and including it.

    Lightning starts a window at every ``batch_idx`` that is a multiple of ``window`` (it zeroes the gradients
    there), so at a boundary this is the size of the window that ends.

    Example::

        >>> [micro_batches_in_window(i, 4) for i in range(10)]
        [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    """
    return batch_idx % window + 1


def is_window_boundary(batch_idx: int, window: int, num_batches: float) -> bool:
    """Whether the optimizer steps after ``batch_idx``: the window is full or the epoch ends (Lightning's rule).

    Example::

        >>> [i for i in range(10) if is_window_boundary(i, 4, 10)]
        [3, 7, 9]
    """
    return (batch_idx + 1) % window == 0 or batch_idx + 1 >= num_batches


def mean_window_scale(loss_divisor: int, micro_batches: int) -> float:
    """Factor that turns gradients accumulated from losses divided by ``loss_divisor`` into the window mean.

    Lightning divides each micro-batch loss by ``N = accumulate_grad_batches`` (``loss_divisor = N``); a window of
    ``k`` micro-batches then holds ``(1/N) sum_i grad(L_i)`` and needs ``N / k``. Undivided losses
    (``loss_divisor = 1``, manual optimization) need ``1 / k``.

    Example::

        >>> mean_window_scale(4, 2)  # the short last window of 10 batches with N = 4
        2.0
    """
    if micro_batches < 1:
        raise ValueError(f"A window holds at least one micro-batch, got {micro_batches}.")
    return loss_divisor / micro_batches


def token_window_scale(global_tokens: Tensor, world_size: int, loss_divisor: int) -> Tensor:
    """Factor that turns accumulated, rank-averaged gradients of summed token losses into the per-token mean.

    The gradient at the boundary is ``(1 / (W * N)) * sum_{r,i} grad(S_ri)`` with ``S_ri`` the summed token loss of
    micro-batch ``i`` on rank ``r``; the target is ``sum_{r,i} grad(S_ri) / T``, so the factor is ``W * N / T``. A
    window without tokens has a zero gradient; the count is clamped to 1 so the factor stays finite.

    With tensor or context parallelism every rank of a data-parallel group counts the same tokens and the gradient
    is averaged over the data-parallel ranks only; the replication cancels between ``W`` and ``T``, so passing the
    world size and the count summed over the world is still exact.

    Example::

        >>> token_window_scale(torch.tensor(50.0), world_size=2, loss_divisor=4)
        tensor(0.1600)
    """
    return (world_size * loss_divisor) / global_tokens.clamp(min=1.0)


class TokenCount:
    """Sum of per-micro-batch token counts of one window, kept on the device (no host synchronization).

    Python numbers are summed on the host, tensors on their device; :meth:`total` combines both into one fp32
    device scalar.
    """

    def __init__(self) -> None:
        self.host = 0.0
        self.device: Tensor | None = None

    def add(self, num_tokens: int | float | Tensor) -> None:
        if isinstance(num_tokens, Tensor):
            if num_tokens.numel() != 1:
                raise ValueError(
                    f"The token count must be a number or a one-element tensor, got a tensor of shape "
                    f"{tuple(num_tokens.shape)}. Return e.g. `mask.sum()`, not the mask."
                )
            value = num_tokens.detach().reshape(()).to(torch.float32)
            self.device = value if self.device is None else self.device + value.to(self.device.device)
        else:
            self.host += float(num_tokens)

    def total(self, device: torch.device) -> Tensor:
        if self.device is None:
            return torch.full((), self.host, dtype=torch.float32, device=device)
        return self.device.to(device) + self.host

    def reset(self) -> None:
        self.host = 0.0
        self.device = None


def nonzero_grad_flags(grads: list[Tensor]) -> Tensor:
    """A bool device vector: which gradients hold a non-zero (or non-finite) value. No host synchronization."""
    return per_tensor_norms([local_tensor(g) for g in grads], 1.0) != 0


class _WindowScale(GradKitCallback):
    """The scale of one ended :class:`ManualAccumulator` window, as a ``Stage.SCALE`` policy of the engine.

    Registered with the Trainer's engine at the window's last backward and folded into the next engine run for the
    optimizer, so the window scale, any clipping (which then reads the norm of the window mean) and every other
    policy reach the gradients in the engine's one multiply. The token count rides the engine's one collective.
    """

    _stage = Stage.SCALE

    def __init__(self, normalize: str, micro_batches: int, tokens: Tensor | None) -> None:
        self.normalize = normalize
        self.micro_batches = micro_batches
        self.tokens = tokens
        self.applied = False
        self._key = f"ManualAccumulator/tokens/{id(self)}"

    def _reduce_request(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Tensor]:
        return {} if self.tokens is None else {self._key: self.tokens}

    def _decide(self, plan: StepPlan, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.applied = True
        device = plan.index.shard_weight.device
        if self.normalize == "tokens":
            plan.multiply_scale(token_window_scale(plan.reduced[self._key].to(device), world_size(), 1))
        elif self.micro_batches > 1:
            # A fill kernel, no host-to-device copy.
            factor = mean_window_scale(1, self.micro_batches)
            plan.multiply_scale(torch.full((), factor, dtype=torch.float32, device=device))


class ManualAccumulator:
    r"""Exact gradient accumulation for manual optimization (``self.automatic_optimization = False``).

    Call :meth:`backward` once per micro-batch instead of ``self.manual_backward``; it returns ``True`` on the last
    micro-batch of a window (the window is full or the epoch ends). Then call :meth:`step`: the accumulated
    gradients become the window mean (``normalize="mean"``) or the summed per-token loss divided by the token count
    of the whole window across all ranks (``normalize="tokens"``), the optimizer steps (through Lightning, so
    precision plugins and gradkit callbacks run) and the gradients are freed (``zero_grad(set_to_none=True)``), so
    a window never starts dirty.

    The window scale is a factor of the gradkit engine's plan, not a write of its own: whoever runs the engine for
    the step (:func:`~lightning_gradkit.clip_gradients` called between the last backward and :meth:`step`, a
    gradkit callback's ``on_before_optimizer_step``, or :meth:`step` itself when neither does) folds it into the
    engine's single multiply of the gradients. Clipping therefore reads the norm of the window mean, as a plain
    loop that averages and then calls ``clip_grad_norm_`` does, and the gradients are written once.

    Losses are passed undivided: the mean of each micro-batch (``"mean"``) or the SUM of its per-token losses
    (``"tokens"``). Under DDP, backward synchronization is skipped inside a window (``no_sync``) and happens on the
    boundary micro-batch; in token mode the window's token count is summed over ranks in the engine's one
    collective. Nothing reads a device value on the host.

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
        self._pending: _WindowScale | None = None
        self._module: weakref.ref[pl.LightningModule] | None = None
        self._optimizer: Optimizer | None = None

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
        pending = _WindowScale(self.normalize, self._micro_batches, tokens)
        optimizers = module.trainer.optimizers
        target = self._optimizer if self._optimizer is not None else optimizers[0] if len(optimizers) == 1 else None
        engine = _Engine.of(module.trainer)
        if self._pending is not None:
            engine.discard_pending_scale(self._pending)
        engine.add_pending_scale(pending, target)
        self._pending = pending
        self._module = weakref.ref(module)
        self._micro_batches = 0
        self._tokens.reset()

    def scale(self, optimizer: Optimizer) -> None:
        """Apply the ended window's scale to ``optimizer``'s gradients now, unless the engine already did.

        Runs the gradkit engine for ``optimizer`` (with the Trainer's gradkit callbacks, in one multiply);
        :meth:`step` calls it when nothing else would run the engine before the optimizer steps.
        """
        pending, module = self._pending, self._module() if self._module is not None else None
        if pending is None or pending.applied or module is None:
            return
        trainer = module.trainer
        inner = getattr(optimizer, "optimizer", optimizer)
        _Engine.of(trainer).run(trainer, module, inner)
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
            _Engine.of(module.trainer).discard_pending_scale(pending)
        self._pending = None
