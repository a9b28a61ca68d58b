"""2-process CPU job (gloo): a backbone that is in the optimizer from the start, frozen with ``requires_grad_(False)``
in epoch 0 and unfrozen with ``requires_grad_(True)`` in epoch 1, under FSDP2 (``fully_shard`` per submodule) and DDP.

Per strategy two fits: ``ClipGradNorm`` + ``GradNormMonitor`` (what is logged, and the gradient and the update the
optimizer applies on the first unfrozen step), then the same with ``NonFiniteGuard(action="skip")`` and a NaN written
into rank 1's piece of a backbone gradient on that step. Each rank writes what it saw to ``rank<r>.json``.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.optim import Optimizer

from gradkit.step.norms import local_tensor
from helpers import column, distributed_trainer, rank_loader, read_metrics, script_parser, write_rank_result
from lightning_gradkit import (
    ClipGradNorm,
    GradKitDDPStrategy,
    GradKitModelParallelStrategy,
    GradNormMonitor,
    NonFiniteGuard,
)
from lightning_gradkit.trainer_door import TrainerPipeline

BATCHES = 4  # per epoch and rank: step BATCHES is the first unfrozen step
LR = 0.1
MAX_NORM = 0.05
NAN_PARAM = "backbone.0.weight"


class UnfreezingModel(pl.LightningModule):
    """Every parameter in the optimizer; the backbone is frozen in epoch 0 only."""

    def __init__(self, sharded: bool) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)
        self.sharded = sharded
        self.names: list[str] = []

    def configure_model(self) -> None:
        if self.sharded:
            from torch.distributed.fsdp import fully_shard

            for module in (self.backbone, self.head):
                fully_shard(module, mesh=self.device_mesh["data_parallel"])

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Optimizer:
        # The optimizer's parameters (FSDP2's sharded ones), named in their order.
        self.names = [n for n, _ in self.named_parameters()]
        return torch.optim.SGD(self.parameters(), lr=LR)

    def on_train_epoch_start(self) -> None:
        self.backbone.requires_grad_(self.current_epoch >= 1)


def _stepped(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _full(t: Tensor) -> list[float]:
    """The whole tensor as every rank sees it (a collective for a DTensor: every rank calls it in the same order)."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().reshape(-1).tolist()


class PoisonGradient(pl.Callback):
    """Writes a NaN into rank 1's piece of a backbone gradient on the first unfrozen step, before the gradkit engine
    reads the gradients (listed before the gradkit callbacks)."""

    def __init__(self) -> None:
        self.written = False

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, opt: Optimizer) -> None:
        if trainer.global_rank == 1 and trainer.global_step == BATCHES:
            param = _stepped(opt)[pl_module.names.index(NAN_PARAM)]
            local_tensor(param.grad).view(-1)[0] = math.nan
            self.written = True


class Record(pl.Callback):
    """After the engine wrote the gradients (listed after the gradkit callbacks): which parameters the optimizer is
    about to step, and on the first unfrozen step the gradients it applies and the parameters before and after."""

    def __init__(self) -> None:
        self.with_grad: list[list[str]] = []
        self.applied: dict[str, list[float]] = {}
        self.before: dict[str, list[float]] = {}
        self.after: dict[str, list[float]] = {}
        self.local_before: list[Tensor] = []
        self.unchanged: bool | None = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, opt: Optimizer) -> None:
        params = _stepped(opt)
        self.with_grad.append([n for n, p in zip(pl_module.names, params, strict=True) if p.grad is not None])
        if trainer.global_step != BATCHES:
            return
        for name, p in zip(pl_module.names, params, strict=True):
            self.applied[name] = _full(p.grad)
            self.before[name] = _full(p)
        self.local_before = [local_tensor(p.detach()).clone() for p in params]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step != BATCHES + 1:  # the step counter has already moved past the recorded step
            return
        params = _stepped(trainer.optimizers[0])
        self.after = {name: _full(p) for name, p in zip(pl_module.names, params, strict=True)}
        after = [local_tensor(p.detach()) for p in params]
        self.unchanged = all(torch.equal(a, b) for a, b in zip(self.local_before, after, strict=True))


def fit(out: Path, name: str, sharded: bool, poison: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = UnfreezingModel(sharded)
    record = Record()
    gradkit: list[pl.Callback] = [GradNormMonitor(depth=0), ClipGradNorm(MAX_NORM)]
    if poison:
        gradkit = [PoisonGradient(), *gradkit, NonFiniteGuard(action="skip")]
    strategy: Any = GradKitModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    if not sharded:
        # DDP expects a gradient for every parameter it was built with; the frozen backbone has none in epoch 0.
        strategy = GradKitDDPStrategy(find_unused_parameters=True)
    trainer = distributed_trainer(
        strategy=strategy, max_epochs=2, logger=CSVLogger(out, name=name), callbacks=[*gradkit, record]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, rank_loader(trainer.global_rank, n=BATCHES * 8))
    result: dict[str, Any] = {
        "with_grad": record.with_grad,
        "applied": record.applied,
        "before": record.before,
        "after": record.after,
        "poisoned": any(isinstance(cb, PoisonGradient) and cb.written for cb in trainer.callbacks),
        "skipped": float(skipped) if (skipped := TrainerPipeline.of(trainer).skipped_steps) is not None else 0.0,
        "unchanged": record.unchanged,
        "warnings": [str(w.message) for w in caught if "requires_grad=False" in str(w.message)],
    }
    if trainer.global_rank == 0:
        rows = read_metrics(trainer)
        result["total"] = column(rows, "grad_norm/total")
        result["post_clip"] = column(rows, "grad_norm/total_post_clip")
    return result


def main() -> None:
    args = script_parser().parse_args()
    results = {}
    for strategy in ("fsdp2", "ddp"):
        for poison in (False, True):
            name = f"{strategy}-{'nan' if poison else 'clean'}"
            results[name] = fit(args.out, name, strategy == "fsdp2", poison)
    write_rank_result(args.out, torch.distributed.get_rank(), results)


if __name__ == "__main__":
    main()
