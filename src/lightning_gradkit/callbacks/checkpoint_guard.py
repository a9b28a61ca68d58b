"""The Trainer's checkpoint gate: a checkpoint of non-finite state is never written, nor replaces a good one."""

from __future__ import annotations

from typing import Any, Literal, get_args

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from gradkit._util.arguments import check_choice
from gradkit._util.user_frame import warn_user
from gradkit.report.events import EventLog
from gradkit.step.state_check import CHECKPOINT_REFUSED, FiniteCheck, checkpoint_is_finite, refusal_message
from lightning_gradkit.trainer_door import events_dir, instance_hook

__all__ = ["CheckpointAction", "CheckpointGuard"]

CheckpointAction = Literal["skip", "raise"]

# `ModelCheckpoint`'s save entry points in Lightning 2.6.6: the top-k file and `last.ckpt` (each with the bookkeeping
# around it: `best_model_path`, `last_model_path`, the removal of the file it replaces), and the bare save that
# `on_exception` calls. Gating the first two whole leaves the records and the previous files as they were.
_MODEL_CHECKPOINT_SAVES = ("_save_topk_checkpoint", "_save_last_checkpoint", "_save_checkpoint")


class CheckpointGuard(pl.Callback):
    r"""Never write a checkpoint that holds a non-finite parameter, optimizer state or buffer, and never let one
    replace the last good checkpoint.

    Before each checkpoint the Trainer saves during ``fit`` (each ``ModelCheckpoint``'s top-k file and ``last.ckpt``,
    its ``save_on_exception`` file, and ``trainer.save_checkpoint`` called from a hook or another callback), the
    guard checks the LightningModule's parameters and buffers and every optimizer's state with
    :func:`gradkit.checkpoint_is_finite`: one pass on the device (an inf-norm per tensor, so a finite 3e38 is finite),
    one host read per step that saves (a top-k file and ``last.ckpt`` at one step: one read), none at the other
    steps. Under DDP, FSDP and FSDP2 the flags of all ranks travel in one all-reduce, so every rank takes the same
    decision; a DTensor is read through its local shard.

    When something is non-finite the checkpoint is not written and ``ModelCheckpoint`` records nothing:
    ``last.ckpt`` and the top-k files stay those of the last good step (with ``save_top_k=1`` the previous file is
    kept, not replaced), ``best_model_path`` and ``last_model_path`` name files that exist, and the next due save is
    tried again. The first refusal warns, naming the step, the non-finite tensors (module parameter, buffer,
    optimizer state key) and the newest good checkpoint; every refusal is a ``checkpoint_refused`` event in
    ``gradkit_events.jsonl`` (the logger's directory) with all the names. ``action="raise"`` stops the run there
    instead. The optimizer state is checked for a weights-only checkpoint too (non-finite moments make the next
    step's parameters non-finite); the optimizers' ``step`` counts, the LR schedulers and other callbacks' state are
    not read.

    A callback cannot cancel a save (``on_save_checkpoint`` runs while the checkpoint is written), so at ``setup`` of
    ``fit`` the guard wraps, on this Trainer's instances only, each ``ModelCheckpoint``'s save methods and
    ``trainer.save_checkpoint``; ``teardown`` takes the wrappers off (read in Lightning 2.6.6). Any strategy works;
    the guard does not need a GradKit strategy.

    Args:
        action: ``"skip"`` to leave a checkpoint of non-finite state unwritten and train on (a later save, e.g. after
            a ``SpikeRollback``, is written again), ``"raise"`` to stop the run at the first one.

    Raises:
        ValueError: at construction, if ``action`` is unknown.
        RuntimeError: with ``action="raise"``, at the first checkpoint of non-finite state (nothing is written).

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning.pytorch.callbacks import ModelCheckpoint
        >>> from lightning_gradkit import CheckpointGuard
        >>> checkpoints = ModelCheckpoint(every_n_train_steps=500, save_last=True)
        >>> trainer = Trainer(callbacks=[checkpoints, CheckpointGuard()])
    """

    def __init__(self, action: CheckpointAction = "skip") -> None:
        self.action = check_choice(
            "action",
            action,
            get_args(CheckpointAction),
            hint="'skip' leaves the checkpoint unwritten and trains on, 'raise' stops the run.",
        )
        self.refused = 0  #: checkpoints refused in the current (or last) fit
        self._wrapped: list[_Gated] = []
        self._verdict: tuple[int, FiniteCheck] | None = None
        self._events: EventLog | None = None

    @instance_hook  # `callbacks=[CheckpointGuard]`, the class, is refused with the fix
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._unwrap()  # a fit that raised left them on (Lightning calls no `teardown` after an exception)
        if stage != "fit":
            return
        self._events = EventLog(events_dir(trainer), rank=trainer.global_rank)  # on every rank: a broadcast
        self._verdict, self.refused = None, 0
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint):
                self._wrapped += [_Gated(self, trainer, callback, name) for name in _MODEL_CHECKPOINT_SAVES]
        self._wrapped.append(_Gated(self, trainer, trainer, "save_checkpoint"))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._unwrap()

    def _unwrap(self) -> None:
        for gated in reversed(self._wrapped):
            gated.remove()
        self._wrapped = []

    def allows(self, trainer: pl.Trainer, target: str) -> bool:
        """Whether the training state is finite at this step: checked at the step's first save, then remembered (the
        state does not change between the saves of one step)."""
        step = trainer.global_step
        if self._verdict is None or self._verdict[0] != step:
            check = checkpoint_is_finite(trainer.lightning_module, trainer.optimizers)
            self._verdict = (step, check)
            if not check:
                self._refuse(trainer, check, target)
        return self._verdict[1].finite

    def _refuse(self, trainer: pl.Trainer, check: FiniteCheck, target: str) -> None:
        self.refused += 1
        step = trainer.global_step
        if self._events is not None:
            self._events.write(
                step=step,
                batch_idx=trainer.fit_loop.epoch_loop.batch_idx,
                rank=None,  # the flags of every rank, combined
                what=CHECKPOINT_REFUSED,
                culprit=check.first(),
                values=check.as_event(),
                source=type(self).__name__,
                action=self.action,
                target=target,
            )
        events = self._events.path if self._events is not None else None
        if self.action == "raise":
            stops = "the run stops, nothing was written"
            raise RuntimeError(refusal_message("CheckpointGuard", check, step, stops, events))
        if self.refused == 1 and trainer.is_global_zero:
            warn_user(refusal_message("CheckpointGuard", check, step, _kept(trainer), events))  # at `trainer.fit`


def _kept(trainer: pl.Trainer) -> str:
    """What the warning says was done: nothing written, and the newest good checkpoint."""
    kept = [
        path
        for callback in trainer.checkpoint_callbacks
        if isinstance(callback, ModelCheckpoint)
        for path in (callback.last_model_path, callback.best_model_path)
        if path
    ]
    where = f"the newest good checkpoint stays {kept[0]}" if kept else "no good checkpoint was written before"
    return f"it was not written, {where} (later refusals are in the events file only)"


class _Gated:
    """One save method of one object (a ``ModelCheckpoint``, the ``Trainer``), replaced on the instance by a call
    that goes through only when the training state is finite. Holds the method's name, not the bound method: a
    pickled owner then finds its class's method again (a bound method would be looked up on the instance: this)."""

    def __init__(self, guard: CheckpointGuard, trainer: pl.Trainer, owner: object, name: str) -> None:
        self.guard, self.trainer, self.owner, self.name = guard, trainer, owner, name
        self.replaced = vars(owner).get(name)  # an instance attribute of someone else's, put back by `remove`
        setattr(owner, name, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.guard.allows(self.trainer, self._target(args, kwargs)):
            return None
        method = self.replaced if self.replaced is not None else getattr(type(self.owner), self.name)
        return method(*args, **kwargs) if self.replaced is not None else method(self.owner, *args, **kwargs)

    def _target(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The file (``trainer.save_checkpoint``) or the directory (a ``ModelCheckpoint``) the save was for."""
        if self.owner is self.trainer:
            return str(args[0] if args else kwargs.get("filepath"))
        return str(getattr(self.owner, "dirpath", None))

    def remove(self) -> None:
        if vars(self.owner).get(self.name) is not self:
            return  # replaced since by someone else: theirs stays
        if self.replaced is None:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.replaced)
