"""Argument checks shared by every constructor: one style of error for every callback.

Each check returns the value in its canonical type (``int``, ``float``, ``bool``, ``list[str]``) or raises
``ValueError`` naming the argument, the value received and what is accepted (:func:`check_type`, for an argument
that takes an object such as a model or a function, raises ``TypeError`` the same way). ``bool`` is never accepted as
a number (``True`` is an ``int`` to Python, never a step count to a user), ``None`` and strings are refused with the
same message instead of the bare ``int()``/``float()`` error, and NaN never passes a range check (every comparison
with NaN is false, so ``value <= 0`` alone lets it through).

The checks of one argument of one job (``norm_type``, ``normalize``, ``every_n``, ``memory_budget``) live here too,
so a callback and the functions it drives refuse a value with the same message; and :func:`name_list` and
:func:`format_bytes`, the one way a message shows a list of names and a size.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

__all__ = [
    "check_bool",
    "check_choice",
    "check_float",
    "check_int",
    "check_strings",
    "check_type",
    "format_bytes",
    "name_list",
    "shown",
    "validate_every_n",
    "validate_memory_budget",
    "validate_norm_type",
    "validate_normalize",
]


#: How many names a message shows before "and N more".
_MAX_NAMES_SHOWN = 10


def name_list(names: Sequence[str], quote: bool = False) -> str:
    """The first :data:`_MAX_NAMES_SHOWN` of ``names``, comma-separated (in backticks with ``quote``), then how many
    more there are.

    Example::

        >>> name_list([f"layer{i}" for i in range(12)])
        'layer0, layer1, layer2, layer3, layer4, layer5, layer6, layer7, layer8, layer9 and 2 more'
        >>> name_list(["fc.weight"], quote=True)
        '`fc.weight`'
    """
    shown = ", ".join(f"`{n}`" if quote else n for n in names[:_MAX_NAMES_SHOWN])
    more = len(names) - _MAX_NAMES_SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def format_bytes(n: float) -> str:
    """A size for a message: ``"512 B"``, ``"1.5 KiB"``, ... ``"2.0 GiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _fail(name: str, expected: str, value: object, hint: str = "") -> ValueError:
    return ValueError(f"`{name}` must be {expected}, got {value!r}.{' ' + hint if hint else ''}")


def check_int(name: str, value: object, minimum: int = 1, maximum: int | None = None, hint: str = "") -> int:
    """Return ``value`` as an ``int`` if it is an integer (not a bool) in ``[minimum, maximum]`` (``maximum=None``:
    no bound); ``hint``, a sentence appended to the error (what the argument means, a typical value).

    Raises:
        ValueError: if ``value`` is not an integer (a bool, a float such as ``2.5``, ``nan`` or ``inf``, ``None``,
            a string) or lies outside the range.

    Example::

        >>> check_int("window", 4)
        4
        >>> check_int("window", True)
        Traceback (most recent call last):
        ...
        ValueError: `window` must be an integer >= 1, got True.
    """
    expected = f"an integer >= {minimum}" + (f" and <= {maximum:_}" if maximum is not None else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _fail(name, expected, value, hint)
    if value < minimum or (maximum is not None and value > maximum):
        raise _fail(name, expected, value, hint)
    return int(value)


def check_float(
    name: str,
    value: object,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    below: float | None = None,
    allow_inf: bool = False,
    hint: str = "",
) -> float:
    """Return ``value`` as a ``float`` if it is a real number (not a bool, not NaN) in the given range: ``minimum``
    and ``maximum`` inclusive, ``above`` and ``below`` exclusive; ``allow_inf`` accepts ``float("inf")`` (still
    subject to the bounds).

    Raises:
        ValueError: if ``value`` is not a number, is NaN, is infinite without ``allow_inf``, or is out of range.

    Example::

        >>> check_float("alpha", 0.97, above=0.0, below=1.0)
        0.97
    """
    parts = [
        f">= {minimum}" if minimum is not None else "",
        f"> {above}" if above is not None else "",
        f"<= {maximum}" if maximum is not None else "",
        f"< {below}" if below is not None else "",
    ]
    bounds = " and ".join(p for p in parts if p)
    expected = ("a number" if allow_inf else "a finite number") + (f" {bounds}" if bounds else "")
    if allow_inf:
        expected += " (float('inf') allowed)"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(name, expected, value, hint)
    number = float(value)
    if math.isnan(number) or (math.isinf(number) and not allow_inf):
        raise _fail(name, expected, value, hint)
    if (
        (minimum is not None and number < minimum)
        or (maximum is not None and number > maximum)
        or (above is not None and not number > above)
        or (below is not None and not number < below)
    ):
        raise _fail(name, expected, value, hint)
    return number


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a ``bool``; strings such as ``"no"`` are refused rather than read as true.

    Raises:
        ValueError: if ``value`` is not ``True`` or ``False``.
    """
    if not isinstance(value, bool):
        raise _fail(name, "True or False", value)
    return value


def check_choice(name: str, value: object, allowed: Sequence[str], hint: str = "") -> str:
    """Return ``value`` if it is one of ``allowed``.

    Raises:
        ValueError: naming the allowed values, if ``value`` is not one of them.
    """
    if not isinstance(value, str) or value not in allowed:
        raise _fail(name, f"one of {list(allowed)}", value, hint)
    return value


def check_strings(name: str, value: object, allow_empty: bool = True, hint: str = "") -> list[str]:
    """Return ``value`` as a list of non-empty strings; a single string is one entry, not a list of letters.

    Raises:
        ValueError: if ``value`` is neither a string nor a sequence of non-empty strings (or is empty while
            ``allow_empty`` is false).

    Example::

        >>> check_strings("exclude", "Linear")
        ['Linear']
    """
    if value is None and allow_empty:
        return []
    if isinstance(value, str):
        value = [value]
    expected = "a string or a list of non-empty strings" + ("" if allow_empty else " (at least one)")
    if not isinstance(value, Sequence) or not all(isinstance(v, str) and v.strip() for v in value):
        raise _fail(name, expected, value, hint)
    if not value and not allow_empty:
        raise _fail(name, expected, value, hint)
    return list(value)


def check_type(name: str, value: object, accepted: type | tuple[type, ...], expected: str, hint: str = "") -> None:
    """Refuse ``value`` unless it is an instance of ``accepted``; ``expected`` says what is accepted, in words. The
    value is shown as its ``repr`` when that is short (``'stdout'``, ``5``), with its type.

    Raises:
        TypeError: naming the argument and the value, if ``value`` is not an instance of ``accepted`` (the kind of
            object is wrong, not its value).

    Example::

        >>> check_type("name", 5, str, "a string")
        Traceback (most recent call last):
        ...
        TypeError: `name` must be a string, got 5 (an int).
    """
    if not isinstance(value, accepted):
        raise TypeError(f"`{name}` must be {expected}, got {shown(value)}.{' ' + hint if hint else ''}")


def shown(value: object) -> str:
    """``value`` for a message: its ``repr`` and type when the ``repr`` is one short line (``'fp16' (a str)``,
    ``None``), else its type alone (``a Linear``: a module's ``repr`` fills a screen)."""
    text = repr(value)
    name = type(value).__name__
    kind = f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"
    if value is None:
        return text
    return f"{text} ({kind})" if len(text) <= 60 and "\n" not in text else kind


# -- checks of one argument of one job, shared by its callback and its functions ------------------------------
def validate_norm_type(norm_type: float, argument: str = "norm_type") -> float:
    """Return ``norm_type`` as a float if it is a p-norm order (``p >= 1`` or ``inf``), else raise ``ValueError``."""
    return check_float(argument, norm_type, minimum=1.0, allow_inf=True, hint="Use 2.0 for the Euclidean norm.")


def validate_normalize(normalize: str) -> str:
    """Return ``normalize`` if it is ``"mean"`` or ``"tokens"``, else raise ``ValueError``."""
    return check_choice(
        "normalize",
        normalize,
        ("mean", "tokens"),
        hint="Use 'mean' to average the micro-batches of each window, 'tokens' to divide the summed per-token loss by "
        "the window's global token count.",
    )


def validate_every_n(every_n: int) -> None:
    check_int("every_n", every_n, 1, hint="1 checkpoints every match.")


def validate_memory_budget(memory_budget: float | None) -> None:
    """``None``; a fraction in (0, 1] of the un-checkpointed activation bytes; or a whole number of bytes > 1."""
    if memory_budget is None:
        return
    valid = isinstance(memory_budget, (int, float)) and not isinstance(memory_budget, bool)
    if valid and 0 < memory_budget <= 1:
        return
    if valid and memory_budget > 1 and float(memory_budget).is_integer():
        return
    raise ValueError(
        "`memory_budget` must be None, a fraction in (0, 1] of the un-checkpointed activation memory (e.g. 0.5), "
        f"or a whole number of bytes > 1 (e.g. 2_000_000_000), got {memory_budget!r}."
    )
