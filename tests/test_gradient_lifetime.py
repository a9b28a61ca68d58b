"""The engine must not keep a step's gradients alive after the optimizer's ``zero_grad`` dropped them.

Reference: the same training with plain Lightning (no gradkit callback), where every gradient of step k is freed by
``zero_grad(set_to_none=True)`` before the backward of step k + 1. A kept reference would add one whole set of
gradients to the memory peak of every backward.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from helpers import MLPModule, loader, make_trainer
from lightning_gradkit import (
    AdaptiveGradClip,
    ClipGradNorm,
    ClipGradValue,
    GradNormMonitor,
    ManualAccumulator,
    NonFiniteGuard,
    SpikeGuard,
    SpikeRollback,
    ZClip,
    clip_gradients,
)
from lightning_gradkit.trainer_door import TrainerPipeline


class _Tracker(MLPModule):
    """Records weak references to the gradients the optimizer steps with, and how many are alive at each later
    backward (after Lightning's ``zero_grad``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.refs: list[weakref.ref[Tensor]] = []
        self.alive: list[int] = []
        # The memory itself: a detached alias or a view of a gradient (another tensor object) keeps it alive after
        # the `.grad` object is gone, which a weak reference to `p.grad` alone does not see.
        self.storages: list[StorageWeakRef] = []
        self.storages_alive: list[int] = []

    def on_before_backward(self, loss: Tensor) -> None:
        self.alive.append(sum(r() is not None for r in self.refs))
        self.storages_alive.append(sum(not s.expired() for s in self.storages))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.refs = [weakref.ref(p.grad) for p in self.parameters() if p.grad is not None]
        self.storages = [StorageWeakRef(p.grad.untyped_storage()) for p in self.parameters() if p.grad is not None]


class _ManualTracker(_Tracker):
    """Manual optimization: ``clip_gradients`` without a clipping callback, ``zero_grad`` before each backward."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        opt = self.optimizers()
        opt.zero_grad(set_to_none=True)
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        self.refs = [weakref.ref(p.grad) for p in self.parameters()]
        clip_gradients(self, opt, ClipGradNorm(0.5))
        opt.step()
        return loss


CONFIGS = {
    "plain Lightning (reference)": lambda: ([], {}),
    "monitor + ClipGradNorm": lambda: ([GradNormMonitor(), ClipGradNorm(0.5)], {}),
    "ClipGradValue": lambda: ([ClipGradValue(0.01)], {}),
    "AdaptiveGradClip": lambda: ([AdaptiveGradClip()], {}),
    "ZClip + guards, gradkit strategy": lambda: (
        [ZClip(), NonFiniteGuard(), SpikeGuard("grad_norm", action="skip")],
        {"strategy": "gradkit"},
    ),
    "monitor, accumulation 2": lambda: ([GradNormMonitor(), ClipGradNorm(0.5)], {"accumulate_grad_batches": 2}),
    "SpikeRollback + ClipGradNorm, gradkit strategy": lambda: (
        [SpikeRollback("grad_norm", snapshot_every_n_steps=2), ClipGradNorm(0.5)],
        {"strategy": "gradkit"},
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_previous_step_gradients_are_freed_before_the_next_backward(tmp_path: Path, name: str) -> None:
    callbacks, extra = CONFIGS[name]()
    model = _Tracker(optimizer="adam")
    make_trainer(tmp_path, max_steps=5, callbacks=callbacks, **extra).fit(model, loader())
    steps_seen = [n for n in model.alive if n]
    assert model.alive[0] == 0 and len(model.alive) >= 5
    assert not steps_seen, f"gradients of the previous step were still alive at a backward: {model.alive}"
    assert not any(model.storages_alive), f"their memory was still held at a backward: {model.storages_alive}"


def test_previous_step_gradients_are_freed_with_manual_clip_gradients(tmp_path: Path) -> None:
    model = _ManualTracker()
    make_trainer(tmp_path, max_steps=4, callbacks=[GradNormMonitor()]).fit(model, loader())
    assert len(model.alive) == 4
    # The tracker records the current step's gradients right after its backward: at the next backward
    # (after the user's zero_grad) none of them may be alive.
    assert model.alive == [0, 0, 0, 0]


class _WindowTracker(_Tracker):
    """Manual optimization with a ``ManualAccumulator`` window of 2 and an attached ``ClipGradNorm``."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.accumulator = ManualAccumulator(2)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.accumulator.backward(self, loss, batch_idx):
            self.refs = [weakref.ref(p.grad) for p in self.parameters()]
            self.accumulator.step(self.optimizers())
        return loss


def test_previous_window_gradients_are_freed_with_manual_accumulator(tmp_path: Path) -> None:
    model = _WindowTracker()
    make_trainer(tmp_path, max_epochs=1, callbacks=[ClipGradNorm(0.5)]).fit(model, loader())
    assert len(model.alive) == 8 and any(model.refs)
    assert model.alive == [0] * 8


def test_step_record_measures_the_gradients_as_they_are_now(tmp_path: Path) -> None:
    """The pipeline's record holds no gradients; its ``measure_grads`` reads ``p.grad`` after the step, until
    ``zero_grad``."""
    seen: dict[str, Any] = {}

    class _Probe(MLPModule):
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            opt = self.trainer.optimizers[0]
            record = TrainerPipeline.of(self.trainer).last_records[id(opt)]
            expected = torch.nn.utils.get_total_norm([p.grad for p in self.parameters()])
            seen["measured"] = record.measure_grads(2.0).norm()
            seen["expected"] = expected
            grads = [p.grad for p in self.parameters()]
            opt.zero_grad(set_to_none=True)
            with pytest.raises(RuntimeError, match="zero_grad"):
                record.measure_grads(2.0)
            for p, g in zip(self.parameters(), grads, strict=True):
                p.grad = g

    make_trainer(tmp_path, max_steps=1, callbacks=[ClipGradValue(0.01)]).fit(_Probe(), loader())
    torch.testing.assert_close(seen["measured"], seen["expected"])


class _Wide(MLPModule):
    """Gradients large enough (64 MiB in fp32) that one extra set shows in the CUDA memory peak."""

    def __init__(self) -> None:
        super().__init__(hidden=4096, optimizer="sgd")


def _peak_bytes(tmp_path: Path, callbacks: list[Any], **kwargs: Any) -> int:
    """The CUDA memory peak of a short fit above what was allocated before it (an earlier fit's leftovers freed)."""
    gc.collect()
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    make_trainer(tmp_path, accelerator="gpu", max_steps=4, callbacks=callbacks, **kwargs).fit(_Wide(), loader())
    return torch.cuda.max_memory_allocated() - start


@pytest.mark.gpu
def test_monitor_and_clip_add_no_gradient_set_to_the_cuda_peak(tmp_path: Path) -> None:
    """Peak CUDA memory of monitor + ClipGradNorm against Lightning's ``gradient_clip_val`` on the same model: the
    difference stays far below one set of gradients (the statistics are a few small vectors)."""
    grad_bytes = sum(p.numel() * 4 for p in _Wide().parameters())
    lightning = _peak_bytes(tmp_path / "lightning", [], gradient_clip_val=0.5)
    ours = _peak_bytes(tmp_path / "ours", [GradNormMonitor(), ClipGradNorm(0.5)])
    assert ours - lightning < 0.05 * grad_bytes, (ours, lightning, grad_bytes)
