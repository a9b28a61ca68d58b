"""What the gradient report reads and finds, without plotting (:mod:`gradkit.report.figure` draws it): a run's logged
series and events (:class:`RunData`, also the record of :class:`~gradkit.GradNormMonitor`), where its logged steps
fall on the step axis, and its incidents (the events that skipped a step, rolled back or escalated)."""

from __future__ import annotations

import bisect
import csv
import importlib.util
import itertools
import json
import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradkit.report.events import EVENTS_FILENAME as EVENTS_FILE
from gradkit.report.events import read_metadata

__all__ = [
    "INCIDENT_RADIUS",
    "INSTALL_HINT",
    "REPORT_FILE",
    "RISE_FACTOR",
    "Incident",
    "Record",
    "Rise",
    "RunData",
    "cell_reach",
    "choose_incidents",
    "event_label",
    "fill_reach",
    "first_rise",
    "heat_grid",
    "incident_grid",
    "incident_kind",
    "incident_windows",
    "is_incident",
    "is_sparse",
    "is_validation_event",
    "isolated_points",
    "left_out_text",
    "load_run",
    "logged_steps_text",
    "step_lattice",
]

REPORT_FILE = "gradient_report.png"
#: How to install matplotlib, for error messages: lightning_gradkit is installed from a checkout, not an index.
INSTALL_HINT = (
    "run `pip install -e '.[report]'` in the lightning_gradkit checkout (the package is on no package index), or "
    "`pip install 'matplotlib>=3.7'`"
)
_MODULE_PREFIX = "grad_norm/module/"
_RATIO_TOTAL = "update_ratio/total"
_RATIO_MODULE_PREFIX = "update_ratio/module/"
_TB_GLOB = "events.out.tfevents.*"
_MAX_COLUMNS = 2000  # heatmap columns; longer runs show the logged step nearest each column
_REACH_FRACTION = 0.01  # a logged value is drawn over at most this fraction of the run's steps either side
#: The steps either side of an event that an incident panel shows.
INCIDENT_RADIUS = 10
#: A module counts as risen when its norm is this many times its usual norm (its median before the incident).
RISE_FACTOR = 5.0


def _natural_key(name: str) -> list[Any]:
    """``blocks.2`` before ``blocks.10``: digit runs compare as numbers (they sit at odd positions of the split)."""
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", name))]


@dataclass
class RunData:
    """Per-step series of a run and its events.

    Attributes:
        series: metric name -> {optimizer step: value}.
        events: the records of ``gradkit_events.jsonl``.
        module_order: the modules (names after ``grad_norm/module/``) in model order, when the source knows it.
    """

    series: dict[str, dict[int, float]] = field(default_factory=lambda: defaultdict(dict))
    events: list[dict] = field(default_factory=list)
    module_order: list[str] = field(default_factory=list)

    @property
    def modules(self) -> list[str]:
        """The logged modules: in ``module_order`` where it lists them, the others after them in natural order."""
        logged = {k[len(_MODULE_PREFIX) :] for k in self.series if k.startswith(_MODULE_PREFIX)}
        known = [m for m in self.module_order if m in logged]
        return known + sorted(logged.difference(known), key=_natural_key)

    @property
    def ratio_rows(self) -> list[str]:
        """The rows of the update-ratio panel: ``total`` (when logged), then the modules in :attr:`modules` order."""
        logged = {k[len(_RATIO_MODULE_PREFIX) :] for k in self.series if k.startswith(_RATIO_MODULE_PREFIX)}
        order = [m for m in self.modules if m in logged] + sorted(logged.difference(self.modules), key=_natural_key)
        return (["total"] if _RATIO_TOTAL in self.series else []) + order

    def module_series(self, module: str) -> dict[int, float]:
        """The logged gradient norms of a module of :attr:`modules`."""
        return self.series[_MODULE_PREFIX + module]

    def ratio_series(self, row: str) -> dict[int, float]:
        """The logged update ratios of a row of :attr:`ratio_rows`."""
        return self.series.get(_RATIO_TOTAL if row == "total" else _RATIO_MODULE_PREFIX + row, {})

    @property
    def has_grad_norms(self) -> bool:
        return any(k.startswith("grad_norm/") for k in self.series)

    @staticmethod
    def read_events(path: Path) -> list[dict]:
        """The events of a ``gradkit_events.jsonl`` file (none when it does not exist)."""
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _read_csv(path: Path, data: RunData) -> None:
    with path.open() as f:
        for row in csv.DictReader(f):
            step = row.get("step")
            if step in (None, ""):
                continue
            for key, value in row.items():
                if key != "step" and value not in (None, ""):
                    data.series[key][int(float(step))] = float(value)


def _read_tensorboard(log_dir: Path, data: RunData) -> None:
    """Scalars of the TensorBoard event files in ``log_dir``; tags keep the order they were first logged in."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    for path in sorted(log_dir.glob(_TB_GLOB)):
        accumulator = EventAccumulator(str(path), size_guidance={SCALARS: 0})
        accumulator.Reload()
        tags = accumulator.Tags()[SCALARS]
        for tag in tags:
            for event in accumulator.Scalars(tag):
                data.series[tag][int(event.step)] = float(event.value)
        data.module_order += [t[len(_MODULE_PREFIX) :] for t in tags if t.startswith(_MODULE_PREFIX)]


def load_run(log_dir: str | Path) -> RunData:
    """Read a run directory: ``metrics.csv``, TensorBoard event files, ``gradkit_events.jsonl``.

    Raises:
        FileNotFoundError: if ``log_dir`` is not a directory or holds none of these files (the message names the
            run directories below it, if any).
        ModuleNotFoundError: if the directory holds only TensorBoard files and tensorboard is not installed.
    """
    log_dir = Path(log_dir)
    if not log_dir.is_dir():
        raise FileNotFoundError(
            f"{log_dir} is not a directory. Pass the directory of a run logged with `CSVLogger` or `TensorBoardLogger` "
            "(its `log_dir`, e.g. lightning_logs/version_0)."
        )
    metrics, events = log_dir / "metrics.csv", log_dir / EVENTS_FILE
    tb_files = sorted(log_dir.glob(_TB_GLOB))
    if not metrics.exists() and not events.exists() and not tb_files:
        runs = sorted({p.parent for pattern in ("*/metrics.csv", f"*/{_TB_GLOB}") for p in log_dir.glob(pattern)})
        hint = f" It has run directories below it: {', '.join(str(r) for r in runs[-3:])}." if runs else ""
        raise FileNotFoundError(
            f"{log_dir} has no metrics.csv, no TensorBoard event file and no {EVENTS_FILE}. Pass the directory of a "
            f"run logged with `CSVLogger` or `TensorBoardLogger` (its `log_dir`, e.g. lightning_logs/version_0).{hint}"
        )
    data = RunData()
    if metrics.exists():
        _read_csv(metrics, data)
    if tb_files:
        if importlib.util.find_spec("tensorboard") is None:
            if not metrics.exists():
                raise ModuleNotFoundError(
                    f"{log_dir} holds TensorBoard event files; reading them needs tensorboard: "
                    "`pip install tensorboard`."
                )
        else:
            _read_tensorboard(log_dir, data)
    data.events = RunData.read_events(events)
    # GradNormMonitor writes the model order of the rows next to the logs (metrics.csv sorts its columns by name).
    order = read_metadata(log_dir).get("module_order")
    if isinstance(order, list):
        data.module_order = [str(m) for m in order]
    return data


def _log10(value: float) -> float:
    return math.log10(value) if value > 0 and math.isfinite(value) else math.nan


def cell_reach(steps: list[int]) -> float:
    """How many steps either side of a logged step its value is drawn over: half a step, or 1% of the run.

    A value stands for its own step only. Stretching it over the steps nearest to it keeps a dense log readable (a
    column per logged step would be a hair's width in a long run), but in a sparse log it would paint blocks of
    steps that logged nothing: a logged value reaches at most 1% of the run's steps either side.

    Example::

        >>> cell_reach([0, 9]), cell_reach([0, 500, 999])
        (0.5, 9.99)
    """
    return max(0.5, _REACH_FRACTION * (steps[-1] - steps[0]))


def is_sparse(steps: list[int]) -> bool:
    """Whether the logged steps lie further apart than their values reach (:func:`cell_reach`): then the heatmap
    shows blank columns between them and the lines of the lower panel mark every logged point.

    Example::

        >>> is_sparse([0, 9]), is_sparse(list(range(0, 300, 5)))
        (True, False)
    """
    if len(steps) <= 2:
        return True
    return statistics.median(b - a for a, b in itertools.pairwise(steps)) > 2 * cell_reach(steps)


def step_lattice(
    steps: list[int], max_columns: int = _MAX_COLUMNS, reach: float = math.inf
) -> tuple[list[int], list[int | None]]:
    """Evenly spaced heatmap columns over ``steps`` and, for each, the index of the nearest logged step.

    Logged steps are not evenly spaced (the first and last step of a run join the logging period), and ``imshow``
    draws evenly spaced columns: one column per step (or per ``width`` steps in a long run) puts every value at its
    own step, the same x as in the panel below. A column further than ``reach`` steps from every logged step gets
    ``None``: nothing was logged there.

    Example::

        >>> step_lattice([0, 4, 9])
        ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 0, 0, 1, 1, 1, 1, 2, 2, 2])
        >>> step_lattice([0, 4, 9], reach=0.5)[1]
        [0, None, None, None, 1, None, None, None, None, 2]
    """
    first, last = steps[0], steps[-1]
    width = max(1, math.ceil((last - first + 1) / max_columns))
    columns = list(range(first, last + 1, width))
    nearest: list[int | None] = []
    for x in columns:
        i = bisect.bisect_left(steps, x)
        if i == len(steps) or (i > 0 and x - steps[i - 1] <= steps[i] - x):
            i -= 1
        nearest.append(i if abs(steps[i] - x) <= reach else None)
    return columns, nearest


def logged_steps_text(steps: list[int]) -> str:
    """How many optimizer steps logged gradient norms, for a title.

    Example::

        >>> logged_steps_text([0, 9])
        '2 of 10 steps logged (0-9; faded: the nearest logged value, not measured there)'
        >>> logged_steps_text([0, 1, 2])
        'every step logged (0-2)'
    """
    total = steps[-1] - steps[0] + 1
    if len(steps) == total:
        return f"every step logged ({steps[0]}-{steps[-1]})"
    faded = "; faded: the nearest logged value, not measured there" if is_sparse(steps) else ""
    return f"{len(steps)} of {total} steps logged ({steps[0]}-{steps[-1]}{faded})"


def heat_grid(
    series: list[dict[int, float]], steps: list[int], filled: bool = False
) -> tuple[list[list[float]], tuple[float, ...]]:
    """log10 of each series on the heatmap's columns over ``steps`` (NaN where nothing was logged), and the extent.

    ``filled``: every column takes the value of the logged step nearest to it, up to half the usual gap between
    logged steps either side (:func:`fill_reach`): the faded layer that keeps a sparse log from reading as a barcode
    of one-step columns. A gap much longer than the usual one (a stretch with nothing logged) stays blank.

    Example::

        >>> heat_grid([{0: 10.0, 4: 100.0}], [0, 4])[0]
        [[1.0, nan, nan, nan, 2.0]]
        >>> heat_grid([{0: 10.0, 4: 100.0}], [0, 4], filled=True)[0]
        [[1.0, 1.0, 1.0, 2.0, 2.0]]
    """
    columns, nearest = step_lattice(steps, reach=fill_reach(steps) if filled else cell_reach(steps))
    width = columns[1] - columns[0] if len(columns) > 1 else 1
    grid = []
    for values in series:
        logged = [_log10(values.get(s, math.nan)) for s in steps]
        grid.append([math.nan if i is None else logged[i] for i in nearest])
    return grid, (columns[0] - width / 2, columns[-1] + width / 2, len(series) - 0.5, -0.5)


def fill_reach(steps: list[int]) -> float:
    """How far the faded layer of a sparse heatmap carries a logged value: half the median gap between logged
    steps (so the usual logging interval is covered end to end), at least :func:`cell_reach`.

    Example::

        >>> fill_reach([0, 49, 99, 149]), fill_reach([0, 1, 2])
        (25.0, 0.5)
    """
    if len(steps) < 2:
        return cell_reach(steps) if steps else 0.5
    return max(cell_reach(steps), statistics.median(b - a for a, b in itertools.pairwise(steps)) / 2)


# -- incidents: the events that skipped a step, rolled back or escalated, and where each began ----------------------
#: Events that are incidents whatever their ``action``.
_INCIDENT_WHATS = ("rollback", "rollback_stopped", "escalation")


def is_incident(event: dict) -> bool:
    """Whether an event gets an incident panel: a training step a guard skipped or stopped on, a rollback, an
    escalation (validation events and warnings do not).

    Example::

        >>> is_incident({"what": "spike", "action": "skip", "step": 4}), is_incident({"what": "spike", "step": 4})
        (True, False)
    """
    if not isinstance(event.get("step"), (int, float)) or is_validation_event(event):
        return False
    return event.get("action") in ("skip", "raise") or event.get("what") in _INCIDENT_WHATS


@dataclass
class Incident:
    """Events close together and the steps their panel shows.

    Attributes:
        first: the first step shown (``INCIDENT_RADIUS`` before the first event, or the run's first step).
        last: the last step shown.
        events: the events, in step order.
    """

    first: int
    last: int
    events: list[dict]

    @property
    def steps(self) -> list[int]:
        return list(range(self.first, self.last + 1))

    @property
    def event_steps(self) -> list[int]:
        return sorted({int(e["step"]) for e in self.events})


def incident_windows(events: list[dict], radius: int = INCIDENT_RADIUS, run_end: int | None = None) -> list[Incident]:
    """One :class:`Incident` per group of incident events (:func:`is_incident`) whose windows of ``radius`` steps
    either side overlap: a run of skipped steps and the rollback that ends it make one panel. The windows stop at
    step 0 and at ``run_end`` (the run's last step), when given.

    Example::

        >>> events = [{"step": s, "what": "spike", "action": "skip"} for s in (3, 5, 40)]
        >>> [(i.first, i.last, i.event_steps) for i in incident_windows(events)]
        [(0, 15, [3, 5]), (30, 50, [40])]
    """
    found = sorted((e for e in events if is_incident(e)), key=lambda e: int(e["step"]))
    out: list[Incident] = []
    for event in found:
        step = int(event["step"])
        if out and step - radius <= out[-1].last:
            out[-1].events.append(event)
            out[-1].last = step + radius
        else:
            out.append(Incident(max(0, step - radius), step + radius, [event]))
    if run_end is not None:
        for incident in out:
            incident.last = max(min(incident.last, run_end), incident.event_steps[-1])
    return out


def incident_kind(incident: Incident) -> tuple[str, ...]:
    """What an incident is, for choosing panels: the labels of its events (:func:`event_label`), each once."""
    return tuple(sorted({event_label(e) for e in incident.events}))


def choose_incidents(incidents: list[Incident], limit: int) -> tuple[list[Incident], list[Incident]]:
    """The incidents that get a panel, at most ``limit``, in step order, and those left out.

    The rarest kinds first (:func:`incident_kind`: a rollback among 38 routine skips), then the latest: the run's
    last incidents say most about where it ended.

    Example::

        >>> skip = [{"what": "spike", "action": "skip"}]
        >>> skips = [Incident(s - 10, s + 10, [{"step": s, **skip[0]}]) for s in range(0, 900, 100)]
        >>> rollback = Incident(440, 460, [{"step": 450, "what": "rollback"}])
        >>> shown, left = choose_incidents([*skips, rollback], 3)
        >>> [i.event_steps[0] for i in shown], len(left)
        ([450, 700, 800], 7)
    """
    if len(incidents) <= limit:
        return list(incidents), []
    counts: dict[tuple[str, ...], int] = defaultdict(int)
    for incident in incidents:
        counts[incident_kind(incident)] += 1
    ranked = sorted(incidents, key=lambda i: (counts[incident_kind(i)], -i.event_steps[-1]))
    shown = sorted(ranked[:limit], key=lambda i: i.event_steps[0])
    left = sorted(ranked[limit:], key=lambda i: i.event_steps[0])
    return shown, left


def left_out_text(left: list[Incident], most: int = 3) -> str:
    """The incidents without a panel, in a few words: how many of each kind, between which steps.

    Example::

        >>> skips = [Incident(s - 10, s + 10, [{"step": s, "what": "spike", "action": "skip"}]) for s in (30, 90)]
        >>> left_out_text(skips)
        '2 x spike (step skipped) at steps 30-90'
    """
    kinds: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for incident in left:
        kinds[incident_kind(incident)].append(incident.event_steps[0])
    ordered = sorted(kinds.items(), key=lambda item: -len(item[1]))
    parts = []
    for kind, steps in ordered[:most]:
        where = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
        parts.append(f"{len(steps)} x {' + '.join(kind)} at {where}")
    if len(ordered) > most:
        parts.append(f"{sum(len(s) for _, s in ordered[most:])} more of {len(ordered) - most} other kinds")
    return "; ".join(parts)


def incident_grid(series: list[dict[int, float]], steps: list[int], before: int | None = None) -> list[list[float]]:
    """log10 of each series over ``steps`` divided by its median before the incident (NaN where nothing finite was
    logged).

    Each row is normalized by the median of its own finite positive values at the steps before ``before`` (the
    first event's step: the module's usual norm before the incident; the whole window when no step precedes it),
    so a module that went ten times its usual norm reads +1 whatever its scale. A non-finite value stays
    non-finite (NaN or inf).

    Example::

        >>> incident_grid([{0: 1.0, 1: 1.0, 2: 100.0}, {0: 5.0, 2: 5.0}], [0, 1, 2], before=2)
        [[0.0, 0.0, 2.0], [0.0, nan, 0.0]]
    """
    grid = []
    for values in series:
        window = [values.get(s, math.nan) for s in steps]
        finite = [v for s, v in zip(steps, window, strict=True) if math.isfinite(v) and v > 0]
        usual = [values[s] for s in steps if before is not None and s < before and values.get(s, 0.0) > 0]
        usual = [v for v in usual if math.isfinite(v)] or finite
        median = statistics.median(usual) if usual else math.nan
        grid.append(
            [(v if v == math.inf else math.nan) if not math.isfinite(v) else _log10(v / median) for v in window]
        )
    return grid


@dataclass
class Rise:
    """Where an incident began: the earliest step at which some module rose, and which modules rose there.

    Attributes:
        step: the step.
        rows: the modules that rose there, most first (a non-finite one before any finite one).
        factors: for each, its norm over its usual (median) norm; ``inf`` for a non-finite value.
    """

    step: int
    rows: list[str]
    factors: list[float]


def first_rise(
    rows: list[str], series: list[dict[int, float]], grid: list[list[float]], steps: list[int]
) -> Rise | None:
    """The modules whose norm rose first: the earliest step at which a row is non-finite or :data:`RISE_FACTOR`
    times its usual norm (``grid``, from :func:`incident_grid`), with every row that rose there; ``None`` if none
    rose.

    Example::

        >>> series = [{0: 1.0, 1: 1.0, 2: 50.0}, {0: 1.0, 1: 1.0, 2: 1.0}]
        >>> first_rise(["a", "b"], series, incident_grid(series, [0, 1, 2], before=2), [0, 1, 2])
        Rise(step=2, rows=['a'], factors=[50.0])
    """
    threshold = math.log10(RISE_FACTOR)
    for j, step in enumerate(steps):
        risen = []
        for i, row in enumerate(rows):
            raw = series[i].get(step)
            if raw is not None and not math.isfinite(raw):
                risen.append((math.inf, -i, row))
            elif math.isfinite(grid[i][j]) and grid[i][j] >= threshold:
                risen.append((10 ** grid[i][j], -i, row))
        if risen:
            risen.sort(reverse=True)  # most first; equal factors in model order
            return Rise(step, [r[2] for r in risen], [round(r[0], 6) for r in risen])
    return None


def isolated_points(values: list[float]) -> list[int]:
    """Positions of the finite values with no finite neighbour: a line through the others never reaches them.

    Example::

        >>> isolated_points([1.0, math.nan, 2.0, math.nan, 3.0, 4.0])
        [0, 2]
    """
    finite = [math.isfinite(v) for v in values]
    return [
        i
        for i, ok in enumerate(finite)
        if ok and not (i > 0 and finite[i - 1]) and not (i + 1 < len(finite) and finite[i + 1])
    ]


#: Events found in validation (``NonFiniteGuard``'s ``nonfinite_val_loss``, ``InferenceModeValidation``'s
#: ``validation_non_finite``): they skip no optimizer step, whatever the guard's ``action``.
_VALIDATION_EVENT = re.compile(r"(^|_)val(idation)?(_|$)")


def is_validation_event(event: dict) -> bool:
    """Whether an event was found in validation, where no optimizer step is taken (nor skipped)."""
    return bool(_VALIDATION_EVENT.search(str(event.get("what", ""))))


def event_label(event: dict) -> str:
    """What an event of ``gradkit_events.jsonl`` says happened, for the legend.

    Example::

        >>> event_label({"what": "nonfinite_grads", "action": "skip"})
        'nonfinite_grads (step skipped)'
        >>> event_label({"what": "nonfinite_val_loss", "action": "skip", "stopped": False})
        'nonfinite_val_loss (in validation)'
    """
    what = str(event.get("what", "event"))
    if is_validation_event(event):
        return f"{what} (in validation{', training stopped' if event.get('stopped') else ''})"
    if event.get("action") == "skip":
        return f"{what} (step skipped)"
    return what


class Record:
    """The values :class:`~gradkit.GradNormMonitor` logged, kept on the host for the report (rank 0,
    ``report=True``).

    Past ``max_steps`` logged steps every other one is dropped (and from then on only every other one kept), so a
    long run at a short logging period keeps a bounded record: the figure cannot show more columns anyway.
    """

    def __init__(self, max_steps: int = 4096) -> None:
        self.max_steps = max_steps
        self.steps: list[int] = []
        self.values: list[dict[str, float]] = []
        self.module_order: list[str] = []
        self._stride = 1
        self._seen = 0

    def add(self, step: int, values: dict[str, float], modules: list[str], suffix: str) -> None:
        if not self.module_order:
            self.module_order = [name + suffix for name in modules]
        self._seen += 1
        if (self._seen - 1) % self._stride:
            return
        if self.steps and self.steps[-1] == step:  # a second optimizer logged at the same step
            self.values[-1].update(values)
            return
        self.steps.append(step)
        self.values.append(values)
        if len(self.steps) > self.max_steps:
            self.steps, self.values = self.steps[::2], self.values[::2]
            self._stride *= 2

    def merge(self, step: int, values: dict[str, float]) -> None:
        """Add values measured after the step (the update ratio) to the record of ``step``, if it was kept."""
        if self.steps and self.steps[-1] == step:
            self.values[-1].update(values)

    def run_data(self, events: list[dict]) -> RunData:
        data = RunData(events=events, module_order=self.module_order)
        for step, values in zip(self.steps, self.values, strict=True):
            for key, value in values.items():
                data.series[key][step] = value
        return data
