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
                    (with dispatch(fuse_gather=True): left to the experts' first GEMM, which reads
                     the received rows in place: moe.dispatch.RowGather)
    combine: 4^-1, all_to_all back, weighted unpermute (moe.dispatch) -> [T, H]

With a placement (comm.placement) the expert ids above are physical: step 0 maps each slot's logical
expert to one of its copies (``RouteMap``), so rank p's S slots are again the contiguous ids p*S .. and
steps 1-4 run unchanged with El = S.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from moekit.comm.all_to_all import Traffic, agree_on_signature, all_to_all, exchange_counts
from moekit.comm.placement import Placement
from moekit.moe.dispatch import Dispatched, PermuteMeta, RowGather, permute, row_weights, sort_slots, unpermute
from moekit.moe.router import Routing, check_int, count_experts


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


class RouteMap:
    """Logical expert ids [T, k] -> physical ids under a placement, for the tokens of one EP position: a
    slot goes to one copy of its expert (Placement.route_table: copies on the source's node first), token
    t of source position i to copy (t + i) mod #copies, so a replicated expert's tokens split evenly."""

    def __init__(self, placement: Placement, source: int, nodes: tuple[int, ...] | None = None):
        table = placement.route_table(source, nodes)
        width = max(len(c) for c in table)
        self.table = torch.tensor([c + c[:1] * (width - len(c)) for c in table])  # [E, width] padded
        self.count = torch.tensor([len(c) for c in table])  # [E]
        self.source = source

    def __call__(self, indices: Tensor) -> Tensor:
        if self.table.device != indices.device:
            self.table, self.count = self.table.to(indices.device), self.count.to(indices.device)
        safe = indices.clamp(min=0)  # [T, k]; -1 (dropped) stays -1 below
        token = torch.arange(indices.shape[0], device=indices.device)[:, None]
        pick = (token + self.source) % self.count[safe]
        return torch.where(indices >= 0, self.table[safe, pick], -1)


# ---------------------------------------------------------------------------------------------------
# Input checks: shapes and Python ints only (no host sync), run on every rank before its first collective.
# Every rank given the same bad input raises the same ValueError instead of one of them raising deep inside
# (an IndexError after the count exchange) while its peers wait in the all-to-all, or the exchange running
# on wrong data. A rank whose peers' inputs are fine still leaves them waiting until the group's timeout.
# ---------------------------------------------------------------------------------------------------


def check_ep_num_experts(who: str, num_experts, ep: int) -> None:
    """``num_experts``: a positive integer that the ``ep`` ranks of the EP group split evenly."""
    check_int(f"{who} num_experts", num_experts, 1)
    if num_experts % ep:
        sizes = sorted({d for i in range(1, math.isqrt(num_experts) + 1) if num_experts % i == 0
                        for d in (i, num_experts // i)})
        raise ValueError(f"{who} num_experts={num_experts} is not divisible by the EP group size {ep}: every rank "
                         f"holds num_experts / ep experts; use a multiple of {ep} experts or an EP group size "
                         f"among {sizes}")


def check_tokens(who: str, x: Tensor, routing: Routing) -> None:
    """One row of ``x`` per routed token."""
    T = routing.indices.shape[0]
    if x.shape[0] != T:
        raise ValueError(f"{who}.dispatch got {x.shape[0]} tokens (x.shape[0]) but routing for {T} "
                         f"(routing.indices.shape[0]); pass the x the router routed, one row per token")


def check_expert_counts(who: str, routing: Routing, num_experts: int) -> None:
    """The routing is for ``num_experts`` (logical) experts: its tokens_per_expert has shape [E]."""
    shape = routing.tokens_per_expert.shape  # the routing's number of experts: shape only, no sync
    if shape != (num_experts,):
        raise ValueError(f"{who}.dispatch: routing.tokens_per_expert has shape {tuple(shape)} but this {who} has "
                         f"num_experts={num_experts}; build the dispatcher and the router with the same number of "
                         f"experts")


def check_combine_rows(rows: Tensor, num_rows: int) -> None:
    """``rows``: [R, H], one per row the dispatch delivered to this rank (the flat and, through its intra-node
    dispatcher, the hierarchical combine)."""
    if rows.dim() != 2 or rows.shape[0] != num_rows:
        raise ValueError(f"combine: rows has shape {tuple(rows.shape)} but this expert-parallel dispatch delivered "
                         f"[R={num_rows}, H] rows to this rank; pass the experts' output for Dispatched.rows (one "
                         f"row each, same order)")


class EPDispatcherBase:
    """What the flat and the hierarchical EP dispatcher share: the chunked overlap entry point and the
    placement check. Subclasses set ``ep`` and ``num_experts``."""

    overlap_chunks, overlap_trace = 1, None  # comm.overlap.set_overlap: > 1 pipelines dispatch / experts / combine

    def pipelined(self, x: Tensor, routing: Routing, experts) -> Tensor:
        """dispatch -> experts -> combine in ``overlap_chunks`` overlapped chunks (comm.overlap); MoELayer
        calls it instead of the three when ``overlap_chunks`` > 1."""
        from moekit.comm.overlap import pipelined

        check_expert_counts(type(self).__name__, routing, self.num_experts)  # overlap.pipelined checks the tokens
        return pipelined(self, x, routing, experts)

    def checked(self, placement: Placement | None) -> Placement | None:
        """``placement`` if it fits this EP group (None for a contiguous one: the plain blocks)."""
        if placement is not None and (placement.ep, placement.num_experts) != (self.ep, self.num_experts):
            raise ValueError(f"placement for ep={placement.ep}, {placement.num_experts} experts; this EP group has "
                             f"{self.ep} ranks and {self.num_experts} experts")
        return None if placement is None or placement.is_contiguous else placement


class FlatEPDispatcher(EPDispatcherBase):
    """All-to-all over one EP group; each rank computes S experts on every rank's tokens for them.

    ``expert_range``: the ids [lo, hi) of this rank's S experts (physical ids: position * S ..);
    ``local_expert_ids``: the logical expert in each of them (the contiguous block without a placement).
    ``placement``: None (contiguous blocks of E/P) or a comm.placement.Placement; ``set_placement`` swaps it.
    """

    def __init__(self, num_experts: int, group, group_ranks: list[int], node_of=None, traffic: Traffic | None = None,
                 placement: Placement | None = None):
        self.group, self.group_ranks = group, list(group_ranks)
        self.ep = len(group_ranks)
        self.rank = dist.get_rank()
        self.check_group(group, self.group_ranks, self.rank)
        check_ep_num_experts("FlatEPDispatcher", num_experts, self.ep)
        self.num_experts = num_experts
        self.node_of = node_of or (lambda r: 0)
        self.traffic = traffic if traffic is not None else Traffic()
        self.ep_group, self.ep_position = group, self.group_ranks.index(self.rank)
        self.set_placement(placement)

    @staticmethod
    def check_group(group, group_ranks: list[int], rank: int) -> None:
        """``group_ranks``: the global ranks of ``group`` in its group-rank order (the all-to-all sends split p
        to group rank p and ``expert_range`` follows this rank's index), this rank among them."""
        if rank not in group_ranks or group == dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(f"FlatEPDispatcher: this rank ({rank}) is not in group_ranks={group_ranks} or not a "
                             f"member of the process group; build the dispatcher only on the ranks of its EP group, "
                             f"with that group and its ranks")
        members = dist.get_process_group_ranks(group)
        if group_ranks != members:
            raise ValueError(f"FlatEPDispatcher: group_ranks={group_ranks} but the process group holds ranks {members} "
                             f"(in group-rank order, which the all-to-all's splits follow); pass "
                             f"group_ranks=dist.get_process_group_ranks(group) (with a Topology: group('ep') and "
                             f"members('ep'))")

    def set_placement(self, placement: Placement | None) -> None:
        """Route by ``placement`` from now on (None or contiguous: blocks of E/P). Collective: the EP group
        checks that every rank holds the same placement."""
        self.placement = self.checked(placement)
        P, pos = self.ep, self.ep_position
        S = self.num_experts // P if self.placement is None else self.placement.slots_per_rank
        self.local_experts, self.num_physical = S, P * S
        self.expert_range = (pos * S, (pos + 1) * S)
        self.local_expert_ids = tuple(range(pos * S, (pos + 1) * S)) if self.placement is None else self.placement.slots[pos]
        nodes = tuple(self.node_of(r) for r in self.group_ranks)
        self.routes = None if self.placement is None else RouteMap(self.placement, pos, nodes if len(set(nodes)) > 1 else None)
        self.signature = self.num_physical * 4096 + S  # travels with every count exchange
        if self.placement is not None:
            self.signature += self.placement.signature() << 32
        agree_on_signature(self.group, self.signature)  # before any count exchange: payload widths must match

    # dispatch(fuse_gather=True) leaves step 4, the reorder, to the experts' first GEMM (moe.dispatch.RowGather), and
    # combine(weighted=False) the routing weights to their last (row_weights: the weights travel with the rows)
    fuses_gather = True
    fuses_weights = True

    def dispatch(self, x: Tensor, routing: Routing, *, fuse_gather: bool = False) -> Dispatched:
        """``fuse_gather``: return the received rows [R, H] source-major as they came, with a RowGather saying
        which of them each expert-major row is, for experts that gather in their first GEMM: one copy pass fewer
        (MoELayer asks where moe.experts.FUSED_PERMUTE allows)."""
        check_tokens("FlatEPDispatcher", x, routing)
        check_expert_counts("FlatEPDispatcher", routing, self.num_experts)
        indices, counts = routing.indices, routing.tokens_per_expert
        if self.routes is not None:  # 0. logical -> physical expert ids (the copies this source uses)
            indices = self.routes(indices)
            counts = count_experts(indices, self.num_physical)
        return self.dispatch_slots(x, indices, routing.weights, counts, may_drop=routing.capacity is not None,
                                   fuse_gather=fuse_gather)

    def dispatch_slots(self, x: Tensor, indices: Tensor, weights: Tensor, counts: Tensor,
                       may_drop: bool, fuse_gather: bool = False) -> Dispatched:
        """dispatch() on raw slots: indices [T, k] physical ids (-1 = no expert), weights [T, k], counts [P*S]."""
        T, k = indices.shape
        P, El = self.ep, self.local_experts
        send_counts = counts.view(P, El)  # [P, El] (physical) experts are rank-contiguous
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
        if fuse_gather:  # a permutation: received row t is expert-major row inverse[t] (one "slot" each)
            return Dispatched(recv, recv_counts.sum(0), meta, RowGather.over(recv, order, inverse))
        return Dispatched(_Reorder.apply(recv, order, inverse), recv_counts.sum(0), meta)

    def row_weights(self, meta: EPMeta) -> Tensor:
        """[R] float32: the routing weight of each row this rank's experts compute, in their (expert-major) order:
        each source's row weights (moe.dispatch.row_weights) sent with its rows, one fp32 each, by an all-to-all
        (a collective: every rank of the group calls it, as MoELayer does when the experts take the weights)."""
        mine = row_weights(meta.local)[:, None]  # [N, 1] in my sort order, as the rows went
        self._count("dispatch", meta.send_splits, mine)
        recv = all_to_all(mine, meta.recv_splits, meta.send_splits, self.group)  # [R, 1] source-major
        return recv[:, 0].index_select(0, meta.order)

    def combine(self, rows: Tensor, meta: EPMeta, *, weighted: bool = True) -> Tensor:
        """``weighted=False``: the rows carry their weights already (row_weights): each token's rows summed."""
        check_combine_rows(rows, meta.order.shape[0])  # else IndexError here or rows lost, peers in the all-to-all
        back = _Reorder.apply(rows, meta.inverse, meta.order)  # [R, H] source-major again
        self._count("combine", meta.recv_splits, back)
        mine = all_to_all(back, meta.send_splits, meta.recv_splits, self.group)  # [N, H] in my sort order
        return unpermute(mine, meta.local, weighted)

    def _count(self, phase: str, splits: list[int], rows: Tensor) -> None:
        row_bytes = rows.shape[-1] * rows.element_size()
        self.traffic.add(phase, splits, self.group_ranks, row_bytes, self.node_of, self.rank)


# ---------------------------------------------------------------------------------------------------
# Applying EP to a model
# ---------------------------------------------------------------------------------------------------


def shard_experts(layer: nn.Module, ep_mesh, placement: Placement | None = None) -> tuple[int, int]:
    """Keep this rank's experts (after the full-tensor init: layout-free): the contiguous E/ep block, or
    under a ``placement`` the experts of its S slots in slot order (replicas are copies of the same init);
    returns their ids [lo, hi) (physical ids under a placement), which the EP dispatcher must send here.

    The weights become DTensors ``Shard(0)`` over the EP mesh: their global shape is [E, ...] ([P*S, ...]
    in physical order under a placement, which checkpoints turn back into logical order: comm.relocate),
    so checkpoints (torch.distributed.checkpoint) hold whole experts and load at any ep degree, FSDP can
    shard them further over the ranks holding the same experts, and the experts compute on
    ``to_local()`` (moe.experts). No communication: every rank already has the full initialised tensor.
    """
    experts = layer.experts
    E, ep_size, ep_rank = experts.w_in.shape[0], ep_mesh.size(), ep_mesh.get_local_rank()
    if E % ep_size:
        raise ValueError(f"num_experts={E} is not divisible by ep={ep_size}; every EP rank holds num_experts / ep "
                         f"experts: use an ep among {[d for d in range(1, E + 1) if E % d == 0]}")
    rows = list(range(ep_rank * E // ep_size, (ep_rank + 1) * E // ep_size))
    if placement is not None:
        rows = list(placement.slots[ep_rank])
    for name in experts.param_names():  # weights and, with ffn_bias, the biases: each [E, ...] over experts
        full = getattr(experts, name)
        shard = DTensor.from_local(full.detach()[rows].clone(), ep_mesh, [Shard(0)], run_check=False)
        setattr(experts, name, nn.Parameter(shard, requires_grad=full.requires_grad))
    return ep_rank * len(rows), (ep_rank + 1) * len(rows)


def all_reduce_counts(*groups):
    """A moe CountReducer: per-expert counts summed over ``groups`` in turn (the data-parallel group:
    global-batch balancing; the TP then the CP group: the ranks sharing each sequence's tokens)."""

    def reduce(counts: Tensor) -> Tensor:
        out = counts.detach().clone()
        for group in groups:
            dist.all_reduce(out, group=group)
        return out

    return reduce


def install_sequence_balance(router, topology) -> None:
    """Sequence-wise balancing (moe.router.Router, balance="sequence"): the ranks that hold parts of the same
    sequences are the TP ranks (their token split, sequence parallel or not) times the CP ranks; the per-sequence
    counts are summed over both, and each rank's loss counts tp * cp times."""
    L = topology.layout
    groups = [topology.group(kind) for kind, n in (("tp", L.tp), ("cp", L.cp)) if n > 1]
    router.sequence_reducer = all_reduce_counts(*groups) if groups else None
    router.sequence_parts = L.tp * L.cp


def apply_expert_parallel(model: nn.Module, topology, hierarchical: bool = False,
                          placements: dict[str, Placement] | None = None, overlap_chunks: int = 1) -> Traffic:
    """Shard every MoE layer's experts over the EP group, install EP dispatchers and global balancing.

    ``placements``: {MoE layer name: comm.placement.Placement} for layers whose experts are not placed in
    contiguous blocks (any layer not named, or a contiguous one, keeps the blocks).
    Each layer's ``dispatcher.expert_range`` then names the slots this rank holds and
    ``dispatcher.local_expert_ids`` their logical experts (the guard and tools read them there). Returns the
    shared Traffic counter (bytes per link class) the trainer logs.
    ``overlap_chunks`` > 1: each layer's dispatch / experts / combine runs in that many token chunks whose
    all-to-alls overlap the other chunks' experts (comm.overlap); it needs ep > 1.
    """
    from moekit.comm.hierarchical import HierarchicalEPDispatcher
    from moekit.moe.load import moe_layers

    traffic = Traffic()
    ep_ranks = topology.members("ep")
    placements = placements or {}
    if hierarchical:
        topology.check_hierarchical()
    if overlap_chunks != 1 and topology.layout.ep == 1:
        raise ValueError(f"ep_overlap_chunks={overlap_chunks} needs expert parallelism (ep > 1): it overlaps the EP "
                         f"all-to-all, which ep=1 does not have; set it to 1 or raise ep")
    for name, layer in moe_layers(model):
        # global-batch balancing: the counts of every rank of the stage (data ranks x TP token slices)
        layer.router.count_reducer = all_reduce_counts(topology.group("stage"))
        install_sequence_balance(layer.router, topology)
        if topology.layout.ep == 1:
            continue
        placement = placements.get(name)
        if placement is not None and (placement.ep, placement.num_experts) != (topology.layout.ep, layer.num_experts):
            raise ValueError(f"{name}: expert placement for ep={placement.ep} and {placement.num_experts} experts, "
                             f"but the layout has ep={topology.layout.ep} and the layer {layer.num_experts} experts")
        if placement is not None and placement.is_contiguous:
            placement = None
        held = shard_experts(layer, topology.mesh("experts")["ep"], placement)
        if hierarchical:
            dispatcher = HierarchicalEPDispatcher(layer.num_experts, topology, traffic, placement)
        else:
            dispatcher = FlatEPDispatcher(layer.num_experts, topology.group("ep"), ep_ranks, topology.node_of, traffic,
                                          placement)
        # the mesh's shard (checkpoints, FSDP) and the all-to-all's destination must be the same experts
        assert dispatcher.expert_range == held, (name, dispatcher.expert_range, held)
        if overlap_chunks != 1:
            from moekit.comm.overlap import set_overlap

            set_overlap(dispatcher, overlap_chunks)
        layer.dispatcher = dispatcher
    return traffic
