"""2-process CPU job: ActivationCheckpointing under DDP or FSDP2 (ModelParallelStrategy).

Several fits run in one launch, one per configuration, each from the same initial weights and dropout seed. Each
rank saves the full gradients of every step to ``grads_<config>_rank<r>.pt`` and writes what the callback reported
to ``rank<r>.json``; the test compares every configuration's gradients with the run without checkpointing.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, Subset

from helpers import distributed_trainer, script_parser, write_rank_result
from lightning_gradkit import ActivationCheckpointing
from lightning_gradkit.activation_checkpointing.injection import injected_mode
from lightning_gradkit.demos import ByteDataset, GPTConfig, TinyGPT, TinyGPTModule, stdlib_text

MODEL = dict(n_layer=3, n_head=2, n_embd=32, block_size=32, dropout=0.1, lr=1e-2)
STEPS = 2


class GPT(TinyGPTModule):
    """Built in ``__init__`` (``late=False``) or in ``configure_model`` (``late=True``); sharded there under FSDP2."""

    def __init__(self, late: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.late = late
        if late:
            self.model = None

    def configure_model(self) -> None:
        if self.late and self.model is None:
            h = self.hparams
            torch.manual_seed(0)
            self.model = TinyGPT(GPTConfig(256, h.block_size, h.n_layer, h.n_head, h.n_embd, h.dropout))
        if self.device_mesh is not None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    def on_train_start(self) -> None:
        torch.manual_seed(1234)  # the same dropout stream in every configuration


class Record(pl.Callback):
    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.injected: list[str] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if not self.grads:
            self.injected = [n for n, m in pl_module.named_modules() if injected_mode(m)]
        grads = {}
        for name, p in pl_module.named_parameters():
            g = p.grad
            grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
        self.grads.append(grads)


def rank_loader(rank: int) -> DataLoader:
    data = ByteDataset(stdlib_text(max_bytes=3000), block_size=32)
    return DataLoader(Subset(data, range(rank, len(data), 2)), batch_size=4)


CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "ddp": {
        "none": {},
        "full": {"callback": {"mode": "full"}},
        "selective": {"callback": {"mode": "selective"}},
        "budget": {"callback": {"memory_budget": 0.5}},
        "full_late": {"callback": {"mode": "full"}, "late": True},
    },
    "fsdp2": {
        "none": {},
        "full": {"callback": {"mode": "full"}},
        "selective_late": {"callback": {"mode": "selective"}, "late": True},
        "budget": {"callback": {"memory_budget": 0.5}},
    },
}


def main() -> None:
    parser = script_parser()
    parser.add_argument("--strategy", choices=list(CONFIGS), required=True)
    args = parser.parse_args()

    report: dict[str, Any] = {}
    rank = 0
    for name, config in CONFIGS[args.strategy].items():
        torch.manual_seed(0)
        model = GPT(late=config.get("late", False), **MODEL)
        if args.strategy == "fsdp2":
            strategy: Any = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        else:
            strategy = "ddp"  # Lightning's default: find_unused_parameters=False, no static graph
        record = Record()
        callbacks: list[pl.Callback] = [record]
        callback = None
        if "callback" in config:
            callback = ActivationCheckpointing(["Block"], **config["callback"])
            callbacks.insert(0, callback)
        trainer = distributed_trainer(strategy=strategy, max_epochs=None, max_steps=STEPS, callbacks=callbacks)
        rank = trainer.global_rank
        trainer.fit(model, rank_loader(rank))
        torch.save(record.grads, args.out / f"grads_{name}_rank{rank}.pt")
        report[name] = {
            "injected_in_first_step": record.injected,
            "checkpointed": callback.checkpointed_modules if callback else [],
            "before": callback.saved_bytes_before if callback else None,
            "after": callback.saved_bytes_after if callback else None,
            "steps": len(record.grads),
        }
    write_rank_result(args.out, rank, report)


if __name__ == "__main__":
    main()
