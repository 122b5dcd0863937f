"""moekit.models.hf (models/hf/) against transformers itself: tiny random checkpoints made locally with save_pretrained.

Parity: for every family (mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3, llama, qwen2, qwen3) moekit's
logits equal transformers' (fp32, relative error < 1e-5) for imports, and transformers loads moekit's
exports (save_hf) with the same logits, tokenizer included. Native moekit models export as the nearest
family that reproduces them, or are refused with the reasons. Corrupt and mismatched folders fail with
errors naming the key, the shapes and the fix; unsupported features fail listing every one.
"""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig, MixtralForCausalLM

from moekit.models.config import ModelConfig
from moekit.models.hf import (
    UnsupportedCheckpoint, check_hf_exportable, config_from_hf, load_hf, load_hf_into, load_hf_sharded,
    load_mixtral, save_hf,
    save_mixtral,
)
from moekit.models.transformer import build_model

VOCAB, SEQ = 128, 12
# initializer_range 0.1 (not HF's 0.02) makes router logits decisive, so a near-tie cannot flip an expert
# choice between two correct implementations and the parity tests compare real routing.
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, initializer_range=0.1,
            max_position_embeddings=64)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def hf_mixtral(folder: Path, seed: int = 0, dtype=torch.float32, shard: str | None = None, **overrides):
    """A random tiny MixtralForCausalLM saved with save_pretrained; returns the in-memory model."""
    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**{**TINY, **overrides})).eval()
    kwargs = {"max_shard_size": shard} if shard else {}
    model.to(dtype).save_pretrained(folder, **kwargs)
    return model


@torch.no_grad()
def hf_logits(model, toks: torch.Tensor) -> torch.Tensor:
    return model(toks).logits.float()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """One valid checkpoint that the corruption tests copy and break."""
    folder = tmp_path_factory.mktemp("base")
    hf_mixtral(folder)
    return folder


def broken_copy(base: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(base, tmp_path / "ckpt"))


def edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def edit_tensors(folder: Path, fn) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------------
# Import and export parity
# ---------------------------------------------------------------------------------------------------

CONFIGS = {
    "gqa2-top2-untied": dict(rope_theta=1e4),
    "mqa-top1-tied": dict(num_key_value_heads=1, num_experts_per_tok=1, tie_word_embeddings=True, rope_theta=5e5),
    "mha-top3-headdim": dict(num_key_value_heads=4, num_experts_per_tok=3, num_local_experts=6, head_dim=16,
                             rope_theta=1e6, rms_norm_eps=1e-6, hidden_size=48, vocab_size=200),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_import_matches_transformers(tmp_path, name):
    hf = hf_mixtral(tmp_path, **CONFIGS[name])
    model = load_mixtral(tmp_path)
    toks = tokens().clamp_max(hf.config.vocab_size - 1)
    with torch.no_grad():
        assert rel_err(model(toks), hf_logits(hf, toks)) < 1e-4
    cfg = model.config
    assert (cfg.num_kv_heads, cfg.top_k, cfg.tie_embeddings) == (
        hf.config.num_key_value_heads, hf.config.num_experts_per_tok, hf.config.tie_word_embeddings)
    assert cfg.rope_theta == hf.config.rope_parameters["rope_theta"] and not model.training


def moekit_mixtral(**overrides) -> ModelConfig:
    fields = dict(name="t", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_seq_len=64, num_experts=4, moe_ffn_hidden_size=24, top_k=2, init_std=0.1,
                  router_options={"normalize": True})
    return ModelConfig(**{**fields, **overrides})


@pytest.mark.parametrize("layout,overrides", [
    ("per_expert", {}),
    ("fused", dict(top_k=1, tie_embeddings=True, num_kv_heads=1, rope_theta=3e5)),
    ("per_expert", dict(top_k=3, num_experts=5, head_dim=12, norm_eps=1e-6)),
])
def test_export_loads_in_transformers(tmp_path, layout, overrides):
    model = build_model(moekit_mixtral(**overrides), seed=1).eval()
    save_mixtral(model, tmp_path, layout=layout)
    hf = MixtralForCausalLM.from_pretrained(tmp_path).eval()
    toks = tokens(1)
    with torch.no_grad():
        assert rel_err(hf_logits(hf, toks), model(toks)) < 1e-4
        assert rel_err(load_mixtral(tmp_path)(toks), model(toks)) == 0.0  # exact round trip


def test_sharded_checkpoint(tmp_path):
    hf = hf_mixtral(tmp_path / "in", shard="20KB")
    assert len(list((tmp_path / "in").glob("model-*.safetensors"))) > 1
    assert (tmp_path / "in" / "model.safetensors.index.json").is_file()
    model = load_mixtral(tmp_path / "in")
    with torch.no_grad():
        assert rel_err(model(tokens()), hf_logits(hf, tokens())) < 1e-4
    save_mixtral(model, tmp_path / "out", max_shard_size="16KB")
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1
    back = MixtralForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert rel_err(hf_logits(back, tokens()), hf_logits(hf, tokens())) < 1e-4


def test_bf16_checkpoint(tmp_path):
    hf_mixtral(tmp_path / "in", dtype=torch.bfloat16)
    hf32 = MixtralForCausalLM.from_pretrained(tmp_path / "in", dtype=torch.float32).eval()
    model = load_mixtral(tmp_path / "in")  # upcast to fp32 (training master weights)
    assert model.embed.weight.dtype == torch.float32
    with torch.no_grad():
        assert rel_err(model(tokens()), hf_logits(hf32, tokens())) < 1e-4
    assert load_mixtral(tmp_path / "in", dtype="auto").embed.weight.dtype == torch.bfloat16
    save_mixtral(model, tmp_path / "out", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_file(tmp_path / "out" / "model.safetensors")["model.embed_tokens.weight"].dtype == torch.bfloat16
    back = MixtralForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert rel_err(hf_logits(back, tokens()), hf_logits(hf32, tokens())) == 0.0  # bf16 -> fp32 -> bf16 is exact


# ---------------------------------------------------------------------------------------------------
# Corrupt and mismatched checkpoints
# ---------------------------------------------------------------------------------------------------

EXPERT = "model.layers.1.block_sparse_moe.experts.2.w3.weight"


@pytest.mark.parametrize("breakage,match", [
    (lambda t: t.pop(EXPERT), r"missing 1 tensor.*experts\.2\.w3\.weight \(for moekit layers\.1\.ffn\.experts\.w_in\)"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(32)}),
     r"nothing in the model consumes.*q_proj\.bias"),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 32)}),
     r"k_proj\.weight has shape \[8, 32\] in the checkpoint but config\.json \(hidden_size, num_key_value_heads, "
     r"head_dim\) implies \[16, 32\]"),
    (lambda t: [t.pop(k) for k in list(t) if ".experts.3." in k], r"num_local_experts=4 but layer 0 has 3 experts"),
    (lambda t: t.pop("lm_head.weight"), r"tie_word_embeddings=false but the checkpoint has no lm_head\.weight"),
])
def test_bad_tensors(base, tmp_path, breakage, match):
    folder = broken_copy(base, tmp_path)
    edit_tensors(folder, breakage)
    with pytest.raises(ValueError, match=match):
        load_mixtral(folder)


@pytest.mark.parametrize("changes,match", [
    (dict(num_local_experts=8), r"num_local_experts=8 but layer 0 has 4 experts"),
    (dict(num_hidden_layers=3), r"num_hidden_layers=3 but the checkpoint has layers 0\.\.1"),
    (dict(num_key_value_heads=4), r"k_proj\.weight has shape \[16, 32\] .* implies \[32, 32\]"),
    (dict(intermediate_size=40), r"experts\.0\.w1\.weight has shape \[48, 32\] .* implies \[40, 32\]"),
    (dict(tie_word_embeddings=True), r"tie_word_embeddings=true but lm_head\.weight \[128, 32\] differs"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu'"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}), r"rope_type='dynamic'"),
    (dict(model_type="gpt2"),
     r"model_type='gpt2' is not supported; moekit imports \['deepseek_v2', 'deepseek_v3', 'dots1', "
     r"'ernie4_5_moe', 'glm4_moe', 'glm4_moe_lite'"),
])
def test_config_weight_mismatch(base, tmp_path, changes, match):
    folder = broken_copy(base, tmp_path)
    edit_config(folder, **changes)
    with pytest.raises(ValueError, match=match):
        load_hf(folder)


def test_truncated_file(base, tmp_path):
    folder = broken_copy(base, tmp_path)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=r"model\.safetensors: .* the file is truncated"):
        load_mixtral(folder)


def test_missing_shard_and_stale_index(tmp_path):
    hf_mixtral(tmp_path, shard="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    moved = tmp_path / shard
    moved.rename(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=rf"lists shard\(s\) \['{shard}'\] that are not in"):
        load_mixtral(tmp_path)
    (tmp_path / "elsewhere").rename(moved)
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = shard if index["weight_map"][key] != shard else "model-00001-of-99999.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"puts {key} in .* come from different saves"):
        load_mixtral(tmp_path)


def test_export_rejects_what_mixtral_cannot_express(tmp_path):
    with pytest.raises(ValueError, match=r"Mixtral has an MoE FFN in every layer; this model has 1 of 2"):
        save_mixtral(build_model(moekit_mixtral(moe_every=2)), tmp_path)
    with pytest.raises(ValueError, match=r"drops tokens \(capacity_factor=1.25\)"):
        save_mixtral(build_model(moekit_mixtral(capacity_factor=1.25)), tmp_path)
    with pytest.raises(ValueError, match=r"not a softmax top-k router"):
        save_mixtral(build_model(moekit_mixtral(router_options={"score": "sigmoid"})), tmp_path)
    assert not (tmp_path / "config.json").exists()


# ---------------------------------------------------------------------------------------------------
# Every family: transformers -> moekit -> transformers, tokenizer included
# ---------------------------------------------------------------------------------------------------

SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.1, max_position_embeddings=64)
QWEN_MOE = dict(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
MLA = dict(num_key_value_heads=4, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
           moe_intermediate_size=16, n_routed_experts=8)  # transformers' MLA needs num_key_value_heads = heads
YARN = dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16, mscale=1.0,
            mscale_all_dim=0.707, beta_fast=32, beta_slow=1)
LLAMA3 = dict(rope_type="llama3", rope_theta=1e4, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
FAMILY_CASES = {  # case -> (model_type, config overrides)
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16)),
    # Mistral's sliding window on every layer, shorter than the test's sequence
    "mixtral-window": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=5)),
    "qwen2_moe": ("qwen2_moe", dict(QWEN_MOE, shared_expert_intermediate_size=40, qkv_bias=True, norm_topk_prob=True)),
    "qwen3_moe": ("qwen3_moe", dict(QWEN_MOE, head_dim=12, num_hidden_layers=3, mlp_only_layers=[0],
                                    tie_word_embeddings=True)),
    "olmoe": ("olmoe", dict(num_experts=4, num_experts_per_tok=2, clip_qkv=0.5, norm_topk_prob=False)),
    # groups scored by their top 2 with top_k=3 != 2 * topk_group; YaRN with DeepSeek's mscale_all_dim
    "deepseek_v3-qlora-yarn": ("deepseek_v3", dict(MLA, num_hidden_layers=3, first_k_dense_replace=1, q_lora_rank=16,
                                                   n_group=4, topk_group=2, num_experts_per_tok=3,
                                                   rope_parameters=YARN)),
    "deepseek_v3-fullq": ("deepseek_v3", dict(MLA, q_lora_rank=None, first_k_dense_replace=0, n_group=2, topk_group=1,
                                              num_experts_per_tok=2, n_shared_experts=2, norm_topk_prob=False,
                                              rope_interleave=False, routed_scaling_factor=1.5)),
    # dots.llm1: Qwen3's attention with biases on q/k/v and o, DeepSeek-V3's MoE (4 groups keep 2, scaling 2.5,
    # renormalised, a shared expert, a dense first layer)
    "dots1": ("dots1", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                            first_k_dense_replace=1, num_hidden_layers=3, n_group=4, topk_group=2, head_dim=16,
                            routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True)),
    # every layer sliding (max_window_layers 0) with a 5-position window under 12-token inputs; no renorm
    "dots1-window": ("dots1", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                   n_shared_experts=2, sliding_window=5, max_window_layers=0)),
    # DeepSeek-V2-Lite: full-rank q, softmax over every expert, no renorm, 2 shared experts, a dense first layer
    "deepseek_v2-lite": ("deepseek_v2", dict(MLA, q_lora_rank=None, first_k_dense_replace=1, num_hidden_layers=3,
                                             num_experts_per_tok=3, n_shared_experts=2, routed_scaling_factor=1.0)),
    # DeepSeek-V2: low-rank q, groups of the best single score (group_limited_greedy), routed scaling, YaRN
    "deepseek_v2-groups-yarn": ("deepseek_v2", dict(MLA, q_lora_rank=16, topk_method="group_limited_greedy", n_group=4,
                                                    topk_group=2, num_experts_per_tok=3, routed_scaling_factor=16.0,
                                                    rope_parameters=YARN)),
    # GLM-4.7-Flash: DeepSeek-V3's MLA and MoE (4 groups keep 2, scaling 1.8, a shared expert), two dense layers
    # first (mlp_layer_types), an MTP layer
    "glm4_moe_lite": ("glm4_moe_lite", dict(MLA, q_lora_rank=16, num_hidden_layers=4, n_group=4, topk_group=2,
                                            num_experts_per_tok=3, routed_scaling_factor=1.8, n_shared_experts=1,
                                            mlp_layer_types=["dense", "dense", "sparse", "sparse"])),
    # GLM-4.5: GQA with q/k/v biases, RoPE on half of each head, DeepSeek's MoE (4 groups keep 2, scaling 2.5,
    # 2 shared experts, a dense first layer)
    "glm4_moe": ("glm4_moe", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                  first_k_dense_replace=1, num_hidden_layers=3, attention_bias=True, n_group=4,
                                  topk_group=2, routed_scaling_factor=2.5, n_shared_experts=2)),
    # per-head q/k norm, a quarter of each head rotated, no renorm, every layer MoE
    "glm4_moe-qknorm": ("glm4_moe", dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=16,
                                         use_qk_norm=True, head_dim=16, first_k_dense_replace=0,
                                         rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                              partial_rotary_factor=0.25), norm_topk_prob=False)),
    # gpt-oss: sinks, q/k/v/o biases, a 4-position window on layer 0, a biased gate, biased clamped-SwiGLU experts
    "gpt_oss": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=4, head_dim=8)),
    # MiniMax-M2: q/k RMSNorm over the projection, RoPE on rotary_dim 8 of 16 channels (legacy field), sigmoid +
    # e_score_correction_bias in the block (not its gate), Mixtral's per-expert names
    "minimax_m2": ("minimax_m2", dict(num_local_experts=8, num_experts_per_tok=3, head_dim=16, rotary_dim=8)),
    "minimax_m2-full-rope-yarn": ("minimax_m2", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8,
                                                     rope_parameters={**YARN, "rope_theta": 5e6})),
    # ERNIE 4.5: RoPE on adjacent channel pairs, a tied head, a dense first layer, softmax + a [1, E] selection bias
    # (moe_statics), 2 ungated shared experts
    "ernie4_5_moe": ("ernie4_5_moe", dict(moe_num_experts=8, moe_k=3, moe_intermediate_size=16, num_hidden_layers=3,
                                          moe_num_shared_experts=2)),
    # every other layer MoE (interval 2: layers 1 and 3), the last one dense (end index 3 of 5), no shared expert,
    # an untied head, head_dim 16
    "ernie4_5_moe-interval": ("ernie4_5_moe", dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=16,
                                                   num_hidden_layers=5, moe_layer_start_index=0, moe_layer_end_index=3,
                                                   moe_layer_interval=2, moe_num_shared_experts=0, head_dim=16,
                                                   tie_word_embeddings=False)),
    # Llama 4 (Scout-like): MoE on layers 1 and 3 (interleave 2) between wider dense MLPs, NoPE on layers 1 and 3
    # (queries scaled by the temperature from position 1: floor_scale 2), 4-position chunks on layers 0 and 2 under
    # 12-token inputs with the weightless q/k norm, llama3 RoPE on adjacent pairs, top-1 sigmoid weighting the input
    "llama4_text": ("llama4_text", dict(num_local_experts=4, intermediate_size=16, intermediate_size_mlp=48,
                                        num_hidden_layers=4, interleave_moe_layer_step=2, no_rope_layer_interval=2,
                                        attention_chunk_size=4, floor_scale=2, attn_scale=0.5, head_dim=8,
                                        rope_parameters=LLAMA3)),
    # Maverick-like: no q/k norm, no temperature, every layer MoE, the 4th layer NoPE, no chunks, attention biases
    "llama4_text-maverick": ("llama4_text", dict(num_local_experts=4, intermediate_size=16, num_hidden_layers=4,
                                                 use_qk_norm=False, attn_temperature_tuning=False,
                                                 attention_chunk_size=None, attention_bias=True, head_dim=8)),
    # every layer RoPE'd (the NoPE interval past the layers) and chunked, the q/k norm on all of them
    "llama4_text-all-rope": ("llama4_text", dict(num_local_experts=4, intermediate_size=16, num_hidden_layers=3,
                                                 no_rope_layer_interval=8, attention_chunk_size=5, head_dim=8)),
    "llama": ("llama", dict(rope_parameters=LLAMA3)),
    # attention_bias: biases on q/k/v and o_proj (attention_bias + attention_out_bias in moekit)
    "llama-bias": ("llama", dict(attention_bias=True)),
    "qwen3_moe-bias": ("qwen3_moe", dict(QWEN_MOE, attention_bias=True)),
    "olmoe-bias": ("olmoe", dict(num_experts=4, num_experts_per_tok=2, attention_bias=True)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=32, max_window_layers=0)),
    "qwen3": ("qwen3", dict(head_dim=16, rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0))),
}
TEXT = "the quick brown fox jumps over the lazy dog while the dog sleeps"


def hf_family_model(folder: Path, model_type: str, overrides: dict, seed: int = 0):
    """A random tiny transformers model of ``model_type`` saved with save_pretrained; returns it."""
    cfg = transformers.AutoConfig.for_model(model_type, **{**SIZES, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # transformers starts every norm at 1: a swapped or dropped norm would not show
                p.normal_(1.0, 0.2)
            elif name.endswith(("bias", "sinks")):  # and biases at 0: a dropped bias would not show either
                p.normal_(0.0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # the bias must change which experts win
                b.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory) -> Path:
    """tokenizer.json (a BPE trained here with the tokenizers library) + tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("tokenizer")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(vocab_size=VOCAB, show_progress=False,
                                                             special_tokens=["<unk>", "<|endoftext|>"]))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "unk_token": "<unk>"}))
    return folder


def check_tokenizer(folder: Path, tokenizer_files: Path, eos: str = "<|endoftext|>") -> None:
    from tokenizers import Tokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    assert tok(TEXT).input_ids == Tokenizer.from_file(str(tokenizer_files / "tokenizer.json")).encode(TEXT).ids
    assert tok.eos_token == eos


def test_kimi_k2_imports_as_deepseek_v3_and_exports_for_transformers(tmp_path):
    """Kimi K2 is DeepseekV3ForCausalLM under model_type "kimi_k2" with a remote-code tiktoken tokenizer: it
    imports as deepseek_v3 (transformers' logits), records that family, and exports a folder transformers
    loads without remote code; the tokenizer's files and the code its auto_map names come along."""
    src, out = tmp_path / "kimi", tmp_path / "out"
    hf = hf_family_model(src, "deepseek_v3", dict(MLA, q_lora_rank=16, first_k_dense_replace=1, num_hidden_layers=3,
                                                  n_group=1, topk_group=1, num_experts_per_tok=3,
                                                  routed_scaling_factor=2.827))
    edit_config(src, model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    (src / "tiktoken.model").write_bytes(torch.randint(0, 256, (300,), dtype=torch.uint8).numpy().tobytes())
    (src / "tokenization_kimi.py").write_text("# the tokenizer's remote code\n")
    (src / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": [
        "tokenization_kimi.TikTokenTokenizer", None], "AutoProcessor": "other/repo--processing.P"}}))
    model = load_hf(src)
    toks = tokens()
    with torch.no_grad():
        assert rel_err(model(toks), hf_logits(hf, toks)) < 1e-5
    assert model.config.name == "hf:deepseek_v3" and model.hf_family == "deepseek_v3"
    save_hf(model, out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(hf)
    assert rel_err(hf_logits(back, toks), hf_logits(hf, toks)) < 1e-5
    for name in ("tiktoken.model", "tokenization_kimi.py", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    assert not (out / "processing.py").exists()


def add_mtp_layer(folder: Path, layer: int) -> dict[str, torch.Tensor]:
    """A multi-token-prediction layer as the releases store it: a transformer block at index ``layer`` (here a
    perturbed copy of the last one), its two input norms, the [H, 2H] projection, its final norm, and copies of
    the embedding and the head. Returns the tensors added."""
    added = {}

    def add(t: dict) -> None:
        H = t["model.embed_tokens.weight"].shape[1]
        last = f"model.layers.{layer - 1}."
        for k, v in list(t.items()):
            if k.startswith(last):
                added[f"model.layers.{layer}." + k[len(last):]] = v + 0.1 * torch.randn(v.shape)
        added.update({f"model.layers.{layer}.{k}": v for k, v in (
            ("eh_proj.weight", torch.randn(H, 2 * H) / H), ("enorm.weight", 1 + 0.2 * torch.randn(H)),
            ("hnorm.weight", 1 + 0.2 * torch.randn(H)), ("shared_head.norm.weight", 1 + 0.2 * torch.randn(H)),
            ("embed_tokens.weight", t["model.embed_tokens.weight"].clone()),
            ("shared_head.head.weight", t.get("lm_head.weight", t["model.embed_tokens.weight"]).clone()))})
        t.update(added)
    edit_tensors(folder, add)
    return added


@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_family_round_trip(tmp_path, tokenizer_files, case):
    model_type, overrides = FAMILY_CASES[case]
    src, out = tmp_path / "hf", tmp_path / "out"
    hf = hf_family_model(src, model_type, overrides)
    for f in tokenizer_files.iterdir():  # a checkpoint folder carries its tokenizer
        shutil.copy(f, src)
    L = hf.config.num_hidden_layers
    mtp_family = model_type in ("deepseek_v3", "glm4_moe", "glm4_moe_lite")  # their releases carry multi-token-prediction layers
    if mtp_family:
        edit_config(src, num_nextn_predict_layers=1)
        added = add_mtp_layer(src, L)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_hf(src)
    assert not [str(w.message) for w in caught if "multi-token-prediction" in str(w.message)]
    assert model.config.mtp_layers == mtp_family  # the layer loads into the model's MTP depth (models.mtp)
    toks = tokens()
    ref = hf_logits(hf, toks)
    with torch.no_grad():
        assert rel_err(model(toks), ref) < 1e-5
    assert model.config.name == f"hf:{model_type}" and model.hf_family == model_type

    save_hf(model, out)  # its own family, with the tokenizer of the folder it came from
    assert json.loads((out / "config.json").read_text())["model_type"] == model_type
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(hf)
    assert rel_err(hf_logits(back, toks), ref) < 1e-5
    check_tokenizer(out, tokenizer_files)
    if mtp_family:  # the MTP layer is written back as it came (but for its copies of the shared tensors)
        written = {}
        for f in out.glob("*.safetensors"):
            written.update(load_file(f))
        assert {k for k in written if k.startswith(f"model.layers.{L}.")} == set(added)
        for k in added:  # the embedding / head copies too: they are the main ones, as in the release
            assert torch.equal(written[k], added[k]), k
        assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
        with warnings.catch_warnings(record=True) as caught:  # a model without the depth leaves it out, saying so
            warnings.simplefilter("always")
            plain = build_model(dataclasses.replace(model.config, mtp_layers=0))
            load_hf_into(plain, src)
        assert any(f"model.layers.{L}.*" in str(w.message) and "mtp_layers=0" in str(w.message) for w in caught)
        with torch.no_grad():
            assert rel_err(plain(toks), ref) < 1e-5
        for copy in ("shared_head.head.weight", "embed_tokens.weight"):  # a copy that is not the main tensor
            key = f"model.layers.{L}.{copy}"
            edit_tensors(src, lambda t: t.update({key: t[key].clone().index_fill_(0, torch.tensor([3]), 0.5)}))
            for load in (load_hf, lambda p: load_hf_sharded(build_model(model.config), p)):  # whole / by slices
                with pytest.raises(ValueError, match=rf"{key}, the multi-token-prediction layer's copy of "
                                                     r".* differs from it; .* --model\.mtp_layers 0"):
                    load(src)
            edit_tensors(src, lambda t: t.update({key: added[key]}))
    if mtp_family:  # without num_nextn_predict_layers the extra layer is a mismatch
        edit_config(src, num_nextn_predict_layers=0)
        with pytest.raises(ValueError, match=rf"num_hidden_layers={L} but the checkpoint has layers 0\.\.{L} "):
            load_hf(src)


@pytest.mark.parametrize("case,change", [
    ("glm4_moe", "no_partial_factor"),  # transformers' Glm4Moe then rotates half of each head
    ("glm4_moe", "no_shared_experts"),  # n_shared_experts 0: transformers saves [0, H] shared-expert tensors
    ("deepseek_v3-fullq", "no_shared_experts"),
])
def test_config_defaults_and_empty_tensors_import_as_transformers_reads_them(tmp_path, case, change):
    model_type, overrides = FAMILY_CASES[case]
    if change == "no_shared_experts":
        overrides = {**overrides, "n_shared_experts": 0}
    hf_family_model(tmp_path, model_type, overrides)
    if change == "no_partial_factor":
        cfg = json.loads((tmp_path / "config.json").read_text())
        found = [cfg.pop("partial_rotary_factor", None), (cfg.get("rope_parameters") or {}).pop("partial_rotary_factor",
                                                                                                 None)]
        assert any(f is not None for f in found)  # the key was there, and is gone now
        (tmp_path / "config.json").write_text(json.dumps(cfg))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ours = load_hf(tmp_path)
    assert ours.config.partial_rotary_factor == (0.5 if model_type == "glm4_moe" else 1.0)
    assert (ours.config.shared_ffn_hidden_size == 0) == (change == "no_shared_experts")
    with torch.no_grad():
        assert rel_err(ours(tokens()), hf_logits(theirs, tokens())) < 1e-5


def write_hf_config(folder: Path, model_type: str, **changes) -> Path:
    """config.json of a tiny ``model_type`` with ``changes`` written as given (no transformers validation)."""
    folder.mkdir()
    cfg = {**transformers.AutoConfig.for_model(model_type, **SIZES).to_dict(), **changes}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("model_type,changes,patterns", [
    ("llama", dict(attention_bias=True, mlp_bias=True, partial_rotary_factor=0.5),
     [r"mlp_bias=true", r"partial_rotary_factor=0\.5"]),
    ("qwen2_moe", dict(QWEN_MOE, num_hidden_layers=4, mlp_only_layers=[2]),
     [r"MoE layers \[0, 1, 3\] of 4 .* per-layer MoE/dense list"]),
    ("qwen3_moe", dict(QWEN_MOE, attention_bias=True, hidden_act="gelu"), [r"hidden_act='gelu'"]),
    ("deepseek_v3", dict(MLA, moe_layer_freq=2, attention_bias=True, scoring_func="softmax",
                         rope_parameters={"rope_type": "longrope", "rope_theta": 1e4},
                         quantization_config={"quant_method": "awq", "bits": 4}),
     [r"moe_layer_freq=2", r"MLA's q_a / kv_a / o", r"scoring_func='softmax'", r"rope_type='longrope'",
      r"quant_method='awq'"]),
    ("olmoe", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
     [r"rope_type='dynamic'"]),
])
def test_unsupported_features_are_named(tmp_path, model_type, changes, patterns):
    folder = write_hf_config(tmp_path / "cfg", model_type, **changes)
    with pytest.raises(UnsupportedCheckpoint) as err:
        config_from_hf(folder)
    assert len(str(err.value).splitlines()) == len(patterns) + 1  # one line per missing feature
    for pattern in patterns:
        assert re.search(pattern, str(err.value)), (pattern, str(err.value))


# ---------------------------------------------------------------------------------------------------
# Native moekit models: the nearest family that reproduces them, or a refusal with the reasons
# ---------------------------------------------------------------------------------------------------

MLA_MOEKIT = dict(attention="mla", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                  num_experts=8, num_layers=3, first_dense_layers=1, ffn_hidden_size=40)
NATIVE = {  # case -> (family asked for or None, moekit config overrides); the family written is case's prefix
    "qwen3_moe": (None, dict(qk_norm="head", head_dim=12, num_layers=3, moe_every=2, ffn_hidden_size=40,
                             router_options={"normalize": False})),
    "olmoe": (None, dict(qk_norm="full", qkv_clip=0.4, top_k=1, router_options={})),
    "qwen2_moe": (None, dict(attention_bias=True, shared_ffn_hidden_size=20, shared_expert_gate=True, num_layers=3,
                             first_dense_layers=1, ffn_hidden_size=40)),
    "qwen2_moe-zero-shared": (None, dict(router_options={"normalize": False})),  # plain softmax top-k, no renorm
    "qwen2_moe-asked": ("qwen2_moe", dict()),  # Mixtral-like, written as Qwen2-MoE on request
    # sigmoid routing without expert_bias or shared expert (both written as zeros); moekit's group score
    # (top top_k // group_top_k = 2) is DeepSeek's
    "deepseek_v3": (None, dict(MLA_MOEKIT, q_lora_rank=12, top_k=4, rope_scaling={k: v for k, v in YARN.items()
                                                                                   if k != "rope_theta"},
                               router_options={"score": "sigmoid", "num_groups": 4, "group_top_k": 2,
                                               "scaling": 2.0})),
    "deepseek_v3-bias-shared": (None, dict(MLA_MOEKIT, top_k=3, rope_interleave=False, shared_ffn_hidden_size=48,
                                           router_options={"score": "sigmoid", "expert_bias": True, "num_groups": 4,
                                                           "group_top_k": 2, "group_score_top": 2,
                                                           "normalize": False})),
    # GQA with sigmoid routing: GLM-4-MoE's MoE (the selection bias and the shared expert it lacks: zeros)
    "glm4_moe": (None, dict(router_options={"score": "sigmoid", "scaling": 1.5})),
    "glm4_moe-partial": (None, dict(partial_rotary_factor=0.5, attention_bias=True, qk_norm="head", num_layers=3,
                                    first_dense_layers=1, ffn_hidden_size=40, shared_ffn_hidden_size=48,
                                    router_options={"score": "sigmoid", "expert_bias": True, "num_groups": 2,
                                                    "group_top_k": 1, "group_score_top": 2})),
    # MLA with MoE on every other layer: DeepSeek-V3 cannot say it (first_k_dense_replace), GLM-4.7-Flash can
    "glm4_moe_lite": (None, dict(MLA_MOEKIT, num_layers=4, moe_every=2, top_k=3, shared_ffn_hidden_size=24,
                                 ffn_hidden_size=40, router_options={"score": "sigmoid", "expert_bias": True,
                                                                     "num_groups": 4, "group_top_k": 2,
                                                                     "group_score_top": 2, "scaling": 1.8})),
    # adjacent RoPE pairs: only ERNIE 4.5 has them (its selection bias, [1, E], written as zeros; no shared expert)
    "ernie4_5_moe": (None, dict(rope_pairs="adjacent")),
    "ernie4_5_moe-bias-shared": (None, dict(rope_pairs="adjacent", num_layers=3, first_dense_layers=1,
                                            ffn_hidden_size=40, shared_ffn_hidden_size=48, tie_embeddings=True,
                                            router_options={"normalize": True, "expert_bias": True})),
    "llama": (None, dict(num_experts=0, rope_scaling={k: v for k, v in LLAMA3.items() if k != "rope_theta"})),
    "qwen2": (None, dict(num_experts=0, attention_bias=True)),
    "qwen3": (None, dict(num_experts=0, qk_norm="head", tie_embeddings=True)),
}


@torch.no_grad()
def perturb(model) -> None:
    """Norms away from 1 and selection biases away from 0, so that every one of them matters."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if "norm" in name:
            t.normal_(1.0, 0.2)
        elif name.endswith("expert_bias"):
            t.normal_(0.0, 0.3)


@pytest.mark.parametrize("case", list(NATIVE))
def test_native_model_exports_as_nearest_family(tmp_path, case):
    asked, overrides = NATIVE[case]
    model = build_model(moekit_mixtral(**overrides), seed=2).eval()
    perturb(model)
    family = case.split("-")[0]
    assert check_hf_exportable(model, asked) == family
    save_hf(model, tmp_path, family=asked)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == family
    toks = tokens(3)
    with torch.no_grad():
        want = model(toks)
        assert rel_err(hf_logits(AutoModelForCausalLM.from_pretrained(tmp_path).eval(), toks), want) < 1e-5
        assert rel_err(load_hf(tmp_path)(toks), want) < 1e-6  # zero-filled parts add nothing


@pytest.mark.parametrize("overrides,family,patterns", [
    (dict(router_options={"score": "sigmoid"}, qkv_clip=0.5), None,
     [r"no HuggingFace family reproduces", r"Mixtral: .*is not a softmax top-k router",
      r"DeepSeek-V3: DeepSeek-V3 has multi-head latent attention", r"GLM-4-MoE: GLM-4-MoE does not clip q/k/v"]),
    (dict(partial_rotary_factor=0.5), "qwen3_moe",
     [r"Qwen3-MoE rotates every channel of a head; this model has partial_rotary_factor=0\.5"]),
    (dict(qk_norm="head"), "mixtral", [r"Mixtral cannot reproduce this model: Mixtral has qk_norm='none'; this "
                                       r"model has qk_norm='head'"]),
    (dict(shared_ffn_hidden_size=16), "qwen2_moe", [r"shared expert is sigmoid-gated; this model's has no gate"]),
    (dict(num_experts=0), "mixtral", [r"Mixtral is an MoE family; this model has no experts"]),
    (dict(attention_bias=True), "qwen3_moe", [r"Qwen3-MoE's attention_bias puts biases on q/k/v and o alike; this "
                                              r"model has attention_bias=True, attention_out_bias=False"]),
    (dict(attention_bias=True, attention_out_bias=True), "qwen2_moe", [r"Qwen2-MoE has no o_proj bias"]),
    (dict(attention_out_bias=True), "mixtral", [r"Mixtral has no attention biases"]),
    (dict(rope_pairs="adjacent"), "mixtral", [r"Mixtral's RoPE rotates channel i with channel i \+ R/2; this model "
                                              r"has rope_pairs='adjacent'"]),
    (dict(), "ernie4_5_moe", [r"ERNIE-4\.5-MoE's RoPE rotates adjacent channel pairs; this model has "
                              r"rope_pairs='half'"]),
    (dict(rope_pairs="adjacent", num_layers=3, first_dense_layers=1, moe_every=2,
          router_options={"normalize": False}), "ernie4_5_moe",
     [r"first_dense_layers=1, which is not a multiple of moe_every=2",
      r"does not renormalise the top-k weights \(normalize=False\); ERNIE 4\.5 always does"]),
    (dict(router="switch", top_k=1, router_options={}, qk_norm="head"), "qwen3_moe", [r"jitter=0\.01 noise"]),
    (dict(name="hf:olmoe"), None, [r"imported from olmoe but no longer matches it: OLMoE has qk_norm='full'"]),
    (dict(attention="mla", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
          router_options={"score": "sigmoid", "num_groups": 2, "group_top_k": 1, "group_score_top": 1}),
     "deepseek_v3", [r"scores a group by its top 1 experts; DeepSeek-V3 by its top 2 \(router option "
                     r"group_score_top=2\)"]),
])
def test_export_refusals(tmp_path, overrides, family, patterns):
    with pytest.raises(ValueError) as err:
        save_hf(build_model(moekit_mixtral(**overrides)), tmp_path, family=family)
    for pattern in patterns:
        assert re.search(pattern, str(err.value)), (pattern, str(err.value))
    assert not (tmp_path / "config.json").exists()


def test_run_tokenizer_exports(tmp_path):
    """A moekit run's byte tokenizer becomes a byte-level tokenizer.json: ids 0-255 = UTF-8 bytes, EOS 256."""
    from moekit.train.tokens import TokenizerInfo, record_tokenizer

    model = build_model(moekit_mixtral(vocab_size=260))
    run = tmp_path / "run"
    run.mkdir()
    record_tokenizer(run, TokenizerInfo("bytes", "bytes", None, 257, 256))
    save_hf(model, tmp_path / "out", tokenizer_from=run)
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "héllo, wörld ✓ <tag>"
    ids = tok(text).input_ids
    assert ids == list(text.encode()) and tok.decode(ids) == text
    assert tok.eos_token_id == 256 and json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == 256
    record_tokenizer(run, TokenizerInfo("unknown", None, None, 257, None))
    with pytest.raises(ValueError, match=r"without tokenizer metadata \(kind 'unknown'\)"):
        save_hf(model, tmp_path / "out2", tokenizer_from=run)
    with pytest.raises(ValueError, match=r"no tokenizer files"):
        save_hf(model, tmp_path / "out3", tokenizer_from=tmp_path / "out2")

# ---------------------------------------------------------------------------------------------------
# tools/convert.py
# ---------------------------------------------------------------------------------------------------


def test_convert_round_trip(base, tmp_path, tokenizer_files, capsys):
    import torch.distributed.checkpoint as dcp

    from moekit.train.convert import main
    from moekit.train.modelfiles import load_moekit
    from moekit.train.tokens import TokenizerInfo, record_tokenizer, sha256_file

    hf = MixtralForCausalLM.from_pretrained(base).eval()
    for name in ("model.safetensors", "model.pt"):
        assert main(["hf-to-moekit", str(base), str(tmp_path / name), "--verify"]) == 0
        with torch.no_grad():
            assert rel_err(load_moekit(tmp_path / name)(tokens()), hf_logits(hf, tokens())) < 1e-4
    # A tools/train.py checkpoint: DCP state {"model", "optim", "train"} + meta.json with the model config,
    # in a run directory that recorded its tokenizer.
    model = load_moekit(tmp_path / "model.pt")
    assert model.config.name == "hf:mixtral"  # the family survives the moekit file
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_000001"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model.state_dict(), "train": {"step": 1}}, checkpoint_id=str(step))
    (step / "meta.json").write_text(json.dumps({"format": 1, "step": 1, "model": model.config.to_dict()}))
    tok_file = tokenizer_files / "tokenizer.json"
    record_tokenizer(run, TokenizerInfo("hf", str(tok_file), sha256_file(str(tok_file)), VOCAB, 1, str(tok_file)))
    assert main(["moekit-to-hf", str(step), str(tmp_path / "hf"), "--layout", "fused", "--verify"]) == 0
    back = MixtralForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert rel_err(hf_logits(back, tokens()), hf_logits(hf, tokens())) < 1e-4
    check_tokenizer(tmp_path / "hf", tokenizer_files)
    out = capsys.readouterr().out
    assert "verified" in out and f"(mixtral, fused experts, tokenizer from {run})" in out
    # Another family on request (a zero shared expert), the tokenizer from the HF folder it came from
    assert main(["moekit-to-hf", str(tmp_path / "model.safetensors"), str(tmp_path / "qwen"), "--family",
                 "qwen2_moe", "--tokenizer", str(tokenizer_files), "--verify"]) == 0
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "qwen").eval()
    assert back.config.model_type == "qwen2_moe" and rel_err(hf_logits(back, tokens()), hf_logits(hf, tokens())) < 1e-4
    check_tokenizer(tmp_path / "qwen", tokenizer_files)


def test_convert_names_every_family_without_torch():
    """moekit-convert lists the families for --family without importing the models: the list must be theirs."""
    from moekit.models.hf import FAMILIES
    from moekit.train.convert import HF_FAMILIES

    assert sorted(HF_FAMILIES) == sorted(FAMILIES)


def test_convert_rejects_wrong_inputs(base, tmp_path, capsys):
    from moekit.train.convert import main

    assert main(["moekit-to-hf", str(base / "model.safetensors"), str(tmp_path / "x")]) == 2
    assert "not a moekit model file; for a HuggingFace folder use 'hf-to-moekit'" in capsys.readouterr().err
    assert main(["hf-to-moekit", str(base), str(tmp_path / "model.bin")]) == 2
    assert "name the output *.safetensors or *.pt" in capsys.readouterr().err



@pytest.fixture(scope="module")
def moekit_pt(base, tmp_path_factory) -> Path:
    """``base`` as a moekit model file (what hf-to-moekit writes), for the moekit-to-hf refusals."""
    from moekit.train.modelfiles import save_moekit

    return save_moekit(load_hf(base), tmp_path_factory.mktemp("moekit_pt") / "model.pt")


def convert_refuses(capsys, argv: list, *words: str) -> str:
    """moekit-convert ``argv`` exits 2 with one line on stderr holding every one of ``words``."""
    from moekit.train.convert import main

    capsys.readouterr()  # only what this call writes
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and all(w in err[0] for w in words), (rc, err)
    return err[0]


def test_convert_refuses_an_unreadable_pt_file(moekit_pt, tmp_path, capsys):
    truncated, garbage = tmp_path / "truncated.pt", tmp_path / "garbage.pt"
    truncated.write_bytes(moekit_pt.read_bytes()[:1000])
    garbage.write_text("hello\n")
    for bad in (truncated, garbage):
        convert_refuses(capsys, ["moekit-to-hf", bad, tmp_path / "out"], f"{bad}: unreadable (truncated, or not a "
                        f"file torch.save wrote", "write it again with 'moekit-convert hf-to-moekit")
    convert_refuses(capsys, ["moekit-to-hf", tmp_path / "nonexist.safetensors", tmp_path / "out"],
                    "nonexist.safetensors: no such file or directory; pass a moekit model file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["garbage.pt", "truncated.pt"]  # no OUT made


def test_convert_checks_out_before_reading_the_model(base, moekit_pt, tmp_path, capsys, monkeypatch):
    import errno
    import os

    (tmp_path / "tiny.txt").write_text("hi")
    (tmp_path / "ro").mkdir()
    real_open = os.open

    def read_only(path, *args, **kwargs):  # the machine runs as root: chmod makes no read-only folder
        if str(path).startswith(str(tmp_path / "ro")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    monkeypatch.setattr("moekit.train.modelfiles.load_hf", lambda *a, **k: pytest.fail("read the model before OUT"))
    for name in ("x.safetensors", "x.pt"):  # safetensors and torch.save would fail with tracebacks of their own
        convert_refuses(capsys, ["hf-to-moekit", base, tmp_path / "ro" / name], f"OUT {tmp_path / 'ro' / name}: "
                        f"folder {tmp_path / 'ro'}: not writable: Read-only file system", "choose another folder")
        convert_refuses(capsys, ["hf-to-moekit", base, tmp_path / "tiny.txt" / name],
                        f"OUT {tmp_path / 'tiny.txt' / name}: {tmp_path / 'tiny.txt'} is a file, not a folder; "
                        f"choose another OUT")
    convert_refuses(capsys, ["hf-to-moekit", base, tmp_path / "ro"], "OUT", "name the output *.safetensors or *.pt")
    convert_refuses(capsys, ["moekit-to-hf", moekit_pt, tmp_path / "ro" / "hf"],
                    f"OUT {tmp_path / 'ro' / 'hf'}: not writable: Read-only file system", "choose another OUT")
    convert_refuses(capsys, ["moekit-to-hf", moekit_pt, tmp_path / "tiny.txt"],
                    f"OUT {tmp_path / 'tiny.txt'}: an existing file; moekit-to-hf writes a folder",
                    "choose another OUT")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ro", "tiny.txt"] and not any((tmp_path / "ro").iterdir())


def test_convert_names_the_flags_before_reading_the_model(moekit_pt, tmp_path, capsys, monkeypatch):
    from moekit.models.hf.io import parse_size

    monkeypatch.setattr("moekit.train.modelfiles.load_moekit", lambda *a: pytest.fail("read the model first"))
    (tmp_path / "empty").mkdir()
    for argv, words in ((["--tokenizer", tmp_path / "nonexist"], (f"--tokenizer {tmp_path / 'nonexist'}: no such "
                                                                  f"directory; pass a HuggingFace model folder",)),
                        (["--tokenizer", tmp_path / "empty"], (f"--tokenizer {tmp_path / 'empty'}: no tokenizer "
                                                               f"files", "pass --tokenizer the folder")),
                        (["--max-shard-size", "0"], ("--max-shard-size 0: not a size; use a positive number",)),
                        (["--max-shard-size", "5XB"], ("--max-shard-size 5XB: not a size",))):
        convert_refuses(capsys, ["moekit-to-hf", moekit_pt, tmp_path / "out", *argv], *words)
    assert [p.name for p in tmp_path.iterdir()] == ["empty"]  # no OUT made
    assert (parse_size("1000000"), parse_size("2KiB"), parse_size(" 1.5 kb ")) == (10**6, 2048, 1500)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A moekit-train run directory with one checkpoint (the trainer's tiny native model)."""
    from moekit.train.loop import main
    from tests.tiny import TINY_MODEL

    run = tmp_path_factory.mktemp("trained") / "run"
    assert main([*TINY_MODEL, "--run-dir", str(run), "--steps", "1", "--checkpoint.every", "1"]) == 0
    return run


def test_convert_takes_a_run_directory_and_refuses_one_as_out(trained_run, moekit_pt, tmp_path, capsys):
    from moekit.train.convert import main

    step = sorted((trained_run / "checkpoints").iterdir())[-1]
    assert main(["moekit-to-hf", str(trained_run), str(tmp_path / "hf")]) == 0  # as moekit-generate takes one
    assert f"its newest checkpoint, {step}" in capsys.readouterr().out
    assert (tmp_path / "hf" / "tokenizer.json").is_file()  # the run's recorded tokenizer went along
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.num_hidden_layers == 2
    before = {p.name: p.read_bytes() for p in trained_run.iterdir() if p.is_file()}
    convert_refuses(capsys, ["moekit-to-hf", moekit_pt, trained_run], f"OUT {trained_run} is a moekit-train run "
                    f"directory", "choose another folder")
    assert {p.name: p.read_bytes() for p in trained_run.iterdir() if p.is_file()} == before
    empty = tmp_path / "empty_run"
    (empty / "checkpoints").mkdir(parents=True)
    convert_refuses(capsys, ["moekit-to-hf", empty, tmp_path / "out"], f"{empty}: no checkpoint in")


def test_load_hf_into_checks_the_model_config(base):
    from moekit.models.hf import config_from_hf, load_hf_into

    cfg = config_from_hf(base)
    cfg.capacity_factor, cfg.aux_loss_coeff, cfg.max_seq_len = 2.0, 0.05, 32  # training fields may differ
    cfg.ffn_hidden_size += 8  # the dense FFN width is unused when every layer is MoE (Mixtral)
    model = build_model(cfg, seed=3)
    load_hf_into(model, base)
    hf = MixtralForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():
        assert rel_err(model.eval()(tokens()), hf_logits(hf, tokens())) < 1e-4
    cfg.top_k, cfg.rope_theta = 1, 1e4
    with pytest.raises(ValueError, match=r"rope_theta=10000.0 \(model\) vs 1000000.0 \(checkpoint\); top_k=1"):
        load_hf_into(build_model(cfg), base)


@pytest.mark.parametrize("content,match", [(b"[1, 2]", "holds a JSON list, not the object of a model config"),
                                           (b"{nope", "not valid JSON"), (b"\xff\xfe", "not valid JSON")])
def test_a_config_json_that_is_not_an_object_is_named(tmp_path, content, match):
    from moekit.models.hf import load_hf

    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ValueError, match=match):
        load_hf(tmp_path)
