"""gradkit under pipeline parallelism (``torch.distributed.pipelining``, 2 CPU processes, gloo) against one process
holding the whole model.

A GPT-like model of four parts (a token embedding, two residual blocks in a ``ModuleDict``, a head) cut in two
stages as torchtitan cuts one, keeping the model's names: stage 0 holds ``emb`` and ``blocks.0``, stage 1
``blocks.1`` and ``head``; no parameter is on both. Each rank runs its stage under ``ScheduleGPipe`` or
``Schedule1F1B`` (two micro-batches per step, the loss on the last stage) and a ``GradKit`` on its stage module,
declared with ``gradkit.pipeline_parallel(stage, pp_group)``, then ``kit.step(optimizer)``.

Before, one ``GradKit`` per stage was refused by the layout check ("Build the same model on every rank"), and stages
of the same shapes each clipped by their own stage's norm (0.54-0.83x the global one). Declared, the total and
per-module norms, the clip coefficient and the skip are those of one process, on every stage alike.

One launch (:func:`helpers.run_processes`) runs every case:

- ``ClipGradNorm`` with ``NonFiniteGuard(action="skip")`` under each schedule (the monitor's param-group rows on, the
  last stage's losses handed over), with a NaN in one stage's gradient at one step (stage 1 under GPipe, stage 0
  under 1F1B): the step is skipped on both stages, and rank 0 names the parameter;
- ``ZClip`` (history of the global norm; the monitor's weight norms and update ratios on) and ``AdaptiveGradClip``
  (unit-wise, its post-clip total measured again) under 1F1B;
- two stages of one class (the same parameter names), declared: their rows are named by stage;
- the refusals: the split undeclared (the layout check at ``GradKit(...)``), declared on one rank only, and two
  stages of the same shapes undeclared (the first step's check of copies), each naming ``gradkit.pipeline_parallel``.

Reference: one process, the whole model, the same global batches of 4, ``clip_grad_norm_`` (and the papers'
clippers of ``clip_reference``), the poisoned step left out. Tolerance: the pipeline sums two micro-batches' gradients
where the reference takes one backward over the batch, so norms agree to ``rel=1e-5`` and parameters to
``rtol=1e-5, atol=1e-6``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from clip_reference import AGCRef, NormRef, ZClipRef
from helpers import run_processes

pytestmark = pytest.mark.distributed

STAGES = 2
VOCAB, WIDTH, TOKENS = 11, 8, 4
BATCH, MICRO_BATCHES = 4, 2  # the global batch of a step, cut in two micro-batches
STEPS = 4
LR = 0.1
DEPTH = 2  # the monitor's rows: emb, blocks.0, blocks.1, head
MAX_NORM = 0.5
NAN = {"gpipe": (1, 1), "1f1b": (2, 0)}  # case: (step, stage) of a NaN in that stage's gradient
ZCLIP = {"alpha": 0.9, "z_threshold": 0.5, "warmup_steps": 2, "max_norm": 1.0}
AGC_FACTOR = 0.02
REFERENCES: dict[str, Callable[[], Callable[[nn.Module], None]]] = {
    "gpipe": lambda: NormRef(MAX_NORM),
    "1f1b": lambda: NormRef(MAX_NORM),
    "zclip": lambda: ZClipRef(**ZCLIP),
    "agc": lambda: AGCRef(AGC_FACTOR),
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: Tensor) -> Tensor:
        return h + torch.tanh(self.fc(self.ln(h)))


class TinyGPT(nn.Module):
    """``head(blocks(emb(x)))``; a stage keeps some parts and sets the others to ``None`` (torchtitan's way)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb: nn.Embedding | None = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleDict({"0": Block(), "1": Block()})
        self.head: nn.Linear | None = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x) if self.emb is not None else x
        for block in self.blocks.values():
            h = block(h)
        return self.head(h) if self.head is not None else h


def make_model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT()


def make_stage(stage: int) -> TinyGPT:
    """Stage ``stage`` of the model, cut from the whole one: the same parameters, the same names."""
    model = make_model()
    if stage == 0:
        model.head = None
        del model.blocks["1"]
    else:
        model.emb = None
        del model.blocks["0"]
    return model


def batches() -> list[tuple[Tensor, Tensor]]:
    """``STEPS`` global batches of token ids and next-token targets, ``[BATCH, TOKENS]`` each."""
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(VOCAB, (BATCH, TOKENS), generator=generator),
            torch.randint(VOCAB, (BATCH, TOKENS), generator=generator),
        )
        for _ in range(STEPS)
    ]


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_block(stage: int) -> Block:
    """Stage ``stage`` of two stages of the same class: the same names (``ln.weight``, ...) on both."""
    torch.manual_seed(stage)
    return Block()


def block_batches() -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(2)
    return [(torch.randn(BATCH, TOKENS, WIDTH, generator=generator), torch.zeros(BATCH, TOKENS, WIDTH))] * 2


def block_loss(out: Tensor, target: Tensor) -> Tensor:
    return (out - target).square().mean()


def module_norms(
    model: nn.Module, tensors: dict[str, Tensor] | None = None, key: str = "grad_norm"
) -> dict[str, float]:
    """Per-module 2-norms at ``DEPTH`` components of the names, as the monitor groups them, and their total: of the
    gradients, or of ``tensors`` (by parameter name)."""
    groups: dict[str, list[Tensor]] = {}
    for name, p in model.named_parameters():
        tensor = p.grad if tensors is None else tensors[name]
        groups.setdefault(".".join(name.split(".")[:-1][:DEPTH]), []).append(tensor)
    rows = {f"{key}/module/{k}": torch.nn.utils.get_total_norm(v).item() for k, v in groups.items()}
    return rows | {f"{key}/total": torch.nn.utils.get_total_norm([t for v in groups.values() for t in v]).item()}


def reference(clip: Callable[[nn.Module], None], skip: Collection[int] = ()) -> dict[str, Any]:
    """One process, the whole model: per step the module and total norms, ``clip_grad_norm_``'s coefficient (for
    ``NormRef``), ``clip``, the post-clip total, the weights' norms and the update-to-weight ratios
    (``||w_after - w_before|| / ||w_before||``, total and per module), and SGD unless the step is in ``skip``."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    steps: list[dict[str, float]] = []
    for step, (x, y) in enumerate(batches()):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        row = module_norms(model)
        row["grad_norm/param_group_0"] = row["grad_norm/total"]  # one param group (each stage's optimizer: one)
        if isinstance(clip, NormRef):
            row["grad_clip/coef"] = min(1.0, MAX_NORM / (row["grad_norm/total"] + 1e-6))
        clip(model)
        row["grad_norm/total_post_clip"] = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        row |= module_norms(model, before, "weight_norm")
        if step not in skip:
            opt.step()
        update = {n: p.detach() - before[n] for n, p in model.named_parameters()}
        ratios = module_norms(model, update, "update_ratio")
        row |= {k: v / row[k.replace("update_ratio", "weight_norm")] for k, v in ratios.items()}
        steps.append(row)
    return {"steps": steps, "params": {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()}}


def stage_params(params: dict[str, list[float]], stage: int) -> dict[str, list[float]]:
    """The reference parameters stage ``stage`` holds (see :func:`make_stage`)."""
    first = ("emb.", "blocks.0.")
    return {n: v for n, v in params.items() if n.startswith(first) == (stage == 0)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_processes("pipeline_parallel_script.py", tmp_path_factory.mktemp("pp"), nprocs=STAGES, timeout=180)


def test_the_reference_model_splits_into_the_two_stages() -> None:
    """The reference itself: the two stages, run one after the other, compute what the whole model computes, and
    hold every parameter of it once."""
    x, _ = batches()[0]
    stages = [make_stage(0), make_stage(1)]
    torch.testing.assert_close(stages[1](stages[0](x)), make_model()(x))
    names = [[n for n, _ in stage.named_parameters()] for stage in stages]
    assert sorted(names[0] + names[1]) == sorted(n for n, _ in make_model().named_parameters())
    assert not set(names[0]) & set(names[1])


def test_stages_log_the_whole_models_norms_clip_and_skip_alike_and_equal_one_process(
    ranks: list[dict[str, Any]],
) -> None:
    # Both stages logged and decided exactly the same (NaN included, hence the JSON text).
    assert json.dumps([ranks[1][c]["logged"] for c in REFERENCES]) == json.dumps(
        [ranks[0][c]["logged"] for c in REFERENCES]
    )
    for case, make_clip in REFERENCES.items():
        nan_step = NAN[case][0] if case in NAN else None
        ref = reference(make_clip(), skip={nan_step} if nan_step is not None else ())
        clipped = [r["grad_norm/total_post_clip"] < r["grad_norm/total"] * (1 - 1e-4) for r in ref["steps"]]
        assert any(clipped), f"{case}: the reference never clips, the case proves nothing"
        logged = ranks[0][case]["logged"]
        if nan_step is not None:
            # The NaN of one stage skips the step on both; the other steps equal one process.
            assert math.isnan(logged[nan_step]["grad_norm/total"])
            assert [row["gradkit/skipped_steps"] for row in logged] == [float(s >= nan_step) for s in range(STEPS)]
            logged = logged[:nan_step] + logged[nan_step + 1 :]
            ref["steps"] = ref["steps"][:nan_step] + ref["steps"][nan_step + 1 :]
        assert len(logged) == len(ref["steps"]), case
        for step, (got, expected) in enumerate(zip(logged, ref["steps"], strict=True)):
            # Every stage's module rows, named as one process names them; each value equal to its.
            assert {k for k in got if k.startswith("grad_norm/module/")} == {
                k for k in expected if k.startswith("grad_norm/module/")
            }
            if case in NAN:  # the guarded cases log the param group's norm: group 0 of both stages
                assert "grad_norm/param_group_0" in got
            if case == "zclip":  # with the weight norms and update ratios, every stage's too
                assert {"weight_norm/module/emb", "update_ratio/module/head", "update_ratio/total"} <= got.keys()
            for key, value in expected.items():
                if key in got:
                    assert got[key] == pytest.approx(value, rel=1e-5), (case, step, key)
        for stage, rank in enumerate(ranks):
            expected_params = stage_params(ref["params"], stage)
            assert rank[case]["params"].keys() == expected_params.keys()
            for name, value in expected_params.items():
                torch.testing.assert_close(
                    torch.tensor(rank[case]["params"][name]), torch.tensor(value), rtol=1e-5, atol=1e-6, msg=name
                )
            # One collective of gradkit's per step (the pipeline group is the world here); on logging steps (here
            # every step) AdaptiveGradClip reads the clipped gradients again for its post-clip total, and the weight
            # norms and update ratios (the ZClip case) take one each.
            assert rank[case]["world_collectives"] == [{"agc": 2, "zclip": 3}.get(case, 1)] * STEPS, case


def test_stages_of_one_class_are_named_by_stage_and_equal_one_process(ranks: list[dict[str, Any]]) -> None:
    """Two stages of one ``Block`` each: the same parameter names on both, told apart as ``stage<k>.``; the norms are
    those of ``nn.Sequential(block0, block1)``, whose rows are ``0.ln``, ``0.fc``, ``1.ln``, ``1.fc``."""
    model = nn.Sequential(make_block(0), make_block(1))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    logged = ranks[0]["same_shapes"]["logged"]
    assert json.dumps(ranks[1]["same_shapes"]["logged"]) == json.dumps(logged)
    for got, (x, y) in zip(logged, block_batches(), strict=True):
        opt.zero_grad()
        block_loss(model(x), y).backward()
        rows = module_norms(model).items()  # "grad_norm/module/0.ln": stage 0's `ln`
        expected = {k.replace("/module/", "/module/stage"): v for k, v in rows}
        total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
        expected |= {"grad_norm/total": total, "grad_clip/coef": min(1.0, MAX_NORM / (total + 1e-6))}
        assert {k for k in got if k.startswith("grad_norm/module/")} == {k for k in expected if "module" in k}
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-5), key
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()


def test_a_nan_on_one_stage_is_named_by_rank_0_with_the_stage_that_made_it(ranks: list[dict[str, Any]]) -> None:
    """Rank 0 warns for all: it names the first parameter of the stage whose gradient was NaN, and its rank."""
    (gpipe,) = ranks[0]["gpipe"]["warnings"]
    assert "culprit `blocks.1.ln.weight`" in gpipe and "on rank(s) [1]" in gpipe  # stage 1's, named on stage 0
    (one_f_one_b,) = ranks[0]["1f1b"]["warnings"]
    assert "culprit `emb.weight`" in one_f_one_b and "on rank(s) [0]" in one_f_one_b


def test_undeclared_or_partly_declared_pipelines_are_refused_with_the_fix(ranks: list[dict[str, Any]]) -> None:
    for case in ("undeclared_split", "declared_on_rank_0_only", "undeclared_same_shapes"):
        messages = [rank[case] for rank in ranks]
        assert messages[0] is not None and all(m == messages[0] for m in messages), case  # every rank alike, no hang
        assert "gradkit.pipeline_parallel(stage_module, pp_group)" in messages[0], case
    # The stages of another shape stop at `GradKit(...)`, naming the first parameter that differs.
    assert "rank 0 has `optimizer 0, group 0: emb.weight" in ranks[0]["undeclared_split"]
    assert "rank 1: none" in ranks[0]["declared_on_rank_0_only"]
    # Stages of the same shapes pass that check; the first step finds their gradients differ.
    assert "differs between ranks" in ranks[0]["undeclared_same_shapes"]
