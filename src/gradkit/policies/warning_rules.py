"""The detector of :class:`~gradkit.EarlyWarning`: a threshold rule and a growth rule over each series
of the early-warning signals (:mod:`gradkit.policies.signals`), on host values that are the same on every rank.

- **threshold**: the value is above the signal's threshold (a level beyond what training recovers from), or not
  finite. It fires at any step, the warm-up included.
- **growth**: outside the warm-up, from the signal's floor on, the value grew at least ``growth`` times over
  ``growth_steps`` optimizer steps (since the last value logged that long ago or longer) *and* by more than the
  series' own history explains: more than the median of its past rises over ``growth_steps`` plus ``sigmas`` robust
  standard deviations of them (``1.4826 * MAD``), once :data:`MIN_HISTORY` rises are known, for a signal with
  ``sigmas`` (:data:`DEFAULT_SIGMAS`: log Z, which wanders in healthy runs; a series of it sets its own bar, one
  whose growth speeds up fires). Without ``sigmas`` the bar is ``growth`` alone.
- **warm-up**: a reading is in the warm-up while the learning rate rose since the previous reading, and over the
  first ``warmup_steps`` optimizer steps. The values of a warm-up are not a history to measure growth on (everything
  moves then, in healthy runs too): the growth rule neither fires nor learns there, and measures a rise only from a
  value read after it.

Growth is measured on a log scale: ``log(value)``, or the value itself for the signals that are logarithms already
(:data:`LOG_SIGNALS`: log Z, whose thresholds and floors are also taken above ``log(n)``, the log Z of a uniform
prediction over the output module's ``n`` outputs). A series that fired fires again only once its value is
``growth`` times the value it fired at: a level that stays high warns once, a level that keeps growing warns again
at every doubling. Pure Python; the state round-trips through :meth:`Detector.state_dict`.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gradkit._util.arguments import check_float, shown

__all__ = [
    "DEFAULT_FLOORS",
    "DEFAULT_SIGMAS",
    "DEFAULT_THRESHOLDS",
    "LOG_SIGNALS",
    "MIN_HISTORY",
    "SIGNALS",
    "Detector",
    "Finding",
    "checked_rules",
]

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

#: The signals that are logarithms already: their growth is their rise, and their rules are above ``log(n)``.
LOG_SIGNALS = frozenset({"logz_mean", "logz_max"})

#: Past rises of a series the growth rule calibrates on before it may fire (with ``sigmas``).
MIN_HISTORY = 10

#: Per signal, the value above which it warns at any step (``None``: no threshold rule). Attention logits of 1500
#: are fifteen times the level at which Kimi K2's QK-Clip acts (100), above what the slowly growing logits of healthy
#: runs reach in their first hundreds of steps (up to about 1000 on the proxies of ``bench_early_warning.py``); a
#: mean log Z 15 nats above a uniform prediction's (healthy GPTs pass 10 for a few steps of their warm-up) puts a
#: factor e^15 on the output's normalizer.
DEFAULT_THRESHOLDS: dict[str, float | None] = {
    "attn_logit_max": 1500.0,
    "logz_mean": 15.0,
    "logz_max": None,
    "adam_g2_v": None,
    "adam_spike_frac": None,
    "update_ratio_spread": None,
    "spike_score": None,
}

#: Per signal, the value from which the growth rule applies (``None``: no growth rule): attention logits from twice
#: the level at which Kimi K2's QK-Clip acts, log Z from 2 nats above a uniform prediction's.
DEFAULT_FLOORS: dict[str, float | None] = {
    "attn_logit_max": 200.0,
    "logz_mean": 2.0,
    "logz_max": None,
    "adam_g2_v": None,
    "adam_spike_frac": None,
    "update_ratio_spread": None,
    "spike_score": None,
}

#: Per signal, how many robust standard deviations above its own past rises a series' rise must be for the growth
#: rule (``None``: the growth factor alone). Attention logits that grow exponentially at a steady pace are the
#: instability itself (Wortsman et al. 2023; a healthy model's slow down), so their bar is the growth factor; log Z
#: wanders by more than a doubling of Z in healthy runs, so its bar is its own history's.
DEFAULT_SIGMAS: dict[str, float | None] = {
    "attn_logit_max": None,
    "logz_mean": 4.0,
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
        sigmas: per signal, how far above its own past rises a series' rise must be, in robust standard deviations
            (``None`` or absent: the growth factor alone).
        warmup_steps: the first optimizer steps that are a warm-up whatever the learning rate does.

    Example::

        >>> detector = Detector({"attn_logit_max": 1000.0}, {"attn_logit_max": 100.0}, 2.0, 20, {}, 0)
        >>> [detector.check("attn_logit_max", "attn", step, v) for step, v in ((0, 60.0), (10, 90.0))]
        [None, None]
        >>> detector.check("attn_logit_max", "attn", 20, 150.0).rule
        'growth'
    """

    def __init__(
        self,
        thresholds: dict[str, float | None],
        floors: dict[str, float | None],
        growth: float,
        growth_steps: int,
        sigmas: dict[str, float | None] | None = None,
        warmup_steps: int = 40,
    ) -> None:
        self.thresholds, self.floors = thresholds, floors
        self.growth, self.growth_steps, self.warmup_steps = growth, growth_steps, warmup_steps
        self.sigmas = sigmas or {}
        self._history: dict[tuple[str, str], deque[tuple[int, float]]] = {}
        self._rises: dict[tuple[str, str], list[float]] = {}
        self._fired: dict[tuple[str, str], float] = {}
        self._lr: float | None = None
        self._warm = False  # set by each reading
        self._warm_step = -1  # the last step read in a warm-up

    def reading(self, step: int, lr: float | None) -> bool:
        """Start the reading of ``step``, at learning rate ``lr`` (the largest of the loop's, ``None``: unknown);
        whether it is in the warm-up."""
        rising = lr is not None and self._lr is not None and lr > self._lr * (1 + 1e-6)
        self._lr = lr if lr is not None else self._lr
        self._warm = rising or step < self.warmup_steps
        if self._warm:
            self._warm_step = step
        return self._warm

    def check(self, signal: str, module: str, step: int, value: float, baseline: float = 0.0) -> Finding | None:
        """Record ``value`` of the series at ``step``; the finding if a rule fires. ``baseline``: what the signal's
        thresholds and floors are taken above (``log(n)`` for log Z)."""
        key = (signal, module)
        level = _level(signal, value)
        history = self._history.setdefault(key, deque())
        # The growth rule compares with the newest value at least `growth_steps` before: older ones are not needed.
        while len(history) > 1 and history[1][0] <= step - self.growth_steps:
            history.popleft()
        reference = history[0] if history and history[0][0] <= step - self.growth_steps else None
        history.append((step, level))
        finding = self._threshold(signal, module, step, value, baseline)
        # A rise is measured from a value read after the warm-up: one that spans its end is still the warm-up's.
        if finding is None and reference is not None and not self._warm and reference[0] > self._warm_step:
            finding = self._growth(key, step, value, level, reference, baseline)
        if finding is None:
            return None
        fired = self._fired.get(key)
        again = fired is None or (
            math.isfinite(fired) and (not math.isfinite(level) or level >= fired + math.log(self.growth))
        )
        if not again:
            return None  # warned already; again once the value has grown by `growth` since
        self._fired[key] = level if math.isfinite(level) else math.inf
        return finding

    def _threshold(self, signal: str, module: str, step: int, value: float, baseline: float) -> Finding | None:
        threshold = self.thresholds.get(signal)
        if not math.isfinite(value) or (threshold is not None and value > baseline + threshold):
            limit = baseline + threshold if threshold is not None else math.inf
            return Finding(signal, module, step, value, "threshold", limit)
        return None

    def _growth(
        self, key: tuple[str, str], step: int, value: float, level: float, reference: tuple[int, float], base: float
    ) -> Finding | None:
        floor = self.floors.get(key[0])
        if floor is None or not math.isfinite(level) or not math.isfinite(reference[1]):
            return None
        rise = level - reference[1]
        rises = self._rises.setdefault(key, [])
        bar = _bar(rises, self.sigmas.get(key[0]))
        rises.append(rise)
        del rises[:-_MAX_RISES]
        if bar is None or value < base + floor or rise < max(math.log(self.growth), bar):
            return None
        earlier = math.exp(reference[1]) if key[0] not in LOG_SIGNALS else reference[1]
        return Finding(key[0], key[1], step, value, "growth", self.growth, earlier, reference[0])

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": [[signal, module, list(map(list, h))] for (signal, module), h in self._history.items()],
            "fired": [[signal, module, value] for (signal, module), value in self._fired.items()],
            "rises": [[signal, module, list(r)] for (signal, module), r in self._rises.items()],
            "lr": self._lr,
            "warm_step": self._warm_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._history = {(s, m): deque((int(t), float(v)) for t, v in h) for s, m, h in state["history"]}
        self._fired = {(s, m): float(v) for s, m, v in state["fired"]}
        # Saved before the calibrated growth rule (no rises, values not on the log scale): it starts calibrating.
        self._rises = {(s, m): [float(x) for x in r] for s, m, r in state.get("rises", [])}
        if "rises" not in state:
            self._history, self._fired = {}, {}
        self._lr = state.get("lr")
        self._warm_step = int(state.get("warm_step", -1))


# The past rises a series keeps (its calibration: the last 1,000 logging steps).
_MAX_RISES = 1000


def _level(signal: str, value: float) -> float:
    """The value on the growth rule's log scale."""
    if signal in LOG_SIGNALS or not math.isfinite(value):
        return value
    return math.log(value) if value > 0 else -math.inf


def _bar(rises: list[float], sigmas: float | None) -> float | None:
    """The rise a series must exceed given its past ``rises`` (``None``: not calibrated yet)."""
    if sigmas is None:
        return -math.inf
    if len(rises) < MIN_HISTORY:
        return None
    median = statistics.median(rises)
    spread = 1.4826 * statistics.median(abs(r - median) for r in rises)
    return median + sigmas * spread
