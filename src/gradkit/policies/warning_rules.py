"""The detector of :class:`~gradkit.EarlyWarning`: a threshold rule and a growth rule over each series
of the early-warning signals (:mod:`gradkit.policies.signals`), on host values that are the same on every rank.

- **threshold**: the value is above the signal's threshold, or not finite;
- **growth**: the value is at least the signal's floor and at least ``growth`` times what it was ``growth_steps``
  optimizer steps before (the last value logged that long ago or longer): a series that grows exponentially, before
  it reaches any threshold.

A series that fired fires again only once its value is ``growth`` times the value it fired at: a level that stays
high (attention logits do not shrink by themselves) warns once, a level that keeps growing warns again at every
doubling. Pure Python; the state round-trips through :meth:`Detector.state_dict`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gradkit._util.arguments import check_float, shown

__all__ = ["DEFAULT_FLOORS", "DEFAULT_THRESHOLDS", "SIGNALS", "Detector", "Finding", "checked_rules"]

#: The signals the detector watches.
SIGNALS = (
    "attn_logit_max",
    "logz_mean",
    "logz_max",
    "adam_g2_v",
    "adam_spike_frac",
    "update_ratio_spread",
    "spike_score",
)

#: Per signal, the value above which it warns (``None``: no threshold rule).
DEFAULT_THRESHOLDS: dict[str, float | None] = {
    "attn_logit_max": 1000.0,
    "logz_mean": None,
    "logz_max": None,
    "adam_g2_v": None,
    "adam_spike_frac": None,
    "update_ratio_spread": None,
    "spike_score": None,
}

#: Per signal, the value from which the growth rule applies (``None``: no growth rule).
DEFAULT_FLOORS: dict[str, float | None] = {
    "attn_logit_max": 150.0,
    "logz_mean": None,
    "logz_max": None,
    "adam_g2_v": None,
    "adam_spike_frac": None,
    "update_ratio_spread": None,
    "spike_score": None,
}


def checked_rules(argument: str, given: dict[str, float | None] | None, defaults: dict[str, float | None]) -> dict:
    """``defaults`` updated with ``given`` (a signal mapped to a number, or ``None`` to turn its rule off).

    Raises:
        ValueError: naming ``argument``, for ``given`` that is not a dict (a string, a number), a signal that is not
            one of :data:`SIGNALS` or a value that is neither ``None`` nor a finite number.

    Example::

        >>> checked_rules("thresholds", {"spike_score": 0.05}, DEFAULT_THRESHOLDS)["spike_score"]
        0.05
    """
    if given is not None and not isinstance(given, Mapping):
        raise ValueError(
            f"`{argument}` must be a dict of signal names to numbers (None turns a rule off), got {shown(given)}. "
            f"E.g. `{argument}={{'attn_logit_max': {defaults['attn_logit_max']}}}`; the signals are {list(SIGNALS)}."
        )
    rules = dict(defaults)
    for signal, value in (given or {}).items():
        if signal not in SIGNALS:
            raise ValueError(
                f"`{argument}` names the signal {signal!r}, which is not one of {list(SIGNALS)}. Use those names, "
                "e.g. `{'attn_logit_max': 1000.0}`, and `None` to turn a rule off."
            )
        rules[signal] = None if value is None else check_float(f"{argument}[{signal!r}]", value)
    return rules


@dataclass
class Finding:
    """A series that fired.

    Attributes:
        signal: the signal (one of :data:`SIGNALS`).
        module: the module the value belongs to (empty for a signal with one value per step).
        step: the optimizer step.
        value: its value.
        rule: ``"threshold"`` or ``"growth"``.
        limit: the threshold, or the growth factor.
        reference: the growth rule's earlier value, else ``None``.
        reference_step: the step of that value.
    """

    signal: str
    module: str
    step: int
    value: float
    rule: str
    limit: float
    reference: float | None = None
    reference_step: int | None = None

    def values(self) -> dict[str, Any]:
        """The event's ``values``."""
        out: dict[str, Any] = {"signal": self.signal, "module": self.module, "value": self.value, "rule": self.rule}
        out["threshold" if self.rule == "threshold" else "growth"] = self.limit
        if self.reference is not None:
            out.update(reference=self.reference, reference_step=self.reference_step)
        return out


class Detector:
    """The two rules over every ``(signal, module)`` series (see the module docstring).

    Args:
        thresholds: per signal, the threshold rule's level (``None``: off).
        floors: per signal, the growth rule's floor (``None``: off).
        growth: the growth factor (> 1).
        growth_steps: the optimizer steps the growth is measured over (>= 1).

    Example::

        >>> detector = Detector({"attn_logit_max": 1000.0}, {"attn_logit_max": 100.0}, 2.0, 20)
        >>> [detector.check("attn_logit_max", "attn", step, v) for step, v in ((0, 60.0), (10, 90.0))]
        [None, None]
        >>> detector.check("attn_logit_max", "attn", 20, 150.0).rule
        'growth'
    """

    def __init__(
        self, thresholds: dict[str, float | None], floors: dict[str, float | None], growth: float, growth_steps: int
    ) -> None:
        self.thresholds, self.floors = thresholds, floors
        self.growth, self.growth_steps = growth, growth_steps
        self._history: dict[tuple[str, str], deque[tuple[int, float]]] = {}
        self._fired: dict[tuple[str, str], float] = {}

    def check(self, signal: str, module: str, step: int, value: float) -> Finding | None:
        """Record ``value`` of the series at ``step``; the finding if a rule fires."""
        key = (signal, module)
        history = self._history.setdefault(key, deque())
        # The growth rule compares with the newest value at least `growth_steps` before: older ones are not needed.
        while len(history) > 1 and history[1][0] <= step - self.growth_steps:
            history.popleft()
        reference = history[0] if history and history[0][0] <= step - self.growth_steps else None
        history.append((step, value))
        finding = self._rule(signal, module, step, value, reference)
        if finding is None:
            return None
        fired = self._fired.get(key)
        again = fired is None or value >= self.growth * fired or (math.isfinite(fired) and not math.isfinite(value))
        if not again:
            return None  # warned already; again once the value has grown by `growth` since
        self._fired[key] = value if math.isfinite(value) else math.inf
        return finding

    def _rule(
        self, signal: str, module: str, step: int, value: float, reference: tuple[int, float] | None
    ) -> Finding | None:
        threshold = self.thresholds.get(signal)
        if threshold is not None and (not math.isfinite(value) or value > threshold):
            return Finding(signal, module, step, value, "threshold", threshold)
        floor = self.floors.get(signal)
        if floor is None or reference is None or not (value >= floor and reference[1] > 0):
            return None
        if value >= self.growth * reference[1]:
            return Finding(signal, module, step, value, "growth", self.growth, reference[1], reference[0])
        return None

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": [[signal, module, list(map(list, h))] for (signal, module), h in self._history.items()],
            "fired": [[signal, module, value] for (signal, module), value in self._fired.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._history = {(s, m): deque((int(t), float(v)) for t, v in h) for s, m, h in state["history"]}
        self._fired = {(s, m): float(v) for s, m, v in state["fired"]}
