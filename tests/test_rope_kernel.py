"""moe.kernels.rope (one-pass Triton RoPE) against the torch rotation, in the interpreter (CPU).

Both layouts attention uses ([B, S, heads, R] with [S, 1, R/2] tables, and the transposed [B, heads, S, R]
view with [S, R/2]), a half width that is not a power of two, positions that start past 0 (a KV cache),
fp32 and bf16, the inverse rotation, adjacent pairs (2i, 2i + 1) in and out, and models.rope's _Rope and
_RopeAdjacent forced onto the kernel (forward and backward) against their torch paths. References: float64
torch (a different computation: cat of halves, strided pairs).
"""
from __future__ import annotations

import os

import pytest
import torch

from moekit.models import rope as attention_rope
from moekit.models.rope import apply_rope, rope_angles
from moekit.moe.kernels import LAUNCHES, interpret_mode
from moekit.moe.kernels.rope import rope, rope_ref, why_not_rope

pytestmark = pytest.mark.skipif(not interpret_mode() and not torch.cuda.is_available(),
                                reason="Triton interpreter (TRITON_INTERPRET=1 before import) or a GPU")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
ULP = {torch.float32: 2e-6, torch.bfloat16: 2 ** -8}  # one rounding of the output (relative), with slack


def tables(seq: int, dim: int, start: int):
    cos, sin = rope_angles(seq, dim, 10000.0, DEV, start)  # [S, R/2] float32
    return cos, sin


def kernel_matches_torch_path(monkeypatch, rotate, x0, g, dtype):
    """``rotate`` forced onto the kernel (one launch forward, one backward) against TRITON_ROPE='never': outputs and
    input gradients (cotangent ``g``) equal to the dtype's rounding. Returns the kernel's (y, dx)."""

    def run(mode):
        monkeypatch.setattr(attention_rope, "TRITON_ROPE", mode)
        x = x0.clone().requires_grad_()
        y = rotate(x)
        (dx,) = torch.autograd.grad(y, x, g)
        return y, dx

    before = LAUNCHES["_rope_kernel"]
    y_k, dx_k = run("always")
    assert LAUNCHES["_rope_kernel"] == before + 2  # forward and backward
    y_t, dx_t = run("never")
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(y_k, y_t, **tol)
    torch.testing.assert_close(dx_k, dx_t, **tol)
    return y_k, dx_k


def check_close(got, ref64, dtype):
    err = (got.double() - ref64).abs()
    bound = ULP[dtype] * ref64.abs() + 1e-6
    assert bool((err <= bound).all()), f"max err {err.max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("dim", [16, 12])  # half 8, and half 6 (not a power of two: masked columns)
@pytest.mark.parametrize("inverse", [False, True], ids=["fwd", "inverse"])
def test_rope_kernel_matches_float64(dtype, layout, dim, inverse):
    gen = torch.Generator().manual_seed(int(os.environ.get("MOEKIT_TEST_SEED", "0")))
    B, S, heads, start = 2, 7, 3, 5
    cos, sin = tables(S, dim, start)
    x = torch.randn(B, S, heads, dim, generator=gen).to(DEV, dtype)
    if layout == "bshd":
        c, s = cos[:, None], sin[:, None]
    else:  # the transposed view attention has after .transpose(1, 2): not contiguous
        x, c, s = x.transpose(1, 2), cos, sin
        assert not x.is_contiguous()
    before = LAUNCHES["_rope_kernel"]
    got = rope(x, c, s, inverse=inverse)
    assert LAUNCHES["_rope_kernel"] == before + 1
    assert got.shape == x.shape and got.dtype == dtype
    x64 = x.double()
    sign = -1.0 if inverse else 1.0
    c64, s64 = (c.double(), sign * s.double())
    half = dim // 2
    ref = torch.empty_like(x64)
    ref[..., :half] = x64[..., :half] * c64 - x64[..., half:] * s64
    ref[..., half:] = x64[..., half:] * c64 + x64[..., :half] * s64
    check_close(got, ref, dtype)
    # the inverse undoes the rotation (fp32: to rounding)
    if dtype == torch.float32:
        back = rope(got, c, s, inverse=not inverse)
        torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("dim", [16, 12])
def test_adjacent_pairs_match_float64_and_invert(dtype, layout, dim):
    """pairs="from_adjacent" rotates (2i, 2i + 1) into halves (DeepSeek's MLA rope dims, ERNIE 4.5);
    "to_adjacent" with inverse takes halves back to pairs: the forward's backward, so the two compose to x."""
    gen = torch.Generator().manual_seed(int(os.environ.get("MOEKIT_TEST_SEED", "0")) + 1)
    B, S, heads = 2, 7, 3
    cos, sin = tables(S, dim, 3)
    x = torch.randn(B, S, heads, dim, generator=gen).to(DEV, dtype)
    c, s = cos[:, None], sin[:, None]
    if layout == "bhsd":
        x, c, s = x.transpose(1, 2), cos, sin
    got = rope(x, c, s, pairs="from_adjacent")
    x64, c64, s64 = x.double(), c.double(), s.double()
    ev, od = x64[..., 0::2], x64[..., 1::2]  # written out: pair i is channels 2i, 2i + 1
    check_close(got, torch.cat((ev * c64 - od * s64, od * c64 + ev * s64), dim=-1), dtype)
    back = rope(got, c, s, inverse=True, pairs="to_adjacent")
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2 ** -6)
    torch.testing.assert_close(back, x, **tol)
    with pytest.raises(ValueError, match="pairs='diagonal'"):
        rope(x, c, s, pairs="diagonal")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interleaved_rope_forced_onto_the_kernel_matches_its_torch_path(monkeypatch, dtype):
    """models.rope.apply_rope_interleaved (_RopeAdjacent): the kernel forward and backward against the torch
    rotation, and both against autograd through the rotation written out in float64."""
    from moekit.models.rope import apply_rope_interleaved

    gen = torch.Generator().manual_seed(int(os.environ.get("MOEKIT_TEST_SEED", "0")) + 2)
    B, heads, S, dim = 2, 3, 9, 8
    cos, sin = tables(S, dim, 0)
    x0 = torch.randn(B, heads, S, dim, generator=gen).to(DEV, dtype)
    g = torch.randn(B, heads, S, dim, generator=gen).to(DEV, dtype)
    y_k, dx_k = kernel_matches_torch_path(monkeypatch, lambda x: apply_rope_interleaved(x, cos, sin), x0, g, dtype)
    x64 = x0.double().requires_grad_()
    ev, od = x64[..., 0::2], x64[..., 1::2]
    y64 = torch.cat((ev * cos.double() - od * sin.double(), od * cos.double() + ev * sin.double()), dim=-1)
    (dx64,) = torch.autograd.grad(y64, x64, g.double())
    check_close(y_k, y64.detach(), dtype)
    check_close(dx_k, dx64, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_rope_forced_onto_the_kernel_matches_its_torch_path(monkeypatch, dtype):
    gen = torch.Generator().manual_seed(int(os.environ.get("MOEKIT_TEST_SEED", "0")))
    B, S, heads, dim = 2, 9, 4, 8
    cos, sin = tables(S, dim, 0)
    x0 = torch.randn(B, S, heads, dim, generator=gen).to(DEV, dtype)
    g = torch.randn(B, S, heads, dim, generator=gen).to(DEV, dtype)
    y_k, _ = kernel_matches_torch_path(monkeypatch, lambda x: apply_rope(x, cos[:, None], sin[:, None]), x0, g, dtype)
    # the torch path's fp32 rotation against float64: the kernel's numbers are the rotation's, not a rounding
    # artefact of one path
    check_close(y_k, rope_ref(x0.double(), cos.double()[:, None], sin.double()[:, None]), dtype)


def test_double_backward_keeps_the_torch_path(monkeypatch):
    monkeypatch.setattr(attention_rope, "TRITON_ROPE", "always")
    cos, sin = tables(5, 8, 0)
    x = torch.randn(1, 5, 2, 8, device=DEV, dtype=torch.float64 if DEV == "cpu" else torch.float32)
    x = x.float().requires_grad_()
    y = apply_rope(x, cos[:, None], sin[:, None])
    (dx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    (ddx,) = torch.autograd.grad(dx.sum(), x)  # the rotation is orthogonal: d/dx sum(2 R^T R x) = 2 * 1
    torch.testing.assert_close(ddx, torch.full_like(x, 2.0), rtol=1e-5, atol=1e-5)


def test_refusals_name_the_problem(monkeypatch):
    cos, sin = tables(4, 8, 0)
    x = torch.randn(1, 4, 2, 8, device=DEV)
    assert why_not_rope(x, cos[:, None], sin[:, None]) == ""
    assert "even" in why_not_rope(torch.randn(1, 4, 2, 7, device=DEV), cos[:, None], sin[:, None])
    assert "float32" in why_not_rope(x, cos[:, None].double(), sin[:, None].double())
    assert "fit neither" in why_not_rope(x, cos[:3, None], sin[:3, None])
    with pytest.raises(ValueError, match="fit neither"):
        rope(x, cos, sin)  # [S, R/2] tables with positions along dim 1: the wrong layout
    monkeypatch.setattr(attention_rope, "TRITON_ROPE", "sometimes")
    with pytest.raises(ValueError, match="TRITON_ROPE='sometimes'"):
        apply_rope(x, cos[:, None], sin[:, None])
    monkeypatch.setattr(attention_rope, "TRITON_ROPE", "always")
    with pytest.raises(ValueError, match="TRITON_ROPE='always'.*fit neither"):
        apply_rope(x, cos[:3, None], sin[:3, None])


def test_a_rope_kernel_that_cannot_be_built_falls_back_to_torch_once_with_a_warning(monkeypatch):
    from triton.compiler.errors import CompilationError

    from moekit.moe.kernels import rope as rope_module

    def broken(*args, **kwargs):
        raise CompilationError("rope.py", None, "unsupported op in this Triton")

    cos, sin = tables(6, 8, 0)
    x = torch.randn(2, 6, 3, 8, device=DEV, requires_grad=True)
    monkeypatch.setattr(attention_rope, "TRITON_ROPE", "never")
    ref = apply_rope(x, cos[:, None], sin[:, None])
    monkeypatch.setattr(rope_module, "rope", broken)
    monkeypatch.setattr(attention_rope, "_ROPE_BUILD_FAILURE", [])
    monkeypatch.setattr(attention_rope, "TRITON_ROPE", "auto")
    # on CPU "auto" never picks the kernel: pick it as a GPU would
    monkeypatch.setattr(attention_rope, "_rope_kernel_or_none", lambda *a: attention_rope._rope_or_fallback)
    with pytest.warns(UserWarning, match="RoPE kernel failed to build here.*CompilationError.*torch rotation"):
        got = apply_rope(x, cos[:, None], sin[:, None])
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert attention_rope._ROPE_BUILD_FAILURE  # and "auto" skips the kernel from now on
    monkeypatch.undo()
    monkeypatch.setattr(attention_rope, "_ROPE_BUILD_FAILURE", ["CompilationError: earlier"])
    assert attention_rope._rope_kernel_or_none(x.cuda() if DEV == "cuda" else x, cos[:, None], sin[:, None]) is None
    monkeypatch.setattr(attention_rope, "TRITON_ROPE", "always")
    monkeypatch.setattr(rope_module, "rope", broken)
    with pytest.raises(CompilationError):
        attention_rope._rope_or_fallback(x, cos[:, None], sin[:, None])


def test_partial_rotary_attention_on_the_kernel_matches_its_torch_path(monkeypatch):
    """partial_rotary_factor < 1 (GLM-4.5) hands the kernel a slice of each head: rows D wide, R = D / 2 rotated.
    The kernel (forward on the q / k slices, backward on the gradient's slices) must equal the torch rotation."""
    from moekit.models.attention import Attention
    from moekit.models.config import ModelConfig
    from moekit.models.rope import rope_tables

    cfg = ModelConfig(name="t", vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                      max_seq_len=16, num_experts=0, head_dim=12, partial_rotary_factor=0.5,
                      attention_bias=True).validate()
    torch.manual_seed(0)
    attn = Attention(cfg).to(DEV)
    x0 = torch.randn(2, 9, 32, device=DEV)
    cos, sin = rope_tables(cfg, 9, DEV)
    assert cos.shape == (9, 3)  # R / 2 = 12 * 0.5 / 2: half 3, not a power of two

    def run(mode):
        monkeypatch.setattr(attention_rope, "TRITON_ROPE", mode)
        x = x0.clone().requires_grad_()
        y = attn(x, cos, sin)
        grads = torch.autograd.grad(y.square().sum(), [x, attn.wq.weight, attn.wk.weight])
        return y, grads

    before = LAUNCHES["_rope_kernel"]
    y_k, g_k = run("always")
    assert LAUNCHES["_rope_kernel"] == before + 4  # q and k, forward and backward
    y_t, g_t = run("never")
    torch.testing.assert_close(y_k, y_t, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_k, g_t):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
