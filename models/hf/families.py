"""HuggingFace config.json <-> ModelConfig, one ``Family`` per ``model_type``.

A family says how its config.json maps onto ModelConfig (sizes, layer pattern, router options), how it
names tensors (``weights.Naming``), and which of its features moekit's model lacks. An import either
reproduces transformers' forward exactly or fails naming every missing feature and the model change
that would add it: moekit never drops a q/k norm or a bias and hopes for the best.

    transformers                          moekit router ("topk")
    Mixtral     softmax, top-k, renorm    score=softmax, normalize=True (also for k=1: HF renormalises)
    Qwen2/3-MoE softmax, norm_topk_prob   score=softmax, normalize=norm_topk_prob
    DeepSeek-V3 sigmoid + bias, groups    score=sigmoid, expert_bias, num_groups=n_group,
                (top-2 sum per group),    group_top_k=topk_group (needs top_k // topk_group == 2),
                norm_topk_prob, scaling   normalize=norm_topk_prob, scaling=routed_scaling_factor
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moekit.models.config import ModelConfig
from moekit.models.hf.weights import Naming
from moekit.moe.router import TopKRouter

MIXTRAL = Naming(moe_blocks=("block_sparse_moe", "mlp"), expert_proj=("w1", "w3", "w2"),
                 experts_field="num_local_experts")
QWEN2_MOE = Naming(moe_blocks=("mlp",), expert_proj=("gate_proj", "up_proj", "down_proj"), experts_field="num_experts",
                   shared="shared_expert", shared_gate="shared_expert_gate")
QWEN3_MOE = Naming(moe_blocks=("mlp",), expert_proj=("gate_proj", "up_proj", "down_proj"),
                   experts_field="num_local_experts")  # transformers 5 writes it under this name
DEEPSEEK_V3 = Naming(moe_blocks=("mlp",), expert_proj=("gate_proj", "up_proj", "down_proj"),
                     experts_field="n_routed_experts", shared="shared_experts", router_bias="e_score_correction_bias")

# Model changes that would lift each unsupported feature (also listed in docs/hf.md).
NEEDS = {
    "attention_bias": "ModelConfig.attention_bias: bool and nn.Linear(..., bias=True) for wq/wk/wv in "
                      "moekit.models.transformer.Attention",
    "qk_norm": "ModelConfig.qk_norm: bool and Attention.q_norm / k_norm = nn.RMSNorm(head_dim, eps=norm_eps) "
               "applied to q [B,S,N,D] and k [B,S,K,D] before RoPE",
    "shared_expert_gate": "ModelConfig.shared_expert_gate: bool passed by Block as "
                          "MoELayer(..., shared_expert_gate=config.shared_expert_gate)",
    "mla": "a multi-head latent attention module (q_a/q_b, kv_a_proj_with_mqa, kv_b projections, split "
           "nope/rope head dims, interleaved RoPE) selected by a ModelConfig.attention field",
    "rope_scaling": "RoPE scaling (rope_type, factor, ...) in ModelConfig and models.transformer.rope_angles",
    "layer_pattern": "an explicit per-layer MoE/dense list in ModelConfig (moe_layers) besides "
                     "first_dense_layers / moe_every",
}


class UnsupportedCheckpoint(ValueError):
    """A checkpoint whose math moekit's model cannot reproduce (the message names features and fixes)."""


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


def rope_theta(hf: dict, default: float, problems: list[str]) -> float:
    """RoPE base from transformers 5's rope_parameters or 4's top-level rope_theta / rope_scaling."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        problems.append(f"RoPE scaling rope_type={rope_type!r} (needs {NEEDS['rope_scaling']})")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        problems.append(f"partial rotary embedding partial_rotary_factor={partial} (needs {NEEDS['rope_scaling']})")
    return float(params.get("rope_theta", hf.get("rope_theta", default)))


def base_fields(hf: dict, rope_default: float, window: int | None, problems: list[str]) -> dict[str, Any]:
    """ModelConfig fields every family shares: sizes, attention, RoPE, norm, embeddings."""
    H, N = _get(hf, "hidden_size"), _get(hf, "num_attention_heads")
    head_dim = _get(hf, "head_dim", 0)
    if _get(hf, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (moekit's gated FFN is SwiGLU = silu(gate) * up)")
    max_pos = _get(hf, "max_position_embeddings", 4096)
    # Sliding-window attention equals full causal attention while the sequence fits in the window, so
    # the import is exact up to max_seq_len = window (longer inputs raise in Transformer.forward).
    return dict(
        vocab_size=_get(hf, "vocab_size"), hidden_size=H, num_layers=_get(hf, "num_hidden_layers"), num_heads=N,
        num_kv_heads=_get(hf, "num_key_value_heads", N), head_dim=0 if head_dim * N == H else head_dim,
        max_seq_len=min(max_pos, window) if window else max_pos, rope_theta=rope_theta(hf, rope_default, problems),
        norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)), tie_embeddings=bool(_get(hf, "tie_word_embeddings", False)),
        init_std=float(_get(hf, "initializer_range", 0.02)), activation="swiglu", router="topk",
        capacity_factor=None, aux_loss_coeff=float(_get(hf, "router_aux_loss_coef", 0.0)), z_loss_coeff=0.0,
    )


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
    problems: list[str] = []
    fields = base_fields(hf, 1e6, hf.get("sliding_window"), problems)
    F = _get(hf, "intermediate_size")
    # Every Mixtral layer is sparse; the dense FFN width is unused and kept equal to the expert width.
    fields.update(num_experts=_get(hf, ("num_local_experts", "num_experts")), top_k=_get(hf, "num_experts_per_tok"),
                  moe_ffn_hidden_size=F, ffn_hidden_size=F, router_options={"normalize": True})
    return _model_config(hf, fields, problems)


def qwen_moe_config(hf: dict) -> ModelConfig:
    """Qwen2-MoE and Qwen3-MoE: softmax top-k, optional renorm, sparse-step layer pattern."""
    problems: list[str] = []
    qwen2 = hf.get("model_type") == "qwen2_moe"
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    fields = base_fields(hf, 10000.0, window, problems)
    if hf.get("qkv_bias", qwen2) or hf.get("attention_bias", False):
        problems.append(f"attention biases (qkv_bias / attention_bias) (needs {NEEDS['attention_bias']})")
    if not qwen2:
        problems.append(f"q/k RMSNorm (self_attn.q_norm, k_norm) (needs {NEEDS['qk_norm']})")
    E, L = _get(hf, ("num_experts", "num_local_experts")), fields["num_layers"]
    step, dense = _get(hf, "decoder_sparse_step", 1), set(_get(hf, "mlp_only_layers", []))
    moe = [i not in dense and E > 0 and (i + 1) % step == 0 for i in range(L)]
    pattern = layer_pattern(moe)
    if pattern is None:
        problems.append(f"MoE layers {[i for i in range(L) if moe[i]]} of {L} (mlp_only_layers, decoder_sparse_step) "
                        f"(needs {NEEDS['layer_pattern']})")
    first, every = pattern or (0, 1)
    fields.update(num_experts=E, top_k=_get(hf, "num_experts_per_tok"), first_dense_layers=first, moe_every=every,
                  moe_ffn_hidden_size=_get(hf, "moe_intermediate_size"), ffn_hidden_size=_get(hf, "intermediate_size"),
                  router_options=qwen_router_options(hf))
    if qwen2:
        fields["shared_ffn_hidden_size"] = _get(hf, "shared_expert_intermediate_size")
        if "shared_expert_gate" in {f.name for f in dataclasses.fields(ModelConfig)}:
            fields["shared_expert_gate"] = True
        else:
            problems.append(f"sigmoid-gated shared expert (mlp.shared_expert_gate) "
                            f"(needs {NEEDS['shared_expert_gate']})")
    return _model_config(hf, fields, problems)


def qwen_router_options(hf: dict) -> dict[str, Any]:
    return {"normalize": bool(_get(hf, "norm_topk_prob", False))}


def deepseek_v3_config(hf: dict) -> ModelConfig:
    problems: list[str] = [f"multi-head latent attention (kv_lora_rank={hf.get('kv_lora_rank')}, "
                           f"q_lora_rank={hf.get('q_lora_rank')}) (needs {NEEDS['mla']})"]
    fields = base_fields(hf, 10000.0, None, problems)
    fields.update(num_experts=_get(hf, ("n_routed_experts", "num_local_experts")),
                  top_k=_get(hf, "num_experts_per_tok"), moe_ffn_hidden_size=_get(hf, "moe_intermediate_size"),
                  ffn_hidden_size=_get(hf, "intermediate_size"),
                  shared_ffn_hidden_size=_get(hf, "moe_intermediate_size") * _get(hf, "n_shared_experts", 1),
                  first_dense_layers=_get(hf, "first_k_dense_replace", 0),
                  router_options=deepseek_router_options(hf, problems))
    return _model_config(hf, fields, problems)


def deepseek_router_options(hf: dict, problems: list[str]) -> dict[str, Any]:
    """Sigmoid scores, selection bias, group-limited top-k, renorm, routed scaling (DeepseekV3TopkRouter)."""
    k, groups, topk_group = _get(hf, "num_experts_per_tok"), _get(hf, "n_group", 1), _get(hf, "topk_group", 1)
    options = {"score": "sigmoid", "normalize": bool(_get(hf, "norm_topk_prob", True)), "expert_bias": True,
               "scaling": float(_get(hf, "routed_scaling_factor", 1.0))}
    # transformers scores a group by the sum of its top-2 experts; moekit by its top top_k // group_top_k.
    if k == 2 * topk_group:
        options.update(num_groups=groups, group_top_k=topk_group)
    elif groups > 1:
        problems.append(f"group scores from each group's top 2 experts with num_experts_per_tok={k}, "
                        f"topk_group={topk_group} (moekit's group score sums the top top_k // group_top_k = "
                        f"{k // max(topk_group, 1)}; needs a group_score_top option in moe.router.TopKRouter)")
    return options


@dataclass(frozen=True)
class Family:
    to_config: Callable[[dict], ModelConfig]
    naming: Naming
    layers_field: str = "num_hidden_layers"


FAMILIES: dict[str, Family] = {
    "mixtral": Family(mixtral_config, MIXTRAL),
    "qwen2_moe": Family(qwen_moe_config, QWEN2_MOE),
    "qwen3_moe": Family(qwen_moe_config, QWEN3_MOE),
    "deepseek_v3": Family(deepseek_v3_config, DEEPSEEK_V3),
}


def family(hf: dict, path) -> Family:
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"{path}/config.json: model_type={model_type!r} is not supported; moekit imports "
                         f"{sorted(FAMILIES)}")
    return FAMILIES[model_type]


# ---------------------------------------------------------------------------------------------------
# Export: ModelConfig -> Mixtral config.json
# ---------------------------------------------------------------------------------------------------


def check_mixtral_exportable(model) -> None:
    """Raise naming the first part of ``model`` whose math transformers' Mixtral cannot express."""
    cfg = model.config
    if cfg.num_experts == 0 or cfg.num_moe_layers != cfg.num_layers:
        raise ValueError(f"Mixtral has an MoE FFN in every layer; this model has {cfg.num_moe_layers} of "
                         f"{cfg.num_layers} (moe_every={cfg.moe_every}, first_dense_layers={cfg.first_dense_layers})")
    if cfg.activation != "swiglu":
        raise ValueError(f"Mixtral experts are SwiGLU; this model has activation={cfg.activation!r}")
    if cfg.shared_ffn_hidden_size:
        raise ValueError(f"Mixtral has no shared expert; this model has "
                         f"shared_ffn_hidden_size={cfg.shared_ffn_hidden_size}")
    for i, layer in enumerate(model.layers):
        r = layer.ffn.router
        why = _mixtral_router_mismatch(r)
        if why:
            raise ValueError(f"layers.{i}.ffn.router ({type(r).__name__}) {why}; transformers' Mixtral routes by "
                             f"softmax top-k renormalised over the k, dropless. Export a model built with "
                             f"router='topk', router_options={{'normalize': True}}, capacity_factor=None")


def _mixtral_router_mismatch(r) -> str:
    if not isinstance(r, TopKRouter) or r.score != "softmax":
        return "is not a softmax top-k router"
    if getattr(r, "jitter", 0.0) > 0:
        return f"multiplies its input by jitter={r.jitter} noise in training"
    if r.capacity_factor is not None:
        return f"drops tokens (capacity_factor={r.capacity_factor})"
    if not r.normalize:
        return "does not renormalise the top-k weights (normalize=False)"
    if r.scaling != 1.0 or r.num_groups is not None:
        return f"uses scaling={r.scaling} / num_groups={r.num_groups}"
    if r.expert_bias is not None:
        return "has an expert_bias (aux-loss-free balancing changes which experts are chosen)"
    return ""


def mixtral_hf_config(cfg: ModelConfig, dtype_name: str) -> dict[str, Any]:
    """config.json for MixtralForCausalLM: every field transformers 5 reads, plus v4's rope_theta/torch_dtype."""
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.moe_ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.attn_head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "initializer_range": cfg.init_std, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "sliding_window": None, "attention_dropout": 0.0,
        "num_experts_per_tok": cfg.top_k, "num_local_experts": cfg.num_experts, "output_router_logits": False,
        "router_aux_loss_coef": cfg.aux_loss_coeff, "router_jitter_noise": 0.0,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"}, "rope_theta": cfg.rope_theta,
        "use_cache": True, "dtype": dtype_name, "torch_dtype": dtype_name,
    }
