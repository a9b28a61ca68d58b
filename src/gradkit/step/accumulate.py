"""Exact gradient accumulation math: window scale factors and token normalization.

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

:class:`~lightning_gradkit.AccumulationGuard` wires them into the Trainer, :class:`~lightning_gradkit.ManualAccumulator`
into manual optimization.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from gradkit.step.norms import local_tensor, per_tensor_norms, world_size
from gradkit.step.protocol import Stage, StepContext

if TYPE_CHECKING:
    from gradkit.step.plan import Decision, StepStats

__all__ = [
    "TOKENS_KEY",
    "Normalize",
    "TokenCount",
    "WindowScale",
    "is_window_boundary",
    "mean_window_scale",
    "micro_batches_in_window",
    "nonzero_grad_flags",
    "token_window_scale",
]


Normalize = Literal["mean", "tokens"]

#: The key under which ``training_step`` returns the token count of its micro-batch in ``normalize="tokens"``.
TOKENS_KEY = "num_tokens"


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
    """Factor that turns gradients accumulated from losses divided by ``loss_divisor`` into the window mean: ``N / k``
    for Lightning's ``N = accumulate_grad_batches`` and a window of ``k``, ``1 / k`` for undivided losses.

    Example::

        >>> mean_window_scale(4, 2)  # the short last window of 10 batches with N = 4
        2.0
    """
    if micro_batches < 1:
        raise ValueError(f"A window holds at least one micro-batch, got {micro_batches}.")
    return loss_divisor / micro_batches


def token_window_scale(global_tokens: Tensor, world_size: int, loss_divisor: int) -> Tensor:
    """Factor ``W * N / T`` that turns accumulated, rank-averaged gradients of summed token losses into the per-token
    mean (``T`` clamped to 1: a window without tokens has a zero gradient).

    With tensor or context parallelism every rank of a data-parallel group counts the same tokens and the gradient
    is averaged over the data-parallel ranks only; the replication cancels between ``W`` and ``T``, so passing the
    world size and the count summed over the world is still exact.

    Example::

        >>> token_window_scale(torch.tensor(50.0), world_size=2, loss_divisor=4)
        tensor(0.1600)
    """
    return (world_size * loss_divisor) / global_tokens.clamp(min=1.0)


class TokenCount:
    """Sum of per-micro-batch token counts of one window: Python numbers on the host, tensors on their device (no
    host synchronization); :meth:`total` combines both into one fp32 device scalar."""

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


class WindowScale:
    """The scale of one ended accumulation window (``ManualAccumulator``'s), as a ``Stage.SCALE`` policy handed to the
    pipeline at the window's last backward (``Pipeline.add_pending_scale``): clipping then reads the norm of the
    window mean, and the token count rides the engine's one collective."""

    stage = Stage.SCALE

    def __init__(self, normalize: str, micro_batches: int, tokens: Tensor | None) -> None:
        self.normalize = normalize
        self.micro_batches = micro_batches
        self.tokens = tokens
        self.applied = False
        self._key = f"ManualAccumulator/tokens/{id(self)}"

    def reduce_request(self, ctx: StepContext) -> dict[str, Tensor]:
        return {} if self.tokens is None else {self._key: self.tokens}

    def decide(self, stats: StepStats, decision: Decision, ctx: StepContext) -> None:
        self.applied = True
        device = stats.index.shard_weight.device
        if self.normalize == "tokens":
            decision.multiply_scale(token_window_scale(stats.reduced[self._key].to(device), world_size(), 1))
        elif self.micro_batches > 1:
            # A fill kernel, no host-to-device copy.
            factor = mean_window_scale(1, self.micro_batches)
            decision.multiply_scale(torch.full((), factor, dtype=torch.float32, device=device))
