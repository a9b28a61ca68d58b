"""NonFiniteGuard with Lightning's real Trainer: faults injected on purpose, compared bitwise with the state before
the bad step and with a plain PyTorch loop that never saw the bad batch.

The fault-injection helpers here are also used by ``distributed/guards_script.py``.
"""

from __future__ import annotations

import copy
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from torch import Tensor, nn

from helpers import MLPModule, column, count_syncs, loader, make_trainer, read_metrics, run_without_lightning
from lightning_gradkit import NonFiniteGuard

NAN, INF = float("nan"), float("inf")


# -- fault injection ----------------------------------------------------------------------------------------------
@dataclass
class Fault:
    """One injected non-finite value.

    Attributes:
        kind: ``"loss"`` (the training loss), ``"grad"`` (one element of one parameter's gradient, through a tensor
            hook) or ``"activation"`` (one element of one submodule's output, through a forward hook).
        value: ``nan`` or ``inf``.
        batch_idx: the training batch that gets the fault (a replay of that batch gets it again).
        rank: the only rank that injects; ``None`` for every rank.
        target: the submodule (``"activation"``) or parameter (``"grad"``) name.
    """

    kind: str
    value: float
    batch_idx: int = 2
    rank: int | None = None
    target: str = "encoder.2"


class FaultModule(MLPModule):
    """The MLP with Adam, a :class:`Fault`, and a snapshot of parameters and optimizer state at each batch start."""

    def __init__(self, fault: Fault | None = None, optimizer: str = "adam", lr: float = 0.01, fused: bool = False):
        super().__init__(lr=lr, optimizer=optimizer)
        self.fault = fault
        self.fused = fused
        self.snapshots: dict[int, tuple[dict[str, Tensor], dict[str, Any]]] = {}
        self._hooks: list[Any] = []
        self._batch_idx = -1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr, fused=self.fused or None)
        return super().configure_optimizers()

    def _active(self) -> bool:
        f = self.fault
        return (
            f is not None and self._batch_idx == f.batch_idx and (f.rank is None or f.rank == self.trainer.global_rank)
        )

    def _poison(self, t: Tensor) -> Tensor:
        if not self._active():
            return t
        t = t.clone()
        t.view(-1)[0] = self.fault.value
        return t

    def on_fit_start(self) -> None:
        if self.fault is None or self._hooks:
            return
        if self.fault.kind == "activation":
            module = self.get_submodule(self.fault.target)
            self._hooks.append(module.register_forward_hook(lambda m, args, out: self._poison(out)))
        elif self.fault.kind == "grad":
            param = self.get_parameter(self.fault.target)
            self._hooks.append(param.register_hook(self._poison))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        # Keyed on the batch being computed (the forward and backward that follow), so a replay of it repeats.
        self._batch_idx = batch_idx
        loss = super().training_step(batch, batch_idx)
        if self.fault is not None and self.fault.kind == "loss" and self._active():
            loss = loss * self.fault.value
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        params = {n: plain(p) for n, p in self.named_parameters()}
        state = self.trainer.optimizers[0].state_dict()
        state = {"state": {i: {k: plain(v) for k, v in s.items()} for i, s in state["state"].items()}}
        self.snapshots[batch_idx] = (params, state)


def plain(t: Any) -> Any:
    """A detached copy; a DTensor (FSDP2) is gathered whole (a collective: every rank calls it at the same point)."""
    if not isinstance(t, Tensor):
        return copy.deepcopy(t)
    return t.detach().full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def state_equal(a: tuple[dict[str, Tensor], dict[str, Any]], b: tuple[dict[str, Tensor], dict[str, Any]]) -> bool:
    """Parameters and optimizer state (every tensor: moments, step counts) bitwise equal."""
    params_a, opt_a = a
    params_b, opt_b = b
    if params_a.keys() != params_b.keys() or opt_a["state"].keys() != opt_b["state"].keys():
        return False
    if not all(torch.equal(params_a[k], params_b[k]) for k in params_a):
        return False
    for i, state in opt_a["state"].items():
        other = opt_b["state"][i]
        if state.keys() != other.keys() or not all(torch.equal(state[k], other[k]) for k in state):
            return False
    return True


def reference_params(skip: set[int], n: int = 64, batch_size: int = 8, lr: float = 0.01) -> dict[str, Tensor]:
    """Plain PyTorch: Adam over the batches of ``loader(n, batch_size)`` that are not in ``skip``."""
    torch.manual_seed(0)
    model = MLPModule(lr=lr)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for i, (x, y) in enumerate(loader(n, batch_size)):
        if i in skip:
            continue
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def events(trainer_or_dir: Any) -> list[dict[str, Any]]:
    directory = Path(trainer_or_dir.log_dir) if hasattr(trainer_or_dir, "log_dir") else Path(trainer_or_dir)
    path = directory / "gradkit_events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def fit(tmp_path: Path, fault: Fault | None, **kwargs: Any) -> tuple[FaultModule, Any, list[str]]:
    """Train the FaultModule with ``NonFiniteGuard(action="skip")``; returns the guard's warning texts too."""
    torch.manual_seed(0)
    model = FaultModule(fault)
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[NonFiniteGuard(action="skip")], **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader())
    return model, trainer, [str(w.message) for w in caught if "NonFiniteGuard" in str(w.message)]


def make_fault(kind: str, value: float, rank: int | None = None) -> Fault:
    """The fault of one matrix cell. An Inf activation goes into ``head``: before it every activation passes a
    ``tanh``, and ``tanh(inf) = 1`` with a zero derivative, so an Inf there is harmless (a NaN is not)."""
    target = {"loss": "", "grad": "encoder.0.weight", "activation": "encoder.2" if math.isnan(value) else "head"}
    return Fault(kind, value, rank=rank, target=target[kind])


def expected_culprit(fault: Fault) -> str:
    return "<loss>" if fault.kind == "loss" else fault.target


# -- the fault matrix, single device -------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize("kind", ["loss", "grad", "activation"])
def test_skipped_step_leaves_params_and_adam_state_bitwise_unchanged(tmp_path: Path, kind: str, value: float) -> None:
    fault = make_fault(kind, value)
    model, trainer, warned = fit(tmp_path, fault)
    k = fault.batch_idx
    assert len(warned) == 1 and "gradkit_events.jsonl" in warned[0] and f"step {k}" in warned[0]
    assert state_equal(model.snapshots[k], model.snapshots[k + 1])
    assert not state_equal(model.snapshots[k + 1], model.snapshots[k + 2])  # later steps do update
    # Independent reference: plain Adam that never saw batch k (the training completed with 7 applied steps).
    expected = reference_params(skip={k})
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=0, msg=name)
    assert trainer.global_step == 8  # attempted steps, documented
    assert column(read_metrics(trainer), "gradkit/skipped_steps")[-1] == 1.0
    (event,) = events(trainer)
    assert event["step"] == k and event["batch_idx"] == k
    assert event["culprit"] == expected_culprit(fault)
    if kind == "loss":
        assert event["what"] == "nonfinite_loss_and_grads" and event["rank"] == [0]
    if kind == "grad":
        assert event["what"] == "nonfinite_grads" and event["values"]["nonfinite_param_grads"] == ["encoder.0.weight"]
    if kind == "activation":
        assert event["values"]["forensics"][0]["phase"] == "forward"


@pytest.mark.parametrize("kind", ["loss", "grad", "activation"])
def test_bf16_mixed_skip_is_exact(tmp_path: Path, kind: str) -> None:
    fault = make_fault(kind, NAN)
    model, trainer, _ = fit(tmp_path, fault, precision="bf16-mixed")
    k = fault.batch_idx
    assert state_equal(model.snapshots[k], model.snapshots[k + 1])
    assert events(trainer)[0]["culprit"] == expected_culprit(fault)


@pytest.mark.parametrize("kind", ["loss", "grad", "activation"])
def test_fp16_gradscaler_skip_is_exact_and_named(tmp_path: Path, kind: str) -> None:
    fault = make_fault(kind, INF)
    scaler = torch.amp.GradScaler("cpu")
    model, trainer, warned = fit(tmp_path, fault, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    k = fault.batch_idx
    assert state_equal(model.snapshots[k], model.snapshots[k + 1])
    (event,) = [e for e in events(trainer) if e["step"] == k]  # the scaler may overflow at step 0, too
    assert event["culprit"] == expected_culprit(fault)
    # Non-finite gradients under a finite loss look like the scaler's routine overflow: recorded, not warned.
    overflow = fault.kind == "grad"
    assert (event["what"] == "fp16_overflow") == overflow and len(warned) == (0 if overflow else 1)


def test_fused_adam_skips_on_device_and_syncs_only_to_replay_the_bad_step(tmp_path: Path) -> None:
    fault = Fault("loss", NAN)
    torch.manual_seed(0)
    model = FaultModule(fault, fused=True)
    guard = NonFiniteGuard(action="skip")
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[guard], log_every_n_steps=1000)
    with count_syncs() as counter:
        per_step = counter.watch_per_call(trainer.strategy, "optimizer_step")
        with pytest.warns(UserWarning, match="between steps 2 and 2"):
            trainer.fit(model, loader())
    # The clean steps read nothing on the host. Step 3 learns (one step late) that step 2 was flagged and replays it:
    # the replay's reads are the only ones after step 0 (a fused optimizer's first step: test_first_step_sync.py).
    assert len(per_step) == 8 and [step for step, syncs in enumerate(per_step) if syncs and step > 0] == [3], per_step
    assert state_equal(model.snapshots[2], model.snapshots[3])
    assert not state_equal(model.snapshots[3], model.snapshots[4])
    # Reported at the end of training from the device-side count; the replay found the loss made non-finite.
    (event,) = events(trainer)
    assert event["what"] == "nonfinite_loss_and_grads" and event["values"]["flagged_steps"] == 1
    assert event["first_step"] == 2 and event["culprit"] == "<loss>" and event["culprit_source"] == "replay"
    assert event["batch_idx"] == 2 and event["reproducible"] is True


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_fused_adam_skip_is_exact_under_mixed_precision(tmp_path: Path, precision: str) -> None:
    """The fused kernel receives the skip as ``found_inf`` (under 16-mixed combined with the GradScaler's own)."""
    fault = Fault("activation", NAN)
    if precision == "16-mixed":
        kwargs = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))]}
    else:
        kwargs = {"precision": precision}
    torch.manual_seed(0)
    model = FaultModule(fault, fused=True)
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[NonFiniteGuard()], **kwargs)
    with pytest.warns(UserWarning, match="NonFiniteGuard"):
        trainer.fit(model, loader())
    assert state_equal(model.snapshots[2], model.snapshots[3])
    assert not state_equal(model.snapshots[3], model.snapshots[4])


def test_ordinary_optimizer_costs_one_host_read_per_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[NonFiniteGuard()], log_every_n_steps=1000)
    with count_syncs() as counter:
        counter.watch(trainer.strategy, "optimizer_step")
        trainer.fit(FaultModule(None, optimizer="sgd"), loader())  # Adam itself calls .item() on its step count
    assert counter.counts == {"__bool__": 8}


# -- learning-rate schedulers and accumulation ---------------------------------------------------------------------
class ScheduledFaultModule(FaultModule):
    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.lr, fused=self.fused or None)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.mark.parametrize("fused", [False, True], ids=["adam", "fused_adam"])
def test_step_scheduler_does_not_advance_on_a_skipped_step(tmp_path: Path, fused: bool) -> None:
    torch.manual_seed(0)
    model = ScheduledFaultModule(Fault("loss", NAN, batch_idx=3), fused=fused)
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[NonFiniteGuard()])
    with pytest.warns(UserWarning, match="NonFiniteGuard"):
        trainer.fit(model, loader())
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert sched.last_epoch == 7  # 8 attempted steps, 7 applied
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.01 * 0.5**7)
    assert "step" not in sched.__dict__ and "lr_scheduler_step" not in model.__dict__  # nothing left behind


def test_accumulation_skips_the_whole_window_and_replays_the_bad_micro_batch(tmp_path: Path) -> None:
    fault = Fault("activation", NAN, batch_idx=5)  # second micro-batch of the third window
    model, trainer, _ = fit(tmp_path, fault, accumulate_grad_batches=2)
    assert state_equal(model.snapshots[4], model.snapshots[6])
    (event,) = events(trainer)
    assert event["step"] == 2 and event["culprit"] == "encoder.2"
    assert event["values"]["forensics"][0]["batch_idx"] == 5
    expected = reference_params_accumulated(skip_window=2)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-6, atol=1e-7, msg=name)


def reference_params_accumulated(skip_window: int, lr: float = 0.01) -> dict[str, Tensor]:
    torch.manual_seed(0)
    model = MLPModule(lr=lr)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    batches = list(loader())
    for w in range(4):
        if w == skip_window:
            continue
        opt.zero_grad()
        for x, y in batches[2 * w : 2 * w + 2]:
            (nn.functional.mse_loss(model(x), y) / 2).backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


# -- actions, limits, messages -------------------------------------------------------------------------------------
def test_raise_stops_before_the_bad_update_and_names_the_module(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = FaultModule(Fault("activation", NAN))
    guard = NonFiniteGuard(action="raise")
    trainer = make_trainer(tmp_path, callbacks=[guard])  # "raise" needs no GradKit strategy
    with pytest.raises(RuntimeError, match=r"step 2:.*`encoder\.2`.*gradkit_events\.jsonl"):
        trainer.fit(model, loader())
    params = {n: p.detach() for n, p in model.named_parameters()}
    assert all(torch.equal(params[n], model.snapshots[2][0][n]) for n in params)


def test_warn_applies_the_update_and_reports_on_logging_steps(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = FaultModule(Fault("grad", INF, target="head.bias"), optimizer="sgd")
    trainer = make_trainer(tmp_path, callbacks=[NonFiniteGuard(action="warn")], log_every_n_steps=4)
    # The Inf update is applied, so step 3 is non-finite as well; the logging step 3 reports both, and the logging
    # step 7 the four after them.
    with (
        pytest.warns(UserWarning, match=r"2 optimizer step\(s\) with non-finite values between steps 2 and 3"),
        pytest.warns(UserWarning, match=r"4 optimizer step\(s\) with non-finite values between steps 4 and 7"),
    ):
        trainer.fit(model, loader())
    assert not math.isfinite(model.head.bias.detach().sum().item())
    first = events(trainer)[0]
    assert first["step"] == first["first_step"] == 2 and first["culprit"] == "head.bias"  # one number per event


class AlwaysNaN(FaultModule):
    def _active(self) -> bool:
        return self._batch_idx >= 1


def test_max_consecutive_stops_with_steps_cause_and_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = AlwaysNaN(Fault("activation", NAN))
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1)
    guard = NonFiniteGuard(max_consecutive=3)
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[guard, ckpt], enable_checkpointing=True)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError) as info:
        trainer.fit(model, loader())
    message = str(info.value)
    assert "3 consecutive optimizer steps" in message and "steps 1-3" in message
    assert "`encoder.2`" in message and "gradkit_events.jsonl" in message
    assert str(tmp_path / "ckpt") in message
    assert [e["step"] for e in events(trainer)] == [1, 2, 3]
    assert state_equal(model.snapshots[1], model.snapshots[3])


def test_forensics_runs_on_the_first_detection_only(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = AlwaysNaN(Fault("activation", NAN))
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[NonFiniteGuard(max_consecutive=100)])
    with pytest.warns(UserWarning):
        trainer.fit(model, loader())
    found = events(trainer)
    assert len(found) == 7
    assert "forensics" in found[0]["values"] and all("forensics" not in e["values"] for e in found[1:])


class NaNValidation(MLPModule):
    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        return loss * NAN if batch_idx == 1 else loss


def test_nonfinite_validation_loss_is_reported_and_stops_training(tmp_path: Path) -> None:
    trainer = make_trainer(
        tmp_path,
        callbacks=[NonFiniteGuard(action="warn", stop_on_nonfinite_validation=True)],
        val_check_interval=4,
        max_epochs=3,
    )
    with pytest.warns(UserWarning, match="non-finite validation loss at step 4.*Training stops"):
        trainer.fit(NaNValidation(), loader(), loader(n=24))
    assert trainer.global_step == 4
    (event,) = events(trainer)
    assert event["what"] == "nonfinite_val_loss" and event["rank"] == [0] and event["stopped"] is True


# -- setup and arguments -------------------------------------------------------------------------------------------
def test_skip_on_a_plain_strategy_fails_at_setup_naming_the_fix(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[NonFiniteGuard(action="skip")])
    with pytest.raises(RuntimeError, match=r'strategy="gradkit"'):
        trainer.fit(MLPModule(), loader())


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"action": "stop"}, "action"),
        ({"max_consecutive": 0}, "max_consecutive"),
        ({"max_consecutive": 1.5}, "max_consecutive"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=f"`{argument}`"):
        NonFiniteGuard(**kwargs)


def test_skip_count_survives_a_resume(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = FaultModule(Fault("loss", NAN, batch_idx=2))
    trainer = make_trainer(tmp_path / "a", strategy="gradkit", callbacks=[NonFiniteGuard()], max_epochs=1)
    with pytest.warns(UserWarning):
        trainer.fit(model, loader())
    trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
    model.fault = Fault("loss", NAN, batch_idx=5)  # one more in epoch 2
    trainer = make_trainer(tmp_path / "b", strategy="gradkit", callbacks=[NonFiniteGuard()], max_epochs=2)
    with pytest.warns(UserWarning):
        trainer.fit(model, loader(), ckpt_path=tmp_path / "epoch1.ckpt")
    assert column(read_metrics(trainer), "gradkit/skipped_steps")[-1] == 2.0
    assert trainer.callbacks[0].state_dict()["skipped_steps"] == 2.0


def test_state_dict_round_trips(tmp_path: Path) -> None:
    _, trainer, _ = fit(tmp_path, Fault("activation", NAN))
    guard = trainer.callbacks[0]
    state = guard.state_dict()
    assert state["skipped_steps"] == 1.0 and state["forensics_done"] is True
    fresh = NonFiniteGuard()
    fresh.load_state_dict(copy.deepcopy(state))
    assert fresh._forensics_done and fresh._first_finding == guard._first_finding


LIGHTNING_FREE_LOOP = """
import json, math, sys, warnings
import torch
from torch import nn
from gradkit.policies.guards import NonFiniteGuard
from gradkit.doors.loop import GradKit
from gradkit.policies.spike_guard import SpikeGuard

def batches():
    g = torch.Generator().manual_seed(0)
    out = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(12)]
    out[3][0][0, 0] = math.nan  # a NaN input: NonFiniteGuard skips step 3
    out[9] = (out[9][0], out[9][1] * 1000.0)  # a loss spike: SpikeGuard skips step 9
    return out

def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

net = model()
opt = torch.optim.SGD(net.parameters(), lr=0.05)
guards = [NonFiniteGuard(action="skip"), SpikeGuard("loss", z_threshold=4.0, warmup_steps=5, action="skip")]
kit = GradKit(net, opt, guards, log_dir=sys.argv[1])
applied = []
with warnings.catch_warnings(record=True):
    warnings.simplefilter("always")
    for x, y in batches():
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        kit.note_loss(loss, replay=lambda x=x, y=y: nn.functional.mse_loss(net(x), y))
        applied.append(kit.step(opt))
        opt.zero_grad(set_to_none=True)
    kit.finish()

# The reference: plain PyTorch, skipping the steps the guards should skip.
ref = model()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
for i, (x, y) in enumerate(batches()):
    if i in (3, 9):
        continue
    nn.functional.mse_loss(ref(x), y).backward()
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=True)
same = all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), ref.state_dict().values()))
print(json.dumps({"applied": applied, "same": same, "skipped": kit.skipped_steps}))
"""


def test_torch_guards_run_behind_the_loop_door_without_lightning(tmp_path: Path) -> None:
    """``gradkit.NonFiniteGuard`` and ``gradkit.SpikeGuard`` in a plain loop, in a fresh
    interpreter that never loads Lightning. Reference: the same loop in plain PyTorch without the two bad steps."""
    result = json.loads(run_without_lightning(LIGHTNING_FREE_LOOP, str(tmp_path)))
    assert result["applied"] == [i not in (3, 9) for i in range(12)] and result["skipped"] == 2
    assert result["same"]  # bitwise equal to the reference
    nonfinite, spike = events(tmp_path)
    assert (nonfinite["step"], nonfinite["what"], nonfinite["culprit"]) == (3, "nonfinite_loss_and_grads", "<batch>")
    assert nonfinite["culprit_source"] == "replay" and nonfinite["values"]["forensics"][0]["phase"] == "batch"
    assert (spike["step"], spike["what"], spike["source"]) == (9, "loss_spike", "SpikeGuard")
