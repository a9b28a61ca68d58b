"""When a window opens and what it puts back, behind every door: the model state after a skipped step equals a run
that never saw the bad batch.

References: the same model trained by a hand-written loop (or plain Lightning) with the bad batch left out; each
case below is one the step-state review found broken (``.data`` writes, a ``no_grad`` pass or a method before the
forward, two optimizer steps in one ``training_step``, a checkpoint inside an accumulation window, a buffer the
replay replaces, constant buffers after a culprit replay).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from gradkit.doors.loop import GradKit
from gradkit.step.replay import replay
from helpers import make_trainer
from lightning_gradkit import AccumulationGuard, ActivationCheckpointing, NonFiniteGuard

STEPS = 6
NAN_STEP = 3

# Every test here provokes a non-finite step on purpose: the guard's warning is expected.
pytestmark = pytest.mark.filterwarnings("ignore:NonFiniteGuard:UserWarning")


class Net(nn.Module):
    """A BatchNorm, an EMA kept through ``.data`` (a VQ-VAE codebook's way), and a ``loss`` method that runs the
    layers without calling the model."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 1)
        self.register_buffer("ema", torch.zeros(4))

    def features(self, x: Tensor) -> Tensor:
        h = self.bn(self.lin(x))
        self.ema.data.mul_(0.9).add_(0.1 * h.detach().mean(0))
        return h

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.features(x)))

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        return nn.functional.mse_loss(self.head(torch.tanh(self.features(x))), y)


def batches() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(STEPS)]
    out[NAN_STEP][0][0, 0] = math.nan
    return out


def bits(state: dict[str, Tensor]) -> dict[str, bytes]:
    return {k: v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for k, v in state.items()}


def plain_loop(mode: str, door: bool) -> dict[str, Tensor]:
    """``mode``: "forward" (the model called), "method" (``model.loss``), "no_grad_first" (a pseudo-label pass under
    ``no_grad`` in train mode, then the forward). The reference (``door=False``) leaves the NaN batch out."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kit = GradKit(model, opt, NonFiniteGuard("skip", forensics=False), log_every_n_steps=0) if door else None
    for step, (x, y) in enumerate(batches()):
        opt.zero_grad(set_to_none=True)
        if not door and step == NAN_STEP:
            continue
        if mode == "no_grad_first":
            with torch.no_grad():
                model(x)  # pseudo-labels in train mode: writes the BatchNorm statistics and the EMA
        loss = model.loss(x, y) if mode == "method" else nn.functional.mse_loss(model(x), y)
        loss.backward()
        if kit is None:
            opt.step()
        else:
            kit.note_loss(loss)
            kit.step(opt)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("mode", ["forward", "method", "no_grad_first"])
def test_loop_door_skip_puts_back_every_buffer_whatever_ran_first(mode: str) -> None:
    """Items 1 and 2: the `.data` EMA, and buffers written before the window's first grad-enabled forward of the
    model (a `no_grad` pass, a method that bypasses `model(...)`), come back exactly."""
    assert bits(plain_loop(mode, door=True)) == bits(plain_loop(mode, door=False))


def test_loop_door_leaves_no_hook_behind() -> None:
    """The first window's hooks remove themselves at the first forward: nothing stays on the user's model."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    GradKit(model, opt, NonFiniteGuard("skip"), log_every_n_steps=0)
    assert any(m._forward_pre_hooks for m in model.modules())
    model(torch.randn(2, 4))
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_loop_door_window_after_load_state_dict_is_taken_after_the_model_is_loaded() -> None:
    """`kit.load_state_dict` before `model.load_state_dict`: the next window still starts from the loaded buffers."""
    torch.manual_seed(0)
    trained = Net()
    trained.bn.running_mean.fill_(3.0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kit = GradKit(model, opt, NonFiniteGuard("skip", forensics=False), log_every_n_steps=0)
    model(torch.randn(2, 4))  # a window opens with the untrained buffers
    kit.load_state_dict(kit.state_dict())
    model.load_state_dict(trained.state_dict())
    x = torch.full((8, 4), math.nan)
    loss = nn.functional.mse_loss(model(x), torch.zeros(8, 1))
    loss.backward()
    kit.note_loss(loss)
    assert kit.step(opt) is False
    assert bits({"bn": model.bn.running_mean}) == bits({"bn": trained.bn.running_mean})


# -- the Trainer -----------------------------------------------------------------------------------------------------
class GAN(pl.LightningModule):
    """Manual optimization, two optimizer steps in one `training_step`: a discriminator step, then a generator step;
    both networks hold a BatchNorm. `bad_g` makes the generator's loss NaN at that batch (the D step is fine)."""

    def __init__(self, bad_g: int | None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.g = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        self.d = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
        self.bad_g = bad_g

    def discriminator_step(self, real: Tensor, batch_idx: int) -> Tensor:
        """The discriminator's step; returns the generator's input noise."""
        _, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], 2, generator=torch.Generator().manual_seed(batch_idx))
        d_loss = self.d(real).mean() - self.d(self.g(z).detach()).mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        return z

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> None:
        z = self.discriminator_step(batch[0], batch_idx)
        opt_g, _ = self.optimizers()
        g_loss = -self.d(self.g(z * (math.nan if batch_idx == self.bad_g else 1.0))).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.g.parameters(), lr=0.05), torch.optim.SGD(self.d.parameters(), lr=0.05)]


class GANReference(GAN):
    """The same, with the generator's step of the bad batch left out: its forward does not run (the reference for
    a skipped generator step that put back what its forward wrote)."""

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> None:
        if batch_idx == self.bad_g:
            self.discriminator_step(batch[0], batch_idx)
        else:
            super().training_step(batch, batch_idx)


def quiet_fit(trainer: pl.Trainer, model: pl.LightningModule, data: Any, **kwargs: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data, **kwargs)


def test_second_optimizer_step_of_a_training_step_puts_back_its_own_window(tmp_path: Path) -> None:
    """Item 3: the generator's step (after the discriminator's, same `training_step`) is skipped: the generator's
    BatchNorm statistics its forward wrote come back, as if that forward never ran."""
    data = DataLoader(TensorDataset(torch.randn(48, 2)), batch_size=8)
    torch.manual_seed(0)
    ours = GAN(bad_g=2)
    guard = NonFiniteGuard("skip", forensics=False)
    quiet_fit(make_trainer(tmp_path / "g", strategy="gradkit", callbacks=[guard]), ours, data)
    torch.manual_seed(0)
    reference = GANReference(bad_g=2)
    quiet_fit(make_trainer(tmp_path / "p"), reference, data)
    assert bits(ours.state_dict()) == bits(reference.state_dict())


class BNModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_checkpoint_inside_an_accumulation_window_resumes_with_the_windows_buffers(tmp_path: Path) -> None:
    """Item 4: a checkpoint saved after the first micro-batch of a window; the resumed run's rest of that window is
    NaN (as is everything after it, so every later step is skipped too): the skip puts back the buffers from before
    the window's first micro-batch, which only the checkpoint can know (the resumed process never saw it)."""
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)), batch_size=8)
    nan = DataLoader(TensorDataset(torch.full((64, 4), math.nan), torch.zeros(64, 1)), batch_size=8)
    before_window: dict[str, Tensor] = {}

    class SaveInside(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
            if i == 2:  # the window of batches 2 and 3 opens
                before_window.update({k: v.clone() for k, v in pl_module.state_dict().items() if "running" in k})

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.fit_loop.epoch_loop.batch_idx == 2:  # inside the window, after its first micro-batch
                trainer.save_checkpoint(tmp_path / "inside.ckpt")

    def trainer(root: str, extra: list[Any]) -> pl.Trainer:
        callbacks = [NonFiniteGuard("skip", forensics=False), AccumulationGuard(), *extra]
        return make_trainer(tmp_path / root, strategy="gradkit", accumulate_grad_batches=2, callbacks=callbacks)

    torch.manual_seed(0)
    quiet_fit(trainer("a", [SaveInside()]), BNModule(), data)
    resumed = BNModule()
    quiet_fit(trainer("b", []), resumed, nan, ckpt_path=tmp_path / "inside.ckpt")
    after = {k: v for k, v in resumed.state_dict().items() if "running" in k}
    assert bits(after) == bits(before_window)


class Counting(nn.Module):
    """Replaces a buffer on every training forward (``self.seen = self.seen + 1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))
        self.lin = nn.Linear(2, 1)

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.seen = self.seen + 1
        return self.lin(x)


def test_a_replay_puts_back_a_buffer_it_replaced() -> None:
    """Item 5: the replay context restores by slot: the replaced buffer gets its old object and value back."""
    model = Counting()
    model(torch.ones(1, 2))
    before = model.seen
    with replay(model):
        model(torch.ones(1, 2))
        model(torch.ones(1, 2))
    assert model.seen is before and model.seen.item() == 1.0


def test_activation_checkpointing_measurement_leaves_a_replaced_buffer_alone(tmp_path: Path) -> None:
    """Item 5 behind the Trainer: the measuring forwards of `ActivationCheckpointing` leave the counter where plain
    Lightning leaves it (one per training batch)."""

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(Counting(), nn.Linear(1, 2), Counting())

        def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
            return self.blocks(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = DataLoader(TensorDataset(torch.randn(24, 2)), batch_size=4)
    torch.manual_seed(0)
    model = Module()
    callback = ActivationCheckpointing(targets=["Counting"])
    quiet_fit(make_trainer(tmp_path, max_steps=6, callbacks=[callback]), model, data)
    assert model.blocks[0].seen.item() == 6.0 and model.blocks[2].seen.item() == 6.0


def test_no_buffer_warning_after_a_culprit_replay_on_constant_buffers(tmp_path: Path) -> None:
    """Item 6: a model with constant buffers (position ids) and a NaN batch: the culprit replay runs, the constant
    buffers are untouched, and no warning about buffers is given."""

    class Positions(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("position_ids", torch.arange(4))
            self.emb = nn.Embedding(4, 3)
            self.head = nn.Linear(3, 1)

        def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
            (x,) = batch
            return (self.head(self.emb(self.position_ids)).sum() * x.mean()).pow(2)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    x = torch.randn(16, 2)
    x[4] = math.nan
    model = Positions()
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[NonFiniteGuard("skip")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(TensorDataset(x), batch_size=4))
    assert torch.equal(model.position_ids, torch.arange(4))
    messages = [str(w.message) for w in caught]
    assert any("NonFiniteGuard" in m for m in messages)  # the replay ran and reported
    assert not any("wrote module buffers" in m for m in messages), [m for m in messages if "buffer" in m]
