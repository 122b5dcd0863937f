"""The whole expert MLP, y = act(rows_e @ w_in[e]) @ w_out[e] per expert, with the activation fused.

Shapes: rows [N, H] expert-major, counts [E] int64, w_in [E, H, F_in] (F_in = 2F for SwiGLU laid out
[gate | up], F otherwise), w_out [E, F, H] -> y [N, H]; rows at or past sum(counts) come out 0.
Any counts values are safe: a negative count is 0 and the row blocks stop at N
(moe.experts.counts_to_offs); the kernels clamp the offsets like every grouped kernel (_common).

Variants: ``"plain"`` = grouped_mm, the activation in torch, grouped_mm. ``"fused"``:
  forward   kernel 1 computes the gate and up tiles of one [BLOCK_M, BLOCK_N] block of h in the same
            program (two accumulators sharing each x tile) and writes h = act(pre) directly; when a
            gradient is needed it also writes pre = rows @ w_in (the activation's input, F_in wide)
            so backward needs no GEMM recompute. Then y = grouped_mm(h, w_out).
  backward  kernel 2 computes dh = dy @ w_out[e]^T and, in its epilogue, reads pre and writes
            dpre = dh * act'(pre) plus h = act(pre) recomputed (needed for dw_out, so h is never
            saved). Then dx = grouped_mm(dpre, w_in^T), dw_in = wgrad(rows, dpre),
            dw_out = wgrad(h, dy), each only when needed.
Activation math runs in fp32 on the fp32 accumulators; gelu is the exact erf form.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekit.moe.activations import OAI_ALPHA, OAI_LIMIT, get_activation
from moekit.moe.experts import counts_to_offs

from ._common import (LAUNCHES, Kernel, cfg, check_gather_index, check_offs, check_triton_tensors, dot_flags,
                      expert_tile, gather_rows, prune_by_smem, row_tile_grid, tile_mm, to_out, why_not_triton_tensors)
from ._tma import (check_tma_mode, set_tma_allocator, tile_mm_tma, tile_mm_tma_b, tma_default, tma_wanted,
                   try_tma_launch, why_not_tma_gemm, why_not_variant)
from .grouped_mm import check_bias, check_row_scale, grouped_mm, grouped_mm_fwd
from .grouped_mm_wgrad import grouped_colsum, grouped_mm_wgrad
from .combine import combine_rows
from .scatter_add import scatter_add_rows

VARIANTS = ("fused", "plain")
# The kernels' ACT constexpr is moe.activations' Activation.kernel_code; the epilogues below hard-code
# each one's forward and derivative (0 swiglu, gated; 1 gelu, erf form; 2 relu; 3 swiglu_oai, gated, gpt-oss's
# clamped SwiGLU). tests/test_kernels.py checks every entry of that table against its torch function.
# swiglu_oai's constants are literals in the kernels (a global tl.constexpr does not multiply a tensor in the
# interpreter); they must stay moe.activations' values:
assert (OAI_ALPHA, OAI_LIMIT) == (1.702, 7.0), "update the swiglu_oai literals in the epilogues below"

# ---------------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------------


def expert_mlp_ref(rows: torch.Tensor, counts: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
                   activation: str) -> torch.Tensor:
    """Per-expert loop in plain PyTorch (the same maths as moe.experts' "loop" backend), rows past the
    clamped counts (counts_to_offs) 0."""
    act = get_activation(activation)
    out = rows.new_zeros(rows.shape[0], w_out.shape[-1])
    start = 0
    for e, end in enumerate(counts_to_offs(counts, rows.shape[0]).tolist()):  # D2H sync: the loop bounds
        if end > start:
            out[start:end] = act(rows[start:end] @ w_in[e]) @ w_out[e]
        start = end
    return out


# ---------------------------------------------------------------------------------------------------
# Kernels. Tile scheduling and the K loop are grouped_mm's (see grouped_mm.py), shared via _common.py.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _expert_up_act_kernel(
    X, W, HOUT, PRE, OFFS, BIAS, GIDX,
    M, F, K, E, X_ROWS,
    stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_hm, stride_hn, stride_pm, stride_pn,
    stride_be, stride_bn,
    E_POW2: tl.constexpr, ACT: tl.constexpr, SAVE_PRE: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_GATHER: tl.constexpr, PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """h[:, n-tile] = act(x @ w[e][:, n-tile] (, x @ w[e][:, F + n-tile]) (+ bias[e] columns)); optionally
    pre (the activation's input, bias included) as well. HAS_BIAS: the tile's expert e is known here, so its
    bias row is one [BLOCK_N] load per half. HAS_GATHER: logical row r reads x[GIDX[r]] (X_ROWS rows; an index
    outside them reads zeros), the permute's gather done in the K loop's loads (_common.gather_rows). TMA: the
    operands through descriptors (_tma.tile_mm_tma; unit inner strides), or with HAS_GATHER the weights alone
    (_tma.tile_mm_tma_b: the gathered rows through pointers)."""
    GATED: tl.constexpr = (ACT == 0) | (ACT == 3)
    e, offs_m, m_mask, offs_n, n_mask, owned, start, end = expert_tile(OFFS, M, F, E, E_POW2, BLOCK_M, BLOCK_N,
                                                                       GROUP_M)
    if owned:
        # the up half starts F columns later; the same x tile feeds it: x is read once for both halves
        w_e = W + e.to(tl.int64) * stride_we
        if TMA and HAS_GATHER:  # the weights through a descriptor, the gathered rows through pointers
            src, a_mask = gather_rows(GIDX, offs_m, m_mask, X_ROWS, HAS_GATHER)
            acc_g, acc_u = tile_mm_tma_b(X, src, a_mask, stride_xm, stride_xk, w_e, stride_wk, tl.min(offs_n, 0),
                                         (1 + GATED) * F, K, F, GATED, PRECISION, INTERP_BF16, BLOCK_M, BLOCK_N,
                                         BLOCK_K)
        elif TMA:
            acc_g, acc_u = tile_mm_tma(X, start, end - start, stride_xm, tl.min(offs_m, 0) - start, w_e, stride_wk,
                                       tl.min(offs_n, 0), (1 + GATED) * F, K, F, False, GATED, PRECISION, INTERP_BF16,
                                       BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            src, a_mask = gather_rows(GIDX, offs_m, m_mask, X_ROWS, HAS_GATHER)
            acc_g, acc_u = tile_mm(X, src, a_mask, stride_xm, stride_xk, w_e, offs_n, n_mask, stride_wk, stride_wn,
                                   K, F, GATED, PRECISION, INTERP_BF16, BLOCK_M, BLOCK_N, BLOCK_K)
        if HAS_BIAS:  # bias[e, n-tile] (and bias[e, F + n-tile]: the up half), in fp32 on the accumulators
            b_ptrs = BIAS + e.to(tl.int64) * stride_be + offs_n * stride_bn
            acc_g += tl.load(b_ptrs, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_u += tl.load(b_ptrs + F * stride_bn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if ACT == 0:
            h = acc_g * tl.sigmoid(acc_g) * acc_u
        elif ACT == 1:
            h = 0.5 * acc_g * (1.0 + tl.erf(acc_g * 0.7071067811865476))
        elif ACT == 2:
            h = tl.maximum(acc_g, 0.0)
        else:  # swiglu_oai: (clamp(u) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
            _ALPHA: tl.constexpr = 1.702
            _LIMIT: tl.constexpr = 7.0
            g_c = tl.minimum(acc_g, _LIMIT)
            u_c = tl.minimum(tl.maximum(acc_u, -_LIMIT), _LIMIT)
            h = (u_c + 1.0) * g_c * tl.sigmoid(_ALPHA * g_c)
        h = to_out(h, HOUT.dtype.element_ty, INTERP_BF16)
        pre_g = to_out(acc_g, HOUT.dtype.element_ty, INTERP_BF16)
        pre_u = to_out(acc_u, HOUT.dtype.element_ty, INTERP_BF16)
    else:  # surplus program: zero the unowned tail rows
        h = tl.zeros((BLOCK_M, BLOCK_N), dtype=HOUT.dtype.element_ty)
        pre_g = h
        pre_u = h
    mn_mask = m_mask[:, None] & n_mask[None, :]
    rows64 = offs_m.to(tl.int64)[:, None]
    tl.store(HOUT + rows64 * stride_hm + offs_n[None, :] * stride_hn, h, mask=mn_mask)
    if SAVE_PRE:
        p_ptrs = PRE + rows64 * stride_pm + offs_n[None, :] * stride_pn
        tl.store(p_ptrs, pre_g, mask=mn_mask)
        if GATED:
            tl.store(p_ptrs + F * stride_pn, pre_u, mask=mn_mask)


@triton.jit
def _dact_columns(acc, SCALE, GS, PRE, DPRE, HOUT, rows64, m_mask, col0, F,
                  stride_pm, stride_pn, stride_dpm, stride_dpn, stride_hm, stride_hn, stride_gm,
                  ACT: tl.constexpr, STORE_H: tl.constexpr, HAS_SCALE: tl.constexpr, INTERP_BF16: tl.constexpr,
                  WIDTH: tl.constexpr):
    """The down_dact epilogue for WIDTH columns from col0: dpre = dh * act'(pre) (and h = act(pre)); pre holds
    the first projection's bias already, so the backward needs nothing else of it.

    HAS_SCALE: the forward scaled each row of y = h @ w_out by SCALE[row] (the combine's weight), so acc is
    dy @ w_out^T before the scale: dh = scale * acc, the stored h is scale * h (what dw_out's wgrad wants), and
    the rows' sums of h * acc over these columns, the weight's gradient <y_row, dy_row> over them, go to their
    slot of GS (the kernel's docstring)."""
    GATED: tl.constexpr = (ACT == 0) | (ACT == 3)
    offs_n = col0 + tl.arange(0, WIDTH)
    mask = m_mask[:, None] & (offs_n < F)[None, :]
    p_ptrs = PRE + rows64 * stride_pm + offs_n[None, :] * stride_pn
    g = tl.load(p_ptrs, mask=mask, other=0.0).to(tl.float32)
    # h and the derivative factors first (d_g = dh * fg, d_u = dh * fu), then the scale's partial sums from the
    # unscaled acc, then acc scaled in place: no second accumulator-sized tile is live at once
    if ACT == 0:
        u = tl.load(p_ptrs + F * stride_pn, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        fg = u * sig * (1.0 + g * (1.0 - sig))
        fu = silu
        h = silu * u
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
        pdf = tl.exp(-0.5 * g * g) * 0.3989422804014327  # 1/sqrt(2*pi)
        fg = cdf + g * pdf
        fu = fg
        h = g * cdf
    elif ACT == 2:
        fg = tl.where(g > 0.0, 1.0, 0.0)
        fu = fg
        h = tl.maximum(g, 0.0)
    else:  # swiglu_oai; clamp passes the gradient inside [lo, hi] bounds included, as torch's clamp backward
        _ALPHA: tl.constexpr = 1.702
        _LIMIT: tl.constexpr = 7.0
        u = tl.load(p_ptrs + F * stride_pn, mask=mask, other=0.0).to(tl.float32)
        g_c = tl.minimum(g, _LIMIT)
        u_c = tl.minimum(tl.maximum(u, -_LIMIT), _LIMIT)
        sig = tl.sigmoid(_ALPHA * g_c)
        fg = tl.where(g <= _LIMIT, (u_c + 1.0) * sig * (1.0 + _ALPHA * g_c * (1.0 - sig)), 0.0)
        fu = tl.where((u >= -_LIMIT) & (u <= _LIMIT), g_c * sig, 0.0)
        h = (u_c + 1.0) * g_c * sig
    if HAS_SCALE:
        # masked columns: pre reads 0 and acc's tails are 0, so they add nothing
        # (a column block wholly past F has no slot: its sums are 0, and the slot would be the next row's)
        in_f = (tl.zeros((1,), dtype=tl.int32) + col0) < F
        tl.store(GS + rows64 * stride_gm + col0 // 8, tl.sum(h * acc, 1)[:, None], mask=m_mask[:, None] & in_f[None, :])
        scale = tl.load(SCALE + rows64, mask=m_mask[:, None], other=0.0).to(tl.float32)  # [BLOCK_M, 1]
        acc = acc * scale  # dh
        h = h * scale
    if ACT == 2:  # a zero factor must not turn an inf / nan dh into nan
        d_g = tl.where(g > 0.0, acc, 0.0)
    else:
        d_g = acc * fg
    d_u = acc * fu
    dp_ptrs = DPRE + rows64 * stride_dpm + offs_n[None, :] * stride_dpn
    tl.store(dp_ptrs, to_out(d_g, DPRE.dtype.element_ty, INTERP_BF16), mask=mask)
    if GATED:
        tl.store(dp_ptrs + F * stride_dpn, to_out(d_u, DPRE.dtype.element_ty, INTERP_BF16), mask=mask)
    if STORE_H:
        tl.store(HOUT + rows64 * stride_hm + offs_n[None, :] * stride_hn, to_out(h, HOUT.dtype.element_ty, INTERP_BF16),
                 mask=mask)


@triton.jit
def _column_halves(t, ROWS: tl.constexpr, HALF: tl.constexpr):
    """[ROWS, 2 * HALF] -> its left and right [ROWS, HALF] column halves (element order kept)."""
    return tl.split(tl.permute(tl.reshape(t, (ROWS, 2, HALF)), (0, 2, 1)))


@triton.jit
def _expert_down_dact_kernel(
    DY, W, PRE, DPRE, HOUT, OFFS, SCALE, GS,
    M, F, K, E,
    stride_dym, stride_dyk, stride_we, stride_wk, stride_wn, stride_pm, stride_pn, stride_dpm, stride_dpn,
    stride_hm, stride_hn, stride_gm,
    E_POW2: tl.constexpr, ACT: tl.constexpr, STORE_H: tl.constexpr, HAS_SCALE: tl.constexpr,
    PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """dh = dy @ w_out[e]^T (W passed as a transposed view), epilogue: dpre = dh * act'(pre), h = act(pre).

    The epilogue runs on the tile's four column quarters in turn (BLOCK_N >= 4). On a whole 128 x 128 tile,
    the fp32 accumulator, the two pre tiles, their products and the 64-bit pointers did not fit in 255
    registers: ptxas (sm90) reported 830-940 bytes of spills per thread at 8 warps and 5.8 KB at 4, and the
    kernel ran at 175-400 TFLOP/s where the plain GEMMs reached 500-720 (docs/benchmarks.md, second GPU
    round). In quarters the tuned configs spill nothing (64 x 128: 107 registers instead of 246).

    TMA: dy and w_out[e] through descriptors (_tma.tile_mm_tma; stride_wn is w_out's stored row stride,
    the view's column stride).

    HAS_SCALE: the forward's rows were scaled by SCALE (fp32 [M], the combine's weights: _dact_columns); each
    column quarter's row sums of h * (dy @ w_out^T) go to GS[row, col0 // 8] (fp32, zeroed by the launcher:
    GS_COLUMNS), whose row sums are the scales' gradient: a fixed order, no atomics."""
    GATED: tl.constexpr = (ACT == 0) | (ACT == 3)
    e, offs_m, m_mask, offs_n, n_mask, owned, start, end = expert_tile(OFFS, M, F, E, E_POW2, BLOCK_M, BLOCK_N,
                                                                       GROUP_M)
    if owned:
        w_e = W + e.to(tl.int64) * stride_we
        first_row = tl.min(offs_m, 0)
        col0 = tl.min(offs_n, 0)
        if TMA:  # W is w_out[e]^T [H, F] as a view; its storage [F, H] is read and the tile transposed
            acc, _ = tile_mm_tma(DY, start, end - start, stride_dym, first_row - start, w_e, stride_wn, col0, F, K, 0,
                                 True, False, PRECISION, INTERP_BF16, BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            acc, _ = tile_mm(DY, offs_m, m_mask, stride_dym, stride_dyk, w_e, offs_n, n_mask, stride_wk, stride_wn, K,
                             0, False, PRECISION, INTERP_BF16, BLOCK_M, BLOCK_N, BLOCK_K)
        Q: tl.constexpr = BLOCK_N // 4
        # the rows again from scalars, after the K loop: no row vectors held in registers across it (an owned
        # tile's rows end at its expert's end)
        rows = first_row + tl.arange(0, BLOCK_M)
        m_mask = rows < end
        rows64 = rows.to(tl.int64)[:, None]
        left, right = _column_halves(acc, BLOCK_M, 2 * Q)
        a, b = _column_halves(left, BLOCK_M, Q)
        c, d = _column_halves(right, BLOCK_M, Q)
        _dact_columns(a, SCALE, GS, PRE, DPRE, HOUT, rows64, m_mask, col0, F, stride_pm, stride_pn, stride_dpm,
                      stride_dpn, stride_hm, stride_hn, stride_gm, ACT, STORE_H, HAS_SCALE, INTERP_BF16, Q)
        _dact_columns(b, SCALE, GS, PRE, DPRE, HOUT, rows64, m_mask, col0 + Q, F, stride_pm, stride_pn, stride_dpm,
                      stride_dpn, stride_hm, stride_hn, stride_gm, ACT, STORE_H, HAS_SCALE, INTERP_BF16, Q)
        _dact_columns(c, SCALE, GS, PRE, DPRE, HOUT, rows64, m_mask, col0 + 2 * Q, F, stride_pm, stride_pn,
                      stride_dpm, stride_dpn, stride_hm, stride_hn, stride_gm, ACT, STORE_H, HAS_SCALE, INTERP_BF16, Q)
        _dact_columns(d, SCALE, GS, PRE, DPRE, HOUT, rows64, m_mask, col0 + 3 * Q, F, stride_pm, stride_pn,
                      stride_dpm, stride_dpn, stride_hm, stride_hn, stride_gm, ACT, STORE_H, HAS_SCALE, INTERP_BF16, Q)
    else:  # surplus program: rows no expert owns get zero gradient (their output was forced to 0)
        rows64 = offs_m.to(tl.int64)[:, None]
        mn_mask = m_mask[:, None] & n_mask[None, :]
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=DPRE.dtype.element_ty)
        dp_ptrs = DPRE + rows64 * stride_dpm + offs_n[None, :] * stride_dpn
        tl.store(dp_ptrs, zero, mask=mn_mask)
        if GATED:
            tl.store(dp_ptrs + F * stride_dpn, zero, mask=mn_mask)
        if STORE_H:
            tl.store(HOUT + rows64 * stride_hm + offs_n[None, :] * stride_hn, zero, mask=mn_mask)


# The scale-gradient partials' column granularity: one slot per 8 columns of F, so that every column quarter of a
# tile (BLOCK_N >= 32: the configs' and the interpreter's) has its own slot. The kernel writes the literal. Each
# quarter stores its sums at once rather than adding them up across the tile: held across the four, they and the
# scale made ptxas (sm90) spill 148-212 bytes a thread at 128 x 128.
GS_COLUMNS = 8
_SMEM = 200 * 1024
# Two B tiles (gate and up) per stage and two accumulators: smaller N tiles than grouped_mm.
# Both lists ordered by the H100 sweep (tools/bench/tune_kernels.py), best overall first; 8 warps won every
# call of both kernels.
EXPERT_UP_ACT = Kernel(
    _expert_up_act_kernel,
    configs=[
        cfg(128, 128, 64, 8, 4),
        cfg(128, 128, 64, 8, 3),
        cfg(128, 128, 32, 8, 4),
        cfg(128, 64, 64, 4, 4),
        cfg(64, 128, 64, 4, 4),
        cfg(64, 64, 64, 4, 4),
        cfg(128, 64, 32, 4, 4),
        cfg(64, 64, 32, 4, 3),
        cfg(64, 64, 32, 8, 3),  # fp32 (FMA dot): two accumulators of 16 values a thread, no spills
        cfg(32, 64, 32, 4, 3),
    ],
    interpret_config=cfg(32, 32, 16, 4, 1, group=2),
    key=["F", "K", "ACT", "TMA", "HAS_GATHER"],
    prune=prune_by_smem(_SMEM, b_tiles=2, fp32_acc_per_thread=32),
)
_DOWN_DACT_FITS = prune_by_smem(_SMEM, elem_arg="DY", fp32_acc_per_thread=32)


def _prune_down_dact(configs, named_args, **kwargs):
    """prune_by_smem, and with HAS_SCALE (the row weights' epilogue: a scale tile and the partial sums) only tiles
    of at most 32 accumulator values a thread where any fit: at 64 ptxas (sm90) spilled 40-124 bytes a thread in
    that epilogue, at 32 none (moe.kernels._compile_check)."""
    kept = _DOWN_DACT_FITS(configs, named_args, **kwargs)
    if kwargs.get("HAS_SCALE", named_args.get("HAS_SCALE")):
        kept = [c for c in kept if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 32 * 32 * c.num_warps] or kept
    return kept


EXPERT_DOWN_DACT = Kernel(
    _expert_down_dact_kernel,
    configs=[
        cfg(128, 128, 128, 8, 3),
        cfg(64, 128, 128, 8, 4),
        cfg(128, 128, 64, 8, 4),
        cfg(64, 128, 128, 8, 3),
        cfg(64, 128, 64, 4, 4),
        cfg(128, 64, 64, 4, 4),
        cfg(64, 64, 32, 4, 3),
        cfg(64, 64, 32, 8, 3),  # fp32 (FMA dot)
        cfg(32, 64, 32, 4, 3),
    ],
    interpret_config=cfg(32, 32, 16, 4, 1, group=2),
    key=["F", "K", "ACT", "TMA", "HAS_SCALE"],
    prune=_prune_down_dact,
)

# Where the fused kernels read their GEMM operands through TMA descriptors (bf16 / fp16; unit inner strides and
# 16-byte aligned rows of the rows and of the weights as stored; CUDA sm90+ or the interpreter): "auto" (the
# default: on CUDA), "never", "always" (also in the interpreter: tests); it starts as MOEKIT_TMA says
# (_tma.TMA_ENV). Unlike grouped_mm's variant these stay one program per tile (not persistent): only the
# K loop's loads change. A Triton that cannot build them falls back to the pointer loads with a warning.
MLP_TMA = tma_default()
_TMA_FAILURE: list[str] = []


def why_not_tma(x: torch.Tensor, w: torch.Tensor, gather_index: torch.Tensor | None = None) -> str:
    """"" when the fused kernels can read x [M, K] and the weights w (as stored) through descriptors; with a
    gather_index, the weights alone (the gathered rows of x come through pointers)."""
    operands = dict(x=x, w=w) if gather_index is None else dict(w=w)
    return why_not_variant(why_not_tma_gemm(**operands), _TMA_FAILURE)


def _launch(kernel: Kernel, grid, args: tuple, x: torch.Tensor, w: torch.Tensor, gather_index=None,
            **constexprs) -> None:
    """kernel[grid](*args, TMA=..., **constexprs): the descriptor loads where MLP_TMA asks and they can run
    (for a gathered x, the weights' loads only), else (or after they fail to build, once, with a warning) the
    pointer loads."""
    check_tma_mode(MLP_TMA, "expert_mlp.MLP_TMA")
    if tma_wanted(MLP_TMA, x.device) and not why_not_tma(x, w, gather_index):
        set_tma_allocator(x.device)
        if try_tma_launch(lambda: kernel[grid](*args, TMA=True, **constexprs), _TMA_FAILURE, "expert_mlp"):
            LAUNCHES[f"{kernel.name}:tma"] += 1  # of the launches counted under its name: those with descriptors
            return
    kernel[grid](*args, TMA=False, **constexprs)


# ---------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------


def expert_up_act(x: torch.Tensor, w_in: torch.Tensor, offs: torch.Tensor, activation: str, *,
                  save_pre: bool, allow_tf32: bool = False, bias: torch.Tensor | None = None,
                  gather_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h [M, F], pre [M, F_in] or None) with h = act(x @ w_in[e] (+ bias[e])) per expert row block;
    bias [E, F_in] or None. gather_index [M] int64 or None: logical row r is x[gather_index[r]] (x [X_ROWS, K])."""
    what = "expert_up_act (Triton)"
    act = get_activation(activation)
    if x.dim() != 2 or w_in.dim() != 3 or w_in.shape[1] != x.shape[1] or (act.gated and w_in.shape[2] % 2):
        raise ValueError(f"{what}: need x [M, K] and w_in [E, K, F_in] (F_in even for {activation}), got "
                         f"{tuple(x.shape)} and {tuple(w_in.shape)}")
    check_bias(what, bias, w_in.shape[0], w_in.shape[2])
    check_triton_tensors(what, x, w_in, *([] if bias is None else [bias]))
    check_gather_index(gather_index, x.device, what)
    m, k = x.shape if gather_index is None else (gather_index.shape[0], x.shape[1])
    e, f_in = w_in.shape[0], w_in.shape[2]
    offs = check_offs(offs, e, x.device, m, what)
    f = f_in // 2 if act.gated else f_in
    h = torch.empty(m, f, device=x.device, dtype=x.dtype)
    pre = torch.empty(m, f_in, device=x.device, dtype=x.dtype) if save_pre else None
    if m == 0 or f == 0:
        return h, pre
    if e == 0:  # no expert owns a row
        return h.zero_(), pre if pre is None else pre.zero_()
    p = pre if pre is not None else h  # placeholder pointer, never written when SAVE_PRE is False
    b = bias if bias is not None else h  # placeholder pointer, never read when HAS_BIAS is False
    g = gather_index if gather_index is not None else offs  # placeholder pointer, never read without a gather
    _launch(EXPERT_UP_ACT, row_tile_grid(m, f, e), (
        x, w_in, h, p, offs, b, g, m, f, k, e, x.shape[0],
        x.stride(0), x.stride(1), w_in.stride(0), w_in.stride(1), w_in.stride(2),
        h.stride(0), h.stride(1), p.stride(0), p.stride(1), b.stride(0), b.stride(1),
    ), x, w_in, gather_index, E_POW2=triton.next_power_of_2(e), ACT=act.kernel_code, SAVE_PRE=save_pre,
        HAS_BIAS=bias is not None, HAS_GATHER=gather_index is not None, **dot_flags(x.dtype, allow_tf32))
    return h, pre


def expert_down_dact(dy: torch.Tensor, w_out: torch.Tensor, pre: torch.Tensor, offs: torch.Tensor,
                     activation: str, *, store_h: bool, allow_tf32: bool = False,
                     row_scale: torch.Tensor | None = None):
    """(dpre [M, F_in], h [M, F] or None, d_scale [M] or None): dpre = (dy @ w_out[e]^T) * act'(pre), h = act(pre).

    row_scale (float32 [M]): the forward computed y = row_scale * (h @ w_out[e]); then dh carries the scale,
    h comes back scaled (dw_out = wgrad(h, dy)), and d_scale[r] = <h[r] @ w_out[e], dy[r]> in fp32."""
    what = "expert_down_dact (Triton)"
    act = get_activation(activation)
    if (dy.dim() != 2 or w_out.dim() != 3 or pre.dim() != 2 or w_out.shape[2] != dy.shape[1]
            or tuple(pre.shape) != (dy.shape[0], act.in_features(w_out.shape[1]))):
        raise ValueError(f"{what}: need dy [M, H], w_out [E, F, H], pre [M, F_in] (F_in for {activation}), got "
                         f"{tuple(dy.shape)}, {tuple(w_out.shape)}, {tuple(pre.shape)}")
    check_triton_tensors(what, dy, w_out, pre)
    m, hdim = dy.shape
    e, f = w_out.shape[0], w_out.shape[1]
    offs = check_offs(offs, e, dy.device, m, what)
    check_row_scale(what, row_scale, m, dy.device)
    wt = w_out.transpose(1, 2)  # [E, H, F] view: the kernel reads w_out[e]^T through strides
    dpre = torch.empty(m, pre.shape[1], device=dy.device, dtype=dy.dtype)
    h = torch.empty(m, f, device=dy.device, dtype=dy.dtype) if store_h else None
    # one fp32 partial sum per column quarter of a tile (GS_COLUMNS), zero where none writes
    parts = dy.new_zeros(m, triton.cdiv(f, GS_COLUMNS), dtype=torch.float32) if row_scale is not None else None
    if m == 0 or f == 0 or e == 0:  # no products (no expert owns a row: zero gradient, act(pre) of those rows 0)
        return dpre.zero_(), h if h is None else h.zero_(), parts if parts is None else parts.sum(1)
    hp = h if h is not None else dpre  # placeholder pointer, never written when STORE_H is False
    sc, gs = (row_scale, parts) if row_scale is not None else (offs, dpre)  # placeholders without a scale
    _launch(EXPERT_DOWN_DACT, row_tile_grid(m, f, e), (
        dy, wt, pre, dpre, hp, offs, sc, gs, m, f, hdim, e,
        dy.stride(0), dy.stride(1), wt.stride(0), wt.stride(1), wt.stride(2),
        pre.stride(0), pre.stride(1), dpre.stride(0), dpre.stride(1), hp.stride(0), hp.stride(1), gs.stride(0),
    ), dy, w_out, E_POW2=triton.next_power_of_2(e), ACT=act.kernel_code, STORE_H=store_h,
        HAS_SCALE=row_scale is not None, **dot_flags(dy.dtype, allow_tf32))
    return dpre, h, parts if parts is None else parts.sum(1)


# ---------------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------------


class FusedExpertMLPFunction(torch.autograd.Function):
    """Optional biases b_in [E, F_in] / b_out [E, H] (None: no bias): added in the epilogues of the first
    kernel and of the second GEMM, which know their tile's expert; their gradients are the per-expert column
    sums of dpre and dy (grouped_colsum: a fixed reduction order, no atomics), rows past sum(counts) none.

    gather_index [N] (None: x is the rows): the first kernel reads row r from x[gather_index[r]], so the
    permuted [N, H] copy is never made nor saved (x is). Backward sums each x row's logical-row gradients in
    a fixed order: by ``gather_slots`` (x row t's rows are gather_slots[t*k:(t+1)*k], N for none: the
    combine kernel without weights, no sort) or else by a sort of gather_index (scatter_add_rows).

    row_scale [N] float32 (None: 1): the second GEMM's epilogue multiplies row r by it (the combine's routing
    weight, applied here so the combine is a plain sum and keeps no rows for its weights' gradient), after b_out:
    y[r] = row_scale[r] (h[r] @ w_out[e] + b_out[e]). Its gradient <h[r] @ w_out[e], dy[r]> comes from the backward
    kernel's epilogue, which has h and dy @ w_out^T in hand; with b_out, <b_out[e], dy[r]> from the bias gradient's
    read of dy (grouped_colsum's dot_with), whose column sums then weight each row by its scale."""

    @staticmethod
    def forward(ctx, x, offs, w_in, w_out, activation, allow_tf32, need_grad, b_in=None, b_out=None,
                gather_index=None, gather_slots=None, row_scale=None):
        # need_grad comes from the caller: inside forward grad mode is off and ctx.needs_input_grad
        # stays True under torch.no_grad(), which would make inference write pre for nothing.
        h, pre = expert_up_act(x, w_in, offs, activation, save_pre=need_grad, allow_tf32=allow_tf32, bias=b_in,
                               gather_index=gather_index)
        y = grouped_mm_fwd(h, w_out, offs, allow_tf32=allow_tf32, bias=b_out, row_scale=row_scale)
        ctx.save_for_backward(x, offs, w_in, w_out, pre, gather_index, gather_slots, row_scale,
                              b_out if row_scale is not None else None)  # the scale's gradient reads b_out
        ctx.activation, ctx.allow_tf32 = activation, allow_tf32
        return y

    @staticmethod
    def backward(ctx, dy):
        x, offs, w_in, w_out, pre, gather_index, gather_slots, row_scale, b_out = ctx.saved_tensors
        need_x, _, need_win, need_wout = ctx.needs_input_grad[:4]
        need_bin, need_bout = ctx.needs_input_grad[7:9]
        need_scale = ctx.needs_input_grad[11]
        tf32 = ctx.allow_tf32
        dx = dw_in = dw_out = db_in = db_out = d_scale = None
        if need_x or need_win or need_bin or need_scale:
            dpre, h, d_scale = expert_down_dact(dy, w_out, pre, offs, ctx.activation, store_h=need_wout,
                                                allow_tf32=tf32, row_scale=row_scale)
            if need_x:
                dx = grouped_mm_fwd(dpre, w_in, offs, transpose_w=True, allow_tf32=tf32)  # [N, H] row gradients
                if gather_index is not None:
                    dx = _sum_into_sources(dx, gather_index, gather_slots, x.shape[0])
            if need_win:
                dw_in = grouped_mm_wgrad(x, dpre, offs, gather_index, allow_tf32=tf32)
            if need_bin:
                db_in = grouped_colsum(dpre, offs)
        elif need_wout:  # only w_out trains: h from pre elementwise, no GEMM needed
            h = get_activation(ctx.activation)(pre)
            if row_scale is not None:
                h = h * row_scale[:, None].to(h.dtype)
        if need_wout:
            dw_out = grouped_mm_wgrad(h, dy, offs, allow_tf32=tf32)
        if row_scale is not None and b_out is not None and (need_bout or need_scale):
            # y = row_scale * (h @ w_out + b_out): db_out sums each row's dy times its scale, and the scale's
            # gradient gains <dy, b_out[e]>, both from one read of dy
            db_out, dots = grouped_colsum(dy, offs, row_scale=row_scale, dot_with=b_out.to(dy.dtype))
            db_out = db_out if need_bout else None
            if need_scale:
                d_scale = d_scale + dots
        elif need_bout:
            db_out = grouped_colsum(dy, offs)
        return dx, None, dw_in, dw_out, None, None, None, db_in, db_out, None, None, d_scale


def _sum_into_sources(d_rows: torch.Tensor, gather_index: torch.Tensor, gather_slots: torch.Tensor | None,
                      num_sources: int) -> torch.Tensor:
    """[num_sources, H]: each gathered-from row's gradient, the sum of its logical rows' in a fixed order."""
    if gather_slots is None:
        return scatter_add_rows(d_rows, gather_index, num_sources)
    if num_sources == 0:  # nothing to gather from (an expert-parallel rank that received no rows)
        return d_rows.new_zeros(0, d_rows.shape[1])
    return combine_rows(d_rows, gather_slots, None, num_sources, gather_slots.shape[0] // num_sources)


# ---------------------------------------------------------------------------------------------------
# Functional API
# ---------------------------------------------------------------------------------------------------


def why_not_triton(rows: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, *biases: torch.Tensor) -> str:
    """"" when the Triton expert path can run on these tensors, else a short reason naming the fix."""
    return why_not_triton_tensors(rows, w_in, w_out, *biases)


def expert_mlp(rows: torch.Tensor, counts: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
               activation: str, *, variant: str = "fused", allow_tf32: bool = False,
               b_in: torch.Tensor | None = None, b_out: torch.Tensor | None = None,
               gather_index: torch.Tensor | None = None, gather_slots: torch.Tensor | None = None,
               row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """act(rows_e @ w_in[e] (+ b_in[e])) @ w_out[e] (+ b_out[e]) per expert's contiguous row block;
    differentiable in rows, w_in, w_out and the optional biases b_in [E, F_in], b_out [E, H].

    rows [N, H], counts [E] (int64, expert e owns rows sum(counts[:e]):sum(counts[:e+1])),
    w_in [E, H, F_in] (F_in = 2F, [gate | up], for "swiglu"; F for "gelu"/"relu"), w_out [E, F, H]
    -> [N, H]; rows past sum(counts) are 0 (with zero gradient). A negative count counts as 0, and
    counts summing past N stop at N (moe.experts.counts_to_offs). variant "fused" (activation in
    the GEMM epilogues) or "plain" (two grouped GEMMs, activation in torch). Triton only: see
    why_not_triton.

    gather_index [N] int64: the rows are read in place, logical row r = rows[gather_index[r]] with rows
    [T, H] the unpermuted source (ScatterMoE-style: the permute's gather happens in the first GEMM's loads,
    and no [N, H] copy is made or kept for backward; an index outside [0, T) reads a zero row). The output
    is [N, H] in the logical order; rows' gradient [T, H] sums each source row's logical rows in a fixed
    order. gather_slots [T*k] int64, optional: the inverse map (source row t's logical rows are
    gather_slots[t*k:(t+1)*k], N or any index outside [0, N) for none, as moe.dispatch's slot_row), which
    lets that sum skip a sort.

    row_scale [N] float32: each output row times its entry, differentiable (the combine's routing weights, so
    that the combine is a plain sum: moe.experts.FUSED_PERMUTE); with b_out the bias is scaled with its row, as the
    weighted combine would.
    """
    what = "expert_mlp"
    act = get_activation(activation)  # ValueError naming the known activations
    if variant not in VARIANTS:
        raise ValueError(f"{what}: variant={variant!r} is unknown; use one of {VARIANTS}")
    if rows.dim() != 2 or w_in.dim() != 3 or w_out.dim() != 3:
        raise ValueError(f"{what}: need rows [N, H], w_in [E, H, F_in], w_out [E, F, H]; got "
                         f"{tuple(rows.shape)}, {tuple(w_in.shape)}, {tuple(w_out.shape)}")
    e, hdim, f_in = w_in.shape
    f = w_out.shape[1]
    want_f_in = act.in_features(f)
    if rows.shape[1] != hdim or w_out.shape[0] != e or w_out.shape[2] != hdim or f_in != want_f_in:
        raise ValueError(f"{what}: shapes disagree: rows {tuple(rows.shape)}, w_in {tuple(w_in.shape)}, "
                         f"w_out {tuple(w_out.shape)}; want w_in [E, H, {want_f_in}] for {activation} with "
                         f"w_out [E, F={f}, H]")
    if (counts.shape != (e,) or counts.dtype.is_floating_point or counts.dtype.is_complex
            or counts.dtype == torch.bool or counts.device != rows.device):
        raise ValueError(f"{what}: counts must be an integer [E={e}] tensor on {rows.device}, got "
                         f"{tuple(counts.shape)} {counts.dtype} on {counts.device}")
    check_bias(what, b_in, e, f_in, "b_in")
    check_bias(what, b_out, e, hdim, "b_out")
    _check_gather(what, rows, gather_index, gather_slots)
    num_rows = rows.shape[0] if gather_index is None else gather_index.shape[0]
    check_row_scale(what, row_scale, num_rows, rows.device)
    biases = [b for b in (b_in, b_out) if b is not None]
    reason = why_not_triton(rows, w_in, w_out, *biases)
    if reason:
        raise ValueError(f"{what}: {reason}")
    offs = counts_to_offs(counts, num_rows)  # on device: no host sync
    if variant == "plain":
        from moekit.moe.experts import add_expert_bias

        h = grouped_mm(rows, w_in, offs, gather_index, backend="triton", allow_tf32=allow_tf32)
        h = add_expert_bias(h, b_in, offs)
        y = add_expert_bias(grouped_mm(act(h), w_out, offs, backend="triton", allow_tf32=allow_tf32), b_out, offs)
        return y if row_scale is None else (y * row_scale[:, None]).to(y.dtype)
    scaled = () if row_scale is None else (row_scale,)
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (rows, w_in, w_out, *biases, *scaled))
    return FusedExpertMLPFunction.apply(rows, offs, w_in, w_out, activation, allow_tf32, need_grad, b_in, b_out,
                                        gather_index, gather_slots, row_scale)


def _check_gather(what: str, rows: torch.Tensor, gather_index: torch.Tensor | None,
                  gather_slots: torch.Tensor | None) -> None:
    check_gather_index(gather_index, rows.device, what)
    if gather_slots is None:
        return
    if gather_index is None:
        raise ValueError(f"{what}: gather_slots is the inverse of gather_index; pass gather_index too, or neither")
    if (not isinstance(gather_slots, torch.Tensor) or gather_slots.dim() != 1 or gather_slots.dtype != torch.int64
            or gather_slots.device != rows.device):
        raise ValueError(f"{what}: gather_slots must be a 1-D int64 tensor on {rows.device}")
    t = rows.shape[0]
    if (t == 0 and gather_slots.numel()) or (t and gather_slots.numel() % t):
        raise ValueError(f"{what}: gather_slots has {gather_slots.numel()} entries, not k per source row for the "
                         f"{t} rows; it must be [T*k] (moe.dispatch's slot_row)")
