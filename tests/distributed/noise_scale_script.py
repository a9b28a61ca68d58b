"""2-process CPU job (gloo): ``GradNormMonitor(noise_scale=True)`` under DDP behind the Trainer and the loop door.

Started once per rank as ``torchrun`` starts a job (:func:`helpers.run_processes`): the script initializes
``torch.distributed``, the Trainer finds the process group up. Each rank records what the monitor logged (the
Trainer with 2 micro-batches per step under its ``no_sync``, counting the examples; the loop door with a given batch
size and a logging period of 2), the operations and host syncs of a non-logging and a logging DDP step with and
without the noise scale, the loop door's warning for an accumulation without ``no_sync``, and the refusals (FSDP2,
the loop door without a batch size).
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from gradkit import GradKit
from gradkit import GradNormMonitor as LoopMonitor
from helpers import MLPModule, count_syncs, distributed_trainer, rank_loader, script_parser, write_rank_result
from lightning_gradkit import GradNormMonitor
from lightning_gradkit.diagnostics.op_count import OpCounter

KEYS = ("grad_noise/", "grad_norm/total")


class Record(pl.Callback):
    """What the monitor logged at each optimizer step (it runs the pipeline first: it comes first in the list)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(KEYS)})


def run_trainer(rank: int) -> list[dict[str, float]]:
    """4 optimizer steps of 2 micro-batches of 4 examples per rank; the monitor counts the 8 examples itself."""
    torch.manual_seed(0)
    record = Record()
    monitor = GradNormMonitor(noise_scale=True, depth=0, log_every_n_steps=1)
    trainer = distributed_trainer(callbacks=[monitor, record], accumulate_grad_batches=2)
    trainer.fit(MLPModule(), rank_loader(rank, n=64, batch_size=4))
    return record.rows


def _ddp_model() -> DistributedDataParallel:
    torch.manual_seed(0)
    return DistributedDataParallel(MLPModule())


def run_loop(rank: int) -> list[tuple[int, dict[str, float]]]:
    """4 steps of 4 examples per rank, logged at steps 0 (the first), 1 and 3 (period 2)."""
    ddp = _ddp_model()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    rows: list[tuple[int, dict[str, float]]] = []
    monitor = LoopMonitor(noise_scale=True, noise_scale_batch_size=4, depth=0, log_every_n_steps=2)
    kit = GradKit(ddp, opt, monitor, log=lambda m, s: rows.append((s, m)), log_every_n_steps=2, log_dir=False)
    for x, y in rank_loader(rank, n=32, batch_size=4):
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        kit.step(opt)
    return rows


def _step_costs(noise: bool, rank: int) -> list[dict[str, Any]]:
    """Operations and host syncs of 3 whole DDP steps (forward, backward, ``kit.step``); step 0 logs, 1 and 2 not."""
    ddp = _ddp_model()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    extra: dict[str, Any] = {"noise_scale": True, "noise_scale_batch_size": 4} if noise else {}
    kit = GradKit(ddp, opt, LoopMonitor(depth=0, **extra), log=lambda m, s: None, log_every_n_steps=50, log_dir=False)
    costs = []
    for x, y in list(rank_loader(rank, n=24, batch_size=4))[:3]:
        with count_syncs() as syncs, syncs.active(), OpCounter() as counter:
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            kit.step(opt)
        costs.append({"launches": counter.launches, "ops": dict(counter.ops), "syncs": syncs.total})
    return costs


def run_unsynced_accumulation(rank: int) -> dict[str, Any]:
    """Two micro-batches per step: without ``no_sync`` at step 0 (a warning, no estimate), with it at step 1."""
    ddp = _ddp_model()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    rows: list[dict[str, float]] = []
    monitor = LoopMonitor(noise_scale=True, noise_scale_batch_size=8, depth=0)
    kit = GradKit(ddp, opt, monitor, log=lambda m, s: rows.append(m), log_every_n_steps=1, log_dir=False)
    batches = list(rank_loader(rank, n=32, batch_size=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            opt.zero_grad()
            (x0, y0), (x1, y1) = batches[2 * step : 2 * step + 2]
            with ddp.no_sync() if step == 1 else nullcontext():
                (nn.functional.mse_loss(ddp(x0), y0) / 2).backward()
            (nn.functional.mse_loss(ddp(x1), y1) / 2).backward()
            kit.step(opt)
    messages = [str(w.message) for w in caught if "noise_scale" in str(w.message)]
    return {"rows": [{k: v for k, v in r.items() if k.startswith(KEYS)} for r in rows], "warnings": messages}


def refusals() -> dict[str, str]:
    """The errors of FSDP2 and of a loop door without the batch size (the message of each)."""
    out = {}
    torch.manual_seed(0)
    sharded = fully_shard(MLPModule())
    try:
        GradKit(sharded, torch.optim.SGD(sharded.parameters(), lr=0.1), LoopMonitor(noise_scale=True), log_dir=False)
    except ValueError as err:
        out["fsdp2"] = str(err)
    ddp = _ddp_model()
    try:
        GradKit(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), LoopMonitor(noise_scale=True), log_dir=False)
    except ValueError as err:
        out["no_batch_size"] = str(err)
    return out


def main() -> None:
    args = script_parser().parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result: dict[str, Any] = {"trainer": run_trainer(rank), "loop": run_loop(rank)}
        result["costs"] = {"noise": _step_costs(True, rank), "plain": _step_costs(False, rank)}
    result["unsynced"] = run_unsynced_accumulation(rank)
    result["refusals"] = refusals()
    write_rank_result(args.out, rank, result)


if __name__ == "__main__":
    main()
