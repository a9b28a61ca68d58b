"""SpikeRollback's escalation: a spike that comes back after a plain rollback is cured only by the escalation
(an LR cut with a re-warmup, optionally a reset of the optimizer moments), and the escalated run equals, bitwise, a
plain PyTorch loop that restores the same snapshots and applies the same cut and reset by hand.

The persistent fault is in the LR schedule: a ``LambdaLR`` multiplies the learning rate by ``FAULT`` for the
scheduler's steps ``FAULT_STEPS``. A rollback restores the scheduler, so the fault comes back after it, as a fault
of the configuration does in a real run; a cut learning rate goes through it.
"""

from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from gradkit.policies.escalation import reset_optimizer_state_, rewarmup_factor
from gradkit.step.snapshot import Snapshot
from helpers import make_trainer, regression_data
from lightning_gradkit import SpikeRollback
from test_guards import events
from test_rollback import ResumableLoader

N_BATCHES, BATCH, LR = 64, 32, 0.01
FAULT, FAULT_STEPS = 100.0, range(26, 34)


def schedule(k: int) -> float:
    return FAULT if k in FAULT_STEPS else 1.0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(x))


def make_optimizer(net: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule)


class FaultyScheduleModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.losses: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self) -> Any:
        opt, sched = make_optimizer(self)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data() -> DataLoader:
    """Noiseless targets: the loss falls smoothly, so only the fault makes it spike."""
    x = regression_data(N_BATCHES * BATCH).tensors[0]
    y = (x[:, :1] * 2.0 - x[:, 1:2]).tanh()
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def make_rollback(**kwargs: Any) -> SpikeRollback:
    args: dict[str, Any] = dict(
        z_threshold=4.0, alpha=0.9, warmup_steps=8, patience=1, snapshot_every_n_steps=4, keep=2, max_rollbacks=4
    )
    args.update(kwargs)
    return SpikeRollback("loss", **args)


def fit(tmp_path: Path, rollback: SpikeRollback | None) -> tuple[FaultyScheduleModule, pl.Trainer]:
    torch.manual_seed(0)
    model = FaultyScheduleModule()
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[rollback] if rollback is not None else [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data())
    return model, trainer


def escalating(**kwargs: Any) -> SpikeRollback:
    return make_rollback(escalate_lr_factor=0.02, escalate_rewarmup_steps=100, **kwargs)


def reference_run(rollbacks: list[dict[str, Any]], escalations: list[dict[str, Any]]) -> Net:
    """Plain PyTorch: the same Net, Adam and faulty LambdaLR over the same batches. The events say when a rollback
    fired and to which step; the loop keeps its own copy of the state before every batch, restores it there (the
    step that fired is not applied), and cuts the learning rate and resets the moments as the escalation says."""
    torch.manual_seed(0)
    net = Net()
    opt, sched = make_optimizer(net)
    fired = {e["step"]: e for e in rollbacks}
    escalated = {e["step"]: e for e in escalations}
    states: dict[int, Any] = {}
    cut: tuple[float, int] | None = None  # (first multiplier, applied steps since the escalation)
    for step, (x, y) in enumerate(data()):
        states[step] = copy.deepcopy((net.state_dict(), opt.state_dict(), sched.state_dict()))
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        if step in fired:
            for obj, state in zip((net, opt, sched), states[fired[step]["to_step"]], strict=True):
                obj.load_state_dict(copy.deepcopy(state))
            if step in escalated:
                e = escalated[step]
                cut = (e["lr_factor"], 0)
                modules = [m.removeprefix("net.") for m in e["reset_modules"]]
                for name, p in net.named_parameters():
                    if e["reset_moments"] == "all" or any(name.startswith(m + ".") for m in modules):
                        opt.state.pop(p, None)  # a fresh Adam's state: built at the parameter's next step
            continue
        scheduled = [g["lr"] for g in opt.param_groups]
        if cut is not None:
            start, done = cut
            factor = 1.0 if done >= 100 else start + (1.0 - start) * done / 100
            for g in opt.param_groups:
                g["lr"] = g["lr"] * factor
            cut = (start, done + 1)
        opt.step()
        for g, lr in zip(opt.param_groups, scheduled, strict=True):
            g["lr"] = lr
        sched.step()
    return net


def rollback_events(trainer: pl.Trainer, what: str) -> list[dict[str, Any]]:
    return [e for e in events(trainer.log_dir) if e["what"] == what]


def test_spike_that_comes_back_after_a_rollback_is_cured_only_by_escalation(tmp_path: Path) -> None:
    # The fault begins at the scheduler's step 26: the rollback at step 27 restores the snapshot of step 24, and the
    # restored scheduler walks into the fault again. Plain rollbacks meet it again and again until the budget is
    # spent; the escalated one (step 31) restores that state once more (as of step 28, where the run resumed from it)
    # and goes through the fault at 2% of the rate.
    with pytest.raises(RuntimeError, match="budget of `max_rollbacks=4` is spent"):
        fit(tmp_path / "plain", make_rollback())
    plain = [e["what"] for e in events(tmp_path / "plain" / "logs" / "version_0")]
    assert plain == ["rollback"] * 4 + ["rollback_stopped"]
    model, trainer = fit(tmp_path / "escalated", escalating())
    first, second = rollback_events(trainer, "rollback")
    (escalation,) = rollback_events(trainer, "escalation")
    assert (first["step"], first["to_step"], second["step"], second["to_step"]) == (27, 24, 31, 28)
    assert escalation["step"] == 31 and escalation["lr_factor"] == 0.02 and escalation["rewarmup_steps"] == 100
    assert escalation["steps_since_previous"] == 31 - 28 and escalation["reset_moments"] == "none"
    before = sum(model.losses[16:24]) / 8
    assert sum(model.losses[-8:]) / 8 < before  # back on track, below the loss before the fault
    assert all(math.isfinite(v) for v in model.losses)


@pytest.mark.parametrize("reset", ["none", "all", "spiking"])
def test_escalated_run_equals_a_plain_loop_that_restores_cuts_the_rate_and_resets_the_moments_bitwise(
    tmp_path: Path, reset: str
) -> None:
    model, trainer = fit(tmp_path, escalating(escalate_reset_moments=reset))
    rollbacks = rollback_events(trainer, "rollback")
    (escalation,) = rollback_events(trainer, "escalation")
    assert escalation["reset_moments"] == reset
    if reset == "all":
        assert escalation["reset_params"] == len(list(model.parameters()))
    if reset == "spiking":
        # The LR fault makes every module's gradient spike (see the next test for one module alone).
        assert escalation["reset_modules"] == ["net.blocks", "net.head"] and min(escalation["module_z"].values()) > 4
    expected = reference_run(rollbacks, [escalation])
    for (name, p), ref in zip(model.net.named_parameters(), expected.parameters(), strict=True):
        assert torch.equal(p.detach(), ref.detach()), name
    # Outside `optimizer.step` the param groups hold the schedule's value, as the scheduler and a checkpoint see it.
    assert trainer.optimizers[0].param_groups[0]["lr"] == LR


class HeadSpikeModule(FaultyScheduleModule):
    """No LR fault; in the batches ``BAD_HEAD`` the head's gradient is multiplied by 1000 (Adam, being invariant to
    the scale, hardly notices: the total gradient norm spikes, from the head alone). Records Adam's state after every
    batch, keyed by ``global_step``."""

    BAD_HEAD = (26, 29)

    def __init__(self) -> None:
        super().__init__()
        self.states: dict[int, dict[str, Any]] = {}
        self.hooks: list[Any] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if batch_idx in self.BAD_HEAD:
            self.hooks = [p.register_hook(lambda g: g * 1000.0) for p in self.net.head.parameters()]
        return super().training_step(batch, batch_idx)

    def on_after_backward(self) -> None:
        for handle in self.hooks:
            handle.remove()
        self.hooks = []

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=LR)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        opt = self.trainer.optimizers[0]
        self.states[self.trainer.global_step] = {
            n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in self.net.named_parameters()
        }


def test_spiking_reset_resets_the_moments_of_the_module_whose_gradient_spiked_and_no_other(tmp_path: Path) -> None:
    # Step 26 fires (patience 1) and restores the snapshot of step 24; step 29 spikes again, 2 steps after the run
    # resumed at 27: the rollback (to the snapshot of step 28) escalates and resets the head's Adam state only.
    torch.manual_seed(0)
    model = HeadSpikeModule()
    rollback = SpikeRollback(
        "grad_norm",
        z_threshold=4.0,
        alpha=0.9,
        warmup_steps=8,
        patience=1,
        snapshot_every_n_steps=4,
        escalate_reset_moments="spiking",
    )
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[rollback])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data())
    first, second = rollback_events(trainer, "rollback")
    (escalation,) = rollback_events(trainer, "escalation")
    assert (first["step"], first["to_step"], second["step"], second["to_step"]) == (26, 24, 29, 28)
    assert escalation["reset_modules"] == ["net.head"] and escalation["reset_params"] == 2
    assert escalation["lr_factor"] is None and escalation["culprit"] == "net.head"
    after, snapshot = model.states[30], model.states[28]
    for name, state in after.items():
        if name.startswith("head."):
            assert state == {}, name  # a fresh Adam: no state until its first step builds it
            continue
        assert state.keys() == snapshot[name].keys(), name
        for key, value in state.items():
            assert torch.equal(value, snapshot[name][key]), (name, key)


def test_the_reference_comparison_would_catch_a_missing_cut_or_reset(tmp_path: Path) -> None:
    """The loop without the cut, or without the reset, ends elsewhere: the bitwise comparison above has teeth."""
    _, trainer = fit(tmp_path, escalating(escalate_reset_moments="all"))
    rollbacks = rollback_events(trainer, "rollback")
    (escalation,) = rollback_events(trainer, "escalation")
    exact = reference_run(rollbacks, [escalation])
    no_reset = reference_run(rollbacks, [dict(escalation, reset_moments="none", reset_modules=[])])
    no_cut = reference_run(rollbacks, [dict(escalation, lr_factor=1.0)])
    for other in (no_reset, no_cut):
        assert not torch.equal(exact.head.weight, other.head.weight)


def test_rewarmup_factor_ramps_linearly_from_the_cut_back_to_one() -> None:
    assert [rewarmup_factor(0.2, k, 4) for k in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])
    assert rewarmup_factor(0.2, 4, 4) == 1.0


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("escalate_lr_factor", 0.0),
        ("escalate_lr_factor", 1.0),
        ("escalate_lr_factor", "half"),
        ("escalate_rewarmup_steps", 0),
        ("escalate_reset_moments", "some"),
        ("escalate_within_steps", 0),
    ],
)
def test_bad_escalation_argument_names_the_argument_and_the_value(argument: str, value: Any) -> None:
    with pytest.raises(ValueError, match=argument) as info:
        SpikeRollback(**{argument: value})
    assert repr(value) in str(info.value) or str(value) in str(info.value)


class DataLoaderResumable(ResumableLoader):
    """This module's batches, resumable mid-epoch."""

    def __init__(self) -> None:
        super().__init__(1, {})
        self.batches = list(data())


def fit_resumable(root: Path, save_at: int = 0, ckpt: Path | None = None) -> tuple[FaultyScheduleModule, pl.Trainer]:
    torch.manual_seed(0)
    model = FaultyScheduleModule()
    callbacks: list[Any] = [escalating(escalate_reset_moments="all", save_snapshots=True)]
    if save_at:
        callbacks.append(ModelCheckpoint(root, "mid", every_n_train_steps=save_at, save_top_k=-1))
    trainer = make_trainer(root, strategy="gradkit", callbacks=callbacks, enable_checkpointing=bool(save_at))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoaderResumable(), ckpt_path=ckpt)
    return model, trainer


def test_checkpoint_during_the_rewarmup_resumes_exactly(tmp_path: Path) -> None:
    # The escalation at step 31 starts the ramp; the checkpoint after step 36 is 4 applied steps into it.
    straight, t_straight = fit_resumable(tmp_path, save_at=36)
    state = torch.load(tmp_path / "mid.ckpt", weights_only=True)["callbacks"][t_straight.callbacks[0].state_key]
    assert (state["ramp_start"], state["ramp_done"], state["escalations"]) == (0.02, 4, 1)
    resumed, _ = fit_resumable(tmp_path / "resumed", ckpt=tmp_path / "mid.ckpt")
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name
    # Without the ramp's state the resumed run steps at the full rate: the comparison has teeth.
    full = torch.load(tmp_path / "mid.ckpt", weights_only=False)
    full["callbacks"][t_straight.callbacks[0].state_key].update(ramp_start=1.0, ramp_done=0)
    torch.save(full, tmp_path / "no_ramp.ckpt")
    uncut, _ = fit_resumable(tmp_path / "uncut", ckpt=tmp_path / "no_ramp.ckpt")
    assert not torch.equal(uncut.net.head.weight, straight.net.head.weight)


FRESH_CASES: dict[str, Any] = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=0.01),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=0.01),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=0.01),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=0.01, t0=2),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.01, initial_accumulator_value=0.1),
    "sgd_dampening": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, dampening=0.5),
    "groups": lambda ps: torch.optim.NAdam([{"params": ps[:1], "lr": 0.02, "betas": (0.8, 0.9)}, {"params": ps[1:]}]),
}


@pytest.mark.parametrize("case", list(FRESH_CASES))
def test_after_a_moment_reset_the_next_step_is_the_first_step_of_a_fresh_optimizer(case: str) -> None:
    """The reference: a fresh optimizer of the same class and param-group settings, built on copies of the parameters
    as they are at the reset, taking one step on the same gradients."""
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    params = list(net.parameters())
    opt = FRESH_CASES[case](params)
    x = torch.randn(16, 4)
    for _ in range(5):  # a trained state, far from a fresh one
        opt.zero_grad()
        net(x).pow(2).sum().backward()
        opt.step()
    copies = [p.detach().clone().requires_grad_() for p in params]
    fresh = FRESH_CASES[case](copies)
    assert reset_optimizer_state_(opt, params) == len(params)
    for _ in range(3):  # the first step after the reset, and the ones after it
        opt.zero_grad()
        net(x).pow(2).sum().backward()
        for c, p in zip(copies, params, strict=True):
            c.grad = p.grad.clone()
        opt.step()
        fresh.step()
        for p, c in zip(params, copies, strict=True):
            assert torch.equal(p, c)
            assert opt.state[p].keys() == fresh.state[c].keys()
            for key, value in fresh.state[c].items():
                assert torch.equal(torch.as_tensor(opt.state[p][key]), torch.as_tensor(value)), key


def test_a_rollback_after_a_reset_restores_the_state_the_reset_dropped() -> None:
    """A reset may leave a parameter without state until its next step (a fresh SGD has no momentum buffer); a
    restore of an older snapshot before that step puts the snapshot's state back, as it was."""
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    params = list(net.parameters())
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    net(torch.randn(2, 4)).sum().backward()
    opt.step()
    snap = Snapshot(net, host=True)
    snap.capture([opt])
    before = copy.deepcopy(opt.state_dict())
    reset_optimizer_state_(opt, params)
    snap.restore([opt])
    after = opt.state_dict()
    assert after["state"].keys() == before["state"].keys()
    for key, state in before["state"].items():
        assert torch.equal(after["state"][key]["momentum_buffer"], state["momentum_buffer"])
