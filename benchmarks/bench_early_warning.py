"""Does EarlyWarning see an instability coming, and stay quiet on healthy runs? Small-scale proxies, on the CPU.

Every run trains behind the loop door (``gradkit.GradKit``) with ``gradkit.EarlyWarning`` at its defaults (the output
module it finds by itself is checked against the kind's), the signals measured every ``--log-every`` optimizer steps
(5: the loop's logging period), 300 steps, seeds 0, 1, 2. The GPTs are ``lightning_gradkit.demos.TinyGPT`` (layers x
heads x width, 64 tokens, batch 8, byte-level standard-library text, AdamW with betas 0.9/0.95 and no weight decay, a
linear warm-up then a constant learning rate); the twins of a seed share the initial weights and the data order.

**Unstable kinds**, each judged against a stable twin:

- ``g4_plain``: 4 x 8 heads x 128, plain attention, LR 0.1, 20-step warm-up (the shape of issue 44's proxy,
  narrower): the attention logits grow without bound from the warm-up on. Twin ``g4_qkln``: the same with
  qk-layernorm (Wortsman et al. 2023's fix: a LayerNorm on each head's queries and keys).
- ``g2_plain``: 2 x 4 heads x 128, LR 0.1, 100-step warm-up (issue 34's proxy). Twin ``g2_qkln``.
- ``g2_mid``: ``g2_plain`` at LR 0.03 with a 20-step warm-up: the logits grow slowly and the loss leaves its twin's
  late (steps 160 to 250). Twin ``g2_mid_qkln``.
- ``g4_outdiv``: ``g4_qkln`` without the final LayerNorm and with the output head at 3x the LR: the output logits
  diverge within the first 10 steps (the loss reaches ~1e4). Twin ``g4_qkln``.
- ``g2_outlo``: ``g2_mid_qkln`` at LR 0.015, no final LayerNorm, output head at 3x: output-logit spikes just after the
  warm-up. Twin ``g2_outlo_twin`` (the same with the final LayerNorm and one LR).

- ``w4_plain``: 4 x 8 heads x 256, LR 0.1, 20-step warm-up: issue 44's proxy shape. Twin ``w4_qkln``.

**Stable kinds**: the twins; ``w4_lowlr`` (``w4_plain`` at LR 0.01: issue 44's "10x-lower-LR twin", whose attention
logits grow to about 1000 in 300 healthy steps); ``g4_lowlr`` and ``g2_lowlr`` (the plain-attention GPTs at a 10x
lower LR, which end with the best losses of all); ``resnet`` (a BatchNorm ResNet of 3 stages, SGD with momentum 0.9, LR
0.1 after a 10-step warm-up, weight decay 5e-4, batch 32 of noisy 16x16 images of 10 classes), ``resnet_adam`` (the same
with AdamW at 1e-3, torch's betas and weight decay) and ``bert`` (``transformers.BertForMaskedLM``, 2 layers x 4 heads x
128, eager attention, from scratch, 15% of the bytes masked, AdamW 1e-3 after a 30-step warm-up, weight decay 0.01).

The criteria of issue 44 item 1:

1. **lead**, on unstable kinds: the first warning comes at least ``LEAD`` = 20 optimizer steps before the loss leaves
   its trend, in most seeds. The *divergence* step is the first step from step 30 on from which the unstable run's
   loss (a moving average of 20 steps) stays 10% above the twin's for 40 steps (a gap in the warm-up that closes again
   is not a departure from the trend: ``w4_plain``'s loss runs 15% above its twin's over steps 15 to 35, then level
   until step 150), or spikes to 1.5x the median of its previous 20 losses while the twin's does not, or is not
   finite; a loss that is not finite or twice the twin's before step 30 (a blow-up in the warm-up, which no noise
   explains) diverges there.
2. **false alarms**, on stable kinds: at most one warning per 1,000 optimizer steps (all seeds together).

The issue-34 table (``--mitigation``) runs the ``g2`` twins (5 seeds by default) and adds, per seed, the unstable twin
with ``EarlyWarning(action="escalate")``: it must end within 10% of the stable twin's loss (the mean of the last 25
steps); ``--low-lr-twin`` adds the 10x-lower-LR twin's warnings.

    python benchmarks/bench_early_warning.py                          # every kind, 3 seeds: benchmarks/RESULTS.md
    python benchmarks/bench_early_warning.py --kinds g2_mid,bert --seeds 1
    python benchmarks/bench_early_warning.py --mitigation --low-lr-twin  # the issue-34 table, 5 seeds

``tests/test_early_warning_proxy.py`` runs a short version of the issue-34 table.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import cache, partial
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradkit import EarlyWarning, GradKit
from lightning_gradkit.demos import ByteDataset, CausalSelfAttention, GPTConfig, TinyGPT, stdlib_text

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128, dropout=0.0)  # issue 34's proxy
PEAK_LR = 0.1  # issue 34's proxy
WARMUP = 100  # issue 34's proxy
BATCH = 8
IMAGE_BATCH = 32
STEPS = 300
LOG_EVERY = 5
LEAD = 20  # optimizer steps the warning must come before the divergence
BUDGET = 1.0  # warnings per 1,000 steps a stable kind may draw
MARGIN = 0.10  # "exceeds by 10%", "within 10%"
SMOOTH = 20  # steps of the moving average, and of the median a spike is measured against
START = 30  # the first step the moving averages are compared at
SPIKE = 1.5  # a loss this many times the median of the previous SMOOTH losses is a spike
HOLD = 40  # steps the moving average must stay above the twin's
BLOWUP = 2.0  # before START, a loss this many times the twin's diverges
END = 25  # steps of the end loss

Batch = tuple[Tensor, Tensor]
Alarm = tuple[int, str, str, float]  # a warning: (step, signal, module, value)


# -- models -----------------------------------------------------------------------------------------------------------


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


def gpt(
    seed: int, n_layer: int, n_head: int, qk_norm: bool = False, final_norm: bool = True, n_embd: int = 128
) -> TinyGPT:
    """A TinyGPT with the initial weights of ``seed``: the same with or without qk-layernorm."""
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=n_layer, n_head=n_head, n_embd=n_embd, dropout=0.0)
    torch.manual_seed(seed)
    model = TinyGPT(config)
    if qk_norm:
        for block in model.blocks:
            plain = block.attn
            block.attn = QKNormAttention(config)
            block.attn.load_state_dict(plain.state_dict(), strict=False)  # the norms keep their fresh (1, 0)
    if not final_norm:
        model.ln_f = nn.Identity()  # the output logits are then free to grow with the residual stream
    return model


def proxy_model(seed: int, qk_norm: bool) -> TinyGPT:
    """Issue 34's twin of ``seed`` (``CONFIG``): the same initial weights with and without qk-layernorm."""
    return gpt(seed, CONFIG.n_layer, CONFIG.n_head, qk_norm)


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with BatchNorm, and a projected shortcut where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + self.short(x))


class ResNet(nn.Module):
    """A small ResNet of three stages (16, 32, 64 channels) for 16x16 images; the logits come from ``fc``."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.layers = nn.Sequential(BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), BasicBlock(32, 64, 2))
        self.fc = nn.Linear(64, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


def resnet(seed: int) -> ResNet:
    torch.manual_seed(seed)
    return ResNet()


def bert(seed: int) -> nn.Module:
    """A tiny ``BertForMaskedLM`` from scratch, with eager attention (the attention probabilities are computed)."""
    from transformers import BertConfig, BertForMaskedLM  # imported here: a second or more, for one kind

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=256,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=512,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    return BertForMaskedLM(config)


# -- data and losses --------------------------------------------------------------------------------------------------


@cache
def _text() -> ByteDataset:
    return ByteDataset(stdlib_text(max_bytes=400_000), CONFIG.block_size)


def text_batches(seed: int, steps: int) -> Iterator[Batch]:
    """Next-byte windows in the order of ``seed``: inputs and targets."""
    data = _text()
    order = torch.randint(len(data), (steps * BATCH,), generator=torch.Generator().manual_seed(seed))
    for step in range(steps):
        pairs = [data[int(i)] for i in order[step * BATCH : (step + 1) * BATCH]]
        yield torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def masked_batches(seed: int, steps: int) -> Iterator[Batch]:
    """BERT's masked-language-model batches: 15% of the bytes replaced by 0, the loss on those only (-100 elsewhere)."""
    masks = torch.Generator().manual_seed(seed + 99)
    for x, _ in text_batches(seed, steps):
        masked = torch.rand(x.shape, generator=masks) < 0.15
        yield x.masked_fill(masked, 0), x.masked_fill(~masked, -100)


def image_batches(seed: int, steps: int) -> Iterator[Batch]:
    """Noisy images of 10 classes: a smooth 16x16 pattern per class (the same for every seed), scaled, plus noise."""
    patterns = F.avg_pool2d(torch.randn(10, 3, 20, 20, generator=torch.Generator().manual_seed(1234)), 5, 1)
    draws = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        y = torch.randint(10, (IMAGE_BATCH,), generator=draws)
        scale = 0.5 + torch.rand(IMAGE_BATCH, 1, 1, 1, generator=draws)
        yield patterns[y] * scale + 0.8 * torch.randn(IMAGE_BATCH, 3, 16, 16, generator=draws), y


def lm_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def masked_lm_loss(model: nn.Module, x: Tensor, labels: Tensor) -> Tensor:
    return model(input_ids=x, labels=labels).loss


def classification_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(model(x), y)


# -- the kinds --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """A proxy kind: its model, data, optimizer and schedule, and (unstable kinds) the stable twin it is judged by.

    ``output`` is the module that returns the logits (the one ``EarlyWarning`` must find); ``output_lr`` multiplies the
    learning rate of its parameters; the learning rate warms up linearly over ``warmup`` steps, then stays constant.
    """

    model: Callable[[int], nn.Module]
    batches: Callable[[int, int], Iterator[Batch]]
    loss: Callable[[nn.Module, Tensor, Tensor], Tensor]
    output: str
    lr: float
    warmup: int
    twin: str | None = None
    optimizer: Literal["adamw", "sgd"] = "adamw"
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    output_lr: float = 1.0


_GPT = {"batches": text_batches, "loss": lm_loss, "output": "lm_head"}
_RESNET = Kind(resnet, image_batches, classification_loss, "fc", 0.1, 10, optimizer="sgd", weight_decay=5e-4)

_G4 = partial(gpt, n_layer=4, n_head=8)
_G2 = partial(gpt, n_layer=2, n_head=4)
_W4 = partial(gpt, n_layer=4, n_head=8, n_embd=256)  # issue 44's proxy shape
_OUT = {"qk_norm": True, "final_norm": False}  # the output-logit kinds: qk-layernorm, no final LayerNorm

KINDS: dict[str, Kind] = {
    "g4_plain": Kind(_G4, **_GPT, lr=0.1, warmup=20, twin="g4_qkln"),
    "g2_plain": Kind(_G2, **_GPT, lr=0.1, warmup=100, twin="g2_qkln"),
    "g2_mid": Kind(_G2, **_GPT, lr=0.03, warmup=20, twin="g2_mid_qkln"),
    "g4_outdiv": Kind(partial(_G4, **_OUT), **_GPT, lr=0.1, warmup=20, twin="g4_qkln", output_lr=3.0),
    "g2_outlo": Kind(partial(_G2, **_OUT), **_GPT, lr=0.015, warmup=20, twin="g2_outlo_twin", output_lr=3.0),
    "g4_qkln": Kind(partial(_G4, qk_norm=True), **_GPT, lr=0.1, warmup=20),
    "g2_qkln": Kind(partial(_G2, qk_norm=True), **_GPT, lr=0.1, warmup=100),
    "g2_mid_qkln": Kind(partial(_G2, qk_norm=True), **_GPT, lr=0.03, warmup=20),
    "g2_outlo_twin": Kind(partial(_G2, qk_norm=True), **_GPT, lr=0.015, warmup=20),
    "g4_lowlr": Kind(_G4, **_GPT, lr=0.01, warmup=20),
    "g2_lowlr": Kind(_G2, **_GPT, lr=0.01, warmup=100),
    "w4_plain": Kind(_W4, **_GPT, lr=0.1, warmup=20, twin="w4_qkln"),
    "w4_qkln": Kind(partial(_W4, qk_norm=True), **_GPT, lr=0.1, warmup=20),
    "w4_lowlr": Kind(_W4, **_GPT, lr=0.01, warmup=20),
    "resnet": _RESNET,
    "resnet_adam": replace(_RESNET, optimizer="adamw", lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01),
    "bert": Kind(bert, masked_batches, masked_lm_loss, "cls.predictions.decoder", 1e-3, 30, weight_decay=0.01),
}


# -- one run ----------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One run: the loss of every optimizer step, the warnings ``(step, signal, module, value)``, its time."""

    losses: list[float]
    warnings: list[Alarm]
    escalations: int = 0
    seconds: float = 0.0


def make_optimizer(kind: Kind, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The kind's optimizer; the output module's parameters in a group of their own at ``output_lr`` times ``lr``."""
    head = {id(p) for p in model.get_submodule(kind.output).parameters()} if kind.output_lr != 1.0 else set()
    groups = [{"params": [p for p in model.parameters() if id(p) not in head], "lr": lr}]
    if head:
        groups.append({"params": list(model.get_submodule(kind.output).parameters()), "lr": lr * kind.output_lr})
    if kind.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, weight_decay=kind.weight_decay)
    return torch.optim.AdamW(groups, lr=lr, betas=kind.betas, weight_decay=kind.weight_decay)


def train_kind(
    kind: Kind,
    seed: int,
    steps: int = STEPS,
    log_every: int = LOG_EVERY,
    lr: float | None = None,
    **options: Any,
) -> Run:
    """Train ``kind`` for ``steps`` optimizer steps behind the loop door, ``EarlyWarning(**options)`` watching (its
    ``output`` found by itself: checked to be ``kind.output``); ``lr`` replaces the kind's."""
    model = kind.model(seed)
    optimizer = make_optimizer(kind, model, kind.lr if lr is None else lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / kind.warmup))
    warning = EarlyWarning(**options)  # output="auto": the output module found as a user's run finds it
    losses: list[float] = []
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the warnings are counted from the policy, not printed run after run
        kit = GradKit(model, optimizer, warning, log_every_n_steps=log_every, schedulers=schedule, log_dir=False)
        if warning.output_module != kind.output:
            raise RuntimeError(f"EarlyWarning found the output module {warning.output_module!r}, not {kind.output!r}")
        for x, y in kind.batches(seed, steps):
            loss = kind.loss(model, x, y)
            loss.backward()
            kit.note_loss(loss)
            kit.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        kit.finish()
    escalations = warning.state_dict()["escalations"]
    return Run(losses, list(warning.warnings), escalations, time.perf_counter() - start)


def train(seed: int, qk_norm: bool, steps: int, action: str = "warn", lr: float = PEAK_LR, **options: Any) -> Run:
    """Train one of issue 34's twins (``g2_qkln`` or ``g2_plain``) at ``lr`` (``options``: more of EarlyWarning's
    arguments)."""
    return train_kind(KINDS["g2_qkln" if qk_norm else "g2_plain"], seed, steps, lr=lr, action=action, **options)


# -- the criteria -----------------------------------------------------------------------------------------------------


def moving_average(values: list[float], window: int = SMOOTH) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def _spikes(losses: list[float], step: int) -> bool:
    return losses[step] > SPIKE * statistics.median(losses[step - SMOOTH : step])


def divergence_step(unstable: list[float], stable: list[float]) -> int | None:
    """The step at which ``unstable`` leaves its trend against its twin ``stable`` (the criteria of the module
    docstring); ``None`` if it never does."""
    for step in range(min(START, len(unstable))):
        if not math.isfinite(unstable[step]) or unstable[step] > BLOWUP * stable[step]:
            return step
    u, s = moving_average(unstable), moving_average(stable)
    above = [a > (1 + MARGIN) * b for a, b in zip(u, s, strict=True)]
    for step in range(START, len(unstable)):
        if not math.isfinite(unstable[step]) or all(above[step : step + HOLD]):
            return step
        if _spikes(unstable, step) and not _spikes(stable, step):
            return step
    return None


def lead(run: Run, divergence: int | None) -> int | None:
    """Optimizer steps from the first warning to the divergence (negative: the warning came after it)."""
    return None if divergence is None or not run.warnings else divergence - run.warnings[0][0]


def end_loss(losses: list[float]) -> float:
    return sum(losses[-END:]) / END


def _alarm(alarm: Alarm | None) -> str:
    return "none" if alarm is None else f"{alarm[0]}, {alarm[1]}, {alarm[2]}, {alarm[3]:.3g}"


# -- the proxy kinds (issue 44) ---------------------------------------------------------------------------------------


def kinds_to_run(names: list[str]) -> list[str]:
    """``names`` with the twins of its unstable kinds, each twin before the first kind it judges, each kind once."""
    order: list[str] = []
    for name in names:
        twin = KINDS[name].twin
        order += [k for k in (twin, name) if k is not None and k not in order]
    return order


def run_kinds(names: list[str], seeds: list[int], steps: int, log_every: int) -> dict[tuple[str, int], Run]:
    """Every (kind, seed) run once, a line printed as each ends."""
    runs: dict[tuple[str, int], Run] = {}
    for name in kinds_to_run(names):
        for seed in seeds:
            run = runs[name, seed] = train_kind(KINDS[name], seed, steps, log_every)
            print(
                f"{name} seed {seed}: {len(run.warnings)} warnings, first {_alarm(_first(run))}; "
                f"end loss {end_loss(run.losses):.3f}; {run.seconds:.0f} s",
                flush=True,
            )
    return runs


def _first(run: Run) -> Alarm | None:
    return run.warnings[0] if run.warnings else None


def unstable_table(runs: dict[tuple[str, int], Run]) -> list[str]:
    """One row per unstable kind and seed: the divergence, the first warning, the lead."""
    rows = [
        "| kind | twin | seed | divergence step | first warning (step, signal, module, value) | lead | warnings "
        "| time |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (name, seed), run in runs.items():
        twin = KINDS[name].twin
        if twin is None:
            continue
        divergence = divergence_step(run.losses, runs[twin, seed].losses)
        steps = lead(run, divergence)
        verdict = "n/a" if steps is None else f"{steps} {'ok' if steps >= LEAD else 'MISSED'}"
        rows.append(
            f"| {name} | {twin} | {seed} | {divergence} | {_alarm(_first(run))} | {verdict} | {len(run.warnings)} "
            f"| {run.seconds:.0f} s |"
        )
    return rows


def stable_table(runs: dict[tuple[str, int], Run]) -> list[str]:
    """One row per stable kind and seed: its warnings."""
    rows = [
        "| kind | seed | warnings | first warning (step, signal, module, value) | end loss | time |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (name, seed), run in runs.items():
        if KINDS[name].twin is None:
            rows.append(
                f"| {name} | {seed} | {len(run.warnings)} | {_alarm(_first(run))} | {end_loss(run.losses):.3f} "
                f"| {run.seconds:.0f} s |"
            )
    return rows


def _judge_unstable(runs: dict[tuple[str, int], Run], name: str, seeds: list[int]) -> tuple[str, str, bool]:
    """The leads of ``name``'s seeds, and whether they are >= ``LEAD`` in most."""
    twin = KINDS[name].twin
    leads = [lead(runs[name, s], divergence_step(runs[name, s].losses, runs[twin, s].losses)) for s in seeds]
    hits = sum(steps is not None and steps >= LEAD for steps in leads)
    per_seed = ", ".join("n/a" if steps is None else str(steps) for steps in leads)
    return per_seed, f"{hits}/{len(seeds)}", 2 * hits > len(seeds)


def _judge_stable(runs: dict[tuple[str, int], Run], name: str, seeds: list[int]) -> tuple[str, str, bool]:
    """The warnings of ``name``'s seeds, and whether they are within ``BUDGET`` per 1,000 steps over all."""
    per_seed = [runs[name, seed] for seed in seeds]
    rate = 1000 * sum(len(run.warnings) for run in per_seed) / sum(len(run.losses) for run in per_seed)
    return ", ".join(str(len(run.warnings)) for run in per_seed), f"{rate:.2f} per 1,000 steps", rate <= BUDGET


def kind_summary(runs: dict[tuple[str, int], Run], seeds: list[int]) -> tuple[list[str], str]:
    """One row per kind against its criterion, and the summary line."""
    rows = ["| kind | seeds | criterion | per seed | result |", "| --- | --- | --- | --- | --- |"]
    verdicts: dict[bool, list[bool]] = {True: [], False: []}  # unstable?: met
    for name in dict.fromkeys(name for name, _ in runs):
        unstable = KINDS[name].twin is not None
        per_seed, result, ok = (_judge_unstable if unstable else _judge_stable)(runs, name, seeds)
        criterion = f"lead >= {LEAD} steps in most seeds" if unstable else f"<= {BUDGET:g} warning per 1,000 steps"
        rows.append(f"| {name} | {len(seeds)} | {criterion} | {per_seed} | {result} {'ok' if ok else 'MISSED'} |")
        verdicts[unstable].append(ok)
    seconds = sum(run.seconds for run in runs.values())
    line = (
        f"unstable kinds warned >= {LEAD} steps ahead in most seeds: {sum(verdicts[True])}/{len(verdicts[True])}; "
        f"stable kinds within {BUDGET:g} warning per 1,000 steps: {sum(verdicts[False])}/{len(verdicts[False])}; "
        f"{len(runs)} runs, {seconds:.0f} s"
    )
    return rows, line


def report_kinds(runs: dict[tuple[str, int], Run], seeds: list[int]) -> None:
    summary, line = kind_summary(runs, seeds)
    for title, rows in (
        (f"Unstable kinds: the lead (the first warning >= {LEAD} steps before the divergence)", unstable_table(runs)),
        (f"Stable kinds: false alarms (at most {BUDGET:g} per 1,000 steps over all seeds)", stable_table(runs)),
        ("Per kind", summary),
    ):
        print(f"\n{title}\n", *rows, sep="\n")
    print(f"\n{line}")


# -- the twins and the mitigation (issue 34) --------------------------------------------------------------------------


@dataclass
class SeedResult:
    seed: int
    first_warning: Alarm | None
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
    """Issue 34's twins of ``seed``, the unstable one with ``action="escalate"`` too (``mitigate``) and the
    10x-lower-LR twin (``low_lr``: plain attention, a false-alarm check)."""
    unstable = train(seed, qk_norm=False, steps=steps)
    stable = train(seed, qk_norm=True, steps=steps)
    mitigated = train(seed, qk_norm=False, steps=steps, action="escalate") if mitigate else None
    low = train(seed, qk_norm=False, steps=steps, lr=PEAK_LR / 10) if low_lr else None
    return SeedResult(
        seed=seed,
        first_warning=_first(unstable),
        divergence=divergence_step(unstable.losses, stable.losses),
        stable_warnings=len(stable.warnings),
        end_unstable=end_loss(unstable.losses),
        end_stable=end_loss(stable.losses),
        end_mitigated=end_loss(mitigated.losses) if mitigated else math.nan,
        escalations=mitigated.escalations if mitigated else 0,
        seconds=sum(run.seconds for run in (unstable, stable, mitigated, low) if run is not None),
        low_lr_warnings=len(low.warnings) if low is not None else None,
    )


def mitigation_table(results: list[SeedResult]) -> str:
    head = (
        "| seed | first warning (step, signal, module, value) | divergence step | lead | stable twin warnings "
        "| end loss unstable / stable / mitigated | mitigated / stable | escalations | 10x-lower-LR twin warnings |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    rows = []
    for r in results:
        verdict = f"{r.lead} {'ok' if r.lead_ok else 'MISSED'}" if r.lead is not None else "n/a MISSED"
        ratio = r.end_mitigated / r.end_stable
        rows.append(
            f"| {r.seed} | {_alarm(r.first_warning)} | {r.divergence} | {verdict} | {r.stable_warnings} "
            f"| {r.end_unstable:.3f} / {r.end_stable:.3f} / {r.end_mitigated:.3f} "
            f"| {ratio:.3f} {'ok' if r.mitigated_ok else 'MISSED'} | {r.escalations} "
            f"| {'not run' if r.low_lr_warnings is None else r.low_lr_warnings} |"
        )
    return "\n".join([head, *rows])


def report_mitigation(seeds: int, steps: int, low_lr: bool) -> None:
    results = []
    for seed in range(seeds):
        results.append(run_seed(seed, steps, low_lr=low_lr))
        print(mitigation_table(results[-1:]).splitlines()[-1], f"({results[-1].seconds:.0f} s)", flush=True)
    print(f"\n{mitigation_table(results)}")
    leads = sum(r.lead_ok for r in results)
    quiet = sum(r.stable_warnings == 0 for r in results)
    mitigated = sum(r.mitigated_ok for r in results)
    print(
        f"\nlead >= {LEAD} steps: {leads}/{len(results)}; stable twin quiet: {quiet}/{len(results)}; "
        f"mitigated within {MARGIN:.0%}: {mitigated}/{len(results)}; {sum(r.seconds for r in results):.0f} s"
    )


# -- main -------------------------------------------------------------------------------------------------------------


def kind_list(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in KINDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown kinds {unknown or value!r}: choose from {', '.join(KINDS)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", type=kind_list, default=list(KINDS), help="comma list (default: every kind)")
    parser.add_argument(
        "--seeds", type=int, default=None, help="how many seeds, from --first-seed (default 3; 5 with --mitigation)"
    )
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed (held-out seeds: 3 and on)")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--log-every", type=int, default=LOG_EVERY, help="the loop's logging period, in steps")
    parser.add_argument("--mitigation", action="store_true", help="issue 34's twins and action='escalate' instead")
    parser.add_argument("--low-lr-twin", action="store_true", help="with --mitigation: the 10x-lower-LR twin too")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a shared 2-core machine: one core
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread")
    if args.mitigation or args.low_lr_twin:
        report_mitigation(args.seeds or 5, args.steps, args.low_lr_twin)
        return
    seeds = list(range(args.first_seed, args.first_seed + (args.seeds or 3)))
    print(f"seeds {seeds} x {args.steps} steps, signals every {args.log_every} steps: {', '.join(args.kinds)}")
    report_kinds(run_kinds(args.kinds, seeds, args.steps, args.log_every), seeds)


if __name__ == "__main__":
    main()
