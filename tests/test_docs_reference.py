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
    assert len(policies) == 11, sorted(policies)
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
