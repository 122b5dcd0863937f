"""Moving experts between the ranks of an EP group: checkpoints in logical order, rebalancing, replicas.

Under a placement (comm.placement) a layer's expert weights are DTensors ``Shard(0)`` over the "ep" mesh dim
in *physical* order: global shape [P*S, ...], rank p's local block is its S slots (FSDP may shard dim 1
further). Everything outside the running model sees logical order:

    checkpoint  logical_state: each expert tensor (weights, AdamW moments) becomes the [E, ...] DTensor
                Shard(0) that EP without a placement has (rank p: experts p*E/P ..), one copy per expert,
                so DCP files are the same whatever the placement and load at any ep or in one process;
                physical_state is the way back (replica slots are filled from their expert's row)
    rebalance   rebalance(model, optimizer, placements): weights and AdamW moments to new slots, in place
    gradients   sum_replica_grads: every copy of a replicated expert computed part of its tokens; their
                gradients are summed over the EP group so all copies hold the one expert's gradient (and,
                with equal moments, take the same optimizer step); tag_primaries marks the rows the global
                gradient norm counts (one copy each)

Every expert parameter moves: the weights and, with ffn_bias, the biases (GroupedExperts.param_names()).
All three rest on move_rows: one all_to_all_single over the EP group that gives every slot of the target
placement its row from the source placement (from this rank's own slots when it holds that expert).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from moekit.comm.placement import Placement
from moekit.moe.load import moe_layers


def _moves(src: Placement, dst: Placement) -> list[list[list[tuple[int, int]]]]:
    """moves[p][q]: (slot on p under src, slot on q under dst) pairs, in dst slot order, that q takes from p."""
    P, S = src.ep, src.slots_per_rank
    copies = src.copies()
    moves: list[list[list[tuple[int, int]]]] = [[[] for _ in range(P)] for _ in range(P)]
    for q, row in enumerate(dst.slots):
        for slot, e in enumerate(row):
            here = [c for c in copies[e] if c // S == q]
            c = here[0] if here else copies[e][0]  # no traffic when q holds the expert already
            moves[c // S][q].append((c % S, slot))
    return moves


def move_rows(local: Tensor, src: Placement, dst: Placement, position: int, group) -> Tensor:
    """[S_src, ...] rows this rank holds under ``src`` -> [S_dst, ...] rows it holds under ``dst`` (collective
    over ``group``, the EP group; every rank passes the same placements)."""
    assert src.ep == dst.ep and src.num_experts == dst.num_experts, (src.ep, dst.ep)
    P, me = src.ep, position
    moves = _moves(src, dst)
    out = local.new_empty((dst.slots_per_rank,) + tuple(local.shape[1:]))
    own = moves[me][me]
    if own:
        out[[d for _, d in own]] = local[[s for s, _ in own]]
    if P == 1:
        return out
    send = [s for q in range(P) if q != me for s, _ in moves[me][q]]
    in_splits = [0 if q == me else len(moves[me][q]) for q in range(P)]
    out_splits = [0 if p == me else len(moves[p][me]) for p in range(P)]
    recv = local.new_empty((sum(out_splits),) + tuple(local.shape[1:]))
    dist.all_to_all_single(recv, local[send].contiguous(), out_splits, in_splits, group=group)
    received = [d for p in range(P) if p != me for _, d in moves[p][me]]
    if received:
        out[received] = recv
    return out


def placed_layers(model: nn.Module):
    """(name, layer, placement, EP group, position) of every MoE layer whose experts follow a placement
    other than contiguous blocks (``dispatcher.placement``)."""
    for name, layer in moe_layers(model):
        placement = getattr(layer.dispatcher, "placement", None)
        if placement is not None:
            yield name, layer, placement, layer.dispatcher.ep_group, layer.dispatcher.ep_position


def _relabel(t: DTensor, local: Tensor, rows: int) -> DTensor:
    shape = (rows,) + tuple(t.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=shape, stride=stride)


def _expert_entries(model_sd: dict, optim_sd: dict | None, fqn: str) -> list[tuple[dict, str]]:
    """(dict, key) of the param ``fqn`` and of its optimizer state tensors shaped like it (AdamW's moments)."""
    entries = [(model_sd, fqn)] if fqn in model_sd else []
    states = (optim_sd or {}).get("state", {})
    state = {}
    if fqn in states:
        state = states[fqn] = dict(states[fqn])  # a copy: the optimizer's own dict may be behind it
    shape = model_sd[fqn].shape if fqn in model_sd else None
    entries += [(state, k) for k, v in state.items() if isinstance(v, DTensor) and v.shape == shape]
    return entries


def logical_state(model: nn.Module, model_sd: dict, optim_sd: dict | None = None) -> None:
    """In place: every placed expert tensor of the state dicts (get_model_state_dict /
    get_optimizer_state_dict keys) becomes its logical [E, ...] DTensor, contiguous blocks, one copy each."""
    for name, layer, placement, group, pos in placed_layers(model):
        logical = Placement.contiguous(placement.num_experts, placement.ep)
        for param in layer.experts.param_names():
            for d, k in _expert_entries(model_sd, optim_sd, f"{name}.experts.{param}"):
                t = d[k]
                d[k] = _relabel(t, move_rows(t.to_local(), placement, logical, pos, group), placement.num_experts)


def physical_state(model: nn.Module, model_sd: dict, optim_sd: dict | None = None) -> None:
    """The inverse of logical_state (state dicts made by it, e.g. loaded from a checkpoint): back to this
    model's placements, replica slots filled with their expert's row."""
    params = dict(model.named_parameters())
    for name, layer, placement, group, pos in placed_layers(model):
        logical = Placement.contiguous(placement.num_experts, placement.ep)
        for param in layer.experts.param_names():
            fqn = f"{name}.experts.{param}"
            like = params[fqn]
            for d, k in _expert_entries(model_sd, optim_sd, fqn):
                t = d[k]
                d[k] = _relabel(like, move_rows(t.to_local(), logical, placement, pos, group), like.shape[0])


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def sum_replica_grads(model: nn.Module) -> None:
    """Every copy of a replicated expert gets the sum of all copies' gradients (one all-reduce per EP group
    over the replicated experts' rows only)."""
    pending: dict[object, list] = {}  # EP group -> [(grad, slot, row)], buffers
    for _, layer, placement, group, pos in placed_layers(model):
        replicated = [e for e, c in enumerate(placement.copies()) if len(c) > 1]
        if not replicated:
            continue
        row_of = {e: i for i, e in enumerate(replicated)}
        for param in layer.experts.param_names():
            p = getattr(layer.experts, param)
            if p.grad is None:
                continue
            g = _local(p.grad)
            buf = g.new_zeros((len(replicated),) + tuple(g.shape[1:]))
            mine = [(s, row_of[e]) for s, e in enumerate(placement.slots[pos]) if e in row_of]
            for s, r in mine:  # fixed order: the same sums on every rank
                buf[r] += g[s]
            pending.setdefault(group, []).append((g, mine, buf))
    for group, items in pending.items():
        flat = torch.cat([buf.reshape(-1) for _, _, buf in items])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g, mine, buf in items:
            summed = flat[offset : offset + buf.numel()].view_as(buf)
            offset += buf.numel()
            for s, r in mine:
                g[s] = summed[r]


def tag_primaries(model: nn.Module) -> None:
    """Mark each expert parameter with ``expert_primary`` ([S] float, 1 on the slots holding an expert's
    first copy; None without replicas) for comm.grad_sync.global_grad_norm. Call after FSDP and after
    ``to_empty`` (both replace the Parameter objects), and after every rebalance."""
    placed = {id(layer): (placement, pos) for _, layer, placement, _, pos in placed_layers(model)}
    for _, layer in moe_layers(model):
        placement, pos = placed.get(id(layer), (None, 0))
        for param in layer.experts.param_names():
            p = getattr(layer.experts, param)
            mask = None
            if placement is not None and placement.replicas:
                device = _local(p).device  # a model parallelised on the meta device gets its storage later
                mask = torch.tensor(placement.primary_mask(pos), dtype=torch.float32,
                                    device="cpu" if device.type == "meta" else device)
            p.expert_primary = mask


@torch.no_grad()
def rebalance(model: nn.Module, optimizer, placements: dict[str, Placement]) -> int:
    """Move every MoE layer of ``model`` (this rank's stages) to ``placements`` ({layer name: Placement};
    a missing name = contiguous blocks): expert weights and the optimizer state shaped like them, in place,
    then the dispatchers route by the new tables. Collective over each EP group. Returns the layers moved."""
    moved = 0
    for name, layer in moe_layers(model):
        dispatcher = layer.dispatcher
        if not hasattr(dispatcher, "set_placement"):  # ep == 1: every expert is here
            continue
        P, E = dispatcher.ep, layer.num_experts
        old = dispatcher.placement or Placement.contiguous(E, P)
        new = placements.get(name) or Placement.contiguous(E, P)
        if new == old:
            continue
        if new.slots_per_rank != old.slots_per_rank or new.ep != old.ep:
            raise ValueError(f"{name}: a rebalance keeps {old.slots_per_rank} slots on each of {old.ep} ranks; the "
                             f"new placement has {new.slots_per_rank} on {new.ep}")
        for param in layer.experts.param_names():
            p = getattr(layer.experts, param)
            state = optimizer.state.get(p, {}) if optimizer is not None else {}
            for t in [p, *(v for v in state.values() if isinstance(v, Tensor) and v.shape == p.shape)]:
                local = _local(t)
                local.copy_(move_rows(local, old, new, dispatcher.ep_position, dispatcher.ep_group))
        dispatcher.set_placement(new)
        moved += 1
    tag_primaries(model)
    return moved
