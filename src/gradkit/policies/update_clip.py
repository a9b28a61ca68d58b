r"""Clip the update an optimizer step makes: :class:`UpdateClip` rescales ``w - w_before`` when its norm goes over the
mean plus ``sigma_factor`` standard deviations of its recent history (Levanter's ``clip_update_norm``, which Marin's
32B run used). Pure PyTorch; the ``Trainer`` callback of the same name is :class:`lightning_gradkit.UpdateClip`.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from gradkit._util.arguments import check_bool, check_float, check_int
from gradkit.step.norms import (
    ParamIndex,
    grouped_norms,
    host_to_device,
    local_tensor,
    per_tensor_norms,
    reduce_sharded,
    total_norm,
)
from gradkit.step.params import clean_name
from gradkit.step.plan import StepOutcome, StepStats
from gradkit.step.protocol import Door, Stage, StepContext, state_key, unwrapped
from gradkit.step.selection import (
    NamePattern,
    auto_module_keys,
    module_rows,
    parse_patterns,
    refuse_unmatched,
    repeated_blocks,
)

__all__ = ["UpdateClip", "clip_against_history", "history_threshold"]

#: Levanter's floors: the standard deviation of the history and the norm a coefficient divides by.
STD_FLOOR = 1e-6
NORM_FLOOR = 1e-6
#: The row of the parameters no ``modules`` pattern selects.
REST = "rest"


def history_threshold(history: Tensor, count: Tensor, sigma_factor: float, warmup: int) -> Tensor:
    """Per row of ``history`` (``[rows, size]``, NaN: an empty slot), ``mean + sigma_factor * max(std, 1e-6)`` of its
    norms (population standard deviation), ``inf`` while a row holds fewer than ``warmup`` norms. ``count`` (``[rows]``)
    is how many norms each row took so far: a ring fills its slots in order, so it holds ``min(count, size)``. No host
    sync.

    Example::

        >>> history_threshold(torch.tensor([[1.0, 3.0, math.nan]]), torch.tensor([2]), 1.0, warmup=2)
        tensor([3.])
    """
    held = count.clamp_max(history.shape[1])
    mean = history.nansum(1) / held
    std = (history - mean[:, None]).square_().nansum(1).div_(held).sqrt_().clamp_min_(STD_FLOOR)
    return torch.where(held >= warmup, mean.add_(std, alpha=sigma_factor), math.inf)


def clip_against_history(
    history: Tensor, count: Tensor, norms: Tensor, skip: Tensor | None, sigma_factor: float, warmup: int
) -> tuple[Tensor, Tensor]:
    """One step of the rule, per row: the coefficient ``min(1, threshold / max(norm, 1e-6))`` (1 for a norm at or
    under :func:`history_threshold`, or not finite), then the norm written into the row's ring, unless it is not
    finite, is 0 (the step did not move) or ``skip`` (a policy skipped the step).

    Args:
        history: ``[rows, size]`` the last norms of each row (NaN: an empty slot), updated in place.
        count: ``[rows]`` how many norms each row took so far (its ring position), updated in place.
        norms: ``[rows]`` this step's update norms.
        skip: a bool device scalar, or ``None`` where no policy may skip.
        sigma_factor: ``k`` of ``mean + k * std``.
        warmup: how many norms a row holds before it clips.

    Returns:
        ``(coef, threshold)``, ``[rows]`` device tensors.
    """
    threshold = history_threshold(history, count, sigma_factor, warmup)
    finite = norms < math.inf  # NaN too is not
    coef = torch.where((norms > threshold) & finite, threshold / norms.clamp_min(NORM_FLOOR), 1.0)
    joins = (norms > 0) & finite
    if skip is not None:
        joins = joins & ~skip.to(joins.device)
    slot = (count % history.shape[1]).unsqueeze_(1)
    kept = history.gather(1, slot)
    history.scatter_(1, slot, torch.where(joins.unsqueeze(1), norms.unsqueeze(1), kept))
    count.add_(joins)
    return coef, threshold


@dataclass
class _History:
    """One optimizer's history: per row (the whole model, or a module), a ring of its last norms and its count."""

    rows: list[str]
    norms: Tensor
    count: Tensor


@dataclass(eq=False)
class _Layout:
    """One optimizer's parameters as UpdateClip reads them, built once per parameter index: the row of each parameter,
    the (row, run) buckets of the rescale, the param group of each (its learning rate) and the snapshot buffers."""

    index: ParamIndex
    rows: list[str]
    row_of: Tensor | None  # per parameter its row (device), None: one row
    buckets: list[tuple[int, list[Tensor]]]  # (row, buffers of one (device, dtype) run in that row)
    group_of: list[int]
    before: list[Tensor] = field(default_factory=list)


@dataclass
class _Pending:
    """A step between its snapshot (``observe``) and the optimizer's return: what the rescale needs."""

    layout: _Layout
    skip: Tensor | None
    inverse_lr: Tensor | float
    logging: bool
    suffix: str


class UpdateClip:
    r"""Clip the update of each optimizer step, ``u = w - w_before``, by its norm against the mean plus ``sigma_factor``
    standard deviations of its recent history: Levanter's ``clip_update_norm`` (``ClipUpdateNormConfig``,
    ``clip_update_by_historical_norm``), which Marin's 32B run used (``sigma_factor=2.0``, 128 steps).

    **The rule** (Levanter's). After the step, ``n = ||u||_2`` over every parameter of the optimizer. The threshold is
    ``mean + sigma_factor * max(std, 1e-6)`` of the last ``history_size`` norms (population standard deviation); when
    ``n`` exceeds it the update is scaled by ``c = threshold / max(n, 1e-6)``, so the parameters become
    ``w_before + c * u``; otherwise they are left bit for bit. Nothing acts until the history holds ``warmup_steps``
    norms (Levanter: ``max(2, history_size // 2)``). The norm enters the history unclipped, so a lasting rise is
    absorbed instead of clipped forever. The optimizer's state (Adam's moments, momentum) is not touched, as in
    Levanter, where the clip is a transform of the update chained after ``scale_by_adam``.

    **What is measured.** With ``divide_by_lr`` (the default) each parameter's update is divided by its param
    group's learning rate before the norm is taken: Levanter's transform sits before ``scale(-learning_rate)``, so its
    norms are those of the step's direction (``m / (sqrt(v) + eps) + weight_decay * w`` for AdamW) and the threshold
    does not follow the LR schedule (warm-up, decay, a re-warm-up). ``divide_by_lr=False`` measures ``w - w_before``
    itself. A group whose learning rate is 0 contributes nothing.

    **Globally or per module.** ``modules=None`` takes one norm over the whole update (Levanter). ``"auto"`` gives
    each row of ``GradNormMonitor(depth="auto")`` (each repeated block, each other top-level module) its own norm,
    history and coefficient; a list of class names or ``re:`` patterns (:mod:`gradkit.step.selection`) gives each
    selected module one, and every parameter outside them one more row, ``rest``.

    **Where this differs from Levanter.** A norm that is not finite, a zero norm (a step that did not move: a guard
    skipped it through a fused kernel's ``found_inf``, a learning rate of 0) and the norm of a step a policy skipped
    (``NonFiniteGuard``, ``SpikeGuard``, ...) never enter the history; Levanter's takes every norm, and one ``Inf``
    would disable it for ``history_size`` steps. A non-finite update is not clipped (a guard's job). Per-module rows,
    ``warmup_steps`` and ``divide_by_lr=False`` are additions; each optimizer has its own history. The rescale is
    written ``w + (1 - c) (w_before - w)``, within one rounding of ``w_before + c u`` and exactly ``w`` when ``c = 1``.

    **Cost.** A copy of the optimizer's parameters, kept between steps (the parameters' bytes once more). Per step,
    one ``_foreach`` pass per (device, dtype) run before the step (the copy) and four after it (subtract, norm,
    multiply, add; per module, the multiply is one call per module and run), and about 35 small operations for the
    rule: no host sync, and a number of launches that does not grow with the number of tensors (measured in
    ``benchmarks/bench_update_clip.py``). A fused optimizer cannot take the clip into its kernel as it takes a
    gradient clip (its ``grad_scale`` scales the gradient its moments are built from, not the update), so the same
    passes run after it. Under FSDP the per-parameter norms of the local shards are summed over ranks in one
    all-reduce (as ``GradNormMonitor``'s update ratio); under DDP every rank makes the same update and the same
    decision, with no collective.

    **Logged** on logging steps only: ``update_clip/norm``, ``update_clip/threshold`` (``inf`` during warm-up) and
    ``update_clip/coef`` (per module, ``/<module>`` appended; ``/opt{i}`` with several optimizers); a step that did not
    run logs a norm of 0 and a coefficient of 1. The clip acts before any other policy reads the update
    (``GradNormMonitor``'s update ratio sees the clipped one).

    Args:
        sigma_factor: ``k`` of ``mean + k * std`` (> 0); Levanter's default is 3, Marin's 32B run used 2.
        history_size: how many past update norms the statistics cover (>= 2); Levanter's default is 128.
        warmup_steps: how many norms the history holds before the clip acts, in ``[2, history_size]``; ``None``:
            ``max(2, history_size // 2)``, Levanter's rule.
        modules: ``None`` for one norm over the whole update, ``"auto"`` for one per module row, or class names and
            ``re:`` patterns of the modules that each get their own norm.
        divide_by_lr: measure the update divided by its param group's learning rate (Levanter's norm).
        log_every_n_steps: how often to log, in optimizer steps; defaults to the loop's period (the clip runs every
            step).

    Raises:
        ValueError: at construction, naming the argument; at ``attach``, a ``modules`` pattern that selects no module;
            at ``load_state_dict`` or the first step after it, a history saved with another ``history_size`` or other
            rows.

    Example::

        >>> import torch
        >>> from gradkit import GradKit, UpdateClip
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Linear(4, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> clip = UpdateClip(history_size=4)
        >>> kit = GradKit(model, optimizer, clip, log_dir=False)
        >>> for scale in (1.0, 1.1, 0.9, 1.0, 100.0):  # the last batch's update is a spike
        ...     model(torch.ones(2, 4) * scale).sum().backward()
        ...     _ = kit.step(optimizer)
        ...     optimizer.zero_grad()
        >>> clip.last_coef() < 0.1
        True
    """

    stage = Stage.OBSERVE

    def __init__(
        self,
        sigma_factor: float = 3.0,
        history_size: int = 128,
        warmup_steps: int | None = None,
        modules: list[str] | Literal["auto"] | None = None,
        divide_by_lr: bool = True,
        log_every_n_steps: int | None = None,
    ) -> None:
        self.sigma_factor = check_float("sigma_factor", sigma_factor, above=0.0, hint="Levanter uses 3.0.")
        self.history_size = check_int("history_size", history_size, 2, hint="Levanter uses 128 (steps).")
        if warmup_steps is not None:
            check_int(
                "warmup_steps",
                warmup_steps,
                2,
                self.history_size,
                hint=f"It counts norms in the history (`history_size={self.history_size}`); None: Levanter's "
                "`max(2, history_size // 2)`.",
            )
        self.warmup_steps = warmup_steps
        self.modules = modules
        self._patterns: tuple[NamePattern, ...] = ()
        if modules is not None and modules != "auto":
            self._patterns = parse_patterns("modules", modules, allow_empty=False)
        self.divide_by_lr = check_bool("divide_by_lr", divide_by_lr)
        if log_every_n_steps is not None:
            check_int("log_every_n_steps", log_every_n_steps, 1, hint="None follows the loop's logging period.")
        self.log_every_n_steps = log_every_n_steps
        self._selected: list[str] = []  # the modules the patterns select (outermost), cleaned names
        self._blocks: list[str] = []
        self._model_order: list[str] = []
        self._layouts: dict[int, _Layout] = {}
        self._histories: dict[int, _History] = {}
        self._pending: dict[int, _Pending] = {}
        self._handles: dict[int, RemovableHandle] = {}
        self._metrics: dict[int, dict[str, Tensor]] = {}
        self._last_coef: dict[int, Tensor] = {}

    @property
    def state_key(self) -> str:
        return state_key(self)

    @property
    def warmup(self) -> int:
        """The norms a history holds before the clip acts (``warmup_steps``, or Levanter's rule)."""
        return self.warmup_steps if self.warmup_steps is not None else max(2, self.history_size // 2)

    def last_coef(self, optimizer_idx: int = 0) -> float:
        """The smallest coefficient of the optimizer's last step (1.0: not clipped; reads the device)."""
        coef = self._last_coef.get(optimizer_idx)
        return 1.0 if coef is None else float(coef.min())

    def __getstate__(self) -> dict[str, Any]:
        # The snapshot buffers and the step in flight are rebuilt at the next step: a copy does not carry a copy of
        # the parameters (the optimizer's hooks do not survive a pickle either).
        return {**self.__dict__, "_layouts": {}, "_pending": {}, "_handles": {}}

    # -- the model ----------------------------------------------------------------------------------------------
    def attach(self, ctx: Door, model: nn.Module) -> None:
        """Read the model's module names (the rows).

        Raises:
            ValueError: a ``modules`` pattern that selects no module.
        """
        named = [(clean_name(n), m) for n, m in model.named_modules()]
        self._model_order = [clean_name(n) for n, _ in model.named_parameters()]
        self._blocks = repeated_blocks(named) if self.modules == "auto" else []
        self._selected = self._select(named) if self._patterns else []
        self._layouts = {}

    def _select(self, named: list[tuple[str, nn.Module]]) -> list[str]:
        chosen: list[str] = []
        for name, module in named:
            inside = any(name.startswith(c + ".") or not c for c in chosen)
            if not inside and any(p.matches_module(name, module) for p in self._patterns):
                chosen.append(name)
        refuse_unmatched("modules", self._patterns, named, named)
        return chosen

    def detach(self, ctx: StepContext | None = None) -> None:
        """Drop the step in flight (its hook on the optimizer) and the snapshot buffers."""
        for idx in list(self._handles):
            self._release(idx)
        self._layouts = {}

    def _release(self, idx: int) -> _Pending | None:
        """Remove optimizer ``idx``'s post-step hook (not from inside it: the optimizer is iterating over its hooks);
        the step still pending, if its optimizer did not step."""
        handle = self._handles.pop(idx, None)
        if handle is not None:
            handle.remove()
        return self._pending.pop(idx, None)

    # -- the step -----------------------------------------------------------------------------------------------
    def observe(self, stats: StepStats, outcome: StepOutcome, ctx: StepContext) -> None:
        """An optimizer step is about to run: copy its parameters, and rescale its update once it returns."""
        if not stats.has_gradients:
            return  # nothing for the optimizer to step
        suffix = f"/opt{stats.optimizer_idx}" if len(ctx.optimizers) > 1 else ""
        logging = ctx.is_logging_step(self.log_every_n_steps)
        skip = outcome.decision.skip
        self._arm(unwrapped(stats.optimizer), stats.optimizer_idx, stats.index, skip, logging, suffix)

    def _arm(
        self, optimizer: Optimizer, idx: int, index: ParamIndex, skip: Tensor | None, logging: bool, suffix: str
    ) -> None:
        layout = self._layout(idx, index, optimizer)
        with torch.no_grad():
            params = [local_tensor(p) for p in index.params]
            for start, stop in index.run_bounds:
                torch._foreach_copy_(layout.before[start:stop], params[start:stop])
        self._release(idx)  # a step armed but never run (a GradScaler's inf): this one replaces it
        inverse = self._inverse_lr(optimizer, layout) if self.divide_by_lr else 1.0
        pending = _Pending(layout, skip, inverse, logging, suffix)
        handle = optimizer.register_step_post_hook(functools.partial(self._after_optimizer_step, idx))
        hooks = getattr(optimizer, "_optimizer_step_post_hooks", None)
        if isinstance(hooks, OrderedDict):
            # First among the step's post-hooks: the monitor's and EarlyWarning's update measurements, registered at
            # their own `observe`, see the clipped update whatever the order of the policies.
            hooks.move_to_end(handle.id, last=False)
        self._handles[idx] = handle
        self._pending[idx] = pending

    def _layout(self, idx: int, index: ParamIndex, optimizer: Optimizer) -> _Layout:
        """The layout of ``index`` (built at its first step), and its history checked against it."""
        layout = self._layouts.get(idx)
        if layout is not None and layout.index is index:
            return layout
        layout = self._layouts[idx] = self._build_layout(index, optimizer)
        device = index.shard_weight.device
        history = self._histories.get(idx)
        if history is None:
            norms = torch.full((len(layout.rows), self.history_size), math.nan, device=device)
            zero = torch.zeros(len(layout.rows), dtype=torch.long, device=device)
            self._histories[idx] = _History(layout.rows, norms, zero)
        elif history.rows != layout.rows:
            raise ValueError(
                f"UpdateClip: the saved history of optimizer {idx} has the rows {history.rows[:4]}, this model "
                f"{layout.rows[:4]}: resume with the `modules` and the model of the saved run."
            )
        else:
            history.norms, history.count = history.norms.to(device), history.count.to(device)
        return layout

    def _build_layout(self, index: ParamIndex, optimizer: Optimizer) -> _Layout:
        names = index.names
        if self.modules is None:
            keys = [""] * len(names)
        elif self.modules == "auto":
            keys = auto_module_keys(names, self._blocks)
        else:
            keys = [next((s for s in self._selected if not s or n.startswith(s + ".")), REST) for n in names]
        rows, row_of = module_rows(keys, names, self._model_order)
        before = [torch.empty_like(local_tensor(p)) for p in index.params]
        buckets: dict[tuple[int, int], list[Tensor]] = {}
        for position, (row, run) in enumerate(zip(row_of, index.run_of, strict=True)):
            buckets.setdefault((row, run), []).append(before[position])
        groups = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        return _Layout(
            index=index,
            rows=rows,
            row_of=None if len(rows) == 1 else host_to_device(row_of, torch.long, index.shard_weight.device),
            buckets=[(row, tensors) for (row, _), tensors in buckets.items()],
            group_of=[groups.get(id(p), 0) for p in index.params],
            before=before,
        )

    def _inverse_lr(self, optimizer: Optimizer, layout: _Layout) -> Tensor | float:
        """``1 / lr`` for every parameter (0 where the learning rate is 0), read before the step (the schedulers step
        after it): a float when one learning rate serves every parameter, else a device vector."""
        lrs = [group["lr"] for group in optimizer.param_groups]
        device = layout.index.shard_weight.device
        if any(isinstance(lr, Tensor) for lr in lrs):  # a tensor learning rate stays on its device
            stacked = torch.stack([torch.as_tensor(lr, dtype=torch.float32).to(device) for lr in lrs])
            inverse = torch.where(stacked > 0, stacked.reciprocal(), 0.0)
            return inverse[layout.index.group_index]
        used = [float(lrs[g]) for g in layout.group_of]
        if len(set(used)) == 1:
            return 1.0 / used[0] if used[0] > 0 else 0.0
        return host_to_device([1.0 / lr if lr > 0 else 0.0 for lr in used], torch.float32, device)

    def _after_optimizer_step(self, idx: int, optimizer: Optimizer, args: tuple[Any, ...], kwargs: Any) -> None:
        """``optimizer.step()`` returned (a ``torch.optim`` step post-hook): measure the update and rescale it."""
        pending = self._pending.pop(idx, None)
        if pending is None:
            return  # a step that did not go through the door's pipeline (its hook goes at `after_step`)
        with torch.no_grad():
            coef, norms, threshold = self._clip(idx, pending)
        self._last_coef[idx] = coef
        if pending.logging:
            self._metrics[idx] = self._named_metrics(pending, norms, threshold, coef)

    def _clip(self, idx: int, pending: _Pending) -> tuple[Tensor, Tensor, Tensor]:
        layout, index = pending.layout, pending.layout.index
        params = [local_tensor(p) for p in index.params]
        before = layout.before
        for start, stop in index.run_bounds:  # the buffers become w_before - w: minus the update
            torch._foreach_sub_(before[start:stop], params[start:stop])
        device = index.shard_weight.device
        local = per_tensor_norms(before, 2.0, index.run_bounds).to(device)
        per_param = reduce_sharded(index, {2.0: local})[0][2.0]
        if isinstance(pending.inverse_lr, Tensor) or pending.inverse_lr != 1.0:
            per_param = per_param * pending.inverse_lr
        if layout.row_of is None:
            norms = total_norm(per_param, 2.0).reshape(1)
        else:
            norms = grouped_norms(per_param, layout.row_of, len(layout.rows), 2.0)
        history = self._histories[idx]
        coef, threshold = clip_against_history(
            history.norms, history.count, norms, pending.skip, self.sigma_factor, self.warmup
        )
        shrink = 1.0 - coef  # w += (1 - c) (w_before - w): exactly w where c = 1
        for row, tensors in layout.buckets:
            torch._foreach_mul_(tensors, shrink[row].to(tensors[0].device))
        for start, stop in index.run_bounds:
            torch._foreach_add_(params[start:stop], before[start:stop])
        return coef, norms, threshold

    def _named_metrics(self, pending: _Pending, norms: Tensor, threshold: Tensor, coef: Tensor) -> dict[str, Tensor]:
        metrics: dict[str, Tensor] = {}
        for i, row in enumerate(pending.layout.rows):
            tail = (f"/{row}" if row else "") + pending.suffix
            metrics.update(
                {
                    f"update_clip/norm{tail}": norms[i],
                    f"update_clip/threshold{tail}": threshold[i],
                    f"update_clip/coef{tail}": coef[i],
                }
            )
        return metrics

    def after_step(self, ctx: StepContext) -> None:
        """Log a logging step's values (a step that did not run: norm 0, coefficient 1)."""
        for idx in list(self._handles):
            pending = self._release(idx)
            if pending is not None and pending.logging:  # armed, but the optimizer did not step (a skip)
                history = self._histories[idx]
                threshold = history_threshold(history.norms, history.count, self.sigma_factor, self.warmup)
                zeros = torch.zeros_like(threshold)
                self._metrics[idx] = self._named_metrics(pending, zeros, threshold, zeros + 1.0)
        for metrics in self._metrics.values():
            ctx.log(metrics, self.log_every_n_steps)
        self._metrics = {}

    # -- the state ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Per optimizer, the ``rows`` (module names; ``[""]``: the whole model), the ``history`` of each
        (``[rows, history_size]``, NaN: an empty slot) and the ``count`` of norms each took, on the CPU."""
        return {
            "history_size": self.history_size,
            "optimizers": {
                idx: {"rows": list(h.rows), "history": h.norms.detach().cpu(), "count": h.count.detach().cpu()}
                for idx, h in self._histories.items()
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        size = int(state_dict["history_size"])
        if size != self.history_size:
            raise ValueError(
                f"UpdateClip: the saved history holds {size} norms per row but `history_size={self.history_size}`. "
                "Resume with the same `history_size`."
            )
        self._histories = {
            int(idx): _History(list(s["rows"]), s["history"].to(torch.float32).clone(), s["count"].clone())
            for idx, s in state_dict["optimizers"].items()
        }
        self._layouts = {}  # each history is checked against its optimizer's rows at its next step
