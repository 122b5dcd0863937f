"""Auxiliary routing losses and the aux-loss-free bias update rule (``bias_update_step``).

Shape legend: T tokens routed together, E experts, k slots per token.

Definitions (Megatron-Core's, so configs move across):
    load balance  = E * sum_e f_e * P_e
        f_e = (top-k assignments to e, before capacity dropping) / (T * k)
        P_e = mean over tokens of the full score distribution (softmax probs, or sigmoid scores
              normalised to sum 1 per token)
    z-loss        = mean_t logsumexp(logits_t)^2

Global-batch balancing: f_e can be computed from counts summed over a group of ranks (the
``CountReducer`` that ``comm`` plugs into a router). P_e stays local and carries the gradient; since
data-parallel gradients are averaged, mean_r(E * sum_e f_e * P_e^(r)) equals the single-process loss
over the union of the ranks' tokens, value and gradient alike.

Sequence-wise balance (DeepSeek-V3's complementary loss, router option balance="sequence"): the same loss within
each sequence, averaged over the sequences (``sequence_balance_loss``, with ``Sequences`` saying where a rank's
tokens sit among them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

# Sums a per-rank [E] tensor over the ranks whose tokens form the balancing batch. ``None`` means
# micro-batch balancing (the tokens of this forward only). comm/ provides the all-reduce version;
# it must not be differentiable (counts carry no gradient).
CountReducer = Optional[Callable[[Tensor], Tensor]]


def load_balance_loss(scores: Tensor, assigned: Tensor) -> Tensor:
    """Switch/GShard balance loss.

    scores   [T, E] float32: per-token score distribution (rows sum to 1)
    assigned [E]    top-k assignments per expert before dropping (local or globally reduced)
    returns  scalar, 1.0 when perfectly balanced, E when every slot hits one expert.
    """
    num_experts = scores.shape[-1]
    if scores.shape[0] == 0:
        return scores.sum() * 0.0  # keeps the graph (and a zero gradient) for empty batches
    f = assigned.to(scores.dtype) / assigned.sum().clamp_min(1).to(scores.dtype)  # [E]
    p = scores.mean(dim=0)  # [E]
    return num_experts * torch.dot(f, p)


@dataclass(frozen=True)
class Sequences:
    """Where a rank's T tokens sit among the micro-batch's sequences (sequence-wise balancing): token j is
    position ``offset + j`` of the flattened [count, length] grid of ``count`` sequences of ``length`` tokens.
    One process: offset 0, the [B, S] input itself; a TP token slice: its start in the flattened batch (a slice
    may cut a sequence); a sequence-parallel or context-parallel rank: its own [B, S / parts] share.
    ``weight``: the caller's aux-loss weight, which the sequence loss divides out (moe.layer.MoELayer)."""

    offset: int
    length: int
    count: int
    weight: float = 1.0

    def check(self, tokens: int) -> None:
        if self.length < 1 or self.count < 1 or self.offset < 0 or self.offset + tokens > self.length * self.count:
            raise ValueError(f"{tokens} tokens from position {self.offset} do not fit {self.count} sequence(s) of "
                             f"{self.length} (Sequences{(self.offset, self.length, self.count)})")

    def ids(self, tokens: int, device=None) -> Tensor:
        """[T] the sequence of each token."""
        return torch.div(torch.arange(self.offset, self.offset + tokens, device=device), self.length,
                         rounding_mode="floor")


def sequence_counts(indices: Tensor, sequences: Sequences, num_experts: int) -> Tensor:
    """[B, E] top-k choices per sequence and expert of indices [T, k] (ids outside [0, E) count nowhere)."""
    valid = (indices >= 0) & (indices < num_experts)  # [T, k]; an invalid id adds 0 (no data-dependent shape)
    ids = sequences.ids(indices.shape[0], indices.device)
    flat = ids[:, None] * num_experts + indices.clamp(0, num_experts - 1)  # [T, k]
    counts = torch.zeros(sequences.count * num_experts, dtype=torch.float32, device=indices.device)
    counts.index_add_(0, flat.flatten(), valid.flatten().float())
    return counts.view(sequences.count, num_experts)


def sequence_balance_loss(scores: Tensor, counts: Tensor, sequences: Sequences, top_k: int) -> Tensor:
    """DeepSeek-V3's sequence-wise balance loss (eqs. 17-20), mean over the B sequences of
    E * sum_i f_{b,i} P_{b,i}: f the share of sequence b's top_k choices per token that went to expert i, P its
    tokens' mean score for i. scores [T, E] (rows sum to 1, this rank's tokens, placed by ``sequences``), counts
    [B, E] (every rank's choices of each sequence: Router.reduce_sequence_counts). P sums this rank's tokens only,
    over the whole sequence's length: the ranks holding parts of a sequence add up to its loss. 1.0 when every
    sequence is balanced, E when each sends every choice to one expert.
    """
    B, E = counts.shape
    T = scores.shape[0]
    if T == 0:
        return scores.sum() * 0.0  # keeps the graph (and a zero gradient) for empty batches
    chosen = counts.sum(1, keepdim=True)  # [B, 1]: top_k x the sequence's tokens (on every rank)
    f = (counts / chosen.clamp_min(1)).to(scores.dtype)  # [B, E]
    length = (chosen / top_k).clamp_min(1).to(scores.dtype)  # [B, 1] tokens of each sequence
    # [B, E] this rank's tokens' score sums: the tokens padded into the [B, S] grid, summed along S (pad and sum
    # keep nothing for backward, and no matmul)
    grid = F.pad(scores, (0, 0, sequences.offset, B * sequences.length - sequences.offset - T))
    partial = grid.view(B, sequences.length, E).sum(1)
    return E * (f * partial / length).sum() / B


def sequence_imbalance(counts: Tensor) -> Tensor:
    """Mean over the sequences of max / mean of their choices per expert, counts [B, E]: 1.0 when every sequence
    loads its experts evenly, E when each sends every choice to one expert (sequences with no token count 0)."""
    mean = counts.mean(1)  # [B]
    return (counts.amax(1) / mean.clamp_min(1e-9)).where(mean > 0, 0.0).mean()


def z_loss(logits: Tensor) -> Tensor:
    """ST-MoE router z-loss: keeps gate logits small so the softmax stays in a well-conditioned range."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return torch.logsumexp(logits, dim=-1).square().mean()


@torch.no_grad()
def bias_update_step(bias: Tensor, load: Tensor, rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): raise under-loaded experts' bias, lower over-loaded ones.

    bias += rate * sign(mean(load) - load), then re-centred to zero mean so it never drifts.
    ``load`` [E] counts assigned since the last update (globally reduced where EP/DP is in use).
    """
    delta = torch.sign(load.float().mean() - load.float())
    bias.add_(rate * delta)
    bias.sub_(bias.mean())
