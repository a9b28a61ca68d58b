"""A skipped step leaves no trace in the policies' statistics: the run is the run on the data without that batch.

The reference of every test is the same run, with the same policies, on the data with the bad batch removed (a
hand-written loop through the loop door, or a ``Trainer`` on the shorter dataset). A skipped step leaves parameters
and optimizer state bitwise as they were, so the two runs apply the same updates only if every policy's statistics
(ZClip's EMA, AutoClip's ring of norms, SpikeGuard's and SpikeRollback's running moments) left the skipped step out
too: the final parameters and the statistics are compared bitwise (``torch.equal``). A gradient gust after the bad
batch makes the clippers clip, to a threshold the skipped step would have moved (before the fix: ZClip's clip of the
gust 3.2e-3 off, AutoClip's next clip 5.3e-2 off, the final parameters 8.7e-4 and 1.3e-2 off, relative).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Subset

from gradkit.doors.loop import GradKit
from helpers import MLPModule, assert_same_state, make_trainer, regression_data
from lightning_gradkit import AutoClip, NonFiniteGuard, SpikeGuard, SpikeRollback, ZClip

STEPS, BATCH, BAD = 56, 8, 40  # batch BAD is the bad one: a loss spike, or a non-finite gradient under a finite loss
GUST = 48  # a gradient 3 times as large, which the clippers clip (to a threshold the skipped batch would move)


# The policy under test: a clipper, or SpikeRollback (whose statistics see the spike, flagged, without firing).
_UNDER_TEST = {
    "zclip": lambda: ZClip(warmup_steps=10, z_threshold=1.0),
    "autoclip": lambda: AutoClip(percentile=50.0, history_size=32),
    "rollback": lambda: SpikeRollback("loss", warmup_steps=10, snapshot_every_n_steps=1000),
}


def _policies(kind: str, fault: str) -> list[Any]:
    """The policy under test, and the guard that skips the bad batch: SpikeGuard for a loss spike (the gradient is
    finite), NonFiniteGuard for a non-finite gradient (SpikeGuard then watches the finite loss and warns)."""
    tested = _UNDER_TEST[kind]()
    if fault == "loss_spike":
        return [tested, SpikeGuard("loss", action="skip", warmup_steps=10)]
    return [tested, SpikeGuard("loss", action="warn", warmup_steps=10), NonFiniteGuard("skip")]


def _statistics(policies: list[Any]) -> list[Any]:
    """What each policy keeps of the past steps: the clipper's per-optimizer state, SpikeGuard's and SpikeRollback's
    running moments (not the counts of skipped steps and spikes, which differ by the skip)."""
    kept = {ZClip: "policies", AutoClip: "policies", SpikeGuard: "stats", SpikeRollback: "stats"}
    return [p.state_dict()[kept[type(p)]] for p in policies if type(p) in kept]


def _loop_run(
    kind: str, fault: str, optimizer: str, bad: bool, device: str = "cpu"
) -> tuple[nn.Module, list[Any], list[bool | None]]:
    """The loop door over the STEPS batches (``bad``: batch BAD spoiled) or over all but batch BAD."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
    if optimizer == "adamw_fused":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policies = _policies(kind, fault)
    kit = GradKit(model, opt, policies, log_dir=False, log_every_n_steps=5)
    data = regression_data(STEPS * BATCH)
    applied = []
    for step in range(STEPS):
        if step == BAD and not bad:
            continue
        x, y = (t.to(device) for t in data[step * BATCH : (step + 1) * BATCH])
        loss = nn.functional.mse_loss(model(x), y)
        spoiled = step == BAD
        if spoiled and fault == "loss_spike":
            loss = loss * 50.0  # a finite spike: the gradient is 50 times as large, finite
        loss.backward()
        if spoiled and fault == "nan_grad":
            model[0].weight.grad[0, 0] = float("nan")  # a non-finite gradient under a finite loss
        if step == GUST:
            for p in model.parameters():
                p.grad.mul_(3.0)
        kit.note_loss(loss)
        applied.append(kit.step(opt))
        opt.zero_grad(set_to_none=True)
    kit.finish()
    return model, policies, applied


CASES = [(kind, fault) for kind in _UNDER_TEST for fault in ("loss_spike", "nan_grad")]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw_fused"])
@pytest.mark.parametrize(("kind", "fault"), CASES)
def test_loop_door_skipped_batch_leaves_the_run_of_the_data_without_it(kind: str, fault: str, optimizer: str) -> None:
    """ZClip's EMA, AutoClip's ring, SpikeGuard's and SpikeRollback's moments leave the skipped step out (a fused
    optimizer's skip, only on device at the step, reaches them one step late): parameters and statistics are the
    reference's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the guards' reports of the bad batch
        model, policies, applied = _loop_run(kind, fault, optimizer, bad=True)
        reference, reference_policies, reference_applied = _loop_run(kind, fault, optimizer, bad=False)
    skipped = [step for step, done in enumerate(applied) if done is False]
    if optimizer == "sgd":  # a fused optimizer's skip is never read at the step (`kit.step` returns None)
        assert skipped == [BAD] and all(reference_applied)
    assert_same_state(_statistics(policies), _statistics(reference_policies))
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.gpu
def test_cuda_fused_skip_reaches_the_statistics_one_step_late() -> None:
    """On CUDA the fused optimizer's skip flag reaches the host through a pinned copy, never read at the step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, policies, applied = _loop_run("zclip", "loss_spike", "adamw_fused", bad=True, device="cuda")
        reference, reference_policies, _ = _loop_run("zclip", "loss_spike", "adamw_fused", bad=False, device="cuda")
    assert applied[BAD] is None  # not read at the step (only a logging step's report reads its own step's flag)
    assert_same_state(_statistics(policies), _statistics(reference_policies))
    assert policies[1].state_dict()["skipped_steps"] == 1.0
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name


# -- behind the Trainer -------------------------------------------------------------------------------------------
class _SpikyMLP(MLPModule):
    """MLPModule whose loss of batch ``spike_at`` is multiplied by 50 (a finite spike) and whose gradients of batch
    ``gust_at`` are multiplied by 3."""

    def __init__(self, spike_at: int | None, gust_at: int) -> None:
        super().__init__(lr=0.1)
        self.spike_at, self.gust_at = spike_at, gust_at
        self.gusts = 0

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * 50.0 if batch_idx == self.spike_at else loss

    def on_after_backward(self) -> None:
        if self.trainer.fit_loop.epoch_loop.batch_idx == self.gust_at:
            self.gusts += 1
            for p in self.parameters():
                p.grad.mul_(3.0)


def _trainer_run(tmp_path: Path, clipper: str, bad: bool) -> tuple[_SpikyMLP, list[Any]]:
    torch.manual_seed(0)
    data = regression_data(STEPS * BATCH)
    kept = range(len(data)) if bad else [i for i in range(len(data)) if i // BATCH != BAD]
    policies = _policies(clipper, "loss_spike")
    model = _SpikyMLP(BAD, GUST) if bad else _SpikyMLP(None, GUST - 1)  # without batch BAD, GUST comes one earlier
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=policies, logger=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(Subset(data, list(kept)), batch_size=BATCH))
    return model, policies


@pytest.mark.parametrize("clipper", ["zclip", "autoclip"])
def test_trainer_skipped_spike_leaves_the_run_of_the_data_without_it(tmp_path: Path, clipper: str) -> None:
    model, policies = _trainer_run(tmp_path / "spiky", clipper, bad=True)
    reference, reference_policies = _trainer_run(tmp_path / "reference", clipper, bad=False)
    assert policies[1].state_dict()["skipped_steps"] == 1.0 and model.gusts == reference.gusts == 1
    assert_same_state(_statistics(policies), _statistics(reference_policies))
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name
