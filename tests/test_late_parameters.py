"""Parameters that join the optimizer during the fit (Lightning's ``BackboneFinetuning``, ``requires_grad_(True)``)
are measured, guarded, scaled and clipped like the others, against references computed from the same gradients or a
plain PyTorch loop that unfreezes the same way."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, BaseFinetuning, Callback
from torch import Tensor, nn

from clip_reference import AGCRef
from helpers import column, loader, make_trainer, read_metrics
from lightning_gradkit import AccumulationGuard, AdaptiveGradClip, ClipGradNorm, GradNormMonitor, NonFiniteGuard

BATCHES = 4  # per epoch; epoch 0 trains the head, epoch 1 the backbone too
HEAD_LR = 0.1
BACKBONE_LR = 0.01  # BackboneFinetuning's default: backbone_initial_ratio_lr (0.1) times the first group's lr


class BackboneModel(pl.LightningModule):
    """A regression model with a ``backbone`` (what ``BackboneFinetuning`` freezes) and a ``head``.

    Records the gradients right after ``backward`` (before any gradkit callback acts) and in the module's own
    ``on_before_optimizer_step`` (which Lightning calls after every callback's, so after the engine wrote them).
    """

    def __init__(self, unfreeze: str = "backbone_finetuning") -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)
        self.unfreeze = unfreeze
        self.pre: list[dict[str, Tensor]] = []
        self.post: list[dict[str, Tensor]] = []
        self.weights: list[dict[str, Tensor]] = []
        self.nan_at_step: int | None = None

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.unfreeze == "requires_grad":
            # Every parameter is in the optimizer from the start; the backbone is frozen for epoch 0 only.
            return torch.optim.SGD(self.parameters(), lr=HEAD_LR)
        # As Lightning's BaseFinetuning asks: only the trainable parameters; the backbone joins as a new group.
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=HEAD_LR)

    def on_train_epoch_start(self) -> None:
        if self.unfreeze == "requires_grad":
            self.backbone.requires_grad_(self.current_epoch >= 1)

    def on_after_backward(self) -> None:
        if self.nan_at_step == self.trainer.global_step:
            self.backbone[0].weight.grad[0, 0] = math.nan
        self.pre.append(_grads(self))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.post.append(_grads(self))
        self.weights.append(_params(self))


def _grads(module: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def _unfreezing(unfreeze: str) -> list[Callback]:
    return [BackboneFinetuning(unfreeze_backbone_at_epoch=1)] if unfreeze == "backbone_finetuning" else []


def _fit(tmp_path: Path, model: BackboneModel, callbacks: list[Callback], **kwargs: object) -> pl.Trainer:
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, callbacks=[*_unfreezing(model.unfreeze), *callbacks], max_epochs=2, **kwargs)
    trainer.fit(model, loader(n=BATCHES * 8 * kwargs.get("accumulate_grad_batches", 1), batch_size=8))
    return trainer


def _clip_grad_norm_reference(grads: dict[str, Tensor], max_norm: float) -> dict[str, Tensor]:
    """``torch.nn.utils.clip_grad_norm_`` applied to copies of the gradients."""
    params = {n: nn.Parameter(torch.zeros_like(g)) for n, g in grads.items()}
    for n, p in params.items():
        p.grad = grads[n].clone()
    torch.nn.utils.clip_grad_norm_(params.values(), max_norm)
    return {n: p.grad for n, p in params.items()}


@pytest.mark.parametrize("unfreeze", ["backbone_finetuning", "requires_grad"])
def test_clip_grad_norm_clips_the_unfrozen_backbone_like_clip_grad_norm(tmp_path: Path, unfreeze: str) -> None:
    max_norm = 0.01  # below every total norm here: each step is clipped
    model = BackboneModel(unfreeze)
    _fit(tmp_path, model, [ClipGradNorm(max_norm)])
    assert len(model.pre) == len(model.post) == 2 * BATCHES
    # Epoch 0 steps the head only, epoch 1 the backbone too: the comparison covers both index layouts.
    assert all(not any(n.startswith("backbone") for n in g) for g in model.pre[:BATCHES])
    assert all("backbone.0.weight" in g for g in model.pre[BATCHES:])
    for step, (pre, post) in enumerate(zip(model.pre, model.post, strict=True)):
        expected = _clip_grad_norm_reference(pre, max_norm)
        assert post.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(post[name], expected[name], rtol=1e-5, atol=1e-9, msg=f"{name} at {step}")
        total = torch.nn.utils.get_total_norm(list(post.values()))
        assert total.item() == pytest.approx(max_norm, rel=1e-4)


def test_nan_in_an_unfrozen_backbone_gradient_skips_the_step(tmp_path: Path) -> None:
    model = BackboneModel()
    model.nan_at_step = BATCHES + 1  # the second step of epoch 1, after BackboneFinetuning unfroze the backbone
    before: dict[int, dict[str, Tensor]] = {}
    after: dict[int, dict[str, Tensor]] = {}

    class Snapshots(Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
            before[len(before)] = _params(pl_module)

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
            after[len(after)] = _params(pl_module)

    with pytest.warns(UserWarning, match="skipped"):
        _fit(tmp_path, model, [Snapshots(), NonFiniteGuard(action="skip")], strategy="gradkit")
    batch = BATCHES + 1
    assert not torch.isfinite(model.pre[batch]["backbone.0.weight"]).all()
    for name, value in before[batch].items():
        assert torch.equal(after[batch][name], value), name
    # The other steps of epoch 1 did update the backbone: the skip is not an accident of a frozen weight.
    assert not torch.equal(after[batch + 1]["backbone.0.weight"], before[batch + 1]["backbone.0.weight"])
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _params(module: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_monitor_total_norm_covers_the_unfrozen_backbone(tmp_path: Path) -> None:
    model = BackboneModel()
    trainer = _fit(tmp_path, model, [GradNormMonitor(depth=2, param_groups=True)])
    rows = read_metrics(trainer)
    expected = [torch.nn.utils.get_total_norm(list(g.values())).item() for g in model.pre]
    assert column(rows, "grad_norm/total") == pytest.approx(expected, rel=1e-6)
    # Per-module and per-group norms of the backbone appear once it joins the optimizer.
    backbone = [
        torch.nn.utils.get_total_norm([g["backbone.0.weight"], g["backbone.0.bias"]]).item()
        for g in model.pre[BATCHES:]
    ]
    assert column(rows, "grad_norm/module/backbone.0") == pytest.approx(backbone, rel=1e-6)
    assert len(column(rows, "grad_norm/param_group_1")) == BATCHES


class FreezeAllInSetup(BaseFinetuning):
    """Freezes the whole model in ``setup``, as Lightning's ``test_base_finetuning_internal_optimizer_metadata`` does:
    the backbone (in the optimizer, frozen) is unfrozen at epoch 0, the head joins as a new param group at epoch 1."""

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module)

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == 0:
            self.make_trainable(pl_module.backbone)
        elif epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.head, optimizer, lr=HEAD_LR)


class FrozenBackboneInOptimizer(BackboneModel):
    def __init__(self) -> None:
        super().__init__("base_finetuning")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.backbone.parameters(), lr=BACKBONE_LR)


def test_monitor_warns_when_nothing_trains_at_fit_start_and_measures_the_parameters_that_join(tmp_path: Path) -> None:
    model = FrozenBackboneInOptimizer()
    monitor = GradNormMonitor(depth=1, param_groups=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(tmp_path, model, [FreezeAllInSetup(), monitor])
    messages = [str(w.message) for w in caught if "no trainable parameter at fit start" in str(w.message)]
    assert len(messages) == 1 and "picks parameters up when they join" in messages[0]
    # Epoch 0 trains the backbone, epoch 1 the head too: the logged norms are those of exactly these gradients.
    backbone = {f"backbone.{i}.{kind}" for i in (0, 2) for kind in ("weight", "bias")}
    assert [set(g) for g in model.pre] == [backbone] * BATCHES + [backbone | {"head.weight", "head.bias"}] * BATCHES
    rows = read_metrics(trainer)
    expected = [torch.nn.utils.get_total_norm(list(g.values())).item() for g in model.pre]
    assert column(rows, "grad_norm/total") == pytest.approx(expected, rel=1e-6)
    head = [torch.nn.utils.get_total_norm([g["head.weight"], g["head.bias"]]).item() for g in model.pre[BATCHES:]]
    assert column(rows, "grad_norm/param_group_1") == pytest.approx(head, rel=1e-6)
    assert column(rows, "grad_norm/module/head") == pytest.approx(head, rel=1e-6)


class WithUnusedBackboneLayer(BackboneModel):
    def __init__(self) -> None:
        super().__init__()
        self.backbone.add_module("unused", nn.Linear(2, 2))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone[:-1](x))


def test_monitor_warns_about_an_unfrozen_parameter_without_gradient(tmp_path: Path) -> None:
    model = WithUnusedBackboneLayer()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = _fit(tmp_path, model, [GradNormMonitor()])
    messages = [str(w.message) for w in record if "received no gradient" in str(w.message)]
    stepped = [p for g in trainer.optimizers[0].param_groups for p in g["params"]]
    without_grad = sorted(n for n, p in model.named_parameters() if p.grad is None and any(p is q for q in stepped))
    assert without_grad == ["backbone.unused.bias", "backbone.unused.weight"]
    assert len(messages) == 1 and all(name in messages[0] for name in without_grad)


def test_accumulation_guard_scales_the_unfrozen_backbone_in_the_short_window(tmp_path: Path) -> None:
    """3 batches per epoch with windows of 2: the last window of each epoch holds one micro-batch."""
    model = BackboneModel()
    torch.manual_seed(0)
    trainer = make_trainer(
        tmp_path,
        callbacks=[*_unfreezing("backbone_finetuning"), AccumulationGuard()],
        max_epochs=2,
        accumulate_grad_batches=2,
    )
    trainer.fit(model, loader(n=3 * 8, batch_size=8))

    # Plain PyTorch: the mean gradient of each window; the backbone joins as a group with lr 0.01 at epoch 1.
    torch.manual_seed(0)
    ref = BackboneModel()
    ref.backbone.requires_grad_(False)
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=HEAD_LR)
    batches = list(loader(n=3 * 8, batch_size=8))
    for epoch in range(2):
        if epoch == 1:
            ref.backbone.requires_grad_(True)
            opt.add_param_group({"params": list(ref.backbone.parameters()), "lr": BACKBONE_LR})
        for window in (batches[:2], batches[2:]):
            opt.zero_grad()
            for x, y in window:
                (nn.functional.mse_loss(ref(x), y) / len(window)).backward()
            opt.step()
    for (name, got), expected in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6, msg=name)
    assert not torch.equal(ref.backbone[0].weight, BackboneModel().backbone[0].weight)


def test_agc_clips_parameters_unfrozen_after_setup(tmp_path: Path) -> None:
    """AGC's selection covers frozen parameters: the unfrozen backbone is clipped unit-wise, as timm does."""
    model = BackboneModel()
    _fit(tmp_path, model, [AdaptiveGradClip(clip_factor=0.01)])
    clipped_backbone = False
    for step, (pre, post, weights) in enumerate(zip(model.pre, model.post, model.weights, strict=True)):
        reference = nn.Module()
        for name, grad in pre.items():
            param = nn.Parameter(weights[name].clone())
            param.grad = grad.clone()
            reference.register_parameter(name.replace(".", "_"), param)
        AGCRef(0.01)(reference)
        for name, grad in pre.items():
            expected = reference.get_parameter(name.replace(".", "_")).grad
            torch.testing.assert_close(post[name], expected, rtol=1e-5, atol=1e-9, msg=f"{name} at {step}")
            clipped_backbone |= name.startswith("backbone") and not torch.equal(expected, grad)
    assert clipped_backbone


class BackboneZeroForgotten(BackboneModel):
    """An ``optimizer_zero_grad`` written before the backbone was unfrozen: it zeroes the head only."""

    def __init__(self) -> None:
        super().__init__()
        self.dirty_at_window_start: list[list[str]] = []
        self.backwards = 0

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        for p in self.head.parameters():
            p.grad = None

    def on_before_backward(self, loss: Tensor) -> None:
        # Windows of 2 micro-batches (4 per epoch): every other backward starts a window.
        if self.backwards % 2 == 0:
            names = [n for n, p in self.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0]
            self.dirty_at_window_start.append(names)
        self.backwards += 1


def test_accumulation_guard_checks_that_unfrozen_parameters_start_windows_clean(tmp_path: Path) -> None:
    model = BackboneZeroForgotten()
    guard = AccumulationGuard(zero_early=False, on_dirty="warn")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _fit(tmp_path, model, [guard], accumulate_grad_batches=2, log_every_n_steps=50)
    messages = [str(w.message) for w in record if "began with non-zero gradients" in str(w.message)]
    dirty = next(names for names in model.dirty_at_window_start if names)
    assert dirty == ["backbone.0.weight", "backbone.0.bias", "backbone.2.weight", "backbone.2.bias"]
    assert len(messages) == 1 and f"in {len(dirty)} parameter(s): {', '.join(dirty)}." in messages[0]


class RefreezingModel(BackboneModel):
    """Every parameter in the optimizer; the backbone trains in epoch 0 and is frozen again for epoch 1."""

    def __init__(self) -> None:
        super().__init__("requires_grad")

    def on_train_epoch_start(self) -> None:
        self.backbone.requires_grad_(self.current_epoch == 0)


def test_parameters_frozen_again_leave_the_index_without_a_missing_gradient_warning(tmp_path: Path) -> None:
    """A trained parameter frozen mid-fit has no gradient from then on: the index drops it instead of reporting it
    as a trainable parameter that received none, and clipping and the logged norm cover the head alone."""
    max_norm = 0.01
    model = RefreezingModel()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(tmp_path, model, [GradNormMonitor(), ClipGradNorm(max_norm)])
    assert not [w for w in caught if "received no gradient" in str(w.message)]
    assert all("backbone.0.weight" in g for g in model.pre[:BATCHES])
    assert all(not any(n.startswith("backbone") for n in g) for g in model.pre[BATCHES:])
    for pre, post in zip(model.pre, model.post, strict=True):
        expected = _clip_grad_norm_reference(pre, max_norm)
        for name in expected:
            torch.testing.assert_close(post[name], expected[name], rtol=1e-5, atol=1e-9, msg=name)
    logged = column(read_metrics(trainer), "grad_norm/total")
    assert logged[-1] == pytest.approx(torch.nn.utils.get_total_norm(list(model.pre[-1].values())).item(), rel=1e-5)
