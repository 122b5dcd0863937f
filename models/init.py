"""Weight initialisation that any rank can do for the part of a tensor it holds (``init_weights``).

Every value is a function of (seed, the parameter's single-process name, its position) alone:

    tensor [d0, d1, rest...] is cut into tiles along dims 0 and 1 (rest whole), about TILE elements each
    (3-d tensors, the experts' [E, ., .]: one expert per tile row); tile (i0, i1) is drawn in float32 on a CPU
    generator seeded by a hash of (seed, name, i0, i1)

So a rank that holds a box of a tensor (a DTensor shard under TP / EP / FSDP, a pipeline stage's layers, the
last stage's replica of the embedding) draws only the tiles its box meets and copies its part: the model is
initialised after it is parallelised, on meta-device modules moved with ``to_empty``, and no rank ever holds
the whole model. The values do not depend on the layout (tested against one process), on the device (the
draws are on the CPU), on the order in which tensors are filled, or on which other tensors exist (adding MTP
depths leaves the main weights as they were).

Under an expert placement (comm.placement) a rank's expert rows are physical slots; each row is drawn as the
logical expert its slot holds (``dispatcher.local_expert_ids``), so replicas start equal.
"""
from __future__ import annotations

import hashlib
import math

import torch
from torch import Tensor, nn

TILE = 1 << 20  # elements per tile (4 MiB of float32)
WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def tile_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The tile of a tensor of ``shape`` along dims 0 and 1 (module docstring); depends on the shape only."""
    if len(shape) == 0:
        return ()
    if len(shape) == 1:
        return (max(1, min(shape[0], TILE)),)
    rest = math.prod(shape[2:])
    t1 = max(1, min(shape[1], TILE // max(rest, 1)))
    t0 = 1 if len(shape) > 2 else max(1, min(shape[0], TILE // (t1 * max(rest, 1))))
    return (t0, t1)


def _seed(seed: int, name: str, tile: tuple[int, ...]) -> int:
    text = f"{seed}:{name}:{':'.join(map(str, tile))}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def normal_values(seed: int, name: str, shape: tuple[int, ...], box: tuple[range, ...], std: float,
                  rows: list[int] | None = None) -> Tensor:
    """Float32 CPU values N(0, std) of the part ``box`` (one range per dim) of tensor ``name`` of ``shape``.
    ``rows``: the dim-0 indices of the whole tensor that the box's rows stand for, when they are not box[0]
    (an expert placement's logical experts)."""
    out = torch.empty([len(r) for r in box], dtype=torch.float32)
    if out.numel() == 0:
        return out
    if len(shape) == 0:
        g = torch.Generator().manual_seed(_seed(seed, name, ()))
        return out.normal_(0.0, std, generator=g)
    tile = tile_shape(shape)
    rows = list(box[0]) if rows is None else list(rows)
    cols = box[1] if len(shape) > 1 else None
    # group the wanted rows by tile row, keeping where each goes in ``out``
    by_tile: dict[int, list[tuple[int, int]]] = {}
    for j, r in enumerate(rows):
        by_tile.setdefault(r // tile[0], []).append((j, r))
    for i0, members in by_tile.items():
        r0, r1 = i0 * tile[0], min(shape[0], (i0 + 1) * tile[0])
        (j0, first), n = members[0], len(members)
        run = all(m == (j0 + t, first + t) for t, m in enumerate(members))  # consecutive rows: one slice copy
        dst = [slice(j0, j0 + n)] if run else [j for j, _ in members]
        src = [slice(first - r0, first - r0 + n)] if run else [r - r0 for _, r in members]
        if cols is None:  # 1-d
            g = torch.Generator().manual_seed(_seed(seed, name, (i0,)))
            values = torch.empty(r1 - r0, dtype=torch.float32).normal_(0.0, std, generator=g)
            for d, s_ in zip(dst, src):
                out[d] = values[s_]
            continue
        c_first, c_last = cols.start // tile[1], (cols.stop - 1) // tile[1] if len(cols) else -1
        for i1 in range(c_first, c_last + 1):
            c0, c1 = i1 * tile[1], min(shape[1], (i1 + 1) * tile[1])
            g = torch.Generator().manual_seed(_seed(seed, name, (i0, i1)))
            values = torch.empty(r1 - r0, c1 - c0, *shape[2:], dtype=torch.float32).normal_(0.0, std, generator=g)
            lo, hi = max(c0, cols.start), min(c1, cols.stop)
            rest = tuple(slice(b.start, b.stop) for b in box[2:])
            for d, s_ in zip(dst, src):
                out[(d, slice(lo - cols.start, hi - cols.start), *((slice(None),) * len(rest)))] = \
                    values[(s_, slice(lo - c0, hi - c0), *rest)]
    return out


def fold_layer_indices(names) -> list[str]:
    """Names with layer indices folded (``layers.N.attn.wq.weight``), in first-seen order: for messages."""
    import re

    out: dict[str, None] = {}
    for n in names:
        out[re.sub(r"^(layers|mtp)\.\d+\.", r"\1.N.", n)] = None
    return list(out)


def canonical_name(name: str) -> str:
    """A parameter's single-process name: without the wrappers compile / checkpointing / FSDP insert."""
    for w in WRAPPERS:
        name = name.replace(w, "")
    return name


class _Filler:
    """``normal_(t, std)`` for the model's parameters: each rank fills the part it holds (module docstring)."""

    def __init__(self, model: nn.Module, seed: int, only: set[str] | None = None):
        from moekit.models.hf.sharded import slot_experts
        from moekit.moe.load import moe_layers

        self.seed, self.only = seed, only
        self.names = {id(p): canonical_name(n) for n, p in model.named_parameters()}
        # expert tensors under a placement: (the logical expert of each local row, the number of experts)
        self.logical: dict[int, tuple[list[int], int]] = {}
        self.experts: dict[int, int] = {}  # every expert tensor: the number of (logical) experts
        for _, layer in moe_layers(model):
            params = [getattr(layer.experts, n) for n in layer.experts.param_names()]  # weights (+ biases)
            self.experts.update({id(w): layer.num_experts for w in params})
            rows = slot_experts(layer)
            if rows is not None:
                for w in params:
                    self.logical[id(w)] = (rows, layer.num_experts)

    @torch.no_grad()
    def __call__(self, t: Tensor, std: float) -> None:
        from moekit.models.hf.sharded import shard_box

        name = self.names[id(t)]
        if self.only is not None and name not in self.only:
            return
        box = shard_box(t, name)
        local = t.to_local() if hasattr(t, "to_local") else t
        shape, rows = tuple(t.shape), None
        if id(t) in self.logical:  # physical slots: the values are those of the logical expert each slot holds
            rows, experts = self.logical[id(t)]
            shape = (experts,) + shape[1:]
        elif id(t) in self.experts and shape[0] != self.experts[id(t)]:
            raise RuntimeError(f"{name} has {shape[0]} expert rows for {self.experts[id(t)]} experts but no placement "
                               f"names their logical experts; initialise before placing them (comm.relocate)")
        local.copy_(normal_values(self.seed, name, shape, box, std, rows))


def _zero_biases(ffn: nn.Module) -> None:
    """An MoE layer's biases start at 0: the experts' ffn_bias (b_in, b_out) and the router's gate bias. A
    constant is the same in every layout, placement and shard, so each rank zeroes what it holds."""
    from moekit.moe.layer import MoELayer

    if not isinstance(ffn, MoELayer):
        return
    biases = [getattr(ffn.experts, n) for n in ffn.experts.param_names() if n.startswith("b_")]
    if getattr(ffn.router, "gate_bias", False):
        biases.append(ffn.router.bias)
    for b in biases:
        (b.to_local() if hasattr(b, "to_local") else b).zero_()


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0, only: set[str] | None = None) -> None:
    """Fill every parameter and buffer of ``model`` (a Transformer, or a pipeline rank's PipelineModel: the same
    attributes, some None) from ``seed`` (module docstring), whatever it holds of each tensor.

    Residual-stream inputs (embedding, q/k/v and MLA's projections, FFN in, router) get N(0, init_std);
    projections back into the residual stream (attention out, FFN out) get init_std / sqrt(2 L) (GPT-2), so
    the residual's variance does not grow with depth; biases 0 (the MoE experts' ffn_bias and the router's gate
    bias included), norm scales 1, router state 0.

    ``only``: draw just these parameters (single-process names), for a load that fills the rest next
    (models.hf.load_hf_sharded); the constant fills still run everywhere, they cost nothing."""
    from moekit.models.norms import norm_identity
    from moekit.models.transformer import init_ffn

    cfg = model.config
    normal_ = _Filler(model, seed, only)
    std, std_out = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
    if getattr(model, "embed", None) is not None:
        normal_(model.embed.weight, std)
    for layer in model.layers:
        for norm in (layer.attn_norm, layer.ffn_norm):
            norm.weight.fill_(norm_identity(norm))
        layer.attn.init_weights(normal_, std, std_out)
        init_ffn(layer.ffn, normal_, std, std_out)
        _zero_biases(layer.ffn)
    if getattr(model, "norm", None) is not None:
        model.norm.weight.fill_(norm_identity(model.norm))
    if getattr(model, "lm_head", None) is not None:
        normal_(model.lm_head.weight, std)
    for module in getattr(model, "mtp", None) or ():
        for norm in (module.enorm, module.hnorm, module.norm, module.block.attn_norm, module.block.ffn_norm):
            norm.weight.fill_(norm_identity(norm))
        normal_(module.eh_proj.weight, std)
        module.block.attn.init_weights(normal_, std, std_out)
        init_ffn(module.block.ffn, normal_, std, std_out)
        _zero_biases(module.block.ffn)
    _init_lora(model, normal_)


def _init_lora(model: nn.Module, normal_) -> None:
    """LoRA adapters (models.lora): A factors N(0, 1/fan_in) drawn as every tensor is, B factors 0 (a constant:
    each rank zeroes what it holds), so fresh adapters leave the model's output as it was."""
    for _, module in model.named_modules():
        if not getattr(module, "lora_rank", 0):
            continue
        if hasattr(module, "lora_a"):  # a LoRALinear: lora_a [r, in], lora_b [out, r]
            pairs = [(module.lora_a, module.lora_b, module.lora_a.shape[-1])]
        else:  # expert stacks: lora_a_{side} [E, in, r], lora_b_{side} [E, r, out]
            pairs = [(module.get_parameter(f"lora_a_{s}"), module.get_parameter(f"lora_b_{s}"),
                      module.get_parameter(f"lora_a_{s}").shape[1]) for s in module.lora_sides]
        for a, b, fan_in in pairs:
            normal_(a, 1.0 / math.sqrt(fan_in))
            if normal_.only is None or normal_.names[id(b)] in normal_.only:
                (b.to_local() if hasattr(b, "to_local") else b).zero_()
