"""Sequence-wise balancing (moe.router.Router, balance="sequence") across ranks that cut sequences: an MoE layer
under the TP token split, whose contiguous slices of the flattened tokens cut a sequence in two, reproduces one
process's output, aux loss and router gradient (gloo, real ranks). Whole models under tp / sp / cp / dp:
tests/test_context_parallel.py's layouts with balance="sequence"."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moekit.comm.expert_parallel import install_sequence_balance
from moekit.comm.tensor_parallel import TPTokenSplit
from moekit.comm.topology import Layout, Topology
from moekit.moe.layer import MoELayer, set_aux_loss_scale
from moekit.moe.router import build_router
from tests.dist_utils import run_ranks

H, E, B, S = 16, 4, 3, 5  # 15 tokens: the TP slices 8 | 7 cut sequence 1 after 3 tokens


def _layer(seed: int = 0) -> MoELayer:
    torch.manual_seed(seed)
    router = build_router("topk", H, E, top_k=2, aux_loss_coeff=0.5, z_loss_coeff=0.0, balance="sequence")
    return MoELayer(H, 12, E, router)


def _tp_rank(rank: int, world: int):
    topo = Topology(Layout(tp=2), rank, world).build()
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(3))
    probe = torch.randn(B, S, H, generator=torch.Generator().manual_seed(4))
    ref = _layer()
    want = ref(x)
    (want * probe).sum().backward()
    layer = _layer()
    layer.token_split = TPTokenSplit(topo.group("tp"), rank, 2)
    install_sequence_balance(layer.router, topo)
    set_aux_loss_scale(layer, token_slices=2)
    assert layer.router.sequence_parts == 2
    grid = layer.token_split.sequences(x)
    assert (grid.offset, grid.length, grid.count) == (0 if rank == 0 else 8, S, B)
    assert grid.ids(8 if rank == 0 else 7).tolist() == ([0] * 5 + [1] * 3 if rank == 0 else [1] * 2 + [2] * 5)
    got = layer(x)
    (got * probe).sum().backward()
    torch.testing.assert_close(got, want)
    grad = layer.router.weight.grad.clone()
    dist.all_reduce(grad)  # comm.grad_sync sums a router's gradient over the TP ranks ("stage" group)
    torch.testing.assert_close(grad, ref.router.weight.grad, rtol=1e-5, atol=1e-7)


def test_tp_token_split_cutting_a_sequence_reproduces_one_process():
    run_ranks(_tp_rank, 2)


def test_sequence_ids_of_each_split():
    """LocalTokens: every row of a [B, S, H] input; a [T, H] input is one sequence."""
    layer = _layer()
    grid = layer.token_split.sequences(torch.zeros(2, 3, H))
    assert grid.ids(6).tolist() == [0, 0, 0, 1, 1, 1] and grid.count == 2
    grid = layer.token_split.sequences(torch.zeros(4, H))
    assert grid.ids(4).tolist() == [0, 0, 0, 0] and grid.count == 1
    with pytest.raises(ValueError, match="balance='sequence'"):
        build_router("topk", H, E, balance="sequence")(torch.zeros(4, H))
