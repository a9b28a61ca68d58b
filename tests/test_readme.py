"""The README's argument table names every constructor argument of every public callback."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import shlex
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import pytest

from helpers import exported_callbacks

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"


def argument_table() -> dict[str, str]:
    """The rows of the table under "## Callbacks and strategies": each class named in a row's first cell -> the row's
    second cell (``ClipGradNorm`` and ``ClipGradValue`` share one row)."""
    section = README.read_text().split("## Callbacks and strategies", 1)[1]
    table = section.split("| name | arguments (defaults) |", 1)[1].split("\n\n", 1)[0]
    rows: dict[str, str] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]  # `\|` is a pipe in a cell
        if not line.startswith("| `") or len(cells) != 2:
            continue
        for name in re.findall(r"`(\w+)`", cells[0]):
            rows[name] = cells[1]
    return rows


def public_callbacks() -> list[type[pl.Callback]]:
    return list(exported_callbacks().values())


def test_readme_table_names_every_argument_of_every_public_callback() -> None:
    rows = argument_table()
    missing = {}
    for cls in public_callbacks():
        assert cls.__name__ in rows, f"README table has no row for `{cls.__name__}`"
        arguments = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        absent = [a for a in arguments if not re.search(rf"`{a}[=`]", rows[cls.__name__])]
        if absent:
            missing[cls.__name__] = absent
    assert not missing, f"arguments missing from the README table: {missing}"


def test_readme_table_gives_each_default_the_constructor_has() -> None:
    rows = argument_table()
    wrong = {}
    for cls in public_callbacks():
        for parameter in inspect.signature(cls.__init__).parameters.values():
            # `name=default` or `name="a"\|"b"` (the default first); a bare `name` states no default
            written = re.search(rf"`{parameter.name}=([^`]*)`", rows[cls.__name__])
            if written is None:
                continue
            default = ast.literal_eval(written.group(1).split("\\|")[0])
            if default != parameter.default:
                wrong[f"{cls.__name__}.{parameter.name}"] = (written.group(1), parameter.default)
    assert not wrong, f"README default differs from the constructor's (README, constructor): {wrong}"


def readme_commands(prefix: str) -> list[list[str]]:
    """The README's shell commands that start with ``prefix``, continuation lines joined, split into arguments."""
    text = README.read_text().replace("\\\n", " ")
    return [shlex.split(line.strip()) for line in text.splitlines() if line.strip().startswith(prefix)]


def test_readme_cli_example_adds_a_callback_the_demo_preset_does_not_have(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (command,) = readme_commands("python examples/tiny_gpt.py fit --config examples/configs/demo.yaml")
    monkeypatch.setattr("sys.argv", ["tiny_gpt.py"])
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("tiny_gpt", ROOT / "examples" / "tiny_gpt.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert command[:3] == ["python", "examples/tiny_gpt.py", "fit"]
    args = [a.replace("examples/", f"{ROOT}/examples/") for a in command[3:]]  # without `fit`: run=False
    preset = example.TinyGPTCLI(example.TinyGPTModule, example.StdlibTextDataModule, args=args[:2], run=False)
    result = example.TinyGPTCLI(example.TinyGPTModule, example.StdlibTextDataModule, args=args, run=False)

    before = Counter(type(c).__name__ for c in preset.trainer.callbacks)
    after = Counter(type(c).__name__ for c in result.trainer.callbacks)
    added = after - before
    assert sum(added.values()) == 1 and before == after - added, (before, after)
    (name,) = added
    assert after[name] == 1  # a callback the preset does not already have
    overrides = {a.split("=")[0].removeprefix("--trainer.callbacks."): a.split("=")[1] for a in args[3:]}
    (callback,) = [c for c in result.trainer.callbacks if type(c).__name__ == name]
    for key, value in overrides.items():
        assert str(getattr(callback, key)) == value  # the override reached the added callback


def test_quick_start_runs_without_jsonargparse(tmp_path: Path) -> None:
    """The README's quick start, as written (two optimizer steps instead of 48), in a process where `jsonargparse`
    cannot be imported: only LightningCLI needs it (the `cli` extra)."""
    import subprocess
    import sys

    (snippet,) = re.findall(r"## Quick start\n\n```python\n(.*?)```", README.read_text(), re.S)
    assert "max_steps=48" in snippet
    blocker = (
        "import sys\n"
        "class _NoJsonargparse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'jsonargparse':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _NoJsonargparse())\n"
    )
    script = blocker + snippet.replace("max_steps=48", "max_steps=2") + "assert 'jsonargparse' not in sys.modules\n"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(tmp_path.glob("lightning_logs/version_*/gradient_report.png"))


def site_packages_without(tmp_path: Path, *prefixes: str) -> Path:
    """A copy of this interpreter's site-packages made of links, less the entries whose names start with one of
    ``prefixes`` (the package, its ``.dist-info``): an environment where those packages were never installed, for
    the import system and for ``importlib.metadata`` alike (torchmetrics and Lightning ask the latter)."""
    import site

    (source,) = [Path(p) for p in site.getsitepackages() if Path(p).name == "site-packages"]
    mirror = tmp_path / "site-packages"
    mirror.mkdir()
    for entry in source.iterdir():
        if not entry.name.lower().startswith(prefixes):
            (mirror / entry.name).symlink_to(entry)
    return mirror


def test_quick_start_runs_after_a_plain_install_without_matplotlib(tmp_path: Path) -> None:
    """`pip install .` brings no matplotlib (the `report` extra does): the quick start, as written (two optimizer
    steps instead of 48), runs in an environment without it; `report=True` says in one line, at the user's
    `trainer.fit(...)` line, that it draws nothing and how to get the figure."""
    import subprocess
    import sys

    (snippet,) = re.findall(r"## Quick start\n\n```python\n(.*?)```", README.read_text(), re.S)
    assert "GradNormMonitor(report=True)" in snippet
    mirror = site_packages_without(tmp_path, "matplotlib", "mpl_toolkits", "pylab")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = (
        "import site, sys, warnings\n"
        f"site.addsitedir({str(mirror)!r})\n"
        f"sys.path.insert(0, {str(ROOT / 'src')!r})\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        + "".join(f"    {line}\n" for line in snippet.replace("max_steps=48", "max_steps=2").splitlines())
        + "assert 'matplotlib' not in sys.modules\n"
        "notes = [w for w in caught if 'matplotlib' in str(w.message)]\n"
        "assert len(notes) == 1, [str(w.message) for w in notes]\n"
        "print(notes[0].filename, notes[0].lineno, str(notes[0].message), sep='|')\n"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", script], cwd=run_dir, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    filename, line, message = done.stdout.strip().splitlines()[-1].split("|")
    assert "\n" not in message and "pip install" in message and "matplotlib" in message
    # The note names the user's line (`trainer.fit(...)`), not a file of gradkit or Lightning.
    assert (filename, int(line)) == ("<string>", script.count("\n", 0, script.index("trainer.fit(")) + 1)
    assert not list(run_dir.glob("lightning_logs/version_*/gradient_report.png"))
    assert list(run_dir.glob("lightning_logs/version_*/gradkit_run.json"))  # the run itself went on and logged


def test_the_gpt2_use_cache_limitation_holds_as_the_readme_states_it() -> None:
    """Known limitations: GPT-2 with `use_cache=True` under activation checkpointing. Checked on the installed
    transformers (the README names the version it states): `mode="full"` gives the gradients of the model without
    checkpointing while the recompute appends to the returned KV cache a second time; `mode="selective"` fails in the
    backward; with `use_cache=False` both train."""
    transformers = pytest.importorskip("transformers")
    import torch

    from lightning_gradkit import inject_activation_checkpointing

    limitation = README.read_text().split("## Known limitations", 1)[1]
    assert f"transformers {transformers.__version__}" in limitation, "the README names another transformers release"

    def run(mode: str | None, use_cache: bool) -> tuple[dict[str, torch.Tensor], int]:
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            vocab_size=64, n_positions=12, n_embd=16, n_layer=2, n_head=2, use_cache=use_cache,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
        if mode is not None:
            inject_activation_checkpointing(model, targets=["GPT2Block"], mode=mode)
        ids = torch.randint(64, (4, 12), generator=torch.Generator().manual_seed(1))
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        cached = out.past_key_values.get_seq_length() if out.past_key_values is not None else 0
        return {n: p.grad for n, p in model.named_parameters()}, cached

    plain, cached = run(None, use_cache=True)
    assert cached == 12
    full, cached = run("full", use_cache=True)
    assert all(torch.equal(full[n], g) for n, g in plain.items()) and cached == 24  # each token twice
    with pytest.raises(RuntimeError, match="encountered during backward but not found in storage"):
        run("selective", use_cache=True)
    for mode in ("full", "selective"):
        grads, cached = run(mode, use_cache=False)
        assert cached == 0 and all(torch.allclose(grads[n], g, atol=1e-6) for n, g in plain.items())


def test_the_plain_loop_sink_makes_one_tensorboard_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's plain-PyTorch block, as written, on a small model: its sink writes every metric into one
    TensorBoard run (issue 33: `writer.add_scalars("train", ...)` made one run directory per metric)."""
    pytest.importorskip("tensorboard")
    import torch
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    section = README.read_text().split("**Plain PyTorch**", 1)[1]
    (block,) = re.findall(r"```python\n(.*?)```", section.split("**LR schedulers**", 1)[0], re.S)
    assert "def to_tensorboard" in block and "add_scalars" not in block
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    namespace = {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "loader": [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)],
        "loss_fn": torch.nn.functional.mse_loss,
    }
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), namespace)
    namespace["writer"].close()
    runs = {p.parent for p in (tmp_path / "runs").rglob("events.out.tfevents.*")}
    assert runs == {tmp_path / "runs" / "exp1"}
    accumulator = EventAccumulator(str(tmp_path / "runs" / "exp1"), size_guidance={SCALARS: 0})
    accumulator.Reload()
    tags = accumulator.Tags()[SCALARS]
    assert {"grad_norm/total", "grad_norm/total_post_clip", "grad_norm/module/0", "grad_norm/module/2"} <= set(tags)
