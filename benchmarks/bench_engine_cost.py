"""Direct cost of the gradient work at the optimizer-step boundary, gradkit against Lightning, timed inside real
Trainer runs.

The boundary is Lightning's ``Precision._after_closure``: every callback's and the module's
``on_before_optimizer_step`` plus Lightning's own gradient clipping (``gradient_clip_val``). Timing that one
function gives every configuration the same ruler: gradkit's whole engine (monitor + clip + guards) on one side,
Lightning's ``clip_grad_norm_`` and its documented ``grad_norm`` logging recipe on the other. It complements the
A/B step-time tables, whose run-to-run noise on a shared CPU is several percent: this measures the work itself,
not a difference of two noisy medians. Runs are interleaved over ``--repeats`` and the step time used as the
denominator is the median over all runs of all configurations.

A second, paired measurement then sets ``GradNormMonitor + ClipGradNorm`` against ``gradient_clip_val`` step by step
within one run (``harness.paired_boundary_cost``): ``--paired-steps`` steps per run, ``2 * --repeats`` runs with
the side that goes first swapped each time. Its ratio is the median of the per-pair ratios.

    python benchmarks/bench_engine_cost.py [--steps 40 --warmup 8 --repeats 3 --paired-steps 200]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
from bench_monitoring import LightningRecipe
from harness import (
    ConfigFactory,
    around_boundary,
    common_args,
    gpt_loader,
    machine,
    paired_boundary_cost,
    paired_summary,
    run_once,
)

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
from lightning_gradkit.demos import TinyGPTModule

MODEL = dict(n_layer=8, n_head=4, n_embd=128, block_size=64)
BASELINE = "Lightning gradient_clip_val=1.0"


def _ours(*callbacks: pl.Callback) -> tuple[pl.LightningModule, dict[str, Any]]:
    strategy = "gradkit" if any(isinstance(c, NonFiniteGuard) for c in callbacks) else "auto"
    return TinyGPTModule(**MODEL), {"callbacks": [*callbacks, GradNormMonitor(depth=2)], "strategy": strategy}


CASES: dict[str, ConfigFactory] = {
    "nothing (no clipping, no norm logging)": lambda: (TinyGPTModule(**MODEL), {}),
    BASELINE: lambda: (TinyGPTModule(**MODEL), {"gradient_clip_val": 1.0}),
    "Lightning gradient_clip_val=1.0 + grad_norm recipe (b)": lambda: (
        LightningRecipe(**MODEL),
        {"gradient_clip_val": 1.0},
    ),
    "GradNormMonitor(depth=2)": lambda: _ours(),
    "+ ClipGradNorm": lambda: _ours(ClipGradNorm(1.0)),
    "+ ClipGradValue": lambda: _ours(ClipGradValue(0.01)),
    "+ AdaptiveGradClip": lambda: _ours(AdaptiveGradClip()),
    "+ AutoClip": lambda: _ours(AutoClip()),
    "+ ZClip": lambda: _ours(ZClip()),
    "+ NonFiniteGuard + SpikeGuard (gradkit strategy)": lambda: _ours(
        NonFiniteGuard(), SpikeGuard("grad_norm", action="skip")
    ),
}


def boundary_cost(case: ConfigFactory, loader: DataLoader, steps: int, warmup: int) -> tuple[list[float], list[float]]:
    """Per-step boundary times and step times (seconds) of one run, warm-up steps dropped."""
    samples: list[float] = []

    def timed(original: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        original(*args, **kwargs)
        samples.append(time.perf_counter() - t0)

    with around_boundary(timed):
        step_times = run_once(case, loader, steps, "cpu", {"log_every_n_steps": 50})
    return samples[warmup:], step_times[warmup:]


def paired(loader: DataLoader, steps: int, warmup: int, runs: int, accelerator: str = "cpu") -> None:
    """``GradNormMonitor(depth=2) + ClipGradNorm(1.0)`` against ``gradient_clip_val=1.0``, paired step by step."""
    pairs = [
        paired_boundary_cost(
            TinyGPTModule(**MODEL),
            loader,
            [ClipGradNorm(1.0), GradNormMonitor(depth=2)],
            steps,
            warmup,
            accelerator,
            first="ours" if k % 2 == 0 else "lightning",
        )
        for k in range(runs)
    ]
    ours, lightning, ratio = paired_summary(pairs)
    print(f"\npaired in one run ({runs} runs of {steps} steps, {warmup} warm-up pairs dropped, first side swapped):")
    print("| configuration | boundary per step (ms) |\n| --- | ---: |")
    print(f"| {BASELINE} | {lightning * 1e3:.3f} |\n| GradNormMonitor(depth=2) + ClipGradNorm | {ours * 1e3:.3f} |")
    print(f"| monitor + ClipGradNorm / gradient_clip_val (median of per-pair ratios) | {ratio:.3f}x |")


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--paired-steps", type=int, default=200, help="steps per paired run (0: none)")
    args = parser.parse_args()
    loader = gpt_loader(MODEL["block_size"])
    boundary: dict[str, list[float]] = {name: [] for name in CASES}
    steps: list[float] = []
    for _ in range(args.repeats):
        for name, case in CASES.items():
            b, s = boundary_cost(case, loader, args.steps, args.warmup)
            boundary[name] += b
            steps += s
    step = statistics.median(steps)
    cost = {name: statistics.median(b) for name, b in boundary.items()}
    print(f"machine: {machine()}\nmodel: TinyGPT {MODEL}, batch 16, log_every_n_steps=50")
    print(f"median step over all runs: {step * 1e3:.1f} ms ({args.repeats} interleaved runs per configuration)")
    print(f"| configuration | boundary per step (ms) | share of step | vs `{BASELINE}` (% of step) |")
    print("| --- | ---: | ---: | ---: |")
    for name, c in cost.items():
        print(f"| {name} | {c * 1e3:.3f} | {100 * c / step:.2f}% | {100 * (c - cost[BASELINE]) / step:+.2f}% |")
    if args.paired_steps:
        paired(loader, args.paired_steps, args.warmup, 2 * args.repeats)


if __name__ == "__main__":
    main()
