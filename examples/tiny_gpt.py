"""Train a tiny GPT from scratch on the Python standard library's source, with gradkit guarding the run.

    python examples/tiny_gpt.py fit --config examples/configs/demo.yaml            # the `make demo` run
    python examples/tiny_gpt.py fit --config examples/configs/demo.yaml --inject-nan-at 40
    python examples/tiny_gpt.py fit --config examples/configs/demo.yaml --model.lr 0.3   # provoke spikes
    python examples/tiny_gpt.py fit --config examples/configs/demo.yaml --inject-spike-at 200 \
        --trainer.callbacks+=lightning_gradkit.SpikeRollback --trainer.callbacks.z_threshold=3.0
    python examples/tiny_gpt.py fit --help                                          # every option, documented

Everything the run does to the gradient path comes from callbacks listed in the YAML (or added on the command
line with ``--trainer.callbacks+=lightning_gradkit.ZClip``); the LightningModule is plain.
"""

from __future__ import annotations

from typing import Literal

from lightning.pytorch.cli import LightningCLI

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


def main(args: list[str] | None = None) -> TinyGPTCLI:
    return TinyGPTCLI(TinyGPTModule, StdlibTextDataModule, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
