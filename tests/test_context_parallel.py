"""Context parallelism (comm.context_parallel): zigzag shards, the key/value gather, chunked attention, and every
layout with --cp reproducing the single-process gradients (gloo, real ranks).

The cheapest tier first: the shard/gather bookkeeping and ``context_attend`` are checked in one process against
attention over the whole sequence (the gather simulated by concatenating every rank's shard); then real ranks
check whole models against the unparallelised one: losses and every gradient, aux loss and z-loss on.
"""
from __future__ import annotations

import math

import pytest
import torch

from moekit.comm import context_parallel as cpmod
from moekit.comm.context_parallel import ContextParallel, check_context_parallel, check_sequence
from moekit.comm.grad_sync import sync_gradients
from moekit.comm.topology import Layout, LayoutError, Topology
from moekit.models.attention import context_attend
from moekit.models.mtp import ahead_spans
from moekit.models.parallelize import parallelize
from moekit.models.transformer import KVCache, build_model
from tests.dist_utils import run_ranks
from tests.test_parallelize import QWEN3_5, tiny_config

MLA = dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=12)
OSS = dict(attention_sinks=True, sliding_window=3, full_attention_every=2, attention_bias=True,
           attention_out_bias=True, moe_ffn_bias=True, activation="swiglu_oai")


# ---------------------------------------------------------------------------------------------------
# Shards and the gather, one process
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_shards_cover_the_sequence_once_and_balance_causal_work(cp):
    S = 2 * cp * 3
    seen = torch.cat([ContextParallel(cp, r).positions(S // cp) for r in range(cp)])
    assert sorted(seen.tolist()) == list(range(S))
    # causal attention's work of a query at position p is p + 1 keys: every rank gets the same total
    work = [int((ContextParallel(cp, r).positions(S // cp) + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1, work
    t = torch.arange(2 * S).view(2, S)
    for r in range(cp):
        ctx = ContextParallel(cp, r)
        torch.testing.assert_close(ctx.shard(t), t[:, ctx.positions(S // cp)])
        assert [(lo, g) for lo, g, _ in ctx.chunks(S // cp)] == [(0, r * 3), (3, (2 * cp - 1 - r) * 3)]


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_gather_puts_every_rank_shard_back_in_position_order(cp, monkeypatch):
    """The all-gather returns the ranks' shards in rank order; ``gather`` reorders them (and its backward is
    the gather's, so the reorder is the part to check): simulated with the shards themselves."""
    S, g = 4 * cp, torch.Generator().manual_seed(cp)
    whole = torch.randn(2, 3, S, 5, generator=g)
    shards = [ContextParallel(cp, r).shard(whole, dim=2) for r in range(cp)]
    monkeypatch.setattr(cpmod, "_all_gather", lambda x, dim, group: torch.cat(
        [s.movedim(2, 0).contiguous() for s in group]))
    for r in range(cp):
        torch.testing.assert_close(ContextParallel(cp, r, group=shards).gather(shards[r], dim=2), whole)


def _reference(q, k, v, window, sinks):
    """softmax(q k^T / sqrt(D) + causal (and window) mask [, sink column]) v in float64: the definition."""
    B, N, S, D = q.shape
    G = N // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    visible = (j <= i) & ((j > i - window) if window else True)
    scores = scores.masked_fill(~visible, -math.inf)
    if sinks is not None:
        scores = torch.cat((scores, sinks.view(1, N, 1, 1).expand(B, N, S, 1)), dim=-1)
    return scores.softmax(-1)[..., :S] @ v


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("window,sinks", [(0, False), (0, True), (3, False), (5, True), (100, False)],
                         ids=["causal", "sinks", "window3", "window5-sinks", "window-wider-than-sequence"])
def test_context_attention_is_the_whole_sequence_attention(cp, window, sinks):
    """Each rank's chunks over the gathered keys give its rows of attention over the whole sequence, and the
    gradients summed over the ranks (what the gather's reduce-scatter does) are the whole attention's."""
    B, N, K, D, S = 2, 4, 2, 8, 4 * cp
    g = torch.Generator().manual_seed(7 * cp + window)
    q, k, v = (torch.randn(B, n, S, D, generator=g, dtype=torch.float64, requires_grad=True) for n in (N, K, K))
    sink = torch.randn(N, generator=g, dtype=torch.float64, requires_grad=True) if sinks else None
    probe = torch.randn(B, N, S, D, generator=g, dtype=torch.float64)
    want = _reference(q, k, v, window, sink)
    grads_want = torch.autograd.grad((want * probe).sum(), [t for t in (q, k, v, sink) if t is not None])
    total = 0
    for r in range(cp):
        ctx = ContextParallel(cp, r)
        got = context_attend(ctx.shard(q, 2), k, v, ctx, gqa=True, window=window, sinks=sink)
        torch.testing.assert_close(got, ctx.shard(want, 2), msg=lambda m: f"rank {r}: {m}")
        total = total + (got * ctx.shard(probe, 2)).sum()
    grads = torch.autograd.grad(total, [t for t in (q, k, v, sink) if t is not None])
    for name, a, b in zip("qkvs", grads, grads_want):
        torch.testing.assert_close(a, b, msg=lambda m: f"grad {name}: {m}")


# ---------------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------------


def test_layout_with_cp_counts_its_ranks_and_folds_ep_over_them():
    layout = Layout.infer(8, cp=2, tp=2, ep=2, num_experts=4)
    assert (layout.dp, layout.data_parallel, layout.dp_cp, layout.world_size) == (2, 2, 4, 8)
    assert "--cp 2" in layout.flags and "--cp" not in Layout().flags
    with pytest.raises(LayoutError, match=r"ep=8 must divide the data-parallel size dp\*fsdp\*cp = 4"):
        Layout.infer(8, cp=2, tp=2, ep=8, num_experts=8)
    with pytest.raises(LayoutError, match=r"not divisible by pp\*fsdp\*cp\*tp = 1\*1\*3\*1 = 3"):
        Layout.infer(4, cp=3)
    with pytest.raises(LayoutError, match="--cp=0 is invalid"):
        Layout.infer(4, cp=0)


def test_topology_groups_with_cp():
    """8 ranks dp2 x cp2 x tp2, ep2: rank = ((dp * cp) + cp_i) * tp + tp_i. A sequence's cp ranks are
    neighbours in the EP group; gradients and counts run over dp x cp; the batch splits over dp only."""
    topo = Topology(Layout(dp=2, cp=2, tp=2, ep=2), rank=5, ranks_per_node=8)
    c = topo.coords()
    assert (c.dp, c.cp, c.tp) == (1, 0, 1)
    assert topo.rank_of(0, 1, 0, 1, cp=0) == 5 and topo.rank_of(0, 1, 0, 1, cp=1) == 7
    assert topo.members("cp") == [5, 7]
    assert topo.members("tp") == [4, 5]
    assert topo.members("dp") == [1, 3, 5, 7]
    assert topo.members("ep") == [5, 7]
    assert topo.members("edp") == [1, 5]
    assert topo.members("stage") == list(range(8))
    assert topo.data_rank() == 1 and topo.data_rank(7) == 1 and topo.data_rank(2) == 0
    assert topo.token_rank() == 2


def test_sequences_must_split_into_zigzag_chunks():
    check_sequence(32, 4)
    with pytest.raises(LayoutError, match=r"--cp 4 splits each sequence into 2\*cp = 8 equal chunks.*"
                                          r"--seq-len 30 is not a multiple of 8; use e.g. --seq-len 24"):
        check_sequence(30, 4)
    with pytest.raises(LayoutError, match="--seq-len 30 is not a multiple of 4"):
        check_context_parallel(tiny_config(mtp_layers=1), 2, 30)
    check_context_parallel(tiny_config(mtp_layers=1), 2, 32)  # multi-token prediction runs under cp
    check_context_parallel(tiny_config(mtp_layers=1), 1, 31)  # cp 1: nothing to refuse


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_depth_spans_cover_the_positions_with_a_token_ahead_once(cp):
    """models.mtp.ahead_spans: over the CP ranks, depth k's spans are the global positions 0 .. S-k-1, each once,
    a prefix of each rank's chunks; a rank whose chunks all lie in the last k positions has none."""
    S = 4 * cp
    n = S // cp
    for k in range(1, S):
        held = []
        for r in range(cp):
            context = ContextParallel(cp, r)
            where = context.positions(n).tolist()
            spans = ahead_spans(context, n, S, k)
            assert all(0 <= a < b <= n for a, b in spans)
            held += [where[i] for a, b in spans for i in range(a, b)]
            assert all(where[i] + k >= S for i in set(range(n)) - {i for a, b in spans for i in range(a, b)})
        assert sorted(held) == list(range(S - k)), (cp, k)
    assert ahead_spans(ContextParallel(2, 1), 4, 8, 6) == []  # positions 2-5: none has a token 6 ahead


def test_context_parallel_model_refuses_a_kv_cache_and_checks_the_whole_length():
    model = build_model(tiny_config(max_seq_len=16), seed=0)
    model.context_parallel = ContextParallel(2, 0)
    with pytest.raises(ValueError, match="decode with a KV cache in a model without context parallelism"):
        model(torch.zeros(1, 4, dtype=torch.long), cache=KVCache(model.config))
    with pytest.raises(ValueError, match="sequence length 24 exceeds model.max_seq_len=16"):
        model(torch.zeros(1, 12, dtype=torch.long))


# ---------------------------------------------------------------------------------------------------
# Real ranks: whole models against one process
# ---------------------------------------------------------------------------------------------------

B, SEQ = 4, 16
SEQUENCE_BALANCE = {"normalize": True, "balance": "sequence"}  # DeepSeek-V3's sequence-wise aux loss


def _check(rank, world, degrees, over, recipe):
    layout = Layout(**degrees)
    topo = Topology(layout, rank, world).build()
    cfg = tiny_config(**over)
    recipe = dict(recipe)
    eos = recipe.pop("document_eos", None)  # document masking: documents end at positions 2, 6, 13
    S = recipe.pop("seq", SEQ)
    tokens = torch.randint(1, cfg.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(5))
    if eos is not None:
        tokens[:, [2, 6, 13]] = eos
    x, y = tokens[:, :-1], tokens[:, 1:]
    ref = build_model(cfg, seed=3)
    ref.document_eos = eos
    want_loss = ref(x, targets=y)
    want_loss.backward()
    model = build_model(cfg, seed=3)
    model.document_eos = eos
    done = parallelize(model, topo, **recipe)
    assert done.context is not None and done.context.degree == layout.cp
    D = layout.data_parallel
    xs, ys = (t.reshape(D, B // D, S)[topo.data_rank()] for t in (x, y))
    loss = model(done.context.shard(xs), targets=done.context.shard(ys))
    loss.backward()
    sync_gradients(model, topo, done.grad_roles, fsdp=done.fsdp)
    where = f"{degrees} {over} {recipe}"
    mean = loss.detach().clone()  # each rank's mean over its equal share: their mean is the whole batch's
    torch.distributed.all_reduce(mean, group=topo.group("dp"))
    torch.testing.assert_close(mean / layout.dp_cp, want_loss.detach(), msg=lambda m: f"{where}: loss: {m}")
    if cfg.mtp_layers:  # the depths' recorded loss: each rank's weighted share, whose mean is one process's
        depths = model.pop_mtp_loss()
        torch.distributed.all_reduce(depths, group=topo.group("dp"))
        torch.testing.assert_close(depths / layout.dp_cp, ref.pop_mtp_loss(), msg=lambda m: f"{where}: mtp: {m}")
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(got, ref_grads[name].grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{where}: {name}: {m}")


def _ranks(rank, world, cases):
    for case in cases:  # one spawn checks several layouts (process start-up dominates on 2 cores)
        _check(rank, world, *case)


# Qwen3.5's layers (tests/test_parallelize.py): a Gated DeltaNet layer whose chunks' starting states come from the
# other ranks' chunks (affine maps, all-gathered), its convolution reading across the ranks' chunks; chunks of 2
# positions inside the rule so that each rank's chunk is several of them
QWEN = dict(QWEN3_5, linear_chunk=2)
# Llama 4's layers: layer 0 RoPE'd in chunks of 5 (the zigzag chunks of 4 straddle them), layer 1 NoPE with the
# query temperature from position 2 (each rank scales its own positions), top-1 experts weighting their input
LLAMA4 = dict(nope_every=2, attention_chunk=5, attn_temperature_floor=3, qk_norm="unit", rope_pairs="adjacent",
              router_weight_on_input=True, top_k=1, router_options={"score": "sigmoid", "normalize": False},
              shared_ffn_hidden_size=24)
TWO_RANKS = [
    (dict(cp=2), QWEN, {}),
    (dict(cp=2, ep=2), LLAMA4, {"document_eos": 0}),
    (dict(cp=2), QWEN, {"document_eos": 0}),
    (dict(cp=2), {}, {}),
    (dict(cp=2, ep=2), {"router": "hash", "router_options": {}, "first_dense_layers": 1}, {}),
    (dict(cp=2), MLA, {"activation_checkpointing": "full"}),
    (dict(cp=2), OSS, {"activation_checkpointing": "selective"}),
    (dict(cp=2), OSS, {"document_eos": 0}),
    (dict(cp=2, ep=2), {"mtp_layers": 2}, {}),
    (dict(cp=2), {"router_options": SEQUENCE_BALANCE}, {}),
]
FOUR_RANKS = [
    # chunks of 2 positions: the convolution's 3 inputs before a chunk span two earlier chunks (other ranks')
    (dict(cp=4), dict(QWEN, linear_chunk=64), {"document_eos": 0}),
    (dict(cp=2, fsdp=2, ep=2), QWEN, {"activation_checkpointing": "selective"}),
    (dict(dp=2, cp=2, ep=2), {"shared_ffn_hidden_size": 16}, {}),
    (dict(cp=4), dict(OSS, sliding_window=5, full_attention_every=0), {}),
    (dict(cp=2, tp=2), LLAMA4, {"sequence_parallel": True}),
    (dict(cp=2, fsdp=2, ep=4), MLA, {}),
    (dict(cp=2, tp=2), OSS, {"sequence_parallel": True}),
    (dict(cp=4), MLA, {"document_eos": 0}),
    (dict(cp=4), dict(MLA, mtp_layers=5), {"seq": 8}),
    (dict(cp=2, fsdp=2, ep=2), dict(MLA, mtp_layers=1), {}),
    (dict(cp=2, tp=2), {"mtp_layers": 2}, {"document_eos": 0}),
    (dict(cp=2, tp=2), {"router_options": SEQUENCE_BALANCE, "mtp_layers": 1}, {"sequence_parallel": True}),
]


@pytest.mark.parametrize("world,cases", [(2, TWO_RANKS), (4, FOUR_RANKS)], ids=["2-ranks", "4-ranks"])
def test_context_parallel_layouts_equal_single_process(world, cases):
    """2 ranks: cp2; cp2 x ep2 (hash router, a dense layer); MLA + full AC; gpt-oss's sinks, windows and biases
    with selective AC, and with document masking (documents crossing the ranks' chunks); two MTP depths (MoE blocks)
    at cp2 x ep2. 4 ranks: dp2 x cp2 x ep2 (shared expert); cp4 with a window wider than a chunk; MLA with FSDP over
    fsdp x cp and ep4; cp2 x tp2 with sequence parallelism; MLA at cp4 with document masking; five MTP depths at
    cp4 over 8 positions (from depth 5 rank 3 holds no position with a token ahead: its MoE layer routes no row
    and its loss is a weighted zero); an MTP depth under FSDP over fsdp x cp (the depth embeds the ids ahead
    with the root unit's embedding); MTP at cp2 x tp2 (the depths' TP token split over the kept rows) with
    documents. Sequence-wise balancing at cp2 (each sequence's loss from both ranks' tokens) and at cp2 x tp2 with
    sequence parallelism and an MTP depth (every sequence over 4 ranks). Losses, every gradient and the recorded
    MTP loss."""
    run_ranks(_ranks, world, cases)


def _pipeline_rank(rank, world):
    from moekit.models.pipeline import build_pipeline

    topo = Topology(Layout(pp=2, cp=2), rank, world).build()
    pipe = build_pipeline(build_model(tiny_config(), seed=0), topo, "gpipe", 1, SEQ)
    done = parallelize(pipe.model, topo)
    stages = pipe.model.stages  # kept outside the PipelineModel's registered children
    assert stages and all(stage.context_parallel is done.context for stage in stages), rank
    assert all(block.attn.context_parallel is done.context for stage in stages for block in stage.layers.values())


def test_pipeline_stages_get_the_strategy():
    """pp2 x cp2: every stage module computes RoPE at its rank's positions (the strategy reaches the stages, which
    PipelineModel does not register as children; at initialisation a wrong position moves the loss by ~1e-6 only,
    so the trainer-level curve comparison cannot see it)."""
    run_ranks(_pipeline_rank, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sinks", [False, True])
def test_prefix_chunks_merge_two_flash_calls_and_keep_no_mask(dtype, sinks):
    """A later chunk (queries at 24 .. 31 over keys 0 .. 31) runs as two flash calls merged by their logsumexps
    (models.attention.PrefixCausalAttention): forward and gradients equal one masked SDPA call within the dtype's
    rounding, and autograd keeps no [S, keys] mask (CPU SDPA keeps a float copy of the one it is given)."""
    from moekit.models import attention as A

    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, 8, 16, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(2, 2, 32, 16, generator=g).to(dtype).requires_grad_() for _ in range(2))
    sink = torch.randn(4, generator=g).requires_grad_() if sinks else None
    kept = []

    def keep(t):
        kept.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        got = A.positioned_attention(q, k, v, 24, 0, True, None, 0, sink)
    assert (8, 32) not in kept and all(len(s) != 2 for s in kept), kept
    mask = A.span_mask(24, 8, 0, 32, 0, "cpu")
    want = (A.masked_sdpa(q, k, v, mask, True, None) if sink is None
            else A.sink_attention(q, k, v, mask, sink, None, True))
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    probe = torch.randn(want.shape, generator=g).to(dtype)
    inputs = [t for t in (q, k, v, sink) if t is not None]
    for name, a, b in zip("qkvs", torch.autograd.grad((got * probe).sum(), inputs),
                          torch.autograd.grad((want * probe).sum(), inputs)):
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=lambda m: f"grad {name}: {m}")


def test_prefix_chunks_stay_mask_free_inside_torch_compile(monkeypatch):
    """A compiled block traces the merge (its two flash calls, not one masked SDPA call) and gets the eager values
    and gradients."""
    from moekit.models import attention as A
    from moekit.models import sdpa

    calls = []
    flash = sdpa._CPU_FLASH
    monkeypatch.setattr(sdpa, "_CPU_FLASH", lambda *a, **kw: calls.append(1) or flash(*a, **kw))
    g = torch.Generator().manual_seed(12)
    q = torch.randn(2, 4, 8, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 32, 16, generator=g, requires_grad=True) for _ in range(2))

    def f(q, k, v):
        return A.positioned_attention(q, k, v, 24, 0, True, None, 0, None) * 2

    eager = f(q, k, v)
    assert len(calls) == 2
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    assert len(calls) >= 4  # traced through the merge's flash calls (a masked call would make none)
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(torch.autograd.grad(compiled.sum(), (q, k, v)), torch.autograd.grad(eager.sum(), (q, k, v))):
        torch.testing.assert_close(a, b)
