"""2-process CPU job (gloo): AccumulationGuard, ManualAccumulator and InferenceModeValidation under DDP.

Several fits in one launch (each launch costs seconds): token mode, mean mode with a short last window, the manual
helper in token mode, and in-fit validation under gloo. Each rank writes what it saw to ``rank<r>.json``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn

from helpers import (
    MLPModule,
    ShardedMLP,
    count_syncs,
    distributed_trainer,
    rank_loader,
    script_parser,
    write_rank_result,
)
from lightning_gradkit import AccumulationGuard, InferenceModeValidation
from test_accumulation import ManualTokenLM, TokenLM, token_loader


def state(model: nn.Module) -> dict[str, list]:
    return {k: v.detach().tolist() for k, v in model.state_dict().items()}


class CollectiveCounter:
    """Counts ``torch.distributed.all_reduce`` calls made while a watched method runs."""

    def __init__(self) -> None:
        self.calls = 0
        self._active = False
        original = dist.all_reduce

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._active:
                self.calls += 1
            return original(*args, **kwargs)

        dist.all_reduce = counted

    def watch(self, obj: object, method: str) -> None:
        original = getattr(obj, method)

        @functools.wraps(original)
        def watched(*args: Any, **kwargs: Any) -> Any:
            self._active = True
            try:
                return original(*args, **kwargs)
            finally:
                self._active = False

        setattr(obj, method, watched)


class ValRecorder(MLPModule):
    def __init__(self) -> None:
        super().__init__()
        self.modes: list[list[bool]] = []

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.modes.append([torch.is_inference_mode_enabled(), torch.is_grad_enabled()])


def main() -> None:
    args = script_parser().parse_args()
    out: dict[str, Any] = {}

    # 1. Token mode: 5 micro-batches of 4 sequences per rank, N = 2 -> windows 2, 2, 1.
    torch.manual_seed(0)
    model = TokenLM()
    guard = AccumulationGuard(normalize="tokens")
    collectives = CollectiveCounter()
    collectives.watch(guard, "on_before_optimizer_step")
    t = distributed_trainer(accumulate_grad_batches=2, callbacks=[guard])
    rank = t.global_rank
    with count_syncs() as syncs:
        syncs.watch(guard, "on_before_optimizer_step")
        t.fit(model, token_loader(40, 4, rank=rank, world_size=2))
    out["tokens"] = state(model)
    out["tokens_steps"] = t.global_step
    out["tokens_all_reduces"] = collectives.calls
    out["tokens_syncs"] = syncs.total

    # 2. Mean mode: 10 micro-batches of 4 per rank, N = 4 -> windows 4, 4, 2.
    torch.manual_seed(0)
    model = MLPModule()
    t = distributed_trainer(accumulate_grad_batches=4, callbacks=[AccumulationGuard()])
    t.fit(model, rank_loader(rank, n=80, batch_size=4))
    out["mean"] = state(model)

    # 3. The manual helper in token mode (no_sync inside windows, one scalar all-reduce per step).
    torch.manual_seed(0)
    model = ManualTokenLM(2)
    t = distributed_trainer(callbacks=[AccumulationGuard(on_dirty="raise")])
    t.fit(model, token_loader(40, 4, rank=rank, world_size=2))
    out["manual_tokens"] = state(model)

    # 4. Validation under gloo: Lightning's evaluation loop refuses inference mode, so the callback falls back.
    model = ValRecorder()
    t = distributed_trainer(limit_val_batches=2, callbacks=[InferenceModeValidation()])
    t.fit(model, rank_loader(rank, n=16), rank_loader(rank, n=16))
    out["val_modes"] = model.modes
    try:
        distributed_trainer(limit_val_batches=1, callbacks=[InferenceModeValidation(fallback="raise")]).fit(
            ValRecorder(), rank_loader(rank, n=16), rank_loader(rank, n=16)
        )
        out["raise_message"] = None
    except RuntimeError as err:
        out["raise_message"] = str(err)

    # 5. FSDP2 (fully_shard): refused before gloo is even considered.
    try:
        fsdp2 = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        distributed_trainer(
            strategy=fsdp2, limit_val_batches=1, callbacks=[InferenceModeValidation(fallback="raise")]
        ).fit(ShardedMLP(), rank_loader(rank, n=16), rank_loader(rank, n=16))
        out["fsdp2_message"] = None
    except RuntimeError as err:
        out["fsdp2_message"] = str(err)

    write_rank_result(args.out, rank, out)


if __name__ == "__main__":
    main()
