"""The CPU fast paths agree with the paths they replace (issue 19): the loop backend's hand-written
SwiGLU function against its autograd composite, and the CPU combine / permute-backward against the
gather + bmm path GPUs keep. float64, so "agree" is to rounding."""
import pytest
import torch

from moekit.moe import dispatch, experts
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
    want = experts._loop_composite(rows, sizes, w_in, w_out, "swiglu")
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
