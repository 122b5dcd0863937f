"""The combine kernels (moe/kernels/combine.py) and moe.dispatch's Triton path, on CPU in the Triton interpreter.

The reference is computed another way: float64 einsums over an explicit one-hot [T, k, N] of the slot
layout (out = w . A . rows, grad_rows = w . A . grad_out, grad_w = A . rows . grad_out), on the same
(rounded) inputs. Bounds are the rounding the kernels are allowed: one rounding of the result to its
dtype (2**-8 relative for bf16, 2**-24 for fp32) plus fp32 accumulation, n_terms * 2**-24 of the sum of
the terms' magnitudes. Routings come from the real router and LocalDispatcher (sort_slots): ragged, with
empty experts, and capacity-limited with dropped slots (the pad index N).

The module-level TRITON_INTERPRET handling is test_kernels.py's (see its docstring). Shapes stay tiny
(T <= 48, H <= 80: the interpreter runs every program in numpy); its tiles are 256 elements with
BLOCK_H <= 32, so H = 80 has a partial column tile and T = 45 a partial token block.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_PREV_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
import triton  # noqa: E402,F401  (first import decides the mode: see the module docstring)

import pytest
import torch

import moekit.moe.kernels as K
from moekit.moe import dispatch
from moekit.moe.dispatch import LocalDispatcher, sort_slots
from moekit.moe.kernels.combine import (combine_rows, combine_rows_backward, combine_rows_backward_ref,
                                        combine_rows_ref)
from moekit.moe.router import Routing, build_router
from tests.helpers import gen as _gen

if _PREV_INTERPRET is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _PREV_INTERPRET

REPO = Path(__file__).resolve().parents[1]
FWD, BWD = "_combine_fwd_kernel", "_combine_bwd_kernel"
F32_EPS = 2.0 ** -24


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not K.interpret_mode():
        pytest.fail("triton was imported in compiled mode before this module set TRITON_INTERPRET=1; "
                    "run `TRITON_INTERPRET=1 pytest tests/test_combine_kernel.py`")
    torch.set_num_threads(min(2, os.cpu_count() or 1))


def _routing(gen, T: int, E: int, k: int, capacity_factor: float | None, empty=(0, 3)) -> Routing:
    """A top-k routing with experts ``empty`` never chosen (ragged counts with empty experts) and, with a
    capacity factor, slots dropped (-1) by the router's capacity."""
    router = build_router("topk", 8, E, top_k=k, capacity_factor=capacity_factor)
    logits = torch.randn(T, E, generator=gen)
    logits[:, list(empty)] = -30.0
    return router.route(logits)


def _meta(gen, T, E, k, capacity_factor):
    r = _routing(gen, T, E, k, capacity_factor)
    return LocalDispatcher(E).dispatch(torch.zeros(T, 1), r).meta


def _one_hot(slot_row: torch.Tensor, T: int, k: int, N: int) -> torch.Tensor:
    """[T, k, N] float64: A[t, j, r] = 1 where slot (t, j) names row r in [0, N); any other index is no row."""
    idx = slot_row.view(T, k)
    valid = (idx >= 0) & (idx < N)
    a = torch.zeros(T, k, N + 1, dtype=torch.float64)
    a.scatter_(2, torch.where(valid, idx, N)[..., None], 1.0)
    return a[..., :N]


def _einsum_ref(rows, w, slot_row, g, T, k):
    """(out, grad_rows, grad_w) in float64 and the same of the magnitudes (for the accumulation bound)."""
    a = _one_hot(slot_row, T, k, rows.shape[0])
    rows, g = rows.double(), g.double()
    w = torch.ones(T, k, dtype=torch.float64) if w is None else w.double()
    ref = (torch.einsum("tj,tjn,nh->th", w, a, rows), torch.einsum("tj,tjn,th->nh", w, a, g),
           torch.einsum("tjn,nh,th->tj", a, rows, g))
    w, rows, g = w.abs(), rows.abs(), g.abs()
    mag = (torch.einsum("tj,tjn,nh->th", w, a, rows), torch.einsum("tj,tjn,th->nh", w, a, g),
           torch.einsum("tjn,nh,th->tj", a, rows, g))
    return ref, mag


def _assert_rounded(name, got, ref, mag, n_terms):
    """|got - ref| <= one rounding to got.dtype + fp32 accumulation of n_terms terms (elementwise)."""
    unit = {torch.float32: F32_EPS, torch.bfloat16: 2.0 ** -8}[got.dtype]
    err = (got.double() - ref).abs()
    bound = unit * ref.abs() + n_terms * F32_EPS * mag + 1e-30
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"{name}: error {worst:.3g}x the bound (max err {err.max().item():.3g})"


def _run_kernels(rows, w, slot_row, g, T, k):
    out = combine_rows(rows, slot_row, w, T, k)
    grad_rows, grad_w = combine_rows_backward(g, rows, w, slot_row)
    return out, grad_rows, grad_w


# (k, capacity factor, rows dtype, weights dtype). Dropless routings have a row per slot; capacity-limited
# ones pad dropped slots to N; experts 0 and 3 are empty in both.
CASES = [
    (1, None, torch.float32, torch.float32),
    (2, 0.6, torch.float32, torch.float32),
    (6, None, torch.float32, torch.float32),
    (8, 0.5, torch.float32, torch.float32),
    (1, 0.7, torch.bfloat16, torch.float32),
    (2, None, torch.bfloat16, torch.float32),  # autocast's mix: bf16 expert outputs, fp32 router weights
    (6, 0.8, torch.bfloat16, torch.float32),
    (8, None, torch.bfloat16, torch.bfloat16),
]


@pytest.mark.parametrize("k,capacity_factor,dtype,w_dtype", CASES,
                         ids=[f"k{c[0]}-{'cap' if c[1] else 'dropless'}-{str(c[2])[6:]}-w{str(c[3])[6:]}"
                              for c in CASES])
def test_combine_and_both_grads_match_float64_one_hot(k, capacity_factor, dtype, w_dtype):
    T, E, H = 45, 12, 80
    gen = _gen("one_hot", k, capacity_factor, dtype, w_dtype)
    meta = _meta(gen, T, E, k, capacity_factor)
    N = meta.row_slot.shape[0]
    if capacity_factor is not None:
        assert N < T * k and bool((meta.slot_row == N).any()), "the capacity must drop slots"
    rows = torch.randn(N, H, generator=gen).to(dtype)
    w = meta.weights.to(w_dtype)
    g = torch.randn(T, H, generator=gen).to(dtype)
    out, grad_rows, grad_w = _run_kernels(rows, w, meta.slot_row, g, T, k)
    (r_out, r_rows, r_w), (m_out, m_rows, m_w) = _einsum_ref(rows, w, meta.slot_row, g, T, k)
    assert out.dtype == grad_rows.dtype == dtype and grad_w.dtype == w_dtype
    _assert_rounded("out", out, r_out, m_out, k + 1)
    _assert_rounded("grad_rows", grad_rows, r_rows, m_rows, 1)
    _assert_rounded("grad_w", grad_w, r_w, m_w, H + 1)
    # the pure-torch references in the kernel module agree too
    ref_rows, ref_w = combine_rows_backward_ref(g, rows, w, meta.slot_row)
    _assert_rounded("combine_rows_ref", combine_rows_ref(rows, meta.slot_row, w, T, k), r_out, m_out, k + 1)
    _assert_rounded("combine_rows_backward_ref grad_rows", ref_rows, r_rows, m_rows, 1)
    _assert_rounded("combine_rows_backward_ref grad_w", ref_w, r_w, m_w, H + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_unweighted_sum_is_the_permute_backward(dtype):
    """weights None: grad_x[t] = sum_j grad_rows[row of (t, j)], against index_add_ over row_slot in float64."""
    T, E, k, H = 40, 10, 6, 48
    gen = _gen("unweighted", dtype)
    meta = _meta(gen, T, E, k, 0.7)
    N = meta.row_slot.shape[0]
    grad_rows = torch.randn(N, H, generator=gen).to(dtype)
    got = combine_rows(grad_rows, meta.slot_row, None, T, k)
    ref = torch.zeros(T, H, dtype=torch.float64).index_add_(0, meta.row_slot // k, grad_rows.double())
    mag = torch.zeros(T, H, dtype=torch.float64).index_add_(0, meta.row_slot // k, grad_rows.double().abs())
    _assert_rounded("grad_x", got, ref, mag, k)


def test_hostile_indices_contribute_zero_and_read_nothing_outside():
    """Negative, >= N and huge indices are no row: they contribute 0, get grad_w 0, write nothing, and
    never read outside rows (NaN guard rows around it) nor their weight (NaN there).

    In a subprocess, as tests/test_kernel_bounds.py does: an index that did reach an address would
    corrupt the interpreter's heap, and that must fail this test, not kill pytest."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    code = "import tests.test_combine_kernel as m; m.hostile_case(); print('OK')"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, f"exit {proc.returncode}\n{proc.stdout}{proc.stderr[-3000:]}"


def hostile_case():
    """The body of the test above (runs in the subprocess)."""
    T, k, N, H = 24, 5, 30, 40
    gen = _gen("hostile")
    buf = torch.full((N + 2, H), float("nan"))
    buf[1:N + 1] = torch.randn(N, H, generator=gen)
    rows = buf[1:N + 1]  # a view: reading row -1 or N would pick up NaN
    hostile = torch.tensor([-1, -2, N, N + 1, 2 ** 40, 2 ** 62, -(2 ** 63), 2 ** 63 - 1, -(2 ** 31), 2 ** 31])
    slot_row = hostile[torch.randint(0, len(hostile), (T * k,), generator=gen)]
    named = torch.randperm(T * k, generator=gen)[:N - 4]  # distinct valid rows for most slots, 4 rows unnamed
    slot_row[named] = torch.randperm(N, generator=gen)[:N - 4]
    valid = (slot_row >= 0) & (slot_row < N)
    w = torch.randn(T, k, generator=gen)
    w.view(-1)[~valid] = float("nan")  # an invalid slot's weight must not be read either
    g = torch.randn(T, H, generator=gen)
    out = combine_rows(rows, slot_row, w, T, k)
    grad_rows, grad_w = combine_rows_backward(g, rows, w, slot_row, zero_fill_rows=True)
    (r_out, r_rows, r_w), (m_out, m_rows, m_w) = _einsum_ref(rows, torch.where(valid.view(T, k), w, 0.0),
                                                             slot_row, g, T, k)
    assert torch.isfinite(out).all() and torch.isfinite(grad_rows).all() and torch.isfinite(grad_w).all()
    _assert_rounded("out", out, r_out, m_out, k + 1)
    _assert_rounded("grad_rows", grad_rows, r_rows, m_rows, 1)
    _assert_rounded("grad_w", grad_w, r_w, m_w, H + 1)
    assert (grad_w.view(-1)[~valid] == 0).all()
    unnamed = torch.ones(N, dtype=torch.bool)
    unnamed[slot_row[valid]] = False
    assert int(unnamed.sum()) == 4 and (grad_rows[unnamed] == 0).all()
    unweighted = combine_rows(rows, slot_row, None, T, k)
    assert torch.isfinite(unweighted).all()


def test_empty_shapes_launch_nothing():
    H, k = 16, 3
    rows = torch.randn(7, H)
    launches = K.LAUNCHES[FWD] + K.LAUNCHES[BWD]
    # T = 0: no tokens; every row is no slot's, so its gradient is 0
    empty_w = torch.zeros(0, k)
    no_slots = torch.zeros(0, dtype=torch.int64)
    assert combine_rows(rows, no_slots, empty_w, 0, k).shape == (0, H)
    gr, gw = combine_rows_backward(torch.zeros(0, H), rows, empty_w, no_slots)
    assert gr.shape == (7, H) and (gr == 0).all() and gw.shape == (0, k)
    # N = 0: every slot is dropped (index 0 = N is the pad)
    w = torch.rand(4, k)
    pad = torch.zeros(4 * k, dtype=torch.int64)
    out = combine_rows(torch.zeros(0, H), pad, w, 4, k)
    assert out.shape == (4, H) and (out == 0).all()
    gr, gw = combine_rows_backward(torch.randn(4, H), torch.zeros(0, H), w, pad)
    assert gr.shape == (0, H) and gw.shape == (4, k) and (gw == 0).all()
    # H = 0
    slots = torch.randint(0, 7, (4 * k,))
    assert combine_rows(rows[:, :0], slots, w, 4, k).shape == (4, 0)
    gr, gw = combine_rows_backward(torch.zeros(4, 0), rows[:, :0], w, slots)
    assert gr.shape == (7, 0) and (gw == 0).all()
    assert K.LAUNCHES[FWD] + K.LAUNCHES[BWD] == launches  # no launch on an empty grid


def test_two_runs_are_bitwise_equal():
    T, E, k, H = 32, 12, 8, 48
    gen = _gen("determinism")
    meta = _meta(gen, T, E, k, 0.6)
    rows = torch.randn(meta.row_slot.shape[0], H, generator=gen).bfloat16()
    g = torch.randn(T, H, generator=gen).bfloat16()
    a = _run_kernels(rows, meta.weights, meta.slot_row, g, T, k)
    b = _run_kernels(rows, meta.weights, meta.slot_row, g, T, k)
    for name, x, y in zip(("out", "grad_rows", "grad_w"), a, b):
        assert torch.equal(x, y), name


def test_many_slots_loop_over_slot_chunks():
    """k > 16 (expert choice's [T, E] layout, mostly -1): the forward's slot loop and the backward's
    chunks of 16 slots."""
    T, E, H = 12, 20, 36
    gen = _gen("many slots")
    taken = torch.rand(T, E, generator=gen) < 0.3
    indices = torch.where(taken, torch.arange(E).expand(T, E), -1)
    row_slot, slot_row = sort_slots(indices, int(taken.sum()))
    N = row_slot.shape[0]
    rows = torch.randn(N, H, generator=gen)
    w = torch.where(taken, torch.rand(T, E, generator=gen), 0.0)
    g = torch.randn(T, H, generator=gen)
    out, grad_rows, grad_w = _run_kernels(rows, w, slot_row, g, T, E)
    (r_out, r_rows, r_w), (m_out, m_rows, m_w) = _einsum_ref(rows, w, slot_row, g, T, E)
    _assert_rounded("out", out, r_out, m_out, E + 1)
    _assert_rounded("grad_rows", grad_rows, r_rows, m_rows, 1)
    _assert_rounded("grad_w", grad_w, r_w, m_w, H + 1)


def test_grad_rows_zero_filled_where_rows_outnumber_slots():
    """N > T*k: some rows are no slot's; their gradient is 0 without being asked (and with zero_fill_rows)."""
    T, k, N, H = 5, 2, 14, 8
    gen = _gen("outnumber")
    slot_row = torch.randperm(N, generator=gen)[:T * k]
    rows, w, g = torch.randn(N, H, generator=gen), torch.rand(T, k, generator=gen), torch.randn(T, H, generator=gen)
    gr, _ = combine_rows_backward(g, rows, w, slot_row, need_grad_weights=False)
    (_, r_rows, _), (_, m_rows, _) = _einsum_ref(rows, w, slot_row, g, T, k)
    _assert_rounded("grad_rows", gr, r_rows, m_rows, 1)


def test_arguments_are_checked_with_the_fix_named():
    rows, w = torch.randn(6, 8), torch.rand(3, 2)
    slots = torch.arange(6)
    cases = [
        (lambda: combine_rows(rows, slots.int(), w, 3, 2), "use .reshape(-1).long()"),
        (lambda: combine_rows(rows, slots[:5], w, 3, 2), "num_tokens * top_k = 3 * 2 = 6"),
        (lambda: combine_rows(rows, slots, w[:, :1], 3, 2), "weights must be [T, k] = [3, 2]"),
        (lambda: combine_rows(rows, slots, w, 3, 0), "top_k=0 must be an int >= 1"),
        (lambda: combine_rows(rows.double(), slots, w, 3, 2), "use float32/bfloat16/float16"),
        (lambda: combine_rows(rows, slots, w.double(), 3, 2), "weights dtype torch.float64"),
        (lambda: combine_rows_backward(torch.randn(3, 7), rows, w, slots), "grad_out must be [T, H] = [3, 8]"),
    ]
    for fn, needle in cases:
        with pytest.raises(ValueError) as info:
            fn()
        assert needle in str(info.value), (needle, str(info.value))


# ---------------------------------------------------------------------------------------------------
# moe.dispatch on its Triton path (TRITON_COMBINE="always") against its CPU path
# ---------------------------------------------------------------------------------------------------


def _dispatch_fwd_bwd(x0, w0, routing, E, wrt=("x", "w")):
    """out and the grads of (x, weights) through permute -> a per-row scaling (the 'experts') -> combine."""
    x = x0.clone().requires_grad_("x" in wrt)
    w = w0.clone().requires_grad_("w" in wrt)
    r = Routing(routing.indices, w, routing.tokens_per_expert, routing.aux_loss, capacity=routing.capacity)
    disp = LocalDispatcher(E)
    d = disp.dispatch(x, r)
    scale = torch.linspace(0.5, 1.5, d.rows.shape[0], dtype=torch.float64).to(x.dtype)[:, None]
    out = disp.combine(d.rows * scale, d.meta)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    inputs = [t for t in (x, w) if t.requires_grad]
    return (out.detach(), *torch.autograd.grad(out, inputs, g))


@pytest.mark.parametrize("k,capacity_factor,dtype", [(1, None, torch.float32), (2, 0.6, torch.float32),
                                                     (6, None, torch.float32), (8, 0.5, torch.bfloat16)],
                         ids=["k1-dropless-f32", "k2-cap-f32", "k6-dropless-f32", "k8-cap-bf16"])
def test_dispatch_triton_path_matches_the_cpu_path(monkeypatch, k, capacity_factor, dtype):
    T, E, H = 36, 12, 40
    gen = _gen("dispatch", k, capacity_factor, dtype)
    routing = _routing(gen, T, E, k, capacity_factor)
    x0 = torch.randn(T, H, generator=gen).to(dtype)
    w0 = routing.weights.to(dtype)
    cpu = _dispatch_fwd_bwd(x0, w0, routing, E)
    before = dict(K.LAUNCHES)
    monkeypatch.setattr(dispatch, "TRITON_COMBINE", "always")
    tri = _dispatch_fwd_bwd(x0, w0, routing, E)
    # combine forward + permute backward (the forward kernel without weights), combine backward
    assert K.LAUNCHES[FWD] == before.get(FWD, 0) + 2 and K.LAUNCHES[BWD] == before.get(BWD, 0) + 1
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for name, a, b in zip(("out", "grad_x", "grad_w"), tri, cpu):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name}: {m}")


def test_dispatch_triton_path_honours_needs_input_grad(monkeypatch):
    """Only x, or only the weights, need a gradient: the kernel skips the other output."""
    T, E, k, H = 20, 8, 2, 24
    gen = _gen("needs_input_grad")
    routing = _routing(gen, T, E, k, None, empty=(1,))
    x0, w0 = torch.randn(T, H, generator=gen), routing.weights
    for wrt in (("x",), ("w",)):
        cpu = _dispatch_fwd_bwd(x0, w0, routing, E, wrt)
        monkeypatch.setattr(dispatch, "TRITON_COMBINE", "always")
        tri = _dispatch_fwd_bwd(x0, w0, routing, E, wrt)
        monkeypatch.setattr(dispatch, "TRITON_COMBINE", "auto")
        for a, b in zip(tri, cpu):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_double_backward_takes_the_torch_path(monkeypatch):
    """create_graph=True: the backward runs differentiable torch ops (no kernel), so a second derivative
    through the combine is what the CPU path gives."""
    T, E, k, H = 16, 6, 2, 12
    gen = _gen("double backward")
    routing = _routing(gen, T, E, k, 0.8, empty=(2,))
    g = torch.randn(T, H, generator=gen)

    def second_order():
        disp = LocalDispatcher(E)
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(3), requires_grad=True)
        w = routing.weights.clone().requires_grad_()
        r = Routing(routing.indices, w, routing.tokens_per_expert, routing.aux_loss, capacity=routing.capacity)
        d = disp.dispatch(x, r)
        out = disp.combine(d.rows * d.rows, d.meta)
        gx, gw = torch.autograd.grad(out, (x, w), g, create_graph=True)
        return torch.autograd.grad((gx * gx).sum() + (gw * gw).sum(), (x, w))

    cpu = second_order()
    monkeypatch.setattr(dispatch, "TRITON_COMBINE", "always")
    bwd_before = K.LAUNCHES[BWD]
    tri = second_order()
    assert K.LAUNCHES[BWD] == bwd_before  # the graph-building backward ran no kernel
    for a, b in zip(tri, cpu):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_dispatch_switch_refuses_what_it_cannot_run(monkeypatch):
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    routing = Routing(torch.tensor([[0], [1], [1], [0]]), torch.ones(4, 1, dtype=torch.float64),
                      torch.tensor([2, 2]), torch.zeros(()))
    disp = LocalDispatcher(2)
    monkeypatch.setattr(dispatch, "TRITON_COMBINE", "always")
    d = disp.dispatch(x, routing)
    with pytest.raises(ValueError, match="TRITON_COMBINE='always'.*float32/bfloat16/float16"):
        disp.combine(d.rows, d.meta)
    monkeypatch.setattr(dispatch, "TRITON_COMBINE", "sometimes")
    with pytest.raises(ValueError, match="use one of auto, always, never"):
        disp.combine(d.rows, d.meta)
    monkeypatch.setattr(dispatch, "TRITON_COMBINE", "never")
    torch.testing.assert_close(disp.combine(d.rows, d.meta), x.detach())


def test_dispatch_triton_path_empty_batch(monkeypatch):
    monkeypatch.setattr(dispatch, "TRITON_COMBINE", "always")
    empty = Routing(torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2, requires_grad=True),
                    torch.zeros(4, dtype=torch.long), torch.zeros(()), capacity=3)
    x = torch.zeros(0, 8, requires_grad=True)
    disp = LocalDispatcher(4)
    d = disp.dispatch(x, empty)
    out = disp.combine(d.rows * 2, d.meta)
    gx, gw = torch.autograd.grad(out.sum(), (x, empty.weights))
    assert out.shape == (0, 8) and gx.shape == (0, 8) and gw.shape == (0, 2)


def test_a_kernel_that_cannot_be_built_falls_back_to_torch_once_with_a_warning(monkeypatch):
    """A Triton version whose compiler rejects the kernel (or a GPU that cannot hold its config) must not
    stop training: moe.dispatch warns once, records why for these dtypes, and runs its torch combine;
    TRITON_COMBINE='always' raises instead. Simulated on CPU: the kernel path is chosen, the launcher raises."""
    from triton.compiler.errors import CompilationError

    from moekit.moe import dispatch
    from moekit.moe.kernels import combine

    def broken(*args, **kwargs):
        raise CompilationError("kernel.py", None, "unsupported op in this Triton")

    gen = _gen("fallback")
    routing = _routing(gen, 24, 6, 2, None)
    x = torch.randn(24, 16, generator=gen, requires_grad=True)
    cot = torch.randn(24, 16, generator=gen)
    disp = dispatch.LocalDispatcher(6)

    def run():
        d = disp.dispatch(x, routing)
        out = disp.combine(d.rows * 1.5, d.meta)
        return (out, *torch.autograd.grad(out, x, cot))

    monkeypatch.setattr(dispatch, "TRITON_COMBINE", "never")
    ref = run()
    monkeypatch.setattr(combine, "combine_rows", broken)
    monkeypatch.setattr(combine, "combine_rows_backward", broken)
    monkeypatch.setattr(dispatch, "TRITON_COMBINE", "auto")
    monkeypatch.setattr(dispatch, "_triton_combine", lambda rows, weights=None: True)  # as on a GPU
    monkeypatch.setattr(dispatch, "_COMBINE_OK", {})
    with pytest.warns(UserWarning, match="failed to build here.*CompilationError.*torch combine runs instead"):
        got = run()
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the torch path itself
    assert any("CompilationError" in v for v in dispatch._COMBINE_OK.values())  # later calls skip the kernel
    monkeypatch.setattr(dispatch, "TRITON_COMBINE", "always")
    with pytest.raises(CompilationError):
        run()
