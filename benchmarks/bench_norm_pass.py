"""The per-tensor norm pass against the bandwidth floor: 148 tensors of GPT-2-small shapes (124M elements), bf16 and
fp32, on CUDA. Times multi_tensor_norms (the implementation it picks, printed), the same with
GRADKIT_NORM_KERNEL=foreach, and one torch.sum over a flat buffer of the same bytes (one read: the floor).

    python benchmarks/bench_norm_pass.py [--iters 200]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch

from lightning_gradkit.core._multi_norm import fallback_reason, multi_tensor_norms, norm_implementation


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(50257, 768), (1024, 768)]
    for _ in range(12):
        shapes += [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,)]
        shapes += [(768,), (768,), (768, 3072), (3072,), (3072, 768), (768,)]
    return [*shapes, (768,), (768,)]


def median_us(fn: Callable[[], object], iters: int) -> float:
    """Median GPU time of ``fn`` between CUDA events (each call timed alone, after warm-up)."""
    for _ in range(5):
        fn()
    samples = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) * 1e3)
    samples.sort()
    return samples[len(samples) // 2]


def with_foreach(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        os.environ["GRADKIT_NORM_KERNEL"] = "foreach"
        try:
            return fn()
        finally:
            os.environ.pop("GRADKIT_NORM_KERNEL")

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    cuda = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for dtype in (torch.bfloat16, torch.float32):
        grads = [torch.randn(s, device=cuda, dtype=dtype) for s in gpt2_small_shapes()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        impl = norm_implementation(cuda, dtype, 2.0)
        reason = fallback_reason(cuda, dtype, 2.0)
        kernel_us = median_us(lambda: multi_tensor_norms(grads, 2.0), args.iters)  # noqa: B023 (called at once)
        foreach_us = median_us(with_foreach(lambda: multi_tensor_norms(grads, 2.0)), args.iters)  # noqa: B023
        floor_us = median_us(lambda: torch.sum(flat), args.iters)  # noqa: B023
        print(
            f"{dtype}: {len(grads)} tensors, {flat.numel()} elements | {impl}{f' ({reason})' if reason else ''}: "
            f"{kernel_us:.0f} us ({kernel_us / floor_us:.2f}x) | foreach: {foreach_us:.0f} us "
            f"({foreach_us / floor_us:.2f}x) | torch.sum: {floor_us:.0f} us"
        )


if __name__ == "__main__":
    main()
