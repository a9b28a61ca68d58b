"""Rank-local state in ``torch.distributed.checkpoint`` (DCP) checkpoints: each rank's own values under a key of its
rank, the rest once.

DCP saves a value that every rank puts under the same key once (a plain tensor, or any other object: one rank's copy
is written, every rank reads it back). That suits what the ranks agree on (the policies' statistics, computed from
all-reduced values) and is wrong for what each rank holds its own of: ``SpikeRollback(save_snapshots=True)``'s ring,
where each snapshot holds the rank's FSDP2 shards, its module buffers and its RNG states. A policy names those
entries of its ``state_dict`` (``rank_local_keys()``); here they are taken out of the state and saved under
``rank_local.rank<r>``, one item that rank ``r`` writes (into its own ``__<r>_0.distcp`` file: the ring is saved
sharded) and only rank ``r`` reads. The item is a tuple, which DCP keeps whole (its flattening walks dicts and lists,
not tuples) and pickles with the tensors in it: a load needs no template of the ring's shape, which a fresh run
cannot know (how many snapshots, which of them hold optimizer state).

A resume with another world size is refused when rank-local state was saved, with the reason: the shards, buffers
and RNG states of a rank belong to the run's sharding and data split, and a rank of the new world has no such state
of its own. A policy without rank-local state resumes on any world size.

Two users: :meth:`gradkit.GradKit.distributed_state` (a DCP ``Stateful`` for a loop of your own) and the Trainer's
``GradKitModelParallelStrategy`` (its ``save_checkpoint`` / ``load_checkpoint`` with
``save_distributed_checkpoint=True``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from gradkit.step.protocol import Roster

__all__ = [
    "RANK_LOCAL_FOLDER",
    "DistributedState",
    "load_rank_local",
    "merge_rank_local",
    "save_rank_local",
    "split_rank_local",
]

#: The sub-folder of a Trainer's distributed checkpoint that holds the rank-local states (Lightning's own DCP save
#: holds the model and the optimizers only; its ``meta.pt`` holds the callbacks' states, from rank 0).
RANK_LOCAL_FOLDER = "gradkit_rank_local"
_KEY = "rank_local"


class _Kit(Protocol):
    """What :class:`DistributedState` reads of a :class:`~gradkit.GradKit` (named here, not imported: the loop door
    imports this module)."""

    policies: list[Any]

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None: ...


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def split_rank_local(
    states: Mapping[str, Any], keys: Mapping[str, tuple[str, ...]]
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``states`` (policy states by policy key) without their rank-local entries, and those entries by policy key.

    Args:
        states: the policies' states, as ``GradKit.state_dict()["policies"]`` or a Trainer checkpoint's
            ``"callbacks"`` hold them.
        keys: each policy's rank-local entries (``Roster.rank_local()``).
    """
    shared, local = dict(states), {}
    for key, names in keys.items():
        state = shared.get(key)
        if isinstance(state, Mapping):
            shared[key] = {k: v for k, v in state.items() if k not in names}
            local[key] = {k: state[k] for k in names if k in state}
    return shared, local


def merge_rank_local(states: Mapping[str, Any], local: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The inverse of :func:`split_rank_local`: ``local``'s entries put back into the states they came from."""
    merged = dict(states)
    for key, entries in local.items():
        if key in merged:
            merged[key] = {**merged[key], **entries}
    return merged


def _entries(local: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """This rank's part of a DCP state dict: the world size (the same on every rank, saved once) and its rank-local
    states under its own key, a tuple that DCP keeps whole."""
    rank, world = _rank_and_world()
    return {"world_size": world, f"rank{rank}": (local,)}


def _adopt(entries: Mapping[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """This rank's rank-local states from the loaded :func:`_entries`.

    Raises:
        ValueError: the states were saved by another number of ranks (and hold something).
    """
    rank, world = _rank_and_world()
    (local,) = entries[f"rank{rank}"]
    saved = int(entries["world_size"])
    if saved != world and any(value for states in local.values() for value in states.values()):
        raise ValueError(_world_size_message(saved, world, list(local), where))
    return local


def _world_size_message(saved: int, world: int, policies: list[str], where: str) -> str:
    return (
        f"{where} holds the rank-local state of {', '.join(policies)} saved by {saved} rank(s), and this run has "
        f"{world}: each rank's state (SpikeRollback's snapshots: that rank's FSDP2 shards, module buffers and RNG "
        f"states) belongs to the sharding and the data split of {saved} ranks, and no rank here has its own. Resume "
        f"with {saved} ranks, or with `save_snapshots=False` (the run takes its first snapshot at the resume)."
    )


class DistributedState:
    """A :class:`~gradkit.GradKit` as a ``torch.distributed.checkpoint`` ``Stateful``:
    ``kit.distributed_state()`` builds it (see there).

    :meth:`state_dict` holds, as two kinds of DCP items: ``state``, the kit's :meth:`~gradkit.GradKit.state_dict`
    but the rank-local entries (the same on every rank: one copy saved), and, when a policy has rank-local state,
    ``rank_local.rank<r>``, each rank's own entries, and ``rank_local.world_size``.
    """

    def __init__(self, kit: _Kit) -> None:
        self._kit = kit

    def _keys(self) -> dict[str, tuple[str, ...]]:
        return Roster(self._kit.policies).rank_local()

    def state_dict(self) -> dict[str, Any]:
        """The items to save; also the template DCP loads into (each item is replaced whole by the saved one)."""
        state = self._kit.state_dict()
        keys = self._keys()
        shared, local = split_rank_local(state["policies"], keys)
        # A tuple: DCP saves it as one item, whatever the policies' states hold (their shape changes as a run goes).
        out: dict[str, Any] = {"state": ({**state, "policies": shared},)}
        if keys:
            out[_KEY] = _entries(local)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume the kit from what DCP loaded into :meth:`state_dict`'s items.

        Raises:
            ValueError: the rank-local state was saved by another number of ranks.
        """
        (state,) = state_dict["state"]
        local = _adopt(state_dict[_KEY], "The checkpoint") if _KEY in state_dict else {}
        self._kit.load_state_dict({**state, "policies": merge_rank_local(state["policies"], local)})


def save_rank_local(local: dict[str, dict[str, Any]], folder: Path) -> None:
    """Save this rank's rank-local states (by policy key) into the DCP checkpoint ``folder``; a collective."""
    from torch.distributed.checkpoint import save

    save({_KEY: _entries(local)}, checkpoint_id=folder)


def load_rank_local(folder: Path, policies: list[str]) -> dict[str, dict[str, Any]]:
    """This rank's rank-local states from :func:`save_rank_local`'s ``folder``; a collective. ``policies``: the keys
    of the policies that have rank-local state in this run (for the message).

    Raises:
        ValueError: ``folder`` was saved by another number of ranks (read from its metadata first, so that a rank
            the checkpoint has nothing for gets this reason rather than a missing key).
    """
    from torch.distributed.checkpoint import FileSystemReader, load

    rank, world = _rank_and_world()
    saved = [k for k in FileSystemReader(folder).read_metadata().state_dict_metadata if k.startswith(f"{_KEY}.rank")]
    if len(saved) != world:
        raise ValueError(_world_size_message(len(saved), world, policies, f"The checkpoint {folder.parent}"))
    loaded: dict[str, Any] = {_KEY: {"world_size": None, f"rank{rank}": None}}
    load(loaded, checkpoint_id=folder)
    return _adopt(loaded[_KEY], f"The checkpoint {folder.parent}")
