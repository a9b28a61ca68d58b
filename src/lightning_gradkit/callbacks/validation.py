"""In-fit validation under ``torch.inference_mode``, with the checks that make it safe for the training after it."""

from __future__ import annotations

import functools
import gc
import math
import re
import sys
import types
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.accelerators import Accelerator, XLAAccelerator
from lightning.pytorch.strategies import FSDPStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from gradkit._util.arguments import check_bool, check_choice, name_list
from gradkit.report.events import EventLog
from lightning_gradkit.trainer_door import events_dir, instance_hook

__all__ = [
    "Fallback",
    "InferenceModeValidation",
    "OnInferenceTensors",
    "find_inference_tensors",
    "inference_mode_unsafe_reason",
]


Fallback = Literal["no_grad", "raise"]
OnInferenceTensors = Literal["clone", "raise"]
_MAX_DEPTH = 3
# Module internals that hold no user tensors (parameters and buffers are visited separately).
_SKIP_ATTRS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_trainer"})
# Packages whose objects hold no user cache: the search does not look inside their instances (a Trainer, a logger,
# an optimizer kept on the module), nor, when it names an owner after a failure, at their module globals.
_FRAMEWORK_PACKAGES = frozenset(
    {
        "builtins",
        "torch",
        "lightning",
        "lightning_fabric",
        "pytorch_lightning",
        "lightning_gradkit",
        "gradkit",
        "torchmetrics",
    }
)
# What torch says when training meets an inference tensor (saved for backward, or updated in place).
_INFERENCE_TENSOR_ERROR = re.compile(r"[Ii]nference tensors? ")


def _is_fsdp2(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6 keeps it private
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return False
    return any(isinstance(m, FSDPModule) for m in module.modules())


def inference_mode_unsafe_reason(strategy: Strategy, accelerator: Accelerator, module: nn.Module | None) -> str | None:
    """Why in-fit validation must not run under ``torch.inference_mode`` with this setup, or ``None``.

    - FSDP1 (``FSDPStrategy``): the unsharded flat-parameter views made in an inference-mode forward are
      inference tensors that the next training forward cannot use (pytorch/pytorch#95957; Lightning's own
      evaluation loop falls back to ``no_grad`` there).
    - FSDP2 (``fully_shard``, e.g. under ``ModelParallelStrategy``): the all-gather buffers are allocated on the
      first forward and reused; when that forward is the sanity check under inference mode they stay inference
      tensors and the first training step fails with "Inplace update to inference tensor outside InferenceMode"
      (checked with torch 2.13).
    - the ``gloo`` backend and XLA: Lightning's evaluation loop itself refuses inference mode there.
    """
    if isinstance(strategy, FSDPStrategy):
        return (
            "FSDP1 (`FSDPStrategy`) turns its unsharded parameter views into inference tensors that break the next "
            "training step (pytorch/pytorch#95957)"
        )
    if module is not None and _is_fsdp2(module):
        return (
            "FSDP2 (`fully_shard`) allocates its all-gather buffers on the first forward; under inference mode they "
            "become inference tensors that the training step cannot write"
        )
    if isinstance(accelerator, XLAAccelerator):
        return "XLA does not support `torch.inference_mode` (Lightning's evaluation loop uses `no_grad` there)"
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        return "Lightning's evaluation loop uses `no_grad` with the gloo backend"
    return None


def _in_framework(obj: object) -> bool:
    return type(obj).__module__.partition(".")[0] in _FRAMEWORK_PACKAGES


def _slot_names(obj: object) -> list[str]:
    """The ``__slots__`` of ``obj``'s classes (a ``dataclass(slots=True)``), without ``__dict__``/``__weakref__``."""
    names: list[str] = []
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names += [n for n in ((slots,) if isinstance(slots, str) else slots) if n not in ("__dict__", "__weakref__")]
    return names


class _InferenceTensorSearch:
    """Finds inference tensors in a value and, with ``clone``, replaces them where they are kept (see
    :func:`find_inference_tensors`); tuples are rebuilt, ``__dict__`` and ``__slots__`` of plain objects visited."""

    def __init__(self, clone: bool) -> None:
        self.clone = clone
        self.found: list[str] = []
        self._clones: dict[int, Tensor] = {}
        self._seen: set[int] = set()

    def tensor(self, t: Tensor, name: str) -> Tensor:
        if not t.is_inference():
            return t
        self.found.append(name)
        if not self.clone:
            return t
        if id(t) not in self._clones:
            with torch.inference_mode(False):
                self._clones[id(t)] = t.clone()
        return self._clones[id(t)]

    def visit(self, value: Any, name: str, depth: int) -> Any:
        """``value`` with its inference tensors found (and replaced, with ``clone``); a rebuilt tuple if it is one."""
        if isinstance(value, Tensor):
            return self.tensor(value, name)
        if depth >= _MAX_DEPTH or isinstance(value, (nn.Module, type, types.ModuleType, types.FunctionType)):
            return value
        if isinstance(value, list):
            for i, item in enumerate(value):
                new = self.visit(item, f"{name}[{i}]", depth + 1)
                if new is not item:
                    value[i] = new
        elif isinstance(value, tuple):
            items = [self.visit(item, f"{name}[{i}]", depth + 1) for i, item in enumerate(value)]
            if any(new is not old for new, old in zip(items, value, strict=True)):
                return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        elif isinstance(value, dict):
            for key, item in list(value.items()):
                new = self.visit(item, f"{name}[{key!r}]", depth + 1)
                if new is not item:
                    value[key] = new
        elif not _in_framework(value) and id(value) not in self._seen:
            self._seen.add(id(value))
            self._visit_attributes(value, name, depth)
        return value

    def _visit_attributes(self, obj: object, name: str, depth: int) -> None:
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            for key, item in list(attrs.items()):
                new = self.visit(item, f"{name}.{key}", depth + 1)
                if new is not item:
                    attrs[key] = new  # past a custom `__setattr__` or a frozen dataclass, as `vars(obj)` holds it
        for slot in _slot_names(obj):
            item = getattr(obj, slot, None)
            new = self.visit(item, f"{name}.{slot}", depth + 1)
            if new is not item:
                object.__setattr__(obj, slot, new)


def find_inference_tensors(root: nn.Module, clone: bool = False) -> tuple[list[str], list[str]]:
    """Find tensors on ``root``'s modules that are inference tensors; optionally replace them by normal clones.

    Visited: every submodule's buffers and parameters, and its plain attributes that are tensors, lists, tuples or
    dicts, or plain Python objects (a cache object: ``self.cache.table``), nested up to three levels. Clones are made
    outside inference mode, so training can save them for backward and update them in place; a tensor reachable
    under several names is cloned once, so aliases stay aliases. Parameters are only reported: the optimizer holds
    the original objects.

    Returns:
        The qualified names of inference-tensor parameters, and of the other inference tensors found.

    Example::

        >>> net = nn.Linear(2, 2)
        >>> with torch.inference_mode():
        ...     net.cache = {"table": torch.ones(2)}
        >>> find_inference_tensors(net, clone=True)
        ([], ["cache['table']"])
        >>> net.cache["table"].is_inference()
        False
    """
    params: list[str] = []
    search = _InferenceTensorSearch(clone)
    for module_name, module in root.named_modules():
        prefix = f"{module_name}." if module_name else ""
        params += [prefix + n for n, p in module._parameters.items() if p is not None and p.is_inference()]
        for n, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[n] = search.tensor(b, prefix + n)
        for n, value in list(vars(module).items()):
            if n in _SKIP_ATTRS or (n.startswith("_") and "hook" in n):
                continue
            new = search.visit(value, prefix + n, 0)
            if new is not value:
                module.__dict__[n] = new
    return params, search.found


def _follow(ref: object) -> bool:
    """Whether the search for a cache's tensors goes on into ``ref``: containers and plain objects, not modules (an
    ``lru_cache`` on a method has ``self`` in its keys), classes, functions or framework objects."""
    if isinstance(ref, (dict, list, tuple, set)):
        return True
    return not isinstance(ref, (nn.Module, type, types.ModuleType, types.FunctionType)) and not _in_framework(ref)


def _holds_inference_tensor(root: object) -> bool:
    """Whether an inference tensor is among the objects ``root`` refers to, up to ``_MAX_DEPTH + 1`` hops, as the
    garbage collector sees them (which reaches inside C objects such as an ``lru_cache``'s cache)."""
    level = [root]
    seen = {id(root)}
    for _ in range(_MAX_DEPTH + 1):
        following = []
        for obj in level:
            for ref in gc.get_referents(obj):
                if isinstance(ref, Tensor):
                    if ref.is_inference():
                        return True
                elif id(ref) not in seen and _follow(ref):
                    seen.add(id(ref))
                    following.append(ref)
        level = following
    return False


def _lru_caches_holding_inference_tensors() -> list[str]:
    """Qualified names of the ``functools.lru_cache`` (and ``functools.cache``) functions whose cache holds an
    inference tensor. Slow (it walks every object the garbage collector tracks): for error messages."""
    # `type(o) is`, not `isinstance`: it reads no attribute of `o` (an object like torch's deprecated
    # `torch.distributed.reduce_op` warns on every attribute read); the wrapper type cannot be subclassed.
    caches = [o for o in gc.get_objects() if type(o) is functools._lru_cache_wrapper]
    return [
        f"{cache.__module__}.{cache.__qualname__}"
        for cache in caches
        if cache.cache_info().currsize and _holds_inference_tensor(cache)
    ]


def _globals_holding_inference_tensors() -> list[str]:
    """Qualified names of the inference tensors held by the globals of imported modules outside torch and Lightning
    (also inside containers and plain objects, three levels deep)."""
    found: list[str] = []
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.partition(".")[0] in _FRAMEWORK_PACKAGES:
            continue
        search = _InferenceTensorSearch(clone=False)
        try:
            for name, value in list(vars(module).items()):
                if not name.startswith("__") and type(value) is not functools._lru_cache_wrapper:
                    search.visit(value, f"{module_name}.{name}", 1)
        except Exception:
            continue  # a lazy module (transformers') may raise on a read; it holds no tensor of the run
        found += search.found
    return found


def _explain(pl_module: pl.LightningModule) -> str:
    """The cause and the fixes of torch's inference-tensor error in training, naming the owners of such tensors."""
    params, on_model = find_inference_tensors(pl_module, clone=False)
    caches = _lru_caches_holding_inference_tensors()
    owners = [*params, *on_model, *(f"the lru_cache of {c}" for c in caches)]
    owners += [f"the global {g}" for g in _globals_holding_inference_tensors()]
    where = (
        f"Inference tensors are kept by: {name_list(owners)}."
        if owners
        else "None was found on the model, in an `lru_cache` or in a module global (a closure or a class attribute "
        "may hold it)."
    )
    clear = f"`{caches[0].rpartition('.')[2]}.cache_clear()`" if caches else "`fn.cache_clear()`"
    return (
        "InferenceModeValidation: training met a tensor that was created under `torch.inference_mode` (in "
        "validation under this callback, in `trainer.validate`, or by your code) and kept past it. The callback "
        "clones those the LightningModule holds (buffers, attributes, and lists, dicts and plain objects in them), "
        f"not others. {where} Fix: create the value outside inference mode "
        "(`with torch.inference_mode(False): value = value.clone()`), clear the cache after validation "
        f"({clear} in `on_validation_end`), or remove InferenceModeValidation so that in-fit validation runs under "
        "`torch.no_grad`, as in plain Lightning."
    )


class InferenceModeValidation(pl.Callback):
    r"""Run the sanity check and every in-fit validation under ``torch.inference_mode``, safely.

    Lightning runs validation inside ``fit`` under ``torch.no_grad`` (its fit loop builds the validation loop with
    ``inference_mode=False``); only ``validate``/``test``/``predict`` use ``torch.inference_mode``, which also skips
    version-counter and view tracking. This callback switches the fit loop's validation to inference mode at fit
    start (restored at teardown), so Lightning's own evaluation loop enters the context, with its own exclusions.
    Where inference mode is unsafe (FSDP1, FSDP2, the gloo backend, XLA: see
    :func:`inference_mode_unsafe_reason` for why) validation stays under ``no_grad`` or, with ``fallback="raise"``,
    fit stops with the reason. The model is in eval mode inside validation and each submodule's own train/eval mode
    is restored after it (Lightning's evaluation loop does both).

    The hazard of inference mode is a tensor created during validation and kept: a cache on a module (rotary
    tables, a running statistic, a torchmetrics state reset in validation) is an inference tensor, and training
    fails with "Inference tensors cannot be saved for backward" (Lightning #20181). So after every validation (also
    ``trainer.validate``), again before the next training batch and at train start, the model's tensors are searched
    (:func:`find_inference_tensors`, once per validation, never per step): inference tensors are replaced by normal
    clones (``on_inference_tensors="clone"``) or named in an error (``"raise"``). A parameter that became an
    inference tensor always raises: the optimizer holds the old one.

    A cache the model does not hold (an ``lru_cache``, a module global, a closure) cannot be repaired: when training
    meets such a tensor, ``on_exception`` completes torch's error message with the owners it can find (``"the
    lru_cache of my_pkg.rope.tables"``), the cause and the fixes. That search costs nothing until the error happens.

    With ``check_finite``, the validation metrics (``trainer.callback_metrics`` logged by that validation) are
    read once at validation end; non-finite ones are named in a warning and appended as an event to
    ``gradkit_events.jsonl`` in the logger's directory.

    Args:
        fallback: ``"no_grad"`` to validate under ``torch.no_grad`` where inference mode is unsafe, ``"raise"`` to
            stop instead.
        check_finite: warn about non-finite validation loss or metrics.
        on_inference_tensors: ``"clone"`` to make inference tensors left on modules usable by training, ``"raise"``
            to name them in an error.

    Raises:
        ValueError: at construction, if ``fallback`` or ``on_inference_tensors`` is unknown.
        RuntimeError: at fit start with ``fallback="raise"`` where inference mode is unsafe; after validation if a
            parameter (or, with ``on_inference_tensors="raise"``, any module tensor) is an inference tensor. Torch's
            own error, when training meets an inference tensor kept elsewhere, leaves ``fit`` with its owners and
            the fixes added to its message.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import InferenceModeValidation
        >>> trainer = Trainer(callbacks=[InferenceModeValidation()])
    """

    def __init__(
        self,
        fallback: Fallback = "no_grad",
        check_finite: bool = True,
        on_inference_tensors: OnInferenceTensors = "clone",
    ) -> None:
        self.fallback = check_choice(
            "fallback",
            fallback,
            get_args(Fallback),
            hint="'no_grad' validates under `torch.no_grad` where inference mode is unsafe (FSDP, gloo, XLA), 'raise' "
            "stops there.",
        )
        self.check_finite = check_bool("check_finite", check_finite)
        self.on_inference_tensors = check_choice(
            "on_inference_tensors", on_inference_tensors, get_args(OnInferenceTensors)
        )
        self._loop: Any = None
        self._previous_mode = False
        self._enabled = False
        self._scan_pending = False
        self._metrics_before: dict[str, Any] = {}
        self._warned_not_enabled = False
        self._reported: set[str] = set()

    # -- switching the fit loop's validation --------------------------------------------------------------------
    @instance_hook  # `callbacks=[InferenceModeValidation]`, the class, is refused with the fix
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Resolved on every rank here: `trainer.log_dir` is a broadcast from rank 0.
        self._events = EventLog(events_dir(trainer), rank=trainer.global_rank)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loop = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "val_loop", None)
        if loop is None or not hasattr(loop, "inference_mode"):
            raise RuntimeError(
                "InferenceModeValidation: the Trainer's fit loop has no `epoch_loop.val_loop.inference_mode` switch "
                f"(custom loop `{type(trainer.fit_loop).__name__}`, or an unsupported Lightning version)."
            )
        reason = inference_mode_unsafe_reason(trainer.strategy, trainer.accelerator, pl_module)
        self._enabled = reason is None
        if reason is not None:
            if self.fallback == "raise":
                raise RuntimeError(
                    f"InferenceModeValidation: in-fit validation cannot use `torch.inference_mode` here: {reason}. "
                    "Pass `fallback='no_grad'` to validate under `torch.no_grad`, or remove the callback."
                )
            rank_zero_info(f"InferenceModeValidation: in-fit validation stays under `torch.no_grad`: {reason}.")
            return
        self._loop, self._previous_mode = loop, loop.inference_mode
        loop.inference_mode = True

    def _restore(self) -> None:
        if self._loop is not None:
            self._loop.inference_mode = self._previous_mode
            self._loop = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()
        if isinstance(exception, RuntimeError) and _INFERENCE_TENSOR_ERROR.search(str(exception)):
            # Lightning re-raises `exception` after every `on_exception` hook and its teardown: raising another one
            # here would skip them, so the message of the original grows instead.
            exception.args = (f"{exception.args[0] if exception.args else ''}\n\n{_explain(pl_module)}",)

    # -- validation ---------------------------------------------------------------------------------------------
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if (
            trainer.state.fn == TrainerFn.FITTING
            and self._enabled
            and not torch.is_inference_mode_enabled()
            and not self._warned_not_enabled
        ):
            self._warned_not_enabled = True
            rank_zero_warn(
                "InferenceModeValidation: Lightning ran this validation under `torch.no_grad` although inference "
                "mode was requested; its evaluation loop excludes this setup."
            )
        if self.check_finite:
            self._metrics_before = dict(trainer.callback_metrics)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.check_finite:
            self._check_finite(trainer)
        # Now, and again before the next training batch: hooks that run after this one (the LightningModule's own
        # `on_validation_end`, later callbacks) may still cache tensors.
        self._repair(pl_module)
        self._scan_pending = True

    def _check_finite(self, trainer: pl.Trainer) -> None:
        before, self._metrics_before = self._metrics_before, {}
        new = {
            k: v
            for k, v in trainer.callback_metrics.items()
            if isinstance(v, Tensor) and v.numel() and v is not before.get(k)
        }
        if not new:
            return
        first = next(iter(new.values()))
        flat = [v.detach().reshape(-1).to(first.device, torch.float32) for v in new.values()]
        values = torch.cat(flat).tolist()  # one read per validation
        bad: dict[str, str] = {}
        offset = 0
        for (key, v), piece in zip(new.items(), flat, strict=True):
            chunk = values[offset : offset + piece.numel()]
            offset += piece.numel()
            if not all(math.isfinite(x) for x in chunk):
                bad[key] = str(chunk[0] if v.numel() == 1 else chunk)
        if not bad:
            return
        where = "the sanity check" if trainer.sanity_checking else f"epoch {trainer.current_epoch}"
        shown = ", ".join(f"{k}={v}" for k, v in bad.items())
        rank_zero_warn(
            f"InferenceModeValidation: non-finite validation metric(s) in {where} "
            f"(global step {trainer.global_step}): {shown}."
        )
        self._events.write(
            step=trainer.global_step,
            batch_idx=-1,
            rank=trainer.global_rank,
            what="validation_non_finite",
            culprit=None,
            values=bad,
            epoch=trainer.current_epoch,
            sanity_check=trainer.sanity_checking,
        )

    # -- making module tensors usable by training again ---------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._scan_pending = False
        self._repair(pl_module)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._scan_pending:
            self._scan_pending = False
            self._repair(pl_module)

    def _repair(self, pl_module: pl.LightningModule) -> None:
        clone = self.on_inference_tensors == "clone"
        params, found = find_inference_tensors(pl_module, clone=clone)
        if params:
            raise RuntimeError(
                f"InferenceModeValidation: parameter(s) {name_list(params)} were replaced during validation by "
                "tensors created under `torch.inference_mode`; the optimizer still holds the old ones and training "
                "cannot use them. Do not assign parameters in validation hooks."
            )
        if found and not clone:
            raise RuntimeError(
                f"InferenceModeValidation: validation left inference tensors on the model: {name_list(found)}. "
                "Training cannot save them for backward or update them in place. Recreate them outside validation, "
                "`.clone()` them before use in training, or pass `on_inference_tensors='clone'`."
            )
        new = [n for n in found if n not in self._reported]
        if new:
            self._reported.update(new)
            rank_zero_info(
                f"InferenceModeValidation: replaced inference tensors left by validation with normal clones: "
                f"{name_list(new)}."
            )
