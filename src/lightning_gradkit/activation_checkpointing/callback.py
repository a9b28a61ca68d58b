"""Activation checkpointing for any model under any strategy, by module selection or by a memory budget."""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves

from gradkit._util.arguments import check_bool, check_choice, format_bytes, validate_every_n, validate_memory_budget
from gradkit.step.replay import replay
from gradkit.step.selection import parse_patterns
from lightning_gradkit.activation_checkpointing.injection import (
    MODES,
    bypass_checkpointing,
    checkpointed_elsewhere,
    inject_selected,
    module_ancestry,
    no_match_message,
    remove,
    select_modules,
    user_class,
)
from lightning_gradkit.activation_checkpointing.planner import (
    ActivationProfile,
    budget_bytes,
    format_summary,
    measure_saved_activations,
    plan_checkpointing,
)
from lightning_gradkit.trainer_door import instance_hook

__all__ = ["ActivationCheckpointing"]


class ActivationCheckpointing(Callback):
    r"""Checkpoint selected submodules of the model, or as few as a memory budget needs, with no model change.

    Each selected module recomputes its forward during the backward instead of keeping its activations: non-reentrant
    :func:`torch.utils.checkpoint.checkpoint` with the RNG state preserved, so dropout draws the same masks in the
    recompute and the gradients equal those without checkpointing. The module's class, parameter names and
    ``state_dict`` keys do not change (a checkpoint saved with the callback loads without it and vice versa): only its
    instance ``forward`` is replaced (see :mod:`lightning_gradkit.activation_checkpointing.injection` for why this
    beats ``checkpoint_wrapper`` here). The hooks of DDP and FSDP2 stay outside the checkpointed region, so DDP needs no
    ``find_unused_parameters`` and FSDP/FSDP2 sharding may happen before or after the injection.

    When it happens:

    - ``setup``: modules that exist at that point (built in ``__init__``) are checkpointed before
      ``configure_model`` and before the strategy wraps or shards the model.
    - ``on_fit_start``: the selection is made again on the final model; matching modules created in
      ``configure_model`` are checkpointed now (correct after ``fully_shard``/FSDP wrapping, since only
      ``forward`` changes), and targets that still match nothing raise. An injection of ours that Lightning's
      ``FSDPStrategy(activation_checkpointing_policy=...)`` wrapped again is undone (no double checkpointing).
    - First training batch (``measure=True``): two extra forwards of ``training_step`` on that batch, without
      backward and in eager mode, one with checkpointing bypassed and one with it, measure the saved-activation bytes
      (:mod:`~lightning_gradkit.activation_checkpointing.planner`: no extra memory). They run in the replay context
      (:func:`gradkit.step.replay.replay`: RNG states, buffers, ``self.log`` and the gradkit callbacks' statistics are
      left untouched, DDP gradient sync is off); other side effects of ``training_step`` (a counter it increments)
      happen twice more. Rank 0 logs a one-screen summary. With ``memory_budget``, rank 0 plans here, on its batch.
    - ``teardown``, or ``on_exception`` when ``fit`` fails: the injections are removed; the model is returned as it
      was given.
    - Buffers: the recompute during the backward does not update buffers a second time (BatchNorm's running
      statistics and ``num_batches_tracked`` move once per forward, as without checkpointing).

    Args:
        targets: the modules to checkpoint, in gradkit's selection grammar (:mod:`gradkit.step.selection`):
            module class names (``"Block"``, ``"torch.nn.TransformerEncoderLayer"``; subclasses match too) or
            ``"re:<regex>"`` patterns that match whole qualified module names relative to the LightningModule (e.g.
            ``"re:model\.blocks\.\d+"``). A match inside another match is dropped.
        every_n: checkpoint every n-th match (the n-th, 2n-th, ...); 1 checkpoints all of them.
        mode: ``"full"`` recomputes the whole module; ``"selective"`` keeps the outputs of matmuls and attention
            kernels and recomputes the cheap ops between them (op-level selective checkpointing with
            :func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`, after torchtitan).
        offload: keep the activations saved outside checkpointed modules in pinned host memory
            (:func:`torch.autograd.graph.save_on_cpu`) during each training forward. Without an accelerator it has
            nothing to do and is switched off with a warning.
        memory_budget: plan the selection instead: a fraction in (0, 1] of the saved-activation bytes without
            checkpointing, or a whole number of bytes (> 1). The measuring step attributes saved bytes to each
            matching module and the fewest of them (largest saving first) are checkpointed to bring the total under
            the budget. Needs automatic optimization. Works in eager mode; no ``torch.compile`` needed.
        measure: run the measuring step and log the summary (needed by ``memory_budget``).

    Attributes:
        checkpointed_modules: qualified names of the modules checkpointed in the current fit.
        saved_bytes_before: saved-activation bytes of the first training step without checkpointing (this rank's
            measurement), or None before the measuring step.
        saved_bytes_after: the same with checkpointing.

    Raises:
        ValueError: at construction, on an invalid argument or conflicting ones (``every_n`` with
            ``memory_budget``); at setup, if ``targets`` match no module (the message names, for each target, the
            nearest module names or classes and a target that would match), or ``memory_budget`` is used with
            manual optimization.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import ActivationCheckpointing
        >>> trainer = Trainer(callbacks=[ActivationCheckpointing(["Block"], mode="selective")])
        >>> trainer = Trainer(callbacks=[ActivationCheckpointing(["Block"], memory_budget=0.5)])
    """

    def __init__(
        self,
        targets: list[str],
        every_n: int = 1,
        mode: Literal["full", "selective"] = "full",
        offload: bool = False,
        memory_budget: float | None = None,
        measure: bool = True,
    ) -> None:
        self._targets = parse_patterns("targets", targets, allow_empty=False)
        validate_every_n(every_n)
        check_choice("mode", mode, MODES)
        check_bool("offload", offload)
        check_bool("measure", measure)
        validate_memory_budget(memory_budget)
        if memory_budget is not None and every_n != 1:
            raise ValueError(
                f"`every_n={every_n}` conflicts with `memory_budget={memory_budget}`: the budget chooses the modules "
                "itself. Leave `every_n=1` (its default) or drop `memory_budget`."
            )
        if memory_budget is not None and not measure:
            raise ValueError("`memory_budget` needs the measuring step: leave `measure=True`.")
        self.targets = [t.text for t in self._targets]
        self.every_n = every_n
        self.mode = mode
        self.offload = offload
        self.memory_budget = memory_budget
        self.measure = measure
        self._injected: list[nn.Module] = []
        self._candidates: list[tuple[str, nn.Module]] = []
        self._pending = True
        self.checkpointed_modules: list[str] = []
        self.saved_bytes_before: int | None = None
        self.saved_bytes_after: int | None = None
        self._offload_device = False
        self._offload_ctx: contextlib.AbstractContextManager[None] | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(targets=self.targets, every_n=self.every_n, mode=self.mode)

    # -- injection ----------------------------------------------------------------------------------------------------
    def apply(self, module: nn.Module) -> list[str]:
        """Checkpoint the modules of ``module`` selected by ``targets``/``every_n``; returns their names.

        ``setup`` and ``on_fit_start`` call it; a strategy may too (it is idempotent). With ``memory_budget`` it does
        nothing: the selection is planned on the first training batch.
        """
        if self.memory_budget is not None:
            return []
        return self._inject(module, select_modules(module, self._targets, self.every_n))

    def _inject(self, root: nn.Module, selected: list[tuple[str, nn.Module]]) -> list[str]:
        kept = inject_selected(root, selected, self.mode, self._injected)
        self._injected += [m for _, m in kept if not any(m is i for i in self._injected)]
        return [name for name, _ in kept]

    def _reconcile(self, root: nn.Module) -> None:
        """Make the injections match the selection on the final model (after ``configure_model`` and wrapping)."""
        present = {id(m) for m in root.modules()}
        ancestry = module_ancestry(root)
        kept = []
        for module in self._injected:
            who = checkpointed_elsewhere(root, module, own=False, ancestry=ancestry) if id(module) in present else None
            if id(module) not in present or who is not None:
                remove(module)
                if who is not None:
                    rank_zero_warn(
                        f"ActivationCheckpointing: `{type(module).__name__}` is also checkpointed by {who} (e.g. "
                        "`FSDPStrategy(activation_checkpointing_policy=...)`); the callback's injection is removed to "
                        "avoid checkpointing it twice. Configure only one of them."
                    )
            else:
                kept.append(module)
        self._injected = kept
        if self.memory_budget is None:
            selected = self._candidates[self.every_n - 1 :: self.every_n]
            chosen = {id(m) for _, m in selected}
            for module in [m for m in self._injected if id(m) not in chosen]:
                remove(module)
            self._injected = [m for m in self._injected if id(m) in chosen]
            self._inject(root, selected)

    # -- Lightning hooks ----------------------------------------------------------------------------------------------
    @instance_hook  # `callbacks=[ActivationCheckpointing]`, the class, is refused with the fix
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._pending = True
        self.checkpointed_modules, self.saved_bytes_before, self.saved_bytes_after = [], None, None
        if self.memory_budget is not None and not pl_module.automatic_optimization:
            raise ValueError(
                "ActivationCheckpointing: `memory_budget` plans on a measuring forward of `training_step`, which "
                "cannot be run in isolation with manual optimization (it steps the optimizers). Select the modules "
                "with `targets`/`every_n` instead."
            )
        device = trainer.strategy.root_device
        self._offload_device = self.offload and device.type != "cpu"
        if self.offload and not self._offload_device:
            rank_zero_warn(
                "ActivationCheckpointing: `offload=True` has no effect on CPU (activations already live in host "
                "memory); training runs without offloading."
            )
        if not select_modules(pl_module, self._targets):
            if is_overridden("configure_model", pl_module):
                return  # the targets may be created in `configure_model`; checked again at `on_fit_start`
            raise ValueError(no_match_message(pl_module, self._targets))
        self.apply(pl_module)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._candidates = select_modules(pl_module, self._targets)
        if not self._candidates:
            raise ValueError(no_match_message(pl_module, self._targets))
        self._reconcile(pl_module)
        self._update_names()
        if not self.measure:
            self._log_summary(None, None)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._pending:
            self._pending = False
            if self.measure:
                self._measure_and_plan(trainer, pl_module, batch, batch_idx)
        if self._offload_device and self._offload_ctx is None:
            self._offload_ctx = torch.autograd.graph.save_on_cpu(pin_memory=trainer.strategy.root_device.type == "cuda")
            self._offload_ctx.__enter__()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self._end_offload()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._end_offload()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning does not call `teardown` when `fit` raises: the model must come back unpatched here too.
        self._restore()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._restore()

    def _restore(self) -> None:
        """End offloading and remove every injection: the model is returned as it was given."""
        self._end_offload()
        for module in self._injected:
            remove(module)
        self._injected = []

    def _end_offload(self) -> None:
        if self._offload_ctx is not None:
            ctx, self._offload_ctx = self._offload_ctx, None
            ctx.__exit__(None, None, None)

    # -- measuring step, plan and summary ------------------------------------------------------------------------------
    def _measure_and_plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if not pl_module.automatic_optimization:
            self._log_summary(None, None, ["not measured: the measuring forward needs automatic optimization"])
            return
        planning = self.memory_budget is not None
        try:
            with bypass_checkpointing():
                probe = planning and self.mode == "selective"
                before = self._measure(trainer, pl_module, batch, batch_idx, self._candidates, probe)
            footer = self._plan(trainer, pl_module, before) if planning else []
            injected = [(n, m) for n, m in self._candidates if any(m is i for i in self._injected)]
            after = self._measure(trainer, pl_module, batch, batch_idx, injected, self.mode == "selective")
        except Exception as err:
            if planning:
                raise
            rank_zero_warn(f"ActivationCheckpointing: could not measure the saved activations ({err!r}).")
            self._log_summary(None, None)
            return
        if self._offload_device:
            outside = after.held(range(len(injected))) - after.checkpoint_held
            footer.append(f"offload: {format_bytes(outside)} saved outside checkpointed modules go to host memory")
        self._log_summary(before, after, footer)

    def _measure(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        candidates: list[tuple[str, nn.Module]],
        selective: bool,
    ) -> ActivationProfile:
        strategy = trainer.strategy
        with contextlib.ExitStack() as stack:
            stack.enter_context(replay(pl_module))  # compiled code runs eagerly inside: the planner sees every op
            if isinstance(strategy.model, DistributedDataParallel):
                stack.enter_context(strategy.model.no_sync())
            return measure_saved_activations(
                lambda: strategy.training_step(batch, batch_idx),
                pl_module,
                candidates,
                selective=selective,
                exclude=[t for t in tree_leaves(batch) if isinstance(t, Tensor)],
            )

    def _plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule, before: ActivationProfile) -> list[str]:
        assert self.memory_budget is not None
        budget = budget_bytes(self.memory_budget, before.held())
        chosen, met = plan_checkpointing(before, budget)
        # Every rank must checkpoint the same modules: rank 0's plan (on its batch) is the plan.
        chosen, met = trainer.strategy.broadcast((chosen, met), src=0)
        self._inject(pl_module, [self._candidates[i] for i in chosen])
        what = f"{self.memory_budget:.0%} of {format_bytes(before.held())}" if self.memory_budget <= 1 else "bytes"
        line = f"memory budget {format_bytes(budget)} ({what}): {len(chosen)} of {len(self._candidates)} modules"
        if not met:
            rank_zero_warn(
                f"ActivationCheckpointing: the memory budget of {format_bytes(budget)} cannot be met by checkpointing "
                f"the modules `targets={self.targets}` select; all {len(chosen)} that help are checkpointed. Target "
                "more modules, use `offload=True`, or a smaller batch."
            )
            line += " (budget NOT met)"
        return [line]

    def _update_names(self) -> None:
        injected = {id(m) for m in self._injected}
        self.checkpointed_modules = [name for name, m in self._candidates if id(m) in injected]

    def _log_summary(
        self, before: ActivationProfile | None, after: ActivationProfile | None, footer: list[str] | None = None
    ) -> None:
        self._update_names()
        injected = {id(m) for m in self._injected}
        rows = [
            (name, user_class(m).__name__, before.module_bytes(i) if before else None, id(m) in injected)
            for i, (name, m) in enumerate(self._candidates)
        ]
        selection = f"every_n={self.every_n}" if self.memory_budget is None else f"memory_budget={self.memory_budget}"
        header = (
            f"ActivationCheckpointing: {len(injected)} of {len(rows)} matching modules checkpointed "
            f"(mode={self.mode!r}, targets={self.targets}, {selection})"
        )
        self.saved_bytes_before = before.held() if before is not None else None
        self.saved_bytes_after = after.held(range(len(after.names))) if after is not None else None
        rank_zero_info(
            format_summary(header, rows, self.saved_bytes_before, self.saved_bytes_after, footer or [])
            + ("\n  (measured on the first training batch, without backward)" if before else "")
        )
