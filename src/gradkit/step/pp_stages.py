"""Pipeline parallelism: each rank trains one stage of the model, other parameters than its peers'.

A pipeline stage (``torch.distributed.pipelining``: the embedding and the first blocks on one rank, the last blocks
and the head on the next) holds parameters no other stage has. Its own gradient norm is not the model's: each stage
would clip by another factor (0.54-0.83x the global norm, measured), and an undeclared split into differently shaped
stages reads as ranks that built different models. Nothing in the parameters says which ranks are stages of one
pipeline (a plain tensor looks the same on every rank), so the loop declares it with :func:`pipeline_parallel`.

Declared, each stage's per-parameter norms take their own columns of one every-stage vector, in stage order
(:class:`PipelineStages`, laid out once per parameter index by a gather of names over the pipeline group): a rank
writes the p-th powers of its stage's norms into its columns, zeros elsewhere, weighted by one over the ranks that
hold the stage (its data-parallel copies), and the engine's one all-reduce per step sums them
(:func:`~gradkit.step.norms.reduce_sharded`). Every rank then holds every stage's norms: the total norm is
torchtitan's ``clip_grad_norm_(..., pp_mesh=...)`` (the p-th powers summed over the stages), the per-module rows and
the non-finite flags are those of one process holding the whole model, and the clip coefficient and every skip are
computed from the same reduced vector on every stage, so they are bitwise the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from gradkit.step.host_lag import host_to_device
from gradkit.step.replicas import mesh_group

__all__ = ["PipelineStages", "declared_pipeline", "pipeline_parallel", "pipeline_stages", "ranks_per_stage"]

# Where `pipeline_parallel` writes the stage's pipeline group, on the module (it survives FSDP2's `fully_shard` and
# DDP, which keep the module object).
_ATTRIBUTE = "_gradkit_pipeline_group"


def pipeline_parallel(stage_module: nn.Module, group: dist.ProcessGroup | DeviceMesh) -> None:
    """Declare that ``stage_module`` is this rank's stage of a pipeline whose stages are the ranks of ``group``.

    Under pipeline parallelism (``torch.distributed.pipelining``) each rank trains a stage, parameters no other stage
    has (an embedding and the first blocks on one rank, the last blocks and the head on the next). Undeclared, a
    rank's gradient norm is its own stage's, so each stage would clip by its own factor; gradkit cannot tell a stage
    from a model built differently by mistake, so it refuses ranks that train other parameters when the door starts,
    and stages of the same shapes at the first step. Declared, the per-parameter norms of every stage travel in the
    engine's one all-reduce per step: the total, per-module and per-param-group norms, every clipper's decision and
    every skip are those of one process holding the whole model, and the same on every stage (a NaN on one stage
    skips the step on all of them). ``GradNormMonitor`` logs every stage's rows on every rank: log from one rank.

    Call it on every rank, before the door starts (``GradKit(...)``), with the module the rank's optimizer trains.
    Data parallelism inside a stage (``DistributedDataParallel`` or ``fully_shard`` over the stage's data-parallel
    ranks) is counted once; the world must be ``group`` size times the ranks of each stage.

    Args:
        stage_module: the module that holds this rank's stage (its parameters are the ones the rank's optimizer
            steps; keep the whole model's names, as a stage cut from the model does, so that the rows read as one
            model's; names that repeat across stages are told apart as ``stage<k>.<name>``).
        group: the process group (or 1-D ``DeviceMesh``) that holds one rank of every stage, in stage order: the
            group your ``PipelineStage`` was given (``mesh["pp"]``).

    Raises:
        TypeError: if ``stage_module`` is not a module, or ``group`` is not a process group or 1-D mesh.
        ValueError: if ``group`` does not hold this rank.

    Example::

        stage = PipelineStage(stage_module, pp_rank, pp_size, device, group=pp_group)
        schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
        gradkit.pipeline_parallel(stage_module, pp_group)
        kit = gradkit.GradKit(stage_module, optimizer, [GradNormMonitor(), ClipGradNorm(1.0), NonFiniteGuard()])
        ...
        schedule.step(x) if first else schedule.step(target=y)   # forward and backward of every micro-batch
        kit.step(optimizer)                                      # the whole model's norm, the same on every stage
    """
    if not isinstance(stage_module, nn.Module):
        raise TypeError(
            f"`stage_module` must be the nn.Module of this rank's stage, got {type(stage_module).__name__} "
            f"{stage_module!r}: pass the module you gave `PipelineStage` (not the stage object)."
        )
    group = mesh_group(
        group,
        "the pipeline dimension, e.g. `mesh['pp']`",
        "the pipeline group (one rank per stage, the one your `PipelineStage` was given)",
        "`init_device_mesh(...)['pp'].get_group()` or `dist.new_group(ranks)`",
    )
    setattr(stage_module, _ATTRIBUTE, group)


def declared_pipeline(model: nn.Module | None) -> dist.ProcessGroup | None:
    """The pipeline group declared by :func:`pipeline_parallel` on ``model`` or one of its modules, ``None`` if none.

    Raises:
        ValueError: if modules of ``model`` declare different groups.
    """
    if model is None:
        return None
    groups = {id(g): g for g in (m.__dict__.get(_ATTRIBUTE) for m in model.modules()) if g is not None}
    if len(groups) > 1:
        raise ValueError(
            f"{len(groups)} different pipeline groups are declared with `gradkit.pipeline_parallel` on modules of "
            f"`{type(model).__name__}`: a rank trains one stage of one pipeline. Declare the rank's stage module once."
        )
    return next(iter(groups.values()), None)


def ranks_per_stage(group: dist.ProcessGroup, world: int) -> int:
    """How many ranks hold each stage: the world over the pipeline's stages (its data-parallel copies).

    Raises:
        ValueError: if the stages do not divide the world.
    """
    stages = dist.get_world_size(group)
    if world % stages:
        raise ValueError(
            f"The pipeline group declared with `gradkit.pipeline_parallel` has {stages} stages, which does not "
            f"divide the world of {world} ranks: every stage must be held by the same number of ranks. Build the "
            "pipeline group as one dimension of a world-sized mesh (`init_device_mesh(..., (pp, dp))`)."
        )
    return world // stages


@dataclass(eq=False)
class PipelineStages:
    """Where each stage's parameters sit in the every-stage vector of norms, and what its columns are called.

    Attributes:
        group: the pipeline group; stage: this rank's stage (its rank in ``group``).
        offset: the first column of this stage; width: this stage's parameters; count: every stage's.
        names: every stage's parameter names, in stage order (the columns).
        group_index, num_groups: the param group of every column (each stage's optimizer numbers its own groups;
            group ``g`` is group ``g`` of every stage).
        check_offset, check_names, check_assumed: the columns of the first-step check of copies
            (:class:`~gradkit.step.replicas.ReplicaCheck`): this stage's first one, and every stage's, named.
        module_names, module_index: the per-module rows over the columns (set by the index; ``None`` at depth 0).
    """

    group: dist.ProcessGroup
    stage: int
    offset: int
    width: int
    count: int
    names: list[str]
    group_index: Tensor
    num_groups: int
    check_offset: int
    check_names: list[str]
    check_assumed: list[str]
    module_names: list[str] = field(default_factory=list)
    module_index: Tensor | None = None

    def spread(self, local: Tensor) -> Tensor:
        """This stage's ``[width]`` values in their columns of a ``[count]`` vector of zeros (one op)."""
        return torch.nn.functional.pad(local, (self.offset, self.count - self.offset - self.width))

    def local(self, every: Tensor) -> Tensor:
        """This stage's columns of an every-stage vector (a view)."""
        return every[self.offset : self.offset + self.width]


@dataclass(frozen=True)
class _StageInfo:
    """What one stage tells the others, once per parameter index."""

    names: list[str]
    groups: list[int]
    num_groups: int
    check_names: list[str]
    check_assumed: list[str]


def _repeated(infos: Sequence[_StageInfo]) -> bool:
    """Whether a name repeats across stages: stages cut from one model keep its names (unique), stages built from
    separate classes may not (``fc.weight`` on two); then every name is told apart as ``stage<k>.<name>``."""
    seen: set[str] = set()
    for info in infos:
        if seen & set(info.names):
            return True
        seen.update(info.names)
    return False


def pipeline_stages(
    group: dist.ProcessGroup,
    names: Sequence[str],
    groups: Sequence[int],
    num_groups: int,
    checked: tuple[Sequence[str], Sequence[str]],
    device: torch.device,
) -> PipelineStages:
    """The layout of one stage's parameter index among every stage's. Collective over ``group``: one
    ``all_gather_object`` of the names, once per index (every stage builds its index at the same step).

    Args:
        group: the declared pipeline group.
        names, groups, num_groups: this stage's parameter names and param groups, in index order.
        checked: the names of this stage's parameters that the first-step check compares, and what is assumed of
            each (:func:`~gradkit.step.replicas.replica_check`).
        device: where the index tensors live.
    """
    mine = _StageInfo(list(names), list(groups), num_groups, list(checked[0]), list(checked[1]))
    infos: list[_StageInfo | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(infos, mine, group=group)
    stages = [info for info in infos if info is not None]
    stage = dist.get_rank(group)
    repeated = _repeated(stages)
    tag = [f"stage{k}." if repeated else "" for k in range(len(stages))]
    columns = [tag[k] + n for k, info in enumerate(stages) for n in info.names]
    return PipelineStages(
        group=group,
        stage=stage,
        offset=sum(len(info.names) for info in stages[:stage]),
        width=len(names),
        count=len(columns),
        names=columns,
        group_index=host_to_device([g for info in stages for g in info.groups], torch.long, device),
        num_groups=max(info.num_groups for info in stages),
        check_offset=sum(len(info.check_names) for info in stages[:stage]),
        check_names=[tag[k] + n for k, info in enumerate(stages) for n in info.check_names],
        check_assumed=[a for info in stages for a in info.check_assumed],
    )
