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

Under a placement (comm.placement) the expert ids are first mapped to physical copies (copies on the
source's own node preferred: a replicated expert then often costs no inter-node row at all); node b holds
physical ids b*G*S .. (b+1)*G*S - 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moekit.comm.all_to_all import Traffic, agree_on_signature, all_to_all, exchange_counts
from moekit.comm.expert_parallel import (EPDispatcherBase, FlatEPDispatcher, RouteMap, check_ep_num_experts,
                                         check_expert_counts, check_tokens)
from moekit.comm.placement import Placement
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


class HierarchicalEPDispatcher(EPDispatcherBase):
    """``expert_range``: this rank's block inside its node's block of E / nodes experts (node-major); physical
    ids (position * S ..) under a placement, whose logical experts are ``local_expert_ids``."""

    def __init__(self, num_experts: int, topology, traffic: Traffic | None = None, placement: Placement | None = None):
        topology.check_hierarchical()
        self.ep_ranks = topology.members("ep")
        self.rail_ranks = topology.members("ep_rail")
        self.node_ranks = topology.members("ep_node")
        self.num_nodes, self.per_node = len(self.rail_ranks), len(self.node_ranks)
        self.ep = len(self.ep_ranks)
        # E / ep per rank; then E / nodes per node divides too (ep = nodes * per_node: check_hierarchical)
        check_ep_num_experts("HierarchicalEPDispatcher", num_experts, self.ep)
        self.num_experts = num_experts
        self.my_node = self.rail_ranks.index(topology.rank)  # my node's index inside the EP group
        self.rank, self.node_of = topology.rank, topology.node_of
        self.rail_group = topology.group("ep_rail")
        self.ep_group, self.ep_position = topology.group("ep"), self.ep_ranks.index(topology.rank)
        self.traffic = traffic if traffic is not None else Traffic()
        self.topology, self.inner = topology, None
        self.set_placement(placement)

    def set_placement(self, placement: Placement | None) -> None:
        """Route by ``placement`` from now on (None: contiguous blocks); collective over the EP group."""
        self.placement = self.checked(placement)
        S = self.num_experts // self.ep if self.placement is None else self.placement.slots_per_rank
        self.num_physical = self.ep * S
        self.experts_per_node = self.num_physical // self.num_nodes  # physical ids per node
        if self.inner is None or self.inner.num_experts != self.experts_per_node:
            topology = self.topology
            self.inner = FlatEPDispatcher(self.experts_per_node, topology.group("ep_node"), self.node_ranks,
                                          topology.node_of, self.traffic)
        first = self.my_node * self.experts_per_node  # inner ids count from my node's first expert
        self.expert_range = (first + self.inner.expert_range[0], first + self.inner.expert_range[1])
        self.local_expert_ids = (tuple(range(*self.expert_range)) if self.placement is None
                                 else self.placement.slots[self.ep_position])
        nodes = tuple(self.node_of(r) for r in self.ep_ranks)
        self.routes = None if self.placement is None else RouteMap(self.placement, self.ep_position, nodes)
        self.signature = self.num_physical * 4096 + self.num_nodes
        if self.placement is not None:
            self.signature += self.placement.signature() << 32
            agree_on_signature(self.ep_group, self.signature)

    # The fused permute (moe.experts.FUSED_PERMUTE) as flat EP offers it, from the intra-node exchange: dispatch(
    # fuse_gather=True) leaves its reorder to the experts' first GEMM, combine(weighted=False) the routing weights to
    # their last (row_weights: each (token, node) row's weights on that node travel with it, then with its rows)
    fuses_gather = True
    fuses_weights = True

    def dispatch(self, x: Tensor, routing: Routing, *, fuse_gather: bool = False) -> Dispatched:
        """``fuse_gather``: the received rows as they came inside the node, with a RowGather (FlatEPDispatcher)."""
        # routing.tokens_per_expert is not read below, but its shape is the routing's number of experts
        check_tokens("HierarchicalEPDispatcher", x, routing)
        check_expert_counts("HierarchicalEPDispatcher", routing, self.num_experts)
        indices = self.physical(routing)
        node_ids = self.node_slots(indices)
        m = self.num_nodes
        send_counts = count_experts(node_ids, m)  # [m] rows per destination node
        recv_counts = exchange_counts(send_counts.view(m, 1), self.rail_group, signature=self.signature)
        # D2H sync: split sizes of the inter-node exchange
        send_splits, recv_splits = send_counts.cpu().tolist(), recv_counts.view(-1).cpu().tolist()
        rows, ids_rows, w_rows, nodes = self.to_nodes(x, indices, routing.weights, node_ids, sum(send_splits))
        self.count_rail("dispatch", send_splits, rows)
        # 2. across nodes on the rail, then a flat EP dispatch inside the destination node
        recv = all_to_all(rows, recv_splits, send_splits, self.rail_group)  # [R1, H]
        recv_ids = all_to_all(ids_rows, recv_splits, send_splits, self.rail_group)  # [R1, k]
        recv_w = all_to_all(w_rows, recv_splits, send_splits, self.rail_group)  # [R1, k]
        return self.inside_node(recv, recv_ids, recv_w, nodes, send_splits, recv_splits, fuse_gather)

    def physical(self, routing: Routing) -> Tensor:
        """[T, k] the slots' physical expert ids (logical ones without a placement)."""
        return routing.indices if self.routes is None else self.routes(routing.indices)

    def node_slots(self, indices: Tensor) -> Tensor:
        """[T, m] virtual slots: node j where token t has at least one expert on node j, else -1."""
        T, m = indices.shape[0], self.num_nodes
        kept = indices >= 0
        visits = torch.zeros(T, m + 1, dtype=torch.bool, device=indices.device)
        visits.scatter_(1, torch.where(kept, indices // self.experts_per_node, m), True)
        return torch.where(visits[:, :m], torch.arange(m, device=indices.device), -1)

    def to_nodes(self, x: Tensor, indices: Tensor, weights: Tensor, node_ids: Tensor, num_rows: int):
        """1. one row per (token, node), node-major, with the token's slots on that node: (rows [N1, H],
        ids [N1, k] expert ids on the destination node (-1 elsewhere), weights [N1, k], PermuteMeta)."""
        T, k = indices.shape
        m, Epn = self.num_nodes, self.experts_per_node
        slot_node = torch.where(indices >= 0, indices // Epn, -1)  # [T, k]
        row_slot, slot_row = sort_slots(node_ids, num_rows)
        nodes = PermuteMeta(T, m, row_slot, slot_row, (node_ids >= 0).to(weights.dtype), may_drop=True)
        rows = permute(x, nodes)  # [N1, H]
        node_range = torch.arange(m, device=x.device)
        node_of_slot = slot_node[:, None, :] == node_range[None, :, None]  # [T, m, k]
        local_ids = torch.where(node_of_slot, indices[:, None, :] - node_range[None, :, None] * Epn, -1)
        local_w = torch.where(node_of_slot, weights[:, None, :], 0.0)  # [T, m, k]
        ids_rows = local_ids.view(T * m, k).index_select(0, row_slot)  # [N1, k] ids on the destination node
        w_rows = _SelectRows.apply(local_w.view(T * m, k), row_slot)  # [N1, k]
        return rows, ids_rows, w_rows, nodes

    def inside_node(self, recv: Tensor, recv_ids: Tensor, recv_w: Tensor, nodes: PermuteMeta,
                    send_splits: list[int], recv_splits: list[int], fuse_gather: bool = False) -> Dispatched:
        """2b. the rows that arrived on the rail, dispatched by a flat EP exchange inside this node."""
        inner = self.inner.dispatch_slots(recv, recv_ids, recv_w, count_experts(recv_ids, self.experts_per_node),
                                          may_drop=True, fuse_gather=fuse_gather)
        return Dispatched(inner.rows, inner.counts, HierMeta(nodes, send_splits, recv_splits, inner.meta), inner.gather)

    def row_weights(self, meta: HierMeta) -> Tensor:
        """[R] float32: each expert row's routing weight, in the experts' order (collective over the node's EP
        ranks: FlatEPDispatcher.row_weights of the intra-node exchange)."""
        return self.inner.row_weights(meta.inner)

    def count_rail(self, phase: str, splits: list[int], rows: Tensor) -> None:
        self.traffic.add(phase, splits, self.rail_ranks, rows.shape[-1] * rows.element_size(), self.node_of, self.rank)

    def combine(self, rows: Tensor, meta: HierMeta, *, weighted: bool = True) -> Tensor:
        """``weighted=False``: the rows carry their weights already (row_weights): the sums are plain."""
        # 3. weighted sum over the token's experts on this node, then one row back across nodes; the inner
        # combine checks rows (expert_parallel.check_combine_rows) before its all-to-all, the first collective here
        partial = self.inner.combine(rows, meta.inner, weighted=weighted)  # [R1, H]
        self.count_rail("combine", meta.recv_splits, partial)
        back = all_to_all(partial, meta.send_splits, meta.recv_splits, self.rail_group)  # [N1, H]
        # 4. sum over the nodes each token visited (weights are 1 there: expert weights were applied)
        return unpermute(back, meta.nodes)
