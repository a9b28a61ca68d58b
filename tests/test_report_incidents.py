"""The report's update-ratio panel and incident panels, read back from the matplotlib figure objects."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from gradkit.report.data import RunData, load_run
from gradkit.report.figure import build_figure
from helpers import MLPModule, loader, make_trainer, read_metrics
from lightning_gradkit import GradNormMonitor, NonFiniteGuard
from lightning_gradkit.demos import FaultInjector

pytest.importorskip("matplotlib")


def _axes(fig, label: str) -> list:
    return [ax for ax in fig.axes if ax.get_label() == label]


def _rows(ax) -> list[str]:
    return [t.get_text() for t in ax.get_yticklabels()]


def _framed_steps(ax) -> list[float]:
    return sorted(p.get_x() + 0.5 for p in ax.patches if p.get_label() == "event")


def _panel_steps(ax) -> list[int]:
    low, high = ax.get_xlim()
    return list(range(math.ceil(low), math.floor(high) + 1))


def _synthetic_run() -> RunData:
    """Three modules with steady norms; ``b`` jumps 100x at step 20, ``a`` 50x at step 21; a skip at 21 and a
    rollback at 23 (one incident), a validation event (none) and an escalation at 60 (a second incident)."""
    data = RunData(module_order=["a", "b", "c"])
    usual = {"a": 1.0, "b": 2.0, "c": 0.5}
    for step in range(70):
        for module, value in usual.items():
            factor = 100.0 if (module, step) == ("b", 20) else 50.0 if (module, step) == ("a", 21) else 1.0
            data.series[f"grad_norm/module/{module}"][step] = value * factor * (1 + 0.01 * (step % 3))
        data.series["grad_norm/total"][step] = 3.0
    data.events = [
        {"step": 21, "what": "grad_norm_spike", "action": "skip", "culprit": None},
        {"step": 23, "what": "rollback", "culprit": None},
        {"step": 40, "what": "nonfinite_val_loss", "action": "skip"},
        {"step": 60, "what": "escalation", "culprit": None},
    ]
    return data


def test_incident_panels_show_the_modules_around_each_event_and_the_module_that_rose_first() -> None:
    fig = build_figure(_synthetic_run())
    panels = _axes(fig, "incident")
    assert len(panels) == 2  # skip + rollback merged, the validation event is no incident, the escalation apart
    first, second = panels
    assert _rows(first) == ["a", "b", "c"]
    assert _panel_steps(first) == list(range(11, 34))  # 10 steps before the skip, 10 after the rollback
    assert _framed_steps(first) == [21, 23]
    grid = first.images[0].get_array()
    column = 20 - 11
    # Each module over its median before the first event: b's jump reads log10(100), the others stay near 0.
    assert grid[1, column] == pytest.approx(math.log10(100 * 1.02 / 1.01), abs=1e-6)
    assert abs(grid[0, column]) < 0.01 and abs(grid[2, column]) < 0.01
    assert grid[0, column + 1] == pytest.approx(math.log10(50), abs=0.01)
    assert first.get_title().splitlines() == [
        "steps 21-23 (2 events): grad_norm_spike (step skipped), rollback",
        "first at step 20: b 101x its usual norm",  # 2.04 over b's median before step 21 (2.02)
    ]
    assert _panel_steps(second) == list(range(50, 70)) and _framed_steps(second) == [60]  # the run ends at 69
    assert "escalation" in second.get_title()


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GradNormMonitor]:
    """A NaN injected into ``encoder.0`` at step 12 of 16; NonFiniteGuard skips the step."""
    tmp_path = tmp_path_factory.mktemp("nan_run")
    monitor = GradNormMonitor(depth=2, update_ratio=True, report=True)
    trainer = make_trainer(
        tmp_path,
        strategy="gradkit",
        callbacks=[monitor, NonFiniteGuard(action="skip"), FaultInjector(step=12, module="encoder.0")],
        max_steps=16,
    )
    with pytest.warns(UserWarning, match="non-finite"):
        trainer.fit(MLPModule(), loader(n=128))
    return Path(trainer.logger.log_dir), monitor


def test_incident_panel_of_a_real_run_is_the_same_in_fit_and_from_the_logs(nan_run) -> None:
    log_dir, monitor = nan_run
    for data in (monitor.report_data, load_run(log_dir)):
        (panel,) = _axes(build_figure(data), "incident")
        assert _rows(panel) == ["encoder.0", "encoder.2", "head"]
        assert _panel_steps(panel) == list(range(2, 16))  # 10 before, to the run's last step
        assert _framed_steps(panel) == [12]
        nonfinite = panel.collections[0].get_offsets()
        assert sorted(map(tuple, nonfinite.tolist())) == [(12.0, 0.0), (12.0, 1.0), (12.0, 2.0)]
        assert "non-finite from step 12: all 3 modules" in panel.get_title()


def test_update_ratio_panel_shows_the_logged_ratios_per_module_in_fit_and_from_the_logs(nan_run) -> None:
    log_dir, monitor = nan_run
    rows = read_metrics(log_dir)
    for data in (monitor.report_data, load_run(log_dir)):
        (panel,) = _axes(build_figure(data), "update ratio")
        assert _rows(panel) == ["total", "encoder.0", "encoder.2", "head"]
        grid = panel.images[0].get_array()
        for i, key in enumerate(["total", "module/encoder.0", "module/encoder.2", "module/head"]):
            logged = {int(r["step"]): float(r[f"update_ratio/{key}"]) for r in rows if r.get(f"update_ratio/{key}")}
            assert sorted(logged) == list(range(16))
            assert logged[12] == 0.0 and grid.mask[i, 12]  # the skipped step: no update, a blank cell
            for step in (0, 5, 15):
                assert grid[i, step] == pytest.approx(math.log10(logged[step]), rel=1e-6)


# -- issue 33: what a panel may claim, and which incidents get one --------------------------------------------------
def _lightning_default_run(events: list[dict]) -> RunData:
    """Norms logged as Lightning's default period logs them over 200 steps (0, 49, 99, 149, 199); the embedding's
    norm 1000 times its usual at step 40, which no logged step sees."""
    data = RunData(module_order=["embedding", "head"], events=events)
    for step in (0, 49, 99, 149, 199):
        data.series["grad_norm/module/embedding"][step] = 1.0
        data.series["grad_norm/module/head"][step] = 2.0
        data.series["grad_norm/total"][step] = 2.2
    return data


def test_an_incident_panel_over_unlogged_steps_never_reads_as_measured() -> None:
    events = [{"step": s, "what": "nonfinite_grads", "action": "skip", "culprit": None} for s in (40, 70)]
    first, second = _axes(build_figure(_lightning_default_run(events)), "incident")
    # Steps 30-50: only 49 was logged, not the event's step 40: the title says so instead of "no module above".
    assert (
        first.get_title().splitlines()[-1]
        == "no module above 5x its usual norm at the 1 of 21 steps logged, the event's not"
    )
    # Steps 60-80: nothing logged at all.
    assert second.get_title().splitlines()[-1] == (
        "not measured: no step of 60-80 logged its norms (log every step to see it)"
    )
    assert [t.get_text() for t in second.texts] == ["nothing logged here"]
    assert bool(np.isnan(np.ma.filled(second.images[0].get_array().astype(float), np.nan)).all())


def test_panels_go_to_the_rarest_kinds_and_the_latest_and_the_header_names_the_rest() -> None:
    """39 incidents (the issue's count): 38 routine skips and one rollback among them; 8 panels."""
    data = RunData(module_order=["a"])
    for step in range(0, 2300):
        data.series["grad_norm/module/a"][step] = 1.0
    skips = [{"step": s, "what": "nonfinite_grads", "action": "skip"} for s in range(20, 2300, 60)]
    rollback = {"step": 530, "what": "rollback"}
    assert len(skips) == 38 and all(abs(e["step"] - 530) > 2 * 10 for e in skips)  # 39 panels of their own
    data.events = [*skips, rollback]
    fig = build_figure(data)
    panels = _axes(fig, "incident")
    drawn = [_framed_steps(p)[0] for p in panels]
    latest = sorted(e["step"] for e in skips)[-7:]
    assert drawn == [530, *latest]  # the rare rollback, then the 7 latest skips, in step order
    assert "rollback" in panels[0].get_title()
    (header,) = [t for t in fig.texts if t.get_label() == "incidents header"]
    left = sorted(e["step"] for e in skips)[:-7]
    assert header.get_text().splitlines()[0] == (
        f"Incidents: 8 of 39 drawn, the rarest kinds and the latest first; not drawn: 31 x nonfinite_grads "
        f"(step skipped) at steps {left[0]}-{left[-1]}."
    )
