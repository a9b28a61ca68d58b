"""``SpikeRollback`` as a Lightning ``Trainer`` callback: the torch policy (:mod:`gradkit.policies.rollback`) with the
checks and hooks only a Trainer has."""

from __future__ import annotations

import lightning.pytorch as pl

from gradkit.policies import rollback
from lightning_gradkit._docstring import with_policy_docstring
from lightning_gradkit.strategy import rank_zero_checkpoint_reason, require_gradkit_step
from lightning_gradkit.trainer_door import GradKitCallback, TrainerPipeline

__all__ = ["SpikeRollback"]


@with_policy_docstring
class SpikeRollback(rollback.SpikeRollback, GradKitCallback):
    """The Trainer callback of :class:`gradkit.SpikeRollback`: its docstring, then what follows.

    Under a Trainer it needs a GradKit strategy (which skips the step that fires and puts back the buffers of every
    skipped step) and automatic optimization. The first snapshot is taken at ``on_train_start``.

    A callback of its own rather than ``SpikeGuard(action="rollback")``: its snapshots cost host memory and copies,
    a visible choice. It composes with the guards: they skip a single bad batch at once, ``SpikeRollback`` acts only
    when skipping did not cure the run, with its own ``patience``, thresholds and budget.

    Raises:
        ValueError: at setup, for ``save_snapshots=True`` with several ranks under ``FSDPStrategy`` or
            ``ModelParallelStrategy(save_distributed_checkpoint=False)``: each rank's snapshots hold its own shards,
            and there Lightning saves callback states from rank 0 only. ``GradKitModelParallelStrategy`` with
            ``save_distributed_checkpoint=True`` (the default) saves every rank's snapshots in its distributed
            checkpoint (sub-folder ``gradkit_rank_local``), and a resume on another number of ranks is refused.
        RuntimeError: at setup, on a strategy that cannot skip an optimizer step (the message names the GradKit
            strategy to use), under manual optimization or DeepSpeed.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import NonFiniteGuard, SpikeGuard, SpikeRollback
        >>> trainer = Trainer(
        ...     strategy="gradkit",
        ...     accelerator="cpu",
        ...     callbacks=[
        ...         NonFiniteGuard(action="skip"),
        ...         SpikeGuard("loss", action="skip"),
        ...         SpikeRollback("loss", patience=3, snapshot_every_n_steps=100, skip_batches=200),
        ...     ],
        ... )
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        require_gradkit_step(
            trainer,
            pl_module,
            "SpikeRollback",
            "skips the optimizer step that triggers a rollback",
            deepspeed=(
                "it restores the parameters and optimizer state from a snapshot and skips the triggering step, but "
                "the DeepSpeed engine owns the optimizer state (partitioned under ZeRO) and its step",
                "DeepSpeed has no rollback (no config key does it). Save checkpoints (`ModelCheckpoint("
                "every_n_train_steps=...)`) and resume from the last good one with `trainer.fit(..., ckpt_path=...)`.",
            ),
            manual="",
        )
        why = rank_zero_checkpoint_reason(trainer.strategy) if trainer.world_size > 1 else None
        if self.save_snapshots and why is not None:
            raise ValueError(
                f"SpikeRollback(save_snapshots=True) saves the snapshots in its checkpoint state, and under "
                f"{type(trainer.strategy).__name__} every rank's snapshots hold its own shards, but {why}. Or use "
                "`save_snapshots=False`: a resumed run then takes its first snapshot at the resume."
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the checkpoint's states were loaded, before the first epoch's data loader draws from the RNGs (its
        # sampler's seed): the first snapshot holds the RNG states the run starts with.
        self._start(TrainerPipeline.of(trainer).context(trainer, pl_module))
