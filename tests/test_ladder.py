"""EscalationLadder: a scripted sequence of findings climbs it rung by rung, each rung acts (the learning rate against
the hand-computed ramp, the z-loss weight, QK-Clip switched on against the rule computed by hand, a rollback against a
plain loop that never trained the rewound batches, bitwise), every transition is an event, a calm stretch climbs down
whatever the order of the policies, a resumed run goes on from the saved rung, the stop ends a process with the
documented exit code behind the loop door and ends ``trainer.fit``, and bad configurations are refused.

The findings come from ``EarlyWarning`` watching log Z of a classifier whose output layer adds a scripted constant to
its logits at chosen steps: log Z moves by that constant and the cross-entropy does not (it is shift-invariant), so
the findings fall exactly on the chosen steps; or from ``ladder.report`` and ``SpikeRollback``.
"""

from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from gradkit import EarlyWarning, EscalationLadder, GradKit, QKClip, SpikeRollback, TrainingStopped
from gradkit.policies.escalation import rewarmup_factor
from helpers import make_trainer, run_fresh
from lightning_gradkit import EarlyWarning as EarlyWarningCallback
from lightning_gradkit import EscalationLadder as EscalationLadderCallback
from test_guards import events

gen = torch.Generator().manual_seed(0)
BATCHES = [(torch.randn(6, 4, generator=gen), torch.randint(3, (6,), generator=gen)) for _ in range(16)]
# log Z above 50 fires; a series fires again once it doubled: each offset more than doubles the last.
CLIMB = {3: 100.0, 5: 300.0, 7: 1000.0, 9: 3000.0, 11: 10000.0}


class Head(nn.Linear):
    """The output layer: its logits plus ``offset``, which moves log Z by as much and leaves the cross-entropy."""

    offset = 0.0

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) + self.offset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = Head(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _warning() -> EarlyWarning:
    """Watches log Z of ``head`` only: a finding where it passes 50, then at each doubling."""
    quiet = {"adam": False, "update_spread": False, "spike_score": False}
    return EarlyWarning(attention=None, output="head", thresholds={"logz_max": 50.0}, log_every_n_steps=1, **quiet)


def _train(kit: GradKit, model: Net, steps: range, offsets: dict[int, float], ladder: EscalationLadder) -> None:
    optimizer = kit.ctx.optimizers[0]
    for step in steps:
        x, y = BATCHES[step]
        model.head.offset = offsets.get(step, 0.0)
        logits = model(x)
        loss = F.cross_entropy(logits, y) + ladder.z_loss_term(logits)
        loss.backward()
        kit.note_loss(loss)
        kit.step(optimizer)
        optimizer.zero_grad()


def _ladder_events(directory: Path) -> list[tuple[int, str, str, str, str]]:
    return [
        (e["step"], e["from_rung"], e["to_rung"], e["direction"], e["source"])
        for e in events(directory)
        if e["what"] == "escalation_ladder"
    ]


# -- climbing ------------------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:(EarlyWarning|EscalationLadder|SpikeRollback):UserWarning")
def test_each_finding_climbs_one_rung_and_each_rung_acts_up_to_the_stop(tmp_path: Path) -> None:
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ladder = EscalationLadder(
        z_loss=1e-4, escalate_lr_factor=0.5, escalate_rewarmup_steps=4, escalate_reset_moments="all", calm_steps=None
    )
    rollback = SpikeRollback(warmup_steps=1000, snapshot_every_n_steps=2, keep=4)  # snapshots only: no trigger
    kit = GradKit(model, optimizer, [_warning(), rollback, ladder], log_dir=tmp_path, log_every_n_steps=1)
    lrs: list[float] = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: lrs.append(opt.param_groups[0]["lr"]))
    weights: list[float] = []
    with pytest.raises(TrainingStopped) as stopped:
        for step in range(14):
            _train(kit, model, range(step, step + 1), CLIMB, ladder)
            weights.append(float(ladder.z_loss_weight))
    assert stopped.value.code == 75 and step == 11  # the process would exit with EX_TEMPFAIL
    assert _ladder_events(tmp_path) == [
        (3, "calm", "warn", "climb", "EarlyWarning"),
        (5, "warn", "lr_cut", "climb", "EarlyWarning"),
        (7, "lr_cut", "mitigate", "climb", "EarlyWarning"),
        (9, "mitigate", "rollback", "climb", "EarlyWarning"),
        (11, "rollback", "stop", "climb", "EarlyWarning"),
    ]
    cut, mitigate, rolled, stop = [e for e in events(tmp_path) if e["what"] == "escalation_ladder"][1:]
    assert (cut["lr_factor"], cut["reset_params"], cut["reset_moments"]) == (0.5, 4, "all")
    assert (mitigate["z_loss_weight"], mitigate["qk_clip"]) == (1e-4, 0)
    assert (rolled["rolled_back"], rolled["before_step"], stop["exit_code"]) == (True, 3, 75)
    # The cut at step 5 ramps back over 4 applied steps: 0.1 x (0.5 + 0.5 k / 4), a rollback does not rewind it.
    assert lrs == pytest.approx([0.1] * 6 + [0.1 * (0.5 + 0.5 * k / 4) for k in range(4)] + [0.1, 0.1])
    assert lrs[6:10] == pytest.approx([0.1 * rewarmup_factor(0.5, k, 4) for k in range(4)])
    f32 = torch.tensor(1e-4).item()
    assert weights == [0.0] * 7 + [f32] * 4  # the z-loss from step 7's rung on (step 11 stopped before the append)
    (back,) = [e for e in events(tmp_path) if e["what"] == "rollback"]
    # The newest snapshot before the first finding (step 3): the one of step 2 (snapshots every 2 steps).
    assert (back["to_step"], back["from_step"], back["values"]["reason"]) == (2, 10, "escalation_ladder")
    assert ladder.rung == "stop" and rollback.rollbacks == 1


@pytest.mark.filterwarnings("ignore:(EarlyWarning|EscalationLadder|SpikeRollback):UserWarning")
def test_the_rollback_rung_leaves_the_run_a_plain_loop_that_never_trained_the_rewound_batches(tmp_path: Path) -> None:
    model = _net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    ladder = EscalationLadder(rungs=["rollback"])
    rollback = SpikeRollback(warmup_steps=1000, snapshot_every_n_steps=2, keep=3)
    kit = GradKit(model, optimizer, [_warning(), rollback, ladder], log_dir=tmp_path, log_every_n_steps=1)
    _train(kit, model, range(10), {5: 100.0}, ladder)  # a finding at step 5: back to the snapshot of step 4
    (back,) = [e for e in events(tmp_path) if e["what"] == "rollback"]
    assert (back["to_step"], back["rewound_steps"], back["steps_to_skip"]) == (4, 2, [[4, 6]])
    # Plain PyTorch: the same net and Adam on the batches the model kept: 0-3, then 6-9.
    reference = _net()
    plain = torch.optim.Adam(reference.parameters(), lr=0.01)
    for step in [0, 1, 2, 3, 6, 7, 8, 9]:
        x, y = BATCHES[step]
        F.cross_entropy(reference(x), y).backward()
        plain.step()
        plain.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name
        assert torch.equal(optimizer.state[p]["exp_avg_sq"], plain.state[q]["exp_avg_sq"]), name
    assert int(optimizer.state[model.head.weight]["step"]) == 8 and kit.skipped_steps == 2


# -- climbing down, in any order -------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:(EarlyWarning|EscalationLadder):UserWarning")
@pytest.mark.parametrize("ladder_first", [True, False])
def test_a_calm_stretch_climbs_down_one_rung_whatever_the_order_of_the_policies(
    tmp_path: Path, ladder_first: bool
) -> None:
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ladder = EscalationLadder(rungs=["warn", "mitigate"], z_loss=1e-3, calm_steps=3)
    policies = [ladder, _warning()] if ladder_first else [_warning(), ladder]
    kit = GradKit(model, optimizer, policies, log_dir=tmp_path, log_every_n_steps=1)
    weights = []
    for step in range(12):
        _train(kit, model, range(step, step + 1), {1: 100.0, 2: 300.0, 10: 1000.0}, ladder)
        weights.append(float(ladder.z_loss_weight))
    # Findings at 1 and 2; steps 3-5 calm: down at step 6, steps 6-8 calm: down at 9; a new finding at 10.
    assert _ladder_events(tmp_path) == [
        (1, "calm", "warn", "climb", "EarlyWarning"),
        (2, "warn", "mitigate", "climb", "EarlyWarning"),
        (6, "mitigate", "warn", "descend", "calm"),
        (9, "warn", "calm", "descend", "calm"),
        (10, "calm", "warn", "climb", "EarlyWarning"),
    ]
    f32 = torch.tensor(1e-3).item()
    assert weights == [0.0, 0.0, f32, f32, f32, f32] + [0.0] * 6  # on at `mitigate` only


# -- the mitigation: QK-Clip switched on -----------------------------------------------------------------------------
def _max_logit_per_head(attention: nn.MultiheadAttention, x: Tensor) -> Tensor:
    """By hand: ``nn.MultiheadAttention``'s pre-softmax logits ``q.k / sqrt(d)`` per head, their largest."""
    e, h = attention.embed_dim, attention.num_heads
    w, b = attention.in_proj_weight, attention.in_proj_bias
    q = (x @ w[:e].T + b[:e]).unflatten(-1, (h, e // h)).transpose(1, 2)
    k = (x @ w[e : 2 * e].T + b[e : 2 * e]).unflatten(-1, (h, e // h)).transpose(1, 2)
    return (q @ k.transpose(-1, -2) / math.sqrt(e // h)).amax(dim=(0, 2, 3))


@pytest.mark.filterwarnings("ignore:EscalationLadder:UserWarning")
def test_the_mitigate_rung_switches_on_a_qk_clip_built_off(tmp_path: Path) -> None:
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, 2, batch_first=True)
    initial = copy.deepcopy(attention.state_dict())
    optimizer = torch.optim.SGD(attention.parameters(), lr=0.0)  # only QK-Clip changes the weights
    clip = QKClip(threshold=0.5, attention=["MultiheadAttention"], enabled=False)
    ladder = EscalationLadder(rungs=["warn", "mitigate"], calm_steps=None)
    kit = GradKit(attention, optimizer, [clip, ladder], log_dir=tmp_path)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1)) * 10
    for step in range(3):
        before = _max_logit_per_head(attention, x).detach()
        attention(x, x, x)[0].sum().backward()
        kit.step(optimizer)
        optimizer.zero_grad()
        if step < 2:  # built off: the weights stay as they were, whatever the logits
            assert all(torch.equal(v, initial[k]) for k, v in attention.state_dict().items())
            ladder.report(f"check {step}")
    assert clip.active and ladder.rung == "mitigate"
    # Step 2 ran with QK-Clip on: every head over 0.5 had its logits brought back to exactly 0.5 (lr 0).
    assert (before > 0.5).all()
    torch.testing.assert_close(_max_logit_per_head(attention, x), torch.full((2,), 0.5), rtol=1e-5, atol=0)
    (event,) = [e for e in events(tmp_path) if e["to_rung"] == "mitigate"]
    assert event["qk_clip"] == 1 and event["step"] == 1


# -- state -----------------------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:EscalationLadder:UserWarning")
def test_a_resumed_run_goes_on_from_the_saved_rung_with_its_mitigations_on() -> None:
    def run(steps: range, ladder: EscalationLadder, state: dict[str, Any] | None = None) -> None:
        model = nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        kit = GradKit(model, optimizer, ladder, log_dir=False)
        if state is not None:
            kit.load_state_dict(state)
        for step in steps:
            model(torch.ones(1, 2)).sum().backward()
            kit.step(optimizer)
            optimizer.zero_grad()
            if step in (1, 2, 6):
                ladder.report(f"finding at {step}")
        saved.append(copy.deepcopy(kit.state_dict()))

    def make() -> EscalationLadder:
        return EscalationLadder(rungs=["warn", "mitigate", "stop"], z_loss=1e-4, calm_steps=10)

    saved: list[dict[str, Any]] = []
    whole, first, resumed = make(), make(), make()
    with pytest.raises(TrainingStopped):
        run(range(8), whole)
    run(range(4), first)
    assert first.rung == "mitigate"
    with pytest.raises(TrainingStopped):
        run(range(4, 8), resumed, saved[-1])
    assert resumed.transitions == whole.transitions
    assert [t[2] for t in whole.transitions] == ["warn", "mitigate", "stop"]
    assert float(resumed.z_loss_weight) == pytest.approx(1e-4)


def test_a_state_on_a_rung_the_ladder_lacks_is_refused() -> None:
    state = EscalationLadder(rungs=["warn", "stop"]).state_dict() | {"rung": "rollback"}
    with pytest.raises(ValueError, match=r"rung 'rollback', which `rungs=\['warn', 'stop'\]` does not hold"):
        EscalationLadder(rungs=["warn", "stop"]).load_state_dict(state)


# -- the stop ----------------------------------------------------------------------------------------------------------
def test_an_uncaught_stop_ends_the_process_with_the_documented_exit_code() -> None:
    done = run_fresh(
        "import torch\n"
        "from gradkit import EscalationLadder, GradKit\n"
        "model = torch.nn.Linear(2, 1)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "ladder = EscalationLadder(rungs=['warn', 'stop'])\n"
        "with GradKit(model, optimizer, ladder, log_dir=False) as kit:\n"
        "    for step in range(5):\n"
        "        model(torch.ones(1, 2)).sum().backward()\n"
        "        kit.step(optimizer)\n"
        "        optimizer.zero_grad()\n"
        "        ladder.report('loss rose')\n"
        "print('not reached')\n",
        returncode=75,
    )
    assert "not reached" not in done.stdout
    assert "EscalationLadder: warn -> stop at step 1 (loss rose). The process exits with code 75." in done.stderr


@pytest.mark.filterwarnings("ignore:(EscalationLadder|SpikeRollback|NonFiniteGuard):UserWarning")
def test_spike_rollback_reports_its_rollbacks_and_out_of_rollbacks_stops_through_the_ladder(tmp_path: Path) -> None:
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rollback = SpikeRollback(warmup_steps=2, nonfinite_patience=1, snapshot_every_n_steps=1, max_rollbacks=1)
    ladder = EscalationLadder(rungs=["warn", "stop"], exit_code=70)
    kit = GradKit(model, optimizer, [rollback, ladder], log_dir=tmp_path)
    with pytest.raises(TrainingStopped) as stopped:
        for step in range(8):
            loss = model(torch.ones(1, 2)).sum() * (math.nan if step in (3, 5) else 1.0)
            loss.backward()
            kit.note_loss(loss)
            kit.step(optimizer)
            optimizer.zero_grad()
    # The NaN of step 3 rolls back (a finding: warn); that of step 5 finds the budget spent: the ladder stops.
    assert (stopped.value.code, step) == (70, 5)
    assert _ladder_events(tmp_path) == [
        (3, "calm", "warn", "climb", "SpikeRollback"),
        (5, "warn", "stop", "climb", "SpikeRollback"),
    ]
    assert [e["what"] for e in events(tmp_path)][-2:] == ["rollback_stopped", "escalation_ladder"]


class _Classifier(pl.LightningModule):
    """The Net, its log Z moved at the steps of ``CLIMB``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.net.head.offset = CLIMB.get(self.global_step, 0.0)
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(BATCHES, batch_size=None)  # the loop door's batches, in order


@pytest.mark.filterwarnings("ignore:(EarlyWarning|EscalationLadder):UserWarning")
def test_behind_the_trainer_the_ladder_climbs_as_behind_the_loop_door_and_the_stop_ends_fit(tmp_path: Path) -> None:
    def rungs() -> dict[str, Any]:
        return {"rungs": ["warn", "lr_cut", "stop"], "escalate_reset_moments": "none", "calm_steps": None}

    quiet = {"adam": False, "update_spread": False, "spike_score": False, "attention": None}
    watch = {"output": "net.head", "thresholds": {"logz_max": 50.0}, **quiet}
    ladder = EscalationLadderCallback(**rungs())  # type: ignore[arg-type]
    trainer = make_trainer(tmp_path, max_steps=16, callbacks=[EarlyWarningCallback(**watch), ladder])
    with pytest.raises(TrainingStopped) as stopped:
        trainer.fit(_Classifier())
    assert stopped.value.code == 75 and trainer.global_step == 8  # stopped at the end of step 7
    loop = EscalationLadder(**rungs())  # type: ignore[arg-type]
    model = _net()
    kit = GradKit(model, torch.optim.SGD(model.parameters(), lr=0.1), [_warning(), loop], log_dir=False)
    with pytest.raises(TrainingStopped), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(kit, model, range(16), CLIMB, loop)
    assert ladder.transitions == loop.transitions
    assert [(s, to) for s, _, to, _ in ladder.transitions] == [(3, "warn"), (5, "lr_cut"), (7, "stop")]
    assert [e["to_rung"] for e in events(trainer) if e["what"] == "escalation_ladder"] == ["warn", "lr_cut", "stop"]


# -- configuration ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rungs": []}, r"`rungs` must be a non-empty list"),
        ({"rungs": "stop"}, r"`rungs` must be a non-empty list"),
        ({"rungs": ["warn", "halt"]}, r"`rungs` holds unknown rung\(s\) \['halt'\]"),
        ({"rungs": ["stop", "warn"]}, r"`rungs` must climb in order"),
        ({"rungs": ["warn", "warn"]}, r"`rungs` must climb in order"),
        ({"climb_findings": 0}, r"`climb_findings` must be an integer >= 1, got 0"),
        ({"climb_within_steps": 0}, r"`climb_within_steps` must be an integer >= 1, got 0"),
        ({"calm_steps": 0}, r"`calm_steps` must be an integer >= 1, got 0"),
        ({"z_loss": -1e-4}, r"`z_loss` must be a finite number > 0.0, got -0.0001"),
        ({"z_loss": 1e-4, "rungs": ["warn", "stop"]}, r"`z_loss=0.0001` is switched on at the 'mitigate' rung"),
        ({"exit_code": 0}, r"`exit_code` must be an integer >= 1 and <= 255, got 0. 0 tells a scheduler"),
        ({"exit_code": 256}, r"`exit_code` must be an integer >= 1 and <= 255, got 256"),
        ({"escalate_lr_factor": 1.5}, r"`escalate_lr_factor` must be a finite number > 0.0 and < 1.0, got 1.5"),
        ({"escalate_lr_factor": None, "escalate_reset_moments": "none"}, r"gives it nothing to do"),
    ],
)
def test_a_bad_configuration_is_refused_at_construction_naming_the_argument(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EscalationLadder(**kwargs)


@pytest.mark.parametrize(
    ("policies", "message"),
    [
        ([EscalationLadder(rungs=["warn", "rollback"])], r"'rollback' rung .* `policies` holds no SpikeRollback"),
        ([EscalationLadder(rungs=["mitigate"])], r"'mitigate' rung .* no QKClip\(enabled=False\) and `z_loss=None`"),
        ([EscalationLadder(rungs=["mitigate"]), QKClip(enabled=True)], r"no QKClip\(enabled=False\)"),
        ([_warning(), EscalationLadder(rungs=["warn"])], None),
        (
            [EarlyWarning(attention=None, action="escalate"), EscalationLadder(rungs=["warn"])],
            r"EarlyWarning\(action='escalate'\) cuts the learning rate on its own",
        ),
        (
            [SpikeRollback(escalate_lr_factor=0.5), EscalationLadder(rungs=["warn"])],
            r"SpikeRollback\(escalate_...\) escalates on its own",
        ),
    ],
)
@pytest.mark.filterwarnings("ignore:(EscalationLadder|QKClip):UserWarning")
def test_a_rung_without_its_means_or_a_second_escalation_is_refused_at_attach(
    policies: list[Any], message: str | None
) -> None:
    model = _net()
    build = lambda: GradKit(model, torch.optim.SGD(model.parameters(), lr=0.1), policies, log_dir=False)  # noqa: E731
    if message is None:  # the reference: the same loop with what the rung needs is accepted
        assert build().policies[-1].rung == "calm"
    else:
        with pytest.raises(ValueError, match=message):
            build()
