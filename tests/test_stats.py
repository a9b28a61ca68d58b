"""GradStats math against independent references (torch.nn.utils and plain loops)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gradkit._util.arguments import validate_norm_type
from gradkit.step.norms import derive_stats, grouped_norms, per_tensor_norms
from gradkit.step.params import build_param_index, clean_name, module_key

NORMS = [1.0, 2.0, 3.0, math.inf]


@pytest.mark.parametrize("p", NORMS)
def test_per_tensor_norms_match_torch_linalg_across_dtype_groups(p: float) -> None:
    tensors = [torch.randn(5, 3), torch.randn(7).double(), torch.randn(4, 2).bfloat16(), torch.randn(3)]
    # Order by (device, dtype) as the engine does; per_tensor_norms handles consecutive runs.
    tensors.sort(key=lambda t: str(t.dtype))
    got = per_tensor_norms(tensors, p)
    expected = torch.stack([torch.linalg.vector_norm(t.float(), p) for t in tensors])
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def test_inf_norm_propagates_nan_and_inf_and_sign_like_linalg() -> None:
    # On CPU the inf-norm takes the aminmax route; it must agree with vector_norm on signs, NaN, Inf and empties.
    tensors = [
        torch.tensor([-3.0, -1.0]),
        torch.tensor([0.5, float("nan"), 9.0]),
        torch.tensor([[1.0, -math.inf]]),
        torch.zeros(0),
        torch.tensor([-2.0, 1.0]).bfloat16(),
    ]
    got = per_tensor_norms(tensors, math.inf)
    expected = [torch.linalg.vector_norm(t.float(), math.inf) if t.numel() else torch.tensor(0.0) for t in tensors]
    torch.testing.assert_close(got, torch.stack(expected), equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("p", NORMS)
def test_derived_total_and_module_norms_match_reference(p: float) -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 2)))
    model(torch.randn(3, 4)).pow(2).sum().backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = {id(q): n for n, q in model.named_parameters()}
    index = build_param_index(opt.param_groups, names, depth=1, device=torch.device("cpu"))
    norms = per_tensor_norms([q.grad for q in index.params], p)
    stats = derive_stats(index, norms, p, missing=[])

    grads = [q.grad for q in model.parameters()]
    torch.testing.assert_close(stats.total, torch.nn.utils.get_total_norm(grads, p), rtol=1e-6, atol=0)
    assert stats.module_names == ["0", "2"]
    for i, prefix in enumerate(stats.module_names):
        ref = torch.nn.utils.get_total_norm([q.grad for n, q in model.named_parameters() if n.startswith(prefix)], p)
        torch.testing.assert_close(stats.module_norms[i], ref, rtol=1e-6, atol=0)
    assert bool(stats.finite)


def test_non_finite_gradient_clears_finite_flag() -> None:
    norms = torch.tensor([1.0, float("nan"), 2.0])
    assert torch.isnan(grouped_norms(norms, torch.tensor([0, 0, 1]), 2, 2.0)[0])
    assert not torch.isfinite(grouped_norms(torch.tensor([1.0, math.inf]), torch.tensor([0, 0]), 1, 2.0)[0])


def test_module_key_and_clean_name() -> None:
    assert module_key("encoder.layer.3.attn.q.weight", 3) == "encoder.layer.3"
    assert module_key("head.weight", 2) == "head"
    assert module_key("scale", 1) == "<root>"
    assert clean_name("_fsdp_wrapped_module.blocks.0._checkpoint_wrapped_module.fc.weight") == "blocks.0.fc.weight"


@pytest.mark.parametrize("bad", [0.5, 0.0, -1.0, float("nan"), -math.inf])
def test_invalid_norm_type_names_the_argument(bad: float) -> None:
    with pytest.raises(ValueError, match="norm_type"):
        validate_norm_type(bad)
