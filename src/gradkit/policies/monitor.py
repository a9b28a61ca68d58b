"""Gradient-norm logging from the shared one-pass statistics: :class:`GradNormMonitor`, a plain torch policy that
works behind every door (the ``Trainer`` through :class:`lightning_gradkit.GradNormMonitor`, :class:`~gradkit.GradKit`
for Fabric and plain loops); the per-module rows (:func:`repeated_blocks`, :func:`auto_module_keys`,
:func:`module_rows`, shared with ``SpikeRollback``) and the update-to-weight ratio (:func:`update_ratios`)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from gradkit._util.arguments import check_bool, check_int, name_list, validate_norm_type
from gradkit.policies.noise_scale import DDPNoiseProbe, start_probe
from gradkit.policies.update_ratio import _Before, update_ratios
from gradkit.report.data import INSTALL_HINT, Record, RunData
from gradkit.report.events import EVENTS_FILENAME, write_metadata
from gradkit.report.loggers import has_matplotlib, publish_report
from gradkit.step.norms import (
    ParamIndex,
    grouped_norms,
    host_to_device,
    local_tensor,
    per_tensor_norms,
    reduce_sharded,
    total_norm,
)
from gradkit.step.params import clean_name, module_key
from gradkit.step.plan import Decision, StepOutcome, StepStats
from gradkit.step.protocol import Door, Stage, StatsRequest, StepContext, served, state_key, values_to_host
from gradkit.step.selection import auto_module_keys, module_rows, repeated_blocks

__all__ = [
    "PROG_BAR_KEYS",
    "ZERO_GRADIENT_STEPS",
    "GradNormMonitor",
    "auto_module_keys",
    "module_rows",
    "repeated_blocks",
    "update_ratios",
]


#: Keys shown in Lightning's progress bar with ``prog_bar=True`` (short: the bar is one line).
PROG_BAR_KEYS = ("grad_norm", "clipped", "skipped")

#: A parameter is named in the all-zero-gradient warning only when its gradient was all zero on each of this many
#: first optimizer steps. One step proves nothing: a zero-initialised gain (the last BatchNorm of every ResNet block
#: with ``zero_init_residual``, a zero-init LayerScale or adapter) zeroes the gradients upstream of it until the first
#: step moves it, and a warm-up from ``lr=0`` holds it one step more.
ZERO_GRADIENT_STEPS = 4


def _clipped_flag(stats: StepStats, decision: Decision) -> Tensor | None:
    """Whether a clipping callback scaled this step's gradients down (a bool device scalar), or None without one."""
    flags = []
    if decision.clip_decided and not decision.clipped:  # a clipper that left this step alone (ZClip's warm-up)
        return stats.primary.total < 0  # False, on device
    if decision.clip_coef is not None:
        flags.append(decision.clip_coef.reshape(()) < 1)
    if decision.param_coefs:
        coefs = list(decision.param_coefs.values())
        flags.append(torch.cat([c.reshape(-1).to(coefs[0].device) for c in coefs]).min() < 1)
    if decision.clamp_value is not None and math.inf in stats.norms:
        flags.append(decision.scaled(stats.norms[math.inf].total) > decision.clamp_value)
    return torch.stack([f.to(flags[0].device) for f in flags]).any() if flags else None


class GradNormMonitor:
    r"""Log gradient norms (total, per module, per param group) and optionally weight norms and update ratios.

    The norms come from the step's shared :class:`~gradkit.GradStats`: one ``torch._foreach_norm`` pass over
    all gradients at the optimizer-step boundary (after AMP unscaling and the DDP all-reduce; global values under
    FSDP1/FSDP2 through one all-reduce), once per optimizer step. They are read to the host on logging steps only
    (every ``log_every_n_steps`` optimizer steps, the first one and, when the loop knows it, the last one), so other
    steps cost no host-device synchronization; they reach the ``Trainer``'s loggers or ``GradKit``'s ``log``.

    Logged keys (``/opt{i}`` is appended when the loop has several optimizers):

    - ``grad_norm/total``: the total norm of the gradients the optimizer receives, before clipping.
    - ``grad_norm/total_post_clip``: the same after a gradkit clipping policy acted (when one is present).
    - ``grad_norm/module/<name>``: per module (see ``depth``).
    - ``grad_norm/param_group_<i>``: per optimizer param group.
    - ``weight_norm/total`` and ``weight_norm/module/<name>``: with ``weight_norms=True``.
    - ``update_ratio/total`` and ``update_ratio/module/<name>``: with ``update_ratio=True``, the update-to-weight
      ratio ``||w_after - w_before|| / ||w_before||`` (2-norms, whatever ``norm_type``) of this optimizer step.
    - ``grad_noise/b_simple``, ``grad_noise/g2``, ``grad_noise/s``, ``grad_noise/g_small_sq``,
      ``grad_noise/g_big_sq``, ``grad_noise/batch_size``: with ``noise_scale=True`` under DDP, see below.

    It writes no events (the report reads the guards'); beside them, in the log directory, it keeps
    ``gradkit_run.json`` (the model order of the per-module rows, which a logger such as ``CSVLogger`` sorts by name).

    **Update-to-weight ratio.** The ratio of the size of a step's update to the size of the weights is the usual
    learning-rate health signal: about ``1e-3`` per step is healthy (Karpathy, CS231n "ratio of weights:updates");
    far below, the learning rate is too low or the module does not train; far above, it is too high. On a logging
    step the monitor copies this optimizer's (local) parameters after the gradients are written and measures the
    update right after ``optimizer.step()`` returns (a ``torch.optim`` step post-hook, removed after the step): one
    ``_foreach_sub_``, two ``_foreach_norm`` passes and under sharding one all-reduce, and the copy held during the
    step; other steps cost nothing. A module whose weights are all zero gets ``inf`` (``nan`` if it did not move). A
    step the optimizer did not apply (a guard skipped it, the ``GradScaler`` found an inf) logs ``0``.

    **Gradient noise scale.** With ``noise_scale=True`` under DDP, on logging steps, the monitor estimates the critical
    batch ``B_simple = S / |G|^2`` of McCandlish et al. (2018, "An Empirical Model of Large-Batch Training", appendix
    A.1) from the two batch sizes DDP has anyway: each rank's gradient of the step (``B_small``: the rank's examples of
    the optimizer step, every micro-batch) and the all-reduced one (``B_big = world_size x B_small``). It logs
    ``grad_noise/g_small_sq`` (``|G_small|^2``: each rank's squared 2-norm, averaged over the ranks),
    ``grad_noise/g_big_sq`` (``|G_big|^2``), the unbiased estimates ``|G|^2 = (B_big |G_big|^2 - B_small
    |G_small|^2) / (B_big - B_small)`` and ``S = (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)`` each smoothed
    by an exponential moving average (factor ``0.9`` per logging step, bias-corrected; the ratio of noisy estimates is
    biased, so the paper smooths numerator and denominator separately) as ``grad_noise/g2`` and ``grad_noise/s``,
    their ratio ``grad_noise/b_simple`` (NaN while the smoothed ``|G|^2`` is not positive) and ``B_big`` as
    ``grad_noise/batch_size``. A batch well below ``B_simple`` trains with nearly perfect data parallelism; far above
    it, more examples per step buy little. The values are those of the gradients the optimizer receives (the AMP scale
    removed), with the loss a mean over the batch (the gradient of an average). The local gradient is read by a hook on
    each parameter, put on for the synchronizing backward of a logging step only, before DDP's all-reduce: one norm
    per parameter and one all-reduce (in the step's collective) on logging steps, no tensor operation on other steps.
    With gradient accumulation the non-final micro-batches must run under ``no_sync`` (the Trainer does). The
    smoothing starts again after a resume. A single process, a loop without a ``DistributedDataParallel`` module (the
    Hugging Face door's) or with several optimizers gets one warning and no ``grad_noise/`` keys; FSDP and FSDP2 are
    refused (their gradients are reduce-scattered inside ``backward``).

    Trainable parameters that receive no gradient, or an all-zero gradient on each of the first 4 optimizer steps
    (``ZERO_GRADIENT_STEPS``: a zero-initialised gain zeroes the gradients upstream of it on the first step only), are
    named in a warning, once each: the classic "training under ``no_grad``" or "loss not connected" failures. The
    checks cost no host sync until the first logging step after them, and start again for parameters that join the
    optimizer (a backbone unfrozen by ``BackboneFinetuning``). Every gradient the optimizer applies is measured, also
    one on a parameter with ``requires_grad=False`` (FSDP2, see ``GradKitModelParallelStrategy``).

    Args:
        norm_type: the p of the norm, ``p >= 1`` or ``float("inf")``.
        depth: module-tree depth of the per-module norms. ``"auto"`` (default): one module per repeated block (each
            child of a ``ModuleList``/``Sequential`` of same-class modules, e.g. ``encoder.encoder.layer.3``) plus the
            other top-level modules (``head``; beside the blocks, their siblings such as ``model.wte``). An integer
            ``d`` cuts qualified module names at ``d`` components (1 groups by top-level children, 2 by their
            children, and so on); 0 turns per-module logging off.
        param_groups: also log one norm per optimizer param group.
        weight_norms: also log the weight norms (total and, with ``depth``, per module) on logging steps.
        update_ratio: also log the update-to-weight ratio (total and, with ``depth``, per module) on logging steps;
            see above for what it costs. The report draws it as a panel of its own.
        report: at the end of ``fit`` (or at ``GradKit.finish()``), render the gradient report
            (``gradkit.report.figure``) to ``gradient_report.png`` in the log directory (the ``Trainer``'s, or
            ``GradKit(log_dir=...)``) and log it, with the guards' events, to each attached logger
            (:mod:`gradkit.report.loggers`): TensorBoard's Images and Text tabs, a W&B image and table, MLflow artifacts
            and a tag. The monitor keeps the values it logs (rank 0, on logging steps), so any logger, or none, will do.
            Drawing needs matplotlib (the ``report`` extra); without it the run warns once and the loggers get the
            events only.
        report_every_n_logs: also log the report to the loggers (and rewrite the PNG) every this many
            logging steps of the monitor, at the end of the step; ``None``: at the end only. Drawing takes about a
            second per report on a CPU, on the host: choose it so that a report comes every few minutes.
        log_every_n_steps: how often to log, in optimizer steps; defaults to the loop's period (the Trainer's
            ``log_every_n_steps``).
        noise_scale: also estimate the gradient noise scale (the critical batch ``B_simple``) under DDP on logging
            steps; see above. The report draws it as a panel of its own.
        noise_scale_batch_size: ``B_small``, the examples one rank trains on in one optimizer step (every
            micro-batch), or the tokens, for ``B_simple`` in tokens. ``None``: behind the ``Trainer``, counted per step
            with Lightning's batch-size inference (the length of the first tensor of each micro-batch, as ``self.log``
            infers it); the loop door does not see the batches and needs it.
        prog_bar: show the total norm (``grad_norm``), the fraction of optimizer steps clipped since the previous
            logging step (``clipped``, with a clipping callback) and the number of skipped steps (``skipped``, with
            a guard that skips) in Lightning's progress bar, updated on logging steps (a ``Trainer`` only).

    Raises:
        ValueError: if ``norm_type`` < 1, ``depth`` is neither ``"auto"`` nor an integer >= 0,
            ``log_every_n_steps`` or ``report_every_n_logs`` is not a positive integer, ``report_every_n_logs``
            comes without ``report=True``, ``noise_scale_batch_size`` is not a positive integer or comes without
            ``noise_scale=True``; behind a loop door, ``report=True`` with ``log_dir=False``, ``prog_bar=True`` or
            ``noise_scale=True`` without ``noise_scale_batch_size`` (under DDP); ``noise_scale=True`` under FSDP/FSDP2.

    Example::

        >>> import torch
        >>> from gradkit import GradKit, GradNormMonitor
        >>> model = torch.nn.Linear(4, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> logged = []
        >>> kit = GradKit(model, optimizer, GradNormMonitor(update_ratio=True), log_every_n_steps=1,
        ...               log=lambda metrics, step: logged.append(metrics))
        >>> model(torch.ones(2, 4)).sum().backward()
        >>> kit.step(optimizer)
        True
        >>> [key for key in logged[0] if key.endswith("total")]
        ['grad_norm/total', 'update_ratio/total']
    """

    stage = Stage.OBSERVE
    #: Whether the door counts each step's examples for the noise scale (the Trainer callback does).
    _counts_batches = False

    def __init__(  # noqa: PLR0913 (a public constructor: one argument per documented option)
        self,
        norm_type: float = 2.0,
        depth: int | Literal["auto"] = "auto",
        param_groups: bool = False,
        weight_norms: bool = False,
        update_ratio: bool = False,
        report: bool = False,
        log_every_n_steps: int | None = None,
        prog_bar: bool = False,
        report_every_n_logs: int | None = None,
        noise_scale: bool = False,
        noise_scale_batch_size: int | None = None,
    ) -> None:
        self.norm_type = validate_norm_type(norm_type)
        if not (isinstance(depth, str) and depth == "auto"):
            hint = "Use 'auto' for one row per repeated block, an integer to cut module names at that many components."
            depth = check_int("depth", depth, 0, hint=hint + " 0 turns per-module norms off.")
        self.depth: int | Literal["auto"] = depth
        self.param_groups = check_bool("param_groups", param_groups)
        self.weight_norms = check_bool("weight_norms", weight_norms)
        self.update_ratio = check_bool("update_ratio", update_ratio)
        self.report = check_bool("report", report)
        if report_every_n_logs is not None:
            check_int("report_every_n_logs", report_every_n_logs, 1, hint="Leave it as None for one report at the end.")
            if not report:
                raise ValueError(
                    f"`report_every_n_logs={report_every_n_logs!r}` reports during the run, and `report=False` asks "
                    "for no report. Set `report=True` too, or leave `report_every_n_logs=None`."
                )
        self.report_every_n_logs = report_every_n_logs
        if log_every_n_steps is not None:
            hint = "Leave it as None to follow the Trainer's `log_every_n_steps`."
            check_int("log_every_n_steps", log_every_n_steps, 1, hint=hint)
        self.log_every_n_steps = log_every_n_steps
        self.noise_scale = check_bool("noise_scale", noise_scale)
        if noise_scale_batch_size is not None:
            hint = "Give the examples (or tokens) of one rank's batch per optimizer step, every micro-batch together."
            check_int("noise_scale_batch_size", noise_scale_batch_size, 1, hint=hint)
            if not noise_scale:
                raise ValueError(
                    f"`noise_scale_batch_size={noise_scale_batch_size!r}` is the batch of the noise scale, and "
                    "`noise_scale=False` measures none. Set `noise_scale=True` too, or leave it None."
                )
        self.noise_scale_batch_size = noise_scale_batch_size
        self.prog_bar = check_bool("prog_bar", prog_bar)
        self._start_run_state()

    def _start_run_state(self) -> None:
        """What a run finds and keeps (checks, rows, counts, the report's record, the update-ratio hooks): empty."""
        self._noise: DDPNoiseProbe | None = None
        self._noise_warned = False
        # The parameter index each check was done for (re-armed when parameters join or leave the optimizer), and
        # the names already reported.
        self._missing_checked: ParamIndex | None = None
        self._zero_watch: dict[int, _ZeroWatch] = {}
        self._reported_missing: set[str] = set()
        self._reported_zero: set[str] = set()
        self._first_pending = True
        self._model_order: list[str] = []
        self._blocks: list[str] = []
        self._rows: dict[int, tuple[ParamIndex, list[str], Tensor]] = {}
        self._clipped: dict[int, Tensor] = {}
        self._steps_since_log: dict[int, int] = {}
        self._record: Record | None = None
        self._report_dir: Path | None = None
        self._can_draw = False  # matplotlib is there (checked at attach)
        self._logs_since_report = 0
        self._report_due = False
        self._published: tuple[object, Path | None] | None = None  # what the last report showed, and its PNG
        self._metadata_dir: Path | None = None
        self._written_rows: dict[int, list[str]] = {}
        # Update ratio: the parameters before the step of a logging step, per optimizer, and the step hooks.
        self._before: dict[int, _Before] = {}
        self._step_hooks: dict[int, RemovableHandle] = {}
        self._door: Door | None = None

    @property
    def state_key(self) -> str:
        return state_key(self, norm_type=self.norm_type, depth=self.depth)

    @property
    def report_data(self) -> RunData | None:
        """With ``report=True``, on global rank 0: the values logged so far (what the report draws), else None."""
        if self._record is None or self._report_dir is None:
            return None
        return self._record.run_data(RunData.read_events(self._report_dir / EVENTS_FILENAME))

    def attach(self, ctx: Door, model: nn.Module) -> None:
        """What a run starts from: the model's parameter order and blocks, the log directory, nothing logged yet.

        Raises:
            ValueError: ``report=True`` where the loop has no log directory, ``prog_bar=True`` where it has no
                progress bar.
        """
        self._door = ctx  # the loggers, the progress bar, the logging period and the skip count, read per step
        directory = ctx.log_dir  # the Trainer's broadcasts rank 0's directory: every rank asks here
        if self.report and directory is None:
            raise ValueError(
                "GradNormMonitor(report=True) writes gradient_report.png into the loop's log directory, and this "
                "loop has none: pass `GradKit(..., log_dir=...)`, or leave `report=False`."
            )
        if self.prog_bar and ctx.progress_bar is None:
            raise ValueError(
                "GradNormMonitor(prog_bar=True) shows its values in a Lightning Trainer's progress bar, which this "
                "loop does not have: leave `prog_bar=False` (the values reach the loop's `log` function)."
            )
        if not any(p.requires_grad for p in model.parameters()):
            # Valid: a `BaseFinetuning` callback may freeze everything in `setup`; the index takes them as they join.
            ctx.warn(
                f"GradNormMonitor: `{type(model).__name__}` has no trainable parameter at fit start (none has "
                "`requires_grad=True`; a `BaseFinetuning` callback may have frozen them). The monitor picks "
                "parameters up when they join (unfrozen with `requires_grad_(True)` or added with `add_param_group`) "
                "and logs their norms from then on."
            )
        # Names as the pipeline cleans them (no FSDP / checkpoint-wrapper / compile components), in registration order.
        self._model_order = [clean_name(n) for n, _ in model.named_parameters()]
        self._blocks = repeated_blocks((clean_name(n), m) for n, m in model.named_modules())
        for kept in (self._rows, self._written_rows, self._clipped, self._steps_since_log):
            kept.clear()
        self._first_pending = True
        rank_zero = ctx.global_rank == 0
        self._report_dir = directory if self.report else None
        self._can_draw = self.report and has_matplotlib()
        if self.report and not self._can_draw:
            ctx.warn(
                "GradNormMonitor(report=True): matplotlib is not installed, so no gradient_report.png is drawn (the "
                f"loggers get the events only); to draw it, {INSTALL_HINT}."
            )
        self._logs_since_report, self._report_due, self._published = 0, False, None
        # The model order of the rows goes next to the logs (rank 0), for `python -m gradkit.report`.
        self._metadata_dir = directory if rank_zero else None
        self._record = Record() if self.report and rank_zero else None
        if self.noise_scale:
            self._start_noise_scale(ctx, model)

    def _start_noise_scale(self, ctx: Door, model: nn.Module) -> None:
        """The noise-scale probe on the loop's DDP module, or one warning (a single process, no DDP module).

        Raises:
            ValueError: under FSDP/FSDP2; without ``noise_scale_batch_size`` where the door counts no batch.
        """
        if self._noise is not None:
            self._noise.close()
        warned: list[str] = []
        self._noise = start_probe(ctx, model, functools.partial(self._logs_now, ctx), warned.append)
        if warned and not self._noise_warned:  # once per monitor, whatever the number of fits
            self._noise_warned = True
            ctx.warn(warned[0])
        if self._noise is not None and self.noise_scale_batch_size is None and not self._counts_batches:
            self._noise.close()
            self._noise = None
            raise ValueError(
                "GradNormMonitor(noise_scale=True) needs the batch of one rank per optimizer step, and this door does "
                "not see the batches: pass `noise_scale_batch_size=` (the examples, or tokens, one rank trains on per "
                "optimizer step, every micro-batch together)."
            )

    def detach(self, ctx: StepContext) -> None:
        """Remove the noise-scale probe's hooks from the DDP module."""
        if self._noise is not None:
            self._noise.close()
            self._noise = None

    def reduce_request(self, ctx: StepContext) -> dict[str, Tensor]:
        """On a logging step with ``noise_scale=True``: this rank's squared local norm, summed over the ranks in the
        step's one collective."""
        return {} if self._noise is None else self._noise.reduce_request(ctx)

    def _logs_now(self, ctx: StepContext) -> bool:
        """Whether the current optimizer step logs: on the period, or the first or the last step off it."""
        return any(self._log_kind(ctx))

    def _log_kind(self, ctx: StepContext) -> tuple[bool, bool]:
        """``(on the period, off it)``: the logging period's step, or the first or the last step of the loop."""
        on_period = ctx.is_logging_step(self.log_every_n_steps)
        door = served(self._door, self)
        period = door.log_every_n_steps if self.log_every_n_steps is None else self.log_every_n_steps
        extra = not on_period and period != 0 and (self._first_pending or door.is_last_step())
        return on_period, extra

    def finish(self, ctx: StepContext) -> Path | None:
        """The report at the end (``report=True``, rank 0): the PNG and each logger's copy; returns the PNG written."""
        if self._record is None or self._report_dir is None:
            return None
        return self._publish_report(ctx, final=True)

    def _publish_report(self, ctx: StepContext, final: bool) -> Path | None:
        """The report from what the monitor logged: the PNG and each logger's copy (the events only without
        matplotlib)."""
        assert self._report_dir is not None
        data = self.report_data
        assert data is not None
        # What the report shows: the points of each series and the events. The report at the end of a run whose last
        # logging step already published a periodic one would log the same figure again at the same step.
        shown = (sorted((key, len(values)) for key, values in data.series.items()), len(data.events))
        if final and self._published is not None and self._published[0] == shown:
            return self._published[1]
        warn_empty = ctx.warn if final else None  # a periodic report before the first logged step: nothing to say
        door = served(self._door, self)
        path = publish_report(data, self._report_dir, door.loggers, door.log_step, ctx.warn, self._can_draw, warn_empty)
        self._published = (shown, path)
        return path

    def request_stats(self, request: StatsRequest) -> None:
        request.norm_types.add(self.norm_type)

    def primary_norm_type(self) -> float | None:
        return self.norm_type

    def observe(self, stats: StepStats, outcome: StepOutcome, ctx: StepContext) -> None:
        missing = stats.norms[self.norm_type].missing
        if missing and stats.index is not self._missing_checked:
            self._missing_checked = stats.index
            missing = [n for n in missing if n not in self._reported_missing]
            self._reported_missing.update(missing)
            if missing:
                ctx.warn(
                    f"GradNormMonitor: {len(missing)} trainable parameter(s) received no gradient at step "
                    f"{ctx.global_step}: {name_list(missing)}. They are not connected to the loss (or the "
                    "forward ran under `torch.no_grad`). Freeze them (`requires_grad_(False)`) if that is intended."
                )
        idx = stats.optimizer_idx
        watch = self._zero_watch.get(idx)
        if watch is None or watch.index is not stats.index:
            watch = self._zero_watch[idx] = _ZeroWatch(stats.index)
        watch.add(stats, self.norm_type)
        if self._record is not None or self.prog_bar:
            self._count_clipped(stats, outcome.decision)
        on_period, extra = self._log_kind(ctx)
        noise = self._noise_metrics(stats, outcome.decision, on_period or extra)
        if not (on_period or extra):
            return
        self._first_pending = False
        suffix = f"/opt{idx}" if len(ctx.optimizers) > 1 else ""
        metrics = {k + suffix: v for k, v in self.metrics(stats, outcome).items()}
        metrics.update(noise)
        if self.weight_norms:
            metrics.update({k + suffix: v for k, v in self._weight_metrics(stats).items()})
        host = None if on_period else values_to_host(metrics)  # off the period (first, last step): now, on the host
        if host is None:
            ctx.log(metrics, self.log_every_n_steps)
        else:
            ctx.log_values(host)
        if watch.ready:
            self._warn_zero_gradients(watch, ctx)
        self._write_row_order(idx, suffix)
        if self._record is not None or self.prog_bar:
            self._note(idx, metrics, host, suffix)
        if self.update_ratio:
            self._keep_before(stats, suffix, on_period)

    def _noise_metrics(self, stats: StepStats, decision: Decision, logging: bool) -> dict[str, Tensor]:
        """The noise scale's values of a logging step (``noise_scale=True``); every step forgets what it measured."""
        if self._noise is None:
            return {}
        door = served(self._door, self)
        batch = self.noise_scale_batch_size or self._noise.counted(door.global_step)
        return self._noise.take(stats, decision, door, batch, logging)

    # -- update-to-weight ratio (logging steps only) --------------------------------------------------------------
    def _keep_before(self, stats: StepStats, suffix: str, on_period: bool) -> None:
        """Copy the parameters before the step and arm the hook that measures the update after it."""
        index = stats.index
        before = [local_tensor(p.detach()).clone() for p in index.params]
        weight_norms = per_tensor_norms(before, 2.0, index.run_bounds).to(index.shard_weight.device)
        idx, rows = stats.optimizer_idx, self._module_rows(stats)
        step = served(self._door, self).log_step
        self._before[idx] = _Before(index, before, weight_norms, rows, suffix, on_period, step)
        if idx not in self._step_hooks:
            self._step_hooks[idx] = stats.optimizer.register_step_post_hook(functools.partial(self._after_step, idx))

    def _after_step(self, idx: int, optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """``optimizer.step()`` returned (a ``torch.optim`` step post-hook): measure the update of a logging step.

        The ratios are logged after the step (:meth:`after_step`), with those of a step that did not happen, from one
        hook: Lightning keeps a logged key per hook, and the same key logged from two hooks would be re-sent stale.
        """
        before = self._before.get(idx)
        if before is None or before.ratios is not None:  # another step of the same batch (manual optimization)
            return
        with torch.no_grad():
            before.ratios = update_ratios(before.index, before.params, before.weight_norms, before.rows)
        before.params = []

    def after_step(self, ctx: StepContext) -> None:
        """Log the update ratios of a logging step (the batch's end under a Trainer), then the report when one is due
        (``report_every_n_logs``)."""
        if self._step_hooks:  # a logging step with `update_ratio`
            self._log_ratios(ctx)
        if self._report_due:
            self._report_due = False
            self._publish_report(ctx, final=False)

    def _log_ratios(self, ctx: StepContext) -> None:
        self._drop_step_hooks()
        for before in self._before.values():
            ratios = before.ratios
            if ratios is None:
                # The step hook did not run: the optimizer did not step (a guard skipped it, the GradScaler found an
                # inf). The update was zero. The parameters are not read here: a rollback may have restored them.
                zero = torch.zeros((), device=before.weight_norms.device)
                rows = before.rows[0] if before.rows is not None else []
                ratios = {f"update_ratio/{name}": zero for name in ["total", *(f"module/{r}" for r in rows)]}
            metrics = {k + before.suffix: v for k, v in ratios.items()}
            host = None if before.on_period else values_to_host(metrics)  # as the step's other values were logged
            if host is None:
                ctx.log(metrics, self.log_every_n_steps)
            else:
                ctx.log_values(host)
            if self._record is not None:
                self._record.merge(before.step, host or values_to_host(metrics))
        self._before.clear()

    def _drop_step_hooks(self) -> None:
        for handle in self._step_hooks.values():
            handle.remove()
        self._step_hooks.clear()

    # -- what a logging step logs and keeps -------------------------------------------------------------------------
    def _write_row_order(self, idx: int, suffix: str) -> None:
        """Record the per-module rows in model order in ``gradkit_run.json`` when they change (rank 0, a logger)."""
        rows = self._rows.get(idx)
        if self._metadata_dir is None or rows is None:
            return
        names = [name + suffix for name in rows[1]]
        if self._written_rows.get(idx) == names:
            return
        self._written_rows[idx] = names
        order = [name for i in sorted(self._written_rows) for name in self._written_rows[i]]
        write_metadata(self._metadata_dir, module_order=order)

    def _count_clipped(self, stats: StepStats, decision: Decision) -> None:
        """Count clipped steps on device between logging steps (for the report and the progress bar)."""
        flag = _clipped_flag(stats, decision)
        if flag is None:
            return
        idx = stats.optimizer_idx
        count = self._clipped.get(idx)
        self._clipped[idx] = flag.to(torch.float32) if count is None else count + flag
        self._steps_since_log[idx] = self._steps_since_log.get(idx, 0) + 1

    def _note(self, idx: int, metrics: dict[str, Tensor], host: dict[str, float] | None, suffix: str) -> None:
        """Keep the logged values for the report and show them in the progress bar (one more host transfer)."""
        extra: dict[str, Tensor] = {}
        clipped = self._clipped.pop(idx, None)
        if clipped is not None:
            extra["grad_clip/clipped_fraction" + suffix] = clipped / self._steps_since_log.pop(idx)
        door = served(self._door, self)
        skipped = door.steps.skipped
        if skipped is not None:
            extra["gradkit/skipped_steps"] = skipped
        values = {**(host or values_to_host(metrics)), **(values_to_host(extra) if extra else {})}
        if self._record is not None:
            self._record.add(door.log_step, values, self._rows[idx][1] if idx in self._rows else [], suffix)
            if self.report_every_n_logs is not None and idx == 0:
                self._logs_since_report += 1
                if self._logs_since_report >= self.report_every_n_logs:
                    self._logs_since_report, self._report_due = 0, True
        if self.prog_bar:
            keys = ("grad_norm/total" + suffix, "grad_clip/clipped_fraction" + suffix, "gradkit/skipped_steps")
            shown = zip(PROG_BAR_KEYS, keys, strict=True)
            door.progress_bar({name + suffix: values[key] for name, key in shown if key in values})

    def metrics(self, stats: StepStats, outcome: StepOutcome) -> dict[str, Tensor]:
        """The gradient-norm metrics of one step, as device tensors (no host sync)."""
        decision = outcome.decision
        grads = stats.norms[self.norm_type]
        out = {"grad_norm/total": decision.scaled(grads.total)}
        if (decision.clipped or decision.clip_decided) and self.norm_type == stats.primary_norm_type:
            out["grad_norm/total_post_clip"] = outcome.post_clip_total()
        rows = self._module_rows(stats)
        if rows is not None:
            names, index = rows
            module_norms = decision.scaled(grouped_norms(grads.model_norms, index, len(names), self.norm_type))
            out.update({f"grad_norm/module/{name}": module_norms[i] for i, name in enumerate(names)})
        if self.param_groups:
            out.update({f"grad_norm/param_group_{i}": g for i, g in enumerate(decision.scaled(grads.group_norms))})
        return out

    def _module_rows(self, stats: StepStats) -> tuple[list[str], Tensor] | None:
        """The per-module rows of this optimizer's parameters, in model order, built once per parameter layout.

        Module norms are grouped here, from the per-parameter norms, on logging steps only: the pipeline need not
        group every step. Under pipeline parallelism the rows are every stage's, in stage order (the same on every
        stage; ``depth="auto"`` knows the repeated blocks of this rank's stage only).
        """
        if self.depth == 0:
            return None
        cached = self._rows.get(stats.optimizer_idx)
        if cached is not None and cached[0] is stats.index:
            return cached[1], cached[2]
        names = stats.primary.model_names
        if self.depth == "auto":
            keys = auto_module_keys(names, self._blocks)
        else:
            keys = [module_key(n, self.depth) for n in names]
        rows, positions = module_rows(keys, names, self._model_order if stats.index.pp is None else ())
        index = host_to_device(positions, torch.long, stats.index.shard_weight.device)
        self._rows[stats.optimizer_idx] = (stats.index, rows, index)
        return rows, index

    def _warn_zero_gradients(self, watch: _ZeroWatch, ctx: StepContext) -> None:
        """Name the parameters whose gradient stayed all zero through the watch (a logging step: one host read)."""
        names = [n for n in watch.read() if n not in self._reported_zero]
        self._reported_zero.update(names)
        if names:
            ctx.warn(
                f"GradNormMonitor: {len(names)} trainable parameter(s) had an all-zero gradient on each of the first "
                f"{watch.steps} optimizer steps (up to step {ctx.global_step}): {name_list(names)}. Check that "
                "the loss depends on them."
            )

    def _weight_metrics(self, stats: StepStats) -> dict[str, Tensor]:
        index = stats.index
        p = self.norm_type
        weights = [local_tensor(param.detach()) for param in index.params]
        local = per_tensor_norms(weights, p).to(index.shard_weight.device)
        norms = reduce_sharded(index, {p: local})[0][p]
        out = {"weight_norm/total": total_norm(norms, p)}
        rows = self._module_rows(stats)
        if rows is not None:
            names, row_index = rows
            module_norms = grouped_norms(norms, row_index, len(names), p)
            out.update({f"weight_norm/module/{name}": module_norms[i] for i, name in enumerate(names)})
        return out


@dataclass
class _ZeroWatch:
    """The all-zero-gradient check of one parameter index over its first :data:`ZERO_GRADIENT_STEPS` steps.

    Each step folds ``param_norms == 0`` into ``zero`` on the device (no host sync) and keeps in ``present`` the
    positions that had a gradient on every step so far (a missing gradient has its own warning). Once the steps are
    watched, the first logging step reads the result (:meth:`read`).
    """

    index: ParamIndex
    zero: Tensor | None = None
    present: set[int] | None = None
    steps: int = 0
    done: bool = False

    @property
    def ready(self) -> bool:
        return self.steps >= ZERO_GRADIENT_STEPS and not self.done

    def add(self, stats: StepStats, norm_type: float) -> None:
        if self.steps >= ZERO_GRADIENT_STEPS:
            return
        zero = stats.norms[norm_type].param_norms == 0
        self.zero = zero if self.zero is None else self.zero & zero
        if self.present is None:
            self.present = set(stats.present)
        elif len(stats.present) != self.index.num_params:  # with every gradient there, the set stays as it is
            self.present.intersection_update(stats.present)
        self.steps += 1

    def read(self) -> list[str]:
        """Names of the parameters whose gradient was all zero on every watched step (reads the device once)."""
        self.done = True
        assert self.zero is not None and self.present is not None
        zero = self.zero.cpu().nonzero().flatten().tolist()
        return [self.index.names[i] for i in zero if i in self.present]
