"""The step pipeline, without Lightning: measure once, decide once, touch the gradients once.

This is the engine every front door drives: the Lightning ``Trainer`` callbacks
(:class:`~lightning_gradkit.engine.Engine`), Lightning Fabric and a plain PyTorch loop
(:class:`~gradkit.loop.GradKit`). It imports torch only. :meth:`Pipeline.run` is the list of the phases,
one method or function each:

1. **measure** (:meth:`Pipeline._measure`): every gradient is read once, into this rank's per-parameter norms (and
   the unit norms AGC asks for), for the norm types the policies request (``request_stats``).
2. **reduce** (:meth:`Pipeline._reduce`): at most ONE all-reduce carries the sharded norm contributions and the
   per-rank scalars the policies name (``reduce_request``: window loss, token counts) together, and, when a guard
   asks for it, each rank's flag of non-finite local gradients: the finite flag, and so every skip decision, is
   then the same on every rank. The inf-norm of sharded gradients is a maximum, not a sum: when a policy asks for
   it, it takes a second all-reduce (:func:`~gradkit.norms.reduce_sharded`). The result is the
   :class:`StepPlan`.
3. **decide** (:func:`decide`): each policy's ``decide`` in stage order, ``SCALE`` (accumulation) -> ``GUARD``
   (skip flags) -> ``CLIP`` (coefficient) -> ``OBSERVE``. Each reads the plan and writes its decision to it; none
   reads the gradients.
4. **apply** (:meth:`StepPlan.apply`): one ``torch._foreach_mul_`` per (device, dtype) group with the product of
   all scales, kept in fp32 (per-parameter factors, if any, are folded into that same pass), plus a clamp for value
   clipping. Sparse gradients are written through their values.
5. **observe** (:meth:`Pipeline.observe`): the skip count, and each policy's ``observe`` (logging, on logging
   steps only).

A phase that has nothing to do this step costs nothing: no unit norms unless asked, no collective in a single
process (nor without sharded gradients and per-rank scalars), no write when no policy scales or clips.

What the pipeline needs of the loop around it is a :class:`StepContext`: the step's identity, the optimizers, the
parameter names, the AMP loss scale the gradients still carry, the logging rule and where logged values go. Each
front door supplies one; the policies (:class:`Policy`) read the same context, so a policy decides the same way
behind every door.

Under 16-mixed AMP, while the gradients are still multiplied by the loss scale (an optimizer that unscales inside
its own ``step``, ``fused=True``, under Lightning; every optimizer under Fabric's or a plain ``GradScaler``), the
pipeline divides every norm by the scaler's scale tensor (no host sync), so that all statistics and thresholds mean
the same as without AMP, and records the factor in ``StepPlan.loss_scale``; a multiplicative clip coefficient is
equally valid on scaled gradients, and a value clamp is widened by that factor.

Once per set of gradients: the pipeline runs at the first call for an optimizer step, whoever makes it, and later
calls for the same gradients find it done. An optimizer that evaluates its closure again inside ``step`` (``LBFGS``,
SAM) produces new gradients within the same step: they are scaled and clipped, never decided again
(:mod:`gradkit._closure` states the rule and holds its code).

Map of this file, in order: :class:`Stage`; :class:`UnitNorms` and :class:`StepPlan` (the plan, its one write and
the write kernels); :class:`StatsRequest`; :class:`StepContext` and :class:`Policy` (what the pipeline reads of the
loop and of the policies); :class:`Pipeline` (the parameter-index cache, :meth:`~Pipeline.run` and the phases); the
gradient read (``_read_step``, ``_measure_units``, ``_param_norms``).
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from gradkit._arguments import name_list
from gradkit._closure import Evaluation, Evaluations, decide_again
from gradkit._torch_compat import handles_found_inf
from gradkit.norms import (
    GradStats,
    ParamIndex,
    build_param_index,
    derive_stats,
    fill_present,
    local_tensor,
    nonfinite_mask,
    per_tensor_norms,
    positions_tensor,
    reduce_sharded,
    resolve_partial_grads,
    row_norms,
    sparse_values,
    steps_in_optimizer,
    total_norm,
    world_size,
)

if TYPE_CHECKING:
    from gradkit.culprit import MicroBatch

__all__ = [
    "Pipeline",
    "Policy",
    "Roster",
    "Stage",
    "StatsRequest",
    "StepContext",
    "StepPlan",
    "UnitNorms",
    "hook",
    "is_policy",
    "state_key",
    "unwrapped",
    "values_to_host",
]


# -- the plan and its one write ------------------------------------------------------------------------------------
class Stage(IntEnum):
    """The order in which policies decide within one step."""

    SCALE = 0
    GUARD = 1
    CLIP = 2
    OBSERVE = 3


@dataclass
class UnitNorms:
    """Unit-wise 2-norms of some gradients (AGC): one norm per slice along dim 0, i.e. per output unit.

    Measured in the engine's single read of the gradients, for the parameters a callback named in
    ``StatsRequest.unit_norm_names`` whose gradient has more than one dimension; the per-parameter norms in
    ``StepPlan.stats`` are derived from them, so those gradients are read once. Values are local to the rank (a
    sharded gradient holds whole rows under FSDP2's dim-0 sharding) and already divided by ``StepPlan.loss_scale``,
    but not multiplied by ``StepPlan.scale``.

    Attributes:
        positions: index positions (in ``ParamIndex.params``) of the parameters, in order.
        sizes: number of (local) units of each.
        flat: ``[sum(sizes)]`` the unit norms of all of them, concatenated in that order.
    """

    positions: list[int]
    sizes: list[int]
    flat: Tensor


@dataclass
class StepPlan:
    """Everything measured and decided for one optimizer step. All values are device tensors.

    Policies write ``scale`` (via :meth:`multiply_scale`), ``clip_coef``, ``param_coefs``, ``clamp_value`` and
    skip flags (via :meth:`add_skip`); the engine applies them in one pass.

    ``grads`` holds the gradients of the parameters at ``present`` (positions in ``index``), and ``run_ids`` the
    (device, dtype) group of each (``ParamIndex.run_of``), ``-1`` for a sparse one. Sparse COO gradients are
    coalesced by the engine's read (``p.grad`` is replaced by its coalesced version), so their values are the
    gradient. The engine empties ``grads`` once the plan is applied (:meth:`release_gradients`): a plan kept after
    its step must not keep the step's gradients alive once the optimizer's ``zero_grad`` drops them.

    ``loss_scale`` is set when the gradients are still multiplied by the AMP loss scale (fused optimizers under
    16-mixed); every norm in ``stats`` and ``unit_norms`` is already expressed without it, and ``clamp_value`` is
    meant in those unscaled units too.
    """

    optimizer: Optimizer
    optimizer_idx: int
    index: ParamIndex
    grads: list[Tensor]
    present: list[int]
    stats: dict[float, GradStats]
    reduced: dict[str, Tensor]
    primary_norm_type: float
    logging_step: bool
    scale: Tensor | None = None
    clip_coef: Tensor | None = None
    param_coefs: dict[int, Tensor] = field(default_factory=dict)
    clamp_value: float | None = None
    skip: Tensor | None = None
    post_clip_total_fn: Callable[[], Tensor] | None = None
    loss_scale: Tensor | None = None
    unit_norms: UnitNorms | None = None
    run_ids: list[int] = field(default_factory=list)
    run_bounds: list[tuple[int, int]] | None = None
    #: Whether a clipping policy decided this step, even to leave the gradients alone (ZClip in its warm-up).
    clip_decided: bool = False
    #: The common factor (accumulation scale times clip coefficient) left for a fused optimizer to apply through its
    #: ``grad_scale`` (see :meth:`apply`); ``None`` when the gradients were written.
    folded: Tensor | None = None
    _post_clip_total: Tensor | None = None
    _skip_host: bool | None = None
    _released: bool = False

    @property
    def primary(self) -> GradStats:
        """Statistics at the primary norm type (the monitor's, 2.0 by default)."""
        return self.stats[self.primary_norm_type]

    def scaled(self, value: Tensor) -> Tensor:
        """A norm of the raw gradients expressed for the gradients after the accumulation scale."""
        return value if self.scale is None else value * self.scale

    def pre_clip_total(self, norm_type: float | None = None) -> Tensor:
        """Total norm of the gradients as the optimizer would see them without clipping."""
        return self.scaled(self.stats[self.primary_norm_type if norm_type is None else norm_type].total)

    def multiply_scale(self, factor: Tensor) -> None:
        """Fold a factor for every gradient (e.g. accumulation normalization) into the single multiply."""
        self.scale = factor if self.scale is None else self.scale * factor

    def add_skip(self, flag: Tensor) -> None:
        """Ask the strategy not to step the optimizer when ``flag`` (a bool device scalar) is true."""
        self.skip = flag if self.skip is None else self.skip | flag

    def skip_on_host(self) -> bool:
        """The skip decision as a Python bool: one host read per step, shared by everyone who asks."""
        if self._skip_host is None:
            self._skip_host = bool(self.skip) if self.skip is not None else False
        return self._skip_host

    def flag_on_host_with_skip(self, flag: Tensor) -> bool:
        """``flag`` (a device bool) as a Python bool, read in the same transfer as the skip decision when that is not
        on the host yet (which :meth:`skip_on_host` then returns without another read)."""
        if self._skip_host is not None or self.skip is None:
            return bool(flag)
        skip, value = torch.stack([self.skip, flag.to(self.skip.device)]).tolist()
        self._skip_host = bool(skip)
        return bool(value)

    def skip_known_on_host(self) -> bool | None:
        """The skip decision if it was already read to the host this step, else ``None`` (never synchronizes)."""
        if self.skip is None:
            return False
        return self._skip_host

    def post_clip_total(self) -> Tensor:
        """Total norm (primary norm type) of the gradients after scaling and clipping.

        Derived without touching the gradients when the clip is a scalar coefficient or the clipping policy supplied
        ``post_clip_total_fn`` (for the primary norm type); measured once (on logging steps only, by the callers)
        after a value clamp or per-parameter coefficients otherwise.
        """
        if self._post_clip_total is not None:
            return self._post_clip_total
        p = self.primary_norm_type
        if self.post_clip_total_fn is not None:
            result = self.post_clip_total_fn()
        elif self.clamp_value is not None or self.param_coefs:
            result = total_norm(self.measure_grads(p), p)
        else:
            result = self.pre_clip_total()
            if self.clip_coef is not None:
                result = result * self.clip_coef
        self._post_clip_total = result
        return result

    def measure_grads(self, norm_type: float) -> Tensor:
        """Read the gradients as they are now: global per-parameter norms, without the loss scale.

        A second read of the gradients: only for post-clip values that cannot be derived (callers use it on logging
        steps only). Under sharding this performs a collective, so every rank must call it.
        """
        grads, present = self.grads, self.present
        if self._released:
            grads, present = _current_grads(self)
        local = per_tensor_norms(grads, norm_type).to(self.index.shard_weight.device)
        local = fill_present(local, present, self.index.num_params)
        if self.loss_scale is not None:
            local = local / self.loss_scale
        return reduce_sharded(self.index, {norm_type: local})[0][norm_type]

    def release_gradients(self) -> None:
        """Drop the references to the step's gradient tensors (the engine calls it once the plan is applied).

        Everything decided stays; a later :meth:`measure_grads` reads the parameters' gradients as they are then.
        Without this, a plan kept after its step (the engine's last plan, a clipper's last decision) would hold the
        gradients through the next backward after ``zero_grad(set_to_none=True)`` dropped them: one more set of
        gradients at the memory peak.
        """
        self.grads = []
        self._released = True

    @property
    def clipped(self) -> bool:
        return self.clip_coef is not None or bool(self.param_coefs) or self.clamp_value is not None

    def apply(self, fold: bool = False) -> None:
        """Write the gradients once: multiply by the product of all factors, then clamp for value clipping.

        With ``fold`` (the door steps a fused optimizer through :func:`~gradkit.gate.step_as_decided`)
        a plan whose only write is one common factor makes no pass over the gradients: the factor is kept in
        :attr:`folded` and the fused kernel, which reads every gradient anyway, divides it by ``1 / factor`` (its
        ``grad_scale``) and stores the result back, as it does for a ``GradScaler``'s unscale. The step then reads the
        gradients twice (the norm, the optimizer) instead of three times, in one launch fewer per group. What the
        kernel reads, and leaves in ``p.grad``, is within 1 ulp (fp32) of the written gradient (``g / fl(1/c)``
        against ``fl(g * c)``).

        The common factor (accumulation scale times clip coefficient) stays fp32 and multiplies each (device, dtype)
        run of gradients as it is, as ``torch.nn.utils.clip_grad_norm_`` does: rounding it to a low-precision dtype
        would move the clip by up to 0.4% (bf16). Per-parameter factors (AGC) are multiplied by it in fp32, then
        cast to their own gradient's dtype. Sparse gradients are written through their values. A plan that asks for
        no write (the monitor alone) touches nothing.
        """
        if self.scale is None and not self.clipped:
            return
        common = self.scale
        if self.clip_coef is not None:
            common = self.clip_coef if common is None else common * self.clip_coef
        if fold and common is not None and self.clamp_value is None and not self.param_coefs:
            self.folded = common
            return
        if self.param_coefs:
            uniform: list[Tensor] = []
            uniform_ids: list[int] = []
            own: list[Tensor] = []
            own_sparse: list[bool] = []
            coefs: list[Tensor] = []
            for i, g, run in zip(self.present, self.grads, self.run_ids, strict=True):
                coef = self.param_coefs.get(i)
                if coef is None:
                    uniform.append(g)
                    uniform_ids.append(run)
                else:
                    own.append(g)
                    own_sparse.append(run < 0)
                    coefs.append(coef)
            if common is not None:
                coefs = torch._foreach_mul(coefs, common)
            coefs = [c if c.dtype == g.dtype else c.to(g.dtype) for c, g in zip(coefs, own, strict=True)]
            dense = [(g, c) for g, c, sparse in zip(own, coefs, own_sparse, strict=True) if not sparse]
            if dense:
                # Broadcasts unit-wise coefficients over each gradient.
                torch._foreach_mul_([g for g, _ in dense], [c for _, c in dense])
            for g, c, sparse in zip(own, coefs, own_sparse, strict=True):
                if sparse:
                    _scale_sparse_(g, c)
            runs, sparse = _split_runs(uniform, uniform_ids)
        else:
            runs, sparse = self._dense_runs()
        if common is not None:
            for run in runs:
                torch._foreach_mul_(run, common.to(run[0].device))
            for g in sparse:
                _scale_sparse_(g, common)
        if self.clamp_value is not None and self.grads:
            self._clamp(self.clamp_value)

    def _dense_runs(self) -> tuple[list[list[Tensor]], list[Tensor]]:
        """All gradients as runs sharing device and dtype, and the sparse ones."""
        if self.run_bounds is not None:
            return [self.grads[start:stop] for start, stop in self.run_bounds], []
        return _split_runs(self.grads, self.run_ids)

    def _clamp(self, clamp_value: float) -> None:
        """Value clipping: clamp every gradient element (the values of a sparse gradient) to the bound."""
        runs, sparse = self._dense_runs()
        runs += [[sparse_values(g)] for g in sparse]
        if self.loss_scale is None:
            for run in runs:
                _clamp_(run, clamp_value)
            return
        # The gradients still carry the loss scale: so does the bound (a device scalar, no host sync). The scaler
        # looks for overflows only inside `step`, after this: a clamp must not turn an Inf into a finite value, so a
        # step with a non-finite gradient gets NaN bounds (all NaN, which it skips).
        finite = next(iter(self.stats.values())).finite
        bound = torch.where(finite, self.loss_scale * clamp_value, math.nan)
        for run in runs:
            # One cast of the bound per (device, dtype) run.
            high = bound.to(run[0].device, run[0].dtype)
            low = -high
            for g in run:
                g.clamp_(min=low, max=high)


def _split_runs(grads: list[Tensor], run_ids: list[int]) -> tuple[list[list[Tensor]], list[Tensor]]:
    """Dense gradients in runs that share device and dtype (one ``_foreach`` call each), and the sparse ones."""
    runs: list[list[Tensor]] = []
    sparse: list[Tensor] = []
    last = -1
    for g, run in zip(grads, run_ids, strict=True):
        if run < 0:
            sparse.append(g)
        elif run == last:
            runs[-1].append(g)
        else:
            runs.append([g])
            last = run
    return runs, sparse


def _scale_sparse_(grad: Tensor, factor: Tensor) -> None:
    """Multiply a coalesced sparse COO gradient in place by a scalar or by one factor per row (dim 0)."""
    values = grad._values()
    if factor.numel() == 1:
        values.mul_(factor.reshape(()).to(values.device))
    else:
        rows = factor.reshape(-1)[grad._indices()[0]]
        values.mul_(rows.view(-1, *([1] * (values.ndim - 1))))


def _clamp_(tensors: list[Tensor], bound: float) -> None:
    """Clamp every tensor to ``[-bound, bound]`` in place: one ``_foreach`` call per bound where the fused
    multi-tensor kernel exists (CUDA), one ``clamp_`` pass per tensor on CPU, where ``_foreach`` would read each
    tensor twice."""
    if tensors[0].device.type == "cpu":
        for t in tensors:
            t.clamp_(-bound, bound)
    else:
        torch._foreach_clamp_min_(tensors, -bound)
        torch._foreach_clamp_max_(tensors, bound)


@dataclass
class StatsRequest:
    """What the measure phase reads this step: the union of the policies' ``request_stats``.

    Attributes:
        norm_types: the norm types of the per-parameter norms (2.0 when no policy asks for one).
        depth: module depth of the per-module norms (``ParamIndex`` groups).
        unit_norm_names: parameters whose unit-wise 2-norms are measured (AGC), see :class:`UnitNorms`.
        rank_flags: make the finite flag global: every rank's local flag travels in the step's collective.
    """

    norm_types: set[float] = field(default_factory=set)
    depth: int = 0
    unit_norm_names: set[str] = field(default_factory=set)
    rank_flags: bool = False


# Key in `StepPlan.reduced` of the per-rank flags: `[world_size]`, 1.0 where a rank's own gradients were non-finite.
_NONFINITE_GRAD_RANKS = "gradkit/nonfinite_grad_ranks"


def values_to_host(metrics: dict[str, Tensor]) -> dict[str, float]:
    """Step values (device scalars) as Python floats, in one device-to-host transfer (logging steps only). Values
    already on the host (a policy's host statistics) are read where they are."""
    on_device = {k: v for k, v in metrics.items() if v.device.type != "cpu"} or metrics
    first = next(iter(on_device.values()))
    stacked = torch.stack([v.detach().reshape(()).to(first.device, torch.float32) for v in on_device.values()])
    values = dict(zip(on_device, stacked.tolist(), strict=True))
    return {k: values[k] if k in values else float(v) for k, v in metrics.items()}


# -- what the pipeline reads of the loop and of the policies --------------------------------------------------------
class StepContext:
    """The loop a step runs in, as the pipeline and the policies read it: one subclass per front door.

    The Lightning ``Trainer`` door answers from the Trainer (:class:`~lightning_gradkit.engine.TrainerContext`), the
    Fabric and plain-PyTorch door from its own step counter (:class:`~gradkit.loop.LoopContext`). A
    feature that only exists under a Trainer (the culprit replay of ``training_step``, the gradient report, the LR
    gate) reads ``trainer``, which is ``None`` behind the other doors.

    Attributes:
        trainer: the Lightning ``Trainer`` when the loop is one, else ``None``.
        pl_module: its ``LightningModule``, else ``None``.
        log_dir: the directory of the guards' event file (``None``: none is written).
        micro_batch: the micro-batch whose loss the door hands to ``note_loss``, kept for the culprit replay
            (``None`` where the door keeps none): the loop door's ``note_loss(loss, replay=...)``, the Trainer's
            batch of ``training_step``.
    """

    trainer = None
    pl_module = None
    log_dir: Path | None = None
    micro_batch: MicroBatch | None = None

    @property
    def optimizers(self) -> Sequence[Optimizer]:
        """Every optimizer of the loop, in a fixed order (the index of one names its logged metrics)."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        """The device of the model's parameters on this rank."""
        raise NotImplementedError

    @property
    def global_step(self) -> int:
        """Optimizer steps attempted before the current one (skipped ones included)."""
        raise NotImplementedError

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if world_size() > 1 else 0

    @property
    def batch_idx(self) -> int:
        """The current batch of the epoch, as the loop counts it (the step, where the loop has no epochs)."""
        return self.global_step

    @property
    def accumulate_grad_batches(self) -> int:
        """The micro-batches per optimizer step whose losses the loop divides before ``backward`` (1 if none)."""
        return 1

    @property
    def log_every_n_steps(self) -> int:
        raise NotImplementedError

    def step_key(self) -> tuple[int, ...]:
        """What identifies the current optimizer step: equal for all calls within it, different for the next."""
        return (self.global_step,)

    def param_names(self) -> dict[int, str]:
        """``id(parameter) -> name`` for every parameter of the model."""
        raise NotImplementedError

    def flat_sharded(self) -> bool:
        """Whether every gradient is a flat local shard (FSDP1 over several ranks)."""
        return False

    def loss_scale(self, optimizer: Optimizer) -> Tensor | None:
        """The AMP loss scale ``optimizer``'s gradients still carry (a device tensor), or ``None``."""
        return None

    def loss_scale_source(self) -> object | None:
        """The loop's fp16 ``GradScaler``, or ``None``."""
        return None

    def steps_through_gate(self) -> bool:
        """Whether every optimizer step of the loop goes through :func:`~gradkit.gate.step_as_decided`
        (the door gates ``optimizer.step``)."""
        return False

    def folds_into(self, optimizer: Optimizer) -> bool:
        """Whether a plan's common factor can go to ``optimizer``'s fused kernel (its ``grad_scale``) instead of a
        write pass: the door gates the step and the optimizer is fused."""
        return self.steps_through_gate() and handles_found_inf(optimizer)

    def is_logging_step(self, every_n_steps: int | None = None) -> bool:
        """Whether the current step logs: ``every_n_steps`` or the loop's own period."""
        n = self.log_every_n_steps if every_n_steps is None else every_n_steps
        return n != 0 and (self.global_step + 1) % n == 0

    def is_last_step(self) -> bool:
        """Whether the current step is known to be the loop's last one."""
        return False

    def checkpoint_note(self) -> str:
        """Where to resume from, for an error that stops training (the Trainer names its last checkpoints)."""
        return "keep checkpoints of the loop to resume from"

    def log(self, metrics: dict[str, Tensor], every_n_steps: int | None = None) -> None:
        """Send step values (device tensors) to the loop's loggers; called on logging steps only."""
        raise NotImplementedError

    def log_values(self, values: dict[str, float]) -> None:
        """Send values already on the host to the loop's loggers at the current step (a step off the period)."""
        raise NotImplementedError

    def warn(self, message: str) -> None:
        """A warning, from rank 0 only."""
        if self.global_rank == 0:
            warnings.warn(message, UserWarning, stacklevel=3)

    @property
    def model(self) -> torch.nn.Module:
        """The module being trained (its buffers are part of a step's state)."""
        raise NotImplementedError

    @property
    def pipeline(self) -> Pipeline:
        """The loop's pipeline (its count of skipped steps is part of a step's state)."""
        raise NotImplementedError

    def policies(self) -> list[Policy]:
        """Every policy of the loop."""
        raise NotImplementedError

    def schedulers(self) -> list[object]:
        """The LR schedulers of the loop (``state_dict``/``load_state_dict``), in a fixed order."""
        return []

    def step_state(self) -> dict[str, object]:
        """What the door itself changes per step besides the above (the Trainer's LR-schedule counts)."""
        return {}

    def load_step_state(self, state: dict[str, object]) -> None:
        """Rewind :meth:`step_state` at the current batch."""

    def optimizer_index(self, optimizer: Optimizer) -> int:
        """The position of ``optimizer`` (or of the optimizer a wrapper holds) in :attr:`optimizers`, 0 if absent."""
        for i, opt in enumerate(self.optimizers):
            if opt is optimizer or unwrapped(opt) is optimizer:
                return i
        return 0


def unwrapped(optimizer: Optimizer) -> Optimizer:
    """The optimizer a wrapper holds (Lightning's ``LightningOptimizer._optimizer``, Fabric's
    ``_FabricOptimizer.optimizer``), or the optimizer itself."""
    inner = getattr(optimizer, "_optimizer", None) or getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, Optimizer) else optimizer


class Policy(Protocol):
    """What a policy is to the pipeline: a plain object with a ``stage`` and any of the hooks below.

    A policy does not derive from this class (gradkit's own do not: one class per algorithm, no base); it is a
    :class:`typing.Protocol`, and :func:`is_policy` tells whether an object is one (it has a ``stage``). The pipeline
    calls only the hooks a policy defines (:class:`Roster`); each reads the loop through the :class:`StepContext`, so
    a policy decides the same way behind every door. A class that subclasses ``Policy`` explicitly inherits the no-op
    hooks below.

    The protocol, in the order of a step:

    - ``attach(ctx, model)``: the door is set up (the Trainer's ``setup``, ``GradKit(...)``, ``load_state_dict``);
      raise ``ValueError`` if the policy, as configured, cannot work behind this door.
    - ``before_first_forward(ctx)``: the first forward after the door was built or loaded is about to run.
    - ``note_loss(loss, ctx)``: a micro-batch loss (before any division, without the AMP scale).
    - ``request_stats(request)``, ``primary_norm_type()``, ``reduce_request(ctx)``: what the measure and reduce
      phases read for it.
    - ``decide(plan, ctx)`` / ``decide_again(plan, first, ctx)``: its decision, written into the plan; no gradient
      is read, nothing syncs.
    - ``observe(plan, ctx)``: after the write; logs on logging steps.
    - ``after_step(ctx)``: after the optimizer step (applied or skipped) and the LR schedulers of the batch.
    - ``finish(ctx)``: the loop ended.
    - ``may_skip()``: whether it may ask for a step to be skipped (the door must be able to skip).
    - ``state_dict()`` / ``load_state_dict(state)`` and ``state_key``: its state, one format behind every door.
    """

    stage: Stage

    def may_skip(self) -> bool:
        """Whether this policy may ask for an optimizer step to be skipped (the door must be able to skip)."""
        return False

    def request_stats(self, request: StatsRequest) -> None:
        """Measure: add the norm types and module depth this policy reads."""

    def primary_norm_type(self) -> float | None:
        """The norm type whose statistics are logged as the step's gradient norm (the monitor's)."""
        return None

    def reduce_request(self, ctx: StepContext) -> dict[str, Tensor]:
        """Reduce: per-rank scalars to be summed across ranks in the step's single collective (keys must be unique)."""
        return {}

    def decide(self, plan: StepPlan, ctx: StepContext) -> None:
        """Decide: read the plan's statistics and write a decision into it. Must not read gradients or sync."""

    def decide_again(self, plan: StepPlan, first: StepPlan, ctx: StepContext) -> None:
        """Decide, for a later evaluation of the closure within the same optimizer step (``LBFGS``, SAM; see
        :mod:`gradkit._closure`): ``plan`` holds the fresh gradients' statistics and the step's accumulation
        scale, ``first`` the step's decision. Write what applies to every evaluation's gradients (clipping); forget
        what this evaluation's micro-batch hooks collected for a decision (the step was decided on the first
        evaluation). Must not read gradients or sync."""

    def observe(self, plan: StepPlan, ctx: StepContext) -> None:
        """Observe, after the gradients are written: log on logging steps."""

    def note_loss(self, loss: Tensor, ctx: StepContext) -> None:
        """A micro-batch loss as the loop computed it (before any division, without the AMP scale)."""

    def finish(self, ctx: StepContext) -> None:
        """The loop ended: report what is still pending."""

    def after_step(self, ctx: StepContext) -> None:
        """After the optimizer step (applied or skipped) and the LR schedulers of the batch."""

    def before_first_forward(self, ctx: StepContext) -> None:
        """The first forward after the door was built or loaded is about to run (the model's weights and buffers are
        loaded by then, in whatever order the loop loaded them)."""

    def attach(self, ctx: StepContext, model: torch.nn.Module) -> None:
        """The door is set up: prepare what needs the model.

        Raises:
            ValueError: if the policy, as configured, cannot work behind this door.
        """


def state_key(policy: object, **identity: object) -> str:
    """The key of ``policy``'s state in a checkpoint, the same behind every door: Lightning's
    ``Callback._generate_state_key`` format (class name, then the arguments that tell two instances apart), so that a
    Trainer checkpoint's ``"callbacks"`` entry and :meth:`~gradkit.loop.GradKit.state_dict` use one key."""
    return f"{type(policy).__qualname__}{identity!r}" if identity else type(policy).__qualname__


def is_policy(obj: object) -> bool:
    """Whether ``obj`` is a policy instance: it has a :class:`Stage` as ``stage`` (a class is not an instance)."""
    return not isinstance(obj, type) and isinstance(getattr(obj, "stage", None), Stage)


def hook(policy: object, name: str) -> Callable[..., Any] | None:
    """``policy``'s protocol hook ``name`` (bound), or ``None`` when it does not define it."""
    return getattr(policy, name, None)


class Roster:
    """A step's policies in stage order, and each phase's hooks (bound methods of the policies that define them).

    Built once per set of policies (:meth:`Pipeline._roster`): a phase calls only the policies that take part in it.
    """

    __slots__ = ("decide", "decide_again", "observe", "policies", "primary", "reduce_request", "request")

    def __init__(self, policies: Sequence[object]) -> None:
        self.policies = sorted(policies, key=lambda policy: policy.stage)  # type: ignore[attr-defined]
        found = {
            name: [m for p in self.policies if (m := hook(p, name)) is not None]
            for name in ("decide", "decide_again", "observe", "reduce_request")
        }
        self.decide = found["decide"]
        self.decide_again = found["decide_again"]
        self.observe = found["observe"]
        self.reduce_request = found["reduce_request"]
        request = StatsRequest()
        for p in self.policies:
            add = hook(p, "request_stats")
            if add is not None:
                add(request)
        if not request.norm_types:
            request.norm_types.add(2.0)
        self.request = request
        primaries = (hook(p, "primary_norm_type") for p in self.policies)
        self.primary = next((v for f in primaries if f is not None and (v := f()) is not None), None)


# -- the pipeline ----------------------------------------------------------------------------------------------------
class Pipeline:
    """The engine's state across steps, and the run of one step's phases: one per loop (Trainer, Fabric, plain)."""

    def __init__(self) -> None:
        self._indexes: dict[tuple[int, int], _CachedIndex] = {}
        self._evaluations = Evaluations()
        self.last_plans: dict[int, StepPlan] = {}
        self.skipped_steps: Tensor | None = None
        self.generation = 0
        self._pending_scales: list[tuple[Policy, Optimizer | None]] = []
        self._warned_frozen: set[str] = set()
        self._cached_roster: tuple[list[Policy], Roster] | None = None

    def reset(self) -> None:
        """Forget the parameter indexes (parameters may be replaced between fits, e.g. by sharding)."""
        self._indexes.clear()
        self._evaluations.clear()
        self.last_plans.clear()
        self.skipped_steps = None
        self._pending_scales.clear()
        self._warned_frozen.clear()

    def add_pending_scale(self, policy: Policy, optimizer: Optimizer | None) -> None:
        """Fold ``policy`` (a ``Stage.SCALE`` policy outside the loop's policies) into the next run for ``optimizer``
        (any optimizer when ``None``), whoever starts that run. Used once, then forgotten."""
        self._pending_scales.append((policy, optimizer))

    def discard_pending_scale(self, policy: Policy) -> None:
        """Forget ``policy`` if no run has used it."""
        self._pending_scales = [(p, o) for p, o in self._pending_scales if p is not policy]

    def step_plan(self, ctx: StepContext, optimizer: Optimizer) -> StepPlan | None:
        """The plan decided for ``optimizer``'s current step (its first evaluation), ``None`` if none ran yet."""
        if not self._evaluations.ran(optimizer, ctx.step_key()):
            return None
        return self.last_plans.get(id(optimizer))

    def run(self, ctx: StepContext, optimizer: Optimizer, policies: Sequence[Policy]) -> StepPlan | None:
        """Run the step's pipeline once per set of gradients of an optimizer step; ``None`` when it already ran.

        A closure evaluated again within the step (new gradients) gets a plan that only scales and clips them (see
        :mod:`gradkit._closure`); the step's decision stays in ``last_plans``.

        Args:
            ctx: the loop the step runs in.
            optimizer: the optimizer about to step.
            policies: the loop's policies (any order: they run in stage order).
        """
        step = ctx.step_key()
        evaluation = self._evaluations.classify(optimizer, step, self.generation)
        if evaluation is Evaluation.SAME:
            return None
        first = self.last_plans[id(optimizer)] if evaluation is Evaluation.LATER else None
        with torch.no_grad():
            return self._run(ctx, optimizer, policies, step, first)

    def _run(
        self,
        ctx: StepContext,
        optimizer: Optimizer,
        policies: Sequence[Policy],
        step: tuple[int, ...],
        first: StepPlan | None,
    ) -> StepPlan:
        """The phases of one set of gradients: measure -> reduce -> decide -> apply -> observe.

        ``first`` is the step's plan when these gradients come from a later evaluation of its closure: they are
        decided again (scaled and clipped) and not observed.
        """
        roster = self._roster(optimizer, policies)
        measured = self._measure(ctx, optimizer, roster.request)
        plan = self._reduce(ctx, optimizer, roster, measured)
        if first is not None:
            decide_again(plan, first, roster.decide_again, ctx)
        else:
            for decide in roster.decide:
                decide(plan, ctx)
        # Only a first evaluation's dense, plain-tensor gradients are left to a fused kernel (one `grad_scale`).
        fold = first is None and measured.bounds is not None and not measured.index.any_dtensor
        plan.apply(fold=fold and ctx.folds_into(optimizer))
        # After the write, which bumps the gradients' versions: a later call must find these written ones the same.
        self._evaluations.record(optimizer, step, self.generation, shared=len(ctx.optimizers) > 1)
        if first is None:
            self.observe(plan, roster, ctx)
        plan.release_gradients()  # a plan kept after its step must not keep its gradients alive
        return plan

    # -- the phases ------------------------------------------------------------------------------------------------
    def _roster(self, optimizer: Optimizer, policies: Sequence[Policy]) -> Roster:
        """The step's :class:`Roster`: ``policies`` and the pending scales for ``optimizer`` (taken: each is used by
        one run), built again only when that set changes."""
        if self._pending_scales:
            taken = [p for p, o in self._pending_scales if o is None or o is optimizer]
            self._pending_scales = [(p, o) for p, o in self._pending_scales if not (o is None or o is optimizer)]
            policies = [*policies, *taken]
        cached = self._cached_roster
        if cached is None or len(cached[0]) != len(policies) or any(map(operator.is_not, cached[0], policies)):
            cached = self._cached_roster = (list(policies), Roster(policies))
        return cached[1]

    def _index(self, ctx: StepContext, optimizer: Optimizer, depth: int) -> ParamIndex:
        """The index of the parameters ``optimizer`` steps now, rebuilt only when that set changed.

        A parameter of the param groups belongs to it when it has a gradient (the optimizer applies it, whatever its
        ``requires_grad``) or asks for one (``requires_grad=True``): see
        :func:`~gradkit.norms.steps_in_optimizer`. Parameters can join after the first step (a
        backbone unfrozen with ``requires_grad_(True)``, a param group added with ``add_param_group``, as Lightning's
        ``BackboneFinetuning`` does) or leave it (frozen again). The check every step looks at the param groups
        (identity and length of each list) and, for each parameter left out of the index, at its gradient and its
        ``requires_grad``: nothing per indexed tensor. An indexed parameter that left shows as a missing gradient, and
        :meth:`_measure` then calls :meth:`_forget_index`.

        Under FSDP2 an unfrozen module's sharded parameters can keep ``requires_grad=False`` and still get a
        gradient, on one step (see :class:`~lightning_gradkit.GradKitModelParallelStrategy`): the index takes them in
        for that step, with a warning naming them, and drops them when their gradients stop.
        """
        key = (id(optimizer), depth)
        groups = tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)
        cached = self._indexes.get(key)
        if cached is not None and cached.groups == groups and not any(map(steps_in_optimizer, cached.outside)):
            return cached.index
        first = next((p for g in optimizer.param_groups for p in g["params"]), None)
        device = first.device if first is not None else ctx.device
        index = build_param_index(optimizer.param_groups, ctx.param_names(), depth, device, ctx.flat_sharded())
        outside = [p for g in optimizer.param_groups for p in g["params"] if not steps_in_optimizer(p)]
        self._indexes[key] = _CachedIndex(groups, outside, index)
        self._warn_gradients_of_frozen(ctx, index)
        return index

    def _warn_gradients_of_frozen(self, ctx: StepContext, index: ParamIndex) -> None:
        """Warn once per parameter about gradients on parameters with ``requires_grad=False`` (see :meth:`_index`)."""
        names = [n for n, p in zip(index.names, index.params, strict=True) if not p.requires_grad]
        names = [n for n in names if n not in self._warned_frozen]
        if not names:
            return
        self._warned_frozen.update(names)
        ctx.warn(
            f"gradkit: {len(names)} parameter(s) the optimizer steps have a gradient but `requires_grad=False`: "
            f"{name_list(names)}. The optimizer applies these gradients, so gradkit measures, clips and guards them "
            "too. Under FSDP2 this happens when `requires_grad_(True)` reached a module's unsharded parameters (a "
            "module that is its own FSDP root or has `reshard_after_forward=False`, frozen or just validated): FSDP2 "
            "resets the flag from the sharded parameters at its next all-gather, so these parameters train for this "
            "one step only. Call `module.reshard()` before `requires_grad_(True)` (see "
            "`GradKitModelParallelStrategy`). Otherwise, if they are meant to be frozen, clear their gradients "
            "(`zero_grad(set_to_none=True)`)."
        )

    def _forget_index(self, optimizer: Optimizer, depth: int) -> None:
        self._indexes.pop((id(optimizer), depth), None)

    def _measure(self, ctx: StepContext, optimizer: Optimizer, request: StatsRequest) -> _Measured:
        """Measure: read every gradient once into this rank's per-parameter norms (and unit norms, if asked).

        Norms are divided by the AMP loss scale while the gradients still carry it (see the module docstring), so
        every later phase works in unscaled units.
        """
        index = self._index(ctx, optimizer, request.depth)
        grads, present, run_ids, bounds, absent = _read_step(index)
        if any(not steps_in_optimizer(index.params[i]) for i in absent):  # frozen since the index was built
            self._forget_index(optimizer, request.depth)
            index = self._index(ctx, optimizer, request.depth)
            grads, present, run_ids, bounds, absent = _read_step(index)
        scale = ctx.loss_scale(optimizer)
        units = _measure_units(index, grads, present, request.unit_norm_names)
        local: dict[float, Tensor] = {}
        for p in sorted(request.norm_types):
            # The unit norms already read the gradients AGC names: their 2-norms derive from them.
            norms = _param_norms(grads, p, units if p == 2.0 else None, bounds).to(index.shard_weight.device)
            if scale is not None:
                norms = norms / scale
            local[p] = fill_present(norms, present, index.num_params)
        if units is not None:
            units = UnitNorms(
                [present[j] for j in units.positions], units.sizes, units.flat if scale is None else units.flat / scale
            )
        return _Measured(index, grads, present, run_ids, bounds, [index.names[i] for i in absent], local, units, scale)

    def _reduce(
        self,
        ctx: StepContext,
        optimizer: Optimizer,
        roster: Roster,
        measured: _Measured,
    ) -> StepPlan:
        """Reduce: one collective for the sharded norms and the policies' per-rank scalars; the plan's statistics.

        Nothing is reduced in a single process, nor without sharded gradients and per-rank scalars
        (:func:`~gradkit.norms.reduce_sharded`).
        """
        index = measured.index
        extras: dict[str, Tensor] = {}
        for reduce_request in roster.reduce_request:
            extras.update(reduce_request(ctx))
        if roster.request.rank_flags and world_size() > 1:
            # A rank's gradients can turn non-finite after the DDP all-reduce (a hook, `on_after_backward`, a faulty
            # kernel): its flags then differ from the others'. Summed in the one collective, every rank sees them all.
            extras[_NONFINITE_GRAD_RANKS] = _local_nonfinite_flags(measured.local, index.shard_weight.device)
        norms_by_p, reduced = reduce_sharded(index, measured.local, extras)
        stats = {p: derive_stats(index, norms_by_p[p], p, measured.missing) for p in measured.local}
        if _NONFINITE_GRAD_RANKS in reduced:
            anywhere = reduced[_NONFINITE_GRAD_RANKS].sum() > 0
            for grad_stats in stats.values():
                grad_stats.finite = grad_stats.finite & ~anywhere
        primary = roster.primary
        return StepPlan(
            optimizer=optimizer,
            optimizer_idx=ctx.optimizer_index(optimizer),
            index=index,
            grads=measured.grads,
            present=measured.present,
            stats=stats,
            reduced=reduced,
            primary_norm_type=primary if primary is not None else min(stats),
            logging_step=ctx.is_logging_step(None),
            loss_scale=measured.loss_scale,
            unit_norms=measured.unit_norms,
            run_ids=measured.run_ids,
            run_bounds=measured.bounds,
        )

    def observe(self, plan: StepPlan, roster: Roster, ctx: StepContext) -> None:
        """Observe (a step's first evaluation only): keep the decision for the gate, count a skip, let the policies
        log. Off logging steps nothing here reads a value to the host."""
        if plan.skip is not None:
            count = plan.skip.to(torch.float32)
            self.skipped_steps = count if self.skipped_steps is None else self.skipped_steps + count
        self.last_plans[id(plan.optimizer)] = plan
        for observe in roster.observe:
            observe(plan, ctx)
        if self.skipped_steps is not None and plan.logging_step:
            ctx.log({"gradkit/skipped_steps": self.skipped_steps})


@dataclass(frozen=True)
class _Measured:
    """What the measure phase read: the gradients (see :func:`_read_grads`) and this rank's norms of them.

    Attributes:
        missing: names of the indexed parameters without a gradient at this step.
        local: per norm type, ``[P]`` per-parameter norms of this rank's gradients (local shards), unscaled.
        unit_norms: AGC's unit norms, at index positions, unscaled.
        loss_scale: the AMP loss scale the gradients still carry, or ``None``.
    """

    index: ParamIndex
    grads: list[Tensor]
    present: list[int]
    run_ids: list[int]
    bounds: list[tuple[int, int]] | None
    missing: list[str]
    local: dict[float, Tensor]
    unit_norms: UnitNorms | None
    loss_scale: Tensor | None


@dataclass(frozen=True)
class _CachedIndex:
    """A parameter index with what tells when it is stale: the param groups it was built from (identity and
    length of each ``params`` list) and the parameters of those groups it left out (no gradient, frozen)."""

    groups: tuple[tuple[int, int], ...]
    outside: list[Tensor]
    index: ParamIndex


# -- the gradient read and the measure phase's helpers -------------------------------------------------------------
def _local_nonfinite_flags(local: dict[float, Tensor], device: torch.device) -> Tensor:
    """``[world_size]`` zeros, with this rank's entry 1.0 when any of its local per-parameter norms is NaN or Inf."""
    bad = torch.stack([nonfinite_mask(norms).any() for norms in local.values()]).any()
    flags = torch.zeros(world_size(), dtype=torch.float32, device=device)
    flags[dist.get_rank()] = bad.to(torch.float32)
    return flags


def _measure_units(index: ParamIndex, grads: list[Tensor], present: list[int], names: set[str]) -> UnitNorms | None:
    """Unit-wise 2-norms (over all dims but the first) of the named gradients with more than one dimension.

    ``flat`` is left in the gradients' own units here (the caller removes the loss scale); ``positions`` hold the
    positions in ``grads`` until the caller maps them (see :func:`_param_norms`).
    """
    if not names:
        return None
    slots = [j for j, i in enumerate(present) if grads[j].ndim > 1 and index.names[i] in names]
    if not slots:
        return None
    units = [row_norms(grads[j]) for j in slots]
    return UnitNorms(positions=slots, sizes=[u.numel() for u in units], flat=torch.cat(units))


def _current_grads(plan: StepPlan) -> tuple[list[Tensor], list[int]]:
    """The gradients of a released plan's parameters as they are now, at the positions the plan measured.

    Raises:
        RuntimeError: if one of them is gone (the optimizer's ``zero_grad`` ran since the step).
    """
    grads, present, _, _ = _read_grads(plan.index)
    if present != plan.present:
        raise RuntimeError(
            "The gradients of this optimizer step are no longer there (`zero_grad` ran since the step): post-clip "
            "norms can only be measured until the next `zero_grad`. Read them on the step itself, as the gradkit "
            "callbacks log them."
        )
    return grads, present


def _read_step(index: ParamIndex) -> tuple[list[Tensor], list[int], list[int], list[tuple[int, int]] | None, list[int]]:
    """:func:`_read_grads` after summing ``Partial`` gradients (:func:`resolve_partial_grads`), plus the positions
    without a gradient (:func:`_absent`)."""
    resolve_partial_grads([index.params[i] for i in index.replicated_dtensors])
    grads, present, run_ids, bounds = _read_grads(index)
    return grads, present, run_ids, bounds, _absent(index, present)


def _read_grads(index: ParamIndex) -> tuple[list[Tensor], list[int], list[int], list[tuple[int, int]] | None]:
    """The step's gradients: ``(grads, present, run_ids, bounds)``.

    ``grads`` are the local tensors of the parameters at positions ``present`` of the index, ``run_ids`` their
    (device, dtype) group (-1 for a sparse gradient) and ``bounds`` the ``(start, stop)`` of the dense runs when
    every parameter has a dense gradient (the common step: then nothing here looks at a gradient twice), else
    ``None``. A sparse gradient may hold one index several times (one entry per embedding lookup); its norms and
    value clamps need the sum, so it is replaced here, in the engine's one read, by the equal coalesced tensor,
    which every later step (and the optimizer) reads and writes in place.
    """
    raw = [p.grad for p in index.params]
    present = index.all_positions
    sparse: list[int] = []
    for g in raw:
        if g is None or g.is_sparse:  # one pass for the common step, where neither occurs
            present = [i for i, g in enumerate(raw) if g is not None]
            raw = [raw[i] for i in present]
            sparse = [j for j, g in enumerate(raw) if g.is_sparse]
            break
    for j in sparse:
        if not raw[j].is_coalesced():
            raw[j] = index.params[present[j]].grad = raw[j].coalesce()
    grads = [local_tensor(g) for g in raw] if index.any_dtensor else raw
    if len(present) == index.num_params and not sparse:
        return grads, present, index.run_of, index.run_bounds
    run_ids = [index.run_of[i] for i in present]
    for j in sparse:
        run_ids[j] = -1
    return grads, present, run_ids, None


def _absent(index: ParamIndex, present: list[int]) -> list[int]:
    """Positions of the index whose parameter has no gradient at this step."""
    if len(present) == index.num_params:
        return []
    have = set(present)
    return [i for i in range(index.num_params) if i not in have]


def _param_norms(
    grads: list[Tensor], norm_type: float, units: UnitNorms | None, bounds: list[tuple[int, int]] | None = None
) -> Tensor:
    """Per-gradient norms; the 2-norms of gradients measured unit-wise are derived from their unit norms.

    ``bounds``: the dense runs of ``grads`` when known (see :func:`_read_grads`)."""
    if units is None:
        return per_tensor_norms(grads, norm_type, bounds)
    slots = set(units.positions)
    rest = [j for j in range(len(grads)) if j not in slots]
    device = units.flat.device
    out = torch.empty(len(grads), dtype=torch.float32, device=device)
    out[positions_tensor(tuple(units.positions), device)] = torch.stack(
        torch._foreach_norm(list(units.flat.split(units.sizes)), 2.0)
    )
    if rest:
        out[positions_tensor(tuple(rest), device)] = per_tensor_norms([grads[j] for j in rest], norm_type).to(device)
    return out
