"""moekit.models.hf (models/hf/) against transformers itself: tiny random checkpoints made locally with save_pretrained.

Parity: moekit's logits equal transformers' (fp32, relative error < 1e-4) for imports, and transformers
loads moekit's exports with moekit's logits. Corrupt and mismatched folders fail with errors naming the
key, the shapes and the fix. Router semantics of the families the model cannot import whole yet
(Qwen2-MoE shared-expert gate, DeepSeek-V3 group-limited sigmoid routing) are checked block by block.
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
from transformers import MixtralConfig, MixtralForCausalLM

from moekit.models.config import ModelConfig
from moekit.models.hf import UnsupportedCheckpoint, config_from_hf, load_hf, load_mixtral, save_mixtral
from moekit.models.hf.families import DEEPSEEK_V3, QWEN2_MOE, deepseek_router_options, qwen_router_options
from moekit.models.hf.weights import moe_rules
from moekit.models.transformer import build_model
from moekit.moe import MoELayer, build_router

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
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), r"rope_type='yarn'"),
    (dict(model_type="llama"), r"model_type='llama' is not supported"),
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
    with pytest.raises(ValueError, match=r"MoE FFN in every layer; this model has 1 of 2"):
        save_mixtral(build_model(moekit_mixtral(moe_every=2)), tmp_path)
    with pytest.raises(ValueError, match=r"drops tokens \(capacity_factor=1.25\)"):
        save_mixtral(build_model(moekit_mixtral(capacity_factor=1.25)), tmp_path)
    with pytest.raises(ValueError, match=r"not a softmax top-k router"):
        save_mixtral(build_model(moekit_mixtral(router_options={"score": "sigmoid"})), tmp_path)
    assert not (tmp_path / "config.json").exists()


# ---------------------------------------------------------------------------------------------------
# Other families: unsupported features are named; MoE block semantics match block by block
# ---------------------------------------------------------------------------------------------------

QWEN_SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                  num_experts_per_tok=2, initializer_range=0.1)
HAS_SHARED_GATE = "shared_expert_gate" in {f.name for f in dataclasses.fields(ModelConfig)}


def test_unsupported_features_are_named(tmp_path):
    from transformers import DeepseekV3Config, Qwen2MoeConfig, Qwen3MoeConfig

    cases = [
        (Qwen3MoeConfig(**QWEN_SIZES), [r"q/k RMSNorm", r"qk_norm"]),
        (Qwen2MoeConfig(**QWEN_SIZES, qkv_bias=True), [r"attention biases", r"attention_bias: bool"]),
        (DeepseekV3Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, n_routed_experts=8, n_group=2,
                          topk_group=1, num_experts_per_tok=2), [r"multi-head latent attention"]),
        (Qwen2MoeConfig(**{**QWEN_SIZES, "num_hidden_layers": 4}, qkv_bias=False, mlp_only_layers=[2]),
         [r"MoE layers \[0, 1, 3\] of 4", r"moe_layers"]),
    ]
    for i, (cfg, patterns) in enumerate(cases):
        cfg.save_pretrained(tmp_path / str(i))
        with pytest.raises(UnsupportedCheckpoint) as err:
            config_from_hf(tmp_path / str(i))
        for pattern in patterns:
            assert re.search(pattern, str(err.value)), (pattern, str(err.value))


def load_block(layer: MoELayer, hf_block: torch.nn.Module, naming, fused: bool = True) -> None:
    """Fill a moekit MoELayer from a transformers sparse block through the importer's own rules."""
    hf_state = {f"b.{k}": v for k, v in hf_block.state_dict().items()}
    state = layer.state_dict()
    with torch.no_grad():
        for rule in moe_rules("m", "b", layer, naming, fused):
            state[rule.target.removeprefix("m.")].copy_(rule.join([hf_state[s] for s in rule.sources]))


def test_qwen2_moe_block_matches(tmp_path):
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    for norm_topk_prob in (False, True):
        cfg = Qwen2MoeConfig(**QWEN_SIZES, shared_expert_intermediate_size=40, norm_topk_prob=norm_topk_prob)
        torch.manual_seed(0)
        block = Qwen2MoeSparseMoeBlock(cfg).eval()
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.1)  # HF zero-inits the router; random weights route for real
        router = build_router("topk", 32, 4, top_k=2, aux_loss_coeff=0.0, **qwen_router_options(cfg.to_dict()))
        layer = MoELayer(32, 24, 4, router, shared_ffn_hidden_size=40, shared_expert_gate=True).eval()
        load_block(layer, block, QWEN2_MOE)
        x = torch.randn(2, SEQ, 32)
        with torch.no_grad():
            assert rel_err(layer(x), block(x)) < 1e-5


def test_deepseek_v3_moe_block_matches():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    for E, groups, topk_group, k in ((8, 2, 1, 2), (8, 4, 2, 4)):
        cfg = DeepseekV3Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=E, n_shared_experts=2,
                               n_group=groups, topk_group=topk_group, num_experts_per_tok=k, norm_topk_prob=True,
                               routed_scaling_factor=2.5)
        torch.manual_seed(0)
        block = DeepseekV3MoE(cfg).eval()
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.1)
        block.gate.e_score_correction_bias.normal_(0.0, 0.3)  # the bias must change which experts win
        problems: list[str] = []
        options = deepseek_router_options(cfg.to_dict(), problems)
        assert not problems and options["num_groups"] == groups and options["scaling"] == 2.5
        router = build_router("topk", 32, E, top_k=k, aux_loss_coeff=0.0, **options)
        layer = MoELayer(32, 16, E, router, shared_ffn_hidden_size=32).eval()
        load_block(layer, block, DEEPSEEK_V3)
        x = torch.randn(2, SEQ, 32)
        with torch.no_grad():
            assert rel_err(layer(x), block(x)) < 1e-5


@pytest.mark.skipif(not HAS_SHARED_GATE, reason="ModelConfig has no shared_expert_gate field yet (see docs/hf.md)")
def test_qwen2_moe_import_matches_transformers(tmp_path):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(**QWEN_SIZES, shared_expert_intermediate_size=40, qkv_bias=False, norm_topk_prob=True)
    hf = Qwen2MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path)
    with torch.no_grad():
        assert rel_err(load_hf(tmp_path)(tokens()), hf_logits(hf, tokens())) < 1e-4


# ---------------------------------------------------------------------------------------------------
# tools/convert.py
# ---------------------------------------------------------------------------------------------------


def test_convert_round_trip(base, tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    from moekit.train.convert import load_moekit, main

    hf = MixtralForCausalLM.from_pretrained(base).eval()
    for name in ("model.safetensors", "model.pt"):
        assert main(["hf-to-moekit", str(base), str(tmp_path / name), "--verify"]) == 0
        with torch.no_grad():
            assert rel_err(load_moekit(tmp_path / name)(tokens()), hf_logits(hf, tokens())) < 1e-4
    # A tools/train.py checkpoint: DCP state {"model", "optim", "train"} + meta.json with the model config.
    model = load_moekit(tmp_path / "model.pt")
    step = tmp_path / "run" / "checkpoints" / "step_000001"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model.state_dict(), "train": {"step": 1}}, checkpoint_id=str(step))
    (step / "meta.json").write_text(json.dumps({"format": 1, "step": 1, "model": model.config.to_dict()}))
    assert main(["moekit-to-hf", str(step), str(tmp_path / "hf"), "--layout", "fused", "--verify"]) == 0
    back = MixtralForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert rel_err(hf_logits(back, tokens()), hf_logits(hf, tokens())) < 1e-4
    assert "verified" in capsys.readouterr().out


def test_convert_rejects_wrong_inputs(base, tmp_path, capsys):
    from moekit.train.convert import main

    assert main(["moekit-to-hf", str(base / "model.safetensors"), str(tmp_path / "x")]) == 2
    assert "not a moekit model file; for a HuggingFace folder use 'hf-to-moekit'" in capsys.readouterr().err
    assert main(["hf-to-moekit", str(base), str(tmp_path / "model.bin")]) == 2
    assert "name the output *.safetensors or *.pt" in capsys.readouterr().err


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
