"""ActivationCheckpointing on a CUDA device: fused attention kernels, peak memory, offload, Lightning's FSDPStrategy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from helpers import make_trainer
from lightning_gradkit import ActivationCheckpointing, inject_activation_checkpointing
from lightning_gradkit.activation_checkpointing.injection import injected_mode
from lightning_gradkit.demos import Block, ByteDataset, GPTConfig, TinyGPT, TinyGPTModule, stdlib_text

pytestmark = pytest.mark.gpu

CONFIG = GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=4, n_embd=256, dropout=0.1)
MODEL = dict(n_layer=4, n_head=4, n_embd=256, block_size=256, dropout=0.1, lr=1e-3)


def gpt(dropout: float = CONFIG.dropout) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(GPTConfig(**{**CONFIG.__dict__, "dropout": dropout})).cuda()


def loss_of(model: nn.Module, idx: Tensor) -> Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), idx.roll(-1, 1).reshape(-1))


def grads_and_peak(model: nn.Module, idx: Tensor) -> tuple[dict[str, Tensor], int]:
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(7)
    loss_of(model, idx).backward()
    torch.cuda.synchronize()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_fused_attention_with_dropout_gives_the_same_gradients_and_a_lower_peak(mode: str) -> None:
    idx = torch.randint(0, 256, (8, CONFIG.block_size), device="cuda")
    reference, plain_peak = grads_and_peak(gpt(), idx)
    model = gpt()
    inject_activation_checkpointing(model, ["Block"], mode=mode)
    got, peak = grads_and_peak(model, idx)
    for name, grad in reference.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-5, msg=name)
    assert peak < (0.6 if mode == "full" else 0.9) * plain_peak


class MemoryAtBackward(pl.Callback):
    def __init__(self) -> None:
        self.allocated: list[int] = []

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        torch.cuda.synchronize()
        self.allocated.append(torch.cuda.memory_allocated())


def loader() -> DataLoader:
    return DataLoader(ByteDataset(stdlib_text(max_bytes=200_000), block_size=256), batch_size=8)


def test_offload_keeps_fewer_bytes_on_the_device_and_trains_identically(tmp_path: Path) -> None:
    def run(offload: bool) -> tuple[list[int], list[Tensor]]:
        torch.manual_seed(0)
        module, memory = TinyGPTModule(**MODEL), MemoryAtBackward()
        callback = ActivationCheckpointing(["Block"], every_n=2, offload=offload)
        make_trainer(tmp_path, accelerator="gpu", max_steps=3, logger=False, callbacks=[callback, memory]).fit(
            module, loader()
        )
        return memory.allocated, [p.detach().cpu() for p in module.parameters()]

    plain_memory, plain_params = run(offload=False)
    memory, params = run(offload=True)
    assert max(memory) < max(plain_memory)
    for a, b in zip(params, plain_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.injected: list[bool] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))
        self.injected.append(any(injected_mode(m) for m in pl_module.modules()))


def test_fsdp_strategy_trains_identically_and_its_own_policy_is_not_doubled(tmp_path: Path) -> None:
    from lightning.pytorch.strategies import FSDPStrategy

    def run(callbacks: list[pl.Callback], **strategy_kwargs: Any) -> Losses:
        torch.manual_seed(0)
        losses = Losses()
        strategy = FSDPStrategy(auto_wrap_policy={Block}, **strategy_kwargs)
        trainer = make_trainer(
            tmp_path, accelerator="gpu", devices=1, strategy=strategy, max_steps=3, logger=False,
            callbacks=[*callbacks, losses],
        )  # fmt: skip
        trainer.fit(TinyGPTModule(**MODEL), loader())
        return losses

    plain = run([])
    ours = run([ActivationCheckpointing(["Block"])])
    assert all(ours.injected)
    assert ours.losses == pytest.approx(plain.losses, abs=1e-5)
    with pytest.warns(UserWarning, match="also checkpointed by checkpoint_wrapper"):
        both = run([ActivationCheckpointing(["Block"])], activation_checkpointing_policy={Block})
    assert not any(both.injected)
    assert both.losses == pytest.approx(plain.losses, abs=1e-5)


def test_inductor_compiled_injected_model_keeps_the_lower_peak() -> None:
    # no dropout: inductor draws its own random numbers, which differ between differently partitioned graphs
    idx = torch.randint(0, 256, (8, CONFIG.block_size), device="cuda")
    plain = torch.compile(gpt(dropout=0.0))
    grads_and_peak(plain, idx)  # compile
    reference, plain_peak = grads_and_peak(plain, idx)
    model = gpt(dropout=0.0)
    inject_activation_checkpointing(model, ["Block"])
    compiled = torch.compile(model)
    grads_and_peak(compiled, idx)
    got, peak = grads_and_peak(compiled, idx)
    assert peak < 0.7 * plain_peak
    for name, grad in reference.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-4, msg=name)
