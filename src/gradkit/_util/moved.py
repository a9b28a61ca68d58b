"""The module paths of gradkit before it was arranged by role (``gradkit.clipping`` is ``gradkit.policies.clipping``
now): each old path still imports, for one release, and says where its names went."""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from collections.abc import Mapping

#: Old module -> new module, both under ``gradkit.`` (0.x; the old paths go in the release after the next).
MOVED: dict[str, str] = {
    "agc": "policies.agc",
    "clipping": "policies.clipping",
    "history_clipping": "policies.history_clipping",
    "guards": "policies.guards",
    "guard_reporting": "policies.guard_reporting",
    "spike_guard": "policies.spike_guard",
    "rollback": "policies.rollback",
    "escalation": "policies.escalation",
    "steps_to_skip": "policies.steps_to_skip",
    "monitor": "policies.monitor",
    "update_ratio": "policies.update_ratio",
    "early_warning": "policies.early_warning",
    "warning_rules": "policies.warning_rules",
    "signals": "policies.signals",
    "signal_math": "policies.signal_math",
    "qk_clip": "policies.qk_clip",
    "attention_heads": "policies.attention_heads",
    "culprit": "policies.culprit",
    "forensics": "policies.forensics",
    "pipeline": "step.pipeline",
    "protocol": "step.protocol",
    "accounting": "step.accounting",
    "gate": "step.gate",
    "norms": "step.norms",
    "params": "step.params",
    "write": "step.write",
    "accumulate": "step.accumulate",
    "host_lag": "step.host_lag",
    "snapshot": "step.snapshot",
    "replay": "step.replay",
    "replicas": "step.replicas",
    "selection": "step.selection",
    "running": "step.running",
    "watch": "step.watch",
    "loop": "doors.loop",
    "loop_setup": "doors.loop_setup",
    "huggingface": "doors.huggingface",
    "report_data": "report.data",
    "report_layout": "report.layout",
    "report_loggers": "report.loggers",
    "report_signals": "report.signal_panels",
    "events": "report.events",
    # Not a flat-layout path: the pipeline's record of a step had a module of its own earlier in this release.
    "step.record": "step.pipeline",
}


class MovedModule(types.ModuleType):
    """An old module path: a name read from it comes from the new module, with a ``DeprecationWarning`` at the
    reading line (``from gradkit.loop import GradKit`` warns there and works). The new module is imported at the
    first read only, so an old path costs nothing until used (``gradkit.huggingface`` needs ``transformers``)."""

    def __init__(self, old: str, new: str) -> None:
        super().__init__(old, f"Moved to :mod:`{new}`.")
        self._new = new

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):  # the import system's own probes (__path__, __file__, ...): not a user's read
            raise AttributeError(name)
        warnings.warn(
            f"`{self.__name__}` moved to `{self._new}`: import `{name}` from `{self._new}`, or from `gradkit` "
            f"where it is public. `{self.__name__}` goes in the release after the next.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(self._new), name)

    def __dir__(self) -> list[str]:
        return dir(importlib.import_module(self._new))


def register(package: str, moved: Mapping[str, str] = MOVED) -> None:
    """Put each old path in ``sys.modules`` (no import hook: the import system finds them there)."""
    for old, new in moved.items():
        sys.modules.setdefault(f"{package}.{old}", MovedModule(f"{package}.{old}", f"{package}.{new}"))


def step_plan_moved(package: str) -> type:
    """The deprecated ``StepPlan`` of ``package`` (``gradkit``, ``lightning_gradkit``), for one release: the
    pipeline's record of a step, with a ``DeprecationWarning`` at the reading line that says what a policy reads and
    writes now."""
    from gradkit.step.pipeline import StepRecord  # at the first read only: this module loads before the step modules

    warnings.warn(
        f"`{package}.StepPlan` was split: a policy's `decide(self, stats, decision, ctx)` reads the step's "
        "measurements in a read-only `StepStats` and writes through a `Decision`, and `observe(self, stats, outcome, "
        f"ctx)` reads a `StepOutcome`. Import `StepStats`, `Decision` or `StepOutcome` from `{package}`; `StepPlan` "
        "goes in the release after the next.",
        DeprecationWarning,
        stacklevel=3,
    )
    return StepRecord
