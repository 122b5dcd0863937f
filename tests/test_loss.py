"""models.loss.chunked_lm_loss (the trainer's loss from hidden states, in token chunks) against the logits
path, F.cross_entropy(F.linear(h, W).float(), y): values and gradients, chunk sizes that do and do not
divide the tokens, autocast, a tied head, the model's ``targets=`` entry, what it keeps for backward."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from moekit.models import transformer
from moekit.models.config import ModelConfig
from moekit.models.loss import chunked_lm_loss
from tests.helpers import gen


def case(N, H, V, key):
    g = gen(*key)
    h = torch.randn(N, H, generator=g, requires_grad=True)
    w = (torch.randn(V, H, generator=g) * 0.2).requires_grad_()
    y = torch.randint(0, V, (N,), generator=g)
    return h, w, y


def grads(loss_fn, h, w, y):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = loss_fn(h, w, y)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def plain(h, w, y):
    return F.cross_entropy(F.linear(h, w).float(), y)


@pytest.mark.parametrize("chunk", [1, 7, 64, 100, 4096])
def test_float32_matches_the_logits_path(chunk):
    h, w, y = case(100, 24, 130, ("fp32", chunk))
    got = grads(lambda *a: chunked_lm_loss(*a, chunk=chunk), h, w, y)
    want = grads(plain, h, w, y)
    for name, a, b in zip(("loss", "dh", "dw"), got, want):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, msg=name)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_ignored_targets_count_as_in_cross_entropy(chunk):
    """-100 targets (HF's label masking) add nothing and the mean is over the others, as F.cross_entropy's
    ignore_index; a chunk of only ignored positions included. All ignored: loss 0 and no gradient (F gives nan)."""
    h, w, y = case(100, 24, 130, ("ignore", chunk))
    g = gen("ignore-mask", chunk)
    y = y.masked_fill(torch.rand(100, generator=g) < 0.4, -100)
    y[10:30] = -100  # whole chunks of 7 (and of 1) with nothing to count
    got = grads(lambda *a: chunked_lm_loss(*a, chunk=chunk), h, w, y)
    want = grads(plain, h, w, y)
    for name, a, b in zip(("loss", "dh", "dw"), got, want):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, msg=name)
    assert got[1][10:30].abs().max() == 0  # ignored positions get no gradient
    loss, dh, dw = grads(lambda *a: chunked_lm_loss(*a, chunk=chunk), h, w, torch.full((100,), -100))
    assert loss.item() == 0 and dh.abs().max() == 0 and dw.abs().max() == 0


def test_bf16_autocast_matches_the_logits_path_to_bf16_rounding():
    h, w, y = case(200, 32, 300, ("bf16",))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = grads(lambda *a: chunked_lm_loss(*a, chunk=64), h, w, y)
        want = grads(plain, h, w, y)
    exact = grads(plain, h.double(), w.double(), y)
    for name, a, b, r in zip(("loss", "dh", "dw"), got, want, exact):
        assert a.dtype == b.dtype, name  # fp32 loss, fp32 grads of fp32 leaves, as autocast gives
        err, err_plain = (a.double() - r).abs().max(), (b.double() - r).abs().max()
        assert err <= 2 * err_plain + 1e-3 * r.abs().max(), (name, float(err), float(err_plain))


def test_batched_targets_and_leading_dims():
    h, w, y = case(60, 16, 50, ("batched",))
    got = chunked_lm_loss(h.view(3, 20, 16), w, y.view(3, 20), chunk=16)
    torch.testing.assert_close(got, plain(h, w, y))


def test_keeps_gradients_not_logits():
    """What autograd keeps between forward and backward: the [N, H] and [V, H] gradients, not [N, V]."""
    N, H, V = 256, 16, 2048
    h, w, y = case(N, H, V, ("memory",))

    def saved_bytes(fn):
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(h, w, y)
        return sum(seen.values())

    logits_bytes = N * V * 4
    assert saved_bytes(plain) >= logits_bytes
    chunked = saved_bytes(lambda *a: chunked_lm_loss(*a, chunk=64))
    assert chunked <= (N * H + V * H) * 4 + 1024 < logits_bytes / 4


def test_model_targets_entry_equals_cross_entropy_of_its_logits(monkeypatch):
    cfg = ModelConfig(vocab_size=97, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, ffn_hidden_size=48,
                      num_experts=4, moe_ffn_hidden_size=24, top_k=2, max_seq_len=32, tie_embeddings=True)
    model = transformer.Transformer(cfg)
    model.init_weights(seed=3)
    tokens = torch.randint(0, 97, (2, 12), generator=gen("model"))
    targets = torch.randint(0, 97, (2, 12), generator=gen("model", "y"))
    outs = []
    for mode in ("auto", "never"):
        monkeypatch.setattr(transformer, "LOSS_CHUNKS", mode)
        model.zero_grad()
        loss = model(tokens, targets=targets)
        loss.backward()
        outs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = outs
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b, F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()))
    assert ga.keys() == gb.keys() and "embed.weight" in ga  # the tied head's gradient joins the embedding's
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_head_that_is_not_a_plain_tensor_takes_the_logits_path(monkeypatch):
    class Sharded(torch.Tensor):  # stands in for a tensor-parallel DTensor head
        pass

    w = torch.zeros(4, 3)
    assert transformer.chunked_loss_applies(w) and transformer.chunked_loss_applies(torch.nn.Parameter(w))
    assert not transformer.chunked_loss_applies(w.as_subclass(Sharded))
    monkeypatch.setattr(transformer, "LOSS_CHUNKS", "sometimes")
    with pytest.raises(ValueError, match="LOSS_CHUNKS='sometimes'"):
        transformer.chunked_loss_applies(w)


def test_bad_arguments_are_named():
    h, w, y = case(10, 8, 20, ("bad",))
    with pytest.raises(ValueError, match="targets must have hidden's shape"):
        chunked_lm_loss(h, w, y[:9])
    with pytest.raises(ValueError, match=r"must be \[V, H=8\]"):
        chunked_lm_loss(h, w[:, :7], y)
    with pytest.raises(ValueError, match="chunk=0"):
        chunked_lm_loss(h, w, y, chunk=0)
