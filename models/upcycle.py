"""Dense-to-MoE upcycling: an MoE model whose experts start as the dense model's MLP, with the same output.

Sparse upcycling (Komatsuzaki et al. 2023) copies a dense model's MLP into every expert; granular
upcycling (He et al. 2024, arXiv:2410.07524; Megatron-Core's ``--moe-use-upcycling``) first splits the MLP
into g shards of F/g hidden units, so the experts are finer than the dense MLP. Here the router and the
experts' output projections are chosen so that the upcycled model computes exactly the dense model's
function at step 0 (up to rounding), whatever g:

    upcycled_config(dense_cfg, num_experts, top_k, granularity)  the MoE ModelConfig for a dense one
    upcycle(dense, config, granularity, seed, drop)             a new MoE Transformer from a dense Transformer
    upcycle_into(moe, dense, granularity, seed, drop)           the same into an already built (parallelised) MoE
                                                                model, reading from a source box by box
    ModuleSource(dense)                                         a dense model in memory as such a source
    check_upcycle_config(config, granularity)                   refuse an MoE config that cannot reproduce it
    dense_mismatches(dense_cfg, config, granularity)            fields the MoE config must take from the dense

(Opening a dense checkpoint from a path, HF folder or moekit file, is ``moekit.train.upcycle.open_dense``: the
moekit file formats live in the application layer. Its sources read slices: a rank reads just the parts its
shards are made from, never the whole dense model.)

What is copied: every tensor outside the FFNs (embedding, attention with its biases / q-k norms, the
norms, lm_head) unchanged; the FFN of a layer the MoE config keeps dense (first_dense_layers, moe_every)
unchanged; each MoE layer's experts from that layer's dense MLP, as follows.

Construction and proof. F dense hidden units, g shards of f = F/g units, E experts, c = E/g copies,
top_k = g*m, router weights scaled by lambda (router option ``scaling``, 1 by default):

  1. The dense MLP is a sum over its hidden units, because the activation is elementwise along F
     (SwiGLU: silu(gate_j) * up_j; GELU / ReLU: act(up_j)):
         y(x) = W_out act(W_in x) = sum_{s<g} y_s(x),   y_s(x) = W_out[:, S_s] act(W_in[S_s] x)
     with S_s the s-th block of f units (for SwiGLU the same units of the gate and the up projection).
  2. Expert e is shard s(e) = e mod g of copy c(e) = e div g, its output projection scaled by g / lambda:
         expert_e(x) = (g / lambda) y_{e mod g}(x).
  3. Router row e is u_{e div g}, with u_0 .. u_{c-1} ~ N(0, init_std) drawn from the seed: the g experts
     of a copy have the same logit, hence the same score p_c (softmax: the same numerator over the same
     denominator; sigmoid: elementwise).
  4. Selection. The scores are constant on each copy and (u random) differ between copies, so in
     descending order each copy's g experts are adjacent and the top g*m are exactly the g experts of the
     m best copies, C. Group-limited routing keeps this when each group holds whole copies ((E /
     num_groups) % g == 0, checked): the selectable experts are then whole copies. The aux-loss-free
     expert_bias starts at zero, so it changes nothing at step 0.
  5. Weights, renormalised (normalize=True): each selected expert of copy c gets
         w_c = lambda p_c / sum_{selected e'} p_{c(e')} = lambda p_c / (g sum_{c' in C} p_{c'}).
  6. Output: sum_{c in C} sum_{s<g} w_c (g / lambda) y_s(x) = sum_{c in C} (p_c / sum_{c' in C} p_{c'}) y(x)
     = y(x).  QED.

Each condition is needed, so each is checked (``check_upcycle_config``) and its absence refused with the
reason: top_k a multiple of g and identical router rows within a copy (else a token selects shards of
different copies, with unequal weights, so the shards do not add up to y: tests/test_upcycle.py shows the
output moving with random rows), normalize (else the weights sum to sum p, not 1), the "topk" router
(switch's jitter, expert choice, Sinkhorn and hash routing do not pick per token the top-k scores), no
``force_expert``. Capacity (capacity_factor set) is allowed with a warning: a dropped slot removes a shard
of a copy, so tokens that overflow an expert differ from the dense model; Sparse Upcycling itself trains
with a capacity, so refusing it would rule out that recipe. Use dropless routing for an exact start.

Shared expert (shared_ffn_hidden_size > 0, any width, gated or not): its input projections are drawn
N(0, init_std) from the seed and its output projection starts at zero, so it adds nothing at step 0 and
learns from the first step on (the gradient of its output projection is nonzero). Splitting the dense MLP
between the shared and the routed experts would tie the shared width to F/g and change which shards the
copies hold; a zero-output start keeps every width and the simple expert = shard e mod g rule.

g = 1 is plain sparse upcycling: every expert is the whole dense MLP, any top_k, rows all random.

Drop-upcycling (``drop`` = r > 0; Nakamura et al., ICLR 2025, arXiv:2502.19261): the copies of a dense MLP start
identical and specialise slowly, so each expert re-initialises floor(r f) of its f hidden units, drawn at random
per expert: their gate / up rows and their output-projection column are drawn N(mean, std) of the dense
tensor they come from (its whole-tensor statistics, in float64), the output values then scaled by g / lambda as
the kept ones are. The rest of the expert is the upcycled shard. The upcycled model then no longer computes the
dense model's function at step 0 (it is a trade of that start for diversity: the paper finds r = 0.5 best over
long training). The draws are a function of (seed, layer, logical expert) alone, so every layout, placement and
replica gets the same values.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import torch
from torch import Tensor

from moekit.models.config import ModelConfig
from moekit.models.transformer import Transformer, meta_device
from moekit.moe import MoELayer
from moekit.moe.activations import get_activation
from moekit.moe.router import TopKRouter, build_router, router_class

# ModelConfig fields that only describe the MoE part: an upcycled config sets them freely.
MOE_FIELDS = ("num_experts", "moe_ffn_hidden_size", "shared_ffn_hidden_size", "shared_expert_gate", "moe_ffn_bias", "moe_every",
              "first_dense_layers", "router", "top_k", "capacity_factor", "aux_loss_coeff", "z_loss_coeff",
              "router_options", "expert_backend")
# Fields that change none of the copied tensors' math (max_seq_len: RoPE is computed per position).
FREE_FIELDS = ("name", "max_seq_len", "init_std")
# Every other field (vocabulary, widths, attention, RoPE, norms, activation, ...) must equal the dense
# model's; ffn_hidden_size only while some layer keeps a dense FFN.


def _check_granularity(granularity) -> None:
    if not isinstance(granularity, int) or isinstance(granularity, bool) or granularity < 1:
        raise ValueError(f"granularity={granularity!r} is invalid; it must be an integer >= 1 (1 = every expert a "
                         f"copy of the whole dense MLP; g = experts of F/g hidden units)")


def _check_dense(dense: ModelConfig, granularity: int) -> None:
    if dense.num_experts:
        raise ValueError(f"the source model is not dense: it has num_experts={dense.num_experts} (an MoE model); "
                         f"upcycling starts from a dense model (num_experts = 0)")
    F = dense.ffn_hidden_size
    if F % granularity:
        divisors = [d for d in range(2, min(F, 64) + 1) if F % d == 0][:6]
        raise ValueError(f"granularity {granularity} does not divide the dense model's ffn_hidden_size={F} (each "
                         f"expert takes F/g of its hidden units); use a divisor of {F}"
                         + (f", e.g. {', '.join(map(str, divisors))}" if divisors else ""))


def check_upcycle_config(config: ModelConfig, granularity: int = 1) -> list[str]:
    """Refuse (ValueError with the reason and the fix) an MoE config whose upcycled model could not give the
    dense model's output (module docstring, "Each condition is needed"); return warnings for what is
    allowed but inexact (capacity)."""
    _check_granularity(granularity)
    g, E, k = granularity, config.num_experts, config.top_k
    if E == 0 or config.num_moe_layers == 0:
        raise ValueError(f"the MoE config has no MoE layer (model.num_experts={E}, {config.num_layers} layers, "
                         f"first_dense_layers={config.first_dense_layers}, moe_every={config.moe_every}); set "
                         f"model.num_experts (and top_k) for the upcycled model")
    if E % g:
        raise ValueError(f"granularity {g} does not divide model.num_experts={E}: the experts are E/g copies of the "
                         f"dense MLP's g shards; use num_experts a multiple of {g}, e.g. {g * max(1, round(E / g))}")
    if k % g:
        up = g * math.ceil(k / g)
        raise ValueError(f"model.top_k={k} is not a multiple of granularity {g}: a token must select all {g} shards of "
                         f"the copies it routes to for their sum to be the dense MLP; use top_k "
                         f"{up if up <= E else g} (top_k = g * copies per token)")
    if router_class(config.router) is not TopKRouter:
        raise ValueError(f"model.router={config.router!r}: upcycling reproduces the dense model only with the 'topk' "
                         f"router (each token takes its top-k softmax or sigmoid scores, renormalised); use "
                         f"--router topk with router_options normalize = true")
    with meta_device():
        router = build_router(config.router, config.hidden_size, E, **config.router_kwargs())
    if not router.normalize:
        raise ValueError(f"router_options normalize={config.router_options.get('normalize')!r} (top_k={k}): without "
                         f"renormalising, a token's weights sum to its scores' sum, not 1, so the experts add up to a "
                         f"scaled dense MLP; set model.router_options.normalize = true")
    if router.force_expert is not None:
        raise ValueError(f"router_options force_expert={router.force_expert} sends every token to one shard; drop it "
                         f"for upcycling")
    if router.num_groups is not None and (E // router.num_groups) % g:
        raise ValueError(f"router_options num_groups={router.num_groups} puts {E // router.num_groups} experts in a "
                         f"group, not a multiple of granularity {g}: a copy's shards would straddle groups and a token "
                         f"could select part of a copy; choose num_groups so that num_experts / num_groups is a "
                         f"multiple of {g}")
    notes = []
    if config.capacity_factor is not None:
        notes.append(f"capacity_factor={config.capacity_factor}: tokens whose slots overflow an expert lose a shard "
                     f"of their copy, so the upcycled model differs from the dense one on those tokens; use "
                     f"capacity_factor none (dropless) for an exact start")
    return notes


def dense_mismatches(dense: ModelConfig, config: ModelConfig, granularity: int = 1) -> list[tuple[str, Any, Any]]:
    """[(field, the dense model's value, the MoE config's value)] for every field the MoE config must take from
    the dense model and does not: everything but the MoE fields, plus moe_ffn_hidden_size = F / granularity."""
    _check_granularity(granularity)
    _check_dense(dense, granularity)
    keeps_dense = any(not config.is_moe_layer(i) for i in range(config.num_layers))
    out = []
    for f in dataclasses.fields(ModelConfig):
        name = f.name
        if name in MOE_FIELDS or name in FREE_FIELDS or (name == "ffn_hidden_size" and not keeps_dense):
            continue
        want, have = getattr(dense, name), getattr(config, name)
        if name == "head_dim" and want != have:  # 0 = hidden_size // num_heads: compare the dims the fixed config
            want = dense.attn_head_dim           # (hidden_size and num_heads the dense model's) would have
            have = have or (dense.hidden_size // dense.num_heads if dense.num_heads else 0)
        if want != have:
            out.append((name, want, have))
    if config.moe_ffn_hidden_size != dense.ffn_hidden_size // granularity:
        out.append(("moe_ffn_hidden_size", dense.ffn_hidden_size // granularity, config.moe_ffn_hidden_size))
    return out


def upcycled_config(dense: ModelConfig, num_experts: int, top_k: int, granularity: int = 1,
                    **moe_overrides) -> ModelConfig:
    """The MoE config of an upcycled ``dense``: its attention, embeddings, norms and activation; every layer
    MoE (unless ``moe_every`` / ``first_dense_layers`` say otherwise) with ``num_experts`` experts of width
    ffn_hidden_size / granularity, top-``top_k`` renormalised softmax routing, dropless.

    ``moe_overrides``: any other MoE field (router, router_options, moe_every, first_dense_layers,
    shared_ffn_hidden_size, capacity_factor, aux_loss_coeff, ...) or max_seq_len / init_std / name.
    router_options default to {"normalize": True}; given ones are added to that. A field copied from the
    dense model, or an MoE config that cannot reproduce it (``check_upcycle_config``), is a ValueError.
    """
    _check_granularity(granularity)
    _check_dense(dense, granularity)
    settable = (set(MOE_FIELDS) | set(FREE_FIELDS)) - {"num_experts", "top_k", "moe_ffn_hidden_size"}
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for name in moe_overrides:
        if name in ("num_experts", "top_k"):
            raise ValueError(f"upcycled_config: {name} is a positional argument, not an override")
        if name == "moe_ffn_hidden_size":
            raise ValueError(f"upcycled_config: moe_ffn_hidden_size is ffn_hidden_size / granularity = "
                             f"{dense.ffn_hidden_size // granularity}; choose the expert width with granularity")
        if name not in fields:
            raise ValueError(f"upcycled_config: unknown model field {name!r}; MoE fields are {sorted(settable)}")
        if name not in settable:
            raise ValueError(f"upcycled_config: {name} is copied from the dense model ({getattr(dense, name)!r}); "
                             f"only MoE fields can be set: {sorted(settable)}")
    values = dense.to_dict()
    values.update(name=f"{dense.name}-upcycled", num_experts=num_experts, top_k=top_k,
                  moe_ffn_hidden_size=dense.ffn_hidden_size // granularity, router="topk", capacity_factor=None,
                  shared_ffn_hidden_size=0, shared_expert_gate=False, moe_every=1, first_dense_layers=0)
    options = dict(moe_overrides.pop("router_options", None) or {})
    values.update(moe_overrides)
    values["router_options"] = {"normalize": True, **options} if values["router"] == "topk" else options
    config = ModelConfig.from_dict(values).validate()
    for note in check_upcycle_config(config, granularity):
        warnings.warn(note, stacklevel=2)
    return config


class ModuleSource:
    """A dense Transformer in memory as an upcycling source (``upcycle_into``'s ``dense``): ``config``, ``shapes``
    (every state-dict tensor's shape) and ``read(name, box)`` (its values at ``box``, one range per dim). Other
    sources read the same from files without holding the model (models.hf.sharded.FolderSlices,
    train.modelfiles.ModelSlices)."""

    def __init__(self, model: torch.nn.Module):
        self.config = model.config
        self._state = model.state_dict()
        self.shapes = {k: tuple(v.shape) for k, v in self._state.items()}

    def read(self, name: str, box) -> Tensor:
        return self._state[name][_index(box)]


def _index(box) -> tuple[slice, ...]:
    return tuple(slice(r.start, r.stop) for r in box)


def _source(dense):
    return ModuleSource(dense) if isinstance(dense, torch.nn.Module) else dense


def upcycle(dense, config: ModelConfig, granularity: int = 1, seed: int = 0, drop: float = 0.0) -> Transformer:
    """A new MoE Transformer (float32, train mode; on ``dense``'s device for a model, else the CPU) built from
    ``config`` and filled from ``dense`` (a dense Transformer or a source, ``upcycle_into``): at step 0 it computes
    the dense model's logits (module docstring)."""
    with meta_device():
        model = Transformer(config)
    device = dense.embed.weight.device if isinstance(dense, torch.nn.Module) else torch.device("cpu")
    model.to_empty(device=device)
    return upcycle_into(model, dense, granularity, seed, drop)


def check_drop(drop) -> None:
    if isinstance(drop, bool) or not isinstance(drop, (int, float)) or not 0.0 <= drop <= 1.0:
        raise ValueError(f"drop={drop!r} is invalid; it must be a fraction in [0, 1] (the share of each expert's "
                         f"hidden units re-initialised; 0 = plain upcycling, 0.5 = the drop-upcycling paper's)")


@torch.no_grad()
def upcycle_into(moe, dense, granularity: int = 1, seed: int = 0, drop: float = 0.0):
    """Fill every parameter and buffer of the built MoE model ``moe`` from ``dense`` (in place; returned).

    Copies the tensors outside the FFNs and the dense-FFN layers; builds the experts from the dense MLP
    shards, the routers from ``seed`` (rows drawn N(0, init_std), identical within a copy), the shared
    experts with a zero output projection. ValueError when the configs do not allow an exact upcycle
    (``check_upcycle_config``, ``dense_mismatches``); capacity is allowed with a warning. ``drop`` > 0:
    drop-upcycling (module docstring), each expert re-initialising that fraction of its hidden units.

    ``dense``: a dense Transformer, or a source that reads one box by box without holding it (``ModuleSource``'s
    interface; models.hf.sharded.FolderSlices for an HF folder, train.modelfiles.ModelSlices for moekit files).
    Whatever its dtype, the values are computed in float32 (a bf16 dense model gives the weights of its float32
    copy).

    ``moe`` may be a whole Transformer or a parallelised one (models.parallelize: TP / EP / FSDP DTensors, expert
    placements, a pipeline rank's PipelineModel, built on the meta device and moved with ``to_empty``): each
    rank reads and writes only what it holds, the values the whole upcycled model has there (the router rows
    are drawn for every layer, held or not, so each layer's draws are the same on every rank).
    """
    from moekit.models.pipeline import whole_structure

    config, src = moe.config, _source(dense)
    check_drop(drop)
    for note in check_upcycle_config(config, granularity):
        warnings.warn(note, stacklevel=2)
    diffs = dense_mismatches(src.config, config, granularity)
    if diffs:
        listed = ", ".join(f"model.{k}={have!r} (dense{' F / granularity' if k == 'moe_ffn_hidden_size' else ''}: "
                           f"{want!r})" for k, want, have in diffs)
        raise ValueError(f"the MoE config differs from the dense model where upcycling copies it: {listed}; set "
                         f"those fields to the dense model's values")
    whole = whole_structure(moe)  # every layer's structure (a pipeline rank holds only its stages)
    _copy_state(moe, src, "", skip=_is_ffn, names=whole.state_dict())
    held = dict(moe.layers.items()) if isinstance(moe.layers, torch.nn.ModuleDict) else {
        str(i): b for i, b in enumerate(moe.layers)}
    gen = torch.Generator().manual_seed(seed)
    for i, shape in enumerate(whole.layers):
        block, prefix = held.get(str(i)), f"layers.{i}.ffn."
        _check_dense_mlp(src, prefix, get_activation(config.activation).gated)
        if isinstance(shape.ffn, MoELayer):  # drawn on every rank, written where held
            _upcycle_ffn(shape.ffn, block.ffn if block is not None else None, src, prefix, granularity, gen,
                         config.init_std, _Drop(drop, seed, i) if drop > 0 else None)
        elif block is not None:
            _copy_state(block.ffn, src, prefix)
    return moe


def _is_ffn(name: str) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[0] == "layers" and parts[2] == "ffn"


def _check_dense_mlp(src, prefix: str, gated: bool) -> None:
    """The dense layer's FFN is a DenseMLP: w_up / w_gate [F, H] (w_gate when gated), w_out [H, F]."""
    H, F = src.config.hidden_size, src.config.ffn_hidden_size
    want = {"w_up.weight": (F, H), "w_out.weight": (H, F), **({"w_gate.weight": (F, H)} if gated else {})}
    have = {k[len(prefix):]: v for k, v in src.shapes.items() if k.startswith(prefix)}
    if have != want:
        raise ValueError(f"dense model {prefix[:-1]}: its tensors are {have}, not a DenseMLP's {want}")


def _put(t: Tensor, part_of) -> None:
    """Write into ``t`` (a tensor, or a DTensor: its local shard) its part of the whole tensor: ``part_of(box)``
    gives the whole tensor's values at ``box`` (one index range per dim); a tensor: the whole tensor."""
    from moekit.models.hf.sharded import shard_box

    local = t.to_local() if hasattr(t, "to_local") else t
    if local.numel() == 0:
        return
    box = shard_box(t)
    local.copy_(part_of[_index(box)] if isinstance(part_of, Tensor) else part_of(box))


def _copy_state(dst: torch.nn.Module, src, prefix: str, skip=lambda name: False, names=None) -> None:
    """Copy every state_dict tensor of ``dst`` (but the skipped) from ``src``'s tensor named ``prefix`` + its name,
    of the same shape (each rank its part), and require that every such tensor of ``src`` is one of ``names``
    (the whole model's state, by default ``dst``'s)."""
    have = {k[len(prefix):]: v for k, v in src.shapes.items() if k.startswith(prefix)}
    want = {k: v for k, v in dst.state_dict().items() if not skip(k)}
    names = want if names is None else {k: v for k, v in names.items() if not skip(k)}
    for name, t in names.items():
        s = have.get(name)
        if s is None or tuple(s) != tuple(t.shape):
            got = "missing" if s is None else f"shape {list(s)}"
            raise ValueError(f"{prefix}{name}: the MoE model has shape {list(t.shape)}, the dense model {got}; the "
                             f"models differ outside the FFNs (dense_mismatches should have named the field)")
    for name, t in want.items():
        _put(t, lambda box, key=prefix + name: src.read(key, box))
    extra = sorted(k for k in have if not skip(k) and k not in names)
    if extra:
        raise ValueError(f"the dense model{' ' + prefix[:-1] if prefix else ''} has tensors the MoE model lacks: "
                         f"{[prefix + k for k in extra[:5]]}")


def _normal(shape, std: float, gen: torch.Generator) -> Tensor:
    """N(0, std) of ``shape``, drawn in float32 on the CPU generator (device independent, as init_weights)."""
    return torch.empty(tuple(shape), dtype=torch.float32).normal_(0.0, std, generator=gen)


class _Drop:
    """Drop-upcycling's re-initialised units of one layer (module docstring): per logical expert, which of its f
    hidden units and their values, drawn from (seed, layer, expert) alone."""

    def __init__(self, fraction: float, seed: int, layer: int):
        self.fraction, self.seed, self.layer = fraction, seed, layer
        self.stats: dict[str, tuple[float, float]] = {}  # dense tensor -> (mean, std)

    def read_stats(self, src, prefix: str, names: tuple[str, ...]) -> None:
        """Mean and std of each whole dense tensor (float64, read in blocks of rows: the same on every rank)."""
        for name in names:
            key = f"{prefix}{name}.weight"
            rows, cols = src.shapes[key]
            total = square = 0.0
            step = max(1, (1 << 22) // max(cols, 1))
            for a in range(0, rows, step):
                block = src.read(key, (range(a, min(a + step, rows)), range(cols))).double()
                total += block.sum().item()
                square += block.square().sum().item()
            n = rows * cols
            mean = total / n
            self.stats[name] = (mean, math.sqrt(max(square / n - mean * mean, 0.0)))

    def draw(self, expert: int, f: int, hidden: int, names: tuple[str, ...]) -> tuple[Tensor, dict[str, Tensor]]:
        """(the re-initialised units, sorted; for each dense tensor in ``names`` their [units, H] float32 values).
        Each tensor's values have a stream of their own, so w_in's pass and w_out's draw only their own."""
        from moekit.models.init import _seed

        def stream(what: str) -> torch.Generator:
            return torch.Generator().manual_seed(_seed(self.seed, f"upcycle-drop:layers.{self.layer}{what}", (expert,)))

        units = torch.randperm(f, generator=stream(""))[: int(self.fraction * f)].sort().values
        values = {}
        for name in names:
            mean, std = self.stats[name]
            values[name] = torch.empty(len(units), hidden, dtype=torch.float64).normal_(
                generator=stream(f".{name}")).mul_(std).add_(mean).float()
        return units, values


def _upcycle_ffn(shape: MoELayer, layer: MoELayer | None, src, prefix: str, g: int, gen: torch.Generator,
                 std: float, drop: _Drop | None = None) -> None:
    """One MoE layer from its dense MLP (module docstring, steps 2-3): the draws from ``shape`` (the whole model's
    layer, possibly on the meta device), the writes into ``layer`` (this rank's, None when another rank holds it),
    reading from ``src`` just the parts of the MLP's shards (F/g hidden units each) its expert rows hold."""
    # gpt-oss-style biases (gate, experts) start at zero: a copy of a bias-free dense MLP, ties between copies kept
    known = {"router.weight", "router.expert_bias", "experts.w_in", "experts.w_out", "router.bias", "experts.b_in",
             "experts.b_out"}
    unknown = [k for k in shape.state_dict() if k not in known and not k.startswith("shared_expert.")]
    if unknown:  # a tensor this function would leave uninitialised
        raise ValueError(f"{prefix[:-1]}: upcycling does not know how to initialise {unknown}")
    E, f = shape.num_experts, shape.experts.ffn_hidden_size
    rows = torch.empty(E // g, shape.hidden_size, dtype=torch.float32).normal_(0.0, std, generator=gen)  # [c, H]
    shared = shape.shared_expert
    drawn = {}  # shared expert: input projections drawn, output projection zero (adds nothing at step 0)
    if shared is not None:
        for name in ("w_gate", "w_up", "gate"):
            if getattr(shared, name) is not None:
                drawn[name] = _normal(getattr(shared, name).weight.shape, std, gen)
    if layer is None:
        return
    from moekit.models.hf.sharded import shard_box, slot_experts

    experts, router = layer.experts, layer.router
    projections = ("w_gate", "w_up") if get_activation(experts.activation).gated else ("w_up",)
    scale = g / router.scaling  # step 2: undo the 1/g of each shard's weight and the router's scaling

    def w_in(s: int, hidden: range, cols: range) -> Tensor:  # shard s's [H, gate | up] at (hidden, cols)
        parts = []
        for j, name in enumerate(projections):  # column block j of w_in: projection j's units, transposed
            lo, hi = max(cols.start, j * f), min(cols.stop, (j + 1) * f)
            if lo < hi:
                parts.append(src.read(f"{prefix}{name}.weight", (range(s * f + lo - j * f, s * f + hi - j * f),
                                                                  hidden)).t())
        return torch.cat(parts, dim=1).float()  # float32 before any arithmetic: a bf16 source as its fp32 copy

    def w_out(s: int, units: range, hidden: range) -> Tensor:  # shard s's [f, H] at (units, hidden), scaled
        part = src.read(f"{prefix}w_out.weight", (hidden, range(s * f + units.start, s * f + units.stop)))
        return part.t().float() * scale

    placed = slot_experts(layer)  # a placement's logical expert per local row, else None
    names = (*projections, "w_out")
    for t, read in ((experts.w_in, w_in), (experts.w_out, w_out)):
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.numel() == 0:
            continue
        box = shard_box(t)
        shards = {}  # expert e = shard e % g: each shard's part read once, rows written one by one
        for j, e in enumerate(box[0] if placed is None else placed):
            if e % g not in shards:
                shards[e % g] = read(e % g, *box[1:])
            local[j].copy_(shards[e % g])
            if drop is not None:
                if not drop.stats:
                    drop.read_stats(src, prefix, names)
                _drop_units(local[j], t is experts.w_in, drop, e, f, shape.hidden_size, names, box, scale)
    _put(router.weight, rows.repeat_interleave(g, dim=0))  # step 3: row e = u_{e // g}
    for _, buf in router.named_buffers():  # aux-loss-free expert_bias, its pending load: zero at step 0
        buf.zero_()
    for bias in (getattr(router, "bias", None), getattr(experts, "b_in", None), getattr(experts, "b_out", None)):
        if bias is not None:  # the dense MLP has none: zero keeps the upcycled model the dense one
            bias.zero_()
    if layer.shared_expert is not None:
        for name, value in drawn.items():
            _put(getattr(layer.shared_expert, name).weight, value)
        layer.shared_expert.w_out.weight.zero_()


def _drop_units(row: Tensor, is_w_in: bool, drop: _Drop, expert: int, f: int, hidden: int, names, box,
                scale: float) -> None:
    """Overwrite expert ``expert``'s re-initialised units in ``row``, its local part (``box[1:]``) of w_in [H, gate |
    up] (column u of projection j at j * f + u) or of w_out [f, H] (row u, values scaled as the kept ones)."""
    mine = names[:-1] if is_w_in else names[-1:]
    units, values = drop.draw(expert, f, hidden, mine)
    rows, cols = box[1], box[2]
    if is_w_in:
        for j, name in enumerate(mine):
            at = [(int(u) + j * f, k) for k, u in enumerate(units) if int(u) + j * f in cols]
            if at:
                col = torch.tensor([c - cols.start for c, _ in at])
                row[:, col] = values[name][[k for _, k in at]][:, rows.start:rows.stop].t().to(row.dtype)
    else:
        at = [(int(u), k) for k, u in enumerate(units) if int(u) in rows]
        if at:
            here = torch.tensor([u - rows.start for u, _ in at])
            row[here] = (values[names[-1]][[k for _, k in at]][:, cols.start:cols.stop] * scale).to(row.dtype)
