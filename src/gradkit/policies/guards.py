"""NonFiniteGuard: NaN/Inf in the loss or the gradients, caught on device, skipped, raised or warned about, and
traced back to where it began.

The guard decides on device, in the pipeline's ``GUARD`` stage, from values that are identical on every rank:
gradient statistics after the DDP all-reduce, and per-rank loss values summed in the pipeline's single collective.
So every rank takes the same decision and no extra collective is issued (except once per detection, when the ranks'
findings are gathered for the report). When and how the host learns of a flagged step depends on ``action``
(:mod:`gradkit.policies.guard_reporting`); where it began is the culprit replay's job (:mod:`gradkit.policies.culprit`).
The Trainer callback (:class:`lightning_gradkit.NonFiniteGuard`) adds what only a Trainer has: validation checks,
DeepSpeed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from gradkit._util.arguments import check_bool, check_choice, check_int
from gradkit.policies.culprit import (
    Culprit,
    MicroBatch,
    bad_sample_ids,
    culprit_text,
    first_bad_batch,
    gather_ranks,
    id_list,
    locate_culprit,
    nonfinite_kind,
    replay_micro_batches,
    reproducibility,
    step_summary,
    what_text,
)
from gradkit.policies.forensics import Finding
from gradkit.policies.guard_reporting import Flagged, Kept, Ledger, Reporter, overflow_summary, write_norm_overflow
from gradkit.step.norms import GradStats, loss_scale, nonfinite_mask, world_size
from gradkit.step.plan import Decision, StepOutcome, StepStats
from gradkit.step.protocol import Door, Stage, StatsRequest, StepContext, served, state_key
from gradkit.step.snapshot import Snapshot

__all__ = ["NonFiniteGuard"]


class NonFiniteGuard:
    r"""Catch NaN/Inf in the loss or the gradients: skip the step, raise, or warn; and name where it began.

    Every optimizer step the guard checks the loss of each micro-batch (``note_loss``, on device) and
    the gradients (the finite flag of the step's shared gradient statistics, after unscaling and the DDP
    all-reduce). A loss that is non-finite on one rank only flags the step on every rank, and so do gradients that
    turn non-finite on one rank after the all-reduce (a gradient hook, ``on_after_backward``): the per-rank flags
    travel in the pipeline's single collective, so every rank takes the same decision.

    ``action``:

    - ``"skip"`` (behind a Trainer, needs a GradKit strategy, e.g. ``Trainer(strategy="gradkit")``; behind
      :class:`~gradkit.GradKit`, ``kit.step`` skips): the optimizer does not step.
      Parameters and optimizer state (Adam moments and step counts included) stay bitwise unchanged, gradients are
      cleared, step-interval LR schedulers do not advance, ``gradkit/skipped_steps`` counts it.
      ``trainer.global_step`` still counts the attempted step (as Lightning does for a step the fp16
      ``GradScaler`` skips). After ``max_consecutive`` flagged steps in a row, training stops with an error that
      lists the steps, what was non-finite, and the last checkpoint.
    - ``"raise"``: raise before the optimizer steps (one host read of the flag per step; any strategy).
    - ``"warn"``: let the update happen, count the flagged steps on device and report them on logging steps.

    Forensics: on a detection (the first of the run, then at most one per ``replay_every_n_steps`` optimizer steps,
    not on every step), the micro-batches of the bad step are replayed once under a dispatch mode that sees every
    aten operator of the forward and of the backward (see :mod:`gradkit.policies.forensics`). The replay follows the
    non-finite loss (else the non-finite gradients) back to the operator that made it from finite values, and names
    the module it ran in (for an operator of the backward, the module whose forward it differentiates), the operator
    (``aten.div.Tensor``) and the user's source line. Infinities that a later operator makes finite again (a ``-inf``
    attention mask before a softmax) are never named; in-place operators (``ReLU(inplace=True)``) replay as they
    trained. The replay needs the bad step's parameters: it runs with ``action="raise"`` and ``action="skip"``, on
    single-device and DDP strategies. A fused optimizer skips on device, so its flag reaches the host one step later:
    the skipped step left the parameters as they were, and the next step reads the flag before its own optimizer
    step, so the bad step's micro-batches (kept by reference until then, never copied) are replayed there, against
    the buffers of the bad step's window start; the report on the next logging step names the culprit. Its cost, a
    host read per operator, is paid once per replay; the clean steps pay none. Behind the Trainer the replay runs
    ``training_step``; in a loop of your own it runs the closure each micro-batch handed over:
    ``kit.note_loss(loss, replay=lambda: loss_fn(model(batch)))`` (see :meth:`~gradkit.GradKit.note_loss`;
    without one the event says the replay was unavailable).

    - A replay that raises is reported as ``"failed"`` with its error, one that cannot run as ``"unavailable"`` with
      the reason: the event and the message say so (never that the replay stayed finite), and the culprit then
      comes from the loss or the gradients.
    - What the replay covers: ``training_step`` (or the closure) and its backward, nothing after them. The event's
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

    Events: each is one JSON line in ``gradkit_events.jsonl`` in the logger's directory (``GradKit``'s ``log_dir``),
    written by rank 0, gathered from all ranks; the event and the error say the same. The warning's first line says
    what, where and what was done (``NonFiniteGuard: non-finite gradients at step 40, culprit `blocks.1.mlp` (from
    the replay); the optimizer step was skipped.``); the lines below it the micro-batch, the culprit's sentence,
    the sample ids and the replay's verdict, and how many parameters had non-finite gradients (their names are in
    the event); it points at your line (``trainer.fit(...)``, ``kit.step(...)``), not at gradkit's. ``step`` is
    the optimizer step, ``batch_idx`` the micro-batch where the non-finite value was first seen (the replay's, else
    the first micro-batch with a non-finite loss, else the step's last micro-batch), ``batches`` the micro-batches
    of the step. ``culprit`` has one meaning in every mode: the earliest point of the step's computation where a
    non-finite value was seen. A replay, when one ran and reproduced it, localizes it (a module name, ``"<batch>"``,
    ``"<loss>"`` or a parameter; each rank's finding in ``values.forensics`` adds its ``phase``, ``op`` and
    ``source``); without one, a non-finite loss on some rank gives ``"<loss>"`` (the value was already non-finite
    there; a replay would name the module), and otherwise the culprit is the first parameter (in the optimizer's
    order) whose gradient was non-finite on some rank. ``culprit_source`` says which (``"replay"``, ``"loss"`` or
    ``"gradients"``). ``action="warn"`` never replays (the update was applied, so the step's parameters are gone):
    its culprit comes from the loss or the gradients, and the message says to use ``"skip"`` or ``"raise"``.

    The events' ``what``: ``"nonfinite_loss"``, ``"nonfinite_grads"``, ``"nonfinite_loss_and_grads"``,
    ``"fp16_overflow"`` and ``"nonfinite_val_loss"`` (both below). Skipped steps are logged as
    ``gradkit/skipped_steps`` on logging steps.

    With the fp16 ``GradScaler``, non-finite gradients under a finite loss are the scaler's routine overflow (its
    first steps at the default scale 65536 overflow often): the scaler skips the step itself and lowers its scale.
    That is the scaler's skip, not the guard's: it is not counted in ``gradkit/skipped_steps`` (nor in
    ``GradKit.skipped_steps``), the buffers the step's forwards wrote are kept and LR schedulers step, as without the
    guard. The guard records it as an ``"fp16_overflow"`` event and counts it toward ``max_consecutive``, without a
    warning or a replay. A non-finite loss is the guard's skip, counted as usual.

    Norm overflow: the gradients are non-finite exactly where ``torch.isfinite`` says so (measured in the gradient
    read, not inferred from the norm). A step whose gradient norm is nevertheless inf, every element finite (the fp32
    sum of squares passes 3.4e38: one element of 3e19 does it), is a ``"norm_overflow"`` event, not a non-finite
    one: ``action`` applies to it as to a non-finite step (skipped, raised, warned; counted toward
    ``max_consecutive``), because no norm-based policy can use that step (a clip coefficient ``max_norm / inf`` is
    0, statistics fed inf), and the event names the parameters whose own norm overflowed, without a replay (there is
    nothing non-finite to trace). ``torch.nn.utils.clip_grad_norm_(error_if_nonfinite=True)`` calls the same step
    non-finite.

    Behind the Trainer only, under Lightning's ``DeepSpeedStrategy`` (see :mod:`lightning_gradkit._deepspeed`):
    ``"warn"`` and ``"raise"`` only (``"skip"`` is refused at setup: the DeepSpeed engine steps inside
    ``engine.step()``). The loss of each micro-batch is checked before DeepSpeed steps (``"raise"`` stops with the
    parameters unchanged), the gradients through DeepSpeed's global norm after its step
    (``engine.get_global_grad_norm()``; DeepSpeed's own overflow check has then skipped the step, or, without one,
    applied it). A step DeepSpeed skips under fp16 is its loss scaler's routine and not flagged. No replay runs.

    Validation (``check_validation``, behind the Trainer): a non-finite validation loss (the tensor returned by
    ``validation_step`` or its ``"loss"`` entry, and logged metrics whose name starts with ``val`` and contains
    ``loss``) is reported as an event and a warning once per validation run; with ``stop_on_nonfinite_validation``
    training stops (``trainer.should_stop``).

    Args:
        action: ``"skip"``, ``"raise"`` or ``"warn"``.
        check_loss: check each micro-batch loss.
        check_grads: check the gradients: the step's shared norms, and whether an element is NaN or Inf (from the
            same read on CUDA; one more read of the gradients on CPU and where the Triton kernel does not run).
        max_consecutive: stop after this many flagged steps in a row (``>= 1``).
        forensics: replay a bad step's micro-batches to name the culprit module (``training_step`` runs
            again: see "Forensics" above).
        replay_every_n_steps: the replay budget of a long run: a detection at least this many optimizer steps after
            the last replayed one is replayed too (a second, independent NaN 900 steps later gets its own culprit);
            the ones in between are not (a run of bad steps costs one replay). ``None``: the run's first detection
            only.
        detect_anomaly: run that single replay under ``torch.autograd.detect_anomaly(check_nan=True)`` as well
            (single-process runs only).
        check_validation: report non-finite validation losses.
        stop_on_nonfinite_validation: stop training on a non-finite validation loss.

    Raises:
        ValueError: on an unknown ``action``, ``max_consecutive < 1``, ``replay_every_n_steps < 1``, a non-bool
            flag, or with both ``check_loss`` and ``check_grads`` false.
        RuntimeError: at the Trainer's setup, for ``action="skip"`` on a strategy that cannot skip steps (the
            message names the GradKit strategy to use); during training, for ``action="raise"`` on a non-finite
            step and after ``max_consecutive`` flagged steps in a row.

    Example::

        >>> import torch, warnings
        >>> from gradkit import GradKit, NonFiniteGuard
        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> kit = GradKit(model, optimizer, NonFiniteGuard(action="skip"), log_dir=False)
        >>> x = torch.tensor([[float("nan"), 1.0]])
        >>> loss = model(x).sum()
        >>> loss.backward()
        >>> kit.note_loss(loss, replay=lambda: model(x).sum())
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")  # record the warning whatever the filters outside
        ...     kit.step(optimizer)
        False
        >>> "culprit `<batch>`" in str(caught[0].message)
        True
    """

    stage = Stage.GUARD

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
        replay_every_n_steps: int | None = 500,
    ) -> None:
        self.action = check_choice("action", action, ("skip", "raise", "warn"))
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
        self.check_validation = check_bool("check_validation", check_validation)
        self.stop_on_nonfinite_validation = check_bool("stop_on_nonfinite_validation", stop_on_nonfinite_validation)
        if replay_every_n_steps is not None:
            hint = "Leave it as None to replay the run's first detection only."
            check_int("replay_every_n_steps", replay_every_n_steps, 1, hint=hint)
        self.replay_every_n_steps = replay_every_n_steps
        self._reporter = Reporter("NonFiniteGuard", self.action)
        self._ledger = Ledger()
        self._scaler = False
        self._door: Door | None = None
        # The open window: whether a loss was non-finite, the losses, and (acting at the step) the micro-batches'
        # indices, sample ids and replays.
        self._loss_bad: Tensor | None = None
        self._losses: list[Tensor] = []
        self._window: list[int] = []
        self._ids: list[Any] = []
        self._micro_batches: list[MicroBatch] = []
        self._flags: tuple[Tensor, Tensor | None, Tensor | None, Tensor | None] | None = None
        self._late: Flagged | None = None  # the previous step, learnt flagged in this step's `decide`
        self._consecutive: list[int] = []
        self._first_finding: dict[str, Any] | None = None
        self._forensics_done = False  # a replay ran in this run
        self._last_replay: int | None = None  # the step of the last replay
        self._param_names: list[str] = []
        self._key = f"{self.state_key}/loss_nonfinite_ranks"

    @property
    def state_key(self) -> str:
        return state_key(self, action=self.action)

    @property
    def events_path(self) -> Path | None:
        """The ``gradkit_events.jsonl`` file this guard writes to (known once the door is set up)."""
        return self._reporter.path

    def may_skip(self) -> bool:
        return self.action == "skip"

    def replay_allowed(self, step: int) -> bool:
        """Whether a detection at optimizer step ``step`` may be replayed (``forensics`` and the replay budget)."""
        if not self.forensics or self._last_replay is None:
            return self.forensics
        every = self.replay_every_n_steps
        return every is not None and step - self._last_replay >= every

    def attach(self, ctx: Door, model: torch.nn.Module) -> None:
        self._door = ctx  # the model, the scaler and the window's buffers a replay reads, where to resume from
        self._reporter.attach(ctx)
        self._scaler = ctx.loss_scale_source() is not None
        if self.forensics and self.detect_anomaly and world_size() > 1:
            ctx.warn(
                "NonFiniteGuard(detect_anomaly=True): anomaly mode is not used for the replay in a multi-process run "
                "(it raises inside the backward on the ranks that see the NaN only, leaving the other ranks waiting "
                "in a collective of the backward). The replay still names the culprit module."
            )

    def before_first_forward(self, ctx: StepContext) -> None:
        self._reporter.restore_skips(ctx)

    def finish(self, ctx: StepContext) -> None:
        if not self._reporter.reads_on_host():
            self._report_ledger(ctx)

    def note_loss(self, loss: Tensor, ctx: StepContext) -> None:
        """A micro-batch loss (without the AMP scale), checked on device (no host sync); the micro-batch the door
        keeps for a replay (:attr:`~gradkit.StepContext.micro_batch`) joins the window."""
        if self._reporter.keeps_micro_batches():
            batch = ctx.micro_batch
            self._window.append(ctx.batch_idx if batch is None else batch.batch_idx)
            self._ids.append(None if batch is None else batch.ids)  # a reference: read on a flagged step only
            if batch is not None and self.replay_allowed(ctx.global_step):
                self._micro_batches.append(batch)
        if self.check_loss:
            loss = loss.detach()  # in its own dtype: a float64 loss of -1.4e39 is finite, its fp32 cast is not
            bad = nonfinite_mask(loss)
            bad = bad if bad.dim() == 0 else bad.any()
            self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad
            self._losses.append(loss)

    def _forget_window(self) -> None:
        self._loss_bad = None
        self._losses = []
        self._micro_batches = []
        self._window = []
        self._ids = []

    def request_stats(self, request: StatsRequest) -> None:
        if self.check_grads:
            request.rank_flags = True
            request.finite_check = True

    def reduce_request(self, ctx: StepContext) -> dict[str, Tensor]:
        if not self.check_loss or world_size() <= 1:  # one process: its own flag is the decision
            return {}
        ranks = torch.zeros(world_size(), dtype=torch.float32, device=ctx.device)
        if self._loss_bad is not None:
            ranks[dist.get_rank()] = self._loss_bad.to(torch.float32)
        return {self._key: ranks}

    def decide(self, stats: StepStats, decision: Decision, ctx: StepContext) -> None:
        loss_ranks = None  # per rank, 1.0 where a loss was non-finite (several processes only)
        loss_bad = None
        if self.check_loss and self._key in stats.reduced:
            loss_ranks = stats.reduced[self._key].to(stats.primary.total.device)
            loss_bad = loss_ranks.sum() > 0
        elif self.check_loss and self._loss_bad is not None:
            loss_bad = self._loss_bad.to(stats.primary.total.device)
        # The step's norms NaN or Inf: a non-finite element, or a norm overflow (every element finite); both flag
        # the step, `found_nonfinite` (torch.isfinite, exactly) tells them apart for the report.
        grads_bad = stats.primary.norms_nonfinite if self.check_grads else None
        found = stats.primary.found_nonfinite if self.check_grads else None
        if loss_bad is not None and grads_bad is not None:
            bad = loss_bad | grads_bad
        else:
            bad = next((t for t in (loss_bad, grads_bad) if t is not None), None)
            if bad is None:  # only the loss is checked, and no loss was handed over this step
                bad = torch.zeros((), dtype=torch.bool, device=stats.primary.total.device)
        self._flags = (bad, loss_ranks, loss_bad, grads_bad, found)
        if self.action == "skip":
            # Non-finite gradients under a finite loss with a GradScaler are its routine overflow: the scaler skips
            # that step itself. It is the scaler's skip, not the guard's: not counted, buffers and schedulers as
            # without the guard. The guard still records it (an "fp16_overflow" event).
            overflow = self._overflow(loss_bad, found)
            decision.add_skip(bad if overflow is None else bad & ~overflow)
        if not self._reporter.reads_on_host():
            # [flag, loss non-finite, gradient elements non-finite] in one op; the per-rank losses when there are
            # ranks. The per-parameter norms are kept (a reference) to name the culprit if the step turns out flagged.
            grads = grads_bad if found is None else found
            flags = torch.stack([bad, bad if loss_bad is None else loss_bad, bad if grads is None else grads])
            if loss_ranks is not None:
                flags = torch.cat([flags.to(loss_ranks.dtype), loss_ranks])
            self._param_names = stats.primary.model_names  # every stage's under pipeline parallelism
            # References, not copies: a clean step pays nothing for what a flagged one will need.
            kept = Kept(stats.primary.model_norms, self._micro_batches, self._window, self._ids)
            self._late = self._ledger.record(ctx.global_step, flags, kept)

    def _overflow(self, loss_bad: Tensor | None, found: Tensor | None) -> Tensor | None:
        """Under a GradScaler: a non-finite gradient element and a finite loss on every rank (a device flag, no sync);
        ``None`` without a scaler or without the gradient check. A norm overflow is not: the scaler would step it."""
        if not self._scaler or found is None:
            return None
        grads_bad = found > 0
        return grads_bad if loss_bad is None else grads_bad & ~loss_bad

    def decide_again(self, stats: StepStats, decision: Decision, first: Decision, ctx: StepContext) -> None:
        # A re-evaluated closure's micro-batch belongs to no decision: the step was decided on its first evaluation.
        self._forget_window()

    def observe(self, stats: StepStats, outcome: StepOutcome, ctx: StepContext) -> None:
        try:
            if self._reporter.reads_on_host():
                self._act_at_step(stats, outcome, ctx)
                return
            late, self._late = self._late, None
            if late is not None:
                self._replay_late(late, ctx)
            if stats.logging_step:
                self._report_ledger(ctx)
        finally:
            self._forget_window()

    # -- acting at the step (host knows) -----------------------------------------------------------------------
    def _act_at_step(self, stats: StepStats, outcome: StepOutcome, ctx: StepContext) -> None:
        assert self._flags is not None
        bad, loss_ranks, loss_bad, grads_bad, found = self._flags
        # Under a GradScaler the skip leaves the overflow out (see `decide`): the flag is read with it.
        if not self._reporter.flagged_on_host(outcome, bad, within_skip=not (self._scaler and self.check_grads)):
            self._consecutive = []
            return
        step = ctx.global_step
        self._consecutive.append(step)
        if loss_ranks is not None:
            bad_ranks = [r for r, v in enumerate(loss_ranks.tolist()) if v > 0]
        else:
            bad_ranks = [ctx.global_rank] if loss_bad is not None and bool(loss_bad) else []
        grads_nonfinite = bool(found > 0) if found is not None else grads_bad is not None and bool(grads_bad)
        if grads_bad is not None and not grads_nonfinite and not bad_ranks:
            self._norm_overflow(stats, ctx)
            return
        overflow = bool(self._scaler and grads_nonfinite and not bad_ranks)
        finding: Finding | None = None
        if self.replay_allowed(step) and not overflow:
            finding = self._replay(ctx, self._micro_batches, step)
        # Gradients can differ between ranks (a rank's own hook after the all-reduce): every rank's is reported.
        per_rank = gather_ranks(self._local_report(ctx, stats.primary, finding))
        what = "fp16_overflow" if overflow else nonfinite_kind(bool(bad_ranks), grads_nonfinite)
        self._report_flagged(ctx, stats.primary, per_rank, bad_ranks, what, finding is not None)

    def _local_report(self, ctx: StepContext, primary: GradStats, finding: Finding | None) -> dict[str, Any]:
        """What this rank knows of a flagged step: its losses, its non-finite gradients, its replay's finding."""
        nonfinite = (~torch.isfinite(primary.param_norms)).cpu()
        return {
            "rank": ctx.global_rank,
            # As training_step returned them (Lightning divides by the accumulation count before the backward).
            "losses": [v * ctx.accumulate_grad_batches for t in self._losses for v in t.reshape(-1).tolist()],
            # Positions among the whole model's parameters (every stage's under pipeline parallelism).
            "params": [primary.model_position(i) for i in nonfinite.nonzero().flatten().tolist()],
            "finding": None
            if finding is None
            else {"culprit": finding.culprit, "phase": finding.phase, **finding.detail},
            "described": None if finding is None else finding.describe(),
            "ids": [id_list(ids) for ids in self._ids],
        }

    def _report_flagged(
        self,
        ctx: StepContext,
        primary: GradStats,
        per_rank: list[dict[str, Any]],
        bad_ranks: list[int],
        what: str,
        found_by_replay: bool,
    ) -> None:
        """The event, the console summary and the warning of a flagged step, from every rank's report."""
        step = ctx.global_step
        params = [primary.model_names[i] for i in sorted({i for r in per_rank for i in r["params"]})]
        grad_ranks = [r["rank"] for r in per_rank if r["params"]]
        culprit = locate_culprit(per_rank, bad_ranks, params, self._no_replay_reason())
        window = list(self._window) or [ctx.batch_idx]
        batch = culprit.batch if culprit.batch is not None else first_bad_batch(per_rank, window)
        replay = reproducibility(per_rank)
        ids = _sample_ids(per_rank, window.index(batch) if batch in window else -1)
        values = {
            "loss_nonfinite_ranks": bad_ranks,
            "grad_nonfinite_ranks": grad_ranks,
            "losses": {str(r["rank"]): r["losses"] for r in per_rank},
            "nonfinite_param_grads": params[:50],
            "grad_norm": float(primary.total),
            "consecutive": len(self._consecutive),
            "replay_reproduced_ranks": replay.reproduced_on,
        }
        findings = [dict(r["finding"], rank=r["rank"]) for r in per_rank if r["finding"] is not None]
        if findings:
            values["forensics"] = findings
        self._reporter.write(
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
        if found_by_replay and self._first_finding is None:
            self._first_finding = {"step": step, "culprit": culprit.name, "described": culprit.text}
        summary = step_summary(step, batch, window, what, bad_ranks, grad_ranks, params, culprit, replay, ids)
        self._conclude(ctx, summary)
        if what != "fp16_overflow":
            # A short first line; the details below it, the parameters' names only in the event.
            verb = "skipped" if self.action == "skip" else "applied"
            first = f"NonFiniteGuard: {what_text(what)} at step {step}, {culprit_text(culprit)}"
            first += f"; the optimizer step was {verb}."
            details = step_summary(step, batch, window, what, bad_ranks, grad_ranks, [], culprit, replay, ids)
            if params:
                details += f" Non-finite gradients in {len(params)} parameter(s) on rank(s) {grad_ranks}"
                details += f" (first `{params[0]}`)." if len(params) > 1 else f": `{params[0]}`."
            ctx.warn(f"{first}\n  {details}{self._reporter.note}")

    def _conclude(self, ctx: StepContext, summary: str) -> None:
        """Raise for ``action="raise"``, stop after ``max_consecutive`` flagged steps in a row."""
        if self.action == "raise":
            raise RuntimeError(f"NonFiniteGuard: {summary}{self._reporter.note}")
        if len(self._consecutive) >= self.max_consecutive:
            self._stop(ctx, len(self._consecutive), self._consecutive[0], ctx.global_step, summary)

    def _norm_overflow(self, stats: StepStats, ctx: StepContext) -> None:
        """A flagged step whose gradient norm is inf, every element finite: its event, then as a non-finite step."""
        summary = write_norm_overflow(self._reporter, ctx, stats.primary, len(self._consecutive))
        self._conclude(ctx, summary)
        verb = "skipped" if self.action == "skip" else "applied"
        ctx.warn(f"NonFiniteGuard: {summary} The optimizer step was {verb}.{self._reporter.note}")

    def _no_replay_reason(self) -> str:
        """Why no replay ran at a flagged step, and how to get one."""
        if not self.forensics:
            return "forensics=False"
        if not self._reporter.keeps_micro_batches():
            return (
                "action='warn' applied the update, so a replay would not see the step's parameters: use "
                "action='skip' or 'raise' to name the module, the operator and the source line"
            )
        if self.replay_every_n_steps is None:
            return "the replay runs at the first detection only (`replay_every_n_steps=None`)"
        return (
            f"the last replay ran at step {self._last_replay}: at most one per {self.replay_every_n_steps} steps "
            "(`replay_every_n_steps`)"
        )

    def _replay(
        self, ctx: StepContext, batches: list[MicroBatch], step: int, buffers: Snapshot | None = None
    ) -> Finding:
        """Replay step ``step``'s micro-batches (:func:`~gradkit.policies.culprit.replay_micro_batches`), within the
        budget."""
        self._forensics_done = True
        self._last_replay = step
        anomaly = self.detect_anomaly and world_size() == 1
        door = served(self._door, self)
        return replay_micro_batches(door.model, batches, loss_scale(door.loss_scale_source()), anomaly, buffers)

    def _replay_late(self, flagged: Flagged, ctx: StepContext) -> None:
        """Replay a step a fused optimizer skipped on device, now that its flag reached the host: no optimizer step has
        applied since, so the parameters are still the bad step's, and its window's buffers are set for the replay
        (the next step's forwards wrote them since). Every rank learns the flag at the same step: the findings are
        gathered there."""
        kept: Kept = flagged.keep
        batches, kept.micro_batches = kept.micro_batches, []  # let the batches go, replayed or not
        bad_ranks, grads = self._late_flags(flagged.flags, ctx)
        overflow = self._scaler and grads and not bad_ranks  # the GradScaler's routine skip: never replayed
        if not self._reporter.replays_late() or overflow or not self.replay_allowed(flagged.step):
            return
        finding = self._replay(ctx, batches, flagged.step, served(self._door, self).window_buffers)
        local = {
            "rank": ctx.global_rank,
            "finding": {"culprit": finding.culprit, "phase": finding.phase, **finding.detail},
            "described": finding.describe(),
            "ids": [id_list(ids) for ids in kept.ids],
        }
        kept.per_rank = gather_ranks(local)

    def _late_flags(self, flags: list[float], ctx: StepContext) -> tuple[list[int], bool]:
        """From flags read one step late: the ranks whose loss was non-finite, and whether gradients were."""
        loss_ranks = flags[3:] if len(flags) > 3 else [flags[1] if self.check_loss else 0]
        bad_ranks = [r if len(flags) > 3 else ctx.global_rank for r, v in enumerate(loss_ranks) if v > 0]
        return bad_ranks, self.check_grads and bool(flags[2])

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
            f"giving up. Last one: {summary}{first_found}{applied} {served(self._door, self).checkpoint_note()}."
            f"{self._reporter.note}"
        )

    # -- lazy reporting (device ledger) ------------------------------------------------------------------------
    def _report_ledger(self, ctx: StepContext) -> None:
        flagged = self._ledger.fold()  # this step's flags: a logging step (or the end) may wait for them
        if flagged is not None:
            self._replay_late(flagged, ctx)
        record = self._ledger.read()
        if record is None:
            return
        first, last, count = record.first, record.last, record.count
        bad_ranks, grads = self._late_flags(record.flags, ctx)
        norm_overflow = self.check_grads and not grads and not bad_ranks  # flagged by its norm alone
        kept: Kept = record.keep
        params = self._late_params(kept, grads, norm_overflow)
        what = "norm_overflow" if norm_overflow else nonfinite_kind(bool(bad_ranks), grads)
        if self._scaler and grads and not bad_ranks:
            what = "fp16_overflow"
        per_rank = kept.per_rank or []
        culprit = locate_culprit(per_rank, bad_ranks, params, self._no_replay_reason())
        replay = reproducibility(per_rank)
        run = record.longest_run
        values: dict[str, Any] = {"flagged_steps": count, "first_step": first, "last_step": last, "longest_run": run}
        findings = [dict(r["finding"], rank=r["rank"]) for r in per_rank if r["finding"] is not None]
        if findings:
            values.update(forensics=findings, replay_reproduced_ranks=replay.reproduced_on)
        where = _late_where(kept, per_rank, culprit)
        self._reporter.write(
            ctx,
            step=first,  # the flagged step, also when reported one step late (a fused skip): one number per event
            rank=bad_ranks or None,
            what=what,
            culprit=culprit.name,
            culprit_source=culprit.source,
            reproducible=replay.reproducible,
            reproducible_reason=replay.reason if per_rank else f"no replay ran: {self._no_replay_reason()}",
            values=values,
            first_step=first,
            **where,
        )
        if findings and self._first_finding is None:
            self._first_finding = {"step": first, "culprit": culprit.name, "described": culprit.text}
        detail = [f"loss non-finite on rank(s) {bad_ranks}"] if bad_ranks else []
        if norm_overflow:
            detail.append(overflow_summary(first, params[0] if params else None, []).rstrip("."))
        elif culprit.name is not None:
            detail.append(f"culprit `{culprit.name}`: {culprit.text}")
        verb = "skipped" if self.action == "skip" else "applied"
        kind = "flagged" if norm_overflow else "with non-finite values"  # the period's first flagged step says
        summary = (
            f"{count} optimizer step(s) {kind} between steps {first} and {last} (updates {verb}); "
            f"at step {first}: {'; '.join(detail) or 'non-finite values'}."
        )
        if run >= self.max_consecutive:
            self._stop(ctx, run, record.run_first, record.run_last, summary)
        if what != "fp16_overflow":
            ctx.warn(f"NonFiniteGuard: {summary}{self._reporter.note}")

    def _late_params(self, kept: Kept, grads: bool, norm_overflow: bool) -> list[str]:
        """The parameter a late report names: the first with a non-finite gradient, or the largest norm when the norm
        alone overflowed (a logging step: may read)."""
        if not self._param_names:
            return []
        if grads:
            return [self._param_names[int(nonfinite_mask(kept.param_norms).to(torch.float32).argmax())]]
        if norm_overflow:
            return [self._param_names[int(kept.param_norms.argmax())]]
        return []

    # -- state -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "consecutive": list(self._consecutive),
            "forensics_done": self._forensics_done,
            "last_replay_step": self._last_replay,
            "first_finding": self._first_finding,
            **self._reporter.skipped_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._consecutive = list(state_dict.get("consecutive", []))
        self._forensics_done = bool(state_dict.get("forensics_done", False))
        self._first_finding = state_dict.get("first_finding")
        last = state_dict.get("last_replay_step")
        if last is None and self._forensics_done and self._first_finding is not None:
            last = self._first_finding["step"]  # saved before the budget: the one replay ran at the first finding
        self._last_replay = None if last is None else int(last)
        self._reporter.restored_skips = float(state_dict.get("skipped_steps", 0.0))


def _late_where(kept: Kept, per_rank: list[dict[str, Any]], culprit: Culprit) -> dict[str, Any]:
    """Where a late report's culprit came from: the replayed micro-batch that made it, its step's micro-batches and
    its sample ids (empty when the culprit is not in the kept window)."""
    if culprit.batch not in kept.window:
        return {}
    position = kept.window.index(culprit.batch)
    ids = {str(r["rank"]): bad_sample_ids(r["ids"][position], r["finding"]) for r in per_rank if r["ids"][position]}
    return {"batch_idx": culprit.batch, "batches": [kept.window[0], kept.window[-1]], "sample_ids": ids or None}


def _sample_ids(per_rank: list[dict[str, Any]], position: int) -> dict[str, Any]:
    """Per rank, the ids of the samples of its micro-batch at ``position`` in the window that made the non-finite
    value (all of the micro-batch's where the replay does not narrow them down)."""
    return {
        str(r["rank"]): bad_sample_ids(r["ids"][position], r["finding"])
        for r in per_rank
        if -len(r["ids"]) <= position < len(r["ids"]) and r["ids"][position] is not None
    }
