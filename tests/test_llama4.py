"""Llama 4's parts (models.config: nope_every, attention_chunk, attn_temperature_*, qk_norm 'unit',
router_weight_on_input): chunked attention against its definition (documents, a KV cache, context-parallel ranks,
gradients), cached decoding across chunk boundaries, the MoE that weights its experts' input, the multimodal
release's language model, what is refused, and a run of the llama4-tiny preset. transformers' logits, both ways:
tests/test_hf.py (FAMILY_CASES llama4_text*); the planner: tests/test_dryrun.py; context parallelism and expert
parallelism of the whole model: tests/test_context_parallel.py."""
from __future__ import annotations

import dataclasses
import json
import math
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from moekit.comm.context_parallel import ContextParallel
from moekit.models.attention import attend, context_attend
from moekit.models.config import ModelConfig, preset
from moekit.models.kvcache import LayerKV
from moekit.models.transformer import KVCache, build_model
from moekit.moe import MoELayer, build_router

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def chunked_reference(q, k, v, chunk: int, documents=None):
    """softmax over the keys j <= i of query i's chunk (and document) in float64: the definition."""
    B, N, S, D = q.shape
    G = N // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    visible = (j <= i) & (j // chunk == i // chunk)
    if documents is not None:
        visible = visible & (documents[:, None, :, None] == documents[:, None, None, :])
    return scores.masked_fill(~visible, -math.inf).softmax(-1) @ v


@pytest.mark.parametrize("chunk,S", [(4, 18), (5, 5), (7, 16)], ids=["4-of-18", "one-chunk", "7-of-16"])
def test_chunked_attention_is_its_definition(chunk, S):
    """attend(chunk=...) over a whole sequence, with documents, and its gradients; context_attend on cp 2 and 3
    ranks over the gathered keys; and a KV cache fed prefill, single steps and a block across chunk boundaries."""
    B, N, K, D = 2, 4, 2, 8
    g = torch.Generator().manual_seed(S * chunk)
    q, k, v = (torch.randn(B, n, S, D, generator=g, dtype=torch.float64, requires_grad=True) for n in (N, K, K))
    documents = torch.tensor([[0] * 3 + [1] * (S - 3), [0] * (S - 2) + [1] * 2])
    for docs in (None, documents):
        want = chunked_reference(q, k, v, chunk, docs)
        got = attend(q, k, v, None, True, segments=docs, chunk=chunk)
        torch.testing.assert_close(got, want)
        probe = torch.randn(want.shape, generator=g, dtype=torch.float64)
        for a, b in zip(torch.autograd.grad((got * probe).sum(), (q, k, v)),
                        torch.autograd.grad((want * probe).sum(), (q, k, v))):
            torch.testing.assert_close(a, b)
    want = chunked_reference(q, k, v, chunk)
    for cp in (2, 3):
        if S % (2 * cp):
            continue
        for r in range(cp):
            ctx = ContextParallel(cp, r)
            torch.testing.assert_close(context_attend(ctx.shard(q, 2), k, v, ctx, True, chunk=chunk),
                                       ctx.shard(want, 2), msg=lambda m: f"cp {cp} rank {r}: {m}")
    with torch.no_grad():
        cache = LayerKV(S)
        spans = [(0, 3), (3, 4), (4, 4 + chunk + 1), *[(i, i + 1) for i in range(5 + chunk, S)]]
        got = torch.cat([attend(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], cache, True, chunk=chunk)
                         for a, b in spans if a < b <= S], dim=2)
    torch.testing.assert_close(got, want[:, :, : got.shape[2]])


def llama4_config(**over) -> ModelConfig:
    small = dict(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, ffn_hidden_size=48, moe_ffn_hidden_size=16,
                 shared_ffn_hidden_size=16, num_experts=4, vocab_size=64, max_seq_len=40, attention_chunk=8,
                 attn_temperature_floor=6)
    return dataclasses.replace(preset("llama4-tiny"), **{**small, **over}).validate()


def test_cached_decoding_crosses_chunks_and_scales_nope_queries_at_their_positions():
    """The KV cache's logits equal the full forward's over 96 positions (12 chunks of 8; the NoPE layers' query
    temperature grows from position 5): prefill, single steps, a 9-position block and a 20-position one. The
    chunked layers keep a ring of chunk - 1 + KV_WINDOW_SLACK = 71 positions (their queries see no older ones), the
    NoPE layers every position."""
    from moekit.models.kvcache import KV_WINDOW_SLACK

    model = build_model(llama4_config(max_seq_len=96), seed=2).eval()
    tokens = torch.randint(0, 64, (2, 96), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        full = model(tokens)
        cache = KVCache(model.config)
        spans = [(0, 6), (6, 7), (7, 16), *[(i, i + 1) for i in range(16, 70)], (70, 90), (90, 96)]
        inc = torch.cat([model(tokens[:, a:b], cache=cache) for a, b in spans], dim=1)
    torch.testing.assert_close(inc, full, rtol=1e-5, atol=1e-5)
    slots = [layer.keys.shape[2] for layer in cache.layers]
    assert slots == [8 - 1 + KV_WINDOW_SLACK, 96, 8 - 1 + KV_WINDOW_SLACK, 96], slots


def test_input_weighted_top1_moe_is_its_definition():
    """MoELayer(weight_on_input=True): y = expert_e(w x) + shared(x) for each token's one expert e and sigmoid
    weight w; the router's gradient flows through the scaled input. Top-2 routing is refused, naming it."""
    torch.manual_seed(0)
    H, F, E, T = 16, 12, 4, 40
    router = build_router("topk", H, E, top_k=1, score="sigmoid", normalize=False, aux_loss_coeff=0.0)
    layer = MoELayer(H, F, E, router, shared_ffn_hidden_size=F, weight_on_input=True, backend="loop")
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    layer = layer.double()
    got = layer(x)
    logits = x @ layer.router.weight.t()
    top, idx = logits.max(dim=-1)
    w = torch.sigmoid(top)[:, None]
    w_in, w_out = layer.experts.w_in, layer.experts.w_out  # [E, H, 2F] (gate | up), [E, F, H]
    rows = []
    for t in range(T):
        h = (w[t] * x[t]) @ w_in[idx[t]]
        gate, up = h.chunk(2)
        rows.append((torch.nn.functional.silu(gate) * up) @ w_out[idx[t]])
    want = torch.stack(rows) + layer.shared_expert(x)
    torch.testing.assert_close(got, want)
    g_got = torch.autograd.grad(got.sum(), layer.router.weight)[0]
    g_want = torch.autograd.grad(want.sum(), layer.router.weight)[0]
    torch.testing.assert_close(g_got, g_want)
    two = MoELayer(H, F, E, build_router("topk", H, E, top_k=2), weight_on_input=True)
    with pytest.raises(ValueError, match=r"weight of its one expert, but the router gave 2 per token; route top-1"):
        two(torch.randn(4, H))


@pytest.mark.parametrize("over,match", [
    (dict(attention_chunk=8, sliding_window=4), "attends within chunks or within a window, not both"),
    (dict(attn_temperature_floor=8), "scales the queries of the NoPE layers, but model.nope_every is 0"),
    (dict(nope_every=-1), "model.nope_every=-1 is invalid"),
    (dict(router_weight_on_input=True, top_k=2), "needs top-1 routing, but model.top_k=2"),
    (dict(nope_every=1, qk_norm="unit"), "leaves no layer with RoPE"),
    (dict(attention="mla", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, nope_every=2),
     "apply to attention='gqa'"),
])
def test_bad_llama4_settings_are_refused(over, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=32, moe_ffn_hidden_size=16,
                    **over).validate()


def test_other_families_refuse_what_only_llama4_computes(tmp_path):
    from moekit.models.hf import save_hf

    for over, what in ((dict(nope_every=2, attn_temperature_floor=0, qk_norm="none", router_weight_on_input=False,
                             router_options={"normalize": True}, top_k=2, shared_ffn_hidden_size=0, moe_every=1,
                             attention_chunk=0, rope_pairs="half"), "Mixtral has no layers without RoPE"),
                       (dict(attention_chunk=8, nope_every=0, attn_temperature_floor=0, qk_norm="none",
                             router_weight_on_input=False, router_options={"normalize": True}, top_k=2,
                             shared_ffn_hidden_size=0, moe_every=1, rope_pairs="half"),
                        "Mixtral has no chunked attention")):
        with pytest.raises(ValueError, match=what):
            save_hf(build_model(llama4_config(**over)), tmp_path / "x", family="mixtral")
    model = build_model(llama4_config(top_k=1, router_weight_on_input=False))
    with pytest.raises(ValueError, match="Llama 4's router weight scales the expert's input; this model has "
                                         "router_weight_on_input=false"):
        save_hf(model, tmp_path / "y")


def test_the_multimodal_release_imports_its_language_model(tmp_path):
    """Llama-4-Scout's release: model_type llama4 with the text config nested, the language model's tensors under
    language_model., a vision tower and projector beside it (left out with a warning); it exports as llama4_text."""
    from moekit.models.hf import load_hf, save_hf

    flat, release, out = tmp_path / "flat", tmp_path / "release", tmp_path / "out"
    model = build_model(llama4_config(), seed=5)
    save_hf(model, flat)
    text = json.loads((flat / "config.json").read_text())
    release.mkdir()
    tensors = {"language_model." + k: v for k, v in load_file(flat / "model.safetensors").items()}
    tensors.update({"vision_model.patch_embedding.linear.weight": torch.zeros(4, 4),
                    "multi_modal_projector.linear_1.weight": torch.zeros(4, 4)})
    save_file(tensors, release / "model.safetensors")
    (release / "config.json").write_text(json.dumps({"model_type": "llama4", "architectures":
                                                     ["Llama4ForConditionalGeneration"], "text_config": text,
                                                     "vision_config": {"model_type": "llama4_vision_model"}}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        back = load_hf(release)
    assert any("skipping the vision tower" in str(w.message) and "2 tensors" in str(w.message) for w in caught)
    tokens = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens), model(tokens), rtol=0, atol=0)
    save_hf(back, out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama4_text"


def test_the_tiny_preset_trains(tmp_path):
    """moekit-train --preset llama4-tiny: chunks of 64 over 128-position sequences, NoPE layers with the
    temperature, input-weighted experts; the loss falls and every parameter moves."""
    from moekit.train.loop import main

    run = tmp_path / "run"
    assert main(["--preset", "llama4-tiny", "--steps", "6", "--train.seq_len", "128", "--batch-size", "4",
                 "--train.lr", "3e-3", "--eval.every", "0", "--eval.sequences", "8", "--log.every", "1",
                 "--log.progress", "off",
                 "--checkpoint.every", "0", "--log.tensorboard", "false", "--run-dir", str(run)]) == 0
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.2, losses


@pytest.mark.parametrize("change", [dict(attention_chunk=0), dict(attn_temperature_floor=0), dict(qk_norm="none"),
                                    dict(nope_every=0, attn_temperature_floor=0), dict(router_weight_on_input=False),
                                    dict(rope_pairs="half")])
def test_each_llama4_feature_shows_in_transformers_logits(tmp_path, change):
    """The round trip of tests/test_hf.py (FAMILY_CASES llama4_text) can fail for each part: the imported model
    without it no longer gives transformers' logits."""
    from moekit.models.hf import load_hf
    from tests.test_hf import FAMILY_CASES, hf_family_model, hf_logits, rel_err, tokens

    model_type, overrides = FAMILY_CASES["llama4_text"]
    ref = hf_family_model(tmp_path / "hf", model_type, overrides)
    model = load_hf(tmp_path / "hf")
    altered = build_model(dataclasses.replace(model.config, **change))
    altered.load_state_dict(model.state_dict())
    toks = tokens()
    want = hf_logits(ref, toks)
    with torch.no_grad():
        assert rel_err(model(toks), want) < 1e-5
        assert rel_err(altered(toks), want) > 1e-3, change


@pytest.mark.parametrize("name,params,active", [("llama-4-scout", 107.77e9, 17.17e9),
                                                ("llama-4-maverick", 400.71e9, 17.17e9)])
def test_release_presets_have_the_release_sizes(name, params, active):
    """Scout's text model (its release's 109B counts the vision tower too) and Maverick, counted on the meta
    device: total and active parameters (one routed expert and the shared one per MoE layer)."""
    from moekit.models.stats import model_stats

    stats = model_stats(preset(name))
    assert stats.params == pytest.approx(params, rel=1e-3) and stats.active_params == pytest.approx(active, rel=2e-3)


@pytest.mark.parametrize("change,match", [
    (dict(num_experts_per_tok=2), r"num_experts_per_tok=2 \(transformers' Llama4 scales each token's input"),
    (dict(no_rope_layers=[1, 0, 0, 1]), r"no_rope_layers=\[1, 0, 0, 1\] \(needs a per-layer RoPE / NoPE list"),
    (dict(moe_layers=[0, 3]), r"MoE layers \[0, 3\] of 4 \(moe_layers\)"),
])
def test_llama4_checkpoints_moekit_cannot_compute_are_refused(tmp_path, change, match):
    """config.json fields whose math moekit's model lacks are named before any weight is read."""
    from moekit.models.hf import UnsupportedCheckpoint, load_hf, save_hf

    save_hf(build_model(llama4_config(num_layers=4)), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(UnsupportedCheckpoint, match=match):
        load_hf(tmp_path)
