"""The event log under faults: it never stops training, and it never lands in the working directory implicitly."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from gradkit.report.events import EVENTS_FILENAME
from helpers import loader, make_trainer
from lightning_gradkit import NonFiniteGuard
from test_guards import NAN, Fault, FaultModule, events, reference_params, state_equal


def _block_with_directory(path: Path) -> None:
    path.mkdir(parents=True)


def _block_with_full_disk(path: Path) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full (Linux) to simulate a full disk")
    path.parent.mkdir(parents=True)
    path.symlink_to("/dev/full")  # every write fails with ENOSPC, as on a full disk


def _block_with_a_file_as_parent(path: Path) -> None:
    path.parent.parent.mkdir(parents=True, exist_ok=True)
    path.parent.write_text("a file where the run directory should be")


@pytest.mark.parametrize(
    "block",
    [_block_with_directory, _block_with_full_disk, _block_with_a_file_as_parent],
    ids=["path_is_a_directory", "disk_full", "parent_is_a_file"],
)
def test_unwritable_event_log_warns_once_and_the_bad_step_is_still_skipped(tmp_path: Path, block) -> None:
    root = tmp_path / "run"
    block(root / EVENTS_FILENAME)
    torch.manual_seed(0)
    model = FaultModule(Fault("loss", NAN, batch_idx=2))
    guard = NonFiniteGuard(action="skip")
    trainer = make_trainer(tmp_path, logger=False, default_root_dir=root, strategy="gradkit", callbacks=[guard])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader())
    assert trainer.global_step == 8  # the run finished
    assert state_equal(model.snapshots[2], model.snapshots[3])  # the bad step was skipped, not turned into a crash
    expected = reference_params(skip={2})  # plain Adam that never saw batch 2
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=0, msg=name)
    failed = [str(w.message) for w in caught if "could not write an event" in str(w.message)]
    assert len(failed) == 1 and str(root / EVENTS_FILENAME) in failed[0]
    # The guard's own warning still names the step.
    assert any("NonFiniteGuard" in str(w.message) and "step 2" in str(w.message) for w in caught)


def test_without_a_logger_events_go_to_lightning_logs_not_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    guard = NonFiniteGuard(action="skip")
    trainer = make_trainer(tmp_path, logger=False, strategy="gradkit", callbacks=[guard])
    with pytest.warns(UserWarning, match="NonFiniteGuard"):
        trainer.fit(FaultModule(Fault("loss", NAN, batch_idx=2)), loader())
    assert Path(trainer.default_root_dir) == Path(os.getcwd())  # Lightning's fallback: the working directory
    assert not (tmp_path / EVENTS_FILENAME).exists()
    expected = tmp_path / "lightning_logs" / EVENTS_FILENAME
    assert guard.events_path is not None and guard.events_path.resolve() == expected.resolve()
    (event,) = events(expected.parent)
    assert event["step"] == 2 and event["what"] == "nonfinite_loss_and_grads"


def test_an_explicit_default_root_dir_holds_the_events_without_a_logger(tmp_path: Path) -> None:
    torch.manual_seed(0)
    root = tmp_path / "run"
    trainer = make_trainer(
        tmp_path, logger=False, default_root_dir=root, strategy="gradkit", callbacks=[NonFiniteGuard()]
    )
    with pytest.warns(UserWarning, match="NonFiniteGuard"):
        trainer.fit(FaultModule(Fault("loss", NAN, batch_idx=2)), loader())
    (event,) = events(root)
    assert event["step"] == 2
