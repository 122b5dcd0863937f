"""Rotary position embeddings (RoPE) of the decoder's attention (models.attention applies them).

    cos, sin [S, R/2] of position * inv_freq (R = rope_dim: the head dim, or MLA's rope dims), with
    transformers' scalings (linear, yarn, llama3) and their attention factor folded into cos / sin, as
    transformers does (``rope_frequencies``, ``rope_tables``). ``apply_rope`` rotates channel pairs
    (i, i + D/2) (GPT-NeoX / HF layout) through an autograd Function whose backward is the inverse rotation,
    on CUDA one Triton pass (``TRITON_ROPE``, moe.kernels.rope); ``apply_rope_interleaved`` rotates pairs
    (2i, 2i + 1) (DeepSeek's layout).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from moekit.models.config import ModelConfig


def rope_angles(seq_len: int, head_dim: int, theta: float, device, start: int = 0) -> tuple[Tensor, Tensor]:
    """cos, sin [S, D/2] of position * theta^(-2i/D) (Su et al. 2021) for positions start .. start+S-1, in
    float32 (plain RoPE; ``rope_tables`` covers the scalings)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)  # [D/2]
    return _angles(inv_freq, seq_len, start, 1.0)


def _angles(inv_freq: Tensor, seq_len: int, start: int, factor: float) -> tuple[Tensor, Tensor]:
    positions = torch.arange(start, start + seq_len, device=inv_freq.device, dtype=torch.float32)  # [S]
    angles = torch.outer(positions, inv_freq)  # [S, R/2]
    if factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * factor, angles.sin() * factor


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(config: ModelConfig, device=None) -> tuple[Tensor, float]:
    """(inv_freq [R/2] float32, attention_factor) for ``config.rope_scaling``: the numbers transformers'
    ROPE_INIT_FUNCTIONS give for the same rope_parameters (R = config.rope_dim). The attention factor
    multiplies cos and sin (YaRN; 1 otherwise)."""
    dim, base, rs = config.rope_dim, float(config.rope_theta), config.rope_scaling
    exponents = torch.arange(0, dim, 2, device=device, dtype=torch.int64).float() / dim  # [R/2]
    inv_freq = 1.0 / base**exponents
    kind = rs.get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    factor = float(rs["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        old = rs["original_max_position_embeddings"]
        low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)  # long wavelengths: / factor
        if high == low:  # no band between them to blend over (Llama 4 Scout: both 1)
            return scaled, 1.0
        smooth = (old / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        return torch.where(medium, blended, scaled), 1.0
    # yarn: interpolate the low frequencies (/ factor), keep the high ones, ramp linearly in between
    attention = rs.get("attention_factor")
    mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
    if attention is None:
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else yarn_mscale(factor))
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1
    old = rs["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength fits ``rotations`` times in ``old``
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate (/ factor)
    return (inv_freq / factor) * (1 - keep) + inv_freq * keep, float(attention)


def rope_tables(config: ModelConfig, seq_len: int, device, start: int = 0) -> tuple[Tensor, Tensor]:
    """cos, sin [S, R/2] float32 for positions start .. start+S-1 of ``config``'s RoPE (its scaling and
    attention factor included); what every attention layer of the model gets."""
    if not config.rope_scaling or config.rope_scaling.get("rope_type") == "default":
        return rope_angles(seq_len, config.rope_dim, config.rope_theta, device, start)
    inv_freq, factor = rope_frequencies(config, device)
    return _angles(inv_freq, seq_len, start, factor)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (i, i + D/2) of x [B, heads, S, D] by the position angle (GPT-NeoX/HF layout).

    cos, sin [S, D/2] broadcast against each half of x; [S, 1, D/2] serves x [B, S, heads, D]. Computed in
    float32, returned in x's dtype, rounded exactly as [x1 cos - x2 sin, x2 cos + x1 sin]."""
    return _Rope.apply(x, cos, sin)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """x * [cos, cos] + [x2, x1] * [-sin, sin] (``inverse``: the sines negated), in float32."""
    c = torch.cat((cos, cos), dim=-1)  # [..., D]
    s = torch.cat((sin, -sin) if inverse else (-sin, sin), dim=-1)
    # one contiguous table row per trailing index of x: the products then broadcast over the leading dims
    # only (on CPU a table broadcast inside the rows runs several times slower)
    rows = x.shape[x.dim() - c.dim():]
    c, s = c.expand(rows).contiguous(), s.expand(rows).contiguous()
    xf = x.float()  # one upcast (a no-op for fp32 x), read twice
    x1, x2 = xf.chunk(2, dim=-1)  # [..., D/2] each
    out = xf * c
    rotated = torch.cat((x2, x1), dim=-1) * s
    # a + b * (-sin) == a - b * sin, bitwise. Traced by torch.compile: out of place, and no `.to` that would
    # be a no-op. Torch 2.11 (fixed in 2.12) drops the gradient of an autograd.Function whose forward returns
    # an in-place result or a no-op `.to` of one of its intermediates: wq and wk got zero gradients in a
    # compiled model (tests/test_compile.py shows it on such versions). Inductor fuses the add either way.
    if torch.compiler.is_compiling():
        out = out + rotated
    else:
        out.add_(rotated)
    return out if out.dtype == x.dtype else out.to(x.dtype)


# Where the one-pass Triton RoPE (moe.kernels.rope) replaces _rotate: "auto" on CUDA tensors it takes
# (not while torch.compile traces: inductor fuses _rotate itself); "always" on CPU tensors too, in the
# Triton interpreter (tests), raising instead of falling back; "never": _rotate everywhere.
TRITON_ROPE = "auto"
_TRITON_ROPE_MODES = ("auto", "always", "never")
_ROPE_BUILD_FAILURE: list[str] = []  # why the kernel could not be built here, once it failed (then: torch)


def _rope_kernel_or_none(x: Tensor, cos: Tensor, sin: Tensor):
    """moe.kernels.rope.rope when TRITON_ROPE says it runs on these tensors, else None."""
    mode = TRITON_ROPE
    if mode not in _TRITON_ROPE_MODES:
        raise ValueError(f"models.rope.TRITON_ROPE={mode!r}; use one of {', '.join(_TRITON_ROPE_MODES)}")
    if mode == "never" or (mode == "auto" and (x.device.type != "cuda" or torch.compiler.is_compiling()
                                               or _ROPE_BUILD_FAILURE)):
        return None
    try:
        from moekit.moe.kernels._common import why_not_triton_tensors
        from moekit.moe.kernels.rope import why_not_rope
    except ImportError as exc:  # no triton on this platform
        reason = f"the Triton kernels cannot be imported ({exc})"
    else:
        reason = why_not_triton_tensors(x) or why_not_rope(x, cos, sin)
    if reason:
        if mode == "always":
            raise ValueError(f"models.rope.TRITON_ROPE='always': {reason} (or set it to 'auto')")
        return None
    return _rope_or_fallback


def _rope_or_fallback(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False, pairs: str = "half") -> Tensor:
    """The Triton RoPE; if this machine's Triton cannot build it (a compile error, a GPU that cannot hold
    it), one warning and the torch rotation from then on (TRITON_ROPE='always' raises instead)."""
    from moekit.moe.kernels._common import BUILD_ERRORS, record_build_failure
    from moekit.moe.kernels.rope import rope

    try:
        return rope(x, cos, sin, inverse=inverse, pairs=pairs)
    except BUILD_ERRORS as exc:
        if TRITON_ROPE == "always":
            raise
        record_build_failure(exc, _ROPE_BUILD_FAILURE, "models.rope", "Triton RoPE kernel", "the torch rotation runs",
                             "models.rope.TRITON_ROPE", stacklevel=2)
        if pairs != "half":
            return _rotate_adjacent(x, cos, sin, inverse, pairs)
        return _rotate(x, cos, sin, inverse=inverse)


class _Rope(torch.autograd.Function):
    """y = R(angle) x is linear in x, so dL/dx = R(-angle) dL/dy: the backward is the same rotation with the
    sines negated. Autograd keeps only the [S, D/2] tables (shared by every layer), not x's halves and the
    expression's products; the per-head tables are rebuilt in backward rather than kept. On CUDA both run
    as one Triton pass (TRITON_ROPE), the same float32 arithmetic up to fused multiply-adds."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        kernel = _rope_kernel_or_none(x, cos, sin)
        return kernel(x, cos, sin) if kernel is not None else _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        kernel = None if torch.is_grad_enabled() else _rope_kernel_or_none(grad, cos, sin)  # create_graph: torch
        if kernel is not None:
            return kernel(grad, cos, sin, inverse=True), None, None
        return _rotate(grad, cos, sin, inverse=True), None, None


def apply_rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (2i, 2i + 1) of x [B, heads, S, D] (DeepSeek's layout; ERNIE 4.5's); the result is
    in the half layout (rotated evens, then rotated odds), as transformers returns it: q and k get the same
    permutation, so q . k is unchanged. Like ``apply_rope``, an autograd Function keeping only the tables, one
    Triton pass on CUDA (TRITON_ROPE) each way."""
    return _RopeAdjacent.apply(x, cos, sin)


def _rotate_adjacent(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool, pairs: str) -> Tensor:
    """The torch rotation for adjacent pairs: "from_adjacent" reads (2i, 2i + 1) and writes halves (the forward),
    "to_adjacent" reads halves and writes (2i, 2i + 1) (with ``inverse``: the forward's backward). float32 math."""
    xf = x.float()
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if pairs == "from_adjacent" else xf.chunk(2, dim=-1)
    s = -sin if inverse else sin
    o1, o2 = x1 * cos - x2 * s, x2 * cos + x1 * s
    out = torch.stack((o1, o2), dim=-1).flatten(-2) if pairs == "to_adjacent" else torch.cat((o1, o2), dim=-1)
    return out.type_as(x)


class _RopeAdjacent(torch.autograd.Function):
    """apply_rope_interleaved: y = R(angle) P x, P the permutation of the pairs (2i, 2i + 1) into halves, so
    dL/dx = P^T R(-angle) dL/dy: the inverse rotation read from halves and written back as pairs."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        kernel = _rope_kernel_or_none(x, cos, sin)
        return kernel(x, cos, sin, pairs="from_adjacent") if kernel is not None else \
            _rotate_adjacent(x, cos, sin, False, "from_adjacent")

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        kernel = None if torch.is_grad_enabled() else _rope_kernel_or_none(grad, cos, sin)  # create_graph: torch
        if kernel is not None:
            return kernel(grad, cos, sin, inverse=True, pairs="to_adjacent"), None, None
        return _rotate_adjacent(grad, cos, sin, True, "to_adjacent"), None, None
