"""4-process CPU job (gloo): gradkit under a 2 x 2 (data parallel x tensor parallel) mesh, TP then FSDP2.

Two fits in one launch (each launch costs seconds): monitor + ClipGradNorm, then NonFiniteGuard + AccumulationGuard
+ ClipGradNorm with a NaN written into one rank's gradient shard. Each rank records what it logged and decided and
its final (full) parameters in ``rank<r>.json``.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from accum_script import CollectiveCounter
from torch.optim import Optimizer

from helpers import distributed_trainer, pg_timeout, rank_loader, script_parser, write_rank_result
from lightning_gradkit import (
    AccumulationGuard,
    ClipGradNorm,
    GradKitModelParallelStrategy,
    GradNormMonitor,
    NonFiniteGuard,
)
from lightning_gradkit.trainer_door import TrainerPipeline
from test_scale_distributed import DEPTH, MAX_NORM, TPBlocks

DATA_PARALLEL, TENSOR_PARALLEL = 2, 2
NAN_RANK, NAN_STEP, NAN_PARAM = 3, 1, "blocks.1.ln.weight"


class PoisonOneShard(pl.Callback):
    """Writes a NaN into rank ``NAN_RANK``'s local shard of one gradient before the gradkit engine reads them."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, opt: Optimizer) -> None:
        if trainer.global_rank == NAN_RANK and trainer.global_step == NAN_STEP:
            grad = dict(pl_module.named_parameters())[NAN_PARAM].grad
            grad._local_tensor.view(-1)[0] = float("nan")


class Record(pl.Callback):
    """After the engine ran (listed after the gradkit callbacks): what it decided, and what the monitor logged."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, opt: Optimizer) -> None:
        record = TrainerPipeline.of(trainer).last_records[id(opt)]
        decision = record.decision
        self.steps.append(
            {
                "skip": bool(decision.skip) if decision.skip is not None else False,
                "scale": float(decision.scale) if decision.scale is not None else 1.0,
                "total": float(decision.scaled(record.stats.primary.total)),
            }
        )

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.steps and "logged" not in self.steps[-1]:
            metrics = trainer.callback_metrics
            self.steps[-1]["logged"] = {k: float(v) for k, v in metrics.items() if k.startswith("grad_norm")}


def full_params(model: torch.nn.Module) -> dict[str, list[float]]:
    return {n: p.full_tensor().detach().reshape(-1).tolist() for n, p in model.named_parameters()}


def fit(callbacks: list[pl.Callback], n: int, accumulate: int = 1) -> tuple[pl.Trainer, TPBlocks]:
    torch.manual_seed(0)
    model = TPBlocks()
    strategy = GradKitModelParallelStrategy(
        data_parallel_size=DATA_PARALLEL, tensor_parallel_size=TENSOR_PARALLEL, timeout=pg_timeout()
    )
    trainer = distributed_trainer(
        devices=DATA_PARALLEL * TENSOR_PARALLEL,
        strategy=strategy,
        accumulate_grad_batches=accumulate,
        log_every_n_steps=1,
        callbacks=callbacks,
    )
    # init_device_mesh lays ranks out row-major: rank r is data-parallel rank r // TENSOR_PARALLEL.
    data = rank_loader(trainer.global_rank // TENSOR_PARALLEL, world_size=DATA_PARALLEL, n=n, batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data)
    return trainer, model


def main() -> None:
    args = script_parser().parse_args()
    out: dict[str, Any] = {}

    collectives = CollectiveCounter()
    collectives.watch(TrainerPipeline, "run")
    record = Record()
    trainer, model = fit([GradNormMonitor(depth=DEPTH), ClipGradNorm(MAX_NORM), record], n=24)
    out["clip"] = {"steps": record.steps, "params": full_params(model), "all_reduces": collectives.calls}

    record = Record()
    callbacks = [PoisonOneShard(), NonFiniteGuard(action="skip"), AccumulationGuard(), ClipGradNorm(MAX_NORM), record]
    trainer, model = fit(callbacks, n=40, accumulate=2)
    skipped = TrainerPipeline.of(trainer).skipped_steps
    out["guard"] = {
        "steps": [{k: v for k, v in s.items() if k != "logged"} for s in record.steps],
        "params": full_params(model),
        "skipped_steps": int(skipped) if skipped is not None else 0,
    }
    write_rank_result(args.out, trainer.global_rank, out)


if __name__ == "__main__":
    main()
