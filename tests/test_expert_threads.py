"""Experts in parallel on CPU (moe/expert_threads.py, issue 19): bitwise the sequential loop, forward and
backward, fp32 and bf16, ragged and empty experts, SwiGLU and gpt-oss's swiglu_oai with expert biases; the pool
leaves torch's thread settings as they were; the by-shape choice."""
import threading

import pytest
import torch

from moekit.moe import experts, expert_threads as et, loop_experts
from moekit.moe.expert_threads import choose_workers, expert_threads, for_each_expert


ACTS = ["swiglu", "swiglu_oai"]  # swiglu_oai: with gpt-oss's expert biases b_in, b_out


def _case(dtype, counts, N=301, H=32, F=24, seed=0, activation="swiglu", scale=None):
    g = torch.Generator().manual_seed(seed)
    E = len(counts)
    if scale is None:
        scale = 4 if activation == "swiglu_oai" else 1  # h past swiglu_oai's clamp (+-7) for some entries
    rows = (scale * torch.randn(N, H, generator=g)).to(dtype).requires_grad_()
    w_in = (torch.randn(E, H, 2 * F, generator=g) / H ** 0.5).to(dtype).requires_grad_()
    w_out = (torch.randn(E, F, H, generator=g) / F ** 0.5).to(dtype).requires_grad_()
    biases = {}
    if activation == "swiglu_oai":
        biases = {"b_in": torch.randn(E, 2 * F, generator=g).to(dtype).requires_grad_(),
                  "b_out": torch.randn(E, H, generator=g).to(dtype).requires_grad_()}
    return rows, torch.tensor(counts), w_in, w_out, torch.randn(N, H, generator=g).to(dtype), activation, biases


def _fwd_bwd(workers, rows, counts, w_in, w_out, dy, activation="swiglu", biases=None):
    biases = biases or {}
    with expert_threads(workers):
        y = experts.loop_mlp(rows, counts, w_in, w_out, activation, **biases)
        grads = torch.autograd.grad(y, (rows, w_in, w_out, *biases.values()), dy)
        with torch.no_grad():
            y_ng = experts.loop_mlp(rows, counts, w_in, w_out, activation, **biases)
        with torch.inference_mode():
            y_inf = experts.loop_mlp(rows, counts, w_in, w_out, activation, **biases)
    return (y, *grads, y_ng, y_inf)


# ragged with empty experts, all rows to one expert, rows nobody owns (counts sum < N), nothing at all
COUNTS = [[40, 0, 77, 3, 0, 120, 1, 60], [0, 0, 301, 0], [10, 0, 50, 20, 0, 5], [0, 0, 0, 0]]


def _one_thread_loop(case):
    """The sequential loop with torch (and MKL) at one thread, as each worker runs: MKL's blocking of a GEMM
    depends on its thread count, so the multithreaded loop agrees only to rounding."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _fwd_bwd(1, *case)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", COUNTS)
def test_parallel_experts_equal_the_sequential_loop_bitwise(dtype, counts, activation):
    case = _case(dtype, counts, activation=activation)
    want = _one_thread_loop(case)
    for workers in (2, 3):
        for a, b in zip(_fwd_bwd(workers, *case), want):
            assert torch.equal(a, b)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    if activation == "swiglu_oai" and dtype == torch.float32:  # 4x the inputs: 4x the rounding
        tol = dict(atol=4e-5, rtol=4e-5)
    for a, b in zip(_fwd_bwd(1, *case), want):  # the loop on torch's threads: to rounding
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("activation", ACTS)
def test_parallel_experts_match_the_autograd_composite_in_float64(activation):
    rows, counts, w_in, w_out, dy, _, biases = _case(torch.float64, COUNTS[0], activation=activation)
    leaves = (rows, w_in, w_out, *biases.values())
    # the autograd reference
    want = loop_experts._loop_composite(rows, counts.tolist(), w_in, w_out, activation, *biases.values())
    with expert_threads(2):
        got = experts.loop_mlp(rows, counts, w_in, w_out, activation, **biases)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, leaves, dy), torch.autograd.grad(want, leaves, dy)):
        torch.testing.assert_close(a, b)


def test_every_expert_runs_once_on_a_single_threaded_worker_and_settings_are_restored():
    before = torch.get_num_threads()
    seen, lock = [], threading.Lock()

    def body(e, start, n, bufs):
        with lock:
            seen.append((e, start, n, threading.current_thread().name, torch.get_num_threads(), bufs))

    sizes = [3, 0, 5, 1, 0, 2]
    for_each_expert(sizes, body, 2, scratch=lambda: threading.get_ident())
    assert sorted(s[:3] for s in seen) == [(0, 0, 3), (2, 3, 5), (3, 8, 1), (5, 9, 2)]
    assert all(name.startswith("moekit-experts") and width == 1 for *_, name, width, _ in seen)
    assert [s[0] for s in seen][:1] == [2]  # the biggest expert is taken first
    assert torch.get_num_threads() == before  # the caller's width, and torch's default for new threads
    fresh = []
    t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    t.start(), t.join()
    assert fresh == [before]


def test_a_worker_error_reaches_the_caller():
    def body(e, start, n, bufs):
        if e == 1:
            raise RuntimeError("expert 1 failed")

    with pytest.raises(RuntimeError, match="expert 1 failed"):
        for_each_expert([2, 2, 2, 2], body, 2)


def test_choice_by_shape(monkeypatch):
    def choice(N, E, H, F_in, threads, device="cpu"):
        monkeypatch.setattr(et.torch, "get_num_threads", lambda: threads)
        return choose_workers(torch.empty(N, H, device=device), torch.empty(E, H, F_in, device=device), [1] * E)

    assert choice(32768, 64, 256, 256, 2) == 2  # fine-grained: small per-expert GEMMs
    assert choice(8192, 8, 256, 1024, 2) == 1  # Mixtral-like: MKL's own threads (measured faster)
    assert choice(8192, 16, 256, 1024, 2) == 2  # 16 x F 512: measured faster in parallel
    assert choice(8192, 8, 128, 512, 2) == 1  # the README main job (H 128): measured slower in parallel
    assert choice(32768, 8, 4096, 28672, 2) == 1  # big GEMMs: MKL's own threads
    assert choice(32768, 64, 256, 256, 1) == 1  # one thread: nothing to share
    assert choice(32768, 3, 256, 256, 2) == 1  # fewer than two experts per thread: no balance
    assert choice(32768, 64, 256, 256, 2, device="meta") == 1  # CPU only
    with expert_threads(1):
        assert choice(32768, 64, 256, 256, 2) == 1
    with pytest.raises(ValueError, match="positive integer"):
        with expert_threads(0):
            pass


def test_bf16_gpt_oss_experts_match_float64():
    """bf16's path (oneDNN row pieces, weight gradients over zero-padded rows, 120 and 301 rows here) with
    swiglu_oai and biases: every gradient, the biases' column sums included, is float64's to bf16 rounding. Inputs
    of std 1, so bf16's rounding moves no h across the clamp (the float64 tests cover the clamp)."""
    for counts in (COUNTS[0], COUNTS[1]):
        case = _case(torch.float64, counts, activation="swiglu_oai", scale=1)
        rows, counts_t, w_in, w_out, dy, act, biases = case
        leaves = (rows, w_in, w_out, *biases.values())
        low = [t.detach().bfloat16().requires_grad_() for t in leaves]
        want = _fwd_bwd(2, *case[:5], act, biases)
        got = _fwd_bwd(2, low[0], counts_t, low[1], low[2], dy.bfloat16(), act, dict(zip(biases, low[3:])))
        for a, b in zip(got, want):
            scale = float(b.detach().abs().max())
            torch.testing.assert_close(a.double(), b, rtol=0.03, atol=0.03 * scale)
