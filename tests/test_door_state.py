"""One state format behind every door, and a loop door that leaves nothing behind.

A policy's state is keyed by its ``state_key`` behind the Trainer (``checkpoint["callbacks"]``) and behind
:class:`~gradkit.GradKit` (``state_dict()["policies"]``): a Trainer checkpoint resumes a plain loop and a plain
loop's state resumes a Trainer, each continuing exactly as the uninterrupted run (the reference: one plain loop over
all batches, which tests/test_front_doors.py proves equal to the Trainer and to ``clip_grad_norm_``).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from gradkit import Decision, StepOutcome, StepStats
from gradkit.doors.loop import GradKit
from gradkit.step.protocol import Stage
from helpers import make_trainer
from lightning_gradkit import NonFiniteGuard, SpikeGuard, ZClip
from lightning_gradkit import StepsToSkip as StepsToSkipCallback
from test_front_doors import Net, NetModule, _assert_same_state, _batches, _initial_state, _optimizer

pytestmark = pytest.mark.filterwarnings("ignore:NonFiniteGuard:UserWarning", "ignore:SpikeGuard:UserWarning")

HALF = 6  # one epoch of 6 batches, trained twice; its NaN batch (5) is skipped in each epoch


def _policies() -> list[Any]:
    return [
        ZClip(alpha=0.9, z_threshold=1.5, warmup_steps=3),
        NonFiniteGuard(action="skip"),
        SpikeGuard(monitor="loss", warmup_steps=3, z_threshold=2.0, action="warn"),
    ]


def _plain(model: nn.Module, opt: torch.optim.Optimizer, kit: GradKit, batches: list[tuple[Tensor, Tensor]]) -> None:
    model.train()
    for x, y in batches:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        kit.note_loss(loss)
        kit.step(opt)
        opt.zero_grad(set_to_none=True)


def _epoch() -> list[tuple[Tensor, Tensor]]:
    return _batches()[:HALF]


def _uninterrupted() -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Two epochs in one plain loop."""
    model = Net()
    model.load_state_dict(_initial_state())
    opt = _optimizer("sgd", model.parameters())
    kit = GradKit(model, opt, _policies(), log_every_n_steps=1)
    _plain(model, opt, kit, _epoch() * 2)
    return model.state_dict(), kit.state_dict()


def _trainer_checkpoint(tmp_path: Path) -> dict[str, Any]:
    """A Trainer's checkpoint after the first epoch."""
    module = NetModule("sgd")
    module.load_state_dict(_initial_state())
    trainer = make_trainer(tmp_path, default_root_dir=tmp_path, strategy="gradkit", callbacks=_policies(), logger=False)
    trainer.fit(module, DataLoader(_epoch(), batch_size=None))
    path = tmp_path / "half.ckpt"
    trainer.save_checkpoint(path)
    return torch.load(path, weights_only=False)


def test_a_trainer_checkpoint_resumes_behind_the_loop_door(tmp_path: Path) -> None:
    expected, expected_state = _uninterrupted()
    checkpoint = _trainer_checkpoint(tmp_path)
    model = Net()
    model.load_state_dict(checkpoint["state_dict"])
    opt = _optimizer("sgd", model.parameters())
    opt.load_state_dict(checkpoint["optimizer_states"][0])
    kit = GradKit(model, opt, _policies(), log_every_n_steps=1)
    kit.load_state_dict(checkpoint)
    assert kit.state_dict()["step"] == HALF
    _plain(model, opt, kit, _epoch())
    _assert_same_state(model.state_dict(), expected)
    # The policies' statistics went on from the Trainer's, as in the uninterrupted run.
    state = kit.state_dict()["policies"]
    assert state.keys() == expected_state["policies"].keys() == {cb.state_key for cb in _policies()}
    zclip_key = _policies()[0].state_key
    assert state[zclip_key] == expected_state["policies"][zclip_key]


def test_a_loop_door_state_resumes_a_trainer(tmp_path: Path) -> None:
    expected, _ = _uninterrupted()
    model = Net()
    model.load_state_dict(_initial_state())
    opt = _optimizer("sgd", model.parameters())
    kit = GradKit(model, opt, _policies(), log_every_n_steps=1)
    _plain(model, opt, kit, _epoch())
    # A Trainer checkpoint of the same point, whose callbacks, weights and optimizer are replaced by the loop's.
    checkpoint = _trainer_checkpoint(tmp_path / "skeleton")
    assert checkpoint["callbacks"].keys() >= kit.state_dict()["policies"].keys()
    checkpoint["callbacks"].update(kit.state_dict()["policies"])
    checkpoint["state_dict"] = model.state_dict()
    checkpoint["optimizer_states"] = [opt.state_dict()]
    path = tmp_path / "from_loop.ckpt"
    torch.save(checkpoint, path)
    module = NetModule("sgd")
    trainer = make_trainer(
        tmp_path, default_root_dir=tmp_path, strategy="gradkit", callbacks=_policies(), logger=False, max_epochs=2
    )
    trainer.fit(module, DataLoader(_epoch(), batch_size=None), ckpt_path=path)
    _assert_same_state(module.state_dict(), expected)


def test_a_trainer_resume_with_a_policy_added_and_one_gone_warns_as_the_loop_door(tmp_path: Path) -> None:
    """The Trainer side of the restart: an added StepsToSkip starts fresh, with the loop door's warning (Lightning
    says nothing), and the state of the NonFiniteGuard left out is reported by Lightning. The dropped NaN batch of the
    second epoch leaves the model where the uninterrupted run's skip left it."""
    expected, _ = _uninterrupted()
    _trainer_checkpoint(tmp_path)
    declared = StepsToSkipCallback(steps=[[HALF + 5, HALF + 6]])  # the NaN batch of the second epoch
    resumed = [*(p for p in _policies() if not isinstance(p, NonFiniteGuard)), declared]
    module = NetModule("sgd")
    trainer = make_trainer(
        tmp_path, default_root_dir=tmp_path, strategy="gradkit", callbacks=resumed, logger=False, max_epochs=2
    )
    with pytest.warns(UserWarning) as caught:
        trainer.fit(module, DataLoader(_epoch(), batch_size=None), ckpt_path=tmp_path / "half.ckpt")
    messages = [str(w.message) for w in caught]
    assert sum(m.startswith("Resuming with no saved state for StepsToSkip: ") for m in messages) == 1
    assert any("Please add the following callbacks: [\"NonFiniteGuard{'action': 'skip'}\"]" in m for m in messages)
    assert declared.dropped == 1
    _assert_same_state(module.state_dict(), expected)


def test_saved_snapshots_carry_a_torch_clippers_state_through_a_loop_doors_resume() -> None:
    """`SpikeRollback(save_snapshots=True)` beside a torch-only clipper (no ``state_key`` attribute: keyed by its class
    name, as behind the Trainer): the state saves, resumes, and the resumed loop ends as the uninterrupted one."""
    from gradkit.policies.guards import NonFiniteGuard as TorchNonFiniteGuard
    from gradkit.policies.history_clipping import AutoClip
    from gradkit.policies.rollback import SpikeRollback

    def kit_for(model: nn.Module, opt: torch.optim.Optimizer) -> GradKit:
        rollback = SpikeRollback("loss", snapshot_every_n_steps=2, save_snapshots=True)
        policies = [AutoClip(percentile=50.0), TorchNonFiniteGuard(action="skip"), rollback]  # the NaN batch: skipped
        return GradKit(model, opt, policies, log_every_n_steps=0, log_dir=False)

    model = Net()
    model.load_state_dict(_initial_state())
    opt = _optimizer("sgd", model.parameters())
    kit = kit_for(model, opt)
    _plain(model, opt, kit, _epoch()[:4])
    state, saved_model, saved_opt = copy.deepcopy((kit.state_dict(), model.state_dict(), opt.state_dict()))
    (ring,) = [s["snapshots"] for key, s in state["policies"].items() if key.startswith("SpikeRollback")]
    assert ring and all("AutoClip" in snapshot["callbacks"] for snapshot in ring)
    _plain(model, opt, kit, _epoch()[4:])

    fresh = Net()
    fresh.load_state_dict(saved_model)
    fresh_opt = _optimizer("sgd", fresh.parameters())
    fresh_opt.load_state_dict(saved_opt)
    fresh_kit = kit_for(fresh, fresh_opt)
    fresh_kit.load_state_dict(state)
    _plain(fresh, fresh_opt, fresh_kit, _epoch()[4:])
    _assert_same_state(fresh.state_dict(), model.state_dict())


def test_a_state_saved_as_a_list_still_loads_by_position() -> None:
    model = Net()
    opt = _optimizer("sgd", model.parameters())
    kit = GradKit(model, opt, _policies(), log_every_n_steps=1)
    _plain(model, opt, kit, _batches()[:4])
    keyed = kit.state_dict()
    legacy = {**keyed, "policies": [keyed["policies"][p.state_key] for p in kit.policies]}
    other = GradKit(model, opt, _policies(), log_every_n_steps=0)
    other.load_state_dict(legacy)
    assert other.state_dict() == keyed


def test_a_policy_added_at_a_resume_starts_fresh_and_a_gone_policys_state_is_reported() -> None:
    """As a Trainer resumes: states are matched by key, each mismatch is one warning, not an error (the loop door
    raised a KeyError). The references: the saved state itself, and the state of a policy never trained."""
    model = Net()
    opt = _optimizer("sgd", model.parameters())
    saved_with = [NonFiniteGuard(action="skip"), SpikeGuard(monitor="loss", warmup_steps=3, action="warn")]
    kit = GradKit(model, opt, saved_with, log_every_n_steps=0, log_dir=False)
    _plain(model, opt, kit, _batches()[:4])
    state = copy.deepcopy(kit.state_dict())
    kept, added = SpikeGuard(monitor="loss", warmup_steps=3, action="warn"), ZClip()
    resumed = GradKit(model, opt, [kept, added], log_every_n_steps=0, log_dir=False)
    with pytest.warns(UserWarning) as caught:
        resumed.load_state_dict(state)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert messages[0].startswith("Resuming with no saved state for ZClip: it was not in the run")
    assert "so it starts fresh" in messages[0]
    assert messages[1].startswith("The checkpoint holds the state of NonFiniteGuard{'action': 'skip'}, which this run")
    assert "is not loaded" in messages[1]
    after = resumed.state_dict()
    assert after["step"] == 4
    assert after["policies"][kept.state_key] == state["policies"][kept.state_key]
    assert after["policies"]["ZClip"] == ZClip().state_dict()


def test_two_policies_with_one_state_key_are_refused() -> None:
    model = Net()
    opt = _optimizer("sgd", model.parameters())
    with pytest.raises(ValueError, match="more than one policy with the state key ZClip"):
        GradKit(model, opt, [ZClip(), ZClip()])


class _Probe:
    """A policy of the user's own: a plain object with a stage and the hooks it needs (the protocol)."""

    stage = Stage.OBSERVE

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.handles: list[Any] = []

    def attach(self, ctx: Any, model: nn.Module) -> None:
        self.calls.append("attach")
        self.handles = [model.register_forward_hook(lambda *args: None)]

    def finish(self, ctx: Any) -> None:
        self.calls.append("finish")

    def detach(self, ctx: Any) -> None:
        self.calls.append("detach")
        for handle in self.handles:
            handle.remove()


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def test_close_removes_every_hook_the_door_and_its_policies_registered() -> None:
    model = Net()
    opt = _optimizer("sgd", model.parameters())
    probe = _Probe()
    kit = GradKit(model, opt, [NonFiniteGuard(action="skip"), probe], log_every_n_steps=0)
    assert _hooks(model) > 0  # the first window's forward pre-hooks and the probe's hook
    kit.close()
    assert _hooks(model) == 0
    assert probe.calls == ["attach", "detach"]


def test_the_context_manager_finishes_then_closes() -> None:
    model = Net()
    model.load_state_dict(_initial_state())
    opt = _optimizer("sgd", model.parameters())
    probe = _Probe()
    with GradKit(model, opt, [NonFiniteGuard(action="skip"), probe], log_every_n_steps=0) as kit:
        _plain(model, opt, kit, _batches()[:3])
        assert _hooks(model) == 1  # the probe's; the door's first-window hooks removed themselves
    assert probe.calls == ["attach", "finish", "detach"]
    assert _hooks(model) == 0
    with pytest.raises(RuntimeError, match="boom"), GradKit(model, opt, [probe], log_every_n_steps=0):
        raise RuntimeError("boom")
    assert probe.calls[-2:] == ["attach", "detach"]  # no finish after an exception


class _FailingModule(NetModule):
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if batch_idx == 2:
            raise RuntimeError("the user's error")
        return super().training_step(batch, batch_idx)


def test_the_trainers_teardown_detaches_the_policies_after_an_error_too(tmp_path: Path) -> None:
    """Behind the Trainer, `detach` runs at teardown (as `GradKit.close()` behind the loop door), also when training
    stopped with an error and `on_train_end` (the policies' `finish`) never ran."""
    from lightning_gradkit import GradKitCallback

    class ProbeCallback(_Probe, GradKitCallback):
        pass

    probe = ProbeCallback()
    module = _FailingModule("sgd")
    trainer = make_trainer(tmp_path, callbacks=[probe], logger=False)
    with pytest.raises(RuntimeError, match="the user's error"):
        trainer.fit(module, DataLoader(_epoch(), batch_size=None))
    assert probe.calls == ["attach", "detach"] and _hooks(module) == 0


class _HalvingPolicy:
    """A policy of the user's own that clips (halves every gradient) at the GUARD stage, so the door's check of "one
    clipper" (stage CLIP) does not see it."""

    stage = Stage.GUARD

    def decide(self, stats: Any, decision: Any, ctx: Any) -> None:
        decision.clip_by(torch.tensor(0.5))


def test_a_second_clip_in_one_step_is_refused_not_overwritten() -> None:
    """Issue 40: a clip was a plain field of the plan, and a second clipper silently replaced the first one's. The
    decision takes one clip form per step: ClipGradNorm after the user's halving raises, naming the rule."""
    from gradkit.policies.clipping import ClipGradNorm

    torch.manual_seed(0)
    model = Net()
    opt = _optimizer("sgd", model.parameters())
    kit = GradKit(model, opt, [_HalvingPolicy(), ClipGradNorm(max_norm=1e-3)])
    x, y = _batches()[0]
    nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(ValueError, match=r"`Decision.clip_by` got a second clip .* already holds a coefficient"):
        kit.step(opt)


class _SkipsStepOne:
    """A policy of the user's own, on the split contract: reads the statistics, skips step 1, observes the outcome."""

    stage = Stage.GUARD

    def __init__(self) -> None:
        self.totals: list[float] = []
        self.skipped: list[bool] = []

    def decide(self, stats: StepStats, decision: Decision, ctx: Any) -> None:
        self.totals.append(float(stats.primary.total))
        decision.add_skip(torch.tensor(ctx.global_step == 1))

    def observe(self, stats: StepStats, outcome: StepOutcome, ctx: Any) -> None:
        self.skipped.append(outcome.was_skipped())


def test_a_policy_reads_read_only_stats_writes_a_decision_and_observes_the_outcome() -> None:
    """Issue 40: ``decide`` gets the step's measurements (frozen) and its decision, ``observe`` the outcome. Against
    torch: the total is ``get_total_norm`` of the gradients, and the skipped step leaves the parameters as they were."""
    torch.manual_seed(0)
    model = Net()
    opt = _optimizer("sgd", model.parameters())
    policy = _SkipsStepOne()
    kit = GradKit(model, opt, [policy])
    expected, changed = [], []
    for x, y in _batches()[:3]:
        nn.functional.mse_loss(model(x), y).backward()
        expected.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        before = [p.detach().clone() for p in model.parameters()]
        kit.step(opt)
        changed.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)))
        opt.zero_grad(set_to_none=True)
    assert policy.totals == pytest.approx(expected, rel=1e-6)
    assert policy.skipped == [False, True, False] and changed == [True, False, True]
    with pytest.raises(dataclasses.FrozenInstanceError):
        kit.pipeline.last_records[id(opt)].stats.present = []  # type: ignore[misc]


class _PlanGuard:
    """A policy written for ``StepPlan``, before issue 40: ``decide(plan, ctx)``."""

    stage = Stage.GUARD

    def decide(self, plan: Any, ctx: Any) -> None:
        plan.add_skip(torch.tensor(False))


class _PlanObserver:
    """An ``observe(plan, ctx)`` of before issue 40."""

    stage = Stage.OBSERVE

    def observe(self, plan: Any, ctx: Any) -> None:
        pass


@pytest.mark.parametrize(
    ("policy", "fix"),
    [(_PlanGuard(), "decide(self, stats, decision, ctx)"), (_PlanObserver(), "observe(self, stats, outcome, ctx)")],
)
def test_a_policy_written_for_step_plan_is_refused_naming_the_new_signature(policy: object, fix: str) -> None:
    """Issue 40: an old hook would get the statistics where it expects the plan; it is refused when the door is built,
    with the signature to write and where each old read went."""
    model = Net()
    opt = _optimizer("sgd", model.parameters())
    with pytest.raises(
        TypeError, match=rf"`{type(policy).__name__}\.\w+` has the signature .* Write `{re.escape(fix)}`"
    ):
        GradKit(model, opt, [policy])
