"""The Trainer callbacks of :class:`gradkit.EarlyWarning`, :class:`gradkit.QKClip`, :class:`gradkit.UpdateClip`,
:class:`gradkit.EscalationLadder` and :class:`gradkit.StepsToSkip`: their Lightning-only hooks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from torch import Tensor

import gradkit.policies.early_warning
import gradkit.policies.ladder
import gradkit.policies.qk_clip
import gradkit.policies.steps_to_skip
import gradkit.policies.update_clip
from lightning_gradkit._deepspeed import refuse_under_deepspeed
from lightning_gradkit._docstring import with_policy_docstring
from lightning_gradkit.strategy import require_gradkit_step
from lightning_gradkit.trainer_door import GradKitCallback, TrainerPipeline

__all__ = ["EarlyWarning", "EscalationLadder", "QKClip", "StepsToSkip", "UpdateClip"]


@with_policy_docstring
class EarlyWarning(gradkit.EarlyWarning, GradKitCallback):
    r"""The Trainer callback of :class:`gradkit.EarlyWarning`: its docstring, then what follows.

    Under a Trainer the SpikeScore takes each batch's loss from Lightning's own detached copy (the ``loss`` of
    ``training_step``'s output, at the batch end), so a step that does not log costs no device operation at all.
    ``action="escalate"`` works with any strategy (the learning-rate cut acts inside ``optimizer.step``). Not under
    DeepSpeed, whose engine owns the optimizer state.

    Raises:
        RuntimeError: at setup, under ``DeepSpeedStrategy``.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import EarlyWarning, GradNormMonitor
        >>> trainer = Trainer(callbacks=[GradNormMonitor(report=True), EarlyWarning(output="model.lm_head")])
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            refuse_under_deepspeed(
                trainer,
                "`EarlyWarning(...)`",
                "its Adam signals read the optimizer's state and its escalation resets it, but the DeepSpeed engine "
                "owns the optimizer state (partitioned under ZeRO)",
                "Use Lightning's DDP or FSDP strategies for EarlyWarning.",
            )

    _trained = False  # whether the current batch ran a backward (a batch StepsToSkip dropped runs none)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        """The batch trains; its loss is taken at the batch end, already detached by Lightning (no operation here).
        The backward pass is counted as :class:`GradKitCallback` counts it, without its ``note_loss`` call."""
        self._trained = True
        (self._gradkit_engine or TrainerPipeline.of(trainer)).pipeline.generation += 1

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if self._trained and isinstance(loss, Tensor):
            self._signals.note_loss(loss, detached=True)
        self._trained = False
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


@with_policy_docstring
class StepsToSkip(gradkit.StepsToSkip, GradKitCallback):
    r"""The Trainer callback of :class:`gradkit.StepsToSkip`: its docstring, then what follows.

    Under a Trainer the GradKit strategy drops a declared step: its ``training_step`` returns without a forward, the
    backward and the optimizer step are left out, the step-interval LR schedulers hold, and ``trainer.global_step``
    and ``gradkit/skipped_steps`` count the step, as for a step a guard skipped. It needs a GradKit strategy and
    automatic optimization.

    Raises:
        RuntimeError: at setup, on a strategy that is not a GradKit strategy (the message names the one to use),
            under manual optimization or DeepSpeed.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import StepsToSkip
        >>> trainer = Trainer(strategy="gradkit", accelerator="cpu", callbacks=[StepsToSkip(steps=[[1200, 1450]])])
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        require_gradkit_step(
            trainer,
            pl_module,
            "StepsToSkip",
            "drops the batches of declared steps",
            deepspeed=(
                "the GradKit strategy drops a declared step's batches, and DeepSpeed's engine owns the step",
                "DeepSpeed has no declared data skip: leave the batches out of your data loader.",
            ),
            manual="Return early from `training_step` where `StepsToSkip.range_of(self.global_step)` is not None "
            "instead.",
        )


@with_policy_docstring
class QKClip(gradkit.QKClip, GradKitCallback):
    r"""The Trainer callback of :class:`gradkit.QKClip`: its docstring, then what follows.

    Under a Trainer the rescale runs at the end of each batch that stepped the optimizer (``on_train_batch_end``),
    with DDP, FSDP2 and tensor parallelism (``GradKitModelParallelStrategy``, sharding in ``configure_model``) or a
    single device (not FSDP1, whose flat shards hide the rows, nor DeepSpeed, whose engine owns the weights);
    validation forwards are not read (the module is in eval mode).

    Raises:
        RuntimeError: at setup, under ``DeepSpeedStrategy``.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import QKClip
        >>> trainer = Trainer(callbacks=[QKClip(threshold=100.0)])
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            refuse_under_deepspeed(
                trainer,
                "`QKClip(...)`",
                "it rescales the query and key weights after the step, and the DeepSpeed engine owns them (partitioned "
                "under ZeRO)",
                "Use Lightning's DDP strategy for QKClip.",
            )


@with_policy_docstring
class UpdateClip(gradkit.UpdateClip, GradKitCallback):
    r"""The Trainer callback of :class:`gradkit.UpdateClip`: its docstring, then what follows.

    Under a Trainer the parameters are copied in ``on_before_optimizer_step`` and the update is rescaled as
    ``optimizer.step()`` returns (a step post-hook), with any strategy but DeepSpeed, whose engine owns the step; the
    values are logged at the batch end.

    Raises:
        RuntimeError: at setup, under ``DeepSpeedStrategy``.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import UpdateClip
        >>> trainer = Trainer(callbacks=[UpdateClip(sigma_factor=3.0, history_size=128)])
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            refuse_under_deepspeed(
                trainer,
                "`UpdateClip(...)`",
                "it rescales the parameters after the optimizer step, and the DeepSpeed engine owns the step and the "
                "parameters (partitioned under ZeRO)",
                "Use Lightning's DDP or FSDP strategies for UpdateClip.",
            )


@with_policy_docstring
class EscalationLadder(gradkit.EscalationLadder, GradKitCallback):
    r"""The Trainer callback of :class:`gradkit.EscalationLadder`: its docstring, then what follows.

    Under a Trainer the ``stop`` rung raises :class:`~gradkit.TrainingStopped` from the callback hook:
    Lightning calls the callbacks' ``on_exception`` and finalizes the loggers, then lets it through ``trainer.fit``,
    and the script (a ``LightningCLI`` one too) exits with ``exit_code``. ``ModelCheckpoint`` saves nothing at the
    stop (resume from its last checkpoint). Keep a reference to the ladder for the z-loss: ``self.trainer.callbacks``
    holds it. Not under DeepSpeed, whose engine owns the optimizer state its ``lr_cut`` resets.

    Raises:
        RuntimeError: at setup, under ``DeepSpeedStrategy``.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import EarlyWarning, EscalationLadder, QKClip, SpikeRollback
        >>> trainer = Trainer(
        ...     strategy="gradkit",
        ...     accelerator="cpu",
        ...     callbacks=[
        ...         EarlyWarning(output="model.lm_head"),
        ...         QKClip(threshold=100.0, enabled=False),
        ...         SpikeRollback("loss", snapshot_every_n_steps=100),
        ...         EscalationLadder(z_loss=1e-4),
        ...     ],
        ... )
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            refuse_under_deepspeed(
                trainer,
                "`EscalationLadder(...)`",
                "its 'lr_cut' rung cuts the learning rate inside the optimizer step and resets the optimizer state, "
                "but the DeepSpeed engine owns the optimizer state (partitioned under ZeRO) and its step",
                "Use Lightning's DDP or FSDP strategies for EscalationLadder.",
            )
