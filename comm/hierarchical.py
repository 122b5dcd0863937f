"""Two-level expert-parallel dispatch: across nodes once per (token, node), then inside the node.

Shape legend: T local tokens, k slots, m nodes in the EP group, g EP ranks per node, El local experts,
N1 (token, node) rows this rank sends across nodes, R1 rows it receives, H hidden.

    source rank (node a, position i)                     destination node b
    ------------------------------------                 ------------------------------------------
    1. one row per (token, destination node)  --rail-->  2. the peer at position i on node b receives
       with the token's slots on that node               it, with the k expert ids and weights (ids of
       (ids / weights, -1 / 0 elsewhere)                 other nodes masked) and runs a flat EP
                                                            dispatch inside node b (intra-node links)
    4. out[t] = sum over its nodes of the     <--rail--  3. combine inside node b: the weighted sum over
       returned partial sums                                the token's experts on b, one row back

A token with several experts on one remote node crosses the node boundary once each way (dedup); the
weighted sum of its experts on that node is taken before the return trip. The rail group is the set of
EP ranks with the same position on every node, so inter-node traffic runs between matching local ranks
(one NIC rail each on typical clusters).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moekit.comm.all_to_all import Traffic, all_to_all, exchange_counts
from moekit.comm.expert_parallel import FlatEPDispatcher
from moekit.moe.dispatch import Dispatched, PermuteMeta, permute, sort_slots, unpermute
from moekit.moe.router import Routing, count_experts


class _SelectRows(torch.autograd.Function):
    """src[index] for an injective index; backward scatters into distinct rows (deterministic)."""

    @staticmethod
    def forward(ctx, src: Tensor, index: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        ctx.num_rows = src.shape[0]
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.num_rows,) + tuple(grad.shape[1:]))
        return out.index_copy_(0, index, grad), None


@dataclass(frozen=True)
class HierMeta:
    nodes: PermuteMeta  # source side: (token, node) rows, weights 1 where the token visits the node
    send_splits: list[int]
    recv_splits: list[int]
    inner: object  # the intra-node flat dispatcher's metadata


class HierarchicalEPDispatcher:
    """``expert_range``: this rank's block inside its node's block of E / nodes experts (node-major)."""

    def __init__(self, num_experts: int, topology, traffic: Traffic | None = None):
        topology.check_hierarchical()
        self.num_experts = num_experts
        self.ep_ranks = topology.members("ep")
        self.rail_ranks = topology.members("ep_rail")
        self.node_ranks = topology.members("ep_node")
        self.num_nodes, self.per_node = len(self.rail_ranks), len(self.node_ranks)
        P = len(self.ep_ranks)
        if num_experts % P:
            raise ValueError(f"num_experts={num_experts} is not divisible by the EP group size {P}")
        self.experts_per_node = num_experts // self.num_nodes
        self.my_node = self.rail_ranks.index(topology.rank)  # my node's index inside the EP group
        self.rank, self.node_of = topology.rank, topology.node_of
        self.rail_group = topology.group("ep_rail")
        self.traffic = traffic if traffic is not None else Traffic()
        self.inner = FlatEPDispatcher(self.experts_per_node, topology.group("ep_node"), self.node_ranks,
                                      topology.node_of, self.traffic)
        first = self.my_node * self.experts_per_node  # inner ids count from my node's first expert
        self.expert_range = (first + self.inner.expert_range[0], first + self.inner.expert_range[1])

    def dispatch(self, x: Tensor, routing: Routing) -> Dispatched:
        T, k = routing.indices.shape
        m, Epn = self.num_nodes, self.experts_per_node
        kept = routing.indices >= 0
        slot_node = torch.where(kept, routing.indices // Epn, -1)  # [T, k]
        visits = torch.zeros(T, m + 1, dtype=torch.bool, device=x.device)
        visits.scatter_(1, torch.where(kept, slot_node, m), True)
        visits = visits[:, :m]  # [T, m] token t has at least one expert on node j
        node_ids = torch.where(visits, torch.arange(m, device=x.device), -1)  # [T, m] virtual slots
        send_counts = count_experts(node_ids, m)  # [m] rows per destination node
        recv_counts = exchange_counts(send_counts.view(m, 1), self.rail_group, signature=self.num_experts * 4096 + m)
        # D2H sync: split sizes of the inter-node exchange
        send_splits, recv_splits = send_counts.cpu().tolist(), recv_counts.view(-1).cpu().tolist()
        row_slot, slot_row = sort_slots(node_ids, sum(send_splits))
        nodes = PermuteMeta(T, m, row_slot, slot_row, visits.to(routing.weights.dtype), may_drop=True)
        # 1. rows and their per-node routing, one per (token, node), node-major
        rows = permute(x, nodes)  # [N1, H]
        node_of_slot = slot_node[:, None, :] == torch.arange(m, device=x.device)[None, :, None]  # [T, m, k]
        local_ids = torch.where(node_of_slot, routing.indices[:, None, :] - torch.arange(m, device=x.device)[None, :, None] * Epn, -1)
        local_w = torch.where(node_of_slot, routing.weights[:, None, :], 0.0)  # [T, m, k]
        ids_rows = local_ids.view(T * m, k).index_select(0, row_slot)  # [N1, k] ids on the destination node
        w_rows = _SelectRows.apply(local_w.view(T * m, k), row_slot)  # [N1, k]
        self.traffic.add("dispatch", send_splits, self.rail_ranks, rows.shape[-1] * rows.element_size(),
                         self.node_of, self.rank)
        # 2. across nodes on the rail, then a flat EP dispatch inside the destination node
        recv = all_to_all(rows, recv_splits, send_splits, self.rail_group)  # [R1, H]
        recv_ids = all_to_all(ids_rows, recv_splits, send_splits, self.rail_group)  # [R1, k]
        recv_w = all_to_all(w_rows, recv_splits, send_splits, self.rail_group)  # [R1, k]
        inner = self.inner.dispatch_slots(recv, recv_ids, recv_w, count_experts(recv_ids, Epn), may_drop=True)
        meta = HierMeta(nodes, send_splits, recv_splits, inner.meta)
        return Dispatched(inner.rows, inner.counts, meta)

    def combine(self, rows: Tensor, meta: HierMeta) -> Tensor:
        # 3. weighted sum over the token's experts on this node, then one row back across nodes
        partial = self.inner.combine(rows, meta.inner)  # [R1, H]
        self.traffic.add("combine", meta.recv_splits, self.rail_ranks, partial.shape[-1] * partial.element_size(),
                         self.node_of, self.rank)
        back = all_to_all(partial, meta.send_splits, meta.recv_splits, self.rail_group)  # [N1, H]
        # 4. sum over the nodes each token visited (weights are 1 there: expert weights were applied)
        return unpermute(back, meta.nodes)
