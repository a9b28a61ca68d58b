"""A fused optimizer takes the clip coefficient (and the accumulation scale) as its ``grad_scale``: no separate pass
over the gradients writes them.

The reference is the hand-written loop every user knows: ``clip_grad_norm_`` (which multiplies the gradients in place)
and then the same fused optimizer's ``step``. The fused kernel divides each gradient by ``grad_scale = 1 / c`` as it
reads it (and stores the result back, as it does for a ``GradScaler``'s unscale), where the reference multiplies by
``c``: ``g / fl(1/c)`` against ``fl(g * c)``, at most 1 ulp apart (proved on random data below), so the parameters
agree to the rounding of the optimizer's update, not bitwise; where no clipping happens (``c == 1``) they are bitwise
equal.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn

from gradkit.doors.loop import GradKit
from helpers import MLPModule, loader, make_trainer
from lightning_gradkit import ClipGradNorm, NonFiniteGuard
from lightning_gradkit.diagnostics.op_count import OpCounter

FUSED: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
}
STEPS = 8
NAN_STEP = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def _batches() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=g) * 4, torch.randn(8, 1, generator=g)) for _ in range(STEPS)]
    batches[NAN_STEP][0][0, 0] = math.nan
    return batches


def _reference(
    make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer], max_norm: float
) -> tuple[nn.Module, list[Tensor]]:
    """clip_grad_norm_ then the fused step; the NaN batch left out (what the guard's skip must equal). Also the
    first step's clipped gradients."""
    model = _model()
    opt = make_opt(list(model.parameters()))
    first: list[Tensor] = []
    for step, (x, y) in enumerate(_batches()):
        opt.zero_grad(set_to_none=True)
        if step == NAN_STEP:
            continue
        nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        first = first or [p.grad.clone() for p in model.parameters()]
        opt.step()
    return model, first


def _door(
    make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer], max_norm: float
) -> tuple[nn.Module, GradKit, list[Tensor], list[int]]:
    """The loop door with a clipper and a skipping guard (so the gate folds); the first step's gradients after the
    step, and the aten ops that write gradients in place outside the optimizer's kernel, per step."""
    model = _model()
    opt = make_opt(list(model.parameters()))
    kit = GradKit(model, opt, [ClipGradNorm(max_norm), NonFiniteGuard("skip", forensics=False)], log_every_n_steps=0)
    first: list[Tensor] = []
    writes: list[int] = []
    for x, y in _batches():
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        kit.note_loss(loss)
        with OpCounter() as counter:
            kit.step(opt)
        writes.append(counter.ops["_foreach_mul_"] + counter.ops["mul_"])
        first = first or [p.grad.clone() for p in model.parameters()]
    return model, kit, first, writes


def _assert_close_to_rounding(ours: nn.Module, ref: nn.Module) -> None:
    """Parameters equal up to the rounding of the updates: 1 ulp of a gradient moves an Adam or SGD update by
    about 1 ulp of that update, far below 1e-6 relative here."""
    for (name, a), b in zip(ours.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_the_kernel_reads_each_gradient_within_one_ulp_of_the_written_one() -> None:
    """``g / fl(1/c)`` (the fused kernel with ``grad_scale = 1/c``) against ``fl(g * c)`` (the write pass)."""
    g = torch.Generator().manual_seed(0)
    worst = 0
    for trial in range(200):
        grads = torch.randn(100_000, generator=g) * 10.0 ** (trial % 16 - 8)
        c = torch.rand((), generator=g).clamp_min(1e-6)
        written = grads * c
        read = grads / torch.reciprocal(c)
        worst = max(worst, int((written.view(torch.int32) - read.view(torch.int32)).abs().max()))
    assert worst <= 1


@pytest.mark.parametrize("name", list(FUSED))
def test_fused_clip_and_skip_behind_the_door_equal_clip_grad_norm_without_a_write_pass(name: str) -> None:
    ours, kit, first, writes = _door(FUSED[name], max_norm=0.5)
    ref, ref_first = _reference(FUSED[name], max_norm=0.5)
    _assert_close_to_rounding(ours, ref)
    assert kit.skipped_steps == 1
    assert writes == [0] * STEPS  # no multiply of the gradients besides the optimizer's own kernel
    # What the kernel stored back in `.grad` is the clipped gradient, within 1 ulp of clip_grad_norm_'s.
    for a, b in zip(first, ref_first, strict=True):
        assert int((a.view(torch.int32) - b.view(torch.int32)).abs().max()) <= 1


@pytest.mark.parametrize("name", list(FUSED))
def test_an_unclipped_fused_step_is_bitwise_the_plain_step(name: str) -> None:
    """With nothing to clip the coefficient is exactly 1, and so is ``grad_scale``: bitwise the plain fused step."""
    ours, _, _, _ = _door(FUSED[name], max_norm=1e9)
    ref, _ = _reference(FUSED[name], max_norm=1e9)
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_fused_clip_under_a_grad_scaler_divides_the_scalers_grad_scale() -> None:
    """fp16 on CPU with a GradScaler: the scaler's ``grad_scale`` (the loss scale) and the clip coefficient are one
    division in the kernel; the reference unscales, clips, then lets the scaler step."""

    def run(door: bool) -> nn.Module:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        kit = None
        if door:
            policies = [ClipGradNorm(0.5), NonFiniteGuard("skip", forensics=False)]
            kit = GradKit(model, opt, policies, scaler=scaler, log_every_n_steps=0)
        for step, (x, y) in enumerate(_batches()):
            opt.zero_grad(set_to_none=True)
            if step == NAN_STEP:
                continue
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            if kit is not None:
                kit.note_loss(loss)
                kit.step(opt)
                continue
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
        return model

    _assert_close_to_rounding(run(door=True), run(door=False))


class _Fused(MLPModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05, fused=True)


def test_trainer_with_a_gradkit_strategy_folds_the_clip_as_lightnings_clip_would_apply_it(tmp_path: Path) -> None:
    """Behind the Trainer (a GradKit strategy gates the step while a guard may skip): ``ClipGradNorm`` with a fused
    AdamW equals Lightning's ``gradient_clip_val`` to rounding, with no multiply of the gradients in the step."""

    class Count(pl.Callback):
        """Counts the in-place multiplies of the optimizer step's boundary (the callbacks' hook to the step)."""

        def __init__(self) -> None:
            self.writes: list[int] = []

        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, opt: object) -> None:
            self.counter = OpCounter()
            self.counter.__enter__()

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
            self.counter.__exit__(None, None, None)
            self.writes.append(self.counter.ops["_foreach_mul_"] + self.counter.ops["mul_"])

    def fit(callbacks: list[pl.Callback], **kwargs: object) -> tuple[pl.LightningModule, Count]:
        torch.manual_seed(0)
        module, count = _Fused(), Count()
        trainer = make_trainer(tmp_path, max_steps=6, log_every_n_steps=50, callbacks=[count, *callbacks], **kwargs)
        trainer.fit(module, loader())
        return module, count

    # The counter opens first in the hook, so the pipeline (run by ClipGradNorm's hook) is counted.
    ours, count = fit([ClipGradNorm(0.05), NonFiniteGuard("skip")], strategy="gradkit")
    assert count.writes == [0] * 6
    ref, ref_count = fit([], gradient_clip_val=0.05)
    assert all(n > 0 for n in ref_count.writes)  # Lightning's clip: the counter sees its write pass
    _assert_close_to_rounding(ours, ref)


def test_a_gradient_scaled_in_place_by_torch_is_what_the_reference_multiplies() -> None:
    """The reference's own premise: ``clip_grad_norm_`` writes ``g * c`` into the gradients, c = max / (norm + 1e-6)."""
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    torch.nn.utils.clip_grad_norm_([p], 1.0)
    assert torch.equal(p.grad, torch.tensor([3.0, 4.0, 0.0]) * (1.0 / (5.0 + 1e-6)))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FUSED))
def test_fused_fold_on_cuda_equals_clip_grad_norm_and_never_synchronizes(name: str) -> None:
    """On CUDA: the same equality (the CUDA kernels divide by ``grad_scale`` as the CPU ones do), and the folded,
    skipping step runs under ``set_sync_debug_mode("error")`` after the first step."""

    def run(door: bool) -> nn.Module:
        torch.manual_seed(0)
        model = _model().cuda()
        opt = FUSED[name](list(model.parameters()))
        kit = GradKit(model, opt, [ClipGradNorm(0.5), NonFiniteGuard("skip", forensics=False)], log_every_n_steps=0)
        for step, (x, y) in enumerate(_batches()):
            x, y = x.cuda(), y.cuda()
            opt.zero_grad(set_to_none=True)
            if not door and step == NAN_STEP:
                continue
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if not door:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                continue
            kit.note_loss(loss)
            torch.cuda.set_sync_debug_mode("error" if step > 0 else "default")
            try:
                kit.step(opt)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return model

    _assert_close_to_rounding(run(door=True), run(door=False))
