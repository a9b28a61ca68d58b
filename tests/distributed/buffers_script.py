"""2-process CPU job: a NaN batch on rank 0 only (whose buffers DDP broadcasts to every rank at each forward) into a
ResNet-18-shaped CNN under ``gradkit_ddp`` with ``NonFiniteGuard(action="skip")``, and plain Lightning DDP on the
same data without that batch. Each rank records both runs' final parameters and BatchNorm buffers.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

from architectures import ArchModule, ResNet18Like, image_data
from helpers import distributed_trainer, script_parser, write_rank_result
from lightning_gradkit import GradKitDDPStrategy, NonFiniteGuard

BATCH, BAD = 4, 2


def rank_data(rank: int, poisoned: bool) -> DataLoader:
    x, y = image_data(n=6 * BATCH, image=8, seed=rank).tensors
    x = x.clone()
    if poisoned and rank == 0:
        x[BAD * BATCH : (BAD + 1) * BATCH] = float("nan")
    data = TensorDataset(x, y)
    if not poisoned:  # the reference never sees the bad step's batch, on any rank
        data = Subset(data, [i for i in range(len(data)) if i // BATCH != BAD])
    return DataLoader(data, batch_size=BATCH)


def fit(gradkit: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = ArchModule(ResNet18Like(width=4), lr=0.01)
    kwargs: dict[str, Any] = {}
    if gradkit:
        kwargs = dict(strategy=GradKitDDPStrategy(), callbacks=[NonFiniteGuard(action="skip", forensics=False)])
    trainer = distributed_trainer(**kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, rank_data(trainer.global_rank, poisoned=gradkit))
    return {k: v.detach().reshape(-1).tolist() for k, v in model.state_dict().items()}


def main() -> None:
    args = script_parser().parse_args()
    result = {"gradkit": fit(gradkit=True), "plain": fit(gradkit=False)}
    write_rank_result(args.out, torch.distributed.get_rank(), result)


if __name__ == "__main__":
    main()
