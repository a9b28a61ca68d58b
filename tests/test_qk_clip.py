"""QKClip rescales the query and key weights of the heads whose largest logit went over the threshold, by the MuonClip
rule: checked against the logits and the rule computed by hand (plain torch, from the module's own weights), on a
user-written attention (eager softmax and SDPA, grouped-query), ``nn.MultiheadAttention``, Hugging Face GPT-2, BERT
and Llama (eager and SDPA; rotary embeddings), behind the loop door and the Trainer."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from gradkit import GradKit, QKClip
from helpers import count_syncs, make_trainer

transformers = pytest.importorskip("transformers")


# -- the references: logits by hand, the rule by hand ----------------------------------------------------------------
def causal_logits(q: Tensor, k: Tensor, scale: float, causal: bool = True) -> Tensor:
    """``(B, H, L, L)`` logits of per-head ``q``, ``k`` (key heads repeated per query group), future keys at -inf."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = (q.double() @ k.double().transpose(-1, -2)) * scale
    length = q.shape[-2]
    if not causal:
        return logits
    return logits.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), -math.inf)


def head_max(logits: Tensor) -> Tensor:
    return logits.transpose(0, 1).flatten(1).amax(1)


def hand_factors(maxima: Tensor, tau: float, kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """MuonClip's rule: ``gamma`` per query head, the query and key head scales (grouped-query as documented)."""
    gamma = torch.tensor([tau / m if m > tau else 1.0 for m in maxima.tolist()], dtype=torch.float64)
    group = gamma.view(kv_heads, -1)
    key = torch.tensor([math.sqrt(min(row)) for row in group.tolist()], dtype=torch.float64)
    query = torch.tensor([g / key[i // group.shape[1]] for i, g in enumerate(gamma.tolist())], dtype=torch.float64)
    return gamma, query, key


def scaled_rows(t: Tensor, per_head: Tensor, head_dim: int, start: int = 0, dim: int = 0) -> Tensor:
    """``t`` with rows ``start + h * head_dim ...`` (along ``dim``) multiplied by ``per_head[h]``, row by row."""
    out = t.detach().clone().double()
    for h, s in enumerate(per_head.tolist()):
        rows = out.narrow(dim, start + h * head_dim, head_dim)
        rows *= s
    return out.to(t.dtype)


def threshold_between(maxima: Tensor) -> float:
    """A threshold that some heads exceed and some do not."""
    ordered = maxima.sort().values
    middle = len(ordered) // 2
    return float((ordered[middle - 1] + ordered[middle]) / 2)


def check_logits(before: Tensor, after: Tensor, gamma: Tensor, tau: float) -> None:
    """Each head's logits scaled by exactly its gamma; a clipped head's largest logit is now tau."""
    finite = torch.isfinite(before)
    expected = torch.where(finite, before * gamma[None, :, None, None], before)
    torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-5)
    clipped = gamma < 1
    assert clipped.any() and (~clipped).any()
    torch.testing.assert_close(
        head_max(after)[clipped], torch.full((int(clipped.sum()),), tau, dtype=after.dtype), rtol=1e-5, atol=0
    )  # to fp32 rounding


def one_step(model: nn.Module, clip: QKClip, loss: Callable[[], Tensor], lr: float = 0.0) -> None:
    """A step behind the loop door (``lr=0``: the weights change only by the rescale)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    with GradKit(model, optimizer, clip, log_dir=False) as kit:
        loss().backward()
        kit.step(optimizer)


# -- a user-written attention ----------------------------------------------------------------------------------------
class UserAttention(nn.Module):
    """Llama-style projections, grouped-query (4 query heads, 2 key heads), eager softmax or SDPA."""

    def __init__(self, width: int = 16, heads: int = 4, kv_heads: int = 2, sdpa: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, width // heads
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, kv_heads * self.head_dim)
        self.v_proj = nn.Linear(width, kv_heads * self.head_dim)
        self.o_proj = nn.Linear(width, width)
        self.sdpa = sdpa

    def qk(self, x: Tensor) -> tuple[Tensor, Tensor]:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        return q, k

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k = self.qk(x)
        v = self.v_proj(x).view(b, t, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            groups = self.num_heads // self.num_key_value_heads
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            y = torch.softmax(scores, dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, t, c))


@pytest.mark.parametrize("sdpa", [False, True], ids=["eager", "sdpa"])
def test_user_attention_heads_over_the_threshold_are_rescaled_by_the_muonclip_rule(sdpa: bool) -> None:
    torch.manual_seed(0)
    model = UserAttention(sdpa=sdpa)
    x = torch.randn(2, 6, 16) * 3

    def logits() -> Tensor:
        with torch.no_grad():
            return causal_logits(*model.qk(x), 1 / math.sqrt(model.head_dim))

    before = logits()
    tau = threshold_between(head_max(before))
    gamma, query, key = hand_factors(head_max(before), tau, kv_heads=2)
    expected = {
        "q_proj.weight": scaled_rows(model.q_proj.weight, query, 4),
        "q_proj.bias": scaled_rows(model.q_proj.bias, query, 4),
        "k_proj.weight": scaled_rows(model.k_proj.weight, key, 4),
        "k_proj.bias": scaled_rows(model.k_proj.bias, key, 4),
    }
    untouched = {k: v.clone() for k, v in model.state_dict().items() if k not in expected}
    clip = QKClip(threshold=tau, attention=["UserAttention"])
    one_step(model, clip, lambda: model(x).sum())

    state = model.state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7, msg=name)
    for name, value in untouched.items():
        assert torch.equal(state[name], value), name
    check_logits(before, logits(), gamma, tau)


def test_a_step_with_learning_rate_rescales_the_stepped_weights_by_the_maxima_of_its_forward() -> None:
    # Reference: the same step in a plain loop (SGD), then the rule by hand with the maxima of the step's forward.
    torch.manual_seed(0)
    model = UserAttention()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 6, 16) * 3
    with torch.no_grad():
        maxima = head_max(causal_logits(*model.qk(x), 0.5))
    tau = threshold_between(maxima)
    _, query, key = hand_factors(maxima, tau, kv_heads=2)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(x).pow(2).mean().backward()
    optimizer.step()
    one_step(model, QKClip(threshold=tau), lambda: model(x).pow(2).mean(), lr=0.1)
    torch.testing.assert_close(model.q_proj.weight, scaled_rows(reference.q_proj.weight, query, 4))
    torch.testing.assert_close(model.k_proj.bias, scaled_rows(reference.k_proj.bias, key, 4))
    torch.testing.assert_close(model.v_proj.weight, reference.v_proj.weight, rtol=0, atol=0)


def _blended(before: Tensor, after: Tensor, per_head: Tensor, head_dim: int) -> Tensor:
    """``before + s * (after - before)`` row by row, ``s`` the row's head's factor (the reference of
    ``scale_updates``)."""
    out = after.detach().clone().double()
    old = before.double()
    for h, factor in enumerate(per_head.tolist()):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        out[rows] = old[rows] + factor * (out[rows] - old[rows])
    return out.to(after.dtype)


def _scale_updates_reference(model: UserAttention, xs: list[Tensor], tau: float) -> tuple[Tensor, Tensor]:
    """SGD steps with momentum in a plain loop, each followed by ``scale_updates`` and the MuonClip rule by hand: every
    query and key row takes its update times the product of the factors it was rescaled by so far, then this step's
    factor (a query factor above 1, grouped-query's, leaves the product as it is). Returns the final products. Not
    AdamW: it turns the last bits of two summation orders into full-size updates of the near-zero bias gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    products = {"q": torch.ones(4, dtype=torch.float64), "k": torch.ones(2, dtype=torch.float64)}
    projections = {"q": model.q_proj, "k": model.k_proj}
    for x in xs:
        with torch.no_grad():
            maxima = head_max(causal_logits(*model.qk(x), 1 / math.sqrt(model.head_dim)))
        before = {(p, n): getattr(m, n).detach().clone() for p, m in projections.items() for n in ("weight", "bias")}
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        _, query, key = hand_factors(maxima, tau, kv_heads=2)
        factors = {"q": query, "k": key}
        with torch.no_grad():
            for (part, name), old in before.items():
                param = getattr(projections[part], name)
                param.copy_(scaled_rows(_blended(old, param, products[part], 4), factors[part], 4))
        products["q"] *= query.clamp(max=1.0)
        products["k"] *= key
    return products["q"], products["k"]


def test_scale_updates_blends_each_clipped_rows_update_by_its_product_of_factors() -> None:
    torch.manual_seed(0)
    model = UserAttention()
    reference, plain = copy.deepcopy(model), copy.deepcopy(model)
    xs = [torch.randn(2, 6, 16) * 3 for _ in range(6)]
    with torch.no_grad():
        tau = threshold_between(head_max(causal_logits(*model.qk(xs[0]), 0.5)))
    query, key = _scale_updates_reference(reference, xs, tau)
    assert (query < 1).any() and (key < 0.9).any()  # clipped, more than once: the products matter

    def run(net: UserAttention, clip: QKClip) -> None:
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        with GradKit(net, optimizer, clip, log_dir=False) as kit:
            for x in xs:
                net(x).pow(2).mean().backward()
                kit.step(optimizer)
                optimizer.zero_grad()

    clip = QKClip(threshold=tau, scale_updates=True)
    run(model, clip)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    factors = clip.state_dict()["factors"][""]
    torch.testing.assert_close(factors["query"].double(), query, rtol=1e-5, atol=0)
    torch.testing.assert_close(factors["key"].double(), key, rtol=1e-5, atol=0)
    run(plain, QKClip(threshold=tau))  # without it the query and key weights end elsewhere
    assert not torch.allclose(plain.q_proj.weight, model.q_proj.weight, rtol=1e-3, atol=1e-4)


def test_scale_updates_resumes_from_its_state_as_an_uninterrupted_run() -> None:
    torch.manual_seed(0)
    model = UserAttention()
    resumed = copy.deepcopy(model)
    xs = [torch.randn(2, 6, 16) * 3 for _ in range(6)]
    with torch.no_grad():
        tau = threshold_between(head_max(causal_logits(*model.qk(xs[0]), 0.5)))

    def steps(net: UserAttention, clip: QKClip, optimizer: torch.optim.Optimizer, batch: list[Tensor]) -> None:
        with GradKit(net, optimizer, clip, log_dir=False) as kit:
            for x in batch:
                net(x).pow(2).mean().backward()
                kit.step(optimizer)
                optimizer.zero_grad()

    steps(model, QKClip(threshold=tau, scale_updates=True), torch.optim.AdamW(model.parameters(), lr=0.05), xs)
    optimizer = torch.optim.AdamW(resumed.parameters(), lr=0.05)
    first = QKClip(threshold=tau, scale_updates=True)
    steps(resumed, first, optimizer, xs[:3])
    second = QKClip(threshold=tau, scale_updates=True)
    second.load_state_dict(copy.deepcopy(first.state_dict()))
    steps(resumed, second, optimizer, xs[3:])
    for name, value in model.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


def test_multihead_attention_heads_over_the_threshold_are_rescaled_by_the_muonclip_rule() -> None:
    torch.manual_seed(0)
    model = nn.MultiheadAttention(12, 3, batch_first=True)
    x = torch.randn(2, 5, 12) * 3
    padding = torch.tensor([[False] * 5, [False, False, False, True, True]])  # True: left out (MHA's convention)

    def logits() -> Tensor:
        with torch.no_grad():
            q, k, _ = F.linear(x, model.in_proj_weight, model.in_proj_bias).chunk(3, dim=-1)
            q, k = (z.view(2, 5, 3, 4).transpose(1, 2).double() for z in (q, k))
            out = (q @ k.transpose(-1, -2)) / 2.0
            return out.masked_fill(padding[:, None, None, :], -math.inf)

    before = logits()
    tau = threshold_between(head_max(before))
    gamma, query, key = hand_factors(head_max(before), tau, kv_heads=3)
    expected_weight = scaled_rows(scaled_rows(model.in_proj_weight, query, 4), key, 4, start=12)
    expected_bias = scaled_rows(scaled_rows(model.in_proj_bias, query, 4), key, 4, start=12)
    out_proj = model.out_proj.weight.clone()
    one_step(model, QKClip(threshold=tau), lambda: model(x, x, x, key_padding_mask=padding)[0].sum())

    torch.testing.assert_close(model.in_proj_weight, expected_weight, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(model.in_proj_bias, expected_bias, rtol=1e-6, atol=1e-7)
    assert torch.equal(model.in_proj_weight[24:], expected_weight[24:])  # value rows untouched
    assert torch.equal(model.out_proj.weight, out_proj)
    check_logits(before, logits(), gamma, tau)


# -- Hugging Face models ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_gpt2_fused_c_attn_heads_are_rescaled_by_the_muonclip_rule(implementation: str) -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=16, n_head=4, n_layer=1, n_positions=16, vocab_size=50, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0
    )
    config._attn_implementation = implementation
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(50, (2, 8))
    attention = model.transformer.h[0].attn

    def logits() -> Tensor:
        with torch.no_grad():
            hidden = model.transformer.h[0].ln_1(model.transformer.wte(ids) + model.transformer.wpe.weight[:8])
            q, k, _ = attention.c_attn(hidden).split(16, dim=2)
            q, k = (z.view(2, 8, 4, 4).transpose(1, 2) for z in (q, k))
            return causal_logits(q, k, 0.5)

    with torch.no_grad():  # logits large enough to clip
        attention.c_attn.weight[:, :32] *= 8
    before = logits()
    tau = threshold_between(head_max(before))
    gamma, query, key = hand_factors(head_max(before), tau, kv_heads=4)
    weight = attention.c_attn.weight  # Conv1D: (in, out), heads along the columns
    expected_weight = scaled_rows(scaled_rows(weight, query, 4, dim=1), key, 4, start=16, dim=1)
    expected_bias = scaled_rows(scaled_rows(attention.c_attn.bias, query, 4), key, 4, start=16)
    one_step(model, QKClip(threshold=tau), lambda: model(ids, labels=ids).loss)

    torch.testing.assert_close(attention.c_attn.weight, expected_weight, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(attention.c_attn.bias, expected_bias, rtol=1e-6, atol=1e-7)
    check_logits(before, logits(), gamma, tau)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_bert_query_and_key_heads_are_rescaled_by_the_muonclip_rule(implementation: str) -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=16,
        num_attention_heads=4,
        num_hidden_layers=1,
        intermediate_size=32,
        vocab_size=50,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    config._attn_implementation = implementation
    model = transformers.BertForMaskedLM(config)
    ids = torch.randint(50, (2, 8))
    attention = model.bert.encoder.layer[0].attention.self

    def logits() -> Tensor:
        with torch.no_grad():
            hidden = model.bert.embeddings(ids)
            q, k = (proj(hidden).view(2, 8, 4, 4).transpose(1, 2) for proj in (attention.query, attention.key))
            return causal_logits(q, k, 0.5, causal=False)

    with torch.no_grad():
        attention.query.weight *= 10
    before = logits()
    tau = threshold_between(head_max(before))
    gamma, query, key = hand_factors(head_max(before), tau, kv_heads=4)
    expected_q = scaled_rows(attention.query.weight, query, 4)
    expected_k = scaled_rows(attention.key.bias, key, 4)
    clip = QKClip(threshold=tau)
    one_step(model, clip, lambda: model(ids, labels=ids).loss)

    assert clip.attention_modules == ["bert.encoder.layer.0.attention"]
    torch.testing.assert_close(attention.query.weight, expected_q, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(attention.key.bias, expected_k, rtol=1e-6, atol=1e-7)
    check_logits(before, logits(), gamma, tau)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_llama_grouped_query_heads_with_rotary_embeddings_are_rescaled_by_the_muonclip_rule(
    implementation: str,
) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        vocab_size=50,
        max_position_embeddings=16,
    )
    config._attn_implementation = implementation
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(50, (2, 8))
    layer = model.model.layers[0]

    def logits() -> Tensor:  # by hand, with HF's rotary embedding as the reference applies it
        with torch.no_grad():
            hidden = layer.input_layernorm(model.model.embed_tokens(ids))
            cos, sin = model.model.rotary_emb(hidden, torch.arange(8)[None])
            q = layer.self_attn.q_proj(hidden).view(2, 8, 4, 4).transpose(1, 2)
            k = layer.self_attn.k_proj(hidden).view(2, 8, 2, 4).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            return causal_logits(q, k, 0.5)

    with torch.no_grad():
        layer.self_attn.q_proj.weight *= 10
        layer.self_attn.k_proj.weight *= 10
    before = logits()
    tau = threshold_between(head_max(before))
    gamma, query, key = hand_factors(head_max(before), tau, kv_heads=2)
    expected_q = scaled_rows(layer.self_attn.q_proj.weight, query, 4)
    expected_k = scaled_rows(layer.self_attn.k_proj.weight, key, 4)
    one_step(model, QKClip(threshold=tau), lambda: model(ids, labels=ids).loss)

    torch.testing.assert_close(layer.self_attn.q_proj.weight, expected_q, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(layer.self_attn.k_proj.weight, expected_k, rtol=1e-6, atol=1e-7)
    check_logits(before, logits(), gamma, tau)


# -- interleaved and multi-latent layouts, FlexAttention -------------------------------------------------------------
def deepseek_v3(implementation: str) -> nn.Module:
    """A one-layer DeepSeek-V3 (multi-latent attention, 4 heads of 4 nope and 2 rotary dimensions, a dense MLP: no
    experts) whose query and key projections are 30 times their initial scale, so that its logits are large."""
    config = transformers.DeepseekV3Config(
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=1,
        first_k_dense_replace=1,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=2,
        v_head_dim=4,
        vocab_size=50,
        max_position_embeddings=16,
    )
    config._attn_implementation = implementation
    model = transformers.DeepseekV3ForCausalLM(config)
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        for name in ("q_b_proj", "kv_b_proj", "kv_a_proj_with_mqa"):
            getattr(attention, name).weight.mul_(30)
    return model


def scaled_blocks(t: Tensor, per_head: Tensor, period: int, start: int, width: int, per_block: int = 1) -> Tensor:
    """``t`` with the ``width`` rows of head ``h`` multiplied by ``per_head[h]``, row by row: blocks of ``period`` rows,
    each with ``per_block`` heads side by side from row ``start`` of the block."""
    out = t.detach().clone().double()
    for h, s in enumerate(per_head.tolist()):
        rows = out.narrow(0, (h // per_block) * period + start + (h % per_block) * width, width)
        rows *= s
    return out.to(t.dtype)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_deepseek_v3_multi_latent_heads_are_rescaled_by_kimi_k2s_mla_rule(implementation: str) -> None:
    # Reference: Kimi K2's rule for MLA by hand: per head, the nope rows of q_b_proj and kv_b_proj by sqrt(gamma), the
    # rope rows of q_b_proj by gamma, the shared rotary key (kv_a_proj_with_mqa) untouched; logits by hand.
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    torch.manual_seed(0)
    model = deepseek_v3(implementation)
    ids = torch.randint(50, (2, 8))
    layer = model.model.layers[0]
    attention = layer.self_attn

    def logits() -> Tensor:  # MLA by hand: [q nope | q rope] . [k nope of the head | the shared rotary key]
        with torch.no_grad():
            hidden = layer.input_layernorm(model.model.embed_tokens(ids))
            cos, sin = model.model.rotary_emb(hidden, torch.arange(8)[None])
            q = attention.q_b_proj(attention.q_a_layernorm(attention.q_a_proj(hidden))).view(2, 8, 4, 6).transpose(1, 2)
            latent, k_rope = attention.kv_a_proj_with_mqa(hidden).split([8, 2], dim=-1)
            k_nope = attention.kv_b_proj(attention.kv_a_layernorm(latent)).view(2, 8, 4, 8).transpose(1, 2)[..., :4]
            q_rope, k_rope = apply_rotary_pos_emb_interleave(q[..., 4:], k_rope.view(2, 1, 8, 2), cos, sin)
            k = torch.cat([k_nope, k_rope.expand(2, 4, 8, 2)], dim=-1)
            return causal_logits(torch.cat([q[..., :4], q_rope], dim=-1), k, 6**-0.5)

    before = logits()
    tau = threshold_between(head_max(before))
    gamma, root, _ = hand_factors(head_max(before), tau, kv_heads=4)
    q_b = attention.q_b_proj.weight
    expected = {
        "q_b_proj.weight": scaled_blocks(scaled_blocks(q_b, root, 6, 0, 4), gamma, 6, 4, 2),
        "kv_b_proj.weight": scaled_blocks(attention.kv_b_proj.weight, root, 8, 0, 4),
    }
    untouched = {k: v.clone() for k, v in attention.state_dict().items() if k not in expected}
    one_step(model, QKClip(threshold=tau), lambda: model(ids, labels=ids).loss)

    state = attention.state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7, msg=name)
    assert "kv_a_proj_with_mqa.weight" in untouched
    for name, value in untouched.items():
        assert torch.equal(state[name], value), name
    check_logits(before, logits(), gamma, tau)


def test_scale_updates_blends_multi_latent_rows_by_their_own_products() -> None:
    # Reference, by hand: step 2's update (plain SGD's, -lr * grad at the weights after step 1, from a copy) times
    # each row's product after step 1 (the nope query and key rows by their heads' products, the rotary query rows by
    # theirs), then step 2's own rescale (the ratio of the products); the rotary products are the nope ones squared
    # (Kimi K2's MLA rule: gamma against sqrt(gamma)).
    torch.manual_seed(0)
    model = deepseek_v3("eager").train()
    attention = model.model.layers[0].self_attn
    ids = [torch.randint(50, (2, 8)) for _ in range(2)]
    lr, key = 0.01, "model.layers.0.self_attn"
    clip = QKClip(threshold=5.0, scale_updates=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    with GradKit(model, optimizer, clip, log_dir=False) as kit:
        model(ids[0], labels=ids[0]).loss.backward()
        kit.step(optimizer)
        optimizer.zero_grad()
        first = copy.deepcopy(model)
        products = {part: value.clone() for part, value in clip.state_dict()["factors"][key].items()}
        first(ids[1], labels=ids[1]).loss.backward()
        model(ids[1], labels=ids[1]).loss.backward()
        kit.step(optimizer)
    after = clip.state_dict()["factors"][key]
    assert set(products) == {"query", "key", "rope"} and (products["query"] < 0.9).any()
    torch.testing.assert_close(after["rope"], after["query"] ** 2, rtol=1e-6, atol=0)
    step = {part: after[part] / products[part] for part in products}
    reference = first.model.layers[0].self_attn
    q_b, kv_b = reference.q_b_proj.weight, reference.kv_b_proj.weight
    update = scaled_blocks(scaled_blocks(-lr * q_b.grad, products["query"], 6, 0, 4), products["rope"], 6, 4, 2)
    expected = scaled_blocks(scaled_blocks(q_b + update, step["query"], 6, 0, 4), step["rope"], 6, 4, 2)
    torch.testing.assert_close(attention.q_b_proj.weight, expected, rtol=1e-6, atol=1e-6)
    update = scaled_blocks(-lr * kv_b.grad, products["key"], 8, 0, 4)  # the value rows take the whole update
    torch.testing.assert_close(attention.kv_b_proj.weight, scaled_blocks(kv_b + update, step["key"], 8, 0, 4))
    shared = reference.kv_a_proj_with_mqa.weight  # the rotary key every head shares: plain SGD, never rescaled
    torch.testing.assert_close(attention.kv_a_proj_with_mqa.weight, shared - lr * shared.grad, rtol=0, atol=1e-7)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_gpt_neox_interleaved_query_key_value_heads_are_rescaled_by_the_muonclip_rule(implementation: str) -> None:
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(
        hidden_size=16,
        num_attention_heads=4,
        num_hidden_layers=1,
        intermediate_size=32,
        vocab_size=50,
        max_position_embeddings=16,
        rotary_pct=0.5,
    )
    config._attn_implementation = implementation
    model = transformers.GPTNeoXForCausalLM(config)
    ids = torch.randint(50, (2, 8))
    layer = model.gpt_neox.layers[0]
    fused = layer.attention.query_key_value  # per head [q | k | v], 4 rows each

    def logits() -> Tensor:
        with torch.no_grad():
            hidden = layer.input_layernorm(model.gpt_neox.embed_in(ids))
            cos, sin = model.gpt_neox.rotary_emb(hidden, torch.arange(8)[None])
            q, k, _ = fused(hidden).view(2, 8, 4, 12).transpose(1, 2).chunk(3, dim=-1)
            return causal_logits(*apply_rotary_pos_emb(q, k, cos, sin), 0.5)

    with torch.no_grad():
        fused.weight *= 10
    before = logits()
    tau = threshold_between(head_max(before))
    gamma, query, key = hand_factors(head_max(before), tau, kv_heads=4)
    expected = {
        name: scaled_blocks(scaled_blocks(t, query, 12, 0, 4), key, 12, 4, 4)
        for name, t in (("weight", fused.weight), ("bias", fused.bias))
    }
    one_step(model, QKClip(threshold=tau), lambda: model(ids, labels=ids).loss)

    for name, value in expected.items():
        torch.testing.assert_close(getattr(fused, name), value, rtol=1e-6, atol=1e-7, msg=name)
        assert torch.equal(getattr(fused, name).view(4, 12, -1)[:, 8:], value.view(4, 12, -1)[:, 8:])  # values
    check_logits(before, logits(), gamma, tau)


@pytest.mark.parametrize("layout", ["grouped", "multi_query"])
def test_falcon_query_key_value_grouped_per_key_head_is_rescaled_by_the_muonclip_rule(layout: str) -> None:
    # Falcon's fused rows per key head: [its query heads | key | value] (2 key heads of 2 query heads; or 1 of 4).
    from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

    torch.manual_seed(0)
    kv_heads = 2 if layout == "grouped" else 1
    config = transformers.FalconConfig(
        hidden_size=16,
        num_attention_heads=4,
        num_hidden_layers=1,
        vocab_size=50,
        new_decoder_architecture=layout == "grouped",
        multi_query=layout == "multi_query",
        num_kv_heads=kv_heads,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    config._attn_implementation = "eager"
    model = transformers.FalconForCausalLM(config)
    ids = torch.randint(50, (2, 8))
    attention = model.transformer.h[0].self_attention
    seen: dict[str, object] = {}
    attention.register_forward_pre_hook(lambda m, a, k: seen.update(args=a, kwargs=k), with_kwargs=True)
    group = 4 // kv_heads

    def logits() -> Tensor:  # from the attention's input as the model gives it, by hand
        with torch.no_grad():
            model(ids)
            hidden = seen["args"][0] if seen["args"] else seen["kwargs"]["hidden_states"]  # type: ignore[index]
            cos, sin = seen["kwargs"]["position_embeddings"]  # type: ignore[index]
            qkv = attention.query_key_value(hidden).view(2, 8, kv_heads, group + 2, 4)
            q = qkv[..., :group, :].flatten(2, 3).transpose(1, 2)
            k = qkv[..., group, :].transpose(1, 2)
            return causal_logits(*apply_rotary_pos_emb(q, k, cos, sin), 0.5)

    with torch.no_grad():
        attention.query_key_value.weight *= 10
    before = logits()
    tau = threshold_between(head_max(before))
    gamma, query, key = hand_factors(head_max(before), tau, kv_heads=kv_heads)
    period = (group + 2) * 4
    weight = attention.query_key_value.weight
    expected = scaled_blocks(scaled_blocks(weight, query, period, 0, 4, group), key, period, group * 4, 4)
    one_step(model, QKClip(threshold=tau), lambda: model(ids, labels=ids).loss)

    torch.testing.assert_close(attention.query_key_value.weight, expected, rtol=1e-6, atol=1e-7)
    check_logits(before, logits(), gamma, tau)


class UserFlexAttention(UserAttention):
    """UserAttention's projections through FlexAttention with a causal block mask. FlexAttention on the CPU has no
    backward: it attends over detached q, k, v here (only ``o_proj`` learns); its logits are what QKClip reads."""

    def forward(self, x: Tensor) -> Tensor:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        b, t, c = x.shape
        q, k = self.qk(x)
        v = self.v_proj(x).view(b, t, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, t, t, device=x.device)
        y = flex_attention(q.detach(), k.detach(), v.detach(), block_mask=mask, enable_gqa=True)
        assert isinstance(y, Tensor)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, c))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")
def test_flex_attention_heads_are_rescaled_by_the_muonclip_rule_from_its_max_scores() -> None:
    torch.manual_seed(0)
    model = UserFlexAttention()
    x = torch.randn(2, 6, 16) * 3

    def logits() -> Tensor:
        with torch.no_grad():
            return causal_logits(*model.qk(x), 0.5)

    before = logits()
    tau = threshold_between(head_max(before))
    gamma, query, key = hand_factors(head_max(before), tau, kv_heads=2)
    expected = {
        "q_proj.weight": scaled_rows(model.q_proj.weight, query, 4),
        "k_proj.bias": scaled_rows(model.k_proj.bias, key, 4),
    }
    clip = QKClip(threshold=tau, attention=["UserFlexAttention"])
    one_step(model, clip, lambda: model(x).sum())

    for name, value in expected.items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-6, atol=1e-7, msg=name)
    check_logits(before, logits(), gamma, tau)


# -- the hot path, the doors -----------------------------------------------------------------------------------------
def test_no_host_sync_off_logging_steps_and_one_read_on_them() -> None:
    torch.manual_seed(0)
    model = UserAttention(sdpa=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    logged: list[dict[str, float]] = []
    clip = QKClip(threshold=1.0)
    kit = GradKit(model, optimizer, clip, log_every_n_steps=3, log_dir=False, log=lambda m, s: logged.append(m))
    x = torch.randn(2, 6, 16) * 3
    with count_syncs() as counter:
        for step in range(3):
            with counter.active():
                model(x).pow(2).mean().backward()
                kit.step(optimizer)
                optimizer.zero_grad()
            assert counter.total == (0 if step < 2 else 1), (step, counter.counts)  # the logging step's one read
    kit.close()
    assert len(logged) == 1 and logged[0]["qk_clip/max_logit"] > 1.0 and logged[0]["qk_clip/clipped_heads"] >= 1


def _tiny_gpt_batches() -> list[tuple[Tensor, Tensor]]:
    ids = torch.randint(256, (12, 9), generator=torch.Generator().manual_seed(0))
    return [(ids[i : i + 4, :-1], ids[i : i + 4, 1:]) for i in range(0, 12, 4)]


@pytest.mark.parametrize("scale_updates", [False, True], ids=["rule", "scale_updates"])
def test_trainer_and_loop_door_rescale_to_the_same_weights(tmp_path: Path, scale_updates: bool) -> None:
    from lightning_gradkit import QKClip as QKClipCallback
    from lightning_gradkit.demos import TinyGPTModule

    torch.manual_seed(0)
    module = TinyGPTModule(n_layer=2, n_head=2, n_embd=16, block_size=8, lr=0.05)
    twin = copy.deepcopy(module)
    batches = _tiny_gpt_batches()
    callback = QKClipCallback(threshold=0.2, scale_updates=scale_updates)
    trainer = make_trainer(tmp_path, callbacks=[callback], max_steps=3, logger=False)
    data = TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    trainer.fit(module, DataLoader(data, batch_size=4))

    optimizer = twin.configure_optimizers()
    clip = QKClip(threshold=0.2, scale_updates=scale_updates)
    with GradKit(twin, optimizer, clip, log_dir=False) as kit:
        for batch in batches:
            twin.training_step(batch, 0).backward()
            kit.step(optimizer)
            optimizer.zero_grad()
    assert callback.attention_modules == clip.attention_modules == ["model.blocks.0.attn", "model.blocks.1.attn"]
    assert clip.clipped_heads > 0
    for (name, expected), actual in zip(twin.state_dict().items(), module.state_dict().values(), strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=name)
    products = [(n, p, t) for n, parts in clip.state_dict()["factors"].items() for p, t in parts.items()]
    assert bool(products) == scale_updates and all(t.min() < 1 for _, p, t in products if p != "rope")
    for name, part, value in products:
        assert torch.equal(callback.state_dict()["factors"][name][part], value), (name, part)


# -- refusals --------------------------------------------------------------------------------------------------------
class UnknownProjectionAttention(nn.Module):
    """A fused projection under a name QKClip does not read."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = 2
        self.in_proj = nn.Linear(8, 24)

    def forward(self, x: Tensor) -> Tensor:
        return self.in_proj(x)


class NormalizedAttention(UserAttention):
    def __init__(self) -> None:
        super().__init__()
        self.q_norm, self.k_norm = nn.LayerNorm(4), nn.LayerNorm(4)


class HiddenKernelAttention(UserAttention):
    """Computes its attention weights without ``softmax`` or SDPA (as a custom kernel would)."""

    def forward(self, x: Tensor) -> Tensor:
        q, k = self.qk(x)
        weights = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)).exp()
        return (weights / weights.sum(-1, keepdim=True)).sum()


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (UnknownProjectionAttention(), "holds no query and key projections gradkit knows"),
        (NormalizedAttention(), "normalizes its queries and keys (`q_norm`)"),
    ],
)
def test_an_attention_module_without_readable_query_and_key_weights_is_refused_with_the_reason(
    model: nn.Module, reason: str
) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="QKClip cannot rescale the heads of `the model`") as info:
        GradKit(model, optimizer, QKClip(attention=[type(model).__name__]), log_dir=False)
    assert reason in str(info.value) and "Leave it out of `attention`" in str(info.value)


def test_an_attention_whose_logits_no_forward_exposes_is_refused_at_its_first_step() -> None:
    model = HiddenKernelAttention()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kit = GradKit(model, optimizer, QKClip(), log_dir=False)
    model(torch.randn(2, 6, 16)).backward()
    with pytest.raises(RuntimeError, match="QKClip read no attention logits in ``"):
        kit.step(optimizer)
    kit.close()


def test_a_weight_placed_as_a_partial_sum_is_refused_at_attach(one_rank_group: object) -> None:
    # A partial sum (each rank a summand) has no rows to rescale: scaling one summand's rows is not the rule.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    model = UserAttention()
    mesh = init_device_mesh("cpu", (1,))
    model.q_proj.weight = nn.Parameter(DTensor.from_local(model.q_proj.weight.detach(), mesh, [Partial()]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"QKClip cannot rescale the heads of `the model`: .* partial sum") as info:
        GradKit(model, optimizer, QKClip(), log_dir=False)
    assert "`ColwiseParallel`" in str(info.value)


def test_threshold_is_checked_at_construction() -> None:
    with pytest.raises(ValueError, match="threshold"):
        QKClip(threshold=0.0)
