r"""Early-warning signals of a training instability, measured on logging steps only: what
:class:`~gradkit.EarlyWarning` logs and watches.

Each signal looks where the trouble shows before the loss does (the references are in the docs page
``docs/jobs/early_warning.md``):

- ``signals/attn_logit_max/<module>``: the largest attention logit ``q.k / sqrt(d)`` of each attention module, over
  the step's forwards (Wortsman et al. 2023: it grows without bound at high learning rates without qk-layernorm).
  A module that calls ``torch.softmax`` on its scores is read whole (the softmax input is the logits); one that calls
  ``F.scaled_dot_product_attention``, whose logits are never materialized, has them computed on a sample
  (:func:`sdpa_logit_max`): the first batch element, every head, ``sdpa_queries`` query positions evenly spaced
  (the last one included) against every key, with the call's own mask, causality and scale.
  :attr:`StabilitySignals.sampled` says what was sampled, per module.
- ``signals/logz_mean`` and ``signals/logz_max``: the mean and the largest ``log Z = logsumexp(logits)`` over the
  positions of a named output module (the z-loss quantity; it drifts when the output logits diverge).
- ``signals/adam_g2_v/<row>`` and ``signals/adam_spike_frac/<row>``: for optimizers that keep Adam's second moment
  (``exp_avg_sq``), per module row, ``mean(g^2) / mean(v_hat)`` and the fraction of coordinates with
  ``g^2 > theta * v_hat`` (SPAM, Huang et al. 2025, ``theta = 5000``): ``g`` the gradient the optimizer steps with
  (after gradkit's scaling and clipping, without the AMP scale) and ``v_hat`` the bias-corrected second moment
  before this step.
- ``signals/update_ratio_spread``: the largest per-module update-to-weight ratio over their median (WeSaR, 2024:
  before spikes some modules' updates grow far beyond the others').
- ``signals/spike_score`` and ``signals/spike_score_total``: the fraction of optimizer steps whose loss or gradient
  norm lies above ``mean + 6 sd`` of its previous 128 values (OLMo 2; OLMo-core's ``StabilityMonitorCallback``),
  over the last ``rolling_window`` steps and over the whole run.

Cost: nothing on a step that does not log. The forward hooks check a Python flag, and the SpikeScore keeps a
reference to each step's loss and gradient norm (tensors the loop computes anyway) until the next logging step
reads them all in its one transfer. Behind the loop door, keeping a micro-batch's loss is one ``detach`` (a view: no
kernel, no allocation); the Trainer hands over its own detached copy. A logging step computes the signals, makes
one all-reduce of the sums and one of the maxima under ``torch.distributed`` (so every rank reads the same values),
and reads them to the host once. ``benchmarks/bench_signals.py`` measures it.

Under ``torch.compile`` the forward hooks of modules inside a compiled region are traced as nothing (they return at
once while dynamo traces them): the graph gets no operator of theirs and no guard on the step, so nothing recompiles,
and the attention and log Z signals of those modules are not measured (a warning says so, once; the other signals
read the gradients and the optimizer outside the graph and are measured as usual).

Pure PyTorch; no Lightning here.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from gradkit._util.arguments import name_list
from gradkit.policies.attention_heads import ModuleScopedMode
from gradkit.policies.signal_math import SpikeScore, adam_ratio_sums, sdpa_logit_max
from gradkit.policies.update_ratio import update_ratios
from gradkit.policies.warning_rules import LOG_SIGNALS
from gradkit.report.events import SIGNALS_PREFIX as PREFIX
from gradkit.step.accumulate import mean_window_scale
from gradkit.step.norms import ParamIndex, host_to_device, local_tensor, per_tensor_norms, world_size
from gradkit.step.params import clean_name
from gradkit.step.plan import StepOutcome, StepStats
from gradkit.step.protocol import Door, StepContext
from gradkit.step.replay import replaying
from gradkit.step.selection import (
    NamePattern,
    auto_module_keys,
    module_rows,
    no_match_hint,
    outermost_attention,
    repeated_blocks,
)

__all__ = ["PREFIX", "Reading", "StabilitySignals", "signal_key"]

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SOFTMAX = (torch.softmax, F.softmax, Tensor.softmax)


class _AttentionMode(ModuleScopedMode):
    """Active inside one attention module's forward on a logging step: reads the logits of its attention calls."""

    owner: StabilitySignals

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # Inside this method the mode is off: what it computes here is not seen again.
        if func is F.scaled_dot_product_attention:
            call = {**dict(zip(_SDPA_ARGS, args, strict=False)), **kwargs}
            with torch.no_grad():
                value, what = sdpa_logit_max(
                    call["query"],
                    call["key"],
                    call.get("attn_mask"),
                    bool(call.get("is_causal", False)),
                    call.get("scale"),
                    bool(call.get("enable_gqa", False)),
                    self.owner.sdpa_queries,
                )
            self.owner.note_attention(self.name, value, "scaled_dot_product_attention: " + what)
        elif func in _SOFTMAX:
            scores = args[0] if args else kwargs.get("input", kwargs.get("self"))
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if isinstance(scores, Tensor) and scores.ndim >= 3 and dim in (-1, scores.ndim - 1):
                self.owner.note_attention(self.name, scores.detach().amax(), "softmax input: every logit")
        return func(*args, **kwargs)


class StabilitySignals:
    """The measurement of the signals for one loop: hooks on the model, what a step keeps, the logging step's read.

    :class:`~gradkit.EarlyWarning` owns one and calls it from its protocol hooks; the arguments are
    its own (see there).
    """

    def __init__(
        self,
        attention: tuple[NamePattern, ...] | None,
        output: str | None,
        adam: bool,
        update_spread: bool,
        spike_score: bool,
        sdpa_queries: int,
        theta: float,
        log_every_n_steps: int | None,
    ) -> None:
        self.attention, self.output = attention, output
        self.adam, self.update_spread, self.spike_score_on = adam, update_spread, spike_score
        self.sdpa_queries, self.theta, self.log_every_n_steps = sdpa_queries, theta, log_every_n_steps
        self.spike_score = SpikeScore()
        self.classes: int | None = None  # the output module's number of outputs, from its forward
        #: Per attention module: what its logits were read from (the sample of a ``scaled_dot_product_attention``).
        self.sampled: dict[str, str] = {}
        self.modules: dict[str, nn.Module] = {}
        self.attention_names: list[str] = []
        self._ctx: StepContext | None = None
        self._hooks: list[RemovableHandle] = []
        self._hooked: nn.Module | None = None  # the model the hooks are on
        self._modes: dict[str, _AttentionMode] = {}
        self._active_for: tuple[tuple[int, ...], bool] | None = None
        self._blocks: list[str] = []
        self._model_order: list[str] = []
        self._rows: dict[int, tuple[ParamIndex, list[str], Tensor]] = {}
        # The current logging step's device values.
        self._attn: dict[str, Tensor] = {}
        self._logz: tuple[Tensor, int, Tensor] | None = None
        self._adam: list[tuple[list[str], Tensor]] = []
        self._ratios: dict[int, tuple[list[str], Tensor]] = {}
        self._before: dict[int, tuple[ParamIndex, list[Tensor], Tensor, tuple[list[str], Tensor]]] = {}
        self._step_hooks: list[RemovableHandle] = []
        # Forwards of the hooked modules on this logging step that ran outside torch.compile, and whether the missing
        # signals of compiled modules were warned about (once).
        self._hooked_forwards = 0
        self._warned_compiled = False
        self._observed = False
        self._logging = False
        self._step = 0
        # SpikeScore: the losses of the open window, then each step's (losses, window factor, grad norm, scale)
        # until a logging step reads them; values read already (a checkpoint taken in between) as host floats.
        self._window: list[Tensor] = []
        self._pending: list[_Pending] = []
        self._pending_host: list[tuple[float | None, float | None]] = []

    # -- the model ----------------------------------------------------------------------------------------------
    def attach(self, ctx: Door, model: nn.Module) -> None:
        """Find the attention and output modules and hook them.

        Raises:
            ValueError: an ``attention`` pattern or the ``output`` name that selects no module.
        """
        if self._hooks and self._hooked is model:
            # Attached again (a door's `load_state_dict`): the hooks stay. A compiled graph that traced them guards on
            # their ids, and new ones would recompile it.
            self._ctx = ctx
            return
        self.detach()
        self._ctx = ctx
        self._hooked = model
        named = [(clean_name(n), m) for n, m in model.named_modules()]
        self.modules = dict(named)
        self._model_order = [clean_name(n) for n, _ in model.named_parameters()]
        self._blocks = repeated_blocks(named)
        self._rows.clear()
        patterns = self.attention
        self.attention_names = [] if patterns is None else [n for n, _ in outermost_attention(named, patterns)]
        for name in self.attention_names:
            module = self.modules[name]
            self._modes[name] = _AttentionMode(self, name)
            self._hooks.append(module.register_forward_pre_hook(functools.partial(self._enter, name)))
            self._hooks.append(module.register_forward_hook(functools.partial(self._exit, name), always_call=True))
        if self.output == "auto":
            self.output = output_module(model, named)
        elif self.output is not None and self.output not in self.modules:
            names = [n for n, _ in named if n]
            hint = no_match_hint(NamePattern.parse("re:" + self.output, "output"), names, [])
            raise ValueError(
                f"`output={self.output!r}` names no module of `{type(model).__name__}`. {hint} Give the qualified "
                "name of the module that returns the output logits (e.g. 'lm_head'), or `output=None`."
            )
        if self.output is not None:
            self._hooks.append(self.modules[self.output].register_forward_hook(self._output_hook))

    def detach(self) -> None:
        """Remove every hook (and leave an attention mode a failed forward left open)."""
        for handle in [*self._hooks, *self._step_hooks]:
            handle.remove()
        self._hooks, self._step_hooks = [], []
        for mode in self._modes.values():
            mode.stop()
        self._modes = {}

    def _active(self) -> bool:
        """Whether the forward under way belongs to a logging step's training (Python only: no device work)."""
        ctx = self._ctx
        if ctx is None:
            return False
        key = ctx.step_key()
        if self._active_for is None or self._active_for[0] != key:
            self._active_for = (key, ctx.is_logging_step(self.log_every_n_steps))
        return self._active_for[1] and torch.is_grad_enabled() and not replaying()

    def _enter(self, name: str, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return  # traced into a compiled graph as nothing: no guard on the step, no recompilation, no graph break
        if module.training and self._active():
            self._hooked_forwards += 1
            self._modes[name].start()

    def _exit(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        mode = self._modes.get(name)
        if mode is not None:
            mode.stop()

    def note_attention(self, name: str, value: Tensor, what: str) -> None:
        previous = self._attn.get(name)
        self._attn[name] = value.float() if previous is None else torch.maximum(previous, value.float())
        self.sampled.setdefault(name, what)

    def _output_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or not (module.training and self._active() and isinstance(output, Tensor)):
            return
        self._hooked_forwards += 1
        self.classes = output.shape[-1]
        with torch.no_grad():
            lse = torch.logsumexp(output.detach().float(), dim=-1)
            total, peak = lse.sum(), lse.amax()
        if self._logz is not None:
            total, peak = self._logz[0] + total, torch.maximum(self._logz[2], peak)
        self._logz = (total, (self._logz[1] if self._logz is not None else 0) + lse.numel(), peak)

    # -- the step -----------------------------------------------------------------------------------------------
    def note_loss(self, loss: Tensor, detached: bool = False) -> None:
        """A micro-batch loss, as the loop computed it (the SpikeScore's): kept by reference (``detach`` is a view)."""
        if self.spike_score_on:
            self._window.append(loss if detached else loss.detach())

    def observe(self, stats: StepStats, outcome: StepOutcome, ctx: StepContext) -> None:
        """Every step: keep references for the SpikeScore. A logging step: the g^2/v sums, the parameters before
        the step for the update ratios."""
        self._observed = True
        if self.spike_score_on:  # its losses join at the step's end (a Trainer hands the last one over then)
            self._pending.append(_Pending([], 1.0, stats.primary.total, outcome.decision.scale))
        if not ctx.is_logging_step(self.log_every_n_steps):
            return
        self._logging = True
        self._step = ctx.global_step
        rows = self._module_rows(stats)
        if self.adam:
            params = [stats.index.params[i] for i in stats.present]
            grads = [local_tensor(p.grad) for p in params]  # as the write left them (the step's own are the pipeline's)
            factor = outcome.decision.folded
            if stats.loss_scale is not None:
                factor = (1.0 / stats.loss_scale) if factor is None else factor / stats.loss_scale
            with torch.no_grad():
                sums = adam_ratio_sums(grads, stats.optimizer, params, factor, self.theta)
            if sums is not None:
                per_row = torch.zeros(4, len(rows[0]), dtype=torch.float32, device=sums.device)
                present_rows = rows[1][host_to_device(stats.present, torch.long, rows[1].device)]
                per_row.index_add_(1, present_rows.to(sums.device), sums)
                self._adam.append((rows[0], per_row))
        if self.update_spread:
            index = stats.index
            with torch.no_grad():
                before = [local_tensor(p.detach()).clone() for p in index.params]
                weights = per_tensor_norms(before, 2.0, index.run_bounds).to(index.shard_weight.device)
            self._before[stats.optimizer_idx] = (index, before, weights, rows)
            post = functools.partial(self._after_optimizer_step, stats.optimizer_idx)
            self._step_hooks.append(stats.optimizer.register_step_post_hook(post))

    def _after_optimizer_step(self, idx: int, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        kept = self._before.pop(idx, None)
        if kept is None:
            return
        index, before, weights, rows = kept
        with torch.no_grad():
            ratios = update_ratios(index, before, weights, rows)
        names = rows[0]
        self._ratios[idx] = (names, torch.stack([ratios[f"update_ratio/module/{n}"] for n in names]))

    def _module_rows(self, stats: StepStats) -> tuple[list[str], Tensor]:
        """The rows of ``GradNormMonitor(depth="auto")`` and the row of every parameter, once per parameter index."""
        cached = self._rows.get(stats.optimizer_idx)
        if cached is None or cached[0] is not stats.index:
            names = stats.index.names
            rows, positions = module_rows(auto_module_keys(names, self._blocks), names, self._model_order)
            cached = (stats.index, rows, host_to_device(positions, torch.long, stats.index.shard_weight.device))
            self._rows[stats.optimizer_idx] = cached
        return cached[1], cached[2]

    def read(self, ctx: StepContext) -> Reading | None:
        """After the optimizer step: the logging step's signals, reduced over ranks and read to the host once.

        ``None`` off logging steps (nothing computed, nothing read) and after a micro-batch inside an accumulation
        window (the Trainer calls after every batch).
        """
        if not self._observed:
            return None
        self._observed = False
        self._close_window(ctx)
        if not self._logging:
            return None
        self._logging = False
        self._before.clear()
        self._warn_if_compiled(ctx)
        reading = self._reading(self._reduced(ctx.device))
        self._attn, self._logz, self._adam, self._ratios = {}, None, [], {}
        return reading

    def _warn_if_compiled(self, ctx: StepContext) -> None:
        """Once: the hooked modules (attention, output) ran no forward of this logging step outside ``torch.compile``,
        so the signals their hooks measure are missing (the hooks are traced as nothing: see :meth:`_enter`)."""
        hooked, self._hooked_forwards = self._hooked_forwards, 0
        if hooked or self._warned_compiled or not (self.attention_names or self.output is not None):
            return
        self._warned_compiled = True
        ctx.warn(
            f"EarlyWarning: the modules it hooks ({name_list([*self.attention_names, *filter(None, [self.output])])}) "
            f"ran no forward outside torch.compile on a logging step, so `signals/attn_logit_max/*`, "
            "`signals/logz_mean` and `signals/logz_max` are not measured for them: gradkit's forward hooks are traced "
            "into a compiled graph as nothing (no recompilation, no graph break in your compiled region). The other "
            "signals (Adam g^2/v, update-ratio spread, SpikeScore) are measured as usual. To measure them too, leave "
            "the attention and output modules out of the compiled region (e.g. compile the blocks' MLPs only)."
        )

    def _close_window(self, ctx: StepContext) -> None:
        """The step's window of micro-batch losses is complete: hand it to the step's pending entry, and remove the
        hooks that only this step needed."""
        if self._pending:
            step = self._pending[-1]
            step.losses, self._window = self._window, []
            if step.losses:
                step.factor = mean_window_scale(ctx.accumulate_grad_batches, len(step.losses))
        for handle in self._step_hooks:
            handle.remove()
        self._step_hooks = []

    def _reduced(self, device: torch.device) -> _Reduced:
        """Every signal of the logging step packed into three vectors (summed, maximized, plain), reduced over the
        ranks and read to the host in one transfer."""
        sums, maxima, plain = _Pack(device), _Pack(device), _Pack(device)
        out = _Reduced(attention={name: maxima.add(value) for name, value in sorted(self._attn.items())})
        if self._logz is not None:
            total, count, peak = self._logz
            out.logz = (
                sums.add(total),
                sums.add(host_to_device([float(count)], torch.float32, device)),
                maxima.add(peak),
            )
        out.adam = [(names, sums.add(t.flatten())) for names, t in self._adam]
        out.pending, self._pending = self._pending, []
        losses = [t.float() for entry in out.pending for t in entry.losses]
        loss_part = sums.add(torch.stack(losses)) if losses else None
        out.ratios = [(names, plain.add(t)) for names, t in self._ratios.values()]
        norms = [e.norm if e.scale is None else e.norm * e.scale for e in out.pending if e.norm is not None]
        norm_part = plain.add(torch.stack(norms)) if norms else None
        sum_vec, max_vec = sums.vector(), maxima.vector()
        if world_size() > 1:
            dist.all_reduce(sum_vec)
            dist.all_reduce(max_vec, op=dist.ReduceOp.MAX)
            if loss_part is not None:  # the loss is a mean over the ranks; the other sums are totals
                sum_vec[loss_part] /= world_size()
        host = torch.cat([sum_vec, max_vec, plain.vector()]).tolist()
        ns, nm = sum_vec.numel(), max_vec.numel()
        out.s, out.m, out.p = host[:ns], host[ns : ns + nm], host[ns + nm :]
        out.losses = out.s[loss_part] if loss_part is not None else []
        out.norms = out.p[norm_part] if norm_part else []
        return out

    def _reading(self, r: _Reduced) -> Reading:
        """The logging step's :class:`Reading` from the host values."""
        s, m, p = r.s, r.m, r.p
        reading = Reading(self._step, classes=self.classes)
        for name, part in r.attention.items():
            reading.add("attn_logit_max", name, m[part][0])
        if r.logz is not None:
            total, count = s[r.logz[0]][0], s[r.logz[1]][0]
            reading.add("logz_mean", "", total / max(count, 1.0), self.output)
            reading.add("logz_max", "", m[r.logz[2]][0], self.output)
        for names, part in r.adam:
            g2, v, count, numel = (s[part][k * len(names) : (k + 1) * len(names)] for k in range(4))
            for i, row in enumerate(names):
                if numel[i] > 0:
                    reading.add("adam_g2_v", row, g2[i] / v[i] if v[i] > 0 else math.inf)
                    reading.add("adam_spike_frac", row, count[i] / numel[i])
        found = [(row, v) for names, part in r.ratios for row, v in zip(names, p[part], strict=True) if v > 0]
        found = [(row, v) for row, v in found if math.isfinite(v)]
        if len(found) >= 3:
            top, value = max(found, key=lambda item: item[1])
            reading.add("update_ratio_spread", "", value / statistics.median(v for _, v in found), top)
        if self.spike_score_on:
            self._score(r.pending, r.losses, r.norms)
            reading.add("spike_score", "", self.spike_score.score)
            reading.add("spike_score_total", "", self.spike_score.total)
        return reading

    def _score(self, pending: list[_Pending], losses: list[float], norms: list[float]) -> None:
        """Feed the SpikeScore every step since the last logging step, in order."""
        for loss, norm in self._pending_host:
            self.spike_score.add(loss, norm)
        self._pending_host = []
        for entry in pending:
            loss = sum(losses[: len(entry.losses)]) * entry.factor if entry.losses else None
            losses = losses[len(entry.losses) :]
            value = None
            if entry.norm is not None:
                value, norms = norms[0], norms[1:]
            self.spike_score.add(loss, value)

    def state_dict(self) -> dict[str, Any]:
        """The SpikeScore's state, with the steps since the last logging step read to the host (one read)."""
        pending = [
            (
                float(sum(t.float() for t in e.losses) * e.factor) if e.losses else None,
                float(e.norm if e.scale is None else e.norm * e.scale) if e.norm is not None else None,
            )
            for e in self._pending
        ]
        return {"spike_score": self.spike_score.state_dict(), "pending": self._pending_host + pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.spike_score.load_state_dict(state["spike_score"])
        self._pending_host = [(loss, norm) for loss, norm in state["pending"]]
        self._pending, self._window = [], []


@dataclass
class _Pending:
    """What a step keeps for the SpikeScore until a logging step reads it: its micro-batch losses, the factor of
    their mean, the gradient norm and the accumulation scale the norm is still to be multiplied by."""

    losses: list[Tensor]
    factor: float
    norm: Tensor | None
    scale: Tensor | None


@dataclass
class Reading:
    """A logging step's signals on the host.

    Attributes:
        step: the optimizer step they were measured at.
        values: per ``(signal, module)`` the value (``module`` empty for a signal with one value per step).
        concerned: for a signal with one value per step, the module it points at (the output module for log Z, the
            module with the largest update ratio for the spread), where there is one.
    """

    step: int
    values: dict[tuple[str, str], float] = field(default_factory=dict)
    concerned: dict[str, str] = field(default_factory=dict)
    #: The number of outputs of the output module (log Z of a uniform prediction: its log), once seen.
    classes: int | None = None

    def baseline(self, signal: str) -> float:
        """What the detector's rules for ``signal`` are taken above: ``log(n)`` for log Z over ``n`` outputs."""
        return math.log(self.classes) if signal in LOG_SIGNALS and self.classes else 0.0

    def add(self, signal: str, module: str, value: float, concerned: str | None = None) -> None:
        self.values[(signal, module)] = value
        if concerned:
            self.concerned[signal] = concerned

    def metrics(self) -> dict[str, float]:
        """The logged keys (:func:`signal_key`) and their values."""
        return {signal_key(signal, module): value for (signal, module), value in self.values.items()}


def signal_key(signal: str, module: str = "") -> str:
    """The logged key of a signal: ``signals/<signal>``, then ``/<module>`` for a per-module one.

    Example::

        >>> signal_key("attn_logit_max", "blocks.0.attn"), signal_key("spike_score")
        ('signals/attn_logit_max/blocks.0.attn', 'signals/spike_score')
    """
    return PREFIX + signal + (f"/{module}" if module else "")


@dataclass
class _Reduced:
    """A logging step's signals on the host: the summed (``s``), maximized (``m``) and plain (``p``) values, and where
    each signal's values sit in them."""

    attention: dict[str, slice]
    logz: tuple[slice, slice, slice] | None = None
    adam: list[tuple[list[str], slice]] = field(default_factory=list)
    ratios: list[tuple[list[str], slice]] = field(default_factory=list)
    pending: list[_Pending] = field(default_factory=list)
    s: list[float] = field(default_factory=list)
    m: list[float] = field(default_factory=list)
    p: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)


class _Pack:
    """Device values gathered into one flat fp32 vector; :meth:`add` returns each value's slice of it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.parts: list[Tensor] = []
        self.size = 0

    def add(self, value: Tensor) -> slice:
        flat = value.detach().reshape(-1).float().to(self.device)
        self.parts.append(flat)
        self.size += flat.numel()
        return slice(self.size - flat.numel(), self.size)

    def vector(self) -> Tensor:
        return torch.cat(self.parts) if self.parts else torch.zeros(0, device=self.device)


#: The names an output module goes by (the last part of its qualified name), when the model does not say.
_OUTPUT_NAMES = ("lm_head", "head", "output", "classifier", "fc", "decoder", "logits", "out")


def output_module(model: nn.Module, named: list[tuple[str, nn.Module]]) -> str | None:
    """The module that returns the output logits: what the outermost model that has ``get_output_embeddings``
    (Hugging Face) returns, else the last ``nn.Linear`` named as an output module is (:data:`_OUTPUT_NAMES`: GPT's
    ``lm_head``, torchvision's ``fc``, timm's ``head``, ...); ``None`` when there is none.

    Example::

        >>> from torch import nn
        >>> net = nn.Sequential()
        >>> net.add_module("body", nn.Linear(4, 8))
        >>> net.add_module("fc", nn.Linear(8, 3))
        >>> output_module(net, list(net.named_modules()))
        'fc'
    """
    names = {id(m): n for n, m in named}
    for _, module in named:
        get = getattr(module, "get_output_embeddings", None)
        if callable(get):
            found = get()
            if isinstance(found, nn.Module) and id(found) in names:
                return names[id(found)]
    linear = [n for n, m in named if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in _OUTPUT_NAMES]
    return linear[-1] if linear else None
