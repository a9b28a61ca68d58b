"""What EarlyWarning's signals cost per optimizer step: the same loop with and without them, side by side in one run.

A TinyGPT (4 layers, width 128, 64 tokens, batch 8; ``F.scaled_dot_product_attention``) trains with AdamW behind the
loop door, logging every 10 optimizer steps. The configurations run interleaved (each one a block of steps, in turn,
``--rounds`` times) so a drift of the machine hits them alike:

- ``without``: the loop door with ``GradNormMonitor`` only (the reference);
- ``all signals``: the same plus ``EarlyWarning(output="lm_head")`` with every signal;
- one line per signal alone (the others turned off), to see where a logging step's time goes.

For each: the median wall time of the steps that do not log and of those that log, their ratios to the reference, and
the aten operations and kernel launches it adds to one step of each kind (``OpCounter``: on a GPU each launch is a few
microseconds of host time). Off logging steps the signals add no launch: the ratio there is 1 up to noise.

    python benchmarks/bench_signals.py [--rounds 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from gradkit.doors.loop import GradKit
from gradkit.policies.early_warning import EarlyWarning
from gradkit.policies.monitor import GradNormMonitor
from lightning_gradkit.demos import GPTConfig, TinyGPT
from lightning_gradkit.diagnostics.op_count import OpCounter

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
EVERY = 10
ONLY = {"attention": None, "output": None, "adam": False, "update_spread": False, "spike_score": False}
CONFIGS: dict[str, Callable[[], list[Any]]] = {
    "without": lambda: [GradNormMonitor()],
    "all signals": lambda: [GradNormMonitor(), EarlyWarning(output="lm_head")],
    "attention logits only": lambda: [GradNormMonitor(), EarlyWarning(**{**ONLY, "attention": "auto"})],
    "log Z only": lambda: [GradNormMonitor(), EarlyWarning(**{**ONLY, "output": "lm_head"})],
    "Adam g^2/v only": lambda: [GradNormMonitor(), EarlyWarning(**{**ONLY, "adam": True})],
    "update spread only": lambda: [GradNormMonitor(), EarlyWarning(**{**ONLY, "update_spread": True})],
    "SpikeScore only": lambda: [GradNormMonitor(), EarlyWarning(**{**ONLY, "spike_score": True})],
}


class Loop:
    """One configuration's model, optimizer and door, kept across the rounds."""

    def __init__(self, policies: list[Any]) -> None:
        torch.manual_seed(0)
        self.model = TinyGPT(CONFIG)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.kit = GradKit(self.model, self.optimizer, policies, log_every_n_steps=EVERY, log_dir=False)
        self.data = torch.randint(256, (8, CONFIG.block_size), generator=torch.Generator().manual_seed(0))
        self.times: dict[bool, list[float]] = {False: [], True: []}

    def step(self, counter: OpCounter | None = None) -> bool:
        logging = self.kit.ctx.is_logging_step()
        start = time.perf_counter()
        with counter if counter is not None else nullcontext():
            loss = F.cross_entropy(self.model(self.data).flatten(0, 1), self.data.flatten())
            loss.backward()
            self.kit.note_loss(loss)
            self.kit.step(self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)
        self.times[logging].append(time.perf_counter() - start)
        return logging


def counted(loop: Loop) -> dict[bool, OpCounter]:
    """The operations of the next step that does not log and of the next one that does."""
    found: dict[bool, OpCounter] = {}
    while len(found) < 2:
        counter = OpCounter()
        logging = loop.step(counter)
        found.setdefault(logging, counter)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="steps per configuration per round (a multiple of 10)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    loops = {name: Loop(make()) for name, make in CONFIGS.items()}
    for loop in loops.values():  # warm-up: indexes built, Adam's state, one logging step
        for _ in range(EVERY + 2):
            loop.step()
        loop.times = {False: [], True: []}
    for _ in range(args.rounds):
        for loop in loops.values():
            for _ in range(args.steps):
                loop.step()
    counts = {name: counted(loop) for name, loop in loops.items()}
    base = loops["without"]
    plain, logs = statistics.median(base.times[False]), statistics.median(base.times[True])
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread; TinyGPT ")
    print(f"{CONFIG.n_layer} layers x {CONFIG.n_embd}, batch 8 x {CONFIG.block_size}, logging every {EVERY} steps")
    print(
        "\n| configuration | step without logging (ms) | ratio | logging step (ms) | ratio "
        "| ops / launches added, step without logging | ops / launches added, logging step |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, loop in loops.items():
        quiet, logging = statistics.median(loop.times[False]), statistics.median(loop.times[True])
        added = [
            f"{counts[name][k].total - counts['without'][k].total} / "
            f"{counts[name][k].launches - counts['without'][k].launches}"
            for k in (False, True)
        ]
        print(
            f"| {name} | {quiet * 1e3:.1f} | {quiet / plain:.3f} | {logging * 1e3:.1f} | {logging / logs:.3f} "
            f"| {added[0]} | {added[1]} |"
        )
    steps = len(base.times[False]) + len(base.times[True])
    print(f"\n{steps} measured steps per configuration ({len(base.times[True])} logging), medians.")


if __name__ == "__main__":
    main()
