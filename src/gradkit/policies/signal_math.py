r"""The arithmetic of the early-warning signals (:mod:`gradkit.policies.signals`), as pure functions of tensors and
floats.

- :func:`sdpa_logit_max`: the largest attention logit of a ``F.scaled_dot_product_attention`` call, on a sample of
  its query positions (the call never materializes its logits);
- :func:`adam_ratio_sums`: per parameter, the sums behind ``mean(g^2) / mean(v_hat)`` and the fraction of
  coordinates with ``g^2 > theta * v_hat`` (SPAM, Huang et al. 2025), from Adam's own state;
- :class:`SpikeScore`: OLMo 2's SpikeScore, on the host.

Pure PyTorch; no Lightning here.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from gradkit.step.norms import host_to_device, local_tensor

__all__ = ["MIN_MOMENT_STEPS", "SpikeScore", "adam_ratio_sums", "sampled_positions", "sdpa_logit_max"]

#: Optimizer steps a parameter's second moment must average before its ``g^2 / v`` signals are measured.
MIN_MOMENT_STEPS = 10

# Parameters per chunk of the g^2/v pass: bounds its temporaries (two gradient-sized copies of a chunk).
_CHUNK_ELEMENTS = 1 << 25


def sampled_positions(length: int, count: int) -> list[int]:
    """``count`` positions of ``range(length)`` evenly spaced, the first and the last included (all when fewer).

    Example::

        >>> sampled_positions(10, 4), sampled_positions(3, 8)
        ([0, 3, 6, 9], [0, 1, 2])
    """
    if count >= length:
        return list(range(length))
    if count == 1:
        return [length - 1]  # the last query sees every key of a causal attention
    return sorted({round(i * (length - 1) / (count - 1)) for i in range(count)})


def sdpa_logit_max(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    queries: int = 64,
) -> tuple[Tensor, str]:
    """The largest attention logit of a ``F.scaled_dot_product_attention`` call, on a sample, and what was sampled.

    The logits ``q.k * scale`` (``scale`` defaults to ``1 / sqrt(E)``, as in ``scaled_dot_product_attention``) of the
    first batch element, every head (key heads repeated for grouped-query attention), and ``queries`` query positions
    (:func:`sampled_positions`) against every key, in fp32. Positions the call masks out (``is_causal``: keys after
    the query; a boolean ``attn_mask``: ``False``) do not count; a float ``attn_mask`` is added, as the call adds it.

    Returns:
        ``(max_logit, description)``: a device scalar (``-inf`` if every sampled logit is masked) and a sentence.

    Example::

        >>> q = k = torch.ones(1, 2, 4, 8)
        >>> value, what = sdpa_logit_max(q, k, is_causal=True, queries=2)
        >>> round(float(value), 4), what
        (2.8284, 'batch element 0 of 1, 2 heads, 2 of 4 query positions, all 4 keys')
    """
    q, k = query.detach(), key.detach()
    if q.ndim == 2:  # (L, E): one head
        q, k = q.unsqueeze(0), k.unsqueeze(0)
    first = (0,) * (q.ndim - 3)
    q0, k0 = q[first], k[first]
    heads, length, dim = q0.shape
    keys = k0.shape[-2]
    if k0.shape[0] != heads and (enable_gqa or heads % k0.shape[0] == 0):
        k0 = k0.repeat_interleave(heads // k0.shape[0], dim=0)
    positions = sampled_positions(length, queries)
    rows = host_to_device(positions, torch.long, q.device)
    factor = scale if scale is not None else 1.0 / math.sqrt(dim)
    logits = (q0[:, rows].float() @ k0.float().transpose(-1, -2)) * factor
    if is_causal:  # `scaled_dot_product_attention`'s causal mask: key j attends to query i when j <= i
        later = torch.arange(keys, device=q.device)[None, :] > rows[:, None]
        logits = logits.masked_fill(later, -math.inf)
    if attn_mask is not None:
        mask = torch.broadcast_to(attn_mask.detach(), (*q.shape[:-1], keys))[first][:, rows]
        logits = logits.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else logits + mask.float()
    batch = math.prod(query.shape[:-3]) if query.ndim > 3 else 1
    what = f"batch element 0 of {batch}, {heads} heads, {len(positions)} of {length} query positions, all {keys} keys"
    return logits.amax(), what


def adam_ratio_sums(
    grads: list[Tensor], optimizer: Optimizer, params: list[Tensor], factor: Tensor | None, theta: float
) -> Tensor | None:
    r"""Per parameter: ``[sum g^2, sum v_hat, count(g^2 > theta * v_hat), count(v_hat > 0)]`` from Adam's state,
    ``[4, P]``, over the coordinates whose ``v_hat`` is not 0.

    ``v_hat = exp_avg_sq / (1 - beta2 ** step)`` is the bias-corrected second moment before the optimizer's step;
    ``g = grad * factor``. Left out, as not yet a baseline to measure a gradient against: a parameter whose
    second moment averages fewer than :data:`MIN_MOMENT_STEPS` steps (after one step ``g^2 / v_hat`` is the ratio
    of two gradient samples, Cauchy-like: 1% of the coordinates of any Gaussian gradient exceed 5000), counting zero
    everywhere, and a coordinate whose ``v`` is still 0 (an embedding row no batch has used: its first gradient is
    not a spike). ``None`` when no parameter has a second moment (not an Adam-family optimizer). Reads the state's
    step counts on the host (a CPU tensor for a plain Adam; a device one, read once, for a fused or capturable one).
    """
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    found: list[tuple[int, Tensor, Tensor, float, Any]] = []
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        state = optimizer.state.get(p, {})
        v = state.get("exp_avg_sq")
        group = groups.get(id(p), {})
        if v is not None and "betas" in group and not g.is_sparse:
            found.append((i, g, local_tensor(v), float(group["betas"][1]), state.get("step", 0.0)))
    # The step counts in one read (tensors, on the host for a plain Adam, on the device for a fused one).
    counts = [s for *_, s in found]
    tensors = [c for c in counts if isinstance(c, Tensor)]
    if tensors:
        same = len({t.device for t in tensors}) == 1
        read = iter(torch.stack([t.reshape(()).float() for t in tensors]).tolist() if same else map(float, tensors))
        counts = [next(read) if isinstance(c, Tensor) else float(c) for c in counts]
    kept = [(f, n) for f, n in zip(found, counts, strict=True) if n >= MIN_MOMENT_STEPS]
    rows = [i for (i, *_), _ in kept]
    gs = [g for (_, g, *_), _ in kept]
    vs = [v for (_, _, v, *_), _ in kept]
    corrections = [1.0 - beta2**n for (*_, beta2, _), n in kept]
    if not rows:
        return None
    device = gs[0].device
    out = torch.zeros(4, len(params), dtype=torch.float32, device=device)
    start = 0
    while start < len(rows):
        stop, size = start, 0
        while stop < len(rows) and (stop == start or size + gs[stop].numel() <= _CHUNK_ELEMENTS):
            size += gs[stop].numel()
            stop += 1
        g, v = gs[start:stop], vs[start:stop]
        present = torch._foreach_sign(v)  # 1 where v > 0 (v >= 0): the coordinates measured
        squares = torch._foreach_mul(g, g)
        torch._foreach_mul_(squares, present)
        if factor is not None:
            torch._foreach_mul_(squares, (factor * factor).to(device))
        # v_hat = v / c: sum v_hat and the count of g^2 - theta * v_hat > 0 (the sign of its positive part, summed).
        inverse = [1.0 / c for c in corrections[start:stop]]
        v_hat = torch._foreach_mul(v, inverse)
        sums = torch.stack(
            [torch.stack(torch._foreach_norm(squares, 1)), torch.stack(torch._foreach_norm(v_hat, 1))]
        ).float()
        torch._foreach_mul_(v_hat, theta)
        torch._foreach_sub_(squares, v_hat)
        torch._foreach_clamp_min_(squares, 0.0)
        torch._foreach_sign_(squares)
        count = torch.stack(torch._foreach_norm(squares, 1)).float()
        numel = torch.stack(torch._foreach_norm(present, 1)).float()
        cols = host_to_device(rows[start:stop], torch.long, device)
        out[:, cols] = torch.cat([sums, count[None], numel[None]])
        start = stop
    return out


class SpikeScore:
    """OLMo 2's SpikeScore (OLMo-core's ``StabilityMonitorCallback``), on the host: a step spikes when its loss or its
    gradient norm lies above ``mean + threshold_std * sd`` of the previous ``window`` values of that series (once
    ``window`` values are known); the score is the fraction of spiking steps over the last ``rolling_window`` steps,
    and over the run (:attr:`total`). Unlike OLMo-core a non-finite value counts as a spike and stays out of the
    history, and the rolling score is given before ``rolling_window`` steps are seen (over the steps so far).

    Example::

        >>> score = SpikeScore(window=4)
        >>> for loss in [1.0, 1.1, 0.9, 1.0, 1.05, 50.0]:
        ...     score.add(loss, None)
        >>> score.spikes, score.steps, round(score.score, 3)
        (1, 6, 0.167)
    """

    def __init__(self, window: int = 128, rolling_window: int = 10_000, threshold_std: float = 6.0) -> None:
        self.window = window
        self.rolling_window = rolling_window
        self.threshold_std = threshold_std
        self.histories: dict[str, deque[float]] = {"loss": deque(maxlen=window), "grad_norm": deque(maxlen=window)}
        self.recent: deque[bool] = deque(maxlen=rolling_window)
        self.spikes = 0
        self.steps = 0

    def _spike(self, name: str, value: float | None) -> bool:
        if value is None:
            return False
        if not math.isfinite(value):
            return True
        history = self.histories[name]
        spike = False
        if len(history) == self.window:
            mean = sum(history) / len(history)
            std = math.sqrt(sum((x - mean) ** 2 for x in history) / len(history))
            spike = std >= 1e-10 and value > mean + self.threshold_std * std
        history.append(value)
        return spike

    def add(self, loss: float | None, grad_norm: float | None) -> None:
        """One optimizer step's loss and gradient norm (``None``: not watched)."""
        spike = self._spike("loss", loss) | self._spike("grad_norm", grad_norm)
        self.recent.append(spike)
        self.spikes += spike
        self.steps += 1

    @property
    def score(self) -> float:
        return sum(self.recent) / len(self.recent) if self.recent else 0.0

    @property
    def total(self) -> float:
        return self.spikes / self.steps if self.steps else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "histories": {k: list(v) for k, v in self.histories.items()},
            "recent": list(self.recent),
            "spikes": self.spikes,
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, values in state["histories"].items():
            self.histories[name] = deque(values, maxlen=self.window)
        self.recent = deque(state["recent"], maxlen=self.rolling_window)
        self.spikes, self.steps = int(state["spikes"]), int(state["steps"])
