"""The expert-parallel declaration and the first-step check of copies, in one process (the 4-process behaviour is
``tests/test_expert_parallel_distributed.py``).

The check's comparison is a pure function of the gathered ``[world, 3, C]`` table (norms, piece keys, shard weights
per rank): its expectations here are written out by hand from the rule (copies are ranks with equal keys; their finite
norms agree within 0.1%; every rank has the same weight). The declaration is read from a real model, also after
FSDP2's ``fully_shard`` has put new parameters in place (on a 1-rank gloo group).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradkit
import lightning_gradkit
from gradkit.step.params import build_param_index
from gradkit.step.replicas import declared_groups, replica_mismatch


def table(norms: list[float], keys: list[float], weights: list[float] | None = None) -> torch.Tensor:
    """The gathered table of one checked parameter held by ``len(norms)`` ranks."""
    weights = weights if weights is not None else [0.0] * len(norms)
    return torch.tensor([[[n], [k], [w]] for n, k, w in zip(norms, keys, weights, strict=True)])


PLAIN = ["a plain tensor, so gradkit counts it as one copy held by every rank (as DDP keeps it)"]


def test_copies_within_a_thousandth_pass_and_differing_ones_name_the_parameter_ranks_and_fix() -> None:
    # DDP leaves copies bitwise equal; tensor-parallel ranks computing a LayerNorm's gradient apart, 1e-6 apart.
    assert replica_mismatch(["ln.weight"], PLAIN, table([2.0, 2.0, 2.0 * (1 + 1e-6), 2.0], [0, 0, 0, 0])) is None
    message = replica_mismatch(["moe.w_in"], PLAIN, table([0.19, 0.04, 0.19, 0.04], [0, 0, 0, 0]))
    assert message is not None
    assert "`moe.w_in`" in message and "rank 0 0.19, rank 1 0.04, rank 2 0.19, rank 3 0.04" in message
    assert "gradkit.expert_parallel(module, group)" in message and "a plain tensor" in message


def test_copies_left_unreduced_over_context_parallel_ranks_are_refused_with_the_cp_fix() -> None:
    """Context parallelism gives each cp rank the gradient of its part of the sequence; FSDP2 over ``mesh["dp"]``
    alone (a DTensor on a sub-mesh) or no reduction (a plain tensor) leaves the cp copies apart. The GPU run under
    torch's ring attention is ``tests/test_context_parallel_gpu.py``; here the norms of its two ranks, by hand."""
    sub_mesh = "a DTensor on a device mesh of 1 of the 2 ranks, so gradkit counts the ranks of the other meshes ..."
    for assumed in (sub_mesh, PLAIN[0]):
        message = replica_mismatch(["tok.weight"], [assumed], table([0.152178, 0.138075], [0, 0]))
        assert message is not None and "rank 0 0.152178, rank 1 0.138075" in message
        assert "Under context parallelism" in message and "mesh['dp', 'cp']._flatten('dp_shard_cp')" in message
        assert "DDP over the cp group" in message


def test_only_ranks_with_the_same_piece_key_are_compared() -> None:
    # Expert-parallel ranks 0 and 1 hold different experts (keys 0 and 1); their data-parallel copies (2 and 3) agree.
    declared = ["declared expert-parallel over a group of 2 ranks, so gradkit counts the ranks ..."]
    assert replica_mismatch(["w_in"], declared, table([0.19, 0.04, 0.19, 0.04], [0, 1, 0, 1])) is None
    # A copy that was not all-reduced over the expert-data-parallel group: the fix says so.
    message = replica_mismatch(["w_in"], declared, table([0.19, 0.04, 0.21, 0.04], [0, 1, 0, 1]))
    assert message is not None and "rank 0 0.19, rank 2 0.21" in message and "rank 1" not in message
    assert "expert-data-parallel group" in message


def test_non_finite_norms_and_zero_gradients_are_left_alone() -> None:
    # A NaN on one rank is the guards' matter; all-zero copies (an expert without tokens anywhere) agree.
    assert replica_mismatch(["w"], PLAIN, table([1.0, float("nan"), 1.0, float("inf")], [0, 0, 0, 0])) is None
    assert replica_mismatch(["w"], PLAIN, table([0.0, 0.0], [0, 0])) is None
    # A rank with a gradient beside one without (an undeclared expert that got no token there) differs.
    assert replica_mismatch(["w"], PLAIN, table([0.3, 0.0], [0, 0])) is not None


def test_a_declaration_on_some_ranks_only_is_refused() -> None:
    message = replica_mismatch(["w"], PLAIN, table([1.0, 1.0], [0, 0], weights=[0.5, 0.0]))
    assert message is not None and "on some ranks only" in message and "[0.0, 0.5]" in message


def test_expert_parallel_is_exported_by_both_roots_and_refuses_what_is_not_a_group() -> None:
    assert lightning_gradkit.expert_parallel is gradkit.expert_parallel
    with pytest.raises(TypeError, match=r"`group` must be a torch.distributed ProcessGroup .* got list \[0, 1\]"):
        gradkit.expert_parallel(nn.Linear(2, 2), [0, 1])


def test_a_module_declaration_covers_the_parameters_fsdp2_puts_in_place(one_rank_group: dist.ProcessGroup) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 2))
    gradkit.expert_parallel(model[1], one_rank_group)
    gradkit.expert_parallel(model[0].bias, one_rank_group)
    before = {id(p) for p in model[1].parameters()} | {id(model[0].bias)}
    assert set(declared_groups(model)) == before
    fully_shard(model[1], mesh=init_device_mesh("cpu", (1,)))
    after = declared_groups(model)
    assert {id(p) for p in model[1].parameters()} <= set(after)  # the new DTensor parameters
    assert all(hasattr(p, "placements") for p in model[1].parameters())
    # One process: nothing is reduced, the declaration changes nothing of the index (the one-device hot path).
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    index = build_param_index(opt.param_groups, names, 1, torch.device("cpu"), model=model)
    assert index.replica_check is None and index.sharded_positions == [2, 3]  # FSDP2's own shards only


def test_expert_parallel_refuses_a_2d_mesh_and_items_that_are_not_modules(one_rank_group: dist.ProcessGroup) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with pytest.raises(ValueError, match=r"a 2-D mesh .* pass the dimension over which the experts differ"):
        gradkit.expert_parallel(nn.Linear(2, 2), init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "ep")))
    with pytest.raises(TypeError, match=r"takes modules and parameters, got str 'experts'"):
        gradkit.expert_parallel(["experts"], one_rank_group)
    with pytest.raises(ValueError, match=r"`modules_or_params` is empty"):
        gradkit.expert_parallel([], one_rank_group)
