"""Expert parallelism on real gloo processes: all-to-all, flat and hierarchical EP layers vs one process."""
import copy

import pytest
import torch
import torch.distributed as dist

from moekit.comm.all_to_all import SplitMismatchError, all_to_all, exchange_counts
from moekit.comm.expert_parallel import apply_expert_parallel
from moekit.comm.grad_sync import gradient_roles, sync_gradients
from moekit.comm.topology import Layout, LayoutError, Topology
from moekit.moe import MoELayer, build_router
from tests.dist_utils import run_ranks

H, FF = 8, 16


# --------------------------------------------------------------------------------------------------
# all-to-all vs a reference built from all_gather
# --------------------------------------------------------------------------------------------------


def _a2a_rank(rank, world):
    g = torch.Generator().manual_seed(123)
    splits = torch.randint(0, 4, (world, world), generator=g)  # splits[src, dst], zeros included
    splits[0, :] = 0  # rank 0 sends nothing
    splits[:, world - 1] = 0  # the last rank receives nothing
    payloads = [torch.randn(int(splits[s].sum()), 3, generator=g, dtype=torch.float64) for s in range(world)]
    x = payloads[rank].clone().requires_grad_()
    out = all_to_all(x, splits[:, rank].tolist(), splits[rank].tolist(), dist.group.WORLD)
    # reference: the block src -> rank is a slice of the (known) payload of src
    expect = [payloads[s][int(splits[s, :rank].sum()): int(splits[s, : rank + 1].sum())] for s in range(world)]
    torch.testing.assert_close(out, torch.cat(expect))
    # backward: grad of sum(out * c_rank) w.r.t. x equals c of whoever received each row
    coeffs = [torch.randn(int(splits[:, d].sum()), 3, generator=g, dtype=torch.float64) for d in range(world)]
    (out * coeffs[rank]).sum().backward()
    grads = []
    for d in range(world):
        start = int(splits[:rank, d].sum())
        grads.append(coeffs[d][start : start + int(splits[rank, d])])
    torch.testing.assert_close(x.grad, torch.cat(grads))
    # counts with a matching signature pass, a mismatching one fails on every rank (no hang)
    recv = exchange_counts(splits[rank].view(world, 1), dist.group.WORLD, signature=7)
    assert recv.view(-1).tolist() == splits[:, rank].tolist()
    with pytest.raises(SplitMismatchError, match="signature"):
        exchange_counts(splits[rank].view(world, 1), dist.group.WORLD, signature=7 + (rank == 1))


@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_uneven_splits(world):
    run_ranks(_a2a_rank, world)


# --------------------------------------------------------------------------------------------------
# EP layer == single-process layer on the same global tokens
# --------------------------------------------------------------------------------------------------


def _build_reference(E, k, seed, skew_away_from=None):
    torch.manual_seed(seed)
    opts = {}
    if skew_away_from is not None:  # a selection-only bias: the experts of one rank get no tokens at all
        bias = torch.zeros(E)
        bias[skew_away_from] = -1e4
        opts["expert_bias"] = bias
    router = build_router("topk", H, E, top_k=k, aux_loss_coeff=0.1, z_loss_coeff=0.01, **opts)
    return MoELayer(H, FF, E, router, backend="loop").double()


def _ep_layer_rank(rank, world, E, k, tokens, per_node, hierarchical, skew, seed):
    D = world
    topo = Topology(Layout(dp=D, ep=world), rank, per_node).build()
    El = E // world
    skew_slice = slice((world - 1) * El, world * El) if skew else None
    ref = _build_reference(E, k, seed, skew_slice)
    ep = copy.deepcopy(ref)
    traffic = apply_expert_parallel(ep, topo, hierarchical=hierarchical)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(D * tokens, H, generator=g, dtype=torch.float64)
    c = torch.randn(D * tokens, H, generator=g, dtype=torch.float64)
    ref.train(), ep.train()
    y_ref = ref(x)
    ((y_ref * c).sum() / (D * tokens)).backward()
    mine = slice(rank * tokens, (rank + 1) * tokens)
    y = ep(x[mine])
    torch.testing.assert_close(y, y_ref[mine].detach())
    ((y * c[mine]).sum() / tokens).backward()
    sync_gradients(ep, topo, gradient_roles(ep))
    lo, hi = ep.dispatcher.expert_range  # the experts this rank holds: its block of E / world
    assert (lo, hi) == (rank * El, (rank + 1) * El)
    torch.testing.assert_close(ep.router.weight.grad, ref.router.weight.grad)
    torch.testing.assert_close(ep.experts.w_in.grad.to_local(), ref.experts.w_in.grad[lo:hi])
    torch.testing.assert_close(ep.experts.w_out.grad.to_local(), ref.experts.w_out.grad[lo:hi])
    if skew and rank == world - 1:
        assert ep.load.summary().tokens_per_expert[lo:hi] == [0] * El  # my experts got nothing, still fine
    assert ep.load.summary().total_slots == tokens * k
    stats = traffic.snapshot()
    assert all(v >= 0 for v in stats.values())
    # expert shards are DTensors with the global [E, ...] shape: checkpoints hold whole experts
    sd = ep.state_dict()
    assert sd["experts.w_in"].shape == ref.experts.w_in.shape
    torch.testing.assert_close(sd["experts.w_in"].full_tensor(), ref.experts.w_in.detach())


@pytest.mark.parametrize("world,E,k,skew", [(2, 4, 2, False), (4, 8, 3, True)])
def test_flat_ep_layer_equals_single_process(world, E, k, skew):
    run_ranks(_ep_layer_rank, world, E, k, 6, world, False, skew, 11)


@pytest.mark.parametrize("world,per_node", [(4, 2), (8, 4)])
def test_hierarchical_ep_layer_equals_single_process(world, per_node):
    run_ranks(_ep_layer_rank, world, 2 * world, 3, 5, per_node, True, False, 5)


def _traffic_rank(rank, world, per_node):
    E, k, T = 2 * world, 3, 12
    topo = Topology(Layout(dp=world, ep=world), rank, per_node).build()
    ref = _build_reference(E, k, 3)
    flat, hier = copy.deepcopy(ref), copy.deepcopy(ref)
    tf = apply_expert_parallel(flat, topo, hierarchical=False)
    th = apply_expert_parallel(hier, topo, hierarchical=True)
    x = torch.randn(world * T, H, generator=torch.Generator().manual_seed(9), dtype=torch.float64)[rank * T:(rank + 1) * T]
    yf, yh = flat(x), hier(x)
    torch.testing.assert_close(yh, yf)
    bf, bh = tf.snapshot(), th.snapshot()
    # exact inter-node bytes: one row per (token, remote node it has experts on), each way
    idx = ref.router(x).indices
    Epn, my_node = E // (world // per_node), rank // per_node
    distinct_remote = sum(len({e // Epn for e in row} - {my_node}) for row in idx.tolist())
    row = H * x.element_size()
    assert bh.get("dispatch_inter", 0) == distinct_remote * row
    remote_slots = sum(sum(1 for e in r if e // Epn != my_node) for r in idx.tolist())
    assert bf.get("dispatch_inter", 0) == remote_slots * row >= bh.get("dispatch_inter", 0)
    totals = torch.tensor([bh.get("dispatch_inter", 0), bf.get("dispatch_inter", 0)])
    dist.all_reduce(totals)
    assert totals[0] < totals[1]  # k=3 over 2 nodes: dedup must save something somewhere


@pytest.mark.parametrize("world,per_node", [(4, 2)])
def test_hierarchical_dedups_inter_node_bytes(world, per_node):
    run_ranks(_traffic_rank, world, per_node)


# --------------------------------------------------------------------------------------------------
# Topology validation (no processes needed)
# --------------------------------------------------------------------------------------------------


def test_layout_validation_messages():
    with pytest.raises(LayoutError, match="world size is 4"):
        Layout(dp=2, ep=2).validate(4)
    with pytest.raises(LayoutError, match="num_experts=6 is not divisible by ep=4"):
        Layout(dp=4, ep=4).validate(4, num_experts=6)
    with pytest.raises(LayoutError, match="ep=3 must divide"):
        Layout(dp=4, ep=3).validate(4)
    with pytest.raises(LayoutError, match="not divisible by pp"):
        Layout.infer(6, tp=4)
    assert Layout.infer(8, tp=2, ep=2) == Layout(pp=1, dp=4, fsdp=1, tp=2, ep=2)


def test_group_membership():
    topo = Topology(Layout(pp=1, dp=4, fsdp=1, tp=2, ep=2), rank=2, ranks_per_node=4)
    assert topo.members("dp") == [0, 2, 4, 6]
    assert topo.members("ep") == [2, 0][::-1] and topo.members("edp") == [2, 6]
    big = Topology(Layout(dp=8, ep=8), rank=5, ranks_per_node=4)
    assert big.members("ep_node") == [4, 5, 6, 7] and big.members("ep_rail") == [1, 5]
    uneven = Topology(Layout(dp=12, ep=6), rank=0, ranks_per_node=4)  # group 0-5: 4 + 2 ranks
    with pytest.raises(LayoutError, match="spread evenly"):
        uneven.check_hierarchical()
