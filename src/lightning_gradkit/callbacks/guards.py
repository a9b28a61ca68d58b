"""Guards on the gradient path: non-finite losses and gradients, loss and gradient-norm spikes.

Both guards decide on device, in the shared per-step engine (stage ``GUARD``), from values that are identical on
every rank: gradient statistics after the DDP all-reduce, and per-rank loss values summed in the engine's single
collective. So every rank takes the same decision and no extra collective is issued (except once per detection,
when the ranks' findings are gathered for the report).

When a guard *acts* it reads its flag to the host:

- ``action="skip"`` with an ordinary optimizer: the strategy reads the step's skip flag once anyway; the guard
  shares that read and reads more only on a skipped step (to report it).
- ``action="raise"``: one host read per step, before the optimizer steps (the bad update is never applied).
- ``action="warn"``, and ``action="skip"`` with a fused optimizer (which skips on device through ``found_inf``):
  the flagged steps are counted on device and read on logging steps (and at the end of training); the report
  covers every step flagged since the previous read.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, NamedTuple

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_gradkit._arguments import check_bool, check_choice, check_float, check_int
from lightning_gradkit.core.accumulate import mean_window_scale
from lightning_gradkit.core.norms import loss_scale
from lightning_gradkit.core.running import RunningMoments, WindowMoments, spike_decision
from lightning_gradkit.engine import Engine, GradKitCallback, Stage, StatsRequest, StepPlan, world_size
from lightning_gradkit.events import EventLog, events_dir
from lightning_gradkit.forensics import Finding, describe_error, replay_training_step
from lightning_gradkit.replay import RNGState, capture_rng, replaying
from lightning_gradkit.strategy import GradKitStrategyMixin, gradkit_strategy_hint, handles_found_inf

_MAX_NAMES = 10


# -- argument checks ----------------------------------------------------------------------------------------------
def _choice(argument: str, value: str, allowed: tuple[str, ...]) -> str:
    return check_choice(argument, value, allowed)


def _positive_int(argument: str, value: int, minimum: int = 1) -> int:
    return check_int(argument, value, minimum)


def _positive_float(argument: str, value: float) -> float:
    return check_float(argument, value, above=0.0)


def _names(names: list[str]) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:_MAX_NAMES])
    return shown + (f" and {len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else "")


def _unscaled_loss(trainer: pl.Trainer, loss: Tensor) -> Tensor:
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

    def add(self, trainer: pl.Trainer, loss: Tensor) -> None:
        loss = _unscaled_loss(trainer, loss).reshape(())
        self.sum = loss if self.sum is None else self.sum.to(loss.device) + loss
        self.count += 1

    def take(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Tensor:
        """The window's mean loss on this rank, shape ``(1,)`` (NaN for a window without a loss); starts a new one.

        Lightning divides each micro-batch loss by N before ``on_before_backward`` (automatic optimization only):
        the window's sum is then k / N of its mean, too small for the short last window of an epoch.
        """
        value = self.sum
        if value is None:
            value = torch.full((), math.nan, device=pl_module.device)
        else:
            divisor = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
            factor = mean_window_scale(divisor, self.count)
            if factor != 1.0:
                value = value * factor
        self.sum, self.count = None, 0
        return value.reshape(1).to(pl_module.device)


class WatchesLossOrGradNorm(GradKitCallback):
    """The value ``SpikeGuard`` and ``SpikeRollback`` watch each optimizer step, identical on every rank.

    ``monitor="loss"``: the window's mean loss (:class:`WindowLoss`) averaged over ranks through the engine's one
    collective; ``"grad_norm"``: the total 2-norm of the gradients the optimizer would step with. Subclasses set
    ``monitor``, ``_key`` (unique in the collective) and ``_window_loss``.
    """

    monitor: str
    _key: str
    _window_loss: WindowLoss

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self.monitor == "loss" and not replaying():
            self._window_loss.add(trainer, loss)

    def _stats_request(self, request: StatsRequest) -> None:
        if self.monitor == "grad_norm":
            request.norm_types.add(2.0)

    def _reduce_request(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Tensor]:
        if self.monitor != "loss":
            return {}
        return {self._key: self._window_loss.take(trainer, pl_module)}

    def _watched_value(self, plan: StepPlan) -> Tensor:
        if self.monitor == "loss":
            x = plan.reduced[self._key].reshape(()).to(plan.primary.total.device)
            return x / world_size() if world_size() > 1 else x
        return plan.scaled(plan.stats[2.0].total)


def _rank() -> int:
    return dist.get_rank() if world_size() > 1 else 0


def _gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (a collective: all ranks must call it at the same point)."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


class _Ledger:
    """Device-side record of the steps flagged between two host reads: recording never synchronizes.

    Keeps the number of flagged steps, the first and last flagged step, the longest run of consecutive flagged
    steps with its first and last step (a run that goes on across reads keeps its start), and named values captured
    at the first flagged step.
    """

    def __init__(self) -> None:
        self.t: dict[str, Tensor] = {}
        self.firsts: dict[str, Tensor] = {}

    def record(self, flag: Tensor, step: Tensor, firsts: dict[str, Tensor]) -> None:
        f = flag.reshape(()).bool()
        if not self.t:
            zero = torch.zeros((), dtype=torch.float32, device=f.device)
            none = zero - 1
            self.t = {"count": zero, "first": none, "last": none, "run": zero, "run_first": none, "max_run": zero}
            self.t.update(max_run_first=none, max_run_last=none)
        t = self.t
        new_first = f & (t["count"] == 0)
        t["count"] = t["count"] + f
        t["first"] = torch.where(new_first, step, t["first"])
        t["last"] = torch.where(f, step, t["last"])
        t["run_first"] = torch.where(f & (t["run"] == 0), step, t["run_first"])
        t["run"] = torch.where(f, t["run"] + 1, 0.0)
        longest = f & (t["run"] >= t["max_run"])
        t["max_run"] = torch.maximum(t["max_run"], t["run"])
        t["max_run_first"] = torch.where(longest, t["run_first"], t["max_run_first"])
        t["max_run_last"] = torch.where(longest, step, t["max_run_last"])
        for key, value in firsts.items():
            value = value.detach().to(f.device, torch.float32)
            previous = self.firsts.get(key, torch.zeros_like(value))
            self.firsts[key] = torch.where(new_first, value, previous)

    def read(self) -> dict[str, Any] | None:
        """The record as Python values (one device-to-host transfer), then start a new period; ``None`` if empty."""
        if not self.t:
            return None
        entries = {**self.t, **self.firsts}
        flat = torch.cat([v.reshape(-1) for v in entries.values()]).tolist()
        out: dict[str, Any] = {}
        offset = 0
        for key, value in entries.items():
            n = value.numel()
            out[key] = flat[offset] if value.dim() == 0 else flat[offset : offset + n]
            offset += n
        self.t["count"] = torch.zeros_like(self.t["count"])
        self.t["first"] = torch.full_like(self.t["first"], -1.0)
        # The next period's longest run starts as the run still going on (with its start, possibly before).
        self.t["max_run"] = self.t["run"].clone()
        self.t["max_run_first"] = self.t["run_first"].clone()
        self.t["max_run_last"] = torch.where(self.t["run"] > 0, self.t["last"], -1.0)
        return out if out["count"] > 0 else None


class _Guard(GradKitCallback):
    """Shared wiring: argument checks, strategy check, the event log, host-read or device-ledger reporting."""

    _stage = Stage.GUARD

    def __init__(self, action: str) -> None:
        self.action = action
        self._events: EventLog | None = None
        self._ledger = _Ledger()
        self._dev_step: Tensor | None = None
        self._fused = False
        self._restored_skips: float | None = None
        self._trainer_ref: pl.Trainer | None = None
        self._param_names: list[str] = []

    # -- Lightning hooks ---------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit" and self.action == "skip" and not isinstance(trainer.strategy, GradKitStrategyMixin):
            raise RuntimeError(
                f"{type(self).__name__}(action='skip') needs a strategy that can skip an optimizer step, but the "
                f"Trainer uses {type(trainer.strategy).__name__}. Use {gradkit_strategy_hint(trainer.strategy)}, "
                "or `action='warn'`/`'raise'`, which work with any strategy."
            )
        self._events = EventLog(events_dir(trainer), rank=trainer.global_rank)
        self._trainer_ref = trainer

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fused = any(handles_found_inf(opt) for opt in trainer.optimizers)
        self._dev_step = torch.tensor(float(trainer.global_step), device=pl_module.device)
        if self._restored_skips is not None:
            engine = Engine.of(trainer)
            engine.skipped_steps = torch.tensor(self._restored_skips, device=pl_module.device)
            self._restored_skips = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._reads_on_host():
            self._report_ledger(trainer)

    # -- shared helpers ----------------------------------------------------------------------------------------
    def _needs_step_control(self) -> bool:
        return self.action == "skip"

    def _reads_on_host(self) -> bool:
        """Whether this guard learns of a flagged step at that step (else: on logging steps, from the ledger)."""
        return self.action == "raise" or (self.action == "skip" and not self._fused)

    def _flagged_on_host(self, plan: StepPlan, flag: Tensor) -> bool:
        """Read this guard's flag when it acts at the step; shares the strategy's read of the skip decision."""
        if self.action == "skip":
            return plan.skip_on_host() and bool(flag)
        return bool(flag)

    def _advance_step(self, flag: Tensor, firsts: dict[str, Tensor]) -> None:
        if self._dev_step is None:
            self._dev_step = torch.zeros((), device=flag.device)
        self._ledger.record(flag, self._dev_step, firsts)
        self._dev_step = self._dev_step + 1

    @property
    def events_path(self) -> Path | None:
        """The ``gradkit_events.jsonl`` file this guard writes to (known after ``setup``)."""
        return self._events.path if self._events is not None else None

    def _write(self, trainer: pl.Trainer, **fields: Any) -> None:
        if self._events is not None:
            fields.setdefault("step", trainer.global_step)
            fields.setdefault("batch_idx", trainer.fit_loop.epoch_loop.batch_idx)
            self._events.write(source=type(self).__name__, action=self.action, **fields)

    def _report_ledger(self, trainer: pl.Trainer) -> None:
        """Lazy mode: read what was counted on device since the last read and report it."""

    def _skipped_state(self) -> dict[str, float]:
        """The engine's count of skipped steps, saved by every guard (all hold the same value)."""
        count = Engine.of(self._trainer_ref).skipped_steps if self._trainer_ref is not None else None
        return {"skipped_steps": float(count) if count is not None else 0.0}


def _last_checkpoint(trainer: pl.Trainer) -> str:
    paths = [cb.last_model_path or cb.best_model_path for cb in trainer.checkpoint_callbacks]
    paths = [p for p in paths if p]
    if not paths:
        return "no checkpoint was saved (add a `ModelCheckpoint` callback to keep one)"
    return "last checkpoint saved: " + ", ".join(paths)


def _replay_available(trainer: pl.Trainer, pl_module: pl.LightningModule) -> str | None:
    """Why a forensic replay cannot run here, or ``None`` when it can."""
    if isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy)):
        return "sharded parameters: a replay would need the strategy's collectives"
    if not pl_module.automatic_optimization:
        return "manual optimization: the training step steps optimizers itself"
    return None


class NonFiniteGuard(_Guard):
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

    With the fp16 ``GradScaler``, non-finite gradients under a finite loss are the scaler's routine overflow: they
    are skipped, recorded as ``"fp16_overflow"`` events and counted toward ``max_consecutive``, without a warning
    or a replay.

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
        super().__init__(_choice("action", action, ("skip", "raise", "warn")))
        self.check_loss = check_bool("check_loss", check_loss)
        self.check_grads = check_bool("check_grads", check_grads)
        if not (check_loss or check_grads):
            raise ValueError(
                "`check_loss=False` and `check_grads=False` leave the guard nothing to check. Set one of them to True "
                "(both by default), or remove the NonFiniteGuard."
            )
        self.max_consecutive = _positive_int("max_consecutive", max_consecutive)
        self.forensics = check_bool("forensics", forensics)
        self.detect_anomaly = check_bool("detect_anomaly", detect_anomaly)
        self.check_validation = check_bool("check_validation", check_validation)
        self.stop_on_nonfinite_validation = check_bool("stop_on_nonfinite_validation", stop_on_nonfinite_validation)
        self._loss_bad: Tensor | None = None
        self._losses: list[Tensor] = []
        self._batches: list[tuple[Any, int, RNGState]] = []
        self._window: list[int] = []
        self._flags: tuple[Tensor, Tensor | None, Tensor | None] | None = None
        self._consecutive: list[int] = []
        self._first_finding: dict[str, Any] | None = None
        self._forensics_done = False
        self._val_bad: Tensor | None = None
        self._val_first: Tensor | None = None
        self._key = f"{self.state_key}/loss_nonfinite_ranks"

    @property
    def state_key(self) -> str:
        return self._generate_state_key(action=self.action)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._scaler = getattr(trainer.precision_plugin, "scaler", None) is not None
        if stage == "fit" and self.forensics and self.detect_anomaly and trainer.world_size > 1:
            rank_zero_warn(
                "NonFiniteGuard(detect_anomaly=True): anomaly mode is not used for the replay in a multi-process run "
                "(it raises inside the backward on the ranks that see the NaN only, leaving the other ranks waiting "
                "in a collective of the backward). The replay still names the culprit module."
            )

    # -- per micro-batch ---------------------------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._window.append(batch_idx)
        if self.forensics and not self._forensics_done and self._reads_on_host():
            # A reference (no copy) and the torch RNG state, so the replay repeats this batch's dropout masks.
            self._batches.append((batch, batch_idx, capture_rng(full=False)))

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if not self.check_loss or replaying():
            return
        loss = loss.detach()
        bad = ~torch.isfinite(loss).all()
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad
        self._losses.append(loss)

    # -- engine steps ------------------------------------------------------------------------------------------
    def _stats_request(self, request: StatsRequest) -> None:
        if self.check_grads:
            request.rank_flags = True

    def _reduce_request(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Tensor]:
        if not self.check_loss:
            return {}
        ranks = torch.zeros(max(world_size(), 1), dtype=torch.float32, device=pl_module.device)
        if self._loss_bad is not None:
            ranks[_rank()] = self._loss_bad.to(torch.float32)
        return {self._key: ranks}

    def _decide(self, plan: StepPlan, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = plan.primary.total.device
        bad = torch.zeros((), dtype=torch.bool, device=device)
        loss_ranks = None
        grads_bad = None
        if self.check_loss:
            loss_ranks = plan.reduced[self._key].to(device)
            bad = bad | (loss_ranks.sum() > 0)
        if self.check_grads:
            grads_bad = ~plan.primary.finite
            bad = bad | grads_bad
        self._flags = (bad, loss_ranks, grads_bad)
        if self.action == "skip":
            plan.add_skip(bad)
        if not self._reads_on_host():
            firsts = {"param": (~torch.isfinite(plan.primary.param_norms)).to(torch.int64).argmax().float()}
            if loss_ranks is not None:
                firsts["loss_ranks"] = loss_ranks
            if grads_bad is not None:
                firsts["grads"] = grads_bad
            self._param_names = plan.primary.names
            self._advance_step(bad, firsts)

    def _decide_again(
        self, plan: StepPlan, first: StepPlan, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> None:
        # A re-evaluated closure's loss belongs to no decision: the step was decided on its first evaluation.
        self._loss_bad = None
        self._losses = []

    def _observe(self, plan: StepPlan, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            if self._reads_on_host():
                self._act_at_step(plan, trainer, pl_module)
            elif plan.logging_step:
                self._report_ledger(trainer)
        finally:
            self._loss_bad = None
            self._losses = []
            self._batches = []
            self._window = []

    # -- acting at the step (host knows) -----------------------------------------------------------------------
    def _act_at_step(self, plan: StepPlan, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._flags is not None
        bad, loss_ranks, grads_bad = self._flags
        if not self._flagged_on_host(plan, bad):
            self._consecutive = []
            return
        step = trainer.global_step
        self._consecutive.append(step)
        bad_ranks = [r for r, v in enumerate(loss_ranks.tolist()) if v > 0] if loss_ranks is not None else []
        grads_nonfinite = bool(grads_bad) if grads_bad is not None else False
        stats = plan.primary
        nonfinite = (~torch.isfinite(stats.param_norms)).cpu()
        overflow = self._scaler and grads_nonfinite and not bad_ranks
        finding: Finding | None = None
        if self.forensics and not self._forensics_done and not overflow:
            finding = self._replay(trainer, pl_module)
        local = {
            "rank": trainer.global_rank,
            # As training_step returned them (Lightning divides by the accumulation count before the backward).
            "losses": [
                v * trainer.accumulate_grad_batches
                for t in self._losses
                for v in _unscaled_loss(trainer, t).reshape(-1).tolist()
            ],
            "params": nonfinite.nonzero().flatten().tolist(),
            "finding": None
            if finding is None
            else {"culprit": finding.culprit, "phase": finding.phase, **finding.detail},
            "described": None if finding is None else finding.describe(),
        }
        per_rank = _gather(local)
        # Gradients can differ between ranks (a rank's own hook after the all-reduce): report every rank's.
        positions = sorted({i for r in per_rank for i in r["params"]})
        params = [stats.names[i] for i in positions]
        grad_ranks = [r["rank"] for r in per_rank if r["params"]]
        no_replay = "forensics=False" if not self.forensics else "the replay runs at the first detection only"
        culprit = _culprit(per_rank, bad_ranks, params, no_replay)
        window = list(self._window) or [trainer.fit_loop.epoch_loop.batch_idx]
        batch = culprit.batch if culprit.batch is not None else _first_bad_batch(per_rank, window)
        what = "fp16_overflow" if overflow else _what(bool(bad_ranks), grads_nonfinite)
        values = {
            "loss_nonfinite_ranks": bad_ranks,
            "grad_nonfinite_ranks": grad_ranks,
            "losses": {str(r["rank"]): r["losses"] for r in per_rank},
            "nonfinite_param_grads": params[:50],
            "grad_norm": float(stats.total),
            "consecutive": len(self._consecutive),
        }
        findings = [dict(r["finding"], rank=r["rank"]) for r in per_rank if r["finding"] is not None]
        if findings:
            values["forensics"] = findings
        self._write(
            trainer,
            batch_idx=batch,
            batches=[window[0], window[-1]],
            rank=bad_ranks or None,
            what=what,
            culprit=culprit.name,
            culprit_source=culprit.source,
            values=values,
        )
        summary = _summary(step, batch, window, what, bad_ranks, grad_ranks, params, culprit)
        if finding is not None and self._first_finding is None:
            self._first_finding = {"step": step, "culprit": culprit.name, "described": culprit.text}
        if self.action == "raise":
            raise RuntimeError(f"NonFiniteGuard: {summary} Events: {self.events_path}.")
        if len(self._consecutive) >= self.max_consecutive:
            self._stop(trainer, len(self._consecutive), self._consecutive[0], step, summary)
        if not overflow:
            rank_zero_warn(
                f"NonFiniteGuard: {summary} The optimizer step was {'skipped' if self.action == 'skip' else 'applied'}."
                f" Events: {self.events_path}."
            )

    def _replay(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Finding:
        """Replay the step's micro-batches; the first one that reproduces a non-finite value names the culprit.

        Collective-safe: every rank replays every micro-batch, in order, whatever it found before, so the
        collectives that ``training_step`` issues pair up across ranks as they did in training.
        """
        self._forensics_done = True
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

    def _stop(self, trainer: pl.Trainer, count: int, first: int, last: int, summary: str) -> None:
        first_found = ""
        if self._first_finding is not None and self._first_finding["step"] != last:
            f = self._first_finding
            first_found = f" The first detection (step {f['step']}) found: {f['described']}."
        applied = (
            "" if self.action == "skip" else f" Those updates were applied: use a checkpoint from before step {first}."
        )
        raise RuntimeError(
            f"NonFiniteGuard: {count} consecutive optimizer steps had non-finite values (steps {first}-{last}); "
            f"giving up. Last one: {summary}{first_found}{applied} {_last_checkpoint(trainer)}. "
            f"Events: {self.events_path}."
        )

    # -- lazy reporting (device ledger) ------------------------------------------------------------------------
    def _report_ledger(self, trainer: pl.Trainer) -> None:
        record = self._ledger.read()
        if record is None:
            return
        names = self._param_names
        first, last, count = int(record["first"]), int(record["last"]), int(record["count"])
        loss_ranks = record.get("loss_ranks")
        bad_ranks = [
            r for r, v in enumerate(loss_ranks if isinstance(loss_ranks, list) else [loss_ranks or 0]) if v > 0
        ]
        grads = bool(record.get("grads", 0.0))
        param = names[int(record["param"])] if grads and names else None
        what = _what(bool(bad_ranks), grads)
        if self._scaler and grads and not bad_ranks:
            what = "fp16_overflow"
        run, run_first, run_last = int(record["max_run"]), int(record["max_run_first"]), int(record["max_run_last"])
        values = {"flagged_steps": count, "first_step": first, "last_step": last, "longest_run": run}
        if bad_ranks:
            culprit = _Culprit("<loss>", "loss", "", None)
        else:
            culprit = _Culprit(param, "gradients" if param is not None else None, "", None)
        self._write(
            trainer,
            rank=bad_ranks or None,
            what=what,
            culprit=culprit.name,
            culprit_source=culprit.source,
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
            self._stop(trainer, run, run_first, run_last, summary)
        if what != "fp16_overflow":
            rank_zero_warn(f"NonFiniteGuard: {summary} Events: {self.events_path}.")

    # -- validation --------------------------------------------------------------------------------------------
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not self.check_validation:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, Tensor):
            return
        bad = ~torch.isfinite(loss.detach()).all()
        if self._val_bad is None:
            self._val_bad, self._val_first = bad, loss.detach().float().reshape(-1)[:1]
        else:
            self._val_first = torch.where(self._val_bad, self._val_first, loss.detach().float().reshape(-1)[:1])
            self._val_bad = self._val_bad | bad

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.check_validation:
            return
        device = pl_module.device
        local = torch.zeros(2, device=device)
        if self._val_bad is not None:
            local = torch.cat([self._val_bad.float().reshape(1), self._val_first.reshape(1)]).to(device)
        metrics = {
            k: float(v)
            for k, v in trainer.callback_metrics.items()
            if k.startswith("val") and "loss" in k and isinstance(v, Tensor) and v.numel() == 1
        }
        bad_metrics = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        local[0] = max(float(local[0]), float(bool(bad_metrics)))
        self._val_bad = self._val_first = None
        gathered = trainer.strategy.all_gather(local).reshape(-1, 2).tolist()
        bad_ranks = [r for r, (flag, _) in enumerate(gathered) if flag > 0]
        if not bad_ranks:
            return
        stop = self.stop_on_nonfinite_validation and not trainer.sanity_checking
        values = {"first_nonfinite_loss": {str(r): gathered[r][1] for r in bad_ranks}, "logged": bad_metrics}
        self._write(trainer, rank=bad_ranks, what="nonfinite_val_loss", culprit=None, values=values, stopped=stop)
        message = (
            f"NonFiniteGuard: non-finite validation loss at step {trainer.global_step} on rank(s) {bad_ranks}"
            f"{' (' + ', '.join(bad_metrics) + ')' if bad_metrics else ''}."
        )
        if stop:
            trainer.should_stop = True
            message += " Training stops (`stop_on_nonfinite_validation=True`)."
        rank_zero_warn(f"{message} Events: {self.events_path}.")

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


def _what(loss: bool, grads: bool) -> str:
    if loss and grads:
        return "nonfinite_loss_and_grads"
    return "nonfinite_loss" if loss else "nonfinite_grads"


class _Culprit(NamedTuple):
    """Where the first non-finite value was localized, and how (the one meaning of ``culprit`` in every mode).

    Attributes:
        name: a module name, ``"<batch>"``, ``"<loss>"`` or a parameter name; ``None`` when not localized.
        source: ``"replay"`` (a forensic replay reproduced it), ``"loss"`` (no replay; the loss was non-finite) or
            ``"gradients"`` (no replay, finite losses; the first parameter, in the optimizer's order, whose gradient
            was non-finite); ``None`` with ``name``.
        text: one sentence for the console and errors.
        batch: the micro-batch whose replay found it (``None`` unless ``source == "replay"``).
    """

    name: str | None
    source: str | None
    text: str
    batch: int | None


def _culprit(
    per_rank: list[dict[str, Any]], bad_ranks: list[int], params: list[str], no_replay: str = "no replay"
) -> _Culprit:
    """The replay's finding (ranks with a bad loss first), else the first parameter with a non-finite gradient.

    ``no_replay`` says why no replay ran at this step (for the message)."""
    ordered = sorted(per_rank, key=lambda r: (r["rank"] not in bad_ranks, r["rank"]))
    for r in ordered:
        f = r["finding"]
        if f is not None and f.get("culprit") is not None:
            batch = f.get("batch_idx")
            text = f"{r['described']} (replay of batch {batch} on rank {r['rank']})"
            return _Culprit(f["culprit"], "replay", text, batch)
    replays = [r for r in per_rank if r["finding"] is not None]
    unfinished = [r for r in replays if r["finding"]["phase"] != "not_reproduced"]
    why = no_replay
    if unfinished:  # a replay that failed or could not run: never reported as a finite one
        r = unfinished[0]
        batch = r["finding"].get("batch_idx")
        why = f"{r['described']}; " + (f"batch {batch}, " if batch is not None else "") + f"rank {r['rank']}"
    elif replays:
        why = "the replay stayed finite"
    if bad_ranks:
        return _Culprit("<loss>", "loss", f"the loss was already non-finite on rank(s) {bad_ranks} ({why})", None)
    if params:
        return _Culprit(params[0], "gradients", f"the first parameter with a non-finite gradient ({why})", None)
    return _Culprit(None, None, f"not localized ({why})", None)


def _first_bad_batch(per_rank: list[dict[str, Any]], window: list[int]) -> int:
    """The first micro-batch of the step whose loss was non-finite on some rank, else the step's last one."""
    firsts = [
        next((k for k, v in enumerate(r["losses"]) if not math.isfinite(v)), None) for r in per_rank if r["losses"]
    ]
    found = [k for k in firsts if k is not None and k < len(window)]
    return window[min(found)] if found else window[-1]


def _summary(
    step: int,
    batch: int,
    window: list[int],
    what: str,
    bad_ranks: list[int],
    grad_ranks: list[int],
    params: list[str],
    culprit: _Culprit,
) -> str:
    """The console line of a flagged step; errors and the event say the same."""
    if what == "fp16_overflow":
        return f"fp16 gradient overflow at step {step}."
    where = f"batch {batch}" + (f" (the step's batches {window[0]}-{window[-1]})" if len(window) > 1 else "")
    parts = [f"non-finite values at step {step}: {where};"]
    if bad_ranks:
        parts.append(f"loss non-finite on rank(s) {bad_ranks};")
    if params:
        parts.append(f"non-finite gradients on rank(s) {grad_ranks} in {_names(params)};")
    if culprit.name is not None:
        parts.append(f"culprit `{culprit.name}`: {culprit.text}.")
    else:
        parts.append(f"culprit {culprit.text}.")
    return " ".join(parts)


class SpikeGuard(WatchesLossOrGradNorm, _Guard):
    r"""Detect loss or gradient-norm spikes with a running z-score on device: warn, skip the step, or raise.

    Each optimizer step, the monitored value ``x`` (the loss averaged over the accumulation window and over ranks,
    or the total 2-norm of the gradients) is compared with NaN-masked running statistics kept on device:
    ``z = (x - mean) / std``; ``z > z_threshold`` after ``warmup_steps`` finite values is a spike. The statistics
    are an exponential moving average (``alpha``) or, with ``window``, the last ``window`` finite values; they are
    fed with ``x`` clamped to ``mean + z_threshold * std`` (as ZClip, Kumar et al. 2025, does), so a spike does not
    inflate them and a lasting level shift is absorbed gradually. Non-finite values are ignored (masked, they never
    poison the statistics): catching them is :class:`NonFiniteGuard`'s job.

    The decision is identical on every rank: the loss of each rank travels in the engine's single collective, and
    gradient norms are global. No host synchronization is needed to decide; ``action`` says when one happens:

    - ``"warn"``: spikes are counted on device and reported (warning + event) on logging steps.
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
        super().__init__(_choice("action", action, ("warn", "skip", "raise")))
        self.monitor = _choice("monitor", monitor, ("loss", "grad_norm"))
        self.z_threshold = _positive_float("z_threshold", z_threshold)
        self.alpha = check_float("alpha", alpha, above=0.0, below=1.0, hint="A typical value is 0.97.")
        self.warmup_steps = _positive_int("warmup_steps", warmup_steps, minimum=2)
        if window is not None:
            _positive_int("window", window)
            if window < self.warmup_steps:
                raise ValueError(
                    f"`window` must hold at least `warmup_steps` values, got window={window!r} and "
                    f"warmup_steps={self.warmup_steps!r}. Enlarge the window or lower `warmup_steps`."
                )
        self.window = window
        self._stats: RunningMoments | WindowMoments = WindowMoments(window) if window else RunningMoments(self.alpha)
        self._device = torch.device("cpu")
        self._window_loss = WindowLoss()
        self._step: tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None = None
        self._spikes = 0
        self._key = f"{self.state_key}/loss_sum"

    @property
    def state_key(self) -> str:
        return self._generate_state_key(monitor=self.monitor, window=self.window, alpha=self.alpha)

    def _decide(self, plan: StepPlan, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        x = self._watched_value(plan)
        if self._device != x.device:
            self._stats.to(x.device)
            self._device = x.device
        mean, var, count = self._stats.moments()
        spike, z, record, std = spike_decision(x, mean, var, count, self.z_threshold, self.warmup_steps)
        self._stats.update(record)
        self._step = (spike, x.float(), z, mean, std)
        if self.action == "skip":
            plan.add_skip(spike)
        if not self._reads_on_host():
            self._advance_step(spike, {"value": x, "z": z, "mean": mean, "std": std})

    def _observe(self, plan: StepPlan, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._step is not None
        spike, x, z, mean, std = self._step
        if self._reads_on_host():
            if not self._flagged_on_host(plan, spike):
                return
            self._spikes += 1
            value, zv, mv, sv = torch.stack([x, z, mean, std]).tolist()
            culprit = None
            if self.monitor == "grad_norm":
                norms = plan.stats[2.0].param_norms
                culprit = plan.stats[2.0].names[int(norms.argmax())] if norms.numel() else None
            self._report(trainer, trainer.global_step, trainer.global_step, 1, value, zv, mv, sv, culprit)
        elif plan.logging_step:
            self._report_ledger(trainer)

    def _report_ledger(self, trainer: pl.Trainer) -> None:
        record = self._ledger.read()
        if record is None:
            return
        count = int(record["count"])
        self._spikes += count
        self._report(
            trainer,
            int(record["first"]),
            int(record["last"]),
            count,
            record["value"],
            record["z"],
            record["mean"],
            record["std"],
            None,
        )

    def _report(
        self,
        trainer: pl.Trainer,
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
        self._write(trainer, step=first, rank=None, what=what, culprit=culprit, values=values, last_step=last)
        steps = f"step {first}" if count == 1 else f"{count} steps between {first} and {last} (first at {first})"
        where = f"; largest gradient: `{culprit}`" if culprit else ""
        text = (
            f"SpikeGuard: {self.monitor} spike at {steps}: {value:.6g} is {z:.1f} standard deviations above the "
            f"running mean {mean:.6g} (std {std:.3g}, threshold {self.z_threshold}){where}."
        )
        if self.action == "raise":
            raise RuntimeError(f"{text} Events: {self.events_path}.")
        verb = "skipped" if self.action == "skip" else "applied"
        rank_zero_warn(f"{text} The update was {verb}. Events: {self.events_path}.")

    # -- state -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
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
        self._spikes = int(state_dict.get("spikes", 0))
        if "window_loss" in state_dict:
            self._window_loss.sum, self._window_loss.count = state_dict["window_loss"]
        self._restored_skips = float(state_dict.get("skipped_steps", 0.0))
