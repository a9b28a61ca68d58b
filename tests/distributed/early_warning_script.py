"""2-process CPU job (gloo), started once per rank as ``torchrun`` starts one (:func:`helpers.run_processes`):

- ``EarlyWarning`` behind the loop door on a ``DistributedDataParallel`` TinyGPT, each rank with its own batches:
  each rank records what it logged and warned, and the largest attention logit of its own first batch element (the
  sample a ``scaled_dot_product_attention`` call is read from), computed by hand, per logging step;
- ``StepsToSkip`` under ``Trainer(strategy="gradkit_ddp")``: each rank records its final parameters, its global
  step, and the batches its ``training_step`` ran;
- ``QKClip`` behind the loop door on a ``DistributedDataParallel`` TinyGPT, each rank with its own batches (those of
  :func:`qk_clip_batches`): each rank records its final parameters and what it logged;
- ``QKClip`` behind the loop door on the test's ``ShardableLM`` sharded by FSDP2 (``fully_shard`` per block and at
  the root; each rank its element of ``sharded_batches``) and by tensor parallelism (``ColwiseParallel`` query, key
  and value projections, ``RowwiseParallel`` output projection; every rank the whole batch): each rank records its
  final (gathered) parameters and what it logged; then the error QKClip raises at the first forward of a model whose
  query projection alone is ``ColwiseParallel``; then the tensor-parallel case again under
  ``Trainer(strategy=GradKitModelParallelStrategy(tensor_parallel_size=2))`` with the ``QKClip`` callback.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from gradkit.doors.loop import GradKit
from gradkit.policies.early_warning import EarlyWarning
from gradkit.policies.qk_clip import QKClip
from helpers import MLPModule, distributed_trainer, pg_timeout, rank_loader, script_parser, write_rank_result
from lightning_gradkit import StepsToSkip
from lightning_gradkit.demos import GPTConfig, TinyGPT
from test_early_warning_distributed import (
    MHA_THRESHOLD,
    SHARDED_CONFIGS,
    SHARDED_SCALE_UPDATES,
    SHARDED_STEPS,
    SHARDED_THRESHOLD,
    MHAModel,
    ShardableLM,
    mha_batches,
    sharded_batches,
)

CONFIG = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=32)
STEPS = 6
DROPPED = [[1, 3]]


def _local_maxima(model: nn.Module, found: dict[str, list[float]]) -> None:
    """Forward hooks: the largest logit of each attention module for this rank's first batch element, by hand."""
    for i, block in enumerate(model.blocks):

        @torch.no_grad()
        def read(module: nn.Module, args: Any, output: Any, name: str = f"blocks.{i}.attn") -> None:
            x = args[0][:1]
            t, c = x.shape[1], x.shape[2]
            q, k, _ = module.qkv(x).split(c, dim=2)
            q, k = (z.view(1, t, module.n_head, c // module.n_head).transpose(1, 2) for z in (q, k))
            logits = (q @ k.transpose(-1, -2) / math.sqrt(c // module.n_head))[0]
            logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
            found.setdefault(name, []).append(float(logits.max()))

        block.attn.register_forward_hook(read)


def run_early_warning(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    local: dict[str, list[float]] = {}
    _local_maxima(model, local)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    logged: list[dict[str, float]] = []
    warning = EarlyWarning(
        output="lm_head", floors={"attn_logit_max": 0.0}, growth=1.01, growth_steps=2, sigmas=None, warmup_steps=0
    )
    kit = GradKit(ddp, optimizer, warning, log_every_n_steps=2, log_dir=False, log=lambda m, s: logged.append(m))
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    for _ in range(STEPS):
        x = torch.randint(256, (4, 16), generator=gen)
        loss = F.cross_entropy(ddp(x).flatten(0, 1), x.flatten())
        loss.backward()
        kit.note_loss(loss)
        kit.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    return {"logged": logged, "warnings": [list(w) for w in warning.warnings], "local": local}


class _Module(MLPModule):
    def __init__(self) -> None:
        super().__init__(lr=0.05, optimizer="adam")
        self.trained: list[int] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.trained.append(batch_idx)
        return super().training_step(batch, batch_idx)


def run_steps_to_skip(rank: int) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = _Module()
    trainer = distributed_trainer(strategy="gradkit_ddp", callbacks=[StepsToSkip(steps=DROPPED)])
    trainer.fit(module, rank_loader(rank, n=4 * 2 * STEPS, batch_size=4))
    return {
        "global_step": trainer.global_step,
        "trained": module.trained,
        "params": [p.detach().flatten().tolist() for p in module.parameters()],
    }


QK_THRESHOLD = 0.2


def qk_clip_batches(step: int) -> list[Tensor]:
    """Step ``step``'s batch of each rank (rank ``r`` takes element ``r``): the single-process reference trains on
    their concatenation."""
    gen = torch.Generator().manual_seed(200 + step)
    return list(torch.randint(256, (2, 4, 16), generator=gen))


def run_qk_clip(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(TinyGPT(CONFIG))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    logged: list[dict[str, float]] = []
    kit = GradKit(
        ddp,
        optimizer,
        QKClip(threshold=QK_THRESHOLD),
        log_every_n_steps=1,
        log_dir=False,
        log=lambda m, s: logged.append(m),
    )
    for step in range(3):
        x = qk_clip_batches(step)[rank]
        F.cross_entropy(ddp(x).flatten(0, 1), x.flatten()).backward()
        kit.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    kit.close()
    return {"logged": logged, "params": {n: p.detach().flatten().tolist() for n, p in ddp.module.named_parameters()}}


TP_PLAN = {
    "q_proj": ColwiseParallel(),
    "k_proj": ColwiseParallel(),
    "v_proj": ColwiseParallel(),
    "o_proj": RowwiseParallel(),
}


def run_qk_clip_sharded(rank: int, layout: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = ShardableLM(**SHARDED_CONFIGS[layout])  # the reference's initial weights, then sharded
    mesh = init_device_mesh("cpu", (2,))
    for block in model.blocks:
        if layout == "fsdp2":
            fully_shard(block, mesh=mesh)
        else:
            parallelize_module(block.attn, mesh, TP_PLAN)
    if layout == "fsdp2":
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    logged: list[dict[str, float]] = []
    clip = QKClip(threshold=SHARDED_THRESHOLD, scale_updates=SHARDED_SCALE_UPDATES[layout])
    kit = GradKit(model, optimizer, clip, log_every_n_steps=1, log_dir=False, log=lambda m, s: logged.append(m))
    for step in range(SHARDED_STEPS):
        x = sharded_batches(step)
        x = x[rank] if layout == "fsdp2" else x.flatten(0, 1)
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        kit.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    kit.close()
    params = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
    return {
        "logged": [{k: float(v) for k, v in row.items() if k.startswith("qk_clip/")} for row in logged],
        "params": {n: p.detach().flatten().tolist() for n, p in params.items()},
    }


def run_qk_clip_mha(rank: int) -> dict[str, Any]:
    """``nn.MultiheadAttention`` sharded by FSDP2 on itself (and at the root), behind the loop door."""
    model = MHAModel()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.mha, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    clip = QKClip(threshold=MHA_THRESHOLD, attention=["MultiheadAttention"])
    clipped = []
    with GradKit(model, optimizer, clip, log_dir=False) as kit:
        for x in mha_batches():
            model(x[2 * rank : 2 * rank + 2]).pow(2).mean().backward()
            kit.step(optimizer)
            optimizer.zero_grad()
            clipped.append(clip.clipped_heads)
    params = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
    return {"clipped": clipped, "params": {n: p.detach().flatten().tolist() for n, p in params.items()}}


class _TensorParallelLM(pl.LightningModule):
    """The test's ``ShardableLM``, tensor-parallel in ``configure_model`` (``GradKitModelParallelStrategy``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = ShardableLM(**SHARDED_CONFIGS["tp"])

    def configure_model(self) -> None:
        for block in self.model.blocks:
            parallelize_module(block.attn, self.device_mesh["tensor_parallel"], TP_PLAN)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x = batch[0]
        return F.cross_entropy(self.model(x).flatten(0, 1), x.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def run_qk_clip_trainer(rank: int) -> dict[str, list[float]]:
    """The tensor-parallel case under ``Trainer(strategy=GradKitModelParallelStrategy(tensor_parallel_size=2))``."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_gradkit import GradKitModelParallelStrategy
    from lightning_gradkit import QKClip as QKClipCallback

    module = _TensorParallelLM()
    data = TensorDataset(torch.cat([sharded_batches(step).flatten(0, 1) for step in range(SHARDED_STEPS)]))
    strategy = GradKitModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2, timeout=pg_timeout())
    trainer = distributed_trainer(strategy=strategy, callbacks=[QKClipCallback(threshold=SHARDED_THRESHOLD)])
    trainer.fit(module, DataLoader(data, batch_size=8))
    params = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in module.model.named_parameters()}
    return {n: p.detach().flatten().tolist() for n, p in params.items()}


def run_qk_clip_refused(rank: int) -> str:
    """Tensor parallelism on the query projection only: a rank's query heads meet every key head; QKClip's error."""
    torch.manual_seed(0)
    model = ShardableLM(**SHARDED_CONFIGS["tp"])
    mesh = init_device_mesh("cpu", (2,))
    for block in model.blocks:
        parallelize_module(block.attn, mesh, {"q_proj": ColwiseParallel()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with GradKit(model, optimizer, QKClip(threshold=SHARDED_THRESHOLD), log_dir=False):
        try:
            model(sharded_batches(0).flatten(0, 1))
        except RuntimeError as error:
            return str(error)
    return ""


def main() -> None:
    args = script_parser().parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = {
            "early_warning": run_early_warning(rank),
            "steps_to_skip": run_steps_to_skip(rank),
            "qk_clip": run_qk_clip(rank),
            "qk_clip_fsdp2": run_qk_clip_sharded(rank, "fsdp2"),
            "qk_clip_tp": run_qk_clip_sharded(rank, "tp"),
            "qk_clip_refused": run_qk_clip_refused(rank),
            "qk_clip_trainer": run_qk_clip_trainer(rank),
            "qk_clip_mha": run_qk_clip_mha(rank),
        }
    write_rank_result(args.out, rank, result)


if __name__ == "__main__":
    main()
