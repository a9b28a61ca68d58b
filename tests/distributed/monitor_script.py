"""2-process CPU job: GradNormMonitor under DDP or FSDP2 (ModelParallelStrategy); each rank records what it logged.

With ``--update-ratio`` the model trains with Adam and the monitor logs the update-to-weight ratios, which are
recorded instead of the gradient norms.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from helpers import MLPModule, ShardedMLP, distributed_trainer, rank_loader, script_parser, write_rank_result
from lightning_gradkit import GradNormMonitor


class Record(pl.Callback):
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Runs after the monitor's own batch end (the monitor comes first in the callbacks), which logs the ratios.
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(self.prefix)})


def main() -> None:
    parser = script_parser()
    parser.add_argument("--strategy", choices=["ddp", "fsdp2"], required=True)
    parser.add_argument("--norm-type", type=float, default=2.0)
    parser.add_argument("--update-ratio", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    kwargs = {"optimizer": "adam", "lr": 0.01} if args.update_ratio else {}
    if args.strategy == "fsdp2":
        model, strategy = ShardedMLP(**kwargs), ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    else:
        model, strategy = MLPModule(**kwargs), "ddp"
    record = Record("update_ratio" if args.update_ratio else "grad_norm")
    monitor = GradNormMonitor(norm_type=args.norm_type, depth=1, update_ratio=args.update_ratio)
    trainer = distributed_trainer(strategy=strategy, callbacks=[monitor, record])
    trainer.fit(model, rank_loader(trainer.global_rank))
    write_rank_result(args.out, trainer.global_rank, record.rows)


if __name__ == "__main__":
    main()
