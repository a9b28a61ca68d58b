"""A skipped or replayed step leaves no trace: module buffers put back on a skip, replays unseen by statistics.

References: plain Lightning (no gradkit) on the same data with the bad batches removed, and plain PyTorch loops.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from architectures import ArchModule, ResNet18Like, TiedTransformerLM, TinyViT, image_data, token_data
from gradkit.step.replay import replay, replaying
from gradkit.step.snapshot import Snapshot
from helpers import make_trainer
from lightning_gradkit import AccumulationGuard, ActivationCheckpointing, NonFiniteGuard
from test_accumulation import TokenLM, max_diff, token_loader

BATCH = 8


def quiet_fit(trainer: Any, model: Any, data: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data)


def poisoned_images(n_batches: int, bad: list[int]) -> TensorDataset:
    """Random images; every image of the batches in ``bad`` is NaN."""
    x, y = image_data(n=n_batches * BATCH, image=8).tensors
    x = x.clone()
    for b in bad:
        x[b * BATCH : (b + 1) * BATCH] = float("nan")
    return TensorDataset(x, y)


def without(data: TensorDataset, batches: list[int]) -> DataLoader:
    keep = [i for i in range(len(data)) if i // BATCH not in batches]
    return DataLoader(Subset(data, keep), batch_size=BATCH)


def resnet_state(tmp_path: Path, data: DataLoader, optimizer: str = "sgd", **kwargs: Any) -> dict[str, Tensor]:
    torch.manual_seed(0)
    model = ArchModule(ResNet18Like(width=4), lr=0.01, optimizer=optimizer)
    quiet_fit(make_trainer(tmp_path, **kwargs), model, data)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_states_equal(got: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def bn_buffers(state: dict[str, Tensor]) -> list[str]:
    return [k for k in state if k.endswith(("running_mean", "running_var", "num_batches_tracked"))]


# -- item 1: a skip leaves module buffers as they were -------------------------------------------------------------


@pytest.mark.parametrize(
    ("optimizer", "window", "bad", "dropped", "precision"),
    [
        ("sgd", 1, [2], [2], "32-true"),
        ("adam_fused", 1, [2], [2], "32-true"),  # the skip is known on device only: torch.where, no host read
        ("sgd", 2, [3], [2, 3], "32-true"),  # NaN in the 2nd micro-batch: the 1st micro-batch wrote buffers too
        ("sgd", 1, [2], [2], "bf16-mixed"),
    ],
    ids=["sgd", "fused_adam", "accumulation", "bf16"],
)
def test_skipped_step_leaves_batchnorm_buffers_as_without_the_bad_batch(
    tmp_path: Path, optimizer: str, window: int, bad: list[int], dropped: list[int], precision: str
) -> None:
    """ResNet-18 shape (in-place ReLU, zero-init last BN): parameters AND every BN buffer equal a plain Lightning
    run that never saw the skipped window's batches."""
    data = poisoned_images(8, bad)
    got = resnet_state(
        tmp_path / "gradkit",
        DataLoader(data, batch_size=BATCH),
        optimizer,
        strategy="gradkit",
        accumulate_grad_batches=window,
        precision=precision,
        callbacks=[NonFiniteGuard(action="skip", forensics=False)],
    )
    expected = resnet_state(
        tmp_path / "plain", without(data, dropped), optimizer, accumulate_grad_batches=window, precision=precision
    )
    assert len(bn_buffers(expected)) == 3 * 20  # every BatchNorm of the network, downsample branches included
    assert_states_equal(got, expected)


@pytest.mark.parametrize("arch", ["vit", "tied_lm"])
def test_skip_on_transformers_equals_plain_lightning_without_the_bad_batch(tmp_path: Path, arch: str) -> None:
    """A ViT with a root `cls_token` and a pre-LN LM whose head is tied to its embedding (one parameter, two uses):
    a NaN batch skipped with its culprit replay leaves the run equal to plain Lightning without that batch."""
    if arch == "vit":
        data = poisoned_images(6, [3])
        make: Any = lambda: TinyViT()  # noqa: E731
    else:
        x, y = token_data(n=6 * BATCH).tensors
        data = TensorDataset(x, y)
        make = lambda: TiedTransformerLM()  # noqa: E731

    class Poisoned(ArchModule):
        poison = False  # the LM's batch 3 gives a NaN loss in the gradkit run (token ids cannot hold a NaN)

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            loss = super().training_step(batch, batch_idx)
            return loss * float("nan") if self.poison and batch_idx == 3 else loss

    states = []
    for name, loader_, kwargs in (
        ("gradkit", DataLoader(data, batch_size=BATCH), {"strategy": "gradkit", "callbacks": [NonFiniteGuard()]}),
        ("plain", without(data, [3]), {}),
    ):
        torch.manual_seed(0)
        module = Poisoned(make(), lr=0.05, optimizer="adam")
        module.poison = arch == "tied_lm" and name == "gradkit"
        quiet_fit(make_trainer(tmp_path / name, **kwargs), module, loader_)
        states.append(module.state_dict())
    assert_states_equal(*states)


def test_skipped_step_in_manual_optimization_puts_buffers_back(tmp_path: Path) -> None:
    class Manual(ArchModule):
        def __init__(self) -> None:
            super().__init__(ResNet18Like(width=4), lr=0.01)
            self.automatic_optimization = False

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            opt = self.optimizers()
            opt.zero_grad()
            loss = self._loss(batch)
            self.manual_backward(loss)
            opt.step()
            return loss

    data = poisoned_images(6, [1])
    torch.manual_seed(0)
    model = Manual()
    guard = NonFiniteGuard(action="skip", forensics=False)
    quiet_fit(make_trainer(tmp_path / "g", strategy="gradkit", callbacks=[guard]), model, DataLoader(data, BATCH))
    torch.manual_seed(0)
    reference = Manual()
    quiet_fit(make_trainer(tmp_path / "p"), reference, without(data, [1]))
    assert_states_equal(model.state_dict(), reference.state_dict())


def test_ema_of_buffers_stays_finite_after_a_skipped_nan_batch(tmp_path: Path) -> None:
    """`EMAWeightAveraging(use_buffers=True)` averages the buffers after each step: a skip must not feed it NaN."""
    from lightning.pytorch import callbacks

    if not hasattr(callbacks, "EMAWeightAveraging"):
        pytest.skip("EMAWeightAveraging arrived in Lightning 2.6")
    ema = callbacks.EMAWeightAveraging(use_buffers=True)
    torch.manual_seed(0)
    model = ArchModule(ResNet18Like(width=4), lr=0.01)
    trainer = make_trainer(
        tmp_path, strategy="gradkit", callbacks=[NonFiniteGuard(action="skip", forensics=False), ema]
    )
    quiet_fit(trainer, model, DataLoader(poisoned_images(6, [2]), batch_size=BATCH))
    averaged = ema._average_model.module.state_dict()
    assert bn_buffers(averaged)
    assert all(torch.isfinite(averaged[k].float()).all() for k in bn_buffers(averaged))


class DataEma(nn.Module):
    """Keeps an EMA of its inputs in a buffer written through ``.data`` (vector-quantize-pytorch's codebook EMA):
    such writes do not bump the buffer's version counter."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(3))

    def forward(self, x: Tensor) -> Tensor:
        self.ema.data.mul_(0.9).add_(0.1 * x.mean(0))
        return x


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
def test_window_snapshot_puts_back_a_buffer_written_through_data(on_device: bool) -> None:
    model = DataEma()
    snapshot = Snapshot(model)
    snapshot.capture()
    model(torch.ones(4, 3))
    snapshot.close(skipped=False)  # applied: kept
    kept = model.ema.clone()
    snapshot.capture()
    version = model.ema._version
    model(torch.full((4, 3), float("nan")))
    assert model.ema._version == version and model.ema.isnan().all()  # the write is invisible to the counter
    snapshot.close(None, torch.tensor(True)) if on_device else snapshot.close(skipped=True)
    assert torch.equal(model.ema, kept)


class Ema(nn.Module):
    """Keeps an EMA of its inputs in a buffer it REPLACES (not an in-place write), and a counter it starts
    writing in place later."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(3))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.count = False

    def forward(self, x: Tensor) -> Tensor:
        self.ema = 0.9 * self.ema + 0.1 * x.mean(0)
        if self.count:
            self.calls.add_(1)
        return x


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
def test_window_snapshot_restores_replaced_buffers_and_buffers_first_written_late(on_device: bool) -> None:
    """Every slot comes back: a replaced buffer as the object it was, a buffer written for the first time in the
    skipped window (nothing was learned about it before) with its values from before the window."""
    model = Ema()
    model.sub = Ema()
    snapshot = Snapshot(model)
    snapshot.capture()
    model(torch.ones(4, 3))  # the root writes `ema`; `sub` never runs
    snapshot.close(skipped=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ema_object = model.ema
    snapshot.capture()
    model.sub.count = True
    model(model.sub(torch.full((4, 3), float("nan"))))  # `sub` starts writing
    assert model.ema is not ema_object
    snapshot.close(None, torch.tensor(True)) if on_device else snapshot.close(skipped=True)
    assert model.ema is ema_object
    assert_states_equal(model.state_dict(), before)


@pytest.mark.parametrize("skip", [True, False])
def test_window_snapshot_device_flag_restores_only_when_true(skip: bool) -> None:
    bn = nn.BatchNorm1d(2)
    snapshot = Snapshot(bn)
    snapshot.capture()
    bn(torch.randn(4, 2))
    snapshot.close(skipped=False)
    snapshot.capture()
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    bn(torch.randn(4, 2))
    bn.running_var[0] = float("inf")  # any bits come back exactly, Inf and NaN included
    bn.running_mean[1] = float("nan")
    after = {k: v.clone() for k, v in bn.state_dict().items()}
    snapshot.restore(skip=torch.tensor(skip))
    expected = before if skip else after
    for key, value in bn.state_dict().items():  # bit for bit (NaN is not equal to itself)
        assert torch.equal(value.reshape(-1).view(torch.uint8), expected[key].reshape(-1).view(torch.uint8)), key


# -- item 3: replays are invisible to every stateful piece ---------------------------------------------------------


def reference_token_windows(windows: list[list[int]], n: int = 36, batch: int = 4) -> dict[str, Tensor]:
    """Plain PyTorch: each listed window (micro-batch indices) is one batch, its token-loss sum over its tokens."""
    torch.manual_seed(0)
    model = TokenLM()
    opt = torch.optim.SGD(model.parameters(), lr=model.lr)
    batches = list(token_loader(n, batch))
    for window in windows:
        big = [torch.cat(parts) for parts in zip(*(batches[i] for i in window), strict=True)]
        opt.zero_grad()
        loss_sum, tokens = model.token_losses(big)
        (loss_sum / tokens).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_activation_checkpointing_measurement_leaves_the_token_count_alone(tmp_path: Path) -> None:
    """`measure=True` runs `training_step` twice more on the first batch; the first step's token count must not
    include those forwards (it was 3x too large: the gradient came out scaled by 1/3)."""
    torch.manual_seed(0)
    model = TokenLM()
    callbacks = [ActivationCheckpointing(targets=["Linear"]), AccumulationGuard(normalize="tokens")]
    quiet_fit(make_trainer(tmp_path, callbacks=callbacks, accumulate_grad_batches=3), model, token_loader(36, 4))
    expected = reference_token_windows([[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    assert max_diff(model.state_dict(), expected) < 1e-6


class PoisonedTokenLM(TokenLM):
    def __init__(self, bad: int) -> None:
        super().__init__()
        self.bad = bad

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        out = super().training_step(batch, batch_idx)
        if batch_idx == self.bad:
            out["loss"] = out["loss"] * float("nan")
        return out


def test_culprit_replay_leaves_the_next_windows_token_count_alone(tmp_path: Path) -> None:
    """NaN loss in micro-batch 4 (window [3, 4, 5]): the forensic replay re-runs the window's training steps; the
    next window must be normalized by its own tokens only."""
    torch.manual_seed(0)
    model = PoisonedTokenLM(bad=4)
    callbacks = [NonFiniteGuard(action="skip"), AccumulationGuard(normalize="tokens")]
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=callbacks, accumulate_grad_batches=3)
    quiet_fit(trainer, model, token_loader(36, 4))
    assert trainer.callbacks[0]._forensics_done  # the replay did run
    expected = reference_token_windows([[0, 1, 2], [6, 7, 8]])
    assert max_diff(model.state_dict(), expected) < 1e-6


class LBFGSTokenLM(TokenLM):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=3)


class LBFGSMeanPerToken(LBFGSTokenLM):
    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        loss_sum, n = self.token_losses(batch)
        return loss_sum / n


def test_later_closure_evaluations_do_not_count_tokens_for_the_next_step(tmp_path: Path) -> None:
    """LBFGS evaluates the closure several times per step; the token count is the step's first evaluation's. The
    reference is plain Lightning with the per-token mean loss (the same gradient at every evaluation)."""
    torch.manual_seed(0)
    model = LBFGSTokenLM()
    trainer = make_trainer(tmp_path / "g", strategy="gradkit", callbacks=[AccumulationGuard(normalize="tokens")])
    quiet_fit(trainer, model, token_loader(16, 4))
    torch.manual_seed(0)
    reference = LBFGSMeanPerToken()
    quiet_fit(make_trainer(tmp_path / "p"), reference, token_loader(16, 4))
    assert max_diff(model.state_dict(), reference.state_dict()) < 1e-5


def test_replay_context_restores_buffers_rng_logging_and_statistics() -> None:
    bn = nn.BatchNorm1d(2)
    logged: list[str] = []
    bn.log = lambda name, value: logged.append(name)  # type: ignore[attr-defined]
    bn.log_dict = lambda values: logged.append("dict")  # type: ignore[attr-defined]
    before_rng = torch.get_rng_state()
    with replay(bn):
        assert replaying()
        bn(torch.randn(4, 2))
        bn.log("x", 1.0)  # type: ignore[attr-defined]
    assert not replaying()
    assert torch.equal(torch.get_rng_state(), before_rng)
    assert torch.equal(bn.running_mean, torch.zeros(2)) and int(bn.num_batches_tracked) == 0
    bn.log("y", 1.0)  # type: ignore[attr-defined]
    assert logged == ["y"]


@pytest.mark.distributed
def test_skip_on_one_rank_leaves_ddp_buffers_as_without_the_bad_batch(tmp_path: Path) -> None:
    """Rank 0 (whose buffers DDP broadcasts) gets a NaN batch: after the skip every rank's parameters and BN buffers
    equal plain Lightning DDP that never saw that batch."""
    from helpers import run_distributed

    ranks = run_distributed("buffers_script.py", tmp_path, timeout=300)
    for rank in ranks:
        assert bn_buffers(rank["plain"])
        for key, expected in rank["plain"].items():
            assert torch.equal(torch.tensor(rank["gradkit"][key]), torch.tensor(expected)), key
