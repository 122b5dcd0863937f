"""Attention and the KV cache of the decoder (models.transformer builds blocks from these; RoPE: models.rope).

Shape legend: B batch, S sequence, H hidden, N query heads, K key/value heads, D head dim.

    gqa (Attention)      q = wq(x), k = wk(x), v = wv(x)         [+ bias: attention_bias]
                         qk_norm "full": RMSNorm over q [N*D] and k [K*D] (OLMoE), then split into heads
                         qk_norm "head": RMSNorm(D) on every q and k head (Qwen3)
                         qkv_clip: clamp q, k, v to [-clip, clip] (OLMoE); RoPE on q, k; causal SDPA (GQA)
                         sliding window (per layer: config.attention_window), sinks and a wo bias (gpt-oss)
    mla (MLAttention)    DeepSeek-V2/V3 multi-head latent attention, per head n:
                         q_n = [q_nope_n, q_rope_n] = wq(x) or wq_b(norm(wq_a(x)))        (nope + rope dims)
                         [c, k_rope] = wkv_a(x); [k_nope_n, v_n] = wkv_b(norm(c))        (c: kv_lora_rank)
                         k_n = [k_nope_n, RoPE(k_rope)]  (the rope key is shared by all heads)
                         softmax(q_n . k_n * scale) v_n, scale = (nope + rope)^-0.5 * yarn mscale^2
    RoPE                 models.rope: cos, sin [S, R/2] tables and the rotation (R: D, or MLA's rope dims)

Under tensor parallelism the projections into heads are column-sharded, so q / k / v views use -1 heads
(this rank's share) and nothing here knows about ranks (comm.tensor_parallel).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moekit.models.config import ModelConfig
from moekit.models.rope import (  # noqa: F401  (re-exported: RoPE lived here)
    apply_rope, apply_rope_interleaved, rope_angles, rope_frequencies, rope_tables, yarn_mscale)

# DeepSeek's latent norms (q_a_layernorm, kv_a_layernorm) use RMSNorm's default epsilon, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


# ---------------------------------------------------------------------------------------------------
# Attention modules
# ---------------------------------------------------------------------------------------------------


# Where causal attention runs as explicit bmm + softmax + bmm (``explicit_causal_attention``) instead of torch's
# SDPA: "auto" for CPU bf16 / fp16 (including under autocast) with sequences of at most EXPLICIT_MAX_SEQ and
# [B, N, S, S] scores of at most EXPLICIT_MAX_SCORES elements, not while torch.compile traces; "always"
# everywhere (tests); "never": SDPA everywhere. Measured forward + backward, bf16, 4 heads of 32, 2 cores
# (tools/bench/cpu_fusion.py --cases attention --attn-batch B --attn-seq S), explicit / SDPA time:
#     S 128: 0.30 (B 16)   S 256: 0.74 (B 4), 0.43 (B 16), 0.94 (B 64)   S 384: 0.48 (B 16)
#     S 512: 1.22-1.24 (B 4, 16)   S 768: 1.95   S 1024: 1.92   S 2048: 2.32
# torch's CPU flash attention is slow in bf16 at short sequences; from S 512 on its tiling wins. In fp32 the
# two were equal at S 256 (0.97) and explicit lost 3-4x at S 1024-2048, so fp32 keeps SDPA. The explicit form
# materialises the scores (and keeps the probabilities for backward), hence the element cap as well (2**24:
# 32 MiB in bf16 per layer; past it the fresh allocations' page faults eat the gain, B 64 x S 256).
EXPLICIT_ATTENTION = "auto"
_EXPLICIT_ATTENTION_MODES = ("auto", "always", "never")
EXPLICIT_MAX_SEQ = 384
EXPLICIT_MAX_SCORES = 2**24


def explicit_attention_applies(device_type: str, dtype: torch.dtype, batch: int, heads: int, seq_len: int) -> bool:
    """Whether causal attention without a KV cache runs as ``explicit_causal_attention`` (EXPLICIT_ATTENTION
    above) for these shapes in this compute dtype; also what train.planning's activation estimate asks."""
    mode = EXPLICIT_ATTENTION
    if mode not in _EXPLICIT_ATTENTION_MODES:
        raise ValueError(f"models.attention.EXPLICIT_ATTENTION={mode!r}; use one of "
                         f"{', '.join(_EXPLICIT_ATTENTION_MODES)}")
    if mode != "auto":
        return mode == "always"
    return (device_type == "cpu" and dtype in (torch.bfloat16, torch.float16) and seq_len <= EXPLICIT_MAX_SEQ
            and batch * heads * seq_len * seq_len <= EXPLICIT_MAX_SCORES)


def _explicit_attention(q: Tensor) -> bool:
    dtype = torch.get_autocast_dtype("cpu") if q.device.type == "cpu" and torch.is_autocast_enabled("cpu") else q.dtype
    B, N, S, _ = q.shape
    return (explicit_attention_applies(q.device.type, dtype, B, N, S)
            and not (EXPLICIT_ATTENTION == "auto" and torch.compiler.is_compiling()))


def explicit_causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, window: int = 0,
                              sinks: Tensor | None = None) -> Tensor:
    """Causal attention of q [B, N, S, Dqk] over k [B, K, S, Dqk], v [B, K, S, Dv] (N % K == 0) as
    softmax(q k^T * scale + causal mask) v in batched matmuls: each key head's G = N / K query heads are
    stacked into one [G * S, Dqk] block, so the keys and values are read as they are (no GQA expansion).
    The same function as ``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)``;
    ``window`` > 0 also hides keys more than window - 1 positions back, ``sinks`` [N] joins each head's softmax
    as a column of its own that is then dropped (as ``sink_attention``)."""
    B, N, S, Dqk = q.shape
    K, Dv = k.shape[1], v.shape[-1]
    if N % K or k.shape[2] != S:
        raise ValueError(f"explicit_causal_attention: {N} query heads over {K} key heads of length {k.shape[2]} "
                         f"for {S} queries; need N % K == 0 and keys as long as the queries")
    G = N // K
    scale = Dqk ** -0.5 if scale is None else scale
    if window:  # [S, S] additive: 0 where visible
        mask = torch.zeros(S, S, device=q.device, dtype=q.dtype).masked_fill_(~window_mask(0, S, window, q.device),
                                                                              -math.inf)
    else:
        mask = torch.full((S, S), -math.inf, device=q.device, dtype=q.dtype).triu_(1)
    scores = torch.baddbmm(mask.repeat(G, 1), q.reshape(B * K, G * S, Dqk), k.reshape(B * K, S, Dqk).transpose(1, 2),
                           alpha=scale)  # [B*K, G*S, S]
    if sinks is None:
        return torch.bmm(scores.softmax(-1), v.reshape(B * K, S, Dv)).view(B, N, S, Dv)
    sink = sinks.to(scores.dtype).view(1, K, G, 1).expand(B, K, G, S).reshape(B * K, G * S, 1)  # head n = k*G + g
    probs = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :S]  # the sink's share taken, then dropped
    return torch.bmm(probs, v.reshape(B * K, S, Dv)).view(B, N, S, Dv)


def sink_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, sinks: Tensor, scale: float | None,
                   gqa: bool) -> Tensor:
    """Attention whose softmax also counts a learned logit per query head (gpt-oss's sinks): for query i of
    head n, softmax over [q_i.k_j * scale (j visible), sinks_n], the sink's share dropped, so the weights sum to
    less than 1 and a head can attend to nothing. q [B, N, S, D], k [B, K, P, D], v [B, K, P, Dv] (Dv <= D + 8),
    ``mask`` [S, P] bool (True: visible), or None: causal, P == S; sinks [N].

    Run as SDPA over one more key that every query sees, with a zero value, and one more channel: q gets
    sinks_n / scale there and the extra key 1, the real keys 0, so that key's logit is sinks_n for every query
    of head n whatever its q. Torch's fused kernels then do the rest (and the sinks' gradient is that
    channel's). Shapes are kept to what those kernels take:
      - the channel is padded to 8 (head dims stay multiples of 8 for the GPU kernels), and v to the same width
        (CPU flash attention needs one head dim for q, k and v; without it torch runs its reference path, which
        keeps the [B, N, S, 1+P] probabilities: 2.2x the saved bytes measured at tiny size, 5x slower at S 1024);
      - the keys are padded with hidden zero keys to a multiple of 16 (CUDA's memory-efficient kernel otherwise
        copies the mask into a padded [B, N, S, keys] tensor that backward keeps: 2 GiB per layer at S 4096).

        q' [.., S, D+8] = [q | sinks_n/scale | 0...]      k' [.., 16m, D+8] = [0 | 1 | 0...] ; [k | 0 ...] ; 0...
        v' [.., 16m, D+8] = 0 ; [v | 0 ...] ; 0...         mask' [S, 16m] = [True | mask | False...]

    Causal (no mask): the queries get the same row layout as the keys, a zero query first and zero queries at
    the end, so plain causal SDPA (is_causal: flash attention on CPU and GPU, GQA native, causal blocks skipped,
    no mask) lets row 1 + i, query i, see the sink and keys 0 .. i; the pad rows' outputs are dropped.
    """
    B, N, S, D = q.shape
    K, P, Dv = k.shape[1], k.shape[2], v.shape[-1]
    scale = D**-0.5 if scale is None else scale
    width = D + 8
    hidden = -(1 + P) % 16  # zero keys no query sees, to a multiple of 16
    sink_q = (sinks.to(q.dtype) / scale).view(1, N, 1, 1).expand(B, N, S, 1)
    q2 = torch.cat((q, sink_q, q.new_zeros(B, N, S, width - D - 1)), dim=-1)  # [B, N, S, D+8]
    sink_k = k.new_zeros(B, K, 1, width)
    sink_k[..., D] = 1
    k2 = torch.cat((sink_k, F.pad(k, (0, width - D)), k.new_zeros(B, K, hidden, width)), dim=2)  # [B, K, 16m, D+8]
    v2 = F.pad(v, (0, width - Dv, 1, hidden))  # [B, K, 16m, D+8]: the sink's and the hidden keys' values 0
    if mask is None:
        if P != S:
            raise ValueError(f"sink_attention without a mask is causal over its own positions: {S} queries need "
                             f"{S} keys, got {P}; pass the [S, P] mask")
        q2 = F.pad(q2, (0, 0, 1, hidden))  # [B, N, 16m, D+8]: row 1 + i is query i
        y = F.scaled_dot_product_attention(q2, k2, v2, is_causal=True, enable_gqa=gqa, scale=scale)
        return y[:, :, 1 : S + 1, :Dv]
    lead = mask.shape[:-1]  # [S], or [B, 1, S] with documents (segment_mask)
    mask2 = torch.cat((mask.new_ones(*lead, 1), mask, mask.new_zeros(*lead, hidden)), dim=-1)  # [.., S, 16m]
    return masked_sdpa(q2, k2, v2, mask2, gqa, scale)[..., :Dv]


def masked_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, gqa: bool, scale: float | None) -> Tensor:
    """SDPA with a boolean mask. On a GPU, torch's GQA (enable_gqa) runs on the flash kernel only, which takes no
    mask, so a masked GQA call would fall back to the math kernel and materialise [B, N, S, S] scores; the keys and
    values are expanded to the query heads instead (K/N of what the scores would cost), which the
    memory-efficient kernel takes. On the CPU, torch's flash kernel takes both."""
    if gqa and q.is_cuda:
        groups = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)


def attend(q: Tensor, k: Tensor, v: Tensor, kv: LayerKV | None, gqa: bool, scale: float | None = None,
           window: int = 0, sinks: Tensor | None = None, segments: Tensor | None = None) -> Tensor:
    """Causal SDPA of q [B, N, S, Dqk] over k [B, K, S, Dqk], v [B, K, S, Dv] (-> [B, N, S, Dv]); with ``kv``
    the new keys / values are appended to the cache and q attends to every cached position too. Where it
    is faster (CPU bf16, small S: EXPLICIT_ATTENTION) the same function runs as bmm + softmax + bmm.
    ``window`` > 0: each query sees only the last ``window`` positions, itself included (``local_attention``:
    only the keys a window reaches are read); ``sinks`` [N]: a learned logit per query head in every softmax
    (``sink_attention``); ``segments`` [B, S]: each position's document (``document_segments``), attention stays
    within it (training only: no KV cache)."""
    if segments is not None:
        if kv is not None:
            raise ValueError("document masking (segments) is for training forwards; decode without it")
        return local_attention(q, k, v, 0, gqa, scale, window, sinks, segments=segments)
    if kv is None and _explicit_attention(q):
        return explicit_causal_attention(q, k, v, scale, window, sinks)
    start, S, first = 0 if kv is None else kv.length, q.shape[2], 0
    if kv is not None:  # [B, K, start+S - first, D*]: every position a new query can see, in order
        k, v, first = kv.extend(k, v)
    if not window and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(start, S, q.device),
                                              is_causal=start == 0 and S > 1, enable_gqa=gqa, scale=scale)
    if kv is not None and sinks is not None and S <= CACHED_SINKS_MAX_NEW:  # decoding: no widened cache copies
        lo = max(first, start - window + 1) if window else first
        mask = span_mask(start, S, lo, start + S - lo, window, q.device)
        return masked_sink_attention(q, k[:, :, lo - first :], v[:, :, lo - first :], mask, sinks, scale)
    return local_attention(q, k, v, start, gqa, scale, window, sinks, first)


# Sliding-window layers run their queries in blocks of WINDOW_BLOCK positions (at least the window), each over
# only the keys its window reaches: S * (block + window) query-key pairs instead of the S^2 / 2 of one masked call
# (gpt-oss, window 128, S 4096: 384 / 2048 per query, 5.3x fewer). Where S < 2 blocks, one call. 0: never.
# Measured: docs/benchmarks.md, "Sliding-window blocks" (tools/bench/attention_sinks.py).
WINDOW_BLOCK = 256


def window_block(S: int, window: int) -> int:
    """Query positions per call of ``local_attention`` for S queries under ``window`` (S: one call)."""
    if not window or WINDOW_BLOCK <= 0:
        return S
    block = max(WINDOW_BLOCK, window)
    return block if S >= 2 * block else S


def local_attention(q: Tensor, k: Tensor, v: Tensor, q_start: int, gqa: bool, scale: float | None = None,
                    window: int = 0, sinks: Tensor | None = None, k_start: int = 0,
                    segments: Tensor | None = None) -> Tensor:
    """Causal (``window``: sliding-window) attention of queries at positions q_start .. q_start+S-1, q [B, N, S, Dqk],
    over keys k [B, K, P, Dqk] and values v [B, K, P, Dv] at positions k_start .. k_start+P-1 (at least every
    position the queries see; keys past the last query are never read). Each block of ``window_block`` queries
    reads the keys from its window's start to its own end: a KV cache's decoding step, a context-parallel chunk
    and a long windowed sequence alike. ``segments`` [B, k_start+P]: the document of every position (keys and
    queries), or None."""
    S = q.shape[2]
    block = window_block(S, window)
    out = []
    for i in range(0, S, block):
        n, first = min(block, S - i), q_start + i
        lo = max(k_start, first - window + 1) if window else k_start  # the first key any of these queries sees
        # a few more keys, hidden by the mask, so there are a multiple of 16: CUDA's memory-efficient kernel keeps a
        # per-head copy of a mask whose key count is not (sink_attention pads for the same reason)
        if window:
            lo = max(k_start, first + n - -(-(first + n - lo) // 16) * 16)
        keys = slice(lo - k_start, first + n - k_start)
        out.append(positioned_attention(q[:, :, i : i + n], k[:, :, keys], v[:, :, keys],
                                        first, lo, gqa, scale, window, sinks, segments))
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


def positioned_attention(q: Tensor, k: Tensor, v: Tensor, q_start: int, k_start: int, gqa: bool,
                         scale: float | None, window: int, sinks: Tensor | None,
                         segments: Tensor | None = None) -> Tensor:
    """One attention call: queries at q_start .., keys at k_start .. up to the last query's position. Plain causal
    SDPA (no mask) where the keys are the queries' own positions and neither the window nor a document boundary
    hides any of them."""
    S, P = q.shape[2], k.shape[2]
    if q_start == k_start and P == S and (not window or window >= S) and segments is None:
        if sinks is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=S > 1, enable_gqa=gqa, scale=scale)
        return sink_attention(q, k, v, None, sinks, scale, gqa)
    if _prefix_applies(q, v, q_start - k_start, P, window, segments):
        return PrefixCausalAttention.apply(q, k, v, q_start - k_start, scale, sinks)
    mask = span_mask(q_start, S, k_start, P, window, q.device)  # [S, P]
    if segments is not None:  # [B, 1, S, P]: and the same document
        same = segments[:, q_start : q_start + S, None] == segments[:, None, k_start : k_start + P]
        mask = (mask & same)[:, None]
    if sinks is None:
        return masked_sdpa(q, k, v, mask, gqa, scale)
    return sink_attention(q, k, v, mask, sinks, scale, gqa)


def document_segments(tokens: Tensor, eos: int) -> Tensor:
    """[B, S] int32: each position's document in a packed sequence, the number of end-of-document tokens ``eos``
    before it (an EOS ends its own document; the next position starts the next one). No host sync."""
    ends = tokens == eos
    return (ends.cumsum(dim=1, dtype=torch.int32) - ends.int())


def _prefix_applies(q: Tensor, v: Tensor, prefix: int, P: int, window: int, segments) -> bool:
    """Whether a call of queries after ``prefix`` fully visible keys runs as PrefixCausalAttention: causal attention
    (sinks or not; no window or documents) over keys that end with the queries' own positions, on the CPU (its flash
    kernel returns the logsumexp the merge needs), with one head width for q, k and v, outside torch.compile."""
    return (prefix > 0 and P == prefix + q.shape[2] and not window and segments is None
            and q.device.type == "cpu" and q.shape[-1] == v.shape[-1] and not torch.compiler.is_compiling())


_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class PrefixCausalAttention(torch.autograd.Function):
    """Queries at positions p .. p+S-1 over keys 0 .. p+S-1 (a context-parallel chunk: every earlier key visible,
    then causal over its own positions) without a mask. SDPA's causal flag aligns the diagonal top-left, so this
    call needs a [S, p+S] mask, which CPU SDPA converts to float and keeps for backward: S^2 / (2 cp) elements per
    layer and rank, more than context parallelism saves at long sequences. Instead two flash calls, merged by
    their logsumexps (as ring attention merges its blocks):

        o1, l1 = attention(q, keys 0 .. p-1)             (no mask: all visible)
        o2, l2 = attention(q, keys p .. p+S-1, causal)   (square: the causal flag is right)
        l = logaddexp(l1, l2 [, sink_n]);   out = exp(l1 - l) o1 + exp(l2 - l) o2

    gpt-oss's sinks join the merge as a third part with logsumexp sink_n and value 0. Backward runs each part's
    flash backward with the merged ``out`` and ``l``: they recompute each part's probabilities as exp(scores - l),
    the merged softmax's restricted to that part, and its row term rowsum(dout * out) is the merged one, so the
    parts' gradients add up to the whole call's; a sink's is -sum over its rows of exp(sink_n - l) rowsum(dout * out).
    Keeps q, the keys and values (views of the gathered tensor), out and l [B, N, S] (float32): no mask."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, prefix: int, scale: float | None,
                sinks: Tensor | None = None) -> Tensor:
        with torch.autocast("cpu", enabled=False):
            k, v = k.to(q.dtype), v.to(q.dtype)
            o1, l1 = _CPU_FLASH(q, k[:, :, :prefix], v[:, :, :prefix], 0.0, False, scale=scale)
            o2, l2 = _CPU_FLASH(q, k[:, :, prefix:], v[:, :, prefix:], 0.0, True, scale=scale)
            lse = torch.logaddexp(l1, l2)  # [B, N, S]
            if sinks is not None:
                lse = torch.logaddexp(lse, sinks.float().view(1, -1, 1))
            out = (torch.exp(l1 - lse)[..., None] * o1 + torch.exp(l2 - lse)[..., None] * o2).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.prefix, ctx.scale = prefix, scale
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        p, grad = ctx.prefix, grad.contiguous().to(q.dtype)
        with torch.autocast("cpu", enabled=False):
            dq1, dk1, dv1 = _CPU_FLASH_BACKWARD(grad, q, k[:, :, :p], v[:, :, :p], out, lse, 0.0, False, scale=ctx.scale)
            dq2, dk2, dv2 = _CPU_FLASH_BACKWARD(grad, q, k[:, :, p:], v[:, :, p:], out, lse, 0.0, True, scale=ctx.scale)
            dsinks = None
            if sinks is not None and ctx.needs_input_grad[5]:
                rows = (grad.float() * out.float()).sum(-1)  # [B, N, S]
                dsinks = -(torch.exp(sinks.float().view(1, -1, 1) - lse) * rows).sum((0, 2)).to(sinks.dtype)
        return dq1 + dq2, torch.cat((dk1, dk2), dim=2), torch.cat((dv1, dv2), dim=2), None, None, dsinks


def span_mask(q_start: int, S: int, k_start: int, P: int, window: int, device) -> Tensor:
    """[S, P] bool: queries at positions q_start .. q_start+S-1 over keys at k_start .. k_start+P-1; key j is
    visible to query i iff j <= i (and i - window < j when ``window`` > 0)."""
    keys = torch.arange(k_start, k_start + P, device=device)[None, :]  # [1, P]
    queries = torch.arange(q_start, q_start + S, device=device)[:, None]  # [S, 1]
    visible = keys <= queries
    return visible & (keys > queries - window) if window else visible


def context_attend(q: Tensor, k: Tensor, v: Tensor, context, gqa: bool, scale: float | None = None,
                   window: int = 0, sinks: Tensor | None = None, segments: Tensor | None = None) -> Tensor:
    """Causal attention of a context-parallel rank's queries q [B, N, S_local, Dqk] (its chunks of the sequence:
    ``context.chunks``, comm.context_parallel) over the whole sequence's keys k [B, K, S, Dqk] and values
    v [B, K, S, Dv], gathered in position order. Each chunk attends to the keys up to its own end only (and from
    its window's start): the zigzag chunks then cost every rank the same. ``segments`` [B, S]: the whole
    sequence's documents, or None. -> [B, N, S_local, Dv]."""
    out = [local_attention(q[:, :, local : local + n], k, v, start, gqa, scale, window, sinks, segments=segments)
           for local, start, n in context.chunks(q.shape[2])]
    return torch.cat(out, dim=2)


# With sinks, a decoding step (at most this many new positions over a KV cache) runs ``masked_sink_attention``:
# sink_attention's widened copies of every cached key and value would cost ~3x the reads of the attention itself.
CACHED_SINKS_MAX_NEW = 16


def masked_sink_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, sinks: Tensor,
                          scale: float | None = None) -> Tensor:
    """``sink_attention``'s function as batched matmuls over the keys as they are (GQA by stacking each key head's
    query heads, as explicit_causal_attention): q [B, N, S, D], k [B, K, P, D], v [B, K, P, Dv], mask [S, P]."""
    B, N, S, D = q.shape
    K, P, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = N // K
    scale = D**-0.5 if scale is None else scale
    scores = torch.matmul(q.reshape(B, K, G * S, D), k.transpose(-1, -2)) * scale  # [B, K, G*S, P]
    scores = scores.masked_fill(~mask.repeat(G, 1), -math.inf)
    sink = sinks.to(scores.dtype).view(1, K, G, 1, 1).expand(B, K, G, S, 1).reshape(B, K, G * S, 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :P]
    return torch.matmul(probs, v).view(B, N, S, Dv)


class Attention(nn.Module):
    """Causal grouped-query attention: K key/value heads serve N query heads (N % K == 0); optional q/k/v
    biases, q/k RMSNorm ("head" or "full") and q/k/v clipping (module docstring)."""

    def __init__(self, config: ModelConfig, layer_id: int = 0):
        super().__init__()
        self.window = config.attention_window(layer_id)
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim, self.rope_dim = config.attn_head_dim, config.rope_dim
        self.qk_norm, self.qkv_clip = config.qk_norm, float(config.qkv_clip)
        H, D, bias = config.hidden_size, self.head_dim, config.attention_bias
        self.wq = nn.Linear(H, self.num_heads * D, bias=bias)
        self.wk = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.wv = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.wo = nn.Linear(self.num_heads * D, H, bias=config.attention_out_bias)
        # gpt-oss: one learned logit per query head in the softmax (sink_attention); a DTensor sharded by heads
        # under tensor parallelism (comm.tensor_parallel), like wq's output
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.attention_sinks else None
        self.context_parallel = None  # comm.context_parallel: gather the sequence's keys and values
        if config.qk_norm != "none":
            full = config.qk_norm == "full"
            self.q_norm = nn.RMSNorm(self.num_heads * D if full else D, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(self.num_kv_heads * D if full else D, eps=config.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: LayerKV | None = None,
                segments: Tensor | None = None) -> Tensor:
        """x [B, S, H] at the positions cos/sin describe. ``kv``: this layer's cache (incremental decoding);
        the new keys/values are appended and the queries attend to every cached position as well. ``segments``:
        the documents of the sequence's positions (the whole sequence's under context parallelism), or None."""
        B, S, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)  # [B, S, N*D], [B, S, K*D] x 2
        if self.qk_norm == "full":  # over the whole projection (never under TP: comm.tensor_parallel)
            q, k = self.q_norm(q), self.k_norm(k)
        # -1 heads: under tensor parallelism this rank's q/k/v projections produce N/tp and K/tp heads
        q, k, v = (t.view(B, S, -1, self.head_dim) for t in (q, k, v))  # [B, S, heads, D]
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.qkv_clip > 0:
            q, k, v = (t.clamp(-self.qkv_clip, self.qkv_clip) for t in (q, k, v))
        # RoPE before the transpose: x [B, S, heads, D] is laid out as the projection wrote it
        q, k = self._rope(q, cos[:, None], sin[:, None]), self._rope(k, cos[:, None], sin[:, None])
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, D]
        sinks = self.sinks.to_local() if hasattr(self.sinks, "to_local") else self.sinks  # this rank's heads
        gqa = self.num_kv_heads != self.num_heads
        if self.context_parallel is not None and kv is None:  # this rank's queries over every position's keys
            kv_all = self.context_parallel.gather(torch.cat((k, v), dim=-1), dim=2)  # [B, K, S_global, 2D]
            k, v = kv_all.split(self.head_dim, dim=-1)
            y = context_attend(q, k, v, self.context_parallel, gqa, window=self.window, sinks=sinks,
                               segments=segments)
        else:
            y = attend(q, k, v, kv, gqa, window=self.window, sinks=sinks, segments=segments)  # [B, N, S, D]
        return self.wo(y.transpose(1, 2).reshape(B, S, -1))  # [B, S, H]

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """RoPE on the first rope_dim channels of each head (all of them unless partial_rotary_factor < 1)."""
        if self.rope_dim == self.head_dim:
            return apply_rope(x, cos, sin)
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat((apply_rope(rot, cos, sin), rest), dim=-1)

    @torch.no_grad()
    def init_weights(self, normal_, std: float, std_out: float) -> None:
        for w in (self.wq, self.wk, self.wv):
            normal_(w.weight, std)
            if w.bias is not None:
                w.bias.zero_()
        normal_(self.wo.weight, std_out)
        if self.wo.bias is not None:
            self.wo.bias.zero_()
        if self.sinks is not None:  # 0: the sink starts as one more key of logit 0 (gpt-oss trained from there)
            self.sinks.zero_()
        if self.qk_norm != "none":
            self.q_norm.weight.fill_(1.0)
            self.k_norm.weight.fill_(1.0)


class MLAttention(nn.Module):
    """DeepSeek-V2/V3 multi-head latent attention (module docstring), numerically transformers'
    DeepseekV3Attention: low-rank (or full-rank, q_lora_rank = 0) queries, a compressed key/value latent
    with one RoPE key shared by all heads, decoupled RoPE on the rope dims only."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        H, N = config.hidden_size, config.num_heads
        self.num_heads = N
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank, self.interleave = config.kv_lora_rank, config.rope_interleave
        qk = self.nope + self.rope
        if config.q_lora_rank:
            self.wq_a = nn.Linear(H, config.q_lora_rank, bias=False)
            self.q_a_norm = nn.RMSNorm(config.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(config.q_lora_rank, N * qk, bias=False)
        else:
            self.wq = nn.Linear(H, N * qk, bias=False)
        self.wkv_a = nn.Linear(H, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_norm = nn.RMSNorm(self.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_lora_rank, N * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(N * self.v_dim, H, bias=False)
        self.scale = qk**-0.5
        self.context_parallel = None  # comm.context_parallel: gather the sequence's key latents
        rs = config.rope_scaling
        if rs.get("rope_type") == "yarn" and rs.get("mscale_all_dim"):
            self.scale *= yarn_mscale(float(rs["factor"]), rs["mscale_all_dim"]) ** 2

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: LayerKV | None = None,
                segments: Tensor | None = None) -> Tensor:
        """As Attention.forward; the cache holds the expanded keys [B, N, S, nope+rope] and values [B, N, S, v]."""
        B, S, _ = x.shape
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_a_norm(self.wq_a(x)))  # [B, S, N*(nope+rope)]
        q = q.view(B, S, -1, self.nope + self.rope).transpose(1, 2)  # [B, n, S, nope+rope] (n: this rank's heads)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)  # [B, S, kv_lora], [B, S, rope]
        latent = self.kv_a_norm(latent)
        rotate = apply_rope_interleaved if self.interleave else apply_rope
        q_rope, k_rope = rotate(q_rope, cos, sin), rotate(k_rope[:, None], cos, sin)  # k_rope [B, 1, S, rope]
        context = self.context_parallel if kv is None else None
        if context is not None:  # every position's latent and rope key (kv_lora + rope per position), expanded here
            whole = context.gather(torch.cat((latent, k_rope[:, 0]), dim=-1), dim=1)  # [B, S_global, kv_lora+rope]
            latent, k_rope = whole.split([self.kv_lora_rank, self.rope], dim=-1)
            k_rope = k_rope[:, None]  # [B, 1, S_global, rope]
        P = latent.shape[1]  # key positions
        kv_heads = self.wkv_b(latent).view(B, P, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv_heads.split([self.nope, self.v_dim], dim=-1)  # [B, n, P, nope], [B, n, P, v]
        q = torch.cat((q_nope, q_rope), dim=-1)  # [B, n, S, nope+rope]
        k = torch.cat((k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)  # [B, n, P, nope+rope]
        if context is not None:
            y = context_attend(q, k, v.contiguous(), context, False, self.scale, segments=segments)  # [B, n, S, v]
        else:
            y = attend(q, k, v.contiguous(), kv, False, self.scale, segments=segments)  # [B, n, S, v]
        return self.wo(y.transpose(1, 2).reshape(B, S, -1))  # [B, S, H]

    @torch.no_grad()
    def init_weights(self, normal_, std: float, std_out: float) -> None:
        for name in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b"):
            if hasattr(self, name):
                normal_(getattr(self, name).weight, std)
        normal_(self.wo.weight, std_out)
        for norm in (getattr(self, "q_a_norm", None), self.kv_a_norm):
            if norm is not None:
                norm.weight.fill_(1.0)


def build_attention(config: ModelConfig, layer_id: int = 0) -> nn.Module:
    """Layer ``layer_id``'s attention (its sliding window comes from config.attention_window)."""
    return MLAttention(config) if config.attention == "mla" else Attention(config, layer_id)


# ---------------------------------------------------------------------------------------------------
# KV cache (incremental decoding)
# ---------------------------------------------------------------------------------------------------


def causal_mask(start: int, new: int, device) -> Tensor | None:
    """[new, start+new] bool: query start+i sees keys 0 .. start+i. None where no mask is needed: one new
    query sees every key; a first chunk (start 0) is plain causal attention (is_causal)."""
    if new == 1 or start == 0:
        return None
    keys = torch.arange(start + new, device=device)  # [P+S]
    return keys[None, :] <= torch.arange(start, start + new, device=device)[:, None]  # [S, P+S]


def window_mask(start: int, new: int, window: int, device) -> Tensor:
    """[new, start+new] bool: query start+i sees keys j with start+i - window < j <= start+i (window 0: every
    key up to itself)."""
    keys = torch.arange(start + new, device=device)[None, :]  # [1, P+S]
    queries = torch.arange(start, start + new, device=device)[:, None]  # [S, 1]
    visible = keys <= queries
    return visible & (keys > queries - window) if window else visible


# A sliding-window layer's cache keeps its last window - 1 positions (all its next query can see) plus this many,
# so speculative decoding can take back that many rejected positions (models.attention.LayerKV.truncate).
KV_WINDOW_SLACK = 64


class LayerKV:
    """One attention layer's cached keys [B, K, slots, Dk] and values [B, K, slots, Dv] of ``length`` positions.

    ``window`` > 0 (a sliding-window layer) with a capacity larger than window - 1 + KV_WINDOW_SLACK: a ring of
    that many slots, position p in slot p % slots, so the layer's memory stays bounded however long the
    generation (gpt-oss-120b at 128k positions: 18 of 36 layers keep 191 positions instead of 131072). Otherwise
    slots = capacity, position p in slot p.

    Allocated at the first write with the keys' and values' batch, heads, widths, dtype and device (the model's
    compute dtype: autocast's when it is on), so one cache serves any model (GQA, MLA, whose key and value widths
    differ) without being told its layout."""

    def __init__(self, capacity: int, window: int = 0):
        self.capacity, self.length, self.window = capacity, 0, window
        self.ring = bool(window) and window - 1 + KV_WINDOW_SLACK < capacity
        self.slots = window - 1 + KV_WINDOW_SLACK if self.ring else capacity
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k [B, K, S, Dk], v [B, K, S, Dv] at positions length .. length+S-1; return every position's (a
        ring returns the positions ``extend`` does: ask it where they start)."""
        keys, values, _ = self.extend(k, v)
        return keys, values

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, int]:
        """Write k, v at positions length .. length+S-1 and return (keys, values, first): the cached positions
        first .. length+S-1 in position order, every one the new positions' queries can see (first 0 unless this is
        a ring: then the window's)."""
        B, K, S, _ = k.shape
        start, end = self.length, self.length + S
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; appending {S} at position {self.length} "
                             f"overflows it: make a larger cache (at most model.max_seq_len) or start a new one")
        if self.keys is None:
            self.keys = k.new_empty(B, K, self.slots, k.shape[-1])
            self.values = v.new_empty(B, v.shape[1], self.slots, v.shape[-1])
        elif self.keys.shape[0] != B or self.keys.dtype != k.dtype:
            raise ValueError(f"KV cache was filled with batch {self.keys.shape[0]} in {self.keys.dtype}, got batch "
                             f"{B} in {k.dtype}; use one cache per batch of sequences")
        self.length = end
        if not self.ring:
            self.keys[:, :, start:end] = k
            self.values[:, :, start:end] = v
            return self.keys[:, :, :end], self.values[:, :, :end], 0
        first = max(0, start - self.window + 1)  # the oldest position the first new query sees
        held = torch.arange(first, start, device=k.device) % self.slots  # read before the new writes reuse them
        keys = torch.cat((self.keys.index_select(2, held), k), dim=2)  # [B, K, start - first + S, Dk]
        values = torch.cat((self.values.index_select(2, held), v), dim=2)
        kept = min(S, self.slots)  # a prefill longer than the ring leaves its last positions
        slots = torch.arange(end - kept, end, device=k.device) % self.slots
        self.keys.index_copy_(2, slots, k[:, :, S - kept :])
        self.values.index_copy_(2, slots, v[:, :, S - kept :])
        return keys, values, first

    def truncate(self, length: int) -> None:
        """Forget the positions from ``length`` on (a rejected draft token's, speculative decoding). A ring can take
        back KV_WINDOW_SLACK positions: older ones it has overwritten."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a KV cache of {self.length} positions to {length}")
        if self.ring and self.length - length > KV_WINDOW_SLACK:
            raise ValueError(f"a sliding-window layer's KV cache keeps window - 1 + {KV_WINDOW_SLACK} positions; "
                             f"taking back {self.length - length} of them needs positions it overwrote: start a new "
                             f"cache from the prompt, or raise models.attention.KV_WINDOW_SLACK")
        self.length = length


class KVCache:
    """Per-layer keys and values of the positions decoded so far (``Transformer.forward(tokens, cache=...)``).

    ``capacity``: the most positions it will hold (default and limit: model.max_seq_len). Memory is
    B * capacity * (K * D keys + K * D values) elements per GQA layer, B * capacity * N * (nope + rope + v) per MLA
    layer (expanded keys and values), B * (window - 1 + KV_WINDOW_SLACK) * 2 * K * D per sliding-window layer (a
    ring: LayerKV), allocated as the layers first write. A cache belongs to one batch
    of sequences that all share positions: start a new one for another prompt.
    """

    def __init__(self, config: ModelConfig, capacity: int | None = None):
        capacity = config.max_seq_len if capacity is None else capacity
        if not 1 <= capacity <= config.max_seq_len:
            raise ValueError(f"KV cache capacity {capacity} is invalid; it must be in [1, model.max_seq_len="
                             f"{config.max_seq_len}]")
        self.capacity = capacity
        self.layers = [LayerKV(capacity, config.attention_window(i)) for i in range(config.num_layers)]

    @property
    def length(self) -> int:
        """Positions cached: the next token's position."""
        return self.layers[0].length if self.layers else 0

    def truncate(self, length: int) -> None:
        """Forget the positions from ``length`` on, in every layer."""
        for layer in self.layers:
            layer.truncate(length)
