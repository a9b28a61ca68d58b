"""LightningCLI builds every gradkit callback from YAML or the command line, with jsonargparse's errors."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
from lightning.pytorch.cli import LightningCLI

from helpers import exported_callbacks
from lightning_gradkit import GradNormMonitor
from lightning_gradkit.demos import StdlibTextDataModule, TinyGPTModule

BASE = [
    "--seed_everything=0",  # else Lightning warns "No seed found"
    "--trainer.accelerator=cpu",
    "--trainer.max_steps=2",
    "--trainer.log_every_n_steps=1",  # a run shorter than the logging period makes GradNormMonitor warn
    "--trainer.limit_val_batches=0",
    "--trainer.enable_progress_bar=false",
    "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
    "--data.max_bytes=20000",
    "--model.n_layer=1",
]


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    # LightningCLI warns when both `args` and sys.argv are given; under pytest sys.argv is pytest's.
    monkeypatch.setattr("sys.argv", ["cli"])


def cli(args: list[str], run: bool = True) -> LightningCLI:
    return LightningCLI(TinyGPTModule, StdlibTextDataModule, args=(["fit"] if run else []) + args, run=run)


def test_callback_from_command_line_with_init_args(tmp_path: Path) -> None:
    result = cli(
        [
            *BASE,
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.callbacks+=lightning_gradkit.GradNormMonitor",
            "--trainer.callbacks.depth=2",
            "--trainer.callbacks.norm_type=1.0",
        ]
    )
    monitors = [c for c in result.trainer.callbacks if isinstance(c, GradNormMonitor)]
    assert len(monitors) == 1 and monitors[0].depth == 2 and monitors[0].norm_type == 1.0
    assert result.trainer.global_step == 2


def test_callback_from_yaml(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning_gradkit.GradNormMonitor\n"
        "      init_args:\n        depth: 1\n        param_groups: true\n"
    )
    result = cli([f"--config={config}", *BASE, f"--trainer.default_root_dir={tmp_path}"])
    (monitor,) = [c for c in result.trainer.callbacks if isinstance(c, GradNormMonitor)]
    assert monitor.depth == 1 and monitor.param_groups


def test_wrong_class_path_gives_jsonargparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli([*BASE, "--trainer.callbacks+=lightning_gradkit.NoSuchCallback"])
    err = capsys.readouterr().err
    assert "lightning_gradkit.NoSuchCallback" in err


def test_wrong_argument_name_gives_jsonargparse_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning_gradkit.GradNormMonitor\n"
        "      init_args:\n        dept: 2\n"
    )
    with pytest.raises(SystemExit):
        cli([f"--config={config}", *BASE])
    assert "dept" in capsys.readouterr().err


def test_invalid_value_reaches_our_validation_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises((SystemExit, ValueError)) as info:
        cli([*BASE, "--trainer.callbacks+=lightning_gradkit.GradNormMonitor", "--trainer.callbacks.depth=-1"])
    text = str(info.value) + capsys.readouterr().err
    assert "depth" in text


def test_help_shows_each_arguments_documentation(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli(["fit", "--trainer.callbacks.help", "lightning_gradkit.GradNormMonitor"], run=False)
    out = " ".join(capsys.readouterr().out.split())
    assert "--trainer.callbacks.depth DEPTH" in out
    assert "module-tree depth of the per-module norms" in out
    assert "the p of the norm" in out


# Every public callback, with arguments a user would type (the required ones, and one other than its default).
CALLBACK_ARGS: dict[str, dict[str, object]] = {
    "GradNormMonitor": {"depth": 1, "norm_type": 1.0},
    "ClipGradNorm": {"max_norm": 1.0, "norm_type": 1.0},
    "ClipGradValue": {"clip_value": 0.5},
    "AdaptiveGradClip": {"clip_factor": 0.02, "exclude": ["re:^head"]},
    "AutoClip": {"percentile": 20.0, "history_size": 50},
    "ZClip": {"z_threshold": 3.0, "max_norm": 2.0},
    "NonFiniteGuard": {"action": "warn", "max_consecutive": 3},
    "SpikeGuard": {"monitor": "grad_norm", "window": 30},
    "SpikeRollback": {"skip_batches": 10, "keep": 3},
    "EarlyWarning": {"growth_steps": 10, "action": "escalate"},
    "EscalationLadder": {"rungs": ["warn", "lr_cut", "stop"], "calm_steps": 500, "exit_code": 70},
    "StepsToSkip": {"steps": [[5, 7]]},
    "QKClip": {"threshold": 50.0, "attention": ["CausalSelfAttention"]},
    "UpdateClip": {"sigma_factor": 2.0, "history_size": 64, "modules": ["Block"], "divide_by_lr": False},
    "ActivationCheckpointing": {"targets": ["Block"], "mode": "selective"},
    "InferenceModeValidation": {"fallback": "raise"},
    "CheckpointGuard": {"action": "raise"},
    "AccumulationGuard": {"normalize": "tokens", "tokens_key": "n"},
    "SyncAudit": {"every_n_steps": 5, "mode": "raise", "max_syncs_per_step": 2},
    "GraphLeakGuard": {"check_every_n_steps": 5, "gc_scan": True},
}


def stored(callback: object, name: str) -> object:
    """The value a callback keeps for a constructor argument."""
    return getattr(callback, name)


def test_every_public_callback_is_covered() -> None:
    assert set(exported_callbacks()) == set(CALLBACK_ARGS)


@pytest.mark.parametrize("name", sorted(CALLBACK_ARGS))
def test_every_callback_builds_from_the_command_line(name: str) -> None:
    import lightning_gradkit

    cls = getattr(lightning_gradkit, name)
    arguments = CALLBACK_ARGS[name]
    typed = [f"--trainer.callbacks.{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in arguments.items()]
    result = cli([*BASE, f"--trainer.callbacks+=lightning_gradkit.{name}", *typed], run=False)
    (built,) = [c for c in result.trainer.callbacks if type(c) is cls]
    reference = cls(**arguments)  # the same arguments, in Python
    defaults = inspect.signature(cls.__init__).parameters
    for key, value in arguments.items():
        assert value != defaults[key].default  # else the check below could not tell the value was passed
        assert stored(built, key) == stored(reference, key) == value, key


CLIP_ARGUMENTS = {
    "ClipGradNorm": ["max_norm", "norm_type"],
    "ClipGradValue": ["clip_value"],
    "AdaptiveGradClip": ["clip_factor", "eps", "exclude"],
    "AutoClip": ["percentile", "history_size"],
    "ZClip": ["alpha", "z_threshold", "warmup_steps", "max_norm"],
}


@pytest.mark.parametrize("name", sorted(CLIP_ARGUMENTS))
def test_clipping_callbacks_show_jsonargparse_only_their_public_arguments(name: str) -> None:
    from jsonargparse import ArgumentParser

    import lightning_gradkit

    parser = ArgumentParser()
    parser.add_class_arguments(getattr(lightning_gradkit, name), "cb")
    assert [a.dest[3:] for a in parser._actions if a.dest.startswith("cb.")] == CLIP_ARGUMENTS[name]


def test_help_describes_every_argument_of_every_callback() -> None:
    # What `--trainer.callbacks.help <name>` prints for each argument: jsonargparse's reading of the class docstring's
    # Args (the composed one for a policy's callback), independent of the docs test's own parser.
    from jsonargparse import ArgumentParser

    undocumented = {}
    for name, cls in exported_callbacks().items():
        parser = ArgumentParser()
        parser.add_class_arguments(cls, "cb")
        helps = {a.dest[3:]: (a.help or "").strip() for a in parser._actions if a.dest.startswith("cb.")}
        assert set(helps) == set(inspect.signature(cls.__init__).parameters) - {"self"}, name
        if missing := sorted(argument for argument, text in helps.items() if not text):
            undocumented[name] = missing
    assert not undocumented, f"arguments that LightningCLI's --help shows without a description: {undocumented}"


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("gradkit", "GradKitSingleDeviceStrategy"),
        ("gradkit_ddp", "GradKitDDPStrategy"),
        ("gradkit_ddp_spawn", "GradKitDDPStrategy"),
        ("gradkit_model_parallel", "GradKitModelParallelStrategy"),
    ],
)
def test_strategy_names_resolve_from_the_command_line(name: str, cls: str) -> None:
    import lightning_gradkit

    devices = "1" if name == "gradkit" else "2"
    result = cli([*BASE, f"--trainer.strategy={name}", f"--trainer.devices={devices}"], run=False)
    assert isinstance(result.trainer.strategy, getattr(lightning_gradkit, cls))
