"""Small versions of the architectures users train, with the details that break gradient tools.

- :class:`ResNet18Like`: torchvision/timm's ResNet-18 layout (stem, four stages of two ``BasicBlock``s, a
  ``downsample`` branch where the shape changes) with ``ReLU(inplace=True)`` everywhere and the last BatchNorm of
  every block zero-initialised (``zero_init_residual``), at a width that trains in milliseconds on a CPU.
- :class:`TiedTransformerLM`: a pre-LayerNorm GPT with the output head tied to the token embedding.
- :class:`TinyViT`: a patch-embedding ViT whose ``cls_token`` and ``pos_embed`` are parameters of the root module.

:class:`ArchModule` wraps any of them in a LightningModule. Nothing here depends on timm or transformers.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


class BasicBlock(nn.Module):
    """torchvision's ``BasicBlock``: conv-bn-relu-conv-bn, plus the identity or a 1x1 ``downsample``."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        nn.init.zeros_(self.bn2.weight)  # zero_init_residual: each block starts as the identity
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet18Like(nn.Module):
    """ResNet-18's layout (2-2-2-2 ``BasicBlock``s, in-place ReLU, zero-init last BN) at width ``width``."""

    def __init__(self, num_classes: int = 10, width: int = 4, in_chans: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_chans, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        widths = [width, 2 * width, 4 * width, 8 * width]
        layers = []
        inplanes = width
        for i, planes in enumerate(widths):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(BasicBlock(inplanes, planes, stride), BasicBlock(planes, planes)))
            inplanes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class Block(nn.Module):
    """A pre-LN transformer block (nanoGPT's): ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, dim: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.causal = causal

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln_1(x)
        mask = None
        if self.causal:
            t = x.shape[1]
            mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class TiedTransformerLM(nn.Module):
    """A pre-LN GPT whose ``lm_head`` weight IS ``wte``'s (one parameter, two uses)."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2, layers: int = 2, block_size: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block_size, dim)
        self.blocks = nn.ModuleList([Block(dim, heads, causal=True) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class TinyViT(nn.Module):
    """A ViT: conv patch embedding, a ``cls_token`` and ``pos_embed`` on the ROOT module, pre-LN blocks."""

    def __init__(
        self, num_classes: int = 10, image: int = 8, patch: int = 4, dim: int = 16, layers: int = 2, in_chans: int = 3
    ) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(in_chans, dim, patch, patch)
        num_patches = (image // patch) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, 2, causal=False) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class ArchModule(pl.LightningModule):
    """Trains one of the models above with SGD: cross-entropy over classes (images) or next tokens (LM).

    Args:
        model: the network.
        lr: SGD learning rate.
        optimizer: ``"sgd"``, ``"adam"`` or ``"adam_fused"`` (``Adam(fused=True)``, which takes ``found_inf``).
    """

    def __init__(self, model: nn.Module, lr: float = 0.05, optimizer: str = "sgd") -> None:
        super().__init__()
        self.model = model
        self.lr = lr
        self.optimizer_name = optimizer

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = self.model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._loss(batch)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer_name.startswith("adam"):
            return torch.optim.Adam(self.parameters(), lr=self.lr, fused=self.optimizer_name == "adam_fused")
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def image_data(n: int = 32, image: int = 8, num_classes: int = 10, seed: int = 0) -> TensorDataset:
    """Random images and labels, the same for a given seed."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, image, image, generator=g), torch.randint(0, num_classes, (n,), generator=g))


def token_data(n: int = 32, block_size: int = 8, vocab: int = 32, seed: int = 0) -> TensorDataset:
    """Random token sequences and their next-token targets."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, vocab, (n, block_size + 1), generator=g)
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def data_loader(dataset: TensorDataset, batch_size: int = 8) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)
