"""Activation checkpointing injected into any model (plain PyTorch): which modules, and how their forward is
checkpointed. :class:`~lightning_gradkit.ActivationCheckpointing` wires it into the Trainer.

The selected module keeps its class, its place in the module tree and its parameter
names: only its instance-level ``forward`` is replaced by a small callable that runs the class ``forward`` under
non-reentrant :func:`torch.utils.checkpoint.checkpoint` (``use_reentrant=False, preserve_rng_state=True``). Compared
with the alternatives:

- ``checkpoint_wrapper`` inserts a ``CheckpointWrapper`` module: ``state_dict`` keys survive (it strips the prefix
  with state-dict hooks) but ``named_parameters``/``named_modules`` gain ``_checkpoint_wrapped_module.``, which changes
  per-module logging names, optimizer parameter naming and anything matching module paths; it must also be applied
  before FSDP wraps the module.
- ``torch.distributed._composable.checkpoint`` keeps names too, but it works through forward hooks and recomputes by
  calling the module again (re-running every forward hook, FSDP2's included) and cannot be applied twice.
- Replacing ``forward`` keeps every name, leaves all forward hooks (FSDP2's unshard/reshard, DDP, user hooks) outside
  the checkpointed region, and recomputes only the module's own computation. It is therefore equally correct before
  or after ``fully_shard``/FSDP wrapping/DDP, and ``torch.compile`` traces it as its native checkpoint operator.
  ``copy.deepcopy`` and ``pickle`` of the model keep working: the callable holds the module, so a copy is bound to
  the copy.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from gradkit._util.arguments import validate_every_n
from gradkit.step.params import clean_name, is_ddp_wrapped
from gradkit.step.selection import NamePattern, no_match_hint, parse_patterns

__all__ = [
    "MODES",
    "SAVE_POLICIES",
    "CheckpointMode",
    "bypass_checkpointing",
    "checkpointed_elsewhere",
    "inject",
    "inject_activation_checkpointing",
    "inject_selected",
    "injected_mode",
    "module_ancestry",
    "no_match_message",
    "remove",
    "select_modules",
    "selective_policy",
    "user_class",
]


CheckpointMode = Literal["full", "selective"]
MODES: tuple[str, ...] = ("full", "selective")

# (class name, second component of its module path) of those wrappers, compared by name: importing their modules
# (torch._dynamo in particular) only to test isinstance would be slow.
_WRAPPER_CLASSES = frozenset(
    {("OptimizedModule", "_dynamo"), ("FullyShardedDataParallel", "distributed"), ("ActivationWrapper", "distributed")}
)


# -- selection -----------------------------------------------------------------------------------------------------
def _is_wrapper(module: nn.Module) -> bool:
    """Wrapper modules (compile, FSDP1, checkpoint_wrapper) are never selected: the module they wrap is."""
    return any(
        (c.__name__, c.__module__.split(".")[1] if "." in c.__module__ else "") in _WRAPPER_CLASSES
        for c in type(module).__mro__
    )


def user_class(module: nn.Module) -> type:
    """The module's class, seen through the per-class subclasses that FSDP2's ``fully_shard`` creates."""
    for cls in type(module).__mro__:
        if not cls.__module__.startswith("torch.distributed.fsdp"):
            return cls
    return type(module)


def _candidates(root: nn.Module) -> Iterator[tuple[str, str, nn.Module]]:
    """``(raw name, cleaned name, module)`` of every submodule a target may select: wrappers and the root left out."""
    ddp = is_ddp_wrapped(root)
    for raw, module in root.named_modules():
        if not raw or _is_wrapper(module):
            continue
        name = clean_name(raw, ddp_root=ddp)
        if name:  # the module a wrapped root (compile, DDP, FSDP1) wraps is the root itself
            yield raw, name, module


def select_modules(
    root: nn.Module, targets: Sequence[str] | Sequence[NamePattern], every_n: int = 1
) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of the submodules of ``root`` that ``targets`` select, in module order.

    ``targets`` follow gradkit's selection grammar (:mod:`gradkit.step.selection`), over the names
    :func:`~gradkit.step.params.clean_name` writes relative to ``root`` (DDP's leading ``module`` too), so the same
    targets select the same modules before and after wrapping. ``root`` itself and wrapper modules are never selected,
    nor a match nested in another (the outer recompute covers it). Of the others every ``every_n``-th is kept
    (torchtitan's ``ac_freq``).
    """
    parsed = [t if isinstance(t, NamePattern) else NamePattern.parse(t, "targets") for t in targets]
    kept: list[tuple[str, str, nn.Module]] = []
    for raw, name, module in _candidates(root):
        if kept and raw.startswith(kept[-1][0] + "."):
            continue
        if any(t.matches_module(name, module) for t in parsed):
            kept.append((raw, name, module))
    return [(name, module) for _, name, module in kept[every_n - 1 :: every_n]]


# -- the selective checkpointing policy ----------------------------------------------------------------------------
def _ops(*names: str) -> frozenset[torch._ops.OpOverload]:
    found = []
    for name in names:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None and hasattr(packet, overload):
            found.append(getattr(packet, overload))
    return frozenset(found)


# Compute-bound ops whose outputs selective checkpointing keeps (torchtitan's ``_save_list``; ``aten.linear`` and
# ``aten.matmul`` decompose into these before the dispatcher sees them).
_SAVED_MATMUL_OPS = _ops(
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.baddbmm.default",
    "aten._scaled_mm.default",
    "aten.convolution.default",
    "_c10d_functional.reduce_scatter_tensor.default",
)
_SAVED_ATTENTION_OPS = _ops(
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._flash_attention_forward.default",
    "aten._efficient_attention_forward.default",
)


def _dropout_p(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == "dropout_p":
            if "dropout_p" in kwargs:
                return float(kwargs["dropout_p"])
            return float(args[i]) if i < len(args) else float(arg.default_value or 0.0)
    return 0.0


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The op-level policy of ``mode="selective"``: keep matmul and attention outputs, recompute the rest.

    Follows torchtitan's selective activation checkpointing (``torchtitan/distributed/activation_checkpoint.py``):
    the outputs of matmuls, convolutions, attention kernels and reduce-scatters are saved (``MUST_SAVE``); cheap
    pointwise/normalization ops are recomputed (``PREFER_RECOMPUTE``). Random ops are always recomputed, and an
    attention kernel with ``dropout_p > 0`` is recomputed too: skipping a random op during the recompute would shift
    the RNG stream that the recomputed dropouts after it replay, and their masks would differ from the forward's.

    Used with :func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`.
    """
    if op in _SAVED_ATTENTION_OPS:
        return CheckpointPolicy.MUST_SAVE if _dropout_p(op, args, kwargs) == 0.0 else CheckpointPolicy.PREFER_RECOMPUTE
    if op in _SAVED_MATMUL_OPS and torch.Tag.nondeterministic_seeded not in op.tags:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


SAVE_POLICIES = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
_selective_context_fn = functools.partial(create_selective_checkpoint_contexts, selective_policy)


# -- injection -----------------------------------------------------------------------------------------------------
_bypass_depth = 0


@contextlib.contextmanager
def bypass_checkpointing() -> Iterator[None]:
    """Run injected modules without checkpointing inside this context (used to measure the baseline)."""
    global _bypass_depth
    _bypass_depth += 1
    try:
        yield
    finally:
        _bypass_depth -= 1


class _CheckpointedForward:
    """The instance-level ``forward`` of a module that :func:`inject_activation_checkpointing` selected.

    It holds the module (not a bound method or a closure) so that ``copy.deepcopy`` and ``pickle`` bind the copy's
    ``forward`` to the copy. ``original`` is an instance-level ``forward`` that existed before the injection, if any.
    """

    def __init__(self, module: nn.Module, mode: CheckpointMode, original: Callable[..., Any] | None = None) -> None:
        self.module = module
        self.mode = mode
        self.original = original

    def _inner(self) -> Callable[..., Any]:
        if self.original is not None:
            return self.original
        return type(self.module).forward.__get__(self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self._inner()
        if kwargs:  # keyword arguments go to the module, never to `checkpoint` (whose own keywords could clash)
            fn = functools.partial(fn, **kwargs)
        # Nothing is saved without grad mode (validation, inference): skip the checkpoint's RNG bookkeeping.
        if _bypass_depth or not torch.is_grad_enabled():
            return fn(*args)
        if torch.compiler.is_compiling():
            # A compiled graph applies buffer mutations once (functionalized); `context_fn` must be dispatch modes.
            if self.mode == "selective":
                return checkpoint(
                    fn, *args, use_reentrant=False, preserve_rng_state=True, context_fn=_selective_context_fn
                )
            return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
        context_fn = functools.partial(_eager_contexts, self.module, self.mode)
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn)

    def __repr__(self) -> str:
        return f"<activation-checkpointed forward ({self.mode}) of {type(self.module).__name__}>"


def _eager_contexts(
    module: nn.Module, mode: CheckpointMode
) -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
    """The forward and recompute contexts of one eager checkpointed call (``checkpoint``'s ``context_fn``).

    The backward recomputes the forward, and a forward that updates buffers (BatchNorm's ``running_mean``,
    ``running_var`` and ``num_batches_tracked``) would update them a second time. The recompute context therefore
    copies every buffer of the module tree before the recompute and puts the copies back after it (also when
    ``checkpoint`` stops the recompute early). It is entered outside the selective-checkpointing dispatch mode, so
    those copies are not ops of the checkpointed region. The recompute sees the buffers as the forward left them:
    exact for BatchNorm in training mode, whose output uses the batch statistics only.
    """
    forward: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    recompute: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if mode == "selective":
        forward, recompute = _selective_context_fn()
    return forward, _buffers_restored(module, recompute)


@contextlib.contextmanager
def _buffers_restored(module: nn.Module, inner: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
    """Run the body inside ``inner``; restore every buffer of ``module``'s tree afterwards, in place and as the same
    tensor object in its slot."""
    saved = [
        (owner, name, buf, buf.detach().clone())
        for owner in module.modules()
        for name, buf in owner._buffers.items()
        if buf is not None
    ]
    try:
        with inner:
            yield
    finally:
        with torch.no_grad():
            for owner, name, buf, copy in saved:
                owner._buffers[name] = buf
                buf.copy_(copy)


def injected_mode(module: nn.Module) -> CheckpointMode | None:
    """The mode ``module`` was checkpointed with by this package, or None."""
    fwd = module.__dict__.get("forward")
    return fwd.mode if isinstance(fwd, _CheckpointedForward) else None


def _composable_checkpointed(module: nn.Module) -> bool:
    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:  # pragma: no cover - builds without torch.distributed
        return False
    registry = _get_registry(module)
    return bool(registry) and "checkpoint" in registry


def _checkpointed_by(module: nn.Module, parent: nn.Module | None = None, own: bool = True) -> str | None:
    """Who already checkpoints ``module``: this package (unless ``own=False``), ``checkpoint_wrapper`` (``module``
    or ``parent`` is an ``ActivationWrapper``), composable ``checkpoint``, or Hugging Face's
    ``gradient_checkpointing_enable()``; None if nothing does."""
    if own and injected_mode(module) is not None:
        return "lightning_gradkit"
    for m in (module, parent):
        if m is not None and any(c.__name__ == "ActivationWrapper" for c in type(m).__mro__):
            return "checkpoint_wrapper"
    if _composable_checkpointed(module):
        return "torch.distributed._composable.checkpoint"
    if getattr(module, "gradient_checkpointing", False) is True:
        return "gradient_checkpointing_enable()"
    return None


def module_ancestry(root: nn.Module) -> dict[int, list[nn.Module]]:
    """For every submodule (by id), its ancestors from the parent up to ``root``."""
    parents: dict[int, list[nn.Module]] = {id(root): []}
    for _, module in root.named_modules():
        for child in module.children():
            parents.setdefault(id(child), [module, *parents.get(id(module), [])])
    return parents


def checkpointed_elsewhere(
    root: nn.Module, module: nn.Module, own: bool = True, ancestry: dict[int, list[nn.Module]] | None = None
) -> str | None:
    """Whether ``module`` or one of its ancestors within ``root`` is already checkpointed, and by whom.

    With ``own=False`` an injection of this package on ``module`` itself does not count (ancestors always do).
    ``ancestry`` is ``module_ancestry(root)``, computed once when checking many modules."""
    chain = (ancestry if ancestry is not None else module_ancestry(root)).get(id(module), [])
    for depth, (m, parent) in enumerate(zip([module, *chain], [*chain, None], strict=True)):
        who = _checkpointed_by(m, parent, own=own or depth > 0)
        if who is not None:
            return who
    return None


def inject_selected(
    root: nn.Module, selected: Sequence[tuple[str, nn.Module]], mode: CheckpointMode, done: Sequence[nn.Module] = ()
) -> list[tuple[str, nn.Module]]:
    """Checkpoint the ``selected`` modules of ``root`` (those in ``done`` are already), but not one that is already
    checkpointed otherwise (a warning names them); returns the ``(name, module)`` pairs checkpointed."""
    ancestry = module_ancestry(root)
    kept, skipped = [], []
    for name, module in selected:
        if not any(module is m for m in done):
            who = checkpointed_elsewhere(root, module, ancestry=ancestry)
            if who is not None:
                skipped.append(f"{name} ({who})")
                continue
            inject(module, mode)
        kept.append((name, module))
    if skipped:
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(
            "ActivationCheckpointing: these modules are already checkpointed and are left as they are (no double "
            f"checkpointing): {', '.join(skipped)}."
        )
    return kept


def inject(module: nn.Module, mode: CheckpointMode = "full") -> None:
    """Checkpoint ``module``'s forward in place (no check for existing checkpointing; see
    :func:`inject_activation_checkpointing`)."""
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}.")
    module.forward = _CheckpointedForward(module, mode, module.__dict__.get("forward"))


def remove(module: nn.Module) -> bool:
    """Undo :func:`inject` on ``module``; returns whether it was injected."""
    fwd = module.__dict__.get("forward")
    if not isinstance(fwd, _CheckpointedForward):
        return False
    if fwd.original is not None:
        module.forward = fwd.original
    else:
        del module.forward
    return True


def inject_activation_checkpointing(
    module: nn.Module, targets: list[str], every_n: int = 1, mode: CheckpointMode = "full"
) -> list[str]:
    """Checkpoint the submodules of ``module`` that ``targets`` select; the helper for ``configure_model``.

    Non-reentrant :func:`torch.utils.checkpoint.checkpoint` with the RNG state preserved (dropout masks are the
    same in the recompute). Names, ``state_dict`` keys and the module tree are unchanged. Safe before or after
    ``fully_shard``/DDP/FSDP wrapping and before ``torch.compile``. Modules that are already checkpointed (by this
    function, ``checkpoint_wrapper``, composable ``checkpoint`` or ``gradient_checkpointing_enable``) are left as they
    are, with a warning.

    Args:
        module: the model to modify in place.
        targets: module class names (``"Block"``, ``"torch.nn.TransformerEncoderLayer"``) or ``re:`` regexes that
            must match whole qualified names: gradkit's selection grammar (:mod:`gradkit.step.selection`).
        every_n: checkpoint every n-th match (1: all of them).
        mode: ``"full"`` recomputes the whole module; ``"selective"`` keeps matmul/attention outputs and recomputes
            the rest (:func:`selective_policy`).

    Returns:
        The qualified names of the modules it checkpointed.

    Raises:
        ValueError: on invalid arguments, or if ``targets`` match no submodule (the message names, for each target,
            the nearest module names or classes and a target that would match).

    Example::

        class MyModel(LightningModule):
            def configure_model(self):
                self.model = Transformer(...)
                inject_activation_checkpointing(self.model, ["TransformerBlock"])
                for block in self.model.blocks:
                    fully_shard(block, mesh=self.device_mesh)
                fully_shard(self.model, mesh=self.device_mesh)
    """
    parsed = parse_patterns("targets", targets, allow_empty=False)
    validate_every_n(every_n)
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}.")
    selected = select_modules(module, parsed, every_n)
    if not selected:
        raise ValueError(no_match_message(module, parsed))
    return [name for name, _ in inject_selected(module, selected, mode)]


def no_match_message(root: nn.Module, targets: Sequence[NamePattern]) -> str:
    """The error for ``targets`` that select no submodule of ``root``: per target, what is near and what would match."""
    candidates = [(name, module) for _, name, module in _candidates(root)]
    names = [name for name, _ in candidates]
    classes = [user_class(module).__name__ for _, module in candidates]
    hints = " ".join(no_match_hint(target, names, classes) for target in targets)
    shown = ", ".join(f"'{target.text}'" for target in targets)  # as written, without repr's doubled backslashes
    return (
        f"ActivationCheckpointing: `targets=[{shown}]` match no submodule of "
        f"`{type(root).__name__}`. {hints} The grammar of `targets`: `gradkit.step.selection`."
    )
