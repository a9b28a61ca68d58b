"""The Fabric and plain-PyTorch door on a CUDA device: no host sync off logging steps with a fused optimizer
(``torch.cuda.set_sync_debug_mode("error")`` raises on any), 16-mixed and bf16-mixed under Fabric equal to the plain
door, and Fabric's FSDP1 (``FSDPStrategy``, CUDA only) equal to the plain door on one device."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from gradkit.doors.loop import GradKit
from helpers import launched_in_process
from lightning_gradkit import ClipGradNorm, GradNormMonitor, NonFiniteGuard
from test_front_doors import BATCHES, Net, _batches, _initial_state, _optimizer

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:NonFiniteGuard:UserWarning")]


def _policies() -> list[Any]:
    return [GradNormMonitor(depth=1), ClipGradNorm(max_norm=0.5), NonFiniteGuard(action="skip")]


def _cuda_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.cuda(), y.cuda()) for x, y in _batches()]


def test_plain_door_on_cuda_skips_with_zero_host_syncs_with_a_fused_optimizer() -> None:
    model = Net().cuda()
    model.load_state_dict(_initial_state())
    opt = torch.optim.Adam(model.parameters(), lr=0.05, fused=True)
    kit = GradKit(model, opt, _policies(), log=lambda metrics, step: None, log_every_n_steps=1000)
    for i, (x, y) in enumerate(_cuda_batches()):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if i > 0:  # the first step logs the monitor's first values (one transfer)
            torch.cuda.set_sync_debug_mode("error")
        try:
            kit.note_loss(loss)
            kit.step(opt)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        opt.zero_grad(set_to_none=True)
    assert kit.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _run(fabric: Fabric | None, precision: str) -> dict[str, torch.Tensor]:
    net = Net()
    net.load_state_dict(_initial_state())
    model: nn.Module = net
    if fabric is not None:
        model = fabric.setup_module(net)
        opt = fabric.setup_optimizers(_optimizer("sgd", model.parameters()))
    else:
        model = net.cuda()
        opt = _optimizer("sgd", model.parameters())
    kit = GradKit(model, opt, _policies(), fabric=fabric, log_every_n_steps=1, max_steps=BATCHES)
    model.train()
    for x, y in _cuda_batches():
        loss = nn.functional.mse_loss(model(x).float(), y)
        if fabric is not None:
            fabric.backward(loss)
        else:
            loss.backward()
        kit.note_loss(loss)
        kit.step(opt)
        opt.zero_grad(set_to_none=True)
    assert kit.skipped_steps == 1, precision
    return {k: v.detach().float().cpu() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("strategy", ["auto", "fsdp"])
def test_fabric_door_on_cuda_equals_the_plain_door(strategy: str) -> None:
    fabric = Fabric(accelerator="cuda", devices=1, strategy=strategy, precision="32-true")
    with launched_in_process(fabric):  # FSDP refuses `setup_module` before `launch()`, even on one device
        state = _run(fabric, "32-true")
    reference = _run(None, "32-true")
    for key, value in reference.items():
        torch.testing.assert_close(state[key.replace("_fsdp_wrapped_module.", "")], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_fabric_door_with_mixed_precision_on_cuda_skips_the_nan_step(precision: str) -> None:
    fabric = Fabric(accelerator="cuda", devices=1, precision=precision)
    state = _run(fabric, precision)
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    # The NaN step was skipped: BatchNorm counted every batch but that one.
    assert int(state["norm.num_batches_tracked"]) == BATCHES - 1
