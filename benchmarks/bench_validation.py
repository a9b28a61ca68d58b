"""In-fit validation time: Lightning's default (``torch.no_grad``) vs InferenceModeValidation
(``torch.inference_mode``), on the same GPT-style model and data, in one run.

Each fit trains a few steps per epoch and validates at every epoch end; the time of every in-fit validation loop
(``on_validation_start`` to ``on_validation_end``, sanity check excluded) is recorded. Runs are interleaved
(A, B, A, B, ...) so drifts of the machine hit both configurations alike. A second table isolates the grad mode:
the model's validation forward alone, alternating ``no_grad`` / ``inference_mode`` batch by batch, at a small
batch (per-op overhead dominates, where inference mode saves most) and at the fit's batch size.

    python benchmarks/bench_validation.py [--epochs 6 --val-batches 20 --repeats 3]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
from harness import common_args, machine, quiet_trainer, sync_device

from lightning_gradkit import InferenceModeValidation
from lightning_gradkit.demos import ByteDataset, TinyGPTModule, stdlib_text

MODEL = dict(n_layer=6, n_head=4, n_embd=128, block_size=64)


class ValidationTimer(pl.Callback):
    """Wall time of every in-fit validation loop (the sanity check excluded)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sync_device()
        self._start = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sync_device()
        if not trainer.sanity_checking:
            self.times.append(time.perf_counter() - self._start)


def run_once(callbacks: list[pl.Callback], train: DataLoader, val: DataLoader, args: Any) -> list[float]:
    timer = ValidationTimer()
    trainer = quiet_trainer(
        args.accelerator,
        max_epochs=args.epochs,
        limit_train_batches=2,
        limit_val_batches=args.val_batches,
        num_sanity_val_steps=1,
        callbacks=[*callbacks, timer],
    )
    trainer.fit(TinyGPTModule(**MODEL), train, val)
    return timer.times[1:]  # the first validation warms up allocators and kernels


def time_forward(batch_size: int, iters: int, accelerator: str) -> dict[str, float]:
    """Median time of one validation forward (loss) under each grad mode, alternating modes every iteration."""
    device = "cuda" if accelerator == "gpu" else "cpu"
    module = TinyGPTModule(**MODEL).to(device).eval()
    x = torch.randint(0, 256, (batch_size, MODEL["block_size"]), device=device)
    modes = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
    times: dict[str, list[float]] = {name: [] for name in modes}
    for i in range(iters + 5):
        order = list(modes.items())
        for name, mode in order if i % 2 == 0 else order[::-1]:  # A B B A: neither mode always runs second
            sync_device()
            start = time.perf_counter()
            with mode():
                module.loss((x, x))
            sync_device()
            if i >= 5:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6, help="epochs per run (one validation each)")
    parser.add_argument("--val-batches", type=int, default=20, help="validation batches per validation")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--forward-iters", type=int, default=200, help="forwards per mode in the isolated timing")
    parser.add_argument("--skip-fit", action="store_true", help="only the isolated forward timing")
    args = parser.parse_args()

    text = stdlib_text(max_bytes=300_000)
    train = DataLoader(ByteDataset(text[:200_000], MODEL["block_size"]), batch_size=args.batch_size)
    val = DataLoader(ByteDataset(text[200_000:], MODEL["block_size"]), batch_size=args.batch_size)
    configs = {
        "lightning_no_grad": list,
        "InferenceModeValidation": lambda: [InferenceModeValidation()],
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(0 if args.skip_fit else args.repeats):
        for name, make_callbacks in configs.items():
            times[name] += run_once(make_callbacks(), train, val, args)

    print(f"### In-fit validation time ({machine()})")
    print()
    shape = f"{args.val_batches} batches of {args.batch_size} x {MODEL['block_size']} tokens"
    print(f"{shape} per validation, model {MODEL}")
    print()
    if not args.skip_fit:
        base = statistics.median(times["lightning_no_grad"])
        print("| configuration | validations | median per validation (ms) | per batch (ms) | ratio vs no_grad |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for name, values in times.items():
            median = statistics.median(values)
            print(
                f"| {name} | {len(values)} | {median * 1e3:.1f} | {median * 1e3 / args.val_batches:.2f} | "
                f"{median / base:.4f} |"
            )
        print()
    print("| validation forward alone | batch | no_grad (ms) | inference_mode (ms) | ratio |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for batch_size in (1, args.batch_size):
        t = time_forward(batch_size, args.forward_iters, args.accelerator)
        print(
            f"| alternating, {args.forward_iters} each | {batch_size} | {t['no_grad'] * 1e3:.2f} | "
            f"{t['inference_mode'] * 1e3:.2f} | {t['inference_mode'] / t['no_grad']:.4f} |"
        )


if __name__ == "__main__":
    main()
