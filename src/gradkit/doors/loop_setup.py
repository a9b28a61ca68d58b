"""What the loop door (:class:`~gradkit.GradKit`) checks and resolves when it is built: the policies, the
schedulers and the optimizers they belong to, the module inside Fabric's or DDP's wrapper, the events directory."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.optim import Optimizer

from gradkit._util.arguments import check_int, check_type, shown
from gradkit.step.protocol import (
    Policy,
    Roster,
    Stage,
    fresh_state_note,
    gone_state_note,
    is_policy,
    policy_key,
    unwrapped,
)

__all__ = [
    "checked_door_arguments",
    "checked_policies",
    "checked_schedulers",
    "events_dir",
    "fabric_flat_sharded",
    "fabric_scaler",
    "matched_states",
    "root_module",
    "watches_loss",
]


_DEFAULT_LOG_DIR = "gradkit_logs"


def checked_door_arguments(
    model: object,
    optimizers: object,
    log: object,
    scaler: object,
    fabric: object,
    max_steps: object,
    log_dir: object,
) -> list[Optimizer]:
    """The arguments of ``GradKit(...)`` checked before anything is built from them (a wrong one would fail later,
    inside a step, with an error that names none of them); returns the optimizers as a list.

    Raises:
        TypeError: naming the argument, the value and what it takes, for a ``model`` that is not an ``nn.Module``,
            ``optimizers`` that are not torch optimizers, a ``log`` that cannot be called, a ``scaler`` that is not a
            ``GradScaler``, a ``fabric`` that is not Lightning's ``Fabric``, a ``log_dir`` that is not a path.
        ValueError: for ``max_steps`` that is not a step count, or no optimizer at all.
    """
    check_type("model", model, nn.Module, "the torch module being trained (an `nn.Module`)")
    listed = [optimizers] if isinstance(optimizers, Optimizer) else optimizers
    fix = "Pass the optimizer the loop steps, or a list of them: `GradKit(model, optimizer, policies)`."
    if not isinstance(listed, Sequence) or isinstance(listed, str):
        raise TypeError(f"`optimizers` must be a torch optimizer or a list of them, got {shown(optimizers)}. {fix}")
    if not listed:
        raise ValueError(f"`optimizers` is empty: the loop door steps at least one optimizer. {fix}")
    for optimizer in listed:
        check_type("optimizers", unwrapped(optimizer), Optimizer, "a torch optimizer or a list of them", fix)
    if log is not None:
        check_type("log", log, Callable, "None or a function `log(metrics, step)`", "E.g. `log=fabric.log_dict`.")
    if scaler is not None:
        check_type(
            "scaler", scaler, torch.amp.GradScaler, "None or the loop's `torch.amp.GradScaler`",
            "For fp16, build one (`torch.amp.GradScaler('cuda')`) and pass it; under Fabric leave it None.",
        )  # fmt: skip
    if fabric is not None:
        check_type("fabric", fabric, _fabric_classes(), "None or the loop's `lightning.fabric.Fabric`")
    if max_steps is not None:
        check_int("max_steps", max_steps, 1, hint="None when the loop's length is not known.")
    if log_dir is not None and log_dir is not False:
        check_type(
            "log_dir", log_dir, (str, os.PathLike), "a directory (a str or a Path), None or False",
            "None: Fabric's logger directory, else ./gradkit_logs; False: no event file.",
        )  # fmt: skip
    _check_optimizers_train_model(model, listed)  # type: ignore[arg-type]
    return list(listed)


def _check_optimizers_train_model(model: nn.Module, optimizers: Sequence[Optimizer]) -> None:
    """Refuse an optimizer that steps none of ``model``'s parameters (``GradKit(model_b, optimizer_of_model_a)``):
    the door would measure and guard gradients the optimizer never applies, and silently apply the others. An
    optimizer that also steps parameters outside the model (a learnable loss temperature) is fine."""
    owned = {id(p) for p in model.parameters()}
    for i, optimizer in enumerate(optimizers):
        params = [p for group in unwrapped(optimizer).param_groups for p in group["params"]]
        if params and not any(id(p) in owned for p in params):
            raise ValueError(
                f"`optimizers[{i}]` ({type(unwrapped(optimizer)).__name__}, {len(params)} parameter(s)) steps none of "
                f"the parameters of `model` ({type(model).__name__}): it was built for another model. Build it on "
                "this model's parameters (`torch.optim.AdamW(model.parameters())`), or pass the model it trains."
            )


def _fabric_classes() -> tuple[type, ...]:
    """Lightning's ``Fabric`` class, from each of its packages already imported (none imported: no Fabric exists)."""
    modules = (sys.modules.get("lightning.fabric"), sys.modules.get("lightning_fabric"))
    return tuple(module.Fabric for module in modules if module is not None and hasattr(module, "Fabric"))


def events_dir(log_dir: str | Path | Literal[False] | None, fabric: Any) -> Path | None:
    """Where the event file goes: ``log_dir``; else the directory of Fabric's first logger; else
    ``./gradkit_logs``. ``False``: no event file."""
    if log_dir is False:
        return None
    if log_dir:
        return Path(log_dir)
    loggers = getattr(fabric, "loggers", None) or []
    directory = getattr(loggers[0], "log_dir", None) if loggers else None
    return Path(directory) if directory else Path.cwd() / _DEFAULT_LOG_DIR


def root_module(model: nn.Module) -> nn.Module:
    """The user's module inside Fabric's ``_FabricModule`` or a ``DistributedDataParallel`` wrapper (the names
    the Trainer door reports are the LightningModule's own, unwrapped ones)."""
    wrappers = sys.modules.get("lightning.fabric.wrappers") or sys.modules.get("lightning_fabric.wrappers")
    if wrappers is not None and wrappers.is_wrapped(model):
        model = model.module
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    return model


def fabric_scaler(fabric: Any) -> torch.amp.GradScaler | None:
    """The ``GradScaler`` of Fabric's 16-mixed precision plugin, else ``None``."""
    return getattr(fabric.strategy.precision, "scaler", None)


def fabric_flat_sharded(fabric: Any) -> bool:
    """Whether Fabric runs FSDP1 over several ranks (every gradient a flat local shard)."""
    strategies = sys.modules.get("lightning.fabric.strategies") or sys.modules.get("lightning_fabric.strategies")
    return strategies is not None and isinstance(fabric.strategy, strategies.FSDPStrategy) and fabric.world_size > 1


def matched_states(
    policies: Sequence[Policy], states: Mapping[str, Any], report_gone: bool
) -> tuple[list[tuple[Policy, Any]], list[str]]:
    """Each stateful policy with its saved state, matched by ``state_key`` as a ``Trainer`` matches callbacks, and the
    warnings of the mismatches: a policy with no saved state starts fresh (added at a restart, or built with other
    arguments); a saved state whose policy is gone is not loaded (said only with ``report_gone``: a Trainer
    checkpoint holds every callback's state, gradkit's or not)."""
    stateful = {policy_key(p): p for p in Roster(policies).loads_state}
    notes = []
    fresh = [key for key in stateful if key not in states]
    if fresh:
        notes.append(fresh_state_note(fresh))
    gone = [str(key) for key in states if key not in stateful]
    if gone and report_gone:
        notes.append(gone_state_note(gone))
    return [(policy, states[key]) for key, policy in stateful.items() if key in states], notes


def watches_loss(policy: Policy) -> bool:
    """Whether ``policy`` watches the loss (``monitor="loss"``), which only :meth:`GradKit.note_loss` hands it behind
    this door."""
    return getattr(policy, "monitor", None) == "loss"


def checked_schedulers(schedulers: Any, optimizers: list[Optimizer]) -> list[tuple[Any, Optimizer]]:
    """Each scheduler (one, or a list of them) with the optimizer it was built on (``scheduler.optimizer``; without
    that attribute, the loop's only optimizer). ``None`` is none.

    Raises:
        TypeError: an object that is not an LR scheduler (no ``step`` and ``state_dict``), e.g. the name ``"cosine"``.
        ValueError: a ``ReduceLROnPlateau`` (it steps on a metric), a scheduler of an optimizer the loop does not
            step, or one that does not say its optimizer in a loop of several.
    """
    single = hasattr(schedulers, "state_dict") and hasattr(schedulers, "step")
    listed = [schedulers] if single else [] if schedulers is None else schedulers
    if isinstance(listed, (str, Mapping)) or not isinstance(listed, Iterable):
        listed = [listed]  # refused below, as the scheduler it is not
    out = []
    for scheduler in listed:
        if not (callable(getattr(scheduler, "step", None)) and callable(getattr(scheduler, "state_dict", None))):
            raise TypeError(
                f"`schedulers` must be LR schedulers (objects with `step()` and `state_dict()`), or a list of them, "
                f"got {shown(scheduler)}. Build one on the loop's optimizer, e.g. "
                "`torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max_steps)`."
            )
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            # As Lightning's `reduce_on_plateau` needs a `monitor`: `kit.step` has no metric to give it.
            raise ValueError(
                "`schedulers` holds a ReduceLROnPlateau, which steps on a metric (`scheduler.step(metrics)`) that "
                "`kit.step` does not have. Leave it out of `schedulers` and step it yourself with the metric, e.g. "
                "after validation, `scheduler.step(val_loss)` once per epoch (per optimizer step: only when "
                "`kit.step(...)` returned True, so that a skipped step holds it)."
            )
        built_on = getattr(scheduler, "optimizer", None)
        if built_on is None and len(optimizers) == 1:
            built_on = optimizers[0]
        owner = unwrapped(built_on) if isinstance(built_on, Optimizer) else None
        if owner is None or not any(owner is opt for opt in optimizers):
            where = "no optimizer (no `optimizer` attribute)" if built_on is None else "an optimizer"
            raise ValueError(
                f"`schedulers` holds a {type(scheduler).__name__} built on {where} that is not one of the "
                f"{len(optimizers)} optimizer(s) given to GradKit: `kit.step(opt)` steps only the schedulers of `opt`. "
                "Build each scheduler on one of the loop's optimizers, or step it yourself."
            )
        out.append((scheduler, owner))
    return out


def checked_policies(policies: Policy | Sequence[Policy]) -> list[Policy]:
    """The policies as given (one, or a list of them, as ``optimizers``), after the checks a Trainer makes at setup.

    Raises:
        TypeError: a class instead of an instance, or an object that is not a gradkit policy.
        ValueError: more than one clipper.
    """
    if is_policy(policies) or isinstance(policies, type):
        out: list[Policy] = [policies]  # type: ignore[list-item]  # a class is refused below, with the fix
    elif isinstance(policies, Iterable) and not isinstance(policies, (str, Mapping)):
        out = list(policies)
    else:
        raise TypeError(
            f"`policies` must be a gradkit policy or a list of them, got {_a(policies)}. Pass e.g. "
            "`[GradNormMonitor(), ClipGradNorm(1.0)]`."
        )
    for policy in out:
        if isinstance(policy, type):
            raise TypeError(
                f"`policies` holds the class `{policy.__name__}`, not an instance of it: use `{policy.__name__}()`, "
                "with its arguments in the parentheses."
            )
        if not is_policy(policy):
            raise TypeError(
                f"`policies` holds a {type(policy).__name__}, which takes no part in the optimizer step's pipeline "
                "(a Trainer callback such as `ActivationCheckpointing` or `InferenceModeValidation` works only as "
                "one). Give gradkit policies such as `GradNormMonitor()`, `ClipGradNorm(1.0)` or `NonFiniteGuard()`."
            )
    for policy in out:
        reason = getattr(policy, "trainer_only", None)
        if reason:
            raise ValueError(
                f"{type(policy).__name__} works only as a Lightning Trainer callback: {reason}. In a Fabric or "
                "plain-PyTorch loop, remove it from `GradKit(policies=[...])`."
            )
    keys = [policy_key(p) for p in Roster(out).saves_state]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ValueError(
            f"`policies` holds more than one policy with the state key {', '.join(twice)}: their states would "
            "overwrite each other in a checkpoint (a Trainer refuses such callbacks too). Keep one of each."
        )
    clippers = [type(p).__name__ for p in out if p.stage is Stage.CLIP]
    if len(clippers) > 1:
        raise ValueError(
            f"`policies` holds {len(clippers)} gradient clippers ({', '.join(clippers)}); each would rescale the "
            "gradients the other already clipped. Keep exactly one of them."
        )
    return out


def _a(value: object) -> str:
    """``value``'s type for a message: "an int", "a dict"."""
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"
