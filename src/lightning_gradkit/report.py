"""The gradient report: one PNG of a run's gradient norms, clipping, skipped steps and events.

    python -m lightning_gradkit.report LOG_DIR [--out FILE]

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

from lightning_gradkit.events import EVENTS_FILENAME as EVENTS_FILE
from lightning_gradkit.events import read_metadata

__all__ = [
    "INSTALL_HINT",
    "REPORT_FILE",
    "RunData",
    "build_figure",
    "cell_reach",
    "event_label",
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
    """Axes rectangles in inches, so both panels get the same x extent whatever their labels."""

    rows: int
    label_chars: int

    @property
    def heat_height(self) -> float:
        return min(max(self.rows * _ROW_HEIGHT, _MIN_HEAT_HEIGHT), _MAX_HEAT_HEIGHT)

    @property
    def left(self) -> float:
        return max(1.0, 0.3 + 0.062 * self.label_chars)

    right = 1.25
    top = 0.45
    gap = 0.55
    bottom = 1.35

    @property
    def height(self) -> float:
        return self.top + self.heat_height + self.gap + _TOTAL_HEIGHT + self.bottom

    def rect(self, y_from_top: float, h: float, fig_w: float = _WIDTH) -> list[float]:
        width = fig_w - self.left - self.right
        return [self.left / fig_w, 1 - (y_from_top + h) / self.height, width / fig_w, h / self.height]


def build_figure(data: RunData):
    """The report's matplotlib figure: module heatmap on top, total norms, clipping, skips and events below.

    Both panels span the same x range at the same horizontal position (the colour bar sits in the right margin),
    so a step in the heatmap lies straight above the same step below.
    """
    plt = _pyplot()
    from matplotlib import ticker

    modules = data.modules
    layout = _Layout(rows=max(len(modules), 1), label_chars=max((len(m) for m in modules), default=10))
    fig = plt.figure(figsize=(_WIDTH, layout.height))
    ax_heat = fig.add_axes(layout.rect(layout.top, layout.heat_height))
    ax_total = fig.add_axes(layout.rect(layout.top + layout.heat_height + layout.gap, _TOTAL_HEIGHT), sharex=ax_heat)

    steps = sorted({s for k, v in data.series.items() if k.startswith("grad_norm/") for s in v})
    event_steps = [int(e["step"]) for e in data.events if isinstance(e.get("step"), (int, float))]
    span = steps + event_steps
    if modules and steps:
        _draw_heatmap(fig, ax_heat, data, modules, steps, layout)
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


def _draw_heatmap(fig, ax, data: RunData, modules: list[str], steps: list[int], layout: _Layout) -> None:
    columns, nearest = step_lattice(steps, reach=cell_reach(steps))
    width = columns[1] - columns[0] if len(columns) > 1 else 1
    grid = []
    for m in modules:
        values = data.series[_MODULE_PREFIX + m]
        logged = [_log10(values.get(s, math.nan)) for s in steps]
        grid.append([math.nan if i is None else logged[i] for i in nearest])
    extent = (columns[0] - width / 2, columns[-1] + width / 2, len(modules) - 0.5, -0.5)
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis", extent=extent)
    every = max(1, math.ceil(_LABEL_HEIGHT * len(modules) / layout.heat_height))
    shown = range(0, len(modules), every)
    ax.set_yticks(list(shown), [modules[i] for i in shown], fontsize=7)
    bar = fig.add_axes(
        [
            (_WIDTH - layout.right + 0.12) / _WIDTH,
            1 - (layout.top + layout.heat_height) / layout.height,
            0.15 / _WIDTH,
            layout.heat_height / layout.height,
        ]
    )
    fig.colorbar(image, cax=bar, label="log10 gradient norm")
    # Logged but non-finite (NaN/Inf) cells in red; cells with nothing logged stay blank.
    bad = [
        (s, row)
        for row, m in enumerate(modules)
        for s, v in data.series[_MODULE_PREFIX + m].items()
        if not math.isfinite(v)
    ]
    if bad:
        ax.scatter([b[0] for b in bad], [b[1] for b in bad], marker="s", color="red", s=14, label="non-finite")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, -0.02), fontsize=7, frameon=False)


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
total norm before and after clipping (clipped steps marked, the clipped fraction and skipped steps where logged)
and the events that gradkit's guards wrote (gradkit_events.jsonl), on one step axis.

LOG_DIR is the directory of one run: a CSVLogger's (metrics.csv) or a TensorBoardLogger's (events.out.tfevents.*,
needs tensorboard), e.g. lightning_logs/version_0. The run must have used GradNormMonitor, which logs the
grad_norm/* metrics drawn here."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_gradkit.report",
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
