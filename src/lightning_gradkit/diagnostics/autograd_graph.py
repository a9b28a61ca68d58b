"""Autograd graphs kept alive across steps, found on plain PyTorch objects (no Lightning here).

:func:`module_graph_tensors` walks a module tree's user attributes (lists, tuples, dicts, sets, deques,
dataclasses, plain objects, nested) for tensors that still carry ``grad_fn``; :class:`OlderGraph` keeps those
whose graph reaches a node created before an :func:`autograd_sequence_marker` (autograd numbers its nodes in
creation order); :func:`graph_footprint` counts the distinct graphs such tensors keep alive, their nodes and the
memory they pin.

:class:`~lightning_gradkit.GraphLeakGuard` wires it into the Trainer.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import sys
import types
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from lightning_gradkit.diagnostics.sources import FRAMEWORK_PACKAGES, LIBRARY_PACKAGES, short_path

__all__ = [
    "GraphFootprint",
    "GraphTensor",
    "OlderGraph",
    "autograd_sequence_marker",
    "gc_graph_tensors",
    "graph_footprint",
    "module_graph_tensors",
    "object_graph_tensors",
    "standard_attributes",
    "steady_growth",
    "storage_keys",
]


_THIS_FILE = os.path.realpath(__file__)
_PROBE: Tensor | None = None


def autograd_sequence_marker() -> int:
    """The sequence number autograd will give the next graph node created in this thread.

    Autograd numbers the nodes of each thread in creation order (``Node._sequence_nr()``), so a tensor whose
    ``grad_fn`` has a smaller number than a marker taken at the start of a step was created before that step.
    """
    global _PROBE
    if _PROBE is None:
        _PROBE = torch.zeros((), requires_grad=True)
    with torch.enable_grad():
        node = (_PROBE * 1).grad_fn
    assert node is not None
    return node._sequence_nr() + 1


class OlderGraph:
    """Tells whether a tensor's autograd graph reaches a node created before ``marker`` (an
    :func:`autograd_sequence_marker` taken when the step started): the graph outlived the step it was made in.

    Nodes found not to reach an old one are remembered across calls, so checking many tensors of one graph costs one
    walk. Autograd numbers nodes per thread: a graph built in another thread (a double-backward graph built by
    autograd's device threads) cannot be dated this way and may be reported.
    """

    def __init__(self, marker: int) -> None:
        self.marker = marker
        self._clean: set[int] = set()
        self._alive: list[object] = []  # keeps walked node wrappers alive so that their ids stay unique

    def __call__(self, tensor: Tensor) -> bool:
        fn = tensor.grad_fn
        if fn is None:
            return False
        stack = [fn]
        walked: dict[int, object] = {}
        while stack:
            node = stack.pop()
            if node is None or id(node) in self._clean or id(node) in walked:
                continue
            if node._sequence_nr() < self.marker:
                return True
            walked[id(node)] = node
            stack.extend(f for f, _ in node.next_functions)
        self._clean.update(walked)
        self._alive.extend(walked.values())
        return False


@dataclass(frozen=True)
class GraphTensor:
    """A tensor found holding an autograd graph, where (``path``: ``pl_module.history[120]``) and what it is (the name
    of its ``grad_fn``, shape, dtype, device): a description, the tensor itself is not kept."""

    path: str
    grad_fn: str
    shape: tuple[int, ...]
    dtype: str
    device: str

    @classmethod
    def describe(cls, path: str, tensor: Tensor) -> GraphTensor:
        return cls(path, type(tensor.grad_fn).__name__, tuple(tensor.shape), str(tensor.dtype), str(tensor.device))


def standard_attributes(*module_types: type[nn.Module]) -> frozenset[str]:
    """Instance attributes every module of these types has: their internals, as opposed to user state."""
    names: set[str] = set()
    for module_type in module_types:
        names.update(vars(module_type()))
    return frozenset(names)


_MAX_VISITS = 200_000
_SCALARS = (str, bytes, int, float, bool, complex, type(None))
_NOT_WALKED = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)
_NON_USER_PACKAGES = frozenset((*LIBRARY_PACKAGES, *FRAMEWORK_PACKAGES, "builtins"))


def _is_user_object(obj: object) -> bool:
    if isinstance(obj, _NOT_WALKED) or not hasattr(obj, "__dict__"):
        return False
    package = type(obj).__module__.partition(".")[0]
    return package not in _NON_USER_PACKAGES and package not in sys.stdlib_module_names


class _Walker:
    """Depth-first walk of an object tree for tensors with a ``grad_fn`` that ``select`` accepts."""

    def __init__(self, select: Callable[[Tensor], bool] | None, skip: frozenset[str], budget: int) -> None:
        self.select = select
        self.skip = skip
        self.budget = budget
        self.seen: set[int] = set()
        self.found: list[tuple[str, Tensor]] = []
        self.truncated = False

    def walk(self, obj: object, path: str) -> None:
        stack = [(obj, path)]
        while stack:
            obj, path = stack.pop()
            if isinstance(obj, Tensor):
                if obj.grad_fn is not None and (self.select is None or self.select(obj)):
                    self.found.append((path, obj))
                continue
            if isinstance(obj, _SCALARS) or id(obj) in self.seen:
                continue
            self.seen.add(id(obj))
            if len(self.seen) > self.budget:
                self.truncated = True
                return
            stack.extend(reversed(self._children(obj, path)))

    def _children(self, obj: object, path: str) -> list[tuple[object, str]]:
        if isinstance(obj, dict):
            return [(v, f"{path}[{k!r}]") for k, v in obj.items()]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return [(v, f"{path}.{k}") for k, v in zip(obj._fields, obj, strict=False)]
        if isinstance(obj, (list, tuple, deque)):
            return [(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        if isinstance(obj, (set, frozenset)):
            return [(v, f"{path}{{#{i}}}") for i, v in enumerate(obj)]
        if isinstance(obj, nn.Module):  # an unregistered module (e.g. a teacher kept in a list)
            children = [(v, f"{path}.{k}") for k, v in vars(obj).items() if k not in self.skip]
            return children + [(m, f"{path}.{k}") for k, m in obj._modules.items()]
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return [(getattr(obj, f.name, None), f"{path}.{f.name}") for f in dataclasses.fields(obj)]
        if isinstance(obj, types.SimpleNamespace) or _is_user_object(obj):
            return [(v, f"{path}.{k}") for k, v in vars(obj).items()]
        return []


def module_graph_tensors(
    module: nn.Module,
    root: str = "module",
    skip: frozenset[str] = frozenset(),
    select: Callable[[Tensor], bool] | None = None,
    budget: int = _MAX_VISITS,
) -> tuple[list[tuple[str, Tensor]], bool]:
    """Tensors with a ``grad_fn`` held in the user attributes of ``module`` and of its submodules.

    Parameters, buffers and the attributes named in ``skip`` (module internals, see :func:`standard_attributes`)
    are not walked; everything else is, recursively: lists, tuples, named tuples, dicts, sets, deques,
    dataclasses, ``SimpleNamespace`` and instances of classes outside PyTorch, Lightning and the standard library.
    ``select`` (e.g. an :class:`OlderGraph`) keeps the tensors it accepts; the walk stops after ``budget`` objects.

    Returns:
        ``([(path, tensor), ...], truncated)``, e.g. ``("module.history[3]", tensor)``; the paths start with ``root``.
    """
    walker = _Walker(select, skip, budget)
    named = list(module.named_modules())
    walker.seen.update(id(m) for _, m in named)
    for name, sub in named:
        prefix = f"{root}.{name}" if name else root
        for key, value in vars(sub).items():
            if key not in skip:
                walker.walk(value, f"{prefix}.{key}")
                if walker.truncated:
                    return walker.found, True
    return walker.found, False


def object_graph_tensors(
    obj: object, root: str, select: Callable[[Tensor], bool] | None = None
) -> list[tuple[str, Tensor]]:
    """Tensors with a ``grad_fn`` (that ``select`` accepts, if given) anywhere in a plain object tree."""
    walker = _Walker(select, frozenset(), _MAX_VISITS)
    walker.walk(obj, root)
    return walker.found


def gc_graph_tensors(select: Callable[[Tensor], bool], exclude: set[int]) -> list[tuple[str, Tensor]]:
    """Every live tensor with a ``grad_fn`` that ``select`` accepts and not in ``exclude`` (ids), by a GC scan.

    Each is named by where it is held: ``<module>.<name>[i]``, ``<module>.<Class>.<attr>[i]`` for a class attribute,
    ``<Type>.<attr>[key]``, ``<local 'x' in f (file)>``, or ``<gc>`` when no container or frame holds it. Naming costs
    three passes over the live objects (``gc.get_referrers`` of all found tensors at once, then of their containers,
    then of the dicts that hold those), however many tensors were found. Objects are tested by ``type()``, never by
    attribute access: some objects warn when touched (``torch.distributed.reduce_op`` warns that it is deprecated).
    """
    objects = gc.get_objects()
    held = [t for t in objects if issubclass(type(t), Tensor) and t.grad_fn is not None and id(t) not in exclude]
    del objects
    held = [t for t in held if not _describes_only(t)]
    found = [t for t in held if select(t)]
    del held
    names = _name_tensors(found) if found else {}
    return [(names.get(id(t), "<gc>"), t) for t in found]


def _describes_only(t: Tensor) -> bool:
    """Whether ``t`` holds no memory of its own to report: a ``FakeTensor`` (``torch.compile`` keeps them alive in
    its caches, some with symbolic sizes such as ``s0 * 778240``), a tensor with symbolic sizes, or a meta tensor."""
    try:
        return t.device.type == "meta" or is_fake(t) or any(isinstance(s, torch.SymInt) for s in t.shape)
    except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass that cannot tell: not ours to scan
        return True


def _entries(container: object) -> list[tuple[object, object]]:
    if issubclass(type(container), dict):
        return list(container.items())  # type: ignore[attr-defined]
    if issubclass(type(container), (list, tuple, deque)):
        return list(enumerate(container))  # type: ignore[arg-type]
    return []


def _name_tensors(found: list[Tensor]) -> dict[int, str]:
    """``id(tensor) -> path`` for the found tensors that a container or a frame (outside this file) holds."""
    wanted = {id(t) for t in found}
    ours = {id(found)}
    containers: list[object] = []
    frames: list[types.FrameType] = []
    for ref in gc.get_referrers(*found):
        if id(ref) in ours:
            continue
        if type(ref) is types.FrameType:
            if os.path.realpath(ref.f_code.co_filename) != _THIS_FILE:
                frames.append(ref)
        elif issubclass(type(ref), (list, tuple, deque, dict)):
            containers.append(ref)
    owners = _owners(containers, ours | {id(containers), id(frames)})
    names: dict[int, str] = {}
    for container in containers:
        for key, value in _entries(container):
            if id(value) in wanted:
                names.setdefault(id(value), f"{owners[id(container)]}[{key!r}]")
    for frame in frames:
        for key, value in frame.f_locals.items():
            if id(value) in wanted:
                where = f"{frame.f_code.co_name} ({short_path(frame.f_code.co_filename)})"
                names.setdefault(id(value), f"<local {key!r} in {where}>")
    return names


def _owners(containers: list[object], ignore: set[int]) -> dict[int, str]:
    """``id(container) -> name`` from the dict that holds each container and the object that holds that dict."""
    result = {id(c): f"<{type(c).__name__}>" for c in containers}
    if not containers:
        return result
    ids = set(result)
    holders: dict[int, tuple[dict, object]] = {}  # id(container) -> (the dict holding it, its key there)
    for ref in gc.get_referrers(*containers):
        if type(ref) is dict and id(ref) not in ignore and id(ref) not in ids:
            for key, value in ref.items():
                if id(value) in ids:
                    holders.setdefault(id(value), (ref, key))
    modules = {id(vars(m)): name for name, m in list(sys.modules.items()) if type(m) is types.ModuleType}
    dict_owner = _dict_owners(holders)
    for container_id, (d, key) in holders.items():
        if id(d) in modules:
            result[container_id] = f"{modules[id(d)]}.{key}"
        elif id(d) in dict_owner:
            result[container_id] = f"{dict_owner[id(d)]}.{key}"
        else:
            result[container_id] = f"<dict>[{key!r}]"
    return result


def _dict_owners(holders: dict[int, tuple[dict, object]]) -> dict[int, str]:
    """``id(d) -> name`` of the class or object whose namespace is each dict ``d`` in ``holders``."""
    dicts = {id(d): d for d, _ in holders.values()}
    dict_owner: dict[int, str] = {}
    for owner in gc.get_referrers(*dicts.values()) if dicts else []:
        if issubclass(type(owner), type):
            # A class attribute: the class holds its namespace dict behind a mappingproxy.
            for d, key in holders.values():
                if owner.__dict__.get(key) is d.get(key):
                    dict_owner.setdefault(id(d), f"{owner.__module__}.{owner.__qualname__}")
        elif id(_instance_dict(owner)) in dicts:
            dict_owner.setdefault(id(_instance_dict(owner)), f"<{type(owner).__name__}>")
    return dict_owner


def _instance_dict(obj: object) -> object:
    """``obj.__dict__`` without running the object's own ``__getattribute__`` (which may warn or fail)."""
    try:
        return object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return None


@dataclass
class GraphFootprint:
    """What a set of tensors keeps alive through their autograd graphs.

    Attributes:
        graphs: distinct graphs (tensors whose graphs share a node count once; the per-parameter
            ``AccumulateGrad`` nodes, shared by every step's graph, do not join graphs).
        nodes: graph nodes held (``AccumulateGrad`` excluded).
        tensor_bytes: bytes of the storages of the tensors themselves.
        saved_bytes: bytes of further storages kept by saved tensors not yet freed (``backward()`` frees the
            saved tensors of the nodes it runs; a graph never backpropagated keeps all of them). Parameters,
            buffers and storages already counted are excluded; tensors packed by saved-tensor hooks (activation
            checkpointing, CPU offload) are counted only when the packed object is itself a tensor or a tuple of
            tensors, and are never unpacked.
        truncated: the node walk stopped at its budget; the counts are lower bounds.
    """

    graphs: int = 0
    nodes: int = 0
    tensor_bytes: int = 0
    saved_bytes: int = 0
    truncated: bool = False

    @property
    def pinned_bytes(self) -> int:
        return self.tensor_bytes + self.saved_bytes


_MAX_NODES = 1_000_000
_SAVED_ATTRS: dict[type, tuple[str, ...]] = {}


def _storage(t: Tensor) -> tuple[tuple[str, int | None, int], int] | None:
    """``(key, nbytes)`` identifying the memory behind ``t``; ``None`` for meta tensors."""
    if t.device.type == "meta":
        return None
    try:
        storage = t.untyped_storage()
        return (t.device.type, t.device.index, storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested or wrapper subclasses
        return ("object", None, id(t)), t.numel() * t.element_size()


def storage_keys(tensors: Iterable[Tensor]) -> set[tuple[str, int | None, int]]:
    """The storage keys of ``tensors`` (e.g. a module's parameters and buffers, to exclude from a footprint)."""
    keys = set()
    for t in tensors:
        found = _storage(t)
        if found is not None:
            keys.add(found[0])
    return keys


def _saved_tensors(node: object) -> Iterator[Tensor]:
    """The tensors a graph node still holds for backward, read without running any unpack hook."""
    names = _SAVED_ATTRS.get(type(node))
    if names is None:
        names = _SAVED_ATTRS[type(node)] = tuple(n for n in dir(node) if n.startswith("_raw_saved_"))
    for name in names:
        try:
            value = getattr(node, name)
        except RuntimeError:
            continue
        for saved in value if isinstance(value, (list, tuple)) else (value,):
            data = getattr(saved, "data", None)  # SavedTensor.data: the tensor, the packed object, or None once freed
            if isinstance(data, Tensor):
                yield data
            elif isinstance(data, tuple):
                yield from (d for d in data if isinstance(d, Tensor))
    extra = getattr(node, "__dict__", None)  # custom autograd.Function: tensors stored on ctx
    if extra:
        yield from (v for v in extra.values() if isinstance(v, Tensor))


def graph_footprint(
    tensors: Sequence[Tensor], exclude: set[tuple[str, int | None, int]] | None = None, max_nodes: int = _MAX_NODES
) -> GraphFootprint:
    """Count the graphs, nodes and bytes that ``tensors`` keep alive through their ``grad_fn`` (see
    :class:`GraphFootprint`). ``exclude`` holds storage keys (:func:`storage_keys`) not to count."""
    counted = set(exclude or ())
    result = GraphFootprint()
    for t in tensors:
        found = _storage(t)
        if found is not None and found[0] not in counted:
            counted.add(found[0])
            result.tensor_bytes += found[1]

    parent = list(range(len(tensors)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    nodes: list[object] = []  # keeps the node wrappers alive so their ids stay unique during the walk
    for i, t in enumerate(tensors):
        stack = [t.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or type(node).__name__ == "AccumulateGrad":
                continue
            seen = owner.get(id(node))
            if seen is not None:
                parent[root(i)] = root(seen)
                continue
            if len(nodes) >= max_nodes:
                result.truncated = True
                break
            owner[id(node)] = i
            nodes.append(node)
            stack.extend(fn for fn, _ in node.next_functions)
    for node in nodes:
        for saved in _saved_tensors(node):
            found = _storage(saved)
            if found is not None and found[0] not in counted:
                counted.add(found[0])
                result.saved_bytes += found[1]
    result.nodes = len(nodes)
    result.graphs = len({root(i) for i in range(len(tensors))})
    return result


def steady_growth(values: Sequence[float], min_growth: float, min_r2: float = 0.9) -> float | None:
    """The growth per sample when ``values`` rise steadily, else ``None``.

    Steady: the least-squares slope is positive, a line explains at least ``min_r2`` of the variance
    (a single jump, such as optimizer state allocated at the first step, does not), and the values grew by at
    least ``min_growth`` from the first to the last.
    """
    n = len(values)
    if n < 3 or values[-1] - values[0] < min_growth:
        return None
    mean_x = (n - 1) / 2
    mean_y = math.fsum(values) / n
    sxy = math.fsum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    sxx = math.fsum((i - mean_x) ** 2 for i in range(n))
    syy = math.fsum((v - mean_y) ** 2 for v in values)
    if syy == 0 or sxy <= 0 or sxy * sxy / (sxx * syy) < min_r2:
        return None
    return sxy / sxx
