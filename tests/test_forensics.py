"""Forensic replay: the culprit named for faults planted at known places, and a replay that changes nothing."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from helpers import MLPModule, loader, make_trainer
from lightning_gradkit.core.norms import clean_name
from lightning_gradkit.forensics import find_nonfinite_origin, replay_training_step
from lightning_gradkit.replay import capture_rng, preserved_state


class Log(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.log(x)


class Sqrt(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.sqrt(x)


class Block(nn.Module):
    """``inner`` is followed by a functional op in the block's own forward."""

    def __init__(self, op: str = "none") -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.after = nn.Linear(4, 4)
        self.op = op

    def forward(self, x: Tensor) -> Tensor:
        h = self.inner(x)
        if self.op == "log":
            h = torch.log(h - 1e3)  # negative -> NaN, made between the submodules
        return self.after(h)


def net(*middle: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), *middle, nn.Linear(4, 1))


def origin(model: nn.Module, x: Tensor, **kwargs: Any):
    return find_nonfinite_origin(model, lambda: model(x).pow(2).mean(), **kwargs)


def test_names_the_module_whose_forward_output_turned_nan() -> None:
    model = net(nn.Tanh(), Log(), nn.Linear(4, 4))  # log of tanh output < 0 is NaN
    finding = origin(model, torch.randn(8, 4))
    assert (finding.culprit, finding.phase) == ("2", "forward")
    assert "module_type" in finding.detail and finding.detail["module_type"] == "Log"


def test_names_the_parent_when_nan_is_made_between_its_submodules() -> None:
    model = net(Block("log"))
    finding = origin(model, torch.randn(8, 4))
    assert (finding.culprit, finding.phase) == ("1", "forward_between_submodules")
    assert finding.detail["input_of"] == "1.after"


def test_names_the_batch_when_the_input_is_already_nonfinite() -> None:
    x = torch.randn(8, 4)
    x[3, 1] = float("inf")
    finding = origin(net(), x)
    assert finding.phase == "batch" and finding.culprit == "<batch>"


def test_names_the_module_whose_backward_turned_inf() -> None:
    # sqrt(relu(x)) is finite forward, its derivative at 0 is inf.
    model = net(nn.ReLU(), Sqrt())
    x = torch.full((8, 4), -10.0)
    finding = origin(model, x)
    assert (finding.culprit, finding.phase) == ("2", "backward")


def test_names_the_loss_when_the_model_output_is_finite() -> None:
    model = net()
    finding = find_nonfinite_origin(model, lambda: model(torch.randn(8, 4)).mean() / 0.0 * 0.0)
    assert (finding.culprit, finding.phase) == ("<loss>", "loss")


def test_names_a_parameter_whose_gradient_a_hook_poisoned() -> None:
    model = net()
    model[1].weight.register_hook(lambda g: g * float("nan"))
    finding = origin(model, torch.randn(8, 4))
    assert (finding.culprit, finding.phase) == ("1.weight", "parameter_gradient")


def test_a_finite_replay_reports_not_reproduced() -> None:
    finding = origin(net(), torch.randn(8, 4))
    assert finding.culprit is None and finding.phase == "not_reproduced"


def test_anomaly_mode_adds_the_forward_trace_for_that_replay_only() -> None:
    # sqrt(0) has an inf derivative; the first layer's weight gradient then sums +inf and -inf: NaN, which
    # detect_anomaly reports (it ignores inf).
    model = net(Sqrt())
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
    finding = origin(model, torch.randn(8, 4), anomaly=True)
    assert (finding.culprit, finding.phase) == ("1", "backward")
    assert "returned nan values" in finding.detail["replay_error"]
    assert "Traceback of forward call" in finding.detail["anomaly_forward_trace"]
    assert not torch.is_anomaly_enabled()


def test_hooks_are_removed_and_grads_untouched() -> None:
    model = net(nn.Tanh(), Log())
    origin(model, torch.randn(8, 4))
    assert all(p.grad is None for p in model.parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks for m in model.modules())


def test_culprit_names_drop_wrapper_components_and_the_root_is_named_root() -> None:
    assert clean_name("_orig_mod.encoder._fsdp_wrapped_module.2") == "encoder.2"
    assert clean_name("submodule.x") == "submodule.x"
    # The root module (named "") is "<root>" in a Finding.
    finding = origin(Block("log"), torch.randn(8, 4))
    assert (finding.culprit, finding.phase) == ("<root>", "forward_between_submodules")
    assert finding.detail["input_of"] == "after"


class DropoutBN(MLPModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 16))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.outputs = self(batch[0]).detach()  # the output under this step's dropout mask
        loss = nn.functional.mse_loss(self.outputs, batch[1]).requires_grad_()
        self.log("train_loss", loss)  # outside a loop this raises: the replay must silence it
        return loss


def step_outside_the_loop(model: DropoutBN, batch: Any) -> None:
    model.log = lambda *args, **kwargs: None
    try:
        model.training_step(batch, 0)
    finally:
        del model.log


def test_replay_changes_nothing_and_repeats_the_dropout_mask(tmp_path: Path) -> None:
    """RNG streams, BatchNorm running stats and grads after a replay equal those without one."""
    model = DropoutBN()
    trainer = make_trainer(tmp_path, max_steps=1)
    trainer.fit(model, loader())
    batch = next(iter(loader()))
    model.train()
    # The original step: RNG state before it, outputs, then the states everything is in afterwards.
    rng = capture_rng(full=False)
    step_outside_the_loop(model, batch)
    original_outputs = model.outputs
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    random.seed(1)
    np.random.seed(1)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    expected_next = (torch.rand(3).tolist(), random.random(), np.random.rand())
    random.seed(1)
    np.random.seed(1)
    torch.set_rng_state(rng.torch_cpu)
    step_outside_the_loop(model, batch)  # advance torch RNG exactly as the original step did
    buffers_again = {n: b.clone() for n, b in model.named_buffers()}
    for n in buffers:
        model.get_buffer(n).copy_(buffers[n])
    finding = replay_training_step(trainer, model, batch, 0, rng=rng)
    assert finding.phase == "not_reproduced"
    assert torch.equal(model.outputs, original_outputs)  # the replay saw the same dropout mask
    assert (torch.rand(3).tolist(), random.random(), np.random.rand()) == expected_next
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n
    assert any(not torch.equal(buffers[n], buffers_again[n]) for n in buffers)  # a forward does move them
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]), n


def test_preserved_state_restores_train_mode() -> None:
    model = net(nn.Dropout())
    with preserved_state(model):
        model.eval()
    assert model.training
