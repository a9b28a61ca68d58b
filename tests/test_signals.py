"""The early-warning signals (``gradkit.policies.signals``), each against an independent reference: attention logits
computed by hand (``q @ k^T / sqrt(d)``, masked), log Z with ``torch.logsumexp``, ``g^2 / v`` from the optimizer's state
by hand, update ratios from copies of the parameters, OLMo's SpikeScore written out in the test; and what a step that
does not log costs: no device operation, no host sync."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradkit.doors.loop import GradKit
from gradkit.policies.early_warning import EarlyWarning
from gradkit.policies.signal_math import (
    MIN_MOMENT_STEPS,
    SpikeScore,
    adam_ratio_sums,
    sampled_positions,
    sdpa_logit_max,
)
from helpers import count_syncs
from lightning_gradkit.demos import GPTConfig, TinyGPT
from lightning_gradkit.diagnostics.op_count import OpCounter

CONFIG = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=32)


def _by_hand(q: Tensor, k: Tensor, causal: bool, rows: list[int] | None = None, scale: float | None = None) -> Tensor:
    """The reference: every logit of the first batch element, ``q @ k^T / sqrt(d)``, causal positions masked."""
    q0, k0 = q.reshape(-1, *q.shape[-3:])[0], k.reshape(-1, *k.shape[-3:])[0]
    logits = q0 @ k0.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if causal:
        logits = logits.masked_fill(torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1), -math.inf)
    return logits[:, rows].max() if rows is not None else logits.max()


def test_sampled_positions_are_evenly_spaced_and_keep_the_last() -> None:
    assert sampled_positions(64, 4) == [0, 21, 42, 63]
    assert sampled_positions(10, 1) == [9]
    assert sampled_positions(5, 64) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_logit_max_of_every_query_equals_the_logits_by_hand(causal: bool) -> None:
    q, k = torch.randn(3, 4, 10, 8), torch.randn(3, 4, 10, 8)
    value, what = sdpa_logit_max(q, k, is_causal=causal, queries=64)
    assert torch.allclose(value, _by_hand(q, k, causal))
    assert what == "batch element 0 of 3, 4 heads, 10 of 10 query positions, all 10 keys"


def test_sdpa_logit_max_of_a_sample_reads_only_the_sampled_queries() -> None:
    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8)
    value, what = sdpa_logit_max(q, k, is_causal=True, queries=4)
    assert torch.allclose(value, _by_hand(q, k, True, rows=sampled_positions(16, 4)))
    assert "4 of 16 query positions" in what


def test_sdpa_logit_max_applies_the_calls_mask_scale_and_grouped_heads() -> None:
    q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 9, 8)
    keep = torch.rand(2, 1, 6, 9) > 0.5
    keep[..., 0] = True
    value, _ = sdpa_logit_max(q, k, attn_mask=keep, scale=0.5, enable_gqa=True)
    grouped = k.repeat_interleave(2, dim=1)
    logits = q[0] @ grouped[0].transpose(-1, -2) * 0.5
    assert torch.allclose(value, logits.masked_fill(~keep[0], -math.inf).max())
    bias = torch.randn(6, 9)
    value, _ = sdpa_logit_max(q, grouped, attn_mask=bias)
    assert torch.allclose(value, (q[0] @ grouped[0].transpose(-1, -2) / math.sqrt(8) + bias).max())


class _Attention(nn.Module):
    """Every attention logit of a ``TinyGPT`` attention module, for the first batch element, by hand."""

    def __init__(self) -> None:
        self.values: dict[str, Tensor] = {}

    def hook(self, name: str):
        @torch.no_grad()
        def read(module: nn.Module, args: Any, output: Any) -> None:
            x = args[0]
            b, t, c = x.shape
            q, k, _ = module.qkv(x).split(c, dim=2)
            q, k = (z.view(b, t, module.n_head, c // module.n_head).transpose(1, 2) for z in (q, k))
            self.values[name] = _by_hand(q, k, causal=True)

        return read


def _tiny(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(CONFIG)


def _run(model: nn.Module, warning: EarlyWarning, steps: int, every: int = 1, **kit_args: Any) -> list[dict]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logged: list[dict] = []
    kit = GradKit(model, optimizer, warning, log_every_n_steps=every, log_dir=False, log=lambda m, s: logged.append(m))
    for _ in range(steps):
        x = torch.randint(256, (4, 16))
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        kit.note_loss(loss)
        kit.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    return logged


def test_attention_logit_max_of_a_model_equals_the_logits_by_hand() -> None:
    model = _tiny()
    reference = _Attention()
    for i, block in enumerate(model.blocks):
        block.attn.register_forward_hook(reference.hook(f"blocks.{i}.attn"))
    warning = EarlyWarning(adam=False, update_spread=False, spike_score=False, sdpa_queries=64)
    logged = _run(model, warning, steps=1)
    assert warning.attention_modules == ["blocks.0.attn", "blocks.1.attn"]
    for name, value in reference.values.items():
        assert logged[0][f"signals/attn_logit_max/{name}"] == pytest.approx(float(value), rel=1e-5)
    assert "16 of 16 query positions" in warning.sampled["blocks.0.attn"]


class _SoftmaxAttention(nn.Module):
    """nanoGPT's explicit attention: the logits are materialized and go through ``F.softmax``."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.qk = nn.Linear(width, 2 * width)
        self.seen: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        q, k = self.qk(x).chunk(2, dim=-1)
        logits = (q.unsqueeze(1) @ k.unsqueeze(1).transpose(-1, -2)) / math.sqrt(q.shape[-1])
        logits = logits.masked_fill(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1), -math.inf)
        self.seen.append(logits.detach())
        return (F.softmax(logits, dim=-1) @ x.unsqueeze(1)).squeeze(1)


def test_a_softmax_attention_is_read_whole_over_every_micro_batch_forward() -> None:
    model = nn.Sequential(_SoftmaxAttention(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    logged: list[dict] = []
    warning = EarlyWarning(attention=["_SoftmaxAttention"], adam=False, update_spread=False, spike_score=False)
    kit = GradKit(model, optimizer, warning, log_every_n_steps=1, log_dir=False, log=lambda m, s: logged.append(m))
    for _ in range(3):  # three micro-batches in one optimizer step
        model(torch.randn(2, 5, 8)).sum().backward()
    kit.step(optimizer)
    expected = max(float(t.max()) for t in model[0].seen)
    assert logged[0]["signals/attn_logit_max/0"] == pytest.approx(expected, rel=1e-6)
    assert warning.sampled == {"0": "softmax input: every logit"}


def test_output_log_z_equals_logsumexp_of_the_logits() -> None:
    model = _tiny()
    outputs: list[Tensor] = []
    model.lm_head.register_forward_hook(lambda m, a, out: outputs.append(out.detach()))
    warning = EarlyWarning(output="lm_head", attention=None, adam=False, update_spread=False, spike_score=False)
    logged = _run(model, warning, steps=1)
    lse = torch.logsumexp(outputs[0], dim=-1)
    assert logged[0]["signals/logz_mean"] == pytest.approx(float(lse.mean()), rel=1e-5)
    assert logged[0]["signals/logz_max"] == pytest.approx(float(lse.max()), rel=1e-6)


def test_adam_g2_over_v_per_module_equals_the_optimizer_state_by_hand() -> None:
    model = _tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    logged: list[dict] = []
    theta = 2.0  # low enough that some coordinates count
    warning = EarlyWarning(attention=None, update_spread=False, spike_score=False, theta=theta)
    steps = MIN_MOMENT_STEPS + 1  # the first step whose second moments average enough steps to be measured
    kit = GradKit(model, optimizer, warning, log_every_n_steps=steps, log_dir=False, log=lambda m, s: logged.append(m))
    reference: dict[str, tuple[float, float]] = {}
    unseen = 0
    for step in range(steps):
        x = torch.randint(256, (4, 16))
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        if step == steps - 1:  # the logging step: v before the optimizer's step, the gradient it steps with
            rows: dict[str, list[float]] = {}
            for name, p in model.named_parameters():
                state = optimizer.state[p]
                v_hat = state["exp_avg_sq"] / (1 - 0.95 ** float(state["step"]))
                seen = v_hat > 0  # an embedding row no batch has used yet is left out
                unseen += int((~seen).sum())
                row = name.split(".")[0] if not name.startswith("blocks") else ".".join(name.split(".")[:2])
                sums = rows.setdefault(row, [0.0, 0.0, 0.0, 0.0])
                sums[0] += float(p.grad.square()[seen].sum())
                sums[1] += float(v_hat.sum())
                sums[2] += float((p.grad.square() > theta * v_hat)[seen].sum())
                sums[3] += int(seen.sum())
            reference = {row: (g2 / v, count / n) for row, (g2, v, count, n) in rows.items()}
        kit.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    (values,) = logged
    assert set(reference) == {"wte", "wpe", "blocks.0", "blocks.1", "ln_f", "lm_head"}
    for row, (ratio, fraction) in reference.items():
        assert values[f"signals/adam_g2_v/{row}"] == pytest.approx(ratio, rel=1e-4)
        assert values[f"signals/adam_spike_frac/{row}"] == pytest.approx(fraction, abs=1e-7)
    assert any(values[f"signals/adam_spike_frac/{row}"] > 0 for row in reference)
    assert unseen > 0  # the case of a coordinate whose v is still 0 is exercised


def test_adam_signals_wait_for_second_moments_of_enough_steps() -> None:
    # After one step g^2/v_hat is the ratio of two gradient samples: ~1% of Gaussian coordinates exceed 5000, so the
    # spike fraction would read 0.01 on any healthy run at step 1. Nothing is measured before MIN_MOMENT_STEPS.
    model = _tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logged: list[tuple[int, dict]] = []
    warning = EarlyWarning(attention=None, update_spread=False, spike_score=False)
    kit = GradKit(model, optimizer, warning, log_every_n_steps=1, log_dir=False, log=lambda m, s: logged.append((s, m)))
    for _ in range(MIN_MOMENT_STEPS + 2):
        x = torch.randint(256, (4, 16))
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        kit.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    measured = [step for step, metrics in logged if any("adam_spike_frac" in k for k in metrics)]
    # From the step (0-based) whose optimizer state holds MIN_MOMENT_STEPS steps before it on.
    assert measured == [MIN_MOMENT_STEPS, MIN_MOMENT_STEPS + 1]


def test_adam_ratio_sums_skip_an_optimizer_without_a_second_moment() -> None:
    w = nn.Parameter(torch.ones(3))
    sgd = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    w.grad = torch.ones(3)
    sgd.step()
    assert adam_ratio_sums([w.grad], sgd, [w], None, 5000.0) is None


def test_update_ratio_spread_equals_the_ratios_of_parameter_copies() -> None:
    model = _tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logged: list[dict] = []
    warning = EarlyWarning(attention=None, adam=False, spike_score=False)
    kit = GradKit(model, optimizer, warning, log_every_n_steps=2, log_dir=False, log=lambda m, s: logged.append(m))
    for _ in range(2):
        x = torch.randint(256, (4, 16))
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        kit.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    rows: dict[str, list[float]] = {}
    for name, p in model.named_parameters():
        row = name.split(".")[0] if not name.startswith("blocks") else ".".join(name.split(".")[:2])
        sums = rows.setdefault(row, [0.0, 0.0])
        sums[0] += float((p.detach() - before[name]).square().sum())
        sums[1] += float(before[name].square().sum())
    ratios = [math.sqrt(update / weight) for update, weight in rows.values()]
    assert logged[0]["signals/update_ratio_spread"] == pytest.approx(max(ratios) / statistics.median(ratios), rel=1e-4)


def _olmo_spike_score(losses: list[float], norms: list[float], window: int = 128, k: float = 6.0) -> float:
    """OLMo-core's StabilityMonitorCallback, written out: a step spikes when its loss or its norm lies above
    mean + k * (population) sd of the previous ``window`` values of that series."""
    spikes = 0
    for t in range(len(losses)):
        spiked = False
        for series in (losses, norms):
            history = series[max(0, t - window) : t]
            if len(history) == window and statistics.pstdev(history) >= 1e-10:
                spiked |= series[t] > statistics.fmean(history) + k * statistics.pstdev(history)
        spikes += spiked
    return spikes / len(losses)


def test_spike_score_equals_olmos_rule_written_out() -> None:
    gen = torch.Generator().manual_seed(0)
    losses = (2 + 0.01 * torch.randn(400, generator=gen)).tolist()
    norms = (1 + 0.01 * torch.randn(400, generator=gen)).tolist()
    for t in (150, 200, 201, 330):
        losses[t] += 1.0
    norms[260] += 1.0
    score = SpikeScore(window=128)
    for loss, norm in zip(losses, norms, strict=True):
        score.add(loss, norm)
    assert score.spikes == 5
    assert score.total == pytest.approx(_olmo_spike_score(losses, norms))


def test_spike_score_of_the_loop_reads_every_steps_loss_and_norm() -> None:
    """The values kept by reference between logging steps reach the SpikeScore in order: one spike injected into the
    loss shows in the score read at the next logging step."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    warning = EarlyWarning(attention=None, adam=False, update_spread=False)
    warning._signals.spike_score = SpikeScore(window=8)
    logged: list[dict] = []
    kit = GradKit(model, optimizer, warning, log_every_n_steps=5, log_dir=False, log=lambda m, s: logged.append(m))
    for step in range(20):
        loss = model(torch.ones(2, 4)).square().mean() + (50.0 if step == 12 else 0.0)
        loss.backward()
        kit.note_loss(loss)
        kit.step(optimizer)
        optimizer.zero_grad()
    assert [row["signals/spike_score_total"] for row in logged] == [0.0, 0.0, 1 / 15, 1 / 20]


def _door_step_cost(warning: bool, logging_every: int) -> tuple[Counter[str], int, int, int]:
    """The aten operations, kernel launches, bytes and host syncs of the 6th of 6 loop-door steps of a TinyGPT."""
    model = _tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    policies = [EarlyWarning(output="lm_head")] if warning else []
    kit = GradKit(model, optimizer, policies, log_every_n_steps=logging_every, log_dir=False, log=lambda m, s: None)
    x = torch.randint(256, (2, 16))
    for _ in range(6):
        counter = OpCounter()
        with count_syncs() as sync_counter, sync_counter.active(), counter:
            loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
            loss.backward()
            kit.note_loss(loss)
            kit.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
    return counter.ops, counter.launches, counter.bytes, sync_counter.total


def test_a_step_that_does_not_log_costs_no_launch_no_byte_and_no_sync() -> None:
    """Against the same loop without EarlyWarning: the only operation added is the ``detach`` (a view: no kernel,
    no allocation) that keeps the step's loss for the SpikeScore."""
    bare_ops, bare_launches, bare_bytes, bare_syncs = _door_step_cost(False, 50)
    ops, launches, nbytes, syncs = _door_step_cost(True, 50)
    assert (launches, nbytes, syncs) == (bare_launches, bare_bytes, bare_syncs)
    assert ops - bare_ops == Counter({"detach": 1})


def test_a_logging_step_does_the_measuring() -> None:
    """The reference for the test above: on a logging step the same counter sees the signals' work."""
    bare_ops, bare_launches, _, _ = _door_step_cost(False, 1)
    ops, launches, _, _ = _door_step_cost(True, 1)
    assert launches > bare_launches + 20
    assert ops["logsumexp"] == 1 and ops["_foreach_norm"] > bare_ops["_foreach_norm"]
