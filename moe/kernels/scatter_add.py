"""Deterministic row scatter-add: out[r] = sum of src[j] over j with index[j] == r, in increasing j.

This is the backward of a gather (``grouped_mm(..., gather_index=...)``): a token routed to k experts
appears k times among the logical rows and its gradient is the sum of those k rows. ``index_add_`` on
CUDA uses atomics, so its float sums vary run to run; here one program owns one output row (and one
BLOCK_K column strip) and adds its contributions in a fixed order in fp32, so results are bitwise
reproducible. The order comes from a stable sort of ``index`` (device-side, no host sync).

Shapes: src [M, K], index [M] int64 (entries outside [0, num_rows) are dropped), out [num_rows, K].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import Kernel, check_triton_tensors, interp_bf16, to_out

# ---------------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------------


def scatter_add_rows_ref(src: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    keep = (index >= 0) & (index < num_rows)
    out = src.new_zeros(num_rows, src.shape[1])
    return out.index_add_(0, index[keep], src[keep])


# ---------------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _segment_sum_rows_kernel(
    SRC, ORDER, SEG_START, SEG_END, OUT,
    K, stride_sm, stride_sk, stride_om, stride_ok,
    INTERP_BF16: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    first = tl.load(SEG_START + row)
    last = tl.load(SEG_END + row)
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for j in range(first, last):  # ascending j: the fixed summation order
        src_row = tl.load(ORDER + j)
        acc += tl.load(SRC + src_row * stride_sm + offs_k * stride_sk, mask=k_mask, other=0.0).to(tl.float32)
    tl.store(OUT + row.to(tl.int64) * stride_om + offs_k * stride_ok, to_out(acc, OUT.dtype.element_ty, INTERP_BF16),
             mask=k_mask)


SEGMENT_SUM_ROWS = Kernel(
    _segment_sum_rows_kernel,
    configs=[triton.Config({"BLOCK_K": 512}, num_warps=4), triton.Config({"BLOCK_K": 1024}, num_warps=8)],
    interpret_config=triton.Config({"BLOCK_K": 32}, num_warps=4),
    key=["K"],
)

# ---------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------


def scatter_add_rows(src: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """out [num_rows, K]: out[r] = sum_{j: index[j] == r} src[j], deterministic (fixed order, fp32 sum)."""
    what = "scatter_add_rows (Triton)"
    if src.dim() != 2 or index.dim() != 1 or index.shape[0] != src.shape[0]:
        raise ValueError(f"{what}: need src [M, K] and index [M], got {tuple(src.shape)} and {tuple(index.shape)}")
    if index.dtype != torch.int64 or index.device != src.device:
        raise ValueError(f"{what}: index must be int64 on {src.device}, got {index.dtype} on {index.device}")
    if num_rows < 0:
        raise ValueError(f"{what}: num_rows={num_rows} must be >= 0 (the number of rows of the output)")
    check_triton_tensors(what, src)
    k = src.shape[1]
    out = torch.empty(num_rows, k, device=src.device, dtype=src.dtype)
    if out.numel() == 0:
        return out
    # Stable sort: contributions of one row stay in increasing j, whatever the sort implementation.
    sorted_index, order = torch.sort(index, stable=True)
    rows = torch.arange(num_rows, device=src.device, dtype=sorted_index.dtype)
    seg_start = torch.searchsorted(sorted_index, rows, right=False)
    seg_end = torch.searchsorted(sorted_index, rows, right=True)
    grid = lambda meta: (num_rows, triton.cdiv(k, meta["BLOCK_K"]))
    SEGMENT_SUM_ROWS[grid](src, order, seg_start, seg_end, out, k,
                           src.stride(0), src.stride(1), out.stride(0), out.stride(1),
                           INTERP_BF16=interp_bf16(src.dtype))
    return out
