"""Train a tiny GPT from scratch on the Python standard library's source, with gradkit guarding the run.

    python examples/tiny_gpt.py fit --config examples/configs/demo.yaml            # the `make demo` run
    python examples/tiny_gpt.py fit --config examples/configs/demo.yaml --inject-nan-at 150 \
        --inject-into model.blocks.3.attn                     # a second fault: demo.yaml's injects at step 40
    python examples/tiny_gpt.py fit --config examples/configs/demo.yaml --model.lr 0.3   # provoke spikes
    python examples/tiny_gpt.py fit --config examples/configs/demo.yaml --inject-spike-at 200 \
        --trainer.callbacks+=lightning_gradkit.SpikeRollback --trainer.callbacks.z_threshold=3.0
    python examples/tiny_gpt.py fit --help                                          # every option, documented

Everything the run does to the gradient path comes from callbacks listed in the YAML (or added on the command
line with ``--trainer.callbacks+=lightning_gradkit.GraphLeakGuard``); the LightningModule is plain.

Two messages of third-party libraries are hidden while the example runs, since a newcomer takes them for
gradkit's: Lightning 2.6's ``FutureWarning`` about torch's deprecated ``LeafSpec`` (Lightning's own code builds
one) and Lightning's "Tip" advertising its LitLogger service. Every other line is shown.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_module

import lightning_gradkit  # noqa: F401  (registers the "gradkit*" strategy names)
from lightning_gradkit.demos import FaultInjector, SpikeInjector, StdlibTextDataModule, TinyGPTModule


class TinyGPTCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--inject-nan-at", type=int | None, default=None, help="optimizer step whose batch gets a NaN activation"
        )
        parser.add_argument("--inject-into", type=str, default="model.blocks.1.mlp", help="module that gets the NaN")
        parser.add_argument(
            "--inject-spike-at",
            type=int | None,
            default=None,
            help="optimizer step from which the learning rate is multiplied: a loss spike that persists",
        )
        parser.add_argument("--inject-spike-steps", type=int, default=4, help="optimizer steps the raised rate lasts")
        parser.add_argument("--inject-spike-factor", type=float, default=100.0, help="learning-rate multiplier")
        parser.add_argument(
            "--inject-spike-clock",
            type=Literal["global_step", "optimizer"],
            default="global_step",
            help='what counts the steps of --inject-spike-at: "optimizer" (its step count) rewinds with a rollback, '
            "so the spike comes back after it",
        )
        parser.link_arguments("model.block_size", "data.block_size")

    def before_fit(self) -> None:
        config = self.config[self.subcommand]
        if config.inject_nan_at is not None:
            self.trainer.callbacks.append(FaultInjector(config.inject_nan_at, config.inject_into))
        if config.inject_spike_at is not None:
            # First: it puts the learning rate back before a SpikeRollback snapshot reads the optimizer.
            injector = SpikeInjector(
                config.inject_spike_at, config.inject_spike_steps, config.inject_spike_factor, config.inject_spike_clock
            )
            self.trainer.callbacks.insert(0, injector)


def _not_a_litlogger_tip(record: logging.LogRecord) -> bool:
    return "Tip: For seamless cloud logging" not in record.getMessage()


@contextmanager
def third_party_noise_hidden() -> Iterator[None]:
    """Hide Lightning's ``LeafSpec`` deprecation warning and its LitLogger tip, for the duration of the block."""
    logger = rank_zero_module.log  # the logger Lightning's `rank_zero_info` writes to
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
        )
        logger.addFilter(_not_a_litlogger_tip)
        try:
            yield
        finally:
            logger.removeFilter(_not_a_litlogger_tip)


def main(args: list[str] | None = None) -> TinyGPTCLI:
    with third_party_noise_hidden():
        return TinyGPTCLI(TinyGPTModule, StdlibTextDataModule, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
