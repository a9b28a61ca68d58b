"""The gradient noise scale of :class:`~gradkit.GradNormMonitor`'s ``noise_scale=True``: the critical batch
``B_simple`` from the local and the all-reduced gradient of a DDP step.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", appendix A.1: the squared norm of a gradient
averaged over ``B`` examples has the expectation ``|G|^2 + S / B``, where ``G`` is the true gradient and ``S = tr(Σ)``
the trace of the per-example gradient covariance. Two batch sizes give two equations: under DDP, each rank's own
gradient (``B_small``, its examples of the optimizer step) and the all-reduced one (``B_big = world x B_small``):

    |G|^2 = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    S     = (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)
    B_simple = S / |G|^2

``|G_small|^2`` is the mean over ranks of each rank's squared local norm (each is an unbiased estimate; their mean has
less variance). Both estimates are noisy and the ratio of noisy estimates is biased, so, as the paper does, ``|G|^2``
and ``S`` are smoothed separately (an exponential moving average, :data:`NOISE_SCALE_EMA` per estimate, Adam's bias
correction) and ``B_simple`` is the ratio of the averages.

Where the local gradient is read: DDP all-reduces the gradients in buckets during ``backward``, so after it only the
global gradient exists. On a logging step, and only there, :class:`DDPNoiseProbe` puts a post-accumulate-grad hook on
every parameter for the backward that synchronizes: it runs after the gradient is accumulated into ``.grad`` and
before DDP's own hook copies it into its bucket, so it reads this rank's gradient (the whole optimizer step's under
``no_sync`` accumulation). The hooks are removed after the step. Other steps cost one Python call per forward (the
pre-hook on the DDP module that decides) and no tensor operation. A DDP communication hook would see the buckets
too, but it stays registered for good (DDP cannot remove one), costs a division pass over every bucket on every step
(the C++ reducer folds ``1 / world`` into its copy into the bucket only without a hook) and excludes the user's own
(``fp16_compress_hook``, PowerSGD).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from gradkit._util.torch_compat import loss_scale
from gradkit.step.norms import per_tensor_norms, world_size
from gradkit.step.plan import Decision, StepStats
from gradkit.step.protocol import Door, StepContext, unwrapped

__all__ = [
    "NOISE_SCALE_EMA",
    "DDPNoiseProbe",
    "NoiseScaleEMA",
    "data_parallel_module",
    "noise_estimates",
    "start_probe",
]

#: The factor of the moving averages of ``|G|^2`` and ``S``, per estimate (one per logging step): about the last 10
#: estimates count (``1 / (1 - 0.9)``), 500 optimizer steps at Lightning's default ``log_every_n_steps=50``.
NOISE_SCALE_EMA = 0.9

#: The per-rank sum of squared local norms, summed over ranks in the step's one collective (``reduce_request``).
_LOCAL_KEY = "grad_noise/local_squares"


def noise_estimates(g_small_sq: Tensor, g_big_sq: Tensor, b_small: float, b_big: float) -> tuple[Tensor, Tensor]:
    """The unbiased estimates ``(|G|^2, S)`` of McCandlish et al. (2018), appendix A.1, from the squared gradient
    norms measured on a batch of ``b_small`` and one of ``b_big`` examples.

    Example::

        >>> g2, s = noise_estimates(torch.tensor(3.0), torch.tensor(1.5), 4, 8)  # |G|^2 + S / B with |G|^2 = 0, S = 12
        >>> g2.item(), s.item()
        (0.0, 12.0)
    """
    g2 = (b_big * g_big_sq - b_small * g_small_sq) / (b_big - b_small)
    s = (g_small_sq - g_big_sq) / (1.0 / b_small - 1.0 / b_big)
    return g2, s


class NoiseScaleEMA:
    """The moving averages of ``|G|^2`` and ``S`` on the device (no host sync), with Adam's bias correction; an
    estimate that is not finite (a step whose gradients overflowed) is left out.

    Example::

        >>> ema = NoiseScaleEMA()
        >>> out = ema.update(torch.tensor(2.0), torch.tensor(10.0))
        >>> [round(out[k].item(), 4) for k in ("grad_noise/g2", "grad_noise/s", "grad_noise/b_simple")]
        [2.0, 10.0, 5.0]
    """

    def __init__(self, beta: float = NOISE_SCALE_EMA) -> None:
        self.beta = beta
        self._g2: Tensor | None = None
        self._s: Tensor | None = None
        self._count: Tensor | None = None

    def update(self, g2: Tensor, s: Tensor) -> dict[str, Tensor]:
        """Fold one estimate in; the smoothed ``|G|^2``, ``S`` and their ratio ``B_simple`` (NaN while the smoothed
        ``|G|^2`` is not positive: the noise still hides the gradient)."""
        beta = self.beta
        if self._g2 is None or self._s is None or self._count is None:
            self._g2, self._s, self._count = (torch.zeros((), device=g2.device) for _ in range(3))
        finite = torch.isfinite(g2) & torch.isfinite(s)
        self._g2 = torch.where(finite, beta * self._g2 + (1 - beta) * g2, self._g2)
        self._s = torch.where(finite, beta * self._s + (1 - beta) * s, self._s)
        self._count = self._count + finite
        correction = 1 - beta**self._count  # 0 before the first finite estimate: the averages read NaN
        ratio = torch.where(self._g2 > 0, self._s / self._g2, torch.full_like(self._g2, math.nan))
        return {
            "grad_noise/g2": self._g2 / correction,
            "grad_noise/s": self._s / correction,
            "grad_noise/b_simple": ratio,
        }


class DDPNoiseProbe:
    """Each rank's local gradient norms on a logging step, read before DDP's all-reduce, and the step's estimates.

    Args:
        ddp: the DDP module the loop calls.
        logs_now: whether the current optimizer step logs (asked at the forward of a synchronizing backward).
    """

    def __init__(self, ddp: DistributedDataParallel, logs_now: Callable[[], bool]) -> None:
        self.ddp = ddp
        self._logs_now = logs_now
        self._forward_hook = ddp.register_forward_pre_hook(self._arm)
        self._param_hooks: list[RemovableHandle] = []
        self._local: dict[int, Tensor] = {}  # id(parameter) -> this rank's local 2-norm (a 1-element fp32 vector)
        self._syncs = 0  # synchronizing forwards armed in this optimizer step
        self._global_sq: Tensor | None = None
        self._examples: tuple[int, int] = (-1, 0)  # (optimizer step, examples counted in it)
        self.ema = NoiseScaleEMA()
        self.unsynced_warned = False

    # -- the logging step's backward ------------------------------------------------------------------------------
    def _arm(self, module: nn.Module, args: Any) -> None:
        """A forward of the DDP module: hook the parameters when its backward synchronizes on a logging step."""
        if not (torch.is_grad_enabled() and self.ddp.require_backward_grad_sync) or not self._logs_now():
            return  # a `no_sync` micro-batch, an evaluation, a step that does not log: nothing, not even a tensor op
        self._syncs += 1
        if not self._param_hooks:
            params = [p for p in self.ddp.module.parameters() if p.requires_grad]
            self._param_hooks = [p.register_post_accumulate_grad_hook(self._note_local) for p in params]

    def _note_local(self, param: Tensor) -> None:
        # After `.grad` holds this backward's (and the `no_sync` micro-batches') local sum, before DDP's own hook
        # copies it into its bucket for the all-reduce. Overwritten if autograd accumulates twice (the sum is kept).
        if param.grad is not None:
            self._local[id(param)] = per_tensor_norms([param.grad.detach()], 2.0)

    def count(self, examples: int, step: int) -> None:
        """Add a micro-batch's examples to optimizer step ``step``'s count (the Trainer's batch-size inference)."""
        counted = self._examples[1] if self._examples[0] == step else 0
        self._examples = (step, counted + examples)

    def counted(self, step: int) -> int:
        return self._examples[1] if self._examples[0] == step else 0

    # -- the step's pipeline ----------------------------------------------------------------------------------------
    def reduce_request(self, ctx: StepContext) -> dict[str, Tensor]:
        """This rank's sum of squared local norms, to be summed over ranks in the step's one collective; keeps the
        squared norm of the all-reduced gradients of the same parameters (the optimizer's, read before the write)."""
        if not self._local:
            return {}
        params = [p for opt in ctx.optimizers for g in unwrapped(opt).param_groups for p in g["params"]]
        params = [p for p in params if id(p) in self._local and p.grad is not None]
        if not params:
            return {}
        local = torch.cat([self._local[id(p)] for p in params])
        self._global_sq = per_tensor_norms([p.grad.detach() for p in params], 2.0).square().sum()
        return {_LOCAL_KEY: local.square().sum()}

    def take(self, stats: StepStats, decision: Decision, door: Door, batch: int, logging: bool) -> dict[str, Tensor]:
        """The step's values on a logging step (none on others), then forget the step.

        ``batch``: this rank's examples in the step (``B_small``). The values are those of the gradients the optimizer
        receives, as ``grad_norm/total`` is: the AMP scale removed, the pipeline's accumulation scale applied.
        """
        armed, syncs, global_sq = bool(self._local), self._syncs, self._global_sq
        self.reset()
        if not (logging and armed) or global_sq is None or _LOCAL_KEY not in stats.reduced or batch <= 0:
            return {}
        if syncs > 1:
            if not self.unsynced_warned:
                self.unsynced_warned = True
                door.warn(
                    f"GradNormMonitor(noise_scale=True): DDP all-reduced the gradients {syncs} times in optimizer "
                    f"step {door.global_step}, so no rank's own gradient of the step was left to read: no noise "
                    "scale is logged. Accumulate the micro-batches but the last under `ddp_model.no_sync()` (the "
                    "Trainer does), which also saves the all-reduces."
                )
            return {}
        world = world_size()
        g_small_sq = stats.reduced[_LOCAL_KEY].to(global_sq.device) / world  # the mean over ranks
        backward_scale = loss_scale(door.loss_scale_source())  # the AMP scale every gradient carried in `backward`
        if backward_scale is not None:
            g_small_sq = g_small_sq / backward_scale.to(g_small_sq.device).square()
        if stats.loss_scale is not None:  # the all-reduced gradients were still scaled at the measure
            global_sq = global_sq / stats.loss_scale.to(global_sq.device).square()
        if decision.scale is not None:
            factor = decision.scale.to(global_sq.device).square()
            g_small_sq, global_sq = g_small_sq * factor, global_sq * factor
        b_big = float(world * batch)
        g2, s = noise_estimates(g_small_sq, global_sq, float(batch), b_big)
        out = {"grad_noise/g_small_sq": g_small_sq, "grad_noise/g_big_sq": global_sq}
        out.update(self.ema.update(g2, s))
        out["grad_noise/batch_size"] = torch.tensor(b_big)
        return out

    def reset(self) -> None:
        """Forget the step: remove the parameter hooks (the next logging step puts them back)."""
        for handle in self._param_hooks:
            handle.remove()
        self._param_hooks = []
        self._local.clear()
        self._syncs = 0
        self._global_sq = None

    def close(self) -> None:
        self.reset()
        self._forward_hook.remove()


def data_parallel_module(module: object) -> DistributedDataParallel | None:
    """The ``DistributedDataParallel`` module the loop calls, inside Fabric's wrapper or a ``torch.compile`` one."""
    for _ in range(4):
        if isinstance(module, DistributedDataParallel):
            return module
        module = getattr(module, "_forward_module", None) or getattr(module, "_orig_mod", None)
    return None


def _sharded(model: nn.Module, door: Door) -> bool:
    """Whether the gradients are sharded by FSDP (FSDP1's flat shards, FSDP2's ``fully_shard``, DTensors)."""
    if door.flat_sharded():
        return True
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kinds = tuple(t for t in (getattr(fsdp, "FSDPModule", None), getattr(fsdp, "FullyShardedDataParallel", None)) if t)
    if kinds and any(isinstance(m, kinds) for m in model.modules()):
        return True
    return any(hasattr(p, "_local_tensor") for p in model.parameters())


def start_probe(
    door: Door, model: nn.Module, logs_now: Callable[[], bool], warn: Callable[[str], None]
) -> DDPNoiseProbe | None:
    """The probe of a run that can measure the noise scale, else ``None`` with ``warn`` called with the reason.

    Raises:
        ValueError: the gradients are sharded (FSDP, FSDP2): they are reduce-scattered inside ``backward``.
    """
    if _sharded(model, door):
        raise ValueError(
            "GradNormMonitor(noise_scale=True) reads each rank's local gradient before DDP's all-reduce, and this "
            "model's gradients are sharded (FSDP or FSDP2's `fully_shard`): they are reduce-scattered inside "
            "`backward`, shard by shard, where gradkit does not read them yet (FSDP2's `set_custom_reduce_scatter` "
            "would see the local gradient; not implemented). Train under DDP for the noise scale, or leave "
            "`noise_scale=False`."
        )
    world = world_size()
    ddp = data_parallel_module(getattr(door, "wrapped_model", None))  # `Door.wrapped_model`: see the doors
    if world == 1:
        reason = "this run has one process"
    elif ddp is None:
        reason = (
            f"this run has {world} processes and no `DistributedDataParallel` module (give the loop door the "
            "DDP-wrapped model, `GradKit(ddp_model, ...)`; the Hugging Face door does not expose it)"
        )
    elif ddp.process_group.size() != world:
        reason = f"DDP reduces over {ddp.process_group.size()} of the {world} processes (a sub-group)"
    elif len(door.optimizers) != 1:
        reason = f"the loop has {len(door.optimizers)} optimizers (one is supported)"
    else:
        return DDPNoiseProbe(ddp, logs_now)
    warn(
        f"GradNormMonitor(noise_scale=True): no gradient noise scale in this run: {reason}. It needs the local "
        "gradient of each of several data-parallel ranks beside the all-reduced one (DDP, one optimizer); nothing "
        "is logged under `grad_noise/`."
    )
    return None
