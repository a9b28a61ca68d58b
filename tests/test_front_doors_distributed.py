"""The three front doors on 2 CPU processes (gloo), under DDP and under FSDP2: the Trainer (``"gradkit_ddp"``,
``GradKitModelParallelStrategy`` with ``fully_shard`` in ``configure_model``), Fabric (``"ddp"``, Fabric's
``ModelParallelStrategy(parallelize_fn=...)``) and a plain loop (``DistributedDataParallel``, ``fully_shard``) give,
on every rank, the same parameters, BatchNorm buffers, logged norms and skip decisions, bitwise; with a NaN on rank 1
only, both ranks skip that step.

The independent reference is a single-process plain loop over the global batches without the NaN step:
``clip_grad_norm_`` on the mean of the two ranks' gradients, each rank's half batch through BatchNorm with its own
batch statistics (neither DDP nor FSDP2 synchronizes them), from rank 0's running statistics under DDP (which
broadcasts them each forward) and from the rank's own under FSDP2.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from helpers import run_processes
from lightning_gradkit import ClipGradNorm, GradNormMonitor, NonFiniteGuard, SpikeRollback, ZClip
from test_front_doors import Net, _initial_state, _optimizer

pytestmark = pytest.mark.distributed

WORLD = 2
STEPS = 8
NAN_STEP = 4
NAN_RANK = 1
MAX_NORM = 4.0
#: (parallelism, clipper, optimizer): under DDP SGD with momentum and an ordinary skip, and Adam fused with the skip
#: through ``found_inf``; under FSDP2 SGD.
CASES = (("ddp", "norm", "sgd"), ("ddp", "zclip", "adam_fused"), ("fsdp2", "norm", "sgd"))
#: SpikeRollback under DDP: a loss spike on both ranks for ``len(SPIKE)`` steps (no NaN), rolled back.
ROLLBACK_CASE = ("ddp", "rollback", "sgd")
SPIKE = (4, 5, 6)
DOORS = ("trainer", "fabric", "plain")


def global_batches() -> list[tuple[Tensor, Tensor]]:
    """``STEPS`` global batches of 8 samples, without the NaN; every fourth one with 5x larger targets (a gradient
    spike: ZClip clips there, ``ClipGradNorm`` on some other steps too)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(STEPS):
        x = torch.randn(4 * WORLD, 8, generator=g)
        out.append((x, torch.randn(4 * WORLD, 1, generator=g) * (1.0 + 4.0 * (i % 4 == 3))))
    return out


def rank_batches(rank: int, clipper: str = "norm") -> list[tuple[Tensor, Tensor]]:
    """Rank ``r``'s share of every global batch (samples ``4r .. 4r + 3``), with a NaN input on rank 1 at
    ``NAN_STEP``; for the rollback case instead, 30x larger inputs and targets on both ranks at the ``SPIKE`` steps."""
    out = []
    for i, (x, y) in enumerate(global_batches()):
        x, y = x[4 * rank : 4 * rank + 4].clone(), y[4 * rank : 4 * rank + 4].clone()
        if clipper == "rollback":
            x, y = (x * 30.0, y * 30.0) if i in SPIKE else (x, y)
        elif i == NAN_STEP and rank == NAN_RANK:
            x[1, 2] = math.nan
        out.append((x, y))
    return out


def policies(clipper: str) -> list[Any]:
    if clipper == "rollback":
        rollback = SpikeRollback(
            monitor="loss",
            z_threshold=3.0,
            warmup_steps=2,
            patience=3,
            snapshot_every_n_steps=2,
            keep=2,
            skip_batches=1,
        )
        return [GradNormMonitor(depth=1), rollback]
    clip = ZClip(alpha=0.9, z_threshold=1.5, warmup_steps=3) if clipper == "zclip" else ClipGradNorm(MAX_NORM)
    return [GradNormMonitor(depth=1), clip, NonFiniteGuard(action="skip")]


def reference(broadcast_buffers: bool) -> list[dict[str, Tensor]]:
    """Each rank's final state from a single-process plain loop (``clip_grad_norm_``, no gradkit), NaN step left out.

    Args:
        broadcast_buffers: whether each forward starts from rank 0's BatchNorm statistics (DDP), or each rank keeps
            its own (FSDP2).
    """
    model = Net()
    model.load_state_dict(_initial_state())
    opt = _optimizer("sgd", model.parameters())
    buffers = [copy.deepcopy(dict(model.named_buffers())) for _ in range(WORLD)]
    model.train()
    for i, (x, y) in enumerate(global_batches()):
        if i == NAN_STEP:
            continue
        start = copy.deepcopy(buffers)
        for r in range(WORLD):
            model.load_state_dict(start[0] if broadcast_buffers else start[r], strict=False)
            half = slice(4 * r, 4 * r + 4)
            (nn.functional.mse_loss(model(x[half]), y[half]) / WORLD).backward()
            buffers[r] = copy.deepcopy(dict(model.named_buffers()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return [{**params, **buffers[r]} for r in range(WORLD)]


def _tensor(values: list[float], like: Tensor) -> Tensor:
    return torch.tensor(values, dtype=torch.float64).to(like.dtype).reshape(like.shape)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_processes("doors_script.py", tmp_path_factory.mktemp("doors"), timeout=240)


@pytest.mark.parametrize(("parallel", "clipper", "optimizer"), CASES)
def test_three_doors_give_the_same_state_logs_and_skips_on_every_rank(
    ranks: list[dict[str, Any]], parallel: str, clipper: str, optimizer: str
) -> None:
    case = f"{parallel}-{clipper}-{optimizer}"
    for rank, result in enumerate(ranks):
        trainer = result[f"{case}/trainer"]
        for door in DOORS[1:]:
            other = result[f"{case}/{door}"]
            # Parameters and BatchNorm buffers (the NaN step's writes put back), bitwise.
            assert other["state"] == trainer["state"], (rank, door)
            assert other["logs"].keys() == trainer["logs"].keys(), (rank, door)
            for key, values in trainer["logs"].items():
                assert other["logs"][key] == pytest.approx(values, nan_ok=True, rel=0, abs=0), (rank, door, key)
        logs = trainer["logs"]
        assert {"grad_norm/module/encoder", "grad_norm/module/norm", "grad_norm/module/head"} <= logs.keys()
        assert all(len(values) == STEPS for values in logs.values())
        # The NaN of rank 1 reached both ranks' norms, and both skipped exactly that step.
        assert math.isnan(logs["grad_norm/total"][NAN_STEP])
        assert logs["gradkit/skipped_steps"] == [0.0] * NAN_STEP + [1.0] * (STEPS - NAN_STEP), rank
        coefs = [c for c in logs["grad_clip/coef"] if not math.isnan(c)]
        assert min(coefs) < 0.5 and max(coefs) == 1.0  # the clipper acted on some steps, not on all
        state = trainer["state"]
        assert all(math.isfinite(v) for values in state.values() for v in values), rank
    # Every rank logs the same global values.
    first, second = (result[f"{case}/trainer"]["logs"] for result in ranks)
    for key, values in first.items():
        assert second[key] == pytest.approx(values, nan_ok=True, rel=0, abs=0), key


@pytest.mark.parametrize(("parallel", "clipper", "optimizer"), CASES)
def test_the_checkpoint_check_names_one_ranks_nan_on_every_rank(
    ranks: list[dict[str, Any]], parallel: str, clipper: str, optimizer: str
) -> None:
    # Rank 1 alone wrote a NaN into its piece of a parameter (under FSDP2 its own shard), a buffer and an optimizer
    # state (tests/distributed/doors_script.py): the flags' all-reduce makes both ranks refuse, naming the same three.
    moment = "exp_avg" if optimizer.startswith("adam") else "momentum_buffer"
    expected = {
        "parameters": ["encoder.weight"],
        "buffers": ["norm.running_var"],
        "optimizer_state": [f"encoder.bias.{moment}"],
    }
    for rank, result in enumerate(ranks):
        health = result[f"{parallel}-{clipper}-{optimizer}/plain"]["checkpoint_health"]
        assert health == {"healthy": True, "nonfinite": expected}, rank


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_every_door_equals_a_single_process_loop_on_the_global_batches(
    ranks: list[dict[str, Any]], parallel: str
) -> None:
    expected = reference(broadcast_buffers=parallel == "ddp")
    for rank, result in enumerate(ranks):
        for door in DOORS:
            state = result[f"{parallel}-norm-sgd/{door}"]["state"]
            assert state.keys() == expected[rank].keys()
            for name, value in expected[rank].items():
                got = _tensor(state[name], value)
                if name.endswith("num_batches_tracked"):
                    # The skipped step's counter is put back too: the reference never saw that step.
                    assert got == value, (rank, door, name)
                    continue
                torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {door} {name}")


def test_rollback_under_ddp_is_the_same_behind_the_three_doors(ranks: list[dict[str, Any]]) -> None:
    case = "-".join(ROLLBACK_CASE)
    for rank, result in enumerate(ranks):
        trainer = result[f"{case}/trainer"]
        (record,) = trainer["history"]  # one rollback, after `patience` flagged steps, to a snapshot before them
        assert record["to_step"] <= record["spike_start"] <= SPIKE[0] and record["rewound_steps"] >= 3, record
        for door in DOORS[1:]:
            other = result[f"{case}/{door}"]
            assert other["history"] == trainer["history"], (rank, door)
            assert other["state"] == trainer["state"], (rank, door)
            for key, values in trainer["logs"].items():
                assert other["logs"][key] == pytest.approx(values, nan_ok=True, rel=0, abs=0), (rank, door, key)
    # Both ranks restored the same snapshot: DDP's parameters stay identical across ranks.
    states = [result[f"{case}/trainer"]["state"] for result in ranks]
    params = [k for k in states[0] if not k.startswith("norm.running") and "num_batches" not in k]
    assert all(states[0][k] == states[1][k] for k in params)
