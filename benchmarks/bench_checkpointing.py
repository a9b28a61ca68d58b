"""Activation checkpointing trade-off: saved activation bytes and step time for none / full / every 2nd block /
selective / memory budget 0.5, on the same GPT-style model, in one interleaved run. On a GPU it also reports the
peak ``torch.cuda.max_memory_allocated`` per training step.

    python benchmarks/bench_checkpointing.py [--n-embd 256 --steps 12 --warmup 3 --repeats 2 --threads 1]

The default width, 256, is where the model's time goes to matmuls, as in the models checkpointing is for. At 64 wide
the CPU step is bound by per-op overhead instead: the recompute then costs a larger share of the step, and
selective mode's per-op dispatch (a Python ``TorchDispatchMode`` in PyTorch's implementation, in the forward and in
the recompute) can cost more than the matmuls it saves. ``--n-embd 64`` shows that regime.

Besides the harness's wall-clock step time it reports the process CPU time per step (``time.process_time``), which a
busy shared machine disturbs far less; with ``--threads 1`` it is the compute cost of each configuration.

Saved activation bytes come from the callback's measuring step (``saved_tensors_hooks``, unique storages, plus what
the checkpointed regions keep), on the first batch of the last run of each configuration.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
from harness import common_args, compare, machine, report

from gradkit._util.arguments import format_bytes
from lightning_gradkit import ActivationCheckpointing
from lightning_gradkit.demos import ByteDataset, TinyGPTModule, stdlib_text

MODEL: dict[str, Any] = dict(n_layer=8, n_head=4, n_embd=256, block_size=128, dropout=0.0)
BATCH = 16
SETTINGS: dict[str, dict[str, Any] | None] = {
    "a_none": None,
    "b_full": {"mode": "full"},
    "c_every_2nd": {"every_n": 2},
    "d_selective": {"mode": "selective"},
    "e_budget_0.5": {"memory_budget": 0.5},
    # PyTorch's checkpoint written by hand around every block: the reference for the cost of the recompute itself.
    "f_hand_written_checkpoint": None,
}
HAND_WRITTEN = "f_hand_written_checkpoint"


class HandCheckpointed(TinyGPTModule):
    """Every block's forward wrapped in ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` by hand."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for block in self.model.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


class StepCPUTime(pl.Callback):
    """Process CPU time of each training step (all threads of this process)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start: float | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        now = time.process_time()
        if self._start is not None:
            self.times.append(now - self._start)
        self._start = now


class PeakMemory(pl.Callback):
    """Peak allocated device memory of each training step, above what was allocated at its start."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self._start = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self._start = torch.cuda.memory_allocated()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        torch.cuda.synchronize()
        self.peaks.append(torch.cuda.max_memory_allocated() - self._start)


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--n-embd", type=int, default=MODEL["n_embd"], help="model width")
    args = parser.parse_args()
    MODEL["n_embd"] = args.n_embd
    if args.threads:
        torch.set_num_threads(args.threads)
    data = ByteDataset(stdlib_text(), block_size=MODEL["block_size"])
    loader = DataLoader(data, batch_size=BATCH, shuffle=False)
    cuda = args.accelerator == "gpu"
    latest: dict[str, tuple[ActivationCheckpointing | None, PeakMemory | None]] = {}
    cpu_times: dict[str, list[list[float]]] = {name: [] for name in SETTINGS}

    def factory(name: str, setting: dict[str, Any] | None):  # type: ignore[no-untyped-def]
        def build() -> tuple[pl.LightningModule, dict[str, Any]]:
            callback = ActivationCheckpointing(["Block"], **setting) if setting is not None else None
            peak = PeakMemory() if cuda else None
            cpu = StepCPUTime()
            latest[name] = (callback, peak)
            cpu_times[name].append(cpu.times)
            module = HandCheckpointed(**MODEL) if name == HAND_WRITTEN else TinyGPTModule(**MODEL)
            return module, {"callbacks": [c for c in (callback, peak, cpu) if c is not None]}

        return build

    print(f"machine: {machine()}\nmodel: TinyGPT {MODEL}, batch {BATCH}, torch threads {torch.get_num_threads()}")
    results = compare(
        {name: factory(name, setting) for name, setting in SETTINGS.items()},
        loader,
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
        accelerator=args.accelerator,
    )
    print(report(results, "a_none", "Activation checkpointing: step time"))
    base_time = results["a_none"].median
    # every callback measures the un-checkpointed step first: that is the "none" figure
    base_bytes = latest["b_full"][0].saved_bytes_before
    base_peak = statistics.median(latest["a_none"][1].peaks[1:]) if cuda else None
    cpu = {name: statistics.median(t for run in runs for t in run[args.warmup :]) for name, runs in cpu_times.items()}
    header = (
        "| configuration | checkpointed blocks | saved activations | vs none | step time vs none "
        "| CPU time / step (ms) | CPU time vs none |"
    )
    if cuda:
        header += " peak step memory | vs none |"
    print("\n### Activation checkpointing: memory\n")
    print(header)
    print("| --- " * (header.count("|") - 1) + "|")
    for name in SETTINGS:
        callback, peak = latest[name]
        saved = callback.saved_bytes_after if callback else base_bytes
        blocks = len(callback.checkpointed_modules) if callback else 0
        memory = f"{blocks}/{MODEL['n_layer']} | {format_bytes(saved)} | {saved / base_bytes - 1:+.1%}"
        if name == HAND_WRITTEN:
            memory = f"{MODEL['n_layer']}/{MODEL['n_layer']} | as b_full | "
        row = (
            f"| {name} | {memory} | {results[name].median / base_time - 1:+.1%} | "
            f"{cpu[name] * 1e3:.1f} | {cpu[name] / cpu['a_none'] - 1:+.1%} |"
        )
        if cuda:
            p = statistics.median(peak.peaks[1:])
            row += f" {format_bytes(p)} | {p / base_peak - 1:+.1%} |"
        print(row)


if __name__ == "__main__":
    main()
