"""2-process CPU job (gloo): rank 1 trains a different parameter layout; every rank records the error it got.

Two fits in one launch: DDP where rank 1 hands its optimizer the parameters in reverse order (DDP checks the module's
parameter shapes, not the optimizer's order), and FSDP2 where rank 1's model has an extra layer.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from helpers import MLPModule, ShardedMLP, distributed_trainer, rank_loader, script_parser, write_rank_result
from lightning_gradkit import ClipGradNorm, GradNormMonitor


class ReversedOnRankOne(MLPModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = list(self.parameters())
        return torch.optim.SGD(params[::-1] if self.trainer.global_rank == 1 else params, lr=self.lr)


class ExtraLayerOnRankOne(ShardedMLP):
    def configure_model(self) -> None:
        if self.trainer.global_rank == 1:
            self.extra = nn.Linear(16, 16)
        super().configure_model()


def error_of(model: MLPModule, strategy: Any, callbacks: list) -> str | None:
    trainer = distributed_trainer(strategy=strategy, callbacks=callbacks)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, rank_loader(trainer.global_rank))
    except RuntimeError as err:
        return str(err)
    return None


def main() -> None:
    args = script_parser().parse_args()
    torch.manual_seed(0)
    out = {"ddp_order": error_of(ReversedOnRankOne(), "ddp", [GradNormMonitor()])}
    fsdp2 = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    out["fsdp2_extra"] = error_of(ExtraLayerOnRankOne(), fsdp2, [ClipGradNorm(1.0)])
    rank = torch.distributed.get_rank()
    write_rank_result(args.out, rank, out)


if __name__ == "__main__":
    main()
