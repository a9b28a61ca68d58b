"""The torch (and torchmetrics) private attributes gradkit reads, one small function each, no Lightning in it.

They sit in the torch-only ``gradkit`` root (not in :mod:`lightning_gradkit._compat`, which indexes them) because
the Lightning-free step pipeline needs them as much as the Trainer does: a plain PyTorch or Fabric loop with a
``GradScaler`` and a fused optimizer asks the same two questions (what is the loss scale, without a host sync;
does ``optimizer.step`` honour ``found_inf``). Each function says why no public API does. Run on torch 2.13, and
read in the source of torch 2.4.0 and 2.5.1 (the package's floor is ``torch>=2.5``): same attributes, same
meaning.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn
from torch.amp.grad_scaler import GradScaler, OptState
from torch.optim import Optimizer

__all__ = ["gradients_still_scaled", "handles_found_inf", "loss_scale", "metric_state_names"]


def loss_scale(scaler: GradScaler | None) -> Tensor | None:
    """The scale an AMP ``GradScaler`` multiplies losses (and so gradients) by, as its device tensor.

    Reads the scaler's private ``_scale``: ``GradScaler.get_scale()`` would synchronize the host with the device
    (it returns a Python float). ``None`` without a scaler, for a disabled one, and before its first ``scale`` call
    (``_scale`` is created lazily then). ``_scale`` is a float32 scalar tensor or ``None``.
    """
    if scaler is None or not scaler.is_enabled():
        return None
    return getattr(scaler, "_scale", None)


def gradients_still_scaled(scaler: GradScaler, optimizer: Optimizer) -> bool:
    """Whether ``scaler`` has not unscaled ``optimizer``'s gradients since its last ``update``.

    Reads the private ``GradScaler._per_optimizer_states[id(optimizer)]["stage"]``: ``OptState.READY`` until
    ``unscale_`` (or ``step``) runs for the optimizer. No public API tells whether ``unscale_`` ran, and calling it
    to find out raises on the second call. A missing entry (``_per_optimizer_states`` is a ``defaultdict``; ``.get``
    does not create one) means nothing happened to the optimizer yet: READY.
    """
    state = scaler._per_optimizer_states.get(id(optimizer))
    return state is None or state["stage"] is OptState.READY


def handles_found_inf(optimizer: Optimizer) -> bool:
    """Whether ``optimizer.step`` honours a ``found_inf`` (and ``grad_scale``) attribute on device in every param
    group (PyTorch's fused optimizers).

    ``_step_supports_amp_scaling`` is the private flag ``GradScaler.step`` itself tests before it sets
    ``optimizer.found_inf`` and ``grad_scale``; Adam, AdamW, SGD and Adagrad set it only with ``fused=True``.
    There is no public equivalent. The attributes are optimizer-wide but torch reads them per param group: a group
    with ``fused=False`` in a fused optimizer (torch accepts it) runs the foreach or single-tensor kernel, which
    asserts that both are ``None``. So the optimizer counts as fused only when every group is.
    """
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        group.get("fused", optimizer.defaults.get("fused", False)) for group in optimizer.param_groups
    )


def metric_state_names(metric: nn.Module) -> Sequence[str]:
    """The state attributes of a ``torchmetrics.Metric``: its private ``_defaults`` (the names ``add_state`` made).

    The public ``Metric.metric_state`` arrived after torchmetrics 1.0.0 (the package's floor), and reads the same
    ``_defaults``. Checked on torchmetrics 1.0.0 and 1.9.0.
    """
    return list(metric._defaults)
