"""Built-in routers beyond the top-k family: expert choice, Sinkhorn, hash.

Shape legend: T tokens, E experts, k slots per token, C slots per expert (capacity).
Imported by moe.router for registration; use them through ``build_router(name, ...)``.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from moekit.moe.losses import z_loss
from moekit.moe.router import Router, Routing, _builtin, check_choice, check_int, count_experts, register_router


@_builtin
@register_router("expert_choice")
class ExpertChoiceRouter(Router):
    """Experts pick tokens (Zhou et al. 2022): expert e takes its top C tokens by score.

    C = min(T, ceil(capacity_factor * T * k / E)), so every expert is exactly full: perfect balance
    by construction, and a token may get 0..E experts. The slot layout is therefore [T, E]:
    column e holds e if expert e took the token, else -1. Selection looks at all T tokens routed
    together, i.e. at future positions of a sequence: fine for encoders and for the training of
    some decoders, but not causal; say so when comparing it with token-choice routers.
    No slot is ever dropped (``dropped_fraction`` is 0, as in the load records); ``unrouted_fraction``
    is the fraction of tokens that no expert took, which only the residual connection carries.
    """

    def __init__(self, hidden_size: int, num_experts: int, *, top_k: int = 1, capacity_factor: float | None = 1.0,
                 score: str = "softmax", z_loss_coeff: float = 0.0, gate_bias: bool = False):
        if capacity_factor is None:
            raise ValueError("capacity_factor=None is invalid for expert_choice: experts always take C tokens; "
                             "use a positive number (1.0 = each token gets k experts on average)")
        super().__init__(hidden_size, num_experts, top_k=top_k, capacity_factor=capacity_factor,
                         z_loss_coeff=z_loss_coeff, gate_bias=gate_bias)
        check_choice("score", score, ("softmax", "sigmoid"))
        self.score = score

    def route(self, logits: Tensor, token_ids: Tensor | None = None) -> Routing:
        T, E = logits.shape
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()  # [T, E]
        capacity = self.capacity(T)
        taken = torch.zeros(T, E, dtype=torch.bool, device=logits.device)
        if capacity > 0:
            top = scores.topk(capacity, dim=0).indices  # [C, E] token ids per expert
            taken.scatter_(0, top, True)
        experts = torch.arange(E, device=logits.device).expand(T, E)
        indices = torch.where(taken, experts, -1)  # [T, E]
        weights = torch.where(taken, scores, 0.0)
        kept = count_experts(indices, E)
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.z_loss_coeff > 0):  # only logged at 0
            zl = z_loss(logits)
        unrouted = (~taken.any(-1)).float().mean() if T else logits.new_zeros(())
        stats = {"z_loss": zl.detach(), "dropped_fraction": torch.zeros((), device=logits.device),
                 "unrouted_fraction": unrouted, "assigned_per_expert": kept}
        return Routing(indices, weights, kept, self.z_loss_coeff * zl, stats, capacity)


def sinkhorn(logits: Tensor, num_iters: int) -> Tensor:
    """Log-domain Sinkhorn: log of a [T, E] plan whose rows sum to 1 and columns to T/E.

    Alternating row/column normalisation of exp(logits) (Cuturi 2013); the per-token argmax of the
    plan is a balanced assignment. Fixed iteration count: no data-dependent loop, no host sync.
    """
    T, E = logits.shape
    log_p = logits.float()
    log_col_target = math.log(T / E) if T else 0.0
    for _ in range(num_iters):
        log_p = log_p - torch.logsumexp(log_p, dim=0, keepdim=True) + log_col_target
        log_p = log_p - torch.logsumexp(log_p, dim=1, keepdim=True)
    return log_p


@_builtin
@register_router("sinkhorn")
class SinkhornRouter(Router):
    """Balanced assignment by Sinkhorn normalisation in training, plain top-k in eval (BASE-style).

    The plan only decides *which* experts (no gradient flows through it); weights are the softmax
    scores of the chosen experts, renormalised when k > 1. Balanced by construction, so the aux loss
    defaults to 0; capacity dropping is available as for top-k.
    """

    def __init__(self, hidden_size: int, num_experts: int, *, top_k: int = 1, num_iters: int = 8,
                 normalize: bool | None = None, capacity_factor: float | None = None,
                 drop_policy: str = "probs", aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
                 gate_bias: bool = False, balance: str = "batch"):
        super().__init__(hidden_size, num_experts, top_k=top_k, capacity_factor=capacity_factor,
                         drop_policy=drop_policy, aux_loss_coeff=aux_loss_coeff, z_loss_coeff=z_loss_coeff,
                         gate_bias=gate_bias, balance=balance)
        check_int("num_iters", num_iters, 1)
        self.num_iters = num_iters
        self.normalize = top_k > 1 if normalize is None else bool(normalize)

    def route(self, logits: Tensor, token_ids: Tensor | None = None) -> Routing:
        scores = logits.softmax(-1)  # [T, E]
        choice = sinkhorn(logits.detach(), self.num_iters) if self.training else scores
        indices = choice.topk(self.top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(1, indices)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        return self.finish(logits, scores, indices, weights, self.capacity(logits.shape[0]))


def hash_tokens(token_ids: Tensor, seed: int) -> Tensor:
    """A fixed integer mix of token ids (Murmur-style finaliser in 32 bits, int64 arithmetic)."""
    m32 = (1 << 32) - 1
    h = (token_ids.long() & 0x7FFFFFFF) * 2654435761 + (seed * 40503 + 1)
    h = h & m32
    h = h ^ (h >> 16)
    h = (h * 0x45D9F3B) & m32
    return h ^ (h >> 16)


@_builtin
@register_router("hash")
class HashRouter(Router):
    """Hash layers (Roller et al. 2021): expert = hash(token id); no gate, nothing learned.

    Slot j of a token goes to (hash(id) + j) mod E, so its k experts are distinct; each weight is
    1/k. Deterministic across runs, ranks and layouts.
    """

    requires_token_ids = True

    def __init__(self, hidden_size: int, num_experts: int, *, top_k: int = 1, seed: int = 0,
                 capacity_factor: float | None = None, drop_policy: str = "position"):
        super().__init__(hidden_size, num_experts, top_k=top_k, capacity_factor=capacity_factor,
                         drop_policy=drop_policy, gate=False)
        check_int("seed", seed, 0)
        self.seed = seed

    def route(self, logits: Tensor, token_ids: Tensor | None = None) -> Routing:
        if token_ids is None:
            raise ValueError("the hash router needs token ids: pass token_ids to MoELayer.forward / Router.forward")
        T, E, k = logits.shape[0], self.num_experts, self.top_k
        first = hash_tokens(token_ids.to(logits.device), self.seed) % E  # [T]
        indices = (first[:, None] + torch.arange(k, device=logits.device)) % E  # [T, k]
        weights = torch.full((T, k), 1.0 / k, device=logits.device)
        uniform = torch.full_like(logits, 1.0 / E)
        return self.finish(logits, uniform, indices, weights, self.capacity(T))
