"""NonFiniteGuard's finite flag is ``torch.isfinite`` over the gradients and the loss, whatever the norms do.

A finite gradient whose fp32 sum of squares passes 3.4e38 (one element of 3e19 in fp32, 1e20 in bf16) makes every
2-norm inf, as ``torch.nn.utils.get_total_norm``'s; a float64 loss of -1.4e39 is finite though its fp32 cast is not.
Neither is non-finite: the first is a ``"norm_overflow"`` event (the step skipped, as documented), the second is
nothing at all. References: ``torch.isfinite`` computed by hand over the same tensors, ``get_total_norm`` for the
overflow, plain PyTorch loops and the state before the step for what the optimizer did.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gradkit.doors.loop import GradKit
from gradkit.policies.guards import NonFiniteGuard as LoopNonFiniteGuard
from gradkit.step.norms import checked_norms, per_tensor_norms
from helpers import MLPModule, column, loader, make_trainer, read_metrics
from lightning_gradkit import NonFiniteGuard
from lightning_gradkit.trainer_door import TrainerPipeline
from test_guards import Fault, FaultModule, events, state_equal

NAN, INF = float("nan"), float("inf")


def _isfinite(*tensors: Tensor) -> bool:
    """The reference: ``torch.isfinite`` over every element, by hand."""
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def test_the_reference_tells_a_huge_finite_value_from_an_infinite_one() -> None:
    assert _isfinite(
        torch.tensor([3e19]), torch.tensor([1e20], dtype=torch.bfloat16), torch.tensor(-1.4e39, dtype=torch.float64)
    )
    assert not _isfinite(torch.tensor([1.0, INF])) and not _isfinite(torch.tensor([NAN]))
    assert torch.nn.utils.get_total_norm([torch.tensor([3e19, 1.0])]).item() == INF  # torch's norm overflows too


def _bits(tensors: list[Tensor]) -> list[Tensor]:
    return [t.detach().clone().reshape(-1).view(torch.uint8) for t in tensors]


@pytest.mark.parametrize("p", [2.0, 1.0, math.inf])
def test_checked_norms_mark_exactly_the_lists_with_a_nonfinite_element(p: float) -> None:
    """Every dtype the gradients come in, each with a finite value past its square's range and then with a NaN or an
    infinity; one ``expand`` view (overlapping memory, checked without writing). The norms are bitwise
    ``per_tensor_norms``' and the tensors are left bitwise as they were."""
    huge = {torch.float32: 3e19, torch.bfloat16: 1e20, torch.float16: 6e4, torch.float64: 1e200}
    for dtype, value in huge.items():
        for bad in (None, INF, -INF, NAN):
            tensors = [torch.randn(5, 3).to(dtype), torch.zeros(0, dtype=dtype), torch.randn(7).to(dtype)]
            tensors[0][1, 2] = value
            tensors.append(torch.randn(4, 1).to(dtype).expand(4, 3))
            if bad is not None:
                tensors[2][3] = bad
            before = _bits(tensors)
            norms, found = checked_norms(tensors, p)
            assert found.item() == (0.0 if _isfinite(*tensors) else 1.0), (dtype, bad, p)
            torch.testing.assert_close(norms, per_tensor_norms(tensors, p), rtol=0, atol=0, equal_nan=True)
            assert all(torch.equal(a, b) for a, b in zip(before, _bits(tensors), strict=True))


# -- behind the loop door -----------------------------------------------------------------------------------------
VALUES = [
    (torch.float32, 3e19),
    (torch.bfloat16, 1e20),
    (torch.float32, INF),
    (torch.float32, -INF),
    (torch.float32, NAN),
    (torch.bfloat16, INF),
]


@pytest.mark.parametrize(("dtype", "value"), VALUES, ids=[f"{d}-{v}".replace("torch.", "") for d, v in VALUES])
@pytest.mark.parametrize("action", ["skip", "warn"])
def test_loop_door_flag_is_isfinite_and_an_overflowing_norm_is_named_apart(
    tmp_path: Path, dtype: torch.dtype, value: float, action: str
) -> None:
    """One gradient element set by a tensor hook. The flag equals ``torch.isfinite`` over gradients and loss; a
    finite step whose norm overflows (as ``get_total_norm``'s does) is a ``"norm_overflow"`` event naming the
    parameter, a non-finite one stays ``"nonfinite_grads"``; with ``"skip"`` both leave the parameters bitwise as
    they were (``"warn"`` reports at the next logging step, from the lazy ledger)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kit = GradKit(model, opt, LoopNonFiniteGuard(action), log_dir=tmp_path, log_every_n_steps=1)
    model[2].weight.register_hook(
        lambda g: g.index_put((torch.tensor(1), torch.tensor(2)), torch.tensor(value, dtype=dtype))
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = model(torch.ones(5, 4, dtype=dtype)).square().mean()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    reference = _isfinite(loss, *grads)
    kit.note_loss(loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        applied = kit.step(opt)
        kit.finish()
    record = kit.pipeline.last_records[id(opt)]
    assert bool(record.stats.primary.finite) == reference
    assert math.isinf(torch.nn.utils.get_total_norm([g.float() for g in grads]).item()) or math.isnan(value)
    (event,) = events(tmp_path)
    if reference:
        assert event["what"] == "norm_overflow" and event["culprit"] == "2.weight"
        assert any("gradient norm overflow at step 0" in str(w.message) for w in caught)
    else:
        assert event["what"] == "nonfinite_grads" and event["culprit"] == "2.weight"
    if action == "skip":
        assert applied is False and kit.skipped_steps == 1
        assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
        assert event["values"].get("overflow_param_grads", ["2.weight"]) == ["2.weight"]


def test_loop_door_a_finite_float64_loss_of_minus_1_4e39_is_not_flagged() -> None:
    """Its fp32 cast is -inf; the guard checks it in its own dtype. Reference: the same SGD step in plain PyTorch."""

    def run(guarded: bool) -> tuple[nn.Module, bool | None]:
        torch.manual_seed(0)
        model = nn.Linear(4, 1).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        kit = GradKit(model, opt, LoopNonFiniteGuard("skip"), log_dir=False) if guarded else None
        loss = model(torch.ones(3, 4, dtype=torch.float64)).square().mean() - 1.4e39
        loss.backward()
        assert _isfinite(loss, *(p.grad for p in model.parameters())) and math.isinf(loss.float().item())
        if kit is None:
            opt.step()
            return model, None
        kit.note_loss(loss)
        return model, kit.step(opt)

    guarded, applied = run(True)
    reference, _ = run(False)
    assert applied is True
    assert all(torch.equal(a, b) for a, b in zip(guarded.parameters(), reference.parameters(), strict=True))


# -- behind the Trainer -------------------------------------------------------------------------------------------
class RecordingFaultModule(FaultModule):
    """Records, at each optimizer step, ``torch.isfinite`` by hand over the loss and the gradients, and the flag of
    the plan the guard decided on (the module's hook runs after the callbacks')."""

    def __init__(self, fault: Fault) -> None:
        super().__init__(fault, optimizer="sgd", lr=0.1)
        self.records: list[tuple[bool, bool]] = []
        self._loss: Tensor | None = None

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self._loss = super().training_step(batch, batch_idx)
        return self._loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        record = TrainerPipeline.of(self.trainer).last_records[id(optimizer)]
        reference = _isfinite(self._loss, *(p.grad for p in self.parameters()))
        self.records.append((reference, bool(record.stats.primary.finite)))


def test_trainer_overflowing_fp32_gradient_is_a_norm_overflow_skipped_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = RecordingFaultModule(Fault("grad", 3e19, target="encoder.0.weight"))
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[NonFiniteGuard(action="skip")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader())
    assert [flag for _, flag in model.records] == [reference for reference, _ in model.records] == [True] * 8
    k = model.fault.batch_idx
    assert state_equal(model.snapshots[k], model.snapshots[k + 1])  # skipped: parameters and state as before
    assert not state_equal(model.snapshots[k + 1], model.snapshots[k + 2])
    (event,) = events(trainer)
    assert (event["step"], event["what"], event["culprit"]) == (k, "norm_overflow", "encoder.0.weight")
    assert event["values"]["overflow_param_grads"] == ["encoder.0.weight"] and event["values"]["grad_norm"] == "inf"
    assert next(str(w.message) for w in caught if "NonFiniteGuard" in str(w.message)).startswith(
        f"NonFiniteGuard: gradient norm overflow at step {k}: every gradient element is finite"
    )
    assert column(read_metrics(trainer), "gradkit/skipped_steps")[-1] == 1.0


def test_trainer_nonfinite_gradient_is_still_nonfinite(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = RecordingFaultModule(Fault("grad", -INF, target="encoder.0.weight"))
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[NonFiniteGuard(action="skip")])
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        trainer.fit(model, loader())
    assert [flag for _, flag in model.records] == [reference for reference, _ in model.records]
    assert [reference for reference, _ in model.records].count(False) == 1
    (event,) = events(trainer)
    assert (event["what"], event["culprit"]) == ("nonfinite_grads", "encoder.0.weight")


class Float64Loss(MLPModule):
    """A float64 model whose loss is shifted by -1.4e39: finite, its gradients those of the MSE."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return super().training_step(batch, batch_idx) - 1.4e39


def test_trainer_a_finite_float64_loss_of_minus_1_4e39_is_not_flagged(tmp_path: Path) -> None:
    """Reference: plain PyTorch SGD in float64 over the same batches (the shift leaves the gradients alone)."""
    torch.manual_seed(0)
    model = Float64Loss()
    trainer = make_trainer(tmp_path, strategy="gradkit", precision="64-true", callbacks=[NonFiniteGuard("skip")])
    trainer.fit(model, loader())
    torch.manual_seed(0)
    reference = MLPModule().double()
    opt = torch.optim.SGD(reference.parameters(), lr=reference.lr)
    for x, y in loader():
        opt.zero_grad()
        loss = nn.functional.mse_loss(reference(x.double()), y.double()) - 1.4e39
        assert _isfinite(loss)
        loss.backward()
        opt.step()
    assert events(trainer) == []
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0, msg=name)
