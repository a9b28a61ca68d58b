"""One docstring per policy: a Trainer callback's ``__doc__`` is built from the docstring of the torch policy it
subclasses, so ``help()``, the docs site (autodoc) and LightningCLI's ``--help`` show one text for both roots.

The torch class (``gradkit.ClipGradNorm``) documents the algorithm, every argument, what it logs and the
events it writes, with an ``Example::`` behind the loop door. The callback's own docstring holds only what a Trainer
adds: its first paragraph is a note for a reader of the source, then prose on what differs behind the Trainer, a
``Raises:`` of the setup-time checks and a Trainer ``Example::``. :func:`with_policy_docstring` joins the two.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from typing import TypeVar

__all__ = ["compose_docstring", "policy_of", "sections", "with_policy_docstring"]

_C = TypeVar("_C", bound=type)

# A Google-style section header at the left margin: "Args:", "Raises:", "Example::" (a literal block follows).
_HEADER = re.compile(r"^(?P<name>[A-Z][a-z]+):(?::)?$")


def sections(doc: str) -> tuple[list[str], dict[str, list[str]]]:
    """A docstring split into its paragraphs before the first section and its sections, in order.

    Returns:
        The leading paragraphs (each a block of lines, without the blank lines between them), and each section's
        header line (``"Args:"``, ``"Example::"``) -> its lines, blank lines and indentation kept.
    """
    lines = inspect.cleandoc(doc).splitlines()
    start = next((i for i, line in enumerate(lines) if _HEADER.match(line)), len(lines))
    head = "\n".join(lines[:start]).strip()
    found: dict[str, list[str]] = {}
    current: list[str] = []
    for line in lines[start:]:
        if _HEADER.match(line):
            current = found.setdefault(line, [])
        else:
            current.append(line)
    return [p.strip() for p in re.split(r"\n\s*\n", head) if p.strip()], {
        header: _trimmed(body) for header, body in found.items()
    }


def _trimmed(lines: list[str]) -> list[str]:
    """Without the trailing blank lines (a leading one stays: ``Example::`` needs it before its literal block)."""
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


def policy_of(callback: type) -> type | None:
    """The torch policy a Trainer callback subclasses: its first base class from the ``gradkit`` root."""
    return next((base for base in callback.__bases__ if base.__module__.split(".")[0] == "gradkit"), None)


def compose_docstring(policy: type, callback: type) -> str:
    """The policy's docstring with the callback's Trainer part: the policy's paragraphs, a paragraph that names both
    imports, the callback's paragraphs after its first, the policy's ``Args:``, both ``Raises:`` (the policy's
    entries first) and the callback's ``Example::`` in place of the policy's loop-door one."""
    policy_head, policy_sections = sections(policy.__doc__ or "")
    callback_head, callback_sections = sections(callback.__doc__ or "")
    name = callback.__name__
    doors = textwrap.fill(
        f"**Behind the Trainer** this is ``lightning_gradkit.{name}``, a ``Callback``; in a plain PyTorch loop, "
        f"Lightning Fabric or the Hugging Face Trainer it is ``gradkit.{name}``, the same class without Lightning, "
        "with the same arguments and checkpoint state.",
        width=116,
    )
    paragraphs = [*policy_head, doors, *callback_head[1:]]
    merged = dict(policy_sections)
    merged.pop("Example::", None)
    for header, body in callback_sections.items():
        merged[header] = [*merged[header], *body] if header in merged and header != "Example::" else body
    parts = ["\n\n".join(paragraphs)]
    parts += ["\n".join([header, *body]) for header, body in merged.items()]
    return "\n\n".join(parts) + "\n"


def with_policy_docstring(callback: _C) -> _C:
    """Class decorator: give a Trainer callback the docstring :func:`compose_docstring` builds from its policy's.

    Raises:
        TypeError: if ``callback`` subclasses no ``gradkit`` policy, or either class has no docstring.
    """
    policy = policy_of(callback)
    if policy is None or not policy.__doc__ or not callback.__doc__:
        raise TypeError(
            f"{callback.__name__}: `with_policy_docstring` needs a callback with a docstring that subclasses a "
            f"documented `gradkit` policy (its bases: {[b.__qualname__ for b in callback.__bases__]})."
        )
    callback.__doc__ = compose_docstring(policy, callback)
    return callback
