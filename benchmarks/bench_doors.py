"""The plain-PyTorch door's cost per optimizer step, side by side with the hand-written step it replaces.

A plain loop over N small tensors (16 values each, as ``bench_scale.py``'s model) times only the optimizer-step
part of each iteration, after the backward:

- ``torch``: ``clip_grad_norm_(foreach=True)`` then ``optimizer.step()``, what a loop without gradkit does;
- ``GradKit(monitor + ClipGradNorm)``: ``kit.step(optimizer)`` with ``GradNormMonitor`` and ``ClipGradNorm``;
- ``GradKit(full stack)``: also ``NonFiniteGuard(action="skip")`` and ``SpikeGuard(monitor="grad_norm")`` (the skip
  flag read once per step with SGD).

Configurations are interleaved over ``--repeats``; the medians of each configuration's per-step times are printed
with their ratio to ``torch``.

    python benchmarks/bench_doors.py [--sizes 100 1000 --steps 300 --warmup 30 --repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from harness import machine

from gradkit.doors.loop import GradKit
from lightning_gradkit import ClipGradNorm, GradNormMonitor, NonFiniteGuard, SpikeGuard

WIDTH = 16


class ManyTensors(nn.Module):
    """N parameter tensors of 16 values; the forward is one matrix product over all of them."""

    def __init__(self, num_tensors: int) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(WIDTH) * 0.1) for _ in range(num_tensors))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.stack(list(self.weights), dim=1)


def _policies(config: str) -> list:
    if config == "monitor + ClipGradNorm":
        return [GradNormMonitor(depth=0), ClipGradNorm(max_norm=1.0)]
    return [
        GradNormMonitor(depth=0),
        ClipGradNorm(max_norm=1.0),
        NonFiniteGuard(action="skip"),
        SpikeGuard(monitor="grad_norm", action="warn"),
    ]


def step_times(config: str, num_tensors: int, steps: int, warmup: int) -> list[float]:
    """Seconds spent in the optimizer-step part of each iteration (after the backward), warm-up dropped."""
    torch.manual_seed(0)
    model = ManyTensors(num_tensors)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, WIDTH)
    step: Callable[[], object]
    if config == "torch":

        def step() -> object:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            return opt.step()
    else:
        kit = GradKit(model, opt, _policies(config), log=lambda metrics, step: None, log_every_n_steps=50)

        def step() -> object:
            return kit.step(opt)

    times = []
    for _ in range(steps + warmup):
        model(x).square().mean().backward()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        opt.zero_grad(set_to_none=True)
    return times[warmup:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    configs = ["torch", "monitor + ClipGradNorm", "full stack"]
    print(machine())
    print(f"{args.steps} steps per run ({args.warmup} warm-up dropped), {args.repeats} interleaved runs; per-step time")
    print("of the optimizer-step part (clip + step, or kit.step), median over all runs\n")
    print("| configuration | " + " | ".join(f"{n} tensors" for n in args.sizes) + " |")
    print("| --- |" + " ---: |" * len(args.sizes))
    medians: dict[tuple[str, int], float] = {}
    for n in args.sizes:
        samples: dict[str, list[float]] = {c: [] for c in configs}
        for _ in range(args.repeats):
            for config in configs:
                samples[config] += step_times(config, n, args.steps, args.warmup)
        for config in configs:
            medians[config, n] = statistics.median(samples[config])
    for config in configs:
        cells = [f"{medians[config, n] * 1e6:.0f} us" for n in args.sizes]
        print(f"| {config} | " + " | ".join(cells) + " |")
    for config in configs[1:]:
        ratios = [f"{medians[config, n] / medians['torch', n]:.2f}x" for n in args.sizes]
        print(f"| {config} / torch | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
