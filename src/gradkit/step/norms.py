"""One-pass gradient statistics.

Every optimizer step the gradients are read once: one ``torch._foreach_norm`` per (device, dtype) group gives
the norm of every parameter's gradient as one fp32 vector. Everything else (per-module, per-param-group and
total norms) is derived from that vector with small device ops, so no consumer ever reads the gradients again. The
exact finite flag is not: an fp32 sum of squares overflows on finite elements (one of 3e19), so when a policy asks,
the read also says whether an element is NaN or infinite (:func:`checked_norms`: from the same read on the Triton
path, from a second one elsewhere). When gradients are sharded (DTensor under FSDP2, flat shards under FSDP1) the
local p-th powers of all parameters travel in a single all-reduce (:func:`reduce_sharded`; the inf-norm, a maximum,
takes a second one).

Gradients (and losses) that still carry the AMP loss scale are expressed without it through :func:`loss_scale`, the
one reader of a ``GradScaler``'s scale tensor (defined with the other torch private reads in
:mod:`gradkit._util.torch_compat`, importable from here).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from gradkit._util.torch_compat import loss_scale as loss_scale  # re-exported: callers import it here
from gradkit.step._multi_norm import found_nonfinite, multi_tensor_norms
from gradkit.step.host_lag import host_to_device as host_to_device  # re-exported: callers import it here
from gradkit.step.pp_stages import PipelineStages

if TYPE_CHECKING:
    from gradkit.step.replicas import ReplicaCheck

__all__ = [
    "GradStats",
    "ParamIndex",
    "checked_norms",
    "combine_sharded",
    "derive_stats",
    "fill_present",
    "finite_mask",
    "grouped_norms",
    "host_to_device",
    "local_tensor",
    "loss_scale",
    "nonfinite_mask",
    "per_tensor_norms",
    "positions_tensor",
    "powered",
    "reduce_sharded",
    "row_norms",
    "run_bounds",
    "sparse_values",
    "stage_columns",
    "total_norm",
    "unpowered",
    "world_size",
]


def finite_mask(x: Tensor) -> Tensor:
    """``torch.isfinite(x)`` in two device operations instead of four (``isfinite`` is a composite of ``abs``,
    ``ne``, ``eq`` and ``mul``; each is a kernel launch on a GPU): ``x - x`` is exactly 0 for every finite value and
    NaN for a NaN or an infinity.

    Example::

        >>> finite_mask(torch.tensor([1.0, float("inf"), float("nan"), -3e38]))
        tensor([ True, False, False,  True])
    """
    return (x - x) == 0


def nonfinite_mask(x: Tensor) -> Tensor:
    """``~torch.isfinite(x)`` in two device operations (see :func:`finite_mask`)."""
    return (x - x) != 0


def local_tensor(t: Tensor) -> Tensor:
    """The tensor a rank holds: the local shard of a DTensor, the tensor itself otherwise.

    In-place ops on the returned tensor modify the DTensor's storage.
    """
    local = getattr(t, "_local_tensor", None)
    return local if local is not None else t


@functools.lru_cache(maxsize=64)
def positions_tensor(positions: tuple[int, ...], device: torch.device) -> Tensor:
    """An index tensor of ``positions`` on ``device``, made once per layout and copied without a host sync (see
    :func:`host_to_device`)."""
    return host_to_device(positions, torch.long, device)


def fill_present(values: Tensor, present: Sequence[int], size: int) -> Tensor:
    """A ``[size]`` fp32 vector holding ``values`` at the positions ``present`` and 0 elsewhere.

    Spreads the norms of the gradients present at a step over all parameters of the index (a parameter without a
    gradient has norm 0). ``present`` are distinct positions in ascending order, so when all ``size`` of them are
    present ``values`` is returned as it is.

    Example::

        >>> fill_present(torch.tensor([3.0, 4.0]), [0, 2], 3)
        tensor([3., 0., 4.])
    """
    if len(present) == size:
        return values
    full = torch.zeros(size, dtype=torch.float32, device=values.device)
    if present:
        full[positions_tensor(tuple(present), full.device)] = values
    return full


def sparse_values(t: Tensor) -> Tensor:
    """The values of a sparse COO tensor after summing duplicate indices (``coalesce``), as a dense tensor.

    Norms and value clamps of a sparse gradient are those of these values: an uncoalesced tensor may hold one
    index several times (one entry per lookup of an ``nn.Embedding(sparse=True)`` row), and only their sum is the
    gradient. Coalescing is free for a tensor that is already coalesced.
    """
    return t.coalesce()._values()


def _run_norms(run: list[Tensor], norm_type: float, found: list[Tensor] | None) -> Tensor:
    """Norms of tensors that share device and dtype, stacked (:func:`~gradkit.step._multi_norm.multi_tensor_norms`,
    which appends the run's non-finite mark to ``found`` when given).

    On CPU the inf-norm comes from one ``aminmax`` per tensor (``max(max, -min)``): ``_foreach_norm`` has no fused
    CPU kernel and its inf-norm there costs about 7x as much. NaN propagates either way.
    """
    if math.isinf(norm_type) and run[0].device.type == "cpu":
        pairs = [torch.aminmax(t) for t in run]
        norms = torch.maximum(torch.stack([p.max for p in pairs]), torch.stack([p.min for p in pairs]).neg())
        if found is not None:  # a maximum of magnitudes cannot overflow: finite exactly when every element is
            found.append(nonfinite_mask(norms).any().to(torch.float32))
        return norms
    return multi_tensor_norms(run, norm_type, found)


def run_bounds(run_ids: Sequence[object]) -> list[tuple[int, int]]:
    """``(start, stop)`` of each stretch of equal consecutive ids.

    Example::

        >>> run_bounds([0, 0, 1, 1, 1, 2])
        [(0, 2), (2, 5), (5, 6)]
    """
    bounds: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(run_ids) + 1):
        if i == len(run_ids) or run_ids[i] != run_ids[start]:
            bounds.append((start, i))
            start = i
    return bounds


def per_tensor_norms(
    tensors: Sequence[Tensor],
    norm_type: float,
    bounds: Sequence[tuple[int, int]] | None = None,
    found: list[Tensor] | None = None,
) -> Tensor:
    """The p-norm of each tensor, as one fp32 vector on the first tensor's device.

    One multi-tensor call per run of consecutive tensors that share device and dtype (callers keep parameters
    ordered by group): two Triton launches on CUDA, one ``torch._foreach_norm`` elsewhere. Low-precision tensors are
    reduced in fp32; a sparse COO tensor's norm is that of its coalesced values (:func:`sparse_values`). ``bounds``
    (:attr:`ParamIndex.run_bounds`), when the caller knows them, spare inspecting the tensors one by one. ``found``,
    when given, receives each run's non-finite mark (see :func:`checked_norms`).

    Example::

        >>> per_tensor_norms([torch.ones(4), torch.full((3,), 2.0)], 2.0)
        tensor([2.0000, 3.4641])
    """
    if len(tensors) == 0:
        return torch.zeros(0)
    out_device = tensors[0].device
    pieces: list[Tensor] = []
    if bounds is None:
        bounds = run_bounds([(t.device, t.dtype, t.layout) for t in tensors])
    runs = [list(tensors[start:stop]) for start, stop in bounds]
    runs = [[sparse_values(t) for t in run] if run[0].is_sparse else run for run in runs]
    if math.isinf(norm_type):
        # A rank's shard of a small parameter can be empty (FSDP); its inf-norm is 0, not an error.
        runs = [[t if t.numel() else t.new_zeros(1) for t in run] for run in runs]
    for run in runs:
        if run[0].device.type == "cpu" and not math.isinf(norm_type):
            # `multi_tensor_norms`' own path off CUDA, without its dispatch: one `_foreach_norm`.
            low_precision = run[0].dtype in (torch.float16, torch.bfloat16)
            norms = torch.stack(torch._foreach_norm(run, norm_type, dtype=torch.float32 if low_precision else None))
            if found is not None:  # fp32 sums cannot tell an infinite element from an overflow: a second read
                found.append(found_nonfinite(run))
        else:
            norms = _run_norms(run, norm_type, found)
        pieces.append(norms.to(out_device, torch.float32, non_blocking=True))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def checked_norms(
    tensors: Sequence[Tensor], norm_type: float, bounds: Sequence[tuple[int, int]] | None = None
) -> tuple[Tensor, Tensor]:
    """:func:`per_tensor_norms` (the same values) and whether some element of the tensors is NaN or infinite: an fp32
    scalar on the first tensor's device, 1.0 or 0.0, ``torch.isfinite`` over every element exactly.

    The norms cannot say it: they accumulate in fp32, so one finite element of 3e19 makes a 2-norm inf. The Triton
    path marks non-finite elements in the same read; the ``_foreach_norm`` path (CPU, other devices, the kernel
    turned off) reads the tensors once more (:func:`~gradkit.step._multi_norm.found_nonfinite`).

    Example::

        >>> checked_norms([torch.tensor([3e19, 1.0]), torch.ones(2)], 2.0)
        (tensor([   inf, 1.4142]), tensor(0.))
    """
    marks: list[Tensor] = []
    norms = per_tensor_norms(tensors, norm_type, bounds, marks)
    if len(marks) <= 1:
        return norms, marks[0] if marks else torch.zeros((), device=norms.device)
    return norms, torch.stack([m.to(norms.device, non_blocking=True) for m in marks]).amax()


def row_norms(t: Tensor) -> Tensor:
    """The 2-norm of every slice of ``t`` along dim 0 (an output unit, for AGC), as an fp32 vector of ``t.shape[0]``:
    ``timm.utils.agc.unitwise_norm`` for a weight of several dimensions (a bias, gain or scalar is one unit).

    Low-precision tensors are reduced in fp32, float64 ones in float64. For a sparse COO tensor, the norms of its
    coalesced rows (0 for a row it does not hold).

    Example::

        >>> row_norms(torch.tensor([[3.0, 4.0], [0.0, 1.0]]))
        tensor([5., 1.])
    """
    reduce_dtype = torch.float32 if t.dtype in (torch.float16, torch.bfloat16, torch.float32) else None
    if not t.is_sparse:
        norms = torch.linalg.vector_norm(t, 2.0, dim=tuple(range(1, t.ndim)), dtype=reduce_dtype)
        return norms if norms.dtype == torch.float32 else norms.to(torch.float32)  # a `.to` per tensor costs a call
    t = t.coalesce()
    values = t._values()
    row_sq = torch.linalg.vector_norm(values.reshape(values.shape[0], -1), 2.0, dim=1, dtype=reduce_dtype).square()
    sums = torch.zeros(t.shape[0], dtype=row_sq.dtype, device=row_sq.device).index_add_(0, t._indices()[0], row_sq)
    return sums.sqrt().to(torch.float32)


def powered(norms: Tensor, norm_type: float) -> Tensor:
    """``norms ** p`` for finite p (the additive form of a p-norm); the norms themselves for ``p = inf``."""
    return norms if math.isinf(norm_type) else norms.pow(norm_type)


def unpowered(powers: Tensor, norm_type: float) -> Tensor:
    """Inverse of :func:`powered`."""
    return powers if math.isinf(norm_type) else powers.pow(1.0 / norm_type)


def total_norm(norms: Tensor, norm_type: float) -> Tensor:
    """The p-norm of the concatenation of tensors, from their individual p-norms, as
    ``torch.nn.utils.get_total_norm``: NaN propagates (also for ``p = inf``: ``amax`` ignores nothing)."""
    if norms.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=norms.device)
    if math.isinf(norm_type):
        return norms.amax()
    return torch.linalg.vector_norm(norms, norm_type)


def grouped_norms(norms: Tensor, index: Tensor, num_groups: int, norm_type: float) -> Tensor:
    """Combine per-tensor norms into per-group norms; ``index[i]`` is the group of tensor ``i``.

    Example::

        >>> grouped_norms(torch.tensor([3.0, 4.0, 1.0]), torch.tensor([0, 0, 1]), 2, 2.0)
        tensor([5., 1.])
    """
    out = torch.zeros(num_groups, dtype=norms.dtype, device=norms.device)
    if math.isinf(norm_type):
        return out.scatter_reduce(0, index, norms, reduce="amax", include_self=True)
    return unpowered(out.index_add(0, index, powered(norms, norm_type)), norm_type)


def combine_sharded(local_norms: Tensor, shard_weight: Tensor, reduced_powers: Tensor, norm_type: float) -> Tensor:
    """Global per-parameter norms from local ones after the all-reduce of :func:`reduce_sharded`.

    Args:
        local_norms: this rank's per-parameter norms (of local shards for sharded parameters).
        shard_weight: per parameter, 0 for replicated gradients (identical on every rank, nothing to reduce) and
            ``1 / replication`` for sharded ones (a shard held by ``replication`` ranks is counted once).
        reduced_powers: the all-reduced (sum, or max for ``p = inf``) of ``powered(local_norms) * shard_weight``.
        norm_type: the p of the norm.
    """
    sharded = shard_weight > 0
    return torch.where(sharded, unpowered(reduced_powers, norm_type), local_norms)


@dataclass(eq=False)
class ParamIndex:
    """Static description of the parameters one optimizer steps, reused every step until that set changes.

    Parameters are ordered so that gradients of the same (device, dtype) are adjacent; ``run_of[i]`` numbers the
    (device, dtype) group of parameter ``i``. Compared and hashed by identity: caches derived from an index key on
    the object itself (an ``id`` may be reused once the index is garbage collected). ``shard_weight`` is 0 for a
    parameter the same on every rank and ``1 / (ranks holding its piece)`` for a sharded or declared one
    (:func:`~gradkit.expert_parallel`); ``replica_check``, with several processes, checks at the first
    reduction that the copies it assumes are copies. ``pp``, under a :func:`~gradkit.pipeline_parallel` declaration,
    places this stage's parameters among every stage's (every weight is then above 0: the other stages need them).
    """

    params: list[torch.nn.Parameter]
    names: list[str]
    module_names: list[str]
    module_index: Tensor | None
    group_index: Tensor
    num_groups: int
    shard_weight: Tensor
    any_sharded: bool
    depth: int
    replicated_dtensors: list[int] = field(default_factory=list)
    run_of: list[int] = field(default_factory=list)
    any_dtensor: bool = False
    replica_check: ReplicaCheck | None = None
    sharded_positions: list[int] = field(default_factory=list)  # where ``shard_weight > 0``, known on the host
    pp: PipelineStages | None = None

    @property
    def reduced_width(self) -> int:
        """The length of the per-parameter norms a reduction returns: every stage's parameters under pipeline
        parallelism, this index's otherwise."""
        return len(self.params) if self.pp is None else self.pp.count

    @functools.cached_property
    def run_bounds(self) -> list[tuple[int, int]]:
        """``(start, stop)`` of each (device, dtype) group in parameter order: the ``_foreach`` runs of a step in
        which every parameter has a dense gradient, known without looking at the gradients."""
        return run_bounds(self.run_of)

    @functools.cached_property
    def all_positions(self) -> list[int]:
        return list(range(len(self.params)))

    @property
    def num_params(self) -> int:
        return len(self.params)


def world_size() -> int:
    """The number of ranks in the default process group; 1 without one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def reduce_sharded(
    index: ParamIndex, local: Mapping[float, Tensor], extras: Mapping[str, Tensor] | None = None
) -> tuple[dict[float, Tensor], dict[str, Tensor]]:
    """Global per-parameter norms from this rank's local ones, and per-rank ``extras`` summed over all ranks.

    The one place where sharded norms are reduced. For every finite p each rank contributes
    ``powered(local[p], p) * index.shard_weight`` (:func:`combine_sharded`); all finite norm types and the extras
    (flattened, in fp32) travel in ONE all-reduce (SUM). Under pipeline parallelism (``index.pp``) each stage's
    contribution sits in its own columns of an every-stage vector, and the norms returned are every stage's
    (``[index.reduced_width]``, in stage order; :meth:`~gradkit.step.pp_stages.PipelineStages.local` takes this
    stage's). The inf-norm is a maximum: with sharded gradients it takes a
    second all-reduce (MAX). Nothing is reduced in a single process, nor without sharded gradients and extras, except
    at the first reduction of norms of an index whose ``replica_check`` is pending: its block rides in the same
    all-reduce and is verified (:class:`~gradkit.step.replicas.ReplicaCheck`). Under sharding every rank must call it,
    with the same norm types and extras of the same shapes.

    Args:
        index: the parameters the norms belong to (``shard_weight``, ``any_sharded``, ``replica_check``).
        local: per norm type, this rank's ``[P]`` per-parameter norms (of local shards for sharded parameters).
        extras: per-rank tensors to be summed over ranks in the same collective.

    Returns:
        ``(norms, reduced)``: per norm type the global per-parameter norms (every stage's under pipeline
        parallelism), and per extra its sum over all ranks (fp32, on the device of ``index.shard_weight``, in the
        extra's shape).

    Raises:
        RuntimeError: on every rank, at the first reduction, if copies that gradkit assumes differ (the fix named).
    """
    extras = {} if extras is None else extras
    check = index.replica_check
    check = check if check is not None and not check.done and local else None
    if world_size() == 1 or (not index.any_sharded and not extras and check is None):
        return dict(local), dict(extras)
    device = index.shard_weight.device
    finite_ps = [p for p in local if not math.isinf(p)] if index.any_sharded else []
    pieces = [stage_columns(index, powered(local[p], p) * index.shard_weight) for p in finite_ps]
    pieces += [t.detach().reshape(-1).to(device=device, dtype=torch.float32) for t in extras.values()]
    if check is not None:
        pieces.append(check.contribution(next(iter(local.values()))))
    norms = dict(local)
    reduced: dict[str, Tensor] = {}
    if pieces:
        flat = torch.cat(pieces)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in finite_ps:
            n = index.reduced_width
            if index.pp is None:
                norms[p] = combine_sharded(local[p], index.shard_weight, flat[offset : offset + n], p)
            else:  # every weight is above 0: every stage's norm is the reduced one
                norms[p] = unpowered(flat[offset : offset + n], p)
            offset += n
        for name, t in extras.items():
            n = t.numel()
            reduced[name] = flat[offset : offset + n].reshape(t.shape)
            offset += n
        if check is not None:
            check.verify(flat[offset:])
    if index.any_sharded and math.inf in local:
        contrib = stage_columns(index, local[math.inf] * (index.shard_weight > 0))
        dist.all_reduce(contrib, op=dist.ReduceOp.MAX)
        norms[math.inf] = (
            combine_sharded(local[math.inf], index.shard_weight, contrib, math.inf) if index.pp is None else contrib
        )
    return norms, reduced


def stage_columns(index: ParamIndex, contribution: Tensor) -> Tensor:
    """A rank's per-parameter contribution to the reduction, in its stage's columns under pipeline parallelism."""
    return contribution if index.pp is None else index.pp.spread(contribution)


@dataclass
class GradStats:
    """The gradient statistics of one optimizer step, all device tensors (reading them is the caller's choice).

    Attributes:
        norm_type: the p of every norm in this record.
        param_norms: ``[P]`` global norm of the gradient of every parameter in the index (0 where it has none).
        names: ``[P]`` qualified parameter names, aligned with ``param_norms``.
        module_norms: ``[M]`` norms per module at the chosen depth (``None`` when depth is 0).
        module_names: ``[M]`` the module names.
        group_norms: ``[G]`` norms per optimizer param group (derived when first read: few steps need it).
        total: scalar total norm, equal to ``torch.nn.utils.get_total_norm`` over all gradients. Accumulated in fp32
            as torch does: inf when the sum of squares passes fp32's range, even with every element finite.
        found_nonfinite: fp32 scalar, 0.0 when every gradient element is finite (``torch.isfinite``, exactly), else
            the number of ranks holding a NaN or an infinity (1.0 in one process); measured only when a policy asks
            (``StatsRequest.finite_check``: ``NonFiniteGuard`` does), else ``None``.
        finite: scalar bool, False when any gradient element is NaN or Inf: ``found_nonfinite == 0`` when measured,
            else derived from ``total`` (then an overflowing norm reads as non-finite). Derived when first read.
        norms_nonfinite: scalar bool, True when ``total`` (or, in several processes, a rank's own norm) is NaN or
            Inf: a non-finite element, or a norm overflow (``finite`` and ``norms_nonfinite`` both true: every
            element finite, the norm past fp32's range). Derived when first read.
        missing: names of trainable parameters that had no gradient at this step.
        pp: under pipeline parallelism (:func:`~gradkit.pipeline_parallel`), where this stage's parameters sit among
            every stage's: ``param_norms`` and ``names`` are this stage's, ``total``, ``module_norms`` and
            ``group_norms`` the whole model's, as ``model_norms`` and ``model_names`` are.
    """

    norm_type: float
    param_norms: Tensor
    names: list[str]
    module_norms: Tensor | None
    module_names: list[str]
    total: Tensor
    missing: list[str] = field(default_factory=list)
    group_index: Tensor | None = field(default=None, repr=False)
    num_groups: int = 0
    found_nonfinite: Tensor | None = None
    _group_norms: Tensor | None = field(default=None, repr=False)
    _finite: Tensor | None = field(default=None, repr=False)
    _norms_nonfinite: Tensor | None = field(default=None, repr=False)
    pp: PipelineStages | None = field(default=None, repr=False)
    _model_norms: Tensor | None = field(default=None, repr=False)

    @property
    def model_norms(self) -> Tensor:
        """The per-parameter norms of the whole model: every stage's under pipeline parallelism (the same vector on
        every stage), else :attr:`param_norms`."""
        return self.param_norms if self._model_norms is None else self._model_norms

    @property
    def model_names(self) -> list[str]:
        """The names of :attr:`model_norms`."""
        return self.names if self.pp is None else self.pp.names

    def model_position(self, position: int) -> int:
        """Where this stage's parameter ``position`` (of :attr:`param_norms`) sits in :attr:`model_norms`."""
        return position if self.pp is None else self.pp.offset + position

    @property
    def finite(self) -> Tensor:
        if self._finite is None:
            found = self.found_nonfinite
            self._finite = finite_mask(self.total) if found is None else found == 0
        return self._finite

    @finite.setter
    def finite(self, value: Tensor) -> None:
        self._finite = value

    @property
    def norms_nonfinite(self) -> Tensor:
        if self._norms_nonfinite is None:
            self._norms_nonfinite = nonfinite_mask(self.total)
        return self._norms_nonfinite

    @norms_nonfinite.setter
    def norms_nonfinite(self, value: Tensor) -> None:
        self._norms_nonfinite = value

    @property
    def group_norms(self) -> Tensor:
        if self._group_norms is None:
            assert self.group_index is not None
            self._group_norms = grouped_norms(self.model_norms, self.group_index, self.num_groups, self.norm_type)
        return self._group_norms


def derive_stats(
    index: ParamIndex, param_norms: Tensor, norm_type: float, missing: list[str], found: Tensor | None = None
) -> GradStats:
    """Build a :class:`GradStats` from global per-parameter norms as :func:`reduce_sharded` returns them (every
    stage's under pipeline parallelism; no gradient is read here); ``found`` is the read's ``found_nonfinite``, when
    it measured one."""
    if index.pp is not None:
        return _derive_stage_stats(index, index.pp, param_norms, norm_type, missing, found)
    total = total_norm(param_norms, norm_type)
    module_norms = None
    if index.module_index is not None:
        module_norms = grouped_norms(param_norms, index.module_index, len(index.module_names), norm_type)
    return GradStats(
        norm_type=norm_type,
        param_norms=param_norms,
        names=index.names,
        module_norms=module_norms,
        module_names=index.module_names,
        total=total,
        missing=missing,
        group_index=index.group_index,
        num_groups=index.num_groups,
        found_nonfinite=found,
    )


def _derive_stage_stats(
    index: ParamIndex, pp: PipelineStages, every: Tensor, norm_type: float, missing: list[str], found: Tensor | None
) -> GradStats:
    """:func:`derive_stats` of a pipeline stage: its own per-parameter norms, the whole model's total, modules and
    param groups, from every stage's norms (``every``: the same vector on every stage, so the same decisions)."""
    module_norms = None
    if pp.module_index is not None:
        module_norms = grouped_norms(every, pp.module_index, len(pp.module_names), norm_type)
    return GradStats(
        norm_type=norm_type,
        param_norms=pp.local(every),
        names=index.names,
        module_norms=module_norms,
        module_names=pp.module_names,
        total=total_norm(every, norm_type),
        missing=missing,
        group_index=pp.group_index,
        num_groups=pp.num_groups,
        found_nonfinite=found,
        pp=pp,
        _model_norms=every,
    )
