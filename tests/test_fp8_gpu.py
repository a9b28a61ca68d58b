"""FP8 on a GPU: torchao's ``Float8Linear`` (tensorwise and rowwise dynamic scaling) with the float8 matmuls of an
H100-class device (``torch._scaled_mm`` needs compute capability 8.9 or more), under bf16 autocast, behind the loop
door and the Trainer (``bf16-mixed``): the same proofs as ``tests/test_fp8.py`` on CPU, against the same references
(a hand-written loop with ``clip_grad_norm_``, plain Lightning with ``gradient_clip_val``, the bad steps left out).

Exact, unless the device itself is not: the reference runs twice, and the run with the stack must differ from it by
no more than the two reference runs differ from each other (``DEVICE_NOISE_FACTOR`` times that, and 0 when they are
equal, which they should be: attention runs on the math kernel here, whose backward has no atomics). Part of
``make gpu-check`` (every ``gpu``-marked test); the interpreter needs torchao (``pip install torchao==0.18.0``, built
for its torch), else the file is skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from test_compile import flat, relative
from test_fp8 import (
    RECIPES,
    Float8Module,
    check_skips_and_norms,
    fp8_model,
    hand_loop,
    loop_runs,
    trainer_run,
    trainer_runs,
)

pytest.importorskip("torchao.float8")

pytestmark = pytest.mark.gpu

#: The run with the stack may differ from the reference by this many times the reference's own run-to-run difference.
DEVICE_NOISE_FACTOR = 4.0


@pytest.fixture(autouse=True)
def _float8_device() -> Iterator[None]:
    """Skip below compute capability 8.9 (no float8 matmul); run attention on the deterministic math kernel."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"float8 matmuls need compute capability 8.9+, this GPU has {torch.cuda.get_device_capability()}")
    with sdpa_kernel(SDPBackend.MATH):
        yield


def within_device_noise(got: torch.Tensor, reference: torch.Tensor, again: torch.Tensor) -> None:
    noise = relative(again, reference)
    assert relative(got, reference) <= DEVICE_NOISE_FACTOR * noise, f"the reference's own run-to-run noise: {noise}"


@pytest.mark.parametrize(("recipe", "order"), [("tensorwise", "before"), ("rowwise", "after")])
def test_float8_on_gpu_loop_door_skips_exactly_and_logs_the_norms_of_clip_grad_norm_(
    tmp_path: Path, recipe: str, order: str
) -> None:
    runs = loop_runs(tmp_path, recipe, order, device="cuda")
    again = fp8_model(recipe, device="cuda")
    hand_loop(again, lambda m: float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)), [])
    within_device_noise(flat(runs.model), flat(runs.reference), flat(again))
    check_skips_and_norms(runs, tmp_path)


@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_on_gpu_trainer_equals_plain_lightning_without_the_bad_steps(tmp_path: Path, recipe: str) -> None:
    """``bf16-mixed``, the blocks checkpointed by class, the model converted in ``configure_model``."""
    gpu = {"accelerator": "gpu", "precision": "bf16-mixed"}
    module, reference = trainer_runs(tmp_path, recipe, "configure_model", "FaultyBlock", **gpu)
    again = Float8Module(recipe, "configure_model")
    trainer_run(tmp_path / "again", again, [], **gpu)
    within_device_noise(flat(module), flat(reference), flat(again))
