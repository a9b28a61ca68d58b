"""gradkit under Lightning's ``DeepSpeedStrategy``: what works, what is refused, and DeepSpeed's own values.

Lightning's ``DeepSpeedStrategy`` hands the optimizer step to the DeepSpeed engine: after
``on_before_optimizer_step``, ``engine.step()`` reduces (ZeRO: partitions) the gradients, measures their global norm,
clips (``gradient_clipping``), skips the step on an fp16 overflow and steps the optimizer, all inside one call that no
callback can enter; under ZeRO stage 2 and 3 the parameters' ``.grad`` are empty before it. So gradkit's per-step
engine (which reads ``.grad`` and writes the decision back before the step) cannot run there.

What works (after ``engine.step()``, in ``on_train_batch_end``):

- :class:`~lightning_gradkit.GradNormMonitor` logs DeepSpeed's global gradient norm
  (``engine.get_global_grad_norm()``) as ``grad_norm/total`` and DeepSpeed's count of skipped steps
  (``engine.skipped_steps``) as ``deepspeed/skipped_steps`` (see :func:`deepspeed_step`).
- :class:`~lightning_gradkit.NonFiniteGuard` with ``action="warn"`` or ``"raise"``: the loss of every micro-batch,
  and DeepSpeed's global norm after its step.

What needs to own the step is refused at ``setup`` (:func:`refuse_under_deepspeed`), naming the DeepSpeed config key
to use instead: skipping (``NonFiniteGuard(action="skip")``, ``SpikeGuard``), the clipping callbacks, the
accumulation guard, ``SpikeRollback`` and :class:`~lightning_gradkit.GradKitStrategyMixin`.

Detection is ``isinstance(trainer.strategy, DeepSpeedStrategy)``: Lightning's public class, importable without the
``deepspeed`` package (which only its constructor imports).
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy
from torch import Tensor

__all__ = [
    "SKIPPING_INSTEAD",
    "DeepSpeedStep",
    "clipping_instead",
    "deepspeed_step",
    "is_deepspeed_strategy",
    "refuse_under_deepspeed",
    "uses_deepspeed",
]


def clipping_instead(max_norm: float | None = None) -> str:
    """What to use instead of a gradkit clipping callback: the DeepSpeed config key and Lightning's route to it.

    Example::

        >>> clipping_instead(1.0)[:35]
        'Set `"gradient_clipping": 1.0` in t'
    """
    value = "<max 2-norm>" if max_norm is None else repr(max_norm)
    return (
        f'Set `"gradient_clipping": {value}` in the DeepSpeed config, or `Trainer(gradient_clip_val={value})`, which '
        "Lightning passes to DeepSpeed as `gradient_clipping`. DeepSpeed clips by the global 2-norm with a fixed "
        "threshold only: it has no value, adaptive (AutoClip, ZClip) or unit-wise (AGC) clipping."
    )


#: What to use instead of a skipping gradkit callback.
SKIPPING_INSTEAD = (
    'DeepSpeed skips a step itself only on an fp16 overflow: `Trainer(precision="16-mixed")` with dynamic loss '
    'scaling (`"fp16": {"loss_scale": 0}` in the DeepSpeed config, `DeepSpeedStrategy(loss_scale=0)`, the default), '
    "counted in `engine.skipped_steps` (GradNormMonitor logs it as `deepspeed/skipped_steps`)."
)


def uses_deepspeed(trainer: pl.Trainer) -> bool:
    """Whether ``trainer`` trains through Lightning's ``DeepSpeedStrategy`` (or a subclass of it)."""
    return is_deepspeed_strategy(trainer.strategy)


def is_deepspeed_strategy(strategy: Strategy | object) -> bool:
    """Whether ``strategy`` is Lightning's ``DeepSpeedStrategy`` (or a subclass). Imports no ``deepspeed``."""
    return isinstance(strategy, DeepSpeedStrategy)


def refuse_under_deepspeed(trainer: pl.Trainer, setting: str, why: str, instead: str) -> None:
    """Raise ``RuntimeError`` when ``trainer`` uses DeepSpeed: ``setting`` (the callback or argument as the user
    wrote it, ``"NonFiniteGuard(action='skip')"``) cannot work there, ``why`` (what of the step it needs and DeepSpeed
    keeps to itself), and ``instead`` (the DeepSpeed config key, or the other setting, to use instead).

    Example::

        >>> from lightning.pytorch import Trainer
        >>> refuse_under_deepspeed(Trainer(accelerator="cpu", logger=False), "ZClip()", "...", "...")  # no DeepSpeed
    """
    if uses_deepspeed(trainer):
        raise RuntimeError(
            f"{setting} does not work under `{type(trainer.strategy).__name__}`: {why}. {instead} "
            "What gradkit supports under DeepSpeed: GradNormMonitor (DeepSpeed's global gradient norm and skipped "
            "steps) and NonFiniteGuard(action='warn' or 'raise')."
        )


# -- DeepSpeed's own values, read after its step -------------------------------------------------------------------
@dataclass(frozen=True)
class DeepSpeedStep:
    """What the DeepSpeed engine reports about its optimizer steps (read after ``engine.step()``).

    Attributes:
        steps: ``engine.global_steps``, the optimizer steps DeepSpeed took (skipped ones included). It moves once
            per accumulation window (``gradient_accumulation_steps`` micro-batches), while Lightning calls
            ``engine.step()`` after every micro-batch.
        skipped: ``engine.skipped_steps``, the steps DeepSpeed's optimizer did not apply (an fp16 overflow under
            dynamic loss scaling, or a non-finite norm its overflow check caught).
        grad_norm: ``engine.get_global_grad_norm()`` as a float32 tensor: the 2-norm of all gradients of the last
            step, global over the data-parallel (and model-parallel) ranks, after unscaling by the fp16 loss scale
            and before ``gradient_clipping``; ``inf`` on a step DeepSpeed skipped. ``None`` where DeepSpeed computes
            none: ZeRO stage 0 without fp16/bf16 (DeepSpeed steps the torch optimizer directly) and ZeRO 1/2 with
            the norm computation turned off.
    """

    steps: int
    skipped: int
    grad_norm: Tensor | None


def deepspeed_step(strategy: DeepSpeedStrategy) -> DeepSpeedStep:
    """Read the DeepSpeed engine's step count, skipped steps and global gradient norm (no host-device sync).

    The norm stays on its device (ZeRO optimizers keep a device tensor, the fp16/bf16 optimizers a Python float);
    read it to the host on logging steps only.
    """
    engine = strategy.deepspeed_engine
    norm = engine.get_global_grad_norm()
    if norm is not None:
        norm = norm.detach().to(torch.float32) if isinstance(norm, Tensor) else torch.tensor(float(norm))
    return DeepSpeedStep(steps=int(engine.global_steps), skipped=int(engine.skipped_steps), grad_norm=norm)
