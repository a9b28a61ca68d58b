"""2-process job: every clipping callback under FSDP2 (ModelParallelStrategy) and DDP (CPU or GPU), or FSDP1 (GPU),
one fit each.

All fits share one launch (the process group outlives a Trainer). Each rank records, per strategy and case, the
logged clipping metrics of every step and the full parameters at the end.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from helpers import MLPModule, ShardedMLP, distributed_trainer, rank_loader, script_parser, write_rank_result
from lightning_gradkit import AdaptiveGradClip, AutoClip, ClipGradNorm, ClipGradValue, GradNormMonitor, ZClip

CASES = {
    "norm": lambda: ClipGradNorm(0.8),
    "value": lambda: ClipGradValue(0.1),
    "agc": lambda: AdaptiveGradClip(clip_factor=0.05),
    "autoclip": lambda: AutoClip(percentile=25.0, history_size=4),
    "zclip": lambda: ZClip(alpha=0.9, z_threshold=0.5, warmup_steps=3, max_norm=1.4),
}
N_SAMPLES = 64


class Record(pl.Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        keys = ("grad_clip/", "grad_norm/total")
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(keys)})


def full_params(trainer: pl.Trainer, model: torch.nn.Module) -> dict[str, list]:
    if isinstance(trainer.strategy, FSDPStrategy):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(trainer.strategy.model):
            return {name: p.detach().cpu().tolist() for name, p in model.named_parameters()}
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).cpu().tolist()
    return out


def make_strategy(name: str) -> tuple[MLPModule, ModelParallelStrategy | FSDPStrategy | str]:
    if name == "fsdp2":
        return ShardedMLP(), ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    if name == "fsdp1":
        return MLPModule(), FSDPStrategy(use_orig_params=True)
    return MLPModule(), "ddp"


def main() -> None:
    parser = script_parser()
    parser.add_argument("--strategies", default="fsdp2,ddp", help="comma-separated: fsdp2, ddp, fsdp1 (GPU only)")
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args()

    results: dict[str, dict] = {name: {} for name in args.strategies.split(",")}
    rank = 0
    for strategy_name, case in ((s, c) for s in results for c in CASES):
        if strategy_name == "fsdp1" and case == "agc":
            continue  # AGC needs unflattened parameters: it refuses FSDP1 at setup
        torch.manual_seed(0)
        model, strategy = make_strategy(strategy_name)
        record = Record()
        trainer = distributed_trainer(
            accelerator=args.accelerator, strategy=strategy, callbacks=[CASES[case](), GradNormMonitor(), record]
        )
        trainer.fit(model, rank_loader(trainer.global_rank, n=N_SAMPLES))
        rank = trainer.global_rank
        results[strategy_name][case] = {"metrics": record.rows, "params": full_params(trainer, model)}
    write_rank_result(args.out, rank, results)


if __name__ == "__main__":
    main()
