"""gradkit on a 2-D device mesh (tensor parallel x FSDP2, 4 CPU processes, gloo) against a single process.

``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)``: the up/down projections of two pre-LN MLP
blocks are column/row-parallel over the tensor-parallel dimension, then every block is ``fully_shard``-ed over the
data-parallel dimension. The LayerNorms, the input projection and the head are only ``fully_shard``-ed: they live on
the 1-D data-parallel sub-mesh and the two tensor-parallel ranks of a data-parallel group hold the same shard of
them, which must count once. The reference is one process with the same initial weights on the same global batches
(each data-parallel rank gets half of a global batch; both tensor-parallel ranks of a group get the same half).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn

from helpers import loader, run_distributed

pytestmark = pytest.mark.distributed

WIDTH = 8
MAX_NORM = 1.0
LR = 0.1
DEPTH = 2


class Block(nn.Module):
    """Pre-LN MLP block: ``x + down(gelu(up(ln(x))))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.ln(x))))


class TPBlocks(pl.LightningModule):
    """Input projection, two pre-LN MLP blocks and a head, SGD. ``configure_model`` applies TP then FSDP2 when the
    strategy provides a device mesh; without one (the reference) it is an ordinary module."""

    def __init__(self, nan_at_step: int | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.Sequential(Block(WIDTH), Block(WIDTH))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.inp(x)))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        for block in self.blocks:
            parallelize_module(block, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        for block in self.blocks:
            fully_shard(block, mesh=dp)
        fully_shard(self, mesh=dp)


def module_norms(model: nn.Module) -> dict[str, float]:
    """Per-module 2-norms of the gradients at ``DEPTH`` components of the parameter names, as the monitor groups."""
    groups: dict[str, list[Tensor]] = {}
    for name, p in model.named_parameters():
        groups.setdefault(".".join(name.split(".")[:-1][:DEPTH]), []).append(p.grad)
    return {f"grad_norm/module/{k}": torch.nn.utils.get_total_norm(v).item() for k, v in groups.items()}


def reference(windows: list[list[int]], skip: set[int], accumulate: int) -> dict[str, Any]:
    """One process, global batches of 8: per optimizer step the pre-clip total and module norms (of the gradients
    after the exact-accumulation scale ``accumulate / len(window)``), ``clip_grad_norm_`` and SGD; the steps in
    ``skip`` are not taken. Lightning divides each micro-batch loss by ``accumulate``."""
    torch.manual_seed(0)
    model = TPBlocks()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    batches = list(loader(n=8 * sum(len(w) for w in windows), batch_size=8))
    steps: list[dict[str, float]] = []
    for step, window in enumerate(windows):
        opt.zero_grad()
        for i in window:
            x, y = batches[i]
            (nn.functional.mse_loss(model(x), y) / accumulate).backward()
        scale = accumulate / len(window)
        for p in model.parameters():
            p.grad.mul_(scale)
        row = {"scale": scale, **module_norms(model)}
        row["grad_norm/total"] = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
        row["grad_norm/total_post_clip"] = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
        steps.append(row)
        if step not in skip:
            opt.step()
    return {"steps": steps, "params": {n: p.detach().reshape(-1) for n, p in model.named_parameters()}}


def assert_params_close(got: dict[str, list[float]], expected: dict[str, Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, ref in expected.items():
        torch.testing.assert_close(torch.tensor(got[name]), ref, rtol=1e-5, atol=1e-6, msg=name)


def test_2d_mesh_norms_clipping_skip_and_accumulation_equal_one_process(tmp_path: Path) -> None:
    ranks = run_distributed("mesh2d_script.py", tmp_path, nprocs=4, timeout=240)
    for rank in ranks[1:]:
        for case in ("clip", "guard"):
            # Every rank logged and decided exactly the same (NaN included, hence the JSON text).
            assert json.dumps(rank[case]["steps"]) == json.dumps(ranks[0][case]["steps"]), case
    got = ranks[0]

    # Monitor + ClipGradNorm, 3 steps: logged norms, the clip decision (through the parameters it produced), and one
    # all-reduce per step for everything.
    ref = reference([[0], [1], [2]], skip=set(), accumulate=1)
    assert len(got["clip"]["steps"]) == 3
    for logged, expected in zip(got["clip"]["steps"], ref["steps"], strict=True):
        assert logged["skip"] is False
        assert logged["logged"].keys() == expected.keys() - {"scale"}
        for key, value in logged["logged"].items():
            assert value == pytest.approx(expected[key], rel=1e-5), key
    for rank in ranks:
        # Not bitwise across ranks: the tensor-parallel ranks compute their replicated LayerNorm gradients apart.
        assert_params_close(rank["clip"]["params"], ref["params"])
    assert got["clip"]["all_reduces"] == 3

    # NonFiniteGuard + AccumulationGuard + ClipGradNorm, accumulate 2 over 5 batches: windows [0, 1], [2, 3], [4].
    # A NaN in one rank's shard of one LayerNorm gradient at the second step skips that step on every rank; the
    # short last window is scaled by 2 / 1.
    ref = reference([[0, 1], [2, 3], [4]], skip={1}, accumulate=2)
    steps = got["guard"]["steps"]
    assert [s["skip"] for s in steps] == [False, True, False]
    assert math.isnan(steps[1]["total"])
    for k in (0, 2):
        assert steps[k]["scale"] == pytest.approx(ref["steps"][k]["scale"])
        assert steps[k]["total"] == pytest.approx(ref["steps"][k]["grad_norm/total"], rel=1e-5)
    assert got["guard"]["skipped_steps"] == 1
    for rank in ranks:
        assert_params_close(rank["guard"]["params"], ref["params"])


SEQ, FEATURES = 4, 2


class SequenceParallelMLP(pl.LightningModule):
    """Tokens of ``FEATURES`` values (each sample is ``SEQ`` of them), a per-token input projection, one pre-LN MLP
    block and a per-token head; the loss is the mean squared error over all tokens. ``configure_model`` makes it
    sequence parallel: each tensor-parallel rank keeps its slice of the sequence, the per-token modules
    (``SequenceParallel``) hold replicated parameters whose gradients autograd leaves ``Partial``, and the rank's loss
    is its share of the global mean (the gradients of the shares add up to the gradient of the mean)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.block = Block(WIDTH)
        self.head = nn.Linear(WIDTH, 1)
        self.tp_rank, self.tp_size = 0, 1

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.view(x.shape[0], SEQ, FEATURES)
        part = SEQ // self.tp_size
        return self.head(self.block(self.inp(tokens[:, self.tp_rank * part : (self.tp_rank + 1) * part])))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        out = self(x)
        return (out - y[:, None, :]).pow(2).sum() / (x.shape[0] * SEQ)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def configure_model(self) -> None:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        tp = self.device_mesh["tensor_parallel"]
        self.tp_rank, self.tp_size = tp.get_local_rank(), tp.size()
        per_token = SequenceParallel(use_local_output=True)
        plan = {
            "inp": per_token,
            "block.ln": per_token,
            "block.up": ColwiseParallel(input_layouts=Shard(1)),
            "block.down": RowwiseParallel(output_layouts=Shard(1)),
            "head": per_token,
        }
        parallelize_module(self, tp, plan)


def sequence_parallel_reference(steps: int) -> dict[str, Any]:
    """One process on the full sequences: pre-clip norms from ``clip_grad_norm_``, then SGD."""
    torch.manual_seed(0)
    model = SequenceParallelMLP()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    rows = []
    for x, y in list(loader(n=4 * steps, batch_size=4)):
        opt.zero_grad()
        model.training_step((x, y), 0).backward()
        rows.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
    return {"totals": rows, "params": {n: p.detach().reshape(-1) for n, p in model.named_parameters()}}


def test_sequence_parallel_partial_gradients_are_summed_before_the_norm(tmp_path: Path) -> None:
    ranks = run_distributed("sequence_parallel_script.py", tmp_path, timeout=180)
    ref = sequence_parallel_reference(steps=3)
    for rank in ranks:
        assert rank["partial_before"]  # autograd did leave Partial gradients for the engine to resolve
        assert rank["totals"] == pytest.approx(ref["totals"], rel=1e-5)
        assert_params_close(rank["params"], ref["params"])
