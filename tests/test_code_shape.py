"""The package keeps its function budget, the one shape rule that serves the code: no function over 50 statements,
12 branches or 10 arguments (ruff's PLR0915, PLR0912, PLR0913, configured in pyproject.toml). CI runs no `make lint`,
so the budget is checked here. How deep a ``ClipGradNorm`` step goes (functions and files per door) is a measurement,
printed by ``benchmarks/bench_call_depth.py``; this file only checks that its tracer counts what it says."""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUDGET = ("PLR0912", "PLR0913", "PLR0915")


def _ruff() -> str:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: it is in the `dev` extra (`make test` installs it)")
    return found


def test_every_function_of_the_package_keeps_the_budget() -> None:
    done = subprocess.run(
        [_ruff(), "check", "--select", ",".join(BUDGET), "--output-format", "concise", "src"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_budget_check_sees_a_function_over_it(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(51))
    (tmp_path / "long.py").write_text(f"def long():\n{body}")
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    done = subprocess.run(
        [_ruff(), "check", "--select", ",".join(BUDGET), "--output-format", "concise", "long.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1 and "PLR0915" in done.stdout, done.stdout


def test_the_call_depth_tracer_counts_gradkit_functions_only() -> None:
    spec = importlib.util.spec_from_file_location("bench_call_depth", ROOT / "benchmarks" / "bench_call_depth.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import torch

    from gradkit.norms import total_norm

    functions, files = module.traced(lambda: total_norm(torch.ones(3), 2.0) + torch.ones(1))
    assert functions == ["norms.py:total_norm"] and files == ["norms.py"]


def test_the_skip_count_has_one_writer() -> None:
    """Issue 40: the count of skipped steps had 7 writers in 5 files. Only ``gradkit/accounting.py`` assigns it now;
    everyone else calls its methods (a door's drop, the pipeline's skip, a rollback's rewind, a resume)."""
    writers = []
    for path in (ROOT / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in ("skipped_steps", "_skipped"):
                    writers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert writers and all(w.startswith("src/gradkit/accounting.py:") for w in writers), writers
