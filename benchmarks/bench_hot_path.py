"""What gradkit adds to one optimizer step, counted and timed on the CPU: what predicts its cost on a GPU.

On a GPU a small model's step is host-bound: every aten operation gradkit dispatches is a kernel launch on the step,
and so is every value a logging step sends through ``self.log`` (one ``.item()`` each at the flush). Both are
deterministic, or nearly, on the CPU, so this script measures them side by side with the alternative in one run:

1. **Operations per optimizer step** behind the plain-PyTorch door (``GradKit``), against the same loop without
   gradkit (its own ops subtracted): all aten operations, the kernel launches among them (all but views) and the
   bytes allocated, for monitor + ``ClipGradNorm`` and the full stack (monitor, ``ZClip``, ``NonFiniteGuard``,
   ``SpikeGuard``), SGD / foreach AdamW / fused AdamW, at 10, 148, 1,000 and 10,000 trainable tensors.
2. **A logging step**: a Trainer fit of TinyGPT (12 layers, 16 wide) with Lightning's ``gradient_clip_val`` and with
   gradkit's monitor + ``ClipGradNorm``, each step timed alone, configurations interleaved; the logging steps'
   median against the other steps' median, for each.

    python benchmarks/bench_hot_path.py [--sizes 10 148 1000 10000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
from harness import machine

from gradkit.doors.loop import GradKit
from lightning_gradkit import ClipGradNorm, GradNormMonitor, NonFiniteGuard, SpikeGuard, ZClip
from lightning_gradkit.demos import TinyGPTModule
from lightning_gradkit.diagnostics.op_count import OpCounter

STACKS: dict[str, Callable[[], list[Any]]] = {
    "monitor+clip": lambda: [GradNormMonitor(log_every_n_steps=50), ClipGradNorm(1.0)],
    # Short warm-ups: the counted step is past them. A high spike threshold: the step counted is an ordinary one.
    "full stack": lambda: [
        GradNormMonitor(log_every_n_steps=50),
        ZClip(warmup_steps=2),
        NonFiniteGuard("skip"),
        SpikeGuard("loss", action="skip", warmup_steps=2, z_threshold=1e3),
    ],
}
OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    "adamw foreach": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True),
    "adamw fused": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True),
}
STEPS = 6


class Many(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(16) * 0.1) for _ in range(n)])

    def forward(self, x: Tensor) -> Tensor:
        return (torch.stack(list(self.ps)) * x).square().mean()


def step_cost(n: int, optimizer: str, stack: str | None) -> OpCounter:
    """The operations of the last of ``STEPS`` loop steps, with gradkit's ``stack`` or bare (``None``)."""
    torch.manual_seed(0)
    model = Many(n)
    opt = OPTIMIZERS[optimizer](model)
    kit = GradKit(model, opt, STACKS[stack](), log_every_n_steps=50) if stack else None
    x = torch.randn(16)
    counter = OpCounter()
    for step in range(STEPS):
        counter = OpCounter()
        with counter if step == STEPS - 1 else contextlib.nullcontext():
            opt.zero_grad(set_to_none=True)
            loss = model(x)
            loss.backward()
            if kit is None:
                opt.step()
            else:
                kit.note_loss(loss)
                kit.step(opt)
    return counter


def count_table(sizes: list[int]) -> None:
    print("\n1. aten operations gradkit adds to one optimizer step (plain-PyTorch door; ops / kernel launches / bytes)")
    header = "".join(f"{n:>20,}" for n in sizes)
    print(f"{'stack':14s}{'optimizer':16s}{header}   grad bytes at the largest n")
    for stack in STACKS:
        for optimizer in OPTIMIZERS:
            cells = []
            for n in sizes:
                bare, ours = step_cost(n, optimizer, None), step_cost(n, optimizer, stack)
                ops, launches = ours.total - bare.total, ours.launches - bare.launches
                cells.append(f"{ops} / {launches} / {ours.bytes - bare.bytes} B")
            grad_bytes = sizes[-1] * 16 * 4
            print(f"{stack:14s}{optimizer:16s}" + "".join(f"{c:>20s}" for c in cells) + f"   {grad_bytes:,} B")


class StepClock(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.times.append(time.perf_counter() - self.t0)


def logging_step(repeats: int, steps: int = 100, every: int = 10) -> None:
    print(f"\n2. a logging step (Trainer, TinyGPT 12 x 16, log_every_n_steps={every}, {steps} steps, {repeats} runs)")
    x = torch.randint(0, 256, (2 * steps, 9))
    data = TensorDataset(x[:, :-1], x[:, 1:])
    configs: dict[str, tuple[Callable[[], list[Any]], float | None]] = {
        "Lightning gradient_clip_val": (lambda: [], 1.0),
        "gradkit monitor+clip": (lambda: [GradNormMonitor(), ClipGradNorm(1.0)], None),
    }
    times: dict[str, list[list[float]]] = {name: [] for name in configs}
    for _ in range(repeats):
        for name, (callbacks, clip) in configs.items():
            torch.manual_seed(0)
            clock = StepClock()
            trainer = pl.Trainer(
                accelerator="cpu",
                max_steps=steps,
                callbacks=[clock, *callbacks()],
                logger=CSVLogger(tempfile.mkdtemp()),
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                log_every_n_steps=every,
                gradient_clip_val=clip,
            )
            trainer.fit(TinyGPTModule(n_layer=12, n_head=1, n_embd=16, block_size=8), DataLoader(data, batch_size=2))
            times[name].append(clock.times)
    print(f"{'configuration':30s}{'other steps':>14s}{'logging steps':>16s}{'extra':>10s}")
    for name, runs in times.items():
        logging = [t for run in runs for i, t in enumerate(run) if (i + 1) % every == 0 and i >= every]
        other = [t for run in runs for i, t in enumerate(run) if (i + 1) % every != 0 and i >= every]
        lo, ot = statistics.median(logging) * 1e3, statistics.median(other) * 1e3
        print(f"{name:30s}{ot:11.2f} ms{lo:13.2f} ms{lo - ot:+8.2f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 148, 1000, 10_000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    print(machine())
    count_table(args.sizes)
    logging_step(args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
