"""Whole-step cost of gradkit's stack against bare Lightning and Lightning's own clip, on one CUDA device.

The project's GPT (:class:`lightning_gradkit.demos.TinyGPTModule`, vocabulary 256) on random tokens, AdamW,
``bf16-mixed``. Configurations (the table of the issue "Free on the GPU"):

    bare                  no callbacks, AdamW (foreach)
    lightning_clip        Trainer(gradient_clip_val=1.0)
    gradkit_monitor_clip  GradNormMonitor(log_every_n_steps=50) + ClipGradNorm(1.0)
    gradkit_full          GradNormMonitor + ZClip() + NonFiniteGuard("skip") + SpikeGuard("loss", action="skip")
    bare_fused            no callbacks, AdamW(fused=True)
    gradkit_full_fused    the full stack with AdamW(fused=True)

Each fit is a fresh Trainer; the configurations run interleaved ``--repeats`` times and each figure is the median
of its fits. A fit's time is that of steps ``--warmup``..``--steps`` with one synchronize at each end (no sync
between steps, as in training), so it includes the logging step (step 50) and the last step, which the monitor also
logs. A second pass times single steps, with a synchronize around each, for the steps around the logging step: the
logging step's extra milliseconds and the first step's time, where the whole-run gap of monitor + clip against
Lightning's clip was left unexplained by the steady-state profile.

Targets (on CUDA): monitor + clip <= Lightning's clip; full <= 1.05x bare (foreach); full fused <= 1.03x bare fused.

    python benchmarks/bench_gpu_step.py [--small] [--steps 60 --warmup 15 --repeats 3] [--json PATH]
    python benchmarks/bench_gpu_step.py --tiny       # CPU smoke run: 2 x 64, a few steps, fp32
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_gradkit as gk
from lightning_gradkit.demos import TinyGPTModule

SIZES: dict[str, dict[str, int]] = {
    "default": {"layers": 12, "embd": 768, "batch": 16, "block": 256},
    "small": {"layers": 4, "embd": 256, "batch": 8, "block": 128},
    "tiny": {"layers": 2, "embd": 64, "batch": 4, "block": 32},
}


@dataclass(frozen=True)
class Config:
    strategy: str
    fused: bool
    clip: float | None
    callbacks: Callable[[int], list[pl.Callback]]


def _none(log_every: int) -> list[pl.Callback]:
    return []


def _monitor_clip(log_every: int) -> list[pl.Callback]:
    return [gk.GradNormMonitor(log_every_n_steps=log_every), gk.ClipGradNorm(1.0)]


def _full(log_every: int) -> list[pl.Callback]:
    return [
        gk.GradNormMonitor(log_every_n_steps=log_every),
        gk.ZClip(),
        gk.NonFiniteGuard(action="skip"),
        gk.SpikeGuard("loss", action="skip"),
    ]


CONFIGS: dict[str, Config] = {
    "bare": Config("auto", False, None, _none),
    "lightning_clip": Config("auto", False, 1.0, _none),
    "gradkit_monitor_clip": Config("gradkit", False, None, _monitor_clip),
    "gradkit_full": Config("gradkit", False, None, _full),
    "bare_fused": Config("auto", True, None, _none),
    "gradkit_full_fused": Config("gradkit", True, None, _full),
}
# (name, numerator, denominator, limit): numerator / denominator <= limit.
TARGETS = [
    ("monitor+clip <= Lightning clip", "gradkit_monitor_clip", "lightning_clip", 1.0),
    ("full <= 1.05x bare (foreach)", "gradkit_full", "bare", 1.05),
    ("full fused <= 1.03x bare fused", "gradkit_full_fused", "bare_fused", 1.03),
]
# The per-step pass: where the gap between these two lies, with bare as the reference.
PER_STEP_CONFIGS = ("bare", "lightning_clip", "gradkit_monitor_clip")


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


class RunClock(pl.Callback):
    """Wall time of steps ``warmup``..end of the fit, with one synchronize at each end."""

    def __init__(self, warmup: int, cuda: bool) -> None:
        self.warmup, self.cuda = warmup, cuda
        self.t0 = self.t1 = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if idx == self.warmup:
            _sync(self.cuda)
            self.t0 = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _sync(self.cuda)
        self.t1 = time.perf_counter()


class StepClock(pl.Callback):
    """Wall time of every step (batch start to next batch start, so the logger's flush counts), synchronized."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        _sync(self.cuda)
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _sync(self.cuda)
        self.starts.append(time.perf_counter())

    @property
    def step_ms(self) -> list[float]:
        return [(b - a) * 1e3 for a, b in zip(self.starts, self.starts[1:], strict=False)]


def fit(
    cfg: Config,
    size: dict[str, int],
    args: argparse.Namespace,
    data: TensorDataset,
    clock: pl.Callback,
    steps: int | None = None,
) -> None:
    torch.manual_seed(0)
    module = TinyGPTModule(
        n_layer=size["layers"],
        n_head=max(1, size["embd"] // 64),
        n_embd=size["embd"],
        block_size=size["block"],
        fused=cfg.fused,
    )
    trainer = pl.Trainer(
        accelerator="gpu" if args.cuda else "cpu",
        devices=1,
        strategy=cfg.strategy,
        precision=args.precision,
        max_steps=steps or args.steps,
        callbacks=[clock, *cfg.callbacks(args.log_every)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=cfg.clip,
        log_every_n_steps=args.log_every,
    )
    trainer.fit(module, DataLoader(data, batch_size=size["batch"]))


def per_step(cfg: Config, size: dict[str, int], args: argparse.Namespace, data: TensorDataset) -> dict[str, float]:
    """One fit through the first logging step and a few steps beyond; each step timed alone."""
    clock = StepClock(args.cuda)
    fit(cfg, size, args, data, clock, steps=args.log_every + 6)
    ms = clock.step_ms
    logging_idx = args.log_every - 1  # global step 49 logs: (49 + 1) % 50 == 0
    window = range(max(1, logging_idx - 8), len(ms) - 1)  # the last step also logs: left out of the reference
    steady = statistics.median(ms[i] for i in window if (i + 1) % args.log_every)
    return {
        "first_step_ms": ms[0],
        "second_step_ms": ms[1],
        "steady_step_ms": steady,
        "logging_step_ms": ms[logging_idx],
        "logging_extra_ms": ms[logging_idx] - steady,
        "last_step_ms": ms[-1],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--small", action="store_true", help="GPT 4 x 256, batch 8 x 128")
    which.add_argument("--tiny", action="store_true", help="GPT 2 x 64, batch 4 x 32, fp32, few steps: CPU smoke run")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per fit (default 60, tiny 10)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed first steps of a fit (default 15, tiny 3)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved fits per configuration (default 3)")
    parser.add_argument("--precision", default=None, help="Trainer precision (default bf16-mixed, tiny 32-true)")
    parser.add_argument("--log-every", type=int, default=None, help="logging period (default 50, tiny 5)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    args.cuda = args.device == "cuda"
    if not args.cuda and not args.tiny:
        print("bench_gpu_step: skipped: no CUDA device (a GPU benchmark; --tiny runs on CPU)")
        return 0
    tiny = args.tiny
    size = SIZES["tiny" if tiny else "small" if args.small else "default"]
    args.steps = args.steps or (10 if tiny else 60)
    args.warmup = args.warmup if args.warmup is not None else (3 if tiny else 15)
    args.repeats = args.repeats or (1 if tiny else 3)
    args.precision = args.precision or ("32-true" if tiny else "bf16-mixed")
    args.log_every = args.log_every or (5 if tiny else 50)
    if args.warmup >= args.steps:
        parser.error(f"--warmup ({args.warmup}) must be below --steps ({args.steps})")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings(
        "ignore", message=".*(LeafSpec|smaller than the logging interval|fewer than the logging|no `val_dataloader`)"
    )

    g = torch.Generator().manual_seed(0)
    n_samples = size["batch"] * max(args.steps, args.log_every + 6)
    x = torch.randint(0, 256, (n_samples, size["block"] + 1), generator=g)
    data = TensorDataset(x[:, :-1], x[:, 1:])

    # One untimed fit first: the process's one-time costs (CUDA context, cuBLAS handles, kernel loading, imports
    # of the callbacks' modules) would otherwise land on the first configuration of the first repeat.
    for name in ("bare", "gradkit_full_fused"):
        fit(CONFIGS[name], size, args, data, RunClock(args.warmup, args.cuda), steps=args.warmup + 2)
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(args.repeats):
        for name, cfg in CONFIGS.items():
            clock = RunClock(args.warmup, args.cuda)
            fit(cfg, size, args, data, clock)
            times[name].append((clock.t1 - clock.t0) / (args.steps - args.warmup) * 1e3)
    steps = {name: per_step(CONFIGS[name], size, args, data) for name in PER_STEP_CONFIGS}

    device = torch.cuda.get_device_name() if args.cuda else f"CPU ({torch.get_num_threads()} threads)"
    model = f"GPT {size['layers']} x {size['embd']}, batch {size['batch']} x {size['block']}"
    print(
        f"device {device}; torch {torch.__version__}; lightning {pl.__version__}\n{model}, {args.precision}, "
        f"steps {args.warmup}..{args.steps} of each fit timed, log_every_n_steps={args.log_every}; "
        f"ms per step, median of {args.repeats} interleaved fits"
    )
    med = {name: statistics.median(ts) for name, ts in times.items()}
    base = {name: "bare_fused" if CONFIGS[name].fused else "bare" for name in CONFIGS}
    for name, ts in times.items():
        ref = base[name]
        runs = ", ".join(f"{t:.2f}" for t in ts)
        print(f"  {name:22s} {med[name]:8.2f} ms  x{med[name] / med[ref]:.4f} {ref:10s}  runs [{runs}]")
    print("single steps, synchronized around each (ms): first, second, steady median, logging step, its extra")
    for name, s in steps.items():
        print(
            f"  {name:22s} {s['first_step_ms']:9.1f} {s['second_step_ms']:8.2f} {s['steady_step_ms']:8.2f} "
            f"{s['logging_step_ms']:8.2f}  {s['logging_extra_ms']:+7.2f}"
        )
    targets = []
    failed = False
    for label, num, den, limit in TARGETS:
        ratio = med[num] / med[den]
        ok = ratio <= limit
        targets.append({"name": label, "value": ratio, "limit": limit, "pass": ok})
        verdict = ("PASS" if ok else "FAIL") if args.cuda and not tiny else "info (a CUDA target)"
        print(f"target {label}: x{ratio:.4f} (limit {limit:g}) {verdict}")
        failed |= args.cuda and not tiny and not ok
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "benchmark": "bench_gpu_step",
            "device": device,
            "torch": torch.__version__,
            "lightning": pl.__version__,
            "model": model,
            "precision": args.precision,
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "log_every_n_steps": args.log_every,
            "ms_per_step": med,
            "runs": times,
            "ratio": {name: med[name] / med[base[name]] for name in CONFIGS},
            "ratio_to": base,
            "single_steps": steps,
            "targets": targets,
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
