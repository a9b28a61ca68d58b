"""The gradient report renders what a real run logged: per-module rows, totals and event markers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from gradkit.report.data import load_run
from gradkit.report.figure import build_figure, main, render
from helpers import MLPModule, column, loader, make_trainer, read_metrics
from lightning_gradkit import GradNormMonitor

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
    """The heatmap cell drawn at ``step`` (data x) in ``row``; NaN for a blank cell (imshow masks NaN)."""
    image = heat.images[0]
    left, right, _, _ = image.get_extent()
    grid = np.ma.filled(image.get_array().astype(float), np.nan)
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


def test_each_clipped_fraction_bar_covers_the_steps_it_counts_centred_on_their_numbers(tmp_path: Path) -> None:
    """Logged every step, the fraction of step s counts step s alone: its bar is the unit cell around s (issue 33:
    it covered (s-1, s], half of it over the previous step); logged at 3 and 7, the second counts steps 4-7."""
    data = load_run(_run(tmp_path))
    data.series["grad_clip/clipped_fraction"] = {s: float(s % 2) for s in range(8)}
    (twin,) = [a for a in build_figure(data).axes if a.get_label() == "clip fraction"]
    (bars,) = twin.patches
    values, edges, _ = bars.get_data()
    assert list(edges) == [s - 0.5 for s in range(9)] and list(values) == [float(s % 2) for s in range(8)]
    data.series["grad_clip/clipped_fraction"] = {3: 0.25, 7: 0.5}
    (twin,) = [a for a in build_figure(data).axes if a.get_label() == "clip fraction"]
    values, edges, _ = twin.patches[0].get_data()
    assert list(edges) == [-0.5, 3.5, 7.5] and list(values) == [0.25, 0.5]


def test_the_post_clip_line_is_drawn_only_where_clipping_acted(tmp_path: Path) -> None:
    """Where no step was clipped the two totals are equal: only the pre-clip line is drawn there (issue 33: a dashed
    post-clip line over it hid it); each clipped step joins its neighbours."""

    data = load_run(_run(tmp_path))
    pre = data.series["grad_norm/total"]
    steps = sorted(pre)
    clipped = {steps[2]: pre[steps[2]] / 4}
    data.series["grad_norm/total_post_clip"] = {s: clipped.get(s, pre[s]) for s in steps}
    lines = _total_lines(build_figure(data))
    post = lines["total (post-clip)"]
    assert post.get_linestyle() == "-" and list(post.get_xdata()) == steps
    drawn = dict(zip(steps, post.get_ydata(), strict=True))
    assert [s for s in steps if not math.isnan(drawn[s])] == steps[1:4]
    assert drawn[steps[2]] == pytest.approx(pre[steps[2]] / 4)
    assert list(lines["total (pre-clip)"].get_ydata()) == pytest.approx([pre[s] for s in steps])


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
    # Without a logger the monitor keeps what it would have logged, and the figure is drawn from that.
    assert sorted(monitor.report_data.series["grad_norm/total"]) == [0, 1, 2]
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(tmp_path / "gradient_report.png").shape
    fig = build_figure(monitor.report_data)
    # The PNG is that figure, saved at 110 dpi: the same size in inches.
    assert (width, height) == pytest.approx(tuple(fig.get_size_inches() * 110), abs=2)


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


# -- the figure tells the truth at any logging density (issue 25) ---------------------------------------------------
def _heat(fig):
    return fig.axes[0]


def _total_lines(fig) -> dict[str, object]:
    return {line.get_label(): line for line in fig.axes[1].get_lines()}


def _visible_xticks(ax) -> list[float]:
    low, high = ax.get_xlim()
    return [t for t in ax.get_xticks() if low <= t <= high]


def test_sparse_log_draws_markers_blank_columns_and_says_how_many_steps_were_logged(tmp_path: Path) -> None:
    """Lightning's default period (50) over a 10-step run logs steps 0 and 9 only: nothing may be drawn between."""
    trainer = make_trainer(tmp_path, callbacks=[GradNormMonitor(depth=2)], log_every_n_steps=50, max_steps=10)
    with pytest.warns(UserWarning, match="logging period"), pytest.warns(UserWarning, match="logging interval"):
        trainer.fit(MLPModule(), loader(n=80))
    rows = read_metrics(trainer)
    logged = {int(r["step"]): float(r["grad_norm/total"]) for r in rows if r.get("grad_norm/total")}
    assert list(logged) == [0, 9]
    fig = build_figure(load_run(trainer.logger.log_dir))
    heat = _heat(fig)
    assert "2 of 10 steps logged" in heat.get_title()
    head = [t.get_text() for t in heat.get_yticklabels()].index("head")
    expected = column(rows, "grad_norm/module/head")
    assert _heat_value_at(heat, head, 0) == pytest.approx(math.log10(expected[0]), rel=1e-6)
    assert _heat_value_at(heat, head, 9) == pytest.approx(math.log10(expected[1]), rel=1e-6)
    assert all(math.isnan(_heat_value_at(heat, head, s)) for s in range(1, 9))  # nothing measured there
    # Beneath, faded, each logged value over its half of the gap (issue 33: no barcode of one-step columns).
    faded = heat.images[1]
    assert faded.get_alpha() < 1 and faded.get_zorder() < heat.images[0].get_zorder()
    nearest = np.ma.filled(faded.get_array().astype(float), np.nan)[head]
    assert list(nearest) == pytest.approx([math.log10(expected[0])] * 5 + [math.log10(expected[1])] * 5, rel=1e-6)
    assert "faded: the nearest logged value, not measured there" in heat.get_title()
    line = _total_lines(fig)["total"]
    assert list(line.get_xdata()) == [0, 9] and list(line.get_ydata()) == pytest.approx(list(logged.values()))
    assert line.get_marker() == "o" and line.get_markevery() is None  # a marker on every logged point


def test_dense_log_fills_the_heatmap_and_draws_a_plain_line(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[GradNormMonitor(depth=2)], max_steps=8)
    trainer.fit(MLPModule(), loader())
    fig = build_figure(load_run(trainer.logger.log_dir))
    assert "every step logged (0-7)" in _heat(fig).get_title()
    assert not any(math.isnan(v) for v in _heat(fig).images[0].get_array().ravel())
    assert len(_heat(fig).images) == 1  # no faded layer: every step is measured
    assert _total_lines(fig)["total"].get_marker() in (None, "None", "")


@pytest.mark.parametrize("steps", [4, 20])
def test_short_run_has_integer_step_ticks(tmp_path: Path, steps: int) -> None:
    """matplotlib's default ticks are -0.5, 0.0, 0.5, ... over 4 steps and 0.0, 2.5, 5.0, ... over 20: no optimizer
    step is 2.5."""
    trainer = make_trainer(tmp_path, callbacks=[GradNormMonitor()], max_steps=steps)
    trainer.fit(MLPModule(), loader(n=8 * steps))
    fig = build_figure(load_run(trainer.logger.log_dir))
    fig.canvas.draw()
    ticks = _visible_xticks(fig.axes[1])
    assert len(ticks) >= 4 and all(t == int(t) for t in ticks), ticks
    assert min(ticks) == 0 and max(ticks) <= steps - 1


class NaNValidation(MLPModule):
    """A validation loss that is NaN in the validation run at ``nan_at`` (a global step)."""

    def __init__(self, nan_at: int) -> None:
        super().__init__()
        self.nan_at = nan_at

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        if self.trainer.global_step == self.nan_at:
            loss = loss * math.nan
        self.log("val_loss", loss)
        return loss


@pytest.fixture(scope="module")
def guarded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 3 and 5 skipped (a NaN injected, NonFiniteGuard skips), a NaN validation loss at step 6 (validation
    runs after 6 batches) and a third skipped step there too: two events at one step."""
    from lightning_gradkit import NonFiniteGuard
    from lightning_gradkit.demos import FaultInjector

    tmp_path = tmp_path_factory.mktemp("guarded")
    faults = [FaultInjector(step=s, module="encoder.0") for s in (3, 5, 6)]
    trainer = make_trainer(
        tmp_path,
        strategy="gradkit",
        callbacks=[GradNormMonitor(depth=2), NonFiniteGuard(action="skip"), *faults],
        max_steps=8,
        val_check_interval=6,
        limit_val_batches=1,
    )
    with pytest.warns(UserWarning, match="non-finite"):
        trainer.fit(NaNValidation(nan_at=6), loader(), loader(n=8))
    return Path(trainer.logger.log_dir)


def test_isolated_logged_point_between_two_skipped_steps_is_drawn(guarded_run: Path) -> None:
    data = load_run(guarded_run)
    pre = data.series["grad_norm/total"]
    assert [s for s in sorted(pre) if not math.isfinite(pre[s])] == [3, 5, 6]
    line = _total_lines(build_figure(data))["total"]
    steps = list(line.get_xdata())
    assert steps == list(range(8))
    # Steps 4 (between 3 and 5) and 7 (after 6, the last step) have no finite neighbour: no line segment reaches
    # them, so they, and only they, get a marker.
    assert line.get_marker() == "o" and line.get_markevery() == [steps.index(4), steps.index(7)]


def test_validation_event_is_not_a_skipped_step_and_events_at_one_step_do_not_overlap(guarded_run: Path) -> None:
    data = load_run(guarded_run)
    kinds = sorted((e["step"], e["what"]) for e in data.events)
    assert (6, "nonfinite_val_loss") in kinds and any(k == (6, w) for k in kinds for w in ("nonfinite_loss_and_grads",))
    fig = build_figure(data)
    total = fig.axes[1]
    labels = [t.get_text() for t in total.get_legend().get_texts()]
    assert "event: nonfinite_val_loss (in validation)" in labels
    assert not any("val" in label and "skipped" in label for label in labels)
    assert "event: nonfinite_loss_and_grads (step skipped)" in labels
    # The two events of step 6 share the panel's height: one in the lower half, one in the upper.
    at_six = [line for line in total.get_lines() if list(line.get_xdata()) == [6, 6]]
    assert sorted(tuple(line.get_ydata()) for line in at_six) == [(0.0, 0.5), (0.5, 1.0)]
    assert len({line.get_color() for line in at_six}) == 2
    at_three = [line for line in total.get_lines() if list(line.get_xdata()) == [3, 3]]
    assert [tuple(line.get_ydata()) for line in at_three] == [(0.0, 1.0)]


class StemFirst(MLPModule):
    """Model order (stem, blocks, classifier) differs from name order (blocks, classifier, encoder, head, stem)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(4, 4)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])
        self.classifier = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x[:, :4]
        for layer in (self.stem, *self.blocks, self.classifier):
            h = torch.tanh(layer(h))
        return super().forward(x) + h.sum(dim=1, keepdim=True)


def test_cli_on_a_csv_run_keeps_the_model_order_of_the_rows(tmp_path: Path) -> None:
    monitor = GradNormMonitor(report=True)
    trainer = make_trainer(tmp_path, callbacks=[monitor], max_steps=3)
    trainer.fit(StemFirst(), loader())
    in_fit = monitor.report_data.modules
    assert in_fit == ["encoder", "head", "stem", "blocks.0", "blocks.1", "blocks.2", "classifier"]
    from_csv = load_run(trainer.logger.log_dir)
    assert from_csv.modules == in_fit
    fig = build_figure(from_csv)
    assert [t.get_text() for t in _heat(fig).get_yticklabels()] == in_fit
    assert "modules in model order" in _heat(fig).get_title()
    main([trainer.logger.log_dir])
    assert (Path(trainer.logger.log_dir) / "gradient_report.png").exists()


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")
def test_vit_root_parameters_get_rows_named_for_what_they_hold(tmp_path: Path) -> None:
    from architectures import ArchModule, TinyViT, data_loader, image_data

    class Recording(ArchModule):
        """Records the cls_token gradient norm the optimizer receives (after the callbacks, which change nothing)."""

        def __init__(self) -> None:
            super().__init__(TinyViT())
            self.cls_norms: list[float] = []

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            self.cls_norms.append(float(self.model.cls_token.grad.norm()))

    torch.manual_seed(0)
    model = Recording()
    trainer = make_trainer(tmp_path, callbacks=[GradNormMonitor()], max_steps=4)
    trainer.fit(model, data_loader(image_data()))
    fig = build_figure(load_run(trainer.logger.log_dir))
    rows = [t.get_text() for t in _heat(fig).get_yticklabels()]
    assert rows == [
        "model.cls_token",
        "model.pos_embed",
        "model.patch_embed",
        "model.blocks.0",
        "model.blocks.1",
        "model.norm",
        "model.head",
    ]
    drawn = [_heat_value_at(_heat(fig), 0, s) for s in range(4)]
    assert drawn == pytest.approx([math.log10(v) for v in model.cls_norms], rel=1e-5)


def test_missing_matplotlib_hint_gives_the_install_command_that_works_from_a_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The package is on no index: `pip install lightning_gradkit[report]` finds nothing, the checkout's extra works.
    The monitor says it in its one-line note (it does not raise: the README's quick start must run without
    matplotlib), the CLI in its error."""
    import importlib.util
    import sys

    log_dir = _run(tmp_path / "run")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a)
    )
    with pytest.warns(UserWarning, match="matplotlib is not installed") as from_monitor:
        make_trainer(tmp_path, callbacks=[GradNormMonitor(report=True)], max_steps=1).fit(MLPModule(), loader())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    with pytest.raises(ModuleNotFoundError) as from_report:
        render(log_dir)
    note = next(str(w.message) for w in from_monitor if "matplotlib" in str(w.message))
    for message in (note, str(from_report.value)):
        assert "pip install -e '.[report]'" in message and "checkout" in message, message
        assert "lightning_gradkit[report]" not in message
