"""GradNormMonitor on 2 CPU processes (gloo): every rank logs the single-process reference value."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from helpers import MLPModule, loader, run_distributed

pytestmark = pytest.mark.distributed


def reference_norms(norm_type: float) -> list[dict[str, float]]:
    """A plain PyTorch loop on the global batches: DDP's 2 x 4 interleaved samples are 8 contiguous ones."""
    torch.manual_seed(0)
    model = MLPModule()
    opt = torch.optim.SGD(model.parameters(), lr=model.lr)
    rows = []
    for x, y in loader(n=32, batch_size=8):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        named = dict(model.named_parameters())
        row = {"grad_norm/total": torch.nn.utils.get_total_norm([p.grad for p in named.values()], norm_type).item()}
        for prefix in ("encoder", "head"):
            grads = [p.grad for n, p in named.items() if n.startswith(prefix + ".")]
            row[f"grad_norm/module/{prefix}"] = torch.nn.utils.get_total_norm(grads, norm_type).item()
        rows.append(row)
        opt.step()
    return rows


@pytest.mark.parametrize(("strategy", "norm_type"), [("ddp", 2.0), ("fsdp2", 2.0), ("fsdp2", math.inf)])
def test_all_ranks_log_the_single_process_reference(tmp_path: Path, strategy: str, norm_type: float) -> None:
    ranks = run_distributed("monitor_script.py", tmp_path, "--strategy", strategy, "--norm-type", str(norm_type))
    expected = reference_norms(norm_type)
    assert ranks[0] == ranks[1]
    assert len(ranks[0]) == len(expected) == 4
    for got, ref in zip(ranks[0], expected, strict=True):
        assert got.keys() == ref.keys()
        for key in ref:
            assert got[key] == pytest.approx(ref[key], rel=1e-5), key


def _ratio(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], prefix: str) -> float:
    names = [n for n in before if n.startswith(prefix)]
    update = sum((after[n] - before[n]).double().square().sum() for n in names).sqrt()
    return (update / sum(before[n].double().square().sum() for n in names).sqrt()).item()


def reference_update_ratios() -> list[dict[str, float]]:
    """The same plain loop with Adam: ``||w_after - w_before|| / ||w_before||`` from the state dicts of each step."""
    torch.manual_seed(0)
    model = MLPModule(optimizer="adam", lr=0.01)
    opt = torch.optim.Adam(model.parameters(), lr=model.lr)
    rows = []
    for x, y in loader(n=32, batch_size=8):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        opt.step()
        after = model.state_dict()
        row = {"update_ratio/total": _ratio(before, after, "")}
        row.update({f"update_ratio/module/{m}": _ratio(before, after, m + ".") for m in ("encoder", "head")})
        rows.append(row)
    return rows


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_update_ratio_on_all_ranks_equals_the_single_process_state_dicts(tmp_path: Path, strategy: str) -> None:
    """Under FSDP2 each rank holds half of every weight (the head's one row: one rank holds all of it, the other an
    empty shard): the ratio must sum the shards' squares across ranks, not divide this rank's update by its weights."""
    ranks = run_distributed("monitor_script.py", tmp_path, "--strategy", strategy, "--update-ratio")
    expected = reference_update_ratios()
    assert ranks[0] == ranks[1]
    assert len(ranks[0]) == len(expected) == 4
    for got, ref in zip(ranks[0], expected, strict=True):
        assert got.keys() == ref.keys()
        for key in ref:
            assert got[key] == pytest.approx(ref[key], rel=1e-4), key
