"""Grouped GEMM over contiguous expert row blocks: Y = X @ W[e] per block, plus its autograd.

Shapes: x [M_x, K], w [E, K, N], offs [E] int32 cumulative row ends (expert e owns logical rows
offs[e-1]:offs[e], offs[-1] = 0), optional gather_index [M] int64 (logical row r reads x[gather_index[r]];
without it M = M_x), y [M, N]. Logical rows at or past offs[-1] belong to no expert and come out 0.
Any offs and gather_index values are memory-safe, with one semantics everywhere (_common's docstring):
each offset is clamped to [previous end, M], and an index outside [0, M_x) reads a zero row.

Tile scheduling (no host sync): the grid is an upper bound of cdiv(M, BLOCK_M) + E row tiles times
cdiv(N, BLOCK_N) column tiles (each expert adds at most one partial row tile). Every program rebuilds
the per-expert tile table from ``offs`` on device (an E-wide cumsum in registers, cheap next to a
K-long GEMM loop), finds its expert with a vectorised search, and surplus programs zero the unowned
tail rows instead, so the output needs no separate memset. Programs are ordered GROUP_M row tiles at
a time per column strip so consecutive programs share W[e] and X tiles in L2.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (Kernel, cfg, check_gather_index, check_offs, check_triton_tensors, dot_acc, dot_flags,
                      expert_tile, expert_tile_table, gather_rows, gather_rows_ref, owned_row_tile, prune_by_smem,
                      row_tile_grid, swizzle_pid, tile_mm, to_out, why_not_triton_tensors)
from ._tma import (check_tma_mode, set_tma_allocator, tma_default, tma_wanted, try_tma_launch, why_not_tma_gemm,
                   why_not_variant)

# ---------------------------------------------------------------------------------------------------
# Reference (also the torch fallback where Triton cannot run)
# ---------------------------------------------------------------------------------------------------


def grouped_mm_ref(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                   gather_index: torch.Tensor | None = None) -> torch.Tensor:
    """Per-expert loop in plain PyTorch; differentiable through autograd. Any dtype, any device.

    Out-of-range offs and gather_index values as the kernels treat them (_common's docstring).
    """
    a = x if gather_index is None else gather_rows_ref(x, gather_index)
    m = a.shape[0]
    out = a.new_zeros(m, w.shape[-1])
    start = 0
    for e, end in enumerate(offs.tolist()):  # D2H sync: the loop bounds are the offsets
        end = min(max(end, start), m)  # clamped to [previous end, M]
        if end > start:
            out[start:end] = a[start:end] @ w[e]
        start = end
    return out


# ---------------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------------


@triton.jit
def add_bias(acc, BIAS, e, offs_n, n_mask, stride_be, stride_bn, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] + bias[e, offs_n] (fp32) when HAS_BIAS: an owned tile knows its expert, so an
    expert's bias costs one row load per tile in the epilogue."""
    if HAS_BIAS:
        b = tl.load(BIAS + e.to(tl.int64) * stride_be + offs_n * stride_bn, mask=n_mask, other=0.0)
        acc = acc + b.to(tl.float32)[None, :]
    return acc


@triton.jit
def scale_rows(acc, SCALE, rows, m_mask, HAS_SCALE: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] * scale[rows] (fp32 [M]) when HAS_SCALE: the combine's routing weights applied in the
    epilogue (moe.experts.FUSED_PERMUTE), so the combine is a plain sum."""
    if HAS_SCALE:
        acc = acc * tl.load(SCALE + rows, mask=m_mask, other=0.0).to(tl.float32)[:, None]
    return acc


@triton.jit
def _grouped_mm_kernel(
    X, W, Y, OFFS, GIDX, BIAS, SCALE,
    M, N, K, E, X_ROWS,
    stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_ym, stride_yn, stride_be, stride_bn,
    E_POW2: tl.constexpr, HAS_GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
    PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # tile scheduling as in the module docstring (_common.expert_tile), then one K loop per owned tile
    e, offs_m, m_mask, offs_n, n_mask, owned, _start, _end = expert_tile(OFFS, M, N, E, E_POW2, BLOCK_M, BLOCK_N,
                                                                         GROUP_M)
    if owned:
        src, a_mask = gather_rows(GIDX, offs_m, m_mask, X_ROWS, HAS_GATHER)
        acc, _ = tile_mm(X, src, a_mask, stride_xm, stride_xk, W + e.to(tl.int64) * stride_we, offs_n, n_mask,
                         stride_wk, stride_wn, K, 0, False, PRECISION, INTERP_BF16, BLOCK_M, BLOCK_N, BLOCK_K)
        acc = add_bias(acc, BIAS, e, offs_n, n_mask, stride_be, stride_bn, HAS_BIAS)
        acc = scale_rows(acc, SCALE, offs_m, m_mask, HAS_SCALE)
        y = to_out(acc, Y.dtype.element_ty, INTERP_BF16)
    else:
        # Surplus program: zero the rows past the last owned one (rows no expert owns).
        y = tl.zeros((BLOCK_M, BLOCK_N), dtype=Y.dtype.element_ty)
    y_ptrs = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, y, mask=m_mask[:, None] & n_mask[None, :])


# Candidates from the H100 sweep (tools/bench/tune_kernels.py; docs/kernels.md, "Autotuning"), best overall
# first (what MOEKIT_AUTOTUNE=first takes): the 128x256 tiles won the forward and dx on every shape but the
# fine-grained one (K = F = 256), where 128x128x32 with 4 warps did. The small ones are for fp32, whose
# tiles are twice the bytes (the smem prune drops the big ones there).
GROUPED_MM = Kernel(
    _grouped_mm_kernel,
    configs=[
        cfg(128, 256, 64, 8, 4),
        cfg(128, 256, 64, 8, 3),
        cfg(128, 256, 32, 8, 4),
        cfg(128, 128, 32, 4, 4),
        cfg(128, 128, 32, 4, 3),
        cfg(128, 128, 64, 8, 4),
        cfg(64, 128, 64, 4, 4),
        cfg(64, 64, 64, 4, 4),
        cfg(64, 64, 32, 4, 3),
    ],
    interpret_config=cfg(32, 32, 16, 4, 1, group=2),
    key=["N", "K"],
    prune=prune_by_smem(200 * 1024),
)

@triton.jit
def _grouped_mm_tma_kernel(
    X, W, Y, OFFS, BIAS, SCALE,
    M, N, K, E,
    stride_xm, stride_we, stride_wr, stride_ym, stride_yn, stride_be, stride_bn,
    E_POW2: tl.constexpr, W_TRANS: tl.constexpr, FLATTEN: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """_grouped_mm_kernel's tiles, persistent and through tensor-memory (TMA) descriptors.

    Persistent: a grid of about one program per SM. Each builds the expert tile table once, then walks the
    owned tiles program_id, program_id + num_programs, ... (GROUP_M swizzle over the owned row tiles), then
    the tiles of the tail rows no expert owns, which it zeroes. The owned-tile loop is a plain nest (no
    branch around the K loop) so that FLATTEN lets Triton pipeline one tile's loads under the previous
    tile's epilogue, the point of a persistent kernel when K is short (fine-grained experts: 4-8 K steps).
    TMA: three descriptors made once per program. x over all of [M, K]: a tile's rows past its expert's end
    read the next expert's rows, which only feed output rows the store masks (a row's result depends on
    that row alone); past M and the k tail the hardware fills zeros. W over [E, K, N] as stored (W_TRANS:
    the stored [E, N, K] of a transposed view, the tile transposed in registers), so each expert's k and n
    tails are zero-filled at its own bounds. The K loop and its reduction order are the pointer kernel's:
    the same bits. Unit inner strides, no gather (the launcher's conditions)."""
    eids, starts, ends, tiles, tile_end = expert_tile_table(OFFS, M, E, E_POW2, BLOCK_M)
    owned_m = tl.sum(tiles, 0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid, programs = tl.program_id(0), tl.num_programs(0)
    x_desc = tl.make_tensor_descriptor(X, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    if W_TRANS:
        w_desc = tl.make_tensor_descriptor(W, shape=[E, N, K], strides=[stride_we, stride_wr, 1],
                                           block_shape=[1, BLOCK_N, BLOCK_K])
    else:
        w_desc = tl.make_tensor_descriptor(W, shape=[E, K, N], strides=[stride_we, stride_wr, 1],
                                           block_shape=[1, BLOCK_K, BLOCK_N])
    for tile in tl.range(pid, owned_m * num_pid_n, programs, flatten=FLATTEN):
        pid_m, pid_n = swizzle_pid(tile, owned_m, num_pid_n, GROUP_M)
        e, first_row, end = owned_row_tile(pid_m, eids, starts, ends, tiles, tile_end, BLOCK_M)
        n0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = x_desc.load([first_row, k0])
            if W_TRANS:
                b = tl.trans(tl.reshape(w_desc.load([e, n0, k0]), (BLOCK_N, BLOCK_K)))
            else:
                b = tl.reshape(w_desc.load([e, k0, n0]), (BLOCK_K, BLOCK_N))
            acc = dot_acc(a, b, acc, PRECISION, INTERP_BF16)
        offs_m = first_row + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        acc = add_bias(acc, BIAS, e, offs_n, offs_n < N, stride_be, stride_bn, HAS_BIAS)
        acc = scale_rows(acc, SCALE, offs_m, offs_m < end, HAS_SCALE)
        y_ptrs = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
        tl.store(y_ptrs, to_out(acc, Y.dtype.element_ty, INTERP_BF16),
                 mask=(offs_m < end)[:, None] & (offs_n < N)[None, :])
    # rows no expert owns (past the last expert's end) come out 0, as in the pointer kernel
    tail = tl.max(ends, 0)
    for tile in range(pid, tl.cdiv(M - tail, BLOCK_M) * num_pid_n, programs):
        offs_m = tail + (tile // num_pid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = (tile % num_pid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        y_ptrs = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
        tl.store(y_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=Y.dtype.element_ty),
                 mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


GROUPED_MM_TMA = GROUPED_MM.variant(_grouped_mm_tma_kernel)

# Where the persistent TMA variant runs (no gather; unit inner strides and 16-byte aligned rows of x and of
# W's stored layout; CUDA sm90+ or the interpreter): "auto" (the default: on CUDA, where it measured faster than the
# pointer kernel, tools/bench/grouped_gemm.py's triton_tma peer), "never", "always" (also in the interpreter:
# tests); it starts as
# MOEKIT_TMA says (_tma.TMA_ENV). A Triton without device-side descriptors, or one that cannot build the
# kernel here, falls back with a warning.
GEMM_TMA = tma_default()
_TMA_FAILURE: list[str] = []
# programs per SM of the persistent launch, and the SM count per device (the interpreter runs a few programs,
# so that its tests cover the tile loop's stride)
PROGRAMS_PER_SM = 1
# Loop flattening of the persistent tile loop (tl.range(flatten=...)): the next tile's loads pipelined under
# this tile's epilogue. On by default with the variant; False keeps the two loops apart.
FLATTEN = True
_SMS: dict = {}


def why_not_tma(x: torch.Tensor, w: torch.Tensor, gather_index=None) -> str:
    """"" when _grouped_mm_tma_kernel can take these operands (w as stored: [E, K, N], or [E, N, K] for a
    transposed view), else why not."""
    return why_not_variant(why_not_tma_gemm(x=x, w=w), _TMA_FAILURE, gather_index)


def _persistent_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 3
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device] * PROGRAMS_PER_SM


def _launch_tma(x, w, y, offs, m, n, k, e, transpose_w: bool, flags: dict, bias=None, row_scale=None) -> bool:
    """Run the persistent TMA kernel into y; False when it cannot run here (then the pointer kernel does)."""
    check_tma_mode(GEMM_TMA, "grouped_mm.GEMM_TMA")
    if not tma_wanted(GEMM_TMA, x.device) or why_not_tma(x, w):
        return False
    set_tma_allocator(x.device)
    programs = _persistent_programs(x.device)
    grid = lambda meta: (min(programs, (triton.cdiv(m, meta["BLOCK_M"]) + e) * triton.cdiv(n, meta["BLOCK_N"])),)  # noqa: E731
    b = bias if bias is not None else y  # placeholder pointer, never read when HAS_BIAS is False
    sc = row_scale if row_scale is not None else offs  # placeholder pointer, never read when HAS_SCALE is False
    return try_tma_launch(lambda: GROUPED_MM_TMA[grid](
        x, w, y, offs, b, sc, m, n, k, e,
        x.stride(0), w.stride(0), w.stride(1), y.stride(0), y.stride(1), b.stride(0), b.stride(1),
        E_POW2=triton.next_power_of_2(e), W_TRANS=transpose_w, FLATTEN=FLATTEN, HAS_BIAS=bias is not None,
        HAS_SCALE=row_scale is not None, **flags,
    ), _TMA_FAILURE, "grouped_mm")


# ---------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------


def check_grouped_mm_shapes(x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"{what}: x must be [M, K] and w [E, K, N], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"{what}: x is [M, K={x.shape[1]}] but w is [E, K={w.shape[1]}, N]; K must match")


def check_bias(what: str, bias: torch.Tensor | None, num_experts: int, n: int, name: str = "bias") -> None:
    """A per-expert bias is None or an [E, N] tensor (any strides); dtype and device are checked with the
    other operands (check_triton_tensors)."""
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (num_experts, n)):
        got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"{what}: {name} must be [E={num_experts}, N={n}] (one bias row per expert), got {got}")


def check_row_scale(what: str, row_scale: torch.Tensor | None, m: int, device: torch.device) -> None:
    """A row scale is None or a contiguous float32 [M] tensor on the operands' device."""
    if row_scale is None:
        return
    if (not isinstance(row_scale, torch.Tensor) or tuple(row_scale.shape) != (m,) or row_scale.dtype != torch.float32
            or row_scale.device != device or not row_scale.is_contiguous()):
        got = (f"{tuple(row_scale.shape)} {row_scale.dtype} on {row_scale.device}" if isinstance(row_scale, torch.Tensor)
               else type(row_scale).__name__)
        raise ValueError(f"{what}: row_scale must be a contiguous float32 [M={m}] tensor on {device}, got {got}")


def check_grouped_mm_operands(x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    """What every backend needs of x and w (the Triton kernels and the torch loop alike), checked once where
    the backend is chosen so that each reports the same ValueError: tensors of shapes [M, K] and [E, K, N],
    one dtype, one device. Metadata only: no host sync."""
    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{what}: {name} must be a tensor, got {type(t).__name__}")
    check_grouped_mm_shapes(x, w, what)
    if x.device != w.device:
        raise ValueError(f"{what}: all tensors must be on one device, got x on {x.device} and w on {w.device}")
    if x.dtype != w.dtype:
        raise ValueError(f"{what}: all tensors must share one dtype, got x {x.dtype} and w {w.dtype}; cast one "
                         f"of them")


def grouped_mm_fwd(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, gather_index: torch.Tensor | None = None,
                   *, transpose_w: bool = False, allow_tf32: bool = False, bias: torch.Tensor | None = None,
                   row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Triton launch: y [M, N] = x[rows] @ w[e] (+ bias[e], bias [E, N]) (``transpose_w``: @ w[e]^T via
    strides, no copy), each row times row_scale[row] (float32 [M]) when given. Rows no expert owns stay 0, bias
    or not."""
    what = "grouped_mm (Triton)"
    wt = w.transpose(1, 2) if transpose_w else w  # a view: the kernel only sees strides
    check_grouped_mm_shapes(x, wt, what)
    check_bias(what, bias, wt.shape[0], wt.shape[2])
    check_triton_tensors(what, x, w, *([] if bias is None else [bias]))
    check_gather_index(gather_index, x.device, what)
    m = x.shape[0] if gather_index is None else gather_index.shape[0]
    offs = check_offs(offs, w.shape[0], x.device, m, what)
    check_row_scale(what, row_scale, m, x.device)
    e, k, n = wt.shape
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0 or n == 0:
        return y
    if e == 0:  # no expert owns a row
        return y.zero_()
    if k == 0 and bias is None:  # no products
        return y.zero_()
    flags = dot_flags(x.dtype, allow_tf32)
    if gather_index is None and k > 0 and _launch_tma(x, w, y, offs, m, n, k, e, transpose_w, flags, bias,
                                                      row_scale):
        return y
    b = bias if bias is not None else y  # placeholder pointer, never read when HAS_BIAS is False
    sc = row_scale if row_scale is not None else offs  # placeholder pointer, never read when HAS_SCALE is False
    GROUPED_MM[row_tile_grid(m, n, e)](
        x, wt, y, offs, gather_index if gather_index is not None else offs, b, sc,
        m, n, k, e, x.shape[0],
        x.stride(0), x.stride(1), wt.stride(0), wt.stride(1), wt.stride(2), y.stride(0), y.stride(1),
        b.stride(0), b.stride(1),
        E_POW2=triton.next_power_of_2(e), HAS_GATHER=gather_index is not None, HAS_BIAS=bias is not None,
        HAS_SCALE=row_scale is not None, **flags,
    )
    return y


# ---------------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------------


class GroupedMMFunction(torch.autograd.Function):
    """dX = dY @ W[e]^T reuses the forward kernel on a transposed view; dW[e] = X_e^T dY_e is the
    k-grouped wgrad kernel. With a gather, dX for the logical rows is scatter-added back onto x in a
    fixed order (deterministic)."""

    @staticmethod
    def forward(ctx, x, w, offs, gather_index, allow_tf32):
        ctx.save_for_backward(x, w, offs, gather_index)
        ctx.allow_tf32 = allow_tf32
        return grouped_mm_fwd(x, w, offs, gather_index, allow_tf32=allow_tf32)

    @staticmethod
    def backward(ctx, dy):
        from .grouped_mm_wgrad import grouped_mm_wgrad
        from .scatter_add import scatter_add_rows

        x, w, offs, gather_index = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = grouped_mm_fwd(dy, w, offs, transpose_w=True, allow_tf32=ctx.allow_tf32)
            if gather_index is not None:
                dx = scatter_add_rows(dx, gather_index, x.shape[0])
        if ctx.needs_input_grad[1]:
            dw = grouped_mm_wgrad(x, dy, offs, gather_index, allow_tf32=ctx.allow_tf32)
        return dx, dw, None, None, None


# ---------------------------------------------------------------------------------------------------
# Functional API
# ---------------------------------------------------------------------------------------------------

BACKENDS = ("auto", "triton", "torch")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, gather_index: torch.Tensor | None = None,
               *, backend: str = "auto", allow_tf32: bool = False) -> torch.Tensor:
    """Grouped matmul over contiguous expert row blocks; differentiable in x and w.

    x [M_x, K], w [E, K, N], offs [E] int32 cumulative row ends (torch.nn.functional.grouped_mm's
    convention: expert e owns rows offs[e-1]:offs[e]) -> y [M, N] with M = M_x, or with
    gather_index [M] int64, M = len(gather_index) and logical row r = x[gather_index[r]].
    Rows at or past offs[-1] are zero. Empty experts and M = 0 are fine. Out-of-range values are
    memory-safe and defined: each offset is clamped to [previous end, M] (a negative or decreasing
    one gives an empty expert; rows no expert owns come out 0 and get zero gradient), and a gather
    index outside [0, M_x) reads a zero row whose gradient is dropped.

    backend: "auto" runs Triton where it can (CUDA, or CPU under TRITON_INTERPRET=1) and a per-expert
    torch loop elsewhere (one host sync); "triton" raises a ValueError saying why when it cannot run;
    "torch" always takes the loop. allow_tf32: fp32 inputs multiply in TF32 (faster, ~1e-3 relative).
    """
    what = "grouped_mm"  # every argument error names the public function, whichever backend then runs
    if backend not in BACKENDS:
        raise ValueError(f"{what}: backend={backend!r} is unknown; use one of {BACKENDS}")
    check_grouped_mm_operands(x, w, what)
    check_gather_index(gather_index, x.device, what)
    m = x.shape[0] if gather_index is None else gather_index.shape[0]
    offs = check_offs(offs, w.shape[0], x.device, m, what)  # metadata only; int32 contiguous
    use_triton = backend == "triton" or (backend == "auto" and why_not_triton_tensors(x, w) == "")
    if not use_triton:
        return grouped_mm_ref(x, w, offs, gather_index)
    return GroupedMMFunction.apply(x, w, offs, gather_index, allow_tf32)

