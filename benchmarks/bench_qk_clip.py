"""Does QKClip keep the unstable proxy of ``bench_early_warning.py`` near its qk-layernorm twin? On the CPU.

The same twins, data, AdamW and schedule as ``benchmarks/bench_early_warning.py`` (TinyGPT 2 x 4 heads x 128, a
warm-up to a learning rate of 0.1, 300 steps): the stable twin with qk-layernorm, and the plain-attention twin with
``QKClip(threshold=tau)`` behind the loop door, for each ``tau``. Printed per seed: the end loss (mean of the last 25
steps) of each, their ratio, and the largest attention logit of the last logged step (``qk_clip/max_logit``, the
maxima of that step's forward, before its rescale).

The reference columns (``--bound-thresholds``) hold the plain twin's logits *exactly* under ``tau`` in every training
forward, which no rescale after the step can do: before each forward of an attention module, its logits on that very
input are computed and its query and key rows rescaled by QKClip's rule (``sqrt(tau / max)`` each) so that every
head's largest logit of the forward is at most ``tau``. Not a QKClip mode (it needs the module's own projections, and
one more ``q @ k^T`` per forward): the best any bound on the logits does on this proxy. The stable twin's "max logit"
is that of its normalized queries and keys at the last step.

    python benchmarks/bench_qk_clip.py                         # 5 seeds, tau 100, 30, 10: benchmarks/RESULTS.md
    python benchmarks/bench_qk_clip.py --seeds 1 --thresholds 10 --bound-thresholds
    python benchmarks/bench_qk_clip.py --thresholds 30 10 --bound-thresholds   # with scale_updates=True beside
"""

from __future__ import annotations

import argparse
import math
import platform
import time
import warnings

import torch
import torch.nn.functional as F
from bench_early_warning import BATCH, CONFIG, PEAK_LR, WARMUP, end_loss, proxy_model
from torch import Tensor, nn

from gradkit import GradKit, QKClip
from lightning_gradkit.demos import ByteDataset, TinyGPT, stdlib_text


def head_max_logit(attn: nn.Module, x: Tensor) -> Tensor:
    """Per head, the largest causal logit ``q.k / sqrt(d)`` TinyGPT's attention computes on ``x`` (after its
    qk-layernorm, where it has one)."""
    b, t, c = x.shape
    heads = attn.n_head
    q, k, _ = attn.qkv(x).split(c, dim=2)
    q, k = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k))
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(c // heads)
    logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
    return logits.transpose(0, 1).reshape(heads, -1).amax(1)


def bound_logits(model: TinyGPT, tau: float) -> None:
    """Before each training forward of an attention module, rescale its query and key rows (weight and bias, by
    ``sqrt(tau / max)`` each, per head) so that the forward's largest logit of every head is at most ``tau``."""

    def hook(attn: nn.Module, args: tuple[Tensor, ...]) -> None:
        if not attn.training:
            return
        with torch.no_grad():
            peak = head_max_logit(attn, args[0])
            scale = torch.where(peak > tau, tau / peak, torch.ones_like(peak)).sqrt()
            rows = scale.repeat_interleave(CONFIG.n_embd // CONFIG.n_head).repeat(2)  # q rows, then k rows
            attn.qkv.weight[: 2 * CONFIG.n_embd] *= rows[:, None]
            attn.qkv.bias[: 2 * CONFIG.n_embd] *= rows

    for block in model.blocks:
        block.attn.register_forward_pre_hook(hook)


def train(
    seed: int, qk_norm: bool, steps: int, tau: float | None, bound: float | None = None, scale_updates: bool = False
) -> tuple[float, float]:
    """One twin's run: its end loss and the largest logit of its last logged step (QKClip's ``qk_clip/max_logit``,
    or, without QKClip, that of the last step's forward)."""
    model = proxy_model(seed, qk_norm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / WARMUP))
    data = ByteDataset(stdlib_text(max_bytes=400_000), CONFIG.block_size)
    order = torch.randint(len(data), (steps * BATCH,), generator=torch.Generator().manual_seed(seed))
    if bound is not None:
        bound_logits(model, bound)
    logged: dict[str, float] = {}
    last: list[float] = []  # the largest logit of each attention module's forward at the last step
    losses: list[float] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        policies = [QKClip(threshold=tau, scale_updates=scale_updates)] if tau is not None else []
        log_every = max(1, steps // 6)
        with GradKit(
            model, optimizer, policies, log=lambda m, s: logged.update(m), log_every_n_steps=log_every,
            schedulers=schedule, log_dir=False,
        ) as kit:  # fmt: skip
            for step in range(steps):
                pairs = [data[int(i)] for i in order[step * BATCH : (step + 1) * BATCH]]
                x, y = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
                watch = [b.attn.register_forward_hook(_probe(last)) for b in model.blocks] if step == steps - 1 else []
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                for handle in watch:
                    handle.remove()
                loss.backward()
                kit.step(optimizer)
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())
    return end_loss(losses), logged.get("qk_clip/max_logit", max(last, default=float("nan")))


def _probe(into: list[float]):  # a forward hook that keeps the largest logit of the forward
    def hook(attn: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
        with torch.no_grad():
            into.append(float(head_max_logit(attn, args[0]).max()))

    return hook


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--thresholds", type=float, nargs="+", default=[100.0, 30.0, 10.0])
    parser.add_argument("--bound-thresholds", type=float, nargs="*", default=[30.0, 10.0])
    parser.add_argument("--scale-updates-thresholds", type=float, nargs="*", default=[30.0, 10.0])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread")
    print(
        "| seed | stable: end loss, max logit | "
        + " | ".join(f"QKClip({t:g}): end loss, / stable, max logit" for t in args.thresholds)
        + "".join(f" | exact bound {t:g}: end loss, / stable" for t in args.bound_thresholds)
        + "".join(f" | QKClip({t:g}, scale_updates=True)" for t in args.scale_updates_thresholds)
        + " |"
    )
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        start = time.perf_counter()
        stable, stable_max = train(seed, True, args.steps, None)
        cells = []
        for tau in args.thresholds:
            clipped, peak = train(seed, False, args.steps, tau)
            cells.append(f"{clipped:.3f}, {clipped / stable:.3f}, {peak:.0f}")
        for tau in args.bound_thresholds:
            bounded, _ = train(seed, False, args.steps, None, bound=tau)
            cells.append(f"{bounded:.3f}, {bounded / stable:.3f}")
        for tau in args.scale_updates_thresholds:
            scaled, peak = train(seed, False, args.steps, tau, scale_updates=True)
            cells.append(f"{scaled:.3f}, {scaled / stable:.3f}, {peak:.0f}")
        print(
            f"| {seed} | {stable:.3f}, {stable_max:.0f} | "
            + " | ".join(cells)
            + f" | ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
