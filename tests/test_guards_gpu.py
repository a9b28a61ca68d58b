"""NonFiniteGuard on a CUDA device: the fault matrix under bf16-mixed and 16-mixed, and a fused Adam that skips a
step with no host synchronization at all (``torch.cuda.set_sync_debug_mode("error")`` raises on any)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision

from helpers import loader, make_trainer
from lightning_gradkit import NonFiniteGuard
from test_guards import NAN, FaultModule, events, expected_culprit, fit, make_fault, state_equal

pytestmark = pytest.mark.gpu


def precision_kwargs(precision: str) -> dict[str, Any]:
    if precision == "16-mixed":
        return {
            "plugins": [MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cuda", init_scale=2.0**12))]
        }
    return {"precision": precision}


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("kind", ["loss", "grad", "activation"])
@pytest.mark.parametrize("value", [NAN, float("inf")], ids=["nan", "inf"])
def test_fault_matrix_on_gpu(tmp_path: Path, precision: str, kind: str, value: float) -> None:
    fault = make_fault(kind, value)
    model, trainer, _ = fit(tmp_path, fault, accelerator="gpu", **precision_kwargs(precision))
    k = fault.batch_idx
    assert state_equal(model.snapshots[k], model.snapshots[k + 1])
    assert not state_equal(model.snapshots[k + 1], model.snapshots[k + 2])
    (event,) = [e for e in events(trainer) if e["step"] == k]
    assert event["culprit"] == expected_culprit(fault)


def _no_sync(trainer: Any, method: Any, replay_step: int) -> Any:
    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        # Step 0 is checked on its own in test_first_step_sync.py; `replay_step` learns that the step before it was
        # flagged and replays it (a host read per operator, on that step only).
        if trainer.global_step in (0, replay_step):
            return method(*args, **kwargs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return method(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return wrapped


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_fused_adam_skips_with_zero_host_syncs(tmp_path: Path, precision: str) -> None:
    fault = make_fault("loss", NAN)
    torch.manual_seed(0)
    model = FaultModule(fault, fused=True)
    trainer = make_trainer(
        tmp_path,
        accelerator="gpu",
        strategy="gradkit",
        callbacks=[NonFiniteGuard()],
        log_every_n_steps=1000,
        **precision_kwargs(precision),
    )
    # Every optimizer step after the first but the replay's (training step, backward, engine, guard, fused Adam with
    # found_inf) runs with CUDA's sync debug mode set to "error": any device-to-host synchronization inside it raises.
    k = fault.batch_idx
    trainer.strategy.optimizer_step = _no_sync(trainer, trainer.strategy.optimizer_step, replay_step=k + 1)
    with pytest.warns(UserWarning, match="between steps 2 and 2"):
        trainer.fit(model, loader())
    assert state_equal(model.snapshots[k], model.snapshots[k + 1])
    assert not state_equal(model.snapshots[k + 1], model.snapshots[k + 2])
    (event,) = events(trainer)
    assert (event["culprit"], event["culprit_source"]) == ("<loss>", "replay")  # replayed one step late
