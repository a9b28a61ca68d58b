"""Forensic replay: the culprit named for faults planted at known places, and a replay that changes nothing."""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from architectures import ArchModule, ResNet18Like, TiedTransformerLM, TinyViT, data_loader, image_data, token_data
from gradkit.doors.loop import GradKit
from gradkit.policies.culprit import replay_micro_batches
from gradkit.policies.forensics import find_nonfinite_origin
from gradkit.step.params import clean_name
from gradkit.step.replay import capture_rng, replay
from helpers import MLPModule, assert_same_state, count_syncs, loader, make_trainer
from lightning_gradkit import NonFiniteGuard
from lightning_gradkit.callbacks.guard_callbacks import training_step_batch
from lightning_gradkit.trainer_door import TrainerPipeline
from test_guards import events


class Log(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.log(x)


class Sqrt(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.sqrt(x)


class Block(nn.Module):
    """``inner`` is followed by a functional op in the block's own forward."""

    def __init__(self, op: str = "none") -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.after = nn.Linear(4, 4)
        self.op = op

    def forward(self, x: Tensor) -> Tensor:
        h = self.inner(x)
        if self.op == "log":
            h = torch.log(h - 1e3)  # negative -> NaN, made between the submodules
        return self.after(h)


LOG_CODE = "h = torch.log(h - 1e3)  # negative -> NaN, made between the submodules"
LOG_LINE = next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if line.strip() == LOG_CODE)


def net(*middle: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), *middle, nn.Linear(4, 1))


def origin(model: nn.Module, x: Tensor, **kwargs: Any):
    return find_nonfinite_origin(model, lambda: model(x).pow(2).mean(), **kwargs)


def test_names_the_module_whose_forward_output_turned_nan() -> None:
    model = net(nn.Tanh(), Log(), nn.Linear(4, 4))  # log of tanh output < 0 is NaN
    finding = origin(model, torch.randn(8, 4))
    assert (finding.culprit, finding.phase) == ("2", "forward")
    assert "module_type" in finding.detail and finding.detail["module_type"] == "Log"


def test_names_the_parent_when_nan_is_made_between_its_submodules() -> None:
    model = net(Block("log"))
    finding = origin(model, torch.randn(8, 4))
    assert (finding.culprit, finding.phase) == ("1", "forward_between_submodules")
    assert finding.detail["op"] == "aten.log.default"
    assert finding.detail["source"].endswith(f"{LOG_LINE} in forward: {LOG_CODE}")


def test_names_the_batch_when_the_input_is_already_nonfinite() -> None:
    x = torch.randn(8, 4)
    x[3, 1] = float("inf")
    finding = origin(net(), x)
    assert finding.phase == "batch" and finding.culprit == "<batch>"
    assert finding.detail["op"] == "aten.addmm.default" and finding.detail["input_of"] == "the forward of `0`"


def test_an_inplace_operator_on_a_nonfinite_input_hands_its_origin_on() -> None:
    # relu_ writes its NaN input in place: the NaN was the batch's, not relu_'s.
    x = torch.randn(8, 4)
    x[0, 0] = float("nan")
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 1))
    finding = origin(model, x)
    assert (finding.culprit, finding.phase) == ("<batch>", "batch")
    assert finding.detail["op"] == "aten.relu_.default"


def sqrt_at_zero() -> nn.Sequential:
    """``sqrt`` of an all-zero activation: finite forward; its derivative at 0 is inf, and the first layer's weight
    gradient sums +inf and -inf into NaN."""
    model = net(Sqrt())
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
    return model


def test_names_the_module_whose_backward_turned_inf() -> None:
    finding = origin(sqrt_at_zero(), torch.randn(8, 4))
    assert (finding.culprit, finding.phase) == ("1", "backward")
    assert finding.detail["forward_op"] == "aten.sqrt.default" and finding.detail["node"] == "SqrtBackward0"
    assert finding.detail["op"] == "aten.div.Tensor"  # SqrtBackward0: grad / (2 * sqrt(x))
    assert finding.detail["source"].endswith("in forward: return torch.sqrt(x)")  # the forward call it differentiates
    assert finding.detail["became_nan"] == "`aten.mm.default` in the backward of `0`"
    assert finding.detail["nonfinite_param_grads"] == ["0.weight", "0.bias"]


def test_an_inf_the_backward_absorbs_is_no_culprit() -> None:
    # sqrt(relu(x)) at 0: Sqrt's input gradient is inf, ReLU's backward zeroes it: every parameter gradient is finite.
    model = net(nn.ReLU(), Sqrt())
    finding = origin(model, torch.full((8, 4), -10.0))
    assert finding.phase == "not_reproduced"
    loss = model(torch.full((8, 4), -10.0)).pow(2).mean()
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(loss, list(model.parameters())))


def test_names_the_loss_when_the_model_output_is_finite() -> None:
    model = net()
    finding = find_nonfinite_origin(model, lambda: model(torch.randn(8, 4)).mean() / 0.0 * 0.0)
    assert (finding.culprit, finding.phase) == ("<loss>", "loss")


def test_names_the_loss_when_its_backward_makes_the_first_nonfinite_value() -> None:
    model = net()
    x = torch.randn(8, 4)
    finding = find_nonfinite_origin(model, lambda: torch.sqrt(model(x) * 0).sum())  # d sqrt(0) = inf
    assert (finding.culprit, finding.phase, finding.detail["pass"]) == ("<loss>", "loss", "backward")
    assert (finding.detail["node"], finding.detail["forward_op"]) == ("SqrtBackward0", "aten.sqrt.default")
    # inf * 0 in the backward of `model(x) * 0`, also outside the modules.
    assert finding.detail["became_nan"] == "`aten.mul.Tensor` in the backward of the code outside the modules"


def test_names_a_parameter_whose_gradient_a_hook_poisoned() -> None:
    model = net()
    model[1].weight.register_hook(lambda g: g * float("nan"))  # the hook
    finding = origin(model, torch.randn(8, 4))
    assert (finding.culprit, finding.phase) == ("1.weight", "parameter_gradient")
    assert finding.detail["op"] == "aten.mul.Tensor" and finding.detail["source"].endswith("# the hook")


def test_a_sparse_embedding_gradient_is_checked_too() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    model[1].register_forward_hook(lambda m, args, out: out / 0)
    idx = torch.randint(0, 10, (3, 5))
    finding = find_nonfinite_origin(model, lambda: model(idx).sum())
    assert (finding.culprit, finding.phase, finding.detail["op"]) == ("1", "forward", "aten.div.Tensor")
    # Independent check: the plain gradients, the embedding's sparse one read through its stored values.
    grads = torch.autograd.grad(model(idx).sum(), list(model.parameters()))
    assert grads[0].is_sparse and not torch.isfinite(grads[0]._values()).all()
    assert finding.detail["nonfinite_param_grads"] == ["0.weight", "1.weight", "1.bias"]
    assert "replay_error" not in finding.detail


def test_names_a_parameter_that_was_already_nonfinite() -> None:
    model = net()
    with torch.no_grad():
        model[0].weight[2, 3] = float("inf")
    finding = origin(model, torch.randn(8, 4))
    assert (finding.culprit, finding.phase) == ("0.weight", "parameter")
    assert finding.detail["op"] == "aten.addmm.default" and finding.detail["input_of"] == "the forward of `0`"


def test_a_finite_replay_reports_not_reproduced() -> None:
    finding = origin(net(), torch.randn(8, 4))
    assert finding.culprit is None and finding.phase == "not_reproduced"


def test_anomaly_mode_adds_the_forward_trace_for_that_replay_only() -> None:
    # detect_anomaly stops the backward at the NaN (it ignores inf) of the first layer's weight gradient.
    with pytest.warns(UserWarning, match="Anomaly Detection has been enabled"):  # torch's, for the replay
        finding = origin(sqrt_at_zero(), torch.randn(8, 4), anomaly=True)
    assert (finding.culprit, finding.phase) == ("1", "backward")
    assert "returned nan values" in finding.detail["replay_error"]
    assert "Traceback of forward call" in finding.detail["anomaly_forward_trace"]
    assert not torch.is_anomaly_enabled()


def test_hooks_are_removed_and_grads_untouched() -> None:
    model = net(nn.Tanh(), Log())
    origin(model, torch.randn(8, 4))
    assert all(p.grad is None for p in model.parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks for m in model.modules())


def test_culprit_names_drop_wrapper_components_and_the_root_is_named_root() -> None:
    assert clean_name("_orig_mod.encoder._fsdp_wrapped_module.2") == "encoder.2"
    assert clean_name("submodule.x") == "submodule.x"
    # The root module (named "") is "<root>" in a Finding.
    finding = origin(Block("log"), torch.randn(8, 4))
    assert (finding.culprit, finding.phase) == ("<root>", "forward_between_submodules")
    assert finding.detail["op"] == "aten.log.default"


class DropoutBN(MLPModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 16))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.outputs = self(batch[0]).detach()  # the output under this step's dropout mask
        loss = nn.functional.mse_loss(self.outputs, batch[1]).requires_grad_()
        self.log("train_loss", loss)  # outside a loop this raises: the replay must silence it
        return loss


def step_outside_the_loop(model: DropoutBN, batch: Any) -> None:
    model.log = lambda *args, **kwargs: None
    try:
        model.training_step(batch, 0)
    finally:
        del model.log


def test_replay_changes_nothing_and_repeats_the_dropout_mask(tmp_path: Path) -> None:
    """RNG streams, BatchNorm running stats and grads after a replay equal those without one."""
    model = DropoutBN()
    trainer = make_trainer(tmp_path, max_steps=1)
    trainer.fit(model, loader())
    batch = next(iter(loader()))
    model.train()
    # The original step: RNG state before it, outputs, then the states everything is in afterwards.
    rng = capture_rng(full=False)
    step_outside_the_loop(model, batch)
    original_outputs = model.outputs
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    random.seed(1)
    np.random.seed(1)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    expected_next = (torch.rand(3).tolist(), random.random(), np.random.rand())
    random.seed(1)
    np.random.seed(1)
    torch.set_rng_state(rng.torch_cpu)
    step_outside_the_loop(model, batch)  # advance torch RNG exactly as the original step did
    buffers_again = {n: b.clone() for n, b in model.named_buffers()}
    for n in buffers:
        model.get_buffer(n).copy_(buffers[n])
    micro_batch = training_step_batch(trainer, model, batch, 0)
    micro_batch.rng = rng  # the state before the original step above
    finding = replay_micro_batches(model, [micro_batch])
    assert finding.phase == "not_reproduced"
    assert torch.equal(model.outputs, original_outputs)  # the replay saw the same dropout mask
    assert (torch.rand(3).tolist(), random.random(), np.random.rand()) == expected_next
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n
    assert any(not torch.equal(buffers[n], buffers_again[n]) for n in buffers)  # a forward does move them
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]), n


def test_replay_restores_train_mode() -> None:
    model = net(nn.Dropout())
    with replay(model):
        model.eval()
    assert model.training


# -- in-place operators, custom backward, fp16 scale, failures ------------------------------------------------------
class DivInPlace(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        x = x.clone()
        x.div_(0.0)  # in place: +-inf
        return x


def test_names_an_inplace_operator_and_not_the_inplace_relu_after_it() -> None:
    """Module backward hooks cannot wrap an in-place ReLU; the replay sees the in-place operators themselves."""
    model = net(DivInPlace(), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.ReLU(inplace=True))
    finding = origin(model, torch.randn(8, 4))
    assert (finding.culprit, finding.phase) == ("1", "forward")
    assert finding.detail["op"] == "aten.div_.Tensor" and finding.detail["source"].endswith(
        "x.div_(0.0)  # in place: +-inf"
    )
    assert "replay_error" not in finding.detail


class NaNGradient(torch.autograd.Function):
    """Identity forward; a backward that makes NaN."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad * float("nan")  # the custom backward


class CustomBackward(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return NaNGradient.apply(x)


def test_names_the_module_of_a_custom_function_whose_backward_made_nan() -> None:
    finding = origin(net(CustomBackward()), torch.randn(8, 4))
    assert (finding.culprit, finding.phase) == ("1", "backward")
    assert finding.detail["node"] == "NaNGradientBackward" and finding.detail["op"] == "aten.mul.Tensor"
    assert finding.detail["source"].endswith("# the custom backward")  # the user's backward code, not the forward
    assert finding.detail["nonfinite_param_grads"] == ["0.weight", "0.bias"]


def test_an_fp16_overflow_under_the_backward_scale_is_named_in_the_backward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 64), nn.Linear(64, 1)).half()
    x = torch.randn(8, 4).half()

    def compute_loss() -> Tensor:
        return model(x).float().pow(2).sum()

    assert find_nonfinite_origin(model, compute_loss).phase == "not_reproduced"
    # The GradScaler's scale: the loss stays finite in fp32, the fp16 backward of the last layer overflows.
    finding = find_nonfinite_origin(model, compute_loss, backward_scale=2.0**16)
    assert (finding.culprit, finding.phase) == ("2", "backward") and finding.detail["loss_finite"]
    assert (finding.detail["op"], finding.detail["forward_op"]) == ("aten.mm.default", "aten.addmm.default")
    # Independent check: a plain backward of the scaled loss gives the same non-finite gradients.
    grads = torch.autograd.grad(compute_loss() * 2.0**16, list(model.parameters()))
    expected = [n for (n, _), g in zip(model.named_parameters(), grads, strict=True) if not torch.isfinite(g).all()]
    assert finding.detail["nonfinite_param_grads"] == expected and expected


def test_a_replay_that_raises_says_it_failed_and_never_that_it_stayed_finite() -> None:
    model = net(nn.Tanh(), Log())  # the forward makes NaN, then the replay raises before returning a loss

    def compute_loss() -> Tensor:
        model(torch.randn(8, 4))
        raise RuntimeError("the data iterator is exhausted\nsecond line")

    finding = find_nonfinite_origin(model, compute_loss)
    assert (finding.culprit, finding.phase) == (None, "failed")
    assert finding.detail["error"] == "RuntimeError: the data iterator is exhausted"
    assert finding.describe() == "the replay failed: RuntimeError: the data iterator is exhausted"


# -- real architectures ---------------------------------------------------------------------------------------------
def make_nan(module: nn.Module, args: Any, output: Tensor) -> Tensor:
    return (output.abs() + 1).neg().log()  # log of a negative number: NaN made by aten.log


def test_attention_masks_are_no_culprit_and_a_nan_in_a_later_block_is_named() -> None:
    """``nn.MultiheadAttention`` turns the causal mask into ``-inf`` (``masked_fill_``) in every block; the softmax
    makes it finite again, so it is no culprit. A NaN made in block 1 is named, with its operator."""
    torch.manual_seed(0)
    model = TiedTransformerLM()
    idx = torch.randint(0, 32, (2, 8))
    assert find_nonfinite_origin(model, lambda: model(idx).sum()).phase == "not_reproduced"
    model.blocks[1].mlp[0].register_forward_hook(make_nan)
    finding = find_nonfinite_origin(model, lambda: model(idx).sum())
    assert (finding.culprit, finding.phase, finding.detail["op"]) == ("blocks.1.mlp.0", "forward", "aten.log.default")
    assert finding.detail["source"].endswith(
        "in make_nan: return (output.abs() + 1).neg().log()  # log of a negative number: NaN made by aten.log"
    )


def test_names_a_nan_inside_a_vit_block() -> None:
    torch.manual_seed(0)
    model = TinyViT()
    model.blocks[1].ln_2.register_forward_hook(make_nan)
    finding = find_nonfinite_origin(model, lambda: model(torch.randn(2, 3, 8, 8)).sum())
    assert (finding.culprit, finding.phase, finding.detail["op"]) == ("blocks.1.ln_2", "forward", "aten.log.default")
    assert finding.detail["module_type"] == "LayerNorm"


# -- with Lightning's Trainer ---------------------------------------------------------------------------------------
MAKE_NAN_CODE = "return (output.abs() + 1).neg().log()  # log of a negative number: NaN made by aten.log"


class PoisonedArch(ArchModule):
    """An architecture whose submodule ``target`` makes NaN (an operator in a forward hook) on batch ``bad_batch``,
    and again when that batch is replayed: the hook is keyed on the batch ``training_step`` computes."""

    def __init__(self, model: nn.Module, target: str, bad_batch: int = 2) -> None:
        super().__init__(model, lr=0.01)
        self.bad_batch = bad_batch
        self.batch_idx = -1
        self.get_submodule(target).register_forward_hook(self.poison)

    def poison(self, module: nn.Module, args: Any, output: Tensor) -> Tensor | None:
        return make_nan(module, args, output) if self.batch_idx == self.bad_batch else None

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.batch_idx = batch_idx
        return super().training_step(batch, batch_idx)


ARCHITECTURES: dict[str, tuple[Callable[[], nn.Module], Callable[[], TensorDataset], str, str]] = {
    # layer3's first BasicBlock: a NaN out of bn1 goes through the in-place ReLU, conv2, bn2 and `out += identity`.
    "resnet18": (ResNet18Like, image_data, "model.layer3.0.bn1", "BatchNorm2d"),
    "tied_transformer": (TiedTransformerLM, token_data, "model.blocks.1.mlp.0", "Linear"),
    "vit": (TinyViT, image_data, "model.blocks.0.ln_2", "LayerNorm"),
}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_guard_names_the_module_and_operator_that_made_nan_in_a_real_architecture(tmp_path: Path, arch: str) -> None:
    build, data, target, module_type = ARCHITECTURES[arch]
    torch.manual_seed(0)
    model = PoisonedArch(build(), target)
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[NonFiniteGuard(action="skip")], max_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data_loader(data()))
    (event,) = events(trainer)
    assert (event["step"], event["batch_idx"]) == (2, 2)
    assert event["culprit"] == target and event["culprit_source"] == "replay"
    (finding,) = event["values"]["forensics"]
    assert (finding["phase"], finding["op"], finding["module_type"]) == ("forward", "aten.log.default", module_type)
    assert finding["source"].endswith(f"in make_nan: {MAKE_NAN_CODE}") and "replay_error" not in finding
    (line,) = [str(w.message) for w in caught if "NonFiniteGuard" in str(w.message)]
    assert f"culprit `{target}`: first non-finite value made by `aten.log.default` in the forward of `{target}`" in line


class NormalizesRows(nn.Module):
    """Divides each row by its largest magnitude: 0 / 0 = NaN for a row of zeros (a fault the data decides)."""

    def forward(self, x: Tensor) -> Tensor:
        return x / x.abs().amax(dim=1, keepdim=True)  # the culprit line


class NormalizedMLP(MLPModule):
    """The MLP behind row normalization, with dropout: the replay must repeat the masks and restore the RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.normalize = NormalizesRows()
        self.dropout = nn.Dropout(0.2)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(self.dropout(self.normalize(x)))


def _zero_row_loader() -> DataLoader:
    """``loader()``'s batches of 8, with the first row of batch 3 zeroed."""
    x, y = loader().dataset.tensors
    x = x.clone()
    x[3 * 8] = 0.0
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _assert_both_doors_name_normalize(trainer_event: dict, loop_event: dict, step_key: str) -> None:
    """The Trainer's and the loop door's events of the bad micro-batch 3 (step 1, the window [2, 3]) name the module
    `normalize`, its operator and the culprit line, and their replay findings are equal."""
    for event in (trainer_event, loop_event):
        assert (event[step_key], event["batch_idx"], event["batches"]) == (1, 3, [2, 3])
        assert (event["culprit"], event["culprit_source"], event["reproducible"]) == ("normalize", "replay", True)
    (trainer_finding,) = trainer_event["values"]["forensics"]
    (loop_finding,) = loop_event["values"]["forensics"]
    assert (loop_finding["phase"], loop_finding["op"]) == ("forward", "aten.div.Tensor")
    assert loop_finding["source"].endswith("return x / x.abs().amax(dim=1, keepdim=True)  # the culprit line")
    assert loop_finding == trainer_finding


def test_loop_door_replay_names_the_same_module_operator_and_line_as_the_trainer(tmp_path: Path) -> None:
    """``kit.note_loss(loss, replay=...)`` gives the loop door the Trainer's culprit replay: windows of 2 micro-batches,
    the second of step 1 makes NaN in ``normalize`` (0 / 0). Reference: the Trainer door's event for the same model
    and data. The replays leave no trace: both doors end with bitwise equal parameters (dropout masks included)."""
    torch.manual_seed(0)
    module = NormalizedMLP()
    initial = {k: v.clone() for k, v in module.state_dict().items()}
    guard = NonFiniteGuard(action="skip")
    trainer = make_trainer(tmp_path / "trainer", strategy="gradkit", callbacks=[guard], accumulate_grad_batches=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _zero_row_loader())
    (trainer_event,) = events(trainer)

    torch.manual_seed(0)
    model = NormalizedMLP()
    model.load_state_dict(initial)
    opt = torch.optim.SGD(model.parameters(), lr=model.lr)
    kit = GradKit(model, opt, NonFiniteGuard(action="skip"), log_dir=tmp_path / "loop")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, (x, y) in enumerate(_zero_row_loader()):
            loss = nn.functional.mse_loss(model(x), y)
            (loss / 2).backward()
            kit.note_loss(loss, replay=lambda x=x, y=y: nn.functional.mse_loss(model(x), y))
            if i % 2 == 1:
                kit.step(opt)
                opt.zero_grad(set_to_none=True)
    (loop_event,) = events(tmp_path / "loop")

    _assert_both_doors_name_normalize(trainer_event, loop_event, "step")
    assert kit.skipped_steps == int(TrainerPipeline.of(trainer).skipped_steps) == 1
    for name, value in module.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name


def test_loop_door_without_a_replay_says_how_to_give_one(tmp_path: Path) -> None:
    model = NormalizedMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kit = GradKit(model, opt, NonFiniteGuard(action="skip"), log_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x, y in _zero_row_loader():
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            kit.note_loss(loss)
            kit.step(opt)
            opt.zero_grad(set_to_none=True)
    (event,) = events(tmp_path)
    assert (event["culprit"], event["culprit_source"]) == ("<loss>", "loss")
    (finding,) = event["values"]["forensics"]
    assert finding["phase"] == "unavailable" and "kit.note_loss(loss, replay=lambda:" in finding["reason"]


class NormalizedBN(MLPModule):
    """Row normalization (0 / 0 = NaN on a row of zeros) and a BatchNorm, whose running statistics every forward writes
    and a skip puts back, before the MLP; trained with AdamW(fused=True), which skips on device (``found_inf``)."""

    def __init__(self) -> None:
        super().__init__()
        self.normalize = NormalizesRows()
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(self.norm(self.normalize(x)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)


def _counted_step(kit: GradKit, optimizer: torch.optim.Optimizer) -> int:
    """``kit.step(optimizer)``; the host syncs it made."""
    with count_syncs() as counter, counter.active():
        kit.step(optimizer)
    return counter.total


def test_a_fused_optimizers_skip_is_replayed_one_step_late_behind_the_trainer_and_the_loop_door(tmp_path: Path) -> None:
    """Windows of 2 micro-batches; the zero row of batch 3 makes NaN in ``normalize`` at step 1. The fused kernel skips
    step 1 on device; its flag reaches the host in step 2, before step 2's optimizer step, and step 1's micro-batches
    are replayed then. References: the module, operator and line the test planted; a plain torch loop with fused
    AdamW that never saw window 1 (parameters and BatchNorm statistics bitwise: the replay left nothing behind); the
    loop door's clean steps read nothing on the host."""
    mse = nn.functional.mse_loss
    torch.manual_seed(0)
    module = NormalizedBN()
    initial = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = make_trainer(
        tmp_path / "trainer", strategy="gradkit", callbacks=[NonFiniteGuard()], accumulate_grad_batches=2
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, _zero_row_loader())
    (trainer_event,) = events(trainer)

    model = NormalizedBN()
    model.load_state_dict(initial)
    opt = model.configure_optimizers()
    kit = GradKit(model, opt, NonFiniteGuard(), log_dir=tmp_path / "loop")
    syncs: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, (x, y) in enumerate(_zero_row_loader()):
            loss = mse(model(x), y)
            (loss / 2).backward()
            kit.note_loss(loss, replay=lambda x=x, y=y: mse(model(x), y))
            if i % 2 == 0:
                continue
            # Counted: step 1 (the bad one) and step 3. Not step 2, which replays step 1 (the counter's mode would be
            # the innermost frame of the replay), nor step 0, a fused optimizer's first (test_first_step_sync.py).
            step = kit.ctx.step
            if step in (1, 3):
                syncs[step] = _counted_step(kit, opt)
            else:
                kit.step(opt)
            opt.zero_grad(set_to_none=True)
        kit.finish()
    (loop_event,) = events(tmp_path / "loop")
    assert syncs == {1: 0, 3: 0}

    _assert_both_doors_name_normalize(trainer_event, loop_event, "first_step")
    (line,) = [str(w.message) for w in caught if "NonFiniteGuard" in str(w.message)]
    assert "culprit `normalize`: first non-finite value made by `aten.div.Tensor` in the forward of `normalize`" in line

    reference = NormalizedBN()
    reference.load_state_dict(initial)
    reference_opt = reference.configure_optimizers()
    batches = list(_zero_row_loader())
    for window in (0, 2, 3):
        for x, y in batches[2 * window : 2 * window + 2]:
            (mse(reference(x), y) / 2).backward()
        reference_opt.step()
        reference_opt.zero_grad(set_to_none=True)
    assert_same_state(module.state_dict(), reference.state_dict(), "trainer")
    assert_same_state(model.state_dict(), reference.state_dict(), "loop door")


class CountsForwards(nn.Module):
    """A buffer that every training forward increments (a counter a model keeps itself); each forward notes the value
    it saw, replays too (a Python side effect, which a replay repeats)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.seen: list[float] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(float(self.calls))
        if self.training:
            self.calls += 1
        return x


def test_a_late_replay_runs_against_the_buffers_the_bad_step_saw() -> None:
    """Reference: the buffer value the bad step's own forward saw. Step 1 is NaN and skipped on device (its forward
    saw 1 and wrote 2, which the skip puts back); step 2's forward sees 1 and writes 2 before the replay of step 1,
    which must see 1 again, and leave 2."""
    torch.manual_seed(0)
    model = nn.Sequential(CountsForwards(), nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    kit = GradKit(model, opt, NonFiniteGuard(), log_dir=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(4):
            x = torch.randn(8, 4)
            x[0, 0] = float("nan") if step == 1 else x[0, 0]
            loss = model(x).pow(2).mean()
            loss.backward()
            kit.note_loss(loss, replay=lambda x=x: model(x).pow(2).mean())
            kit.step(opt)
            opt.zero_grad(set_to_none=True)
        kit.finish()
    counter = model[0]
    assert counter.seen == [0.0, 1.0, 1.0, 1.0, 2.0]  # steps 0, 1, 2, the replay of step 1 (at step 2), step 3
    assert float(counter.calls) == 3.0 and kit.skipped_steps == 1


class RaisesWhenReplayed(MLPModule):
    """A NaN loss at batch 2, and a ``training_step`` that raises when it sees a batch a second time (a replay)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[int] = set()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if batch_idx in self.seen:
            raise RuntimeError("training_step saw this batch twice")
        self.seen.add(batch_idx)
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx == 2 else loss


def test_guard_reports_a_failed_replay_with_its_error_and_never_as_a_finite_one(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[NonFiniteGuard(action="skip")], max_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(RaisesWhenReplayed(), loader())
    (event,) = events(trainer)
    # Not localized by the replay: the culprit is where the guard saw the value, the loss.
    assert (event["culprit"], event["culprit_source"]) == ("<loss>", "loss")
    error = "RuntimeError: training_step saw this batch twice"
    assert event["values"]["forensics"] == [
        {"culprit": None, "phase": "failed", "error": error, "batch_idx": 2, "rank": 0}
    ]
    (line,) = [str(w.message) for w in caught if "NonFiniteGuard" in str(w.message)]
    why = f"the replay failed: {error}; batch 2, rank 0"
    assert f"culprit `<loss>`: the loss was already non-finite on rank(s) [0] ({why})" in line
    assert "stayed finite" not in line


class RefusesHooks(nn.Linear):
    def register_forward_pre_hook(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this module takes no hooks")


def test_a_model_that_refuses_hooks_gets_no_replay_and_says_why() -> None:
    model = net(RefusesHooks(4, 4))
    ran = []
    finding = find_nonfinite_origin(model, lambda: ran.append(1))
    assert (finding.culprit, finding.phase, ran) == (None, "unavailable", [])
    assert finding.describe() == "no replay: cannot hook the model's modules: RuntimeError: this module takes no hooks"
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())  # none left behind


# -- transient or reproducible -----------------------------------------------------------------------------------
class DictBatchNaN(MLPModule):
    """Dict batches ``{"x", "y", "ids"}``; batch 2's loss is NaN. ``transient``: only the first time the batch is
    computed (a flag flipped at the first occurrence), so the forensic replay computes it finite, as a one-off
    hardware fault would; otherwise every time (a data or model fault)."""

    def __init__(self, transient: bool) -> None:
        super().__init__()
        self.transient = transient
        self.fired = False

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step((batch["x"], batch["y"]), batch_idx)
        if batch_idx == 2 and not (self.transient and self.fired):
            self.fired = True
            return loss * float("nan")
        return loss


def dict_batches() -> DataLoader:
    x, y = loader().dataset.tensors
    batches = [{"x": x[i : i + 8], "y": y[i : i + 8], "ids": torch.arange(i, i + 8) + 1000} for i in range(0, 64, 8)]
    return DataLoader(batches, batch_size=None)


@pytest.mark.parametrize("transient", [False, True], ids=["reproducible", "transient"])
def test_event_says_whether_the_replay_reproduced_the_nan_and_names_the_sample_ids(
    tmp_path: Path, transient: bool
) -> None:
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[NonFiniteGuard(action="skip")], max_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(DictBatchNaN(transient), dict_batches())
    (event,) = events(trainer)
    assert event["batch_idx"] == 2 and event["sample_ids"] == {"0": list(range(1016, 1024))}
    # A replay that stayed finite proves no verdict (the value may come from outside the replayed code): `None`.
    assert event["reproducible"] is (None if transient else True)
    assert event["values"]["replay_reproduced_ranks"] == ([] if transient else [0])
    (line,) = [str(w.message) for w in caught if "NonFiniteGuard" in str(w.message)]
    assert "Sample ids of batch 2: rank 0: [1016, 1017" in line
    if transient:
        assert event["reproducible_reason"].startswith("the replay of training_step and its backward stayed finite")
        assert "Seen on rank(s) [0]; the replay of training_step and its backward stayed finite" in line
        assert "or from non-deterministic hardware" in line
    else:
        assert "made it again on rank(s) [0]" in event["reproducible_reason"]
        assert "reproduced it on rank(s) [0]: a reproducible fault points at the data or the model" in line


class _SampleFault(nn.Module):
    """Makes sample 3 of its input NaN while ``active``."""

    active = False

    def forward(self, x: Tensor) -> Tensor:
        return x.index_fill(0, torch.tensor([3]), math.nan) if self.active else x


class DictRowNaN(MLPModule):
    """Dict batches; with ``poison``, at batch 2 the module ``fault`` (before the encoder) makes sample 3 NaN: a fault
    in one sample's rows, made again by the replay of the batch."""

    def __init__(self, poison: bool) -> None:
        super().__init__()
        self.poison = poison
        self.fault = _SampleFault()

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(self.fault(x))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.fault.active = self.poison and batch_idx == 2
        return super().training_step((batch["x"], batch["y"]), batch_idx)


@pytest.mark.parametrize("where", ["input", "module"])
def test_a_nan_in_one_sample_of_a_dict_batch_names_that_sample_alone(tmp_path: Path, where: str) -> None:
    # Reference: the sample the test poisons (position 3 of batch 2, id 1019), in the batch itself or in the rows a
    # module makes from it; the other 7 ids of the batch are not named.
    batches = list(dict_batches())
    if where == "input":
        batches[2]["x"][3, 0] = math.nan
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[NonFiniteGuard(action="skip")], max_steps=4)
    with pytest.warns(UserWarning, match=r"Sample ids of batch 2: rank 0: \[1019\]"):
        trainer.fit(DictRowNaN(poison=where == "module"), DataLoader(batches, batch_size=None))
    (event,) = events(trainer)
    assert event["batch_idx"] == 2 and event["sample_ids"] == {"0": [1019]}
    assert event["culprit"] == ("<batch>" if where == "input" else "fault")


def test_without_a_replay_the_event_says_reproducible_is_unknown(tmp_path: Path) -> None:
    guard = NonFiniteGuard(action="skip", forensics=False)
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[guard], max_steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(DictBatchNaN(transient=False), dict_batches())
    (event,) = events(trainer)
    assert event["reproducible"] is None and event["sample_ids"] == {"0": list(range(1016, 1024))}
    assert event["reproducible_reason"] == "no replay ran"


class HookNaN(MLPModule):
    """A deterministic fault outside ``training_step`` and its backward: ``on_after_backward`` writes a NaN into the
    head's weight gradient at batch 2, every time the batch is trained."""

    def on_after_backward(self) -> None:
        if self.trainer.fit_loop.epoch_loop.batch_idx == 2:
            assert self.head.weight.grad is not None
            self.head.weight.grad[0, 0] = float("nan")


def test_a_nan_made_outside_the_replayed_code_is_not_called_transient(tmp_path: Path) -> None:
    # The reference: the plain-torch replay the guard does, by hand. `training_step` and its backward for batch 2
    # give finite gradients, yet the NaN is deterministic (the hook makes it every time): "not reproduced" proves
    # nothing about the hardware, so the event says the verdict is unknown and why.
    torch.manual_seed(0)
    reference = HookNaN()
    batches = list(loader())
    for x, y in batches[:2]:
        reference.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        with torch.no_grad():
            for p in reference.parameters():
                p -= 0.1 * p.grad
    reference.zero_grad()
    nn.functional.mse_loss(reference(batches[2][0]), batches[2][1]).backward()
    assert all(torch.isfinite(p.grad).all() for p in reference.parameters())

    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[NonFiniteGuard(action="skip")], max_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(HookNaN(), loader())
    (event,) = events(trainer)
    assert event["batch_idx"] == 2 and event["values"]["grad_nonfinite_ranks"] == [0]
    assert event["values"]["forensics"][0]["phase"] == "not_reproduced"
    assert event["reproducible"] is None
    reason = event["reproducible_reason"]
    assert "the replay of training_step and its backward stayed finite" in reason
    assert "on_after_backward" in reason and "hardware" in reason
    (line,) = [str(w.message) for w in caught if "NonFiniteGuard" in str(w.message)]
    assert "points at the hardware" not in line
    assert "stayed finite" in line and "on_after_backward" in line
