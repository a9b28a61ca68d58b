"""The two guards of the gradient path: :class:`NonFiniteGuard` (NaN/Inf) and :class:`SpikeGuard` (z-score spikes).

Both guards decide on device, in the shared per-step engine (stage ``GUARD``), from values that are identical on
every rank: gradient statistics after the DDP all-reduce, and per-rank loss values summed in the engine's single
collective. So every rank takes the same decision and no extra collective is issued (except once per detection,
when the ranks' findings are gathered for the report). When and how the host learns of a flagged step depends on
``action`` (:mod:`~lightning_gradkit.callbacks.guard_reporting`).

The rest of the guards lives beside this file, one concept per file:

- :mod:`~lightning_gradkit.callbacks.guard_reporting`: the base both guards share, and the device ledger of the
  steps flagged between two host reads;
- :mod:`~lightning_gradkit.callbacks.loss_window`: the value ``SpikeGuard`` (and ``SpikeRollback``) watches;
- :mod:`~lightning_gradkit.callbacks.culprit`: where a non-finite step began, and the sentence that says so;
- :mod:`~lightning_gradkit.callbacks.nonfinite_validation`: ``NonFiniteGuard``'s validation checks.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from gradkit._arguments import check_bool, check_choice, check_float, check_int
from gradkit.host_lag import HostLag, as_float32
from gradkit.norms import nonfinite_mask
from gradkit.protocol import StepContext
from gradkit.replay import RNGState, capture_rng
from gradkit.running import HostMoments
from lightning_gradkit._deepspeed import SKIPPING_INSTEAD, deepspeed_step, refuse_under_deepspeed, uses_deepspeed
from lightning_gradkit.callbacks.culprit import (
    Culprit,
    first_bad_batch,
    id_list,
    locate_culprit,
    nonfinite_kind,
    reproducibility,
    sample_ids,
    step_summary,
)
from lightning_gradkit.callbacks.guard_reporting import GuardBase
from lightning_gradkit.callbacks.loss_window import WatchesLossOrGradNorm, WindowLoss, unscaled_loss
from lightning_gradkit.callbacks.nonfinite_validation import NonFiniteValidationCheck
from lightning_gradkit.engine import StatsRequest, StepPlan, is_logging_step, world_size
from lightning_gradkit.forensics import Finding, describe_error, replay_training_step

__all__ = ["NonFiniteGuard", "SpikeGuard"]


def _rank() -> int:
    return dist.get_rank() if world_size() > 1 else 0


def _gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (a collective: all ranks must call it at the same point)."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def _last_checkpoint(trainer: pl.Trainer | None) -> str:
    if trainer is None:
        return "keep checkpoints of the loop to resume from"
    paths = [cb.last_model_path or cb.best_model_path for cb in trainer.checkpoint_callbacks]
    paths = [p for p in paths if p]
    if not paths:
        return "no checkpoint was saved (add a `ModelCheckpoint` callback to keep one)"
    return "last checkpoint saved: " + ", ".join(paths)


def _replay_available(trainer: pl.Trainer | None, pl_module: pl.LightningModule | None) -> str | None:
    """Why a forensic replay cannot run here, or ``None`` when it can."""
    if trainer is None or pl_module is None:
        return "a loop without a Lightning Trainer has no `training_step` to re-run"
    if isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy)):
        return "sharded parameters: a replay would need the strategy's collectives"
    if not pl_module.automatic_optimization:
        return "manual optimization: the training step steps optimizers itself"
    return None


class NonFiniteGuard(NonFiniteValidationCheck):
    r"""Catch NaN/Inf in the loss or the gradients: skip the step, raise, or warn; and name where it began.

    Every optimizer step the guard checks the loss of each micro-batch (in ``on_before_backward``, on device) and
    the gradients (the finite flag of the step's shared gradient statistics, after unscaling and the DDP
    all-reduce). A loss that is non-finite on one rank only flags the step on every rank, and so do gradients that
    turn non-finite on one rank after the all-reduce (a gradient hook, ``on_after_backward``): the per-rank flags
    travel in the engine's single collective, so every rank takes the same decision.

    ``action``:

    - ``"skip"`` (needs a GradKit strategy, e.g. ``Trainer(strategy="gradkit")``): the optimizer does not step.
      Parameters and optimizer state (Adam moments and step counts included) stay bitwise unchanged, gradients are
      cleared, step-interval LR schedulers do not advance, ``gradkit/skipped_steps`` counts it.
      ``trainer.global_step`` still counts the attempted step (as Lightning does for a step the fp16
      ``GradScaler`` skips). After ``max_consecutive`` flagged steps in a row, training stops with an error that
      lists the steps, what was non-finite, and the last checkpoint.
    - ``"raise"``: raise before the optimizer steps (one host read of the flag per step; any strategy).
    - ``"warn"``: let the update happen, count the flagged steps on device and report them on logging steps.

    Forensics: on the first detection (not on every step), the micro-batches of the bad step are replayed once
    under a dispatch mode that sees every aten operator of the forward and of the backward (see
    :mod:`lightning_gradkit.forensics`). The replay follows the non-finite loss (else the non-finite gradients) back
    to the operator that made it from finite values, and names the module it ran in (for an operator of the
    backward, the module whose forward it differentiates), the operator (``aten.div.Tensor``) and the user's source
    line. Infinities that a later operator makes finite again (a ``-inf`` attention mask before a softmax) are never
    named; in-place operators (``ReLU(inplace=True)``) replay as they trained. The replay needs the detection at the
    bad step, so it runs with ``action="raise"`` and with ``action="skip"`` and an ordinary optimizer, on
    single-device and DDP strategies. Its cost, a host read per operator, is paid once; the training steps do not
    pay for it.

    - A replay that raises is reported as ``"failed"`` with its error, one that cannot run as ``"unavailable"`` with
      the reason: the event and the message say so (never that the replay stayed finite), and the culprit then
      comes from the loss or the gradients.
    - What the replay covers: ``training_step`` and its backward, nothing after them. The event's
      ``reproducible`` is ``True`` when the replay made the non-finite value again (the data or the model), else
      ``None`` with a ``reproducible_reason``: a replay that stayed finite proves no verdict, since a value made
      deterministically outside it (a hook such as ``on_after_backward``, a callback, the optimizer) stays finite
      in the replay as a non-deterministic hardware fault does.
    - What the replay restores: RNG states, buffers, gradients, and the state of every ``torchmetrics`` metric of
      the LightningModule (a metric updated in ``training_step`` is not counted twice); ``self.log`` does nothing.
    - What it cannot restore: ``training_step`` runs again, so its other Python side effects (a counter it
      increments, a print, a list it appends to) happen once more per replayed micro-batch.
    - Collectives: every rank replays every micro-batch of the step, in order, also after it has found its
      culprit, so a collective inside ``training_step`` (``self.all_gather``, a contrastive loss, a metric synced
      on step) pairs up across ranks as in training. ``detect_anomaly`` applies to single-process runs only: it
      raises inside the backward on the ranks that see the NaN only, which would leave a collective of the backward
      (``all_gather(..., sync_grads=True)``) unpaired.

    Events: each is one JSON line in ``gradkit_events.jsonl`` in the logger's directory (written by rank 0,
    gathered from all ranks); the console line, the event and the error say the same. ``step`` is the optimizer
    step, ``batch_idx`` the micro-batch where the non-finite value was first seen (the replay's, else the first
    micro-batch with a non-finite loss, else the step's last micro-batch), ``batches`` the micro-batches of the
    step. ``culprit`` has one meaning in every mode: the earliest point of the step's computation where a
    non-finite value was seen. A replay, when one ran and reproduced it, localizes it (a module name, ``"<batch>"``,
    ``"<loss>"`` or a parameter; each rank's finding in ``values.forensics`` adds its ``phase``, ``op`` and
    ``source``); without one, a non-finite loss on some rank gives ``"<loss>"`` (the value was already non-finite
    there; a replay would name the module), and otherwise the culprit is the first parameter (in the optimizer's
    order) whose gradient was non-finite on some rank. ``culprit_source`` says which (``"replay"``,
    ``"loss"`` or ``"gradients"``). ``action="warn"`` and fused optimizers never replay (the flag is read on logging
    steps only), so their culprit comes from the loss or the gradients.

    With the fp16 ``GradScaler``, non-finite gradients under a finite loss are the scaler's routine overflow (its
    first steps at the default scale 65536 overflow often): the scaler skips the step itself and lowers its scale.
    That is the scaler's skip, not the guard's: it is not counted in ``gradkit/skipped_steps`` (nor in
    ``GradKit.skipped_steps``), the buffers the step's forwards wrote are kept and LR schedulers step, as without the
    guard. The guard records it as an ``"fp16_overflow"`` event and counts it toward ``max_consecutive``, without a
    warning or a replay. A non-finite loss is the guard's skip, counted as usual.

    Under Lightning's ``DeepSpeedStrategy`` (see :mod:`lightning_gradkit._deepspeed`): ``"warn"`` and ``"raise"``
    only (``"skip"`` is refused at setup: the DeepSpeed engine steps inside ``engine.step()``). The loss of each
    micro-batch is checked before DeepSpeed steps (``"raise"`` stops with the parameters unchanged), the gradients
    through DeepSpeed's global norm after its step (``engine.get_global_grad_norm()``; DeepSpeed's own overflow check
    has then skipped the step, or, without one, applied it). A step DeepSpeed skips under fp16 is its loss scaler's
    routine and not flagged. No replay runs.

    Validation (``check_validation``): a non-finite validation loss (the tensor returned by ``validation_step``
    or its ``"loss"`` entry, and logged metrics whose name starts with ``val`` and contains ``loss``) is reported
    as an event and a warning once per validation run; with ``stop_on_nonfinite_validation`` training stops
    (``trainer.should_stop``).

    Args:
        action: ``"skip"``, ``"raise"`` or ``"warn"``.
        check_loss: check each micro-batch loss.
        check_grads: check the gradients (one finite flag from the step's shared norms: no extra pass).
        max_consecutive: stop after this many flagged steps in a row (``>= 1``).
        forensics: replay the first bad step's micro-batches to name the culprit module (``training_step`` runs
            again: see "Forensics" above).
        detect_anomaly: run that single replay under ``torch.autograd.detect_anomaly(check_nan=True)`` as well
            (single-process runs only).
        check_validation: report non-finite validation losses.
        stop_on_nonfinite_validation: stop training on a non-finite validation loss.

    Raises:
        ValueError: on an unknown ``action``, ``max_consecutive < 1``, a non-bool flag, or with both
            ``check_loss`` and ``check_grads`` false.
        RuntimeError: at setup, for ``action="skip"`` on a strategy that cannot skip steps (the message names the
            GradKit strategy to use); during training, for ``action="raise"`` on a non-finite step and after
            ``max_consecutive`` flagged steps in a row.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import NonFiniteGuard
        >>> trainer = Trainer(strategy="gradkit", accelerator="cpu", callbacks=[NonFiniteGuard(action="skip")])
    """

    def __init__(
        self,
        action: Literal["skip", "raise", "warn"] = "skip",
        check_loss: bool = True,
        check_grads: bool = True,
        max_consecutive: int = 10,
        forensics: bool = True,
        detect_anomaly: bool = False,
        check_validation: bool = True,
        stop_on_nonfinite_validation: bool = False,
    ) -> None:
        action = check_choice("action", action, ("skip", "raise", "warn"))
        super().__init__(action, check_validation, stop_on_nonfinite_validation)
        self.check_loss = check_bool("check_loss", check_loss)
        self.check_grads = check_bool("check_grads", check_grads)
        if not (check_loss or check_grads):
            raise ValueError(
                "`check_loss=False` and `check_grads=False` leave the guard nothing to check. Set one of them to True "
                "(both by default), or remove the NonFiniteGuard."
            )
        self.max_consecutive = check_int("max_consecutive", max_consecutive)
        self.forensics = check_bool("forensics", forensics)
        self.detect_anomaly = check_bool("detect_anomaly", detect_anomaly)
        self._loss_bad: Tensor | None = None
        self._losses: list[Tensor] = []
        self._batches: list[tuple[Any, int, RNGState]] = []
        self._window: list[int] = []
        self._ids: list[Any] = []
        self._flags: tuple[Tensor, Tensor | None, Tensor | None, Tensor | None] | None = None
        self._consecutive: list[int] = []
        self._first_finding: dict[str, Any] | None = None
        self._forensics_done = False
        self._param_names: list[str] = []
        self._key = f"{self.state_key}/loss_nonfinite_ranks"
        # Under DeepSpeed: the engine's step and skip counts at the last batch end, the flagged steps counted on
        # device (warn) and how many of them were reported.
        self._deepspeed = False
        self._ds_steps = 0
        self._ds_skipped = 0
        self._ds_flagged: Tensor | None = None
        self._ds_reported = 0
        self._ds_skipped_reported = 0
        self._ds_warned_no_norm = False

    @property
    def state_key(self) -> str:
        return self._generate_state_key(action=self.action)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._scaler = getattr(trainer.precision_plugin, "scaler", None) is not None
        self._deepspeed = uses_deepspeed(trainer)
        if stage == "fit" and self.forensics and self.detect_anomaly and trainer.world_size > 1:
            rank_zero_warn(
                "NonFiniteGuard(detect_anomaly=True): anomaly mode is not used for the replay in a multi-process run "
                "(it raises inside the backward on the ranks that see the NaN only, leaving the other ranks waiting "
                "in a collective of the backward). The replay still names the culprit module."
            )

    # -- per micro-batch ---------------------------------------------------------------------------------------
    def attach(self, ctx: StepContext, model: torch.nn.Module) -> None:
        super().attach(ctx, model)
        self._scaler = ctx.loss_scale_source() is not None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._deepspeed:  # no replay under DeepSpeed: nothing of the batch is kept
            return
        self._window.append(batch_idx)
        if self._reads_on_host():
            self._ids.append(sample_ids(batch))  # a reference: read to the host on a flagged step only
        if self.forensics and not self._forensics_done and self._reads_on_host():
            # A reference (no copy) and the torch RNG state, so the replay repeats this batch's dropout masks.
            self._batches.append((batch, batch_idx, capture_rng(full=False)))

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self.check_loss:
            self._add_loss(unscaled_loss(trainer, loss))

    def note_loss(self, loss: Tensor, ctx: StepContext) -> None:
        # Outside a Trainer, each loss handed over is one micro-batch of the window (`on_train_batch_start` there).
        self._window.append(ctx.batch_idx)
        if self.check_loss:
            self._add_loss(loss.detach().float())

    def _add_loss(self, loss: Tensor) -> None:
        """Check a micro-batch loss (without the AMP scale) on device: no host sync."""
        bad = nonfinite_mask(loss)
        bad = bad if bad.dim() == 0 else bad.any()
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad
        self._losses.append(loss)

    # -- under DeepSpeed: the loss before its step, its global norm after -------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._deepspeed:
            super().on_fit_start(trainer, pl_module)
            return
        step = deepspeed_step(trainer.strategy)
        self._ds_steps, self._ds_skipped = step.steps, step.skipped
        self._ds_flagged = None
        self._ds_reported = 0
        self._ds_skipped_reported = step.skipped

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if not self._deepspeed:
            super().on_before_optimizer_step(trainer, pl_module, optimizer)
        elif self.action == "raise" and self._loss_bad is not None and bool(self._loss_bad):
            self._deepspeed_flagged(trainer, "loss", "DeepSpeed has not stepped: the parameters are unchanged.")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._deepspeed:
            self._check_deepspeed_step(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._deepspeed:
            self._report_deepspeed(trainer)
        else:
            super().on_train_end(trainer, pl_module)

    def _check_deepspeed_step(self, trainer: pl.Trainer) -> None:
        """After a DeepSpeed optimizer step: flag a non-finite loss of its window or a non-finite global norm.

        DeepSpeed's optimizers that measure the norm skip a step whose norm is not finite (``engine.skipped_steps``
        moves, the norm reads ``inf``); under fp16 that is the loss scaler's routine overflow and is not flagged for
        its gradients. ``raise`` reads the flag every step; ``warn`` counts on device and reports on logging steps.
        """
        step = deepspeed_step(trainer.strategy)
        if step.steps == self._ds_steps:  # inside an accumulation window: the loss flag waits for the step
            return
        skipped_by_deepspeed = step.skipped > self._ds_skipped
        self._ds_steps, self._ds_skipped = step.steps, step.skipped
        loss_bad, self._loss_bad, self._losses = self._loss_bad, None, []
        fp16 = str(trainer.precision_plugin.precision).startswith("16")
        grads_bad = None
        if self.check_grads and step.grad_norm is not None and not (skipped_by_deepspeed and fp16):
            grads_bad = ~torch.isfinite(step.grad_norm)
        elif self.check_grads and step.grad_norm is None and not self._ds_warned_no_norm:
            self._ds_warned_no_norm = True
            rank_zero_warn(
                "NonFiniteGuard: the DeepSpeed engine computed no global gradient norm (ZeRO stage 0 in full "
                "precision steps the torch optimizer directly), so only the loss is checked under this config."
            )
        flags = [f for f in (loss_bad, grads_bad) if f is not None]
        if not flags:
            return
        device = flags[0].device
        bad = torch.stack([f.to(device) for f in flags]).any()
        if self.action == "raise":
            if bool(bad):
                applied = "DeepSpeed skipped this step itself." if skipped_by_deepspeed else "DeepSpeed applied it."
                self._deepspeed_flagged(trainer, "loss or global gradient norm", applied)
            return
        bad = bad.to(torch.float32)
        self._ds_flagged = bad if self._ds_flagged is None else self._ds_flagged + bad
        if is_logging_step(trainer, None):
            self._report_deepspeed(trainer)

    def _deepspeed_flagged(self, trainer: pl.Trainer, what: str, applied: str) -> None:
        """``action="raise"`` under DeepSpeed: record the event and raise."""
        self._write(trainer, rank=None, what="nonfinite", culprit=None, values={"deepspeed_step": self._ds_steps})
        raise RuntimeError(
            f"NonFiniteGuard: non-finite {what} at optimizer step {trainer.global_step} under DeepSpeed. {applied} "
            "Under DeepSpeed the guard checks each micro-batch's loss before the step and DeepSpeed's global norm "
            f"after it (no replay names the culprit module). {_last_checkpoint(trainer)}. Events: {self.events_path}."
        )

    def _report_deepspeed(self, trainer: pl.Trainer) -> None:
        """``action="warn"`` under DeepSpeed: one host read of the device count; warn about new flagged steps."""
        if self._ds_flagged is None:
            return
        count = int(self._ds_flagged)
        new, self._ds_reported = count - self._ds_reported, count
        skipped, self._ds_skipped_reported = self._ds_skipped - self._ds_skipped_reported, self._ds_skipped
        if new > 0:
            self._write(trainer, rank=None, what="nonfinite", culprit=None, values={"flagged_steps": new})
            rank_zero_warn(
                f"NonFiniteGuard: {new} DeepSpeed optimizer step(s) up to step {trainer.global_step} had a non-finite "
                f"loss or global gradient norm. DeepSpeed skipped {skipped} step(s) itself since the last report "
                f"(its overflow check, `deepspeed/skipped_steps`) and applied the others. Events: {self.events_path}."
            )

    # -- engine steps ------------------------------------------------------------------------------------------
    def request_stats(self, request: StatsRequest) -> None:
        if self.check_grads:
            request.rank_flags = True

    def reduce_request(self, ctx: StepContext) -> dict[str, Tensor]:
        if not self.check_loss or world_size() <= 1:  # one process: its own flag is the decision
            return {}
        ranks = torch.zeros(world_size(), dtype=torch.float32, device=ctx.device)
        if self._loss_bad is not None:
            ranks[_rank()] = self._loss_bad.to(torch.float32)
        return {self._key: ranks}

    def decide(self, plan: StepPlan, ctx: StepContext) -> None:
        loss_ranks = None  # per rank, 1.0 where a loss was non-finite (several processes only)
        loss_bad = None
        if self.check_loss and self._key in plan.reduced:
            loss_ranks = plan.reduced[self._key].to(plan.primary.total.device)
            loss_bad = loss_ranks.sum() > 0
        elif self.check_loss and self._loss_bad is not None:
            loss_bad = self._loss_bad.to(plan.primary.total.device)
        grads_bad = ~plan.primary.finite if self.check_grads else None
        if loss_bad is not None and grads_bad is not None:
            bad = loss_bad | grads_bad
        else:
            bad = next((t for t in (loss_bad, grads_bad) if t is not None), None)
            if bad is None:  # only the loss is checked, and no loss was handed over this step
                bad = torch.zeros((), dtype=torch.bool, device=plan.primary.total.device)
        self._flags = (bad, loss_ranks, loss_bad, grads_bad)
        if self.action == "skip":
            # Non-finite gradients under a finite loss with a GradScaler are its routine overflow: the scaler skips
            # that step itself. It is the scaler's skip, not the guard's: not counted, buffers and schedulers as
            # without the guard. The guard still records it (an "fp16_overflow" event).
            overflow = self._overflow(loss_bad, grads_bad)
            plan.add_skip(bad if overflow is None else bad & ~overflow)
        if not self._reads_on_host():
            # [flag, loss non-finite, gradients non-finite] in one op; the per-rank losses when there are ranks. The
            # per-parameter norms are kept (a reference) to name the culprit if the step turns out flagged.
            flags = torch.stack([bad, bad if loss_bad is None else loss_bad, bad if grads_bad is None else grads_bad])
            if loss_ranks is not None:
                flags = torch.cat([flags.to(loss_ranks.dtype), loss_ranks])
            self._param_names = plan.primary.names
            self._ledger.record(ctx.global_step, flags, plan.primary.param_norms)

    def _overflow(self, loss_bad: Tensor | None, grads_bad: Tensor | None) -> Tensor | None:
        """Under a GradScaler: non-finite gradients and a finite loss on every rank (a device flag, no sync); ``None``
        without a scaler or without the gradient check."""
        if not self._scaler or grads_bad is None:
            return None
        return grads_bad if loss_bad is None else grads_bad & ~loss_bad

    def decide_again(self, plan: StepPlan, first: StepPlan, ctx: StepContext) -> None:
        # A re-evaluated closure's loss belongs to no decision: the step was decided on its first evaluation.
        self._loss_bad = None
        self._losses = []

    def observe(self, plan: StepPlan, ctx: StepContext) -> None:
        try:
            if self._reads_on_host():
                self._act_at_step(plan, ctx)
            elif plan.logging_step:
                self._report_ledger(ctx)
        finally:
            self._loss_bad = None
            self._losses = []
            self._batches = []
            self._window = []
            self._ids = []

    # -- acting at the step (host knows) -----------------------------------------------------------------------
    def _act_at_step(self, plan: StepPlan, ctx: StepContext) -> None:
        assert self._flags is not None
        bad, loss_ranks, loss_bad, grads_bad = self._flags
        # Under a GradScaler the skip leaves the overflow out (see `decide`): the flag is read with it.
        if not self._flagged_on_host(plan, bad, within_skip=not (self._scaler and self.check_grads)):
            self._consecutive = []
            return
        step = ctx.global_step
        self._consecutive.append(step)
        if loss_ranks is not None:
            bad_ranks = [r for r, v in enumerate(loss_ranks.tolist()) if v > 0]
        else:
            bad_ranks = [ctx.global_rank] if loss_bad is not None and bool(loss_bad) else []
        grads_nonfinite = bool(grads_bad) if grads_bad is not None else False
        stats = plan.primary
        nonfinite = (~torch.isfinite(stats.param_norms)).cpu()
        overflow = self._scaler and grads_nonfinite and not bad_ranks
        finding: Finding | None = None
        if self.forensics and not self._forensics_done and not overflow:
            finding = self._replay(ctx)
        local = {
            "rank": ctx.global_rank,
            # As training_step returned them (Lightning divides by the accumulation count before the backward).
            "losses": [v * ctx.accumulate_grad_batches for t in self._losses for v in t.reshape(-1).tolist()],
            "params": nonfinite.nonzero().flatten().tolist(),
            "finding": None
            if finding is None
            else {"culprit": finding.culprit, "phase": finding.phase, **finding.detail},
            "described": None if finding is None else finding.describe(),
            "ids": [id_list(ids) for ids in self._ids],
        }
        per_rank = _gather(local)
        # Gradients can differ between ranks (a rank's own hook after the all-reduce): report every rank's.
        positions = sorted({i for r in per_rank for i in r["params"]})
        params = [stats.names[i] for i in positions]
        grad_ranks = [r["rank"] for r in per_rank if r["params"]]
        no_replay = "forensics=False" if not self.forensics else "the replay runs at the first detection only"
        culprit = locate_culprit(per_rank, bad_ranks, params, no_replay)
        window = list(self._window) or [ctx.batch_idx]
        batch = culprit.batch if culprit.batch is not None else first_bad_batch(per_rank, window)
        replay = reproducibility(per_rank)
        position = window.index(batch) if batch in window else -1
        ids = {
            str(r["rank"]): r["ids"][position]
            for r in per_rank
            if -len(r["ids"]) <= position < len(r["ids"]) and r["ids"][position] is not None
        }
        what = "fp16_overflow" if overflow else nonfinite_kind(bool(bad_ranks), grads_nonfinite)
        values = {
            "loss_nonfinite_ranks": bad_ranks,
            "grad_nonfinite_ranks": grad_ranks,
            "losses": {str(r["rank"]): r["losses"] for r in per_rank},
            "nonfinite_param_grads": params[:50],
            "grad_norm": float(stats.total),
            "consecutive": len(self._consecutive),
            "replay_reproduced_ranks": replay.reproduced_on,
        }
        findings = [dict(r["finding"], rank=r["rank"]) for r in per_rank if r["finding"] is not None]
        if findings:
            values["forensics"] = findings
        self._write(
            ctx,
            batch_idx=batch,
            batches=[window[0], window[-1]],
            rank=bad_ranks or None,
            what=what,
            culprit=culprit.name,
            culprit_source=culprit.source,
            reproducible=replay.reproducible,
            reproducible_reason=replay.reason,
            sample_ids=ids or None,
            values=values,
        )
        summary = step_summary(step, batch, window, what, bad_ranks, grad_ranks, params, culprit, replay, ids)
        if finding is not None and self._first_finding is None:
            self._first_finding = {"step": step, "culprit": culprit.name, "described": culprit.text}
        if self.action == "raise":
            raise RuntimeError(f"NonFiniteGuard: {summary}{self._events_note}")
        if len(self._consecutive) >= self.max_consecutive:
            self._stop(ctx, len(self._consecutive), self._consecutive[0], step, summary)
        if not overflow:
            ctx.warn(
                f"NonFiniteGuard: {summary} The optimizer step was {'skipped' if self.action == 'skip' else 'applied'}."
                f"{self._events_note}"
            )

    def _replay(self, ctx: StepContext) -> Finding:
        """Replay the step's micro-batches; the first one that reproduces a non-finite value names the culprit.

        Collective-safe: every rank replays every micro-batch, in order, whatever it found before, so the
        collectives that ``training_step`` issues pair up across ranks as they did in training.
        """
        self._forensics_done = True
        trainer, pl_module = ctx.trainer, ctx.pl_module
        reason = _replay_available(trainer, pl_module)
        if reason is not None:
            return Finding(None, "unavailable", {"reason": reason})
        anomaly = self.detect_anomaly and world_size() == 1
        first: Finding | None = None
        failed: Finding | None = None
        for batch, batch_idx, rng in self._batches:
            try:
                finding = replay_training_step(trainer, pl_module, batch, batch_idx, rng, anomaly=anomaly)
            except Exception as err:  # forensics must never be what stops a run
                finding = Finding(None, "failed", {"error": describe_error(err)})
            if first is None and finding.culprit is not None:
                finding.detail["batch_idx"] = batch_idx
                first = finding
            elif failed is None and finding.phase in ("failed", "unavailable"):
                # A micro-batch whose replay did not run to the end: it may be the one that made the value.
                finding.detail["batch_idx"] = batch_idx
                failed = finding
        return first or failed or Finding(None, "not_reproduced")

    def _stop(self, ctx: StepContext, count: int, first: int, last: int, summary: str) -> None:
        first_found = ""
        if self._first_finding is not None and self._first_finding["step"] != last:
            f = self._first_finding
            first_found = f" The first detection (step {f['step']}) found: {f['described']}."
        applied = (
            "" if self.action == "skip" else f" Those updates were applied: use a checkpoint from before step {first}."
        )
        raise RuntimeError(
            f"NonFiniteGuard: {count} consecutive optimizer steps had non-finite values (steps {first}-{last}); "
            f"giving up. Last one: {summary}{first_found}{applied} {_last_checkpoint(ctx.trainer)}."
            f"{self._events_note}"
        )

    # -- lazy reporting (device ledger) ------------------------------------------------------------------------
    def _report_ledger(self, ctx: StepContext) -> None:
        record = self._ledger.read()
        if record is None:
            return
        names = self._param_names
        first, last, count = int(record["first"]), int(record["last"]), int(record["count"])
        flags = record["flags"]  # [flag, loss non-finite, gradients non-finite, per-rank losses...]
        loss_ranks = flags[3:] if len(flags) > 3 else [flags[1] if self.check_loss else 0]
        bad_ranks = [r if len(flags) > 3 else ctx.global_rank for r, v in enumerate(loss_ranks) if v > 0]
        grads = self.check_grads and bool(flags[2])
        param = None
        if grads and names:  # the first parameter with a non-finite gradient (a logging step: the read is allowed)
            param = names[int(nonfinite_mask(record["keep"]).to(torch.float32).argmax())]
        what = nonfinite_kind(bool(bad_ranks), grads)
        if self._scaler and grads and not bad_ranks:
            what = "fp16_overflow"
        run, run_first, run_last = int(record["max_run"]), int(record["max_run_first"]), int(record["max_run_last"])
        values = {"flagged_steps": count, "first_step": first, "last_step": last, "longest_run": run}
        if bad_ranks:
            culprit = Culprit("<loss>", "loss", "", None)
        else:
            culprit = Culprit(param, "gradients" if param is not None else None, "", None)
        self._write(
            ctx,
            rank=bad_ranks or None,
            what=what,
            culprit=culprit.name,
            culprit_source=culprit.source,
            reproducible=None,
            reproducible_reason="no replay ran (steps reported lazily, on logging steps, are never replayed)",
            values=values,
            first_step=first,
        )
        detail = []
        if bad_ranks:
            detail.append(f"loss non-finite on rank(s) {bad_ranks}")
        if bad_ranks:
            detail.append("culprit `<loss>`: the loss was already non-finite (no replay in this mode)")
        elif param is not None:
            detail.append(f"culprit `{param}`: the first parameter with a non-finite gradient (no replay in this mode)")
        verb = "skipped" if self.action == "skip" else "applied"
        summary = (
            f"{count} optimizer step(s) with non-finite values between steps {first} and {last} (updates {verb}); "
            f"at step {first}: {'; '.join(detail) or 'non-finite values'}."
        )
        if run >= self.max_consecutive:
            self._stop(ctx, run, run_first, run_last, summary)
        if what != "fp16_overflow":
            ctx.warn(f"NonFiniteGuard: {summary}{self._events_note}")

    # -- state -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "consecutive": list(self._consecutive),
            "forensics_done": self._forensics_done,
            "first_finding": self._first_finding,
            **self._skipped_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._consecutive = list(state_dict.get("consecutive", []))
        self._forensics_done = bool(state_dict.get("forensics_done", False))
        self._first_finding = state_dict.get("first_finding")
        self._restored_skips = float(state_dict.get("skipped_steps", 0.0))


class SpikeGuard(WatchesLossOrGradNorm, GuardBase):
    r"""Detect loss or gradient-norm spikes with a running z-score: warn, skip the step, or raise.

    Each optimizer step, the monitored value ``x`` (the loss averaged over the accumulation window and over ranks,
    or the total 2-norm of the gradients) is compared with NaN-masked running statistics: ``z = (x - mean) / std``;
    ``z > z_threshold`` after ``warmup_steps`` finite values is a spike. The statistics are Python floats fed with
    each value one step late (a non-blocking copy to the host: the decision of a step needs the statistics of the
    steps before it only), so deciding is one comparison on device and never a host sync. The statistics
    are an exponential moving average (``alpha``) or, with ``window``, the last ``window`` finite values; they are
    fed with ``x`` clamped to ``mean + z_threshold * std`` (as ZClip, Kumar et al. 2025, does), so a spike does not
    inflate them and a lasting level shift is absorbed gradually. Non-finite values are ignored (masked, they never
    poison the statistics): catching them is :class:`NonFiniteGuard`'s job.

    The decision is identical on every rank: the loss of each rank travels in the engine's single collective, and
    gradient norms are global. No host synchronization is needed to decide; ``action`` says when one happens:

    - ``"warn"``: spikes are reported (warning + event) on logging steps.
    - ``"skip"`` (needs a GradKit strategy): the optimizer step is skipped as :class:`NonFiniteGuard` skips it.
    - ``"raise"``: one host read per step; raises before the optimizer steps.

    Unlike Lightning's ``SpikeDetection`` (loss only, a barrier and a collective every batch, raise only, no
    working ``load_state_dict``), the state round-trips through checkpoints: a resumed run takes the same
    decisions as an uninterrupted one.

    Args:
        monitor: ``"loss"`` or ``"grad_norm"``.
        z_threshold: spike threshold in standard deviations (> 0). Default 6.0.
        alpha: EMA decay of the history, in ``(0, 1)``; default 0.97 (ZClip's default). Ignored with ``window``.
        window: keep the last ``window`` finite values instead of an EMA (>= ``warmup_steps``).
        warmup_steps: finite values seen before any decision (>= 2). Default 25 (ZClip's default).
        action: ``"warn"``, ``"skip"`` or ``"raise"``.

    Raises:
        ValueError: on an unknown ``monitor`` or ``action``, ``z_threshold <= 0``, ``alpha`` outside ``(0, 1)``,
            ``window < warmup_steps`` or ``warmup_steps < 2``.
        RuntimeError: at setup, for ``action="skip"`` on a strategy that cannot skip steps; during training, for
            ``action="raise"`` on a spike.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import SpikeGuard
        >>> trainer = Trainer(strategy="gradkit", accelerator="cpu", callbacks=[SpikeGuard("loss", action="skip")])
    """

    def __init__(
        self,
        monitor: Literal["loss", "grad_norm"] = "loss",
        z_threshold: float = 6.0,
        alpha: float = 0.97,
        window: int | None = None,
        warmup_steps: int = 25,
        action: Literal["warn", "skip", "raise"] = "warn",
    ) -> None:
        super().__init__(check_choice("action", action, ("warn", "skip", "raise")))
        self.monitor = check_choice("monitor", monitor, ("loss", "grad_norm"))
        self.z_threshold = check_float("z_threshold", z_threshold, above=0.0)
        self.alpha = check_float("alpha", alpha, above=0.0, below=1.0, hint="A typical value is 0.97.")
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 2)
        if window is not None:
            check_int("window", window)
            if window < self.warmup_steps:
                raise ValueError(
                    f"`window` must hold at least `warmup_steps` values, got window={window!r} and "
                    f"warmup_steps={self.warmup_steps!r}. Enlarge the window or lower `warmup_steps`."
                )
        self.window = window
        # Host statistics, fed each step's value one step late (see `core.host_lag`): a step's decision is one
        # comparison on device with the threshold of the steps before it.
        self._stats = HostMoments(self.alpha, window)
        self._lag = HostLag()
        self._pending: tuple[int, float] | None = None  # the step whose value is on its way, and its threshold
        self._flagged: list[tuple[int, float, float, float, float]] = []  # (step, value, z, mean, std) to report
        self._window_loss = WindowLoss()
        self._step: tuple[Tensor, Tensor] | None = None
        self._spikes = 0
        self._key = f"{self.state_key}/loss_sum"

    @property
    def state_key(self) -> str:
        return self._generate_state_key(monitor=self.monitor, window=self.window, alpha=self.alpha)

    def _refuse_deepspeed(self, trainer: pl.Trainer) -> None:
        skip = self.action == "skip"
        refuse_under_deepspeed(
            trainer,
            f"`SpikeGuard(monitor={self.monitor!r}, action={self.action!r})`",
            "it decides inside gradkit's per-step engine, before the optimizer steps, from the gradients in `.grad`; "
            "the DeepSpeed engine keeps the gradients in its own buffers (ZeRO) and steps in `engine.step()`, so that "
            "engine does not run" + (", and no callback can hold back DeepSpeed's step" if skip else ""),
            (
                f"DeepSpeed has no spike skip: {SKIPPING_INSTEAD}"
                if skip
                else "Watch the spikes in GradNormMonitor's `grad_norm/total` (DeepSpeed's global norm) instead."
            ),
        )

    def decide(self, plan: StepPlan, ctx: StepContext) -> None:
        x = self._watched_value(plan)
        self._fold()
        threshold = self._stats.threshold(self.z_threshold, self.warmup_steps)
        # A finite value above the threshold; NaN and Inf never are (they are NonFiniteGuard's).
        spike = torch.nan_to_num(x, nan=-math.inf, posinf=-math.inf) > threshold
        self._lag.push(x.reshape(1))
        self._pending = (ctx.global_step, threshold)
        self._step = (spike, x)
        if self.action == "skip":
            plan.add_skip(spike)

    def _fold(self) -> None:
        """Feed the statistics with the value of the step on its way to the host; keep it to report if it was a
        spike and this guard reports later (``action="warn"``, a fused optimizer's skip)."""
        values = self._lag.pop()
        if values is None or self._pending is None:
            return
        (x,), (step, threshold) = values, self._pending
        self._pending = None
        # The device compared the fp32 value with the fp32 rounding of the threshold: the same test here.
        spike = math.isfinite(x) and x > as_float32(threshold)
        if spike and not self._reads_on_host():
            mean, std = self._stats.moments()[0], self._stats.std()
            self._flagged.append((step, x, (x - mean) / std, mean, std))
        self._stats.record(x, spike, self.z_threshold)

    def observe(self, plan: StepPlan, ctx: StepContext) -> None:
        assert self._step is not None
        spike, x = self._step
        if self._reads_on_host():
            if not self._flagged_on_host(plan, spike):
                return
            self._spikes += 1
            value = float(x)  # a flagged step: the host reads its decision anyway
            mean, std = self._stats.moments()[0], self._stats.std()
            culprit = None
            if self.monitor == "grad_norm":
                norms = plan.stats[2.0].param_norms
                culprit = plan.stats[2.0].names[int(norms.argmax())] if norms.numel() else None
            self._report(ctx, ctx.global_step, ctx.global_step, 1, value, (value - mean) / std, mean, std, culprit)
        elif plan.logging_step:
            self._report_ledger(ctx)

    def _report_ledger(self, ctx: StepContext) -> None:
        """Report the spikes found since the last report, this step's included (a logging step or the end of
        training: the wait for this step's value is allowed there)."""
        self._fold()
        if not self._flagged:
            return
        flagged, self._flagged = self._flagged, []
        self._spikes += len(flagged)
        step, value, z, mean, std = flagged[0]
        self._report(ctx, step, flagged[-1][0], len(flagged), value, z, mean, std, None)

    def _report(
        self,
        ctx: StepContext,
        first: int,
        last: int,
        count: int,
        value: float,
        z: float,
        mean: float,
        std: float,
        culprit: str | None,
    ) -> None:
        what = f"{self.monitor}_spike"
        values = {"value": value, "z": z, "mean": mean, "std": std, "z_threshold": self.z_threshold, "spikes": count}
        self._write(ctx, step=first, rank=None, what=what, culprit=culprit, values=values, last_step=last)
        steps = f"step {first}" if count == 1 else f"{count} steps between {first} and {last} (first at {first})"
        where = f"; largest gradient: `{culprit}`" if culprit else ""
        text = (
            f"SpikeGuard: {self.monitor} spike at {steps}: {value:.6g} is {z:.1f} standard deviations above the "
            f"running mean {mean:.6g} (std {std:.3g}, threshold {self.z_threshold}){where}."
        )
        if self.action == "raise":
            raise RuntimeError(f"{text}{self._events_note}")
        verb = "skipped" if self.action == "skip" else "applied"
        ctx.warn(f"{text} The update was {verb}.{self._events_note}")

    # -- state -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        self._fold()
        state = {
            "statistic": "window" if self.window else "ema",
            "stats": self._stats.state_dict(),
            "spikes": self._spikes,
            **self._skipped_state(),
        }
        if self._window_loss.sum is not None:
            # The losses of an accumulation window still open (a checkpoint saved mid-window): a resumed run then
            # monitors the same window mean as an uninterrupted one.
            state["window_loss"] = (self._window_loss.sum.detach().cpu(), self._window_loss.count)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        expected = "window" if self.window else "ema"
        if state_dict.get("statistic", expected) != expected:
            raise ValueError(
                f"SpikeGuard: the checkpoint holds {state_dict['statistic']!r} statistics but this SpikeGuard uses "
                f"{expected!r} (window={self.window!r}). Resume with the same arguments."
            )
        self._stats.load_state_dict(state_dict["stats"])
        self._lag.clear()
        self._pending = None
        self._spikes = int(state_dict.get("spikes", 0))
        if "window_loss" in state_dict:
            self._window_loss.sum, self._window_loss.count = state_dict["window_loss"]
        self._restored_skips = float(state_dict.get("skipped_steps", 0.0))
