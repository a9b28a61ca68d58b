r"""One escalation ladder over the policies that see trouble coming: :class:`EscalationLadder` answers finding after
finding with a warning, a learning-rate cut and moment reset, a mitigation (QK-Clip, z-loss), a rollback and at last a
stop with an exit code a job scheduler can act on; a calm stretch climbs back down. Pure PyTorch; the ``Trainer``
callback of the same name is :class:`lightning_gradkit.EscalationLadder`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from gradkit._util.arguments import check_float, check_int, name_list
from gradkit.policies.early_warning import EarlyWarning
from gradkit.policies.escalation import Escalation, module_params
from gradkit.policies.qk_clip import QKClip
from gradkit.policies.rollback import SpikeRollback
from gradkit.report.events import EventLog
from gradkit.step.plan import StepOutcome, StepStats
from gradkit.step.protocol import Door, Stage, StepContext, served, state_key

__all__ = ["EXIT_TEMPFAIL", "LADDER_EVENT", "RUNGS", "EscalationLadder", "TrainingStopped"]

Rung = Literal["warn", "lr_cut", "mitigate", "rollback", "stop"]
#: The rungs, in the order a ladder climbs them.
RUNGS: tuple[str, ...] = ("warn", "lr_cut", "mitigate", "rollback", "stop")
#: The default exit code of the ``stop`` rung: ``EX_TEMPFAIL`` of BSD's ``sysexits.h`` ("a temporary failure; the
#: user is invited to retry"), which no Python error exits with (an uncaught exception exits with 1).
EXIT_TEMPFAIL = 75
#: The ``what`` of a transition's event in ``gradkit_events.jsonl``.
LADDER_EVENT = "escalation_ladder"
_CALM = "calm"  # the ladder on no rung


class TrainingStopped(SystemExit):
    """Training stopped by :class:`~gradkit.EscalationLadder`'s ``stop`` rung. A :class:`SystemExit` whose ``code`` is
    the ladder's ``exit_code``: uncaught, it ends the process with that status (and no traceback); ``except Exception``
    does not catch it. The Lightning ``Trainer`` lets it through after its ``on_exception`` hooks.

    Attributes:
        exit_code: the process's exit status (the ladder's ``exit_code``).
        message: why training stopped (also the ladder's last warning and event).
    """

    def __init__(self, exit_code: int, message: str) -> None:
        super().__init__(exit_code)
        self.exit_code = exit_code
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[type, tuple[int, str]]:
        return type(self), (self.exit_code, self.message)


class EscalationLadder:
    r"""One escalation for the whole loop: each finding of :class:`~gradkit.EarlyWarning` or
    :class:`~gradkit.SpikeRollback` (or a check of your own, :meth:`report`) climbs one rung, and each rung acts
    harder than the one before; a calm stretch climbs down.

    **Rungs** (``rungs``, any of them, in this order):

    - ``warn``: a warning and an event;
    - ``lr_cut``: the learning rate times ``escalate_lr_factor``, ramping back to the schedule over
      ``escalate_rewarmup_steps`` applied steps, and the optimizer moments reset (``escalate_reset_moments``:
      ``"spiking"``, the modules the findings since the last cut named, all parameters when none did), as
      ``EarlyWarning(action="escalate")`` does (:mod:`gradkit.policies.escalation`);
    - ``mitigate``: every ``QKClip(enabled=False)`` of the loop switched on, and :attr:`z_loss_weight` (0 until
      then) set to ``z_loss``: add ``ladder.z_loss_term(logits)`` (``z_loss_weight * logsumexp(logits)**2``, averaged:
      PaLM's z-loss) to your loss, and the mitigation reaches your loss without a change of your forward;
    - ``rollback``: ``SpikeRollback`` restores its newest snapshot taken before the first finding since the ladder
      left calm (else its oldest), and steps over its ``skip_batches``, as its own rollbacks do;
    - ``stop``: a warning, an event, then :class:`~gradkit.TrainingStopped` (a ``SystemExit`` with ``exit_code``): the
      process ends with that status behind every door, for a job scheduler to act on (``docs/jobs/early_warning.md``
      shows Slurm and Kubernetes). ``SpikeRollback`` out of rollbacks (``max_rollbacks``) stops here too.

    **Climbing.** The ladder climbs one rung when ``climb_findings`` steps with findings fall within
    ``climb_within_steps`` optimizer steps (a step counts once, whatever reports at it); on the top rung the same
    condition repeats its action. ``EarlyWarning``'s detector fires a series again only after it grew ``growth``
    times since, so the next finding says the rung below did not hold. **Descending.** After ``calm_steps`` steps
    without a finding it climbs down one rung (at the next step: every policy has reported by then, whatever the
    order of the policies), and again after ``calm_steps`` more; the mitigations are on from ``mitigate`` up, so they
    go off below it (the learning rate ramps back by itself).

    The ladder owns the escalation: ``EarlyWarning(action="escalate")`` and a ``SpikeRollback`` that escalates are
    refused beside it. It acts where it hears of a finding (in the reporting policy's ``after_step``, or in
    :meth:`report`), so the next step trains under the new rung; every rank decides alike (the findings are).
    Its state (the rung, the findings counted, the learning-rate ramp) travels in checkpoints: a resumed run goes on
    from the same rung, its mitigations on; a rollback does not rewind it. Cost: none on a step without a finding but
    the host read of the skip flag during a learning-rate ramp (as ``EarlyWarning`` escalating).

    Every transition is an ``escalation_ladder`` event in ``gradkit_events.jsonl`` (``from_rung``, ``to_rung``,
    ``direction``: ``"climb"``, ``"descend"`` or ``"repeat"``, ``source``, the ``reason`` in ``values`` and the
    rung's action: ``lr_factor`` and ``reset_params``, ``qk_clip`` and ``z_loss_weight``, ``rolled_back``,
    ``exit_code``), a warning, and an entry of ``transitions``.

    Args:
        rungs: the rungs to climb, a subset of ``["warn", "lr_cut", "mitigate", "rollback", "stop"]`` in this
            order; ``None``: all five.
        climb_findings: steps with findings that climb one rung (>= 1).
        climb_within_steps: the optimizer steps those findings must fall within (>= 1).
        calm_steps: optimizer steps without a finding that climb down one rung (>= 1); ``None``: never down.
        escalate_lr_factor: at ``lr_cut``, multiply the learning rate by this factor in ``(0, 1)``, ramping back to
            the schedule (``None``: no cut).
        escalate_rewarmup_steps: applied optimizer steps over which the cut ramps back to 1 (>= 1).
        escalate_reset_moments: at ``lr_cut``, reset the optimizer state of the ``"spiking"`` modules (those the
            findings named; all parameters when none did), of ``"all"`` parameters, or ``"none"``.
        z_loss: the z-loss weight from ``mitigate`` up (PaLM's is 1e-4); ``None``: no z-loss.
        exit_code: the process's exit status at ``stop`` (1 to 255); 75 (``EX_TEMPFAIL``) by default.

    Raises:
        ValueError: at construction, naming the argument: an unknown, repeated or misordered rung, a number out of
            range, an ``lr_cut`` rung with nothing to do, a ``z_loss`` without a ``mitigate`` rung; at ``attach``,
            a rung whose means the loop lacks (``rollback`` without a ``SpikeRollback``, ``mitigate`` without a
            ``QKClip(enabled=False)`` or ``z_loss``), or a policy that escalates on its own.

    Example::

        >>> import torch
        >>> from gradkit import EscalationLadder, GradKit, TrainingStopped
        >>> model = torch.nn.Linear(4, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> ladder = EscalationLadder(rungs=["warn", "lr_cut", "stop"], calm_steps=None)
        >>> kit = GradKit(model, optimizer, ladder, log_dir=False)
        >>> for check in [False, True, True, False, True]:
        ...     model(torch.ones(2, 4)).sum().backward()
        ...     _ = kit.step(optimizer)
        ...     optimizer.zero_grad()
        ...     if check:  # a check of your own failed at this step
        ...         try:
        ...             ladder.report("validation loss rose")
        ...         except TrainingStopped as stop:
        ...             print("exit code", stop.code)
        exit code 75
        >>> [(step, to) for step, _, to, _ in ladder.transitions]
        [(1, 'warn'), (2, 'lr_cut'), (4, 'stop')]
    """

    stage = Stage.OBSERVE
    #: A rollback does not rewind the ladder (its rung is the run's history, as the events are).
    survives_rollback = True

    def __init__(
        self,
        rungs: list[Rung] | None = None,
        climb_findings: int = 1,
        climb_within_steps: int = 100,
        calm_steps: int | None = 1000,
        escalate_lr_factor: float | None = 0.1,
        escalate_rewarmup_steps: int = 300,
        escalate_reset_moments: Literal["none", "all", "spiking"] = "spiking",
        z_loss: float | None = None,
        exit_code: int = EXIT_TEMPFAIL,
    ) -> None:
        self.rungs: list[str] = _checked_rungs(rungs)
        self.climb_findings = check_int("climb_findings", climb_findings, 1, hint="1 climbs at every finding.")
        self.climb_within_steps = check_int(
            "climb_within_steps", climb_within_steps, 1, hint="E.g. `climb_within_steps=100`."
        )
        if calm_steps is not None:
            check_int("calm_steps", calm_steps, 1, hint="None never climbs down; e.g. `calm_steps=1000`.")
        self.calm_steps = calm_steps
        self._escalation = Escalation(
            escalate_lr_factor, escalate_rewarmup_steps, escalate_reset_moments, 1, 0.97, 6.0, 2
        )
        self.escalate_lr_factor = self._escalation.lr_factor
        self.escalate_rewarmup_steps = self._escalation.rewarmup_steps
        self.escalate_reset_moments = self._escalation.reset_moments
        if "lr_cut" in self.rungs and escalate_lr_factor is None and escalate_reset_moments == "none":
            raise ValueError(
                "`rungs` holds 'lr_cut', and `escalate_lr_factor=None` with `escalate_reset_moments='none'` gives it "
                "nothing to do: give a factor (e.g. 0.1) or a moment reset ('spiking', 'all'), or leave 'lr_cut' out."
            )
        if z_loss is not None:
            check_float("z_loss", z_loss, above=0.0, hint="PaLM's z-loss weight is 1e-4; None: no z-loss.")
            if "mitigate" not in self.rungs:
                raise ValueError(
                    f"`z_loss={z_loss!r}` is switched on at the 'mitigate' rung, which `rungs={self.rungs}` leaves "
                    "out: add 'mitigate' to `rungs`, or leave `z_loss=None`."
                )
        self.z_loss = z_loss
        hint = "0 tells a scheduler the job succeeded; the default is 75 (EX_TEMPFAIL)."
        self.exit_code = check_int("exit_code", exit_code, 1, 255, hint=hint)
        self._z_weight = torch.zeros(())
        self._z_read = False
        self._start_run_state()

    def _start_run_state(self) -> None:
        """The loop's members (set at ``attach``) and the ladder's state: calm, nothing counted."""
        self._door: Door | None = None
        self._model: nn.Module | None = None
        self._events: EventLog | None = None
        self._clips: list[QKClip] = []
        self._rollback: SpikeRollback | None = None
        self._reporters: list[EarlyWarning | SpikeRollback] = []
        self._level = 0  # 0: calm; k: `rungs[k - 1]`
        self._recent: list[int] = []  # the steps with findings counted towards the next climb
        self._step: int | None = None  # the step of the last finding (a step counts once)
        self._last: int | None = None  # where the calm is counted from: the last finding or descent
        self._episode: int | None = None  # the first finding since the ladder left calm (what a rollback goes before)
        self._modules: list[str] = []  # the modules the findings since the last cut named
        #: Every transition: ``(step, from rung, to rung, reason)``.
        self.transitions: list[tuple[int, str, str, str]] = []

    @property
    def state_key(self) -> str:
        return state_key(self)

    @property
    def rung(self) -> str:
        """The current rung (``"calm"``: none)."""
        return self.rungs[self._level - 1] if self._level else _CALM

    @property
    def z_loss_weight(self) -> Tensor:
        """The weight of the z-loss, a scalar on the model's device once attached, 0 below the ``mitigate`` rung and
        ``z_loss`` from it up. Read it at every step (the ladder changes it in place)."""
        self._z_read = True
        return self._z_weight

    def z_loss_term(self, logits: Tensor) -> Tensor:
        """The z-loss term to add to the loss: ``z_loss_weight * logsumexp(logits, -1)**2`` averaged over the
        positions (PaLM, Chowdhery et al. 2022); 0 below the ``mitigate`` rung."""
        log_z = torch.logsumexp(logits.float(), dim=-1)
        return self.z_loss_weight.to(log_z.device) * log_z.square().mean()

    # -- the loop ------------------------------------------------------------------------------------------------
    def attach(self, ctx: Door, model: nn.Module) -> None:
        """Find the policies that report to the ladder and those its rungs act through.

        Raises:
            ValueError: a policy that escalates on its own, or a rung whose means the loop lacks.
        """
        policies = ctx.policies()
        self._refuse_own_escalations(policies)
        self._clips = [p for p in policies if isinstance(p, QKClip) and not p.enabled]
        self._rollback = next((p for p in policies if isinstance(p, SpikeRollback)), None)
        if "rollback" in self.rungs and self._rollback is None:
            raise ValueError(
                f"EscalationLadder's 'rollback' rung restores SpikeRollback's snapshots, and {ctx.policies_owner()} no "
                "SpikeRollback: add `SpikeRollback(...)`, or leave 'rollback' out of `rungs`."
            )
        if "mitigate" in self.rungs and not self._clips and self.z_loss is None:
            raise ValueError(
                "EscalationLadder's 'mitigate' rung switches on `QKClip(enabled=False)` and the z-loss weight, and "
                f"{ctx.policies_owner()} no QKClip(enabled=False) and `z_loss=None`: add `QKClip(..., enabled=False)`, "
                "give `z_loss=1e-4` (and add `ladder.z_loss_term(logits)` to the loss), or leave 'mitigate' out of "
                "`rungs`."
            )
        self._reporters = [p for p in policies if isinstance(p, (EarlyWarning, SpikeRollback))]
        for reporter in self._reporters:
            reporter._ladder = self
        if not self._reporters:
            ctx.warn(
                "EscalationLadder: no EarlyWarning or SpikeRollback reports to it, so it climbs only on "
                "`ladder.report(...)`. Add `EarlyWarning(...)` to the loop for the early-warning signals."
            )
        self._door, self._model = ctx, model
        self._events = EventLog(ctx.log_dir, rank=ctx.global_rank) if ctx.log_dir is not None else None
        self._z_weight = self._z_weight.to(ctx.device)
        self._escalation.start(ctx)  # the learning-rate hooks on the loop's optimizers
        self._apply_switches()

    def _refuse_own_escalations(self, policies: Sequence[object]) -> None:
        for policy in policies:
            if isinstance(policy, EarlyWarning) and policy.action == "escalate":
                raise ValueError(
                    "EarlyWarning(action='escalate') cuts the learning rate on its own, and EscalationLadder owns the "
                    "escalation: use `EarlyWarning(action='warn')` (the ladder's 'lr_cut' rung cuts it)."
                )
            if isinstance(policy, SpikeRollback) and (
                policy.escalate_lr_factor is not None or policy.escalate_reset_moments != "none"
            ):
                raise ValueError(
                    "SpikeRollback(escalate_...) escalates on its own, and EscalationLadder owns the escalation: "
                    "leave `escalate_lr_factor=None` and `escalate_reset_moments='none'` (the ladder's 'lr_cut' rung "
                    "cuts the learning rate and resets the moments)."
                )

    def detach(self, ctx: StepContext) -> None:
        self._escalation.remove_hooks()
        for reporter in self._reporters:
            if reporter._ladder is self:
                reporter._ladder = None
        self._reporters = []

    def finish(self, ctx: StepContext) -> None:
        self._escalation.remove_hooks()

    def observe(self, stats: StepStats, outcome: StepOutcome, ctx: StepContext) -> None:
        self._escalation.ramp_step(lambda: outcome.decision.skip is not None and outcome.skip_on_host())

    def after_step(self, ctx: StepContext) -> None:
        self._settle(ctx.global_step - 1)

    # -- findings ------------------------------------------------------------------------------------------------
    def report(self, reason: str, source: str = "user", modules: Sequence[str] = ()) -> None:
        """A finding at the step just done: ``EarlyWarning`` and ``SpikeRollback`` report theirs; report a check of
        your own (between steps, on every rank alike). It counts towards the next climb, and the climb acts at once.

        Args:
            reason: what was found (in the event and the warning).
            source: who found it.
            modules: the modules concerned (the moment reset of ``escalate_reset_moments="spiking"``).

        Raises:
            TrainingStopped: the ladder climbed to its ``stop`` rung.
        """
        door = served(self._door, self)
        step = door.global_step - 1
        self._settle(step)
        self._modules += [m for m in modules if m not in self._modules]
        if self._step == step:
            return  # a step counts once, whatever reports at it
        self._step = self._last = step
        if self._episode is None:
            self._episode = step
        self._recent = [s for s in self._recent if step - s < self.climb_within_steps] + [step]
        if len(self._recent) >= self.climb_findings:
            self._recent = []
            self._move(door, step, min(self._level + 1, len(self.rungs)), reason, source)

    def stop(self, reason: str, source: str = "user", step: int | None = None) -> None:
        """Go to the ``stop`` rung now, if the ladder has one (``SpikeRollback`` out of rollbacks calls it); without
        one, return.

        Raises:
            TrainingStopped: with ``exit_code``.
        """
        if "stop" in self.rungs:
            door = served(self._door, self)
            self._move(door, door.global_step - 1 if step is None else step, len(self.rungs), reason, source)

    def _settle(self, step: int) -> None:
        """Climb down one rung when the steps before ``step`` held ``calm_steps`` without a finding (whole steps: every
        policy has reported for them, so the decision does not depend on the order of the policies)."""
        if self.calm_steps is None or not self._level or self._last is None:
            return
        if step - 1 - self._last >= self.calm_steps:
            self._last = step - 1
            door = served(self._door, self)
            self._move(door, step, self._level - 1, f"no finding for {self.calm_steps} steps", "calm")

    # -- transitions ---------------------------------------------------------------------------------------------
    def _move(self, door: Door, step: int, to: int, reason: str, source: str) -> None:
        before = self.rung
        direction = "climb" if to > self._level else "descend" if to < self._level else "repeat"
        self._level = to
        fields, done = self._act(door, step, reason) if direction != "descend" else ({}, "")
        self._apply_switches()
        if not self._level:  # calm again: the next finding starts a new episode
            self._episode, self._recent, self._modules = None, [], []
        self.transitions.append((step, before, self.rung, reason))
        if self._events is not None:
            self._events.write(
                step=step,
                batch_idx=door.batch_idx,
                rank=None,
                what=LADDER_EVENT,
                culprit=None,
                values={"reason": reason},
                source=source,
                from_rung=before,
                to_rung=self.rung,
                direction=direction,
                **fields,
            )
        message = f"EscalationLadder: {before} -> {self.rung} at step {step} ({reason}){done}."
        if self.rung == "stop":
            message += f" The process exits with code {self.exit_code}."
        door.warn(message)
        if self.rung == "stop":
            raise TrainingStopped(self.exit_code, message)

    def _act(self, door: Door, step: int, reason: str) -> tuple[dict[str, Any], str]:
        """The current rung's action: the event's fields and, for the warning, what was done."""
        rung = self.rung
        if rung == "lr_cut":
            return self._cut(door, step)
        if rung == "mitigate":
            return self._mitigate(door)
        if rung == "rollback":
            assert self._rollback is not None and self._episode is not None
            rolled = self._rollback.roll_back_now(door, self._episode, f"rung 'rollback' ({reason})")
            done = f"; rolled back to before step {self._episode}" if rolled else "; this step rolls back already"
            return {"rolled_back": rolled, "before_step": self._episode}, done
        if rung == "stop":
            return {"exit_code": self.exit_code}, ""
        return {}, ""

    def _cut(self, door: Door, step: int) -> tuple[dict[str, Any], str]:
        modules, self._modules = self._modules, []
        spiking = None
        if modules and self.escalate_reset_moments == "spiking" and self._model is not None:
            spiking = (modules, module_params(self._model, modules), {})
        fields, _ = self._escalation.escalate(door, spiking, step, 0, 0, step)
        keys = ("escalation", "lr_factor", "rewarmup_steps", "reset_moments", "reset_modules", "reset_params")
        kept = {k: fields[k] for k in keys}
        done = []
        if kept["lr_factor"] is not None:
            done.append(f"learning rate x{kept['lr_factor']:.3g}, back over {self.escalate_rewarmup_steps} steps")
        if self.escalate_reset_moments != "none":
            where = name_list(modules, quote=True) if spiking is not None else "all trained parameters"
            done.append(f"optimizer moments reset for {kept['reset_params']} parameters ({where})")
        return kept, "; " + "; ".join(done)

    def _mitigate(self, door: Door) -> tuple[dict[str, Any], str]:
        done = []
        if self._clips:
            done.append(f"QK-Clip on ({len(self._clips)} QKClip)")
        if self.z_loss is not None:
            done.append(f"z-loss weight {self.z_loss:g}")
            if not self._z_read:
                door.warn(
                    "EscalationLadder: the z-loss weight goes on, and the loss has never read it: add "
                    "`ladder.z_loss_term(logits)` (or `ladder.z_loss_weight * ...`) to the loss for the z-loss to act."
                )
        return {"qk_clip": len(self._clips), "z_loss_weight": self.z_loss}, "; " + ", ".join(done)

    def _apply_switches(self) -> None:
        """The mitigations follow the rung: on from ``mitigate`` up (a device fill, no sync)."""
        on = "mitigate" in self.rungs and self._level > self.rungs.index("mitigate")
        for clip in self._clips:
            clip.active = on
        self._z_weight.fill_(self.z_loss if on and self.z_loss is not None else 0.0)

    # -- state ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "rung": self.rung,
            "recent": list(self._recent),
            "step": self._step,
            "last": self._last,
            "episode": self._episode,
            "modules": list(self._modules),
            "transitions": [list(t) for t in self.transitions],
            "escalation": self._escalation.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume on the saved rung, its mitigations on.

        Raises:
            ValueError: the saved rung is not one of ``rungs``.
        """
        rung = state_dict["rung"]
        if rung != _CALM and rung not in self.rungs:
            raise ValueError(
                f"The checkpoint's EscalationLadder is on the rung {rung!r}, which `rungs={self.rungs}` does not hold: "
                "resume with the saved run's `rungs`."
            )
        self._level = self.rungs.index(rung) + 1 if rung != _CALM else 0
        self._recent = [int(s) for s in state_dict["recent"]]
        self._step, self._last, self._episode = state_dict["step"], state_dict["last"], state_dict["episode"]
        self._modules = list(state_dict["modules"])
        self.transitions = [(int(s), str(a), str(b), str(r)) for s, a, b, r in state_dict["transitions"]]
        self._escalation.load_state_dict(state_dict["escalation"])
        self._apply_switches()


def _checked_rungs(rungs: Sequence[str] | None) -> list[str]:
    """``rungs`` as a list, or all five.

    Raises:
        ValueError: naming ``rungs``: not a list, empty, an unknown, repeated or misordered rung.
    """
    if rungs is None:
        return list(RUNGS)
    hint = f"Give a subset of {list(RUNGS)} in this order, e.g. `rungs=['warn', 'lr_cut', 'stop']`."
    if isinstance(rungs, str) or not isinstance(rungs, Sequence) or not rungs:
        raise ValueError(f"`rungs` must be a non-empty list of rungs, got {rungs!r}. {hint}")
    unknown = [r for r in rungs if r not in RUNGS]
    if unknown:
        raise ValueError(f"`rungs` holds unknown rung(s) {unknown}, got {list(rungs)!r}. {hint}")
    order = [RUNGS.index(r) for r in rungs]
    if order != sorted(set(order)):
        raise ValueError(f"`rungs` must climb in order, each rung once, got {list(rungs)!r}. {hint}")
    return list(rungs)
