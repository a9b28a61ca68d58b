"""Where a flagged non-finite step began, and the one sentence that says so.

Pure functions over what :class:`~lightning_gradkit.NonFiniteGuard` gathered from every rank at a flagged step
(the losses, the parameters with a non-finite gradient, the forensic replay's finding): no Trainer, no tensors.

- :func:`nonfinite_kind`: the event's ``what`` (loss, gradients or both).
- :class:`Culprit` and :func:`locate_culprit`: the one meaning of ``culprit`` in every mode.
- :func:`first_bad_batch`: the micro-batch where the non-finite value was first seen.
- :func:`step_summary`: the console line; the error and the event say the same.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from lightning_gradkit._arguments import name_list

__all__ = ["Culprit", "first_bad_batch", "locate_culprit", "nonfinite_kind", "step_summary"]


def nonfinite_kind(loss: bool, grads: bool) -> str:
    """The event's ``what`` for a step whose loss (on some rank) and/or gradients were non-finite."""
    if loss and grads:
        return "nonfinite_loss_and_grads"
    return "nonfinite_loss" if loss else "nonfinite_grads"


class Culprit(NamedTuple):
    """Where the first non-finite value was localized, and how (the one meaning of ``culprit`` in every mode).

    Attributes:
        name: a module name, ``"<batch>"``, ``"<loss>"`` or a parameter name; ``None`` when not localized.
        source: ``"replay"`` (a forensic replay reproduced it), ``"loss"`` (no replay; the loss was non-finite) or
            ``"gradients"`` (no replay, finite losses; the first parameter, in the optimizer's order, whose gradient
            was non-finite); ``None`` with ``name``.
        text: one sentence for the console and errors.
        batch: the micro-batch whose replay found it (``None`` unless ``source == "replay"``).
    """

    name: str | None
    source: str | None
    text: str
    batch: int | None


def locate_culprit(
    per_rank: list[dict[str, Any]], bad_ranks: list[int], params: list[str], no_replay: str = "no replay"
) -> Culprit:
    """The replay's finding (ranks with a bad loss first), else the first parameter with a non-finite gradient.

    ``no_replay`` says why no replay ran at this step (for the message)."""
    ordered = sorted(per_rank, key=lambda r: (r["rank"] not in bad_ranks, r["rank"]))
    for r in ordered:
        f = r["finding"]
        if f is not None and f.get("culprit") is not None:
            batch = f.get("batch_idx")
            text = f"{r['described']} (replay of batch {batch} on rank {r['rank']})"
            return Culprit(f["culprit"], "replay", text, batch)
    replays = [r for r in per_rank if r["finding"] is not None]
    unfinished = [r for r in replays if r["finding"]["phase"] != "not_reproduced"]
    why = no_replay
    if unfinished:  # a replay that failed or could not run: never reported as a finite one
        r = unfinished[0]
        batch = r["finding"].get("batch_idx")
        why = f"{r['described']}; " + (f"batch {batch}, " if batch is not None else "") + f"rank {r['rank']}"
    elif replays:
        why = "the replay stayed finite"
    if bad_ranks:
        return Culprit("<loss>", "loss", f"the loss was already non-finite on rank(s) {bad_ranks} ({why})", None)
    if params:
        return Culprit(params[0], "gradients", f"the first parameter with a non-finite gradient ({why})", None)
    return Culprit(None, None, f"not localized ({why})", None)


def first_bad_batch(per_rank: list[dict[str, Any]], window: list[int]) -> int:
    """The first micro-batch of the step whose loss was non-finite on some rank, else the step's last one."""
    firsts = [
        next((k for k, v in enumerate(r["losses"]) if not math.isfinite(v)), None) for r in per_rank if r["losses"]
    ]
    found = [k for k in firsts if k is not None and k < len(window)]
    return window[min(found)] if found else window[-1]


def step_summary(
    step: int,
    batch: int,
    window: list[int],
    what: str,
    bad_ranks: list[int],
    grad_ranks: list[int],
    params: list[str],
    culprit: Culprit,
) -> str:
    """The console line of a flagged step; errors and the event say the same."""
    if what == "fp16_overflow":
        return f"fp16 gradient overflow at step {step}."
    where = f"batch {batch}" + (f" (the step's batches {window[0]}-{window[-1]})" if len(window) > 1 else "")
    parts = [f"non-finite values at step {step}: {where};"]
    if bad_ranks:
        parts.append(f"loss non-finite on rank(s) {bad_ranks};")
    if params:
        parts.append(f"non-finite gradients on rank(s) {grad_ranks} in {name_list(params, quote=True)};")
    if culprit.name is not None:
        parts.append(f"culprit `{culprit.name}`: {culprit.text}.")
    else:
        parts.append(f"culprit {culprit.text}.")
    return " ".join(parts)
