"""Every code block of the documentation site (``docs/**/*.md``) runs here, as a reader would copy it.

A page's fenced blocks are taken by language:

- ``python``: the page's blocks run in order in one namespace (a later block may use what an earlier one defined, as
  a reader follows the page), in a fresh working directory, and then the page's entry in ``OUTCOMES`` checks what
  they were meant to produce (a metric logged, a step skipped, an event written). ``SHRINK`` lists the only edits
  made before running (a shorter run than the page shows); each must still match the page.
- ``bash``: each command is checked without running its side effects: a ``make`` target exists (``make -n``), a
  ``pip`` line names extras that ``pyproject.toml`` declares (and the wheel of its version), an example's command line
  is accepted by the example (LightningCLI builds the Trainer with ``run=False``; ``--help`` output names the class;
  argparse parses it). A command this file has no check for fails the test.
- ``yaml``: parsed, and every ``class_path`` imports and builds with its ``init_args``.
- ``text``: output or a listing, not code. ``{directive}`` fences (``{eval-rst}``, ``{toctree}``, ``{include}``) are
  Sphinx's, checked by the ``-W`` build (``make docs``).

The docstring examples (``>>>``) of the public names of both roots (``help()`` and the pages show them) run as
doctests, each in a namespace of its own: an example imports what it uses.

The names of other projects that the site links (``docs/external_names.py``) each designate an object of the installed
package, the one their anchor names, and their URLs stay under the project's documentation root.
"""

from __future__ import annotations

import ast
import contextlib
import doctest
import importlib
import importlib.util
import io
import json
import re
import shlex
import subprocess
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import yaml

ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if not {"_build"} & set(p.parts))

# A fence opens with 3+ backticks (indented in a list item or not) and closes with the same fence at the same indent.
FENCE = re.compile(
    r"^(?P<indent>[ ]*)(?P<fence>`{3,})(?P<info>[^`\n]*)\n(?P<body>.*?)^(?P=indent)(?P=fence)[ ]*$", re.M | re.S
)


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    language: str
    code: str


def blocks(page: str) -> list[Block]:
    text = (DOCS / page).read_text()
    found = []
    for match in FENCE.finditer(text):
        indent = len(match["indent"])
        code = "".join(line[indent:] if line[:indent].isspace() else line for line in match["body"].splitlines(True))
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(page, line, match["info"].strip().split(" ")[0], code))
    return found


def test_every_fence_is_a_known_language() -> None:
    unknown = [
        f"{b.page}:{b.line}: {b.language!r}"
        for page in PAGES
        for b in blocks(page)
        if b.language not in ("python", "bash", "yaml", "text") and not b.language.startswith("{")
    ]
    assert not unknown, f"code blocks this test cannot run (python, bash, yaml; text for output): {unknown}"


# ---------------------------------------------------------------------------------------------------------- python

# (page, text on the page, what runs instead): a shorter run than the page shows, nothing else.
SHRINK: dict[str, list[tuple[str, str]]] = {
    "getting_started.md": [("max_steps=48", "max_steps=2")],
}


def _events(directory: Path) -> list[dict[str, Any]]:
    files = sorted(directory.rglob("gradkit_events.jsonl"))
    return [json.loads(line) for file in files for line in file.read_text().splitlines()]


def _getting_started(ns: dict[str, Any], cwd: Path, caught: list[warnings.WarningMessage]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert ns["trainer"].global_step == 2
    (run,) = cwd.glob("lightning_logs/version_*")
    assert (run / "gradient_report.png").is_file()
    events = EventAccumulator(str(run)).Reload()
    assert len(events.Scalars("grad_norm/total")) == 2  # every step in the report (the default logger's run)
    # The first thing a visitor runs shows no warning of ours (it warned that 48 steps are fewer than the period).
    ours = [str(w.message) for w in caught if "gradkit" in w.filename or "GradNormMonitor" in str(w.message)]
    assert not ours, ours


def _norm_logging(ns: dict[str, Any], cwd: Path, caught: list[warnings.WarningMessage]) -> None:
    keys = ns["keys"]
    assert {"grad_norm/total", "grad_norm/param_group_0", "update_ratio/total"} <= set(keys), keys
    assert any(k.startswith("grad_norm/module/model.blocks.") for k in keys), keys
    assert len(ns["norms"]) == 4 and all(norm > 0 for norm in ns["norms"])  # every step logged


def _clipping(ns: dict[str, Any], cwd: Path, caught: list[warnings.WarningMessage]) -> None:
    last = ns["last"]
    assert float(last["grad_norm/total"]) > 0.05  # the model's norm is above the ceiling: the clip acted
    assert float(last["grad_norm/total_post_clip"]) == pytest.approx(0.05, rel=1e-4)
    assert ns["manual"].norm.ndim == 0 and float(ns["manual"].norm) > 0  # the norm of its last step


def _anomalies(ns: dict[str, Any], cwd: Path, caught: list[warnings.WarningMessage]) -> None:
    (event,) = [e for e in _events(cwd) if e["source"] == "NonFiniteGuard"]
    assert event["step"] == 3 and event["action"] == "skip" and event["culprit"] == "model.blocks.1.mlp"
    assert any("NonFiniteGuard" in str(w.message) for w in caught)
    assert [type(c).__name__ for c in ns["rollback_trainer"].callbacks if "Spike" in type(c).__name__] == [
        "SpikeGuard",
        "SpikeRollback",
    ]


def _early_warning(ns: dict[str, Any], cwd: Path, caught: list[warnings.WarningMessage]) -> None:
    warning, (run,) = ns["warning"], list(cwd.glob("logs/lightning_logs/version_*"))
    assert warning.attention_modules == ["model.blocks.0.attn", "model.blocks.1.attn"] and warning.warnings == []
    assert "signals/attn_logit_max/model.blocks.0.attn" in (run / "metrics.csv").read_text().splitlines()[0]
    assert (run / "gradient_report.png").is_file()
    assert ns["watch"].thresholds["spike_score"] == 0.01
    ladder = ns["ladder"]  # a healthy run: calm, QK-Clip still off, the z-loss weight 0
    assert (ns["guarded"].global_step, ladder.rung, ladder.transitions) == (4, "calm", [])
    clip = next(cb for cb in ns["guarded"].callbacks if type(cb).__name__ == "QKClip")
    assert clip.attention_modules and not clip.active and float(ladder.z_loss_weight) == 0.0
    assert (ns["skipping"].global_step, ns["declared"].dropped, ns["kit"].skipped_steps) == (6, 2, 2)
    fresh = [w for w in caught if str(w.message).startswith("Resuming with no saved state for StepsToSkip: ")]
    assert len(fresh) == 1 and ns["restarted"].state_dict()["step"] == 0  # the restart loaded, StepsToSkip fresh


def _activation_checkpointing(ns: dict[str, Any], cwd: Path, caught: list[warnings.WarningMessage]) -> None:
    assert ns["names_before"] == ns["names_after"]  # state_dict keys unchanged by the injection
    assert ns["trainer"].global_step == 3
    assert ns["checkpointing"].saved_bytes_after < ns["checkpointing"].saved_bytes_before
    assert ns["checkpointed"] == ["blocks.1", "blocks.3"]


def _validation(ns: dict[str, Any], cwd: Path, caught: list[warnings.WarningMessage]) -> None:
    assert ns["seen"] == [True, True]  # both validation batches ran under torch.inference_mode


def _accumulation(ns: dict[str, Any], cwd: Path, caught: list[warnings.WarningMessage]) -> None:
    # 6 batches in windows of 4: 2 optimizer steps, the last window of 2 batches.
    assert ns["trainer"].global_step == 2
    assert ns["manual_trainer"].global_step == 2


def _diagnostics(ns: dict[str, Any], cwd: Path, caught: list[warnings.WarningMessage]) -> None:
    (block,) = [b for b in blocks("jobs/diagnostics.md") if b.language == "python"]
    item_line = 1 + next(i for i, line in enumerate(block.code.splitlines()) if "loss.item()" in line)
    assert [(site.filename, site.lineno) for site in ns["audit"].report] == [
        (f"docs/jobs/diagnostics.md:{block.line}", item_line)
    ]
    assert any("history" in str(report) for report in ns["leaks"].reports)


def _doors(ns: dict[str, Any], cwd: Path, caught: list[warnings.WarningMessage]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert ns["kit"].skipped_steps == 1  # the plain loop's fourth step had a NaN loss and gradients
    assert [(e["step"], e["action"]) for e in _events(cwd / "runs" / "exp1")] == [(3, "skip")]
    (run,) = {path.parent for path in (cwd / "runs" / "exp1").rglob("events.out.tfevents.*")}  # one run
    scalars = EventAccumulator(str(run)).Reload().Tags()["scalars"]
    assert {"grad_norm/total", "grad_norm/total_post_clip"} <= set(scalars), scalars
    assert ns["fabric_kit"].state_dict()["step"] == 4 and ns["fabric_kit"].skipped_steps == 0


def _scale(ns: dict[str, Any], cwd: Path, caught: list[warnings.WarningMessage]) -> None:
    from lightning.pytorch import LightningModule

    # The blocks define the hooks (a mesh needs 4 processes: tests/test_hsdp_distributed.py and
    # tests/test_expert_parallel_distributed.py run one each).
    assert ns["HSDPModule"].configure_model is not LightningModule.configure_model
    assert ns["MoEModule"].configure_model is not LightningModule.configure_model
    assert callable(ns["train_stage"])  # a pipeline needs 2 processes: tests/test_pipeline_parallel_distributed.py
    assert callable(ns["train_context_parallel"])  # ring attention needs 2 GPUs: tests/test_context_parallel_gpu.py


def _hf_door(ns: dict[str, Any], cwd: Path, caught: list[warnings.WarningMessage]) -> None:
    rows = [row for row in ns["trainer"].state.log_history if "grad_norm/total" in row]
    # Every logging_steps=2, and the first step of each run: 1, then 3 in the run resumed from step 2.
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert (cwd / "hf-run" / "checkpoint-2" / "gradkit_state.pt").is_file()
    assert ns["trainer"].state.global_step == 4 and ns["door"].kit.state_dict()["step"] == 4  # resumed at 2
    assert not any("HFGradKit clips for HF" in str(w.message) for w in caught)  # an info note, not a warning


def _playbook(ns: dict[str, Any], cwd: Path, caught: list[warnings.WarningMessage]) -> None:
    reproducible, transient = ns["reproducible"], ns["transient"]
    assert reproducible["reproducible"] is True and reproducible["culprit"] == "model.blocks.1.mlp"
    assert transient["reproducible"] is None and "replay" in transient["reproducible_reason"]


# page -> the check of what its blocks produced: (the namespace, the working directory, the warnings raised).
OUTCOMES: dict[str, Callable[[dict[str, Any], Path, list[warnings.WarningMessage]], None]] = {
    "getting_started.md": _getting_started,
    "jobs/norm_logging.md": _norm_logging,
    "jobs/clipping.md": _clipping,
    "jobs/anomalies.md": _anomalies,
    "jobs/early_warning.md": _early_warning,
    "jobs/activation_checkpointing.md": _activation_checkpointing,
    "jobs/validation.md": _validation,
    "jobs/accumulation.md": _accumulation,
    "jobs/diagnostics.md": _diagnostics,
    "doors.md": _doors,
    "hf_door.md": _hf_door,
    "scale.md": _scale,
    "playbook.md": _playbook,
}

PYTHON_PAGES = [page for page in PAGES if any(b.language == "python" for b in blocks(page))]
# page -> the optional package its blocks need (an extra of pyproject.toml): without it the page's run is skipped.
REQUIRES = {"hf_door.md": "transformers"}


def test_every_page_with_python_has_an_outcome_check() -> None:
    missing = sorted(set(PYTHON_PAGES) - set(OUTCOMES))
    assert not missing, f"pages whose python blocks run with no check of their result (add one to OUTCOMES): {missing}"
    assert set(OUTCOMES) <= set(PYTHON_PAGES), sorted(set(OUTCOMES) - set(PYTHON_PAGES))
    for page, edits in SHRINK.items():
        text = (DOCS / page).read_text()
        assert all(old in text for old, _ in edits), f"{page}: a SHRINK edit no longer matches the page"


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_python_blocks_run(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if page in REQUIRES:
        pytest.importorskip(REQUIRES[page])
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for block in blocks(page):
            if block.language != "python":
                continue
            code = block.code
            for old, new in SHRINK.get(page, []):
                code = code.replace(old, new)
            exec(compile(code, f"docs/{page}:{block.line}", "exec"), namespace)
    OUTCOMES[page](namespace, tmp_path, caught)


def _import_origins(tree: ast.Module) -> dict[str, str]:
    """Each name a block's imports bind -> the module it comes from (``import a.b`` binds ``a``)."""
    origins = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            origins.update({alias.asname or alias.name: node.module for alias in node.names})
        elif isinstance(node, ast.Import):
            origins.update({(alias.asname or alias.name).split(".")[0]: alias.name for alias in node.names})
    return origins


# The one import of every door but the Trainer's: the policies, GradKit and HF's `install` from `gradkit`.
DOOR_IMPORTS = {"GradKit": "gradkit", "install": "gradkit"}


def test_loop_and_hf_door_blocks_import_from_gradkit() -> None:
    """One import per door, taught the same way on every page: a block that builds the loop door (``GradKit(...)``,
    Fabric included) or the HF door (``install(...)``) takes each gradkit name it uses from ``gradkit`` itself (not
    ``lightning_gradkit``, which loads Lightning, nor a submodule), whether it imports it or an earlier block of the
    page did (the page's blocks share one namespace)."""
    checked, wrong = 0, []
    for page in PYTHON_PAGES:
        origins: dict[str, str] = {}
        for block in blocks(page):
            if block.language != "python":
                continue
            tree = ast.parse(block.code)
            origins.update(_import_origins(tree))
            calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
            if not calls & set(DOOR_IMPORTS):
                continue
            checked += 1
            used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            for name in sorted(used):
                module = origins.get(name, "")
                if module.split(".")[0] in ("gradkit", "lightning_gradkit") and module != DOOR_IMPORTS.get(
                    name, "gradkit"
                ):
                    wrong.append(f"docs/{page}:{block.line}: `{name}` from `{module}`")
    assert checked >= 4, checked  # doors.md (loop, Fabric), hf_door.md, jobs/early_warning.md
    assert not wrong, f"loop-door and HF-door blocks that import from elsewhere than `gradkit`: {wrong}"


# ---------------------------------------------------------------------------------------------------------- bash


def _commands(block: Block) -> list[list[str]]:
    text = block.code.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in text.splitlines() if line.split("#", 1)[0].strip()]


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"docs_example_{name}", ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_make(args: list[str]) -> None:
    (target,) = args
    done = subprocess.run(["make", "-n", "-C", str(ROOT), target], capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"`make {target}`: {done.stderr}"


def _check_pip(args: list[str]) -> None:
    # pyproject.toml read with two patterns (tomllib is Python 3.11+, the package supports 3.10)
    pyproject = (ROOT / "pyproject.toml").read_text()
    (version,) = re.findall(r'^version = "([^"]+)"', pyproject, re.M)
    table = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^([A-Za-z0-9_-]+) = \[", table, re.M))
    wheel = f"dist/lightning_gradkit-{version}-py3-none-any.whl"
    options = {"-e", "--no-deps", "-w", "dist"}
    # The CPU torch + torchvision pitfall (getting started): torch pinned as the Makefile pins it.
    (torch_pin,) = set(re.findall(r"pip install -q (torch==\S+)", (ROOT / "Makefile").read_text()))
    third_party = {torch_pin, "torchvision==0.28.0", "timm", "--index-url", "https://download.pytorch.org/whl/cpu"}
    for spec in args[1:]:
        if spec in options or spec in third_party:
            continue
        path, _, named = spec.partition("[")
        assert path in (".", wheel), f"`pip {' '.join(args)}`: {path!r} is neither the checkout nor {wheel}"
        unknown = set(filter(None, named.rstrip("]").split(","))) - extras
        assert not unknown, f"`pip {' '.join(args)}`: extras {unknown} are not in pyproject.toml ({sorted(extras)})"


def _check_tiny_gpt(args: list[str]) -> None:
    assert args[0] == "fit", args
    example = _example("tiny_gpt")
    args = [a.replace("examples/", f"{ROOT}/examples/") for a in args[1:]]
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        try:
            cli = example.TinyGPTCLI(example.TinyGPTModule, example.StdlibTextDataModule, args=args, run=False)
        except SystemExit as stop:
            assert stop.code == 0, output.getvalue()[-2000:]
            helped = [a.split(".")[-1] for a in args[args.index("--trainer.callbacks.help") + 1 :]]
            assert helped and all(name in output.getvalue() for name in helped), output.getvalue()[-2000:]
            return
    named = [a.split("=")[1].split(".")[-1] for a in args if a.startswith("--trainer.callbacks+=")]
    if not named:
        return
    # The callbacks it adds are new to the config it starts from, each once, and the overrides after them reach them.
    first = next(i for i, a in enumerate(args) if a.startswith("--trainer.callbacks+="))
    with contextlib.redirect_stdout(output):
        preset = example.TinyGPTCLI(example.TinyGPTModule, example.StdlibTextDataModule, args=args[:first], run=False)
    before = Counter(type(c).__name__ for c in preset.trainer.callbacks)
    after = Counter(type(c).__name__ for c in cli.trainer.callbacks)
    assert after - before == Counter(named) and not before & Counter(named), (before, after)
    (added,) = [c for c in cli.trainer.callbacks if type(c).__name__ == named[-1]]
    for override in [a for a in args[first + 1 :] if a.startswith("--trainer.callbacks.")]:
        key, _, value = override.removeprefix("--trainer.callbacks.").partition("=")
        assert str(getattr(added, key)) == value, (override, getattr(added, key))


def _check_fabric_pretrain(args: list[str]) -> None:
    parsed = _example("fabric_pretrain").parse_args(args)
    assert parsed.out_dir is not None


def _check_hf_finetune(args: list[str]) -> None:
    if importlib.util.find_spec("transformers") is None:  # the huggingface extra: the example imports it
        assert (ROOT / "examples" / "hf_finetune.py").is_file()
        return
    parsed = _example("hf_finetune").parse_args(args)
    assert parsed.out_dir is not None


def test_bash_commands_are_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["docs"])
    checked = 0
    for page in PAGES:
        for block in blocks(page):
            if block.language != "bash":
                continue
            for argv in _commands(block):
                where = f"docs/{page}:{block.line}: {shlex.join(argv)}"
                match argv:
                    case ["make", *rest]:
                        _check_make(rest)
                    case ["pip", ("install" | "wheel"), *_]:
                        _check_pip(argv[1:])
                    case ["python", "examples/tiny_gpt.py", *rest]:
                        _check_tiny_gpt(rest)
                    case ["python", "examples/fabric_pretrain.py", *rest]:
                        _check_fabric_pretrain(rest)
                    case ["python", "examples/hf_finetune.py", *rest]:
                        _check_hf_finetune(rest)
                    case _:
                        pytest.fail(f"{where}: no check for this command in tests/test_docs.py")
                checked += 1
    assert checked >= 8


# ---------------------------------------------------------------------------------------------------------- yaml


def test_yaml_blocks_build_their_classes() -> None:
    """Every ``class_path`` of a YAML block imports and builds with its ``init_args``, as LightningCLI would."""

    def specs(node: Any) -> list[dict[str, Any]]:
        if isinstance(node, dict):
            own = [node] if isinstance(node.get("class_path"), str) else []
            return own + [spec for value in node.values() for spec in specs(value)]
        if isinstance(node, list):
            return [spec for value in node for spec in specs(value)]
        return []

    built = []
    for page in PAGES:
        for block in blocks(page):
            if block.language == "yaml":
                for spec in specs(yaml.safe_load(block.code)):
                    module, _, name = spec["class_path"].rpartition(".")
                    cls = getattr(importlib.import_module(module), name)
                    built.append(cls(**spec.get("init_args", {})))
    # an unknown or invalid init_arg raises at construction (TypeError, ValueError naming the argument)
    assert {"GradKitDDPStrategy", "ZClip"} <= {type(b).__name__ for b in built}, built


# ---------------------------------------------------------------------------------------------------------- reference


def _public() -> dict[str, object]:
    import lightning_gradkit

    return {f"lightning_gradkit.{name}": getattr(lightning_gradkit, name) for name in lightning_gradkit.__all__}


def test_every_public_name_is_in_the_api_reference() -> None:
    import gradkit

    documented = {
        match
        for page in PAGES
        for match in re.findall(r"^\.\. auto(?:class|function):: (\S+)", (DOCS / page).read_text(), re.M)
    }
    # A name of both roots is documented under the one the docs teach for its door (`gradkit.GradKit`: the loop door).
    torch_root = {name.removeprefix("gradkit.") for name in documented if name.startswith("gradkit.")}
    documented |= {
        f"lightning_gradkit.{name}"
        for name in torch_root & set(gradkit.__all__)
        if _public().get(f"lightning_gradkit.{name}") is getattr(gradkit, name)
    }
    missing = sorted(set(_public()) - documented)
    assert not missing, f"public names with no autodoc entry in docs/: {missing}"
    stale = sorted(name for name in documented if name.startswith("lightning_gradkit.") and name not in _public())
    assert not stale, f"autodoc entries for names that are not in lightning_gradkit.__all__: {stale}"


def _documented_objects() -> dict[str, object]:
    """The public names of both roots whose docstrings a reader sees (``help()``, the pages); an object of both roots
    once, under ``lightning_gradkit``. The torch policies' examples run behind the loop door, the callbacks' in a
    Trainer."""
    import gradkit

    public = _public()
    shared = {id(obj) for obj in public.values()}
    torch_root = {f"gradkit.{name}": getattr(gradkit, name) for name in gradkit.__all__}
    return {**public, **{name: obj for name, obj in torch_root.items() if id(obj) not in shared}}


def _doctests(name: str) -> list[doctest.DocTest]:
    found = doctest.DocTestFinder(recurse=False).find(_documented_objects()[name], name, globs={})
    return [t for t in found if t.examples]


@pytest.mark.parametrize("name", [name for name in sorted(_documented_objects()) if _doctests(name)])
def test_docstring_examples_run(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    output = io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what an example's Trainer warns about (no GPU, small runs) is not its result
        for test in _doctests(name):
            runner.run(test, out=output.write)
    assert runner.failures == 0, output.getvalue()
    assert runner.tries > 0


# ---------------------------------------------------------------------------------------------------------- links


def _external_names() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_external_names", DOCS / "external_names.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXTERNAL = _external_names()
# the official documentation root of each project the site links
OFFICIAL_ROOTS = {
    "python": "https://docs.python.org/3/",
    "torch": "https://docs.pytorch.org/docs/stable/",
    "lightning": "https://lightning.ai/docs/pytorch/stable/",
    "transformers": "https://huggingface.co/docs/transformers/",
}
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def _resolve(dotted: str) -> object:
    """The object a dotted name designates: its longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ImportError(f"no module of {dotted!r} imports")


@pytest.mark.parametrize("name", sorted(EXTERNAL.NAMES))
def test_external_name_is_an_object_of_the_installed_package(name: str) -> None:
    """Each linked name designates an object of the installed package, and its anchor, where the anchor is a Python
    name (not a section), designates the same object: the page documents what the signature shows."""
    link = EXTERNAL.NAMES[name]
    if link.project == "transformers":
        pytest.importorskip("transformers")  # the huggingface extra
    target = link.target or name
    found = _resolve(target)
    assert callable(found), f"{name}: {target} is not a class or function"
    if DOTTED.fullmatch(link.anchor):
        assert _resolve(link.anchor) is found, f"{name}: the page documents {link.anchor}, another object"


def test_external_links_stay_under_their_project_roots() -> None:
    assert EXTERNAL.ROOTS == OFFICIAL_ROOTS
    for name, link in EXTERNAL.NAMES.items():
        assert link.project in OFFICIAL_ROOTS, name
        assert link.role in ("class", "function"), name
        assert "://" not in link.page and not link.page.startswith("/") and ".." not in link.page, name
        assert "#" not in link.page and link.anchor and not re.search(r"\s", link.anchor), name
        assert EXTERNAL.url(name) == f"{OFFICIAL_ROOTS[link.project]}{link.page}#{link.anchor}", name


def test_external_inventories_read_back(tmp_path: Path) -> None:
    """The inventories conf.py writes load with Sphinx's own reader, every name at its URL."""
    inventory = pytest.importorskip("sphinx.util.inventory")
    mapping = EXTERNAL.write_inventories(tmp_path)
    assert set(mapping) == set(OFFICIAL_ROOTS)
    loaded = {}
    for root, path in mapping.values():
        data = inventory.InventoryFile.loads(Path(path).read_bytes(), uri=root).data
        for objtype, entries in data.items():
            for name, item in entries.items():
                loaded[name] = (objtype, item.uri)
    assert loaded == {name: (f"py:{link.role}", EXTERNAL.url(name)) for name, link in EXTERNAL.NAMES.items()}


def test_no_public_docstring_writes_a_bare_file_uri() -> None:
    """docutils (the docstrings' reStructuredText, not the MyST pages) turns a standalone ``file:...`` into a hyperlink
    (``file`` is a URI scheme): SyncAudit's "file:line" rendered as a dead link. Written as a literal, it stays text."""
    import gradkit
    import lightning_gradkit

    bare = re.compile(r"(?<![`\w/])file:(?!//)")
    texts = {f"{root.__name__}.{name}": getattr(root, name).__doc__ or "" for root in (lightning_gradkit, gradkit)
             for name in root.__all__}  # fmt: skip
    found = [where for where, text in texts.items() if bare.search(text)]
    assert not found, found
