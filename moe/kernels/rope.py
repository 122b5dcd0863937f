"""Rotary position embedding (GPT-NeoX / HF half layout) in one pass: read x once, write the rotation once.

    out[..., :R/2] = x1 * cos - x2 * sin        x1 = x[..., :R/2], x2 = x[..., R/2:R]
    out[..., R/2:] = x2 * cos + x1 * sin        (``inverse``: sin negated, the backward of the rotation)

``pairs`` says which channels form the rotated pairs on the way in and out: "half" (both halves, above);
"from_adjacent" reads pairs (2i, 2i + 1) and writes the half layout (DeepSeek's MLA rope dims, ERNIE 4.5:
models.rope.apply_rope_interleaved, whose q and k get the same permutation); "to_adjacent" reads the half layout
and writes pairs (2i, 2i + 1): with ``inverse``, the backward of "from_adjacent".

x is 4-D with a unit-stride last dimension of R channels, in one of the two layouts attention uses:
[B, S, heads, R] with cos / sin [S, 1, R/2] (positions along dim 1, how moekit's attention calls it), or
[B, heads, S, R] with cos / sin [S, R/2] (positions along dim 2). cos / sin are float32; the products
and sums are float32 and the result is rounded once to x's dtype.

Why a kernel: the torch version (models.rope._rotate) is an upcast, two multiplies, a cat, an add
and a downcast, each a pass over [B, S, heads, R] in fp32. On an H200 that was 3.7 ms
of a 128 ms mixtral-1b training step, plus 1.8 ms of cat (docs/benchmarks.md, first GPU round), for
what moves 2 x 2 bytes per element in bf16. The torch version stays the reference and the CPU path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import Kernel, cdiv, check_triton_tensors, interp_bf16, interpret_mode, pow2, to_out


PAIRS = ("half", "from_adjacent", "to_adjacent")


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
             pairs: str = "half") -> torch.Tensor:
    """The rotation in plain torch, float32 (float64 for float64 x) math, x's dtype out."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xa = x.to(acc)
    x1, x2 = (xa[..., 0::2], xa[..., 1::2]) if pairs == "from_adjacent" else xa.chunk(2, dim=-1)
    c, s = cos.to(acc), sin.to(acc)
    if inverse:
        s = -s
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    out = torch.stack((o1, o2), dim=-1).flatten(-2) if pairs == "to_adjacent" else torch.cat((o1, o2), dim=-1)
    return out.to(x.dtype)


@triton.jit
def _rope_kernel(
    X, COS, SIN, OUT,
    ROWS, A1, A2, sx0, sx1, sx2, so0, so1, so2,
    HALF: tl.constexpr, HALF_P2: tl.constexpr, POS_AXIS: tl.constexpr, INVERSE: tl.constexpr,
    IN_ADJACENT: tl.constexpr, OUT_ADJACENT: tl.constexpr, INTERP_BF16: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # one program: BLOCK_R rows (a row = one (i0, i1, i2) index of x's first three dims) x all R channels
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    r_mask = rows < ROWS
    i2 = rows % A2
    i1 = (rows // A2) % A1
    i0 = rows // (A2 * A1)
    if POS_AXIS == 1:
        pos = i1
    else:
        pos = i2
    cols = tl.arange(0, HALF_P2)
    m = r_mask[:, None] & (cols < HALF)[None, :]
    if IN_ADJACENT:  # pair i is channels (2i, 2i + 1)
        xp = X + (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None] + 2 * cols[None, :]
        x1 = tl.load(xp, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(xp + 1, mask=m, other=0.0).to(tl.float32)
    else:  # pair i is channels (i, i + R/2)
        xp = X + (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None] + cols[None, :]
        x1 = tl.load(xp, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(xp + HALF, mask=m, other=0.0).to(tl.float32)
    tp = pos[:, None] * HALF + cols[None, :]  # cos / sin rows: [S, R/2] contiguous
    c = tl.load(COS + tp, mask=m, other=0.0)
    s = tl.load(SIN + tp, mask=m, other=0.0)
    if INVERSE:
        s = -s
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    if OUT_ADJACENT:
        op = OUT + (i0 * so0 + i1 * so1 + i2 * so2)[:, None] + 2 * cols[None, :]
        tl.store(op, to_out(o1, OUT.dtype.element_ty, INTERP_BF16), mask=m)
        tl.store(op + 1, to_out(o2, OUT.dtype.element_ty, INTERP_BF16), mask=m)
    else:
        op = OUT + (i0 * so0 + i1 * so1 + i2 * so2)[:, None] + cols[None, :]
        tl.store(op, to_out(o1, OUT.dtype.element_ty, INTERP_BF16), mask=m)
        tl.store(op + HALF, to_out(o2, OUT.dtype.element_ty, INTERP_BF16), mask=m)


# One config; the row block is a launch argument sized so a program moves ~8 KiB of x (see _block_rows).
ROPE = Kernel(_rope_kernel, configs=[triton.Config({}, num_warps=4)], interpret_config=triton.Config({}, num_warps=4),
              key=[])
_TILE_BYTES = 8192
_INTERPRET_ROWS = 4
_INTERPRET = interpret_mode()


def why_not_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str:
    """"" when :func:`rope` can run on these tensors, else the reason (naming the fix)."""
    if x.dim() != 4 or x.shape[-1] % 2 or (x.shape[-1] > 1 and x.stride(-1) != 1):
        return f"x must be 4-D with an even, unit-stride last dimension, got shape {tuple(x.shape)}, " \
               f"strides {x.stride()}"
    half = x.shape[-1] // 2
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or t.device != x.device:
            return f"{name} must be float32 on {x.device}, got {t.dtype} on {t.device}"
        if not t.is_contiguous():
            return f"{name} must be contiguous"
    if cos.shape != sin.shape:
        return f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ"
    if cos.dim() == 3 and cos.shape[1:] == (1, half) and cos.shape[0] == x.shape[1]:
        pass  # x [B, S, heads, R], positions along dim 1
    elif cos.dim() == 2 and cos.shape == (x.shape[2], half):
        pass  # x [B, heads, S, R], positions along dim 2
    else:
        return (f"cos / sin {tuple(cos.shape)} fit neither x [B, S, heads, R] with [S, 1, R/2] nor x [B, heads, S, R] "
                f"with [S, R/2] for x {tuple(x.shape)}")
    return ""


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
         pairs: str = "half") -> torch.Tensor:
    """The rotation (module docstring) as one Triton launch; not differentiable itself (models.rope's
    _Rope wraps it: its backward is this with ``inverse``; _RopeAdjacent's: "to_adjacent" with ``inverse``)."""
    what = "rope (Triton)"
    if pairs not in PAIRS:
        raise ValueError(f"{what}: pairs={pairs!r} is not one of {PAIRS}")
    reason = why_not_rope(x, cos, sin)
    if reason:
        raise ValueError(f"{what}: {reason}")
    check_triton_tensors(what, x)
    out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    a0, a1, a2, r = x.shape
    half = r // 2
    rows = a0 * a1 * a2
    block_r = _INTERPRET_ROWS if _INTERPRET else max(1, _TILE_BYTES // (r * x.element_size()))
    block_r = min(pow2(block_r), 1024)
    so = out.stride()
    ROPE[(cdiv(rows, block_r),)](
        x, cos, sin, out, rows, a1, a2, x.stride(0), x.stride(1), x.stride(2), so[0], so[1], so[2],
        HALF=half, HALF_P2=pow2(half), POS_AXIS=1 if cos.dim() == 3 else 2, INVERSE=inverse,
        IN_ADJACENT=pairs == "from_adjacent", OUT_ADJACENT=pairs == "to_adjacent", INTERP_BF16=interp_bf16(x.dtype),
        BLOCK_R=block_r,
    )
    return out
