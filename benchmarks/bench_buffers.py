"""What it costs that a skipped step puts back the module buffers (issue 21, item 1; issue 30, items 1-6).

Every GradKit strategy that may skip a step copies, at each accumulation window's start, every module buffer (one
multi-tensor copy per dtype: BatchNorm's running statistics, position ids, masks), and puts them back if the step
is skipped. Side by side, in one
run, interleaved: the "gradkit" strategy with ``NonFiniteGuard(action="skip")`` with that protection (``on``) and
with it switched off (``off``), on

- a ResNet-18-shaped CNN (20 BatchNorm layers, 60 buffers) on 32x32 images, batch 32, with SGD and with
  ``Adam(fused=True)`` (whose skip flag stays on device, so the restore is an exact select on integer views of
  the buffers, three multi-tensor operations per element size, on every step);
- TinyGPT (no BatchNorm): the protection must cost nothing there.

Besides the step times (noisy on a shared CPU), the time spent inside the protection itself (the capture at the
window start and the close at the step) is measured directly, per step.

    python benchmarks/bench_buffers.py [--steps 60 --warmup 10 --repeats 3]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from harness import common_args, compare, gpt_loader, machine, report

from architectures import ArchModule, ResNet18Like
from gradkit.step.snapshot import Snapshot
from lightning_gradkit import GradKitSingleDeviceStrategy, NonFiniteGuard
from lightning_gradkit.demos import TinyGPTModule

GPT = dict(n_layer=4, n_head=4, n_embd=128, block_size=64)


class NoBufferProtection(GradKitSingleDeviceStrategy):
    """The "gradkit" strategy with the buffer protection switched off (the ``off`` column)."""

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self._gradkit_buffers = None


class _Clock:
    """Seconds spent in the Snapshot methods the strategy calls, summed over a run."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.originals: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> _Clock:
        for name in ("capture", "drop", "restore"):
            original = getattr(Snapshot, name)
            self.originals[name] = original
            setattr(Snapshot, name, self._timed(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self.originals.items():
            setattr(Snapshot, name, original)

    def _timed(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def image_loader(n: int = 4096, batch_size: int = 32) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    return DataLoader(data, batch_size=batch_size, shuffle=False)


def configs(make: Callable[[], pl.LightningModule]) -> dict[str, Callable[[], tuple[pl.LightningModule, dict]]]:
    def guard() -> list[pl.Callback]:
        return [NonFiniteGuard(action="skip", forensics=False)]

    return {
        "off": lambda: (make(), {"callbacks": guard(), "strategy": NoBufferProtection()}),
        "on": lambda: (make(), {"callbacks": guard(), "strategy": "gradkit"}),
    }


def direct_cost(make: Callable[[], pl.LightningModule], loader: DataLoader, steps: int) -> tuple[float, int, int]:
    """Microseconds per step inside the protection, and the buffers it copies per window (count, bytes)."""
    from harness import quiet_trainer

    module = make()
    trainer = quiet_trainer(max_steps=steps, strategy="gradkit", callbacks=[NonFiniteGuard(action="skip")])
    with _Clock() as clock:
        trainer.fit(module, loader)
    buffers = list(module.buffers())
    return 1e6 * clock.seconds / steps, len(buffers), sum(b.numel() * b.element_size() for b in buffers)


def main() -> None:
    args = common_args(__doc__.splitlines()[0]).parse_args()
    print(f"machine: {machine()}")
    cases = {
        "ResNet-18-shaped CNN (width 16), 32x32, batch 32": (
            lambda: ArchModule(ResNet18Like(width=16)),
            image_loader(),
        ),
        "the same CNN with Adam(fused=True) (restore by torch.where on every step)": (
            lambda: ArchModule(ResNet18Like(width=16), lr=1e-3, optimizer="adam_fused"),
            image_loader(),
        ),
        f"TinyGPT {GPT}, batch 16 (no BatchNorm)": (lambda: TinyGPTModule(**GPT), gpt_loader(GPT["block_size"])),
    }
    for title, (make, loader) in cases.items():
        results = compare(configs(make), loader, steps=args.steps, warmup=args.warmup, repeats=args.repeats)
        print(report(results, "off", title))
        micros, count, nbytes = direct_cost(make, loader, args.steps)
        step = results["off"].median * 1e6
        print(
            f"inside the protection: {micros:.1f} us per step = {100 * micros / step:.3f}% of the step; "
            f"buffers copied per window: {count} ({nbytes:,} bytes)\n"
        )


if __name__ == "__main__":
    main()
