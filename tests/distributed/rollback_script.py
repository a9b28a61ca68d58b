"""2-process CPU job: SpikeRollback under DDP and under FSDP2 (``fully_shard``), the spike on rank 1 only.

Global batches 9 and 10 spike (rank 1's targets x50); with ``patience=2`` the rollback fires at step 10 on every
rank, restores the snapshot of step 8 and steps over 2 more batches. Each rank records its own *local* state
(FSDP2: its shards) at the end of every batch and compares the state after the rollback with the snapshot's
bitwise; it also reports the final parameters (gathered whole) for the single-process reference.

Distributed checkpoints (``torch.distributed.checkpoint``) with ``save_snapshots=True`` under FSDP2: the Trainer's
FSDP2 run saves one at step 9 (``ModelCheckpoint``; between the snapshot of step 8 and the spike, so only the saved
ring lets a resumed run restore step 8's state), and a plain loop (``GradKit.distributed_state()``) does the same;
each is resumed from it in a new run, whose local state at the end is compared with the uninterrupted run's bitwise.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Subset

from gradkit import GradKit
from gradkit.doors.distributed_checkpoint import RANK_LOCAL_FOLDER
from gradkit.step.norms import local_tensor
from helpers import MLPModule, ShardedMLP, distributed_trainer, pg_timeout, script_parser, write_rank_result
from lightning_gradkit import GradKitDDPStrategy, GradKitModelParallelStrategy, SpikeRollback
from test_guards import events
from test_rollback import ResumableLoader
from test_rollback_distributed import N_BATCHES, ROLLBACK, SAVE_AT, spiky_global_data


def rank_loader(rank: int) -> DataLoader:
    data = spiky_global_data()
    return DataLoader(Subset(data, range(rank, len(data), 2)), batch_size=4)


class RankBatches(ResumableLoader):
    """This rank's batches, resumable mid-epoch (Lightning restores the loader's ``state_dict``)."""

    def __init__(self, rank: int) -> None:
        self.batches, self.drawn, self.start = list(rank_loader(rank)), 0, 0


def local_state(module: nn.Module, opt: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    return {
        "params": [local_tensor(p.detach()).clone() for p in module.parameters()],
        "optimizer": [
            {k: local_tensor(v).clone() if isinstance(v, Tensor) else v for k, v in opt.state[p].items()}
            for p in module.parameters()
            if p in opt.state
        ],
        "lr": [g["lr"] for g in opt.param_groups],
        "scheduler": copy.deepcopy(scheduler.state_dict()),
    }


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


class RollbackMLP(MLPModule):
    """Adam and a per-step StepLR; the local state recorded at every batch end, keyed by global step."""

    def __init__(self) -> None:
        super().__init__(lr=0.01, optimizer="adam")
        self.records: dict[int, dict[str, Any]] = {}

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        trainer = self.trainer
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        self.records[trainer.global_step] = local_state(self, trainer.optimizers[0], scheduler)


class ShardedRollbackMLP(RollbackMLP, ShardedMLP):
    """The same, with the encoder and the head sharded by FSDP2 in ``configure_model``."""


def fit(
    out: Path, name: str, model: RollbackMLP, strategy: Any, loader: Any, saving: bool = False, ckpt: Path | None = None
) -> tuple[pl.Trainer, SpikeRollback]:
    """``model`` trained on ``loader`` with the job's SpikeRollback; ``saving``: with ``save_snapshots=True`` and a
    checkpoint at step ``SAVE_AT`` (``<out>/<name>/mid.ckpt``); ``ckpt``: resumed from that checkpoint."""
    callback = SpikeRollback("loss", **ROLLBACK, save_snapshots=saving or ckpt is not None)
    callbacks: list[Any] = [callback]
    if saving:
        callbacks.append(ModelCheckpoint(out / name, "mid", every_n_train_steps=SAVE_AT, save_top_k=-1))
    trainer = distributed_trainer(
        strategy=strategy, default_root_dir=out / name, callbacks=callbacks, enable_checkpointing=saving
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader(trainer.global_rank), ckpt_path=ckpt)
    return trainer, callback


def run(out: Path, name: str, model: RollbackMLP, strategy: Any, saving: bool = False) -> dict[str, Any]:
    trainer, callback = fit(out, name, model, strategy, RankBatches if saving else rank_loader, saving)
    found = [e for e in events(trainer.default_root_dir) if e["what"] == "rollback"] if trainer.global_rank == 0 else []
    # The test checks (rank 0's event) that the rollback fired at step 10 and restored the snapshot of step 8.
    return {
        "rank": trainer.global_rank,
        "restored_equals_snapshot": equal(model.records[11], model.records[8]),
        "spike_changed_state": not equal(model.records[10], model.records[8]),
        "adam_steps": [float(s["step"]) for s in model.records[N_BATCHES]["optimizer"]],
        "params": {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().tolist()
            for n, p in model.named_parameters()
        },
        "events": found,
        "history": callback.state_dict()["history"],
        "global_step": trainer.global_step,
        "snapshot_bytes": callback.snapshot_bytes,
        "final": model.records[N_BATCHES],
    }


def written_by(folder: Path, key: str) -> str:
    """The file of the checkpoint ``folder`` that holds the item ``key`` (``__<rank>_0.distcp``: the rank that wrote
    it)."""
    storage = dcp.FileSystemReader(folder).read_metadata().storage_data
    (path,) = {info.relative_path for index, info in storage.items() if index.fqn == key}
    return path


def resumed_trainer(out: Path, straight: dict[str, Any]) -> dict[str, Any]:
    """The Trainer's FSDP2 run resumed from its checkpoint of step ``SAVE_AT``: its end state against the
    uninterrupted run's (``straight``), and where the checkpoint keeps each rank's snapshots."""
    torch.manual_seed(0)
    strategy = GradKitModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=pg_timeout())
    model, ckpt = ShardedRollbackMLP(), out / "fsdp2" / "mid.ckpt"
    trainer, callback = fit(out, "fsdp2_resumed", model, strategy, RankBatches, ckpt=ckpt)
    rank = trainer.global_rank
    meta = torch.load(ckpt / "meta.pt", weights_only=True)["callbacks"][callback.state_key]
    return {
        "same_end_state": equal(model.records[N_BATCHES], straight["final"]),
        "history": callback.state_dict()["history"],
        "meta_has_snapshots": "snapshots" in meta,
        "written_by": written_by(ckpt / RANK_LOCAL_FOLDER, f"rank_local.rank{rank}"),
    }


def loop(out: Path, rank: int, resume: bool = False) -> dict[str, Any]:
    """The plain loop door on FSDP2 (``fully_shard``): the job's SpikeRollback with ``save_snapshots=True`` and a DCP
    checkpoint (``GradKit.distributed_state()``) at step ``SAVE_AT``; ``resume``: from that checkpoint."""
    torch.manual_seed(0)
    model = MLPModule(lr=0.01)
    mesh = init_device_mesh("cpu", (2,))
    for module in (model.encoder, model.head):
        fully_shard(module, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    rollback = SpikeRollback("loss", **ROLLBACK, save_snapshots=True)
    kit = GradKit(model, opt, [rollback], schedulers=sched, log_every_n_steps=0, log_dir=False)
    ckpt = out / "loop_ckpt"

    def state() -> dict[str, Any]:
        model_state, optim_state = get_state_dict(model, opt)
        return {"model": model_state, "optim": optim_state, "sched": sched, "gradkit": kit.distributed_state()}

    first, saved = 0, {}
    if resume:
        loaded = state()
        dcp.load(loaded, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        first = kit.state_dict()["step"]
    for step, (x, y) in enumerate(rank_loader(rank)):
        if step < first:
            continue
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        kit.note_loss(loss)
        kit.step(opt)
        opt.zero_grad(set_to_none=True)
        if step + 1 == SAVE_AT and not resume:
            dcp.save(state(), checkpoint_id=ckpt)
            saved = {k: v.tolist() for k, v in rollback.state_dict()["stats"].items()}
    kit.finish()
    return {
        "first_step": first,
        "end": local_state(model, opt, sched),
        "history": rollback.state_dict()["history"],
        "params": {n: p.full_tensor().tolist() for n, p in model.named_parameters()},
        "saved_stats": saved,
        "written_by": written_by(ckpt, f"gradkit.rank_local.rank{rank}"),
    }


def refused_save_snapshots(out: Path) -> str:
    """The setup error of ``save_snapshots=True`` under FSDP2 whose checkpoint is one file from rank 0."""
    strategy = GradKitModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=False, timeout=pg_timeout()
    )
    callback = SpikeRollback(save_snapshots=True)
    trainer = distributed_trainer(strategy=strategy, default_root_dir=out / "refused", callbacks=[callback])
    try:
        trainer.fit(ShardedRollbackMLP(), rank_loader(trainer.global_rank))
    except ValueError as error:
        return str(error)
    return ""


def main() -> None:
    args = script_parser().parse_args()
    results: dict[str, Any] = {}
    torch.manual_seed(0)
    results["ddp"] = run(args.out, "ddp", RollbackMLP(), GradKitDDPStrategy(timeout=pg_timeout()))
    torch.manual_seed(0)
    fsdp2 = GradKitModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=pg_timeout())
    results["fsdp2"] = run(args.out, "fsdp2", ShardedRollbackMLP(), fsdp2, saving=True)
    results["fsdp2_resumed"] = resumed_trainer(args.out, results["fsdp2"])
    results["fsdp2_save_snapshots"] = refused_save_snapshots(args.out)
    rank = results["ddp"]["rank"]
    results["loop"] = loop(args.out, rank)
    resumed = loop(args.out, rank, resume=True)
    resumed["same_end_state"] = equal(resumed.pop("end"), results["loop"].pop("end"))
    results["loop_resumed"] = resumed
    for case in ("ddp", "fsdp2"):
        del results[case]["final"]  # tensors: compared here, not written
    write_rank_result(args.out, rank, results)


if __name__ == "__main__":
    main()
