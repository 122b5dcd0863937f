import re

import pytest
import torch

from moekit.moe.dispatch import LocalDispatcher
from moekit.moe.router import Routing, build_router, count_experts


def make_routing(indices, weights=None, capacity=None, *, num_experts):
    indices = torch.as_tensor(indices, dtype=torch.long)
    if weights is None:
        weights = torch.where(indices >= 0, 1.0, 0.0)
    return Routing(indices, torch.as_tensor(weights, dtype=torch.float32), count_experts(indices, num_experts),
                   torch.zeros(()), {}, capacity)


def test_rows_are_expert_major_and_stable():
    x = torch.arange(4.0)[:, None].expand(4, 3).contiguous()  # row t holds t
    r = make_routing([[2, 0], [0, 1], [2, 1], [3, 0]], num_experts=4)
    d = LocalDispatcher(4).dispatch(x, r)
    # expert 0: t0, t1, t3 | expert 1: t1, t2 | expert 2: t0, t2 | expert 3: t3
    assert d.rows[:, 0].tolist() == [0, 1, 3, 1, 2, 0, 2, 3]
    assert d.counts.tolist() == [3, 2, 2, 1]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_permute_then_combine_is_identity(k):
    g = torch.Generator().manual_seed(k)
    T, E, H = 31, 8, 5
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    r = make_routing(idx, torch.full((T, k), 1.0 / k), num_experts=E)
    disp = LocalDispatcher(E)
    d = disp.dispatch(x, r)
    torch.testing.assert_close(disp.combine(d.rows, d.meta), x)
    r1 = make_routing(idx, num_experts=E)  # unit weights: each token comes back k times
    d1 = disp.dispatch(x, r1)
    torch.testing.assert_close(disp.combine(d1.rows, d1.meta), k * x)


def test_empty_experts_and_empty_batch():
    x = torch.randn(5, 3)
    d = LocalDispatcher(6).dispatch(x, make_routing([[3], [3], [0], [3], [0]], num_experts=6))
    assert d.counts.tolist() == [2, 0, 0, 3, 0, 0]
    empty = Routing(torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), torch.zeros(6, dtype=torch.long),
                    torch.zeros(()))
    disp = LocalDispatcher(6)
    e = disp.dispatch(torch.zeros(0, 3, requires_grad=True), empty)
    assert e.rows.shape == (0, 3)
    out = disp.combine(e.rows * 2, e.meta)
    out.sum().backward()
    assert out.shape == (0, 3)


def test_dropped_slots_neither_read_nor_receive():
    x = torch.randn(4, 2, requires_grad=True)
    r = make_routing([[0, -1], [-1, -1], [1, 0], [-1, 1]], capacity=2, num_experts=2)
    disp = LocalDispatcher(2)
    d = disp.dispatch(x, r)
    assert d.rows.shape[0] == 4  # min(T*k, E*capacity): static, no host sync
    y = disp.combine(d.rows * 3.0, d.meta)
    torch.testing.assert_close(y[1], torch.zeros(2))
    torch.testing.assert_close(y[0], 3 * x[0].detach())
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([[3.0] * 2, [0.0] * 2, [6.0] * 2, [3.0] * 2]))


def test_gradients_match_plain_indexing():
    g = torch.Generator().manual_seed(0)
    T, E, H, k = 17, 5, 4, 2
    router = build_router("topk", H, E, top_k=k, capacity_factor=0.8)
    x = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    r = router.route(torch.randn(T, E, generator=g))
    w = r.weights.double().requires_grad_()
    scale = torch.randn(E, H, generator=g, dtype=torch.float64)
    disp = LocalDispatcher(E)
    d = disp.dispatch(x, Routing(r.indices, w, r.tokens_per_expert, r.aux_loss, capacity=r.capacity))
    owner = torch.repeat_interleave(torch.arange(E), d.counts, output_size=int(d.counts.sum()))
    n = owner.numel()
    rows = torch.cat([d.rows[:n] * scale[owner], torch.zeros_like(d.rows[n:])])
    out = disp.combine(rows, d.meta)
    # reference: per slot, x[t] * scale[e] * w
    ref = torch.zeros_like(x)
    for t in range(T):
        for j in range(k):
            e = r.indices[t, j].item()
            if e >= 0:
                ref = ref.index_add(0, torch.tensor([t]), (x[t] * scale[e] * w[t, j])[None])
    torch.testing.assert_close(out, ref)
    go = torch.randn(T, H, generator=g, dtype=torch.float64)
    gx, gw = torch.autograd.grad(out, (x, w), go)
    rx, rw = torch.autograd.grad(ref, (x, w), go)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)


def test_token_count_mismatch():
    r = make_routing([[0], [1]], num_experts=2)
    with pytest.raises(ValueError, match="3 tokens but routing for 2"):
        LocalDispatcher(2).dispatch(torch.randn(3, 4), r)


@pytest.mark.parametrize("n", [0, 7, 12287, 12288, 24576, 32767, 32768, 40000])
def test_stable_argsort_is_torchs_stable_sort(n):
    """The CPU radix padding (moe.dispatch.stable_argsort) returns exactly torch's stable order, dropped
    slots (int64 max keys) included, on both sides of its size thresholds."""
    from moekit.moe.dispatch import stable_argsort

    g = torch.Generator().manual_seed(n)
    key = torch.randint(-1, 13, (n,), generator=g)
    key = torch.where(key < 0, torch.iinfo(torch.int64).max, key)
    got = stable_argsort(key)
    assert got.dtype == torch.int64 and torch.equal(got, torch.sort(key, stable=True).indices)
    # stable: equal keys keep their order
    assert torch.equal(key[got], key.sort().values) and bool((torch.diff(got[key[got] == 3]) > 0).all())


@pytest.mark.parametrize("num_experts", [1, 8, 256])
def test_narrow_sort_key_orders_slots_as_the_int64_key(num_experts):
    """The int32 slot key (CUDA's sort, half the radix passes) gives the int64 key's stable order: expert
    ids ascending, each expert's slots in token order, dropped slots (-1, any negative) last; the -1s in
    token order."""
    from moekit.moe.dispatch import slot_sort_key

    g = torch.Generator().manual_seed(num_experts)
    flat = torch.randint(0, num_experts, (5000,), generator=g)
    flat[torch.rand(5000, generator=g) < 0.1] = -1
    flat[:3] = torch.tensor([-7, num_experts - 1, 0])
    narrow, wide = slot_sort_key(flat, narrow=True), slot_sort_key(flat, narrow=False)
    assert narrow.dtype == torch.int32 and wide.dtype == torch.int64
    order = torch.sort(narrow, stable=True).indices
    assert torch.equal(order, torch.sort(wide, stable=True).indices)
    kept = int((flat >= 0).sum())
    assert bool((flat[order[kept:]] < 0).all()) and bool((torch.diff(flat[order[:kept]]) >= 0).all())
    dropped = order[kept:][flat[order[kept:]] == -1]
    assert torch.equal(dropped, (flat == -1).nonzero().squeeze(1))  # stable among the dropped


def test_local_dispatcher_refuses_no_experts():
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=rf"LocalDispatcher num_experts={bad!r} is invalid; it must be an "
                                             rf"integer >= 1"):
            LocalDispatcher(bad)


def test_dispatch_refuses_a_routing_for_another_number_of_experts():
    r = make_routing([[0, 1], [3, 2], [1, 0]], num_experts=4)
    with pytest.raises(ValueError, match=r"tokens_per_expert has shape \(4,\) but this LocalDispatcher has "
                                         r"num_experts=8"):
        LocalDispatcher(8).dispatch(torch.randn(3, 5), r)


@pytest.mark.parametrize("cut", ["short", "long", "flat"])
def test_combine_checks_rows_against_the_dispatch(cut):
    r = make_routing([[0, 1], [3, 2], [1, 0]], capacity=None, num_experts=4)
    disp = LocalDispatcher(4)
    d = disp.dispatch(torch.randn(3, 5), r)
    rows = {"short": d.rows[:-1], "long": torch.cat([d.rows, d.rows[:1]]), "flat": d.rows.reshape(-1)}[cut]
    with pytest.raises(ValueError, match=re.escape(f"combine: rows has shape {tuple(rows.shape)}") + r".*\[N=6, H\]"):
        disp.combine(rows, d.meta)
