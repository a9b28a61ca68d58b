"""A JSON-lines event log next to the run's logs: ``gradkit_events.jsonl``.

Callbacks that detect something (a non-finite loss, a spike, a skipped step) write one JSON object per line with
the fields ``time``, ``step``, ``batch_idx``, ``rank``, ``what``, ``culprit``, ``values`` (and any extra fields
the caller adds). By default only global rank 0 writes (callers gather per-rank findings first); a log made with
``every_rank=True`` lets each rank append its own findings, each line written with one ``write`` on an ``O_APPEND``
descriptor so lines never interleave.

Writing an event never raises into training: when the file cannot be written (disk full, the path is a directory, a
read-only directory) the log warns once per file and training goes on without it.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "EVENTS_FILENAME",
    "METADATA_FILENAME",
    "SIGNALS_EVENT",
    "SIGNALS_PREFIX",
    "EventLog",
    "read_metadata",
    "write_metadata",
]


EVENTS_FILENAME = "gradkit_events.jsonl"
#: A small JSON record next to the events file: what the logged metrics alone do not tell a reader of the run, such
#: as the model order of the per-module rows (``CSVLogger`` sorts its columns by name).
METADATA_FILENAME = "gradkit_run.json"
#: The ``what`` of the event that holds the run's early-warning signal series (written at the end, for the report).
SIGNALS_EVENT = "signals"
#: The prefix of every logged early-warning signal (``signals/...``).
SIGNALS_PREFIX = "signals/"

# Files whose write already failed once in this process: the warning is given once per file.
_failed_paths: set[Path] = set()


def _warn_rank_zero(message: str) -> None:
    """A warning from global rank 0 only (every rank writes the same message)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        warnings.warn(message, UserWarning, stacklevel=3)


def _jsonable(value: Any) -> Any:
    """``value`` as plain JSON: tensors become numbers or lists, non-finite floats the strings ``"nan"``/``"inf"``."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


class EventLog:
    """Appends events as JSON lines to ``<directory>/gradkit_events.jsonl``: from global rank 0 only (``rank``: this
    process's), or from every rank with ``every_rank`` (findings local to a rank, e.g. host syncs).

    Example::

        >>> import tempfile
        >>> log = EventLog(Path(tempfile.mkdtemp()), rank=0)
        >>> log.write(step=3, batch_idx=3, rank=0, what="nonfinite_loss", culprit="encoder.2", values={"loss": 1.0})
        >>> log.read()[0]["culprit"]
        'encoder.2'
    """

    def __init__(self, directory: Path, rank: int = 0, every_rank: bool = False) -> None:
        self.path = Path(directory) / EVENTS_FILENAME
        self.rank = rank
        self.every_rank = every_rank

    def write(
        self,
        *,
        step: int,
        batch_idx: int,
        rank: int | list[int] | None,
        what: str,
        culprit: str | None,
        values: Mapping[str, Any],
        **extra: Any,
    ) -> None:
        """Append one event (a no-op on ranks other than 0, unless ``every_rank``).

        Never raises: an event that cannot be encoded or written is dropped with a warning (once per file).
        """
        if self.rank != 0 and not self.every_rank:
            return
        record = {
            "time": time.time(),
            "step": step,
            "batch_idx": batch_idx,
            "rank": rank,
            "what": what,
            "culprit": culprit,
            "values": values,
            **extra,
        }
        try:
            self._append(json.dumps(_jsonable(record), allow_nan=False) + "\n")
        except (OSError, TypeError, ValueError) as err:
            # A guard writes its event at the step it acts on: the event log must never be what stops training.
            self._warn_failed(err)

    def _append(self, line: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One write() of the whole line on an O_APPEND descriptor: a reader never sees half an event.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, line.encode())
        finally:
            os.close(fd)
        if written != len(line.encode()):
            raise OSError(f"wrote {written} of {len(line.encode())} bytes")

    def _warn_failed(self, err: Exception) -> None:
        if self.path in _failed_paths:
            return
        _failed_paths.add(self.path)
        message = (
            f"lightning_gradkit: could not write an event to {self.path} ({type(err).__name__}: {err}); training "
            "goes on, and later events that fail to be written are dropped silently. Free disk space or make the "
            "directory writable (it is the logger's directory, or `Trainer(default_root_dir=...)` without a logger)."
        )
        if self.every_rank:
            warnings.warn(f"[rank {self.rank}] {message}", stacklevel=3)
        else:
            _warn_rank_zero(message)

    def read(self) -> list[dict[str, Any]]:
        """All events written so far (empty when there is no file yet)."""
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def write_metadata(directory: str | Path, **fields: Any) -> None:
    """Merge ``fields`` into ``<directory>/gradkit_run.json`` (call on global rank 0 only), replaced in one
    ``os.replace`` (a reader never sees half of it); like the event log it never raises into training.

    Example::

        >>> import tempfile
        >>> directory = Path(tempfile.mkdtemp())
        >>> write_metadata(directory, module_order=["encoder", "head"])
        >>> read_metadata(directory)
        {'module_order': ['encoder', 'head']}
    """
    path = Path(directory) / METADATA_FILENAME
    try:
        record = {**read_metadata(directory), **_jsonable(fields)}
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(partial, path)
    except (OSError, TypeError, ValueError) as err:
        _warn_rank_zero(f"lightning_gradkit: could not write {path} ({type(err).__name__}: {err}); training goes on.")


def read_metadata(directory: str | Path) -> dict[str, Any]:
    """The record of ``<directory>/gradkit_run.json``; empty when there is none or it is not valid JSON."""
    path = Path(directory) / METADATA_FILENAME
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}
