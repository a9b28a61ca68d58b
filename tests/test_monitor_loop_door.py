"""GradNormMonitor behind the loop door (`GradKit`): ``update_ratio=True`` and ``report=True`` give what they give
behind the Trainer, checked against the Trainer's run and against ratios and norms computed by hand; the torch class
runs in an interpreter where Lightning was never imported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import gradkit.policies.monitor
import gradkit.report.figure
from gradkit.doors.loop import GradKit
from gradkit.report.events import EventLog
from gradkit.step.protocol import Stage
from helpers import MLPModule, loader, make_trainer, read_metrics, run_without_lightning
from lightning_gradkit import GradNormMonitor
from test_monitor_update_ratio import hand_ratios, logged

pytest.importorskip("matplotlib")

PERIOD, STEPS = 3, 8
RATIO_KEYS = ["update_ratio/total", *(f"update_ratio/module/{m}" for m in ("encoder.0", "encoder.2", "head"))]


def trainer_run(tmp_path: Path) -> tuple[dict[str, dict[int, float]], GradNormMonitor]:
    torch.manual_seed(0)
    monitor = GradNormMonitor(depth=2, update_ratio=True, report=True)
    trainer = make_trainer(tmp_path, callbacks=[monitor], log_every_n_steps=PERIOD, max_steps=STEPS)
    trainer.fit(MLPModule(optimizer="adam", lr=0.01), loader())
    rows = read_metrics(trainer)
    return {key: logged(rows, key) for key in RATIO_KEYS}, monitor


def loop_run(log_dir: Path) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, float]], object]:
    """The Trainer's run as a plain loop: the same module, optimizer, batches and seed; the hand-computed ratios of
    every step from the state dicts around ``kit.step``."""
    torch.manual_seed(0)
    model = MLPModule(optimizer="adam", lr=0.01)
    opt = model.configure_optimizers()
    monitor = gradkit.GradNormMonitor(depth=2, update_ratio=True, report=True)
    rows: dict[int, dict[str, float]] = {}
    kit = GradKit(
        model,
        opt,
        monitor,
        log=lambda metrics, step: rows.setdefault(step, {}).update(metrics),
        log_every_n_steps=PERIOD,
        max_steps=STEPS,
        log_dir=log_dir,
    )
    reference: dict[int, dict[str, float]] = {}
    for step, (x, y) in enumerate(loader()):
        nn.functional.mse_loss(model(x), y).backward()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        kit.step(opt)
        reference[step] = hand_ratios(before, model.state_dict())
        opt.zero_grad(set_to_none=True)
    kit.finish()
    return rows, reference, monitor


def test_update_ratio_and_report_behind_the_loop_door_equal_the_trainers(tmp_path: Path) -> None:
    trainer_ratios, trainer_monitor = trainer_run(tmp_path / "trainer")
    rows, reference, monitor = loop_run(tmp_path / "loop")
    # The same logging steps (the period's 2 and 5, the first and the last) and the Trainer's values, bitwise.
    assert sorted(rows) == [0, 2, 5, 7]
    for key, values in trainer_ratios.items():
        assert {s: r[key] for s, r in rows.items()} == values, key
        # Both against the independent reference: ||w_after - w_before|| / ||w_before|| from the state dicts.
        assert values == pytest.approx({s: reference[s][key] for s in values}, rel=1e-5), key
    # The report, written at `kit.finish()` into the loop's log_dir from what the monitor recorded.
    assert (tmp_path / "loop" / "gradient_report.png").stat().st_size > 10_000
    data, trainer_data = monitor.report_data, trainer_monitor.report_data
    assert data is not None and trainer_data is not None
    assert data.modules == trainer_data.modules == ["encoder.0", "encoder.2", "head"]
    assert data.ratio_rows == trainer_data.ratio_rows
    for key in ("grad_norm/total", *RATIO_KEYS):
        assert data.series[key] == trainer_data.series[key], key


class _WritesAnEventAtFinish:
    """A guard-stage policy that, like the guards' ledgers, writes its last event at the end of the loop."""

    stage = Stage.GUARD

    def __init__(self, log_dir: Path) -> None:
        self.log = EventLog(log_dir)

    def finish(self, ctx: object) -> None:
        self.log.write(step=1, batch_idx=1, rank=0, what="spike", culprit=None, values={}, action="skip")


def test_the_loop_doors_report_shows_the_events_the_guards_write_at_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The monitor listed first still draws after the guards' ``finish``: the door calls it in stage order."""
    drawn: list[list[dict]] = []
    real_draw = gradkit.report.figure.draw
    monkeypatch.setattr(
        gradkit.report.figure, "draw", lambda data, source: drawn.append(data.events) or real_draw(data)
    )
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = gradkit.GradNormMonitor(report=True)
    kit = GradKit(model, opt, [monitor, _WritesAnEventAtFinish(tmp_path)], log_every_n_steps=1, log_dir=tmp_path)
    for _ in range(3):
        model(torch.ones(2, 4)).sum().backward()
        kit.step(opt)
        opt.zero_grad(set_to_none=True)
    kit.finish()
    assert [[event["what"] for event in events] for events in drawn] == [["spike"]]


_NO_LIGHTNING_LOOP = """
import json, tempfile
from pathlib import Path
import torch
from torch import nn
from gradkit.doors.loop import GradKit
from gradkit.policies.monitor import GradNormMonitor
from gradkit.step.protocol import Stage

class SkipStep2:
    '''A policy of the protocol, torch only: skips the optimizer step at step 2.'''
    stage = Stage.GUARD
    def may_skip(self):
        return True
    def decide(self, stats, decision, ctx):
        decision.add_skip(torch.tensor(ctx.global_step == 2))

def ratio(before, after, prefix):
    names = [n for n in before if n.startswith(prefix)]
    update = sum(float((after[n].double() - before[n].double()).square().sum()) for n in names) ** 0.5
    return update / sum(float(before[n].double().square().sum()) for n in names) ** 0.5

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
log_dir = Path(tempfile.mkdtemp())
rows, reference = {}, {}
kit = GradKit(model, opt, [GradNormMonitor(depth=1, update_ratio=True, report=True), SkipStep2()],
              log=lambda metrics, step: rows.setdefault(step, {}).update(metrics), log_every_n_steps=1,
              log_dir=log_dir)
g = torch.Generator().manual_seed(0)
for step in range(5):
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
    nn.functional.mse_loss(model(x), y).backward()
    norms = {"total": torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()}
    norms.update({m: torch.nn.utils.get_total_norm([model[m].weight.grad, model[m].bias.grad]).item() for m in (0, 2)})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kit.step(opt)
    after = model.state_dict()
    reference[step] = {"norms": norms, "ratios": {"total": ratio(before, after, ""), "0": ratio(before, after, "0."),
                                                   "2": ratio(before, after, "2.")}}
    opt.zero_grad(set_to_none=True)
kit.finish()
print(json.dumps({
    "rows": rows, "reference": reference,
    "report": (log_dir / "gradient_report.png").stat().st_size,
}))
"""


def test_the_torch_monitor_logs_norms_ratios_and_its_report_in_a_loop_without_lightning() -> None:
    out = json.loads(run_without_lightning(_NO_LIGHTNING_LOOP, timeout=300).splitlines()[-1])
    assert out["report"] > 10_000
    rows = {int(step): row for step, row in out["rows"].items()}
    assert sorted(rows) == list(range(5))
    for step, row in rows.items():
        expected = out["reference"][str(step)]
        # The norms against torch.nn.utils.get_total_norm, the ratios against the state dicts around the step.
        assert row["grad_norm/total"] == pytest.approx(expected["norms"]["total"], rel=1e-6)
        for m in ("0", "2"):
            assert row[f"grad_norm/module/{m}"] == pytest.approx(expected["norms"][m], rel=1e-6)
            assert row[f"update_ratio/module/{m}"] == pytest.approx(expected["ratios"][m], rel=1e-5)
        assert row["update_ratio/total"] == pytest.approx(expected["ratios"]["total"], rel=1e-5)
    # The skipped step applied no update: the monitor logs 0, as the reference measures.
    assert rows[2]["update_ratio/total"] == 0.0 == out["reference"]["2"]["ratios"]["total"]
    assert rows[2]["gradkit/skipped_steps"] == 1.0
    assert all(rows[s]["update_ratio/total"] > 1e-4 for s in (0, 1, 3, 4))
