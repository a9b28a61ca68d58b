"""Under ``torch.distributed`` (2 CPU processes, gloo): EarlyWarning decides on reduced values, so every rank logs
and warns the same; StepsToSkip drops the same steps on every rank of a ``gradkit_ddp`` Trainer, without a hang; QKClip
rescales by the maxima of every rank's batches (one all-reduce), as one process on the global batch does, under DDP,
FSDP2 (``fully_shard``: its shards rescaled row by row) and tensor parallelism (``ColwiseParallel`` query and key
projections: each rank reads the maxima of its own heads)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helpers import run_processes

pytestmark = pytest.mark.distributed

LOGGING_STEPS = (1, 3, 5)  # log_every_n_steps=2 over 6 steps


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_processes("early_warning_script.py", tmp_path_factory.mktemp("early_warning"), timeout=240)


def test_every_rank_logs_and_warns_the_same_reduced_values(ranks: list[dict[str, Any]]) -> None:
    first, second = (r["early_warning"] for r in ranks)
    assert first["logged"] == second["logged"] and len(first["logged"]) == len(LOGGING_STEPS)
    assert first["warnings"] == second["warnings"] and first["warnings"]
    for name in ("blocks.0.attn", "blocks.1.attn"):
        mine, theirs = first["local"][name], second["local"][name]
        assert mine != theirs  # each rank's own batches: the reduction is what makes the logged values equal
        expected = [max(mine[step], theirs[step]) for step in LOGGING_STEPS]
        logged = [row[f"signals/attn_logit_max/{name}"] for row in first["logged"]]
        assert logged == pytest.approx(expected, rel=1e-5)


def test_steps_to_skip_drops_the_same_steps_on_every_rank_of_a_ddp_trainer(ranks: list[dict[str, Any]]) -> None:
    first, second = (r["steps_to_skip"] for r in ranks)
    assert first["global_step"] == second["global_step"] == 6
    assert first["trained"] == second["trained"] == [0, 3, 4, 5]
    assert first["params"] == second["params"]


def test_qk_clip_rescales_every_rank_by_the_maxima_of_the_global_batch(ranks: list[dict[str, Any]]) -> None:
    # Reference: one process, the same model and steps on the concatenation of the ranks' batches (DDP's mean of the
    # ranks' mean losses is the global mean; the largest logit of the global batch is the largest of the ranks').
    from gradkit import GradKit, QKClip
    from lightning_gradkit.demos import GPTConfig, TinyGPT

    first, second = (r["qk_clip"] for r in ranks)
    assert first == second
    assert all(row["qk_clip/clipped_heads"] > 0 for row in first["logged"])
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=32))  # the script's
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with GradKit(model, optimizer, QKClip(threshold=0.2), log_dir=False) as kit:
        for step in range(3):  # the script's `qk_clip_batches(step)`, every rank's
            x = torch.randint(256, (2, 4, 16), generator=torch.Generator().manual_seed(200 + step)).flatten(0, 1)
            F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
            kit.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
    for name, param in model.named_parameters():
        torch.testing.assert_close(torch.tensor(first["params"][name]), param.detach().flatten(), msg=name)


# -- QKClip on sharded weights: a Llama-style model the script shards, the reference runs whole ----------------------
class ShardableAttention(nn.Module):
    """Llama-style attention (``q_proj``/``k_proj``/``v_proj``/``o_proj``, grouped-query) that views its heads as
    ``-1``, as tensor-parallel models do: a rank whose projections are ``ColwiseParallel`` computes its own heads."""

    def __init__(self, width: int, heads: int, kv_heads: int, sdpa: bool) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, width // heads
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, kv_heads * self.head_dim)
        self.v_proj = nn.Linear(width, kv_heads * self.head_dim)
        self.o_proj = nn.Linear(width, width, bias=False)
        self.sdpa = sdpa

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            y = torch.softmax(scores, dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class ShardableBlock(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, sdpa: bool) -> None:
        super().__init__()
        self.attn = ShardableAttention(width, heads, kv_heads, sdpa)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.attn(x)


class ShardableLM(nn.Module):
    """Two blocks, the first with eager softmax, the second with SDPA."""

    def __init__(self, width: int, heads: int, kv_heads: int, vocab: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([ShardableBlock(width, heads, kv_heads, sdpa) for sdpa in (False, True)])
        self.head = nn.Linear(width, vocab)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


#: ``fsdp2``: 24 query rows and 12 key rows split 12 / 6 per rank, so a key head's rows straddle the two shards;
#: ``tp``: 4 query heads and 2 key heads, 2 and 1 per rank.
SHARDED_CONFIGS = {"fsdp2": {"width": 24, "heads": 6, "kv_heads": 3}, "tp": {"width": 16, "heads": 4, "kv_heads": 2}}
# `scale_updates` under FSDP2 (the blend of each clipped row's update on a shard's rows); the plain rule under TP.
SHARDED_SCALE_UPDATES = {"fsdp2": True, "tp": False}
SHARDED_THRESHOLD, SHARDED_STEPS = 1.4, 3  # some heads of every step over it, some under


def sharded_batches(step: int) -> Tensor:
    """Step ``step``'s global batch, ``(ranks, 4, 12)``: under FSDP2 rank ``r`` takes element ``r``, under tensor
    parallelism every rank takes all of it (flattened)."""
    return torch.randint(64, (2, 4, 12), generator=torch.Generator().manual_seed(300 + step))


def sharded_reference(layout: str) -> tuple[dict[str, Tensor], list[dict[str, float]]]:
    """One process, the unsharded model: its parameters after the steps and what QKClip logged."""
    from gradkit import GradKit, QKClip

    torch.manual_seed(0)
    model = ShardableLM(**SHARDED_CONFIGS[layout])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    logged: list[dict[str, float]] = []
    clip = QKClip(threshold=SHARDED_THRESHOLD, scale_updates=SHARDED_SCALE_UPDATES[layout])
    with GradKit(model, optimizer, clip, log_every_n_steps=1, log_dir=False, log=lambda m, s: logged.append(m)) as kit:
        for step in range(SHARDED_STEPS):
            x = sharded_batches(step).flatten(0, 1)
            F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
            kit.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
    rows = [{k: float(v) for k, v in row.items() if k.startswith("qk_clip/")} for row in logged]
    return {n: p.detach() for n, p in model.named_parameters()}, rows


@pytest.mark.parametrize("layout", ["fsdp2", "tp"])
def test_qk_clip_rescales_sharded_weights_as_one_process_rescales_the_whole_model(
    ranks: list[dict[str, Any]], layout: str
) -> None:
    # Reference: the same model unsharded, in one process, on the global batch (FSDP2 averages the ranks' gradients:
    # the mean of their mean losses is the global mean; a tensor-parallel rank runs the global batch itself).
    params, logged = sharded_reference(layout)
    first, second = (r[f"qk_clip_{layout}"] for r in ranks)
    assert first == second  # every rank rescaled the same (their gathered weights are equal)
    assert [row["qk_clip/clipped_heads"] for row in first["logged"]] == [r["qk_clip/clipped_heads"] for r in logged]
    assert all(0 < r["qk_clip/clipped_heads"] < 2 * SHARDED_CONFIGS[layout]["heads"] for r in logged)
    for mine, theirs in zip(first["logged"], logged, strict=True):
        assert mine["qk_clip/max_logit"] == pytest.approx(theirs["qk_clip/max_logit"], rel=1e-5)
    assert set(first["params"]) == set(params)
    for name, param in params.items():  # fp32 reduction order only (the gradients' all-reduce, the sharded matmuls)
        torch.testing.assert_close(torch.tensor(first["params"][name]), param.flatten(), rtol=1e-5, atol=1e-6, msg=name)


class MHAModel(nn.Module):
    """``nn.MultiheadAttention`` (3 heads of 4) and a head: the script shards the attention module on itself."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mha = nn.MultiheadAttention(12, 3, batch_first=True)
        self.out = nn.Linear(12, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.mha(x, x, x, need_weights=False)[0])


MHA_THRESHOLD = 25.0  # 2 of the 3 heads go over it at the first step


def mha_batches() -> Tensor:
    """Two steps' global batch ``(2 steps, 4, 5, 12)``; under FSDP2 rank ``r`` takes elements ``2r, 2r + 1``."""
    return torch.randn(2, 4, 5, 12, generator=torch.Generator().manual_seed(1)) * 4


def test_qk_clip_on_multihead_attention_sharded_on_itself_rescales_as_one_process(
    ranks: list[dict[str, Any]],
) -> None:
    # FSDP2 reshards a module sharded on itself in its own post-forward hook: QKClip's hook reads the whole weights
    # before it. Reference: the unsharded model in one process on the global batch.
    from gradkit import GradKit, QKClip

    model = MHAModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    clip = QKClip(threshold=MHA_THRESHOLD, attention=["MultiheadAttention"])
    clipped = []
    with GradKit(model, optimizer, clip, log_dir=False) as kit:
        for x in mha_batches():
            model(x).pow(2).mean().backward()
            kit.step(optimizer)
            optimizer.zero_grad()
            clipped.append(clip.clipped_heads)
    assert clipped == [2, 0]  # some heads clipped, some not
    first, second = (r["qk_clip_mha"] for r in ranks)
    assert first == second and first["clipped"] == clipped
    for name, param in model.named_parameters():
        torch.testing.assert_close(torch.tensor(first["params"][name]), param.flatten(), rtol=1e-5, atol=1e-6, msg=name)


def test_the_qk_clip_callback_under_a_tensor_parallel_trainer_rescales_as_the_loop_door_on_one_process(
    ranks: list[dict[str, Any]],
) -> None:
    params, _ = sharded_reference("tp")  # the same model, steps and batches, unsharded, behind the loop door
    first, second = (r["qk_clip_trainer"] for r in ranks)
    assert first == second and set(first) == set(params)
    for name, param in params.items():
        torch.testing.assert_close(torch.tensor(first[name]), param.flatten(), rtol=1e-5, atol=1e-6, msg=name)


def test_qk_clip_refuses_a_tensor_parallel_forward_whose_query_and_key_heads_are_split_differently(
    ranks: list[dict[str, Any]],
) -> None:
    # `ColwiseParallel` on `q_proj` alone: each rank's 2 query heads meet both key heads, not their own one.
    for rank in ranks:
        message = rank["qk_clip_refused"]
        assert message.startswith("QKClip cannot read the heads of `blocks.0.attn`: its forward splits the query and")
        assert "`ColwiseParallel` on the same mesh" in message and "leave this module out of `attention`" in message
