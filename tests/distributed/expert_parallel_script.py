"""4-process CPU job (gloo, started as torchrun starts one): gradkit under expert parallelism, the loop door and the
Trainer, declared and undeclared (see ``tests/test_expert_parallel_distributed.py``).

Each rank records per case what was logged at every optimizer step, the collectives on the world group during each
step, the warnings rank 0 gave, its final parameters (FSDP2's shards gathered over the data-parallel copies: the
dense parameters whole, the experts of this rank), or, for the undeclared cases, the error that stopped it.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

import gradkit
from gradkit import AdaptiveGradClip, AutoClip, ClipGradNorm, GradKit, GradNormMonitor, NonFiniteGuard, ZClip
from helpers import distributed_trainer, pg_timeout, rank_loader, script_parser, write_rank_result
from lightning_gradkit import ClipGradNorm as ClipGradNormCallback
from lightning_gradkit import GradKitModelParallelStrategy
from lightning_gradkit import GradNormMonitor as GradNormMonitorCallback
from lightning_gradkit import NonFiniteGuard as NonFiniteGuardCallback
from test_expert_parallel_distributed import (
    AGC_FACTOR,
    AUTOCLIP,
    BATCH,
    BLOCKED,
    BLOCKED_STEP,
    DEPTH,
    DP,
    EP,
    LR,
    MAX_NORM,
    NAN_RANK,
    NAN_STEP,
    STEPS,
    ZCLIP,
    TinyMoE,
    make_model,
)

_COLLECTIVES = ("all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor")


class WorldCollectives:
    """Counts the ``torch.distributed`` collectives on the world group while :meth:`counting` (wrapped once)."""

    def __init__(self) -> None:
        self.active = False
        self.calls = 0
        for name in _COLLECTIVES:
            setattr(dist, name, self._counted(getattr(dist, name)))

    def _counted(self, collective: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(collective)
        def counted(*args: Any, group: Any = None, **kwargs: Any) -> Any:
            if self.active and (group is None or group is dist.group.WORLD):
                self.calls += 1
            return collective(*args, group=group, **kwargs)

        return counted

    @contextmanager
    def counting(self) -> Iterator[list[int]]:
        self.active, self.calls = True, 0
        found: list[int] = []
        try:
            yield found
        finally:
            self.active = False
            found.append(self.calls)


COUNTER: WorldCollectives


def poison(param: Tensor) -> None:
    """A NaN in this rank's (local) part of ``param``'s gradient."""
    grad = param.grad
    (grad._local_tensor if isinstance(grad, DTensor) else grad).view(-1)[0] = float("nan")


# -- the loop door: DDP over the dense layers, the experts all-reduced over their copies by the loop -------------------
def loop_fit(policies: list[Any], mesh: DeviceMesh, declare: bool = True) -> dict[str, Any]:
    model = make_model()
    model.moe.localize(mesh["ep"].get_group())
    if declare:
        gradkit.expert_parallel(model.moe.experts, mesh["ep"])
    experts = [f"moe.experts.{n}" for n, _ in model.moe.experts.named_parameters()]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    logged: list[dict[str, float]] = []
    kit = GradKit(ddp, opt, policies, log=lambda m, s: logged.append(m), log_every_n_steps=1, log_dir=False)
    dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group()
    collectives: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, (x, y) in enumerate(rank_loader(dp_rank, world_size=DP, n=DP * BATCH * STEPS, batch_size=BATCH)):
            model.moe.blocked = BLOCKED if step == BLOCKED_STEP else ()
            nn.functional.mse_loss(ddp(x), y).backward()
            for p in model.moe.experts.parameters():
                if p.grad is not None:  # None on both copies alike: their experts got no token anywhere
                    dist.all_reduce(p.grad, group=dp_group)
                    p.grad /= DP
            if step == NAN_STEP and dist.get_rank() == NAN_RANK and isinstance(policies[-1], NonFiniteGuard):
                poison(model.moe.experts.w_in)
            with COUNTER.counting() as found:
                kit.step(opt)
            collectives += found
            opt.zero_grad(set_to_none=True)
    params = {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()}
    return {"logged": logged, "world_collectives": collectives, "params": params, "warnings": _texts(caught)}


def loop_error(mesh: DeviceMesh) -> dict[str, Any]:
    """The same loop, experts undeclared: the error of the first step, if any."""
    steps_done = 0
    try:
        model = make_model()
        model.moe.localize(mesh["ep"].get_group())
        experts = [f"moe.experts.{n}" for n, _ in model.moe.experts.named_parameters()]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts)
        ddp = DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        kit = GradKit(ddp, opt, [GradNormMonitor(), ClipGradNorm(MAX_NORM)], log_every_n_steps=1, log_dir=False)
        x, y = next(iter(rank_loader(mesh["dp"].get_local_rank(), world_size=DP, n=DP * BATCH, batch_size=BATCH)))
        nn.functional.mse_loss(ddp(x), y).backward()
        for p in model.moe.experts.parameters():
            dist.all_reduce(p.grad, group=mesh["dp"].get_group())
        kit.step(opt)
        steps_done += 1
    except RuntimeError as error:
        return {"error": str(error), "steps_done": steps_done}
    return {"error": None, "steps_done": steps_done}


def _texts(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "NonFiniteGuard" in str(w.message)]


# -- the Trainer: FSDP2 over the data-parallel dimension, the experts declared over the second one ---------------------
class MoEModule(pl.LightningModule):
    def __init__(self, declare: bool = True) -> None:
        super().__init__()
        self.net: TinyMoE = make_model()
        self.declare = declare

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        ep, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        self.net.moe.localize(ep.get_group())
        if self.declare:
            gradkit.expert_parallel(self.net.moe.experts, ep)
        fully_shard(self.net.moe.experts, mesh=dp)
        fully_shard(self, mesh=dp)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)  # through the root's FSDP2 hooks, which gather the dense parameters

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.net.moe.blocked = BLOCKED if self.trainer.global_step == BLOCKED_STEP else ()
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class Record(pl.Callback):
    """Listed first: poisons rank ``NAN_RANK``'s shard of the experts' gradient at ``NAN_STEP`` before the engine
    reads it; per optimizer step, the world collectives of its batch and what was logged."""

    def __init__(self) -> None:
        self.logged: list[dict[str, float]] = []
        self.collectives: list[int] = []
        self._counting: Any = None

    def on_train_batch_start(self, *args: Any) -> None:
        self._counting = COUNTER.counting()
        self._found = self._counting.__enter__()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, opt: Optimizer) -> None:
        if trainer.global_step == NAN_STEP and trainer.global_rank == NAN_RANK:
            poison(pl_module.net.moe.experts.w_in)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._counting.__exit__(None, None, None)
        self.collectives += self._found
        keys = ("grad_norm/", "grad_clip/", "gradkit/")
        self.logged.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(keys)})


def trainer_fit(declare: bool) -> dict[str, Any]:
    module = MoEModule(declare)
    record = Record()
    callbacks = [
        record,
        GradNormMonitorCallback(depth=DEPTH + 1),  # the LightningModule's `net.` adds a component
        ClipGradNormCallback(MAX_NORM),
        NonFiniteGuardCallback(action="skip"),
    ]
    strategy = GradKitModelParallelStrategy(data_parallel_size=DP, tensor_parallel_size=EP, timeout=pg_timeout())
    trainer = distributed_trainer(devices=DP * EP, strategy=strategy, callbacks=callbacks, max_steps=STEPS)
    data = rank_loader(trainer.global_rank // EP, world_size=DP, n=DP * BATCH * STEPS, batch_size=BATCH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module, data)
        except RuntimeError as error:
            return {"error": str(error)}
    params = {}
    for name, p in module.named_parameters():
        params[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1).tolist()
    out = {"logged": record.logged, "world_collectives": record.collectives, "params": params}
    return {**out, "warnings": _texts(caught), "error": None}


def main() -> None:
    global COUNTER
    args = script_parser().parse_args()
    dist.init_process_group("gloo", timeout=pg_timeout())
    COUNTER = WorldCollectives()
    mesh = init_device_mesh("cpu", (DP, EP), mesh_dim_names=("dp", "ep"))
    clippers = {
        "norm": lambda: [GradNormMonitor(depth=DEPTH), ClipGradNorm(MAX_NORM), NonFiniteGuard(action="skip")],
        "zclip": lambda: [GradNormMonitor(depth=DEPTH), ZClip(**ZCLIP)],
        "agc": lambda: [GradNormMonitor(depth=DEPTH), AdaptiveGradClip(clip_factor=AGC_FACTOR)],
        "autoclip": lambda: [GradNormMonitor(depth=DEPTH), AutoClip(**AUTOCLIP)],
    }
    out: dict[str, Any] = {case: loop_fit(make(), mesh) for case, make in clippers.items()}
    out["undeclared"] = loop_error(mesh)
    out["trainer"] = trainer_fit(declare=True)
    out["trainer_undeclared"] = trainer_fit(declare=False)
    write_rank_result(args.out, dist.get_rank(), out)


if __name__ == "__main__":
    main()
