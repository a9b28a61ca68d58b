"""Optional: the step-state guarantees on Hugging Face models built from config (random init, no download).

Skipped unless ``transformers`` is installed (it is not a dependency of the package or of the test venv).
References are plain PyTorch loops on the same model, data and seed.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from gradkit.step.snapshot import Snapshot
from helpers import make_trainer
from lightning_gradkit import AccumulationGuard, ActivationCheckpointing, NonFiniteGuard

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 64, 12, 4


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        use_cache=False,
    )  # fmt: skip  (a KV cache filled in the forward grows again in the checkpointed recompute)
    return transformers.GPT2LMHeadModel(config)


def bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


def batches(n: int, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """Token ids and a mask of 1..SEQ real tokens per sequence (very different token counts per batch)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(VOCAB, (BATCH, SEQ), generator=g)
        lengths = torch.randint(2, SEQ + 1, (BATCH,), generator=g)
        out.append((ids, (torch.arange(SEQ)[None, :] < lengths[:, None]).long()))
    return out


def token_loss(model: nn.Module, ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Summed next-token (GPT-2) or same-token (BERT) cross-entropy over the real tokens, and their count."""
    logits = model(input_ids=ids, attention_mask=mask).logits
    causal = isinstance(model, transformers.GPT2LMHeadModel)
    if causal:
        logits, ids, mask = logits[:, :-1], ids[:, 1:], mask[:, 1:]
    losses = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1), reduction="none")
    return (losses * mask.reshape(-1)).sum(), mask.sum()


class HFModule(pl.LightningModule):
    """SGD, not Adam: attention key biases get a gradient that is zero up to rounding, which Adam would amplify into
    full-size updates that differ between two summation orders."""

    def __init__(self, model: nn.Module, bad: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.bad = bad

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        loss_sum, n = token_loss(self.model, *batch)
        if batch_idx == self.bad:
            loss_sum = loss_sum * float("nan")
        return {"loss": loss_sum, "num_tokens": n}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def reference(make: Any, windows: list[list[int]], data: list[tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for window in windows:
        opt.zero_grad()
        parts = [token_loss(model, *data[i]) for i in window]
        (sum(p[0] for p in parts) / sum(p[1] for p in parts)).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("make", [gpt2, bert], ids=["gpt2_tied", "bert"])
def test_token_normalized_skip_with_checkpointing_equals_a_plain_loop(tmp_path: Path, make: Any) -> None:
    """Accumulation of 3 with per-token normalization, activation checkpointing (measured first batch) and a NaN
    loss in micro-batch 4 skipped with its culprit replay: the result is the plain loop without that window."""
    data = batches(9)
    torch.manual_seed(0)
    module = HFModule(make(), bad=4)
    targets = ["GPT2Block"] if make is gpt2 else ["BertLayer"]
    callbacks = [
        ActivationCheckpointing(targets=targets),
        AccumulationGuard(normalize="tokens"),
        NonFiniteGuard(action="skip"),
    ]
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=callbacks, accumulate_grad_batches=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(data, batch_size=None))
    expected = reference(make, [[0, 1, 2], [6, 7, 8]], data)
    got = module.model.state_dict()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_bert_skip_puts_back_its_constant_buffers_untouched() -> None:
    """BERT's constant buffers (position_ids, token_type_ids) are captured and put back by slot: after a skipped
    window they are the same objects with the same values."""
    model = bert()
    before = {name: (buf, buf.clone()) for name, buf in model.named_buffers()}
    assert before  # position_ids, token_type_ids
    snapshot = Snapshot(model)
    snapshot.capture()
    ids, mask = batches(1)[0]
    token_loss(model, ids, mask)[0].backward()
    snapshot.close(skipped=True)
    for name, buf in model.named_buffers():
        assert buf is before[name][0] and torch.equal(buf, before[name][1]), name
