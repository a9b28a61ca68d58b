"""The Triton kernels of :mod:`gradkit.step._multi_norm`; imported only there, and only once triton is known
to import (triton is optional: nothing else in the package may import this module).

Two launches for any number of tensors (the reduction order is in :func:`gradkit.step._multi_norm.
multi_tensor_norms`): ``_block_partials`` reduces fixed-size blocks of every tensor into one fp32 partial per block,
``_segment_norms`` folds each tensor's partials in block order and takes the root. With ``CHECK`` the same read also
keeps each block's largest magnitude (NaN kept), and the second launch writes, after the norms, 1.0 for each tensor
holding a NaN or an infinity, else 0.0: ``torch.isfinite`` exactly, which the fp32 square-sum cannot give (a finite
3e19 squares to inf).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A program reads one block (_multi_norm._BLOCK elements) as _TILE-element loads unrolled _BLOCK // _TILE times.
_TILE = 2048
_NUM_WARPS = 8  # 2048 / 256 threads: 8 elements (16 B of bf16) per thread and load
_SEGMENT = 1024  # partials one step of _segment_norms reads; the largest GPT-2 tensor has 2356 blocks

_MODES = {2.0: 2, 1.0: 1, float("inf"): 0}
_ELEMENT = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _max_keep_nan(a, b):
    # tl.max / tl.maximum default to IEEE maxNum, which drops a NaN; the inf-norm must propagate it like torch.
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _accumulate(acc, x, MODE: tl.constexpr):
    if MODE == 2:
        acc += x * x
    elif MODE == 1:
        acc += tl.abs(x)
    else:
        acc = _max_keep_nan(acc, tl.abs(x))
    return acc


@triton.jit
def _block_partials(  # noqa: PLR0913 (a Triton kernel: its arguments are its launch parameters)
    ptrs,
    numels,
    starts,
    owner,
    partials,
    ELEMENT: tl.constexpr,
    MODE: tl.constexpr,
    CHECK: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
    TILE: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(owner + pid)  # the tensor this block belongs to (int64 table, so offsets below are int64)
    numel = tl.load(numels + t)
    base = tl.load(ptrs + t).to(tl.pointer_type(ELEMENT))
    if ALIGNED:
        # A pointer loaded from memory has no known alignment; without the hint the loads are not vectorized.
        base = tl.multiple_of(base, 16)
    begin = (pid - tl.load(starts + t)) * BLOCK
    acc = tl.zeros([TILE], dtype=tl.float32)
    # The largest magnitude (NaN kept), for CHECK under MODE 1 and 2; under MODE 0 it is the norm itself.
    big = tl.zeros([TILE], dtype=tl.float32)
    # Same lanes, same order on both branches (a masked element adds 0), so the branch does not change the bits.
    if begin + BLOCK <= numel:
        # A whole block: unmasked loads, which vectorize (a mask from a loaded numel has unknown alignment).
        for k in tl.static_range(0, BLOCK, TILE):
            x = tl.load(base + begin + k + tl.arange(0, TILE)).to(tl.float32)
            acc = _accumulate(acc, x, MODE)
            if CHECK and MODE != 0:
                big = _max_keep_nan(big, tl.abs(x))
    else:
        for k in tl.static_range(0, BLOCK, TILE):
            offsets = begin + k + tl.arange(0, TILE)
            x = tl.load(base + offsets, mask=offsets < numel, other=0.0).to(tl.float32)
            acc = _accumulate(acc, x, MODE)
            if CHECK and MODE != 0:
                big = _max_keep_nan(big, tl.abs(x))
    partial = tl.reduce(acc, 0, _max_keep_nan) if MODE == 0 else tl.sum(acc, 0)
    tl.store(partials + pid, partial)
    if CHECK and MODE != 0:
        # After the num_programs partials: a max of magnitudes cannot overflow, so it is finite exactly when every
        # element is.
        tl.store(partials + tl.num_programs(0) + pid, tl.reduce(big, 0, _max_keep_nan))


@triton.jit
def _segment_norms(partials, starts, out, num_blocks, MODE: tl.constexpr, CHECK: tl.constexpr, SEGMENT: tl.constexpr):
    t = tl.program_id(0)
    first = tl.load(starts + t)
    stop = tl.load(starts + t + 1)
    acc = tl.zeros([SEGMENT], dtype=tl.float32)
    big = tl.zeros([SEGMENT], dtype=tl.float32)
    for i in range(first, stop, SEGMENT):
        index = i + tl.arange(0, SEGMENT)
        v = tl.load(partials + index, mask=index < stop, other=0.0)
        if MODE == 0:
            acc = _max_keep_nan(acc, v)
        else:
            acc += v
            if CHECK:
                big = _max_keep_nan(big, tl.load(partials + num_blocks + index, mask=index < stop, other=0.0))
    total = tl.reduce(acc, 0, _max_keep_nan) if MODE == 0 else tl.sum(acc, 0)
    if MODE == 2:
        total = tl.sqrt_rn(total)  # IEEE-rounded, as torch's sqrt; tl.sqrt may be approximate
    tl.store(out + t, total)
    if CHECK:
        largest = total if MODE == 0 else tl.reduce(big, 0, _max_keep_nan)
        # `<` is false for NaN and for inf: 1.0 marks a tensor with a non-finite element.
        tl.store(out + tl.num_programs(0) + t, tl.where(largest < float("inf"), 0.0, 1.0))


def _launch(
    ptrs: torch.Tensor,
    numels: torch.Tensor,
    starts: torch.Tensor,
    owner: torch.Tensor,
    num_blocks: int,
    aligned: bool,
    block: int,
    dtype: torch.dtype,
    norm_type: float,
    check: bool = False,
) -> torch.Tensor:
    """Per-tensor norms from the tables of :func:`gradkit.step._multi_norm._build_tables` (on the tensors'
    device), as an fp32 vector; ``num_blocks`` is ``len(owner)``, known on the host, ``aligned`` whether every data
    pointer is a multiple of 16 bytes, ``block`` the elements per block the tables were built for (a multiple of
    ``_TILE``). With ``check`` the vector is twice as long: the norms, then 1.0 for each tensor holding a NaN or an
    infinity (0.0 otherwise), from the same read."""
    num_tensors = numels.numel()
    mode = _MODES[float(norm_type)]
    extra = check and mode != 0  # a second set of partials: the blocks' largest magnitudes
    partials = torch.empty(num_blocks * (2 if extra else 1), dtype=torch.float32, device=ptrs.device)
    out = torch.empty(num_tensors * (2 if check else 1), dtype=torch.float32, device=ptrs.device)
    _block_partials[(num_blocks,)](
        ptrs, numels, starts, owner, partials, _ELEMENT[dtype], mode, check, aligned, block, _TILE, num_warps=_NUM_WARPS
    )
    _segment_norms[(num_tensors,)](partials, starts, out, num_blocks, mode, check, _SEGMENT, num_warps=4)
    return out
