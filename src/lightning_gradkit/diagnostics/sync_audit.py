"""SyncAudit: the user's source lines that make the host wait for the device, per training step."""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from gradkit._util.arguments import check_choice, check_int, check_strings
from lightning_gradkit.diagnostics.host_sync import (
    HostSyncRecorder,
    StepSyncs,
    SyncSite,
    SyncTable,
    format_sync_table,
    site_row,
)
from lightning_gradkit.diagnostics.sources import SourceClassifier, package_dirs
from lightning_gradkit.trainer_door import events_dir, instance_hook, write_rank_event

__all__ = ["SyncAudit"]


_MODES = ("warn", "raise")
_HOOK = "on_train_batch_end"


class SyncAudit(Callback):
    r"""Find the lines of your code that force a host-device synchronization, and how often per step.

    A ``loss.item()``, ``if torch.isnan(x).any():``, ``print(tensor)`` or ``.cpu()`` in a training step makes the
    CPU wait until the GPU has caught up; the time then shows up elsewhere (often in ``backward`` or the optimizer).
    On the audited steps this callback records every such sync made by your hooks and steps, attributes each to
    the line of YOUR code that caused it, and reports a table: ``file:line``, code, syncs per step and, where it can be
    measured, the share of the step's wall time the host spent stalled there.

    On CUDA the counts come from PyTorch's detector (``torch.cuda.set_sync_debug_mode("warn")``, on for the audited
    steps only): every real synchronization. Elsewhere (CPU runs, e.g. in CI) the calls that sync when their tensor
    lives on a GPU are recognised (``item``, ``if tensor``, ``print``, ``.cpu()``, ``nonzero``, boolean-mask
    indexing, ...: :data:`~lightning_gradkit.diagnostics.host_sync.SYNC_CALLS`), without a stall share.

    A sync is yours when the first frame outside PyTorch, NumPy, torchmetrics and the standard library (walking
    out from the call) is in your code; when that frame is in Lightning or lightning_gradkit, the sync is theirs
    (e.g. Lightning reading logged values) and goes to :attr:`framework_report` instead. An audited step runs from
    this callback's ``on_train_batch_start`` to the end of the LightningModule's ``on_train_batch_end``: the
    ``training_step``, backward, the optimizer step with its hooks, and the batch hooks after this callback's.
    Validation and data loading are outside. Steps that are not audited cost one integer check per hook.

    The table is emitted (rank zero) after the first audited step and, if it changed, at the end of training. Each
    audited step in which your code synced is also an event (``what="host_sync"``) in ``gradkit_events.jsonl``.

    Args:
        every_n_steps: audit one training step (batch) in every ``every_n_steps``: the ``n``-th, ``2n``-th, ...
            (batches counted across epochs, as ``trainer.fit_loop.total_batch_idx + 1``). With gradient
            accumulation over ``k`` batches, a multiple of ``k`` audits the batches that step the optimizer.
        top_k: how many lines the printed table shows (:attr:`report` always holds all of them).
        mode: ``"warn"`` prints the table and warns when a step exceeds ``max_syncs_per_step``; ``"raise"`` raises a
            ``RuntimeError`` as soon as an audited step makes more than ``max_syncs_per_step`` syncs from your code
            (for your own CI).
        max_syncs_per_step: the budget of syncs per step from your code; required with ``mode="raise"``.
        skip_packages: more top-level packages to treat like PyTorch (e.g. ``["transformers"]``): a sync inside them
            is charged to the line of your code that called into them.

    Raises:
        ValueError: if ``every_n_steps`` or ``top_k`` is not a positive integer, ``mode`` is not ``"warn"`` or
            ``"raise"``, ``max_syncs_per_step`` is negative or missing with ``mode="raise"``, or a package in
            ``skip_packages`` cannot be found.
        RuntimeError: with ``mode="raise"``, when an audited step exceeds ``max_syncs_per_step`` (on every rank of a
            distributed run: the ranks decide together).

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradkit import SyncAudit
        >>> audit = SyncAudit(every_n_steps=50)
        >>> trainer = Trainer(callbacks=[audit])
        >>> # after trainer.fit(...): audit.report -> [SyncSite(filename=..., lineno=42, code="loss.item()", ...)]
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        top_k: int = 10,
        mode: Literal["warn", "raise"] = "warn",
        max_syncs_per_step: int | None = None,
        skip_packages: list[str] | None = None,
    ) -> None:
        check_int("every_n_steps", every_n_steps, 1)
        check_int("top_k", top_k, 1)
        check_choice("mode", mode, _MODES)
        if max_syncs_per_step is not None:
            check_int("max_syncs_per_step", max_syncs_per_step, 0, hint="None sets no budget.")
        if mode == "raise" and max_syncs_per_step is None:
            raise ValueError(
                "`mode='raise'` needs `max_syncs_per_step`, the number of host syncs per step your code may make "
                "(e.g. `max_syncs_per_step=0`)."
            )
        skip_packages = check_strings("skip_packages", skip_packages, hint="Give top-level package names.")
        missing = [name for name in skip_packages if not package_dirs([name])]
        if missing:
            raise ValueError(
                f"`skip_packages` names packages that cannot be found: {missing}. Give importable top-level package "
                "names, e.g. ['transformers']."
            )
        self.every_n_steps = every_n_steps
        self.top_k = top_k
        self.mode = mode
        self.max_syncs_per_step = max_syncs_per_step
        self.skip_packages = skip_packages
        self._classifier: SourceClassifier | None = None
        self._recorder: HostSyncRecorder | None = None
        self._table = SyncTable()
        self._method: str | None = None
        self._events_dir: str | None = None
        self._shown: list[tuple[str, int, float]] | None = None
        self._warned_budget = False

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps)

    # -- results -----------------------------------------------------------------------------------------------
    @property
    def report(self) -> list[SyncSite]:
        """Your code's sync sites over all audited steps, most frequent first."""
        return self._table.rows()

    @property
    def framework_report(self) -> list[SyncSite]:
        """Syncs made by Lightning or lightning_gradkit themselves during the audited steps."""
        return self._table.rows(framework=True)

    @property
    def step_counts(self) -> list[int]:
        """Syncs from your code in each audited step, in order."""
        return list(self._table.step_totals)

    @property
    def method(self) -> str | None:
        """``"cuda_sync_debug"`` or ``"intercepted_calls"`` (see the class docstring); ``None`` before any audit."""
        return self._method

    # -- Lightning hooks ---------------------------------------------------------------------------------------
    @instance_hook  # `callbacks=[SyncAudit]`, the class, is refused with the fix
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._classifier is None:
            self._classifier = SourceClassifier(self.skip_packages)
        if stage == "fit":
            self._events_dir = events_dir(trainer)  # collective: every rank calls setup
            self._shown = None
            self._warned_budget = False

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if (trainer.fit_loop.total_batch_idx + 1) % self.every_n_steps:
            return
        assert self._classifier is not None
        self._recorder = HostSyncRecorder(self._classifier, cuda=pl_module.device.type == "cuda")
        self._method = self._recorder.method
        self._recorder.start()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._recorder is None:
            return
        # Lightning calls the LightningModule's hook after every callback's: keep recording until it returns.
        hook = getattr(pl_module, _HOOK)

        def recorded_hook(*args: Any, **kwargs: Any) -> Any:
            try:
                result = hook(*args, **kwargs)
            except BaseException:
                self.finish(pl_module)
                raise
            self._close(trainer, pl_module, batch_idx)
            return result

        pl_module.__dict__[_HOOK] = recorded_hook

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.finish(pl_module)  # a batch skipped by `on_train_batch_start` returning -1 never reaches its end hook

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.finish(pl_module)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.finish(pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._table.steps == 0:
            rank_zero_warn(
                f"SyncAudit audited no training step: `every_n_steps={self.every_n_steps}` and the run made "
                f"{trainer.fit_loop.total_batch_idx + 1} steps. Lower `every_n_steps` to audit this run."
            )
            return
        if self._signature(self.report) != self._shown:
            self._emit(self.report, f"{self._table.steps} audited steps")

    # -- state -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        table = self._table
        if self._recorder is not None and self._recorder.active:
            # A checkpoint saved inside an audited step (ModelCheckpoint runs in on_train_batch_end): that step is
            # not replayed on resume, so it is saved as counted so far.
            table = SyncTable()
            table.load_state_dict(self._table.state_dict())
            table.add(self._recorder.snapshot())
        return {"table": table.state_dict(), "method": self._method}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._table.load_state_dict(state_dict["table"])
        self._method = state_dict["method"]

    # -- internals ---------------------------------------------------------------------------------------------
    def finish(self, pl_module: pl.LightningModule) -> StepSyncs | None:
        """Stop recording and restore the LightningModule's hook (exception-safe; a no-op when not recording)."""
        recorder, self._recorder = self._recorder, None
        pl_module.__dict__.pop(_HOOK, None)
        return recorder.stop() if recorder is not None and recorder.active else None

    def _close(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> None:
        step = self.finish(pl_module)
        if step is None:
            return
        self._table.add(step)
        rows = [site_row(k, t, 1, step.seconds) for k, t in step.user.items()]
        rows.sort(key=lambda r: (-r.syncs, r.filename, r.lineno))
        if self._events_dir is not None and step.user_total:
            write_rank_event(
                self._events_dir,
                trainer,
                "host_sync",
                batch_idx,
                syncs=step.user_total,
                framework_syncs=step.framework_total,
                method=step.method,
                seconds=step.seconds,
                sites=[
                    {
                        "file": r.filename,
                        "line": r.lineno,
                        "code": r.code,
                        "count": r.syncs,
                        "kinds": r.kinds,
                        "stall_s": r.stall_seconds,
                    }
                    for r in rows
                ],
            )
        budget = self.max_syncs_per_step
        exceeded = budget is not None and step.user_total > budget
        message = (
            f"SyncAudit: training step {trainer.fit_loop.total_batch_idx} made {step.user_total} host-device syncs "
            f"from your code, more than `max_syncs_per_step={budget}`:\n{format_sync_table(rows, self.top_k)}"
        )
        if self.mode == "raise":
            # Every rank audits the same steps: decide together, so that no rank is left waiting in a collective.
            if trainer.strategy.reduce_boolean_decision(exceeded, all=False):
                raise RuntimeError(message if exceeded else "SyncAudit: another rank exceeded `max_syncs_per_step`.")
        elif exceeded and not self._warned_budget:
            self._warned_budget = True
            rank_zero_warn(message)
        if self._shown is None:
            self._emit(self.report, f"audited step {trainer.fit_loop.total_batch_idx}")

    @staticmethod
    def _signature(rows: list[SyncSite]) -> list[tuple[str, int, float]]:
        return [(r.filename, r.lineno, round(r.per_step, 2)) for r in rows]

    def _emit(self, rows: list[SyncSite], scope: str) -> None:
        self._shown = self._signature(rows)
        framework = sum(r.syncs for r in self.framework_report) / max(self._table.steps, 1)
        how = (
            "CUDA sync detector"
            if self._method == "cuda_sync_debug"
            else "recognised calls: the syncs this code makes with its tensors on a GPU"
        )
        tail = (
            f"\n(+{framework:.2f} syncs/step made by Lightning or lightning_gradkit themselves: "
            "`SyncAudit.framework_report`)"
            if framework
            else ""
        )
        if not rows:
            rank_zero_info(f"SyncAudit ({scope}, {how}): no host-device sync from your code.{tail}")
            return
        total = sum(r.per_step for r in rows)
        rank_zero_warn(
            f"SyncAudit ({scope}, {how}): your code makes {total:.2f} host-device syncs per step:\n"
            f"{format_sync_table(rows, self.top_k)}{tail}"
        )
