"""The Triton delta-rule scan (moe/kernels/delta_scan.py) and gated_delta_rule's kernel path, on CPU in the Triton
interpreter.

Two references: the torch loop over the chunks (TRITON_SCAN = "never", same float32 chunk terms: the kernels change
only the order of the scan's sums, so the two agree to a few float32 ulps of the values' scale) and the float64
recurrence position by position (gated_delta_steps: float32 against float64, bounded by a tolerance of 1e-4 on
O(1) values, the loop's own error being ~1e-6). In the interpreter the column tile is 16, so dv = 32 runs two tiles
and the backward's partial sums over them; L, dk and dv that are not powers of two (or below 16) run padded.

The module-level TRITON_INTERPRET handling is test_kernels.py's (see its docstring).
"""
from __future__ import annotations

import importlib
import os

_PREV_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
importlib.import_module("triton")  # the first import decides the mode: see the module docstring

import pytest
import torch

import moekit.moe.kernels as K
from moekit.models import delta_rule as dr
from moekit.models.delta_rule import RecomputedRule, gated_delta_rule, gated_delta_steps, l2_normalize
from moekit.moe.kernels.delta_scan import delta_scan, delta_scan_ref
from tests.helpers import gen

if _PREV_INTERPRET is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _PREV_INTERPRET

FWD, BWD = "_delta_scan_fwd_kernel", "_delta_scan_bwd_kernel"


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not K.interpret_mode():
        pytest.fail("triton was imported in compiled mode before this module set TRITON_INTERPRET=1; "
                    "run `TRITON_INTERPRET=1 pytest tests/test_delta_scan.py`")
    monkeypatch.setattr(dr, "TRITON_SCAN", "always")
    monkeypatch.setattr(dr, "_BUILD_FAILURE", [])
    torch.set_num_threads(min(2, os.cpu_count() or 1))


def _inputs(B, S, N, dk, dv, key, state=True, docs=False):
    g = gen("delta_scan", B, S, N, dk, dv, *key)
    q = l2_normalize(torch.randn(B, S, N, dk, generator=g, dtype=torch.float64)) * dk ** -0.5
    k = l2_normalize(torch.randn(B, S, N, dk, generator=g, dtype=torch.float64))
    v = torch.randn(B, S, N, dv, generator=g, dtype=torch.float64)
    decay = -torch.rand(B, S, N, generator=g, dtype=torch.float64) * 2
    beta = torch.rand(B, S, N, generator=g, dtype=torch.float64)
    s0 = torch.randn(B, N, dk, dv, generator=g, dtype=torch.float64) if state else None
    segments = None
    if docs:  # documents of random lengths, one of them crossing a chunk boundary
        cuts = torch.rand(B, S, generator=g) < 0.15
        cuts[:, 0] = False
        segments = cuts.cumsum(1)
    return [q, k, v, decay, beta], s0, segments


def _grads(fn, inputs, s0, segments, want_state, key):
    """(o, final state or None, grads of q, k, v, g, beta and s0) of fn's outputs against fixed random weights."""
    xs = [t.detach().clone().requires_grad_() for t in inputs]
    s = s0.detach().clone().requires_grad_() if s0 is not None else None
    o, fin = fn(*xs, s, segments)
    g = gen("weights", *key)
    loss = (o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)).sum()
    if want_state:
        loss = loss + (fin * torch.randn(fin.shape, generator=g, dtype=torch.float64).to(fin.dtype)).sum()
    wrt = xs + ([s] if s is not None else [])
    return o.detach(), (fin.detach() if fin is not None else None), torch.autograd.grad(loss, wrt)


def _close(got, want, tol):
    want = want.to(got.dtype) if got.dtype != want.dtype else want
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want.to(got.dtype), rtol=0, atol=tol * scale)


def _rule(chunk, final_state):
    return lambda q, k, v, g, b, s, seg: gated_delta_rule(q, k, v, g, b, s, chunk=chunk, final_state=final_state,
                                                          segments=seg)


def _steps(q, k, v, g, b, s, seg):
    return gated_delta_steps(q, k, v, g, b, s, seg)


CASES = [  # B, S, N, dk, dv, chunk, initial state, documents
    (1, 37, 2, 16, 32, 16, True, False),  # ragged last chunk, two column tiles
    (2, 12, 2, 16, 16, 16, False, False),  # one chunk only (L = S = 12: padded to 16), no state
    (1, 40, 2, 32, 16, 16, True, True),  # documents
    (2, 21, 2, 12, 20, 8, True, False),  # dk, dv, L neither powers of two nor >= 16 (padded)
]


@pytest.mark.parametrize("B,S,N,dk,dv,chunk,state,docs", CASES)
def test_rule_matches_loop_and_recurrence(monkeypatch, B, S, N, dk, dv, chunk, state, docs):
    """Forward o and final state, gradients of q, k, v, g, beta (and the initial state) through gated_delta_rule
    with its final state in the loss: the kernels against the float32 loop and the float64 recurrence."""
    key = (B, S, N, dk, dv, chunk, state, docs)
    inputs, s0, seg = _inputs(B, S, N, dk, dv, key, state, docs)
    f32 = [t.float() for t in inputs]
    s32 = s0.float() if s0 is not None else None
    before = (K.LAUNCHES[FWD], K.LAUNCHES[BWD])
    o, fin, grads = _grads(_rule(chunk, True), f32, s32, seg, True, key)
    assert (K.LAUNCHES[FWD], K.LAUNCHES[BWD]) == (before[0] + 1, before[1] + 1)  # the kernels ran, once each
    monkeypatch.setattr(dr, "TRITON_SCAN", "never")
    lo, lfin, lgrads = _grads(_rule(chunk, True), f32, s32, seg, True, key)
    assert (K.LAUNCHES[FWD], K.LAUNCHES[BWD]) == (before[0] + 1, before[1] + 1)  # "never": the loop
    ro, rfin, rgrads = _grads(_steps, inputs, s0, seg, True, key)
    assert o.dtype == fin.dtype == torch.float32 and o.shape == ro.shape
    for got, loop, ref in zip((o, fin, *grads), (lo, lfin, *lgrads), (ro, rfin, *rgrads)):
        _close(got, loop, 2e-5)
        _close(got, ref, 1e-4)


@pytest.mark.parametrize("docs", [False, True])
def test_recomputed_rule_matches_loop(monkeypatch, docs):
    """Training's path: RecomputedRule (no final state, no initial state) runs the forward kernel without saving
    states and, in backward, the forward (saving them) and the backward kernel."""
    B, S, N, dk, dv, chunk = 2, 30, 2, 16, 32, 16
    key = ("recomputed", docs)
    inputs, _, seg = _inputs(B, S, N, dk, dv, key, state=False, docs=docs)
    f32 = [t.float() for t in inputs]

    def fn(q, k, v, g, b, s, seg):
        return RecomputedRule.apply(q, k, v, g, b, chunk, seg), None

    before = (K.LAUNCHES[FWD], K.LAUNCHES[BWD])
    o, _, grads = _grads(fn, f32, None, seg, False, key)
    assert (K.LAUNCHES[FWD], K.LAUNCHES[BWD]) == (before[0] + 2, before[1] + 1)
    monkeypatch.setattr(dr, "TRITON_SCAN", "never")
    lo, _, lgrads = _grads(fn, f32, None, seg, False, key)
    ro, _, rgrads = _grads(_steps, inputs, None, seg, False, key)
    for got, loop, ref in zip((o, *grads), (lo, *lgrads), (ro, *rgrads)):
        _close(got, loop, 2e-5)
        _close(got, ref, 1e-4)


def test_without_final_state_and_without_grad():
    """final_state=False returns None; under no_grad only the forward kernel runs (no states saved); the outputs are
    those of the run with a final state."""
    inputs, s0, _ = _inputs(1, 20, 2, 16, 16, ("nograd",))
    f32 = [t.float() for t in inputs]
    with torch.no_grad():
        before = (K.LAUNCHES[FWD], K.LAUNCHES[BWD])
        o, none = gated_delta_rule(*f32, s0.float(), chunk=16, final_state=False)
        o2, fin = gated_delta_rule(*f32, s0.float(), chunk=16)
        assert (K.LAUNCHES[FWD], K.LAUNCHES[BWD]) == (before[0] + 2, before[1])
    assert none is None and torch.equal(o, o2)
    want_o, want_s = gated_delta_steps(*inputs, s0)
    _close(o, want_o, 1e-4)
    _close(fin, want_s, 1e-4)


def test_scan_gradients_of_every_term():
    """delta_scan itself against its torch loop in float64 autograd, the final state's gradient included: all seven
    inputs' gradients (chunk terms and initial state) over several chunks and two column tiles."""
    g = gen("terms")
    B, N, n, L, dk, dv = 1, 2, 3, 16, 16, 32
    shapes = [(B, N, n, L, dv), (B, N, n, L, dk), (B, N, n, L, dk), (B, N, n, L, L), (B, N, n, L, dk), (B, N, n),
              (B, N, dk, dv)]
    ts = [torch.randn(s, generator=g, dtype=torch.float64) * 0.3 for s in shapes]
    ts[3] = ts[3].tril()
    ts[5] = torch.rand(shapes[5], generator=g, dtype=torch.float64)
    ts = [t.requires_grad_() for t in ts]
    f32 = [t.detach().float().requires_grad_() for t in ts]
    o, fin = delta_scan(*f32)
    ro, rfin = delta_scan_ref(*ts)
    w_o, w_s = torch.randn(ro.shape, generator=g, dtype=torch.float64), torch.randn(rfin.shape, generator=g,
                                                                                   dtype=torch.float64)
    got = torch.autograd.grad((o * w_o.float()).sum() + (fin * w_s.float()).sum(), f32)
    want = torch.autograd.grad((ro * w_o).sum() + (rfin * w_s).sum(), ts)
    _close(o, ro, 1e-5)
    _close(fin, rfin, 1e-5)
    for a, b in zip(got, want):
        _close(a, b, 1e-5)


def test_modes(monkeypatch):
    """"auto" on CPU runs the loop (no launch); "always" without TRITON_INTERPRET raises, saying why; float64 runs
    the loop whatever the mode; an unknown mode is refused."""
    inputs, s0, _ = _inputs(1, 20, 2, 16, 16, ("modes",))
    f32 = [t.float() for t in inputs]
    before = (K.LAUNCHES[FWD], K.LAUNCHES[BWD])
    gated_delta_rule(*inputs, s0, chunk=16)  # float64 under "always": the loop
    monkeypatch.setattr(dr, "TRITON_SCAN", "auto")
    gated_delta_rule(*f32, s0.float(), chunk=16)
    assert (K.LAUNCHES[FWD], K.LAUNCHES[BWD]) == before
    monkeypatch.setattr(dr, "TRITON_SCAN", "always")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_SCAN='always'.*TRITON_INTERPRET"):
        gated_delta_rule(*f32, s0.float(), chunk=16)
    monkeypatch.setattr(dr, "TRITON_SCAN", "sometimes")
    assert "MOEKIT_DELTA_SCAN" in dr.delta_scan_problem()
    with pytest.raises(ValueError, match="invalid"):
        gated_delta_rule(*f32, s0.float(), chunk=16)


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_a_kernel_that_fails_to_build_falls_back_to_the_loop(monkeypatch, which):
    """"auto": the forward kernel failing to build runs the loop; the backward one failing (the forward built)
    differentiates the loop over the saved chunk starts. Either way one warning, the same outputs and gradients as
    the loop, and the loop from the next call on; "always" raises the build error instead."""
    from tests.helpers import BrokenLauncher

    DS = importlib.import_module("moekit.moe.kernels.delta_scan")  # the module (the package exports the function)

    key = ("broken", which)
    inputs, s0, _ = _inputs(1, 40, 2, 16, 16, key)
    f32, s32 = [t.float() for t in inputs], s0.float()
    monkeypatch.setattr(dr, "TRITON_SCAN", "never")
    want = _grads(_rule(16, True), f32, s32, None, True, key)
    monkeypatch.setattr(DS, "DELTA_SCAN_FWD" if which == "forward" else "DELTA_SCAN_BWD", BrokenLauncher())
    monkeypatch.setattr(dr, "TRITON_SCAN", "always")
    with pytest.raises(Exception, match="simulated"):
        _grads(_rule(16, True), f32, s32, None, True, key)
    monkeypatch.setattr(dr, "TRITON_SCAN", "auto")
    # "auto" as on a GPU (on CPU it never takes the kernels): until a build failure is remembered
    monkeypatch.setattr(dr, "_scan_path", lambda x: not dr._BUILD_FAILURE)
    what = "Triton delta-rule scan" if which == "forward" else "backward delta-rule scan kernel"
    with pytest.warns(UserWarning, match=f"the {what} failed to build here.*simulated"):
        got = _grads(_rule(16, True), f32, s32, None, True, key)
    for a, b in zip((got[0], got[1], *got[2]), (want[0], want[1], *want[2])):
        _close(a, b, 2e-5)
    assert dr._BUILD_FAILURE  # remembered: the next call takes the loop, no launch and no warning
    before = (K.LAUNCHES[FWD], K.LAUNCHES[BWD])
    _grads(_rule(16, True), f32, s32, None, True, key)
    assert (K.LAUNCHES[FWD], K.LAUNCHES[BWD]) == before
