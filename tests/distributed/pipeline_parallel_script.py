"""2-process CPU job (gloo, started as torchrun starts one): gradkit under pipeline parallelism, declared and not
(see ``tests/test_pipeline_parallel_distributed.py``).

Each rank records per case what was logged at every optimizer step, the collectives on the world group during each
``kit.step``, the guard's warnings, its stage's final parameters, or, for the refusals, the error that stopped it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from expert_parallel_script import WorldCollectives
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

import gradkit
from gradkit import AdaptiveGradClip, ClipGradNorm, GradKit, GradNormMonitor, NonFiniteGuard, ZClip
from helpers import pg_timeout, script_parser, write_rank_result
from test_pipeline_parallel_distributed import (
    AGC_FACTOR,
    DEPTH,
    LR,
    MAX_NORM,
    MICRO_BATCHES,
    NAN,
    STAGES,
    ZCLIP,
    batches,
    block_batches,
    block_loss,
    loss_fn,
    make_block,
    make_stage,
)

COUNTER: WorldCollectives


def run_step(schedule: PipelineScheduleSingle, stage: int, x: Tensor, y: Tensor) -> list[Tensor]:
    """One step of the pipeline: the forward and backward of every micro-batch (inputs on the first stage, targets
    on the last); the micro-batches' losses on the last stage."""
    losses: list[Tensor] = []
    if stage == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    return losses


def fit(
    module: nn.Module,
    schedule_type: type[PipelineScheduleSingle],
    policies: list[Any],
    nan: Any = None,
    data: list[tuple[Tensor, Tensor]] | None = None,
    loss: Callable[[Tensor, Tensor], Tensor] = loss_fn,
) -> dict:
    """Train this rank's stage ``module`` (declared by the caller) under ``schedule_type`` with a ``GradKit`` on
    ``data`` (the token batches by default); a NaN in the stage's first gradient at ``nan = (step, stage)``."""
    pp = dist.group.WORLD
    stage = dist.get_rank(pp)
    pipe = PipelineStage(module, stage, STAGES, torch.device("cpu"), group=pp)
    schedule = schedule_type(pipe, n_microbatches=MICRO_BATCHES, loss_fn=loss)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    logged: list[dict[str, float]] = []
    kit = GradKit(module, opt, policies, log=lambda m, s: logged.append(m), log_every_n_steps=1, log_dir=False)
    collectives: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, (x, y) in enumerate(batches() if data is None else data):
            for loss in run_step(schedule, stage, x, y):  # the last stage's losses, for NonFiniteGuard's loss check
                kit.note_loss(loss)
            if nan == (step, stage):
                next(p for p in module.parameters()).grad.view(-1)[0] = float("nan")
            with COUNTER.counting() as found:
                kit.step(opt)
            collectives += found
            opt.zero_grad(set_to_none=True)
    params = {n: p.detach().reshape(-1).tolist() for n, p in module.named_parameters()}
    texts = [str(w.message) for w in caught if "NonFiniteGuard" in str(w.message)]
    return {"logged": logged, "world_collectives": collectives, "params": params, "warnings": texts}


def declared_fit(schedule_type: type[PipelineScheduleSingle], policies: list[Any], nan: Any = None) -> dict:
    module = make_stage(dist.get_rank())
    gradkit.pipeline_parallel(module, dist.group.WORLD)
    return fit(module, schedule_type, policies, nan)


def refusal(declare_on: tuple[int, ...]) -> str | None:
    """The error of ``GradKit(...)`` on the GPT-like split, declared on the ranks ``declare_on`` only."""
    module = make_stage(dist.get_rank())
    if dist.get_rank() in declare_on:
        gradkit.pipeline_parallel(module, dist.group.WORLD)
    try:
        GradKit(module, torch.optim.SGD(module.parameters(), lr=LR), [ClipGradNorm(MAX_NORM)], log_dir=False)
    except RuntimeError as error:
        return str(error)
    return None


def same_shapes_fit() -> dict:
    """Two stages of one ``Block`` each (the same names), declared: their names are told apart by stage."""
    module = make_block(dist.get_rank())
    gradkit.pipeline_parallel(module, dist.group.WORLD)
    return fit(
        module, ScheduleGPipe, [GradNormMonitor(depth=DEPTH), ClipGradNorm(MAX_NORM)], None, block_batches(), block_loss
    )


def same_shapes_refusal() -> str | None:
    """The same two stages, undeclared: the error of the first step."""
    module = make_block(dist.get_rank())
    pipe = PipelineStage(module, dist.get_rank(), STAGES, torch.device("cpu"), group=dist.group.WORLD)
    schedule = ScheduleGPipe(pipe, n_microbatches=MICRO_BATCHES, loss_fn=block_loss)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    kit = GradKit(module, opt, [ClipGradNorm(MAX_NORM)], log_dir=False)
    run_step(schedule, dist.get_rank(), *block_batches()[0])
    try:
        kit.step(opt)
    except RuntimeError as error:
        return str(error)
    return None


def guarded() -> list[Any]:
    """The norm clip with the skip, and the monitor with its param-group rows."""
    return [GradNormMonitor(depth=DEPTH, param_groups=True), ClipGradNorm(MAX_NORM), NonFiniteGuard(action="skip")]


def main() -> None:
    global COUNTER
    args = script_parser().parse_args()
    dist.init_process_group("gloo", timeout=pg_timeout())
    COUNTER = WorldCollectives()
    out: dict[str, Any] = {
        "gpipe": declared_fit(ScheduleGPipe, guarded(), NAN["gpipe"]),
        "1f1b": declared_fit(Schedule1F1B, guarded(), NAN["1f1b"]),
        "zclip": declared_fit(
            Schedule1F1B, [GradNormMonitor(depth=DEPTH, weight_norms=True, update_ratio=True), ZClip(**ZCLIP)]
        ),
        "agc": declared_fit(Schedule1F1B, [GradNormMonitor(depth=DEPTH), AdaptiveGradClip(clip_factor=AGC_FACTOR)]),
        "same_shapes": same_shapes_fit(),
        "undeclared_split": refusal(()),
        "declared_on_rank_0_only": refusal((0,)),
        "undeclared_same_shapes": same_shapes_refusal(),
    }
    write_rank_result(args.out, dist.get_rank(), out)


if __name__ == "__main__":
    main()
