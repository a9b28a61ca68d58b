"""SyncAudit and GraphLeakGuard overhead: on the steps they do not audit (the target: within 1% of step time on
CPU) and on the steps they do, side by side with no callback, on the same GPT-style model, in one run.

    python benchmarks/bench_diagnostics.py [--steps 60 --repeats 3]

Step times are wall time and process CPU time; with one intra-op thread (the default here) the CPU time of a step
measures its work, little disturbed by other processes competing for the machine's cores.
Unaudited steps are measured twice: as the step-time ratio of interleaved Trainer runs with and without both
callbacks (bounded by the machine's noise), and exactly, by timing the callbacks' per-step hooks on an unaudited
step called directly on a real Trainer. Audited steps are measured inside one run that audits every other step,
so audited and unaudited steps alternate and share the machine's conditions.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
from harness import common_args, machine, quiet_trainer, run_once

from lightning_gradkit import GraphLeakGuard, SyncAudit
from lightning_gradkit.demos import ByteDataset, TinyGPTModule, stdlib_text

MODEL = dict(n_layer=4, n_head=4, n_embd=64, block_size=64)
NEVER = 10**9


class SyncingGPT(TinyGPTModule):
    """Two host syncs per step in user code (what an audit finds)."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.last = loss.item()
        if bool(torch.isnan(loss)):
            raise RuntimeError("nan")
        return loss


class LeakingGPT(SyncingGPT):
    """Also keeps every step's loss with its graph (what a leak check walks: one more graph per step)."""

    def __init__(self, **kwargs: int) -> None:
        super().__init__(**kwargs)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss)
        return loss


class CpuStepTimer(pl.Callback):
    """Process CPU time between consecutive training batches: less sensitive than wall time to other processes
    competing for the machine's cores."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.starts.append(time.process_time())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.starts.append(time.process_time())

    @property
    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]


CONFIGS: dict[str, tuple[type[SyncingGPT], Callable[[], list[pl.Callback]]]] = {
    "a_none": (SyncingGPT, list),
    "b_both_unaudited": (
        SyncingGPT,
        lambda: [SyncAudit(every_n_steps=NEVER), GraphLeakGuard(check_every_n_steps=NEVER)],
    ),
    "c_SyncAudit_every_2nd": (SyncingGPT, lambda: [SyncAudit(every_n_steps=2)]),
    "d_GraphLeakGuard_every_2nd": (SyncingGPT, lambda: [GraphLeakGuard(check_every_n_steps=2)]),
    "e_GraphLeakGuard_every_2nd_leaking": (LeakingGPT, lambda: [GraphLeakGuard(check_every_n_steps=2)]),
    "z_none_again": (SyncingGPT, list),  # the same as a_none: the spread between the two is the noise floor
}


def hook_cost(loader: DataLoader, root: str, calls: int = 50000) -> dict[str, float]:
    """Seconds per unaudited step spent in each callback's two per-step hooks, called directly on a real Trainer."""
    audit, guard = SyncAudit(every_n_steps=NEVER), GraphLeakGuard(check_every_n_steps=NEVER)
    module = SyncingGPT(**MODEL)
    trainer = quiet_trainer(max_steps=2, default_root_dir=root, callbacks=[audit, guard])
    trainer.fit(module, loader)
    out = {}
    for name, cb in (("SyncAudit", audit), ("GraphLeakGuard", guard)):
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                cb.on_train_batch_start(trainer, module, None, 0)
                cb.on_train_batch_end(trainer, module, None, None, 0)
            samples.append((time.perf_counter() - t0) / calls)
        out[name] = min(samples)
    return out


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier CPU times)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = ByteDataset(stdlib_text(), block_size=MODEL["block_size"])
    loader = DataLoader(data, batch_size=16, shuffle=False)
    print(f"machine: {machine()}\nmodel: TinyGPT {MODEL}, batch 16, {args.steps} steps x {args.repeats} runs each")
    wall: dict[str, list[list[float]]] = {name: [] for name in CONFIGS}
    cpu: dict[str, list[list[float]]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as root:
        names = list(CONFIGS)
        for r in range(args.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # rotated: no configuration always first
                module_type, callbacks = CONFIGS[name]
                timer = CpuStepTimer()

                def factory(
                    module_type: type[SyncingGPT] = module_type,
                    callbacks: Callable[[], list[pl.Callback]] = callbacks,
                    timer: CpuStepTimer = timer,
                ) -> tuple[pl.LightningModule, dict[str, Any]]:
                    return module_type(**MODEL), {"callbacks": [*callbacks(), timer]}

                wall[name].append(run_once(factory, loader, args.steps, args.accelerator, {"default_root_dir": root}))
                cpu[name].append(timer.step_times)
        hooks = hook_cost(loader, root)

    def median(runs: dict[str, list[list[float]]], name: str, parity: int | None = None) -> float:
        # Step i is the time from batch i's start to batch i+1's start; batch i is audited when (i + 1) % 2 == 0.
        picked = [
            t
            for times in runs[name]
            for i, t in enumerate(times)
            if i >= args.warmup and (parity is None or i % 2 == parity)
        ]
        return statistics.median(picked)

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.2f}"

    def pct(a: float, b: float) -> str:
        return f"{100 * (a / b - 1):+.2f}%"

    base_w, base_c = median(wall, "a_none"), median(cpu, "a_none")
    both_w, both_c = median(wall, "b_both_unaudited"), median(cpu, "b_both_unaudited")
    print("\n| configuration | steps | wall (ms) | CPU (ms) | wall vs ref | CPU vs ref |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    print(f"| a_none | all | {ms(base_w)} | {ms(base_c)} | | |")
    print(f"| b_both_unaudited | all | {ms(both_w)} | {ms(both_c)} | {pct(both_w, base_w)} | {pct(both_c, base_c)} |")
    again_w, again_c = median(wall, "z_none_again"), median(cpu, "z_none_again")
    print(f"| z_none_again | all | {ms(again_w)} | {ms(again_c)} | {pct(again_w, base_w)} | {pct(again_c, base_c)} |")
    for name in ("c_SyncAudit_every_2nd", "d_GraphLeakGuard_every_2nd", "e_GraphLeakGuard_every_2nd_leaking"):
        plain_w, plain_c = median(wall, name, 0), median(cpu, name, 0)
        audit_w, audit_c = median(wall, name, 1), median(cpu, name, 1)
        print(f"| {name} | unaudited | {ms(plain_w)} | {ms(plain_c)} | | |")
        print(
            f"| {name} | audited | {ms(audit_w)} | {ms(audit_c)} | {pct(audit_w, plain_w)} | {pct(audit_c, plain_c)} |"
        )
    print("\nPer-step hooks on an unaudited step, called directly on a real Trainer:")
    for name, seconds in hooks.items():
        print(
            f"  {name}: {seconds * 1e6:.2f} us per step = {100 * seconds / base_c:.4f}% of the a_none step "
            f"({ms(base_c)} ms CPU)"
        )


if __name__ == "__main__":
    main()
