"""Guard overhead with no faults: GradNormMonitor alone vs GradNormMonitor + NonFiniteGuard + SpikeGuard (on the
"gradkit" strategy, skipping enabled) vs GradNormMonitor under ``Trainer(detect_anomaly=True)``, on the same
GPT-style model, in one run.

    python benchmarks/bench_guards.py [--steps 60 --repeats 3]
"""

from __future__ import annotations

import sys
from pathlib import Path

from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
from harness import common_args, compare, machine, report

from lightning_gradkit import GradNormMonitor, NonFiniteGuard, SpikeGuard
from lightning_gradkit.demos import ByteDataset, TinyGPTModule, stdlib_text

MODEL = dict(n_layer=8, n_head=4, n_embd=128, block_size=64)
LOG_EVERY = 50


def configs() -> dict:
    def guards() -> list:
        return [GradNormMonitor(depth=2), NonFiniteGuard(action="skip"), SpikeGuard("loss", action="skip")]

    return {
        "a_monitor": lambda: (TinyGPTModule(**MODEL), {"callbacks": [GradNormMonitor(depth=2)]}),
        "b_monitor+guards": lambda: (TinyGPTModule(**MODEL), {"callbacks": guards(), "strategy": "gradkit"}),
        "c_monitor+detect_anomaly": lambda: (
            TinyGPTModule(**MODEL),
            {"callbacks": [GradNormMonitor(depth=2)], "detect_anomaly": True},
        ),
    }


def main() -> None:
    args = common_args(__doc__.splitlines()[0]).parse_args()
    data = ByteDataset(stdlib_text(), block_size=MODEL["block_size"])
    loader = DataLoader(data, batch_size=16, shuffle=False)
    print(f"machine: {machine()}\nmodel: TinyGPT {MODEL}, batch 16, no faults")
    results = compare(
        configs(),
        loader,
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
        accelerator=args.accelerator,
        trainer_kwargs={"log_every_n_steps": LOG_EVERY},
    )
    print(report(results, "a_monitor", f"Guard overhead, log_every_n_steps={LOG_EVERY}"))
    base = results["a_monitor"].median
    guards = results["b_monitor+guards"].median
    anomaly = results["c_monitor+detect_anomaly"].median
    print(f"overhead of the guards over monitoring alone: {100 * (guards / base - 1):+.2f}% of step time")
    print(f"detect_anomaly=True vs the guards: {anomaly / guards:.2f}x slower")


if __name__ == "__main__":
    main()
