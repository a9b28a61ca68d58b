"""The launcher of the ``tests/distributed`` jobs (``helpers._run_jobs``): a job that times out is started once more,
a job that fails is not, and a timeout grows with the machine's load.

The job is ``tests/distributed/stall_script.py``, a script without torch that stalls on the tries it is told to, so
a timeout here is the script's sleep, not the machine's load. Every start appends a line to a file outside the job's
folder: the count of starts is read from there, not from the launcher.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from helpers import launch_timeout, run_processes

TIMEOUT = 3.0  # seconds; the script starts in a fraction of one


def tries(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()]


def test_a_job_that_times_out_is_started_once_more_in_a_clean_folder(tmp_path: Path) -> None:
    out, record = tmp_path / "job", tmp_path / "tries.txt"
    out.mkdir()
    (out / "input.txt").write_text("the test's own file")
    start = time.monotonic()
    with pytest.warns(UserWarning, match=r"stall_script\.py timed out after \d+ s \(try 1 of 2; load average .*\)"):
        ranks = run_processes("stall_script.py", out, "--tries", str(record), "--stall", "1", nprocs=1, timeout=TIMEOUT)
    assert time.monotonic() - start >= TIMEOUT  # the first start was waited for, then killed
    assert ranks == [{"attempt": 2}]
    # What the first try wrote is gone, the test's own file stays; the second try got a port of its own.
    assert sorted(p.name for p in out.iterdir()) == ["input.txt", "rank0.json", "try2.txt"]
    (port1, pg1), (port2, pg2) = tries(record)
    assert port1 != port2
    assert float(pg1) >= 60 and float(pg2) >= 60


def test_a_job_that_times_out_twice_fails(tmp_path: Path) -> None:
    out, record = tmp_path / "job", tmp_path / "tries.txt"
    out.mkdir()
    with pytest.warns(UserWarning, match="try 1 of 2"), pytest.raises(AssertionError, match=r"try 2 of 2"):
        run_processes("stall_script.py", out, "--tries", str(record), "--stall", "2", nprocs=1, timeout=TIMEOUT)
    assert len(tries(record)) == 2


def test_a_job_that_fails_is_not_started_again(tmp_path: Path) -> None:
    out, record = tmp_path / "job", tmp_path / "tries.txt"
    out.mkdir()
    with pytest.raises(AssertionError, match=r"stall_script\.py failed \(3\)"):
        run_processes("stall_script.py", out, "--tries", str(record), "--exit", "3", nprocs=1, timeout=TIMEOUT)
    assert len(tries(record)) == 1


def test_launch_timeout_grows_with_the_load_the_processes_share_the_cores_with() -> None:
    """The fair-share model: ``nprocs`` processes and ``load`` others on ``cores`` cores, against the processes
    alone, computed here by hand for this machine's figures."""
    cores, load = os.cpu_count() or 1, os.getloadavg()[0]
    for nprocs in (1, 2, 8):
        alone = min(nprocs, cores)
        loaded = min(nprocs, cores * nprocs / (nprocs + load))
        got = launch_timeout(100.0, nprocs)
        assert got == pytest.approx(100.0 * max(1.0, alone / loaded), rel=0.05)  # the load average moves meanwhile
        assert got >= 100.0
