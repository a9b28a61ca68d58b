"""The reference pages of the docs site state what the code does: every public callback has its page, its docstring
(the page, ``help()``) describes every constructor argument, and the argument table of ``docs/callbacks/index.md``
names every constructor argument with the constructor's default; a known limitation is checked on the installed
release it names."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest

import lightning_gradkit
from helpers import exported_callbacks

DOCS = Path(__file__).parents[1] / "docs"
CALLBACKS = DOCS / "callbacks" / "index.md"


def argument_table() -> dict[str, str]:
    """The rows of the table under "## Arguments and defaults": each class named in a row's first cell -> the row's
    second cell (``ClipGradNorm`` and ``ClipGradValue`` share one row)."""
    section = CALLBACKS.read_text().split("## Arguments and defaults", 1)[1]
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


def documented_arguments(doc: str) -> dict[str, str]:
    """The ``Args:`` section of a Google-style docstring: each argument -> its description (continuation lines
    joined). Read by indentation only, as napoleon and jsonargparse's docstring parser read it: an entry is a line
    one level in, ``name: text`` or ``name (type): text``."""
    lines = inspect.cleandoc(doc).splitlines()
    if "Args:" not in lines:
        return {}
    entries: dict[str, list[str]] = {}
    current: list[str] = []
    for line in lines[lines.index("Args:") + 1 :]:
        if line and not line.startswith(" "):  # the next section
            break
        entry = re.match(r"^    (\S[^:]*?)(?: \([^)]*\))?:(?: (.*))?$", line)
        if entry and not line.startswith("     "):
            current = entries.setdefault(entry.group(1), [])
            current.append(entry.group(2) or "")
        elif line.strip():
            current.append(line.strip())
    return {name: " ".join(text).strip() for name, text in entries.items()}


def torch_policy(cls: type) -> type | None:
    """The torch policy (a class of the ``gradkit`` root) a callback subclasses, if any: read from the MRO."""
    return next((base for base in cls.__mro__[1:] if base.__module__.split(".")[0] == "gradkit"), None)


def test_every_callback_argument_has_a_description_in_its_docstring() -> None:
    # The docstring is the page (autodoc), `help()` and LightningCLI's `--help`: each argument once, one entry each.
    undocumented, unknown = {}, {}
    for cls in public_callbacks():
        described = documented_arguments(cls.__doc__ or "")
        arguments = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        if missing := [a for a in arguments if not described.get(a)]:
            undocumented[cls.__name__] = missing
        if extra := sorted(set(described) - set(arguments)):  # e.g. `a, b: ...`, which no parser splits
            unknown[cls.__name__] = extra
    assert not undocumented, f"constructor arguments without a description in the class docstring: {undocumented}"
    assert not unknown, f"Args entries that name no constructor argument: {unknown}"


def test_a_policy_callbacks_docstring_holds_its_torch_policys_text() -> None:
    # One text for both roots: the callback's docstring holds the torch class's text up to its sections and its Args
    # section verbatim; the loop-door example stays the torch class's, the callback shows a Trainer.
    policies = {cls.__name__: torch_policy(cls) for cls in public_callbacks() if torch_policy(cls) is not None}
    assert len(policies) == 14, sorted(policies)
    for name, policy in policies.items():
        callback = inspect.cleandoc(getattr(lightning_gradkit, name).__doc__)
        torch_doc = inspect.cleandoc(policy.__doc__)
        head, args = torch_doc.split("\nArgs:\n", 1)
        args = "Args:\n" + re.split(r"\n\n(?=\S)", args, maxsplit=1)[0]
        assert head.split("\n\n", 1)[0] in callback and head.rsplit("\n\n", 1)[-1] in callback, name
        assert args in callback, f"{name}: the torch class's Args section is not in the callback's docstring"
        assert "Trainer(" in callback.split("Example::", 1)[1], f"{name}: no Trainer example"


def test_every_public_callback_has_its_page_its_row_and_its_toctree_entry() -> None:
    index = CALLBACKS.read_text()
    toctree = index.split("```{toctree}", 1)[1].split("```", 1)[0].split()
    for cls in public_callbacks():
        name = cls.__name__
        page = DOCS / "callbacks" / f"{name}.md"
        assert page.is_file(), f"docs/callbacks/{name}.md is missing"
        assert f".. autoclass:: lightning_gradkit.{name}\n" in page.read_text(), f"{page.name}: no autoclass of {name}"
        assert f"| [`{name}`]({name}.md) |" in index, f"docs/callbacks/index.md has no row linking {name}.md"
        assert name in toctree, f"docs/callbacks/index.md's toctree does not list {name}"
    pages = {p.stem for p in (DOCS / "callbacks").glob("*.md")} - {"index"}
    assert pages == {cls.__name__ for cls in public_callbacks()}, "a page for a name that is not a public callback"


def test_argument_table_names_every_argument_of_every_public_callback() -> None:
    rows = argument_table()
    missing = {}
    for cls in public_callbacks():
        assert cls.__name__ in rows, f"the argument table has no row for `{cls.__name__}`"
        arguments = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        absent = [a for a in arguments if not re.search(rf"`{a}[=`]", rows[cls.__name__])]
        if absent:
            missing[cls.__name__] = absent
    assert not missing, f"arguments missing from the argument table: {missing}"


def test_argument_table_gives_each_default_the_constructor_has() -> None:
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
    assert not wrong, f"the table's default differs from the constructor's (table, constructor): {wrong}"


def test_the_gpt2_use_cache_limitation_holds_as_the_page_states_it() -> None:
    """docs/limitations.md: GPT-2 with `use_cache=True` under activation checkpointing. Checked on the installed
    transformers (the page names the version it states): `mode="full"` gives the gradients of the model without
    checkpointing while the recompute appends to the returned KV cache a second time; `mode="selective"` fails in the
    backward; with `use_cache=False` both train."""
    transformers = pytest.importorskip("transformers")
    import torch

    from lightning_gradkit import inject_activation_checkpointing

    limitation = (DOCS / "limitations.md").read_text()
    assert f"transformers {transformers.__version__}" in limitation, "docs/limitations.md names another release"

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


# -- where the pages state the same fact, they state what the code does ------------------------------------------------
ROOT = DOCS.parent


def user_texts() -> dict[str, str]:
    """What a user reads: every page, the README, the changelog, and the docstrings of the public names of both roots
    (classes with their public members), by where each comes from."""
    import gradkit

    texts = {
        p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted(DOCS.rglob("*.md")) if "_build" not in p.parts
    }
    texts |= {name: (ROOT / name).read_text() for name in ("README.md", "CHANGELOG.md")}
    for root in (gradkit, lightning_gradkit):
        for name in root.__all__:
            obj = getattr(root, name)
            texts[f"{root.__name__}.{name}"] = inspect.getdoc(obj) or ""
            members = vars(obj).items() if isinstance(obj, type) else ()
            texts |= {
                f"{root.__name__}.{name}.{member}": inspect.getdoc(value) or ""
                for member, value in members
                if not member.startswith("_")
            }
    return texts


def sentences(text: str) -> list[str]:
    """``text`` cut into sentences: a paragraph, a list item, a docstring entry (``name: ...``) or a code line starts
    a new unit, and a unit is cut after ``.``, ``!`` or ``?`` before a capital, a backtick or a bracket."""
    units: list[list[str]] = [[]]
    code = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            code = not code
        starts = not stripped or code or re.match(r"(- |\* |>>> |\.\.\. |\w+( \([^)]*\))?:( |$))", stripped)
        if starts:
            units.append([])
        units[-1].append(stripped)
    flat = [" ".join(unit).strip() for unit in units]
    return [s for unit in flat if unit for s in re.split(r"(?<=[.!?])\s+(?=[A-Z`(*\[])", unit)]


# A sentence on the loop door's `log_dir` left out (the default), and one on a run without an events file.
LOG_DIR = re.compile(r"(?<![.\w])log_dir\b")
LOG_DIR_DEFAULT = re.compile(r"without (it|one|(an? )?`{0,2}log_dir)\b|\(the default\)|by default")
NO_EVENTS = re.compile(r"nowhere|no events? file|writes none", re.I)


def _nan_step_events(log_dir: Path | bool | None) -> list[Path]:
    """One step with a NaN loss behind the loop door, ``log_dir`` as given (``None``: left out); the event files
    written under the working directory."""
    import warnings

    import torch

    from gradkit import GradKit, NonFiniteGuard

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    arguments = {} if log_dir is None else {"log_dir": log_dir}
    kit = GradKit(model, optimizer, NonFiniteGuard(action="skip", forensics=False), **arguments)
    loss = model(torch.tensor([[float("nan"), 1.0]])).sum()
    loss.backward()
    kit.note_loss(loss)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the guard's report of the step: the event file is what is checked
        assert kit.step(optimizer) is False
        kit.finish()
    return sorted(Path.cwd().rglob("gradkit_events.jsonl"))


def test_every_statement_of_the_loop_doors_log_dir_default_is_what_the_door_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The reference: a run without `log_dir` in an empty working directory, and one with `log_dir=False`.
    monkeypatch.chdir(tmp_path)
    (default,) = _nan_step_events(None)
    directory = default.parent.relative_to(tmp_path).as_posix()
    assert directory == "gradkit_logs"  # the sentences below must name it; Fabric's logger directory: test_loop_door
    (tmp_path / "no_events").mkdir()
    monkeypatch.chdir(tmp_path / "no_events")
    assert _nan_step_events(False) == []

    stated, contradicting = 0, []
    for where, text in user_texts().items():
        for sentence in sentences(text):
            if not LOG_DIR.search(sentence):
                continue
            if LOG_DIR_DEFAULT.search(sentence):
                stated += 1
                if directory not in sentence:
                    contradicting.append(f"{where}: {sentence}")
            elif NO_EVENTS.search(sentence) and "log_dir=False" not in sentence:
                contradicting.append(f"{where}: {sentence}")
    assert stated >= 5, stated  # doors.md (twice), playbook.md, the changelog, GradKit's docstring
    assert not contradicting, "sentences on the loop door's `log_dir` that differ from the code:\n" + "\n".join(
        contradicting
    )


def _named_policies(text: str, start: str, end: str, clippers: set[str]) -> set[str]:
    """The policies a list between ``start`` and ``end`` in ``text`` names: its backticked class names, and every
    clipper where it says "all clippers"."""
    span = re.sub(r"\s+", " ", text).split(start, 1)[1].split(end, 1)[0]
    return set(re.findall(r"`{1,2}([A-Z]\w+)(?:\(|`)", span)) | (clippers if "all clippers" in span else set())


@pytest.mark.filterwarnings("ignore:QKClip found no attention module:UserWarning")  # on a Linear
@pytest.mark.filterwarnings("ignore:EscalationLadder. no EarlyWarning or SpikeRollback:UserWarning")  # alone here
def test_the_lists_of_what_works_in_a_loop_name_every_policy_the_loop_door_takes() -> None:
    # The reference: what `GradKit(...)` accepts. Every policy of the torch root builds a door; a Trainer-only
    # callback is refused at construction, naming why.
    import torch

    import gradkit

    def accepted(policy: object) -> bool:
        model = torch.nn.Linear(2, 1)
        try:
            gradkit.GradKit(model, torch.optim.SGD(model.parameters(), lr=0.1), policy, log_dir=False).close()
        except (TypeError, ValueError) as refusal:  # not a policy at all, or one that needs a Trainer
            assert isinstance(refusal, TypeError) or "Trainer" in str(refusal), refusal
            return False
        return True

    policies = {name for name in gradkit.__all__ if hasattr(getattr(gradkit, name), "stage")}
    built = {
        "EarlyWarning": {"attention": None, "output": None},
        "StepsToSkip": {"steps": [[5, 6]]},
        "EscalationLadder": {"rungs": ["warn", "lr_cut", "stop"]},  # its 'rollback' and 'mitigate' need other policies
    }
    works = {name for name in policies if accepted(getattr(gradkit, name)(*required(name), **built.get(name, {})))}
    assert works == policies
    refused = ["AccumulationGuard", "ActivationCheckpointing", "InferenceModeValidation"]
    assert not any(accepted(getattr(lightning_gradkit, name)(*required(name))) for name in refused)

    clippers = {name for name in policies if getattr(gradkit, name).stage is gradkit.Stage.CLIP}
    lists = {
        "docs/doors.md": ((DOCS / "doors.md").read_text(), "What works in a loop:", "The callbacks"),
        "GradKit's docstring": (gradkit.GradKit.__doc__ or "", "Policies that work here", "Callbacks that drive"),
    }
    for where, (text, start, end) in lists.items():
        named = _named_policies(text, start, end, clippers)
        assert named == works, f"{where} lists {sorted(named)}, the loop door takes {sorted(works)}"


def required(name: str) -> list[object]:
    """The required positional arguments of a callback or policy, with a value that builds it."""
    values = {"max_norm": 1.0, "clip_value": 1.0, "targets": ["Linear"]}
    cls = getattr(lightning_gradkit, name)
    parameters = inspect.signature(cls.__init__).parameters.values()
    return [values[p.name] for p in parameters if p.name != "self" and p.default is inspect.Parameter.empty]
