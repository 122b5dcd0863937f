"""The explicit causal attention (bmm + softmax + bmm, models.attention.EXPLICIT_ATTENTION) that CPU bf16 runs
instead of torch's SDPA: the same function as SDPA (GQA, its own scale, value width != key width), chosen only
where it was measured faster, and a model trained either way follows the same curve."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moekit.models import attention as A
from moekit.models.config import ModelConfig
from moekit.models.transformer import build_model


@pytest.fixture
def mode():
    """Set models.attention.EXPLICIT_ATTENTION for one test, restored after."""
    before = A.EXPLICIT_ATTENTION
    yield lambda m: setattr(A, "EXPLICIT_ATTENTION", m)
    A.EXPLICIT_ATTENTION = before


@pytest.mark.parametrize("B,N,K,S,Dqk,Dv,scale", [
    (2, 4, 2, 9, 8, 8, None),  # GQA, 2 query heads per key head
    (3, 6, 6, 5, 12, 7, 0.3),  # MLA-like: one key head per query head, own scale, narrower values
    (1, 8, 1, 17, 4, 4, None),  # MQA
    (2, 2, 2, 1, 4, 4, None),  # a single position
])
def test_explicit_attention_is_sdpa(B, N, K, S, Dqk, Dv, scale):
    """Forward and every input gradient equal SDPA's in float64 on fresh random inputs, from inputs laid out
    as the attention modules pass them (q / k / v transposed views of [B, S, heads, D])."""
    q, k, v = (torch.randn(B, S, n, d, dtype=torch.float64).transpose(1, 2).requires_grad_()
               for n, d in ((N, Dqk), (K, Dqk), (K, Dv)))
    got = A.explicit_causal_attention(q, k, v, scale)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a, b)


def test_explicit_attention_refuses_mismatched_heads():
    q, k = torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="N % K == 0"):
        A.explicit_causal_attention(q, k, k)


def test_auto_takes_the_explicit_path_only_where_measured_faster(mode):
    """auto: CPU bf16 / fp16 (also via autocast) up to the sequence and score caps; fp32, long sequences and big
    score tensors keep SDPA."""
    mode("auto")
    small = torch.empty(2, 4, 16, 8)
    assert not A._explicit_attention(small)
    assert A._explicit_attention(small.bfloat16()) and A._explicit_attention(small.half())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert A._explicit_attention(small)
    S = A.EXPLICIT_MAX_SEQ
    assert A._explicit_attention(torch.empty(1, 2, S, 8, dtype=torch.bfloat16))
    assert not A._explicit_attention(torch.empty(1, 2, S + 1, 8, dtype=torch.bfloat16))  # flash wins at long S
    heads = A.EXPLICIT_MAX_SCORES // (S * S) + 1  # B * N * S * S just over the element cap
    assert not A._explicit_attention(torch.empty(1, heads, S, 8, dtype=torch.bfloat16))
    mode("never")
    assert not A._explicit_attention(small.bfloat16())
    mode("always")
    assert A._explicit_attention(small)
    mode("sometimes")
    with pytest.raises(ValueError, match="EXPLICIT_ATTENTION='sometimes'"):
        A._explicit_attention(small)


def test_training_under_bf16_autocast_follows_the_sdpa_curve(mode):
    """A tiny GQA MoE model trained 4 steps under CPU bf16 autocast with the explicit path (what auto picks)
    and with SDPA: the losses agree to bf16 precision, and the explicit path really ran."""
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=64, max_seq_len=16,
                      ffn_hidden_size=48, num_experts=4, moe_ffn_hidden_size=16, top_k=2).validate()
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    curves = {}
    for m in ("auto", "never"):
        mode(m)
        model = build_model(cfg, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        calls = []
        original = A.explicit_causal_attention
        A.explicit_causal_attention = lambda *a, **kw: calls.append(1) or original(*a, **kw)
        try:
            losses = []
            for _ in range(4):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
        finally:
            A.explicit_causal_attention = original
        assert bool(calls) == (m == "auto")
        curves[m] = torch.tensor(losses)
    assert curves["auto"][-1] < curves["auto"][0]  # it trains
    torch.testing.assert_close(curves["auto"], curves["never"], rtol=2e-2, atol=0)


# ---------------------------------------------------------------------------------------------------
# Sliding-window layers in query blocks (models.attention.local_attention, WINDOW_BLOCK)
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def window_block():
    """Set models.attention.WINDOW_BLOCK for one test, restored after."""
    before = A.WINDOW_BLOCK
    yield lambda b: setattr(A, "WINDOW_BLOCK", b)
    A.WINDOW_BLOCK = before


def test_window_blocks_are_at_least_the_window_and_only_where_two_fit(window_block):
    window_block(256)
    assert A.window_block(4096, 128) == 256 and A.window_block(4096, 1000) == 1000
    assert A.window_block(511, 128) == 511 and A.window_block(512, 128) == 256  # one call below two blocks
    assert A.window_block(4096, 0) == 4096  # no window: never blocked
    window_block(0)
    assert A.window_block(4096, 128) == 4096


@pytest.mark.parametrize("block", [4, 8])
@pytest.mark.parametrize("S,window,start", [(32, 3, 0), (33, 6, 0), (32, 11, 0), (9, 4, 0), (20, 5, 13), (7, 3, 30)],
                         ids=["window3", "ragged-last-block", "window-over-blocks", "one-call", "cached-13",
                              "cached-30"])
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_blocked_window_attention_is_the_definition(window_block, block, S, window, start, sinks):
    """Queries at start .. start+S-1 in blocks over keys 0 .. start+S-1: forward and every gradient equal the
    masked softmax over all keys (float64), whether a block is shorter than the window or the last one ragged."""
    from tests.test_context_parallel import _reference

    window_block(block)
    g = torch.Generator().manual_seed(S * 31 + window + start + sinks)
    P = start + S
    q = torch.randn(2, 4, P, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, P, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sink = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True) if sinks else None
    want = _reference(q, k, v, window, sink)[:, :, start:]
    got = A.local_attention(q[:, :, start:], k, v, start, True, window=window, sinks=sink)
    torch.testing.assert_close(got, want)
    probe = torch.randn(want.shape, generator=g, dtype=torch.float64)
    inputs = [t for t in (q, k, v, sink) if t is not None]
    for a, b in zip(torch.autograd.grad((got * probe).sum(), inputs), torch.autograd.grad((want * probe).sum(), inputs)):
        torch.testing.assert_close(a, b)


def test_model_with_window_blocks_equals_one_masked_call(window_block):
    """gpt-oss-tiny's layers (sinks, a window of 8, alternating full layers): logits and gradients with 16-query
    blocks equal those of one masked call per layer; a KV cache's decoding equals the full forward."""
    from moekit.models.config import preset
    from moekit.models.transformer import KVCache

    cfg = preset("gpt-oss-tiny")
    cfg.sliding_window, cfg.num_layers = 8, 2
    tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(3))
    results = {}
    for block in (0, 16):
        window_block(block)
        model = build_model(cfg, seed=1)
        loss = model(tokens[:, :-1], targets=tokens[:, 1:])
        loss.backward()
        with torch.no_grad():
            cache = KVCache(cfg)
            steps = [model(tokens[:, :40], cache=cache)] + [model(tokens[:, i : i + 1], cache=cache)
                                                            for i in range(40, 64)]
            results[block] = (loss.detach(), [p.grad for p in model.parameters()], torch.cat(steps, dim=1),
                              model(tokens))
    (loss0, grads0, cached0, full0), (loss1, grads1, cached1, full1) = results[0], results[16]
    torch.testing.assert_close(loss1, loss0)
    for a, b in zip(grads1, grads0):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(full1, full0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cached1, full1, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cached0, full0, rtol=1e-4, atol=1e-4)


def test_windowed_layers_cache_a_ring_and_decode_as_the_full_forward():
    """gpt-oss-tiny, window 8: its sliding layers keep 8 - 1 + KV_WINDOW_SLACK slots; decoding 150 positions (a
    100-position prefill longer than the ring, then one token at a time, wrapping it twice) gives the full
    forward's logits; speculative decoding's take-back works within the slack and is refused past it."""
    from moekit.models.config import preset
    from moekit.models.transformer import KVCache

    cfg = preset("gpt-oss-tiny")
    cfg.sliding_window, cfg.num_layers = 8, 2
    model = build_model(cfg, seed=2).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 150), generator=torch.Generator().manual_seed(4))
    cache = KVCache(cfg)
    slots = 8 - 1 + A.KV_WINDOW_SLACK
    with torch.no_grad():
        full = model(tokens)
        steps = [model(tokens[:, :100], cache=cache)] + [model(tokens[:, i : i + 1], cache=cache)
                                                         for i in range(100, 150)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)
        assert [layer.keys.shape[2] for layer in cache.layers] == [slots, cfg.max_seq_len]  # sliding, full
        cache.truncate(147)  # a rejected draft of 3: decode them again
        torch.testing.assert_close(model(tokens[:, 147:150], cache=cache), full[:, 147:150], rtol=1e-4, atol=1e-4)
        with pytest.raises(ValueError, match="needs positions it overwrote"):
            cache.truncate(150 - A.KV_WINDOW_SLACK - 1)
        again = KVCache(cfg)  # the whole slack taken back right after a long prefill: its oldest kept positions
        model(tokens[:, :100], cache=again)
        back = 100 - A.KV_WINDOW_SLACK
        again.truncate(back)
        torch.testing.assert_close(model(tokens[:, back : back + 4], cache=again), full[:, back : back + 4],
                                   rtol=1e-4, atol=1e-4)
    small = KVCache(cfg, capacity=8 - 1 + A.KV_WINDOW_SLACK)  # no room to save: every position kept, no ring
    assert not small.layers[0].ring and small.layers[0].slots == small.capacity
