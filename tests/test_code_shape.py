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

    from gradkit.step.norms import total_norm

    functions, files = module.traced(lambda: total_norm(torch.ones(3), 2.0) + torch.ones(1))
    assert functions == ["norms.py:total_norm"] and files == ["norms.py"]


def test_the_skip_count_has_one_writer() -> None:
    """Issue 40: the count of skipped steps had 7 writers in 5 files. Only ``gradkit/step/accounting.py`` assigns it
    now; everyone else calls its methods (a door's drop, the pipeline's skip, a rollback's rewind, a resume)."""
    writers = []
    for path in (ROOT / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in ("skipped_steps", "_skipped"):
                    writers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert writers and all(w.startswith("src/gradkit/step/accounting.py:") for w in writers), writers


# Duck-typed checks of objects that are not policies, which share a hook's name: an LR scheduler's `state_dict`.
_NOT_POLICIES = {("src/gradkit/doors/loop_setup.py", "schedulers"), ("src/gradkit/doors/loop_setup.py", "scheduler")}


def _policy_hooks() -> set[str]:
    from gradkit.step.protocol import Policy

    return {name for name, value in vars(Policy).items() if callable(value) and not name.startswith("_")}


def test_hooks_are_looked_up_by_name_in_one_place() -> None:
    """Issue 40: about 30 sites found a policy's hook by name (``hook(policy, "after_step")``, ``getattr(policy,
    "note_loss", None)``). Only ``gradkit/step/protocol.py`` (its ``Roster``) does now; doors read the roster's
    lists."""
    hooks = _policy_hooks()
    sites = []
    for path in (ROOT / "src").rglob("*.py"):
        where = str(path.relative_to(ROOT))
        if where == "src/gradkit/step/protocol.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func.id if isinstance(node.func, ast.Name) else None
            if func not in ("hook", "getattr", "hasattr") or len(node.args) < 2:
                continue  # `hook(*args)` elsewhere is a local function of that name (a wrapped torch hook)
            name, owner = node.args[1], ast.unparse(node.args[0])
            if isinstance(name, ast.Constant) and name.value in hooks and (where, owner) not in _NOT_POLICIES:
                sites.append(f"{where}:{node.lineno}")
    assert sites == [], sites


def test_every_hook_the_roster_looks_up_is_declared_on_policy() -> None:
    """The typed protocol: each name the one lookup passes is a method of ``Policy``, with its no-op default."""
    tree = ast.parse((ROOT / "src" / "gradkit" / "step" / "protocol.py").read_text())
    looked_up = {
        node.args[1].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("hook", "_bound")
        and len(node.args) == 2
        and isinstance(node.args[1], ast.Constant)
    }
    assert len(looked_up) >= 15 and looked_up <= _policy_hooks(), looked_up - _policy_hooks()


def test_the_policy_facing_context_has_at_most_14_members() -> None:
    """Issue 40: ``StepContext`` had 34 members (the model, the pipeline, ``policies()``, ``trainer``...). The
    policies' per-step context keeps 14; the door's services are on ``Door``, which a policy gets at ``attach``."""
    from gradkit.step.protocol import Door, StepContext

    members = {name for name in dir(StepContext) if not name.startswith("_")}
    assert len(members) <= 14, sorted(members)
    assert {"model", "pipeline", "policies", "schedulers", "step_state", "trainer", "pl_module"}.isdisjoint(members)
    assert {"model", "steps", "policies", "schedulers", "step_state", "flat_sharded", "folds_into"} <= set(dir(Door))
    # The door hands a policy its step accounting, not the pipeline (whose type would close an import cycle).
    assert "pipeline" not in dir(Door)


def test_the_decision_has_at_most_10_fields() -> None:
    """Issue 40: ``StepPlan`` had 36 members, measurements, decisions and lazy values together. What the policies
    decide is a ``Decision`` of at most 10 fields (private ones included), written through its methods."""
    from gradkit.step.plan import Decision

    assert len(Decision.__slots__) <= 10, Decision.__slots__
    assert not hasattr(Decision(), "__dict__")  # no field beyond the slots
    assert {"scale", "clip_coef", "param_coefs", "clamp_value", "skip", "folded"} <= set(Decision.__slots__)


def test_the_policy_facing_hooks_take_the_stats_and_the_decision_not_the_pipelines_record() -> None:
    """Issue 40: ``StepPlan`` held the measurements, the decision and (privately) the gradients, and every hook got it
    whole. ``decide`` reads a read-only ``StepStats`` and writes a ``Decision``; ``observe`` reads a ``StepOutcome``;
    the gradients stay in the pipeline's ``StepRecord``, which no hook of ``Policy`` is given."""
    import dataclasses
    import inspect

    from gradkit.step.plan import StepOutcome, StepStats
    from gradkit.step.protocol import Policy

    def annotations(name: str) -> list[str]:
        parameters = inspect.signature(getattr(Policy, name)).parameters.values()
        return [str(p.annotation) for p in parameters if p.name != "self"]

    assert annotations("decide") == ["StepStats", "Decision", "StepContext"]
    assert annotations("decide_again") == ["StepStats", "Decision", "Decision", "StepContext"]
    assert annotations("observe") == ["StepStats", "StepOutcome", "StepContext"]
    every = {a for name in _policy_hooks() for a in annotations(name)}
    assert not {a for a in every if "StepRecord" in a or "StepPlan" in a}, every
    # Read only: the statistics are frozen, and the outcome offers reads of the decision and of what came of it.
    assert dataclasses.fields(StepStats) and StepStats.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert not any("grad" in f.name and f.name != "has_gradients" for f in dataclasses.fields(StepStats))
    reads = {"decision", "post_clip_total", "skip_on_host", "flag_on_host_with_skip", "skip_known_on_host"}
    assert {n for n in vars(StepOutcome) if not n.startswith("_")} == reads | {"was_skipped"}


def test_the_step_gradients_are_kept_by_no_object() -> None:
    """Issue 40: the gradients stay private to the pipeline. ``Pipeline.run`` hands the gradients of its read to
    ``StepRecord.apply`` (and ``step/write.py``); no record, policy, door or adapter keeps them in an attribute."""
    from gradkit.step.pipeline import StepRecord

    holders = []
    for path in (ROOT / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("_grads", "grads"):
                holders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not holders, holders
    assert not [name for name in StepRecord.__slots__ if "grad" in name], StepRecord.__slots__


def _long_functions(root: Path, limit: int = 60) -> list[str]:
    """``file:line name (n lines)`` of every function longer than ``limit`` lines, its docstring left out."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                doc = node.body[0]
                if (
                    isinstance(doc, ast.Expr)
                    and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str)
                ):
                    lines -= doc.end_lineno - doc.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_over_60_lines() -> None:
    """Issue 40: 10 functions were over 60 lines (``_act_at_step`` 90, ``build_figure`` 98). The docstring does not
    count: an argument list explained is not a long function."""
    assert _long_functions(ROOT / "src") == []


def test_the_length_check_sees_a_long_function_and_not_its_docstring(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    doc = '    """' + "\n".join("    doc" for _ in range(70)) + '"""\n'
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n    return x0\n\ndef documented():\n{doc}    return 1\n")
    assert [f.split(" ")[1] for f in _long_functions(tmp_path)] == ["long"]
