"""The engine's first optimizer step makes no host-device synchronization either: the index tensors it builds once
(parameter groups, modules, shard weights, positions, AGC's caches) are copied from pinned memory, not from pageable
memory with a blocking copy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.overrides import TorchFunctionMode

from gradkit.step.norms import host_to_device
from helpers import MLPModule, loader, make_trainer
from lightning_gradkit import AdaptiveGradClip, GradNormMonitor


class _DeviceFactoryCalls(TorchFunctionMode):
    """Records ``torch.tensor(data, device=...)`` calls: on CUDA each is a blocking copy from pageable memory."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.tensor and kwargs.get("device") is not None:
            self.calls.append(f"torch.tensor(..., device={kwargs['device']})")
        return func(*args, **kwargs)


class _RecordFirstStep(pl.Callback):
    """Runs every callback's ``on_before_optimizer_step`` of the first step inside the recording mode."""

    def __init__(self, watched: list[pl.Callback]) -> None:
        self.mode = _DeviceFactoryCalls()
        for callback in watched:
            original = callback.on_before_optimizer_step

            def recorded(*args: Any, __original: Any = original, **kwargs: Any) -> Any:
                if args[0].global_step > 0:
                    return __original(*args, **kwargs)
                with self.mode:
                    return __original(*args, **kwargs)

            callback.on_before_optimizer_step = recorded  # type: ignore[method-assign]


# The run is shorter than its logging period on purpose (steps without logging); GradNormMonitor warns about that.
@pytest.mark.filterwarnings(r"ignore:GradNormMonitor. this run has \d+ optimizer step.s., fewer than the logging")
@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_first_engine_step_builds_no_device_tensor_from_a_host_list(tmp_path: Path, accelerator: str) -> None:
    callbacks: list[pl.Callback] = [GradNormMonitor(depth=2, param_groups=True), AdaptiveGradClip(clip_factor=0.05)]
    recorder = _RecordFirstStep(callbacks)
    trainer = make_trainer(tmp_path, accelerator=accelerator, callbacks=[*callbacks, recorder], log_every_n_steps=1000)
    trainer.fit(MLPModule(param_groups=True), loader())
    assert trainer.global_step == 8
    assert recorder.mode.calls == []


@pytest.mark.gpu
def test_host_to_device_does_not_synchronize_where_torch_tensor_does() -> None:
    values = [0, 3, 5]
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchronizing"):
            torch.tensor(values, device="cuda")  # the reference: torch's blocking copy from pageable memory
        copied = host_to_device(values, torch.long, torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert copied.device.type == "cuda" and copied.cpu().tolist() == values


@pytest.mark.gpu
def test_first_step_with_monitor_and_agc_makes_no_cuda_sync(tmp_path: Path) -> None:
    callbacks: list[pl.Callback] = [GradNormMonitor(depth=2, param_groups=True), AdaptiveGradClip(clip_factor=0.05)]
    for callback in callbacks:
        original = callback.on_before_optimizer_step

        def strict(*args: Any, __original: Any = original, **kwargs: Any) -> Any:
            torch.cuda.set_sync_debug_mode("error")  # from step 0: the step that builds the index tensors
            try:
                return __original(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        callback.on_before_optimizer_step = strict  # type: ignore[method-assign]
    # `log_every_n_steps=0`: the monitor logs nothing, not even the first and last steps it otherwise reads to the
    # host, so step 0 holds only the engine's own work (index tensors included).
    trainer = make_trainer(tmp_path, accelerator="gpu", callbacks=callbacks, log_every_n_steps=0)
    trainer.fit(MLPModule(param_groups=True), loader())
    assert trainer.global_step == 8
