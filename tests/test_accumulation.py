"""AccumulationGuard and ManualAccumulator with Lightning's real Trainer, against plain PyTorch reference loops."""

from __future__ import annotations

import copy
import math
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, Subset, TensorDataset

from clip_reference import AGCRef
from gradkit.policies import clipping
from gradkit.step.accumulate import (
    is_window_boundary,
    mean_window_scale,
    micro_batches_in_window,
    token_window_scale,
)
from helpers import MLPModule, column, count_syncs, loader, make_trainer, read_metrics, regression_data
from lightning_gradkit import (
    AccumulationGuard,
    AdaptiveGradClip,
    ClipGradNorm,
    GradNormMonitor,
    ManualAccumulator,
    NonFiniteGuard,
    SpikeGuard,
    clip_gradients,
)

VOCAB, SEQ_LEN = 11, 7

# -- models and data shared with the distributed script ------------------------------------------------------------


class TokenLM(pl.LightningModule):
    """A tiny per-token classifier: returns the SUM of the masked token losses and the token count."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)
        self.lr = lr

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.embed(x)))

    def token_losses(self, batch: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, y, mask = batch
        logits = self(x)
        losses = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="none")
        return (losses.reshape(y.shape) * mask).sum(), mask.sum()

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        loss_sum, n = self.token_losses(batch)
        return {"loss": loss_sum, "num_tokens": n}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def token_data(n: int, seed: int = 0) -> TensorDataset:
    """Sequences of very different lengths (1..SEQ_LEN tokens, padding masked out)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(VOCAB, (n, SEQ_LEN), generator=g)
    y = torch.randint(VOCAB, (n, SEQ_LEN), generator=g)
    lengths = torch.randint(1, SEQ_LEN + 1, (n,), generator=g)
    mask = (torch.arange(SEQ_LEN)[None, :] < lengths[:, None]).float()
    return TensorDataset(x, y, mask)


def token_loader(n: int, batch_size: int, rank: int = 0, world_size: int = 1) -> DataLoader:
    """Rank ``r`` gets samples ``r, r + world, ...``: micro-batch k of all ranks together is batch k of
    ``token_loader(n, batch_size * world_size)``."""
    data = token_data(n)
    return DataLoader(Subset(data, range(rank, n, world_size)), batch_size=batch_size)


def reference_token_lm(n: int, global_batch: int, window: int) -> dict[str, Tensor]:
    """Plain PyTorch: each window is ONE big batch, its summed token loss divided by its token count."""
    torch.manual_seed(0)
    model = TokenLM()
    opt = torch.optim.SGD(model.parameters(), lr=model.lr)
    batches = list(token_loader(n, global_batch))
    for start in range(0, len(batches), window):
        big = [torch.cat(parts) for parts in zip(*batches[start : start + window], strict=True)]
        opt.zero_grad()
        loss_sum, tokens = model.token_losses(big)
        (loss_sum / tokens).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_mlp(n_batches: int, window: int, divide_by_actual: bool) -> dict[str, Tensor]:
    """Plain PyTorch: each window's micro-batch losses divided by the window's actual size (or always by N)."""
    torch.manual_seed(0)
    model = MLPModule()
    opt = torch.optim.SGD(model.parameters(), lr=model.lr)
    batches = list(loader(n=8 * n_batches, batch_size=8))
    for start in range(0, len(batches), window):
        part = batches[start : start + window]
        divisor = len(part) if divide_by_actual else window
        opt.zero_grad()
        for x, y in part:
            (nn.functional.mse_loss(model(x), y) / divisor).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def fitted_state(tmp_path: Path, model: pl.LightningModule, data: DataLoader, **kwargs: Any) -> dict[str, Tensor]:
    trainer = make_trainer(tmp_path, **kwargs)
    trainer.fit(model, data)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- pure math ------------------------------------------------------------------------------------------------------


def test_window_arithmetic_matches_lightning_windows() -> None:
    # 10 batches, N = 4: Lightning zeroes at 0, 4, 8 and steps after 3, 7, 9.
    assert [i for i in range(10) if is_window_boundary(i, 4, 10)] == [3, 7, 9]
    assert [micro_batches_in_window(i, 4) for i in (3, 7, 9)] == [4, 4, 2]
    assert mean_window_scale(4, 2) == 2.0
    assert mean_window_scale(1, 4) == 0.25
    # W * N / T, and a window with no tokens keeps a finite factor (its gradient is zero anyway).
    assert token_window_scale(torch.tensor(40.0), 2, 4).item() == pytest.approx(0.2)
    assert torch.isfinite(token_window_scale(torch.tensor(0.0), 2, 4))


# -- mean mode ------------------------------------------------------------------------------------------------------


def test_short_last_window_is_averaged_over_its_micro_batches(tmp_path: Path) -> None:
    """10 batches of 8 with N = 4: windows 4, 4, 2. Lightning alone divides the last one by 4."""
    exact = reference_mlp(10, 4, divide_by_actual=True)
    lightning_rule = reference_mlp(10, 4, divide_by_actual=False)

    torch.manual_seed(0)
    guarded = fitted_state(
        tmp_path, MLPModule(), loader(n=80), accumulate_grad_batches=4, callbacks=[AccumulationGuard()]
    )
    torch.manual_seed(0)
    plain = fitted_state(tmp_path, MLPModule(), loader(n=80), accumulate_grad_batches=4)

    assert max_diff(guarded, exact) < 1e-6
    # Lightning alone follows the divide-by-N rule and so differs from the exact reference.
    assert max_diff(plain, lightning_rule) < 1e-6
    assert max_diff(plain, exact) > 1e-3


def test_fewer_batches_than_window_warns_and_averages(tmp_path: Path) -> None:
    exact = reference_mlp(3, 4, divide_by_actual=True)  # one window of 3 per epoch
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"3 training batch\(es\), fewer than `accumulate_grad_batches=4`"):
        guarded = fitted_state(
            tmp_path, MLPModule(), loader(n=24), accumulate_grad_batches=4, callbacks=[AccumulationGuard()]
        )
    assert max_diff(guarded, exact) < 1e-6


def test_logged_norm_is_the_norm_of_the_normalized_gradient(tmp_path: Path) -> None:
    """The monitor reads the engine's scaled statistics: the short window's norm is that of the window mean."""
    torch.manual_seed(0)
    model = MLPModule()
    batches = list(loader(n=80))
    expected = []
    ref = MLPModule()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=ref.lr)
    for start in range(0, 10, 4):
        part = batches[start : start + 4]
        opt.zero_grad()
        for x, y in part:
            (nn.functional.mse_loss(ref(x), y) / len(part)).backward()
        expected.append(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item())
        opt.step()
    trainer = make_trainer(tmp_path, accumulate_grad_batches=4, callbacks=[GradNormMonitor(), AccumulationGuard()])
    trainer.fit(model, loader(n=80))
    assert column(read_metrics(trainer), "grad_norm/total") == pytest.approx(expected, rel=1e-5)


def test_mean_mode_makes_no_host_sync(tmp_path: Path) -> None:
    guard = AccumulationGuard(zero_early=True, check_clean=True)
    hooks = ("on_before_optimizer_step", "on_before_backward", "on_train_batch_start", "on_train_batch_end")
    with count_syncs() as counter:
        for hook in hooks:
            counter.watch(guard, hook)
        trainer = make_trainer(tmp_path, accumulate_grad_batches=4, callbacks=[guard], log_every_n_steps=1)
        trainer.fit(MLPModule(), loader(n=80))
        assert trainer.global_step == 3
        assert counter.total == 0, counter.counts

        # The counter is live: gradients kept as zeros (not None) need a device check, read on logging steps.
        class ZeroNotNone(MLPModule):
            def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
                optimizer.zero_grad(set_to_none=False)

        guard.zero_early = False
        trainer = make_trainer(tmp_path, accumulate_grad_batches=4, callbacks=[guard], log_every_n_steps=1)
        trainer.fit(ZeroNotNone(), loader(n=80))
        assert counter.total > 0


# -- token mode -----------------------------------------------------------------------------------------------------


def test_token_mode_equals_one_big_batch_normalized_by_token_count(tmp_path: Path) -> None:
    """5 micro-batches of 4 sequences with N = 2 (windows 2, 2, 1), lengths 1..7 tokens."""
    expected = reference_token_lm(n=20, global_batch=4, window=2)
    torch.manual_seed(0)
    guard = AccumulationGuard(normalize="tokens")
    with count_syncs() as counter:
        counter.watch(guard, "on_before_optimizer_step")
        got = fitted_state(tmp_path, TokenLM(), token_loader(20, 4), accumulate_grad_batches=2, callbacks=[guard])
    assert counter.total == 0, counter.counts
    assert max_diff(got, expected) < 1e-6
    # Per-micro-batch mean losses (Lightning's usual recipe) give a different, token-weighted-wrong answer.
    torch.manual_seed(0)

    class MeanPerBatch(TokenLM):
        def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
            loss_sum, n = self.token_losses(batch)
            return loss_sum / n

    plain = fitted_state(tmp_path, MeanPerBatch(), token_loader(20, 4), accumulate_grad_batches=2)
    assert max_diff(plain, expected) > 1e-3


def test_token_mode_with_agc_scales_and_clips_unit_wise_in_one_multiply(tmp_path: Path) -> None:
    """The engine folds the token normalisation into AGC's per-unit coefficients (one multiply per gradient): the
    result equals normalising first, then timm's AGC, in a plain loop."""
    clip = AGCRef(clip_factor=0.02)
    torch.manual_seed(0)
    model = TokenLM()
    opt = torch.optim.SGD(model.parameters(), lr=model.lr)
    batches = list(token_loader(20, 4))
    clipped_any = False
    for start in range(0, len(batches), 2):
        big = [torch.cat(parts) for parts in zip(*batches[start : start + 2], strict=True)]
        opt.zero_grad()
        loss_sum, tokens = model.token_losses(big)
        (loss_sum / tokens).backward()
        before = [p.grad.clone() for p in model.parameters()]
        clip(model)
        clipped_any |= any(not torch.equal(b, p.grad) for b, p in zip(before, model.parameters(), strict=True))
        opt.step()
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert clipped_any  # the clip factor is small enough to bite

    torch.manual_seed(0)
    callbacks = [AccumulationGuard(normalize="tokens"), AdaptiveGradClip(clip_factor=0.02)]
    got = fitted_state(tmp_path, TokenLM(), token_loader(20, 4), accumulate_grad_batches=2, callbacks=callbacks)
    assert max_diff(got, expected) < 1e-6


def test_token_mode_without_token_count_names_the_key(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[AccumulationGuard(normalize="tokens")])
    with pytest.raises(ValueError, match=r"without the key 'num_tokens'.*return \{'loss': loss_sum, 'num_tokens': n\}"):
        trainer.fit(MLPModule(), loader())


def test_token_mode_restores_training_step_after_fit(tmp_path: Path) -> None:
    model = TokenLM()
    make_trainer(tmp_path, callbacks=[AccumulationGuard(normalize="tokens")]).fit(model, token_loader(8, 4))
    assert "training_step" not in model.__dict__
    # also after a failing fit
    model = MLPModule()
    with pytest.raises(ValueError):
        make_trainer(tmp_path, callbacks=[AccumulationGuard(normalize="tokens")]).fit(model, loader())
    assert "training_step" not in model.__dict__


def test_custom_tokens_key(tmp_path: Path) -> None:
    class Renamed(TokenLM):
        def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
            loss_sum, n = self.token_losses(batch)
            return {"loss": loss_sum, "ntok": n}

    expected = reference_token_lm(n=12, global_batch=4, window=3)
    torch.manual_seed(0)
    guard = AccumulationGuard(normalize="tokens", tokens_key="ntok")
    got = fitted_state(tmp_path, Renamed(), token_loader(12, 4), accumulate_grad_batches=3, callbacks=[guard])
    assert max_diff(got, expected) < 1e-6


# -- zero_early -----------------------------------------------------------------------------------------------------


class GradPresence(pl.Callback):
    """Records whether gradients exist when each batch starts (i.e. during its forward)."""

    def __init__(self) -> None:
        self.present: list[bool] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self.present.append(any(p.grad is not None for p in pl_module.parameters()))


@pytest.mark.parametrize("zero_early", [True, False])
def test_zero_early_frees_gradients_before_the_next_forward(tmp_path: Path, zero_early: bool) -> None:
    presence = GradPresence()
    trainer = make_trainer(
        tmp_path, accumulate_grad_batches=2, callbacks=[AccumulationGuard(zero_early=zero_early), presence]
    )
    trainer.fit(MLPModule(), loader(n=48))  # 6 batches: windows start at 0, 2, 4
    # Inside a window the gradients must survive; at a window start they are gone only with zero_early.
    assert presence.present == [False, True, not zero_early, True, not zero_early, True]


class KeepsGradBuffers(MLPModule):
    """Zeroes in place, so the gradient buffers keep their addresses across windows (as CUDA graphs need)."""

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=False)


class GradAddresses(pl.Callback):
    """Records, when each batch starts, the address of every parameter's gradient (None where there is none)."""

    def __init__(self) -> None:
        self.addresses: list[list[int | None]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self.addresses.append([None if p.grad is None else p.grad.data_ptr() for p in pl_module.parameters()])


def test_zero_early_leaves_the_zeroing_to_an_optimizer_zero_grad_override(tmp_path: Path) -> None:
    """The override keeps its gradient buffers: with the guard they live exactly as in Lightning alone (the
    reference), and the guard says why it did not free them."""
    fits = {}
    for callbacks in ([], [AccumulationGuard(zero_early=True)]):
        torch.manual_seed(0)
        model, addresses = KeepsGradBuffers(), GradAddresses()
        trainer = make_trainer(tmp_path, accumulate_grad_batches=2, callbacks=[*callbacks, addresses])
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer.fit(model, loader(n=48))  # 6 batches: windows start at 0, 2, 4
        told = [str(w.message) for w in record if "AccumulationGuard" in str(w.message)]
        fits[bool(callbacks)] = (addresses.addresses, told, model.state_dict())
    reference, guarded = fits[False], fits[True]
    for addresses, _, _ in (reference, guarded):
        # No gradient before the first backward; then the same buffers at every batch start, windows included.
        assert addresses[0] == [None] * 6 and None not in addresses[1]
        assert all(row == addresses[1] for row in addresses[1:])
    assert reference[1] == [] and len(guarded[1]) == 1
    assert "`KeepsGradBuffers` overrides `optimizer_zero_grad`" in guarded[1][0]
    assert "zero_grad(set_to_none=True)" in guarded[1][0] and "zero_early=False" in guarded[1][0]
    for name, value in reference[2].items():
        assert torch.equal(guarded[2][name], value), name

    # zero_early=False: the same run, without the warning; a module without override: zero_early frees, silently.
    cases = ((KeepsGradBuffers(), AccumulationGuard(zero_early=False), False), (MLPModule(), AccumulationGuard(), True))
    for model, guard, freed in cases:
        addresses = GradAddresses()
        trainer = make_trainer(tmp_path, accumulate_grad_batches=2, callbacks=[guard, addresses])
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer.fit(model, loader(n=48))
        assert not [w for w in record if "AccumulationGuard" in str(w.message)]
        assert (addresses.addresses[2][0] is None) is freed  # at the start of the second window


@pytest.mark.gpu
def test_zero_early_lowers_forward_peak_memory_by_the_gradient_size(tmp_path: Path) -> None:
    class Wide(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(4)])
            self.peaks: list[int] = []

        def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
            torch.cuda.reset_peak_memory_stats()
            loss = self.layers(batch[0]).square().mean()
            self.peaks.append(torch.cuda.max_memory_allocated())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    data = DataLoader(TensorDataset(torch.randn(32, 2048)), batch_size=4)
    peaks = {}
    for zero_early in (True, False):
        model = Wide()
        trainer = make_trainer(
            tmp_path, accelerator="gpu", callbacks=[AccumulationGuard(zero_early=zero_early)], logger=False
        )
        trainer.fit(model, data)
        peaks[zero_early] = max(model.peaks[2:])  # steady state
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    saved = peaks[False] - peaks[True]
    assert saved == pytest.approx(grad_bytes, rel=0.1)


# -- check_clean ----------------------------------------------------------------------------------------------------


class ForgetfulManual(MLPModule):
    """Manual optimization that steps every batch and never calls ``zero_grad`` (unless told to)."""

    def __init__(self, zero: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.zero = zero

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        opt = self.optimizers()
        if self.zero:
            opt.zero_grad()
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.manual_backward(loss)
        opt.step()
        return loss


def test_check_clean_catches_manual_loop_that_forgets_zero_grad(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[AccumulationGuard(zero_early=False, on_dirty="raise")])
    with pytest.raises(RuntimeError, match=r"window that starts at optimizer step 1 .*encoder\.0\.weight") as info:
        trainer.fit(ForgetfulManual(), loader(n=64))
    assert "head.bias" in str(info.value)
    assert trainer.global_step == 2  # caught in the second window, at its first logging step

    # Control: the same loop with zero_grad is clean.
    trainer = make_trainer(tmp_path, callbacks=[AccumulationGuard(zero_early=False, on_dirty="raise")])
    trainer.fit(ForgetfulManual(zero=True), loader(n=64))
    assert trainer.global_step == 8


def test_check_clean_warns_for_an_optimizer_zero_grad_that_skips_parameters(tmp_path: Path) -> None:
    class HeadOnlyZero(MLPModule):
        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
            for p in self.head.parameters():
                p.grad = None

    guard = AccumulationGuard(zero_early=False, on_dirty="warn")
    trainer = make_trainer(tmp_path, accumulate_grad_batches=2, callbacks=[guard], log_every_n_steps=50)
    with pytest.warns(UserWarning, match=r"in 4 parameter\(s\): encoder\.0\.weight, encoder\.0\.bias") as record:
        trainer.fit(HeadOnlyZero(), loader(n=64))
    message = str(next(w.message for w in record if "AccumulationGuard" in str(w.message)))
    assert "head" not in message
    # zero_early leaves the zeroing to the override, so it neither hides the leftovers nor changes the run.
    trainer = make_trainer(tmp_path, accumulate_grad_batches=2, callbacks=[AccumulationGuard(on_dirty="raise")])
    leftovers = r"in 4 parameter\(s\): encoder\.0\.weight, encoder\.0\.bias"
    with pytest.warns(UserWarning, match=r"`HeadOnlyZero` overrides"), pytest.raises(RuntimeError, match=leftovers):
        trainer.fit(HeadOnlyZero(), loader(n=64))


def test_accumulation_guard_under_manual_optimization_checks_windows_only(tmp_path: Path) -> None:
    """Manual optimization: check_clean is the guard's only job. zero_early=True cannot act and says so, pointing to
    ManualAccumulator; a guard without check_clean would do nothing and is refused before training."""
    model = ForgetfulManual(zero=True)
    trainer = make_trainer(tmp_path, callbacks=[AccumulationGuard(check_clean=False, zero_early=False)])
    with pytest.raises(RuntimeError, match=r"check_clean=False\) does nothing under manual .*ManualAccumulator"):
        trainer.fit(model, loader(n=64))
    assert trainer.global_step == 0

    trainer = make_trainer(tmp_path, callbacks=[AccumulationGuard()])
    with pytest.warns(UserWarning, match=r"zero_early=True\) has no effect under manual .*ManualAccumulator") as record:
        trainer.fit(ForgetfulManual(zero=True), loader(n=64))
    assert trainer.global_step == 8
    assert "`ForgetfulManual` sets `automatic_optimization = False`" in str(record[0].message)

    # zero_early=False keeps the check, silently: it still catches the missing zero_grad. A module that holds a
    # ManualAccumulator (which frees the gradients itself) is not told to use one.
    trainer = make_trainer(tmp_path, callbacks=[AccumulationGuard(zero_early=False, on_dirty="raise")])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match=r"window that starts at optimizer step 1"):
            trainer.fit(ForgetfulManual(), loader(n=64))
        make_trainer(tmp_path, callbacks=[AccumulationGuard(on_dirty="raise")]).fit(ManualMLP(2), loader(n=64))
    assert not [w for w in record if "zero_early" in str(w.message)]


# -- manual optimization helper -------------------------------------------------------------------------------------


class ManualMLP(MLPModule):
    def __init__(self, window: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.accumulator = ManualAccumulator(window)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self.accumulator.backward(self, loss, batch_idx):
            self.accumulator.step(self.optimizers())


class ManualTokenLM(TokenLM):
    def __init__(self, window: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.accumulator = ManualAccumulator(window, normalize="tokens")

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        loss_sum, n = self.token_losses(batch)
        if self.accumulator.backward(self, loss_sum, batch_idx, num_tokens=n):
            self.accumulator.step(self.optimizers())


def test_manual_accumulator_scales_windows_in_a_second_fit(tmp_path: Path) -> None:
    """A second ``fit`` builds new optimizers: the accumulator must scale its windows for them, as a new one does."""
    model = ManualMLP(4)
    make_trainer(tmp_path, callbacks=[AccumulationGuard()]).fit(model, loader(n=80))
    reference = copy.deepcopy(model)
    reference.accumulator = ManualAccumulator(4)
    got = fitted_state(tmp_path, model, loader(n=80), callbacks=[AccumulationGuard()])
    expected = fitted_state(tmp_path, reference, loader(n=80), callbacks=[AccumulationGuard()])
    assert max_diff(got, expected) == 0.0


def test_manual_accumulator_mean_matches_reference(tmp_path: Path) -> None:
    expected = reference_mlp(10, 4, divide_by_actual=True)
    torch.manual_seed(0)
    got = fitted_state(tmp_path, ManualMLP(4), loader(n=80), callbacks=[AccumulationGuard(on_dirty="raise")])
    assert max_diff(got, expected) < 1e-6


def test_manual_accumulator_tokens_matches_reference(tmp_path: Path) -> None:
    expected = reference_token_lm(n=20, global_batch=4, window=2)
    torch.manual_seed(0)
    got = fitted_state(tmp_path, ManualTokenLM(2), token_loader(20, 4))
    assert max_diff(got, expected) < 1e-6


class GradWrites(TorchDispatchMode):
    """Counts, per gradient, the ATen operations that write into it in place, whatever the route (``mul_``,
    ``_foreach_mul_``, ``clamp_``, ``copy_``...): every mutable argument of every op is checked."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.names = {
            p.grad.untyped_storage().data_ptr(): n for n, p in module.named_parameters() if p.grad is not None
        }
        self.writes: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = kwargs.get(argument.name, args[i] if i < len(args) else None)
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(t, Tensor) and t.untyped_storage().data_ptr() in self.names:
                    self.writes[self.names[t.untyped_storage().data_ptr()]] += 1
        return func(*args, **kwargs)


MAX_NORM = 0.05


class ManualClipped(pl.LightningModule):
    """Manual optimization: ``ManualAccumulator`` windows of 4; the window's gradients clipped by ``route``:
    ``clip_gradients`` between the last backward and ``step``, an attached ``ClipGradNorm`` callback, or nothing."""

    def __init__(self, base: pl.LightningModule, normalize: str, route: str) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.base = base
        self.route = route
        self.accumulator = ManualAccumulator(4, normalize=normalize)  # type: ignore[arg-type]
        self.clip = clipping.ClipGradNorm(MAX_NORM)
        self.grad_writes: list[Counter[str]] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        if isinstance(self.base, TokenLM):
            loss, n = self.base.token_losses(batch)
            boundary = self.accumulator.backward(self, loss, batch_idx, num_tokens=n)
        else:
            boundary = self.accumulator.backward(self, nn.functional.mse_loss(self.base(batch[0]), batch[1]), batch_idx)
        if boundary:
            with GradWrites(self) as writes:
                if self.route == "clip_gradients":
                    clip_gradients(self, opt, self.clip)
                self.accumulator.step(opt)
            self.grad_writes.append(writes.writes)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.base.lr)


def reference_window_mean_clipped(normalize: str, clip: bool) -> dict[str, Tensor]:
    """Plain PyTorch: each window's gradient is the mean over its micro-batches (or its summed token loss over its
    token count), then ``clip_grad_norm_``, then the step."""
    torch.manual_seed(0)
    model: Any = TokenLM() if normalize == "tokens" else MLPModule()
    opt = torch.optim.SGD(model.parameters(), lr=model.lr)
    batches = list(token_loader(40, 4) if normalize == "tokens" else loader(n=80))
    for start in range(0, len(batches), 4):
        part = batches[start : start + 4]
        opt.zero_grad()
        if normalize == "tokens":
            big = [torch.cat(pieces) for pieces in zip(*part, strict=True)]
            loss_sum, tokens = model.token_losses(big)
            (loss_sum / tokens).backward()
        else:
            for x, y in part:
                (nn.functional.mse_loss(model(x), y) / len(part)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
    return {f"base.{k}": v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("route", ["clip_gradients", "callback", "none"])
@pytest.mark.parametrize("normalize", ["mean", "tokens"])
def test_manual_accumulator_clips_the_window_mean_and_writes_the_gradients_once(
    tmp_path: Path, normalize: str, route: str
) -> None:
    """10 micro-batches, windows 4, 4, 2: the clip threshold applies to the window mean, not to its sum."""
    torch.manual_seed(0)
    base: Any = TokenLM() if normalize == "tokens" else MLPModule()
    model = ManualClipped(base, normalize, route)
    callbacks = [ClipGradNorm(MAX_NORM)] if route == "callback" else []
    data = token_loader(40, 4) if normalize == "tokens" else loader(n=80)
    got = fitted_state(tmp_path, model, data, callbacks=callbacks)
    expected = reference_window_mean_clipped(normalize, clip=route != "none")
    assert max_diff(got, expected) < 1e-6
    if route != "none":  # clipping was active: the unclipped result is far away
        assert max_diff(got, reference_window_mean_clipped(normalize, clip=False)) > 1e-3
    names = [n for n, _ in model.named_parameters()]
    assert model.grad_writes == [Counter(dict.fromkeys(names, 1))] * 3


@pytest.mark.parametrize("route", ["clip_gradients", "callback", "none"])
def test_manual_accumulator_makes_no_host_sync(tmp_path: Path, route: str) -> None:
    torch.manual_seed(0)
    model = ManualClipped(TokenLM(), "tokens", route)
    with count_syncs() as counter:
        for method in ("backward", "step"):
            counter.watch(model.accumulator, method)
        callbacks = [ClipGradNorm(MAX_NORM)] if route == "callback" else []
        trainer = make_trainer(tmp_path, callbacks=callbacks, log_every_n_steps=1000)
        trainer.fit(model, token_loader(40, 4))
    assert trainer.global_step == 3
    assert counter.total == 0, counter.counts


def test_manual_accumulator_needs_the_token_count(tmp_path: Path) -> None:
    class NoCount(ManualTokenLM):
        def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
            loss_sum, _ = self.token_losses(batch)
            self.accumulator.backward(self, loss_sum, batch_idx)

    with pytest.raises(ValueError, match="needs the micro-batch's token count"):
        make_trainer(tmp_path).fit(NoCount(2), token_loader(8, 4))


# -- checkpoints saved inside a window ------------------------------------------------------------------------------


class ResumableLoader(DataLoader):
    """A DataLoader with Lightning's ``state_dict``/``load_state_dict`` interface: a resumed fit continues with the
    batch after the checkpoint (a plain DataLoader would start the epoch's data over)."""

    def __init__(self, dataset: Any, batch_size: int) -> None:
        super().__init__(dataset, batch_size=batch_size)
        self.yielded = 0
        self.skip = 0

    def __iter__(self) -> Any:
        skip, self.skip = self.skip, 0
        self.yielded = skip
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                self.yielded += 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = state["yielded"]


class SaveAt(pl.Callback):
    """``trainer.save_checkpoint`` at the end of one training batch of the first epoch."""

    def __init__(self, batch_idx: int, path: Path) -> None:
        self.batch_idx, self.path = batch_idx, path

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.batch_idx and trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


class PoisonedMLP(MLPModule):
    """Adam on the MLP; optionally a NaN loss at micro-batch ``nan_at`` of the first epoch."""

    def __init__(self, nan_at: int | None = None) -> None:
        super().__init__(optimizer="adam", lr=0.01)
        self.nan_at = nan_at

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * math.nan if (batch_idx, self.current_epoch) == (self.nan_at, 0) else loss


def resume_case(normalize: str, nan_at: int | None = None) -> tuple[Any, Any]:
    torch.manual_seed(0)
    if normalize == "tokens":
        return TokenLM(), ResumableLoader(token_data(40), batch_size=4)
    return PoisonedMLP(nan_at), ResumableLoader(regression_data(80), batch_size=8)


def fit_interrupted(tmp_path: Path, normalize: str, callbacks: Any, **kwargs: Any) -> tuple[Any, Any, Path]:
    """Two epochs of 10 micro-batches with N = 4, uninterrupted but saving after micro-batch 2 of the window of
    optimizer step 1 (batch_idx 5); then a fresh fit resumed from that checkpoint. Returns both final states."""
    ckpt = tmp_path / "mid_window.ckpt"
    model, data = resume_case(normalize, kwargs.pop("nan_at", None))
    run = dict(accumulate_grad_batches=4, max_epochs=2, **kwargs)
    make_trainer(tmp_path, callbacks=[*callbacks(), SaveAt(5, ckpt)], **run).fit(model, data)
    uninterrupted = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model, data = resume_case(normalize)
    make_trainer(tmp_path, callbacks=callbacks(), **run).fit(model, data, ckpt_path=ckpt)
    return uninterrupted, {k: v.detach().clone() for k, v in model.state_dict().items()}, ckpt


@pytest.mark.parametrize("normalize", ["mean", "tokens"])
def test_checkpoint_inside_a_window_resumes_exactly_with_the_guard(tmp_path: Path, normalize: str) -> None:
    spike_guards: list[SpikeGuard] = []

    def callbacks() -> list[Any]:
        spike_guards.append(SpikeGuard("loss", window=16, warmup_steps=16))  # records every window's mean loss
        return [AccumulationGuard(normalize=normalize), spike_guards[-1]]

    uninterrupted, resumed, ckpt = fit_interrupted(tmp_path, normalize, callbacks)
    assert max_diff(resumed, uninterrupted) < 1e-6
    # SpikeGuard saved the window's first losses too: the resumed run monitors the same window means.
    recorded = [guard.state_dict()["stats"][0]["values"] for guard in spike_guards]
    assert torch.allclose(recorded[0], recorded[1], rtol=1e-6, atol=0, equal_nan=True)
    # The checkpoint holds the window: a CPU copy of the gradients of its 2 micro-batches, and the token count.
    window = torch.load(ckpt, weights_only=False)["gradkit_accumulation_window"]
    assert (window["micro_batch"], window["window"], window["step"]) == (2, 4, 1)
    assert all(g is not None for g in window["state"]["grads"])


@pytest.mark.parametrize("normalize", ["mean", "tokens"])
def test_checkpoint_inside_a_window_without_the_guard_warns_at_save_and_resume(tmp_path: Path, normalize: str) -> None:
    """Lightning alone loses the window's first micro-batches; a gradkit callback says so, naming the position."""
    position = "after micro-batch 2 of 4, before optimizer step 1"
    with pytest.warns(UserWarning) as record:
        uninterrupted, resumed, _ = fit_interrupted(tmp_path, normalize, lambda: [GradNormMonitor()])
    messages = [str(w.message) for w in record if "gradkit:" in str(w.message)]
    assert len(messages) == 2
    assert "checkpoint is saved inside a gradient-accumulation window" in messages[0] and position in messages[0]
    assert "resuming from a checkpoint saved inside" in messages[1] and position in messages[1]
    assert max_diff(resumed, uninterrupted) > 1e-3  # the divergence the warnings announce


def test_model_checkpoint_after_a_mid_window_validation_resumes_exactly(tmp_path: Path) -> None:
    """``val_check_interval=6`` with N = 4: ``ModelCheckpoint`` saves after micro-batch 2 of a window."""

    class Validated(PoisonedMLP):
        def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
            self.log("val_loss", nn.functional.mse_loss(self(batch[0]), batch[1]))

    def fit(ckpt_path: Path | None) -> dict[str, Tensor]:
        torch.manual_seed(0)
        model = Validated()
        checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1, every_n_epochs=None)
        trainer = make_trainer(
            tmp_path,
            accumulate_grad_batches=4,
            max_epochs=1,
            val_check_interval=6,
            limit_val_batches=1,
            enable_checkpointing=True,
            callbacks=[AccumulationGuard(), checkpoints],
        )
        data = ResumableLoader(regression_data(80), batch_size=8)
        trainer.fit(model, data, loader(n=8), ckpt_path=ckpt_path)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    uninterrupted = fit(None)
    mid_window = tmp_path / "ckpts" / "epoch=0-step=1.ckpt"
    assert torch.load(mid_window, weights_only=False)["gradkit_accumulation_window"]["micro_batch"] == 2
    assert max_diff(fit(mid_window), uninterrupted) < 1e-6


def test_nan_in_a_window_split_by_a_checkpoint_is_still_skipped_after_resume(tmp_path: Path) -> None:
    """Micro-batch 4 (the first of the window of step 1) has a NaN loss; the checkpoint follows micro-batch 5. The
    restored gradients carry the NaN, so the resumed run skips step 1 as the uninterrupted one does."""

    def callbacks() -> list[Any]:
        return [AccumulationGuard(), NonFiniteGuard(action="skip")]

    with pytest.warns(UserWarning, match="NonFiniteGuard"):
        uninterrupted, resumed, _ = fit_interrupted(tmp_path, "mean", callbacks, nan_at=4, strategy="gradkit")
    assert all(torch.isfinite(v).all() for v in uninterrupted.values())
    assert max_diff(resumed, uninterrupted) < 1e-6


def test_checkpoint_size_grows_by_the_gradients_only_when_saved_inside_a_window(tmp_path: Path) -> None:
    sizes = {}
    for name, callbacks in (("guard", lambda: [AccumulationGuard()]), ("monitor", lambda: [GradNormMonitor()])):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, _, ckpt = fit_interrupted(tmp_path / name, "mean", callbacks)
        sizes[name] = ckpt.stat().st_size
    grad_bytes = sum(p.numel() * p.element_size() for p in MLPModule().parameters())
    assert grad_bytes <= sizes["guard"] - sizes["monitor"] <= grad_bytes + 4096


# -- bad input and setup errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"normalize": "sum"}, r"`normalize` must be one of \['mean', 'tokens'\], got 'sum'"),
        ({"on_dirty": "ignore"}, r"`on_dirty` must be one of \['warn', 'raise'\], got 'ignore'"),
        ({"tokens_key": ""}, "`tokens_key` must name"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AccumulationGuard(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"window": 0}, "`window` must be"), ({"window": 2, "normalize": "x"}, "`normalize`")]
)
def test_manual_accumulator_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ManualAccumulator(**kwargs)


def test_two_guards_are_refused(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[AccumulationGuard(), AccumulationGuard()])
    with pytest.raises(RuntimeError, match="several AccumulationGuard"):
        trainer.fit(MLPModule(), loader())


def test_token_mode_with_manual_optimization_points_to_the_helper(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[AccumulationGuard(normalize="tokens")])
    with pytest.raises(RuntimeError, match="ManualAccumulator"):
        trainer.fit(ManualMLP(2), loader())


def test_guard_builds_from_lightning_cli_style_arguments(tmp_path: Path) -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(AccumulationGuard, "guard")
    cfg = parser.parse_args(["--guard.normalize=tokens", "--guard.on_dirty=raise", "--guard.zero_early=false"])
    guard = AccumulationGuard(**cfg.guard.as_dict())
    assert (guard.normalize, guard.on_dirty, guard.zero_early) == ("tokens", "raise", False)
    with pytest.raises(Exception, match="normalize"):
        parser.parse_args(["--guard.normalize=sum"])
