"""Gradient-norm logging from the shared one-pass statistics."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_gradkit._engine import GradKitCallback, Stage, StepPlan, _StatsRequest, is_logging_step, log_metrics
from lightning_gradkit.stats import (
    ParamIndex,
    combine_sharded,
    grouped_norms,
    local_tensor,
    per_tensor_norms,
    powered,
    total_norm,
    validate_norm_type,
)

_MAX_NAMES = 10


def _name_list(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES])
    return shown + (f" and {len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else "")


class GradNormMonitor(GradKitCallback):
    r"""Log gradient norms (total, per module, per param group) and optionally weight norms.

    The norms come from the step's shared :class:`~lightning_gradkit.stats.GradStats`: one
    ``torch._foreach_norm`` pass over all gradients at the optimizer-step boundary (after AMP unscaling and the DDP
    all-reduce; correct global values under FSDP1/FSDP2 through one all-reduce). Values are logged with
    ``pl_module.log`` on logging steps only, so any Lightning logger receives them and non-logging steps cost no
    host-device synchronization. With accumulation, the norms are measured once per optimizer step, at the boundary.

    Logged keys (``/opt{i}`` is appended when the Trainer has several optimizers):

    - ``grad_norm/total``: the total norm of the gradients the optimizer receives, before clipping.
    - ``grad_norm/total_post_clip``: the same after a gradkit clipping callback acted (when one is present).
    - ``grad_norm/module/<name>``: per module, the qualified module name cut at ``depth`` components.
    - ``grad_norm/param_group_<i>``: per optimizer param group.
    - ``weight_norm/total`` and ``weight_norm/module/<name>``: with ``weight_norms=True``.

    Trainable parameters that receive no gradient, or an all-zero gradient, are named in a warning, once each
    (the classic "training under ``no_grad``" or "loss not connected" failures). The checks start again for the
    parameters that join the optimizer during the fit (e.g. a backbone unfrozen by ``BackboneFinetuning``).

    Args:
        norm_type: the p of the norm, ``p >= 1`` or ``float("inf")``.
        depth: module-tree depth of the per-module norms: 1 groups by top-level children, 2 by their children,
            and so on. 0 turns per-module logging off.
        param_groups: also log one norm per optimizer param group.
        weight_norms: also log the weight norms (total and, with ``depth``, per module) on logging steps.
        report: at the end of ``fit``, render the gradient report (``lightning_gradkit.report``) into the logger's
            directory. Needs a ``CSVLogger`` and matplotlib (``pip install lightning_gradkit[report]``).
        log_every_n_steps: how often to log, in optimizer steps; defaults to the Trainer's
            ``log_every_n_steps``. With a period of its own the values go straight to ``trainer.loggers``
            (Lightning's ``self.log`` would re-send stale values on its own logging steps).

    Raises:
        ValueError: if ``norm_type`` < 1, ``depth`` < 0 or ``log_every_n_steps`` <= 0.
        RuntimeError: at fit start, if the model has no trainable parameter.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import GradNormMonitor
        >>> trainer = Trainer(callbacks=[GradNormMonitor(depth=2, param_groups=True)])
    """

    _stage = Stage.OBSERVE

    def __init__(
        self,
        norm_type: float = 2.0,
        depth: int = 0,
        param_groups: bool = False,
        weight_norms: bool = False,
        report: bool = False,
        log_every_n_steps: int | None = None,
    ) -> None:
        self.norm_type = validate_norm_type(norm_type)
        if depth < 0:
            raise ValueError(f"`depth` must be >= 0 (0 disables per-module norms), got {depth!r}.")
        if log_every_n_steps is not None and log_every_n_steps <= 0:
            raise ValueError(
                f"`log_every_n_steps` must be a positive integer, got {log_every_n_steps!r}. "
                "Leave it as None to follow the Trainer's `log_every_n_steps`."
            )
        self.depth = depth
        self.param_groups = param_groups
        self.weight_norms = weight_norms
        self.report = report
        self.log_every_n_steps = log_every_n_steps
        # The parameter index each check was done for (re-armed when parameters join or leave the optimizer), and
        # the names already reported.
        self._missing_checked: ParamIndex | None = None
        self._zero_checked: ParamIndex | None = None
        self._reported_missing: set[str] = set()
        self._reported_zero: set[str] = set()

    @property
    def state_key(self) -> str:
        return self._generate_state_key(norm_type=self.norm_type, depth=self.depth)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        if not any(p.requires_grad for p in pl_module.parameters()):
            raise RuntimeError(
                f"GradNormMonitor: `{type(pl_module).__name__}` has no trainable parameter (none has "
                "`requires_grad=True`), so there is no gradient to measure. Unfreeze some parameters or remove the "
                "callback."
            )

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.report or not trainer.is_global_zero:
            return
        if not isinstance(trainer.logger, CSVLogger):
            rank_zero_warn("GradNormMonitor(report=True) needs a CSVLogger (the report reads its metrics.csv).")
            return
        from lightning_gradkit.report import render

        trainer.logger.save()
        try:
            path = render(trainer.logger.log_dir)
        except ValueError as err:  # nothing logged yet (e.g. a run shorter than the logging period)
            rank_zero_warn(f"GradNormMonitor: no gradient report written: {err}")
            return
        rank_zero_info(f"GradNormMonitor: gradient report written to {path}")

    def _stats_request(self, request: _StatsRequest) -> None:
        request.norm_types.add(self.norm_type)
        request.depth = max(request.depth, self.depth)

    def _primary_norm_type(self) -> float | None:
        return self.norm_type

    def _observe(self, plan: StepPlan, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        missing = plan.stats[self.norm_type].missing
        if missing and plan.index is not self._missing_checked:
            self._missing_checked = plan.index
            missing = [n for n in missing if n not in self._reported_missing]
            self._reported_missing.update(missing)
            if missing:
                rank_zero_warn(
                    f"GradNormMonitor: {len(missing)} trainable parameter(s) received no gradient at step "
                    f"{trainer.global_step}: {_name_list(missing)}. They are not connected to the loss (or the "
                    "forward ran under `torch.no_grad`). Freeze them (`requires_grad_(False)`) if that is intended."
                )
        if not is_logging_step(trainer, self.log_every_n_steps):
            return
        suffix = f"/opt{plan.optimizer_idx}" if len(trainer.optimizers) > 1 else ""
        log_metrics(trainer, pl_module, {k + suffix: v for k, v in self.metrics(plan).items()}, self.log_every_n_steps)
        if plan.index is not self._zero_checked:
            self._warn_zero_gradients(plan, trainer)
        if self.weight_norms:
            log_metrics(
                trainer,
                pl_module,
                {k + suffix: v for k, v in self._weight_metrics(plan).items()},
                self.log_every_n_steps,
            )

    def metrics(self, plan: StepPlan) -> dict[str, Tensor]:
        """The gradient-norm metrics of one step, as device tensors (no host sync)."""
        stats = plan.stats[self.norm_type]
        out = {"grad_norm/total": plan.scaled(stats.total)}
        if plan.clipped and self.norm_type == plan.primary_norm_type:
            out["grad_norm/total_post_clip"] = plan.post_clip_total()
        if self.depth and stats.module_norms is not None:
            out.update(self._module_metrics("grad_norm", plan.scaled(stats.module_norms), stats.module_names))
        if self.param_groups:
            scaled_groups = plan.scaled(stats.group_norms)
            for i in range(stats.group_norms.numel()):
                out[f"grad_norm/param_group_{i}"] = scaled_groups[i]
        return out

    def _warn_zero_gradients(self, plan: StepPlan, trainer: pl.Trainer) -> None:
        stats = plan.stats[self.norm_type]
        present = torch.zeros(len(stats.names), dtype=torch.bool)
        present[plan.present] = True
        zero = ((stats.param_norms == 0).cpu() & present).nonzero().flatten().tolist()
        if not zero:
            return
        self._zero_checked = plan.index
        names = [stats.names[i] for i in zero if stats.names[i] not in self._reported_zero]
        self._reported_zero.update(names)
        if names:
            rank_zero_warn(
                f"GradNormMonitor: {len(names)} trainable parameter(s) have an all-zero gradient at step "
                f"{trainer.global_step}: {_name_list(names)}. Check that the loss depends on them."
            )

    def _weight_metrics(self, plan: StepPlan) -> dict[str, Tensor]:
        index = plan.index
        p = self.norm_type
        weights = [local_tensor(param.detach()) for param in index.params]
        norms = per_tensor_norms(weights, p).to(index.shard_weight.device)
        if index.any_sharded and dist.is_available() and dist.is_initialized():
            contrib = powered(norms, p) * index.shard_weight
            dist.all_reduce(contrib, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM)
            norms = combine_sharded(norms, index.shard_weight, contrib, p)
        out = {"weight_norm/total": total_norm(norms, p)}
        if index.module_index is not None and self.depth:
            module_norms = grouped_norms(norms, index.module_index, len(index.module_names), p)
            out.update(self._module_metrics("weight_norm", module_norms, index.module_names))
        return out

    def _module_metrics(self, prefix: str, norms: Tensor, names: list[str]) -> dict[str, Tensor]:
        """Per-module metrics at this monitor's depth (another callback may have asked the engine for a deeper one)."""
        regroup = _modules_at_depth(names, self.depth)
        if regroup is not None:
            names, index = regroup
            norms = grouped_norms(norms, index.to(norms.device), len(names), self.norm_type)
        return {f"{prefix}/module/{name}": norms[i] for i, name in enumerate(names)}


def _modules_at_depth(module_names: list[str], depth: int) -> tuple[list[str], Tensor] | None:
    """Map module names grouped at a deeper level to ``depth`` components; ``None`` when already at ``depth``."""
    cut = [".".join(n.split(".")[:depth]) if n != "<root>" else n for n in module_names]
    if cut == module_names:
        return None
    names = list(dict.fromkeys(cut))
    lookup = {n: i for i, n in enumerate(names)}
    return names, torch.tensor([lookup[n] for n in cut], dtype=torch.long)
