"""moekit model -> HuggingFace family: which families reproduce a model, their config.json, the tokenizer files.

``export_problems(model, family)`` lists every reason transformers' ``family`` would compute different
logits (empty: it reproduces the model). ``choose_family`` picks the family ``save_hf`` writes: the one
asked for, else the one the model was imported from (``model.hf_family`` or a config named
``hf:<model_type>``), else the first of ``NEAREST`` that reproduces it:

    MoE    mixtral      softmax top-k renormalised, no shared expert, every layer MoE, plain GQA
           qwen3_moe    softmax top-k, q/k RMSNorm per head (qk_norm="head")
           olmoe        softmax top-k, q/k RMSNorm over the projection (qk_norm="full"), qkv_clip
           qwen2_moe    softmax top-k, q/k/v biases, a sigmoid-gated shared expert (or none), any layer pattern
           deepseek_v3  MLA, sigmoid + expert_bias, group-limited (groups scored by their top 2), routed
                        scaling, an ungated shared expert (or none), dense first layers
           glm4_moe_lite  DeepSeek-V3's MLA and MoE, any dense / MoE layer pattern (mlp_layer_types)
           glm4_moe     DeepSeek-V3's MoE with GQA: q/k/v biases or not, qk_norm none or "head", RoPE on
                        partial_rotary_factor of each head (the only family with partial RoPE)
           (and deepseek_v2, dots1, minimax_m2, ernie4_5_moe, gpt_oss: the families table, docs/hf.md)
    dense  llama, qwen2 (q/k/v biases), qwen3 (qk_norm="head")

Where a family always has a part the model lacks, the export writes it so that it adds nothing
(``zero_fill``): DeepSeek-V3's / GLM-4-MoE's e_score_correction_bias as zeros (no selection bias), an all-zero
shared expert for Qwen2-MoE, DeepSeek-V3 or GLM-4-MoE (it outputs 0). The logits are unchanged; importing the
export back gives a model with those (zero) parts.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from moekit.models.config import ModelConfig
from moekit.models.hf.families import FAMILIES, recorded_family
from moekit.models.hf.fp8 import quantization_config
from moekit.moe.router import TopKRouter

NEAREST = {True: ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "deepseek_v3", "glm4_moe_lite", "deepseek_v2",
                  "glm4_moe", "dots1",
                  "minimax_m2", "ernie4_5_moe", "gpt_oss", "qwen3_5_moe_text", "qwen3_next", "llama4_text"),
           False: ("llama", "qwen2", "qwen3", "qwen3_5_text")}
PRETTY = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE", "olmoe": "OLMoE",
          "deepseek_v3": "DeepSeek-V3", "deepseek_v2": "DeepSeek-V2", "dots1": "dots.llm1", "glm4_moe": "GLM-4-MoE",
          "glm4_moe_lite": "GLM-4-MoE-Lite",
          "gpt_oss": "gpt-oss", "minimax_m2": "MiniMax-M2", "ernie4_5_moe": "ERNIE-4.5-MoE",
          "qwen3_5_moe_text": "Qwen3.5-MoE", "qwen3_5_moe": "Qwen3.5-MoE", "qwen3_next": "Qwen3-Next",
          "qwen3_5_text": "Qwen3.5", "qwen3_5": "Qwen3.5", "llama4_text": "Llama 4", "llama4": "Llama 4",
          "llama": "Llama", "qwen2": "Qwen2",
          "qwen3": "Qwen3"}
# (attention kind, its biases, the qk_norms it can compute, qkv_clip allowed) of each family's attention; biases:
# "none", "qkv" (q/k/v, never o: Qwen2's qkv_bias, GLM's attention_bias) or "all" (one attention_bias for q/k/v and o)
ATTENTION = {"mixtral": ("gqa", "none", ("none",), False), "qwen2_moe": ("gqa", "qkv", ("none",), False),
             "qwen3_moe": ("gqa", "all", ("head",), False), "olmoe": ("gqa", "all", ("full",), True),
             "deepseek_v3": ("mla", "none", ("none",), False), "deepseek_v2": ("mla", "none", ("none",), False),
             "glm4_moe_lite": ("mla", "none", ("none",), False),
             "dots1": ("gqa", "all", ("head",), False), "glm4_moe": ("gqa", "qkv", ("none", "head"), False),
             "gpt_oss": ("gqa", "all", ("none",), False), "minimax_m2": ("gqa", "none", ("full",), False),
             "ernie4_5_moe": ("gqa", "none", ("none",), False),
             "qwen3_5_moe_text": ("gqa", "all", ("head",), False), "qwen3_5_moe": ("gqa", "all", ("head",), False),
             "qwen3_next": ("gqa", "all", ("head",), False), "qwen3_5_text": ("gqa", "all", ("head",), False),
             "qwen3_5": ("gqa", "all", ("head",), False),
             "llama4_text": ("gqa", "all", ("unit", "none"), False), "llama4": ("gqa", "all", ("unit", "none"), False),
             "llama": ("gqa", "all", ("none",), False), "qwen2": ("gqa", "qkv", ("none",), False),
             "qwen3": ("gqa", "all", ("head",), False)}
# the families whose MoE is DeepSeek-V3's: sigmoid scores, selection bias, groups, scaling, ungated shared experts
DEEPSEEK_MOE = ("deepseek_v3", "glm4_moe", "dots1", "glm4_moe_lite")
SIGMOID_MOE = (*DEEPSEEK_MOE, "minimax_m2")  # sigmoid scores and (optionally) a selection bias
DEEPSEEK_SHARED = (*DEEPSEEK_MOE, "deepseek_v2")  # ungated shared experts (n_shared_experts), dense first layers
# gated attention, zero-centered norms, Gated DeltaNet layers
QWEN3_5 = ("qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next", "qwen3_5_text", "qwen3_5")
# the one a model imported from the multimodal release exports as (its language model: Qwen3_5MoeForCausalLM)
EXPORT_AS = {"qwen3_5_moe": "qwen3_5_moe_text", "qwen3_5": "qwen3_5_text", "llama4": "llama4_text"}
LLAMA4 = ("llama4_text", "llama4")  # NoPE layers, chunked attention, the query temperature, top-1 input weighting
PARTIAL_ROPE = ("glm4_moe", "minimax_m2", *QWEN3_5)  # the families that rotate a fraction of each head
# families whose config.json carries moekit's sliding windows (gpt-oss's are checked with its other features):
# Mixtral's covers every layer; dots.llm1 takes layer_types
WINDOWED = ("mixtral", "dots1")


# ---------------------------------------------------------------------------------------------------
# Which families reproduce a model
# ---------------------------------------------------------------------------------------------------


def export_problems(model, family: str) -> list[str]:
    """Every part of ``model`` whose math transformers' ``family`` cannot express ([] = it reproduces it)."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not a HuggingFace family moekit writes; choose one of "
                         f"{list(FAMILIES)}")
    cfg, name = model.config, PRETTY[family]
    problems: list[str] = []
    act = "swiglu_oai" if family == "gpt_oss" else "swiglu"
    if cfg.activation != act:
        problems.append(f"{name}'s FFNs are {'a clamped SwiGLU (swiglu_oai)' if family == 'gpt_oss' else 'SwiGLU'}; "
                        f"this model has activation={cfg.activation!r}")
    problems += _attention_problems(cfg, family, name)
    moe_layers = [i for i, layer in enumerate(model.layers) if layer.is_moe]
    if not FAMILIES[family].moe:
        if moe_layers:
            problems.append(f"{name} is a dense family; this model has {len(moe_layers)} MoE layers (export an MoE "
                            f"family: {', '.join(NEAREST[True])})")
        return problems
    if cfg.num_experts == 0:
        problems.append(f"{name} is an MoE family; this model has no experts (num_experts=0); export a dense "
                        f"family: {', '.join(NEAREST[False])}")
        return problems
    problems += _layer_problems(cfg, family, name)
    if cfg.router_weight_on_input != (family in LLAMA4):
        problems.append(f"{name}'s router weight scales the expert's {'input' if family in LLAMA4 else 'output'}; this "
                        f"model has router_weight_on_input={str(cfg.router_weight_on_input).lower()} (Llama 4 scales "
                        f"the input)")
    for i in moe_layers:  # every MoE layer is built alike: report the first that differs
        why = _router_problems(model.layers[i].ffn.router, family, name) + _shared_problems(model.layers[i].ffn,
                                                                                             cfg, family, name)
        if why:
            problems += [f"layers.{i}.ffn: {w}" for w in why]
            break
    return problems


def _attention_problems(cfg: ModelConfig, family: str, name: str) -> list[str]:
    kind, biases, qk_norms, clip_ok = ATTENTION[family]
    if cfg.attention != kind:
        what = "multi-head latent attention (MLA)" if kind == "mla" else "grouped-query attention"
        return [f"{name} has {what}; this model has attention={cfg.attention!r}"]
    problems = []
    if biases == "none" and (cfg.attention_bias or cfg.attention_out_bias):
        problems.append(f"{name} has no attention biases; this model has attention_bias={cfg.attention_bias}, "
                        f"attention_out_bias={cfg.attention_out_bias} (Qwen2 and Qwen2-MoE have q/k/v biases; Llama, "
                        f"Qwen3 and gpt-oss biases on q/k/v and o)")
    elif biases == "qkv" and cfg.attention_out_bias:
        problems.append(f"{name} has no o_proj bias; this model has attention_out_bias=true (Llama, Qwen3 and gpt-oss "
                        f"have one with their q/k/v biases)")
    elif biases == "all" and cfg.attention_bias != cfg.attention_out_bias:
        problems.append(f"{name}'s attention_bias puts biases on q/k/v and o alike; this model has attention_bias="
                        f"{cfg.attention_bias}, attention_out_bias={cfg.attention_out_bias} (Qwen2 has q/k/v only)")
    if family == "qwen2" and not cfg.attention_bias:
        problems.append("Qwen2 always has q/k/v biases; this model has attention_bias=false (Llama has none)")
    if cfg.qk_norm not in qk_norms:
        problems.append(f"{name} has qk_norm={' or '.join(map(repr, qk_norms))}; this model has qk_norm="
                        f"{cfg.qk_norm!r} (head: Qwen3, Qwen3-MoE, GLM-4-MoE; full: OLMoE)")
    if cfg.partial_rotary_factor != 1.0 and family not in PARTIAL_ROPE:
        problems.append(f"{name} rotates every channel of a head; this model has partial_rotary_factor="
                        f"{cfg.partial_rotary_factor} (GLM-4-MoE and MiniMax-M2 rotate part of it)")
    pairs = "adjacent" if family in ("ernie4_5_moe", *LLAMA4) else "half"
    if kind == "gqa" and cfg.rope_pairs != pairs:
        how = "adjacent channel pairs" if pairs == "adjacent" else "channel i with channel i + R/2"
        problems.append(f"{name}'s RoPE rotates {how}; this model has rope_pairs={cfg.rope_pairs!r} (ERNIE 4.5 pairs "
                        f"adjacent channels, the other families i with i + R/2)")
    if family == "deepseek_v2" and not cfg.rope_interleave:
        problems.append("DeepSeek-V2 rotates interleaved pairs of the rope dims; this model has rope_interleave=false "
                        "(DeepSeek-V3's rope_interleave flag takes either)")
    qwen3_5 = family in QWEN3_5
    if cfg.attention_output_gate != qwen3_5:
        problems.append(f"{name} {'gates' if qwen3_5 else 'does not gate'} each attention head's output; this model has "
                        f"attention_output_gate={str(cfg.attention_output_gate).lower()} (Qwen3.5 gates it)")
    if cfg.norm_zero_centered != qwen3_5:
        problems.append(f"{name}'s RMSNorms {'are' if qwen3_5 else 'are not'} zero-centered (scale 1 + w); this model "
                        f"has norm_zero_centered={str(cfg.norm_zero_centered).lower()} (Qwen3.5's are)")
    if cfg.linear_attention != "none" and not qwen3_5:
        problems.append(f"{name} has no linear-attention layers; this model has linear_attention="
                        f"{cfg.linear_attention!r} (Qwen3.5 has Gated DeltaNet layers)")
    if family not in LLAMA4:
        for field, what in (("nope_every", "layers without RoPE"), ("attention_chunk", "chunked attention"),
                            ("attn_temperature_floor", "a query temperature on NoPE layers")):
            if getattr(cfg, field):
                problems.append(f"{name} has no {what}; this model has {field}={getattr(cfg, field)} (Llama 4 has it)")
    if cfg.qkv_clip and not clip_ok:
        problems.append(f"{name} does not clip q/k/v; this model has qkv_clip={cfg.qkv_clip} (OLMoE does)")
    if family == "gpt_oss":
        if not cfg.attention_sinks:
            problems.append("gpt-oss's attention has a sink logit per head; this model has attention_sinks=false")
        return problems
    if family == "mixtral" and cfg.sliding_window and cfg.full_attention_every:
        problems.append(f"Mixtral's sliding window covers every layer; this model has full_attention_every="
                        f"{cfg.full_attention_every} (gpt-oss alternates)")
    for field, what in (("attention_sinks", "attention sinks"), ("sliding_window", "sliding window")):
        if getattr(cfg, field) and not (family in WINDOWED and field == "sliding_window"):
            problems.append(f"{name} has no {what}; this model has {field}={getattr(cfg, field)!r} (gpt-oss has it)")
    if family == "llama" and cfg.hidden_size % cfg.num_heads:
        problems.append(f"transformers' LlamaConfig needs hidden_size divisible by num_heads; this model has "
                        f"{cfg.hidden_size} and {cfg.num_heads} (Qwen2 / Qwen3 take any head_dim)")
    if family == "olmoe" and cfg.attn_head_dim * cfg.num_heads != cfg.hidden_size:
        problems.append(f"OLMoE's q norm spans hidden_size, so num_heads * head_dim must equal hidden_size; this "
                        f"model has {cfg.num_heads} * {cfg.attn_head_dim} != {cfg.hidden_size}")
    return problems


def _layer_problems(cfg: ModelConfig, family: str, name: str) -> list[str]:
    L, n = cfg.num_layers, cfg.num_moe_layers
    if family in ("mixtral", "olmoe", "gpt_oss", "minimax_m2", "qwen3_5_moe_text", "qwen3_5_moe") and n != L:
        return [f"{name} has an MoE FFN in every layer; this model has {n} of {L} (moe_every={cfg.moe_every}, "
                f"first_dense_layers={cfg.first_dense_layers})"]
    if family in DEEPSEEK_SHARED and family != "glm4_moe_lite" and cfg.moe_every != 1:  # lite: mlp_layer_types
        return [f"{name} has an MoE FFN in every layer from first_k_dense_replace on; this model has "
                f"moe_every={cfg.moe_every}"]
    if family in LLAMA4 and cfg.first_dense_layers:
        return [f"{name} puts MoE FFNs on every interleave_moe_layer_step-th layer from the first; this model has "
                f"first_dense_layers={cfg.first_dense_layers}"]
    if family == "ernie4_5_moe" and cfg.first_dense_layers % cfg.moe_every:
        return [f"{name} puts MoE FFNs on the layers i >= moe_layer_start_index with (i + 1) % moe_layer_interval "
                f"== 0; this model has first_dense_layers={cfg.first_dense_layers}, which is not a multiple of "
                f"moe_every={cfg.moe_every}"]
    return []


def _router_problems(r, family: str, name: str) -> list[str]:
    if not isinstance(r, TopKRouter):
        return [f"router {type(r).__name__} is not a top-k router; {name} routes by top-k over expert scores"]
    problems = []
    if getattr(r, "jitter", 0.0) > 0:
        problems.append(f"router multiplies its input by jitter={r.jitter} noise in training")
    if r.capacity_factor is not None:
        problems.append(f"router drops tokens (capacity_factor={r.capacity_factor}); transformers is dropless: "
                        f"rebuild the model with capacity_factor=None and load the state_dict into it")
    if r.force_expert is not None:
        problems.append(f"router forces expert {r.force_expert} (a debug option)")
    deepseek, sigmoid = family in DEEPSEEK_MOE, family in (*SIGMOID_MOE, *LLAMA4)
    if family in LLAMA4 and (r.top_k != 1 or r.normalize):
        problems.append(f"{name} routes each token to its one top expert, weighted by the sigmoid of its logit; this "
                        f"router has top_k={r.top_k}, normalize={r.normalize}")
    if r.score != ("sigmoid" if sigmoid else "softmax"):
        problems.append(f"router scores with {r.score}; {name} scores with {'sigmoid' if sigmoid else 'softmax'} "
                        f"(is not a {'sigmoid' if sigmoid else 'softmax'} top-k router)")
    if family in ("mixtral", "minimax_m2", "qwen3_5_moe_text", "qwen3_5_moe") and not r.normalize:
        problems.append("router does not renormalise the top-k weights (normalize=False); Mixtral always does "
                        "(Qwen2-MoE, Qwen3-MoE, OLMoE: norm_topk_prob=false)")
    if family == "deepseek_v2":
        if r.normalize:
            problems.append("router renormalises the top-k weights; DeepSeek-V2 never does (transformers' DeepseekV2 "
                            "ignores norm_topk_prob)")
        if r.num_groups is not None and r.group_score_top != 1:
            problems.append(f"router scores a group by its top {r.group_score_top} experts; DeepSeek-V2 by its best "
                            f"one (router option group_score_top=1)")
        if r.expert_bias is not None:
            problems.append("router has an expert_bias; DeepSeek-V2 has no selection bias (DeepSeek-V3 has)")
        return problems
    if deepseek:
        if r.num_groups is not None and r.group_score_top != 2:
            problems.append(f"router scores a group by its top {r.group_score_top} experts; {name} by its top "
                            f"2 (router option group_score_top=2)")
        return problems
    if r.scaling != 1.0 or r.num_groups is not None:
        problems.append(f"router uses scaling={r.scaling} / num_groups={r.num_groups} (DeepSeek-V3 and GLM-4-MoE "
                        f"have them)")
    if family == "ernie4_5_moe" and not r.normalize:
        problems.append("router does not renormalise the top-k weights (normalize=False); ERNIE 4.5 always does")
    if r.expert_bias is not None and (not sigmoid or family in LLAMA4) and family != "ernie4_5_moe":
        problems.append("router has an expert_bias (aux-loss-free balancing changes which experts are chosen; "
                        "DeepSeek-V3 and GLM-4-MoE have it)")
    if family == "gpt_oss" and not r.normalize:
        problems.append("router does not renormalise the top-k weights (normalize=False); gpt-oss takes the softmax "
                        "of the top-k logits, which is renormalised")
    if family != "gpt_oss" and getattr(r, "bias", None) is not None:
        problems.append(f"router's gate has a bias (gate_bias); {name}'s has none (gpt-oss's has)")
    return problems


def _shared_problems(ffn, cfg: ModelConfig, family: str, name: str) -> list[str]:
    """The shared expert, and the routed experts' biases (here, as the other per-layer expert check)."""
    if family != "gpt_oss" and getattr(ffn.experts, "b_in", None) is not None:
        return [f"{name}'s experts have no biases; this model has moe_ffn_bias=true (gpt-oss's have)"]
    shared = ffn.shared_expert
    if shared is None:
        return []
    gated = shared.gate is not None
    if family in ("qwen2_moe", *QWEN3_5) and not gated:
        return [f"{name}'s shared expert is sigmoid-gated; this model's has no gate (shared_expert_gate=false)"]
    if family in (*DEEPSEEK_SHARED, "ernie4_5_moe"):
        if gated:
            return [f"{name}'s shared experts have no gate; this model has shared_expert_gate=true"]
        if cfg.shared_ffn_hidden_size % cfg.moe_ffn_hidden_size:
            return [f"{name}'s shared experts are n_shared_experts * moe_intermediate_size wide; this model's "
                    f"shared_ffn_hidden_size={cfg.shared_ffn_hidden_size} is not a multiple of "
                    f"moe_ffn_hidden_size={cfg.moe_ffn_hidden_size}"]
    if family in LLAMA4 and (gated or cfg.shared_ffn_hidden_size != cfg.moe_ffn_hidden_size):
        return [f"{name}'s shared expert is ungated and as wide as a routed one (intermediate_size); this model's has "
                f"shared_ffn_hidden_size={cfg.shared_ffn_hidden_size} (experts: {cfg.moe_ffn_hidden_size}), "
                f"shared_expert_gate={str(gated).lower()}"]
    if family not in ("qwen2_moe", *DEEPSEEK_SHARED, "ernie4_5_moe", *QWEN3_5, *LLAMA4):
        return [f"{name} has no shared expert; this model has shared_ffn_hidden_size={cfg.shared_ffn_hidden_size}"]
    return []


def choose_family(model, family: str | None = None) -> str:
    """The family ``save_hf`` writes (module docstring); a ValueError with every reason when none fits."""
    if family is None:
        family = getattr(model, "hf_family", None) or recorded_family(model.config)
        came = family is not None
    else:
        came = False
    if family is not None:
        family = EXPORT_AS.get(family, family)
        problems = export_problems(model, family)
        if problems:
            how = (f"the model was imported from {family} but no longer matches it" if came
                   else f"{PRETTY[family]} cannot reproduce this model")
            raise ValueError(f"{how}: " + "; ".join(problems))
        return family
    moe = model.config.num_experts > 0 and model.config.num_moe_layers > 0
    reasons = {}
    for candidate in NEAREST[moe]:
        reasons[candidate] = export_problems(model, candidate)
        if not reasons[candidate]:
            return candidate
    raise ValueError("no HuggingFace family reproduces this model's logits:\n  - " + "\n  - ".join(
        f"{PRETTY[f]}: {'; '.join(why)}" for f, why in reasons.items()))


# ---------------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------------


def _router(model) -> TopKRouter:
    """The model's router (its first MoE layer's; one built from the config when every layer is dense)."""
    found = next((layer.ffn.router for layer in model.layers if layer.is_moe), None)
    if found is not None:
        return found
    from moekit.models.transformer import meta_device
    from moekit.moe import build_router

    cfg = model.config
    with meta_device():
        return build_router(cfg.router, cfg.hidden_size, cfg.num_experts, **cfg.router_kwargs())


def _rope(cfg: ModelConfig) -> dict[str, Any]:
    scaling = {k: v for k, v in cfg.rope_scaling.items()} if cfg.rope_scaling else {"rope_type": "default"}
    out = {"rope_parameters": {"rope_theta": cfg.rope_theta, **scaling}, "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:  # transformers 4 reads the scaling here (and "type")
        out["rope_scaling"] = {**scaling, "type": scaling["rope_type"]}
    return out


def hf_config(model, family: str, dtype_name: str, token_ids: dict[str, Any] | None = None,
              fp8_block: tuple[int, int] | None = None) -> dict[str, Any]:
    """config.json for ``family``: every field its transformers config reads (plus transformers 4's
    rope_theta / rope_scaling / torch_dtype), so ``from_pretrained`` rebuilds the same math; with ``fp8_block``
    the quantization_config of block-wise fp8 weights (models/hf/fp8.py)."""
    cfg: ModelConfig = model.config
    L, E, D = cfg.num_layers, cfg.num_experts, cfg.attn_head_dim
    out: dict[str, Any] = {
        "architectures": [FAMILIES[family].architecture], "model_type": family, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "num_hidden_layers": L, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": D, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "initializer_range": cfg.init_std, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_dropout": 0.0, "use_cache": True,
        **_rope(cfg), "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **(token_ids or {}),
        "dtype": dtype_name, "torch_dtype": dtype_name,
    }
    r = _router(model) if FAMILIES[family].moe else None
    moe = dict(num_experts_per_tok=cfg.top_k, router_aux_loss_coef=cfg.aux_loss_coeff, output_router_logits=False)
    no_window = dict(use_sliding_window=False, sliding_window=None, max_window_layers=L,
                     layer_types=["full_attention"] * L)
    if family == "mixtral":
        out.update(moe, intermediate_size=cfg.moe_ffn_hidden_size, num_local_experts=E,
                   sliding_window=cfg.sliding_window or None, router_jitter_noise=0.0)
    elif family in ("qwen2_moe", "qwen3_moe"):
        out.update({**moe, **no_window}, intermediate_size=cfg.ffn_hidden_size,
                   moe_intermediate_size=cfg.moe_ffn_hidden_size, num_experts=E, norm_topk_prob=r.normalize,
                   decoder_sparse_step=1, mlp_only_layers=[i for i in range(L) if not cfg.is_moe_layer(i)])
        if family == "qwen2_moe":
            out.update(qkv_bias=cfg.attention_bias,
                       shared_expert_intermediate_size=cfg.shared_ffn_hidden_size or cfg.moe_ffn_hidden_size)
        else:
            out.update(attention_bias=cfg.attention_bias)
    elif family == "olmoe":
        out.update(moe, intermediate_size=cfg.moe_ffn_hidden_size, num_experts=E, norm_topk_prob=r.normalize,
                   clip_qkv=cfg.qkv_clip or None, attention_bias=cfg.attention_bias)
    elif family == "deepseek_v3":
        out.update(_deepseek_moe(cfg, r), **_mla(cfg), moe_layer_freq=1, scoring_func="sigmoid", topk_method="noaux_tc",
                   rope_interleave=cfg.rope_interleave, num_nextn_predict_layers=cfg.mtp_layers)
    elif family == "glm4_moe_lite":
        out.update(_deepseek_moe(cfg, r), **_mla(cfg), rope_interleave=cfg.rope_interleave,
                   num_nextn_predict_layers=cfg.mtp_layers,
                   mlp_layer_types=["sparse" if cfg.is_moe_layer(i) else "dense" for i in range(L)])
    elif family == "deepseek_v2":
        out.update(_deepseek_moe(cfg, r), **_mla(cfg), norm_topk_prob=False, mlp_bias=False,
                   topk_method="group_limited_greedy" if r.num_groups is not None else "greedy",
                   aux_loss_alpha=cfg.aux_loss_coeff, seq_aux=getattr(r, "balance", "batch") == "sequence")
    elif family == "dots1":
        out.update(_deepseek_moe(cfg, r), **no_window, attention_bias=cfg.attention_bias)
        if cfg.sliding_window:
            out.update(sliding_window=cfg.sliding_window, layer_types=_layer_types(cfg))
    elif family == "glm4_moe":
        out.update(_deepseek_moe(cfg, r), attention_bias=cfg.attention_bias, use_qk_norm=cfg.qk_norm == "head",
                   num_nextn_predict_layers=cfg.mtp_layers, partial_rotary_factor=cfg.partial_rotary_factor)
        out["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor  # where transformers 5 reads it
    elif family == "minimax_m2":
        out.update(moe, intermediate_size=cfg.moe_ffn_hidden_size, num_local_experts=E, rotary_dim=cfg.rope_dim,
                   use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid", use_routing_bias=True,
                   router_jitter_noise=0.0, partial_rotary_factor=cfg.partial_rotary_factor)
        out["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor  # where transformers 5 reads it
    elif family == "ernie4_5_moe":
        out.update(intermediate_size=cfg.ffn_hidden_size, moe_intermediate_size=cfg.moe_ffn_hidden_size,
                   moe_num_experts=E, moe_k=cfg.top_k, router_aux_loss_coef=cfg.aux_loss_coeff,
                   output_router_logits=False,
                   moe_num_shared_experts=cfg.shared_ffn_hidden_size // cfg.moe_ffn_hidden_size,
                   moe_layer_start_index=cfg.first_dense_layers, moe_layer_end_index=L - 1,
                   moe_layer_interval=cfg.moe_every, moe_norm_min=1e-12, use_bias=False)
    elif family == "gpt_oss":
        from moekit.moe.activations import OAI_ALPHA, OAI_LIMIT

        out.update(moe, intermediate_size=cfg.moe_ffn_hidden_size, num_local_experts=E,
                   attention_bias=cfg.attention_bias, sliding_window=cfg.sliding_window or None,
                   layer_types=_layer_types(cfg), swiglu_alpha=OAI_ALPHA, swiglu_limit=OAI_LIMIT)
    elif family in QWEN3_5:
        if FAMILIES[family].moe:
            out.update(moe, moe_intermediate_size=cfg.moe_ffn_hidden_size, num_experts=E,
                       shared_expert_intermediate_size=cfg.shared_ffn_hidden_size or cfg.moe_ffn_hidden_size)
        else:  # dense Qwen3.5
            out.update(intermediate_size=cfg.ffn_hidden_size)
        out.update(attention_bias=cfg.attention_bias, partial_rotary_factor=cfg.partial_rotary_factor,
                   layer_types=["linear_attention" if cfg.is_linear_layer(i) else "full_attention" for i in range(L)],
                   linear_conv_kernel_dim=cfg.linear_conv_kernel,
                   linear_key_head_dim=cfg.linear_key_head_dim or 128, linear_value_head_dim=cfg.linear_value_head_dim or 128,
                   linear_num_key_heads=cfg.linear_num_key_heads or 16,
                   linear_num_value_heads=cfg.linear_num_value_heads or 32)
        out["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor  # where transformers 5 reads it
        out["mtp_num_hidden_layers"] = min(cfg.mtp_layers, 1)  # the mtp.* layer written (vLLM's MTP drafting)
        if family == "qwen3_next":  # Qwen3-MoE's layer pattern and renormalisation flag
            out.update(intermediate_size=cfg.ffn_hidden_size, norm_topk_prob=r.normalize, decoder_sparse_step=1,
                       mlp_only_layers=[i for i in range(L) if not cfg.is_moe_layer(i)])
    elif family in LLAMA4:
        rope = [int(cfg.uses_rope(i)) for i in range(L)]
        out.update(moe, num_experts_per_tok=1, num_local_experts=E, intermediate_size=cfg.moe_ffn_hidden_size,
                   intermediate_size_mlp=cfg.ffn_hidden_size, attention_bias=cfg.attention_bias,
                   moe_layers=[i for i in range(L) if cfg.is_moe_layer(i)], interleave_moe_layer_step=cfg.moe_every,
                   no_rope_layers=rope, no_rope_layer_interval=cfg.nope_every or L + 1,
                   use_qk_norm=cfg.qk_norm == "unit", attention_chunk_size=cfg.attention_chunk or None,
                   layer_types=["chunked_attention" if r_ and cfg.attention_chunk else "full_attention" for r_ in rope],
                   attn_temperature_tuning=bool(cfg.attn_temperature_floor),
                   floor_scale=cfg.attn_temperature_floor or 8192, attn_scale=cfg.attn_temperature_scale,
                   router_jitter_noise=0.0)
    elif family == "llama":
        out.update(intermediate_size=cfg.ffn_hidden_size, attention_bias=cfg.attention_bias, mlp_bias=False,
                   pretraining_tp=1)
    else:  # qwen2, qwen3
        out.update(no_window, intermediate_size=cfg.ffn_hidden_size)
        if family == "qwen3":
            out["attention_bias"] = cfg.attention_bias
    if fp8_block is not None:
        out["quantization_config"] = quantization_config(fp8_block)
    return out


def _deepseek_moe(cfg: ModelConfig, r: TopKRouter) -> dict[str, Any]:
    """config.json's MoE fields of the DeepSeek lineage (deepseek_v3 / v2, glm4_moe, dots1): routed and shared
    experts, groups, renormalisation, routed scaling, dense first layers (no router_aux_loss_coef: they read none)."""
    groups = (r.num_groups, r.group_top_k) if r.num_groups is not None else (1, 1)
    return dict(num_experts_per_tok=cfg.top_k, output_router_logits=False, intermediate_size=cfg.ffn_hidden_size,
                moe_intermediate_size=cfg.moe_ffn_hidden_size, n_routed_experts=cfg.num_experts,
                n_shared_experts=max(cfg.shared_ffn_hidden_size // cfg.moe_ffn_hidden_size, 1), n_group=groups[0],
                topk_group=groups[1], norm_topk_prob=r.normalize, routed_scaling_factor=r.scaling,
                first_k_dense_replace=cfg.first_dense_layers)


def _mla(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's multi-head latent attention fields (DeepSeek-V2 / V3)."""
    return dict(q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank,
                qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                v_head_dim=cfg.v_head_dim, head_dim=cfg.qk_rope_head_dim, attention_bias=False,
                num_key_value_heads=cfg.num_heads, pretraining_tp=1)


def _layer_types(cfg: ModelConfig) -> list[str]:
    """transformers' per-layer layer_types of the model's windows (config.attention_window)."""
    return ["sliding_attention" if cfg.attention_window(i) else "full_attention" for i in range(cfg.num_layers)]


# ---------------------------------------------------------------------------------------------------
# Parts a family always has and the model lacks: written so that they add nothing
# ---------------------------------------------------------------------------------------------------


def zero_fill(model, family: str, dtype: torch.dtype) -> dict[str, Tensor]:
    """HF key -> zero tensor for the parts of ``family`` the model lacks (module docstring)."""
    cfg, out = model.config, {}
    H, F = cfg.hidden_size, cfg.moe_ffn_hidden_size
    for i, layer in enumerate(model.layers):
        if not layer.is_moe or family not in ("qwen2_moe", *SIGMOID_MOE, "deepseek_v2", "gpt_oss", "ernie4_5_moe",
                                              *QWEN3_5, *LLAMA4):
            continue
        block = f"model.layers.{i}.mlp"
        if family in LLAMA4:  # its shared expert always exists
            if layer.ffn.shared_expert is None:
                for proj, shape in (("gate_proj", (F, H)), ("up_proj", (F, H)), ("down_proj", (H, F))):
                    out[f"model.layers.{i}.feed_forward.shared_expert.{proj}.weight"] = torch.zeros(shape, dtype=dtype)
            continue
        if family == "ernie4_5_moe":  # its selection bias always exists ([1, E]); no shared experts: a count of 0
            if layer.ffn.router.expert_bias is None:
                out[f"{block}.moe_statics.e_score_correction_bias"] = torch.zeros(1, cfg.num_experts, dtype=dtype)
            continue
        if family == "minimax_m2":  # its selection bias sits in the block (block_sparse_moe), not under the gate
            if layer.ffn.router.expert_bias is None:
                out[f"model.layers.{i}.block_sparse_moe.e_score_correction_bias"] = torch.zeros(cfg.num_experts,
                                                                                                dtype=dtype)
            continue
        if family == "gpt_oss":  # gpt-oss's gate and experts always have biases
            if getattr(layer.ffn.router, "bias", None) is None:
                out[f"{block}.router.bias"] = torch.zeros(cfg.num_experts, dtype=dtype)
            if getattr(layer.ffn.experts, "b_in", None) is None:
                out[f"{block}.experts.gate_up_proj_bias"] = torch.zeros(cfg.num_experts, 2 * F, dtype=dtype)
                out[f"{block}.experts.down_proj_bias"] = torch.zeros(cfg.num_experts, H, dtype=dtype)
            continue
        if family in DEEPSEEK_MOE and layer.ffn.router.expert_bias is None:
            out[f"{block}.gate.e_score_correction_bias"] = torch.zeros(cfg.num_experts, dtype=dtype)
        if layer.ffn.shared_expert is None:
            gated = family in ("qwen2_moe", *QWEN3_5)
            shared = "shared_expert" if gated else "shared_experts"
            for proj, shape in (("gate_proj", (F, H)), ("up_proj", (F, H)), ("down_proj", (H, F))):
                out[f"{block}.{shared}.{proj}.weight"] = torch.zeros(shape, dtype=dtype)
            if gated:
                out[f"{block}.shared_expert_gate.weight"] = torch.zeros(1, H, dtype=dtype)
    return out


# ---------------------------------------------------------------------------------------------------
# Tokenizer files
# ---------------------------------------------------------------------------------------------------

# What AutoTokenizer / generate read from a model folder, copied as they are.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "chat_template.jinja",
                   "chat_template.json", "generation_config.json", "tiktoken.model")
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")  # any makes one
RUN_TOKENIZER_INFO = "tokenizer_info.json"  # a moekit run directory's record (moekit.train.tokens.record_tokenizer)
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
BYTE_EOS = "<|endoftext|>"


def check_tokenizer_source(src: str | Path, what: str | None = None, flag: str = "tokenizer_from=") -> str:
    """Refuse a tokenizer source ``copy_tokenizer`` cannot use, before any work: a ValueError that starts with
    ``what`` (default ``tokenizer_from='SRC'``; a program passes its flag, ``--tokenizer SRC``) and names
    ``flag`` in the fix. Returns "run" (a moekit run directory) or "hf" (a folder of tokenizer files). The EOS
    id against the model's vocabulary needs the model: ``copy_tokenizer`` checks it."""
    src = Path(src)
    what = what or f"tokenizer_from={str(src)!r}"
    where = "pass a HuggingFace model folder or a moekit run directory"
    if not src.exists():
        raise ValueError(f"{what}: no such directory; {where}")
    if not src.is_dir():
        raise ValueError(f"{what} is not a directory; {where}")
    if (src / RUN_TOKENIZER_INFO).is_file():
        info = _read_json(src / RUN_TOKENIZER_INFO)
        kind = info.get("kind") if isinstance(info, dict) else None
        if kind == "hf" and not (src / "tokenizer.json").is_file():
            raise ValueError(f"{what}: {RUN_TOKENIZER_INFO} records an hf tokenizer but tokenizer.json is missing; "
                             f"restore it")
        if kind not in ("hf", "bytes"):
            raise ValueError(f"{what}: {src / RUN_TOKENIZER_INFO}: the run trained on token ids without tokenizer "
                             f"metadata (kind {kind!r}), so there is no tokenizer to export; pass {flag} the folder "
                             f"of the tokenizer the data were made with")
        return "run"
    found = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if not any(name in found for name in VOCABULARY_FILES):
        raise ValueError(f"{what}: no tokenizer files (looked for {', '.join(VOCABULARY_FILES)}); pass {flag} "
                         f"the folder the tokenizer lies in, or a moekit run directory (tokenizer_info.json)")
    return "hf"


def copy_tokenizer(src: str | Path, out: Path, model_vocab: int, max_len: int) -> dict[str, Any]:
    """Put ``src``'s tokenizer into ``out`` so ``AutoTokenizer.from_pretrained(out)`` works; returns the
    special token ids for config.json.

    ``src``: a HuggingFace folder (its tokenizer files are copied, its config.json's token ids kept) or a
    moekit run directory (tokenizer_info.json): an "hf" run's tokenizer.json gets a tokenizer_config.json
    naming its EOS; a "bytes" run gets a byte-level tokenizer.json with ids 0-255 = bytes and its EOS."""
    src = Path(src)
    if check_tokenizer_source(src) == "run":
        return _run_tokenizer(src, out, model_vocab, max_len)
    for name in (*TOKENIZER_FILES, *_tokenizer_code(src)):
        if (src / name).is_file() and (src / name).resolve() != (out / name).resolve():  # exporting into its source
            shutil.copyfile(src / name, out / name)
    config = _read_json(src / "config.json") if (src / "config.json").is_file() else {}
    return {k: config[k] for k in TOKEN_ID_FIELDS if k in config}


def _tokenizer_code(src: Path) -> list[str]:
    """The Python files a remote-code tokenizer needs (tokenizer_config.json's ``auto_map``, e.g. Kimi K2's
    ``tokenization_kimi.TikTokenTokenizer`` -> tokenization_kimi.py), so the copy loads as the source does with
    ``trust_remote_code=True``. Only plain module names of this folder; a reference into another repository
    ("org/repo--module.Class") names no file here."""
    path = src / "tokenizer_config.json"
    settings = _read_json(path) if path.is_file() else {}
    auto_map = settings.get("auto_map") if isinstance(settings, dict) else None
    refs: list = []
    for value in auto_map.values() if isinstance(auto_map, dict) else ():
        refs.extend(value if isinstance(value, list) else [value])
    names = {r.rsplit(".", 1)[0] + ".py" for r in refs if isinstance(r, str) and "." in r and "--" not in r}
    return sorted(n for n in names if "/" not in n and (src / n).is_file())


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable ({type(exc).__name__}: {exc}); restore it") from None


def _run_tokenizer(run: Path, out: Path, model_vocab: int, max_len: int) -> dict[str, Any]:
    """A run directory's tokenizer (its record already passed ``check_tokenizer_source``: kind "hf" or "bytes")."""
    info = _read_json(run / RUN_TOKENIZER_INFO)
    eos = info.get("eos_id")
    if eos is not None and (not isinstance(eos, int) or not 0 <= eos < model_vocab):
        raise ValueError(f"{run / RUN_TOKENIZER_INFO}: eos_id={eos!r} is not a token id of the model (vocab_size "
                         f"{model_vocab}); restore the record")
    if info["kind"] == "hf":
        from tokenizers import Tokenizer

        shutil.copyfile(run / "tokenizer.json", out / "tokenizer.json")
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    else:
        tok = byte_tokenizer(eos)
        tok.save(str(out / "tokenizer.json"))
    settings: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
                                "clean_up_tokenization_spaces": False}
    if info["kind"] == "hf" and (run / "tokenizer_config.json").is_file():
        # the set's tokenizer folder's own (moekit-prepare copied it; the trainer, into the run): its special tokens
        # and chat template, which a fine-tuned chat model needs; a class that needs other files becomes the fast one
        source = _read_json(run / "tokenizer_config.json")
        if isinstance(source, dict):
            settings = {**source, "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len}
            settings.pop("auto_map", None)  # remote tokenizer code is not in a run directory
        for name in ("special_tokens_map.json", "chat_template.jinja", "chat_template.json"):
            if (run / name).is_file():
                shutil.copyfile(run / name, out / name)
    if eos is not None:
        settings["eos_token"] = tok.id_to_token(eos)
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    return {"eos_token_id": eos}


def byte_symbols() -> dict[int, str]:
    """Byte -> the printable character byte-level BPE (GPT-2, ``tokenizers.pre_tokenizers.ByteLevel``) writes
    for it: printable Latin-1 bytes stand for themselves, the other 68 take 256, 257, ... in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


def byte_tokenizer(eos_id: int | None):
    """A ``tokenizers`` tokenizer whose ids 0-255 are the UTF-8 bytes (moekit's byte data), no merges, and
    ``BYTE_EOS`` at ``eos_id`` (ids between 256 and it become placeholders)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in byte_symbols().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    if eos_id is not None and eos_id >= 256:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(256, eos_id)] + [BYTE_EOS])
    return tok
