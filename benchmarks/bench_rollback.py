"""Cost of SpikeRollback's snapshots: step time with snapshots every 50 and every 200 steps against no callback,
the time of one snapshot, and the host memory the snapshots take, on the same GPT-style model, in one run.

    python benchmarks/bench_rollback.py [--steps 110 --warmup 10 --repeats 3]

A snapshot happens on one step in ``n``, so the median step time does not see it: the table reports the *mean*
step time as well, and the script times the snapshot itself (the copies into the host ring, after a real step,
median of ``--captures``) and divides it by ``n`` and by the median step time of all runs: the overhead it adds per
step on average. That amortized figure does not depend on whether a snapshot step falls in the measured window.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import Result, common_args, run_table

from lightning_gradkit import SpikeRollback
from lightning_gradkit.demos import TinyGPTModule

MODEL = dict(n_layer=8, n_head=4, n_embd=128, block_size=64)
LOG_EVERY = 50


def rollback(n: int) -> tuple[pl.LightningModule, dict[str, Any]]:
    callback = SpikeRollback("loss", snapshot_every_n_steps=n)
    return TinyGPTModule(**MODEL), {"callbacks": [callback], "strategy": "gradkit"}


CONFIGS = {
    "a_none": lambda: (TinyGPTModule(**MODEL), {"strategy": "gradkit"}),
    "b_snapshot_every_200": lambda: rollback(200),
    "c_snapshot_every_50": lambda: rollback(50),
}


class CaptureTimer(pl.Callback):
    """After a few real steps (the AdamW state exists), time ``SpikeRollback``'s capture of one snapshot."""

    def __init__(self, rollback: SpikeRollback, after: int, captures: int) -> None:
        self.rollback = rollback
        self.after = after
        self.captures = captures
        self.times: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        if trainer.global_step != self.after:
            return
        for _ in range(self.captures):
            start = time.perf_counter()
            self.rollback._capture(trainer, pl_module)
            if torch.cuda.is_available():
                # The copies are queued non-blocking: include the time until they are done (the worst case).
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - start)


def measure_capture(captures: int, accelerator: str) -> tuple[float, int, int]:
    """Median time of one snapshot, the host bytes of the ring (``keep=2``) and the parameter bytes."""
    from harness import gpt_loader, quiet_trainer

    callback = SpikeRollback("loss", snapshot_every_n_steps=10**9)
    timer = CaptureTimer(callback, after=3, captures=captures)
    module = TinyGPTModule(**MODEL)
    trainer = quiet_trainer(accelerator, strategy="gradkit", max_steps=3, callbacks=[callback, timer])
    trainer.fit(module, gpt_loader(MODEL["block_size"]))
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    return statistics.median(timer.times), callback.snapshot_bytes, param_bytes


def mean_line(results: dict[str, Result], baseline: str) -> str:
    base = statistics.fmean(results[baseline].times)
    return "\n".join(
        f"  mean {name}: {statistics.fmean(r.times) * 1e3:.2f} ms, ratio {statistics.fmean(r.times) / base:.4f}"
        for name, r in results.items()
    )


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--captures", type=int, default=20, help="snapshots timed back to back")
    parser.set_defaults(steps=110)
    args = parser.parse_args()
    results = run_table(args, CONFIGS, MODEL, "Snapshot overhead (no spikes)", "a_none", LOG_EVERY)
    print(mean_line(results, "a_none"))
    capture, ring_bytes, param_bytes = measure_capture(args.captures, args.accelerator)
    # The denominator: the median step over all runs of all configurations (as in bench_engine_cost.py), steadier
    # on a shared machine than one configuration's median.
    step = statistics.median([t for r in results.values() for t in r.times])
    print(f"median step over all configurations: {step * 1e3:.2f} ms")
    print(f"one snapshot (parameters + buffers + AdamW state + small states): {capture * 1e3:.2f} ms")
    for n in (50, 200):
        print(f"amortized at snapshot_every_n_steps={n}: {100 * capture / n / step:.3f}% of step time")
    print(
        f"host memory, keep=2: {ring_bytes / 2**20:.1f} MiB = {ring_bytes / param_bytes:.2f}x the parameter bytes "
        f"({param_bytes / 2**20:.1f} MiB)"
    )


if __name__ == "__main__":
    main()
