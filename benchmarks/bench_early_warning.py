"""Does EarlyWarning see an instability coming? A small-scale proxy of Wortsman et al. (2023), on the CPU.

Two twins of a small GPT (``lightning_gradkit.demos.TinyGPT``: 2 layers, 4 heads, width 128, 64 tokens) train on the
same byte-level text, with the same seed, data order, AdamW and learning-rate schedule (a linear warm-up to a peak of
0.1 over 100 steps, then constant), behind the loop door (``gradkit.GradKit``):

- the **unstable** twin, plain attention: at this learning rate its attention logits grow without bound;
- the **stable** twin, the same with qk-layernorm (a LayerNorm on each head's queries and keys before the product,
  the paper's fix), which keeps the logits small.

``EarlyWarning`` watches both with its default rules (the signals every 5 optimizer steps). The criteria of issue 34,
per seed:

1. **lead**: the unstable twin's first warning comes at least 20 optimizer steps before its loss first exceeds the
   stable twin's by 10% (both as a moving average over the last 10 steps, so that one noisy batch decides nothing), or
   turns non-finite (the *divergence* step);
2. **quiet**: the stable twin never gets a warning over the same steps;
3. **mitigation**: the unstable twin with ``EarlyWarning(action="escalate")`` (the learning rate cut to 0.1x and
   ramped back over 300 steps, compounding at each new warning, the moments of the attention module that fired
   reset) ends within 10% of the stable twin's loss (mean of the last 25 steps).

The targets: (1) and (3) in at least 4 of 5 seeds, (2) in all of them.

    python benchmarks/bench_early_warning.py              # 5 seeds: the table of benchmarks/RESULTS.md
    python benchmarks/bench_early_warning.py --low-lr-twin  # and the 10x-lower-LR twin: does it stay quiet too?
    python benchmarks/bench_early_warning.py --seeds 1 --steps 160    # the short version the test runs

``tests/test_early_warning_proxy.py`` runs a short version of the same code.
"""

from __future__ import annotations

import argparse
import math
import platform
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradkit.doors.loop import GradKit
from gradkit.policies.early_warning import EarlyWarning
from lightning_gradkit.demos import ByteDataset, CausalSelfAttention, GPTConfig, TinyGPT, stdlib_text

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128, dropout=0.0)
PEAK_LR = 0.1
WARMUP = 100
BATCH = 8
LOG_EVERY = 5
LEAD = 20  # optimizer steps the warning must come before the divergence
MARGIN = 0.10  # "exceeds by 10%", "within 10%"
SMOOTH = 10  # steps of the moving average the divergence is read from
END = 25  # steps of the end loss


class QKNormAttention(CausalSelfAttention):
    """TinyGPT's attention with qk-layernorm: each head's queries and keys are layer-normalized before the product."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        head = config.n_embd // config.n_head
        self.q_norm = nn.LayerNorm(head)
        self.k_norm = nn.LayerNorm(head)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


def proxy_model(seed: int, qk_norm: bool) -> TinyGPT:
    """The twin of ``seed``: the same initial weights with and without qk-layernorm."""
    torch.manual_seed(seed)
    model = TinyGPT(CONFIG)
    if qk_norm:
        for block in model.blocks:
            plain = block.attn
            block.attn = QKNormAttention(CONFIG)
            block.attn.load_state_dict(plain.state_dict(), strict=False)
    return model


@dataclass
class Run:
    """One twin's run: the loss of every optimizer step and the warnings ``(step, signal, module, value)``."""

    losses: list[float]
    warnings: list[tuple[int, str, str, float]]
    escalations: int = 0
    seconds: float = 0.0
    series: dict[str, dict[int, float]] = field(default_factory=dict)


def train(seed: int, qk_norm: bool, steps: int, action: str = "warn", lr: float = PEAK_LR, **options: Any) -> Run:
    """Train one twin for ``steps`` optimizer steps behind the loop door, EarlyWarning watching (``options``: more
    of its arguments)."""
    model = proxy_model(seed, qk_norm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / WARMUP))
    data = ByteDataset(stdlib_text(max_bytes=400_000), CONFIG.block_size)
    order = torch.randint(len(data), (steps * BATCH,), generator=torch.Generator().manual_seed(seed))
    warning = EarlyWarning(output="lm_head", action=action, **options)  # type: ignore[arg-type]
    series: dict[str, dict[int, float]] = {}

    def log(metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            series.setdefault(key, {})[step] = value

    losses: list[float] = []
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the warnings are counted from the policy, not printed 15 runs over
        kit = GradKit(
            model, optimizer, warning, log=log, log_every_n_steps=LOG_EVERY, schedulers=schedule, log_dir=False
        )
        for step in range(steps):
            pairs = [data[int(i)] for i in order[step * BATCH : (step + 1) * BATCH]]
            x, y = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            kit.note_loss(loss)
            kit.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        kit.finish()
    escalations = warning.state_dict()["escalations"]
    return Run(losses, list(warning.warnings), escalations, time.perf_counter() - start, series)


def moving_average(values: list[float], window: int = SMOOTH) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def divergence_step(unstable: list[float], stable: list[float]) -> int | None:
    """The first step at which the unstable twin's moving-average loss exceeds the stable twin's by ``MARGIN`` (or a
    loss is non-finite), from the first full window on; ``None`` if it never does."""
    u, s = moving_average(unstable), moving_average(stable)
    for step in range(SMOOTH - 1, len(u)):
        if not math.isfinite(unstable[step]) or u[step] > (1 + MARGIN) * s[step]:
            return step
    return None


def end_loss(losses: list[float]) -> float:
    return sum(losses[-END:]) / END


@dataclass
class SeedResult:
    seed: int
    first_warning: tuple[int, str, str, float] | None
    divergence: int | None
    stable_warnings: int
    end_unstable: float
    end_stable: float
    end_mitigated: float
    escalations: int
    seconds: float
    low_lr_warnings: int | None = None

    @property
    def lead(self) -> int | None:
        if self.first_warning is None or self.divergence is None:
            return None
        return self.divergence - self.first_warning[0]

    @property
    def lead_ok(self) -> bool:
        return self.lead is not None and self.lead >= LEAD

    @property
    def mitigated_ok(self) -> bool:
        return self.end_mitigated <= (1 + MARGIN) * self.end_stable


def run_seed(seed: int, steps: int, mitigate: bool = True, low_lr: bool = False) -> SeedResult:
    unstable = train(seed, qk_norm=False, steps=steps)
    stable = train(seed, qk_norm=True, steps=steps)
    mitigated = train(seed, qk_norm=False, steps=steps, action="escalate") if mitigate else None
    # The other stable twin the issue allows: plain attention at a 10x lower learning rate (a false-alarm check).
    low = train(seed, qk_norm=False, steps=steps, lr=PEAK_LR / 10) if low_lr else None
    return SeedResult(
        seed=seed,
        first_warning=unstable.warnings[0] if unstable.warnings else None,
        divergence=divergence_step(unstable.losses, stable.losses),
        stable_warnings=len(stable.warnings),
        end_unstable=end_loss(unstable.losses),
        end_stable=end_loss(stable.losses),
        end_mitigated=end_loss(mitigated.losses) if mitigated else math.nan,
        escalations=mitigated.escalations if mitigated else 0,
        seconds=sum(run.seconds for run in (unstable, stable, mitigated, low) if run is not None),
        low_lr_warnings=len(low.warnings) if low is not None else None,
    )


def table(results: list[SeedResult]) -> str:
    head = (
        "| seed | first warning (step, signal, module, value) | divergence step | lead | stable twin warnings "
        "| end loss unstable / stable / mitigated | mitigated / stable | escalations | 10x-lower-LR twin warnings |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    rows = []
    for r in results:
        w = r.first_warning
        warned = f"{w[0]}, {w[1]}, {w[2]}, {w[3]:.3g}" if w else "none"
        lead = f"{r.lead} {'ok' if r.lead_ok else 'MISSED'}" if r.lead is not None else "n/a MISSED"
        ratio = r.end_mitigated / r.end_stable
        rows.append(
            f"| {r.seed} | {warned} | {r.divergence} | {lead} | {r.stable_warnings} "
            f"| {r.end_unstable:.3f} / {r.end_stable:.3f} / {r.end_mitigated:.3f} "
            f"| {ratio:.3f} {'ok' if r.mitigated_ok else 'MISSED'} | {r.escalations} "
            f"| {'not run' if r.low_lr_warnings is None else r.low_lr_warnings} |"
        )
    return "\n".join([head, *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--low-lr-twin", action="store_true", help="also run the 10x-lower-LR twin (5 more runs)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a shared 2-core machine: one core
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread")
    results = []
    for seed in range(args.seeds):
        results.append(run_seed(seed, args.steps, low_lr=args.low_lr_twin))
        print(table(results[-1:]).splitlines()[-1], f"({results[-1].seconds:.0f} s)", flush=True)
    print()
    print(table(results))
    leads = sum(r.lead_ok for r in results)
    quiet = sum(r.stable_warnings == 0 for r in results)
    mitigated = sum(r.mitigated_ok for r in results)
    print(
        f"\nlead >= {LEAD} steps: {leads}/{len(results)}; stable twin quiet: {quiet}/{len(results)}; "
        f"mitigated within {MARGIN:.0%}: {mitigated}/{len(results)}; {sum(r.seconds for r in results):.0f} s"
    )


if __name__ == "__main__":
    main()
