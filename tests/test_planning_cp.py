"""The planner (moekit.train.planning) under context parallelism: each rank holds S / cp positions of every sequence,
attention keeps the whole sequence's keys and values, FSDP shards dense tensors over fsdp x cp and experts over
dp x fsdp x cp / ep. Estimates against memory measured on real gloo ranks (tests/test_dryrun.py's way: the storages
still alive after a forward), with document masking too, parameter shards against the recipe's, and the dry run's
report."""
import dataclasses

import pytest
import torch

from moekit.comm.topology import Layout, Topology
from moekit.models import attention
from moekit.models.config import preset
from moekit.models.parallelize import parallelize
from moekit.models.transformer import build_model
from moekit.train.planning import activations as A
from moekit.train.planning import dryrun
from moekit.train.planning.memory import Workload, all_to_all, estimate_memory
from tests.dist_utils import run_ranks
from tests.test_dryrun import EOS, compare, measure, packed_tokens

B, S = 2, 64  # one micro-batch of whole sequences; each cp rank holds S / cp positions of both
# MLA with equal q / v head dims: CPU SDPA then runs its flash kernel (with Dqk != Dv it falls back to the math path)
MLA = dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, q_lora_rank=12)

CASES = {  # name: (preset, overrides, activation checkpointing, dtype)
    # plain GQA: the gathered [B, K, S, 2D], a mask per chunk but rank 0's first, wo's copy of the outputs
    "gqa": ("mixtral-tiny", {}, "none", "float32"),
    # sinks (sink_attention's widened copies per chunk, the gathered keys freed), a 6-position window on layer 0
    # (narrower than a chunk at cp 4)
    "gpt-oss": ("gpt-oss-tiny", {"sliding_window": 6}, "none", "float32"),
    # the gathered latent expanded to k, v of all S positions on every rank; dense first layer, shared expert
    "mla": ("deepseek-tiny", MLA, "none", "float32"),
    # autocast: the gather in bf16, every projection's cast input, the expert biases' casts the loop keeps
    "gpt-oss-bf16": ("gpt-oss-tiny", {"sliding_window": 6}, "none", "bfloat16"),
    # the selective checkpoint caches the all-gather's output (a functional collective) and each chunk's SDPA
    "gpt-oss-selective": ("gpt-oss-tiny", {"sliding_window": 6}, "selective", "float32"),
    "gqa-full": ("mixtral-tiny", {}, "full", "float32"),
    # a dense first layer, a shared expert; with tp 2 and sequence parallelism: residual and MoE on S / cp / tp
    "deepseek": ("deepseek-tiny", {}, "none", "float32"),
    # the window's blocks inside each chunk (models.attention.local_attention; WINDOW_BLOCK 8 here: 2 per chunk),
    # each over 16 keys, not the 8 + 5 its window reaches (a multiple of 16; the block at position 0: 8)
    "gpt-oss-blocks": ("gpt-oss-tiny", {"sliding_window": 6}, "none", "float32"),
    # document masking (DOCUMENTS): every chunk's call masked, rank 0's first too, by a [B, 1, c, keys] mask
    "gqa-documents": ("mixtral-tiny", {}, "none", "float32"),
    # sinks and window blocks of 16 keys, the full layer's chunks masked (c query rows, not sink_attention's P')
    "gpt-oss-blocks-documents": ("gpt-oss-tiny", {"sliding_window": 6}, "none", "float32"),
    "mla-documents": ("deepseek-tiny", MLA, "none", "float32"),
    # checkpointed blocks keep the whole sequences' documents [B, S] int32 (from the gathered token ids)
    "gpt-oss-selective-documents": ("gpt-oss-tiny", {"sliding_window": 6}, "selective", "float32"),
    "gqa-full-documents": ("mixtral-tiny", {}, "full", "float32"),
    # two multi-token-prediction depths on every local position, each with its own embedding of the ids ahead
    "deepseek-mtp": ("deepseek-tiny", {"mtp_layers": 2}, "none", "float32"),
    # a Gated DeltaNet layer (its chunks' affine maps, the gathered maps and convolution tails) and a gated GQA one
    "qwen3.5": ("qwen3.5-tiny", {"full_attention_every": 2, "linear_chunk": 8}, "none", "float32"),
    "qwen3.5-documents": ("qwen3.5-tiny", {"full_attention_every": 2, "linear_chunk": 8}, "none", "float32"),
}
BLOCKS = {"gpt-oss-blocks": 8, "gpt-oss-blocks-documents": 8}  # models.attention.WINDOW_BLOCK (else the default)
DOCUMENTS = {name for name in CASES if name.endswith("-documents")}  # Transformer.document_eos = EOS


def _config(name: str, over: dict):
    return dataclasses.replace(preset(name), num_layers=2, **over)


def _measure_rank(rank: int, layout: Layout, case: str, ranks_per_node: int,
                  sp: bool = False) -> tuple[dict, Topology, object]:
    name, over, mode, dtype = CASES[case]
    cfg = _config(name, over)
    topo = Topology(layout, rank, ranks_per_node=ranks_per_node).build()
    if case in DOCUMENTS:  # documents ending at 5, 20, 40 and 30: across chunks (16 positions at cp 2, 8 at cp 4)
        tokens, targets = packed_tokens(cfg, seed=topo.data_rank())
    else:
        gen = torch.Generator().manual_seed(topo.data_rank())  # the cp ranks of a data rank split the same sequences
        tokens, targets = (torch.randint(0, cfg.vocab_size, (B, S), generator=gen) for _ in range(2))
    model = build_model(cfg, seed=0)
    model.document_eos = EOS if case in DOCUMENTS else None
    done = parallelize(model, topo, activation_checkpointing=mode, sequence_parallel=sp)
    tokens, targets = done.context.shard(tokens), done.context.shard(targets)  # this rank's zigzag chunks
    model.train()
    autocast = torch.bfloat16 if dtype == "bfloat16" else None
    return measure(model, tokens, targets, autocast=autocast), topo, done


def _exact_ranks(rank: int, world: int, layout: Layout, cases: list[str], sp: bool = False):
    """ep == 1: no routing imbalance, so each rank's activations are its estimate's up to a few small tensors (the
    estimate is above by 0.2-2.7 KiB here, 4.5 KiB with two MTP depths, whose MoE rows and loss are the kept
    positions' (rank 0, holding the sequences' ends, keeps 66 kB less than rank 1); less than the masks of the
    layers, 2-5 KiB each, which the CPU's prefix
    chunks (PrefixCausalAttention) do not keep, and than the documents checkpoints keep, 512 bytes, where the
    estimate is 220 bytes above: each term is seen); parameters, gradients and AdamW state exactly."""
    default = attention.WINDOW_BLOCK
    for case in cases:
        attention.WINDOW_BLOCK = BLOCKS.get(case, default)  # the model's calls and the estimate's alike
        measured, topo, _ = _measure_rank(rank, layout, case, world, sp)
        name, over, mode, dtype = CASES[case]
        cfg, index = _config(name, over), topo.coords().cp
        documents = case in DOCUMENTS
        est = estimate_memory(cfg, layout, Workload(B, S, dtype, mode, "cpu", sequence_parallel=sp, cp_rank=index,
                                                    document_mask=documents))
        ratios = compare(measured, est)
        print(f"rank {rank} {case} {layout}: measured {measured['activations']} estimate {est.activations} {ratios}")
        assert (est.params, est.grads, est.optimizer) == (measured["params"], measured["grads"], measured["optimizer"])
        slack = 2048 * (cfg.num_layers + cfg.mtp_layers)  # per attention layer (the masks above), MTP depths too
        assert 0 <= est.activations - measured["activations"] <= slack, (case, measured, est.breakdown)
        # the planner's figure (no cp_rank) is the cp rank that keeps the most
        wl = Workload(B, S, dtype, mode, "cpu", sequence_parallel=sp, document_mask=documents)
        assert estimate_memory(cfg, layout, wl).activations == max(
            estimate_memory(cfg, layout, dataclasses.replace(wl, cp_rank=r)).activations for r in range(layout.cp))
    attention.WINDOW_BLOCK = default


def test_estimate_matches_cp2_ranks():
    run_ranks(_exact_ranks, 2, Layout(cp=2), list(CASES))


def _cp4_and_fsdp(rank: int, world: int):
    _exact_ranks(rank, world, Layout(cp=4), ["gqa", "gpt-oss", "mla-documents"])
    _exact_ranks(rank, world, Layout(cp=2, tp=2), ["deepseek"], sp=True)
    # FSDP over fsdp x cp = 4 ranks (dense dim 0), experts over ep 2 and then their dim 1 over dp x fsdp x cp / ep;
    # routing imbalance between ranks leaves the activations within compare's 20%, the all-to-all bytes 25%
    layout = Layout(fsdp=2, cp=2, ep=2)
    measured, topo, done = _measure_rank(rank, layout, "gqa", world)
    cfg, wl = _config("mixtral-tiny", {}), Workload(B, S, "float32", "none", "cpu", cp_rank=topo.coords().cp)
    est = estimate_memory(cfg, layout, wl, ranks_per_node=world)
    ratios = compare(measured, est)
    print(f"rank {rank} fsdp2 x cp2 x ep2: {ratios}")
    assert (est.params, est.grads, est.optimizer) == (measured["params"], measured["grads"], measured["optimizer"])
    sent = sum(v for k, v in done.traffic.snapshot().items() if k.endswith("_intra"))
    expected = all_to_all(cfg, layout, wl, ranks_per_node=world).forward["intra"]
    assert abs(sent / expected - 1) <= 0.25, (sent, expected)


def test_estimate_matches_cp4_and_fsdp_over_cp_ranks():
    run_ranks(_cp4_and_fsdp, 4)


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("cp,S,window,block", [
    (1, 64, 0, 256), (1, 64, 6, 16), (1, 64, 6, 256), (1, 70, 5, 8), (1, 64, 3, 32),
    (2, 64, 0, 256), (2, 64, 6, 8), (2, 96, 6, 8), (4, 64, 6, 256), (4, 128, 3, 4),
])
def test_calls_are_the_calls_attention_makes(monkeypatch, documents, cp, S, window, block):
    """The planner's ``_calls`` (queries, keys, masked) of every cp rank are the calls models.attention makes on CPU,
    recorded from positioned_attention (masked: it builds a span mask): window blocks reading a multiple of 16 keys
    (fewer only from position 0), context-parallel chunks (after the first, without a window: PrefixCausalAttention,
    no mask, unless q and v differ in width as MLA's may), every call masked with documents."""
    from moekit.comm.context_parallel import ContextParallel

    monkeypatch.setattr(attention, "WINDOW_BLOCK", block)
    calls, masks = [], []
    positioned, span = attention.positioned_attention, attention.span_mask

    def record(q, k, *args, **kwargs):
        masks.append(False)
        calls.append((q.shape[2], k.shape[2]))
        return positioned(q, k, *args, **kwargs)

    def record_mask(*args, **kwargs):
        masks[-1] = True
        return span(*args, **kwargs)

    monkeypatch.setattr(attention, "positioned_attention", record)
    monkeypatch.setattr(attention, "span_mask", record_mask)
    cfg = dataclasses.replace(preset("mixtral-tiny"), sliding_window=window)
    for rank, width in [(r, w) for r in range(cp) for w in (8, 6)]:  # v as wide as q, k, or narrower
        calls.clear(), masks.clear()
        x = torch.randn(1, 1, S, 8)
        v = x[..., :width].contiguous()
        segments = torch.zeros(1, S, dtype=torch.int32) if documents else None
        if cp == 1:
            attention.attend(x, x, v, None, False, window=window, segments=segments)
            if not calls:  # no window, no documents: attend's own causal SDPA, one unmasked call
                calls.append((S, S)), masks.append(False)
        else:
            context = ContextParallel(cp, rank)
            attention.context_attend(context.shard(x, dim=2), x, v, context, False, window=window, segments=segments)
        s = A.shapes(cfg, Layout(cp=cp), Workload(1, S, "float32", "none", "cpu", document_mask=documents))
        planned = A._calls(s, rank, window, same_widths=width == 8)
        assert planned == [(n, P, m) for (n, P), m in zip(calls, masks)], (rank, width, calls, masks)


# ---------------------------------------------------------------------------------------------------
# Parameters per rank, tokens per rank, the report
# ---------------------------------------------------------------------------------------------------


def _expected_shards(cfg, layout: Layout) -> dict[str, int]:
    """mixtral-tiny's elements per rank by part, by hand: dense tensors' dim 0 over fsdp x cp when fsdp > 1
    (else whole), experts' dim 0 over ep and dim 1 over dp x fsdp x cp / ep when fsdp > 1."""
    H, E, F, L, V = cfg.hidden_size, cfg.num_experts, cfg.moe_ffn_hidden_size, cfg.num_layers, cfg.vocab_size
    N, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.attn_head_dim
    shard = layout.fsdp * layout.cp if layout.fsdp > 1 else 1
    edp = layout.dp * layout.fsdp * layout.cp // layout.ep if layout.fsdp > 1 else 1

    def rows(n: int) -> int:  # every dim 0 here divides evenly
        return n // shard

    return {"attention": L * (rows(N * D) * H + rows(K * D) * H * 2 + rows(H) * N * D), "embedding": rows(V) * H,
            "head": rows(V) * H, "norms": (2 * L + 1) * rows(H), "router": L * rows(E) * H,
            "experts": L * (E // layout.ep) * (H // edp * 2 * F + F // edp * H)}


@pytest.mark.parametrize("flags,layout", [
    (["--dp", "2", "--fsdp", "2", "--cp", "2", "--ep", "4"], Layout(dp=2, fsdp=2, cp=2, ep=4)),
    (["--dp", "2", "--cp", "2", "--ep", "2"], Layout(dp=2, cp=2, ep=2)),  # no FSDP: cp ranks hold replicas
])
def test_parameter_shards_per_rank(capsys, flags, layout):
    """The recipe's real shards (the dry run's meta model at 8 / 4 fake ranks) are the estimate's, part by part, and
    both are the hand count: at dp2 x fsdp2 x cp2 FSDP shards dense tensors 4 ways, not fsdp's 2, and the experts
    over the 2 ranks of 8 / ep 4 holding the same ones (counting fsdp alone gave twice these); without FSDP the cp
    ranks hold whole replicas."""
    cfg = preset("mixtral-tiny")
    est = estimate_memory(cfg, layout, Workload(2, 128, "bfloat16"))
    assert est.param_numel == _expected_shards(cfg, layout)
    rc = dryrun.main(["--dry-run", "--world-size", str(layout.world_size), *flags, "--batch-size", "8",
                      "--train.seq_len", "128"])
    out = capsys.readouterr().out
    assert rc == 0 and "the estimate agrees" in out and "MISMATCH" not in out, out


def test_per_token_terms_shrink_cp_times_and_attention_keeps_whole_sequences():
    """At the same micro-batch, cp 4 holds a quarter of each sequence: everything per token (residual, norms, the MoE
    layer, the token ids, all-to-all bytes) is a quarter; attention is more than a quarter (the keys and values of
    every position are gathered, and kept)."""
    cfg = preset("mixtral-8x7b")
    wl = Workload(1, 32768, "bfloat16", "none", "cuda")
    one, four = Layout(fsdp=8, ep=8), Layout(fsdp=2, cp=4, ep=8)  # the same 8 ranks per EP group and FSDP mesh
    a, b = estimate_memory(cfg, one, wl), estimate_memory(cfg, four, wl)
    assert a.param_numel == b.param_numel
    for part in ("residual", "norms", "router", "dispatch", "experts", "ffn_input", "embedding"):
        assert b.breakdown[part] * 4 == pytest.approx(a.breakdown[part], rel=1e-3), part
    short = Workload(1, 4096, "bfloat16", "none", "cuda")  # under one loss chunk: the logits of 4096 / 1024 tokens
    head = cfg.vocab_size * cfg.hidden_size * 2  # the head's cast, whatever the tokens
    logits = [estimate_memory(cfg, layout, short).breakdown["transient_logits"] - head for layout in (one, four)]
    assert logits[1] * 4 == logits[0]
    assert b.breakdown["attention"] * 4 > 1.2 * a.breakdown["attention"]
    steps = [all_to_all(cfg, layout, wl, ranks_per_node=8).step["intra"] for layout in (one, four)]
    assert steps[1] * 4 == pytest.approx(steps[0])


@pytest.mark.parametrize("lower_right", [True, False], ids=["bottom-right", "masked"])
def test_cuda_context_attention_terms(monkeypatch, lower_right):
    """On CUDA a later chunk (every key before its queries visible) runs as one unmasked flash call aligned
    bottom-right (models.attention.CUDA_LOWER_RIGHT, the default): every chunk then keeps only views of the
    gathered [B, K, S, 2D]. With it off, a masked GQA chunk expands its keys and values to the query heads
    (models.attention.masked_sdpa): those copies are kept, and the gathered keys only while an unmasked chunk
    (rank 0's first) reads them. cp 2, S 4096, c 1024: rank 0 runs chunk 0 unmasked and chunk 3 over 4096 keys;
    rank 1 chunks 1 and 2 over 2048 and 3072 keys (masked: the masks [c, keys], keys % 16 == 0, broadcast views)."""
    from moekit.models import attention as MA

    monkeypatch.setattr(MA, "CUDA_LOWER_RIGHT", lower_right)
    cfg = dataclasses.replace(preset("mixtral-8x7b"), sliding_window=0)
    Sg, c, a = 4096, 1024, 2
    N, K, D, H = cfg.num_heads, cfg.num_kv_heads, cfg.attn_head_dim, cfg.hidden_size
    T = Sg // 2  # one sequence's half on each rank
    common = T * H * a + 3 * T * N * D * a + T * N * 4  # the cast input; q, outputs, wo's copy; logsumexp
    if lower_right:
        rank0 = rank1 = common + Sg * K * 2 * D * a
    else:
        rank0 = common + Sg * K * 2 * D * a + 2 * N * Sg * D * a + c * Sg * a
        rank1 = common + 2 * N * (2 * c + 3 * c) * D * a + c * (2 * c + 3 * c) * a
    got = {}
    for r in (0, 1, None):
        s = A.shapes(cfg, Layout(cp=2), Workload(1, Sg, "bfloat16", "none", "cuda", cp_rank=r))
        got[r] = A._attention(cfg, Layout(cp=2), s, 0)
    assert got == {0: rank0, 1: rank1, None: max(rank0, rank1)}


def test_dry_run_reports_how_each_sequence_splits(capsys):
    """128k-token sequences of mixtral-8x7b on 64 ranks, the same shards either way: fsdp 64 keeps one whole sequence
    per rank and does not fit a 40 GB GPU (exit 3); fsdp 8 x cp 8 splits each into 16 chunks of 8192 positions,
    16384 per rank, and fits."""
    base = ["--dry-run", "--preset", "mixtral-8x7b", "--model.max_seq_len", "131072", "--world-size", "64", "--ep", "8",
            "--train.seq_len", "131072", "--train.activation_checkpointing", "full", "--dry-run-gpu-gb", "40"]
    rc = dryrun.main(base + ["--fsdp", "64", "--batch-size", "64"])
    out = capsys.readouterr().out
    assert rc == dryrun.DOES_NOT_FIT and " cp " not in out and "micro-batch 1 x 131072 tokens," in out, out
    shards = out.split("the estimate agrees): ")[1].split("\n")[0]
    rc = dryrun.main(base + ["--fsdp", "8", "--cp", "8", "--batch-size", "8"])
    out = capsys.readouterr().out
    assert rc == 0 and ": fits" in out and f"the estimate agrees): {shards}\n" in out, out
    assert "pp 1 x dp 1 x fsdp 8 x cp 8 x tp 1, ep 8 folded in the 64 data- and context-parallel ranks" in out
    assert "micro-batch 1 x 16384 tokens (its share of each sequence)" in out
    assert "cp 8: each sequence's 131072 positions split into 16 chunks of 8192, 16384 per rank" in out
    print(out)
