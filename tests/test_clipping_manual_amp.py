"""Clipping under 16-mixed AMP (fused and unfused optimizers) and in manual optimization, against plain loops."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import Tensor, nn

from clip_reference import AGCRef, AutoClipRef, NormRef, ValueRef, ZClipRef, total_norm
from gradkit.policies.agc import AdaptiveGradClip as TorchAdaptiveGradClip
from gradkit.policies.clipping import ClipGradNorm as TorchClipGradNorm
from gradkit.policies.clipping import ClipGradValue as TorchClipGradValue
from gradkit.policies.history_clipping import AutoClip as TorchAutoClip
from gradkit.policies.history_clipping import ZClip as TorchZClip
from helpers import MLPModule, count_syncs, loader, make_trainer
from lightning_gradkit import AdaptiveGradClip, ClipGradNorm, ClipGradValue, GradNormMonitor, ZClip, clip_gradients

STEPS = 12


class FusedAdamW(MLPModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01, fused=True)


def amp_plugin() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


def reference_amp(clip: Callable[[nn.Module], None], model_cls: type[MLPModule]) -> dict[str, Tensor]:
    """PyTorch's documented AMP recipe: scale, backward, unscale_, clip, scaler.step, update."""
    torch.manual_seed(0)
    model = model_cls()
    opt = model.configure_optimizers()
    scaler = torch.amp.GradScaler("cpu")
    for x, y in loader(n=STEPS * 8, batch_size=8):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        clip(model)
        scaler.step(opt)
        scaler.update()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


AMP_CASES = {
    "norm": (lambda: ClipGradNorm(0.5), lambda: NormRef(0.5)),
    "value": (lambda: ClipGradValue(0.05), lambda: ValueRef(0.05)),
    "agc": (lambda: AdaptiveGradClip(clip_factor=0.05), lambda: AGCRef(0.05)),
    "zclip": (lambda: ZClip(alpha=0.9, z_threshold=0.5, warmup_steps=3), lambda: ZClipRef(0.9, 0.5, 3)),
}


@pytest.mark.parametrize("model_cls", [FusedAdamW, MLPModule], ids=["fused-adamw", "sgd"])
@pytest.mark.parametrize("case", list(AMP_CASES))
def test_16_mixed_clips_the_unscaled_gradients_like_the_amp_recipe(
    tmp_path: Path, case: str, model_cls: type[MLPModule]
) -> None:
    """With a fused optimizer Lightning does not unscale before the hook: the thresholds must still hold."""
    make_callback, make_ref = AMP_CASES[case]
    torch.manual_seed(0)
    model = model_cls()
    trainer = make_trainer(tmp_path, callbacks=[make_callback()], plugins=[amp_plugin()])
    trainer.fit(model, loader(n=STEPS * 8, batch_size=8))
    expected = reference_amp(make_ref(), model_cls)
    unclipped = reference_amp(lambda m: None, model_cls)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=1e-6, msg=name)
    assert any(not torch.allclose(expected[n], unclipped[n], rtol=0, atol=1e-5) for n in expected)


def test_fused_amp_logs_unscaled_norms(tmp_path: Path) -> None:
    norms: list[float] = []

    class Recording(FusedAdamW):
        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            scale = self.trainer.precision_plugin.scaler.get_scale()
            norms.append(total_norm(self) / scale)

    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, callbacks=[GradNormMonitor(), ClipGradNorm(100.0)], plugins=[amp_plugin()])
    trainer.fit(Recording(), loader(n=16, batch_size=8))
    assert trainer.callback_metrics["grad_norm/total"].item() == pytest.approx(norms[-1], rel=1e-6)
    assert trainer.callback_metrics["grad_clip/pre_clip_norm"].item() == pytest.approx(norms[-1], rel=1e-6)
    assert norms[-1] < 100.0  # the scaled norm (x 65536) would be clipped


class ManualModule(MLPModule):
    """Manual optimization calling ``clip_gradients`` between ``manual_backward`` and ``step``."""

    def __init__(self, policy: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.policy = policy
        self.returned: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self(x), y))
        self.returned.append(clip_gradients(self, opt, self.policy).item())
        opt.step()


def reference_manual(clip: Callable[[nn.Module], None], amp: bool) -> tuple[dict[str, Tensor], list[float]]:
    torch.manual_seed(0)
    model = MLPModule()
    opt = model.configure_optimizers()
    scaler = torch.amp.GradScaler("cpu", enabled=amp)
    norms = []
    for x, y in loader(n=STEPS * 8, batch_size=8):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
            loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(total_norm(model))
        clip(model)
        scaler.step(opt)
        scaler.update()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


MANUAL_CASES: dict[str, tuple[Callable[[], Any], Callable[[], Callable[[nn.Module], None]], bool]] = {
    # (clipper given to clip_gradients, reference, also attach it to the Trainer)
    "torch-clipper": (lambda: TorchClipGradNorm(0.5), lambda: NormRef(0.5), False),
    "callback-object": (
        lambda: ZClip(alpha=0.9, z_threshold=0.5, warmup_steps=3),
        lambda: ZClipRef(0.9, 0.5, 3),
        False,
    ),
    "attached-callback": (lambda: ClipGradNorm(0.5), lambda: NormRef(0.5), True),
    "torch-zclip": (
        lambda: TorchZClip(alpha=0.9, z_threshold=0.5, warmup_steps=3),
        lambda: ZClipRef(0.9, 0.5, 3),
        False,
    ),
}


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "16-mixed"])
@pytest.mark.parametrize("case", list(MANUAL_CASES))
def test_manual_optimization_clips_once_and_returns_the_norm(tmp_path: Path, case: str, amp: bool) -> None:
    make_policy, make_ref, attach = MANUAL_CASES[case]
    policy = make_policy()
    torch.manual_seed(0)
    model = ManualModule(policy)
    callbacks = [policy, GradNormMonitor()] if attach else [GradNormMonitor()]
    trainer = make_trainer(tmp_path, callbacks=callbacks, plugins=[amp_plugin()] if amp else None)
    trainer.fit(model, loader(n=STEPS * 8, batch_size=8))
    expected, norms = reference_manual(make_ref(), amp)
    # The returned norms are unscaled (under AMP the gradients are still scaled at this point).
    assert model.returned == pytest.approx(norms, rel=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=1e-6, msg=name)


TORCH_CLIPPERS: dict[str, tuple[Callable[[], Any], Callable[[], Callable[[nn.Module], None]]]] = {
    # Every other torch clipper class clip_gradients accepts (ClipGradNorm and ZClip are above).
    "value": (lambda: TorchClipGradValue(0.05), lambda: ValueRef(0.05)),
    "agc": (lambda: TorchAdaptiveGradClip(clip_factor=0.05), lambda: AGCRef(0.05)),
    "autoclip": (lambda: TorchAutoClip(percentile=30.0, history_size=50), lambda: AutoClipRef(30.0, 50)),
}


@pytest.mark.parametrize("case", list(TORCH_CLIPPERS))
def test_manual_clip_gradients_applies_every_torch_clipper(tmp_path: Path, case: str) -> None:
    make_policy, make_ref = TORCH_CLIPPERS[case]
    torch.manual_seed(0)
    model = ManualModule(make_policy())
    make_trainer(tmp_path).fit(model, loader(n=STEPS * 8, batch_size=8))
    expected, _ = reference_manual(make_ref(), amp=False)
    unclipped, _ = reference_manual(lambda m: None, amp=False)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=1e-6, msg=name)
    assert any(not torch.allclose(expected[n], unclipped[n], rtol=0, atol=1e-5) for n in expected)


def test_manual_clip_gradients_syncs_nothing(tmp_path: Path) -> None:
    import lightning_gradkit.callbacks.clip_callbacks as clipping_module

    with count_syncs() as counter:
        counter.watch(clipping_module, "clip_gradients")
        model = ManualModule(TorchZClip(warmup_steps=2))

        def training_step(batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
            opt = model.optimizers()
            opt.zero_grad()
            model.manual_backward(nn.functional.mse_loss(model(batch[0]), batch[1]))
            clipping_module.clip_gradients(model, opt, model.policy)
            opt.step()

        model.training_step = training_step  # type: ignore[method-assign]
        trainer = make_trainer(tmp_path, log_every_n_steps=1000, plugins=[amp_plugin()])
        trainer.fit(model, loader(n=48, batch_size=8))
        assert trainer.global_step == 6
        assert counter.total == 0, counter.counts


def test_manual_clip_gradients_rejects_automatic_optimization_and_second_clipper(tmp_path: Path) -> None:
    class Automatic(MLPModule):
        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            clip_gradients(self, optimizer, TorchClipGradNorm(1.0))

    with pytest.raises(RuntimeError, match="manual optimization"):
        make_trainer(tmp_path).fit(Automatic(), loader(n=8))

    trainer = make_trainer(tmp_path, callbacks=[ClipGradNorm(1.0)])
    with pytest.raises(ValueError, match="would clip twice"):
        trainer.fit(ManualModule(TorchZClip()), loader(n=8))

    with pytest.raises(ValueError, match=r"must be a gradkit clipper .* got GradNormMonitor"):
        make_trainer(tmp_path).fit(ManualModule(GradNormMonitor()), loader(n=8))


class TwoOptimizers(MLPModule):
    """Manual optimization with one optimizer for the encoder and one for the head, one clipper for both."""

    def __init__(self, policy: Any) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.policy = policy

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.encoder.parameters(), lr=0.1), torch.optim.SGD(self.head.parameters(), lr=0.1)]

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        opt_encoder, opt_head = self.optimizers()
        opt_encoder.zero_grad()
        opt_head.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self(batch[0]), batch[1]))
        clip_gradients(self, opt_encoder, self.policy)
        opt_encoder.step()
        clip_gradients(self, opt_head, self.policy)
        opt_head.step()


def reference_two_optimizers(make_ref: Callable[[], Callable[[nn.Module], None]] | None, epochs: int = 1) -> dict:
    """Plain loop: each optimizer's gradients clipped by its own, independent reference policy."""
    torch.manual_seed(0)
    model = MLPModule()
    opts = [torch.optim.SGD(model.encoder.parameters(), lr=0.1), torch.optim.SGD(model.head.parameters(), lr=0.1)]
    clips = [make_ref(), make_ref()] if make_ref is not None else [lambda m: None] * 2
    for _ in range(epochs):
        for x, y in loader(n=STEPS * 8, batch_size=8):
            for opt in opts:
                opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            for opt, clip, part in zip(opts, clips, (model.encoder, model.head), strict=True):
                clip(part)
                opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


TWO_OPTIMIZER_CASES: dict[str, tuple[Callable[[], Any], Callable[[], Callable[[nn.Module], None]]]] = {
    "torch-zclip": (lambda: TorchZClip(alpha=0.9, z_threshold=0.5, warmup_steps=3), lambda: ZClipRef(0.9, 0.5, 3)),
    "torch-autoclip": (lambda: TorchAutoClip(percentile=30.0, history_size=50), lambda: AutoClipRef(30.0, 50)),
    "zclip-callback": (lambda: ZClip(alpha=0.9, z_threshold=0.5, warmup_steps=3), lambda: ZClipRef(0.9, 0.5, 3)),
}


@pytest.mark.parametrize("case", list(TWO_OPTIMIZER_CASES))
def test_one_policy_object_for_two_optimizers_keeps_one_state_per_optimizer(tmp_path: Path, case: str) -> None:
    make_policy, make_ref = TWO_OPTIMIZER_CASES[case]
    policy = make_policy()
    torch.manual_seed(0)
    model = TwoOptimizers(policy)
    make_trainer(tmp_path).fit(model, loader(n=STEPS * 8, batch_size=8))
    expected = reference_two_optimizers(make_ref)
    unclipped = reference_two_optimizers(None)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=1e-6, msg=name)
    assert all(
        not torch.allclose(expected[n], unclipped[n], rtol=0, atol=1e-5) for n in ("encoder.0.weight", "head.weight")
    )


def test_attached_callback_for_two_optimizers_resumes_both_states_from_a_checkpoint(tmp_path: Path) -> None:
    def clipper() -> ZClip:
        return ZClip(alpha=0.9, z_threshold=0.5, warmup_steps=3)

    first = clipper()
    torch.manual_seed(0)
    model = TwoOptimizers(first)
    trainer = make_trainer(tmp_path, callbacks=[first])
    trainer.fit(model, loader(n=STEPS * 8, batch_size=8))
    ckpt = tmp_path / "epoch1.ckpt"
    trainer.save_checkpoint(ckpt)

    resumed = clipper()
    model = TwoOptimizers(resumed)
    make_trainer(tmp_path, callbacks=[resumed], max_epochs=2).fit(
        model, loader(n=STEPS * 8, batch_size=8), ckpt_path=ckpt
    )
    expected = reference_two_optimizers(lambda: ZClipRef(0.9, 0.5, 3), epochs=2)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=1e-6, msg=name)
