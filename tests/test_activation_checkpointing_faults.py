"""ActivationCheckpointing under faults: buffers updated by a forward move once per step, and a failed fit leaves no
injection behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn

from helpers import loader, make_trainer
from lightning_gradkit import ActivationCheckpointing, NonFiniteGuard
from lightning_gradkit.activation_checkpointing.injection import injected_mode


class NormBlock(nn.Module):
    """A forward that updates buffers: BatchNorm's running statistics and its ``num_batches_tracked``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.norm(self.linear(x)))


class NormNet(pl.LightningModule):
    def __init__(self, mode: str = "full", nan_from_batch: int | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.Sequential(NormBlock(16), NormBlock(16))
        self.head = nn.Linear(16, 1)
        self.nan_from_batch = nan_from_batch

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.inp(x)))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self.nan_from_batch is not None and batch_idx >= self.nan_from_batch:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path: Path, *callbacks: pl.Callback, accumulate: int = 1) -> NormNet:
    torch.manual_seed(0)
    model = NormNet()
    trainer = make_trainer(tmp_path, callbacks=list(callbacks), accumulate_grad_batches=accumulate)
    trainer.fit(model, loader(n=64, batch_size=8))
    return model


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_batchnorm_buffers_after_training_equal_those_without_checkpointing(
    tmp_path: Path, mode: str, accumulate: int
) -> None:
    checkpointed = _fit(
        tmp_path / "ckpt", ActivationCheckpointing(["NormBlock"], mode=mode, measure=False), accumulate=accumulate
    )
    # Reference: the same Trainer run without gradkit (Lightning alone), same seed and batches.
    plain = _fit(tmp_path / "plain", accumulate=accumulate)
    buffers = dict(plain.named_buffers())
    assert buffers["blocks.0.norm.num_batches_tracked"] == 8  # one update per forward: 8 batches
    for name, buf in checkpointed.named_buffers():
        assert torch.equal(buf, buffers[name]), name
    params = dict(plain.named_parameters())
    for name, p in checkpointed.named_parameters():
        torch.testing.assert_close(p, params[name], rtol=0, atol=0, msg=name)


def test_recompute_runs_on_the_buffers_the_forward_left_and_leaves_them_unchanged() -> None:
    """Plain PyTorch: one checkpointed BatchNorm forward and backward against the same without checkpointing."""
    from lightning_gradkit.activation_checkpointing.injection import inject

    torch.manual_seed(0)
    reference = NormBlock(4)
    block = NormBlock(4)
    block.load_state_dict(reference.state_dict())
    inject(block)
    x = torch.randn(6, 4)
    reference(x).square().sum().backward()
    block(x).square().sum().backward()
    for (name, a), b in zip(reference.named_buffers(), block.buffers(), strict=True):
        assert torch.equal(a, b), name
    for (name, a), b in zip(reference.named_parameters(), block.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


class Injected(pl.Callback):
    """Records, at the first training batch, which blocks carry an injected forward (proves the fit injected)."""

    def __init__(self) -> None:
        self.during: list[bool] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self.during:
            self.during = [injected_mode(m) is not None for m in pl_module.blocks]


def test_a_failed_fit_removes_the_injections(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = NormNet(nan_from_batch=1)
    seen = Injected()
    guard = NonFiniteGuard(action="skip", max_consecutive=2)
    trainer = make_trainer(
        tmp_path, strategy="gradkit", callbacks=[ActivationCheckpointing(["NormBlock"]), guard, seen]
    )
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="consecutive optimizer steps"):
        trainer.fit(model, loader())
    assert seen.during == [True, True]
    # Reference: a freshly built model, never given to the callback, carries no instance-level forward.
    fresh = NormNet()
    for (name, module), (_, untouched) in zip(model.named_modules(), fresh.named_modules(), strict=True):
        assert injected_mode(module) is None, name
        assert ("forward" in module.__dict__) == ("forward" in untouched.__dict__), name
