"""The Lightning ``Trainer`` front door of the step pipeline: the pipeline every gradkit callback joins.

The pipeline itself (measure -> reduce -> decide -> apply -> observe) is Lightning-free and lives in
:mod:`gradkit.step.pipeline`; this module connects it to a Trainer:

- :class:`TrainerContext`: what the pipeline and the policies read of the loop (the step's identity, optimizers,
  parameter names, the AMP scale the gradients still carry, Lightning's logging rule and loggers), answered by the
  Trainer.
- :class:`TrainerPipeline`: one :class:`~gradkit.step.pipeline.Pipeline` per Trainer, shared by all gradkit
  callbacks of that Trainer. Whichever of them Lightning calls first in ``on_before_optimizer_step`` (after AMP
  unscale and after the DDP all-reduce) runs the whole pipeline for all of them; the others find the step already
  done. So results never depend on the order of the ``callbacks`` list.
- :class:`GradKitCallback`: the base every gradkit callback derives from, a
  :class:`~gradkit.Policy` with thin Lightning hooks.

The strategy mixin (:mod:`lightning_gradkit.strategy`) reads the step's ``Decision.skip`` to step the optimizer or not.

One entry point: :meth:`TrainerPipeline.run`. Every caller goes through it: each :class:`GradKitCallback`'s
``on_before_optimizer_step``, :func:`~lightning_gradkit.clip_gradients` (manual optimization, with the clipper as an
``extra`` policy) and :class:`~lightning_gradkit.ManualAccumulator` (its window scale is a pending ``SCALE`` policy
that the next run folds in, or a run of its own at ``step``). Nothing else writes the gradients.

Under 16-mixed AMP with an optimizer that unscales inside its own ``step`` (``fused=True``), Lightning does not
call ``GradScaler.unscale_`` before ``on_before_optimizer_step``: the gradients the pipeline sees are still multiplied
by the loss scale (:func:`_pending_loss_scale` says so, and the pipeline works in unscaled units).

Map of this file, in order: what the pipeline reads of the Trainer (:func:`_pending_loss_scale`,
:func:`flat_sharded`, :class:`TrainerContext`); :class:`TrainerPipeline`;
:class:`GradKitCallback` and :func:`log_metrics`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from gradkit._util.torch_compat import gradients_still_scaled
from gradkit.report.events import EventLog
from gradkit.step.accounting import StepAccounting
from gradkit.step.norms import loss_scale, world_size
from gradkit.step.pipeline import Pipeline, StepRecord
from gradkit.step.protocol import Door, Policy, Roster, Stage, StatsRequest, fresh_state_note, values_to_host
from gradkit.step.rank_check import verify_same_layout
from gradkit.step.snapshot import Snapshot
from lightning_gradkit._compat import epoch_ends_with_this_batch, publish_callback_metrics
from lightning_gradkit._window import note_window_on_load, note_window_on_save

__all__ = [
    "GradKitCallback",
    "Stage",
    "StatsRequest",
    "TrainerContext",
    "TrainerPipeline",
    "batches_that_stepped",
    "check_callback_instances",
    "events_dir",
    "flat_sharded",
    "instance_hook",
    "log_metrics",
    "unscaled_loss",
    "world_size",
    "write_rank_event",
]


# -- what the pipeline reads of the Trainer --------------------------------------------------------------------------
def _pending_loss_scale(trainer: pl.Trainer, optimizer: Optimizer) -> Tensor | None:
    """The AMP loss scale the optimizer's gradients are still multiplied by, or ``None`` when they are unscaled.

    Lightning unscales before ``on_before_optimizer_step`` except for optimizers that unscale inside ``step``
    (``fused=True``); in manual optimization it unscales only inside ``optimizer.step()``. The scaler's own
    per-optimizer stage says which case holds. Returns the scaler's device tensor: reading it needs no host sync
    (``GradScaler.get_scale()`` would sync).
    """
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    scale = loss_scale(scaler)
    if scale is None or not gradients_still_scaled(scaler, optimizer):
        return None
    return scale


def batches_that_stepped(trainer: pl.Trainer) -> int:
    """The step Lightning logs metrics under: ``fit_loop.epoch_loop._batches_that_stepped``.

    Lightning's ``_LoggerConnector`` logs with this step and decides ``log_every_n_steps`` on it plus one;
    ``LearningRateMonitor`` and ``DeviceStatsMonitor`` read the same attribute. ``trainer.global_step`` differs (it
    counts every optimizer's steps). 2.5.0 and later also add one when resuming a checkpoint saved mid-epoch before
    the batch end; reading Lightning's own counter keeps gradkit's steps equal to Lightning's in every release.
    """
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def flat_sharded(trainer: pl.Trainer) -> bool:
    """Whether every gradient is a flat local shard: FSDP1 (Lightning's ``FSDPStrategy``) over more than one rank.

    FSDP2 and tensor parallelism (DTensor parameters) are told apart per parameter, by their placements.
    """
    return isinstance(trainer.strategy, FSDPStrategy) and trainer.world_size > 1


def _is_last_step(trainer: pl.Trainer) -> bool:
    """Whether the optimizer step under way is the last of ``fit``, as far as ``max_steps``/``max_epochs`` say.

    Called in ``on_before_optimizer_step``, before ``global_step`` counts this step. A stop that Lightning decides
    after the step (early stopping, ``max_time``) is not foreseen.
    """
    if trainer.max_steps != -1 and trainer.global_step + 1 >= trainer.max_steps:
        return True
    max_epochs = trainer.max_epochs
    if max_epochs is None or max_epochs == -1 or trainer.current_epoch + 1 < max_epochs:
        return False
    return epoch_ends_with_this_batch(trainer)


class TrainerContext(Door):
    """The loop as a Lightning ``Trainer`` runs it: every answer is read from the Trainer when asked.

    Args:
        trainer: the Trainer.
        pl_module: its LightningModule.
    """

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.trainer = trainer
        self.pl_module = pl_module
        self._log_dir: Path | None = None

    @property
    @override
    def log_dir(self) -> Path:
        """The event file's directory (:func:`events_dir`), read once: the first read must come on every rank (it
        broadcasts rank 0's value), as a policy's ``attach`` does."""
        if self._log_dir is None:
            self._log_dir = events_dir(self.trainer)
        return self._log_dir

    @property
    @override
    def optimizers(self) -> Sequence[Optimizer]:
        return self.trainer.optimizers

    @property
    @override
    def device(self) -> torch.device:
        return self.pl_module.device

    @property
    @override
    def global_step(self) -> int:
        return self.trainer.global_step

    @property
    @override
    def global_rank(self) -> int:
        return self.trainer.global_rank

    @property
    @override
    def batch_idx(self) -> int:
        return self.trainer.fit_loop.epoch_loop.batch_idx

    @property
    @override
    def accumulate_grad_batches(self) -> int:
        # Lightning divides each loss by it before `backward` in automatic optimization only.
        return self.trainer.accumulate_grad_batches if self.pl_module.automatic_optimization else 1

    @property
    @override
    def log_every_n_steps(self) -> int:
        return self.trainer.log_every_n_steps

    @property
    @override
    def log_step(self) -> int:
        return batches_that_stepped(self.trainer)

    @override
    def step_key(self) -> tuple[int, ...]:
        # `global_step` counts every attempted step (manual optimization too); the batch tells two fits apart.
        return self.trainer.global_step, self.trainer.fit_loop.total_batch_idx

    @override
    def param_names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.pl_module.named_parameters()}

    @override
    def flat_sharded(self) -> bool:
        return flat_sharded(self.trainer)

    @override
    def steps_through_gate(self) -> bool:
        # A GradKit strategy gates `optimizer.step` while a policy may skip (`GradKitStrategyMixin.setup`).
        return bool(getattr(self.trainer.strategy, "_gradkit_gate_active", False))

    @override
    def loss_scale(self, optimizer: Optimizer) -> Tensor | None:
        if getattr(self.trainer.precision_plugin, "scaler", None) is None:
            return None
        return _pending_loss_scale(self.trainer, optimizer)

    @override
    def loss_scale_source(self) -> object | None:
        return getattr(self.trainer.precision_plugin, "scaler", None)

    @property
    @override
    def window_buffers(self) -> Snapshot | None:
        return getattr(self.trainer.strategy, "_gradkit_buffers", None)  # a GradKit strategy's, while a policy may skip

    @override
    def is_logging_step(self, every_n_steps: int | None = None) -> bool:
        # Lightning's own rule (`_LoggerConnector.should_update_logs`) with an optional own period; the step is
        # `batches_that_stepped`, read inline: every step of the Trainer door asks.
        trainer = self.trainer
        n = trainer.log_every_n_steps if every_n_steps is None else every_n_steps
        return n != 0 and ((trainer.fit_loop.epoch_loop._batches_that_stepped + 1) % n == 0 or trainer.should_stop)

    @override
    def is_last_step(self) -> bool:
        return _is_last_step(self.trainer)

    @override
    def policies_owner(self) -> str:
        return "The Trainer has"

    @override
    def checkpoint_note(self) -> str:
        paths = [cb.last_model_path or cb.best_model_path for cb in self.trainer.checkpoint_callbacks]
        paths = [p for p in paths if p]
        if not paths:
            return "no checkpoint was saved (add a `ModelCheckpoint` callback to keep one)"
        return "last checkpoint saved: " + ", ".join(paths)

    @override
    def log(self, metrics: dict[str, Tensor], every_n_steps: int | None = None) -> None:
        log_metrics(self.trainer, self.pl_module, metrics, every_n_steps)

    @override
    def log_values(self, values: dict[str, float]) -> None:
        # Straight to the loggers, as Lightning's `LearningRateMonitor` does: `self.log` would keep them for the epoch.
        step = batches_that_stepped(self.trainer)
        for logger in self.trainer.loggers:
            logger.log_metrics(values, step=step)

    @property
    @override
    def loggers(self) -> Sequence[Any]:
        return self.trainer.loggers

    @property
    @override
    def progress_bar(self) -> Callable[[dict[str, float]], None]:
        return self._show_progress

    def _show_progress(self, values: dict[str, float]) -> None:
        # CPU tensors: the progress bar reads them every batch, which must not synchronize the device.
        tensors = {k: torch.tensor(v) for k, v in values.items()}
        self.pl_module.log_dict(tensors, prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=1)

    @property
    @override
    def model(self) -> torch.nn.Module:
        return self.pl_module

    @property
    def wrapped_model(self) -> torch.nn.Module | None:
        """The module the strategy calls (``trainer.strategy.model``: the ``DistributedDataParallel`` under DDP), where
        ``GradNormMonitor(noise_scale=True)`` reads each rank's local gradient
        (:func:`gradkit.policies.noise_scale.start_probe`)."""
        return self.trainer.strategy.model

    @property
    @override
    def steps(self) -> StepAccounting:
        return TrainerPipeline.of(self.trainer).pipeline.steps

    @override
    def policies(self) -> list[Policy]:
        return [cb for cb in self.trainer.callbacks if isinstance(cb, GradKitCallback)]

    @override
    def schedulers(self) -> list[object]:
        return [config.scheduler for config in self.trainer.lr_scheduler_configs]

    @override
    def step_state(self) -> dict[str, object]:
        state = getattr(self.trainer.strategy, "gradkit_state_dict", None)
        return state() if state is not None else {}

    @override
    def load_step_state(self, state: dict[str, object]) -> None:
        load = getattr(self.trainer.strategy, "gradkit_load_state_dict", None)
        if load is not None:
            load(state)


# Where the events go when the Trainer has no logger and no `default_root_dir` of its own: Lightning's default log
# folder (its default logger writes there too), never the bare working directory.
_FALLBACK_DIRNAME = "lightning_logs"


def events_dir(trainer: pl.Trainer) -> Path:
    """The directory of the event file.

    The first logger's directory; without a logger ``trainer.default_root_dir``, unless that is only Lightning's
    fallback (the current working directory, used when no ``default_root_dir`` is given): then
    ``<cwd>/lightning_logs``, so that a run with ``logger=False`` does not drop files into a source tree.

    Must be called on every rank at the same point (``setup``): ``trainer.log_dir`` broadcasts rank 0's value.
    """
    directory = trainer.log_dir if trainer.loggers else None
    if directory:
        return Path(directory)
    root = Path(trainer.default_root_dir)
    if root.resolve() == Path.cwd().resolve():
        return root / _FALLBACK_DIRNAME
    return root


def write_rank_event(directory: str | Path, trainer: pl.Trainer, what: str, batch_idx: int, **details: Any) -> None:
    """Append one event for this rank's findings to ``<directory>/gradkit_events.jsonl``."""
    log = EventLog(Path(directory), rank=trainer.global_rank, every_rank=True)
    log.write(
        step=trainer.global_step,
        batch_idx=batch_idx,
        rank=trainer.global_rank,
        what=what,
        culprit=None,
        values={},
        **details,
    )


# -- the Trainer's pipeline --------------------------------------------------------------------------------------
class TrainerPipeline:
    """The pipeline of one Trainer, shared by all gradkit callbacks of that Trainer: a
    :class:`~gradkit.step.pipeline.Pipeline` (:attr:`pipeline`) driven with the Trainer's context and callbacks.

    Attributes:
        pipeline: the Lightning-free pipeline it runs (``Door.pipeline`` behind the Trainer).
    """

    _by_trainer: weakref.WeakKeyDictionary[pl.Trainer, TrainerPipeline] = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self.pipeline = Pipeline()
        self._layout_verified = False
        self._ctx: TrainerContext | None = None
        self._policies: list[Policy] | None = None  # the Trainer's gradkit callbacks, taken once per fit

    @classmethod
    def of(cls, trainer: pl.Trainer) -> TrainerPipeline:
        engine = cls._by_trainer.get(trainer)
        if engine is None:
            engine = cls._by_trainer[trainer] = cls()
        return engine

    @property
    def last_records(self) -> dict[int, StepRecord]:
        """Per optimizer (``id``), the record of its last step's first evaluation (:attr:`Pipeline.last_records`)."""
        return self.pipeline.last_records

    @property
    def steps(self) -> StepAccounting:
        """The Trainer's step accounting (:attr:`Pipeline.steps`)."""
        return self.pipeline.steps

    @property
    def skipped_steps(self) -> Tensor | None:
        """The attempted steps the model does not hold (:attr:`Pipeline.skipped_steps`)."""
        return self.pipeline.skipped_steps

    @property
    def generation(self) -> int:
        """Backward passes so far (:attr:`Pipeline.generation`; the callbacks count them in ``on_before_backward``)."""
        return self.pipeline.generation

    @generation.setter
    def generation(self, value: int) -> None:
        self.pipeline.generation = value

    def add_pending_scale(self, policy: Policy, optimizer: Optimizer | None) -> None:
        """:meth:`Pipeline.add_pending_scale`."""
        self.pipeline.add_pending_scale(policy, optimizer)

    def discard_pending_scale(self, policy: Policy) -> None:
        """:meth:`Pipeline.discard_pending_scale`."""
        self.pipeline.discard_pending_scale(policy)

    def reset(self) -> None:
        """Forget the parameter indexes (parameters may be replaced between fits, e.g. by sharding)."""
        self.pipeline.reset()
        self._layout_verified = False
        self._ctx = None
        self._policies = None

    def context(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> TrainerContext:
        """The :class:`TrainerContext` of ``trainer`` (one object, made again only when the module changes)."""
        ctx = self._ctx
        if ctx is None or ctx.trainer is not trainer or ctx.pl_module is not pl_module:
            ctx = self._ctx = TrainerContext(trainer, pl_module)
        return ctx

    def verify_layout(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Once per fit, before the first step: every rank must train the same parameters in the same order."""
        if not self._layout_verified:
            self._layout_verified = True
            verify_same_layout(trainer.optimizers, {id(p): n for n, p in pl_module.named_parameters()}, pl_module)

    @staticmethod
    def callbacks(trainer: pl.Trainer, extra: Sequence[Policy] = ()) -> list[Policy]:
        """The Trainer's gradkit callbacks and ``extra``; the pipeline puts them in stage order."""
        return [*(cb for cb in trainer.callbacks if isinstance(cb, GradKitCallback)), *extra]

    def step_record(self, trainer: pl.Trainer, optimizer: Optimizer) -> StepRecord | None:
        """The record of ``optimizer``'s current step (its first evaluation), ``None`` if none ran yet."""
        return self.pipeline.step_record(self.context(trainer, trainer.lightning_module).step_key(), optimizer)

    def run(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizer: Optimizer,
        extra: Sequence[Policy] = (),
    ) -> StepRecord | None:
        """Run the step's pipeline for the Trainer's gradkit callbacks and ``extra`` (policies that are not in
        ``trainer.callbacks``: the manual-optimization entry point); ``None`` when it already ran for these
        gradients."""
        ctx = self._ctx
        if ctx is None or ctx.trainer is not trainer or ctx.pl_module is not pl_module:
            ctx = self.context(trainer, pl_module)
        if extra:
            return self.pipeline.run(ctx, optimizer, self.callbacks(trainer, extra))
        if self._policies is None:
            self._policies = self.callbacks(trainer)
        return self.pipeline.run(ctx, optimizer, self._policies)


# -- the policies' base class --------------------------------------------------------------------------------------
def check_callback_instances(trainer: pl.Trainer) -> None:
    """Refuse a callback class given to the Trainer instead of an instance (``callbacks=[ZClip]``).

    Lightning calls a callback's hooks on the object it was given; on a class they run unbound and fail with
    "missing 1 required positional argument: 'pl_module'", then once more in ``on_exception``. The gradkit
    strategies check when they connect to the model, every gradkit callback in its ``setup``: an instance's catches
    a class listed after it, a class's own (:class:`_InstanceHook`) catches the class itself, without a gradkit
    strategy.

    Raises:
        TypeError: naming each class and the instance to pass instead. The classes leave ``trainer.callbacks``
            first, so that Lightning's ``on_exception`` hooks, called while this error propagates, do not replace
            it with their own.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import ZClip
        >>> check_callback_instances(Trainer(callbacks=[ZClip], logger=False))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: `Trainer(callbacks=[...])` holds the class `ZClip`, not an instance of it...
    """
    classes = [cb for cb in trainer.callbacks if isinstance(cb, type)]
    if not classes:
        return
    trainer.callbacks[:] = [cb for cb in trainer.callbacks if not isinstance(cb, type)]
    names = ", ".join(f"`{cls.__name__}`" for cls in classes)
    fixed = ", ".join(f"{cls.__name__}()" for cls in classes)
    raise TypeError(
        f"`Trainer(callbacks=[...])` holds the class{'es' if len(classes) > 1 else ''} {names}, not an instance of "
        f"{'them' if len(classes) > 1 else 'it'}: Lightning calls a callback's hooks on the object it is given. "
        f"Instantiate {'each' if len(classes) > 1 else 'it'}: `callbacks=[{fixed}]`, with its arguments in the "
        "parentheses (e.g. `ZClip(z_threshold=2.5)`)."
    )


def unscaled_loss(trainer: pl.Trainer, loss: Tensor) -> Tensor:
    """The loss as ``training_step`` returned it, divided as Lightning divides it under accumulation
    (``on_before_backward`` sees it multiplied by the fp16 scale too; the scale is removed, no host sync)."""
    scale = loss_scale(getattr(trainer.precision_plugin, "scaler", None))
    # At least fp32, never narrower than the loss: a float64 loss of -1.4e39 is finite, its fp32 cast is not.
    loss = loss.detach().to(torch.promote_types(loss.dtype, torch.float32))
    return loss if scale is None else loss / scale.to(loss.device)


class _InstanceHook:
    """A callback's ``setup`` that refuses its class given in place of an instance (``callbacks=[ZClip]``).

    Lightning calls each hook as ``getattr(callback, "setup")(trainer, pl_module, stage=...)`` on whatever the list
    holds; on a class that is the plain function, called unbound ("missing 1 required positional argument"). Read
    from the class, this descriptor gives a function that raises :func:`check_callback_instances`'s error instead:
    the first hook Lightning calls catches the class wherever it stands in the list, with or without a gradkit
    strategy. Read from an instance, it is the method itself.
    """

    def __init__(self, method: Callable[..., None]) -> None:
        self.method = method
        self.__doc__ = method.__doc__

    def __get__(self, instance: object, owner: type) -> Callable[..., None]:
        if instance is not None:
            return self.method.__get__(instance, owner)
        return functools.partial(_setup_of_a_class, self.method)


def _setup_of_a_class(method: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    if args and isinstance(args[0], pl.Trainer):  # Lightning's call on the class: `trainer` in the place of `self`
        check_callback_instances(args[0])
    method(*args, **kwargs)  # an explicit unbound call, `ZClip.setup(callback, trainer, pl_module, stage)`


def instance_hook(method: Callable[..., None]) -> Any:
    """Decorate a plain Lightning callback's ``setup`` so that its class in ``callbacks=[...]`` is refused with the
    fix (:class:`GradKitCallback`'s subclasses get it without the decorator)."""
    return _InstanceHook(method)


class GradKitCallback(Callback):
    """The Lightning adapter of a torch policy: every Trainer hook forwarded to the policy's protocol hook.

    A gradkit callback is ``class ClipGradNorm(gradkit.ClipGradNorm, GradKitCallback)``: the policy class (a
    plain torch object, :class:`~gradkit.Policy`) holds the algorithm and its state; this class turns the
    Trainer's hooks into the protocol's calls, the same calls the loop door makes:

    ====================================  ==========================================================
    Trainer hook                          protocol hook
    ====================================  ==========================================================
    ``setup``                             (the pipeline of the Trainer is reset)
    ``on_fit_start``                      ``attach(ctx, pl_module)``
    ``on_train_batch_start`` (first)      ``before_first_forward(ctx)``
    ``on_before_backward``                ``note_loss(loss, ctx)`` (the loss without the fp16 scale)
    ``on_before_optimizer_step``          the pipeline (``request_stats`` ... ``observe``)
    ``on_train_batch_end``                ``after_step(ctx)``
    ``on_train_end``                      ``finish(ctx)``
    ====================================  ==========================================================

    The first of a Trainer's gradkit callbacks that Lightning calls in ``on_before_optimizer_step`` runs the pipeline
    for all of them. ``state_dict`` / ``load_state_dict`` are the policy's own: a checkpoint keeps them under the
    callback's ``state_key``, the key :class:`~gradkit.GradKit` uses too; a stateful callback the checkpoint has
    no state for (added at the restart) starts fresh, with the loop door's warning. A callback that only works under a
    Trainer (``AccumulationGuard``) sets :attr:`trainer_only` to the reason, which the loop door's refusal names.
    """

    stage: Stage = Stage.OBSERVE
    #: Why the callback works only under a Trainer (the loop door refuses it, naming this), ``None`` if it does not.
    trainer_only: str | None = None
    _first_forward_done = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        setup = cls.__dict__.get("setup")
        if setup is not None and not isinstance(setup, _InstanceHook):
            cls.setup = _InstanceHook(setup)  # type: ignore[method-assign]  # `callbacks=[cls]` is refused

    #: The pipeline of the Trainer this callback is set up in, bound once in ``setup`` for the hooks Lightning calls
    #: every micro-batch (``None`` outside a Trainer's stage: a subclass whose ``setup`` skips this one's finds it by
    #: the Trainer).
    _gradkit_engine: TrainerPipeline | None = None

    @instance_hook
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_callback_instances(trainer)
        self._gradkit_engine = engine = TrainerPipeline.of(trainer)
        engine.reset()

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = TrainerPipeline.of(trainer)
        engine.verify_layout(trainer, pl_module)
        for attach in self._gradkit_roster.attach:
            attach(engine.context(trainer, pl_module), pl_module)
        self._first_forward_done = False

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._first_forward_done:
            self._first_forward_done = True
            for before_first_forward in self._gradkit_roster.before_first_forward:
                before_first_forward(self._context(trainer, pl_module))

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        # Lightning calls it before every backward (`manual_backward` and closure re-evaluations included): the count
        # of backward passes tells a closure's later evaluation from a second run for the same gradients. A subclass
        # that overrides this hook calls it (one gradkit callback's count is enough: only a change is read).
        engine = self._gradkit_engine or TrainerPipeline.of(trainer)
        engine.pipeline.generation += 1
        # The unscaled loss costs a `detach` per micro-batch: only for a policy that reads it.
        for note_loss in self._gradkit_roster.note_loss:
            note_loss(unscaled_loss(trainer, loss), engine.context(trainer, pl_module))

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        (self._gradkit_engine or TrainerPipeline.of(trainer)).run(trainer, pl_module, optimizer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        for after_step in self._gradkit_roster.after_step:
            after_step(self._context(trainer, pl_module))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for finish in self._gradkit_roster.finish:
            finish(self._context(trainer, pl_module))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The hooks a policy put on the model and the optimizers leave them, as `GradKit.close()` removes them behind
        # the loop door.
        for detach in self._gradkit_roster.detach:
            detach(self._context(trainer, pl_module))
        self._gradkit_engine = None  # the callback keeps no Trainer's pipeline past the stage (a pickle stays small)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # After an error Lightning calls neither `on_train_end` nor `teardown`: the hooks leave here.
        for detach in self._gradkit_roster.detach:
            detach(self._context(trainer, pl_module))
        self._gradkit_engine = None

    @functools.cached_property
    def _gradkit_roster(self) -> Roster:
        """This policy's hooks, looked up once (Lightning calls some of them every micro-batch)."""
        return Roster.of(self)

    @staticmethod
    def _context(trainer: pl.Trainer, pl_module: pl.LightningModule) -> TrainerContext:
        return TrainerPipeline.of(trainer).context(trainer, pl_module)

    # -- checkpoints inside an accumulation window -----------------------------------------------------------------
    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if _first_gradkit_callback(trainer) is self:
            note_window_on_save(trainer, checkpoint)

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if _first_gradkit_callback(trainer) is self:
            note_window_on_load(trainer, checkpoint)
            _note_fresh_callbacks(trainer, checkpoint)


def _note_fresh_callbacks(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
    """Say, once, which stateful gradkit callbacks the checkpoint holds no state for (added at this restart): Lightning
    starts them fresh without a word, the loop and Hugging Face doors with this one. (A saved state whose callback is
    gone, Lightning itself reports: "callbacks used to create the checkpoint need to be provided".)"""
    saved = checkpoint.get("callbacks") or {}
    fresh = [
        cb.state_key
        for cb in trainer.callbacks
        if isinstance(cb, GradKitCallback)
        and type(cb).state_dict is not Callback.state_dict  # a callback without state has nothing to resume
        and cb.state_key not in saved
        and cb._legacy_state_key not in saved
    ]
    if fresh:
        rank_zero_warn(fresh_state_note(fresh))


def _first_gradkit_callback(trainer: pl.Trainer) -> GradKitCallback | None:
    """The gradkit callback that speaks for all of them where one message is enough."""
    return next((cb for cb in trainer.callbacks if isinstance(cb, GradKitCallback)), None)


def log_metrics(
    trainer: pl.Trainer, pl_module: pl.LightningModule, metrics: dict[str, Tensor], every_n_steps: int | None = None
) -> None:
    """Log step-level values so every attached Lightning logger receives them.

    The values are read to the host in one transfer and sent to ``trainer.loggers`` directly, as Lightning's
    ``LearningRateMonitor`` does, at the step Lightning logs under; those logged on the Trainer's own period also
    reach ``trainer.callback_metrics``. Not ``pl_module.log_dict``: per value it costs Lightning's bookkeeping and, at
    its flush, one ``.item()`` (a host sync each on a GPU); and a callback with a period of its own must not use
    ``self.log`` at all (Lightning keeps step values for the whole epoch and would flush stale ones on its own
    logging steps).
    """
    if not metrics:
        return
    values = values_to_host(metrics)
    step = batches_that_stepped(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(values, step=step)
    if every_n_steps is None or every_n_steps == trainer.log_every_n_steps:
        publish_callback_metrics(trainer, values)
