"""GradNormMonitor under mixed precision: logged norms are the unscaled ones the optimizer steps with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision

from helpers import column, loader, make_trainer, read_metrics
from lightning_gradkit import GradNormMonitor
from test_monitor import RecordingModule


def _precision_kwargs(precision: str, device: str) -> dict:
    if precision == "16-mixed":
        # On CPU, plain precision="16-mixed" silently becomes bf16: pass the fp16 GradScaler plugin explicitly.
        scaler = torch.amp.GradScaler(device, init_scale=2.0**12)
        return {"plugins": [MixedPrecision("16-mixed", device, scaler=scaler)]}
    return {"precision": precision}


def _check_unscaled_norms(tmp_path: Path, precision: str, accelerator: str) -> None:
    device = "cuda" if accelerator == "gpu" else "cpu"
    model = RecordingModule(2.0)
    trainer = make_trainer(
        tmp_path,
        accelerator=accelerator,
        callbacks=[GradNormMonitor(depth=2)],
        **_precision_kwargs(precision, device),
    )
    trainer.fit(model, loader())
    rows = read_metrics(trainer)
    # The reference is taken in the LightningModule hook, which Lightning calls after `scaler.unscale_`.
    for key in ("grad_norm/total", "grad_norm/module/encoder.0", "grad_norm/module/head"):
        expected = [r[key] for r in model.reference]
        assert column(rows, key) == pytest.approx(expected, rel=1e-5), key
    # A scaled gradient would be ~4096x larger: the logged values are plainly unscaled.
    assert max(column(rows, "grad_norm/total")) < 100


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_norms_are_unscaled_cpu(tmp_path: Path, precision: str) -> None:
    _check_unscaled_norms(tmp_path, precision, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_norms_are_unscaled_gpu(tmp_path: Path, precision: str) -> None:
    _check_unscaled_norms(tmp_path, precision, "gpu")


@pytest.mark.gpu
def test_no_cuda_sync_on_non_logging_steps(tmp_path: Path) -> None:
    """8 steps with a period of 1000: the monitor logs (reads to the host) on the first and the last step only."""
    monitor = GradNormMonitor(depth=2, param_groups=True)
    original = monitor.on_before_optimizer_step
    calls = []

    def strict(*args, **kwargs):
        calls.append(None)
        if len(calls) in (1, 8):  # the first and last optimizer steps of the fit are logged
            return original(*args, **kwargs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return original(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monitor.on_before_optimizer_step = strict
    trainer = make_trainer(tmp_path, accelerator="gpu", callbacks=[monitor], log_every_n_steps=1000)
    trainer.fit(RecordingModule(2.0, param_groups=True), loader())
    assert trainer.global_step == 8
