"""The router's fp32 logits of a bf16 input from bf16 GEMMs (moe.precision._SplitLinear; SPLIT_ROUTER).

On CUDA the split form runs by default; here SPLIT_ROUTER="always" runs the same arithmetic on CPU (its bf16
products summed by an fp32 matmul), checked against float64 references computed from the original operands."""
from __future__ import annotations

import pytest
import torch

from moekit.moe import build_router
from moekit.moe import precision as P


def _operands(T, H, E, w_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    w = (torch.randn(E, H, generator=gen) * 0.02).to(w_dtype)
    g = torch.randn(T, E, generator=gen)
    return x, w, g


def _run(x, w, g, mode, monkeypatch):
    monkeypatch.setattr(P, "SPLIT_ROUTER", mode)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = P.upcast_linear(xl, wl, torch.float32)
    out.backward(g)
    return out.detach(), xl.grad, wl.grad


def _reference(x, w, g):
    xd, wd, gd = x.double(), w.double(), g.double()
    return xd @ wd.t(), gd @ wd, gd.t() @ xd


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,E", [(64, 96, 8), (37, 200, 24), (1, 64, 5)])
def test_split_matches_float64(T, H, E, w_dtype, monkeypatch):
    x, w, g = _operands(T, H, E, w_dtype, seed=T * 1000 + H + E)
    assert P.split_applies(x, w, torch.float32) is False  # CPU under "auto": the fp32 GEMM
    out, dx, dw = _run(x, w, g, "always", monkeypatch)
    assert out.dtype == torch.float32 and dx.dtype == torch.bfloat16 and dw.dtype == w_dtype
    ref_out, ref_dx, ref_dw = _reference(x, w, g)
    # logits: exact products, fp32 sums (bf16 w) or the weight to 16 bits (fp32 w): far inside bf16's 2^-9
    assert _rel(out, ref_out) < (1e-6 if w_dtype == torch.bfloat16 else 3e-5)
    # dx ends in bf16 (x's dtype): at most bf16 rounding of the float64 result
    assert _rel(dx, ref_dx) < 4e-3
    tol_dw = 4e-3 if w_dtype == torch.bfloat16 else 3e-5  # a bf16 w's gradient is rounded to bf16 itself
    assert _rel(dw, ref_dw) < tol_dw
    # the fp32 path agrees with it as closely
    out32, dx32, dw32 = _run(x, w, g, "never", monkeypatch)
    assert _rel(out, out32.double()) < 3e-5 and _rel(dw, dw32.double()) < max(tol_dw, 3e-5)


def test_a_single_bf16_gemm_would_fail_the_tolerance(monkeypatch):
    """The split's low halves matter: dropping them (one bf16 GEMM of w and g) misses the logits' and the
    weight gradient's bound above by two orders of magnitude, so that bound can catch a lost term."""
    x, w, g = _operands(64, 96, 8, torch.float32, seed=7)
    ref_out, _, ref_dw = _reference(x, w, g)
    single = x.float() @ w.to(torch.bfloat16).float().t()
    assert _rel(single, ref_out) > 3e-4
    single_dw = g.to(torch.bfloat16).float().t() @ x.float()
    assert _rel(single_dw, ref_dw) > 3e-4


def test_split_path_is_the_one_that_runs(monkeypatch):
    calls = []
    monkeypatch.setattr(P._SplitLinear, "apply", lambda *a: calls.append(a) or P._UpcastLinear.apply(*a, torch.float32))
    x, w, g = _operands(16, 32, 4, torch.float32, seed=3)
    _run(x, w, g, "always", monkeypatch)
    assert len(calls) == 1
    _run(x, w, g, "never", monkeypatch)
    _run(x.float(), w, g, "always", monkeypatch)  # an fp32 input: no split (nothing to gain from bf16 GEMMs)
    assert len(calls) == 1


def test_router_routes_as_the_fp32_gemm(monkeypatch):
    """A top-k router on a bf16 input, weights fp32: the same experts and weights either way, except where two
    logits tie to ~1e-5 (none here, checked)."""
    torch.manual_seed(0)
    router = build_router("topk", 128, 16, top_k=4)
    x = torch.randn(256, 128).to(torch.bfloat16)
    monkeypatch.setattr(P, "SPLIT_ROUTER", "never")
    a = router(x)
    logits = router.logits(x)
    monkeypatch.setattr(P, "SPLIT_ROUTER", "always")
    b = router(x)
    top = logits.topk(5, dim=-1).values
    assert (top[:, 3] - top[:, 4]).min() > 1e-5  # no near-tie at the k-th place (the split moves logits ~1e-6)
    assert torch.equal(a.indices, b.indices)
    torch.testing.assert_close(a.weights, b.weights, rtol=1e-4, atol=1e-5)


def test_bad_mode_is_named(monkeypatch):
    monkeypatch.setattr(P, "SPLIT_ROUTER", "sometimes")
    x, w, _ = _operands(4, 8, 2, torch.float32, seed=1)
    with pytest.raises(ValueError, match="SPLIT_ROUTER='sometimes'"):
        P.upcast_linear(x, w, torch.float32)


def test_split_survives_torch_compile():
    """Compiled (the router is compiled on its own in training), the split must still carry the low half: inductor
    keeps a bf16 round trip t.to(bf16).float() in fp32 unless told otherwise, so a low half computed from it is
    zero. The bit-masked split does not depend on that."""
    t = torch.randn(64, 96, generator=torch.Generator().manual_seed(2)) * 0.02
    for fn in (P._split, torch.compile(P._split)):
        hi, lo = fn(t)
        assert hi.dtype == lo.dtype == torch.bfloat16 and bool((lo != 0).any())
        assert _rel(hi.double() + lo.double(), t.double()) < 2e-5
