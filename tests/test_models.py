"""models/: presets, meta build + seeded init, causality, attention against a naive oracle, stats."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moekit.models.config import PRESETS, ModelConfig, preset
from moekit.models.stats import mean_keys, model_stats
from moekit.models.transformer import Attention, Transformer, apply_rope, build_model, rope_angles
from moekit.moe import MoELayer
from moekit.moe.router import TopKRouter

TINY_PRESETS = ["mixtral-tiny", "switch-tiny", "deepseek-tiny", "gpt-oss-tiny"]
REAL_PRESETS = [n for n in PRESETS if n not in TINY_PRESETS]


def small(name: str, **overrides) -> ModelConfig:
    """A preset shrunk to test size, keeping its routing family and layer pattern."""
    cfg = preset(name)
    sizes = dict(hidden_size=32, num_heads=4, num_kv_heads=2 if cfg.num_kv_heads < cfg.num_heads else 4,
                 ffn_hidden_size=64, moe_ffn_hidden_size=32, max_seq_len=64)
    for k, v in {**sizes, **overrides}.items():
        setattr(cfg, k, v)
    if cfg.shared_ffn_hidden_size:
        cfg.shared_ffn_hidden_size = 32
    return cfg


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_tiny_presets_build_and_run(name):
    model = build_model(preset(name), seed=0)
    tokens = torch.randint(0, 256, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 256) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    logits.logsumexp(-1).mean().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "router" not in n or p.requires_grad)


def test_preset_families():
    mix, sw, ds, oss = (preset(n) for n in TINY_PRESETS)
    assert [oss.attention_window(i) for i in range(4)] == [64, 0, 64, 0] and oss.attention_sinks
    assert (oss.activation, oss.moe_ffn_bias, oss.router_options["gate_bias"]) == ("swiglu_oai", True, True)
    assert [mix.is_moe_layer(i) for i in range(4)] == [True] * 4
    assert [sw.is_moe_layer(i) for i in range(4)] == [False, True, False, True]  # every other layer
    assert [ds.is_moe_layer(i) for i in range(4)] == [False, True, True, True]  # first layer dense
    assert (mix.top_k, mix.capacity_factor, mix.activation, mix.num_kv_heads < mix.num_heads) == (2, None, "swiglu", True)
    assert (sw.router, sw.capacity_factor, sw.activation) == ("switch", 1.25, "relu")
    assert ds.router_options["score"] == "sigmoid" and ds.router_options["bias_update_rate"] > 0
    assert ds.shared_ffn_hidden_size > 0 and ds.num_experts > mix.num_experts


def test_preset_returns_a_copy_and_unknown_preset_lists_all():
    cfg = preset("mixtral-tiny")
    cfg.router_options["normalize"] = False
    assert PRESETS["mixtral-tiny"].router_options["normalize"] is True
    with pytest.raises(ValueError, match="mixtral-tiny, switch-tiny, deepseek-tiny"):
        preset("gpt-5")


@pytest.mark.parametrize("name", REAL_PRESETS)
def test_real_sizes_build_on_meta(name):
    with torch.device("meta"):
        model = Transformer(preset(name))
    assert all(p.is_meta for p in model.parameters())
    stats = model_stats(preset(name))
    assert 0 < stats.active_params < stats.params and stats.train_flops_per_token > 6 * stats.active_params * 0.5


def test_published_parameter_counts():
    # Mixtral 8x7B: 46.7B total, 12.9B active (Jiang et al. 2024); Qwen3-30B-A3B: 30.5B / 3.3B.
    mix = model_stats(preset("mixtral-8x7b"))
    assert mix.params / 1e9 == pytest.approx(46.7, abs=0.05) and mix.active_params / 1e9 == pytest.approx(12.9, abs=0.05)
    qwen = model_stats(preset("qwen3-moe-30b-a3b"))
    assert qwen.params / 1e9 == pytest.approx(30.5, abs=0.05) and qwen.active_params / 1e9 == pytest.approx(3.3, abs=0.06)
    # GLM-4.5-Air: "106B total, 12B active" (Z.ai), the active count without the embedding and output matrices
    glm = model_stats(preset("glm-4.5-air"))
    embeddings = 2 * 151552 * 4096
    assert 106.0 <= glm.params / 1e9 < 107.0
    assert (glm.active_params - embeddings) / 1e9 == pytest.approx(12.0, abs=0.25)
    # DeepSeek-V3: 671B total, 37B active (DeepSeek-AI 2024; without the 14B multi-token-prediction module);
    # Kimi K2: "1 trillion total parameters, 32 billion activated" (Moonshot AI 2025)
    ds, kimi = model_stats(preset("deepseek-v3")), model_stats(preset("kimi-k2"))
    assert ds.params / 1e9 == pytest.approx(671.0, abs=0.5) and ds.active_params / 1e9 == pytest.approx(37.0, abs=0.6)
    assert 1000 <= kimi.params / 1e9 < 1050 and kimi.active_params / 1e9 == pytest.approx(32.0, abs=0.9)
    # DeepSeek-V2-Lite: "15.7B total parameters, 2.4B activated" (DeepSeek-AI 2024), active without the embedding
    lite = model_stats(preset("deepseek-v2-lite"))
    assert lite.params / 1e9 == pytest.approx(15.7, abs=0.02)
    assert (lite.active_params - lite.embedding_params) / 1e9 == pytest.approx(2.4, abs=0.06)
    # MiniMax-M2: "230B total parameters with 10B active" (MiniMax 2025), active without the embedding and the head
    m2 = model_stats(preset("minimax-m2"))
    assert 228 < m2.params / 1e9 < 231
    assert (m2.active_params - 2 * m2.embedding_params) / 1e9 == pytest.approx(10, abs=0.25)
    # ERNIE-4.5-21B-A3B: "21B total parameters, 3B activated" (Baidu 2025), active without the (tied) embedding
    ernie = model_stats(preset("ernie-4.5-21b-a3b"))
    assert 21 < ernie.params / 1e9 < 22 and ernie.embedding_params == 103424 * 2560
    assert (ernie.active_params - ernie.embedding_params) / 1e9 == pytest.approx(3.0, abs=0.1)
    # gpt-oss (OpenAI 2025 model card): 20.91B total, 3.61B active; 116.83B, 5.13B (active without the embedding)
    for name, total, active in (("gpt-oss-20b", 20.91, 3.61), ("gpt-oss-120b", 116.83, 5.13)):
        s = model_stats(preset(name))
        assert s.params / 1e9 == pytest.approx(total, abs=0.01), name
        assert (s.active_params - s.embedding_params) / 1e9 == pytest.approx(active, abs=0.01), name


# config.json of the releases (the fields that shape the model), as published on the Hub
DEEPSEEK_V3_RELEASE = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280}
KIMI_K2_RELEASE = {
    **DEEPSEEK_V3_RELEASE, "model_type": "kimi_k2", "first_k_dense_replace": 1, "max_position_embeddings": 131072,
    "n_group": 1, "n_routed_experts": 384, "num_attention_heads": 64, "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0, "topk_group": 1, "routed_scaling_factor": 2.827, "rope_theta": 50000.0,
    "vocab_size": 163840, "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                                           "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                           "type": "yarn"},
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}}


GPT_OSS_20B_RELEASE = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088}
DEEPSEEK_V2_LITE_RELEASE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "attention_bias": False,
    "aux_loss_alpha": 0.001, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 1408,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "v_head_dim": 128, "vocab_size": 102400}
MINIMAX_M2_RELEASE = {
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 3072, "intermediate_size": 1536, "max_position_embeddings": 196608, "mtp_transformer_layers": 1,
    "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8,
    "num_local_experts": 256, "num_mtp_modules": 3, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-06,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rope_theta": 5000000, "rotary_dim": 64, "scoring_func": "sigmoid", "shared_intermediate_size": 0,
    "tie_word_embeddings": False, "use_mtp": True, "use_qk_norm": True, "use_routing_bias": True,
    "vocab_size": 200064}
ERNIE_21B_RELEASE = {  # ERNIE-4.5-21B-A3B-PT's sizes (the model card's), as transformers' Ernie4_5_Moe reads them
    "architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe", "hidden_act": "silu",
    "hidden_size": 2560, "intermediate_size": 12288, "max_position_embeddings": 131072, "moe_intermediate_size": 1536,
    "moe_k": 6, "moe_layer_interval": 1, "moe_layer_start_index": 1, "moe_layer_end_index": 27, "moe_num_experts": 64,
    "moe_num_shared_experts": 2, "num_attention_heads": 20, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": True, "use_bias": False,
    "vocab_size": 103424}
GPT_OSS_120B_RELEASE = {**GPT_OSS_20B_RELEASE, "num_hidden_layers": 36, "num_local_experts": 128,
                        "layer_types": ["sliding_attention", "full_attention"] * 18}


@pytest.mark.parametrize("name,release", [("deepseek-v3", DEEPSEEK_V3_RELEASE), ("kimi-k2", KIMI_K2_RELEASE),
                                          ("gpt-oss-20b", GPT_OSS_20B_RELEASE), ("gpt-oss-120b", GPT_OSS_120B_RELEASE),
                                          ("minimax-m2", MINIMAX_M2_RELEASE), ("ernie-4.5-21b-a3b", ERNIE_21B_RELEASE),
                                          ("deepseek-v2-lite", DEEPSEEK_V2_LITE_RELEASE)])
def test_real_presets_are_what_the_release_config_imports_as(tmp_path, name, release):
    """The deepseek-v3 and kimi-k2 presets are the models their checkpoints load into (the forward's fields,
    routing included; the bias update rate is a training setting), so a dry run of the preset plans the run
    that --init-from-hf will make. Kimi K2's model_type imports as deepseek_v3."""
    import json

    from moekit.models.hf import MATH_FIELDS, config_from_hf

    (tmp_path / "config.json").write_text(json.dumps(release))
    imported, mine = config_from_hf(tmp_path), preset(name)
    for field in (*MATH_FIELDS, "first_dense_layers", "max_seq_len"):
        assert getattr(imported, field) == getattr(mine, field), field
    assert imported.router_options == {k: v for k, v in mine.router_options.items() if k != "bias_update_rate"}
    assert imported.name == "hf:" + json.loads(json.dumps(release))["model_type"].replace("kimi_k2", "deepseek_v3")


def test_flops_per_token_formula():
    cfg = small("mixtral-tiny", num_layers=2, tie_embeddings=True)
    s = model_stats(cfg, seq_len=64)
    # tied: the embedding is also the output matmul, so every active parameter is a matmul weight
    # except the RMSNorm scales (2 per layer + final)
    norms = cfg.hidden_size * (2 * cfg.num_layers + 1)
    attn = 2 * cfg.num_layers * 64 * cfg.num_heads * cfg.attn_head_dim
    assert s.train_flops_per_token == 3 * (2 * (s.active_params - norms) + attn)
    untied = model_stats(small("mixtral-tiny", num_layers=2), seq_len=64)
    # untied: the output projection is a matmul, the input embedding a lookup (same size)
    assert untied.params == s.params + s.embedding_params
    assert untied.train_flops_per_token == s.train_flops_per_token


FLOP_CASES = {
    "mixtral-gqa": ("mixtral-tiny", {}),
    "switch-tied-dropless": ("switch-tiny", {"capacity_factor": None}),
    "deepseek-shared-dense-first": ("deepseek-tiny", {}),
    "deepseek-mla": ("deepseek-tiny", dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                           v_head_dim=6, q_lora_rank=12)),
    "qwen2-gated-shared": ("mixtral-tiny", {"shared_ffn_hidden_size": 24, "shared_expert_gate": True}),
    # two multi-token-prediction depths (models.mtp): MoE blocks on S - 1 and S - 2 positions, the head reused
    "deepseek-mtp2": ("deepseek-tiny", {"mtp_layers": 2}),
    "switch-tied-mtp1": ("switch-tiny", {"capacity_factor": None, "mtp_layers": 1}),
    # gpt-oss: a 12-position window on layer 0 (layer 1 full), sinks, biases everywhere (not matmuls)
    "gpt-oss-window": ("gpt-oss-tiny", {"sliding_window": 12}),
    # Llama 4: a dense layer, an MoE layer weighting its experts' input, a shared expert, NoPE (no chunks under 48)
    "llama4": ("llama4-tiny", {}),
}


@pytest.mark.parametrize("S,chunk", [(48, 16), (40, 16), (7, 3), (16, 16), (10, 64)])
def test_mean_keys_of_chunked_attention(S, chunk):
    """Chunked attention's keys per query under the formula's convention (a causal sequence of S: S / 2, the mean
    of i + 1 over its queries less 1/2): the same mean with i counted from its chunk's start."""
    assert mean_keys(S, 0, chunk) == pytest.approx(sum(i % chunk + 1 for i in range(S)) / S - 0.5)


@pytest.mark.parametrize("case", FLOP_CASES)
def test_flops_per_token_equal_torchs_flop_counter(monkeypatch, case):
    """The MFU numerator (model_stats, counted on the meta device) against torch's FlopCounterMode over a real
    forward + backward of the same model: every matmul torch runs, counted from its shapes. The per-expert loop
    backend and the explicit bmm attention make every product an aten (b)mm the counter knows; the chunked
    loss's weight-gradient addmm_ gets addmm's formula. The bmm attention computes the whole S x S score
    matrix, where the formula counts the causal half, so the counter sees one more attention term (x3)."""
    from torch.utils.flop_counter import FlopCounterMode

    from moekit.models import attention

    name, overrides = FLOP_CASES[case]
    cfg = small(name, num_layers=2, expert_backend="loop", **overrides)
    monkeypatch.setattr(attention, "EXPLICIT_ATTENTION", "always")
    model = build_model(cfg, seed=3)
    B, S = 2, 48
    tokens = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(4))
    def addmm_(acc_shape, a_shape, b_shape, *args, **kwargs):  # acc += a @ b: 2 m k n
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]

    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: addmm_}) as counter:
        model(tokens, targets=tokens.roll(-1, 1)).backward()
    counted = counter.get_total_flops() / (B * S)
    stats = model_stats(cfg, seq_len=S)
    # the whole score matrix of every block: 2 S keys where the formula counts 2 mean_keys (S for a causal layer),
    # S - k for MTP depth k on (S - k) / S
    keys = sum(2 * S - 2 * mean_keys(S, cfg.attention_window(i)) for i in range(cfg.num_layers))
    keys += sum((S - k) ** 2 / S for k in range(1, cfg.mtp_layers + 1))
    attention_term = keys * cfg.num_heads * (cfg.attn_qk_head_dim + cfg.attn_v_head_dim)
    assert counted == pytest.approx(stats.train_flops_per_token + 3 * attention_term, rel=1e-12), \
        (counted, stats.train_flops_per_token)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)  # nothing left out of backward


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_meta_build_and_init_are_deterministic(name):
    cfg = small(name)
    a, b = build_model(cfg, seed=7), build_model(cfg, seed=7)
    direct = Transformer(cfg)  # built on CPU with module defaults, then the same init
    direct.init_weights(7)
    other = build_model(cfg, seed=8)
    sa = a.state_dict()
    for key, value in sa.items():
        assert torch.equal(value, b.state_dict()[key]), key
        assert torch.equal(value, direct.state_dict()[key]), key
    differs = [k for k, v in sa.items() if v.dtype.is_floating_point and v.std() > 0 and not torch.equal(v, other.state_dict()[k])]
    assert len(differs) == sum(1 for v in sa.values() if v.dtype.is_floating_point and v.std() > 0)


def test_init_scales_residual_projections():
    cfg = preset("mixtral-tiny")
    model = build_model(cfg, seed=0)
    wo = model.layers[0].attn.wo.weight
    assert wo.std().item() == pytest.approx(cfg.init_std / math.sqrt(2 * cfg.num_layers), rel=0.05)
    assert model.embed.weight.std().item() == pytest.approx(cfg.init_std, rel=0.05)


@pytest.mark.parametrize("name", TINY_PRESETS + ["hash"])
def test_causal(name):
    """Changing tokens at positions >= t leaves the logits before t unchanged (dropless routing:
    capacity dropping lets later tokens take an expert's capacity, which is not causal)."""
    cfg = small("mixtral-tiny", router="hash", router_options={}) if name == "hash" else small(name)
    cfg.capacity_factor = None
    model = build_model(cfg, seed=1).eval()
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    t = 11
    changed[:, t:] = torch.randint(0, 256, (2, 24 - t), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    # not bitwise: expert row blocks change size with the routing of later tokens, and matmul
    # blocking with them; a leak of future information would be orders of magnitude larger
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-5)
    assert (a[:, t:] - b[:, t:]).abs().max() > 1e-2  # the test can fail: later logits do change


def naive_attention(attn: Attention, x: torch.Tensor, cos, sin) -> torch.Tensor:
    """Per-head loop with an explicit causal mask and repeated kv heads: the oracle for SDPA + GQA."""
    B, S, _ = x.shape
    N, K, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = apply_rope(attn.wq(x).view(B, S, N, D).transpose(1, 2), cos, sin)
    k = apply_rope(attn.wk(x).view(B, S, K, D).transpose(1, 2), cos, sin)
    v = attn.wv(x).view(B, S, K, D).transpose(1, 2)
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    heads = []
    for h in range(N):
        kv = h // (N // K)  # query head h reads kv head h // group
        scores = q[:, h] @ k[:, kv].transpose(-1, -2) / math.sqrt(D)
        heads.append(scores.masked_fill(~mask, -math.inf).softmax(-1) @ v[:, kv])
    return attn.wo(torch.stack(heads, 1).transpose(1, 2).reshape(B, S, N * D))


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_attention_matches_naive_gqa(kv_heads):
    cfg = small("mixtral-tiny", num_kv_heads=kv_heads)
    torch.manual_seed(0)
    attn = Attention(cfg)
    x = torch.randn(2, 10, cfg.hidden_size)
    cos, sin = rope_angles(10, cfg.attn_head_dim, cfg.rope_theta, "cpu")
    torch.testing.assert_close(attn(x, cos, sin), naive_attention(attn, x, cos, sin), rtol=1e-5, atol=1e-6)


def test_rope_scores_depend_on_relative_position_only():
    D = 16
    q, k = torch.randn(1, 1, 1, D), torch.randn(1, 1, 1, D)
    cos, sin = rope_angles(40, D, 10000.0, "cpu")

    def score(i, j):
        return (apply_rope(q, cos[i : i + 1], sin[i : i + 1]) * apply_rope(k, cos[j : j + 1], sin[j : j + 1])).sum()

    torch.testing.assert_close(score(5, 2), score(35, 32), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(score(5, 2), score(5, 4))


def test_tied_and_untied_embeddings():
    tied = build_model(small("switch-tiny"), seed=0)
    untied = build_model(small("mixtral-tiny"), seed=0)
    assert tied.lm_head is None and untied.lm_head is not None
    names = {n for n, _ in tied.named_parameters()}
    assert "embed.weight" in names and not any(n.startswith("lm_head") for n in names)
    tokens = torch.randint(0, 256, (1, 8))
    h = tied.norm(tied.embed(tokens))  # with no layers the logits would be h @ E^T; check the weight is shared
    assert tied(tokens).shape == (1, 8, 256) and h.shape == (1, 8, 32)
    tied(tokens).sum().backward()
    assert tied.embed.weight.grad is not None


def test_moe_layers_get_router_options_and_token_ids():
    cfg = small("deepseek-tiny")
    model = build_model(cfg, seed=0)
    moe = [layer.ffn for layer in model.layers if layer.is_moe]
    assert len(moe) == cfg.num_moe_layers == 3 and all(isinstance(m, MoELayer) for m in moe)
    router = moe[0].router
    assert (router.score, router.num_groups, router.top_k) == ("sigmoid", 4, 4) and router.expert_bias is not None
    assert moe[0].shared_expert is not None
    # the hash router needs token ids: the model passes them through
    hashed = build_model(small("mixtral-tiny", router="hash", router_options={}), seed=0)
    assert hashed(torch.randint(0, 256, (2, 8))).shape == (2, 8, 256)


def test_router_kwargs_pass_common_fields_only_where_accepted():
    cfg = small("mixtral-tiny", router="switch", router_options={})
    kwargs = cfg.router_kwargs()
    assert "top_k" not in kwargs and kwargs["aux_loss_coeff"] == cfg.aux_loss_coeff  # switch is top-1 by definition
    assert cfg.unused_router_fields() == ["top_k"]
    cfg = small("mixtral-tiny", router="hash", router_options={})
    kwargs = cfg.router_kwargs()
    # hash takes no loss coefficients; z_loss_coeff is 0 (what hash implies) so it is not reported
    assert cfg.unused_router_fields() == ["aux_loss_coeff"] and kwargs["top_k"] == 2 and "z_loss_coeff" not in kwargs
    cfg.aux_loss_coeff = 0.0
    assert cfg.unused_router_fields() == []
    # router_options come last: they may override a common field, and reach build_router as given
    cfg = small("mixtral-tiny", top_k=2, router_options={"top_k": 1, "normalize": False})
    assert cfg.router_kwargs() == {"top_k": 1, "capacity_factor": None, "aux_loss_coeff": cfg.aux_loss_coeff,
                                   "z_loss_coeff": 0.0, "normalize": False}
    router = build_model(cfg, seed=0).layers[0].ffn.router
    assert (router.top_k, router.normalize) == (1, False)


def test_router_kwargs_accept_a_user_router_taking_any_option():
    cfg = small("mixtral-tiny", router=f"{__name__}:AnyOptionRouter", router_options={"flavour": 3})
    assert cfg.router_kwargs() == {"top_k": 2, "capacity_factor": None, "aux_loss_coeff": cfg.aux_loss_coeff,
                                   "z_loss_coeff": 0.0, "flavour": 3}
    assert cfg.unused_router_fields() == []


def test_set_router_clears_router_options_but_keeps_common_fields():
    cfg = small("switch-tiny", capacity_factor=2.0, top_k=1)
    assert cfg.router_options == {"jitter": 0.01}
    cfg.set_router("switch")  # same family: its options stay
    assert cfg.router_options == {"jitter": 0.01}
    cfg.set_router("topk")  # jitter belongs to switch: dropped; the common fields carry over
    assert (cfg.router, cfg.router_options, cfg.capacity_factor, cfg.top_k) == ("topk", {}, 2.0, 1)
    assert cfg.router_kwargs()["capacity_factor"] == 2.0
    Transformer(cfg)  # builds: no switch-only option reaches the topk router
    assert PRESETS["switch-tiny"].router_options == {"jitter": 0.01}  # presets untouched


@pytest.mark.parametrize("field,value,match", [
    ("num_kv_heads", 3, "num_kv_heads=3 must divide"),
    ("hidden_size", 30, "not divisible by model.num_heads"),
    ("top_k", 9, "top_k=9 exceeds"),
    ("capacity_factor", -1.0, "capacity_factor=-1.0 is invalid"),
    ("activation", "tanh", "activation='tanh' is invalid"),
    ("num_layers", 0, "num_layers=0 is invalid"),
])
def test_config_validation_names_the_field(field, value, match):
    cfg = small("mixtral-tiny")
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=match):
        Transformer(cfg)


def test_bad_router_option_fails_at_build():
    cfg = small("mixtral-tiny", router_options={"jitter": 0.1})  # a switch option on a topk router
    with pytest.raises(ValueError, match="jitter"):
        Transformer(cfg)


def test_sequence_longer_than_max_seq_len():
    model = build_model(small("mixtral-tiny", max_seq_len=8), seed=0)
    with pytest.raises(ValueError, match="max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_model_code_never_imports_distributed():
    root = Path(__file__).resolve().parents[1] / "models"
    for name in ("config.py", "transformer.py", "stats.py"):
        text = (root / name).read_text()
        assert "torch.distributed" not in text and "import comm" not in text and "from comm" not in text, name


def test_forward_matches_manual_composition():
    """The model is embed -> blocks -> norm -> tied/untied projection, nothing hidden."""
    model = build_model(small("mixtral-tiny", num_layers=1), seed=0).eval()
    tokens = torch.randint(0, 256, (1, 12))
    cos, sin = rope_angles(12, model.config.attn_head_dim, model.config.rope_theta, "cpu")
    with torch.no_grad():
        x = model.embed(tokens)
        blk = model.layers[0]
        h = x + blk.attn(blk.attn_norm(x), cos, sin)
        y = h + blk.ffn(blk.ffn_norm(h), token_ids=tokens)
        expected = F.linear(model.norm(y), model.lm_head.weight)
        torch.testing.assert_close(model(tokens), expected)


class AnyOptionRouter(TopKRouter):
    """A user router whose __init__ takes **options: it gets every common field."""

    def __init__(self, hidden_size, num_experts, flavour=0, **options):
        super().__init__(hidden_size, num_experts, **options)
        self.flavour = flavour


def test_meta_device_builds_the_same_skeleton_without_initialising_or_importing_dynamo():
    """models.transformer.meta_device: the same parameter names, shapes and dtypes as a build under
    torch.device("meta"), and, in a fresh interpreter, no torch._dynamo import (torch's meta path for random
    fills imports it: ~1.3 s of start-up for every command that builds a model's skeleton)."""
    import subprocess
    import sys

    from moekit.models.config import preset
    from moekit.models.transformer import Transformer, meta_device

    config = preset("deepseek-tiny")
    with torch.device("meta"):
        plain = {n: (p.shape, p.dtype, p.is_meta) for n, p in Transformer(config).named_parameters()}
    with meta_device():
        skipped = {n: (p.shape, p.dtype, p.is_meta) for n, p in Transformer(config).named_parameters()}
    assert skipped == plain and all(meta for _, _, meta in plain.values())
    w = torch.empty(3, 4)  # outside meta tensors the mode is not there, and inside it leaves real tensors alone
    with meta_device():
        torch.nn.init.ones_(w)
    assert torch.equal(w, torch.ones(3, 4))
    probe = ("import sys; from moekit.models.config import preset; from moekit.models.transformer import "
             "Transformer, meta_device\nwith meta_device(): Transformer(preset('deepseek-tiny'))\n"
             "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_models_package_exports_its_public_names():
    """docs/architecture.md's model API is importable from moekit.models itself (loaded on first use)."""
    import moekit.models as models
    from moekit.models import config, transformer

    for name in models.__all__:
        assert getattr(models, name) is getattr(config if hasattr(config, name) else transformer, name), name
    assert {"ModelConfig", "PRESETS", "Transformer", "build_model"} <= set(models.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        models.nope


@pytest.mark.parametrize("over", [dict(first_dense_layers=9), dict(moe_every=9)])
def test_experts_without_an_moe_layer_are_refused(over):
    """num_experts > 0 with a layer pattern that leaves no MoE layer would train a dense model without a word."""
    from moekit.models.config import preset

    cfg = preset("mixtral-tiny")
    for k, v in over.items():
        setattr(cfg, k, v)
    with pytest.raises(ValueError, match="but no layer is an MoE layer"):
        cfg.validate()
    cfg.num_experts = 0  # a dense model says so
    cfg.validate()


def test_forward_names_bad_token_tensors_and_runs_an_empty_batch():
    from moekit.models import build_model, preset

    cfg = preset("mixtral-tiny")
    model = build_model(cfg)
    for bad, what in ((torch.zeros(2, 3), "2-d torch.float32"), (torch.zeros(3, dtype=torch.long), "1-d torch.int64"),
                      (torch.zeros(2, 3, dtype=torch.bool), "torch.bool"), ([[1, 2]], "got list")):
        with pytest.raises(TypeError, match=f"tokens must be a \\[batch, seq\\] tensor of integer token ids.*{what}"):
            model(bad)
    ok = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="targets must be"):
        model(ok, targets=ok.float())
    assert model(torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0, cfg.vocab_size)
    with pytest.raises(ValueError, match="hold no token to compute a loss over"):
        model(torch.zeros(0, 4, dtype=torch.long), targets=torch.zeros(0, 4, dtype=torch.long))


@pytest.mark.parametrize("args,error,match", [
    (("mixtral-tiny",), TypeError, r"config must be a ModelConfig, got str; for a preset: build_model\(preset"),
    (({"hidden_size": 8},), TypeError, "ModelConfig.from_dict"),
    ((None, "cpu", 1.5), ValueError, "seed=1.5 is invalid"),
    ((None, "tpu:x"), ValueError, "device='tpu:x' is invalid"),
])
def test_build_model_names_a_bad_argument(args, error, match):
    from moekit.models import build_model, preset

    args = (preset("mixtral-tiny"), *args[1:]) if args[0] is None else args
    with pytest.raises(error, match=match):
        build_model(*args)
