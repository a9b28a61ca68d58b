"""GraphLeakGuard with Lightning's real Trainer, and the graph-scanning functions against hand-built graphs."""

from __future__ import annotations

import json
import warnings
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch
from torch import Tensor, nn

from helpers import MLPModule, loader, make_trainer
from lightning_gradkit import GraphLeakGuard
from lightning_gradkit.diagnostics.autograd_graph import (
    OlderGraph,
    autograd_sequence_marker,
    graph_footprint,
    module_graph_tensors,
    steady_growth,
    storage_keys,
)


def guard_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "GraphLeakGuard" in str(w.message)]


def graph_nodes(tensor: Tensor) -> int:
    """Reference: the nodes of a tensor's graph, by a plain breadth-first walk (AccumulateGrad excluded)."""
    seen, queue = set(), deque([tensor.grad_fn])
    keep = []
    while queue:
        node = queue.popleft()
        if node is None or id(node) in seen or type(node).__name__ == "AccumulateGrad":
            continue
        seen.add(id(node))
        keep.append(node)
        queue.extend(fn for fn, _ in node.next_functions)
    return len(seen)


class StoringModule(MLPModule):
    """Stores the step's loss each step: the tensor itself, ``loss.detach()`` or ``loss.item()``."""

    def __init__(self, store: str) -> None:
        super().__init__()
        self.store = store
        self.losses: list[Tensor | float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.store == "tensor":
            self.losses.append(loss)
        elif self.store == "detach":
            self.losses.append(loss.detach())
        else:
            self.losses.append(loss.item())
        return loss


def test_appended_loss_is_caught_at_first_check_naming_the_attribute(tmp_path: Path) -> None:
    guard = GraphLeakGuard(check_every_n_steps=3)
    model = StoringModule("tensor")
    trainer = make_trainer(tmp_path, callbacks=[guard])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(model, loader())  # 8 batches: checks after batches 2 and 5

    first, second = guard.reports
    assert first.batch_idx == 2
    # losses[2] is the checked step's own loss: not yet a leak.
    assert [t.path for t in first.tensors] == ["pl_module.losses[0]", "pl_module.losses[1]"]
    assert [t.path for t in second.tensors] == [f"pl_module.losses[{i}]" for i in range(5)]
    assert first.tensors[0].grad_fn == "MseLossBackward0" and first.tensors[0].shape == ()
    assert (first.footprint.graphs, second.footprint.graphs) == (2, 5)  # one graph per step
    assert first.footprint.nodes == graph_nodes(model.losses[0]) + graph_nodes(model.losses[1])
    assert first.footprint.tensor_bytes == sum(t.untyped_storage().nbytes() for t in model.losses[:2])
    assert first.footprint.saved_bytes == 0  # backward() freed every saved tensor of these graphs
    assert first.containers == {"pl_module.losses": 2}
    [message] = guard_warnings(record)  # warned once for this attribute, not at every check
    assert "pl_module.losses[0], pl_module.losses[1]" in message and "2 graph(s)" in message


@pytest.mark.parametrize("store", ["detach", "item"])
def test_detached_or_item_values_are_not_flagged(tmp_path: Path, store: str) -> None:
    guard = GraphLeakGuard(check_every_n_steps=2)
    model = StoringModule(store)
    trainer = make_trainer(tmp_path, callbacks=[guard])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(model, loader())
    assert len(model.losses) == 8
    assert guard.reports == []
    assert guard_warnings(record) == []


class NestedStoreModule(MLPModule):
    def __init__(self) -> None:
        super().__init__()
        self.stats = {"loss": deque(maxlen=100)}

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.stats["loss"].append(loss * 2)
        return loss


def test_raise_action_stops_at_first_check_with_nested_path(tmp_path: Path) -> None:
    model = NestedStoreModule()
    trainer = make_trainer(tmp_path, callbacks=[GraphLeakGuard(check_every_n_steps=2, action="raise")])
    with pytest.raises(RuntimeError, match=r"pl_module\.stats\['loss'\]\[0\]"):
        trainer.fit(model, loader())
    assert len(model.stats["loss"]) == 2  # stopped after batch 1, the first check


class RunningTotalModule(MLPModule):
    """``total`` chains every step's graph; ``last`` only ever holds the current step's."""

    def __init__(self) -> None:
        super().__init__()
        self.total = torch.zeros(())
        self.last: Tensor | None = None

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.total = self.total + loss
        self.last = loss
        return loss


def test_running_total_is_one_chained_graph_and_current_step_graph_is_not_a_leak(tmp_path: Path) -> None:
    guard = GraphLeakGuard(check_every_n_steps=4)
    model = RunningTotalModule()
    trainer = make_trainer(tmp_path, callbacks=[guard])
    with pytest.warns(UserWarning, match=r"pl_module\.total"):
        trainer.fit(model, loader())
    first = guard.reports[0]
    assert [t.path for t in first.tensors] == ["pl_module.total"]
    assert first.footprint.graphs == 1
    assert first.footprint.nodes == 4 * graph_nodes(model.last) + 4  # 4 steps' graphs plus 4 additions


class AuxBranchModule(MLPModule):
    """Keeps an auxiliary output that the loss does not use: backward never frees what its graph saved."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[Tensor] = []
        self.aux_bytes: list[int] = []
        self.saved_bytes: list[int] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        h = self.encoder(x)
        aux = h.sin()  # saves h for a backward that never comes
        self.kept.append(aux)
        self.aux_bytes.append(aux.untyped_storage().nbytes())
        self.saved_bytes.append(h.untyped_storage().nbytes())
        return nn.functional.mse_loss(self.head(torch.tanh(h)), y)


def test_pinned_memory_counts_unfreed_saved_tensors(tmp_path: Path) -> None:
    guard = GraphLeakGuard(check_every_n_steps=4)
    model = AuxBranchModule()
    trainer = make_trainer(tmp_path, callbacks=[guard])
    with pytest.warns(UserWarning, match=r"pl_module\.kept\[0\], pl_module\.kept\[1\], pl_module\.kept\[2\]"):
        trainer.fit(model, loader())
    footprint = guard.reports[0].footprint
    assert footprint.graphs == 3
    assert footprint.tensor_bytes == sum(model.aux_bytes[:3])
    assert footprint.saved_bytes == sum(model.saved_bytes[:3])
    assert footprint.pinned_bytes == sum(model.aux_bytes[:3]) + sum(model.saved_bytes[:3])


class ExtraOutputsModule(MLPModule):
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        x, y = batch
        h = self.encoder(x)
        pred = self.head(torch.tanh(h))
        loss = nn.functional.mse_loss(pred, y)
        return {"loss": loss, "pred": pred, "aux": (h * 3).sin()}


def test_returned_output_with_unfreed_graph_is_reported_once(tmp_path: Path) -> None:
    guard = GraphLeakGuard(check_every_n_steps=2)
    trainer = make_trainer(tmp_path, callbacks=[guard])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(ExtraOutputsModule(), loader())
    # "pred" is part of the loss graph (freed by backward); "aux" is a branch backward never ran through.
    [message] = guard_warnings(record)
    assert "outputs['aux']" in message and "pred" not in message
    assert guard.reports == []
    events = [json.loads(line) for line in (Path(trainer.log_dir) / "gradkit_events.jsonl").read_text().splitlines()]
    assert [(e["what"], e["path"], e["batch_idx"], e["step"]) for e in events] == [
        ("output_graph", "outputs['aux']", 1, 2)
    ]


_GLOBAL_LOSSES: list[Tensor] = []


class GlobalStoreModule(MLPModule):
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        _GLOBAL_LOSSES.append(loss)
        return loss


def test_gc_scan_finds_a_module_level_list(tmp_path: Path) -> None:
    try:
        plain = GraphLeakGuard(check_every_n_steps=3)
        make_trainer(tmp_path, callbacks=[plain], max_steps=3).fit(GlobalStoreModule(), loader())
        assert plain.reports == []  # out of the LightningModule's reach
        _GLOBAL_LOSSES.clear()

        scanning = GraphLeakGuard(check_every_n_steps=3, gc_scan=True)
        with pytest.warns(UserWarning, match="_GLOBAL_LOSSES"):
            make_trainer(tmp_path, callbacks=[scanning], max_steps=3).fit(GlobalStoreModule(), loader())
        paths = [t.path for t in scanning.reports[0].tensors]
        assert f"{__name__}._GLOBAL_LOSSES[0]" in paths and f"{__name__}._GLOBAL_LOSSES[1]" in paths
        assert f"{__name__}._GLOBAL_LOSSES[2]" not in paths  # the checked step's own
    finally:
        _GLOBAL_LOSSES.clear()


def _symbolic_fake_with_graph() -> Tensor:
    """What ``torch.compile`` leaves alive in its caches: a FakeTensor with a ``grad_fn`` and a symbolic size."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    fake = mode.from_tensor(torch.randn(5, 3, requires_grad=True), symbolic_context=context)
    with mode:
        return fake * 2


def test_gc_scan_passes_over_fake_tensors_of_torch_compile(tmp_path: Path) -> None:
    # A fake tensor pins no memory; its symbolic byte count (`12*s0`) once crashed the report's formatting.
    fakes = [_symbolic_fake_with_graph()]
    assert fakes[0].grad_fn is not None and isinstance(fakes[0].shape[0], torch.SymInt)
    try:
        scanning = GraphLeakGuard(check_every_n_steps=3, gc_scan=True)
        with pytest.warns(UserWarning, match="_GLOBAL_LOSSES"):
            make_trainer(tmp_path, callbacks=[scanning], max_steps=3).fit(GlobalStoreModule(), loader())
        paths = [t.path for t in scanning.reports[0].tensors]
        assert f"{__name__}._GLOBAL_LOSSES[0]" in paths
        assert not any("fakes" in p for p in paths)
    finally:
        _GLOBAL_LOSSES.clear()


class _History:
    """A leak in a class attribute: shared by every instance, out of the module's reach."""

    hist: list[Tensor] = []


class ClassAttributeStoreModule(MLPModule):
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        _History.hist.append(loss)
        return loss


def test_gc_scan_names_every_tensor_of_a_class_attribute(tmp_path: Path) -> None:
    try:
        guard = GraphLeakGuard(check_every_n_steps=8, gc_scan=True)
        with pytest.warns(UserWarning, match="_History.hist"):
            make_trainer(tmp_path, callbacks=[guard], max_steps=8).fit(ClassAttributeStoreModule(), loader())
        paths = [t.path for t in guard.reports[0].tensors]
        # The 7 tensors of the earlier steps, each by its position in the class attribute (none as a bare <gc>;
        # tensors other tests left alive in this process may be found too).
        assert [p for p in paths if "_History" in p] == [f"{__name__}._History.hist[{i}]" for i in range(7)]
    finally:
        _History.hist.clear()


def test_gc_scan_touches_no_deprecated_attribute(tmp_path: Path) -> None:
    """`torch.distributed.reduce_op` warns on any attribute access; the scan must not make it."""
    assert torch.distributed.is_available()
    try:
        guard = GraphLeakGuard(check_every_n_steps=3, gc_scan=True)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            make_trainer(tmp_path, callbacks=[guard], max_steps=3).fit(GlobalStoreModule(), loader())
        assert guard.reports  # the scan ran and found the leak
        assert [str(w.message) for w in record if "reduce_op" in str(w.message)] == []
    finally:
        _GLOBAL_LOSSES.clear()


def test_leak_events_are_written(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[GraphLeakGuard(check_every_n_steps=4)])
    with pytest.warns(UserWarning):
        trainer.fit(StoringModule("tensor"), loader())
    events = [json.loads(line) for line in (Path(trainer.log_dir) / "gradkit_events.jsonl").read_text().splitlines()]
    assert [(e["what"], e["step"], e["batch_idx"], e["rank"], e["tensors"], e["graphs"]) for e in events] == [
        ("graph_leak", 4, 3, 0, 3, 3),
        ("graph_leak", 8, 7, 0, 7, 7),
    ]
    assert events[0]["containers"] == {"pl_module.losses": 3}


# -- the pure functions ------------------------------------------------------------------------------------------


class Pair(NamedTuple):
    a: Tensor
    b: Tensor


@dataclass
class Holder:
    value: Tensor


class Tree(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(2, 2)
        self.detached = torch.ones(2)


def test_module_walk_names_paths_through_nested_containers() -> None:
    w = torch.ones(2, requires_grad=True)
    tree = Tree()
    tree.child.cache = {"k": [w * 1, w.detach()]}
    tree.pair = Pair(w * 2, w.detach())
    tree.holder = Holder(w * 3)
    tree.ns = SimpleNamespace(x=w * 4)
    tree.unregistered = [nn.Linear(2, 2)]
    tree.unregistered[0].kept = w * 5
    tree.same = tree.pair  # visited once
    found, truncated = module_graph_tensors(tree, "m")
    assert not truncated
    assert sorted(path for path, _ in found) == [
        "m.child.cache['k'][0]",
        "m.holder.value",
        "m.ns.x",
        "m.pair.a",
        "m.unregistered[0].kept",
    ]
    _, truncated = module_graph_tensors(tree, "m", budget=3)
    assert truncated


def test_older_graph_dates_graphs_by_creation_order() -> None:
    w = torch.ones(3, requires_grad=True)
    old = (w * 2).sum()
    total = old * 1
    marker = autograd_sequence_marker()
    new = (w * 3).sum()
    chained = total + new  # a new node linked to an old graph
    older = OlderGraph(marker)
    assert older(old) and older(chained)
    assert not older(new) and not older(w) and not older(w.detach())


def test_graph_footprint_counts_graphs_nodes_and_freed_saved_tensors() -> None:
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(8, 4)
    a = (x @ w).exp()  # mm saves x; exp saves its result (a itself)
    b = (x @ w).sin()  # mm saves x (same storage); sin saves x @ w
    before = graph_footprint([a, b], storage_keys([w]))
    assert before.graphs == 2  # they share only w's AccumulateGrad node
    assert before.nodes == 4
    assert before.tensor_bytes == a.untyped_storage().nbytes() + b.untyped_storage().nbytes()
    assert before.saved_bytes == x.untyped_storage().nbytes() + 8 * 4 * 4  # x once, plus the (x @ w) sin saved
    joined = graph_footprint([a, a + b], storage_keys([w]))
    assert joined.graphs == 1
    b.sum().backward()  # frees b's saved tensors
    after = graph_footprint([a, b], storage_keys([w]))
    assert after.saved_bytes == x.untyped_storage().nbytes()  # still saved by a's graph
    assert (after.graphs, after.nodes) == (2, 4)


def test_steady_growth_detects_a_trend_not_a_jump_or_noise() -> None:
    g = torch.Generator().manual_seed(0)
    noise = (torch.rand(10, generator=g) * 2e5).tolist()
    linear = [1e8 + 3e6 * i + n for i, n in enumerate(noise)]
    slope = steady_growth(linear, min_growth=1 << 20)
    assert slope == pytest.approx(3e6, rel=0.05)
    assert steady_growth([1e8 + n for n in noise], min_growth=1 << 20) is None  # flat
    assert steady_growth([1e8] + [2e8] * 9, min_growth=1 << 20) is None  # one allocation at the start
    assert steady_growth([1e8 + 10 * i for i in range(10)], min_growth=1 << 20) is None  # too small to matter
    assert steady_growth([1e8 - 3e6 * i for i in range(10)], min_growth=1 << 20) is None  # shrinking


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"check_every_n_steps": 0}, "check_every_n_steps"),
        ({"check_every_n_steps": -1}, "check_every_n_steps"),
        ({"check_every_n_steps": True}, "check_every_n_steps"),
        ({"action": "skip"}, "action"),
        ({"trend_window": 2}, "trend_window"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GraphLeakGuard(**kwargs)  # type: ignore[arg-type]


class GrowingCudaModule(MLPModule):
    """Keeps an unused activation graph per step: 3 x 4 MiB (the kept output, and the two tensors its graph saved)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[Tensor] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        ones = torch.ones(1024, 1024, device=self.device)  # saved by the multiplication
        big = self.encoder[0].weight.sum() * ones  # saved by sin()
        self.kept.append(big.sin())
        return super().training_step(batch, batch_idx)


@pytest.mark.gpu
def test_cuda_memory_trend_is_reported(tmp_path: Path) -> None:
    guard = GraphLeakGuard(check_every_n_steps=1, trend_window=5)
    trainer = make_trainer(tmp_path, callbacks=[guard], accelerator="cuda", max_steps=8)
    with pytest.warns(UserWarning, match="rose steadily"):
        trainer.fit(GrowingCudaModule(), loader())
    step_bytes = 3 * 4 * 2**20
    assert guard.memory_trend == pytest.approx(step_bytes, rel=0.05)
    first = guard.reports[0]
    assert [t.path for t in first.tensors] == ["pl_module.kept[0]"]
    assert first.footprint.pinned_bytes == step_bytes
    assert first.tensors[0].device == "cuda:0"
