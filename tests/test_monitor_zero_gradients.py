"""GradNormMonitor's all-zero-gradient warning names only the parameters whose gradient stays all zero, against a
record of the gradients the optimizer really received (read by hand in the model's own hook)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from architectures import ArchModule, ResNet18Like, data_loader, image_data
from gradkit.policies.monitor import ZERO_GRADIENT_STEPS
from helpers import MLPModule, count_syncs, loader, make_trainer
from lightning_gradkit import GradNormMonitor


class ZeroRecord:
    """The names of the parameters whose gradient is all zero, recorded at every optimizer step."""

    def __init__(self) -> None:
        self.steps: list[set[str]] = []

    def add(self, module: nn.Module) -> None:
        self.steps.append({n for n, p in module.named_parameters() if p.grad is not None and not p.grad.any()})

    def zero_on_first(self, k: int) -> set[str]:
        return set.intersection(*self.steps[:k])


class RecordingResNet(ArchModule):
    """ResNet-18-shaped CNN (zero-init last BN of each block); ``dead`` is a head whose output is multiplied by 0."""

    def __init__(self, dead_head: bool = False) -> None:
        super().__init__(ResNet18Like())
        self.dead = nn.Linear(3, 10) if dead_head else None
        self.record = ZeroRecord()

    def forward(self, x: Tensor) -> Tensor:
        logits = self.model(x)
        if self.dead is not None:
            logits = logits + 0.0 * self.dead(x.mean(dim=(2, 3)))
        return logits

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.record.add(self)


def zero_warnings(record: list[warnings.WarningMessage]) -> list[set[str]]:
    """The parameter names of each all-zero-gradient warning."""
    found = []
    for w in record:
        match = re.search(r"all-zero gradient.*?: (.*)\. Check that", str(w.message))
        if match:
            found.append(set(match.group(1).split(", ")))
    return found


def test_zero_init_residual_resnet_gets_no_zero_gradient_warning(tmp_path: Path) -> None:
    model = RecordingResNet()
    trainer = make_trainer(tmp_path, callbacks=[GradNormMonitor()], max_steps=ZERO_GRADIENT_STEPS + 2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(model, data_loader(image_data(n=48)))
    # The reference: step 0 really has all-zero gradients (conv1, bn1 and conv2 of each of the 8 blocks, behind the
    # zero-init BN gain), and none from step 1 on.
    assert len(model.record.steps[0]) == 32
    assert all(not zero for zero in model.record.steps[1:])
    assert zero_warnings(record) == []


def test_parameter_that_never_gets_a_gradient_signal_is_named(tmp_path: Path) -> None:
    model = RecordingResNet(dead_head=True)
    trainer = make_trainer(tmp_path, callbacks=[GradNormMonitor()], max_steps=ZERO_GRADIENT_STEPS + 2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(model, data_loader(image_data(n=48)))
    assert model.record.zero_on_first(ZERO_GRADIENT_STEPS) == {"dead.weight", "dead.bias"}
    assert zero_warnings(record) == [{"dead.weight", "dead.bias"}]


class LateGain(MLPModule):
    """A scalar gain whose gradient is zero until step ``zero_steps`` (its output is gated off until then)."""

    def __init__(self, zero_steps: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))
        self.zero_steps = zero_steps
        self.record = ZeroRecord()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        gate = 1.0 if self.global_step >= self.zero_steps else 0.0
        return nn.functional.mse_loss(self(x) * (1.0 + gate * (self.gain - 1.0)), y)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.record.add(self)


@pytest.mark.parametrize("zero_steps", [ZERO_GRADIENT_STEPS - 1, ZERO_GRADIENT_STEPS])
def test_zero_gradient_is_named_when_it_lasts_the_documented_number_of_steps(tmp_path: Path, zero_steps: int) -> None:
    model = LateGain(zero_steps)
    trainer = make_trainer(tmp_path, callbacks=[GradNormMonitor()], max_steps=ZERO_GRADIENT_STEPS + 2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(model, loader())
    expected = model.record.zero_on_first(ZERO_GRADIENT_STEPS)
    assert expected == ({"gain"} if zero_steps >= ZERO_GRADIENT_STEPS else set())
    assert zero_warnings(record) == ([expected] if expected else [])


def test_zero_gradient_watch_reads_nothing_off_logging_steps(tmp_path: Path) -> None:
    model = LateGain(zero_steps=100)
    monitor = GradNormMonitor()
    steps = ZERO_GRADIENT_STEPS + 2
    trainer = make_trainer(tmp_path, callbacks=[monitor], max_steps=steps, log_every_n_steps=1000)
    with count_syncs() as counter, warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        per_step = counter.watch_per_call(monitor, "on_before_optimizer_step")
        trainer.fit(model, loader())
    # Only the first and the last step log; the warning comes on the last one, the first logging step after the watch.
    assert len(per_step) == steps and per_step[1:-1] == [0] * (steps - 2), per_step
    assert zero_warnings(record) == [{"gain"}] == [model.record.zero_on_first(ZERO_GRADIENT_STEPS)]
