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


def test_trainer_and_loop_door_rescale_to_the_same_weights(tmp_path: Path) -> None:
    from lightning_gradkit import QKClip as QKClipCallback
    from lightning_gradkit.demos import TinyGPTModule

    torch.manual_seed(0)
    module = TinyGPTModule(n_layer=2, n_head=2, n_embd=16, block_size=8, lr=0.05)
    twin = copy.deepcopy(module)
    batches = _tiny_gpt_batches()
    callback = QKClipCallback(threshold=0.2)
    trainer = make_trainer(tmp_path, callbacks=[callback], max_steps=3, logger=False)
    data = TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    trainer.fit(module, DataLoader(data, batch_size=4))

    optimizer = twin.configure_optimizers()
    clip = QKClip(threshold=0.2)
    with GradKit(twin, optimizer, clip, log_dir=False) as kit:
        for batch in batches:
            twin.training_step(batch, 0).backward()
            kit.step(optimizer)
            optimizer.zero_grad()
    assert callback.attention_modules == clip.attention_modules == ["model.blocks.0.attn", "model.blocks.1.attn"]
    assert clip.clipped_heads > 0
    for (name, expected), actual in zip(twin.state_dict().items(), module.state_dict().values(), strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=name)


# -- refusals --------------------------------------------------------------------------------------------------------
class NeoXStyleAttention(nn.Module):
    """An interleaved fused projection under a name QKClip does not read."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = 2
        self.query_key_value = nn.Linear(8, 24)

    def forward(self, x: Tensor) -> Tensor:
        return self.query_key_value(x)


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
        (NeoXStyleAttention(), "holds no query and key projections gradkit knows"),
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
