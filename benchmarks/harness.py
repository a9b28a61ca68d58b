"""Side-by-side step-time measurement of Lightning Trainer configurations.

Every configuration trains the same model on the same data with a fresh Trainer. Runs are interleaved
(A, B, C, A, B, C, ...) so slow drifts of the machine hit every configuration alike, and the step time is the
median over all measured steps (warm-up steps dropped). A step is the wall time between consecutive
``on_train_batch_start`` calls, so it includes everything Lightning does per batch (logging flushes too).
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

# A configuration builds (module, extra Trainer kwargs) afresh for every run.
ConfigFactory = Callable[[], tuple[pl.LightningModule, dict[str, Any]]]


def sync_device() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepTimer(pl.Callback):
    """Records the wall time between consecutive training batches."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        sync_device()
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sync_device()
        self.starts.append(time.perf_counter())

    @property
    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]


@dataclass
class Result:
    name: str
    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def quiet_trainer(accelerator: str = "cpu", **overrides: Any) -> pl.Trainer:
    """A one-device Trainer that logs, checkpoints, prints and validates nothing unless ``overrides`` say so."""
    kwargs: dict[str, Any] = dict(
        accelerator=accelerator,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    return pl.Trainer(**{**kwargs, **overrides})


def run_once(
    factory: ConfigFactory, dataloader: DataLoader, steps: int, accelerator: str, trainer_kwargs: dict[str, Any]
) -> list[float]:
    module, extra = factory()
    timer = StepTimer()
    callbacks = [*extra.pop("callbacks", []), timer]
    trainer = quiet_trainer(accelerator, max_steps=steps, callbacks=callbacks, **{**trainer_kwargs, **extra})
    trainer.fit(module, dataloader)
    return timer.step_times


def compare(
    configs: dict[str, ConfigFactory],
    dataloader: DataLoader,
    steps: int = 60,
    warmup: int = 10,
    repeats: int = 3,
    accelerator: str = "cpu",
    trainer_kwargs: dict[str, Any] | None = None,
) -> dict[str, Result]:
    """Run every configuration ``repeats`` times, interleaved; return the measured step times."""
    results = {name: Result(name) for name in configs}
    for _ in range(repeats):
        for name, factory in configs.items():
            times = run_once(factory, dataloader, steps, accelerator, dict(trainer_kwargs or {}))
            results[name].times.extend(times[warmup:])
    return results


def report(results: dict[str, Result], baseline: str, title: str) -> str:
    """A Markdown table: median step time and ratio to ``baseline`` for each configuration."""
    base = results[baseline].median
    lines = [
        f"### {title}",
        "",
        "| configuration | median step (ms) | ratio vs " + baseline + " |",
        "| --- | ---: | ---: |",
    ]
    for r in results.values():
        lines.append(f"| {r.name} | {r.median * 1e3:.2f} | {r.median / base:.4f} |")
    return "\n".join(lines)


def gpt_loader(block_size: int, batch_size: int = 16) -> DataLoader:
    """Next-byte batches of the standard library's source (the data every benchmark trains on)."""
    from lightning_gradkit.demos import ByteDataset, stdlib_text

    return DataLoader(ByteDataset(stdlib_text(), block_size=block_size), batch_size=batch_size, shuffle=False)


def run_table(
    args: argparse.Namespace,
    configs: dict[str, ConfigFactory],
    model: dict[str, Any],
    title: str,
    baseline: str,
    log_every_n_steps: int,
) -> dict[str, Result]:
    """The common body of a benchmark: train every configuration on :func:`gpt_loader` batches, print the table
    and each configuration's overhead against ``baseline``."""
    print(f"machine: {machine()}\nmodel: TinyGPT {model}, batch 16")
    results = compare(
        configs,
        gpt_loader(model["block_size"]),
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
        accelerator=args.accelerator,
        trainer_kwargs={"log_every_n_steps": log_every_n_steps},
    )
    print(report(results, baseline, f"{title}, log_every_n_steps={log_every_n_steps}"))
    base = results[baseline].median
    for name in results:
        if name != baseline:
            print(f"overhead {name}: {100 * (results[name].median / base - 1):+.2f}% of step time")
    return results


def machine() -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({torch.get_num_threads()} threads)"
    return f"{platform.machine()} {device}, torch {torch.__version__}, lightning {pl.__version__}"


def common_args(description: str) -> argparse.ArgumentParser:
    """The command-line flags every benchmark shares; also silences Lightning's per-fit INFO lines."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="steps dropped from each run")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per configuration")
    parser.add_argument("--accelerator", default="gpu" if torch.cuda.is_available() else "cpu")
    return parser
