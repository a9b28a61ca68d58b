"""gradkit under expert parallelism (4 CPU processes, gloo) against one process holding the whole model.

A small mixture-of-experts (an input projection, a top-1 router, four experts as stacked weights ``w_in [E, 4, 8]``
and ``w_out [E, 8, 4]``, a head) on a 2 x 2 (data parallel x expert parallel) world: rank ``r`` is data-parallel
rank ``r // 2`` and expert-parallel rank ``k = r % 2``, holding experts ``2k`` and ``2k + 1`` as plain local
parameters (rows ``2k, 2k + 1`` of the stacked weights; the same names on every rank). The two ranks of an
expert-parallel group see the same batch; each applies its own experts to the tokens routed to them and the outputs
are summed over the group (``_SumOverGroup``), the gradient of the shared input summed back (``_CopyToGroup``): the
all-to-all of a production MoE moves the tokens instead, but leaves the same gradients in the same places, which is
all gradkit reads. Dense parameters are data-parallel over all four ranks, experts over their two copies.

Declared with ``gradkit.expert_parallel(experts, ep_group)``, each rank's experts count once over the world
(weight 1/2 for the plain copies of the loop door, 1 for FSDP2's shards under the Trainer). Before, each rank's norm
counted the dense parameters and its own experts only (0.80-0.96x the true norm), each rank clipped by its own factor
and the dense parameters drifted apart. Undeclared, the first step now stops with the fix.

One launch (:func:`helpers.run_processes`, torchrun's way) runs every case:

- the loop door, DDP over the dense layers (experts left out of DDP and all-reduced over their copies by the loop):
  ``ClipGradNorm`` with ``NonFiniteGuard(action="skip")`` (a NaN in one copy of an expert gradient at step 1; at
  step 3 the router gives no token to experts 2 and 3, so ranks 1 and 3 have no expert gradient at all), ``ZClip``,
  ``AdaptiveGradClip`` and ``AutoClip``, then the same model undeclared;
- the Trainer, ``GradKitModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)`` (its second mesh
  dimension serves as the expert-parallel one: its ranks see the same batch), with FSDP2 over the data-parallel
  dimension for the dense layers and for the experts (``configure_model``): the same NaN and empty experts, then
  undeclared.

Reference: one process, all four experts, global batches of 8, ``clip_grad_norm_`` (and the papers' clippers of
``clip_reference``). Tolerance: DDP and FSDP2 average the gradients in another order than one backward over the
global batch, so norms agree to ``rel=1e-5`` and parameters to ``rtol=1e-5, atol=1e-6``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from clip_reference import AGCRef, AutoClipRef, NormRef, ZClipRef
from helpers import loader, run_processes

pytestmark = pytest.mark.distributed

DP, EP = 2, 2
WORLD = DP * EP
EXPERTS, WIDTH, HIDDEN = 4, 4, 8
BATCH = 4  # samples per data-parallel rank and step: global batches of DP * BATCH
STEPS = 5
LR = 0.1
DEPTH = 2  # the monitor's module rows: inp, moe.router, moe.experts, head
MAX_NORM = 0.05
NAN_STEP, NAN_RANK = 1, 3  # a NaN in rank 3's copy of the experts' gradient (after the loop's all-reduce)
BLOCKED_STEP, BLOCKED = 3, (2, 3)  # no token for expert-parallel rank 1's experts: no gradient on ranks 1 and 3
ZCLIP = {"alpha": 0.9, "z_threshold": 0.5, "warmup_steps": 2, "max_norm": 1.0}
AGC_FACTOR = 0.01
AUTOCLIP = {"percentile": 10.0, "history_size": 10}
REFERENCES: dict[str, Callable[[], Callable[[nn.Module], None]]] = {
    "norm": lambda: NormRef(MAX_NORM),
    "zclip": lambda: ZClipRef(**ZCLIP),
    "agc": lambda: AGCRef(AGC_FACTOR),
    "autoclip": lambda: AutoClipRef(**AUTOCLIP),
}


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the group (Megatron's ``f``): each rank's experts
    give the part of the shared input's gradient that flows through them."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverGroup(torch.autograd.Function):
    """The sum of the group's outputs forward (each rank's experts' share); identity backward (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class Experts(nn.Module):
    """Stacked expert weights; expert ``j`` maps a token ``h`` to ``gelu(h @ w_in[j]) @ w_out[j]``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(n, WIDTH, HIDDEN) * 0.5)
        self.w_out = nn.Parameter(torch.randn(n, HIDDEN, WIDTH) * 0.5)

    def forward(self, h: Tensor, choice: Tensor, gate: Tensor, first: int) -> Tensor:
        out = torch.zeros_like(h)
        for j in range(self.w_in.shape[0]):
            # An expert without tokens still runs (on zero rows), as a grouped GEMM does: its gradient is zero.
            rows = (choice == first + j).nonzero().squeeze(1)
            y = nn.functional.gelu(h[rows] @ self.w_in[j]) @ self.w_out[j]
            out = out.index_add(0, rows, y * gate[rows])
        return out


class MoE(nn.Module):
    """A top-1 router and the experts; :meth:`localize` keeps this rank's experts of an expert-parallel group."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, EXPERTS, bias=False)
        self.experts = Experts(EXPERTS)
        self.group: dist.ProcessGroup | None = None
        self.first = 0  # global index of the first local expert
        self.blocked: tuple[int, ...] = ()  # experts the router gives no token (the test's switch)

    def localize(self, group: dist.ProcessGroup) -> None:
        """Keep rows ``k * E/ep .. (k + 1) * E/ep`` of the stacked weights on the group's rank ``k``."""
        n = EXPERTS // dist.get_world_size(group)
        self.first = dist.get_rank(group) * n
        for name in ("w_in", "w_out"):
            full = getattr(self.experts, name).detach()
            setattr(self.experts, name, nn.Parameter(full[self.first : self.first + n].clone()))
        self.group = group

    def forward(self, h: Tensor) -> Tensor:
        logits = self.router(h)
        if self.blocked:
            mask = torch.zeros(EXPERTS, dtype=torch.bool)
            mask[list(self.blocked)] = True
            logits = logits.masked_fill(mask, -math.inf)
        if self.group is not None:
            h, logits = _CopyToGroup.apply(torch.cat([h, logits], 1), self.group).split([WIDTH, EXPERTS], 1)
        probs = logits.softmax(-1)
        choice = probs.argmax(-1)
        out = h * 0  # in the graph even without experts here: the group's backward sum runs on every rank
        local = range(self.first, self.first + self.experts.w_in.shape[0])
        if not set(local) <= set(self.blocked):  # all of a rank's experts blocked: they do not run, no gradient
            out = out + self.experts(h, choice, probs.gather(1, choice[:, None]), self.first)
        return _SumOverGroup.apply(out, self.group) if self.group is not None else out


class TinyMoE(nn.Module):
    """``head(h + moe(h))`` with ``h = tanh(inp(x))``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.moe = MoE()
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        return self.head(h + self.moe(h))


def make_model() -> TinyMoE:
    torch.manual_seed(0)
    return TinyMoE()


def module_norms(model: nn.Module, prefix: str = "") -> dict[str, float]:
    """Per-module 2-norms at ``DEPTH`` components of the names (after ``prefix``), as the monitor groups them."""
    groups: dict[str, list[Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            groups.setdefault(prefix + ".".join(name.split(".")[:-1][:DEPTH]), []).append(p.grad)
    return {f"grad_norm/module/{k}": torch.nn.utils.get_total_norm(v).item() for k, v in groups.items()}


def reference(clip: Callable[[nn.Module], None], skip: Collection[int] = (), prefix: str = "") -> dict[str, Any]:
    """One process, all experts, global batches of 8: per step the total and module norms, the clip coefficient of
    ``clip_grad_norm_``'s formula (for ``NormRef``), ``clip``, the post-clip total, and SGD unless the step is in
    ``skip``; experts ``BLOCKED`` get no token at ``BLOCKED_STEP``."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    steps: list[dict[str, float]] = []
    for step, (x, y) in enumerate(loader(n=DP * BATCH * STEPS, batch_size=DP * BATCH)):
        model.moe.blocked = BLOCKED if step == BLOCKED_STEP else ()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        row = module_norms(model, prefix)
        total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
        row["grad_norm/total"] = total
        if isinstance(clip, NormRef):  # ClipGradNorm's coefficient, by torch's formula
            row["grad_clip/coef"] = min(1.0, MAX_NORM / (total + 1e-6))
        clip(model)
        row["grad_norm/total_post_clip"] = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
        steps.append(row)
        if step not in skip:
            opt.step()
    return {"steps": steps, "params": {n: p.detach() for n, p in model.named_parameters()}}


def local_reference(params: dict[str, Tensor], ep_rank: int) -> dict[str, list[float]]:
    """The reference parameters a rank of expert-parallel rank ``ep_rank`` holds: every dense one, its experts' rows."""
    n = EXPERTS // EP
    out = {}
    for name, value in params.items():
        local = value[ep_rank * n : (ep_rank + 1) * n] if ".experts." in name else value
        out[name] = local.reshape(-1).tolist()
    return out


def assert_params_close(got: dict[str, list[float]], expected: dict[str, list[float]], case: str) -> None:
    assert got.keys() == expected.keys(), case
    for name, ref in expected.items():
        torch.testing.assert_close(torch.tensor(got[name]), torch.tensor(ref), rtol=1e-5, atol=1e-6, msg=name)


def assert_logged(logged: list[dict[str, float]], expected: list[dict[str, float]], case: str) -> None:
    """Every key the reference has (module rows, total, post-clip total, and ``grad_clip/coef`` where logged) equals
    it, and the module rows are exactly the reference's."""
    assert len(logged) == len(expected), case
    for step, (got, ref) in enumerate(zip(logged, expected, strict=True)):
        rows = {k for k in got if k.startswith("grad_norm/module/")}
        assert rows == {k for k in ref if k.startswith("grad_norm/module/")}, (case, step)
        for key, value in ref.items():
            if key in got:
                assert got[key] == pytest.approx(value, rel=1e-5), (case, step, key)


def assert_clips(case: str, ref: dict[str, Any]) -> None:
    clipped = [r["grad_norm/total_post_clip"] < r["grad_norm/total"] * (1 - 1e-4) for r in ref["steps"]]
    assert any(clipped), f"{case}: the reference never clips, the case proves nothing"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_processes("expert_parallel_script.py", tmp_path_factory.mktemp("ep"), nprocs=WORLD, timeout=240)


def test_the_reference_model_splits_into_the_expert_parallel_one() -> None:
    """The reference itself: a model whose experts are cut in two halves, each run as its own rank's experts and the
    outputs summed (what ``_SumOverGroup`` does), computes what the whole model computes."""
    model = make_model()
    x, _ = next(iter(loader(n=8, batch_size=8)))
    whole = model(x)
    h = torch.tanh(model.inp(x))
    probs = model.moe.router(h).softmax(-1)
    choice = probs.argmax(-1)
    gate = probs.gather(1, choice[:, None])
    n = EXPERTS // EP
    halves = []
    for k in range(EP):
        part = Experts(n)
        part.w_in, part.w_out = (nn.Parameter(w.detach()[k * n : (k + 1) * n]) for w in model.moe.experts.parameters())
        halves.append(part(h, choice, gate, k * n))
    torch.testing.assert_close(model.head(h + sum(halves)), whole)


def test_loop_door_counts_plain_local_experts_once_and_equals_one_process(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks[1:]:
        # Every rank logged and decided exactly the same (NaN included, hence the JSON text).
        assert json.dumps([rank[c]["logged"] for c in REFERENCES]) == json.dumps(
            [ranks[0][c]["logged"] for c in REFERENCES]
        )
    for case, make_clip in REFERENCES.items():
        skip = {NAN_STEP} if case == "norm" else set()
        ref = reference(make_clip(), skip)
        assert_clips(case, ref)
        logged = ranks[0][case]["logged"]
        if case == "norm":
            # The NaN in one copy of the experts' gradient skips that step on every rank; the others equal one process.
            assert math.isnan(logged[NAN_STEP]["grad_norm/total"])
            assert [row["gradkit/skipped_steps"] for row in logged] == [0.0] + [1.0] * (STEPS - 1)
            logged, ref["steps"] = (
                logged[:NAN_STEP] + logged[NAN_STEP + 1 :],
                [r for s, r in enumerate(ref["steps"]) if s != NAN_STEP],
            )
        assert_logged(logged, ref["steps"], case)
        for r, rank in enumerate(ranks):
            assert_params_close(rank[case]["params"], local_reference(ref["params"], r % EP), case)
            # One collective over the world per step, the first step's check of the copies included (DDP's own
            # all-reduces and the experts' over their copies run in C++ or on sub-groups and are not counted).
            # AdaptiveGradClip adds a scalar all-reduce on logging steps (here every step) for its post-clip total.
            expected = 2 if case == "agc" else 1
            assert rank[case]["world_collectives"] == [expected] * STEPS, case
    # The warning names the expert parameter whose gradient was NaN (rank 0 warns for all).
    assert any("moe.experts.w_in" in w for w in ranks[0]["norm"]["warnings"])


def test_loop_door_refuses_undeclared_local_experts_with_the_fix(ranks: list[dict[str, Any]]) -> None:
    messages = [rank["undeclared"]["error"] for rank in ranks]
    assert messages[0] is not None and all(m == messages[0] for m in messages)  # every rank stops alike, none hangs
    assert "`moe.experts.w_in`" in messages[0] and "gradkit.expert_parallel(module, group)" in messages[0]
    assert "a plain tensor" in messages[0]
    assert ranks[0]["undeclared"]["steps_done"] == 0


def test_trainer_fsdp2_experts_declared_equal_one_process(ranks: list[dict[str, Any]]) -> None:
    ref = reference(NormRef(MAX_NORM), skip={NAN_STEP}, prefix="net.")
    assert_clips("trainer", ref)
    got = ranks[0]["trainer"]
    for rank in ranks[1:]:
        assert json.dumps(rank["trainer"]["logged"]) == json.dumps(got["logged"])
    logged = got["logged"]
    assert math.isnan(logged[NAN_STEP]["grad_norm/total"])
    assert [row["gradkit/skipped_steps"] for row in logged] == [0.0] + [1.0] * (STEPS - 1)
    keep = [s for s in range(STEPS) if s != NAN_STEP]
    assert_logged([logged[s] for s in keep], [ref["steps"][s] for s in keep], "trainer")
    expected = {f"net.{n}": v for n, v in ref["params"].items()}
    for r, rank in enumerate(ranks):
        assert_params_close(rank["trainer"]["params"], local_reference(expected, r % EP), "trainer")
        assert rank["trainer"]["world_collectives"] == [1] * STEPS
    assert any("net.moe.experts.w_in" in w for w in got["warnings"])


def test_trainer_refuses_undeclared_fsdp2_experts_with_the_fix(ranks: list[dict[str, Any]]) -> None:
    """FSDP2 shards the undeclared experts over the data-parallel sub-mesh: gradkit took the other sub-mesh's shards
    for copies (weight 1/2); now the first step stops, naming the assumption and the fix."""
    messages = [rank["trainer_undeclared"]["error"] for rank in ranks]
    assert messages[0] is not None and all(m == messages[0] for m in messages)
    assert "`net.moe.experts.w_in`" in messages[0] and "gradkit.expert_parallel(module, group)" in messages[0]
    assert "a DTensor on a device mesh of 2 of the 4 ranks" in messages[0]
