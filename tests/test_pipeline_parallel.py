"""The pipeline-parallel declaration and its refusals, in one process (the 2-process behaviour is
``tests/test_pipeline_parallel_distributed.py``).

The refusals of several ranks are pure functions of what the ranks gathered (each rank's stage tag and layout, the
check's ``[world, 3, C]`` table); their expectations are written out by hand from the rule: every rank declares the
same pipeline, the ranks of one stage train the same parameters, and a rank of another stage (NaN norm and weight in
the table) holds no copy to compare. The declaration itself is read from a real model on a 1-rank gloo group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradkit
from gradkit.step.params import build_param_index
from gradkit.step.pp_stages import declared_pipeline
from gradkit.step.rank_check import layout_mismatch, pipeline_mismatch
from gradkit.step.replicas import replica_mismatch

NAN = float("nan")
PLAIN = ["a plain tensor, so gradkit counts it as one copy held by every rank (as DDP keeps it)"]


def test_pipeline_parallel_refuses_what_is_not_a_stage_module_or_a_group() -> None:
    with pytest.raises(TypeError, match=r"`group` must be a torch.distributed ProcessGroup .* got list \[0, 1\]"):
        gradkit.pipeline_parallel(nn.Linear(2, 2), [0, 1])
    with pytest.raises(TypeError, match=r"`stage_module` must be the nn.Module of this rank's stage, got str 'stage'"):
        gradkit.pipeline_parallel("stage", [0, 1])


def test_pipeline_parallel_takes_a_group_or_its_1d_mesh_and_refuses_a_2d_one(
    one_rank_group: dist.ProcessGroup,
) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with pytest.raises(ValueError, match=r"a 2-D mesh .* pass the pipeline dimension, e.g. `mesh\['pp'\]`"):
        gradkit.pipeline_parallel(nn.Linear(2, 2), init_device_mesh("cpu", (1, 1), mesh_dim_names=("pp", "dp")))
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    gradkit.pipeline_parallel(model, init_device_mesh("cpu", (1,), mesh_dim_names=("pp",)))
    assert isinstance(declared_pipeline(model), dist.ProcessGroup)
    gradkit.pipeline_parallel(model, one_rank_group)
    assert declared_pipeline(model) is one_rank_group
    # One process: nothing to lay out, the index is the one-device one (the hot path unchanged).
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    index = build_param_index(
        opt.param_groups, {id(p): n for n, p in model.named_parameters()}, 1, torch.device("cpu"), model=model
    )
    assert index.pp is None and not index.any_sharded


def test_two_pipelines_declared_in_one_model_are_refused(one_rank_group: dist.ProcessGroup) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    gradkit.pipeline_parallel(model[0], one_rank_group)
    gradkit.pipeline_parallel(model[1], dist.new_group([0]))
    with pytest.raises(ValueError, match=r"2 different pipeline groups are declared .* Declare the rank's stage"):
        declared_pipeline(model)


def test_a_pipeline_declared_on_some_ranks_only_is_refused_naming_them() -> None:
    assert pipeline_mismatch(["stage 0 of 2", "stage 1 of 2"]) is None
    assert pipeline_mismatch(["", ""]) is None
    message = pipeline_mismatch(["stage 0 of 2", ""])
    assert message is not None and "(rank 0: stage 0 of 2; rank 1: none)" in message
    assert "`gradkit.pipeline_parallel(stage_module, pp_group)`" in message and "not declared on ranks [1]" in message
    assert pipeline_mismatch(["stage 0 of 2", "stage 0 of 4"]) is not None


def test_stages_may_differ_but_the_copies_of_one_stage_may_not() -> None:
    emb, head = ["optimizer 0, group 0: emb.weight"], ["optimizer 0, group 0: head.weight"]
    # PP x DP: ranks 0 and 1 hold stage 0, ranks 2 and 3 stage 1; rank 1 built another stage 0.
    tags = ["stage 0 of 2", "stage 0 of 2", "stage 1 of 2", "stage 1 of 2"]
    message = layout_mismatch(tags, [emb, head, head, head])
    assert message.startswith("gradkit: the ranks of pipeline stage 0 of 2 do not train the same parameters")
    assert (
        "position 0: rank 0 has `optimizer 0, group 0: emb.weight`; rank 1 has `optimizer 0, group 0: head" in message
    )
    # Undeclared, the same stages read as one model built differently: the message names the declaration.
    message = layout_mismatch(["", ""], [emb, head])
    assert "Build the same model on every rank" in message
    assert "`gradkit.pipeline_parallel(stage_module, pp_group)`" in message


def test_the_check_of_copies_compares_the_ranks_of_a_stage_only() -> None:
    """One checked parameter of stage 0 on a 2 x 2 (pipeline x data) world: ranks 2 and 3 (stage 1) write NaN as its
    norm and weight. Equal copies on ranks 0 and 1 pass; differing ones name those two ranks only."""

    def table(norms: list[float], weights: list[float]) -> torch.Tensor:
        return torch.tensor([[[n], [0.0], [w]] for n, w in zip(norms, weights, strict=True)])

    held = [0.5, 0.5, NAN, NAN]
    assert replica_mismatch(["blocks.0.fc.weight"], PLAIN, table([0.3, 0.3, NAN, NAN], held)) is None
    message = replica_mismatch(["blocks.0.fc.weight"], PLAIN, table([0.3, 0.1, NAN, NAN], held))
    assert message is not None and "(rank 0 0.3, rank 1 0.1)" in message
    message = replica_mismatch(["w"], PLAIN, table([0.3, 0.3, NAN, NAN], [0.5, 1.0, NAN, NAN]))
    assert message is not None and "(shard weights [0.5, 1.0])" in message
