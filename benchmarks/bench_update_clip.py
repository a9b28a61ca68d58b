"""What UpdateClip costs per optimizer step: step time against a bare step (zero_grad, forward, backward,
``optimizer.step``) on a small GPT, behind the loop door, interleaved step by step, and the memory it keeps.

Four setups train the same TinyGPT on the same batches, one step each in turn (so a drift of the machine hits all of
them alike): the bare loop, the loop door with no policy (the pipeline's own read of the gradient norms), and the door
with ``UpdateClip()`` (one norm) and ``UpdateClip(modules="auto")`` (one per block and per other module). Printed per
optimizer: the median step time of each and its ratio to the bare step (on a shared CPU, a few percent of noise), the
time of UpdateClip's own work measured directly (its copy before the step and its rescale after it, the less noisy
figure) and its share of the bare step, the operations and kernel launches it adds to a step (counted with
``OpCounter``, against the door with no policy) and the bytes of its copy of the parameters.

    python benchmarks/bench_update_clip.py                       # CPU, 1 thread: benchmarks/RESULTS.md
    python benchmarks/bench_update_clip.py --device cuda --steps 200
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradkit import GradKit, UpdateClip
from lightning_gradkit.demos import GPTConfig, TinyGPT
from lightning_gradkit.diagnostics.op_count import OpCounter

SETUPS: dict[str, Callable[[], list[Any] | None]] = {
    "bare step": lambda: None,
    "door, no policy": lambda: [],
    "UpdateClip()": lambda: [UpdateClip()],
    'UpdateClip(modules="auto")': lambda: [UpdateClip(modules="auto")],
}
OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "AdamW (foreach)": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True),
    "AdamW (fused)": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True),
    "SGD (momentum)": lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9),
}


@dataclass
class Setup:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    kit: GradKit | None
    times: list[float] = field(default_factory=list)
    own: list[float] = field(default_factory=list)  # UpdateClip's copy and rescale, timed directly


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def build(config: GPTConfig, optimizer: str, policies: list[Any] | None, device: torch.device) -> Setup:
    torch.manual_seed(0)
    model = TinyGPT(config).to(device)
    opt = OPTIMIZERS[optimizer](model)
    kit = None if policies is None else GradKit(model, opt, policies, log_every_n_steps=0, log_dir=False)
    setup = Setup(model, opt, kit)
    for policy in policies or []:
        for method in ("_arm", "_after_optimizer_step"):  # its work before the step and after it
            setattr(policy, method, timed(getattr(policy, method), setup.own, device))
    return setup


def timed(method: Callable[..., None], into: list[float], device: torch.device) -> Callable[..., None]:
    def run(*args: Any) -> None:
        sync(device)
        t0 = time.perf_counter()
        method(*args)
        sync(device)
        into.append(time.perf_counter() - t0)

    return run


def step(setup: Setup, x: Tensor, y: Tensor) -> None:
    setup.optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(setup.model(x).flatten(0, 1), y.flatten())
    loss.backward()
    if setup.kit is None:
        setup.optimizer.step()
    else:
        setup.kit.step(setup.optimizer)


def added_ops(config: GPTConfig, optimizer: str, policies: list[Any], device: torch.device) -> tuple[int, int]:
    """The operations and launches ``policies`` add to one step past their warm-up, against the door with none."""
    x = torch.randint(256, (2, config.block_size), device=device)
    counts = []
    for chosen in ([], policies):
        setup = build(config, optimizer, chosen, device)
        for _ in range(3):
            step(setup, x, x)
        with OpCounter() as counter:
            step(setup, x, x)
        counts.append((counter.total, counter.launches))
    return counts[1][0] - counts[0][0], counts[1][1] - counts[0][1]


def run(args: argparse.Namespace, optimizer: str, device: torch.device) -> None:
    config = GPTConfig(256, args.block_size, args.layers, args.heads, args.embd, 0.0)
    setups = {name: build(config, optimizer, make(), device) for name, make in SETUPS.items()}
    g = torch.Generator().manual_seed(0)
    for i in range(args.steps):
        ids = torch.randint(256, (args.batch, args.block_size + 1), generator=g).to(device)
        for setup in setups.values():  # one step each in turn
            sync(device)
            t0 = time.perf_counter()
            step(setup, ids[:, :-1], ids[:, 1:])
            sync(device)
            if i >= args.warmup:
                setup.times.append(time.perf_counter() - t0)
    bare = statistics.median(setups["bare step"].times)
    params = sum(p.numel() * p.element_size() for p in setups["bare step"].model.parameters())
    for name, setup in setups.items():
        median = statistics.median(setup.times)
        if name.startswith("UpdateClip"):
            ops, launches = added_ops(config, optimizer, SETUPS[name]() or [], device)
            per_step = [a + b for a, b in zip(setup.own[0::2], setup.own[1::2], strict=True)]  # before + after
            own = statistics.median(per_step[args.warmup :])
            share = f"{own * 1e3:.2f} ms ({own / bare:.1%} of the bare step)"
            extra = f"{share} | +{ops} / +{launches} | {params / 2**20:.1f} MiB"
        else:
            extra = " | |"
        print(f"| {optimizer} | {name} | {median * 1e3:.1f} ms | {median / bare:.3f} | {extra} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"machine: {name}, torch {torch.__version__}; TinyGPT {args.layers} x {args.heads} x {args.embd}, ")
    print(f"batch {args.batch} x {args.block_size}; median of {args.steps - args.warmup} interleaved steps")
    print("| optimizer | setup | step | / bare | UpdateClip's own time | ops / launches added | copy kept |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for optimizer in args.optimizers:
        run(args, optimizer, device)


if __name__ == "__main__":
    main()
