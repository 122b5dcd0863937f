"""Expert-parallel dispatchers (moe's Dispatcher protocol) and the plumbing that applies EP to a model.

Shape legend: T local tokens, k slots, E experts, P ranks in the EP group, El = E / P local experts,
N rows this rank sends, R rows it receives, H hidden.

Flat dispatch, one EP group of P ranks:

    1. local sort   slots -> rows in global-expert order: rows for rank p are contiguous  [N, H]
    2. counts       fixed-shape all_to_all of counts [P, El] -> recv_counts [P, El] (+ layout check)
    3. all_to_all   rows -> received rows, grouped by source rank, expert-minor            [R, H]
                      src0: e0 e1 | src1: e0 e1 | ...
    4. reorder      -> local-expert-major for the grouped GEMM                             [R, H]
                      e0: src0 src1 | e1: src0 src1
    combine: 4^-1, all_to_all back, weighted unpermute (moe.dispatch) -> [T, H]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from moekit.comm.all_to_all import Traffic, agree_on_signature, all_to_all, exchange_counts
from moekit.moe.dispatch import Dispatched, PermuteMeta, permute, sort_slots, unpermute
from moekit.moe.router import Routing


class _Reorder(torch.autograd.Function):
    """x[order] for a permutation ``order``; backward applies the inverse permutation (a gather)."""

    @staticmethod
    def forward(ctx, x: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def source_to_expert_order(recv_counts: Tensor) -> Tensor:
    """[P, El] counts of received blocks (source-major) -> gather index making rows local-expert-major."""
    P, El = recv_counts.shape
    sizes = recv_counts.reshape(-1)
    total = int(sizes.sum())  # D2H sync: the caller already synced these counts
    src_start = torch.cumsum(sizes, 0) - sizes  # [P*El] block starts in source-major order
    em_sizes = recv_counts.t().reshape(-1)  # blocks in expert-major order
    em_src_start = src_start.view(P, El).t().reshape(-1)
    em_start = torch.cumsum(em_sizes, 0) - em_sizes
    shift = torch.repeat_interleave(em_src_start - em_start, em_sizes, output_size=total)
    return torch.arange(total, device=recv_counts.device) + shift


def _inverse(order: Tensor) -> Tensor:
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


@dataclass(frozen=True)
class EPMeta:
    local: PermuteMeta  # the source-side sort of this rank's slots
    send_splits: list[int]  # rows sent to each EP rank
    recv_splits: list[int]  # rows received from each EP rank
    order: Tensor  # [R] received -> local-expert-major
    inverse: Tensor  # [R] its inverse


class FlatEPDispatcher:
    """All-to-all over one EP group; each rank computes E/P experts on every rank's tokens for them.

    ``expert_range``: the contiguous block of E/P experts at this rank's position in ``group_ranks``.
    """

    def __init__(self, num_experts: int, group, group_ranks: list[int], node_of=None, traffic: Traffic | None = None):
        self.group, self.group_ranks = group, list(group_ranks)
        self.ep = len(group_ranks)
        if num_experts % self.ep:
            raise ValueError(f"num_experts={num_experts} is not divisible by the EP group size {self.ep}")
        self.num_experts, self.local_experts = num_experts, num_experts // self.ep
        self.node_of = node_of or (lambda r: 0)
        self.traffic = traffic if traffic is not None else Traffic()
        self.rank = dist.get_rank()
        position = self.group_ranks.index(self.rank)
        self.expert_range = (position * self.local_experts, (position + 1) * self.local_experts)
        self.signature = num_experts * 4096 + self.local_experts  # travels with every count exchange
        agree_on_signature(group, self.signature)  # before any count exchange: payload widths must match

    def dispatch(self, x: Tensor, routing: Routing) -> Dispatched:
        return self.dispatch_slots(x, routing.indices, routing.weights, routing.tokens_per_expert,
                                   may_drop=routing.capacity is not None)

    def dispatch_slots(self, x: Tensor, indices: Tensor, weights: Tensor, counts: Tensor,
                       may_drop: bool) -> Dispatched:
        """dispatch() on raw slots: indices [T, k] (-1 = no expert), weights [T, k], counts [E]."""
        T, k = indices.shape
        P, El = self.ep, self.local_experts
        send_counts = counts.view(P, El)  # [P, El] global experts are rank-contiguous
        recv_counts = exchange_counts(send_counts, self.group, signature=self.signature)
        # D2H sync: split sizes drive the variable-size exchange
        send_splits = send_counts.sum(1).cpu().tolist()
        recv_splits = recv_counts.sum(1).cpu().tolist()
        row_slot, slot_row = sort_slots(indices, sum(send_splits))
        local = PermuteMeta(T, k, row_slot, slot_row, weights, may_drop=may_drop)
        rows = permute(x, local)  # [N, H]
        self._count("dispatch", send_splits, rows)
        recv = all_to_all(rows, recv_splits, send_splits, self.group)  # [R, H] source-major
        order = source_to_expert_order(recv_counts)
        inverse = _inverse(order)
        meta = EPMeta(local, send_splits, recv_splits, order, inverse)
        return Dispatched(_Reorder.apply(recv, order, inverse), recv_counts.sum(0), meta)

    def combine(self, rows: Tensor, meta: EPMeta) -> Tensor:
        back = _Reorder.apply(rows, meta.inverse, meta.order)  # [R, H] source-major again
        self._count("combine", meta.recv_splits, back)
        mine = all_to_all(back, meta.send_splits, meta.recv_splits, self.group)  # [N, H] in my sort order
        return unpermute(mine, meta.local)

    def _count(self, phase: str, splits: list[int], rows: Tensor) -> None:
        row_bytes = rows.shape[-1] * rows.element_size()
        self.traffic.add(phase, splits, self.group_ranks, row_bytes, self.node_of, self.rank)


# ---------------------------------------------------------------------------------------------------
# Applying EP to a model
# ---------------------------------------------------------------------------------------------------


def shard_experts(layer: nn.Module, ep_mesh) -> tuple[int, int]:
    """Keep this rank's contiguous E/ep slice of the experts (after the full-tensor init: layout-free);
    returns the slice's global expert ids [lo, hi), which the EP dispatcher must send here.

    The weights become DTensors ``Shard(0)`` over the EP mesh: their global shape stays [E, ...], so
    checkpoints (torch.distributed.checkpoint) hold whole experts and load at any ep degree, FSDP can
    shard them further over the ranks holding the same experts, and the experts compute on
    ``to_local()`` (moe.experts). No communication: every rank already has the full initialised tensor.
    """
    experts = layer.experts
    E, ep_size, ep_rank = experts.w_in.shape[0], ep_mesh.size(), ep_mesh.get_local_rank()
    if E % ep_size:
        raise ValueError(f"num_experts={E} is not divisible by ep={ep_size}")
    lo, hi = ep_rank * E // ep_size, (ep_rank + 1) * E // ep_size
    for name in ("w_in", "w_out"):
        full = getattr(experts, name)
        shard = DTensor.from_local(full.detach()[lo:hi].clone(), ep_mesh, [Shard(0)], run_check=False)
        setattr(experts, name, nn.Parameter(shard, requires_grad=full.requires_grad))
    return lo, hi


def all_reduce_counts(group):
    """A moe CountReducer: per-expert counts summed over the data-parallel group (global-batch balancing)."""

    def reduce(counts: Tensor) -> Tensor:
        out = counts.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    return reduce


def apply_expert_parallel(model: nn.Module, topology, hierarchical: bool = False) -> Traffic:
    """Shard every MoE layer's experts over the EP group, install EP dispatchers and global balancing.

    Each layer's ``dispatcher.expert_range`` then names the experts this rank holds (the guard and tools
    read it there). Returns the shared Traffic counter (bytes per link class) the trainer logs.
    """
    from moekit.comm.hierarchical import HierarchicalEPDispatcher
    from moekit.moe.load import moe_layers

    traffic = Traffic()
    ep_ranks = topology.members("ep")
    if hierarchical:
        topology.check_hierarchical()
    for name, layer in moe_layers(model):
        # global-batch balancing: the counts of every rank of the stage (data ranks x TP token slices)
        layer.router.count_reducer = all_reduce_counts(topology.group("stage"))
        if topology.layout.ep == 1:
            continue
        held = shard_experts(layer, topology.mesh("experts")["ep"])
        if hierarchical:
            dispatcher = HierarchicalEPDispatcher(layer.num_experts, topology, traffic)
        else:
            dispatcher = FlatEPDispatcher(layer.num_experts, topology.group("ep"), ep_ranks, topology.node_of, traffic)
        # the mesh's shard (checkpoints, FSDP) and the all-to-all's destination must be the same experts
        assert dispatcher.expert_range == held, (name, dispatcher.expert_range, held)
        layer.dispatcher = dispatcher
    return traffic
