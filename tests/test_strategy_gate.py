"""The strategy's gate in the setups of issue 12: manual optimization with ``clip_gradients``, optimizers that
evaluate the closure several times, the value ``optimizer.step`` returns, and LR schedulers with ``frequency > 1``.

References: plain PyTorch loops that skip the bad step, and plain Lightning (no gradkit) with the same seed.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn

from gradkit.policies import clipping
from helpers import MLPModule, loader, make_trainer
from lightning_gradkit import ClipGradNorm, NonFiniteGuard, SpikeGuard, ZClip, clip_gradients
from test_guards import FaultModule, state_equal

NAN = float("nan")


def quiet_fit(trainer: Any, model: Any, *args: Any, **kwargs: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, *args, **kwargs)


# -- item 1: manual optimization + skip ----------------------------------------------------------------------------
BAD = {"nonfinite": 2, "spike": 9}  # the batch whose loss is NaN, or multiplied by 50
MAX_NORM = 0.5


class ManualAdam(FaultModule):
    """Manual optimization with Adam: ``manual_backward``, optionally ``clip_gradients``, ``opt.step()``."""

    def __init__(self, bad: str, clip: bool) -> None:
        super().__init__(None, optimizer="adam", lr=0.01)
        self.automatic_optimization = False
        self.bad, self.clip = bad, clip
        self.policy = clipping.ClipGradNorm(MAX_NORM)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if batch_idx == BAD[self.bad]:
            loss = loss * (NAN if self.bad == "nonfinite" else 50.0)
        self.manual_backward(loss)
        if self.clip:
            clip_gradients(self, opt, self.policy)
        opt.step()


def reference_manual(skip: int, clip: bool, n: int) -> dict[str, Tensor]:
    """Plain PyTorch: Adam over ``loader(n)`` without batch ``skip``, clipped by ``clip_grad_norm_`` if asked."""
    torch.manual_seed(0)
    model = MLPModule(lr=0.01)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for i, (x, y) in enumerate(loader(n)):
        if i == skip:
            continue
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize("clip", [True, False], ids=["clip_gradients", "no_clip"])
@pytest.mark.parametrize("bad", ["nonfinite", "spike"])
def test_manual_skip_leaves_params_and_adam_state_untouched(tmp_path: Path, bad: str, clip: bool) -> None:
    guard = (
        NonFiniteGuard(action="skip") if bad == "nonfinite" else SpikeGuard("loss", 4.0, warmup_steps=5, action="skip")
    )
    n = 128 if bad == "spike" else 64
    torch.manual_seed(0)
    model = ManualAdam(bad, clip)
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[guard])
    quiet_fit(trainer, model, loader(n))
    k = BAD[bad]
    assert state_equal(model.snapshots[k], model.snapshots[k + 1])  # parameters and Adam moments and step count
    assert not state_equal(model.snapshots[k + 1], model.snapshots[k + 2])
    expected = reference_manual(skip=k, clip=clip, n=n)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=1e-6 if clip else 0, msg=name)


# -- item 7: optimizers that evaluate the closure several times ----------------------------------------------------
class SAMLike(torch.optim.Optimizer):
    """Sharpness-aware minimization (Foret et al. 2021) in its plainest form: ``step(closure)`` evaluates the closure
    at ``w`` and at ``w + rho * g / |g|``, then steps ``w`` with the second gradient. Returns the second loss."""

    def __init__(self, params: Any, lr: float = 0.05, rho: float = 0.05) -> None:
        super().__init__(params, {"lr": lr, "rho": rho})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        with torch.enable_grad():
            closure()
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        shifts = [self.param_groups[0]["rho"] * p.grad / (norm + 1e-12) for p in params]
        torch._foreach_add_(params, shifts)
        with torch.enable_grad():
            second = closure()
        torch._foreach_sub_(params, shifts)
        torch._foreach_add_(params, [p.grad for p in params], alpha=-self.param_groups[0]["lr"])
        return second


class ClosureModule(MLPModule):
    """Counts ``training_step`` calls and records what ``optimizer.step`` returned (automatic optimization)."""

    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.kind = optimizer
        self.calls = 0
        self.returned: list[Any] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.calls += 1
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.kind == "lbfgs":
            return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=4)
        return SAMLike(self.parameters())

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        self.returned.append(optimizer.step(closure=optimizer_closure))


def returned_values(values: list[Any]) -> list[Any]:
    return [v.item() if isinstance(v, Tensor) else v for v in values]


def fit_closure_module(
    tmp_path: Path, optimizer: str, gradkit: bool, clip: bool, guard: bool = True, **kwargs: Any
) -> ClosureModule:
    torch.manual_seed(0)
    model = ClosureModule(optimizer)
    if gradkit and not guard:  # no gate: the plain strategy, gradkit only clips
        trainer = make_trainer(tmp_path / "clip_only", callbacks=[ClipGradNorm(MAX_NORM)], **kwargs)
    elif gradkit:
        callbacks: list[Any] = [NonFiniteGuard(action="skip")] + ([ClipGradNorm(MAX_NORM)] if clip else [])
        trainer = make_trainer(tmp_path / "gradkit", strategy="gradkit", callbacks=callbacks, **kwargs)
    else:
        clip_kwargs = {"gradient_clip_val": MAX_NORM} if clip else {}
        trainer = make_trainer(tmp_path / "plain", **clip_kwargs, **kwargs)
    quiet_fit(trainer, model, loader())
    return model


@pytest.mark.parametrize(
    ("clip", "guard"), [(False, True), (True, True), (True, False)], ids=["guard", "guard+clip", "clip_no_gate"]
)
@pytest.mark.parametrize("optimizer", ["lbfgs", "sam"])
def test_closure_re_evaluating_optimizer_matches_plain_lightning(
    tmp_path: Path, optimizer: str, clip: bool, guard: bool
) -> None:
    """Plain Lightning runs the closure (and its `gradient_clip_val` clip) at every evaluation; so must gradkit,
    with the gate and, clipping only, without it."""
    plain = fit_closure_module(tmp_path, optimizer, gradkit=False, clip=clip)
    gated = fit_closure_module(tmp_path, optimizer, gradkit=True, clip=clip, guard=guard)
    assert plain.calls > 8 and gated.calls == plain.calls  # more than one evaluation per step
    assert returned_values(gated.returned) == pytest.approx(returned_values(plain.returned), rel=1e-6)
    for (name, a), b in zip(plain.named_parameters(), gated.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)


def test_closure_re_evaluations_feed_adaptive_policies_once_per_step(tmp_path: Path) -> None:
    """The second evaluation of SAM is clipped to the threshold ZClip chose on the first; the statistics of ZClip
    and SpikeGuard hold one value per optimizer step."""
    torch.manual_seed(0)
    zclip = ZClip(warmup_steps=2, z_threshold=0.1)
    spike = SpikeGuard("grad_norm", warmup_steps=2, action="skip")
    norms: list[tuple[float, float]] = []

    class Recording(ClosureModule):
        def on_before_optimizer_step(self, optimizer: Any) -> None:
            # Runs after the gradkit callbacks: the total norm after clipping, and the step's threshold.
            total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.parameters()]))
            norms.append((total.item(), zclip.metrics()["grad_clip/threshold"].item()))

    model = Recording("sam")
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[zclip, spike, NonFiniteGuard()])
    quiet_fit(trainer, model, loader())
    assert model.calls == 16 and len(norms) == 16
    assert int(zclip.state_dict()["policies"][0]["count"]) == 8 and int(spike.state_dict()["stats"][0]["count"]) == 8
    for first, second in zip(norms[0::2], norms[1::2], strict=True):
        assert second[1] == first[1]  # the same threshold for both evaluations of a step
        assert second[0] <= second[1] * (1 + 1e-6)  # and the second evaluation is clipped to it


class ManualClosure(MLPModule):
    """Manual optimization: ``opt.step(closure=...)`` with a closure that back-propagates and returns the loss."""

    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.kind = optimizer
        self.returned: list[Any] = []

    configure_optimizers = ClosureModule.configure_optimizers

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        opt = self.optimizers()

        def closure() -> Tensor:
            opt.zero_grad()
            loss = nn.functional.mse_loss(self(batch[0]), batch[1])
            self.manual_backward(loss)
            return loss.detach()

        self.returned.append(opt.step(closure=closure))


@pytest.mark.parametrize("optimizer", ["lbfgs", "sam"])
def test_optimizer_step_returns_what_the_optimizer_returned(tmp_path: Path, optimizer: str) -> None:
    results = {}
    for name, kwargs in {"plain": {}, "gradkit": {"strategy": "gradkit", "callbacks": [NonFiniteGuard()]}}.items():
        torch.manual_seed(0)
        model = ManualClosure(optimizer)
        quiet_fit(make_trainer(tmp_path / name, **kwargs), model, loader())
        results[name] = returned_values(model.returned)
    assert len(results["plain"]) == 8 and results["gradkit"] == pytest.approx(results["plain"], rel=1e-6)
    # Automatic optimization: the LightningModule's `optimizer_step` hook reads it as well.
    plain = fit_closure_module(tmp_path / "auto", optimizer, gradkit=False, clip=False)
    gated = fit_closure_module(tmp_path / "auto", optimizer, gradkit=True, clip=False)
    assert returned_values(gated.returned) == pytest.approx(returned_values(plain.returned), rel=1e-6)
    assert all(v is not None for v in gated.returned)


# -- item 11: LR schedulers with a frequency ------------------------------------------------------------------------
LR, GAMMA = 0.01, 0.5


class ScheduledModule(FaultModule):
    """Adam + ``StepLR(step_size=1, gamma=0.5)`` at ``interval="step"`` with a ``frequency``; records the LR at
    each batch start. NaN losses at the batches in ``bad`` (every epoch)."""

    def __init__(self, frequency: int, bad: set[int], fused: bool = False) -> None:
        super().__init__(None, lr=LR, fused=fused)
        self.frequency = frequency
        self.bad = bad
        self.lrs: list[float] = []

    def _active(self) -> bool:
        return self._batch_idx in self.bad

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self._batch_idx = batch_idx
        loss = MLPModule.training_step(self, batch, batch_idx)
        return loss * NAN if self._active() else loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.lr, fused=self.fused or None)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": self.frequency}}


def reference_lrs(frequency: int, bad: set[int], epochs: int, batches: int = 8) -> list[float]:
    """The LR at each batch start when the scheduler steps after every ``frequency``-th applied optimizer step of an
    epoch (no accumulation: one batch per step; Lightning's count restarts each epoch)."""
    lr, out = LR, []
    for _ in range(epochs):
        applied = 0
        for b in range(batches):
            out.append(lr)
            if b in bad:
                continue
            applied += 1
            if applied % frequency == 0:
                lr *= GAMMA
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["adam", "fused_adam"])
@pytest.mark.parametrize("frequency", [1, 3])
def test_step_scheduler_with_frequency_steps_once_per_f_applied_steps(
    tmp_path: Path, frequency: int, fused: bool
) -> None:
    bad = {2, 4}  # batch 2 is Lightning's own scheduler step for frequency=3
    torch.manual_seed(0)
    model = ScheduledModule(frequency, bad, fused=fused)
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[NonFiniteGuard()], max_epochs=2)
    quiet_fit(trainer, model, loader())
    assert model.lrs == pytest.approx(reference_lrs(frequency, bad, epochs=2), rel=1e-12)
    assert trainer.lr_scheduler_configs[0].frequency == frequency  # restored after fitting


@pytest.mark.parametrize(("frequency", "accumulate"), [(3, 1), (2, 2), (3, 2)])
def test_step_scheduler_without_skips_follows_lightning(tmp_path: Path, frequency: int, accumulate: int) -> None:
    """Nothing skipped: exactly Lightning's schedule, whose count is in batches (also under accumulation)."""
    lrs = {}
    for name, kwargs in {"plain": {}, "gradkit": {"strategy": "gradkit", "callbacks": [NonFiniteGuard()]}}.items():
        torch.manual_seed(0)
        model = ScheduledModule(frequency, bad=set())
        trainer = make_trainer(tmp_path / name, max_epochs=2, accumulate_grad_batches=accumulate, **kwargs)
        quiet_fit(trainer, model, loader(n=72))
        lrs[name] = model.lrs
    assert lrs["gradkit"] == lrs["plain"] and len(set(lrs["plain"])) > 2


def test_step_scheduler_counts_survive_a_mid_epoch_resume(tmp_path: Path) -> None:
    """Resumed from a checkpoint saved after 5 steps (mid-epoch, after the skip at batch 2): the scheduler steps
    where the uninterrupted run steps it, from the counts saved in the checkpoint."""
    frequency, bad = 3, {2}
    torch.manual_seed(0)
    straight = ScheduledModule(frequency, bad)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    trainer = make_trainer(
        tmp_path / "a", strategy="gradkit", callbacks=[NonFiniteGuard(), ckpt], max_epochs=2, enable_checkpointing=True
    )
    quiet_fit(trainer, straight, loader())
    assert straight.lrs == pytest.approx(reference_lrs(frequency, bad, epochs=2), rel=1e-12)

    resumed = ScheduledModule(frequency, bad)
    trainer = make_trainer(tmp_path / "b", strategy="gradkit", callbacks=[NonFiniteGuard()], max_epochs=2)
    quiet_fit(trainer, resumed, loader(), ckpt_path=next((tmp_path / "ckpt").glob("*step=5*")))
    assert resumed.lrs == pytest.approx(straight.lrs[5:], rel=1e-12)


class IgnoresClosure(torch.optim.SGD):
    """An optimizer whose ``step`` never calls the closure it is handed (a user's bug, which Lightning catches)."""

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        super().step()


class IgnoresClosureModule(MLPModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return IgnoresClosure(self.parameters(), lr=self.lr)


def test_the_gate_runs_the_closure_so_lightnings_closure_not_executed_check_never_fires(tmp_path: Path) -> None:
    """Documented in GradKitStrategyMixin: plain Lightning stops an optimizer that ignores its closure; the gate has
    run the closure before calling the optimizer, so the optimizer steps on that evaluation's gradients, exactly as a
    plain loop (forward, backward, step) does."""
    torch.manual_seed(0)
    with pytest.raises(MisconfigurationException, match="closure hasn't been executed"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(tmp_path / "plain").fit(IgnoresClosureModule(), loader())
    torch.manual_seed(0)
    model = IgnoresClosureModule()
    trainer = make_trainer(tmp_path / "gradkit", strategy="gradkit", callbacks=[NonFiniteGuard(action="skip")])
    quiet_fit(trainer, model, loader())
    torch.manual_seed(0)
    reference = IgnoresClosureModule()
    opt = reference.configure_optimizers()
    for x, y in loader():
        opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        opt.step()
    for (name, a), b in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), name
