"""Every private name gradkit reads of another package is mapped in ``lightning_gradkit._compat`` (issue 31 item 5).

The scan is of the source itself: every attribute read ``x._name`` (and ``getattr(x, "_name")``) in both import roots
whose ``_name`` is defined nowhere in them is a private name of torch, Lightning, torchmetrics or the standard
library, and must be named in the map (the docstring of :mod:`lightning_gradkit._compat`), with why. The Lightning
names the scan cannot tell from a name of ours (``_optimizer``, ``_root_device``: gradkit uses those names too) are
listed below and checked by name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_gradkit._compat as compat

ROOT = Path(__file__).resolve().parents[1] / "src"
LIGHTNING_PRIVATE = {
    "_batches_that_stepped",
    "_num_ready_batches_reached",
    "_callback_metrics",
    "_start_method",
    "_root_device",
    "_trainer",
    "_optimizer",
    "_generate_state_key",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own(value: ast.expr) -> bool:
    """``self._x`` / ``cls._x``: a class's own private attribute."""
    return isinstance(value, ast.Name) and value.id in ("self", "cls")


def _foreign_private_reads() -> dict[str, set[str]]:
    defined: set[str] = set()
    read: dict[str, set[str]] = {}
    files = sorted(ROOT.rglob("*.py"))
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.Attribute):
                if isinstance(node.ctx, ast.Store):
                    defined.add(node.attr)
                elif _private(node.attr) and not _own(node.value):
                    read.setdefault(node.attr, set()).add(path.name)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and _private(node.args[1].value)
            ):
                read.setdefault(node.args[1].value, set()).add(path.name)
    modules = {p.stem for p in files}
    return {
        name: where
        for name, where in read.items()
        if name not in defined and name not in modules and not name.startswith("_foreach")
    }


def test_every_foreign_private_read_is_in_the_compat_map() -> None:
    foreign = _foreign_private_reads()
    assert {"_batches_that_stepped", "_scale", "_schema"} <= foreign.keys()  # the scan does find them
    unmapped = {name: sorted(where) for name, where in foreign.items() if name not in compat.__doc__}
    assert unmapped == {}


def test_the_lightning_private_names_are_in_the_map() -> None:
    assert sorted(name for name in LIGHTNING_PRIVATE if name not in compat.__doc__) == []
