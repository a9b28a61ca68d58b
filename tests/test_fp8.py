"""FP8 training with torchao's ``Float8Linear`` (dynamic scaling; the tensorwise and rowwise recipes) under gradkit,
on CPU: torch 2.13's CPU build runs ``Float8Linear``'s forward and backward (the inputs, weights and output gradients
cast to float8 with per-tensor or per-row scales, the matmuls on the float8 values), so the whole proof runs here,
not only the conversion.

The model is ``tests/test_compile.py``'s two-block GPT (every ``nn.Linear`` 16 x 16, 16 x 48 or 16 x 32: float8's
multiples of 16) whose ``blocks.1`` makes an inf for a batch that starts with token 0 and whose loss spikes (x50)
for a batch that starts with token 1, converted with ``torchao.float8.convert_to_float8_training``. Every run is
compared with an independent reference that uses no gradkit code: the same converted model in a hand-written loop
(or plain Lightning with ``gradient_clip_val``) with ``torch.nn.utils.clip_grad_norm_`` (or a clipper of
``tests/clip_reference.py``), without activation checkpointing, the bad steps' micro-batches left out.

- Parameters: bitwise. Dynamic scaling computes each scale from the tensor being cast, so the recompute of a
  checkpointed block casts exactly as its forward did, and a skipped or replayed step leaves no scale behind.
- Norms: the total pre-clip norm bitwise equal to what ``clip_grad_norm_`` returns (the same ``_foreach_norm`` of
  the same gradients, reduced the same way); the per-module norms within ``NORM_RTOL = 1e-6`` of a hand sum over
  each module's parameters (gradkit sums the per-tensor squares in another order: float32 reassociation, a few ulps
  of 1.2e-7).
- torchao 0.18 has no delayed scaling (its ``ScalingType`` is ``DYNAMIC`` or ``DISABLED``): ``Float8Linear`` holds
  no buffer and no tensor that a forward updates, so there is no scaling history for a replay to move (checked).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

import gradkit
from clip_reference import AGCRef, ValueRef
from gradkit.policies.culprit import MicroBatch, replay_micro_batches
from helpers import make_trainer
from lightning_gradkit import (
    ActivationCheckpointing,
    ClipGradNorm,
    GradNormMonitor,
    NonFiniteGuard,
    SpikeGuard,
    inject_activation_checkpointing,
)
from lightning_gradkit.activation_checkpointing.injection import injected_mode
from test_compile import (
    ACCUMULATE,
    APPLIED,
    INF_STEP,
    SPIKE_STEP,
    batches,
    clean_batches,
    flat,
    initial_model,
    make_optimizer,
    skipped_and_culprit,
    without_bad_steps,
)

float8 = pytest.importorskip("torchao.float8")
Float8Linear = pytest.importorskip("torchao.float8.float8_linear").Float8Linear

# The guards report each skip with a warning; the tests check the skips and culprits themselves (events, returns).
pytestmark = [
    pytest.mark.filterwarnings("ignore:SpikeGuard. loss spike at step"),
    pytest.mark.filterwarnings("ignore:NonFiniteGuard. non-finite loss and gradients at step"),
]

RECIPES = ["tensorwise", "rowwise"]
NORM_RTOL = 1e-6
BLOCK_CLASS = "FaultyBlock"


def fp8_model(
    recipe: str, checkpoint: str | None = None, targets: tuple[str, ...] = (BLOCK_CLASS,), device: str = "cpu"
) -> nn.Module:
    """The faulty GPT on ``device`` with its ``nn.Linear`` converted to ``Float8Linear``; ``checkpoint="before"`` /
    ``"after"`` injects activation checkpointing of ``targets`` before / after the conversion."""
    model = initial_model().to(device)
    if checkpoint == "before":
        inject_activation_checkpointing(model, list(targets))
    float8.convert_to_float8_training(model, config=float8.Float8LinearConfig.from_recipe_name(recipe))
    if checkpoint == "after":
        inject_activation_checkpointing(model, list(targets))
    return model


def loss_of(model: nn.Module, batch: Tensor) -> Tensor:
    """The model's loss on ``batch``, on the model's device; on a GPU under bf16 autocast, as FP8 training runs there
    (the rowwise recipe's float8 matmul writes bf16 only; the parameters and gradients stay float32)."""
    device = next(model.parameters()).device
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        return model(batch.to(device))


def grads_of(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def module_norms(model: nn.Module, names: list[str]) -> dict[str, float]:
    """Each module's gradient 2-norm by hand: the root of the sum of its parameters' squared gradient norms."""
    grads = grads_of(model)
    return {
        name: float(sum(g.double().square().sum() for n, g in grads.items() if n.startswith(name + ".")) ** 0.5)
        for name in names
    }


def float8_state(model: nn.Module) -> dict[str, Any]:
    """Every ``Float8Linear``'s plain attributes (not its parameters, buffers or hooks), deep-copied: what a forward
    could change in it outside its tensors (its config, its matmul config, its scaling types)."""
    return {
        name: {k: copy.deepcopy(v) for k, v in vars(m).items() if not k.startswith("_")}
        for name, m in model.named_modules()
        if isinstance(m, Float8Linear)
    }


# -- what a replay could change: the scaling state ------------------------------------------------------------------
@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_linear_keeps_no_scaling_state_for_a_replay_to_change(recipe: str) -> None:
    """Dynamic scaling only (no delayed scaling, hence no amax history): no buffer, no tensor attribute, and every
    ``Float8Linear``'s plain attributes the same after a training forward and backward (whose matmuls are float8
    ``torch._scaled_mm`` calls on CPU too) and a culprit replay."""
    assert {s.name for s in float8.ScalingType} == {"DYNAMIC", "DISABLED"}  # torchao 0.18 removed delayed scaling
    model = fp8_model(recipe, checkpoint="before")
    converted = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert len(converted) == 7 and list(model.buffers()) == []
    assert not any(isinstance(v, Tensor) for m in converted for v in vars(m).values())
    before = float8_state(model)
    bad = batches()[INF_STEP * ACCUMULATE]
    with torch.profiler.profile() as profile:
        model(bad).backward()
    assert "aten::_scaled_mm" in {e.name for e in profile.events()}  # float8 matmuls, not an emulation
    finding = replay_micro_batches(model, [MicroBatch(0, lambda: model(bad))])
    assert finding.culprit == "blocks.1"
    assert float8_state(model) == before


@pytest.mark.parametrize("recipe", RECIPES)
def test_culprit_replay_sees_through_float8_tensors_to_the_block_that_made_the_inf(recipe: str) -> None:
    """The inf that ``blocks.1`` adds is cast to float8 (as NaN) by the head's ``Float8Linear``, whose matmul the
    dispatch mode sees on two ``Float8TrainingTensor``s: the replay follows the value through their float8 data and
    names ``blocks.1``, the operator and the source line, as it does for the model before conversion (the
    reference); the head is where the inf became NaN. (Before: the head's ``aten.mm`` was named the origin.)"""
    bad = batches()[INF_STEP * ACCUMULATE]
    plain, model = initial_model(), fp8_model(recipe)
    reference = replay_micro_batches(plain, [MicroBatch(0, lambda: plain(bad))])
    finding = replay_micro_batches(model, [MicroBatch(0, lambda: model(bad))])
    assert (
        (finding.culprit, finding.phase)
        == (reference.culprit, reference.phase)
        == ("blocks.1", "forward_between_submodules")
    )
    assert finding.detail["op"] == reference.detail["op"] and finding.detail["source"] == reference.detail["source"]
    assert "the forward of `head`" in finding.detail["became_nan"]


# -- conversion and checkpointing: the order, the names ------------------------------------------------------------
@pytest.mark.parametrize("recipe", RECIPES)
def test_block_checkpointing_before_or_after_conversion_keeps_names_keys_and_gradients(recipe: str) -> None:
    """Checkpointing the blocks by class, injected before or after ``convert_to_float8_training``: the parameter
    names and ``state_dict`` keys of the converted model without checkpointing, every block checkpointed, every
    ``nn.Linear`` a ``Float8Linear``, and the gradients of one step bitwise those of the model without it."""
    reference = fp8_model(recipe)
    batch = clean_batches(1, seed=5)[0]
    reference(batch).backward()
    for order in ("before", "after"):
        model = fp8_model(recipe, checkpoint=order)
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
        assert list(model.state_dict()) == list(reference.state_dict())
        assert [injected_mode(b) for b in model.blocks] == ["full", "full"], order
        assert not any(type(m) is nn.Linear for m in model.modules())
        model(batch).backward()
        got, expected = grads_of(model), grads_of(reference)
        assert got.keys() == expected.keys() and all(torch.equal(got[n], expected[n]) for n in got), order


def test_linear_targets_are_checkpointed_when_injected_after_the_conversion() -> None:
    """``convert_to_float8_training`` replaces each ``nn.Linear`` by a new module: ``inject_activation_checkpointing``
    with ``Linear`` targets checkpoints the ``Float8Linear``s when it runs after the conversion (they are
    ``nn.Linear`` subclasses), and a checkpointed ``nn.Linear`` converted afterwards is no longer checkpointed (the
    order docs/compile.md gives: convert, then inject; the Trainer's callback selects again at ``on_fit_start``)."""
    after = fp8_model("tensorwise", checkpoint="after", targets=("Linear",))
    before = fp8_model("tensorwise", checkpoint="before", targets=("Linear",))
    assert [injected_mode(m) for m in after.modules() if isinstance(m, Float8Linear)] == ["full"] * 7
    assert [injected_mode(m) for m in before.modules() if isinstance(m, Float8Linear)] == [None] * 7


# -- the loop door: the stack against a hand-written loop ----------------------------------------------------------
def hand_loop(
    model: nn.Module, clip: Callable[[nn.Module], Any], names: list[str]
) -> tuple[list[float], list[dict[str, float]]]:
    """The reference: AdamW, ``clip`` between backward and step, the bad steps' micro-batches left out; each step's
    total pre-clip norm (what ``clip`` returns) and per-module norms (by hand)."""
    opt = make_optimizer("adamw", model.parameters())
    totals, modules = [], []
    data = without_bad_steps(batches())
    for start in range(0, len(data), ACCUMULATE):
        for b in data[start : start + ACCUMULATE]:
            (loss_of(model, b) / ACCUMULATE).backward()
        modules.append(module_norms(model, names))
        totals.append(clip(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return totals, modules


def kit_loop(
    model: nn.Module, policies: list[Any], log_dir: Path
) -> tuple[list[bool | None], dict[int, dict[str, float]]]:
    """The loop door with ``policies`` on the faulty data; whether each step was applied, and the logged rows."""
    opt = make_optimizer("adamw", model.parameters())
    rows: dict[int, dict[str, float]] = {}
    kit = gradkit.GradKit(
        model, opt, policies, log=lambda m, s: rows.setdefault(s, {}).update(m), log_every_n_steps=1, log_dir=log_dir
    )
    applied = []
    data = batches()
    for start in range(0, len(data), ACCUMULATE):
        for b in data[start : start + ACCUMULATE]:
            loss = loss_of(model, b)
            (loss / ACCUMULATE).backward()
            kit.note_loss(loss, replay=lambda b=b: loss_of(model, b))
        applied.append(kit.step(opt))
        opt.zero_grad(set_to_none=True)
    kit.finish()
    return applied, rows


def guards() -> list[Any]:
    return [gradkit.NonFiniteGuard("skip"), gradkit.SpikeGuard(action="skip", warmup_steps=3)]


@dataclass
class LoopRuns:
    """The loop door's run with the stack and the hand-written reference's, on the same float8 model."""

    model: nn.Module  # after the door's run
    reference: nn.Module  # after the reference's run
    applied: list[bool | None]  # each step, behind the door
    rows: dict[int, dict[str, float]]  # the door's logged values, by step
    totals: list[float]  # the reference's pre-clip total norms (clip_grad_norm_'s return), by applied step
    modules: list[dict[str, float]]  # the reference's per-block norms by hand, by applied step


BLOCKS = ["blocks.0", "blocks.1"]


def loop_runs(tmp_path: Path, recipe: str, order: str, device: str = "cpu") -> LoopRuns:
    """The monitor, ``ClipGradNorm(1.0)`` and the guards behind the loop door on the faulty data, the blocks
    checkpointed (``order``: before or after the conversion); the reference with ``clip_grad_norm_``."""
    model = fp8_model(recipe, checkpoint=order, device=device)
    applied, rows = kit_loop(model, [gradkit.GradNormMonitor(), gradkit.ClipGradNorm(1.0), *guards()], tmp_path)
    reference = fp8_model(recipe, device=device)
    totals, modules = hand_loop(reference, lambda m: float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)), BLOCKS)
    return LoopRuns(model, reference, applied, rows, totals, modules)


def check_skips_and_norms(runs: LoopRuns, log_dir: Path) -> None:
    """The same steps skipped, the culprit named, and the logged norms those of the reference: the total bitwise
    (clip_grad_norm_'s own reduction), the blocks' within ``NORM_RTOL``, under the converted model's names."""
    assert runs.applied == APPLIED
    assert skipped_and_culprit(log_dir) == ([INF_STEP, SPIKE_STEP], "blocks.1")
    steps = [s for s, ok in enumerate(APPLIED) if ok]  # the reference's i-th step is the door's steps[i]
    assert [runs.rows[s]["grad_norm/total"] for s in steps] == runs.totals
    logged = {k.removeprefix("grad_norm/module/") for k in runs.rows[0] if k.startswith("grad_norm/module/")}
    assert set(BLOCKS) <= logged <= {n for n, _ in runs.reference.named_modules()}  # the converted model's names
    for i, s in enumerate(steps):
        assert {b: runs.rows[s][f"grad_norm/module/{b}"] for b in BLOCKS} == pytest.approx(
            runs.modules[i], rel=NORM_RTOL
        )


@pytest.mark.parametrize(("recipe", "order"), [("tensorwise", "before"), ("rowwise", "after")])
def test_loop_door_on_float8_model_skips_exactly_and_logs_the_norms_of_clip_grad_norm_(
    tmp_path: Path, recipe: str, order: str
) -> None:
    runs = loop_runs(tmp_path, recipe, order)
    assert torch.equal(flat(runs.model), flat(runs.reference))
    check_skips_and_norms(runs, tmp_path)


CLIPPERS = {
    "value": (lambda: gradkit.ClipGradValue(0.02), lambda: ValueRef(0.02)),
    "agc": (lambda: gradkit.AdaptiveGradClip(clip_factor=0.02), lambda: AGCRef(0.02)),
}


@pytest.mark.parametrize("name", list(CLIPPERS))
def test_clippers_behind_the_guards_train_a_float8_model_like_their_reference(tmp_path: Path, name: str) -> None:
    """Element-wise and unit-wise clipping (``tests/clip_reference.py``: ``clip_grad_value_`` and timm's AGC written
    out) on the float8 model with checkpointed blocks: bitwise, the same steps skipped."""
    make_clipper, make_reference = CLIPPERS[name]
    model = fp8_model("rowwise", checkpoint="after")
    applied, _ = kit_loop(model, [make_clipper(), *guards()], tmp_path)
    reference = fp8_model("rowwise")
    hand_loop(reference, make_reference(), [])
    assert torch.equal(flat(model), flat(reference)) and applied == APPLIED
    unclipped = fp8_model("rowwise")
    hand_loop(unclipped, lambda m: None, [])
    assert not torch.equal(flat(reference), flat(unclipped))  # the clipper did clip


# -- the Trainer ---------------------------------------------------------------------------------------------------
class Float8Module(pl.LightningModule):
    """The faulty GPT converted to float8 in ``__init__`` or in ``configure_model`` (after the callbacks' ``setup``,
    where ``ActivationCheckpointing`` first injects)."""

    def __init__(self, recipe: str, convert_in: str) -> None:
        super().__init__()
        self.recipe, self.convert_in = recipe, convert_in
        self.model = initial_model()
        if convert_in == "__init__":
            self._convert()

    def _convert(self) -> None:
        config = float8.Float8LinearConfig.from_recipe_name(self.recipe)
        float8.convert_to_float8_training(self.model, config=config)

    def configure_model(self) -> None:
        if self.convert_in == "configure_model" and not isinstance(self.model.head, Float8Linear):
            self._convert()

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.model(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer("adamw", self.parameters())


def trainer_run(tmp_path: Path, module: Float8Module, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    """``Trainer.fit`` with the stack on the faulty data, or plain Lightning (``gradient_clip_val``) on the data without
    the bad steps; ``kwargs`` go to the Trainer."""
    trainer = make_trainer(
        tmp_path,
        default_root_dir=tmp_path,
        logger=False,
        strategy="gradkit" if callbacks else "auto",
        callbacks=callbacks,
        gradient_clip_val=None if callbacks else 1.0,
        accumulate_grad_batches=ACCUMULATE,
        **kwargs,
    )
    data = batches() if callbacks else without_bad_steps(batches())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="(NonFiniteGuard|SpikeGuard)")
        trainer.fit(module, DataLoader(data, batch_size=None))
    return trainer


@pytest.mark.parametrize(
    ("recipe", "convert_in", "target"),
    [("tensorwise", "configure_model", "Linear"), ("rowwise", "__init__", BLOCK_CLASS)],
    ids=["convert-after-injection", "convert-before-injection"],
)
def test_trainer_on_float8_model_equals_plain_lightning_without_the_bad_steps(
    tmp_path: Path, recipe: str, convert_in: str, target: str
) -> None:
    """The stack with ``ActivationCheckpointing`` by class, the model converted before its ``setup`` injects, or after
    (in ``configure_model``: the ``nn.Linear``s it checkpointed are replaced, and it checkpoints the ``Float8Linear``s
    at ``on_fit_start``): the parameters of plain Lightning on the data without the bad steps, bitwise."""
    module, reference = trainer_runs(tmp_path, recipe, convert_in, target)
    assert torch.equal(flat(module), flat(reference))


def trainer_runs(
    tmp_path: Path, recipe: str, convert_in: str, target: str, **kwargs: Any
) -> tuple[Float8Module, Float8Module]:
    """The stack with ``ActivationCheckpointing([target])``, and plain Lightning; checks the skips, the culprit, the
    modules checkpointed and the ``state_dict`` keys; returns both modules after the run."""
    checkpointing = ActivationCheckpointing([target])
    stack = [GradNormMonitor(), ClipGradNorm(1.0), NonFiniteGuard("skip"), SpikeGuard(action="skip", warmup_steps=3)]
    module = Float8Module(recipe, convert_in)
    trainer_run(tmp_path / "stack", module, [*stack, checkpointing], **kwargs)
    reference = Float8Module(recipe, convert_in)
    trainer_run(tmp_path / "plain", reference, [], **kwargs)
    assert skipped_and_culprit(tmp_path / "stack") == ([INF_STEP, SPIKE_STEP], "model.blocks.1")
    expected = ["model.blocks.0", "model.blocks.1"]
    if target == "Linear":
        expected = [n for n, m in module.named_modules() if isinstance(m, Float8Linear)]
    assert checkpointing.checkpointed_modules == expected and len(expected) in (2, 7)
    assert list(module.state_dict()) == list(reference.state_dict())
    return module, reference
