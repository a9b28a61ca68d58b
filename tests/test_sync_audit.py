"""SyncAudit with Lightning's real Trainer: the user's syncing lines, found and counted per audited step."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn

from helpers import MLPModule, loader, make_trainer
from lightning_gradkit import NonFiniteGuard, SyncAudit
from lightning_gradkit.diagnostics.host_sync import HostSyncRecorder
from lightning_gradkit.diagnostics.sources import LIBRARY, USER, SourceClassifier

THIS_FILE = os.path.realpath(__file__)


def line_of(function: object, text: str) -> int:
    """The line number of the (single) source line of ``function`` containing ``text``."""
    lines, start = inspect.getsourcelines(function)
    hits = [start + i for i, line in enumerate(lines) if text in line and "line_of(" not in line]
    assert len(hits) == 1, (text, hits)
    return hits[0]


def function_stack_depth() -> int:
    return torch._C._len_torch_function_stack()


class SyncingModule(MLPModule):
    """Makes exactly two host syncs per step in ``training_step``: one ``.item()``, one ``bool(tensor)``."""

    def __init__(self) -> None:
        super().__init__()
        self.values: list[float] = []
        self.depth_per_step: list[int] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        self.depth_per_step.append(function_stack_depth())
        loss = nn.functional.mse_loss(self(x), y)
        self.values.append(loss.item())
        if bool(torch.isnan(x).any()):
            raise AssertionError("the data has no NaN")
        return loss


def test_reports_item_and_bool_lines_two_syncs_per_step(tmp_path: Path) -> None:
    audit = SyncAudit(every_n_steps=2)
    trainer = make_trainer(tmp_path, callbacks=[audit])
    with pytest.warns(UserWarning, match="2.00 host-device syncs per step"):
        trainer.fit(SyncingModule(), loader())  # 8 batches: batches 1, 3, 5, 7 are audited

    item_line = line_of(SyncingModule.training_step, "loss.item()")
    bool_line = line_of(SyncingModule.training_step, "bool(torch.isnan(x).any())")
    rows = sorted(audit.report, key=lambda r: r.lineno)
    assert [(os.path.realpath(r.filename), r.lineno) for r in rows] == [(THIS_FILE, item_line), (THIS_FILE, bool_line)]
    assert [r.kinds for r in rows] == [{"item": 4}, {"bool": 4}]
    assert [r.per_step for r in rows] == [1.0, 1.0]
    assert rows[0].code == "self.values.append(loss.item())"
    assert all(r.function == "training_step" and r.share is None for r in rows)  # no stall to measure on a CPU
    assert audit.step_counts == [2, 2, 2, 2]
    assert audit.method == "intercepted_calls"


class LoggingModule(MLPModule):
    """No sync of its own: ``self.log`` keeps the tensor; Lightning reads it for the progress bar."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, prog_bar=True)
        return loss


def test_clean_module_reports_zero_and_lightning_syncs_apart(tmp_path: Path) -> None:
    audit = SyncAudit(every_n_steps=1)
    trainer = make_trainer(tmp_path, callbacks=[audit], enable_progress_bar=True)
    trainer.fit(LoggingModule(), loader(n=32))
    assert audit.report == []
    assert audit.step_counts == [0, 0, 0, 0]
    assert not (Path(trainer.log_dir) / "gradkit_events.jsonl").exists()  # nothing of the user's to report
    # Lightning's progress bar reads the loss on every step: counted, but as Lightning's own sync.
    lightning_dir = os.path.dirname(os.path.realpath(__import__("lightning").__file__))
    assert audit.framework_report
    assert all(os.path.realpath(r.filename).startswith(lightning_dir) for r in audit.framework_report)


def test_unaudited_steps_run_without_interception_and_nothing_stays_installed(tmp_path: Path) -> None:
    audit = SyncAudit(every_n_steps=3)
    model = SyncingModule()
    trainer = make_trainer(tmp_path, callbacks=[audit])
    with pytest.warns(UserWarning, match="host-device syncs per step"):
        trainer.fit(model, loader())
    assert model.depth_per_step == [0, 0, 1, 0, 0, 1, 0, 0]  # the mode is active in batches 2 and 5 only
    assert audit.step_counts == [2, 2]
    assert function_stack_depth() == 0


class HookSyncModule(MLPModule):
    def on_train_batch_end(self, outputs: dict[str, Tensor], batch: object, batch_idx: int) -> None:
        self.last = float(outputs["loss"])


def test_gradkits_own_syncs_are_the_frameworks_not_the_users(tmp_path: Path) -> None:
    """The gate reads the skip flag on the host (an ordinary optimizer) and the monitor's values on logging steps:
    gradkit's own syncs, counted apart from the user's, as Lightning's are; a clean module is reported clean."""
    audit = SyncAudit(every_n_steps=1)
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[audit, NonFiniteGuard(action="skip")])
    trainer.fit(MLPModule(), loader(n=32))
    assert audit.report == [] and audit.step_counts == [0, 0, 0, 0]
    gradkit_dir = os.path.dirname(os.path.realpath(__import__("gradkit").__file__))
    assert audit.framework_report
    assert all(os.path.realpath(r.filename).startswith(gradkit_dir) for r in audit.framework_report)


def test_lightning_module_batch_end_hook_is_audited_then_restored(tmp_path: Path) -> None:
    audit = SyncAudit(every_n_steps=2)
    model = HookSyncModule()
    trainer = make_trainer(tmp_path, callbacks=[audit])
    with pytest.warns(UserWarning, match="1.00 host-device syncs per step"):
        trainer.fit(model, loader(n=32))
    [row] = audit.report
    assert row.lineno == line_of(HookSyncModule.on_train_batch_end, "float(outputs")
    assert row.kinds == {"float": 2}
    assert "on_train_batch_end" not in vars(model)  # the recording wrapper is gone
    assert function_stack_depth() == 0


class NormCheckModule(MLPModule):
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in self.parameters()]
        self.norm = torch.nn.utils.get_total_norm(grads, error_if_nonfinite=True)


def test_sync_inside_pytorch_is_charged_to_the_calling_line(tmp_path: Path) -> None:
    # get_total_norm(error_if_nonfinite=True) branches on a tensor inside torch/nn/utils/clip_grad.py.
    audit = SyncAudit(every_n_steps=1)
    trainer = make_trainer(tmp_path, callbacks=[audit])
    with pytest.warns(UserWarning, match="1.00 host-device syncs per step"):
        trainer.fit(NormCheckModule(), loader(n=16))
    [row] = audit.report
    assert (os.path.realpath(row.filename), row.lineno) == (
        THIS_FILE,
        line_of(NormCheckModule.on_before_optimizer_step, "get_total_norm"),
    )
    assert row.kinds == {"bool": 2}


def test_raise_mode_fails_the_step_over_budget_and_restores(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[SyncAudit(every_n_steps=2, mode="raise", max_syncs_per_step=2)])
    with pytest.warns(UserWarning, match=r"your code makes 2\.00 host-device syncs per step"):  # the report
        trainer.fit(SyncingModule(), loader(n=32))  # 2 syncs per step: within budget

    model = SyncingModule()
    audit = SyncAudit(every_n_steps=2, mode="raise", max_syncs_per_step=1)
    trainer = make_trainer(tmp_path, callbacks=[audit])
    with pytest.raises(RuntimeError, match=r"made 2 host-device syncs.*max_syncs_per_step=1") as info:
        trainer.fit(model, loader(n=32))
    assert "loss.item()" in str(info.value)
    assert len(model.values) == 2  # stopped at the first audited step (batch 1)
    assert function_stack_depth() == 0


class FailingModule(SyncingModule):
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if batch_idx == 1:
            raise ValueError("boom")
        return super().training_step(batch, batch_idx)


def test_exception_inside_audited_step_uninstalls_the_interceptor(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[SyncAudit(every_n_steps=2)])
    with pytest.raises(ValueError, match="boom"):
        trainer.fit(FailingModule(), loader(n=32))
    assert function_stack_depth() == 0


class StopEarlyModule(SyncingModule):
    def on_train_batch_start(self, batch: object, batch_idx: int) -> int | None:
        return -1 if batch_idx == 3 else None  # Lightning then ends the epoch without `on_train_batch_end`


def test_batch_skipped_by_on_train_batch_start_leaves_nothing_installed(tmp_path: Path) -> None:
    audit = SyncAudit(every_n_steps=2)
    model = StopEarlyModule()
    trainer = make_trainer(tmp_path, callbacks=[audit], max_epochs=2, limit_val_batches=0)
    with pytest.warns(UserWarning):
        trainer.fit(model, loader(n=48))  # 6 batches per epoch; each epoch stops at its batch 3
    assert model.depth_per_step == [0, 1, 0, 0, 1, 0]  # batches 1 and 5 (the 2nd epoch's batch 1) audited
    assert audit.step_counts == [2, 2]
    assert function_stack_depth() == 0


def test_events_are_written_per_audited_step(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[SyncAudit(every_n_steps=4)])
    with pytest.warns(UserWarning):
        trainer.fit(SyncingModule(), loader())
    events = [json.loads(line) for line in (Path(trainer.log_dir) / "gradkit_events.jsonl").read_text().splitlines()]
    assert [(e["what"], e["step"], e["batch_idx"], e["rank"], e["syncs"]) for e in events] == [
        ("host_sync", 4, 3, 0, 2),
        ("host_sync", 8, 7, 0, 2),
    ]
    assert sorted(s["line"] for s in events[0]["sites"]) == [
        line_of(SyncingModule.training_step, "loss.item()"),
        line_of(SyncingModule.training_step, "bool(torch.isnan"),
    ]


def test_resumed_run_reports_as_uninterrupted(tmp_path: Path) -> None:
    full = SyncAudit(every_n_steps=2)
    with pytest.warns(UserWarning):
        make_trainer(tmp_path / "full", callbacks=[full]).fit(SyncingModule(), loader())

    # ModelCheckpoint saves after batch 3, inside an audited step (Lightning runs it in on_train_batch_end).
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    trainer = make_trainer(
        tmp_path / "a", callbacks=[SyncAudit(every_n_steps=2), saver], max_steps=4, enable_checkpointing=True
    )
    with pytest.warns(UserWarning):
        trainer.fit(SyncingModule(), loader())
    resumed = SyncAudit(every_n_steps=2)
    model = SyncingModule()
    trainer = make_trainer(tmp_path / "b", callbacks=[resumed])
    with pytest.warns(UserWarning, match=r"audited step 5, .* 2\.00 host-device syncs per step"):
        trainer.fit(model, loader(), ckpt_path=tmp_path / "ckpt" / "epoch=0-step=4.ckpt")
    assert len(model.values) == 4  # batches 4..7 ran after the resume
    assert resumed.step_counts == full.step_counts == [2, 2, 2, 2]
    assert [(r.lineno, r.syncs, r.steps) for r in resumed.report] == [(r.lineno, r.syncs, r.steps) for r in full.report]


def test_no_audited_step_is_reported(tmp_path: Path) -> None:
    audit = SyncAudit(every_n_steps=100)
    trainer = make_trainer(tmp_path, callbacks=[audit])
    with pytest.warns(UserWarning, match="audited no training step"):
        trainer.fit(SyncingModule(), loader(n=16))
    assert audit.step_counts == []


def test_recorder_counts_pytorch_functions_and_outermost_calls_only() -> None:
    recorder = HostSyncRecorder(SourceClassifier())
    x = torch.tensor([1.0, -2.0, 3.0])
    recorder.start()
    torch.nonzero(x)  # a function, not a method
    x[x > 0]  # boolean-mask indexing
    repr(x)  # one call, however many reads torch._tensor_str makes inside
    x.to("cpu")
    x.to(torch.float64)  # not a sync
    x.sum() * 2  # not a sync
    step = recorder.stop()
    assert function_stack_depth() == 0
    kinds = {k[1]: dict(t.kinds) for k, t in step.user.items()}
    start = line_of(test_recorder_counts_pytorch_functions_and_outermost_calls_only, "torch.nonzero(x)")
    assert kinds == {start: {"nonzero": 1}, start + 1: {"mask_index": 1}, start + 2: {"repr": 1}, start + 3: {"cpu": 1}}


def test_skip_packages_makes_a_package_library_code() -> None:
    import helpers

    assert SourceClassifier().category(helpers.__file__) == USER
    assert SourceClassifier(["helpers"]).category(helpers.__file__) == LIBRARY
    assert SourceClassifier().category(torch.__file__) == LIBRARY


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"every_n_steps": -3}, "every_n_steps"),
        ({"every_n_steps": 1.5}, "every_n_steps"),
        ({"top_k": 0}, "top_k"),
        ({"mode": "error"}, "mode"),
        ({"max_syncs_per_step": -1}, "max_syncs_per_step"),
        ({"mode": "raise"}, "max_syncs_per_step"),
        ({"skip_packages": ["no_such_package_xyz"]}, "skip_packages"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SyncAudit(**kwargs)  # type: ignore[arg-type]


@pytest.mark.gpu
def test_cuda_path_counts_real_syncs_with_stall_share(tmp_path: Path) -> None:
    audit = SyncAudit(every_n_steps=2)
    trainer = make_trainer(tmp_path, callbacks=[audit], accelerator="cuda")
    with pytest.warns(UserWarning, match="2.00 host-device syncs per step"):
        trainer.fit(SyncingModule(), loader())
    assert audit.method == "cuda_sync_debug"
    rows = sorted(audit.report, key=lambda r: r.lineno)
    assert [r.lineno for r in rows] == [
        line_of(SyncingModule.training_step, "loss.item()"),
        line_of(SyncingModule.training_step, "bool(torch.isnan(x).any())"),
    ]
    assert [r.kinds for r in rows] == [{"item": 4}, {"bool": 4}]
    assert audit.step_counts == [2, 2, 2, 2]
    for row in rows:
        assert row.stall_seconds is not None and row.stall_seconds > 0
        assert row.share is not None and 0 < row.share < 1
    assert torch.cuda.get_sync_debug_mode() == 0  # restored
