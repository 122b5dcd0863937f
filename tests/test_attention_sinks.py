"""gpt-oss's attention features: a learned sink logit per query head, a sliding window on the layers the pattern
picks, a bias on wo. Each path (SDPA with the sink as an extra key, the explicit bmm path, the KV cache) against
a reference written as the definition: masked scores, the sink column appended, softmax, the sink dropped."""
from __future__ import annotations

import json
import math

import pytest
import torch

from moekit.models import attention as A
from moekit.models.config import ModelConfig
from moekit.models.transformer import KVCache, build_model


@pytest.fixture
def mode():
    before = A.EXPLICIT_ATTENTION
    yield lambda m: setattr(A, "EXPLICIT_ATTENTION", m)
    A.EXPLICIT_ATTENTION = before


def reference(q, k, v, window, sinks, scale=None, start=0):
    """Per head, as transformers' eager gpt-oss attention: scores, causal (+ window) mask, cat sink, softmax,
    drop the sink. q [B, N, S, D], k / v [B, K, P, D] with P = start + S."""
    B, N, S, D = q.shape
    K, P = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    k, v = (t.repeat_interleave(N // K, dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * scale  # [B, N, S, P]
    qpos = torch.arange(start, start + S)[:, None]
    kpos = torch.arange(P)[None, :]
    visible = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
    scores = scores.masked_fill(~visible, -math.inf)
    if sinks is not None:
        scores = torch.cat((scores, sinks.view(1, N, 1, 1).expand(B, N, S, 1)), dim=-1)
    probs = scores.softmax(-1)[..., :P]
    return probs @ v


@pytest.mark.parametrize("N,K,S,window,with_sinks", [
    (4, 2, 11, 3, True), (4, 4, 7, 0, True), (6, 2, 9, 4, False), (2, 1, 5, 1, True), (4, 2, 6, 10, True)])
@pytest.mark.parametrize("path", ["sdpa", "explicit"])
def test_window_and_sinks_match_the_definition(mode, path, N, K, S, window, with_sinks):
    """Forward and the gradients of q, k, v and the sinks, float64, fresh random inputs (sinks of either sign and
    large enough to matter: a head can put most of its weight on the sink)."""
    mode("always" if path == "explicit" else "never")
    B, D = 2, 8
    q = torch.randn(B, N, S, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, K, S, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sinks = (torch.randn(N, dtype=torch.float64) * 3).requires_grad_() if with_sinks else None
    got = A.attend(q, k, v, None, N != K, window=window, sinks=sinks)
    want = reference(q, k, v, window, sinks)
    torch.testing.assert_close(got, want)
    inputs = (q, k, v) + ((sinks,) if with_sinks else ())
    g = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, inputs, g), torch.autograd.grad(want, inputs, g)):
        torch.testing.assert_close(a, b)


def test_sinks_take_weight_away():
    """A large sink logit drives a head's output to 0 (it attends to nothing); -inf sinks give plain attention."""
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mask = A.window_mask(0, 5, 0, "cpu")
    out = A.sink_attention(q, k, v, mask, torch.tensor([30.0, -1e4]), None, False)
    assert out[:, 0].abs().max() < 1e-6
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out[:, 1], plain[:, 1])


def test_window_mask():
    m = A.window_mask(2, 3, 2, "cpu")  # queries 2, 3, 4 over keys 0..4, each seeing itself and one before
    assert m.tolist() == [[False, True, True, False, False], [False, False, True, True, False],
                          [False, False, False, True, True]]
    assert A.window_mask(0, 3, 0, "cpu").tolist() == [[True, False, False], [True, True, False], [True, True, True]]


def gpt_oss_like(**kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, max_seq_len=32,
                num_experts=4, top_k=2, moe_ffn_hidden_size=16, attention_bias=True, attention_out_bias=True,
                attention_sinks=True, sliding_window=3, full_attention_every=2)
    return ModelConfig(**{**base, **kw})


def test_layer_pattern_and_parameters():
    cfg = gpt_oss_like()
    assert [cfg.attention_window(i) for i in range(4)] == [3, 0, 3, 0]  # gpt-oss: even layers slide
    assert [ModelConfig(sliding_window=5).attention_window(i) for i in range(3)] == [5, 5, 5]  # Mistral: all
    model = build_model(cfg, seed=0)
    assert [layer.attn.window for layer in model.layers] == [3, 0, 3, 0]
    names = dict(model.named_parameters())
    assert names["layers.0.attn.sinks"].shape == (4,) and names["layers.0.attn.wo.bias"].shape == (32,)
    plain = dict(build_model(ModelConfig(), seed=0).named_parameters())
    assert not any(n.endswith((".sinks", "wo.bias")) for n in plain)  # off by default: no new tensors


@pytest.mark.parametrize("bad,match", [
    (dict(sliding_window=-1), "sliding_window"), (dict(sliding_window=0, full_attention_every=2), "no window"),
    (dict(attention_sinks=1), "attention_sinks"),
    (dict(attention="mla", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
          attention_bias=False), "attention_out_bias|attention_sinks|sliding_window")])
def test_bad_attention_config(bad, match):
    with pytest.raises(ValueError, match=match):
        gpt_oss_like(**bad).validate()


def test_kv_cache_decoding_equals_the_full_forward():
    """Incremental decoding through windowed and sink layers (prompt, then one token at a time, then a chunk)
    gives the logits of one full forward: the window applies to cached keys as well."""
    torch.manual_seed(0)
    model = build_model(gpt_oss_like(), seed=1).eval()
    with torch.no_grad():
        for layer in model.layers:  # non-zero sinks and biases so they matter
            layer.attn.sinks.normal_(0, 2)
            layer.attn.wo.bias.normal_(0, 0.5)
        tokens = torch.randint(0, 64, (2, 12))
        full = model(tokens)
        cache = KVCache(model.config)
        parts = [model(tokens[:, :5], cache=cache)]
        parts += [model(tokens[:, i : i + 1], cache=cache) for i in range(5, 9)]
        parts.append(model(tokens[:, 9:], cache=cache))
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_training_learns_the_sinks():
    """The sinks and wo bias get gradients and move in a training step (they are trained parameters)."""
    model = build_model(gpt_oss_like(), seed=0)
    tokens = torch.randint(0, 64, (2, 16))
    loss = model(tokens, targets=torch.roll(tokens, -1, 1))
    loss.backward()
    for layer in model.layers:
        assert layer.attn.sinks.grad.abs().sum() > 0 and layer.attn.wo.bias.grad.abs().sum() > 0


@pytest.mark.parametrize("start,S,window", [(0, 5, 0), (9, 1, 4), (9, 3, 0), (20, 2, 6)])
def test_decoding_path_matches_the_definition(start, S, window):
    """The KV-cache step's sink attention (matmuls over the cached keys as they are) against the definition, with
    the queries at positions start .. start+S-1 over start+S keys; forward and every gradient, float64."""
    B, N, K, D = 2, 6, 2, 8
    q = torch.randn(B, N, S, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, K, start + S, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sinks = (torch.randn(N, dtype=torch.float64) * 2).requires_grad_()
    got = A.masked_sink_attention(q, k, v, A.window_mask(start, S, window, "cpu"), sinks)
    want = reference(q, k, v, window, sinks, start=start)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, (q, k, v, sinks), g), torch.autograd.grad(want, (q, k, v, sinks), g)):
        torch.testing.assert_close(a, b)


def test_the_attention_bench_peers_agree_and_it_writes_its_table(tmp_path, capsys):
    """tools/bench/attention_sinks.py: transformers' eager gpt-oss attention computes moekit's function (max err in
    the table, checked here), the saved bytes are counted, the JSON written; bad flags are one-line errors."""
    pytest.importorskip("transformers")
    from moekit.bench import attention_sinks

    out = tmp_path / "a.json"
    assert attention_sinks.main(["--seqs", "40", "--batch", "1", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                                 "--window", "8", "--warmup", "0", "--repeats", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    by = {r["peer"]: r for r in rows}
    assert set(by) == {"sdpa causal", "moekit sinks", "moekit sinks+window", "moekit one masked call",
                       "hf eager sinks+window"}
    assert by["hf eager sinks+window"]["max_err"] < 1e-5 and by["moekit sinks+window"]["ratio"] == 1.0
    assert by["moekit one masked call"]["max_err"] < 1e-5
    assert all(r["saved_mib"] > 0 for r in rows)
    with pytest.raises(SystemExit):
        attention_sinks.main(["--heads", "6", "--kv-heads", "4", "--out", str(out)])
    assert "--kv-heads 4 must divide --heads 6" in capsys.readouterr().err
