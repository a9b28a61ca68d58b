"""Gradient-norm logging from the shared one-pass statistics."""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from gradkit._arguments import check_bool, check_int, name_list, validate_norm_type
from gradkit.events import EVENTS_FILENAME, write_metadata
from gradkit.norms import (
    ParamIndex,
    clean_name,
    combine_sharded,
    grouped_norms,
    host_to_device,
    local_tensor,
    module_key,
    per_tensor_norms,
    powered,
    reduce_sharded,
    total_norm,
)
from gradkit.pipeline import StepContext, values_to_host
from gradkit.selection import auto_module_keys, module_rows, repeated_blocks
from lightning_gradkit._compat import batches_that_stepped
from lightning_gradkit._deepspeed import deepspeed_step, refuse_under_deepspeed, uses_deepspeed
from lightning_gradkit.engine import (
    Engine,
    GradKitCallback,
    Stage,
    StatsRequest,
    StepPlan,
    events_dir,
    log_metrics,
)

if TYPE_CHECKING:
    from gradkit.report import RunData


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


def _clipped_flag(plan: StepPlan) -> Tensor | None:
    """Whether a clipping callback scaled this step's gradients down (a bool device scalar), or None without one."""
    flags = []
    if plan.clip_decided and not plan.clipped:  # a clipper that left this step alone (ZClip's warm-up)
        return plan.primary.total < 0  # False, on device
    if plan.clip_coef is not None:
        flags.append(plan.clip_coef.reshape(()) < 1)
    if plan.param_coefs:
        coefs = list(plan.param_coefs.values())
        flags.append(torch.cat([c.reshape(-1).to(coefs[0].device) for c in coefs]).min() < 1)
    if plan.clamp_value is not None and math.inf in plan.stats:
        flags.append(plan.pre_clip_total(math.inf) > plan.clamp_value)
    return torch.stack([f.to(flags[0].device) for f in flags]).any() if flags else None


class GradNormMonitor(GradKitCallback):
    r"""Log gradient norms (total, per module, per param group) and optionally weight norms.

    The norms come from the step's shared :class:`~gradkit.norms.GradStats`: one
    ``torch._foreach_norm`` pass over all gradients at the optimizer-step boundary (after AMP unscaling and the DDP
    all-reduce; correct global values under FSDP1/FSDP2 through one all-reduce). Values are logged with
    ``pl_module.log`` on logging steps only, so any Lightning logger receives them and non-logging steps cost no
    host-device synchronization. With accumulation, the norms are measured once per optimizer step, at the boundary.

    Logging steps are every ``log_every_n_steps`` optimizer steps, plus the first optimizer step of each ``fit`` and
    the last one (when ``max_steps`` or ``max_epochs`` ends the run), so a run shorter than the period still shows
    its norms; a warning at train start says when the run has fewer optimizer steps than the period. The first and
    last steps go straight to ``trainer.loggers`` (one host transfer), since Lightning flushes ``self.log`` values
    on its own period only.

    Logged keys (``/opt{i}`` is appended when the Trainer has several optimizers):

    - ``grad_norm/total``: the total norm of the gradients the optimizer receives, before clipping.
    - ``grad_norm/total_post_clip``: the same after a gradkit clipping callback acted (when one is present).
    - ``grad_norm/module/<name>``: per module (see ``depth``).
    - ``grad_norm/param_group_<i>``: per optimizer param group.
    - ``weight_norm/total`` and ``weight_norm/module/<name>``: with ``weight_norms=True``.
    - ``update_ratio/total`` and ``update_ratio/module/<name>``: with ``update_ratio=True``, the update-to-weight
      ratio ``||w_after - w_before|| / ||w_before||`` (2-norms, whatever ``norm_type``) of this optimizer step.

    **Under Lightning's** ``DeepSpeedStrategy`` the DeepSpeed engine owns the step (see
    :mod:`lightning_gradkit._deepspeed`); the monitor logs what it measures, after ``engine.step()``:

    - ``grad_norm/total``: ``engine.get_global_grad_norm()``, the global 2-norm of the gradients after unscaling and
      before DeepSpeed's ``gradient_clipping`` (``inf`` on a step DeepSpeed skipped). Not logged, with one warning,
      where DeepSpeed computes none (ZeRO stage 0 in full precision).
    - ``deepspeed/skipped_steps``: ``engine.skipped_steps``, the steps DeepSpeed did not apply (fp16 overflow).

    Logging steps count DeepSpeed's optimizer steps (``engine.global_steps``, one per accumulation window), plus the
    first; the values go to ``trainer.loggers`` directly. A non-logging step reads two Python ints of the engine and
    nothing from the device. ``depth`` is not used; ``norm_type`` other than 2, ``param_groups``, ``weight_norms``,
    ``update_ratio``, ``report`` and ``prog_bar`` are refused at setup.

    **Update-to-weight ratio.** The ratio of the size of a step's update to the size of the weights is the usual
    learning-rate health signal: about ``1e-3`` per step is healthy (Karpathy, CS231n "ratio of weights:updates");
    far below, the learning rate is too low or the module does not train; far above, it is too high. On a logging
    step the monitor copies this optimizer's parameters (the local shards under FSDP/FSDP2) after the gradients are
    written and before the optimizer steps, and computes the ratio right after ``optimizer.step()`` returns (a
    ``torch.optim`` step post-hook, removed at the end of the batch, which logs it): one ``_foreach_sub_`` and two
    ``_foreach_norm`` passes, and under sharding one all-reduce. The ratio divides by the weights before the step (a
    module whose weights are all zero gets ``inf``, or ``nan`` if it did not move either). Cost: on logging steps
    only, one copy of the (local) parameters held during the optimizer step, so peak memory grows by the parameter
    bytes there; other steps cost nothing (no hook, no copy, no sync). A step the optimizer did not apply (a guard
    skipped it, the ``GradScaler`` found an inf, a fused optimizer was told ``found_inf``) logs ``0``: its update
    was zero.

    Trainable parameters that receive no gradient, or an all-zero gradient, are named in a warning, once each
    (the classic "training under ``no_grad``" or "loss not connected" failures). A gradient counts as all-zero when
    it is all zero on each of the first 4 optimizer steps (``ZERO_GRADIENT_STEPS``) of the fit, or after parameters
    joined the optimizer: a zero-initialised gain (the last BatchNorm of each ResNet block with
    ``zero_init_residual``) zeroes the gradients upstream of it on the first step only, which is no fault. Those
    steps cost two element-wise kernels on the per-parameter norms each and no host sync; the result is read on the
    first logging step after them. The checks start again for the parameters that join the optimizer during the fit
    (e.g. a backbone unfrozen by ``BackboneFinetuning``). A model with no trainable parameter at fit start (a
    ``BaseFinetuning`` callback froze everything in ``setup`` and unfreezes at an epoch start) gets a warning; its
    parameters are measured from the step they join. Every gradient the optimizer applies is measured, also one on a
    parameter with ``requires_grad=False`` (FSDP2, see ``GradKitModelParallelStrategy``).

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
        report: at the end of ``fit``, render the gradient report (``gradkit.report``) to
            ``gradient_report.png`` in the log directory. The monitor keeps the values it logs (rank 0, on logging
            steps), so any logger, or none, will do. Needs matplotlib: ``pip install -e '.[report]'`` in the
            lightning_gradkit checkout.
        log_every_n_steps: how often to log, in optimizer steps; defaults to the Trainer's
            ``log_every_n_steps``. With a period of its own the values go straight to ``trainer.loggers``
            (Lightning's ``self.log`` would re-send stale values on its own logging steps).
        prog_bar: show the total norm (``grad_norm``), the fraction of optimizer steps clipped since the previous
            logging step (``clipped``, with a clipping callback) and the number of skipped steps (``skipped``, with
            a guard that skips) in Lightning's progress bar, updated on logging steps.

    Raises:
        ValueError: if ``norm_type`` < 1, ``depth`` is neither ``"auto"`` nor an integer >= 0, or
            ``log_every_n_steps`` is not a positive integer; at setup, if the Trainer has another GradNormMonitor.
        ModuleNotFoundError: with ``report=True``, if matplotlib is not installed.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import GradNormMonitor
        >>> trainer = Trainer(callbacks=[GradNormMonitor(param_groups=True, report=True)])
    """

    stage = Stage.OBSERVE

    def __init__(
        self,
        norm_type: float = 2.0,
        depth: int | Literal["auto"] = "auto",
        param_groups: bool = False,
        weight_norms: bool = False,
        update_ratio: bool = False,
        report: bool = False,
        log_every_n_steps: int | None = None,
        prog_bar: bool = False,
    ) -> None:
        self.norm_type = validate_norm_type(norm_type)
        if not (isinstance(depth, str) and depth == "auto"):
            depth = check_int(
                "depth",
                depth,
                0,
                hint="Use 'auto' for one row per repeated block, an integer to cut module names at that many "
                "components, 0 to turn per-module norms off.",
            )
        self.depth: int | Literal["auto"] = depth
        self.param_groups = check_bool("param_groups", param_groups)
        self.weight_norms = check_bool("weight_norms", weight_norms)
        self.update_ratio = check_bool("update_ratio", update_ratio)
        self.report = check_bool("report", report)
        if report and importlib.util.find_spec("matplotlib") is None:
            from gradkit.report import INSTALL_HINT

            raise ModuleNotFoundError(
                "GradNormMonitor(report=True) draws the report with matplotlib, which is not installed: "
                f"{INSTALL_HINT}; or leave `report=False`."
            )
        if log_every_n_steps is not None:
            check_int(
                "log_every_n_steps",
                log_every_n_steps,
                1,
                hint="Leave it as None to follow the Trainer's `log_every_n_steps`.",
            )
        self.log_every_n_steps = log_every_n_steps
        # The parameter index each check was done for (re-armed when parameters join or leave the optimizer), and
        # the names already reported.
        self._missing_checked: ParamIndex | None = None
        self._zero_watch: dict[int, _ZeroWatch] = {}
        self._reported_missing: set[str] = set()
        self._reported_zero: set[str] = set()
        self.prog_bar = check_bool("prog_bar", prog_bar)
        self._first_pending = True
        self._model_order: list[str] = []
        self._blocks: list[str] = []
        self._rows: dict[int, tuple[ParamIndex, list[str], Tensor]] = {}
        self._clipped: dict[int, Tensor] = {}
        self._steps_since_log: dict[int, int] = {}
        self._record: _Record | None = None
        self._report_dir: Path | None = None
        self._metadata_dir: Path | None = None
        self._written_rows: dict[int, list[str]] = {}
        # Under DeepSpeed: the engine's step count at the last batch end, and whether a missing norm was reported.
        self._deepspeed = False
        self._deepspeed_steps = 0
        self._warned_no_deepspeed_norm = False
        # Update ratio: the parameters before the step of a logging step, per optimizer, and the step hooks.
        self._before: dict[int, _Before] = {}
        self._step_hooks: dict[int, RemovableHandle] = {}

    @property
    def state_key(self) -> str:
        return self._generate_state_key(norm_type=self.norm_type, depth=self.depth)

    @property
    def report_data(self) -> RunData | None:
        """With ``report=True``, on global rank 0: the values logged so far (what the report draws), else None."""
        if self._record is None:
            return None
        # Imported here: `python -m gradkit.report` must not find the module imported by the package.
        from gradkit.report import RunData

        events = RunData.read_events(self._report_dir / EVENTS_FILENAME) if self._report_dir is not None else []
        return self._record.run_data(events)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        monitors = [cb for cb in trainer.callbacks if isinstance(cb, GradNormMonitor)]
        if len(monitors) > 1:
            raise ValueError(
                f"The Trainer has {len(monitors)} GradNormMonitor callbacks: each would log the same `grad_norm/*` "
                "keys. Keep exactly one and give it every option you need (`depth`, `param_groups`, `weight_norms`, "
                "`update_ratio`, `report`, `prog_bar`)."
            )
        self._deepspeed = uses_deepspeed(trainer)
        if self._deepspeed and stage == "fit":
            self._refuse_deepspeed_options(trainer)
        # `trainer.log_dir` broadcasts rank 0's directory: every rank asks at the same point.
        directory = events_dir(trainer) if self.report or trainer.loggers else None
        if self.report:
            self._report_dir = directory
        # The model order of the rows goes next to the logs (rank 0), for `python -m gradkit.report`.
        self._metadata_dir = directory if trainer.loggers and trainer.is_global_zero else None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._deepspeed:
            self._first_pending = True
            self._deepspeed_steps = deepspeed_step(trainer.strategy).steps
            return
        super().on_fit_start(trainer, pl_module)
        if not any(p.requires_grad for p in pl_module.parameters()):
            # Valid in Lightning: a `BaseFinetuning` callback may freeze everything in `setup` and unfreeze at an epoch
            # start. The engine's index picks the parameters up when they join.
            rank_zero_warn(
                f"GradNormMonitor: `{type(pl_module).__name__}` has no trainable parameter at fit start (none has "
                "`requires_grad=True`; a `BaseFinetuning` callback may have frozen them). The monitor picks "
                "parameters up when they join (unfrozen with `requires_grad_(True)` or added with `add_param_group`) "
                "and logs their norms from then on."
            )
        self._start(pl_module)
        self._record = _Record() if self.report and trainer.is_global_zero else None

    def _start(self, model: torch.nn.Module) -> None:
        """What a fit starts from: the model's parameter order and blocks, nothing logged yet."""
        # Names as the engine cleans them (no FSDP / checkpoint-wrapper / compile components), in registration order.
        self._model_order = [clean_name(n) for n, _ in model.named_parameters()]
        self._blocks = repeated_blocks((clean_name(n), m) for n, m in model.named_modules())
        self._rows.clear()
        self._written_rows.clear()
        self._clipped.clear()
        self._steps_since_log.clear()
        self._first_pending = True

    def attach(self, ctx: StepContext, model: torch.nn.Module) -> None:
        needs_trainer = [name for name in ("report", "prog_bar", "update_ratio") if getattr(self, name)]
        if needs_trainer:
            raise ValueError(
                f"GradNormMonitor({needs_trainer[0]}=True) needs a Lightning `Trainer` (its loggers' directory, "
                "progress bar or batch hooks); outside one, set it to False. The gradient norms are logged through "
                "the loop's `log` function."
            )
        self._start(model)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        period = trainer.log_every_n_steps if self.log_every_n_steps is None else self.log_every_n_steps
        try:
            total = trainer.estimated_stepping_batches
        except MisconfigurationException:  # an accumulation schedule: no single estimate
            return
        if period and math.isfinite(total) and 0 < total < period:
            rank_zero_warn(
                f"GradNormMonitor: this run has {int(total)} optimizer step(s), fewer than the logging period of "
                f"{period} (`log_every_n_steps`, counted in optimizer steps): gradient norms are logged on the first "
                "and the last step only. Lower `Trainer(log_every_n_steps=...)` or "
                "`GradNormMonitor(log_every_n_steps=...)` to see more."
            )

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._record is None or self._report_dir is None:
            return
        from gradkit.report import REPORT_FILE, render_data

        try:
            path = render_data(self.report_data, self._report_dir / REPORT_FILE, source="GradNormMonitor")
        except ValueError as err:  # nothing logged (a run stopped before its first optimizer step)
            rank_zero_warn(f"GradNormMonitor: no gradient report written: {err}")
            return
        rank_zero_info(f"GradNormMonitor: gradient report written to {path}")

    # -- under DeepSpeed: the engine's own values, after its step -------------------------------------------------
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if not self._deepspeed:  # DeepSpeed measures inside `engine.step()`, which comes after this hook
            super().on_before_optimizer_step(trainer, pl_module, optimizer)

    def _refuse_deepspeed_options(self, trainer: pl.Trainer) -> None:
        """Refuse the options DeepSpeed's one global 2-norm per step cannot serve."""
        options = {
            "norm_type": (self.norm_type, 2.0),
            "param_groups": (self.param_groups, False),
            "weight_norms": (self.weight_norms, False),
            "update_ratio": (self.update_ratio, False),
            "report": (self.report, False),
            "prog_bar": (self.prog_bar, False),
        }
        for name, (value, supported) in options.items():
            if value != supported:
                refuse_under_deepspeed(
                    trainer,
                    f"`GradNormMonitor({name}={value!r})`",
                    "under DeepSpeed the monitor logs what the DeepSpeed engine measures inside its step, one global "
                    "2-norm per optimizer step (`engine.get_global_grad_norm()`), since the gradients live in "
                    "DeepSpeed's own buffers (ZeRO)",
                    f"Leave `{name}={supported!r}` (the default): `grad_norm/total` and `deepspeed/skipped_steps` "
                    "are logged.",
                )

    def _log_deepspeed(self, trainer: pl.Trainer) -> None:
        """Log DeepSpeed's global norm and skipped steps after a DeepSpeed optimizer step, on logging steps only.

        Counted in DeepSpeed optimizer steps (``engine.global_steps``): with ``accumulate_grad_batches``, Lightning
        calls ``engine.step()`` after every micro-batch and DeepSpeed steps once per window. A non-logging step reads
        two Python ints of the engine and nothing from the device.
        """
        step = deepspeed_step(trainer.strategy)
        if step.steps == self._deepspeed_steps:  # inside an accumulation window: DeepSpeed did not step
            return
        self._deepspeed_steps = step.steps
        period = trainer.log_every_n_steps if self.log_every_n_steps is None else self.log_every_n_steps
        last = trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps
        if period == 0 or not (step.steps % period == 0 or self._first_pending or last or trainer.should_stop):
            return
        self._first_pending = False
        metrics: dict[str, float] = {}
        if step.grad_norm is not None:
            metrics["grad_norm/total"] = float(step.grad_norm)  # the one device read, on logging steps only
        elif not self._warned_no_deepspeed_norm:
            self._warned_no_deepspeed_norm = True
            rank_zero_warn(
                "GradNormMonitor: the DeepSpeed engine computed no global gradient norm "
                "(`engine.get_global_grad_norm()` is None), so `grad_norm/total` is not logged. DeepSpeed computes it "
                "under ZeRO stage 1-3 or with fp16/bf16; with ZeRO stage 0 in full precision it steps the torch "
                "optimizer directly and measures nothing."
            )
        metrics["deepspeed/skipped_steps"] = float(step.skipped)
        logged_at = batches_that_stepped(trainer)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=logged_at)

    def request_stats(self, request: StatsRequest) -> None:
        request.norm_types.add(self.norm_type)

    def primary_norm_type(self) -> float | None:
        return self.norm_type

    def observe(self, plan: StepPlan, ctx: StepContext) -> None:
        missing = plan.stats[self.norm_type].missing
        if missing and plan.index is not self._missing_checked:
            self._missing_checked = plan.index
            missing = [n for n in missing if n not in self._reported_missing]
            self._reported_missing.update(missing)
            if missing:
                ctx.warn(
                    f"GradNormMonitor: {len(missing)} trainable parameter(s) received no gradient at step "
                    f"{ctx.global_step}: {name_list(missing)}. They are not connected to the loss (or the "
                    "forward ran under `torch.no_grad`). Freeze them (`requires_grad_(False)`) if that is intended."
                )
        idx = plan.optimizer_idx
        watch = self._zero_watch.get(idx)
        if watch is None or watch.index is not plan.index:
            watch = self._zero_watch[idx] = _ZeroWatch(plan.index)
        watch.add(plan, self.norm_type)
        if self._record is not None or self.prog_bar:
            self._count_clipped(plan)
        on_period = ctx.is_logging_step(self.log_every_n_steps)
        period = ctx.log_every_n_steps if self.log_every_n_steps is None else self.log_every_n_steps
        extra = not on_period and period != 0 and (self._first_pending or ctx.is_last_step())
        if not (on_period or extra):
            return
        self._first_pending = False
        suffix = f"/opt{idx}" if len(ctx.optimizers) > 1 else ""
        metrics = {k + suffix: v for k, v in self.metrics(plan).items()}
        if self.weight_norms:
            metrics.update({k + suffix: v for k, v in self._weight_metrics(plan).items()})
        host: dict[str, float] | None = None
        if on_period:
            ctx.log(metrics, self.log_every_n_steps)
        else:
            host = values_to_host(metrics)
            ctx.log_values(host)
        if watch.ready:
            self._warn_zero_gradients(watch, ctx)
        self._write_row_order(idx, suffix)
        if self._record is not None or self.prog_bar:
            self._note(plan, ctx.trainer, ctx.pl_module, metrics, host, suffix)
        if self.update_ratio:
            self._keep_before(plan, suffix, on_period)

    # -- update-to-weight ratio (logging steps only) --------------------------------------------------------------
    def _keep_before(self, plan: StepPlan, suffix: str, on_period: bool) -> None:
        """Copy the parameters before the step and arm the hook that measures the update after it."""
        index = plan.index
        before = [local_tensor(p.detach()).clone() for p in index.params]
        weight_norms = per_tensor_norms(before, 2.0, index.run_bounds).to(index.shard_weight.device)
        idx = plan.optimizer_idx
        self._before[idx] = _Before(index, before, weight_norms, self._module_rows(plan), suffix, on_period)
        if idx not in self._step_hooks:
            hook = functools.partial(self._after_step, idx)
            self._step_hooks[idx] = plan.optimizer.register_step_post_hook(hook)

    def _after_step(self, idx: int, optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """``optimizer.step()`` returned (a ``torch.optim`` step post-hook): measure the update of a logging step.

        The ratios are logged at the batch end, with those of a step that did not happen, from one hook: Lightning
        keeps a logged key per hook, and the same key logged from two hooks would be re-sent stale.
        """
        before = self._before.get(idx)
        if before is None or before.ratios is not None:  # another step of the same batch (manual optimization)
            return
        with torch.no_grad():
            before.ratios = update_ratios(before.index, before.params, before.weight_norms, before.rows)
        before.params = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._deepspeed:
            self._log_deepspeed(trainer)
            return
        if not self._step_hooks:  # not a logging step with `update_ratio`: nothing to do
            return
        for handle in self._step_hooks.values():
            handle.remove()
        self._step_hooks.clear()
        for before in self._before.values():
            ratios = before.ratios
            if ratios is None:
                # The step hook did not run: the optimizer did not step (a guard skipped it, the GradScaler found an
                # inf). The update was zero. The parameters are not read here: a rollback may have restored them.
                zero = torch.zeros((), device=before.weight_norms.device)
                rows = before.rows[0] if before.rows is not None else []
                ratios = {f"update_ratio/{name}": zero for name in ["total", *(f"module/{r}" for r in rows)]}
            self._log_ratios(trainer, pl_module, before, ratios)
        self._before.clear()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for handle in self._step_hooks.values():  # a fit that raised inside a logging step's batch
            handle.remove()
        self._step_hooks.clear()
        self._before.clear()

    def _log_ratios(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, before: _Before, ratios: dict[str, Tensor]
    ) -> None:
        """Log the ratios as the step's other values were logged (one host transfer off the Trainer's period)."""
        metrics = {k + before.suffix: v for k, v in ratios.items()}
        step = batches_that_stepped(trainer)
        host: dict[str, float] | None = None
        if before.on_period:
            log_metrics(trainer, pl_module, metrics, self.log_every_n_steps)
        else:
            host = values_to_host(metrics)
            for logger in trainer.loggers:
                logger.log_metrics(host, step=step)
        if self._record is not None:
            self._record.merge(step, host or values_to_host(metrics))

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

    def _count_clipped(self, plan: StepPlan) -> None:
        """Count clipped steps on device between logging steps (for the report and the progress bar)."""
        flag = _clipped_flag(plan)
        if flag is None:
            return
        idx = plan.optimizer_idx
        count = self._clipped.get(idx)
        self._clipped[idx] = flag.to(torch.float32) if count is None else count + flag
        self._steps_since_log[idx] = self._steps_since_log.get(idx, 0) + 1

    def _note(
        self,
        plan: StepPlan,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        metrics: dict[str, Tensor],
        host: dict[str, float] | None,
        suffix: str,
    ) -> None:
        """Keep the logged values for the report and show them in the progress bar (one more host transfer)."""
        idx = plan.optimizer_idx
        extra: dict[str, Tensor] = {}
        clipped = self._clipped.pop(idx, None)
        if clipped is not None:
            extra["grad_clip/clipped_fraction" + suffix] = clipped / self._steps_since_log.pop(idx)
        skipped = Engine.of(trainer).skipped_steps
        if skipped is not None:
            extra["gradkit/skipped_steps"] = skipped
        values = {**(host or values_to_host(metrics)), **(values_to_host(extra) if extra else {})}
        step = batches_that_stepped(trainer)
        if self._record is not None:
            self._record.add(step, values, self._rows[idx][1] if idx in self._rows else [], suffix)
        if self.prog_bar:
            shown = {
                "grad_norm": values.get("grad_norm/total" + suffix),
                "clipped": values.get("grad_clip/clipped_fraction" + suffix),
                "skipped": values.get("gradkit/skipped_steps"),
            }
            # CPU tensors: the progress bar reads them every batch, which must not synchronize the device.
            pl_module.log_dict(
                {k + suffix: torch.tensor(v) for k, v in shown.items() if v is not None},
                prog_bar=True,
                logger=False,
                on_step=True,
                on_epoch=False,
                batch_size=1,
            )

    def metrics(self, plan: StepPlan) -> dict[str, Tensor]:
        """The gradient-norm metrics of one step, as device tensors (no host sync)."""
        stats = plan.stats[self.norm_type]
        out = {"grad_norm/total": plan.scaled(stats.total)}
        if (plan.clipped or plan.clip_decided) and self.norm_type == plan.primary_norm_type:
            out["grad_norm/total_post_clip"] = plan.post_clip_total()
        rows = self._module_rows(plan)
        if rows is not None:
            names, index = rows
            module_norms = grouped_norms(stats.param_norms, index, len(names), self.norm_type)
            out.update(self._module_metrics("grad_norm", plan.scaled(module_norms), names))
        if self.param_groups:
            scaled_groups = plan.scaled(stats.group_norms)
            for i in range(stats.group_norms.numel()):
                out[f"grad_norm/param_group_{i}"] = scaled_groups[i]
        return out

    def _module_rows(self, plan: StepPlan) -> tuple[list[str], Tensor] | None:
        """The per-module rows of this optimizer's parameters, in model order, built once per parameter layout.

        Module norms are grouped here, from the per-parameter norms, on logging steps only: the engine need not
        group every step.
        """
        if self.depth == 0:
            return None
        cached = self._rows.get(plan.optimizer_idx)
        if cached is not None and cached[0] is plan.index:
            return cached[1], cached[2]
        names = plan.index.names
        if self.depth == "auto":
            keys = auto_module_keys(names, self._blocks)
        else:
            keys = [module_key(n, self.depth) for n in names]
        rows, positions = module_rows(keys, names, self._model_order)
        index = host_to_device(positions, torch.long, plan.index.shard_weight.device)
        self._rows[plan.optimizer_idx] = (plan.index, rows, index)
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

    def _weight_metrics(self, plan: StepPlan) -> dict[str, Tensor]:
        index = plan.index
        p = self.norm_type
        weights = [local_tensor(param.detach()) for param in index.params]
        local = per_tensor_norms(weights, p).to(index.shard_weight.device)
        norms = reduce_sharded(index, {p: local})[0][p]
        out = {"weight_norm/total": total_norm(norms, p)}
        rows = self._module_rows(plan)
        if rows is not None:
            names, row_index = rows
            out.update(self._module_metrics("weight_norm", grouped_norms(norms, row_index, len(names), p), names))
        return out

    @staticmethod
    def _module_metrics(prefix: str, norms: Tensor, names: list[str]) -> dict[str, Tensor]:
        return {f"{prefix}/module/{name}": norms[i] for i, name in enumerate(names)}


def update_ratios(
    index: ParamIndex, before: list[Tensor], weight_norms: Tensor, rows: tuple[list[str], Tensor] | None
) -> dict[str, Tensor]:
    """The update-to-weight ratios ``||w - w_before|| / ||w_before||`` (2-norms), total and per row.

    Overwrites ``before`` with the update (one ``_foreach_sub_``), takes its per-parameter norms (one
    ``_foreach_norm`` per device/dtype group) and, when some parameter is sharded, sums the shards' squares in one
    all-reduce (:func:`~gradkit.norms.reduce_sharded`, the weights' squares riding along as an extra).

    Args:
        index: the parameters of one optimizer.
        before: copies of this rank's (local) parameters, taken before the step, in ``index`` order.
        weight_norms: this rank's per-parameter 2-norms of ``before``.
        rows: the per-module rows and the row of every parameter, or None for the total only.

    Example::

        >>> from gradkit.norms import build_param_index
        >>> w = torch.nn.Parameter(torch.full((4,), 2.0))
        >>> index = build_param_index([{"params": [w]}], {id(w): "w"}, 0, torch.device("cpu"))
        >>> before = [w.detach().clone()]
        >>> with torch.no_grad():
        ...     _ = w.sub_(0.004)
        >>> update_ratios(index, before, per_tensor_norms(before, 2.0), None)["update_ratio/total"]
        tensor(0.0020)
    """
    device = index.shard_weight.device
    torch._foreach_sub_(before, [local_tensor(p.detach()) for p in index.params])
    update_local = per_tensor_norms(before, 2.0, index.run_bounds).to(device)
    extras = {_WEIGHT_SQUARES: powered(weight_norms, 2.0) * index.shard_weight} if index.any_sharded else {}
    norms, reduced = reduce_sharded(index, {2.0: update_local}, extras)
    update = norms[2.0]
    weights = (
        combine_sharded(weight_norms, index.shard_weight, reduced[_WEIGHT_SQUARES], 2.0) if extras else weight_norms
    )
    out = {"update_ratio/total": total_norm(update, 2.0) / total_norm(weights, 2.0)}
    if rows is not None:
        names, row_index = rows
        ratio = grouped_norms(update, row_index, len(names), 2.0) / grouped_norms(weights, row_index, len(names), 2.0)
        out.update({f"update_ratio/module/{name}": ratio[i] for i, name in enumerate(names)})
    return out


_WEIGHT_SQUARES = "update_ratio.weight_squares"


@dataclass
class _Before:
    """What a logging step keeps of one optimizer's parameters for the update ratio: the copies until the step
    returns, then the ratios until the batch ends."""

    index: ParamIndex
    params: list[Tensor]
    weight_norms: Tensor
    rows: tuple[list[str], Tensor] | None
    suffix: str
    on_period: bool
    ratios: dict[str, Tensor] | None = None


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

    def add(self, plan: StepPlan, norm_type: float) -> None:
        if self.steps >= ZERO_GRADIENT_STEPS:
            return
        zero = plan.stats[norm_type].param_norms == 0
        self.zero = zero if self.zero is None else self.zero & zero
        if self.present is None:
            self.present = set(plan.present)
        elif len(plan.present) != self.index.num_params:  # with every gradient there, the set stays as it is
            self.present.intersection_update(plan.present)
        self.steps += 1

    def read(self) -> list[str]:
        """Names of the parameters whose gradient was all zero on every watched step (reads the device once)."""
        self.done = True
        assert self.zero is not None and self.present is not None
        zero = self.zero.cpu().nonzero().flatten().tolist()
        return [self.index.names[i] for i in zero if i in self.present]


class _Record:
    """The values the monitor logged, kept on the host for the report (rank 0, ``report=True``).

    Past ``max_steps`` logged steps every other one is dropped (and from then on only every other one kept), so a
    long run at a short logging period keeps a bounded record: the figure cannot show more columns anyway.
    """

    def __init__(self, max_steps: int = 4096) -> None:
        self.max_steps = max_steps
        self.steps: list[int] = []
        self.values: list[dict[str, float]] = []
        self.module_order: list[str] = []
        self._stride = 1
        self._seen = 0

    def add(self, step: int, values: dict[str, float], modules: list[str], suffix: str) -> None:
        if not self.module_order:
            self.module_order = [name + suffix for name in modules]
        self._seen += 1
        if (self._seen - 1) % self._stride:
            return
        if self.steps and self.steps[-1] == step:  # a second optimizer logged at the same step
            self.values[-1].update(values)
            return
        self.steps.append(step)
        self.values.append(values)
        if len(self.steps) > self.max_steps:
            self.steps, self.values = self.steps[::2], self.values[::2]
            self._stride *= 2

    def merge(self, step: int, values: dict[str, float]) -> None:
        """Add values measured after the step (the update ratio) to the record of ``step``, if it was kept."""
        if self.steps and self.steps[-1] == step:
            self.values[-1].update(values)

    def run_data(self, events: list[dict]) -> RunData:
        from gradkit.report import RunData

        data = RunData(events=events, module_order=self.module_order)
        for step, values in zip(self.steps, self.values, strict=True):
            for key, value in values.items():
                data.series[key][step] = value
        return data
