"""gradkit under Lightning's DeepSpeedStrategy: refusals at setup (CPU, no ``deepspeed`` needed), the monitor and
the guard under real DeepSpeed (DeepSpeed's CPU accelerator where the ``deepspeed`` package is installed; CUDA in
the ``gpu`` tests).

Lightning's ``DeepSpeedStrategy`` runs on CUDA only: ``setup_environment`` raises "The DeepSpeed strategy is only
supported on CUDA GPUs" for any other accelerator, and the constructor imports ``deepspeed``. The refusal tests
build Lightning's strategy without DeepSpeed's part (:class:`DeepSpeedBeforeSetup`); the CPU tests lift the CUDA-only
checks only (:class:`CPUDeepSpeed`, ``DS_ACCELERATOR=cpu``).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from torch import Tensor

from helpers import MLPModule, column, loader, read_metrics
from helpers import make_trainer as make_plain_trainer
from lightning_gradkit import (
    AccumulationGuard,
    AdaptiveGradClip,
    AutoClip,
    ClipGradNorm,
    ClipGradValue,
    GradKitStrategyMixin,
    GradNormMonitor,
    NonFiniteGuard,
    SpikeGuard,
    SpikeRollback,
    ZClip,
)


def make_trainer(tmp_path: Path, **kwargs: Any) -> Trainer:
    """``helpers.make_trainer`` in the batch order of ``loader()`` (DeepSpeed's DDP base would shuffle it)."""
    return make_plain_trainer(tmp_path, use_distributed_sampler=False, **kwargs)


HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs the deepspeed package")


class DeepSpeedBeforeSetup(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy up to the callbacks' ``setup``, buildable without the ``deepspeed`` package.

    ``DeepSpeedStrategy.__init__`` imports ``deepspeed`` and ``setup_environment`` refuses a CPU accelerator; this
    subclass keeps ``DDPStrategy``'s constructor and an empty ``setup_environment``, so ``fit`` reaches the callbacks'
    ``setup`` on CPU. It never trains.
    """

    def __init__(self) -> None:
        DDPStrategy.__init__(self)
        self.config: dict[str, Any] = {}

    def setup_environment(self) -> None:
        pass


class SetupReached(Exception):
    pass


class StopAtSetup(Callback):
    """Listed after the gradkit callback: raised once every earlier callback's ``setup`` passed."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        raise SetupReached


def fit_until_setup(tmp_path: Path, callback: Callback, strategy: DeepSpeedStrategy | None = None) -> None:
    trainer = make_trainer(tmp_path, strategy=strategy or DeepSpeedBeforeSetup(), callbacks=[callback, StopAtSetup()])
    trainer.fit(MLPModule(), loader())


REFUSED = [
    (ClipGradNorm(max_norm=1.0), "`ClipGradNorm(max_norm=1.0, norm_type=2.0)`", '"gradient_clipping": 1.0'),
    (ClipGradNorm(max_norm=1.0, norm_type=1.0), "norm_type=1.0", '"gradient_clipping": <max 2-norm>'),
    (ClipGradValue(clip_value=0.5), "`ClipGradValue(clip_value=0.5)`", "no value, adaptive"),
    (AutoClip(), "`AutoClip(...)`", "`gradient_clipping`"),
    (ZClip(), "`ZClip(...)`", "`gradient_clipping`"),
    (AdaptiveGradClip(), "`AdaptiveGradClip(...)`", "`gradient_clipping`"),
    (NonFiniteGuard(action="skip"), "`NonFiniteGuard(action='skip')`", '"loss_scale": 0'),
    (SpikeGuard(action="skip"), "`SpikeGuard(monitor='loss', action='skip')`", '"loss_scale": 0'),
    (SpikeGuard(action="warn"), "`SpikeGuard(monitor='loss', action='warn')`", "`grad_norm/total`"),
    (SpikeRollback(), "`SpikeRollback(...)`", "DeepSpeed has no rollback"),
    (AccumulationGuard(), "`AccumulationGuard(normalize='mean')`", "`gradient_accumulation_steps`"),
    (GradNormMonitor(update_ratio=True), "`GradNormMonitor(update_ratio=True)`", "Leave `update_ratio=False`"),
    (GradNormMonitor(norm_type=1.0), "`GradNormMonitor(norm_type=1.0)`", "Leave `norm_type=2.0`"),
]


@pytest.mark.parametrize(("callback", "setting", "instead"), REFUSED, ids=[r[1] for r in REFUSED])
def test_what_needs_the_step_is_refused_at_setup_naming_the_deepspeed_key(
    tmp_path: Path, callback: Callback, setting: str, instead: str
) -> None:
    with pytest.raises(RuntimeError) as info:
        fit_until_setup(tmp_path, callback)
    message = str(info.value)
    assert setting in message and instead in message, message
    assert "does not work under `DeepSpeedBeforeSetup`" in message


@pytest.mark.parametrize(
    "callback",
    [GradNormMonitor(), NonFiniteGuard(action="warn"), NonFiniteGuard(action="raise")],
    ids=["GradNormMonitor()", "NonFiniteGuard(warn)", "NonFiniteGuard(raise)"],  # stable across processes (xdist)
)
def test_monitor_and_warn_or_raise_guard_pass_setup_under_deepspeed(tmp_path: Path, callback: Callback) -> None:
    with pytest.raises(SetupReached):
        fit_until_setup(tmp_path, callback)


def test_gradkit_strategy_mixin_on_deepspeed_is_refused_when_it_connects(tmp_path: Path) -> None:
    class GradKitDeepSpeed(GradKitStrategyMixin, DeepSpeedBeforeSetup):
        pass

    with pytest.raises(RuntimeError, match=r"`GradKitDeepSpeed` mixes GradKitStrategyMixin into DeepSpeedStrategy"):
        fit_until_setup(tmp_path, GradNormMonitor(), GradKitDeepSpeed())


# -- real DeepSpeed on CPU ---------------------------------------------------------------------------------------------
class CPUDeepSpeed(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy with its CUDA-only checks lifted, to run on DeepSpeed's CPU accelerator.

    Three checks stand in the way on CPU, nothing else: ``setup_environment`` refuses a non-CUDA accelerator,
    ``setup_distributed`` wants CUDA device indices, and ``deepspeed.initialize`` gets ``root_device.index`` (None on
    CPU) as its device rank.
    """

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu", 0)

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        self.set_world_ranks()
        self._init_deepspeed_distributed()


@pytest.fixture
def deepspeed_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    if not HAS_DEEPSPEED:
        pytest.skip("needs the deepspeed package")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)


def reference_norms(steps: int, lr: float = 0.1) -> list[float]:
    """Plain PyTorch: the global 2-norm of the gradients of each SGD step of MLPModule on ``loader()``."""
    torch.manual_seed(0)
    module = MLPModule(lr=lr)
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    norms = []
    for i, batch in enumerate(loader()):
        if i == steps:
            break
        optimizer.zero_grad()
        module.training_step(batch, i).backward()
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in module.parameters()])))
        optimizer.step()
    return norms


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_monitor_logs_deepspeeds_global_norm_equal_to_plain_pytorch(
    tmp_path: Path, deepspeed_cpu: None, stage: int
) -> None:
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, strategy=CPUDeepSpeed(stage=stage), max_steps=4, callbacks=[GradNormMonitor()])
    trainer.fit(MLPModule(), loader())
    rows = read_metrics(trainer)
    logged = column(rows, "grad_norm/total")
    assert logged == pytest.approx(reference_norms(4), rel=1e-5)
    assert column(rows, "deepspeed/skipped_steps") == [0.0] * 4


class NaNLossAt(MLPModule):
    def __init__(self, bad_batch: int) -> None:
        super().__init__()
        self.bad_batch = bad_batch

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * math.nan if batch_idx == self.bad_batch else loss


def test_monitor_logs_deepspeeds_own_skipped_overflow_step(tmp_path: Path, deepspeed_cpu: None) -> None:
    """bf16 at ZeRO stage 0 runs DeepSpeed's FP16_UnfusedOptimizer, whose overflow check skips a non-finite step."""
    torch.manual_seed(0)
    trainer = make_trainer(
        tmp_path, strategy=CPUDeepSpeed(stage=0), precision="bf16-mixed", max_steps=4, callbacks=[GradNormMonitor()]
    )
    trainer.fit(NaNLossAt(bad_batch=1), loader())
    rows = read_metrics(trainer)
    assert column(rows, "deepspeed/skipped_steps") == [0.0, 1.0, 1.0, 1.0]
    norms = column(rows, "grad_norm/total")
    assert math.isinf(norms[1]) and all(math.isfinite(n) for n in norms[2:])


def test_guard_raise_stops_before_deepspeed_steps_on_a_nonfinite_loss(tmp_path: Path, deepspeed_cpu: None) -> None:
    torch.manual_seed(0)
    module = NaNLossAt(bad_batch=2)
    trainer = make_trainer(tmp_path, strategy=CPUDeepSpeed(stage=2), callbacks=[NonFiniteGuard(action="raise")])
    with pytest.raises(RuntimeError, match=r"non-finite loss at optimizer step 2 under DeepSpeed\. DeepSpeed has not"):
        trainer.fit(module, loader())
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert trainer.strategy.deepspeed_engine.global_steps == 2


def test_guard_warn_reports_a_nonfinite_norm_deepspeed_skipped_itself(tmp_path: Path, deepspeed_cpu: None) -> None:
    """bf16 under ZeRO stage 2: DeepSpeed's overflow check skips the NaN step; the guard reports it (no fp16 loss
    scale makes it routine)."""
    torch.manual_seed(0)
    trainer = make_trainer(
        tmp_path,
        strategy=CPUDeepSpeed(stage=2),
        precision="bf16-mixed",
        max_steps=3,
        callbacks=[NonFiniteGuard(action="warn", check_loss=False)],
    )
    with pytest.warns(UserWarning, match=r"1 DeepSpeed optimizer step\(s\) up to step 2 .* DeepSpeed skipped 1"):
        trainer.fit(NaNLossAt(bad_batch=1), loader())
    assert trainer.strategy.deepspeed_engine.skipped_steps == 1


# -- real DeepSpeed on CUDA ----------------------------------------------------------------------------------------
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@needs_cuda
@needs_deepspeed
@pytest.mark.parametrize("stage", [2, 3])
def test_gpu_monitor_logs_deepspeeds_global_norm_equal_to_plain_pytorch(tmp_path: Path, stage: int) -> None:
    torch.manual_seed(0)
    trainer = make_trainer(
        tmp_path,
        accelerator="cuda",
        strategy=DeepSpeedStrategy(stage=stage),
        max_steps=4,
        callbacks=[GradNormMonitor()],
    )
    trainer.fit(MLPModule(), loader())
    assert column(read_metrics(trainer), "grad_norm/total") == pytest.approx(reference_norms(4), rel=1e-4)


@gpu
@needs_cuda
@needs_deepspeed
def test_gpu_monitor_logs_fp16_overflow_skips(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trainer = make_trainer(
        tmp_path,
        accelerator="cuda",
        strategy=DeepSpeedStrategy(stage=2),
        precision="16-mixed",
        max_steps=4,
        callbacks=[GradNormMonitor(), NonFiniteGuard(action="warn", check_loss=False)],
    )
    trainer.fit(NaNLossAt(bad_batch=1), loader())
    skipped = column(read_metrics(trainer), "deepspeed/skipped_steps")
    assert skipped[-1] == trainer.strategy.deepspeed_engine.skipped_steps >= 1


@gpu
@needs_cuda
@needs_deepspeed
def test_gpu_guard_raise_stops_before_deepspeed_steps(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trainer = make_trainer(
        tmp_path, accelerator="cuda", strategy=DeepSpeedStrategy(stage=2), callbacks=[NonFiniteGuard(action="raise")]
    )
    with pytest.raises(RuntimeError, match=r"non-finite loss at optimizer step 2 under DeepSpeed"):
        trainer.fit(NaNLossAt(bad_batch=2), loader())
    assert trainer.strategy.deepspeed_engine.global_steps == 2
