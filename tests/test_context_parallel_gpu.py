"""gradkit under context parallelism (torch's ``context_parallel``: ring attention over a ``cp`` mesh dimension) on 2
CUDA devices, against one process on the whole sequence.

Context parallelism shards the sequence dimension of the batch over the ``cp`` ranks and swaps SDPA for ring
attention; the parameters stay replicated over ``cp``, so each rank's gradient is that of its part of the sequence and
must be reduced over ``cp`` before the step, as torchtitan does by sharding FSDP2 over the flattened data x context
mesh (``dp_shard_cp``). Reduced so, the parameters are DTensors on a world-sized mesh (FSDP2) or plain tensors the same
on every rank (DDP over the cp group): gradkit counts them as it counts data parallelism, and adds no collective.

Why a GPU test: in torch 2.13 ``context_parallel`` does not run on CPU. Its ring attention handles only the CUDA SDPA
kernels (``aten._scaled_dot_product_{flash,efficient,cudnn}_attention``, which have no CPU kernel); on CPU SDPA takes
``aten._scaled_dot_product_flash_attention_for_cpu``, and the DTensor dispatch fails with ``NotImplementedError:
Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered.``;
under ``sdpa_kernel(SDPBackend.MATH)`` it fails with ``RuntimeError: aten.add.Tensor got mixed torch.Tensor and
DTensor`` (the causal mask is a plain tensor). The refusal of unreduced gradients does not need ring attention: on CPU
it is ``tests/test_expert_parallel_distributed.py`` (a plain parameter whose gradient differs across ranks, and FSDP2
over a data-parallel sub-mesh whose gradients differ across the other dimension) and ``tests/test_replicas.py``.

One launch (:func:`helpers.run_processes`, NCCL, rank ``r`` on ``cuda:r``) runs every case, a tiny causal
self-attention language model (token and position embeddings, one attention block, a head) under
``context_parallel(mesh["cp"], buffers=[tokens, positions, labels])`` (16 tokens: torch's head-tail load balancing is
on), behind the loop door with ``GradNormMonitor``, ``ClipGradNorm`` and ``NonFiniteGuard(action="skip")``:

- ``fsdp2``: ``fully_shard`` over the flattened (``dp``, ``cp``) mesh, torchtitan's ``dp_shard_cp``;
- ``ddp``: ``DistributedDataParallel`` over the cp group;
- ``fsdp2_dp_only``: ``fully_shard`` over the ``dp`` dimension alone (a user's mistake: nothing reduces over ``cp``),
  refused at the first step, naming the parameter and the fix.

A NaN in rank 1's gradient at step 2 skips that step on both ranks. Reference: one process on ``cuda:0``, the whole
sequence, plain SDPA, ``clip_grad_norm_``, the poisoned step left out. Tolerance: ring attention sums each query's
softmax over two key blocks merged by their log-sum-exp, and the ranks' gradients of half the sequence are averaged
where the reference takes one backward, so norms agree to ``rel=1e-4`` and parameters to ``rtol=1e-4, atol=1e-5``
(float32; TF32 is off by default for matmuls).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from clip_reference import NormRef
from helpers import run_processes

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]

VOCAB, WIDTH, HEADS, SEQ = 13, 16, 2, 16  # head dim 8: a multiple of the efficient kernel's alignment
BATCH, STEPS, LR, MAX_NORM = 2, 4, 0.1, 0.3
NAN_STEP, NAN_RANK = 2, 1
MODULES = ("tok", "pos", "attn", "head")  # the monitor's rows at depth 1


class Attention(nn.Module):
    """Causal multi-head self-attention through ``nn.functional.scaled_dot_product_attention``, looked up at call
    time: ``context_parallel`` swaps that attribute for ring attention."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: Tensor) -> Tensor:
        b, t, _ = h.shape  # t is this rank's part of the sequence under context parallelism
        q, k, v = self.qkv(h).view(b, t, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)  # 3 x [B, H, T, D]
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # the sequence is dim 2, as CP needs
        return self.out(y.transpose(1, 2).reshape(b, t, WIDTH))


class CausalLM(nn.Module):
    """``head(h + attn(h))`` with ``h = tok(tokens) + pos(positions)``: positions are an input, sharded with the
    tokens (a position table indexed by ``arange`` would give every rank the first positions)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)
        self.attn = Attention()
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: Tensor, positions: Tensor) -> Tensor:
        h = self.tok(tokens) + self.pos(positions)
        return self.head(h + self.attn(h))


def make_model() -> CausalLM:
    torch.manual_seed(0)
    return CausalLM()


def batches() -> list[tuple[Tensor, Tensor]]:
    """``STEPS`` batches of ``(tokens, labels)``, ``[BATCH, SEQ]`` each: the labels are the next tokens."""
    g = torch.Generator().manual_seed(1)
    seqs = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=g)
    return [(s[:, :-1], s[:, 1:]) for s in seqs]


def positions() -> Tensor:
    """``[BATCH, SEQ]``, contiguous: ``context_parallel`` resizes its buffers in place (an expanded view cannot)."""
    return torch.arange(SEQ).repeat(BATCH, 1)


def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
    """The mean over this rank's tokens: averaged over equal parts of the sequence, the mean over all of them."""
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def reference(device: str) -> tuple[list[dict[str, float]], dict[str, Tensor]]:
    """One process, the whole sequence: per step the total and module norms, ``clip_grad_norm_``'s coefficient and
    the post-clip total, then SGD (not at the poisoned step); the final parameters."""
    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    rows = []
    for step, (tokens, labels) in enumerate(batches()):
        opt.zero_grad()
        loss_fn(model(tokens.to(device), positions().to(device)), labels.to(device)).backward()
        if step == NAN_STEP:
            continue
        row = {
            f"grad_norm/module/{m}": torch.nn.utils.get_total_norm([p.grad for p in getattr(model, m).parameters()])
            for m in MODULES
        }
        total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        row |= {"grad_norm/total": total, "grad_clip/coef": torch.clamp(MAX_NORM / (total + 1e-6), max=1.0)}
        NormRef(MAX_NORM)(model)
        row["grad_norm/total_post_clip"] = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        rows.append({k: float(v) for k, v in row.items()})
        opt.step()
    return rows, {n: p.detach().cpu() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    return run_processes("context_parallel_script.py", tmp_path_factory.mktemp("cp"), timeout=150)


@pytest.mark.parametrize("case", ["fsdp2", "ddp"])
def test_norms_clip_skip_and_parameters_equal_one_process_on_the_whole_sequence(
    ranks: list[dict[str, Any]], case: str
) -> None:
    expected, params = reference("cuda:0")
    for rank in ranks:
        logged = [row for row in rank[case]["logged"] if "grad_norm/total" in row]
        kept = [row for step, row in enumerate(logged) if step != NAN_STEP]
        assert len(logged) == STEPS and len(kept) == len(expected)
        for got, want in zip(kept, expected, strict=True):
            for key, value in want.items():
                assert got[key] == pytest.approx(value, rel=1e-4), (case, key)
        for name, value in params.items():
            got = torch.tensor(rank[case]["params"][name]).view_as(value)
            torch.testing.assert_close(got, value, rtol=1e-4, atol=1e-5, msg=f"{case} {name}")
        assert rank[case]["skipped"] == 1
    # Every rank logs the same values: FSDP2's from the one reduced vector, DDP's from bitwise-equal reduced gradients
    # (but at the poisoned step, where rank 1's own gradient holds the NaN it was given after the reduction).
    same = [
        [row for step, row in enumerate(rank[case]["logged"]) if case == "fsdp2" or step != NAN_STEP] for rank in ranks
    ]
    assert same[0] == same[1]
    # Reduced over cp, gradkit adds no collective: the one all-reduce per step of the sharded norms (FSDP2) or of the
    # skip flags that NonFiniteGuard sums (DDP), the same as under data parallelism.
    assert ranks[0][case]["world_collectives"] == [1] * STEPS


def test_gradients_not_reduced_over_cp_are_refused_at_the_first_step_with_the_fix(ranks: list[dict[str, Any]]) -> None:
    messages = [rank["fsdp2_dp_only"]["error"] for rank in ranks]
    assert messages[0] == messages[1] and messages[0] is not None  # every rank stops alike
    assert "`tok.weight` differs between ranks" in messages[0] and "Under context parallelism" in messages[0]
    assert "mesh['dp', 'cp']._flatten('dp_shard_cp')" in messages[0]
    assert ranks[0]["fsdp2_dp_only"]["steps_done"] == 0
