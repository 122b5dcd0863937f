"""Collective hygiene of one MoE layer on real gloo ranks: how many collectives each layout issues, and
that ranks which disagree (layout, expert count, a skipped collective) fail with an error, never hang."""
from __future__ import annotations

import time
from collections import Counter
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from moekit.comm.all_to_all import SplitMismatchError
from moekit.comm.expert_parallel import FlatEPDispatcher, apply_expert_parallel
from moekit.comm.topology import Layout, Topology
from moekit.moe import MoELayer, build_router
from tests.dist_utils import run_ranks

H, FF, T = 8, 16, 6


def _layer(E: int, aux: float) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(H, FF, E, build_router("topk", H, E, top_k=2, aux_loss_coeff=aux), backend="loop")


def _counting(names=("all_to_all_single", "all_reduce")) -> Counter:
    """Wrap torch.distributed collectives (comm/ calls them as dist.<name>) with call counters."""
    calls = Counter()
    for name in names:
        real = getattr(dist, name)

        def wrapper(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, wrapper)
    return calls


# Per forward of one MoE layer: flat EP = count exchange + token all-to-all (dispatch) + token all-to-all
# (combine); hierarchical = on the rail (counts, rows, expert ids, weights; combine) and a flat exchange
# inside the node (counts, rows, combine). The aux loss adds one all_reduce of the per-expert counts.
CASES = {  # name: (ep, ranks per node, hierarchical, forward all-to-alls, backward all-to-alls)
    "ep1": (1, 2, False, 0, 0),
    "flat-ep2": (2, 2, False, 3, 2),  # backward: the two token exchanges reversed
    # backward: rail rows and weights (expert ids carry no gradient), inner dispatch and combine, rail combine
    "hierarchical-ep4": (4, 2, True, 8, 5),
}


def _count_rank(rank, world, cases):
    for name in cases:
        ep, per_node, hierarchical, a2a_fwd, a2a_bwd = CASES[name]
        topo = Topology(Layout(dp=world, ep=ep), rank, per_node).build()
        for aux, reduces in ((0.0, 0), (0.01, 1)):
            layer = _layer(2 * world, aux)
            apply_expert_parallel(layer, topo, hierarchical=hierarchical)
            x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank)).requires_grad_()
            calls = _counting()
            try:
                y = layer(x)
                assert calls == Counter(all_to_all_single=a2a_fwd, all_reduce=reduces), (name, aux, calls)
                calls.clear()
                y.square().sum().backward()
                assert calls == Counter(all_to_all_single=a2a_bwd), (name, aux, calls)
            finally:
                for op in ("all_to_all_single", "all_reduce"):
                    setattr(dist, op, getattr(dist.distributed_c10d, op))


@pytest.mark.parametrize("world,cases", [(2, ["ep1", "flat-ep2"]), (4, ["hierarchical-ep4"])])
def test_collectives_per_moe_layer(world, cases):
    run_ranks(_count_rank, world, cases)


def _disagreeing_rank(rank, world, timeout_s):
    # 1. rank 1 was built with 4 experts, rank 0 with 8: both fail at setup (count rows would differ in width)
    E = 8 if rank == 0 else 4
    with pytest.raises(SplitMismatchError, match="must build the same model"):
        FlatEPDispatcher(E, dist.group.WORLD, [0, 1])
    # 2. rank 1 never joins the layer's collectives: rank 0 raises after timeout_s instead of hanging
    topo = Topology(Layout(dp=world, ep=world), rank, world).build(timeout=timedelta(seconds=timeout_s))
    layer = _layer(4, 0.0)
    apply_expert_parallel(layer, topo)
    if rank == 0:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="(?i)timed? ?out"):
            layer(torch.randn(T, H))
        assert time.monotonic() - t0 < timeout_s + 5
    dist.barrier()  # the default group (60 s): rank 1 stays until rank 0 has seen its error


def test_disagreeing_ranks_fail_instead_of_hanging():
    run_ranks(_disagreeing_rank, 2, 3.0)
