"""The gradient report where users look: in each attached Lightning logger, beside the curves.

:class:`~gradkit.GradNormMonitor` (``report=True``) hands the report's figure and the events of
``gradkit_events.jsonl`` to every logger of the loop (``trainer.loggers``, ``fabric.loggers``):

- ``TensorBoardLogger``: the figure with ``add_figure("gradkit/gradient_report", ...)`` (the Images tab, one image
  per report under a step slider), the events as a Markdown table with ``add_text("gradkit/events", ...)`` (the
  Text tab);
- ``WandbLogger``: ``log_image("gradkit/gradient_report", ...)`` and a table, ``log_table("gradkit/events", ...)``;
- ``MLFlowLogger``: the artifacts ``gradkit/gradient_report.png`` (``log_figure``) and
  ``gradkit/gradkit_events.jsonl``, and the tag ``gradkit.report.events`` (one line: how many events of each kind,
where);
- a ``CSVLogger`` and any other logger: the PNG and ``gradkit_events.jsonl`` in the log directory are the report.

Loggers are told apart by the names of their classes (and their bases), so nothing here imports Lightning, W&B or
MLflow; Lightning's and Fabric's ``TensorBoardLogger`` both count. Publishing never stops training: a logger that
fails is skipped with one warning.
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gradkit.report.data import REPORT_FILE, RunData, event_label
from gradkit.report.events import EVENTS_FILENAME

__all__ = [
    "EVENTS_ARTIFACT",
    "EVENTS_TAG",
    "EVENT_COLUMNS",
    "REPORT_ARTIFACT",
    "REPORT_TAG",
    "event_rows",
    "events_markdown",
    "events_summary",
    "has_matplotlib",
    "logger_kind",
    "publish",
    "publish_report",
]

#: The tag (TensorBoard) or key (W&B) of the figure, and of the events.
REPORT_TAG = "gradkit/gradient_report"
EVENTS_TAG = "gradkit/events"
#: MLflow's artifact paths and tag.
REPORT_ARTIFACT = "gradkit/gradient_report.png"
EVENTS_ARTIFACT = "gradkit/gradkit_events.jsonl"
_MLFLOW_TAG = "gradkit.report.events"
_MLFLOW_TAG_LIMIT = 5000  # characters: MLflow's limit on a tag value (older servers; newer ones allow more)
#: The columns of the events table: what happened, where, and what the guard did.
EVENT_COLUMNS = ("step", "event", "culprit", "source", "batch_idx")
_MAX_TEXT_ROWS = 200  # the TensorBoard table lists this many events; the file has them all

_KINDS = {"TensorBoardLogger": "tensorboard", "WandbLogger": "wandb", "MLFlowLogger": "mlflow"}


def logger_kind(logger: object) -> str | None:
    """``"tensorboard"``, ``"wandb"`` or ``"mlflow"`` for Lightning's (or Fabric's) logger of that name or a subclass
    of it, else ``None`` (a ``CSVLogger``: the PNG in its folder is the report)."""
    for cls in type(logger).__mro__:
        if cls.__name__ in _KINDS:
            return _KINDS[cls.__name__]
    return None


def event_rows(events: Sequence[dict]) -> list[list[Any]]:
    """One row per event, :data:`EVENT_COLUMNS` (``event``: what happened, as the report's legend says it).

    Example::

        >>> event_rows([{"step": 40, "what": "nonfinite_grads", "action": "skip", "culprit": "blocks.1.mlp",
        ...              "source": "NonFiniteGuard", "batch_idx": 160}])
        [[40, 'nonfinite_grads (step skipped)', 'blocks.1.mlp', 'NonFiniteGuard', 160]]
    """
    return [
        [e.get("step"), event_label(e), e.get("culprit") or "", e.get("source") or "", e.get("batch_idx")]
        for e in events
    ]


def events_summary(events: Sequence[dict]) -> str:
    """The events in one line: how many of each kind, at which steps.

    Example::

        >>> events_summary([{"step": s, "what": "nonfinite_grads", "action": "skip"} for s in (40, 90)])
        '2 events: 2 x nonfinite_grads (step skipped) at steps 40, 90'
        >>> events_summary([])
        'no event'
    """
    if not events:
        return "no event"
    labels = Counter(event_label(e) for e in events)
    parts = []
    for label, count in labels.most_common():
        steps = [str(e.get("step")) for e in events if event_label(e) == label]
        shown = ", ".join(steps[:8]) + (f" and {len(steps) - 8} more" if len(steps) > 8 else "")
        parts.append(f"{count} x {label} at step{'s' if len(steps) > 1 else ''} {shown}")
    return f"{len(events)} event{'s' if len(events) > 1 else ''}: " + "; ".join(parts)


def events_markdown(events: Sequence[dict], events_file: str | None = None) -> str:
    """The events as a Markdown table (TensorBoard's Text tab renders it), the first :data:`_MAX_TEXT_ROWS` of them.

    Example::

        >>> print(events_markdown([{"step": 40, "what": "loss_spike", "source": "SpikeGuard"}]))
        1 event: 1 x loss_spike at step 40
        <BLANKLINE>
        | step | event | culprit | source | batch_idx |
        | --- | --- | --- | --- | --- |
        | 40 | loss_spike |  | SpikeGuard |  |
    """
    lines = [events_summary(events)]
    if events:
        lines += ["", "| " + " | ".join(EVENT_COLUMNS) + " |", "|" + " --- |" * len(EVENT_COLUMNS)]
        for row in event_rows(events[:_MAX_TEXT_ROWS]):
            cells = ["" if v is None else str(v).replace("|", "\\|") for v in row]
            lines.append("| " + " | ".join(cells) + " |")
        if len(events) > _MAX_TEXT_ROWS:
            lines.append(f"\n... and {len(events) - _MAX_TEXT_ROWS} more")
    if events_file:
        lines.append(f"\nEvery field of every event: {events_file}")
    return "\n".join(lines)


def has_matplotlib() -> bool:
    """Whether matplotlib can be imported (not installed, or blocked with ``sys.modules["matplotlib"] = None``)."""
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        return False


def publish_report(
    data: RunData,
    directory: Path,
    loggers: Sequence[object],
    fallback_step: int,
    warn: Callable[[str], None],
    draw_figure: bool = True,
    warn_empty: Callable[[str], None] | None = None,
) -> Path | None:
    """Draw the report of ``data`` (``draw_figure``: matplotlib is there), write ``directory/gradient_report.png``
    and :func:`publish` it with the events at the last step that logged norms (``fallback_step`` when none did).
    Returns the PNG written, ``None`` when nothing was drawn (``warn_empty`` says why when nothing was logged)."""
    steps = [s for key, values in data.series.items() if key.startswith("grad_norm/") for s in values]
    step = max(steps, default=fallback_step)
    events_file = str(directory / EVENTS_FILENAME) if data.events else None
    figure, path = None, None
    if draw_figure:
        from gradkit.report.figure import (  # here: `python -m gradkit.report` must not find it imported
            close,
            draw,
            save,
        )

        try:
            figure = draw(data, source="GradNormMonitor")
        except ValueError as err:  # nothing logged (a run stopped before its first optimizer step)
            if warn_empty is not None:
                warn_empty(f"GradNormMonitor: no gradient report written: {err}")
            return None
        path = save(figure, directory / REPORT_FILE)
    try:
        publish(loggers, step, figure, data.events, warn, events_file)
    finally:
        if figure is not None:
            close(figure)
    return path


def publish(
    loggers: Sequence[object],
    step: int,
    figure: Any | None,
    events: Sequence[dict],
    warn: Callable[[str], None],
    events_file: str | None = None,
) -> list[str]:
    """Log the report's ``figure`` (``None``: matplotlib is missing, the events only) and ``events`` at ``step`` to
    every logger this module knows (see the table above). Returns the kinds reached, in logger order.

    A logger that raises is skipped with a warning (``warn``): the report never stops training.
    """
    reached = []
    for logger in loggers:
        kind = logger_kind(logger)
        if kind is None:
            continue
        try:
            _PUBLISHERS[kind](logger, step, figure, list(events), events_file)
        except Exception as err:  # a logger's own failure (network, a closed writer): the run goes on
            warn(
                f"GradNormMonitor: could not log the gradient report to {type(logger).__name__} "
                f"({type(err).__name__}: {err}); the log directory keeps gradient_report.png and gradkit_events.jsonl."
            )
            continue
        reached.append(kind)
    return reached


def _tensorboard(logger: Any, step: int, figure: Any, events: list[dict], events_file: str | None) -> None:
    writer = logger.experiment  # a SummaryWriter (torch's or tensorboardX's)
    if figure is not None:
        writer.add_figure(REPORT_TAG, figure, global_step=step, close=False)
    writer.add_text(EVENTS_TAG, events_markdown(events, events_file), global_step=step)
    writer.flush()


def _wandb(logger: Any, step: int, figure: Any, events: list[dict], events_file: str | None) -> None:
    if figure is not None:
        logger.log_image(key=REPORT_TAG, images=[_rgb(figure)], step=step, caption=[events_summary(events)])
    logger.log_table(key=EVENTS_TAG, columns=list(EVENT_COLUMNS), data=event_rows(events), step=step)


def _mlflow(logger: Any, step: int, figure: Any, events: list[dict], events_file: str | None) -> None:
    client, run_id = logger.experiment, logger.run_id  # an MlflowClient and the logger's run
    if figure is not None:
        client.log_figure(run_id, figure, REPORT_ARTIFACT)
    client.log_text(run_id, "".join(json.dumps(e) + "\n" for e in events), EVENTS_ARTIFACT)
    summary = events_summary(events)
    if len(summary) > _MLFLOW_TAG_LIMIT:
        summary = summary[: _MLFLOW_TAG_LIMIT - 40] + f" ... (all in {EVENTS_ARTIFACT})"
    client.set_tag(run_id, _MLFLOW_TAG, summary)
    client.set_tag(run_id, "gradkit.report_step", str(step))


def _rgb(figure: Any) -> Any:
    """The figure's pixels, ``(height, width, 3)`` uint8: W&B takes arrays on every version."""
    import numpy as np

    figure.canvas.draw()
    return np.asarray(figure.canvas.buffer_rgba())[..., :3].copy()


_PUBLISHERS: dict[str, Callable[[Any, int, Any, list[dict], str | None], None]] = {
    "tensorboard": _tensorboard,
    "wandb": _wandb,
    "mlflow": _mlflow,
}
