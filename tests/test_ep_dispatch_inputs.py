"""Input checks of the expert-parallel dispatchers (comm.expert_parallel, comm.hierarchical) on real gloo ranks.

Each bad input below is given on every rank and must raise the same ValueError there before any collective.
Without the checks these inputs were accepted (a wrong result, no error), raised another error deep inside,
or left a peer waiting in an all-to-all: the groups time out after TIMEOUT_S, so such a run fails, never hangs.
Good inputs (ragged token counts, an expert or a whole rank without tokens, a dropped slot) give what the
single-process LocalDispatcher gives, forward and backward.
"""
from __future__ import annotations

import re
from datetime import timedelta

import pytest
import torch

from moekit.comm.expert_parallel import FlatEPDispatcher
from moekit.comm.hierarchical import HierarchicalEPDispatcher
from moekit.comm.overlap import set_overlap
from moekit.comm.placement import default_placement
from moekit.comm.topology import Layout, Topology
from moekit.moe.dispatch import LocalDispatcher
from moekit.moe.router import Routing, count_experts
from tests.dist_utils import run_ranks

H, K = 4, 2
TIMEOUT_S = 10.0  # a rank left waiting in a collective raises after this long instead of hanging
# (world, ranks per node, hierarchical, E, experts no token is routed to)
FLAT = (2, 2, False, 4, (1,))
HIER = (4, 2, True, 8, (1, 6, 7))  # 2 simulated nodes of 2 ranks; rank 3 (experts 6, 7) receives nothing
CASES = {"flat": FLAT, "hierarchical": HIER}


def _topology(rank: int, world: int, per_node: int) -> Topology:
    return Topology(Layout(dp=world, ep=world), rank, per_node).build(timeout=timedelta(seconds=TIMEOUT_S))


def _dispatcher(topo: Topology, hierarchical: bool, E: int, placement=None):
    if hierarchical:
        return HierarchicalEPDispatcher(E, topo, placement=placement)
    return FlatEPDispatcher(E, topo.group("ep"), topo.members("ep"), topo.node_of, placement=placement)


def _tokens(world: int) -> list[int]:
    return [5, 3, 4, 2][:world]  # ragged: every rank a different number of tokens


def _global_routing(world: int, E: int, unused: tuple[int, ...], seed: int = 0):
    """x [T, H] float64 and a dropless-but-capacity routing of all ranks' tokens: K distinct experts per token
    among those not in ``unused``, one slot dropped (-1, weight 0)."""
    g = torch.Generator().manual_seed(seed)
    T = sum(_tokens(world))
    allowed = torch.tensor([e for e in range(E) if e not in unused])
    indices = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:K]] for _ in range(T)])
    weights = torch.rand(T, K, generator=g, dtype=torch.float64) + 0.1
    indices[1, 1], weights[1, 1] = -1, 0.0  # a slot capacity dropped
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    return x, indices, weights


def _routing(indices: torch.Tensor, weights: torch.Tensor, E: int) -> Routing:
    # capacity: a bound no expert reaches (LocalDispatcher then keeps a row per slot), but it says slots may drop
    return Routing(indices, weights, count_experts(indices, E), torch.zeros(()), capacity=indices.numel())


def _mine(rank: int, world: int) -> slice:
    sizes = _tokens(world)
    return slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))


def _experts(first: int):
    """A stand-in for the expert backends: row r of expert e -> tanh(row) * (e + 1); rows past counts.sum()
    (no expert's) -> 0."""

    def run(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        expert = torch.full((rows.shape[0],), -1, dtype=torch.int64)
        n = int(counts.sum())
        expert[:n] = torch.repeat_interleave(torch.arange(first, first + counts.numel()), counts)
        return torch.where(expert[:, None] >= 0, torch.tanh(rows) * (expert[:, None] + 1), 0.0)

    return run


# --------------------------------------------------------------------------------------------------
# good inputs: the same result as the one-process LocalDispatcher
# --------------------------------------------------------------------------------------------------


def _matches_local_rank(rank, world, per_node, hierarchical, E, unused):
    topo = _topology(rank, world, per_node)
    d = _dispatcher(topo, hierarchical, E)
    x_all, indices, weights = _global_routing(world, E, unused)
    x_ref = x_all.clone().requires_grad_()
    local = LocalDispatcher(E)
    ref = local.dispatch(x_ref, _routing(indices, weights, E))
    y_ref = local.combine(_experts(0)(ref.rows, ref.counts), ref.meta)
    c = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (y_ref * c).sum().backward()

    mine = _mine(rank, world)
    x = x_all[mine].clone().requires_grad_()
    out = d.dispatch(x, _routing(indices[mine], weights[mine], E))
    if rank == world - 1 and hierarchical:
        assert out.rows.shape[0] == 0 and out.counts.tolist() == [0, 0]  # a rank without tokens still takes part
    y = d.combine(_experts(d.expert_range[0])(out.rows, out.counts), out.meta)
    torch.testing.assert_close(y, y_ref[mine].detach())
    (y * c[mine]).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad[mine])


@pytest.mark.parametrize("case", CASES)
def test_good_inputs_match_local_dispatcher(case):
    world, per_node, hierarchical, E, unused = CASES[case]
    run_ranks(_matches_local_rank, world, per_node, hierarchical, E, unused)


# --------------------------------------------------------------------------------------------------
# construction: what the caller chooses
# --------------------------------------------------------------------------------------------------


def _num_experts_rank(rank, world, per_node, hierarchical, bad, match):
    topo = _topology(rank, world, per_node)
    for E in bad:
        with pytest.raises(ValueError, match=match.format(E=E)):
            _dispatcher(topo, hierarchical, E)
    _dispatcher(topo, hierarchical, 2 * world)  # the ranks still agree on a good one afterwards


@pytest.mark.parametrize("case", CASES)
def test_num_experts_must_be_a_positive_integer(case):
    world, per_node, hierarchical = CASES[case][:3]
    who = "HierarchicalEPDispatcher" if hierarchical else "FlatEPDispatcher"
    run_ranks(_num_experts_rank, world, per_node, hierarchical, [0, -world, float(2 * world)],
              who + r" num_experts={E!r} is invalid; it must be an integer >= 1")


@pytest.mark.parametrize("case,E,sizes", [("flat", 3, "[1, 3]"), ("hierarchical", 6, "[1, 2, 3, 6]")])
def test_num_experts_must_divide_over_the_ep_group(case, E, sizes):
    world, per_node, hierarchical = CASES[case][:3]
    who = "HierarchicalEPDispatcher" if hierarchical else "FlatEPDispatcher"
    match = (rf"{who} num_experts={{E}} is not divisible by the EP group size {world}: .*use a multiple of "
             rf"{world} experts or an EP group size among {re.escape(sizes)}")
    run_ranks(_num_experts_rank, world, per_node, hierarchical, [E], match)


def _group_ranks_rank(rank, world):
    topo = _topology(rank, world, world)
    group = topo.group("ep")
    with pytest.raises(ValueError, match=r"group_ranks=\[1, 0\] but the process group holds ranks \[0, 1\].*pass "
                                         r"group_ranks=dist.get_process_group_ranks\(group\)"):
        FlatEPDispatcher(4, group, [1, 0])
    # rank 0: a list that leaves rank 1 out; rank 1: a list without itself (it would wait for rank 0's setup)
    match = r"group_ranks=\[0\] but the process group holds" if rank == 0 else r"this rank \(1\) is not in group_ranks"
    with pytest.raises(ValueError, match=match):
        FlatEPDispatcher(4, group, [0])
    FlatEPDispatcher(4, group, [0, 1])


def test_flat_group_ranks_must_be_the_groups_ranks_in_order():
    run_ranks(_group_ranks_rank, 2)


# --------------------------------------------------------------------------------------------------
# dispatch and combine: the routing and the rows
# --------------------------------------------------------------------------------------------------


def _rank_inputs(rank, world, per_node, hierarchical, E, unused):
    """(this rank's dispatcher, its tokens, their routing) of the shared global routing."""
    d = _dispatcher(_topology(rank, world, per_node), hierarchical, E)
    x_all, indices, weights = _global_routing(world, E, unused)
    mine = _mine(rank, world)
    return d, x_all[mine], _routing(indices[mine], weights[mine], E)


def _tokens_rank(rank, world, per_node, hierarchical, E, unused):
    d, x_mine, routing = _rank_inputs(rank, world, per_node, hierarchical, E, unused)
    T = routing.indices.shape[0]
    # even ranks one row too many (without the check: dispatched anyway), odd ranks one too few (an IndexError
    # after the count exchange, while the even ranks wait in the all-to-all)
    n = T + 1 if rank % 2 == 0 else T - 1
    x = torch.randn(n, H, dtype=torch.float64)
    who = type(d).__name__
    with pytest.raises(ValueError, match=rf"{who}.dispatch got {n} tokens \(x.shape\[0\]\) but routing for {T} "
                                         r".*one row per token"):
        d.dispatch(x, routing)
    out = d.dispatch(x_mine, routing)  # the group still works
    d.combine(out.rows, out.meta)


@pytest.mark.parametrize("case", CASES)
def test_dispatch_tokens_must_match_the_routing(case):
    run_ranks(_tokens_rank, *CASES[case])


def _expert_counts_rank(rank, world, per_node, hierarchical, E, unused):
    topo = _topology(rank, world, per_node)
    who = type(_dispatcher(topo, hierarchical, E)).__name__
    mine = _mine(rank, world)
    for routed in (E // 2, 2 * E):  # fewer experts: ids all valid here; more: ids past E
        x, indices, weights = _global_routing(world, routed, ())
        routing = _routing(indices[mine], weights[mine], routed)
        match = (rf"{who}.dispatch: routing.tokens_per_expert has shape \({routed},\) but this {who} has "
                 rf"num_experts={E}; build the dispatcher and the router with the same number of experts")
        plain = _dispatcher(topo, hierarchical, E)
        # under a placement the counts are recomputed from the physical ids: the routing's are never read
        placed = _dispatcher(topo, hierarchical, E, default_placement(E, world, world))
        pipelined = _dispatcher(topo, hierarchical, E)
        set_overlap(pipelined, 2)
        for d in (plain, placed):
            with pytest.raises(ValueError, match=match):
                d.dispatch(x[mine], routing)
        with pytest.raises(ValueError, match=match):
            pipelined.pipelined(x[mine], routing, _experts(pipelined.expert_range[0]))


@pytest.mark.parametrize("case", CASES)
def test_dispatch_routing_must_be_for_the_dispatchers_experts(case):
    run_ranks(_expert_counts_rank, *CASES[case])


def _combine_rows_rank(rank, world, per_node, hierarchical, E, unused):
    d, x_mine, routing = _rank_inputs(rank, world, per_node, hierarchical, E, unused)
    out = d.dispatch(x_mine, routing)
    R = out.rows.shape[0]
    rows = _experts(d.expert_range[0])(out.rows, out.counts)
    # one row too many (without the check: combined anyway), and the rows flattened to 1-D
    for bad in (torch.cat([rows, rows.new_zeros(1, H)]), rows.reshape(-1)):
        with pytest.raises(ValueError, match=rf"combine: rows has shape {re.escape(str(tuple(bad.shape)))} but this "
                                             rf"expert-parallel dispatch delivered \[R={R}, H\] rows to this rank; "
                                             r"pass the experts' output"):
            d.combine(bad, out.meta)
    assert d.combine(rows, out.meta).shape == x_mine.shape  # the group still works
    # the chunked path: hierarchical combines through the same intra-node combine; flat checks in start_combine
    set_overlap(d, 2)

    def extra_row(rows, counts):
        return torch.cat([_experts(d.expert_range[0])(rows, counts), rows.new_zeros(1, H)])

    with pytest.raises(ValueError, match=r"combine: rows has shape .* but this expert-parallel dispatch"):
        d.pipelined(x_mine, routing, extra_row)


@pytest.mark.parametrize("case", CASES)
def test_combine_rows_must_be_one_per_dispatched_row(case):
    run_ranks(_combine_rows_rank, *CASES[case])
