"""ActivationCheckpointing in Lightning's Trainer (CPU): same training as a plain PyTorch loop, less memory."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from helpers import make_trainer, read_metrics
from lightning_gradkit import ActivationCheckpointing, inject_activation_checkpointing
from lightning_gradkit.activation_checkpointing.injection import injected_mode
from lightning_gradkit.demos import ByteDataset, GPTConfig, TinyGPT, TinyGPTModule, stdlib_text
from test_activation_checkpointing import live_activation_bytes

MODEL = dict(n_layer=3, n_head=2, n_embd=32, block_size=32, dropout=0.1, lr=1e-2)
STEPS = 3


def loader() -> DataLoader:
    return DataLoader(ByteDataset(stdlib_text(max_bytes=4000), block_size=32), batch_size=4)


class GradRecorder(pl.Callback):
    """Gradients (and whether the blocks were checkpointed) at every optimizer step."""

    def __init__(self) -> None:
        self.grads: list[dict[str, Tensor]] = []
        self.injected: list[bool] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters()})
        blocks = [m for m in pl_module.modules() if type(m).__name__ == "Block"]
        self.injected.append(all(injected_mode(b) is not None for b in blocks))


def reference_grads(module_cls: type[pl.LightningModule] = TinyGPTModule) -> list[dict[str, Tensor]]:
    """A hand-written loop without checkpointing, same seed, same batches, same optimizer."""
    torch.manual_seed(0)
    module = module_cls(**MODEL)
    module.configure_model()
    optimizer = module.configure_optimizers()
    grads = []
    for step, batch in zip(range(STEPS), loader(), strict=False):
        optimizer.zero_grad()
        module.training_step(batch, step).backward()
        grads.append({n: p.grad.clone() for n, p in module.named_parameters()})
        optimizer.step()
    return grads


def fit(
    tmp_path: Path, *callbacks: pl.Callback, module_cls: type[pl.LightningModule] = TinyGPTModule
) -> pl.LightningModule:
    torch.manual_seed(0)
    module = module_cls(**MODEL)
    make_trainer(tmp_path, max_steps=STEPS, logger=False, callbacks=list(callbacks)).fit(module, loader())
    return module


def assert_same_grads(got: list[dict[str, Tensor]], expected: list[dict[str, Tensor]]) -> None:
    assert len(got) == len(expected) == STEPS
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g.keys() == e.keys()
        for name in e:
            torch.testing.assert_close(g[name], e[name], rtol=0, atol=1e-6, msg=f"step {step}: {name}")


@pytest.mark.parametrize(
    "kwargs",
    [{"mode": "full"}, {"mode": "selective"}, {"memory_budget": 0.5}, {"every_n": 2, "offload": True}],
    ids=["full", "selective", "budget", "every_2nd_offload"],
)
def test_training_with_the_callback_matches_a_plain_loop_without_checkpointing(tmp_path: Path, kwargs: dict) -> None:
    recorder = GradRecorder()
    callback = ActivationCheckpointing(["Block"], **kwargs)
    if kwargs.get("offload"):
        with pytest.warns(UserWarning, match="`offload=True` has no effect on CPU"):
            fit(tmp_path, callback, recorder)
    else:
        fit(tmp_path, callback, recorder)
    assert_same_grads(recorder.grads, reference_grads())
    # the measuring step ran and checkpointing was active during the steps
    assert callback.saved_bytes_after < callback.saved_bytes_before
    if "memory_budget" in kwargs:
        assert callback.saved_bytes_after <= 0.5 * callback.saved_bytes_before
        assert 0 < len(callback.checkpointed_modules) < MODEL["n_layer"]
    elif "every_n" in kwargs:
        assert callback.checkpointed_modules == ["model.blocks.1"]
    else:
        assert all(recorder.injected)


def test_measured_bytes_match_the_live_storage_reference_on_the_first_batch(tmp_path: Path) -> None:
    callback = ActivationCheckpointing(["Block"])
    fit(tmp_path, callback)
    torch.manual_seed(0)
    module = TinyGPTModule(**MODEL)
    batch = next(iter(loader()))
    before = live_activation_bytes(lambda: module.training_step(batch, 0), module, batch)
    inject_activation_checkpointing(module, ["Block"])
    after = live_activation_bytes(lambda: module.training_step(batch, 0), module, batch)
    assert (callback.saved_bytes_before, callback.saved_bytes_after) == (before, after)
    assert after <= 0.4 * before


def test_summary_names_the_checkpointed_modules_and_the_measured_bytes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        fit(tmp_path, ActivationCheckpointing(["Block"], every_n=2))
    summary = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("ActivationCheckpointing:"))
    lines = summary.splitlines()
    assert "1 of 3 matching modules checkpointed" in lines[0]
    assert [line.split()[0] for line in lines[2:5]] == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    assert [line.split()[-1] for line in lines[2:5]] == ["no", "yes", "no"]
    assert "without checkpointing ->" in summary
    assert len(lines) <= 25


class BatchNormLogging(TinyGPTModule):
    """Buffers that a forward updates, and epoch-aggregated logging: the measuring step must touch neither."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.norm = nn.BatchNorm1d(kwargs["n_embd"])

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        h = self.model.wte(x)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        h = h + torch.randn_like(h) * 0.01  # consumes the global RNG outside any checkpointed module
        for block in self.model.blocks:
            h = block(h)
        logits = self.model.lm_head(self.model.ln_f(h))
        loss = nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss


def test_measuring_step_leaves_buffers_rng_and_logged_metrics_untouched(tmp_path: Path) -> None:
    def run(path: Path, callbacks: list[pl.Callback]) -> tuple[pl.LightningModule, list[dict[str, str]]]:
        torch.manual_seed(0)
        module = BatchNormLogging(**MODEL)
        trainer = make_trainer(path, max_steps=STEPS, callbacks=callbacks)
        trainer.fit(module, loader())
        return module, read_metrics(trainer)

    plain, plain_rows = run(tmp_path / "plain", [])
    callback = ActivationCheckpointing(["Block"], memory_budget=0.6)
    ours, rows = run(tmp_path / "ours", [callback])
    assert callback.saved_bytes_before is not None
    assert rows == plain_rows
    assert torch.equal(ours.norm.running_mean, plain.norm.running_mean)
    assert ours.norm.num_batches_tracked == plain.norm.num_batches_tracked == STEPS
    for (name, p), q in zip(ours.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)


def test_targets_matching_nothing_raise_at_setup_with_the_module_classes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"match no submodule of `TinyGPTModule`.*Block, CausalSelfAttention"):
        fit(tmp_path, ActivationCheckpointing(["TransformerBlock"]))


class LateGPT(TinyGPTModule):
    """Builds its model in ``configure_model`` (as sharded models do)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            h = self.hparams
            self.model = TinyGPT(GPTConfig(256, h.block_size, h.n_layer, h.n_head, h.n_embd, h.dropout))


def test_modules_created_in_configure_model_are_checkpointed_at_fit_start(tmp_path: Path) -> None:
    recorder = GradRecorder()
    callback = ActivationCheckpointing(["Block"], mode="selective")
    module = fit(tmp_path, callback, recorder, module_cls=LateGPT)
    assert all(recorder.injected)
    assert callback.checkpointed_modules == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    assert_same_grads(recorder.grads, reference_grads(LateGPT))
    assert not any(injected_mode(m) for m in module.modules())  # teardown gave the model back as it was


def test_targets_still_missing_after_configure_model_raise_at_fit_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"match no submodule of `LateGPT`.*Block"):
        fit(tmp_path, ActivationCheckpointing(["TransformerBlock"]), module_cls=LateGPT)


class WrapsItself(TinyGPTModule):
    """Checkpoints its blocks with ``checkpoint_wrapper`` after the callback's setup, as
    ``FSDPStrategy(activation_checkpointing_policy=...)`` does when it wraps the model."""

    def configure_model(self) -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(self.model, check_fn=lambda m: isinstance(m, type(self.model.blocks[0])))


def test_a_second_checkpointing_applied_later_undoes_ours_with_a_warning(tmp_path: Path) -> None:
    recorder = GradRecorder()
    with (
        pytest.warns(UserWarning, match="also checkpointed by checkpoint_wrapper"),
        pytest.warns(UserWarning, match=r"already checkpointed and are left as they are.*\(checkpoint_wrapper\)"),
    ):
        module = fit(tmp_path, ActivationCheckpointing(["Block"]), recorder, module_cls=WrapsItself)
    blocks = [m for m in module.modules() if type(m).__name__ == "Block"]
    assert len(blocks) == 3 and not any(injected_mode(b) for b in blocks)
    assert not any(recorder.injected)


def test_two_callbacks_on_the_same_modules_checkpoint_them_once(tmp_path: Path) -> None:
    first, second = ActivationCheckpointing(["Block"]), ActivationCheckpointing(["Block"], mode="selective")
    recorder = GradRecorder()
    with pytest.warns(UserWarning, match=r"already checkpointed.*model\.blocks\.0 \(lightning_gradkit\)"):
        fit(tmp_path, first, second, recorder)
    assert first.checkpointed_modules == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    assert second.checkpointed_modules == []
    assert_same_grads(recorder.grads, reference_grads())


def test_lightning_checkpoints_load_with_and_without_the_callback(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = TinyGPTModule(**MODEL)
    trainer = make_trainer(tmp_path, max_steps=2, logger=False, callbacks=[ActivationCheckpointing(["Block"])])
    trainer.fit(module, loader())
    trainer.save_checkpoint(tmp_path / "with.ckpt")
    # saved with injection -> loaded into a plain model (strict)
    plain = TinyGPTModule.load_from_checkpoint(tmp_path / "with.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), module.parameters(), strict=True))
    # saved without injection -> resumed with it
    trainer = make_trainer(tmp_path, max_steps=2, logger=False)
    trainer.fit(plain, loader())
    trainer.save_checkpoint(tmp_path / "without.ckpt")
    resumed, start = TinyGPTModule(**MODEL), StartParams()
    callback = ActivationCheckpointing(["Block"])
    trainer = make_trainer(tmp_path, max_steps=4, max_epochs=3, logger=False, callbacks=[callback, start])
    trainer.fit(resumed, loader(), ckpt_path=tmp_path / "without.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(start.params, plain.parameters(), strict=True))
    assert start.injected and callback.checkpointed_modules


class StartParams(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.params = [p.detach().clone() for p in pl_module.parameters()]
        self.injected = all(injected_mode(b) for b in pl_module.model.blocks)


class ManualGPT(TinyGPTModule):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(self.loss(batch))
        optimizer.step()


def test_manual_optimization_is_checkpointed_but_a_memory_budget_is_refused(tmp_path: Path) -> None:
    callback = ActivationCheckpointing(["Block"])
    fit(tmp_path, callback, module_cls=ManualGPT)
    assert callback.checkpointed_modules == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    assert callback.saved_bytes_before is None  # the measuring forward would step the optimizer: skipped
    with pytest.raises(ValueError, match="manual optimization"):
        fit(tmp_path, ActivationCheckpointing(["Block"], memory_budget=0.5), module_cls=ManualGPT)


class CompiledGPT(TinyGPTModule):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model = torch.compile(self.model, backend="aot_eager")


def test_compiled_submodules_are_selected_through_orig_mod_and_measured_in_eager_mode(tmp_path: Path) -> None:
    recorder = GradRecorder()
    callback = ActivationCheckpointing([r"re:model\.blocks\.\d+"])
    fit(tmp_path, callback, recorder, module_cls=CompiledGPT)
    assert callback.checkpointed_modules == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    assert all(recorder.injected)
    stripped = [{n.replace("_orig_mod.", ""): g for n, g in step.items()} for step in recorder.grads]
    assert_same_grads(stripped, reference_grads())
    assert callback.saved_bytes_after <= 0.4 * callback.saved_bytes_before


def test_lightning_cli_builds_the_callback_from_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.cli import LightningCLI

    from lightning_gradkit.demos import StdlibTextDataModule

    monkeypatch.setattr("sys.argv", ["cli"])
    config = tmp_path / "c.yaml"
    config.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning_gradkit.ActivationCheckpointing\n      init_args:\n"
        "        targets: [Block, 're:model\\.lm_head']\n        mode: selective\n        memory_budget: 2000000\n"
    )
    args = [f"--config={config}", "--trainer.accelerator=cpu", "--seed_everything=0"]
    result = LightningCLI(TinyGPTModule, StdlibTextDataModule, args=args, run=False)
    (callback,) = [c for c in result.trainer.callbacks if isinstance(c, ActivationCheckpointing)]
    assert callback.targets == ["Block", r"re:model\.lm_head"]
    assert (callback.mode, callback.memory_budget) == ("selective", 2_000_000)
