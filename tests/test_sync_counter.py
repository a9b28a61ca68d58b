"""The test suite's host-sync counter covers every call gradkit's own SyncAudit treats as a sync."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from helpers import count_syncs
from lightning_gradkit.diagnostics.host_sync import SYNC_CALLS

# One call per kind of host sync, with the key the counter files it under.
SYNCING: dict[str, tuple[Callable[[Tensor], Any], str]] = {
    "item": (lambda t: t.sum().item(), "item"),
    "bool": (lambda t: bool(t.sum()), "__bool__"),
    "if": (lambda t: 1 if t.sum() > 0 else 0, "__bool__"),
    "int": (lambda t: int(t.sum()), "__int__"),
    "float": (lambda t: float(t.sum()), "__float__"),
    "index": (lambda t: [1, 2, 3][t.long().sum() % 3], "__index__"),
    "operator.index": (lambda t: operator.index(t.long().sum()), "__index__"),
    "tolist": (lambda t: t.tolist(), "tolist"),
    "cpu": (lambda t: t.cpu(), "cpu"),
    "to cpu": (lambda t: t.to("cpu"), "cpu"),
    "to device cpu": (lambda t: t.to(device="cpu"), "cpu"),
    "numpy": (lambda t: t.numpy(), "numpy"),
    "nonzero method": (lambda t: t.nonzero(), "nonzero"),
    "torch.nonzero": (lambda t: torch.nonzero(t), "nonzero"),
    "torch.where one argument": (lambda t: torch.where(t > 0), "nonzero"),
    "argwhere": (lambda t: torch.argwhere(t), "argwhere"),
    "boolean mask indexing": (lambda t: t[t > 0], "mask_index"),
    "masked_select": (lambda t: torch.masked_select(t, t > 0), "masked_select"),
    "torch.equal": (lambda t: torch.equal(t, t), "equal"),
    "Tensor.equal": (lambda t: t.equal(t), "equal"),
    "allclose": (lambda t: torch.allclose(t, t), "allclose"),
    "is_nonzero": (lambda t: torch.is_nonzero(t.sum()), "is_nonzero"),
    "unique": (lambda t: torch.unique(t), "unique"),
    "bincount": (lambda t: torch.bincount(t.long().abs()), "bincount"),
    "repeat_interleave with tensor repeats": (
        lambda t: torch.repeat_interleave(t, t.long().abs() + 1),
        "repeat_interleave",
    ),
    "repr": (lambda t: repr(t), "__repr__"),
    "format": (lambda t: f"{t.sum():.3f}", "__format__"),
    "contains": (lambda t: 1.0 in t, "__contains__"),
}

NOT_SYNCING: dict[str, Callable[[Tensor], Any]] = {
    "arithmetic": lambda t: (t * 2 + 1).sum(),
    "comparison to a tensor": lambda t: t > 0,
    "torch.where three arguments": lambda t: torch.where(t > 0, t, 0.0),
    "integer-tensor indexing": lambda t: t[torch.tensor([0, 2])],
    "python indexing": lambda t: t[1:3],
    "dtype cast": lambda t: t.to(torch.float64),
    "foreach norm": lambda t: torch._foreach_norm([t, t]),
    "clamp on device": lambda t: torch.clamp(t.norm(), max=1.0),
    "repeat_interleave with output_size": lambda t: torch.repeat_interleave(
        t, torch.ones(4, dtype=torch.long), output_size=4
    ),
    "shape": lambda t: t.shape[0] + t.numel(),
}


def test_every_kind_in_sync_audits_list_has_a_case_here() -> None:
    covered = {func.__name__ for func in SYNC_CALLS} - {"__complex__", "__array__", "unique_consecutive"}
    assert covered <= {key for _, key in SYNCING.values()}


@pytest.mark.parametrize("name", sorted(SYNCING))
def test_each_sync_kind_is_counted_once_under_its_key(name: str) -> None:
    call, key = SYNCING[name]
    t = torch.tensor([1.0, -2.0, 3.0, 0.5])
    with count_syncs() as counter, counter.active():
        call(t)
    assert counter.counts == {key: 1}


@pytest.mark.parametrize("name", sorted(NOT_SYNCING))
def test_operations_that_stay_on_the_device_are_not_counted(name: str) -> None:
    t = torch.tensor([1.0, -2.0, 3.0, 0.5])
    with count_syncs() as counter, counter.active():
        NOT_SYNCING[name](t)
    assert counter.total == 0, counter.counts


def test_only_watched_methods_are_counted() -> None:
    class Holder:
        def syncing(self, t: Tensor) -> float:
            return t.sum().item()

    holder = Holder()
    t = torch.ones(3)
    with count_syncs() as counter:
        counter.watch(holder, "syncing")
        t.sum().item()  # outside the watched method
        holder.syncing(t)
        holder.syncing(t)
    assert counter.counts == {"item": 2}
    t.sum().item()  # after the context: the mode is gone
    assert counter.counts == {"item": 2}
