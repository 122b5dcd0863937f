"""The permute fused into the expert GEMMs (ScatterMoE-style; moe.experts.FUSED_PERMUTE), on CPU in the Triton
interpreter: the gather into the first (the rows read from the layer input in place) and the routing weights into
the last (row_scale, the combine a plain sum).

Kernel level: ``expert_mlp(x, counts, ..., gather_index=, gather_slots=, row_scale=)`` against float64 autograd of
the gather-then-per-expert-loop written another way (``x[index]``, ``expert_mlp_ref``, times the weights), with
ragged counts, empty experts, rows past sum(counts), out-of-range indices and source rows nobody reads. Layer
level: the gather alone gives the permuted path's output and gradients bit for bit (at most two slots a token, which
both sum alike), with the weights as well the same accuracy against float64; the permuted copy and the weighted
combine never run, and the memory kept for backward shrinks by exactly the [T k, H] rows and expert outputs. Flat
expert parallelism over gloo ranks: the received rows' reorder in the up kernel, bit for bit.

The module-level TRITON_INTERPRET handling is test_kernels.py's (see its docstring).
"""
from __future__ import annotations

import copy
import math
import os

_PREV_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
import triton  # noqa: E402,F401  (first import decides the mode: see test_kernels.py)

import pytest
import torch

import moekit.moe.kernels as K
from moekit.bench.layer_probes import KeptForBackward
from moekit.moe import dispatch, experts
from moekit.moe.activations import ffn_in_features, get_activation
from moekit.moe.dispatch import LocalDispatcher
from moekit.moe.kernels import LAUNCHES, expert_mlp, expert_mlp_ref
from moekit.moe.layer import MoELayer
from moekit.moe.router import build_router
from tests.helpers import gen

if _PREV_INTERPRET is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _PREV_INTERPRET


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not K.interpret_mode():
        pytest.fail("triton was imported in compiled mode before this module set TRITON_INTERPRET=1; "
                    "run `TRITON_INTERPRET=1 pytest tests/test_fused_gather.py`")
    torch.set_num_threads(min(2, os.cpu_count() or 1))


def _routing(g, T, E, k, capacity_factor=None, empty=(0, 3)):
    """Ragged top-k routing with experts ``empty`` never chosen (and slots dropped under a capacity)."""
    router = build_router("topk", 8, E, top_k=k, capacity_factor=capacity_factor)
    logits = torch.randn(T, E, generator=g)
    logits[:, list(empty)] = -30.0
    return router.route(logits)


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def _fwd_bwd(fn, inputs, g):
    leaves = _leaves(*inputs)
    y = fn(*leaves)
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.dtype)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


# ---------------------------------------------------------------------------------------------------
# Kernel level
# ---------------------------------------------------------------------------------------------------


@pytest.mark.cover  # each value's path every run, re-paired each run (tests/conftest.py)
@pytest.mark.parametrize("activation", ["swiglu", "gelu", "swiglu_oai"])
@pytest.mark.parametrize("slots", [True, False], ids=["slots", "sorted"])
@pytest.mark.parametrize("variant", ["fused", "plain"])
def test_gathered_expert_mlp_matches_float64(activation, slots, variant):
    """Logical rows read from x in place, 4 experts of them empty or ragged, the backward's token sums by the slot
    map (combine kernel) or by a sort (scatter_add_rows): every output and gradient within fp32 rounding of float64
    autograd over x[index] -> per-expert loop."""
    g = gen("gathered", activation, slots, variant)
    T, E, k, H, F = 29, 6, 3, 24, 20
    r = _routing(g, T, E, k)
    d = LocalDispatcher(E).dispatch(torch.zeros(T, H), r, fuse_gather=True)
    index, counts = d.gather.index, r.tokens_per_expert
    x = torch.randn(T + 3, H, generator=g, dtype=torch.float64)  # 3 source rows no slot reads
    w_in = torch.randn(E, H, ffn_in_features(activation, F), generator=g, dtype=torch.float64) / H ** 0.5
    w_out = torch.randn(E, F, H, generator=g, dtype=torch.float64) / F ** 0.5
    slot_map = None
    if slots:  # the dispatch's slot map covers the T routed tokens; the 3 extra rows have no slots
        slot_map = torch.cat([d.gather.slots, torch.full((3 * k,), index.shape[0], dtype=torch.int64)])
    ref = _fwd_bwd(lambda a, b, c: expert_mlp_ref(a.index_select(0, index), counts, b, c, activation),
                   (x, w_in, w_out), gen("dy", 1))
    got = _fwd_bwd(lambda a, b, c: expert_mlp(a, counts, b, c, activation, variant=variant, gather_index=index,
                                              gather_slots=slot_map if variant == "fused" else None),
                   [t.float() for t in (x, w_in, w_out)], gen("dy", 1))
    for name, a, b in zip(("y", "dx", "dw_in", "dw_out"), got, ref):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=2e-5, msg=lambda m: f"{name}: {m}")
    assert got[1][T:].abs().max() == 0  # rows nobody reads get no gradient
    assert ref[1][:T].abs().sum(1).gt(0).all()  # ...while every routed token does (the check above can fail)


def test_gather_reads_zeros_for_indices_outside_the_source_and_zero_rows_past_the_counts():
    """Out-of-range gather indices read a zero row and pass nothing back; rows past sum(counts) come out 0."""
    g = gen("oob")
    T, E, H, F = 11, 3, 16, 12
    x, w_in, w_out = (torch.randn(T, H, generator=g), torch.randn(E, H, 2 * F, generator=g) / H ** 0.5,
                      torch.randn(E, F, H, generator=g) / F ** 0.5)  # unit-scale products: fp32 error stays ~1e-6
    index = torch.randint(0, T, (20,), generator=g)
    index[[2, 7, 15]] = torch.tensor([-1, T, 10 ** 9])
    counts = torch.tensor([6, 0, 11])  # 17 owned rows, 3 past them
    got = _fwd_bwd(lambda a, b, c: expert_mlp(a, counts, b, c, "swiglu", gather_index=index), (x, w_in, w_out),
                   gen("oob-dy"))
    safe = torch.where((index >= 0) & (index < T), index, T)
    x_pad = torch.cat([x.double(), torch.zeros(1, H, dtype=torch.float64)])
    ref = _fwd_bwd(lambda a, b, c: expert_mlp_ref(a.index_select(0, safe), counts, b, c, "swiglu"),
                   (x_pad, w_in.double(), w_out.double()), gen("oob-dy"))
    torch.testing.assert_close(got[0].double(), ref[0], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got[1].double(), ref[1][:T], rtol=2e-5, atol=2e-5)
    assert got[0][[2, 7, 15]].abs().max() == 0 and got[0][17:].abs().max() == 0


@pytest.mark.parametrize("slots", [True, False], ids=["slots", "sorted"])
def test_gather_from_no_rows(slots):
    """A source with no rows (an expert-parallel rank that received none): empty output, an empty gradient of the
    source, zero weight gradients; the backward's slot sum must not divide by the zero rows."""
    g = gen("empty-source", slots)
    x = torch.randn(0, 16, requires_grad=True)
    w_in, w_out = (torch.randn(3, 16, 24, generator=g).requires_grad_(), torch.randn(3, 12, 16, generator=g)
                   .requires_grad_())
    empty = torch.zeros(0, dtype=torch.int64)
    y = expert_mlp(x, torch.zeros(3, dtype=torch.int64), w_in, w_out, "swiglu", gather_index=empty,
                   gather_slots=empty if slots else None, row_scale=torch.ones(0, requires_grad=True))
    assert y.shape == (0, 16)
    (y.sum() + 0 * (w_in.sum() + w_out.sum())).backward()
    assert x.grad.shape == (0, 16) and w_in.grad.abs().max() == 0


def test_gathered_bf16_within_what_torch_gets_in_bf16():
    """bf16: the kernel's error against float64 at most twice torch's own bf16 computation of the same thing plus
    one bf16 ulp of the result's scale (the calibrated bound of tests/test_kernels.py)."""
    g = gen("bf16")
    T, E, k, H, F = 33, 5, 2, 32, 24
    r = _routing(g, T, E, k, empty=(1,))
    index = LocalDispatcher(E).dispatch(torch.zeros(T, H), r, fuse_gather=True).gather.index
    counts = r.tokens_per_expert
    x, w_in, w_out = (torch.randn(T, H, generator=g), torch.randn(E, H, 2 * F, generator=g) / H ** 0.5,
                      torch.randn(E, F, H, generator=g) / F ** 0.5)
    bf = [t.bfloat16() for t in (x, w_in, w_out)]
    ref = _fwd_bwd(lambda a, b, c: expert_mlp_ref(a.index_select(0, index), counts, b, c, "swiglu"),
                   [t.double() for t in bf], gen("bf16-dy"))
    low = _fwd_bwd(lambda a, b, c: expert_mlp_ref(a.index_select(0, index), counts, b, c, "swiglu"), bf, gen("bf16-dy"))
    got = _fwd_bwd(lambda a, b, c: expert_mlp(a, counts, b, c, "swiglu", gather_index=index), bf, gen("bf16-dy"))
    for name, a, lo, want in zip(("y", "dx", "dw_in", "dw_out"), got, low, ref):
        err, err_torch = (a.double() - want).abs().max(), (lo.double() - want).abs().max()
        assert err <= 2 * err_torch + 2 ** -8 * want.abs().max(), (name, err.item(), err_torch.item())


@pytest.mark.cover  # each value's path every run, re-paired each run (tests/conftest.py)
@pytest.mark.parametrize("activation", ["swiglu", "gelu", "relu", "swiglu_oai"])
@pytest.mark.parametrize("variant", ["fused", "plain"])
def test_row_scale_and_its_gradient_match_float64(activation, variant):
    """row_scale: each output row times its weight in the second GEMM's epilogue, the weight's gradient
    <h @ w_out, dy> from the dact kernel's epilogue (fp32 partial sums per column tile); against float64 autograd of
    the per-expert loop times the weights, rows past sum(counts) 0 with zero weight gradient."""
    g = gen("scale", activation, variant)
    E, H, F, counts = 5, 24, 40, [0, 37, 0, 50, 3]  # F 40: a partial column tile, and several partial sums per row
    N = sum(counts) + 5
    rows = torch.randn(N, H, generator=g, dtype=torch.float64)
    w_in = torch.randn(E, H, ffn_in_features(activation, F), generator=g, dtype=torch.float64) / H ** 0.5
    w_out = torch.randn(E, F, H, generator=g, dtype=torch.float64) / F ** 0.5
    scale = torch.rand(N, generator=g, dtype=torch.float64)
    c = torch.tensor(counts)
    ref = _fwd_bwd(lambda a, b, d, s: expert_mlp_ref(a, c, b, d, activation) * s[:, None], (rows, w_in, w_out, scale),
                   gen("scale-dy"))
    got = _fwd_bwd(lambda a, b, d, s: expert_mlp(a, c, b, d, activation, variant=variant, row_scale=s),
                   [t.float() for t in (rows, w_in, w_out, scale)], gen("scale-dy"))
    for name, a, b in zip(("y", "drows", "dw_in", "dw_out", "d_scale"), got, ref):
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=2e-5, msg=lambda m: f"{name}: {m}")
    assert got[4][-5:].abs().max() == 0 and ref[4][:-5].abs().min() > 0  # owned rows' gradients are real


def _biased_loop(rows, counts, w_in, w_out, b_in, b_out, activation):
    """act(rows_e @ w_in[e] + b_in[e]) @ w_out[e] + b_out[e] per expert's row block in autograd ops, rows past
    sum(counts) 0: the reference computed another way than the kernels' epilogues."""
    act = get_activation(activation)
    out, start = [], 0
    for e, c in enumerate(counts.tolist()):
        block = rows[start:start + c]
        out.append(act(block @ w_in[e] + b_in[e]) @ w_out[e] + b_out[e])
        start += c
    out.append(rows[start:] * 0)
    return torch.cat(out)


@pytest.mark.parametrize("activation", ["swiglu_oai", "gelu"])
@pytest.mark.parametrize("variant", ["fused", "plain"])
def test_row_scale_after_the_output_bias_matches_float64(activation, variant):
    """gpt-oss's experts (b_in, b_out) with the routing weights in the last GEMM: y[r] = s[r] (h[r] @ w_out + b_out);
    db_out = the rows' s-weighted column sums and the weights' gradient gains <b_out[e], dy[r]>, both from one read
    of dy (grouped_colsum's row_scale / dot_with); against float64 autograd of a per-expert loop, empty experts and
    unowned rows included."""
    g = gen("scale-bias", activation, variant)
    E, H, F, counts = 5, 24, 40, [0, 37, 0, 50, 3]
    N = sum(counts) + 5
    rows = torch.randn(N, H, generator=g, dtype=torch.float64)
    w_in = torch.randn(E, H, ffn_in_features(activation, F), generator=g, dtype=torch.float64) / H ** 0.5
    w_out = torch.randn(E, F, H, generator=g, dtype=torch.float64) / F ** 0.5
    b_in = torch.randn(E, ffn_in_features(activation, F), generator=g, dtype=torch.float64)
    b_out = torch.randn(E, H, generator=g, dtype=torch.float64)
    scale = torch.rand(N, generator=g, dtype=torch.float64)
    c = torch.tensor(counts)
    ref = _fwd_bwd(lambda a, b, d, bi, bo, s: _biased_loop(a, c, b, d, bi, bo, activation) * s[:, None],
                   (rows, w_in, w_out, b_in, b_out, scale), gen("scale-bias-dy"))
    got = _fwd_bwd(lambda a, b, d, bi, bo, s: expert_mlp(a, c, b, d, activation, variant=variant, b_in=bi, b_out=bo,
                                                         row_scale=s),
                   [t.float() for t in (rows, w_in, w_out, b_in, b_out, scale)], gen("scale-bias-dy"))
    for name, a, b in zip(("y", "drows", "dw_in", "dw_out", "db_in", "db_out", "d_scale"), got, ref):
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=2e-5, msg=lambda m: f"{name}: {m}")
    assert got[6][-5:].abs().max() == 0 and ref[6][:-5].abs().min() > 0


@pytest.mark.parametrize("bad,match", [
    (dict(gather_index=torch.zeros(4)), "int64"),
    (dict(gather_slots=torch.zeros(8, dtype=torch.int64)), "pass gather_index too"),
    (dict(gather_index=torch.zeros(6, dtype=torch.int64), gather_slots=torch.zeros(7, dtype=torch.int64)),
     "not k per source row"),
    (dict(gather_index=torch.zeros(6, dtype=torch.int64), gather_slots=torch.zeros(8, dtype=torch.int32)),
     "1-D int64"),
    (dict(row_scale=torch.ones(4, dtype=torch.float64)), "row_scale must be a contiguous float32 \\[M=4\\]"),
    (dict(row_scale=torch.ones(5)), "row_scale must be"),
])
def test_bad_gather_arguments_are_refused(bad, match):
    x, w_in, w_out = torch.randn(4, 8), torch.randn(2, 8, 6), torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=match):
        expert_mlp(x, torch.tensor([3, 3]), w_in, w_out, "swiglu", **bad)


# ---------------------------------------------------------------------------------------------------
# Layer level
# ---------------------------------------------------------------------------------------------------


def _layer(dtype, k=2, capacity_factor=None, **layer_kw) -> MoELayer:
    torch.manual_seed(0)
    router = build_router("topk", 24, 6, top_k=k, capacity_factor=capacity_factor)
    layer = MoELayer(24, 20, 6, router, backend="triton", **layer_kw).to(dtype)
    with torch.no_grad():  # biases start at 0: make them matter to the output
        for name, p in layer.experts.named_parameters():
            if name.startswith("b_"):
                p.normal_(generator=gen("bias", name))
    return layer


def _layer_run(layer, mode, monkeypatch, x):
    """(output, dx, parameter grads, bytes kept for backward) of one forward+backward under FUSED_PERMUTE=mode."""
    monkeypatch.setattr(experts, "FUSED_PERMUTE", mode)
    layer.zero_grad()
    x = x.detach().clone().requires_grad_()
    with KeptForBackward() as kept:
        y = layer(x)
    kept_bytes = kept.bytes()
    y.backward(torch.randn(y.shape, generator=gen("layer-dy"), dtype=torch.float64).to(y.dtype))
    return y.detach(), x.grad, [p.grad for p in layer.parameters()], kept_bytes


LAYER_CASES = {"dropless": {}, "capacity": dict(capacity_factor=0.6), "top4": dict(k=4),
               "bias": dict(ffn_bias=True, activation="swiglu_oai"),  # output biases scaled with their rows
               "weight_on_input": dict(k=1, weight_on_input=True), "shared": dict(shared_ffn_hidden_size=16)}


def _rows(case):
    T, k = 30, LAYER_CASES[case].get("k", 2)
    return T, k, (T * k if case != "capacity" else min(T * k, 6 * min(T, math.ceil(T * k / 6 * 0.6))))  # E x capacity


@pytest.mark.cover  # each value's path every run, re-paired each run (tests/conftest.py)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [c for c in LAYER_CASES if c != "top4"])
def test_layer_gather_alone_equals_the_permuted_rows_bitwise(monkeypatch, dtype, case):
    """The gather without the weights (a dispatcher that does not take them): at most two slots a token, which add
    the same way in both backward paths, so output, input gradient and every parameter gradient bit for bit; the
    permute never runs, and the bytes kept for backward drop by the [N, H] permuted rows (less the experts' input,
    where nothing else kept it)."""
    monkeypatch.setattr(LocalDispatcher, "fuses_weights", False)
    layer = _layer(dtype, **LAYER_CASES[case])
    x = torch.randn(2, 15, 24, generator=gen("layer", dtype, case), dtype=torch.float64).to(dtype)
    plain = _layer_run(layer, "never", monkeypatch, x)
    calls = []
    monkeypatch.setattr(dispatch, "permute", lambda *a: calls.append(1) or pytest.fail("the rows were permuted"))
    before = LAUNCHES["_expert_up_act_kernel"]
    fused = _layer_run(layer, "always", monkeypatch, x)
    assert LAUNCHES["_expert_up_act_kernel"] == before + 1 and not calls
    for name, a, b in (("y", fused[0], plain[0]), ("dx", fused[1], plain[1])):
        assert torch.equal(a, b), (name, (a - b).abs().max())
    for i, (a, b) in enumerate(zip(fused[2], plain[2])):
        assert torch.equal(a, b), (i, (a - b).abs().max())
    T, _, n_rows = _rows(case)
    new_input = T if case == "weight_on_input" else 0  # its scaled copy, which nothing else keeps
    assert plain[3] - fused[3] == (n_rows - new_input) * 24 * dtype.itemsize, (plain[3], fused[3])


@pytest.mark.cover  # each value's path every run, re-paired each run (tests/conftest.py)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_fused_permute_as_accurate_as_the_permuted_rows(monkeypatch, dtype, case):
    """The gather and the routing weights in the expert GEMMs: output, input gradient and every parameter gradient
    (the router's through the weights' gradient from the backward kernel's epilogue) against the same layer in
    float64, at most 2x the error of the permuted path plus a rounding of the result's dtype; neither the permute
    nor the weighted combine runs (output biases too: the weights scale each biased row in the epilogue, and the
    scale's gradient gains <b_out, dy> from the bias gradient's read of dy), and the bytes kept drop by the permuted
    rows and the combine's [N, H] rows, less the [N] fp32 row weights the experts keep instead of the [T, k]
    routing weights."""
    layer = _layer(dtype, **LAYER_CASES[case])
    x = torch.randn(2, 15, 24, generator=gen("layer", dtype, case), dtype=torch.float64).to(dtype)
    ref_layer = copy.deepcopy(layer).double()
    ref_layer.set_backend("loop")
    ref = _layer_run(ref_layer, "never", monkeypatch, x.double())
    plain = _layer_run(layer, "never", monkeypatch, x)
    monkeypatch.setattr(dispatch, "permute", lambda *a: pytest.fail("the rows were permuted"))
    monkeypatch.setattr(dispatch._Unpermute, "apply", lambda *a: pytest.fail("the weighted combine ran"))
    fused = _layer_run(layer, "always", monkeypatch, x)
    eps = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -22
    for i, (f, p, r) in enumerate(zip([fused[0], fused[1], *fused[2]], [plain[0], plain[1], *plain[2]],
                                      [ref[0], ref[1], *ref[2]])):
        err_f, err_p = ((t.double() - r).norm() / r.norm() for t in (f, p))
        assert err_f <= 2 * err_p + eps, (i, err_f.item(), err_p.item())
    T, k, n_rows = _rows(case)
    a = dtype.itemsize
    new_input = T * 24 * a if case == "weight_on_input" else 0
    # the permuted rows; the combine's rows, its [T, k] fp32 weights for the [N] fp32 row weights
    saved = n_rows * 24 * a - new_input + n_rows * 24 * a + T * k * 4 - n_rows * 4
    if case == "bias":  # b_out [6, 24], which the weights' gradient reads (<b_out[e], dy[r]>)
        saved -= 6 * 24 * a
    assert plain[3] - fused[3] == saved, (plain[3], fused[3], saved)


def test_switch_decides_where_the_permute_fuses(monkeypatch):
    """auto: CUDA tensors only; always: the interpreter's CPU tensors too, but only for a backend that takes it
    (the loop backend dispatches as before, and asking it to gather or scale is refused); experts with output
    biases gather and scale."""
    layer = MoELayer(16, 8, 4, "topk", backend="triton")
    rows = torch.randn(5, 16)
    for mode, want in (("never", False), ("auto", False), ("always", True)):
        monkeypatch.setattr(experts, "FUSED_PERMUTE", mode)
        assert layer.experts.takes_gather(rows) is want and layer.experts.takes_row_scale(rows) is want, mode
    biased = MoELayer(16, 8, 4, "topk", backend="triton", ffn_bias=True)
    assert biased.experts.takes_gather(rows) and biased.experts.takes_row_scale(rows)
    d = LocalDispatcher(4).dispatch(rows, layer.router(rows), fuse_gather=True)
    layer.set_backend("loop")
    assert layer.experts.takes_gather(rows) is False
    layer(rows)  # dispatches the permuted rows
    with pytest.raises(ValueError, match="cannot read rows in place"):
        layer.experts(d.rows, d.counts, gather=d.gather)
    monkeypatch.setattr(experts, "FUSED_PERMUTE", "fast")
    layer.set_backend("triton")
    with pytest.raises(ValueError, match=r"MOEKIT_FUSED_PERMUTE.*use one of auto, always, never"):
        layer.experts.takes_gather(rows)


@pytest.mark.cover  # each value's path every run, re-paired each run (tests/conftest.py)
@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("biases", [False, True], ids=["", "gpt-oss-experts"])
def test_planner_counts_what_the_fused_permute_keeps(monkeypatch, autocast, biases):
    """The memory planner's activations for a Triton-expert model (one small layer, one process) against the
    measured bytes with the switch either way: within 1.5% each (the same 3.4 KB over with the switch off or on:
    small ints and scalars, relatively large at this size), and the difference of the two exact. The [T k, H] rows go (under autocast the experts keep the one bf16
    copy of their input instead; in fp32 the block's input itself, which was kept already), and so do the
    combine's [T k, H] expert outputs (the [T k] fp32 row weights replace its [T, k] routing weights). With output
    biases the experts also keep b_out (under autocast its bf16 cast)."""
    import dataclasses

    from moekit.comm.topology import Layout
    from moekit.models.config import preset
    from moekit.train.planning.memory import Workload, estimate_memory
    from tests.test_dryrun import B, S, measure_one_process

    # one small layer: the interpreter runs every expert kernel program in numpy
    cfg = dataclasses.replace(preset("mixtral-tiny"), num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                              moe_ffn_hidden_size=32, expert_backend="triton")
    if biases:
        cfg = dataclasses.replace(cfg, moe_ffn_bias=True, activation="swiglu_oai")
    wl = Workload(B, S, "float32" if autocast is None else "bfloat16", "none", "cpu")
    measured, estimated = {}, {}
    for mode in ("never", "always"):
        monkeypatch.setattr(experts, "FUSED_PERMUTE", mode)
        measured[mode] = measure_one_process(cfg, "none", autocast=autocast, backward=False)["activations"]
        estimated[mode] = estimate_memory(cfg, Layout(), wl).activations
        assert estimated[mode] == pytest.approx(measured[mode], rel=0.015), (mode, estimated, measured)
    saved = measured["never"] - measured["always"]
    assert estimated["never"] - estimated["always"] == saved, (estimated, measured)
    T, H, k = B * S, cfg.hidden_size, cfg.top_k
    a = 2 if autocast else 4
    # the rows and the combine's expert outputs, less the input copy; the [T k] row weights for the routing weights
    bias = cfg.num_experts * H * a if biases and autocast else 0
    assert saved == 2 * T * k * H * a - (T * H * a if autocast else 0) - bias, saved


def test_layer_benchmark_times_the_fused_permute(tmp_path, capsys):
    """tools/bench/moe_layer.py: the moekit[triton+fused] peer (the same output as moekit[triton] to rounding, less
    kept for backward) and, where the layer's experts take it, the experts_fused + combine_sum phases beside the
    permute + experts + combine they replace."""
    import json

    from moekit.bench import moe_layer
    from moekit.bench.layer_probes import phase_steps

    out = tmp_path / "layer.json"
    assert moe_layer.main(["--tokens", "48", "--hidden", "16", "--shapes", "16x4x2", "--backends", "triton",
                           "--hf-impl", "--peers", "fused", "--repeats", "1", "--warmup", "0", "--out",
                           str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {r["impl"]: r for r in res["results"]}
    fused, plain = rows["moekit[triton+fused]"], rows["moekit[triton]"]
    assert fused["rel_err_vs_fp32"] < 1e-6 and fused["grad_rel_err_vs_fp32"] < 1e-6
    assert abs(fused["rel_err_vs_fp32"] - plain["rel_err_vs_fp32"]) < 1e-6
    mem = res["cases"][0]["activation_bytes"]
    assert mem["moekit[triton+fused]"]["saved_tensors_bytes"] < mem["moekit[triton]"]["saved_tensors_bytes"]
    assert "moekit[triton+fused]" in capsys.readouterr().out
    layer = MoELayer(16, 16, 4, "topk", backend="triton")
    steps = phase_steps(layer, torch.randn(12, 16, generator=gen("phase")))
    assert {"experts_fused", "combine_sum"} <= steps.keys()
    steps["experts_fused"]()
    assert layer.experts.w_in.grad is not None and layer.experts.w_in.grad.abs().sum() > 0
    layer.set_backend("loop")
    assert "experts_fused" not in phase_steps(layer, torch.randn(12, 16))


def _ep_rank(rank, world, E, k, tokens, per_node=None):
    """One rank of a flat EP layer on the Triton experts (``per_node``: hierarchical, nodes of that many ranks, the
    fused permute in its intra-node exchange): switch off, the gather alone (the received rows' reorder in the up
    kernel: a permutation either way, so the same output and gradients bit for bit), and the weights too (sent with
    the rows, applied in the last GEMM: within fp32 rounding, the weighted combine never runs); counted reorders
    show which copies were made."""
    import copy

    from moekit.comm import expert_parallel as EP
    from moekit.comm.expert_parallel import FlatEPDispatcher, apply_expert_parallel
    from moekit.comm.topology import Layout, Topology

    from moekit.comm.hierarchical import HierarchicalEPDispatcher

    topo = Topology(Layout(dp=world, ep=world), rank, per_node or world).build()
    torch.manual_seed(3)
    ref = MoELayer(24, 20, E, build_router("topk", 24, E, top_k=k), backend="triton")
    runs = {}
    for name, mode, weights in (("off", "never", True), ("gather", "always", False), ("fused", "always", True)):
        experts.FUSED_PERMUTE = mode
        FlatEPDispatcher.fuses_weights = HierarchicalEPDispatcher.fuses_weights = weights
        layer = copy.deepcopy(ref)
        apply_expert_parallel(layer, topo, hierarchical=per_node is not None)
        assert isinstance(layer.dispatcher, HierarchicalEPDispatcher) == (per_node is not None)
        calls, real, real_unpermute = [], EP._Reorder.apply, EP.unpermute
        EP._Reorder.apply = lambda *a: calls.append(1) or real(*a)
        EP.unpermute = lambda rows, meta, weighted=True: (weighted and name == "fused" and pytest.fail(
            "weighted combine")) or real_unpermute(rows, meta, weighted)
        try:
            x = torch.randn(tokens, 24, generator=gen("ep", rank)).requires_grad_()
            y = layer(x)
            y.backward(torch.randn(y.shape, generator=gen("ep-dy", rank)))
        finally:
            EP._Reorder.apply, EP.unpermute = real, real_unpermute
        assert len(calls) == (2 if mode == "never" else 1), (name, calls)  # dispatch's and combine's; combine's
        runs[name] = (y.detach(), x.grad, layer.experts.w_in.grad.to_local(), layer.experts.w_out.grad.to_local(),
                      layer.router.weight.grad)
    FlatEPDispatcher.fuses_weights = HierarchicalEPDispatcher.fuses_weights = True
    for a, b in zip(runs["gather"], runs["off"]):
        assert torch.equal(a, b), (a - b).abs().max()
    for a, b in zip(runs["fused"], runs["off"]):
        # the weight applied before the down GEMM's sum instead of after it: fp32 rounding of the summed terms,
        # which scales with the tensor's largest values, not with each element (a near-zero output may cancel
        # terms of ~1: a fixed atol of 1e-6 failed by 3.9e-6 on one session's inputs, none of 39 seeds tried after)
        scale = float(b.abs().max().clamp(min=1.0))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("world,per_node", [(2, None), (4, 2)], ids=["flat-2", "hierarchical-2x2"])
def test_expert_parallel_permute_fused_into_the_experts(world, per_node):
    """Expert parallelism over gloo ranks (interpreted Triton experts), flat over 2 and hierarchical over 2 nodes of
    2: the intra-node step 4's reorder of the received rows happens in the up kernel's loads, and the routing
    weights, sent with the rows (across the rail, then inside the node), in the last GEMM's epilogue."""
    from tests.dist_utils import run_ranks

    run_ranks(_ep_rank, world, 4, 2, 9, per_node, env={"TRITON_INTERPRET": "1"})


def _planner_ep_rank(rank, world, per_node):
    """Expert parallelism over ``world`` ranks in nodes of ``per_node`` (2 x 2: hierarchical), one small
    Triton-expert layer: the kept bytes with the switch off minus on, measured, against the planner's difference.
    They differ only by the [R] fp32 row weights, whose count the planner takes as balanced (R = T k) while each
    rank computes the rows routed to it."""
    import dataclasses

    from moekit.comm.topology import Layout, Topology
    from moekit.models.config import preset
    from moekit.models.parallelize import parallelize
    from moekit.models.transformer import build_model
    from moekit.train.planning.memory import Workload, estimate_memory
    from tests.test_dryrun import B, S, measure

    cfg = dataclasses.replace(preset("mixtral-tiny"), num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                              moe_ffn_hidden_size=32, expert_backend="triton")
    layout = Layout(ep=world, dp=world)
    topo = Topology(layout, rank, ranks_per_node=per_node).build()
    g = torch.Generator().manual_seed(topo.data_rank())
    tokens, targets = (torch.randint(0, cfg.vocab_size, (B, S), generator=g) for _ in range(2))
    kept, est, rows = {}, {}, []
    for mode in ("never", "always"):
        experts.FUSED_PERMUTE = mode
        model = build_model(cfg, seed=0)
        parallelize(model, topo, hierarchical=per_node < world)
        model.train()
        hook = model.layers[0].ffn.experts.register_forward_pre_hook(lambda m, a: rows.append(int(a[1].sum())))
        kept[mode] = measure(model, tokens, targets, backward=False)["activations"]
        hook.remove()
        est[mode] = estimate_memory(cfg, layout, Workload(B, S, "float32", "none", "cpu"), ranks_per_node=per_node,
                                    hierarchical=per_node < world).activations
    T, k, H = B * S, cfg.top_k, cfg.hidden_size
    measured, estimated = kept["never"] - kept["always"], est["never"] - est["always"]
    assert estimated == T * k * H * 4, estimated  # the combine's [T k, H] rows; the row weights for the weights
    # the combine kept its [T k, H] rows back from the experts (this rank's tokens'); the fused experts keep an fp32
    # weight for each of the R rows they computed (the planner's T k on average over the ranks) instead of the
    # [T, k] routing weights
    R = rows[0]
    assert rows == [R, R]
    if per_node == world:
        assert measured == T * k * H * 4 - R * 4 + T * k * 4, (measured, R, T * k)
        return
    # hierarchical: the inner combine keeps the rows back to its sources, the (token, node) rows this rank received
    # on the rail, and their [R1, k] weights; summed over the ranks those rows are every token's k slots (dropless),
    # so the planner's per-rank T k H is exact on average, up to the weights' bytes (R1 <= T m)
    import torch.distributed as dist

    total = torch.tensor([float(measured)])
    dist.all_reduce(total)
    assert abs(total.item() - world * estimated) <= world * T * k * 4 * 2, (total.item(), world * estimated)


@pytest.mark.parametrize("world,per_node", [(2, 2), (4, 2)], ids=["flat-2", "hierarchical-2x2"])
def test_planner_counts_the_weights_fused_under_expert_parallelism(world, per_node):
    from tests.dist_utils import run_ranks

    run_ranks(_planner_ep_rank, world, per_node, env={"TRITON_INTERPRET": "1"})
