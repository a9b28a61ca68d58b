"""The figure docs/incident_panel.png: the update-ratio panel and the incident panels of a tiny GPT run.

    python docs/incident_demo.py [--out docs/incident_panel.png]      # CPU, about a minute

A 3-layer tiny GPT trains 120 steps, logging every step, with ``GradNormMonitor(update_ratio=True)``. Two faults are
injected: the learning rate is multiplied by 100 for steps 60-62 (``SpikeInjector``; ``SpikeGuard`` skips the
steps whose gradient norm spikes after it), and a NaN comes out of ``model.blocks.1.mlp`` at step 90
(``FaultInjector``; ``NonFiniteGuard`` skips the step and its replay names the module). The PNG is the lower part
of the gradient report: the update-to-weight ratio per module, then one incident panel per group of events.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import warnings
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger
from matplotlib.transforms import Bbox

from gradkit.report.data import load_run
from gradkit.report.figure import build_figure
from lightning_gradkit import GradNormMonitor, NonFiniteGuard, SpikeGuard
from lightning_gradkit.demos import FaultInjector, SpikeInjector, StdlibTextDataModule, TinyGPTModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "incident_panel.png"))
    parser.add_argument("--max-steps", type=int, default=120)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    pl.seed_everything(0, verbose=False)
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            accelerator="cpu",
            strategy="gradkit",
            max_steps=args.max_steps,
            log_every_n_steps=1,
            limit_val_batches=0,
            logger=CSVLogger(root, name="run"),
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[
                SpikeInjector(step=60, steps=3, factor=100.0),
                GradNormMonitor(update_ratio=True),
                NonFiniteGuard(action="skip"),
                SpikeGuard(monitor="grad_norm", action="skip", z_threshold=4.0),
                FaultInjector(step=90, module="model.blocks.1.mlp"),
            ],
        )
        model = TinyGPTModule(n_layer=3, n_head=2, n_embd=48, block_size=32, lr=0.003)
        trainer.fit(model, StdlibTextDataModule(block_size=32, batch_size=16, max_bytes=100_000))
        fig = build_figure(load_run(trainer.logger.log_dir))
    # From the top of the update-ratio panel's title to the bottom of the figure.
    ratio = next(ax for ax in fig.axes if ax.get_label() == "update ratio")
    top = ratio.get_position().y1 * fig.get_figheight() + 0.25
    fig.savefig(args.out, dpi=100, bbox_inches=Bbox([[0.0, 0.0], [fig.get_figwidth(), top]]))
    print(args.out)


if __name__ == "__main__":
    main()
