"""The gradient report renders what a real run logged: per-module rows, totals and event markers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

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
