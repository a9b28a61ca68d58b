"""Host-device syncs per optimizer step of the full gradkit stack on CUDA, behind the loop door and the Trainer.

The full stack (``GradNormMonitor(log_every_n_steps=50)``, ``ZClip()``, ``NonFiniteGuard("skip")``,
``SpikeGuard("loss", action="skip")``) on the project's GPT (4 x 256, batch 8 x 128, bf16 autocast / bf16-mixed),
for ``--steps`` steps, two ways: a plain loop through :class:`gradkit.GradKit`, and a Trainer fit
with the ``"gradkit"`` strategy. The watched steps are every step after the first that is not a logging step
(the first step and the last one log too); around each (forward, backward, the gradkit step, the optimizer step),
PyTorch's detector is switched on:

- ``torch.cuda.set_sync_debug_mode("warn")`` and the warnings caught: the number of syncs of every watched step;
- ``torch.cuda.set_sync_debug_mode("error")`` for the fused optimizers: any sync raises, the run must finish.

Expected (DESIGN.md, "no host sync off logging steps"): 0 with ``AdamW(fused=True)``, whose ``found_inf`` takes
the skip flag on device; exactly 1 per step with a foreach ``AdamW``, the one read of the skip flag. A bare Trainer
fit with the fused AdamW is counted too, as the control: syncs Lightning's own step makes.

    python benchmarks/bench_gpu_syncs.py [--steps 12] [--json PATH]      # needs CUDA; skips without it
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_gradkit as gk
from gradkit.doors.loop import GradKit
from lightning_gradkit.demos import GPTConfig, TinyGPT, TinyGPTModule

SIZE = {"layers": 4, "embd": 256, "batch": 8, "block": 128}
LOG_EVERY = 50
_SYNC_MESSAGE = "called a synchronizing CUDA operation"


def full_stack() -> list[Any]:
    return [
        gk.GradNormMonitor(log_every_n_steps=LOG_EVERY),
        gk.ZClip(),
        gk.NonFiniteGuard(action="skip"),
        gk.SpikeGuard("loss", action="skip"),
    ]


def watched(step: int, steps: int) -> bool:
    """Steps off the logging ones: not the first (the monitor logs it), not a period's, not the last."""
    return 0 < step < steps - 1 and (step + 1) % LOG_EVERY != 0


class SyncCounter:
    """Counts the syncs PyTorch's detector reports while :meth:`watch` is open (``mode`` "warn" or "error")."""

    def __init__(self, mode: str, cuda: bool) -> None:
        self.mode, self.cuda = mode, cuda
        self.per_step: list[int] = []

    @contextmanager
    def watch(self) -> Iterator[None]:
        if not self.cuda:  # --cpu-dry-run: the code paths only
            yield
            self.per_step.append(0)
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(self.mode)
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        self.per_step.append(sum(_SYNC_MESSAGE in str(w.message) for w in caught))


def tokens(steps: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (steps * SIZE["batch"], SIZE["block"] + 1), generator=g)
    return x[:, :-1].to(device), x[:, 1:].to(device)


def run_door(fused: bool, mode: str, steps: int, device: str) -> SyncCounter:
    """A plain loop: the batches are on the device before the loop, so only the step itself is watched."""
    torch.manual_seed(0)
    cuda = device == "cuda"
    model = TinyGPT(GPTConfig(256, SIZE["block"], SIZE["layers"], SIZE["embd"] // 64, SIZE["embd"])).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=fused or None, foreach=None if fused else True)
    logged: list[dict[str, float]] = []
    kit = GradKit(
        model,
        optimizer,
        full_stack(),
        log=lambda metrics, step: logged.append(metrics),
        log_every_n_steps=LOG_EVERY,
        max_steps=steps,
    )
    x, y = tokens(steps, device)
    counter = SyncCounter(mode, cuda)
    b = SIZE["batch"]

    def one_step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            logits = model(xb)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), yb.reshape(-1))
        loss.backward()
        kit.note_loss(loss)
        kit.step(optimizer)
        optimizer.zero_grad(set_to_none=True)

    for step in range(steps):
        batch = x[step * b : (step + 1) * b], y[step * b : (step + 1) * b]
        if watched(step, steps):
            with counter.watch():
                one_step(*batch)
        else:
            one_step(*batch)
    kit.finish()
    if not logged:
        raise RuntimeError("the loop door logged nothing: the run did not go through the monitor's logging steps")
    return counter


class _TrainerWatch(pl.Callback):
    """Opens the counter at ``on_train_batch_start`` of every watched step (after the batch moved to the device)
    and closes it at ``on_train_batch_end``."""

    def __init__(self, counter: SyncCounter, steps: int) -> None:
        self.counter, self.steps = counter, steps
        self._open: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if watched(trainer.global_step, self.steps):
            self._open = self.counter.watch()
            self._open.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, out: Any, b: Any, i: int) -> None:
        self._close(None)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close(exception)

    def _close(self, exception: BaseException | None) -> None:
        if self._open is not None:
            cm, self._open = self._open, None
            cm.__exit__(type(exception) if exception else None, exception, None)


def run_trainer(fused: bool, mode: str, steps: int, device: str, gradkit: bool = True) -> SyncCounter:
    torch.manual_seed(0)
    cuda = device == "cuda"
    counter = SyncCounter(mode, cuda)
    module = TinyGPTModule(
        n_layer=SIZE["layers"], n_head=SIZE["embd"] // 64, n_embd=SIZE["embd"], block_size=SIZE["block"], fused=fused
    )
    x, y = tokens(steps, "cpu")
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        strategy="gradkit" if gradkit else "auto",
        precision="bf16-mixed" if cuda else "32-true",
        max_steps=steps,
        callbacks=[_TrainerWatch(counter, steps), *(full_stack() if gradkit else [])],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=LOG_EVERY,
    )
    try:
        trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=SIZE["batch"]))
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    return counter


def check(name: str, run: Callable[[], SyncCounter], expected: int | None, cuda: bool) -> dict[str, Any]:
    """Run one case; ``expected`` syncs per watched step (``None``: reported only)."""
    try:
        counts: list[int] | None = run().per_step
        error = None
    except RuntimeError as e:  # "error" mode: the first sync raises
        counts, error = None, str(e).splitlines()[0]
    if counts is None:
        ok = False
        shown = f"raised: {error}"
    else:
        ok = bool(counts) and all(c == expected for c in counts) if expected is not None else True
        shown = f"{sum(counts)} syncs in {len(counts)} watched steps, per step {counts}" if cuda else "not counted"
    if not cuda:
        verdict = "dry run (no CUDA: nothing counted)"
    elif expected is None:
        verdict = "info"
    else:
        verdict = "PASS" if ok else "FAIL"
    print(f"  {name:44s} expected {'-' if expected is None else expected}/step: {shown} {verdict}")
    return {"name": name, "expected_per_step": expected, "per_step": counts, "error": error, "pass": ok}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run (the first and last log)")
    parser.add_argument("--json", type=Path, default=None, help="also write the counts to this JSON file")
    parser.add_argument(
        "--cpu-dry-run", action="store_true", help="without CUDA: run the code paths on CPU, counting nothing"
    )
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_dry_run:
        print("bench_gpu_syncs: skipped: no CUDA device (torch.cuda.set_sync_debug_mode needs one)")
        return 0
    if args.steps < 3:
        parser.error(f"--steps must be >= 3 (the first and the last step log), got {args.steps}")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*(LeafSpec|smaller than the logging interval|fewer than the logging)")
    warnings.filterwarnings("ignore", message=".*no `val_dataloader`")
    device = "cuda" if cuda else "cpu"
    n = args.steps
    name = torch.cuda.get_device_name() if cuda else "CPU (dry run)"
    print(f"device {name}; torch {torch.__version__}; lightning {pl.__version__}")
    model = f"GPT {SIZE['layers']} x {SIZE['embd']}, batch {SIZE['batch']} x {SIZE['block']}"
    print(f"{model}, bf16; {n} steps, the full stack; watched: steps 1..{n - 2} off the logging steps")
    cases = [
        ("door, fused AdamW, mode warn", lambda: run_door(True, "warn", n, device), 0),
        ("door, fused AdamW, mode error", lambda: run_door(True, "error", n, device), 0),
        ("door, foreach AdamW, mode warn", lambda: run_door(False, "warn", n, device), 1),
        ("Trainer, bare (control), fused AdamW, mode warn", lambda: run_trainer(True, "warn", n, device, False), None),
        ("Trainer, fused AdamW, mode warn", lambda: run_trainer(True, "warn", n, device), 0),
        ("Trainer, fused AdamW, mode error", lambda: run_trainer(True, "error", n, device), 0),
        ("Trainer, foreach AdamW, mode warn", lambda: run_trainer(False, "warn", n, device), 1),
    ]
    results = [check(label, run, expected, cuda) for label, run, expected in cases]
    failed = cuda and not all(r["pass"] for r in results)
    if cuda:
        print(f"sync count: {'FAIL' if failed else 'PASS'}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "benchmark": "bench_gpu_syncs",
            "device": name,
            "torch": torch.__version__,
            "lightning": pl.__version__,
            "steps": n,
            "counted": cuda,
            "results": results,
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
