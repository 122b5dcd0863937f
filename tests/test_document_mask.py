"""Document masking (--data.document_mask; Transformer.document_eos): in a packed sequence, attention stays within
each document, so every document's logits are those of the document run alone.

The oracle is the model on each document by itself (positions from 0): RoPE makes attention depend on relative
positions only, and the routers here choose per token, so packed-and-masked equals alone up to float rounding.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moekit.models import attention as A
from moekit.models.attention import document_segments
from moekit.models.transformer import KVCache, build_model
from tests.test_parallelize import tiny_config

EOS = 0
MLA = dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=12)
OSS = dict(attention_sinks=True, sliding_window=3, full_attention_every=2, attention_bias=True,
           attention_out_bias=True, moe_ffn_bias=True, activation="swiglu_oai")


def test_segments_count_the_ends_before_each_position():
    tokens = torch.tensor([[5, 0, 7, 7, 0, 0, 3], [0, 1, 2, 3, 4, 5, 6]])
    assert document_segments(tokens, EOS).tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]
    assert document_segments(tokens, EOS).dtype == torch.int32


def _packed(lengths, vocab, seed):
    """One sequence of documents of these lengths, each ending in EOS (the last one may run off the end)."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, vocab, (n,), generator=g) for n in lengths]
    for d in docs[:-1]:
        d[-1] = EOS
    return docs


# Qwen3.5's layers: Gated DeltaNet (its state restarts per document, chunks of 8 over documents of 1 .. 17) and gated
# attention
QWEN3_5 = dict(linear_attention="gated_deltanet", full_attention_every=2, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=4, linear_chunk=8,
               attention_output_gate=True, norm_zero_centered=True, qk_norm="head")


@pytest.mark.parametrize("over", [{}, OSS, MLA, dict(OSS, sliding_window=5, full_attention_every=0), QWEN3_5],
                         ids=["gqa", "gpt-oss", "mla", "all-windowed", "qwen3.5"])
@pytest.mark.parametrize("block", [0, 4], ids=["one-call", "window-blocks"])
def test_each_document_is_the_document_alone(over, block, monkeypatch):
    """Two packed sequences (documents of 5, 9, 10 and of 1, 17, 6 positions): logits of every document equal the
    model's on that document alone, and the loss's gradients equal those of the per-document losses; without
    document masking the later documents' logits differ (what the mask changes)."""
    monkeypatch.setattr(A, "WINDOW_BLOCK", block)
    monkeypatch.setattr(A, "EXPLICIT_ATTENTION", "never")
    cfg = tiny_config(aux_loss_coeff=0.0, z_loss_coeff=0.0, **over)
    rows = [_packed([5, 9, 10], cfg.vocab_size, 1), _packed([1, 17, 6], cfg.vocab_size, 2)]
    tokens = torch.stack([torch.cat(docs) for docs in rows])  # [2, 24]
    targets = torch.randint(0, cfg.vocab_size, tokens.shape, generator=torch.Generator().manual_seed(3))
    model = build_model(cfg, seed=4)
    plain = model(tokens).detach()
    model.document_eos = EOS
    packed = model(tokens)
    model.document_eos = None
    alone = torch.cat([torch.cat([model(d[None])[0] for d in docs]) for docs in rows]).view_as(packed)
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(plain[:, 9:], alone[:, 9:], atol=1e-3)  # unmasked, later documents see earlier ones
    # gradients: the masked mean loss over both rows = the mean over every position of the documents alone
    model.document_eos = EOS
    want = torch.autograd.grad(F.cross_entropy(alone.flatten(0, 1), targets.flatten()), list(model.parameters()),
                               allow_unused=True)
    got = torch.autograd.grad(model(tokens, targets=targets), list(model.parameters()), allow_unused=True)
    for (name, _), a, b in zip(model.named_parameters(), got, want):
        if b is None:
            assert a is None or not a.abs().any(), name
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_document_masking_refuses_a_kv_cache():
    model = build_model(tiny_config(), seed=0)
    model.document_eos = EOS
    with pytest.raises(ValueError, match="document masking .* is for training forwards"):
        model(torch.ones(1, 4, dtype=torch.long), cache=KVCache(model.config))


def test_multi_token_prediction_depths_attend_within_documents():
    """The depths' blocks attend within position i's document: changing the first document leaves the depth's
    states over the second one unchanged with masking on, and changes them with it off."""
    from moekit.models.mtp import depth_states
    from moekit.models.transformer import sequence_segments

    cfg = tiny_config(mtp_layers=1, aux_loss_coeff=0.0, z_loss_coeff=0.0)
    model = build_model(cfg, seed=5)
    a = torch.cat(_packed([6, 10], cfg.vocab_size, 7))[None]  # documents at positions 0-5 and 6-15
    b = a.clone()
    b[0, 1:5] = torch.randint(1, cfg.vocab_size, (4,), generator=torch.Generator().manual_seed(8))

    def states(tokens):
        segments = sequence_segments(model, tokens)
        cos, sin = A.rope_tables(cfg, tokens.shape[1], "cpu")
        x = model.norm(_hidden(model, tokens, segments, cos, sin))
        return next(depth_states(model, x, model.embed(tokens), tokens, cos, sin, segments))[1]

    with torch.no_grad():
        model.document_eos = EOS
        torch.testing.assert_close(states(a)[:, 6:], states(b)[:, 6:])
        model.document_eos = None
        assert not torch.allclose(states(a)[:, 6:], states(b)[:, 6:])


def _hidden(model, tokens, segments, cos, sin):
    x = model.embed(tokens)
    for layer in model.layers:
        x = layer(x, cos, sin, tokens, segments=segments)
    return x


def test_trainer_masks_documents_of_prepared_data_and_refuses_data_without_ends(tmp_path, capsys):
    """--data.document_mask true on a moekit-prepare'd byte set (EOS 256 between the files' lines): the run trains
    and its losses differ from the unmasked run's from the first step (sequences span documents); the embedded
    corpus marks no document ends and is refused in one line."""
    import json

    from moekit.train.loop import main as train
    from moekit.train.prepare import main as prepare

    doc = tmp_path / "docs.txt"
    doc.write_text("\n".join(f"document {i}: " + "moe " * (i % 7 + 3) for i in range(400)) + "\n")
    data = tmp_path / "docs.bin"
    assert prepare([str(doc), "--tokenizer", "bytes", "--docs-per-line", "-o", str(data)]) == 0
    tiny = ["--steps", "2", "--batch-size", "4", "--train.seq_len", "64", "--model.hidden_size", "32",
            "--model.num_layers", "2", "--model.vocab_size", "257", "--eval.every", "0", "--eval.sequences", "8",
            "--log.progress", "off",
            "--checkpoint.every", "0", "--data.path", str(data)]
    runs = {}
    for mask in ("false", "true"):
        run_dir = tmp_path / f"run-{mask}"
        keep = ["--checkpoint.every", "2"] if mask == "true" else []  # a checkpoint for moekit-eval
        assert train([*tiny, *keep, "--run-dir", str(run_dir), "--data.document_mask", mask]) == 0
        runs[mask] = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert runs["true"][0] != pytest.approx(runs["false"][0], rel=1e-6)
    # moekit-eval evaluates as the run trained (auto), or as told
    from moekit.train.evaluate import main as evaluate

    losses = {}
    for choice in ("auto", "on", "off"):
        out = tmp_path / f"eval-{choice}.json"
        assert evaluate([str(tmp_path / "run-true"), "--batches", "2", "--quiet", "--document-mask", choice,
                         "--out", str(out)]) == 0
        result = json.loads(out.read_text())
        losses[choice] = result["loss"]
        assert result["document_mask"] == (choice != "off")
    assert losses["auto"] == losses["on"] != pytest.approx(losses["off"], rel=1e-6)
    # two pipeline stages (each splits its micro-batches at EOS itself) follow the one-process masked curve
    from tests.test_train_distributed import run

    micro = ["--train.micro_batch_size", "2", "--data.document_mask", "true"]
    r = run([*tiny, *micro, "--run-dir", str(tmp_path / "one")])
    assert r.returncode == 0, r.stderr[-2000:]
    r = run([*tiny, *micro, "--run-dir", str(tmp_path / "pp2"), "--pp", "2"], nproc=2)
    assert r.returncode == 0, r.stderr[-2000:]
    one, pp2 = ([json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                for d in ("one", "pp2"))
    assert pp2 == pytest.approx(one, rel=1e-5, abs=1e-6)
    capsys.readouterr()
    assert train(["--steps", "1", "--run-dir", str(tmp_path / "bad"), "--data.document_mask", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs the data's end-of-document id" in err, err
