"""The clipping callbacks with Lightning's real Trainer, against independent plain-PyTorch loops."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from clip_reference import AGCRef, AutoClipRef, NormRef, ValueRef, ZClipRef, total_norm
from helpers import MLPModule, column, count_syncs, loader, make_trainer, read_metrics
from lightning_gradkit import AdaptiveGradClip, AutoClip, ClipGradNorm, ClipGradValue, GradNormMonitor, ZClip

STEPS = 20

Clipper = ClipGradNorm | ClipGradValue | AdaptiveGradClip | AutoClip | ZClip


class ZeroInitMLP(MLPModule):
    """``encoder.2`` starts at zero: under AGC only the ``eps`` floor lets it move."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        nn.init.zeros_(self.encoder[2].weight)
        nn.init.zeros_(self.encoder[2].bias)


def reference_params(
    clip: Callable[[nn.Module], None], accumulate: int = 1, model_cls: type[MLPModule] = MLPModule, **kwargs: Any
) -> dict[str, torch.Tensor]:
    """The plain loop Lightning's automatic optimization stands for: loss / accumulate, clip, step."""
    torch.manual_seed(0)
    model = model_cls(**kwargs)
    opt = model.configure_optimizers()
    batches = list(loader(n=STEPS * accumulate * 8, batch_size=8))
    for k in range(STEPS):
        opt.zero_grad()
        for x, y in batches[k * accumulate : (k + 1) * accumulate]:
            (nn.functional.mse_loss(model(x), y) / accumulate).backward()
        clip(model)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def lightning_params(
    tmp_path: Path,
    callback: Clipper,
    accumulate: int = 1,
    model_cls: type[MLPModule] = MLPModule,
    **kwargs: Any,
) -> tuple[dict[str, torch.Tensor], list[dict[str, str]]]:
    torch.manual_seed(0)
    model = model_cls(**kwargs)
    trainer = make_trainer(tmp_path, callbacks=[callback], accumulate_grad_batches=accumulate)
    trainer.fit(model, loader(n=STEPS * accumulate * 8, batch_size=8))
    return {n: p.detach().clone() for n, p in model.named_parameters()}, read_metrics(trainer)


CASES: dict[str, tuple[Callable[[], Clipper], Callable[[], Callable[[nn.Module], None]]]] = {
    "norm-2": (lambda: ClipGradNorm(0.8), lambda: NormRef(0.8)),
    "norm-1": (lambda: ClipGradNorm(2.0, norm_type=1.0), lambda: NormRef(2.0, 1.0)),
    "norm-inf": (lambda: ClipGradNorm(0.3, norm_type=math.inf), lambda: NormRef(0.3, math.inf)),
    "value": (lambda: ClipGradValue(0.1), lambda: ValueRef(0.1)),
    "agc": (
        lambda: AdaptiveGradClip(clip_factor=0.05, exclude=["re:head"]),
        lambda: AGCRef(0.05, exclude=r"^head\."),
    ),
    "autoclip": (lambda: AutoClip(percentile=25.0, history_size=6), lambda: AutoClipRef(25.0, 6)),
    "zclip": (
        lambda: ZClip(alpha=0.9, z_threshold=0.5, warmup_steps=4, max_norm=1.4),
        lambda: ZClipRef(0.9, 0.5, 4, 1.4),
    ),
}


@pytest.mark.parametrize("accumulate", [1, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_parameters_after_20_steps_equal_the_reference_loop(tmp_path: Path, case: str, accumulate: int) -> None:
    make_callback, make_ref = CASES[case]
    got, rows = lightning_params(tmp_path, make_callback(), accumulate)
    expected = reference_params(make_ref(), accumulate)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)
    # The case clips on some steps, not necessarily all: the comparison is not vacuous.
    clipped = column(rows, "grad_clip/clipped_fraction")
    assert len(clipped) == STEPS and 0 < sum(clipped) <= STEPS


class _ClipWithOwnSetup(ClipGradNorm):
    """A user's subclass whose ``setup`` does not call ``super()``: the hooks find the Trainer's pipeline without the
    binding ``GradKitCallback.setup`` makes."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.stages = [*getattr(self, "stages", []), stage]


def test_a_subclass_whose_setup_skips_super_clips_as_the_reference(tmp_path: Path) -> None:
    callback = _ClipWithOwnSetup(0.8)
    got, rows = lightning_params(tmp_path, callback, accumulate=2)
    expected = reference_params(NormRef(0.8), accumulate=2)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)
    assert callback.stages == ["fit"] and 0 < sum(column(rows, "grad_clip/clipped_fraction")) <= STEPS


def test_agc_eps_floor_lets_zero_initialised_parameters_update(tmp_path: Path) -> None:
    got, _ = lightning_params(tmp_path, AdaptiveGradClip(clip_factor=0.01), model_cls=ZeroInitMLP)
    expected = reference_params(AGCRef(0.01), model_cls=ZeroInitMLP)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)
    assert got["encoder.2.weight"].abs().sum() > 0


@pytest.mark.parametrize("case", ["norm-2", "agc"])
def test_bf16_parameters_are_clipped_like_the_reference(tmp_path: Path, case: str) -> None:
    """With ``bf16-true`` the gradients are bf16: unit norms are reduced in fp32, coefficients cast to bf16."""
    make_callback, make_ref = CASES[case]
    torch.manual_seed(0)
    model = MLPModule()
    trainer = make_trainer(tmp_path, callbacks=[make_callback()], precision="bf16-true")
    trainer.fit(model, loader(n=STEPS * 8, batch_size=8))

    torch.manual_seed(0)
    ref = MLPModule().to(torch.bfloat16)
    opt = ref.configure_optimizers()
    clip = make_ref()
    for x, y in loader(n=STEPS * 8, batch_size=8):
        opt.zero_grad()
        nn.functional.mse_loss(ref(x.to(torch.bfloat16)), y.to(torch.bfloat16)).backward()
        clip(ref)
        opt.step()
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2, msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_float64_parameters_are_clipped_like_the_reference(tmp_path: Path, case: str) -> None:
    """Every clipper, and the monitor beside it, on a float64 model (``precision="64-true"``)."""
    make_callback, make_ref = CASES[case]
    torch.manual_seed(0)
    model = MLPModule()
    trainer = make_trainer(tmp_path, callbacks=[make_callback(), GradNormMonitor()], precision="64-true")
    trainer.fit(model, loader(n=STEPS * 8, batch_size=8))

    torch.manual_seed(0)
    ref = MLPModule().double()
    opt = ref.configure_optimizers()
    clip = make_ref()
    pre = []
    for x, y in loader(n=STEPS * 8, batch_size=8):
        opt.zero_grad()
        nn.functional.mse_loss(ref(x.double()), y.double()).backward()
        pre.append(total_norm(ref))
        clip(ref)
        opt.step()
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    assert column(read_metrics(trainer), "grad_norm/total") == pytest.approx(pre, rel=1e-5)


class MixedDtypeMLP(MLPModule):
    """A bf16 encoder and an fp32 head: the index orders the bf16 group first."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder.to(torch.bfloat16)
        self.pre: list[list[torch.Tensor]] = []
        self.post: list[list[torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.encoder(x.to(torch.bfloat16))).float())

    def on_after_backward(self) -> None:
        self.pre.append([p.grad.clone() for p in self.parameters()])

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.post.append([p.grad.clone() for p in self.parameters()])


def test_mixed_bf16_fp32_model_is_clipped_like_clip_grad_norm(tmp_path: Path) -> None:
    """The fp32 head gets the fp32 coefficient (not a bf16-rounded one), the bf16 encoder the same coefficient."""
    max_norm = 0.05
    model = MixedDtypeMLP()
    trainer = make_trainer(tmp_path, callbacks=[ClipGradNorm(max_norm)])
    trainer.fit(model, loader(n=STEPS * 8, batch_size=8))
    for step, (pre, post) in enumerate(zip(model.pre, model.post, strict=True)):
        # torch's clip_grad_norm_ = get_total_norm + clip_grads_with_norm_; the total is taken in fp32 over the same
        # gradients (get_total_norm would reduce the bf16 ones in bf16, a different rounding of the same norm).
        params = [nn.Parameter(torch.zeros_like(g)) for g in pre]
        for p, g in zip(params, pre, strict=True):
            p.grad = g.clone()
        total = torch.nn.utils.get_total_norm([g.float() for g in pre])
        assert total > max_norm
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        for got, p in zip(post, params, strict=True):
            if got.dtype == torch.float32:
                torch.testing.assert_close(got, p.grad, rtol=1e-6, atol=0, msg=f"step {step}")
            else:
                # One bf16 rounding of the same product.
                torch.testing.assert_close(got, p.grad, rtol=2**-7, atol=0, msg=f"step {step}")


class RecordingClipped(MLPModule):
    """Records the reference pre- and post-clip 2-norms in the module hook, which runs after every callback's."""

    def __init__(self, clip: Callable[[nn.Module], None]) -> None:
        super().__init__()
        self.post: list[float] = []
        self.clip = clip

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.post.append(total_norm(self))


@pytest.mark.parametrize("case", ["norm-2", "value", "agc", "zclip"])
def test_logged_norms_equal_the_reference(tmp_path: Path, case: str) -> None:
    make_callback, make_ref = CASES[case]
    callback = make_callback()
    torch.manual_seed(0)
    model = RecordingClipped(make_ref())
    trainer = make_trainer(tmp_path, callbacks=[callback, GradNormMonitor()], log_every_n_steps=1)
    trainer.fit(model, loader(n=STEPS * 8, batch_size=8))
    rows = read_metrics(trainer)

    # The reference: pre-clip norms in the callback's norm, post-clip norms, per-step clip decisions.
    torch.manual_seed(0)
    ref_model = MLPModule()
    opt = ref_model.configure_optimizers()
    clip, p = make_ref(), (math.inf if case == "value" else 2.0)
    pre, post, post2, clipped = [], [], [], []
    for x, y in loader(n=STEPS * 8, batch_size=8):
        opt.zero_grad()
        nn.functional.mse_loss(ref_model(x), y).backward()
        before = [g.clone() for g in (q.grad for q in ref_model.parameters())]
        pre.append(total_norm(ref_model, p))
        clip(ref_model)
        post.append(total_norm(ref_model, p))
        post2.append(total_norm(ref_model))
        clipped.append(any(not torch.equal(a, q.grad) for a, q in zip(before, ref_model.parameters(), strict=True)))
        opt.step()

    assert column(rows, "grad_clip/pre_clip_norm") == pytest.approx(pre, rel=1e-5)
    assert column(rows, "grad_clip/post_clip_norm") == pytest.approx(post, rel=1e-5)
    assert column(rows, "grad_clip/coef") == pytest.approx([b / a for a, b in zip(pre, post, strict=True)], rel=1e-5)
    assert column(rows, "grad_clip/clipped_fraction") == [float(c) for c in clipped]
    # The monitor's post-clip total (2-norm) is derived from the clip decision, or measured after a clamp.
    assert column(rows, "grad_norm/total_post_clip") == pytest.approx(post2, rel=1e-5)
    assert model.post == pytest.approx(post2, rel=1e-5)


def test_zclip_logs_the_z_score_threshold_mean_plus_z_times_std(tmp_path: Path) -> None:
    """``grad_clip/threshold`` is the norm above which ZClip clips (the paper's ``mu + z_threshold * sigma`` of the
    EMA statistics before the step), on clipped and unclipped steps alike, and ``inf`` during warm-up."""
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, callbacks=[ZClip(alpha=0.9, z_threshold=1.0, warmup_steps=4)])
    trainer.fit(MLPModule(), loader(n=STEPS * 8, batch_size=8))
    rows = read_metrics(trainer)

    torch.manual_seed(0)
    model = MLPModule()
    opt = model.configure_optimizers()
    ref = ZClipRef(0.9, 1.0, 4)
    thresholds, pre, clipped = [], [], []
    for x, y in loader(n=STEPS * 8, batch_size=8):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        pre.append(total_norm(model))
        thresholds.append(math.inf if ref.mean is None else ref.mean + 1.0 * math.sqrt(ref.var))
        ref(model)
        clipped.append(total_norm(model) < pre[-1] * (1 - 1e-6))
        opt.step()

    logged = column(rows, "grad_clip/threshold")
    assert logged[:4] == [math.inf] * 4
    assert logged[4:] == pytest.approx(thresholds[4:], rel=1e-5)
    assert column(rows, "grad_clip/pre_clip_norm") == pytest.approx(pre, rel=1e-5)
    # Both kinds of step are checked: a clipped one lies above its threshold, an unclipped one at or below it.
    assert 0 < sum(clipped[4:]) < STEPS - 4
    for norm, threshold, was_clipped in zip(pre[4:], logged[4:], clipped[4:], strict=True):
        assert (norm > threshold) == was_clipped


def reference_clip_flags(
    clip: Callable[[nn.Module], None], steps: int, clipped: Callable[[float, float], bool], **kwargs: Any
) -> list[bool]:
    """A plain loop clipped by ``clip``: per step, ``clipped(norm before the clip, norm after it)``."""
    torch.manual_seed(0)
    model = MLPModule(**kwargs)
    opt = model.configure_optimizers()
    flags = []
    for x, y in loader(n=steps * 8, batch_size=8):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        before = total_norm(model)
        clip(model)
        flags.append(bool(clipped(before, total_norm(model))))
        opt.step()
    return flags


def test_clipped_fraction_counts_steps_since_the_last_log(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[AutoClip(percentile=25.0, history_size=6)], log_every_n_steps=5)
    torch.manual_seed(0)
    trainer.fit(MLPModule(), loader(n=STEPS * 8, batch_size=8))
    clip = AutoClipRef(25.0, 6)
    flags = reference_clip_flags(clip, STEPS, lambda norm, _: norm > np.percentile(list(clip.history), 25.0))
    expected = [sum(flags[i : i + 5]) / 5 for i in range(0, STEPS, 5)]
    assert column(read_metrics(trainer), "grad_clip/clipped_fraction") == pytest.approx(expected)
    assert 0 < sum(expected) < 4


@pytest.mark.parametrize("make_callback", [lambda: ClipGradNorm(0.6), lambda: ZClip(alpha=0.9, warmup_steps=4)])
def test_clipped_count_over_long_logging_periods_and_in_checkpoints(tmp_path: Path, make_callback: Callable) -> None:
    """The clipped flags are summed in batches (of 64 steps, and when logged or saved): a logging period of 150
    steps and a checkpoint taken between two logs count exactly the steps a plain loop clips."""
    steps, period = 170, 150
    torch.manual_seed(0)
    callback = make_callback()
    trainer = make_trainer(tmp_path, callbacks=[callback], log_every_n_steps=period, max_steps=steps)
    trainer.fit(MLPModule(lr=0.05), loader(n=steps * 8, batch_size=8))
    ref = NormRef(0.6) if isinstance(callback, ClipGradNorm) else ZClipRef(0.9, 2.5, 4, None)
    flags = reference_clip_flags(ref, steps, lambda before, after: after < before * (1 - 1e-6), lr=0.05)
    assert 0 < sum(flags[:period]) < period and sum(flags[period:]) > 0
    # Logged once, at step `period - 1`, over the `period` steps before it.
    fractions = column(read_metrics(trainer), "grad_clip/clipped_fraction")
    assert fractions == pytest.approx([sum(flags[:period]) / period])
    state = callback.state_dict()
    assert int(state["clipped"][0]) == sum(flags[period:]) and state["steps"][0] == steps - period


@pytest.mark.parametrize("case", list(CASES))
def test_no_host_sync_per_step(tmp_path: Path, case: str) -> None:
    callback = CASES[case][0]()
    with count_syncs() as counter:
        counter.watch(callback, "on_before_optimizer_step")
        trainer = make_trainer(tmp_path, callbacks=[callback], log_every_n_steps=1000, accumulate_grad_batches=2)
        trainer.fit(MLPModule(), loader(n=64))
        assert trainer.global_step == 4
        assert counter.total == 0, counter.counts


def _strict_after_first_step(callback: Clipper) -> None:
    """Make any CUDA host sync inside the callback's hook an error (the first step builds index tensors)."""
    original = callback.on_before_optimizer_step

    def strict(trainer, pl_module, optimizer) -> None:
        if trainer.global_step >= 1:
            torch.cuda.set_sync_debug_mode("error")
        try:
            original(trainer, pl_module, optimizer)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    callback.on_before_optimizer_step = strict  # type: ignore[method-assign]


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_no_cuda_sync_per_step(tmp_path: Path, case: str) -> None:
    callback = CASES[case][0]()
    _strict_after_first_step(callback)
    trainer = make_trainer(
        tmp_path, accelerator="gpu", callbacks=[callback], log_every_n_steps=1000, accumulate_grad_batches=2
    )
    trainer.fit(MLPModule(), loader(n=64))
    assert trainer.global_step == 4


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["norm-2", "value", "agc", "zclip"])
def test_no_cuda_sync_per_step_with_fused_adamw_under_16_mixed(tmp_path: Path, case: str) -> None:
    class FusedAdamW(MLPModule):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=0.01, fused=True)

    callback = CASES[case][0]()
    _strict_after_first_step(callback)
    trainer = make_trainer(
        tmp_path, accelerator="gpu", precision="16-mixed", callbacks=[callback], log_every_n_steps=1000
    )
    trainer.fit(FusedAdamW(), loader(n=64))
    assert trainer.global_step == 8


@pytest.mark.parametrize(
    "make_callback",
    [
        lambda: AutoClip(percentile=25.0, history_size=6),
        lambda: ZClip(alpha=0.9, z_threshold=0.5, warmup_steps=4, max_norm=1.4),
        lambda: AdaptiveGradClip(clip_factor=0.05),
    ],
    ids=["autoclip", "zclip", "agc"],
)
def test_resumed_run_clips_bitwise_like_an_uninterrupted_one(tmp_path: Path, make_callback: Callable) -> None:
    """10 steps, checkpoint, 10 more steps from the checkpoint == 20 steps straight (Adam: its state is resumed too)."""
    data = loader(n=80, batch_size=8)  # 10 steps per epoch

    torch.manual_seed(0)
    straight = MLPModule(optimizer="adam", lr=0.01)
    make_trainer(tmp_path / "a", callbacks=[make_callback()], max_epochs=2).fit(straight, data)

    torch.manual_seed(0)
    first = MLPModule(optimizer="adam", lr=0.01)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    make_trainer(tmp_path / "b", callbacks=[make_callback(), ckpt], max_epochs=1, enable_checkpointing=True).fit(
        first, data
    )
    torch.manual_seed(1)  # resuming must not depend on the fresh model's init
    resumed = MLPModule(optimizer="adam", lr=0.01)
    callback = make_callback()
    trainer = make_trainer(tmp_path / "c", callbacks=[callback], max_epochs=2)
    trainer.fit(resumed, data, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))

    assert trainer.global_step == 20
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name
    if not isinstance(callback, AdaptiveGradClip):
        saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["callbacks"][type(callback).__name__]
        assert saved["policies"][0], "the policy state is in the checkpoint"


class InfAtStep(MLPModule):
    """One gradient becomes Inf on step ``bad``; after the callbacks ran, that step's gradients are zeroed (SGD then
    leaves the weights alone), as a skip would."""

    bad = 6

    def on_after_backward(self) -> None:
        if self.trainer.global_step == self.bad:
            self.head.bias.grad.fill_(math.inf)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.trainer.global_step == self.bad:
            for q in self.parameters():
                q.grad.zero_()


@pytest.mark.parametrize("case", ["autoclip", "zclip"])
def test_non_finite_norm_never_enters_the_statistics(tmp_path: Path, case: str) -> None:
    make_callback, make_ref = CASES[case]
    callback = make_callback()
    torch.manual_seed(0)
    model = InfAtStep()
    make_trainer(tmp_path, callbacks=[callback]).fit(model, loader(n=STEPS * 8, batch_size=8))

    ref = make_ref()
    torch.manual_seed(0)
    ref_model = MLPModule()
    opt = ref_model.configure_optimizers()
    for k, (x, y) in enumerate(loader(n=STEPS * 8, batch_size=8)):
        opt.zero_grad()
        nn.functional.mse_loss(ref_model(x), y).backward()
        if k == InfAtStep.bad:
            ref_model.head.bias.grad.fill_(math.inf)
        ref(ref_model)  # the reference drops non-finite norms from its statistics
        if k == InfAtStep.bad:
            opt.zero_grad(set_to_none=False)
        opt.step()

    for (name, a), b in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    state = callback.state_dict()["policies"][0]
    if isinstance(ref, ZClipRef):
        assert int(state["count"]) == STEPS - 1
        assert float(state["mean"]) == pytest.approx(ref.mean, rel=1e-6)
        assert float(state["var"]) == pytest.approx(ref.var, rel=1e-5)
    else:
        assert int(state["count"]) == STEPS - 1
        assert sorted(state["history"].tolist()) == pytest.approx(sorted(ref.history), rel=1e-6)


@pytest.mark.parametrize(
    ("factory", "argument"),
    [
        (lambda: ClipGradNorm(0.0), "max_norm"),
        (lambda: ClipGradNorm(-1.0), "max_norm"),
        (lambda: ClipGradNorm(1.0, norm_type=0.5), "norm_type"),
        (lambda: ClipGradValue(0.0), "clip_value"),
        (lambda: AdaptiveGradClip(clip_factor=0.0), "clip_factor"),
        (lambda: AdaptiveGradClip(eps=-1.0), "eps"),
        (lambda: AdaptiveGradClip(exclude=["re:("]), "exclude"),
        (lambda: AdaptiveGradClip(exclude=["not a class"]), "exclude"),
        (lambda: AutoClip(percentile=0.0), "percentile"),
        (lambda: AutoClip(percentile=100.5), "percentile"),
        (lambda: AutoClip(history_size=0), "history_size"),
        (lambda: ZClip(alpha=0.0), "alpha"),
        (lambda: ZClip(alpha=1.0), "alpha"),
        (lambda: ZClip(z_threshold=0.0), "z_threshold"),
        (lambda: ZClip(warmup_steps=0), "warmup_steps"),
        (lambda: ZClip(max_norm=-2.0), "max_norm"),
    ],
)
def test_bad_arguments_raise_naming_the_argument_and_value(factory: Callable, argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        factory()


def test_exclude_pattern_matching_nothing_fails_at_setup(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[AdaptiveGradClip(exclude=["Linear", "re:^classifier"])])
    with pytest.raises(ValueError, match=r"'re:\^classifier' matches no trainable parameter"):
        trainer.fit(MLPModule(), loader())


def test_exclude_by_class_name_leaves_those_parameters_unclipped(tmp_path: Path) -> None:
    """Excluding every ``Linear`` leaves nothing to clip: AGC is then a no-op against plain training."""
    got, _ = lightning_params(tmp_path, AdaptiveGradClip(clip_factor=0.001, exclude=["Linear"]))
    expected = reference_params(lambda model: None)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_two_clipping_callbacks_fail_at_setup(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[ClipGradNorm(1.0), ZClip()])
    with pytest.raises(ValueError, match="Keep exactly one"):
        trainer.fit(MLPModule(), loader())


@pytest.mark.parametrize("kind", [ClipGradNorm, AutoClip])
def test_two_clipping_callbacks_of_one_class_are_refused_at_trainer_construction(tmp_path: Path, kind: type) -> None:
    """One state key per class, the same behind every door: Lightning's own check refuses the twins, naming them (two
    clippers of different classes reach gradkit's check at setup, above)."""
    twins = [kind(1.0), kind(1.0)] if kind is ClipGradNorm else [kind(), kind()]
    with pytest.raises(RuntimeError, match=rf"more than one stateful callback of type `{kind.__name__}`"):
        make_trainer(tmp_path, callbacks=twins)


def test_clipping_state_is_saved_under_the_class_name(tmp_path: Path) -> None:
    """The key checkpoints have always used: a checkpoint written before or after this version loads either way."""
    trainer = make_trainer(tmp_path, callbacks=[ClipGradNorm(1.0)], enable_checkpointing=True, max_steps=2)
    trainer.fit(MLPModule(), loader())
    path = tmp_path / "two_steps.ckpt"
    trainer.save_checkpoint(path)
    assert "ClipGradNorm" in torch.load(path, weights_only=False)["callbacks"]


def test_trainer_gradient_clip_val_with_a_clipping_callback_fails_at_setup(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[AutoClip()], gradient_clip_val=1.0)
    with pytest.raises(ValueError, match="Use one"):
        trainer.fit(MLPModule(), loader())


@pytest.mark.parametrize("case", list(CASES))
def test_only_adaptive_clippers_log_a_threshold(tmp_path: Path, case: str) -> None:
    # The class docstrings are the reference: every clipper logs the four norm keys; AutoClip and ZClip, whose
    # threshold moves with the history, also log `grad_clip/threshold`. ClipGradNorm's would be `max_norm` forever.
    callback = CASES[case][0]()
    _, rows = lightning_params(tmp_path, callback)
    logged = {key for row in rows for key, value in row.items() if key.startswith("grad_clip/") and value != ""}
    expected = {"grad_clip/pre_clip_norm", "grad_clip/post_clip_norm", "grad_clip/coef", "grad_clip/clipped_fraction"}
    if case in ("autoclip", "zclip"):
        expected.add("grad_clip/threshold")
    assert logged == expected
    assert set(callback.metrics()) == expected
