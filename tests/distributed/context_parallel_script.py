"""2-process CUDA job (NCCL, started as torchrun starts one, rank ``r`` on ``cuda:r``): gradkit under torch's context
parallelism, the gradients reduced over the cp ranks by FSDP2 or DDP, and not (see
``tests/test_context_parallel_gpu.py``). ``--device cpu`` runs it on gloo CPU processes, where torch 2.13's ring
attention stops at the first forward (the error the test module quotes).

Each rank records per case what was logged at every optimizer step, the collectives on the world group during each
``kit.step``, the skipped steps and the whole final parameters, or, for the mistake, the error that stopped it.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from expert_parallel_script import WorldCollectives, poison
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import context_parallel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel

from gradkit import ClipGradNorm, GradKit, GradNormMonitor, NonFiniteGuard
from helpers import pg_timeout, script_parser, write_rank_result
from test_context_parallel_gpu import LR, MAX_NORM, NAN_RANK, NAN_STEP, batches, loss_fn, make_model, positions

COUNTER: WorldCollectives
CUDA_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


def forward_backward(model: nn.Module, cp: DeviceMesh, tokens: Tensor, labels: Tensor) -> Tensor:
    """This rank's part of the sequence, forward and backward under ring attention (the backward too: its SDPA
    backward is ring attention's); the local loss."""
    # Copies: `context_parallel` shards its buffers in place (resize_ and copy_), and the tokens and labels of a batch
    # are views of one tensor.
    tokens, pos, labels = (t.to(cp.device_type, copy=True) for t in (tokens, positions(), labels))
    # Sharded along the sequence (dim 1), head-tail load balanced; the positions with the tokens.
    # Ring attention replaces the CUDA kernels only (the math kernel fails under it): keep SDPA on them, as torchtitan.
    kernels = sdpa_kernel(CUDA_KERNELS) if cp.device_type == "cuda" else nullcontext()
    with kernels, context_parallel(cp, buffers=[tokens, pos, labels], buffer_seq_dims=[1, 1, 1]):
        loss = loss_fn(model(tokens, pos), labels)
        loss.backward()
    return loss.detach()


def fit(model: nn.Module, cp: DeviceMesh) -> dict[str, Any]:
    """The loop door on ``model`` (already wrapped), a NaN in rank ``NAN_RANK``'s gradient at step ``NAN_STEP``."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    logged: list[dict[str, float]] = []
    policies = [GradNormMonitor(depth=1), ClipGradNorm(MAX_NORM), NonFiniteGuard(action="skip")]
    kit = GradKit(model, opt, policies, log=lambda m, s: logged.append(m), log_every_n_steps=1, log_dir=False)
    collectives: list[int] = []
    for step, (tokens, labels) in enumerate(batches()):
        kit.note_loss(forward_backward(model, cp, tokens, labels))
        if step == NAN_STEP and dist.get_rank() == NAN_RANK:
            poison(next(model.parameters()))
        with COUNTER.counting() as found:
            kit.step(opt)
        collectives += found
        opt.zero_grad(set_to_none=True)
    params = {
        n.removeprefix("module."): (p.full_tensor() if isinstance(p, DTensor) else p)
        .detach()
        .cpu()
        .reshape(-1)
        .tolist()
        for n, p in model.named_parameters()
    }
    return {"logged": logged, "world_collectives": collectives, "skipped": kit.skipped_steps, "params": params}


def first_step_error(model: nn.Module, cp: DeviceMesh) -> dict[str, Any]:
    """The first step of ``model`` whose gradients nothing reduces over ``cp``: the error that stopped it, if any."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    kit = GradKit(model, opt, [GradNormMonitor(depth=1), ClipGradNorm(MAX_NORM)], log_every_n_steps=1, log_dir=False)
    forward_backward(model, cp, *batches()[0])
    try:
        kit.step(opt)
    except RuntimeError as error:
        return {"error": str(error), "steps_done": 0}
    return {"error": None, "steps_done": 1}


def main() -> None:
    global COUNTER
    parser = script_parser()
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    device = args.device
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=pg_timeout())
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank())
    COUNTER = WorldCollectives()
    mesh = init_device_mesh(device, (1, dist.get_world_size()), mesh_dim_names=("dp", "cp"))
    dp_shard_cp = mesh["dp", "cp"]._flatten("dp_shard_cp")  # torchtitan's mesh for FSDP under context parallelism
    out: dict[str, Any] = {
        "fsdp2": fit(fully_shard(make_model().to(device), mesh=dp_shard_cp), mesh["cp"]),
        "ddp": fit(DistributedDataParallel(make_model().to(device), process_group=mesh["cp"].get_group()), mesh["cp"]),
        "fsdp2_dp_only": first_step_error(fully_shard(make_model().to(device), mesh=mesh["dp"]), mesh["cp"]),
    }
    write_rank_result(args.out, dist.get_rank(), out)


if __name__ == "__main__":
    main()
