"""The local combine (weighted gather-sum of expert rows back onto tokens) and its backward, in one pass each.

Shape legend: T tokens, k slots per token, N routed rows, H hidden. ``slot_row`` [T*k] names the row of
each slot (``moe.dispatch.sort_slots``); a slot whose index lies outside [0, N) (the pad value N of a
dropped slot, or any other value, negative included) has no row: it contributes zero, receives nothing,
and its index is never turned into an address.

    combine_rows           out[t] = sum_{j=0..k-1} w[t, j] * rows[slot_row[t*k + j]]       (w None: 1)
    combine_rows_backward  grad_rows[slot_row[t*k + j]] = w[t, j] * grad_out[t]
                           grad_w[t, j] = <rows[slot_row[t*k + j]], grad_out[t]>

``combine_rows`` with ``weights=None`` is also the permute's backward (grad_x[t] = sum_j grad_rows[row of
slot (t, j)]). Every sum runs in fp32 in a fixed order (slots j = 0..k-1; grad_w over H in column-tile
order), one program owns each output element and nothing is added atomically, so results are bitwise
reproducible run to run. The backward writes each slot's row once: rows that are no slot's row are left
unwritten unless ``zero_fill_rows`` (automatic when N > T*k, where some row must be slot-less).

Design (memory-bound: each byte is read or written once):
  * forward: a 2-D grid (token blocks of BLOCK_T, column tiles of BLOCK_H); a program keeps a
    [BLOCK_T, BLOCK_H] fp32 accumulator and adds the k slots' rows in order j = 0..k-1 (unrolled for
    k <= 16, so the compiler issues all k row loads of a program before the first add), then stores the
    tile once in the output dtype. Reads N*H (+ the [T, k] indices and weights), writes T*H.
  * backward: a 1-D grid of token blocks; a program takes its tokens' slots as one [BLOCK_T, K_CHUNK]
    chunk (K_CHUNK = next power of 2 of k, at most 16; larger k loops over chunks and re-reads grad_out
    per chunk) and walks H in BLOCK_H tiles: per tile it loads the grad_out tile once and the chunk's
    rows as one [BLOCK_T, K_CHUNK, BLOCK_H] tile (all in flight together), adds <row, grad_out> to a
    [BLOCK_T, K_CHUNK] fp32 accumulator (the sum over H stays in the program: no partial sums, no
    atomics) and stores w * grad_out into the slots' rows. Reads T*H + N*H, writes N*H (+ [T, k]).
    Either output can be switched off (NEED_GR / NEED_GW): grad_rows alone does not read rows.
  * tiles: forward 4 KiB of a row per slot load (128 threads x two 16-byte vectors: BLOCK_H = 2048 bf16 /
    1024 fp32), backward 8 KiB per chunk tile; several tokens per program when H is smaller. The block
    sizes follow from (H, k, dtype) alone: no autotuning, hence no timing runs and no host syncs.
  * row offsets are int64 (row * stride can pass 2**31); the inner dimension is contiguous (the launchers
    copy a tensor that is not), so Triton sees unit stride and emits 16-byte vector loads and stores.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ._common import (SUPPORTED_DTYPES, Kernel, cdiv, check_triton_tensors, gather_rows_ref, interp_bf16,
                      interpret_mode, pow2, to_out, why_not_triton_tensors)

# k up to this is unrolled in the forward (all k row loads of a program issued together) and is one slot
# chunk in the backward; above it (e.g. expert choice's [T, E] slot layout) a loop keeps the kernels small.
UNROLL_MAX_K = 16
MAX_K_CHUNK = 16

# ---------------------------------------------------------------------------------------------------
# References (plain torch, any dtype; float64 in, float64 out)
# ---------------------------------------------------------------------------------------------------


def _slot_index(slot_row: torch.Tensor, num_tokens: int, top_k: int, num_rows: int):
    """([T, k] indices with every invalid one replaced by num_rows, [T, k] valid mask)."""
    idx = slot_row.view(num_tokens, top_k)
    valid = (idx >= 0) & (idx < num_rows)
    return torch.where(valid, idx, num_rows), valid


def combine_rows_ref(rows: torch.Tensor, slot_row: torch.Tensor, weights: torch.Tensor | None, num_tokens: int,
                     top_k: int) -> torch.Tensor:
    """out [T, H] = sum_j w[t, j] * rows[slot_row[t*k + j]], invalid slots skipped; fp32 (or wider)
    accumulation in slot order, result in rows.dtype."""
    acc = torch.promote_types(rows.dtype, torch.float32)
    idx, valid = _slot_index(slot_row, num_tokens, top_k, rows.shape[0])
    out = torch.zeros(num_tokens, rows.shape[1], dtype=acc, device=rows.device)
    for j in range(top_k):
        x = gather_rows_ref(rows, idx[:, j]).to(acc)  # index N reads the zero pad row
        if weights is not None:
            x = torch.where(valid[:, j:j + 1], x * weights[:, j:j + 1].to(acc), 0.0)
        out += x
    return out.to(rows.dtype)


def combine_rows_backward_ref(grad_out: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
                              slot_row: torch.Tensor, need_grad_rows: bool = True, need_grad_weights: bool = True):
    """(grad_rows [N, H] or None, grad_weights [T, k] or None); rows that are no slot's row get 0."""
    T, k = weights.shape
    N, H = rows.shape
    acc = torch.promote_types(rows.dtype, torch.float32)
    idx, valid = _slot_index(slot_row, T, k, N)
    g = grad_out.to(acc)
    grad_rows = grad_w = None
    if need_grad_rows:
        per_slot = g[:, None, :] * weights.to(acc)[:, :, None]  # [T, k, H]
        grad_rows = torch.zeros(N + 1, H, dtype=acc, device=rows.device)  # row N: sink of invalid slots
        grad_rows[idx[valid]] = per_slot[valid]
        grad_rows = grad_rows[:N].to(rows.dtype)
    if need_grad_weights:
        slots = torch.stack([gather_rows_ref(rows, idx[:, j]) for j in range(k)], 1).to(acc) if k else \
            rows.new_zeros(T, 0, H, dtype=acc)
        grad_w = torch.where(valid, (slots * g[:, None, :]).sum(-1), 0.0).to(weights.dtype)
    return grad_rows, grad_w


# ---------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _slot_rows(SLOT_ROW, slot0, j, t_mask, N):
    """(row of slot j of each token, valid): a row outside [0, N) is invalid and replaced by 0, so no
    address past the tensors is ever formed (and every load / store on it is masked off)."""
    r = tl.load(SLOT_ROW + slot0 + j, mask=t_mask, other=-1)
    valid = t_mask & (r >= 0) & (r < N)
    return tl.where(valid, r, 0), valid


@triton.jit
def _add_slot(acc, ROWS, SLOT_ROW, W, slot0, j, offs_t, t_mask, offs_h, h_mask, N, stride_rn, stride_wt,
              stride_wk, HAS_W: tl.constexpr):
    """acc + w[:, j] * rows[row of slot j] (rows alone without weights), in fp32."""
    r, valid = _slot_rows(SLOT_ROW, slot0, j, t_mask, N)
    x = tl.load(ROWS + r[:, None] * stride_rn + offs_h[None, :], mask=valid[:, None] & h_mask[None, :],
                other=0.0).to(tl.float32)
    if HAS_W:
        w = tl.load(W + offs_t * stride_wt + j * stride_wk, mask=valid, other=0.0).to(tl.float32)
        x = x * w[:, None]
    return acc + x


@triton.jit
def _combine_fwd_kernel(
    ROWS, SLOT_ROW, W, OUT,
    T, N, H, stride_rn, stride_wt, stride_wk, stride_ot,
    TOP_K: tl.constexpr, HAS_W: tl.constexpr, UNROLL: tl.constexpr, INTERP_BF16: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_mask = offs_t < T
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    slot0 = offs_t * TOP_K  # flat id of each token's first slot
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    if UNROLL:
        for j in tl.static_range(TOP_K):  # j = 0..k-1: the fixed summation order
            acc = _add_slot(acc, ROWS, SLOT_ROW, W, slot0, j, offs_t, t_mask, offs_h, h_mask, N, stride_rn,
                            stride_wt, stride_wk, HAS_W)
    else:
        for j in range(TOP_K):
            acc = _add_slot(acc, ROWS, SLOT_ROW, W, slot0, j, offs_t, t_mask, offs_h, h_mask, N, stride_rn,
                            stride_wt, stride_wk, HAS_W)
    tl.store(OUT + offs_t[:, None] * stride_ot + offs_h[None, :], to_out(acc, OUT.dtype.element_ty, INTERP_BF16),
             mask=t_mask[:, None] & h_mask[None, :])


@triton.jit
def _combine_bwd_kernel(
    GRAD_OUT, ROWS, SLOT_ROW, W, GRAD_ROWS, GRAD_W,
    T, N, H, stride_gt, stride_rn, stride_wt, stride_wk, stride_grn,
    TOP_K: tl.constexpr, K_CHUNK: tl.constexpr, NEED_GR: tl.constexpr, NEED_GW: tl.constexpr,
    INTERP_BF16: tl.constexpr, W_INTERP_BF16: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_mask = offs_t < T
    slot0 = offs_t * TOP_K
    # Slots in chunks of K_CHUNK (a single chunk when k <= 16): a chunk's k rows are one
    # [BLOCK_T, K_CHUNK, BLOCK_H] tile, so all of its row loads are in flight together.
    for c in range(0, TOP_K, K_CHUNK):
        slots = c + tl.arange(0, K_CHUNK)
        s_mask = t_mask[:, None] & (slots[None, :] < TOP_K)  # [BLOCK_T, K_CHUNK]
        r = tl.load(SLOT_ROW + slot0[:, None] + slots[None, :], mask=s_mask, other=-1)
        valid = s_mask & (r >= 0) & (r < N)  # rows outside [0, N): no address is formed from them
        r3 = tl.where(valid, r, 0)[:, :, None]  # [BLOCK_T, K_CHUNK, 1] int64 rows
        v3 = valid[:, :, None]
        if NEED_GR:
            w3 = tl.load(W + offs_t[:, None] * stride_wt + slots[None, :] * stride_wk, mask=valid,
                         other=0.0).to(tl.float32)[:, :, None]
        acc_w = tl.zeros((BLOCK_T, K_CHUNK), dtype=tl.float32)  # <row of slot, grad_out[t]> so far
        for h0 in range(0, H, BLOCK_H):  # column tiles in order: the fixed order of the grad_w sums
            offs_h = h0 + tl.arange(0, BLOCK_H)
            h_mask = offs_h < H
            g = tl.load(GRAD_OUT + offs_t[:, None] * stride_gt + offs_h[None, :],
                        mask=t_mask[:, None] & h_mask[None, :], other=0.0).to(tl.float32)[:, None, :]
            m3 = v3 & h_mask[None, None, :]
            cols3 = offs_h[None, None, :]
            if NEED_GW:  # loaded before the stores below, which the compiler cannot move loads across
                x = tl.load(ROWS + r3 * stride_rn + cols3, mask=m3, other=0.0).to(tl.float32)
                acc_w += tl.sum(x * g, axis=2)
            if NEED_GR:
                tl.store(GRAD_ROWS + r3 * stride_grn + cols3,
                         to_out(w3 * g, GRAD_ROWS.dtype.element_ty, INTERP_BF16), mask=m3)
        if NEED_GW:  # invalid slots kept 0; grad_w is a fresh contiguous [T, k]
            tl.store(GRAD_W + slot0[:, None] + slots[None, :],
                     to_out(acc_w, GRAD_W.dtype.element_ty, W_INTERP_BF16), mask=s_mask)


# One config each (the block sizes are launch arguments picked from H and the dtype, see _blocks): the
# Kernel wrapper then never times anything, and still checks the Triton mode and counts launches.
COMBINE_FWD = Kernel(_combine_fwd_kernel, configs=[triton.Config({}, num_warps=4)],
                     interpret_config=triton.Config({}, num_warps=4), key=[])
COMBINE_BWD = Kernel(_combine_bwd_kernel, configs=[triton.Config({}, num_warps=4)],
                     interpret_config=triton.Config({}, num_warps=4), key=[])

# GPU forward: 4 KiB of a row per slot load = 4 warps x 32 threads x two 16-byte vectors (k of them in
# flight per program). GPU backward: 8 KiB per tile of a slot chunk (k <= 16 rows of BLOCK_H), four
# 16-byte vectors a thread. Registers stay <= ~64 a thread (k <= 8; sm90 offline compile, no spills),
# so 8+ programs share an SM: tens of KiB in flight per SM, what HBM3e's latency-bandwidth product
# needs. Interpreter: 256 elements a tile with BLOCK_H <= 32, so tiny test shapes get partial column
# tiles, several column tiles per row and BLOCK_T > 1.
_FWD_TILE_BYTES, _BWD_TILE_BYTES = 4096, 8192
_INTERPRET_TILE, _INTERPRET_BLOCK_H = 256, 32


# Block sizes come from plain-Python helpers (_common.pow2 / cdiv): this op is short enough (tens of
# microseconds on a GPU) for host overhead to show.
_INTERPRET = interpret_mode()  # fixed once triton is imported (moe.kernels._common, Kernel._build)


def _blocks(h: int, elem_size: int, tile_bytes: int, slots: int = 1) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_H) for rows of h elements of elem_size bytes, ``slots`` rows per token in a tile."""
    tile = max(1, (_INTERPRET_TILE if _INTERPRET else tile_bytes // elem_size) // slots)
    block_h = min(pow2(h), _INTERPRET_BLOCK_H if _INTERPRET else tile)
    return max(1, tile // block_h), block_h


# ---------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------


def why_not_combine(rows: torch.Tensor, weights: torch.Tensor | None = None) -> str:
    """"" when the combine kernels can run on these tensors, else the reason (naming the fix)."""
    reason = why_not_triton_tensors(rows)
    if reason or weights is None:
        return reason
    if weights.device != rows.device:
        return f"weights are on {weights.device} but rows on {rows.device}; move them there"
    if weights.dtype not in SUPPORTED_DTYPES:
        return f"weights dtype {weights.dtype} is not supported by the Triton kernels; use float32/bfloat16/float16"
    return ""


def _check(what: str, rows: torch.Tensor, slot_row: torch.Tensor, weights: torch.Tensor | None, num_tokens: int,
           top_k: int) -> None:
    if rows.dim() != 2:
        raise ValueError(f"{what}: rows must be [N, H], got shape {tuple(rows.shape)}")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"{what}: top_k={top_k!r} must be an int >= 1 (slots per token)")
    if not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"{what}: num_tokens={num_tokens!r} must be an int >= 0")
    if slot_row.dim() != 1 or slot_row.dtype != torch.int64:
        raise ValueError(f"{what}: slot_row must be a 1-D int64 tensor [T*k], got {slot_row.dtype} of shape "
                         f"{tuple(slot_row.shape)}; use .reshape(-1).long()")
    if slot_row.numel() != num_tokens * top_k:
        raise ValueError(f"{what}: slot_row has {slot_row.numel()} entries but num_tokens * top_k = "
                         f"{num_tokens} * {top_k} = {num_tokens * top_k}; pass the meta's T and k")
    if slot_row.device != rows.device:
        raise ValueError(f"{what}: slot_row is on {slot_row.device} but rows on {rows.device}; move it there")
    if weights is not None and tuple(weights.shape) != (num_tokens, top_k):
        raise ValueError(f"{what}: weights must be [T, k] = [{num_tokens}, {top_k}], got {tuple(weights.shape)}")
    check_triton_tensors(what, rows)
    if weights is not None:
        if weights.device != rows.device:
            raise ValueError(f"{what}: weights are on {weights.device} but rows on {rows.device}; move them there")
        if weights.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{what}: weights dtype {weights.dtype} is not supported by the Triton kernels; "
                             "use float32/bfloat16/float16")


def _inner_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride along its last dimension (what the kernels index with), copying only if needed."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _on_device(t: torch.Tensor):
    """Launch on t's GPU even when another one is current (Triton launches on the current device)."""
    if t.device.type == "cuda" and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def combine_rows(rows: torch.Tensor, slot_row: torch.Tensor, weights: torch.Tensor | None, num_tokens: int,
                 top_k: int) -> torch.Tensor:
    """out [T, H] in rows.dtype: out[t] = sum_j w[t, j] * rows[slot_row[t*k + j]] (fp32 sum in slot order;
    weights None: the plain gather-sum). Indices outside [0, N) contribute zero. Not differentiable
    itself: moe.dispatch wraps it (and its backward) in autograd Functions."""
    what = "combine_rows (Triton)"
    _check(what, rows, slot_row, weights, num_tokens, top_k)
    slot_row = slot_row.contiguous()
    N, H = rows.shape
    out = torch.empty(num_tokens, H, device=rows.device, dtype=rows.dtype)
    if num_tokens == 0 or H == 0:
        return out
    if N == 0:  # no slot has a row
        return out.zero_()
    rows = _inner_contiguous(rows)
    block_t, block_h = _blocks(H, rows.element_size(), _FWD_TILE_BYTES)
    grid = (cdiv(num_tokens, block_t), cdiv(H, block_h))
    w = weights if weights is not None else slot_row  # never read without HAS_W
    with _on_device(rows):
        COMBINE_FWD[grid](
            rows, slot_row, w, out, num_tokens, N, H, rows.stride(0),
            w.stride(0) if weights is not None else 0, w.stride(1) if weights is not None else 0, out.stride(0),
            TOP_K=top_k, HAS_W=weights is not None, UNROLL=top_k <= UNROLL_MAX_K, INTERP_BF16=interp_bf16(rows.dtype),
            BLOCK_T=block_t, BLOCK_H=block_h,
        )
    return out


def combine_rows_backward(grad_out: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, slot_row: torch.Tensor,
                          *, need_grad_rows: bool = True, need_grad_weights: bool = True,
                          zero_fill_rows: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Both gradients of :func:`combine_rows` (with weights) in one pass over grad_out and rows.

    Returns (grad_rows [N, H] in rows.dtype or None, grad_weights [T, k] in weights.dtype or None):
    grad_rows[slot_row[t*k + j]] = w[t, j] * grad_out[t]; grad_w[t, j] = <rows[slot_row[t*k + j]],
    grad_out[t]> summed in fp32 (0 for an invalid slot). Each row is written by the one slot that names
    it (moe.dispatch.sort_slots gives every row of [0, N) exactly one slot); a row that no slot names
    is left as allocated, so pass ``zero_fill_rows=True`` when that can happen (done automatically
    when N > T*k). Two slots naming one row would race: the layouts of sort_slots never do.
    """
    what = "combine_rows_backward (Triton)"
    if weights.dim() != 2:
        raise ValueError(f"{what}: weights must be [T, k], got shape {tuple(weights.shape)}")
    T, k = weights.shape
    _check(what, rows, slot_row, weights, T, k)
    slot_row = slot_row.contiguous()
    N, H = rows.shape
    if tuple(grad_out.shape) != (T, H):
        raise ValueError(f"{what}: grad_out must be [T, H] = [{T}, {H}], got {tuple(grad_out.shape)}")
    if grad_out.device != rows.device or grad_out.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{what}: grad_out must be float32/bfloat16/float16 on {rows.device}, got {grad_out.dtype} "
                         f"on {grad_out.device}")
    grad_rows = grad_w = None
    if need_grad_rows:
        fill = zero_fill_rows or N > T * k  # more rows than slots: some row is no slot's
        grad_rows = (torch.zeros if fill else torch.empty)(N, H, device=rows.device, dtype=rows.dtype)
    if need_grad_weights:
        grad_w = torch.empty(T, k, device=rows.device, dtype=weights.dtype)
    if not (need_grad_rows or need_grad_weights) or T == 0:
        return grad_rows, grad_w
    if N == 0 or H == 0:  # no slot has a row, or nothing to sum: grad_w is 0, grad_rows has no elements
        return grad_rows, grad_w.zero_() if grad_w is not None else None
    rows, grad_out = _inner_contiguous(rows), _inner_contiguous(grad_out)
    k_chunk = min(pow2(k), MAX_K_CHUNK)
    block_t, block_h = _blocks(H, max(rows.element_size(), grad_out.element_size()), _BWD_TILE_BYTES, k_chunk)
    gr = grad_rows if grad_rows is not None else rows  # never written without NEED_GR
    gw = grad_w if grad_w is not None else weights  # never written without NEED_GW
    with _on_device(rows):
        COMBINE_BWD[(cdiv(T, block_t),)](
            grad_out, rows, slot_row, weights, gr, gw, T, N, H,
            grad_out.stride(0), rows.stride(0), weights.stride(0), weights.stride(1), gr.stride(0),
            TOP_K=k, K_CHUNK=k_chunk, NEED_GR=need_grad_rows,
            NEED_GW=need_grad_weights, INTERP_BF16=interp_bf16(rows.dtype), W_INTERP_BF16=interp_bf16(weights.dtype),
            BLOCK_T=block_t, BLOCK_H=block_h,
        )
    return grad_rows, grad_w
