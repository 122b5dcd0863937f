"""Expert-parallel communication / computation overlap: dispatch -> experts -> combine pipelined in chunks.

Shape legend: T local tokens, C chunks, k slots, P EP ranks, S experts (slots) per rank, m nodes, H hidden.

The rank's T tokens are cut into C contiguous chunks; each chunk is dispatched, computed and combined on
its own, with its all-to-alls asynchronous, so that one chunk's exchange runs while another chunk's
experts compute. ``--layout.ep_overlap_chunks C`` (C = 1: the plain dispatch / experts / combine).

Forward, C = 3: cnt the one count exchange for all chunks (no chunk then waits for a count exchange queued
behind another chunk's rows), P permute, E experts, U unpermute; a bar is an all-to-all from its issue to
its wait (D dispatch, K combine), which runs while the compute line goes on:

    compute     cnt  P0  P1  E0  P2  E1  E2  U0  U1  U2
    D0                 [====]
    D1                     [========]                      chunk 1's rows travel while E0 runs
    D2                             [====]
    K0                         [============]              chunk 0's outputs travel while E1, E2 run
    K1                                 [========]
    K2                                     [========]

Backward: each exchange is two autograd Functions, ``_Issue`` (starts the all-to-all, returns the
buffer being filled) and ``_Wait`` (waits, returns it). Backward runs them mirrored: ``_Wait.backward``
starts the reverse exchange of the gradient, ``_Issue.backward`` waits for it. Autograd's engine runs
the ready node created last first (priority by sequence number), which replays the forward schedule
backwards with the same overlap, without any hook into the engine (' = gradient):

    compute     U2'  U1'  U0'  E2'  E1'  P2'  E0'  P1'  P0'
    K2'            [==========]
    K1'                 [==========]
    K0'                      [===============]
    D2'                           [=====]                  chunk 2's input gradient travels while E1' runs
    D1'                                [==========]
    D0'                                          [=====]

Every rank runs the same Functions in the same order (empty chunks included), so the collectives match;
activation checkpointing recomputes the whole forward (its own issues and waits) before the first
unpermute's backward, and the recomputed graph's channels are separate objects.

Flat dispatch overlaps its one all-to-all each way. Hierarchical dispatch overlaps the inter-node (rail)
exchange, the expensive one; the intra-node exchange of a chunk stays synchronous (its counts depend on
the rows that just arrived). Under a placement the logical -> physical map runs on the whole batch first,
so every token picks the same copy as unchunked. Results equal the unchunked run up to the expert GEMMs'
rounding: each token's output and input gradient are per-row sums in the same order, while an expert's
weight gradient is summed per chunk, then over chunks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moekit.comm.all_to_all import SplitMismatchError, agree_on_signature, exchange_counts, start_all_to_all
from moekit.comm.expert_parallel import (EPMeta, FlatEPDispatcher, _inverse, _Reorder, check_combine_rows,
                                        source_to_expert_order)
from moekit.comm.hierarchical import HierarchicalEPDispatcher
from moekit.moe.dispatch import Dispatched, PermuteMeta, permute, sort_slots, unpermute
from moekit.moe.router import Routing, count_experts


def set_overlap(dispatcher, chunks: int, trace: list | None = None) -> None:
    """Pipeline ``dispatcher``'s dispatch / experts / combine in ``chunks`` token chunks (1 = off).

    Collective over the EP group: every rank must use the same count (their per-chunk exchanges pair up).
    ``trace``: a list that receives (direction, action, phase, chunk) events, for tests; None = off.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"ep_overlap_chunks={chunks!r} is invalid; it must be an integer >= 1 (1 = no overlap)")
    if type(dispatcher) not in _STAGES:
        raise ValueError(f"ep_overlap_chunks={chunks}: {type(dispatcher).__name__} cannot be pipelined; chunked "
                         f"overlap knows {[t.__name__ for t in _STAGES]} (set it to 1 for other dispatchers)")
    try:
        agree_on_signature(dispatcher.ep_group, chunks)
    except SplitMismatchError as exc:
        raise SplitMismatchError(f"ep_overlap_chunks differs between EP ranks: {exc}") from None
    dispatcher.overlap_chunks, dispatcher.overlap_trace = chunks, trace


def chunk_sizes(tokens: int, chunks: int) -> list[int]:
    """Contiguous token chunks, the first ``tokens % chunks`` one longer (some may be empty)."""
    return [tokens // chunks + (c < tokens % chunks) for c in range(chunks)]


# ---------------------------------------------------------------------------------------------------
# An asynchronous all-to-all as two autograd Functions
# ---------------------------------------------------------------------------------------------------


class Channel:
    """One chunk's exchange in one phase: splits, group, and the in-flight handle from issue to wait."""

    def __init__(self, phase: str, chunk: int, out_splits: list[int], in_splits: list[int], group, trace):
        self.phase, self.chunk, self.group, self.trace = phase, chunk, group, trace
        self.out_splits, self.in_splits = [int(s) for s in out_splits], [int(s) for s in in_splits]
        self.work = self.keep = None  # forward exchange in flight (keep: its input, alive until the wait)
        self.grad_work = self.grad_keep = self.grad_out = None  # the reverse exchange in backward

    def record(self, direction: str, action: str) -> None:
        if self.trace is not None:
            self.trace.append((direction, action, self.phase, self.chunk))


class _Issue(torch.autograd.Function):
    """Start the all-to-all of ``x``; return its output buffer (valid once ``_Wait`` ran on it).
    Backward: wait for the reverse exchange ``_Wait.backward`` started; its result is x's gradient (the
    gradient autograd hands over is the buffer's, already on its way back)."""

    @staticmethod
    def forward(ctx, x: Tensor, chan: Channel) -> Tensor:
        ctx.chan = chan
        out, chan.work, chan.keep = start_all_to_all(x, chan.out_splits, chan.in_splits, chan.group, async_op=True)
        chan.record("fwd", "issue")
        return out

    @staticmethod
    def backward(ctx, _sent: Tensor):
        chan = ctx.chan
        chan.grad_work.wait()
        chan.record("bwd", "wait")
        out, chan.grad_work, chan.grad_keep, chan.grad_out = chan.grad_out, None, None, None
        return out, None


class _Wait(torch.autograd.Function):
    """Wait for the exchange ``_Issue`` started; identity on its buffer. Backward: start the reverse
    exchange of the gradient (what I received from rank p goes back to rank p); the gradient itself
    goes on to ``_Issue.backward`` only as the edge that orders the two (the channel carries the result)."""

    @staticmethod
    def forward(ctx, buf: Tensor, chan: Channel) -> Tensor:
        ctx.chan = chan
        chan.work.wait()
        chan.work = chan.keep = None
        chan.record("fwd", "wait")
        return buf.view_as(buf)

    @staticmethod
    def backward(ctx, grad: Tensor):
        chan = ctx.chan
        chan.grad_out, chan.grad_work, chan.grad_keep = start_all_to_all(grad, chan.in_splits, chan.out_splits,
                                                                         chan.group, async_op=True)
        chan.record("bwd", "issue")
        return grad, None


def issue(x: Tensor, chan: Channel) -> Tensor:
    return _Issue.apply(x, chan)


def wait(buf: Tensor, chan: Channel) -> Tensor:
    return _Wait.apply(buf, chan)


class _Mark(torch.autograd.Function):
    """Identity; records an event when its backward runs (the tracing hook of the tests)."""

    @staticmethod
    def forward(ctx, x: Tensor, trace: list, event: tuple) -> Tensor:
        ctx.trace, ctx.event = trace, event
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.trace.append(ctx.event)
        return grad, None, None


def _experts(experts, d: Dispatched, chunk: int, trace: list | None) -> Tensor:
    if trace is None:
        return experts(d.rows, d.counts)
    rows = _Mark.apply(d.rows, trace, ("bwd", "experts_end", "experts", chunk))  # its backward: E done
    trace.append(("fwd", "experts", "experts", chunk))
    out = experts(rows, d.counts)
    return _Mark.apply(out, trace, ("bwd", "experts", "experts", chunk))  # its backward: E starts


# ---------------------------------------------------------------------------------------------------
# The pipeline
# ---------------------------------------------------------------------------------------------------


def pipelined(dispatcher, x: Tensor, routing: Routing, experts) -> Tensor:
    """[T, H] rows -> [T, H] combined expert outputs, as dispatch / experts / combine would give, in
    ``dispatcher.overlap_chunks`` chunks whose exchanges overlap the other chunks' experts."""
    if x.shape[0] != routing.indices.shape[0]:
        raise ValueError(f"dispatch got {x.shape[0]} tokens but routing for {routing.indices.shape[0]}")
    stages = _STAGES[type(dispatcher)](dispatcher)
    trace = dispatcher.overlap_trace
    chunks = stages.plan(x, routing, dispatcher.overlap_chunks)
    started = [stages.start_dispatch(chunks[0])]
    combining = []
    for c in range(len(chunks)):
        if c + 1 < len(chunks):  # 1. chunk c+1's rows go out before chunk c's experts run
            started.append(stages.start_dispatch(chunks[c + 1]))
        d = stages.finish_dispatch(started[c])  # 2. chunk c's rows are here
        started[c] = None
        out = _experts(experts, d, c, trace)  # 3. compute while c+1 (and c-1's combine) travel
        combining.append(stages.start_combine(out, d.meta, c))  # 4. chunk c's outputs go back
    return torch.cat([stages.finish_combine(k) for k in combining])  # 5. [T, H]


@dataclass
class _Chunk:
    index: int
    x: Tensor  # [Tc, H]
    indices: Tensor  # [Tc, k] physical ids
    weights: Tensor  # [Tc, k]
    send_splits: list[int]
    recv_splits: list[int]
    extra: object = None  # the flat stage's received counts [P, S]; the hierarchical one's node slots


def _split(x: Tensor, indices: Tensor, weights: Tensor, C: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    sizes = chunk_sizes(x.shape[0], C)
    return list(zip(x.split(sizes), indices.split(sizes), weights.split(sizes)))


def _chunk_counts(per_token: Tensor, sizes: list[int], bins: int) -> Tensor:
    """[C, bins] counts of ``per_token`` ids [T, j] (-1 = none) in each token chunk: one scatter."""
    chunk_of = torch.repeat_interleave(torch.arange(len(sizes), device=per_token.device),
                                       torch.tensor(sizes, device=per_token.device), output_size=per_token.shape[0])
    keyed = torch.where(per_token >= 0, per_token + chunk_of[:, None] * bins, -1)
    return count_experts(keyed, len(sizes) * bins).view(len(sizes), bins)


class _FlatStages:
    """FlatEPDispatcher's dispatch_slots / combine, cut at the all-to-alls (comm.expert_parallel, steps 1-4)."""

    def __init__(self, d):
        self.d = d

    def plan(self, x: Tensor, routing: Routing, C: int) -> list[_Chunk]:
        d, (P, S) = self.d, (self.d.ep, self.d.local_experts)
        indices = routing.indices if d.routes is None else d.routes(routing.indices)  # whole batch: same copies
        self.may_drop = routing.capacity is not None
        send = _chunk_counts(indices, chunk_sizes(x.shape[0], C), P * S).view(C, P, S)
        # one count exchange for every chunk: row p of the payload holds my C count rows for rank p
        recv = exchange_counts(send.transpose(0, 1).reshape(P, C * S), d.group, signature=d.signature)
        recv = recv.view(P, C, S).transpose(0, 1)  # [C, P, S]
        # D2H sync: split sizes of every chunk's exchange, at once
        splits = torch.stack([send.sum(2), recv.sum(2)]).cpu().tolist()
        return [_Chunk(c, xc, ic, wc, splits[0][c], splits[1][c], recv[c])
                for c, (xc, ic, wc) in enumerate(_split(x, indices, routing.weights, C))]

    def start_dispatch(self, ch: _Chunk):
        d = self.d
        row_slot, slot_row = sort_slots(ch.indices, sum(ch.send_splits))
        local = PermuteMeta(ch.x.shape[0], ch.indices.shape[1], row_slot, slot_row, ch.weights, may_drop=self.may_drop)
        rows = permute(ch.x, local)  # [N, H] in global-expert order
        d._count("dispatch", ch.send_splits, rows)
        chan = Channel("dispatch", ch.index, ch.recv_splits, ch.send_splits, d.group, d.overlap_trace)
        return ch, local, chan, issue(rows, chan)

    def finish_dispatch(self, started) -> Dispatched:
        ch, local, chan, buf = started
        recv = wait(buf, chan)  # [R, H] source-major
        order = source_to_expert_order(ch.extra)
        inverse = _inverse(order)
        meta = EPMeta(local, ch.send_splits, ch.recv_splits, order, inverse)
        return Dispatched(_Reorder.apply(recv, order, inverse), ch.extra.sum(0), meta)

    def start_combine(self, rows: Tensor, meta: EPMeta, c: int):
        check_combine_rows(rows, meta.order.shape[0])  # before the all-to-all, as FlatEPDispatcher.combine
        back = _Reorder.apply(rows, meta.inverse, meta.order)  # [R, H] source-major again
        self.d._count("combine", meta.recv_splits, back)
        chan = Channel("combine", c, meta.send_splits, meta.recv_splits, self.d.group, self.d.overlap_trace)
        return meta.local, chan, issue(back, chan)

    def finish_combine(self, combining) -> Tensor:
        local, chan, buf = combining
        return unpermute(wait(buf, chan), local)  # [Tc, H]


class _HierStages:
    """HierarchicalEPDispatcher's dispatch / combine cut at the rail (inter-node) all-to-alls; the
    intra-node exchange inside finish_dispatch / start_combine stays synchronous (comm.hierarchical)."""

    def __init__(self, d):
        self.d = d

    def plan(self, x: Tensor, routing: Routing, C: int) -> list[_Chunk]:
        d, m = self.d, self.d.num_nodes
        indices = d.physical(routing)  # whole batch: same copies as unchunked
        node_ids = d.node_slots(indices)  # [T, m]
        sizes = chunk_sizes(x.shape[0], C)
        send = _chunk_counts(node_ids, sizes, m)  # [C, m]
        recv = exchange_counts(send.t().contiguous(), d.rail_group, signature=d.signature).t()  # [C, m]
        splits = torch.stack([send, recv]).cpu().tolist()  # D2H sync: every chunk's rail splits at once
        return [_Chunk(c, xc, ic, wc, splits[0][c], splits[1][c], nc) for c, ((xc, ic, wc), nc)
                in enumerate(zip(_split(x, indices, routing.weights, C), node_ids.split(sizes)))]

    def start_dispatch(self, ch: _Chunk):
        d = self.d
        rows, ids_rows, w_rows, nodes = d.to_nodes(ch.x, ch.indices, ch.weights, ch.extra, sum(ch.send_splits))
        d.count_rail("dispatch", ch.send_splits, rows)
        chans = [Channel("dispatch", ch.index, ch.recv_splits, ch.send_splits, d.rail_group, d.overlap_trace if i == 0
                         else None) for i in range(3)]
        return ch, nodes, chans, [issue(t, chan) for t, chan in zip((rows, ids_rows, w_rows), chans)]

    def finish_dispatch(self, started) -> Dispatched:
        ch, nodes, chans, bufs = started
        recv, recv_ids, recv_w = (wait(b, chan) for b, chan in zip(bufs, chans))
        return self.d.inside_node(recv, recv_ids, recv_w, nodes, ch.send_splits, ch.recv_splits)

    def start_combine(self, rows: Tensor, meta, c: int):
        d = self.d
        partial = d.inner.combine(rows, meta.inner)  # [R1, H] weighted sum over this node's experts
        d.count_rail("combine", meta.recv_splits, partial)
        chan = Channel("combine", c, meta.send_splits, meta.recv_splits, d.rail_group, d.overlap_trace)
        return meta.nodes, chan, issue(partial, chan)

    def finish_combine(self, combining) -> Tensor:
        nodes, chan, buf = combining
        return unpermute(wait(buf, chan), nodes)  # [Tc, H]


_STAGES = {FlatEPDispatcher: _FlatStages, HierarchicalEPDispatcher: _HierStages}
