"""A ``torch.compile``d model under the whole stack, behind the Trainer, Fabric and the loop door (CPU, inductor).

The model is a two-block GPT whose ``blocks.1`` makes an inf in the rows of a batch that starts with token 0 and whose
loss spikes (x50) for a batch that starts with token 1: data faults, compiled into the graph with no branch. Every
run is compared with independent references that use no gradkit code: a hand-written loop (or plain Lightning) with
``torch.nn.utils.clip_grad_norm_`` (or a clipper of ``tests/clip_reference.py``) and the bad steps' micro-batches
left out.

- Compiled against compiled: bitwise (AdamW). The guards, clippers, the culprit replay, activation checkpointing,
  inference-mode validation and the early-warning hooks change nothing in what the compiled graphs compute.
- Compiled against eager: a compiled graph reassociates float32 sums, so its gradients differ from eager ones in the
  last bits. With SGD (linear in the gradient) the parameters after ``STEPS`` steps then differ by a few float32
  ulps of the largest parameter: measured 2.9e-8 of ``max|p|``; the tolerance is ``EAGER_RTOL = 1e-6`` (8 ulps of
  float32's 1.2e-7). AdamW divides by ``sqrt(v)`` and so magnifies a last-bit difference of a small gradient up to
  ``lr`` per step (measured 5.4e-4 of ``max|p|`` between the compiled and the eager hand loops): no tolerance below
  that would mean anything, hence the bitwise compiled reference for AdamW.
- Dynamo's counters: the same number of frames and graphs compiled, and no graph break, with the stack as without
  it over ``STEPS`` optimizer steps of two micro-batches each (logging steps included), the bad steps included.

Compilation dominates the cost (the model is small to keep it low: 46 s of CPU for the file with a cold inductor cache,
about 25 s with a warm one): cold compiles of the training graph, its checkpointed variant and the validation graph;
every later run recompiles after ``torch._dynamo.reset()`` (for its own counts) from inductor's on-disk caches.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader

import gradkit
from clip_reference import AGCRef, AutoClipRef, NormRef, ValueRef, ZClipRef
from gradkit.policies.culprit import MicroBatch, replay_micro_batches
from helpers import make_trainer
from lightning_gradkit import (
    ActivationCheckpointing,
    ClipGradNorm,
    EarlyWarning,
    GradNormMonitor,
    InferenceModeValidation,
    NonFiniteGuard,
    SpikeGuard,
    inject_activation_checkpointing,
)
from lightning_gradkit.demos import CausalSelfAttention, GPTConfig

# The guards report each skip with a warning; the tests check the skips and culprits themselves (events, returns).
pytestmark = [
    pytest.mark.filterwarnings("ignore:SpikeGuard. loss spike at step"),
    pytest.mark.filterwarnings("ignore:NonFiniteGuard. non-finite loss and gradients at step"),
]

VOCAB, BLOCK = 32, 8
STEPS, ACCUMULATE = 10, 2
INF_STEP, SPIKE_STEP = 3, 7  # the steps whose first micro-batch makes an inf, a loss spike
EAGER_RTOL = 1e-6
EARLY_WARNING_COMPILED = "EarlyWarning: the modules it hooks"


class FaultyBlock(nn.Module):
    """Causal self-attention and a ReLU MLP, residual; adds +inf to the rows flagged ``bad`` (a device tensor: no
    branch, no recompilation)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn = CausalSelfAttention(config)
        self.fc = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: Tensor, bad: Tensor | None = None) -> Tensor:
        x = x + self.attn(x)
        x = x + torch.relu(self.fc(x))
        return x if bad is None else x + torch.where(bad[:, :, None], float("inf"), 0.0)


class FaultyGPT(nn.Module):
    """A two-block GPT (no LayerNorm, little to compile: cold compilation is this file's cost) that returns its loss,
    nanoGPT-style, so that every door compiles the same graph. ``blocks.1`` makes the inf."""

    def __init__(self) -> None:
        super().__init__()
        config = GPTConfig(VOCAB, BLOCK, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
        self.wte = nn.Embedding(VOCAB, config.n_embd)
        self.blocks = nn.ModuleList(FaultyBlock(config) for _ in range(config.n_layer))
        self.head = nn.Linear(config.n_embd, VOCAB)

    def forward(self, batch: Tensor) -> Tensor:
        idx, targets = batch[:, :-1], batch[:, 1:]
        x = self.wte(idx)
        for i, block in enumerate(self.blocks):
            x = block(x, idx[:, :1] == 0 if i == 1 else None)
        loss = F.cross_entropy(self.head(x).reshape(-1, VOCAB), targets.reshape(-1))
        return loss * torch.where((idx[:, 0] == 1).any(), 50.0, 1.0)


def clean_batches(count: int, seed: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (4, BLOCK + 1), generator=g) for _ in range(count)]


def batches() -> list[Tensor]:
    """``ACCUMULATE`` micro-batches per step; the first of ``INF_STEP`` starts with 0, of ``SPIKE_STEP`` with 1."""
    out = clean_batches(STEPS * ACCUMULATE, seed=1)
    out[INF_STEP * ACCUMULATE][0, 0] = 0
    out[SPIKE_STEP * ACCUMULATE][0, 0] = 1
    return out


#: Whether each step is applied: the inf and the spike are skipped.
APPLIED = [s not in (INF_STEP, SPIKE_STEP) for s in range(STEPS)]


def without_bad_steps(data: list[Tensor]) -> list[Tensor]:
    """The reference's data: the micro-batches of the bad steps left out."""
    return [b for i, b in enumerate(data) if APPLIED[i // ACCUMULATE]]


def initial_model() -> FaultyGPT:
    torch.manual_seed(0)
    return FaultyGPT()


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2) if name == "adamw" else torch.optim.SGD(params, lr=0.1)


def flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def relative(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@dataclass
class Counts:
    """What dynamo compiled in a run: frames, distinct graphs, graph breaks."""

    frames: int
    graphs: int
    breaks: int


def fresh_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()


def counted() -> Counts:
    breaks = sum(counters["graph_break"].values())
    return Counts(counters["frames"]["total"], counters["stats"]["unique_graphs"], breaks)


@pytest.fixture(autouse=True, scope="module")
def _dynamo_left_clean() -> Iterator[None]:
    """The compiled code of this file's models stays out of the other test files."""
    yield
    fresh_dynamo()


def read_events(directory: Path) -> list[dict[str, Any]]:
    path = directory / "gradkit_events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def skipped_and_culprit(directory: Path) -> tuple[list[int], str | None]:
    """The steps the guards skipped, and the non-finite step's culprit, from the events file."""
    events = [e for e in read_events(directory) if e.get("action") == "skip" and e["what"] != "signals"]
    culprits = [e["culprit"] for e in events if e["what"].startswith("nonfinite")]
    return sorted(e["step"] for e in events), culprits[0] if culprits else None


# -- the loop door (and Fabric) ------------------------------------------------------------------------------------
def loop_policies(clipper: Any = None, early_warning: bool = True) -> list[Any]:
    """The stack; ``early_warning=False`` leaves out the one policy with forward hooks (their ids are in the guards
    of a graph that traced them: a new model instance, with new hooks, compiles once more)."""
    return [
        gradkit.GradNormMonitor(),
        clipper if clipper is not None else gradkit.ClipGradNorm(1.0),
        gradkit.NonFiniteGuard("skip"),
        gradkit.SpikeGuard(action="skip", warmup_steps=3),
        *([gradkit.EarlyWarning()] if early_warning else []),
    ]


@dataclass
class Trained:
    """What a loop saw: each step applied or not (behind the door), and how many micro-batch losses the compiled graph
    made (not eager code: a model that dynamo stopped compiling makes them eagerly)."""

    applied: list[bool | None] = field(default_factory=list)
    compiled: int = 0


def train_loop(
    call: Callable[[Tensor], Tensor],
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: list[Tensor],
    kit: gradkit.GradKit | None = None,
    clip: Callable[[nn.Module], None] | None = None,
    backward: Callable[[Tensor], None] = Tensor.backward,
) -> Trained:
    """Micro-batches of ``ACCUMULATE``; each step through ``kit``, or ``clip`` and a plain ``opt.step()``."""
    trained = Trained()
    for start in range(0, len(data), ACCUMULATE):
        for b in data[start : start + ACCUMULATE]:
            loss = call(b)
            trained.compiled += loss.grad_fn.name() == "CompiledFunctionBackward"  # made by the compiled graph
            backward(loss / ACCUMULATE)
            if kit is not None:
                kit.note_loss(loss, replay=lambda b=b: call(b))
        if kit is not None:
            trained.applied.append(kit.step(opt))
        else:
            (clip or NormRef(1.0))(model)
            opt.step()
        opt.zero_grad(set_to_none=True)
    return trained


def compiled_call(model: nn.Module, compiled: bool | str) -> nn.Module:
    """``model`` compiled: ``True`` by ``torch.compile(model)``, ``"in place"`` by ``model.compile()``."""
    if compiled == "in place":
        model.compile()
        return model
    return torch.compile(model) if compiled else model


def loop_run(
    tmp_path: Path | None, compiled: bool | str, optimizer: str, policies: list[Any] | None = None
) -> tuple[Tensor, Trained]:
    """The loop door with ``policies`` (the stack and activation checkpointing injected before compiling), on the
    faulty data."""
    model = initial_model()
    if policies is None:  # the injected `forward` is guarded by identity: a new model instance compiles once more
        inject_activation_checkpointing(model, ["re:blocks\\.\\d+"])
    call = compiled_call(model, compiled)
    opt = make_optimizer(optimizer, model.parameters())
    policies = loop_policies() if policies is None else policies
    kit = gradkit.GradKit(model, opt, policies, log_every_n_steps=3, log_dir=tmp_path or False)
    trained = train_loop(call, model, opt, batches(), kit)
    kit.finish()
    return flat(model), trained


def hand_run(compiled: bool, optimizer: str, clip: Callable[[nn.Module], None] | None = None) -> Tensor:
    """The reference: a hand-written loop, ``clip`` (``clip_grad_norm_``), the bad steps left out."""
    model = initial_model()
    call = torch.compile(model) if compiled else model
    opt = make_optimizer(optimizer, model.parameters())
    train_loop(call, model, opt, without_bad_steps(batches()), clip=clip)
    return flat(model)


def test_compiled_loop_door_skips_exactly_and_compiles_nothing_more(tmp_path: Path) -> None:
    fresh_dynamo()
    reference = hand_run(compiled=True, optimizer="adamw")
    plain = counted()
    fresh_dynamo()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, trained = loop_run(tmp_path, compiled=True, optimizer="adamw")
    assert counted() == plain == Counts(frames=1, graphs=1, breaks=0)
    assert relative(got, reference) == 0.0  # the culprit replay left no trace on what the compiled graph computes
    assert trained.applied == APPLIED and trained.compiled == STEPS * ACCUMULATE
    assert skipped_and_culprit(tmp_path) == ([INF_STEP, SPIKE_STEP], "blocks.1")
    assert any(str(w.message).startswith(EARLY_WARNING_COMPILED) for w in caught)


# The attention signals of a compiled region are not measured, and EarlyWarning says so once (checked elsewhere).
@pytest.mark.filterwarnings("ignore:EarlyWarning. the modules it hooks")
def test_compiled_loop_door_equals_the_eager_reference_within_float32_noise() -> None:
    """SGD: the stack on a model compiled in place (``model.compile()``) against an eager hand loop (the tolerance:
    module docstring); the skips are the same steps as in eager mode."""
    got, trained = loop_run(None, compiled="in place", optimizer="sgd")
    eager, eager_trained = loop_run(None, compiled=False, optimizer="sgd")
    reference = hand_run(compiled=False, optimizer="sgd")
    assert 0.0 < relative(got, reference) < EAGER_RTOL
    assert relative(eager, reference) == 0.0
    assert trained.applied == eager_trained.applied == APPLIED and trained.compiled == STEPS * ACCUMULATE


CLIPPERS = {
    "value": (lambda: gradkit.ClipGradValue(0.02), lambda: ValueRef(0.02)),
    "agc": (lambda: gradkit.AdaptiveGradClip(clip_factor=0.02), lambda: AGCRef(0.02)),
    "autoclip": (lambda: gradkit.AutoClip(percentile=30.0, history_size=5), lambda: AutoClipRef(30.0, 5)),
    "zclip": (lambda: gradkit.ZClip(alpha=0.9, z_threshold=0.5, warmup_steps=3), lambda: ZClipRef(0.9, 0.5, 3)),
}


@pytest.mark.parametrize("name", list(CLIPPERS))
def test_every_clipper_behind_a_compiled_model_trains_like_its_reference(name: str) -> None:
    """Each clipper of ``tests/clip_reference.py``, behind the guards, on a compiled graph already cached: no new
    frame, and the parameters of the reference loop (which leaves the bad steps out) within the tolerance of
    ``tests/test_clipping_policies.py`` for a compiled reference, and of ``EAGER_RTOL`` for an eager one."""
    make_clipper, make_reference = CLIPPERS[name]
    loop_run(None, compiled=True, optimizer="sgd", policies=loop_policies(early_warning=False))  # the graph, cached
    counters.clear()
    got, trained = loop_run(None, True, "sgd", loop_policies(make_clipper(), early_warning=False))
    assert counted() == Counts(0, 0, 0)
    reference = hand_run(compiled=True, optimizer="sgd", clip=make_reference())
    eager = hand_run(compiled=False, optimizer="sgd", clip=make_reference())
    assert (got - reference).abs().max() <= 1e-6
    assert relative(got, eager) < EAGER_RTOL
    assert relative(reference, hand_run(compiled=True, optimizer="sgd")) > 1e-4  # the clipper did clip
    assert trained.applied == APPLIED and trained.compiled == STEPS * ACCUMULATE


@pytest.mark.parametrize("order", ["compile-then-setup", "setup-then-compile"])
def test_compiled_model_behind_fabric_skips_exactly_with_no_graph_break(order: str) -> None:
    """``fabric.setup(torch.compile(net))`` and ``torch.compile(fabric.setup(net))``: in the second the compiled
    region holds the module gradkit's first-forward hook sits on, yet the hook of the wrapper runs first, outside it."""

    def run(with_kit: bool) -> tuple[Tensor, Counts, Trained]:
        fresh_dynamo()
        fabric = Fabric(accelerator="cpu", devices=1)
        net = initial_model()
        if order == "compile-then-setup":
            model, opt = fabric.setup(torch.compile(net), make_optimizer("adamw", net.parameters()))
        else:
            module, opt = fabric.setup(net, make_optimizer("adamw", net.parameters()))
            model = torch.compile(module)
        kit = gradkit.GradKit(model, opt, loop_policies(), fabric=fabric, log_every_n_steps=3) if with_kit else None
        data = batches() if with_kit else without_bad_steps(batches())
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="(NonFiniteGuard|SpikeGuard|EarlyWarning)")
            trained = train_loop(model, net, opt, data, kit, backward=fabric.backward)
        return flat(net), counted(), trained

    reference, plain, _ = run(with_kit=False)
    got, counts, trained = run(with_kit=True)
    assert counts == plain == Counts(frames=1, graphs=1, breaks=0)
    assert relative(got, reference) == 0.0
    assert trained.applied == APPLIED and trained.compiled == STEPS * ACCUMULATE


def test_replay_under_compile_leaves_the_model_compiled() -> None:
    """A culprit replay of a compiled model runs eagerly (its dispatch mode sees every operator) and changes nothing
    of dynamo's state: the next call runs the compiled graph again, with no new frame. (A frame that dynamo meets
    under a dispatch mode is otherwise marked to run eagerly for good.) The backend counts the compiled graph's runs."""
    runs: list[int] = []

    def counting_backend(graph: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            runs.append(1)
            return graph.forward(*args)

        return run

    fresh_dynamo()
    model = initial_model()
    compiled = torch.compile(model, backend=counting_backend)
    bad, good = batches()[INF_STEP * ACCUMULATE], batches()[0]
    with torch.no_grad():
        compiled(good)
    finding = replay_micro_batches(model, [MicroBatch(0, lambda: compiled(bad))])
    with torch.no_grad():
        compiled(good)
    assert (finding.culprit, finding.phase) == ("blocks.1", "forward_between_submodules")
    assert len(runs) == 2  # before and after the replay, not during it
    assert counted() == Counts(frames=1, graphs=1, breaks=0)


def test_explain_finds_no_graph_break_nor_operator_added_by_the_door_and_its_hooks() -> None:
    """``torch._dynamo.explain`` of the model on a logging step, with the loop door's first-forward hook and
    EarlyWarning's forward hooks attached: one graph, no break and the same operators as without them."""
    fresh_dynamo()
    model, batch = initial_model(), batches()[0]
    alone = torch._dynamo.explain(model)(batch)
    opt = make_optimizer("adamw", model.parameters())
    kit = gradkit.GradKit(model, opt, loop_policies(), log_every_n_steps=1, log_dir=False)
    fresh_dynamo()
    hooked = torch._dynamo.explain(model)(batch)
    kit.close()
    assert (hooked.graph_count, hooked.graph_break_count) == (alone.graph_count, alone.graph_break_count) == (1, 0)
    assert hooked.op_count == alone.op_count  # and no operator of gradkit's in the graph


def test_door_resumed_under_compile_keeps_the_hooks_the_graph_traced() -> None:
    """``GradKit.load_state_dict`` attaches the policies again; EarlyWarning's forward hooks, whose ids the compiled
    graph's guards hold, stay as they are: the resumed loop runs the same graph (one frame, as without the resume)."""
    fresh_dynamo()
    model = initial_model()
    call, opt = torch.compile(model), make_optimizer("adamw", model.parameters())
    kit = gradkit.GradKit(model, opt, loop_policies(), log_every_n_steps=1, log_dir=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="EarlyWarning")
        train_loop(call, model, opt, clean_batches(4, seed=3), kit)
        kit.load_state_dict(kit.state_dict())
        train_loop(call, model, opt, clean_batches(4, seed=4), kit)
    assert counted() == Counts(frames=1, graphs=1, breaks=0)


# -- the Trainer ---------------------------------------------------------------------------------------------------
class FaultyModule(pl.LightningModule):
    """The faulty GPT as a LightningModule; ``compile_inner`` compiles its model (else compile the module itself)."""

    def __init__(self, compile_inner: bool) -> None:
        super().__init__()
        self.inference_mode: list[bool] = []  # whether each validation step ran under inference mode
        self.model = initial_model()
        if compile_inner:
            self.model = torch.compile(self.model)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.model(batch)

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        self.inference_mode.append(torch.is_inference_mode_enabled())
        self.log("val_loss", self.model(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer("adamw", self.parameters())


def trainer_stack() -> list[pl.Callback]:
    return [
        GradNormMonitor(),
        ClipGradNorm(1.0),
        NonFiniteGuard("skip"),
        SpikeGuard(action="skip", warmup_steps=3),
        ActivationCheckpointing(["re:model\\.blocks\\.\\d+"]),  # injected after torch.compile, before its first call
        InferenceModeValidation(),
        EarlyWarning(),
    ]


def trainer_run(tmp_path: Path, with_stack: bool, compile_inner: bool) -> tuple[Tensor, Counts, list[bool]]:
    """``Trainer.fit`` on the faulty data with the stack, or plain Lightning (``gradient_clip_val``) on the data
    without the bad steps; validation twice."""
    fresh_dynamo()
    module = FaultyModule(compile_inner)
    trainer = make_trainer(
        tmp_path,
        default_root_dir=tmp_path,
        logger=False,
        strategy="gradkit" if with_stack else "auto",
        callbacks=trainer_stack() if with_stack else [],
        gradient_clip_val=None if with_stack else 1.0,
        accumulate_grad_batches=ACCUMULATE,
        log_every_n_steps=3,
        val_check_interval=8,
        limit_val_batches=2,
    )
    data = batches() if with_stack else without_bad_steps(batches())
    model = module if compile_inner else torch.compile(module)  # as Lightning's docs show
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="(NonFiniteGuard|SpikeGuard|EarlyWarning)")
        trainer.fit(model, DataLoader(data, batch_size=None), DataLoader(clean_batches(2, seed=2), batch_size=None))
    return flat(module), counted(), module.inference_mode


@pytest.mark.parametrize("compile_inner", [True, False], ids=["compiled-model", "compiled-lightning-module"])
def test_compiled_trainer_run_skips_exactly_names_the_culprit_and_compiles_nothing_more(
    tmp_path: Path, compile_inner: bool
) -> None:
    reference, plain, no_grad_validation = trainer_run(tmp_path / "plain", False, compile_inner)
    got, counts, validation = trainer_run(tmp_path / "stack", True, compile_inner)
    assert counts == plain
    assert validation == [True] * 4 and no_grad_validation == [False] * 4  # twice 2 batches, under inference_mode
    if compile_inner:  # the compiled LightningModule: Lightning's `self.log` in validation_step breaks its graph
        assert plain == Counts(frames=2, graphs=2, breaks=0)
    assert relative(got, reference) == 0.0
    assert skipped_and_culprit(tmp_path / "stack") == ([INF_STEP, SPIKE_STEP], "model.blocks.1")
