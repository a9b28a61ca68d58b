"""The Hugging Face door across HF checkpoints: ``save_steps`` writes the policies' state into each checkpoint folder
and ``trainer.train(resume_from_checkpoint=...)`` loads it, so a resumed run equals the uninterrupted one bitwise
(model, policies' statistics, logged values, skipped steps). Skipped without ``transformers``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gradkit.doors.huggingface import STATE_FILENAME, install  # noqa: E402
from helpers import assert_same_state  # noqa: E402
from hf_fixtures import (  # noqa: E402
    MODELS,
    TokenData,
    assert_same_model,
    gradkit_rows,
    merged_rows,
    optimizer_and_scheduler,
    poison,
    training_args,
)
from lightning_gradkit import GradNormMonitor, NonFiniteGuard, SpikeGuard, StepsToSkip, ZClip  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:NonFiniteGuard:UserWarning", "ignore:SpikeGuard:UserWarning")

STEPS, ACCUMULATE, SAMPLES = 8, 2, 64
BAD_SAMPLE = 17  # step 2: the skip count and the guards' statistics carry it across the checkpoint of step 4


def _policies() -> list[Any]:
    return [
        GradNormMonitor(),
        ZClip(warmup_steps=2, z_threshold=0.5),
        SpikeGuard(monitor="grad_norm", warmup_steps=2, action="warn"),
        NonFiniteGuard(action="skip"),
    ]


def _run(out: Path, resume: str | bool | None = None) -> tuple[Any, Any]:
    model = MODELS["gpt2"]()
    poison(model, "gpt2")
    args = training_args(
        out, max_steps=STEPS, gradient_accumulation_steps=ACCUMULATE, save_strategy="steps", save_steps=4
    )
    data = TokenData("gpt2", SAMPLES, poisoned=[BAD_SAMPLE])
    trainer = transformers.Trainer(model, args, train_dataset=data, optimizers=optimizer_and_scheduler(model, STEPS))
    door = install(trainer, _policies())
    trainer.train(resume_from_checkpoint=resume)
    return trainer, door


def test_a_run_resumed_from_an_hf_checkpoint_equals_the_uninterrupted_one(tmp_path: Path) -> None:
    whole, whole_door = _run(tmp_path / "whole")
    assert (tmp_path / "whole" / "checkpoint-4" / STATE_FILENAME).is_file()
    # The checkpoint folder alone, moved to a new output_dir: `resume_from_checkpoint=True` finds it there.
    shutil.copytree(tmp_path / "whole" / "checkpoint-4", tmp_path / "resumed" / "checkpoint-4")
    resumed, resumed_door = _run(tmp_path / "resumed", resume=True)

    assert_same_model(resumed.model, whole.model)
    assert_same_state(resumed_door.kit.state_dict(), whole_door.kit.state_dict())
    assert resumed_door.kit.skipped_steps == whole_door.kit.skipped_steps == 1
    # HF's log_history resumes from the checkpoint's (steps 1 to 4, the door's rows included): the whole of it is
    # the uninterrupted run's.
    assert merged_rows(gradkit_rows(resumed.state.log_history)) == merged_rows(gradkit_rows(whole.state.log_history))
    assert resumed.lr_scheduler.last_epoch == whole.lr_scheduler.last_epoch == STEPS - 1
    # The state the checkpoint carried was not a fresh one: ZClip and SpikeGuard had seen 4 steps.
    saved = torch.load(tmp_path / "whole" / "checkpoint-4" / STATE_FILENAME, weights_only=False)
    assert saved["step"] == 4 and saved["skipped_steps"] == 1


def test_a_checkpoint_without_the_policies_state_resumes_them_fresh_and_says_so(tmp_path: Path) -> None:
    _run(tmp_path / "whole")
    folder = tmp_path / "resumed" / "checkpoint-4"
    shutil.copytree(tmp_path / "whole" / "checkpoint-4", folder)
    (folder / STATE_FILENAME).unlink()
    with pytest.warns(UserWarning, match=f"holds no {STATE_FILENAME}.*the policies start fresh"):
        _, door = _run(tmp_path / "resumed", resume=str(folder))
    assert door.kit.skipped_steps == 0  # the skip of step 2 is not in the fresh state


def test_a_resume_with_a_policy_added_and_one_gone_warns_as_the_loop_door(tmp_path: Path) -> None:
    """The door loads through the loop door's ``load_state_dict``: a policy added at the restart starts fresh and a
    saved state whose policy is gone is reported, each in one warning, in the loop door's words (it used to raise a
    KeyError); the added StepsToSkip then drops its step."""

    def run(policies: list[Any], resume: str | None = None) -> Any:
        model = MODELS["norm"]()
        args = training_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
        data = TokenData("norm", 4 * 4)
        trainer = transformers.Trainer(model, args, train_dataset=data, optimizers=optimizer_and_scheduler(model, 4))
        door = install(trainer, policies)
        trainer.train(resume_from_checkpoint=resume)
        return door

    run([NonFiniteGuard(action="skip"), ZClip(warmup_steps=2)])
    declared = StepsToSkip(steps=[[3, 4]])
    with pytest.warns(UserWarning) as caught:
        door = run([ZClip(warmup_steps=2), declared], resume=str(tmp_path / "checkpoint-2"))
    messages = [str(w.message) for w in caught]
    assert sum(m.startswith("Resuming with no saved state for StepsToSkip: ") for m in messages) == 1
    gone = "The checkpoint holds the state of NonFiniteGuard{'action': 'skip'}, which this run does not have"
    assert sum(m.startswith(gone) for m in messages) == 1
    assert declared.dropped == 1 and door.kit.skipped_steps == 1 and door.kit.ctx.step == 4


class _NanAfterStep(transformers.TrainerCallback):
    """A user's callback (HF calls it before the door's): the head's weights turn NaN after optimizer step ``step``,
    what an exploding update leaves."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if state.global_step == self.step:
            with torch.no_grad():
                model.head.weight.fill_(float("nan"))


@pytest.mark.filterwarnings("ignore:HFGradKit. the checkpoint:UserWarning")
def test_the_door_writes_no_checkpoint_folder_of_a_nonfinite_state(tmp_path: Path) -> None:
    bad, steps = 3, 5

    def run(out: Path, check_checkpoints: bool) -> tuple[Any, Any]:
        model = MODELS["norm"]()
        args = training_args(out, max_steps=steps, save_strategy="steps", save_steps=1)
        trainer = transformers.Trainer(
            model, args, train_dataset=TokenData("norm", steps * 4), callbacks=[_NanAfterStep(bad)],
            optimizers=optimizer_and_scheduler(model, steps),
        )  # fmt: skip
        return trainer, install(trainer, [GradNormMonitor()], check_checkpoints=check_checkpoints)

    def folders(out: Path) -> dict[str, bool]:
        """Each checkpoint folder -> whether its weights and optimizer state are finite (the reference:
        ``torch.isfinite`` over every tensor of its files)."""
        from safetensors.torch import load_file

        found = {}
        for folder in sorted(out.glob("checkpoint-*")):
            tensors = [*load_file(folder / "model.safetensors").values()]
            tensors += [t for s in torch.load(folder / "optimizer.pt")["state"].values() for t in s.values()]
            found[folder.name] = all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())
        return found

    trainer, _ = run(tmp_path / "checked", check_checkpoints=True)
    with pytest.warns(UserWarning, match=rf"HFGradKit: the checkpoint of step {bad} .*`head.weight`"):
        trainer.train()
    assert folders(tmp_path / "checked") == {f"checkpoint-{s}": True for s in range(1, bad)}
    refused = [e for e in _events(tmp_path / "checked") if e["what"] == "checkpoint_refused"]
    assert [e["step"] for e in refused] == list(range(bad, steps + 1))
    assert all(e["values"]["parameters"] == ["head.weight"] for e in refused[:1])
    # A save HF decides after the step (save_strategy="best" does, after its evaluation) is refused as well.
    trainer._save_checkpoint(trainer.model, None)
    assert not (tmp_path / "checked" / f"checkpoint-{steps}").exists()

    # Without the check HF writes the NaN folders (what the door prevents).
    unchecked, _ = run(tmp_path / "unchecked", check_checkpoints=False)
    unchecked.train()
    assert folders(tmp_path / "unchecked") == {f"checkpoint-{s}": s < bad for s in range(1, steps + 1)}


def _events(out: Path) -> list[dict[str, Any]]:
    import json

    return [json.loads(line) for line in (out / "gradkit_events.jsonl").read_text().splitlines()]
