"""The gradient report: one PNG of a run's gradient norms, clipping, skipped steps and events.

    python -m gradkit.report LOG_DIR [--out FILE]

``LOG_DIR`` is a run directory: a ``CSVLogger``'s (``metrics.csv``) or a ``TensorBoardLogger``'s
(``events.out.tfevents.*``, read when tensorboard is installed), with the ``gradkit_events.jsonl`` of gradkit's
guards. ``GradNormMonitor(report=True)`` renders the same figure from the values it logged, whatever the logger, at
the end of ``fit`` or at ``GradKit.finish()``. What the report reads and finds (:class:`~gradkit.report.data.RunData`,
the incidents) is in :mod:`gradkit.report.data`; this module draws it. From the top, on one step axis:

1. a heatmap of per-module gradient norms (``grad_norm/module/*``, log10), one row per module in model order (from
   the monitor, the ``gradkit_run.json`` it writes next to the logs, or a TensorBoard file; else in name order with
   numbers compared as numbers, as ``metrics.csv`` sorts its columns: ``blocks.2`` before ``blocks.10``), its title
   saying how many steps logged norms. A logged value is drawn over the steps nearest to it, at most 1% of the run
   either side: a sparse log (Lightning's default period in a short run) shows blank columns where nothing was logged;
2. with ``GradNormMonitor(update_ratio=True)``: the update-to-weight ratio per module (``update_ratio/*``, log10),
   coloured around the ``1e-3`` rule of thumb;
3. the total gradient norm before and after clipping with the clipped steps marked (or "no step clipped"), a marker
   on every logged point when the log is sparse and on each point no line reaches (between two non-finite steps),
   the fraction of steps clipped (``grad_clip/clipped_fraction``) and the number of skipped steps
   (``gradkit/skipped_steps``) where logged; and every event of ``gradkit_events.jsonl`` (skipped steps, spikes,
   non-finite values, leaks, ...) as a line at its step, labelled with what happened ("step skipped" only for a
   training step a guard skipped; validation events dash-dotted; the events of one step share the panel's height);
4. with ``GradNormMonitor(noise_scale=True)`` (DDP): the critical batch ``B_simple`` (``grad_noise/b_simple``, the
   gradient noise scale of McCandlish et al. 2018, smoothed) over the steps, log scale, beside the batch the run
   trained with (``grad_noise/batch_size``, every rank's examples of a step);
5. below them, one incident panel per group of events that skipped a step, rolled back or escalated (events within
   ``INCIDENT_RADIUS`` steps share a panel): each module's gradient norm over its usual norm (its median before the
   first event) for the 10 steps either side, the event steps framed, and in the title what happened, the culprit a
   replay named and the module that rose first. Log every step to see an incident step by step.

matplotlib is the optional ``report`` extra: ``pip install -e '.[report]'`` in a checkout of lightning_gradkit (the
package is on no package index), or ``pip install matplotlib``.
"""

from __future__ import annotations

import argparse
import itertools
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from gradkit.report.data import (
    REPORT_FILE,
    RISE_FACTOR,
    Incident,
    Rise,
    RunData,
    choose_incidents,
    event_label,
    first_rise,
    heat_grid,
    incident_grid,
    incident_windows,
    is_sparse,
    is_validation_event,
    isolated_points,
    left_out_text,
    load_run,
    logged_steps_text,
)
from gradkit.report.layout import (
    FADED,
    INCIDENT_COLUMNS,
    INCIDENT_HEADER,
    INCIDENT_RANGE,
    INCIDENT_TITLE,
    MAX_INCIDENTS,
    NOISE_HEIGHT,
    TOTAL_HEIGHT,
    WIDTH,
    Layout,
    pyplot,
    row_labels,
)
from gradkit.report.signal_panels import add_signal_panels, signal_series

__all__ = ["RATIO_GUIDE", "build_figure", "close", "draw", "main", "render", "render_data", "save"]


_TOTAL = "grad_norm/total"
_POST = "grad_norm/total_post_clip"
_CLIP_FRACTION = "grad_clip/clipped_fraction"
_SKIPPED = "gradkit/skipped_steps"
_B_SIMPLE = "grad_noise/b_simple"
_NOISE_BATCH = "grad_noise/batch_size"
#: The update-to-weight ratio that the ratio panel centres its colours on (Karpathy's rule of thumb).
RATIO_GUIDE = 1e-3


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
    """
    out = Path(out) if out is not None else Path(log_dir) / REPORT_FILE
    return render_data(load_run(log_dir), out, source=str(log_dir))


def render_data(data: RunData, out: str | Path, source: str = "the run") -> Path:
    """Render ``data`` to a PNG at ``out`` and return its path.

    Raises:
        ValueError: if ``data`` holds no gradient norm and no event.
    """
    fig = draw(data, source)
    try:
        return save(fig, out)
    finally:
        close(fig)


def draw(data: RunData, source: str = "the run"):
    """The report's figure of ``data`` (:func:`build_figure`), after checking there is something to draw.

    Raises:
        ValueError: if ``data`` holds no gradient norm and no event.
    """
    if not data.has_grad_norms and not data.events:
        raise ValueError(
            f"{source} has no `grad_norm/*` metric and no event. Add `GradNormMonitor()` to the Trainer callbacks to "
            "record what the report draws (`GradNormMonitor(report=True)` draws it at the end of fit)."
        )
    return build_figure(data)


def save(fig, out: str | Path) -> Path:
    """Write ``fig`` to the PNG ``out`` (110 dpi) and return its path."""
    out = Path(out)
    fig.savefig(out, dpi=110)
    return out


def close(fig) -> None:
    """Free ``fig`` (pyplot keeps every figure it made until it is closed)."""
    pyplot().close(fig)


def build_figure(data: RunData):
    """The report's matplotlib figure: module heatmap on top, the update-ratio heatmap (when logged), the total
    norms, clipping, skips and events, then one incident panel per event that skipped, rolled back or escalated.

    The step panels span the same x range at the same horizontal position (the colour bars sit in the right
    margin), so a step in a heatmap lies straight above the same step below. Every axes has a label that says what
    it is (``"gradient norm"``, ``"update ratio"``, ``"totals"``, ``"incident"``), for readers of the figure object.
    """
    plt = pyplot()
    from matplotlib import ticker

    data = signal_series(data)  # EarlyWarning's series, kept in the events file; drawn by add_signal_panels
    modules = data.modules
    ratio_rows = data.ratio_rows
    steps = sorted({s for k, v in data.series.items() if k.startswith("grad_norm/") for s in v})
    incidents = incident_windows(data.events, run_end=steps[-1] if steps else None)
    layout = Layout(
        rows=max(len(modules), 1),
        label_chars=max((len(m) for m in modules), default=10),
        ratio_rows=len(ratio_rows),
        incidents=min(len(incidents), MAX_INCIDENTS),
        noise_panel=bool(data.series.get(_B_SIMPLE)),
    )
    shown, left_out = choose_incidents(incidents, MAX_INCIDENTS)
    fig = plt.figure(figsize=(WIDTH, layout.height))
    ax_heat = fig.add_axes(layout.rect(layout.top, layout.heat_height), label="gradient norm")
    ax_total = fig.add_axes(layout.rect(layout.total_top, TOTAL_HEIGHT), sharex=ax_heat, label="totals")

    event_steps = [int(e["step"]) for e in data.events if isinstance(e.get("step"), (int, float))]
    sparse = bool(steps) and is_sparse(steps)
    _draw_module_heatmap(fig, ax_heat, data, steps, layout, sparse)
    if ratio_rows:
        ax_ratio = fig.add_axes(
            layout.rect(layout.ratio_top, layout.ratio_height), sharex=ax_heat, label="update ratio"
        )
        _draw_ratios(fig, ax_ratio, data, ratio_rows, steps, layout)
    _draw_totals(ax_total, data, sparse=sparse)
    _draw_events(ax_total, data.events)
    _frame_totals(fig, ax_heat, ax_total, steps + event_steps, ticker)
    if layout.noise_panel:
        ax_noise = fig.add_axes(layout.rect(layout.noise_top, NOISE_HEIGHT), sharex=ax_heat, label="critical batch")
        _draw_critical_batch(ax_noise, data, sparse)
    if incidents:
        _draw_incidents(fig, data, shown, left_out, layout)
    add_signal_panels(fig, data)
    return fig


def _draw_module_heatmap(fig, ax_heat, data: RunData, steps: list[int], layout: Layout, sparse: bool) -> None:
    """The per-module heatmap (log10 norms, a row per module, the colour bar in the right margin) and its title, or
    the reason it is empty."""
    modules = data.modules
    if modules and steps:
        series = [data.module_series(m) for m in modules]
        grid, extent = heat_grid(series, steps)
        image = ax_heat.imshow(
            grid, aspect="auto", interpolation="nearest", cmap="viridis", extent=extent, zorder=2, label="logged"
        )
        if sparse:
            # Beneath the logged columns, faded: each logged value over its logging interval, so a sparse log reads
            # as a picture of the run rather than a barcode of one-step columns; the title says it is not measured.
            filled, _ = heat_grid(series, steps, filled=True)
            ax_heat.imshow(
                filled,
                aspect="auto",
                interpolation="nearest",
                cmap="viridis",
                norm=image.norm,
                extent=extent,
                alpha=FADED,
                zorder=1,
                label="nearest logged",
            )
        row_labels(ax_heat, modules, layout.heat_height)
        fig.colorbar(
            image, cax=fig.add_axes(layout.bar_rect(layout.top, layout.heat_height)), label="log10 gradient norm"
        )
        _mark_nonfinite(ax_heat, series)
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


def _frame_totals(fig, ax_heat, ax_total, span: list[int], ticker) -> None:
    """The totals panel's x range (every logged step and event), integer ticks, axis labels, and one legend below it
    for the totals and the clip-fraction twin."""
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


def _mark_nonfinite(ax, series: list[dict[int, float]]) -> None:
    """Logged but non-finite (NaN/Inf) cells in red; cells with nothing logged stay blank."""
    bad = [(s, row) for row, values in enumerate(series) for s, v in values.items() if not math.isfinite(v)]
    if bad:
        ax.scatter([b[0] for b in bad], [b[1] for b in bad], marker="s", color="red", s=14, label="non-finite")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, -0.02), fontsize=7, frameon=False)


def _draw_ratios(fig, ax, data: RunData, rows: list[str], steps: list[int], layout: Layout) -> None:
    """The update-to-weight ratio per module (log10), coloured around :data:`RATIO_GUIDE`: white at 1e-3, red
    above (large updates: a high learning rate), blue below (small updates: a low one, or a module that does not
    train). A step that applied no update logged 0 and stays blank, like a step that logged nothing."""
    from matplotlib import ticker
    from matplotlib.colors import TwoSlopeNorm

    plt = pyplot()
    series = [data.ratio_series(row) for row in rows]
    ratio_steps = sorted({s for values in series for s in values})
    grid, extent = heat_grid(series, steps or ratio_steps)
    guide = math.log10(RATIO_GUIDE)
    finite = [v for row in grid for v in row if math.isfinite(v)]
    low = min([*finite, guide - 1.0])
    high = max([*finite, guide + 1.0])
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="0.85")
    norm = TwoSlopeNorm(vcenter=guide, vmin=low, vmax=high)
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm, extent=extent)
    row_labels(ax, rows, layout.ratio_height)
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


def _draw_incidents(fig, data: RunData, shown: list[Incident], left_out: list[Incident], layout: Layout) -> None:
    """One panel per incident of ``shown`` (:func:`~gradkit.report.data.choose_incidents`); the header says which
    were left out."""
    plt = pyplot()
    from matplotlib import ticker
    from matplotlib.patches import Rectangle

    modules = data.modules
    rows = modules or ["total"]
    series = [data.module_series(m) for m in modules] or [data.series.get(_TOTAL, {})]
    header_y = 1 - (layout.incident_top + INCIDENT_HEADER - 0.05) / layout.height
    if left_out:
        total = len(shown) + len(left_out)
        header = (
            f"Incidents: {len(shown)} of {total} drawn, the rarest kinds and the latest first; not drawn: "
            f"{left_out_text(left_out)}.\nPer-module gradient norm / its usual norm (its median before the first "
            "event), log10; event steps framed, red: above usual, blue: below, grey: not logged, x: non-finite"
        )
    else:
        header = (
            "Incidents: per-module gradient norm / its usual norm (its median before the first event), log10;\n"
            "event steps framed, red: above usual, blue: below, grey: not logged, x: non-finite"
        )
    fig.text(layout.left / WIDTH, header_y, header, fontsize=10 if not left_out else 8.5, label="incidents header")
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
            vmin=-INCIDENT_RANGE,
            vmax=INCIDENT_RANGE,
            extent=extent,
        )
        if k % INCIDENT_COLUMNS == 0:
            row_labels(ax, rows, layout.incident_height)
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
        logged = [step for step in steps if any(step in values for values in series)]
        if not logged:
            ax.text(0.5, 0.5, "nothing logged here", ha="center", va="center", transform=ax.transAxes, fontsize=8)
        title = _incident_title(incident, first_rise(rows, series, grid, steps), len(rows), logged)
        ax.set_title(title, fontsize=7.5)
    if image is not None:
        top = layout.incident_top + INCIDENT_HEADER + INCIDENT_TITLE
        bar = fig.colorbar(image, cax=fig.add_axes(layout.bar_rect(top, layout.incident_height)), extend="both")
        bar.set_label("log10 norm / usual norm", fontsize=8)


def _mark_nonfinite_cells(ax, series: list[dict[int, float]], steps: list[int]) -> None:
    bad = [(s, row) for row, values in enumerate(series) for s in steps if not math.isfinite(values.get(s, 0.0))]
    if bad:
        ax.scatter([b[0] for b in bad], [b[1] for b in bad], marker="x", color="black", s=12, lw=1, label="non-finite")


def _incident_title(incident: Incident, rise: Rise | None, rows: int, logged: list[int]) -> str:
    """What happened at which step(s), the culprit a replay named (if any), and where it began, as far as the
    ``logged`` steps of the panel tell: a panel whose steps were not logged says so, never that nothing rose."""
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
    shown = incident.steps
    unlogged_events = not set(steps) & set(logged)
    if not logged:
        first = f"not measured: no step of {shown[0]}-{shown[-1]} logged its norms (log every step to see it)"
    elif rise is None and len(logged) < len(shown):
        where = ", the event's not" if unlogged_events else ""
        first = f"no module above {RISE_FACTOR:g}x its usual norm at the {len(logged)} of {len(shown)} steps logged"
        first += where
    elif rise is None:
        first = f"no module above {RISE_FACTOR:g}x its usual norm"
    elif math.isinf(rise.factors[0]):
        n = sum(math.isinf(f) for f in rise.factors)
        first = f"non-finite from step {rise.step}: " + (f"all {n} modules" if n == rows else ", ".join(rise.rows[:n]))
    else:
        more = f" (+{len(rise.rows) - 1} more)" if len(rise.rows) > 1 else ""
        first = f"first at step {rise.step}: {rise.rows[0]} {rise.factors[0]:.3g}x its usual norm{more}"
    return "\n".join([*lines, first])


def _fraction_edges(steps: list[int]) -> list[float]:
    """The edges of the clipped-fraction bars: the one logged at ``s`` covers the steps since the previous log (the
    first, the steps from 0), each the unit cell around its number.

    Example::

        >>> _fraction_edges([0, 4, 9])
        [-0.5, 0.5, 4.5, 9.5]
    """
    return [-0.5, *(s + 0.5 for s in steps)]


def _clipped_count(fraction: dict[int, float]) -> tuple[int, int]:
    """``(clipped, steps)`` from fractions logged per logging interval (each covers the steps since the previous)."""
    steps = sorted(fraction)
    lengths = [steps[0] + 1] + [b - a for a, b in itertools.pairwise(steps)]
    return round(sum(fraction[s] * n for s, n in zip(steps, lengths, strict=True))), sum(lengths)


def _clipped_stretches(pre: dict[int, float], post: dict[int, float], clipped: list[int]) -> dict[int, float]:
    """The post-clip values at the clipped steps and at their logged neighbours, NaN at every other logged step.

    Example::

        >>> _clipped_stretches({0: 1.0, 1: 5.0, 2: 1.0, 3: 1.0}, {0: 1.0, 1: 2.0, 2: 1.0, 3: 1.0}, [1])
        {0: 1.0, 1: 2.0, 2: 1.0, 3: nan}
    """
    steps = sorted(post)
    keep = set(clipped)
    for i, step in enumerate(steps):
        if step in clipped:
            keep.update(steps[max(i - 1, 0) : i + 2])
    return {step: post[step] if step in keep else math.nan for step in steps}


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
            # Only where the clip acted (and to its neighbours, so each clipped point joins the line it left): where
            # both are equal the pre-clip line is the only one drawn, and no line hides another.
            _plot_series(
                ax, _clipped_stretches(pre, post, clipped), sparse, label="total (post-clip)", color="tab:green", lw=1
            )
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
        # A fraction logged at step s covers the steps since the previous log, previous+1 .. s: each step is the
        # unit cell around its number, as in the heatmaps, so the bar spans (previous + 0.5, s + 0.5].
        twin.stairs(
            [fraction[step] for step in sorted(fraction)],
            _fraction_edges(sorted(fraction)),
            fill=True,
            color="tab:gray",
            alpha=0.25,
            label="fraction of steps clipped (right axis)",
        )
        twin.set_ylim(0, 1.05)
        twin.set_ylabel("clipped fraction", fontsize=8)
    if data.events:
        parts.append("events")
    ax.set_title(", ".join(parts), fontsize=10)


def _draw_critical_batch(ax, data: RunData, sparse: bool) -> None:
    """The critical batch ``B_simple`` over the steps (log scale) and the batch the run trained with: a batch well
    below ``B_simple`` scales almost perfectly with more data parallelism, one far above it wastes examples."""
    b_simple = data.series.get(_B_SIMPLE, {})
    batch = data.series.get(_NOISE_BATCH, {})
    shown = {s: v for s, v in b_simple.items() if math.isfinite(v) and v > 0}
    parts = ["Critical batch B_simple = S / |G|² (the gradient noise scale, McCandlish et al. 2018; smoothed)"]
    if shown:
        _plot_series(ax, shown, sparse, label="B_simple", color="tab:purple", lw=1.2)
        last = max(shown)
        parts.append(f"last {shown[last]:.3g}")
    if batch:
        _plot_series(ax, batch, sparse, label="batch per step (all ranks)", color="black", lw=1, ls="--")
        parts.append(f"batch {batch[max(batch)]:.3g}")
    missing = len(b_simple) - len(shown)
    if missing:
        parts.append(
            f"\n{missing} of {len(b_simple)} logged steps without an estimate (smoothed |G|² not positive yet)"
        )
    if shown or batch:
        ax.set_yscale("log")
        ax.legend(loc="upper left", fontsize=7)
    else:
        ax.text(
            0.5,
            0.5,
            "no positive estimate yet: the noise still hides the gradient",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
    ax.set_title(", ".join(parts).replace(", \n", "\n"), fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("examples per step")


_EVENT_COLORS = ("tab:red", "tab:purple", "tab:orange", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


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
fraction and skipped steps where logged) and the events that gradkit's guards wrote (gradkit_events.jsonl), the
critical batch B_simple (when logged: GradNormMonitor(noise_scale=True) under DDP), on one step axis; below, one
incident panel per skipped step, rollback or escalation: the per-module norms around it.

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
