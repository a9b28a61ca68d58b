"""Checkpoints saved inside a gradient-accumulation window (automatic optimization).

Lightning saves a checkpoint wherever it is asked to (``ModelCheckpoint`` after a validation run that
``val_check_interval`` places mid-window, ``trainer.save_checkpoint`` from any hook), but never the gradients
accumulated so far: on resume it continues with the next micro-batch (the loops' batch progress is restored) and
``zero_grad`` only runs at a window start, so the resumed window steps with its remaining micro-batches only and the
run silently diverges from an uninterrupted one. :class:`~lightning_gradkit.AccumulationGuard` saves and restores
the open window; otherwise the first gradkit callback of the Trainer warns, at save time and at resume, naming the
window position.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

__all__ = ["WindowPosition", "note_window_on_load", "note_window_on_save", "open_window"]


#: Key, in a Lightning checkpoint, of the open window: its position and, when it can be resumed exactly, the state
#: ``AccumulationGuard`` needs for that (the gradients and counts accumulated so far).
_CHECKPOINT_KEY = "gradkit_accumulation_window"


@dataclass(frozen=True)
class WindowPosition:
    """Where training stands inside an accumulation window: ``micro_batch`` backwards have run in it (``1 <=
    micro_batch < window``, ``accumulate_grad_batches``), before optimizer step ``step`` (``trainer.global_step``)."""

    micro_batch: int
    window: int
    step: int

    def describe(self) -> str:
        return f"after micro-batch {self.micro_batch} of {self.window}, before optimizer step {self.step}"


def open_window(trainer: pl.Trainer) -> WindowPosition | None:
    """The accumulation window whose gradients are not stepped yet, or ``None`` at a window boundary.

    Counts the batches whose training step has run in this epoch (Lightning's ``batch_progress.current.processed``):
    Lightning zeroes the gradients at every ``batch_idx`` that is a multiple of N and steps after the last batch of
    a window or of the epoch.
    """
    module = trainer.lightning_module if trainer.state.fn == TrainerFn.FITTING else None
    window = trainer.accumulate_grad_batches
    if module is None or not module.automatic_optimization or window <= 1:
        return None
    progress = trainer.fit_loop.epoch_loop.batch_progress
    processed = progress.current.processed
    micro_batch = processed % window
    if micro_batch == 0 or processed >= trainer.num_training_batches or progress.is_last_batch:
        return None
    return WindowPosition(micro_batch, window, trainer.global_step)


def _window_keeper(trainer: pl.Trainer) -> Any:
    """The callback that saves and restores open windows (``AccumulationGuard``), if attached."""
    return next((cb for cb in trainer.callbacks if getattr(cb, "_restores_open_window", False)), None)


def note_window_on_save(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
    """Save the open window's position (and, with ``AccumulationGuard`` on a single process, its state) in
    ``checkpoint``; warn when the window cannot be resumed exactly."""
    position = open_window(trainer)
    if position is None:
        return
    keeper = _window_keeper(trainer)
    state = keeper._open_window_state(position) if keeper is not None and trainer.world_size == 1 else None
    checkpoint[_CHECKPOINT_KEY] = {**asdict(position), "state": state}
    if state is not None:
        return
    fix = (
        "`AccumulationGuard` restores such windows on a single process only (each rank holds its own partial sum)."
        if keeper is not None
        else "Add `AccumulationGuard()` to the callbacks to save and restore the window exactly (single process)."
    )
    rank_zero_warn(
        f"gradkit: this checkpoint is saved inside a gradient-accumulation window ({position.describe()}). "
        f"Lightning does not save the gradients of the {position.micro_batch} micro-batch(es) accumulated so far, so "
        f"a run resumed from it takes optimizer step {position.step} with the remaining "
        f"{position.window - position.micro_batch} only and differs from an uninterrupted run. {fix} Or save at "
        "window boundaries (e.g. a `val_check_interval` that is a multiple of `accumulate_grad_batches`)."
    )


def note_window_on_load(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
    """Hand a saved window to ``AccumulationGuard``; warn when none was saved or no guard can restore it."""
    saved = checkpoint.get(_CHECKPOINT_KEY)
    if not saved:
        return
    keeper = _window_keeper(trainer)
    if saved["state"] is not None and keeper is not None:
        keeper._resume_window(saved["state"])  # restored before the next backward, or it says why it cannot
        return
    position = WindowPosition(saved["micro_batch"], saved["window"], saved["step"])
    rank_zero_warn(
        f"gradkit: resuming from a checkpoint saved inside a gradient-accumulation window ({position.describe()}) "
        f"whose gradients are not in it: optimizer step {position.step} will use only the micro-batches after the "
        "checkpoint, so this run differs from an uninterrupted one. Save with `AccumulationGuard()` among the "
        "callbacks to resume such checkpoints exactly."
    )
