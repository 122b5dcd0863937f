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
