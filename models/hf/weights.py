"""Tensor-by-tensor mapping between a moekit Transformer's state_dict and HuggingFace checkpoint keys.

One ``Rule`` per moekit tensor: the HF keys it is made of, ``join`` (HF tensors -> moekit tensor) and its
inverse ``split``. Rules are built from the moekit model (every entry of its state_dict gets exactly one
rule, asserted), so "every model tensor is filled" holds by construction; loading then checks that every
checkpoint key is consumed by some rule. Expected HF shapes come from running ``split`` on a meta tensor
of the moekit shape, so the shape check can never disagree with the copy.

Layouts (F = expert width, H = hidden, E experts):

    moekit experts.w_in   [E, H, 2F]  x @ w_in[e] -> [gate | up]     experts.w_out [E, F, H]
    HF per-expert         experts.{e}.{gate}.weight [F, H], {up} [F, H], {down} [H, F]
                          (Mixtral: w1 / w3 / w2; Qwen and DeepSeek: gate_proj / up_proj / down_proj)
    HF fused (in memory   experts.gate_up_proj [E, 2F, H] (gate rows first), experts.down_proj [E, H, F]
    in transformers 5)
    moekit DenseMLP       w_gate.weight [F, H], w_up.weight [F, H], w_out.weight [H, F]
    HF MLP                gate_proj [F, H], up_proj [F, H], down_proj [H, F]

Attention tensors have the HF tensor's shape and row order in moekit (``ATTENTION_NAMES``), so every
attention rule is an identity: GQA wq/wk/wv(/bias)/wo, q_norm/k_norm; MLA wq or wq_a/q_a_norm/wq_b,
wkv_a/kv_a_norm/wkv_b, wo.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from moekit.models.hf.io import CheckpointReader


@dataclass(frozen=True)
class Naming:
    """How one HuggingFace family names the parts of a decoder layer (``model.layers.{i}.`` omitted)."""

    moe_blocks: tuple[str, ...]  # sub-module holding the sparse block; the first one is written on export
    expert_proj: tuple[str, str, str]  # one expert's gate, up, down projection names
    experts_field: str  # config.json field with the routed expert count, for error messages
    shared: str | None = None  # shared expert(s) inside the block
    shared_gate: str | None = None  # Qwen2-MoE's sigmoid gate on the shared expert
    router_bias: str | None = None  # DeepSeek-V3's selection bias, under the block's ``gate``
    router_bias_in_block: bool = False  # MiniMax-M2: the selection bias sits in the block itself, not its gate
    router_bias_row: bool = False  # ERNIE 4.5: the selection bias is stored as one row [1, E]
    router: str = "gate"  # the router's module inside the block (gpt-oss: "router", whose ``bias`` is the gate's)
    woven: bool = False  # gpt-oss: fused experts, gate / up interleaved, with biases (_woven_expert_rules)
    dense_block: str = "mlp"  # a dense layer's FFN (Llama 4: feed_forward, as its MoE block)
    experts_in_out: bool = False  # fused experts stored [E, in, out] (Llama 4), moekit's layout, not [E, out, in]
    # transformers >= 5 marks the fused experts ``is_transposed`` (gpt-oss): PEFT's adapter on such a [E, in, out]
    # parameter holds the factors of each expert's delta transposed (models.hf.peft.fused_factors)
    experts_transposed: bool = False
    # how the release stores multi-token-prediction layers (models.mtp): "deepseek" as model.layers.{L + k} (enorm,
    # hnorm, eh_proj, shared_head.norm); "qwen" under mtp. (Qwen3-Next / Qwen3.5: pre_fc_norm_embedding,
    # pre_fc_norm_hidden, fc, norm, and the block as mtp.layers.{k})
    mtp: str = "deepseek"


# a depth's own tensors (models.mtp.MTPModule) -> their names in each MTP layout
MTP_NAMES = {"deepseek": {"enorm": "enorm.weight", "hnorm": "hnorm.weight", "eh_proj": "eh_proj.weight",
                          "norm": "shared_head.norm.weight"},
             "qwen": {"enorm": "pre_fc_norm_embedding.weight", "hnorm": "pre_fc_norm_hidden.weight",
                      "eh_proj": "fc.weight", "norm": "norm.weight"}}


def mtp_prefixes(naming: Naming, num_layers: int, k: int) -> tuple[str, str]:
    """(the prefix of MTP depth k's own tensors, that of its block) in the release (``Naming.mtp``)."""
    if naming.mtp == "qwen":
        return "mtp", f"mtp.layers.{k}"
    return f"model.layers.{num_layers + k}", f"model.layers.{num_layers + k}"


def layer_prefix(naming: Naming, num_layers: int, i: int) -> str:
    """The checkpoint prefix of block i: a main layer's, or for i >= num_layers MTP depth i - num_layers's."""
    return f"model.layers.{i}" if i < num_layers else mtp_prefixes(naming, num_layers, i - num_layers)[1]


@dataclass(frozen=True)
class Piece:
    """Where one HF tensor sits inside its moekit target, for slice-wise loads and exports (models/hf/sharded.py).

    Along target dim d the source covers chunk ``parts[d][0]`` of ``parts[d][1]`` equal chunks; ``dims[k]`` is
    the target dim that source dim k runs along. Target dims missing from ``dims`` are one index wide and
    absent from the source (the expert index of a per-expert tensor). E.g. expert e's gate [F, H] inside
    w_in [E, H, 2F]: parts ((e, E), (0, 1), (0, 2)), dims (2, 1).
    """

    parts: tuple[tuple[int, int], ...]
    dims: tuple[int | None, ...]  # None: a source dim of size 1 the target lacks (ERNIE's [1, E] selection bias)
    # (source dim k, ways): along k the source interleaves the target's ``ways`` equal chunks: source index s holds
    # target index (s % ways) * (n // ways) + s // ways (gpt-oss's gate_up_proj [.., 2F] = g0 u0 g1 u1 ...)
    interleave: tuple[int, int] | None = None

    def box(self, shape: tuple[int, ...]) -> tuple[range, ...]:
        """The target indices this source covers, one range per target dim."""
        return tuple(range(i * (n // c), (i + 1) * (n // c)) for n, (i, c) in zip(shape, self.parts))


@dataclass(frozen=True)
class Rule:
    target: str  # moekit state_dict key
    sources: tuple[str, ...]  # HF keys, in the order join() takes them
    join: Callable[[list[Tensor]], Tensor]
    split: Callable[[Tensor], list[Tensor]]
    fields: str  # config.json fields that set these shapes, for error messages
    identity: bool = False  # one source with the target's shape and layout: a box of one is that box of the other
    pieces: tuple[Piece, ...] = ()  # one per source: where it sits in the target (identity rules need none)

    def weaves(self) -> list[tuple[int, int] | None]:
        """Per source: its ``Piece.interleave`` (None: the source runs along the target as it is)."""
        return [p.interleave for p in self.pieces] if self.pieces else [None] * len(self.sources)

    def layout(self, shape: tuple[int, ...]) -> list[tuple[tuple[range, ...], tuple[int, ...]]] | None:
        """Per source: (its box in a target of ``shape``, the target dim of each source dim); None when
        only join / split know (no slice-wise load or export for such a rule)."""
        if self.identity:
            return [(tuple(range(n) for n in shape), tuple(range(len(shape))))]
        if len(self.pieces) != len(self.sources):
            return None
        return [(p.box(shape), p.dims) for p in self.pieces]


def woven_index(targets: range, n: int, ways: int) -> list[int]:
    """The source indices (``Piece.interleave``) of target indices ``targets`` along a dim of n."""
    chunk = n // ways
    return [(t % chunk) * ways + t // chunk for t in targets]


def weave(x: Tensor, dim: int, ways: int) -> Tensor:
    """Target order -> source order along ``dim``: [a0 a1 .. | b0 b1 ..] -> [a0 b0 a1 b1 ..]."""
    n = x.shape[dim]
    return x.unflatten(dim, (ways, n // ways)).transpose(dim, dim + 1).flatten(dim, dim + 1)


def unweave(x: Tensor, dim: int, ways: int) -> Tensor:
    """Source order -> target order along ``dim`` (``weave``'s inverse)."""
    n = x.shape[dim]
    return x.unflatten(dim, (n // ways, ways)).transpose(dim, dim + 1).flatten(dim, dim + 1)


def _one(target: str, source: str, fields: str) -> Rule:
    return Rule(target, (source,), lambda ts: ts[0], lambda t: [t], fields, identity=True)


def _woven_expert_rules(t: str, block: str, experts, fields: str) -> list[Rule]:
    """gpt-oss: gate_up_proj [E, H, 2F] (and its bias [E, 2F]) with gate and up columns interleaved, down_proj
    [E, F, H] and its bias [E, H] in moekit's own layout."""
    whole = lambda nd, weave_dim=None: (Piece(((0, 1),) * nd, tuple(range(nd)),  # noqa: E731
                                              None if weave_dim is None else (weave_dim, 2)),)
    rules = [Rule(f"{t}.experts.w_in", (f"{block}.experts.gate_up_proj",), lambda ts: unweave(ts[0], 2, 2),
                  lambda w: [weave(w, 2, 2)], fields, pieces=whole(3, 2)),
             _one(f"{t}.experts.w_out", f"{block}.experts.down_proj", fields)]
    if getattr(experts, "b_in", None) is not None:
        rules += [Rule(f"{t}.experts.b_in", (f"{block}.experts.gate_up_proj_bias",), lambda ts: unweave(ts[0], 1, 2),
                       lambda b: [weave(b, 1, 2)], fields, pieces=whole(2, 1)),
                  _one(f"{t}.experts.b_out", f"{block}.experts.down_proj_bias", fields)]
    return rules


def _expert_rules(t: str, block: str, naming: Naming, num_experts: int, fused: bool, experts=None) -> list[Rule]:
    """Rules for experts.w_in / w_out of one MoE layer (t: moekit prefix, block: HF block prefix)."""
    fields = f"hidden_size, {naming.experts_field}, expert intermediate size"
    if naming.woven:
        return _woven_expert_rules(t, block, experts, fields)
    if fused and naming.experts_in_out:  # [E, H, 2F] (gate | up) and [E, F, H]: moekit's w_in and w_out as they are
        return [_one(f"{t}.experts.w_in", f"{block}.experts.gate_up_proj", fields),
                _one(f"{t}.experts.w_out", f"{block}.experts.down_proj", fields)]
    if fused:
        transpose = lambda ts: ts[0].transpose(1, 2)  # noqa: E731  [E, a, b] <-> [E, b, a], both ways
        whole = (Piece(((0, 1),) * 3, (0, 2, 1)),)  # the whole target, its last two dims swapped
        return [Rule(f"{t}.experts.w_in", (f"{block}.experts.gate_up_proj",), transpose,
                     lambda w: [w.transpose(1, 2)], fields, pieces=whole),
                Rule(f"{t}.experts.w_out", (f"{block}.experts.down_proj",), transpose,
                     lambda w: [w.transpose(1, 2)], fields, pieces=whole)]
    g, u, d = naming.expert_proj
    E = num_experts
    gates = tuple(f"{block}.experts.{e}.{g}.weight" for e in range(E))
    ups = tuple(f"{block}.experts.{e}.{u}.weight" for e in range(E))
    downs = tuple(f"{block}.experts.{e}.{d}.weight" for e in range(E))

    def join_in(ts: list[Tensor]) -> Tensor:  # 2E x [F, H] -> [E, H, 2F]
        return torch.stack([torch.cat((ts[e], ts[E + e]), 0).t() for e in range(E)])

    def split_in(w: Tensor) -> list[Tensor]:  # [E, H, 2F] -> E gates [F, H], then E ups [F, H]
        gate, up = w.transpose(1, 2).chunk(2, dim=1)  # [E, F, H] each
        return [*gate.unbind(0), *up.unbind(0)]

    # expert e's gate [F, H] = w_in[e, :, :F].T, its up = w_in[e, :, F:].T, its down [H, F] = w_out[e].T
    in_pieces = tuple(Piece(((e, E), (0, 1), (half, 2)), (2, 1)) for half in (0, 1) for e in range(E))
    out_pieces = tuple(Piece(((e, E), (0, 1), (0, 1)), (2, 1)) for e in range(E))
    return [Rule(f"{t}.experts.w_in", gates + ups, join_in, split_in, fields, pieces=in_pieces),
            Rule(f"{t}.experts.w_out", downs, lambda ts: torch.stack([x.t() for x in ts]),
                 lambda w: list(w.transpose(1, 2).unbind(0)), fields, pieces=out_pieces)]


def moe_rules(t: str, block: str, ffn, naming: Naming, fused: bool) -> list[Rule]:
    """Rules for one moekit MoELayer ``ffn`` at moekit prefix ``t`` from HF block prefix ``block``."""
    router = f"{block}.{naming.router}"
    rules = [_one(f"{t}.router.weight", f"{router}.weight", f"hidden_size, {naming.experts_field}")]
    if getattr(ffn.router, "bias", None) is not None:  # a gate bias (gpt-oss): logits = x W^T + b
        if naming.router == "gate":
            raise ValueError(f"{t}.router has a gate bias (router option gate_bias) but this HuggingFace family's "
                             f"router has none; build the model without gate_bias")
        rules.append(_one(f"{t}.router.bias", f"{router}.bias", naming.experts_field))
    if getattr(ffn.router, "expert_bias", None) is not None:
        if naming.router_bias is None:
            raise ValueError(f"{t}.router has an expert_bias (aux-loss-free balancing) but this HuggingFace "
                             f"family has no selection bias to hold it; build the model without expert_bias or "
                             f"bias_update_rate")
        where = block if naming.router_bias_in_block else router
        source, target = f"{where}.{naming.router_bias}", f"{t}.router.expert_bias"
        if naming.router_bias_row:  # [1, E] on disk, [E] in moekit
            rules.append(Rule(target, (source,), lambda ts: ts[0].reshape(-1), lambda b: [b.reshape(1, -1)],
                              naming.experts_field, pieces=(Piece(((0, 1),), (None, 0)),)))
        else:
            rules.append(_one(target, source, naming.experts_field))
    if getattr(ffn.experts, "b_in", None) is not None and not naming.woven:
        raise ValueError(f"{t}.experts have biases (moe_ffn_bias) but this HuggingFace family's experts have none; "
                         f"build the model with moe_ffn_bias=false")
    rules += _expert_rules(t, block, naming, ffn.num_experts, fused, ffn.experts)
    if ffn.shared_expert is not None:
        if naming.shared is None:
            raise ValueError(f"{t} has a shared expert but this HuggingFace family has none; export a model "
                             f"with shared_ffn_hidden_size=0")
        rules += mlp_rules(f"{t}.shared_expert", f"{block}.{naming.shared}", "shared expert intermediate size")
        if ffn.shared_expert.gate is not None:
            if naming.shared_gate is None:
                raise ValueError(f"{t}.shared_expert has a sigmoid gate but this HuggingFace family has none")
            rules.append(_one(f"{t}.shared_expert.gate.weight", f"{block}.{naming.shared_gate}.weight", "hidden_size"))
    # No shared expert while the family always has one (Qwen2-MoE, DeepSeek-V3): an import never builds
    # that (the config implies one); export writes an all-zero one (models/hf/export.py, zero_fill).
    return rules


def mlp_rules(t: str, source: str, width: str) -> list[Rule]:
    fields = f"hidden_size, {width}"
    return [_one(f"{t}.w_gate.weight", f"{source}.gate_proj.weight", fields),
            _one(f"{t}.w_up.weight", f"{source}.up_proj.weight", fields),
            _one(f"{t}.w_out.weight", f"{source}.down_proj.weight", fields)]


# moekit attention module -> HF self_attn module, and the config.json fields that set its shape.
ATTENTION_NAMES = {
    "wq": ("q_proj", "hidden_size, num_attention_heads, head_dim (MLA: qk_nope_head_dim + qk_rope_head_dim)"),
    "wk": ("k_proj", "hidden_size, num_key_value_heads, head_dim"),
    "wv": ("v_proj", "hidden_size, num_key_value_heads, head_dim"),
    "wo": ("o_proj", "hidden_size, num_attention_heads, head_dim (MLA: v_head_dim)"),
    "q_norm": ("q_norm", "head_dim (OLMoE: num_attention_heads * head_dim)"),
    "k_norm": ("k_norm", "head_dim (OLMoE: num_key_value_heads * head_dim)"),
    "wq_a": ("q_a_proj", "hidden_size, q_lora_rank"),
    "q_a_norm": ("q_a_layernorm", "q_lora_rank"),
    "wq_b": ("q_b_proj", "q_lora_rank, num_attention_heads, qk_nope_head_dim + qk_rope_head_dim"),
    "wkv_a": ("kv_a_proj_with_mqa", "hidden_size, kv_lora_rank + qk_rope_head_dim"),
    "kv_a_norm": ("kv_a_layernorm", "kv_lora_rank"),
    "wkv_b": ("kv_b_proj", "kv_lora_rank, num_attention_heads, qk_nope_head_dim + v_head_dim"),
}


# moekit GatedDeltaNet parameter -> HF linear_attn tensor (Qwen3.5), and the config.json fields of its shape.
LINEAR_ATTENTION_NAMES = {
    "wqkv.weight": ("in_proj_qkv.weight", "hidden_size, linear_num_key_heads, linear_key_head_dim, "
                                          "linear_num_value_heads, linear_value_head_dim"),
    "wz.weight": ("in_proj_z.weight", "hidden_size, linear_num_value_heads, linear_value_head_dim"),
    "wb.weight": ("in_proj_b.weight", "hidden_size, linear_num_value_heads"),
    "wa.weight": ("in_proj_a.weight", "hidden_size, linear_num_value_heads"),
    "conv_weight": ("conv1d.weight", "linear_conv_kernel_dim and the q / k / v widths"),
    "dt_bias": ("dt_bias", "linear_num_value_heads"),
    "A_log": ("A_log", "linear_num_value_heads"),
    "norm.weight": ("norm.weight", "linear_value_head_dim"),
    "wo.weight": ("out_proj.weight", "hidden_size, linear_num_value_heads, linear_value_head_dim"),
}


def attention_rules(t: str, s: str, attn) -> list[Rule]:
    """Identity rules for every parameter of a moekit attention module (t: its prefix, s: HF self_attn's, or
    linear_attn's for a Gated DeltaNet layer)."""
    if hasattr(attn, "wqkv"):  # models.linear_attention.GatedDeltaNet
        return [_one(f"{t}.{ours}", f"{s}.{theirs}", fields) for ours, (theirs, fields) in LINEAR_ATTENTION_NAMES.items()]
    rules = []
    for ours, (theirs, fields) in ATTENTION_NAMES.items():
        module = getattr(attn, ours, None)
        if module is None:
            continue
        for p in ("weight", "bias"):
            if getattr(module, p, None) is not None:
                rules.append(_one(f"{t}.{ours}.{p}", f"{s}.{theirs}.{p}", fields))
    if getattr(attn, "sinks", None) is not None:  # gpt-oss: one logit per query head
        rules.append(_one(f"{t}.sinks", f"{s}.sinks", "num_attention_heads"))
    return rules


def layer_rules(i: int, layer, naming: Naming, block: str, fused: bool, target: str | None = None,
                source: str | None = None) -> list[Rule]:
    """Rules of the block at HF index i; ``target``: its moekit prefix (default ``layers.{i}``), ``source`` its
    checkpoint prefix (default ``model.layers.{i}``)."""
    t, s = target or f"layers.{i}", source or f"model.layers.{i}"
    mixer = "linear_attn" if hasattr(layer.attn, "wqkv") else "self_attn"
    rules = [_one(f"{t}.attn_norm.weight", f"{s}.input_layernorm.weight", "hidden_size"),
             *attention_rules(f"{t}.attn", f"{s}.{mixer}", layer.attn),
             _one(f"{t}.ffn_norm.weight", f"{s}.post_attention_layernorm.weight", "hidden_size")]
    if layer.is_moe:
        return rules + moe_rules(f"{t}.ffn", f"{s}.{block}", layer.ffn, naming, fused)
    return rules + mlp_rules(f"{t}.ffn", f"{s}.{naming.dense_block}", "intermediate_size")


def model_rules(model, naming: Naming, blocks: list[str], fused: list[bool], depths: int | None = None) -> list[Rule]:
    """Every rule for ``model``; blocks[i] / fused[i]: the HF block name and expert layout of layer i (MTP depth k:
    i = num_layers + k). ``depths``: how many of the model's MTP depths (models.mtp) the checkpoint holds (default
    all): the others have no rule (an import leaves them as initialised, an export does not write them)."""
    rules = [_one("embed.weight", "model.embed_tokens.weight", "vocab_size, hidden_size")]
    for i, layer in enumerate(model.layers):
        rules += layer_rules(i, layer, naming, blocks[i], fused[i])
    rules.append(_one("norm.weight", "model.norm.weight", "hidden_size"))
    if model.lm_head is not None:
        rules.append(_one("lm_head.weight", "lm_head.weight", "vocab_size, hidden_size"))
    L, mtp = len(model.layers), list(getattr(model, "mtp", ()))
    depths = len(mtp) if depths is None else depths
    for k, depth in enumerate(mtp[:depths]):  # models.mtp, as the release stores them (Naming.mtp)
        t, (s, block) = f"mtp.{k}", mtp_prefixes(naming, L, k)
        names = MTP_NAMES[naming.mtp]
        rules += [_one(f"{t}.{ours}.weight", f"{s}.{names[ours]}", "hidden_size")
                  for ours in ("enorm", "hnorm", "eh_proj")]
        rules += [*layer_rules(L + k, depth.block, naming, blocks[L + k], fused[L + k], target=f"{t}.block",
                               source=block),
                  _one(f"{t}.norm.weight", f"{s}.{names['norm']}", "hidden_size")]
    targets = [r.target for r in rules]
    unmapped = tuple(f"mtp.{k}." for k in range(depths, len(mtp)))  # depths the checkpoint has no layer for
    from moekit.models.lora import is_adapter  # LoRA adapters: folded into the weights before an export (save_hf)

    expected = [k for k in model.state_dict() if not k.endswith("pending_load") and not k.startswith(unmapped)
                and not is_adapter(k)]
    assert sorted(targets) == sorted(expected), f"rules miss {set(expected) - set(targets)}"
    return rules


# ---------------------------------------------------------------------------------------------------
# Loading: detect the checkpoint's layout, validate everything, then copy
# ---------------------------------------------------------------------------------------------------


def detect_layout(keys: set[str], i: int, naming: Naming, layer: str | None = None) -> tuple[str, bool]:
    """(block name, fused?) of layer i's experts in the checkpoint (``layer``: its prefix, default
    ``model.layers.{i}``); the family's default if absent."""
    for block in naming.moe_blocks:
        prefix = f"{layer or f'model.layers.{i}'}.{block}.experts."
        if prefix + "gate_up_proj" in keys or prefix + "down_proj" in keys:
            return block, True
        if any(k.startswith(prefix) for k in keys):
            return block, False
    return naming.moe_blocks[0], False


def check_counts(reader: CheckpointReader, model, naming: Naming, blocks: list[str], fused: list[bool],
                 num_layers_field: str, skipped: set[str] = frozenset(), depths: int = 0) -> None:
    """Layer and expert counts in the checkpoint must match config.json before any key-level check.
    ``skipped``: keys the import leaves out on purpose (families.skipped_keys), not counted."""
    layer_ids = {int(m.group(1)) for k in reader.infos
                 if k not in skipped and (m := re.match(r"model\.layers\.(\d+)\.", k))}
    L, D = len(model.layers), min(len(getattr(model, "mtp", ())), depths)
    in_layers = D if naming.mtp == "deepseek" else 0  # Qwen's MTP layers sit under mtp., not model.layers
    if layer_ids and max(layer_ids) + 1 != L + in_layers:
        mtp = f" and {D} multi-token-prediction layer(s) (num_nextn_predict_layers)" if in_layers else ""
        raise ValueError(f"config.json {num_layers_field}={L}{mtp} but the checkpoint has layers "
                         f"0..{max(layer_ids)} (e.g. model.layers.{max(layer_ids)}.*); the config does not match "
                         f"the weights")
    blocks_of = [*model.layers, *(depth.block for depth in list(getattr(model, "mtp", ()))[:D])]
    for i, layer in enumerate(blocks_of):
        if not layer.is_moe:
            continue
        prefix = f"{layer_prefix(naming, L, i)}.{blocks[i]}.experts."
        if fused[i]:
            key = prefix + ("gate_up_proj" if prefix + "gate_up_proj" in reader.infos else "down_proj")
            found, where = reader.infos[key].shape[0], f"{key} has shape {list(reader.infos[key].shape)}"
        else:
            ids = {int(m.group(1)) for k in reader.infos if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
            found, where = (max(ids) + 1 if ids else 0), f"{prefix}N.* has N in {_span(ids)}"
        if found != layer.ffn.num_experts:
            raise ValueError(f"config.json {naming.experts_field}={layer.ffn.num_experts} but layer {i} has "
                             f"{found} experts in the checkpoint ({where}); the config does not match the weights")


def _span(ids: set[int]) -> str:
    return f"{min(ids)}..{max(ids)}" if ids else "nothing"


def check_keys(reader: CheckpointReader, rules: list[Rule], state: dict[str, Tensor], allowed_extra: set[str]) -> None:
    """Missing keys, unconsumed keys and shape mismatches, all reported at once with their fixes."""
    needed = {s: r for r in rules for s in r.sources}
    missing = [s for s in needed if s not in reader.infos]
    extra = sorted(set(reader.infos) - set(needed) - allowed_extra)
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s) the config implies: " + ", ".join(
            f"{s} (for moekit {needed[s].target})" for s in missing[:5]))
    if extra:
        problems.append(f"{len(extra)} tensor(s) nothing in the model consumes (a config/weight mismatch or an "
                        f"unsupported feature): {extra[:5]}")
    for r in rules:
        if any(s not in reader.infos for s in r.sources):
            continue
        expected = [tuple(x.shape) for x in r.split(torch.empty(state[r.target].shape, device="meta"))]
        for s, shape in zip(r.sources, expected):
            if reader.infos[s].shape != shape:
                problems.append(f"{s} has shape {list(reader.infos[s].shape)} in the checkpoint but config.json "
                                f"({r.fields}) implies {list(shape)}")
    if problems:
        raise ValueError(f"checkpoint {reader.folder} does not match its config.json:\n  " + "\n  ".join(problems[:12])
                         + "\nFix config.json to describe these weights, or use the checkpoint it belongs to.")


@torch.no_grad()
def load_into(model, reader: CheckpointReader, rules: list[Rule], allowed_extra: set[str] = frozenset()) -> None:
    """Validate ``reader`` against ``rules`` (all problems in one ValueError), then fill every model tensor."""
    state = model.state_dict()
    check_keys(reader, rules, state, set(allowed_extra))
    for r in rules:
        state[r.target].copy_(r.join([reader.get(s) for s in r.sources]))


@torch.no_grad()
def export_tensors(model, rules: list[Rule], dtype: torch.dtype | None) -> dict[str, Tensor]:
    """HF key -> tensor (contiguous, on the CPU, in ``dtype`` or the model's own) for every rule."""
    state = model.state_dict()
    out: dict[str, Tensor] = {}
    written: set[tuple[int, int]] = set()  # tensors already written: a second key of one (MTP's copies) gets a copy
    for r in rules:
        value = state[r.target].detach()
        parts = r.split(value.to(dtype) if dtype is not None and value.is_floating_point() else value)
        for key, part in zip(r.sources, parts):
            t = part.to("cpu").contiguous()
            if (t.data_ptr(), t.numel()) in written:  # safetensors refuses two keys on the same memory
                t = t.clone()
            written.add((t.data_ptr(), t.numel()))
            out[key] = t
    return out
