"""The one owner of a loop's step accounting: how many attempted optimizer steps the model does not hold.

A step is *attempted* whatever happens to it (``global_step`` counts it behind the Trainer, the loop door's step
counter behind the others). Three things leave one out of the model, and each is counted here, nowhere else:

- a policy skipped it (``NonFiniteGuard``, ``SpikeGuard``, ``SpikeRollback`` decided ``skip``): :meth:`add_skip`,
  from the pipeline, with the step's device flag (no host read);
- a policy dropped its batches before the forward (``StepsToSkip``): :meth:`add_drop`, from the door;
- a rollback rewound it (``SpikeRollback``): :meth:`rewind`, which sets the count to the restored snapshot's plus
  the steps rewound, so that each attempted step is counted once, however many rollbacks rewind it.

So ``global_step - skipped`` is the number of updates the model holds (less a ``GradScaler``'s own overflow skips,
which are the scaler's). Everyone else reads :attr:`StepAccounting.skipped`: the monitor logs it as
``gradkit/skipped_steps``, the snapshots keep it, the doors report it. A checkpoint restores it with
:meth:`restore` (the loop door's own state, or, for the Trainer and checkpoints of earlier versions, the guards'
state, which has held a copy since before this owner existed).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["StepAccounting"]


class StepAccounting:
    """The count of attempted steps the model does not hold, as a device scalar (``None`` until the first step that
    may be skipped: a run without a skipping policy never allocates it).

    Example::

        >>> steps = StepAccounting()
        >>> steps.add_skip(torch.tensor(True))
        >>> steps.add_skip(torch.tensor(False))
        >>> steps.add_drop(torch.device("cpu"))
        >>> steps.host()
        2
        >>> steps.rewind(torch.tensor(1.0), 5, torch.device("cpu"))  # to a snapshot 5 steps back, 1 skipped then
        >>> steps.host()
        6
    """

    def __init__(self) -> None:
        self._skipped: Tensor | None = None

    @property
    def skipped(self) -> Tensor | None:
        """The count (a float32 device scalar), or ``None`` before any step could be skipped."""
        return self._skipped

    def host(self) -> int:
        """The count as a Python int (a host read: logging steps, the end of a run, a checkpoint)."""
        return 0 if self._skipped is None else int(self._skipped)

    def add_skip(self, flag: Tensor) -> None:
        """Count a step a policy may have skipped: ``flag`` is its device bool (read by no one here)."""
        if self._skipped is None:
            self._skipped = flag.to(torch.float32)
        else:  # a bool adds as 0.0 or 1.0: no cast of its own (one launch fewer a step)
            self._skipped = self._skipped + flag

    def add_drop(self, device: torch.device) -> None:
        """Count a step whose batches were dropped before the forward."""
        one = torch.ones((), device=device)
        self._skipped = one if self._skipped is None else self._skipped + one

    def rewind(self, base: Tensor | None, rewound: int, device: torch.device) -> None:
        """A rollback to a snapshot whose count was ``base`` (``None``: nothing skipped then), ``rewound`` steps back:
        the steps since the snapshot are no longer held, each counted once."""
        steps = torch.tensor(float(rewound), device=device)
        self._skipped = steps if base is None else base + steps

    def restore(self, count: float, device: torch.device) -> None:
        """The count a checkpoint held."""
        self._skipped = torch.tensor(float(count), device=device)

    def reset(self) -> None:
        """A new loop: nothing counted."""
        self._skipped = None

    def state_dict(self) -> dict[str, float]:
        """``{"skipped_steps": count}`` (a host read)."""
        return {"skipped_steps": float(self.host())}

    def load_state_dict(self, state: dict[str, float], device: torch.device) -> None:
        self.restore(state["skipped_steps"], device)
