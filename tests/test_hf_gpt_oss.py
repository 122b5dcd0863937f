"""OpenAI's gpt-oss checkpoints (transformers' GptOss): import, export and MXFP4 weights.

A tiny GptOssForCausalLM with fresh random weights (biases and sinks included) is saved by transformers; moekit's
import must give its logits, moekit's export must load back into transformers with them, and a folder whose
expert weights are MXFP4 (as openai/gpt-oss-20b ships) must load as the dequantized weights, whole and by slices.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moekit.models.hf import UnsupportedCheckpoint, config_from_hf, load_hf, save_hf
from moekit.models.hf.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from moekit.models.hf.families import window_pattern

transformers = pytest.importorskip("transformers")

VOCAB = 96


def hf_model(seed: int, **over):
    """transformers' GptOssForCausalLM, tiny, every parameter random (norm scales, biases and sinks too)."""
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
              max_position_embeddings=64, rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                           "beta_slow": 1.0, "truncate": False,
                                                           "original_max_position_embeddings": 16,
                                                           "rope_theta": 150000.0})
    c = transformers.GptOssConfig(**{**kw, **over})
    c._attn_implementation = "eager"
    model = transformers.GptOssForCausalLM(c).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.5))
    return model


def tokens(n: int = 13) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("over", [{}, {"layer_types": ["sliding_attention"] * 4}, {"sliding_window": 64},
                                  {"num_experts_per_tok": 1}],
                         ids=["alternating", "all-sliding", "wide-window", "top1"])
def test_import_and_export_match_transformers(tmp_path, over):
    """The imported model's logits are transformers' (13 tokens over a 4-position window: the window matters);
    the export loads back into transformers with the same logits and the same layer pattern."""
    theirs = hf_model(seed=len(over), **over)
    theirs.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf").eval()
    cfg = ours.config
    assert cfg.attention_sinks and cfg.moe_ffn_bias and cfg.activation == "swiglu_oai"
    assert [cfg.attention_window(i) for i in range(4)] == [
        over.get("sliding_window", 4) if t == "sliding_attention" else 0 for t in theirs.config.layer_types]
    with torch.no_grad():
        want = theirs(tokens()).logits
        torch.testing.assert_close(ours(tokens()), want, rtol=1e-5, atol=1e-5)
    out = save_hf(ours, tmp_path / "out")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "gpt_oss" and written["layer_types"] == theirs.config.layer_types
    back = transformers.GptOssForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens()).logits, want, rtol=1e-5, atol=1e-5)


def test_cached_generation_matches_the_full_forward(tmp_path):
    """Greedy decoding through the KV cache (windowed layers, sinks) picks transformers' next tokens."""
    from moekit.models.transformer import KVCache

    theirs = hf_model(seed=5)
    theirs.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf").eval()
    seq = tokens(6)
    cache = KVCache(ours.config)
    with torch.no_grad():
        logits = ours(seq, cache=cache)
        for _ in range(8):  # past the 4-position window
            nxt = logits[:, -1:].argmax(-1)
            seq = torch.cat((seq, nxt), 1)
            logits = ours(nxt, cache=cache)
        torch.testing.assert_close(ours(seq), theirs(seq).logits, rtol=1e-5, atol=1e-5)


def mxfp4_folder(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """The folder ``src`` with its expert weights stored as MXFP4 (gpt-oss's release format: X_blocks, X_scales
    and a quantization_config); returns the dequantized expert weights by key."""
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    decoded = {}
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(key).float())
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
        decoded[key] = dequantize_mxfp4(blocks, scales, torch.float32, name=key)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                       "model.layers.*.mlp.router"]}
    (dst / "config.json").write_text(json.dumps(config))
    return decoded


def test_mxfp4_folder_loads_as_its_dequantized_weights(tmp_path):
    """An MXFP4 folder imports as the model whose expert weights are the decoded ones (compared with transformers
    given those weights), and the reader hides the blocks / scales behind the decoded tensor."""
    theirs = hf_model(seed=7)
    theirs.save_pretrained(tmp_path / "hf")
    decoded = mxfp4_folder(tmp_path / "hf", tmp_path / "mxfp4")
    ours = load_hf(tmp_path / "mxfp4", dtype=torch.float32).eval()
    with torch.no_grad():
        for key, value in decoded.items():
            module = theirs.get_submodule(key.rsplit(".", 1)[0])
            getattr(module, key.rsplit(".", 1)[1]).copy_(value)
        assert not torch.equal(decoded["model.layers.0.mlp.experts.down_proj"],
                               load_file(tmp_path / "hf" / "model.safetensors")["model.layers.0.mlp.experts.down_proj"])
        torch.testing.assert_close(ours(tokens()), theirs(tokens()).logits, rtol=1e-5, atol=1e-5)
    from moekit.models.hf.io import CheckpointReader

    reader = CheckpointReader(tmp_path / "mxfp4")
    key = "model.layers.1.mlp.experts.gate_up_proj"
    assert key in reader.infos and key + "_blocks" not in reader.infos and reader.infos[key].shape == (4, 32, 64)
    assert torch.equal(reader.get(key).float(), decoded[key])


def test_mxfp4_folder_missing_scales_is_refused(tmp_path):
    hf_model(seed=1).save_pretrained(tmp_path / "hf")
    mxfp4_folder(tmp_path / "hf", tmp_path / "mxfp4")
    tensors = load_file(tmp_path / "mxfp4" / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(tensors, tmp_path / "mxfp4" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.2.mlp.experts.down_proj_blocks"):
        load_hf(tmp_path / "mxfp4")


def test_window_pattern():
    S, F = "sliding_attention", "full_attention"
    assert window_pattern([S, F, S, F]) == 2 and window_pattern([S] * 3) == 0
    assert window_pattern([S, S, F, S, S, F]) == 3 and window_pattern([F, S]) is None


@pytest.mark.parametrize("over,match", [
    ({"layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]},
     "sliding layers \\[1, 2\\] of 4"),
    ({"swiglu_limit": 10.0}, "swiglu_limit=10.0")])
def test_unsupported_configs_name_the_field(tmp_path, over, match):
    c = hf_model(seed=0, **over).config
    c.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedCheckpoint, match=match):
        config_from_hf(tmp_path)


def test_other_families_refuse_gpt_oss_features(tmp_path):
    """A gpt-oss model cannot be written as Mixtral (sinks, o bias, window, clamped SwiGLU, biases): every reason is
    named; a Mixtral-like model exports as gpt-oss only with gpt-oss's activation and sinks."""
    hf_model(seed=2).save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    with pytest.raises(ValueError) as info:
        save_hf(ours, tmp_path / "as-mixtral", family="mixtral")
    for reason in ("attention_sinks", "attention_out_bias", "full_attention_every", "swiglu_oai", "gate_bias",
                   "moe_ffn_bias"):
        assert reason in str(info.value), (reason, str(info.value))


def _sharded_mxfp4_rank(rank, world, folder):
    from moekit.comm.topology import Layout, Topology
    from moekit.models.hf import sharded
    from moekit.models.parallelize import parallelize
    from moekit.models.transformer import Transformer

    topo = Topology(Layout(ep=2, fsdp=2), rank, world).build()
    with torch.device("meta"):
        model = Transformer(config_from_hf(folder))
    parallelize(model, topo)
    model = model.to_empty(device="cpu")
    sharded.load_hf_sharded(model, folder)
    want = load_hf(folder).state_dict()
    for name, t in model.state_dict().items():
        box = sharded.shard_box(t, name)
        got = t.to_local() if hasattr(t, "to_local") else t
        assert torch.equal(got, want[name][tuple(slice(r.start, r.stop) for r in box)]), (rank, name)


def test_mxfp4_folder_loads_by_slices(tmp_path):
    """Two ranks, fsdp 2 x ep 2: each rank decodes only its experts' MXFP4 blocks and gets load_hf's values."""
    from tests.dist_utils import run_ranks

    hf_model(seed=9).save_pretrained(tmp_path / "hf")
    mxfp4_folder(tmp_path / "hf", tmp_path / "mxfp4")
    run_ranks(_sharded_mxfp4_rank, 2, str(tmp_path / "mxfp4"))


def test_mxfp4_export_is_the_release_format_and_reloads_as_its_rounding(tmp_path, capsys):
    """save_hf(mxfp4=True): the experts as X_blocks / X_scales with quantization_config mxfp4, everything else bf16;
    reloading gives mxfp4_reference's weights exactly (the expert weights through MXFP4 and back) and its logits.
    moekit-convert moekit-to-hf --mxfp4 --verify does the same from a moekit file and reports the cost."""
    from moekit.models.hf import mxfp4_reference
    from moekit.train.convert import main as convert_main

    hf_model(seed=4).save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf", dtype=torch.float32).eval()
    out = save_hf(ours, tmp_path / "mx", mxfp4=True)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    stored = load_file(out / "model.safetensors")
    key = "model.layers.1.mlp.experts.gate_up_proj"
    assert key not in stored and stored[key + "_blocks"].dtype == torch.uint8
    assert stored[key + "_scales"].shape == (4, 64, 1)  # [E, 2F, H / 32]
    assert stored["model.layers.1.mlp.experts.gate_up_proj_bias"].dtype == torch.bfloat16
    back, ref = load_hf(out, dtype=torch.float32).eval(), mxfp4_reference(ours)
    for name, t in ref.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    assert not torch.equal(ref.layers[1].ffn.experts.w_in, ours.layers[1].ffn.experts.w_in)  # it did round
    with torch.no_grad():
        torch.testing.assert_close(back(tokens()), ref(tokens()))
    with pytest.raises(ValueError, match="choose one"):
        save_hf(ours, tmp_path / "both", mxfp4=True, fp8=True)
    assert convert_main(["hf-to-moekit", str(tmp_path / "hf"), str(tmp_path / "m.safetensors")]) == 0
    assert convert_main(["moekit-to-hf", str(tmp_path / "m.safetensors"), str(tmp_path / "cli"), "--mxfp4",
                         "--verify"]) == 0
    printed = capsys.readouterr().out
    assert "MXFP4 expert weights" in printed and "MXFP4 rounding changed the logits by" in printed


def test_mxfp4_export_of_another_family_is_refused(tmp_path):
    from moekit.models.config import ModelConfig
    from moekit.models.transformer import build_model

    model = build_model(ModelConfig(hidden_size=32, num_heads=4, num_kv_heads=2, router_options={"normalize": True}))
    with pytest.raises(ValueError, match="mxfp4=True writes gpt-oss's MXFP4 experts; this model exports as mixtral"):
        save_hf(model, tmp_path / "x", mxfp4=True)
