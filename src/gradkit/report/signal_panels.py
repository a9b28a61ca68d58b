"""The early-warning signals in the gradient report (:mod:`gradkit.report.figure`): a panel per signal, the warnings
marked.

:class:`~gradkit.EarlyWarning` logs its signals as ``signals/<signal>[/<module>]`` and, at the end of
the run, writes them into ``gradkit_events.jsonl`` as one ``signals`` event, so the report finds them whatever the
logger (or none). :func:`signal_series` moves that event's series into the run's data (where ``metrics.csv`` did not
hold them already); :func:`add_signal_panels` grows the report's figure downward by one panel per signal, on the
report's step axis: one line per module, the ``early_warning`` events of that signal as red dashed lines labelled
with their module, the escalations as purple dotted lines. matplotlib is imported by the report, not here.
"""

from __future__ import annotations

import math
from typing import Any

from gradkit.report.data import RunData
from gradkit.report.events import SIGNALS_EVENT
from gradkit.report.events import SIGNALS_PREFIX as PREFIX

__all__ = ["PANELS", "add_signal_panels", "signal_series"]

#: The panels, in order: the signals each draws, its title and whether its axis is logarithmic.
PANELS: list[tuple[tuple[str, ...], str, bool]] = [
    (("attn_logit_max",), "largest attention logit per attention module", True),
    (("logz_mean", "logz_max"), "output log Z (mean, max)", False),
    (("adam_g2_v",), "mean(g^2) / mean(v) per module (Adam)", True),
    (("adam_spike_frac",), "fraction of coordinates with g^2 > theta v (Adam)", False),
    (("update_ratio_spread",), "update-to-weight ratio spread (largest module / median)", True),
    (("spike_score", "spike_score_total"), "SpikeScore (rolling, total)", False),
]

_PANEL_HEIGHT = 1.7  # inches
_GAP = 0.75  # inches above each panel (its title) and below the last (its axis labels)
_MAX_LEGEND = 8


def signal_series(data: RunData) -> RunData:
    """``data`` with the series of its ``signals`` events added (keys the logger recorded stay as they are) and those
    events left out of its events: they hold values, not incidents.

    Example::

        >>> data = RunData(events=[{"what": "signals", "step": 9, "series": {"signals/spike_score": [[4, 0.0]]}}])
        >>> dict(signal_series(data).series), data.events
        ({'signals/spike_score': {4: 0.0}}, [])
    """
    for event in [e for e in data.events if e.get("what") == SIGNALS_EVENT]:
        for key, points in (event.get("series") or {}).items():
            logged = data.series.get(key)
            if not logged:
                # Non-finite values are written as "nan" / "inf" strings there, which `float` reads.
                data.series[key] = {int(step): float(value) for step, value in points}
    data.events = [e for e in data.events if e.get("what") != SIGNALS_EVENT]
    return data


def _panel_series(data: RunData, signals: tuple[str, ...]) -> dict[str, dict[int, float]]:
    """The series of a panel, named by their module (or by the signal, for one value per step)."""
    out: dict[str, dict[int, float]] = {}
    for signal in signals:
        base = PREFIX + signal
        for key, values in data.series.items():
            if values and (key == base or key.startswith(base + "/")):
                name = key[len(base) + 1 :] if key != base else signal
                out[name] = values
    return out


def add_signal_panels(fig: Any, data: RunData) -> None:
    """Grow ``fig`` (the report's figure) downward by one panel per signal that ``data`` holds; nothing without any.

    The panels share the x axis of the report's ``"totals"`` panel (the same steps straight above each other); each
    is labelled ``"signal: <signal>"``.
    """
    panels = [(signals, title, log, s) for signals, title, log in PANELS if (s := _panel_series(data, signals))]
    if not panels:
        return
    width, height = fig.get_size_inches()
    extra = len(panels) * (_PANEL_HEIGHT + _GAP) + _GAP
    total = height + extra
    # Everything drawn so far keeps its size and its place from the top: the new rows go below it.
    for ax in fig.axes:
        box = ax.get_position()
        ax.set_position([box.x0, (box.y0 * height + extra) / total, box.width, box.height * height / total])
    for text in fig.texts:
        x, y = text.get_position()
        text.set_position((x, (y * height + extra) / total))
    fig.set_size_inches(width, total)
    totals = next((ax for ax in fig.axes if ax.get_label() == "totals"), None)
    left, span = (totals.get_position().x0, totals.get_position().width) if totals is not None else (0.1, 0.8)
    warnings = [e for e in data.events if e.get("what") == "early_warning" and isinstance(e.get("step"), (int, float))]
    escalations = [
        e for e in data.events if e.get("what") == "escalation" and e.get("source") == "EarlyWarning" and "step" in e
    ]
    for i, (signals, title, log, series) in enumerate(panels):
        top = extra - _GAP - i * (_PANEL_HEIGHT + _GAP)  # inches from the bottom of the figure to the panel's top
        rect = [left, (top - _PANEL_HEIGHT) / total, span, _PANEL_HEIGHT / total]
        ax = fig.add_axes(rect, sharex=totals, label=f"signal: {title}")
        _draw_panel(ax, signals, title, log, series, warnings, escalations)


def _draw_panel(
    ax: Any,
    signals: tuple[str, ...],
    title: str,
    log: bool,
    series: dict[str, dict[int, float]],
    warnings: list[dict[str, Any]],
    escalations: list[dict[str, Any]],
) -> None:
    names = list(series)
    for name in names:
        points = sorted((s, v) for s, v in series[name].items() if math.isfinite(v) and (v > 0 or not log))
        if points:
            ax.plot(*zip(*points, strict=True), lw=1.2, label=name if len(names) <= _MAX_LEGEND else None)
    if log and any(ax.get_lines()):
        ax.set_yscale("log")
    fired = [e for e in warnings if (e.get("values") or {}).get("signal") in signals]
    for k, event in enumerate(fired):
        module = (event.get("values") or {}).get("module") or event.get("culprit") or ""
        label = "early warning" if k == 0 else None
        ax.axvline(int(event["step"]), color="tab:red", ls="--", lw=1.4, label=label)
        if module:
            ax.annotate(
                module,
                (int(event["step"]), 1.0),
                xycoords=("data", "axes fraction"),
                fontsize=6,
                rotation=90,
                va="top",
                ha="right",
                color="tab:red",
            )
    for k, event in enumerate(escalations):
        ax.axvline(int(event["step"]), color="tab:purple", ls=":", lw=1.4, label="escalation" if k == 0 else None)
    more = "" if len(names) <= _MAX_LEGEND else f" ({len(names)} modules)"
    ax.set_title(f"{title}{more}; {len(fired)} warning(s)", fontsize=9)
    ax.tick_params(labelsize=7)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, fontsize=6, loc="upper left", ncol=min(len(handles), 4))
