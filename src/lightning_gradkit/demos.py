"""A tiny GPT and a byte-level text dataset built from the Python standard library's source, for the examples, the
benchmarks and the tests; like ``lightning.pytorch.demos``, it needs no download."""

from __future__ import annotations

import math
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

__all__ = [
    "MLP",
    "Block",
    "ByteDataset",
    "CausalSelfAttention",
    "FaultInjector",
    "GPTConfig",
    "LossRecorder",
    "ProgressPrinter",
    "SpikeInjector",
    "StdlibTextDataModule",
    "TinyGPT",
    "TinyGPTModule",
    "optimizer_step_count",
    "progress_line",
    "stdlib_text",
]


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


class StdlibTextDataModule(pl.LightningDataModule):
    """Next-byte prediction on standard-library source: the first 90% of the text trains, the rest validates.

    Args:
        block_size: tokens per sample (match the model's ``block_size``).
        batch_size: samples per batch.
        max_bytes: cut the text to this many bytes (small runs); ``None`` uses all of it.
    """

    def __init__(self, block_size: int = 64, batch_size: int = 16, max_bytes: int | None = 200_000) -> None:
        super().__init__()
        self.block_size = block_size
        self.batch_size = batch_size
        self.max_bytes = max_bytes

    def setup(self, stage: str) -> None:
        text = stdlib_text(max_bytes=self.max_bytes)
        cut = int(len(text) * 0.9)
        self.train_set = ByteDataset(text[:cut], self.block_size)
        self.val_set = ByteDataset(text[cut:], self.block_size)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class FaultInjector(pl.Callback):
    """Inject a non-finite value into one submodule's output at one optimizer step (for demos and tests).

    The fault stays active for the whole training batch of that step, so a replay of the batch sees it too.

    Args:
        step: the optimizer step (``trainer.global_step``) whose batch gets the fault.
        module: qualified name of the submodule whose output is poisoned (e.g. ``"model.blocks.1.mlp"``).
        value: ``"nan"`` or ``"inf"``.

    Raises:
        ValueError: if ``step`` < 0 or ``value`` is not ``"nan"``/``"inf"``.
    """

    def __init__(self, step: int, module: str = "model.blocks.1.mlp", value: Literal["nan", "inf"] = "nan") -> None:
        if step < 0:
            raise ValueError(f"`step` must be >= 0, got {step!r}.")
        if value not in ("nan", "inf"):
            raise ValueError(f"`value` must be 'nan' or 'inf', got {value!r}.")
        self.step = step
        self.module = module
        self.value = float(value)
        self._handle: torch.utils.hooks.RemovableHandle | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step and self._handle is None:
            target = pl_module.get_submodule(self.module)
            self._handle = target.register_forward_hook(lambda mod, args, out: out * self.value)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, idx: int) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class SpikeInjector(pl.Callback):
    """Multiply the learning rate by ``factor`` for ``steps`` optimizer steps from ``step``: a spike that persists.

    The updates of those steps are taken while the loss still looks normal; the loss spikes only afterwards, once
    the model is damaged: skipping the spiking steps cannot undo them, rolling back to a snapshot from before
    ``step`` can (:class:`~lightning_gradkit.SpikeRollback`). A stand-in, for demos and tests, for the instabilities
    that make large runs diverge.

    With ``clock="global_step"`` the fault happens once (a rollback does not rewind ``trainer.global_step``). With
    ``clock="optimizer"`` the steps are the optimizer's own count (the largest ``step`` in its state, read to the host
    every batch), which a rollback restores: the fault comes back after every rollback, as a fault of the
    configuration does, and only an escalation (a cut learning rate) goes through it.

    Put it first in the ``callbacks`` list: its ``on_train_batch_end`` puts the learning rate back before another
    callback (a snapshot) reads the optimizer's hyperparameters.

    Args:
        step: the first optimizer step with the raised learning rate, counted by ``clock``.
        steps: how many optimizer steps it lasts (>= 1).
        factor: the multiplier (> 0).
        clock: ``"global_step"`` (``trainer.global_step``) or ``"optimizer"`` (the first optimizer's step count).

    Raises:
        ValueError: if ``step`` < 0, ``steps`` < 1, ``factor`` <= 0 or ``clock`` is not one of the two.

    Example::

        >>> SpikeInjector(180, steps=4, factor=100.0, clock="optimizer").clock
        'optimizer'
    """

    def __init__(
        self,
        step: int,
        steps: int = 3,
        factor: float = 30.0,
        clock: Literal["global_step", "optimizer"] = "global_step",
    ) -> None:
        if step < 0:
            raise ValueError(f"`step` must be >= 0, got {step!r}.")
        if steps < 1:
            raise ValueError(f"`steps` must be >= 1, got {steps!r}.")
        if not factor > 0:
            raise ValueError(f"`factor` must be > 0, got {factor!r}.")
        if clock not in ("global_step", "optimizer"):
            raise ValueError(f'`clock` must be "global_step" or "optimizer", got {clock!r}.')
        self.step = step
        self.steps = steps
        self.factor = factor
        self.clock = clock
        self._saved: list[list[float]] | None = None

    def _now(self, trainer: pl.Trainer) -> int:
        if self.clock == "global_step":
            return trainer.global_step
        return optimizer_step_count(trainer.optimizers[0])

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        if self.step <= self._now(trainer) < self.step + self.steps and self._saved is None:
            self._saved = [[g["lr"] for g in opt.param_groups] for opt in trainer.optimizers]
            for opt in trainer.optimizers:
                for group in opt.param_groups:
                    group["lr"] = group["lr"] * self.factor

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, idx: int) -> None:
        if self._saved is not None:
            for opt, lrs in zip(trainer.optimizers, self._saved, strict=True):
                for group, lr in zip(opt.param_groups, lrs, strict=True):
                    group["lr"] = lr
            self._saved = None


class ProgressPrinter(pl.Callback):
    """Print one line every ``every_n_steps`` optimizer steps, for runs without a progress bar (``make demo``).

    Each line has the step, the training loss of the step's last batch, the latest logged ``grad_norm/total``,
    ``gradkit/skipped_steps`` and ``val_loss`` (read on the printed steps only), and the time since training started::

        step  100/300  loss 2.3016  grad_norm/total 0.4312  skipped 1  val_loss 2.4170  12 s

    Args:
        every_n_steps: print after every ``every_n_steps``-th optimizer step (``trainer.global_step``), and after
            the last one when ``max_steps`` is set.

    Raises:
        ValueError: if ``every_n_steps`` < 1.

    Example::

        Trainer(enable_progress_bar=False, callbacks=[GradNormMonitor(), ProgressPrinter(every_n_steps=50)])
    """

    def __init__(self, every_n_steps: int = 25) -> None:
        if every_n_steps < 1:
            raise ValueError(f"`every_n_steps` must be >= 1, got {every_n_steps!r}.")
        self.every_n_steps = every_n_steps
        self._printed_step = -1
        self._start = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, idx: int) -> None:
        step = trainer.global_step
        last = step == trainer.max_steps
        if step == self._printed_step or not (step % self.every_n_steps == 0 or last):
            return
        self._printed_step = step
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        elapsed = time.perf_counter() - self._start
        rank_zero_info(progress_line(step, trainer.max_steps, loss, trainer.callback_metrics, elapsed))


def progress_line(step: int, max_steps: int, loss: Tensor | None, metrics: dict[str, Tensor], elapsed: float) -> str:
    """The line :class:`ProgressPrinter` prints: the step (``/max_steps`` when set), the loss and the metrics known."""
    total = f"/{max_steps}" if max_steps > 0 else ""
    parts = [f"step {step:>4}{total}", f"loss {float(loss):.4f}" if loss is not None else "loss -"]
    for key, label, fmt in (
        ("grad_norm/total", "grad_norm/total", ".4f"),
        ("gradkit/skipped_steps", "skipped", ".0f"),
        ("val_loss", "val_loss", ".4f"),
    ):
        if key in metrics:
            parts.append(f"{label} {float(metrics[key]):{fmt}}")
    parts.append(f"{elapsed:.0f} s")
    return "  ".join(parts)


def optimizer_step_count(optimizer: torch.optim.Optimizer) -> int:
    """The steps the optimizer has applied: the largest ``step`` in its state (0 before the first step).

    Example::

        >>> net = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.Adam(net.parameters())
        >>> optimizer_step_count(opt)
        0
        >>> net(torch.ones(1, 2)).sum().backward()
        >>> opt.step()
        >>> optimizer_step_count(opt)
        1
    """
    steps = [state["step"] for state in optimizer.state.values() if "step" in state]
    return int(max(float(s) for s in steps)) if steps else 0


class LossRecorder(pl.Callback):
    """Keep the training loss of every batch (``losses[i]`` is batch ``i`` of the run), for plots and tests.

    Reads each loss to the host: one synchronization per batch on a GPU, so for demos only.
    """

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))
