"""Gradient-norm monitoring overhead: no monitoring vs Lightning's recipe vs a per-parameter .item() loop vs
GradNormMonitor, on the same GPT-style model, in one run. Also times one GradStats pass against one read of all
gradient bytes.

    python benchmarks/bench_monitoring.py [--steps 60 --repeats 3]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from lightning.pytorch.utilities import grad_norm

sys.path.insert(0, str(Path(__file__).parent))
from harness import common_args, run_table

from gradkit.step.norms import derive_stats, per_tensor_norms
from gradkit.step.params import build_param_index
from lightning_gradkit import GradNormMonitor
from lightning_gradkit.demos import TinyGPTModule

MODEL = dict(n_layer=8, n_head=4, n_embd=128, block_size=64)
LOG_EVERY = 50


class LightningRecipe(TinyGPTModule):
    """(b) Lightning's documented recipe: ``self.log_dict(grad_norm(self, norm_type=2))``."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log_dict(grad_norm(self, norm_type=2))


class ItemLoop(TinyGPTModule):
    """(c) A per-parameter ``p.grad.norm().item()`` loop, as Composer's OptimizerMonitor does."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        norms = {f"grad_norm/{n}": p.grad.norm().item() for n, p in self.named_parameters() if p.grad is not None}
        norms["grad_norm/total"] = sum(v**2 for v in norms.values()) ** 0.5
        self.log_dict(norms)


def configs() -> dict:
    return {
        "a_none": lambda: (TinyGPTModule(**MODEL), {}),
        "b_lightning_grad_norm": lambda: (LightningRecipe(**MODEL), {}),
        "c_item_loop": lambda: (ItemLoop(**MODEL), {}),
        "d_GradNormMonitor": lambda: (TinyGPTModule(**MODEL), {"callbacks": [GradNormMonitor(depth=2)]}),
    }


def time_stats_pass(device: str, iters: int = 200) -> tuple[float, float, int]:
    """Median time of one GradStats pass (norms + derived values) vs one torch.sum over a flat gradient buffer."""
    module = TinyGPTModule(**MODEL).to(device)
    x = torch.randint(0, 256, (16, MODEL["block_size"]), device=device)
    module.loss((x, x)).backward()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    names = {id(p): n for n, p in module.named_parameters()}
    index = build_param_index(opt.param_groups, names, depth=2, device=torch.device(device))
    grads = [p.grad for p in index.params]
    flat = torch.cat([g.reshape(-1) for g in grads])

    def stats_pass() -> torch.Tensor:
        return derive_stats(index, per_tensor_norms(grads, 2.0), 2.0, []).total

    def read_pass() -> torch.Tensor:
        return torch.sum(flat)

    def timed(fn) -> float:
        samples = []
        for _ in range(iters):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - t0)
        samples.sort()
        return samples[len(samples) // 2]

    timed(stats_pass), timed(read_pass)  # warm up
    return timed(stats_pass), timed(read_pass), flat.numel()


def main() -> None:
    args = common_args(__doc__.splitlines()[0]).parse_args()
    run_table(args, configs(), MODEL, "Monitoring overhead", "a_none", LOG_EVERY)
    device = "cuda" if args.accelerator == "gpu" else "cpu"
    stats_t, read_t, numel = time_stats_pass(device)
    print(
        f"\nGradStats pass: {stats_t * 1e6:.1f} us; torch.sum over the same {numel} gradient elements: "
        f"{read_t * 1e6:.1f} us; ratio {stats_t / read_t:.2f}x"
    )


if __name__ == "__main__":
    main()
