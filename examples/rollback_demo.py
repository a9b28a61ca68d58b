"""A spike that plain skipping does not cure, and SpikeRollback does: both loss curves in one PNG.

    python examples/rollback_demo.py                         # writes docs/rollback.png (CPU, a few minutes)
    python examples/rollback_demo.py --inject-spike-at 150 --max-steps 240 --out rollback.png
    python examples/rollback_demo.py --escalation            # writes docs/rollback_escalation.png

Trains the tiny GPT of ``examples/tiny_gpt.py`` three times through its command line, from the same seed:

1. no fault (the reference curve);
2. ``--inject-spike-at STEP``: the learning rate is multiplied by 100 for 4 steps. Those updates are applied while
   the loss still looks normal; the loss spikes afterwards. ``SpikeGuard(action="skip")`` skips the spiking steps,
   but the damage is already in the weights: the loss stays high and recovers slowly;
3. the same fault with ``SpikeRollback`` added: after 3 spiking steps in a row it restores the snapshot taken
   before the spike (every 50 steps, in host memory) and training goes on from there on fresh data.

With ``--escalation``, the fault comes back after a rollback: the raised learning rate is keyed on the optimizer's
own step count (``--inject-spike-clock=optimizer``), which the rollback restores with the snapshot, as a fault of
the configuration would. The three runs are then:

1. no fault;
2. ``SpikeRollback`` alone: every rollback walks into the fault again (its budget is raised so that the run goes on;
   with the default ``max_rollbacks=5`` it stops with an error);
3. ``SpikeRollback`` with escalation: when the spike comes back, the second rollback also cuts the learning rate
   to 10% and ramps it back over 200 applied steps, so the restored run goes through the fault.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import tiny_gpt

from lightning_gradkit.demos import LossRecorder

# A small model, so that the three runs take minutes on a CPU.
MODEL = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=48", "--model.block_size=32", "--data.batch_size=16"]
GUARDS = [
    "--trainer.callbacks+=lightning_gradkit.NonFiniteGuard",
    "--trainer.callbacks+=lightning_gradkit.SpikeGuard",
    "--trainer.callbacks.action=skip",
]
ROLLBACK = [
    "--trainer.callbacks+=lightning_gradkit.SpikeRollback",
    "--trainer.callbacks.z_threshold=3.0",
    "--trainer.callbacks.patience=3",
    "--trainer.callbacks.snapshot_every_n_steps=50",
]
ESCALATION = ["--trainer.callbacks.escalate_lr_factor=0.1", "--trainer.callbacks.escalate_rewarmup_steps=200"]
# Rollback alone meets the recurring fault again and again: a budget that lets the run go on to the end.
ENDLESS = ["--trainer.callbacks.max_rollbacks=100"]


def train(root: Path, max_steps: int, extra: list[str]) -> tuple[list[float], list[dict]]:
    """One run of ``tiny_gpt.py fit``; returns the loss of every batch and the events it wrote."""
    args = [
        "fit",
        "--seed_everything=0",
        "--trainer.accelerator=cpu",
        "--trainer.strategy=gradkit",
        f"--trainer.max_steps={max_steps}",
        f"--trainer.default_root_dir={root}",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.limit_val_batches=0",
        "--trainer.callbacks+=lightning_gradkit.demos.LossRecorder",
        *MODEL,
        *extra,
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = tiny_gpt.main(args)
    (recorder,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, LossRecorder)]
    path = root / "gradkit_events.jsonl"
    found = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return recorder.losses, found


def run_all(max_steps: int, spike_at: int, work: Path) -> dict[str, tuple[list[float], list[dict]]]:
    """The three runs of the module docstring, keyed ``"no fault"``, ``"skip"`` and ``"rollback"``."""
    fault = [f"--inject-spike-at={spike_at}"]
    return {
        "no fault": train(work / "clean", max_steps, GUARDS),
        "skip": train(work / "skip", max_steps, [*fault, *GUARDS]),
        "rollback": train(work / "rollback", max_steps, [*fault, *GUARDS, *ROLLBACK]),
    }


def run_escalation(max_steps: int, spike_at: int, work: Path) -> dict[str, tuple[list[float], list[dict]]]:
    """The three runs of ``--escalation``, keyed ``"no fault"``, ``"rollback"`` and ``"escalation"``."""
    fault = [f"--inject-spike-at={spike_at}", "--inject-spike-clock=optimizer"]
    return {
        "no fault": train(work / "clean", max_steps, GUARDS),
        "rollback": train(work / "rollback", max_steps, [*fault, *GUARDS, *ROLLBACK, *ENDLESS]),
        "escalation": train(work / "escalation", max_steps, [*fault, *GUARDS, *ROLLBACK, *ESCALATION]),
    }


def smooth(values: list[float], window: int = 9) -> list[float]:
    """Trailing mean, so single noisy batches do not hide the trend."""
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def loss_axes(runs: dict[str, tuple[list[float], list[dict]]], styles: dict[str, dict]) -> tuple[Any, Any]:
    """A figure with each run's smoothed loss curve drawn in its style."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    for name, (losses, _) in runs.items():
        ax.plot(range(len(losses)), smooth(losses), **styles[name])
    return fig, ax


def save(fig: Any, ax: Any, out: Path) -> Path:
    """Add the legend, write the figure to ``out`` and close it."""
    import matplotlib.pyplot as plt

    ax.legend(fontsize=8, loc="upper right", framealpha=1.0)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def plot(runs: dict[str, tuple[list[float], list[dict]]], spike_at: int, out: Path) -> Path:
    fig, ax = loss_axes(
        runs,
        {
            "no fault": dict(color="0.6", lw=1.2, label="no fault"),
            "skip": dict(color="tab:red", lw=1.4, label='injected spike, SpikeGuard(action="skip")'),
            "rollback": dict(color="tab:blue", lw=1.4, label="injected spike, + SpikeRollback"),
        },
    )
    ax.axvspan(spike_at, spike_at + 4, color="tab:orange", alpha=0.3, label="learning rate x100 (4 steps)")
    for event in (e for e in runs["rollback"][1] if e["what"] == "rollback"):
        ax.axvline(event["from_step"], color="tab:blue", ls="--", lw=1)
        ax.annotate(
            f"rollback to the snapshot of step {event['to_step']}",
            (event["from_step"], 0.6),
            xycoords=("data", "axes fraction"),
            xytext=(-6, 0),
            textcoords="offset points",
            ha="right",
            fontsize=8,
            color="tab:blue",
        )
    ax.set_xlabel("optimizer step (trainer.global_step)")
    ax.set_ylabel("training loss (mean of 9 batches)")
    ax.set_title("A spike that skipping does not cure: tiny GPT on CPU")
    return save(fig, ax, out)


def plot_escalation(runs: dict[str, tuple[list[float], list[dict]]], spike_at: int, out: Path) -> Path:
    fig, ax = loss_axes(
        runs,
        {
            "no fault": dict(color="0.6", lw=1.2, label="no fault"),
            "rollback": dict(color="tab:red", lw=1.4, label="recurring spike, SpikeRollback alone"),
            "escalation": dict(color="tab:blue", lw=1.4, label="recurring spike, SpikeRollback with escalation"),
        },
    )
    for name, color in (("rollback", "tab:red"), ("escalation", "tab:blue")):
        for event in (e for e in runs[name][1] if e["what"] == "rollback"):
            ax.axvline(event["from_step"], color=color, ls="--", lw=0.8, alpha=0.7)
    for event in (e for e in runs["escalation"][1] if e["what"] == "escalation"):
        ax.annotate(
            f"escalation: back to step {event['to_step']},\nlearning rate x{event['lr_factor']:.2g}, "
            f"ramped back over {event['rewarmup_steps']} steps",
            (event["step"] + 1, 0.6),
            xycoords=("data", "axes fraction"),
            xytext=(6, 0),
            textcoords="offset points",
            fontsize=8,
            color="tab:blue",
            bbox=dict(facecolor="white", edgecolor="none", alpha=0.9),
        )
    ax.set_xlabel("optimizer step (trainer.global_step); dashed: rollbacks")
    ax.set_ylabel("training loss (mean of 9 batches)")
    ax.set_title(
        f"A spike that comes back after every rollback (learning rate x100 at the optimizer's step {spike_at})",
        fontsize=10,
    )
    return save(fig, ax, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=None, help="300, or 500 with --escalation")
    parser.add_argument("--inject-spike-at", type=int, default=180)
    parser.add_argument(
        "--escalation", action="store_true", help="a spike that comes back after a rollback, cured by escalation"
    )
    parser.add_argument("--out", type=Path, default=None, help="docs/rollback.png or docs/rollback_escalation.png")
    args = parser.parse_args()
    docs = Path(__file__).parents[1] / "docs"
    max_steps = args.max_steps or (500 if args.escalation else 300)
    with tempfile.TemporaryDirectory() as work:
        if args.escalation:
            runs = run_escalation(max_steps, args.inject_spike_at, Path(work))
        else:
            runs = run_all(max_steps, args.inject_spike_at, Path(work))
    for name, (losses, found) in runs.items():
        tail = sum(losses[-20:]) / 20
        rollbacks = [(e["from_step"], e["to_step"]) for e in found if e["what"] == "rollback"]
        print(f"{name:10s} mean loss of the last 20 batches {tail:.3f}; rollbacks (from, to): {rollbacks}")
    if args.escalation:
        print(plot_escalation(runs, args.inject_spike_at, args.out or docs / "rollback_escalation.png"))
    else:
        print(plot(runs, args.inject_spike_at, args.out or docs / "rollback.png"))


if __name__ == "__main__":
    main()
