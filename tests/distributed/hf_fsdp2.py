"""The FSDP2 half of ``hf_door_script.py`` (2 CPU processes, gloo): the Hugging Face door under FSDP2 (HF's
``fsdp=True``, accelerate's ``fully_shard``), in the job of the DDP half so that the processes start once.

Three HF runs of a tiny GPT-2, each on both ranks, with HF's ``max_grad_norm`` (the door takes its clipping over):

- ``whole``: the door with ``GradNormMonitor`` and ``NonFiniteGuard(action="skip")``; a sample of step 1 (on rank 1)
  turns the model's output NaN; HF checkpoints at step 2 (FSDP's sharded state dict, the door's file beside it);
- ``resumed``: the same, resumed from ``whole``'s checkpoint of step 2;
- ``reference``: HF without the door, on the data without step 1's samples, one step fewer, HF clipping (accelerate's
  ``clip_grad_norm_`` of the DTensor gradients); its LR schedule laid over the same 4 steps as the door's runs.

Then the refusals: FSDP1, DeepSpeed, and ``SpikeRollback(save_snapshots=True)`` under FSDP2.

accelerate 1.15 turns FSDP on for accelerator devices only: on CPU (``use_cpu=True``) ``AcceleratorState`` keeps
``MULTI_CPU`` and drops the FSDP plugin (in ``accelerate/state.py`` FSDP is set only for ``MULTI_GPU``, ``MULTI_XPU``,
...), so HF's Trainer silently trains under DDP. :func:`fsdp2_on_cpu` sets the state as accelerate sets it on GPUs
(type FSDP, HF's plugin); what follows is accelerate's and HF's own code: ``fully_shard`` in ``accelerator.prepare``,
the DTensor ``clip_grad_norm_``, the FSDP checkpoints (``torch.distributed.checkpoint``).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import transformers
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, TorchDynamoPlugin
from torch import Tensor, nn

from gradkit import GradNormMonitor, NonFiniteGuard, SpikeRollback
from gradkit.doors.huggingface import STATE_FILENAME, install
from helpers import assert_same_state
from hf_fixtures import BATCH, TokenData, gpt2, gradkit_rows, merged_rows, poison
from hf_fixtures import training_args as base_arguments

STEPS, ACCUMULATE, SAVE_AT = 4, 2, 2
PER_STEP = ACCUMULATE * BATCH * 2  # the samples one optimizer step takes over the 2 ranks
BAD_STEP = 1
# accelerate deals the batches of a sequential sampler round-robin: samples 20-23 are rank 1's first micro-batch of
# step 1.
BAD_SAMPLE = BAD_STEP * PER_STEP + 5


class ScheduledTrainer(transformers.Trainer):
    """HF's Trainer with its linear decay laid over ``STEPS`` steps whatever ``max_steps``: the reference trains one
    step fewer, and HF refuses ``optimizers=(...)`` under FSDP (its advice: override the creation)."""

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        return super().create_scheduler(STEPS, optimizer)


def fsdp2_on_cpu(args: transformers.TrainingArguments) -> None:
    """Set accelerate's state to FSDP with HF's plugin, as accelerate sets it on GPUs (see the module docstring).
    After ``TrainingArguments``, which resets the state."""
    AcceleratorState(cpu=True, dynamo_plugin=TorchDynamoPlugin(), _from_accelerator=True)
    plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    AcceleratorState._shared_state.update(distributed_type=DistributedType.FSDP, fsdp_plugin=plugin)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def arguments(out: Path, steps: int, **kwargs: Any) -> transformers.TrainingArguments:
    fsdp_config = {"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}
    args = base_arguments(
        out, max_steps=steps, gradient_accumulation_steps=ACCUMULATE, ddp_backend="gloo", fsdp=True,
        fsdp_config=fsdp_config, max_grad_norm=0.5, optim="sgd", learning_rate=0.05, **kwargs,
    )  # fmt: skip
    fsdp2_on_cpu(args)
    return args


def train(out: Path, data: TokenData, steps: int, door: bool, **kwargs: Any) -> tuple[Any, Any]:
    model = gpt2()
    poison(model, "gpt2")
    resume = kwargs.pop("resume", None)
    trainer = ScheduledTrainer(model, arguments(out, steps, **kwargs), train_dataset=data)
    kit = install(trainer, [GradNormMonitor(), NonFiniteGuard(action="skip")]) if door else None
    trainer.train(resume_from_checkpoint=resume)
    return trainer, kit


def without_step(data: TokenData, step: int) -> TokenData:
    """``data`` without the samples of optimizer step ``step``."""
    keep = [i for i in range(len(data)) if not step * PER_STEP <= i < (step + 1) * PER_STEP]
    data.ids, data.labels = data.ids[keep], data.labels[keep]
    return data


def whole_model(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer whole (a collective: FSDP2 holds DTensor shards)."""
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}


def digest(state: dict[str, Tensor]) -> str:
    out = hashlib.sha256()
    for value in state.values():
        out.update(value.detach().contiguous().numpy().tobytes())
    return out.hexdigest()


def hf_rows(trainer: Any) -> dict[int, dict[str, float | None]]:
    """HF's own row of each step: its loss, its ``grad_norm`` (NaN as ``None`` for JSON) and learning rate."""
    rows = [r for r in trainer.state.log_history if "loss" in r]
    return {
        r["step"]: {k: None if math.isnan(r[k]) else r[k] for k in ("loss", "grad_norm", "learning_rate")} for r in rows
    }


def refusal(out: Path, policies: list[Any], version: int = 2, engine: DistributedType | None = None) -> str:
    """What ``install`` says on a Trainer of FSDP ``version``, or of ``engine``. accelerate builds an FSDP1 plugin
    only where an accelerator device is, and DeepSpeed only with its package: the FSDP2 state's version or type is set
    instead (all that ``install`` reads), and set back."""
    trainer = ScheduledTrainer(gpt2(), arguments(out, STEPS), train_dataset=TokenData("gpt2", PER_STEP))
    state = trainer.accelerator.state
    state.fsdp_plugin.fsdp_version = version
    state.distributed_type = engine or DistributedType.FSDP
    try:
        install(trainer, policies)
    except ValueError as error:
        return str(error)
    finally:
        state.fsdp_plugin.fsdp_version, state.distributed_type = 2, DistributedType.FSDP
    return "not refused"


def fsdp2_result(out: Path) -> dict[str, Any]:
    """Run the three runs and the refusals on this rank; what the test checks (``test_hf_door_distributed.py``)."""
    samples = STEPS * PER_STEP
    whole, whole_door = train(
        out / "whole", TokenData("gpt2", samples, poisoned=[BAD_SAMPLE]), STEPS, True,
        save_strategy="steps", save_steps=SAVE_AT,
    )  # fmt: skip
    checkpoint = out / "whole" / f"checkpoint-{SAVE_AT}"
    resumed, resumed_door = train(
        out / "resumed", TokenData("gpt2", samples, poisoned=[BAD_SAMPLE]), STEPS, True, resume=str(checkpoint)
    )
    reference, _ = train(out / "reference", without_step(TokenData("gpt2", samples), BAD_STEP), STEPS - 1, False)
    whole_params, reference_params = whole_model(whole.model), whole_model(reference.model)
    try:
        assert_same_state(resumed_door.kit.state_dict(), whole_door.kit.state_dict())
        same_kit_state = True
    except AssertionError:
        same_kit_state = False
    return {
        "distributed_type": whole.accelerator.distributed_type.value,
        "is_fsdp2": whole.accelerator.is_fsdp2,
        "parameter_type": type(next(whole.model.parameters())).__name__,
        "whole": hf_rows(whole),
        "reference": hf_rows(reference),
        "whole_door_rows": merged_rows(gradkit_rows(whole.state.log_history)),
        "resumed_door_rows": merged_rows(gradkit_rows(resumed.state.log_history)),
        "skipped_steps": [whole_door.kit.skipped_steps, resumed_door.kit.skipped_steps],
        "scheduler_steps": [t.lr_scheduler.last_epoch for t in (whole, resumed, reference)],
        "params_max_difference": max((whole_params[k] - v).abs().max().item() for k, v in reference_params.items()),
        "digests": [digest(whole_params), digest(whole_model(resumed.model))],
        "same_kit_state": same_kit_state,
        "state_file": (checkpoint / STATE_FILENAME).is_file(),
        "fsdp1": refusal(out / "fsdp1", [NonFiniteGuard()], version=1),
        "deepspeed": refusal(out / "deepspeed", [NonFiniteGuard()], engine=DistributedType.DEEPSPEED),
        "rollback": refusal(out / "rollback", [SpikeRollback(save_snapshots=True)]),
    }
