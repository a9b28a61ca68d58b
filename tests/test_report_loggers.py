"""The gradient report in the user's logger: read back with each logger's own reader (TensorBoard's
``EventAccumulator``, MLflow's client on a local file store, the files of an offline W&B run), behind the Trainer and
behind the loop door (Fabric's loggers). Each logger is an optional dependency: its tests skip without it."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import gradkit.policies.monitor
import gradkit.report.figure
from gradkit.doors.loop import GradKit
from gradkit.report.loggers import EVENT_COLUMNS, EVENTS_TAG, REPORT_TAG, event_rows, events_summary, publish
from helpers import MLPModule, loader, make_trainer
from lightning_gradkit import GradNormMonitor, NonFiniteGuard
from lightning_gradkit.demos import FaultInjector

pytest.importorskip("matplotlib")

STEPS, NAN_AT = 6, 2


def guarded_fit(tmp_path: Path, logger: object, **monitor_args: object) -> tuple[GradNormMonitor, list[dict]]:
    """6 optimizer steps, each logged, a NaN injected at step 2 (skipped: one event); the monitor and the events."""
    torch.manual_seed(0)
    monitor = GradNormMonitor(depth=2, report=True, **monitor_args)
    guard = NonFiniteGuard(action="skip")
    trainer = make_trainer(
        tmp_path,
        logger=logger,
        strategy="gradkit",
        max_steps=STEPS,
        callbacks=[monitor, guard, FaultInjector(step=NAN_AT, module="encoder.0")],
    )
    with pytest.warns(UserWarning, match="NonFiniteGuard"):
        trainer.fit(MLPModule(), loader(n=8 * STEPS))
    events = [json.loads(line) for line in guard.events_path.read_text().splitlines()]
    assert [e["step"] for e in events] == [NAN_AT]
    return monitor, events


def figure_pixels(monitor: GradNormMonitor) -> tuple[int, int]:
    """(width, height) of the report's figure as a logger renders it (matplotlib's default dpi)."""
    fig = gradkit.report.figure.build_figure(monitor.report_data)
    width, height = fig.get_size_inches() * fig.dpi
    gradkit.report.figure.close(fig)
    return round(width), round(height)


# -- TensorBoard ----------------------------------------------------------------------------------------------------
def read_tensorboard(log_dir: str | Path) -> tuple[list[tuple[int, int, int]], list[tuple[int, str]]]:
    """The report images (step, width, height) and the events texts (step, text) of a TensorBoard run."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, TENSORS, EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={IMAGES: 0, TENSORS: 0})
    accumulator.Reload()
    images = accumulator.Images(REPORT_TAG) if REPORT_TAG in accumulator.Tags()[IMAGES] else []
    texts = accumulator.Tensors(f"{EVENTS_TAG}/text_summary")
    return (
        [(e.step, e.width, e.height) for e in images],
        [(e.step, e.tensor_proto.string_val[0].decode()) for e in texts],
    )


def test_trainer_logs_the_report_and_the_events_to_tensorboard_at_the_end_and_every_n_logs(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path, name="tb")
    monitor, events = guarded_fit(tmp_path, logger, report_every_n_logs=2)
    images, texts = read_tensorboard(logger.log_dir)
    # Logging steps 0..5: a report after every second one (steps 1, 3, 5); the one at the end of fit would show what
    # the report of step 5 showed, so it is not logged a second time.
    assert [step for step, _, _ in images] == [1, 3, 5]
    # The last is the figure of the whole run; the first, before the NaN, has no incident panel below the others.
    assert images[-1][1:] == figure_pixels(monitor) and images[0][2] < images[-1][2]
    assert [step for step, _ in texts] == [1, 3, 5]
    assert texts[0][1] == "no event"
    final = texts[-1][1]
    summary = "1 event: 1 x nonfinite_loss_and_grads (step skipped) at step 2"
    assert final.splitlines()[0] == events_summary(events) == summary
    row = "| " + " | ".join(str(v) for v in event_rows(events)[0]) + " |"
    assert row in final.splitlines() and "encoder.0" in row  # the culprit the replay named
    assert str(Path(logger.log_dir) / "gradkit_events.jsonl") in final
    assert (Path(logger.log_dir) / "gradient_report.png").is_file()  # the file folder, as before


def test_the_report_at_the_end_is_logged_when_it_shows_more_than_the_last_periodic_one(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path, name="tb")
    monitor, _ = guarded_fit(tmp_path, logger, report_every_n_logs=4)
    images, texts = read_tensorboard(logger.log_dir)
    # Logging steps 0..5: the periodic report after the fourth (step 3), then the end of fit (step 5) with two more.
    assert [step for step, _, _ in images] == [3, 5] and [step for step, _ in texts] == [3, 5]
    assert images[-1][1:] == figure_pixels(monitor)


def test_the_loop_door_logs_the_report_to_fabrics_tensorboard_logger(tmp_path: Path) -> None:
    import lightning as L
    from lightning.fabric.loggers import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path, name="fabric")
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=logger)
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    monitor = gradkit.GradNormMonitor(depth=1, report=True)
    kit = GradKit(model, optimizer, monitor, fabric=fabric, log_every_n_steps=1)
    for _ in range(4):
        fabric.backward(model(torch.randn(8, 4)).pow(2).mean())
        kit.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    kit.finish()
    images, texts = read_tensorboard(logger.log_dir)
    assert [step for step, _, _ in images] == [3] and [step for step, _ in texts] == [3]
    assert texts[0][1] == "no event"
    assert {(w, h) for _, w, h in images} == {figure_pixels(monitor)}
    assert set(monitor.report_data.series["grad_norm/total"]) == {0, 1, 2, 3}


# -- MLflow ---------------------------------------------------------------------------------------------------------
def test_trainer_logs_the_report_to_mlflows_local_file_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    from lightning.pytorch.loggers import MLFlowLogger
    from matplotlib.image import imread

    # MLflow 3 keeps the file store for existing users only: it asks to be told so.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    logger = MLFlowLogger(experiment_name="gradkit", tracking_uri=f"file:{tmp_path / 'mlruns'}")
    monitor, events = guarded_fit(tmp_path, logger)
    client, run_id = logger.experiment, logger.run_id
    artifacts = sorted(a.path for a in client.list_artifacts(run_id, "gradkit"))
    assert artifacts == ["gradkit/gradient_report.png", "gradkit/gradkit_events.jsonl"]
    local = Path(client.download_artifacts(run_id, "gradkit", str(tmp_path / "download")))
    height, width, _ = imread(local / "gradient_report.png").shape
    assert (width, height) == pytest.approx(figure_pixels(monitor), abs=2)
    assert [json.loads(line) for line in (local / "gradkit_events.jsonl").read_text().splitlines()] == events
    tags = client.get_run(run_id).data.tags
    assert tags["gradkit.report.events"] == events_summary(events)
    assert tags["gradkit.report_step"] == str(STEPS - 1)


# -- W&B ------------------------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:.*anonymous.*")
def test_trainer_logs_the_report_to_an_offline_wandb_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger
    from matplotlib.image import imread

    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(key, value)
    logger = WandbLogger(project="gradkit", save_dir=str(tmp_path), offline=True)
    try:
        monitor, events = guarded_fit(tmp_path, logger)
        files = Path(logger.experiment.dir)
    finally:
        wandb.finish()
    (image,) = files.glob("media/images/gradkit/gradient_report_*.png")
    height, width, _ = imread(image).shape
    assert (width, height) == figure_pixels(monitor)
    (table,) = files.glob("media/table/gradkit/events_*.table.json")
    logged = json.loads(table.read_text())
    assert logged["columns"] == list(EVENT_COLUMNS)
    assert logged["data"] == event_rows(events)


# -- no matplotlib, a logger that fails, the argument ---------------------------------------------------------------
def test_without_matplotlib_the_report_warns_once_and_the_loggers_get_the_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    from lightning.pytorch.loggers import TensorBoardLogger

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a)
    )
    monkeypatch.setattr(gradkit.report.figure, "draw", lambda *a, **k: pytest.fail("drew without matplotlib"))
    logger = TensorBoardLogger(tmp_path, name="tb")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = GradNormMonitor(report=True)  # no error: the first thing a user copies runs
        make_trainer(tmp_path, logger=logger, max_steps=3, callbacks=[monitor]).fit(MLPModule(), loader())
    notes = [str(w.message) for w in caught if "matplotlib" in str(w.message)]
    assert len(notes) == 1 and "\n" not in notes[0] and "pip install" in notes[0], notes
    assert not (Path(logger.log_dir) / "gradient_report.png").exists()
    images, texts = read_tensorboard(logger.log_dir)
    assert images == [] and texts == [(2, "no event")]


class _Broken:
    """A TensorBoard logger whose writer fails (a full disk, a closed writer)."""

    class TensorBoardLogger:
        @property
        def experiment(self) -> object:
            raise OSError("No space left on device")


def test_a_logger_that_fails_gets_one_warning_and_the_others_their_report() -> None:
    class Recording:
        class TensorBoardLogger:
            def __init__(self) -> None:
                self.experiment = self
                self.calls: list[tuple[str, int]] = []

            def add_figure(self, tag: str, figure: object, global_step: int, close: bool) -> None:
                self.calls.append((tag, global_step))

            def add_text(self, tag: str, text: str, global_step: int) -> None:
                self.calls.append((tag, global_step))

            def flush(self) -> None:
                pass

    good, warned = Recording.TensorBoardLogger(), []
    reached = publish([_Broken.TensorBoardLogger(), good, object()], 7, object(), [], warned.append)
    assert reached == ["tensorboard"] and good.calls == [(REPORT_TAG, 7), (EVENTS_TAG, 7)]
    assert len(warned) == 1 and "No space left on device" in warned[0] and "gradient_report.png" in warned[0]


def test_report_every_n_logs_needs_report_and_a_positive_count() -> None:
    with pytest.raises(ValueError, match="report=True"):
        GradNormMonitor(report_every_n_logs=10)
    with pytest.raises(ValueError, match="report_every_n_logs"):
        GradNormMonitor(report=True, report_every_n_logs=0)
    assert GradNormMonitor(report=True, report_every_n_logs=10).report_every_n_logs == 10


def test_the_events_table_escapes_a_pipe_in_a_cell() -> None:
    from gradkit.report.loggers import events_markdown

    table = events_markdown([{"step": 3, "what": "loss_spike", "culprit": "a|b", "source": "SpikeGuard"}])
    assert table.splitlines()[0] == "1 event: 1 x loss_spike at step 3"
    assert "| 3 | loss_spike | a\\|b | SpikeGuard |  |" in table.splitlines()
