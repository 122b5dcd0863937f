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
from moekit.models.kvcache import KV_WINDOW_SLACK, KVCache, LayerKV  # noqa: F401  (re-exported: they lived here)
from moekit.models.linear_attention import GatedDeltaNet
from moekit.models import qk_clip
from moekit.models.norms import RMSNorm, make_norm, norm_identity
from moekit.moe.precision import compute_dtype
from moekit.models.sdpa import (  # noqa: F401  (re-exported: they lived here)
    KEY_MULTIPLE, PrefixCausalAttention, causal_mask, explicit_causal_attention, lower_right_causal_attention,
    masked_sdpa, masked_sink_attention, sink_attention, span_mask, window_mask)
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


def attend(q: Tensor, k: Tensor, v: Tensor, kv: LayerKV | None, gqa: bool, scale: float | None = None,
           window: int = 0, sinks: Tensor | None = None, segments: Tensor | None = None, chunk: int = 0) -> Tensor:
    """Causal SDPA of q [B, N, S, Dqk] over k [B, K, S, Dqk], v [B, K, S, Dv] (-> [B, N, S, Dv]); with ``kv``
    the new keys / values are appended to the cache and q attends to every cached position too. Where it
    is faster (CPU bf16, small S: EXPLICIT_ATTENTION) the same function runs as bmm + softmax + bmm.
    ``window`` > 0: each query sees only the last ``window`` positions, itself included (``local_attention``:
    only the keys a window reaches are read); ``sinks`` [N]: a learned logit per query head in every softmax
    (``sink_attention``); ``segments`` [B, S]: each position's document (``document_segments``), attention stays
    within it (training only: no KV cache); ``chunk`` > 0: chunked attention (Llama 4), each query sees only the
    keys of its own chunk of ``chunk`` positions (``local_attention``, a call per chunk)."""
    if segments is not None:
        if kv is not None:
            raise ValueError("document masking (segments) is for training forwards; decode without it")
        return local_attention(q, k, v, 0, gqa, scale, window, sinks, segments=segments, chunk=chunk)
    start, S, first = 0 if kv is None else kv.length, q.shape[2], 0
    if kv is not None and kv.padding is not None:  # a left-padded batch of prompts: a mask per row
        k, v, first = kv.extend(k, v)
        mask = kv.padded_mask(start, S, first, k.shape[2], window, chunk, q.device)  # [B, S, P]
        if sinks is not None:
            return masked_sink_attention(q, k, v, mask, sinks, scale)
        return masked_sdpa(q, k, v, mask[:, None], gqa, scale)
    if chunk and start + S <= chunk:  # every query in the first chunk: plain causal attention
        chunk = 0
    if kv is None and not chunk and _explicit_attention(q):
        return explicit_causal_attention(q, k, v, scale, window, sinks)
    if kv is not None:  # [B, K, start+S - first, D*]: every position a new query can see, in order
        k, v, first = kv.extend(k, v)
    if chunk:
        return local_attention(q, k, v, start, gqa, scale, window, sinks, first, chunk=chunk)
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
# Measured: docs/benchmarks.md, "Sliding-window blocks" (tools/bench/attention_sinks.py). Document-masked calls
# take the same blocks (window_block), over the keys up to each block's end.
WINDOW_BLOCK = 256


def window_block(S: int, window: int, documents: bool = False, cpu: bool = True) -> int:
    """Query positions per call of ``local_attention`` for S queries under ``window`` (S: one call). On the CPU,
    document masks (``documents``) take the same blocks: each reads the keys up to its own end, so the masked calls
    skip the causal upper triangle that one masked call computes (1.4-2x causal SDPA's time -> 0.96-1.12x, S 1024 -
    4096). Not on a GPU: a masked GQA call there expands its keys to every query head (masked_sdpa), and blocks over
    all earlier keys would keep S/block/2 times the expanded keys of one call."""
    if not (window or (documents and cpu)) or WINDOW_BLOCK <= 0:
        return S
    block = max(WINDOW_BLOCK, window)
    return block if S >= 2 * block else S


def local_attention(q: Tensor, k: Tensor, v: Tensor, q_start: int, gqa: bool, scale: float | None = None,
                    window: int = 0, sinks: Tensor | None = None, k_start: int = 0,
                    segments: Tensor | None = None, chunk: int = 0) -> Tensor:
    """Causal (``window``: sliding-window) attention of queries at positions q_start .. q_start+S-1, q [B, N, S, Dqk],
    over keys k [B, K, P, Dqk] and values v [B, K, P, Dv] at positions k_start .. k_start+P-1 (at least every
    position the queries see; keys past the last query are never read). Each block of ``window_block`` queries
    reads the keys from its window's start to its own end: a KV cache's decoding step, a context-parallel chunk
    and a long windowed sequence alike. ``segments`` [B, k_start+P]: the document of every position (keys and
    queries), or None. ``chunk`` > 0 (chunked attention): one call per chunk the queries meet, over that chunk's
    keys up to the last query (plain causal attention where the queries start the chunk)."""
    S = q.shape[2]
    if chunk:
        out = []
        first = q_start
        while first < q_start + S:
            end = min(q_start + S, (first // chunk + 1) * chunk)  # this chunk's last query + 1
            lo = (first // chunk) * chunk  # the chunk's first key
            if lo < k_start:
                raise ValueError(f"chunked attention: the queries at {first}.. need the keys from {lo} on (their chunk "
                                 f"of {chunk}) but the keys start at {k_start}")
            i = first - q_start
            keys = slice(lo - k_start, end - k_start)
            out.append(local_attention(q[:, :, i : i + end - first], k[:, :, keys], v[:, :, keys], first, gqa, scale,
                                       window, sinks, lo, segments))
            first = end
        return out[0] if len(out) == 1 else torch.cat(out, dim=2)
    block = window_block(S, window, segments is not None, q.device.type == "cpu")
    out = []
    for i in range(0, S, block):
        n, first = min(block, S - i), q_start + i
        lo = max(k_start, first - window + 1) if window else k_start  # the first key any of these queries sees
        # a few more keys, hidden by the mask, so there are a multiple of 16: CUDA's memory-efficient kernel keeps a
        # per-head copy of a mask whose key count is not (sink_attention pads for the same reason)
        if window:
            lo = max(k_start, first + n - -(-(first + n - lo) // KEY_MULTIPLE) * KEY_MULTIPLE)
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
    if _lower_right_applies(q, v, q_start - k_start, P, window, sinks, segments):
        return lower_right_causal_attention(q, k, v, scale)
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


# CUDA: a context-parallel chunk after fully visible keys as one flash call whose causal flag aligns bottom-right
# (lower_right_causal_attention: no mask, no GQA expansion) instead of a masked call. Checked on the device by
# tests/test_gpu.py::test_lower_right_chunks_on_device_match_float64 (H100, 2026-11-27: cp 2 / 4, bf16 / fp16);
# the planner counts these calls as unmasked (train.planning.attention_memory.lower_right_planned). False: the
# masked call, as before.
CUDA_LOWER_RIGHT = True
LOWER_RIGHT_MAX_DIM = 256  # the flash kernel's largest head width


def lower_right_fits(dtype_bytes: int, q_dim: int, v_dim: int) -> bool:
    """Whether a call of these widths may run as lower_right_causal_attention on CUDA (with CUDA_LOWER_RIGHT): bf16 /
    fp16 (2 bytes), one head width for q, k and v, a multiple of 8 (the flash kernel's) up to 256."""
    return CUDA_LOWER_RIGHT and dtype_bytes == 2 and q_dim == v_dim and q_dim % 8 == 0 and q_dim <= LOWER_RIGHT_MAX_DIM


def _lower_right_applies(q: Tensor, v: Tensor, prefix: int, P: int, window: int, sinks, segments) -> bool:
    return (q.is_cuda and prefix > 0 and P == prefix + q.shape[2] and not window and sinks is None
            and segments is None and q.dtype in (torch.bfloat16, torch.float16)
            and lower_right_fits(q.element_size(), q.shape[-1], v.shape[-1]))


def _prefix_applies(q: Tensor, v: Tensor, prefix: int, P: int, window: int, segments) -> bool:
    """Whether a call of queries after ``prefix`` fully visible keys runs as PrefixCausalAttention: causal attention
    (sinks or not; no window or documents) over keys that end with the queries' own positions, on the CPU (its flash
    kernel returns the logsumexp the merge needs), with one head width for q, k and v. torch.compile traces it (an
    autograd.Function of aten ops: one graph, inductor included)."""
    return (prefix > 0 and P == prefix + q.shape[2] and not window and segments is None
            and q.device.type == "cpu" and q.shape[-1] == v.shape[-1])


def context_attend(q: Tensor, k: Tensor, v: Tensor, context, gqa: bool, scale: float | None = None,
                   window: int = 0, sinks: Tensor | None = None, segments: Tensor | None = None,
                   chunk: int = 0) -> Tensor:
    """Causal attention of a context-parallel rank's queries q [B, N, S_local, Dqk] (its chunks of the sequence:
    ``context.chunks``, comm.context_parallel) over the whole sequence's keys k [B, K, S, Dqk] and values
    v [B, K, S, Dv], gathered in position order. Each chunk attends to the keys up to its own end only (and from
    its window's start): the zigzag chunks then cost every rank the same. ``segments`` [B, S]: the whole
    sequence's documents, or None. -> [B, N, S_local, Dv]."""
    out = [local_attention(q[:, :, local : local + n], k, v, start, gqa, scale, window, sinks, segments=segments,
                           chunk=chunk) for local, start, n in context.chunks(q.shape[2])]
    return torch.cat(out, dim=2)


# With sinks, a decoding step (at most this many new positions over a KV cache) runs ``masked_sink_attention``:
# sink_attention's widened copies of every cached key and value would cost ~3x the reads of the attention itself.
CACHED_SINKS_MAX_NEW = 16


class Attention(nn.Module):
    """Causal grouped-query attention: K key/value heads serve N query heads (N % K == 0); optional q/k/v
    biases, q/k RMSNorm ("head" or "full") and q/k/v clipping (module docstring)."""

    def __init__(self, config: ModelConfig, layer_id: int = 0):
        super().__init__()
        self.window = config.attention_window(layer_id)
        # Llama 4: NoPE layers (no RoPE, full attention, the query temperature), chunked attention on the others
        self.rope = config.uses_rope(layer_id)
        self.chunk = config.attention_chunk_of(layer_id)
        self.temperature = (config.attn_temperature_floor, float(config.attn_temperature_scale)) \
            if config.attn_temperature_floor and not self.rope else None
        self.unit_norm_eps = config.norm_eps if config.qk_norm == "unit" and self.rope else 0.0
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim, self.rope_dim = config.attn_head_dim, config.rope_dim
        self.rope_pairs = config.rope_pairs  # which channels RoPE rotates together (models.config)
        self.qk_norm, self.qkv_clip = config.qk_norm, float(config.qkv_clip)
        H, D, bias = config.hidden_size, self.head_dim, config.attention_bias
        # attention_output_gate: wq emits [q_n | gate_n] per head n (transformers' Qwen3-Next / Qwen3.5 layout)
        self.output_gate = config.attention_output_gate
        self.wq = nn.Linear(H, self.num_heads * D * (2 if self.output_gate else 1), bias=bias)
        self.wk = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.wv = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.wo = nn.Linear(self.num_heads * D, H, bias=config.attention_out_bias)
        # gpt-oss: one learned logit per query head in the softmax (sink_attention); a DTensor sharded by heads
        # under tensor parallelism (comm.tensor_parallel), like wq's output
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.attention_sinks else None
        self.context_parallel = None  # comm.context_parallel: gather the sequence's keys and values
        if config.qk_norm in ("head", "full"):
            full = config.qk_norm == "full"
            self.q_norm = make_norm(config, self.num_heads * D if full else D)
            self.k_norm = make_norm(config, self.num_kv_heads * D if full else D)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: LayerKV | None = None,
                segments: Tensor | None = None) -> Tensor:
        """x [B, S, H] at the positions cos/sin describe. ``kv``: this layer's cache (incremental decoding);
        the new keys/values are appended and the queries attend to every cached position as well. ``segments``:
        the documents of the sequence's positions (the whole sequence's under context parallelism), or None."""
        B, S, _ = x.shape
        x = x.to(compute_dtype(x))  # autocast: one bf16 copy for the three projections (autocast casts per call)
        q, k, v = self.wq(x), self.wk(x), self.wv(x)  # [B, S, N*D], [B, S, K*D] x 2
        gate = None
        if self.output_gate:  # [B, S, N*2D] -> q [B, S, N*D], the gate [B, S, N*D] (both per head)
            q, gate = q.view(B, S, -1, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(B, S, -1), gate.reshape(B, S, -1)
        if self.qk_norm == "full":  # over the whole projection (never under TP: comm.tensor_parallel)
            q, k = self.q_norm(q), self.k_norm(k)
        # -1 heads: under tensor parallelism this rank's q/k/v projections produce N/tp and K/tp heads
        q, k, v = (t.view(B, S, -1, self.head_dim) for t in (q, k, v))  # [B, S, heads, D]
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.unit_norm_eps:  # Llama 4's L2Norm: RMS over each head, no weight, in fp32 (RoPE keeps the RMS)
            q, k = (F.rms_norm(t.float(), (self.head_dim,), eps=self.unit_norm_eps).to(t.dtype) for t in (q, k))
        if self.qkv_clip > 0:
            q, k, v = (t.clamp(-self.qkv_clip, self.qkv_clip) for t in (q, k, v))
        if self.rope:  # RoPE before the transpose: x [B, S, heads, D] is laid out as the projection wrote it
            q, k = self._rope(q, cos[:, None], sin[:, None]), self._rope(k, cos[:, None], sin[:, None])
        if self.temperature is not None:  # Llama 4's NoPE layers: q at position p times 1 + s log(1 + (p+1) // f)
            floor, strength = self.temperature
            p = self._query_positions(S, kv, q.device).float()  # [S], or [B, S] in a left-padded batch
            factor = torch.log1p(torch.floor((p + 1.0) / floor)) * strength + 1.0
            q = (q * factor[..., None, None]).to(q.dtype)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, D]
        sinks = _local_heads(self.sinks)  # this rank's heads
        gqa = self.num_kv_heads != self.num_heads
        if self.context_parallel is not None and kv is None:  # this rank's queries over every position's keys
            kv_all = self.context_parallel.gather(torch.cat((k, v), dim=-1), dim=2)  # [B, K, S_global, 2D]
            k, v = kv_all.split(self.head_dim, dim=-1)
            if qk_clip.recording(self):  # models.qk_clip: this step's largest logit per head
                qk_clip.record(self, q, k, self.head_dim**-0.5, self._query_positions(S, None, q.device), segments)
            y = context_attend(q, k, v, self.context_parallel, gqa, window=self.window, sinks=sinks,
                               segments=segments, chunk=self.chunk)
        else:
            if qk_clip.recording(self):
                qk_clip.record(self, q, k, self.head_dim**-0.5, torch.arange(S, device=q.device), segments)
            y = attend(q, k, v, kv, gqa, window=self.window, sinks=sinks, segments=segments,
                       chunk=self.chunk)  # [B, N, S, D]
        y = y.transpose(1, 2).reshape(B, S, -1)  # [B, S, N*D]
        if gate is not None:
            y = y * torch.sigmoid(gate)
        return self.wo(y)  # [B, S, H]

    def _query_positions(self, S: int, kv: LayerKV | None, device) -> Tensor:
        """[S] the sequence positions of this forward's queries: after a KV cache's (per row [B, S] in a left-padded
        batch, models.kvcache.KVCache), this context-parallel rank's share of the sequence, or 0 .. S-1."""
        if kv is not None and kv.padding is not None:  # [B, S]: each row counts from its first real slot
            slots = torch.arange(kv.length, kv.length + S, device=device)
            return (slots[None, :] - kv.padding.to(device)[:, None]).clamp_min(0)
        if kv is not None:
            return torch.arange(kv.length, kv.length + S, device=device)
        if self.context_parallel is not None:
            return self.context_parallel.positions(S, device)
        return torch.arange(S, device=device)

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """RoPE on the first rope_dim channels of each head (all of them unless partial_rotary_factor < 1), pairing
        them as config.rope_pairs says (adjacent pairs come out in the half layout, q and k alike: q . k is the
        checkpoint's)."""
        rotate = apply_rope_interleaved if self.rope_pairs == "adjacent" else apply_rope
        if self.rope_dim == self.head_dim:
            return rotate(x, cos, sin)
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat((rotate(rot, cos, sin), rest), dim=-1)

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
        if self.qk_norm in ("head", "full"):
            self.q_norm.weight.fill_(norm_identity(self.q_norm))
            self.k_norm.weight.fill_(norm_identity(self.k_norm))


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
            self.q_a_norm = RMSNorm(config.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(config.q_lora_rank, N * qk, bias=False)
        else:
            self.wq = nn.Linear(H, N * qk, bias=False)
        self.wkv_a = nn.Linear(H, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_lora_rank, eps=LATENT_NORM_EPS)
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
        x = x.to(compute_dtype(x))  # autocast: one bf16 copy for wq (or wq_a) and wkv_a
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
        if qk_clip.recording(self):  # models.qk_clip: this step's largest logit per head
            positions = context.positions(S, q.device) if context is not None else torch.arange(S, device=q.device)
            qk_clip.record(self, q, k, self.scale, positions, segments)
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
    """Layer ``layer_id``'s token mixer: Gated DeltaNet where config.is_linear_layer (models.linear_attention),
    else attention (its sliding window comes from config.attention_window)."""
    if config.is_linear_layer(layer_id):
        return GatedDeltaNet(config, layer_id)
    return MLAttention(config) if config.attention == "mla" else Attention(config, layer_id)


def _local_heads(sinks: Tensor | None) -> Tensor | None:
    """gpt-oss's sink logits of this rank's query heads: the local shard of a tensor-parallel DTensor, else the tensor.
    An isinstance check, not ``hasattr(t, "to_local")``: dynamo answers that hasattr False for a DTensor parameter, so
    a compiled block kept the whole DTensor (compile + TP failed to trace the sinks' view). Imported here: building a
    model imports no torch.distributed.tensor."""
    if sinks is None:
        return None
    from torch.distributed.tensor import DTensor

    return sinks.to_local() if isinstance(sinks, DTensor) else sinks
