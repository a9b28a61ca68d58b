"""Direct cost of the gradkit engine per optimizer step (all gradkit callbacks' work at the step boundary),
timed inside a real Trainer run, for each clipping policy. Complements the A/B step-time tables, whose run-to-run
noise on a shared CPU is several percent: this measures the callbacks' own time, not a difference of two noisy
medians.

    python benchmarks/bench_engine_cost.py [--steps 40]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
from harness import StepTimer, common_args, machine

from lightning_gradkit import (
    AdaptiveGradClip,
    AutoClip,
    ClipGradNorm,
    ClipGradValue,
    GradNormMonitor,
    NonFiniteGuard,
    SpikeGuard,
    ZClip,
)
from lightning_gradkit._engine import _Engine
from lightning_gradkit.demos import ByteDataset, TinyGPTModule, stdlib_text

MODEL = dict(n_layer=8, n_head=4, n_embd=128, block_size=64)
CASES = {
    "GradNormMonitor(depth=2)": lambda: [],
    "+ ClipGradNorm": lambda: [ClipGradNorm(1.0)],
    "+ ClipGradValue": lambda: [ClipGradValue(0.01)],
    "+ AdaptiveGradClip": lambda: [AdaptiveGradClip()],
    "+ AutoClip": lambda: [AutoClip()],
    "+ ZClip": lambda: [ZClip()],
    "+ NonFiniteGuard + SpikeGuard (gradkit strategy)": lambda: [
        NonFiniteGuard(),
        SpikeGuard("grad_norm", action="skip"),
    ],
}


def engine_cost(extra: list, loader: DataLoader, steps: int, warmup: int) -> tuple[float, float]:
    """Median engine time per step and median step time, in seconds."""
    samples: list[float] = []
    original = _Engine.run

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        result = original(self, *args, **kwargs)
        if result is not None:
            samples.append(time.perf_counter() - t0)
        return result

    timer = StepTimer()
    strategy = "gradkit" if any(isinstance(c, NonFiniteGuard) for c in extra) else "auto"
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=50,
        strategy=strategy,
        callbacks=[*extra, GradNormMonitor(depth=2), timer],
    )
    _Engine.run = timed
    try:
        trainer.fit(TinyGPTModule(**MODEL), loader)
    finally:
        _Engine.run = original
    return statistics.median(samples[warmup:]), statistics.median(timer.step_times[warmup:])


def main() -> None:
    args = common_args(__doc__.splitlines()[0]).parse_args()
    loader = DataLoader(ByteDataset(stdlib_text(), MODEL["block_size"]), batch_size=16)
    print(f"machine: {machine()}\nmodel: TinyGPT {MODEL}, batch 16, log_every_n_steps=50")
    print("| callbacks | engine per step (ms) | step (ms) | engine share of step |")
    print("| --- | ---: | ---: | ---: |")
    for name, make in CASES.items():
        engine, step = engine_cost(make(), loader, args.steps, args.warmup)
        print(f"| {name} | {engine * 1e3:.3f} | {step * 1e3:.1f} | {100 * engine / step:.2f}% |")


if __name__ == "__main__":
    main()
