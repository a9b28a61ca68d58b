"""The pipeline's own record of one optimizer step: the measurements, the decision, the step's gradients (private to
the pipeline and its write) and what came of the decision (its host reads, the skip flag on its way to the host, the
post-clip total). Torch only.

The policies never hold it as such: ``decide`` gets the :class:`~gradkit.step.plan.StepStats` and the
:class:`~gradkit.step.plan.Decision`, ``observe`` the statistics and the record as a read-only
:class:`~gradkit.step.plan.StepOutcome`. The pipeline (:mod:`gradkit.step.pipeline`) makes it, applies it and keeps
the last one per optimizer; the doors' gate (:mod:`gradkit.step.gate`) reads its decision to step the optimizer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradkit.step.host_lag import HostLag
from gradkit.step.norms import total_norm
from gradkit.step.plan import Decision, StepStats
from gradkit.step.write import measure_grads, write

__all__ = ["StepRecord"]


class StepRecord:
    """One optimizer step as the pipeline keeps it. Every value is a device tensor.

    The gradients of the parameters at ``stats.present`` stay private here and in the write
    (:mod:`gradkit.step.write`): the policies decide from the statistics. ``_run_ids`` gives the (device, dtype) group
    of each (``ParamIndex.run_of``), ``-1`` for a sparse one; ``_run_bounds`` the dense runs when every parameter has a
    dense gradient (the common step), else ``None``. Sparse COO gradients were coalesced by the pipeline's read
    (``p.grad`` replaced by its coalesced version), so their values are the gradient. The pipeline drops them once the
    step is applied (:meth:`release_gradients`): a record kept after its step must not keep the step's gradients
    alive once the optimizer's ``zero_grad`` drops them.

    Attributes:
        stats: what the step measured.
        decision: what the policies decided.
        released: whether the step's gradients were dropped from the record (:meth:`release_gradients`).
    """

    __slots__ = (
        "_grads",
        "_post_clip_total",
        "_run_bounds",
        "_run_ids",
        "_skip_host",
        "_skip_lag",
        "decision",
        "released",
        "stats",
    )

    def __init__(
        self, stats: StepStats, grads: list[Tensor], run_ids: list[int], run_bounds: list[tuple[int, int]] | None
    ) -> None:
        self.stats = stats
        self.decision = Decision()
        self._grads = grads
        self._run_ids = run_ids
        self._run_bounds = run_bounds
        self._post_clip_total: Tensor | None = None
        self._skip_host: bool | None = None
        #: The copy of a skip flag only the device knows on its way to the host (:meth:`was_skipped`).
        self._skip_lag: HostLag | None = None
        self.released = False

    @property
    def dense_runs(self) -> bool:
        """Whether every parameter has a dense gradient, in the index's (device, dtype) runs: the gradients a fused
        kernel can take the common factor for."""
        return self._run_bounds is not None

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
        return measure_grads(None if self.released else self._grads, self.stats, norm_type)

    def release_gradients(self) -> None:
        """Drop the references to the step's gradient tensors (the pipeline calls it once the decision is applied).

        Everything decided stays; a later :meth:`measure_grads` reads the parameters' gradients as they are then.
        Without this, a record kept after its step (the pipeline's last record, a policy's outcome kept for one step)
        would hold the gradients through the next backward after ``zero_grad(set_to_none=True)`` dropped them: one more
        set of gradients at the memory peak.
        """
        self._grads = []
        self.released = True

    def apply(self, fold: bool = False) -> None:
        """Write the gradients once: multiply by the product of all factors, then clamp for value clipping.

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
            write(self._grads, self._run_ids, self.stats, decision, common)
        elif fold:
            decision.fold(common)
        else:
            for start, stop in self._run_bounds:
                run = self._grads[start:stop]
                torch._foreach_mul_(run, common.to(run[0].device))
