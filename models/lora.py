"""LoRA: low-rank adapters on a model's projections and routed experts (Hu et al. 2021), for fine-tuning.

    model.lora_rank    r > 0 turns adapters on (0: none)
    model.lora_alpha   the adapters' scale is alpha / r (16 with r 8: 2)
    model.lora_rslora  the scale is alpha / sqrt(r) instead (rank-stabilized LoRA; PEFT's use_rslora)
    model.lora_dropout p: while training, each adapter reads its input with elements zeroed at rate p, the rest
                       scaled by 1 / (1 - p) (PEFT's lora_dropout; moe.lora_dropout: the masks and their memory)
    model.lora_targets which weights get adapters: comma-separated fnmatch patterns over the one-process weight
                       names (``layers.3.attn.wq.weight``, ``layers.3.ffn.experts.w_in``), or "all": every
                       projection of the blocks (attention, dense and shared-expert FFNs, both routed-expert stacks)
                       except the routers and the one-wide shared-expert gates

A targeted ``nn.Linear`` becomes a ``LoRALinear`` (the same module, its weight and bias kept under their names)
holding ``lora_a`` [r, in] and ``lora_b`` [out, r]: ``y = x W^T + b + (alpha / r) (drop(x) A^T) B^T`` (``drop``:
the identity unless training with lora_dropout). A targeted expert
stack gets ``lora_a_in`` [E, H, r] and ``lora_b_in`` [E, r, F_in] (``w_in``), ``lora_a_out`` [E, F, r] and
``lora_b_out`` [E, r, H] (``w_out``): one adapter per expert, computed factored (moe/lora_experts.py) and sharded
over experts like the weights under expert parallelism. A factors start N(0, 1/fan_in), B factors 0, so a model
with fresh adapters computes what it did without them (bit for bit, except where the experts' fused backend rounds
otherwise than the adapter path's separate products; models.init fills them like any tensor: the same values under
every layout).

The adapters live in the model config, so every program that builds a model from a run's config (generation,
evaluation, export, a resumed run) builds them too. Training with adapters (train.freezing) trains the adapters
only, plus whatever ``--train.trainable`` names; the base weights stay frozen. ``merge_lora`` folds the adapters
into the weights (HuggingFace export, ``moekit-convert merge-lora``), leaving a model without them.

Every layout takes adapters. Tensor parallelism shards a column-wise projection's B with its rows and replicates its
A (comm.tensor_parallel: the [T, r] product then needs no gather), and replicates a row-wise projection's A and B
(RowwiseParallel replicates what is not the weight or bias): DTensor computes the adapter in the projection's own
layout, and the partial gradients of replicated adapters are summed before the gradient norm
(comm.grad_sync.match_grad_placements). Gated DeltaNet's replicated fused projection, which each TP rank reads
in row blocks, applies its adapter's rows alike (models.linear_attention), its gradients partial over TP as the
weight's (comm.grad_sync). The routed and shared experts are computed whole under TP (its token split).
"""
from __future__ import annotations

import fnmatch
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moekit.moe.experts import lora_scale
from moekit.moe.lora_dropout import check_dropout, keep_mask, masked_product, set_stream_source
from moekit.moe.recompute import recomputed

LINEAR_PARAMS = ("lora_a", "lora_b")
# the default targets: every projection of the blocks ("all"), minus these
_NOT_ALL = ("*.router.*", "*.shared_expert.gate.*", "*.gate.weight")


class LoRALinear(nn.Linear):
    """An nn.Linear with a low-rank adapter (module docstring). Made from a built Linear by ``add_linear_lora``."""

    lora_rank: int
    lora_scale: float
    lora_dropout: float

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)
        u = self.lora_input(x, self.lora_a)  # [..., r]
        if y.dim() < 2:
            return y + recomputed(F.linear, u, self.lora_b) * self.lora_scale
        # y + s u B^T as one addmm (no separate scale and add passes over the [..., out] output)
        # (recomputed under selective checkpointing: r-deep, it costs what the add would; keeping it would double the
        # projection's cache beside y, moe.recompute)
        return recomputed(torch.addmm, y.flatten(0, -2), u.flatten(0, -2), self.lora_b.t(),
                          alpha=self.lora_scale).view(y.shape)

    def lora_input(self, x: Tensor, a: Tensor, group=None) -> Tensor:
        """``x A^T`` [..., r] of the adapter's A (``a``: lora_a, or a cast / slice of it), x dropped while training
        with lora_dropout (moe.lora_dropout; ``group``: the process group a plain x is replicated over)."""
        p = self.lora_dropout if self.training else 0.0
        return masked_product(x, a, keep_like(x, p, group), p) if p else F.linear(x, a)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", lora_rank={self.lora_rank}, lora_scale={self.lora_scale:g}" + \
            (f", lora_dropout={self.lora_dropout:g}" if self.lora_dropout else "")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


set_stream_source(_rank)  # moe.lora_dropout's streams of the tensors a process holds alone (the routed experts' rows)


def stream_of(x: Tensor, group=None) -> int:
    """The lowest rank holding the same values of ``x`` (moe.lora_dropout): a DTensor's mesh's lowest rank, else
    ``group``'s lowest rank when given (an input replicated over it), else this rank (0 without a process group)."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        return int(x.device_mesh.mesh.min())
    if group is not None:
        import torch.distributed as dist

        return min(dist.get_process_group_ranks(group))
    return _rank()


def keep_like(x: Tensor, p: float, group=None) -> Tensor:
    """A LoRA dropout keep mask for ``x``: a plain tensor's own, or for a DTensor the whole mask drawn alike on every
    rank of its mesh and this rank's slice kept (a copy: the whole mask is freed), with x's placements."""
    from torch.distributed.tensor import DTensor

    if not isinstance(x, DTensor):
        return keep_mask(x.shape, p, x.device, stream_of(x, group))
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    whole = keep_mask(x.shape, p, x.to_local().device, stream_of(x))
    local_shape, offset = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
    local = whole[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))].clone()
    return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())


def add_linear_lora(linear: nn.Linear, rank: int, alpha: float, rslora: bool = False,
                    dropout: float = 0.0) -> LoRALinear:
    """Turn ``linear`` into a LoRALinear in place (its class changes; weight and bias stay the same Parameters)."""
    if type(linear) is not nn.Linear:
        raise TypeError(f"LoRA adapters go on a plain nn.Linear, not {type(linear).__name__}")
    dropout = check_dropout(dropout)
    w = linear.weight
    linear.__class__ = LoRALinear
    linear.lora_rank, linear.lora_scale, linear.lora_dropout = rank, lora_scale(rank, alpha, rslora), dropout
    linear.lora_a = nn.Parameter(torch.empty(rank, linear.in_features, device=w.device, dtype=w.dtype))
    linear.lora_b = nn.Parameter(torch.zeros(linear.out_features, rank, device=w.device, dtype=w.dtype))
    if not w.is_meta:
        with torch.no_grad():
            linear.lora_a.normal_(0.0, 1.0 / math.sqrt(linear.in_features))
    return linear


def target_patterns(setting: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in str(setting).split(",") if p.strip())


def candidates(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Every weight an adapter can go on, by one-process name -> (its module, the expert side "in" / "out" or "")."""
    from moekit.moe.experts import GroupedExperts

    out: dict[str, tuple[nn.Module, str]] = {}
    for mname, module in model.named_modules():
        if not (mname.startswith("layers.") or mname.startswith("mtp.")):
            continue  # the embedding and the output head keep no adapters
        if type(module) is nn.Linear:
            out[f"{mname}.weight"] = (module, "")
        elif isinstance(module, GroupedExperts):
            out[f"{mname}.w_in"] = (module, "in")
            out[f"{mname}.w_out"] = (module, "out")
    return out


def chosen(names, setting: str, strict: bool = True) -> list[str]:
    """The names of ``names`` that ``setting`` (model.lora_targets) picks, in order; ValueError for a pattern that
    names nothing (listing the candidates, layer indices folded), unless not ``strict`` (part of a model)."""
    names = list(names)
    pats = target_patterns(setting)
    if not pats:
        raise ValueError("model.lora_targets is empty; name the weights that get adapters, or 'all'")
    if pats == ("all",):
        return [n for n in names if not any(fnmatch.fnmatchcase(n, p) for p in _NOT_ALL)]
    for p in pats if strict else ():
        if not any(fnmatch.fnmatchcase(n, p) for n in names):
            from moekit.models.init import fold_layer_indices

            shown = fold_layer_indices(names)
            raise ValueError(f"model.lora_targets pattern {p!r} names no weight that can take an adapter; those are "
                             f"{', '.join(shown[:40])}{' ...' if len(shown) > 40 else ''} (N: a layer index; or "
                             f"'all')")
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in pats)]


def add_lora(model: nn.Module, rank: int, alpha: float, targets: str = "all", rslora: bool = False,
             dropout: float = 0.0) -> list[str]:
    """Adapters on the weights ``targets`` picks (module docstring), scaled by ``lora_scale``; returns their names."""
    cands = candidates(model)
    picked = chosen(cands, targets)
    experts: dict[int, tuple[nn.Module, list[str]]] = {}
    for name in picked:
        module, side = cands[name]
        if side:
            experts.setdefault(id(module), (module, []))[1].append(side)
        else:
            add_linear_lora(module, rank, alpha, rslora, dropout)
    for module, sides in experts.values():
        module.add_lora(rank, alpha, tuple(sides), rslora=rslora, dropout=dropout)
    return picked


_SHAPES: dict[tuple[str, int], list] = {}  # (repr(config), i) -> adapter_shapes: the planner asks many times per block


def adapter_shapes(config, i: int) -> list[tuple[str, tuple[int, ...]]]:
    """(one-process name, shape) of every adapter tensor of block ``i`` (an MTP depth's: i = num_layers + k) under
    ``config``'s LoRA settings, from a meta-device block alone: the dry run's accounting (remembered per config and
    block: building the block costs milliseconds, and one estimate reads each block's several times)."""
    if not config.lora_rank:
        return []
    key = (repr(config), i)
    if key not in _SHAPES:
        if len(_SHAPES) >= 4096:
            _SHAPES.clear()
        _SHAPES[key] = _block_adapter_shapes(config, i)
    return list(_SHAPES[key])


def _block_adapter_shapes(config, i: int) -> list[tuple[str, tuple[int, ...]]]:
    from moekit.models.transformer import Block, meta_device

    r, L = config.lora_rank, config.num_layers
    with meta_device():
        block = Block(config, i)
    root = (nn.ModuleDict({"layers": nn.ModuleDict({str(i): block})}) if i < L else
            nn.ModuleDict({"mtp": nn.ModuleDict({str(i - L): nn.ModuleDict({"block": block})})}))
    cands = candidates(root)
    out = []
    for name in chosen(cands, config.lora_targets, strict=False):
        module, side = cands[name]
        prefix = name.rsplit(".", 1)[0]
        if not side:
            out += [(f"{prefix}.lora_a", (r, module.in_features)), (f"{prefix}.lora_b", (module.out_features, r))]
        else:
            w = getattr(module, f"w_{side}")
            out += [(f"{prefix}.lora_a_{side}", (w.shape[0], w.shape[1], r)),
                    (f"{prefix}.lora_b_{side}", (w.shape[0], r, w.shape[2]))]
    return out


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (``....lora_a``, ``....experts.lora_b_in``)."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf in LINEAR_PARAMS or leaf.startswith("lora_a_") or leaf.startswith("lora_b_")


def has_lora(model: nn.Module) -> bool:
    return any(is_adapter(n) for n, _ in model.named_parameters())


def folded(W: Tensor, A: Tensor, B: Tensor, scale: float, expert: bool) -> Tensor:
    """W + scale x the adapter's product, computed in float32 and returned in W's dtype: a Linear's B @ A ([out, r] @
    [r, in]), an expert stack's A @ B per expert ([E, in, r] @ [E, r, out])."""
    delta = torch.bmm(A.float(), B.float()) if expert else B.float() @ A.float()
    return (W.float() + delta * scale).to(W.dtype)


@torch.no_grad()
def merged_state(state: dict[str, Tensor], scale_of) -> dict[str, Tensor]:
    """A full state dict with its adapters folded into the weights and removed: ``scale_of(prefix)`` gives the
    alpha / rank of the module at ``prefix`` (``layers.3.attn.wq``, ``layers.3.ffn.experts``). Float32 arithmetic,
    stored back in each weight's dtype."""
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for key in state:
        leaf = key.rsplit(".", 1)[-1]
        prefix = key[: -len(leaf) - 1]
        if leaf == "lora_a":
            out[f"{prefix}.weight"] = folded(state[f"{prefix}.weight"], state[key], state[f"{prefix}.lora_b"],
                                             scale_of(prefix), expert=False)
        elif leaf in ("lora_a_in", "lora_a_out"):
            side = leaf[len("lora_a_"):]
            out[f"{prefix}.w_{side}"] = folded(state[f"{prefix}.w_{side}"], state[key], state[f"{prefix}.lora_b_{side}"],
                                               scale_of(prefix), expert=True)
    return out


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _box(t: Tensor, name: str) -> tuple[slice, ...]:
    from moekit.models.hf.sharded import shard_box

    return tuple(slice(r.start, r.stop) for r in shard_box(t, name))


@torch.no_grad()
def fold_lora(model: nn.Module) -> int:
    """Fold every adapter into its weight in place and zero its B factor: the model computes what it did (up to the
    weight dtype's rounding), its adapters now add nothing, and an export writes the folded weights alone. Works on
    a parallelised model, each rank on the part of each weight it holds (any sharding: FSDP, expert parallelism,
    both): the factors are gathered whole (r wide, small) and only this rank's block of ``B A`` is formed.
    Collective where the adapters are DTensors (call on every rank); returns the modules folded."""
    from moekit.moe.experts import GroupedExperts

    count = 0
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            A, B = _full(module.lora_a), _full(module.lora_b)
            rows, cols = _box(module.weight, f"{name}.weight")
            W = _local(module.weight)
            W.copy_(folded(W, A[:, cols], B[rows], module.lora_scale, expert=False))
            _local(module.lora_b).zero_()
            count += 1
        elif isinstance(module, GroupedExperts) and module.lora_rank:
            for side in module.lora_sides:
                w = getattr(module, f"w_{side}")
                A, B = (_full(getattr(module, f"lora_{k}_{side}")) for k in ("a", "b"))
                e, i, o = _box(w, f"{name}.w_{side}")
                W = _local(w)
                W.copy_(folded(W, A[e, i], B[e, :, o], module.lora_scale, expert=True))
                _local(getattr(module, f"lora_b_{side}")).zero_()
            count += 1
    return count


def scales(model: nn.Module) -> dict[str, float]:
    """alpha / rank of every module holding adapters, by one-process name."""
    from moekit.models.init import canonical_name

    return {canonical_name(n): float(m.lora_scale) for n, m in model.named_modules()
            if getattr(m, "lora_rank", 0)}


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter of a one-process model into its weight, in place, and remove the adapters: each
    LoRALinear becomes an nn.Linear again, each expert stack plain. The model then computes what it did (up to
    rounding) and its config says ``lora_rank`` 0."""
    from moekit.moe.experts import LORA_EXPERT_PARAMS, GroupedExperts

    fold_lora(model)  # the weights now hold the adapters' products; what is left is removing the adapters
    for module in list(model.modules()):
        if isinstance(module, LoRALinear):
            del module.lora_a, module.lora_b
            module.__class__ = nn.Linear
            del module.lora_rank, module.lora_scale
        elif isinstance(module, GroupedExperts) and module.lora_rank:
            for name in LORA_EXPERT_PARAMS:
                setattr(module, name, None)
            module.lora_rank, module.lora_scale, module.lora_sides = 0, 0.0, ()
    if getattr(model, "config", None) is not None and getattr(model.config, "lora_rank", 0):
        import dataclasses

        model.config = dataclasses.replace(model.config, lora_rank=0, lora_dropout=0.0)
    return model
