"""Independent reference implementations of the clipping algorithms, written from the papers, for plain loops.

Each is a callable ``clip(model)`` applied between ``backward`` and ``optimizer.step()``; the stateful ones keep
their history in Python floats (as the papers' reference code does), so they share no code with the package.
"""

from __future__ import annotations

import math
import re
from collections import deque

import numpy as np
import torch
from torch import nn


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def total_norm(model: nn.Module, norm_type: float = 2.0) -> float:
    return torch.nn.utils.get_total_norm(grads(model), norm_type).item()


class NormRef:
    def __init__(self, max_norm: float, norm_type: float = 2.0) -> None:
        self.max_norm, self.norm_type = max_norm, norm_type

    def __call__(self, model: nn.Module) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_norm, self.norm_type)


class ValueRef:
    def __init__(self, clip_value: float) -> None:
        self.clip_value = clip_value

    def __call__(self, model: nn.Module) -> None:
        torch.nn.utils.clip_grad_value_(model.parameters(), self.clip_value)


class AGCRef:
    """timm.utils.agc.adaptive_clip_grad, written out: unit-wise norms, weight norm floored at eps."""

    def __init__(self, clip_factor: float, eps: float = 1e-3, exclude: str | None = None) -> None:
        self.clip_factor, self.eps = clip_factor, eps
        self.exclude = re.compile(exclude) if exclude else None

    @staticmethod
    def unitwise(x: torch.Tensor) -> torch.Tensor:
        if x.ndim <= 1:
            return x.norm(2.0)
        return x.norm(2.0, dim=tuple(range(1, x.ndim)), keepdim=True)

    def __call__(self, model: nn.Module) -> None:
        for name, p in model.named_parameters():
            if p.grad is None or (self.exclude and self.exclude.search(name)):
                continue
            w, g = p.detach(), p.grad.detach()
            max_norm = self.unitwise(w).clamp_(min=self.eps).mul_(self.clip_factor)
            grad_norm = self.unitwise(g)
            clipped = g * (max_norm / grad_norm.clamp(min=1e-6))
            p.grad.detach().copy_(torch.where(grad_norm < max_norm, g, clipped))


class AutoClipRef:
    """Seetharaman et al. 2020: append the norm, clip to np.percentile of the history (bounded here)."""

    def __init__(self, percentile: float, history_size: int) -> None:
        self.percentile = percentile
        self.history: deque[float] = deque(maxlen=history_size)

    def __call__(self, model: nn.Module) -> None:
        norm = total_norm(model)
        if math.isfinite(norm):
            self.history.append(norm)
        torch.nn.utils.clip_grad_norm_(model.parameters(), float(np.percentile(list(self.history), self.percentile)))


class ZClipRef:
    """Kumar et al. 2025 (ZClip), zscore mode with reciprocal clipping, statistics in Python floats."""

    def __init__(self, alpha: float, z_threshold: float, warmup_steps: int, max_norm: float | None = None) -> None:
        self.alpha, self.z, self.warmup, self.max_norm = alpha, z_threshold, warmup_steps, max_norm
        self.buffer: list[float] = []
        self.mean: float | None = None
        self.var = 0.0

    def _scale_to(self, model: nn.Module, norm: float, target: float) -> None:
        if norm > target:
            for g in grads(model):
                g.mul_(target / (norm + 1e-6))

    def __call__(self, model: nn.Module) -> None:
        norm = total_norm(model)
        if not math.isfinite(norm):
            return
        if self.mean is None:
            self.buffer.append(norm)
            if len(self.buffer) == self.warmup:
                self.mean = sum(self.buffer) / len(self.buffer)
                self.var = sum((x - self.mean) ** 2 for x in self.buffer) / len(self.buffer)
            if self.max_norm is not None:
                self._scale_to(model, norm, self.max_norm)
            return
        std = math.sqrt(self.var)
        z = (norm - self.mean) / (std + 1e-6)
        adjusted = self.mean + self.z**2 * std / z if z > self.z else norm
        target = adjusted if self.max_norm is None else min(adjusted, self.max_norm)
        self._scale_to(model, norm, target)
        self.mean = self.alpha * self.mean + (1 - self.alpha) * adjusted
        self.var = self.alpha * self.var + (1 - self.alpha) * (adjusted - self.mean) ** 2
