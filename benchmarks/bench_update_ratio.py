"""The cost of GradNormMonitor(update_ratio=True): step time side by side with the monitor without it (interleaved
runs), at a logging period of 1 (every step logs) and of 50, and the monitor's own hook time measured directly on
logging and non-logging steps.

    python benchmarks/bench_update_ratio.py [--steps 60 --repeats 3]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from harness import common_args, gpt_loader, machine, quiet_trainer, run_table, sync_device

from lightning_gradkit import GradNormMonitor
from lightning_gradkit.demos import TinyGPTModule

MODEL = dict(n_layer=8, n_head=4, n_embd=128, block_size=64)
HOOKS = ("on_before_optimizer_step", "on_train_batch_end")


def configs() -> dict:
    return {
        "a_monitor": lambda: (TinyGPTModule(**MODEL), {"callbacks": [GradNormMonitor(depth=2)]}),
        "b_monitor_update_ratio": lambda: (
            TinyGPTModule(**MODEL),
            {"callbacks": [GradNormMonitor(depth=2, update_ratio=True)]},
        ),
    }


def timed_hooks(monitor: GradNormMonitor, log: dict[str, list[float]]) -> None:
    """Wrap the monitor's hooks (on the instance) to record their wall time per step, device synchronized."""
    for name in HOOKS:
        original: Callable[..., Any] = getattr(monitor, name)

        def wrapper(*args: Any, _original: Callable[..., Any] = original, _name: str = name, **kwargs: Any) -> Any:
            sync_device()
            t0 = time.perf_counter()
            result = _original(*args, **kwargs)
            sync_device()
            log[_name].append(time.perf_counter() - t0)
            return result

        setattr(monitor, name, wrapper)


def hook_times(update_ratio: bool, steps: int, log_every: int, accelerator: str) -> tuple[list[float], list[float]]:
    """Per step, the monitor's two hooks together (seconds): ``(logging steps, non-logging steps)``.

    The step post-hook that computes the ratio runs inside ``optimizer.step()``; it is timed by wrapping
    ``gradkit.policies.update_ratio.update_ratios`` where the monitor looks it up (``gradkit.policies.monitor``'s
    namespace) and added to the logging steps' times.
    """
    import gradkit.policies.monitor as monitor_module

    log: dict[str, list[float]] = {name: [] for name in (*HOOKS, "after_step")}
    original = monitor_module.update_ratios

    def timed_ratios(*args: Any, **kwargs: Any) -> Any:
        sync_device()
        t0 = time.perf_counter()
        result = original(*args, **kwargs)
        sync_device()
        log["after_step"].append(time.perf_counter() - t0)
        return result

    monitor = GradNormMonitor(depth=2, update_ratio=update_ratio, log_every_n_steps=log_every)
    timed_hooks(monitor, log)
    monitor_module.update_ratios = timed_ratios
    try:
        trainer = quiet_trainer(accelerator, max_steps=steps, callbacks=[monitor], log_every_n_steps=log_every)
        trainer.fit(TinyGPTModule(**MODEL), gpt_loader(MODEL["block_size"]))
    finally:
        monitor_module.update_ratios = original
    per_step = [a + b for a, b in zip(log["on_before_optimizer_step"], log["on_train_batch_end"], strict=True)]
    # Logging steps: the period's (step + 1) % log_every == 0, plus the first and the last of the fit.
    logging = {0, steps - 1} | {s for s in range(steps) if (s + 1) % log_every == 0}
    after = iter(log["after_step"])
    on = [t + (next(after) if update_ratio else 0.0) for s, t in enumerate(per_step) if s in logging]
    off = [t for s, t in enumerate(per_step) if s not in logging]
    return on[1:], off[5:]  # the first step and the first non-logging steps warm up


def main() -> None:
    args = common_args(__doc__.splitlines()[0]).parse_args()
    for log_every in (1, 50):
        run_table(args, configs(), MODEL, "Step time with and without update_ratio", "a_monitor", log_every)
    print("\nThe monitor's own hooks, per step (median us; interleaved runs, period 10):")
    samples: dict[tuple[bool, str], list[float]] = {}
    for _ in range(args.repeats):
        for update_ratio in (False, True):
            on, off = hook_times(update_ratio, args.steps, 10, args.accelerator)
            samples.setdefault((update_ratio, "logging"), []).extend(on)
            samples.setdefault((update_ratio, "non-logging"), []).extend(off)
    print("| steps | monitor | monitor + update_ratio | difference |")
    print("| --- | ---: | ---: | ---: |")
    for kind in ("logging", "non-logging"):
        without = statistics.median(samples[(False, kind)]) * 1e6
        with_ratio = statistics.median(samples[(True, kind)]) * 1e6
        print(f"| {kind} | {without:.1f} | {with_ratio:.1f} | {with_ratio - without:+.1f} |")
    params = sum(p.numel() * p.element_size() for p in TinyGPTModule(**MODEL).parameters())
    print(f"\nCopy held during a logging step's optimizer step: {params / 2**20:.2f} MiB (the parameter bytes)")
    print(f"machine: {machine()}")


if __name__ == "__main__":
    main()
