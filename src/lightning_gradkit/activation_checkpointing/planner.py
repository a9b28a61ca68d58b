"""How many bytes of activations each module saves, and which modules to checkpoint to fit a memory budget (plain
PyTorch). :func:`measure_saved_activations` runs a forward (no backward) with
:func:`torch.autograd.graph.saved_tensors_hooks` that count each saved tensor's storage once (unique storages, views
deduplicated, parameters and pre-existing tensors excluded) and then drop it, so measuring the un-checkpointed model
needs no more memory than one checkpointed step. What a checkpointed region keeps is not visible to saved-tensor
hooks (the checkpoint installs its own), so the region's inputs (kept for the recompute) and, in selective mode, the
outputs the policy caches are recorded alongside. A module's bytes are what is saved while its forward runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import SAC_IGNORED_OPS

from gradkit._util.arguments import format_bytes
from lightning_gradkit.activation_checkpointing.injection import SAVE_POLICIES, selective_policy

__all__ = [
    "ActivationProfile",
    "budget_bytes",
    "format_summary",
    "measure_saved_activations",
    "plan_checkpointing",
]


# -- measurement ---------------------------------------------------------------------------------------------------
_OUTSIDE = -1


class _Dropped:
    """What the measuring pack hook stores instead of the tensor."""


_DROPPED = _Dropped()


def _unpack_dropped(_: object) -> Tensor:
    raise RuntimeError(
        "ActivationCheckpointing: the forward being measured ran a backward over its own graph (e.g. "
        "`torch.autograd.grad` inside `training_step`); saved activations cannot be measured for such a step."
    )


@dataclass
class ActivationProfile:
    """Saved-activation storages of one forward, attributed to candidate modules.

    ``nbytes`` maps a storage key to its size; ``owners`` gives for each saved storage the candidates whose forward
    was running when it was saved (``-1``: outside every candidate); ``inputs[i]`` and ``cached[i]`` are the
    storages that checkpointing candidate ``i`` would keep: its inputs and, in selective mode, the outputs the policy
    saves.
    """

    names: list[str]
    nbytes: dict[int, int] = field(default_factory=dict)
    owners: dict[int, set[int]] = field(default_factory=dict)
    inputs: list[set[int]] = field(default_factory=list)
    cached: list[set[int]] = field(default_factory=list)

    def held_keys(self, checkpointed: Collection[int]) -> set[int]:
        """The storages kept for backward when the ``checkpointed`` candidates are checkpointed."""
        chosen = set(checkpointed)
        keys = {k for k, owners in self.owners.items() if not owners <= chosen}
        for i in chosen:
            keys |= self.inputs[i] | self.cached[i]
        return keys

    def held(self, checkpointed: Collection[int] = ()) -> int:
        """Bytes kept for backward when the ``checkpointed`` candidates are checkpointed (default: none)."""
        return sum(self.nbytes[k] for k in self.held_keys(checkpointed))

    def module_bytes(self, i: int) -> int:
        """Bytes saved while candidate ``i``'s forward runs."""
        return sum(self.nbytes[k] for k, owners in self.owners.items() if i in owners)

    @property
    def checkpoint_held(self) -> int:
        """Bytes kept by checkpointed regions themselves (their inputs and cached outputs) outside autograd's saved
        tensors; in a profile measured with checkpointing active."""
        keys: set[int] = set()
        for i in range(len(self.names)):
            keys |= self.inputs[i] | self.cached[i]
        return sum(self.nbytes[k] for k in keys)


class _Recorder:
    def __init__(self, profile: ActivationProfile, candidates: Sequence[nn.Module], exclude: set[int]) -> None:
        self.profile = profile
        self.index = {id(m): i for i, m in enumerate(candidates)}
        self.exclude = exclude
        self.stack: list[int] = []
        self._pins: list[StorageWeakRef] = []

    def key(self, t: Tensor) -> int | None:
        """A storage key for ``t``, or None for parameters and tensors that existed before the forward."""
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return None
        t = getattr(t, "_local_tensor", t)  # DTensor: the local shard
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse / opaque tensors: no storage to share
            self.profile.nbytes[-id(t)] = t.numel() * t.element_size()
            return -id(t)
        # Holding a weak reference keeps the storage's identity unique for the whole measurement, without keeping
        # its memory: a freed storage's key is never reused by a new one.
        ref = StorageWeakRef(storage)
        if ref.cdata in self.exclude:
            return None
        if ref.cdata not in self.profile.nbytes:
            self._pins.append(ref)
            self.profile.nbytes[ref.cdata] = storage.nbytes()
        return ref.cdata

    def pack(self, t: Tensor) -> _Dropped:
        key = self.key(t)
        if key is not None:
            self.profile.owners.setdefault(key, set()).add(self.stack[-1] if self.stack else _OUTSIDE)
        return _DROPPED

    def pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        i = self.index[id(module)]
        self.stack.append(i)
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, Tensor) and (key := self.key(leaf)) is not None:
                self.profile.inputs[i].add(key)

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.stack.pop()


class _PolicyProbe(TorchDispatchMode):
    """Records the outputs that :func:`selective_policy` would cache, per enclosing candidate module."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        stack = self.recorder.stack
        if stack and func not in SAC_IGNORED_OPS and selective_policy(None, func, *args, **kwargs) in SAVE_POLICIES:
            for leaf in tree_leaves(out):
                if isinstance(leaf, Tensor) and (key := self.recorder.key(leaf)) is not None:
                    self.recorder.profile.cached[stack[-1]].add(key)
        return out


def _storage_keys(tensors: Iterator[Tensor]) -> set[int]:
    keys = set()
    for t in tensors:
        t = getattr(t, "_local_tensor", t)
        with contextlib.suppress(RuntimeError, NotImplementedError):
            keys.add(StorageWeakRef(t.untyped_storage()).cdata)
    return keys


def measure_saved_activations(
    forward: Callable[[], object],
    root: nn.Module,
    candidates: Sequence[tuple[str, nn.Module]] = (),
    selective: bool = False,
    exclude: Sequence[Tensor] = (),
) -> ActivationProfile:
    """Measure what ``forward()`` saves for backward, without keeping it and without running a backward.

    Saved tensors are counted by unique storage through :func:`torch.autograd.graph.saved_tensors_hooks`, then
    dropped. ``root``'s parameters and buffers, tensors in ``exclude`` (e.g. the batch), and parameters in general
    are not activations and are skipped. For each candidate module the profile also records its tensor inputs and
    (with ``selective=True``) the outputs :func:`selective_policy` caches: what checkpointing that module keeps.
    Run it with grad mode on; ``forward``'s result is discarded, so its graph is freed at once.

    Returns:
        An :class:`ActivationProfile` whose ``held()`` is the saved-activation bytes of the step.
    """
    names = [name for name, _ in candidates]
    modules = [m for _, m in candidates]
    profile = ActivationProfile(names, inputs=[set() for _ in names], cached=[set() for _ in names])
    with torch.no_grad():
        keys = _storage_keys(iter([*root.parameters(), *root.buffers(), *exclude]))
    recorder = _Recorder(profile, modules, keys)
    handles = []
    try:
        for m in modules:
            # Registered last, so they run after other pre-hooks (FSDP2's unshard, ...): the recorded inputs are the
            # ones the module's forward, and thus the checkpoint, receives.
            handles.append(m.register_forward_pre_hook(recorder.pre_forward, with_kwargs=True))
            handles.append(m.register_forward_hook(recorder.post_forward, always_call=True))
        probe = _PolicyProbe(recorder) if selective and modules else contextlib.nullcontext()
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(recorder.pack, _unpack_dropped), probe:
            forward()
    finally:
        for h in handles:
            h.remove()
    return profile


# -- the memory-budget planner -------------------------------------------------------------------------------------
def budget_bytes(memory_budget: float, baseline: int) -> int:
    """The budget in bytes: a fraction of ``baseline`` when ``memory_budget`` <= 1, else bytes."""
    return int(memory_budget * baseline) if memory_budget <= 1 else int(memory_budget)


def plan_checkpointing(profile: ActivationProfile, budget: int) -> tuple[list[int], bool]:
    """Choose candidates to checkpoint so the saved-activation bytes fit in ``budget``.

    Greedy, largest saving first: each candidate's saving is what checkpointing it alone frees (the bytes saved
    inside it, minus the inputs and cached outputs it keeps); candidates are added in that order until
    ``profile.held(chosen) <= budget``. With additive savings (disjoint modules, the usual case) this is the fewest
    modules that meet the budget. Candidates that free nothing are never chosen.

    Returns:
        The chosen candidate indices (sorted) and whether the budget is met (if not, all useful candidates).
    """
    baseline = profile.held()
    if baseline <= budget:
        return [], True
    savings = {i: baseline - profile.held([i]) for i in range(len(profile.names))}
    chosen: list[int] = []
    for i in sorted(savings, key=lambda i: (-savings[i], i)):
        if savings[i] <= 0:
            break
        chosen.append(i)
        if profile.held(chosen) <= budget:
            return sorted(chosen), True
    return sorted(chosen), False


# -- summary -------------------------------------------------------------------------------------------------------
_MAX_ROWS = 16


def format_summary(
    header: str,
    rows: Sequence[tuple[str, str, int | None, bool]],
    before: int | None = None,
    after: int | None = None,
    footer: Sequence[str] = (),
) -> str:
    """A one-screen table: ``(name, class, saved bytes or None, checkpointed)`` per candidate, then totals."""
    shown = list(rows[:_MAX_ROWS])
    width = max([len(r[0]) for r in shown] + [6])
    cls_width = max([len(r[1]) for r in shown] + [5])
    lines = [header, f"  {'module':<{width}}  {'class':<{cls_width}}  {'saved activations':>17}  checkpointed"]
    for name, cls, nbytes, selected in shown:
        size = format_bytes(nbytes) if nbytes is not None else "-"
        lines.append(f"  {name:<{width}}  {cls:<{cls_width}}  {size:>17}  {'yes' if selected else 'no'}")
    if len(rows) > len(shown):
        rest = rows[len(shown) :]
        lines.append(f"  ... {len(rest)} more ({sum(r[3] for r in rest)} of them checkpointed)")
    if before is not None and after is not None:
        change = f" ({(after - before) / before:+.0%})" if before else ""
        lines.append(
            f"  saved activations per step: {format_bytes(before)} without checkpointing -> {format_bytes(after)} "
            f"with it{change}"
        )
    lines.extend(f"  {line}" for line in footer)
    return "\n".join(lines)
