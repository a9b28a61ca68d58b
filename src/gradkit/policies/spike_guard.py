"""SpikeGuard: loss or gradient-norm spikes by a running z-score, decided on device without a host sync.

The value it watches (:class:`~gradkit.step.watch.WatchedValue`, which ``SpikeRollback`` composes too) is identical on
every rank; the statistics are host floats fed one step late (:mod:`gradkit.step.host_lag`); a flagged step is reported
at the step or one step later (:mod:`gradkit.policies.guard_reporting`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from gradkit._util.arguments import check_choice, check_float, check_int
from gradkit.policies.guard_reporting import Reporter
from gradkit.step.host_lag import HostLag, as_float32
from gradkit.step.plan import Decision, StepOutcome, StepStats
from gradkit.step.protocol import Door, Stage, StatsRequest, StepContext, state_key
from gradkit.step.running import HostMoments
from gradkit.step.watch import WatchedValue

__all__ = ["SpikeGuard"]


@dataclass
class _SpikeStatistics:
    """One optimizer's SpikeGuard statistics (host floats) and its step whose value is on its way to them: the value
    (:class:`~gradkit.step.host_lag.HostLag`), then ``(step, threshold)``: the step and the threshold its value was
    compared with, and the step's ``outcome`` once it was applied (asked whether the step was skipped before the
    value is folded in)."""

    moments: HostMoments
    lag: HostLag = field(default_factory=HostLag)
    pending: tuple[int, float] | None = None
    outcome: StepOutcome | None = None


class SpikeGuard:
    r"""Detect loss or gradient-norm spikes with a running z-score: warn, skip the step, or raise.

    Each optimizer step, the monitored value ``x`` (the loss averaged over the accumulation window and over ranks,
    or the total 2-norm of the gradients) is compared with NaN-masked running statistics: ``z = (x - mean) / std``;
    ``z > z_threshold`` after ``warmup_steps`` finite values is a spike. Each optimizer has its own statistics (as
    ZClip's): two optimizers whose values differ in scale (a GAN's two losses, the gradient norms of two models) are
    each compared with their own history. The statistics are Python floats fed with each value one step late (a
    non-blocking copy to the host: the decision of a step needs the statistics of the steps before it only), so
    deciding is one comparison on device and never a host sync. The statistics are an exponential moving average
    (``alpha``) or, with ``window``, the last ``window`` finite values; they are fed with ``x`` clamped to
    ``mean + z_threshold * std`` (as ZClip, Kumar et al. 2025, does), so a spike that is applied (``action="warn"``)
    does not inflate them and a lasting level shift is absorbed gradually. The value of a step that was skipped, by
    this guard or any other policy, is not fed at all: the statistics are the run's without that batch (with
    ``action="skip"``, a lasting rise above the threshold is therefore skipped step after step; ``SpikeRollback``
    handles a spike that persists). Non-finite values are ignored (masked, they never poison the statistics):
    catching them is :class:`~gradkit.NonFiniteGuard`'s job. The loss is each micro-batch's, handed over by
    ``note_loss`` (behind the Trainer, ``on_before_backward``; in a loop of your own,
    :meth:`GradKit.note_loss <gradkit.GradKit.note_loss>`).

    A spike must also rise above the running mean by ``relative_floor`` times its magnitude: near convergence a
    loss is flat, its standard deviation tiny, and the z-score alone would flag its ordinary noise (a loss of 0.0055
    against a running mean of 0.0032 and a standard deviation of 0.00037 reads 6.2 standard deviations). The
    threshold is ``mean + max(z_threshold * std, relative_floor * |mean|)``.

    The decision is identical on every rank: the loss of each rank travels in the pipeline's single collective, and
    gradient norms are global. No host synchronization is needed to decide; ``action`` says when one happens:

    - ``"warn"``: spikes are reported (warning + event) on logging steps.
    - ``"skip"`` (behind a Trainer, needs a GradKit strategy): the step is skipped as ``NonFiniteGuard`` skips it.
    - ``"raise"``: one host read per step; raises before the optimizer steps.

    Events: each report is one event in ``gradkit_events.jsonl`` (``what="loss_spike"`` or ``"grad_norm_spike"``,
    with ``value``, ``z``, ``mean``, ``std``, ``z_threshold``, ``relative_floor``, ``spikes`` and ``last_step``) and
    a warning: with ``"warn"`` (and ``"skip"`` with a fused optimizer) the spikes since the previous logging step,
    by the first one's values; otherwise each spike at its step, a gradient-norm spike naming the parameter with the
    largest gradient as ``culprit``. Skipped steps are logged as ``gradkit/skipped_steps`` on logging steps.

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
        relative_floor: the least rise over the running mean that counts, as a fraction of the mean's magnitude
            (>= 0). Default 1.0: a spike at least doubles the value (a gradient-norm spike is 10x and more). 0: the
            z-score alone. Lower it (e.g. 0.2) for a loss far from zero whose smaller rises matter, a language
            model's at 2-3.

    Raises:
        ValueError: on an unknown ``monitor`` or ``action``, ``z_threshold <= 0``, ``alpha`` outside ``(0, 1)``,
            ``window < warmup_steps``, ``warmup_steps < 2`` or ``relative_floor < 0``.
        RuntimeError: at the Trainer's setup, for ``action="skip"`` on a strategy that cannot skip steps; during
            training, for ``action="raise"`` on a spike.

    Example::

        >>> import torch
        >>> from gradkit import GradKit, SpikeGuard
        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> kit = GradKit(model, optimizer, SpikeGuard("loss", action="skip"), log_dir=False)
        >>> loss = model(torch.ones(1, 2)).pow(2).sum()
        >>> loss.backward()
        >>> kit.note_loss(loss)
        >>> kit.step(optimizer)  # the first step: no history yet, no spike
        True
    """

    stage = Stage.GUARD

    def __init__(
        self,
        monitor: Literal["loss", "grad_norm"] = "loss",
        z_threshold: float = 6.0,
        alpha: float = 0.97,
        window: int | None = None,
        warmup_steps: int = 25,
        action: Literal["warn", "skip", "raise"] = "warn",
        relative_floor: float = 1.0,
    ) -> None:
        self.action = check_choice("action", action, ("warn", "skip", "raise"))
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
        self.relative_floor = check_float(
            "relative_floor", relative_floor, minimum=0.0, hint="Use 0 for the z-score alone."
        )
        # Host statistics per optimizer (index), fed each step's value one step late (see `gradkit.step.host_lag`): a
        # step's
        # decision is one comparison on device with the threshold of the steps before it.
        self._statistics: dict[int, _SpikeStatistics] = {}
        self._flagged: list[tuple[int, float, float, float, float]] = []  # (step, value, z, mean, std) to report
        self._step: tuple[Tensor, Tensor] | None = None
        self._spikes = 0
        self._watched = WatchedValue(self.monitor, f"{self.state_key}/loss_sum")
        self._reporter = Reporter("SpikeGuard", self.action)

    @property
    def state_key(self) -> str:
        return state_key(self, monitor=self.monitor, window=self.window, alpha=self.alpha)

    @property
    def events_path(self) -> Path | None:
        """The ``gradkit_events.jsonl`` file this guard writes to (known once the door is set up)."""
        return self._reporter.path

    def may_skip(self) -> bool:
        return self.action == "skip"

    def attach(self, ctx: Door, model: torch.nn.Module) -> None:
        self._reporter.attach(ctx)

    def before_first_forward(self, ctx: StepContext) -> None:
        self._reporter.restore_skips(ctx)

    def finish(self, ctx: StepContext) -> None:
        if not self._reporter.reads_on_host():
            self._report_ledger(ctx)

    # -- the watched value: each micro-batch's loss, or the gradient norm ------------------------------------------
    def note_loss(self, loss: Tensor, ctx: StepContext) -> None:
        self._watched.note_loss(loss)

    def request_stats(self, request: StatsRequest) -> None:
        self._watched.request_stats(request)

    def reduce_request(self, ctx: StepContext) -> dict[str, Tensor]:
        return self._watched.reduce_request(ctx)

    def decide(self, stats: StepStats, decision: Decision, ctx: StepContext) -> None:
        x = self._watched.value(stats, decision)
        own = self._statistics.get(stats.optimizer_idx)
        if own is None:
            own = self._statistics[stats.optimizer_idx] = _SpikeStatistics(HostMoments(self.alpha, self.window))
        self._fold(own)
        threshold = self._threshold(own.moments)
        # A finite value above the threshold; NaN and Inf never are (they are NonFiniteGuard's).
        spike = torch.nan_to_num(x, nan=-math.inf, posinf=-math.inf) > threshold
        own.lag.push(x.reshape(1))
        own.pending, own.outcome = (ctx.global_step, threshold), None  # the outcome comes at `observe`
        self._step = (spike, x)
        if self.action == "skip":
            decision.add_skip(spike)

    def _threshold(self, moments: HostMoments) -> float:
        """``mean + max(z_threshold * std, relative_floor * |mean|)``; ``inf`` during warm-up."""
        threshold = moments.threshold(self.z_threshold, self.warmup_steps)
        if math.isinf(threshold):
            return threshold
        mean = moments.moments()[0]
        return max(threshold, mean + self.relative_floor * abs(mean))

    def _fold(self, stats: _SpikeStatistics) -> None:
        """Feed an optimizer's statistics with the value of its step on its way to the host, unless a policy skipped
        that step; keep the value to report if it was a spike and this guard reports later (``action="warn"``, a
        fused optimizer's skip)."""
        values = stats.lag.pop()
        if values is None or stats.pending is None:
            return
        (x,), (step, threshold), outcome = values, stats.pending, stats.outcome
        stats.pending = stats.outcome = None
        # The device compared the fp32 value with the fp32 rounding of the threshold: the same test here.
        spike = math.isfinite(x) and x > as_float32(threshold)
        moments = stats.moments
        if spike and not self._reporter.reads_on_host():
            mean, std = moments.moments()[0], moments.std()
            self._flagged.append((step, x, (x - mean) / std, mean, std))
        if outcome is None or not outcome.was_skipped():  # a skipped step leaves the statistics as if it never came
            moments.record(x, spike, self.z_threshold)

    def _fold_all(self) -> None:
        for stats in self._statistics.values():
            self._fold(stats)

    def observe(self, stats: StepStats, outcome: StepOutcome, ctx: StepContext) -> None:
        assert self._step is not None
        spike, x = self._step
        own = self._statistics[stats.optimizer_idx]
        own.outcome = outcome  # asked whether the step was skipped when its value reaches the host
        if self._reporter.reads_on_host():
            if not self._reporter.flagged_on_host(outcome, spike):
                return
            self._spikes += 1
            value = float(x)  # a flagged step: the host reads its decision anyway
            mean, std = own.moments.moments()[0], own.moments.std()
            culprit = None
            if self.monitor == "grad_norm":
                norms = stats.norms[2.0].model_norms  # every stage's under pipeline parallelism
                culprit = stats.norms[2.0].model_names[int(norms.argmax())] if norms.numel() else None
            self._report(ctx, [(ctx.global_step, value, (value - mean) / std, mean, std)], culprit)
        elif stats.logging_step:
            self._report_ledger(ctx)

    def _report_ledger(self, ctx: StepContext) -> None:
        """Report the spikes found since the last report, this step's included (a logging step or the end of
        training: the wait for this step's value is allowed there)."""
        self._fold_all()
        if not self._flagged:
            return
        flagged, self._flagged = sorted(self._flagged), []  # several optimizers: in step order
        self._spikes += len(flagged)
        self._report(ctx, flagged, None)

    def _report(
        self, ctx: StepContext, flagged: list[tuple[int, float, float, float, float]], culprit: str | None
    ) -> None:
        """Report ``flagged`` spikes, ``(step, value, z, mean, std)`` each, by the first one's values."""
        (first, value, z, mean, std), last, count = flagged[0], flagged[-1][0], len(flagged)
        what = f"{self.monitor}_spike"
        values = {
            "value": value,
            "z": z,
            "mean": mean,
            "std": std,
            "z_threshold": self.z_threshold,
            "relative_floor": self.relative_floor,
            "spikes": count,
        }
        self._reporter.write(ctx, step=first, rank=None, what=what, culprit=culprit, values=values, last_step=last)
        steps = f"step {first}" if count == 1 else f"{count} steps between {first} and {last} (first at {first})"
        where = f"; largest gradient: `{culprit}`" if culprit else ""
        text = (
            f"SpikeGuard: {self.monitor} spike at {steps}: {value:.6g} is {z:.1f} standard deviations above the "
            f"running mean {mean:.6g} (std {std:.3g}, threshold {self.z_threshold}, relative floor "
            f"{self.relative_floor:g}){where}."
        )
        if self.action == "raise":
            raise RuntimeError(f"{text}{self._reporter.note}")
        verb = "skipped" if self.action == "skip" else "applied"
        ctx.warn(f"{text} The update was {verb}.{self._reporter.note}")

    # -- state -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``stats``: per optimizer index, the statistics (:meth:`HostMoments.state_dict`), every step's value so far
        included (empty before the first step)."""
        self._fold_all()
        state = {
            "statistic": "window" if self.window else "ema",
            "stats": {idx: stats.moments.state_dict() for idx, stats in self._statistics.items()},
            "spikes": self._spikes,
            **self._reporter.skipped_state(),
        }
        window = self._watched.window
        if window.sum is not None:
            # The losses of an accumulation window still open (a checkpoint saved mid-window): a resumed run then
            # monitors the same window mean as an uninterrupted one.
            state["window_loss"] = (window.sum.detach().cpu(), window.count)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        expected = "window" if self.window else "ema"
        if state_dict.get("statistic", expected) != expected:
            raise ValueError(
                f"SpikeGuard: the checkpoint holds {state_dict['statistic']!r} statistics but this SpikeGuard uses "
                f"{expected!r} (window={self.window!r}). Resume with the same arguments."
            )
        saved = state_dict["stats"]
        if "mean" in saved or "values" in saved:
            # A checkpoint from before the statistics were per optimizer holds one for all: a one-optimizer run's,
            # resumed as optimizer 0's (other optimizers, whose values it mixed, warm up afresh).
            saved = {0: saved}
        self._statistics = {}
        for idx, moments in saved.items():
            stats = self._statistics[int(idx)] = _SpikeStatistics(HostMoments(self.alpha, self.window))
            stats.moments.load_state_dict(moments)
        self._spikes = int(state_dict.get("spikes", 0))
        if "window_loss" in state_dict:
            self._watched.window.sum, self._watched.window.count = state_dict["window_loss"]
        self._reporter.restored_skips = float(state_dict.get("skipped_steps", 0.0))
