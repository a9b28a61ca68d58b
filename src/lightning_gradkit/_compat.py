"""Where gradkit goes past Lightning's public API: every private read and every runtime patch, in one map.

Lightning objects arrive as arguments; the torch-only code (the ``gradkit`` import root) keeps its own few torch and
torchmetrics private reads in :mod:`gradkit._util.torch_compat`.

Read in the source of Lightning 2.4.0, 2.5.0, 2.5.5 and 2.6.6; run with torch 2.13 by the full suite on 2.6.6 and
by ``make test-compat`` on 2.5.6 and 2.6.6. The package supports ``lightning>=2.5,<3`` and ``torch>=2.5``
(docs/versions.md): Lightning 2.4 reads the same attributes, but its loop runs the last batch again when a fit
resumes from a checkpoint saved in ``on_train_batch_end``, so no exact mid-epoch resume can be built on it. A note
says where releases differ.

**Private reads** (one function each where more than one place needs it; a comment says why no public API does):

- :func:`~lightning_gradkit.trainer_door.batches_that_stepped` (in ``trainer_door.py``, the Trainer door, whose every
  step reads it): ``fit_loop.epoch_loop._batches_that_stepped``, the step Lightning logs under.
- :func:`epoch_ends_with_this_batch`: ``fit_loop.epoch_loop._num_ready_batches_reached()``.
- :func:`publish_callback_metrics`: writes into the dict ``trainer.callback_metrics`` returns
  (``_LoggerConnector._callback_metrics``).
- :func:`ddp_start_method`: ``DDPStrategy._start_method``.
- :func:`set_root_device`: writes ``SingleDeviceStrategy._root_device``.
- ``LightningModule._trainer`` in ``GradKitStrategyMixin.connect`` (``strategy.py``): the public ``trainer`` property
  raises for a module not attached to a Trainer, and ``connect`` also runs outside ``fit``.
- ``LightningOptimizer._optimizer`` in :func:`gradkit.step.protocol.unwrapped`, the one place that unwraps an optimizer
  (Fabric's ``_FabricOptimizer`` has the public ``optimizer``; Lightning's wrapper has no public attribute).
- ``Callback._generate_state_key`` (``ActivationCheckpointing``, ``SyncAudit``, ``GraphLeakGuard``): the way
  Lightning's documentation tells a callback to build its ``state_key``; the torch policies rebuild its format with
  :func:`gradkit.step.protocol.state_key`, so a key is the same behind every door.
- ``Callback._legacy_state_key`` (``trainer_door.py``, the note on callbacks added at a restart): the key Lightning
  itself still accepts when it loads a callback's state (``Trainer._checkpoint_connector``), so a callback whose state
  a checkpoint holds under it is not reported as new.
- ``ModelParallelStrategy._save_distributed_checkpoint`` (``strategy.py``, ``saves_rank_local_state``): whether the
  strategy writes a distributed checkpoint, where each rank's own callback state can go (the constructor argument
  ``save_distributed_checkpoint`` has no public getter); read with ``getattr`` and a default of ``False`` (one file
  from rank 0: the rank-local state is then refused with the reason).
- torch and torchmetrics, in :mod:`gradkit._util.torch_compat` (the Lightning-free pipeline needs them too):
  torchmetrics' ``Metric._defaults`` (``metric_state_names``), ``GradScaler._scale``
  (:func:`~gradkit._util.torch_compat.loss_scale`), ``GradScaler._per_optimizer_states`` (``gradients_still_scaled``),
  ``Optimizer._step_supports_amp_scaling`` (``handles_found_inf``).

Public-named loop properties are read directly where needed (``fit_loop.total_batch_idx``,
``fit_loop.epoch_loop.batch_idx``, ``fit_loop.epoch_loop.batch_progress``): public by name, and the same in every
release above. So are torch's underscore APIs that torch's own public code builds on and that the package uses in the
same way: ``torch._foreach_*`` (``torch.nn.utils.clip_grad``), sparse ``_values()``/``_indices()`` (``torch.sparse``),
``Tensor._version`` and ``Tensor._base`` (views), ``Module._buffers``/``_parameters``/``_modules`` (``nn.Module``
state), a DTensor's ``_local_tensor`` (``to_local()`` without its autograd node), a compiled module's ``_orig_mod``
(``torch.compile``'s wrapper), ``torch.utils._python_dispatch``/``_pytree``, an ``OpOverload``'s ``_schema``,
``torch._amp_foreach_non_finite_check_and_unscale_`` (``GradScaler.unscale_``'s own multi-tensor check, with a scale of
1: the exact NaN/Inf flag off the Triton kernel, :mod:`gradkit.step._multi_norm`), ``torch._C._current_autograd_node``
and the autograd node's ``_sequence_nr()`` / ``torch.autograd.graph``'s ``_get_sequence_nr`` (forensics, the planner,
the graph audit), ``torch._C`` for the CUDA event and pinned-memory calls of :mod:`gradkit.step.host_lag`, and the
FSDP2/composable-checkpoint lookups that fall back to private paths on torch < 2.6 (``callbacks/validation.py``,
``activation_checkpointing/injection.py``). Two more torch reads, each guarded by a type check with a fallback:
``Optimizer._optimizer_step_post_hooks`` (``policies/update_clip.py``: UpdateClip's post-hook moved first, so the
monitor's update ratio sees the clipped update) and Fabric's ``_FabricModule._forward_module``
(``policies/noise_scale.py``: the DDP module under Fabric's wrapper). From the standard library: ``sys._getframe``
(the source line of a sync or a culprit), ``functools._lru_cache_wrapper`` (the type of an ``lru_cache``, whose cache
the inference-tensor search reads) and a namedtuple's ``_fields`` (public API).

**Runtime patches**. Each shadows an INSTANCE attribute (never a class attribute) and puts back what was there;
the short-lived ones go through :func:`~gradkit.step.gate.shadowed` (Lightning-free, so the Fabric and
plain-PyTorch door use it too).

1. ``optimizer.step`` is the strategy's gate while ``Strategy.optimizer_step`` runs (``strategy.py``,
   ``shadowed``); :class:`~gradkit.GradKit` shadows it the same way while its ``step`` runs, when the plan may
   skip or leaves a factor to the fused kernel. Why: a callback cannot cancel a step, and every precision plugin ends
   in ``optimizer.step`` (``Precision.optimizer_step`` calls ``optimizer.step(closure=...)``; ``MixedPrecision``
   calls ``scaler.step(optimizer)``, which calls ``optimizer.step()``), so the gate is the one place that sees them.
2. ``optimizer.found_inf`` and ``optimizer.grad_scale`` while a fused optimizer steps (``gradkit/step/gate.py``,
   ``shadowed``): the attributes ``GradScaler.step`` itself sets for fused optimizers; the gate raises ``found_inf``
   on a skip and divides the plan's common factor into ``grad_scale`` (combined with the scaler's), so the fused
   kernel skips, or scales, on device without a host sync.
3. ``LightningModule.lr_scheduler_step`` from ``setup`` to ``teardown`` (``strategy.py``): Lightning calls this
   hook for every due scheduler, looked up with ``getattr`` (``call._call_lightning_module_hook``), so an instance
   attribute takes effect; the gate holds step-interval schedulers after skipped steps. Not installed when the
   module already has an instance attribute of that name.
4. ``LRSchedulerConfig.frequency = 1`` for gated step-interval schedulers, from ``setup`` to ``teardown``
   (``strategy.py``): Lightning's loop steps a scheduler when ``(batch_idx + 1) % frequency == 0`` and knows
   nothing of skipped steps, so the gate is called after every step and applies the real frequency over applied
   steps.
5. ``LightningModule.training_step`` wrapped by ``AccumulationGuard(normalize="tokens")`` from ``setup`` to
   ``teardown`` (``callbacks/accumulation.py``): each micro-batch's token count is needed before its backward, and
   callbacks see ``training_step``'s output only in ``on_train_batch_end``, after the optimizer step.
   ``Strategy.training_step`` reaches it by attribute lookup, also through DDP/FSDP (``_ForwardRedirection`` does
   ``getattr(original_module, "training_step")``).
6. ``module.forward`` of each checkpointed module (``activation_checkpointing/injection.py``): keeps every module
   and parameter name (``checkpoint_wrapper`` adds ``_checkpoint_wrapped_module.``) and leaves forward hooks (FSDP2,
   DDP) outside the checkpointed region. Plain PyTorch; removed by ``remove``.
7. ``LightningModule.log``/``log_dict`` do nothing during a replay (``gradkit/step/replay.py``, ``shadowed``): a
   replayed ``training_step`` must not log twice, and Lightning has no switch for it.
8. ``LightningModule.on_train_batch_end`` for one audited step (``diagnostics/sync_audit.py``): Lightning calls
   the module's hook after every callback's, so the audit keeps recording until it returns.
9. ``trainer.callbacks`` loses the callback CLASSES given instead of instances
   (``trainer_door.check_callback_instances``, from ``GradKitStrategyMixin.connect`` or a callback's ``setup``)
   before gradkit raises its error: Lightning's ``on_exception`` hooks, called while the error propagates, would
   call them unbound and replace the message.
10. A module's buffers and tensor attributes replaced by clones, once, when
    ``InferenceModeValidation(on_inference_tensors="clone")`` finds inference tensors left by validation
    (``callbacks/validation.py``: ``module._buffers[name]`` and ``module.__dict__[name]``, the way ``nn.Module``
    itself stores them): the clones are ordinary tensors, so training can save them for backward.
11. A torchmetrics ``Metric``'s state attributes put back after a replay (``gradkit/step/replay.py``, ``setattr`` of the
    names ``metric_state_names`` lists): a replayed ``training_step`` must not count its batch twice.

**The Hugging Face door** (:mod:`gradkit.doors.huggingface`) lists its own: ``Trainer._get_grad_norm`` and
``Trainer._clip_grad_norm`` replaced on the instance, accelerate's ``AcceleratedOptimizer._is_overflow`` set on a
skip, torch's ``optimizer._opt_called`` / ``_wrapped_by_lr_sched`` kept for the LR scheduler (read on transformers
5.23.0, accelerate 1.15.0).

**Hooks** gradkit registers on the user's objects, with torch's public ``register_*`` APIs, each removed by its owner:
the loop door's first-window forward pre-hooks (removed at the first forward, or by ``GradKit.close``); the culprit
replay's and the planner's forward hooks (removed when the replay or the measurement ends); ``GradNormMonitor``'s
optimizer step post-hook on logging steps with ``update_ratio=True`` (removed when the step returns); the
escalation's optimizer step pre/post hooks while an LR cut ramps back (removed when it ends, at ``teardown`` or by
``GradKit.close``).

Subclassing is not patching: the GradKit strategies override public ``Strategy`` methods (``setup``,
``teardown``, ``optimizer_step``, ``training_step``, ``save_checkpoint``, ``load_checkpoint``) and call ``super()``.

**Strategy names**. :func:`register_strategy_names` puts factories (not the classes) in Lightning's
``StrategyRegistry``: ``StrategyRegistry.get(name)`` only calls what is registered (``data["strategy"](**init)``,
typed ``Callable``; the same in every release above), so registering imports nothing of gradkit's Lightning code.
``import lightning_gradkit`` runs it (the package imports Lightning: it is the Lightning layer; torch-only code
lives in the ``gradkit`` import root, which imports no Lightning).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, Strategy

__all__ = [
    "ddp_start_method",
    "epoch_ends_with_this_batch",
    "publish_callback_metrics",
    "register_strategy_names",
    "set_root_device",
]


# -- private reads ---------------------------------------------------------------------------------------------------
def publish_callback_metrics(trainer: pl.Trainer, values: dict[str, float]) -> None:
    """Make host values logged straight to the loggers visible in ``trainer.callback_metrics`` too (0-dim CPU tensors,
    as Lightning keeps them), for ``ModelCheckpoint(monitor=...)``, ``EarlyStopping`` and user code.

    ``trainer.callback_metrics`` returns ``_LoggerConnector._callback_metrics``, the dict Lightning itself updates from
    ``self.log`` results and clears at the start of each fit (``reset_metrics``): writing into it is the only way in
    without ``self.log``, whose per-value cost (a ``ResultMetric`` moved to the device, then one ``.item()`` per value
    at the flush: a host sync each on a GPU) is what logging the values directly avoids. Read in 2.5.6 and 2.6.6.
    """
    trainer.callback_metrics.update({key: _host_scalar(value) for key, value in values.items()})


def _host_scalar(value: float) -> torch.Tensor:
    import torch

    return torch.tensor(value)


def epoch_ends_with_this_batch(trainer: pl.Trainer) -> bool:
    """Whether the batch under way is the epoch's last: ``fit_loop.epoch_loop._num_ready_batches_reached()``.

    The loop's own test (ready batches equal ``num_training_batches``, or the data fetcher saw the last batch, for
    iterables of unknown length). No public property says it before ``on_train_epoch_end``.
    """
    return trainer.fit_loop.epoch_loop._num_ready_batches_reached()


def ddp_start_method(strategy: DDPStrategy) -> str:
    """``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``: the private ``DDPStrategy._start_method``.

    Set from the ``start_method`` argument; the strategy exposes no public getter. ``"popen"`` for strategies
    without it.
    """
    return getattr(strategy, "_start_method", "popen")


def set_root_device(strategy: SingleDeviceStrategy, device: torch.device) -> None:
    """Move a single-device strategy to ``device``: writes the private ``SingleDeviceStrategy._root_device``.

    ``root_device`` is a read-only property over it. The accelerator connector hands a strategy without devices
    the devices it resolved through the ``parallel_devices`` setter; the gradkit single-device strategy takes its
    device from there, which ``SingleDeviceStrategy`` does not.
    """
    strategy._root_device = device


# -- strategy names ----------------------------------------------------------------------------------------------------
# name: (class in `lightning_gradkit.strategy`, description, init params).
_STRATEGY_NAMES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gradkit": ("GradKitSingleDeviceStrategy", "Single device with gradkit step control", {}),
    "gradkit_ddp": ("GradKitDDPStrategy", "DDP with gradkit step control", {"start_method": "popen"}),
    "gradkit_ddp_spawn": ("GradKitDDPStrategy", "DDP (spawn) with gradkit step control", {"start_method": "spawn"}),
    "gradkit_fsdp": ("GradKitFSDPStrategy", "FSDP with gradkit step control", {}),
    "gradkit_model_parallel": ("GradKitModelParallelStrategy", "ModelParallel with gradkit step control", {}),
}

_REGISTRY_MODULE = "lightning.pytorch.strategies"


def _strategy_factory(class_name: str) -> Callable[..., Strategy]:
    """What the registry calls for a name: imports ``lightning_gradkit.strategy`` then, and builds the strategy."""

    def build(**init_params: Any) -> Strategy:
        from lightning_gradkit import strategy

        return getattr(strategy, class_name)(**init_params)

    return build


def register_strategy_names(strategies: ModuleType | None = None) -> None:
    """Register the gradkit strategy names in Lightning's ``StrategyRegistry`` (imports Lightning if needed).

    Args:
        strategies: the loaded ``lightning.pytorch.strategies`` module; imported when not given.
    """
    if strategies is None:
        strategies = importlib.import_module(_REGISTRY_MODULE)
    for name, (class_name, description, init_params) in _STRATEGY_NAMES.items():
        strategies.StrategyRegistry.register(
            name, _strategy_factory(class_name), description=description, override=True, **init_params
        )
