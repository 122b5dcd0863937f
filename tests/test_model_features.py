"""Issue 16's model features against transformers' own modules: q/k/v biases (Qwen2-MoE), per-head q/k norm
(Qwen3-MoE), whole-projection q/k norm and q/k/v clipping (OLMoE), multi-head latent attention (DeepSeek-V3),
the RoPE scalings (linear, yarn, llama3), DeepSeek's group score; KV-cache decoding; TP / FSDP gradients.

Every comparison copies fresh random weights (norm scales included) from the transformers module into
moekit's and compares fp32 outputs on random inputs.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moekit.comm.topology import Layout, LayoutError, Topology
from moekit.models.attention import MLAttention, window_mask
from moekit.models.rope import rope_frequencies, rope_tables
from moekit.models.config import ModelConfig
from moekit.models.transformer import Attention, KVCache, build_model
from moekit.moe.router import build_router
from tests.dist_utils import run_ranks

transformers = pytest.importorskip("transformers")

H, N, VOCAB = 32, 4, 64

LINEAR = {"rope_type": "linear", "factor": 2.5}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
YARN_DS = {**YARN, "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 24, "beta_slow": 2}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0}
MLA = dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)


def config(**over) -> ModelConfig:
    base = dict(hidden_size=H, num_layers=2, num_heads=N, num_kv_heads=2, head_dim=8, vocab_size=VOCAB,
                max_seq_len=64, ffn_hidden_size=24, num_experts=4, moe_ffn_hidden_size=16, top_k=2, rope_theta=1e4,
                norm_eps=1e-6)
    return ModelConfig(**{**base, **over}).validate()


def randomise_(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 1.0) + (p.dim() == 1))


HF_NAMES = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "q_a_proj": "wq_a",
            "q_a_layernorm": "q_a_norm", "q_b_proj": "wq_b", "kv_a_proj_with_mqa": "wkv_a",
            "kv_a_layernorm": "kv_a_norm", "kv_b_proj": "wkv_b", "q_norm": "q_norm", "k_norm": "k_norm"}


def copy_from_hf(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    state = {}
    for name, t in theirs.state_dict().items():
        module, _, kind = name.rpartition(".")
        state[f"{HF_NAMES[module]}.{kind}" if module else name] = t  # "sinks": a parameter of the module itself
    ours.load_state_dict(state, strict=True)  # same names, shapes (and so row order) for every tensor


def hf_attention(family: str, cfg: ModelConfig, rope: dict):
    """(attention module, rotary embedding) of transformers' ``family`` for ``cfg``'s sizes."""
    common = dict(hidden_size=H, num_attention_heads=N, max_position_embeddings=64, rms_norm_eps=cfg.norm_eps,
                  rope_parameters={**rope, "rope_theta": cfg.rope_theta} if rope else {"rope_type": "default",
                                                                                       "rope_theta": cfg.rope_theta})
    if family == "deepseek_v3":
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

        c = transformers.DeepseekV3Config(num_key_value_heads=N, q_lora_rank=cfg.q_lora_rank or None,
                                          kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                                          qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                                          rope_interleave=cfg.rope_interleave, **common)
        pair = m.DeepseekV3Attention, m.DeepseekV3RotaryEmbedding
    else:
        kv = dict(num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.attn_head_dim)
        if family == "qwen2_moe":
            from transformers.models.qwen2_moe import modeling_qwen2_moe as m

            c = transformers.Qwen2MoeConfig(qkv_bias=cfg.attention_bias, **kv, **common)
            pair = m.Qwen2MoeAttention, m.Qwen2MoeRotaryEmbedding
        elif family == "qwen3_moe":
            from transformers.models.qwen3_moe import modeling_qwen3_moe as m

            c = transformers.Qwen3MoeConfig(**kv, **common)
            pair = m.Qwen3MoeAttention, m.Qwen3MoeRotaryEmbedding
        elif family == "gpt_oss":
            from transformers.models.gpt_oss import modeling_gpt_oss as m

            c = transformers.GptOssConfig(attention_bias=True, sliding_window=cfg.sliding_window, num_hidden_layers=2,
                                          **kv, **common)
            c._attn_implementation = "eager"  # gpt-oss has no SDPA path (the sinks)
            pair = m.GptOssAttention, m.GptOssRotaryEmbedding
            return pair[0](c, 0), pair[1](c)  # layer 0: a sliding one in gpt-oss's pattern
        elif family == "glm4_moe":
            from transformers.models.glm4_moe import modeling_glm4_moe as m

            common["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
            c = transformers.Glm4MoeConfig(attention_bias=cfg.attention_bias, use_qk_norm=cfg.qk_norm == "head",
                                           **kv, **common)
            pair = m.Glm4MoeAttention, m.Glm4MoeRotaryEmbedding
        else:
            from transformers.models.olmoe import modeling_olmoe as m

            c = transformers.OlmoeConfig(clip_qkv=cfg.qkv_clip or None, **kv, **common)
            pair = m.OlmoeAttention, m.OlmoeRotaryEmbedding
    c._attn_implementation = "sdpa"  # causal without a mask
    return pair[0](c, 0), pair[1](c)


CASES = {  # family -> moekit config overrides, rope scaling
    "qwen2_moe": (dict(attention_bias=True), LINEAR),
    "qwen3_moe": (dict(qk_norm="head"), YARN),
    "olmoe": (dict(qk_norm="full", qkv_clip=0.4, head_dim=0), LLAMA3),
    "deepseek_v3": (dict(**MLA, q_lora_rank=12), YARN_DS),
    "deepseek_v3-full-rank-q": (dict(**MLA, rope_interleave=False), YARN),
    "deepseek_v3-plain-rope": (dict(**MLA, q_lora_rank=12), {}),
    # RoPE on part of each head (the rest passes), with the head-width frequencies of that part
    "glm4_moe": (dict(attention_bias=True, partial_rotary_factor=0.5), {}),
    "glm4_moe-qknorm-yarn": (dict(qk_norm="head", head_dim=16, partial_rotary_factor=0.25), YARN),
    # sinks, a 4-position window (layer 0 slides), biases on q/k/v and o, yarn without truncation
    "gpt_oss": (dict(attention_bias=True, attention_out_bias=True, attention_sinks=True, sliding_window=4,
                     full_attention_every=2), {**YARN, "truncate": False, "beta_fast": 32.0, "beta_slow": 1.0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_matches_transformers(case):
    over, rope = CASES[case]
    cfg = config(**over, rope_scaling=dict(rope))
    theirs, rotary = hf_attention(case.split("-")[0], cfg, rope)
    randomise_(theirs, seed=len(case))
    ours = MLAttention(cfg) if cfg.attention == "mla" else Attention(cfg)
    copy_from_hf(ours, theirs)
    x = torch.randn(2, 11, H, generator=torch.Generator().manual_seed(1))
    hf_cos, hf_sin = rotary(x, torch.arange(11)[None])  # [1, S, R] with the attention factor folded in
    cos, sin = rope_tables(cfg, 11, "cpu")  # [S, R/2]
    halves = 1 if hf_cos.shape[-1] == cos.shape[-1] else 2  # gpt-oss's tables hold each frequency once
    torch.testing.assert_close(torch.cat((cos,) * halves, -1), hf_cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat((sin,) * halves, -1), hf_sin[0], rtol=1e-6, atol=1e-6)
    mask = None
    if cfg.attention_sinks:  # transformers' eager attention (gpt-oss) needs its additive mask; ours: layer 0's
        mask = torch.zeros(11, 11).masked_fill(~window_mask(0, 11, cfg.attention_window(0), "cpu"), -math.inf)
        assert ours.window == 4
    want, _ = theirs(x, (hf_cos, hf_sin), mask)
    got = ours(x, cos, sin)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if cfg.qkv_clip:  # the clip is active on these inputs, so the comparison covers it
        assert ours.wq(x).abs().max() > cfg.qkv_clip


@pytest.mark.parametrize("rope", [
    LINEAR, YARN, YARN_DS, {**YARN, "truncate": False}, {**YARN, "attention_factor": 0.8, "beta_fast": 16.0},
    {**YARN, "mscale": 0.5, "mscale_all_dim": 0.0}, {**YARN, "factor": 1.0}, LLAMA3,
    {**LLAMA3, "low_freq_factor": 2.0, "high_freq_factor": 3.0},
    {**LLAMA3, "low_freq_factor": 1.0, "high_freq_factor": 1.0}],  # Llama 4 Scout's: no band between them
    ids=lambda r: "-".join(map(str, r.values())))
@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_rope_frequencies_match_transformers(rope, attention):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = config(rope_scaling=dict(rope), **(MLA if attention == "mla" else {}))
    # transformers' rope dim is config.head_dim (DeepSeek-V3's config sets it to qk_rope_head_dim)
    hf = transformers.LlamaConfig(hidden_size=H, num_attention_heads=N, head_dim=cfg.rope_dim,
                                  max_position_embeddings=64, rope_parameters={**rope, "rope_theta": cfg.rope_theta})
    want, want_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    got, factor = rope_frequencies(cfg)
    assert got.shape == (cfg.rope_dim // 2,) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)
    plain = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.rope_dim, 2).float() / cfg.rope_dim)
    assert not torch.allclose(got, plain) or rope["factor"] == 1.0  # the scaling did something


@pytest.mark.parametrize("over", [
    dict(**MLA, q_lora_rank=12, rope_scaling=YARN_DS, num_experts=0),
    dict(**MLA, rope_interleave=False),
    dict(qk_norm="full", qkv_clip=0.5, attention_bias=True, rope_scaling=LLAMA3),
    dict(qk_norm="head", rope_scaling=LINEAR),
    dict(attention_bias=True, partial_rotary_factor=0.5),
    dict(rope_pairs="adjacent", partial_rotary_factor=0.5)],
    ids=["mla-yarn", "mla-full-rank-q", "olmoe-like", "qwen3-like", "glm-partial-rope", "ernie-adjacent-pairs"])
def test_cached_decoding_equals_full_forward(over):
    cfg = config(**over)
    model = build_model(cfg, seed=2).eval()
    tokens = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(cfg)
        steps = [model(tokens[:, :4], cache=cache), model(tokens[:, 4:7], cache=cache)]
        steps += [model(tokens[:, i : i + 1], cache=cache) for i in range(7, 13)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    if cfg.attention == "mla":  # keys and values of different widths in one cache
        layer = cache.layers[0]
        assert layer.keys.shape[-1] == cfg.attn_qk_head_dim and layer.values.shape[-1] == cfg.v_head_dim


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_adjacent_rope_pairs_are_half_pairs_over_reordered_projections(partial):
    """rope_pairs "adjacent" (ERNIE 4.5) rotates channels (2i, 2i + 1) together: the logits of "half" RoPE (i with
    i + R/2) over q/k projections whose rows are reordered per head (the rotated evens, the rotated odds, the rest),
    HF's old Llama weight permutation written the other way; and different from "half" over the same weights."""
    cfg = config(partial_rotary_factor=partial, rope_theta=100.0)
    adjacent = build_model(ModelConfig(**{**cfg.__dict__, "rope_pairs": "adjacent"}).validate(), seed=5)
    randomise_(adjacent, 5)  # sharp attention: the pairing shows in the logits
    half = build_model(cfg, seed=5)
    half.load_state_dict(adjacent.state_dict())
    D, R = cfg.attn_head_dim, cfg.rope_dim
    order = torch.cat([torch.arange(0, R, 2), torch.arange(1, R, 2), torch.arange(R, D)])
    tokens = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert (adjacent(tokens) - half(tokens)).abs().max() > 1e-2  # the same weights: other pairs
        for a, h in zip(adjacent.layers, half.layers):
            for name in ("wq", "wk"):
                w = getattr(a.attn, name).weight  # [heads * D, H]
                getattr(h.attn, name).weight.copy_(w.view(-1, D, w.shape[-1])[:, order].reshape_as(w))
        torch.testing.assert_close(adjacent(tokens), half(tokens), rtol=1e-5, atol=1e-5)


def test_init_and_parameter_counts():
    cfg = config(**MLA, q_lora_rank=12)
    a, b = build_model(cfg, seed=4), build_model(cfg, seed=4)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    attn = a.layers[0].attn
    assert {n for n, _ in attn.named_parameters()} == {
        "wq_a.weight", "q_a_norm.weight", "wq_b.weight", "wkv_a.weight", "kv_a_norm.weight", "wkv_b.weight", "wo.weight"}
    assert attn.wq_b.weight.shape == (N * 12, 12) and attn.wkv_b.weight.shape == (N * 14, 16)
    assert attn.wkv_a.weight.shape == (20, H) and attn.wo.weight.shape == (H, N * 6)
    assert torch.all(attn.q_a_norm.weight == 1) and torch.all(attn.kv_a_norm.weight == 1)
    std = attn.wkv_b.weight.std().item()
    assert 0.015 < std < 0.025 and attn.wo.weight.std().item() < std  # N(0, init_std); wo scaled down
    gqa = build_model(config(attention_bias=True, qk_norm="head"), seed=4).layers[0].attn
    assert torch.all(gqa.wq.bias == 0) and gqa.wo.bias is None and torch.all(gqa.q_norm.weight == 1)
    assert gqa.q_norm.weight.shape == (8,)

    from moekit.models.stats import model_stats

    s = model_stats(cfg, seq_len=16)
    matmul = sum(p.numel() for n, p in a.named_parameters() if p.dim() >= 2 and n != "embed.weight")
    expert = a.layers[0].ffn.experts
    matmul -= (expert.w_in.numel() + expert.w_out.numel()) // 2 * cfg.num_layers  # top 2 of 4 experts active
    attention = cfg.num_layers * 16 * N * (12 + 6)  # S N (Dqk + Dv) per layer
    assert s.train_flops_per_token == pytest.approx(3 * (2 * matmul + attention))


def test_pipeline_stages_chain_to_the_mla_model():
    """Pipeline stages compute RoPE themselves (the rope dims and the yarn tables): chained, they are the model."""
    from moekit.models.pipeline import StageModule, balance_stages, layer_costs

    cfg = config(**MLA, q_lora_rank=12, rope_scaling=YARN_DS, num_layers=3)
    model = build_model(cfg, seed=3)
    costs = layer_costs(cfg, 12)
    ranges = balance_stages(costs.layers, 3)
    stages = [StageModule(model, r, i == 0, i == 2) for i, r in enumerate(ranges)]
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    x = tokens
    for stage in stages:
        x = stage(x, tokens)
    assert torch.equal(x, model(tokens))


def brute_force_groups(scores: torch.Tensor, groups: int, keep_groups: int, score_top: int, k: int) -> list[set]:
    out = []
    for row in scores.tolist():
        size = len(row) // groups
        group_score = [sum(sorted(row[g * size : (g + 1) * size], reverse=True)[:score_top]) for g in range(groups)]
        best = sorted(range(groups), key=lambda g: -group_score[g])[:keep_groups]
        allowed = [e for e in range(len(row)) if e // size in best]
        out.append(set(sorted(allowed, key=lambda e: -row[e])[:k]))
    return out


def test_group_score_top_matches_brute_force_and_deepseek():
    E, T = 16, 40
    router = build_router("topk", H, E, top_k=3, score="sigmoid", num_groups=4, group_top_k=2, group_score_top=2,
                          expert_bias=True, aux_loss_coeff=0.0)  # top_k 3 is not a multiple of group_top_k 2
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=gen))
        router.expert_bias.copy_(torch.randn(E, generator=gen) * 0.1)
    x = torch.randn(T, H, generator=gen)
    routing = router(x)
    choice = torch.sigmoid(x @ router.weight.T) + router.expert_bias
    want = brute_force_groups(choice, 4, 2, 2, 3)
    assert [set(r) for r in routing.indices.tolist()] == want
    # moekit's default scores a group by its top top_k // group_top_k = 1 expert: another choice here
    default = build_router("topk", H, E, top_k=2, score="sigmoid", num_groups=4, group_top_k=2, aux_loss_coeff=0.0)
    assert default.group_score_top == 1 and router.group_score_top == 2

    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf = DeepseekV3TopkRouter(transformers.DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=3,
                                                            n_group=4, topk_group=2, norm_topk_prob=True,
                                                            routed_scaling_factor=1.0))
    with torch.no_grad():
        hf.weight.copy_(router.weight)
        hf.e_score_correction_bias.copy_(router.expert_bias)
    _, hf_weights, hf_idx = hf(x)
    assert [set(r) for r in hf_idx.tolist()] == want
    order = routing.indices.sort(-1).indices, hf_idx.sort(-1).indices
    torch.testing.assert_close(routing.weights.gather(1, order[0]), hf_weights.gather(1, order[1]))


@pytest.mark.parametrize("options,message", [
    (dict(group_score_top=2), "needs num_groups and group_top_k"),
    (dict(num_groups=4, group_top_k=2, group_score_top=5), "group_score_top=5 is invalid"),
    (dict(num_groups=4, group_top_k=2, group_score_top=0), "group_score_top=0 is invalid"),
    (dict(num_groups=4, group_top_k=1, group_score_top=2, top_k=5), "top_k=5 exceeds the 4 experts"),
    (dict(num_groups=4, group_top_k=2, group_score_top="2"), "has the wrong type"),
])
def test_group_score_top_refusals(options, message):
    options = {"top_k": 2, **options}
    with pytest.raises(ValueError, match=message):
        build_router("topk", H, 16, **options)


@pytest.mark.parametrize("over,message", [
    (dict(attention="mla"), "needs model.kv_lora_rank, model.qk_nope_head_dim, model.qk_rope_head_dim, "
                            "model.v_head_dim > 0"),
    (dict(MLA, v_head_dim=0), r"needs model.v_head_dim > 0"),
    (dict(MLA, qk_rope_head_dim=5), "qk_rope_head_dim=5 must be even"),
    (dict(MLA, q_lora_rank=-1), "q_lora_rank=-1 is invalid"),
    (dict(MLA, attention_bias=True), "attention_bias=True applies to attention='gqa' only"),
    (dict(MLA, qk_norm="head"), "qk_norm='head' applies to attention='gqa' only"),
    (dict(kv_lora_rank=8), "model.kv_lora_rank only apply to attention='mla'"),
    (dict(attention="flash"), "model.attention='flash' is invalid; choose one of"),
    (dict(qk_norm="rms"), "model.qk_norm='rms' is invalid"),
    (dict(rope_pairs="interleaved"), r"model.rope_pairs='interleaved' is invalid; choose one of \['half', 'adjacent'\]"),
    (dict(MLA, rope_pairs="adjacent"), "rope_pairs='adjacent' applies to attention='gqa' only"),
    (dict(qkv_clip=-1.0), "model.qkv_clip=-1.0 is invalid"),
    (dict(partial_rotary_factor=0.0), "model.partial_rotary_factor=0.0 is invalid; it must be a finite number > 0"),
    (dict(partial_rotary_factor=1.5), "partial_rotary_factor=1.5 is above 1"),
    (dict(partial_rotary_factor=0.1), r"partial_rotary_factor=0.1 rotates 0 of the head's \d+ channels; RoPE needs an "
                                      "even number >= 2"),
    (dict(MLA, partial_rotary_factor=0.5), "partial_rotary_factor=0.5 applies to attention='gqa' only"),
    (dict(attention_bias="yes"), "model.attention_bias='yes' is invalid"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_type='dynamic' is invalid"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), r"needs \['original_max_position_embeddings'\]"),
    (dict(rope_scaling={**LINEAR, "rope_theta": 1e4}), r"unknown key\(s\) \['rope_theta'\]"),
    (dict(rope_scaling={**LINEAR, "factor": 0}), "rope_scaling.factor=0 is invalid"),
    (dict(rope_scaling={**YARN, "truncate": 1}), "truncate=1 is invalid"),
    (dict(rope_scaling={**LLAMA3, "high_freq_factor": 0.5}), "high_freq_factor=0.5 must be at least low_freq_factor"),
    (dict(rope_scaling="yarn"), "rope_scaling='yarn' is invalid"),
])
def test_bad_attention_configs_are_refused(over, message):
    with pytest.raises(ValueError, match=message):
        config(**over)


def test_tensor_parallel_head_checks():
    from moekit.comm.tensor_parallel import check_tensor_parallel

    check_tensor_parallel(config(qk_norm="full"), 2)  # sharded, its mean square all-reduced (TPFullRMSNorm)
    check_tensor_parallel(config(qk_norm="head"), 2)
    check_tensor_parallel(config(**MLA, num_kv_heads=3, num_heads=4), 2)  # MLA: only the query heads split
    with pytest.raises(LayoutError, match="--tp 3 must divide num_heads=4"):
        check_tensor_parallel(config(**MLA), 3)


# ---------------------------------------------------------------------------------------------------
# Parallel layouts: the single-process loss and gradients
# ---------------------------------------------------------------------------------------------------

B, S = 4, 12
PARALLEL = {
    "mla": dict(**MLA, q_lora_rank=12, rope_scaling=YARN_DS, first_dense_layers=1),
    "mla-full-rank-q": dict(**MLA, rope_interleave=False),
    "gqa": dict(attention_bias=True, qk_norm="head", qkv_clip=0.5, rope_scaling=LLAMA3),
    "gpt-oss": dict(attention_bias=True, attention_out_bias=True, attention_sinks=True, sliding_window=5,
                    full_attention_every=2, rope_scaling=YARN),
    # OLMoE / MiniMax-M2: q/k RMSNorm over the whole projection, sharded over TP with its mean square all-reduced
    "qk-norm-full": dict(qk_norm="full", qkv_clip=0.5, partial_rotary_factor=0.5, attention_bias=True),
}


def _loss(model, tokens):
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def _check_parallel(rank, world, degrees, name, sequence_parallel):
    from moekit.comm.grad_sync import sync_gradients
    from moekit.models.parallelize import parallelize

    layout = Layout(**degrees)
    topo = Topology(layout, rank, world).build()
    cfg = config(**PARALLEL[name], z_loss_coeff=0.01)
    tokens = torch.randint(0, VOCAB, (B, S + 1), generator=torch.Generator().manual_seed(5))
    ref = build_model(cfg, seed=3)
    ref_loss = _loss(ref, tokens)
    ref_loss.backward()
    model = build_model(cfg, seed=3)
    done = parallelize(model, topo, sequence_parallel=sequence_parallel)
    D = layout.data_parallel
    loss = _loss(model, tokens.view(D, B // D, S + 1)[topo.data_rank()])
    loss.backward()
    sync_gradients(model, topo, done.grad_roles, fsdp=done.fsdp)
    where = f"{degrees} {name} sp={sequence_parallel}"
    mean = loss.detach().clone()
    torch.distributed.all_reduce(mean)
    torch.testing.assert_close(mean / world, ref_loss.detach(), msg=lambda m: f"{where}: loss: {m}")
    want = dict(ref.named_parameters())
    for pname, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(g, want[pname].grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{where}: {pname}: {m}")
    if layout.tp > 1 and cfg.qk_norm == "head":
        assert done.grad_roles["layers.0.attn.q_norm.weight"] == "moe"  # partial over the heads' TP ranks


def _parallel_rank(rank, world, cases):
    for case in cases:
        _check_parallel(rank, world, *case)


def test_tp_and_fsdp_give_the_single_process_gradients():
    """tp=2: MLA (low-rank q, yarn, interleaved rope key) and MLA with full-rank q, both with sequence
    parallelism once; GQA with biases, per-head q/k norm and clipping; gpt-oss's sinks (sharded by heads), window
    and wo bias with sequence parallelism. fsdp=2: the MLA, GQA and gpt-oss models; dp=2 x ep=2: MLA."""
    run_ranks(_parallel_rank, 2, [
        (dict(tp=2), "mla", False), (dict(tp=2), "mla-full-rank-q", True), (dict(tp=2), "gqa", False),
        (dict(tp=2), "gqa", True), (dict(fsdp=2), "mla", False), (dict(fsdp=2), "gqa", False),
        (dict(dp=2, ep=2), "mla", False), (dict(tp=2), "gpt-oss", True), (dict(fsdp=2), "gpt-oss", False),
        (dict(tp=2), "qk-norm-full", True), (dict(tp=2), "qk-norm-full", False)])
