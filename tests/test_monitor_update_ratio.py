"""GradNormMonitor(update_ratio=True) against ratios computed by hand from the state dicts around each step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from helpers import MLPModule, count_syncs, loader, make_trainer, read_metrics
from lightning_gradkit import GradNormMonitor, NonFiniteGuard
from lightning_gradkit.demos import FaultInjector

MODULES = ("encoder.0", "encoder.2", "head")


def hand_ratios(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, float]:
    """``||after - before|| / ||before||`` over all parameters and per module, from two state dicts."""

    def ratio(prefix: str) -> float:
        names = [n for n in before if n.startswith(prefix)]
        update = math.sqrt(sum(float((after[n].double() - before[n].double()).square().sum()) for n in names))
        weight = math.sqrt(sum(float(before[n].double().square().sum()) for n in names))
        return update / weight

    out = {"update_ratio/total": ratio("")}
    out.update({f"update_ratio/module/{m}": ratio(m + ".") for m in MODULES})
    return out


class StateDictModule(MLPModule):
    """Keeps the state dict before every optimizer step (its hook runs after the callbacks') and after it."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.reference: dict[int, dict[str, float]] = {}
        self.step_hooks: list[int] = []
        self._before: dict[str, torch.Tensor] | None = None

    def on_before_optimizer_step(self, optimizer) -> None:
        self._before = {k: v.clone() for k, v in self.state_dict().items()}
        self.step_hooks.append(len(optimizer._optimizer_step_post_hooks))

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        assert self._before is not None
        step = self.trainer.fit_loop.epoch_loop._batches_that_stepped
        self.reference[step] = hand_ratios(self._before, self.state_dict())


def logged(rows: list[dict[str, str]], key: str) -> dict[int, float]:
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key) not in (None, "")}


def test_update_ratio_equals_the_hand_computation_on_logging_steps_only(tmp_path: Path) -> None:
    model = StateDictModule(optimizer="adam", lr=0.01)
    trainer = make_trainer(
        tmp_path, callbacks=[GradNormMonitor(depth=2, update_ratio=True)], log_every_n_steps=3, max_steps=8
    )
    trainer.fit(model, loader())
    rows = read_metrics(trainer)
    # Steps 2 and 5 by the period, 0 and 7 as the first and the last step of the fit.
    assert sorted(logged(rows, "update_ratio/total")) == [0, 2, 5, 7]
    for key in model.reference[0]:
        values = logged(rows, key)
        assert values == pytest.approx({s: model.reference[s][key] for s in values}, rel=1e-5), key
        assert all(1e-4 < v < 1.0 for v in values.values()), (key, values)
    # The step hook exists on logging steps only (the module's hook sees it, before the step).
    assert model.step_hooks == [1, 0, 1, 0, 0, 1, 0, 1]


def test_skipped_step_logs_a_zero_update_ratio(tmp_path: Path) -> None:
    model = StateDictModule()
    trainer = make_trainer(
        tmp_path,
        strategy="gradkit",
        callbacks=[
            GradNormMonitor(depth=2, update_ratio=True),
            NonFiniteGuard(action="skip"),
            FaultInjector(step=2, module="encoder.0"),
        ],
        max_steps=4,
    )
    with pytest.warns(UserWarning, match="non-finite"):
        trainer.fit(model, loader())
    rows = read_metrics(trainer)
    for key in model.reference[0]:
        values = logged(rows, key)
        assert values[2] == 0.0 and model.reference[2][key] == 0.0, key
        assert values == pytest.approx({s: model.reference[s][key] for s in range(4)}, rel=1e-5), key


def test_update_ratio_costs_no_sync_and_keeps_no_copy_off_logging_steps(tmp_path: Path) -> None:
    monitor = GradNormMonitor(depth=2, update_ratio=True)
    with count_syncs() as counter:
        before_step = counter.watch_per_call(monitor, "on_before_optimizer_step")
        batch_end = counter.watch_per_call(monitor, "on_train_batch_end")
        trainer = make_trainer(tmp_path, callbacks=[monitor], log_every_n_steps=1000)
        with pytest.warns(UserWarning, match="fewer than the logging period"):
            trainer.fit(MLPModule(), loader())
    # 8 steps, a period of 1000: only the first and the last step log.
    assert len(before_step) == len(batch_end) == 8
    assert before_step[1:-1] == [0] * 6 and batch_end[1:-1] == [0] * 6, (before_step, batch_end)
    assert monitor._before == {} and monitor._step_hooks == {}
    assert not trainer.optimizers[0]._optimizer_step_post_hooks
