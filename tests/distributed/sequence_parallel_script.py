"""2-process CPU job (gloo): monitor + ClipGradNorm on a sequence-parallel model (tensor parallel only, no FSDP).

Each rank records whether autograd left ``Partial`` gradients, the logged pre-clip totals, and its final parameters.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch.optim import Optimizer

from helpers import distributed_trainer, loader, pg_timeout, script_parser, write_rank_result
from lightning_gradkit import ClipGradNorm, GradKitModelParallelStrategy, GradNormMonitor
from test_scale_distributed import MAX_NORM, SequenceParallelMLP


class SeePartial(pl.Callback):
    """Listed first: sees the gradients as autograd left them, before the gradkit engine."""

    def __init__(self) -> None:
        self.partial = False

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, opt: Optimizer) -> None:
        self.partial |= any(
            placement.is_partial()
            for p in pl_module.parameters()
            if p.grad is not None
            for placement in p.grad.placements
        )


class Totals(pl.Callback):
    def __init__(self) -> None:
        self.totals: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.totals.append(float(trainer.callback_metrics["grad_norm/total"]))


def main() -> None:
    args = script_parser().parse_args()
    torch.manual_seed(0)
    model = SequenceParallelMLP()
    strategy = GradKitModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2, timeout=pg_timeout())
    see, totals = SeePartial(), Totals()
    trainer = distributed_trainer(strategy=strategy, callbacks=[see, GradNormMonitor(), ClipGradNorm(MAX_NORM), totals])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Every rank gets the whole batch (one data-parallel rank); the model keeps its slice of each sequence.
        trainer.fit(model, loader(n=12, batch_size=4))
    params = {n: p.full_tensor().detach().reshape(-1).tolist() for n, p in model.named_parameters()}
    out = {"partial_before": see.partial, "totals": totals.totals, "params": params}
    write_rank_result(args.out, trainer.global_rank, out)


if __name__ == "__main__":
    main()
