"""The gradient report renders what a real run logged: per-module rows, totals and event markers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from helpers import MLPModule, column, loader, make_trainer, read_metrics
from lightning_gradkit import GradNormMonitor
from lightning_gradkit.report import build_figure, load_run, main, render

pytest.importorskip("matplotlib")


def _run(tmp_path: Path) -> Path:
    trainer = make_trainer(tmp_path, callbacks=[GradNormMonitor(depth=2)])
    trainer.fit(MLPModule(), loader())
    return Path(trainer.logger.log_dir)


def test_report_heatmap_has_one_row_per_module_and_values_from_the_log(tmp_path: Path) -> None:
    log_dir = _run(tmp_path)
    event = {"step": 3, "batch_idx": 3, "rank": 0, "what": "skipped_step", "culprit": "encoder.2"}
    (log_dir / "gradkit_events.jsonl").write_text(json.dumps(event) + "\n")
    data = load_run(log_dir)
    fig = build_figure(data)
    heat, total = fig.axes[0], fig.axes[1]
    grid = heat.images[0].get_array()
    assert [t.get_text() for t in heat.get_yticklabels()] == ["encoder.0", "encoder.2", "head"]
    assert grid.shape == (3, 8)
    expected = column(read_metrics(log_dir), "grad_norm/module/head")
    assert list(grid[2]) == pytest.approx([math.log10(v) for v in expected])
    markers = [line for line in total.get_lines() if line.get_label() == "event: skipped_step"]
    assert len(markers) == 1 and list(markers[0].get_xdata()) == [3, 3]


def test_cli_writes_a_non_empty_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log_dir = _run(tmp_path)
    main([str(log_dir)])
    out = Path(capsys.readouterr().out.strip())
    assert out == log_dir / "gradient_report.png"
    from matplotlib.image import imread

    pixels = imread(out)
    assert pixels.shape[0] > 200 and pixels.shape[1] > 800
    assert pixels.std() > 0.05  # a drawn figure, not a blank canvas


def test_missing_directory_and_empty_run_give_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="CSVLogger"):
        render(tmp_path / "nowhere")
    (tmp_path / "metrics.csv").write_text("epoch,step,loss\n0,1,0.5\n")
    with pytest.raises(ValueError, match="GradNormMonitor"):
        render(tmp_path)


# -- the figure: model order, one step axis, fixed panels, clipping, skips ------------------------------------------
def _heat_value_at(heat, row: int, step: float) -> float:
    """The heatmap cell drawn at ``step`` (data x) in ``row``."""
    image = heat.images[0]
    left, right, _, _ = image.get_extent()
    grid = image.get_array()
    col = int((step - left) / (right - left) * grid.shape[1])
    return float(grid[row][col])


def test_figure_values_sit_at_their_steps_on_the_same_x_in_both_panels(tmp_path: Path) -> None:
    """Steps 0, 4, 9, 14, ...: the first step joins the period, so logged steps are unevenly spaced."""
    trainer = make_trainer(tmp_path, callbacks=[GradNormMonitor(depth=2)], log_every_n_steps=5, max_steps=23)
    trainer.fit(MLPModule(), loader(n=512))
    rows = read_metrics(trainer)
    steps = [int(r["step"]) for r in rows if r.get("grad_norm/total")]
    assert steps == [0, 4, 9, 14, 19, 22]
    fig = build_figure(load_run(trainer.logger.log_dir))
    heat, total = fig.axes[0], fig.axes[1]
    labels = [t.get_text() for t in heat.get_yticklabels()]
    for name in ("encoder.0", "encoder.2", "head"):
        logged = column(rows, f"grad_norm/module/{name}")
        drawn = [_heat_value_at(heat, labels.index(name), s) for s in steps]
        assert drawn == pytest.approx([math.log10(v) for v in logged], rel=1e-6), name
    (pre,) = [line for line in total.get_lines() if line.get_label().startswith("total")]
    assert list(pre.get_xdata()) == steps
    assert list(pre.get_ydata()) == pytest.approx(column(rows, "grad_norm/total"))
    fig.canvas.draw()
    assert heat.get_position().x0 == pytest.approx(total.get_position().x0)
    assert heat.get_position().x1 == pytest.approx(total.get_position().x1)
    for s in steps:
        assert heat.transData.transform((s, 0))[0] == pytest.approx(total.transData.transform((s, 0))[0])


class ManyModules(MLPModule):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(layers)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return super().forward(x)


@pytest.mark.parametrize("layers", [6, 62])
def test_report_rows_in_model_order_with_panels_of_fixed_height(tmp_path: Path, layers: int) -> None:
    monitor = GradNormMonitor(report=True)
    trainer = make_trainer(tmp_path, callbacks=[monitor], max_steps=4)
    trainer.fit(ManyModules(layers), loader())
    data = monitor.report_data
    expected = ["encoder", "head", *[f"layers.{i}" for i in range(layers)]]  # registration order
    assert data.modules == expected
    fig = build_figure(data)
    heat, total = fig.axes[0], fig.axes[1]
    shown = [t.get_text() for t in heat.get_yticklabels()]
    assert shown == [m for m in expected if m in shown] and shown[:2] == ["encoder", "head"]
    # The lower panel keeps its height in inches however many rows there are; the figure grows instead.
    assert total.get_position().height * fig.get_figheight() == pytest.approx(2.6)
    assert fig.get_figheight() > 2.6 + 0.12 * min(len(expected), 50)
    # Its legend sits below it, not over the data.
    fig.canvas.draw()
    legend = total.get_legend().get_window_extent()
    assert legend.y1 <= total.get_window_extent().y0
    assert (Path(trainer.logger.log_dir) / "gradient_report.png").exists()


def test_no_step_clipped_is_said_and_clipped_steps_are_marked(tmp_path: Path) -> None:
    from lightning_gradkit import ClipGradNorm

    loose = make_trainer(tmp_path / "loose", callbacks=[GradNormMonitor(), ClipGradNorm(1e6)])
    loose.fit(MLPModule(), loader())
    fig = build_figure(load_run(loose.logger.log_dir))
    total = fig.axes[1]
    assert "no step clipped" in total.get_title()
    assert [line.get_label() for line in total.get_lines()] == ["total (no step clipped)"]

    tight = make_trainer(tmp_path / "tight", callbacks=[GradNormMonitor(), ClipGradNorm(0.05)])
    tight.fit(MLPModule(), loader())
    rows = read_metrics(tight)
    pre = {int(r["step"]): float(r["grad_norm/total"]) for r in rows if r.get("grad_norm/total")}
    fig = build_figure(load_run(tight.logger.log_dir))
    (marks,) = [c for c in fig.axes[1].collections if c.get_label() == "clipped"]
    assert sorted(x for x, _ in marks.get_offsets()) == [s for s, v in pre.items() if v > 0.05 + 1e-6]


def test_skipped_steps_and_clip_fraction_are_drawn_where_logged(tmp_path: Path) -> None:
    data = load_run(_run(tmp_path))
    data.series["grad_clip/clipped_fraction"] = {3: 0.25, 7: 0.5}
    data.series["gradkit/skipped_steps"] = {3: 0.0, 7: 2.0}
    data.events = [{"step": 5, "what": "nonfinite_grads", "action": "skip"}]
    fig = build_figure(data)
    total = fig.axes[1]
    assert "2 step(s) skipped" in total.get_title()
    labels = total.get_legend().get_texts()
    assert "event: nonfinite_grads (step skipped)" in [t.get_text() for t in labels]
    (twin,) = [a for a in fig.axes if a.get_label() == "clip fraction"]
    assert twin.get_ylim()[1] >= 1.0


def test_tensorboard_only_run_renders_in_model_order(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    tb, csv_logger = TensorBoardLogger(tmp_path, name="tb"), CSVLogger(tmp_path, name="csv")
    monitor = GradNormMonitor(report=True)
    trainer = make_trainer(tmp_path, logger=[tb, csv_logger], callbacks=[monitor], max_steps=4)
    trainer.fit(ManyModules(12), loader())
    assert not (Path(tb.log_dir) / "metrics.csv").exists()
    data = load_run(tb.log_dir)
    assert data.modules == monitor.report_data.modules  # the logged order is model order
    reference = load_run(csv_logger.log_dir)
    for key, values in reference.series.items():
        if key.startswith("grad_norm/"):
            assert data.series[key] == pytest.approx(values, rel=1e-6), key
    out = render(tb.log_dir)
    assert out.exists()
    # report=True needs no CSVLogger: written to the first logger's directory.
    assert (Path(trainer.log_dir) / "gradient_report.png").exists()


def test_report_without_any_logger(tmp_path: Path) -> None:
    monitor = GradNormMonitor(report=True)
    make_trainer(tmp_path, logger=False, default_root_dir=tmp_path, callbacks=[monitor], max_steps=3).fit(
        MLPModule(), loader()
    )
    assert (tmp_path / "gradient_report.png").exists()


def test_run_without_grad_norms_says_so_in_the_figure(tmp_path: Path) -> None:
    data = load_run(_run(tmp_path))
    data.series = {k: v for k, v in data.series.items() if not k.startswith("grad_norm")}
    data.events = [{"step": 2, "what": "graph_leak"}]
    fig = build_figure(data)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert any("no `grad_norm/*` metric" in t and "GradNormMonitor" in t for t in texts)


def test_cli_help_is_plain_text_and_a_wrong_directory_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and "LOG_DIR" in out
    with pytest.raises(SystemExit) as info:
        main([str(tmp_path / "nowhere")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nowhere" in err and "Traceback" not in err
