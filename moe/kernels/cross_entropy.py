"""Cross-entropy rows of a logits chunk, and their gradient written over the logits, in one kernel.

    loss[r] = logsumexp(x[r, :]) - x[r, y[r]]                               x [C, V] logits, y [C] targets
    x[r, :] <- (softmax(x[r, :]) - onehot(y[r])) * scale[r]                 (need_grad: in place, x's dtype)

This is the elementwise half of models.loss.chunked_lm_loss: it takes the chunk's logits straight from the
``h @ W^T`` GEMM, in the compute dtype (bf16 / fp16 / fp32, no fp32 copy), and leaves in that same buffer the
gradient the two following GEMMs (``g @ W`` and ``g^T @ h``) read. ``scale`` is the gradient of the mean loss
with respect to the row's loss (keep / count: 1 / number of counted tokens, 0 for an ignored one), a device
tensor, so nothing here syncs with the host.

Targets: ``ignore_index`` (-100, F.cross_entropy's) marks a row that does not count: loss 0 and, whatever its
scale, a zero gradient row. Any other target outside [0, V) is an error the kernel cannot raise without a sync
(torch's gather raises on CPU, and on CUDA stops the process with a device-side assert): its row's loss is NaN
(so the mean loss is NaN, which a trainer's non-finite check catches) and its gradient row lacks the one-hot.
The index is compared with the column ids, never turned into an address.

Design (memory-bound; per row it reads the logits twice and writes them once, against ~7 fp32 passes of the
torch path: the upcast, logsumexp's max / sub / exp / sum, the gather, the in-place sub, exp, one-hot -1, the
scale and the downcast):
  * one program owns BLOCK_R rows (1 for a real vocabulary) and walks the columns in BLOCK_V tiles.
  * pass 1: an online max and sum of exponentials per row in fp32 (each tile: m' = max(m, max(tile)),
    s = s * exp(m - m') + sum(exp(tile - m'))), so logits of any size (1e4, -1e4) stay finite; lse = m + log(s).
    The target's logit is one masked load per row (no address from a target outside [0, V)).
  * pass 2 (need_grad): re-reads each tile (mostly from L2: a row of a 32k vocabulary is 64 KB in bf16) and
    writes ((exp(x - lse) - [col == y]) * scale) rounded once to the logits' dtype, the torch path's
    arithmetic in its order (only lse's summation order differs).
  * row offsets are int64 (C * V passes 2**31 at 8192 x 262144); the columns must have unit stride.
  * block sizes come from (V, dtype) in Python, no autotuning: an autotuner would time the kernel by
    launching it repeatedly, and each launch overwrites its own input.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ._common import Kernel, cdiv, check_triton_tensors, interp_bf16, interpret_mode, pow2, to_out

IGNORE_INDEX = -100


def cross_entropy_rows_ref(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor | None = None,
                           need_grad: bool = False, ignore_index: int = IGNORE_INDEX):
    """(loss [C] float32, grad [C, V] in logits' dtype or None): :func:`cross_entropy_rows` in plain torch
    (float32 math, float64 for float64 logits), without writing into ``logits``."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    x = logits.to(acc)
    C, V = x.shape
    ignored = targets == ignore_index
    hit = (targets >= 0) & (targets < V)
    y = torch.where(hit, targets, 0)[:, None]
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, y).squeeze(1)
    nan = torch.full_like(lse, float("nan"))
    loss = torch.where(ignored, torch.zeros_like(lse), torch.where(hit, lse - picked, nan))
    if not need_grad:
        return loss, None
    s = torch.ones(C, dtype=acc, device=x.device) if scale is None else scale.to(acc)
    s = torch.where(ignored, 0.0, s)
    g = torch.exp(x - lse[:, None])
    g = g - (torch.arange(V, device=x.device)[None, :] == torch.where(hit, targets, -1)[:, None]).to(acc)
    return loss, (g * s[:, None]).to(logits.dtype)


@triton.jit
def _cross_entropy_kernel(
    X, Y, SCALE, LOSS,
    C, V, stride_xr,
    IGNORE: tl.constexpr, HAS_SCALE: tl.constexpr, NEED_GRAD: tl.constexpr, INTERP_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = rows < C
    # rows past C re-read row C - 1 (finite values, no masked -inf rows to make NaNs of); nothing is stored
    base = X + tl.minimum(rows, C - 1).to(tl.int64)[:, None] * stride_xr  # [BLOCK_R, 1]
    y = tl.load(Y + rows, mask=r_mask, other=IGNORE).to(tl.int64)
    ignored = y == IGNORE
    hit = (y >= 0) & (y < V)
    y_col = tl.where(hit, y, -1)[:, None]  # never equal to a column id unless in range
    # x[r, y[r]]: an address only from a target inside [0, V) (the load is masked off otherwise)
    picked = tl.load(base + tl.where(hit, y, 0)[:, None], mask=(r_mask & hit)[:, None], other=0.0).to(tl.float32)
    cols = tl.arange(0, BLOCK_V)

    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)  # running max
    s = tl.zeros((BLOCK_R,), dtype=tl.float32)  # running sum of exp(x - m)
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        c_mask = (c < V)[None, :]
        x = tl.load(base + c[None, :], mask=c_mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))  # finite: every tile has a column < V
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
        m = m_new
    lse = m + tl.log(s)
    loss = tl.where(hit, lse - tl.sum(picked, axis=1), float("nan"))
    tl.store(LOSS + rows, tl.where(ignored, 0.0, loss), mask=r_mask)

    if NEED_GRAD:
        if HAS_SCALE:
            sc = tl.load(SCALE + rows, mask=r_mask, other=0.0).to(tl.float32)
        else:
            sc = tl.full((BLOCK_R,), 1.0, tl.float32)
        sc = tl.where(ignored, 0.0, sc)[:, None]
        lse2 = lse[:, None]
        for v0 in range(0, V, BLOCK_V):
            c = v0 + cols
            mask = r_mask[:, None] & (c < V)[None, :]
            x = tl.load(base + c[None, :], mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse2)
            g = tl.where(c[None, :] == y_col, g - 1.0, g) * sc
            tl.store(base + c[None, :], to_out(g, X.dtype.element_ty, INTERP_BF16), mask=mask)


# One config (block sizes are launch arguments picked by _blocks): the Kernel wrapper then never times
# anything (which would overwrite the logits), and still checks the Triton mode and counts launches.
CROSS_ENTROPY = Kernel(_cross_entropy_kernel, configs=[triton.Config({}, num_warps=8)],
                       interpret_config=triton.Config({}, num_warps=1), key=[])

# GPU: 8 KiB column tiles (8 warps x 32 threads x two 16-byte vectors a thread; bf16: 4096 columns), one row a
# program for a real vocabulary; a vocabulary of 1024 columns or fewer puts several rows in a program, 2048 elements
# a tile (wider multi-row tiles took 120-250 registers a thread, spilling at 64 x 128). sm90 offline compile:
# 26-48 registers a thread for one-row tiles, 100 for 16 x 128, no spills. Not yet tuned on a GPU.
# Interpreter: 64-element tiles with BLOCK_V <= 32, so tiny test vocabularies get several column tiles, a
# ragged last one and BLOCK_R > 1.
_TILE_BYTES, _MULTI_ROW_TILE = 8192, 2048
_INTERPRET_TILE, _INTERPRET_BLOCK_V = 64, 32
_INTERPRET = interpret_mode()  # fixed once triton is imported


def _blocks(c: int, v: int, elem_size: int, block_v: int | None = None) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_V) for c rows of v columns; ``block_v`` (a power of two) overrides the column tile."""
    if block_v is None:
        block_v = min(pow2(v), _INTERPRET_BLOCK_V if _INTERPRET else _TILE_BYTES // elem_size)
    rows_tile = _INTERPRET_TILE if _INTERPRET else _MULTI_ROW_TILE
    return min(max(1, rows_tile // block_v), pow2(c)), block_v


def _on_device(t: torch.Tensor):
    """Launch on t's GPU even when another one is current (Triton launches on the current device)."""
    if t.device.type == "cuda" and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def why_not_cross_entropy(device: torch.device, dtype: torch.dtype) -> str:
    """"" when :func:`cross_entropy_rows` can run on logits of this device and dtype, else the reason."""
    from ._common import why_not_triton_tensors

    return why_not_triton_tensors(torch.empty(0, device=device, dtype=dtype))


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor | None = None, *,
                       need_grad: bool = False, out: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX,
                       block_v: int | None = None) -> torch.Tensor:
    """Per-row cross-entropy of ``logits`` [C, V] (float32/bfloat16/float16, unit column stride) against
    ``targets`` [C] (integer ids; ``ignore_index``: loss 0, zero gradient), returned as float32 [C] (into
    ``out`` when given). With ``need_grad``, overwrites ``logits`` with ``(softmax - onehot) * scale[r]``
    (``scale`` [C] float32, None: 1) in its own dtype. A target outside [0, V) other than ``ignore_index``
    gives its row a NaN loss (module docstring). ``block_v`` (a power of two) overrides the column tile,
    for tests. Triton only: CUDA, or CPU under TRITON_INTERPRET=1."""
    what = "cross_entropy_rows (Triton)"
    if logits.dim() != 2:
        raise ValueError(f"{what}: logits must be [C, V], got shape {tuple(logits.shape)}")
    C, V = logits.shape
    if targets.dim() != 1 or targets.shape[0] != C or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"{what}: targets must be [C={C}] integer ids, got {targets.dtype} of shape "
                         f"{tuple(targets.shape)}")
    if targets.device != logits.device:
        raise ValueError(f"{what}: targets are on {targets.device} but logits on {logits.device}; move them there")
    if scale is not None and (scale.shape != (C,) or scale.device != logits.device
                              or not scale.dtype.is_floating_point):
        raise ValueError(f"{what}: scale must be a float tensor [C={C}] on {logits.device}, got {scale.dtype} of "
                         f"shape {tuple(scale.shape)} on {scale.device}")
    if V > 1 and logits.stride(1) != 1:
        raise ValueError(f"{what}: logits must have unit stride along V (the gradient is written in place), got "
                         f"strides {tuple(logits.stride())}; pass a contiguous tensor")
    if block_v is not None and (block_v < 1 or block_v & (block_v - 1)):
        raise ValueError(f"{what}: block_v={block_v} must be a power of two")
    check_triton_tensors(what, logits)
    if out is None:
        out = torch.empty(C, device=logits.device, dtype=torch.float32)
    elif out.shape != (C,) or out.dtype != torch.float32 or out.device != logits.device or out.stride(0) != 1:
        raise ValueError(f"{what}: out must be a contiguous float32 [C={C}] on {logits.device}")
    if C == 0:
        return out
    if V == 0:  # logsumexp of nothing is -inf: F.cross_entropy cannot take it either
        raise ValueError(f"{what}: logits have no columns (V = 0)")
    targets = targets.contiguous()
    if scale is not None:
        scale = scale.contiguous()
    block_r, block_v = _blocks(C, V, logits.element_size(), block_v)
    with _on_device(logits):
        CROSS_ENTROPY[(cdiv(C, block_r),)](
            logits, targets, scale if scale is not None else out, out, C, V, logits.stride(0),
            IGNORE=ignore_index, HAS_SCALE=scale is not None, NEED_GRAD=bool(need_grad),
            INTERP_BF16=interp_bf16(logits.dtype), BLOCK_R=block_r, BLOCK_V=block_v,
        )
    return out
