"""The norm pass against the bandwidth floor: gradkit's GradStats pass vs one read of the same gradient bytes.

GPT-2-small-shaped gradients (148 tensors, 124.4M elements) in bf16 and fp32. Measured, each the median of
``--iters`` calls (CUDA: one pair of events around each call; CPU: ``perf_counter``):

- ``per_tensor_norms``: :func:`gradkit.step.norms.per_tensor_norms`, the one read of the gradients;
- ``GradStats pass``: that read plus :func:`~gradkit.step.norms.derive_stats` (total, per-module norms),
  what the engine does every optimizer step;
- ``get_total_norm``: ``torch.nn.utils.get_total_norm(foreach=True)``;
- ``clip_grad_norm_``: ``torch.nn.utils.clip_grad_norm_(foreach=True)`` (norm plus the scaling pass);
- ``floor``: one ``torch.sum`` over a flat copy of the same bytes.

Target (issue "Free on the GPU", item 4): the GradStats pass <= 2x the floor at 124M elements in bf16 and fp32 on
CUDA. The script calls the project's public functions, so it measures whatever norm implementation is in place.

    python benchmarks/bench_norm_floor.py [--json PATH]        # CUDA, GPT-2-small shapes
    python benchmarks/bench_norm_floor.py --tiny               # CPU smoke run, small shapes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import lightning
import torch
from torch import nn

from gradkit.step._multi_norm import fallback_reason, norm_implementation
from gradkit.step.norms import derive_stats, per_tensor_norms
from gradkit.step.params import build_param_index

TARGET = 2.0  # GradStats pass / floor
GPT2_SMALL = {"vocab": 50257, "block": 1024, "embd": 768, "layers": 12}
TINY = {"vocab": 512, "block": 64, "embd": 64, "layers": 2}


def gpt2_shapes(vocab: int, block: int, embd: int, layers: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes of GPT-2 (HF layout, tied head): ``12 * layers + 4`` tensors."""
    d = embd
    yield "wte", (vocab, d)
    yield "wpe", (block, d)
    for i in range(layers):
        for name, shape in [
            ("ln_1.weight", (d,)),
            ("ln_1.bias", (d,)),
            ("attn.c_attn.weight", (d, 3 * d)),
            ("attn.c_attn.bias", (3 * d,)),
            ("attn.c_proj.weight", (d, d)),
            ("attn.c_proj.bias", (d,)),
            ("ln_2.weight", (d,)),
            ("ln_2.bias", (d,)),
            ("mlp.c_fc.weight", (d, 4 * d)),
            ("mlp.c_fc.bias", (4 * d,)),
            ("mlp.c_proj.weight", (4 * d, d)),
            ("mlp.c_proj.bias", (d,)),
        ]:
            yield f"h.{i}.{name}", shape
    yield "ln_f.weight", (d,)
    yield "ln_f.bias", (d,)


def implementation(device: torch.device) -> str:
    """The per-tensor norm kernel in use for 2-norms of bf16 and fp32 gradients on ``device`` (and why not the
    multi-tensor one)."""
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        reason = fallback_reason(device, dtype, 2.0)
        out.append(f"{dtype}: {norm_implementation(device, dtype, 2.0)}" + (f" ({reason})" if reason else ""))
    return "; ".join(out)


def timed(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 5) -> float:
    """Median microseconds of one call of ``fn``."""
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(iters):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def measure(dtype: torch.dtype, shapes: dict[str, int], device: torch.device, iters: int) -> dict[str, object]:
    gen = torch.Generator(device=device).manual_seed(0)
    params, names = [], {}
    for name, shape in gpt2_shapes(**shapes):
        p = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        p.grad = torch.randn(shape, device=device, dtype=dtype, generator=gen)
        params.append(p)
        names[id(p)] = name
    opt = torch.optim.SGD(params, lr=0.1)
    index = build_param_index(opt.param_groups, names, depth=2, device=device)
    grads = [p.grad for p in index.params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    nbytes = flat.numel() * flat.element_size()

    def stats_pass() -> torch.Tensor:
        return derive_stats(index, per_tensor_norms(grads, 2.0, index.run_bounds), 2.0, []).total

    def foreach_norms() -> torch.Tensor:
        # The same call with the multi-tensor kernel switched off: the `torch._foreach_norm` path (the "before").
        previous = os.environ.get("GRADKIT_NORM_KERNEL")
        os.environ["GRADKIT_NORM_KERNEL"] = "foreach"
        try:
            return per_tensor_norms(grads, 2.0, index.run_bounds)
        finally:
            if previous is None:
                os.environ.pop("GRADKIT_NORM_KERNEL")
            else:
                os.environ["GRADKIT_NORM_KERNEL"] = previous

    us = {
        "per_tensor_norms": timed(lambda: per_tensor_norms(grads, 2.0, index.run_bounds), device, iters),
        "per_tensor (foreach)": timed(foreach_norms, device, iters),
        "GradStats pass": timed(stats_pass, device, iters),
        "get_total_norm": timed(lambda: torch.nn.utils.get_total_norm(grads, 2.0, foreach=True), device, iters),
        # max_norm far above the norm: the coefficient clamps to 1, the scaling pass still runs (as in training).
        "clip_grad_norm_": timed(lambda: torch.nn.utils.clip_grad_norm_(params, 1e9, foreach=True), device, iters),
        "floor (torch.sum)": timed(lambda: torch.sum(flat), device, iters),
    }
    reference = torch.nn.utils.get_total_norm([g.float() for g in grads], 2.0)
    equal = bool(torch.allclose(stats_pass().float(), reference, rtol=1e-4))
    floor = us["floor (torch.sum)"]
    ratio = us["GradStats pass"] / floor
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "dtype": dtype_name,
        "tensors": len(grads),
        "elements": flat.numel(),
        "bytes": nbytes,
        "us": us,
        "ratio_to_floor": {k: v / floor for k, v in us.items()},
        "floor_GBps": nbytes / floor / 1e3,
        "total_matches_fp32_reference": equal,
        "target": {"name": f"GradStats pass <= {TARGET:g}x floor ({dtype_name})", "value": ratio, "limit": TARGET},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke run)")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per measurement (default 50, tiny 10)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" and not args.tiny:
        print("bench_norm_floor: skipped: no CUDA device (the 124M-element run is a GPU benchmark; --tiny runs on CPU)")
        return 0
    shapes = TINY if args.tiny else GPT2_SMALL
    iters = args.iters or (10 if args.tiny else 50)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"device {name}; torch {torch.__version__}; lightning {lightning.__version__}")
    print(f"norm implementation: {implementation(device)}")
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        r = measure(dtype, shapes, device, iters)
        results.append(r)
        print(
            f"{r['dtype']}: {r['tensors']} tensors, {r['elements'] / 1e6:.1f}M elements, {r['bytes'] / 1e9:.3f} GB; "
            f"floor {r['floor_GBps']:.0f} GB/s; total equals the fp32 reference: {r['total_matches_fp32_reference']}"
        )
        for k, v in r["us"].items():
            print(f"  {k:20s} {v:10.1f} us  x{r['ratio_to_floor'][k]:.2f} floor")
    on_gpu = device.type == "cuda" and not args.tiny
    failed = False
    for r in results:
        t = r["target"]
        t["pass"] = t["value"] <= t["limit"] and r["total_matches_fp32_reference"]
        verdict = ("PASS" if t["pass"] else "FAIL") if on_gpu else "info (a CUDA target at 124M elements)"
        print(f"target {t['name']}: x{t['value']:.2f} {verdict}")
        failed |= on_gpu and not t["pass"]
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "benchmark": "bench_norm_floor",
            "device": name,
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "implementation": implementation(device),
            "tiny": args.tiny,
            "iters": iters,
            "results": results,
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
