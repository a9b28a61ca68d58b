"""The Hugging Face door under mixed precision: bf16 autocast (HF's ``bf16=True``, on the CPU) and fp16 with HF's
``GradScaler`` (the scaler accelerate builds for ``fp16=True``; on the CPU, where accelerate builds none, the same
``torch.amp.GradScaler`` is set on the Trainer's accelerator, so that HF's scaled backward, the door's scaler step and
the held scheduler are those of a GPU run; the ``gpu`` test runs ``fp16=True`` itself).

The reference is the loop door with the same autocast and scaler calls a plain loop makes. Skipped without
``transformers``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gradkit.doors.huggingface import install  # noqa: E402
from hf_fixtures import (  # noqa: E402
    MODELS,
    TokenData,
    assert_same_model,
    batches,
    gradkit_rows,
    loop_door_run,
    merged_rows,
    optimizer_and_scheduler,
    poison,
    training_args,
)
from lightning_gradkit import ClipGradNorm, GradNormMonitor, NonFiniteGuard  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:NonFiniteGuard:UserWarning")

STEPS, ACCUMULATE, SAMPLES = 6, 2, 48
BAD_SAMPLE = 17  # step 2


def _policies() -> list[Any]:
    return [GradNormMonitor(), ClipGradNorm(max_norm=0.5), NonFiniteGuard(action="skip")]


def _scaler(device: str = "cpu") -> torch.amp.GradScaler:
    # growth_interval=2: the scale grows during the run, so a wrong number of scaler updates shows.
    return torch.amp.GradScaler(device, init_scale=2.0**12, growth_interval=2)


def _trainer(out: Path, **arguments: Any) -> tuple[Any, Any]:
    model = MODELS["gpt2"]()
    poison(model, "gpt2")
    args = training_args(out, max_steps=STEPS, gradient_accumulation_steps=ACCUMULATE, **arguments)
    data = TokenData("gpt2", SAMPLES, poisoned=[BAD_SAMPLE])
    pair = optimizer_and_scheduler(model, STEPS)
    return transformers.Trainer(model, args, train_dataset=data, optimizers=pair), pair[0]


def _reference(device: str = "cpu", **kwargs: Any) -> tuple[Any, Any, Any]:
    model = MODELS["gpt2"]().to(device)
    poison(model, "gpt2")
    optimizer, scheduler = optimizer_and_scheduler(model, STEPS)
    data = TokenData("gpt2", SAMPLES, poisoned=[BAD_SAMPLE])
    micro = [{k: v.to(device) for k, v in b.items()} for b in batches(data)]
    kit, rows = loop_door_run(model, "gpt2", micro, ACCUMULATE, optimizer, scheduler, _policies(), 1, **kwargs)
    return model, kit, rows


def _assert_same_run(trainer: Any, door: Any, model: Any, kit: Any, rows: Any) -> None:
    assert_same_model(trainer.model, model)
    assert merged_rows(gradkit_rows(trainer.state.log_history)) == merged_rows(rows)
    assert door.kit.skipped_steps == kit.skipped_steps


def test_bf16_autocast_trains_as_the_loop_door_under_the_same_autocast(tmp_path: Path) -> None:
    trainer, _ = _trainer(tmp_path, bf16=True)
    door = install(trainer, _policies())
    trainer.train()
    model, kit, rows = _reference(autocast=torch.bfloat16)
    _assert_same_run(trainer, door, model, kit, rows)
    assert door.kit.skipped_steps == 1 and trainer.lr_scheduler.last_epoch == STEPS - 1


def test_fp16_with_hfs_grad_scaler_trains_as_the_loop_door_with_the_same_scaler(tmp_path: Path) -> None:
    trainer, _ = _trainer(tmp_path)
    scaler = trainer.accelerator.scaler = _scaler()  # what accelerate builds for fp16=True on a GPU
    door = install(trainer, _policies())
    trainer.train()
    reference_scaler = _scaler()
    model, kit, rows = _reference(scaler=reference_scaler)
    _assert_same_run(trainer, door, model, kit, rows)
    # The NaN step is the scaler's (an fp16 overflow: its scale backs off) and HF holds its scheduler, as accelerate's
    # own step would; the other steps grew the scale as in the reference.
    assert scaler.get_scale() == reference_scaler.get_scale()
    assert trainer.lr_scheduler.last_epoch == STEPS - 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: HF's fp16 runs on a GPU only")
def test_fp16_on_a_gpu_trains_as_the_loop_door(tmp_path: Path) -> None:
    trainer, _ = _trainer(tmp_path, fp16=True, use_cpu=False)
    door = install(trainer, _policies())
    trainer.train()
    assert trainer.accelerator.scaler is not None
    model, kit, rows = _reference("cuda", autocast=torch.float16, scaler=torch.amp.GradScaler("cuda"))
    _assert_same_run(trainer, door, model, kit, rows)
    assert trainer.lr_scheduler.last_epoch == STEPS - 1
