"""GPU tier (``pytest -m gpu``): the kernels, the MoE layer and training on CUDA.

Every test here is marked ``gpu`` and skipped where CUDA is absent (CI). The references are computed
another way: the kernels against float64 torch on the same (rounded) inputs, the layer against its own
float64 copy, bf16 / FSDP / compiled runs against the fp32 eager run. Tolerances are calibrated
against torch itself: a low-precision kernel may be at most a small factor worse than torch's own
matmul in the same dtype, measured on the same inputs in the same test.

``MOEKIT_GPU_TESTS_ON=cpu`` runs the tier on the CPU (Triton in the interpreter, tiny sizes) to check
the tests themselves without a GPU; it is how they were written.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ON = os.environ.get("MOEKIT_GPU_TESTS_ON", "cuda")
# The TMA variants against the pointer kernels: in the interpreter, tests/test_gemm_tma.py and test_wgrad_tma.py
# cover them at interpreter sizes (bit for bit), so the tier's CPU run leaves these out (13 s of CI)
ON_DEVICE_ONLY = pytest.mark.skipif(ON != "cuda", reason="the interpreter runs of the TMA variants are "
                                    "tests/test_gemm_tma.py and test_wgrad_tma.py")
DEVICE = torch.device(ON)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(ON == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu)"),
]
SMALL = ON != "cuda"  # interpreter: shrink every size


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64 (0 when both are empty); NaN anywhere fails every bound."""
    got, ref = got.double().cpu(), ref.double().cpu()
    if not torch.isfinite(got).all():
        return float("inf")
    den = ref.norm().item()
    return (got - ref).norm().item() / den if den else (got - ref).norm().item()


def fwd_bwd(fn, inputs, seed=11):
    """[y, grads...] of fn(*inputs) against one random cotangent (drawn in float64, cast)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    if not y.requires_grad:  # the float64 reference loop builds no graph when no expert owns a row
        return [y.detach()] + [torch.zeros_like(t) for t in leaves]
    g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    y.backward(g.to(y.device, y.dtype))
    return [y.detach()] + [t.grad for t in leaves]


def offs_of(counts) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)


TMA_TWINS = "tests/test_gemm_tma.py and test_wgrad_tma.py run every case in the interpreter"


def first_on_cpu(values, why=TMA_TWINS):
    """Parametrize values for a tier test whose interpreter twin lives in the CPU suite (``why`` names it): all
    of them on a GPU, only the first where the tier runs on CPU (its logic still runs once there; CI's time
    stays for the rest)."""
    return [pytest.param(v, id=str(v).split(".")[-1], marks=pytest.mark.skipif(SMALL and n > 0, reason=why))
            for n, v in enumerate(values)]


# Ragged routings (counts per expert, unowned tail rows): empty experts at both ends, one hot expert,
# a block that is not a multiple of any tile, and no rows at all.
def layouts():
    if SMALL:
        return {"ragged": ([5, 0, 33, 17, 0, 40], 6), "one_hot": ([0, 0, 77, 0], 3), "empty": ([0, 0, 0], 0)}
    return {"ragged": ([517, 0, 3300, 1, 0, 2049, 128, 0], 37), "one_hot": ([0, 0, 4099, 0], 5),
            "fine_grained": ([0, 13, 260, 64, 0, 1, 7, 300] * 8, 0), "empty": ([0, 0, 0], 0)}


# Bounds: fp32 (IEEE dot, not TF32) sits near float rounding; bf16 / fp16 may be at most 2x torch's own
# error on the same rounded inputs, plus a floor of a few ulps of the dtype for near-exact cases.
FLOOR = {torch.float32: 1e-5, torch.bfloat16: 4e-3, torch.float16: 5e-4}


def assert_calibrated(name, got, ref, torch_same_dtype, dtype):
    err, err_torch = rel_err(got, ref), rel_err(torch_same_dtype, ref)
    bound = 2 * err_torch + FLOOR[dtype]
    assert err <= bound, f"{name}: rel err {err:.3g} > {bound:.3g} (torch in {dtype}: {err_torch:.3g})"


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("layout", list(layouts()))
@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gather"])
def test_grouped_mm_matches_float64(layout, dtype, gather):
    from moekit.moe.kernels import grouped_mm, grouped_mm_ref

    counts, extra = layouts()[layout]
    gen = torch.Generator().manual_seed(hash((layout, str(dtype), gather)) % 2**31)
    k, n = (40, 36) if SMALL else (1024, 768)
    m = sum(counts) + extra
    m_x = max(m // 2, 1) if gather else m
    x = torch.randn(m_x, k, generator=gen, dtype=torch.float64).to(dtype).double()
    w = (torch.randn(len(counts), k, n, generator=gen, dtype=torch.float64) / k**0.5).to(dtype).double()
    idx = torch.randint(0, m_x, (m,), generator=gen) if gather else None
    offs = offs_of(counts)
    ref = fwd_bwd(lambda a, b: grouped_mm_ref(a, b, offs, idx), (x, w))
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    got = fwd_bwd(lambda a, b: grouped_mm(a, b, dev(offs), dev(idx), backend="triton"),
                  (x.to(DEVICE, dtype), w.to(DEVICE, dtype)))
    same = fwd_bwd(lambda a, b: grouped_mm_ref(a, b, dev(offs), dev(idx)), (x.to(DEVICE, dtype), w.to(DEVICE, dtype)))
    for name, g, r, t in zip(("y", "dx", "dw"), got, ref, same):
        assert g.dtype == dtype and g.shape == r.shape and g.device.type == DEVICE.type, name
        assert_calibrated(f"{layout} {name}", g, r, t, dtype)
    if extra:  # rows nobody owns: exactly zero out
        assert got[0][-extra:].abs().max().item() == 0
    for e, c in enumerate(counts):  # an empty expert's weight gradient is exactly zero
        if c == 0:
            assert got[2][e].abs().max().item() == 0, f"expert {e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("variant", ["fused", "plain"])
def test_expert_mlp_matches_float64(activation, variant, dtype):
    from moekit.moe.activations import ffn_in_features
    from moekit.moe.kernels import expert_mlp, expert_mlp_ref

    counts, extra = layouts()["ragged"]
    gen = torch.Generator().manual_seed(hash((activation, variant, str(dtype))) % 2**31)
    h, f = (32, 24) if SMALL else (1024, 512)
    e = len(counts)
    rows = torch.randn(sum(counts) + extra, h, generator=gen, dtype=torch.float64).to(dtype).double()
    w_in = (torch.randn(e, h, ffn_in_features(activation, f), generator=gen, dtype=torch.float64) / h**0.5)
    w_out = torch.randn(e, f, h, generator=gen, dtype=torch.float64) / f**0.5
    w_in, w_out = w_in.to(dtype).double(), w_out.to(dtype).double()
    c = torch.tensor(counts)
    ref = fwd_bwd(lambda a, b, d: expert_mlp_ref(a, c, b, d, activation), (rows, w_in, w_out))
    lo = [t.to(DEVICE, dtype) for t in (rows, w_in, w_out)]
    got = fwd_bwd(lambda a, b, d: expert_mlp(a, c.to(DEVICE), b, d, activation, variant=variant), lo)
    same = fwd_bwd(lambda a, b, d: expert_mlp_ref(a, c.to(DEVICE), b, d, activation), lo)
    for name, g, r, t in zip(("y", "d_rows", "d_w_in", "d_w_out"), got, ref, same):
        assert g.dtype == dtype, name
        assert_calibrated(name, g, r, t, dtype)
    assert got[0][-extra:].abs().max().item() == 0 and got[1][-extra:].abs().max().item() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_scatter_add_rows_is_deterministic_and_exact_in_fp32(dtype):
    from moekit.moe.kernels import scatter_add_rows, scatter_add_rows_ref

    gen = torch.Generator().manual_seed(5)
    m, k, rows = (90, 36, 40) if SMALL else (65536, 1024, 16384)
    src = torch.randn(m, k, generator=gen).to(dtype)
    index = torch.randint(-2, rows + 2, (m,), generator=gen)  # a few out of range: dropped, never written
    ref = scatter_add_rows_ref(src.double(), index, rows)
    a = scatter_add_rows(src.to(DEVICE), index.to(DEVICE), rows)
    b = scatter_add_rows(src.to(DEVICE), index.to(DEVICE), rows)
    assert torch.equal(a, b), "two runs differ: the kernel is not deterministic"
    bound = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]  # one rounding of the sum
    assert rel_err(a, ref) <= bound


def combine_layout(gen, T, k, E):
    """(row_slot, slot_row, weights) of a top-k routing with 1 slot in 8 dropped (-1) and a capacity of 90%
    of the kept slots, so the layout has dropped slots (the pad index N) and kept slots past the capacity."""
    from moekit.moe.dispatch import sort_slots

    idx = torch.rand(T, E, generator=gen).topk(k, dim=-1).indices
    idx = torch.where(torch.rand(T, k, generator=gen) < 0.125, -1, idx)
    row_slot, slot_row = sort_slots(idx, int((idx >= 0).sum()) * 9 // 10)
    return row_slot, slot_row, torch.where(idx >= 0, torch.rand(T, k, generator=gen), 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
def test_combine_kernels_match_float64(dtype):
    """moe.kernels.combine at a realistic size (T 4096, H 2048, k 8): the forward (weighted and plain, the
    permute's backward) and both gradients against float64 on the same rounded inputs, bitwise repeatable."""
    from moekit.moe.kernels import combine_rows, combine_rows_backward, combine_rows_backward_ref, combine_rows_ref

    gen = torch.Generator().manual_seed(17)
    T, H, k, E = (40, 48, 3, 6) if SMALL else (4096, 2048, 8, 64)
    row_slot, slot_row, w = combine_layout(gen, T, k, E)
    N = row_slot.shape[0]
    assert N < T * k and bool((slot_row == N).any())
    rows = torch.randn(N, H, generator=gen).to(dtype)
    g = torch.randn(T, H, generator=gen).to(dtype)
    rows_d, g_d, w_d, slots_d = rows.to(DEVICE), g.to(DEVICE), w.to(DEVICE), slot_row.to(DEVICE)

    def run():
        out = combine_rows(rows_d, slots_d, w_d, T, k)
        plain = combine_rows(rows_d, slots_d, None, T, k)
        return (out, plain, *combine_rows_backward(g_d, rows_d, w_d, slots_d))

    got = run()
    for name, a, b in zip(("out", "plain", "grad_rows", "grad_w"), got, run()):
        assert torch.equal(a, b), f"{name}: two runs differ, the kernel is not deterministic"
    r64, g64, w64 = rows_d.double(), g_d.double(), w_d.double()
    ref = (combine_rows_ref(r64, slots_d, w64, T, k), combine_rows_ref(r64, slots_d, None, T, k),
           *combine_rows_backward_ref(g64, r64, w64, slots_d))
    # one rounding of an fp32 sum to the output dtype; grad_w is fp32 (the router's weights) in both cases
    bounds = {"out": FLOOR[dtype], "plain": FLOOR[dtype], "grad_rows": FLOOR[dtype], "grad_w": 1e-5}
    for name, a, r in zip(bounds, got, ref):
        assert a.device.type == DEVICE.type and a.shape == r.shape, name
        assert rel_err(a, r) <= bounds[name], f"{name}: rel err {rel_err(a, r):.3g} > {bounds[name]:.3g}"


def test_dispatch_runs_the_combine_kernels_on_the_device(monkeypatch):
    """moe.dispatch takes the kernels by itself on CUDA (on the CPU stand-in: forced), fp32 and bf16, and
    agrees with its torch path (TRITON_COMBINE="never") through permute, combine and both backwards."""
    from moekit.moe import build_router, dispatch
    from moekit.moe.kernels import LAUNCHES
    from moekit.moe.router import Routing

    gen = torch.Generator().manual_seed(23)
    T, H, k, E = (40, 48, 3, 6) if SMALL else (4096, 1024, 8, 64)
    routing = build_router("topk", H, E, top_k=k, capacity_factor=0.9).route(torch.randn(T, E, generator=gen))
    assert bool((routing.indices < 0).any())  # the capacity dropped slots: a padded meta
    x0, cot = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)

    def run(dtype, mode):
        monkeypatch.setattr(dispatch, "TRITON_COMBINE", mode)
        x = x0.to(DEVICE, dtype).requires_grad_()
        w = routing.weights.to(DEVICE).requires_grad_()
        r = Routing(routing.indices.to(DEVICE), w, routing.tokens_per_expert.to(DEVICE), routing.aux_loss.to(DEVICE),
                    capacity=routing.capacity)
        disp = dispatch.LocalDispatcher(E)
        d = disp.dispatch(x, r)
        out = disp.combine(d.rows * 2.0, d.meta)
        return (out, *torch.autograd.grad(out, (x, w), cot.to(DEVICE, dtype)))

    for dtype in (torch.float32, torch.bfloat16):
        before = (LAUNCHES["_combine_fwd_kernel"], LAUNCHES["_combine_bwd_kernel"])
        got = run(dtype, "auto" if ON == "cuda" else "always")
        # combine forward + the permute's backward (the same kernel, no weights), combine backward
        assert (LAUNCHES["_combine_fwd_kernel"], LAUNCHES["_combine_bwd_kernel"]) == (before[0] + 2, before[1] + 1)
        ref = run(dtype, "never")
        tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the torch path rounds the weights to bf16 too
        for name, a, b in zip(("out", "grad_x", "grad_w"), got, ref):
            assert a.dtype == b.dtype and rel_err(a, b) <= tol, f"{dtype} {name}: rel err {rel_err(a, b):.3g}"


# ---------------------------------------------------------------------------------------------------
# The MoE layer on the device
# ---------------------------------------------------------------------------------------------------

def layer_and_input(num_experts=8, k=2, router="topk", seed=0, bias=False):
    """``bias``: gpt-oss's experts (swiglu_oai, per-expert biases, random: they start at 0)."""
    from moekit.moe import MoELayer, build_router

    torch.manual_seed(seed)
    h, f, t = (32, 48, 96) if SMALL else (512, 1024, 4096)
    kwargs = {"top_k": k} if router == "topk" else {}
    if router == "topk-sequence":  # sequence-wise balancing (the input is then one sequence of t tokens)
        router, kwargs = "topk", {"top_k": k, "balance": "sequence"}
    layer = MoELayer(h, f, num_experts, build_router(router, h, num_experts, **kwargs),
                     activation="swiglu_oai" if bias else "swiglu", ffn_bias=bias)
    if bias:
        with torch.no_grad():
            for p in (layer.experts.b_in, layer.experts.b_out):
                p.normal_(std=0.5, generator=torch.Generator().manual_seed(seed + 2))
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(seed + 1))
    return layer, x


def run_layer(layer, x):
    """(out, grad of x, grads of the parameters) for a fixed random cotangent."""
    x = x.detach().clone().requires_grad_()
    out = layer(x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out.backward(g.to(out.device, out.dtype))
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend", ["triton", "torch", "loop", "auto"])
def test_moe_layer_on_device_matches_float64(backend):
    import copy

    from moekit.moe.experts import resolve_backend

    layer, x = layer_and_input()
    ref_layer = copy.deepcopy(layer).double()
    ref = run_layer(ref_layer, x.double())
    layer = layer.to(DEVICE)
    layer.experts.backend = backend
    probe = torch.zeros(1, layer.hidden_size, device=DEVICE)
    w_in = next(layer.experts.parameters())
    try:
        resolve_backend(backend, probe, w_in, w_in)
    except ValueError as exc:
        pytest.skip(str(exc))
    got = run_layer(layer, x.to(DEVICE))
    # fp32 end to end: router, permutation and experts all near float rounding of the float64 run
    assert rel_err(got[0], ref[0]) < 1e-5 and rel_err(got[1], ref[1]) < 1e-5
    assert got[2].keys() == ref[2].keys()
    for name in ref[2]:
        assert rel_err(got[2][name], ref[2][name]) < 1e-5, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("layout", ["ragged", "one_hot"])
def test_lora_experts_on_device_match_float64(dtype, layout):
    """Experts with LoRA adapters (moe/lora_experts.py: grouped_mm on the device) against float64 merged weights on
    the CPU; bf16 within 3x the error of torch's own bf16 loop on the merged weights, fp32 near rounding."""
    from moekit.moe.experts import GroupedExperts, loop_mlp

    counts, tail = layouts()[layout]
    E, H, Fh, r = len(counts), (32 if SMALL else 1024), (48 if SMALL else 768), 16
    g = torch.Generator().manual_seed(5)
    ex = GroupedExperts(E, H, Fh, activation="swiglu", backend="auto", dtype=torch.float64)
    ex.add_lora(r, 32.0)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / math.sqrt(p.shape[-2]))
    ex.w_in.requires_grad_(False)
    ex.w_out.requires_grad_(False)
    x = torch.randn(sum(counts) + tail, H, generator=g, dtype=torch.float64)
    c = torch.tensor(counts)

    def merged(side, m):
        return getattr(m, f"w_{side}") + m.lora_scale * torch.bmm(getattr(m, f"lora_a_{side}"),
                                                                  getattr(m, f"lora_b_{side}"))

    def reference(m, rows):
        return loop_mlp(rows, c.to(rows.device), merged("in", m), merged("out", m), "swiglu")

    adapters = ["lora_a_in", "lora_b_in", "lora_a_out", "lora_b_out"]

    def run(m, rows, fn):
        rows = rows.detach().clone().requires_grad_()
        y = fn(m, rows)
        gy = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(y)
        grads = torch.autograd.grad(y, [rows, *(getattr(m, n) for n in adapters)], gy)
        return [y.detach(), *grads]

    want = run(ex, x, reference)
    dev = __import__("copy").deepcopy(ex).to(DEVICE, dtype)
    got = run(dev, x.to(DEVICE, dtype), lambda m, rows: m(rows, c.to(DEVICE)))
    peer = run(dev, x.to(DEVICE, dtype), reference)  # torch's own matmuls in this dtype, merged weights
    for name, a, b, p in zip(["out", "rows", *adapters], got, want, peer):
        bound = 1e-5 if dtype == torch.float32 else 3 * rel_err(p, b) + 1e-3
        assert rel_err(a, b) < bound, (name, rel_err(a, b), bound)


@pytest.mark.parametrize("case", first_on_cpu(["k2", "k8", "k4-bias"],
                                              "tests/test_fused_permute.py runs the layer in the interpreter"))
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_fused_permute_layer_on_device_against_the_permuted_rows(monkeypatch, case, autocast):
    """moe.experts.FUSED_PERMUTE. The gather alone (the up kernel reads the routed rows through pointer loads, its
    weights by TMA where that runs): the forward's products are the same in either load path, so the output is
    equal bit for bit, at k 2 the input gradient too (two-term sums in either order), at k 8 within the rounding
    of different summation orders. With the routing weights in the last GEMM as well: everything within the
    rounding of the output's dtype of the permuted path. The permuted copy never exists on the fused paths, nor
    the weighted combine on the second. ``bias``: gpt-oss's experts, each output bias scaled with its row."""
    from moekit.moe import dispatch, experts
    from moekit.moe.dispatch import LocalDispatcher
    from moekit.moe.kernels import LAUNCHES

    k, bias = int(case[1]), case.endswith("bias")
    layer, x = layer_and_input(num_experts=8 if SMALL else 16, k=k, bias=bias)
    layer = layer.to(DEVICE)
    layer.experts.backend = "triton"
    ctx = (lambda: torch.autocast(DEVICE.type, dtype=torch.bfloat16)) if autocast else (lambda: torch.autocast(
        DEVICE.type, enabled=False))
    runs = {}
    for name, mode, weights in (("plain", "never", True), ("gather", "always", False), ("fused", "always", True)):
        monkeypatch.setattr(experts, "FUSED_PERMUTE", mode)
        monkeypatch.setattr(LocalDispatcher, "fuses_weights", weights)
        if mode == "always":
            monkeypatch.setattr(dispatch, "permute", lambda *a: pytest.fail("the rows were permuted"))
        if name == "fused":
            monkeypatch.setattr(dispatch._Unpermute, "apply", lambda *a: pytest.fail("the weighted combine ran"))
        layer.zero_grad()
        before = LAUNCHES["_expert_up_act_kernel"]
        with ctx():
            runs[name] = run_layer(layer, x.to(DEVICE))
        assert LAUNCHES["_expert_up_act_kernel"] == before + 1, name
    ref, gathered, fused = runs["plain"], runs["gather"], runs["fused"]
    assert torch.equal(gathered[0], ref[0])
    if k <= 2:
        assert torch.equal(gathered[1], ref[1])
    bound = 1e-2 if autocast else 1e-5
    for got in (gathered, fused):
        assert rel_err(got[0], ref[0]) < bound and rel_err(got[1], ref[1]) < bound
        for name in ref[2]:
            assert rel_err(got[2][name], ref[2][name]) < bound, name


def test_bf16_autocast_layer_close_to_fp32():
    layer, x = layer_and_input(num_experts=16, k=4)
    layer = layer.to(DEVICE)
    ref = run_layer(layer, x.to(DEVICE))
    layer.zero_grad()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        got = run_layer(layer, x.to(DEVICE))
    # bf16 matmuls (8 mantissa bits): ~3e-3 per rounding; routing decisions flip for near-ties, each flip
    # moving one token's contribution, so the bound is loose but far from the O(1) error of a wrong kernel
    assert rel_err(got[0], ref[0]) < 3e-2
    assert rel_err(got[1], ref[1]) < 5e-2
    for name, g in got[2].items():
        assert g.dtype == torch.float32 and rel_err(g, ref[2][name]) < 8e-2, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-autocast", "fp32"])
def test_fused_lm_loss_on_device_matches_float64(dtype, monkeypatch):
    """The LM-head loss with its fused cross-entropy kernel (models.loss, moe.kernels.cross_entropy; the default
    on CUDA) against float64 on the CPU: loss, dh and dW, a vocabulary that is no multiple of the column tile,
    ignored targets and a ragged last chunk; bounded by 2x the torch passes' own error in the same run."""
    from moekit.models import loss as L
    from moekit.moe.kernels import LAUNCHES

    fused = None if ON == "cuda" else True  # the interpreter: forced (auto is torch off CUDA)
    N, H, V, chunk = (40, 16, 70, 16) if SMALL else (6000, 1024, 32003, 2048)
    gen = torch.Generator().manual_seed(13)
    h = torch.randn(N, H, generator=gen, dtype=torch.float64)
    w = torch.randn(V, H, generator=gen, dtype=torch.float64) * H**-0.5
    y = torch.randint(0, V, (N,), generator=gen)
    y[::7] = L.IGNORE_INDEX

    def run(fused_arg):
        hh, ww = (t.to(DEVICE, torch.float32).requires_grad_() for t in (h, w))
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = L.chunked_lm_loss(hh, ww, y.to(DEVICE), chunk=chunk, fused=fused_arg)
        loss.backward()
        return [loss.detach(), hh.grad, ww.grad]

    hd, wd = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref_loss = F.cross_entropy(hd @ wd.t(), y, ignore_index=L.IGNORE_INDEX)
    ref_loss.backward()
    ref = [ref_loss.detach(), hd.grad, wd.grad]
    before = LAUNCHES["_cross_entropy_kernel"]
    got = run(fused)
    assert LAUNCHES["_cross_entropy_kernel"] == before + -(-N // chunk)  # the kernel ran, once per chunk
    base = run(False)
    for name, g, b, r in zip(("loss", "dh", "dw"), got, base, ref):
        assert rel_err(g, r) <= 2 * rel_err(b, r) + 1e-6, (name, rel_err(g, r), rel_err(b, r))


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["w_fp32", "w_bf16"])
@pytest.mark.parametrize("E", [128, 61])  # 61: rows of the gradient [T, E] not 16-byte aligned
def test_router_logits_split_gemm_match_float64(w_dtype, E, monkeypatch):
    """The router's fp32 logits of a bf16 input from bf16 tensor-core GEMMs (moe.precision._SplitLinear, the
    default on CUDA): logits and both gradients against float64, to fp32-like bounds (2^-17 per split term)."""
    from moekit.moe import precision as P

    if ON != "cuda":
        monkeypatch.setattr(P, "SPLIT_ROUTER", "always")
    T, H = (48, 64) if SMALL else (8192, 2048)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    w = (torch.randn(E, H, generator=gen) * 0.02).to(w_dtype)
    assert P.split_applies(x.to(DEVICE), w.to(DEVICE), torch.float32)
    out, dx, dw = fwd_bwd(lambda a, b: P.upcast_linear(a, b, torch.float32), [x.to(DEVICE), w.to(DEVICE)])
    g = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    xd, wd = x.double(), w.double()
    assert out.dtype == torch.float32
    assert rel_err(out, xd @ wd.t()) < (1e-6 if w_dtype == torch.bfloat16 else 3e-5)
    assert rel_err(dx, g @ wd) < 4e-3  # dx is bf16, x's dtype
    assert rel_err(dw, g.t() @ xd) < (4e-3 if w_dtype == torch.bfloat16 else 3e-5)


@pytest.mark.skipif(ON != "cuda", reason="CUDA's sync debug mode")
@pytest.mark.parametrize("router", ["topk", "switch", "sinkhorn", "expert_choice", "topk-sequence"])
def test_router_and_dispatch_never_sync_on_cuda(router):
    """torch.cuda.set_sync_debug_mode("error"): any host wait in routing / permute / combine raises."""
    layer, x = layer_and_input(router=router, k=2)
    layer = layer.to(DEVICE)
    layer.experts.backend = "triton"
    x = x.to(DEVICE).requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = layer(x)
        out.square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(x.grad).all()


# ---------------------------------------------------------------------------------------------------
# Training on the device
# ---------------------------------------------------------------------------------------------------

TINY = ("--model.hidden_size 64 --model.num_layers 2 --model.num_heads 4 --model.num_kv_heads 2 "
        "--model.ffn_hidden_size 128 --model.moe_ffn_hidden_size 64 --model.max_seq_len 64 --train.seq_len 64 "
        "--batch-size 8 --eval.sequences 8 --eval.every 0 --log.tensorboard false --log.every 1000 "
        "--log.progress off").split()


def train(run_dir: Path, *flags: str) -> list[dict]:
    from moekit.train.loop import main

    assert main([*TINY, "--run-dir", str(run_dir), *flags]) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line and '"step"' in line]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,sinks,documents", [(0, True, False), (48, False, False), (48, True, False),
                                                    (0, False, True), (48, True, True)])
def test_sink_and_window_attention_on_device_match_float64(dtype, window, sinks, documents):
    """gpt-oss's attention on the device's SDPA kernels (masked, GQA expanded: models.attention.masked_sdpa; at S 512
    the window runs in two blocks of 256 queries, models.attention.local_attention) against the float64 path on the
    CPU, forward and the gradients of q, k, v and the sinks; with ``documents`` every call takes a per-sequence
    document mask ([B, 1, S, keys]: documents of 100 positions, shifted by 37 in the second sequence). Bounded by
    4x the error of torch's own plain causal SDPA on the same inputs in the same dtype, plus a floor."""
    from moekit.models import attention as A

    B, N, K, S, D = 2, 8, 2, (64 if SMALL else 512), 64
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, n, S, D, generator=gen, dtype=torch.float64) for n in (N, K, K))
    s = torch.randn(N, generator=gen, dtype=torch.float64) * 2 if sinks else None
    inputs = [q, k, v] + ([s] if sinks else [])
    positions = torch.arange(S)
    segments = torch.stack([positions // 100, (positions + 37) // 100]).int() if documents else None

    def ours(q, k, v, s=None):
        seg = None if segments is None else segments.to(q.device)
        return A.attend(q, k, v, None, True, window=window, sinks=s, segments=seg)

    def plain(q, k, v, s=None):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    before = A.EXPLICIT_ATTENTION
    A.EXPLICIT_ATTENTION = "always"
    try:
        ref = fwd_bwd(lambda *t: ours(*t), inputs)
    finally:
        A.EXPLICIT_ATTENTION = before
    A.EXPLICIT_ATTENTION = "never"
    try:
        got = fwd_bwd(ours, [t.to(DEVICE, dtype) for t in inputs])
    finally:
        A.EXPLICIT_ATTENTION = before
    base_ref = fwd_bwd(plain, [q, k, v])
    base = fwd_bwd(plain, [t.to(DEVICE, dtype) for t in (q, k, v)])
    bound = 4 * max(rel_err(b, r) for b, r in zip(base, base_ref)) + (1e-6 if dtype == torch.float32 else 1e-3)
    for name, g, r in zip(["out", "dq", "dk", "dv", "dsinks"], got, ref):
        assert rel_err(g, r) <= bound, (name, rel_err(g, r), bound)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("documents", [False, True], ids=["plain", "documents"])
def test_chunked_attention_on_device_matches_float64(dtype, documents):
    """Llama 4's chunked attention (models.attention.local_attention's call per chunk: unmasked causal SDPA where
    the queries start their chunk, masked calls with documents) on the device against its float64 definition
    (tests/test_llama4.py), forward and gradients; GQA 8 / 2 heads, chunks of 256 over 1000 positions (the last
    one short). Bounded by 4x the error of torch's own causal SDPA in the dtype."""
    from moekit.models import attention as A
    from tests.test_llama4 import chunked_reference

    B, N, K, D = 2, 8, 2, 64
    S, chunk = (40, 16) if SMALL else (1000, 256)
    gen = torch.Generator().manual_seed(5 + documents)
    q, k, v = (torch.randn(B, n, S, D, generator=gen, dtype=torch.float64) for n in (N, K, K))
    positions = torch.arange(S)
    segments = torch.stack([positions // (S // 3), (positions + 7) // (S // 2)]).int() if documents else None

    def ours(q, k, v):
        return A.attend(q, k, v, None, True, segments=None if segments is None else segments.to(q.device),
                        chunk=chunk)

    def plain(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    ref = fwd_bwd(lambda q, k, v: chunked_reference(q, k, v, chunk, segments), [q, k, v])
    got = fwd_bwd(ours, [t.to(DEVICE, dtype) for t in (q, k, v)])
    base_ref = fwd_bwd(plain, [q, k, v])
    base = fwd_bwd(plain, [t.to(DEVICE, dtype) for t in (q, k, v)])
    bound = 4 * max(rel_err(b, r) for b, r in zip(base, base_ref)) + (1e-6 if dtype == torch.float32 else 1e-3)
    for name, g, r in zip(["out", "dq", "dk", "dv"], got, ref):
        assert rel_err(g, r) <= bound, (name, rel_err(g, r), bound)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cp,D", [(2, 64), (4, 64), (2, 72)], ids=["cp2", "cp4", "cp2-D72"])
def test_lower_right_chunks_on_device_match_float64(monkeypatch, dtype, cp, D):
    """Context-parallel chunks as one bottom-right-aligned flash call each (models.attention.CUDA_LOWER_RIGHT: off
    until this passes on a GPU) against the float64 whole-sequence attention on the CPU (each rank's chunks over the
    gathered keys, tests/test_context_parallel.py's simulation), forward and the q / k / v gradients summed over the
    ranks; GQA 8 / 2 heads; no masked call runs. Bounded by 4x the error of torch's own causal SDPA in the dtype."""
    from moekit.comm.context_parallel import ContextParallel
    from moekit.models import attention as A
    from tests.test_context_parallel import _reference

    monkeypatch.setattr(A, "CUDA_LOWER_RIGHT", True)
    masked = []
    monkeypatch.setattr(A, "masked_sdpa", lambda *a, **kw: masked.append(1))  # any masked call fails the test
    B, N, K, S = 2, 8, 2, (64 if SMALL else 1024)
    gen = torch.Generator().manual_seed(cp + D)
    q, k, v = (torch.randn(B, n, S, D, generator=gen, dtype=torch.float64) for n in (N, K, K))

    def ours(q, k, v):
        outs = [A.context_attend(ContextParallel(cp, r).shard(q, 2), k, v, ContextParallel(cp, r), True)
                for r in range(cp)]  # every rank's rows, back in position order
        whole = torch.empty_like(q[..., :D])
        for r, out in enumerate(outs):
            whole[:, :, ContextParallel(cp, r).positions(S // cp, q.device)] = out
        return whole

    def plain(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    ref = fwd_bwd(lambda q, k, v: _reference(q, k, v, 0, None), [q, k, v])
    got = fwd_bwd(ours, [t.to(DEVICE, dtype) for t in (q, k, v)])
    assert not masked
    base = fwd_bwd(plain, [t.to(DEVICE, dtype) for t in (q, k, v)])
    bound = 4 * max(rel_err(b, r) for b, r in zip(base, ref)) + 1e-3
    for name, g, r in zip(["out", "dq", "dk", "dv"], got, ref):
        assert rel_err(g, r) <= bound, (name, rel_err(g, r), bound)


@pytest.mark.parametrize("scan", ["loop", "scan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_gated_delta_rule_on_device_matches_float64(dtype, scan, monkeypatch):
    """Qwen3.5's Gated DeltaNet on the device: the chunked rule (triangular solves, the state across chunks) in
    fp32 / bf16 inputs against the float64 recurrence on the CPU, output and every input's gradient; the bound
    is calibrated on the recurrence run in the same dtype (the rule accumulates in fp32 either way). ``scan``: the
    chunks' recurrence as the torch loop, or as moe.kernels.delta_scan's two Triton kernels (models.delta_rule
    .TRITON_SCAN; the interpreter on CPU), whose launches are counted."""
    from moekit.models import delta_rule as DR
    from moekit.models.linear_attention import gated_delta_rule, gated_delta_steps, l2_normalize
    from moekit.moe.kernels import LAUNCHES

    monkeypatch.setattr(DR, "TRITON_SCAN", "never" if scan == "loop" else "auto" if ON == "cuda" else "always")
    before = LAUNCHES["_delta_scan_fwd_kernel"] + LAUNCHES["_delta_scan_bwd_kernel"]

    B, S, N, dk, dv = (1, 40, 2, 8, 8) if SMALL else (2, 1000, 8, 128, 128)
    g = torch.Generator().manual_seed(3)
    q = l2_normalize(torch.randn(B, S, N, dk, generator=g, dtype=torch.float64)) * dk**-0.5
    k = l2_normalize(torch.randn(B, S, N, dk, generator=g, dtype=torch.float64))
    v = torch.randn(B, S, N, dv, generator=g, dtype=torch.float64)
    decay = -torch.rand(B, S, N, generator=g, dtype=torch.float64)
    beta = torch.rand(B, S, N, generator=g, dtype=torch.float64)
    inputs = [q, k, v, decay, beta]
    ref = fwd_bwd(lambda *t: gated_delta_steps(*t)[0], inputs)
    low = [t.to(DEVICE, dtype) for t in inputs]
    got = fwd_bwd(lambda *t: gated_delta_rule(*t, chunk=64 if not SMALL else 16, final_state=False)[0], low)
    ran = LAUNCHES["_delta_scan_fwd_kernel"] + LAUNCHES["_delta_scan_bwd_kernel"] - before
    assert ran == (2 if scan == "scan" else 0), ran
    # the same rounding of the inputs through the float64 recurrence: what the dtype itself costs
    same = fwd_bwd(lambda *t: gated_delta_steps(*t)[0], [t.to(dtype).double() for t in inputs])
    for name, a, r, base in zip(["out", "dq", "dk", "dv", "dg", "dbeta"], got, ref, same):
        bound = 2 * rel_err(base, r) + (1e-5 if dtype == torch.float32 else 2e-2)
        assert rel_err(a, r) <= bound, (name, rel_err(a, r), bound)


@pytest.mark.parametrize("preset", ["mixtral-tiny", "deepseek-tiny", "gpt-oss-tiny",
                                    pytest.param("qwen3.5-tiny", marks=pytest.mark.skipif(
                                        SMALL, reason="its CPU training: tests/test_linear_attention.py"))])
def test_training_on_device_fp32_matches_cpu_and_bf16_learns(tmp_path, preset):
    steps = ["--steps", "6", "--preset", preset]
    cpu = train(tmp_path / "cpu", *steps, "--train.device", "cpu", "--train.dtype", "float32")
    # the tier on the CPU (MOEKIT_GPU_TESTS_ON=cpu): the device run in fp32 is the same command as the CPU one
    dev32 = cpu if DEVICE.type == "cpu" else train(tmp_path / "dev32", *steps, "--train.device", DEVICE.type,
                                                   "--train.dtype", "float32")
    bf16 = train(tmp_path / "bf16", *steps, "--train.device", DEVICE.type, "--train.dtype", "bfloat16")
    assert len(cpu) == len(dev32) == len(bf16) == 6
    # same init and data: step 0 agrees to fp32 reductions; later steps drift a little through Adam
    assert dev32[0]["loss"] == pytest.approx(cpu[0]["loss"], rel=1e-4)
    assert dev32[-1]["loss"] == pytest.approx(cpu[-1]["loss"], rel=2e-2)
    assert bf16[0]["loss"] == pytest.approx(cpu[0]["loss"], rel=2e-2)
    assert bf16[-1]["loss"] < bf16[0]["loss"] - 0.1, [m["loss"] for m in bf16]


def test_parameter_ema_on_device_follows_the_recurrence_and_the_trainer_reports_it(tmp_path):
    """The parameter average (moekit.train.ema) on the device beside the trainer's AdamW (fused on CUDA): one
    foreach lerp per update equals the recurrence in float64 over the weights after each step, swapping for an
    evaluation restores every bit; a trainer run on the device reports val_loss_ema."""
    from moekit.models.config import PRESETS
    from moekit.models.transformer import build_model
    from moekit.train.ema import ParameterEMA

    cfg = dataclasses.replace(PRESETS["mixtral-tiny"], hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                              ffn_hidden_size=128, moe_ffn_hidden_size=64, max_seq_len=32)
    model = build_model(cfg, device=DEVICE, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=DEVICE.type == "cuda")
    ema, decay = ParameterEMA(opt, 0.8), 0.8
    want: dict[str, torch.Tensor] = {}
    for step in range(1, 6):
        tokens = torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(step)).to(DEVICE)
        model(tokens, targets=tokens).backward()
        opt.step()
        opt.zero_grad()
        ema.update(step)
        for n, p in model.named_parameters():
            w = p.detach().double().cpu()
            want[n] = w if n not in want else want[n] + (1 - decay) * (w - want[n])
    for n, p in model.named_parameters():
        torch.testing.assert_close(opt.state[p]["ema"].double().cpu(), want[n], rtol=1e-5, atol=1e-6)
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    with ema.swapped():
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.double().cpu(), want[n], rtol=1e-5, atol=1e-6)
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters())
    rows = train(tmp_path / "run", "--steps", "4", "--train.device", DEVICE.type, "--train.ema_decay", "0.9",
                 "--eval.every", "2")
    evaluated = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [2, 4] and all(math.isfinite(r["val_loss_ema"]) for r in evaluated)


def test_profiled_run_on_device_attributes_kernel_time_and_snapshots_memory(tmp_path):
    """--profile.every on the device: the window's categories are GPU kernel time (the experts' and attention's
    kernels attributed through their modules, backward included), and on CUDA --profile.memory leaves the
    allocator's history beside the trace (a pickle torch's memory_viz reads: it holds the recorded segments)."""
    import pickle

    memory = ["--profile.memory", "true"] if DEVICE.type == "cuda" else []
    train(tmp_path / "run", "--steps", "3", "--train.device", DEVICE.type, "--train.dtype",
          "bfloat16" if DEVICE.type == "cuda" else "float32", "--profile.every", "3", "--profile.steps", "2", *memory)
    folder = tmp_path / "run" / "profile" / "step_000003"
    summary = json.loads((folder / "rank0.summary.json").read_text())
    assert summary["steps"] == [2, 3]
    assert summary["time_basis"] == ("GPU kernel time" if DEVICE.type == "cuda" else "CPU op self time")
    cats = summary["categories_ms_per_step"]
    assert cats["expert_gemm"] > 0 and cats["attention"] > 0 and cats["head_loss"] > 0, cats
    assert cats["other"] < 0.5 * summary["ms_per_step"], cats  # the labels attribute most of the step
    if memory:
        with open(folder / "rank0.memory.pickle", "rb") as f:
            snap = pickle.load(f)
        assert snap["segments"] and summary["memory_snapshot"] == "rank0.memory.pickle"


@pytest.mark.skipif(ON != "cuda", reason="--profile.memory records CUDA's caching allocator")
def test_an_out_of_memory_error_leaves_the_allocators_history(tmp_path):
    """StepProfiler.on_error (the trainer's failure path) with --profile.memory: an out-of-memory error at step 7
    writes profile/oom_step_000007/rank0.memory.pickle, and names it; another error writes nothing."""
    import pickle
    from types import SimpleNamespace

    from moekit.train.profiling import StepProfiler

    section = SimpleNamespace(every=0, steps=1, warmup=1, memory=True)
    prof = StepProfiler(section, tmp_path, 0, True, DEVICE, torch.nn.Linear(2, 2), 0, 10, True, print)
    try:
        keep = torch.empty(1 << 20, device=DEVICE)  # an allocation for the history to show
        said = []
        assert prof.on_error(RuntimeError("a shape mismatch"), 7, said.append) is None and not said
        path = prof.on_error(torch.OutOfMemoryError("CUDA out of memory"), 7, said.append)
        assert path == tmp_path / "profile" / "oom_step_000007" / "rank0.memory.pickle" and str(path) in said[0]
        with open(path, "rb") as f:
            assert pickle.load(f)["segments"]
        del keep
    finally:
        prof.close()


def test_mtp_training_and_speculative_decoding_on_device(tmp_path):
    """A multi-token-prediction depth on the device: the trainer's mtp_loss at step 0 equals the CPU run's (fp32),
    and greedy speculative decoding (chains of 1 and 2 drafts from the two depths, one forward checking them) gives
    plain decoding's tokens, with matmuls in true fp32 (TF32 off: a 3-position and a 1-position forward must round
    alike)."""
    from moekit.models.config import ModelConfig
    from moekit.models.transformer import build_model
    from moekit.train.decoding import generate, generate_speculative
    from moekit.train.inference import inference_routing

    steps = ["--steps", "2", "--preset", "deepseek-tiny", "--model.mtp_layers", "1", "--train.dtype", "float32"]
    cpu = train(tmp_path / "cpu", *steps, "--train.device", "cpu")
    dev = train(tmp_path / "dev", *steps, "--train.device", DEVICE.type)
    assert dev[0]["mtp_loss"] == pytest.approx(cpu[0]["mtp_loss"], rel=1e-4)
    cfg = ModelConfig(name="spec", vocab_size=12, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4,
                      max_seq_len=20, ffn_hidden_size=48, num_experts=4, moe_ffn_hidden_size=16, top_k=2,
                      first_dense_layers=1, mtp_layers=2)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        accepted = 0
        for seed in range(3):
            model = build_model(cfg, DEVICE, seed=seed)
            inference_routing(model)
            prompt = torch.randint(0, 12, (4,), generator=torch.Generator().manual_seed(seed)).tolist()
            plain = generate(model, prompt, 40).new_ids
            for depths in (1, 2):
                got = generate_speculative(model, prompt, 40, draft_depths=depths)
                assert got.new_ids == plain, (seed, depths)
                accepted += got.accepted
        assert accepted > 0  # seeds 0-2 of this model draft some accepted tokens on the CPU
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


@pytest.mark.skipif(ON != "cuda", reason="FSDP's mixed precision over NCCL")
def test_fsdp_bf16_mixed_precision_one_gpu():
    """fully_shard with param_dtype bf16 / reduce fp32 on a 1-rank NCCL group: parameters and gradients
    stay fp32, the loss follows the bf16-autocast run of the same model, and training learns."""
    import copy

    import torch.distributed as dist

    from moekit.comm.fsdp import apply_fsdp
    from moekit.comm.topology import Layout, Topology
    from moekit.models.config import PRESETS
    from moekit.models.transformer import build_model
    from tests.dist_utils import free_port

    cfg = dataclasses.replace(PRESETS["mixtral-tiny"], hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                              ffn_hidden_size=256, moe_ffn_hidden_size=128, max_seq_len=64, capacity_factor=None)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ref = build_model(cfg, device="cuda", seed=1)
        sharded = copy.deepcopy(ref)
        apply_fsdp(sharded, Topology(Layout(), 0, 1).build(device_type="cuda"), param_dtype=torch.bfloat16)
        losses = {"ref": [], "fsdp": []}
        for name, model in (("ref", ref), ("fsdp", sharded)):
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
            torch.manual_seed(0)
            for step in range(8):
                tokens = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(step)).cuda()
                ctx = torch.autocast("cuda", dtype=torch.bfloat16) if name == "ref" else torch.autocast("cuda", enabled=False)
                with ctx:
                    loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
                loss.backward()
                if step == 0 and name == "fsdp":
                    for n, p in model.named_parameters():
                        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, n
                opt.step()
                opt.zero_grad()
                losses[name].append(loss.item())
        assert losses["fsdp"][0] == pytest.approx(losses["ref"][0], rel=2e-2)
        assert losses["fsdp"][-1] == pytest.approx(losses["ref"][-1], rel=5e-2)
        assert losses["fsdp"][-1] < losses["fsdp"][0] - 0.1
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(ON != "cuda", reason="inductor on CUDA (CPU inductor: tests/test_compile.py, opt-in)")
def test_compiled_bf16_training_matches_eager():
    import copy

    from moekit.models.compile import apply_compile
    from moekit.models.config import PRESETS
    from moekit.models.transformer import build_model

    cfg = dataclasses.replace(PRESETS["mixtral-tiny"], hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                              ffn_hidden_size=256, moe_ffn_hidden_size=128, max_seq_len=64, capacity_factor=None)
    eager = build_model(cfg, device="cuda", seed=2)
    compiled = copy.deepcopy(eager)
    apply_compile(compiled)
    losses = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        torch.manual_seed(0)
        out = []
        for step in range(5):
            tokens = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(step)).cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        losses[name] = out
    # inductor fuses bf16 elementwise work differently from eager: rounding, not a different model
    assert losses["compiled"][0] == pytest.approx(losses["eager"][0], rel=1e-2)
    assert losses["compiled"][-1] == pytest.approx(losses["eager"][-1], rel=3e-2)


@pytest.mark.skipif(ON != "cuda", reason="pinning a config only matters compiled (the interpreter has one config)")
@pytest.mark.parametrize("tma", ["never", "always"])
def test_every_candidate_tile_config_matches_float64(monkeypatch, tma):
    """Each kernel's every autotune candidate, pinned in turn (Kernel.pinned), in the fused SwiGLU MLP's
    forward and backward: the tier otherwise runs with MOEKIT_AUTOTUNE=first, so this is where the other
    configs' tails, masks and pipelining are checked. bf16, a ragged layout with empty experts. Both kernel
    families: the pointer kernels, and the TMA variants (the default on sm90+), whose grouped GEMM and weight
    gradient are Kernel objects of their own (pinning the pointer kernel's config does not reach them)."""
    import importlib

    from moekit.moe.kernels import expert_mlp, expert_mlp_ref
    from moekit.moe.kernels.expert_mlp import EXPERT_DOWN_DACT, EXPERT_UP_ACT

    modules = {m: importlib.import_module(f"moekit.moe.kernels.{m}") for m in ("grouped_mm", "grouped_mm_wgrad",
                                                                               "expert_mlp")}
    for module, switch in (("grouped_mm", "GEMM_TMA"), ("grouped_mm_wgrad", "WGRAD_TMA"), ("expert_mlp", "MLP_TMA")):
        monkeypatch.setattr(modules[module], switch, tma)
    if tma == "always" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the TMA variants need sm90+")
    suffix = "_TMA" if tma == "always" else ""
    GROUPED_MM = getattr(modules["grouped_mm"], "GROUPED_MM" + suffix)
    GROUPED_MM_WGRAD = getattr(modules["grouped_mm_wgrad"], "GROUPED_MM_WGRAD" + suffix)

    counts, extra = [300, 0, 1, 517, 0, 129], 11
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    h, f, e, dtype = 320, 192, len(counts), torch.bfloat16  # tails in every tile dimension
    rows = torch.randn(sum(counts) + extra, h, generator=gen, dtype=torch.float64).to(dtype).double()
    w_in = (torch.randn(e, h, 2 * f, generator=gen, dtype=torch.float64) / h**0.5).to(dtype).double()
    w_out = (torch.randn(e, f, h, generator=gen, dtype=torch.float64) / f**0.5).to(dtype).double()
    c = torch.tensor(counts)
    ref = fwd_bwd(lambda a, b, d: expert_mlp_ref(a, c, b, d, "swiglu"), (rows, w_in, w_out))
    lo = [t.to(DEVICE, dtype) for t in (rows, w_in, w_out)]
    same = fwd_bwd(lambda a, b, d: expert_mlp_ref(a, c.to(DEVICE), b, d, "swiglu"), lo)
    from triton.runtime.errors import OutOfResources

    too_big = []  # a config this GPU cannot hold (the autotuner skips those silently): listed, not failed
    for kernel in (EXPERT_UP_ACT, GROUPED_MM, EXPERT_DOWN_DACT, GROUPED_MM_WGRAD):
        ran = 0
        for config in kernel.configs:
            try:
                with kernel.pinned(config):
                    got = fwd_bwd(lambda a, b, d: expert_mlp(a, c.to(DEVICE), b, d, "swiglu"), lo)
            except OutOfResources as exc:
                too_big.append(f"{kernel.name} {config}: {exc}")
                continue
            for name, g, r, t in zip(("y", "d_rows", "d_w_in", "d_w_out"), got, ref, same):
                assert_calibrated(f"{kernel.name} {config}: {name}", g, r, t, dtype)
            assert got[0][-extra:].abs().max().item() == 0
            ran += 1
        assert ran >= 1, f"{kernel.name}: no candidate config fits this GPU: {too_big}"
    if too_big:
        print("configs that do not fit this GPU (drop them from the lists):", *too_big, sep="\n  ")


@pytest.mark.skipif(ON != "cuda", reason="the trainer's optimizer is fused on CUDA only")
def test_trainer_optimizer_is_fused_on_gpu_and_steps_like_foreach():
    import copy

    from moekit.models.transformer import build_model
    from moekit.train.config import new_config
    from moekit.train.plan import make_optimizer

    cfg = new_config("mixtral-tiny")
    model = build_model(cfg.model, torch.device("cuda"), seed=3)
    twin = copy.deepcopy(model)
    fused = make_optimizer(model, cfg)
    assert fused.defaults["fused"] is True
    foreach = torch.optim.AdamW(
        [{**g, "params": [p2 for p1, p2 in zip(model.parameters(), twin.parameters()) if any(p1 is q for q in g["params"])]}
         for g in fused.param_groups], lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2), eps=cfg.train.eps,
        foreach=True)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0)).cuda()
    for m, opt in ((model, fused), (twin, foreach)):
        for _ in range(3):
            loss = F.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_muon_step_on_device_matches_the_cpu_step():
    """--train.optimizer muon (train.muon) on the device: one step from the same weights and gradients as on the
    CPU in float64 (Newton-Schulz in fp32 matmuls there: TF32 where torch allows it, hence the tolerance)."""
    import copy

    from moekit.models.transformer import build_model
    from moekit.train.config import new_config
    from moekit.train.muon import Muon, muon_param_groups

    cfg = new_config("deepseek-tiny")
    cpu = build_model(cfg.model, torch.device("cpu"), seed=4)
    dev = copy.deepcopy(cpu).to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    for a, b in zip(cpu.parameters(), dev.parameters()):
        a.grad = torch.randn(a.shape, generator=gen) * 1e-2
        b.grad = a.grad.to(DEVICE)
    opts = [Muon(muon_param_groups(m, 0.1), lr=1e-2) for m in (cpu, dev)]
    for opt in opts:
        opt.step()
    for (name, a), b in zip(cpu.named_parameters(), dev.parameters()):
        assert rel_err(b.detach().cpu(), a.detach()) <= 2e-3, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
def test_rope_kernel_on_device_matches_float64(dtype):
    """moe.kernels.rope at a training size (both layouts, forward and inverse) against float64, and
    models.rope picking it by itself on CUDA ("auto") with the same numbers as its torch path."""
    from moekit.models import rope as attention_rope
    from moekit.models.rope import apply_rope, rope_angles
    from moekit.moe.kernels import LAUNCHES
    from moekit.moe.kernels.rope import rope, rope_ref

    B, S, heads, D = (2, 9, 3, 16) if SMALL else (4, 2048, 8, 128)
    cos, sin = rope_angles(S, D, 1e6, DEVICE, 3)
    x = torch.randn(B, S, heads, D, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    for xs, c, s in ((x, cos[:, None], sin[:, None]), (x.transpose(1, 2), cos, sin)):
        for inverse in (False, True):
            for pairs in ("half", "from_adjacent", "to_adjacent"):  # adjacent: DeepSeek's MLA rope, ERNIE 4.5
                got = rope(xs, c, s, inverse=inverse, pairs=pairs)
                ref = rope_ref(xs.double(), c.double(), s.double(), inverse=inverse, pairs=pairs)
                assert rel_err(got, ref) <= FLOOR[dtype], (inverse, pairs, rel_err(got, ref))
    if ON == "cuda":
        before = LAUNCHES["_rope_kernel"]
        xr = x.clone().requires_grad_()
        y = apply_rope(xr, cos[:, None], sin[:, None])
        y.backward(torch.ones_like(y))
        assert LAUNCHES["_rope_kernel"] == before + 2  # forward and backward on the kernel, unasked
        old, attention_rope.TRITON_ROPE = attention_rope.TRITON_ROPE, "never"
        try:
            xt = x.clone().requires_grad_()
            yt = apply_rope(xt, cos[:, None], sin[:, None])
            yt.backward(torch.ones_like(yt))
        finally:
            attention_rope.TRITON_ROPE = old
        assert rel_err(y, yt) <= FLOOR[dtype] and rel_err(xr.grad, xt.grad) <= FLOOR[dtype]
        from moekit.models.rope import apply_rope_interleaved  # the adjacent pairs: on the kernel unasked too

        before = LAUNCHES["_rope_kernel"]
        xr = x.transpose(1, 2).clone().requires_grad_()
        y = apply_rope_interleaved(xr, cos, sin)
        y.backward(torch.ones_like(y))
        assert LAUNCHES["_rope_kernel"] == before + 2
        ref = rope_ref(x.transpose(1, 2).double(), cos.double(), sin.double(), pairs="from_adjacent")
        assert rel_err(y, ref) <= FLOOR[dtype]


@pytest.mark.parametrize("case", first_on_cpu(range(7), "tests/test_topk_route.py runs each in the interpreter"))
def test_fused_router_kernels_on_device(case):
    """moe.kernels.topk_route on CUDA against the torch steps: tests/test_topk_route.py's cases (exact
    indices and counts, fp32 values and every subset of the backward's inputs), which CI runs in the
    interpreter."""
    from tests import test_topk_route as t

    assert len(t.CASES) == 7
    t.test_kernel_matches_the_torch_steps_forward_and_backward(*t.CASES[case])


def test_router_is_fused_on_device_by_default_and_equals_torch(monkeypatch):
    """FUSED_ROUTER 'auto' runs the kernel for a CUDA TopKRouter (one launch each way) and gives the torch
    router's routing, losses and gradients (tests/test_topk_route.py's router cases, on CUDA)."""
    from moekit.moe import router as router_mod
    from moekit.moe.kernels import LAUNCHES
    from moekit.moe.router import build_router
    from tests import test_topk_route as t

    assert router_mod.FUSED_ROUTER == "auto"
    if DEVICE.type != "cuda":  # the tier's CPU run (MOEKIT_GPU_TESTS_ON=cpu): auto fuses on CUDA only
        monkeypatch.setattr(router_mod, "FUSED_ROUTER", "always")
    r = build_router("topk", 64, 16, top_k=4, aux_loss_coeff=0.01, z_loss_coeff=0.001).to(DEVICE)
    x = torch.randn(300, 64, device=DEVICE, requires_grad=True)
    before = (LAUNCHES["_topk_route_fwd_kernel"], LAUNCHES["_topk_route_bwd_kernel"])
    rt = r(x)
    (rt.weights.sum() + rt.aux_loss).backward()
    assert (LAUNCHES["_topk_route_fwd_kernel"], LAUNCHES["_topk_route_bwd_kernel"]) == (before[0] + 1, before[1] + 1)
    # the tier on the CPU: the first router case checks this test's wiring; tests/test_topk_route.py runs every case
    # in the interpreter (the same function), the CUDA run here takes them all
    for name, options in t.ROUTERS[:1] if SMALL else t.ROUTERS:
        t.test_router_with_the_kernel_equals_the_torch_router(monkeypatch, name, options)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_float8_experts_on_device_match_the_emulation_and_float64(activation):
    """The float8 backend's CUDA path (torch's rowwise-scaled fp8 grouped GEMM, sm90 / sm100) against its
    CPU emulation, which quantizes the same way (tests/test_float8.py checks that one bit for bit), and
    against float64: forward and backward, ragged and empty experts, rows nobody owns."""
    from moekit.moe import float8 as f8
    from moekit.moe.experts import loop_mlp
    from tests import test_float8 as t

    x, counts, w_in, w_out, dy = t._mlp_case(activation, torch.bfloat16)
    dev = [v.to(DEVICE) for v in (x, w_in, w_out)]
    reason = f8.fast_path_why_not(*dev)
    if reason:
        pytest.skip(f"the CUDA fp8 path does not run here: {reason}")
    counts_dev = counts.to(DEVICE)
    got = t._fwd_bwd(lambda *v: f8.float8_mlp(v[0], counts_dev, v[1], v[2], activation), dev, dy.to(DEVICE))
    emu = t._fwd_bwd(lambda *v: f8.float8_mlp(v[0], counts, v[1], v[2], activation), (x, w_in, w_out), dy)
    want = t._fwd_bwd(lambda *v: loop_mlp(v[0], counts, v[1], v[2], activation),
                      (x.double(), w_in.double(), w_out.double()), dy.double())
    owned = int(f8.counts_to_offs(counts, x.shape[0])[-1])
    for name, a, e, w in zip(("y", "d rows", "d w_in", "d w_out"), got, emu, want):
        a = a.cpu()
        assert a.dtype == torch.bfloat16 and torch.isfinite(a).all(), name
        if name in ("y", "d rows"):
            assert torch.equal(a[owned:], torch.zeros_like(a[owned:])), f"{name}: rows nobody owns"
        # same quantized operands; only accumulation order / fast accumulation and bf16 output rounding differ
        assert rel_err(a, e) < 2e-2, f"{name}: {rel_err(a, e):.4f} from the emulation"
        assert t.U / 4 < rel_err(a, w) < 1.6 * t.U, f"{name}: {rel_err(a, w):.4f} from float64"


@ON_DEVICE_ONLY
@pytest.mark.parametrize("dtype", first_on_cpu([torch.bfloat16, torch.float16, torch.float32]))
def test_tma_wgrad_on_device_equals_the_pointer_kernel(monkeypatch, dtype):
    """The TMA variant of the weight gradient (device-side tensor descriptors, sm90+) gives the pointer
    kernel's bits at the tier's ragged layouts, every candidate config's first entry included."""
    import importlib

    from moekit.moe.kernels import LAUNCHES

    W = importlib.import_module("moekit.moe.kernels.grouped_mm_wgrad")
    probe = torch.zeros(16, 16, device=DEVICE, dtype=dtype)
    reason = W.why_not_tma(probe, probe, None)
    if reason:
        pytest.skip(f"TMA does not run here: {reason}")
    g = torch.Generator().manual_seed(5)
    for name, (counts, tail) in layouts().items():
        m = sum(counts) + tail
        x = torch.randn(m, 96, generator=g).to(DEVICE, dtype)
        dy = torch.randn(m, 160, generator=g).to(DEVICE, dtype)
        offs = offs_of(counts).to(DEVICE)
        monkeypatch.setattr(W, "WGRAD_TMA", "never")
        want = W.grouped_mm_wgrad(x, dy, offs)
        monkeypatch.setattr(W, "WGRAD_TMA", "always")
        before = LAUNCHES["_grouped_mm_wgrad_tma_kernel"]
        got = W.grouped_mm_wgrad(x, dy, offs)
        assert LAUNCHES["_grouped_mm_wgrad_tma_kernel"] == before + (1 if m else 0), name  # no rows: zeros, no launch
        assert not W._TMA_FAILURE, W._TMA_FAILURE
        assert torch.equal(got, want), f"{name}: max diff {(got.float() - want.float()).abs().max().item()}"


@ON_DEVICE_ONLY
@pytest.mark.parametrize("dtype", first_on_cpu([torch.bfloat16, torch.float16]))
def test_tma_grouped_mm_on_device_equals_the_pointer_kernel(monkeypatch, dtype):
    """The persistent TMA forward / dX kernel (moe.kernels.grouped_mm.GEMM_TMA) gives the pointer kernel's
    bits at the tier's ragged layouts, plain and through W^T, one program per SM walking the tiles."""
    import importlib

    from moekit.moe.kernels import LAUNCHES

    G = importlib.import_module("moekit.moe.kernels.grouped_mm")
    probe = torch.zeros(16, 16, device=DEVICE, dtype=dtype)
    reason = G.why_not_tma(probe, probe[None])
    if reason:
        pytest.skip(f"TMA does not run here: {reason}")
    g = torch.Generator().manual_seed(6)
    for name, (counts, tail) in layouts().items():
        m = sum(counts) + tail
        k, n = (48, 80) if SMALL else (96, 160)
        w = torch.randn(len(counts), k, n, generator=g).to(DEVICE, dtype)
        for a, transpose in ((torch.randn(m, k, generator=g), False), (torch.randn(m, n, generator=g), True)):
            a, offs = a.to(DEVICE, dtype), offs_of(counts).to(DEVICE)
            monkeypatch.setattr(G, "GEMM_TMA", "never")
            want = G.grouped_mm_fwd(a, w, offs, transpose_w=transpose)
            monkeypatch.setattr(G, "GEMM_TMA", "always")
            before = LAUNCHES["_grouped_mm_tma_kernel"]
            got = G.grouped_mm_fwd(a, w, offs, transpose_w=transpose)
            assert LAUNCHES["_grouped_mm_tma_kernel"] == before + (1 if m else 0), name  # no rows: no launch
            assert not G._TMA_FAILURE, G._TMA_FAILURE
            assert torch.equal(got, want), f"{name} (W^T: {transpose}): max diff {(got.float() - want.float()).abs().max().item()}"


@ON_DEVICE_ONLY
@pytest.mark.parametrize("activation", first_on_cpu(["swiglu", "gelu"]))
def test_expert_mlp_with_every_tma_variant_equals_the_pointer_kernels(monkeypatch, activation):
    """MOEKIT_TMA's three switches at once (the fused kernels' descriptor loads, the persistent forward / dX,
    the weight gradient's): the fused expert MLP's output and gradients keep the pointer kernels' bits."""
    import importlib

    from moekit.moe.kernels import LAUNCHES

    mods = {name: importlib.import_module(f"moekit.moe.kernels.{name}") for name in
            ("expert_mlp", "grouped_mm", "grouped_mm_wgrad")}
    switches = {"expert_mlp": "MLP_TMA", "grouped_mm": "GEMM_TMA", "grouped_mm_wgrad": "WGRAD_TMA"}
    probe = torch.zeros(16, 16, device=DEVICE, dtype=torch.bfloat16)
    reason = mods["expert_mlp"].why_not_tma(probe, probe[None])
    if reason:
        pytest.skip(f"TMA does not run here: {reason}")
    g = torch.Generator().manual_seed(7)
    H, F = (64, 48) if SMALL else (256, 192)  # the interpreter: tails still in every tile dimension
    f_in = 2 * F if activation == "swiglu" else F
    for name, (counts, tail) in layouts().items():
        m = sum(counts) + tail
        x = torch.randn(m, H, generator=g).to(DEVICE, torch.bfloat16).requires_grad_()
        w_in = (torch.randn(len(counts), H, f_in, generator=g) * H ** -0.5).to(DEVICE, torch.bfloat16).requires_grad_()
        w_out = (torch.randn(len(counts), F, H, generator=g) * F ** -0.5).to(DEVICE, torch.bfloat16).requires_grad_()
        dy = torch.randn(m, H, generator=g).to(DEVICE, torch.bfloat16)
        c = torch.tensor(counts, device=DEVICE)
        out = {}
        for mode in ("never", "always"):
            for mod, switch in switches.items():
                monkeypatch.setattr(mods[mod], switch, mode)
            before = LAUNCHES["_expert_up_act_kernel:tma"]
            y = mods["expert_mlp"].expert_mlp(x, c, w_in, w_out, activation, variant="fused")
            out[mode] = (y, *torch.autograd.grad(y, (x, w_in, w_out), dy)) if m else (y,)
            assert LAUNCHES["_expert_up_act_kernel:tma"] - before == (1 if mode == "always" and m else 0), name
        for mod in mods.values():
            assert not mod._TMA_FAILURE, mod._TMA_FAILURE
        for what, a, b in zip(("y", "dx", "dw_in", "dw_out"), out["never"], out["always"]):
            assert torch.equal(a, b), f"{name} {what}: max diff {(a.float() - b.float()).abs().max().item()}"


def test_cpu_checkpoint_resumes_on_the_device_with_its_optimizer(tmp_path):
    """A run checkpointed on CPU (foreach AdamW, step counts on the CPU) resumes on the device, where the
    trainer's AdamW is fused (train.resume puts this run's implementation back and moves the step counts):
    the resumed steps continue the CPU run's curve."""
    common = ["--preset", "mixtral-tiny", "--train.dtype", "float32"]
    cpu = train(tmp_path / "cpu", *common, "--steps", "4", "--train.device", "cpu", "--checkpoint.every", "2")
    resumed = train(tmp_path / "dev", *common, "--steps", "4", "--train.device", DEVICE.type,
                    "--resume", str(tmp_path / "cpu" / "checkpoints" / "step_000002"), "--checkpoint.every", "0")
    assert [m["step"] for m in resumed] == [3, 4]
    for a, b in zip(resumed, cpu[2:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3), (a, b)
