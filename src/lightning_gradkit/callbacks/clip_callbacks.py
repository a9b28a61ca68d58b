"""The clipping callbacks of the Lightning ``Trainer``, and :func:`clip_gradients` for manual optimization.

Each callback is a thin subclass ``class ClipGradNorm(gradkit.ClipGradNorm, GradKitCallback)``: the torch
class holds the algorithm, its arguments and its state; what is left here is what only a Trainer has: the checks at
``setup`` (one clipper per Trainer, not beside ``gradient_clip_val``, not under DeepSpeed) and the
manual-optimization entry point.
"""

from __future__ import annotations

import weakref

import lightning.pytorch as pl
from torch import Tensor
from torch.optim import Optimizer

from gradkit.policies import agc, clipping, history_clipping
from gradkit.step.protocol import Policy, Roster, Stage, is_policy, unwrapped
from lightning_gradkit._deepspeed import clipping_instead, refuse_under_deepspeed
from lightning_gradkit._docstring import with_policy_docstring
from lightning_gradkit.trainer_door import GradKitCallback, TrainerPipeline

__all__ = ["AdaptiveGradClip", "AutoClip", "ClipGradNorm", "ClipGradValue", "ZClip", "clip_gradients"]


def _is_clipper(obj: object) -> bool:
    return is_policy(obj) and obj.stage is Stage.CLIP  # type: ignore[attr-defined]


def _set_up(trainer: pl.Trainer, stage: str, setting: str, max_norm: float | None) -> None:
    """The clipper's checks at ``setup``: DeepSpeed clips by itself (``RuntimeError`` naming ``setting`` and the
    ``gradient_clipping`` value ``max_norm`` that does the same there, if one does), and a Trainer has one clipper
    (``ValueError`` for another clipping callback or ``gradient_clip_val``)."""
    if stage == "fit":
        refuse_under_deepspeed(
            trainer,
            f"`{setting}`",
            "the DeepSpeed engine clips inside `engine.step()`, after every callback hook, and under ZeRO stage "
            "2/3 the gradients are not in `.grad` before it",
            clipping_instead(max_norm),
        )
    clippers = [cb for cb in trainer.callbacks if _is_clipper(cb)]
    if len(clippers) > 1:
        names = ", ".join(type(cb).__name__ for cb in clippers)
        raise ValueError(
            f"The Trainer has {len(clippers)} gradient-clipping callbacks ({names}); each would rescale the "
            "gradients the other already clipped. Keep exactly one of them."
        )
    if clippers and trainer.gradient_clip_val:
        raise ValueError(
            f"`Trainer(gradient_clip_val={trainer.gradient_clip_val!r})` and the {type(clippers[0]).__name__} "
            "callback both clip gradients. Use one: remove `gradient_clip_val` from the Trainer (the callback clips "
            "after the AMP unscale, also with fused optimizers, and logs its norms), or remove the callback."
        )


@with_policy_docstring
class ClipGradNorm(clipping.ClipGradNorm, GradKitCallback):
    r"""The Trainer callback of :class:`gradkit.ClipGradNorm`: its docstring, then what follows.

    Unlike ``Trainer(gradient_clip_val=...)``, it also clips with fused optimizers under 16-mixed AMP, logs the norms,
    and runs with manual optimization too (see :func:`clip_gradients`).

    Raises:
        ValueError: at setup, if another clipping callback or ``Trainer(gradient_clip_val=...)`` is also present.
        RuntimeError: at setup, under ``DeepSpeedStrategy`` (its config's ``gradient_clipping`` does this there).

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import ClipGradNorm
        >>> trainer = Trainer(callbacks=[ClipGradNorm(max_norm=1.0)])
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        _set_up(trainer, stage, repr(self), self.max_norm if self.norm_type == 2.0 else None)


@with_policy_docstring
class ClipGradValue(clipping.ClipGradValue, GradKitCallback):
    r"""The Trainer callback of :class:`gradkit.ClipGradValue`: its docstring, then what follows.

    Raises:
        ValueError: at setup, if another clipping callback or ``Trainer(gradient_clip_val=...)`` is also present.
        RuntimeError: at setup, under ``DeepSpeedStrategy``.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import ClipGradValue
        >>> trainer = Trainer(callbacks=[ClipGradValue(clip_value=0.5)])
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        _set_up(trainer, stage, repr(self), None)


@with_policy_docstring
class AutoClip(history_clipping.AutoClip, GradKitCallback):
    r"""The Trainer callback of :class:`gradkit.AutoClip`: its docstring, then what follows.

    Its history is saved in checkpoints under the key ``"AutoClip"``.

    Raises:
        ValueError: at setup, if another clipping callback or ``Trainer(gradient_clip_val=...)`` is also present.
        RuntimeError: at setup, under ``DeepSpeedStrategy``.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import AutoClip
        >>> trainer = Trainer(callbacks=[AutoClip(percentile=10.0)])
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        _set_up(trainer, stage, "AutoClip(...)", None)


@with_policy_docstring
class ZClip(history_clipping.ZClip, GradKitCallback):
    r"""The Trainer callback of :class:`gradkit.ZClip`: its docstring, then what follows.

    Its statistics are saved in checkpoints under the key ``"ZClip"``.

    Raises:
        ValueError: at setup, if another clipping callback or ``Trainer(gradient_clip_val=...)`` is also present.
        RuntimeError: at setup, under ``DeepSpeedStrategy``.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import ZClip
        >>> trainer = Trainer(callbacks=[ZClip(alpha=0.97, z_threshold=2.5)])
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        _set_up(trainer, stage, "ZClip(...)", None)


@with_policy_docstring
class AdaptiveGradClip(agc.AdaptiveGradClip, GradKitCallback):
    r"""The Trainer callback of :class:`gradkit.AdaptiveGradClip`: its docstring, then what follows.

    The parameters are selected at ``fit`` start, from the configured (sharded, wrapped) model.

    Raises:
        ValueError: at setup, if another clipping callback or ``Trainer(gradient_clip_val=...)`` is also present.
        RuntimeError: at setup, under DeepSpeed.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import AdaptiveGradClip
        >>> trainer = Trainer(callbacks=[AdaptiveGradClip(clip_factor=0.01, exclude=["re:head"])])
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        _set_up(trainer, stage, "AdaptiveGradClip(...)", None)


#: The Trainer each clipper given to `clip_gradients` outside `trainer.callbacks` was attached for (weakly held: the
#: clipper lives on the user's module; a copy of it, pickled with the Trainer, attaches again).
_ATTACHED_FOR: weakref.WeakKeyDictionary[Policy, weakref.ref[pl.Trainer]] = weakref.WeakKeyDictionary()


def clip_gradients(module: pl.LightningModule, optimizer: Optimizer, clipper: Policy) -> Tensor:
    r"""Clip the gradients of ``optimizer`` in a manual-optimization ``training_step`` and return their norm.

    Call it after ``self.manual_backward(loss)`` and before ``optimizer.step()``. It measures the gradients once,
    clips them with ``clipper`` (one in-place multiply, no host sync), logs on logging steps like the callbacks, and
    returns the total norm before clipping (a device tensor, in the clipper's norm; 2-norm for AGC, inf-norm for
    value clipping). Every other gradkit callback of the Trainer runs in the same pass, and the step is not measured
    or clipped again when ``optimizer.step()`` reaches ``on_before_optimizer_step``.

    Under 16-mixed AMP the gradients are still multiplied by the loss scale at this point (Lightning unscales inside
    ``optimizer.step()``, and calling ``GradScaler.unscale_`` here would make that call fail): norms and thresholds
    are computed on the unscaled values, from the scaler's scale tensor, so ``max_norm=1.0`` means the same as
    without AMP (``LightningModule.clip_gradients`` clips the scaled values instead, Lightning issue #18089).

    Args:
        module: the LightningModule (``self``).
        optimizer: the optimizer about to step, as returned by ``self.optimizers()``.
        clipper: a clipper: one of the clipping callbacks (``ZClip(...)``; if it is also in the Trainer's
            ``callbacks``, its state is saved in checkpoints) or its torch class
            (``gradkit.ZClip(...)``). Keep the same object across steps: adaptive clippers carry
            state. One object may serve several optimizers: each optimizer keeps its own state (keyed by its index),
            as with a callback.

    Returns:
        The total gradient norm before clipping, a device scalar.

    Raises:
        RuntimeError: with automatic optimization (use the callbacks there).
        ValueError: if the Trainer has a different clipping callback, or ``clipper`` is not a clipper.

    Example::

        class GAN(LightningModule):
            def __init__(self):
                super().__init__()
                self.automatic_optimization = False
                self.clip = ZClip()

            def training_step(self, batch, batch_idx):
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(self.loss(batch))
                norm = clip_gradients(self, opt, self.clip)
                opt.step()
    """
    trainer = module.trainer
    if module.automatic_optimization:
        raise RuntimeError(
            "`clip_gradients` is for manual optimization (`self.automatic_optimization = False`). With automatic "
            "optimization add the clipping callback to the Trainer instead: `Trainer(callbacks=[ClipGradNorm(1.0)])`."
        )
    if not _is_clipper(clipper):
        raise ValueError(
            f"`clipper` must be a gradkit clipper (a clipping callback such as `ClipGradNorm(1.0)`, or its torch class "
            f"from `gradkit.policies.clipping`), got {type(clipper).__name__}."
        )
    attached = [cb for cb in trainer.callbacks if _is_clipper(cb)]
    if attached and attached[0] is not clipper:
        raise ValueError(
            f"The Trainer already has the clipping callback {type(attached[0]).__name__}; `clip_gradients` with "
            f"another clipper ({type(clipper).__name__}) would clip twice. Pass that callback as `clipper` instead."
        )
    raw = unwrapped(optimizer)
    engine = TrainerPipeline.of(trainer)
    attach = Roster.of(clipper).attach
    if not attached and attach:
        attached_for = _ATTACHED_FOR.get(clipper)
        if attached_for is None or attached_for() is not trainer:
            attach[0](engine.context(trainer, module), module)
            _ATTACHED_FOR[clipper] = weakref.ref(trainer)
    record = engine.run(trainer, module, raw, extra=() if attached else (clipper,))
    if record is None:
        record = engine.last_records[id(raw)]
    stats, norm_type = record.stats, getattr(clipper, "norm_type", None)
    return record.decision.scaled((stats.primary if norm_type is None else stats.norms[norm_type]).total)
