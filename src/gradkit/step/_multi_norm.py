"""Per-tensor norms of many tensors in two kernel launches (Triton on CUDA), ``torch._foreach_norm`` elsewhere.

The norm pass is meant to cost one read of the gradient bytes. ``torch._foreach_norm`` is far from that on bf16
(12.4x a ``torch.sum`` over the same bytes at GPT-2-small shapes on an H200, 3.8x on fp32), so on CUDA the norms come
from :func:`multi_tensor_norms`' own multi-tensor kernel when triton imports. ``GRADKIT_NORM_KERNEL=foreach`` turns
it off; :func:`norm_implementation` names the path a call takes.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch
from torch import Tensor

__all__ = ["fallback_reason", "found_nonfinite", "multi_tensor_norms", "norm_implementation"]

_ENV_VAR = "GRADKIT_NORM_KERNEL"
_ENV_VALUES = ("auto", "foreach")
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KERNEL_NORMS = (1.0, 2.0, math.inf)
# Elements per block (one Triton program, one fp32 partial): 16 KiB of bf16 or 64 KiB of fp32 per program keeps
# enough loads in flight to stream at bandwidth, and 124M elements make ~7.7k programs, many waves over 132 SMs, so
# the partly filled last blocks of small tensors cost little. Apex's multi-tensor chunks are 64K elements; not tuned
# on a GPU yet.
_BLOCK = 16384
_CACHE_SIZE = 8
# Why the kernel is off in this process after it raised once (compile or launch): the first failure, if any.
_KERNEL_FAILED: list[str] = []


@functools.cache
def _triton_import_error() -> str | None:
    try:
        import gradkit.step._triton_norm_kernels  # noqa: F401
    except Exception as error:  # triton missing, or too old for the kernels: either way the fallback runs
        return f"{type(error).__name__}: {error}"
    return None


def fallback_reason(device: torch.device, dtype: torch.dtype, norm_type: float) -> str | None:
    """Why :func:`multi_tensor_norms` would use ``torch._foreach_norm`` for dense tensors of this device, dtype and
    norm type; ``None`` when it uses the Triton kernel.

    Raises:
        ValueError: ``GRADKIT_NORM_KERNEL`` is set to something other than ``auto`` or ``foreach``.
    """
    choice = os.environ.get(_ENV_VAR, "auto")
    if choice not in _ENV_VALUES:
        raise ValueError(
            f"{_ENV_VAR}={choice!r} is not one of {_ENV_VALUES}: unset it, or set 'foreach' to turn off "
            "the Triton norm kernel."
        )
    if choice == "foreach":
        return f"{_ENV_VAR}=foreach"
    if device.type != "cuda":
        return f"the tensors are on {device.type}, the kernel runs on CUDA"
    if dtype not in _KERNEL_DTYPES:
        return f"dtype {dtype} (the kernel reads float32, bfloat16, float16)"
    if float(norm_type) not in _KERNEL_NORMS:
        return f"norm type {norm_type} (the kernel computes 1, 2 and inf)"
    if _KERNEL_FAILED:
        return _KERNEL_FAILED[0]
    return _triton_import_error()


def norm_implementation(
    device: torch.device, dtype: torch.dtype, norm_type: float = 2.0
) -> Literal["triton", "foreach"]:
    """The implementation :func:`multi_tensor_norms` uses for dense tensors of this device, dtype and norm type
    (:func:`fallback_reason` says why when it is ``"foreach"``).

    Example::

        >>> norm_implementation(torch.device("cpu"), torch.float32)
        'foreach'
    """
    return "foreach" if fallback_reason(device, dtype, norm_type) else "triton"


def _foreach_norms(tensors: Sequence[Tensor], norm_type: float) -> Tensor:
    # `torch._foreach_norm` itself: results on CPU (and with the kernel off) are bitwise torch's.
    low_precision = tensors[0].dtype in (torch.float16, torch.bfloat16)
    return torch.stack(torch._foreach_norm(tensors, norm_type, dtype=torch.float32 if low_precision else None))


def _dense(t: Tensor) -> bool:
    """Whether ``t`` fills ``numel`` consecutive elements from its data pointer (contiguous in some dimension order):
    a norm does not depend on the order, so the kernel reads such a tensor as a flat array."""
    if t.is_contiguous() or t.numel() == 0:
        return True
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


class _Tables(NamedTuple):
    ptrs: Tensor  # [T] data pointers (int64)
    numels: Tensor  # [T]
    starts: Tensor  # [T + 1] first block of each tensor; tensor t owns blocks starts[t] to starts[t + 1]
    owner: Tensor  # [B] the tensor of each block
    num_blocks: int
    aligned: bool  # every pointer a multiple of 16 bytes (not so for views into a flat buffer, e.g. DDP buckets)


_tables_cache: OrderedDict[tuple, _Tables] = OrderedDict()


def _build_tables(ptrs: list[int], numels: list[int], device: torch.device) -> _Tables:
    blocks = [-(-n // _BLOCK) for n in numels]
    starts = [0]
    for b in blocks:
        starts.append(starts[-1] + b)
    owner = torch.repeat_interleave(torch.arange(len(numels)), torch.tensor(blocks, dtype=torch.long))
    host = torch.cat([torch.tensor(ptrs + numels + starts, dtype=torch.long), owner])
    if device.type == "cuda":
        # Pinned and non_blocking: the copy is queued without a host sync (the caching host allocator keeps the
        # pinned buffer until it has run). It happens once per layout, not per step.
        host = host.pin_memory().to(device, non_blocking=True)
    n = len(numels)
    return _Tables(
        host[:n],
        host[n : 2 * n],
        host[2 * n : 3 * n + 1],
        host[3 * n + 1 :],
        starts[-1],
        all(p % 16 == 0 for p in ptrs),
    )


def _tables(tensors: Sequence[Tensor]) -> _Tables | None:
    """The kernel's tables for ``tensors``, cached by their data pointers and sizes (a step's gradients usually sit
    where they sat the step before); ``None`` when some tensor cannot be read as a flat array of the first one's
    dtype and device (no storage: sparse or a wrapper subclass such as DTensor; overlapping or with gaps).

    This runs every step, so a cache hit reads four attributes per tensor through C-level ``map`` (88 us for 148
    tensors on a slow shared CPU, against 207 us checking each tensor in a Python loop). The other tensors' device is
    checked only when the tables are built: a hit has the same pointers, and CUDA's unified addressing gives every
    device its own range.
    """
    first = tensors[0]
    try:
        ptrs = tuple(map(Tensor.data_ptr, tensors))
    except RuntimeError:  # "Cannot access data pointer of Tensor that doesn't have storage"
        return None
    if not all(t.dtype is first.dtype for t in tensors):
        return None
    if not all(map(Tensor.is_contiguous, tensors)) and not all(map(_dense, tensors)):
        return None
    numels = tuple(map(Tensor.numel, tensors))
    # Equal keys read the same bytes the same way, whatever tensor objects hold them now. The cache holds no tensor,
    # so it keeps no gradient alive.
    key = (first.device, first.dtype, ptrs, numels)
    tables = _tables_cache.get(key)
    if tables is not None:
        _tables_cache.move_to_end(key)
        return tables
    if any(t.device != first.device for t in tensors):
        return None
    tables = _build_tables(list(ptrs), list(numels), first.device)
    _tables_cache[key] = tables
    if len(_tables_cache) > _CACHE_SIZE:
        _tables_cache.popitem(last=False)
    return tables


def _kernel_norms(tensors: Sequence[Tensor], norm_type: float, check: bool = False) -> Tensor | None:
    """The Triton path without the dispatch checks (CPU tensors work under ``TRITON_INTERPRET=1``); ``None`` when the
    tensors cannot be read as flat arrays. With ``check``, the norms then each tensor's non-finite mark (1.0 or 0.0)
    in one vector of twice the length."""
    tables = _tables(tensors)
    if tables is None:
        return None
    device = tensors[0].device
    if tables.num_blocks == 0:  # every tensor empty: norms 0, nothing non-finite
        return torch.zeros(len(tensors) * (2 if check else 1), dtype=torch.float32, device=device)
    from gradkit.step._triton_norm_kernels import _launch

    t = tables
    args = (t.ptrs, t.numels, t.starts, t.owner, t.num_blocks, t.aligned, _BLOCK, tensors[0].dtype, norm_type, check)
    if device.type != "cuda":
        return _launch(*args)
    with torch.cuda.device(device):  # triton launches on the current device
        return _launch(*args)


def multi_tensor_norms(tensors: Sequence[Tensor], norm_type: float, found: list[Tensor] | None = None) -> Tensor:
    """The ``norm_type``-norm of each tensor, as one fp32 vector on their device (the tensors share device and dtype).

    On CUDA with triton importable, for float32/bfloat16/float16 and p in {1, 2, inf}, two Triton launches whatever
    the number of tensors (the multi-tensor pattern of apex's ``multi_tensor_apply`` and ``torch._foreach_*``: one
    grid over (tensor, block) pairs read from small device tables of data pointers, sizes and block offsets, built
    once per layout and cached). Elsewhere, or with ``GRADKIT_NORM_KERNEL=foreach``, or when a tensor is sparse or
    strided with gaps, ``torch._foreach_norm`` (low precision reduced in fp32).

    Reduction order (deterministic; the kernel uses no atomics): every tensor is cut into blocks of ``_BLOCK``
    elements in memory order; a block is read in ``_TILE``-element loads, each lane of a ``_TILE``-wide fp32
    accumulator summing ``x**2`` (p=2) or ``|x|`` (p=1), or taking the maximum of ``|x|`` (p=inf, NaN kept), over the
    ``_BLOCK // _TILE`` loads, then Triton's fixed reduction tree folds the lanes into the block's partial. The
    second launch folds each tensor's partials the same way (``_SEGMENT`` lanes, blocks in order) and takes the
    square root (IEEE-rounded) for p=2. The order depends only on each tensor's size, not on its neighbours in the
    list or the run, so results are bitwise reproducible run to run on one GPU model and triton version. It is not
    ``_foreach_norm``'s order: the two agree within fp32 rounding (fp32 accumulation, about ``1e-6`` relative for
    2-norms of gradient-sized tensors), not bitwise. An atomic add into each tensor's slot would save the second
    launch but make the sum order, and so the bits, vary run to run; the project promises bitwise reproducibility.

    Both paths accumulate in fp32, as torch does: a 2-norm (1-norm) whose sum of squares (magnitudes) passes fp32's
    range is inf although every element is finite (one element of 3e19 is enough for p=2). ``found``, when given,
    receives whether some element is NaN or infinite (an fp32 scalar, 1.0 or 0.0: ``torch.isfinite`` exactly): on the
    Triton path from the same read (each block's largest magnitude, which cannot overflow), on the ``_foreach_norm``
    path from the inf-norm itself, or for p in {1, 2} from :func:`found_nonfinite`, a second read.

    The result does not track gradients (the kernel reads raw memory); an empty tensor's norm is 0.

    Example::

        >>> multi_tensor_norms([torch.ones(4), torch.full((3,), 2.0)], 2.0)
        tensor([2.0000, 3.4641])
    """
    if len(tensors) == 0:
        if found is not None:
            found.append(torch.zeros(()))
        return torch.zeros(0)
    first = tensors[0]
    if fallback_reason(first.device, first.dtype, norm_type) is None:
        try:
            norms = _kernel_norms(tensors, norm_type, check=found is not None)
        except Exception as error:  # a compile or launch error on this GPU / triton: never the run's end
            _KERNEL_FAILED.append(f"the kernel failed here ({type(error).__name__}: {error})")
            warnings.warn(
                f"gradkit: the Triton norm kernel failed ({type(error).__name__}: {error}); the gradient norms use "
                f"torch._foreach_norm from now on. Set {_ENV_VAR}=foreach to skip the kernel.",
                RuntimeWarning,
                stacklevel=2,
            )
            norms = None
        if norms is not None:
            if found is None:
                return norms
            found.append(norms[len(tensors) :].amax())  # after the norms: each tensor's mark
            return norms[: len(tensors)]
    if math.isinf(norm_type):
        # _foreach_norm has no inf-norm of an empty tensor (no maximum of nothing); it is 0, as under the kernel.
        tensors = [t if t.numel() else t.new_zeros(1) for t in tensors]
    norms = _foreach_norms(tensors, norm_type)
    if found is not None:
        # A maximum of magnitudes cannot overflow: finite exactly when every element is. A sum can.
        found.append(_nonfinite_mark(norms) if math.isinf(norm_type) else found_nonfinite(tensors))
    return norms


@functools.cache
def _one(device: torch.device) -> Tensor:
    """A device scalar 1.0: the inverse scale under which :func:`found_nonfinite`'s GradScaler check scales nothing."""
    return torch.ones((), dtype=torch.float32, device=device)


def _nonfinite_mark(values: Tensor) -> Tensor:
    """1.0 if some of ``values`` is NaN or infinite, else 0.0 (an fp32 scalar)."""
    return ((values - values) != 0).any().to(torch.float32)


def found_nonfinite(tensors: Sequence[Tensor]) -> Tensor:
    """1.0 if some element of ``tensors`` (one device, one dtype) is NaN or infinite, else 0.0: ``torch.isfinite``
    over every element, as an fp32 device scalar, in one multi-tensor pass and no host sync.

    A second read of the tensors: the check of the ``_foreach_norm`` path, whose fp32 norms cannot tell an infinite
    element from an overflowing sum (the Triton path needs no second read). On CPU and CUDA it is the GradScaler's
    own fused check, ``torch._amp_foreach_non_finite_check_and_unscale_`` with an inverse scale of 1.0, which stores
    every element back unchanged (the same bits; the tensors' version counters move) and reads no more than a norm:
    on CPU ``_foreach_norm``'s inf-norm costs about 15x as much. That check writes, so tensors that overlap in memory
    (an ``expand``) and other devices take the inf-norm, which a NaN keeps NaN and which cannot overflow.

    Example::

        >>> found_nonfinite([torch.tensor([3e19, 1.0]), torch.tensor([-float("inf")])])
        tensor(1.)
    """
    first = tensors[0]
    writable = all(map(Tensor.is_contiguous, tensors)) or all(map(_dense, tensors))
    if first.device.type in ("cpu", "cuda") and writable:
        found = torch.zeros((), dtype=torch.float32, device=first.device)
        torch._amp_foreach_non_finite_check_and_unscale_(list(tensors), found, _one(first.device))
        return found
    tensors = [t if t.numel() else t.new_zeros(1) for t in tensors]
    return _nonfinite_mark(torch.stack(torch._foreach_norm(tensors, math.inf)))
