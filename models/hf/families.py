"""HuggingFace config.json -> ModelConfig, one ``Family`` per ``model_type`` (the export side: models/hf/export.py).

A family says how its config.json maps onto ModelConfig (sizes, attention, RoPE, layer pattern, router),
how it names tensors (``weights.Naming``), and which of its features moekit's model lacks. Each family
reads exactly the fields its transformers class reads, with the same defaults. An import either
reproduces transformers' forward exactly or fails naming every missing feature: moekit never drops a
bias or a norm and hopes for the best.

    family       attention                              router (moekit "topk")
    mixtral      GQA                                    softmax, top-k renormalised (also k=1)
    qwen2_moe    GQA, qkv_bias                          softmax, normalize=norm_topk_prob; sigmoid-gated shared expert
    qwen3_moe    GQA, q/k RMSNorm per head              softmax, normalize=norm_topk_prob
    olmoe        GQA, q/k RMSNorm over the projection,  softmax, normalize=norm_topk_prob
                 clip_qkv
    deepseek_v3  MLA (q_lora_rank, kv_lora_rank, ...)   sigmoid + e_score_correction_bias, groups scored by their
                                                        top-2 (group_score_top=2), normalize, routed scaling;
                                                        shared experts, first_k_dense_replace dense layers
    minimax_m2   GQA, q/k RMSNorm over the projection,  sigmoid + e_score_correction_bias, top-k renormalised
                 RoPE on rotary_dim of each head
    gpt_oss      GQA with q/k/v/o biases, a sink logit     softmax over the top-k logits (= softmax, top-k,
                 per head, sliding window on every other   renormalised) of a biased gate; experts with biases
                 layer (layer_types), yarn                 and a clamped SwiGLU (swiglu_oai); MXFP4 weights read
    dots1        GQA, q/k RMSNorm per head, attention_bias  DeepSeek-V3's (sigmoid, bias, groups, scaling, shared
                 on q/k/v and o                             experts, dense first layers)
    deepseek_v2  MLA (as V3)                              softmax over all, top-k times routed scaling, no renorm;
                                                        group_limited_greedy: groups by their best score
    glm4_moe_lite MLA (as deepseek_v3)                   GLM-4.5's (DeepSeek-V3's); dense / MoE per layer from
                 (GLM-4.7-Flash)                        mlp_layer_types
    ernie4_5_moe GQA, RoPE on adjacent channel pairs        softmax + e_score_correction_bias ([1, E], moe_statics),
                 (rope_pairs "adjacent"), tied head         top-k renormalised; ungated shared experts; MoE layers
                                                        from moe_layer_start_index every moe_layer_interval-th
    llama, qwen2 (qkv bias), qwen3 (q/k norm per head): dense (num_experts=0)

Every family reads RoPE from ``rope_parameters`` (transformers 5) or ``rope_theta`` / ``rope_scaling`` (4):
plain, linear, yarn and llama3 map onto ModelConfig.rope_scaling. An imported config is named
``hf:<model_type>`` (``HF_NAME_PREFIX``): that is how ``save_hf`` knows the family a model came from, also
after a moekit checkpoint or ``moekit-convert`` round trip.
"""
from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moekit.models.config import ROPE_SCALINGS, ModelConfig
from moekit.models.hf import fp8
from moekit.models.hf.io import MODEL_TYPE_ALIASES
from moekit.models.hf.weights import Naming

HF_NAME_PREFIX = "hf:"
GATED = ("gate_proj", "up_proj", "down_proj")
MIXTRAL = Naming(moe_blocks=("block_sparse_moe", "mlp"), expert_proj=("w1", "w3", "w2"),
                 experts_field="num_local_experts")
QWEN2_MOE = Naming(moe_blocks=("mlp",), expert_proj=GATED, experts_field="num_experts", shared="shared_expert",
                   shared_gate="shared_expert_gate")
QWEN3_MOE = Naming(moe_blocks=("mlp",), expert_proj=GATED, experts_field="num_experts")
OLMOE = Naming(moe_blocks=("mlp",), expert_proj=GATED, experts_field="num_experts")
DEEPSEEK_V3 = Naming(moe_blocks=("mlp",), expert_proj=GATED, experts_field="n_routed_experts", shared="shared_experts",
                     router_bias="e_score_correction_bias")
DENSE = Naming(moe_blocks=("mlp",), expert_proj=GATED, experts_field="(dense model: no experts)")
MINIMAX_M2 = Naming(moe_blocks=("block_sparse_moe", "mlp"), expert_proj=("w1", "w3", "w2"),
                    experts_field="num_local_experts", router_bias="e_score_correction_bias", router_bias_in_block=True)
ERNIE4_5_MOE = Naming(moe_blocks=("mlp",), expert_proj=GATED, experts_field="moe_num_experts", shared="shared_experts",
                      router_bias="moe_statics.e_score_correction_bias", router_bias_in_block=True,
                      router_bias_row=True)
QWEN3_5_MOE = Naming(moe_blocks=("mlp",), expert_proj=GATED, experts_field="num_experts", shared="shared_expert",
                     shared_gate="shared_expert_gate", mtp="qwen")
QWEN3_5_DENSE = Naming(moe_blocks=("mlp",), expert_proj=GATED, experts_field="(dense model: no experts)", mtp="qwen")
LLAMA4 = Naming(moe_blocks=("feed_forward",), expert_proj=GATED, experts_field="num_local_experts",
                shared="shared_expert", router="router", dense_block="feed_forward", experts_in_out=True)
GPT_OSS = Naming(moe_blocks=("mlp",), expert_proj=GATED, experts_field="num_local_experts", router="router",
                 woven=True, experts_transposed=True)

# What moekit's model would need to lift each refusal (also listed in docs/hf.md).
NEEDS = {
    "mla_bias": "biases on MLA's q_a / kv_a / o projections",
    "mlp_bias": "biases on the FFN projections",
    "activation": "an FFN gated by another activation (moekit's gated FFN is SwiGLU = silu(gate) * up)",
    "partial_rotary": "partial rotary embeddings (RoPE on a fraction of each head)",
    "rope_type": "this RoPE scaling type (moekit has linear, yarn and llama3)",
    "layer_pattern": "an explicit per-layer MoE/dense list in ModelConfig besides first_dense_layers / moe_every",
    "window_pattern": "a per-layer sliding-window list besides sliding_window / full_attention_every",
    "swiglu_oai": "gpt-oss's clamped SwiGLU with other constants (moekit's swiglu_oai: alpha 1.702, limit 7)",
}


class UnsupportedCheckpoint(ValueError):
    """A checkpoint whose math moekit's model cannot reproduce (the message names every missing feature)."""


def _get(hf: dict, key: str | tuple[str, ...], default: Any = ...) -> Any:
    """hf[key]; a tuple lists aliases (transformers renames fields across versions: num_experts ->
    num_local_experts), the first present wins. No default: a missing field is a ValueError."""
    for name in (key,) if isinstance(key, str) else key:
        if hf.get(name) is not None:
            return hf[name]
    if default is ...:
        raise ValueError(f"config.json lacks {key!r}, which a {hf.get('model_type')} config must have; "
                         f"re-save it with save_pretrained")
    return default


# ---------------------------------------------------------------------------------------------------
# Shared fields: sizes, attention, RoPE
# ---------------------------------------------------------------------------------------------------


def rope_fields(hf: dict, default_theta: float, problems: list[str],
                partial_rotary: float | None = None) -> dict[str, Any]:
    """rope_theta and rope_scaling from transformers 5's rope_parameters or 4's rope_theta / rope_scaling,
    with transformers' defaults filled in (original_max_position_embeddings, yarn's factor).
    partial_rotary: the family rotates partial_rotary_factor of each head (GLM-4-MoE), this value when config.json
    has none (transformers' default for the family); None: a factor other than 1 is refused (transformers' other
    families would not run it)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        problems.append(f"RoPE parameters per layer type ({sorted(params)}) (needs {NEEDS['rope_type']})")
        return {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", default_theta)))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    fields: dict[str, Any] = dict(rope_theta=theta)
    if partial_rotary is not None:
        fields["partial_rotary_factor"] = float(partial_rotary if partial is None else partial)
    elif partial is not None and partial != 1.0:
        problems.append(f"partial_rotary_factor={partial} (needs {NEEDS['partial_rotary']})")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return dict(fields, rope_scaling={})
    if kind not in ROPE_SCALINGS:
        problems.append(f"rope_type={kind!r} (needs {NEEDS['rope_type']})")
        return fields
    max_pos = _get(hf, "max_position_embeddings", 4096)
    required, optional = ROPE_SCALINGS[kind]
    scaling = {"rope_type": kind}
    if "original_max_position_embeddings" in required:  # transformers: the top-level field wins, then max_pos
        params["original_max_position_embeddings"] = (hf.get("original_max_position_embeddings")
                                                      or params.get("original_max_position_embeddings") or max_pos)
    if kind == "yarn" and params.get("factor") is None:
        params["factor"] = max_pos / params["original_max_position_embeddings"]
    for key in required:
        if params.get(key) is None:
            raise ValueError(f"config.json rope_parameters with rope_type={kind!r} lacks {key!r}; add it")
        scaling[key] = params[key]
    for key in optional:
        # transformers reads yarn's beta_fast / beta_slow as `value or default`: a 0 means the default
        if params.get(key) is not None and not (key in ("beta_fast", "beta_slow") and not params[key]):
            scaling[key] = params[key]
    return dict(fields, rope_scaling=scaling)


def base_fields(hf: dict, problems: list[str], *, default_theta: float = 10000.0, head_dim_default: int = 0,
                window: int | None = None, partial_rotary: float | None = None) -> dict[str, Any]:
    """ModelConfig fields every family shares: sizes, GQA heads, RoPE, norm, embeddings, training defaults.

    window: the sliding-window length when some layer uses one. Sliding-window attention equals full causal
    attention while the sequence fits in the window, so the import is exact up to max_seq_len = window
    (longer inputs raise in Transformer.forward)."""
    H, N = _get(hf, "hidden_size"), _get(hf, "num_attention_heads")
    if _get(hf, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (needs {NEEDS['activation']})")
    problems += fp8.config_problems(hf.get("quantization_config"))  # block-wise fp8 is read, dequantized
    head_dim = _get(hf, "head_dim", 0) or head_dim_default or H // N
    max_pos = _get(hf, "max_position_embeddings", 4096)
    return dict(
        name=HF_NAME_PREFIX + hf["model_type"], vocab_size=_get(hf, "vocab_size"), hidden_size=H,
        num_layers=_get(hf, "num_hidden_layers"), num_heads=N, num_kv_heads=_get(hf, "num_key_value_heads", N),
        head_dim=0 if head_dim * N == H else head_dim, max_seq_len=min(max_pos, window) if window else max_pos,
        norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)), tie_embeddings=bool(_get(hf, "tie_word_embeddings", False)),
        init_std=float(_get(hf, "initializer_range", 0.02)), activation="swiglu", router="topk",
        capacity_factor=None, aux_loss_coeff=float(_get(hf, "router_aux_loss_coef", 0.0)), z_loss_coeff=0.0,
        **rope_fields(hf, default_theta, problems, partial_rotary),
    )


def qwen_window(hf: dict) -> int | None:
    """Qwen families: a window only with use_sliding_window, and only if some layer is a sliding one."""
    window = hf.get("sliding_window")
    if not hf.get("use_sliding_window") or not window:
        return None
    types = hf.get("layer_types")
    return window if types is None or "sliding_attention" in types else None


def all_attention_biases(hf: dict, fields: dict[str, Any]) -> None:
    """Llama, Qwen3, Qwen3-MoE, OLMoE: attention_bias puts a bias on q/k/v and on o_proj."""
    if hf.get("attention_bias"):
        fields.update(attention_bias=True, attention_out_bias=True)


def layer_pattern(moe: list[bool]) -> tuple[int, int] | None:
    """(first_dense_layers, moe_every) reproducing the per-layer MoE flags, or None if none does."""
    L = len(moe)
    for first in range(L + 1):
        for every in range(1, L + 1):
            if [i >= first and (i - first) % every == every - 1 for i in range(L)] == moe:
                return first, every
    return None


def _model_config(hf: dict, fields: dict[str, Any], problems: list[str]) -> ModelConfig:
    if problems:
        raise UnsupportedCheckpoint(
            f"model_type={hf.get('model_type')!r}: this checkpoint needs feature(s) moekit's model lacks, so its "
            f"logits could not match transformers':\n  - " + "\n  - ".join(problems))
    try:
        return ModelConfig(**fields).validate()
    except ValueError as exc:
        raise ValueError(f"config.json ({hf.get('model_type')}) maps to an invalid moekit config: {exc}") from None


# ---------------------------------------------------------------------------------------------------
# Families
# ---------------------------------------------------------------------------------------------------


def mixtral_config(hf: dict) -> ModelConfig:
    """Mixtral: every layer MoE, softmax top-k renormalised; a sliding_window applies to every layer (Mistral's),
    and moekit's attention has one (model.sliding_window), so the window does not cap max_seq_len."""
    problems: list[str] = []
    fields = base_fields(hf, problems, default_theta=1e6)
    window = hf.get("sliding_window")
    if window and window < fields["max_seq_len"]:  # a window at least as long as the sequence changes nothing
        fields["sliding_window"] = window
    F = _get(hf, "intermediate_size")
    # Every Mixtral layer is sparse; the dense FFN width is unused and kept equal to the expert width.
    fields.update(num_experts=_get(hf, ("num_local_experts", "num_experts")), top_k=_get(hf, "num_experts_per_tok"),
                  moe_ffn_hidden_size=F, ffn_hidden_size=F, router_options={"normalize": True})
    return _model_config(hf, fields, problems)


def qwen_moe_config(hf: dict) -> ModelConfig:
    """Qwen2-MoE and Qwen3-MoE: softmax top-k, optional renorm, sparse-step layer pattern."""
    problems: list[str] = []
    qwen2 = hf.get("model_type") == "qwen2_moe"
    fields = base_fields(hf, problems, window=qwen_window(hf))
    if qwen2:
        fields["attention_bias"] = bool(hf.get("qkv_bias", True))  # Qwen2MoeConfig: qkv_bias, default true
    else:
        all_attention_biases(hf, fields)
        fields["qk_norm"] = "head"
    E, L = _get(hf, ("num_experts", "num_local_experts")), fields["num_layers"]
    first, every = qwen_layer_pattern(hf, E, L, problems)
    fields.update(num_experts=E, top_k=_get(hf, "num_experts_per_tok"), first_dense_layers=first, moe_every=every,
                  moe_ffn_hidden_size=_get(hf, "moe_intermediate_size"), ffn_hidden_size=_get(hf, "intermediate_size"),
                  router_options=softmax_router_options(hf))
    if qwen2:
        fields.update(shared_ffn_hidden_size=_get(hf, "shared_expert_intermediate_size"), shared_expert_gate=True)
    return _model_config(hf, fields, problems)


def qwen_layer_pattern(hf: dict, E: int, L: int, problems: list[str]) -> tuple[int, int]:
    """(first_dense_layers, moe_every) of the Qwen MoE families' layer pattern: layer i is MoE iff it is not in
    mlp_only_layers and (i + 1) % decoder_sparse_step == 0; a pattern no pair reproduces is a problem."""
    step, dense = _get(hf, "decoder_sparse_step", 1), set(_get(hf, "mlp_only_layers", []))
    moe = [i not in dense and E > 0 and (i + 1) % step == 0 for i in range(L)]
    pattern = layer_pattern(moe)
    if pattern is None:
        problems.append(f"MoE layers {[i for i in range(L) if moe[i]]} of {L} (mlp_only_layers, decoder_sparse_step) "
                        f"(needs {NEEDS['layer_pattern']})")
    return pattern or (0, 1)


def softmax_router_options(hf: dict) -> dict[str, Any]:
    """Qwen2/3-MoE and OLMoE: softmax over all experts, top-k, renormalised iff norm_topk_prob."""
    return {"normalize": bool(_get(hf, "norm_topk_prob", False))}


qwen_router_options = softmax_router_options  # the earlier name


def olmoe_config(hf: dict) -> ModelConfig:
    problems: list[str] = []
    fields = base_fields(hf, problems)
    all_attention_biases(hf, fields)
    E = _get(hf, ("num_experts", "num_local_experts"))
    F = _get(hf, "intermediate_size")  # OLMoE's experts have intermediate_size; every layer is sparse
    fields.update(qk_norm="full", qkv_clip=float(_get(hf, "clip_qkv", 0.0)), num_experts=E,
                  top_k=_get(hf, "num_experts_per_tok"), moe_ffn_hidden_size=F, ffn_hidden_size=F,
                  router_options=softmax_router_options(hf))
    return _model_config(hf, fields, problems)


def deepseek_v3_config(hf: dict) -> ModelConfig:
    problems: list[str] = []
    fields = _deepseek_fields(hf, problems)
    if _get(hf, "scoring_func", "sigmoid") != "sigmoid":
        problems.append(f"scoring_func={hf['scoring_func']!r} (transformers' DeepseekV3 always scores with sigmoid, "
                        f"so the checkpoint was not trained for it)")
    fields.update(router_options=deepseek_router_options(hf, problems), mtp_layers=mtp_layers_of(hf))
    return _model_config(hf, fields, problems)


def deepseek_v2_config(hf: dict) -> ModelConfig:
    """DeepSeek-V2 / V2-Lite / V2.5 (transformers' DeepseekV2): DeepSeek-V3's MLA, shared experts and dense first
    layers, with V2's router: softmax over every expert, the top-k weights times routed_scaling_factor and never
    renormalised (transformers' DeepseekV2 ignores norm_topk_prob), no selection bias; topk_method
    "group_limited_greedy" keeps the topk_group groups of the highest single score (group_score_top=1)."""
    problems: list[str] = []
    fields = _deepseek_fields(hf, problems)
    options: dict[str, Any] = {"normalize": False, "scaling": float(_get(hf, "routed_scaling_factor", 1.0))}
    method, groups, topk_group = _get(hf, "topk_method", "greedy"), hf.get("n_group") or 1, hf.get("topk_group") or 1
    if method not in ("greedy", "group_limited_greedy"):
        problems.append(f"topk_method={method!r} (transformers' DeepseekV2 runs greedy and group_limited_greedy)")
    elif method == "group_limited_greedy" and 1 < groups and topk_group < groups:
        options.update(num_groups=groups, group_top_k=topk_group, group_score_top=1)
    if hf.get("seq_aux"):  # DeepSeek-V2's training balanced per sequence (its aux_loss_alpha is that loss's)
        options["balance"] = "sequence"
    # transformers' DeepseekV2 always rotates interleaved pairs (complex multiplication), whatever a config says
    fields.update(router_options=options, aux_loss_coeff=float(_get(hf, "aux_loss_alpha", 0.0)), rope_interleave=True)
    return _model_config(hf, fields, problems)


def _deepseek_fields(hf: dict, problems: list[str]) -> dict[str, Any]:
    """The fields DeepSeek-V2 and V3 share: MLA, routed and shared experts, dense first layers."""
    fields = base_fields(hf, problems)
    if hf.get("attention_bias"):
        problems.append(f"attention_bias=true (needs {NEEDS['mla_bias']})")
    if _get(hf, "moe_layer_freq", 1) != 1:
        problems.append(f"moe_layer_freq={hf['moe_layer_freq']} (transformers' DeepSeek classes ignore it and put an "
                        f"MoE FFN in every layer from first_k_dense_replace on; needs {NEEDS['layer_pattern']})")
    if hf.get("mlp_bias"):
        problems.append(f"mlp_bias=true (needs {NEEDS['mlp_bias']})")
    scaling = fields.get("rope_scaling") or {}
    raw = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if scaling.get("rope_type") not in (None, "yarn") and raw.get("mscale_all_dim"):
        problems.append(f"mscale_all_dim with rope_type={scaling['rope_type']!r} (transformers' MLA scales its "
                        f"softmax by it for any scaled RoPE; moekit's MLA for yarn only)")
    N = fields["num_heads"]
    fields.update(
        attention="mla", num_kv_heads=N, head_dim=0, q_lora_rank=_get(hf, "q_lora_rank", 0),
        kv_lora_rank=_get(hf, "kv_lora_rank"), qk_nope_head_dim=_get(hf, "qk_nope_head_dim"),
        qk_rope_head_dim=_get(hf, "qk_rope_head_dim"), v_head_dim=_get(hf, "v_head_dim"),
        rope_interleave=bool(_get(hf, "rope_interleave", True)), **deepseek_moe_fields(hf, first_dense=0))
    return fields


def deepseek_moe_fields(hf: dict, first_dense: int) -> dict[str, Any]:
    """DeepSeek's MoE layout, as DeepSeek-V2 / V3, GLM-4.5 and dots.llm1 write it: routed experts of
    moe_intermediate_size, n_shared_experts ungated shared ones, first_k_dense_replace dense layers (``first_dense``:
    the family's default), no aux loss (they balance by bias or not at all)."""
    width = _get(hf, "moe_intermediate_size")
    return dict(num_experts=_get(hf, ("n_routed_experts", "num_local_experts")), top_k=_get(hf, "num_experts_per_tok"),
                moe_ffn_hidden_size=width, ffn_hidden_size=_get(hf, "intermediate_size"),
                shared_ffn_hidden_size=width * _get(hf, "n_shared_experts", 1),
                first_dense_layers=_get(hf, "first_k_dense_replace", first_dense), aux_loss_coeff=0.0)


def deepseek_router_options(hf: dict, problems: list[str] | None = None) -> dict[str, Any]:
    """Sigmoid scores, selection bias, group-limited top-k, renorm, routed scaling (DeepseekV3TopkRouter).

    transformers scores a group by the sum of its top-2 experts (group_score_top=2). Groups are left out
    when they cannot mask anything (one group, or every group kept)."""
    groups, topk_group = _get(hf, "n_group", 1), _get(hf, "topk_group", 1)
    options = {"score": "sigmoid", "normalize": bool(_get(hf, "norm_topk_prob", True)), "expert_bias": True,
               "scaling": float(_get(hf, "routed_scaling_factor", 1.0))}
    if groups > 1 and topk_group < groups:
        options.update(num_groups=groups, group_top_k=topk_group, group_score_top=2)
    return options


def glm4_moe_config(hf: dict) -> ModelConfig:
    """GLM-4.5 / 4.6 (transformers' Glm4Moe): grouped-query attention with q/k/v biases (attention_bias; none on
    o_proj), optional per-head q/k norm, RoPE on partial_rotary_factor of each head; DeepSeek-V3's MoE (sigmoid
    scores, selection bias, group-limited top-k, routed scaling, ungated shared experts, dense first layers)."""
    problems: list[str] = []
    fields = base_fields(hf, problems, partial_rotary=0.5)  # Glm4MoeConfig's default when config.json has none
    fields.update(
        attention_bias=bool(_get(hf, "attention_bias", False)), qk_norm="head" if hf.get("use_qk_norm") else "none",
        **deepseek_moe_fields(hf, first_dense=1), router_options=deepseek_router_options(hf, problems),
        mtp_layers=mtp_layers_of(hf))
    return _model_config(hf, fields, problems)


def glm4_moe_lite_config(hf: dict) -> ModelConfig:
    """GLM-4.7-Flash (transformers' Glm4MoeLite): DeepSeek-V3's multi-head latent attention (interleaved rope pairs
    by default) with GLM-4.5's MoE, which is DeepSeek-V3's (sigmoid scores, selection bias, groups, routed scaling,
    ungated shared experts); each layer dense or sparse as mlp_layer_types says (default: the first dense)."""
    problems: list[str] = []
    fields = _deepseek_fields(hf, problems)
    L = fields["num_layers"]
    types = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (L - 1)
    bad = sorted({t for t in types if t not in ("dense", "sparse")})
    if len(types) != L or bad:
        problems.append(f"mlp_layer_types={types} (needs {L} entries of dense / sparse)")
        types = ["sparse"] * L
    pattern = layer_pattern([t == "sparse" for t in types])
    if pattern is None:
        problems.append(f"MoE layers {[i for i, t in enumerate(types) if t == 'sparse']} of {L} (mlp_layer_types) "
                        f"(needs {NEEDS['layer_pattern']})")
    first, every = pattern or (0, 1)
    fields.update(first_dense_layers=first, moe_every=every, router_options=deepseek_router_options(hf, problems),
                  mtp_layers=mtp_layers_of(hf))
    return _model_config(hf, fields, problems)


def minimax_m2_config(hf: dict) -> ModelConfig:
    """MiniMax-M2 / M2.1 (transformers' MiniMaxM2): grouped-query attention whose q and k are RMSNormed over the whole
    projection before RoPE (qk_norm "full", OLMoE's), RoPE on rotary_dim of each head (legacy field; transformers 5
    writes partial_rotary_factor); every layer MoE, its router sigmoid scores plus e_score_correction_bias for the
    choice (aux-loss-free balancing), the top-k renormalised, no shared expert, no routed scaling. transformers' class
    always builds the q/k norms and always scores with sigmoid, whatever use_qk_norm / scoring_func say."""
    problems: list[str] = []
    H, N = _get(hf, "hidden_size"), _get(hf, "num_attention_heads")
    head_dim, rotary = _get(hf, "head_dim", 0) or H // N, hf.get("rotary_dim")
    fields = base_fields(hf, problems, default_theta=5e6, partial_rotary=rotary / head_dim if rotary else 1.0)
    if _get(hf, "scoring_func", "sigmoid") != "sigmoid":
        problems.append(f"scoring_func={hf['scoring_func']!r} (transformers' MiniMaxM2 always scores with sigmoid, "
                        f"so the checkpoint was not trained for it)")
    F = _get(hf, "intermediate_size")
    fields.update(qk_norm="full", num_experts=_get(hf, ("num_local_experts", "num_experts")),
                  top_k=_get(hf, "num_experts_per_tok"), moe_ffn_hidden_size=F, ffn_hidden_size=F,
                  router_options={"score": "sigmoid", "normalize": True, "expert_bias": True})
    return _model_config(hf, fields, problems)


def dots1_config(hf: dict) -> ModelConfig:
    """dots.llm1 (rednote; transformers' Dots1): Qwen3's attention (q/k RMSNorm per head, attention_bias on q/k/v and
    o) with DeepSeek-V3's MoE (sigmoid scores, selection bias, groups scored by their top 2, routed scaling, ungated
    shared experts, dense first layers). Sliding layers (layer_types; by default none: max_window_layers = all)
    follow layer_windows."""
    problems: list[str] = []
    fields = base_fields(hf, problems)
    all_attention_biases(hf, fields)
    L = fields["num_layers"]
    max_window = hf.get("max_window_layers", L)
    window = hf.get("sliding_window")
    types = hf.get("layer_types") or ["sliding_attention" if window is not None and i >= max_window
                                      else "full_attention" for i in range(L)]
    fields.update(layer_windows(types, window, fields["max_seq_len"]))
    fields.update(
        qk_norm="head", **deepseek_moe_fields(hf, first_dense=0),
        router_options={**deepseek_router_options(hf, problems), "normalize": bool(_get(hf, "norm_topk_prob", False))})
    return _model_config(hf, fields, problems)


def layer_windows(types: list[str], window: int | None, max_seq_len: int) -> dict[str, Any]:
    """ModelConfig fields for transformers' per-layer layer_types with ``window``: none when no layer slides; a
    sliding_window with the full_attention_every pattern that reproduces them; else (a pattern moekit has no field
    for, e.g. only the last layers sliding) max_seq_len capped at the window, where full attention equals it."""
    if "sliding_attention" not in types or not window:
        return {}
    every = window_pattern(types)
    if every is not None:
        return dict(sliding_window=window, full_attention_every=every)
    return dict(max_seq_len=min(max_seq_len, window))


def window_pattern(types: list[str]) -> int | None:
    """full_attention_every reproducing transformers' layer_types (layer i full iff (i + 1) % n == 0; 0: every
    layer slides), or None if none does."""
    full = [t == "full_attention" for t in types]
    for n in range(len(types) + 1):
        if [bool(n) and (i + 1) % n == 0 for i in range(len(types))] == full:
            return n
    return None


def gpt_oss_config(hf: dict) -> ModelConfig:
    """OpenAI's gpt-oss (transformers' GptOss): GQA with biases on q/k/v/o and a learned sink per head, a
    sliding window on the layers layer_types marks (every other one), yarn RoPE; every layer MoE with a biased
    gate (softmax over the top-k logits), experts with biases and a clamped SwiGLU."""
    from moekit.moe.activations import OAI_ALPHA, OAI_LIMIT

    problems: list[str] = []
    fields = base_fields(hf, problems, default_theta=150000.0)
    L = fields["num_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
    bad = sorted({t for t in types if t not in ("sliding_attention", "full_attention")})
    if len(types) != L or bad:
        problems.append(f"layer_types={types} (needs {L} entries of sliding_attention / full_attention)")
    window, every = _get(hf, "sliding_window", 128), window_pattern(types)
    if "sliding_attention" not in types or not window:
        window, every = 0, 0
    elif every is None:
        problems.append(f"sliding layers {[i for i, t in enumerate(types) if t != 'full_attention']} of {L} "
                        f"(layer_types) (needs {NEEDS['window_pattern']})")
        every = 0
    alpha, limit = float(_get(hf, "swiglu_alpha", OAI_ALPHA)), float(_get(hf, "swiglu_limit", OAI_LIMIT))
    if (alpha, limit) != (OAI_ALPHA, OAI_LIMIT):
        problems.append(f"swiglu_alpha={alpha}, swiglu_limit={limit} (needs {NEEDS['swiglu_oai']})")
    bias = bool(_get(hf, "attention_bias", True))
    F = _get(hf, "intermediate_size")
    fields.update(attention_bias=bias, attention_out_bias=bias, attention_sinks=True, sliding_window=window,
                  full_attention_every=every, num_experts=_get(hf, ("num_local_experts", "num_experts")),
                  top_k=_get(hf, ("num_experts_per_tok", "experts_per_token")), moe_ffn_hidden_size=F,
                  ffn_hidden_size=F, activation="swiglu_oai", moe_ffn_bias=True,
                  router_options={"normalize": True, "gate_bias": True})
    return _model_config(hf, fields, problems)


def ernie4_5_moe_config(hf: dict) -> ModelConfig:
    """ERNIE 4.5 MoE (Baidu's ERNIE-4.5-21B-A3B / 300B-A47B; transformers' Ernie4_5_Moe): grouped-query attention
    whose RoPE rotates adjacent channel pairs (2i, 2i + 1: rope_pairs "adjacent"), a head tied to the embedding by
    default; MoE FFNs on layers moe_layer_start_index .. moe_layer_end_index with (i + 1) % moe_layer_interval == 0,
    dense ones elsewhere; the router's softmax over every expert chooses by the scores plus e_score_correction_bias
    (aux-loss-free balancing, stored as [1, E] under the block's moe_statics) and renormalises the chosen weights;
    moe_num_shared_experts ungated shared experts of moe_intermediate_size, summed into one."""
    problems: list[str] = []
    fields = base_fields(hf, problems, default_theta=500000.0)
    fields["tie_embeddings"] = bool(_get(hf, "tie_word_embeddings", True))  # Ernie4_5_MoeConfig's default
    if hf.get("use_bias"):
        problems.append(f"use_bias=true (biases on every projection, the FFNs' too: needs {NEEDS['mlp_bias']})")
    E, L = _get(hf, ("moe_num_experts", "num_experts")), fields["num_layers"]
    k = _get(hf, ("moe_k", "num_experts_per_tok"))
    start, end = _get(hf, "moe_layer_start_index", 1), _get(hf, "moe_layer_end_index", -1)
    interval = _get(hf, "moe_layer_interval", 1)
    if not all(isinstance(v, int) for v in (start, end, interval)):  # ERNIE-VL's per-modality lists
        problems.append(f"moe_layer_start_index={start!r}, moe_layer_end_index={end!r}, moe_layer_interval="
                        f"{interval!r} (transformers' Ernie4_5_Moe reads integers)")
        start, end, interval = 0, -1, 1
    end = L - 1 if end == -1 else end
    moe = [E > 0 and (i + 1) % interval == 0 and start <= i <= end for i in range(L)]
    pattern = layer_pattern(moe)
    if pattern is None:
        problems.append(f"MoE layers {[i for i in range(L) if moe[i]]} of {L} (moe_layer_start_index={start}, "
                        f"moe_layer_end_index={end}, moe_layer_interval={interval}) (needs {NEEDS['layer_pattern']})")
    first, every = pattern or (0, 1)
    norm_min = float(_get(hf, "moe_norm_min", 1e-12))
    if E and norm_min > k / E:  # the chosen softmax weights sum to at least k / E: a smaller floor never applies
        problems.append(f"moe_norm_min={norm_min} above top-k / experts = {k / E:.3g} (the renormalisation would be "
                        f"floored; moekit's divides by the weights' sum)")
    width = _get(hf, "moe_intermediate_size")
    fields.update(rope_pairs="adjacent", num_experts=E, top_k=k, first_dense_layers=first, moe_every=every,
                  moe_ffn_hidden_size=width, ffn_hidden_size=_get(hf, "intermediate_size"),
                  shared_ffn_hidden_size=width * _get(hf, "moe_num_shared_experts", 2),
                  router_options={"normalize": True, "expert_bias": True})
    return _model_config(hf, fields, problems)


# Qwen3.5's release (Qwen3_5MoeForConditionalGeneration) nests the language model's config under text_config and
# its weights under model.language_model.; the vision tower (model.visual.*) is left out, the MTP layer (mtp.*) loads
# into the model's depth (models.mtp)
QWEN3_5_NESTED = ("model.language_model.", "model.")


# release -> its language model's type
MULTIMODAL = {"qwen3_5_moe": "qwen3_5_moe_text", "qwen3_5": "qwen3_5_text", "llama4": "llama4_text"}


def text_config(hf: dict) -> dict:
    """The language model's config: a multimodal release's text_config (its model_type the text one), else hf."""
    kind = hf.get("model_type")
    if kind in MULTIMODAL:
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"config.json ({kind}) lacks its text_config table, which holds the language "
                             f"model's sizes; re-save it with save_pretrained")
        return {**text, "model_type": MULTIMODAL[kind],
                "tie_word_embeddings": text.get("tie_word_embeddings", hf.get("tie_word_embeddings", False))}
    return hf


def qwen3_5_moe_config(hf: dict) -> ModelConfig:
    """Qwen3.5 MoE (Qwen3.5-35B-A3B, -122B-A10B, -397B-A17B; transformers' Qwen3_5Moe, text part): Gated DeltaNet
    linear attention on the layers layer_types marks linear_attention (three of every four), gated grouped-query
    attention on the others (wq also emits a sigmoid output gate per head, q/k RMSNorm per head, RoPE on
    partial_rotary_factor of each head, 0.25); zero-centered RMSNorms (scale 1 + w); every layer MoE: softmax
    top-k renormalised, plus a sigmoid-gated shared expert. The release's multimodal RoPE equals plain RoPE on
    text (its three position ids coincide)."""
    hf = text_config(hf)
    problems: list[str] = []
    fields = base_fields(hf, problems, default_theta=10000000.0, head_dim_default=256, partial_rotary=0.25)
    L = fields["num_layers"]
    every = _get(hf, "full_attention_interval", 4)
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                      for i in range(L)]
    bad = sorted({t for t in types if t not in ("linear_attention", "full_attention")})
    if len(types) != L or bad:
        problems.append(f"layer_types={types} (needs {L} entries of linear_attention / full_attention)")
        every = 4
    else:
        every = window_pattern(types)  # the full layers (i + 1) % n == 0; 0 = none
        if every is None:
            problems.append(f"full-attention layers {[i for i, t in enumerate(types) if t == 'full_attention']} of "
                            f"{L} (layer_types) (needs a per-layer linear / full attention list in ModelConfig "
                            f"besides full_attention_every)")
            every = 4
    all_attention_biases(hf, fields)
    fields.update(mtp_layers=mtp_layers_of(hf), qk_norm="head", attention_output_gate=True, norm_zero_centered=True,
                  full_attention_every=every,
                  linear_attention="gated_deltanet" if "linear_attention" in types else "none")
    if hf["model_type"] == "qwen3_5_text":  # dense Qwen3.5 (Qwen3.5-27B, ...): an MLP of intermediate_size
        fields.update(num_experts=0, ffn_hidden_size=_get(hf, "intermediate_size"), aux_loss_coeff=0.0)
    else:
        shared = _get(hf, "shared_expert_intermediate_size", 0)
        fields.update(num_experts=_get(hf, "num_experts"), top_k=_get(hf, "num_experts_per_tok"),
                      moe_ffn_hidden_size=_get(hf, "moe_intermediate_size"),
                      ffn_hidden_size=_get(hf, "moe_intermediate_size"), shared_ffn_hidden_size=shared,
                      shared_expert_gate=bool(shared), router_options={"normalize": True})
    if "linear_attention" in types:
        fields.update(linear_num_key_heads=_get(hf, "linear_num_key_heads"),
                      linear_num_value_heads=_get(hf, "linear_num_value_heads"),
                      linear_key_head_dim=_get(hf, "linear_key_head_dim"),
                      linear_value_head_dim=_get(hf, "linear_value_head_dim"),
                      linear_conv_kernel=_get(hf, "linear_conv_kernel_dim", 4))
    return _model_config(hf, fields, problems)


def qwen3_next_config(hf: dict) -> ModelConfig:
    """Qwen3-Next (Qwen3-Next-80B-A3B; transformers' Qwen3Next): Qwen3.5's architecture (qwen3_5_moe_config) with
    Qwen3-MoE's layer pattern (decoder_sparse_step, mlp_only_layers: dense MLPs of intermediate_size elsewhere) and
    norm_topk_prob; its linear layers store q, k, v and z fused per key-head group (in_proj_qkvz) and b, a likewise
    (in_proj_ba), which the reader splits (``qwen3_next_split``) and the export fuses back (``qwen3_next_fuse``)."""
    config = qwen3_5_moe_config({**hf, "model_type": "qwen3_next"})
    problems: list[str] = []
    first, every = qwen_layer_pattern(hf, config.num_experts, config.num_layers, problems)
    fields = dict(config.to_dict(), first_dense_layers=first, moe_every=every,
                  ffn_hidden_size=_get(hf, "intermediate_size", config.ffn_hidden_size),
                  router_options={"normalize": bool(_get(hf, "norm_topk_prob", True))})
    return _model_config(hf, fields, problems)


def _qwen3_next_sizes(hf: dict) -> tuple[int, int, int, int]:
    return (_get(hf, "linear_num_key_heads"), _get(hf, "linear_num_value_heads"), _get(hf, "linear_key_head_dim"),
            _get(hf, "linear_value_head_dim"))


def qwen3_next_split(hf: dict, reader) -> None:
    """Read each linear layer's fused in_proj_qkvz [Nk (2 dk + 2 r dv), H] (per key head h: q_h, k_h, then the r
    value heads' v and z) and in_proj_ba [Nk 2 r, H] (per key head: r b rows, r a rows) as the in_proj_qkv (all q,
    all k, all v), in_proj_z, in_proj_b and in_proj_a moekit's rules map (Qwen3.5's layout)."""
    Nk, Nv, dk, dv = _qwen3_next_sizes(hf)
    r = Nv // Nk if Nk and Nv % Nk == 0 else 0
    for key in [k for k in reader.infos if k.endswith(".linear_attn.in_proj_qkvz.weight")]:
        prefix = key[: -len("in_proj_qkvz.weight")]
        ba = prefix + "in_proj_ba.weight"
        H = reader.infos[key].shape[-1]
        want = {key: (Nk * (2 * dk + 2 * r * dv), H), ba: (Nk * 2 * r, H)}
        for k, shape in want.items():
            if not r or k not in reader.infos or tuple(reader.infos[k].shape) != shape:
                found = list(reader.infos[k].shape) if k in reader.infos else "missing"
                raise ValueError(f"checkpoint {reader.folder}: {k} is {found}, but config.json (linear_num_key_heads "
                                 f"{Nk}, linear_num_value_heads {Nv}, linear_key_head_dim {dk}, linear_value_head_dim "
                                 f"{dv}, hidden_size {H}) implies {list(shape)}; the config does not match the weights")

        group = 2 * dk + 2 * r * dv  # rows per key head in in_proj_qkvz
        heads = torch.arange(Nk)[:, None]

        def rows(offset: int, width: int, per: int) -> torch.Tensor:  # a part's rows, key head by key head
            return (heads * per + offset + torch.arange(width)).reshape(-1)

        reader.derive(prefix + "in_proj_qkv.weight", key, torch.cat([rows(0, dk, group), rows(dk, dk, group),
                                                                     rows(2 * dk, r * dv, group)]))
        reader.derive(prefix + "in_proj_z.weight", key, rows(2 * dk + r * dv, r * dv, group))
        reader.derive(prefix + "in_proj_b.weight", ba, rows(0, r, 2 * r))
        reader.derive(prefix + "in_proj_a.weight", ba, rows(r, r, 2 * r))


def qwen3_next_fuse(hf: dict, tensors: dict) -> dict:
    """``qwen3_next_split``'s inverse on an export's tensors: each linear layer's in_proj_qkv / z / b / a fused into
    in_proj_qkvz and in_proj_ba, as Qwen3-Next stores them."""
    Nk, Nv, dk, dv = _qwen3_next_sizes(hf)
    r = Nv // Nk
    out = dict(tensors)
    for key in [k for k in tensors if k.endswith(".linear_attn.in_proj_qkv.weight")]:
        prefix = key[: -len("in_proj_qkv.weight")]
        qkv, z = out.pop(key), out.pop(prefix + "in_proj_z.weight")
        b, a = out.pop(prefix + "in_proj_b.weight"), out.pop(prefix + "in_proj_a.weight")
        H = qkv.shape[-1]
        q, k, v = qkv.split([Nk * dk, Nk * dk, Nv * dv])
        out[prefix + "in_proj_qkvz.weight"] = torch.cat([q.view(Nk, dk, H), k.view(Nk, dk, H),
                                                        v.view(Nk, r * dv, H), z.view(Nk, r * dv, H)], 1).reshape(-1, H)
        out[prefix + "in_proj_ba.weight"] = torch.cat([b.view(Nk, r, H), a.view(Nk, r, H)], 1).reshape(-1, H)
    return out


def llama4_config(hf: dict) -> ModelConfig:
    """Llama 4 (Scout 17B-16E, Maverick 17B-128E; transformers' Llama4, text part): GQA whose RoPE (adjacent channel
    pairs) skips every no_rope_layer_interval-th layer (no_rope_layers); the RoPE layers attend within chunks of
    attention_chunk_size (layer_types chunked_attention) and RMS-normalise q / k per head without a weight
    (use_qk_norm), the NoPE layers attend to everything, their queries scaled by the temperature of
    attn_temperature_tuning (floor_scale, attn_scale). MoE layers every interleave_moe_layer_step (or moe_layers),
    the others dense MLPs of intermediate_size_mlp: top-1 (num_experts_per_tok) of sigmoid(router logits), the
    weight scaling the token before its expert, plus an ungated shared expert of intermediate_size."""
    hf = text_config(hf)
    problems: list[str] = []
    fields = base_fields(hf, problems, default_theta=500000.0)
    L, E = fields["num_layers"], _get(hf, ("num_local_experts", "num_experts"))
    k = _get(hf, "num_experts_per_tok", 1)
    step = _get(hf, "interleave_moe_layer_step", 1)
    moe_ids = hf.get("moe_layers")
    moe_ids = list(range(step - 1, L, step)) if moe_ids is None else list(moe_ids)
    pattern = layer_pattern([i in moe_ids for i in range(L)])
    if pattern is None:
        problems.append(f"MoE layers {moe_ids} of {L} (moe_layers) (needs {NEEDS['layer_pattern']})")
    first, every = pattern or (0, 1)
    interval = _get(hf, "no_rope_layer_interval", 4)
    rope = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(L)]
    nope = next((n for n in range(1, L + 2) if [int((i + 1) % n != 0) for i in range(L)] == list(rope)), None)
    if nope is None:
        problems.append(f"no_rope_layers={list(rope)} (needs a per-layer RoPE / NoPE list in ModelConfig besides "
                        f"nope_every)")
        nope = interval
    nope = 0 if nope > L else nope  # every layer has RoPE
    chunk = hf.get("attention_chunk_size") or 0
    types = hf.get("layer_types") or ["chunked_attention" if r and chunk else "full_attention" for r in rope]
    want = ["chunked_attention" if r and chunk else "full_attention" for r in rope]
    if list(types) != want:
        problems.append(f"layer_types={list(types)} (moekit chunks exactly the RoPE layers when attention_chunk_size "
                        f"is set: {want})")
    all_attention_biases(hf, fields)
    tuning = bool(_get(hf, "attn_temperature_tuning", True)) and nope > 0
    if k != 1:
        problems.append(f"num_experts_per_tok={k} (transformers' Llama4 scales each token's input by its weight, "
                        f"which moekit's router_weight_on_input does for top-1 only)")
    F = _get(hf, "intermediate_size")
    fields.update(rope_pairs="adjacent", nope_every=nope, attention_chunk=chunk,
                  qk_norm="unit" if _get(hf, "use_qk_norm", True) and nope != 1 else "none",
                  attn_temperature_floor=int(_get(hf, "floor_scale", 8192)) if tuning else 0,
                  attn_temperature_scale=float(_get(hf, "attn_scale", 0.1)), num_experts=E, top_k=1,
                  first_dense_layers=first, moe_every=every, moe_ffn_hidden_size=F, shared_ffn_hidden_size=F,
                  ffn_hidden_size=_get(hf, "intermediate_size_mlp", F), router_weight_on_input=True,
                  router_options={"score": "sigmoid", "normalize": False})
    return _model_config(hf, fields, problems)


def dense_config(hf: dict) -> ModelConfig:
    """Llama, Qwen2, Qwen3: a moekit model without experts (num_experts=0)."""
    problems: list[str] = []
    kind = hf["model_type"]
    fields = base_fields(hf, problems, head_dim_default=128 if kind == "qwen3" else 0,
                         window=None if kind == "llama" else qwen_window(hf))
    if kind == "qwen2":
        fields["attention_bias"] = True  # Qwen2Attention: q/k/v biases always, none on o_proj
    else:
        all_attention_biases(hf, fields)
    if kind == "qwen3":
        fields["qk_norm"] = "head"
    if hf.get("mlp_bias"):
        problems.append(f"mlp_bias=true (needs {NEEDS['mlp_bias']})")
    F = _get(hf, "intermediate_size")
    fields.update(num_experts=0, ffn_hidden_size=F, moe_ffn_hidden_size=F, aux_loss_coeff=0.0)
    return _model_config(hf, fields, problems)


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # the transformers class config.json's "architectures" names
    to_config: Callable[[dict], ModelConfig]
    naming: Naming
    moe: bool = True
    layers_field: str = "num_hidden_layers"
    # the prefix the language model's weights are stored under instead of ``renamed`` (a multimodal release)
    stored_prefix: str | None = None
    renamed: str = "model."  # Qwen3.5's model.language_model.* are model.*; Llama 4's language_model.* are *
    # split(hf, reader): read fused tensors as the ones moekit's rules map (CheckpointReader.derive); fuse(hf,
    # tensors): the export's inverse (Qwen3-Next's in_proj_qkvz / in_proj_ba)
    split: Callable[[dict, Any], None] | None = None
    fuse: Callable[[dict, dict], dict] | None = None

    def reader_rename(self) -> tuple[str, str] | None:
        """CheckpointReader's ``rename`` for this family's files."""
        return None if self.stored_prefix is None else (self.stored_prefix, self.renamed)


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("mixtral", "MixtralForCausalLM", mixtral_config, MIXTRAL),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", qwen_moe_config, QWEN2_MOE),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", qwen_moe_config, QWEN3_MOE),
    Family("olmoe", "OlmoeForCausalLM", olmoe_config, OLMOE),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", deepseek_v3_config, DEEPSEEK_V3),
    Family("deepseek_v2", "DeepseekV2ForCausalLM", deepseek_v2_config, DEEPSEEK_V3),  # V3's names, no bias
    Family("glm4_moe", "Glm4MoeForCausalLM", glm4_moe_config, DEEPSEEK_V3),  # DeepSeek-V3's MoE names
    Family("glm4_moe_lite", "Glm4MoeLiteForCausalLM", glm4_moe_lite_config, DEEPSEEK_V3),
    Family("gpt_oss", "GptOssForCausalLM", gpt_oss_config, GPT_OSS),
    Family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", qwen3_5_moe_config, QWEN3_5_MOE),
    Family("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", qwen3_5_moe_config, QWEN3_5_MOE,
           stored_prefix=QWEN3_5_NESTED[0]),
    Family("qwen3_next", "Qwen3NextForCausalLM", qwen3_next_config, QWEN3_5_MOE, split=qwen3_next_split,
           fuse=qwen3_next_fuse),
    Family("qwen3_5_text", "Qwen3_5ForCausalLM", qwen3_5_moe_config, QWEN3_5_DENSE, moe=False),
    Family("qwen3_5", "Qwen3_5ForConditionalGeneration", qwen3_5_moe_config, QWEN3_5_DENSE, moe=False,
           stored_prefix=QWEN3_5_NESTED[0]),
    Family("minimax_m2", "MiniMaxM2ForCausalLM", minimax_m2_config, MINIMAX_M2),
    Family("dots1", "Dots1ForCausalLM", dots1_config, DEEPSEEK_V3),  # DeepSeek-V3's MoE names
    Family("ernie4_5_moe", "Ernie4_5_MoeForCausalLM", ernie4_5_moe_config, ERNIE4_5_MOE),
    Family("llama4_text", "Llama4ForCausalLM", llama4_config, LLAMA4),
    Family("llama4", "Llama4ForConditionalGeneration", llama4_config, LLAMA4, stored_prefix="language_model.",
           renamed=""),
    Family("llama", "LlamaForCausalLM", dense_config, DENSE, moe=False),
    Family("qwen2", "Qwen2ForCausalLM", dense_config, DENSE, moe=False),
    Family("qwen3", "Qwen3ForCausalLM", dense_config, DENSE, moe=False),
)}


def family(hf: dict, path) -> Family:
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        aliases = ", ".join(f"{a} (as {f})" for a, f in sorted(MODEL_TYPE_ALIASES.items()))
        raise ValueError(f"{path}/config.json: model_type={model_type!r} is not supported; moekit imports "
                         f"{sorted(FAMILIES)}, and {aliases}")
    return FAMILIES[model_type]


def recorded_family(config: ModelConfig) -> str | None:
    """The model_type an imported config came from (its name ``hf:<model_type>``), else None."""
    name = config.name
    if isinstance(name, str) and name.startswith(HF_NAME_PREFIX) and name[len(HF_NAME_PREFIX):] in FAMILIES:
        return name[len(HF_NAME_PREFIX):]
    return None


# their releases carry multi-token-prediction layers (Qwen's: one, under mtp., weights.Naming.mtp)
QWEN_MTP = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "qwen3_5", "qwen3_5_text")
MTP_FAMILIES = ("deepseek_v3", "glm4_moe", "glm4_moe_lite", *QWEN_MTP)
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # an MTP layer's copies of the shared tensors


def mtp_layers_of(hf: dict) -> int:
    """num_nextn_predict_layers of a family that stores multi-token-prediction layers, else 0. Qwen's
    (mtp_num_hidden_layers): at most 1, the layer its releases hold (vLLM shares one fc and its norms among more
    layers, which moekit's depths do not)."""
    kind = hf.get("model_type")
    if kind in QWEN_MTP:
        text = text_config(hf)
        return min(1, _get(text, ("mtp_num_hidden_layers", "num_nextn_predict_layers"), 0))
    return _get(hf, ("num_nextn_predict_layers", "num_mtp_layers"), 0) if kind in MTP_FAMILIES else 0


def mtp_layers_present(hf: dict, keys, num_layers: int) -> int:
    """How many of num_nextn_predict_layers the checkpoint holds (the leading ones with an ``eh_proj``):
    transformers saves the field (DeepseekV3Config's default is 1) without writing the layers it does not run."""
    n, stored = 0, mtp_layers_of(hf)
    if hf.get("model_type") in QWEN_MTP:
        return int(stored > 0 and "mtp.fc.weight" in keys)
    while n < stored and f"model.layers.{num_layers + n}.eh_proj.weight" in keys:
        n += 1
    return n


def skipped_keys(hf: dict, keys, num_layers: int, path, mtp_layers: int | None = None) -> set[str]:
    """Checkpoint keys an import leaves out on purpose. DeepSeek-V3's and GLM-4.5's multi-token-prediction layers
    (``model.layers.{num_hidden_layers + j}.*``, j < num_nextn_predict_layers) load into the model's MTP depths
    (models.mtp) but for their copies of the embedding and the head (``MTP_COPIES``: the depths share the main
    model's); the layers beyond the model's ``mtp_layers`` (default: all of them) are left out with a warning.
    Qwen3.5 / Qwen3-Next: the vision tower of a multimodal release, and the MTP layer (mtp.*) when the model has no
    depth for it, with a warning."""
    if hf.get("model_type") == "llama4":  # the multimodal release: its vision tower and projector
        vision = {k for k in keys if k.startswith(("vision_model.", "multi_modal_projector."))}
        if vision:
            warnings.warn(f"{path}: importing the language model only; skipping the vision tower (vision_model.*, "
                          f"multi_modal_projector.*: {len(vision)} tensors)", stacklevel=3)
        return vision
    if hf.get("model_type") in QWEN_MTP:  # the vision tower; the MTP layer when the model has no depth for it
        vision = {k for k in keys if k.startswith("model.visual.")}
        if vision:
            warnings.warn(f"{path}: importing the language model only; skipping the vision tower (model.visual.*, "
                          f"{len(vision)} tensors)", stacklevel=3)
        taken = mtp_layers_of(hf) if mtp_layers is None else min(mtp_layers, mtp_layers_of(hf))
        mtp = {k for k in keys if k.startswith("mtp.") and (not taken or k.startswith("mtp.layers.")
                                                                and not k.startswith("mtp.layers.0."))}
        if mtp:
            warnings.warn(f"{path}: skipping {len(mtp)} tensors of the multi-token-prediction layer(s) (mtp.*): the "
                          f"model reads {taken} (model.mtp_layers; the release holds one); the main model's logits "
                          f"are unaffected", stacklevel=3)
        return vision | mtp
    extra = mtp_layers_of(hf)
    if not extra:
        return set()
    taken = extra if mtp_layers is None else min(mtp_layers, extra)
    skipped, left = set(), set()
    for k in keys:
        m = re.match(r"model\.layers\.(\d+)\.(.*)", k)
        if m is None or not num_layers <= int(m.group(1)) < num_layers + extra:
            continue
        if int(m.group(1)) >= num_layers + taken:
            left.add(k)
        elif m.group(2) in MTP_COPIES:
            skipped.add(k)
    if left:
        found = sorted({int(re.match(r"model\.layers\.(\d+)\.", k).group(1)) for k in left})
        warnings.warn(f"{path}: skipping the multi-token-prediction layer(s) "
                      f"{', '.join(f'model.layers.{i}.*' for i in found)} (num_nextn_predict_layers={extra}, "
                      f"{len(left)} tensors): the model has model.mtp_layers={taken}; the main model's logits are "
                      f"unaffected", stacklevel=3)
    return skipped | left
