"""Gated DeltaNet linear attention, the attention output gate and zero-centered norms (models.linear_attention):
the chunked rule against the recurrence written position by position and against transformers' own chunked
function, gradients against float64 autograd through the recurrence, cached decoding against the full forward,
Qwen3.5-MoE checkpoints both ways against transformers (flat and as the multimodal release stores them), layouts,
refusals."""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from moekit.comm.topology import LayoutError
from moekit.models.config import ModelConfig, preset
from moekit.models.kvcache import KVCache
from moekit.models.delta_rule import gated_delta_rule, gated_delta_steps, l2_normalize
from moekit.models.linear_attention import GatedDeltaNet
from moekit.models.norms import ZeroCenteredRMSNorm
from moekit.models.transformer import build_model


def _inputs(B, S, N, dk, dv, seed, dtype=torch.float64, state=True):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, S, N, dk, generator=g, dtype=dtype)) * dk**-0.5
    k = l2_normalize(torch.randn(B, S, N, dk, generator=g, dtype=dtype))
    v = torch.randn(B, S, N, dv, generator=g, dtype=dtype)
    decay = -torch.rand(B, S, N, generator=g, dtype=dtype) * 3  # strong and weak decays
    beta = torch.rand(B, S, N, generator=g, dtype=dtype)
    s0 = torch.randn(B, N, dk, dv, generator=g, dtype=dtype) if state else None
    return q, k, v, decay, beta, s0


@pytest.mark.parametrize("S,chunk", [(1, 64), (7, 3), (37, 16), (64, 64), (65, 64), (40, 1), (30, 100)])
def test_chunked_rule_equals_the_recurrence(S, chunk):
    """Every chunk length, sequences that are and are not whole chunks, a chunk longer than the sequence."""
    q, k, v, decay, beta, s0 = _inputs(2, S, 3, 8, 5, seed=S + chunk)
    want_o, want_s = gated_delta_steps(q, k, v, decay, beta, s0)
    o, s = gated_delta_rule(q, k, v, decay, beta, s0, chunk=chunk)
    assert o.dtype == torch.float64
    torch.testing.assert_close(o, want_o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, want_s, rtol=1e-10, atol=1e-10)
    o2, none = gated_delta_rule(q, k, v, decay, beta, s0, chunk=chunk, final_state=False)
    assert none is None and torch.equal(o2, o)


def test_recurrence_written_out_by_hand():
    """Two positions of one head, the state update spelled out: the reference itself is right."""
    q, k, v, decay, beta, s0 = _inputs(1, 2, 1, 3, 2, seed=1)
    s = s0[0, 0].clone()
    outs = []
    for t in range(2):
        s = s * decay[0, t, 0].exp()
        s = s + torch.outer(k[0, t, 0], beta[0, t, 0] * (v[0, t, 0] - s.T @ k[0, t, 0]))
        outs.append(s.T @ q[0, t, 0])
    o, last = gated_delta_steps(q, k, v, decay, beta, s0)
    torch.testing.assert_close(o[0, :, 0], torch.stack(outs))
    torch.testing.assert_close(last[0, 0], s)


def test_chunked_rule_equals_transformers():
    """A third implementation: transformers' torch_chunk_gated_delta_rule (it scales q itself)."""
    mod = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    q, k, v, decay, beta, s0 = _inputs(2, 45, 2, 8, 6, seed=3, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want, want_s = mod.torch_chunk_gated_delta_rule(q * 8**0.5, k, v, decay, beta, chunk_size=16,
                                                        initial_state=s0, output_final_state=True)
    o, s = gated_delta_rule(q, k, v, decay, beta, s0, chunk=16)
    torch.testing.assert_close(o, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, want_s, rtol=1e-5, atol=1e-5)


def test_chunked_rule_gradients_equal_the_recurrences():
    """Backward through the chunks (triangular solves, decays, the state carried across chunks) against autograd
    through the recurrence, float64, for every input and the initial state."""
    leaves = [t.requires_grad_() for t in _inputs(2, 23, 2, 4, 3, seed=5)]
    weights = torch.randn(2, 23, 2, 3, dtype=torch.float64)
    o, s = gated_delta_rule(*leaves, chunk=8)
    got = torch.autograd.grad((o * weights).sum() + s.square().sum(), leaves)
    o, s = gated_delta_steps(*leaves)
    want = torch.autograd.grad((o * weights).sum() + s.square().sum(), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("S,chunk", [(37, 8), (64, 16), (12, 64), (20, 1)])
def test_documents_restart_the_state_in_the_chunked_rule(S, chunk):
    """Segments: the chunked rule equals the recurrence that zeroes the state at each document start (documents
    that start mid-chunk, at a chunk boundary, one position long)."""
    q, k, v, decay, beta, s0 = _inputs(2, S, 3, 8, 5, seed=S)
    seg = torch.tensor([0] * 5 + [1] * 3 + [2] + [3] * S)[:S].repeat(2, 1)
    seg[1] = torch.randint(0, 4, (S,), generator=torch.Generator().manual_seed(S)).sort().values
    want_o, want_s = gated_delta_steps(q, k, v, decay, beta, s0, segments=seg)
    o, s = gated_delta_rule(q, k, v, decay, beta, s0, chunk=chunk, segments=seg)
    torch.testing.assert_close(o, want_o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, want_s, rtol=1e-10, atol=1e-10)


def test_a_packed_sequence_equals_its_documents_run_alone():
    """The layer under document masking (state and convolution) against each document through the layer by itself:
    another way to the same numbers, which also checks the recurrence's reset."""
    cfg = qwen_tiny(linear_chunk=8)
    layer = build_model(cfg, seed=3).layers[0].attn
    lengths = [5, 1, 11, 9]
    x = torch.randn(2, sum(lengths), cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).repeat(2, 1)
    with torch.no_grad():
        packed = layer(x, segments=seg)
        alone = torch.cat([layer(part) for part in x.split(lengths, dim=1)], dim=1)
        plain = layer(x)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(plain[:, 5:], alone[:, 5:], atol=1e-3)  # without documents the state leaks across


def test_zero_centered_norm_is_rmsnorm_with_one_plus_w():
    x = torch.randn(3, 5, 16)
    zc, plain = ZeroCenteredRMSNorm(16, eps=1e-6), torch.nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        zc.weight.normal_()
        plain.weight.copy_(zc.weight + 1)
    torch.testing.assert_close(zc(x), plain(x))
    assert zc(x.bfloat16()).dtype == torch.bfloat16


def qwen_tiny(**over) -> ModelConfig:
    cfg = preset("qwen3.5-tiny")
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg.validate()


def test_model_init_is_the_identity_where_qwen_starts():
    model = build_model(qwen_tiny(), seed=2)
    assert [type(layer.attn).__name__ for layer in model.layers] == ["GatedDeltaNet"] * 3 + ["Attention"]
    assert torch.count_nonzero(model.norm.weight) == 0 and torch.count_nonzero(model.layers[3].attn.q_norm.weight) == 0
    attn = model.layers[0].attn
    assert torch.equal(attn.norm.weight, torch.ones(32)) and torch.equal(attn.dt_bias, torch.ones(4))
    A = attn.A_log.exp()
    assert 1 < A[0] < A[-1] < 16  # spread over the value heads
    assert attn.conv_weight.std() > 0.1


@pytest.mark.parametrize("splits", [[13, 1, 16], [1] * 6, [5, 25], [30]])
def test_cached_decoding_equals_the_full_forward(splits):
    """Prefill then steps (the recurrence for <= STEPS_MAX positions, chunks beyond): the convolution's cached
    inputs and the states carry every position; the gated attention layer's keys likewise."""
    cfg = qwen_tiny(linear_chunk=8, full_attention_every=2)
    model = build_model(cfg, seed=4).eval()
    t = torch.randint(0, cfg.vocab_size, (2, sum(splits)), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(t)
        cache, parts, at = KVCache(cfg), [], 0
        for n in splits:
            parts.append(model(t[:, at:at + n], cache=cache))
            at += n
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == sum(splits)
    cache.truncate(cache.length)  # nothing to take back: fine
    with pytest.raises(ValueError, match="cannot go back"):  # before the last forward's first position
        cache.truncate(cache.length - splits[-1] - 1)


def test_cache_takes_back_positions_of_a_short_forward():
    """Speculative decoding's pattern: a forward of 3 positions (a draft chain checked), 2 of them taken back, other
    tokens decoded from there: the logits are those of the full forward of the sequence that was kept; the
    convolution's inputs and the states come back to the accepted position."""
    cfg = qwen_tiny(linear_chunk=8, full_attention_every=2)
    model = build_model(cfg, seed=5).eval()
    t = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = KVCache(cfg)
        model(t[:, :10], cache=cache)
        assert cache.layers[0].inputs is None  # a prompt's convolution inputs are not kept (only its last 3)
        model(t[:, 10:13], cache=cache)  # 3 positions, 2 of them rejected
        assert cache.layers[0].inputs.shape[-1] == 3 + 3
        cache.truncate(11)
        other = torch.tensor([[7, 9, 11]])
        got = model(other, cache=cache)
        want = model(torch.cat((t[:, :11], other), 1))[:, 11:]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cannot go back from 14 to 10"):
        cache.truncate(10)


def test_cache_refuses_overflow_and_a_different_batch():
    cfg = qwen_tiny(max_seq_len=16)
    model = build_model(cfg, seed=1).eval()
    cache = KVCache(cfg, capacity=8)
    with torch.no_grad():
        model(torch.zeros(2, 6, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="overflows"):
            model(torch.zeros(2, 3, dtype=torch.long), cache=cache)
    cache = KVCache(cfg)
    layer = model.layers[0].attn
    with torch.no_grad():
        layer(torch.randn(2, 3, cfg.hidden_size), kv=cache.layers[0])
        with pytest.raises(ValueError, match="batch 2, got batch 1"):
            layer(torch.randn(1, 1, cfg.hidden_size), kv=cache.layers[0])


def test_training_learns_and_reaches_every_parameter():
    cfg = qwen_tiny(linear_chunk=16)
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.arange(48).repeat(4, 1) % 23  # a pattern to learn
    losses = []
    for _ in range(15):
        loss = model(data, targets=data.roll(-1, 1))
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


@pytest.mark.parametrize("over,match", [
    ({"linear_attention": "mamba"}, "linear_attention='mamba' is invalid"),
    ({"linear_num_key_heads": 0}, "needs model.linear_num_key_heads > 0"),
    ({"linear_num_value_heads": 3}, "must divide model.linear_num_value_heads=3"),
    ({"linear_conv_kernel": 0}, "linear_conv_kernel=0 is invalid"),
    ({"sliding_window": 8}, "sliding_window=8 with linear_attention"),
    ({"attention_output_gate": 1}, "attention_output_gate=1 is invalid"),
    ({"linear_attention": "none"}, "only apply to linear attention"),
])
def test_config_refusals_name_the_field_and_the_fix(over, match):
    cfg = preset("qwen3.5-tiny")
    for k, v in over.items():
        setattr(cfg, k, v)
    with pytest.raises(ValueError, match=match):
        cfg.validate()


def test_layouts_it_cannot_run_are_refused_up_front():
    """Tensor parallelism that does not divide the key / value heads; a KV cache under document masking."""
    from moekit.comm.context_parallel import check_context_parallel
    from moekit.comm.tensor_parallel import check_tensor_parallel

    cfg = qwen_tiny()
    heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    check_tensor_parallel(cfg, 2)  # the heads split (tests/test_parallelize.py runs it)
    with pytest.raises(LayoutError, match=f"--tp 3 must divide .*linear_num_key_heads={heads[0]}, "
                                          f"linear_num_value_heads={heads[1]}"):
        check_tensor_parallel(cfg, 3)
    check_context_parallel(cfg, 2, 64)  # context parallelism runs them (tests/test_context_parallel.py)
    check_tensor_parallel(qwen_tiny(linear_attention="none", linear_num_key_heads=0, linear_num_value_heads=0,
                                    linear_key_head_dim=0, linear_value_head_dim=0, full_attention_every=0),
                          2)  # gated GQA alone shards fine
    with pytest.raises(ValueError, match="document masking"):
        GatedDeltaNet(cfg)(torch.randn(1, 4, cfg.hidden_size), kv=KVCache(cfg).layers[0],
                           segments=torch.zeros(1, 4, dtype=torch.long))


def test_planner_fits_long_sequences_from_two_short_fake_runs():
    """train.planning.linear_memory: the kept bytes are linear in the length at a fixed remainder, so long sequences
    come from two short fake runs; equal to the fake run at the full length, with documents, autocast and context
    parallelism (each rank's chunks)."""
    from moekit.train.planning import linear_memory as lm

    for S, cp, documents, autocast, recompute in [(77, 1, True, True, True), (176, 4, False, True, False)]:
        cfg = qwen_tiny(linear_chunk=4, linear_recompute=recompute)
        key = tuple((name, getattr(cfg, name)) for name in lm.FIELDS)
        assert S > S % (8 * cp) + 3 * 8 * cp  # long enough to be fitted
        fitted = lm._saved_bytes(key, 2, S, False, autocast, documents, cp, cp - 1)
        assert fitted == lm._fake_run(S, key, 2, False, autocast, documents, cp, cp - 1), (S, cp)


def test_flops_count_the_chunked_rule_as_torch_does():
    """model_stats' linear term against FlopCounterMode over one layer's chunked rule (its bmm's), a sequence that
    is not whole chunks."""
    from torch.utils.flop_counter import FlopCounterMode

    from moekit.models.stats import linear_attention_flops

    cfg = qwen_tiny(linear_chunk=16)
    B, S = 2, 40
    q, k, v, decay, beta, _ = _inputs(B, S, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                      cfg.linear_value_head_dim, seed=2, dtype=torch.float32, state=False)
    with FlopCounterMode(display=False) as counter:
        gated_delta_rule(q, k, v, decay, beta, chunk=16, final_state=True)
    assert counter.get_total_flops() == pytest.approx(linear_attention_flops(cfg, S) * B * S, rel=1e-12)


# ---------------------------------------------------------------------------------------------------
# Qwen3.5-MoE checkpoints against transformers
# ---------------------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")

QWEN35 = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=8, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=6,
              num_experts_per_tok=2, max_position_embeddings=128, initializer_range=0.1)


def hf_qwen35(folder: Path, seed: int = 0, **over):
    """A random Qwen3_5MoeForCausalLM with every parameter moved off its init (norms, A_log, dt_bias included),
    saved with save_pretrained."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    torch.manual_seed(seed)
    return _perturbed_and_saved(Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{**QWEN35, **over})), folder)


def _perturbed_and_saved(model, folder: Path):
    """``model`` (eval) with noise on every parameter (norms, A_log, dt_bias off their init), saved to ``folder``."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval().save_pretrained(folder)
    return model


@torch.no_grad()
def _logits(model, toks):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(toks).logits.float()


def _both_ways(ref, model, out: Path, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``model``'s logits equal transformers' ``ref``'s over 70 positions (past one 64-position chunk), and so do
    those of transformers' load of ``save_hf(model, out)``; -> (the tokens, ref's logits)."""
    from moekit.models.hf import save_hf

    toks = torch.randint(0, 300, (2, 70), generator=torch.Generator().manual_seed(seed))
    want = _logits(ref, toks)
    with torch.no_grad():
        torch.testing.assert_close(model(toks), want, rtol=1e-4, atol=1e-4)
    save_hf(model, out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(_logits(back, toks), want, rtol=1e-5, atol=1e-5)
    return toks, want


@pytest.mark.parametrize("over", [
    {"layer_types": ["linear_attention"] * 3 + ["full_attention"]},
    {"layer_types": ["linear_attention", "full_attention"] * 2, "linear_num_value_heads": 2, "attention_bias": True},
])
def test_qwen3_5_moe_imports_and_exports_with_transformers_logits(tmp_path, over):
    from moekit.models.hf import load_hf

    ref = hf_qwen35(tmp_path / "hf", **over)
    model = load_hf(tmp_path / "hf")
    assert model.config.linear_attention == "gated_deltanet" and model.config.norm_zero_centered
    _both_ways(ref, model, tmp_path / "out")
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf["model_type"] == "qwen3_5_moe_text" and hf["layer_types"] == ref.config.layer_types


def test_the_multimodal_release_imports_its_language_model(tmp_path):
    """Qwen3.5's release: model_type qwen3_5_moe, the text config nested, the language model under
    model.language_model., a vision tower and an MTP layer beside it (left out with a warning)."""
    from moekit.models.hf import config_from_hf, load_hf, save_hf

    ref = hf_qwen35(tmp_path / "flat")
    hf = json.loads((tmp_path / "flat" / "config.json").read_text())
    release = tmp_path / "release"
    release.mkdir()
    tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in load_file(tmp_path / "flat" / "model.safetensors").items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(tensors, release / "model.safetensors")
    text = {k: v for k, v in hf.items() if k not in ("architectures", "model_type")}
    (release / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "text_config": {**text, "model_type": "qwen3_5_moe_text"}, "vision_config": {"depth": 2},
        "tie_word_embeddings": False}))
    assert config_from_hf(release).name == "hf:qwen3_5_moe_text"
    with pytest.warns(UserWarning, match=r"vision tower \(model.visual.\*, 1 tensors\)"):
        model = load_hf(release)
    toks = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(toks), _logits(ref, toks), rtol=1e-4, atol=1e-4)
    save_hf(model, tmp_path / "out")  # as the language model transformers' CausalLM loads
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"
    del tensors["model.language_model.norm.weight"]
    save_file(tensors, release / "model.safetensors")
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="missing 1 tensor"):
        load_hf(release)


def test_native_models_export_only_where_a_family_reproduces_them():
    from moekit.models.hf import check_hf_exportable

    assert check_hf_exportable(build_model(qwen_tiny(), seed=0)) == "qwen3_5_moe_text"
    with pytest.raises(ValueError, match="zero-centered"):
        check_hf_exportable(build_model(qwen_tiny(norm_zero_centered=False), seed=0))
    with pytest.raises(ValueError, match="no linear-attention layers"):
        check_hf_exportable(build_model(qwen_tiny(), seed=0), "qwen2_moe")
    plain = dataclasses.replace(preset("mixtral-tiny"))
    with pytest.raises(ValueError, match="gates each attention head"):
        check_hf_exportable(build_model(plain, seed=0), "qwen3_5_moe_text")


NEXT = dict(QWEN35, intermediate_size=40, mlp_only_layers=[0], norm_topk_prob=False)


def hf_qwen3_next(folder: Path, seed: int = 0, **over):
    """A random Qwen3NextForCausalLM (a dense first layer, no renormalisation), every parameter off its init."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextForCausalLM

    torch.manual_seed(seed)
    return _perturbed_and_saved(Qwen3NextForCausalLM(Qwen3NextConfig(**{**NEXT, **over})), folder)


def test_qwen3_next_reads_its_fused_projections_and_writes_them_back(tmp_path):
    """Qwen3-Next stores q, k, v, z per key-head group in one in_proj_qkvz (and b, a in in_proj_ba): read as the split
    tensors (the reader's derived keys), written back fused; transformers' logits both ways."""
    from moekit.models.hf import load_hf, save_hf

    ref = hf_qwen3_next(tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    cfg = model.config
    assert (cfg.first_dense_layers, cfg.moe_every, cfg.router_options) == (1, 1, {"normalize": False})
    _both_ways(ref, model, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "qwen3_next"
    theirs, ours = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    for key in ("model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.1.linear_attn.in_proj_ba.weight"):
        assert torch.equal(ours[key], theirs[key]), key  # the fused layout itself, bit for bit
    # the same math written as Qwen3.5's unfused layout (no dense layer there: this model has one)
    with pytest.raises(ValueError, match="MoE FFN in every layer"):
        save_hf(model, tmp_path / "as35", family="qwen3_5_moe_text")


def test_qwen3_next_fused_shapes_must_match_the_config(tmp_path):
    from moekit.models.hf import load_hf

    hf_qwen3_next(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    save_file({**tensors, "mtp.fc.weight": torch.zeros(64, 128)}, tmp_path / "hf" / "model.safetensors")
    with pytest.warns(UserWarning, match=r"skipping 1 tensors of the multi-token-prediction layer\(s\) \(mtp.\*\)"):
        load_hf(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "linear_value_head_dim": 4}))
    with pytest.raises(ValueError, match=r"in_proj_qkvz.weight is \[128, 64\], but config.json .* implies \[96, 64\]"):
        load_hf(tmp_path / "hf")


def _qwen3_next_ranks(rank, world, folder):
    from moekit.comm.topology import Layout, Topology
    from moekit.models.hf import config_from_hf, load_hf
    from moekit.models.hf.sharded import load_hf_sharded, save_hf_sharded
    from moekit.models.parallelize import parallelize
    from moekit.models.transformer import Transformer

    topo = Topology(Layout(fsdp=2, ep=2), rank, world).build()
    with torch.device("meta"):
        model = Transformer(config_from_hf(folder))
    parallelize(model, topo)
    model.to_empty(device="cpu")
    load_hf_sharded(model, folder)
    ref = load_hf(folder)
    full = {k: (t.full_tensor() if hasattr(t, "full_tensor") else t) for k, t in model.state_dict().items()}
    for key, value in ref.state_dict().items():
        assert torch.equal(full[key], value), key
    # the sharded export writes the fused in_proj_qkvz / in_proj_ba back (tests/test_hf_sharded.py: byte for byte
    # save_hf's); read back, the model is the one the folder held
    save_hf_sharded(model, Path(folder) / "out")
    torch.distributed.barrier()  # rank 0 writes the index last
    back = load_hf(Path(folder) / "out").state_dict()
    for key, value in ref.state_dict().items():
        assert torch.equal(back[key], value), key


def test_qwen3_next_loads_by_slices_under_fsdp_and_ep(tmp_path):
    """fsdp2 x ep2: each rank reads the rows of the fused tensors its shards of the split ones cover, and the sharded
    export writes them fused again."""
    from tests.dist_utils import run_ranks

    hf_qwen3_next(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")  # the release's MTP layer beside the model: skipped
    save_file({**tensors, "mtp.fc.weight": torch.zeros(64, 128)}, tmp_path / "hf" / "model.safetensors")
    run_ranks(_qwen3_next_ranks, 2, str(tmp_path / "hf"))


def test_qwen3_5_mtp_layer_loads_into_the_depth_and_computes_vllms_mtp(tmp_path):
    """The release's MTP layer (mtp.fc, mtp.pre_fc_norm_embedding / _hidden, mtp.layers.0 (a full-attention
    layer), mtp.norm; mtp_num_hidden_layers 1) loads into the model's depth. Its loss equals vLLM's Qwen3-Next MTP
    math written out here with transformers' own decoder layer and zero-centered norms:
    head(norm(layer(fc([norm_e(embed(t_(i+1))) ; norm_h(h_i)])))) against t_(i+2), h the main model's final normed
    hidden states. Exported back, the mtp.* tensors are the release's bit for bit."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm, Qwen3_5MoeTextRotaryEmbedding)

    from moekit.models.hf import load_hf, save_hf

    ref = hf_qwen35(tmp_path / "hf")
    cfg = ref.config
    cfg._attn_implementation = "sdpa"
    g = torch.Generator().manual_seed(5)
    layer = Qwen3_5MoeDecoderLayer(cfg, 3).eval()  # layer 3 is a full-attention one
    norms = {n: Qwen3_5MoeRMSNorm(64, eps=cfg.rms_norm_eps) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden",
                                                                      "norm")}
    fc = torch.nn.Linear(128, 64, bias=False)
    mtp = {f"mtp.layers.0.{k}": torch.randn(v.shape, generator=g) * 0.1 for k, v in layer.state_dict().items()}
    mtp.update({f"mtp.{n}.weight": torch.randn(64, generator=g) * 0.1 for n in norms})
    mtp["mtp.fc.weight"] = torch.randn(64, 128, generator=g) * 0.1
    with torch.no_grad():
        layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in mtp.items() if k.startswith("mtp.layers.0.")})
        for n, norm in norms.items():
            norm.weight.copy_(mtp[f"mtp.{n}.weight"])
        fc.weight.copy_(mtp["mtp.fc.weight"])
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    save_file({**tensors, **mtp}, tmp_path / "hf" / "model.safetensors")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))

    model = load_hf(tmp_path / "hf")
    assert model.config.mtp_layers == 1
    toks = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(2))
    targets = toks.roll(-1, 1)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = ref.model(toks).last_hidden_state  # [B, S, H], after the final norm
        x = fc(torch.cat((norms["pre_fc_norm_embedding"](ref.model.embed_tokens(toks[:, 1:])),
                          norms["pre_fc_norm_hidden"](h[:, :-1])), dim=-1))
        positions = torch.arange(toks.shape[1] - 1)[None]
        rope = Qwen3_5MoeTextRotaryEmbedding(cfg)(x, positions)
        x = layer(x, position_embeddings=rope, position_ids=positions)
        x = x[0] if isinstance(x, tuple) else x
        logits = ref.lm_head(norms["norm"](x))
        want = F.cross_entropy(logits.flatten(0, 1), targets[:, 1:].flatten())
        model.mtp_in_eval = True  # record the depths' loss in an eval forward
        model(toks, targets=targets)
    torch.testing.assert_close(model.pop_mtp_loss(), want, rtol=1e-4, atol=1e-5)
    save_hf(model, tmp_path / "out", layout="fused")  # the experts as the MTP layer was written here
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(out[k], v) for k, v in mtp.items())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # transformers skips mtp.* as it should


def test_dense_qwen3_5_imports_exports_and_upcycles_into_qwen3_5_moe(tmp_path):
    """Dense Qwen3.5 (qwen3_5_text: the same layers with an MLP) both ways with transformers' logits; upcycled to
    8 experts of half the MLP (granularity 2) it computes the dense logits, and exports as Qwen3.5-MoE (a zero
    shared expert), which transformers runs with those logits."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    from moekit.models.hf import load_hf, save_hf
    from moekit.models.upcycle import upcycle, upcycled_config

    torch.manual_seed(0)
    dense_cfg = {k: v for k, v in QWEN35.items() if k not in ("moe_intermediate_size", "shared_expert_intermediate_size",
                                                               "num_experts", "num_experts_per_tok")}
    ref = _perturbed_and_saved(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**dense_cfg, intermediate_size=96)),
                               tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    assert model.config.num_experts == 0 and model.config.linear_attention == "gated_deltanet"
    toks, want = _both_ways(ref, model, tmp_path / "out")
    moe = upcycle(model, upcycled_config(model.config, 8, 2, 2), 2, seed=1).eval()
    with torch.no_grad():
        torch.testing.assert_close(moe(toks), want, rtol=1e-4, atol=1e-4)
    save_hf(moe, tmp_path / "moe")
    assert json.loads((tmp_path / "moe" / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "moe").eval()
    torch.testing.assert_close(_logits(back, toks), want, rtol=1e-4, atol=1e-4)


def test_trainer_splits_the_gated_deltanet_heads_over_tensor_parallel_ranks(tmp_path):
    """qwen3.5-tiny under --tp 2 (each rank 1 of the 2 key heads and 2 of the 4 value heads of every linear layer,
    the gated GQA layer's heads split too), with sequence parallelism, and with context parallelism (4 ranks) follows
    the one-process loss curve; the dry run plans it (its parameter shards are the recipe's)."""
    from tests.dist_utils import run_trainer

    # two layers, one of each kind: a Gated DeltaNet layer and a gated GQA one (full_attention_every 2); the final
    # validation on 8 sequences (the curves compared are the training losses), no TensorBoard, one thread a rank
    common = ["--preset", "qwen3.5-tiny", "--model.num_layers", "2", "--model.full_attention_every", "2",
              "--train.seq_len", "32", "--batch-size", "4", "--steps", "3", "--eval.every", "0", "--eval.sequences",
              "8", "--log.every", "1", "--log.progress", "off", "--log.tensorboard", "false", "--checkpoint.every",
              "0", "--model.aux_loss_coeff", "0"]  # under TP each rank balances its token slice: the aux loss differs
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def losses(run_dir):
        return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    curves = {}
    for name, extra, nproc in (("one", [], 1), ("tp2", ["--tp", "2"], 2),
                               ("tp2-sp", ["--tp", "2", "--layout.sequence_parallel", "true"], 2),
                               ("tp2-cp2", ["--tp", "2", "--cp", "2"], 4)):  # each rank: its heads of its chunks
        r = run_trainer([*common, "--run-dir", str(tmp_path / name), *extra], nproc=nproc, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        curves[name] = losses(tmp_path / name)
    assert len(curves["one"]) == 3
    assert curves["tp2"] == pytest.approx(curves["one"], rel=1e-5)
    assert curves["tp2-sp"] == pytest.approx(curves["one"], rel=1e-5)
    assert curves["tp2-cp2"] == pytest.approx(curves["one"], rel=1e-5)
    r = run_trainer([*common, "--run-dir", str(tmp_path / "dry"), "--dry-run", "--world-size", "2", "--tp", "2"],
                    env=env)
    assert r.returncode == 0 and "the estimate agrees" in r.stdout, (r.stdout[-2000:], r.stderr[-2000:])

