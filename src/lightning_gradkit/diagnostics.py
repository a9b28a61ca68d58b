"""Training-health diagnostics without Lightning: host-sync interception, source attribution, graph-leak scanning.

The Lightning wiring lives in :mod:`lightning_gradkit.callbacks.sync_audit` and
:mod:`lightning_gradkit.callbacks.graph_leak`; everything here works on plain PyTorch objects.

Host syncs
    :class:`HostSyncRecorder` records, while active, every call that makes (on CUDA) or would make (elsewhere) the
    host wait for the device, and attributes it to a source line with :class:`SourceClassifier`:

    - Everywhere, a :class:`~torch.overrides.TorchFunctionMode` sees every call into the PyTorch API and recognises
      the calls whose result the host must read (:data:`SYNC_CALLS`). A mode is thread-local and scoped (nothing
      in ``torch.Tensor`` is patched, other threads are unaffected) and it also catches functions such as
      ``torch.nonzero`` or boolean-mask indexing that method patching misses. Only the outermost call counts: a
      ``print(t)`` is one event, not the dozens of reads ``torch._tensor_str`` makes.
    - On CUDA the counts come from PyTorch's own detector, ``torch.cuda.set_sync_debug_mode("warn")``, switched
      on only while recording: every real synchronization, including those inside ops the list above does not
      know. The mode then only times the recognised calls: the wall time spent inside such a call is the time the
      host was stalled there.

Source attribution
    A sync belongs to the first frame, walking outwards from the call, that is not "library" code (PyTorch,
    NumPy, torchmetrics, the standard library, ...: they only carry out what their caller asked). If that frame is
    user code, the sync is the user's, reported at that line; if it is "framework" code (Lightning,
    lightning_gradkit), the sync is the framework's own (e.g. Lightning reading logged values), reported apart.

Graph leaks
    :func:`module_graph_tensors` walks a module tree's user attributes (lists, tuples, dicts, sets, deques,
    dataclasses, plain objects, nested) for tensors that still carry ``grad_fn``; :class:`OlderGraph` keeps those
    whose graph reaches a node created before an :func:`autograd_sequence_marker` (autograd numbers its nodes in
    creation order); :func:`graph_footprint` counts the distinct graphs such tensors keep alive, their nodes and the
    memory they pin.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import linecache
import math
import os
import site
import sys
import sysconfig
import time
import types
import warnings
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_gradkit.events import EventLog

if TYPE_CHECKING:
    import lightning.pytorch as pl

# -- source attribution ------------------------------------------------------------------------------------------

LIBRARY, FRAMEWORK, USER = 0, 1, 2

#: Packages that only carry out what their caller asked: a sync inside them is charged to the caller.
LIBRARY_PACKAGES = ("torch", "functorch", "numpy", "torchmetrics", "lightning_utilities", "typing_extensions")
#: Packages that run the user's code: a sync they make themselves is theirs, not the user's.
FRAMEWORK_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_gradkit")

_THIS_FILE = os.path.realpath(__file__)


def package_dirs(names: Iterable[str]) -> list[str]:
    """The source directories of the importable top-level packages among ``names`` (the others are ignored)."""
    dirs: list[str] = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        locations = list(spec.submodule_search_locations or [])
        if not locations and spec.origin:
            locations = [spec.origin]
        dirs.extend(_as_prefix(loc) for loc in locations)
    return dirs


def _as_prefix(path: str) -> str:
    real = os.path.realpath(path)
    return real if real.endswith(".py") else real.rstrip(os.sep) + os.sep


class SourceClassifier:
    """Sorts source files into library, framework and user code, by path; cached per file name.

    Args:
        library_packages: extra top-level packages to treat as library code (their frames are skipped when
            attributing a sync, which is then charged to the line that called into them).

    Example::

        >>> classifier = SourceClassifier()
        >>> classifier.category(torch.__file__) == LIBRARY
        True
    """

    def __init__(self, library_packages: Sequence[str] = ()) -> None:
        self._library = tuple(package_dirs([*LIBRARY_PACKAGES, *library_packages]))
        self._framework = tuple(package_dirs(FRAMEWORK_PACKAGES))
        paths = sysconfig.get_paths()
        self._stdlib = tuple({_as_prefix(paths[k]) for k in ("stdlib", "platstdlib") if paths.get(k)})
        site_dirs = [
            *getattr(site, "getsitepackages", list)(),
            site.getusersitepackages(),
            paths.get("purelib"),
            paths.get("platlib"),
        ]
        self._site = tuple({_as_prefix(d) for d in site_dirs if d})
        self._cache: dict[str, int] = {}

    def category(self, filename: str) -> int:
        """``LIBRARY``, ``FRAMEWORK`` or ``USER`` for a code object's ``co_filename``."""
        found = self._cache.get(filename)
        if found is None:
            found = self._cache[filename] = self._classify(filename)
        return found

    def _classify(self, filename: str) -> int:
        if filename.startswith("<frozen") or filename.startswith("<built-in"):
            return LIBRARY
        if filename.startswith("<"):  # "<stdin>", "<string>", notebook cells: written by the user
            return USER
        path = os.path.realpath(filename)
        if path == _THIS_FILE:  # the interceptor itself is transparent
            return LIBRARY
        if path.startswith(self._library):
            return LIBRARY
        if path.startswith(self._framework):
            return FRAMEWORK
        if path.startswith(self._stdlib) and not path.startswith(self._site):
            return LIBRARY
        return USER

    def attribute(self, frame: types.FrameType | None) -> tuple[int, str, int, str]:
        """``(category, filename, lineno, function)`` of the first non-library frame from ``frame`` outwards."""
        while frame is not None:
            code = frame.f_code
            category = self.category(code.co_filename)
            if category != LIBRARY:
                return category, code.co_filename, frame.f_lineno, code.co_name
            frame = frame.f_back
        return FRAMEWORK, "<unknown>", 0, ""


# -- host-sync interception --------------------------------------------------------------------------------------


def _always_syncing() -> dict[Callable[..., Any], str]:
    t = torch.Tensor
    calls: dict[Callable[..., Any], str] = {
        # values read by the host (`aten::_local_scalar_dense` or a device-to-host copy)
        t.item: "item",
        t.__bool__: "bool",
        t.__int__: "int",
        t.__float__: "float",
        t.__complex__: "complex",
        t.__index__: "index",
        t.tolist: "tolist",
        t.numpy: "numpy",
        t.__array__: "numpy",
        t.cpu: "cpu",
        t.__repr__: "repr",
        t.__format__: "format",
        t.__contains__: "contains",
        t.is_nonzero: "bool",
        torch.is_nonzero: "bool",
        t.equal: "equal",
        torch.equal: "equal",
        t.allclose: "allclose",
        torch.allclose: "allclose",
        # outputs whose size depends on the data: the host waits for the count
        t.nonzero: "nonzero",
        torch.nonzero: "nonzero",
        t.argwhere: "nonzero",
        torch.argwhere: "nonzero",
        t.masked_select: "masked_select",
        torch.masked_select: "masked_select",
        t.unique: "unique",
        torch.unique: "unique",
        t.unique_consecutive: "unique",
        torch.unique_consecutive: "unique",
        t.bincount: "bincount",
        torch.bincount: "bincount",
    }
    return calls


#: Calls that make the host wait for the device whenever their tensor lives on an accelerator. Three more are
#: recognised by their arguments: indexing with a boolean mask (``x[mask]``), ``torch.where(cond)`` with one
#: argument, ``repeat_interleave`` with tensor repeats and no ``output_size``, and ``.to("cpu")`` spelled with the
#: string ``"cpu"`` (``.to(device)`` with a ``torch.device`` is not counted: on a CPU run it cannot be told apart
#: from the harmless ``.to(self.device)``).
SYNC_CALLS: dict[Callable[..., Any], str] = _always_syncing()


def _is_mask(index: object) -> bool:
    if isinstance(index, Tensor):
        return index.dtype in (torch.bool, torch.uint8)
    if isinstance(index, (tuple, list)):
        return any(isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in index)
    return False


def sync_kind(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """The kind of host sync ``func(*args, **kwargs)`` makes on an accelerator, or ``None`` when it makes none."""
    kind = SYNC_CALLS.get(func)
    if kind is not None:
        return kind
    if func is Tensor.__getitem__:
        return "mask_index" if len(args) > 1 and _is_mask(args[1]) else None
    if func is torch.where:
        return "nonzero" if len(args) + len(kwargs) == 1 else None
    if func is torch.repeat_interleave or func is Tensor.repeat_interleave:
        if kwargs.get("output_size") is not None or (len(args) > 3 and args[3] is not None):
            return None
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if args else None)
        return "repeat_interleave" if isinstance(repeats, Tensor) else None
    if func is Tensor.to:
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        return "cpu" if isinstance(target, str) and target.startswith("cpu") else None
    return None


class _SyncInterceptor(TorchFunctionMode):
    """Calls ``on_sync(kind, caller_frame, seconds)`` after each recognised call; passes everything through."""

    def __init__(self, on_sync: Callable[[str, types.FrameType, float], None]) -> None:
        super().__init__()
        self._on_sync = on_sync

    def __torch_function__(
        self,
        func: Callable[..., Any],
        arg_types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        kind = sync_kind(func, args, kwargs)
        if kind is None:
            return func(*args, **kwargs)
        start = time.perf_counter()
        result = func(*args, **kwargs)
        self._on_sync(kind, sys._getframe(1), time.perf_counter() - start)
        return result


_CUDA_SYNC_MESSAGE = "called a synchronizing CUDA operation"

SiteKey = tuple[str, int, str]  # (filename, lineno, function)


@dataclass
class SiteTally:
    """What one source line did while recording: syncs, by kind, and the stall time measured inside them."""

    count: int = 0
    kinds: Counter[str] = field(default_factory=Counter)
    stall_seconds: float = 0.0
    timed: bool = False

    def merge(self, other: SiteTally) -> None:
        self.count += other.count
        self.kinds.update(other.kinds)
        self.stall_seconds += other.stall_seconds
        self.timed = self.timed or other.timed


@dataclass
class StepSyncs:
    """The syncs of one recorded step, split into the user's and the framework's, and the step's wall time."""

    user: dict[SiteKey, SiteTally]
    framework: dict[SiteKey, SiteTally]
    seconds: float
    method: str

    @property
    def user_total(self) -> int:
        return sum(t.count for t in self.user.values())

    @property
    def framework_total(self) -> int:
        return sum(t.count for t in self.framework.values())


class HostSyncRecorder:
    """Records host-device syncs between :meth:`start` and :meth:`stop`, attributed to source lines.

    Args:
        classifier: tells user, framework and library code apart.
        cuda: use PyTorch's CUDA sync detector for the counts (requires CUDA); otherwise count the recognised
            calls (:data:`SYNC_CALLS`), i.e. the syncs the same code would make with its tensors on a GPU.

    Example::

        >>> recorder = HostSyncRecorder(SourceClassifier())
        >>> recorder.start()
        >>> _ = torch.ones(2).sum().item()
        >>> step = recorder.stop()
        >>> step.user_total
        1
    """

    def __init__(self, classifier: SourceClassifier, cuda: bool = False) -> None:
        self.classifier = classifier
        self.cuda = cuda
        self.method = "cuda_sync_debug" if cuda else "intercepted_calls"
        self._mode: _SyncInterceptor | None = None
        self._sites: dict[tuple[int, str, int, str], SiteTally] = {}
        self._timed: dict[tuple[int, str, int, str], SiteTally] = {}
        self._start = 0.0
        self._warnings: warnings.catch_warnings | None = None
        self._previous_showwarning: Callable[..., None] | None = None
        self._previous_debug_mode = 0

    @property
    def active(self) -> bool:
        return self._mode is not None

    def start(self) -> None:
        if self._mode is not None:
            raise RuntimeError("HostSyncRecorder.start() called twice without stop().")
        self._sites = {}
        self._timed = {}
        if self.cuda:
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.filterwarnings("always", message=_CUDA_SYNC_MESSAGE, category=UserWarning)
            self._previous_showwarning = warnings.showwarning
            warnings.showwarning = self._on_warning
            self._previous_debug_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        self._mode = _SyncInterceptor(self._on_call)
        self._mode.__enter__()
        self._start = time.perf_counter()

    def stop(self) -> StepSyncs:
        """End the recording (exception-safe: always restores what :meth:`start` changed)."""
        seconds = time.perf_counter() - self._start
        mode, self._mode = self._mode, None
        try:
            if mode is not None:
                mode.__exit__(None, None, None)
        finally:
            if self._warnings is not None:
                torch.cuda.set_sync_debug_mode(self._previous_debug_mode)
                warnings.showwarning = self._previous_showwarning  # type: ignore[assignment]
                self._warnings.__exit__(None, None, None)
                self._warnings = None
        return self.snapshot(seconds)

    def snapshot(self, seconds: float | None = None) -> StepSyncs:
        """The syncs recorded so far (a copy; the recording goes on)."""
        if seconds is None:
            seconds = time.perf_counter() - self._start
        sites: dict[tuple[int, str, int, str], SiteTally] = {}
        if self.cuda:  # counts from the detector; kinds and stall times from the recognised calls at the same line
            for key, counted in self._sites.items():
                timed = self._timed.get(key)
                if timed is not None:
                    sites[key] = SiteTally(counted.count, Counter(timed.kinds), timed.stall_seconds, True)
                else:
                    sites[key] = SiteTally(counted.count, Counter({"sync": counted.count}))
        else:
            sites = {k: SiteTally(t.count, Counter(t.kinds), t.stall_seconds, t.timed) for k, t in self._timed.items()}
        user = {k[1:]: t for k, t in sites.items() if k[0] == USER}
        framework = {k[1:]: t for k, t in sites.items() if k[0] != USER}
        return StepSyncs(user, framework, seconds, self.method)

    def _on_call(self, kind: str, frame: types.FrameType, seconds: float) -> None:
        key = self.classifier.attribute(frame)
        tally = self._timed.get(key)
        if tally is None:
            tally = self._timed[key] = SiteTally(timed=self.cuda)
        tally.count += 1
        tally.kinds[kind] += 1
        tally.stall_seconds += seconds

    def _on_warning(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        if _CUDA_SYNC_MESSAGE not in str(message):
            assert self._previous_showwarning is not None
            self._previous_showwarning(message, category, filename, lineno, file, line)
            return
        key = self.classifier.attribute(sys._getframe(1))
        tally = self._sites.get(key)
        if tally is None:
            tally = self._sites[key] = SiteTally()
        tally.count += 1


# -- the aggregated table ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SyncSite:
    """One row of the sync report: a source line and the host syncs it made in the audited steps.

    Attributes:
        filename: absolute path of the source file.
        lineno: line number.
        function: the function the line belongs to.
        code: the source text of the line.
        syncs: syncs made at this line over all audited steps.
        steps: number of audited steps.
        kinds: syncs by kind (``"item"``, ``"bool"``, ``"cpu"``, ...; ``"sync"`` when only the CUDA detector saw it).
        stall_seconds: wall time the host spent inside these calls, where measured (CUDA), else ``None``.
        share: ``stall_seconds`` over the wall time of the audited steps, where measured, else ``None``.
    """

    filename: str
    lineno: int
    function: str
    code: str
    syncs: int
    steps: int
    kinds: dict[str, int]
    stall_seconds: float | None
    share: float | None

    @property
    def per_step(self) -> float:
        return self.syncs / self.steps if self.steps else 0.0

    @property
    def location(self) -> str:
        return f"{_short_path(self.filename)}:{self.lineno}"


def _short_path(filename: str) -> str:
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if rel.startswith("..") else rel


class SyncTable:
    """Sync counts per source line, aggregated over recorded steps; serialisable for checkpoints."""

    def __init__(self) -> None:
        self.steps = 0
        self.seconds = 0.0
        self.step_totals: list[int] = []
        self.user: dict[SiteKey, SiteTally] = {}
        self.framework: dict[SiteKey, SiteTally] = {}

    def add(self, step: StepSyncs) -> None:
        self.steps += 1
        self.seconds += step.seconds
        self.step_totals.append(step.user_total)
        for mine, theirs in ((self.user, step.user), (self.framework, step.framework)):
            for key, tally in theirs.items():
                mine.setdefault(key, SiteTally()).merge(tally)

    def rows(self, framework: bool = False) -> list[SyncSite]:
        """The report, most frequent first."""
        sites = self.framework if framework else self.user
        return sorted(
            (site_row(key, tally, self.steps, self.seconds) for key, tally in sites.items()),
            key=lambda row: (-row.syncs, row.filename, row.lineno),
        )

    def state_dict(self) -> dict[str, Any]:
        def dump(sites: dict[SiteKey, SiteTally]) -> list[list[Any]]:
            return [[*k, t.count, dict(t.kinds), t.stall_seconds, t.timed] for k, t in sites.items()]

        return {
            "steps": self.steps,
            "seconds": self.seconds,
            "step_totals": list(self.step_totals),
            "user": dump(self.user),
            "framework": dump(self.framework),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        def load(rows: list[list[Any]]) -> dict[SiteKey, SiteTally]:
            return {(f, int(n), fn): SiteTally(c, Counter(k), s, t) for f, n, fn, c, k, s, t in rows}

        self.steps = int(state["steps"])
        self.seconds = float(state["seconds"])
        self.step_totals = [int(v) for v in state["step_totals"]]
        self.user = load(state["user"])
        self.framework = load(state["framework"])


def site_row(key: SiteKey, tally: SiteTally, steps: int, seconds: float) -> SyncSite:
    filename, lineno, function = key
    stall = tally.stall_seconds if tally.timed else None
    return SyncSite(
        filename=filename,
        lineno=lineno,
        function=function,
        code=linecache.getline(filename, lineno).strip(),
        syncs=tally.count,
        steps=steps,
        kinds=dict(tally.kinds),
        stall_seconds=stall,
        share=stall / seconds if stall is not None and seconds > 0 else None,
    )


def format_sync_table(rows: Sequence[SyncSite], top_k: int) -> str:
    """The rows as a fixed-width text table (the ``top_k`` most frequent)."""
    lines = [f"{'syncs/step':>10}  {'stall':>6}  {'kind':<14}  where  |  code"]
    for row in rows[:top_k]:
        share = f"{row.share:6.1%}" if row.share is not None else f"{'-':>6}"
        kinds = ",".join(sorted(row.kinds))
        lines.append(f"{row.per_step:>10.2f}  {share}  {kinds:<14}  {row.location} ({row.function})  |  {row.code}")
    if len(rows) > top_k:
        lines.append(f"... and {len(rows) - top_k} more line(s)")
    return "\n".join(lines)


# -- graph leaks -------------------------------------------------------------------------------------------------

_PROBE: Tensor | None = None


def autograd_sequence_marker() -> int:
    """The sequence number autograd will give the next graph node created in this thread.

    Autograd numbers the nodes of each thread in creation order (``Node._sequence_nr()``), so a tensor whose
    ``grad_fn`` has a smaller number than a marker taken at the start of a step was created before that step.
    """
    global _PROBE
    if _PROBE is None:
        _PROBE = torch.zeros((), requires_grad=True)
    with torch.enable_grad():
        node = (_PROBE * 1).grad_fn
    assert node is not None
    return node._sequence_nr() + 1


class OlderGraph:
    """Tells whether a tensor's autograd graph reaches a node created before ``marker``.

    Such a graph outlived the step in which it was made: ``losses.append(loss)`` holds old output nodes, and
    ``total = total + loss`` makes a new node each step that links to all the old ones. A graph made entirely in
    the current step (``self.last_logits = logits``) does not qualify. ``AccumulateGrad`` nodes (numbered last by
    autograd) never count. Nodes found not to reach an old one are remembered across calls, so checking many tensors
    of one graph costs one walk.

    Autograd numbers nodes per thread; a graph built in another thread (e.g. a double-backward graph built by
    autograd's device threads) cannot be dated this way and may be reported.

    Args:
        marker: an :func:`autograd_sequence_marker` taken when the step started.
    """

    def __init__(self, marker: int) -> None:
        self.marker = marker
        self._clean: set[int] = set()
        self._alive: list[object] = []  # keeps walked node wrappers alive so that their ids stay unique

    def __call__(self, tensor: Tensor) -> bool:
        fn = tensor.grad_fn
        if fn is None:
            return False
        stack = [fn]
        walked: dict[int, object] = {}
        while stack:
            node = stack.pop()
            if node is None or id(node) in self._clean or id(node) in walked:
                continue
            if node._sequence_nr() < self.marker:
                return True
            walked[id(node)] = node
            stack.extend(f for f, _ in node.next_functions)
        self._clean.update(walked)
        self._alive.extend(walked.values())
        return False


@dataclass(frozen=True)
class GraphTensor:
    """A tensor found holding an autograd graph (a description: the tensor itself is not kept).

    Attributes:
        path: where it was found, e.g. ``pl_module.history[120]``.
        grad_fn: the name of its ``grad_fn`` node.
        shape: its shape.
        dtype: its dtype, as a string.
        device: its device, as a string.
    """

    path: str
    grad_fn: str
    shape: tuple[int, ...]
    dtype: str
    device: str

    @classmethod
    def describe(cls, path: str, tensor: Tensor) -> GraphTensor:
        return cls(path, type(tensor.grad_fn).__name__, tuple(tensor.shape), str(tensor.dtype), str(tensor.device))


def standard_attributes(*module_types: type[nn.Module]) -> frozenset[str]:
    """Instance attributes every module of these types has: their internals, as opposed to user state."""
    names: set[str] = set()
    for module_type in module_types:
        names.update(vars(module_type()))
    return frozenset(names)


_MAX_VISITS = 200_000
_SCALARS = (str, bytes, int, float, bool, complex, type(None))
_NOT_WALKED = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)
_NON_USER_PACKAGES = frozenset((*LIBRARY_PACKAGES, *FRAMEWORK_PACKAGES, "builtins"))


def _is_user_object(obj: object) -> bool:
    if isinstance(obj, _NOT_WALKED) or not hasattr(obj, "__dict__"):
        return False
    package = type(obj).__module__.partition(".")[0]
    return package not in _NON_USER_PACKAGES and package not in sys.stdlib_module_names


class _Walker:
    """Depth-first walk of an object tree for tensors with a ``grad_fn`` that ``select`` accepts."""

    def __init__(self, select: Callable[[Tensor], bool] | None, skip: frozenset[str], budget: int) -> None:
        self.select = select
        self.skip = skip
        self.budget = budget
        self.seen: set[int] = set()
        self.found: list[tuple[str, Tensor]] = []
        self.truncated = False

    def walk(self, obj: object, path: str) -> None:
        stack = [(obj, path)]
        while stack:
            obj, path = stack.pop()
            if isinstance(obj, Tensor):
                if obj.grad_fn is not None and (self.select is None or self.select(obj)):
                    self.found.append((path, obj))
                continue
            if isinstance(obj, _SCALARS) or id(obj) in self.seen:
                continue
            self.seen.add(id(obj))
            if len(self.seen) > self.budget:
                self.truncated = True
                return
            stack.extend(reversed(self._children(obj, path)))

    def _children(self, obj: object, path: str) -> list[tuple[object, str]]:
        if isinstance(obj, dict):
            return [(v, f"{path}[{k!r}]") for k, v in obj.items()]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return [(v, f"{path}.{k}") for k, v in zip(obj._fields, obj, strict=False)]
        if isinstance(obj, (list, tuple, deque)):
            return [(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        if isinstance(obj, (set, frozenset)):
            return [(v, f"{path}{{#{i}}}") for i, v in enumerate(obj)]
        if isinstance(obj, nn.Module):  # an unregistered module (e.g. a teacher kept in a list)
            children = [(v, f"{path}.{k}") for k, v in vars(obj).items() if k not in self.skip]
            return children + [(m, f"{path}.{k}") for k, m in obj._modules.items()]
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return [(getattr(obj, f.name, None), f"{path}.{f.name}") for f in dataclasses.fields(obj)]
        if isinstance(obj, types.SimpleNamespace) or _is_user_object(obj):
            return [(v, f"{path}.{k}") for k, v in vars(obj).items()]
        return []


def module_graph_tensors(
    module: nn.Module,
    root: str = "module",
    skip: frozenset[str] = frozenset(),
    select: Callable[[Tensor], bool] | None = None,
    budget: int = _MAX_VISITS,
) -> tuple[list[tuple[str, Tensor]], bool]:
    """Tensors with a ``grad_fn`` held in the user attributes of ``module`` and of its submodules.

    Parameters, buffers and the attributes named in ``skip`` (module internals, see :func:`standard_attributes`)
    are not walked; everything else is, recursively: lists, tuples, named tuples, dicts, sets, deques,
    dataclasses, ``SimpleNamespace`` and instances of classes outside PyTorch, Lightning and the standard library.

    Args:
        module: the root module.
        root: the name the paths start with.
        skip: attribute names not to walk.
        select: keeps only the tensors it accepts (e.g. an :class:`OlderGraph`); ``None`` keeps every tensor with a
            ``grad_fn``.
        budget: the most objects to visit; the walk stops there and reports itself truncated.

    Returns:
        ``([(path, tensor), ...], truncated)``, e.g. ``("module.history[3]", tensor)``.
    """
    walker = _Walker(select, skip, budget)
    named = list(module.named_modules())
    walker.seen.update(id(m) for _, m in named)
    for name, sub in named:
        prefix = f"{root}.{name}" if name else root
        for key, value in vars(sub).items():
            if key not in skip:
                walker.walk(value, f"{prefix}.{key}")
                if walker.truncated:
                    return walker.found, True
    return walker.found, False


def object_graph_tensors(
    obj: object, root: str, select: Callable[[Tensor], bool] | None = None
) -> list[tuple[str, Tensor]]:
    """Tensors with a ``grad_fn`` (that ``select`` accepts, if given) anywhere in a plain object tree."""
    walker = _Walker(select, frozenset(), _MAX_VISITS)
    walker.walk(obj, root)
    return walker.found


def gc_graph_tensors(select: Callable[[Tensor], bool], exclude: set[int]) -> list[tuple[str, Tensor]]:
    """Every live tensor with a ``grad_fn`` that ``select`` accepts and not in ``exclude`` (ids), by a GC scan.

    Each is named by where it is held: ``<module>.<name>[i]``, ``<module>.<Class>.<attr>[i]`` for a class attribute,
    ``<Type>.<attr>[key]``, ``<local 'x' in f (file)>``, or ``<gc>`` when no container or frame holds it. Naming costs
    three passes over the live objects (``gc.get_referrers`` of all found tensors at once, then of their containers,
    then of the dicts that hold those), however many tensors were found. Objects are tested by ``type()``, never by
    attribute access: some objects warn when touched (``torch.distributed.reduce_op`` warns that it is deprecated).
    """
    objects = gc.get_objects()
    held = [t for t in objects if issubclass(type(t), Tensor) and t.grad_fn is not None and id(t) not in exclude]
    del objects
    found = [t for t in held if select(t)]
    del held
    names = _name_tensors(found) if found else {}
    return [(names.get(id(t), "<gc>"), t) for t in found]


def _entries(container: object) -> list[tuple[object, object]]:
    if issubclass(type(container), dict):
        return list(container.items())  # type: ignore[attr-defined]
    if issubclass(type(container), (list, tuple, deque)):
        return list(enumerate(container))  # type: ignore[arg-type]
    return []


def _name_tensors(found: list[Tensor]) -> dict[int, str]:
    """``id(tensor) -> path`` for the found tensors that a container or a frame (outside this file) holds."""
    wanted = {id(t) for t in found}
    ours = {id(found)}
    containers: list[object] = []
    frames: list[types.FrameType] = []
    for ref in gc.get_referrers(*found):
        if id(ref) in ours:
            continue
        if type(ref) is types.FrameType:
            if os.path.realpath(ref.f_code.co_filename) != _THIS_FILE:
                frames.append(ref)
        elif issubclass(type(ref), (list, tuple, deque, dict)):
            containers.append(ref)
    owners = _owners(containers, ours | {id(containers), id(frames)})
    names: dict[int, str] = {}
    for container in containers:
        for key, value in _entries(container):
            if id(value) in wanted:
                names.setdefault(id(value), f"{owners[id(container)]}[{key!r}]")
    for frame in frames:
        for key, value in frame.f_locals.items():
            if id(value) in wanted:
                where = f"{frame.f_code.co_name} ({_short_path(frame.f_code.co_filename)})"
                names.setdefault(id(value), f"<local {key!r} in {where}>")
    return names


def _owners(containers: list[object], ignore: set[int]) -> dict[int, str]:
    """``id(container) -> name`` from the dict that holds each container and the object that holds that dict."""
    result = {id(c): f"<{type(c).__name__}>" for c in containers}
    if not containers:
        return result
    ids = set(result)
    holders: dict[int, tuple[dict, object]] = {}  # id(container) -> (the dict holding it, its key there)
    for ref in gc.get_referrers(*containers):
        if type(ref) is dict and id(ref) not in ignore and id(ref) not in ids:
            for key, value in ref.items():
                if id(value) in ids:
                    holders.setdefault(id(value), (ref, key))
    modules = {id(vars(m)): name for name, m in list(sys.modules.items()) if type(m) is types.ModuleType}
    dicts = {id(d): d for d, _ in holders.values()}
    dict_owner: dict[int, str] = {}
    for owner in gc.get_referrers(*dicts.values()) if dicts else []:
        if issubclass(type(owner), type):
            # A class attribute: the class holds its namespace dict behind a mappingproxy.
            for d, key in holders.values():
                if owner.__dict__.get(key) is d.get(key):
                    dict_owner.setdefault(id(d), f"{owner.__module__}.{owner.__qualname__}")
        elif id(_instance_dict(owner)) in dicts:
            dict_owner.setdefault(id(_instance_dict(owner)), f"<{type(owner).__name__}>")
    for container_id, (d, key) in holders.items():
        if id(d) in modules:
            result[container_id] = f"{modules[id(d)]}.{key}"
        elif id(d) in dict_owner:
            result[container_id] = f"{dict_owner[id(d)]}.{key}"
        else:
            result[container_id] = f"<dict>[{key!r}]"
    return result


def _instance_dict(obj: object) -> object:
    """``obj.__dict__`` without running the object's own ``__getattribute__`` (which may warn or fail)."""
    try:
        return object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return None


@dataclass
class GraphFootprint:
    """What a set of tensors keeps alive through their autograd graphs.

    Attributes:
        graphs: distinct graphs (tensors whose graphs share a node count once; the per-parameter
            ``AccumulateGrad`` nodes, shared by every step's graph, do not join graphs).
        nodes: graph nodes held (``AccumulateGrad`` excluded).
        tensor_bytes: bytes of the storages of the tensors themselves.
        saved_bytes: bytes of further storages kept by saved tensors not yet freed (``backward()`` frees the
            saved tensors of the nodes it runs; a graph never backpropagated keeps all of them). Parameters,
            buffers and storages already counted are excluded; tensors packed by saved-tensor hooks (activation
            checkpointing, CPU offload) are counted only when the packed object is itself a tensor or a tuple of
            tensors, and are never unpacked.
        truncated: the node walk stopped at its budget; the counts are lower bounds.
    """

    graphs: int = 0
    nodes: int = 0
    tensor_bytes: int = 0
    saved_bytes: int = 0
    truncated: bool = False

    @property
    def pinned_bytes(self) -> int:
        return self.tensor_bytes + self.saved_bytes


_MAX_NODES = 1_000_000
_SAVED_ATTRS: dict[type, tuple[str, ...]] = {}


def _storage(t: Tensor) -> tuple[tuple[str, int | None, int], int] | None:
    """``(key, nbytes)`` identifying the memory behind ``t``; ``None`` for meta tensors."""
    if t.device.type == "meta":
        return None
    try:
        storage = t.untyped_storage()
        return (t.device.type, t.device.index, storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested or wrapper subclasses
        return ("object", None, id(t)), t.numel() * t.element_size()


def storage_keys(tensors: Iterable[Tensor]) -> set[tuple[str, int | None, int]]:
    """The storage keys of ``tensors`` (e.g. a module's parameters and buffers, to exclude from a footprint)."""
    keys = set()
    for t in tensors:
        found = _storage(t)
        if found is not None:
            keys.add(found[0])
    return keys


def _saved_tensors(node: object) -> Iterator[Tensor]:
    """The tensors a graph node still holds for backward, read without running any unpack hook."""
    names = _SAVED_ATTRS.get(type(node))
    if names is None:
        names = _SAVED_ATTRS[type(node)] = tuple(n for n in dir(node) if n.startswith("_raw_saved_"))
    for name in names:
        try:
            value = getattr(node, name)
        except RuntimeError:
            continue
        for saved in value if isinstance(value, (list, tuple)) else (value,):
            data = getattr(saved, "data", None)  # SavedTensor.data: the tensor, the packed object, or None once freed
            if isinstance(data, Tensor):
                yield data
            elif isinstance(data, tuple):
                yield from (d for d in data if isinstance(d, Tensor))
    extra = getattr(node, "__dict__", None)  # custom autograd.Function: tensors stored on ctx
    if extra:
        yield from (v for v in extra.values() if isinstance(v, Tensor))


def graph_footprint(
    tensors: Sequence[Tensor], exclude: set[tuple[str, int | None, int]] | None = None, max_nodes: int = _MAX_NODES
) -> GraphFootprint:
    """Count the graphs, nodes and bytes that ``tensors`` keep alive through their ``grad_fn`` (see
    :class:`GraphFootprint`). ``exclude`` holds storage keys (:func:`storage_keys`) not to count."""
    counted = set(exclude or ())
    result = GraphFootprint()
    for t in tensors:
        found = _storage(t)
        if found is not None and found[0] not in counted:
            counted.add(found[0])
            result.tensor_bytes += found[1]

    parent = list(range(len(tensors)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    nodes: list[object] = []  # keeps the node wrappers alive so their ids stay unique during the walk
    for i, t in enumerate(tensors):
        stack = [t.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or type(node).__name__ == "AccumulateGrad":
                continue
            seen = owner.get(id(node))
            if seen is not None:
                parent[root(i)] = root(seen)
                continue
            if len(nodes) >= max_nodes:
                result.truncated = True
                break
            owner[id(node)] = i
            nodes.append(node)
            stack.extend(fn for fn, _ in node.next_functions)
    for node in nodes:
        for saved in _saved_tensors(node):
            found = _storage(saved)
            if found is not None and found[0] not in counted:
                counted.add(found[0])
                result.saved_bytes += found[1]
    result.nodes = len(nodes)
    result.graphs = len({root(i) for i in range(len(tensors))})
    return result


def steady_growth(values: Sequence[float], min_growth: float, min_r2: float = 0.9) -> float | None:
    """The growth per sample when ``values`` rise steadily, else ``None``.

    Steady: the least-squares slope is positive, a line explains at least ``min_r2`` of the variance
    (a single jump, such as optimizer state allocated at the first step, does not), and the values grew by at
    least ``min_growth`` from the first to the last.
    """
    n = len(values)
    if n < 3 or values[-1] - values[0] < min_growth:
        return None
    mean_x = (n - 1) / 2
    mean_y = math.fsum(values) / n
    sxy = math.fsum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    sxx = math.fsum((i - mean_x) ** 2 for i in range(n))
    syy = math.fsum((v - mean_y) ** 2 for v in values)
    if syy == 0 or sxy <= 0 or sxy * sxy / (sxx * syy) < min_r2:
        return None
    return sxy / sxx


# -- events ------------------------------------------------------------------------------------------------------


def _write_event(directory: str | Path, trainer: pl.Trainer, what: str, batch_idx: int, **details: Any) -> None:
    """Append one event for this rank's findings to ``<directory>/gradkit_events.jsonl``."""
    log = EventLog(Path(directory), rank=trainer.global_rank, every_rank=True)
    log.write(
        step=trainer.global_step,
        batch_idx=batch_idx,
        rank=trainer.global_rank,
        what=what,
        culprit=None,
        values={},
        **details,
    )
