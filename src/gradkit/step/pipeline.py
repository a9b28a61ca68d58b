"""The step pipeline: measure once, decide once, touch the gradients once. Torch only.

Every front door drives it: the Lightning ``Trainer`` callbacks (:mod:`lightning_gradkit.trainer_door`), Lightning
Fabric and a plain PyTorch loop (:class:`~gradkit.GradKit`); what it reads of the loop and of the policies is the
protocol of :mod:`gradkit.step.protocol`. :meth:`Pipeline.run` is the list of the phases:

1. **measure** (:meth:`Pipeline._measure`): every gradient is read once, into this rank's per-parameter norms (and
   the unit norms AGC asks for), for the norm types the policies request; divided by the AMP loss scale while the
   gradients still carry it (no host sync), so every statistic and threshold means the same as without AMP.
2. **reduce** (same method): at most ONE all-reduce carries the sharded norm contributions, the per-rank scalars the
   policies name (window loss, token counts) and, when a guard asks, each rank's flag of non-finite local gradients,
   so every skip decision is the same on every rank (:func:`~gradkit.step.norms.reduce_sharded`; a sharded inf-norm
   takes a second one). The result is the step's :class:`~gradkit.step.plan.StepStats`, kept in the pipeline's own
   :class:`StepRecord` (the gradients themselves stay in :meth:`Pipeline.run`, which hands them to the write).
3. **decide**: each policy's ``decide(stats, decision, ctx)`` in stage order, ``SCALE`` -> ``GUARD`` -> ``CLIP`` ->
   ``OBSERVE``; each reads the statistics and writes through the step's :class:`~gradkit.step.plan.Decision`; none
   reads the gradients.
4. **apply** (:meth:`StepRecord.apply`): one ``torch._foreach_mul_`` per (device, dtype) group
   with the product of all factors in fp32, or none at all when a fused optimizer takes the factor as its
   ``grad_scale``.
5. **observe** (:meth:`Pipeline.observe`): the skip count (a fused optimizer's skip flag starts its way to the host,
   for the policies that ask at the next step whether the step was skipped, ``StepOutcome.was_skipped``), and each
   policy's ``observe(stats, outcome, ctx)``.

A phase with nothing to do costs nothing: no unit norms unless asked, no collective in a single process (nor without
sharded gradients and per-rank scalars), no write when no policy scales or clips.

Once per set of gradients: the pipeline runs at the first call for an optimizer step, whoever makes it, and later
calls for the same gradients find it done (a backward since, counted in :attr:`Pipeline.generation`, or new
gradient versions with several optimizers, tell them apart). A closure evaluated again inside ``step`` (``LBFGS``,
SAM) gives new gradients within the step: they are scaled and clipped, never decided again (:mod:`gradkit.step.closure`
states the rule).

The gate that steps an optimizer, or does not, as the policies decided is :mod:`gradkit.step.gate`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from gradkit._util.arguments import name_list
from gradkit._util.torch_compat import handles_found_inf
from gradkit.step.accounting import StepAccounting
from gradkit.step.closure import decide_again
from gradkit.step.host_lag import HostLag
from gradkit.step.norms import (
    GradStats,
    ParamIndex,
    checked_norms,
    derive_stats,
    fill_present,
    local_tensor,
    nonfinite_mask,
    per_tensor_norms,
    positions_tensor,
    reduce_sharded,
    row_norms,
    total_norm,
)
from gradkit.step.params import build_param_index, resolve_partial_grads, steps_in_optimizer
from gradkit.step.plan import Decision, StepStats, UnitNorms
from gradkit.step.protocol import Door, Policy, Roster, StatsRequest
from gradkit.step.write import measure_grads, write

__all__ = ["Pipeline", "StepRecord"]

# Key in `StepStats.reduced` of the per-rank flags, `[2, world_size]`: row 0 is 1.0 where a rank's own norms were NaN or
# Inf, row 1 where its gradients held a NaN or an infinity (measured on request: `StatsRequest.finite_check`).
_NONFINITE_GRAD_RANKS = "gradkit/nonfinite_grad_ranks"


# -- the pipeline ------------------------------------------------------------------------------------------------------
class Pipeline:
    """The step pipeline of one loop (Trainer, Fabric, plain): its caches across steps, and the run of one step.

    Attributes:
        last_records: per optimizer (``id``), the record of its last step's first evaluation (what the gate reads).
        steps: the loop's step accounting (:class:`~gradkit.step.accounting.StepAccounting`), the one owner of the count
            of attempted steps the model does not hold; :attr:`skipped_steps` reads it.
        generation: backward passes so far (the doors count them): tells a closure's later evaluation from the first.
    """

    def __init__(self) -> None:
        self._indexes: dict[tuple[int, int], _CachedIndex] = {}
        #: Per optimizer: (step key, generation, gradient versions or None) of its last run.
        self._runs: dict[int, tuple[tuple[int, ...], int, tuple[tuple[int, int], ...] | None]] = {}
        self.last_records: dict[int, StepRecord] = {}
        self.steps = StepAccounting()
        self.generation = 0
        self._pending_scales: list[tuple[Policy, Optimizer | None]] = []
        self._warned_frozen: set[str] = set()
        self._cached_roster: tuple[list[Policy], Roster, StatsRequest, float | None] | None = None
        #: Per optimizer (``id``): the pinned buffer its skip flags travel to the host in (fused optimizers only).
        self._skip_lags: dict[int, HostLag] = {}

    @property
    def skipped_steps(self) -> Tensor | None:
        """The attempted steps the model does not hold (a device scalar; ``None`` before any could be skipped)."""
        return self.steps.skipped

    def reset(self) -> None:
        """Forget the parameter indexes (parameters may be replaced between fits, e.g. by sharding)."""
        self._indexes.clear()
        self._runs.clear()
        self.last_records.clear()
        self.steps.reset()
        self._pending_scales.clear()
        self._warned_frozen.clear()
        self._skip_lags.clear()

    def add_pending_scale(self, policy: Policy, optimizer: Optimizer | None) -> None:
        """Fold ``policy`` (a ``Stage.SCALE`` policy outside the loop's policies) into the next run for ``optimizer``
        (any optimizer when ``None``), whoever starts that run. Used once, then forgotten."""
        self._pending_scales.append((policy, optimizer))

    def discard_pending_scale(self, policy: Policy) -> None:
        """Forget ``policy`` if no run has used it."""
        self._pending_scales = [(p, o) for p, o in self._pending_scales if p is not policy]

    def step_record(self, step: tuple[int, ...], optimizer: Optimizer) -> StepRecord | None:
        """The record of ``optimizer``'s step ``step`` (its first evaluation), ``None`` if none ran yet."""
        run = self._runs.get(id(optimizer))
        return self.last_records.get(id(optimizer)) if run is not None and run[0] == step else None

    def run(self, ctx: Door, optimizer: Optimizer, policies: Sequence[Policy]) -> StepRecord | None:
        """Run the step's phases once per set of gradients of an optimizer step; ``None`` when they already ran.

        A closure evaluated again within the step (new gradients) gets a decision that only scales and clips them;
        the step's record stays in :attr:`last_records`.

        Args:
            ctx: the loop the step runs in.
            optimizer: the optimizer about to step.
            policies: the loop's policies (any order: they run in stage order).
        """
        step = ctx.step_key()
        last = self._runs.get(id(optimizer))
        first = None
        if last is not None and last[0] == step:
            if last[1] == self.generation or (last[2] is not None and last[2] == _grad_versions(optimizer)):
                return None  # the gradients this pipeline already wrote for the step
            first = self.last_records[id(optimizer)]  # a later evaluation of the step's closure
        with torch.no_grad():
            roster, request, primary = self._roster(optimizer, policies)
            record, grads, cached = self._measure(ctx, optimizer, roster, request, primary)
            stats, decision = record.stats, record.decision
            if first is not None:
                decide_again(stats, decision, first.decision, roster.decide_again, ctx)
            else:
                for decide in roster.decide:
                    decide(stats, decision, ctx)
            # Only a first evaluation's factor is left to a fused kernel (its `grad_scale`; dense gradients only).
            record.apply(grads, fold=first is None and cached.folds)
            # After the write, which bumps the gradients' versions: a later call must find these written ones the same.
            self._runs[id(optimizer)] = (step, self.generation, _grad_versions(optimizer) if cached.shared else None)
            if first is None:
                self.observe(record, roster, ctx)
        return record

    def _roster(self, optimizer: Optimizer, policies: Sequence[Policy]) -> tuple[Roster, StatsRequest, float | None]:
        """The step's :class:`~gradkit.step.protocol.Roster` (``policies`` and the pending scales for ``optimizer``,
        taken: each is used by one run) with what they ask of the measure, built again only when that set changes."""
        if self._pending_scales:
            taken = [p for p, o in self._pending_scales if o is None or o is optimizer]
            self._pending_scales = [(p, o) for p, o in self._pending_scales if not (o is None or o is optimizer)]
            policies = [*policies, *taken]
        cached = self._cached_roster
        if cached is None or len(cached[0]) != len(policies) or any(map(operator.is_not, cached[0], policies)):
            roster = Roster(policies)
            # What the policies ask of the measure, read once per set of policies (after their `attach`).
            cached = self._cached_roster = (list(policies), roster, roster.request, roster.primary)
        return cached[1], cached[2], cached[3]

    def _index(self, ctx: Door, optimizer: Optimizer, depth: int) -> _CachedIndex:
        """The index of the parameters ``optimizer`` steps now (with what the loop says of the optimizer), rebuilt
        only when that set changed.

        A parameter of the param groups belongs to it when it has a gradient (the optimizer applies it, whatever its
        ``requires_grad``) or asks for one (:func:`~gradkit.step.norms.steps_in_optimizer`). Parameters can join after
        the first step (a backbone unfrozen, a param group added, as Lightning's ``BackboneFinetuning`` does) or leave
        it. The check every step looks at the param groups (identity and length of each list) and at the gradient and
        ``requires_grad`` of each parameter left out: nothing per indexed tensor. An indexed parameter that left
        shows as a missing gradient, and :meth:`_measure` builds the index again.

        Under FSDP2 an unfrozen module's sharded parameters can keep ``requires_grad=False`` and still get a
        gradient, on one step (see :class:`~lightning_gradkit.GradKitModelParallelStrategy`): the index takes them in
        for that step, with a warning naming them, and drops them when their gradients stop.
        """
        key = (id(optimizer), depth)
        groups = tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)
        cached = self._indexes.get(key)
        if cached is not None and cached.groups == groups and not any(map(steps_in_optimizer, cached.outside)):
            return cached
        first = next((p for g in optimizer.param_groups for p in g["params"]), None)
        device = first.device if first is not None else ctx.device
        index = build_param_index(
            optimizer.param_groups, ctx.param_names(), depth, device, ctx.flat_sharded(), ctx.model
        )
        outside = [p for g in optimizer.param_groups for p in g["params"] if not steps_in_optimizer(p)]
        cached = self._indexes[key] = _CachedIndex(
            groups, outside, index, ctx.optimizer_index(optimizer), len(ctx.optimizers) > 1, ctx.folds_into(optimizer)
        )
        names = [n for n, p in zip(index.names, index.params, strict=True) if not p.requires_grad]
        names = [n for n in names if n not in self._warned_frozen]
        if names:
            self._warned_frozen.update(names)
            ctx.warn(
                f"gradkit: {len(names)} parameter(s) the optimizer steps have a gradient but `requires_grad=False`: "
                f"{name_list(names)}. The optimizer applies these gradients, so gradkit measures, clips and guards "
                "them too. Under FSDP2 this happens when `requires_grad_(True)` reached a module's unsharded "
                "parameters (a module that is its own FSDP root or has `reshard_after_forward=False`, frozen or just "
                "validated): FSDP2 resets the flag from the sharded parameters at its next all-gather, so these "
                "parameters train for this one step only. Call `module.reshard()` before `requires_grad_(True)` (see "
                "`GradKitModelParallelStrategy`). Otherwise, if they are meant to be frozen, clear their gradients "
                "(`zero_grad(set_to_none=True)`)."
            )
        return cached

    def _measure(
        self, ctx: Door, optimizer: Optimizer, roster: Roster, request: StatsRequest, primary: float | None
    ) -> tuple[StepRecord, list[Tensor], _CachedIndex]:
        """Measure and reduce: every gradient read once into per-parameter norms (unscaled), one collective at most,
        the step's statistics, in the step's record; and the gradients read (:meth:`StepRecord.apply` writes them)."""
        cached = self._index(ctx, optimizer, request.depth)
        index = cached.index
        if index.replicated_dtensors:
            resolve_partial_grads([index.params[i] for i in index.replicated_dtensors])
        grads, present, run_ids, bounds = _read_grads(index)
        missing: list[str] = []
        if bounds is None and len(present) != len(index.params):
            have = set(present)
            absent = [i for i in range(len(index.params)) if i not in have]
            if any(not steps_in_optimizer(index.params[i]) for i in absent):  # frozen since the index was built
                del self._indexes[(id(optimizer), request.depth)]
                return self._measure(ctx, optimizer, roster, request, primary)
            missing = [index.names[i] for i in absent]
        scale = ctx.loss_scale(optimizer)
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        # Exact finiteness (`GradStats.found_nonfinite`) when a policy asks; under several processes only when it
        # travels in the collective too: a rank's own answer alone could split the ranks' decisions.
        check = request.finite_check and (request.rank_flags or not distributed)
        local, found, units = _local_norms(index, grads, present, bounds, request, scale, check)
        reduced: dict[str, Tensor] = {}
        if distributed or roster.reduce_request:  # a phase with nothing to do costs nothing
            local, reduced = _reduce(ctx, roster, request, index, local, found, distributed)
        norms = {p: derive_stats(index, values, p, missing, found) for p, values in local.items()}
        if _NONFINITE_GRAD_RANKS in reduced:
            _merge_rank_flags(norms, reduced[_NONFINITE_GRAD_RANKS], found is not None)
        stats = StepStats(
            optimizer=optimizer,
            optimizer_idx=cached.optimizer_idx,
            index=index,
            present=present,
            norms=norms,
            reduced=reduced,
            primary_norm_type=primary if primary is not None else min(norms),
            logging_step=ctx.is_logging_step(None),
            loss_scale=scale,
            unit_norms=units,
            has_gradients=bool(grads),
        )
        return StepRecord(stats, run_ids, bounds), grads, cached

    def observe(self, record: StepRecord, roster: Roster, ctx: Door) -> None:
        """Observe (a step's first evaluation only): keep the record for the gate, count a skip, let the policies
        log. Off logging steps nothing here reads a value to the host."""
        stats, skip = record.stats, record.decision.skip
        if skip is not None:
            self.steps.add_skip(skip)
            if handles_found_inf(stats.optimizer):  # skipped on device: no door reads the flag at the step
                self._send_skip(record)
        self.last_records[id(stats.optimizer)] = record
        for observe in roster.observe:
            observe(stats, record, ctx)
        if stats.logging_step and self.skipped_steps is not None:
            ctx.log({"gradkit/skipped_steps": self.skipped_steps})

    def _send_skip(self, record: StepRecord) -> None:
        """Start the non-blocking copy of ``record``'s skip flag to the host, for the policies that ask at the next
        step whether it was skipped (``StepOutcome.was_skipped``). The optimizer's previous record takes its own copy
        first: the pinned buffer is the optimizer's, reused every step."""
        key = id(record.stats.optimizer)
        previous = self.last_records.get(key)
        if previous is not None:
            previous.settle_skip()
        lag = self._skip_lags.get(key)
        if lag is None:
            lag = self._skip_lags[key] = HostLag()
        record.send_skip(lag)


# -- the record of a step ----------------------------------------------------------------------------------------------
class StepRecord:
    """One optimizer step as the pipeline keeps it: the measurements, the decision and what came of it (its host
    reads, the skip flag on its way to the host, the post-clip total). Every value is a device tensor.

    The policies never hold it as such: ``decide`` gets the :class:`~gradkit.step.plan.StepStats` and the
    :class:`~gradkit.step.plan.Decision`, ``observe`` the statistics and the record as a read-only
    :class:`~gradkit.step.plan.StepOutcome`; the doors' gate (:mod:`gradkit.step.gate`) reads its decision to step
    the optimizer. The step's gradients are not kept here: :meth:`Pipeline.run` hands them from its read to
    :meth:`apply`, so a record kept after its step (the pipeline's last record, a policy's outcome kept for one step)
    never holds them through the next backward after ``zero_grad(set_to_none=True)`` dropped them. ``_run_ids`` gives
    the (device, dtype) group of each gradient of the read (``ParamIndex.run_of``), ``-1`` for a sparse one;
    ``_run_bounds`` the dense runs when every parameter has a dense gradient (the common step), else ``None``.

    Attributes:
        stats: what the step measured.
        decision: what the policies decided.
    """

    __slots__ = ("_post_clip_total", "_run_bounds", "_run_ids", "_skip_host", "_skip_lag", "decision", "stats")

    def __init__(self, stats: StepStats, run_ids: list[int], run_bounds: list[tuple[int, int]] | None) -> None:
        self.stats = stats
        self.decision = Decision()
        self._run_ids = run_ids
        self._run_bounds = run_bounds
        self._post_clip_total: Tensor | None = None
        self._skip_host: bool | None = None
        #: The copy of a skip flag only the device knows on its way to the host (:meth:`was_skipped`).
        self._skip_lag: HostLag | None = None

    # -- the skip on the host ----------------------------------------------------------------------------------------
    def skip_on_host(self) -> bool:
        """The skip decision as a Python bool: one host read per step, shared by everyone who asks."""
        if self._skip_host is None:
            skip = self.decision.skip
            self._skip_host = bool(skip) if skip is not None else False
        return self._skip_host

    def flag_on_host_with_skip(self, flag: Tensor) -> bool:
        """``flag`` (a device bool) as a Python bool, read in the same transfer as the skip decision when that is not
        on the host yet (which :meth:`skip_on_host` then returns without another read)."""
        skip = self.decision.skip
        if self._skip_host is not None or skip is None:
            return bool(flag)
        skipped, value = torch.stack([skip, flag.to(skip.device)]).tolist()
        self._skip_host = bool(skipped)
        return bool(value)

    def skip_known_on_host(self) -> bool | None:
        """The skip decision if it was already read to the host this step, else ``None`` (never synchronizes)."""
        if self.decision.skip is None:
            return False
        return self._skip_host

    def send_skip(self, lag: HostLag) -> None:
        """Start the non-blocking copy of the skip flag to the host through ``lag`` (a fused optimizer skips on
        device: no door reads the flag at the step), for :meth:`was_skipped` at the next step."""
        assert self.decision.skip is not None
        lag.push(self.decision.skip)
        self._skip_lag = lag

    def settle_skip(self) -> None:
        """Answer :meth:`was_skipped` now if the copy :meth:`send_skip` started is in flight: its pinned buffer is the
        optimizer's, and the next step's copy reuses it."""
        if self._skip_lag is not None:
            self.was_skipped()

    def was_skipped(self) -> bool:
        """Whether the step was skipped, asked once it is over: by a policy that folds the step's values into its
        statistics one step late (:mod:`gradkit.step.host_lag`) and leaves out a skipped step's, as if its batch never
        came.

        The door's read of the decision when it made one (an ordinary optimizer's gate reads it at the step), else the
        copy of the flag the pipeline started at the step (a fused optimizer skips on device, through ``found_inf``),
        arrived by then: no sync. Asked before the step is over (a logging step's report), it reads the flag then:
        it waits for that copy, or makes the read the gate makes anyway.
        """
        if self._skip_host is None and self._skip_lag is not None:
            values, self._skip_lag = self._skip_lag.pop(), None
            if values is not None:
                self._skip_host = values[0] > 0
        return self.skip_on_host()

    # -- the gradients -----------------------------------------------------------------------------------------------
    def post_clip_total(self) -> Tensor:
        """Total norm (primary norm type) of the gradients after scaling and clipping.

        Derived without touching the gradients when the clip is a scalar coefficient or the clipping policy supplied
        ``post_clip_total_fn`` (for the primary norm type); measured once (on logging steps only, by the callers)
        after a value clamp or per-parameter coefficients otherwise.
        """
        if self._post_clip_total is not None:
            return self._post_clip_total
        decision, p = self.decision, self.stats.primary_norm_type
        if decision.post_clip_total_fn is not None:
            result = decision.post_clip_total_fn()
        elif decision.clamp_value is not None or decision.param_coefs:
            result = total_norm(self.measure_grads(p), p)
        else:
            result = decision.scaled(self.stats.primary.total)
            if decision.clip_coef is not None:
                result = result * decision.clip_coef
        self._post_clip_total = result
        return result

    def measure_grads(self, norm_type: float) -> Tensor:
        """The step's gradients as they are now, read again: :func:`~gradkit.step.write.measure_grads`."""
        return measure_grads(self.stats, norm_type)

    def apply(self, grads: list[Tensor], fold: bool = False) -> None:
        """Write the step's gradients (``grads``: the pipeline's read, in ``stats.present`` order) once: multiply by
        the product of all factors, then clamp for value clipping.

        With ``fold`` (the door steps a fused optimizer through :func:`~gradkit.step.gate.step_as_decided`)
        a decision whose only write is one common factor makes no pass over the gradients: the factor is kept in
        ``Decision.folded`` and the fused kernel, which reads every gradient anyway, divides it by ``1 / factor`` (its
        ``grad_scale``) and stores the result back, as it does for a ``GradScaler``'s unscale. The step then reads the
        gradients twice (the norm, the optimizer) instead of three times, in one launch fewer per group. What the
        kernel reads, and leaves in ``p.grad``, is within 1 ulp (fp32) of the written gradient (``g / fl(1/c)``
        against ``fl(g * c)``).

        The common factor (accumulation scale times clip coefficient) stays fp32 and multiplies each (device, dtype)
        run of gradients as it is, as ``torch.nn.utils.clip_grad_norm_`` does: rounding it to a low-precision dtype
        would move the clip by up to 0.4% (bf16). Per-parameter factors (AGC), value clamps and sparse gradients are
        written by :func:`~gradkit.step.write.write`. A decision that asks for no write (the monitor alone) touches
        nothing.
        """
        decision = self.decision
        coef = decision.clip_coef
        if decision.scale is None and coef is None and not decision.param_coefs and decision.clamp_value is None:
            return
        common = decision.scale
        if coef is not None:
            common = coef if common is None else common * coef
        if decision.clamp_value is not None or decision.param_coefs or self._run_bounds is None:
            write(grads, self._run_ids, self.stats, decision, common)
        elif fold:
            decision.fold(common)
        else:
            for start, stop in self._run_bounds:
                run = grads[start:stop]
                torch._foreach_mul_(run, common.to(run[0].device))


@dataclass(frozen=True)
class _CachedIndex:
    """A parameter index with what tells when it is stale (the param groups it was built from, identity and length of
    each ``params`` list, and the parameters of those groups it left out), and what the loop said of the optimizer:
    its position, whether other optimizers share its backward passes, whether its factor folds into a fused step."""

    groups: tuple[tuple[int, int], ...]
    outside: list[Tensor]
    index: ParamIndex
    optimizer_idx: int
    shared: bool
    folds: bool


def _grad_versions(optimizer: Optimizer) -> tuple[tuple[int, int], ...]:
    """Identity and in-place version of every gradient of ``optimizer``: a backward that wrote into them (or new
    ones after ``zero_grad``) changes it, a backward into other parameters does not. Host metadata only."""
    return tuple(
        (id(p.grad), p.grad._version) for group in optimizer.param_groups for p in group["params"] if p.grad is not None
    )


# -- the gradient read ---------------------------------------------------------------------------------------------
def _local_norms(
    index: ParamIndex,
    grads: list[Tensor],
    present: list[int],
    bounds: list[tuple[int, int]] | None,
    request: StatsRequest,
    scale: Tensor | None,
    check: bool,
) -> tuple[dict[float, Tensor], Tensor | None, UnitNorms | None]:
    """This rank's per-parameter norms of the step's read, per norm type (divided by the AMP ``scale``), the flag of a
    non-finite element (``check``: from the first norm type's read) and the unit norms AGC asks for."""
    names = request.unit_norm_names
    units = _measure_units(index, grads, present, names) if names else None
    found: Tensor | None = None
    local: dict[float, Tensor] = {}
    for p in request.norm_types:
        want = check and found is None  # one norm type's read is enough
        if units is None:
            norms, mark = checked_norms(grads, p, bounds) if want else (per_tensor_norms(grads, p, bounds), None)
        else:  # the unit norms already read the gradients AGC names: their 2-norms derive from them
            norms, mark = _param_norms(grads, p, units if p == 2.0 else None, want)
            norms = norms.to(index.shard_weight.device)
        found = found if mark is None else mark
        if scale is not None:
            norms = norms / scale
        local[p] = norms if bounds is not None else fill_present(norms, present, len(index.params))
    if units is not None:
        flat = units.flat if scale is None else units.flat / scale
        units = UnitNorms([present[j] for j in units.positions], units.sizes, flat)
    return local, found, units


def _reduce(
    ctx: Door,
    roster: Roster,
    request: StatsRequest,
    index: ParamIndex,
    local: dict[float, Tensor],
    found: Tensor | None,
    distributed: bool,
) -> tuple[dict[float, Tensor], dict[str, Tensor]]:
    """The step's one collective (several processes): the sharded norm contributions, the per-rank scalars the
    policies name and, when a guard asks, each rank's flags of non-finite gradients. Returns the norms and the
    reduced scalars (as they are in one process)."""
    extras: dict[str, Tensor] = {}
    for reduce_request in roster.reduce_request:
        extras.update(reduce_request(ctx))
    if request.rank_flags and distributed:
        # A rank's gradients can turn non-finite after the DDP all-reduce (a hook, `on_after_backward`, a faulty
        # kernel): its flags then differ from the others'. Summed in the one collective, every rank sees them all.
        extras[_NONFINITE_GRAD_RANKS] = _local_nonfinite_flags(local, found, index.shard_weight.device)
    if distributed:
        return reduce_sharded(index, local, extras)
    return local, extras


def _grad_norms(
    grads: list[Tensor], norm_type: float, bounds: list[tuple[int, int]] | None, check: bool
) -> tuple[Tensor, Tensor | None]:
    """Per-gradient norms of the step's read and, with ``check``, whether some element is NaN or infinite (from the
    same read on the Triton path: :func:`~gradkit.step.norms.checked_norms`)."""
    if check:
        return checked_norms(grads, norm_type, bounds)
    return per_tensor_norms(grads, norm_type, bounds), None


def _local_nonfinite_flags(local: dict[float, Tensor], found: Tensor | None, device: torch.device) -> Tensor:
    """``[2, world_size]`` zeros, with this rank's entries: row 0 1.0 when any of its local per-parameter norms is NaN
    or Inf, row 1 its ``found`` (1.0 when one of its gradient elements is, measured on request)."""
    bad = torch.stack([nonfinite_mask(norms).any() for norms in local.values()]).any()
    flags = torch.zeros(2, dist.get_world_size(), dtype=torch.float32, device=device)
    flags[0, dist.get_rank()] = bad.to(torch.float32)
    if found is not None:
        flags[1, dist.get_rank()] = found.to(device)
    return flags


def _merge_rank_flags(stats: dict[float, GradStats], flags: Tensor, measured: bool) -> None:
    """Make every rank's statistics say what any rank's own gradients said (``flags``: the summed
    :func:`_local_nonfinite_flags`)."""
    anywhere = flags[0].sum() > 0
    for grad_stats in stats.values():
        grad_stats.norms_nonfinite = grad_stats.norms_nonfinite | anywhere
        if measured:
            grad_stats.found_nonfinite = flags[1].sum()  # the ranks holding a non-finite element
        else:
            grad_stats.finite = grad_stats.finite & ~anywhere


def _measure_units(index: ParamIndex, grads: list[Tensor], present: list[int], names: set[str]) -> UnitNorms | None:
    """Unit-wise 2-norms (over all dims but the first) of the named gradients with more than one dimension.

    ``flat`` is left in the gradients' own units here (the caller removes the loss scale); ``positions`` hold the
    positions in ``grads`` until the caller maps them (see :func:`_param_norms`).
    """
    slots = [j for j, i in enumerate(present) if grads[j].ndim > 1 and index.names[i] in names]
    if not slots:
        return None
    units = [row_norms(grads[j]) for j in slots]
    return UnitNorms(positions=slots, sizes=[u.numel() for u in units], flat=torch.cat(units))


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
    if len(present) == len(index.params) and not sparse:
        return grads, present, index.run_of, index.run_bounds
    run_ids = [index.run_of[i] for i in present]
    for j in sparse:
        run_ids[j] = -1
    return grads, present, run_ids, None


def _param_norms(
    grads: list[Tensor], norm_type: float, units: UnitNorms | None, check: bool
) -> tuple[Tensor, Tensor | None]:
    """Per-gradient norms, and the check of :func:`_grad_norms`; the 2-norms of gradients measured unit-wise are
    derived from their unit norms."""
    if units is None:
        return _grad_norms(grads, norm_type, None, check)
    slots = set(units.positions)
    rest = [j for j in range(len(grads)) if j not in slots]
    device = units.flat.device
    out = torch.empty(len(grads), dtype=torch.float32, device=device)
    out[positions_tensor(tuple(units.positions), device)] = torch.stack(
        torch._foreach_norm(list(units.flat.split(units.sizes)), 2.0)
    )
    found = None
    if rest:
        norms, found = _grad_norms([grads[j] for j in rest], norm_type, None, check)
        out[positions_tensor(tuple(rest), device)] = norms.to(device)
    if check:
        # Unit norms are fp32 sums of squares too: the gradients measured unit-wise are checked by their inf-norm (a
        # maximum cannot overflow), one more read of those gradients, only under AGC and a policy that asks.
        unit_found = checked_norms([grads[j] for j in units.positions], math.inf)[1].to(device)
        found = unit_found if found is None else torch.maximum(found.to(device), unit_found)
    return out, found
