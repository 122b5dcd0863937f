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
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
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
