"""The Hugging Face ``transformers.Trainer`` door: gradkit's policies in HF's training loop, through the loop door.

One call installs it on a built ``Trainer``; the policies are the same objects the Lightning ``Trainer`` and the loop
door take::

    from gradkit.doors.huggingface import install

    args = TrainingArguments("out", logging_steps=10, save_steps=500)  # max_grad_norm=1.0, HF's default
    trainer = Trainer(model, args, train_dataset=train)
    install(trainer, [GradNormMonitor(), NonFiniteGuard(action="skip")])  # the door clips to max_grad_norm
    trainer.train()  # or trainer.train(resume_from_checkpoint=True)

The door is thin: each optimizer step runs :meth:`gradkit.GradKit.step` (measure once, decide once, write the
gradients once, step or skip), the only pipeline there is. What it adds is where HF's loop meets the loop door:

=======================================  ==============================================================================
HF's loop                                the door
=======================================  ==============================================================================
``training_step`` (each micro-batch)     hands the micro-batch's loss to ``kit.note_loss`` (scaled to the step loss HF
                                         logs), with a replay of ``compute_loss`` on the same inputs
``_clip_grad_norm`` (``max_grad_norm``)  taken over: ``ClipGradNorm(max_norm=max_grad_norm)`` runs in the pipeline
                                         (the same coefficient), after the guards and the monitor read the gradients
``_get_grad_norm`` (each step)           answers with the norm the pipeline measures: no second read and write of the
                                         gradients, and HF's logged ``grad_norm`` is the pre-clip norm
``optimizer.step()``                     ``kit.step``: the accumulation boundary is HF's (``sync_gradients``); with fp16
                                         the kit calls HF's ``GradScaler`` (``step``, ``update``) as accelerate would;
                                         a call outside HF's step (``on_pre_optimizer_step`` to ``on_optimizer_step``)
                                         is accelerate's own step
``optimizer_step_was_skipped``           true on a skipped step, so HF holds its LR scheduler as for an fp16 overflow
``on_step_end``                          the policies' logged values go to ``trainer.log``: HF's ``log_history`` and
                                         its reporters (TensorBoard, W&B, MLflow, ...), at HF's ``global_step``
``on_save`` / ``train(resume...)``       ``gradkit_state.pt`` (``kit.state_dict()``) in the checkpoint folder, loaded
                                         when ``train`` resumes from that folder
``on_train_end``                         ``kit.finish()``
=======================================  ==============================================================================

Why instance wrappers and not a ``Trainer`` subclass: the door then works on any ``Trainer`` subclass (TRL's
``SFTTrainer``, a user's ``compute_loss`` override), and a ``TrainerCallback`` alone sees neither the loss nor the
optimizer step. Each wrapper is set on the instance and calls the method it replaced.

HF and torch internals the door relies on, read in transformers 5.23.0, accelerate 1.15.0 and torch 2.13:

- ``Trainer._clip_grad_norm(model)`` clips before ``on_pre_optimizer_step``, where no callback can see the gradients
  unclipped; the door replaces it on the instance when ``max_grad_norm > 0`` (and refuses that setting without it).
- ``Trainer._get_grad_norm(model, grad_norm=None)`` computes the norm with ``clip_grad_norm_(max_norm=inf)`` at every
  optimizer step, whatever ``max_grad_norm``: a full read and a full write (``grads *= 1``) of the gradients, and with
  one non-finite gradient every gradient becomes NaN (``inf / nan``), so a guard could no longer name the parameter
  where it began. The door replaces it on the instance (only if HF has it).
- ``AcceleratedOptimizer._is_overflow`` is what ``step_was_skipped`` (and so HF's ``optimizer_step_was_skipped``)
  returns; no public setter exists.
- torch's LR schedulers wrap ``optimizer.step`` to record ``optimizer._opt_called`` and mark the wrapper
  ``_wrapped_by_lr_sched``; the door's ``step`` on the ``AcceleratedOptimizer`` does both, or torch warns at the
  first scheduler step that ``optimizer.step`` was overridden.
- Under FSDP, HF saves the optimizer through ``torch.distributed.checkpoint``, whose ``_init_optim_state`` steps an
  optimizer without state (SGD) with zero gradients and lr 0 at every save: not a training step, so the door steps
  only between HF's ``on_pre_optimizer_step`` and ``on_optimizer_step``.
- accelerate 1.15 turns FSDP on only on accelerator devices: with ``use_cpu=True`` it keeps ``MULTI_CPU`` and HF's
  Trainer trains under DDP without an error (``tests/distributed/hf_fsdp2.py`` sets FSDP on CPU as on GPUs).
"""

from __future__ import annotations

import functools
import logging
import math
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from gradkit.doors.loop import GradKit
from gradkit.doors.loop_setup import checked_policies
from gradkit.policies.clipping import ClipGradNorm
from gradkit.policies.rollback import SpikeRollback
from gradkit.step.gate import shadowed
from gradkit.step.protocol import Policy, Stage

try:
    import transformers
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, IntervalStrategy, get_last_checkpoint
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "gradkit.doors.huggingface needs `transformers` (and `accelerate`, which its Trainer uses): "
        "pip install 'lightning_gradkit[huggingface]'."
    ) from error

__all__ = ["STATE_FILENAME", "HFGradKit", "install"]

_log = logging.getLogger(__name__)

#: The policies' state in an HF checkpoint folder (``checkpoint-<step>/``), beside ``optimizer.pt``.
STATE_FILENAME = "gradkit_state.pt"

# What the door did with a checkpoint of non-finite state, for its warning.
_REFUSED_SAVE = "HF did not save it (no checkpoint folder written, none rotated out: the newest is the last good one)"
# Schedulers HF does not step per optimizer step (it steps them on an evaluation metric): not the door's to hold.
_METRIC_SCHEDULERS: tuple[type, ...] = tuple(
    cls
    for cls in (torch.optim.lr_scheduler.ReduceLROnPlateau, getattr(transformers.optimization, "GreedyLR", None))
    if cls is not None
)
# Each optimizer step runs in HF's loop in one process, under DDP and under FSDP2 (accelerate's `fully_shard`: the
# gradients are DTensor shards, which the loop door reduces itself). These engines step and clip by themselves.
_UNSUPPORTED = {
    DistributedType.DEEPSPEED: "DeepSpeed clips and skips inside its engine",
    DistributedType.XLA: "XLA is not supported by this door",
    DistributedType.MEGATRON_LM: "Megatron-LM steps inside its engine",
}


def install(
    trainer: Trainer, policies: Policy | Sequence[Policy], *, events: bool = True, check_checkpoints: bool = True
) -> HFGradKit:
    """Install gradkit's policies on a Hugging Face ``Trainer``: the one call the door needs.

    Call it after building the ``Trainer`` and before ``trainer.train()``. The door is added to the Trainer's
    callbacks; see :class:`HFGradKit` for what it does at each step.

    Args:
        trainer: the ``transformers.Trainer`` (or a subclass of it). Its ``max_grad_norm`` (1.0 by default) becomes
            the door's ``ClipGradNorm``; with ``max_grad_norm=0``, give the door the clipper you want, or none.
        policies: gradkit policies (instances): one, or a list of them, e.g. ``[GradNormMonitor(),
            NonFiniteGuard(action="skip")]``.
        events: write the guards' events to ``gradkit_events.jsonl`` in ``TrainingArguments.output_dir``.
        check_checkpoints: refuse to save a checkpoint whose parameters, buffers or optimizer state hold a NaN or an
            infinity (one host read per save, none at other steps); ``False``: HF saves whatever the state is.

    Returns:
        The installed door; its :attr:`~HFGradKit.kit` is the loop door of the current ``train()`` call.

    Raises:
        ValueError: if ``TrainingArguments.max_grad_norm > 0`` and ``policies`` holds a clipper (two clippers), the
            Trainer runs DeepSpeed, FSDP1, XLA or Megatron-LM, ``SpikeRollback(save_snapshots=True)`` under FSDP2
            with several processes, or already has a door (``install`` called twice); as ``GradKit`` for
            ``policies``.
        TypeError: as ``GradKit`` for ``policies``; if ``trainer`` is not a ``transformers.Trainer``.

    Example::

        >>> from transformers import Trainer, TrainingArguments
        >>> from gradkit import ZClip
        >>> from gradkit.doors.huggingface import install
        >>> args = TrainingArguments("out", max_grad_norm=0, use_cpu=True, report_to="none")
        >>> trainer = Trainer(model, args, train_dataset=train)  # doctest: +SKIP
        >>> door = install(trainer, [ZClip()])  # doctest: +SKIP
    """
    return HFGradKit(trainer, policies, events=events, check_checkpoints=check_checkpoints)


class HFGradKit(TrainerCallback):
    r"""gradkit's loop door inside a Hugging Face ``Trainer``: built by :func:`install`, which is how to make one.

    Each ``trainer.train()`` builds a :class:`~gradkit.GradKit` at ``on_train_begin`` on the Trainer's model, its
    torch optimizer (inside accelerate's ``AcceleratedOptimizer``), HF's ``GradScaler`` under fp16 and HF's LR
    scheduler, and runs every optimizer step through it. Everything the loop door does, it does here: the same
    parameters bitwise as the loop door for the same model, data and optimizer (``tests/test_hf_door.py``).

    - **Clipping**: the door takes HF's clipping over: ``max_grad_norm > 0`` (HF's default is 1.0) runs as
      ``ClipGradNorm(max_norm=max_grad_norm)`` in the pipeline, with the same coefficient as HF's ``clip_grad_norm_``
      but after the guards and the monitor have read the unclipped gradients (a warning says so). With
      ``max_grad_norm=0`` the door clips with the clipper given to it (any of gradkit's), or not at all; a clipper
      beside ``max_grad_norm > 0`` is refused. HF's logged ``grad_norm`` is the pre-clip total 2-norm the pipeline
      measured (the norm of the monitor's norm type when it measures no 2-norm), read only on HF's logging steps.
    - **Skips** (``NonFiniteGuard``, ``SpikeGuard``, ``SpikeRollback``): parameters, optimizer state and module
      buffers stay as they were, HF's LR scheduler holds (``optimizer_step_was_skipped``), ``global_step`` counts the
      step, as for an fp16 overflow. Under DDP and FSDP2 the decision is taken on every rank alike (one collective).
    - **FSDP2** (``fsdp=True``, ``fsdp_config={"version": 2}``, HF's default version): the gradients are DTensor
      shards; the norms, the clip and the skip are those of the whole model (one all-reduce per step), and HF's
      ``max_grad_norm`` is taken over as in one process. FSDP1 is refused with the fix.
    - **Losses**: each micro-batch's loss goes to the policies as HF logs it: ``training_step``'s value times the
      window's number of micro-batches, so their mean over the window is HF's step loss whether the model normalizes
      by the window's token count (``num_items_in_batch``) or HF divides by ``gradient_accumulation_steps``. Each
      comes with its replay for ``NonFiniteGuard``'s culprit search: ``compute_loss`` on the inputs HF gave it, on
      the unwrapped model, under HF's ``compute_loss_context_manager``; on a non-finite step the guard names the
      module, the operator and the source line where the first non-finite value appeared (with HF's default
      ``optim="adamw_torch_fused"``, which skips on device, from a replay at the next step).
    - **Logging**: the policies log on HF's logging steps (``logging_steps`` with ``logging_strategy="steps"``; with
      another strategy only their first and last steps); each logging step's values reach ``trainer.log`` once, at
      ``on_step_end``, under HF's ``global_step``.
    - **Checkpoints**: ``kit.state_dict()`` goes to ``gradkit_state.pt`` in each checkpoint folder HF writes
      (``save_steps``; from the process that saves, as HF's own files: the policies' state is the same on every rank,
      under FSDP2 too, but for ``SpikeRollback(save_snapshots=True)``, refused there);
      ``trainer.train(resume_from_checkpoint=...)`` loads it on every rank, so the policies resume as an uninterrupted
      run. A checkpoint without it resumes with fresh policies (a warning says so).
    - **Checkpoint health** (``check_checkpoints=True``, the default): before HF writes a checkpoint folder, the
      model's parameters and buffers and the optimizer state are checked (:meth:`gradkit.GradKit.checkpoint_is_finite`:
      one pass on the device, one host read per save, none at other steps; under DDP every rank's flags in one
      all-reduce). A non-finite state is not saved: at ``on_step_end`` / ``on_epoch_end`` the door clears
      ``control.should_save`` (so no callback's ``on_save`` runs), and a save decided later (``save_strategy="best"``)
      is refused in ``_save_checkpoint``; no folder is written and none is rotated out, so the newest folder is the
      last good one. The first refusal warns, naming the step and the tensors; each is a ``checkpoint_refused`` event.
    - **SpikeRollback**'s snapshots hold HF's LR scheduler; a rollback puts it back with the parameters and the
      optimizer state. A scheduler HF steps on a metric (``ReduceLROnPlateau``) is neither held nor rewound.

    Not supported: DeepSpeed, FSDP1, XLA and Megatron-LM (refused at :func:`install`), hyperparameter search (the
    state file goes to ``output_dir``'s checkpoint folders only). Installed once per ``Trainer`` (a second
    :func:`install` is refused): its wrappers stay on the instance, and each ``train()`` call builds a new loop door.

    Args:
        trainer: the ``Trainer`` to install on.
        policies: the gradkit policies (instances): one, or a list of them.
        events: write the guards' ``gradkit_events.jsonl`` into ``TrainingArguments.output_dir``.
        check_checkpoints: refuse to save a checkpoint of non-finite state.

    Raises:
        ValueError: see :func:`install`.
        TypeError: see :func:`install`.
    """

    def __init__(
        self,
        trainer: Trainer,
        policies: Policy | Sequence[Policy],
        *,
        events: bool = True,
        check_checkpoints: bool = True,
    ) -> None:
        if not isinstance(trainer, Trainer):
            raise TypeError(
                f"`trainer` must be a transformers.Trainer, got a {type(trainer).__name__}. For a loop of your own, "
                "use gradkit.GradKit."
            )
        _check_installed_once(trainer)
        checked = checked_policies(policies)
        _check_distributed(trainer, checked)
        self.policies = _clipping(trainer, checked)
        self.trainer = trainer
        self.events = events
        self.check_checkpoints = check_checkpoints
        # The step whose state was last checked for a save, and whether it was finite.
        self._checked: tuple[int, bool] | None = None
        #: The loop door of the current (or last) ``train()`` call; ``None`` before the first.
        self.kit: GradKit | None = None
        self._resume_from: str | None = None
        self._logged: dict[str, float] = {}
        self._grad_norm: Tensor | None = None
        self._scheduler: _HeldScheduler | None = None
        self._optimizer: AcceleratedOptimizer | None = None
        self._inner: Optimizer | None = None
        self._replaced_step: Any = None
        # Between HF's `on_pre_optimizer_step` and `on_optimizer_step`: the one `optimizer.step()` of HF's loop.
        self._in_hf_step = False
        # `compute_loss`'s inputs for the micro-batch in `training_step`, for its replay.
        self._capturing = False
        self._batch: tuple[dict[str, Any], tuple[Any, ...], dict[str, Any]] | None = None
        # The Trainer's own methods, called by the wrappers (which stay on the instance for its lifetime).
        self._train = trainer.train
        self._training_step = trainer.training_step
        self._compute_loss = trainer.compute_loss
        trainer.train = self._train_wrapper  # type: ignore[method-assign]
        trainer.training_step = self._training_step_wrapper  # type: ignore[method-assign]
        trainer.compute_loss = self._compute_loss_wrapper  # type: ignore[method-assign]
        if hasattr(trainer, "_get_grad_norm"):
            trainer._get_grad_norm = self._measured_grad_norm  # type: ignore[method-assign]
        if trainer.args.max_grad_norm and trainer.args.max_grad_norm > 0:
            trainer._clip_grad_norm = self._measured_grad_norm  # type: ignore[method-assign]  # the door clips
        self._save_checkpoint = trainer._save_checkpoint
        if check_checkpoints:
            trainer._save_checkpoint = self._checked_save  # type: ignore[method-assign]
        trainer.add_callback(self)

    # -- the Trainer's methods, wrapped ---------------------------------------------------------------------------
    def _train_wrapper(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``trainer.train``: note the checkpoint folder it resumes from (HF's resolution of ``True``: the newest
        ``checkpoint-*`` in ``output_dir``), whose ``gradkit_state.pt`` ``on_train_begin`` loads."""
        folder = resume_from_checkpoint
        if folder is True:
            folder = get_last_checkpoint(self.trainer.args.output_dir)  # HF raises the error when there is none
        self._resume_from = str(folder) if folder else None
        return self._train(resume_from_checkpoint, *args, **kwargs)

    def _training_step_wrapper(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Tensor:
        """``trainer.training_step``: forward and backward as HF does them, then the loss to the policies."""
        self._capturing, self._batch = True, None
        try:
            loss = self._training_step(model, inputs, *args, **kwargs)
        finally:
            self._capturing = False
        batch, self._batch = self._batch, None
        if self.kit is not None:
            # HF divided the loss by the window's micro-batches, or the model by the window's token count: times the
            # micro-batches, the window's mean of these is the step loss HF logs.
            window = getattr(self.trainer, "current_gradient_accumulation_steps", 1)
            step_loss = loss * window if window != 1 else loss
            # No replay when a `training_step` override computed its loss without `compute_loss`.
            self.kit.note_loss(step_loss, replay=functools.partial(self._replay, *batch) if batch else None)
        return loss

    def _compute_loss_wrapper(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """``trainer.compute_loss``: inside ``training_step``, keep the inputs (a shallow copy: ``compute_loss`` may
        pop ``labels``) for the replay."""
        if self._capturing:
            self._batch = (dict(inputs), args, kwargs)
        return self._compute_loss(model, inputs, *args, **kwargs)

    def _checked_save(self, model: nn.Module, trial: Any, *args: Any, **kwargs: Any) -> None:
        """``trainer._save_checkpoint``: HF's save of a checkpoint folder, only when the state is finite (a save that
        ``on_step_end`` could not see coming: ``save_strategy="best"`` decides after the evaluation)."""
        if self._state_is_finite():
            self._save_checkpoint(model, trial, *args, **kwargs)

    def _state_is_finite(self) -> bool:
        """Whether the model and the optimizer state are finite at HF's current step: checked once per step (a refusal
        warns and writes its event then), on every rank (a collective under DDP)."""
        if self.kit is None or not self.check_checkpoints:
            return True
        step = self.trainer.state.global_step
        if self._checked is None or self._checked[0] != step:
            self._checked = (step, bool(self.kit._check_checkpoint(type(self).__name__, _REFUSED_SAVE)))
        return self._checked[1]

    def _refuse_due_save(self, control: TrainerControl) -> None:
        """At the end of a step or an epoch: a save HF has decided on is cancelled when the state is not finite."""
        if control.should_save and not self._state_is_finite():
            control.should_save = False

    def _replay(self, inputs: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
        """The micro-batch's loss again: ``compute_loss`` on the unwrapped model (the replay differentiates with
        ``torch.autograd.grad``, which DDP's wrapper does not expect), under HF's autocast context."""
        with self.trainer.compute_loss_context_manager():
            out = self._compute_loss(self.trainer.model, dict(inputs), *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def _measured_grad_norm(self, model: nn.Module, grad_norm: Tensor | float | None = None) -> Tensor | float | None:
        """``trainer._get_grad_norm``: unscale (fp16) as HF does before its norm, and answer with a device scalar that
        the optimizer step fills with the pipeline's pre-clip norm; HF reads it on its logging steps only."""
        if grad_norm is not None:  # `_clip_grad_norm` (this method too) answered first
            return grad_norm
        self.trainer.accelerator.unscale_gradients()
        return self._grad_norm

    # -- the optimizer step -----------------------------------------------------------------------------------------
    def _optimizer_step(self, closure: Callable[[], Any] | None = None) -> None:
        """``optimizer.step()`` of HF's ``AcceleratedOptimizer``: the loop door's step, then what accelerate's step
        records (a skipped step for ``optimizer_step_was_skipped``)."""
        accelerated, inner, kit = self._optimizer, self._inner, self.kit
        assert accelerated is not None and inner is not None and kit is not None
        accelerated._opt_called = True  # what torch's LR-scheduler wrapper of `step` records (see the module notes)
        if not self._in_hf_step:
            # A step outside HF's loop: under FSDP, saving or loading the optimizer state through
            # torch.distributed.checkpoint first steps a stateless optimizer (SGD) with zero gradients and lr 0
            # (`_init_optim_state`). Not a training step: accelerate's own, as without the door.
            step = self._replaced_step or functools.partial(type(accelerated).step, accelerated)
            step(**({} if closure is None else {"closure": closure}))
            return
        if not accelerated.gradient_state.sync_gradients:  # as accelerate: no step inside an accumulation window
            return
        kwargs = {} if closure is None else {"closure": closure}
        if self.trainer.accelerator.scaler is None:
            applied = kit.step(inner, **kwargs)
        else:
            applied = _counted_step(kit, inner, kwargs)
        record = kit.pipeline.last_records.get(id(inner))
        # A fused optimizer's skip is only on device: one read, which HF's scheduler decision needs anyway.
        skipped = applied is False or (applied is None and record is not None and record.skip_on_host())
        accelerated._is_overflow = skipped
        if self._scheduler is not None:
            self._scheduler.due = False  # HF steps (or holds) its scheduler next
        if record is not None and self._grad_norm is not None:
            stats = record.stats
            norm_type = 2.0 if 2.0 in stats.norms else stats.primary_norm_type
            self._grad_norm.copy_(record.decision.scaled(stats.norms[norm_type].total))

    # -- callback hooks ---------------------------------------------------------------------------------------------
    @override
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        trainer = self.trainer
        self._release()
        accelerated = trainer.optimizer
        if not isinstance(accelerated, AcceleratedOptimizer) or not hasattr(accelerated, "_is_overflow"):
            raise RuntimeError(
                f"HFGradKit: the Trainer's optimizer is a {type(accelerated).__name__}, not accelerate's "
                "AcceleratedOptimizer with a `_is_overflow` flag (accelerate 1.15): the door cannot hold HF's LR "
                "scheduler on a skipped step. Report the transformers and accelerate versions."
            )
        inner = accelerated.optimizer
        scheduler = trainer.lr_scheduler
        held = scheduler is not None and not isinstance(scheduler, _METRIC_SCHEDULERS)
        self._scheduler = _HeldScheduler(scheduler, inner) if held else None
        self.kit = GradKit(
            trainer.model,
            inner,
            self.policies,
            log=self._collect,
            log_every_n_steps=state.logging_steps if args.logging_strategy == IntervalStrategy.STEPS else 0,
            scaler=trainer.accelerator.scaler,
            schedulers=[self._scheduler] if held else (),
            max_steps=state.max_steps,
            log_dir=args.output_dir if self.events else False,
        )
        self._optimizer, self._inner = accelerated, inner
        self._grad_norm = torch.full((), math.nan, device=self.kit.ctx.device)
        if self._resume_from is not None:
            self._load(Path(self._resume_from), state)
        step = functools.partial(HFGradKit._optimizer_step, self)
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # see the module notes
        self._replaced_step = accelerated.__dict__.get("step")
        self._in_hf_step = False
        accelerated.step = step  # type: ignore[method-assign]

    @override
    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._in_hf_step = True

    @override
    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._in_hf_step = False

    @override
    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        # `trainer.log` clears `should_log` (HF's `on_log`), which `DefaultFlowCallback` has just set for HF's own
        # row of this step: keep it.
        should_log = control.should_log
        self._flush()
        control.should_log = self.trainer.control.should_log = should_log
        self._refuse_due_save(control)
        return control

    @override
    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        self._refuse_due_save(control)
        return control

    @override
    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.kit is None or not args.should_save:
            return
        if not self._state_is_finite():
            return  # HF's `on_save` after a save `_checked_save` refused: no folder, nothing to add to it
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if not folder.is_dir():
            warnings.warn(
                f"HFGradKit: no checkpoint folder {folder} to save the policies' state in (a hyperparameter search "
                "saves elsewhere); a run resumed from this checkpoint starts them fresh.",
                UserWarning,
                stacklevel=2,
            )
            return
        torch.save(self.kit.state_dict(), folder / STATE_FILENAME)

    @override
    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.kit is not None:
            self.kit.finish()
            self._flush()
        self._release()

    # -- helpers ----------------------------------------------------------------------------------------------------
    def _collect(self, metrics: dict[str, float], step: int) -> None:
        """The loop door's log function: keep the step's values for ``on_step_end`` (``global_step`` counted)."""
        self._logged.update(metrics)

    def _flush(self) -> None:
        if self._logged:
            values, self._logged = self._logged, {}
            self.trainer.log(values)

    def _load(self, folder: Path, state: TrainerState) -> None:
        """Load the policies' state saved in the checkpoint folder the run resumes from."""
        assert self.kit is not None
        path = folder / STATE_FILENAME
        if not path.is_file():
            warnings.warn(
                f"HFGradKit: the checkpoint {folder} holds no {STATE_FILENAME} (saved without the door, or by an "
                "older run): the policies start fresh (statistics, counters), the model and optimizer resume.",
                UserWarning,
                stacklevel=2,
            )
            return
        # Our own file of plain Python and tensors: `weights_only=False` keeps the policies' objects as saved.
        self.kit.load_state_dict(torch.load(path, map_location=self.kit.ctx.device, weights_only=False))
        if self.kit.ctx.step != state.global_step:
            warnings.warn(
                f"HFGradKit: {path} was saved at step {self.kit.ctx.step}, HF resumes at step {state.global_step}: "
                "the folder's files come from different runs.",
                UserWarning,
                stacklevel=2,
            )

    def _release(self) -> None:
        """Undo what the current ``train()`` call set on its optimizer and close its kit, once: at the end of training,
        or at the next ``train()`` after one that raised. The kit stays readable (``skipped_steps``, ``state_dict``)."""
        if self._optimizer is None:
            return
        if self._replaced_step is None:
            del self._optimizer.step
        else:
            self._optimizer.step = self._replaced_step  # type: ignore[method-assign]
        self._optimizer = self._inner = self._replaced_step = None
        if self.kit is not None:
            self.kit.close()


def _counted_step(kit: GradKit, inner: Optimizer, kwargs: dict[str, Any]) -> bool | None:
    """``kit.step(inner)`` under a ``GradScaler``, which skips an overflowing step without the door knowing: whether
    ``inner.step`` ran tells the scaler's skip from a step it applied, as accelerate's own patch of ``step`` does.
    Returns ``kit.step``'s answer, ``False`` when the scaler skipped the step."""
    ran: list[bool] = []
    original = inner.step

    def counted(*args: Any, **kw: Any) -> Any:
        ran.append(True)
        return original(*args, **kw)

    with shadowed(inner, step=counted):
        applied = kit.step(inner, **kwargs)
    return applied if ran else False


class _HeldScheduler:
    """HF's LR scheduler as the loop door sees it (``GradKit(schedulers=...)``): for snapshots, never stepped by it.

    HF steps its scheduler itself, right after ``optimizer.step()`` returns, unless the step was skipped. The loop door
    would step it inside, before its policies' ``after_step`` (where ``SpikeRollback`` takes a snapshot); here its
    ``step`` only records that HF's step is due, and a snapshot taken then says so (``hf_step_due``): restoring it
    steps the scheduler once after loading, which gives the state of the uninterrupted schedule.
    """

    def __init__(self, scheduler: Any, optimizer: Optimizer) -> None:
        self.scheduler = scheduler
        self.optimizer = optimizer  # the loop door pairs a scheduler with its optimizer
        self.due = False

    def step(self) -> None:
        self.due = True

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "hf_step_due": self.due}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        if state["hf_step_due"]:
            self.scheduler.step()


def _clipping(trainer: Trainer, policies: list[Policy]) -> list[Policy]:
    """The policies with HF's clipping taken over: ``max_grad_norm > 0`` becomes ``ClipGradNorm(max_grad_norm)`` in
    the pipeline (the same coefficient as HF's ``clip_grad_norm_``), so that the guards and the monitor see the
    gradients before clipping, measured once.

    Raises:
        ValueError: ``max_grad_norm > 0`` beside a clipper of the door's (two clippers), or a Transformers without
            ``Trainer._clip_grad_norm`` to take over.
    """
    max_norm = trainer.args.max_grad_norm
    if not max_norm or max_norm <= 0:
        return policies
    clippers = [type(p).__name__ for p in policies if p.stage is Stage.CLIP]
    if clippers:
        raise ValueError(
            f"TrainingArguments(max_grad_norm={max_norm}) (1.0 is HF's default) and {clippers[0]} would both clip "
            f"the gradients. Set `max_grad_norm=0` to clip with {clippers[0]} only, or leave {clippers[0]} out for "
            f"the door to clip as HF does (ClipGradNorm(max_norm={max_norm}))."
        )
    if not hasattr(trainer, "_clip_grad_norm"):
        raise ValueError(
            f"TrainingArguments(max_grad_norm={max_norm}): this Transformers ({transformers.__version__}) clips "
            "inside its loop, before gradkit's policies see the gradients, and the door cannot take that over. Set "
            f"`max_grad_norm=0` and give the door `ClipGradNorm(max_norm={max_norm})` for the same clipping."
        )
    # Nothing is wrong (HF's default clipping, done as HF does it): a note at info level, not a warning every run.
    _log.info(
        "HFGradKit clips for HF: TrainingArguments(max_grad_norm=%s) runs as ClipGradNorm(max_norm=%s) in the door's "
        "pipeline, after the guards' measurement (the same coefficient as HF's).",
        max_norm,
        max_norm,
    )
    return [*policies, ClipGradNorm(max_norm=max_norm)]


def _check_installed_once(trainer: Trainer) -> None:
    """Refuse a second door on one ``Trainer``: each would wrap the other's methods and step the optimizer through
    its own loop door, and the first, whose steps never come, would warn at the end that none went through it."""
    installed = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, HFGradKit)]
    if installed:
        names = ", ".join(type(p).__name__ for p in installed[0].policies) or "no policy"
        raise ValueError(
            f"`trainer` already has gradkit's door (with {names}): `install` was called on it before, and a "
            "second door would run every step twice. Call `install(trainer, [...])` once, with every policy in the "
            "list, e.g. `install(trainer, [GradNormMonitor(), NonFiniteGuard(action='skip')])`."
        )


def _check_distributed(trainer: Trainer, policies: Sequence[Policy]) -> None:
    """Refuse the engines that step and clip by themselves, FSDP1, and what FSDP2 shards that a checkpoint of rank
    0's would not hold, with the fix."""
    accelerator = trainer.accelerator
    why = _UNSUPPORTED.get(accelerator.distributed_type)
    if why is not None:
        raise ValueError(
            f"The Trainer runs {accelerator.distributed_type.value}: {why}. The door supports one process, DDP and "
            "FSDP2 (torchrun / accelerate launch without DeepSpeed, or with `fsdp=True`)."
        )
    if accelerator.distributed_type != DistributedType.FSDP:
        return
    if not accelerator.is_fsdp2:
        # FSDP1 hands each rank flat shards that mix several parameters: the loop door tells them from whole
        # parameters only under Fabric, and would count them here as parameters the same on every rank.
        raise ValueError(
            "The Trainer runs FSDP1 (`fsdp_config={'version': 1}`), whose flat gradient shards the door cannot read "
            "per parameter. Use FSDP2: `fsdp_config={'version': 2}` (HF's default, `FSDP_VERSION=2` under "
            "accelerate launch); FSDP1 is deprecated in Transformers."
        )
    saving = [p for p in policies if isinstance(p, SpikeRollback) and p.save_snapshots]
    if saving and accelerator.num_processes > 1:
        raise ValueError(
            "SpikeRollback(save_snapshots=True) saves its snapshots in gradkit_state.pt, which the door writes from "
            "the process that saves (rank 0, as HF's own files), but under FSDP2 every rank's snapshots hold its own "
            "shards. Use `save_snapshots=False`: a resumed run then takes its first snapshot at the resume."
        )
