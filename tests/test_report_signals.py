"""The early-warning signals in the gradient report: the series of EarlyWarning's ``signals`` event reach the report's
data, and the figure gains a panel per signal below everything else, the warnings of that signal marked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradkit.report.data import RunData
from gradkit.report.figure import build_figure, render
from gradkit.report.signal_panels import signal_series

pytest.importorskip("matplotlib")

STEPS = range(0, 60, 5)


def _data() -> RunData:
    data = RunData()
    for step in STEPS:
        data.series["grad_norm/total"][step] = 1.0
        data.series["grad_norm/module/blocks.0"][step] = 0.5
    series = {
        "signals/attn_logit_max/blocks.0.attn": [[s, 10.0 * 1.1**s] for s in STEPS],
        "signals/attn_logit_max/blocks.1.attn": [[s, 5.0] for s in STEPS],
        "signals/spike_score": [[s, 0.0] for s in STEPS],
        "signals/logz_max": [[s, "inf" if s == 55 else 6.0] for s in STEPS],
    }
    data.events = [
        {"what": "signals", "step": 59, "series": series, "source": "EarlyWarning"},
        {"what": "early_warning", "step": 35, "culprit": "blocks.0.attn", "values": {"signal": "attn_logit_max"}},
        {"what": "early_warning", "step": 45, "culprit": "blocks.0.attn", "values": {"signal": "attn_logit_max"}},
        {"what": "escalation", "step": 35, "source": "EarlyWarning", "values": {}},
    ]
    return data


def test_the_signals_event_becomes_series_and_leaves_the_events() -> None:
    data = _data()
    data.series["signals/spike_score"] = {0: 0.5}  # what the logger recorded stays
    signal_series(data)
    assert data.series["signals/attn_logit_max/blocks.0.attn"][35] == pytest.approx(10.0 * 1.1**35)
    assert data.series["signals/logz_max"][55] == float("inf")
    assert data.series["signals/spike_score"] == {0: 0.5}
    assert [e["what"] for e in data.events] == ["early_warning", "early_warning", "escalation"]


def test_the_report_gains_a_panel_per_signal_with_its_warnings_marked() -> None:
    plain = build_figure(RunData(series=_data().series))
    fig = build_figure(_data())
    panels = {ax.get_label(): ax for ax in fig.axes if ax.get_label().startswith("signal: ")}
    assert list(panels) == [
        "signal: largest attention logit per attention module",
        "signal: output log Z (mean, max)",
        "signal: SpikeScore (rolling, total)",
    ]
    attention = panels["signal: largest attention logit per attention module"]
    red = [line for line in attention.get_lines() if line.get_color() == "tab:red"]
    purple = [line for line in attention.get_lines() if line.get_color() == "tab:purple"]
    assert [line.get_xdata()[0] for line in red] == [35, 45] and len(purple) == 1
    assert attention.get_yscale() == "log" and "2 warning(s)" in attention.get_title()
    # The panels above keep their size in inches: the figure grew by the new rows.
    totals = next(ax for ax in fig.axes if ax.get_label() == "totals")
    before = next(ax for ax in plain.axes if ax.get_label() == "totals")
    height = totals.get_position().height * fig.get_size_inches()[1]
    assert height == pytest.approx(before.get_position().height * plain.get_size_inches()[1])
    assert fig.get_size_inches()[1] > plain.get_size_inches()[1] + 3 * 1.7


def test_the_command_line_report_draws_the_signals_of_a_runs_events_file(tmp_path: Path) -> None:
    data = _data()
    (tmp_path / "metrics.csv").write_text("step,grad_norm/total\n" + "".join(f"{s},1.0\n" for s in STEPS))
    (tmp_path / "gradkit_events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in data.events))
    out = render(tmp_path)
    assert out.is_file() and out.stat().st_size > 0
