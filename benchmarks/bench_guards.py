"""Guard overhead with no faults: GradNormMonitor alone vs GradNormMonitor + NonFiniteGuard + SpikeGuard (on the
"gradkit" strategy, skipping enabled) vs GradNormMonitor under ``Trainer(detect_anomaly=True)``, on the same
GPT-style model, in one run.

    python benchmarks/bench_guards.py [--steps 60 --repeats 3] [--clock process]

``--clock process`` times each step in CPU time of this process (``time.process_time``) with one intra-op thread
instead of wall time: on a machine shared with other jobs, wall time mostly measures the neighbours.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
import harness
from harness import common_args, compare, report, run_table

from lightning_gradkit import GradNormMonitor, NonFiniteGuard, SpikeGuard
from lightning_gradkit.demos import ByteDataset, TinyGPTModule, stdlib_text

MODEL = dict(n_layer=8, n_head=4, n_embd=128, block_size=64)
# A model so small that a step is mostly fixed per-step costs: the difference of its step times is what the guards
# cost per step, whatever the model.
TINY = dict(n_layer=1, n_head=1, n_embd=16, block_size=16)
LOG_EVERY = 50


def guards() -> list:
    return [GradNormMonitor(depth=2), NonFiniteGuard(action="skip"), SpikeGuard("loss", action="skip")]


def configs(model: dict, anomaly: bool = True) -> dict:
    out = {
        "a_monitor": lambda: (TinyGPTModule(**model), {"callbacks": [GradNormMonitor(depth=2)]}),
        "b_monitor+guards": lambda: (TinyGPTModule(**model), {"callbacks": guards(), "strategy": "gradkit"}),
    }
    if anomaly:
        out["c_monitor+detect_anomaly"] = lambda: (
            TinyGPTModule(**model),
            {"callbacks": [GradNormMonitor(depth=2)], "detect_anomaly": True},
        )
    return out


def low_quantile(times: list[float], q: float = 0.1) -> float:
    """The ``q``-quantile of step times: neighbours on a shared machine only ever slow a step down, so a low
    quantile estimates the undisturbed step better than the median (``timeit`` takes the minimum for this reason)."""
    ordered = sorted(times)
    return ordered[int(q * (len(ordered) - 1))]


def quantile_lines(results: dict, baseline: str) -> str:
    base = low_quantile(results[baseline].times)
    return "\n".join(
        f"  p10 {name}: {low_quantile(r.times) * 1e3:.2f} ms, ratio {low_quantile(r.times) / base:.4f}"
        for name, r in results.items()
    )


class ProcessTimeStepTimer(harness.StepTimer):
    """The harness's step timer, reading this process's CPU time instead of the wall clock."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.starts.append(time.process_time())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.starts.append(time.process_time())


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--clock", choices=["wall", "process"], default="wall", help="what a step's time is")
    args = parser.parse_args()
    if args.clock == "process":
        torch.set_num_threads(1)
        harness.StepTimer = ProcessTimeStepTimer  # run_once builds its timer from this module attribute
    print(f"clock: {args.clock}")
    results = run_table(args, configs(MODEL), MODEL, "Guard overhead (no faults)", "a_monitor", LOG_EVERY)
    print(quantile_lines(results, "a_monitor"))
    base = results["a_monitor"].median
    guards = results["b_monitor+guards"].median
    anomaly = results["c_monitor+detect_anomaly"].median
    print(f"overhead of the guards over monitoring alone: {100 * (guards / base - 1):+.2f}% of step time")
    print(f"detect_anomaly=True vs the guards: {anomaly / guards:.2f}x slower")

    tiny_loader = DataLoader(ByteDataset(stdlib_text(), block_size=TINY["block_size"]), batch_size=4, shuffle=False)
    tiny = compare(
        configs(TINY, anomaly=False),
        tiny_loader,
        steps=4 * args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
        accelerator=args.accelerator,
        trainer_kwargs={"log_every_n_steps": LOG_EVERY},
    )
    print(report(tiny, "a_monitor", f"Fixed per-step cost, TinyGPT {TINY}, batch 4"))
    print(quantile_lines(tiny, "a_monitor"))
    for label, stat in (("median", lambda r: r.median), ("p10", lambda r: low_quantile(r.times))):
        cost = stat(tiny["b_monitor+guards"]) - stat(tiny["a_monitor"])
        share = 100 * cost / stat(results["a_monitor"])
        print(f"guards' fixed cost per step ({label}): {cost * 1e3:.3f} ms = {share:.2f}% of the TinyGPT {MODEL} step")


if __name__ == "__main__":
    main()
