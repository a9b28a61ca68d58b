"""Find where a non-finite value first appeared, by replaying one batch with module hooks.

Running a whole job under ``torch.autograd.detect_anomaly`` costs 2.5-3x in step time. Instead, once a guard has
seen a non-finite loss or gradient, the batch is replayed ONE time with

- forward pre-hooks and forward hooks on every submodule: the first module (in execution order) whose output is
  non-finite while its inputs were finite is the culprit; non-finite *inputs* arriving at a module name the
  module whose own forward code (between submodules) produced them, or the batch itself;
- full backward hooks (``register_full_backward_hook``): if the forward was clean, the first module (in backward
  order) whose input gradient is non-finite while its output gradient was finite;
- the parameters' gradients of the replay (``torch.autograd.grad``, so ``.grad`` is not touched);
- optionally ``torch.autograd.detect_anomaly(check_nan=True)``, for this replay only.

The replay runs inside the package's one replay context (:func:`lightning_gradkit.replay.replay`): the RNG
states, module buffers (e.g. BatchNorm running stats), ``.grad``, train/eval modes and ``torchmetrics`` states are
restored afterwards, ``self.log`` does nothing, and gradkit's own per-micro-batch statistics (token counts, window
losses) ignore it. The RNG state saved at the start of the bad batch is set for the replay, so dropout masks
repeat. Other Python side effects of the replayed code (a counter, a print, an append to a list) happen once more.

:func:`find_nonfinite_origin` is plain PyTorch; :func:`replay_training_step` wires it to a LightningModule.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_gradkit.core.norms import clean_name, is_ddp_wrapped, loss_scale
from lightning_gradkit.replay import RNGState, replay


@dataclass
class Finding:
    """Where a replay first saw a non-finite value.

    Attributes:
        culprit: qualified module name (``"encoder.2"``), ``"<batch>"``, ``"<loss>"`` (the loss computation after the
            model), a parameter name, or ``None`` when the replay stayed finite.
        phase: ``"forward"``, ``"forward_between_submodules"``, ``"batch"``, ``"loss"``, ``"backward"``,
            ``"backward_downstream"``, ``"parameter_gradient"``, ``"not_reproduced"`` or ``"unavailable"``.
        detail: JSON-friendly facts (e.g. which output, the anomaly message, non-finite parameter gradients).
    """

    culprit: str | None
    phase: str
    detail: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """One sentence for warnings and errors."""
        where = {
            "forward": f"the forward output of `{self.culprit}`",
            "forward_between_submodules": f"the forward of `{self.culprit}` (between its submodules)",
            "batch": f"the inputs of `{self.detail.get('input_of')}` (the batch or the training_step code)",
            "loss": "the loss computation (the model's outputs were finite)",
            "backward": f"the backward of `{self.culprit}` (its output gradient was finite)",
            "backward_downstream": f"the gradient arriving at the output of `{self.culprit}` (from the code after it)",
            "parameter_gradient": f"the gradient of parameter `{self.culprit}`",
        }.get(self.phase)
        if where is not None:
            return f"first non-finite value in {where}"
        if self.phase == "not_reproduced":
            return "the replay of this batch on this rank stayed finite"
        return f"no replay ({self.detail.get('reason', 'not available')})"


def _tensors(obj: Any) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def all_finite(obj: Any) -> bool:
    """Whether every floating-point tensor in a (nested) structure is finite. Reads to the host."""
    return all(bool(torch.isfinite(t).all()) for t in _tensors(obj) if t.is_floating_point() or t.is_complex())


# -- the replay ---------------------------------------------------------------------------------------------------
class _Recorder:
    """Hooks that remember the first place a non-finite value appeared, in execution order."""

    def __init__(self, names: dict[nn.Module, str]) -> None:
        self.names = names
        self.stack: list[str] = []
        self.forward: Finding | None = None
        self.backward: Finding | None = None
        self.backward_calls = 0

    def pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        name = self.names[module]
        if self.forward is None and not all_finite((args, kwargs)):
            if self.stack:
                self.forward = Finding(self.stack[-1], "forward_between_submodules", {"input_of": name})
            else:
                self.forward = Finding("<batch>", "batch", {"input_of": name})
        self.stack.append(name)

    def post_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        name = self.names[module]
        if self.stack and self.stack[-1] == name:
            self.stack.pop()
        if self.forward is None and not all_finite(output):
            self.forward = Finding(name, "forward", {"module_type": type(module).__name__})

    def backward_hook(self, module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        self.backward_calls += 1
        if self.backward is not None:
            return
        name = self.names[module]
        if not all_finite(grad_output):
            # The gradient arriving at this module's output is already bad: made by the code after it.
            first = self.backward_calls == 1
            self.backward = Finding("<loss>" if first else name, "loss" if first else "backward_downstream")
        elif not all_finite(grad_input):
            self.backward = Finding(name, "backward", {"module_type": type(module).__name__})


def find_nonfinite_origin(
    module: nn.Module,
    compute_loss: Callable[[], Tensor | None],
    backward_scale: Tensor | float | None = None,
    anomaly: bool = False,
) -> Finding:
    """Replay ``compute_loss`` with hooks on every submodule of ``module`` and say where non-finite values began.

    The caller restores state (see :func:`lightning_gradkit.replay.replay`); this function only adds and removes hooks.

    Args:
        module: the model whose submodules get hooks. Culprits are named by
            :func:`~lightning_gradkit.core.norms.clean_name`, like the GradNormMonitor's keys: without the components
            of ``torch.compile``, FSDP1 and ``checkpoint_wrapper``, and without DDP's leading ``module`` when
            ``module`` is DDP-wrapped.
        compute_loss: runs the forward and returns the loss (``None`` when there is nothing to differentiate).
        backward_scale: multiply the loss by this before the backward (the ``GradScaler``'s scale: fp16 overflows
            only reproduce under the same scale).
        anomaly: also run under ``torch.autograd.detect_anomaly(check_nan=True)`` and report its message.

    Example::

        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> _ = net[1].register_forward_hook(lambda m, i, o: o * float("nan"))
        >>> find_nonfinite_origin(net, lambda: net(torch.ones(1, 2)).sum()).culprit
        '1'
    """
    # Names as the GradNormMonitor keys them (core.norms.clean_name); the root, even a wrapped one, is "<root>".
    ddp = is_ddp_wrapped(module)
    names = {m: clean_name(n, ddp_root=ddp) or "<root>" for n, m in module.named_modules()}
    recorder = _Recorder(names)
    handles = []
    for m in names:
        handles.append(m.register_forward_pre_hook(recorder.pre_forward, with_kwargs=True))
        handles.append(m.register_forward_hook(recorder.post_forward, with_kwargs=True))
        handles.append(m.register_full_backward_hook(recorder.backward_hook))
    detail: dict[str, Any] = {}
    param_names = [(clean_name(n, ddp_root=ddp), p) for n, p in module.named_parameters() if p.requires_grad]
    bad_params: list[str] = []
    loss: Tensor | None = None
    anomaly_ctx = torch.autograd.detect_anomaly(check_nan=True) if anomaly else nullcontext()
    try:
        with warnings.catch_warnings(record=True) as caught, anomaly_ctx, torch.enable_grad():
            warnings.simplefilter("always")
            try:
                loss = compute_loss()
                if loss is not None and loss.requires_grad:
                    detail["loss_finite"] = bool(torch.isfinite(loss.detach()).all())
                    scaled = loss if backward_scale is None else loss * backward_scale
                    grads = torch.autograd.grad(scaled, [p for _, p in param_names], allow_unused=True)
                    pairs = zip(param_names, grads, strict=True)
                    bad_params = [n for (n, _), g in pairs if g is not None and not all_finite(g)]
            except RuntimeError as err:
                detail["replay_error"] = str(err).splitlines()[0]
            if anomaly:
                traces = [str(w.message) for w in caught if "Traceback of forward call" in str(w.message)]
                if traces:
                    # The header, then the innermost frames: where the forward op that made the NaN was called.
                    head, _, body = traces[0].partition("\n")
                    detail["anomaly_forward_trace"] = head + "\n..." + body[-1500:]
    finally:
        for h in handles:
            h.remove()
    if bad_params:
        detail["nonfinite_param_grads"] = bad_params[:20]
    finding = recorder.forward
    if finding is None and loss is not None and not detail.get("loss_finite", True):
        finding = Finding("<loss>", "loss")
    if finding is None:
        finding = recorder.backward
    if finding is None and bad_params:
        finding = Finding(bad_params[0], "parameter_gradient")
    if finding is None:
        finding = Finding(None, "not_reproduced")
    finding.detail = {**detail, **finding.detail}
    return finding


def replay_training_step(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    batch: Any,
    batch_idx: int,
    rng: RNGState | None = None,
    anomaly: bool = False,
) -> Finding:
    """Replay ``pl_module.training_step(batch, batch_idx)`` once and locate the first non-finite value.

    Runs under the precision plugin's autocast, with ``self.log`` silenced, and with the ``GradScaler``'s scale on
    the loss. The LightningModule is called directly (not through the DDP wrapper): no collective is issued by
    the replay itself, but ``training_step`` may issue its own (``self.all_gather``): then every rank must replay
    the same micro-batches in the same order. Parameters, buffers, gradients, RNG states and ``torchmetrics``
    states are the same afterwards; other side effects of ``training_step`` happen a second time.

    Args:
        trainer: the running Trainer.
        pl_module: the LightningModule.
        batch: the batch as ``training_step`` received it.
        batch_idx: its index.
        rng: torch RNG state captured before the original ``training_step`` (repeats dropout masks).
        anomaly: also run the replay under ``torch.autograd.detect_anomaly``.
    """
    if not pl_module.automatic_optimization:
        return Finding(None, "unavailable", {"reason": "manual optimization: the training step steps optimizers"})
    scale = loss_scale(getattr(trainer.precision_plugin, "scaler", None))

    def compute_loss() -> Tensor | None:
        with trainer.precision_plugin.train_step_context():
            out = pl_module.training_step(batch, batch_idx)
        if isinstance(out, dict):
            out = out.get("loss")
        return out if isinstance(out, Tensor) else None

    with replay(pl_module, rng):
        return find_nonfinite_origin(pl_module, compute_loss, scale, anomaly)
