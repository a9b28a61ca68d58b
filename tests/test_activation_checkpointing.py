"""Activation checkpointing mechanics without the Trainer: selection, injection, measurement, planner."""

from __future__ import annotations

import copy
import itertools
import pickle
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_gradkit import ActivationCheckpointing, inject_activation_checkpointing
from lightning_gradkit.activation_checkpointing.injection import (
    bypass_checkpointing,
    injected_mode,
    remove,
    select_modules,
)
from lightning_gradkit.activation_checkpointing.planner import measure_saved_activations, plan_checkpointing
from lightning_gradkit.demos import Block, GPTConfig, TinyGPT

CONFIG = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=32, dropout=0.1)


def tiny_gpt(n_layer: int = 4) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(GPTConfig(**{**CONFIG.__dict__, "n_layer": n_layer}))


def tokens(batch: int = 4, seed: int = 1) -> Tensor:
    return torch.randint(0, 256, (batch, CONFIG.block_size), generator=torch.Generator().manual_seed(seed))


def loss_of(model: nn.Module, idx: Tensor) -> Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), idx.roll(-1, 1).reshape(-1))


def gradients(model: nn.Module, idx: Tensor, seed: int = 7) -> dict[str, Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the dropout masks
    loss_of(model, idx).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


class LiveStorages(TorchDispatchMode):
    """Independent reference: every storage an op creates during the forward, by weak reference. What is still
    alive once the forward returned (minus its output) is what the graph keeps for backward, whatever keeps it
    (autograd's saved tensors, a checkpoint's inputs, a selective-checkpoint cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                self.refs.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
        return out


def live_activation_bytes(forward: Callable[[], Tensor], model: nn.Module, inputs: Sequence[Tensor] = ()) -> int:
    mode = LiveStorages()
    with mode:
        out = forward()
    # the output, the parameters and the inputs (which ops like `t()`/`view()` return views of) are not activations
    skip = {StorageWeakRef(t.untyped_storage()).cdata for t in (out, *model.parameters(), *inputs)}
    alive = sum(n for key, (ref, n) in mode.refs.items() if not ref.expired() and key not in skip)
    del out
    return alive


# --------------------------------------------------------------------------------------------------------------
# Selection


def test_targets_select_by_class_name_dotted_class_path_and_whole_name_regex() -> None:
    model = tiny_gpt()
    blocks = [f"blocks.{i}" for i in range(4)]
    assert [n for n, _ in select_modules(model, ["Block"])] == blocks
    assert [n for n, _ in select_modules(model, ["lightning_gradkit.demos.Block"])] == blocks
    assert [n for n, _ in select_modules(model, [r"re:blocks\.[02]"])] == ["blocks.0", "blocks.2"]
    # fullmatch: a regex matching only a prefix of a name selects nothing there
    assert select_modules(model, [r"re:blocks\.1\.ml"]) == []
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32), num_layers=3, enable_nested_tensor=False)
    assert [n for n, _ in select_modules(encoder, ["torch.nn.TransformerEncoderLayer"])] == [
        "layers.0",
        "layers.1",
        "layers.2",
    ]


def test_subclasses_match_their_base_class_name() -> None:
    class MyBlock(Block):
        pass

    model = nn.Sequential(MyBlock(CONFIG), nn.Linear(32, 32), Block(CONFIG))
    assert [n for n, _ in select_modules(model, ["Block"])] == ["0", "2"]


def test_every_n_keeps_the_nth_2nth_matches_and_nested_matches_keep_the_outermost() -> None:
    model = tiny_gpt(n_layer=6)
    assert [n for n, _ in select_modules(model, ["Block"], every_n=2)] == ["blocks.1", "blocks.3", "blocks.5"]
    assert [n for n, _ in select_modules(model, ["Block"], every_n=3)] == ["blocks.2", "blocks.5"]
    # MLP lives inside Block: only the blocks are kept
    assert [n for n, _ in select_modules(model, ["MLP", "Block"])] == [f"blocks.{i}" for i in range(6)]
    assert [n for n, _ in select_modules(model, ["MLP"])] == [f"blocks.{i}.mlp" for i in range(6)]


def test_selection_names_ignore_torch_compile_and_checkpoint_wrapper_components() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    outer = nn.Module()
    outer.model = torch.compile(tiny_gpt(n_layer=2))
    selected = select_modules(outer, [r"re:model\.blocks\.\d"])
    assert [n for n, _ in selected] == ["model.blocks.0", "model.blocks.1"]
    assert all(type(m) is Block for _, m in selected)
    gpt = tiny_gpt(n_layer=2)
    gpt.blocks[1] = checkpoint_wrapper(gpt.blocks[1])
    assert [n for n, _ in select_modules(gpt, [r"re:blocks\.\d"])] == ["blocks.0", "blocks.1"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_n": 0}, "every_n"),
        ({"every_n": True}, "every_n"),
        ({"mode": "partial"}, "mode"),
        ({"memory_budget": 0}, "memory_budget"),
        ({"memory_budget": -0.5}, "memory_budget"),
        ({"memory_budget": 1.5}, "memory_budget"),
        ({"memory_budget": True}, "memory_budget"),
        ({"memory_budget": 0.5, "every_n": 2}, "conflicts"),
        ({"memory_budget": 0.5, "measure": False}, "measure"),
        ({"targets": []}, "targets"),
        ({"targets": ["re:blocks.("]}, "regular expression"),
    ],
)
def test_invalid_arguments_raise_value_error_naming_the_argument(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ActivationCheckpointing(**{"targets": ["Block"], **kwargs})


def test_memory_budget_accepts_fractions_and_whole_bytes() -> None:
    assert ActivationCheckpointing(["Block"], memory_budget=1).memory_budget == 1
    assert ActivationCheckpointing(["Block"], memory_budget=0.25).memory_budget == 0.25
    assert ActivationCheckpointing(["Block"], memory_budget=2_000_000).memory_budget == 2_000_000


# --------------------------------------------------------------------------------------------------------------
# Injection


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_injected_gradients_equal_plain_gradients_with_dropout(mode: str) -> None:
    idx = tokens()
    reference = gradients(tiny_gpt(), idx)
    model = tiny_gpt()
    assert inject_activation_checkpointing(model, ["Block"], mode=mode) == [f"blocks.{i}" for i in range(4)]
    got = gradients(model, idx)
    for name, grad in reference.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=1e-6, msg=name)
    # non-vacuous: dropout changes the gradients, so the recompute must have replayed the same masks ...
    other_masks = gradients(tiny_gpt(), idx, seed=8)
    assert not torch.allclose(other_masks["blocks.0.mlp.fc.weight"], reference["blocks.0.mlp.fc.weight"])
    # ... and the injected blocks really keep fewer activations
    plain = tiny_gpt()
    assert measure(model, idx) < measure(plain, idx)


def measure(model: nn.Module, idx: Tensor) -> int:
    return live_activation_bytes(lambda: loss_of(model, idx), model)


def test_state_dict_and_parameter_names_are_unchanged_and_load_both_ways() -> None:
    plain, injected = tiny_gpt(), tiny_gpt()
    inject_activation_checkpointing(injected, ["Block"])
    assert list(injected.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in injected.named_parameters()] == [n for n, _ in plain.named_parameters()]
    with torch.no_grad():
        for p in injected.parameters():
            p.add_(1.0)
    plain.load_state_dict(injected.state_dict(), strict=True)  # injected -> plain
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), injected.parameters(), strict=True))
    fresh = tiny_gpt()
    inject_activation_checkpointing(fresh, ["Block"])
    fresh.load_state_dict(tiny_gpt().state_dict(), strict=True)  # plain -> injected
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), tiny_gpt().parameters(), strict=True))


def test_second_application_warns_and_does_not_double_wrap() -> None:
    model = tiny_gpt(n_layer=2)
    inject_activation_checkpointing(model, ["Block"])
    forward = model.blocks[0].forward
    with pytest.warns(UserWarning, match=r"already checkpointed.*blocks\.0 \(lightning_gradkit\)"):
        assert inject_activation_checkpointing(model, ["Block"]) == []
    assert model.blocks[0].forward is forward
    assert forward.original is None  # the class forward underneath, not another checkpointed one


def test_modules_checkpointed_by_torch_apis_are_left_alone_with_a_warning() -> None:
    from torch.distributed._composable import checkpoint as composable_checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = tiny_gpt(n_layer=3)
    model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    composable_checkpoint(model.blocks[1])
    with pytest.warns(UserWarning, match=r"blocks\.0 \(checkpoint_wrapper\).*blocks\.1 \(torch\.distributed"):
        assert inject_activation_checkpointing(model, ["Block"]) == ["blocks.2"]
    assert injected_mode(model.blocks[0]._checkpoint_wrapped_module) is None
    assert injected_mode(model.blocks[1]) is None


def test_targets_matching_nothing_list_the_module_classes() -> None:
    with pytest.raises(ValueError, match=r"match no submodule.*Block, CausalSelfAttention, Dropout, Embedding"):
        inject_activation_checkpointing(tiny_gpt(), ["TransformerBlock"])


def test_deepcopy_and_pickle_bind_the_copy_and_remove_restores_the_class_forward() -> None:
    model = tiny_gpt(n_layer=2)
    inject_activation_checkpointing(model, ["Block"])
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert clone.blocks[0].forward.module is clone.blocks[0]
        with torch.no_grad():
            clone.blocks[0].ln_1.weight.mul_(0)  # the copy's parameters drive the copy's output
        assert not torch.equal(clone(tokens()), model(tokens()))
    assert remove(model.blocks[0])
    assert "forward" not in model.blocks[0].__dict__
    assert not remove(model.blocks[0])


def test_keyword_arguments_reach_the_module() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: Tensor, scale: float = 1.0, debug: bool = False) -> Tensor:
            return self.lin(x).tanh() * scale + float(debug)

    model = nn.Sequential(Scaled())
    x = torch.randn(2, 4, requires_grad=True)
    expected = model[0](x, scale=3.0, debug=True)
    inject_activation_checkpointing(model, ["Scaled"])
    torch.testing.assert_close(model[0](x, scale=3.0, debug=True), expected)


def test_torch_compile_after_injection_keeps_checkpointing_and_gradients() -> None:
    idx = tokens(batch=2)
    reference = gradients(tiny_gpt(n_layer=2), idx)
    model = tiny_gpt(n_layer=2)
    inject_activation_checkpointing(model, ["Block"])
    compiled = torch.compile(model, backend="aot_eager")
    got = {name.removeprefix("_orig_mod."): grad for name, grad in gradients(compiled, idx).items()}
    for name, grad in reference.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=1e-6, msg=name)

    # Compiled graphs save through autograd.Function contexts, so saved-tensor hooks see all they keep.
    def saved_bytes(m: nn.Module) -> int:
        return measure_saved_activations(lambda: loss_of(m, idx), m).held()

    plain = torch.compile(tiny_gpt(n_layer=2), backend="aot_eager")
    assert saved_bytes(compiled) < 0.5 * saved_bytes(plain)


# --------------------------------------------------------------------------------------------------------------
# Measurement and planner


@pytest.mark.parametrize("mode", [None, "full", "selective"])
def test_measured_saved_bytes_equal_the_live_storage_reference(mode: str | None) -> None:
    model, idx = tiny_gpt(), tokens()
    blocks = select_modules(model, ["Block"])
    if mode is not None:
        inject_activation_checkpointing(model, ["Block"], mode=mode)
    profile = measure_saved_activations(
        lambda: loss_of(model, idx), model, blocks if mode else [], selective=mode == "selective", exclude=[idx]
    )
    assert profile.held(range(len(profile.names))) == live_activation_bytes(lambda: loss_of(model, idx), model)


def test_full_mode_cuts_saved_activation_bytes_by_at_least_60_percent() -> None:
    model, idx = tiny_gpt(), tokens(batch=8)
    before = live_activation_bytes(lambda: loss_of(model, idx), model)
    inject_activation_checkpointing(model, ["Block"])
    after = live_activation_bytes(lambda: loss_of(model, idx), model)
    assert after <= 0.4 * before


@pytest.mark.parametrize(("mode", "fraction"), [("full", 0.5), ("selective", 0.7)])
def test_budget_plan_is_the_smallest_selection_that_fits_and_the_measured_result_fits(
    mode: str, fraction: float
) -> None:
    model, idx = tiny_gpt(n_layer=3), tokens(batch=8)
    blocks = select_modules(model, ["Block"])
    before = measure_saved_activations(
        lambda: loss_of(model, idx), model, blocks, selective=mode == "selective", exclude=[idx]
    )
    budget = int(fraction * before.held())
    chosen, met = plan_checkpointing(before, budget)
    assert met
    # Reference: the real saved bytes of every subset, by brute force, with checkpointing actually applied.
    fitting_sizes = []
    for size in range(len(blocks) + 1):
        for subset in itertools.combinations(range(len(blocks)), size):
            for i in subset:
                inject_activation_checkpointing(model, [rf"re:blocks\.{i}"], mode=mode)
            if live_activation_bytes(lambda: loss_of(model, idx), model) <= budget:
                fitting_sizes.append(size)
            for _, block in blocks:
                remove(block)
    assert len(chosen) == min(fitting_sizes) > 0
    for i in chosen:
        inject_activation_checkpointing(model, [rf"re:blocks\.{i}"], mode=mode)
    assert live_activation_bytes(lambda: loss_of(model, idx), model) <= budget


def test_baseline_measurement_bypasses_injected_modules_and_keeps_nothing() -> None:
    model, idx = tiny_gpt(), tokens()
    plain = measure_saved_activations(lambda: loss_of(model, idx), model, exclude=[idx]).held()
    inject_activation_checkpointing(model, ["Block"])
    with bypass_checkpointing():
        bypassed = measure_saved_activations(lambda: loss_of(model, idx), model, exclude=[idx]).held()
    assert bypassed == plain
    # the measurement itself keeps nothing alive: nothing is left once the forward returned
    keeps = live_activation_bytes(
        lambda: (measure_saved_activations(lambda: loss_of(model, idx), model), torch.zeros(1))[1], model
    )
    assert keeps == 0
