"""The multi-tensor norm pass (``core/_multi_norm.py``): the ``_foreach_norm`` fallback against per-tensor
``torch.linalg.vector_norm`` and ``torch.nn.utils.get_total_norm``; the Triton kernel against the same references
under Triton's CPU interpreter (a subprocess, skipped without triton) and on CUDA (``gpu`` marker).

Tolerances: the references are computed in float64 and rounded to fp32; both implementations accumulate in fp32.
The kernel's longest chain of additions per result is 8 sequential tile adds, a 2048-lane tree (11 levels), a few
sequential segment adds and a 1024-lane tree (10 levels): about 32 roundings of relative ``2**-24`` each, a
worst-case ~2e-6 on the sum of squares and half that on its root; random data is far from the worst case, so the
kernel is held to ``rtol=1e-6`` (measured: under 1.1e-7). torch's CPU reduction (``_foreach_norm`` on CPU is one
``vector_norm`` per tensor) sums long sequential chains per vector lane: off by up to 4.3e-6 at 49k elements here
(1.4e-4 at 5M): the fallback, and the kernel compared with it, get ``rtol=1e-5`` on tensors of at most 50k elements,
as do totals compared with ``get_total_norm``. Inf-norms (a maximum) are exact.
"""

from __future__ import annotations

import importlib.util
import math
import weakref

import pytest
import torch

from gradkit.step import _multi_norm
from gradkit.step._multi_norm import fallback_reason, multi_tensor_norms, norm_implementation
from gradkit.step.norms import per_tensor_norms, total_norm
from helpers import run_fresh

RTOL = 1e-6  # the kernel against float64
RTOL_TORCH = 1e-5  # torch's CPU reductions
NORMS = [2.0, 1.0, math.inf]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _reference(tensors: list[torch.Tensor], p: float) -> torch.Tensor:
    """Per-tensor norms in float64 (0 for an empty tensor, whose inf-norm vector_norm refuses), rounded to fp32."""
    return torch.stack(
        [
            torch.linalg.vector_norm(t.double(), p).float() if t.numel() else torch.zeros((), dtype=torch.float32)
            for t in tensors
        ]
    )


def _mixed_tensors(dtype: torch.dtype) -> list[torch.Tensor]:
    # Sizes around the kernel's 16384-element block, one of several blocks, an empty one, a matrix, a scalar.
    shapes = [(3,), (16384,), (16385,), (0,), (3 * 16384 + 7,), (48, 33), ()]
    return [torch.randn(s).to(dtype) for s in shapes]


def test_reference_is_the_norm_of_a_known_vector() -> None:
    t = torch.tensor([3.0, -4.0])
    assert _reference([t], 2.0).tolist() == [5.0]
    assert _reference([t], 1.0).tolist() == [7.0]
    assert _reference([t, torch.zeros(0)], math.inf).tolist() == [4.0, 0.0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", NORMS)
def test_fallback_matches_vector_norm_per_tensor(dtype: torch.dtype, p: float) -> None:
    tensors = _mixed_tensors(dtype)
    norms = multi_tensor_norms(tensors, p)
    assert norms.dtype == torch.float32 and norms.shape == (len(tensors),)
    torch.testing.assert_close(norms, _reference(tensors, p), rtol=RTOL_TORCH if p != math.inf else 0, atol=0)


def _get_total_norm(tensors: list[torch.Tensor], p: float) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm`` of the fp32 values: on bf16/fp16 tensors torch rounds every per-tensor norm
    to the tensor's dtype (its ``_foreach_norm`` has no ``dtype=``); the upcast is exact."""
    return torch.nn.utils.get_total_norm([t.float() for t in tensors], p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", NORMS)
def test_total_from_fallback_norms_matches_get_total_norm(dtype: torch.dtype, p: float) -> None:
    tensors = [t for t in _mixed_tensors(dtype) if t.numel()]
    expected = _get_total_norm(tensors, p)
    torch.testing.assert_close(total_norm(multi_tensor_norms(tensors, p), p), expected, rtol=RTOL_TORCH, atol=0)


def test_fallback_is_bitwise_the_foreach_norm_of_before() -> None:
    # per_tensor_norms on CPU must not change: the same _foreach_norm call (fp32 accumulation for low precision).
    for dtype in DTYPES:
        tensors = [t for t in _mixed_tensors(dtype) if t.numel()]
        low = dtype != torch.float32
        before = torch.stack(torch._foreach_norm(tensors, 2.0, dtype=torch.float32 if low else None))
        assert torch.equal(multi_tensor_norms(tensors, 2.0), before)
        assert torch.equal(per_tensor_norms(tensors, 2.0), before)


def test_an_empty_list_gives_an_empty_vector() -> None:
    norms = multi_tensor_norms([], 2.0)
    assert norms.shape == (0,) and norms.dtype == torch.float32


def test_empty_tensors_have_norm_zero_for_every_norm_type() -> None:
    for p in NORMS:
        assert multi_tensor_norms([torch.zeros(0), torch.ones(0, 3)], p).tolist() == [0.0, 0.0]


def test_non_contiguous_tensors_give_the_norms_of_their_elements() -> None:
    base = torch.randn(40, 30)
    tensors = [base.t(), base[:, ::2], base[3:9], torch.randn(5, 1).expand(5, 4), base.unsqueeze(0).transpose(0, 2)]
    for p in NORMS:
        expected = _reference([t.contiguous() for t in tensors], p)
        rtol = RTOL_TORCH if p != math.inf else 0
        torch.testing.assert_close(multi_tensor_norms(tensors, p), expected, rtol=rtol, atol=0)


def test_nan_and_inf_propagate_like_vector_norm() -> None:
    t = torch.randn(100)
    t[7] = float("nan")
    u = torch.randn(50)
    u[3] = float("inf")
    for p in NORMS:
        norms = multi_tensor_norms([t, u], p)
        assert math.isnan(norms[0].item()) and norms[1].item() == math.inf


def test_dense_layouts_are_read_as_flat_arrays_and_gapped_ones_fall_back() -> None:
    base = torch.randn(6, 8)
    assert _multi_norm._dense(base.t())  # a permutation of a contiguous block: every element once
    assert _multi_norm._dense(base.unsqueeze(1).permute(2, 1, 0))
    assert _multi_norm._dense(base[2:4])  # a storage offset, contiguous from there
    assert not _multi_norm._dense(base[:, ::2])  # gaps
    assert not _multi_norm._dense(base[:, :5])  # gaps between rows
    assert not _multi_norm._dense(torch.randn(6, 1).expand(6, 8))  # one element read 8 times
    assert _multi_norm._tables([base, base.t()]) is not None
    assert _multi_norm._tables([base, base[:, ::2]]) is None  # the whole list falls back
    assert _multi_norm._tables([base, base.double()]) is None  # mixed dtypes
    assert _multi_norm._tables([base, base.to_sparse()]) is None  # no storage to point at


def test_tables_map_each_block_to_its_tensor_and_are_cached_by_layout() -> None:
    block = _multi_norm._BLOCK
    tensors = [torch.randn(block + 1), torch.zeros(0), torch.randn(5)]
    tables = _multi_norm._tables(tensors)
    assert tables is not None
    assert tables.ptrs.tolist() == [t.data_ptr() for t in tensors]
    assert tables.numels.tolist() == [block + 1, 0, 5]
    assert tables.starts.tolist() == [0, 2, 2, 3]  # tensor t owns blocks starts[t]:starts[t + 1]
    assert tables.owner.tolist() == [0, 0, 2]
    assert tables.num_blocks == 3
    assert _multi_norm._tables(list(tensors)) is tables  # same pointers and sizes: no new table, no copy
    assert _multi_norm._tables([tensors[0], torch.randn(6)]) is not tables


def test_the_table_cache_keeps_no_tensor_alive() -> None:
    t = torch.randn(10)
    ref = weakref.ref(t)
    assert _multi_norm._tables([t]) is not None
    del t
    assert ref() is None


def test_cpu_uses_foreach_and_the_reason_is_given() -> None:
    cpu = torch.device("cpu")
    assert norm_implementation(cpu, torch.float32) == "foreach"
    assert fallback_reason(cpu, torch.float32, 2.0) == "the tensors are on cpu, the kernel runs on CUDA"
    cuda = torch.device("cuda")  # the checks before the import need no CUDA device
    assert "dtype torch.float64" in fallback_reason(cuda, torch.float64, 2.0)
    assert "norm type 3.0" in fallback_reason(cuda, torch.float32, 3.0)
    if importlib.util.find_spec("triton") is None:
        assert "triton" in fallback_reason(cuda, torch.float32, 2.0)


def test_environment_variable_turns_the_kernel_off_and_rejects_unknown_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADKIT_NORM_KERNEL", "foreach")
    assert fallback_reason(torch.device("cuda"), torch.bfloat16, 2.0) == "GRADKIT_NORM_KERNEL=foreach"
    monkeypatch.setenv("GRADKIT_NORM_KERNEL", "trition")
    with pytest.raises(ValueError, match=r"GRADKIT_NORM_KERNEL='trition' is not one of \('auto', 'foreach'\)"):
        norm_implementation(torch.device("cuda"), torch.bfloat16)


_INTERPRETED = r"""
import math, torch
from gradkit.step import _multi_norm
from gradkit.step._multi_norm import _foreach_norms, _kernel_norms

torch.manual_seed(0)
def check(tensors, p, label, against_fallback=True):
    kernel = _kernel_norms(tensors, p)
    ref = torch.stack([torch.linalg.vector_norm(t.double(), p).float() if t.numel() else torch.tensor(0.0)
                       for t in tensors])
    exact = p == math.inf
    torch.testing.assert_close(kernel, ref, rtol=0 if exact else 1e-6, atol=0, msg=label)
    if against_fallback:
        fallback = _foreach_norms([t if t.numel() else t.new_zeros(1) for t in tensors], p)
        torch.testing.assert_close(kernel, fallback, rtol=0 if exact else 1e-5, atol=0, msg=label)
    return kernel

block = _multi_norm._BLOCK
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    base = torch.randn(48, 33).to(dtype)
    tensors = [torch.randn(s).to(dtype) for s in [(3,), (block,), (block + 1,), (0,), (3 * block + 7,), ()]]
    tensors += [base, base.t(), base[5:9]]  # dense, permuted dense, a storage offset (not 16-byte aligned)
    for p in (2.0, 1.0, math.inf):
        norms = check(tensors, p, f"{dtype} p={p}")
        # Each tensor's result depends on its size only: alone, or again, it is the same bits.
        assert torch.equal(_kernel_norms([tensors[4]], p), norms[4:5]), (dtype, p)
        assert torch.equal(_kernel_norms(tensors, p), norms), (dtype, p)

t = torch.randn(300)
t[17] = float("nan")
u = torch.randn(40)
u[2] = -float("inf")
for p in (2.0, 1.0, math.inf):
    n = _kernel_norms([t, u], p)
    assert math.isnan(n[0].item()) and n[1].item() == math.inf, (p, n)

# With check, the same launches mark each tensor holding a NaN or an infinity (torch.isfinite, by hand); a finite
# element whose square passes fp32 (an inf 2-norm) is not marked; the norms are the unchecked ones, bit for bit.
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    tensors = [torch.randn(s).to(dtype) for s in [(3,), (block + 1,), (0,), (5,), (2 * block + 3,), (7,)]]
    tensors[1][block] = 6e4 if dtype == torch.float16 else 3e19
    tensors[3][2], tensors[4][5], tensors[5][0] = float("inf"), -float("inf"), float("nan")
    for p in (2.0, 1.0, math.inf):
        out, n = _kernel_norms(tensors, p, check=True), len(tensors)
        torch.testing.assert_close(out[:n], _kernel_norms(tensors, p), rtol=0, atol=0, equal_nan=True)
        assert out[n:].tolist() == [0.0 if torch.isfinite(t).all() else 1.0 for t in tensors], (dtype, p, out)

# More partials than one step of the segment fold (1024): a smaller block keeps the interpreter quick.
_multi_norm._BLOCK = 2048
_multi_norm._tables_cache.clear()
# torch's CPU sum drifts with size (1.4e-4 relative at 5M elements): only the float64 reference here.
check([torch.randn(2048 * 1100 + 3), torch.randn(10)], 2.0, "1101 blocks", against_fallback=False)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install triton)")
def test_triton_kernel_under_the_cpu_interpreter_matches_the_fallback() -> None:
    # TRITON_INTERPRET must be set before triton is imported: a fresh interpreter, with this run's sys.path.
    assert run_fresh(_INTERPRETED, timeout=600, env={"TRITON_INTERPRET": "1"}).stdout.strip() == "ok"


def _gpt2_small_shapes() -> list[tuple[int, ...]]:
    """The 148 parameter shapes of GPT-2 small (124M), in ``model.parameters()`` order (HF/nanoGPT layout)."""
    shapes: list[tuple[int, ...]] = [(50257, 768), (1024, 768)]
    for _ in range(12):
        shapes += [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,)]
        shapes += [(768,), (768,), (768, 3072), (3072,), (3072, 768), (768,)]
    return [*shapes, (768,), (768,)]


def test_gpt2_small_shapes_are_148_tensors_of_124m_elements() -> None:
    shapes = _gpt2_small_shapes()
    assert len(shapes) == 148
    assert sum(math.prod(s) for s in shapes) == 124_439_808


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("p", NORMS)
def test_cuda_kernel_matches_get_total_norm_on_gpt2_small_gradients(dtype: torch.dtype, p: float) -> None:
    assert norm_implementation(torch.device("cuda"), dtype, p) == "triton", fallback_reason(
        torch.device("cuda"), dtype, p
    )
    grads = [torch.randn(s, device="cuda", dtype=dtype) * 1e-3 for s in _gpt2_small_shapes()]
    norms = multi_tensor_norms(grads, p)
    exact = p == math.inf
    torch.testing.assert_close(norms.cpu(), _reference([g.cpu() for g in grads], p), rtol=0 if exact else RTOL, atol=0)
    expected = _get_total_norm(grads, p)  # torch's CUDA sum: its own order, so torch's tolerance
    torch.testing.assert_close(total_norm(norms, p), expected, rtol=0 if exact else RTOL_TORCH, atol=0)
    assert torch.equal(multi_tensor_norms(grads, p), norms)  # deterministic: no atomics
    assert torch.equal(per_tensor_norms(grads, p), norms)  # the norm pass takes the kernel


@pytest.mark.gpu
def test_cuda_kernel_on_unaligned_views_and_without_host_sync() -> None:
    flat = torch.randn(10_000_001, device="cuda", dtype=torch.bfloat16)
    # Views at odd offsets, as DDP's bucket views: pointers not 16-byte aligned.
    views = [flat[1:4_000_000], flat[4_000_001:4_000_004].view(3, 1), flat[4_000_005:].view(-1)]
    expected = _reference([v.cpu() for v in views], 2.0)
    torch.testing.assert_close(multi_tensor_norms(views, 2.0).cpu(), expected, rtol=RTOL, atol=0)
    grads = [torch.randn(s, device="cuda") for s in [(1000, 17), (3,), (40_000,)]]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        first = multi_tensor_norms(grads, 2.0)  # builds and copies the tables (pinned, non_blocking)
        again = multi_tensor_norms(grads, 2.0)  # cached tables: two launches only
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(first, again)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernel_marks_nonfinite_elements_in_the_same_read(dtype: torch.dtype) -> None:
    """Reference: ``torch.isfinite`` by hand. A finite 1e20 (its square past fp32: an inf 2-norm) is not marked."""
    assert norm_implementation(torch.device("cuda"), dtype, 2.0) == "triton"
    for bad in (None, float("inf"), -float("inf"), float("nan")):
        grads = [torch.randn(s, device="cuda", dtype=dtype) for s in [(768, 2304), (768,), (0,), (50257, 7)]]
        grads[0][5, 7] = 1e20
        if bad is not None:
            grads[3][-1, -1] = bad
        for p in NORMS:
            found: list[torch.Tensor] = []
            norms = multi_tensor_norms(grads, p, found)
            torch.testing.assert_close(norms, multi_tensor_norms(grads, p), rtol=0, atol=0, equal_nan=True)
            assert found[0].item() == (0.0 if all(torch.isfinite(g).all() for g in grads) else 1.0), (bad, p)


@pytest.mark.gpu
def test_cuda_with_the_kernel_turned_off_is_bitwise_foreach(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADKIT_NORM_KERNEL", "foreach")
    grads = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in [(768, 2304), (768,)]]
    expected = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32))
    assert torch.equal(multi_tensor_norms(grads, 2.0), expected)
