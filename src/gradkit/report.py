"""The gradient report: one PNG of a run's gradient norms, clipping, skipped steps and events.

    python -m gradkit.report LOG_DIR [--out FILE]

``LOG_DIR`` is a run directory: a ``CSVLogger``'s (it holds ``metrics.csv``) or a ``TensorBoardLogger``'s (it holds
``events.out.tfevents.*``, read when tensorboard is installed), with the ``gradkit_events.jsonl`` that gradkit's
guards write there. ``GradNormMonitor(report=True)`` renders the same figure at the end of ``fit`` from the values
it logged, whatever the logger. The figure shows:

1. a heatmap of per-module gradient norms (``grad_norm/module/*``, log10) over optimizer steps, one row per module
   in model order (from the monitor, the ``gradkit_run.json`` it writes next to the logs, or a TensorBoard file;
   without them, from ``metrics.csv`` alone, whose columns ``CSVLogger`` sorts, in name order with numbers compared
   as numbers: ``blocks.2`` before ``blocks.10``). Its title says how many steps logged norms. A logged value is
   drawn over the steps nearest to it, at most 1% of the run either side: a sparse log (Lightning's default period
   in a short run) shows blank columns where nothing was logged;
2. below it, on the same step axis (integer ticks), the total gradient norm before and after clipping with the
   clipped steps marked (or "no step clipped"), a marker on every logged point when the log is sparse and on each
   point no line reaches (between two non-finite steps), the fraction of steps clipped
   (``grad_clip/clipped_fraction``) and the number of skipped steps (``gradkit/skipped_steps``) where logged;
3. every event of ``gradkit_events.jsonl`` (skipped steps, spikes, non-finite values, leaks, ...) as a line at its
   step, labelled with what happened ("step skipped" only for a training step a guard skipped; validation events
   dash-dotted); the events of one step share the height of the panel instead of hiding each other.
4. with ``GradNormMonitor(update_ratio=True)``, between the two: the update-to-weight ratio per module
   (``update_ratio/*``, log10) on the same step axis, coloured around the ``1e-3`` rule of thumb;
5. below them, one incident panel per group of events that skipped a step, rolled back or escalated
   (:func:`is_incident`; events within ``INCIDENT_RADIUS`` steps share a panel): each module's gradient norm over its
   usual norm (its median before the first event) for the 10 steps either side, the event steps framed, and in the
   title what happened, the culprit a replay named and the module that rose first (:func:`first_rise`). The
   panels need per-module norms at those steps: log every step to see an incident step by step.

matplotlib is an optional dependency, the ``report`` extra. The package is on no package index: run
``pip install -e '.[report]'`` in a checkout of lightning_gradkit (or ``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
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

from gradkit.events import EVENTS_FILENAME as EVENTS_FILE
from gradkit.events import read_metadata

__all__ = [
    "INCIDENT_RADIUS",
    "INSTALL_HINT",
    "RATIO_GUIDE",
    "REPORT_FILE",
    "RISE_FACTOR",
    "Incident",
    "Rise",
    "RunData",
    "build_figure",
    "cell_reach",
    "event_label",
    "first_rise",
    "incident_grid",
    "incident_windows",
    "is_incident",
    "is_sparse",
    "is_validation_event",
    "isolated_points",
    "load_run",
    "logged_steps_text",
    "main",
    "render",
    "render_data",
    "step_lattice",
]


REPORT_FILE = "gradient_report.png"
#: How to install matplotlib, for error messages: lightning_gradkit is installed from a checkout, not an index.
INSTALL_HINT = (
    "run `pip install -e '.[report]'` in the lightning_gradkit checkout (the package is on no package index), or "
    "`pip install 'matplotlib>=3.7'`"
)
_MODULE_PREFIX = "grad_norm/module/"
_TOTAL = "grad_norm/total"
_POST = "grad_norm/total_post_clip"
_CLIP_FRACTION = "grad_clip/clipped_fraction"
_SKIPPED = "gradkit/skipped_steps"
_RATIO_TOTAL = "update_ratio/total"
_RATIO_MODULE_PREFIX = "update_ratio/module/"
#: The update-to-weight ratio that the ratio panel centres its colours on (Karpathy's rule of thumb).
RATIO_GUIDE = 1e-3
_TB_GLOB = "events.out.tfevents.*"

# Figure geometry, in inches: panel heights stay fixed whatever the number of modules (the figure grows instead).
_WIDTH = 12.0
_ROW_HEIGHT = 0.2
_MAX_HEAT_HEIGHT = 11.0
_MIN_HEAT_HEIGHT = 1.4
_LABEL_HEIGHT = 0.12  # below this many inches per row, only every k-th module name is written
_TOTAL_HEIGHT = 2.6
_MAX_COLUMNS = 2000  # heatmap columns; longer runs show the logged step nearest each column
_REACH_FRACTION = 0.01  # a logged value is drawn over at most this fraction of the run's steps either side
# Incident panels: the steps either side of an event, panels per row, at most this many panels, rows' height.
INCIDENT_RADIUS = 10
_INCIDENT_COLUMNS = 2
_MAX_INCIDENTS = 8
_INCIDENT_ROW_HEIGHT = 0.16
_INCIDENT_MIN_HEIGHT = 0.9
_INCIDENT_MAX_HEIGHT = 4.0
_INCIDENT_TITLE = 0.62  # inches above each panel for its title (up to three lines)
_INCIDENT_BELOW = 0.45  # inches below each panel for its step labels
_INCIDENT_HEADER = 0.6  # inches above the first row for the section title (two lines)
_INCIDENT_RANGE = 2.0  # the colour scale spans 10**-2 .. 10**2 times a module's median
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


def render(log_dir: str | Path, out: str | Path | None = None) -> Path:
    """Render the report of the run in ``log_dir`` to a PNG and return its path.

    Args:
        log_dir: a run directory of a ``CSVLogger`` or a ``TensorBoardLogger``.
        out: where to write the PNG; defaults to ``log_dir/gradient_report.png``.

    Raises:
        FileNotFoundError: if ``log_dir`` holds no run (see :func:`load_run`).
        ModuleNotFoundError: if matplotlib is not installed (the ``report`` extra), or tensorboard for a
            TensorBoard-only run.
        ValueError: if the run logged no gradient norm and no event (nothing to draw).

    Example::

        >>> render("lightning_logs/version_0")  # doctest: +SKIP
        PosixPath('lightning_logs/version_0/gradient_report.png')
    """
    out = Path(out) if out is not None else Path(log_dir) / REPORT_FILE
    return render_data(load_run(log_dir), out, source=str(log_dir))


def render_data(data: RunData, out: str | Path, source: str = "the run") -> Path:
    """Render ``data`` to a PNG at ``out`` and return its path.

    Raises:
        ValueError: if ``data`` holds no gradient norm and no event.
    """
    if not data.has_grad_norms and not data.events:
        raise ValueError(
            f"{source} has no `grad_norm/*` metric and no event. Add `GradNormMonitor()` to the Trainer callbacks to "
            "record what the report draws (`GradNormMonitor(report=True)` draws it at the end of fit)."
        )
    fig = build_figure(data)
    out = Path(out)
    fig.savefig(out, dpi=110)
    _pyplot().close(fig)
    return out


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"The gradient report needs matplotlib, which is not installed: {INSTALL_HINT}."
        ) from err
    return plt


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


@dataclass
class _Layout:
    """Axes rectangles in inches, so all step panels get the same x extent whatever their labels.

    From the top: the module heatmap, the update-ratio heatmap (when logged), the totals with the events, then the
    incident panels (when there are incidents), ``_INCIDENT_COLUMNS`` to a row.
    """

    rows: int
    label_chars: int
    ratio_rows: int = 0
    incidents: int = 0

    @property
    def heat_height(self) -> float:
        return min(max(self.rows * _ROW_HEIGHT, _MIN_HEAT_HEIGHT), _MAX_HEAT_HEIGHT)

    @property
    def ratio_height(self) -> float:
        return min(max(self.ratio_rows * _ROW_HEIGHT, _MIN_HEAT_HEIGHT), _MAX_HEAT_HEIGHT) if self.ratio_rows else 0.0

    @property
    def left(self) -> float:
        return max(1.0, 0.3 + 0.062 * self.label_chars)

    right = 1.25
    top = 0.45
    gap = 0.55
    bottom = 1.35
    incident_gap = 0.3  # inches between incident panels side by side

    @property
    def ratio_top(self) -> float:
        return self.top + self.heat_height + self.gap

    @property
    def total_top(self) -> float:
        return self.ratio_top + (self.ratio_height + self.gap if self.ratio_rows else 0.0)

    @property
    def incident_top(self) -> float:
        return self.total_top + _TOTAL_HEIGHT + self.bottom

    @property
    def incident_height(self) -> float:
        return min(max(self.rows * _INCIDENT_ROW_HEIGHT, _INCIDENT_MIN_HEIGHT), _INCIDENT_MAX_HEIGHT)

    @property
    def incident_row_height(self) -> float:
        return _INCIDENT_TITLE + self.incident_height + _INCIDENT_BELOW

    @property
    def height(self) -> float:
        rows = math.ceil(self.incidents / _INCIDENT_COLUMNS)
        incidents = _INCIDENT_HEADER + rows * self.incident_row_height if rows else 0.0
        return self.incident_top + incidents

    def rect(self, y_from_top: float, h: float, fig_w: float = _WIDTH) -> list[float]:
        width = fig_w - self.left - self.right
        return [self.left / fig_w, 1 - (y_from_top + h) / self.height, width / fig_w, h / self.height]

    def bar_rect(self, y_from_top: float, h: float) -> list[float]:
        """A colour bar in the right margin, beside a panel."""
        return [
            (_WIDTH - self.right + 0.12) / _WIDTH,
            1 - (y_from_top + h) / self.height,
            0.15 / _WIDTH,
            h / self.height,
        ]

    def incident_rect(self, i: int) -> list[float]:
        """The ``i``-th incident panel: ``_INCIDENT_COLUMNS`` to a row, the first column under the step panels."""
        row, col = divmod(i, _INCIDENT_COLUMNS)
        width = (_WIDTH - self.left - self.right - (_INCIDENT_COLUMNS - 1) * self.incident_gap) / _INCIDENT_COLUMNS
        x = self.left + col * (width + self.incident_gap)
        y = self.incident_top + _INCIDENT_HEADER + row * self.incident_row_height + _INCIDENT_TITLE
        h = self.incident_height
        return [x / _WIDTH, 1 - (y + h) / self.height, width / _WIDTH, h / self.height]


def build_figure(data: RunData):
    """The report's matplotlib figure: module heatmap on top, the update-ratio heatmap (when logged), the total
    norms, clipping, skips and events, then one incident panel per event that skipped, rolled back or escalated.

    The step panels span the same x range at the same horizontal position (the colour bars sit in the right
    margin), so a step in a heatmap lies straight above the same step below. Every axes has a label that says what
    it is (``"gradient norm"``, ``"update ratio"``, ``"totals"``, ``"incident"``), for readers of the figure object.
    """
    plt = _pyplot()
    from matplotlib import ticker

    modules = data.modules
    ratio_rows = data.ratio_rows
    logged = [s for k, v in data.series.items() if k.startswith("grad_norm/") for s in v]
    incidents = incident_windows(data.events, run_end=max(logged) if logged else None)
    layout = _Layout(
        rows=max(len(modules), 1),
        label_chars=max((len(m) for m in modules), default=10),
        ratio_rows=len(ratio_rows),
        incidents=min(len(incidents), _MAX_INCIDENTS),
    )
    fig = plt.figure(figsize=(_WIDTH, layout.height))
    ax_heat = fig.add_axes(layout.rect(layout.top, layout.heat_height), label="gradient norm")
    ax_total = fig.add_axes(layout.rect(layout.total_top, _TOTAL_HEIGHT), sharex=ax_heat, label="totals")

    steps = sorted({s for k, v in data.series.items() if k.startswith("grad_norm/") for s in v})
    event_steps = [int(e["step"]) for e in data.events if isinstance(e.get("step"), (int, float))]
    span = steps + event_steps
    if modules and steps:
        grid, extent = _heat_grid([data.series[_MODULE_PREFIX + m] for m in modules], steps)
        image = ax_heat.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis", extent=extent)
        _row_labels(ax_heat, modules, layout.heat_height)
        fig.colorbar(
            image, cax=fig.add_axes(layout.bar_rect(layout.top, layout.heat_height)), label="log10 gradient norm"
        )
        _mark_nonfinite(ax_heat, [data.series[_MODULE_PREFIX + m] for m in modules])
    else:
        reason = (
            "no per-module norms logged: GradNormMonitor(depth=0)?"
            if data.has_grad_norms
            else "no `grad_norm/*` metric in this run: add GradNormMonitor() to the Trainer callbacks"
        )
        ax_heat.text(0.5, 0.5, reason, ha="center", va="center", transform=ax_heat.transAxes)
        ax_heat.set_yticks([])
    in_model_order = set(modules) <= set(data.module_order)
    order = "modules in model order" if in_model_order else "modules by name (numbers as numbers)"
    parts = ["Per-module gradient norm (log10)", order]
    if steps:
        parts.append(logged_steps_text(steps))
    ax_heat.set_title(", ".join(parts), fontsize=10)
    ax_heat.tick_params(labelbottom=False)
    if ratio_rows:
        ax_ratio = fig.add_axes(
            layout.rect(layout.ratio_top, layout.ratio_height), sharex=ax_heat, label="update ratio"
        )
        _draw_ratios(fig, ax_ratio, data, ratio_rows, steps, layout)

    _draw_totals(ax_total, data, sparse=bool(steps) and is_sparse(steps))
    _draw_events(ax_total, data.events)
    if span:
        ax_total.set_xlim(min(span) - 0.5, max(span) + 0.5)
    # Optimizer steps are whole numbers: no tick at 2.5 in a short run (else the ticks of matplotlib's default).
    ax_total.xaxis.set_major_locator(ticker.MaxNLocator(nbins="auto", steps=[1, 2, 2.5, 5, 10], integer=True))
    ax_total.set_xlabel("optimizer step")
    ax_total.set_ylabel("gradient norm")
    handles, labels = ax_total.get_legend_handles_labels()
    for twin in [a for a in fig.axes if a not in (ax_heat, ax_total) and a.get_label() == "clip fraction"]:
        more_handles, more_labels = twin.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    if handles:
        # Below the panel: a legend inside the axes would cover the data.
        ax_total.legend(
            handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=min(len(handles), 4), fontsize=8
        )
    if incidents:
        _draw_incidents(fig, data, incidents, layout)
    return fig


def logged_steps_text(steps: list[int]) -> str:
    """How many optimizer steps logged gradient norms, for a title.

    Example::

        >>> logged_steps_text([0, 9])
        '2 of 10 steps logged (0-9; blank: none logged)'
        >>> logged_steps_text([0, 1, 2])
        'every step logged (0-2)'
    """
    total = steps[-1] - steps[0] + 1
    if len(steps) == total:
        return f"every step logged ({steps[0]}-{steps[-1]})"
    blank = "; blank: none logged" if None in step_lattice(steps, reach=cell_reach(steps))[1] else ""
    return f"{len(steps)} of {total} steps logged ({steps[0]}-{steps[-1]}{blank})"


def _heat_grid(series: list[dict[int, float]], steps: list[int]) -> tuple[list[list[float]], tuple[float, ...]]:
    """log10 of each series on the heatmap's columns over ``steps`` (NaN where nothing was logged), and the extent."""
    columns, nearest = step_lattice(steps, reach=cell_reach(steps))
    width = columns[1] - columns[0] if len(columns) > 1 else 1
    grid = []
    for values in series:
        logged = [_log10(values.get(s, math.nan)) for s in steps]
        grid.append([math.nan if i is None else logged[i] for i in nearest])
    return grid, (columns[0] - width / 2, columns[-1] + width / 2, len(series) - 0.5, -0.5)


def _row_labels(ax, rows: list[str], height: float) -> None:
    """Name the rows, every k-th one when the rows are too thin for a label each."""
    every = max(1, math.ceil(_LABEL_HEIGHT * len(rows) / height))
    shown = range(0, len(rows), every)
    ax.set_yticks(list(shown), [rows[i] for i in shown], fontsize=7)


def _mark_nonfinite(ax, series: list[dict[int, float]]) -> None:
    """Logged but non-finite (NaN/Inf) cells in red; cells with nothing logged stay blank."""
    bad = [(s, row) for row, values in enumerate(series) for s, v in values.items() if not math.isfinite(v)]
    if bad:
        ax.scatter([b[0] for b in bad], [b[1] for b in bad], marker="s", color="red", s=14, label="non-finite")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, -0.02), fontsize=7, frameon=False)


def _draw_ratios(fig, ax, data: RunData, rows: list[str], steps: list[int], layout: _Layout) -> None:
    """The update-to-weight ratio per module (log10), coloured around :data:`RATIO_GUIDE`: white at 1e-3, red
    above (large updates: a high learning rate), blue below (small updates: a low one, or a module that does not
    train). A step that applied no update logged 0 and stays blank, like a step that logged nothing."""
    from matplotlib import ticker
    from matplotlib.colors import TwoSlopeNorm

    plt = _pyplot()
    series = [data.ratio_series(row) for row in rows]
    ratio_steps = sorted({s for values in series for s in values})
    grid, extent = _heat_grid(series, steps or ratio_steps)
    guide = math.log10(RATIO_GUIDE)
    finite = [v for row in grid for v in row if math.isfinite(v)]
    low = min([*finite, guide - 1.0])
    high = max([*finite, guide + 1.0])
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="0.85")
    norm = TwoSlopeNorm(vcenter=guide, vmin=low, vmax=high)
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm, extent=extent)
    _row_labels(ax, rows, layout.ratio_height)
    bar = fig.colorbar(image, cax=fig.add_axes(layout.bar_rect(layout.ratio_top, layout.ratio_height)))
    bar.set_label("update / weight", fontsize=8)
    bar.ax.axhline(guide, color="black", lw=1.2)
    bar.ax.yaxis.set_major_locator(ticker.MultipleLocator(1))
    bar.ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"1e{v:.0f}"))
    ax.set_title(
        "Update-to-weight ratio ||Δw|| / ||w|| per step (log10; white: the 1e-3 rule of thumb, red: larger, "
        "blue: smaller; grey: not logged or no update)",
        fontsize=10,
    )
    ax.tick_params(labelbottom=False)


# -- incidents: the per-module norms around each event that skipped, rolled back or escalated ------------------------
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


def _draw_incidents(fig, data: RunData, incidents: list[Incident], layout: _Layout) -> None:
    plt = _pyplot()
    from matplotlib import ticker
    from matplotlib.patches import Rectangle

    modules = data.modules
    rows = modules or ["total"]
    series = [data.series[_MODULE_PREFIX + m] for m in modules] or [data.series.get(_TOTAL, {})]
    shown = incidents[:_MAX_INCIDENTS]
    more = f" (the first {len(shown)} of {len(incidents)})" if len(incidents) > len(shown) else ""
    header_y = 1 - (layout.incident_top + _INCIDENT_HEADER - 0.05) / layout.height
    fig.text(
        layout.left / _WIDTH,
        header_y,
        f"Incidents{more}: per-module gradient norm / its usual norm (its median before the first event), log10;\n"
        "event steps framed, red: above usual, blue: below, grey: not logged, x: non-finite",
        fontsize=10,
    )
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="0.85")
    image = None
    for k, incident in enumerate(shown):
        ax = fig.add_axes(layout.incident_rect(k), label="incident")
        steps = incident.steps
        grid = incident_grid(series, steps, before=incident.event_steps[0])
        extent = (steps[0] - 0.5, steps[-1] + 0.5, len(rows) - 0.5, -0.5)
        image = ax.imshow(
            grid,
            aspect="auto",
            interpolation="nearest",
            cmap=cmap,
            vmin=-_INCIDENT_RANGE,
            vmax=_INCIDENT_RANGE,
            extent=extent,
        )
        if k % _INCIDENT_COLUMNS == 0:
            _row_labels(ax, rows, layout.incident_height)
        else:
            ax.set_yticks([])
        _mark_nonfinite_cells(ax, series, steps)
        for step in incident.event_steps:
            ax.add_patch(
                Rectangle((step - 0.5, -0.5), 1, len(rows), fill=False, edgecolor="black", lw=1.5, label="event")
            )
        ax.set_xlim(steps[0] - 0.5, steps[-1] + 0.5)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("optimizer step", fontsize=7, labelpad=1)
        ax.xaxis.set_major_locator(ticker.MaxNLocator(nbins=5, integer=True))
        ax.set_title(_incident_title(incident, first_rise(rows, series, grid, steps), len(rows)), fontsize=7.5)
    if image is not None:
        top = layout.incident_top + _INCIDENT_HEADER + _INCIDENT_TITLE
        bar = fig.colorbar(image, cax=fig.add_axes(layout.bar_rect(top, layout.incident_height)), extend="both")
        bar.set_label("log10 norm / usual norm", fontsize=8)


def _mark_nonfinite_cells(ax, series: list[dict[int, float]], steps: list[int]) -> None:
    bad = [(s, row) for row, values in enumerate(series) for s in steps if not math.isfinite(values.get(s, 0.0))]
    if bad:
        ax.scatter([b[0] for b in bad], [b[1] for b in bad], marker="x", color="black", s=12, lw=1, label="non-finite")


def _incident_title(incident: Incident, rise: Rise | None, rows: int) -> str:
    """What happened at which step(s), the culprit a replay named (if any), and where it began."""
    labels = list(dict.fromkeys(event_label(e) for e in incident.events))
    steps = incident.event_steps
    where = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]} ({len(incident.events)} events)"
    what = ", ".join(labels) if len(labels) <= 2 else f"{labels[0]}, {labels[1]} + {len(labels) - 2} more"
    culprits = list(dict.fromkeys(str(e["culprit"]) for e in incident.events if e.get("culprit")))
    lines = [f"{where}: {what}"]
    if culprits:
        lines.append(
            "culprit: " + ", ".join(culprits[:2]) + (f" (+{len(culprits) - 2} more)" if len(culprits) > 2 else "")
        )
    if rise is None:
        first = f"no module above {RISE_FACTOR:g}x its usual norm"
    elif math.isinf(rise.factors[0]):
        n = sum(math.isinf(f) for f in rise.factors)
        first = f"non-finite from step {rise.step}: " + (f"all {n} modules" if n == rows else ", ".join(rise.rows[:n]))
    else:
        more = f" (+{len(rise.rows) - 1} more)" if len(rise.rows) > 1 else ""
        first = f"first at step {rise.step}: {rise.rows[0]} {rise.factors[0]:.3g}x its usual norm{more}"
    return "\n".join([*lines, first])


def _clipped_count(fraction: dict[int, float]) -> tuple[int, int]:
    """``(clipped, steps)`` from fractions logged per logging interval (each covers the steps since the previous)."""
    steps = sorted(fraction)
    lengths = [steps[0] + 1] + [b - a for a, b in itertools.pairwise(steps)]
    return round(sum(fraction[s] * n for s, n in zip(steps, lengths, strict=True))), sum(lengths)


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


def _plot_series(ax, series: dict[int, float], sparse: bool, **style: Any) -> None:
    """A line through the logged values, with a marker on each when sparse, else on each isolated one."""
    steps = sorted(series)
    values = [series[s] for s in steps]
    if sparse:
        ax.plot(steps, values, marker="o", ms=3, **style)
        return
    isolated = isolated_points(values)
    ax.plot(steps, values, marker="o" if isolated else None, ms=3, markevery=isolated or None, **style)


def _draw_totals(ax, data: RunData, sparse: bool = False) -> None:
    parts = ["Total gradient norm"]
    pre = data.series.get(_TOTAL, {})
    post = data.series.get(_POST, {})
    fraction = data.series.get(_CLIP_FRACTION, {})
    clipped = [s for s, v in post.items() if s in pre and v < pre[s] * (1 - 1e-6)]
    any_clipped = any(v > 0 for v in fraction.values())
    if fraction:
        count, steps = _clipped_count(fraction)
        parts.append(f"{count} of {steps} steps clipped" if any_clipped else "no step clipped")
    elif post:
        parts.append(f"{len(clipped)} of {len(post)} logged steps clipped" if clipped else "no step clipped")
    if pre:
        label = "total"
        if clipped:
            label = "total (pre-clip)"
        elif any_clipped:
            label = "total (no logged step clipped)"
        elif post or fraction:
            label = "total (no step clipped)"
        _plot_series(ax, pre, sparse, label=label, color="tab:blue", lw=1)
        if clipped:
            # Dashed: where a logged step was not clipped, the pre-clip line shows through.
            _plot_series(ax, post, sparse, label="total (post-clip)", color="tab:green", lw=1, ls="--")
            ax.scatter(clipped, [post[s] for s in clipped], s=12, color="tab:green", label="clipped", zorder=3)
        finite = [v for v in pre.values() if v > 0 and math.isfinite(v)]
        if finite and max(finite) > 10 * min(finite):
            ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "no `grad_norm/total` logged", ha="center", va="center", transform=ax.transAxes)
    skipped = data.series.get(_SKIPPED, {})
    if skipped:
        parts.append(f"{int(max(skipped.values()))} step(s) skipped")
    if fraction:
        twin = ax.twinx()
        twin.set_label("clip fraction")
        # The fraction is background: the norms and the event lines are drawn over its edges, not under them.
        ax.set_zorder(twin.get_zorder() + 1)
        ax.patch.set_visible(False)
        # A fraction logged at step s covers the steps since the previous log: it is drawn over (previous, s].
        twin.step(list(fraction), list(fraction.values()), where="pre", color="tab:gray", lw=0.8, alpha=0.7)
        twin.fill_between(list(fraction), list(fraction.values()), step="pre", color="tab:gray", alpha=0.15)
        twin.plot([], [], color="tab:gray", label="fraction of steps clipped (right axis)")
        twin.set_ylim(0, 1.05)
        twin.set_ylabel("clipped fraction", fontsize=8)
    if data.events:
        parts.append("events")
    ax.set_title(", ".join(parts), fontsize=10)


_EVENT_COLORS = ("tab:red", "tab:purple", "tab:orange", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


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


def _draw_events(ax, events: list[dict]) -> None:
    """A line per event at its step (dash-dot for validation); the events of one step split the panel's height."""
    at_step: dict[int, dict[str, bool]] = defaultdict(dict)
    for event in events:
        step = event.get("step")
        if isinstance(step, (int, float)):
            at_step[int(step)].setdefault(event_label(event), is_validation_event(event))
    labels = sorted({label for found in at_step.values() for label in found})
    colors = {label: _EVENT_COLORS[i % len(_EVENT_COLORS)] for i, label in enumerate(labels)}
    labelled: set[str] = set()
    for step, found in sorted(at_step.items()):
        for k, (label, validation) in enumerate(found.items()):
            ax.axvline(
                step,
                ymin=k / len(found),
                ymax=(k + 1) / len(found),
                color=colors[label],
                ls="-." if validation else "--",
                lw=1.6,
                label=None if label in labelled else f"event: {label}",
            )
            labelled.add(label)


_CLI_DESCRIPTION = """\
Render the gradient report of a run to a PNG: a heatmap of per-module gradient norms over optimizer steps, the
update-to-weight ratios (when logged), the total norm before and after clipping (clipped steps marked, the clipped
fraction and skipped steps where logged) and the events that gradkit's guards wrote (gradkit_events.jsonl), on one
step axis; below, one incident panel per skipped step, rollback or escalation: the per-module norms around it.

LOG_DIR is the directory of one run: a CSVLogger's (metrics.csv) or a TensorBoardLogger's (events.out.tfevents.*,
needs tensorboard), e.g. lightning_logs/version_0. The run must have used GradNormMonitor, which logs the
grad_norm/* metrics drawn here."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m gradkit.report",
        description=_CLI_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("log_dir", metavar="LOG_DIR", help="the run directory (see above)")
    parser.add_argument("--out", default=None, help=f"output PNG (default: LOG_DIR/{REPORT_FILE})")
    args = parser.parse_args(argv)
    try:
        path = render(args.log_dir, args.out)
    except (FileNotFoundError, ModuleNotFoundError, ValueError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    print(path)


if __name__ == "__main__":
    main()
