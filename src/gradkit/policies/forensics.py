"""Find where a non-finite value first appeared: the module, the aten operator and the source line, by replaying
one batch under a dispatch mode.

Running a whole job under ``torch.autograd.detect_anomaly`` costs 2.5-3x in step time. Instead, once a guard has
seen a non-finite loss or gradient, the batch is replayed ONE time under a
:class:`~torch.utils._python_dispatch.TorchDispatchMode`, which sees every aten operator of the forward and of the
backward (the autograd engine runs the backward under the modes of the code that started it):

- After each operator, its floating-point outputs and the tensors it wrote in place are checked (one ``aminmax``
  reduction each: no copy of the tensor's size). An operator whose output is non-finite while none of its inputs
  was is an *origin*. An operator with non-finite inputs hands their origin on to its outputs (a NaN input before
  an infinite one; a NaN made from an infinity, ``inf - inf``, keeps the infinity's origin and notes where it
  became NaN). An operator whose output is finite again ends the trail, so intentional infinities (a ``-inf``
  attention mask before a softmax) are never a culprit.
- The culprit is the origin of the non-finite loss, else the earliest origin among the non-finite parameter
  gradients: what the guard saw, traced back to the operator that made it.
- Where an operator ran: in the forward, the innermost module whose forward (or forward hook) was running, kept by
  a forward pre-hook and a forward hook (``always_call``) on every submodule; in the backward, the module where the
  forward operator of the running autograd node ran (``torch._C._current_autograd_node()``, matched by the node's
  sequence number); a hook on a parameter's gradient names that parameter. No module backward hook is installed,
  so in-place operators (``ReLU(inplace=True)``, ``out += identity``) replay exactly as they trained.
- The source line is the innermost frame of the Python stack outside torch, Lightning and gradkit, read
  when the operator runs; for an operator of the backward, the line of the forward call it differentiates, unless
  user code (a custom ``autograd.Function``'s backward, a gradient hook) made it.
- The parameters' gradients of the replay come from ``torch.autograd.grad``, so ``.grad`` is not touched;
  optionally the replay also runs under ``torch.autograd.detect_anomaly(check_nan=True)``.

A replay that raises or cannot hook the model says so (``"failed"``, ``"unavailable"``): it never reports a finite
replay it did not see. Values that no operator of the replay made (a non-finite batch, or a parameter that was
already non-finite) are named as such. The replay (:func:`gradkit.policies.culprit.replay_micro_batches` runs it in
:func:`gradkit.step.replay.replay`) costs about two forward-and-backward passes (a host read per operator), once, at the
first detection; the training steps themselves run without any of it.
"""

from __future__ import annotations

import linecache
import math
import os
import sys
import threading
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils.hooks import RemovableHandle

from gradkit.step.norms import local_tensor
from gradkit.step.params import clean_name, is_ddp_wrapped

__all__ = ["Finding", "describe_error", "find_nonfinite_origin"]


@dataclass
class Finding:
    """Where a replay first saw a non-finite value.

    Attributes:
        culprit: qualified module name (``"encoder.2"``), ``"<loss>"`` (the code of ``compute_loss`` outside the
            model's modules: the loss), ``"<batch>"``, a parameter or buffer name, or ``None`` when nothing was
            localized (``phase`` says why).
        phase: where the first non-finite value was made:

            - ``"forward"``: by an operator in the forward (or a forward hook) of the leaf module ``culprit``;
            - ``"forward_between_submodules"``: in the forward of ``culprit`` itself, outside its submodules;
            - ``"loss"``: outside every module of the model (forward or backward: ``detail["pass"]``);
            - ``"backward"``: in the backward of an operator that ran in module ``culprit``;
            - ``"parameter_gradient"``: in a hook on the gradient of parameter ``culprit`` (or, when no operator
              can be named, the first parameter whose gradient was non-finite);
            - ``"batch"``: no operator made it: an input (the batch) was already non-finite;
            - ``"parameter"``: no operator made it: the parameter or buffer ``culprit`` was already non-finite;
            - ``"not_reproduced"``: the replay ran and its loss and parameter gradients stayed finite;
            - ``"failed"``: the replay raised (``detail["error"]``); nothing is known about this batch;
            - ``"unavailable"``: no replay ran (``detail["reason"]``).
        detail: JSON-friendly facts: ``op`` (the aten operator that made the value, e.g. ``"aten.div.Tensor"``),
            ``pass`` (``"forward"`` or ``"backward"``), ``source`` (``"file.py:12 in forward: x = x / s"``),
            ``node`` and ``forward_op`` (a backward origin's autograd node and the forward operator it
            differentiates), ``module_type``, ``became_nan`` (where an infinity became NaN), ``input_of``,
            ``nonfinite_param_grads``, ``replay_error``, the anomaly trace; ``rows`` and ``rows_of``: the positions
            along dim 0 of the first non-finite tensor that hold a non-finite value, and its length (the samples of
            the batch, where dim 0 is the batch's).
    """

    culprit: str | None
    phase: str
    detail: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """One sentence for warnings and errors."""
        d = self.detail
        op = f" by `{d['op']}`" if d.get("op") else ""
        where = {
            "forward": f"in the forward of `{self.culprit}`",
            "forward_between_submodules": f"in the forward of `{self.culprit}` itself (outside its submodules)",
            "loss": f"in the {d.get('pass', 'forward')} of the code outside the model's modules (the loss)",
            "backward": f"in the backward of `{self.culprit}`"
            + (f" (of `{d['forward_op']}`; its incoming gradient was finite)" if d.get("forward_op") else ""),
            "parameter_gradient": f"in the gradient of parameter `{self.culprit}`",
        }.get(self.phase)
        if where is not None:
            text = f"first non-finite value made{op} {where}"
            if d.get("source"):
                text += f", at {d['source']}"
            if d.get("became_nan"):
                text += f"; it became NaN in {d['became_nan']}"
            return text
        if self.phase == "batch":
            return f"an input that was already non-finite (the batch), first used{op} in {d.get('input_of')}"
        if self.phase == "parameter":
            return f"parameter or buffer `{self.culprit}` was already non-finite, first used{op} in {d.get('input_of')}"
        if self.phase == "not_reproduced":
            return "the replay of this batch on this rank stayed finite"
        if self.phase == "failed":
            return f"the replay failed: {d.get('error', 'unknown error')}"
        return f"no replay: {d.get('reason', 'not available')}"


def _stored_values(t: Tensor) -> Tensor:
    """The values a tensor stores: those of a sparse one (an ``Embedding(sparse=True)`` gradient), else itself."""
    if t.layout == torch.sparse_coo:
        return t._values()
    if t.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        return t.values()
    return t


def _all_finite(t: Tensor) -> bool:
    """Whether every value a tensor stores is finite (a sparse one's stored values). Reads to the host."""
    return bool(torch.isfinite(_stored_values(t)).all())


# -- the replay ---------------------------------------------------------------------------------------------------
# Operators that turn a constant of the Python code into a tensor (``torch.tensor(float("nan"))``): the operator that
# uses the constant is where its value enters the computation.
_CONSTANTS = frozenset(
    {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift.default}
)
# Operators whose output holds whatever the memory held: never checked (it may hold a freed NaN).
_UNINITIALIZED = frozenset(
    {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided", "resize_", "set_"}
)
# In-place operators that overwrite ``self`` without reading it (so its old values are no input).
_OVERWRITE = frozenset(
    {"copy_", "fill_", "zero_", "normal_", "uniform_", "random_", "bernoulli_", "exponential_", "geometric_"}
    | {"cauchy_", "log_normal_"}
)
_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"
_REDUCIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# A tensor's storage: views of one tensor and the tensor itself hold the same values.
_Key = tuple[torch.device, int]
# Where the Python code was: (file, line, function).
_Frame = tuple[str, int, str]


def _checked(obj: Any) -> bool:
    """Whether ``obj`` is a plain floating-point tensor with values to check (not a subclass, not meta, not empty)."""
    return (
        isinstance(obj, Tensor)
        and type(obj) in (Tensor, nn.Parameter)
        and (obj.is_floating_point() or obj.is_complex())
        and obj.layout == torch.strided
        and obj.device.type != "meta"
        and obj.numel() > 0
    )


def _floats(obj: Any) -> list[Tensor]:
    return [t for t in pytree.tree_leaves(obj) if _checked(t)]


def _key(t: Tensor) -> _Key:
    t = local_tensor(t)  # a DTensor (an FSDP2 parameter) has no storage of its own: its shard's
    return (t.device, t.untyped_storage().data_ptr())


def _state(t: Tensor) -> int:
    """0 when ``t`` is finite, 1 when it holds infinities but no NaN, 2 when it holds a NaN. One ``aminmax``
    reduction (NaN propagates through it) and one host read."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype not in _REDUCIBLE:
        t = t.float()
    low, high = torch.stack(torch.aminmax(t)).tolist()
    if math.isnan(low) or math.isnan(high):
        return 2
    return 0 if math.isfinite(low) and math.isfinite(high) else 1


def _bad_rows(t: Tensor) -> dict[str, Any]:
    """``{"rows": [...], "rows_of": n}``: the positions along dim 0 of ``t`` (``n`` of them) that hold a non-finite
    value, for naming the samples of a batch that made it (:func:`~gradkit.policies.culprit.bad_sample_ids`); empty for
    a scalar or a sparse tensor. A host read: the replay runs on a flagged step only."""
    if t.ndim == 0 or t.layout != torch.strided or t.shape[0] == 0:
        return {}
    values = t.detach()
    if values.is_complex():
        values = torch.view_as_real(values)
    bad = ~torch.isfinite(values.reshape(values.shape[0], -1)).all(dim=1)
    return {"rows": bad.nonzero().flatten().tolist(), "rows_of": int(t.shape[0])}


def _name(func: Any) -> str:
    packet = getattr(func, "overloadpacket", None)
    return getattr(packet, "__name__", "")


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Tensor], list[Tensor]]:
    """The tensors ``func`` writes in place (its ``Tensor(a!)`` arguments): those it also reads (``relu_``'s
    ``self``), and those it only overwrites (an ``out=``, ``copy_``'s ``self``)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return [], []
    updated: list[Tensor] = []
    overwritten: list[Tensor] = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            tensors = _floats(args[i] if i < len(args) else kwargs.get(arg.name))
            only_written = arg.is_out or (i == 0 and _name(func) in _OVERWRITE)
            (overwritten if only_written else updated).extend(tensors)
    return updated, overwritten


def _unique(tensors: list[Tensor]) -> list[Tensor]:
    seen: set[int] = set()
    return [t for t in tensors if not (id(t) in seen or seen.add(id(t)))]


def _internal_roots() -> tuple[str, ...]:
    """The directories whose frames are not the user's code: torch, Lightning and gradkit's two roots."""
    roots = []
    for name in ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "lightning_gradkit", "gradkit"):
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            roots.append(os.path.dirname(file) + os.sep)
    return tuple(roots)


def _format_source(frame: _Frame | None) -> str | None:
    if frame is None:
        return None
    filename, lineno, function = frame
    code = linecache.getline(filename, lineno).strip()
    return f"{filename}:{lineno} in {function}" + (f": {code}" if code else "")


class _Recorder(TorchDispatchMode):
    """Follows non-finite values through every aten operator back to the operator that made them.

    Args:
        module: the model; its submodules get the forward hooks that keep :attr:`stack`.
        stop: the frame of the replay's caller: the search for the user's source line ends there.
    """

    def __init__(self, module: nn.Module, stop: FrameType | None) -> None:
        super().__init__()
        ddp = is_ddp_wrapped(module)
        self.names = {m: clean_name(n, ddp_root=ddp) or "<root>" for n, m in module.named_modules()}
        self.leaves = {m for m in self.names if next(m.children(), None) is None}
        self.tensors = {
            _key(t): clean_name(n, ddp_root=ddp)
            for n, t in (*module.named_parameters(), *module.named_buffers())
            if t.numel() > 0
        }
        self.stack: list[nn.Module] = []  # the modules whose forward is running, innermost last
        self.origins: list[Finding] = []  # every origin, in the order they were made
        self.holds: dict[_Key, int] = {}  # storage -> index of the origin of the non-finite values it holds
        self.constants: dict[_Key, Tensor] = {}  # non-finite constants of the code (``torch.tensor(float("inf"))``)
        self.nodes: dict[int, tuple[str, nn.Module | None, _Frame | None]] = {}  # autograd node -> its forward op
        self.next_node = torch.autograd._get_sequence_nr()
        self.thread = threading.get_ident()
        self.latest: int | None = None
        self.stop = stop
        self.roots = _internal_roots()
        self.internal: dict[str, bool] = {}

    # -- module hooks -------------------------------------------------------------------------------------------
    def enter(self, module: nn.Module, args: Any) -> None:
        self.stack.append(module)

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack and self.stack[-1] is module:
            self.stack.pop()

    # -- operators ----------------------------------------------------------------------------------------------
    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        node = torch._C._current_autograd_node()
        updated, overwritten = _written(func, args, kwargs)
        before = [_state(t) for t in updated]  # an in-place operator overwrites its input
        out = func(*args, **kwargs)
        if threading.get_ident() == self.thread:
            self._note_nodes(func)
        if func in _CONSTANTS:
            # Held until the replay ends, so that no other tensor gets their memory (and their key).
            self.constants.update((_key(t), t) for t in _floats(out) if _state(t))
        elif not getattr(func, "is_view", False) and _name(func) not in _UNINITIALIZED:
            # (A view holds its base's values: they are checked where they are used.)
            made = _unique([*_floats(out), *updated, *overwritten])
            states = [_state(t) for t in made]
            if any(states):
                inputs = list(zip(updated, before, strict=True))
                self._follow(func, node, args, kwargs, [*updated, *overwritten], inputs, made, states)
        return out

    def _note_nodes(self, func: Any) -> None:
        """Remember the operator, module and source line of the autograd nodes ``func`` just created."""
        seq = torch.autograd._get_sequence_nr()
        if seq > self.next_node:
            record = (str(func), self.stack[-1] if self.stack else None, self._user_frame())
            for s in range(self.next_node, seq):
                self.nodes[s] = record
        self.next_node = seq

    def _follow(
        self,
        func: Any,
        node: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        written: list[Tensor],
        updated: list[tuple[Tensor, int]],
        made: list[Tensor],
        states: list[int],
    ) -> None:
        """``func`` made non-finite values: hand on the origin of its non-finite inputs, or make it an origin.

        ``updated`` are the tensors it read and wrote in place, with their state before it ran."""
        ids = {id(t) for t in written}
        inputs = [t for t in _floats((args, kwargs)) if id(t) not in ids and _key(t) not in self.constants]
        inputs += self._held_inside_subclasses((args, kwargs))
        bad = [(t, s) for t, s in ((t, _state(t)) for t in inputs) if s] + [(t, s) for t, s in updated if s]
        nan = [t for t, s in bad if s == 2]
        inf = [t for t, s in bad if s == 1]
        made_nan = 2 in states
        candidates = (nan or inf) if made_nan else (inf or nan)
        if candidates:
            index = min(self._origin_of(t, func, node) for t in candidates)
            if made_nan and not nan:
                self.origins[index].detail.setdefault("became_nan", f"`{func}` in {self._place(node)}")
        else:
            finding = self._made_by(func, node)
            finding.detail.update(_bad_rows(next(t for t, s in zip(made, states, strict=True) if s)))
            index = self._add(finding)
        for t, s in zip(made, states, strict=True):
            if s:
                self.holds[_key(t)] = index
        self.latest = index

    def _held_inside_subclasses(self, obj: Any) -> list[Tensor]:
        """The plain tensors inside the tensor-subclass arguments in ``obj`` (torchao's ``Float8TrainingTensor``: its
        float8 data and scale) whose non-finite values this replay already traced to an origin.

        The mode sees the operator on the subclass (``aten.mm`` of two float8 tensors), not the operators inside it,
        and a subclass is no plain tensor it checks: without this the operator that reads the subclass would be named
        the origin of a value that an earlier operator made (an inf cast to float8 in the next ``Float8Linear``).
        Only traced tensors count, so a subclass whose inner tensors no traced operator made (a DTensor's local shard)
        changes nothing."""
        found: list[Tensor] = []
        pending = [t for t in pytree.tree_leaves(obj) if isinstance(t, Tensor) and is_traceable_wrapper_subclass(t)]
        while pending:
            outer = pending.pop()
            for name in outer.__tensor_flatten__()[0]:
                inner = getattr(outer, name)
                if is_traceable_wrapper_subclass(inner):
                    pending.append(inner)
                elif _checked(inner) and _key(inner) in self.holds:
                    found.append(inner)
        return found

    def _add(self, finding: Finding) -> int:
        self.origins.append(finding)
        return len(self.origins) - 1

    def _origin_of(self, t: Tensor, func: Any, node: Any) -> int:
        """The origin of a non-finite input; one that no operator made is the batch, a parameter or a buffer."""
        key = _key(t)
        if key not in self.holds:
            detail = {"op": str(func), "input_of": self._place(node)}
            name = self.tensors.get(key)
            finding = Finding(name, "parameter", detail) if name is not None else Finding("<batch>", "batch", detail)
            finding.detail.update(_bad_rows(t))
            self.holds[key] = self._add(finding)
        return self.holds[key]

    def _made_by(self, func: Any, node: Any) -> Finding:
        """The finding for ``func`` making a non-finite value from finite inputs."""
        here = self._user_frame()
        detail: dict[str, Any] = {"op": str(func), "pass": "forward" if node is None else "backward"}
        if node is None:
            module = self.stack[-1] if self.stack else None
            phase = "forward" if module in self.leaves else "forward_between_submodules"
            finding = self._in_module(module, phase, detail)
        elif node.name() == _ACCUMULATE_GRAD:
            finding = Finding(self.tensors.get(_key(node.variable), "<parameter>"), "parameter_gradient", detail)
        else:
            detail["node"] = node.name()
            forward_op, module, forward_frame = self.nodes.get(node._sequence_nr(), (None, None, None))
            if forward_op is None:  # a node this replay's forward did not make
                finding = Finding(f"<{node.name()}>", "backward", detail)
            else:
                detail["forward_op"] = forward_op
                finding = self._in_module(module, "backward", detail)
            here = here or forward_frame
        source = _format_source(here)
        if source is not None:
            finding.detail["source"] = source
        return finding

    def _in_module(self, module: nn.Module | None, phase: str, detail: dict[str, Any]) -> Finding:
        if module is None:
            return Finding("<loss>", "loss", detail)
        return Finding(self.names[module], phase, {**detail, "module_type": type(module).__name__})

    def _place(self, node: Any) -> str:
        """Where an operator runs, for a message: the forward or the backward of a module, or of the code outside
        the modules (the loss)."""
        if node is None:
            module, where = (self.stack[-1] if self.stack else None), "the forward"
        elif node._sequence_nr() in self.nodes:
            module, where = self.nodes[node._sequence_nr()][1], "the backward"
        else:  # a parameter's gradient hook, or a node this replay's forward did not make
            return f"the backward ({node.name()})"
        return f"{where} of " + (f"`{self.names[module]}`" if module is not None else "the code outside the modules")

    def _user_frame(self) -> _Frame | None:
        """The innermost frame outside torch, Lightning and this package, up to the replay's caller."""
        frame = sys._getframe(1)
        while frame is not None and frame is not self.stop:
            filename = frame.f_code.co_filename
            internal = self.internal.get(filename)
            if internal is None:
                internal = self.internal[filename] = filename.startswith(self.roots)
            if not internal:
                return (filename, frame.f_lineno, frame.f_code.co_name)
            frame = frame.f_back
        return None

    def origin(self, tensors: list[Tensor]) -> Finding | None:
        """The earliest origin of the non-finite values in ``tensors`` (a copy), or ``None``."""
        indices = [self.holds[k] for k in (_key(t) for t in tensors if _checked(t)) if k in self.holds]
        if not indices:
            return None
        found = self.origins[min(indices)]
        return Finding(found.culprit, found.phase, dict(found.detail))


def describe_error(err: BaseException) -> str:
    """``"RuntimeError: <the first line of the message>"``: an error in one line, for events and messages."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _hook(recorder: _Recorder) -> list[RemovableHandle]:
    """The forward pre-hook and forward hook that keep ``recorder.stack``, on every module; none if one fails."""
    handles: list[RemovableHandle] = []
    try:
        for m in recorder.names:
            if not isinstance(m, torch.jit.ScriptModule):  # which takes no Python hooks: its operators are its parent's
                handles.append(m.register_forward_pre_hook(recorder.enter, prepend=True))
                handles.append(m.register_forward_hook(recorder.leave, always_call=True))
    except Exception:
        for h in handles:
            h.remove()
        raise
    return handles


def find_nonfinite_origin(
    module: nn.Module,
    compute_loss: Callable[[], Tensor | None],
    backward_scale: Tensor | float | None = None,
    anomaly: bool = False,
) -> Finding:
    """Replay ``compute_loss`` and its backward under a dispatch mode and say where non-finite values began (see the
    module docstring). The caller restores state (:func:`gradkit.step.replay.replay`); this function only adds and
    removes forward hooks and the mode.

    Args:
        module: the model whose submodules get forward hooks. Culprits are named by
            :func:`~gradkit.step.norms.clean_name`, like the GradNormMonitor's keys: without the components
            of ``torch.compile``, FSDP1 and ``checkpoint_wrapper``, and without DDP's leading ``module`` when
            ``module`` is DDP-wrapped. A ``ScriptModule`` gets no hook: its operators count as its parent's.
        compute_loss: runs the forward and returns the loss (``None`` when there is nothing to differentiate).
        backward_scale: multiply the loss by this before the backward (the ``GradScaler``'s scale: fp16 overflows
            only reproduce under the same scale).
        anomaly: also run under ``torch.autograd.detect_anomaly(check_nan=True)`` and report its message.

    Returns:
        A :class:`Finding`; ``phase="failed"`` with ``detail["error"]`` when ``compute_loss`` or the backward raised
        before a non-finite loss or gradient was seen, ``phase="unavailable"`` with ``detail["reason"]`` when a
        module refused the forward hooks (nothing ran).

    Example::

        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> _ = net[1].register_forward_hook(lambda m, i, o: o / 0)
        >>> finding = find_nonfinite_origin(net, lambda: net(torch.ones(1, 2)).sum())
        >>> finding.culprit, finding.phase, finding.detail["op"]
        ('1', 'forward', 'aten.div.Tensor')
    """
    recorder = _Recorder(module, sys._getframe(0))
    param_names = [(clean_name(n, ddp_root=is_ddp_wrapped(module)), p) for n, p in module.named_parameters()]
    param_names = [(n, p) for n, p in param_names if p.requires_grad]
    try:
        handles = _hook(recorder)
    except Exception as err:  # a module that refuses Python hooks: nothing ran
        return Finding(None, "unavailable", {"reason": f"cannot hook the model's modules: {describe_error(err)}"})
    detail: dict[str, Any] = {}
    loss: Tensor | None = None
    grads: tuple[Tensor | None, ...] = ()
    error: Exception | None = None
    anomaly_ctx = torch.autograd.detect_anomaly(check_nan=True) if anomaly else nullcontext()
    try:
        with warnings.catch_warnings(record=True) as caught, anomaly_ctx, torch.enable_grad(), recorder:
            warnings.simplefilter("always")
            try:
                loss = compute_loss()
                if loss is not None and loss.requires_grad:
                    scaled = loss if backward_scale is None else loss * backward_scale
                    grads = torch.autograd.grad(scaled, [p for _, p in param_names], allow_unused=True)
            except Exception as err:  # reported in the finding: a replay never stops the run
                error = err
            if anomaly:
                traces = [str(w.message) for w in caught if "Traceback of forward call" in str(w.message)]
                if traces:
                    # The header, then the innermost frames: where the forward op that made the NaN was called.
                    head, _, body = traces[0].partition("\n")
                    detail["anomaly_forward_trace"] = head + "\n..." + body[-1500:]
    finally:
        for h in handles:
            h.remove()
    loss_bad = loss is not None and not _all_finite(loss.detach())
    if loss is not None:
        detail["loss_finite"] = not loss_bad
    bad = [(n, g) for (n, _), g in zip(param_names, grads, strict=False) if g is not None and not _all_finite(g)]
    if bad:
        detail["nonfinite_param_grads"] = [n for n, _ in bad[:20]]
    finding = _conclude(recorder, loss if loss_bad else None, bad, error, anomaly)
    if error is not None and finding.phase != "failed":
        detail["replay_error"] = describe_error(error)  # raised after the non-finite value was seen
    finding.detail = {**detail, **finding.detail}
    return finding


def _conclude(
    recorder: _Recorder,
    bad_loss: Tensor | None,
    bad_grads: list[tuple[str, Tensor]],
    error: Exception | None,
    anomaly: bool,
) -> Finding:
    """The finding of a replay from what it saw: the loss first, then the gradients, then the error."""
    if bad_loss is not None:
        return recorder.origin([bad_loss]) or Finding("<loss>", "loss")
    if bad_grads:
        return recorder.origin([g for _, g in bad_grads]) or Finding(bad_grads[0][0], "parameter_gradient")
    if error is not None:
        if anomaly and "returned nan values" in str(error) and recorder.latest is not None:
            # detect_anomaly stopped the backward at a node that returned NaN: the latest non-finite value.
            found = recorder.origins[recorder.latest]
            return Finding(found.culprit, found.phase, dict(found.detail))
        return Finding(None, "failed", {"error": describe_error(error)})
    return Finding(None, "not_reproduced")
