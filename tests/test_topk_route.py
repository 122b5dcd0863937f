"""moe.kernels.topk_route (the fused top-k router, one Triton kernel each way) against the torch router.

On CPU the kernels run under TRITON_INTERPRET=1 (conftest sets it where there is no GPU). Logits are a
random permutation of well-separated values per token plus noise, so the top-k is unambiguous and the
indices must match exactly; values and gradients are compared with float32 tolerances.
"""
from __future__ import annotations


import pytest
import torch

from moekit.moe import router as router_mod
from moekit.moe.kernels._common import interpret_mode
from moekit.moe.kernels import topk_route as tr
from moekit.moe.kernels.topk_route import MAX_EXPERTS, topk_route, topk_route_ref, why_not_topk_route
from moekit.moe.router import TopKRouter, build_router
from tests.helpers import gen

pytestmark = pytest.mark.skipif(not (interpret_mode() or torch.cuda.is_available()),
                                reason="needs TRITON_INTERPRET=1 or a GPU")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def separated_logits(T: int, E: int, g: torch.Generator, spread: float = 3.0) -> torch.Tensor:
    base = torch.linspace(-spread, spread, E)
    rows = [base[torch.randperm(E, generator=g)] for _ in range(T)]
    out = torch.stack(rows) if T else torch.empty(0, E)
    return (out + 1e-3 * torch.rand(T, E, generator=g)).to(DEV)


CASES = [  # T, E, k, score, normalize, scaling, bias
    (37, 12, 3, "softmax", True, 1.0, False),
    (37, 12, 3, "sigmoid", True, 2.5, True),
    (50, 60, 8, "softmax", False, 1.0, False),
    (9, 8, 1, "softmax", False, 1.0, False),  # Switch-like
    (23, 64, 6, "sigmoid", True, 2.5, True),  # DeepSeek-like (no groups)
    (5, 3, 3, "softmax", True, 1.0, False),  # k = E
    (0, 16, 2, "softmax", True, 1.0, False),  # no tokens
]


@pytest.mark.parametrize("T,E,k,score,normalize,scaling,with_bias", CASES)
def test_kernel_matches_the_torch_steps_forward_and_backward(T, E, k, score, normalize, scaling, with_bias):
    g = gen("kernel", T, E, k, score, normalize, with_bias)
    logits = separated_logits(T, E, g)
    bias = (0.05 * torch.randn(E, generator=g)).to(DEV) if with_bias else None
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    got = topk_route(a, k, score, normalize, scaling, bias)
    want = topk_route_ref(b, k, score, normalize, scaling, bias)
    assert torch.equal(got[0], want[0]) and got[0].dtype == torch.int64
    assert torch.equal(got[4], want[4]) and int(got[4].sum()) == T * k
    for x, y in zip(got[1:4], want[1:4]):
        torch.testing.assert_close(x, y, rtol=2e-6, atol=2e-7)
    # every subset of the differentiable outputs: the kernel's HAS_* branches
    for use in ((1,), (2,), (3,), (1, 2, 3), (1, 3)):
        a.grad = b.grad = None
        cot = {i: torch.randn(got[i].shape, generator=g).to(DEV) for i in use}
        torch.autograd.backward([got[i] for i in use], [cot[i] for i in use], retain_graph=True)
        torch.autograd.backward([want[i] for i in use], [cot[i] for i in use], retain_graph=True)
        if T == 0:
            assert a.grad is None or a.grad.numel() == 0
            continue
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=f"outputs used: {use}")


def test_bias_changes_the_selection_not_the_weights():
    g = gen("bias")
    T, E, k = 16, 8, 2
    logits = separated_logits(T, E, g, spread=0.5)
    bias = torch.zeros(E, device=DEV)
    bias[E - 1] = 10.0  # expert E-1 wins every token's first slot
    idx, w, scores, _, counts = topk_route(logits, k, "sigmoid", False, 1.0, bias)
    assert (idx[:, 0] == E - 1).all() and counts[E - 1] == T
    torch.testing.assert_close(w, scores.gather(1, idx))  # the real scores, not the biased ones


def test_ties_go_to_the_lower_expert_id():
    logits = torch.zeros(4, 6, device=DEV)
    idx = topk_route(logits, 3, "softmax", True, 1.0)[0]
    assert idx.tolist() == [[0, 1, 2]] * 4


ROUTERS = [
    ("topk", dict(top_k=2, aux_loss_coeff=0.01, z_loss_coeff=0.001)),
    ("topk", dict(top_k=4, score="sigmoid", expert_bias=True, bias_update_rate=0.001, scaling=2.5,
                  aux_loss_coeff=0.0)),
    ("topk", dict(top_k=2, capacity_factor=1.0, drop_policy="probs", aux_loss_coeff=0.01)),
    ("switch", dict(jitter=0.0)),
]


@pytest.mark.parametrize("name,options", ROUTERS, ids=["mixtral", "deepseek-biased", "capacity", "switch"])
def test_router_with_the_kernel_equals_the_torch_router(monkeypatch, name, options):
    """Same routing, losses, stats and gradients (gate weight and input) with FUSED_ROUTER always / never."""
    g = gen("router", name, sorted(options.items()))
    T, H, E = 29, 16, 8
    ref = build_router(name, H, E, **options).to(DEV)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(E, H, generator=g) * 0.5)
        if getattr(ref, "expert_bias", None) is not None:
            ref.expert_bias.copy_(torch.randn(E, generator=g) * 0.01)
    fused = build_router(name, H, E, **options).to(DEV)
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(T, H, generator=g).to(DEV)
    outs = []
    for mode, r in (("never", ref), ("always", fused)):
        monkeypatch.setattr(router_mod, "FUSED_ROUTER", mode)
        assert (r.fused_route_reason(r.logits(x)) == "") == (mode == "always")
        xi = x.clone().requires_grad_(True)
        rt = r(xi)
        loss = (rt.weights * torch.arange(1, rt.weights.shape[1] + 1, device=DEV)).sum() + rt.aux_loss
        gx, gw = torch.autograd.grad(loss, [xi, r.weight])
        outs.append((rt, gx, gw))
    (a, ax, aw), (b, bx, bw) = outs
    assert torch.equal(a.indices, b.indices)
    assert torch.equal(a.tokens_per_expert, b.tokens_per_expert) and a.capacity == b.capacity
    torch.testing.assert_close(a.weights, b.weights, rtol=2e-6, atol=2e-7)
    torch.testing.assert_close(a.aux_loss, b.aux_loss, rtol=1e-5, atol=1e-7)
    assert a.stats.keys() == b.stats.keys()
    for key in a.stats:
        torch.testing.assert_close(a.stats[key], b.stats[key], rtol=1e-5, atol=1e-7, msg=key)
    torch.testing.assert_close(ax, bx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aw, bw, rtol=1e-5, atol=1e-6)


def test_what_stays_in_torch(monkeypatch):
    monkeypatch.setattr(router_mod, "FUSED_ROUTER", "always")
    x = torch.randn(4, 8).to(DEV)
    grouped = build_router("topk", 8, 8, top_k=2, num_groups=4, group_top_k=2)
    assert "group-limited" in grouped.fused_route_reason(grouped.logits(x))

    class MyScores(TopKRouter):
        def scores(self, logits):
            return logits.softmax(-1) ** 2

    mine = MyScores(8, 8, top_k=2)
    assert "overrides scores()" in mine.fused_route_reason(mine.logits(x))
    plain = build_router("topk", 8, 8, top_k=2)
    assert plain.fused_route_reason(plain.logits(x).double()).startswith("logits must be float32")
    monkeypatch.setattr(router_mod, "FUSED_ROUTER", "never")
    assert "'never'" in plain.fused_route_reason(plain.logits(x))
    monkeypatch.setattr(router_mod, "FUSED_ROUTER", "auto")
    if DEV == "cpu":
        assert "CUDA only" in plain.fused_route_reason(plain.logits(x))


def test_arguments_the_kernel_cannot_take_are_named():
    lg = torch.zeros(3, 8, device=DEV)
    assert "top_k=9" in why_not_topk_route(lg, 9, "softmax")
    assert "top_k=0" in why_not_topk_route(lg, 0, "softmax")
    assert f"at most {MAX_EXPERTS}" in why_not_topk_route(torch.zeros(2, MAX_EXPERTS + 1, device=DEV), 2, "softmax")
    assert "score 'relu'" in why_not_topk_route(lg, 2, "relu")
    assert "expert_bias must be float32 [E=8]" in why_not_topk_route(lg, 2, "softmax", torch.zeros(7, device=DEV))
    with pytest.raises(ValueError, match=r"topk_route \(Triton\): logits must be \[T, E\]"):
        topk_route(torch.zeros(8, device=DEV), 2)


def test_backward_reference_with_the_saved_selection_matches_the_kernel():
    """The torch backward the Function falls back to when only the backward kernel fails to build."""
    g = gen("bwd-ref")
    T, E, k = 21, 24, 4
    logits = separated_logits(T, E, g)
    idx = topk_route(logits, k, "sigmoid", True, 2.0)[0]
    dw, ds, dl = (torch.randn(T, k, generator=g).to(DEV), torch.randn(T, E, generator=g).to(DEV),
                  torch.randn(T, generator=g).to(DEV))
    cfg = (k, "sigmoid", True, 2.0)
    for args in ((dw, ds, dl), (dw, None, None), (None, ds, dl)):
        got, want = tr._backward_kernel(logits, idx, *args, cfg), tr.backward_ref(logits, idx, *args, cfg)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_kernel_that_cannot_build_falls_back_to_torch_with_one_warning(monkeypatch):
    from moekit.moe.kernels._common import BUILD_ERRORS

    def broken(*args, **kwargs):
        raise BUILD_ERRORS[0]("no registers left (simulated)")

    g = gen("fallback")
    r = build_router("topk", 8, 8, top_k=2).to(DEV)
    x = torch.randn(6, 8, generator=g).to(DEV)
    monkeypatch.setattr(router_mod, "FUSED_ROUTER", "never")
    want = r(x)
    monkeypatch.setattr(router_mod, "_FUSED_BUILD_FAILURE", [])
    monkeypatch.setattr(tr, "topk_route", broken)
    monkeypatch.setattr(router_mod, "FUSED_ROUTER", "always")
    with pytest.raises(BUILD_ERRORS[0]):  # always: the failure is the answer
        r(x)
    monkeypatch.setattr(router_mod, "FUSED_ROUTER", "auto")
    if DEV == "cpu":  # auto never fuses on CPU: pretend the device is CUDA for the reason check
        monkeypatch.setattr(TopKRouter, "fused_route_reason", lambda self, lg: "")
    with pytest.warns(UserWarning, match="fused top-k kernel failed to build here"):
        got = r(x)
    assert torch.equal(got.indices, want.indices)
    torch.testing.assert_close(got.weights, want.weights)
    assert router_mod._FUSED_BUILD_FAILURE and "simulated" in router_mod._FUSED_BUILD_FAILURE[0]


def test_a_bad_mode_is_named(monkeypatch):
    monkeypatch.setattr(router_mod, "FUSED_ROUTER", "sometimes")
    r = build_router("topk", 8, 8, top_k=2)
    with pytest.raises(ValueError, match="FUSED_ROUTER='sometimes'; use one of auto, always, never"):
        r(torch.randn(3, 8))
