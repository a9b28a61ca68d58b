"""Boundary cost at 100, 1,000 and 10,000 parameter tensors, and the engine's collective at many ranks.

The ruler is ``bench_engine_cost.py``'s: the wall time of Lightning's ``Precision._after_closure`` (every
``on_before_optimizer_step`` hook plus Lightning's own ``gradient_clip_val`` clipping), timed inside real Trainer
runs. The model holds N small tensors (16 values each, in chunks of 100 so that ``GradNormMonitor(depth=2)`` logs
N / 100 module norms) and its forward is a single matrix product, so the step is cheap and the per-tensor work at
the boundary is what grows. Configurations are interleaved over ``--repeats``. Then, per size, ``2 * --repeats``
paired runs set monitor + ClipGradNorm against ``gradient_clip_val`` step by step within one run
(``harness.paired_boundary_cost``, ``--paired-steps`` steps each; 0 turns them off).

``--profile`` runs cProfile over the boundary of ``GradNormMonitor + ClipGradNorm`` at the largest size and prints
the functions where the Python time goes. ``--payload`` prints only the collective-payload table (no training): the
bytes the engine all-reduces per step and a ring all-reduce estimate at 8, 64 and 1024 ranks next to the gradient
all-reduce of the same model.

    python benchmarks/bench_scale.py [--sizes 100 1000 10000 --steps 30 --warmup 5 --repeats 3]
    python benchmarks/bench_scale.py --quick
    python benchmarks/bench_scale.py --profile
    python benchmarks/bench_scale.py --payload
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine_cost import boundary_cost
from harness import ConfigFactory, around_boundary, common_args, machine, paired_boundary_cost, paired_summary, run_once

from lightning_gradkit import ClipGradNorm, GradNormMonitor, NonFiniteGuard, SpikeGuard

WIDTH = 16
CHUNK = 100
BASELINE = "Lightning gradient_clip_val=1.0"


class Chunk(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.params = nn.ParameterList([nn.Parameter(torch.randn(WIDTH) / WIDTH) for _ in range(n)])


class ManyTensors(pl.LightningModule):
    """``num_tensors`` parameter tensors of ``WIDTH`` values; the prediction is ``x @ W.T`` with ``W`` their stack."""

    def __init__(self, num_tensors: int, torch_clip: bool = False) -> None:
        super().__init__()
        sizes = [min(CHUNK, num_tensors - i) for i in range(0, num_tensors, CHUNK)]
        self.chunks = nn.ModuleList([Chunk(n) for n in sizes])
        self.torch_clip = torch_clip

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        weight = torch.stack([p for chunk in self.chunks for p in chunk.params])
        return nn.functional.mse_loss(x @ weight.T, y.expand(-1, weight.shape[0]))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.torch_clip:
            torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0, foreach=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def cases(n: int) -> dict[str, ConfigFactory]:
    def ours(*callbacks: pl.Callback, strategy: str = "auto") -> Callable[[], tuple[pl.LightningModule, dict]]:
        return lambda: (ManyTensors(n), {"callbacks": [GradNormMonitor(depth=2), *callbacks], "strategy": strategy})

    return {
        BASELINE: lambda: (ManyTensors(n), {"gradient_clip_val": 1.0}),
        "torch clip_grad_norm_(foreach=True)": lambda: (ManyTensors(n, torch_clip=True), {}),
        "GradNormMonitor + ClipGradNorm": ours(ClipGradNorm(1.0)),
        "full stack (+ NonFiniteGuard + SpikeGuard)": ours(
            ClipGradNorm(1.0), NonFiniteGuard(), SpikeGuard("grad_norm", action="skip"), strategy="gradkit"
        ),
    }


def data(steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(8 * steps, WIDTH, generator=g), torch.randn(8 * steps, 1)), batch_size=8
    )


def measure(sizes: list[int], steps: int, warmup: int, repeats: int, paired_steps: int = 0) -> None:
    loader = data(steps)
    print(f"machine: {machine()}\nmodel: N tensors of {WIDTH} values, batch 8, log_every_n_steps=50")
    print(f"{steps} steps per run ({warmup} warm-up dropped), {repeats} interleaved runs per configuration\n")
    names = list(cases(sizes[0]))
    table: dict[int, dict[str, float]] = {}
    for n in sizes:
        samples: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(repeats):
            for name, case in cases(n).items():
                samples[name] += boundary_cost(case, loader, steps, warmup)[0]
        table[n] = {name: statistics.median(s) for name, s in samples.items()}
    print("| configuration | " + " | ".join(f"{n:,} tensors (ms)" for n in sizes) + " |")
    print("| --- |" + " ---: |" * len(sizes))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{table[n][name] * 1e3:.2f}" for n in sizes) + " |")
    print(
        "| monitor + ClipGradNorm / gradient_clip_val | "
        + " | ".join(f"{table[n]['GradNormMonitor + ClipGradNorm'] / table[n][BASELINE]:.2f}x" for n in sizes)
        + " |"
    )
    if not paired_steps:
        return
    ratios = []
    for n in sizes:
        pairs = [
            paired_boundary_cost(
                ManyTensors(n),
                data(paired_steps),
                [GradNormMonitor(depth=2), ClipGradNorm(1.0)],
                paired_steps,
                warmup,
                first="ours" if k % 2 == 0 else "lightning",
            )
            for k in range(2 * repeats)
        ]
        ratios.append(paired_summary(pairs)[2])
    print(
        f"| same, paired step by step in one run ({2 * repeats} runs of {paired_steps} steps) | "
        + " | ".join(f"{r:.2f}x" for r in ratios)
        + " |"
    )


def profile(n: int, steps: int, top: int = 20) -> None:
    """cProfile over the boundary only (``Precision._after_closure``) of monitor + ClipGradNorm at ``n`` tensors."""
    profiler = cProfile.Profile()

    def profiled(original: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        profiler.enable()
        try:
            original(*args, **kwargs)
        finally:
            profiler.disable()

    with around_boundary(profiled):
        run_once(cases(n)["GradNormMonitor + ClipGradNorm"], data(steps), steps, "cpu", {"log_every_n_steps": 50})
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    print(f"cProfile of the boundary, GradNormMonitor + ClipGradNorm, {n:,} tensors, {steps} steps")
    stats.sort_stats("tottime").print_stats(top)
    print(out.getvalue())


# -- collective payload at many ranks (a cost model, no training) ------------------------------------------------


def ring_all_reduce_s(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce time: ``2 (n - 1)`` steps, each one hop of latency plus ``nbytes / n`` over the link."""
    return 2 * (ranks - 1) * (latency + nbytes / ranks / bandwidth)


def payload_table(
    tensor_counts: tuple[int, ...] = (1_000, 10_000, 100_000),
    ranks: tuple[int, ...] = (8, 64, 1024),
    bandwidth: float = 25e9,
    latency: float = 5e-6,
    elements_per_tensor: float = 1e6,
    grad_bytes: int = 2,
) -> str:
    """Markdown: the engine's all-reduce (one fp32 per trainable tensor and norm type, plus a few scalars) against the
    gradient all-reduce it rides next to (every gradient element once, ``grad_bytes`` each), ring model."""
    lines = [
        "| tensors | engine payload | engine all-reduce at 8 / 64 / 1024 ranks | gradient all-reduce at 8 / 64 / 1024 "
        "ranks | engine / gradients at 8 / 64 / 1024 ranks |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for count in tensor_counts:
        payload = 4 * count
        grads = grad_bytes * elements_per_tensor * count
        ours = [ring_all_reduce_s(payload, n, bandwidth, latency) for n in ranks]
        theirs = [ring_all_reduce_s(grads, n, bandwidth, latency) for n in ranks]
        lines.append(
            f"| {count:,} | {payload / 1024:,.0f} KiB | "
            + " / ".join(f"{t * 1e3:.2f} ms" for t in ours)
            + " | "
            + " / ".join(f"{t * 1e3:,.0f} ms" for t in theirs)
            + " | "
            + " / ".join(f"{100 * a / b:.3f}%" for a, b in zip(ours, theirs, strict=True))
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.set_defaults(steps=30, warmup=5, repeats=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1_000, 10_000])
    parser.add_argument("--quick", action="store_true", help="12 steps (4 warm-up), one run per configuration")
    parser.add_argument("--profile", action="store_true", help="cProfile the boundary at the largest size")
    parser.add_argument("--payload", action="store_true", help="print the collective-payload table only")
    parser.add_argument("--paired-steps", type=int, default=100, help="steps per paired run (0: none)")
    args = parser.parse_args()
    if args.payload:
        print(payload_table())
        return
    if args.quick:
        args.steps, args.warmup, args.repeats, args.paired_steps = 12, 4, 1, 24
    if args.profile:
        profile(max(args.sizes), args.steps)
        return
    measure(args.sizes, args.steps, args.warmup, args.repeats, args.paired_steps)


if __name__ == "__main__":
    main()
