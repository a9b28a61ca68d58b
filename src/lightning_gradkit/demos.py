"""A tiny GPT and a byte-level text dataset built from the Python standard library's source.

Used by the examples, the benchmarks and the tests; like ``lightning.pytorch.demos``, it needs no download: the
text is present on every machine that has Python.
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

_DEFAULT_MODULES = ("functools.py", "collections/__init__.py", "argparse.py", "dataclasses.py", "textwrap.py")


def stdlib_text(modules: tuple[str, ...] = _DEFAULT_MODULES, max_bytes: int | None = None) -> bytes:
    """The source of some standard-library modules, concatenated in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    data = b"\n".join((root / m).read_bytes() for m in modules)
    return data if max_bytes is None else data[:max_bytes]


class ByteDataset(Dataset):
    """Next-byte prediction windows over a byte string (vocabulary of 256).

    Args:
        data: the text.
        block_size: tokens per sample.
        stride: distance between consecutive windows (defaults to ``block_size``: no overlap).
    """

    def __init__(self, data: bytes, block_size: int = 64, stride: int | None = None) -> None:
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.block_size = block_size
        self.stride = stride or block_size
        self._len = max(0, (len(self.data) - block_size - 1) // self.stride + 1)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        start = i * self.stride
        chunk = self.data[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """A pre-norm transformer block (the unit activation checkpointing usually targets)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A nanoGPT-style decoder: ``12 * n_layer + 5`` parameter tensors."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class TinyGPTModule(pl.LightningModule):
    """A LightningModule around :class:`TinyGPT` trained on next-byte prediction.

    Args:
        n_layer, n_head, n_embd, block_size, dropout: the model size.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        fused: use ``AdamW(fused=True)`` (lets gradkit skip steps with no host sync).
    """

    def __init__(
        self,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 64,
        block_size: int = 64,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        fused: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = TinyGPT(GPTConfig(256, block_size, n_layer, n_head, n_embd, dropout))

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.loss(batch)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        h = self.hparams
        return torch.optim.AdamW(self.parameters(), lr=h.lr, weight_decay=h.weight_decay, fused=h.fused or None)
