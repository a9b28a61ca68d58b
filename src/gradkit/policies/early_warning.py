r"""See an instability coming: :class:`EarlyWarning` logs the early-warning signals (:mod:`gradkit.policies.signals`),
watches them (:mod:`gradkit.policies.warning_rules`) and warns, or cuts the learning rate and resets the optimizer
moments of the modules concerned (:mod:`gradkit.policies.escalation`), before the loss spikes. Pure PyTorch; the
``Trainer`` callback of the same name is :class:`lightning_gradkit.EarlyWarning`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import torch  # noqa: F401  (the docstring example uses it)
from torch import Tensor, nn

from gradkit._util.arguments import check_bool, check_choice, check_float, check_int, name_list
from gradkit.policies.escalation import Escalation, FindingSink, module_params
from gradkit.policies.signals import Reading, StabilitySignals, signal_key
from gradkit.policies.warning_rules import (
    DEFAULT_FLOORS,
    DEFAULT_SIGMAS,
    DEFAULT_THRESHOLDS,
    Detector,
    Finding,
    checked_rules,
)
from gradkit.report.events import SIGNALS_EVENT, EventLog, write_metadata
from gradkit.step.plan import StepOutcome, StepStats
from gradkit.step.protocol import Door, Stage, StepContext, state_key
from gradkit.step.selection import parse_patterns

__all__ = ["ADVICE", "SIGNALS_EVENT", "EarlyWarning"]

#: What to do when a signal fires, per signal (the warning says it; ``docs/jobs/early_warning.md`` says more).
ADVICE = {
    "attn_logit_max": "attention logits are growing without bound (Wortsman et al. 2023): normalize q and k "
    "(qk-layernorm), lower the learning rate, or put weight decay on the query and key projections",
    "logz_mean": "the output logits drift (log Z): add a z-loss (1e-4 * logsumexp(logits)**2 to the loss) or lower "
    "the learning rate",
    "logz_max": "the output logits drift (log Z): add a z-loss (1e-4 * logsumexp(logits)**2 to the loss) or lower "
    "the learning rate",
    "adam_g2_v": "gradients far above Adam's second moment (Bai et al. 2025; SPAM): lower the learning rate or beta2 "
    "(e.g. 0.95), or reset the moments of the module",
    "adam_spike_frac": "many coordinates with g^2 > theta * v (SPAM): lower the learning rate or beta2, or reset the "
    "moments of the module",
    "update_ratio_spread": "one module's updates outgrow the others' (WeSaR 2024): lower its learning rate, check its "
    "initialization and normalization",
    "spike_score": "loss or gradient-norm spikes are frequent (OLMo 2's SpikeScore): lower the learning rate, clip "
    "(ZClip), or skip spiking steps (SpikeGuard)",
}

# The bounded host record of the logged values, for the report (older steps thinned out beyond this many).
_MAX_RECORDED_STEPS = 4096


class EarlyWarning:
    r"""Log early-warning signals of an instability, watch them, and warn (or act) before the loss spikes.

    **Signals** (:mod:`gradkit.policies.signals`), logged on logging steps only (``log_every_n_steps``, by default the
    loop's period), as ``signals/...``: the largest attention logit of each attention module; the mean and the largest
    log Z of the output module named by ``output``; per module row, ``mean(g^2)/mean(v)`` and the fraction of
    coordinates with ``g^2/v > theta`` for an optimizer that keeps Adam's second moment; the spread of the
    update-to-weight ratios; OLMo 2's SpikeScore. A step that does not log costs no device operation and no host sync
    (the SpikeScore keeps references to each step's loss and gradient norm; behind the loop door a loss costs one
    ``detach``, a view); a logging step computes them, reduces them over ranks in two all-reduces and reads them in one
    transfer. For ``F.scaled_dot_product_attention``, whose logits are never materialized, the logits of a sample are
    computed: the first batch element, every head, ``sdpa_queries`` query positions evenly spaced, every key
    (:attr:`sampled` says it per module, and ``gradkit_run.json`` keeps it as ``signals_sampled``).

    **Detector** (:mod:`gradkit.policies.warning_rules`): each ``(signal, module)`` series fires when it exceeds its
    threshold (``thresholds``: a level beyond what training recovers from; non-finite values too), at any step, or,
    outside the warm-up and from its floor on (``floors``), when it grew ``growth`` times over ``growth_steps``
    optimizer steps (and, for a signal with ``sigmas``, by more than its own past rises explain); it fires again
    only after growing ``growth`` times since. The warm-up is every reading at which the learning rate rose since the
    previous one, and the first ``warmup_steps`` optimizer steps: everything moves then, in healthy runs too, so only
    thresholds fire there. It decides on the reduced values, so every rank decides the same, and its state is saved
    in checkpoints. The defaults watch the attention logits (threshold 1500; x3 in 20 steps from 200) and, where an
    output module is found (``output="auto"``), its mean log Z (threshold 15 nats above a uniform prediction's
    ``log(n)``; from 2 above it, x3 of Z in 20 steps and 4 robust standard deviations above its own past rises).
    Their leads and false alarms on proxies of several kinds are in ``benchmarks/RESULTS.md``
    (``benchmarks/bench_early_warning.py``). The other signals are logged and drawn; give them a threshold or floor
    to watch them.

    **Action.** Every firing is an ``early_warning`` event in ``gradkit_events.jsonl`` (with the signal, the module,
    the value, the rule and the action) and a warning that says what to do. With ``action="escalate"``, a step with
    findings also starts the escalation ``SpikeRollback`` uses (:mod:`gradkit.policies.escalation`): the learning rate
    is cut by ``escalate_lr_factor`` and ramps back to the schedule over ``escalate_rewarmup_steps`` applied optimizer
    steps (compounding when it fires again during a ramp), and the optimizer moments of the modules concerned
    (``escalate_reset_moments="spiking"``: the attention module, the module row, the output module, the module with
    the largest update ratio), or of ``"all"`` parameters, are reset; an ``escalation`` event records it. With an
    :class:`~gradkit.EscalationLadder` in the loop, each step with findings is reported to it, which acts (keep
    ``action="warn"``: the ladder owns the escalation). At the end of training the logged series are one ``signals``
    event (what the report draws, whatever the logger).

    Args:
        attention: the attention modules: ``"auto"`` (the outermost modules whose class name ends in
            ``Attention``), class names or ``re:`` patterns (:mod:`gradkit.step.selection`), or ``None`` for none.
        output: the qualified name of the module that returns the output logits (e.g. ``"lm_head"``); ``"auto"``:
            the one the model's ``get_output_embeddings()`` returns (Hugging Face), else the last ``nn.Linear``
            named ``lm_head``, ``head``, ``output``, ``classifier``, ``fc``, ``decoder``, ``logits`` or ``out``
            (``output_module`` says which; none found: no log Z); ``None``: no log Z.
        adam: log the ``g^2/v`` signals when the optimizer keeps ``exp_avg_sq``.
        update_spread: log the spread of the per-module update-to-weight ratios (the parameters are copied before
            the step of a logging step, as ``GradNormMonitor(update_ratio=True)`` does).
        spike_score: log the SpikeScore (over the loss handed to the loop and the total gradient norm).
        sdpa_queries: query positions sampled per ``scaled_dot_product_attention`` call (>= 1).
        theta: the ``g^2/v`` level that counts a coordinate as spiking (SPAM's 5000).
        thresholds: per signal, the threshold rule's level; merged into ``DEFAULT_THRESHOLDS``, ``None`` turns one
            off.
        floors: per signal, the growth rule's floor; merged into ``DEFAULT_FLOORS``, ``None`` turns one off.
        growth: the growth factor of the growth rule and of a series firing again (> 1).
        growth_steps: the optimizer steps the growth is measured over (>= 1).
        sigmas: per signal, how far above its own past rises a series' rise must be to fire the growth rule, in
            robust standard deviations (``1.4826 * MAD``, over at least 10 past rises); merged into
            ``DEFAULT_SIGMAS`` (log Z: 4), ``None`` leaves a signal's bar at ``growth`` alone.
        warmup_steps: the first optimizer steps in which only thresholds fire, whatever the learning rate does (a
            rising learning rate is a warm-up too) (>= 0).
        action: ``"warn"`` or ``"escalate"``.
        escalate_lr_factor: with ``action="escalate"``, multiply the learning rate by this factor in ``(0, 1)``,
            ramping back to the schedule (``None``: no cut).
        escalate_rewarmup_steps: applied optimizer steps over which the cut ramps back to 1 (>= 1).
        escalate_reset_moments: with ``action="escalate"``, reset the optimizer state of the ``"spiking"`` modules
            (those the findings name), of ``"all"`` parameters, or ``"none"``.
        log_every_n_steps: how often to measure and log, in optimizer steps; defaults to the loop's period.

    Raises:
        ValueError: at construction, naming the argument: an invalid pattern, signal or number, an unknown
            ``action``, ``action="escalate"`` with nothing to do; at ``attach``, a pattern or ``output`` that selects
            no module, or a loop that never logs.

    Example::

        >>> import torch
        >>> from gradkit import EarlyWarning, GradKit
        >>> from lightning_gradkit.demos import GPTConfig, TinyGPT
        >>> model = TinyGPT(GPTConfig(n_layer=1, n_embd=32))
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> logged, warning = [], EarlyWarning()
        >>> kit = GradKit(model, optimizer, warning, log_every_n_steps=1, log_dir=False,
        ...               log=lambda metrics, step: logged.append(metrics))
        >>> warning.attention_modules, warning.output_module  # found: by class name, and the output logits' module
        (['blocks.0.attn'], 'lm_head')
        >>> x = torch.randint(256, (2, 16))
        >>> for _ in range(11):  # the Adam signals wait for second moments of 10 steps
        ...     loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        ...     loss.backward()
        ...     kit.note_loss(loss)
        ...     _ = kit.step(optimizer)
        ...     optimizer.zero_grad()
        >>> sorted(k for k in logged[-1] if "blocks" not in k)  # doctest: +NORMALIZE_WHITESPACE
        ['signals/adam_g2_v/lm_head', 'signals/adam_g2_v/ln_f', 'signals/adam_g2_v/wpe', 'signals/adam_g2_v/wte',
         'signals/adam_spike_frac/lm_head', 'signals/adam_spike_frac/ln_f', 'signals/adam_spike_frac/wpe',
         'signals/adam_spike_frac/wte', 'signals/logz_max', 'signals/logz_mean', 'signals/spike_score',
         'signals/spike_score_total', 'signals/update_ratio_spread']
    """

    stage = Stage.GUARD  # its `finish` writes the series before GradNormMonitor's report reads the events

    def __init__(  # noqa: PLR0913 (a public constructor: one argument per documented option)
        self,
        attention: list[str] | Literal["auto"] | None = "auto",
        output: str | None = "auto",
        adam: bool = True,
        update_spread: bool = True,
        spike_score: bool = True,
        sdpa_queries: int = 64,
        theta: float = 5000.0,
        thresholds: dict[str, float | None] | None = None,
        floors: dict[str, float | None] | None = None,
        growth: float = 3.0,
        growth_steps: int = 20,
        sigmas: dict[str, float | None] | None = None,
        warmup_steps: int = 40,
        action: Literal["warn", "escalate"] = "warn",
        escalate_lr_factor: float | None = 0.1,
        escalate_rewarmup_steps: int = 300,
        escalate_reset_moments: Literal["none", "all", "spiking"] = "spiking",
        log_every_n_steps: int | None = None,
    ) -> None:
        patterns = None if attention is None else () if attention == "auto" else parse_patterns("attention", attention)
        if output is not None and not (isinstance(output, str) and output):
            raise ValueError(f"`output` must be a module's qualified name or None, got {output!r}. E.g. 'lm_head'.")
        self.attention, self.output = attention, output
        self.sdpa_queries = check_int("sdpa_queries", sdpa_queries, 1, hint="E.g. `sdpa_queries=64`.")
        self.theta = check_float("theta", theta, above=0.0, hint="SPAM's default is `theta=5000`.")
        self.thresholds = checked_rules("thresholds", thresholds, DEFAULT_THRESHOLDS)
        self.floors = checked_rules("floors", floors, DEFAULT_FLOORS)
        self.growth = check_float("growth", growth, above=1.0, hint="E.g. `growth=3.0`: x3 in `growth_steps` fires.")
        self.growth_steps = check_int("growth_steps", growth_steps, 1, hint="E.g. `growth_steps=20`.")
        self.sigmas = checked_rules("sigmas", sigmas, DEFAULT_SIGMAS)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0, hint="E.g. `warmup_steps=40`.")
        self.action = check_choice("action", action, ("warn", "escalate"))
        if log_every_n_steps is not None:
            check_int("log_every_n_steps", log_every_n_steps, 1, hint="None follows the loop's logging period.")
        self.log_every_n_steps = log_every_n_steps
        self._escalation = _escalation(self.action, escalate_lr_factor, escalate_rewarmup_steps, escalate_reset_moments)
        self.escalate_lr_factor = self._escalation.lr_factor
        self.escalate_rewarmup_steps = self._escalation.rewarmup_steps
        self.escalate_reset_moments = self._escalation.reset_moments
        self._signals = StabilitySignals(
            patterns,
            output,
            check_bool("adam", adam),
            check_bool("update_spread", update_spread),
            check_bool("spike_score", spike_score),
            self.sdpa_queries,
            self.theta,
            log_every_n_steps,
        )
        self._detector = Detector(
            self.thresholds, self.floors, self.growth, self.growth_steps, self.sigmas, self.warmup_steps
        )
        #: The loop's EscalationLadder, which hears of every step with findings (set by the ladder's ``attach``).
        self._ladder: FindingSink | None = None
        self._start_run_state()

    def _start_run_state(self) -> None:
        """What a run records (events, warnings, the signal series for the report): empty."""
        self._events: EventLog | None = None
        self._model: nn.Module | None = None
        self._log_dir: Path | None = None
        self._written_sampled: dict[str, str] = {}
        #: Every warning so far: ``(step, signal, module, value)``.
        self.warnings: list[tuple[int, str, str, float]] = []
        self._record: dict[str, dict[int, float]] = {}
        self._recorded_steps: list[int] = []

    @property
    def state_key(self) -> str:
        return state_key(self)

    @property
    def sampled(self) -> dict[str, str]:
        """Per attention module, what its logits were read from (a ``scaled_dot_product_attention`` call's sample)."""
        return dict(self._signals.sampled)

    @property
    def attention_modules(self) -> list[str]:
        """The attention modules watched (known after ``attach``)."""
        return list(self._signals.attention_names)

    # -- the loop ------------------------------------------------------------------------------------------------
    def attach(self, ctx: Door, model: nn.Module) -> None:
        """Hook the model and open the events file.

        Raises:
            ValueError: a loop that never logs, or a selection that selects no module. (A second EarlyWarning is
                refused by the door: both would have one state key.)
        """
        period = ctx.log_every_n_steps if self.log_every_n_steps is None else self.log_every_n_steps
        if period == 0:
            raise ValueError(
                "EarlyWarning measures its signals on logging steps, and this loop never logs (`log_every_n_steps=0`)."
                " Pass `EarlyWarning(log_every_n_steps=...)`, e.g. 10."
            )
        self._signals.attach(ctx, model)
        self._model = model
        self._log_dir = ctx.log_dir if ctx.global_rank == 0 else None
        self._events = EventLog(ctx.log_dir, rank=ctx.global_rank) if ctx.log_dir is not None else None
        if self.action == "escalate":
            self._escalation.start(ctx)  # the learning-rate hooks on the loop's optimizers

    def detach(self, ctx: StepContext) -> None:
        self._signals.detach()
        self._escalation.remove_hooks()

    def note_loss(self, loss: Tensor, ctx: StepContext) -> None:
        self._signals.note_loss(loss)

    def observe(self, stats: StepStats, outcome: StepOutcome, ctx: StepContext) -> None:
        escalation = self._escalation
        ramping = escalation.ramp_start < 1.0 and escalation.ramp_done < escalation.rewarmup_steps
        if ramping or escalation.step_factor != 1.0:
            # During a ramp only: the step takes the ramp's multiplier unless skipped (a host read of a skip flag).
            escalation.step_factor = 1.0
            if outcome.decision.skip is None or not outcome.skip_on_host():
                escalation.step_applied()
        self._signals.observe(stats, outcome, ctx)

    def after_step(self, ctx: StepContext) -> None:
        reading = self._signals.read(ctx)
        if reading is None:
            return
        metrics = reading.metrics()
        ctx.log_values(metrics)
        self._keep(reading.step, metrics)
        if self._log_dir is not None and self._signals.sampled != self._written_sampled:
            self._written_sampled = dict(self._signals.sampled)
            write_metadata(self._log_dir, signals_sampled=self._written_sampled)
        self._detector.reading(reading.step, _learning_rate(ctx))
        findings = [
            finding
            for (signal, module), value in reading.values.items()
            if (finding := self._detector.check(signal, module, reading.step, value, reading.baseline(signal)))
            is not None
        ]
        if findings:
            self._fire(ctx, reading, findings)

    def finish(self, ctx: StepContext) -> None:
        """Write the run's signal series as one event (what the report draws, whatever the logger)."""
        self._escalation.remove_hooks()
        if self._events is not None and self._record:
            series = {key: sorted(values.items()) for key, values in self._record.items()}
            self._events.write(
                step=ctx.global_step,
                batch_idx=ctx.batch_idx,
                rank=None,
                what=SIGNALS_EVENT,
                culprit=None,
                values={},
                source=type(self).__name__,
                series=series,
                sampled=self._signals.sampled,
            )

    # -- warnings and actions ------------------------------------------------------------------------------------
    def _fire(self, ctx: StepContext, reading: Reading, findings: list[Finding]) -> None:
        escalate = self.action == "escalate"
        modules: list[str] = []
        for finding in findings:
            module = finding.module or reading.concerned.get(finding.signal, "")
            if module and module not in modules:
                modules.append(module)
            self.warnings.append((finding.step, finding.signal, module, finding.value))
            self._event(ctx, finding.step, "early_warning", finding.values(), module or None, action=self.action)
            rule = (
                ("not finite" if not math.isfinite(finding.value) else f"above {finding.limit:.4g}")
                if finding.rule == "threshold"
                else f"x{finding.value / finding.reference:.3g} since step {finding.reference_step}"
                if finding.reference
                else "growing"
            )
            where = f" (module `{module}`)" if module and not finding.module else ""
            ctx.warn(
                f"EarlyWarning: {signal_key(finding.signal, finding.module)}{where} is {finding.value:.4g} at step "
                f"{finding.step} ({rule}): {ADVICE[finding.signal]}."
                + (" Escalating: see the next warning." if escalate else "")
            )
        if escalate:  # during a ramp it compounds: the signal grew by `growth` again despite the cut
            self._escalate(ctx, reading.step, modules, {f.module or f.signal: f.value for f in findings})
        if self._ladder is not None:  # last: the ladder's rung may roll back this policy's state
            keys = name_list([signal_key(f.signal, f.module) for f in findings])
            self._ladder.report(f"EarlyWarning at step {reading.step}: {keys}", source="EarlyWarning", modules=modules)

    def _escalate(self, ctx: StepContext, step: int, modules: list[str], values: dict[str, float]) -> None:
        # "spiking": the modules the findings point at ("all": every trained parameter, chosen by the escalation).
        spiking = (modules, self._params_of(modules), values) if self.escalate_reset_moments == "spiking" else None
        fields, actions = self._escalation.escalate(ctx, spiking, step, 0, 0, step)
        for key in ("step", "rollback", "steps_since_previous", "to_step"):
            fields.pop(key, None)
        fields["module_values"] = fields.pop("module_z")
        self._event(ctx, step, "escalation", values, next(iter(modules), None), **fields)
        ctx.warn(f"EarlyWarning: escalation {self._escalation.count} at step {step}: {actions}.")

    @property
    def output_module(self) -> str | None:
        """The output module whose log Z is watched (known after ``attach``; ``None``: none found or given)."""
        return self._signals.output

    def _params_of(self, modules: list[str]) -> list[Tensor]:
        """The parameters of the named modules (a module row, an attention or output module, or a parameter's name)."""
        assert self._model is not None
        return module_params(self._model, modules)

    def _event(
        self, ctx: StepContext, step: int, what: str, values: dict[str, Any], culprit: str | None, **fields: Any
    ) -> None:
        if self._events is not None:
            self._events.write(
                step=step,
                batch_idx=ctx.batch_idx,
                rank=None,
                what=what,
                culprit=culprit,
                values=values,
                source=type(self).__name__,
                **fields,
            )

    def _keep(self, step: int, metrics: dict[str, float]) -> None:
        """Keep the logged values for the report (rank 0), every other step dropped past the bound."""
        if self._log_dir is None:
            return
        self._recorded_steps.append(step)
        for key, value in metrics.items():
            self._record.setdefault(key, {})[step] = value
        if len(self._recorded_steps) > _MAX_RECORDED_STEPS:
            dropped = set(self._recorded_steps[1::2])
            self._recorded_steps = self._recorded_steps[::2]
            for values in self._record.values():
                for s in dropped & values.keys():
                    del values[s]

    # -- state ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "detector": self._detector.state_dict(),
            "signals": self._signals.state_dict(),
            "warnings": [list(w) for w in self.warnings],
            **self._escalation.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._detector.load_state_dict(state_dict["detector"])
        self._signals.load_state_dict(state_dict["signals"])
        self.warnings = [(int(s), str(g), str(m), float(v)) for s, g, m, v in state_dict["warnings"]]
        self._escalation.load_state_dict(state_dict)


def _escalation(
    action: str, lr_factor: float | None, rewarmup_steps: int, reset_moments: Literal["none", "all", "spiking"]
) -> Escalation:
    """The escalation ``action="escalate"`` starts (checked even for ``"warn"``: its arguments are public)."""
    if action == "escalate" and lr_factor is None and reset_moments == "none":
        raise ValueError(
            "`action='escalate'` with `escalate_lr_factor=None` and `escalate_reset_moments='none'` has nothing "
            "to do: give a factor (e.g. 0.1) or a moment reset ('spiking', 'all'), or use `action='warn'`."
        )
    return Escalation(lr_factor, rewarmup_steps, reset_moments, 1, 0.97, 6.0, 2)


def _learning_rate(ctx: StepContext) -> float | None:
    """The largest learning rate of the loop's optimizers, on the host (a tensor one is read: a logging step's)."""
    rates = [float(group["lr"]) for optimizer in ctx.optimizers for group in optimizer.param_groups if "lr" in group]
    return max(rates) if rates else None
