"""Gradient reduction and the global gradient norm for every layout (dp, fsdp, tp, ep; per pipeline stage).

Each data-parallel rank's loss is the mean over its own share of the global batch (a context-parallel rank's:
over its equal part of each sequence), so the global-batch gradient is (sum over the D = dp * fsdp * cp
ranks holding different tokens) / D. Which ranks hold a partial sum of a parameter's gradient depends on
what the parameter saw:

    parameter                          partial over              reduced by
    dense (attention, norms, embed)    the D data ranks          FSDP (fsdp > 1), else all-reduce over "dp"
    MoE router / shared expert,        D data ranks x tp slices  the above, then a sum over "tp"
    sequence-parallel norms, per-head  (of tokens, or of heads)
    q/k norms under TP, Gated
    DeltaNet's replicated parameters
    under TP
    experts (EP shard)                 edp ranks x tp slices     FSDP over edp (fsdp > 1) or all-reduce over
                                       (the EP all-to-all        "edp"; then a sum over "tp"
                                       already brought every
                                       EP peer's tokens)

Everything is divided by D (FSDP: its gradient divide factor). DTensor gradients are reduced on their
local shards: shards of different ranks are disjoint pieces, so the per-shard sums are what is wanted.

Which row of the table a parameter is in, its role ("dense" | "moe" | "expert"), comes from the recipe
(models.parallelize returns ``grad_roles``, built by ``gradient_roles``), keyed by the parameter's name:
FSDP swaps the Parameter objects, the names stay.

Replicated experts (comm.placement, redundant slots): each copy saw part of its expert's tokens, so after
the reductions above the copies' gradients are summed over the EP group (comm.relocate.sum_replica_grads)
and the gradient norm counts one copy of each expert (``expert_primary`` rows, comm.relocate.tag_primaries).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moekit.moe.layer import MoELayer


def local(t: Tensor) -> Tensor:
    """The tensor this rank holds: a DTensor's local shard, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def gradient_roles(model: nn.Module, token_sliced: Iterable[nn.Module] = ()) -> dict[str, str]:
    """Parameter name (as ``model.named_parameters()`` gives it) -> role, from the module tree:
    "expert" for MoE experts, "moe" for the rest of every MoE layer (router, shared expert) and the
    parameters of ``token_sliced`` modules (what comm.tensor_parallel returns: the sequence-parallel norms and
    the per-head q/k norms, each of which saw a TP rank's share of the tokens or of the heads),
    "dense" for the rest. The recipe calls it; so can a hand-made layout (tests, tools)."""
    sliced = {id(m) for m in token_sliced}
    roles = {name: "dense" for name, _ in model.named_parameters()}
    for prefix, module in model.named_modules():
        if isinstance(module, MoELayer) or id(module) in sliced:
            roles.update({name: "moe" for name, _ in module.named_parameters(prefix)})
        if isinstance(module, MoELayer):
            roles.update({name: "expert" for name, _ in module.experts.named_parameters(_join(prefix, "experts"))})
        if getattr(module, "tp", None) is not None:  # a module split over TP that reads replicated parameters in
            # part (models.linear_attention.GatedDeltaNet): those gradients are partial over TP
            partial = getattr(module, "tp_partial", ())
            roles.update({_join(prefix, name): "moe" for name in partial})
            for name in partial:  # a LoRA adapter (models.lora) on such a projection: read in part alike
                owner = module.get_submodule(name.rsplit(".", 1)[0]) if name.endswith(".weight") else None
                if owner is not None and hasattr(owner, "lora_a"):
                    roles.update({_join(prefix, name[: -len("weight")] + a): "moe" for a in ("lora_a", "lora_b")})
    return roles


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def sync_gradients(model: nn.Module, topology, roles: dict[str, str], fsdp: bool = False) -> None:
    """Turn every rank's gradients into its shard of the single-process global-batch gradient.

    ``roles``: parameter name -> role (``Parallelized.grad_roles``, or ``gradient_roles(model)``).
    ``fsdp``: fully_shard already reduce-scattered the gradients and divided them by its mesh size (D for
    dense, D / ep for experts: comm.fsdp); the experts' 1 / ep and the TP sums are left.
    """
    L = topology.layout
    D, tp = L.dp_cp, L.tp  # the ranks holding different tokens (context-parallel ones too)
    match_grad_placements(model)
    buckets: dict[tuple[str, torch.dtype], list[Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if name not in roles:
            raise KeyError(f"no gradient role for parameter {name!r}: pass this model's roles (Parallelized.grad_roles)")
        role = roles[name]
        if not fsdp:
            kind = {"dense": "dp", "moe": "stage", "expert": "edp"}[role]  # "stage" = dp x cp x tp
            buckets.setdefault((kind, p.grad.dtype), []).append(local(p.grad))
        if role == "expert" and tp > 1:
            buckets.setdefault(("tp", p.grad.dtype), []).append(local(p.grad))
        if fsdp and role == "moe" and tp > 1:
            buckets.setdefault(("tp", p.grad.dtype), []).append(local(p.grad))
        if fsdp and role == "expert" and L.ep > 1:
            local(p.grad).div_(L.ep)
    for (kind, _), grads in sorted(buckets.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        _all_reduce_flat(grads, topology.group(kind))
    if not fsdp and D > 1:
        for kind, grads in buckets.items():
            if kind[0] != "tp":
                for g in grads:
                    g.div_(D)
    if L.ep > 1:  # every copy of a replicated expert: the whole expert's gradient
        from moekit.comm.relocate import sum_replica_grads

        sum_replica_grads(model)


@torch.no_grad()
def match_grad_placements(model: nn.Module) -> None:
    """Give every DTensor gradient its parameter's placements. DTensor's backward may leave a replicated parameter's
    gradient Partial (pending a sum over TP) or sharded: a row-wise projection's LoRA adapters (models.lora), which
    RowwiseParallel replicates, get a Partial B and a column-sharded A gradient. The optimizer would sum them when
    it updates, but the gradient norm reads local values; so they are reduced here first (an r-wide tensor each)."""
    for p in model.parameters():
        g = p.grad
        if g is not None and hasattr(g, "placements") and hasattr(p, "placements") and tuple(g.placements) != tuple(
                p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)


def _all_reduce_flat(grads: list[Tensor], group) -> None:
    """One collective per (group, dtype), not one per parameter."""
    if dist.get_world_size(group) == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


def _shard_groups(t: Tensor) -> tuple:
    """Process groups over which a DTensor's local shards are disjoint pieces of the whole."""
    if not hasattr(t, "placements"):
        return ()
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = t.device_mesh  # FSDP over TP shards uses _StridedShard, which is not a Shard subclass
    return tuple(mesh.get_group(i) for i, pl in enumerate(t.placements) if pl.is_shard() or isinstance(pl, _StridedShard))


def global_grad_norm(params, device, pp_group=None, parts: int = 0):
    """sqrt(sum of squares) of the whole gradient, whatever the sharding: local sums of squares are
    grouped by the groups their shards span and all-reduced over each (replicas are counted once);
    ``pp_group``: pipeline stages hold different parameters, so their totals add up; the last stage's replica of
    the embedding (models.pipeline, ``pipeline_replica``) is stage 0's tensor again and is left out.

    ``parts`` > 0: also each part's norm (a parameter's part is its ``grad_part`` index, 0 .. parts - 1: moekit.train
    .grad_parts; an untagged one counts in the total only), in the same collectives: each group's sums are one
    vector [total, part 0, ..., part parts-1]. Returns the norm, or (the norm, the parts' norms [parts])."""
    sums: dict[tuple, Tensor] = {}
    by_part: dict[tuple, list[list[Tensor]]] = {}  # per group set, each part's squares (summed once, at the end)
    for p in params:
        if p.grad is not None and not getattr(p, "pipeline_replica", False):
            groups = _shard_groups(p.grad)
            square = local(p.grad).float().square()
            primary = getattr(p, "expert_primary", None)  # [S]: replicas of an expert count once
            sq = square.sum() if primary is None else (square.flatten(1).sum(1) * primary.to(square.device)).sum()
            sums[groups] = sums.get(groups, torch.zeros((), device=device)) + sq
            part = getattr(p, "grad_part", None)
            if parts and part is not None:
                by_part.setdefault(groups, [[] for _ in range(parts)])[part].append(sq)
    total = torch.zeros(1 + parts, device=device)
    for groups, sq in sums.items():
        lists = by_part.get(groups)
        if parts:  # one vector per group set: [total, part 0, ...], one all-reduce as for the scalar
            sq = torch.stack([sq, *(torch.stack(x).sum() if x else torch.zeros((), device=device)
                                    for x in (lists or [[]] * parts))])
        for group in groups:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(sq, group=group)
        total = total + sq
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    norms = total.sqrt()
    return (norms[0], norms[1:]) if parts else norms[0]


def clip_gradients(params, max_norm: float, device, pp_group=None, parts: int = 0):
    """Scale all gradients so their global norm is at most ``max_norm`` (torch's rule); returns the norm (with
    ``parts``: and the parts' norms before clipping, as global_grad_norm)."""
    params = [p for p in params if p.grad is not None]
    total = global_grad_norm(params, device, pp_group, parts)
    if parts:
        total, by_part = total
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        # a non-finite norm leaves the gradients as they are: scaling by NaN would poison every layer and
        # hide which one went bad from the non-finite guard (the step is skipped or stopped anyway)
        coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))
        for p in params:
            local(p.grad).mul_(coef.to(p.grad.dtype))
    return (total, by_part) if parts else total
