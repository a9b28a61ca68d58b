from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA device: run `make gpu-check` on a machine with one (docs/benchmarks.md)"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _in_own_working_directory(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test runs in a fresh temporary working directory (not its ``tmp_path``, whose contents tests check): what
    a door writes there by default (`GradKit`'s `./gradkit_logs`, Lightning's `./lightning_logs`) never lands in the
    source tree."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(autouse=True)
def _close_figures() -> Iterator[None]:
    """Close the matplotlib figures a test drew (pyplot keeps every figure it made until closed)."""
    yield
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is not None:
        plt.close("all")


_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")


@pytest.fixture(autouse=True)
def _no_process_group_left() -> Iterator[None]:
    """A test that initializes ``torch.distributed`` in this process (one rank, gloo) or sets the launcher's
    environment must not leave either to the tests after it (Lightning and Hugging Face read both)."""
    import os

    import torch.distributed as dist

    saved = {key: os.environ.get(key) for key in _DIST_ENV}
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[dist.ProcessGroup]:
    """A 1-process gloo group (DistributedDataParallel and the mesh declarations need one), destroyed afterwards."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
