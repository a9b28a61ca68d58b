"""The checkpoint gate behind every door: no checkpoint holds a non-finite parameter, optimizer state or buffer, and
the last good one is never replaced by a bad one. The reference for "finite" is ``torch.isfinite`` over every tensor of
each file written (or of the state, hand-walked); for "the last good one", plain Lightning stopped at that step."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn

from gradkit import GradKit, checkpoint_is_finite
from gradkit.report.events import EVENTS_FILENAME
from helpers import MLPModule, assert_same_state, count_syncs, loader, make_trainer
from lightning_gradkit import CheckpointGuard

BAD_STEP = 3  # the state turns non-finite after this optimizer step: its checkpoint and every later one are refused
NAN = float("nan")


def nonfinite_tensors(obj: Any, where: str = "") -> list[str]:
    """Where a nested checkpoint holds a tensor with a NaN or an infinity (the reference: ``torch.isfinite``)."""
    if isinstance(obj, Tensor):
        return [] if not obj.is_floating_point() or torch.isfinite(obj).all() else [where]
    if isinstance(obj, dict):
        return [w for key, value in obj.items() for w in nonfinite_tensors(value, f"{where}/{key}")]
    if isinstance(obj, (list, tuple)):
        return [w for i, value in enumerate(obj) for w in nonfinite_tensors(value, f"{where}/{i}")]
    return []


def nonfinite_state(checkpoint: dict[str, Any]) -> list[str]:
    """The non-finite tensors among a Lightning checkpoint's parameters, buffers and optimizer state (other entries,
    e.g. ``ModelCheckpoint``'s ``kth_value=inf``, may be infinite by design)."""
    return nonfinite_tensors({k: checkpoint[k] for k in ("state_dict", "optimizer_states") if k in checkpoint})


def checkpoints(directory: Path) -> dict[str, dict[str, Any]]:
    return {p.name: torch.load(p, weights_only=False) for p in sorted(directory.glob("*.ckpt"))}


def events(root: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in root.rglob(EVENTS_FILENAME) for line in path.read_text().splitlines()]


class NormModule(MLPModule):
    """``MLPModule`` with a BatchNorm between its encoder and its head (running statistics in the checkpoint)."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__(optimizer=optimizer)
        self.norm = nn.BatchNorm1d(16)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.norm(self.encoder(x))))


def nan_parameter(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    module.head.weight.data.fill_(NAN)  # what an exploding update leaves


def inf_second_moment(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    trainer.optimizers[0].state[module.head.weight]["exp_avg_sq"][0, 0] = math.inf


def nan_running_var(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    module.norm.running_var[0] = NAN


class Inject(pl.Callback):
    """Makes the state non-finite after optimizer step ``BAD_STEP``, and saves by hand at every step (a save from a
    hook of the user's, beside ``ModelCheckpoint``'s)."""

    def __init__(self, fault: Callable[[pl.Trainer, pl.LightningModule], None] | None, manual: Path | None) -> None:
        self.fault, self.manual = fault, manual

    @torch.no_grad()
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.fault is not None and trainer.global_step == BAD_STEP:
            self.fault(trainer, pl_module)
        if self.manual is not None:
            trainer.save_checkpoint(self.manual / f"manual-{trainer.global_step}.ckpt")


def fit(
    root: Path,
    make: Callable[[], pl.LightningModule],
    *callbacks: pl.Callback,
    max_steps: int = 6,
    **checkpointing: Any,
) -> tuple[pl.Trainer, ModelCheckpoint]:
    torch.manual_seed(0)
    module = make()
    saver = ModelCheckpoint(dirpath=root / "ckpt", **{"every_n_train_steps": 1, "save_last": True, **checkpointing})
    trainer = make_trainer(
        root, callbacks=[*callbacks, saver], enable_checkpointing=True, max_steps=max_steps, log_every_n_steps=50
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "CheckpointGuard", UserWarning)  # asserted on its own below
        trainer.fit(module, loader())
    return trainer, saver


@pytest.mark.parametrize("save_top_k", [1, -1])
def test_no_checkpoint_holds_the_nan_parameters_and_last_ckpt_stays_the_step_before(
    tmp_path: Path, save_top_k: int
) -> None:
    (tmp_path / "manual").mkdir()
    guard = CheckpointGuard()
    trainer, saver = fit(
        tmp_path / "guarded", MLPModule, Inject(nan_parameter, tmp_path / "manual"), guard, save_top_k=save_top_k
    )
    written = checkpoints(tmp_path / "guarded" / "ckpt")
    for name, checkpoint in written.items():
        assert nonfinite_state(checkpoint) == [], name
        assert checkpoint["global_step"] < BAD_STEP, name
    kept = {f"epoch=0-step={s}.ckpt" for s in range(1 if save_top_k == -1 else BAD_STEP - 1, BAD_STEP)}
    assert set(written) == kept | {"last.ckpt"}  # with save_top_k=1 the step-2 file is kept, not replaced
    assert Path(saver.best_model_path).is_file() and Path(saver.last_model_path).is_file()
    # A save from the user's own hook is refused alike.
    assert sorted(p.name for p in (tmp_path / "manual").iterdir()) == [f"manual-{s}.ckpt" for s in range(1, BAD_STEP)]
    assert guard.refused == 6 - BAD_STEP + 1 and "save_checkpoint" not in vars(trainer)  # the wrapper came off

    # The reference: plain Lightning stopped at the last good step writes the same last.ckpt.
    _, _ = fit(tmp_path / "plain", MLPModule, max_steps=BAD_STEP - 1, save_top_k=save_top_k)
    expected = checkpoints(tmp_path / "plain" / "ckpt")["last.ckpt"]
    for key in ("state_dict", "optimizer_states", "global_step", "epoch"):
        assert_same_state(written["last.ckpt"][key], expected[key], key)
    # Without the guard the same run's last.ckpt is the NaN one (what the guard prevents).
    fit(tmp_path / "unguarded", MLPModule, Inject(nan_parameter, None), save_top_k=save_top_k)
    assert nonfinite_state(checkpoints(tmp_path / "unguarded" / "ckpt")["last.ckpt"]) != []

    (event, *later) = [e for e in events(tmp_path / "guarded") if e["what"] == "checkpoint_refused"]
    assert event["step"] == BAD_STEP and event["values"]["parameters"] == ["head.weight"]
    assert [e["step"] for e in later] == list(range(BAD_STEP + 1, 7))


@pytest.mark.parametrize(
    ("fault", "kind", "name"),
    [
        (inf_second_moment, "optimizer_state", "head.weight.exp_avg_sq"),
        (nan_running_var, "buffers", "norm.running_var"),
    ],
)
def test_a_nonfinite_optimizer_state_or_buffer_alone_is_refused(
    tmp_path: Path, fault: Callable[..., None], kind: str, name: str
) -> None:
    module = NormModule(optimizer="adam")
    with pytest.warns(UserWarning, match=rf"CheckpointGuard: the checkpoint of step {BAD_STEP} .*`{name}`") as caught:
        trainer = make_trainer(
            tmp_path,
            callbacks=[Inject(fault, None), CheckpointGuard(), ModelCheckpoint(tmp_path / "ckpt", save_last=True,
                                                                               every_n_train_steps=1)],
            enable_checkpointing=True,
            max_steps=BAD_STEP,
        )  # fmt: skip
        trainer.fit(module, loader())
    (warning,) = [w for w in caught if "CheckpointGuard" in str(w.message)]
    assert warning.filename == __file__  # at the user's `trainer.fit` line
    # The parameters stayed finite (the reference: torch.isfinite); only the injected tensor is not.
    assert all(torch.isfinite(p).all() for p in module.parameters())
    written = checkpoints(tmp_path / "ckpt")
    assert written["last.ckpt"]["global_step"] == BAD_STEP - 1 and f"epoch=0-step={BAD_STEP}.ckpt" not in written
    assert all(nonfinite_state(c) == [] for c in written.values())
    (event,) = [e for e in events(tmp_path) if e["what"] == "checkpoint_refused"]
    assert event["values"] == {"parameters": [], "buffers": [], "optimizer_state": [], kind: [name]}


def test_a_healthy_run_writes_the_files_of_plain_lightning_with_one_host_read_per_saving_step(tmp_path: Path) -> None:
    runs = {}
    for name, callbacks in (("plain", []), ("guarded", [CheckpointGuard()])):
        with count_syncs() as counter, counter.active():
            fit(tmp_path / name, lambda: NormModule(optimizer="adam"), *callbacks, every_n_train_steps=2, save_top_k=-1)
        runs[name] = (checkpoints(tmp_path / name / "ckpt"), counter.total)
    (plain, plain_syncs), (guarded, guarded_syncs) = runs["plain"], runs["guarded"]
    assert sorted(guarded) == sorted(plain) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt",
                                                "last.ckpt"]  # fmt: skip
    for file, checkpoint in guarded.items():
        assert checkpoint.keys() == plain[file].keys()
        for key in checkpoint.keys() - {"callbacks"}:  # the callbacks' entry holds each run's own directory
            assert_same_state(checkpoint[key], plain[file][key], f"{file}[{key}]")
    # Three steps saved (a top-k file and last.ckpt each): three reads, none at the three other steps.
    assert guarded_syncs - plain_syncs == 3
    assert events(tmp_path / "guarded") == []


def test_action_raise_stops_the_run_at_the_first_bad_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=rf"step {BAD_STEP} .*`head.weight`.*the run stops, nothing was written"):
        fit(tmp_path, MLPModule, Inject(nan_parameter, None), CheckpointGuard(action="raise"))
    assert {c["global_step"] for c in checkpoints(tmp_path / "ckpt").values()} == {BAD_STEP - 1}


def test_action_is_checked_at_construction() -> None:
    with pytest.raises(ValueError, match="action"):
        CheckpointGuard(action="quarantine")  # type: ignore[arg-type]


# -- the loop door ---------------------------------------------------------------------------------------------------
def hand_written_check(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[str]]:
    """The reference: ``torch.isfinite`` over each parameter, buffer and optimizer-state tensor, walked by hand."""
    names = {p: n for n, p in model.named_parameters()}
    return {
        "parameters": [n for n, p in model.named_parameters() if not torch.isfinite(p).all()],
        "buffers": [n for n, b in model.named_buffers() if b.is_floating_point() and not torch.isfinite(b).all()],
        "optimizer_state": [
            f"{names[p]}.{key}"
            for group in optimizer.param_groups
            for p in group["params"]
            for key, value in optimizer.state[p].items()
            if key != "step" and not torch.isfinite(value).all()
        ],
    }


def test_checkpoint_is_finite_names_what_a_hand_written_check_finds_with_one_host_read() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(6, 4)).sum().backward()
    optimizer.step()
    model[2].half()  # a low-precision parameter (the same object, the optimizer's key): 6e4 is finite there
    faults = [
        lambda: None,
        lambda: model[0].weight.data.fill_(3e38),  # finite, though its 2-norm would overflow
        lambda: model[2].weight.data.fill_(6e4),
        lambda: model[0].bias.data.__setitem__(1, NAN),
        lambda: model[1].running_mean.__setitem__(0, -math.inf),
        lambda: optimizer.state[model[3].weight]["exp_avg"].__setitem__((0, 0), NAN),
        lambda: optimizer.state[model[2].bias]["exp_avg_sq"].__setitem__(0, math.inf),
    ]
    for fault in faults:
        fault()
        with count_syncs() as counter, counter.active():
            check = checkpoint_is_finite(model, optimizer)
        assert counter.total == 1
        expected = hand_written_check(model, optimizer)
        assert check.as_event() == expected and bool(check) == (expected == {k: [] for k in expected})
    assert check.as_event() == {
        "parameters": ["0.bias"],
        "buffers": ["1.running_mean"],
        "optimizer_state": ["2.bias.exp_avg_sq", "3.weight.exp_avg"],  # in the optimizer's parameter order
    }


def test_the_loop_doors_check_warns_once_and_writes_each_refusal_as_an_event(tmp_path: Path) -> None:
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kit = GradKit(model, optimizer, [], log_dir=tmp_path)
    for _ in range(2):
        model(torch.ones(2, 3)).sum().backward()
        kit.step(optimizer)
    assert kit.checkpoint_is_finite()
    optimizer.state[model.weight]["momentum_buffer"][0, 1] = NAN
    with pytest.warns(UserWarning, match=r"GradKit: the checkpoint of step 2 .*`weight.momentum_buffer`") as caught:
        assert not kit.checkpoint_is_finite()
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second refusal is an event only
        assert kit.checkpoint_is_finite().optimizer_state == ("weight.momentum_buffer",)
    refused = [e for e in events(tmp_path) if e["what"] == "checkpoint_refused"]
    assert [(e["step"], e["culprit"], e["source"]) for e in refused] == [(2, "weight.momentum_buffer", "GradKit")] * 2
