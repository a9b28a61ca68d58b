"""Unit-wise adaptive gradient clipping (AGC) as a plain torch object, on the step's one read of the gradients.

:func:`agc_coefficients` is the paper's rule on unit norms; :class:`AdaptiveGradClip` is the clipper: it asks the
pipeline (:mod:`gradkit.step.pipeline`) for the unit-wise gradient norms of the parameters it selects, reads the weights
once for theirs, and writes one coefficient per unit into the step's decision. What it keeps of its steps for logging
and checkpoints is a :class:`~gradkit.policies.clipping.ClipLedger`, as every clipper's.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from gradkit._util.arguments import check_float
from gradkit.policies.clipping import (
    NORM_EPS,
    ClipDecision,
    ClipLedger,
    LedgerHooks,
    describe,
    norm_ratio,
)
from gradkit.step.norms import (
    ParamIndex,
    host_to_device,
    local_tensor,
    per_tensor_norms,
    reduce_sharded,
    row_norms,
    total_norm,
    world_size,
)
from gradkit.step.params import clean_name, replication
from gradkit.step.plan import Decision, StepStats
from gradkit.step.protocol import Door, Stage, StatsRequest, StepContext
from gradkit.step.selection import NamePattern, no_match_hint, parameters_selected, parse_patterns
from gradkit.step.write import measure_grads

__all__ = ["AdaptiveGradClip", "agc_coefficients", "select_parameters"]


def agc_coefficients(grad_norms: Tensor, weight_norms: Tensor, clip_factor: float, eps: float = 1e-3) -> Tensor:
    """Unit-wise AGC coefficients: ``min(1, clip_factor * max(|W_i|, eps) / max(|G_i|, 1e-6))``.

    Brock et al. 2021, "High-Performance Large-Scale Image Recognition Without Normalization", eq. 3: a unit's
    gradient is rescaled when ``|G_i| / max(|W_i|, eps) > clip_factor``. The ``eps`` floor lets zero-initialised
    units (e.g. a zeroed last layer of a residual branch) still update. Multiplying by these coefficients gives
    bit-for-bit the result of ``timm.utils.agc.adaptive_clip_grad``.

    A unit is a row along dim 0 of a weight (an output unit: :func:`gradkit.functional.unit_norms`), or a
    whole bias, gain or scalar (its norm).

    Args:
        grad_norms: unit-wise norms of the gradients (any shape).
        weight_norms: unit-wise norms of the weights, same shape.
        clip_factor: the ``lambda`` of the paper.
        eps: floor of the weight norm.
    """
    max_norm = weight_norms.clamp(min=eps) * clip_factor
    return torch.clamp(max_norm / grad_norms.clamp(min=NORM_EPS), max=1.0)


class _Lazy:
    """``fn(*args)``, worked out on the first call (a logging step) and kept; picklable when ``fn`` and ``args`` are.

    Example::

        >>> import operator
        >>> total = _Lazy(operator.add, torch.tensor(1.0), torch.tensor(2.0))
        >>> total()
        tensor(3.)
    """

    def __init__(self, fn: Callable[..., Tensor], *args: Any) -> None:
        self._fn = fn
        self._args = args
        self._value: Tensor | None = None

    def __call__(self) -> Tensor:
        if self._value is None:
            self._value = self._fn(*self._args)
        return self._value


class AdaptiveGradClip(LedgerHooks):
    r"""Unit-wise adaptive gradient clipping (AGC).

    Brock, De, Smith, Simonyan, "High-Performance Large-Scale Image Recognition Without Normalization" (ICML 2021),
    as in ``timm.utils.agc``: for every output unit ``i`` of a parameter (a row of a linear weight, an output channel
    of a conv; a bias or gain is one unit), the gradient is rescaled when
    ``|G_i| / max(|W_i|, eps) > clip_factor``, to ``clip_factor * max(|W_i|, eps) / |G_i| * G_i``. The ``eps`` floor
    lets zero-initialised parameters still update. The paper does not clip the final classifier: name it in
    ``exclude``. Defaults ``clip_factor=0.01``, ``eps=1e-3`` are the paper's and timm's.

    The unit-wise gradient norms are measured in the pipeline's single read of the gradients (the per-parameter
    norms of the shared statistics are derived from them); the weights are read once for their unit norms. Under
    FSDP2 (``fully_shard``, dim-0 sharding) each rank clips its own rows; the norms of sharded 1-D parameters travel
    in the step's single all-reduce. FSDP1 flattens parameters, which loses the units: not supported. A sparse
    gradient (``nn.Embedding(sparse=True)``) is clipped row by row from the norms of its coalesced rows. Frozen
    parameters are selected too, so a module unfrozen during the fit (``BackboneFinetuning``) is clipped from the
    step it joins.

    Logs the keys of :class:`~gradkit.ClipGradNorm` (2-norms; ``grad_clip/coef`` is post / pre), a step
    counting as clipped when any unit (on rank 0, under sharding) was rescaled; writes no events.

    Args:
        clip_factor: the ``lambda`` of the paper, > 0.
        eps: floor of the unit weight norm, > 0.
        exclude: parameters left unclipped, in gradkit's selection grammar (:mod:`gradkit.step.selection`):
            module class names (``"Linear"``, matching subclasses; every parameter inside such a module) or
            ``"re:<regex>"`` patterns that match the whole qualified name of a parameter or of a module that holds it
            (``"re:head"``, ``"re:lm_head"``, ``"re:.*\.bias"``); one string is one pattern. Default: none, so the
            final layer is clipped too, unlike the paper and timm's training script: name it here.

    Raises:
        ValueError: at construction, for non-positive ``clip_factor`` or ``eps`` or an invalid regex; when attached to
            a model, for an ``exclude`` pattern that matches no parameter.
        RuntimeError: when attached, under FSDP1 or for a parameter sharded along a dimension other than 0.

    Example::

        >>> from gradkit import AdaptiveGradClip
        >>> clipper = AdaptiveGradClip(clip_factor=0.01, exclude=["re:head"])
    """

    stage = Stage.CLIP
    norm_type = 2.0
    _REDUCE_KEY = "AdaptiveGradClip/sharded_weight_sq"

    def __init__(self, clip_factor: float = 0.01, eps: float = 1e-3, exclude: list[str] | None = None) -> None:
        self.clip_factor = check_float("clip_factor", clip_factor, above=0.0)
        self.eps = check_float("eps", eps, above=0.0)
        self._exclude = parse_patterns("exclude", exclude)
        self.exclude = [pattern.text for pattern in self._exclude]
        self._ledger = ClipLedger()
        self._selected: set[str] | None = None
        self._sharded_1d: list[tuple[str, Tensor, float]] = []
        self._sharded_1d_factors: Tensor | None = None
        self._cache: dict[tuple[Any, ...], Any] = {}
        self._cache_index: ParamIndex | None = None

    def __repr__(self) -> str:
        return describe(self, clip_factor=self.clip_factor, eps=self.eps, exclude=self.exclude)

    def attach(self, ctx: Door, model: torch.nn.Module) -> None:
        """Select the clipped parameters of ``model`` (configured: sharded, wrapped) and check their sharding."""
        if ctx.flat_sharded():
            raise RuntimeError(
                "AdaptiveGradClip needs every parameter in its original shape to find its output units, and FSDP1 "
                "(`strategy='fsdp'`) flattens them into shards. Use FSDP2 (`ModelParallelStrategy` with "
                "`fully_shard` in `configure_model`) or a norm-based clipper such as ClipGradNorm."
            )
        self._selected = select_parameters(model, self._exclude)
        self._sharded_1d = []
        self._sharded_1d_factors = None
        self._cache = {}
        self._cache_index = None
        for name, param in model.named_parameters():
            name = clean_name(name)
            placements = getattr(param, "placements", None)
            if name not in self._selected or placements is None:
                continue
            # Every placement that splits the tensor: `is_shard()` misses `_StridedShard` (FSDP2 over TP).
            sharded_dims = {p.dim for p in placements if not p.is_replicate() and hasattr(p, "dim")}
            if param.ndim > 1 and sharded_dims - {0}:
                raise RuntimeError(
                    f"AdaptiveGradClip: parameter `{name}` is sharded along dim(s) {sorted(sharded_dims)}; its output "
                    f"units (dim 0) are split across ranks. Exclude it (`exclude=['re:{re.escape(name)}']`) or shard "
                    "it along dim 0 only (FSDP2's default)."
                )
            if param.ndim <= 1 and sharded_dims:
                self._sharded_1d.append((name, param, 1.0 / replication(param)))

    def request_stats(self, request: StatsRequest) -> None:
        request.norm_types.add(2.0)
        if self._selected is not None:
            request.unit_norm_names |= self._selected

    def reduce_request(self, ctx: StepContext) -> dict[str, Tensor]:
        # Sharded biases and gains are one unit spread over ranks: their weight norms join the step's all-reduce.
        if not self._sharded_1d or world_size() == 1:
            return {}
        weights = [local_tensor(p.detach()) for _, p, _ in self._sharded_1d]
        if self._sharded_1d_factors is None:
            factors = [w for _, _, w in self._sharded_1d]
            self._sharded_1d_factors = host_to_device(factors, torch.float32, weights[0].device)
        return {self._REDUCE_KEY: per_tensor_norms(weights, 2.0).pow(2) * self._sharded_1d_factors}

    def decide(self, stats: StepStats, decision: Decision, ctx: StepContext) -> None:
        if stats.has_gradients:
            self._ledger.record(stats, decision, self._clip(stats, decision))

    def decide_again(self, stats: StepStats, decision: Decision, first: Decision, ctx: StepContext) -> None:
        # Every evaluation of a re-evaluating closure is clipped unit by unit, from its own gradients.
        if stats.has_gradients:
            self._clip(stats, decision)

    # -- one step ------------------------------------------------------------------------------------------------
    def _cached(self, stats: StepStats, key: tuple[Any, ...]) -> Any:
        """A value cached for the step's parameter index; the cache is emptied when the index is rebuilt (parameters
        joined or left the optimizer)."""
        if stats.index is not self._cache_index:
            self._cache = {}
            self._cache_index = stats.index
        return self._cache.get(key)

    def _one_dim_positions(self, stats: StepStats) -> tuple[list[int], Tensor | None, list[int]]:
        """Selected parameters with at most one dim that have a gradient, an index tensor of them, and for each the
        slot of its reduced weight norm (-1: not sharded). Cached: the set only changes when gradients go missing."""
        key = ("one_dim", tuple(stats.present))
        cached = self._cached(stats, key)
        if cached is None:
            assert self._selected is not None
            index = stats.index
            slots = {name: k for k, (name, _, _) in enumerate(self._sharded_1d)}
            positions = [i for i in stats.present if index.params[i].ndim <= 1 and index.names[i] in self._selected]
            tensor = host_to_device(positions, torch.long, index.shard_weight.device) if positions else None
            cached = self._cache[key] = (positions, tensor, [slots.get(index.names[i], -1) for i in positions])
        return cached

    def _clip(self, stats: StepStats, decision: Decision) -> ClipDecision:
        """Write one coefficient per unit into the decision (``param_coefs``); the clip for the logs."""
        if self._selected is None:
            raise RuntimeError(
                "AdaptiveGradClip was not attached to a model: its `attach(ctx, model)` selects the clipped "
                "parameters (every door calls it: the Trainer at `fit`, `GradKit(...)` when built)."
            )
        index = stats.index
        grads = stats.norms[2.0]
        units = stats.unit_norms
        pos_nd = units.positions if units is not None else []
        pos_1d, pos_1d_tensor, reduced_slots = self._one_dim_positions(stats)
        if not pos_nd and not pos_1d:
            pre = decision.scaled(grads.total)
            return ClipDecision(pre, pre, functools.partial(torch.ones_like, pre), torch.zeros((), dtype=torch.bool))

        grad_parts: list[Tensor] = []
        weight_parts: list[Tensor] = []
        if units is not None:
            grad_parts.append(units.flat)
            weight_parts.extend(row_norms(local_tensor(index.params[i].detach())) for i in pos_nd)
        if pos_1d_tensor is not None:
            grad_parts.append(grads.param_norms[pos_1d_tensor])
            weight_parts.append(self._one_dim_weight_norms(stats, pos_1d, reduced_slots))
        grad_units = decision.scaled(torch.cat(grad_parts))
        coefs = agc_coefficients(grad_units, torch.cat(weight_parts), self.clip_factor, self.eps)

        sizes = (units.sizes if units is not None else []) + [1] * len(pos_1d)
        pieces = list(coefs.split(sizes))
        for k, shape in self._coef_shapes(stats, pos_nd, pos_1d):
            pieces[k] = pieces[k].view(shape)
        pre = decision.scaled(grads.total)
        post = _Lazy(
            _post_clip_total,
            index,
            decision.scale,
            grads.param_norms,
            grad_units,
            coefs,
            pos_nd,
            sizes,
            pos_1d_tensor,
            self._sharded_nd(stats),
        )
        if stats.index.pp is not None:
            # Pipeline parallelism: the other stages' units are not here. The clipped gradients are measured once
            # (logging steps, after the write), every stage's through the reduction.
            post = _Lazy(_measured_post_clip_total, stats)
        # The clipper's own post-clip total stands for the primary norm type's only.
        per_param = dict(zip([*pos_nd, *pos_1d], pieces, strict=True))
        decision.clip_per_param(per_param, post if stats.primary_norm_type == 2.0 else None)
        return ClipDecision(pre, post, functools.partial(norm_ratio, post, pre), clipped=(coefs < 1).any())

    def _sharded_nd(self, stats: StepStats) -> Tensor | None:
        """Positions of the selected parameters of several dims that are sharded or declared expert-parallel
        (cached per index): their post-clip units count through the ranks that hold their gradients, so a rank
        without one (its experts got no token) leaves them out of its own sum too."""
        cached = self._cached(stats, ("sharded_nd",))
        if cached is None:
            assert self._selected is not None
            index = stats.index
            positions = [
                i for i in index.sharded_positions if index.params[i].ndim > 1 and index.names[i] in self._selected
            ]
            tensor = host_to_device(positions, torch.long, index.shard_weight.device) if positions else None
            cached = self._cache[("sharded_nd",)] = (tensor,)
        return cached[0]

    def _coef_shapes(self, stats: StepStats, pos_nd: list[int], pos_1d: list[int]) -> list[tuple[int, tuple[int, ...]]]:
        """``(k, shape)`` for the coefficient pieces that need a view to broadcast over their gradient: unit-wise ones
        of parameters with more than one dim, and scalar parameters (cached per layout; other pieces, of shape
        ``(1,)``, broadcast as they are)."""
        key = ("shapes", tuple(pos_nd), tuple(pos_1d))
        shapes = self._cached(stats, key)
        if shapes is None:
            ndims = {i: stats.index.params[i].ndim for i in stats.present}  # a gradient has its parameter's shape
            shapes = [(k, (-1,) + (1,) * (ndims[i] - 1)) for k, i in enumerate(pos_nd)]
            shapes += [(len(pos_nd) + k, ()) for k, i in enumerate(pos_1d) if ndims[i] == 0]
            self._cache[key] = shapes
        return shapes

    def _one_dim_weight_norms(self, stats: StepStats, positions: list[int], reduced_slots: list[int]) -> Tensor:
        local = per_tensor_norms([local_tensor(stats.index.params[i].detach()) for i in positions], 2.0)
        reduced = stats.reduced.get(self._REDUCE_KEY)
        if reduced is None or all(s < 0 for s in reduced_slots):
            return local
        parts = [reduced[s].sqrt() if s >= 0 else local[k] for k, s in enumerate(reduced_slots)]
        return torch.stack(parts)


def _measured_post_clip_total(stats: StepStats) -> Tensor:
    """The 2-norm of the clipped gradients, read again from the parameters once the step's write is done (pipeline
    parallelism: every stage's, through the reduction)."""
    return total_norm(measure_grads(stats, 2.0), 2.0)


def _post_clip_total(
    index: ParamIndex,
    scale: Tensor | None,
    param_norms: Tensor,
    grad_units: Tensor,
    coefs: Tensor,
    pos_nd: list[int],
    sizes: list[int],
    pos_1d: Tensor | None,
    sharded_nd: Tensor | None = None,
) -> Tensor:
    """Total 2-norm after the clip, from the unit norms: no read of the gradients (logging steps only).

    Unit norms of multi-dimensional parameters are local to a rank under FSDP2 and expert parallelism: their squares
    are summed across ranks (one scalar all-reduce, which every rank joins, also one without such a gradient); all
    other norms here are already global. ``sharded_nd`` are the positions of such parameters that AGC clips, present
    here or not (a rank whose experts got no token has no gradient for them, which the others count). ``scale`` is
    the step's accumulation scale (``Decision.scale``), which ``grad_units`` already carry and the per-parameter
    ``param_norms`` do not.
    """
    post_units = grad_units * coefs
    device = post_units.device
    n_nd = sum(sizes[: len(pos_nd)])
    sq_nd = post_units[:n_nd].square()
    sq_global = post_units[n_nd:].square().sum()
    clipped_mask = torch.zeros(index.num_params, dtype=torch.bool, device=device)
    sharded = torch.zeros((), dtype=post_units.dtype, device=device)
    if pos_nd:
        per_param = torch.stack([s.sum() for s in sq_nd.split(sizes[: len(pos_nd)])])
        nd_tensor = host_to_device(pos_nd, torch.long, device)
        weight = index.shard_weight[nd_tensor]
        sq_global = sq_global + (per_param * (weight == 0)).sum()
        sharded = (per_param * weight).sum()
        clipped_mask[nd_tensor] = True
    if sharded_nd is not None:  # the same on every rank: each joins the all-reduce, with or without gradients
        sharded = reduce_sharded(index, {}, {"sharded": sharded})[1]["sharded"]
        clipped_mask[sharded_nd] = True
    sq_global = sq_global + sharded
    if pos_1d is not None:
        clipped_mask[pos_1d] = True
    others = (param_norms if scale is None else param_norms * scale).square() * ~clipped_mask
    return (sq_global + others.sum()).sqrt()


def select_parameters(model: torch.nn.Module, exclude: tuple[NamePattern, ...]) -> set[str]:
    """Names (cleaned) of the parameters not selected by any ``exclude`` pattern, frozen ones included.

    A frozen parameter may be unfrozen during the fit (``BackboneFinetuning``): it is then clipped like the others.
    Only the parameters an optimizer steps are ever clipped, so selecting frozen ones costs nothing.

    Raises:
        ValueError: naming a pattern that selects no parameter, the names nearest to it and a pattern that would.
    """
    params = [clean_name(n) for n, _ in model.named_parameters()]
    modules = [(clean_name(n), m) for n, m in model.named_modules()]
    excluded: set[str] = set()
    for pattern in exclude:
        matched = parameters_selected(pattern, modules, params)
        if not matched:
            names = [name for name, _ in modules if name] + params
            hint = no_match_hint(pattern, names, [type(m).__name__ for _, m in modules])
            raise ValueError(
                f"AdaptiveGradClip: `exclude` pattern '{pattern.text}' matches no trainable parameter of "
                f"`{type(model).__name__}`, nor a frozen one: {hint}"
            )
        excluded |= matched
    return set(params) - excluded
