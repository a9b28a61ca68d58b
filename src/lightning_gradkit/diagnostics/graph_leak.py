"""GraphLeakGuard: tensors that keep autograd graphs alive from one training step into the next."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from gradkit._util.arguments import check_bool, check_choice, check_int, format_bytes
from lightning_gradkit.diagnostics.autograd_graph import (
    GraphFootprint,
    GraphTensor,
    OlderGraph,
    autograd_sequence_marker,
    gc_graph_tensors,
    graph_footprint,
    module_graph_tensors,
    object_graph_tensors,
    standard_attributes,
    steady_growth,
    storage_keys,
)
from lightning_gradkit.trainer_door import events_dir, instance_hook, write_rank_event

__all__ = ["GraphLeakGuard", "LeakReport"]


_ACTIONS = ("warn", "raise")
_MAX_LISTED = 5
_MIN_TREND_BYTES = 1 << 20


@dataclass(frozen=True)
class LeakReport:
    """What one check found: tensors holding autograd graphs created before the checked step.

    Attributes:
        step: ``trainer.global_step`` at the check.
        batch_idx: the total training batch index of the checked step.
        tensors: where each leaking tensor was found (``pl_module.history[120]``, or a GC location).
        footprint: the graphs, nodes and bytes they keep alive.
        truncated: the attribute walk stopped at its budget; more may be held.
    """

    step: int
    batch_idx: int
    tensors: list[GraphTensor]
    footprint: GraphFootprint
    truncated: bool

    @property
    def containers(self) -> dict[str, int]:
        """Leaking tensors per holding attribute (the path up to its first index), e.g. ``{"pl_module.history": 9}``."""
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[_container(t.path)] = counts.get(_container(t.path), 0) + 1
        return counts


def _container(path: str) -> str:
    cut = min((i for i in (path.find("["), path.find("{")) if i > 0), default=len(path))
    return path[:cut]


def _module_storages(module: nn.Module) -> set[Any]:
    """The parameters' and buffers' storages: alive anyway, never counted as pinned by a graph."""
    return storage_keys([*module.parameters(), *module.buffers()])


class GraphLeakGuard(Callback):
    r"""Find tensors that keep their autograd graph alive across training steps (``self.losses.append(loss)``).

    Storing a tensor without ``.detach()``/``.item()`` keeps its whole autograd graph alive: every node, and
    every saved activation that ``backward()`` did not free. Done each step, memory grows until the run dies.
    Every ``check_every_n_steps`` training steps, at the end of the step (after backward and the optimizer step),
    this callback looks for tensors whose autograd graph reaches into an EARLIER step:

    - in the LightningModule's attributes and those of its submodules (lists, tuples, dicts, sets, deques,
      dataclasses, plain objects, nested), named by path (``pl_module.history[120]``);
    - anywhere in the process with ``gc_scan=True`` (slower: it visits every Python object), named by the
      container or frame holding them where it can tell.

    "Earlier" is autograd's creation order of graph nodes (:mod:`lightning_gradkit.diagnostics.autograd_graph`): so
    ``history.append(loss)`` and ``total = total + loss`` (a new node each step, linked to all the old ones) are
    leaks, while a graph made in the current step and replaced in the next (``self.last_logits = logits``) is not.
    Parameters and buffers are never reported. The report gives the distinct graphs held, their nodes and the memory
    they pin (the tensors' storage and the saved tensors their graphs hold). The same checks also report, once and
    never raised, what ``training_step`` returned besides the loss when its graph still holds saved tensors (a branch
    ``backward()`` never ran: return it ``.detach()``-ed), and on CUDA a steady upward trend of
    ``torch.cuda.memory_allocated()`` over the last ``trend_window`` checks (a leak this walk cannot see).

    Findings go to :attr:`reports`, to a warning (once per holding attribute) or an exception, and to
    ``gradkit_events.jsonl`` (``what="graph_leak"``, ``"output_graph"``, ``"memory_trend"``). Steps that are not
    checked cost one integer check per hook. No state to resume: module attributes are not checkpointed.

    Args:
        check_every_n_steps: check one training step (batch) in every ``check_every_n_steps``: the ``n``-th,
            ``2n``-th, ... (batches counted across epochs). A leak is caught at the first check after the leaked
            tensor outlived its step.
        action: ``"warn"`` or ``"raise"`` (``RuntimeError``) when tensors hold graphs from earlier steps.
        gc_scan: also scan every live tensor through the garbage collector (finds leaks outside the module, e.g.
            in a global list; costs a pass over all Python objects per check).
        trend_window: number of checks the CUDA memory trend is fitted over (>= 3).

    Raises:
        ValueError: if ``check_every_n_steps`` is not a positive integer, ``action`` is not ``"warn"`` or
            ``"raise"``, or ``trend_window`` < 3.
        RuntimeError: with ``action="raise"``, at the first check that finds a leak (on every rank of a distributed
            run: the ranks decide together).

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import GraphLeakGuard
        >>> guard = GraphLeakGuard(check_every_n_steps=50, action="raise")
        >>> trainer = Trainer(callbacks=[guard])
    """

    def __init__(
        self,
        check_every_n_steps: int = 50,
        action: Literal["warn", "raise"] = "warn",
        gc_scan: bool = False,
        trend_window: int = 10,
    ) -> None:
        self.check_every_n_steps = check_int("check_every_n_steps", check_every_n_steps, 1)
        self.action = check_choice("action", action, _ACTIONS)
        self.gc_scan = check_bool("gc_scan", gc_scan)
        self.trend_window = check_int(
            "trend_window", trend_window, 3, hint="It is the number of checks a trend is fitted over."
        )
        self.reports: list[LeakReport] = []
        self.memory_trend: float | None = None
        self._marker: int | None = None
        self._skip: frozenset[str] = frozenset()
        self._warned: set[str] = set()
        self._memory: deque[int] = deque(maxlen=trend_window)
        self._events_dir: str | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(check_every_n_steps=self.check_every_n_steps)

    @instance_hook  # `callbacks=[GraphLeakGuard]`, the class, is refused with the fix
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._skip = standard_attributes(nn.Module, pl.LightningModule)
        self._events_dir = events_dir(trainer)  # collective: every rank calls setup
        self._warned.clear()
        self._memory.clear()
        self.memory_trend = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if (trainer.fit_loop.total_batch_idx + 1) % self.check_every_n_steps:
            return
        self._marker = autograd_sequence_marker()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        marker, self._marker = self._marker, None
        if marker is None:
            return
        self._check_outputs(trainer, pl_module, outputs, batch_idx)
        self._check_memory(trainer, pl_module, batch_idx)
        self._check_leaks(trainer, pl_module, marker, batch_idx)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._marker = None  # a batch skipped by `on_train_batch_start` returning -1 never reaches its end hook

    # -- checks ------------------------------------------------------------------------------------------------
    def _check_leaks(self, trainer: pl.Trainer, pl_module: pl.LightningModule, marker: int, batch_idx: int) -> None:
        report = self._scan(trainer, pl_module, marker)
        if report is not None:
            self.reports.append(report)
            if self._events_dir is not None:
                fp = report.footprint
                write_rank_event(
                    self._events_dir,
                    trainer,
                    "graph_leak",
                    batch_idx,
                    tensors=len(report.tensors),
                    graphs=fp.graphs,
                    nodes=fp.nodes,
                    pinned_bytes=fp.pinned_bytes,
                    containers=report.containers,
                    paths=[t.path for t in report.tensors[:20]],
                )
        if self.action == "raise":
            # Every rank checks the same steps: decide together, so that no rank is left waiting in a collective.
            if trainer.strategy.reduce_boolean_decision(report is not None, all=False):
                raise RuntimeError(
                    self._leak_message(report)
                    if report is not None
                    else "GraphLeakGuard: another rank found tensors holding autograd graphs from earlier steps."
                )
            return
        if report is not None and any(c not in self._warned for c in report.containers):
            self._warned.update(report.containers)
            rank_zero_warn(self._leak_message(report))

    def _scan(self, trainer: pl.Trainer, pl_module: pl.LightningModule, marker: int) -> LeakReport | None:
        older = OlderGraph(marker)
        found, truncated = module_graph_tensors(pl_module, "pl_module", self._skip, older)
        if self.gc_scan:
            found += gc_graph_tensors(older, {id(t) for _, t in found})
        if not found:
            return None
        return LeakReport(
            step=trainer.global_step,
            batch_idx=trainer.fit_loop.total_batch_idx,
            tensors=[GraphTensor.describe(path, t) for path, t in found],
            footprint=graph_footprint([t for _, t in found], _module_storages(pl_module)),
            truncated=truncated,
        )

    @staticmethod
    def _leak_message(report: LeakReport) -> str:
        fp = report.footprint
        lines = [
            f"GraphLeakGuard: at training step {report.batch_idx}, {len(report.tensors)} tensor(s) still hold "
            f"autograd graphs from earlier steps ({fp.graphs} graph(s), {fp.nodes} node(s), "
            f"{'at least ' if fp.truncated or report.truncated else ''}{format_bytes(fp.pinned_bytes)} pinned):"
        ]
        for container, count in report.containers.items():
            paths = [t.path for t in report.tensors if _container(t.path) == container]
            shown = ", ".join(paths[:_MAX_LISTED]) + (f", ... ({count} in all)" if count > _MAX_LISTED else "")
            first = next(t for t in report.tensors if _container(t.path) == container)
            lines.append(f"  {shown}  [grad_fn={first.grad_fn}, shape={list(first.shape)}]")
        lines.append(
            "Store `.detach()` (or `.item()` on logging steps) instead of the tensor, or compute it under "
            "`torch.no_grad()`: a kept graph grows memory every step."
        )
        return "\n".join(lines)

    def _check_outputs(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch_idx: int) -> None:
        if not isinstance(outputs, dict):
            return
        found = object_graph_tensors({k: v for k, v in outputs.items() if k != "loss"}, "outputs")
        returned = storage_keys(t for _, t in found)
        for path, tensor in found:
            key = path.split("]", 1)[0] + "]"  # outputs['<key>']
            if key in self._warned:
                continue
            footprint = graph_footprint([tensor], _module_storages(pl_module) | returned)
            if footprint.saved_bytes == 0:
                continue
            self._warned.add(key)
            if self._events_dir is not None:
                write_rank_event(
                    self._events_dir,
                    trainer,
                    "output_graph",
                    batch_idx,
                    path=path,
                    saved_bytes=footprint.saved_bytes,
                    nodes=footprint.nodes,
                )
            rank_zero_warn(
                f"GraphLeakGuard: `training_step` returned {path} with an autograd graph that still holds "
                f"{format_bytes(footprint.saved_bytes)} of saved tensors (a branch `backward()` did not run through). "
                "Lightning passes it to the `on_train_batch_end` hooks after the optimizer step, so that memory "
                "stays allocated through the step. Return it `.detach()`-ed."
            )

    def _check_memory(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> None:
        device = pl_module.device
        if device.type != "cuda":
            return
        self._memory.append(torch.cuda.memory_allocated(device))
        if len(self._memory) < self.trend_window or self.memory_trend is not None:
            return
        slope = steady_growth(list(self._memory), _MIN_TREND_BYTES)
        if slope is None:
            return
        self.memory_trend = slope
        per_step = slope / self.check_every_n_steps
        if self._events_dir is not None:
            write_rank_event(
                self._events_dir,
                trainer,
                "memory_trend",
                batch_idx,
                bytes_per_step=per_step,
                allocated=list(self._memory),
            )
        rank_zero_warn(
            f"GraphLeakGuard: allocated CUDA memory on {device} rose steadily over the last {self.trend_window} checks "
            f"({format_bytes(self._memory[0])} -> {format_bytes(self._memory[-1])}, about {format_bytes(per_step)} "
            "per step). Something keeps tensors from every step; if no graph leak is reported, look for tensors stored "
            "without `.detach()`/`.cpu()` outside the LightningModule."
        )
