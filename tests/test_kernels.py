"""CPU tests of moe.kernels in the Triton interpreter.

Triton 3.9 decides interpreter mode when ``triton`` is first imported (its tl.* library functions are
decorated then), so this module sets TRITON_INTERPRET=1 before importing triton, then restores the
variable and re-sets it per test with an autouse fixture: other test modules in the same pytest run
keep their environment (moe.kernels' CPU path also needs the variable set at call time).
Shapes stay tiny (the interpreter runs every program in numpy); blocks are 32x32x16 there, so the
sizes below (K=40, N=36, groups of 5/17/33 rows) exercise partial M, N and K tiles.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

_PREV_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
import triton  # noqa: E402,F401  (first import decides the mode: see the module docstring)

import pytest
import torch

import moekit.moe.kernels as K
from moekit.moe.activations import ACTIVATIONS, ffn_in_features, get_activation
from moekit.moe.kernels import expert_mlp, expert_mlp_ref, grouped_mm, grouped_mm_ref, why_not_triton
import importlib

grouped_mm_module = importlib.import_module("moekit.moe.kernels.grouped_mm")

if _PREV_INTERPRET is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _PREV_INTERPRET

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not K.interpret_mode():
        pytest.fail("triton was imported in compiled mode before this module set TRITON_INTERPRET=1; "
                    "run `TRITON_INTERPRET=1 pytest tests/test_kernels.py`")
    torch.set_num_threads(min(2, os.cpu_count() or 1))


def _offs(counts) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)


def _fwd_bwd(fn, inputs, seed=123):
    """(y, grads...) of fn(*inputs) against a fixed random cotangent (drawn in fp64, then cast)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).to(y.dtype)
    if not y.requires_grad:  # the reference loop builds no graph when no expert owns a row
        return [y.detach()] + [torch.zeros_like(t) for t in leaves]
    y.backward(g)
    return [y.detach()] + [t.grad for t in leaves]


def _max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


# Ragged layouts: (counts, extra unowned rows past sum(counts)).
LAYOUTS = {
    "ragged": ([5, 0, 33, 17, 0, 40], 6),
    "first_and_last_empty": ([0, 50, 31, 0], 0),
    "all_rows_in_one_expert": ([0, 0, 77, 0], 3),
    "single_expert": ([70], 0),
    "many_experts": ([9, 0, 3, 14, 0, 0, 21, 1, 7, 0, 16, 5, 0, 12, 2, 0], 4),
    "m_zero": ([0, 0, 0], 0),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grouped_mm_fp32_matches_float64(layout):
    counts, extra = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(len(counts) * 101 + extra)
    m, k, n = sum(counts) + extra, 40, 36
    x = torch.randn(m, k, generator=gen, dtype=torch.float64)
    w = torch.randn(len(counts), k, n, generator=gen, dtype=torch.float64)
    offs = _offs(counts)
    before = K.LAUNCHES["_grouped_mm_kernel"]
    got = _fwd_bwd(lambda a, b: grouped_mm(a, b, offs), (x.float(), w.float()))
    ref = _fwd_bwd(lambda a, b: grouped_mm_ref(a, b, offs), (x, w))
    for name, g, r in zip(("y", "dx", "dw"), got, ref):
        assert g.dtype == torch.float32 and g.shape == r.shape, name
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-4, msg=lambda s: f"{layout} {name}: {s}")
    if extra:  # rows nobody owns: zero output, zero gradient
        assert got[0][-extra:].abs().max() == 0 and got[1][-extra:].abs().max() == 0
    for e, c in enumerate(counts):  # empty experts get an exactly-zero weight gradient
        if c == 0:
            assert got[2][e].abs().max() == 0
    if m:
        assert K.LAUNCHES["_grouped_mm_kernel"] >= before + 2  # fwd + dX ran in Triton


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_mm_low_precision_within_torch_error(dtype):
    """err(kernel) <= 2 * err(torch's own per-expert loop in the same dtype) + atol, vs float64."""
    counts = [0, 45, 8, 0, 61, 19, 0]
    gen = torch.Generator().manual_seed(7)
    m, k, n = sum(counts) + 2, 48, 40
    x = torch.randn(m, k, generator=gen, dtype=torch.float64)
    w = torch.randn(len(counts), k, n, generator=gen, dtype=torch.float64) / k**0.5
    offs = _offs(counts)
    lo = (x.to(dtype).double(), w.to(dtype).double())  # the exact inputs both sides see
    ref = _fwd_bwd(lambda a, b: grouped_mm_ref(a, b, offs), lo)
    got = _fwd_bwd(lambda a, b: grouped_mm(a, b, offs), [t.to(dtype) for t in lo])
    torch_lo = _fwd_bwd(lambda a, b: grouped_mm_ref(a, b, offs), [t.to(dtype) for t in lo])
    for name, g, r, t in zip(("y", "dx", "dw"), got, ref, torch_lo):
        assert g.dtype == dtype
        err, err_torch = _max_err(g, r), _max_err(t, r)
        assert err <= 2 * err_torch + 1e-3 * r.abs().max().item(), f"{name}: {err} vs torch {err_torch}"


def test_gather_matches_explicit_index_and_is_deterministic():
    gen = torch.Generator().manual_seed(3)
    m_x, k, n = 50, 40, 36
    x = torch.randn(m_x, k, generator=gen)
    w = torch.randn(4, k, n, generator=gen)
    # top-2 style: most rows routed twice, a few never (their dx must be zero), plus unowned tail rows
    gather_index = torch.cat([torch.arange(0, 45), torch.arange(0, 45)])[torch.randperm(90, generator=gen)]
    offs = _offs([30, 0, 41, 15])  # 86 owned logical rows out of 90
    got = _fwd_bwd(lambda a, b: grouped_mm(a, b, offs, gather_index), (x, w))
    explicit = _fwd_bwd(lambda a, b: grouped_mm(a[gather_index], b, offs), (x, w))
    ref = _fwd_bwd(lambda a, b: grouped_mm_ref(a, b, offs, gather_index), (x.double(), w.double()))
    for name, g, e, r in zip(("y", "dx", "dw"), got, explicit, ref):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-4, msg=lambda s: f"{name} vs explicit: {s}")
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-4, msg=lambda s: f"{name} vs fp64: {s}")
    assert got[1][45:].abs().max() == 0
    again = _fwd_bwd(lambda a, b: grouped_mm(a, b, offs, gather_index), (x, w))
    for g, a in zip(got, again):
        assert torch.equal(g, a), "forward/backward must be bitwise reproducible"


def test_scatter_add_rows_fixed_order_and_drops_out_of_range():
    gen = torch.Generator().manual_seed(11)
    src = torch.randn(40, 36, generator=gen)
    index = torch.randint(0, 12, (40,), generator=gen)
    index[[3, 17]] = torch.tensor([-1, 99])  # dropped, as in the reference
    out = K.scatter_add_rows(src, index, 15)
    ref = K.scatter_add_rows_ref(src.double(), index, 15)
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-5)
    assert out[12:].abs().max() == 0  # rows nobody points at
    assert torch.equal(out, K.scatter_add_rows(src, index, 15))


EXPERT_COUNTS = [0, 37, 0, 50, 3]  # first and middle experts empty, 3-row group


def _mlp_inputs(activation, dtype=torch.float64, seed=0, hidden=24, ffn=20, extra=5):
    gen = torch.Generator().manual_seed(seed)
    f_in = ffn_in_features(activation, ffn)
    e = len(EXPERT_COUNTS)
    rows = torch.randn(sum(EXPERT_COUNTS) + extra, hidden, generator=gen, dtype=torch.float64)
    w_in = torch.randn(e, hidden, f_in, generator=gen, dtype=torch.float64) / hidden**0.5
    w_out = torch.randn(e, ffn, hidden, generator=gen, dtype=torch.float64) / ffn**0.5
    return [t.to(dtype) for t in (rows, w_in, w_out)]


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_expert_mlp_fused_matches_plain_and_float64(activation):
    counts = torch.tensor(EXPERT_COUNTS)
    inputs = _mlp_inputs(activation)
    ref = _fwd_bwd(lambda r, a, b: expert_mlp_ref(r, counts, a, b, activation), inputs)
    f32 = [t.float() for t in inputs]
    fused = _fwd_bwd(lambda r, a, b: expert_mlp(r, counts, a, b, activation, variant="fused"), f32)
    plain = _fwd_bwd(lambda r, a, b: expert_mlp(r, counts, a, b, activation, variant="plain"), f32)
    for name, f, p, r in zip(("y", "drows", "dw_in", "dw_out"), fused, plain, ref):
        torch.testing.assert_close(f, p, rtol=1e-5, atol=1e-5, msg=lambda s: f"{activation} {name} fused/plain: {s}")
        torch.testing.assert_close(f.double(), r, rtol=1e-5, atol=1e-5, msg=lambda s: f"{activation} {name}: {s}")
    assert fused[0][-5:].abs().max() == 0 and fused[1][-5:].abs().max() == 0
    with torch.no_grad():  # inference: the fused kernel skips writing pre
        torch.testing.assert_close(expert_mlp(*f32[:1], counts, *f32[1:], activation), fused[0], rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_table_drives_every_backend(name):
    """One table entry, every consumer: the fused epilogues (ACT = kernel_code, hard-coded in Triton), the
    kernels' plain variant and reference, and GroupedExperts' loop and torch backends all compute the
    oracle built from the entry's ``unit``, ``up_fn`` and ``gated`` (an entry whose kernel_code names another
    epilogue, or whose fn disagrees with unit/gated, fails here)."""
    from moekit.moe import experts

    act = get_activation(name)
    counts = torch.tensor(EXPERT_COUNTS)
    inputs = _mlp_inputs(name, seed=11)  # float64

    def oracle(rows, w_in, w_out):  # per-expert loop from unit / gated alone
        out, start = [], 0
        for e, n in enumerate(EXPERT_COUNTS):
            h = rows[start:start + n] @ w_in[e]
            if act.gated:
                gate, up = h.chunk(2, dim=-1)
                h = act.unit(gate) * act.up_fn(up)  # up_fn: identity but for swiglu_oai's clamp + 1
            else:
                h = act.unit(h)
            out.append(h @ w_out[e])
            start += n
        return torch.cat(out + [rows.new_zeros(rows.shape[0] - start, w_out.shape[-1])])

    want = _fwd_bwd(oracle, inputs)
    f32 = [t.float() for t in inputs]
    backends = {
        "fused": lambda r, a, b: expert_mlp(r, counts, a, b, name, variant="fused"),
        "plain": lambda r, a, b: expert_mlp(r, counts, a, b, name, variant="plain"),
        "kernel reference": lambda r, a, b: expert_mlp_ref(r, counts, a, b, name),
        "loop": lambda r, a, b: experts.loop_mlp(r, counts, a, b, name),
    }
    if experts._grouped_mm_why_not(*f32) == "":
        backends["torch"] = lambda r, a, b: experts.torch_grouped_mlp(r, counts, a, b, name)
    owned = sum(EXPERT_COUNTS)
    for backend, fn in backends.items():
        for what, g, w in zip(("y", "drows", "dw_in", "dw_out"), _fwd_bwd(fn, f32), want):
            if backend == "torch" and what == "drows":  # grouped_mm leaves d rows past offs[-1] unwritten
                g, w = g[:owned], w[:owned]
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{name} {backend} {what}: {m}")
    if name == "gelu":  # the exact erf form, as the kernel epilogue computes it (not the tanh approximation)
        x = torch.linspace(-4, 4, 101, dtype=torch.float64)
        torch.testing.assert_close(act(x), 0.5 * x * (1 + torch.erf(x / math.sqrt(2))), rtol=0, atol=1e-12)


def test_unknown_activation_is_refused_listing_the_known_ones():
    from moekit.moe.experts import GroupedExperts
    from moekit.moe.layer import DenseMLP

    x, w = torch.randn(10, 8), torch.randn(2, 8, 4)
    for build in (lambda: get_activation("tanh"), lambda: GroupedExperts(2, 8, 4, activation="tanh"),
                  lambda: DenseMLP(8, 4, "tanh"), lambda: expert_mlp(x, torch.tensor([4, 6]), w, w.mT, "tanh")):
        with pytest.raises(ValueError) as info:
            build()
        msg = str(info.value)
        assert "activation='tanh'" in msg and all(repr(n) in msg for n in ACTIVATIONS), msg


def test_expert_mlp_fused_bf16_within_torch_error():
    counts = torch.tensor(EXPERT_COUNTS)
    lo = [t.to(torch.bfloat16).double() for t in _mlp_inputs("swiglu", seed=5)]
    ref = _fwd_bwd(lambda r, a, b: expert_mlp_ref(r, counts, a, b, "swiglu"), lo)
    bf = [t.to(torch.bfloat16) for t in lo]
    torch_lo = _fwd_bwd(lambda r, a, b: expert_mlp_ref(r, counts, a, b, "swiglu"), bf)
    for variant in ("fused", "plain"):
        got = _fwd_bwd(lambda r, a, b: expert_mlp(r, counts, a, b, "swiglu", variant=variant), bf)
        for name, g, r, t in zip(("y", "drows", "dw_in", "dw_out"), got, ref, torch_lo):
            err, err_torch = _max_err(g, r), _max_err(t, r)
            assert err <= 2 * err_torch + 1e-3 * r.abs().max().item(), f"{variant} {name}: {err} vs {err_torch}"


@pytest.mark.parametrize("trainable", [(False, False, True), (True, False, False), (False, True, False)])
def test_expert_mlp_fused_partial_grads(trainable):
    """Only the needed gradients are computed, and each matches the float64 reference."""
    counts = torch.tensor(EXPERT_COUNTS)
    inputs = _mlp_inputs("swiglu", seed=9)
    ref = _fwd_bwd(lambda r, a, b: expert_mlp_ref(r, counts, a, b, "swiglu"), inputs)
    leaves = [t.float().requires_grad_(flag) for t, flag in zip(inputs, trainable)]
    y = expert_mlp(*leaves[:1], counts, *leaves[1:], "swiglu")
    g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(123)).float()
    before = dict(K.LAUNCHES)
    y.backward(g)
    for leaf, flag, r in zip(leaves, trainable, ref[1:]):
        if flag:
            torch.testing.assert_close(leaf.grad.double(), r, rtol=1e-5, atol=1e-5)
        else:
            assert leaf.grad is None
    ran_dact = K.LAUNCHES["_expert_down_dact_kernel"] > before.get("_expert_down_dact_kernel", 0)
    assert ran_dact == (trainable[0] or trainable[1])  # w_out alone needs no dh GEMM


def test_triton_path_runs_not_the_fallback(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the torch fallback ran")

    monkeypatch.setattr(grouped_mm_module, "grouped_mm_ref", boom)
    x, w, offs = torch.randn(40, 16), torch.randn(2, 16, 32), _offs([25, 15])
    before = K.LAUNCHES["_grouped_mm_kernel"]
    y = grouped_mm(x, w, offs)
    assert K.LAUNCHES["_grouped_mm_kernel"] == before + 1
    torch.testing.assert_close(y, torch.cat([x[:25] @ w[0], x[25:] @ w[1]]), rtol=1e-5, atol=1e-5)


def test_grouped_experts_triton_backend_matches_loop():
    from moekit.moe.experts import GroupedExperts

    torch.manual_seed(0)
    mod = GroupedExperts(4, 24, 20, activation="swiglu", backend="triton")
    rows, counts = torch.randn(60, 24), torch.tensor([20, 0, 33, 7])
    y = mod(rows, counts)
    mod.backend = "loop"
    torch.testing.assert_close(y, mod(rows, counts), rtol=1e-5, atol=1e-5)


def test_why_not_triton_messages(monkeypatch):
    x = torch.randn(4, 8)
    w_in, w_out = torch.randn(2, 8, 6), torch.randn(2, 3, 8)
    assert why_not_triton(x, w_in, w_out) == ""
    msg = why_not_triton(x.double(), w_in.double(), w_out.double())
    assert "float64" in msg and "float32/bfloat16/float16" in msg
    assert "one dtype" in why_not_triton(x, w_in.half(), w_out)
    assert "meta" in why_not_triton(x.to("meta"), w_in.to("meta"), w_out.to("meta"))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "CUDA device or TRITON_INTERPRET=1" in why_not_triton(x, w_in, w_out)


def test_clear_errors():
    x, w, offs = torch.randn(10, 8), torch.randn(2, 8, 4), _offs([4, 6])
    cases = [
        (lambda: grouped_mm(x, torch.randn(2, 9, 4), offs), "K must match"),
        (lambda: grouped_mm(x, w, _offs([10])), "offs must be [E=2]"),
        (lambda: grouped_mm(x, w, offs.float()), "integer"),
        (lambda: grouped_mm(x, w, offs, torch.arange(10, dtype=torch.int32)), "int64"),
        (lambda: grouped_mm(x, w, offs, backend="cuda"), "backend='cuda' is unknown"),
        (lambda: grouped_mm(x.double(), w.double(), offs, backend="triton"), "float64"),
        (lambda: expert_mlp(x, offs.long(), w, torch.randn(2, 2, 8), "tanh"), "activation='tanh'"),
        (lambda: expert_mlp(x, offs.long(), w, torch.randn(2, 2, 8), "swiglu", variant="x"), "variant='x'"),
        (lambda: expert_mlp(x, offs.long(), w, torch.randn(2, 3, 8), "swiglu"), "want w_in [E, H, 6]"),
        (lambda: expert_mlp(x, offs.long()[:1], w, torch.randn(2, 2, 8), "swiglu"), "counts must be"),
    ]
    for fn, needle in cases:
        with pytest.raises(ValueError, match=None) as info:
            fn()
        assert needle in str(info.value), (needle, str(info.value))
    # float64 under backend="auto" is not an error: it takes the torch fallback
    torch.testing.assert_close(grouped_mm(x.double(), w.double(), offs), grouped_mm_ref(x.double(), w.double(), offs))


@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
def test_operand_errors_are_the_same_on_every_backend(backend):
    """Mixed dtypes or devices, and bad offs, are one ValueError labelled by the public function whichever backend
    would run (the auto path used to fall back to the torch loop and fail there with a RuntimeError)."""
    x, w, offs = torch.randn(10, 8), torch.randn(2, 8, 4), _offs([4, 6])
    cases = [
        (lambda: grouped_mm(x, w.bfloat16(), offs, backend=backend),
         "grouped_mm: all tensors must share one dtype, got x torch.float32 and w torch.bfloat16"),
        (lambda: grouped_mm(x.half(), w, offs, backend=backend), "grouped_mm: all tensors must share one dtype"),
        (lambda: grouped_mm(x, w.to("meta"), offs, backend=backend), "grouped_mm: all tensors must be on one device"),
        (lambda: grouped_mm(x, w, _offs([10]), backend=backend), "grouped_mm: offs must be [E=2]"),
        (lambda: grouped_mm(x, w, offs.float(), backend=backend), "grouped_mm: offs must be an integer tensor"),
        (lambda: grouped_mm(x.tolist(), w, offs, backend=backend), "grouped_mm: x must be a tensor, got list"),
    ]
    for fn, needle in cases:
        with pytest.raises(ValueError) as info:
            fn()
        assert needle in str(info.value) and "(Triton)" not in str(info.value), (needle, str(info.value))


def test_cpu_without_interpreter_uses_torch_fallback():
    """Subprocess (triton imported without TRITON_INTERPRET): the torch fallback, and clear refusals."""
    code = textwrap.dedent(
        """
        import os, torch
        import moekit.moe.kernels as K
        x, w = torch.randn(30, 16), torch.randn(3, 16, 8)
        offs = torch.tensor([10, 10, 27], dtype=torch.int32)
        ref = K.grouped_mm_ref(x.double(), w.double(), offs)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = K.grouped_mm(xg, wg, offs)
        y.sum().backward()
        assert (y.double() - ref).abs().max() < 1e-4 and y[27:].abs().max() == 0
        assert (wg.grad[1] == 0).all() and (xg.grad[27:] == 0).all()
        assert "CUDA device or TRITON_INTERPRET=1" in K.why_not_triton(x, w, w)
        try:
            K.expert_mlp(x, torch.tensor([10, 0, 17]), torch.randn(3, 16, 8), torch.randn(3, 4, 16), "swiglu")
            raise SystemExit("expert_mlp should refuse without Triton")
        except ValueError as exc:
            assert "TRITON_INTERPRET=1" in str(exc), exc
        os.environ["TRITON_INTERPRET"] = "1"  # too late: triton is already in compiled mode
        assert "before the first `import triton`" in K.why_not_triton(x, w, w)
        y2 = K.grouped_mm(x, w, offs)
        assert sum(K.LAUNCHES.values()) == 0, K.LAUNCHES
        assert (y2.double() - ref).abs().max() < 1e-4
        print("OK")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "2")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr

