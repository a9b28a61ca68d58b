"""Source attribution: which package a frame belongs to, and the first frame that is not a library's.

A sync belongs to the first frame, walking outwards from the call, that is not "library" code (PyTorch,
NumPy, torchmetrics, the standard library, ...: they only carry out what their caller asked). If that frame is
user code, the sync is the user's, reported at that line; if it is "framework" code (Lightning,
lightning_gradkit), the sync is the framework's own (e.g. Lightning reading logged values), reported apart.

Shared by the host-sync audit and the graph-leak scan (which does not report tensors held by library code).
"""

from __future__ import annotations

import importlib.util
import os
import site
import sysconfig
import types
from collections.abc import Iterable, Sequence

__all__ = [
    "FRAMEWORK",
    "FRAMEWORK_PACKAGES",
    "LIBRARY",
    "LIBRARY_PACKAGES",
    "USER",
    "SourceClassifier",
    "package_dirs",
    "short_path",
]


LIBRARY, FRAMEWORK, USER = 0, 1, 2

#: Packages that only carry out what their caller asked: a sync inside them is charged to the caller.
LIBRARY_PACKAGES = ("torch", "functorch", "numpy", "torchmetrics", "lightning_utilities", "typing_extensions")
#: Packages that run the user's code: a sync they make themselves is theirs, not the user's.
FRAMEWORK_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_gradkit", "gradkit")

# The interceptor is transparent to attribution: its own frames are never "the caller".
_INTERCEPTOR_FILE = os.path.join(os.path.dirname(os.path.realpath(__file__)), "host_sync.py")


def package_dirs(names: Iterable[str]) -> list[str]:
    """The source directories of the importable top-level packages among ``names`` (the others are ignored)."""
    dirs: list[str] = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        locations = list(spec.submodule_search_locations or [])
        if not locations and spec.origin:
            locations = [spec.origin]
        dirs.extend(_as_prefix(loc) for loc in locations)
    return dirs


def _as_prefix(path: str) -> str:
    real = os.path.realpath(path)
    return real if real.endswith(".py") else real.rstrip(os.sep) + os.sep


class SourceClassifier:
    """Sorts source files into library, framework and user code, by path; cached per file name.

    Args:
        library_packages: extra top-level packages to treat as library code (their frames are skipped when
            attributing a sync, which is then charged to the line that called into them).

    Example::

        >>> import torch
        >>> SourceClassifier().category(torch.__file__) == LIBRARY
        True
    """

    def __init__(self, library_packages: Sequence[str] = ()) -> None:
        self._library = tuple(package_dirs([*LIBRARY_PACKAGES, *library_packages]))
        self._framework = tuple(package_dirs(FRAMEWORK_PACKAGES))
        paths = sysconfig.get_paths()
        self._stdlib = tuple({_as_prefix(paths[k]) for k in ("stdlib", "platstdlib") if paths.get(k)})
        site_dirs = [
            *getattr(site, "getsitepackages", list)(),
            site.getusersitepackages(),
            paths.get("purelib"),
            paths.get("platlib"),
        ]
        self._site = tuple({_as_prefix(d) for d in site_dirs if d})
        self._cache: dict[str, int] = {}

    def category(self, filename: str) -> int:
        """``LIBRARY``, ``FRAMEWORK`` or ``USER`` for a code object's ``co_filename``."""
        found = self._cache.get(filename)
        if found is None:
            found = self._cache[filename] = self._classify(filename)
        return found

    def _classify(self, filename: str) -> int:
        if filename.startswith("<frozen") or filename.startswith("<built-in"):
            return LIBRARY
        if filename.startswith("<"):  # "<stdin>", "<string>", notebook cells: written by the user
            return USER
        path = os.path.realpath(filename)
        if path == _INTERCEPTOR_FILE:
            return LIBRARY
        if path.startswith(self._library):
            return LIBRARY
        if path.startswith(self._framework):
            return FRAMEWORK
        if path.startswith(self._stdlib) and not path.startswith(self._site):
            return LIBRARY
        return USER

    def attribute(self, frame: types.FrameType | None) -> tuple[int, str, int, str]:
        """``(category, filename, lineno, function)`` of the first non-library frame from ``frame`` outwards."""
        while frame is not None:
            code = frame.f_code
            category = self.category(code.co_filename)
            if category != LIBRARY:
                return category, code.co_filename, frame.f_lineno, code.co_name
            frame = frame.f_back
        return FRAMEWORK, "<unknown>", 0, ""


def short_path(filename: str) -> str:
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if rel.startswith("..") else rel
