"""Shared test utilities: a host-sync counter, small models, a Trainer factory and a fresh-interpreter runner."""

from __future__ import annotations

import argparse
import atexit
import csv
import functools
import json
import math
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradkit.diagnostics.host_sync import SYNC_CALLS, sync_kind

#: Set by :func:`write_rank_result`: this process wrote its result, so its work is done.
_RESULT_WRITTEN = False


def _destroy_process_groups() -> None:
    """Destroy the process groups a distributed test script leaves behind, while the interpreter is still whole, and
    end a process that wrote its result without the interpreter's finalization.

    A gloo process group left to the interpreter's finalization can abort the process ("terminate called without
    an active exception", exit code -6) at random, after every result was written; destroying it at exit is what
    PyTorch's documentation asks of every script. The abort still came, rarely, from the C++ objects (store and
    gloo threads) that finalization destroys after that: a process whose result is written (the last thing every
    script does) therefore leaves with ``os._exit(0)`` once the other exit handlers ran (this one was registered
    first, so it runs last). A script that raised never wrote its result and exits as usual, with its error; the
    pytest process itself never takes this way out.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if _RESULT_WRITTEN and Path(sys.argv[0]).resolve().parent == SCRIPTS.resolve():  # a tests/distributed script
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


atexit.register(_destroy_process_groups)


class SyncCounter(TorchFunctionMode):
    """Counts host-device syncs while ``active`` (or inside watched methods), by the rule of gradkit's SyncAudit.

    A :class:`~torch.overrides.TorchFunctionMode` sees every call into the PyTorch API; a call counts when
    :func:`lightning_gradkit.diagnostics.host_sync.sync_kind` recognises it as one whose result the host must read on an
    accelerator: ``.item()``, ``bool()``/``int()``/``float()``/``__index__``, ``.tolist()``, ``.cpu()``,
    ``.to("cpu")``, ``.numpy()``, ``torch.nonzero``, boolean-mask indexing, ``torch.equal``, ``torch.unique``, ...
    Only the outermost call counts (``print(t)`` is one event). Counts are keyed by the called function's name
    (``"item"``, ``"__bool__"``, ``"nonzero"``) or, for syncs recognised by their arguments, by the kind
    (``"mask_index"``, ``"cpu"`` for ``.to("cpu")``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.depth = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.depth > 0:
            kind = sync_kind(func, args, kwargs)
            if kind is not None:
                self.counts[func.__name__ if func in SYNC_CALLS else kind] += 1
        return func(*args, **kwargs)

    @contextmanager
    def active(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def watch(self, obj: Any, method: str) -> None:
        """Count syncs only while ``obj.method`` runs."""
        original = getattr(obj, method)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            with self.active():
                return original(*args, **kwargs)

        setattr(obj, method, counted)

    def watch_per_call(self, obj: Any, method: str) -> list[int]:
        """Count syncs only while ``obj.method`` runs; the returned list gets the count of each call."""
        original = getattr(obj, method)
        per_call: list[int] = []

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            before = self.total
            with self.active():
                result = original(*args, **kwargs)
            per_call.append(self.total - before)
            return result

        setattr(obj, method, counted)
        return per_call


@contextmanager
def count_syncs() -> Iterator[SyncCounter]:
    """Record host syncs in this thread for the duration; nothing is counted outside ``active``/watched methods."""
    with SyncCounter() as counter:
        yield counter


class MLPModule(pl.LightningModule):
    """A small regression model with named submodules (``encoder.0``, ``encoder.2``, ``head``)."""

    def __init__(self, lr: float = 0.1, optimizer: str = "sgd", hidden: int = 16, param_groups: bool = False) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, hidden))
        self.head = nn.Linear(hidden, 1)
        self.lr = lr
        self.optimizer_name = optimizer
        self.use_param_groups = param_groups

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.encoder(x)))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params: Any = self.parameters()
        if self.use_param_groups:
            params = [{"params": self.encoder.parameters()}, {"params": self.head.parameters(), "lr": self.lr / 2}]
        if self.optimizer_name == "adam":
            return torch.optim.Adam(params, lr=self.lr)
        return torch.optim.SGD(params, lr=self.lr)


def regression_data(n: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :1] * 2.0 - x[:, 1:2]).tanh() + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def loader(n: int = 64, batch_size: int = 8, seed: int = 0) -> DataLoader:
    return DataLoader(regression_data(n, seed), batch_size=batch_size, shuffle=False)


def rank_loader(rank: int, world_size: int = 2, n: int = 32, batch_size: int = 4, seed: int = 0) -> DataLoader:
    """Rank ``r`` gets samples ``r, r + world, ...``: step k of all ranks together is batch k of
    ``loader(n, batch_size * world_size)``, so a single-process reference sees the same global batches.
    Use with ``Trainer(use_distributed_sampler=False)`` (Lightning's sampler shuffles)."""
    data = regression_data(n, seed)
    return DataLoader(torch.utils.data.Subset(data, range(rank, n, world_size)), batch_size=batch_size)


def make_trainer(tmp_path: Path, **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=CSVLogger(tmp_path, name="logs"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


def run_fresh(
    code: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None, returncode: int = 0
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (``python -c``, ``args`` as its ``sys.argv[1:]``) with this test run's
    ``sys.path`` and the extra environment variables ``env``; assert that it exits with status ``returncode`` and
    return it."""
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **(env or {})}
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=full_env, timeout=timeout
    )
    assert done.returncode == returncode, done.stderr[-8000:]
    return done


#: The packages of Lightning, and gradkit's Lightning layer: a plain PyTorch user loads none of them.
LIGHTNING_PACKAGES = ("lightning", "lightning_fabric", "pytorch_lightning", "lightning_gradkit")

#: Starts the last line of stdout of :func:`run_without_lightning`'s interpreter: the Lightning modules loaded.
_LOADED_MARKER = "gradkit-test: Lightning modules loaded: "


def run_without_lightning(code: str, *args: str, timeout: float = 120) -> str:
    """:func:`run_fresh` ``code``, then assert that the interpreter had loaded no module of
    :data:`LIGHTNING_PACKAGES` when ``code`` ended; return the stdout of ``code``."""
    report = (
        "\nimport json as _json, sys as _sys\n"
        f"print({_LOADED_MARKER!r} + _json.dumps(sorted(m for m in _sys.modules "
        f"if m.split('.')[0] in {LIGHTNING_PACKAGES!r})))\n"
    )
    done = run_fresh(code + report, *args, timeout=timeout)
    stdout, marker, loaded = done.stdout.rpartition(_LOADED_MARKER)
    assert marker, done.stdout[-4000:]
    assert json.loads(loaded) == []
    return stdout


def assert_same_state(a: Any, b: Any, where: str = "state") -> None:
    """Two nested states (``state_dict``s) hold the same values: the same types, keys and lengths, tensors bitwise
    (the same dtype and shape, NaN where NaN), everything else ``==`` (a float NaN equal to NaN)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} is not {type(b).__name__}"
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_state(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{list(a.shape)} {b.dtype}{list(b.shape)}"
        nan = a.isnan()
        assert torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan]), where
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, where


def read_metrics(source: pl.Trainer | Path) -> list[dict[str, str]]:
    """Rows of the CSVLogger's metrics.csv, from a Trainer or a run directory."""
    log_dir = Path(source.logger.log_dir) if isinstance(source, pl.Trainer) else Path(source)
    path = log_dir / "metrics.csv"
    with path.open() as f:
        return list(csv.DictReader(f))


def column(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key) not in (None, "")]


SCRIPTS = Path(__file__).parent / "distributed"


class ShardedMLP(MLPModule):
    """:class:`MLPModule` sharded with FSDP2 ``fully_shard`` in ``configure_model`` (``ModelParallelStrategy``)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for module in (self.encoder, self.head):
            fully_shard(module, mesh=mesh)


def distributed_trainer(**kwargs: Any) -> pl.Trainer:
    """A quiet 2-process CPU (gloo) Trainer for the scripts in ``tests/distributed``.

    Data comes from :func:`rank_loader` (``use_distributed_sampler=False``) so references see the same batches.
    """
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        use_distributed_sampler=False,
    )
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


def run_distributed(
    script: str, out_dir: Path, *args: str, timeout: float = 300, nprocs: int = 2
) -> list[dict[str, Any]]:
    """Run ``tests/distributed/<script>`` as an ``nprocs``-process CPU job and return each rank's JSON result.

    The script is started once; Lightning's launcher (``strategy="ddp"`` or ``ModelParallelStrategy``) starts the
    other ranks by re-running the same command (the script passes ``devices=nprocs``). Each rank writes
    ``rank<r>.json`` into ``out_dir``. ``timeout`` is for an otherwise idle 2-core machine (see
    :func:`launch_timeout`). On a timeout the whole process group of the job is killed, so a hung rank cannot outlive
    the test, and the job is started once more.
    """
    _run_jobs(script, out_dir, args, timeout, nprocs, lambda: [{}])
    return _read_ranks(out_dir, nprocs)


def run_nodes(script: str, out_dir: Path, *args: str, num_nodes: int = 2, timeout: float = 300) -> list[dict[str, Any]]:
    """Run ``tests/distributed/<script>`` once per simulated node on this machine, as a user starts a job on a cluster
    without a scheduler: the same command on every node with Lightning's ``NODE_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` (``lightning/fabric/plugins/environments/lightning.py``). The script passes
    ``num_nodes=num_nodes, devices=1``; node ``n`` writes ``rank<n>.json``.
    """

    def envs() -> list[dict[str, str]]:
        port = str(_free_port())
        return [{"NODE_RANK": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} for n in range(num_nodes)]

    _run_jobs(script, out_dir, args, timeout, num_nodes, envs)
    return _read_ranks(out_dir, num_nodes)


def run_processes(
    script: str, out_dir: Path, *args: str, nprocs: int = 2, timeout: float = 300
) -> list[dict[str, Any]]:
    """Run ``tests/distributed/<script>`` once per rank, as ``torchrun`` starts a single-node job: every process gets
    ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``OMP_NUM_THREADS=1`` (torchrun's
    default; Lightning's own launcher sets a thread count too, which changes float reductions). The script initializes
    ``torch.distributed`` itself (``init_process_group("gloo")``); a Lightning Trainer or Fabric in it then finds the
    processes created externally (``LOCAL_RANK`` set) and starts no others. Rank ``r`` writes ``rank<r>.json``.
    """

    def envs() -> list[dict[str, str]]:
        common = {
            "WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "NODE_RANK": "0",
            "OMP_NUM_THREADS": "1",
        }
        return [{**common, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(nprocs)]

    _run_jobs(script, out_dir, args, timeout, nprocs, envs)
    return _read_ranks(out_dir, nprocs)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_timeout(timeout: float, nprocs: int) -> float:
    """``timeout``, set for an otherwise idle machine with 2 cores (CI's), scaled to this machine's load at launch.

    ``nprocs`` processes alone on ``cores`` cores run at a rate ``min(nprocs, cores)``; with ``load`` other runnable
    processes (the 1-minute load average: other test runs on a shared machine, a busy desktop) every process gets an
    equal share of the cores, the job ``cores * nprocs / (nprocs + load)``. The ratio is the slowdown the timeout
    grows by: 1.5x for 8 processes on 2 cores under a load of 4, 3x for 2 processes. The load average lags a sudden
    burst by a minute; the retry in :func:`_run_jobs` covers that.
    """
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0]
    return timeout * max(1.0, (nprocs + load) / max(nprocs, cores))


#: The process-group timeout of a job's collectives, in seconds, scaled as the job's own (:func:`pg_timeout`).
_PG_TIMEOUT_ENV = "GRADKIT_TEST_PG_TIMEOUT_S"


def pg_timeout() -> timedelta:
    """The ``timeout`` a ``tests/distributed`` script gives its process group: short, so that a rank that hangs in a
    collective fails the job in a minute instead of torch's default 30, and scaled by :func:`launch_timeout` as the
    job's own limit, so that a loaded machine (a slow rank start, a starved peer) does not fail the job instead."""
    return timedelta(seconds=float(os.environ.get(_PG_TIMEOUT_ENV, 60)))


class _JobTimeout(Exception):
    pass


def _run_jobs(
    script: str,
    out_dir: Path,
    args: tuple[str, ...],
    timeout: float,
    nprocs: int,
    envs: Callable[[], list[dict[str, str]]],
) -> None:
    """Start the script once per entry of ``envs()`` (extra environment variables), each in its own session, and wait
    for all of them, ``timeout`` scaled by :func:`launch_timeout` for the ``nprocs`` processes of the job.

    A job that times out is killed (every session, hung ranks included) and started once more with fresh ``envs()``
    (a new port) in an ``out_dir`` cleared of what the first try wrote: a timeout on a loaded machine says nothing
    about the code, and a second one fails the test. A job that fails is never retried: a flaky failure is a bug.
    """
    import shutil
    import warnings

    before = set(out_dir.iterdir())
    for attempt in (1, 2):
        limit = launch_timeout(timeout, nprocs)
        pg = {_PG_TIMEOUT_ENV: str(round(launch_timeout(60, nprocs)))}
        try:
            _run_once(script, out_dir, args, limit, [{**env, **pg} for env in envs()])
            return
        except _JobTimeout as timed_out:
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            message = f"{script} timed out after {limit:.0f} s (try {attempt} of 2; load average {load})"
            if attempt == 2:
                raise AssertionError(f"{message}:\n{timed_out}") from None
            warnings.warn(f"{message}: started once more", stacklevel=3)
            for path in set(out_dir.iterdir()) - before:
                shutil.rmtree(path) if path.is_dir() else path.unlink()


def _run_once(script: str, out_dir: Path, args: tuple[str, ...], timeout: float, envs: list[dict[str, str]]) -> None:
    import signal
    import subprocess
    import time

    base = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT")}
    base["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), base.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(SCRIPTS / script), "--out", str(out_dir), *args]
    procs = [
        subprocess.Popen(
            cmd,
            env={**base, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=out_dir,
            start_new_session=True,
        )
        for env in envs
    ]
    deadline = time.monotonic() + timeout
    outputs: list[tuple[str, str]] = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(deadline - time.monotonic(), 0.1)))
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        raise _JobTimeout("\n".join(proc.communicate()[1][-4000:] for proc in procs[len(outputs) :])) from None
    for proc, (stdout, stderr) in zip(procs, outputs, strict=True):
        if proc.returncode != 0:
            raise AssertionError(f"{script} failed ({proc.returncode}):\n{stdout[-4000:]}\n{stderr[-8000:]}")


def script_parser() -> argparse.ArgumentParser:
    """The argument parser of a script in ``tests/distributed``: ``--out`` is the folder :func:`run_distributed`
    reads the ranks' results from; a script adds its own arguments."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    return parser


def write_rank_result(out_dir: Path, rank: int, result: Any) -> None:
    """Write one rank's JSON result where :func:`run_distributed` reads it (the script's last act: see
    :func:`_destroy_process_groups`)."""
    global _RESULT_WRITTEN
    _rank_file(out_dir, rank).write_text(json.dumps(result))
    _RESULT_WRITTEN = True


def _rank_file(out_dir: Path, rank: int) -> Path:
    return out_dir / f"rank{rank}.json"


def _read_ranks(out_dir: Path, count: int) -> list[dict[str, Any]]:
    return [json.loads(_rank_file(out_dir, r).read_text()) for r in range(count)]


def exported_callbacks() -> dict[str, type[pl.Callback]]:
    """The callbacks a user configures, by their top-level name: every exported ``Callback`` class but
    ``GradKitCallback``, the base a new policy is written on."""
    import lightning_gradkit

    exported = {name: getattr(lightning_gradkit, name) for name in lightning_gradkit.__all__}
    return {
        name: obj
        for name, obj in exported.items()
        if isinstance(obj, type) and issubclass(obj, pl.Callback) and name != "GradKitCallback"
    }


@contextmanager
def launched_in_process(fabric: Any) -> Iterator[Any]:
    """``fabric.launch()`` in this process (``devices=1``: no child process), then put the environment back.

    Fabric refuses ``setup_module`` before ``launch()`` under every strategy but the single-device and DataParallel
    ones (``Fabric._validate_launched``), FSDP and DDP included, even on one device. With one device its subprocess
    launcher starts no child: it sets ``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``NODE_RANK``/``LOCAL_RANK`` and
    the strategy creates a process group of one. Both would leak into later tests: restored here.
    """
    environ = dict(os.environ)
    try:
        fabric.launch()
        yield fabric
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
