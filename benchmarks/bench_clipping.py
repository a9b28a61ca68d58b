"""Gradient-clipping overhead: gradkit's clipping callbacks (with GradNormMonitor) against Lightning's
``Trainer(gradient_clip_val=1.0)``, alone and with Lightning's documented norm-logging recipe, on the same GPT-style
model, in one run.

    python benchmarks/bench_clipping.py [--steps 60 --repeats 3]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_monitoring import LightningRecipe
from harness import common_args, run_table

from lightning_gradkit import AdaptiveGradClip, AutoClip, ClipGradNorm, ClipGradValue, GradNormMonitor, ZClip
from lightning_gradkit.demos import TinyGPTModule

MODEL = dict(n_layer=8, n_head=4, n_embd=128, block_size=64)
LOG_EVERY = 50


def ours(*callbacks) -> tuple[TinyGPTModule, dict]:
    return TinyGPTModule(**MODEL), {"callbacks": [*callbacks, GradNormMonitor(depth=2)]}


def configs() -> dict:
    return {
        "a_none": lambda: (TinyGPTModule(**MODEL), {}),
        "b_gradient_clip_val": lambda: (TinyGPTModule(**MODEL), {"gradient_clip_val": 1.0}),
        "c_gradient_clip_val+grad_norm": lambda: (LightningRecipe(**MODEL), {"gradient_clip_val": 1.0}),
        "d_ClipGradNorm+monitor": lambda: ours(ClipGradNorm(1.0)),
        "e_ClipGradValue+monitor": lambda: ours(ClipGradValue(0.01)),
        "f_AdaptiveGradClip+monitor": lambda: ours(AdaptiveGradClip(exclude=[r"re:model\.lm_head"])),
        "g_AutoClip+monitor": lambda: ours(AutoClip()),
        "h_ZClip+monitor": lambda: ours(ZClip()),
    }


def main() -> None:
    args = common_args(__doc__.splitlines()[0]).parse_args()
    results = run_table(args, configs(), MODEL, "Clipping overhead", "a_none", LOG_EVERY)
    for ref in ("b_gradient_clip_val", "c_gradient_clip_val+grad_norm"):
        ratio = results["d_ClipGradNorm+monitor"].median / results[ref].median
        print(f"d_ClipGradNorm+monitor / {ref}: {ratio:.4f}")


if __name__ == "__main__":
    main()
