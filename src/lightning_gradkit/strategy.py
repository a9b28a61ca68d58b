"""The strategy mixin: step the optimizer, or do not, as the step's policies decided.

A Lightning callback cannot cancel an optimizer step: ``on_before_optimizer_step`` runs inside
``Strategy.optimizer_step`` and whatever it does, the precision plugin calls ``optimizer.step`` (or
``GradScaler.step``) afterwards. :class:`GradKitStrategyMixin` owns that one decision. For the duration of
``optimizer_step`` it shadows ``optimizer.step`` with a gate; every precision plugin ends in that gate:

- ``32-true``, ``bf16-mixed`` (``Precision``): ``optimizer.step(closure)``; the gate runs the closure (training
  step, backward, then the callbacks' ``on_before_optimizer_step``, where the gradkit pipeline decides), then steps
  the optimizer or not.
- ``16-mixed`` (``MixedPrecision`` with a ``GradScaler``): closure, ``unscale_``, hooks, ``scaler.step(optimizer)``
  which calls ``optimizer.step()`` (the gate) unless the scaler found an overflow itself, then ``scaler.update()``.

The gate reads the pipeline's decision ``Decision.skip`` (a device flag, identical on every rank because it is
derived from all-reduced gradients and from per-rank flags summed in the pipeline's one collective), and only the
record of the current step's gradients (``TrainerPipeline.step_record``): whoever ran the pipeline first for them
(``on_before_optimizer_step``, or ``clip_gradients`` in manual optimization), never a record of an earlier step.

- ordinary optimizer: one host read of the flag, the only synchronization the design allows; on a skip the
  optimizer is not called (parameters and state bitwise unchanged) and the gradients are set to ``None``.
- fused optimizer (``Adam/AdamW/SGD/Adagrad(fused=True)``): the flag is passed as the optimizer's ``found_inf``
  (combined with the ``GradScaler``'s), the fused kernel skips the update on device: no host synchronization.
  Its gradients are left for Lightning's next ``zero_grad``.

``optimizer.step`` returns what the optimizer returned (on a skipped step, which never calls it: the result of the
closure, what PyTorch's optimizers return).

Optimizers that evaluate the closure several times per step (``LBFGS``, SAM, line searches): the skip is decided
on the first evaluation, which the gate runs before calling the optimizer; later evaluations are scaled and clipped,
never decided. :mod:`gradkit.step.closure` holds the rule and both halves of its code.

Step-interval LR schedulers follow the applied steps. Lightning steps one with ``frequency=f`` after an optimizer
step when ``batch_idx + 1`` (batches of the epoch so far) is a multiple of ``f``. Under the gate the batches of
skipped steps are left out of that count: the scheduler steps after an applied step when the epoch's batches in
applied steps are a multiple of ``f``, and never after a skipped step. Without accumulation that is once per ``f``
applied optimizer steps (counted within the epoch, as Lightning's count restarts each epoch); with nothing
skipped, exactly Lightning's schedule. For this the gate has Lightning call the (gated) ``lr_scheduler_step`` after
every optimizer step (the configs' ``frequency`` reads 1 while fitting; restored at teardown), and the counts are
saved in checkpoints (key ``"gradkit_lr_schedule"``) so a resumed run steps its schedulers where an uninterrupted
one does. They are part of a step's state (``gradkit_state_dict``): a rollback rewinds them with the rest, and the
rewound steps no longer count as applied. With a fused optimizer the skip flag is read on the host when its
scheduler is about to step, after the optimizer step has been queued. ``trainer.global_step`` counts *attempted*
optimizer steps, as Lightning does when the ``GradScaler`` skips one: ``max_steps``, logging and checkpoint periods
keep following batches, while ``gradkit/skipped_steps`` counts the steps a gradkit policy skipped, and after a
rollback the rewound ones too (applied steps = ``global_step - skipped_steps``, less the ``GradScaler``'s own overflow
skips under ``16-mixed``: those are the scaler's, counted by no gradkit door, as a ``Trainer``, Fabric or plain loop
without gradkit would have them).

Map of this file, in order: which Trainers need the gate (``_any_policy_may_skip``) and the strategy to name in
errors (:func:`gradkit_strategy_hint`); the LR-schedule counts (``_ScheduleCount``) and the stand-in for
``lr_scheduler_step`` (``_SchedulerGate``); :class:`GradKitStrategyMixin`: its Lightning hooks, the gate (its
rule is :func:`~gradkit.step.gate.step_as_decided`), the LR schedulers and its part of a step's state; the
four GradKit strategies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import (
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch.optim import Optimizer

from gradkit._util.torch_compat import handles_found_inf
from gradkit.doors.distributed_checkpoint import (
    RANK_LOCAL_FOLDER,
    load_rank_local,
    merge_rank_local,
    save_rank_local,
    split_rank_local,
)
from gradkit.step.closure import first_evaluation
from gradkit.step.gate import close_step, shadowed, step_as_decided
from gradkit.step.pipeline import StepRecord
from gradkit.step.protocol import Roster
from gradkit.step.replay import replaying
from gradkit.step.snapshot import Snapshot
from lightning_gradkit._compat import ddp_start_method, register_strategy_names, set_root_device
from lightning_gradkit._deepspeed import (
    SKIPPING_INSTEAD,
    clipping_instead,
    is_deepspeed_strategy,
    refuse_under_deepspeed,
)
from lightning_gradkit._window import open_window
from lightning_gradkit.trainer_door import GradKitCallback, TrainerPipeline, check_callback_instances

__all__ = [
    "GradKitDDPStrategy",
    "GradKitFSDPStrategy",
    "GradKitModelParallelStrategy",
    "GradKitSingleDeviceStrategy",
    "GradKitStrategyMixin",
    "gradkit_strategy_hint",
    "handles_found_inf",
    "rank_zero_checkpoint_reason",
    "register_strategies",
    "require_gradkit_step",
    "saves_rank_local_state",
]


# Checkpoint key of the LR-schedule counts (see the module docstring).
_SCHEDULE_KEY = "gradkit_lr_schedule"
#: Key, in a checkpoint saved inside an accumulation window, of the module buffers from before the window.
_WINDOW_BUFFERS_KEY = "gradkit_window_buffers"


def _any_policy_may_skip(trainer: pl.Trainer) -> bool:
    """Whether any gradkit callback of ``trainer`` may ask for an optimizer step to be skipped."""
    return Roster([cb for cb in trainer.callbacks if isinstance(cb, GradKitCallback)]).any_may_skip()


def gradkit_strategy_hint(strategy: object) -> str:
    """The GradKit strategy that replaces ``strategy``, as ``Trainer(...)`` text for error messages."""
    if isinstance(strategy, ModelParallelStrategy):
        return 'Trainer(strategy="gradkit_model_parallel") or GradKitModelParallelStrategy(...)'
    if isinstance(strategy, FSDPStrategy):
        return 'Trainer(strategy="gradkit_fsdp") or GradKitFSDPStrategy(...)'
    if isinstance(strategy, DDPStrategy):
        spawn = ddp_start_method(strategy) == "spawn"
        return f'Trainer(strategy="{"gradkit_ddp_spawn" if spawn else "gradkit_ddp"}") or GradKitDDPStrategy(...)'
    if isinstance(strategy, SingleDeviceStrategy):
        return 'Trainer(strategy="gradkit") or GradKitSingleDeviceStrategy(...)'
    return f"a subclass `class My{type(strategy).__name__}(GradKitStrategyMixin, {type(strategy).__name__})`"


def require_gradkit_step(
    trainer: pl.Trainer, pl_module: pl.LightningModule, who: str, does: str, deepspeed: tuple[str, str], manual: str
) -> None:
    """Refuse, naming the fix, a fit where the callback ``who`` cannot act on optimizer steps: under DeepSpeed
    (``deepspeed``: why, what to do instead), without a GradKit strategy (which ``does`` what ``who`` needs), or
    under manual optimization (``manual``: what to do instead, or empty)."""
    refuse_under_deepspeed(trainer, f"`{who}(...)`", *deepspeed)
    if not isinstance(trainer.strategy, GradKitStrategyMixin):
        raise RuntimeError(
            f"{who} {does}, which needs a GradKit strategy, but the Trainer uses {type(trainer.strategy).__name__}. "
            f"Use {gradkit_strategy_hint(trainer.strategy)}."
        )
    if not pl_module.automatic_optimization:
        raise RuntimeError(
            f"{who} needs automatic optimization (one optimizer step per batch, which the GradKit strategy {does}), "
            f"but the LightningModule sets `automatic_optimization = False`.{' ' + manual if manual else ''}"
        )


def saves_rank_local_state(strategy: object) -> bool:
    """Whether ``strategy`` saves each rank's own callback state (``SpikeRollback(save_snapshots=True)``'s snapshots):
    a GradKit strategy on ``ModelParallelStrategy(save_distributed_checkpoint=True)`` (the default) does, into its
    distributed checkpoint (:mod:`gradkit.doors.distributed_checkpoint`)."""
    # Lightning keeps the argument private; without it, the strategy writes one file from rank 0.
    distributed = getattr(strategy, "_save_distributed_checkpoint", False)
    return isinstance(strategy, GradKitStrategyMixin) and isinstance(strategy, ModelParallelStrategy) and distributed


def rank_zero_checkpoint_reason(strategy: object) -> str | None:
    """Why ``strategy``'s checkpoints cannot hold each rank's own callback state (its shards), or ``None`` when they
    can (:func:`saves_rank_local_state`) or the ranks hold the same state (DDP)."""
    if saves_rank_local_state(strategy):
        return None
    if isinstance(strategy, ModelParallelStrategy):
        return (
            "with `save_distributed_checkpoint=False` Lightning writes the checkpoint from rank 0 only; keep the "
            "default `save_distributed_checkpoint=True` on a GradKit strategy (`GradKitModelParallelStrategy`), whose "
            "distributed checkpoint saves every rank's snapshots"
        )
    if isinstance(strategy, FSDPStrategy):
        return (
            "Lightning saves callback states from rank 0 only (`meta.pt` of a sharded checkpoint too); train FSDP2 "
            "with `GradKitModelParallelStrategy` (`save_distributed_checkpoint=True`, the default), whose distributed "
            "checkpoint saves every rank's snapshots"
        )
    return None


@dataclass
class _ScheduleCount:
    """Lightning's index for step-interval schedulers of one optimizer, without the batches of skipped steps.

    Attributes:
        epoch: the epoch counted.
        seen: batches of the epoch up to its last optimizer step (Lightning's ``batch_idx + 1`` there).
        applied: how many of them belong to applied steps.
        last_applied: whether the last optimizer step was applied.
    """

    epoch: int = -1
    seen: int = 0
    applied: int = 0
    last_applied: bool = False

    def record(self, epoch: int, batches: int, applied: bool) -> None:
        """Count an optimizer step taken after ``batches`` batches of ``epoch``."""
        if epoch != self.epoch:
            self.epoch, self.seen, self.applied = epoch, 0, 0
        if applied:
            self.applied += batches - self.seen
        self.seen = batches
        self.last_applied = applied

    def due(self, frequency: int) -> bool:
        """Whether a scheduler with this ``frequency`` steps after the last optimizer step."""
        return self.last_applied and self.applied % frequency == 0

    def rewind(self, saved: _ScheduleCount) -> None:
        """Undo the applied steps counted since ``saved`` was taken, staying at the current batch.

        The batches since then count as batches of steps that were not applied: ``applied`` returns to ``saved``'s
        when both are of the same epoch, else to 0 (none of this epoch's applied steps is left).
        """
        same_epoch = saved.epoch == self.epoch
        self.applied = saved.applied if same_epoch else 0
        self.last_applied = saved.last_applied if same_epoch and saved.seen == self.seen else False


class _SchedulerGate:
    """Stands in for ``LightningModule.lr_scheduler_step`` while fitting: steps gated schedulers only when due (see
    the module docstring). An instance attribute on the module, removed at teardown."""

    def __init__(self, strategy: GradKitStrategyMixin, original: Callable[..., Any]) -> None:
        self.strategy = strategy
        self.original = original

    def __call__(self, scheduler: Any, metric: Any = None) -> Any:
        if self.strategy._gradkit_hold(scheduler):
            return None
        return self.original(scheduler, metric)


class GradKitStrategyMixin:
    """Lets gradkit callbacks skip an optimizer step, exactly and identically on every rank.

    Mix it in front of any Lightning strategy whose ``optimizer_step`` ends in the precision plugin (all built-in
    ones except DeepSpeed and XLA): ``class MyStrategy(GradKitStrategyMixin, DDPStrategy)``. Without a gradkit
    callback that may skip a step (``NonFiniteGuard(action="skip")``, ``SpikeGuard(action="skip")``) it changes
    nothing.

    On a skipped step the optimizer is not stepped (parameters and optimizer state, Adam moments and step counts
    included, are bitwise unchanged), the gradients are cleared, step-interval LR schedulers do not advance (one
    with ``frequency=f`` counts only the batches of applied steps, so it steps once per ``f`` applied optimizer
    steps without accumulation), and ``gradkit/skipped_steps`` counts it. ``trainer.global_step`` still counts the
    attempted step (as Lightning does for a step the ``GradScaler`` skips). ``optimizer.step()`` returns what the
    optimizer returned, in manual optimization too; after ``clip_gradients`` the gate uses the decision taken there.

    Optimizers that evaluate the closure several times per step (``LBFGS``, SAM-style): the skip is decided on the
    first evaluation; later evaluations run the real closure and are scaled and clipped, not decided again.

    The gate runs the step's first evaluation of the closure itself, before it calls the optimizer (the skip must be
    known before anything is applied). So Lightning's check "The closure hasn't been executed" never fires while the
    gate is active: an optimizer whose ``step`` ignores its closure (a bug plain Lightning stops) steps on the
    gradients of the gate's evaluation, without an error.

    Cost: one host read of the skip flag per optimizer step with an ordinary optimizer; none with a fused one
    (``Adam/AdamW/SGD/Adagrad(fused=True)``), whose kernel receives the flag as ``found_inf``. With a fused
    optimizer and a step-interval LR scheduler the flag is read when the scheduler is about to step.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning.pytorch.strategies import DDPStrategy
        >>> from lightning_gradkit import GradKitStrategyMixin, NonFiniteGuard
        >>> class MyDDP(GradKitStrategyMixin, DDPStrategy):
        ...     pass
        >>> trainer = Trainer(strategy=MyDDP(), accelerator="cpu", devices=2, callbacks=[NonFiniteGuard()])
    """

    _gradkit_gate_active: bool = False
    _gradkit_restored: dict[int, tuple[int, int, int, bool]] | None = None
    _gradkit_buffers: Snapshot | None = None
    _gradkit_window_buffers: dict[str, Any] | None = None
    _gradkit_drop_hooks: list[Callable[[Any], bool]] = []

    # -- Lightning hooks -----------------------------------------------------------------------------------------
    def connect(self, model: pl.LightningModule) -> None:
        if is_deepspeed_strategy(self):
            raise RuntimeError(
                f"`{type(self).__name__}` mixes GradKitStrategyMixin into DeepSpeedStrategy, which cannot work: the "
                "mixin gates `optimizer.step` and skips the step there, but the DeepSpeed engine steps, counts and "
                "zeroes the gradients inside `engine.step()`, and under ZeRO keeps them in its own buffers. Use "
                f"`DeepSpeedStrategy` itself. {SKIPPING_INSTEAD} Clipping: {clipping_instead()}"
            )
        super().connect(model)  # type: ignore[misc]
        # The earliest hook with the Trainer: before Lightning calls any callback hook (`setup`).
        trainer = model._trainer
        if trainer is not None:
            check_callback_instances(trainer)

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)  # type: ignore[misc]
        self._gradkit_trainer = trainer
        self._gradkit_pending: dict[int, tuple[int, int, StepRecord | None, bool]] = {}
        self._gradkit_counts: dict[int, _ScheduleCount] = {}
        self._gradkit_frequencies: dict[int, int] = {}
        self._gradkit_gate_active = _any_policy_may_skip(trainer) and trainer.state.fn == TrainerFn.FITTING
        # A callback that drops the batches of declared steps (`StepsToSkip`, which may skip): `_gradkit_drops`.
        callbacks = [cb for cb in trainer.callbacks if isinstance(cb, GradKitCallback)]
        self._gradkit_drop_hooks = Roster(callbacks).drops_batch
        if not self._gradkit_gate_active:
            self._gradkit_drop_hooks = []
            return
        module = trainer.lightning_module
        self._gradkit_buffers = Snapshot(module)
        if module.automatic_optimization and "lr_scheduler_step" not in module.__dict__:
            module.lr_scheduler_step = _SchedulerGate(self, module.lr_scheduler_step)
            for config in self._gradkit_gated_configs():
                # Lightning then calls the gate after every optimizer step; the gate applies the frequency.
                self._gradkit_frequencies[id(config)] = config.frequency
                config.frequency = 1

    def teardown(self) -> None:
        module = getattr(self, "_gradkit_trainer", None)
        module = module.lightning_module if module is not None else None
        if module is not None and isinstance(module.__dict__.get("lr_scheduler_step"), _SchedulerGate):
            del module.lr_scheduler_step
        for config in self.lr_scheduler_configs:  # type: ignore[attr-defined]
            config.frequency = getattr(self, "_gradkit_frequencies", {}).pop(id(config), config.frequency)
        self._gradkit_gate_active = False
        self._gradkit_buffers = None
        super().teardown()  # type: ignore[misc]

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        local: dict[str, dict[str, Any]] = {}
        keys = self._gradkit_rank_local_keys()
        if keys:
            # Lightning writes the callbacks' states from rank 0 only (`meta.pt`): each rank's own entries go into a
            # distributed checkpoint of their own beside it, written by every rank.
            callbacks, local = split_rank_local(checkpoint.get("callbacks", {}), keys)
            checkpoint = {**checkpoint, "callbacks": callbacks}
        if self._gradkit_gate_active and self._gradkit_frequencies:
            checkpoint = {**checkpoint, _SCHEDULE_KEY: self._gradkit_schedule_state()}
        buffers = self._gradkit_buffers
        if buffers is not None and buffers.captured and open_window(self._gradkit_trainer) is not None:
            # Saved inside an accumulation window: the buffers from before its first micro-batch, so that a resumed
            # run that skips this window puts back what an uninterrupted one would.
            checkpoint = {**checkpoint, _WINDOW_BUFFERS_KEY: buffers.buffers_state_dict()}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # type: ignore[misc]
        if keys:
            path = Path(self.broadcast(filepath))  # type: ignore[attr-defined]  # rank 0's path, as Lightning saved
            save_rank_local(local, path / RANK_LOCAL_FOLDER)

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)  # type: ignore[misc]
        keys = self._gradkit_rank_local_keys()
        if keys:
            folder = Path(self.broadcast(checkpoint_path)) / RANK_LOCAL_FOLDER  # type: ignore[attr-defined]
            if folder.is_dir():  # else saved without rank-local state: the callbacks start without it
                local = load_rank_local(folder, list(keys))
                checkpoint["callbacks"] = merge_rank_local(checkpoint.get("callbacks", {}), local)
        # Adopted at the next optimizer step (the window buffers at the next window start): Lightning may load before
        # or after `setup`.
        self._gradkit_restored = checkpoint.get(_SCHEDULE_KEY)
        self._gradkit_window_buffers = checkpoint.get(_WINDOW_BUFFERS_KEY)
        return checkpoint

    def _gradkit_rank_local_keys(self) -> dict[str, tuple[str, ...]]:
        """The gradkit callbacks' rank-local state entries, by state key, where this strategy saves each rank's
        (:func:`saves_rank_local_state`); empty elsewhere."""
        trainer = getattr(self, "_gradkit_trainer", None)  # set at `setup`, which comes before any save or load
        if trainer is None or not saves_rank_local_state(self):
            return {}
        return Roster([cb for cb in trainer.callbacks if isinstance(cb, GradKitCallback)]).rank_local()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._gradkit_drops():
            # A dropped step: no forward. A loss Lightning's loop takes (it refuses `None` with several ranks) and
            # whose backward `backward` skips.
            return torch.zeros((), device=self.root_device)  # type: ignore[attr-defined]
        buffers = self._gradkit_buffers
        if buffers is not None and not buffers.captured and not replaying():
            # Before the window's first forward: what a skip puts back (the saved one when resuming inside it).
            saved, self._gradkit_window_buffers = self._gradkit_window_buffers, None
            if saved:
                buffers.load_buffers_state_dict(saved)
            else:
                buffers.capture()
        return super().training_step(*args, **kwargs)  # type: ignore[misc]

    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Any:
        if self._gradkit_drops():
            return closure_loss  # a dropped step's stand-in loss: nothing to differentiate
        return super().backward(closure_loss, optimizer, *args, **kwargs)  # type: ignore[misc]

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        if not self._gradkit_gate_active:
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        engine = TrainerPipeline.of(self._gradkit_trainer)
        if self._gradkit_drops():
            # A dropped step: Lightning's closure runs (for its bookkeeping; `training_step` returns at once), the
            # precision plugin and the optimizer do not, and the step counts as skipped.
            output = closure()
            optimizer.zero_grad(set_to_none=True)
            engine.steps.add_drop(self.root_device)  # type: ignore[attr-defined]
            self._gradkit_record(optimizer, None, dropped=True)
            return output
        with shadowed(optimizer, step=self._gradkit_gate(optimizer, optimizer.step, engine)):
            output = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        record = engine.step_record(self._gradkit_trainer, optimizer)
        self._gradkit_record(optimizer, record)
        close_step(optimizer, record, self._gradkit_buffers)
        buffers = self._gradkit_buffers
        if buffers is not None and not self._gradkit_trainer.lightning_module.automatic_optimization:
            # In manual optimization the next window opens now: a second optimizer step in the same `training_step`
            # (a GAN's generator after its discriminator) has a window of its own to put back. In automatic
            # optimization it opens at the next `training_step`, after what the batch end changes (a rollback's).
            buffers.capture()
        return output

    def _gradkit_drops(self) -> bool:
        """Whether a gradkit callback (``StepsToSkip``) drops the current optimizer step's batches."""
        if not self._gradkit_drop_hooks:
            return False
        trainer = self._gradkit_trainer
        ctx = TrainerPipeline.of(trainer).context(trainer, trainer.lightning_module)
        return any(drops(ctx) for drops in self._gradkit_drop_hooks)

    # -- the gate ------------------------------------------------------------------------------------------------
    def _gradkit_gate(
        self, optimizer: Optimizer, inner: Callable[..., Any], engine: TrainerPipeline
    ) -> Callable[..., Any]:
        trainer = self._gradkit_trainer

        def gated_step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
            result = None
            if closure is not None:
                # Decide on the first evaluation before the optimizer can apply anything (see `_closure`).
                result, kwargs["closure"] = first_evaluation(closure)
            return step_as_decided(optimizer, inner, engine.step_record(trainer, optimizer), kwargs, result)

        return gated_step

    # -- LR schedulers -------------------------------------------------------------------------------------------
    def _gradkit_gated_configs(self) -> list[LRSchedulerConfig]:
        """The scheduler configs the gate holds: step interval, not ``ReduceLROnPlateau``."""
        configs = self.lr_scheduler_configs  # type: ignore[attr-defined]
        return [c for c in configs if c.interval == "step" and not c.reduce_on_plateau]

    def _gradkit_record(self, optimizer: Optimizer, record: StepRecord | None, dropped: bool = False) -> None:
        """Note an optimizer step for the schedule counts; its skip flag is read only when a scheduler needs it."""
        if not self._gradkit_frequencies:
            return
        self._gradkit_settle()
        trainer = self._gradkit_trainer
        batches = trainer.fit_loop.epoch_loop.batch_idx + 1
        self._gradkit_pending[id(optimizer)] = (trainer.current_epoch, batches, record, dropped)

    def _gradkit_settle(self) -> None:
        """Fold the pending optimizer steps into the counts (a host read of a fused optimizer's skip flag)."""
        if self._gradkit_restored is not None:
            self._gradkit_counts = {i: _ScheduleCount(*values) for i, values in self._gradkit_restored.items()}
            self._gradkit_restored = None
        optimizers = self._gradkit_trainer.optimizers
        for key, (epoch, batches, record, dropped) in self._gradkit_pending.items():
            index = next(i for i, opt in enumerate(optimizers) if id(opt) == key)
            skipped = dropped or (record.skip_on_host() if record is not None else False)
            self._gradkit_counts.setdefault(index, _ScheduleCount()).record(epoch, batches, not skipped)
        self._gradkit_pending.clear()

    def _gradkit_schedule_state(self) -> dict[int, tuple[int, int, int, bool]]:
        """The counts, per optimizer index, as saved in checkpoints."""
        self._gradkit_settle()
        return {i: (c.epoch, c.seen, c.applied, c.last_applied) for i, c in self._gradkit_counts.items()}

    # -- the strategy's part of a step's state ---------------------------------------------------------------------
    def gradkit_state_dict(self) -> dict[str, Any]:
        """What an optimizer step changes in the strategy: the LR-schedule counts of the step-interval schedulers.

        With the parameters, optimizer and scheduler states, buffers, RNG and the gradkit callbacks' states, this is
        part of a training step's state; :class:`~lightning_gradkit.SpikeRollback` keeps it in every snapshot. The
        values are plain (``{"lr_schedule": {optimizer index: (epoch, batches seen, batches of applied steps, last
        step applied)}}``). Reads a fused optimizer's pending skip flag on the host.

        Example::

            >>> from lightning_gradkit.strategy import GradKitSingleDeviceStrategy
            >>> GradKitSingleDeviceStrategy().gradkit_state_dict()
            {'lr_schedule': {}}
        """
        if not hasattr(self, "_gradkit_counts"):  # before `setup`: nothing counted yet
            return {"lr_schedule": {}}
        return {"lr_schedule": self._gradkit_schedule_state()}

    def gradkit_load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Rewind the strategy's step state to ``state_dict`` (from :meth:`gradkit_state_dict`) at the current batch.

        The training continues from the batch it is at: the batches seen since ``state_dict`` was taken count as
        batches of steps that were not applied, so a step-interval scheduler with ``frequency=f`` steps as in a run
        that never saw them (after each ``f`` applied optimizer steps of the epoch, without accumulation). Loading
        the state just taken changes nothing.
        """
        self._gradkit_settle()
        saved = {int(i): _ScheduleCount(*values) for i, values in state_dict["lr_schedule"].items()}
        for i, count in self._gradkit_counts.items():
            count.rewind(saved.get(i, _ScheduleCount()))

    def _gradkit_hold(self, scheduler: Any) -> bool:
        """Whether a gated scheduler must not step now (see the module docstring)."""
        config = next((c for c in self._gradkit_gated_configs() if c.scheduler is scheduler), None)
        if config is None or id(config) not in self._gradkit_frequencies:
            return False
        self._gradkit_settle()
        optimizer = getattr(scheduler, "optimizer", None)
        index = next((i for i, opt in enumerate(self._gradkit_trainer.optimizers) if opt is optimizer), 0)
        count = self._gradkit_counts.get(index)
        return count is None or not count.due(self._gradkit_frequencies[id(config)])


class GradKitSingleDeviceStrategy(GradKitStrategyMixin, SingleDeviceStrategy):
    """Lightning's ``SingleDeviceStrategy`` with gradkit step control (registered as ``"gradkit"``).

    The device follows the Trainer's ``accelerator``/``devices`` when it is not given.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(strategy="gradkit", accelerator="cpu")
    """

    strategy_name = "gradkit"

    def __init__(self, device: str | torch.device | None = None, **kwargs: Any) -> None:
        super().__init__(device=device if device is not None else "cpu", **kwargs)
        self._device_given = device is not None

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return [self.root_device] if self._device_given else None

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        # Lightning's accelerator connector hands a strategy without devices the devices it resolved.
        if not devices:
            return
        if len(devices) > 1:
            raise ValueError(
                f'`Trainer(strategy="gradkit")` runs on one device, but {len(devices)} were selected. Use '
                '`strategy="gradkit_ddp"` for several devices, or `devices=1`.'
            )
        set_root_device(self, devices[0])
        self._device_given = True


class GradKitDDPStrategy(GradKitStrategyMixin, DDPStrategy):
    """Lightning's ``DDPStrategy`` with gradkit step control (``"gradkit_ddp"``, ``"gradkit_ddp_spawn"``)."""

    strategy_name = "gradkit_ddp"


class GradKitFSDPStrategy(GradKitStrategyMixin, FSDPStrategy):
    """Lightning's ``FSDPStrategy`` with gradkit step control (``"gradkit_fsdp"``)."""

    strategy_name = "gradkit_fsdp"


class GradKitModelParallelStrategy(GradKitStrategyMixin, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel) with gradkit step control
    (``"gradkit_model_parallel"``).

    Unfreezing under FSDP2: ``requires_grad_(True)`` sets the flag on the parameters registered on the module at that
    moment. After a forward, FSDP2 leaves the *unsharded* parameters registered until a backward through the module
    reshards them when it does not reshard after forward: a module that is its own FSDP root (``fully_shard`` on it
    but not on a module above it) or one sharded with ``reshard_after_forward=False``. Such a module that is frozen
    (no backward runs through it), or that has just run validation, gets the flag on its unsharded parameters; the
    optimizer's sharded parameters keep ``requires_grad=False``. Plain FSDP2 then trains the module for ONE step: it
    computes and reduce-scatters the gradients into the sharded parameters, which the optimizer applies; at the next
    all-gather it copies ``requires_grad`` from the sharded parameters onto the unsharded ones
    (``FSDPParam.to_unsharded``, torch 2.13), and from the second unfrozen step on the module gets no gradient and
    stops training, without an error. gradkit follows what the optimizer applies: that one step's gradients are
    measured, clipped and guarded like the others, a warning names the parameters, and gradkit does not change what
    FSDP2 trains. To unfreeze for good, call ``module.reshard()`` (``FSDPModule.reshard``, which registers the sharded
    parameters again) before ``requires_grad_(True)``.
    """

    strategy_name = "gradkit_model_parallel"


def register_strategies() -> None:
    """Register the GradKit strategy names in Lightning's ``StrategyRegistry`` (done on import of the package, see
    :mod:`lightning_gradkit._compat`; calling it again is harmless)."""
    register_strategy_names()
