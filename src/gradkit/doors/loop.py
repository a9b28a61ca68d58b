"""The Fabric and plain-PyTorch front door: gradkit's step pipeline in a loop you write yourself.

The Lightning ``Trainer`` reaches the pipeline through callbacks and a strategy; a loop of your own (plain PyTorch,
``torch.distributed`` or not, or Lightning Fabric, as litgpt's pretraining script is) reaches the same pipeline
through :class:`GradKit`: the same policy objects (``GradNormMonitor``, ``ClipGradNorm``, ``ZClip``,
``NonFiniteGuard``, ``SpikeGuard``, ...), the same one read and one write of the gradients, the same skip decided
identically on every rank, the same logged values. For the same model, data and seed the three doors give the same
parameters bitwise (``tests/test_front_doors.py``).

Where a step stands in your loop::

    loss = model(batch)                 # (AMP autocast, as you like)
    fabric.backward(loss)               # or loss.backward(), or scaler.scale(loss).backward()
    kit.note_loss(loss, replay=lambda: loss_fn(model(batch)))  # optional: loss checks, spikes, the culprit replay
    kit.step(optimizer)                 # measure, decide, write the gradients once, step unless skipped
    optimizer.zero_grad(set_to_none=True)

With gradient accumulation, call :meth:`GradKit.step` once per window, after its last backward (the loss you pass
to :meth:`~GradKit.note_loss` is each micro-batch's, before any division).

Map of this file: :class:`LoopContext` (what the pipeline reads of the loop: a step counter, the optimizers, the
scaler, the log function) and :class:`GradKit` (the door: setup checks, :meth:`~GradKit.step` and its gate, the
buffers a skipped step put back, state for checkpoints).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from gradkit._util.arguments import check_int
from gradkit._util.torch_compat import gradients_still_scaled, loss_scale
from gradkit.doors.distributed_checkpoint import DistributedState
from gradkit.doors.loop_setup import (
    checked_door_arguments,
    checked_policies,
    checked_schedulers,
    events_dir,
    fabric_flat_sharded,
    fabric_scaler,
    matched_states,
    root_module,
    watches_loss,
)
from gradkit.policies.culprit import MicroBatch
from gradkit.report.events import EventLog
from gradkit.step.accounting import StepAccounting
from gradkit.step.gate import close_step, shadowed, step_as_decided
from gradkit.step.pipeline import Pipeline, StepRecord
from gradkit.step.protocol import Door, Policy, Roster, policy_key, unwrapped, values_to_host
from gradkit.step.rank_check import verify_same_layout
from gradkit.step.replay import RNGState, capture_rng
from gradkit.step.snapshot import Snapshot
from gradkit.step.state_check import CHECKPOINT_REFUSED, FiniteCheck, checkpoint_is_finite, refusal_message

__all__ = ["GradKit", "LoopContext"]

#: ``log(metrics, step)``: where logged values go (``fabric.log_dict`` has this signature).
_LogFn = Callable[[dict[str, float], int], Any]


class LoopContext(Door):
    """The loop as :class:`GradKit` sees it: its own step counter, the optimizers, the scaler and a log function.

    Args:
        model: the module being trained (wrappers removed).
        optimizers: every optimizer the loop steps, in a fixed order.
        log: ``log(metrics, step)`` called once per logging step with every policy's values as host floats;
            ``None`` drops them.
        log_every_n_steps: the logging period in optimizer steps (0: never).
        scaler: the fp16 ``GradScaler`` whose scale the gradients carry until it unscales them, or ``None``.
        max_steps: the loop's last step, if known (the monitor then also logs the last step).
        log_dir: where the guards write ``gradkit_events.jsonl``; ``None``: no event file.
        flat_sharded: whether every gradient is a flat FSDP1 shard.
        schedulers: the LR schedulers the loop's snapshots hold.
        policies: the loop's policies.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizers: Sequence[Optimizer],
        log: _LogFn | None,
        log_every_n_steps: int,
        scaler: torch.amp.GradScaler | None,
        max_steps: int | None,
        log_dir: Path | None,
        flat_sharded: bool,
        schedulers: Sequence[Any] = (),
        policies: Sequence[Policy] = (),
    ) -> None:
        self._model = model
        self._schedulers = list(schedulers)
        self._pipeline = Pipeline()
        self._policies = list(policies)
        self._optimizers = list(optimizers)
        self._log = log
        # The step's logged values, sent in one call of `log` by `flush_log` at the end of the step.
        self._logged: dict[str, Tensor] = {}
        self._logged_host: dict[str, float] = {}
        self._log_every_n_steps = log_every_n_steps
        self.scaler = scaler
        self.max_steps = max_steps
        self._log_dir = log_dir
        self._loggers: Sequence[Any] = ()
        self._window_buffers: Snapshot | None = None
        self._flat_sharded = flat_sharded
        self.step = 0
        self.micro_batches = 0
        #: The module the loop calls (a ``DistributedDataParallel``, Fabric's wrapper), where
        #: ``GradNormMonitor(noise_scale=True)`` reads each rank's local gradient; set by :class:`GradKit`.
        self.wrapped_model: nn.Module | None = None
        first = next(model.parameters(), None)
        self._device = first.device if first is not None else torch.device("cpu")

    @property
    @override
    def optimizers(self) -> Sequence[Optimizer]:
        return self._optimizers

    @property
    @override
    def device(self) -> torch.device:
        return self._device

    @property
    @override
    def global_step(self) -> int:
        return self.step

    @property
    @override
    def log_every_n_steps(self) -> int:
        return self._log_every_n_steps

    @override
    def step_key(self) -> tuple[int, ...]:
        return (self.step,)

    @override
    def is_logging_step(self, every_n_steps: int | None = None) -> bool:
        n = self._log_every_n_steps if every_n_steps is None else every_n_steps
        return n != 0 and (self.step + 1) % n == 0

    @property
    @override
    def batch_idx(self) -> int:
        # The current micro-batch when the loop hands its losses over (`note_loss`), else the step.
        return self.micro_batches - 1 if self.micro_batches else self.step

    @property
    @override
    def model(self) -> nn.Module:
        return self._model

    @property
    @override
    def log_dir(self) -> Path | None:
        return self._log_dir

    @property
    @override
    def loggers(self) -> Sequence[Any]:
        return self._loggers

    @loggers.setter
    def loggers(self, loggers: Sequence[Any]) -> None:
        self._loggers = loggers

    @property
    @override
    def window_buffers(self) -> Snapshot | None:
        return self._window_buffers

    @window_buffers.setter
    def window_buffers(self, buffers: Snapshot | None) -> None:
        self._window_buffers = buffers

    @property
    def pipeline(self) -> Pipeline:
        """The loop's pipeline (the door's own: a policy reads its :attr:`steps`)."""
        return self._pipeline

    @property
    @override
    def steps(self) -> StepAccounting:
        return self._pipeline.steps

    @override
    def policies(self) -> list[Policy]:
        return self._policies

    @override
    def schedulers(self) -> list[object]:
        return self._schedulers

    @override
    def param_names(self) -> dict[int, str]:
        return {id(p): n for n, p in self._model.named_parameters()}

    @override
    def flat_sharded(self) -> bool:
        return self._flat_sharded

    @override
    def steps_through_gate(self) -> bool:
        return True  # `GradKit.step` gates every optimizer step

    @override
    def loss_scale(self, optimizer: Optimizer) -> Tensor | None:
        if self.scaler is None:
            return None
        scale = loss_scale(self.scaler)
        if scale is None or not gradients_still_scaled(self.scaler, optimizer):
            return None
        return scale

    @override
    def loss_scale_source(self) -> object | None:
        return self.scaler

    @override
    def is_last_step(self) -> bool:
        return self.max_steps is not None and self.step + 1 >= self.max_steps

    @override
    def log(self, metrics: dict[str, Tensor], every_n_steps: int | None = None) -> None:
        if self._log is not None:
            self._logged.update(metrics)

    @override
    def log_values(self, values: dict[str, float]) -> None:
        if self._log is not None:
            self._logged_host.update(values)

    def flush_log(self, step: int) -> None:
        """Send what every policy logged during the step in one call of ``log`` (one row of Fabric's CSV per step,
        not one per policy), the device values read in one transfer."""
        if self._log is None or not (self._logged or self._logged_host):
            return
        values = values_to_host(self._logged) if self._logged else {}
        values.update(self._logged_host)
        self._logged, self._logged_host = {}, {}
        self._log(values, step)


class GradKit:
    r"""gradkit's engine in a loop of your own: plain PyTorch (``torch.distributed`` optional) or Lightning Fabric.

    Give it the model, the optimizers and the policies, the same objects a ``Trainer`` takes as callbacks. Each
    optimizer step, :meth:`step` runs the pipeline once (measure the gradients once, one all-reduce under DDP/FSDP,
    decide, write the gradients once) and steps the optimizer, or, when a guard decided to skip, leaves parameters,
    optimizer state and module buffers exactly as they were. No host synchronization off logging steps, except the
    one read of the skip flag with an ordinary optimizer when a policy may skip (none with a fused optimizer).

    Policies that work here, each imported from ``gradkit``: ``GradNormMonitor`` (``prog_bar`` needs a Trainer,
    ``report`` an events directory: not ``log_dir=False``), ``ClipGradNorm``, ``ClipGradValue``, ``AutoClip``,
    ``ZClip``, ``AdaptiveGradClip``, ``NonFiniteGuard`` (``skip``/``warn``/``raise``; its culprit replay runs the
    closures given to :meth:`note_loss`), ``SpikeGuard``, ``SpikeRollback`` (its snapshots hold the model's
    parameters and buffers, the optimizer state, the ``schedulers`` given here, RNG and the other policies' state),
    ``EarlyWarning`` (its SpikeScore reads the losses given to :meth:`note_loss`), ``StepsToSkip`` (ask
    :attr:`drops_batch` before the forward), ``QKClip`` and ``UpdateClip`` (they rescale after the optimizer step),
    ``EscalationLadder`` (its stop, raised out of :meth:`step`, ends the process with its exit code).
    Callbacks that drive the Trainer's loop (``AccumulationGuard``, ``ActivationCheckpointing``, ...) are refused with
    the reason.

    Each LR scheduler given as ``schedulers`` belongs to the optimizer it was built on (``scheduler.optimizer``):
    :meth:`step` steps it after that optimizer's applied steps and holds it on a skipped one (as the Trainer's
    gradkit strategy holds step-interval schedulers); with two optimizers (a GAN) each scheduler steps once per
    iteration, with its own optimizer. A ``ReduceLROnPlateau`` is refused: it needs a metric, so step it yourself,
    e.g. after validation, or only when :meth:`step` returned ``True``.

    Under ``torch.compile`` give the door the module you compiled or its compiled wrapper (``torch.compile(model)``,
    ``model.compile()``, ``fabric.setup(torch.compile(model))``, ``torch.compile(fabric.setup(model))``): the
    policies add no frame, graph or graph break to what dynamo compiles (``docs/compile.md``). A compiled function
    that calls the model (``torch.compile(train_step)``) traces the door's first-forward hook (put there when a
    policy may skip) and breaks its graph there: compile the module.

    Under Fabric with FSDP2 (``ModelParallelStrategy``), build the optimizer after ``fabric.setup_module(model)``
    (and pass it to ``fabric.setup_optimizers``): one built before sharding holds the unsharded parameters.

    Args:
        model: the module being trained (Fabric's wrapper or a ``DistributedDataParallel`` is fine).
        optimizers: the optimizer, or a list of them (Fabric's wrappers are fine).
        policies: the gradkit policies (instances): one, or a list of them.
        log: ``log(metrics: dict[str, float], step: int)``, called once per logging step with every policy's values
            (one row per step); ``fabric.log_dict`` fits.
            ``None``: the values are not logged (the policies still act).
        log_every_n_steps: logging period in optimizer steps (0: never), as ``Trainer(log_every_n_steps=...)``.
        scaler: the fp16 ``GradScaler`` of a plain loop; :meth:`step` then calls ``scaler.step`` and
            ``scaler.update``. Under Fabric leave it ``None``: it is read from ``fabric``.
        schedulers: step-interval LR schedulers (one or a list), each stepped by :meth:`step` after its own
            optimizer's applied steps.
        fabric: the ``Fabric`` object of a Fabric loop: its logger, precision plugin and strategy are used.
        max_steps: the loop's number of optimizer steps, if known (the monitor then also logs the last step).
        log_dir: directory of the guards' ``gradkit_events.jsonl`` and the monitor's report. ``None`` (the
            default): the directory of Fabric's first logger (its ``log_dir``), else ``./gradkit_logs`` (the working
            directory's, as the Trainer falls back to ``./lightning_logs``). ``False``: no event file.

    Raises:
        TypeError: if ``policies`` is neither a policy nor a list, or a policy is a class instead of an instance, or
            not a gradkit policy; if an argument is not the kind of object it takes (``model`` an ``nn.Module``,
            ``optimizers`` torch optimizers, ``log`` a function, ``scaler`` a ``GradScaler``, ``schedulers`` LR
            schedulers, ``fabric`` a ``Fabric``, ``log_dir`` a path), naming it.
        ValueError: if a policy needs a Lightning ``Trainer``, two clippers are given, ``log_every_n_steps`` < 0,
            ``max_steps`` < 1, a scheduler is a ``ReduceLROnPlateau`` or was built on an optimizer not given here.

    Example::

        >>> import torch
        >>> from gradkit import ClipGradNorm, GradKit, GradNormMonitor, NonFiniteGuard
        >>> model = torch.nn.Linear(4, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> logged = []
        >>> kit = GradKit(model, optimizer, [GradNormMonitor(), ClipGradNorm(1.0), NonFiniteGuard()],
        ...               log=lambda metrics, step: logged.append(metrics), log_every_n_steps=1)
        >>> model(torch.ones(2, 4)).sum().backward()
        >>> kit.step(optimizer)
        True
        >>> sorted(logged[0])[:2]
        ['grad_clip/clipped_fraction', 'grad_clip/coef']
    """

    def __init__(
        self,
        model: nn.Module,
        optimizers: Optimizer | Sequence[Optimizer],
        policies: Policy | Sequence[Policy],
        *,
        log: _LogFn | None = None,
        log_every_n_steps: int = 50,
        scaler: torch.amp.GradScaler | None = None,
        schedulers: Any = (),
        fabric: Any = None,
        max_steps: int | None = None,
        log_dir: str | Path | Literal[False] | None = None,
    ) -> None:
        optimizers = checked_door_arguments(model, optimizers, log, scaler, fabric, max_steps, log_dir)
        check_int(
            "log_every_n_steps", log_every_n_steps, 0, hint="Use e.g. 50 (Lightning's default), or 0 to log nothing."
        )
        self.policies = checked_policies(policies)
        inner = [unwrapped(opt) for opt in optimizers]
        owned = checked_schedulers(schedulers, inner)
        if fabric is not None:
            log = fabric.log_dict if log is None else log
            scaler = fabric_scaler(fabric) if scaler is None else scaler
        self._own_scaler = fabric is None and scaler is not None
        root = root_module(model)
        self.ctx = LoopContext(
            root,
            optimizers,
            log,
            log_every_n_steps,
            scaler,
            max_steps,
            events_dir(log_dir, fabric),
            fabric_flat_sharded(fabric) if fabric is not None else False,
            [scheduler for scheduler, _ in owned],
            self.policies,
        )
        self.ctx.wrapped_model = model  # the DDP module the noise scale hooks (`GradNormMonitor(noise_scale=True)`)
        self.ctx.loggers = list(getattr(fabric, "loggers", ()))  # Fabric's (Lightning) loggers: the monitor's report
        self.pipeline = self.ctx.pipeline
        # Each optimizer's own schedulers: `step(opt)` steps, or holds on a skip, only these.
        self._schedulers_of: dict[int, list[Any]] = {}
        for scheduler, owner in owned:
            self._schedulers_of.setdefault(id(owner), []).append(scheduler)
        verify_same_layout(inner, self.ctx.param_names(), root)
        self._inner = {id(opt): unwrapped(opt) for opt in optimizers}
        self._hooks = Roster(self.policies)  # every hook this door calls, looked up once
        for attach in self._hooks.attach:
            attach(self.ctx, root)
        self._start_run_state(model)
        if self._hooks.any_may_skip():
            self._keep_buffers(root)

    def _start_run_state(self, model: nn.Module) -> None:
        """What the door keeps of the run it serves: nothing yet."""
        # What a loop that bypasses the door would not notice: no `kit.step` at all, no `note_loss` for a loss watcher.
        self._steps_through_kit = 0
        self._finished = False
        self._refused_checkpoints = 0
        self._loss_watchers = [f"{type(p).__name__}(monitor='loss')" for p in self.policies if watches_loss(p)]
        self._buffers: Snapshot | None = None
        self._first_forward: list[Any] = []
        # The module the loop calls (a `torch.compile` or Fabric wrapper included): its forward pre-hook runs eagerly,
        # before dynamo traces what it wraps.
        self._called = model
        # The torch RNG state where the next micro-batch's forward starts, kept while the loop hands over replays.
        self._rng: RNGState | None = None

    def _keep_buffers(self, root: nn.Module) -> None:
        """What a skipped step's forwards wrote into the buffers (BatchNorm statistics) is put back: a window opens
        when the previous step ends (`step`), the first one (and the first after `load_state_dict`) at the first
        forward of any submodule, whatever calls it (a `no_grad` pass, a `model.loss(...)` method)."""
        self._buffers = self.ctx.window_buffers = Snapshot(root)
        self._arm_first_forward()

    def _arm_first_forward(self) -> None:
        """Capture the buffers at the next forward of any submodule, once (the hooks then remove themselves)."""
        if self._buffers is None or self._first_forward:
            return
        self._buffers.drop()
        handles: list[Any] = []
        hook = functools.partial(_open_first_window, weakref.ref(self), handles)
        modules = {id(m): m for m in (*self._called.modules(), *self.ctx.model.modules())}
        handles.extend(m.register_forward_pre_hook(hook) for m in modules.values())
        self._first_forward = handles

    def _opened(self) -> None:
        self._first_forward = []
        for before_first_forward in self._hooks.before_first_forward:
            before_first_forward(self.ctx)
        if self._buffers is not None and not self._buffers.captured:
            self._buffers.capture()

    def note_loss(self, loss: Tensor, replay: Callable[[], Tensor | None] | None = None) -> None:
        """Hand a micro-batch loss (as the loss function returned it, without an AMP scale) to the policies that
        watch it: ``NonFiniteGuard``'s loss check and ``SpikeGuard(monitor="loss")``. No host sync.

        Args:
            loss: the micro-batch's loss, before any division for accumulation.
            replay: a closure that runs the micro-batch's forward again and returns its loss, e.g.
                ``lambda: loss_fn(model(batch))`` (under the same autocast as the training forward). On a
                non-finite step ``NonFiniteGuard`` replays the step's micro-batches once through it, as the Trainer
                replays ``training_step``, and names the module, the operator and the source line where the
                non-finite value began; the model's RNG states, buffers and ``.grad`` are restored afterwards.
                The torch RNG state is saved when the previous micro-batch was handed over (or the previous
                step ended), so dropout masks repeat unless the loop draws random numbers in between (a shuffling
                ``DataLoader`` starting an epoch). Call the unwrapped model (``model.module`` under DDP): the
                replay differentiates with ``torch.autograd.grad``, which DDP's wrapper does not expect. Kept
                while a replay may run: until the step's flag is read (with a fused optimizer, at the next step).
        """
        ctx = self.ctx
        ctx.micro_batches += 1  # the policies that keep the loss detach it (none may keep it)
        if not self._hooks.note_loss:  # no policy reads the losses: none keeps a replay
            self._rng = None
            return
        ctx.micro_batch = None if replay is None else MicroBatch(ctx.batch_idx, replay, self._rng)
        for note_loss in self._hooks.note_loss:
            note_loss(loss, ctx)
        ctx.micro_batch = None
        # Where the next micro-batch's replay would start.
        self._rng = capture_rng(full=False) if replay is not None else None

    def step(self, optimizer: Optimizer | None = None, **kwargs: Any) -> bool | None:
        """Run the pipeline for ``optimizer``'s gradients and step it, unless a policy decided to skip the step.

        Args:
            optimizer: the optimizer to step (one of those given; Fabric's wrapper is fine). Optional with one.
            kwargs: passed on to ``optimizer.step``.

        Returns:
            Whether the step was applied; ``None`` when that is only known on device (a fused optimizer skipped
            through ``found_inf``, never read to the host).

        Raises:
            ValueError: if ``optimizer`` is not one of the loop's optimizers.
        """
        ctx = self.ctx
        inner = self._inner.get(id(optimizer))
        if inner is None:
            optimizer = self._optimizer(optimizer)
            inner = self._inner[id(optimizer)]
        self._steps_through_kit += 1
        dropped = bool(self._hooks.drops_batch) and self.drops_batch  # nothing to measure, nothing applied
        if self._loss_watchers and not ctx.micro_batches and not dropped:
            self._warn_no_loss()
        record = None if dropped else self.pipeline.run(ctx, inner, self.policies)
        # The gate stands in for `optimizer.step` (whatever calls it: Fabric's strategy, a `GradScaler`) only when the
        # decision may skip the step or left a factor to the fused kernel; otherwise the optimizer steps as it is.
        decision = None if record is None else record.decision
        gated = decision is not None and (decision.skip is not None or decision.folded is not None)
        gate = functools.partial(_gated_step, inner, inner.step, record) if gated else None
        with shadowed(inner, step=gate) if gate is not None else nullcontext():
            if self._own_scaler and not dropped:
                ctx.scaler.step(optimizer, **kwargs)  # type: ignore[union-attr]
                ctx.scaler.update()  # type: ignore[union-attr]
            elif not dropped:
                optimizer.step(**kwargs)
        if dropped:
            skipped: bool | None = self._drop(inner)
        else:
            skipped = close_step(inner, record, self._buffers) if gated or self._buffers is not None else False
        if self._schedulers_of and not dropped:
            self._step_schedulers(inner, record)
        step = ctx.step
        ctx.step += 1  # the step is done: what follows sees it counted, as `on_train_batch_end` does
        for after_step in self._hooks.after_step:
            after_step(ctx)
        ctx.flush_log(step)
        if self._buffers is not None and not self._first_forward:
            # The next window opens now, after everything this step changed (a rollback's restore included): a
            # skipped next step puts the buffers back to this.
            self._buffers.capture()
        if self._rng is not None:
            self._rng = capture_rng(full=False)  # where the next micro-batch's forward starts
        return None if skipped is None else not skipped

    @property
    def drops_batch(self) -> bool:
        """Whether a policy (``StepsToSkip``) drops the current optimizer step's batches: draw them, skip the forward
        and the backward, and call :meth:`step` as for any step (it counts the step and applies nothing)."""
        return any(drops(self.ctx) for drops in self._hooks.drops_batch)

    def _drop(self, optimizer: Optimizer) -> bool:
        """A dropped step counts as skipped; a forward run regardless leaves no gradient nor buffer write behind."""
        optimizer.zero_grad(set_to_none=True)
        self.pipeline.steps.add_drop(self.ctx.device)
        if self._buffers is not None:
            self._buffers.close(True)
        return True

    def _step_schedulers(self, optimizer: Optimizer, record: StepRecord | None) -> None:
        """Step ``optimizer``'s LR schedulers after its applied step only (a fused optimizer's skip flag is read here,
        when a scheduler needs it), as the Trainer's gate holds step-interval schedulers. The other optimizers'
        schedulers wait for their own steps: in a GAN loop each steps once per iteration."""
        schedulers = self._schedulers_of.get(id(optimizer))
        if not schedulers:
            return
        if record is not None and record.decision.skip is not None and record.skip_on_host():
            return
        for scheduler in schedulers:
            scheduler.step()

    def finish(self) -> None:
        """End of the loop: the guards report what their device ledgers still hold (as at ``on_train_end``), then the
        monitor draws its report (the policies' ``finish`` in stage order: the report shows the guards' last events).

        Warns when no optimizer step went through :meth:`step` (the policies then measured and guarded nothing) or
        a policy that watches the loss was never given one (:meth:`note_loss`)."""
        self._finished = True
        for finish in self._hooks.finish:
            finish(self.ctx)
        self.ctx.flush_log(self.ctx.step)
        if self._steps_through_kit == 0:
            self.ctx.warn(
                "GradKit.finish(): no optimizer step went through kit.step(...), so the policies measured, clipped "
                "and guarded nothing. Call kit.step(optimizer) in place of optimizer.step() (it steps the optimizer "
                "unless a policy skips the step)."
            )
        self._warn_no_loss()

    def _warn_no_loss(self) -> None:
        """Once: the policies that watch the loss were given none (no :meth:`note_loss` before the first step)."""
        if not self._loss_watchers or self.ctx.micro_batches:
            return
        watchers, self._loss_watchers = self._loss_watchers, []
        self.ctx.warn(
            f"{' and '.join(watchers)} saw no loss: call kit.note_loss(loss) each micro-batch, before kit.step(...); "
            "without it the loss is never checked for spikes."
        )

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps a policy skipped so far (one host read); the fp16 ``GradScaler``'s own overflow skips are
        not counted (see :class:`~lightning_gradkit.NonFiniteGuard`), as under the Trainer."""
        count = self.pipeline.skipped_steps
        return 0 if count is None else int(count)

    def state_dict(self) -> dict[str, Any]:
        """The door's state for a checkpoint: the step counter, the skip count and every policy's state.

        Each policy's state is keyed by its ``state_key``, the key a Lightning ``Trainer`` checkpoint keeps it under
        (``checkpoint["callbacks"][state_key]``): a state saved behind either door loads behind the other. For
        ``torch.save``; in a ``torch.distributed.checkpoint`` state dict put :meth:`distributed_state` instead.
        """
        return {
            "step": self.ctx.step,
            "skipped_steps": self.skipped_steps,
            "policies": {policy_key(p): p.state_dict() for p in self._hooks.saves_state},
        }

    def distributed_state(self) -> DistributedState:
        """The door's state as a ``torch.distributed.checkpoint`` ``Stateful``: put it in the state dict you give
        ``torch.distributed.checkpoint.save`` and ``load``, beside the model's and the optimizers'.

        :meth:`state_dict` itself is not one: DCP loads into the state a fresh door returns, whose shape is not that
        of a trained door's (a policy's history, a snapshot ring), so every policy state goes into one item here. What
        each rank holds its own of (``SpikeRollback(save_snapshots=True)``'s snapshots: under FSDP2 its shards, its
        buffers and RNG states) is saved per rank, by that rank, and loaded back on the same rank: a resumed FSDP2 run
        rolls back as the uninterrupted one (whatever the mesh: the items are per rank). The rest is the same on every
        rank and saved once. A resume on another number of ranks is refused when rank-local state was saved
        (:mod:`gradkit.doors.distributed_checkpoint` says why); without it, it resumes.

        Example::

            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optim_state, "gradkit": kit.distributed_state()}
            dcp.save(state, checkpoint_id=path)
            # at the resume, with the model, the optimizer and the kit built as before:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optim_state, "gradkit": kit.distributed_state()}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        """
        return DistributedState(self)

    def checkpoint_is_finite(self) -> FiniteCheck:
        """Whether a checkpoint of the model and the optimizers now would hold only finite values: call it before you
        save them (on every rank: under ``torch.distributed`` it is a collective) and save only when it is true.

        :func:`gradkit.checkpoint_is_finite` on the door's model and optimizers: one pass over the parameters, the
        buffers and the optimizer state on their device, one host read, every rank's flags in one all-reduce. When
        something is non-finite the door treats the save as refused: a warning (the first time) names the step and the
        tensors, and a ``checkpoint_refused`` event in ``gradkit_events.jsonl`` holds every name. :meth:`state_dict`
        (the policies' state) is not checked: a statistic may be NaN by design.

        Example::

            if kit.checkpoint_is_finite():
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "gradkit": kit.state_dict()}, path)
        """
        return self._check_checkpoint(type(self).__name__, "do not save it")

    def _check_checkpoint(self, source: str, outcome: str) -> FiniteCheck:
        """:meth:`checkpoint_is_finite`, the refusal reported by ``source`` (the door that refuses) with ``outcome``
        (what was done with the checkpoint)."""
        ctx = self.ctx
        check = checkpoint_is_finite(ctx.model, [unwrapped(o) for o in ctx.optimizers])
        if not check:
            self._refused_checkpoints += 1
            events = EventLog(ctx.log_dir, rank=ctx.global_rank) if ctx.log_dir is not None else None
            if events is not None:
                events.write(
                    step=ctx.step,
                    batch_idx=ctx.batch_idx,
                    rank=None,  # the flags of every rank, combined
                    what=CHECKPOINT_REFUSED,
                    culprit=check.first(),
                    values=check.as_event(),
                    source=source,
                )
            if self._refused_checkpoints == 1:
                what = f"{outcome} (later refusals are in the events file only)" if events is not None else outcome
                ctx.warn(refusal_message(source, check, ctx.step, what, events.path if events is not None else None))
        return check

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`, or from a Lightning ``Trainer`` checkpoint of the same policies.

        A Trainer checkpoint (``torch.load(path)``, with its ``"callbacks"`` and ``"global_step"``) gives every
        policy the state its callback saved and the step count. A state saved before the policies were keyed (a list,
        in the order of ``policies``) loads by position.

        Policies and states are matched by ``state_key``, as a ``Trainer`` matches callbacks: a policy with no saved
        state (added at this restart, e.g. ``StepsToSkip(steps=steps_from_events(run_dir))``) starts fresh, and a
        saved state whose policy is gone is not loaded (reported for this door's own states only: a Trainer
        checkpoint holds every callback's); one warning says each."""
        trainer = "callbacks" in state_dict and "global_step" in state_dict
        if trainer:  # a Lightning checkpoint
            step, skipped, states = state_dict["global_step"], None, state_dict["callbacks"]
        else:
            step, skipped, states = state_dict["step"], state_dict["skipped_steps"], state_dict["policies"]
        self.ctx.step = int(step)
        if skipped is not None:
            self.pipeline.steps.restore(float(skipped), self.ctx.device)
        if isinstance(states, Mapping):
            pairs, notes = matched_states(self.policies, states, report_gone=not trainer)
            for note in notes:
                self.ctx.warn(note)
            for policy, state in pairs:
                policy.load_state_dict(state)
        else:
            loads = set(map(id, self._hooks.loads_state))
            for policy, state in zip(self.policies, states, strict=True):  # a stateless policy saved {} there
                if id(policy) in loads:
                    policy.load_state_dict(state)
        for attach in self._hooks.attach:
            attach(self.ctx, self.ctx.model)
        # The model's weights and buffers may be loaded after this call as well as before: the next window's
        # buffers are taken at its first forward, after both.
        self._arm_first_forward()

    def close(self) -> None:
        """Remove everything the door registered: its forward hooks on the model, the policies' own (their
        ``detach`` hook), the buffers it kept. The model and optimizers are left as they are; the door is not used
        again. Called by ``with GradKit(...) as kit:`` on leaving the block (after :meth:`finish`, if the block ended
        without an exception)."""
        for handle in self._first_forward:
            handle.remove()
        self._first_forward = []
        for detach in self._hooks.detach:
            detach(self.ctx)
        if self._buffers is not None:
            self._buffers.drop()
            self._buffers = self.ctx.window_buffers = None

    def __enter__(self) -> GradKit:
        return self

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        try:
            if exc_type is None and self._steps_through_kit and not self._finished:
                self.finish()
        finally:
            self.close()

    def _optimizer(self, optimizer: Optimizer | None) -> Optimizer:
        optimizers = self.ctx.optimizers
        if optimizer is None:
            if len(optimizers) != 1:
                raise ValueError(f"`step()` needs the optimizer to step: this loop has {len(optimizers)} of them.")
            return optimizers[0]
        for opt in optimizers:
            if opt is optimizer or unwrapped(opt) is unwrapped(optimizer):
                return opt
        raise ValueError(
            f"`step(optimizer)` got a {type(optimizer).__name__} that is not one of the optimizers given to GradKit. "
            "Pass every optimizer the loop steps to `GradKit(model, optimizers=[...], ...)`."
        )


# Never traced: called from a module that `torch.compile` wraps (whose `_call_impl` runs before dynamo traces the
# forward), it runs eagerly and removes every hook before the trace starts, so the compiled graph holds none of it.
@torch.compiler.disable
def _open_first_window(kit: weakref.ref[GradKit], handles: list[Any], module: nn.Module, args: Any) -> None:
    """The forward pre-hook that opens a :class:`GradKit`'s first window, then removes itself from every module (a
    weak reference to the door: the hooks keep no door alive, and a door gone leaves no hook behind). The module the
    loop calls gets it too (``torch.compile``'s or Fabric's wrapper): its hook runs first, outside any compiled
    region."""
    door = kit()
    if door is not None:
        door._opened()
    for handle in handles:
        handle.remove()
    handles.clear()


def _gated_step(optimizer: Optimizer, inner: Callable[..., Any], record: StepRecord | None, **kwargs: Any) -> Any:
    """``optimizer.step`` while :meth:`GradKit.step` runs: whatever calls it (Fabric's strategy, a ``GradScaler``)
    meets the step's decision."""
    return step_as_decided(optimizer, inner, record, kwargs)
