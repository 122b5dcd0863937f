"""QK-clip (models.qk_clip, --train.qk_clip): each head's largest logit against a float64 reference with the
layer's masks written out, the rescaling per attention kind (GQA, MHA, gated queries, biases, MLA) bringing a
clipped head's largest logit to exactly the bound and leaving the other heads and every other row alone, the same
clip under data, tensor and fully-sharded parallelism as in one process, and the trainer's flag."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from moekit.models import qk_clip
from moekit.models.config import preset
from moekit.models.transformer import build_model
from tests.dist_utils import run_ranks


def _reference_max(q, k, scale, q_pos, window=0, chunk=0, segments=None):
    """Per-head max of scale q . k over the allowed pairs, in float64 with every pair's mask spelled out
    (``segments`` [B, P]: each position's document; a pair across documents is not allowed)."""
    B, N, S, _ = q.shape
    K, P = k.shape[1], k.shape[2]
    best = torch.full((N,), -math.inf, dtype=torch.float64)
    for h in range(N):
        kh = k[:, h // (N // K)].double()
        logits = torch.einsum("bsd,bpd->bsp", q[:, h].double(), kh) * scale
        for b in range(B):
            for i in range(S):
                for j in range(P):
                    p = int(q_pos[i])
                    ok = j <= p and (not window or p - j < window) and (not chunk or p // chunk == j // chunk)
                    if ok and (segments is None or segments[b, p] == segments[b, j]):
                        best[h] = max(best[h], logits[b, i, j])
    return best


class _Holder(torch.nn.Module):
    def __init__(self, heads, window=0, chunk=0):
        super().__init__()
        self.window, self.chunk = window, chunk
        self.register_buffer("logit_max", torch.full((heads,), -math.inf))


@pytest.mark.parametrize("kv_heads,window,chunk,positions,documents", [
    (4, 0, 0, "plain", False), (2, 0, 0, "plain", False), (1, 5, 0, "plain", False), (2, 0, 4, "plain", False),
    (2, 0, 0, "zigzag", False), (2, 0, 0, "plain", True), (1, 5, 0, "zigzag", True),
])
def test_record_is_the_largest_allowed_logit(monkeypatch, kv_heads, window, chunk, positions, documents):
    """Causal pairs (within a window, or a chunk, when the layer has one; within a document under document masking),
    GQA key heads shared by several query heads, queries at zigzag positions over all the keys (context
    parallelism); blocks of 3 queries (a small BLOCK_ELEMENTS), the running maximum across two forwards."""
    monkeypatch.setattr(qk_clip, "BLOCK_ELEMENTS", 2 * 4 * 12 * 3)
    g = torch.Generator()
    B, N, S, D = 2, 4, 12, 8
    q_pos = torch.arange(S) if positions == "plain" else torch.tensor([0, 1, 2, 9, 10, 11, 3, 4, 5, 6, 7, 8])
    holder = _Holder(N, window, chunk)
    want = torch.full((N,), -math.inf, dtype=torch.float64)
    for _ in range(2):
        q, k = torch.randn(B, N, S, D, generator=g), torch.randn(B, kv_heads, S, D, generator=g)
        # documents of fresh random lengths per sequence (each position's count of document ends before it)
        segments = torch.randint(0, 4, (B, S), generator=g).eq(0).int().cumsum(1) if documents else None
        if documents:  # the largest logit of all sits across two documents, one position apart: unseen by the record
            p = int(q_pos[7])  # query 7's position; a document begins there
            q[0, :, 7], k[0, :, p - 1] = 0, 0
            q[0, :, 7, 0] = k[0, :, p - 1, 0] = 10  # logit 100 / sqrt(D) = 35; the other pairs stay below ~12
            segments[0, p:] += 1
        qk_clip.record(holder, q, k, D**-0.5, q_pos, segments)
        this = _reference_max(q, k, D**-0.5, q_pos, window, chunk, segments)
        if documents:  # the planted pair would be every head's maximum without the documents
            assert (this < _reference_max(q, k, D**-0.5, q_pos, window, chunk) - 10).all()
        want = torch.maximum(want, this)
    torch.testing.assert_close(holder.logit_max.double(), want, rtol=1e-5, atol=1e-5)


MLA = {"attention": "mla", "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6}
CASES = {
    "gqa": ("mixtral-tiny", {}),  # 4 query heads over 2 key heads: queries alone
    "mha": ("mixtral-tiny", {"num_kv_heads": 4}),  # queries and keys, sqrt each
    "gated-bias": ("mixtral-tiny", {"attention_output_gate": True, "attention_bias": True, "num_kv_heads": 4}),
    "mla": ("deepseek-tiny", dict(MLA, q_lora_rank=12)),
    "mla-full-q": ("deepseek-tiny", dict(MLA, q_lora_rank=0)),
}


def _one_layer(name):
    base, over = CASES[name]
    return dataclasses.replace(preset(base), num_layers=1, first_dense_layers=0, **over)


def _max_logits(model, tokens):
    qk_clip.track(model)
    model.train()
    model(tokens, targets=tokens).backward()  # a training forward records
    mod = qk_clip.tracked_modules(model)[0]
    return mod.logit_max.clone()


@pytest.mark.parametrize("name", list(CASES))
def test_clip_brings_each_clipped_head_to_the_bound(name):
    """One attention layer: after clip(tau) at the median head maximum, a second forward's maximum of every head
    that was over tau is tau (the layer's logits of that head scale by tau / S_h exactly), of every other head
    what it was; no weight other than the clipped heads' query (and MHA's key, MLA's key-nope) rows changed."""
    cfg = _one_layer(name)
    model = build_model(cfg, seed=1)
    with torch.no_grad():  # larger logits than the init's, spread over the heads; biases (0 at init) that matter
        for n, p in model.named_parameters():
            if ".attn." in n and p.dim() == 2:
                p.mul_(3.0)
            elif n.endswith(("wq.bias", "wk.bias")):
                p.normal_(std=0.5, generator=torch.Generator().manual_seed(len(n)))
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    before = _max_logits(model, tokens)
    tau = float(before.median())
    clipped = before > tau
    assert clipped.any() and (~clipped).any()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = qk_clip.clip(model, tau)
    assert stats["clipped_heads"] == int(clipped.sum()) and stats["max_logit"] == pytest.approx(float(before.max()))
    assert not torch.isfinite(qk_clip.tracked_modules(model)[0].logit_max).any()  # reset for the next step
    model.zero_grad()
    after = _max_logits(model, tokens)
    torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], tau), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(after[~clipped], before[~clipped], rtol=1e-5, atol=1e-5)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, weights[n])}
    want = {"gqa": {"wq.weight"}, "mha": {"wq.weight", "wk.weight"},
            "gated-bias": {"wq.weight", "wq.bias", "wk.weight", "wk.bias"},
            "mla": {"wq_b.weight", "wkv_b.weight"}, "mla-full-q": {"wq.weight", "wkv_b.weight"}}[name]
    assert changed == {f"layers.0.attn.{w}" for w in want}, changed
    attn = model.layers[0].attn
    if name == "gated-bias":  # the gate rows of every head untouched
        D = attn.head_dim
        gate = lambda w: w.view(attn.num_heads, 2 * D, -1)[:, D:]  # noqa: E731
        assert torch.equal(gate(attn.wq.weight), gate(weights["layers.0.attn.wq.weight"]))
    if name.startswith("mla"):  # the values' rows of wkv_b and the shared rope key untouched
        v = lambda w: w.view(attn.num_heads, attn.nope + attn.v_dim, -1)[:, attn.nope:]  # noqa: E731
        assert torch.equal(v(attn.wkv_b.weight), v(weights["layers.0.attn.wkv_b.weight"]))
        assert torch.equal(attn.wkv_a.weight, weights["layers.0.attn.wkv_a.weight"])


def test_evaluation_and_backward_recompute_do_not_record(monkeypatch):
    """No gradient (evaluation), or eval mode: nothing recorded; a fully checkpointed block's recompute in backward
    records nothing more (its forward did)."""
    from moekit.models.parallelize import apply_activation_checkpointing

    cfg = _one_layer("gqa")
    model = build_model(cfg, seed=1)
    qk_clip.track(model)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    mod = qk_clip.tracked_modules(model)[0]
    with torch.no_grad():
        model.train()(tokens, targets=tokens)
    model.eval()(tokens, targets=tokens)
    assert not torch.isfinite(mod.logit_max).any()
    apply_activation_checkpointing(model, "full")
    calls, real = [], qk_clip.record
    monkeypatch.setattr(qk_clip, "record", lambda *a: calls.append(1) or real(*a))
    model.train()(tokens, targets=tokens).backward()
    assert len(calls) == 1 and torch.isfinite(mod.logit_max).all()


def _clip_rank(rank, world, degrees):
    from moekit.comm.topology import Layout, Topology
    from moekit.models.hf.sharded import shard_box
    from moekit.models.parallelize import parallelize

    layout = Layout(**degrees)
    topo = Topology(layout, rank, world).build()
    cfg = dataclasses.replace(preset("mixtral-tiny"), num_layers=2, num_kv_heads=4)
    tokens = torch.randint(0, cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(3))
    ref = build_model(cfg, seed=4)
    qk_clip.track(ref)
    ref.train()(tokens[:, :-1], targets=tokens[:, 1:]).backward()
    tau = float(torch.cat([m.logit_max for m in qk_clip.tracked_modules(ref)]).median())
    want = qk_clip.clip(ref, tau)
    model = build_model(cfg, seed=4)
    parallelize(model, topo)
    qk_clip.track(model)
    D = layout.data_parallel
    share = tokens.view(D, 4 // D, 17)[topo.data_rank()]
    model.train()(share[:, :-1], targets=share[:, 1:]).backward()
    got = qk_clip.clip(model, tau, topo.group("stage"))
    assert got == pytest.approx(want), (got, want)
    full = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        if ".attn." not in n:
            continue
        box = shard_box(p, n)
        local = p.to_local() if hasattr(p, "to_local") else p
        torch.testing.assert_close(local, full[n][tuple(slice(r.start, r.stop) for r in box)], rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"{degrees} {n}: {m}")


@pytest.mark.parametrize("degrees", [dict(dp=2), dict(tp=2), dict(fsdp=2)], ids=["dp2", "tp2", "fsdp2"])
def test_clip_under_parallelism_equals_one_process(degrees):
    """Each rank records its tokens (dp, fsdp) or its heads (tp); the stage's all-reduce of the maxima gives the
    one-process maxima, and every rank's rows of the query and key weights come out as the one-process clip's."""
    run_ranks(_clip_rank, 2, degrees)


def test_trainer_flag_clips_and_records(tmp_path, capsys):
    """--train.qk_clip on the README's model: each step's metrics carry the largest logit and the heads clipped; a
    bound under the logits clips heads; refused where it cannot act."""
    from moekit.train import UserError
    from moekit.train.cli import parse_args
    from moekit.train.loop import main

    run = tmp_path / "run"
    flags = ["--steps", "3", "--batch-size", "4", "--train.seq_len", "32", "--model.num_layers", "2", "--eval.every",
             "0", "--log.every", "1", "--log.progress", "off", "--log.tensorboard", "false", "--checkpoint.every", "0"]
    assert main([*flags, "--run-dir", str(run), "--train.qk_clip", "0.1"]) == 0  # the init's largest logits: ~0.2
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(rows) == 3 and all(r["max_logit"] > 0 for r in rows) and rows[0]["qk_clipped_heads"] > 0
    assert "max_logit=" in capsys.readouterr().out
    for argv, said in ((["--train.qk_clip", "-1"], "--train.qk_clip=-1.0 is invalid"),
                       (["--preset", "qwen3.5-tiny", "--train.qk_clip", "100"], "q / k norms bound"),
                       (["--train.qk_clip", "100", "--train.activation_checkpointing", "selective"], "selective")):
        with pytest.raises(UserError, match=said):
            parse_args(argv)


def test_trainer_clips_alike_under_pipeline_and_context_parallelism(tmp_path):
    """The same clipped run (a bound the logits pass from the first step, so every step rescales heads) in one
    process, over 2 pipeline stages (each clips its own layers) and over 2 context-parallel ranks (each records its
    zigzag chunks' queries over every key at their global positions): one loss curve."""
    from tests.dist_utils import run_trainer

    common = ["--steps", "4", "--batch-size", "4", "--train.micro_batch_size", "2", "--train.seq_len", "32",
              "--model.num_layers", "2", "--model.aux_loss_coeff", "0", "--eval.every", "0", "--eval.sequences", "8",
              "--log.every", "1",
              "--log.progress", "off", "--checkpoint.every", "0", "--train.qk_clip", "0.1"]
    curves = {}
    for name, extra in (("one", []), ("pp2", ["--pp", "2", "--layout.pp_schedule", "gpipe"]), ("cp2", ["--cp", "2"])):
        r = run_trainer([*common, "--run-dir", str(tmp_path / name), *extra], nproc=1 if name == "one" else 2)
        assert r.returncode == 0, r.stderr[-3000:]
        curves[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert all(row["qk_clipped_heads"] > 0 for row in curves["one"])
    for name in ("pp2", "cp2"):
        assert [r["loss"] for r in curves[name]] == pytest.approx([r["loss"] for r in curves["one"]], rel=1e-5), name
