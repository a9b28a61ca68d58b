"""2-process CPU job (gloo): the Hugging Face door under DDP, a NaN loss on rank 1 only at one step; then under FSDP2
(``hf_fsdp2.py``), in the same processes.

Started once per rank as ``torchrun`` starts a job (:func:`helpers.run_processes`). The script brings the process
group up itself; HF's Trainer (accelerate) finds it and wraps the model in ``DistributedDataParallel``. The NaN is
added to rank 1's loss (``poison(where="loss")``): its gradients stay finite and DDP averages finite gradients, so
only the loss check of rank 1 sees anything; the door's decision must still reach rank 0. Each rank records where it
met the poisoned sample, its skip count, its LR scheduler's steps, a digest of its parameters and its logged rows.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import torch
import torch.distributed as dist
import transformers
from hf_fsdp2 import fsdp2_result

from gradkit.doors.huggingface import install
from helpers import pg_timeout, script_parser, write_rank_result
from hf_fixtures import POISON, TokenData, gpt2, gradkit_rows, merged_rows, optimizer_and_scheduler, poison
from hf_fixtures import training_args as base_arguments
from lightning_gradkit import ClipGradNorm, GradNormMonitor, NonFiniteGuard

STEPS, ACCUMULATE = 4, 2
# accelerate deals the batches of a sequential sampler round-robin: rank 1's micro-batches are the odd ones, its
# step 1 holds global batches 5 and 7 (samples 20-23 and 28-31).
BAD_SAMPLE = 21


def main() -> None:
    args = script_parser().parse_args()
    dist.init_process_group("gloo", timeout=pg_timeout())
    rank = dist.get_rank()
    warnings.filterwarnings("ignore", message="NonFiniteGuard")
    model = gpt2()
    poison(model, "gpt2", where="loss")
    seen: set[int] = set()  # HF's steps whose forwards (the guard's replay included) met the poisoned sample

    def note(module: torch.nn.Module, fargs: Any, kwargs: dict[str, Any]) -> None:
        if bool((kwargs["input_ids"][:, 0] == POISON).any()):
            seen.add(trainer.state.global_step)

    model.register_forward_pre_hook(note, with_kwargs=True)
    training_args = base_arguments(
        args.out / "hf", max_steps=STEPS, gradient_accumulation_steps=ACCUMULATE, ddp_backend="gloo"
    )
    data = TokenData("gpt2", STEPS * ACCUMULATE * 4 * 2, poisoned=[BAD_SAMPLE])
    trainer = transformers.Trainer(
        model, training_args, train_dataset=data, optimizers=optimizer_and_scheduler(model, STEPS)
    )
    door = install(trainer, [GradNormMonitor(), ClipGradNorm(max_norm=0.5), NonFiniteGuard(action="skip")])
    trainer.train()
    digest = hashlib.sha256()
    for value in trainer.model.state_dict().values():
        digest.update(value.detach().contiguous().numpy().tobytes())
    ddp = {
        "distributed_type": trainer.accelerator.distributed_type.value,
        "wrapped": type(trainer.model_wrapped).__name__,
        "poison_seen_at_steps": sorted(seen),
        "skipped_steps": door.kit.skipped_steps,
        "scheduler_steps": trainer.lr_scheduler.last_epoch,
        "digest": digest.hexdigest(),
        "rows": merged_rows(gradkit_rows(trainer.state.log_history)),
    }
    write_rank_result(args.out, rank, {"ddp": ddp, "fsdp2": fsdp2_result(args.out / "fsdp2")})


if __name__ == "__main__":
    main()
