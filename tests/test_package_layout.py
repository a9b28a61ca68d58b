"""The package layout keeps its promises: ``core`` imports no Lightning, no module basename repeats."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_gradkit

PACKAGE = Path(lightning_gradkit.__file__).parent
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


def _module_file(name: str) -> Path | None:
    parts = name.split(".")[1:]
    for candidate in (PACKAGE.joinpath(*parts).with_suffix(".py"), PACKAGE.joinpath(*parts, "__init__.py")):
        if candidate.is_file():
            return candidate
    return None


def test_core_imports_no_lightning_even_through_the_package() -> None:
    # Follow core's imports of lightning_gradkit modules transitively: none may reach Lightning.
    todo = sorted((PACKAGE / "core").glob("*.py"))
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imports(path):
            top = name.split(".")[0]
            assert top not in FRAMEWORKS, f"{path.relative_to(PACKAGE)} imports {name}"
            if top == "lightning_gradkit" and name != "lightning_gradkit":
                target = _module_file(name)
                assert target is not None, name
                todo.append(target)
            assert name != "lightning_gradkit", f"{path.relative_to(PACKAGE)} imports the whole package"
    assert PACKAGE / "core" / "norms.py" in seen  # the walk did run over core


def test_no_module_basename_repeats() -> None:
    names = [p.name for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    assert len(names) > 20
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


def test_the_walk_catches_a_lightning_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from lightning.pytorch import Trainer\n")
    assert "lightning.pytorch" in _imports(bad)
