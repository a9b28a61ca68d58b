"""GradNormMonitor with Lightning's real Trainer, against norms computed by hand in the model's own hook."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from gradkit.step.selection import auto_module_keys, module_rows, repeated_blocks
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


def test_logs_only_on_logging_steps_and_the_first_step(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[GradNormMonitor(log_every_n_steps=4)], log_every_n_steps=2)
    trainer.fit(MLPModule(), loader(n=96))  # 12 steps: the period's 3, 7, 11 (11 is also the last) and the first
    rows = [r for r in read_metrics(trainer) if r.get("grad_norm/total")]
    assert [int(r["step"]) for r in rows] == [0, 3, 7, 11]


# The run is shorter than its logging period on purpose (steps without logging); GradNormMonitor warns about that.
@pytest.mark.filterwarnings(r"ignore:GradNormMonitor. this run has \d+ optimizer step.s., fewer than the logging")
def test_no_host_sync_on_non_logging_steps(tmp_path: Path) -> None:
    monitor = GradNormMonitor(depth=2, param_groups=True)
    with count_syncs() as counter:
        per_step = counter.watch_per_call(monitor, "on_before_optimizer_step")
        trainer = make_trainer(tmp_path, callbacks=[monitor], log_every_n_steps=1000)
        trainer.fit(MLPModule(param_groups=True), loader())
        # 8 steps, a period of 1000: only the first and the last step log (and read values to the host).
        assert len(per_step) == 8 and per_step[1:-1] == [0] * 6, per_step
        assert per_step[0] > 0 and per_step[-1] > 0
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


# -- short runs: the first and the last optimizer step are logged ---------------------------------------------------
def test_quick_start_run_shorter_than_the_period_logs_first_and_last_step_and_warns(tmp_path: Path) -> None:
    """3 epochs of 64 batches, accumulating 4: 48 optimizer steps, fewer than Lightning's default period of 50."""
    model = RecordingModule(2.0)
    trainer = make_trainer(
        tmp_path, callbacks=[GradNormMonitor()], accumulate_grad_batches=4, max_epochs=3, log_every_n_steps=50
    )
    with pytest.warns(UserWarning, match="48 optimizer step.*fewer than the logging period of 50"):
        trainer.fit(model, loader(n=512))
    rows = [r for r in read_metrics(trainer) if r.get("grad_norm/total")]
    assert len(model.reference) == 48
    assert [int(r["step"]) for r in rows] == [0, 47]
    expected = [model.reference[0]["grad_norm/total"], model.reference[47]["grad_norm/total"]]
    assert [float(r["grad_norm/total"]) for r in rows] == pytest.approx(expected, rel=1e-6)


def test_max_steps_ends_on_a_logged_step(tmp_path: Path) -> None:
    model = RecordingModule(2.0)
    trainer = make_trainer(tmp_path, callbacks=[GradNormMonitor()], max_steps=7, log_every_n_steps=5)
    trainer.fit(model, loader())
    rows = [r for r in read_metrics(trainer) if r.get("grad_norm/total")]
    assert [int(r["step"]) for r in rows] == [0, 4, 6]
    expected = [model.reference[s]["grad_norm/total"] for s in (0, 4, 6)]
    assert [float(r["grad_norm/total"]) for r in rows] == pytest.approx(expected, rel=1e-6)


# -- depth="auto": one row per repeated block plus the other modules ------------------------------------------------
class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.experts = nn.ModuleList([nn.Linear(width, width) for _ in range(2)])  # repeated, but inside a block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x) + sum(e(x) for e in self.experts))


class TinyNet(nn.Module):
    def __init__(self, layers: int, width: int = 8) -> None:
        super().__init__()
        self.wte = nn.Linear(8, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wte(x)
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.ln_f(h))


class WrappedNet(MLPModule):
    """A LightningModule holding its model in ``self.model`` (looked through); the optimizer lists the head first."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        del self.encoder, self.head
        self.model = TinyNet(layers)
        self.reference: list[dict[str, float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        head = list(self.model.lm_head.parameters())
        rest = [p for p in self.parameters() if all(p is not q for q in head)]
        return torch.optim.SGD([{"params": head}, {"params": rest}], lr=0.01)

    def on_before_optimizer_step(self, optimizer) -> None:
        grads = {n: p.grad for n, p in self.named_parameters()}
        self.reference.append(
            {
                prefix: torch.nn.utils.get_total_norm(
                    [g for n, g in grads.items() if n.startswith(prefix + ".")]
                ).item()
                for prefix in auto_rows(len(self.model.blocks))
            }
        )


def auto_rows(layers: int) -> list[str]:
    return ["model.wte", *[f"model.blocks.{i}" for i in range(layers)], "model.ln_f", "model.lm_head"]


def test_auto_depth_logs_one_norm_per_block_and_other_module_in_model_order(tmp_path: Path) -> None:
    model = WrappedNet(layers=12)
    monitor = GradNormMonitor(report=True)
    trainer = make_trainer(tmp_path, callbacks=[monitor], max_steps=3)
    trainer.fit(model, loader())
    assert monitor.report_data is not None
    # Model order (blocks.2 before blocks.10, ln_f before lm_head), not the optimizer's or the alphabet's.
    assert monitor.report_data.modules == auto_rows(12)
    rows = read_metrics(trainer)
    for name in auto_rows(12):
        logged = column(rows, f"grad_norm/module/{name}")
        assert logged == pytest.approx([r[name] for r in model.reference], rel=1e-6), name


def test_auto_rows_of_a_minilm_like_encoder() -> None:
    encoder = nn.Module()
    encoder.embeddings = nn.Embedding(10, 8)
    encoder.encoder = nn.Module()
    encoder.encoder.layer = nn.ModuleList([nn.TransformerEncoderLayer(8, 2, 16) for _ in range(6)])
    encoder.pooler = nn.Linear(8, 8)
    root = nn.Module()
    root.encoder = encoder
    root.head = nn.Linear(8, 3)
    names = [n for n, _ in root.named_parameters()]
    keys = auto_module_keys(names, repeated_blocks(root.named_modules()))
    rows, _ = module_rows(keys, names, names)
    assert rows == [
        "encoder.embeddings",
        *[f"encoder.encoder.layer.{i}" for i in range(6)],
        "encoder.pooler",
        "head",
    ]


def test_auto_rows_without_repeated_blocks_are_the_top_level_modules() -> None:
    model = MLPModule()  # encoder = Sequential(Linear, Tanh, Linear): not one class, so not repeated blocks
    names = [n for n, _ in model.named_parameters()]
    keys = auto_module_keys(names, repeated_blocks(model.named_modules()))
    assert module_rows(keys, names, names)[0] == ["encoder", "head"]


def test_prog_bar_shows_norm_clipped_fraction_and_skips_with_no_sync_off_logging_steps(tmp_path: Path) -> None:
    from lightning_gradkit import ClipGradNorm, NonFiniteGuard

    max_norm = 1.2
    model = RecordingModule(2.0)  # its hook runs after the callbacks: it records the post-clip norm
    monitor = GradNormMonitor(prog_bar=True)
    with count_syncs() as counter:
        per_step = counter.watch_per_call(monitor, "on_before_optimizer_step")
        trainer = make_trainer(tmp_path, callbacks=[monitor, ClipGradNorm(max_norm)], log_every_n_steps=4)
        trainer.fit(model, loader())  # 8 steps: logging steps 0 (first), 3 and 7
    assert [n for i, n in enumerate(per_step) if i not in (0, 3, 7)] == [0] * 5, per_step
    post = [r["grad_norm/total"] for r in model.reference]
    clipped = [abs(v - max_norm) < 1e-5 * max_norm for v in post]  # clip_grad_norm_ leaves exactly max_norm
    assert 0 < sum(clipped[4:]) < 4
    shown = trainer.progress_bar_metrics
    logged = [r for r in read_metrics(trainer) if r.get("grad_norm/total")]
    assert shown["grad_norm"] == pytest.approx(float(logged[-1]["grad_norm/total"]))
    assert shown["clipped"] == pytest.approx(sum(clipped[4:]) / 4)  # the steps since the previous log: 4..7
    assert "skipped" not in shown  # no guard that skips

    guarded = make_trainer(
        tmp_path / "guarded", strategy="gradkit", callbacks=[GradNormMonitor(prog_bar=True), NonFiniteGuard()]
    )
    guarded.fit(MLPModule(), loader())
    assert guarded.progress_bar_metrics["skipped"] == 0.0
