"""CPU job (gloo): gradkit under HSDP, FSDP2 on a 2 x 2 (replicate x shard) mesh of 4 processes, or HSDP with
tensor parallelism on a 2 x 2 x 2 (replicate x shard x tensor_parallel) mesh of 8 (``--world 8``).

On 4 processes, one fit per case in one launch (each launch costs seconds): the monitor with ClipGradNorm, ZClip and
AdaptiveGradClip, then NonFiniteGuard + AccumulationGuard + ClipGradNorm with a NaN written into one rank's gradient
shard. On 8, the monitor with ClipGradNorm. Each rank records per case what was logged at every optimizer step, the
collectives over the whole world during the batches of every step, and its final (full) parameters in
``rank<r>.json``.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from mesh2d_script import PoisonOneShard, full_params
from torch.optim import Optimizer

from helpers import distributed_trainer, pg_timeout, rank_loader, script_parser, write_rank_result
from lightning_gradkit import (
    AccumulationGuard,
    AdaptiveGradClip,
    ClipGradNorm,
    GradKitModelParallelStrategy,
    GradNormMonitor,
    NonFiniteGuard,
    ZClip,
)
from test_hsdp_distributed import AGC_FACTOR, GLOBAL_BATCH, REPLICATE, SHARD, STEPS, ZCLIP, HSDPBlocks, HSDPTPBlocks
from test_scale_distributed import DEPTH, MAX_NORM

WORLD = REPLICATE * SHARD
_COLLECTIVES = ("all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor")


class Record(pl.Callback):
    """Per optimizer step: what was logged (listed after the gradkit callbacks), and the ``torch.distributed``
    collectives on the default (world) group during the training batches of its window. The collectives are
    wrapped once per process; only the Record of the running fit counts."""

    active: Record | None = None

    def __init__(self) -> None:
        self.logged: list[dict[str, float]] = []
        self.collectives: list[int] = [0]
        self._in_batch = self._stepped = False

    @classmethod
    def wrap_collectives(cls) -> None:
        for name in _COLLECTIVES:
            setattr(dist, name, cls._counted(getattr(dist, name)))

    @classmethod
    def _counted(cls, collective: Any) -> Any:
        @functools.wraps(collective)
        def counted(*args: Any, group: Any = None, **kwargs: Any) -> Any:
            record = cls.active
            if record is not None and record._in_batch and (group is None or group is dist.group.WORLD):
                record.collectives[-1] += 1
            return collective(*args, group=group, **kwargs)

        return counted

    def on_train_batch_start(self, *args: Any) -> None:
        Record.active = self
        self._in_batch = True

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, opt: Optimizer) -> None:
        self._stepped = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._in_batch = False
        if self._stepped:
            self._stepped = False
            keys = ("grad_norm/", "grad_clip/", "gradkit/")
            self.logged.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(keys)})
            self.collectives.append(0)


def fit(
    callbacks: list[pl.Callback], batches: int, accumulate: int = 1, tensor_parallel: int = 1, world: int = WORLD
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = HSDPBlocks() if tensor_parallel == 1 else HSDPTPBlocks()
    data_parallel = world // tensor_parallel
    strategy = GradKitModelParallelStrategy(
        data_parallel_size=data_parallel, tensor_parallel_size=tensor_parallel, timeout=pg_timeout()
    )
    record = Record()
    trainer = distributed_trainer(
        devices=world,
        strategy=strategy,
        accumulate_grad_batches=accumulate,
        callbacks=[*callbacks, record],
    )
    # init_device_mesh lays ranks out row-major: rank r is data-parallel rank r // tensor_parallel.
    data_rank = trainer.global_rank // tensor_parallel
    per_rank = GLOBAL_BATCH // data_parallel
    data = rank_loader(data_rank, world_size=data_parallel, n=GLOBAL_BATCH * batches, batch_size=per_rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data)
    return {"logged": record.logged, "world_collectives": record.collectives[:-1], "params": full_params(model)}


def main() -> None:
    parser = script_parser()
    parser.add_argument("--world", type=int, default=WORLD, help=f"{WORLD}: the HSDP cases; 8: HSDP + TP, 2 x 2 x 2")
    args = parser.parse_args()
    Record.wrap_collectives()
    if args.world != WORLD:
        monitor_and_clip = [GradNormMonitor(depth=DEPTH), ClipGradNorm(MAX_NORM)]
        out = {"hsdp_tp": fit(monitor_and_clip, STEPS["norm"], tensor_parallel=2, world=args.world)}
        write_rank_result(args.out, dist.get_rank(), out)
        return
    clippers = {
        "norm": lambda: ClipGradNorm(MAX_NORM),
        "zclip": lambda: ZClip(**ZCLIP),
        "agc": lambda: AdaptiveGradClip(clip_factor=AGC_FACTOR),
    }
    out = {case: fit([GradNormMonitor(depth=DEPTH), make()], STEPS[case]) for case, make in clippers.items()}
    guard = [PoisonOneShard(), NonFiniteGuard(action="skip"), AccumulationGuard(), GradNormMonitor(depth=DEPTH)]
    out["guard"] = fit([*guard, ClipGradNorm(MAX_NORM)], batches=5, accumulate=2)
    write_rank_result(args.out, dist.get_rank(), out)


if __name__ == "__main__":
    main()
