"""GradNormMonitor with Lightning's real Trainer, against norms computed by hand in the model's own hook."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import MLPModule, column, count_syncs, loader, make_trainer, read_metrics
from lightning_gradkit import GradNormMonitor


class RecordingModule(MLPModule):
    """Records reference norms in the LightningModule hook (runs after every callback's hook)."""

    def __init__(self, p: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.p = p
        self.reference: list[dict[str, float]] = []

    def on_before_optimizer_step(self, optimizer) -> None:
        grads = {n: q.grad for n, q in self.named_parameters() if q.grad is not None}
        ref = {"grad_norm/total": torch.nn.utils.get_total_norm(list(grads.values()), self.p).item()}
        for prefix in ("encoder.0", "encoder.2", "head"):
            ref[f"grad_norm/module/{prefix}"] = torch.nn.utils.get_total_norm(
                [g for n, g in grads.items() if n.startswith(prefix + ".")], self.p
            ).item()
        for i, group in enumerate(optimizer.param_groups):
            norms = [q.grad.norm(self.p) if math.isfinite(self.p) else q.grad.abs().max() for q in group["params"]]
            stacked = torch.stack(norms)
            total = stacked.max() if math.isinf(self.p) else stacked.pow(self.p).sum().pow(1 / self.p)
            ref[f"grad_norm/param_group_{i}"] = total.item()
        self.reference.append(ref)


@pytest.mark.parametrize("p", [1.0, 2.0, math.inf])
def test_logged_norms_equal_reference_loop(tmp_path: Path, p: float) -> None:
    model = RecordingModule(p, param_groups=True)
    trainer = make_trainer(tmp_path, callbacks=[GradNormMonitor(norm_type=p, depth=2, param_groups=True)])
    trainer.fit(model, loader())
    rows = read_metrics(trainer)
    assert len(model.reference) == 8
    for key in model.reference[0]:
        logged = column(rows, key)
        expected = [r[key] for r in model.reference]
        assert logged == pytest.approx(expected, rel=1e-6), key


def test_accumulation_measures_once_per_optimizer_step(tmp_path: Path) -> None:
    model = RecordingModule(2.0)
    monitor = GradNormMonitor()
    trainer = make_trainer(tmp_path, callbacks=[monitor], accumulate_grad_batches=4)
    trainer.fit(model, loader(n=64))  # 8 batches -> 2 optimizer steps
    logged = column(read_metrics(trainer), "grad_norm/total")
    assert logged == pytest.approx([r["grad_norm/total"] for r in model.reference], rel=1e-6)
    assert len(logged) == 2


def test_logs_only_on_logging_steps(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[GradNormMonitor(log_every_n_steps=4)], log_every_n_steps=2)
    trainer.fit(MLPModule(), loader(n=96))  # 12 steps
    rows = [r for r in read_metrics(trainer) if r.get("grad_norm/total")]
    assert [int(r["step"]) for r in rows] == [3, 7, 11]


def test_no_host_sync_on_non_logging_steps(tmp_path: Path) -> None:
    monitor = GradNormMonitor(depth=2, param_groups=True)
    with count_syncs() as counter:
        counter.watch(monitor, "on_before_optimizer_step")
        trainer = make_trainer(tmp_path, callbacks=[monitor], log_every_n_steps=1000)
        trainer.fit(MLPModule(param_groups=True), loader())
        assert counter.total == 0, counter.counts
        # The counter itself works: a logging step's zero-gradient check reads the norms once.
        monitor.log_every_n_steps = 1
        trainer = make_trainer(tmp_path, callbacks=[monitor], log_every_n_steps=1)
        trainer.fit(MLPModule(), loader(n=8))
        assert counter.total > 0


class PartlyDetached(MLPModule):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(3, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.no_grad():
            h = self.encoder(x)
        return nn.functional.mse_loss(self.head(h), y) + 0.0 * self.encoder[0].bias.sum()


def test_warns_once_naming_parameters_without_or_with_zero_gradient(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[GradNormMonitor()])
    with pytest.warns(UserWarning) as record:
        trainer.fit(PartlyDetached(), loader(n=32))
    messages = [str(w.message) for w in record if "GradNormMonitor" in str(w.message)]
    no_grad = [m for m in messages if "no gradient" in m]
    zero = [m for m in messages if "all-zero" in m]
    assert len(no_grad) == 1 and "unused.weight" in no_grad[0] and "encoder.2.weight" in no_grad[0]
    assert len(zero) == 1 and "encoder.0.bias" in zero[0]


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [({"norm_type": 0.5}, "norm_type"), ({"depth": -1}, "depth"), ({"log_every_n_steps": 0}, "log_every_n_steps")],
)
def test_bad_arguments_raise_naming_the_argument(kwargs: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        GradNormMonitor(**kwargs)


def test_model_without_trainable_parameters_fails_at_setup(tmp_path: Path) -> None:
    model = MLPModule()
    model.requires_grad_(False)
    with pytest.raises(RuntimeError, match="no trainable parameter"):
        make_trainer(tmp_path, callbacks=[GradNormMonitor()]).fit(model, loader())
