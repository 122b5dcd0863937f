"""What one attention layer keeps for backward on one rank (moekit.train.planning.activations' attention term): the
calls models.attention makes (whole sequence, window blocks, context-parallel chunks, document masks) and what
each keeps: q, the keys and values (gathered ones under context parallelism), outputs, logsumexps, masks, sinks'
widened copies, CUDA's GQA expansion of masked calls, MLA's latents, the explicit CPU path's probabilities.
"""
from __future__ import annotations

import dataclasses
import math

from moekit.comm.topology import Layout
from moekit.models.config import ModelConfig
from moekit.models.sdpa import KEY_MULTIPLE
from moekit.train.planning.shapes import FP32, Shapes

SINK_PAD = 8  # models.attention.sink_attention widens q / k by this many channels (the sink's, padded to 8)
MEM_EFF_ALIGN = KEY_MULTIPLE  # torch's efficient attention pads a mask whose last dim is not a multiple of 16


def _attention(cfg: ModelConfig, layout: Layout, s: Shapes, i: int) -> int:
    H, N = cfg.hidden_size, cfg.num_heads // layout.tp
    if cfg.is_linear_layer(i):  # a Gated DeltaNet layer (this TP rank's heads)
        from moekit.train.planning.linear_memory import linear_attention_kept

        return linear_attention_kept(cfg, s, layout.tp)
    if cfg.attention == "mla":
        return _mla(cfg, layout, s)
    D, K = cfg.attn_head_dim, cfg.num_kv_heads // layout.tp
    inputs = s.T * H * (s.a if s.casts else s.r)  # autocast: the one bf16 copy wq, wk and wv read
    chunk = cfg.attention_chunk_of(i)
    if chunk and s.explicit_attention and s.S > chunk:  # chunked attention runs SDPA per chunk, never explicit
        s = dataclasses.replace(s, explicit_attention=False)
    kept = _gqa_kept(s, N, K, D, cfg.attention_window(i), cfg.attention_sinks, cfg.num_kv_heads != cfg.num_heads,
                     chunk)
    if cfg.qk_norm == "unit" and cfg.uses_rope(i):  # Llama 4's weightless norm of q / k in fp32 keeps its input (q
        # and k themselves in fp32, else their fp32 copies) and an rsqrt per head row; nothing multiplies its output
        kept += s.T * (N + K) * D * FP32 + s.T * (N + K) * FP32
    elif cfg.qk_norm in ("head", "full"):  # the norms keep their inputs (q, k before the norm) and rsqrt per row
        # (per head, or per token for "full"); the CPU's composite RMSNorm also its x * rsqrt product
        rows = s.T * (N + K) if cfg.qk_norm == "head" else 2 * s.T
        if cfg.norm_zero_centered or (s.autocast and s.cpu):  # models.norms.ZeroCenteredRMSNorm normalises an
            # fp32 copy and keeps it and the fp32 normalised rows its (1 + w) multiplies; so does the CPU's RMSNorm on
            # a bf16 input under autocast (measured; CUDA's fused kernel, which models.norms.RMSNorm reaches by casting
            # its fp32 weight to the input's dtype, keeps the input and the rsqrt as under FSDP's bf16 parameters)
            kept += s.T * (N + K) * D * 2 * FP32 + rows * FP32
        else:
            kept += s.T * (N + K) * D * s.a * (2 if s.cpu else 1) + rows * FP32
    if cfg.attention_output_gate:  # sigmoid(gate) and the gated output wo reads [T, N D]
        kept += s.T * N * D * 2 * s.a
    return inputs + kept


def _mla(cfg: ModelConfig, layout: Layout, s: Shapes) -> int:
    """models.attention.MLAttention: the latents and their norms, q, the keys expanded per head from the latent,
    v, the output and its logsumexp. Under context parallelism the latent of the whole sequence is gathered and
    expanded on every rank: k and v are [B, N, S, *] of all S positions, and the normed latent wkv_b reads is the
    gathered one (a [B, S, c] copy out of the gathered [B, S, c + rope]), not this rank's."""
    H, N, T, a = cfg.hidden_size, cfg.num_heads // layout.tp, s.T, s.a
    Dqk, Dv, c, q_lora = cfg.attn_qk_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.q_lora_rank
    keys = s.B * s.S if s.cp > 1 else T  # key positions expanded on this rank
    inputs = T * H * (a if s.casts else s.r)  # autocast: the one bf16 copy wq (or wq_a) and wkv_a read
    # wq_a's output and its norm's, wkv_a's [T, c + rope], the normed latent wkv_b reads; each latent norm's rsqrt
    # (and x * rsqrt on CPU: the composite RMSNorm)
    latents = T * 2 * q_lora * a + T * (c + cfg.qk_rope_head_dim) * a + keys * c * a
    for width in (q_lora, c) if q_lora else (c,):
        latents += T * FP32 + (T * width * a if s.cpu else 0)
    kept = T * N * Dqk * a + keys * N * (Dqk + Dv) * a + T * N * (Dv * a + FP32)  # q; k, v; output, logsumexp
    if s.cp > 1 or s.cpu:  # wo reads a copy of the chunks' outputs (on CPU: of the one call's too)
        kept += T * N * Dv * a
    if s.cpu and Dqk != Dv and not s.explicit_attention:  # CPU SDPA's math path (no flash kernel for unequal
        # q / v widths): each call keeps its softmax probabilities [B, N, queries, keys] in fp32 for backward, and
        # neither its output nor a logsumexp (the bmm's backward reads the probabilities and v)
        kept += max(sum(s.B * N * n * P * FP32 for n, P, _ in _calls(s, r, 0, False)) for r in _cp_ranks(s))
        kept -= T * N * (Dv * a + FP32)
    # a mask per masked call: each chunk but rank 0's first, every call with documents (MLA: no key heads to expand)
    kept += max(sum(_mask_bytes(s, N, n, P) for n, P, masked in _calls(s, r, 0, Dqk == Dv, width=Dqk) if masked)
                for r in _cp_ranks(s))
    return inputs + latents + kept + _explicit_probs(cfg, layout, s)


def _gqa_kept(s: Shapes, N: int, K: int, D: int, window: int, sinks: bool, gqa: bool, chunk: int = 0) -> int:
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
        calls = _calls(s, rank, window, chunk=chunk, width=D, sinks=sinks)
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


def lower_right_planned(s: Shapes, same_widths: bool, width: int, sinks: bool) -> bool:
    """Whether a later context-parallel chunk (keys before its queries all visible, no window, no documents) runs
    as one unmasked flash call aligned bottom-right on CUDA (models.attention._lower_right_applies): no mask and
    no GQA expansion kept, its output and logsumexp as a causal call's. ``width``: the q (= v) head width."""
    from moekit.models.attention import lower_right_fits

    return (not s.cpu and not sinks and not s.documents and same_widths and width > 0
            and lower_right_fits(s.a, width, width))


def _calls(s: Shapes, rank: int, window: int, same_widths: bool = True, chunk: int = 0, width: int = 0,
           sinks: bool = False) -> list[tuple[int, int, bool]]:
    """(queries, keys, masked) per sequence of each SDPA call one attention layer makes on context-parallel rank
    ``rank``, as models.attention makes them: local_attention over the whole sequence (cp 1; one call unless a
    window splits the queries into blocks) or over each zigzag chunk (context_attend); each block of queries reads
    the keys from its window's start (else 0) to its own end, a windowed block a few more (hidden by its mask) so
    that it reads a multiple of 16 keys (but none before position 0), with a mask unless they are its own
    positions, the window hides none of them and there are no documents (positioned_attention). Unmasked over more
    keys than queries: on CPU a context-parallel chunk after the first, without window or documents, whose q and v
    have the same head width (``same_widths``) runs as PrefixCausalAttention (every earlier key visible, then
    causal: two flash calls merged by their logsumexps, no mask; models.attention._prefix_applies); on CUDA, in
    bf16 / fp16 with one q / v head ``width`` the flash kernel takes and no ``sinks``, as one flash call aligned
    bottom-right (``lower_right_planned``): unmasked too. ``chunk``
    (chunked attention, where the sequence is longer): the spans are cut at the chunks' starts, and each piece's
    keys start at its chunk's (models.attention.local_attention)."""
    from moekit.comm.context_parallel import ContextParallel
    from moekit.models.attention import window_block

    spans = [(g, n) for _, g, n in ContextParallel(s.cp, rank).chunks(s.S // s.cp)] if s.cp > 1 else [(0, s.S)]
    pieces = []  # (first query, queries, the first key they may see)
    for q_start, S in spans:
        if not chunk or s.S <= chunk:
            pieces.append((q_start, S, 0))
            continue
        first = q_start
        while first < q_start + S:
            end = min(q_start + S, (first // chunk + 1) * chunk)
            pieces.append((first, end - first, first // chunk * chunk))
            first = end
    out = []
    lower_right = lower_right_planned(s, same_widths, width, sinks)
    for q_start, S, k_start in pieces:
        block = window_block(S, window, s.documents, s.cpu)
        for i in range(0, S, block):
            n, first = min(block, S - i), q_start + i
            lo = max(k_start, first - window + 1) if window else k_start
            if window:  # local_attention's keys, a multiple of 16 of them where there are enough
                lo = max(0, first + n - math.ceil((first + n - lo) / MEM_EFF_ALIGN) * MEM_EFF_ALIGN)
            plain = first == lo and (not window or window >= n) and not s.documents
            prefix = s.cpu and same_widths and lo < first and not window and not s.documents
            later = lower_right and lo < first and not window  # CUDA's bottom-right flash call
            out.append((n, first + n - lo, not (plain or prefix or later)))
    return out


def _explicit_probs(cfg: ModelConfig, layout: Layout, s: Shapes) -> int:
    """The explicit attention (CPU bf16, short sequences) keeps the softmax probabilities [B, N, S, S] for
    backward where SDPA keeps an fp32 logsumexp [B, N, S]; it keeps copies of q, k, v in place of the views
    SDPA keeps, and the output either way (the same bytes)."""
    if not s.explicit_attention:
        return 0
    N = cfg.num_heads // layout.tp
    return s.T * N * (s.S * s.a - FP32)
