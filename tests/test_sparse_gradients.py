"""Sparse gradients (``nn.Embedding(sparse=True)``) through the engine, against plain PyTorch loops that densify the
gradient (``to_dense()``) before the reference clip, or keep it sparse for ``SparseAdam``."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from clip_reference import AGCRef, AutoClipRef, NormRef, ValueRef, ZClipRef
from helpers import column, make_trainer, read_metrics
from lightning_gradkit import (
    AccumulationGuard,
    AdaptiveGradClip,
    AutoClip,
    ClipGradNorm,
    ClipGradValue,
    GradNormMonitor,
    NonFiniteGuard,
    ZClip,
)
from lightning_gradkit.trainer_door import GradKitCallback

VOCAB, DIM, TOKENS = 12, 6, 5
STEPS = 12


def token_data(n: int = STEPS * 8, seed: int = 0) -> TensorDataset:
    """Token ids with repeats inside every batch: the embedding's sparse gradient is uncoalesced."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, TOKENS), generator=g)
    y = torch.randn(n, 1, generator=g)
    return TensorDataset(ids, y)


def token_loader(n: int = STEPS * 8) -> DataLoader:
    return DataLoader(token_data(n), batch_size=8, shuffle=False)


class EmbeddingModel(pl.LightningModule):
    """A sparse embedding and a dense head, trained with SGD (or the embedding alone with ``SparseAdam``)."""

    def __init__(self, optimizer: str = "sgd", nan_at_batch: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, sparse=True)
        self.head = nn.Linear(DIM, 1)
        self.optimizer_name = optimizer
        self.nan_at_batch = nan_at_batch
        self.batches = 0
        self.pre: list[dict[str, Tensor]] = []
        if optimizer == "sparse_adam":
            self.head.requires_grad_(False)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.embed(ids).mean(1)))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        ids, y = batch
        return nn.functional.mse_loss(self(ids), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self, self.optimizer_name)

    def on_after_backward(self) -> None:
        if self.batches == self.nan_at_batch:
            poison(self.embed.weight.grad)
        self.batches += 1
        self.pre.append({n: p.grad.to_dense() for n, p in self.named_parameters() if p.grad is not None})


def make_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "sparse_adam":
        return torch.optim.SparseAdam([model.embed.weight], lr=0.05)
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)


def poison(grad: Tensor) -> None:
    assert grad.is_sparse
    grad._values()[0, 0] = math.nan


def reference_params(
    clip: Callable[[nn.Module], None] | None,
    accumulate: int = 1,
    batches: int = STEPS,
    optimizer: str = "sgd",
    skip_batch: int | None = None,
) -> dict[str, Tensor]:
    """The plain loop: loss / accumulate, densify the gradients for the reference clip, step (never on the skipped
    window)."""
    torch.manual_seed(0)
    model = EmbeddingModel(optimizer)
    opt = make_optimizer(model, optimizer)
    data = list(token_loader(batches * 8))
    for start in range(0, len(data), accumulate):
        window = data[start : start + accumulate]
        opt.zero_grad()
        for ids, y in window:
            (nn.functional.mse_loss(model(ids), y) / len(window)).backward()
        if skip_batch is not None and start <= skip_batch < start + accumulate:
            continue
        if clip is not None:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad = p.grad.to_dense()
            clip(model)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def lightning_model(
    tmp_path: Path, callbacks: list[Callback], optimizer: str = "sgd", nan_at_batch: int | None = None, **kwargs: object
) -> tuple[EmbeddingModel, pl.Trainer]:
    torch.manual_seed(0)
    model = EmbeddingModel(optimizer, nan_at_batch)
    trainer = make_trainer(tmp_path, callbacks=callbacks, **kwargs)
    trainer.fit(model, token_loader())
    return model, trainer


CLIPPERS: dict[str, tuple[Callable[[], GradKitCallback], Callable[[], Callable[[nn.Module], None]]]] = {
    "norm-2": (lambda: ClipGradNorm(0.05), lambda: NormRef(0.05)),
    "norm-1": (lambda: ClipGradNorm(0.2, norm_type=1.0), lambda: NormRef(0.2, 1.0)),
    "norm-inf": (lambda: ClipGradNorm(0.01, norm_type=math.inf), lambda: NormRef(0.01, math.inf)),
    "value": (lambda: ClipGradValue(0.005), lambda: ValueRef(0.005)),
    "agc": (lambda: AdaptiveGradClip(clip_factor=0.005), lambda: AGCRef(0.005)),
    "autoclip": (lambda: AutoClip(percentile=25.0, history_size=6), lambda: AutoClipRef(25.0, 6)),
    "zclip": (
        lambda: ZClip(alpha=0.9, z_threshold=0.5, warmup_steps=4, max_norm=0.08),
        lambda: ZClipRef(0.9, 0.5, 4, 0.08),
    ),
}


@pytest.mark.parametrize("case", list(CLIPPERS))
def test_sparse_embedding_is_clipped_like_the_dense_reference(tmp_path: Path, case: str) -> None:
    make_callback, make_ref = CLIPPERS[case]
    model, trainer = lightning_model(tmp_path, [make_callback()])
    assert model.embed.weight.grad is None or model.embed.weight.grad.is_sparse
    expected = reference_params(make_ref())
    for name, got in model.named_parameters():
        torch.testing.assert_close(got, expected[name], rtol=0, atol=1e-6, msg=name)
    clipped = column(read_metrics(trainer), "grad_clip/clipped_fraction")
    assert len(clipped) == STEPS and sum(clipped) > 0


@pytest.mark.parametrize("p", [1.0, 2.0, math.inf])
def test_monitor_measures_sparse_gradients_like_their_dense_copies(tmp_path: Path, p: float) -> None:
    model, trainer = lightning_model(tmp_path, [GradNormMonitor(norm_type=p, depth=1, param_groups=True)])
    rows = read_metrics(trainer)
    total = [torch.nn.utils.get_total_norm(list(g.values()), p).item() for g in model.pre]
    embed = [torch.nn.utils.get_total_norm([g["embed.weight"]], p).item() for g in model.pre]
    assert column(rows, "grad_norm/total") == pytest.approx(total, rel=1e-6)
    assert column(rows, "grad_norm/module/embed") == pytest.approx(embed, rel=1e-6)
    assert column(rows, "grad_norm/param_group_0") == pytest.approx(total, rel=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "sparse_adam"])
def test_nan_in_a_sparse_gradient_skips_the_step(tmp_path: Path, optimizer: str) -> None:
    snapshots: list[tuple[str, dict[str, Tensor]]] = []

    class Snapshots(Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
            snapshots.append(("start", {n: p.detach().clone() for n, p in pl_module.named_parameters()}))

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
            snapshots.append(("end", {n: p.detach().clone() for n, p in pl_module.named_parameters()}))

    with pytest.warns(UserWarning, match="skipped"):
        model, trainer = lightning_model(
            tmp_path, [Snapshots(), NonFiniteGuard(action="skip")], optimizer, nan_at_batch=3, strategy="gradkit"
        )
    start, end = snapshots[2 * 3][1], snapshots[2 * 3 + 1][1]
    for name in start:
        assert torch.equal(start[name], end[name]), name
    expected = reference_params(None, optimizer=optimizer, skip_batch=3)
    for name, got in model.named_parameters():
        torch.testing.assert_close(got, expected[name], rtol=0, atol=1e-6, msg=name)
    assert trainer.global_step == STEPS  # attempted steps
    assert column(read_metrics(trainer), "gradkit/skipped_steps")[-1] == 1.0


def test_accumulation_guard_scales_a_sparse_short_window(tmp_path: Path) -> None:
    """10 batches in windows of 4: the last window holds two micro-batches and is averaged over them."""
    torch.manual_seed(0)
    model = EmbeddingModel()
    trainer = make_trainer(tmp_path, callbacks=[AccumulationGuard()], accumulate_grad_batches=4)
    trainer.fit(model, token_loader(10 * 8))
    expected = reference_params(None, accumulate=4, batches=10)
    for name, got in model.named_parameters():
        torch.testing.assert_close(got, expected[name], rtol=0, atol=1e-6, msg=name)
    assert trainer.global_step == 3
