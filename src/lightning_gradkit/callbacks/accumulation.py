"""Exact gradient accumulation wired into the Lightning Trainer's automatic optimization: :class:`AccumulationGuard`.

It fixes short last windows, normalizes per token, frees old gradients early and checks that windows start clean
(manual optimization: :class:`~lightning_gradkit.ManualAccumulator`). The scale math is in
:mod:`gradkit.step.accumulate`; the guard is a ``Stage.SCALE`` policy of the pipeline: its ``decide`` multiplies the
decision's scale (applied in the one gradient write), its ``decide_again`` forgets the token count of a later closure
evaluation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from gradkit._util.arguments import check_bool, check_choice, name_list, validate_normalize
from gradkit.step.accumulate import (
    TOKENS_KEY,
    Normalize,
    TokenCount,
    mean_window_scale,
    micro_batches_in_window,
    nonzero_grad_flags,
    token_window_scale,
)
from gradkit.step.norms import local_tensor
from gradkit.step.plan import Decision, StepStats
from gradkit.step.protocol import StepContext
from gradkit.step.replay import replaying
from lightning_gradkit._deepspeed import refuse_under_deepspeed
from lightning_gradkit._window import WindowPosition
from lightning_gradkit.callbacks.manual_accumulation import ManualAccumulator
from lightning_gradkit.trainer_door import (
    GradKitCallback,
    Stage,
    TrainerContext,
    world_size,
)

__all__ = ["AccumulationGuard", "OnDirty"]


OnDirty = Literal["warn", "raise"]
_TOKENS_REDUCE_KEY = "accumulation/tokens"


def _overrides_zero_grad(pl_module: pl.LightningModule) -> bool:
    """Whether ``pl_module`` replaces Lightning's ``optimizer_zero_grad`` (in its class or on the instance)."""
    return getattr(pl_module.optimizer_zero_grad, "__func__", None) is not pl.LightningModule.optimizer_zero_grad


def _describe(output: object) -> str:
    if isinstance(output, Mapping):
        return f"a dict with keys {sorted(map(str, output))}"
    return f"a {type(output).__name__}"


def _trainer_door(ctx: StepContext) -> TrainerContext:
    """The Trainer door ``ctx`` is: this callback works only under a Trainer (:attr:`AccumulationGuard.trainer_only`),
    and reads the module's optimization mode and the Trainer's accumulation."""
    if not isinstance(ctx, TrainerContext):
        raise TypeError(f"AccumulationGuard works behind the Lightning Trainer only, got a {type(ctx).__name__}.")
    return ctx


class AccumulationGuard(GradKitCallback):
    r"""Make gradient accumulation exact, free gradients early and check that every window starts clean.

    Lightning divides each micro-batch loss by ``accumulate_grad_batches`` (N), so the short last window of an epoch
    gets a gradient that is too small (Lightning #19987); it cannot normalize by tokens (#20350); it ignores the
    setting silently when an epoch has fewer batches than N (#21808); and it zeroes the gradients only after the next
    forward pass. This callback fixes the scale in the gradkit engine's single gradient write (so clipping and norm
    logging see the normalized gradients), with no host synchronization.

    - ``normalize="mean"``: every window's gradient is the mean over the micro-batches actually in it, the short
      last window included (factor ``N / k`` for a window of ``k < N``; full windows are not touched).
    - ``normalize="tokens"``: ``training_step`` returns the SUM of its per-token losses under ``"loss"`` and the
      number of tokens under ``tokens_key`` (``"num_tokens"``). The stepped gradient equals the gradient of the
      total loss of the window across all ranks divided by the total number of tokens across all ranks (factor
      ``W * N / T``). The count of the window travels in the engine's one all-reduce; there is no look-ahead over
      batches. The same normalization as Hugging Face ``transformers`` >= 4.46 uses for causal LMs.
    - ``zero_early``: the gradients are freed (``zero_grad(set_to_none=True)``) at the end of the boundary batch,
      also when the step was skipped, instead of after the next window's first forward (through which Lightning
      keeps them in memory). Read gradients in ``on_before_optimizer_step``, not in ``on_train_batch_end``; turn it
      off if gradient buffers must keep their addresses (CUDA graphs). A LightningModule that overrides
      ``optimizer_zero_grad`` stays in charge: ``zero_early`` then frees nothing and warns at setup.
    - ``check_clean``: at the first backward of every window the gradients must be ``None`` or zero (the classic
      failure: manual optimization that forgets ``optimizer.zero_grad()``, or an ``optimizer_zero_grad`` override
      that skips parameters). ``None`` gradients are checked on the host; otherwise a per-parameter device flag (one
      ``torch._foreach_norm`` pass) is read on the next logging step or at the epoch end. In manual optimization the
      window is the span between two optimizer steps; with several optimizers the check is skipped.
    - A warning when an epoch has fewer batches than ``accumulate_grad_batches``.
    - Checkpoints saved inside a window (``val_check_interval`` not a multiple of N, ``trainer.save_checkpoint`` from
      a hook): Lightning saves neither the gradients accumulated so far nor the token count, so the resumed window
      would step with its remaining micro-batches only. The callback saves them (a CPU copy of the gradients, at
      mid-window saves only) and puts them back before the next backward. Single process only: under DDP each rank
      holds its own partial sum, and a mid-window save warns instead.

    Manual optimization: Lightning does not accumulate there (``accumulate_grad_batches`` must be 1); use
    :class:`~lightning_gradkit.ManualAccumulator` for exact accumulation and early freeing. Only ``check_clean``
    acts: ``zero_early=True`` has no effect and warns at setup unless the module holds a ``ManualAccumulator`` (pass
    ``zero_early=False`` to keep just the check), and ``check_clean=False`` leaves the guard nothing to do, so it is
    refused.

    Args:
        normalize: ``"mean"`` or ``"tokens"``.
        zero_early: free the gradients right after each optimizer step (automatic optimization, no
            ``optimizer_zero_grad`` override).
        check_clean: verify that gradients are ``None`` or zero at the start of every window.
        on_dirty: ``"warn"`` or ``"raise"`` when a window starts with gradients left over.
        tokens_key: the key of the token count in the dict ``training_step`` returns (token mode).

    Raises:
        ValueError: at construction, if ``normalize`` or ``on_dirty`` is unknown or ``tokens_key`` is empty; in
            token mode, if ``training_step`` does not return the token count.
        RuntimeError: at setup, if the Trainer holds another ``AccumulationGuard``, if the strategy accumulates on
            its own (DeepSpeed), or if manual optimization meets token mode or ``check_clean=False``.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import AccumulationGuard
        >>> trainer = Trainer(accumulate_grad_batches=4, callbacks=[AccumulationGuard(normalize="tokens")])

    with a ``training_step`` such as::

        def training_step(self, batch, batch_idx):
            logits = self(batch["input_ids"])
            token_losses = F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
            mask = batch["attention_mask"]
            return {"loss": (token_losses * mask).sum(), "num_tokens": mask.sum()}
    """

    stage = Stage.SCALE
    _restores_open_window = True

    trainer_only = (
        "it reads the Trainer's accumulation window and `training_step` batches; in your own loop divide the summed "
        "loss by the window's token count (`gradkit.step.accumulate`) before `backward`"
    )

    def __init__(
        self,
        normalize: Normalize = "mean",
        zero_early: bool = True,
        check_clean: bool = True,
        on_dirty: OnDirty = "warn",
        tokens_key: str = TOKENS_KEY,
    ) -> None:
        self.normalize = validate_normalize(normalize)
        self.on_dirty = check_choice("on_dirty", on_dirty, get_args(OnDirty))
        if not isinstance(tokens_key, str) or not tokens_key:
            raise ValueError(f"`tokens_key` must name the key of the token count, got {tokens_key!r}.")
        self.zero_early = check_bool("zero_early", zero_early)
        self.check_clean = check_bool("check_clean", check_clean)
        self.tokens_key = tokens_key
        self._tokens = TokenCount()
        self._batch_idx = 0
        self._stepped = False
        self._expect_clean = False
        self._params: list[Tensor] = []
        self._names: list[str] = []
        self._pending: list[tuple[int, list[int], Tensor]] = []
        self._scalars: dict[tuple[float, torch.device], Tensor] = {}
        self._wrapped: pl.LightningModule | None = None
        self._previous_step_attr: Callable[..., Any] | None = None
        self._warned_short_epoch = False
        self._told_multi_optimizer = False
        self._window_to_restore: dict[str, Any] | None = None
        self._free_early = False  # zero_early where it acts: decided at setup

    # -- setup / teardown ---------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        if sum(isinstance(cb, AccumulationGuard) for cb in trainer.callbacks) > 1:
            raise RuntimeError(
                "The Trainer holds several AccumulationGuard callbacks; each would rescale the same gradients. "
                "Keep one."
            )
        automatic = pl_module.automatic_optimization
        refuse_under_deepspeed(
            trainer,
            f"`AccumulationGuard(normalize={self.normalize!r})`",
            "the DeepSpeed engine accumulates the micro-batches itself and scales their gradients inside "
            "`engine.backward`, so no callback sees the window",
            "Set the window with `Trainer(accumulate_grad_batches=...)`, which Lightning passes to DeepSpeed as "
            "`gradient_accumulation_steps` (the DeepSpeed config must not set that key itself).",
        )
        if automatic and trainer.strategy.handles_gradient_accumulation:
            raise RuntimeError(
                f"AccumulationGuard: the strategy `{type(trainer.strategy).__name__}` accumulates gradients itself "
                "(e.g. DeepSpeed), so Lightning's windows and the scale they need are not visible to callbacks. "
                "Use the strategy's own accumulation settings, or a DDP/FSDP strategy with this callback."
            )
        if self.normalize == "tokens" and not automatic:
            raise RuntimeError(
                "AccumulationGuard(normalize='tokens') works with automatic optimization; "
                f"`{type(pl_module).__name__}` uses manual optimization. Use "
                "`lightning_gradkit.ManualAccumulator(window, normalize='tokens')` in your `training_step` instead."
            )
        if self.normalize == "tokens":
            self._wrap_training_step(pl_module)
        self._free_early = self.zero_early and automatic
        if self._free_early and _overrides_zero_grad(pl_module):
            # Freeing every gradient right after the step runs before the override and decides in its place: a
            # `set_to_none=False` override (static gradient buffers, CUDA graphs) would get its buffers freed, one
            # that keeps some gradients across windows would lose them, one that forgets parameters would be hidden
            # from `check_clean`. Code written for this module weighs more than a callback default, so the override
            # is honoured and only the memory saving is given up, with a warning. Calling the override early
            # instead would call it twice per window, and with the boundary batch's `batch_idx`.
            self._free_early = False
            rank_zero_warn(
                f"AccumulationGuard(zero_early=True): `{type(pl_module).__name__}` overrides `optimizer_zero_grad`, "
                "which Lightning calls at the start of every accumulation window. zero_early would free every "
                "gradient with `optimizer.zero_grad(set_to_none=True)` right after each optimizer step, before your "
                "override runs, and so decide in its place; it leaves the zeroing to your override instead, and the "
                "gradients stay in memory through the next window's first forward. Pass `zero_early=False` to "
                "silence this warning (free the gradients in your override to save that memory)."
            )
        if not automatic:
            self._check_manual_use(pl_module)

    def _check_manual_use(self, pl_module: pl.LightningModule) -> None:
        """Under manual optimization only ``check_clean`` acts: refuse a guard that would do nothing, warn for
        ``zero_early``, which cannot act (the module's ``training_step`` owns the optimizer steps and the zeroing),
        unless the module holds a :class:`ManualAccumulator`, which frees the gradients already."""
        name = type(pl_module).__name__
        if not self.check_clean:
            raise RuntimeError(
                f"AccumulationGuard(check_clean=False) does nothing under manual optimization (`{name}` sets "
                "`automatic_optimization = False`): Lightning does not accumulate there, so there is no window to "
                "rescale and no step to free gradients after. For exact accumulation use "
                "`lightning_gradkit.ManualAccumulator(window)` in your `training_step` (it also frees the gradients "
                "after each step); keep AccumulationGuard only with `check_clean=True`, to catch a missing "
                "`optimizer.zero_grad()`."
            )
        if self.zero_early and not any(isinstance(v, ManualAccumulator) for v in vars(pl_module).values()):
            rank_zero_warn(
                f"AccumulationGuard(zero_early=True) has no effect under manual optimization (`{name}` sets "
                "`automatic_optimization = False`): your `training_step` steps and zeroes the optimizers, and "
                "Lightning does not accumulate. Only `check_clean` acts. For exact accumulation that also frees the "
                "gradients after each step use `lightning_gradkit.ManualAccumulator(window)`; pass "
                "`zero_early=False` to silence this warning."
            )

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._unwrap_training_step()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._unwrap_training_step()

    def _wrap_training_step(self, pl_module: pl.LightningModule) -> None:
        """Capture each micro-batch's token count from ``training_step``'s output before its backward (callbacks see
        the output only after the optimizer step). An instance attribute shadows the method; Lightning looks it up on
        the module at call time, also through the DDP/FSDP wrappers' forward redirection."""
        if self._wrapped is not None:
            return
        original = pl_module.training_step
        self._previous_step_attr = pl_module.__dict__.get("training_step")

        @functools.wraps(original)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            output = original(*args, **kwargs)
            self._record_tokens(output)
            return output

        pl_module.training_step = training_step  # type: ignore[method-assign]
        self._wrapped = pl_module

    def _unwrap_training_step(self) -> None:
        module, self._wrapped = self._wrapped, None
        if module is None:
            return
        if self._previous_step_attr is not None:
            module.training_step = self._previous_step_attr  # type: ignore[method-assign]
        else:
            del module.training_step
        self._previous_step_attr = None

    def _record_tokens(self, output: object) -> None:
        if output is None or replaying():  # Lightning skips the micro-batch; a replay is not one
            return
        if not isinstance(output, Mapping) or self.tokens_key not in output:
            raise ValueError(
                f"AccumulationGuard(normalize='tokens') needs each micro-batch's token count, but `training_step` "
                f"returned {_describe(output)} without the key {self.tokens_key!r}. Return the SUM of the per-token "
                f"losses and the number of tokens: `return {{'loss': loss_sum, {self.tokens_key!r}: n}}` "
                "(e.g. `loss_sum = (token_losses * mask).sum()`, `n = mask.sum()`)."
            )
        self._tokens.add(output[self.tokens_key])

    # -- training hooks -----------------------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pending.clear()
        self._params = []
        self._refresh_params(trainer, pl_module)
        self._tokens.reset()
        self._stepped = False
        self._expect_clean = True

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        window, batches = trainer.accumulate_grad_batches, trainer.num_training_batches
        if self._warned_short_epoch or not pl_module.automatic_optimization or not 0 < batches < window:
            return
        self._warned_short_epoch = True
        effect = (
            f"AccumulationGuard rescales it to the mean over those {int(batches)} micro-batches"
            if self.normalize == "mean"
            else "AccumulationGuard normalizes it by the window's token count"
        )
        rank_zero_warn(
            f"The epoch has {int(batches)} training batch(es), fewer than `accumulate_grad_batches={window}`: every "
            f"optimizer step accumulates only {int(batches)} micro-batch(es) (Lightning #21808). Lightning alone "
            f"would divide their gradient by {window}; {effect}. Lower `accumulate_grad_batches` or use more batches "
            "per epoch if you meant larger steps."
        )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_idx = batch_idx
        if self._window_to_restore is not None:
            self._restore_window(trainer, pl_module, batch_idx)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        super().on_before_backward(trainer, pl_module, loss)  # counts the backward pass
        if not (self.check_clean and self._expect_clean):
            return
        self._expect_clean = False
        if not pl_module.automatic_optimization and len(trainer.optimizers) > 1:
            if not self._told_multi_optimizer:
                self._told_multi_optimizer = True
                rank_zero_info(
                    "AccumulationGuard: `check_clean` is skipped with several optimizers in manual optimization."
                )
            return
        self._refresh_params(trainer, pl_module)
        present = [i for i, p in enumerate(self._params) if p.grad is not None]
        if present:  # None gradients are clean: decided on the host
            flags = nonzero_grad_flags([self._params[i].grad for i in present])
            self._pending.append((trainer.global_step, present, flags))

    def _refresh_params(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The parameters the window-start check reads: every one the optimizers hold, also those added during the
        fit (``add_param_group``, as ``BackboneFinetuning`` does). Renamed only when that list changed."""
        params = [p for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]]
        if len(params) == len(self._params) and all(a is b for a, b in zip(params, self._params, strict=True)):
            return
        self._report_dirty()  # pending flags refer to positions in the old list
        names = {id(p): n for n, p in pl_module.named_parameters()}
        self._params = params
        self._names = [names.get(id(p), f"<param {i}>") for i, p in enumerate(params)]

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        self._stepped = True
        self._expect_clean = True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._stepped and self._free_early:
            for opt in trainer.optimizers:
                opt.zero_grad(set_to_none=True)
        self._stepped = False
        if self._pending and self._context(trainer, pl_module).is_logging_step():
            self._report_dirty()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report_dirty()

    def _report_dirty(self) -> None:
        """Read the pending window-start flags in one transfer and report the first dirty window."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        values = torch.cat([flags.to(pending[0][2].device) for _, _, flags in pending]).tolist()
        offset = 0
        for step, present, _ in pending:
            dirty = [self._names[i] for i, v in zip(present, values[offset : offset + len(present)], strict=True) if v]
            offset += len(present)
            if dirty:
                message = (
                    f"AccumulationGuard: the accumulation window that starts at optimizer step {step} began with "
                    f"non-zero gradients left from the previous window in {len(dirty)} parameter(s): "
                    f"{name_list(dirty)}. In manual optimization call `optimizer.zero_grad()` after every "
                    "`optimizer.step()` (or use `ManualAccumulator`); an `optimizer_zero_grad` override must zero "
                    "every parameter."
                )
                if self.on_dirty == "raise":
                    raise RuntimeError(message)
                rank_zero_warn(message)
                return

    # -- checkpoints inside a window -----------------------------------------------------------------------------
    def _open_window_state(self, position: WindowPosition) -> dict[str, Any]:
        """What a checkpoint saved inside the window needs for an exact resume (read on a save, never per step): a
        CPU copy of the gradients accumulated so far and the token count, which Lightning does not save."""
        grads = [None if p.grad is None else local_tensor(p.grad).detach().to("cpu", copy=True) for p in self._params]
        tokens = None if self._tokens.device is None else self._tokens.device.detach().to("cpu", copy=True)
        return {
            "micro_batch": position.micro_batch,
            "window": position.window,
            "step": position.step,
            "names": list(self._names),
            "grads": grads,
            "tokens_host": self._tokens.host,
            "tokens_device": tokens,
        }

    def _resume_window(self, saved: dict[str, Any]) -> None:
        """Restore ``saved`` (from :meth:`_open_window_state`) before the first backward after the resume."""
        self._window_to_restore = saved

    def _restore_window(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> None:
        """Put the saved window back before the first backward after a resume, if training resumed where it was."""
        saved, self._window_to_restore = self._window_to_restore, None
        assert saved is not None
        position = WindowPosition(saved["micro_batch"], saved["window"], saved["step"])
        window = trainer.accumulate_grad_batches
        here = (window, batch_idx % window, trainer.global_step)
        if here != (position.window, position.micro_batch, position.step) or saved["names"] != self._names:
            rank_zero_warn(
                f"AccumulationGuard: the checkpoint holds an accumulation window ({position.describe()}) but training "
                f"resumed at batch_idx {batch_idx}, optimizer step {trainer.global_step} with "
                f"`accumulate_grad_batches={window}` (or other parameters): the window cannot be restored, so the "
                "next optimizer step uses only the micro-batches after the checkpoint. Resume with the same settings."
            )
            return
        for param, grad in zip(self._params, saved["grads"], strict=True):
            param.grad = None if grad is None else grad.to(param.device)
        self._tokens.host = saved["tokens_host"]
        device = saved["tokens_device"]
        self._tokens.device = None if device is None else device.to(pl_module.device)
        self._expect_clean = False  # the window does not start here: its gradients are the restored ones

    # -- engine steps -------------------------------------------------------------------------------------------
    def reduce_request(self, ctx: StepContext) -> dict[str, Tensor]:
        if self.normalize != "tokens" or not _trainer_door(ctx).pl_module.automatic_optimization:
            return {}
        return {_TOKENS_REDUCE_KEY: self._tokens.total(ctx.device)}

    def decide(self, stats: StepStats, decision: Decision, ctx: StepContext) -> None:
        door = _trainer_door(ctx)
        if not door.pl_module.automatic_optimization:
            return
        window = door.trainer.accumulate_grad_batches
        device = stats.index.shard_weight.device
        if self.normalize == "tokens":
            tokens = stats.reduced[_TOKENS_REDUCE_KEY].to(device)
            decision.multiply_scale(token_window_scale(tokens, world_size(), window))
            self._tokens.reset()
            return
        factor = mean_window_scale(window, micro_batches_in_window(self._batch_idx, window))
        if factor != 1.0:
            decision.multiply_scale(self._scalar(factor, device))

    def decide_again(self, stats: StepStats, decision: Decision, first: Decision, ctx: StepContext) -> None:
        # A later closure evaluation (LBFGS, SAM) ran `training_step` again: the step was normalized by the first
        # evaluation's tokens, and these must not count toward the next window.
        self._tokens.reset()

    def _scalar(self, value: float, device: torch.device) -> Tensor:
        """A device scalar, made once per value (a fill kernel, no host-to-device copy)."""
        key = (value, device)
        if key not in self._scalars:
            self._scalars[key] = torch.full((), value, dtype=torch.float32, device=device)
        return self._scalars[key]
