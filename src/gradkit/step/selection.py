r"""Which modules and parameters a list of name patterns selects: the one selection grammar of gradkit.

``ActivationCheckpointing(targets=...)`` and :func:`~lightning_gradkit.inject_activation_checkpointing` select the
modules to checkpoint with it; ``AdaptiveGradClip(exclude=...)`` selects the parameters it leaves unclipped. Each
entry of such a list is one pattern (a single string is a list of one):

- ``"Block"``: a class name. It selects every module whose class, or one of its base classes, has that name (so a
  subclass matches, and so do the per-class subclasses that FSDP2's ``fully_shard`` creates).
- ``"torch.nn.TransformerEncoderLayer"``: a dotted class path. It selects the instances of that class (and of its
  subclasses) when the path imports; otherwise it is compared with ``module.qualname`` of the module's classes.
- ``"re:<regex>"``: a regular expression that must match a *whole* qualified name (:func:`re.fullmatch`), as
  :func:`~gradkit.step.norms.clean_name` writes it (the names ``GradNormMonitor`` logs: relative to the
  model, without the ``_orig_mod``, FSDP1 and checkpoint-wrapper components, nor DDP's leading ``module``).
  ``"re:blocks\.\d+"`` selects ``blocks.0``, ``blocks.1``, ... but neither ``blocks.0.attn`` nor
  ``model.blocks.0``; ``"re:.*attn"`` selects every module whose name ends in ``attn``, at any depth.

A pattern selects modules. A parameter is selected when a pattern selects a module that holds it, at any depth
(``"Linear"``, ``"re:head"`` for every parameter of the module ``head``), or when a ``re:`` pattern matches the
parameter's own qualified name (``"re:.*\.bias"`` for every bias).

Below them, the rows of ``GradNormMonitor(depth="auto")``, which ``SpikeRollback``'s spiking-module reset reads too.
"""

from __future__ import annotations

import difflib
import functools
import itertools
import pydoc
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from gradkit._util.arguments import check_strings

__all__ = [
    "REGEX_PREFIX",
    "NamePattern",
    "auto_module_keys",
    "module_rows",
    "no_match_hint",
    "outermost_attention",
    "parameters_selected",
    "parse_patterns",
    "refuse_unmatched",
    "repeated_blocks",
]

#: The prefix that makes an entry a regular expression over qualified names.
REGEX_PREFIX = "re:"

# How many nearby names an error shows.
_NEARBY = 5


@dataclass(frozen=True)
class NamePattern:
    """One entry of a selection (see the module docstring for the grammar).

    Attributes:
        text: the entry as the user wrote it (``"Block"``, ``"re:blocks\\.\\d+"``).
        regex: the compiled regular expression of a ``re:`` entry, else ``None``.
    """

    text: str
    regex: re.Pattern[str] | None

    @classmethod
    def parse(cls, text: str, argument: str) -> NamePattern:
        """Parse one entry of ``argument``.

        Raises:
            ValueError: naming ``argument`` and the entry, for an invalid regular expression, or for an entry that
                is neither a ``re:`` pattern nor a (dotted) class name.
        """
        if text.startswith(REGEX_PREFIX):
            try:
                return cls(text, re.compile(text[len(REGEX_PREFIX) :]))
            except re.error as err:
                raise ValueError(f"`{argument}` entry {text!r} is not a valid regular expression: {err}.") from None
        if not all(part.isidentifier() for part in text.split(".")):
            raise ValueError(
                f"`{argument}` entry {text!r} is neither a class name (e.g. 'Block', 'torch.nn.Linear') nor a "
                f"'re:<regex>' pattern. To select by qualified name write {REGEX_PREFIX + re.escape(text)!r}."
            )
        return cls(text, None)

    @functools.cached_property
    def _resolved_class(self) -> type | None:
        if self.regex is not None or "." not in self.text:
            return None
        found = pydoc.locate(self.text)
        return found if isinstance(found, type) else None

    def matches_name(self, name: str) -> bool:
        """Whether this ``re:`` pattern matches the whole of ``name`` (always false for a class name)."""
        return self.regex is not None and self.regex.fullmatch(name) is not None

    def matches_module(self, name: str, module: nn.Module) -> bool:
        """Whether this pattern selects ``module``, whose qualified (cleaned) name is ``name``."""
        if self.regex is not None:
            return self.regex.fullmatch(name) is not None
        if self._resolved_class is not None:
            return isinstance(module, self._resolved_class)
        if "." in self.text:
            return any(f"{c.__module__}.{c.__qualname__}" == self.text for c in type(module).__mro__)
        return any(c.__name__ == self.text for c in type(module).__mro__)


def parse_patterns(argument: str, patterns: object, allow_empty: bool = True) -> tuple[NamePattern, ...]:
    """Check and parse the patterns given as ``argument`` (a string, or a list of strings).

    Raises:
        ValueError: naming ``argument``, if ``patterns`` is not a string or a list of non-empty strings (or is empty
            while ``allow_empty`` is false), or if an entry is invalid (:meth:`NamePattern.parse`).

    Example::

        >>> [p.text for p in parse_patterns("exclude", ["Linear", "re:head"])]
        ['Linear', 're:head']
    """
    entries = check_strings(
        argument,
        patterns,
        allow_empty=allow_empty,
        hint="Give module class names (e.g. 'Block', 'torch.nn.Linear') or 're:<regex>' patterns that match whole "
        "qualified names (see `gradkit.step.selection`).",
    )
    return tuple(NamePattern.parse(entry.strip(), argument) for entry in entries)


def parameters_selected(
    pattern: NamePattern, modules: Sequence[tuple[str, nn.Module]], parameters: Sequence[str]
) -> set[str]:
    """The names in ``parameters`` that ``pattern`` selects: held by a module it selects, or matched themselves.

    Args:
        pattern: the pattern.
        modules: ``(qualified name, module)`` of every module, the root (``""``) included, names cleaned.
        parameters: the qualified (cleaned) names of the parameters.

    Example::

        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
        >>> modules, params = list(model.named_modules()), [n for n, _ in model.named_parameters()]
        >>> sorted(parameters_selected(NamePattern.parse("re:2", "exclude"), modules, params))
        ['2.bias', '2.weight']
    """
    prefixes = [
        name + "." if name else ""
        for name, module in modules
        if (name or pattern.regex is None) and pattern.matches_module(name, module)
    ]
    return {p for p in parameters if pattern.matches_name(p) or any(p.startswith(prefix) for prefix in prefixes)}


def no_match_hint(pattern: NamePattern, names: Iterable[str], classes: Iterable[str]) -> str:
    r"""What to say when ``pattern`` selected nothing: the names nearest to it, and a pattern that would match.

    Args:
        pattern: the pattern that selected nothing.
        names: the qualified names it was matched against, in model order.
        classes: the class names of those modules.

    Example::

        >>> hint = no_match_hint(NamePattern.parse("re:block", "targets"), ["model", "model.blocks.0"], [])
        >>> hint.split(". ")[1:3]
        ['Nearest names: model.blocks.0', "A pattern that matches: 're:model\\.blocks\\.\\d+'"]
    """
    names = list(dict.fromkeys(names))
    if pattern.regex is None:
        classes = sorted(set(classes))
        nearest = difflib.get_close_matches(pattern.text.rsplit(".", 1)[-1], classes, n=_NEARBY, cutoff=0.5)
        closest = f" Nearest class names: {', '.join(nearest)}." if nearest else ""
        known = ", ".join(classes) or "(none)"
        return f"'{pattern.text}': no module class of that name.{closest} Module classes: {known}."
    partial = [name for name in names if pattern.regex.search(name)]
    if partial:
        nearest = partial[:_NEARBY]
    else:
        literal = re.sub(r"\\(.)", r"\1", pattern.text[len(REGEX_PREFIX) :])
        nearest = difflib.get_close_matches(literal, names, n=_NEARBY, cutoff=0.0)
    text = f"'{pattern.text}' must match a whole qualified name (re.fullmatch)."
    if not nearest:
        return f"{text} There are no names to match."
    shown = sorted(nearest, key=names.index)  # in model order; the suggestion comes from the nearest
    text += f" Nearest names: {', '.join(shown)}. A pattern that matches: '{_pattern_for(nearest[0])}'."
    if partial:
        text += f" To match it anywhere in a name, as a search would: '{_searching(pattern.regex.pattern)}'."
    return text


def _searching(regex: str) -> str:
    """A ``re:`` pattern whose full match selects what ``re.search(regex, name)`` finds (``^`` and ``$`` kept)."""
    body = f"(?:{regex})" if "|" in regex else regex
    start, body = ("", body[1:]) if body.startswith("^") else (".*", body)
    end, body = ("", body[:-1]) if body.endswith("$") and not body.endswith("\\$") else (".*", body)
    return REGEX_PREFIX + start + body + end


def _pattern_for(name: str) -> str:
    r"""A ``re:`` pattern that matches ``name`` and its numbered siblings (``blocks.0`` -> ``re:blocks\.\d+``)."""
    return REGEX_PREFIX + r"\.".join(r"\d+" if part.isdigit() else re.escape(part) for part in name.split("."))


# -- per-module grouping (pure functions of names and module classes) ---------------------------------------------
def repeated_blocks(modules: Iterable[tuple[str, nn.Module]]) -> list[str]:
    """Qualified names of the repeated blocks of a model, in registration order.

    A repeated block is a child of a ``ModuleList`` or ``Sequential`` whose children (two or more) all have the same
    class: the layers of a transformer (``model.blocks.3``, ``encoder.encoder.layer.3``), the stages of a ResNet.
    Only the outermost ones count: the experts inside a repeated layer are part of that layer's row.

    Args:
        modules: ``(qualified name, module)`` pairs in registration order, as ``named_modules()`` yields them.

    Example::

        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
        >>> repeated_blocks(net.named_modules())
        ['1.0', '1.1']
    """
    blocks: list[str] = []
    for name, module in modules:
        if any(name.startswith(b + ".") for b in blocks):
            continue
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.named_children())
            if len(children) >= 2 and len({type(child) for _, child in children}) == 1:
                blocks.extend(f"{name}.{child}" if name else child for child, _ in children)
    return blocks


def auto_module_keys(param_names: Sequence[str], blocks: Sequence[str]) -> list[str]:
    """The row (module) of every parameter for ``depth="auto"``.

    A parameter inside a repeated block belongs to that block. Any other parameter belongs to the shortest prefix of
    its owner's name that holds no block: the other top-level modules (``head``), or, beside the blocks, their
    siblings (``model.wte``, ``encoder.embeddings``). A wrapper that holds the whole model (``self.model``) is looked
    through. A parameter of a module that holds other rows (a ViT's ``model.cls_token`` and ``model.pos_embed``, a
    parameter of the LightningModule itself) is a row of its own, named by the parameter: a row named ``model``
    would claim the whole model.

    Example::

        >>> names = ["model.cls_token", "model.wte.weight", "model.blocks.0.fc.weight", "head.bias"]
        >>> auto_module_keys(names, ["model.blocks.0"])
        ['model.cls_token', 'model.wte', 'model.blocks.0', 'head']
    """
    owners = [name.split(".")[:-1] for name in param_names]
    ancestors = {".".join(b.split(".")[:i]) for b in blocks for i in range(1, b.count(".") + 1)}
    # Look through the components every parameter shares (a LightningModule that wraps its model in `self.model`).
    shared = itertools.takewhile(lambda parts: len(set(parts)) == 1, zip(*owners, strict=False))
    common = [parts[0] for parts in shared]
    ancestors.update(".".join(common[:i]) for i in range(1, len(common) + 1))
    block_set = set(blocks)
    keys = []
    for name, owner in zip(param_names, owners, strict=True):
        key = name
        for i in range(1, len(owner) + 1):
            prefix = ".".join(owner[:i])
            if prefix in block_set or prefix not in ancestors:
                key = prefix
                break
        keys.append(key)
    return keys


def module_rows(keys: Sequence[str], names: Sequence[str], model_order: Sequence[str]) -> tuple[list[str], list[int]]:
    """Rows in model order and the row of every parameter.

    Args:
        keys: the row key of every parameter, aligned with ``names``.
        names: the parameter names, in the optimizer's (grouped by device and dtype) order.
        model_order: the parameter names in registration order (``named_parameters()``).

    Returns:
        ``(rows, index)``: the distinct keys, ordered by their first parameter in ``model_order`` (parameters it does
        not list come last), and for every parameter the position of its key in ``rows``.
    """
    rank = {name: i for i, name in enumerate(model_order)}
    first: dict[str, int] = {}
    for key, name in zip(keys, names, strict=True):
        first[key] = min(first.get(key, len(rank)), rank.get(name, len(rank)))
    rows = sorted(dict.fromkeys(keys), key=lambda k: first[k])
    lookup = {k: i for i, k in enumerate(rows)}
    return rows, [lookup[k] for k in keys]


def outermost_attention(
    named: Sequence[tuple[str, nn.Module]], patterns: Sequence[NamePattern]
) -> list[tuple[str, nn.Module]]:
    """The attention modules of ``named`` (``model.named_modules()``): those a pattern selects, or, without patterns
    (``attention="auto"``), those whose class name ends in ``Attention``; the outermost only (a selected module is
    read whole, the modules inside it are not selected again).

    Raises:
        ValueError: an ``attention`` pattern that selects none of them, with the nearest names and classes.

    Example::

        >>> from torch import nn
        >>> class SelfAttention(nn.Module): ...
        >>> net = nn.Sequential(SelfAttention(), nn.Linear(2, 2))
        >>> [name for name, _ in outermost_attention(list(net.named_modules()), ())]
        ['0']
    """
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in named:
        if any(name.startswith(c + ".") or not c for c, _ in chosen):
            continue  # inside a selected module
        if patterns:
            hit = any(p.matches_module(name, module) for p in patterns)
        else:
            hit = type(module).__name__.lower().endswith("attention")
        if hit:
            chosen.append((name, module))
    refuse_unmatched("attention", patterns, chosen, named)
    return chosen


def refuse_unmatched(
    argument: str,
    patterns: Sequence[NamePattern],
    matched: Sequence[tuple[str, nn.Module]],
    named: Sequence[tuple[str, nn.Module]],
) -> None:
    """Refuse the first of ``patterns`` (the entries of ``argument``) that matches none of the ``matched`` modules,
    with :func:`no_match_hint` over every module of ``named``.

    Raises:
        ValueError: naming ``argument``, the entry, the nearest names and a pattern that would match.
    """
    for pattern in patterns:
        if not any(pattern.matches_module(n, m) for n, m in matched):
            names = [n for n, _ in named if n]
            classes = sorted({type(m).__name__ for _, m in named})
            raise ValueError(
                f"`{argument}` entry {pattern.text!r} selects no module. {no_match_hint(pattern, names, classes)}"
            )
