"""SpikeRollback with Lightning's real Trainer: a rollback restores the snapshot bitwise (parameters, buffers,
optimizer and scheduler state, the strategy's schedule counts, RNG, other callbacks' statistics), the run afterwards
equals a plain PyTorch loop that never saw the rewound and stepped-over batches (BatchNorm buffers and LR schedules
with a ``frequency`` included), ``global_step - skipped_steps`` stays Adam's step count, a checkpoint resumes as the
uninterrupted run (with ``save_snapshots=True``; without, as the documented fallback), and bad arguments or a
missing GradKit strategy fail with a clear message.

Spikes come from the data, chosen by index: the targets of some batches are multiplied by a large factor (or set
to NaN), so a reference loop can leave exactly those batches out.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from architectures import ResNet18Like, image_data
from gradkit.step.snapshot import Snapshot, _fits
from helpers import column, count_syncs, make_trainer, read_metrics, regression_data, run_without_lightning
from lightning_gradkit import NonFiniteGuard, SpikeGuard, SpikeRollback, ZClip
from test_guards import events

BATCH = 8


def spiky_loader(n_batches: int, bad: dict[int, float]) -> DataLoader:
    """Regression batches of 8 in order; the targets of batch ``i`` in ``bad`` are multiplied by ``bad[i]``."""
    x, y = regression_data(n_batches * BATCH).tensors
    y = y.clone()
    for i, factor in bad.items():
        y[i * BATCH : (i + 1) * BATCH] *= factor
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


class Net(nn.Module):
    """A small MLP with a BatchNorm (buffers that a forward changes) and a Dropout (draws from the RNG)."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 1)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)


def make_optimizer(
    net: nn.Module, fused: bool = False
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.Adam(net.parameters(), lr=0.01, fused=fused or None)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)


class RollbackModule(pl.LightningModule):
    """The Net with Adam and a per-step StepLR; records the full state at the end of every batch, keyed by
    ``trainer.global_step`` (this hook runs after every callback's ``on_train_batch_end``)."""

    def __init__(self, dropout: float = 0.1, fused: bool = False) -> None:
        super().__init__()
        self.net = Net(dropout)
        self.fused = fused
        self.states: dict[int, dict[str, Any]] = {}

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt, sched = make_optimizer(self, self.fused)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        trainer = self.trainer
        self.states[trainer.global_step] = {
            "params": {n: p.detach().clone() for n, p in self.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in self.named_buffers()},
            "optimizer": copy.deepcopy(trainer.optimizers[0].state_dict()),
            "scheduler": copy.deepcopy(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
            "rng": torch.get_rng_state(),
            # The statistics of the other stateful gradkit callbacks (their counters are bookkeeping).
            "callbacks": {
                type(cb).__name__: copy.deepcopy(cb.state_dict()["stats" if isinstance(cb, SpikeGuard) else "policies"])
                for cb in trainer.callbacks
                if isinstance(cb, (ZClip, SpikeGuard))
            },
        }


def assert_bitwise(a: Any, b: Any, where: str = "") -> None:
    """Nested dicts/lists of tensors and plain values: tensors bitwise equal (dtype included), the rest equal."""
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_bitwise(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), where


def reference_run(
    n_batches: int, bad: dict[int, float], kept: list[int], fused: bool = False, dropout: float = 0.1
) -> Net:
    """Plain PyTorch: the same Net, Adam and per-step StepLR, trained on the batches ``kept`` only, in order."""
    torch.manual_seed(0)
    net = Net(dropout)
    opt, sched = make_optimizer(net, fused)
    batches = list(spiky_loader(n_batches, bad))
    for i in kept:
        x, y = batches[i]
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        sched.step()
    return net


def fit(
    tmp_path: Path,
    rollback: SpikeRollback,
    n_batches: int,
    bad: dict[int, float],
    extra: list[Any] | None = None,
    fused: bool = False,
    module: Callable[[], RollbackModule] | None = None,
    **kwargs: Any,
) -> tuple[RollbackModule, Any, list[str]]:
    torch.manual_seed(0)
    model = module() if module is not None else RollbackModule(fused=fused)
    kwargs.setdefault("strategy", "gradkit")
    trainer = make_trainer(tmp_path, callbacks=[*(extra or []), rollback], **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, spiky_loader(n_batches, bad))
    return model, trainer, [str(w.message) for w in caught if "SpikeRollback" in str(w.message)]


def rollback_events(trainer: Any) -> list[dict[str, Any]]:
    return [e for e in events(trainer) if e["what"].startswith("rollback")]


def make_rollback(**kwargs: Any) -> SpikeRollback:
    args: dict[str, Any] = dict(z_threshold=4.0, alpha=0.9, warmup_steps=4, patience=2, snapshot_every_n_steps=4)
    args.update(kwargs)
    return SpikeRollback("loss", **args)


# -- the restore is exact --------------------------------------------------------------------------------------
def test_rollback_restores_params_buffers_optimizer_scheduler_rng_and_callback_states_bitwise(tmp_path: Path) -> None:
    # Batches 9 and 10 spike: with patience 2 the rollback fires at step 10 and restores the snapshot of step 8.
    extra = [ZClip(warmup_steps=3), SpikeGuard("loss", z_threshold=4.0, warmup_steps=3, action="warn")]
    model, trainer, warned = fit(tmp_path, make_rollback(), 16, {9: 50.0, 10: 50.0}, extra=extra)
    (event,) = rollback_events(trainer)
    assert (event["step"], event["from_step"], event["to_step"], event["spike_start"]) == (10, 11, 8, 9)
    assert event["rewound_steps"] == 3 and event["values"]["reason"] == "spike" and event["values"]["z"] > 4.0
    restored, snapshot = model.states[11], model.states[8]
    assert_bitwise(restored, snapshot)
    assert restored["optimizer"]["state"][0]["step"] == 8  # Adam's step count is back too
    assert not torch.equal(model.states[10]["params"]["net.body.0.weight"], snapshot["params"]["net.body.0.weight"])
    assert len(warned) == 1 and "rolled back from step 11 to the snapshot of step 8" in warned[0]


@pytest.mark.parametrize("fused", [False, True], ids=["adam", "fused_adam"])
def test_run_after_rollback_equals_a_plain_loop_that_never_saw_the_skipped_batches(tmp_path: Path, fused: bool) -> None:
    # A fused Adam skips on device (`found_inf`); the reference loop uses the same Adam implementation (the BatchNorm
    # makes the first bias's gradient ~0, which Adam amplifies: fused and for-loop Adam drift apart there).
    n, bad = 24, {9: 50.0, 10: 50.0}
    model, trainer, _ = fit(tmp_path, make_rollback(skip_batches=3), n, bad, fused=fused)
    (event,) = rollback_events(trainer)
    assert (event["from_step"], event["to_step"], event["skip_batches"], event["batches_skipped"]) == (11, 8, 3, 6)
    # Rewound: batches 8, 9, 10 (the snapshot is from before batch 8); stepped over: 11, 12, 13. The reference
    # draws the dropout masks of the kept batches only: the rollback and each stepped-over batch restore the RNG.
    kept = [*range(8), *range(14, n)]
    expected = reference_run(n, bad, kept, fused)
    for (name, p), ref in zip(model.net.named_parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), ref.detach(), rtol=0, atol=1e-6, msg=name)
    for (name, b), ref in zip(model.net.named_buffers(), expected.buffers(), strict=True):
        torch.testing.assert_close(b, ref, rtol=0, atol=1e-6, msg=name)  # BatchNorm never saw a skipped batch
    opt = trainer.optimizers[0]
    assert opt.state_dict()["state"][0]["step"] == len(kept)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5 ** (len(kept) // 5))
    assert trainer.global_step == n  # attempted steps: the rewound and the stepped-over ones count


def test_the_reference_comparison_would_catch_a_rollback_that_kept_the_rewound_batches(tmp_path: Path) -> None:
    """The reference leaving out batches 8-13 differs from one leaving out 11-13 only: the test above has teeth."""
    n, bad = 24, {9: 50.0, 10: 50.0}
    a = reference_run(n, bad, [*range(8), *range(14, n)])
    b = reference_run(n, bad, [*range(11), *range(14, n)])
    assert (a.body[0].weight - b.body[0].weight).abs().max() > 1e-3


# -- the whole step state ---------------------------------------------------------------------------------------
class FrequencyModule(RollbackModule):
    """No dropout; Adam with a StepLR(step_size=1, gamma=0.9) that Lightning steps every ``frequency`` steps."""

    def __init__(self, frequency: int) -> None:
        super().__init__(dropout=0.0)
        self.frequency = frequency

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": self.frequency}}


@pytest.mark.parametrize("frequency", [2, 3])
def test_scheduler_with_a_frequency_steps_after_a_rollback_as_in_a_plain_loop_on_the_kept_batches(
    tmp_path: Path, frequency: int
) -> None:
    # Batches 8 and 9 spike: the rollback fires at step 9, rewinds batch 8 (applied) and steps over 10-12. The
    # strategy's count of applied batches must rewind with the scheduler: else it steps one batch late.
    n, bad = 24, {8: 50.0, 9: 50.0}
    model, trainer, _ = fit(tmp_path, make_rollback(skip_batches=3), n, bad, module=lambda: FrequencyModule(frequency))
    (event,) = rollback_events(trainer)
    assert (event["step"], event["from_step"], event["to_step"]) == (9, 10, 8)
    kept = [*range(8), *range(13, n)]
    torch.manual_seed(0)
    net = Net(dropout=0.0)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    batches = list(spiky_loader(n, bad))
    for i, b in enumerate(kept):
        opt.zero_grad()
        nn.functional.mse_loss(net(batches[b][0]), batches[b][1]).backward()
        opt.step()
        if (i + 1) % frequency == 0:
            sched.step()
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    assert lr == opt.param_groups[0]["lr"] == pytest.approx(0.01 * 0.9 ** (len(kept) // frequency))
    for (name, p), ref in zip(model.net.named_parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), ref.detach(), rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_batchnorm_buffers_after_a_rollback_equal_a_plain_loop_that_never_saw_the_stepped_over_batches(
    tmp_path: Path, accumulate: int
) -> None:
    """A ResNet-18-shaped CNN; NaN images in batches 9 and 10 turn the BatchNorm running statistics NaN and trigger
    the rollback; every stepped-over batch (11, 12, finite) runs its forward in train mode, which moves them too."""
    n, bad, size = 16, (9, 10), 4
    x, y = image_data(n * size).tensors
    x = x.clone()
    for i in bad:
        x[i * size : (i + 1) * size] = math.nan
    batches = list(DataLoader(TensorDataset(x, y), batch_size=size))

    class CNN(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = ResNet18Like()

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    model = CNN()
    rollback = make_rollback(snapshot_every_n_steps=8 // accumulate, skip_batches=2 // accumulate)
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[rollback], accumulate_grad_batches=accumulate)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=size))
    (event,) = rollback_events(trainer)
    assert event["values"]["reason"] == "nonfinite" and event["to_step"] * accumulate == 8
    # Rewound: batches 8-10 (8-11 with accumulation), then 2 batches stepped over. The reference never saw them.
    end = (event["from_step"] + event["skip_batches"]) * accumulate
    assert end == (13 if accumulate == 1 else 14)
    kept = [*range(8), *range(end, n)]
    torch.manual_seed(0)
    ref = ResNet18Like()
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for window in [kept[i : i + accumulate] for i in range(0, len(kept), accumulate)]:
        opt.zero_grad()
        for b in window:
            (nn.functional.cross_entropy(ref(batches[b][0]), batches[b][1]) / accumulate).backward()
        opt.step()
    buffers = dict(ref.named_buffers())
    for name, b in model.net.named_buffers():
        torch.testing.assert_close(b, buffers[name], rtol=0, atol=1e-6, msg=name)  # num_batches_tracked exactly
    for (name, p), r in zip(model.net.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=1e-5, msg=name)


def test_global_step_minus_skipped_steps_is_adams_step_count_after_a_rollback(tmp_path: Path) -> None:
    # Batch 3: NaN, skipped by NonFiniteGuard; batches 9-10 spike: rollback at step 10 to the snapshot of step 8
    # (3 steps rewound: 8 and 9 applied, 10 skipped), then 3 batches stepped over.
    n, bad = 24, {3: math.nan, 9: 50.0, 10: 50.0}
    _, trainer, _ = fit(tmp_path, make_rollback(skip_batches=3), n, bad, extra=[NonFiniteGuard(action="skip")])
    (event,) = rollback_events(trainer)
    assert (event["from_step"], event["to_step"], event["rewound_steps"]) == (11, 8, 3)
    adam_steps = trainer.optimizers[0].state_dict()["state"][0]["step"]
    assert adam_steps == n - 1 - 3 - 3  # the batches kept: all but 3, 8-10 and 11-13
    logged = column(read_metrics(trainer), "gradkit/skipped_steps")
    assert trainer.global_step - logged[-1] == adam_steps


# -- triggers, snapshot choice and budget ------------------------------------------------------------------------
def test_nonfinite_loss_that_skipping_does_not_cure_triggers_a_rollback(tmp_path: Path) -> None:
    # Batch 3: one NaN, which NonFiniteGuard skips (no rollback); batches 6 and 7: NaN twice in a row.
    bad = {3: math.nan, 6: math.nan, 7: math.nan}
    model, trainer, _ = fit(tmp_path, make_rollback(), 12, bad, extra=[NonFiniteGuard(action="skip")])
    (event,) = rollback_events(trainer)
    assert event["values"]["reason"] == "nonfinite" and event["values"]["nonfinite_consecutive"] == 2
    # The snapshot due after step 4 waited for a clean step (batch 3 was non-finite): it holds step 5.
    assert (event["step"], event["to_step"]) == (7, 5)
    assert_bitwise(model.states[8]["params"], model.states[5]["params"])
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("escalate", [None, 0.5], ids=["plain", "escalating"])
@pytest.mark.parametrize("again", [9, 10], ids=["first_step_after_the_resume", "second_step_after_the_resume"])
def test_a_spike_that_comes_back_at_once_after_a_rollback_takes_the_older_snapshot(
    tmp_path: Path, again: int, escalate: float | None
) -> None:
    # Snapshots every 3 steps, keep 2: steps 3 and 6 when batches 7-8 spike. The first rollback fires at step 8 and
    # restores the snapshot of step 6; the run resumes from it at step 9 (the next snapshot is due at 12). The spike
    # comes back at batches `again`, `again + 1`: within 2 steps of the resume (the restored state's own loss, or its
    # first update, spikes), so that state may carry the fault and the second rollback takes the older snapshot, 3,
    # also when it escalates (a cut learning rate does not repair a state).
    bad = {7: 50.0, 8: 50.0, again: 50.0, again + 1: 50.0}
    rollback = make_rollback(snapshot_every_n_steps=3, escalate_lr_factor=escalate)
    model, trainer, warned = fit(tmp_path, rollback, 16, bad)
    first, second = rollback_events(trainer)
    assert (first["step"], first["to_step"], second["step"], second["to_step"]) == (8, 6, again + 1, 3)
    assert_bitwise(model.states[again + 2]["params"], model.states[3]["params"])
    assert len(warned) == (2 if escalate is None else 3)  # the escalation warns too


# A fault that recurs every 6 steps (batches 20-21, 26-27, 32-33) while snapshots are taken every 16 (steps 0, 16, 32),
# keep=2, patience 2. The documented rule, by hand: each rollback restores the newest snapshot taken at or before the
# spike's first flagged step, and a restored state counts as the snapshot of the step the run resumed from it (the end
# of the stepped-over batches), unless the spike came back within 2 steps of that resume. Per `skip_batches`:
# (step that fired, to_step, rewound_steps) of each rollback, and the batches the model holds.
RECURRING = {20: 50.0, 21: 50.0, 26: 50.0, 27: 50.0, 32: 50.0, 33: 50.0}
RECURRING_RULE = {
    # 21 -> the snapshot of 16 (6 steps: 16-21), resume at 22; 27 -> that state again, as of step 22 (26 is 4 steps
    # after the resume; 6 rewound: 22-27); the snapshot due at 32 is taken after batches 28-31; 33 -> it (2 rewound).
    0: ([(21, 16, 6), (27, 22, 6), (33, 32, 2)], [*range(16), *range(28, 32), *range(34, 40)]),
    # The same with 2 batches stepped over after each: resumes at 24, 30, 36; 26 is 2 steps after the resume at 24.
    2: ([(21, 16, 6), (27, 24, 4), (33, 32, 2)], [*range(16), 30, 31, *range(36, 40)]),
}


@pytest.mark.parametrize("skip_batches", sorted(RECURRING_RULE))
def test_a_recurring_fault_is_met_from_the_newest_snapshot_before_each_spike_never_from_step_0(
    tmp_path: Path, skip_batches: int
) -> None:
    expected_rollbacks, kept = RECURRING_RULE[skip_batches]
    n = 40
    rollback = make_rollback(snapshot_every_n_steps=16, skip_batches=skip_batches)
    model, trainer, warned = fit(tmp_path, rollback, n, RECURRING)
    got = [(e["step"], e["to_step"], e["rewound_steps"]) for e in rollback_events(trainer)]
    assert got == expected_rollbacks
    # The failure this rule replaced: the second spike began no later after the resume than the first after its
    # snapshot, so the state of step 16 was taken for faulty and the run went back to step 0 (27 steps rewound).
    assert all(to_step > 0 and rewound <= 16 + 2 for _, to_step, rewound in got)
    assert len(warned) == 3
    # The reference: a plain loop on the batches the model holds (each rollback and stepped-over batch restores the
    # RNG too), and Adam's step count is what `global_step - skipped_steps` says.
    expected = reference_run(n, RECURRING, kept)
    for (name, p), ref in zip(model.net.named_parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), ref.detach(), rtol=0, atol=1e-6, msg=name)
    adam_steps = trainer.optimizers[0].state_dict()["state"][0]["step"]
    skipped = column(read_metrics(trainer), "gradkit/skipped_steps")[-1]
    assert adam_steps == len(kept) == trainer.global_step - skipped


def test_an_escalating_rollback_of_a_recurring_fault_takes_the_same_snapshots(tmp_path: Path) -> None:
    """The escalation cuts the learning rate of the second and third rollbacks (each within 1000 steps of the previous
    one); the snapshots they restore follow the same rule: the run from them differs, the choice does not."""
    rollback = make_rollback(snapshot_every_n_steps=16, escalate_lr_factor=0.5)
    _, trainer, _ = fit(tmp_path, rollback, 40, RECURRING)
    got = [(e["step"], e["to_step"], e["rewound_steps"]) for e in rollback_events(trainer)]
    assert got == RECURRING_RULE[0][0]
    assert [(e["step"], e["to_step"]) for e in events(trainer) if e["what"] == "escalation"] == [(27, 22), (33, 32)]


def test_with_one_snapshot_kept_a_second_rollback_to_it_stops_with_a_clear_error(tmp_path: Path) -> None:
    bad = {9: 50.0, 10: 50.0, 11: 50.0, 12: 50.0}
    with pytest.raises(RuntimeError, match="no snapshot is left to restore") as info:
        fit(tmp_path, make_rollback(keep=1), 16, bad)
    assert "Raise `keep`" in str(info.value) and "gradkit_events.jsonl" in str(info.value)


def test_max_rollbacks_budget_then_a_clear_error_before_the_bad_step_is_applied(tmp_path: Path) -> None:
    bad = {9: 50.0, 10: 50.0, 11: 50.0, 12: 50.0}
    torch.manual_seed(0)
    model = RollbackModule()
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[make_rollback(max_rollbacks=1)])
    with pytest.raises(RuntimeError, match=r"budget of `max_rollbacks=1` is spent"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, spiky_loader(16, bad))
    stopped = rollback_events(trainer)[-1]
    assert stopped["what"] == "rollback_stopped" and stopped["step"] == 12
    # The step that fired (12) was not applied: the parameters are those recorded after step 11.
    for name, p in model.named_parameters():
        assert torch.equal(p, model.states[12]["params"][name]), name


def test_ordinary_optimizer_costs_one_shared_host_read_per_step_and_one_per_due_snapshot(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trainer = make_trainer(
        tmp_path, strategy="gradkit", callbacks=[make_rollback(snapshot_every_n_steps=4)], log_every_n_steps=1000
    )
    with count_syncs() as counter:
        counter.watch(trainer.strategy, "optimizer_step")
        trainer.fit(RollbackModule(), spiky_loader(8, {}))
    # The strategy reads the skip flag once per step anyway (8 steps); the flag of the step is read when a snapshot
    # is due (after steps 4 and 8). Adam's own `.item()` calls happen outside the gate (capturable=False).
    assert counter.counts["__bool__"] == 8 + 2, counter.counts


# -- resume --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("save_snapshots", [False, True], ids=["resume_state", "saved_snapshots"])
def test_checkpoint_after_a_rollback_resumes_exactly(tmp_path: Path, save_snapshots: bool) -> None:
    """12 batches per epoch; batches 7 and 8 spike in both epochs. The rollback of epoch 1 (step 8, to the snapshot
    of step 4) steps over 5 batches: 3 in epoch 1, 2 in epoch 2, after the checkpoint taken at the epoch's end; the
    state to return to after each is the resumed one, or the restored snapshot from the checkpoint.
    No dropout: Lightning does not restore the global RNG on resume, whatever the callbacks do."""
    n, bad = 12, {7: 50.0, 8: 50.0}

    def run(root: Path, epochs: int, ckpt: Path | None = None) -> tuple[RollbackModule, SpikeRollback, Any]:
        torch.manual_seed(0)
        model, callback = RollbackModule(dropout=0.0), make_rollback(skip_batches=5, save_snapshots=save_snapshots)
        trainer = make_trainer(root, strategy="gradkit", callbacks=[callback], max_epochs=epochs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, spiky_loader(n, bad), ckpt_path=ckpt)
        return model, callback, trainer

    straight, cb_straight, t_straight = run(tmp_path / "a", 2)
    _, cb_first, t_first = run(tmp_path / "b", 1)
    assert cb_first.state_dict()["skip_left"] == 2
    ckpt = tmp_path / "epoch1.ckpt"
    t_first.save_checkpoint(ckpt)
    resumed, cb_resumed, t_resumed = run(tmp_path / "c", 2, ckpt)

    assert [e["to_step"] for e in rollback_events(t_straight)] == [4, 16]
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name
    for (name, a), b in zip(straight.named_buffers(), resumed.buffers(), strict=True):
        assert torch.equal(a, b), name
    assert_bitwise(t_straight.optimizers[0].state_dict(), t_resumed.optimizers[0].state_dict())
    sa, sb = cb_straight.state_dict(), cb_resumed.state_dict()
    assert sa["rollbacks"] == sb["rollbacks"] == 2 and sa["history"] == sb["history"]
    assert_bitwise(sa["stats"], sb["stats"])

    # Without the callback's state the resumed run would not step over batches 12-13: the comparison has teeth.
    state = torch.load(ckpt, weights_only=False)
    state["callbacks"] = {}
    torch.save(state, tmp_path / "stateless.ckpt")
    fresh, _, _ = run(tmp_path / "d", 2, tmp_path / "stateless.ckpt")
    assert not torch.equal(fresh.net.body[0].weight, straight.net.body[0].weight)


class ResumableLoader:
    """``spiky_loader``'s batches in order, resumable mid-epoch (Lightning restores a loader with ``state_dict``).

    It has a length, so Lightning's fetcher does not draw ahead of it: the batches drawn are the batches run.
    """

    def __init__(self, n_batches: int, bad: dict[int, float]) -> None:
        self.batches = list(spiky_loader(n_batches, bad))
        self.drawn = 0
        self.start = 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        self.drawn, self.start = self.start, 0
        while self.drawn < len(self.batches):
            self.drawn += 1
            yield self.batches[self.drawn - 1]

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.drawn}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["consumed"]


def run_resumable(
    root: Path, n: int, bad: dict[int, float], save_snapshots: bool, save_at: int = 0, ckpt: Path | None = None
) -> tuple[RollbackModule, Any, list[str]]:
    """One epoch of ``n`` batches, snapshots every 10 steps, rollback after 3 spiking steps; with ``save_at``, a
    checkpoint ``root/mid.ckpt`` after that many steps. No dropout: Lightning does not restore the global RNG."""
    torch.manual_seed(0)
    model = RollbackModule(dropout=0.0)
    rollback = make_rollback(patience=3, snapshot_every_n_steps=10, skip_batches=2, save_snapshots=save_snapshots)
    callbacks: list[Any] = [rollback]
    if save_at:
        callbacks.append(ModelCheckpoint(root, "mid", every_n_train_steps=save_at, save_top_k=-1))
    trainer = make_trainer(root, strategy="gradkit", callbacks=callbacks, enable_checkpointing=bool(save_at))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, ResumableLoader(n, bad), ckpt_path=ckpt)
    return model, trainer, [str(w.message) for w in caught if "SpikeRollback" in str(w.message)]


def without_time(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in e.items() if k != "time"} for e in events]


# Checkpoints taken inside a run of flagged steps (the spike began at step 20, the snapshot before it is step 20's),
# and between a snapshot (step 30) and a later spike (from step 34).
RESUMES = pytest.mark.parametrize(
    ("n", "bad", "stop_at"),
    [(30, (20, 21, 22), 22), (40, (34, 35, 36), 31)],
    ids=["inside_a_flagged_run", "between_snapshot_and_spike"],
)


@RESUMES
def test_run_resumed_with_saved_snapshots_rolls_back_as_the_uninterrupted_one(
    tmp_path: Path, n: int, bad: tuple[int, ...], stop_at: int
) -> None:
    spikes = dict.fromkeys(bad, 50.0)
    straight, t_straight, _ = run_resumable(tmp_path, n, spikes, save_snapshots=True, save_at=stop_at)
    (event,) = rollback_events(t_straight)
    assert (event["from_step"], event["to_step"]) == (bad[-1] + 1, bad[0] // 10 * 10)
    resumed, t_resumed, warned = run_resumable(tmp_path / "c", n, spikes, True, ckpt=tmp_path / "mid.ckpt")

    assert without_time(rollback_events(t_resumed)) == without_time([event])
    assert len(warned) == 1 and "resumed from" not in warned[0]
    assert_bitwise(dict(straight.named_parameters()), dict(resumed.named_parameters()))
    assert_bitwise(dict(straight.named_buffers()), dict(resumed.named_buffers()))
    assert_bitwise(t_straight.optimizers[0].state_dict(), t_resumed.optimizers[0].state_dict())
    # The count of skipped steps came through the checkpoint: the identity with Adam's step count holds.
    skipped = column(read_metrics(t_resumed), "gradkit/skipped_steps")[-1]
    assert t_resumed.global_step - skipped == t_resumed.optimizers[0].state_dict()["state"][0]["step"]
    # The checkpoint holds the ring: each snapshot as large as the parameters, buffers and Adam's state.
    state = torch.load(tmp_path / "mid.ckpt", weights_only=True)["callbacks"][t_straight.callbacks[0].state_key]
    assert sorted(s["step"] for s in state["snapshots"]) == [stop_at // 10 * 10 - 10, stop_at // 10 * 10]


@RESUMES
def test_run_resumed_without_saved_snapshots_restores_the_resumed_state_and_the_event_says_so(
    tmp_path: Path, n: int, bad: tuple[int, ...], stop_at: int
) -> None:
    spikes = dict.fromkeys(bad, 50.0)
    run_resumable(tmp_path, n, spikes, save_snapshots=False, save_at=stop_at)
    resumed, t_resumed, warned = run_resumable(tmp_path / "c", n, spikes, False, ckpt=tmp_path / "mid.ckpt")

    (event,) = rollback_events(t_resumed)
    assert (event["from_step"], event["to_step"], event["snapshot_origin"]) == (bad[-1] + 1, stop_at, "resume")
    assert len(warned) == 1 and f"the state the run resumed from{', after' if stop_at > bad[0] else ':'}" in warned[0]
    # The documented difference, exactly: the state at the resume is restored, then 2 batches are stepped over.
    kept = [*range(stop_at), *range(bad[-1] + 3, n)]
    expected = reference_run(n, spikes, kept, dropout=0.0)
    for (name, p), ref in zip(resumed.net.named_parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), ref.detach(), rtol=0, atol=1e-6, msg=name)


# -- bad input -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("snapshot_every_n_steps", 0),
        ("snapshot_every_n_steps", 2.0),
        ("snapshot_every_n_steps", True),
        ("snapshot_every_n_steps", math.nan),
        ("snapshot_every_n_steps", math.inf),
        ("keep", 0),
        ("keep", "2"),
        ("skip_batches", -1),
        ("patience", 0),
        ("nonfinite_patience", 0),
        ("max_rollbacks", -1),
        ("warmup_steps", 1),
        ("z_threshold", math.nan),
        ("z_threshold", 0.0),
        ("alpha", 1.0),
        ("monitor", "accuracy"),
    ],
)
def test_bad_argument_names_the_argument_and_the_value(argument: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"`{argument}`") as info:
        SpikeRollback(**{argument: value})
    assert repr(value) in str(info.value)


def test_without_a_gradkit_strategy_setup_names_the_strategy_to_use(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[SpikeRollback()])
    with pytest.raises(RuntimeError, match=r'needs a GradKit strategy.*strategy="gradkit"'):
        trainer.fit(RollbackModule(), spiky_loader(2, {}))


def test_manual_optimization_is_refused_at_setup(tmp_path: Path) -> None:
    class Manual(RollbackModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=[SpikeRollback()])
    with pytest.raises(RuntimeError, match="automatic optimization"):
        trainer.fit(Manual(), spiky_loader(2, {}))


def test_snapshot_buffers_are_allocated_once_and_reused_by_every_capture_and_after_a_load() -> None:
    """A capture writes into the buffers of the previous one (same tensors, same storage); a snapshot loaded from a
    checkpoint keeps the loaded tensors as its buffers. Reference: the values each capture saw, restored bitwise."""
    net = Net()
    opt, _ = make_optimizer(net)
    snap = Snapshot(net, host=True)
    net(torch.randn(8, 8)).sum().backward()
    opt.step()
    snap.capture([opt])
    first = list(snap._copies)
    pointers = [t.untyped_storage().data_ptr() for t in first]
    for _ in range(2):
        opt.zero_grad()
        net(torch.randn(8, 8)).sum().backward()
        opt.step()
        saved = copy.deepcopy((net.state_dict(), opt.state_dict()))
        snap.capture([opt])
        assert all(a is b for a, b in zip(snap._copies, first, strict=True))
        assert [t.untyped_storage().data_ptr() for t in snap._copies] == pointers
    loaded = Snapshot(net, host=True)
    loaded.load_state_dict(snap.state_dict())
    adopted = list(loaded._copies)
    loaded.capture([opt])  # on the host no buffer needs pinning: the loaded tensors are reused
    assert all(a is b for a, b in zip(loaded._copies, adopted, strict=True))
    opt.zero_grad()
    net(torch.randn(8, 8)).sum().backward()
    opt.step()
    loaded.restore([opt])
    assert_bitwise(net.state_dict(), saved[0])
    assert_bitwise(opt.state_dict(), saved[1])


def test_a_snapshot_on_a_gpu_replaces_every_unpinned_buffer_also_for_a_host_source() -> None:
    """The rule that pins a GPU snapshot as a whole: an unpinned buffer does not fit once the snapshot is pinned,
    whatever its source's device (a non-fused Adam keeps its ``step`` counts on the host next to CUDA parameters);
    on a host-only snapshot it fits. (Pinned memory itself needs a GPU: see the ``gpu`` tests below.)"""
    step = torch.tensor(3.0)  # as torch.optim.Adam(foreach) keeps `state["step"]` beside CUDA parameters
    host = torch.empty(())
    assert not host.is_pinned()
    assert _fits(host, step, host=True, pin=False)
    assert not _fits(host, step, host=True, pin=True)
    assert not _fits(torch.empty(2), step, host=True, pin=False)  # shape
    assert not _fits(torch.empty((), dtype=torch.float64), step, host=True, pin=False)  # dtype


# -- the snapshot on a GPU -----------------------------------------------------------------------------------------
def cuda_net_after_a_step() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """A CUDA net whose optimizer took one step: (net, optimizer, deep copy of both state dicts)."""
    net = Net().cuda()
    opt, _ = make_optimizer(net)
    net(torch.randn(8, 8, device="cuda")).sum().backward()
    opt.step()
    saved = copy.deepcopy((net.state_dict(), opt.state_dict()))
    return net, opt, saved


@pytest.mark.gpu
def test_gpu_snapshot_uses_pinned_buffers_and_restores_bitwise() -> None:
    net, opt, saved = cuda_net_after_a_step()
    snap = Snapshot(net, host=True)
    snap.capture([opt])
    assert all(t.is_pinned() for t in snap._copies if t.numel())
    for _ in range(3):  # queued right after the non-blocking copies: must not change what was captured
        opt.zero_grad()
        net(torch.randn(8, 8, device="cuda")).sum().backward()
        opt.step()
    snap.restore([opt])
    assert_bitwise(net.state_dict(), saved[0])
    assert_bitwise(opt.state_dict(), saved[1])


@pytest.mark.gpu
def test_gpu_snapshot_from_a_checkpoint_restores_bitwise_and_is_pinned_again_at_the_next_capture(
    tmp_path: Path,
) -> None:
    net, opt, saved = cuda_net_after_a_step()
    snap = Snapshot(net, host=True)
    snap.capture([opt])
    torch.save(snap.state_dict(), tmp_path / "snapshot.pt")
    loaded = Snapshot(net, host=True)
    loaded.load_state_dict(torch.load(tmp_path / "snapshot.pt", weights_only=True))
    for _ in range(2):
        opt.zero_grad()
        net(torch.randn(8, 8, device="cuda")).sum().backward()
        opt.step()
    loaded.restore([opt])
    assert_bitwise(net.state_dict(), saved[0])
    assert_bitwise(opt.state_dict(), saved[1])
    loaded.capture([opt])
    assert all(t.is_pinned() for t in loaded._copies if t.numel())


# -- the torch policy without Lightning ------------------------------------------------------------------------------
_NO_LIGHTNING_ROLLBACK = """
import json
import torch
from torch import nn
from gradkit.doors.loop import GradKit
from gradkit.policies.rollback import SpikeRollback

def batches():
    g = torch.Generator().manual_seed(0)
    out = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(12)]
    return [(x * 30.0, y * 30.0) if i in (7, 8) else (x, y) for i, (x, y) in enumerate(out)]

def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)

def train(model, opt, data, kit=None):
    for x, y in data:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if kit is None:
            opt.step()
        else:
            kit.note_loss(loss)
            kit.step(opt)
        opt.zero_grad(set_to_none=True)

model, opt = model_and_optimizer()
rollback = SpikeRollback(z_threshold=3.0, warmup_steps=3, patience=2, snapshot_every_n_steps=2, skip_batches=1)
train(model, opt, batches(), GradKit(model, opt, rollback, log_every_n_steps=0))
(record,) = rollback.state_dict()["history"]
# The reference: a hand-written loop that trains on the batches the rollback kept (those before the restored
# snapshot, and those after the stepped-over ones).
resumed = record["from_step"] + record["skip_batches"]
kept = [b for i, b in enumerate(batches()) if i < record["to_step"] or i >= resumed]
reference, reference_opt = model_and_optimizer()
train(reference, reference_opt, kept)
same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
steps = {int(s["step"]) for s in opt.state_dict()["state"].values()}
print(json.dumps({"record": record, "same": same, "adam_steps": sorted(steps), "kept": len(kept)}))
"""


def test_the_torch_policy_rolls_back_behind_the_loop_door_with_lightning_never_imported() -> None:
    """``gradkit.SpikeRollback`` behind ``GradKit`` in a fresh interpreter: no Lightning module is ever
    loaded, and after a rollback (two spiking steps, the snapshot of step 6 restored, one batch stepped over) the
    model, BatchNorm statistics included, equals bitwise a hand-written loop that trained only on the kept batches,
    and Adam's step count is the number of kept batches."""
    import json

    out = json.loads(run_without_lightning(_NO_LIGHTNING_ROLLBACK, timeout=300).strip().splitlines()[-1])
    record = out["record"]
    assert (record["step"], record["from_step"], record["to_step"], record["spike_start"]) == (8, 9, 6, 7)
    assert out["kept"] == 8 and out["adam_steps"] == [8]
    assert out["same"]
