"""Write ``legacy_zclip.ckpt`` and ``legacy_autoclip.ckpt``: checkpoints of lightning_gradkit 0.1.0.dev0.

They were written with the package as laid out before the re-layout, by running this script once from the
repository root. The files are test fixtures, committed on purpose: ``tests/test_legacy_checkpoint.py`` loads them
with the current code, so a change of module paths or state keys that breaks old checkpoints fails a test. Every
stateful gradkit piece is in them: the clipping policies (ZClip in one, AutoClip in the other: a Trainer keeps one
clipper), NonFiniteGuard, SpikeGuard, SpikeRollback, SyncAudit, the strategy's scheduler counts
(``"gradkit_lr_schedule"``) and an open accumulation window (``"gradkit_accumulation_window"``),
saved mid-window from a callback.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

from helpers import MLPModule, loader  # noqa: E402
from lightning_gradkit import (  # noqa: E402
    AccumulationGuard,
    AutoClip,
    GradNormMonitor,
    NonFiniteGuard,
    SpikeGuard,
    SpikeRollback,
    SyncAudit,
    ZClip,
)

CLIPPERS = {"zclip": ZClip, "autoclip": lambda: AutoClip(percentile=50.0)}
SAVE_AT_BATCH = 8  # batch index 8 of a 2-batch window: the checkpoint holds an open window (batch 9 is pending)


class ScheduledMLP(MLPModule):
    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 2}}


def fixture(clipper: str) -> Path:
    return HERE / f"legacy_{clipper}.ckpt"


def callbacks(clipper: str) -> list[pl.Callback]:
    """The callbacks of the run that wrote the fixture (and of the run that loads it)."""
    return [
        GradNormMonitor(),
        CLIPPERS[clipper](),
        NonFiniteGuard(),
        SpikeGuard(warmup_steps=2),
        SpikeRollback(warmup_steps=2, snapshot_every_n_steps=2),
        SyncAudit(),
        AccumulationGuard(),
    ]


class SaveMidWindow(pl.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if args[-1] == SAVE_AT_BATCH:
            trainer.save_checkpoint(self.path)


def main() -> None:
    for clipper in CLIPPERS:
        write(clipper)


def trainer(root: str | Path, max_steps: int, callbacks: list[pl.Callback]) -> pl.Trainer:
    """The Trainer of the run that wrote the fixtures (``max_steps=5``) and of the runs that resume from them."""
    return pl.Trainer(
        accelerator="cpu",
        strategy="gradkit",
        max_steps=max_steps,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=callbacks,
    )


def write(clipper: str) -> None:
    torch.manual_seed(0)
    path = fixture(clipper)
    with tempfile.TemporaryDirectory() as tmp:
        trainer(tmp, 5, [*callbacks(clipper), SaveMidWindow(path)]).fit(
            ScheduledMLP(lr=0.05), loader(n=128, batch_size=8)
        )
    print(f"wrote {path.name} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
