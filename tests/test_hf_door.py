"""The Hugging Face ``Trainer`` door (``gradkit.doors.huggingface``): the same training as the loop door, bitwise, and
as a hand-written loop with ``clip_grad_norm_`` and the non-finite batch left out.

Each test trains a tiny GPT-2, a BERT classifier (both built from config: no download) or a small BatchNorm classifier
with ``transformers.Trainer`` and the door, and compares against references that share nothing with HF's loop
(``hf_fixtures``): the loop door fed the same micro-batches and the loss HF forms, and a hand-written step. Skipped
without ``transformers``.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gradkit.doors.huggingface import install  # noqa: E402
from helpers import assert_same_state, run_without_lightning  # noqa: E402
from hf_fixtures import (  # noqa: E402
    CULPRITS,
    MODELS,
    TokenData,
    assert_same_model,
    batches,
    gradkit_rows,
    hand_written_run,
    loop_door_run,
    merged_rows,
    optimizer_and_scheduler,
    poison,
    training_args,
)
from lightning_gradkit import (  # noqa: E402
    AdaptiveGradClip,
    AutoClip,
    ClipGradNorm,
    ClipGradValue,
    GradNormMonitor,
    NonFiniteGuard,
    SpikeGuard,
    SpikeRollback,
    ZClip,
)
from test_guards import events  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:NonFiniteGuard:UserWarning", "ignore:SpikeGuard:UserWarning", "ignore:SpikeRollback:UserWarning"
)

STEPS, ACCUMULATE = 8, 2
BAD_SAMPLE = 25  # micro-batch 6, the first of window (step) 3 with 2 micro-batches of 4 samples per step


def _samples(steps: int, accumulate: int) -> int:
    return steps * accumulate * 4


def _hf_run(
    kind: str,
    out: Path,
    policies: list[Any],
    *,
    steps: int = STEPS,
    accumulate: int = ACCUMULATE,
    bad: tuple[int, ...] = (BAD_SAMPLE,),
    where: str = "grad",
    optimizer: str | None = "sgd",
    **arguments: Any,
) -> tuple[Any, Any]:
    """Train ``kind`` with HF's Trainer and the door; ``optimizer=None`` lets HF build its own (fused AdamW)."""
    model = MODELS[kind]()
    poison(model, kind, where)
    args = training_args(
        out, max_steps=steps, gradient_accumulation_steps=accumulate, **{"logging_steps": 2, **arguments}
    )
    data = TokenData(kind, _samples(steps, accumulate), poisoned=list(bad))
    pair = optimizer_and_scheduler(model, steps, optimizer) if optimizer else (None, None)
    trainer = transformers.Trainer(model, args, train_dataset=data, optimizers=pair)
    door = install(trainer, policies)
    trainer.train()
    return trainer, door


def _loop_run(
    kind: str,
    policies: list[Any],
    *,
    steps: int = STEPS,
    accumulate: int = ACCUMULATE,
    bad: tuple[int, ...] = (BAD_SAMPLE,),
    where: str = "grad",
    optimizer: str = "sgd",
    log_every_n_steps: int = 2,
    **kwargs: Any,
) -> tuple[Any, Any, Any, list[tuple[int, dict[str, float]]]]:
    """The same run through the loop door: (model, optimizer, kit, logged rows)."""
    model = MODELS[kind]()
    poison(model, kind, where)
    opt, scheduler = optimizer_and_scheduler(model, steps, optimizer)
    micro = batches(TokenData(kind, _samples(steps, accumulate), poisoned=list(bad)))
    kit, rows = loop_door_run(model, kind, micro, accumulate, opt, scheduler, policies, log_every_n_steps, **kwargs)
    return model, opt, kit, rows


def _policies() -> list[Any]:
    return [GradNormMonitor(), ClipGradNorm(max_norm=0.5), NonFiniteGuard(action="skip")]


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_the_door_trains_as_the_loop_door_and_the_hand_written_loop(kind: str, tmp_path: Path) -> None:
    trainer, door = _hf_run(kind, tmp_path, _policies())

    # The loop door on the same micro-batches, with the loss HF back-propagates: bitwise the same run, the same
    # logged values at the same steps, the same skipped step.
    model, optimizer, kit, rows = _loop_run(kind, _policies())
    assert_same_model(trainer.model, model)
    assert merged_rows(gradkit_rows(trainer.state.log_history)) == merged_rows(rows)
    assert door.kit.skipped_steps == kit.skipped_steps == 1
    # HF held its scheduler on the skipped step: 7 steps of the linear decay.
    assert trainer.lr_scheduler.last_epoch == STEPS - 1
    assert trainer.optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    # HF's own grad_norm is the pipeline's pre-clip norm (the monitor's total), on HF's logging steps.
    hf_rows = [row for row in trainer.state.log_history if "loss" in row and "grad_norm" in row]
    monitor = merged_rows(rows)
    assert [row["step"] for row in hf_rows] == [2, 4, 6, 8]
    assert all(repr(row["grad_norm"]) == monitor[row["step"]]["grad_norm/total"] for row in hf_rows)

    # A hand-written loop with clip_grad_norm_ and the non-finite window (micro-batches 6 and 7) left out: bitwise
    # too. The pipeline's total norm and coefficient come out as torch's on these tensors, and SGD applies the
    # clipped gradients as the hand-written step does.
    model = MODELS[kind]()
    optimizer, scheduler = optimizer_and_scheduler(model, STEPS)
    clean = batches(TokenData(kind, _samples(STEPS, ACCUMULATE)), drop=[6, 7])
    hand_written_run(model, kind, clean, ACCUMULATE, optimizer, scheduler, max_norm=0.5)
    assert_same_model(trainer.model, model)
    assert trainer.optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]


def test_hfs_own_fused_adamw_and_schedule_train_as_the_loop_door(tmp_path: Path) -> None:
    # HF builds its default optimizer (fused AdamW, two param groups) and linear schedule; the fused kernel takes the
    # clip coefficient and the skip as its grad_scale and found_inf (no write pass, no host read of the skip).
    trainer, door = _hf_run("gpt2", tmp_path, _policies(), optimizer=None, learning_rate=1e-3)
    assert trainer.optimizer.optimizer.defaults["fused"]
    model, _, kit, rows = _loop_run("gpt2", _policies(), optimizer="hf")
    assert_same_model(trainer.model, model)
    assert merged_rows(gradkit_rows(trainer.state.log_history)) == merged_rows(rows)
    assert door.kit.skipped_steps == kit.skipped_steps == 1 and trainer.lr_scheduler.last_epoch == STEPS - 1
    # Against a hand-written loop with clip_grad_norm_ and the NaN window left out, a tolerance: Adam divides each
    # update by the root of its second moment, so the attention biases and LayerNorm weights, whose gradients are
    # zero up to rounding at initialization, take updates that follow the rounding of the two computations (the
    # kernel divides by the coefficient as grad_scale; the hand-written loop multiplies the gradients by it). Each
    # such update is at most the learning rate (1e-3): the bound is a tenth of one.
    reference = MODELS["gpt2"]()
    optimizer, scheduler = optimizer_and_scheduler(reference, STEPS, "hf")
    clean = batches(TokenData("gpt2", _samples(STEPS, ACCUMULATE)), drop=[6, 7])
    hand_written_run(reference, "gpt2", clean, ACCUMULATE, optimizer, scheduler, max_norm=0.5)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(trainer.model.state_dict()[key], value, rtol=0, atol=1e-4, msg=key)


@pytest.mark.parametrize(
    "clipper",
    [
        lambda: ClipGradNorm(max_norm=0.5),
        lambda: ClipGradValue(clip_value=0.01),
        lambda: AdaptiveGradClip(clip_factor=0.01),
        lambda: AutoClip(percentile=50.0, history_size=4),
        lambda: ZClip(warmup_steps=2, z_threshold=0.5, max_norm=0.5),
    ],
    ids=["ClipGradNorm", "ClipGradValue", "AdaptiveGradClip", "AutoClip", "ZClip"],
)
def test_every_clipper_clips_as_behind_the_loop_door(clipper: Any, tmp_path: Path) -> None:
    steps = 5
    trainer, _ = _hf_run("gpt2", tmp_path, [GradNormMonitor(), clipper()], steps=steps, accumulate=1, bad=())
    model, _, _, rows = _loop_run("gpt2", [GradNormMonitor(), clipper()], steps=steps, accumulate=1, bad=())
    assert_same_model(trainer.model, model)
    logged = merged_rows(gradkit_rows(trainer.state.log_history))
    assert logged == merged_rows(rows)
    # The clipper acted (the run differs from one without it).
    unclipped, _, _, _ = _loop_run("gpt2", [GradNormMonitor()], steps=steps, accumulate=1, bad=())
    assert not torch.equal(unclipped.lm_head.weight, model.lm_head.weight)


def test_a_skipped_step_leaves_parameters_optimizer_state_and_buffers_untouched(tmp_path: Path) -> None:
    # The BatchNorm classifier: HF divides its loss by the accumulation steps (no num_items_in_batch), and each
    # forward writes the running statistics, which the skipped window's forwards must not leave behind.
    seen: dict[str, Any] = {}

    class Watch(transformers.TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any, optimizer: Any, **kw: Any) -> None:
            if state.global_step in (2, 3):  # before a clean step and before the poisoned one
                seen[f"before{state.global_step}"] = copy.deepcopy((model.state_dict(), optimizer.state_dict()))

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any, optimizer: Any, **kw: Any) -> None:
            if state.global_step in (3, 4):
                seen[f"after{state.global_step - 1}"] = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
                seen[f"lr{state.global_step - 1}"] = kw["lr_scheduler"].last_epoch

    model = MODELS["norm"]()
    poison(model, "norm")
    args = training_args(tmp_path, max_steps=6, gradient_accumulation_steps=2)
    optimizer, scheduler = optimizer_and_scheduler(model, 6)
    trainer = transformers.Trainer(
        model, args, train_dataset=TokenData("norm", 48, poisoned=[BAD_SAMPLE]), optimizers=(optimizer, scheduler)
    )
    trainer.add_callback(Watch())
    install(trainer, [NonFiniteGuard(action="skip")])
    trainer.train()

    (params_before, opt_before), (params_after, opt_after) = seen["before3"], seen["after3"]
    for key, value in params_before.items():  # weights and BatchNorm statistics, as before the window
        assert torch.equal(params_after[key], value), key
    assert_same_state(opt_after, opt_before)  # the momentum buffers
    assert seen["lr3"] == seen["lr2"] == 3  # HF's scheduler held on the skipped step
    # The clean step before it changed all of them (the comparison can fail).
    assert not torch.equal(seen["before2"][0]["norm.running_mean"], seen["after2"][0]["norm.running_mean"])
    assert not torch.equal(seen["before2"][0]["head.weight"], seen["after2"][0]["head.weight"])
    # And the whole run equals the loop door's on the same loss (HF divides it by the 2 micro-batches).
    reference, _, kit, _ = _loop_run("norm", [NonFiniteGuard(action="skip")], steps=6)
    assert_same_model(trainer.model, reference)
    assert kit.skipped_steps == 1


def test_a_nan_loss_with_finite_gradients_is_skipped(tmp_path: Path) -> None:
    # Only the loss check sees it: the door hands each micro-batch's loss to the guard.
    trainer, door = _hf_run("gpt2", tmp_path, [NonFiniteGuard(action="skip")], where="loss")
    model, _, kit, _ = _loop_run("gpt2", [NonFiniteGuard(action="skip")], where="loss")
    assert_same_model(trainer.model, model)
    assert door.kit.skipped_steps == kit.skipped_steps == 1
    assert trainer.lr_scheduler.last_epoch == STEPS - 1


def test_spike_guard_skips_a_loss_spike_as_behind_the_loop_door(tmp_path: Path) -> None:
    def policies() -> list[Any]:
        return [SpikeGuard(monitor="loss", warmup_steps=2, z_threshold=3.0, action="skip")]

    trainer, door = _hf_run("gpt2", tmp_path, policies(), where="spike")
    model, _, kit, _ = _loop_run("gpt2", policies(), where="spike")
    assert_same_model(trainer.model, model)
    assert door.kit.skipped_steps == kit.skipped_steps == 1
    assert trainer.lr_scheduler.last_epoch == STEPS - 1
    assert_same_state(door.policies[0].state_dict(), kit.policies[0].state_dict())


def test_spike_rollback_rewinds_hfs_lr_scheduler_with_the_model(tmp_path: Path) -> None:
    # Windows 5 and 6 are non-finite: the guard skips the first, the rollback fires at the second and restores the
    # snapshot of step 4 (parameters, optimizer state and HF's LR scheduler), then steps over one more window.
    steps, bad = 10, (4 * 2 * 5, 4 * 2 * 6)

    def policies() -> list[Any]:
        return [
            NonFiniteGuard(action="skip"),
            SpikeRollback(monitor="loss", nonfinite_patience=2, snapshot_every_n_steps=2, skip_batches=1),
        ]

    trainer, door = _hf_run("gpt2", tmp_path, policies(), steps=steps, bad=bad)
    model, optimizer, kit, _ = _loop_run("gpt2", policies(), steps=steps, bad=bad)
    assert door.policies[1].rollbacks == kit.policies[1].rollbacks == 1
    assert_same_model(trainer.model, model)
    assert trainer.optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    # The schedule took as many steps as the model holds: the attempted steps less the rewound ones (steps 5, 6 and 7
    # in HF's count, back to the snapshot after step 4) and the one stepped over (8): steps 1-4, 9 and 10.
    assert door.kit.skipped_steps == kit.skipped_steps == 4
    assert trainer.lr_scheduler.last_epoch == steps - 4
    assert trainer.lr_scheduler.get_last_lr() == pytest.approx([0.05 * (1 - (steps - 4) / steps)], rel=1e-12)


def test_the_door_takes_over_hfs_max_grad_norm_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # HF's default clipping (max_grad_norm=1.0; 0.5 here) runs as ClipGradNorm in the pipeline: the same training as
    # max_grad_norm=0 with ClipGradNorm(0.5) given to the door, and HF's grad_norm stays the pre-clip norm. Said once,
    # at info level (nothing is wrong).
    with caplog.at_level(logging.INFO, logger="gradkit.doors.huggingface"):
        trainer, door = _hf_run("gpt2", tmp_path / "hf", [GradNormMonitor(), NonFiniteGuard()], max_grad_norm=0.5)
    notes = [r.getMessage() for r in caplog.records if "runs as ClipGradNorm" in r.getMessage()]
    assert len(notes) == 1 and "max_grad_norm=0.5) runs as ClipGradNorm(max_norm=0.5)" in notes[0], notes
    assert [type(p).__name__ for p in door.policies] == ["GradNormMonitor", "NonFiniteGuard", "ClipGradNorm"]
    model, _, kit, rows = _loop_run("gpt2", _policies())
    assert_same_model(trainer.model, model)
    assert merged_rows(gradkit_rows(trainer.state.log_history)) == merged_rows(rows)
    hf_rows = [row for row in trainer.state.log_history if "grad_norm" in row]
    assert all(repr(row["grad_norm"]) == merged_rows(rows)[row["step"]]["grad_norm/total"] for row in hf_rows)
    assert door.kit.skipped_steps == kit.skipped_steps == 1


def test_two_clippers_and_what_is_not_a_trainer_or_a_policy_are_refused_with_the_fix(tmp_path: Path) -> None:
    trainer = transformers.Trainer(MODELS["gpt2"](), training_args(tmp_path, max_grad_norm=1.0))
    with pytest.raises(ValueError, match=r"max_grad_norm=1.0\).*ZClip would both clip.*Set `max_grad_norm=0`"):
        install(trainer, [ZClip()])
    with pytest.raises(TypeError, match=r"must be a transformers\.Trainer"):
        install(object(), [ClipGradNorm(max_norm=1.0)])  # type: ignore[arg-type]
    trainer = transformers.Trainer(MODELS["gpt2"](), training_args(tmp_path))
    with pytest.raises(TypeError, match=r"holds the class `ClipGradNorm`"):
        install(trainer, [ClipGradNorm])  # type: ignore[list-item]


def test_logged_values_reach_hfs_reporters_at_hfs_steps(tmp_path: Path) -> None:
    # TensorBoard is one of HF's reporters (TensorBoardCallback, prefixing "train/"); W&B and MLflow read the same
    # `on_log` call. The door's rows and HF's own row of a step carry the same step number.
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer, _ = _hf_run("gpt2", tmp_path, _policies(), steps=4, bad=(), report_to=["tensorboard"])
    (events,) = tmp_path.glob("runs/*/events.out.tfevents.*")
    scalars = EventAccumulator(str(events)).Reload()
    logged = merged_rows(gradkit_rows(trainer.state.log_history))
    assert sorted(logged) == [1, 2, 4]  # the monitor's first step, then every logging_steps=2
    for key in ("grad_norm/total", "grad_clip/coef", "gradkit/skipped_steps"):
        written = {e.step: repr(e.value) for e in scalars.Scalars(f"train/{key}")}
        # TensorBoard stores float32: the values as HF's log_history holds them, rounded to float32.
        expected = {step: repr(torch.tensor(float(row[key])).item()) for step, row in logged.items() if key in row}
        assert written == expected, key
    hf = {e.step for e in scalars.Scalars("train/loss")}
    assert hf == {2, 4}


def test_the_example_skips_the_injected_nan_and_resumes_with_the_policies_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = importlib.util.spec_from_file_location("hf_finetune", Path(__file__).parents[1] / "examples/hf_finetune.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    common = ["--out-dir", str(tmp_path), "--n-layer", "1", "--n-embd", "32", "--max-bytes", "20000", "--cpu"]
    common += ["--logging-steps", "1", "--save-steps", "2", "--batch-size", "2", "--accumulate", "1"]
    with (
        caplog.at_level(logging.INFO, logger="gradkit.doors.huggingface"),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        trainer = example.main([*common, "--max-steps", "4", "--inject-nan-at", "1"])
    # HF's default max_grad_norm=1.0 runs as ClipGradNorm: nothing is wrong, so a note at info level, no warning.
    assert [r.getMessage() for r in caplog.records if "HFGradKit clips for HF" in r.getMessage()]
    assert not [w for w in caught if "clips for HF" in str(w.message)]
    # The one warning (the NaN skip) names the user's line (the example's `trainer.train()`), not HF's trainer.py.
    (skip,) = [w for w in caught if "NonFiniteGuard" in str(w.message)]
    assert Path(skip.filename).name == "hf_finetune.py", skip.filename
    assert next(row["step"] for row in trainer.state.log_history if row.get("gradkit/skipped_steps") == 1.0) == 2
    resumed = example.main([*common, "--max-steps", "6", "--resume"])
    assert resumed.state.global_step == 6
    assert [
        r["gradkit/skipped_steps"] for r in resumed.state.log_history if r["step"] == 6 and "gradkit/skipped_steps" in r
    ] == [1.0]


def test_the_monitors_gradient_report_is_drawn_in_the_output_dir(tmp_path: Path) -> None:
    # GradNormMonitor(report=True): the report of the run's norms, clips and skips, drawn at the end of training into
    # HF's output_dir (where the events are), from what the monitor logged on HF's logging steps.
    pytest.importorskip("matplotlib")
    from gradkit.report.figure import REPORT_FILE

    trainer, door = _hf_run(
        "gpt2", tmp_path, [GradNormMonitor(report=True), ClipGradNorm(max_norm=0.5), NonFiniteGuard(action="skip")]
    )
    assert (tmp_path / REPORT_FILE).stat().st_size > 10_000
    (event,) = events(tmp_path)
    assert (event["what"], event["step"], event["action"]) == ("nonfinite_loss_and_grads", 3, "skip")
    assert door.kit.skipped_steps == 1 and trainer.state.global_step == STEPS


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_the_culprit_replay_names_the_module_where_the_nan_began(kind: str, tmp_path: Path) -> None:
    # The poisoned micro-batch's NaN begins in the output of CULPRITS[kind]; HF's loss and every gradient are NaN by
    # the time the step ends. The guard replays the step's micro-batches through `compute_loss` on the inputs HF gave
    # it, once, and finds the module.
    trainer, door = _hf_run(kind, tmp_path, [NonFiniteGuard(action="skip")])
    (event,) = events(tmp_path)
    assert event["step"] == 3 and event["culprit"] == CULPRITS[kind]
    assert event["reproducible"] is True
    assert door.kit.skipped_steps == 1
    # The replay changed nothing: the run equals the loop door's without a replay.
    model, _, _, _ = _loop_run(kind, [NonFiniteGuard(action="skip")])
    assert_same_model(trainer.model, model)


def test_hfs_default_fused_adamw_skip_names_the_culprit_one_step_late(tmp_path: Path) -> None:
    # HF's default optimizer (`optim="adamw_torch_fused"`) skips on device: the flag of step 3 reaches the host in step
    # 4, before step 4's optimizer step, and the poisoned micro-batch 6 is replayed then. Reference: the module, the
    # operator and the line the test's poison plants (`hf_fixtures.poison`).
    guard = NonFiniteGuard(action="skip")
    trainer, door = _hf_run("gpt2", tmp_path, [guard], optimizer=None, optim="adamw_torch_fused", learning_rate=1e-3)
    assert trainer.optimizer.optimizer.defaults["fused"]
    (event,) = events(tmp_path)
    assert (event["first_step"], event["batch_idx"], event["batches"]) == (3, 6, [6, 7])
    assert (event["culprit"], event["culprit_source"], event["reproducible"]) == (CULPRITS["gpt2"], "replay", True)
    # The poison is a forward hook of the module (its forward, outside its submodules); the NaN enters as the constant
    # `math.nan` becomes a tensor, on the poison's line.
    (finding,) = event["values"]["forensics"]
    assert (finding["phase"], finding["op"]) == ("forward_between_submodules", "aten.scalar_tensor.default")
    assert finding["source"].endswith('in corrupt: factor = torch.where(state["bad"], math.nan, 1.0).to(output.dtype)')
    # The late replay changed nothing: bitwise the loop door's run, which keeps no micro-batch and never replays (the
    # test above ties that run to a hand-written loop without the NaN window).
    model, _, kit, _ = _loop_run("gpt2", [NonFiniteGuard(action="skip")], optimizer="hf")
    assert_same_model(trainer.model, model)
    assert door.kit.skipped_steps == kit.skipped_steps == 1


def test_the_door_with_gradkits_torch_policies_loads_no_lightning(tmp_path: Path) -> None:
    # The example trains with gradkit's plain torch policies: an HF user installs no Lightning.
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['hf_finetune.py', '--out-dir', {str(tmp_path)!r}, '--n-layer', '1', '--n-embd', '32', "
        "'--max-bytes', '20000', '--cpu', '--max-steps', '3', '--batch-size', '2', '--accumulate', '1', "
        "'--inject-nan-at', '1', '--clip', 'zclip']\n"
        f"runpy.run_path({str(Path(__file__).parents[1] / 'examples/hf_finetune.py')!r}, run_name='__main__')\n"
    )
    assert "3 optimizer steps, 1 skipped" in run_without_lightning(code, timeout=300)


def test_a_short_last_window_is_one_step_with_its_own_loss_scale(tmp_path: Path) -> None:
    # 3 micro-batches per epoch in windows of 2: each epoch ends with a window of 1 (HF's
    # `current_gradient_accumulation_steps`), whose loss the door scales by 1, not 2. SpikeGuard's statistics of the
    # loss, and the model, come out as the loop door's over the same windows.
    def policies() -> list[Any]:
        return [GradNormMonitor(), ClipGradNorm(max_norm=0.5), SpikeGuard(monitor="loss", warmup_steps=2)]

    model = MODELS["gpt2"]()
    args = training_args(tmp_path, max_steps=6, gradient_accumulation_steps=2, logging_steps=2)
    optimizer, scheduler = optimizer_and_scheduler(model, 6)
    trainer = transformers.Trainer(model, args, train_dataset=TokenData("gpt2", 12), optimizers=(optimizer, scheduler))
    door = install(trainer, policies())
    trainer.train()
    assert trainer.state.global_step == 6 and trainer.state.epoch == 3.0
    reference = MODELS["gpt2"]()
    optimizer, scheduler = optimizer_and_scheduler(reference, 6)
    micro = batches(TokenData("gpt2", 12))
    kit, rows = loop_door_run(reference, "gpt2", micro, 2, optimizer, scheduler, policies(), 2, epochs=3)
    assert_same_model(trainer.model, reference)
    assert_same_state(door.policies[2].state_dict(), kit.policies[2].state_dict())
    assert merged_rows(gradkit_rows(trainer.state.log_history)) == merged_rows(rows)
