"""Host-sync interception on plain PyTorch objects, for :class:`~lightning_gradkit.SyncAudit`: which calls make the
host wait for the device, and where (a source line, :mod:`lightning_gradkit.diagnostics.sources`).

A :class:`~torch.overrides.TorchFunctionMode` sees every call into the PyTorch API and recognises those whose result
the host must read (:data:`SYNC_CALLS`): thread-local and scoped (nothing in ``torch.Tensor`` is patched), it also
catches ``torch.nonzero`` or boolean-mask indexing, which method patching misses. Only the outermost call counts
(``print(t)`` is one event). On CUDA the counts come from PyTorch's own detector,
``torch.cuda.set_sync_debug_mode("warn")``, on only while recording, and the mode only times the recognised calls:
the wall time inside such a call is the time the host was stalled there.
"""

from __future__ import annotations

import linecache
import sys
import time
import types
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_gradkit.diagnostics.sources import USER, SourceClassifier, short_path

__all__ = [
    "SYNC_CALLS",
    "HostSyncRecorder",
    "SiteKey",
    "SiteTally",
    "StepSyncs",
    "SyncSite",
    "SyncTable",
    "format_sync_table",
    "site_row",
    "sync_kind",
]


#: Calls that make the host wait for the device whenever their tensor lives on an accelerator. Four more are
#: recognised by their arguments: indexing with a boolean mask (``x[mask]``), ``torch.where(cond)`` with one
#: argument, ``repeat_interleave`` with tensor repeats and no ``output_size``, and ``.to("cpu")`` spelled with the
#: string ``"cpu"`` (``.to(device)`` with a ``torch.device`` is not counted: on a CPU run it cannot be told apart
#: from the harmless ``.to(self.device)``).
SYNC_CALLS: dict[Callable[..., Any], str] = {
    # values read by the host (`aten::_local_scalar_dense` or a device-to-host copy)
    Tensor.item: "item",
    Tensor.__bool__: "bool",
    Tensor.__int__: "int",
    Tensor.__float__: "float",
    Tensor.__complex__: "complex",
    Tensor.__index__: "index",
    Tensor.tolist: "tolist",
    Tensor.numpy: "numpy",
    Tensor.__array__: "numpy",
    Tensor.cpu: "cpu",
    Tensor.__repr__: "repr",
    Tensor.__format__: "format",
    Tensor.__contains__: "contains",
    Tensor.is_nonzero: "bool",
    torch.is_nonzero: "bool",
    Tensor.equal: "equal",
    torch.equal: "equal",
    Tensor.allclose: "allclose",
    torch.allclose: "allclose",
    # outputs whose size depends on the data: the host waits for the count
    Tensor.nonzero: "nonzero",
    torch.nonzero: "nonzero",
    Tensor.argwhere: "nonzero",
    torch.argwhere: "nonzero",
    Tensor.masked_select: "masked_select",
    torch.masked_select: "masked_select",
    Tensor.unique: "unique",
    torch.unique: "unique",
    Tensor.unique_consecutive: "unique",
    torch.unique_consecutive: "unique",
    Tensor.bincount: "bincount",
    torch.bincount: "bincount",
}


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
        return f"{short_path(self.filename)}:{self.lineno}"


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
