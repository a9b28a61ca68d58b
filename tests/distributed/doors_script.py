"""2-process CPU job (gloo): the three front doors under DDP and FSDP2, with a NaN on rank 1 only at one step.

Started once per rank with ``LOCAL_RANK``/``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set, as
``torchrun`` starts a job (:func:`helpers.run_processes`). The script initializes ``torch.distributed`` itself; the
plain door wraps the model in ``DistributedDataParallel`` or shards it with ``fully_shard``; the Trainer and Fabric
then find the processes created externally and the process group already up, as under ``torchrun``. Each rank
records, per case and door, its final state (parameters gathered whole, BatchNorm buffers) and the gradkit series it
logged.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from gradkit.doors.loop import GradKit
from gradkit.step.norms import local_tensor
from helpers import distributed_trainer, script_parser, write_rank_result
from lightning_gradkit import GradKitModelParallelStrategy, SpikeRollback
from test_front_doors import (
    Net,
    NetModule,
    RecordingFabricLogger,
    RecordingLogger,
    _initial_state,
    _optimizer,
    _series,
)
from test_front_doors_distributed import CASES, NAN_RANK, ROLLBACK_CASE, STEPS, WORLD, policies, rank_batches


def state(module: nn.Module) -> dict[str, list[float]]:
    """The module's parameters and buffers as lists (FSDP2's sharded ``DTensor`` parameters gathered whole)."""
    out = {}
    for key, value in module.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        out[key] = full.detach().double().reshape(-1).tolist()
    return out


def shard(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """FSDP2 over the data-parallel ranks: each layer, then the root."""
    for layer in (module.encoder, module.norm, module.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


class ShardedNetModule(NetModule):
    def configure_model(self) -> None:
        shard(self, self.device_mesh["data_parallel"])


def history(policies: list[Any]) -> list[dict[str, Any]]:
    """The rollback record of the case's SpikeRollback, if it has one."""
    return next((p.state_dict()["history"] for p in policies if isinstance(p, SpikeRollback)), [])


def train(
    model: nn.Module, opt: Any, kit: GradKit, backward: Callable[[Tensor], None], rank: int, clipper: str
) -> None:
    model.train()
    for x, y in rank_batches(rank, clipper):
        loss = nn.functional.mse_loss(model(x), y)
        backward(loss)
        kit.note_loss(loss)
        kit.step(opt)
        opt.zero_grad(set_to_none=True)
    kit.finish()


def checkpoint_health(net: nn.Module, opt: Any, kit: GradKit, rank: int) -> dict[str, Any]:
    """``kit.checkpoint_is_finite()`` after training, then again with a NaN written on rank 1 only into its piece of
    a parameter (its FSDP2 shard: rank 0 holds none of it), of a BatchNorm buffer and of an optimizer-state tensor:
    every rank must name all three."""
    healthy = bool(kit.checkpoint_is_finite())
    if rank == NAN_RANK:
        with torch.no_grad():
            local_tensor(net.encoder.weight).view(-1)[0] = float("nan")  # rank 1's rows 8-15 under FSDP2
            net.norm.running_var[0] = float("nan")
            state = opt.state[net.encoder.bias]
            key = next(k for k, v in state.items() if k != "step" and isinstance(v, Tensor))
            local_tensor(state[key]).view(-1)[0] = float("nan")
    return {"healthy": healthy, "nonfinite": kit.checkpoint_is_finite().as_event()}


def run_plain(parallel: str, clipper: str, optimizer: str, rank: int) -> dict[str, Any]:
    net = Net()
    net.load_state_dict(_initial_state())
    if parallel == "fsdp2":
        model = shard(net, init_device_mesh("cpu", (WORLD,), mesh_dim_names=("data_parallel",)))
    else:
        model = nn.parallel.DistributedDataParallel(net)
    opt = _optimizer(optimizer, model.parameters())
    rows: list[dict[str, float]] = []
    log = lambda metrics, step: rows.append(metrics)  # noqa: E731
    chosen = policies(clipper)
    kit = GradKit(model, opt, chosen, log=log, log_every_n_steps=1, max_steps=STEPS)
    train(model, opt, kit, Tensor.backward, rank, clipper)
    result = {"state": state(net), "logs": _series(rows), "history": history(chosen)}
    return {**result, "checkpoint_health": checkpoint_health(net, opt, kit, rank)}


def run_fabric(parallel: str, clipper: str, optimizer: str, rank: int) -> dict[str, Any]:
    logger = RecordingFabricLogger()
    strategy: Any = "ddp"
    if parallel == "fsdp2":
        strategy = ModelParallelStrategy(lambda m, mesh: shard(m, mesh["data_parallel"]), WORLD, 1)
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy, loggers=[logger])
    fabric.launch()
    assert fabric.global_rank == rank
    net = Net()
    net.load_state_dict(_initial_state())
    # The optimizer takes the parameters the strategy registered (FSDP2's sharded ones).
    model = fabric.setup_module(net)
    opt = fabric.setup_optimizers(_optimizer(optimizer, model.parameters()))
    chosen = policies(clipper)
    kit = GradKit(model, opt, chosen, fabric=fabric, log_every_n_steps=1, max_steps=STEPS)
    train(model, opt, kit, fabric.backward, rank, clipper)
    return {"state": state(net), "logs": _series(logger.rows), "history": history(chosen)}


#: The job's output folder: the Trainer's root directory (its guards' event file goes there, not into the cwd).
OUT = "."


def run_trainer(parallel: str, clipper: str, optimizer: str, rank: int) -> dict[str, Any]:
    module = (ShardedNetModule if parallel == "fsdp2" else NetModule)(optimizer)
    module.load_state_dict(_initial_state())
    logger = RecordingLogger()
    strategy: Any = "gradkit_ddp"
    if parallel == "fsdp2":
        strategy = GradKitModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    chosen = policies(clipper)
    trainer = distributed_trainer(
        strategy=strategy, callbacks=chosen, logger=logger, max_steps=STEPS, default_root_dir=OUT
    )
    assert trainer.global_rank == rank
    trainer.fit(module, DataLoader(rank_batches(rank, clipper), batch_size=None))
    return {"state": state(module), "logs": _series(logger.rows), "history": history(chosen)}


def main() -> None:
    global OUT
    args = script_parser().parse_args()
    OUT = str(args.out)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    doors = {"plain": run_plain, "trainer": run_trainer, "fabric": run_fabric}
    results: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for parallel, clipper, optimizer in (*CASES, ROLLBACK_CASE):
            for door, run in doors.items():
                pl.seed_everything(0, verbose=False)
                results[f"{parallel}-{clipper}-{optimizer}/{door}"] = run(parallel, clipper, optimizer, rank)
    write_rank_result(args.out, rank, results)


if __name__ == "__main__":
    main()
