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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
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


@contextmanager
def around_boundary(around: Callable[..., None]) -> Iterator[None]:
    """Run ``around(original, precision, model, *args, **kwargs)`` in place of Lightning's ``Precision._after_closure``
    (the benchmarks' ruler: every ``on_before_optimizer_step`` hook plus Lightning's own gradient clipping) while
    the context is open; ``around`` must call ``original(precision, model, *args, **kwargs)``."""
    original = Precision._after_closure

    def patched(self: Precision, *args: Any, **kwargs: Any) -> None:
        around(original, self, *args, **kwargs)

    Precision._after_closure = patched  # type: ignore[method-assign]
    try:
        yield
    finally:
        Precision._after_closure = original  # type: ignore[method-assign]


def paired_boundary_cost(
    module: pl.LightningModule,
    dataloader: DataLoader,
    callbacks: list[pl.Callback],
    steps: int,
    warmup: int,
    accelerator: str = "cpu",
    clip_val: float = 1.0,
    first: str = "ours",
) -> tuple[list[float], list[float]]:
    """Boundary times of gradkit's ``callbacks`` and of Lightning's ``gradient_clip_val``, alternating step by step
    in one Trainer run: ``(ours, lightning)`` in seconds, warm-up pairs dropped.

    The ruler is ``bench_engine_cost.py``'s, Lightning's ``Precision._after_closure``. On every other step the
    ``callbacks`` are taken out of ``trainer.callbacks`` for that boundary and ``gradient_clip_val`` is set, so
    Lightning clips instead of gradkit. Both sides then see the same model, data, allocator and machine state, and
    a drift of the machine (the several-percent run-to-run noise of a shared CPU) hits both halves of a pair alike.
    ``first`` says which side runs on the even steps (swap it to check that the order does not matter).
    """
    times: dict[str, list[float]] = {"ours": [], "lightning": []}
    sides = ("ours", "lightning") if first == "ours" else ("lightning", "ours")

    def timed(
        original: Callable[..., None], self: Precision, model: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        trainer = model.trainer
        side = sides[sum(len(t) for t in times.values()) % 2]
        saved = trainer.callbacks
        if side == "lightning":
            trainer.callbacks = [cb for cb in saved if not any(cb is ours for ours in callbacks)]
            trainer.gradient_clip_val = clip_val
        sync_device()
        t0 = time.perf_counter()
        try:
            original(self, model, *args, **kwargs)
            sync_device()
            times[side].append(time.perf_counter() - t0)
        finally:
            trainer.callbacks = saved
            trainer.gradient_clip_val = None

    with around_boundary(timed):
        quiet_trainer(accelerator, max_steps=steps, callbacks=callbacks, log_every_n_steps=50).fit(module, dataloader)
    return times["ours"][warmup:], times["lightning"][warmup:]


def paired_summary(pairs: list[tuple[list[float], list[float]]]) -> tuple[float, float, float]:
    """``(ours, lightning, ratio)``: the two medians (seconds) and the median of the per-pair ratios."""
    ours = [t for o, _ in pairs for t in o]
    lightning = [t for _, lt in pairs for t in lt]
    ratios = [a / b for o, lt in pairs for a, b in zip(o, lt, strict=False)]
    return statistics.median(ours), statistics.median(lightning), statistics.median(ratios)


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
