"""The CPU fast paths agree with the paths they replace (issue 19): the loop backend's hand-written
SwiGLU function against its autograd composite, and the CPU combine / permute-backward against the
gather + bmm path GPUs keep. float64, so "agree" is to rounding."""
import pytest
import torch

from moekit.moe import dispatch, experts, loop_experts, onednn_gemm
from moekit.moe.dispatch import LocalDispatcher
from moekit.moe.router import build_router


def _leaves(N=23, H=8, F=5, E=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    w_in = torch.randn(E, H, 2 * F, generator=g, dtype=torch.float64, requires_grad=True)
    w_out = torch.randn(E, F, H, generator=g, dtype=torch.float64, requires_grad=True)
    return rows, w_in, w_out, torch.randn(N, H, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("counts", [[6, 0, 9, 8], [5, 0, 3, 2], [0, 0, 0, 0], [30, -1, 4, 4]])
def test_loop_swiglu_function_matches_the_composite(counts):
    rows, w_in, w_out, dy = _leaves()
    counts = torch.tensor(counts)
    ends = experts.counts_to_offs(counts, rows.shape[0]).tolist()
    sizes = [b - a for a, b in zip([0] + ends[:-1], ends)]
    got = experts.loop_mlp(rows, counts, w_in, w_out, "swiglu")
    want = loop_experts._loop_composite(rows, sizes, w_in, w_out, "swiglu")
    torch.testing.assert_close(got, want)
    if want.requires_grad:
        for a, b in zip(torch.autograd.grad(got, (rows, w_in, w_out), dy, allow_unused=True),
                        torch.autograd.grad(want, (rows, w_in, w_out), dy, allow_unused=True)):
            torch.testing.assert_close(a if a is not None else torch.zeros_like(b), b)
    with torch.no_grad():  # the inference path (one reused expert-sized buffer)
        torch.testing.assert_close(experts.loop_mlp(rows, counts, w_in, w_out, "swiglu"), want.detach())


def test_loop_swiglu_function_double_backward():
    rows, w_in, w_out, _ = _leaves(N=6, H=3, F=2, E=2)
    counts = torch.tensor([2, 3])
    assert torch.autograd.gradgradcheck(lambda r, a, b: experts.loop_mlp(r, counts, a, b, "swiglu"),
                                        (rows, w_in, w_out))


@pytest.mark.parametrize("capacity_factor", [None, 0.7])
def test_cpu_combine_and_permute_match_the_gather_path(monkeypatch, capacity_factor):
    g = torch.Generator().manual_seed(1)
    T, E, H, k = 19, 5, 6, 3
    router = build_router("topk", H, E, top_k=k, capacity_factor=capacity_factor)
    r = router.route(torch.randn(T, E, generator=g))
    x0 = torch.randn(T, H, generator=g, dtype=torch.float64)
    w0 = r.weights.double()
    go = torch.randn(T, H, generator=g, dtype=torch.float64)

    def run():
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        routing = dispatch.Routing(r.indices, w, r.tokens_per_expert, r.aux_loss, capacity=r.capacity)
        disp = LocalDispatcher(E)
        d = disp.dispatch(x, routing)
        out = disp.combine(d.rows * 1.5, d.meta)
        return (out, *torch.autograd.grad(out, (x, w), go))

    fast = run()
    monkeypatch.setattr(dispatch, "_cpu_fast_path", lambda rows, padded: False)
    for a, b in zip(fast, run()):
        torch.testing.assert_close(a, b)


def test_row_pieces_cover_every_row_with_recurring_lengths():
    seen = set()
    for n in range(0, 5000, 7):
        pieces = onednn_gemm.pieces(n)
        assert sum(m for _, m in pieces) == n and all(m > 0 for _, m in pieces)
        assert [s for s, _ in pieces] == [sum(m for _, m in pieces[:i]) for i in range(len(pieces))]  # contiguous
        seen.update(m for _, m in pieces)
        padded = onednn_gemm.padded_rows(n)
        assert padded >= n and padded - n < max(64, padded // 16 + 1)  # at most 6.25% (or < 64 rows) of padding
    assert len(seen) < 100  # lengths recur: multiples of 1024, of 64 below 1024, and 63 rests
    assert len({onednn_gemm.padded_rows(n) for n in range(1, 5000)}) < 60


def _bf16_experts(counts, seed):
    g = torch.Generator().manual_seed(seed)
    E, H, F = len(counts), 96, 80
    N = sum(counts) + 5  # rows nobody owns at the end
    rows = torch.randn(N, H, generator=g).bfloat16().requires_grad_()
    w_in = (torch.randn(E, H, 2 * F, generator=g) / H ** 0.5).bfloat16().requires_grad_()
    w_out = (torch.randn(E, F, H, generator=g) / F ** 0.5).bfloat16().requires_grad_()
    return rows, w_in, w_out, torch.randn(N, H, generator=g).bfloat16(), torch.tensor(counts)


@pytest.mark.parametrize("counts", [[1500, 0, 65, 700, 7], [64, 63, 1100, 0, 2], [3, 0, 0, 2049]])
def test_bf16_loop_in_row_pieces_matches_the_plain_loop(monkeypatch, counts):
    """CPU bf16: GEMMs split into row pieces and weight gradients over zero-padded rows (the last expert's
    rows copied, as they end at the buffer's end) give what one GEMM per expert gives, against float64."""
    rows, w_in, w_out, dy, c = _bf16_experts(counts, seed=len(counts) + counts[0])
    assert onednn_gemm.split_rows(rows)

    def run():
        y = experts.loop_mlp(rows, c, w_in, w_out, "swiglu")
        return (y, *torch.autograd.grad(y, (rows, w_in, w_out), dy))

    split = run()
    monkeypatch.setattr(onednn_gemm, "split_rows", lambda t: False)
    plain = run()
    r64 = [t.detach().double().requires_grad_() for t in (rows, w_in, w_out)]
    y64 = loop_experts._loop_composite(r64[0], c.tolist(), r64[1], r64[2], "swiglu")
    ref = (y64, *torch.autograd.grad(y64, r64, dy.double()))
    for s, p, r in zip(split, plain, ref):
        err_split = ((s.double() - r).norm() / r.norm().clamp_min(1e-30)).item()
        err_plain = ((p.double() - r).norm() / r.norm().clamp_min(1e-30)).item()
        assert err_split <= 1.5 * err_plain + 1e-6 and err_split < 2e-2
    assert torch.count_nonzero(split[0][sum(counts):]) == 0 and torch.count_nonzero(split[1][sum(counts):]) == 0


def test_bf16_loop_gemm_shapes_recur_across_routings():
    """The point of the pieces: over many routings, the loop's bf16 GEMMs take few distinct shapes (each one a
    oneDNN primitive to build), where one GEMM per expert takes a new shape almost every time."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from moekit.moe.expert_threads import expert_threads

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out):
                self.seen.add((tuple(args[0].shape), tuple(args[1].shape)))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    draws = [torch.multinomial(torch.rand(8, generator=g) + 0.05, 6000, replacement=True, generator=g).bincount(
        minlength=8) for _ in range(40)]
    _, w_in, w_out, _, _ = _bf16_experts([750] * 8, seed=1)
    rows = torch.randn(6000, w_in.shape[1], generator=g).bfloat16().requires_grad_()
    dy = torch.randn(6000, w_in.shape[1], generator=g).bfloat16()
    new_late = {}  # shapes first seen in the last 10 routings: what a long run keeps paying for
    for split in (True, False):
        mode = Shapes()
        with expert_threads(1), mode:
            keep = onednn_gemm.split_rows
            onednn_gemm.split_rows = (lambda t: t.dtype == torch.bfloat16) if split else (lambda t: False)
            try:
                for i, c in enumerate(draws):
                    if i == 30:
                        before = len(mode.seen)
                    y = experts.loop_mlp(rows, c, w_in, w_out, "swiglu")
                    torch.autograd.grad(y, (rows, w_in, w_out), dy)
            finally:
                onednn_gemm.split_rows = keep
        new_late[split] = len(mode.seen) - before
    assert new_late[False] > 200 and new_late[True] < new_late[False] / 8, new_late
