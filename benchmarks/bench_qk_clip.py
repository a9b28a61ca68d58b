"""Does QKClip keep the unstable proxy of ``bench_early_warning.py`` near its qk-layernorm twin? On the CPU.

The same twins, data, AdamW and schedule as ``benchmarks/bench_early_warning.py`` (TinyGPT 2 x 4 heads x 128, a
warm-up to a learning rate of 0.1, 300 steps): the stable twin with qk-layernorm, and the plain-attention twin with
``QKClip(threshold=tau)`` behind the loop door, for each ``tau``. Printed per seed: the end loss (mean of the last 25
steps) of each, their ratio, and the largest attention logit of the last logged step (``qk_clip/max_logit``, the
maxima of that step's forward, before its rescale).

    python benchmarks/bench_qk_clip.py                         # 5 seeds, tau 100, 30, 10: benchmarks/RESULTS.md
    python benchmarks/bench_qk_clip.py --seeds 1 --thresholds 10
"""

from __future__ import annotations

import argparse
import platform
import time
import warnings

import torch
import torch.nn.functional as F
from bench_early_warning import BATCH, CONFIG, PEAK_LR, WARMUP, end_loss, proxy_model

from gradkit import GradKit, QKClip
from lightning_gradkit.demos import ByteDataset, stdlib_text


def train(seed: int, qk_norm: bool, steps: int, tau: float | None) -> tuple[float, dict[str, float]]:
    """One twin's run: its end loss and what QKClip logged at the last logging step."""
    model = proxy_model(seed, qk_norm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / WARMUP))
    data = ByteDataset(stdlib_text(max_bytes=400_000), CONFIG.block_size)
    order = torch.randint(len(data), (steps * BATCH,), generator=torch.Generator().manual_seed(seed))
    logged: dict[str, float] = {}
    losses: list[float] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        policies = [QKClip(threshold=tau)] if tau is not None else []
        log_every = max(1, steps // 6)
        with GradKit(
            model, optimizer, policies, log=lambda m, s: logged.update(m), log_every_n_steps=log_every,
            schedulers=schedule, log_dir=False,
        ) as kit:  # fmt: skip
            for step in range(steps):
                pairs = [data[int(i)] for i in order[step * BATCH : (step + 1) * BATCH]]
                x, y = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
                kit.step(optimizer)
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())
    return end_loss(losses), logged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--thresholds", type=float, nargs="+", default=[100.0, 30.0, 10.0])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread")
    print(
        "| seed | stable end loss | "
        + " | ".join(f"QKClip({t:g}): end loss, / stable, max logit" for t in args.thresholds)
    )
    for seed in range(args.seeds):
        start = time.perf_counter()
        stable, _ = train(seed, True, args.steps, None)
        cells = []
        for tau in args.thresholds:
            clipped, logged = train(seed, False, args.steps, tau)
            cells.append(f"{clipped:.3f}, {clipped / stable:.3f}, {logged.get('qk_clip/max_logit', float('nan')):.0f}")
        print(
            f"| {seed} | {stable:.3f} | " + " | ".join(cells) + f" | ({time.perf_counter() - start:.0f} s)", flush=True
        )


if __name__ == "__main__":
    main()
