"""Two simulated nodes on one machine, as users run multi-node jobs with Lightning: the same command per node with
``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``Trainer(num_nodes=2, devices=1, strategy="gradkit_ddp")``. Both
nodes log the same norms and take the same skip decisions, equal to a single process on the global batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from helpers import MLPModule, loader, run_nodes

pytestmark = pytest.mark.distributed

MAX_NORM = 0.5
NAN_RANK, NAN_BATCH = 1, 2


class NodeFault(MLPModule):
    """:class:`MLPModule` whose loss is NaN on global rank ``NAN_RANK`` at batch ``NAN_BATCH``."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_rank == NAN_RANK and batch_idx == NAN_BATCH:
            loss = loss * float("nan")
        return loss


def reference() -> dict:
    """One process on the global batches (2 nodes x 4 interleaved samples are 8 contiguous ones): module and total
    norms, ``clip_grad_norm_``, SGD; the step of the poisoned batch is not taken."""
    torch.manual_seed(0)
    model = MLPModule()
    opt = torch.optim.SGD(model.parameters(), lr=model.lr)
    steps = []
    for i, (x, y) in enumerate(loader(n=32, batch_size=8)):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        row = {
            f"grad_norm/module/{m}": torch.nn.utils.get_total_norm([p.grad for p in getattr(model, m).parameters()])
            for m in ("encoder", "head")
        }
        row["grad_norm/total"] = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        row["grad_norm/total_post_clip"] = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        steps.append({k: v.item() for k, v in row.items()})
        if i != NAN_BATCH:
            opt.step()
    return {"steps": steps, "params": {n: p.detach().reshape(-1) for n, p in model.named_parameters()}}


def test_two_nodes_log_and_skip_identically_and_equal_one_process(tmp_path: Path) -> None:
    nodes = run_nodes("multinode_script.py", tmp_path, num_nodes=2, timeout=180)
    assert [(n["node_rank"], n["global_rank"], n["world_size"]) for n in nodes] == [(0, 0, 2), (1, 1, 2)]
    # Identical decisions and logged values on both nodes, bitwise (NaN included, hence the JSON text).
    assert json.dumps(nodes[0]["steps"]) == json.dumps(nodes[1]["steps"])
    assert nodes[0]["params"] == nodes[1]["params"]

    ref = reference()
    assert [s["skip"] for s in nodes[0]["steps"]] == [i == NAN_BATCH for i in range(len(ref["steps"]))]
    for i, (got, expected) in enumerate(zip(nodes[0]["steps"], ref["steps"], strict=True)):
        if i == NAN_BATCH:
            continue
        assert got["logged"].keys() == expected.keys()
        for key, value in got["logged"].items():
            assert value == pytest.approx(expected[key], rel=1e-5), key
    for name, values in nodes[0]["params"].items():
        torch.testing.assert_close(torch.tensor(values), ref["params"][name], rtol=1e-5, atol=1e-6, msg=name)
