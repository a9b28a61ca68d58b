"""One engine, three front doors: the Trainer callbacks, Lightning Fabric and a plain PyTorch loop give the same
parameters, buffers, logged norms and skip decisions, bitwise, for the same model, data and seed.

The references are independent of each other: the Trainer runs its own loop (closure, hooks, strategy gate), Fabric
its strategy's ``optimizer_step`` and precision plugin, the plain loop nothing but ``torch``. A plain loop with
``torch.nn.utils.clip_grad_norm_`` and a hand-written skip pins down that all three compute the right thing, not
only the same thing.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import Logger as FabricLogger
from lightning.pytorch.loggers import Logger
from torch import Tensor, nn
from torch.utils.data import DataLoader

from gradkit.doors.loop import GradKit
from helpers import count_syncs, launched_in_process, make_trainer
from lightning_gradkit import (
    AccumulationGuard,
    ActivationCheckpointing,
    ClipGradNorm,
    GradNormMonitor,
    NonFiniteGuard,
    SpikeGuard,
    SpikeRollback,
    ZClip,
)
from lightning_gradkit.trainer_door import TrainerPipeline

pytestmark = pytest.mark.filterwarnings("ignore:NonFiniteGuard:UserWarning", "ignore:SpikeGuard:UserWarning")

NAN_BATCH = 5
BATCHES = 12


def _build(module: nn.Module) -> None:
    module.encoder = nn.Linear(8, 16)
    module.norm = nn.BatchNorm1d(16)
    module.head = nn.Linear(16, 1)


def _forward(module: Any, x: Tensor) -> Tensor:
    return module.head(torch.relu(module.norm(module.encoder(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        _build(self)

    def forward(self, x: Tensor) -> Tensor:
        return _forward(self, x)


class NetModule(pl.LightningModule):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        _build(self)
        self.optimizer_name = optimizer

    def forward(self, x: Tensor) -> Tensor:
        return _forward(self, x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _optimizer(self.optimizer_name, self.parameters())


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adam_fused":
        return torch.optim.Adam(params, lr=0.05, fused=True)
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def _batches() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(BATCHES):
        x = torch.randn(8, 8, generator=g) * (1.0 + 2.0 * (i % 4 == 3))  # some steps clip, some do not
        y = torch.randn(8, 1, generator=g)
        if i == NAN_BATCH:
            x[2, 3] = math.nan
        out.append((x, y))
    return out


def _fp16_plain_loop(model: nn.Module, opt: torch.optim.Optimizer, kit: GradKit, scaler: torch.amp.GradScaler) -> None:
    """The plain door's fp16 loop on CPU: autocast, the scaler's scaled backward, ``kit.step`` (which steps the
    scaler)."""
    model.train()
    for x, y in _batches():
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        kit.note_loss(loss)
        kit.step(opt)
        opt.zero_grad(set_to_none=True)


def _initial_state() -> dict[str, Tensor]:
    torch.manual_seed(0)
    return copy.deepcopy(Net().state_dict())


def _policies(clipper: str) -> list[Any]:
    clip = ZClip(alpha=0.9, z_threshold=1.5, warmup_steps=3) if clipper == "zclip" else ClipGradNorm(max_norm=0.5)
    return [
        GradNormMonitor(depth=1),
        clip,
        NonFiniteGuard(action="skip"),
        SpikeGuard(monitor="loss", warmup_steps=3, z_threshold=2.0, action="warn"),
    ]


class _Recording:
    """Keeps every logged row: the part a Lightning and a Fabric logger share here."""

    rows: list[dict[str, float]]

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append(dict(metrics))


class RecordingLogger(_Recording, Logger):
    """A Lightning logger that keeps every logged row."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = []


class RecordingFabricLogger(_Recording, FabricLogger):
    """A Fabric logger that keeps every logged row (``fabric.log_dict`` reaches it)."""

    def __init__(self) -> None:
        self.rows = []


def _series(rows: list[dict[str, float]]) -> dict[str, list[float]]:
    """Every gradkit key's values in logging order (Lightning adds ``epoch``; only gradkit's keys compare)."""
    out: dict[str, list[float]] = {}
    for row in rows:
        for key, value in row.items():
            if key.split("/")[0] in ("grad_norm", "grad_clip", "gradkit"):
                out.setdefault(key, []).append(float(value))
    return out


def run_trainer(tmp_path: Path, clipper: str, optimizer: str) -> tuple[dict[str, Tensor], dict[str, list[float]]]:
    module = NetModule(optimizer)
    module.load_state_dict(_initial_state())
    logger = RecordingLogger()
    trainer = make_trainer(
        tmp_path,
        default_root_dir=tmp_path,  # the guards' event file: the recording logger has no directory
        strategy="gradkit",
        callbacks=_policies(clipper),
        logger=logger,
        max_steps=BATCHES,
    )
    trainer.fit(module, DataLoader(_batches(), batch_size=None))
    return module.state_dict(), _series(logger.rows)


def _train_plain(model: nn.Module, opt: torch.optim.Optimizer, kit: GradKit) -> None:
    """The plain loop over the test's batches: forward, backward, the door's step, zero_grad."""
    model.train()
    for x, y in _batches():
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        kit.note_loss(loss)
        kit.step(opt)
        opt.zero_grad(set_to_none=True)


def run_plain(clipper: str, optimizer: str) -> tuple[dict[str, Tensor], dict[str, list[float]]]:
    model = Net()
    model.load_state_dict(_initial_state())
    opt = _optimizer(optimizer, model.parameters())
    rows: list[dict[str, float]] = []
    kit = GradKit(
        model,
        opt,
        _policies(clipper),
        log=lambda metrics, step: rows.append(metrics),
        log_every_n_steps=1,
        max_steps=BATCHES,
    )
    _train_plain(model, opt, kit)
    kit.finish()
    return model.state_dict(), _series(rows)


def run_fabric(
    clipper: str, optimizer: str, strategy: str = "auto"
) -> tuple[dict[str, Tensor], dict[str, list[float]]]:
    logger = RecordingFabricLogger()
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, loggers=[logger])
    if strategy != "auto":
        with launched_in_process(fabric):
            return _fabric_loop(fabric, logger, clipper, optimizer)
    return _fabric_loop(fabric, logger, clipper, optimizer)


def _fabric_loop(
    fabric: Fabric, logger: RecordingFabricLogger, clipper: str, optimizer: str
) -> tuple[dict[str, Tensor], dict[str, list[float]]]:
    net = Net()
    net.load_state_dict(_initial_state())
    model, opt = fabric.setup(net, _optimizer(optimizer, net.parameters()))
    kit = GradKit(model, opt, _policies(clipper), fabric=fabric, log_every_n_steps=1, max_steps=BATCHES)
    model.train()
    for x, y in _batches():
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        kit.note_loss(loss)
        kit.step(opt)
        opt.zero_grad(set_to_none=True)
    kit.finish()
    return net.state_dict(), _series(logger.rows)


def run_reference(clipper: str, optimizer: str) -> dict[str, Tensor]:
    """Plain PyTorch without gradkit: ``clip_grad_norm_``, and the NaN batch left out with the buffers it wrote."""
    assert clipper == "norm"
    model = Net()
    model.load_state_dict(_initial_state())
    opt = _optimizer(optimizer, model.parameters())
    model.train()
    for i, (x, y) in enumerate(_batches()):
        if i == NAN_BATCH:
            continue
        nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.state_dict()


def _assert_same_state(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize(("clipper", "optimizer"), [("norm", "sgd"), ("zclip", "sgd"), ("norm", "adam_fused")])
def test_three_doors_give_the_same_parameters_logs_and_skips(tmp_path: Path, clipper: str, optimizer: str) -> None:
    trainer_state, trainer_logs = run_trainer(tmp_path, clipper, optimizer)
    plain_state, plain_logs = run_plain(clipper, optimizer)
    fabric_state, fabric_logs = run_fabric(clipper, optimizer)

    # Parameters and BatchNorm statistics (the NaN batch's writes put back), bitwise.
    _assert_same_state(plain_state, trainer_state)
    _assert_same_state(fabric_state, trainer_state)
    assert all(torch.isfinite(v).all() for v in trainer_state.values() if v.is_floating_point())

    # Logged norms, clip values and skip counts: the same keys, the same values in the same order.
    assert trainer_logs.keys() == plain_logs.keys() == fabric_logs.keys()
    for key in ("grad_norm/total", "grad_norm/module/encoder", "grad_clip/pre_clip_norm", "grad_clip/coef"):
        assert len(trainer_logs[key]) == BATCHES, key
    for key, values in trainer_logs.items():
        assert plain_logs[key] == pytest.approx(values, nan_ok=True, rel=0, abs=0), key
        assert fabric_logs[key] == pytest.approx(values, nan_ok=True, rel=0, abs=0), key
    assert math.isnan(trainer_logs["grad_norm/total"][NAN_BATCH])
    # The skip decision: the count steps from 0 to 1 at the NaN batch, on the fused (device-only) path too.
    skipped = trainer_logs["gradkit/skipped_steps"]
    assert skipped[NAN_BATCH - 1 : NAN_BATCH + 1] == [0.0, 1.0] and skipped[-1] == 1.0
    clipped = trainer_logs["grad_clip/coef"]
    assert min(c for c in clipped if not math.isnan(c)) < 1.0  # the clipper acted on some steps


def test_plain_door_equals_a_hand_written_loop_with_clip_grad_norm(tmp_path: Path) -> None:
    plain_state, _ = run_plain("norm", "sgd")
    reference = run_reference("norm", "sgd")
    for key, value in reference.items():
        if key.endswith("num_batches_tracked"):
            # gradkit puts back the skipped batch's counter too, as the reference never saw that batch.
            assert plain_state[key] == value
            continue
        torch.testing.assert_close(plain_state[key], value, rtol=1e-6, atol=1e-7)


def test_door_refuses_trainer_only_callbacks_and_classes() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="AccumulationGuard works only as a Lightning Trainer callback"):
        GradKit(model, opt, [AccumulationGuard()])
    with pytest.raises(TypeError, match="takes no part in the optimizer step's pipeline"):
        GradKit(model, opt, [ActivationCheckpointing(targets=["Linear"])])
    with pytest.raises(TypeError, match="holds the class `ZClip`"):
        GradKit(model, opt, [ZClip])
    with pytest.raises(ValueError, match="2 gradient clippers"):
        GradKit(model, opt, [ZClip(), ClipGradNorm(1.0)])
    with pytest.raises(ValueError, match=r"GradNormMonitor\(report=True\) writes .* pass `GradKit\(\.\.\., log_dir="):
        GradKit(model, opt, [GradNormMonitor(report=True)], log_dir=False)
    with pytest.raises(ValueError, match=r"GradNormMonitor\(prog_bar=True\) .* progress bar, which this loop does not"):
        GradKit(model, opt, [GradNormMonitor(prog_bar=True)])
    with pytest.raises(ValueError, match="`log_every_n_steps` must be an integer >= 0, got -1"):
        GradKit(model, opt, [GradNormMonitor()], log_every_n_steps=-1)


@pytest.mark.parametrize(("optimizer", "reads"), [("adam_fused", 0), ("sgd", 1)])
def test_door_step_syncs_only_to_read_the_skip_of_an_ordinary_optimizer(optimizer: str, reads: int) -> None:
    model = Net()
    model.load_state_dict(_initial_state())
    opt = _optimizer(optimizer, model.parameters())
    policies = [GradNormMonitor(depth=1), ClipGradNorm(max_norm=0.5), NonFiniteGuard(action="skip")]
    kit = GradKit(model, opt, policies, log=lambda metrics, step: None, log_every_n_steps=1000)
    with count_syncs() as counter:
        per_step = counter.watch_per_call(kit, "step")
        counter.watch(kit, "note_loss")
        _train_plain(model, opt, kit)
    # Step 0 logs the monitor's first values (one transfer), and a fused optimizer's first step, which creates its
    # state, reads the skip flag to drop that state if the step was skipped (torch keeps it). The skipped NaN step of
    # an ordinary optimizer is reported at the step (its host reads). Every other step: the one read of the skip
    # flag, or none when fused.
    quiet = [n for i, n in enumerate(per_step) if i not in (0, NAN_BATCH)]
    assert quiet == [reads] * (BATCHES - 2), per_step
    assert per_step[0] == 2
    if optimizer == "adam_fused":
        assert counter.total == 2 and per_step[NAN_BATCH] == 0  # skipped on device, reported at `finish`
    assert kit.skipped_steps == 1


# -- rollback behind every door --------------------------------------------------------------------------------------
SPIKE = (7, 8, 9)  # three steps with a loss spike: SpikeRollback(patience=3) rolls back at the third


def _spike_batches() -> list[tuple[Tensor, Tensor]]:
    batches = [(x.nan_to_num(0.0), y) for x, y in _batches()] + _batches()[:4]
    return [(x * 30.0, y * 30.0) if i in SPIKE else (x, y) for i, (x, y) in enumerate(batches)]


def _rollback() -> SpikeRollback:
    return SpikeRollback(
        monitor="loss", z_threshold=3.0, warmup_steps=3, patience=3, snapshot_every_n_steps=2, keep=2, skip_batches=1
    )


def _scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.95)


class ScheduledNetModule(NetModule):
    def configure_optimizers(self) -> Any:
        opt = _optimizer(self.optimizer_name, self.parameters())
        return {"optimizer": opt, "lr_scheduler": {"scheduler": _scheduler(opt), "interval": "step"}}


@pytest.mark.filterwarnings("ignore:SpikeRollback:UserWarning")
def test_rollback_behind_the_three_doors_restores_the_same_state(tmp_path: Path) -> None:
    batches = _spike_batches()
    steps = len(batches)

    module = ScheduledNetModule("sgd")
    module.load_state_dict(_initial_state())
    trainer_rollback = _rollback()
    trainer = make_trainer(
        tmp_path,
        default_root_dir=tmp_path,
        strategy="gradkit",
        callbacks=[trainer_rollback],
        logger=False,
        max_steps=steps,
    )
    trainer.fit(module, DataLoader(batches, batch_size=None))

    def loop(fabric: Fabric | None) -> tuple[dict[str, Tensor], SpikeRollback, float]:
        net = Net()
        net.load_state_dict(_initial_state())
        opt = _optimizer("sgd", net.parameters())
        sched = _scheduler(opt)
        model: nn.Module = net
        if fabric is not None:
            model, opt = fabric.setup(net, opt)
        rollback = _rollback()
        kit = GradKit(model, opt, [rollback], schedulers=sched, fabric=fabric)
        model.train()
        for x, y in batches:
            loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss) if fabric is not None else loss.backward()
            kit.note_loss(loss)
            kit.step(opt)
            opt.zero_grad(set_to_none=True)
        return net.state_dict(), rollback, sched.get_last_lr()[0]

    torch.manual_seed(0)
    plain_state, plain_rollback, plain_lr = loop(None)
    torch.manual_seed(0)
    fabric_state, fabric_rollback, fabric_lr = loop(Fabric(accelerator="cpu", devices=1))

    history = trainer_rollback.state_dict()["history"]
    assert trainer_rollback.rollbacks == 1 and history[0]["to_step"] <= SPIKE[0]
    for other in (plain_rollback, fabric_rollback):
        assert other.state_dict()["history"] == history
    _assert_same_state(plain_state, module.state_dict())
    _assert_same_state(fabric_state, module.state_dict())
    # The scheduler was rewound with the rest and held on the skipped steps: its LR follows the applied steps.
    trainer_lr = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]
    assert plain_lr == fabric_lr == trainer_lr
    record = history[0]
    # Applied: the steps before the restored snapshot, then the batches after the rollback and the stepped-over ones.
    applied = record["to_step"] + steps - record["from_step"] - record["skip_batches"]
    assert trainer_lr == pytest.approx(0.2 * 0.95**applied, rel=1e-12)


def test_fabric_door_launched_in_process_under_a_distributed_strategy_equals_the_plain_door() -> None:
    """Fabric's DDP on one CPU device, launched in this process (as the CUDA test launches FSDP, which needs a GPU:
    both refuse ``setup_module`` before ``launch()``): the same parameters, buffers and logs as the plain loop, and
    the process group and environment of the launch are gone afterwards."""
    environ = dict(os.environ)
    fabric_state, fabric_logs = run_fabric("norm", "sgd", strategy="ddp")
    assert not torch.distributed.is_initialized() and dict(os.environ) == environ
    plain_state, plain_logs = run_plain("norm", "sgd")
    _assert_same_state(fabric_state, plain_state)
    assert fabric_logs.keys() == plain_logs.keys()
    for key, values in plain_logs.items():
        assert fabric_logs[key] == pytest.approx(values, nan_ok=True, rel=0, abs=0), key
    assert plain_logs["gradkit/skipped_steps"][-1] == 1.0


# -- fp16 with a GradScaler behind every door ------------------------------------------------------------------------
def _scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**10)


@pytest.mark.parametrize("optimizer", ["sgd", "adam_fused"])
def test_fp16_gradscaler_behind_the_doors_gives_the_same_steps(tmp_path: Path, optimizer: str) -> None:
    from lightning.pytorch.plugins import MixedPrecision

    module = NetModule(optimizer)
    module.load_state_dict(_initial_state())
    logger = RecordingLogger()
    trainer = make_trainer(
        tmp_path,
        default_root_dir=tmp_path,
        strategy="gradkit",
        callbacks=_policies("norm"),
        logger=logger,
        max_steps=BATCHES,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=_scaler())],
    )
    trainer.fit(module, DataLoader(_batches(), batch_size=None))
    trainer_logs = _series(logger.rows)

    model = Net()
    model.load_state_dict(_initial_state())
    opt = _optimizer(optimizer, model.parameters())
    scaler = _scaler()
    rows: list[dict[str, float]] = []
    kit = GradKit(
        model,
        opt,
        _policies("norm"),
        log=lambda metrics, step: rows.append(metrics),
        log_every_n_steps=1,
        max_steps=BATCHES,
        scaler=scaler,
    )
    _fp16_plain_loop(model, opt, kit, scaler)
    plain_logs = _series(rows)

    _assert_same_state(model.state_dict(), module.state_dict())
    assert trainer_logs.keys() == plain_logs.keys()
    for key, values in trainer_logs.items():
        assert plain_logs[key] == pytest.approx(values, nan_ok=True, rel=0, abs=0), key
    # Norms are meant without the loss scale (2**10 here): the same order as the fp32 run's.
    fp32 = run_plain("norm", optimizer)[1]["grad_norm/total"]
    assert plain_logs["grad_norm/total"][0] == pytest.approx(fp32[0], rel=1e-2)
    assert trainer_logs["gradkit/skipped_steps"][-1] >= 1.0


@pytest.mark.parametrize("init_scale", [2.0**10, 2.0**24])
@pytest.mark.parametrize("optimizer", ["sgd", "adam_fused"])
def test_fp16_skipped_steps_count_the_guards_skips_not_the_gradscalers_overflows(
    tmp_path: Path, optimizer: str, init_scale: float
) -> None:
    """``skipped_steps`` counts the steps a gradkit policy skipped (the NaN batch), behind the Trainer and the plain
    door alike; the GradScaler's own overflow skips (provoked by ``init_scale=2**24``: the scale halves until the
    fp16 gradients fit) are the scaler's: not counted, and the BatchNorm statistics of those steps are kept, as
    without gradkit. Reference: the scaler's halvings and the guard's ``fp16_overflow`` events."""
    from lightning.pytorch.plugins import MixedPrecision

    def policies() -> list[Any]:
        return [GradNormMonitor(depth=1), ClipGradNorm(max_norm=0.5), NonFiniteGuard(action="skip")]

    module = NetModule(optimizer)
    module.load_state_dict(_initial_state())
    trainer_scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    trainer = make_trainer(
        tmp_path / "trainer",
        default_root_dir=tmp_path / "trainer",
        strategy="gradkit",
        callbacks=policies(),
        logger=RecordingLogger(),
        max_steps=BATCHES,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=trainer_scaler)],
    )
    trainer.fit(module, DataLoader(_batches(), batch_size=None))
    trainer_events = [
        json.loads(line) for line in next(tmp_path.rglob("gradkit_events.jsonl")).read_text().splitlines()
    ]

    model = Net()
    model.load_state_dict(_initial_state())
    opt = _optimizer(optimizer, model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    kit = GradKit(model, opt, policies(), log_dir=tmp_path / "plain", max_steps=BATCHES, scaler=scaler)
    _fp16_plain_loop(model, opt, kit, scaler)
    kit.finish()
    plain_events = [json.loads(line) for line in (tmp_path / "plain" / "gradkit_events.jsonl").read_text().splitlines()]

    overflows = round(math.log2(init_scale / scaler.get_scale())) - 1  # one halving is the NaN step's
    assert trainer_scaler.get_scale() == scaler.get_scale()
    for events, skipped, state in [
        (trainer_events, TrainerPipeline.of(trainer).skipped_steps, module.state_dict()),
        (plain_events, kit.skipped_steps, model.state_dict()),
    ]:
        if optimizer == "sgd":  # a fused optimizer's guard reports from its device ledger, not step by step
            kinds = [e["what"] for e in events]
            assert kinds.count("fp16_overflow") == overflows and len(kinds) == overflows + 1, kinds
        assert int(skipped) == 1
        assert int(state["norm.num_batches_tracked"]) == BATCHES - 1  # only the NaN step's statistics put back
    assert (overflows > 0) == (init_scale > 2**16)  # the huge initial scale did overflow
    _assert_same_state(model.state_dict(), module.state_dict())


def test_door_event_names_the_micro_batch_with_the_nan_loss(tmp_path: Path) -> None:
    """With accumulation, the guard's event names the non-finite micro-batch of the window, counted by the door."""
    model = Net()
    model.load_state_dict(_initial_state())
    opt = _optimizer("sgd", model.parameters())
    guard = NonFiniteGuard(action="skip")
    kit = GradKit(model, opt, [guard], log_dir=tmp_path)
    model.train()
    for i, (x, y) in enumerate(_batches()):  # windows of 2 micro-batches: the NaN (batch 5) is the 2nd of window 2
        loss = nn.functional.mse_loss(model(x), y)
        (loss / 2).backward()
        kit.note_loss(loss)
        if i % 2 == 1:
            kit.step(opt)
            opt.zero_grad(set_to_none=True)
    (event,) = [json.loads(line) for line in (tmp_path / "gradkit_events.jsonl").read_text().splitlines()]
    assert event["step"] == NAN_BATCH // 2 and event["batch_idx"] == NAN_BATCH
    assert event["batches"] == [NAN_BATCH - 1, NAN_BATCH]
    assert kit.skipped_steps == 1
