"""Out-of-range offsets, counts and gather indices: every kernel and backend is memory-safe and agrees.

The semantics under test (moe/kernels/_common.py, docs/kernels.md): expert e owns rows
end[e-1]:end[e] with end[e] = clamp(max(offs[:e+1]), 0, M), rows past end[E-1] come out 0 with zero
gradient; a gather index outside [0, M_x) reads a zero row and passes no gradient back; for the expert
MLP a negative count is 0 and the row blocks stop at N. The oracle builds those bounds and the
valid-index mask explicitly (numpy / Python ints) and runs plain per-expert float64 matmuls.

Malformed offsets used to corrupt the interpreter's heap, so every Triton launch on them runs in one
process of its own (``_run_triton_cases``, under a ``torch.empty`` that fills outputs with NaN, so a row a
kernel leaves unwritten fails the comparison): a regression fails these tests instead of killing
pytest. The module-level TRITON_INTERPRET handling is test_kernels.py's (see its docstring).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import zlib
from itertools import accumulate
from pathlib import Path

_PREV_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
import triton  # noqa: E402,F401  (first import decides the mode: see the module docstring)

import numpy as np
import pytest
import torch

import moekit.moe.kernels as K
from moekit.moe import experts
from moekit.moe.activations import ffn_in_features, get_activation
from moekit.moe.kernels import (expert_mlp, expert_mlp_ref, grouped_mm, grouped_mm_ref, grouped_mm_wgrad,
                                grouped_mm_wgrad_ref)

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
                    "run `TRITON_INTERPRET=1 pytest tests/test_kernel_bounds.py`")
    torch.set_num_threads(min(2, os.cpu_count() or 1))


# Tiny shapes; the interpreter's 32x32x16 blocks still get partial M, N and K tiles.
M, M_X, K_DIM, N_DIM, E = 40, 30, 24, 20, 4  # grouped_mm: logical rows, rows of x (gathered), K, N, experts
ROWS, HIDDEN, FFN = 40, 24, 20  # expert MLP (swiglu)

OFFS_CASES = {  # name: (offs, dtype)
    "valid": ([10, 10, 25, 36], torch.int32),
    "negative": ([-5, 12, 30, 40], torch.int32),
    "all_negative": ([-3, -1, -7, -100], torch.int32),
    "non_monotone": ([20, 8, 35, 30], torch.int32),
    "past_m": ([10, 50, 1000, 3], torch.int32),
    "short": ([5, 5, 20, 22], torch.int32),  # offs[-1] < M: 18 unowned rows
    "int64_huge": ([7, 2**32 + 5, -2**40, 2**33], torch.int64),  # an int32 wrap would read 2**32 + 5 as 5
}
COUNTS_CASES = {
    "negative_count": [10, -5, 20, 7],
    "past_n": [15, 30, 20, 5],
    "short": [3, 0, 12, 5],
    "huge": [4, 2**62, 2**62, -1],  # an unclamped int64 cumsum overflows
    "all_negative": [-1, -2, -3, -4],
}
MM_KEYS = [(case, gather) for case in OFFS_CASES for gather in (False, True)]


def _gen(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def mm_inputs(case: str, gather: bool) -> dict:
    offs, dtype = OFFS_CASES[case]
    gen = _gen(f"mm/{case}/{gather}")
    x = torch.randn(M_X if gather else M, K_DIM, generator=gen)
    out = dict(x=x, w=torch.randn(E, K_DIM, N_DIM, generator=gen), offs=torch.tensor(offs, dtype=dtype),
               dy=torch.randn(M, N_DIM, generator=gen), gather_index=None)
    if gather:  # mostly valid, plus negative, == M_x and far-out indices spread over the rows
        idx = torch.randint(-6, M_X + 6, (M,), generator=gen)
        idx[[0, 9, 17, 26, 33]] = torch.tensor([-1, M_X, -(2**40), 2**40, M_X - 1])
        out["gather_index"] = idx
    return out


def mm_oracle(inp: dict):
    """(y, dx, dw) in float64 numpy: explicit clamped bounds, explicit gather mask, per-expert matmuls."""
    x, w, dy = (inp[k].double().numpy() for k in ("x", "w", "dy"))
    ends = [min(max(end, 0), M) for end in accumulate(inp["offs"].tolist(), max)]  # running max, clipped
    starts = [0] + ends[:-1]
    idx = inp["gather_index"]
    idx = np.arange(M) if idx is None else idx.numpy()
    valid = (idx >= 0) & (idx < x.shape[0])
    a = np.zeros((M, K_DIM))
    a[valid] = x[idx[valid]]
    y, da, dw = np.zeros((M, N_DIM)), np.zeros((M, K_DIM)), np.zeros((E, K_DIM, N_DIM))
    for e, (s, t) in enumerate(zip(starts, ends)):
        y[s:t] = a[s:t] @ w[e]
        da[s:t] = dy[s:t] @ w[e].T
        dw[e] = a[s:t].T @ dy[s:t]
    dx = np.zeros_like(x)
    np.add.at(dx, idx[valid], da[valid])
    return [torch.from_numpy(t) for t in (y, dx, dw)]


def mlp_inputs(case: str) -> dict:
    gen = _gen(f"mlp/{case}")
    f_in = ffn_in_features("swiglu", FFN)
    return dict(rows=torch.randn(ROWS, HIDDEN, generator=gen),
                w_in=torch.randn(E, HIDDEN, f_in, generator=gen) / HIDDEN**0.5,
                w_out=torch.randn(E, FFN, HIDDEN, generator=gen) / FFN**0.5,
                counts=torch.tensor(COUNTS_CASES[case], dtype=torch.int64),
                dy=torch.randn(ROWS, HIDDEN, generator=gen))


def mlp_oracle(inp: dict):
    """(y, drows, dw_in, dw_out) in float64: bounds from Python ints, one explicit block per expert."""
    ends = [min(end, ROWS) for end in accumulate(max(c, 0) for c in inp["counts"].tolist())]
    rows, w_in, w_out, dy = (inp[k].double() for k in ("rows", "w_in", "w_out", "dy"))
    y, drows = torch.zeros_like(rows), torch.zeros_like(rows)
    dw_in, dw_out = torch.zeros_like(w_in), torch.zeros_like(w_out)
    act = get_activation("swiglu")
    for e, (s, t) in enumerate(zip([0] + ends[:-1], ends)):
        xe, wi, wo = (v.clone().requires_grad_() for v in (rows[s:t], w_in[e], w_out[e]))
        ye = act(xe @ wi) @ wo
        ye.backward(dy[s:t])
        y[s:t], drows[s:t], dw_in[e], dw_out[e] = ye.detach(), xe.grad, wi.grad, wo.grad
    return [y, drows, dw_in, dw_out]


def fwd_bwd(fn, leaves, dy):
    """(out, grads...) of fn(*leaves) against cotangent dy; a grad autograd never reached is zeros."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    y = fn(*leaves)
    if y.requires_grad:
        y.backward(dy.to(y.dtype))
    return [y.detach()] + [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]


def assert_matches(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Close to the float64 oracle, and exactly 0 wherever the oracle is (unowned rows, dropped gathers,
    empty experts: random data never gives an exact 0 elsewhere). NaN (an unwritten poisoned row) fails."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4, msg=lambda m: f"{what}: {m}")
    assert (got[want == 0] == 0).all(), f"{what}: not exactly zero where nothing contributes"


# ---------------------------------------------------------------------------------------------------
# Triton, in a subprocess
# ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def poisoned_empty():
    """torch.empty returning NaN-filled floats (and iinfo.min ints): what a kernel leaves unwritten shows."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        if t.is_floating_point():
            return t.fill_(float("nan"))
        return t if t.dtype == torch.bool else t.fill_(torch.iinfo(t.dtype).min)

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def _run_triton_cases(out_path: str) -> None:
    """Every Triton run of the cases above (forward, backward, wgrad alone, inference), saved for the tests."""
    from tests import interpreter_speed

    interpreter_speed.install()  # as conftest does in the test processes
    results = {}
    with poisoned_empty():
        for case, gather in MM_KEYS:
            print(f"grouped_mm {case} gather={gather}", flush=True)  # the last line names a crashing case
            inp = mm_inputs(case, gather)
            offs, gidx = inp["offs"], inp["gather_index"]
            before = K.LAUNCHES["_grouped_mm_kernel"]
            results[f"mm/{case}/{gather}"] = fwd_bwd(
                lambda x, w: grouped_mm(x, w, offs, gidx, backend="triton"), (inp["x"], inp["w"]), inp["dy"])
            assert K.LAUNCHES["_grouped_mm_kernel"] == before + 2  # fwd and dX ran in Triton
            results[f"wgrad/{case}/{gather}"] = [grouped_mm_wgrad(inp["x"], inp["dy"], offs, gidx)]
        for case in COUNTS_CASES:
            print(f"expert_mlp {case}", flush=True)
            inp = mlp_inputs(case)
            leaves = (inp["rows"], inp["w_in"], inp["w_out"])
            # the fused variant: "plain" is two grouped_mm calls, covered above
            results[f"mlp/{case}/fused"] = fwd_bwd(
                lambda r, a, b: expert_mlp(r, inp["counts"], a, b, "swiglu"), leaves, inp["dy"])
            with torch.no_grad():  # the fused forward without pre
                results[f"mlp/{case}/inference"] = [expert_mlp(inp["rows"], inp["counts"], inp["w_in"],
                                                               inp["w_out"], "swiglu")]
    torch.save(results, out_path)


def _forked_triton_cases(out_path: str, log_path: str) -> None:
    """_run_triton_cases in a process forked from the tests' rank fork server, its output into ``log_path``."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for stream in (1, 2):
        os.dup2(fd, stream)
    os.close(fd)
    torch.set_num_threads(2)
    _run_triton_cases(out_path)


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory):
    """The Triton runs in a process of their own: forked from the session's rank fork server (tests/dist_utils.py:
    torch, Triton and the kernels imported once, in the interpreter where the session runs Triton there) or, where
    that server runs compiled Triton or there is none, a fresh interpreter."""
    folder = tmp_path_factory.mktemp("bounds")
    out, log = folder / "triton.pt", folder / "triton.log"
    from tests import dist_utils

    if dist_utils.START == "forkserver" and dist_utils._SERVER_ENV.get("TRITON_INTERPRET") == "1":
        import multiprocessing

        dist_utils._ensure_server()
        child = multiprocessing.get_context("forkserver").Process(target=_forked_triton_cases,
                                                                   args=(str(out), str(log)))
        child.start()
        child.join(timeout=300)
        if child.is_alive():
            child.kill()
            child.join()
        rc, output = child.exitcode, log.read_text(errors="replace") if log.exists() else ""
    else:
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="2")
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        code = f"from tests.test_kernel_bounds import _run_triton_cases; _run_triton_cases({str(out)!r})"
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300)
        rc, output = proc.returncode, proc.stdout[-2000:] + proc.stderr
    if rc != 0:  # a crash (negative rc: a signal), a failed assertion in the child, or the time limit (kill: -9)
        pytest.fail(f"Triton runs on out-of-range inputs failed (rc {rc}):\n{output[-6000:]}")
    return torch.load(out, weights_only=True)


# ---------------------------------------------------------------------------------------------------
# grouped_mm / grouped_mm_wgrad
# ---------------------------------------------------------------------------------------------------


MM_IDS = [f"{c}-{'gather' if g else 'rows'}" for c, g in MM_KEYS]


@pytest.mark.parametrize("case,gather", MM_KEYS, ids=MM_IDS)
def test_grouped_mm_triton_out_of_range(case, gather, triton_results):
    inp = mm_inputs(case, gather)
    want = mm_oracle(inp)
    for what, g, w in zip(("y", "dx", "dw"), triton_results[f"mm/{case}/{gather}"], want):
        assert_matches(g, w, f"{case} gather={gather} triton {what}")
    assert_matches(triton_results[f"wgrad/{case}/{gather}"][0], want[2], f"{case} gather={gather} triton wgrad")


@pytest.mark.parametrize("case,gather", MM_KEYS, ids=MM_IDS)
def test_grouped_mm_references_out_of_range(case, gather):
    inp = mm_inputs(case, gather)
    offs, gidx, dy = inp["offs"], inp["gather_index"], inp["dy"]
    want = mm_oracle(inp)
    leaves32, leaves64 = (inp["x"], inp["w"]), (inp["x"].double(), inp["w"].double())
    got = {
        "grouped_mm_ref": fwd_bwd(lambda x, w: grouped_mm_ref(x, w, offs, gidx), leaves64, dy),
        "backend=torch": fwd_bwd(lambda x, w: grouped_mm(x, w, offs, gidx, backend="torch"), leaves32, dy),
    }
    for backend, outs in got.items():
        for what, g, w in zip(("y", "dx", "dw"), outs, want):
            assert_matches(g, w, f"{case} gather={gather} {backend} {what}")
    assert_matches(grouped_mm_wgrad_ref(inp["x"].double(), dy.double(), offs, gidx), want[2],
                   f"{case} gather={gather} grouped_mm_wgrad_ref")


# ---------------------------------------------------------------------------------------------------
# expert MLP: Triton (fused), the reference, the loop and torch backends
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(COUNTS_CASES))
def test_expert_mlp_triton_out_of_range_counts(case, triton_results):
    want = mlp_oracle(mlp_inputs(case))
    for what, g, w in zip(("y", "drows", "dw_in", "dw_out"), triton_results[f"mlp/{case}/fused"], want):
        assert_matches(g, w, f"{case} triton fused {what}")
    assert_matches(triton_results[f"mlp/{case}/inference"][0], want[0], f"{case} triton inference y")


@pytest.mark.parametrize("case", list(COUNTS_CASES))
def test_expert_backends_out_of_range_counts(case):
    inp = mlp_inputs(case)
    counts, dy = inp["counts"], inp["dy"]
    want = mlp_oracle(inp)
    leaves = (inp["rows"], inp["w_in"], inp["w_out"])
    got = {"expert_mlp_ref": fwd_bwd(lambda r, a, b: expert_mlp_ref(r, counts, a, b, "swiglu"),
                                     [t.double() for t in leaves], dy)}
    got["loop"] = fwd_bwd(lambda r, a, b: experts.loop_mlp(r, counts, a, b, "swiglu"), leaves, dy)
    if experts._grouped_mm_why_not(*leaves) == "":
        got["torch"] = fwd_bwd(lambda r, a, b: experts.torch_grouped_mlp(r, counts, a, b, "swiglu"), leaves, dy)
    for backend, outs in got.items():
        for what, g, w in zip(("y", "drows", "dw_in", "dw_out"), outs, want):
            assert_matches(g, w, f"{case} {backend} {what}")


def test_counts_to_offs_is_monotone_within_rows():
    counts = torch.tensor([3, -4, 2**62, 2**62, 5, -2**63], dtype=torch.int64)
    offs = experts.counts_to_offs(counts, 10)
    assert offs.dtype == torch.int32 and offs.tolist() == [3, 3, 10, 10, 10, 10]
    assert experts.counts_to_offs(torch.tensor([2, 3], dtype=torch.int32), 10).tolist() == [2, 5]
    assert experts.counts_to_offs(torch.zeros(0, dtype=torch.int64), 10).shape == (0,)


def test_no_experts_gives_zero_rows():
    x, w = torch.randn(12, 8), torch.randn(0, 8, 6)
    offs = torch.zeros(0, dtype=torch.int32)
    for backend in ("triton", "torch"):
        with poisoned_empty():
            y = grouped_mm(x, w, offs, backend=backend)
        assert torch.equal(y, torch.zeros(12, 6)), backend
    with poisoned_empty():
        assert torch.equal(grouped_mm_wgrad(x, torch.randn(12, 6), offs), torch.zeros(0, 8, 6))


def test_bad_metadata_is_a_clear_value_error():
    from moekit.moe.kernels.expert_mlp import expert_down_dact, expert_up_act

    x, w = torch.randn(10, 8), torch.randn(2, 8, 6)
    offs = torch.tensor([4, 10], dtype=torch.int32)
    cases = [
        (lambda: K.scatter_add_rows(x, torch.zeros(10, dtype=torch.int64), -1), "num_rows=-1 must be >= 0"),
        (lambda: grouped_mm_wgrad(x, torch.randn(10, 6), offs, torch.zeros(10, dtype=torch.int32)), "int64"),
        (lambda: grouped_mm_wgrad(x, torch.randn(9, 6), offs), "dy has 9 rows"),
        (lambda: expert_up_act(x, torch.randn(2, 7, 6), offs, "swiglu", save_pre=False), "need x [M, K]"),
        (lambda: expert_down_dact(x, torch.randn(2, 3, 8), torch.randn(10, 5), offs, "swiglu", store_h=False),
         "pre [M, F_in]"),
        (lambda: expert_mlp(x, torch.tensor([True, False]), w, torch.randn(2, 3, 8), "swiglu"), "counts must be"),
    ]
    for fn, needle in cases:
        with pytest.raises(ValueError) as info:
            fn()
        assert needle in str(info.value), (needle, str(info.value))
