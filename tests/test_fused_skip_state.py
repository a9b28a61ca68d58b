"""A skipped step of a fused optimizer leaves its state as a run without the skipped batch has it, also when the
skipped step is the one that would have created the state (the first step, or the first after a moment reset).

torch's fused ``step`` builds lazy state before its kernel reads ``found_inf`` and keeps it when the kernel skips:
``SGD(momentum=0.9, fused=True)`` keeps ``torch.empty_like`` momentum buffers, which the next step reads as momentum
(parameters off by 1e18 and more after 25 steps), Adam keeps zero moments and a step count of 0. The reference is a
plain loop with the same optimizer on the batches without the bad one: parameters and the optimizer's
``state_dict`` bitwise equal after every step.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from gradkit.doors.loop import GradKit
from gradkit.policies.escalation import reset_optimizer_state_
from helpers import MLPModule, assert_same_state, count_syncs, make_trainer
from lightning_gradkit import ClipGradNorm, NonFiniteGuard

MakeOpt = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

#: Every optimizer torch ships with a fused kernel (those whose constructor takes ``fused``), each setting that
#: builds state lazily; ``sgd`` without momentum has no state at all.
FUSED: dict[str, MakeOpt] = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, fused=True),
    "sgd_dampening": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, dampening=0.5, fused=True),
    "sgd": lambda p: torch.optim.SGD(p, lr=1e-2, fused=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2, fused=True),
}
STEPS = 6


def test_every_fused_optimizer_torch_ships_is_covered() -> None:
    fused = {
        name
        for name, cls in vars(torch.optim).items()
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
        if "fused" in inspect.signature(cls.__init__).parameters
    }
    assert fused == {"SGD", "Adam", "AdamW", "Adagrad"}, f"fused optimizers changed: {fused}; cover them in FUSED"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def _batches(bad: int | None) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)) for _ in range(STEPS)]
    if bad is not None:
        batches[bad][0][0, 0] = math.nan
    return batches


def _reference(make_opt: MakeOpt, bad: int, reset_at: int | None = None) -> tuple[nn.Module, dict]:
    """A plain loop on the batches without ``bad`` (the optimizer never sees it), with the same reset."""
    model = _model()
    opt = make_opt(list(model.parameters()))
    for step, (x, y) in enumerate(_batches(bad)):
        if step == reset_at:
            reset_optimizer_state_(opt, list(model.parameters()))
        if step == bad:
            continue
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt.state_dict()


def _door(make_opt: MakeOpt, bad: int, reset_at: int | None = None, scaler: bool = False) -> tuple[nn.Module, dict]:
    model = _model()
    opt = make_opt(list(model.parameters()))
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaler else None
    kit = GradKit(model, opt, NonFiniteGuard("skip", forensics=False), log_every_n_steps=0, log_dir=False,
                  scaler=grad_scaler)  # fmt: skip
    for step, (x, y) in enumerate(_batches(bad)):
        if step == reset_at:
            reset_optimizer_state_(opt, list(model.parameters()))
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        (grad_scaler.scale(loss) if grad_scaler is not None else loss).backward()
        kit.note_loss(loss)
        kit.step(opt)
    kit.close()
    return model, opt.state_dict()


def _assert_same_run(ours: tuple[nn.Module, dict], ref: tuple[nn.Module, dict]) -> None:
    for (name, a), b in zip(ours[0].named_parameters(), ref[0].parameters(), strict=True):
        assert torch.equal(a, b), f"{name}: {(a - b).abs().max().item():.3g} from the run without the bad batch"
    assert_same_state(ours[1], ref[1], "optimizer.state_dict()")


@pytest.mark.parametrize("name", sorted(FUSED))
def test_a_skipped_first_fused_step_leaves_the_optimizer_as_a_fresh_one(name: str) -> None:
    _assert_same_run(_door(FUSED[name], bad=0), _reference(FUSED[name], bad=0))


@pytest.mark.parametrize("name", ["sgd_momentum", "adam"])
def test_a_skipped_fused_step_right_after_a_moment_reset_leaves_the_reset_state(name: str) -> None:
    _assert_same_run(_door(FUSED[name], bad=3, reset_at=3), _reference(FUSED[name], bad=3, reset_at=3))


@pytest.mark.parametrize("name", ["sgd_momentum", "adamw"])
def test_a_first_step_skipped_by_the_guard_and_a_grad_scaler_leaves_no_state(name: str) -> None:
    # Power-of-two loss scales are exact: unscaled gradients equal the unscaled run's bitwise, so the reference needs
    # no scaler (the scaler's halved scale after the skip changes nothing else).
    _assert_same_run(_door(FUSED[name], bad=0, scaler=True), _reference(FUSED[name], bad=0))


def test_a_clean_fused_step_reads_nothing_on_the_host_after_the_first() -> None:
    model = _model()
    opt = FUSED["sgd_momentum"](list(model.parameters()))
    kit = GradKit(model, opt, NonFiniteGuard("skip", forensics=False), log_every_n_steps=0, log_dir=False)
    syncs = []
    for x, y in _batches(None):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        kit.note_loss(loss)
        with count_syncs() as counter, counter.active():
            kit.step(opt)
        syncs.append(counter.total)
    kit.close()
    # The first step creates the momentum buffers: the flag is read once there, to know whether to keep them.
    assert syncs[0] == 1 and syncs[1:] == [0] * (STEPS - 1), syncs


class _FusedSGDModule(MLPModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9, fused=True)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        if batch_idx == 0:
            x = x.clone()
            x[0, 0] = math.nan
        return nn.functional.mse_loss(self(x), y)


def test_trainer_skipping_the_first_fused_sgd_step_equals_the_run_without_that_batch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = _FusedSGDModule()
    torch.manual_seed(0)
    reference = MLPModule()
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(40, 8, generator=g), torch.randn(40, 1, generator=g))
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[NonFiniteGuard("skip", forensics=False)])
    with pytest.warns(UserWarning, match=r"NonFiniteGuard: 1 optimizer step\(s\) .* between steps 0 and 0"):
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    opt = torch.optim.SGD(reference.parameters(), lr=1e-2, momentum=0.9, fused=True)
    for i in range(1, 10):  # batch 0 left out
        x, y = data[i * 4 : i * 4 + 4]
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(reference(x), y).backward()
        opt.step()
    assert trainer.global_step == 10
    for (name, a), b in zip(module.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert_same_state(trainer.optimizers[0].state_dict(), opt.state_dict(), "optimizer.state_dict()")


def test_a_fused_optimizer_with_an_unfused_group_is_clipped_and_skipped_as_an_ordinary_one() -> None:
    # torch accepts `fused=False` on one group of a fused Adam; that group's kernel refuses `grad_scale`/`found_inf`,
    # so the clip is written into the gradients and the skip read on the host. Reference: clip_grad_norm_ and the
    # same optimizer, the bad batch left out.
    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam([{"params": params[:2]}, {"params": params[2:], "fused": False}], lr=1e-2, fused=True)

    def run(door: bool) -> tuple[nn.Module, dict]:
        model = _model()
        opt = make(list(model.parameters()))
        kit = GradKit(model, opt, [ClipGradNorm(0.05), NonFiniteGuard("skip", forensics=False)], log_every_n_steps=0,
                      log_dir=False) if door else None  # fmt: skip
        for step, (x, y) in enumerate(_batches(2)):
            opt.zero_grad(set_to_none=True)
            if kit is None and step == 2:
                continue
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if kit is None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                opt.step()
            else:
                kit.note_loss(loss)
                bad = pytest.warns(UserWarning, match="non-finite loss and gradients at step 2")
                with bad if step == 2 else nullcontext():
                    kit.step(opt)
        return model, opt.state_dict()

    _assert_same_run(run(door=True), run(door=False))
