"""UpdateClip against a hand-written loop in plain torch that implements Levanter's ``clip_update_norm`` rule: the
update ``w - w_before`` of each step, its norm against ``mean + k * std`` of the last norms (after a warm-up), the
update rescaled where it goes over; behind the loop door and the Trainer, globally and per module."""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from gradkit import GradKit, GradNormMonitor, NonFiniteGuard, UpdateClip
from helpers import MLPModule, count_syncs, make_trainer, read_metrics, regression_data

Batch = tuple[Tensor, Tensor]
SPIKES = (7, 10)  # the steps whose targets are outliers: their updates go over the threshold


def spiky_batches(steps: int = 12, spikes: tuple[int, ...] = SPIKES, scale: float = 30.0) -> list[Batch]:
    data = regression_data(n=8 * steps, seed=1)
    batches = [(data.tensors[0][i : i + 8], data.tensors[1][i : i + 8].clone()) for i in range(0, 8 * steps, 8)]
    for step in spikes:
        batches[step][1].mul_(scale)
    return batches


def whole(name: str) -> str:
    return ""


def encoder0_head_rest(name: str) -> str:
    """The rows of ``modules=["re:encoder\\.0", "re:head"]``."""
    return "encoder.0" if name.startswith("encoder.0.") else "head" if name.startswith("head.") else "rest"


def reference_run(
    module: MLPModule,
    optimizer: torch.optim.Optimizer,
    batches: list[Batch],
    row_of: Callable[[str], str],
    sigma: float,
    size: int,
    warmup: int,
    scheduler: Any = None,
    divide_by_lr: bool = True,
) -> tuple[list[dict[str, Tensor]], list[dict[str, float]]]:
    """The rule by hand, in float64: the parameters after every step and each row's coefficient."""
    history: dict[str, list[float]] = {}
    states, coefs = [], []
    params = dict(module.named_parameters())
    for step, batch in enumerate(batches):
        module.training_step(batch, step).backward()
        before = {n: p.detach().clone() for n, p in params.items()}
        lr = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}  # before the step
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        squares: dict[str, float] = {}
        for n, p in params.items():
            direction = (p.detach().double() - before[n].double()) / (lr[id(p)] if divide_by_lr else 1.0)
            squares[row_of(n)] = squares.get(row_of(n), 0.0) + float(direction.square().sum())
        coefs.append({})
        for row, square in squares.items():
            norm, past = math.sqrt(square), history.setdefault(row, [])
            threshold = math.inf
            if len(past) >= warmup:
                threshold = statistics.fmean(past) + sigma * max(statistics.pstdev(past), 1e-6)
                assert abs(norm / threshold - 1) > 1e-3, (
                    "a norm this close to the threshold tests rounding, not the rule"
                )
            coef = threshold / max(norm, 1e-6) if norm > threshold else 1.0
            with torch.no_grad():
                for n, p in params.items():
                    if row_of(n) == row:
                        p.copy_(before[n] + coef * (p - before[n]))
            coefs[-1][row] = coef
            past.append(norm)
            del past[:-size]
        optimizer.zero_grad()
        states.append({n: p.detach().clone() for n, p in params.items()})
    return states, coefs


def make_optimizer(module: MLPModule, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    # Two param groups with their own learning rates: the update of each is divided by its own. A large `eps`: in a
    # run this short Adam's normalization would absorb the outliers' gradients (its first update is +-1 per element).
    groups = [{"params": module.encoder.parameters()}, {"params": module.head.parameters(), "lr": 0.004}]
    return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1, eps=0.1, fused=kind == "adamw_fused")


def kit_run(
    module: MLPModule, optimizer: torch.optim.Optimizer, batches: list[Batch], policies: list[Any], **kit: Any
) -> list[dict[str, Tensor]]:
    states = []
    with GradKit(module, optimizer, policies, log_dir=False, **kit) as door:
        for step, batch in enumerate(batches):
            loss = module.training_step(batch, step)
            door.note_loss(loss)
            loss.backward()
            door.step(optimizer)
            optimizer.zero_grad()
            states.append({n: p.detach().clone() for n, p in module.named_parameters()})
    return states


CASES = {
    "sgd-whole": ("sgd", None, whole),
    "adamw-whole": ("adamw", None, whole),
    "sgd-modules": ("sgd", ["re:encoder\\.0", "re:head"], encoder0_head_rest),
    "adamw-modules": ("adamw", ["re:encoder\\.0", "re:head"], encoder0_head_rest),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_update_over_mean_plus_k_sigma_is_rescaled_as_the_hand_written_loop_rescales_it(case: str) -> None:
    kind, modules, row_of = CASES[case]
    torch.manual_seed(0)
    module = MLPModule()
    twin = copy.deepcopy(module)
    batches = spiky_batches()
    optimizer, twin_optimizer = make_optimizer(module, kind), make_optimizer(twin, kind)
    # A schedule that halves the learning rate every 4 steps: the norm is the update over the LR of its own step.
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5) for o in (optimizer, twin_optimizer)]
    expected, coefs = reference_run(twin, twin_optimizer, batches, row_of, 2.0, 6, 3, schedulers[1])
    clip = UpdateClip(sigma_factor=2.0, history_size=6, warmup_steps=3, modules=modules)
    actual = kit_run(module, optimizer, batches, [clip], schedulers=[schedulers[0]])

    clipped = [step for step, c in enumerate(coefs) if min(c.values()) < 1.0]
    # The rule acted, and not everywhere (the first outlier's unclipped norm joins the history and widens it).
    assert SPIKES[0] in clipped and len(clipped) < len(batches) - 3, coefs
    for step, (got, want) in enumerate(zip(actual, expected, strict=True)):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=f"{name} at step {step}")
    assert clip.last_coef() == pytest.approx(min(coefs[-1].values()), rel=1e-5)
    assert clip.state_dict()["optimizers"][0]["rows"] == ([""] if modules is None else ["encoder.0", "rest", "head"])


def test_warm_up_and_divide_by_lr_false_follow_levanter_and_the_raw_update() -> None:
    # Levanter's warm-up, max(2, history_size // 2) norms, and the norm of w - w_before itself.
    torch.manual_seed(0)
    module = MLPModule()
    twin = copy.deepcopy(module)
    batches = spiky_batches(spikes=(5, 10))
    optimizer, twin_optimizer = make_optimizer(module, "sgd"), make_optimizer(twin, "sgd")
    clip = UpdateClip(sigma_factor=2.0, history_size=8, divide_by_lr=False)
    assert clip.warmup == 4
    expected, coefs = reference_run(twin, twin_optimizer, batches, whole, 2.0, 8, 4, divide_by_lr=False)
    actual = kit_run(module, optimizer, batches, [clip])
    assert coefs[5][""] < 1.0
    for got, want in zip(actual, expected, strict=True):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7)


@pytest.mark.filterwarnings("ignore:NonFiniteGuard:UserWarning")
@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_a_step_a_guard_skipped_stays_out_of_the_history(kind: str) -> None:
    # The reference: the same run without the batch. An ordinary optimizer does not step at all; a fused one steps
    # with `found_inf` and makes a zero update, which must not join the history either.
    torch.manual_seed(0)
    module = MLPModule()
    twin = copy.deepcopy(module)
    batches = spiky_batches()
    poisoned = [*batches[:5], (torch.full_like(batches[5][0], math.nan), batches[5][1]), *batches[5:]]
    policies = [NonFiniteGuard("skip", forensics=False), UpdateClip(sigma_factor=2.0, history_size=6, warmup_steps=3)]
    with_skip = kit_run(module, make_optimizer(module, kind), poisoned, policies)
    reference = [UpdateClip(sigma_factor=2.0, history_size=6, warmup_steps=3)]
    without = kit_run(twin, make_optimizer(twin, kind), batches, reference)
    saved, expected = policies[1].state_dict()["optimizers"][0], reference[0].state_dict()["optimizers"][0]
    assert int(saved["count"]) == int(expected["count"]) == len(batches)
    torch.testing.assert_close(saved["history"], expected["history"], rtol=0, atol=0, equal_nan=True)
    for name in without[-1]:
        torch.testing.assert_close(with_skip[-1][name], without[-1][name], rtol=0, atol=0)


def test_a_resumed_run_clips_exactly_as_the_uninterrupted_one() -> None:
    torch.manual_seed(0)
    module = MLPModule()
    first_half = copy.deepcopy(module)
    batches = spiky_batches()
    make = lambda: UpdateClip(sigma_factor=2.0, history_size=6, warmup_steps=3, modules=["re:head"])  # noqa: E731
    straight = kit_run(module, make_optimizer(module, "adamw"), batches, [make()])

    optimizer = make_optimizer(first_half, "adamw")
    with GradKit(first_half, optimizer, make(), log_dir=False) as door:
        for step, batch in enumerate(batches[:6]):
            first_half.training_step(batch, step).backward()
            door.step(optimizer)
            optimizer.zero_grad()
        saved = copy.deepcopy((first_half.state_dict(), optimizer.state_dict(), door.state_dict()))
    resumed = MLPModule()
    resumed.load_state_dict(saved[0])
    resumed_optimizer = make_optimizer(resumed, "adamw")
    resumed_optimizer.load_state_dict(saved[1])
    clip = make()
    with GradKit(resumed, resumed_optimizer, clip, log_dir=False) as door:
        door.load_state_dict(saved[2])
        for step, batch in enumerate(batches[6:], start=6):
            resumed.training_step(batch, step).backward()
            door.step(resumed_optimizer)
            resumed_optimizer.zero_grad()
    assert clip.state_dict()["optimizers"][0]["rows"] == ["rest", "head"]
    for name, value in resumed.named_parameters():
        torch.testing.assert_close(value.detach(), straight[-1][name], rtol=0, atol=0, msg=name)


def test_the_trainer_clips_as_the_hand_written_loop_and_logs_on_logging_steps(tmp_path: Path) -> None:
    from lightning_gradkit import UpdateClip as UpdateClipCallback

    torch.manual_seed(0)
    module = MLPModule()
    twin = copy.deepcopy(module)
    batches = spiky_batches()
    twin_optimizer = twin.configure_optimizers()
    expected, coefs = reference_run(twin, twin_optimizer, batches, whole, 2.0, 6, 3)
    callback = UpdateClipCallback(sigma_factor=2.0, history_size=6, warmup_steps=3)
    trainer = make_trainer(tmp_path, callbacks=[callback], max_steps=len(batches), log_every_n_steps=2)
    data = TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    trainer.fit(module, DataLoader(data, batch_size=8))
    for name, value in module.named_parameters():
        torch.testing.assert_close(value.detach(), expected[-1][name], rtol=1e-5, atol=1e-7, msg=name)
    rows = {int(r["step"]): r for r in read_metrics(trainer) if r.get("update_clip/coef")}
    assert sorted(rows) == [1, 3, 5, 7, 9, 11]  # the logging steps only
    assert float(rows[7]["update_clip/coef"]) == pytest.approx(coefs[7][""], rel=1e-4) and coefs[7][""] < 1
    assert float(rows[1]["update_clip/threshold"]) == math.inf  # the warm-up
    assert {"update_clip/norm", "update_clip/threshold"} <= set(rows[7])


def test_the_monitor_s_update_ratio_sees_the_clipped_update_whatever_the_order() -> None:
    # The monitor before UpdateClip in the list: its post-step hook must still run after the clip.
    torch.manual_seed(0)
    module = MLPModule()
    batches = spiky_batches()
    logged: dict[int, dict[str, float]] = {}
    optimizer = make_optimizer(module, "sgd")
    policies = [
        GradNormMonitor(depth=0, update_ratio=True),
        UpdateClip(sigma_factor=2.0, history_size=6, warmup_steps=3),
    ]
    ratios = []
    log = lambda metrics, step: logged.setdefault(step, {}).update(metrics)  # noqa: E731
    with GradKit(module, optimizer, policies, log=log, log_every_n_steps=1, log_dir=False) as door:
        for step, batch in enumerate(batches):
            before = [p.detach().clone() for p in module.parameters()]
            module.training_step(batch, step).backward()
            door.step(optimizer)
            optimizer.zero_grad()
            after = [p.detach() for p in module.parameters()]
            update = math.sqrt(sum(float((p - b).square().sum()) for p, b in zip(after, before, strict=True)))
            ratios.append(update / math.sqrt(sum(float(b.square().sum()) for b in before)))
    assert logged[7]["update_clip/coef"] < 1.0
    for step, ratio in enumerate(ratios):
        assert logged[step]["update_ratio/total"] == pytest.approx(ratio, rel=1e-5), step


def test_no_host_sync_off_logging_steps() -> None:
    torch.manual_seed(0)
    module = MLPModule()
    groups = [{"params": module.encoder.parameters()}, {"params": module.head.parameters(), "lr": 0.01}]
    optimizer = torch.optim.SGD(groups, lr=0.05, momentum=0.9)  # two learning rates: a vector of 1 / lr per step
    clip = UpdateClip(history_size=6, warmup_steps=2, modules=["re:encoder\\.0"])
    logged: list[dict[str, float]] = []
    door = GradKit(module, optimizer, clip, log_every_n_steps=3, log_dir=False, log=lambda m, s: logged.append(m))
    with count_syncs() as counter:
        for step, batch in enumerate(spiky_batches()[:6]):
            before = counter.total
            with counter.active():
                module.training_step(batch, step).backward()
                door.step(optimizer)
                optimizer.zero_grad()
            assert counter.total - before == (1 if step % 3 == 2 else 0), (step, counter.counts)  # the log's one read
    door.close()
    assert len(logged) == 2 and set(logged[0]) == {
        f"update_clip/{key}/{row}" for key in ("norm", "threshold", "coef") for row in ("encoder.0", "rest")
    }


def test_a_modules_pattern_that_selects_nothing_and_a_history_of_another_size_are_refused() -> None:
    module = MLPModule()
    optimizer = make_optimizer(module, "sgd")
    with pytest.raises(ValueError, match=r"`modules` entry 're:blocks' selects no module"):
        GradKit(module, optimizer, UpdateClip(modules=["re:blocks"]), log_dir=False)
    saved = UpdateClip(history_size=6).state_dict()
    with pytest.raises(ValueError, match=r"holds 6 norms per row but `history_size=8`"):
        UpdateClip(history_size=8).load_state_dict(saved)
    clip = UpdateClip(history_size=6, modules=["re:head"])
    with GradKit(module, optimizer, clip, log_dir=False) as door:
        module.training_step(spiky_batches()[0], 0).backward()
        door.step(optimizer)
        state = clip.state_dict()
    other = UpdateClip(history_size=6)
    other.load_state_dict(state)
    door = GradKit(module, optimizer, other, log_dir=False)
    module.training_step(spiky_batches()[0], 0).backward()
    with pytest.raises(ValueError, match=r"rows \['rest', 'head'\].*resume with the `modules`"):
        door.step(optimizer)
    door.close()
