"""The "float8" expert backend (moe/float8.py): e4m3 quantization with rowwise scales, the grouped fp8 GEMM
against references written another way, the whole expert MLP against float64, and the CUDA path's
arguments checked against torch's own rules (its meta kernel) on CPU.

Error bounds come from e4m3's 3 mantissa bits: rounding to nearest moves a value in the normal range by at
most U = 2^-4 of itself, and a subnormal (below 2^-6 in scaled units) by at most 2^-10 scaled units.
Inputs are fresh each run (MOEKIT_TEST_SEED, printed in pytest's header, replays them).
"""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from moekit.moe import MoELayer, build_router
from moekit.moe import float8 as f8
from moekit.moe.experts import GroupedExperts, auto_order, loop_mlp, resolve_backend
from tests.helpers import gen as _gen

U = 2.0**-4  # e4m3: half an ulp relative to the value, normal range
SUB = 2.0**-10  # e4m3: half the subnormal spacing 2^-9, in scaled units
U_BF16 = 2.0**-8
TINY = torch.finfo(torch.float32).tiny


def _wide(shape, g, dtype=torch.float32) -> torch.Tensor:
    """Normal values times 10^U(-2, 2) per element: many binades, so rounding is tested across exponents."""
    return (torch.randn(shape, generator=g) * 10 ** (4 * torch.rand(shape, generator=g) - 2)).to(dtype)


def _ragged_sizes(E: int, owned: int, g) -> list[int]:
    """``owned`` rows over E experts, at least one expert empty."""
    cuts = sorted(torch.randint(0, owned + 1, (E - 2,), generator=g).tolist())
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [owned])] + [0]
    perm = torch.randperm(E, generator=g).tolist()
    return [sizes[i] for i in perm]


def _plan(sizes: list[int]) -> f8.Plan:
    return f8.Plan(torch.tensor(sizes).cumsum(0).to(torch.int32), sizes)


# ---------------------------------------------------------------------------------------------------
# An e4m3 rounding written another way: from the exponent and the 3-bit mantissa grid, in float64
# ---------------------------------------------------------------------------------------------------


def ref_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round float64 ``v`` to the nearest e4m3fn value (ties to even), saturating at +-448."""
    mag = v.abs()
    _, ex = torch.frexp(mag)  # mag = m * 2^ex, m in [0.5, 1): the binade is [2^(ex-1), 2^ex)
    e = (ex - 1).clamp(min=-6).to(torch.float64)  # below 2^-6: the subnormal grid, spacing 2^-9
    ulp = torch.exp2(e - 3)  # 3 mantissa bits
    return torch.sign(v) * (torch.round(mag / ulp) * ulp).clamp(max=448.0)  # torch.round: half to even


def ref_quantize(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 e4m3 values, float32 scales): the documented recipe, scale = amax / 448 and t / scale in
    float32, then ref_e4m3."""
    t32 = t.to(torch.float32)
    scale = (t32.abs().amax(dim) / 448.0).clamp_min(TINY)
    return ref_e4m3((t32 / scale.unsqueeze(dim)).double()), scale


def ref_fp8_mm(a, b, sizes):
    """(out, tol) float64: out[rows of e] = (Qa @ Qb[e]) * sa * sb[e] from ref_quantize, and an elementwise
    bound on what float32 accumulation (any order), the two scale multiplies and the output dtype's
    rounding may add."""
    owned, K, M = sum(sizes), a.shape[-1], b.shape[-1]
    qa, sa = ref_quantize(a[:owned], -1)
    qb, sb = ref_quantize(b, -2)
    out = torch.zeros(a.shape[0], M, dtype=torch.float64)
    tol = torch.zeros_like(out)
    start = 0
    for e, n in enumerate(sizes):
        s = sa[start:start + n, None].double() * sb[e][None, :].double()
        out[start:start + n] = (qa[start:start + n] @ qb[e]) * s
        tol[start:start + n] = (qa[start:start + n].abs() @ qb[e].abs()) * s * (K + 2) * 2.0**-23
        start += n
    out_u = U_BF16 if a.dtype == torch.bfloat16 else 2.0**-23
    return out, tol + out_u * (out.abs() + tol)


def _assert_within(got, want, tol, what):
    err = (got.double() - want).abs()
    bad = err > tol
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements off, worst error {float(err.max()):.3g} "
                           f"where the bound is {float(tol[bad].min()):.3g}")


# ---------------------------------------------------------------------------------------------------
# Quantization
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,dim", [((37, 80), -1), ((37, 80), 0), ((3, 48, 20), -2)])
def test_quantize_rowwise_is_e4m3_rounding_of_the_scaled_values(shape, dim, dtype):
    g = _gen("quant", shape, dim, dtype)
    t = _wide(shape, g, dtype)
    zero_slice = {-1: (5, slice(None)), 0: (slice(None), 5), -2: (1, slice(None), 5)}[dim]
    t[zero_slice] = 0  # one slice all zero: amax 0
    q, scale = f8.quantize_rowwise(t, dim)
    want_q, want_scale = ref_quantize(t, dim)
    assert q.dtype == torch.float8_e4m3fn and q.shape == t.shape
    assert scale.dtype == torch.float32 and scale.shape == want_scale.shape
    assert torch.equal(scale, want_scale) and bool((scale > 0).all())
    assert torch.equal(q.double(), want_q), "e4m3 values differ from the nearest-even rounding"
    # the largest magnitude of every slice maps to 448 exactly (the scale uses e4m3's whole range); the
    # all-zero slice to zeros
    want_amax = (t.double().abs().amax(dim) > 0).double() * 448.0
    assert int((want_amax == 0).sum()) == 1
    assert torch.equal(q.double().abs().amax(dim), want_amax)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_e4m3s_and_not_bf16s(dtype):
    g = _gen("roundtrip", dtype)
    t = _wide((64, 96), g, dtype)
    q, scale = f8.quantize_rowwise(t, -1)
    back = f8.dequantize(q, scale, -1)
    t64, s = t.double(), scale.double()[:, None]
    err = (back.double() - t64).abs()
    bound = (U + 2.0**-21) * t64.abs() + SUB * s  # + the float32 divide and multiply
    _assert_within(back, t64, bound, "round trip")
    normal = t64.abs() >= 2.0**-6 * s
    rel = err[normal] / t64.abs()[normal]
    # the bound is nearly reached (a 3-bit mantissa), far above what bf16's 8 bits would give
    assert rel.max() > 0.8 * U and rel.max() > 8 * U_BF16


def test_all_zero_rows_and_saturation_give_no_nan():
    t = torch.zeros(3, 32)
    t[1, 5] = 2.0
    q, scale = f8.quantize_rowwise(t, -1)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert torch.equal(f8.dequantize(q, scale, -1), t)
    # values past 448 * scale saturate at +-448 instead of becoming NaN (e4m3fn has no inf)
    big = torch.tensor([[1.0, -3.0, 1e6, -1e30, 448.0, 500.0]])
    sat = f8.quantize_with_scale(big, torch.tensor([1.0]), -1).float()
    assert torch.equal(sat, torch.tensor([[1.0, -3.0, 448.0, -448.0, 448.0, 448.0]]))
    # float32's extremes and bf16's largest value quantize to finite values
    for x in (torch.tensor([[3e38, -1e-38, 1e-45, 0.0]]), torch.tensor([[3.3e38, 1.0]], dtype=torch.bfloat16)):
        q, scale = f8.quantize_rowwise(x, -1)
        back = f8.dequantize(q, scale, -1)
        assert torch.isfinite(back).all() and torch.isfinite(scale).all()
        assert back[0, 0] == pytest.approx(float(x[0, 0]), rel=U)


# ---------------------------------------------------------------------------------------------------
# One grouped GEMM (emulation), forward and backward
# ---------------------------------------------------------------------------------------------------


def _gemm_case(dtype, key):
    g = _gen("gemm", dtype, key)
    E, K, M = 5, 48, 40
    sizes = _ragged_sizes(E, 60, g)
    N = 60 + 7  # 7 rows nobody owns
    a = (torch.randn(N, K, generator=g) * 10 ** (2 * torch.rand(N, 1, generator=g) - 1)).to(dtype)
    a[3].zero_()  # an all-zero owned row: amax 0
    a[60:] = float("nan")  # rows past the blocks must not reach anything
    w = (torch.randn(E, K, M, generator=g) * 10 ** (2 * torch.rand(E, 1, M, generator=g) - 1)).to(dtype)
    return a, w, sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_forward_matches_the_reference_quantization(dtype):
    a, w, sizes = _gemm_case(dtype, "fwd")
    y = f8.fp8_grouped_mm(a, w, _plan(sizes))
    assert y.dtype == dtype and y.shape == (a.shape[0], w.shape[-1])
    want, tol = ref_fp8_mm(a, w, sizes)
    _assert_within(y[:60], want[:60], tol[:60], "fp8 forward")
    assert torch.equal(y[60:], torch.zeros_like(y[60:]))
    assert torch.equal(y[3], torch.zeros_like(y[3]))  # amax 0: zeros, not NaN

    # against the exact float64 product: within what e4m3 rounding of both operands allows, elementwise ...
    owned = a[:60].double()
    qa, sa = ref_quantize(a[:60], -1)
    qb, sb = ref_quantize(w, -2)
    exact, bound, start = torch.zeros_like(want[:60]), torch.zeros_like(want[:60]), 0
    for e, n in enumerate(sizes):
        x, wd = owned[start:start + n], w[e].double()
        ea = U * x.abs() + SUB * sa[start:start + n, None].double()  # |dequant(a) - a|
        ew = U * wd.abs() + SUB * sb[e][None, :].double()
        exact[start:start + n] = x @ wd
        bound[start:start + n] = ea @ (wd.abs() + ew) + x.abs() @ ew
        start += n
    _assert_within(y[:60], exact, bound * (1 + 2.0**-10) + tol[:60], "fp8 forward vs exact")
    # ... and normwise: e4m3's error, well above what bf16 operands would give (the quantization is real)
    rel = float((y[:60].double() - exact).norm() / exact.norm())
    assert U / 4 < rel < 2 * U, rel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_backward_dgrad_fp8_wgrad_high_precision(dtype):
    a, w, sizes = _gemm_case(dtype, "bwd")
    g = _gen("gemm-grad", dtype)
    dy = (torch.randn(a.shape[0], w.shape[-1], generator=g) * 3).to(dtype)
    dy[60:] = float("nan")  # the gradient of rows nobody owns takes no part either
    x = a.clone().requires_grad_()
    wt = w.clone().requires_grad_()
    y = f8.Float8GroupedMM.apply(x, wt, _plan(sizes))
    y.backward(dy)
    # dgrad: dy per row (amax over M), w[e]^T per column (amax over M as well)
    want, tol = ref_fp8_mm(dy, w.transpose(1, 2), sizes)
    _assert_within(x.grad[:60], want[:60], tol[:60], "dgrad")
    assert torch.equal(x.grad[60:], torch.zeros_like(x.grad[60:]))
    # wgrad: x_e^T dy_e in the inputs' dtype, no quantization (a quantized one is ~4% off, far outside)
    start = 0
    for e, n in enumerate(sizes):
        xe, ge = a[start:start + n].double(), dy[start:start + n].double()
        want_w = xe.t() @ ge
        tol_w = (xe.abs().t() @ ge.abs()) * (n + 1) * 2.0**-23
        tol_w = tol_w + (U_BF16 if dtype == torch.bfloat16 else 2.0**-23) * (want_w.abs() + tol_w)
        _assert_within(wt.grad[e], want_w, tol_w, f"wgrad expert {e} ({n} rows)")
        if n == 0:
            assert torch.equal(wt.grad[e], torch.zeros_like(wt.grad[e]))
        start += n


# ---------------------------------------------------------------------------------------------------
# The whole expert MLP against float64
# ---------------------------------------------------------------------------------------------------


def _mlp_case(activation, dtype):
    g = _gen("mlp", activation, dtype)
    E, H, Fh, N = 4, 64, 96, 300
    f_in = 2 * Fh if activation == "swiglu" else Fh
    counts = torch.tensor(_ragged_sizes(E, 280, g))
    counts[counts == 0] = -3  # a negative count reads as 0, as in every backend; 20 rows nobody owns
    x = torch.randn(N, H, generator=g).to(dtype)
    w_in = (torch.randn(E, H, f_in, generator=g) / H**0.5).to(dtype)
    w_out = (torch.randn(E, Fh, H, generator=g) / Fh**0.5).to(dtype)
    dy = torch.randn(N, H, generator=g).to(dtype)
    return x, counts, w_in, w_out, dy


def _fwd_bwd(fn, leaves, dy):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    y = fn(*leaves)
    y.backward(dy.to(y.dtype))
    return [y.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["swiglu", "gelu", "relu"])
def test_mlp_forward_backward_against_float64(activation, dtype):
    x, counts, w_in, w_out, dy = _mlp_case(activation, dtype)
    got = _fwd_bwd(lambda *t: f8.float8_mlp(t[0], counts, t[1], t[2], activation), (x, w_in, w_out), dy)
    want = _fwd_bwd(lambda *t: loop_mlp(t[0], counts, t[1], t[2], activation),
                    (x.double(), w_in.double(), w_out.double()), dy.double())
    owned = int(f8.counts_to_offs(counts, x.shape[0])[-1])
    for name, a, b in zip(("y", "d rows", "d w_in", "d w_out"), got, want):
        assert a.dtype == dtype and torch.isfinite(a).all(), name
        if name in ("y", "d rows"):
            assert torch.equal(a[owned:], torch.zeros_like(a[owned:])), f"{name}: rows nobody owns"
            a, b = a[:owned], b[:owned]
        rel = float((a.double() - b).norm() / b.norm())
        # measured ~U (0.04-0.065): four roundings to e4m3 in a chain. A relu gradient also flips where
        # the quantized h changes sign (0.13-0.19 measured over 40 seeds; fp32 -> bf16 rounding alone gives ~0.04)
        upper = 5 * U if activation == "relu" and name in ("d rows", "d w_in") else 1.6 * U
        assert U / 4 < rel < upper, f"{name}: relative error {rel:.4f} outside ({U / 4:.4f}, {upper:.4f})"
    empty = (counts <= 0).nonzero().flatten()
    assert len(empty) and all(torch.equal(g[empty], torch.zeros_like(g[empty])) for g in got[2:])


def test_bf16_rounding_is_far_inside_the_fp8_band():
    """The lower bound U/4 above is what separates fp8 from bf16: the same check on bf16 GEMMs fails it."""
    x, counts, w_in, w_out, dy = _mlp_case("swiglu", torch.float32)
    bf = [t.to(torch.bfloat16) for t in (x, w_in, w_out)]
    got = loop_mlp(bf[0], counts, bf[1], bf[2], "swiglu").double()
    want = loop_mlp(x.double(), counts, w_in.double(), w_out.double(), "swiglu")
    assert float((got - want).norm() / want.norm()) < U / 8


# ---------------------------------------------------------------------------------------------------
# The backend in the library: selection, errors, training
# ---------------------------------------------------------------------------------------------------


def test_float8_is_selectable_but_never_auto():
    x = torch.randn(4, 16)
    ge = GroupedExperts(2, 16, 16, backend="float8")
    assert resolve_backend("float8", x, ge.w_in, ge.w_out).name == "float8"
    assert resolve_backend("auto", x, ge.w_in, ge.w_out).name == "loop"
    assert all("float8" not in auto_order(torch.device(d), ge.w_out) for d in ("cpu", "cuda"))


def test_bad_inputs_name_the_value_and_the_fix(monkeypatch):
    ge = GroupedExperts(2, 16, 16, backend="float8").double()
    with pytest.raises(ValueError, match=r"float8.*dtype float64.*backend='loop'"):
        ge(torch.randn(4, 16, dtype=torch.float64), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="share one dtype"):
        f8.float8_mlp(torch.randn(4, 16), torch.tensor([2, 2]), torch.randn(2, 16, 32, dtype=torch.bfloat16),
                      torch.randn(2, 16, 16), "swiglu")
    with pytest.raises(ValueError, match="activation='tanh'"):
        f8.float8_mlp(torch.randn(4, 16), torch.tensor([2, 2]), torch.randn(2, 16, 32), torch.randn(2, 16, 16), "tanh")
    # where the CUDA fp8 path would run, H and F must be multiples of 16
    monkeypatch.setattr(f8, "fast_path_why_not", lambda *a: "")
    rows, w_in, w_out = torch.randn(4, 24), torch.randn(2, 24, 64), torch.randn(2, 32, 24)
    with pytest.raises(ValueError, match=r"multiples of 16.*H=24, F=32.*backend='torch'"):
        resolve_backend("float8", rows, w_in, w_out)


def test_fast_path_reasons_on_this_machine():
    x, w_in, w_out = torch.randn(4, 16), torch.randn(2, 16, 32), torch.randn(2, 16, 16)
    assert "not CUDA" in f8.fast_path_why_not(x, w_in, w_out)
    assert f8.why_not_float8(x, w_in, w_out) == ""  # the emulation runs here


def test_moe_layer_trains_a_few_steps_in_bf16():
    g = _gen("train")
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
    H, E = 32, 4
    layer = MoELayer(H, 16, E, build_router("topk", H, E, top_k=2), backend="float8").to(torch.bfloat16)
    opt = torch.optim.AdamW(layer.parameters(), lr=3e-3)
    x = torch.randn(64, H, generator=g).to(torch.bfloat16)
    target = torch.randn(64, H, generator=g).to(torch.bfloat16)
    losses = []
    for _ in range(4):
        loss = F.mse_loss(layer(x).float(), target.float())
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


def test_double_backward_is_refused_clearly():
    x = torch.randn(6, 16, requires_grad=True)
    w_in, w_out = torch.randn(2, 16, 32, requires_grad=True), torch.randn(2, 16, 16, requires_grad=True)
    y = f8.float8_mlp(x, torch.tensor([3, 3]), w_in, w_out, "swiglu")
    (dx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|differentiate"):
        dx.sum().backward()


# ---------------------------------------------------------------------------------------------------
# The CUDA path, as far as a CPU can check it
# ---------------------------------------------------------------------------------------------------


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def check_scaled_grouped_mm_rules(mat_a, mat_b, scale_a, scale_b, offs) -> torch.Tensor:
    """torch's own checks: its meta kernel for _scaled_grouped_mm (layouts, 16-byte strides, scale shapes,
    offs dtype, bf16 out), plus the ones only the CUDA code makes (GroupedBlas.cpp: K and N multiples
    of 16; ScaledGroupMM.cu: fewer than 1024 groups). Returns the meta output."""
    out = torch._scaled_grouped_mm(_meta(mat_a), _meta(mat_b), _meta(scale_a), _meta(scale_b), offs=_meta(offs),
                                   out_dtype=torch.bfloat16)
    assert mat_a.size(-1) % 16 == 0 and mat_b.size(-2) % 16 == 0 and mat_b.size(-1) % 16 == 0
    assert mat_b.shape[0] < 1024
    assert out.shape == (mat_a.shape[0], mat_b.shape[-1]) and out.dtype == torch.bfloat16
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_arguments_follow_torchs_layout_rules(dtype):
    g = _gen("args", dtype)
    E, H, Fh, N = 3, 32, 48, 20
    x = torch.randn(N, H, generator=g).to(dtype)
    w_in = torch.randn(E, H, 2 * Fh, generator=g).to(dtype)
    dy = torch.randn(N, 2 * Fh, generator=g).to(dtype).expand(N, 2 * Fh)  # any layout in
    offs = torch.tensor([5, 5, 17], dtype=torch.int32)
    for a, b in ((x, w_in), (dy, w_in.transpose(-2, -1))):  # forward, and dgrad's w^T view
        args = f8.scaled_grouped_mm_args(a, b, offs)
        qa, qb, sa, sb = args["mat_a"], args["mat_b"], args["scale_a"], args["scale_b"]
        assert qa.dtype == qb.dtype == torch.float8_e4m3fn and sa.dtype == sb.dtype == torch.float32
        assert qa.stride() == (a.shape[1], 1), "mat_a row-major"
        assert qb.shape == b.shape and qb.stride(-2) == 1 and qb.stride(-1) == b.shape[-2], "mat_b column-major"
        assert sa.shape == (N,) and sb.shape == (E, b.shape[-1]) and sb.stride(-1) == 1
        assert args["offs"].dtype == torch.int32 and torch.equal(args["offs"], offs)
        check_scaled_grouped_mm_rules(**args)
        # the scales are the documented ones: amax over K per row of a and per column of b[e]
        assert torch.equal(sa, ref_quantize(a, -1)[1]) and torch.equal(sb, ref_quantize(b, -2)[1])


def test_the_torch_call_matches_the_running_torchs_signatures(monkeypatch):
    """_call_scaled_grouped_mm's arguments bind to torch's functions (both spellings) and pass the meta checks."""
    args = {k: _meta(v) for k, v in f8.scaled_grouped_mm_args(
        torch.randn(8, 32), torch.randn(2, 32, 16), torch.tensor([3, 8], dtype=torch.int32)).items()}
    seen = []
    has_v2 = hasattr(F, "scaled_grouped_mm")
    if has_v2:
        real = F.scaled_grouped_mm

        def v2(*a, **kw):
            bound = inspect.signature(real).bind(*a, **kw)
            seen.append("v2")
            assert bound.arguments["scale_recipe_a"] == bound.arguments["scale_recipe_b"] == F.ScalingType.RowWise
            assert bound.arguments["output_dtype"] == torch.bfloat16 and bound.arguments["offs"] is args["offs"]
            return torch._scaled_grouped_mm(a[0], a[1], a[2], a[4], offs=kw["offs"], out_dtype=torch.bfloat16)

        monkeypatch.setattr(F, "scaled_grouped_mm", v2)
        assert f8._call_scaled_grouped_mm(**args).shape == (8, 16)
        monkeypatch.delattr(F, "scaled_grouped_mm")
    out = f8._call_scaled_grouped_mm(**args)  # torch._scaled_grouped_mm itself, on meta tensors
    assert out.shape == (8, 16) and out.dtype == torch.bfloat16
    assert seen == (["v2"] if has_v2 else [])


def test_cuda_path_logic_on_cpu_with_a_stand_in_kernel(monkeypatch):
    """Runs the CUDA path's code (no host sync, masking, bf16 out, grouped_mm weight gradients) on CPU: the
    kernel is replaced by one that first checks torch's rules on its arguments, then computes the documented
    product and leaves NaN in the rows past offs[-1], as the real kernel leaves them undefined."""
    calls = []

    def kernel(mat_a, mat_b, scale_a, scale_b, offs):
        check_scaled_grouped_mm_rules(mat_a, mat_b, scale_a, scale_b, offs)
        calls.append((tuple(mat_a.shape), tuple(mat_b.shape)))
        out = torch.full((mat_a.shape[0], mat_b.shape[-1]), float("nan"), dtype=torch.bfloat16)
        start = 0
        for e, end in enumerate(offs.tolist()):
            acc = mat_a[start:end].float() @ mat_b[e].float()
            out[start:end] = (acc * scale_a[start:end, None] * scale_b[e][None, :]).to(torch.bfloat16)
            start = end
        return out

    x, counts, w_in, w_out, dy = _mlp_case("swiglu", torch.bfloat16)
    x, w_in, w_out = x[:, :48], w_in[:, :48, :64], w_out[:, :32, :48]  # H 48, F 32: multiples of 16
    dy = dy[:, :48]
    emulated = _fwd_bwd(lambda *t: f8.float8_mlp(t[0], counts, t[1], t[2], "swiglu"), (x, w_in, w_out), dy)
    monkeypatch.setattr(f8, "fast_path_why_not", lambda *a: "")
    monkeypatch.setattr(f8, "_call_scaled_grouped_mm", kernel)
    monkeypatch.setattr(torch.Tensor, "tolist", _no_host_sync(torch.Tensor.tolist, kernel))
    fast = _fwd_bwd(lambda *t: f8.float8_mlp(t[0], counts, t[1], t[2], "swiglu"), (x, w_in, w_out), dy)
    N, H, Fh = x.shape[0], 48, 32
    assert calls == [((N, H), (4, H, 2 * Fh)), ((N, Fh), (4, Fh, H)),  # forward
                     ((N, H), (4, H, Fh)), ((N, 2 * Fh), (4, 2 * Fh, H))]  # dgrads, last GEMM first
    owned = int(f8.counts_to_offs(counts, N)[-1])
    for name, a, b in zip(("y", "d rows", "d w_in", "d w_out"), fast, emulated):
        assert a.dtype == b.dtype and torch.isfinite(a).all(), name
        if name in ("y", "d rows"):
            assert torch.equal(a[owned:], torch.zeros_like(a[owned:])), name
        # the same quantization and GEMMs; only float32 summation order differs (weight gradients:
        # grouped_mm against per-expert mm), which can move an intermediate across an e4m3 rounding boundary
        assert float((a.double() - b.double()).norm() / b.double().norm()) < 2e-3, name


def _no_host_sync(tolist, kernel_fn):
    """Tensor.tolist that fails outside the stand-in kernel: the CUDA path must not sync on the counts."""
    def guarded(self):
        frame = inspect.currentframe().f_back
        if frame is not None and frame.f_code is kernel_fn.__code__:
            return tolist(self)
        raise AssertionError("the CUDA path called .tolist() (a host sync)")
    return guarded


def test_grouped_gemm_bench_times_float8_as_an_mlp_peer():
    """tools/bench/grouped_gemm.py --float8 adds the backend to the mlp workload (on CPU: the emulation)."""
    from moekit.bench import grouped_gemm as bench

    g = _gen("bench")
    E, H, Fh = 4, 32, 16
    x = torch.randn(40, H, generator=g).requires_grad_()
    w_in = (torch.randn(E, H, 2 * Fh, generator=g) / H**0.5).requires_grad_()
    w_out = (torch.randn(E, Fh, H, generator=g) / Fh**0.5).requires_grad_()
    counts = torch.tensor([10, 0, 25, 5])
    impls = bench.build_impls("mlp", x, w_in, w_out, counts, has_torch_gmm=True, float8=True)
    want = loop_mlp(x.double(), counts, w_in.double(), w_out.double(), "swiglu")
    rel = float((impls["float8"]().detach().double() - want.detach()).norm() / want.detach().norm())
    assert U / 4 < rel < 1.6 * U
    assert "float8" not in bench.build_impls("mlp", x, w_in, w_out, counts, True)
    assert "float8" not in bench.build_impls("gemm1", x, w_in, w_out, counts, True, float8=True)
