from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (runs on the lent GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test runs in its own temporary directory: what a door writes to the working directory by default
    (`GradKit`'s `./gradkit_logs`, Lightning's `./lightning_logs`) lands there, never in the source tree."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _close_figures() -> Iterator[None]:
    """Close the matplotlib figures a test drew (pyplot keeps every figure it made until closed)."""
    yield
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is not None:
        plt.close("all")
