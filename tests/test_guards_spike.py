"""SpikeGuard and its NaN-masked running statistics: the statistics against direct formulas, the decisions against
a hand-written z-score loop over the logged values, skip/raise/warn with the real Trainer, and exact resume."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import Tensor

from gradkit.step.running import HostMoments, RunningMoments, ema_update, spike_decision, std_of
from helpers import MLPModule, column, loader, make_trainer, read_metrics
from lightning_gradkit import ManualAccumulator, NonFiniteGuard, SpikeGuard
from test_guards import FaultModule, events, state_equal

NAN = float("nan")


# -- running statistics ------------------------------------------------------------------------------------------
def test_ema_starts_as_the_exact_mean_and_population_variance() -> None:
    xs = torch.randn(20, dtype=torch.float64)
    stats = RunningMoments(alpha=0.9)  # 1 / (1 - alpha) = 10 values of equal weight first
    stats.to(torch.device("cpu"))
    stats.mean, stats.var, stats.count = (t.double() for t in stats.moments())
    for i, x in enumerate(xs[:10]):
        stats.update(x)
        ref = xs[: i + 1]
        torch.testing.assert_close(stats.mean, ref.mean())
        torch.testing.assert_close(stats.var, ref.var(unbiased=False))


def test_ema_after_warmup_matches_the_exponential_recurrence() -> None:
    xs = [float(v) for v in torch.randn(40, dtype=torch.float64)]
    alpha = 0.8
    m, v, n = (torch.zeros((), dtype=torch.float64) for _ in range(3))
    mean, var = 0.0, 0.0
    for i, x in enumerate(xs):
        m, v, n = ema_update(m, v, n, torch.tensor(x, dtype=torch.float64), alpha)
        w = max(1.0 / (i + 1), 1 - alpha)
        delta = x - mean
        mean, var = mean + w * delta, (1 - w) * (var + w * delta * delta)  # West (1979) / Finch (2009)
    assert m.item() == pytest.approx(mean, rel=1e-12) and v.item() == pytest.approx(var, rel=1e-12)


@pytest.mark.parametrize("make", [lambda: RunningMoments(0.9), lambda: HostMoments(0.9), lambda: HostMoments(0.9, 5)])
def test_non_finite_values_change_nothing(make: Any) -> None:
    clean, masked = make(), make()

    def feed(stats: Any, x: Tensor) -> None:
        stats.record(float(x), False, 6.0) if isinstance(stats, HostMoments) else stats.update(x)

    values = torch.randn(12)
    for i, x in enumerate(values):
        feed(clean, x)
        feed(masked, x)
        if i % 3 == 0:
            feed(masked, torch.tensor(NAN if i % 2 else math.inf))
    for a, b in zip(clean.moments(), masked.moments(), strict=True):
        assert a == b if isinstance(a, (int, float)) else torch.equal(a, b)


def test_window_holds_the_last_finite_values() -> None:
    stats = HostMoments(0.9, window=4)
    values = [1.0, 2.0, NAN, 3.0, 4.0, 5.0, math.inf, 6.0]
    for x in values:
        stats.record(x, False, 6.0)
    mean, var, count = stats.moments()
    ref = torch.tensor([3.0, 4.0, 5.0, 6.0], dtype=torch.float64)
    assert count == 4 and mean == ref.mean().item() and var == pytest.approx(ref.var(unbiased=False).item())
    clone = HostMoments(0.9, window=4)
    clone.load_state_dict(stats.state_dict())  # the ring buffer round-trips: the same window, in order
    assert clone.moments() == stats.moments()


def test_host_ema_is_the_device_ema_in_float64() -> None:
    """The host statistics follow :func:`ema_update`'s recurrence (West 1979 / Finch 2009) value for value."""
    alpha = 0.8
    host = HostMoments(alpha)
    m, v, n = (torch.zeros((), dtype=torch.float64) for _ in range(3))
    for x in torch.randn(40, dtype=torch.float64):
        m, v, n = ema_update(m, v, n, x, alpha)
        host.record(float(x), False, 6.0)
    mean, var, count = host.moments()
    assert mean == pytest.approx(m.item(), rel=1e-12) and var == pytest.approx(v.item(), rel=1e-12) and count == 40


def test_spike_decision_thresholds_z_and_clamps_the_recorded_value() -> None:
    mean, var, count = torch.tensor(1.0), torch.tensor(0.04), torch.tensor(30.0)
    spike, z, record, std = spike_decision(torch.tensor(2.3), mean, var, count, z_threshold=6.0, warmup=25)
    assert bool(spike) and z.item() == pytest.approx(6.5) and record.item() == pytest.approx(1.0 + 6 * 0.2)
    assert std.item() == pytest.approx(0.2)
    spike, z, record, _ = spike_decision(torch.tensor(2.3), mean, var, torch.tensor(3.0), z_threshold=6.0, warmup=25)
    assert not bool(spike) and z.item() == 0.0 and record.item() == pytest.approx(2.3)  # still warming up
    spike, _, _, _ = spike_decision(torch.tensor(NAN), mean, var, count, z_threshold=6.0, warmup=25)
    assert not bool(spike)
    assert std_of(torch.tensor(5.0), torch.tensor(0.0)).item() > 0


# -- with the Trainer --------------------------------------------------------------------------------------------
class SpikyModule(FaultModule):
    """SGD on the MLP; the loss of batch ``spike_at`` is multiplied by 50 (a spike, not a non-finite value)."""

    def __init__(self, spike_at: int | None = 9, factor: float = 50.0) -> None:
        super().__init__(None, optimizer="sgd", lr=0.05)
        self.spike_at = spike_at
        self.factor = factor
        self.losses: list[Tensor] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.trainer.fit_loop.total_batch_idx == self.spike_at:
            loss = loss * self.factor
        self.losses.append(loss.detach())
        return loss


def reference_spikes(values: list[float], z: float, alpha: float, warmup: int, floor: float = 1.0) -> list[int]:
    """A hand-written float64 loop of the documented rule: EMA (Welford first), z > threshold and a rise of more than
    ``floor`` times the mean's magnitude, a spike's update clamped."""
    mean = var = 0.0
    spikes = []
    for step, x in enumerate(values):
        std = max(math.sqrt(max(var, 0.0)), abs(mean) * 1e-6 + 1e-12)
        spike = step >= warmup and (x - mean) / std > z and x - mean > floor * abs(mean)
        if spike:
            spikes.append(step)
        record = min(x, mean + z * std) if spike else x
        n = step + 1
        w = max(1.0 / n, 1 - alpha)
        delta = record - mean
        mean, var = mean + w * delta, (1 - w) * (var + w * delta * delta)
    return spikes


def run(tmp_path: Path, guard: SpikeGuard, model: SpikyModule | None = None, **kwargs: Any):
    torch.manual_seed(0)
    model = model or SpikyModule()
    kwargs.setdefault("strategy", "gradkit")
    trainer = make_trainer(tmp_path, callbacks=[guard], **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader(n=128))
    return model, trainer, [str(w.message) for w in caught if "SpikeGuard" in str(w.message)]


def test_warn_flags_exactly_the_steps_a_reference_z_score_loop_flags(tmp_path: Path) -> None:
    guard = SpikeGuard("loss", z_threshold=4.0, alpha=0.9, warmup_steps=5, action="warn")
    model, trainer, warned = run(tmp_path, guard, log_every_n_steps=4)
    losses = [v.item() for v in model.losses]
    assert len(losses) == 16
    expected = reference_spikes(losses, 4.0, 0.9, 5)
    assert expected[0] == 9  # the planted spike (the applied update makes step 10 spike as well)
    # Counted on device, reported on the logging steps 3, 7, 11, 15: one event per period with spikes.
    periods = {}
    for step in expected:
        periods.setdefault(step // 4, []).append(step)
    found = events(trainer)
    assert [(e["step"], e["last_step"], e["values"]["spikes"]) for e in found] == [
        (steps[0], steps[-1], len(steps)) for steps in periods.values()
    ]
    assert found[0]["what"] == "loss_spike" and found[0]["values"]["value"] == pytest.approx(losses[9], rel=1e-5)
    assert len(warned) == len(periods) and "loss spike at" in warned[0] and "gradkit_events.jsonl" in warned[0]


def test_grad_norm_spike_is_skipped_exactly(tmp_path: Path) -> None:
    guard = SpikeGuard("grad_norm", z_threshold=4.0, warmup_steps=5, action="skip")
    model, trainer, warned = run(tmp_path, guard)
    assert state_equal(model.snapshots[9], model.snapshots[10])
    assert column(read_metrics(trainer), "gradkit/skipped_steps")[-1] == 1.0
    (event,) = events(trainer)
    assert event["what"] == "grad_norm_spike" and event["step"] == 9 and event["culprit"] is not None
    assert len(warned) == 1 and "The update was skipped" in warned[0]


def test_fused_adam_spike_skip_under_fp16_gradscaler(tmp_path: Path) -> None:
    """A finite spike does not trip the GradScaler: only the guard's flag, passed as ``found_inf`` together with
    the scaler's, keeps the fused kernel from stepping."""
    model = SpikyModule()
    model.optimizer_name, model.fused, model.lr = "adam", True, 0.01
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    guard = SpikeGuard("loss", z_threshold=4.0, warmup_steps=5, action="skip")
    model, trainer, warned = run(
        tmp_path, guard, model=model, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    )
    assert state_equal(model.snapshots[9], model.snapshots[10])
    assert not state_equal(model.snapshots[8], model.snapshots[9])
    assert scaler.get_scale() == 2.0**8  # the scaler itself never skipped
    assert [e["step"] for e in events(trainer)] == [9] and len(warned) == 1


def test_raise_stops_before_the_spiky_update(tmp_path: Path) -> None:
    guard = SpikeGuard("loss", z_threshold=4.0, warmup_steps=5, action="raise")
    model = SpikyModule()
    with pytest.raises(RuntimeError, match="loss spike at step 9"):
        run(tmp_path, guard, model=model, strategy="auto")
    assert all(torch.equal(p, model.snapshots[9][0][n]) for n, p in model.named_parameters())


def test_spike_guard_and_nonfinite_guard_compose(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = SpikyModule()
    guards = [SpikeGuard("loss", z_threshold=4.0, warmup_steps=5, action="skip"), NonFiniteGuard()]
    trainer = make_trainer(tmp_path, strategy="gradkit", callbacks=guards)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader(n=128))
    assert column(read_metrics(trainer), "gradkit/skipped_steps")[-1] == 1.0
    assert state_equal(model.snapshots[9], model.snapshots[10])


# -- resume ---------------------------------------------------------------------------------------------------------
def test_resumed_run_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    """Epoch 2 holds the spike; its detection depends on statistics restored from the epoch-1 checkpoint."""

    def guard() -> SpikeGuard:
        return SpikeGuard("loss", z_threshold=4.0, window=12, warmup_steps=5, action="skip")

    def module() -> SpikyModule:
        torch.manual_seed(0)
        return SpikyModule(spike_at=11)

    straight = module()
    g_straight = guard()
    run(tmp_path / "a", g_straight, model=straight, max_epochs=2)

    first = module()
    trainer = run(tmp_path / "b", guard(), model=first, max_epochs=1)[1]
    ckpt = tmp_path / "epoch1.ckpt"
    trainer.save_checkpoint(ckpt)

    resumed = module()
    g_resumed = guard()
    trainer = make_trainer(tmp_path / "c", strategy="gradkit", callbacks=[g_resumed], max_epochs=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(resumed, loader(n=128), ckpt_path=ckpt)

    for (name, a), b in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert state_equal(straight.snapshots[3], resumed.snapshots[3])  # batch 3 of epoch 2 (step 11): the spike
    sa, sb = g_straight.state_dict(), g_resumed.state_dict()
    assert sa["skipped_steps"] == sb["skipped_steps"] == 1.0 and sa["spikes"] == sb["spikes"] == 1
    assert sa["stats"].keys() == sb["stats"].keys() == {0}  # one optimizer: its statistics
    for key in sa["stats"][0]:
        assert torch.equal(sa["stats"][0][key], sb["stats"][0][key]), key


def test_resume_without_restored_statistics_would_differ(tmp_path: Path) -> None:
    """The resume test can fail: a fresh guard in epoch 2 is still warming up and misses the spike."""
    torch.manual_seed(0)
    model = SpikyModule(spike_at=3)  # the spike is batch 3 of a fresh run: inside a fresh guard's warm-up
    _, trainer, _ = run(tmp_path, SpikeGuard("loss", z_threshold=4.0, window=12, warmup_steps=5, action="skip"), model)
    assert events(trainer) == []


# -- arguments ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"monitor": "accuracy"}, "monitor"),
        ({"action": "skip_batch"}, "action"),
        ({"z_threshold": 0.0}, "z_threshold"),
        ({"z_threshold": -1.0}, "z_threshold"),
        ({"alpha": 1.0}, "alpha"),
        ({"alpha": 0.0}, "alpha"),
        ({"window": 0}, "window"),
        ({"window": 10, "warmup_steps": 25}, "window"),
        ({"warmup_steps": 1}, "warmup_steps"),
        ({"relative_floor": -0.1}, "relative_floor"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=f"`{argument}`"):
        SpikeGuard(**kwargs)


def test_skip_on_a_plain_strategy_fails_at_setup(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[SpikeGuard(action="skip")])
    with pytest.raises(RuntimeError, match=r'strategy="gradkit"'):
        trainer.fit(SpikyModule(), loader())


def test_load_state_dict_refuses_a_different_statistic() -> None:
    state = SpikeGuard(window=30).state_dict()
    with pytest.raises(ValueError, match="same arguments"):
        SpikeGuard().load_state_dict(state)


# -- the monitored loss under gradient accumulation ----------------------------------------------------------------
class RecordedLosses(MLPModule):
    """Records every micro-batch loss as ``training_step`` computes it; ``constant`` makes each one exactly 1.0."""

    def __init__(self, constant: bool = False, manual_window: int | None = None) -> None:
        super().__init__()
        self.constant = constant
        self.losses: list[float] = []
        self.accumulator = ManualAccumulator(manual_window) if manual_window else None
        self.automatic_optimization = manual_window is None

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        loss = super().training_step(batch, batch_idx)
        if self.constant:
            loss = loss * 0.0 + 1.0
        self.losses.append(loss.item())
        if self.accumulator is None:
            return loss
        if self.accumulator.backward(self, loss, batch_idx):
            self.accumulator.step(self.optimizers())
        return None


def window_means(losses: list[float], window: int) -> list[float]:
    return [sum(part) / len(part) for part in (losses[i : i + window] for i in range(0, len(losses), window))]


@pytest.mark.parametrize(
    ("constant", "precision", "manual"),
    [(True, "32", False), (False, "32", False), (False, "16-mixed", False), (False, "32", True)],
    ids=["constant-loss", "fp32", "16-mixed", "manual-accumulator"],
)
def test_loss_monitor_records_the_mean_of_each_window_including_the_short_last_one(
    tmp_path: Path, constant: bool, precision: str, manual: bool
) -> None:
    guard = SpikeGuard("loss", window=16, warmup_steps=16)  # warming up all along: every value recorded unclamped
    model = RecordedLosses(constant=constant, manual_window=4 if manual else None)
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))] if precision != "32" else None
    accumulate = 1 if manual else 4
    trainer = make_trainer(tmp_path, callbacks=[guard], accumulate_grad_batches=accumulate, plugins=plugins)
    trainer.fit(model, loader(n=80))  # 10 batches: windows of 4, 4 and 2
    recorded = guard.state_dict()["stats"][0]["values"][:3].tolist()
    assert len(model.losses) == 10
    assert recorded == pytest.approx(window_means(model.losses, 4), rel=1e-6)


# -- a near-converged, flat loss (issue 33) ---------------------------------------------------------------------------
def flat_loss_run(values: list[float], **guard_args: Any) -> list[int]:
    """The loop door fed ``values`` as the losses (a model that is not the point); the steps a ``SpikeGuard(loss,
    action="skip")`` skipped."""
    from gradkit.doors.loop import GradKit

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    kit = GradKit(model, optimizer, SpikeGuard("loss", action="skip", **guard_args), log_dir=False)
    skipped = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the spike warnings: the skipped steps say it
        for step, value in enumerate(values):
            model(torch.ones(1, 2)).sum().backward()
            kit.note_loss(torch.tensor(value))
            if not kit.step(optimizer):
                skipped.append(step)
            optimizer.zero_grad(set_to_none=True)
    return skipped


def test_a_flat_near_converged_loss_does_not_alarm_and_a_real_spike_still_does() -> None:
    """The issue's case: a loss near 0.0032 with a standard deviation of about 0.0003, then 0.0055 (6.2 to 7.7
    standard deviations above the mean, 1.7 times the mean): ordinary noise, not a spike, by default; 0.05 (15x) is."""
    flat = [0.0032 + 0.0003 * (-1) ** step for step in range(60)]
    noise, spike = 60, 61
    values = [*flat, 0.0055, 0.05, *flat[:5]]
    assert reference_spikes(values, 6.0, 0.97, 25, floor=0.0)[:1] == [noise]  # the z-score alone: an alarm
    assert flat_loss_run(values, relative_floor=0.0)[:1] == [noise]
    assert reference_spikes(values, 6.0, 0.97, 25) == [spike]
    assert flat_loss_run(values) == [spike]  # the default floor (1.0): the noise passes, the spike is skipped


# -- several optimizers (issue 39) ------------------------------------------------------------------------------------
def reference_skipping(values: list[float], z: float, alpha: float, warmup: int) -> tuple[list[int], float, float]:
    """The documented rule with ``action="skip"``, by hand in float64: as :func:`reference_spikes`, but a skipped
    spike is not recorded at all (the statistics are the run's without that batch). The spikes, the mean and the
    variance at the end."""
    mean = var = 0.0
    n = 0
    spikes = []
    for step, x in enumerate(values):
        std = max(math.sqrt(max(var, 0.0)), abs(mean) * 1e-6 + 1e-12)
        if n >= warmup and (x - mean) / std > z and x - mean > abs(mean):
            spikes.append(step)
            continue
        n += 1
        w = max(1.0 / n, 1 - alpha)
        delta = x - mean
        mean, var = mean + w * delta, (1 - w) * (var + w * delta * delta)
    return spikes, mean, var


def test_each_optimizer_is_compared_with_its_own_statistics() -> None:
    """The issue's case: two optimizers whose losses are about 1 and about 40, the first's 8 times as large at step
    40. The per-optimizer rule by hand on each stream skips that step; one statistic for both streams (the values
    interleaved, as the guard kept them before) sees nothing. The guard skips what the per-optimizer rule skips, and
    saves each optimizer's statistics as the rule computes them."""
    from gradkit.doors.loop import GradKit

    gen = torch.Generator().manual_seed(0)
    first = 1.0 + 0.05 * torch.randn(60, generator=gen)  # float32, as the losses handed over
    second = 40.0 + 2.0 * torch.randn(60, generator=gen)
    first[40] *= 8.0
    first, second = first.tolist(), second.tolist()
    interleaved = [v for pair in zip(first, second, strict=True) for v in pair]
    assert reference_spikes(interleaved, 6.0, 0.97, 25) == []  # one statistic for both: the spike goes unseen
    expected = [reference_skipping(values, 6.0, 0.97, 25) for values in (first, second)]
    assert [spikes for spikes, _, _ in expected] == [[40], []]

    models = torch.nn.ModuleList([torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)])
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.0) for m in models]
    guard = SpikeGuard("loss", action="skip")
    kit = GradKit(models, optimizers, guard, log_dir=False)
    skipped: list[list[int]] = [[], []]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the spike's warning: the skipped steps say it
        for step in range(60):
            for i, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
                model(torch.ones(1, 2)).sum().backward()
                kit.note_loss(torch.tensor((first, second)[i][step]))
                if not kit.step(optimizer):
                    skipped[i].append(step)
                optimizer.zero_grad(set_to_none=True)
    assert skipped == [[40], []]
    saved = guard.state_dict()["stats"]
    assert sorted(saved) == [0, 1]
    for i, (_, mean, var) in enumerate(expected):
        # The same float64 operations on the same float32 values: equal to the last bit.
        assert (float(saved[i]["mean"]), float(saved[i]["var"]), int(saved[i]["count"])) == (mean, var, 59 + i)
