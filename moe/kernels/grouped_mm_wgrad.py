"""Weight gradient of the grouped GEMM: dW[e] = X_e^T dY_e, a k-grouped GEMM over each row block.

Shapes: x [M_x, K] (optional gather_index [M] int64: logical row r = x[gather_index[r]]), dy [M, N],
offs [E] int32 cumulative row ends -> dw [E, K, N] in x's dtype, fp32 accumulation. Out-of-range offs
and gather_index values as in grouped_mm (_common's docstring): an expert whose clamped row range is
empty gets dw[e] = 0, and rows gathered from outside [0, M_x) contribute nothing.

One program owns one [BLOCK_K, BLOCK_N] tile of one expert's dW and walks that expert's rows
BLOCK_M at a time: the reduction order is fixed, so dW is bitwise deterministic (no atomics, no
split-M). An empty expert runs zero iterations and stores zeros. Programs are expert-major, so the
tiles of one expert (which all stream the same X_e and dY_e rows) run together and share L2.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (Kernel, cfg, check_gather_index, check_offs, check_triton_tensors, dot_acc, dot_flags,
                      expert_row_bounds, gather_rows, gather_rows_ref, prune_by_smem, swizzle_pid, to_out)
from ._tma import (check_tma_mode, set_tma_allocator, tma_default, tma_wanted, try_tma_launch,
                   why_not_tma_tensors, why_not_variant)

# ---------------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------------


def grouped_mm_wgrad_ref(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor,
                         gather_index: torch.Tensor | None = None) -> torch.Tensor:
    """Per-expert loop in plain PyTorch: dw[e] = x_e^T @ dy_e, zeros for empty experts (and out-of-range
    values treated as the kernel treats them)."""
    a = x if gather_index is None else gather_rows_ref(x, gather_index)
    dw = a.new_zeros(offs.shape[0], a.shape[1], dy.shape[1])
    start, m = 0, dy.shape[0]
    for e, end in enumerate(offs.tolist()):  # D2H sync: the loop bounds are the offsets
        end = min(max(end, start), m)  # clamped to [previous end, M]
        if end > start:
            dw[e] = a[start:end].transpose(0, 1) @ dy[start:end]
        start = end
    return dw


# ---------------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _wgrad_tile(OFFS, M, K, N, E, E_POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr):
    """(e, pid_k, pid_n, start, end): this program's expert and dW tile, and the expert's rows.

    Expert-major order; inside an expert, GROUP_M k-tiles share each n strip (L2 reuse). The rows come from
    the same clamped monotone bounds as the forward's, so any offs is safe."""
    pid = tl.program_id(0)
    num_pid_k = tl.cdiv(K, BLOCK_K)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    e = pid // (num_pid_k * num_pid_n)
    pid_k, pid_n = swizzle_pid(pid % (num_pid_k * num_pid_n), num_pid_k, num_pid_n, GROUP_M)
    eids, starts, ends = expert_row_bounds(OFFS, M, E, E_POW2)
    start = tl.sum(tl.where(eids == e, starts, 0), 0)
    end = tl.sum(tl.where(eids == e, ends, 0), 0)
    return e, pid_k, pid_n, start, end


@triton.jit
def _grouped_mm_wgrad_kernel(
    X, DY, DW, OFFS, GIDX,
    M, K, N, E, X_ROWS,
    stride_xm, stride_xk, stride_dym, stride_dyn, stride_dwe, stride_dwk, stride_dwn,
    E_POW2: tl.constexpr, HAS_GATHER: tl.constexpr, PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    e, pid_k, pid_n, start, end = _wgrad_tile(OFFS, M, K, N, E, E_POW2, BLOCK_N, BLOCK_K, GROUP_M)

    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = offs_k < K
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        src, a_mask = gather_rows(GIDX, offs_m, m_mask, X_ROWS, HAS_GATHER)
        # x tile loaded as [BLOCK_K, BLOCK_M] (transposed by addressing, not by a copy)
        xt = tl.load(X + src.to(tl.int64)[None, :] * stride_xm + offs_k[:, None] * stride_xk,
                     mask=a_mask[None, :] & k_mask[:, None], other=0.0)
        g = tl.load(DY + offs_m.to(tl.int64)[:, None] * stride_dym + offs_n[None, :] * stride_dyn,
                    mask=m_mask[:, None] & n_mask[None, :], other=0.0)
        acc = dot_acc(xt, g, acc, PRECISION, INTERP_BF16)
    dw_ptrs = DW + e.to(tl.int64) * stride_dwe + offs_k[:, None] * stride_dwk + offs_n[None, :] * stride_dwn
    tl.store(dw_ptrs, to_out(acc, DW.dtype.element_ty, INTERP_BF16), mask=k_mask[:, None] & n_mask[None, :])


# Output tile [BLOCK_K, BLOCK_N]; BLOCK_M is the reduction step over rows. Ordered by the H100 sweep (best
# overall first): 64 rows x a 128 x 256 dW tile won 9 of the 10 wgrad calls, 128 x 128 with 4 warps the other.
GROUPED_MM_WGRAD = Kernel(
    _grouped_mm_wgrad_kernel,
    configs=[
        cfg(64, 256, 128, 8, 3),
        cfg(64, 256, 128, 8, 4),
        cfg(64, 128, 128, 4, 3),
        cfg(64, 128, 128, 8, 3),
        cfg(64, 128, 64, 4, 4),
        cfg(32, 128, 128, 4, 4),
        cfg(64, 64, 64, 4, 4),
        cfg(32, 64, 64, 4, 3),
    ],
    interpret_config=cfg(16, 32, 32, 4, 1, group=2),
    key=["N", "K"],
    prune=prune_by_smem(200 * 1024, a_name="BLOCK_K", k_name="BLOCK_M", acc_names=("BLOCK_K", "BLOCK_N")),
)

@triton.jit
def _grouped_mm_wgrad_tma_kernel(
    X, DY, DW, OFFS,
    M, K, N, E,
    stride_xm, stride_dym, stride_dwe, stride_dwk, stride_dwn,
    E_POW2: tl.constexpr, PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """The same dW tiles and reduction order as _grouped_mm_wgrad_kernel, its operands read by tensor-memory
    (TMA) descriptors instead of masked pointer loads: one descriptor per operand over this expert's rows
    only (base at its first row, its row count as the bound), so the hardware zero-fills the rows past the
    expert's end and the k / n tails. Unit inner strides, no gather (the launcher's conditions)."""
    e, pid_k, pid_n, start, end = _wgrad_tile(OFFS, M, K, N, E, E_POW2, BLOCK_N, BLOCK_K, GROUP_M)
    rows = end - start
    # a descriptor's dims must be positive: an empty expert gets a 1-row bound and runs no iteration
    x_desc = tl.make_tensor_descriptor(X + start.to(tl.int64) * stride_xm, shape=[tl.maximum(rows, 1), K],
                                       strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    dy_desc = tl.make_tensor_descriptor(DY + start.to(tl.int64) * stride_dym, shape=[tl.maximum(rows, 1), N],
                                        strides=[stride_dym, 1], block_shape=[BLOCK_M, BLOCK_N])
    k0 = pid_k * BLOCK_K
    n0 = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(0, rows, BLOCK_M):
        x = x_desc.load([m0, k0])  # [BLOCK_M, BLOCK_K]
        g = dy_desc.load([m0, n0])  # [BLOCK_M, BLOCK_N]
        acc = dot_acc(tl.trans(x), g, acc, PRECISION, INTERP_BF16)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    dw_ptrs = DW + e.to(tl.int64) * stride_dwe + offs_k[:, None] * stride_dwk + offs_n[None, :] * stride_dwn
    tl.store(dw_ptrs, to_out(acc, DW.dtype.element_ty, INTERP_BF16), mask=(offs_k < K)[:, None] & (offs_n < N)[None, :])


GROUPED_MM_WGRAD_TMA = GROUPED_MM_WGRAD.variant(_grouped_mm_wgrad_tma_kernel)

# Where the TMA variant runs (no gather, unit inner strides, 16-byte row strides, CUDA sm90+ or the
# interpreter): "auto" (the default: on CUDA), "never", "always" (also in the interpreter: tests); it starts
# as MOEKIT_TMA says (_tma.TMA_ENV). A Triton without tl.make_tensor_descriptor, or one that cannot build it
# here, falls back with a warning.
WGRAD_TMA = tma_default()
_TMA_FAILURE: list[str] = []


def why_not_tma(x: torch.Tensor, dy: torch.Tensor, gather_index) -> str:
    """"" when _grouped_mm_wgrad_tma_kernel can take these operands, else why not."""
    return why_not_variant(why_not_tma_tensors(x=x, dy=dy), _TMA_FAILURE, gather_index)


# ---------------------------------------------------------------------------------------------------
# Launcher (the backward of grouped_mm calls this; it has no autograd of its own)
# ---------------------------------------------------------------------------------------------------


def grouped_mm_wgrad(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor,
                     gather_index: torch.Tensor | None = None, *, allow_tf32: bool = False) -> torch.Tensor:
    """dw [E, K, N] = per expert e: x[rows of e]^T @ dy[rows of e]; E = len(offs)."""
    what = "grouped_mm_wgrad (Triton)"
    if x.dim() != 2 or dy.dim() != 2:
        raise ValueError(f"{what}: x must be [M, K] and dy [M, N], got {tuple(x.shape)} and {tuple(dy.shape)}")
    check_gather_index(gather_index, x.device, what)
    m = x.shape[0] if gather_index is None else gather_index.shape[0]
    if dy.shape[0] != m:
        raise ValueError(f"{what}: dy has {dy.shape[0]} rows but the (gathered) x has {m}; they must match")
    check_triton_tensors(what, x, dy)
    e = offs.shape[0] if isinstance(offs, torch.Tensor) and offs.dim() == 1 else -1
    offs = check_offs(offs, e, x.device, m, what)
    k, n = x.shape[1], dy.shape[1]
    dw = torch.empty(e, k, n, device=x.device, dtype=x.dtype)
    if dw.numel() == 0:
        return dw
    if m == 0:
        return dw.zero_()
    grid = lambda meta: (e * triton.cdiv(k, meta["BLOCK_K"]) * triton.cdiv(n, meta["BLOCK_N"]),)
    check_tma_mode(WGRAD_TMA, "grouped_mm_wgrad.WGRAD_TMA")
    if tma_wanted(WGRAD_TMA, x.device) and not why_not_tma(x, dy, gather_index):
        set_tma_allocator(x.device)
        if try_tma_launch(lambda: GROUPED_MM_WGRAD_TMA[grid](
            x, dy, dw, offs, m, k, n, e,
            x.stride(0), dy.stride(0), dw.stride(0), dw.stride(1), dw.stride(2),
            E_POW2=triton.next_power_of_2(e), **dot_flags(x.dtype, allow_tf32),
        ), _TMA_FAILURE, "grouped_mm_wgrad", stacklevel=3):
            return dw
    GROUPED_MM_WGRAD[grid](
        x, dy, dw, offs, gather_index if gather_index is not None else offs,
        m, k, n, e, x.shape[0],
        x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
        E_POW2=triton.next_power_of_2(e), HAS_GATHER=gather_index is not None, **dot_flags(x.dtype, allow_tf32),
    )
    return dw


# ---------------------------------------------------------------------------------------------------
# Per-expert column sums: the gradient of a per-expert bias (db[e] = sum of dy over expert e's rows)
# ---------------------------------------------------------------------------------------------------


def grouped_colsum_ref(dy: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-expert loop: out[e] = dy[rows of e].sum(0) (fp32 sums, dy's dtype out), rows past the last end none."""
    out = dy.new_zeros(offs.shape[0], dy.shape[1])
    start, m = 0, dy.shape[0]
    for e, end in enumerate(offs.tolist()):  # D2H sync: the loop bounds are the offsets
        end = min(max(end, start), m)  # clamped to [previous end, M]
        if end > start:
            out[e] = dy[start:end].float().sum(0).to(dy.dtype)
        start = end
    return out


@triton.jit
def _grouped_colsum_kernel(
    DY, OUT, OFFS, SCALE, DOTW, PART,
    M, N, E,
    stride_dym, stride_dyn, stride_oe, stride_on, stride_we, stride_wn, stride_pm,
    E_POW2: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One program per (expert, BLOCK_N columns): walks the expert's rows BLOCK_M at a time in a fixed order
    (bitwise deterministic: no atomics, no split over rows); an empty expert stores zeros. BLOCK_K and GROUP_M
    are unused (the shared cfg()).

    HAS_SCALE: each row weighted by SCALE[row] (fp32 [M]) in the sum. HAS_DOT: also each row's dot product with
    DOTW[e] over the program's columns, stored at PART[row, column block] (fp32; the caller sums a row's blocks):
    the same read of dy gives the output bias's gradient and its share of the routing weights' gradient."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    e = pid // num_pid_n
    pid_n = pid % num_pid_n
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    eids, starts, ends = expert_row_bounds(OFFS, M, E, E_POW2)
    start = tl.sum(tl.where(eids == e, starts, 0), 0)
    end = tl.sum(tl.where(eids == e, ends, 0), 0)
    if HAS_DOT:
        w = tl.load(DOTW + e.to(tl.int64) * stride_we + offs_n * stride_wn, mask=n_mask, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        g = tl.load(DY + offs_m.to(tl.int64)[:, None] * stride_dym + offs_n[None, :] * stride_dyn,
                    mask=m_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
        if HAS_DOT:
            tl.store(PART + offs_m.to(tl.int64) * stride_pm + pid_n, tl.sum(g * w[None, :], 1), mask=m_mask)
        if HAS_SCALE:
            g = g * tl.load(SCALE + offs_m, mask=m_mask, other=0.0).to(tl.float32)[:, None]
        acc += tl.sum(g, 0)
    tl.store(OUT + e.to(tl.int64) * stride_oe + offs_n * stride_on, acc.to(OUT.dtype.element_ty), mask=n_mask)


# A memory-bound reduction: wide column strips, rows in steps of 64 (the whole dy is read once).
GROUPED_COLSUM = Kernel(
    _grouped_colsum_kernel,
    configs=[cfg(64, 128, 16, 4, 1), cfg(32, 256, 16, 4, 1), cfg(128, 64, 16, 4, 1)],
    interpret_config=cfg(16, 32, 16, 4, 1),
    key=["N"],
)


def grouped_colsum(dy: torch.Tensor, offs: torch.Tensor, row_scale: torch.Tensor | None = None,
                   dot_with: torch.Tensor | None = None):
    """out [E, N] = per expert e: dy[rows of e].sum(0), fp32 accumulation, in dy's dtype; E = len(offs).
    The gradient of a per-expert bias added to rows dy's rows (moe.kernels.expert_mlp).

    row_scale (fp32 [M]): the rows weighted, out[e] = sum of row_scale[r] dy[r] (a bias the forward scaled with its
    row). dot_with ([E, N]): also return dots (fp32 [M]), dots[r] = <dy[r], dot_with[expert of r]> (0 for rows no
    expert owns), from the same read of dy: (out, dots)."""
    what = "grouped_colsum (Triton)"
    if dy.dim() != 2:
        raise ValueError(f"{what}: dy must be [M, N], got {tuple(dy.shape)}")
    check_triton_tensors(what, dy)
    e = offs.shape[0] if isinstance(offs, torch.Tensor) and offs.dim() == 1 else -1
    m, n = dy.shape
    offs = check_offs(offs, e, dy.device, m, what)
    if row_scale is not None and (row_scale.shape != (m,) or row_scale.dtype != torch.float32
                                  or row_scale.device != dy.device):
        raise ValueError(f"{what}: row_scale must be float32 [{m}] on {dy.device}, got {row_scale.dtype} "
                         f"{tuple(row_scale.shape)} on {row_scale.device}")
    if dot_with is not None and (dot_with.shape != (e, n) or dot_with.device != dy.device):
        raise ValueError(f"{what}: dot_with must be [{e}, {n}] on {dy.device}, got {tuple(dot_with.shape)} on "
                         f"{dot_with.device}")
    out = torch.empty(e, n, device=dy.device, dtype=dy.dtype)
    if out.numel() == 0 or m == 0:
        out.zero_()
        return out if dot_with is None else (out, dy.new_zeros(m, dtype=torch.float32))
    # the dot products' partial sums, one column per column block: as many blocks as the narrowest BLOCK_N makes
    k = GROUPED_COLSUM
    narrowest = min(c.kwargs["BLOCK_N"] for c in [*k.candidate_configs(), k.interpret_config, k._pinned] if c)
    part = dy.new_zeros(m, triton.cdiv(n, narrowest), dtype=torch.float32) if dot_with is not None else out
    sc = row_scale.contiguous() if row_scale is not None else offs  # placeholders, never read when off
    dw = dot_with if dot_with is not None else out
    grid = lambda meta: (e * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    GROUPED_COLSUM[grid](dy, out, offs, sc, dw, part, m, n, e, dy.stride(0), dy.stride(1), out.stride(0),
                         out.stride(1), dw.stride(0), dw.stride(1), part.stride(0), E_POW2=triton.next_power_of_2(e),
                         HAS_SCALE=row_scale is not None, HAS_DOT=dot_with is not None)
    return out if dot_with is None else (out, part.sum(1))
