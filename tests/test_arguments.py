"""Bad constructor arguments fail at construction, with a ValueError that names the argument and the value.

Every case here used to slip through or fail late: a bare ``float()``/``int()`` error, an ``OverflowError``, an
``AttributeError``, a failure at step 0, a 4 TB allocation, or silent acceptance.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gradkit._util.arguments import check_float, check_int, check_strings
from gradkit.doors.loop import GradKit
from helpers import MLPModule, loader, make_trainer
from lightning_gradkit import (
    AccumulationGuard,
    ActivationCheckpointing,
    AdaptiveGradClip,
    AutoClip,
    ClipGradNorm,
    ClipGradValue,
    EarlyWarning,
    EscalationLadder,
    GradNormMonitor,
    GraphLeakGuard,
    InferenceModeValidation,
    ManualAccumulator,
    NonFiniteGuard,
    QKClip,
    SpikeGuard,
    StepsToSkip,
    SyncAudit,
    UpdateClip,
    ZClip,
)

BAD = [
    # None or a non-numeric string for a number
    (lambda: ClipGradNorm(None), "max_norm", "None"),  # type: ignore[arg-type]
    (lambda: ClipGradNorm("one"), "max_norm", "'one'"),  # type: ignore[arg-type]
    (lambda: ClipGradNorm(1.0, norm_type=None), "norm_type", "None"),  # type: ignore[arg-type]
    (lambda: GradNormMonitor(norm_type="l2"), "norm_type", "'l2'"),  # type: ignore[arg-type]
    (lambda: ClipGradValue("0.5"), "clip_value", "'0.5'"),  # type: ignore[arg-type]
    (lambda: AdaptiveGradClip(clip_factor=None), "clip_factor", "None"),  # type: ignore[arg-type]
    (lambda: ZClip(alpha="0.9"), "alpha", "'0.9'"),  # type: ignore[arg-type]
    (lambda: SpikeGuard(alpha=None), "alpha", "None"),  # type: ignore[arg-type]
    (lambda: SpikeGuard(z_threshold="6"), "z_threshold", "'6'"),  # type: ignore[arg-type]
    (lambda: AutoClip(percentile=None), "percentile", "None"),  # type: ignore[arg-type]
    # infinities where an integer is needed (used to raise OverflowError)
    (lambda: ZClip(warmup_steps=math.inf), "warmup_steps", "inf"),  # type: ignore[arg-type]
    (lambda: AutoClip(history_size=math.inf), "history_size", "inf"),  # type: ignore[arg-type]
    # a list entry that is not a string (used to raise AttributeError)
    (lambda: AdaptiveGradClip(exclude=[3]), "exclude", "[3]"),  # type: ignore[list-item]
    (lambda: SyncAudit(skip_packages=[3]), "skip_packages", "[3]"),  # type: ignore[list-item]
    (lambda: ActivationCheckpointing(targets=3), "targets", "3"),  # type: ignore[arg-type]
    # accepted, then failed at step 0
    (lambda: GradNormMonitor(depth=1.5), "depth", "1.5"),  # type: ignore[arg-type]
    (lambda: GradNormMonitor(depth="deep"), "depth", "'deep'"),  # type: ignore[arg-type]
    (lambda: AutoClip(history_size=10**12), "history_size", "1000000000000"),
    # accepted and silently wrong
    (lambda: GradNormMonitor(log_every_n_steps=math.nan), "log_every_n_steps", "nan"),  # type: ignore[arg-type]
    (lambda: ManualAccumulator(window=math.nan), "window", "nan"),  # type: ignore[arg-type]
    (lambda: ManualAccumulator(window=2.5), "window", "2.5"),  # type: ignore[arg-type]
    (lambda: ManualAccumulator(window=True), "window", "True"),
    (lambda: NonFiniteGuard(check_loss="no"), "check_loss", "'no'"),  # type: ignore[arg-type]
    (lambda: NonFiniteGuard(forensics="yes"), "forensics", "'yes'"),  # type: ignore[arg-type]
    (lambda: NonFiniteGuard(check_loss=False, check_grads=False), "check_grads=False", "nothing to check"),
    (lambda: AccumulationGuard(zero_early="false"), "zero_early", "'false'"),  # type: ignore[arg-type]
    (lambda: InferenceModeValidation(check_finite=None), "check_finite", "None"),  # type: ignore[arg-type]
    (lambda: GraphLeakGuard(gc_scan="true"), "gc_scan", "'true'"),  # type: ignore[arg-type]
    (lambda: ActivationCheckpointing(["Linear"], offload="no"), "offload", "'no'"),  # type: ignore[arg-type]
    (lambda: SpikeGuard(warmup_steps=True), "warmup_steps", "True"),
    (lambda: ClipGradNorm(True), "max_norm", "True"),  # True is an int to Python, never a norm to a user
    # not a list of ranges (used to raise a bare "'float' object is not iterable", or to pass for 0)
    (lambda: StepsToSkip(steps=math.nan), "steps", "nan"),  # type: ignore[arg-type]
    (lambda: StepsToSkip(steps=-1), "steps", "-1"),  # type: ignore[arg-type]
    (lambda: StepsToSkip(steps=1.5), "steps", "1.5"),  # type: ignore[arg-type]
    (lambda: StepsToSkip(steps=True), "steps", "True"),  # type: ignore[arg-type]
    # not a dict of signals (used to raise AttributeError: 'str' object has no attribute 'items')
    (lambda: EarlyWarning(thresholds="attn_logit_max"), "thresholds", "'attn_logit_max'"),  # type: ignore[arg-type]
    (lambda: QKClip(threshold=None), "threshold", "None"),  # type: ignore[arg-type]
    (lambda: QKClip(threshold=-1.0), "threshold", "-1.0"),
    (lambda: QKClip(attention=3), "attention", "3"),  # type: ignore[arg-type]
    (lambda: EarlyWarning(thresholds=1000.0), "thresholds", "1000.0"),  # type: ignore[arg-type]
    (lambda: EarlyWarning(floors="150"), "floors", "'150'"),  # type: ignore[arg-type]
    (lambda: EarlyWarning(floors=150), "floors", "150"),  # type: ignore[arg-type]
    (lambda: UpdateClip(sigma_factor=0.0), "sigma_factor", "0.0"),
    (lambda: UpdateClip(history_size=1), "history_size", "1"),
    (lambda: UpdateClip(history_size=8, warmup_steps=9), "warmup_steps", "9"),
    (lambda: UpdateClip(warmup_steps=1), "warmup_steps", "1"),
    (lambda: UpdateClip(modules=3), "modules", "3"),  # type: ignore[arg-type]
    (lambda: UpdateClip(modules=[]), "modules", "[]"),
    (lambda: UpdateClip(divide_by_lr="yes"), "divide_by_lr", "'yes'"),  # type: ignore[arg-type]
    (lambda: QKClip(enabled="no"), "enabled", "'no'"),  # type: ignore[arg-type]
    (lambda: EscalationLadder(rungs=["warn", "panic"]), "rungs", "['warn', 'panic']"),  # type: ignore[list-item]
    (lambda: EscalationLadder(climb_findings=0), "climb_findings", "0"),
    (lambda: EscalationLadder(calm_steps=1.5), "calm_steps", "1.5"),  # type: ignore[arg-type]
    (lambda: EscalationLadder(z_loss="1e-4"), "z_loss", "'1e-4'"),  # type: ignore[arg-type]
    (lambda: EscalationLadder(exit_code=0), "exit_code", "0"),
]


@pytest.mark.parametrize(("factory", "argument", "value"), BAD)
def test_bad_argument_raises_value_error_naming_argument_and_value(
    factory: Callable[[], object], argument: str, value: str
) -> None:
    with pytest.raises(ValueError, match=f"`{argument}`") as info:
        factory()
    assert value in str(info.value)


def _door(model: Any = "built", optimizer: Any = "built", **kwargs: Any) -> GradKit:
    """A loop door on a small model and its SGD, with ``model``, ``optimizer`` or ``kwargs`` replaced."""
    built = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(built.parameters(), lr=0.1) if optimizer == "built" else optimizer
    return GradKit(built if model == "built" else model, optimizer, [ClipGradNorm(1.0)], **kwargs)


# The loop door's arguments: each used to be accepted and fail at the first (logging) step, or fail with an error
# that named none of them (`'NoneType' object has no attribute 'parameters'`, `expected str, bytes or os.PathLike`).
BAD_DOOR = [
    (lambda: _door(model=None), TypeError, "model", "None"),
    (lambda: _door(optimizer=None), TypeError, "optimizers", "None"),
    (lambda: _door(log_dir=5), TypeError, "log_dir", "5 (an int)"),
    (lambda: _door(fabric="x"), TypeError, "fabric", "'x' (a str)"),
    (lambda: _door(scaler="fp16"), TypeError, "scaler", "'fp16' (a str)"),
    (lambda: _door(schedulers="cosine"), TypeError, "schedulers", "'cosine' (a str)"),
    (lambda: _door(log="stdout"), TypeError, "log", "'stdout' (a str)"),
    (lambda: _door(max_steps="100"), ValueError, "max_steps", "'100'"),
]


@pytest.mark.parametrize(("factory", "error", "argument", "value"), BAD_DOOR)
def test_a_bad_loop_door_argument_is_refused_at_construction_naming_it_and_the_value(
    factory: Callable[[], object], error: type[Exception], argument: str, value: str
) -> None:
    with pytest.raises(error, match=f"^`{argument}` must be ") as info:
        factory()
    assert f"got {value}" in str(info.value)


def test_an_optimizer_of_another_model_is_refused_by_the_loop_door() -> None:
    # The door would measure and guard gradients the optimizer never applies, and let the others through unguarded.
    other = torch.optim.SGD(nn.Linear(3, 1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"^`optimizers\[0\]` \(SGD, 2 parameter\(s\)\) steps none of the parameters"):
        _door(optimizer=other)


def test_one_string_is_one_pattern_not_a_list_of_letters() -> None:
    assert AdaptiveGradClip(exclude="Linear").exclude == ["Linear"]
    assert AdaptiveGradClip(exclude="re:^head\\.").exclude == ["re:^head\\."]
    assert AdaptiveGradClip().exclude == []


def test_exclude_given_as_one_string_leaves_that_class_unclipped(tmp_path: Path) -> None:
    """`exclude="Linear"` on an all-Linear model leaves every gradient as plain Lightning computes it."""
    torch.manual_seed(0)
    reference = MLPModule()
    model = MLPModule()
    model.load_state_dict(reference.state_dict())
    make_trainer(tmp_path / "a", max_steps=3).fit(reference, loader())
    # A tiny clip factor would clip every unit of a non-excluded parameter.
    callback = AdaptiveGradClip(clip_factor=1e-6, exclude="Linear")
    make_trainer(tmp_path / "b", max_steps=3, callbacks=[callback]).fit(model, loader())
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_valid_values_keep_their_type() -> None:
    assert check_int("n", 3) == 3 and type(check_int("n", 3)) is int
    assert check_float("x", 2) == 2.0 and type(check_float("x", 2)) is float
    assert check_float("p", math.inf, minimum=1.0, allow_inf=True) == math.inf
    assert check_strings("t", ("a", "b")) == ["a", "b"]
    assert ZClip(warmup_steps=10).warmup_steps == 10
    assert AutoClip(history_size=10_000_000).history_size == 10_000_000


def test_two_monitors_fail_at_setup(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[GradNormMonitor(), GradNormMonitor(norm_type=1.0)])
    with pytest.raises(ValueError, match=r"2 GradNormMonitor callbacks.*Keep exactly one"):
        trainer.fit(MLPModule(), loader())
