"""``GradNormMonitor(noise_scale=True)``: the gradient noise scale of McCandlish et al. (2018, appendix A.1) under DDP.

One 2-process launch (gloo, :func:`helpers.run_processes`) serves the distributed tests; the reference is the same
model trained in this process, each rank's gradient computed by plain autograd from that rank's batches, and the
paper's formulas and the moving average written out below. The other tests run in one process.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gradkit import GradKit
from gradkit import GradNormMonitor as LoopMonitor
from gradkit.report.data import RunData
from helpers import MLPModule, make_trainer, rank_loader, run_processes
from lightning_gradkit import GradNormMonitor

EMA = 0.9  # the smoothing factor the docstring states, per estimate


def paper_estimates(g_small_sq: float, g_big_sq: float, b_small: float, b_big: float) -> tuple[float, float]:
    """Appendix A.1: |G|^2 = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small),
    S = (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)."""
    g2 = (b_big * g_big_sq - b_small * g_small_sq) / (b_big - b_small)
    s = (g_small_sq - g_big_sq) / (1 / b_small - 1 / b_big)
    return g2, s


def reference(steps: list[list[list[tuple[torch.Tensor, torch.Tensor]]]], logged: list[int]) -> list[dict[str, float]]:
    """The values a rank logs, from a plain loop in one process: ``steps[k][r]`` holds rank r's micro-batches of step
    k (each loss divided by their number, as Lightning does), the gradient applied is the mean of the ranks' (DDP's
    average), SGD with lr 0.1. The estimates of the ``logged`` steps go into a bias-corrected moving average."""
    torch.manual_seed(0)
    model = MLPModule().double()
    params = list(model.parameters())
    m_g2 = m_s = 0.0
    count = 0
    rows = []
    for k, ranks in enumerate(steps):
        grads = []
        for batches in ranks:
            loss = sum(nn.functional.mse_loss(model(x.double()), y.double()) for x, y in batches) / len(batches)
            grads.append(torch.autograd.grad(loss, params))
        mean = [sum(g[i] for g in grads) / len(grads) for i in range(len(params))]
        if k in logged:
            g_small_sq = sum(sum(t.square().sum() for t in g) for g in grads).item() / len(grads)
            g_big_sq = sum(t.square().sum() for t in mean).item()
            b_small = float(sum(len(x) for x, _ in ranks[0]))
            g2, s = paper_estimates(g_small_sq, g_big_sq, b_small, b_small * len(grads))
            m_g2, m_s, count = EMA * m_g2 + (1 - EMA) * g2, EMA * m_s + (1 - EMA) * s, count + 1
            rows.append(
                {
                    "grad_norm/total": math.sqrt(g_big_sq),
                    "grad_noise/g_small_sq": g_small_sq,
                    "grad_noise/g_big_sq": g_big_sq,
                    "grad_noise/g2": m_g2 / (1 - EMA**count),
                    "grad_noise/s": m_s / (1 - EMA**count),
                    "grad_noise/b_simple": m_s / m_g2,
                    "grad_noise/batch_size": b_small * len(grads),
                }
            )
        with torch.no_grad():
            for p, g in zip(params, mean, strict=True):
                p -= 0.1 * g
    return rows


def _assert_rows(got: list[dict[str, float]], expected: list[dict[str, float]]) -> None:
    assert len(got) == len(expected)
    for row, ref in zip(got, expected, strict=True):
        assert row.keys() == ref.keys()
        for key in ref:
            assert row[key] == pytest.approx(ref[key], rel=2e-4, abs=1e-5), key


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_processes("noise_scale_script.py", tmp_path_factory.mktemp("noise_scale"), timeout=240)


@pytest.mark.distributed
class TestUnderDDP:
    def test_trainer_logs_the_papers_estimates_from_each_ranks_accumulated_gradient(
        self, ranks: list[dict[str, Any]]
    ) -> None:
        """4 steps of 2 micro-batches of 4 examples per rank (the monitor counts B_small = 8 itself)."""
        batches = [list(rank_loader(r, n=64, batch_size=4)) for r in range(2)]
        steps = [[batches[r][2 * k : 2 * k + 2] for r in range(2)] for k in range(4)]
        assert ranks[0]["trainer"] == ranks[1]["trainer"]
        _assert_rows(ranks[0]["trainer"], reference(steps, logged=[0, 1, 2, 3]))

    def test_loop_door_estimates_on_its_logging_steps_only(self, ranks: list[dict[str, Any]]) -> None:
        """Period 2 over 4 steps: the first step, steps 1 and 3; step 2 logs nothing and is not in the average."""
        batches = [list(rank_loader(r, n=32, batch_size=4)) for r in range(2)]
        steps = [[[batches[r][k]] for r in range(2)] for k in range(4)]
        rows = ranks[0]["loop"]
        assert [step for step, _ in rows] == [0, 1, 3]
        assert rows == ranks[1]["loop"]
        _assert_rows([row for _, row in rows], reference(steps, logged=[0, 1, 3]))

    def test_no_operation_or_host_sync_added_off_logging_steps(self, ranks: list[dict[str, Any]]) -> None:
        """Whole DDP steps (forward, backward, ``kit.step``) counted with and without the noise scale: steps 1 and 2
        (not logging) dispatch the same aten operations and syncs; step 0 (logging) adds its measurement."""
        for rank in ranks:
            noise, plain = rank["costs"]["noise"], rank["costs"]["plain"]
            assert noise[1:] == plain[1:]
            assert noise[0]["syncs"] == plain[0]["syncs"]
            assert noise[0]["launches"] > plain[0]["launches"]

    def test_accumulation_without_no_sync_warns_and_logs_no_estimate(self, ranks: list[dict[str, Any]]) -> None:
        unsynced = ranks[0]["unsynced"]
        assert len(unsynced["warnings"]) == 1 and "no_sync" in unsynced["warnings"][0]
        first, second = unsynced["rows"]
        assert not any(key.startswith("grad_noise/") for key in first)
        assert second["grad_noise/batch_size"] == 16.0  # 2 ranks x 8 examples, the micro-batches under no_sync
        assert second["grad_noise/g_big_sq"] == pytest.approx(second["grad_norm/total"] ** 2, rel=1e-5)
        assert ranks[1]["unsynced"]["warnings"] == []  # rank 0 speaks for all

    def test_fsdp2_and_a_loop_door_without_batch_size_are_refused(self, ranks: list[dict[str, Any]]) -> None:
        refusals = ranks[0]["refusals"]
        assert "sharded" in refusals["fsdp2"] and "set_custom_reduce_scatter" in refusals["fsdp2"]
        assert "noise_scale_batch_size=" in refusals["no_batch_size"]


def test_paper_estimates_recover_the_true_gradient_and_noise() -> None:
    """E|G_B|^2 = |G|^2 + S / B: plugged in exactly, the estimates give back |G|^2 = 2 and S = 12."""
    from gradkit.policies.noise_scale import noise_estimates

    g2, s = noise_estimates(torch.tensor(2.0 + 12 / 3), torch.tensor(2.0 + 12 / 12), 3, 12)
    assert (g2.item(), s.item()) == pytest.approx((2.0, 12.0))
    assert paper_estimates(2.0 + 12 / 3, 2.0 + 12 / 12, 3, 12) == pytest.approx((2.0, 12.0))


def test_single_process_says_once_there_is_no_noise_scale_and_logs_none(tmp_path: Path) -> None:
    monitor = LoopMonitor(noise_scale=True, log_every_n_steps=1)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logged: list[dict[str, float]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # a second door on the same monitor: no second warning
            kit = GradKit(model, opt, monitor, log=lambda m, s: logged.append(m), log_dir=False)
            model(torch.ones(2, 4)).sum().backward()
            kit.step(opt)
            opt.zero_grad()
        trainer = make_trainer(tmp_path, max_steps=2, callbacks=[GradNormMonitor(noise_scale=True)])
        trainer.fit(MLPModule(), rank_loader(0, world_size=1, n=8, batch_size=4))
    said = [str(w.message) for w in caught if "noise_scale=True" in str(w.message)]
    assert len(said) == 2 and all("one process" in m for m in said)  # one per monitor
    assert logged and not any(k.startswith("grad_noise/") for row in logged for k in row)
    assert not any(k.startswith("grad_noise/") for k in trainer.callback_metrics)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [({"noise_scale_batch_size": 8}, "noise_scale=True"), ({"noise_scale": True, "noise_scale_batch_size": 0}, "0")],
)
def test_invalid_noise_scale_arguments_are_refused(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match="noise_scale_batch_size") as err:
        GradNormMonitor(**kwargs)
    assert named in str(err.value)


def test_report_draws_the_critical_batch_beside_the_batch_when_logged() -> None:
    pytest.importorskip("matplotlib")
    from gradkit.report.figure import build_figure, close

    data = RunData()
    data.series["grad_norm/total"] = {0: 1.0, 1: 0.9, 2: 0.8}
    data.series["grad_noise/b_simple"] = {0: math.nan, 1: 40.0, 2: 50.0}  # step 0: |G|^2 not positive yet
    data.series["grad_noise/batch_size"] = {0: 16.0, 1: 16.0, 2: 16.0}
    fig = build_figure(data)
    try:
        (ax,) = [a for a in fig.axes if a.get_label() == "critical batch"]
        b_simple, batch = ax.get_lines()
        assert list(b_simple.get_xdata()) == [1, 2] and list(b_simple.get_ydata()) == [40.0, 50.0]
        assert list(batch.get_ydata()) == [16.0, 16.0, 16.0]
        assert "1 of 3 logged steps without an estimate" in ax.get_title()
    finally:
        close(fig)
    del data.series["grad_noise/b_simple"], data.series["grad_noise/batch_size"]
    fig = build_figure(data)
    try:
        assert not [a for a in fig.axes if a.get_label() == "critical batch"]
    finally:
        close(fig)
