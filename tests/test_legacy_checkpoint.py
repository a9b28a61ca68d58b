"""Checkpoints written by an earlier layout of the package load into the current one, every gradkit state included.

``tests/data/legacy_*.ckpt`` were written by ``tests/data/make_legacy_checkpoint.py`` with lightning_gradkit
0.1.0.dev0 before the package was re-laid out (one per clipping policy with state). Resuming from them must restore
each callback's state exactly, the strategy's scheduler counts and the open accumulation window, and train on.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from helpers import loader

DATA = Path(__file__).parent / "data"

import sys  # noqa: E402

sys.path.insert(0, str(DATA))
from make_legacy_checkpoint import SAVE_AT_BATCH, ScheduledMLP, callbacks, fixture  # noqa: E402
from make_legacy_checkpoint import trainer as legacy_trainer  # noqa: E402


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        # ZClip's and SpikeGuard's statistics are float64 now (host floats): a saved float32 value comes back exactly.
        widened = a.dtype == torch.float64 and isinstance(b, torch.Tensor) and b.dtype == torch.float32
        same_meta = isinstance(b, torch.Tensor) and (a.dtype == b.dtype or widened) and a.shape == b.shape
        return same_meta and bool(((a == b) | (a.isnan() & b.isnan())).all())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b or (a != a and b != b)  # NaN equals NaN here


class Probe(pl.Callback):
    """Reads what was restored: the callback states at train start (the probe is first in the list, so no callback
    has acted yet) and the gradients before the first resumed backward (the open window was restored by then)."""

    def __init__(self) -> None:
        self.states: dict[str, Any] = {}
        self.schedule: Any = None
        self.grads: list[torch.Tensor | None] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for cb in trainer.callbacks:
            ours = type(cb).__module__.startswith("lightning_gradkit.")
            if ours and type(cb).state_dict is not pl.Callback.state_dict:
                self.states[cb.state_key] = copy.deepcopy(cb.state_dict())
        self.schedule = trainer.strategy._gradkit_schedule_state()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self.grads is None:
            self.grads = [p.grad.clone() if p.grad is not None else None for p in pl_module.parameters()]


@pytest.mark.parametrize("clipper", ["zclip", "autoclip"])
def test_a_checkpoint_of_the_previous_layout_resumes_with_every_state(tmp_path: Path, clipper: str) -> None:
    path = fixture(clipper)
    saved = torch.load(path, weights_only=False)
    probe = Probe()
    trainer = legacy_trainer(tmp_path, 8, [probe, *callbacks(clipper)])
    with pytest.warns(UserWarning):  # Lightning: "the dataloader is not resumable"
        trainer.fit(ScheduledMLP(lr=0.05), loader(n=128, batch_size=8), ckpt_path=path)

    # every stateful gradkit callback found its state under its old key, value for value; a key added since holds
    # the value the checkpoint implies: SpikeRollback now saves the count of skipped steps, as the guards did, and
    # its resume and escalation state, which a checkpoint from before they existed leaves at "never escalated"
    assert probe.states.keys() == saved["callbacks"].keys()
    (skipped,) = {state["skipped_steps"] for state in saved["callbacks"].values() if "skipped_steps" in state}
    never_escalated = {"resumed_at": None, "escalations": 0, "ramp_start": 1.0, "ramp_done": 0, "module_zmax": None}
    for key, state in probe.states.items():
        old = saved["callbacks"][key]
        if key.startswith("SpikeGuard"):
            # SpikeGuard's statistics are per optimizer now: the checkpoint's single one came back as optimizer 0's
            old = {**old, "stats": {0: old["stats"]}}
        assert _same({k: state[k] for k in old}, old), (key, state, old)
        added = {k: state[k] for k in state.keys() - old.keys()}
        # NonFiniteGuard's replay budget: the step of its last replay, the first finding's in a checkpoint from before
        # the budget (its one replay ran there), none when it never replayed
        replayed = old.get("first_finding") if old.get("forensics_done") else None
        last_replay = {"last_replay_step": replayed["step"] if replayed else None}
        assert added in ({}, {"skipped_steps": skipped, **never_escalated}, last_replay), (key, added)
    # the strategy's scheduler counts and the open window (batch SAVE_AT_BATCH's gradients) came back
    assert probe.schedule == saved["gradkit_lr_schedule"]
    window = saved["gradkit_accumulation_window"]
    assert window["micro_batch"] == 1 and window["step"] == (SAVE_AT_BATCH + 1) // 2
    assert probe.grads is not None
    for restored, stored in zip(probe.grads, window["state"]["grads"], strict=True):
        assert restored is not None and torch.equal(restored, stored)
    # and the run trains on to the end
    assert trainer.global_step == 8
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())
