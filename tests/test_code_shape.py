"""The shape of the code keeps the promises of issue 31, measured: a ``ClipGradNorm`` step stays shallow behind each
door, every public callback is a thin class, no source file outgrows what a reader holds at once."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback

import lightning_gradkit

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTIONS = 25
MAX_FILES = 4
MAX_MRO = 4  # classes besides `object`; Lightning's own callbacks have 3
MAX_LINES = 600


def _call_depth():
    spec = importlib.util.spec_from_file_location("bench_call_depth", ROOT / "benchmarks" / "bench_call_depth.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("door", ["loop_door_step", "trainer_step"])
def test_a_clip_grad_norm_step_stays_shallow(door: str) -> None:
    functions, files = getattr(_call_depth(), door)()
    assert any(f.endswith("Pipeline.run") for f in functions)  # the trace did see the step
    assert len(functions) <= MAX_FUNCTIONS, functions
    assert len(files) <= MAX_FILES, files


def test_the_tracer_counts_gradkit_functions_only() -> None:
    module = _call_depth()
    import torch

    from gradkit.norms import total_norm

    functions, files = module.traced(lambda: total_norm(torch.ones(3), 2.0) + torch.ones(1))
    assert functions == ["norms.py:total_norm"] and files == ["norms.py"]


def test_every_public_callback_is_a_thin_class() -> None:
    callbacks = [
        obj
        for name in lightning_gradkit.__all__
        if inspect.isclass(obj := getattr(lightning_gradkit, name)) and issubclass(obj, Callback)
    ]
    assert len(callbacks) >= 13
    deep = {c.__name__: [k.__name__ for k in c.__mro__[1:-1]] for c in callbacks if len(c.__mro__) - 1 > MAX_MRO}
    assert deep == {}


def test_no_source_file_is_longer_than_a_reader_holds_at_once() -> None:
    files = [p for root in ("gradkit", "lightning_gradkit") for p in (ROOT / "src" / root).rglob("*.py")]
    assert len(files) > 40
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
