"""Muon for the weight matrices, AdamW for the rest, in one optimizer (``--train.optimizer muon``).

Muon (Jordan et al. 2024; at scale: Moonlight, Liu et al. 2025; Kimi K2; GLM-4.5) replaces each weight matrix's
update by the orthogonalised momentum: with B the momentum buffer of the gradient G,

    B <- mu B + G,   U = G + mu B (Nesterov) or B,   O = NS5(U) ~ the orthogonal factor of U's SVD
    W <- W - lr * wd * W - lr * 0.2 * sqrt(max(rows, cols)) * O

NS5 is five steps of the quintic Newton-Schulz iteration X <- aX + (b A + c A^2) X, A = X X^T, on U scaled to
unit Frobenius norm (coefficients a, b, c = 3.4445, -4.7750, 2.0315, the published tuned quintic), in float32.
The 0.2 * sqrt(max(rows, cols)) factor (Moonlight's) gives the update AdamW's RMS, so one learning rate and one
weight decay serve both groups, as in Moonlight's recipe.

What is a matrix here: every weight with two or more dims except the embedding and the output head (AdamW
keeps those, Moonlight's choice), so attention and dense projections, routers, shared experts, MTP projections,
and every expert of an expert stack [E, in, out] on its own (batched). A gated expert stack's w_in
[E, H, 2F] is two matrices per expert, gate and up, as transformers stores them. Norm scales, biases (expert
biases included), sinks and the embedding and head take AdamW (decoupled weight decay on the embedding and head,
as the AdamW optimizer does).

Layouts: every expert keeps its whole matrices on one expert-parallel rank, and data / context / pipeline ranks
hold whole tensors, so there each rank orthogonalises its own local matrices. FSDP and tensor parallelism cut
matrices across ranks: their momentum is all-gathered along the cut dims (an expert stack keeps its expert-parallel
dim 0 local), orthogonalised whole and each rank keeps its own shard of the update. Every rank of such a group
then orthogonalises the same matrices (redundant compute, one matrix's gather at a time); spreading the matrices
over the ranks and broadcasting the results would share that work. Every layout computes one process's update.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


BATCH_ELEMENTS = 1 << 26  # matrices of a batch (an expert stack) orthogonalised together, at most this many values


def orthogonalize(g: Tensor, steps: int = 5, eps: float = 1e-7) -> Tensor:
    """NS5(g) for g [..., m, n] (a batch of matrices), float32: approximately U V^T of g = U S V^T, its singular
    values pushed into roughly [0.7, 1.2] (the iteration's tuned fixed point, not exactly 1). A batch larger than
    BATCH_ELEMENTS runs in slices of whole matrices, so the iteration's temporaries (about 4x its input) stay
    bounded for a large expert stack."""
    if g.dim() > 2 and g.numel() > BATCH_ELEMENTS:
        flat = g.reshape(-1, *g.shape[-2:])
        step = max(1, BATCH_ELEMENTS // (g.shape[-2] * g.shape[-1]))
        return torch.cat([_orthogonalize(flat[i : i + step], steps, eps) for i in range(0, flat.shape[0], step)])\
            .view(g.shape)
    return _orthogonalize(g, steps, eps)


def _orthogonalize(g: Tensor, steps: int, eps: float) -> Tensor:
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    wide = x.shape[-2] > x.shape[-1]
    if wide:  # iterate on the side with fewer rows: A = X X^T is the smaller square
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        A = x @ x.mT
        x = a * x + (b * A + c * A @ A) @ x
    return x.mT if wide else x


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _whole_matrices(u: Tensor):
    """(u's local matrices made whole, a function taking such an update back to this rank's shard). A DTensor
    sharded along a matrix dim (FSDP, TP) is all-gathered along it; an expert stack's dim 0 (expert parallelism)
    stays sharded: its local experts are whole matrices already."""
    if not hasattr(u, "to_local"):
        return u, lambda x: x
    from torch.distributed.tensor import DTensor, Replicate, Shard

    keep = [p if isinstance(p, Shard) and p.dim == 0 and u.dim() == 3 else
            (Replicate() if isinstance(p, Shard) else p) for p in u.placements]
    if list(keep) == list(u.placements):
        return u.to_local(), lambda x: x
    mesh, placements, shape, stride = u.device_mesh, u.placements, u.shape, u.stride()
    whole = u.redistribute(mesh, keep).to_local()

    def back(x: Tensor) -> Tensor:  # Replicate -> Shard: each rank takes its chunk, no communication
        full = DTensor.from_local(x, mesh, keep, run_check=False, shape=shape, stride=stride)
        return full.redistribute(mesh, placements).to_local()

    return whole, back


class Muon(torch.optim.Optimizer):
    """Param groups carry ``kind``: "muon" (matrices: ``momentum``, ``nesterov``, ``ns_steps``, and per parameter
    ``chunks`` along the last dim, 2 for a gated expert stack's w_in) or "adamw" (``betas``, ``eps``). Both take
    ``lr`` and ``weight_decay`` (decoupled). Build one for a model with ``muon_param_groups``."""

    def __init__(self, groups: list[dict], lr: float, betas=(0.9, 0.95), eps: float = 1e-8, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5):
        defaults = dict(lr=lr, weight_decay=0.0, betas=betas, eps=eps, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, kind="adamw", chunks=None)
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["kind"] == "muon":
                self._muon(group)
            else:
                self._adamw(group)
        return loss

    def _muon(self, group: dict) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        chunks = group["chunks"] or [1] * len(group["params"])
        for p, n in zip(group["params"], chunks):
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            w, g, buf = _local(p), _local(p.grad), _local(state["momentum_buffer"])
            buf.mul_(mu).add_(g)
            u = g.add(buf, alpha=mu) if group["nesterov"] else buf
            if hasattr(p, "to_local"):  # FSDP / TP shards: the whole matrices (EP's experts stay local)
                u = type(p).from_local(u, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                       stride=p.stride())
            u, back = _whole_matrices(u)
            parts = u.chunk(n, dim=-1) if n > 1 else (u,)  # a gated stack: gate and up, each its own matrix
            update = torch.cat([orthogonalize(x, group["ns_steps"]) for x in parts], dim=-1) if n > 1 else \
                orthogonalize(u, group["ns_steps"])
            update = back(update)
            rows, cols = parts[0].shape[-2], parts[0].shape[-1]
            if wd:
                w.mul_(1 - lr * wd)
            w.add_(update.to(w.dtype), alpha=-lr * 0.2 * math.sqrt(max(rows, cols)))

    def _adamw(self, group: dict) -> None:
        lr, wd, (b1, b2), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            w, g = _local(p), _local(p.grad)
            m, v = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
            state["step"] += 1
            t = float(state["step"])
            if wd:
                w.mul_(1 - lr * wd)
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v / (1 - b2 ** t)).sqrt_().add_(eps)
            w.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))


def muon_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Muon's matrices and AdamW's rest (module docstring), with their weight decay."""
    from moekit.moe.activations import get_activation
    from moekit.moe.experts import GroupedExperts

    gated = {}  # id(w_in) of a gated expert stack -> 2
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            act = get_activation(module.activation)
            gated[id(module.w_in)] = act.in_features(module.ffn_hidden_size) // module.ffn_hidden_size
    head = {id(p) for name, p in model.named_parameters()
            if name.endswith(("embed.weight", "lm_head.weight", "embed_tokens.weight"))}
    matrices, chunks, decayed, rest = [], [], [], []
    for name, p in model.named_parameters():
        bias = name.endswith(("bias", ".b_in", ".b_out", "sinks"))
        if p.dim() >= 2 and id(p) not in head and not bias:
            matrices.append(p)
            chunks.append(gated.get(id(p), 1))
        elif p.dim() >= 2:
            decayed.append(p)
        else:
            rest.append(p)
    return [{"params": matrices, "kind": "muon", "chunks": chunks, "weight_decay": weight_decay},
            {"params": decayed, "kind": "adamw", "weight_decay": weight_decay},
            {"params": rest, "kind": "adamw", "weight_decay": 0.0}]
