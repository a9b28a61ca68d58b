"""One name cleaner (``core.norms.clean_name``): the names of wrapped models, and one name per module across the
GradNormMonitor's keys, the NonFiniteGuard's culprit and the activation-checkpointing selection."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.nn.parallel import DistributedDataParallel

from gradkit.policies.forensics import find_nonfinite_origin
from gradkit.step.params import clean_name, is_ddp_wrapped
from helpers import MLPModule, column, loader, make_trainer, read_metrics
from lightning_gradkit import GradNormMonitor, NonFiniteGuard
from lightning_gradkit.activation_checkpointing.injection import select_modules

NAN = float("nan")


class Holder(nn.Module):
    """A user's submodule that holds its child in an attribute literally named ``module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: Tensor) -> Tensor:
        return self.module(x)


def user_model() -> nn.Module:
    """Names ``0.*``, ``1.module.*`` (a user's ``module``) and ``module.*`` (a user's ``module`` at the top level)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Holder(nn.Linear(4, 4)))
    model.add_module("module", nn.Linear(4, 1))
    return model


def param_names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters()]


USER_NAMES = ["0.weight", "0.bias", "1.module.weight", "1.module.bias", "module.weight", "module.bias"]


# -- the cleaner on the names that wrappers produce ------------------------------------------------------------------
def test_torch_compile_names_clean_to_the_unwrapped_names() -> None:
    model = user_model()
    compiled = torch.compile(model)  # nothing is compiled before the first call
    assert param_names(compiled)[0] == "_orig_mod.0.weight"
    assert [clean_name(n) for n in param_names(compiled)] == param_names(model) == USER_NAMES
    assert [clean_name(n) for n, _ in compiled.named_modules()] == ["", *(n for n, _ in model.named_modules())]


def test_checkpoint_wrapper_names_clean_to_the_unwrapped_names() -> None:
    model = user_model()
    model[1].module = checkpoint_wrapper(model[1].module)
    model.module = checkpoint_wrapper(model.module)
    raw = param_names(model)
    assert "1.module._checkpoint_wrapped_module.weight" in raw and "module._checkpoint_wrapped_module.bias" in raw
    assert [clean_name(n) for n in raw] == USER_NAMES


def test_fsdp1_names_clean_to_the_unwrapped_names() -> None:
    # FullyShardedDataParallel (FSDP1) inserts `_fsdp_wrapped_module` at every wrapped level, outside the checkpoint.
    raw = "_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module._checkpoint_wrapped_module.attn.module.weight"
    assert clean_name(raw) == "blocks.0.attn.module.weight"
    assert clean_name("_fsdp_wrapped_module") == clean_name("") == ""


def test_a_users_module_named_module_is_kept_at_every_depth() -> None:
    assert clean_name("module.weight") == "module.weight"
    assert clean_name("encoder.module.weight") == "encoder.module.weight"
    assert clean_name("_orig_mod.module._checkpoint_wrapped_module.weight") == "module.weight"
    assert not is_ddp_wrapped(user_model())
    assert not is_ddp_wrapped(torch.compile(user_model()))


def test_ddp_prefix_is_dropped_only_as_the_leading_component_of_a_ddp_root() -> None:
    assert clean_name("module.encoder.weight", ddp_root=True) == "encoder.weight"
    assert clean_name("module", ddp_root=True) == ""
    # DDP over a model that has its own `module`: only DDP's (the first) goes.
    assert clean_name("module.module.weight", ddp_root=True) == "module.weight"
    assert clean_name("module.1.module.weight", ddp_root=True) == "1.module.weight"
    # DDP(torch.compile(m)) and torch.compile(DDP(m)).
    assert clean_name("module._orig_mod.1.module.weight", ddp_root=True) == "1.module.weight"
    assert clean_name("_orig_mod.module.1.module.weight", ddp_root=True) == "1.module.weight"


def test_real_ddp_names_clean_to_the_unwrapped_names(one_rank_group: None) -> None:
    model = user_model()
    for wrapped in (DistributedDataParallel(model), torch.compile(DistributedDataParallel(model))):
        assert is_ddp_wrapped(wrapped)
        assert [clean_name(n, ddp_root=True) for n in param_names(wrapped)] == USER_NAMES
    ddp = DistributedDataParallel(model)
    assert param_names(ddp)[-1] == "module.module.bias"
    # The culprit of a DDP-wrapped model and the selection in it use the unwrapped names.
    ddp.module[1].module.weight.register_hook(lambda g: g * NAN)
    finding = find_nonfinite_origin(ddp, lambda: ddp(torch.randn(2, 4)).sum())
    assert (finding.culprit, finding.phase) == ("1.module.weight", "parameter_gradient")
    assert [n for n, _ in select_modules(ddp, [r"re:1\.module", "Holder"])] == ["1"]
    assert [n for n, _ in select_modules(ddp, [r"re:1\.module"])] == ["1.module"]


# -- one name per module across the callbacks ----------------------------------------------------------------------
class _NaNBackward(torch.autograd.Function):
    """Identity forward; the backward returns NaN (a layer whose own gradient computation fails)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return torch.full_like(grad, NAN)


class FaultyLinear(nn.Linear):
    """A Linear whose backward produces NaN while ``armed``: its weight gradient and its input gradient are NaN."""

    armed = False

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        return _NaNBackward.apply(y) if self.armed else y


class WrappedFaultModule(MLPModule):
    """``encoder.2`` is a user's :class:`Holder` whose ``module`` (a :class:`FaultyLinear`) is wrapped by ``wrap``;
    batch 2 (and its replay) gets a NaN gradient there."""

    def __init__(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        super().__init__(lr=0.01, optimizer="adam")
        self.encoder[2] = Holder(wrap(FaultyLinear(16, 16)))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        for m in self.modules():
            if isinstance(m, FaultyLinear):
                m.armed = batch_idx == 2
        return super().training_step(batch, batch_idx)


WRAPPERS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "checkpoint_wrapper": checkpoint_wrapper,
    "torch_compile": lambda m: torch.compile(m, backend="eager"),
}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_guard_culprit_equals_the_monitor_key_of_a_wrapped_module(tmp_path: Path, wrapper: str) -> None:
    torch.manual_seed(0)
    model = WrappedFaultModule(WRAPPERS[wrapper])
    raw = param_names(model)
    assert any(("_checkpoint_wrapped_module" in n or "_orig_mod" in n) and ".module." in n for n in raw), raw
    guard = NonFiniteGuard(action="skip")
    monitor = GradNormMonitor(depth=3)
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[guard, monitor], max_steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader())
    events = [json.loads(line) for line in (Path(trainer.log_dir) / "gradkit_events.jsonl").read_text().splitlines()]
    (event,) = events
    assert event["step"] == 2
    culprit = event["culprit"]
    assert culprit == "encoder.2.module"  # the user's `module` is kept, the wrapper's component dropped
    assert event["values"]["forensics"][0]["phase"] == "backward"  # the custom Function's backward made it
    rows = read_metrics(trainer)
    keys = {k[len("grad_norm/module/") :] for row in rows for k in row if k.startswith("grad_norm/module/")}
    assert culprit in keys, keys
    # The monitor's row for that key is the one that went NaN, at the step the guard skipped.
    assert [math.isnan(v) for v in column(rows, f"grad_norm/module/{culprit}")] == [False, False, True, False]
