"""Cost of SpikeRollback's snapshots: step time with snapshots every 50 and every 200 steps against no callback,
the time of one snapshot, and the host memory the snapshots take, on the same GPT-style model, in one run.

    python benchmarks/bench_rollback.py [--steps 110 --warmup 10 --repeats 3]

A snapshot happens on one step in ``n``, so the median step time does not see it: the table reports the *mean*
step time as well, and the script times the snapshot itself (the copies into the host ring, after a real step,
median of ``--captures``) and divides it by ``n`` and by the median step time of all runs: the overhead it adds per
step on average. That amortized figure does not depend on whether a snapshot step falls in the measured window.

    python benchmarks/bench_rollback.py --faults [--fault-steps 360 --periods 20 40 80]

With ``--faults``, the script measures what SpikeRollback makes of a fault that recurs: the learning rate x100 for 4
optimizer steps every ``P`` steps (P = 20, 40, 80; from step 120, counted in attempted steps as
``trainer.global_step`` is, so a rollback does not move the schedule), in a plain loop (:class:`gradkit.GradKit`,
which runs the policy as the Trainer does) on a 2-layer TinyGPT, one torch thread. The configurations: the old
defaults (the rule for a spike that comes back as it was before issue 39, :class:`OldRule`), the new defaults, and the
new rule with ``escalate_lr_factor`` 0.5 and 0.1. Per period and configuration it prints the
rollbacks, the escalations, the most steps one rollback rewound (``rewound_steps``) and the most optimizer steps the
model lost in one (Adam's step count before and after), whether a rollback after the first went back to step 0, and
the held-out loss at the end, as ratios to the fault-free run and to the old defaults, side by side in one run. The
trigger watches the gradient norm (``monitor="grad_norm"``, its other arguments at their defaults), and
``max_rollbacks`` is raised to 100 so that every run reaches its end.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from harness import Result, common_args, machine, run_table

from gradkit.doors.loop import GradKit
from gradkit.policies import rollback as core
from gradkit.policies.rollback import StepSnapshot
from gradkit.step.protocol import StepContext
from lightning_gradkit import SpikeRollback
from lightning_gradkit.demos import ByteDataset, GPTConfig, TinyGPT, TinyGPTModule, stdlib_text
from lightning_gradkit.trainer_door import TrainerPipeline

MODEL = dict(n_layer=8, n_head=4, n_embd=128, block_size=64)
LOG_EVERY = 50


def rollback(n: int) -> tuple[pl.LightningModule, dict[str, Any]]:
    callback = SpikeRollback("loss", snapshot_every_n_steps=n)
    return TinyGPTModule(**MODEL), {"callbacks": [callback], "strategy": "gradkit"}


CONFIGS = {
    "a_none": lambda: (TinyGPTModule(**MODEL), {"strategy": "gradkit"}),
    "b_snapshot_every_200": lambda: rollback(200),
    "c_snapshot_every_50": lambda: rollback(50),
}


class CaptureTimer(pl.Callback):
    """After a few real steps (the AdamW state exists), time ``SpikeRollback``'s capture of one snapshot."""

    def __init__(self, rollback: SpikeRollback, after: int, captures: int) -> None:
        self.rollback = rollback
        self.after = after
        self.captures = captures
        self.times: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        if trainer.global_step != self.after:
            return
        for _ in range(self.captures):
            start = time.perf_counter()
            self.rollback._capture(TrainerPipeline.of(trainer).context(trainer, pl_module))
            if torch.cuda.is_available():
                # The copies are queued non-blocking: include the time until they are done (the worst case).
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - start)


def measure_capture(captures: int, accelerator: str) -> tuple[float, int, int]:
    """Median time of one snapshot, the host bytes of the ring (``keep=2``) and the parameter bytes."""
    from harness import gpt_loader, quiet_trainer

    callback = SpikeRollback("loss", snapshot_every_n_steps=10**9)
    timer = CaptureTimer(callback, after=3, captures=captures)
    module = TinyGPTModule(**MODEL)
    trainer = quiet_trainer(accelerator, strategy="gradkit", max_steps=3, callbacks=[callback, timer])
    trainer.fit(module, gpt_loader(MODEL["block_size"]))
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    return statistics.median(timer.times), callback.snapshot_bytes, param_bytes


def mean_line(results: dict[str, Result], baseline: str) -> str:
    base = statistics.fmean(results[baseline].times)
    return "\n".join(
        f"  mean {name}: {statistics.fmean(r.times) * 1e3:.2f} ms, ratio {statistics.fmean(r.times) / base:.4f}"
        for name, r in results.items()
    )


# -- recurring faults ---------------------------------------------------------------------------------------------
FAULT_MODEL = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=48)
FAULT_FROM, FAULT_LENGTH, FAULT_FACTOR, FAULT_BATCH = 120, 4, 100.0, 16


class FaultyAdamW(torch.optim.AdamW):
    """AdamW whose learning rate is ``FAULT_FACTOR`` times the scheduled one for ``FAULT_LENGTH`` steps every
    ``period`` attempted steps from ``FAULT_FROM``: raised inside ``step`` only (nested in the escalation's hooks),
    so no snapshot ever holds the raised value."""

    def __init__(self, params: Any, period: int | None) -> None:
        super().__init__(params, lr=3e-3)
        self.period = period
        self.clock = 0  # the attempted step, set by the loop

    def step(self, closure: Any = None) -> Any:
        hot = self.period is not None and self.clock >= FAULT_FROM
        hot = hot and (self.clock - FAULT_FROM) % self.period < FAULT_LENGTH
        factor = FAULT_FACTOR if hot else 1.0
        for group in self.param_groups:
            group["lr"] *= factor
        try:
            return super().step(closure)
        finally:
            for group in self.param_groups:
                group["lr"] /= factor


class OldRule(core.SpikeRollback):
    """``SpikeRollback`` with the rule for a spike that comes back as it was before issue 39 (kept here to measure
    against): the snapshot the previous rollback restored is restored again only when the spike began later after
    the resume than the previous one after that snapshot, or when the rollback escalates; else the older one. A
    restored snapshot keeps the step it was taken at."""

    _reach: int | None = None

    def _resume_from(self, slot: StepSnapshot, ctx: StepContext) -> None:
        return

    def _choose(self, ctx: StepContext, step: int, start: int, values: dict[str, Any]) -> StepSnapshot:
        if self._rollbacks >= self.max_rollbacks:
            return super()._choose(ctx, step, start, values)  # stops with the budget's error
        further = self._reach is not None and self._resumed_at is not None and start - self._resumed_at > self._reach
        again = further or self._escalation.escalates(step, self._resumed_at)
        usable = [s for s in self._ring if s.valid and (again or s.id != self._last_restored_id)]
        candidates = [s for s in usable if s.step <= start] or [s for s in usable if s.origin == "resume"]
        if not candidates:
            self._stop(ctx, step, values, "no snapshot is left to restore.")
        slot = max(candidates, key=lambda s: s.id)
        self._reach = start - (self._resumed_at if slot.id == self._last_restored_id else slot.step)
        return slot


# The grad-norm trigger: on this model the loss trigger at its defaults (z 6, patience 3) sees 1 or 2 of the 4-7
# recurrences, so the rule that picks the snapshot would hardly be exercised.
MONITOR: dict[str, Any] = dict(monitor="grad_norm", max_rollbacks=100)
FAULT_CONFIGS: dict[str, Any] = {
    "old defaults": lambda: OldRule(**MONITOR),
    # The old rule with `escalate_lr_factor=0.5` trains as the new rule with it: an escalating rollback could already
    # restore the same snapshot (only its `to_step` and `rewound_steps` differ), so it is left out.
    "new defaults": lambda: core.SpikeRollback(**MONITOR),
    "new rule, escalate 0.5": lambda: core.SpikeRollback(**MONITOR, escalate_lr_factor=0.5),
    "new rule, escalate 0.1": lambda: core.SpikeRollback(**MONITOR, escalate_lr_factor=0.1),
}


def fault_data() -> tuple[ByteDataset, tuple[torch.Tensor, torch.Tensor]]:
    """The first 90% of the text trains; 256 windows of the last 10% are the held-out set."""
    text = stdlib_text()
    cut = int(len(text) * 0.9)
    held = ByteDataset(text[cut:], FAULT_MODEL.block_size)
    pairs = [held[i] for i in range(256)]
    return ByteDataset(text[:cut], FAULT_MODEL.block_size), (
        torch.stack([x for x, _ in pairs]),
        torch.stack([y for _, y in pairs]),
    )


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, FAULT_MODEL.vocab_size), y.reshape(-1))


def fault_run(period: int | None, make: Any, steps: int, data: Any) -> dict[str, Any]:
    """Train from seed 0 on the same batches; returns the rollbacks, escalations, steps lost and held-out loss."""
    train, (held_x, held_y) = data
    torch.manual_seed(0)
    model = TinyGPT(FAULT_MODEL)
    optimizer = FaultyAdamW(model.parameters(), period)
    policy = make() if make is not None else None
    kit = GradKit(model, optimizer, [policy] if policy is not None else [], log_dir=False)
    order = torch.Generator().manual_seed(1)
    lost: list[int] = []
    stopped = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a warning per rollback
        for step in range(steps):
            idx = torch.randint(len(train), (FAULT_BATCH,), generator=order).tolist()
            loss = lm_loss(model, torch.stack([train[i][0] for i in idx]), torch.stack([train[i][1] for i in idx]))
            loss.backward()
            kit.note_loss(loss)
            optimizer.clock = step
            before = adam_steps(optimizer)
            rollbacks = policy.rollbacks if policy is not None else 0
            try:
                kit.step(optimizer)
            except RuntimeError:
                stopped = step
                break
            if policy is not None and policy.rollbacks > rollbacks:
                lost.append(before - adam_steps(optimizer))
            optimizer.zero_grad(set_to_none=True)
    kit.close()
    model.eval()
    with torch.no_grad():
        held = float(lm_loss(model, held_x, held_y))
    history = policy.state_dict()["history"] if policy is not None else []
    escalations = policy.state_dict()["escalations"] if policy is not None else 0
    return {"history": history, "lost": lost, "held": held, "stopped": stopped, "escalations": escalations}


def adam_steps(optimizer: torch.optim.Optimizer) -> int:
    return max((int(s["step"]) for s in optimizer.state.values() if "step" in s), default=0)


def fault_table(steps: int, periods: list[int]) -> None:
    """Print the table of the module docstring, a row as soon as its run ends."""
    data = fault_data()
    clean = fault_run(None, None, steps, data)["held"]
    print(f"machine: {machine()}; TinyGPT {FAULT_MODEL}, batch {FAULT_BATCH}, AdamW lr 3e-3, {steps} steps")
    print(
        f"fault: lr x{FAULT_FACTOR:g} for {FAULT_LENGTH} steps every P steps from step {FAULT_FROM}; "
        "SpikeRollback(monitor='grad_norm', max_rollbacks=100), other arguments at their defaults "
        "(snapshot_every_n_steps=100, keep=2, patience=3, z_threshold=6)"
    )
    print(f"fault-free held-out loss: {clean:.4f}\n")
    print(
        "| P | configuration | rollbacks | escalations | most rewound | most lost | back to 0 | held-out "
        "| / fault-free | / old defaults |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for period in periods:
        old = None
        for name, make in FAULT_CONFIGS.items():
            r = fault_run(period, make, steps, data)
            old = r["held"] if old is None else old
            rewound = max((h["rewound_steps"] for h in r["history"]), default=0)
            back_to_0 = any(h["to_step"] == 0 for h in r["history"][1:])
            held = f"{r['held']:.4f}" + (f" (stopped at {r['stopped']})" if r["stopped"] is not None else "")
            print(
                f"| {period} | {name} | {len(r['history'])} | {r['escalations']} | {rewound} | "
                f"{max(r['lost'], default=0)} | {'yes' if back_to_0 else 'no'} | {held} | {r['held'] / clean:.3f} "
                f"| {r['held'] / old:.3f} |",
                flush=True,
            )


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--captures", type=int, default=20, help="snapshots timed back to back")
    parser.add_argument("--faults", action="store_true", help="recurring faults instead of the snapshot overhead")
    parser.add_argument("--fault-steps", type=int, default=360, help="optimizer steps per recurring-fault run")
    parser.add_argument("--periods", type=int, nargs="+", default=[20, 40, 80], help="fault periods, in steps")
    parser.set_defaults(steps=110)
    args = parser.parse_args()
    if args.faults:
        torch.set_num_threads(1)  # the 2-layer model trains fastest on one thread
        start = time.perf_counter()
        fault_table(args.fault_steps, args.periods)
        print(f"wall time: {time.perf_counter() - start:.0f} s")
        return
    results = run_table(args, CONFIGS, MODEL, "Snapshot overhead (no spikes)", "a_none", LOG_EVERY)
    print(mean_line(results, "a_none"))
    capture, ring_bytes, param_bytes = measure_capture(args.captures, args.accelerator)
    # The denominator: the median step over all runs of all configurations (as in bench_engine_cost.py), steadier
    # on a shared machine than one configuration's median.
    step = statistics.median([t for r in results.values() for t in r.times])
    print(f"median step over all configurations: {step * 1e3:.2f} ms")
    print(f"one snapshot (parameters + buffers + AdamW state + small states): {capture * 1e3:.2f} ms")
    for n in (50, 200):
        print(f"amortized at snapshot_every_n_steps={n}: {100 * capture / n / step:.3f}% of step time")
    print(
        f"host memory, keep=2: {ring_bytes / 2**20:.1f} MiB = {ring_bytes / param_bytes:.2f}x the parameter bytes "
        f"({param_bytes / 2**20:.1f} MiB)"
    )


if __name__ == "__main__":
    main()
