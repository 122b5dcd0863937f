"""What autograd holds from forward to backward on one rank, per micro-batch (moekit.train.planning.memory's activations).

Shape legend as in moekit.train.planning.memory: T tokens of the micro-batch, Ts those of the residual stream on this
rank (T, or T / tp with sequence parallelism), Tm those the MoE layer routes (T / tp when tp > 1), R expert
rows, a / r bytes of the compute dtype / of the residual stream.

    residual   block input and the post-attention sum h                           2 Ts H r
    norms      rsqrt [Ts], and x * rsqrt [Ts, H] (CPU's composite RMSNorm; CUDA's fused kernel keeps x only)
    attention  the norm output the projections read (autocast: one bf16 copy per projection), q and k
               after RoPE, v, SDPA output and fp32 logsumexp; on CPU a copy of the output for wo. A
               sliding window or sinks (gpt-oss) give SDPA a mask, which it keeps (``_gqa_kept``); sinks
               widen q / k / v and pad the keys (models.attention.sink_attention)
    router     fp32 logits (the z-loss logsumexp keeps them) and scores [Tm, E]; ids, weights [Tm, k]
    dispatch   int64 slot <-> row maps; under EP the reorder permutation and its inverse
    experts    input rows [R, H], [gate | up] [R, 2F] and SwiGLU output [R, F], outputs [R, H] (combine);
               the Triton backend keeps only [gate | up] (its second GEMM's input is recomputed)
    dense FFN  / shared expert (DenseMLP): gate, up, silu(gate), product: 4 T F (GELU 2 T F, ReLU T F)
               (what an activation keeps is measured once from moe.activations' table: ``ffn_widths``)
    head       final norm and the loss: its gradients dh [T, H] and dW [V, H] (models.loss, no logits),
               or under pipeline parallelism the lm_head input and the fp32 log-softmax [T, V]; token ids
Activation checkpointing: "full" keeps each block's input only; "ffn" keeps the FFN / MoE input and drops
its internals; "selective" keeps each block's input and the outputs models.parallelize.selective_policy
caches (``_selective``: projections, fused attention, router logits and routing decisions, the experts'
GEMMs where the dispatcher sees them); the transient is what backward recomputes (one block / one FFN).

Context parallelism (comm.context_parallel, cp > 1): T, Ts, Tm are this rank's S / cp positions of each sequence,
so every term per token shrinks cp times; attention keeps the whole sequence's keys and values (``_gqa_kept``:
the gathered [B, K, S, 2D]; ``_mla``: the gathered latent expanded to [B, N, S, Dqk + Dv]) and a mask per chunk
(on CUDA; the CPU's later chunks without a window or documents keep none: models.attention.PrefixCausalAttention).

Document masking (``Workload.document_mask``, --data.document_mask): every attention call is masked, with a mask per
sequence [B, 1, queries, keys] (``_calls``, ``_mask_bytes``), and none runs the explicit CPU path; the documents
[B, S] int32 (models.attention.document_segments, of whole sequences under context parallelism) are an activation
where checkpointed blocks keep them as their input, else a transient of the forward (memory.estimate_memory).

Sequence parallelism (comm.tensor_parallel, tp > 1) keeps only the regions between the TP matmuls on 1/tp
of the sequence: residual, norms and the whole MoE layer (its input already is the rank's slice, so Tm = Ts).
Attention and the dense MLP all-gather their input over the sequence, and that gathered [T, H] is what
their projections save, so those terms do not shrink. Each model chunk's first block copies its slice of
the input (a view would keep the whole [T, H] alive), and the last block's output is all-gathered (the
final norm / the next stage read all T).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moekit.comm.topology import Layout
from moekit.models.attention import explicit_attention_applies
from moekit.models.config import ModelConfig
from moekit.models.sdpa import KEY_MULTIPLE
from moekit.moe.activations import get_activation

if TYPE_CHECKING:  # moekit.train.planning.memory imports this module
    from moekit.train.planning.memory import Stage, Workload

FP32, INT64 = 4, 8
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
SINK_PAD = 8  # models.attention.sink_attention widens q / k by this many channels (the sink's, padded to 8)
MEM_EFF_ALIGN = KEY_MULTIPLE  # torch's efficient attention pads a mask whose last dim is not a multiple of 16


@functools.lru_cache(maxsize=None)
def ffn_widths(activation: str, dense: bool) -> int:
    """Tensors of the FFN width F that autograd keeps per row between an FFN's two projections, in units of
    [rows, F]: measured once by running the activation of moe.activations' table on a small fp32 example under
    saved_tensors_hooks, plus its output (the second projection keeps it), each storage counted once. So any
    table entry is right without a case here. ``dense``: DenseMLP's form (separate gate and up Linears,
    ``Activation.combine``), else the routed experts' (``Activation.fn`` over [gate | up]).

    SwiGLU: experts 3 (the fused function keeps [gate | up], the GEMM its output), dense 4 (gate, up, silu(gate),
    product); swiglu_oai: experts 3, dense 7 (its clamps and sigmoid are composite ops); GELU 2; ReLU 1."""
    act, rows, F = get_activation(activation), 2, 8
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if dense:
            up = torch.randn(rows, F, requires_grad=True)
            out = act.combine(torch.randn(rows, F, requires_grad=True), up) if act.gated else act.unit(up)
        else:
            out = act(torch.randn(rows, act.in_features(F), requires_grad=True))
    pack(out)
    return sum(seen.values()) // (rows * F * 4)
@dataclass(frozen=True)
class Shapes:
    T: int  # tokens of the micro-batch (attention, projections, dense MLP: gathered under SP)
    Ts: int  # tokens of the residual stream and norms on this rank: T, or T / tp with sequence parallelism
    Tm: int  # tokens the MoE layer routes on this rank (the TP ranks split them)
    R: int  # expert rows this rank computes and combines
    a: int  # bytes of the compute dtype
    r: int  # bytes of the residual stream: fp32, or bf16 when FSDP computes in bf16 parameters
    casts: bool  # autocast over fp32 weights: each projection keeps its own bf16 copy of its input
    cpu: bool
    S: int  # sequence length (the whole sequence's: the keys a query may see)
    explicit_attention: bool  # attention as bmm + softmax + bmm (models.attention.explicit_attention_applies)
    cp: int = 1  # context-parallel ranks splitting each sequence: T holds S / cp positions of each
    cp_rank: int | None = None  # whose zigzag chunks; None: the rank whose attention keeps the most
    documents: bool = False  # document masking: every call masked, by a [B, 1, queries, keys] mask

    @property
    def B(self) -> int:
        """Sequences of the micro-batch."""
        return self.T * self.cp // self.S


def shapes(cfg: ModelConfig, layout: Layout, wl: Workload) -> Shapes:
    T = wl.tokens // layout.cp  # context parallel: this rank's S / cp positions of each sequence
    Tm = math.ceil(T / layout.tp)  # with SP the same: S / cp % tp == 0 (comm.tensor_parallel checks)
    Ts = Tm if wl.sequence_parallel and layout.tp > 1 else T
    k = min(cfg.top_k, cfg.num_experts)
    R = Tm * k
    if cfg.capacity_factor is not None and cfg.num_experts:  # capacity bounds the rows (moe.dispatch)
        R = min(R, cfg.num_experts * min(Tm, math.ceil(Tm * k / cfg.num_experts * cfg.capacity_factor)))
    a = DTYPE_BYTES[wl.dtype]
    bf16_params = a == 2 and layout.fsdp > 1 and wl.device == "cuda"  # the trainer's FSDP param_dtype
    # under context parallelism attention always runs SDPA, chunk by chunk (models.attention.context_attend), and
    # with documents straight through local_attention (models.attention.attend)
    explicit = layout.cp == 1 and not wl.document_mask and explicit_attention_applies(
        wl.device, torch.bfloat16 if a == 2 else torch.float32, wl.micro_batch, cfg.num_heads // layout.tp, wl.seq_len)
    return Shapes(T, Ts, Tm, R, a, a if bf16_params else FP32, a == 2 and not bf16_params, wl.device == "cpu",
                  wl.seq_len, explicit, layout.cp, wl.cp_rank, wl.document_mask)


def _attention(cfg: ModelConfig, layout: Layout, s: Shapes, i: int) -> int:
    H, N = cfg.hidden_size, cfg.num_heads // layout.tp
    if cfg.attention == "mla":
        return _mla(cfg, layout, s)
    D, K = cfg.attn_head_dim, cfg.num_kv_heads // layout.tp
    inputs = 3 * s.T * H * s.a if s.casts else s.T * H * s.r
    kept = _gqa_kept(s, N, K, D, cfg.attention_window(i), cfg.attention_sinks, cfg.num_kv_heads != cfg.num_heads)
    if cfg.qk_norm != "none":  # the norms keep their inputs (q, k before the norm)
        kept += s.T * (N + K) * D * s.a
    return inputs + kept


def _mla(cfg: ModelConfig, layout: Layout, s: Shapes) -> int:
    """models.attention.MLAttention: the latents and their norms, q, the keys expanded per head from the latent,
    v, the output and its logsumexp. Under context parallelism the latent of the whole sequence is gathered and
    expanded on every rank: k and v are [B, N, S, *] of all S positions, and the normed latent wkv_b reads is the
    gathered one (a [B, S, c] copy out of the gathered [B, S, c + rope]), not this rank's."""
    H, N, T, a = cfg.hidden_size, cfg.num_heads // layout.tp, s.T, s.a
    Dqk, Dv, c, q_lora = cfg.attn_qk_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.q_lora_rank
    keys = s.B * s.S if s.cp > 1 else T  # key positions expanded on this rank
    inputs = 2 * T * H * a if s.casts else T * H * s.r  # autocast: wq (or wq_a) and wkv_a cast their own copies
    # wq_a's output and its norm's, wkv_a's [T, c + rope], the normed latent wkv_b reads; each latent norm's rsqrt
    # (and x * rsqrt on CPU: the composite RMSNorm)
    latents = T * 2 * q_lora * a + T * (c + cfg.qk_rope_head_dim) * a + keys * c * a
    for width in (q_lora, c) if q_lora else (c,):
        latents += T * FP32 + (T * width * a if s.cpu else 0)
    kept = T * N * Dqk * a + keys * N * (Dqk + Dv) * a + T * N * (Dv * a + FP32)  # q; k, v; output, logsumexp
    if s.cp > 1 or s.cpu:  # wo reads a copy of the chunks' outputs (on CPU: of the one call's too)
        kept += T * N * Dv * a
    # a mask per masked call: each chunk but rank 0's first, every call with documents (MLA: no key heads to expand)
    kept += max(sum(_mask_bytes(s, N, n, P) for n, P, masked in _calls(s, r, 0, Dqk == Dv) if masked)
                for r in _cp_ranks(s))
    return inputs + latents + kept + _explicit_probs(cfg, layout, s)


def _gqa_kept(s: Shapes, N: int, K: int, D: int, window: int, sinks: bool, gqa: bool) -> int:
    """What one GQA attention keeps from q, k, v on (models.attention.attend, or context_attend under context
    parallelism) to wo's input, on the rank whose calls keep the most (or ``s.cp_rank``'s). The attention runs
    as SDPA calls (``_calls``: one, or local_attention's blocks and context-parallel chunks), each over a span of
    keys of q, k, v:

    plain / window: q (the calls keep views of it), k (after RoPE) and v, or under context parallelism the
        gathered [B, K, S, 2D] of whole sequences (views of it too); each call's output and fp32 logsumexp; each
        masked call's additive [queries, keys] mask in the compute dtype, [B, 1, queries, keys] with documents
        (``_mask_bytes``: CPU flash measured; CUDA efficient attention keeps a broadcast view when keys % 16 == 0,
        which window blocks always read, else torch pads the expanded mask per batch row and head, attention.cpp's
        preprocess_mask). One call needs no copy for wo: RoPE runs before the head transpose, so q reaches SDPA as
        a [B, S, N, D] view and SDPA returns its output in that layout, whose reshape back to [B, S, N*D] is a
        view; several calls' outputs are concatenated, and wo's input is a copy. On CUDA a masked GQA call expands
        its keys and values to the N query heads (masked_sdpa): those [B, N, keys, D] copies are kept instead of
        views, and k and v only while an unmasked call reads them. On CPU a context-parallel chunk after the first
        (every earlier key visible, then causal) runs as models.attention.PrefixCausalAttention: two flash calls
        merged, no mask; it keeps views of q, k, v, its output and its fp32 logsumexp, as an unmasked call does.
    sinks (models.attention.sink_attention), per call over P keys: SDPA over copies q' [B, N, n, D+8], k' and v'
        [B, K, P', D+8] (P' = P + 1 rounded up to a multiple of 16; CUDA, masked, GQA: N heads) and the
        [n, P'] mask ([B, 1, n, P'] with documents); q, k, v themselves are then freed. The fused kernel keeps q',
        k', v', its [B, N, n, D+8] output and fp32 logsumexp, and the mask (CPU flash attention: measured; CUDA's
        memory-efficient kernel, assumed: with P' % 16 == 0 the mask stays a broadcast view); wo's input is a copy
        of the outputs' first D channels [T, N*D]. An unmasked call (causal over its own positions) runs SDPA with
        no mask, its queries padded to the keys' P' rows: q', the output and the logsumexp are P' rows long. A CPU
        PrefixCausalAttention call (sinks are a part of its merge) keeps no widened copies: its [B, N, n, D] output
        and fp32 logsumexp, and views of q and of the gathered keys and values (so those are kept).
    explicit (CPU bf16, short sequences: bmm + softmax + bmm): copies of q, k, v and of the output in place of
        SDPA's views (the same bytes) and the softmax probabilities [B, N, S, S] (S + 1 wide with sinks) in
        place of the logsumexp; its additive mask is not kept (baddbmm's input needs no saving).
    """
    T, B, a = s.T, s.B, s.a
    if s.explicit_attention:
        return T * (2 * N + 2 * K) * D * a + T * N * (s.S + sinks) * a
    expand = gqa and not s.cpu  # masked_sdpa repeats the key heads on CUDA
    keys_kv = B * s.S * K * 2 * D * a if s.cp > 1 else 2 * T * K * D * a  # k and v: gathered, or this rank's
    worst = 0
    for rank in _cp_ranks(s):
        calls = _calls(s, rank, window)
        kept = T * N * D * a if sinks or len(calls) > 1 else 0  # wo's input
        if sinks:
            W, prefix = D + SINK_PAD, False
            for n, P, masked in calls:
                if not masked and P > n:  # PrefixCausalAttention
                    kept += B * N * n * (D * a + FP32)
                    prefix = True
                    continue
                P2 = sink_keys(P)
                rows, heads = (n, N if expand else K) if masked else (P2, K)
                kept += (2 * B * N * rows * W + 2 * B * heads * P2 * W) * a + B * N * rows * FP32
                kept += _mask_bytes(s, N, n, P2) if masked else 0
            kept += T * N * D * a + keys_kv if prefix else 0  # q and the gathered k, v: PrefixCausalAttention's views
        else:
            kept += T * N * D * a + T * N * (D * a + FP32)  # q; the outputs and their logsumexp
            views = False
            for n, P, masked in calls:
                kept += _mask_bytes(s, N, n, P) if masked else 0
                if masked and expand:
                    kept += 2 * B * N * P * D * a
                else:
                    views = True
            kept += keys_kv if views else 0
        worst = max(worst, kept)
    return worst


def sink_keys(S: int) -> int:
    """Keys of models.attention.sink_attention's SDPA over S positions: the sink's and S, padded to 16."""
    return -(-(S + 1) // MEM_EFF_ALIGN) * MEM_EFF_ALIGN


def _mask_bytes(s: Shapes, N: int, rows: int, keys: int) -> int:
    """The additive [rows, keys] mask SDPA keeps for backward (``_gqa_kept``), one per sequence with documents
    ([B, 1, rows, keys]: models.attention.positioned_attention): on CPU as it is; on CUDA a broadcast view when
    ``keys`` is a multiple of 16, else padded and materialised per batch row and head."""
    if s.cpu or keys % MEM_EFF_ALIGN == 0:
        return (s.B if s.documents else 1) * rows * keys * s.a
    return s.B * N * rows * math.ceil(keys / MEM_EFF_ALIGN) * MEM_EFF_ALIGN * s.a


def _cp_ranks(s: Shapes) -> list[int]:
    """The context-parallel ranks an estimate describes: the one asked for, else all (the largest is taken)."""
    return list(range(s.cp)) if s.cp_rank is None else [s.cp_rank]


def _calls(s: Shapes, rank: int, window: int, same_widths: bool = True) -> list[tuple[int, int, bool]]:
    """(queries, keys, masked) per sequence of each SDPA call one attention layer makes on context-parallel rank
    ``rank``, as models.attention makes them: local_attention over the whole sequence (cp 1; one call unless a
    window splits the queries into blocks) or over each zigzag chunk (context_attend); each block of queries reads
    the keys from its window's start (else 0) to its own end, a windowed block a few more (hidden by its mask) so
    that it reads a multiple of 16 keys (but none before position 0), with a mask unless they are its own
    positions, the window hides none of them and there are no documents (positioned_attention). Unmasked over more
    keys than queries: on CPU a context-parallel chunk after the first, without window or documents, whose q and v
    have the same head width (``same_widths``) runs as PrefixCausalAttention (every earlier key visible, then
    causal: two flash calls merged by their logsumexps, no mask; models.attention._prefix_applies)."""
    from moekit.comm.context_parallel import ContextParallel
    from moekit.models.attention import window_block

    spans = [(g, n) for _, g, n in ContextParallel(s.cp, rank).chunks(s.S // s.cp)] if s.cp > 1 else [(0, s.S)]
    out = []
    for q_start, S in spans:
        block = window_block(S, window, s.documents, s.cpu)
        for i in range(0, S, block):
            n, first = min(block, S - i), q_start + i
            lo = max(0, first - window + 1) if window else 0
            if window:  # local_attention's keys, a multiple of 16 of them where there are enough
                lo = max(0, first + n - math.ceil((first + n - lo) / MEM_EFF_ALIGN) * MEM_EFF_ALIGN)
            plain = first == lo and (not window or window >= n) and not s.documents
            prefix = s.cpu and same_widths and lo < first and not window and not s.documents
            out.append((n, first + n - lo, not (plain or prefix)))
    return out


def _explicit_probs(cfg: ModelConfig, layout: Layout, s: Shapes) -> int:
    """The explicit attention (CPU bf16, short sequences) keeps the softmax probabilities [B, N, S, S] for
    backward where SDPA keeps an fp32 logsumexp [B, N, S]; it keeps copies of q, k, v in place of the views
    SDPA keeps, and the output either way (the same bytes)."""
    if not s.explicit_attention:
        return 0
    N = cfg.num_heads // layout.tp
    return s.T * N * (s.S * s.a - FP32)


def fused_router_applies(cfg: ModelConfig, cpu: bool) -> bool:
    """Whether the layer's router runs as moe.kernels.topk_route (moe.router.FUSED_ROUTER "auto": on CUDA,
    top-k / Switch without expert groups or force_expert)."""
    from moekit.moe import router

    opts = cfg.router_options
    return (router.FUSED_ROUTER == "always" or (router.FUSED_ROUTER == "auto" and not cpu)) and \
        cfg.router in ("topk", "switch") and opts.get("num_groups") is None and opts.get("force_expert") is None


def _router(cfg: ModelConfig, s: Shapes) -> int:
    E, k, T, H = cfg.num_experts, cfg.top_k, s.Tm, cfg.hidden_size
    opts = cfg.router_options
    sigmoid = opts.get("score", "softmax") == "sigmoid"
    jitter = 2 * T * H * FP32 if cfg.router == "switch" and opts.get("jitter", 0.01) > 0 else 0
    if fused_router_applies(cfg, s.cpu):  # the kernel keeps the logits and the ids; torch ops on its outputs
        b = T * E * FP32 + T * k * INT64 + E * FP32  # + the balance loss's [E] operand of its dot product
        b += T * E * FP32 + 2 * T * FP32 if sigmoid else 0  # the balance distribution: scores / clamped sum
        b += T * FP32 if cfg.z_loss_coeff > 0 else 0  # the z-loss squares the kernel's logsumexp
        return b + jitter
    b = 2 * T * E * FP32 + T * FP32 + T * k * (INT64 + FP32)  # logits, scores, logsumexp; ids, gathered scores
    if (cfg.router == "topk" and opts.get("normalize", k > 1)) or sigmoid:  # weights / their clamped sum
        b += 2 * T * FP32 + T * k * FP32
    elif opts.get("scaling", 1.0) != 1.0:
        b += T * k * FP32
    b += T * FP32 if sigmoid else 0  # the balance distribution divides by the scores' sum
    return b + jitter  # Switch's jitter: the noise and the jittered input  # a bf16 input is saved as bf16 (moe.precision.upcast_linear), counted with the block's inputs


def _moe(cfg: ModelConfig, layout: Layout, s: Shapes, node_rows: float) -> dict[str, int]:
    """The MoE FFN's internals (its input is counted by the caller)."""
    H, k, F = cfg.hidden_size, cfg.top_k, cfg.moe_ffn_hidden_size
    dispatch = s.Tm * k * INT64 + s.R * INT64 + (2 * s.R * INT64 if layout.ep > 1 else 0)
    dispatch += int(node_rows * s.Tm) * (H * s.a + INT64)  # two-level: one partial sum back per (token, node)
    backend = _backend(cfg, s.cpu)
    # the Triton kernel keeps [gate | up] alone (moe.kernels.expert_mlp.FusedExpertMLPFunction saves pre, and its
    # backward recomputes the activation); the other backends keep what the activation and the second GEMM keep
    act = get_activation(cfg.activation)
    hidden = act.in_features(F) if backend == "triton" else F * ffn_widths(cfg.activation, False)
    experts = s.R * H * (s.a if s.casts else s.r) + s.R * hidden * s.a + s.R * H * s.a
    if cfg.moe_ffn_bias and backend == "torch":  # add_expert_bias keeps each row's int64 expert id, per bias
        experts += 2 * s.R * INT64
    out = {"router": _router(cfg, s), "dispatch": dispatch, "experts": experts}
    if cfg.shared_ffn_hidden_size:
        shared = s.Tm * cfg.shared_ffn_hidden_size * ffn_widths(cfg.activation, True) * s.a
        shared += s.Tm * H * s.a * (s.casts + cfg.shared_expert_gate) + 2 * s.Tm * FP32 * cfg.shared_expert_gate
        out["shared_expert"] = shared
    return out


def _block(cfg: ModelConfig, layout: Layout, s: Shapes, i: int, node_rows: float) -> tuple[dict, dict]:
    """Block i's activations: (kept outside the FFN, the FFN's internals)."""
    H = cfg.hidden_size
    norms = 2 * s.Ts * FP32 + (2 * s.Ts * H * s.r if s.cpu else 0)  # rsqrt; x * rsqrt on CPU
    outer = {"residual": 2 * s.Ts * H * s.r, "norms": norms, "attention": _attention(cfg, layout, s, i)}
    if cfg.is_moe_layer(i):  # the router keeps the norm output (its own input cast is in _router): without
        # SP a view of the replicated [T, H] the MoE layer slices, with SP the rank's [Ts, H] slice
        outer["ffn_input"] = s.Ts * H * s.r
        return outer, _moe(cfg, layout, s, node_rows)
    outer["ffn_input"] = s.T * H * (s.a if s.casts else s.r)  # whole T: under SP the gathered sequence
    F = cfg.ffn_hidden_size // layout.tp
    return outer, {"dense_ffn": s.T * F * ffn_widths(cfg.activation, True) * s.a}


def _selective(cfg: ModelConfig, layout: Layout, s: Shapes, i: int) -> dict[str, int]:
    """What an op-level selective checkpoint caches of block i besides its input (models.parallelize's
    SAVED_OPS): matmul outputs, fused attention outputs and the routing decisions; nothing elementwise."""
    H, a, N = cfg.hidden_size, s.a, cfg.num_heads // layout.tp
    keys = s.B * s.S if s.cp > 1 else s.T  # context parallel: the gathered keys / latents of whole sequences
    if cfg.attention == "mla":
        Dqk, Dv, c = cfg.attn_qk_head_dim, cfg.v_head_dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim
        # q (its latent and projection), kv_a, then kv_b over every key position
        proj = s.T * (cfg.q_lora_rank + N * Dqk + c) + keys * N * (cfg.qk_nope_head_dim + Dv)
        fused = not (s.cpu and Dqk != Dv)  # CPU SDPA falls back to math (bmm, not kept) when Dqk != Dv
    else:
        Dv, K = cfg.attn_head_dim, cfg.num_kv_heads // layout.tp
        proj, fused, c = s.T * (N + 2 * K) * Dv, True, 2 * K * Dv
    # bmm + softmax + bmm (explicit): nothing a selective checkpoint caches
    fused = fused and not s.explicit_attention
    # each SDPA call's output and fp32 logsumexp (``_calls``): sink attention's 8 channels wider, an unmasked one's
    # P' rows long; both flash calls of a CPU PrefixCausalAttention (a later context-parallel chunk)
    width = Dv + SINK_PAD if cfg.attention_sinks else Dv

    def sdpa(n: int, P: int, masked: bool) -> int:
        if not masked and P > n:
            return 2 * n * (Dv * a + FP32)
        return (n if masked or not cfg.attention_sinks else sink_keys(n)) * (width * a + FP32)

    same_widths = cfg.attention != "mla" or cfg.attn_qk_head_dim == Dv
    calls = [_calls(s, r, cfg.attention_window(i), same_widths) for r in _cp_ranks(s)]
    kept = max(s.B * N * sum(sdpa(*call) for call in rank) for rank in calls) if fused else 0
    # q / k / v (or MLA's latents) and the output projection
    out = {"attention": (proj + s.T * H) * a + kept}
    if s.cp > 1:  # the key / value all-gather's output (a functional collective: cached) [B, S, 2KD or c + rope]
        out["attention"] += keys * c * a
    gated = get_activation(cfg.activation).gated
    if not cfg.is_moe_layer(i):  # gate and up [T, F], out [T, H]
        out["dense_ffn"] = s.T * ((1 + gated) * cfg.ffn_hidden_size // layout.tp + H) * a
        return out
    E, k, T, opts = cfg.num_experts, min(cfg.top_k, cfg.num_experts), s.Tm, cfg.router_options
    router = T * E * FP32 * (cfg.router != "hash")  # fp32 logits
    router += 12 * T * k + 16 * T * k  # top-k (fp32 values, int64 ids), the dispatch's stable sort (int64 pairs)
    if opts.get("num_groups"):  # group-limited: the per-group top scores, then the chosen groups
        router += 12 * T * (opts["num_groups"] * opts.get("group_score_top", 2) + opts.get("group_top_k", 1))
    if cfg.capacity_factor is not None:  # the [T, E] priority sort that drops slots past capacity
        router += 12 * T * E
    out["router"] = router
    backend = _backend(cfg, s.cpu)
    # Triton launches are invisible to the dispatcher and the loop's gated function writes out=: both recomputed.
    # The loop runs that function for moe.experts.LOOP_FUSED_ACTIVATIONS (biases or not); other activations
    # compose autograd ops (moe.experts.loop_mlp), whose matmuls the checkpoint caches.
    from moekit.moe.experts import LOOP_FUSED_ACTIVATIONS

    if not (backend == "triton" or (backend == "loop" and cfg.activation in LOOP_FUSED_ACTIVATIONS)):
        out["experts"] = s.R * (cfg.moe_ffn_hidden_size * (1 + gated) + H) * a  # both GEMMs' outputs
    if cfg.shared_ffn_hidden_size:
        out["shared_expert"] = T * ((1 + gated) * cfg.shared_ffn_hidden_size + H + cfg.shared_expert_gate) * a
    return out


def _loss_chunks() -> bool:
    """Whether the trainer's loss runs from hidden states (models.transformer.LOSS_CHUNKS)."""
    from moekit.models import transformer

    return transformer.LOSS_CHUNKS == "auto"


def _backend(cfg: ModelConfig, cpu: bool) -> str:
    """The expert backend the layer runs: its configured one, or what "auto" resolves to."""
    return cfg.expert_backend if cfg.expert_backend != "auto" else _auto_backend(cfg, cpu)


def _auto_backend(cfg: ModelConfig, cpu: bool) -> str:
    """The expert backend "auto" takes: moe.experts.auto_order's first choice for this expert shape."""
    from moekit.moe.experts import auto_order

    w_out = torch.empty(0, cfg.moe_ffn_hidden_size, cfg.hidden_size, device="meta")  # only its shape is read
    return auto_order(torch.device("cpu" if cpu else "cuda"), w_out)[0]


def _add(total: dict[str, int], part: dict[str, int]) -> None:
    for key, v in part.items():
        total[key] = total.get(key, 0) + v


def stage_activations(cfg: ModelConfig, layout: Layout, wl: Workload, stage: Stage,
                      node_rows: float = 0.0) -> tuple[dict[str, int], int]:
    """One micro-batch's activations on a rank of ``stage`` by part, and the recompute transient."""
    s, H, mode = shapes(cfg, layout, wl), cfg.hidden_size, wl.activation_checkpointing
    out, recompute = {"rope": s.T // s.B * cfg.rope_dim * FP32}, 0  # cos, sin [S / cp, D/2], shared
    for i in stage.layers:
        outer, ffn = _block(cfg, layout, s, i, node_rows)
        inner = sum(ffn.values())
        if mode == "full":  # only the block input stays; backward recomputes the whole block
            _add(out, {"residual": s.Ts * H * s.r})
            recompute = max(recompute, sum(outer.values()) - s.Ts * H * s.r + inner)
            continue
        if mode == "selective":  # the block input and the cached op outputs; backward rebuilds the rest
            kept = _selective(cfg, layout, s, i)
            _add(out, {"residual": s.Ts * H * s.r, **kept})
            recompute = max(recompute, sum(outer.values()) + inner - s.Ts * H * s.r - sum(kept.values()))
            continue
        if mode == "ffn":  # the checkpoint keeps the FFN's input and recomputes the rest: the norm output,
            # which under SP is the MoE's own slice, but for a dense MLP the sequence gathered before it
            outer["ffn_input"] = (s.Ts if cfg.is_moe_layer(i) else s.T) * H * s.r
            recompute = max(recompute, inner)
        else:
            _add(out, ffn)
        _add(out, outer)
    if wl.document_mask and mode in ("full", "selective") and stage.layers:  # models.attention.document_segments:
        # [B, S] int32 of the whole sequences (under context parallelism from their gathered ids), which every
        # checkpointed block keeps as its input
        out["documents"] = s.B * s.S * 4
    if stage.first:
        out["embedding"] = s.T * INT64  # token ids
    if stage.last:  # last block's output (all-gathered under SP), final norm, then the loss's own
        out["head"] = _head(cfg, layout, s)
        if cfg.mtp_layers and wl.seq_len > 1:  # the final norm's output, which depth 1's hnorm keeps
            _add(out, {"mtp": s.T * H * s.r})
            if not stage.first:  # a pipeline's last stage looks the tokens up again (its embedding replica)
                _add(out, {"mtp": s.T * H * s.r})
        for k in range(1, cfg.mtp_layers + 1):
            _add(out, _mtp_depth(cfg, layout, wl, k, node_rows))
    else:  # the stage output (all-gathered under SP) waits for its gradient
        _add(out, {"residual": s.T * H * s.r})
    return out, recompute


def _head(cfg: ModelConfig, layout: Layout, s: Shapes) -> int:
    """The final norm and the loss over s.T tokens: the main model's head, and each MTP depth's."""
    H, low = cfg.hidden_size, s.a if s.casts else s.r
    if _loss_chunks():  # models.loss: its gradients dh [T, H] and dW [V, H], no logits
        # measured on CPU: dh is in the dtype of the normed hidden states, the residual stream's (fp32 under
        # autocast over fp32 weights), as is the final norm's kept product
        norm = s.T * FP32 + (s.T * H * s.r if s.cpu else 0)
        return s.T * H * s.r + norm + s.T * H * s.r + cfg.vocab_size * H * s.r
    # LOSS_CHUNKS "never": lm_head input, fp32 log-softmax [T, V]
    norm = s.T * FP32 + (s.T * H * s.r if s.cpu else 0)
    return s.T * H * s.r + norm + s.T * H * low + s.T * cfg.vocab_size * FP32


def _mtp_depth(cfg: ModelConfig, layout: Layout, wl: Workload, k: int, node_rows: float) -> dict[str, int]:
    """Multi-token-prediction depth k (models.mtp; under TP its block is sharded as any block, on the whole
    sequence even with sequence parallelism): on S - k positions per sequence, its two
    input norms, the [embedding; state] concatenation its projection reads, its block (never checkpointed) and
    its own loss through the shared head (gradients dh and dW, as the main loss keeps them)."""
    n = wl.seq_len - k
    if n <= 0:
        return {}
    s = shapes(cfg, layout, dataclasses.replace(wl, seq_len=n, sequence_parallel=False))  # whole sequences
    H, low = cfg.hidden_size, s.a if s.casts else s.r
    outer, ffn = _block(cfg, layout, s, cfg.num_layers + k - 1, node_rows)
    norm = s.T * FP32 + (s.T * H * s.r if s.cpu else 0)  # rsqrt; x * rsqrt on CPU
    out = {"mtp": 2 * norm + 2 * s.T * H * low, **outer}
    _add(out, ffn)
    out["head"] = _head(cfg, layout, s)
    return out


def in_flight(layout: Layout, wl: Workload, stage: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at once (in units of all its layers)."""
    pp, m, v = layout.pp, wl.microbatches, wl.pp_stages_per_rank
    if pp == 1:
        return 1.0
    if wl.pp_schedule == "gpipe":
        return float(m)
    if wl.pp_schedule == "1f1b" or v == 1:
        return float(min(pp - stage, m))
    chunks = 2 * (pp - stage - 1) + (v - 1) * pp + 1  # Megatron's interleaved warm-up + 1, in model chunks
    return min(chunks, m * v) / v

