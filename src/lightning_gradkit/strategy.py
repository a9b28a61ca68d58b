"""The strategy mixin: step the optimizer, or do not, as the step's policies decided.

A Lightning callback cannot cancel an optimizer step: ``on_before_optimizer_step`` runs inside
``Strategy.optimizer_step`` and whatever it does, the precision plugin calls ``optimizer.step`` (or
``GradScaler.step``) afterwards. :class:`GradKitStrategyMixin` owns that one decision. For the duration of
``optimizer_step`` it shadows ``optimizer.step`` with a gate; every precision plugin ends in that gate:

- ``32-true``, ``bf16-mixed`` (``Precision``): ``optimizer.step(closure)``; the gate runs the closure (training
  step, backward, then the callbacks' ``on_before_optimizer_step``, where the gradkit engine decides), then steps
  the optimizer or not.
- ``16-mixed`` (``MixedPrecision`` with a ``GradScaler``): closure, ``unscale_``, hooks, ``scaler.step(optimizer)``
  which calls ``optimizer.step()`` (the gate) unless the scaler found an overflow itself, then ``scaler.update()``.

The gate reads the engine's decision ``StepPlan.skip`` (a device flag, identical on every rank because it is
derived from all-reduced gradients and from per-rank flags summed in the engine's one collective):

- ordinary optimizer: one host read of the flag, the only synchronization the design allows; on a skip the
  optimizer is not called (parameters and state bitwise unchanged) and the gradients are set to ``None``.
- fused optimizer (``Adam/AdamW/SGD/Adagrad(fused=True)``): the flag is passed as the optimizer's ``found_inf``
  (combined with the ``GradScaler``'s), the fused kernel skips the update on device: no host synchronization.
  Its gradients are left for Lightning's next ``zero_grad``.

Step-interval LR schedulers are held on a skipped step (the LightningModule's ``lr_scheduler_step`` hook is
gated while fitting). With a fused optimizer that needs the flag on the host: it is read there, after the step has
been queued. ``trainer.global_step`` counts *attempted* optimizer steps, as Lightning does when the ``GradScaler``
skips one: ``max_steps``, logging and checkpoint periods keep following batches, while ``gradkit/skipped_steps``
counts the skipped ones (applied steps = ``global_step - skipped_steps``) and the LR schedule follows the applied
ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import (
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    StrategyRegistry,
)
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer

from lightning_gradkit._engine import GradKitCallback, StepPlan, _Engine

_MISSING = object()

# Optimizers that evaluate the closure several times per step: the gate runs it once and cannot re-run it.
_CLOSURE_OPTIMIZERS = (torch.optim.LBFGS,)


def handles_found_inf(optimizer: Optimizer) -> bool:
    """Whether ``optimizer.step`` honours a ``found_inf`` attribute on device (PyTorch's fused optimizers)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and bool(
        optimizer.defaults.get("fused", False)
    )


def needs_step_control(trainer: pl.Trainer) -> bool:
    """Whether any gradkit callback of ``trainer`` may ask for an optimizer step to be skipped."""
    return any(cb._needs_step_control() for cb in trainer.callbacks if isinstance(cb, GradKitCallback))


def gradkit_strategy_hint(strategy: object) -> str:
    """The GradKit strategy that replaces ``strategy``, as ``Trainer(...)`` text for error messages."""
    if isinstance(strategy, ModelParallelStrategy):
        return 'Trainer(strategy="gradkit_model_parallel") or GradKitModelParallelStrategy(...)'
    if isinstance(strategy, FSDPStrategy):
        return 'Trainer(strategy="gradkit_fsdp") or GradKitFSDPStrategy(...)'
    if isinstance(strategy, DDPStrategy):
        spawn = getattr(strategy, "_start_method", "popen") == "spawn"
        return f'Trainer(strategy="{"gradkit_ddp_spawn" if spawn else "gradkit_ddp"}") or GradKitDDPStrategy(...)'
    if isinstance(strategy, SingleDeviceStrategy):
        return 'Trainer(strategy="gradkit") or GradKitSingleDeviceStrategy(...)'
    return f"a subclass `class My{type(strategy).__name__}(GradKitStrategyMixin, {type(strategy).__name__})`"


class _SchedulerGate:
    """Stands in for ``LightningModule.lr_scheduler_step`` while fitting: holds step-interval schedulers after a
    skipped optimizer step. An instance attribute on the module, removed at teardown."""

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
    included, are bitwise unchanged), the gradients are cleared, step-interval LR schedulers do not advance, and
    ``gradkit/skipped_steps`` counts it. ``trainer.global_step`` still counts the attempted step (as Lightning does
    for a step the ``GradScaler`` skips).

    Cost: one host read of the skip flag per optimizer step with an ordinary optimizer; none with a fused one
    (``Adam/AdamW/SGD/Adagrad(fused=True)``), whose kernel receives the flag as ``found_inf``. With a fused
    optimizer and a step-interval LR scheduler the flag is read when the scheduler is about to step.

    Raises:
        RuntimeError: at setup, when a callback may skip steps and an optimizer re-evaluates its closure
            (``LBFGS``): such a step cannot be gated after the fact.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning.pytorch.strategies import DDPStrategy
        >>> from lightning_gradkit import GradKitStrategyMixin, NonFiniteGuard
        >>> class MyDDP(GradKitStrategyMixin, DDPStrategy):
        ...     pass
        >>> trainer = Trainer(strategy=MyDDP(), accelerator="cpu", devices=2, callbacks=[NonFiniteGuard()])
    """

    _gradkit_gate_active: bool = False

    # -- Lightning hooks -----------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)  # type: ignore[misc]
        self._gradkit_trainer = trainer
        self._gradkit_records: dict[int, tuple[Tensor | None, bool | None]] = {}
        self._gradkit_gate_active = needs_step_control(trainer) and trainer.state.fn == TrainerFn.FITTING
        if not self._gradkit_gate_active:
            return
        for optimizer in self.optimizers:  # type: ignore[attr-defined]
            if isinstance(optimizer, _CLOSURE_OPTIMIZERS):
                raise RuntimeError(
                    f"{type(optimizer).__name__} evaluates the training closure several times per step, so a gradkit "
                    "callback cannot decide to skip its step after the gradients are known. Use another optimizer, "
                    "or remove the callbacks that skip steps (or give them `action='warn'`/`'raise'`)."
                )
        module = trainer.lightning_module
        if module.automatic_optimization and "lr_scheduler_step" not in module.__dict__:
            module.lr_scheduler_step = _SchedulerGate(self, module.lr_scheduler_step)

    def teardown(self) -> None:
        module = getattr(self, "_gradkit_trainer", None)
        module = module.lightning_module if module is not None else None
        if module is not None and isinstance(module.__dict__.get("lr_scheduler_step"), _SchedulerGate):
            del module.lr_scheduler_step
        self._gradkit_gate_active = False
        super().teardown()  # type: ignore[misc]

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        if not self._gradkit_gate_active:
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        engine = _Engine.of(self._gradkit_trainer)
        engine.last_plans.pop(id(optimizer), None)
        shadowed = optimizer.__dict__.get("step", _MISSING)
        optimizer.step = self._gradkit_gate(optimizer, optimizer.step, engine)  # type: ignore[method-assign]
        try:
            output = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        finally:
            if shadowed is _MISSING:
                del optimizer.step
            else:
                optimizer.step = shadowed  # type: ignore[method-assign]
        plan = engine.last_plans.get(id(optimizer))
        skip = plan.skip if plan is not None else None
        skip_host = plan.skip_known_on_host() if plan is not None else None
        self._gradkit_records[id(optimizer)] = (skip, skip_host)
        if skip_host:
            # Also when the GradScaler skipped on its own and never called the gate.
            optimizer.zero_grad(set_to_none=True)
        return output

    # -- the gate ------------------------------------------------------------------------------------------------
    def _gradkit_gate(self, optimizer: Optimizer, inner: Callable[..., Any], engine: _Engine) -> Callable[..., Any]:
        fused = handles_found_inf(optimizer)

        def gated_step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
            result = None
            if closure is not None:
                with torch.enable_grad():
                    result = closure()

            def cached() -> Any:
                return result

            plan: StepPlan | None = engine.last_plans.get(id(optimizer))
            if plan is None or plan.skip is None:
                inner(closure=cached, **kwargs)
                return result
            if fused:
                _fused_step(optimizer, inner, cached, plan.skip, kwargs)
            elif not plan.skip_on_host():
                inner(closure=cached, **kwargs)
            return result

        return gated_step

    # -- LR schedulers -------------------------------------------------------------------------------------------
    def _gradkit_hold(self, scheduler: Any) -> bool:
        """Whether a step-interval scheduler must not advance because its optimizer's last step was skipped."""
        config = next((c for c in self.lr_scheduler_configs if c.scheduler is scheduler), None)  # type: ignore[attr-defined]
        if config is None or config.interval != "step" or config.reduce_on_plateau:
            return False
        optimizer = getattr(scheduler, "optimizer", None)
        skip, skip_host = self._gradkit_records.pop(id(optimizer), (None, None))
        if skip_host is not None:
            return skip_host
        # Fused optimizer: the flag was never needed on the host until now (the step is already queued).
        return bool(skip) if skip is not None else False


def _fused_step(
    optimizer: Optimizer, inner: Callable[..., Any], closure: Callable[[], Any], skip: Tensor, kwargs: dict
) -> None:
    """Step a fused optimizer with ``found_inf`` raised on a skip: its kernel leaves parameters and state alone."""
    existing = optimizer.__dict__.get("found_inf")  # set by GradScaler.step for the duration of the call
    flag = skip.to(torch.float32)
    optimizer.found_inf = flag if existing is None else torch.maximum(existing, flag.to(existing.device))  # type: ignore[attr-defined]
    try:
        inner(closure=closure, **kwargs)
    finally:
        if existing is None:
            del optimizer.found_inf  # type: ignore[attr-defined]
        else:
            optimizer.found_inf = existing  # type: ignore[attr-defined]


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
        self._root_device = devices[0]
        self._device_given = True


class GradKitDDPStrategy(GradKitStrategyMixin, DDPStrategy):
    """Lightning's ``DDPStrategy`` with gradkit step control (``"gradkit_ddp"``, ``"gradkit_ddp_spawn"``)."""

    strategy_name = "gradkit_ddp"


class GradKitFSDPStrategy(GradKitStrategyMixin, FSDPStrategy):
    """Lightning's ``FSDPStrategy`` with gradkit step control (``"gradkit_fsdp"``)."""

    strategy_name = "gradkit_fsdp"


class GradKitModelParallelStrategy(GradKitStrategyMixin, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel) with gradkit step control
    (``"gradkit_model_parallel"``)."""

    strategy_name = "gradkit_model_parallel"


def register_strategies() -> None:
    """Register the GradKit strategy names in Lightning's ``StrategyRegistry`` (done on import of the package)."""
    entries: list[tuple[str, type, str, dict[str, Any]]] = [
        ("gradkit", GradKitSingleDeviceStrategy, "Single device with gradkit step control", {}),
        ("gradkit_ddp", GradKitDDPStrategy, "DDP with gradkit step control", {"start_method": "popen"}),
        ("gradkit_ddp_spawn", GradKitDDPStrategy, "DDP (spawn) with gradkit step control", {"start_method": "spawn"}),
        ("gradkit_fsdp", GradKitFSDPStrategy, "FSDP with gradkit step control", {}),
        ("gradkit_model_parallel", GradKitModelParallelStrategy, "ModelParallel with gradkit step control", {}),
    ]
    for name, cls, description, init_params in entries:
        StrategyRegistry.register(name, cls, description=description, override=True, **init_params)
