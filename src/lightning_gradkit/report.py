"""The gradient report: one PNG from a run's logged metrics and its ``gradkit_events.jsonl``.

    python -m lightning_gradkit.report LOG_DIR [--out FILE]

``LOG_DIR`` is a ``CSVLogger`` run directory (it holds ``metrics.csv``). The figure shows:

1. a heatmap of per-module gradient norms (``grad_norm/module/*``, log10) over optimizer steps;
2. the total gradient norm before and after clipping, with markers for clipped steps;
3. every event of ``gradkit_events.jsonl`` (skipped steps, spikes, non-finite values, leaks, ...) as a marker
   at its step, labelled with what happened.

matplotlib is an optional dependency: ``pip install lightning_gradkit[report]``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from lightning_gradkit.events import EVENTS_FILENAME as EVENTS_FILE

REPORT_FILE = "gradient_report.png"
_MODULE_PREFIX = "grad_norm/module/"
_TOTAL = "grad_norm/total"
_POST = "grad_norm/total_post_clip"


@dataclass
class RunData:
    """Per-step series read from ``metrics.csv`` and the events of ``gradkit_events.jsonl``."""

    series: dict[str, dict[int, float]] = field(default_factory=lambda: defaultdict(dict))
    events: list[dict] = field(default_factory=list)

    @property
    def modules(self) -> list[str]:
        return [k[len(_MODULE_PREFIX) :] for k in self.series if k.startswith(_MODULE_PREFIX)]


def load_run(log_dir: str | Path) -> RunData:
    """Read a run directory.

    Raises:
        FileNotFoundError: if ``log_dir`` has neither ``metrics.csv`` nor ``gradkit_events.jsonl``.
    """
    log_dir = Path(log_dir)
    metrics, events = log_dir / "metrics.csv", log_dir / EVENTS_FILE
    if not metrics.exists() and not events.exists():
        raise FileNotFoundError(
            f"{log_dir} has no metrics.csv and no {EVENTS_FILE}. Pass the directory of a run logged with "
            "`CSVLogger` (its `log_dir`, e.g. lightning_logs/version_0)."
        )
    data = RunData()
    if metrics.exists():
        with metrics.open() as f:
            for row in csv.DictReader(f):
                step = row.get("step")
                if step in (None, ""):
                    continue
                for key, value in row.items():
                    if key != "step" and value not in (None, ""):
                        data.series[key][int(float(step))] = float(value)
    if events.exists():
        data.events = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    return data


def _log10(value: float) -> float:
    return math.log10(value) if value > 0 and math.isfinite(value) else math.nan


def render(log_dir: str | Path, out: str | Path | None = None) -> Path:
    """Render the report of the run in ``log_dir`` to a PNG and return its path.

    Args:
        log_dir: a ``CSVLogger`` run directory.
        out: where to write the PNG; defaults to ``log_dir/gradient_report.png``.

    Raises:
        ModuleNotFoundError: if matplotlib is not installed (the ``report`` extra).
        ValueError: if the run logged no gradient norm and no event (nothing to draw).

    Example::

        >>> render("lightning_logs/version_0")  # doctest: +SKIP
        PosixPath('lightning_logs/version_0/gradient_report.png')
    """
    data = load_run(log_dir)
    if not data.modules and _TOTAL not in data.series and not data.events:
        raise ValueError(
            f"{log_dir} has no `grad_norm/*` metric and no event. Add `GradNormMonitor(depth=...)` to the Trainer "
            "callbacks (with a CSVLogger) to record what the report draws."
        )
    fig = build_figure(data)
    out = Path(out) if out is not None else Path(log_dir) / REPORT_FILE
    fig.savefig(out, dpi=110)
    _pyplot().close(fig)
    return out


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError as err:  # pragma: no cover - depends on the environment
        raise ModuleNotFoundError(
            "The gradient report needs matplotlib: `pip install lightning_gradkit[report]`."
        ) from err
    return plt


def build_figure(data: RunData):
    """The report's matplotlib figure: module heatmap on top, total norms and events below."""
    plt = _pyplot()
    modules = data.modules
    fig, (ax_heat, ax_total) = plt.subplots(
        2, 1, figsize=(12, 3 + 0.28 * max(len(modules), 4)), sharex=True, height_ratios=[max(len(modules), 3), 3]
    )
    steps = sorted({s for k, v in data.series.items() if k.startswith("grad_norm") for s in v})
    if modules and steps:
        grid = [[_log10(data.series[_MODULE_PREFIX + m].get(s, math.nan)) for s in steps] for m in modules]
        extent = (steps[0] - 0.5, steps[-1] + 0.5, len(modules) - 0.5, -0.5)
        image = ax_heat.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis", extent=extent)
        ax_heat.set_yticks(range(len(modules)), modules, fontsize=7)
        fig.colorbar(image, ax=ax_heat, label="log10 gradient norm", pad=0.01)
        # Logged but non-finite (NaN/Inf) cells in red; cells with nothing logged stay blank.
        bad = [
            (s, row)
            for row, m in enumerate(modules)
            for s, v in data.series[_MODULE_PREFIX + m].items()
            if not math.isfinite(v)
        ]
        if bad:
            ax_heat.scatter([b[0] for b in bad], [b[1] for b in bad], marker="s", color="red", label="non-finite")
            ax_heat.legend(loc="upper right", fontsize=7)
    else:
        ax_heat.text(0.5, 0.5, "no per-module norms logged (GradNormMonitor(depth=...))", ha="center")
    ax_heat.set_title("Per-module gradient norm")

    if _TOTAL in data.series:
        pre = data.series[_TOTAL]
        ax_total.plot(list(pre), list(pre.values()), label="total (pre-clip)", color="tab:blue", lw=1)
        if _POST in data.series:
            post = data.series[_POST]
            ax_total.plot(list(post), list(post.values()), label="total (post-clip)", color="tab:green", lw=1)
            clipped = [s for s, v in post.items() if s in pre and v < pre[s] * (1 - 1e-6)]
            ax_total.scatter(clipped, [post[s] for s in clipped], s=12, color="tab:green", label="clipped", zorder=3)
        if any(v > 0 for v in pre.values()):
            ax_total.set_yscale("log")
    _draw_events(ax_total, data.events)
    ax_total.set_xlabel("optimizer step")
    ax_total.set_ylabel("gradient norm")
    ax_total.set_title("Total gradient norm and events")
    if ax_total.get_legend_handles_labels()[0]:
        ax_total.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    return fig


_EVENT_COLORS = ("tab:red", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


def _draw_events(ax, events: list[dict]) -> None:
    kinds = sorted({str(e.get("what", "event")) for e in events})
    for i, kind in enumerate(kinds):
        steps = [e["step"] for e in events if str(e.get("what", "event")) == kind and "step" in e]
        color = _EVENT_COLORS[i % len(_EVENT_COLORS)]
        for j, step in enumerate(steps):
            ax.axvline(step, color=color, ls="--", lw=1, alpha=0.8, label=f"event: {kind}" if j == 0 else None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_gradkit.report", description=__doc__.splitlines()[0])
    parser.add_argument("log_dir", help="a CSVLogger run directory (holds metrics.csv)")
    parser.add_argument("--out", default=None, help=f"output PNG (default: LOG_DIR/{REPORT_FILE})")
    args = parser.parse_args(argv)
    print(render(args.log_dir, args.out))


if __name__ == "__main__":
    main()
