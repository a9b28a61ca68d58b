"""Declared data-skip ranges: the batches of given optimizer steps are drawn and dropped (OLMo-core's
``steps_to_skip``, Megatron's ``iterations_to_skip``, the restarts of PaLM after a spike).

:class:`StepsToSkip` names optimizer-step ranges; a door asks it (``drops_batch``) whether the current step is one of
them, and then draws the step's batches and trains on none of them: no forward, no backward, no optimizer step. The
step counts as attempted, as a step a guard skipped does (``global_step`` moves on, ``gradkit/skipped_steps`` counts
it, the LR schedulers hold), so the data order after the range is the uninterrupted run's: the batch of step ``s`` is
the batch of step ``s``. Behind the loop door, ask :attr:`GradKit.drops_batch <gradkit.GradKit.drops_batch>`
before the forward and call ``kit.step(optimizer)`` as for any step; under a ``Trainer`` the GradKit strategy drops
the batch itself (:class:`lightning_gradkit.StepsToSkip`).

Each range is an event in ``gradkit_events.jsonl`` when its first step is dropped (``what="steps_skipped"``) with
``steps_to_skip=[[start, stop]]``: the form in which ``SpikeRollback`` lists the steps whose batches its rollback
left out (its ``rollback`` events). :func:`steps_from_events` reads both back, so a run restarted from an earlier
checkpoint can be told to skip them. Pure PyTorch; no Lightning here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from gradkit._util.arguments import shown
from gradkit.report.events import EVENTS_FILENAME, EventLog
from gradkit.step.protocol import Door, Stage, StepContext, state_key

__all__ = ["SKIPPED_EVENT", "StepsToSkip", "merge_ranges", "steps_from_events"]

#: The ``what`` of the event of a dropped range.
SKIPPED_EVENT = "steps_skipped"


def merge_ranges(ranges: Sequence[Sequence[int]], argument: str = "steps") -> list[list[int]]:
    """Check ``[start, stop)`` step ranges and merge those that overlap or touch, in order.

    Raises:
        ValueError: naming ``argument``, for ``ranges`` that are not a list of ranges (a number, a string) or an
            entry that is not two integers ``0 <= start < stop``.

    Example::

        >>> merge_ranges([[300, 320], [100, 150], [140, 160], [160, 170]])
        [[100, 170], [300, 320]]
    """
    if not isinstance(ranges, (list, tuple)):  # a number has no ranges to iterate, a string's would be its letters
        raise ValueError(
            f"`{argument}` must be a list of [start, stop) optimizer-step ranges, got {shown(ranges)}. E.g. "
            "`[[1200, 1450]]` drops the batches of steps 1200 to 1449, `[[7, 8]]` step 7 alone."
        )
    checked = []
    for entry in ranges:
        pair = list(entry) if isinstance(entry, (list, tuple)) else []
        if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair):
            raise ValueError(
                f"`{argument}` entries are [start, stop) optimizer-step ranges, two integers, got {entry!r}. E.g. "
                "`[[1200, 1450]]` drops the batches of steps 1200 to 1449."
            )
        start, stop = pair
        if not 0 <= start < stop:
            raise ValueError(f"`{argument}` entry {entry!r} needs 0 <= start < stop (stop is excluded).")
        checked.append([start, stop])
    merged: list[list[int]] = []
    for start, stop in sorted(checked):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return merged


def steps_from_events(path: str | Path) -> list[list[int]]:
    """The step ranges a run left out, from its ``gradkit_events.jsonl`` (or the directory holding it): the ranges
    :class:`StepsToSkip` dropped and those ``SpikeRollback``'s rollbacks left out (``steps_to_skip`` of each event),
    merged. Give them to ``StepsToSkip(steps=...)`` to restart from an earlier checkpoint without those batches.

    Example::

        >>> import tempfile
        >>> directory = Path(tempfile.mkdtemp())
        >>> EventLog(directory).write(step=130, batch_idx=130, rank=None, what="rollback", culprit=None, values={},
        ...                           steps_to_skip=[[100, 331]])
        >>> steps_from_events(directory)
        [[100, 331]]
    """
    path = Path(path)
    path = path / EVENTS_FILENAME if path.is_dir() else path
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: give the run's {EVENTS_FILENAME} or its directory.")
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    ranges = [r for event in events for r in event.get("steps_to_skip") or []]
    return merge_ranges(ranges, argument=str(path))


class StepsToSkip:
    r"""Drop the batches of declared optimizer-step ranges: drawn from the data, trained on by none of the doors.

    ``steps`` are ``[start, stop)`` ranges of the loop's optimizer-step count (``trainer.global_step``, the loop
    door's step): the batches of steps ``start`` to ``stop - 1`` are drawn (the data order after them stays the
    uninterrupted run's) and dropped: no forward, no backward, no optimizer step. A dropped step counts as attempted
    and skipped, as a step a guard skipped: the step count moves on, ``gradkit/skipped_steps`` counts it, the LR
    schedulers hold, and a forward run regardless (behind the loop door) has its buffer writes put back and its
    gradients dropped. With gradient accumulation every micro-batch of a dropped step is dropped.

    The ranges are saved in checkpoints: a run resumed from one keeps skipping the ranges it was given, and those
    given again are merged in; added at a restart from a checkpoint saved without it, it starts fresh (a warning
    says so), behind every door. Each range is an ``steps_skipped`` event with ``steps_to_skip=[[start, stop]]`` when
    its first step is dropped; ``SpikeRollback``'s ``rollback`` events list the steps they left out in the same
    form, and :func:`~gradkit.policies.steps_to_skip.steps_from_events` collects both from an events file.

    Args:
        steps: the ``[start, stop)`` ranges (pairs of integers), in any order; overlapping ranges are merged.

    Raises:
        ValueError: at construction, for ``steps`` that are not a list of ranges (``nan``, ``-1``, ``True``) or a
            range that is not two integers ``0 <= start < stop``.

    Example::

        >>> import torch
        >>> from gradkit import GradKit, StepsToSkip
        >>> model = torch.nn.Linear(4, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> kit = GradKit(model, optimizer, StepsToSkip(steps=[[1, 3]]), log_dir=False)
        >>> applied = []
        >>> for batch in torch.ones(5, 2, 4):
        ...     if not kit.drops_batch:
        ...         model(batch).sum().backward()
        ...     applied.append(kit.step(optimizer))
        >>> applied, kit.skipped_steps
        ([True, False, False, True, True], 2)
    """

    stage = Stage.GUARD

    def __init__(self, steps: list[list[int]] | None = None) -> None:
        self.steps = merge_ranges([] if steps is None else steps)
        self._announced: list[list[int]] = []
        self._events: EventLog | None = None
        self._counted: int | None = None
        #: Optimizer steps dropped so far (one per step, whatever the micro-batches).
        self.dropped = 0

    @property
    def state_key(self) -> str:
        return state_key(self)

    def attach(self, ctx: Door, model: nn.Module) -> None:
        self._events = EventLog(ctx.log_dir, rank=ctx.global_rank) if ctx.log_dir is not None else None

    def may_skip(self) -> bool:
        return True  # a Trainer needs its GradKit strategy's gate for a dropped step

    def range_of(self, step: int) -> list[int] | None:
        """The declared range that holds ``step``, if any."""
        return next((r for r in self.steps if r[0] <= step < r[1]), None)

    def drops_batch(self, ctx: StepContext) -> bool:
        """Whether the batches of the current optimizer step are dropped (the doors ask, any number of times per
        step). The first answer of a range writes its event; the first of each step counts it."""
        step = ctx.global_step
        found = self.range_of(step)
        if found is None:
            return False
        if self._counted != step:
            self._counted = step
            self.dropped += 1
        if not any(a[0] < found[1] and found[0] < a[1] for a in self._announced):
            self._announced.append(list(found))
            if self._events is not None:
                self._events.write(
                    step=step,
                    batch_idx=ctx.batch_idx,
                    rank=None,
                    what=SKIPPED_EVENT,
                    culprit=None,
                    values={"declared": True},
                    source=type(self).__name__,
                    steps_to_skip=[[max(found[0], step), found[1]]],
                )
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"steps": [list(r) for r in self.steps], "announced": self._announced, "dropped": self.dropped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = merge_ranges([*self.steps, *state_dict["steps"]])
        self._announced = [list(r) for r in state_dict["announced"]]
        self.dropped = int(state_dict["dropped"])
