"""Count exchange and an autograd-aware all-to-all over uneven splits.

    rank r sends rows [0:s0) to rank 0, [s0:s0+s1) to rank 1, ...   (in_splits, known locally)
    rank r receives a block from every rank, in rank order          (out_splits, from the counts)

Every token exchange is preceded by a fixed-shape count exchange, so the receive sizes are known before
the variable-size collective; the counts also carry a layout signature that every peer checks, so two
ranks that disagree on the layout fail with a clear message instead of hanging in a mismatched collective.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


class SplitMismatchError(RuntimeError):
    """Peers disagree about what they exchange (layout, expert count): a bug or a misconfigured launch."""


def exchange_counts(send: Tensor, group, signature: int) -> Tensor:
    """send [P, C] int64 (row p goes to group rank p) -> recv [P, C] (row p came from group rank p).

    ``signature`` (e.g. local experts and total experts folded into one int) travels in an extra column;
    a peer with a different one raises SplitMismatchError naming both values.
    """
    P = dist.get_world_size(group)
    if send.shape[0] != P:
        raise SplitMismatchError(f"count matrix has {send.shape[0]} rows for an exchange group of {P} ranks")
    sig = torch.full((P, 1), signature, dtype=torch.int64, device=send.device)
    payload = torch.cat([send.to(torch.int64), sig], dim=1).contiguous()
    recv = torch.empty_like(payload)
    dist.all_to_all_single(recv, payload, group=group)
    # D2H sync: the signatures (and later the splits) must be known on the host
    theirs = recv[:, -1].cpu().tolist()
    bad = [(p, s) for p, s in enumerate(theirs) if s != signature]
    if bad:
        raise SplitMismatchError(
            f"rank {dist.get_rank()} exchanges with signature {signature} but group ranks {bad} (rank, signature) "
            f"differ: every rank of the expert-parallel group must use the same model and layout"
        )
    return recv[:, :-1]


def agree_on_signature(group, signature: int) -> None:
    """Once, at setup: every rank of ``group`` holds the same layout signature, else SplitMismatchError.

    The per-call check in exchange_counts needs equal payload shapes first: peers built with different
    expert counts send count rows of different widths, which gloo answers by aborting the process and
    NCCL by reading garbage. This fixed-shape exchange runs before any of those.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    mine = torch.tensor([signature], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    theirs = [int(t) for t in everyone]  # D2H sync: setup only
    bad = [(p, s) for p, s in enumerate(theirs) if s != signature]
    if bad:
        raise SplitMismatchError(
            f"rank {dist.get_rank()} has layout signature {signature} but group ranks {bad} (rank, signature) "
            f"differ: every rank of the expert-parallel group must build the same model (num_experts) and layout"
        )


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        # the reverse exchange: what I received from rank p goes back to rank p
        return _all_to_all(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    return start_all_to_all(x, out_splits, in_splits, group)[0]


def start_all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group, async_op: bool = False):
    """(out, work, sent): ``x``'s rows exchanged into a new ``out``; with ``async_op`` the exchange is in
    flight until ``work.wait()``, and ``sent`` (x, contiguous) must stay alive until then (work is None else)."""
    if x.shape[0] != sum(in_splits):
        raise SplitMismatchError(f"all_to_all input has {x.shape[0]} rows but the splits {in_splits} sum to "
                                 f"{sum(in_splits)}")
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    work = dist.all_to_all_single(out, x, list(out_splits), list(in_splits), group=group, async_op=async_op)
    return out, work, x


def all_to_all(x: Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group) -> Tensor:
    """Differentiable all_to_all_single along dim 0 with uneven (possibly zero) splits."""
    return _AllToAll.apply(x, [int(s) for s in out_splits], [int(s) for s in in_splits], group)


class Traffic:
    """Bytes this rank sent, by link class: 'intra' (same node), 'inter' (other node). Self-sends are free."""

    def __init__(self):
        self.bytes: dict[str, int] = defaultdict(int)

    def add(self, phase: str, splits: Sequence[int], dest_ranks: Sequence[int], row_bytes: int,
            node_of, my_rank: int) -> None:
        my_node = node_of(my_rank)
        for n, dest in zip(splits, dest_ranks):
            if dest == my_rank or n == 0:
                continue
            link = "intra" if node_of(dest) == my_node else "inter"
            self.bytes[f"{phase}_{link}"] += int(n) * row_bytes

    def snapshot(self, reset: bool = False) -> dict[str, int]:
        out = dict(self.bytes)
        if reset:
            self.bytes.clear()
        return out
