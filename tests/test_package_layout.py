"""The package layout keeps its promises: ``core`` imports no Lightning, not even through the package ``__init__``;
the public names and the strategy names are there after ``import lightning_gradkit``; no module basename repeats."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import ModuleType

import pytest

import gradkit
import lightning_gradkit
from gradkit._util.moved import MOVED
from helpers import run_fresh, run_without_lightning

PACKAGE = Path(lightning_gradkit.__file__).parent
TORCH_ROOT = Path(gradkit.__file__).parent
FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities")


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (function-level imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_the_torch_root_imports_no_lightning() -> None:
    # Every module of `gradkit`, at any depth of its functions: no framework, nothing of the Lightning layer.
    files = sorted(TORCH_ROOT.rglob("*.py"))
    assert TORCH_ROOT / "step" / "norms.py" in files and TORCH_ROOT / "doors" / "loop.py" in files
    for path in files:
        for name in _imports(path):
            top = name.split(".")[0]
            assert top not in FRAMEWORKS, f"{path.relative_to(TORCH_ROOT)} imports {name}"
            assert top != "lightning_gradkit", f"{path.relative_to(TORCH_ROOT)} imports {name}"


def test_importing_the_torch_root_loads_no_lightning() -> None:
    # The loop door and the policies, imported the way the docs teach a plain PyTorch loop to.
    run_without_lightning(f"from gradkit import {', '.join(gradkit.__all__)}\nimport gradkit.step.accumulate")


def _torch_policies() -> dict[str, str]:
    """Every class of the torch root that sets a ``stage`` in its body (what places a policy in the pipeline; the
    ``Policy`` protocol only annotates it), read from the source: its name -> its module."""
    found = {}
    for path in sorted(TORCH_ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(target, ast.Name) and target.id == "stage"
                for statement in node.body
                for target in (
                    statement.targets if isinstance(statement, ast.Assign) else
                    [statement.target] if isinstance(statement, ast.AnnAssign) and statement.value else []
                )
            ):  # fmt: skip
                found[node.name] = (
                    f"gradkit.{path.relative_to(TORCH_ROOT).with_suffix('').as_posix().replace('/', '.')}"
                )
    return found


def test_the_torch_root_exports_every_policy_under_its_callbacks_name() -> None:
    # One import per door: `from gradkit import ZClip` for a loop, Fabric or HF, `from lightning_gradkit import ZClip`
    # for the Trainer, the same name and arguments. `WindowScale` is ManualAccumulator's scale of one window, built by
    # it, never by a user.
    policies = {name: module for name, module in _torch_policies().items() if name != "WindowScale"}
    assert len(policies) == 14, sorted(policies)
    for name, module in policies.items():
        assert name in gradkit.__all__, f"`from gradkit import {name}` fails"
        assert getattr(gradkit, name) is getattr(importlib.import_module(module), name)
        assert issubclass(getattr(lightning_gradkit, name), getattr(gradkit, name)), name


def test_importing_the_package_before_lightning_registers_the_strategy_names() -> None:
    # Lightning imported first is the in-process case of tests/test_strategy.py.
    out = run_fresh(
        "import lightning_gradkit\n"
        "from lightning.pytorch import Trainer\n"
        "trainer = Trainer(strategy='gradkit_ddp', accelerator='cpu', devices=2, logger=False, "
        "enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)\n"
        "print(type(trainer.strategy).__name__, trainer.strategy._start_method)"
    ).stdout
    assert out.split()[-2:] == ["GradKitDDPStrategy", "popen"]


def test_lightning_cli_resolves_short_class_names_when_lightning_is_imported_first() -> None:
    # LightningCLI (jsonargparse) looks short class paths up among the imported subclasses of `Callback`.
    out = run_fresh(
        "import lightning.pytorch, lightning_gradkit\n"
        "from jsonargparse import ArgumentParser\n"
        "from lightning.pytorch.callbacks import Callback\n"
        "parser = ArgumentParser()\n"
        "parser.add_argument('--cb', type=Callback)\n"
        "print(parser.parse_args(['--cb', 'ZClip', '--cb.z_threshold', '2.5']).cb.class_path)"
    ).stdout
    assert out.split()[-1] == "lightning_gradkit.ZClip"


def test_every_public_name_imports_from_the_package() -> None:
    for name in lightning_gradkit.__all__:
        assert getattr(lightning_gradkit, name).__name__ == name
    assert set(lightning_gradkit.__all__) <= set(dir(lightning_gradkit))


def test_no_module_basename_repeats() -> None:
    names = [p.name for root in (PACKAGE, TORCH_ROOT) for p in root.rglob("*.py") if p.name != "__init__.py"]
    assert len(names) > 20
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


def test_the_walk_catches_a_lightning_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from lightning.pytorch import Trainer\n")
    assert "lightning.pytorch" in _imports(bad)


def _public_definitions(path: Path) -> tuple[set[str], list[str] | None]:
    """The public names a module defines at its top level (not those it imports), and its ``__all__``."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    listed: list[str] | None = None

    def add(target: ast.expr) -> None:
        if isinstance(target, ast.Name):
            names.add(target.id)
        elif isinstance(target, ast.Tuple | ast.List):
            for element in target.elts:
                add(element)

    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                listed = list(ast.literal_eval(node.value))
                continue
            for target in node.targets:
                add(target)
        elif isinstance(node, ast.AnnAssign):
            add(node.target)
    return {n for n in names if not n.startswith("_")}, listed


def test_every_module_lists_its_public_names_in_all() -> None:
    # A name without a leading `_` is public: `__all__` names every one, and a helper used only in its own module
    # starts with `_`. Each listed name must exist (a re-export included).
    for path in sorted(PACKAGE.rglob("*.py")):
        public, listed = _public_definitions(path)
        where = path.relative_to(PACKAGE)
        if listed is None:
            assert not public, f"{where} defines {sorted(public)} but has no `__all__`"
            continue
        assert sorted(public - set(listed)) == [], f"{where}: public names missing from `__all__`"
        parts = [part for part in where.with_suffix("").parts if part != "__init__"]
        module = importlib.import_module(".".join(["lightning_gradkit", *parts]))
        missing = [name for name in listed if not hasattr(module, name)]
        assert missing == [], f"{where}: `__all__` lists names it does not have"


def test_the_torch_root_is_arranged_by_role() -> None:
    # Issue 40: 47 flat modules with prefix families became a few packages by role; at most 8 entries at the top.
    entries = sorted(p.name for p in TORCH_ROOT.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 8, entries
    assert {"step", "policies", "doors", "report"} <= set(entries)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_module_still_imports_with_a_deprecation_warning(old: str) -> None:
    # One release of grace for every module path of the flat layout: the old path gives the new module's objects and
    # says where they went, at the line that reads them.
    if MOVED[old] == "doors.huggingface":
        pytest.importorskip("transformers", reason="the HF door's module needs transformers (the huggingface extra)")
    new = importlib.import_module(f"gradkit.{MOVED[old]}")
    name = next(n for n in getattr(new, "__all__", dir(new)) if not n.startswith("_"))
    with pytest.warns(DeprecationWarning, match=rf"`gradkit\.{old}` moved to `gradkit\.{MOVED[old]}`") as caught:
        value = getattr(importlib.import_module(f"gradkit.{old}"), name)
    assert value is getattr(new, name)
    assert caught[0].filename == __file__


def _module_graph(src: Path, package: str) -> dict[str, set[str]]:
    """The module-level import graph of ``package`` under ``src``: each module -> the package's modules it imports
    at its top level, ``if TYPE_CHECKING:`` blocks included (a type-level cycle is a cycle to a reader and to a
    type checker), imports inside functions excluded (they run at call time, once every module is loaded)."""
    modules = {}
    for path in (src / package).rglob("*.py"):
        name = ".".join(path.relative_to(src).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path

    def imported(node: ast.AST) -> set[str]:
        found: set[str] = set()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.update(
                    f"{child.module}.{alias.name}" if f"{child.module}.{alias.name}" in modules else child.module
                    for alias in child.names
                )
            elif isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            found |= imported(child)
        return found

    def known(name: str) -> str:
        while name and name not in modules:  # `a.b.func` -> `a.b`; outside the package -> ""
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in map(known, imported(ast.parse(path.read_text()))) if m and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan's algorithm), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_torch_root_has_no_import_cycle_not_even_a_type_level_one() -> None:
    # Issue 40: an 8-module cycle around the pipeline (type-level) and norms <-> replicas. Each module's imports,
    # `TYPE_CHECKING` ones included, point away from it: the graph is layered.
    graph = _module_graph(TORCH_ROOT.parent, "gradkit")
    assert len(graph) > 50 and "gradkit.step.protocol" in graph["gradkit.step.pipeline"]
    assert _cycles(graph) == []


def test_the_cycle_walk_catches_a_type_level_cycle_and_leaves_function_imports_out(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import B\n")
    (package / "b.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from pkg.a import A\nB = 1\n")
    (package / "c.py").write_text("import pkg.a\n")
    (package / "d.py").write_text("def late():\n    from pkg.c import x\n")
    (package / "e.py").write_text("from pkg.d import late\n")
    graph = _module_graph(tmp_path, "pkg")
    assert graph["pkg.e"] == {"pkg.d"} and graph["pkg.d"] == set()
    assert _cycles(graph) == [["pkg.a", "pkg.b"]]
    (package / "d.py").write_text("from pkg.e import late\n")  # now at module level: a second cycle
    assert _cycles(_module_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.b"], ["pkg.d", "pkg.e"]]


@pytest.mark.parametrize("root", [gradkit, lightning_gradkit])
def test_step_plan_still_imports_for_one_release_with_a_deprecation_warning(root: ModuleType) -> None:
    # Issue 40: `StepPlan` was split in `StepStats` and `Decision`; the old public name names the new ones.
    with pytest.warns(DeprecationWarning, match=r"StepPlan` was split: .*`StepStats`.*`Decision`") as caught:
        value = root.StepPlan
    assert value.__name__ == "StepRecord" and caught[0].filename == __file__
    assert "StepPlan" not in root.__all__ and {"StepStats", "Decision", "StepOutcome"} <= set(root.__all__)
