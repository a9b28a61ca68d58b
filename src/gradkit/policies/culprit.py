"""Where a flagged non-finite step began, and the one sentence that says so: the replay of the step's micro-batches
(:func:`replay_micro_batches`), then pure functions over what :class:`~gradkit.NonFiniteGuard` gathered from
every rank (the losses, the parameters with a non-finite gradient, the replay's finding), ending in
:func:`step_summary`, the console line that the error and the event repeat.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch.distributed as dist
from torch import Tensor, nn

from gradkit._util.arguments import name_list
from gradkit.policies.forensics import Finding, describe_error, find_nonfinite_origin
from gradkit.step.norms import world_size
from gradkit.step.protocol import MicroBatch as MicroBatch  # re-exported: the doors built it from here
from gradkit.step.replay import replay
from gradkit.step.snapshot import Snapshot

__all__ = [
    "REPLAY_STAYED_FINITE",
    "SAMPLE_ID_KEYS",
    "Culprit",
    "MicroBatch",
    "Reproducibility",
    "bad_sample_ids",
    "culprit_text",
    "first_bad_batch",
    "gather_ranks",
    "id_list",
    "locate_culprit",
    "nonfinite_kind",
    "replay_micro_batches",
    "reproducibility",
    "sample_ids",
    "step_summary",
    "what_text",
]

#: Keys of a dict batch whose value names its samples (the first one present is used).
SAMPLE_ID_KEYS = ("id", "ids", "index", "indices", "sample_id", "sample_ids")

# An event's ``what`` in words (:func:`what_text`).
_WHAT_TEXT = {
    "nonfinite_loss": "non-finite loss",
    "nonfinite_grads": "non-finite gradients",
    "nonfinite_loss_and_grads": "non-finite loss and gradients",
    "norm_overflow": "gradient norm overflow (every element finite)",
}
# Finding phases of a replay that did not see the non-finite value, or did not run to the end.
_NOT_SEEN = ("not_reproduced", "failed", "unavailable")
# Why no replay ran where the door kept no micro-batch (a loop that gave `note_loss` no `replay`).
_NO_MICRO_BATCH = (
    "no micro-batch to replay was handed over: in a loop of your own, pass "
    "`kit.note_loss(loss, replay=lambda: loss_fn(model(batch)))` each micro-batch"
)


def replay_micro_batches(
    module: nn.Module,
    batches: list[MicroBatch],
    backward_scale: Tensor | None = None,
    anomaly: bool = False,
    buffers: Snapshot | None = None,
) -> Finding:
    """Replay a step's micro-batches in order; the first that makes a non-finite value again names the culprit.

    Every micro-batch is replayed, also after one found the culprit, so that the collectives a replayed forward
    issues (``self.all_gather`` in ``training_step``) pair up across ranks as they did in training. Each runs in
    :func:`~gradkit.step.replay.replay` with its RNG state set: ``module``'s state comes out unchanged.
    ``backward_scale`` and ``anomaly`` are :func:`~gradkit.policies.forensics.find_nonfinite_origin`'s. ``buffers``: the
    module's buffers as the bad step's window found them (a replay one step late, after the next step's forwards
    wrote them), set inside each micro-batch's replay context (which puts the current ones back after it).

    Returns:
        The first finding with a culprit (its ``detail["batch_idx"]`` set), else the first micro-batch whose replay
        failed or could not run, else ``"not_reproduced"``; ``"unavailable"`` when no micro-batch can be replayed.
    """
    if not any(b.compute_loss is not None for b in batches):
        reason = next((b.unavailable for b in batches if b.unavailable), _NO_MICRO_BATCH)
        return Finding(None, "unavailable", {"reason": reason})
    first: Finding | None = None
    failed: Finding | None = None
    for batch in batches:
        if batch.compute_loss is None:
            finding = Finding(None, "unavailable", {"reason": batch.unavailable or _NO_MICRO_BATCH})
        else:
            try:
                with replay(module, batch.rng):
                    if buffers is not None:
                        buffers.restore()  # in place: the replay context restores what it captured on entry
                    finding = find_nonfinite_origin(module, batch.compute_loss, backward_scale, anomaly)
            except Exception as err:  # forensics must never be what stops a run
                finding = Finding(None, "failed", {"error": describe_error(err)})
        if first is None and finding.culprit is not None:
            finding.detail["batch_idx"] = batch.batch_idx
            first = finding
        elif failed is None and finding.phase in ("failed", "unavailable"):
            # A micro-batch whose replay did not run to the end: it may be the one that made the value.
            finding.detail["batch_idx"] = batch.batch_idx
            failed = finding
    return first or failed or Finding(None, "not_reproduced")


def nonfinite_kind(loss: bool, grads: bool) -> str:
    """The event's ``what`` for a step whose loss (on some rank) and/or gradients were non-finite."""
    if loss and grads:
        return "nonfinite_loss_and_grads"
    return "nonfinite_loss" if loss else "nonfinite_grads"


def what_text(what: str) -> str:
    """An event's ``what`` in words, for a warning's first line."""
    return _WHAT_TEXT.get(what, what)


def gather_ranks(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (a collective: all ranks must call it at the same point)."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


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


def culprit_text(culprit: Culprit) -> str:
    """``culprit `name` (from the replay)``, for a warning's first line."""
    if culprit.name is None:
        return "culprit not localized"
    how = {"replay": "from the replay", "loss": "no replay", "gradients": "first non-finite gradient, no replay"}
    return f"culprit `{culprit.name}` ({how.get(culprit.source or '', culprit.source)})"


#: Why a replay that stayed finite proves nothing: it covers ``training_step`` and its backward only.
REPLAY_STAYED_FINITE = (
    "the replay of training_step and its backward stayed finite: the non-finite value came from outside them (a "
    "hook such as on_after_backward, a callback, the optimizer) or from non-deterministic hardware"
)


class Reproducibility(NamedTuple):
    """What the forensic replay proved: ``reproducible``, the ranks whose replay reproduced it, and why."""

    reproducible: bool | None
    reproduced_on: list[int]
    reason: str


def reproducibility(per_rank: list[dict[str, Any]]) -> Reproducibility:
    """Whether the forensic replay reproduced the non-finite value, the ranks whose replay did, and the reason.

    ``True`` when a rank's replay made it again (a data or model fault: it comes back with the same batch and
    weights). Otherwise ``None``: nothing is proved (:data:`REPLAY_STAYED_FINITE` when every replay ran to the end,
    else no replay ran, or one failed or could not run).

    Example::

        >>> reproducibility([{"rank": 0, "finding": {"phase": "not_reproduced"}}]).reproducible is None
        True
        >>> reproducibility([{"rank": 1, "finding": {"phase": "forward"}}])[:2]
        (True, [1])
        >>> reproducibility([{"rank": 0, "finding": None}]).reason
        'no replay ran'
    """
    replays = [r for r in per_rank if r["finding"] is not None]
    reproduced = [r["rank"] for r in replays if r["finding"]["phase"] not in _NOT_SEEN]
    if reproduced:
        return Reproducibility(
            True,
            reproduced,
            f"the replay of training_step and its backward made it again on rank(s) {reproduced}: the fault is in "
            "the data or the model",
        )
    if replays and all(r["finding"]["phase"] == "not_reproduced" for r in replays):
        return Reproducibility(None, [], REPLAY_STAYED_FINITE)
    if replays:
        failed = [r["rank"] for r in replays if r["finding"]["phase"] != "not_reproduced"]
        return Reproducibility(None, [], f"the replay failed or could not run on rank(s) {failed}")
    return Reproducibility(None, [], "no replay ran")


def sample_ids(batch: Any) -> Any | None:
    """The ids a batch carries for its samples: the value of its first key in :data:`SAMPLE_ID_KEYS` (a dict
    batch), as it is (a tensor stays on its device: no host read), else ``None``. :func:`id_list` reads it."""
    if not isinstance(batch, Mapping):
        return None
    key = next((k for k in SAMPLE_ID_KEYS if k in batch), None)
    return None if key is None else batch[key]


def bad_sample_ids(ids: list[Any] | None, finding: Mapping[str, Any] | None) -> list[Any] | None:
    """The ids of the samples that made the first non-finite value: those at the replay finding's non-finite
    ``rows`` when its first non-finite tensor is as long as the batch (dim 0 the batch's), else all of ``ids``.

    Example::

        >>> bad_sample_ids([10, 11, 12, 13], {"rows": [2], "rows_of": 4})
        [12]
        >>> bad_sample_ids([10, 11, 12, 13], {"rows": [0, 1, 2, 3], "rows_of": 4})  # every row: not one sample's
        [10, 11, 12, 13]
        >>> bad_sample_ids([10, 11], {"rows": [0], "rows_of": 8})  # another dim 0 (tokens, heads)
        [10, 11]
    """
    if not ids or not finding:
        return ids
    rows, rows_of = finding.get("rows"), finding.get("rows_of")
    if not rows or rows_of != len(ids) or len(rows) == len(ids):
        return ids
    return [ids[r] for r in rows]


def id_list(ids: Any) -> list[Any] | None:
    """Sample ids as a JSON-friendly list (a tensor is read to the host: call it on a flagged step only).

    Example::

        >>> id_list(sample_ids({"x": None, "ids": [7, 3]}))
        [7, 3]
        >>> id_list(sample_ids((None, None))) is None
        True
    """
    if ids is None:
        return None
    if isinstance(ids, Tensor):
        return ids.detach().reshape(-1).tolist()
    values = list(ids) if isinstance(ids, (list, tuple)) else [ids]
    return [i if isinstance(i, (int, str)) else str(i) for i in values]


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
    replay: Reproducibility | None = None,
    ids: dict[str, list[Any]] | None = None,
) -> str:
    """The console line of a flagged step; errors and the event say the same.

    ``replay`` comes from :func:`reproducibility`; ``ids`` are the sample ids of the bad micro-batch per rank
    (:func:`sample_ids`)."""
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
    if ids:
        shown = "; ".join(f"rank {r}: {v[:16]}{' ...' if len(v) > 16 else ''}" for r, v in ids.items())
        parts.append(f"Sample ids of batch {batch}: {shown}.")
    if replay is not None and replay.reproducible:
        parts.append(
            f"The replay reproduced it on rank(s) {replay.reproduced_on}: a reproducible fault points at the data or "
            "the model."
        )
    elif replay is not None and replay.reason == REPLAY_STAYED_FINITE:
        seen = sorted(set(bad_ranks) | set(grad_ranks))
        parts.append(f"Seen on rank(s) {seen}; {REPLAY_STAYED_FINITE}.")
    return " ".join(parts)
