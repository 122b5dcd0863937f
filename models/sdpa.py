"""The attention functions models.attention dispatches to, each one call of torch's kernels (SDPA, CPU flash) or
batched matmuls: causal attention as bmm + softmax + bmm, gpt-oss's sinks on fused SDPA, masked SDPA with GQA, sinks
over a KV cache, and two flash calls merged by their logsumexps for queries after fully visible keys; the masks of
incremental decoding. Which one runs where is models.attention's choice (``attend``, ``positioned_attention``).

Shape legend: B batch, N query heads, K key/value heads, S queries, P keys, D head dim (Dv: the values').
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

# CUDA's memory-efficient attention keeps a per-head padded copy of a mask whose key count is not a multiple of this
# (torch pads the bias's last dimension to it); sink_attention and window blocks read keys in multiples of it
KEY_MULTIPLE = 16


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
    hidden = -(1 + P) % KEY_MULTIPLE  # zero keys no query sees, to a multiple of 16
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
        with torch.autocast("cpu", enabled=False):  # q, k, v of one dtype (the projections'), as SDPA needs
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


def lower_right_causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """Queries at the last S of P key positions, q [B, N, S, D] over k, v [B, K, P, D]: query i sees keys
    0 .. P - S + i, with no mask. CUDA's flash kernel aligns its causal flag to the bottom right when S < P (what
    torch.nn.attention.bias.causal_lower_right dispatches to), takes GQA as it is, and keeps only its output and
    logsumexp. bf16 / fp16, head widths a multiple of 8 up to 256 (models.attention.lower_right_fits)."""
    D = q.shape[-1]
    if D % 8 or D > 256 or v.shape[-1] != D:
        raise ValueError(f"lower_right_causal_attention: head widths q {D}, v {v.shape[-1]}; the flash kernel needs "
                         f"one width, a multiple of 8, at most 256")
    scale = D**-0.5 if scale is None else scale
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[0]


def masked_sink_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, sinks: Tensor,
                          scale: float | None = None) -> Tensor:
    """``sink_attention``'s function as batched matmuls over the keys as they are (GQA by stacking each key head's
    query heads, as explicit_causal_attention): q [B, N, S, D], k [B, K, P, D], v [B, K, P, Dv], mask [S, P] or one
    per row [B, S, P] (models.sdpa.padded_mask)."""
    B, N, S, D = q.shape
    K, P, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = N // K
    scale = D**-0.5 if scale is None else scale
    scores = torch.matmul(q.reshape(B, K, G * S, D), k.transpose(-1, -2)) * scale  # [B, K, G*S, P]
    mask = mask.repeat(G, 1) if mask.dim() == 2 else mask.repeat(1, G, 1)[:, None]  # [G*S, P] / [B, 1, G*S, P]
    scores = scores.masked_fill(~mask, -math.inf)
    sink = sinks.to(scores.dtype).view(1, K, G, 1, 1).expand(B, K, G, S, 1).reshape(B, K, G * S, 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :P]
    return torch.matmul(probs, v).view(B, N, S, Dv)


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
    return span_mask(start, new, 0, start + new, window, device)


def span_mask(q_start: int, S: int, k_start: int, P: int, window: int, device) -> Tensor:
    """[S, P] bool: queries at positions q_start .. q_start+S-1 over keys at k_start .. k_start+P-1; key j is
    visible to query i iff j <= i (and i - window < j when ``window`` > 0)."""
    keys = torch.arange(k_start, k_start + P, device=device)[None, :]  # [1, P]
    queries = torch.arange(q_start, q_start + S, device=device)[:, None]  # [S, 1]
    visible = keys <= queries
    return visible & (keys > queries - window) if window else visible


def padded_mask(padding: Tensor, q_start: int, S: int, k_start: int, P: int, window: int = 0,
                chunk: int = 0) -> Tensor:
    """[B, S, P] bool for a left-padded batch (models.kvcache.KVCache's ``padding`` [B]): queries at slots
    q_start .. q_start+S-1 over keys at slots k_start .. k_start+P-1, each row's positions counted from its first
    real slot (slot - padding[b]). A real query sees the real keys at or before it (within ``window``; within its own
    ``chunk`` of positions), never a filler; a filler query sees only itself, so no row of the softmax is empty."""
    device = padding.device
    pad = padding[:, None, None]  # [B, 1, 1]
    keys = torch.arange(k_start, k_start + P, device=device)[None, None, :] - pad  # [B, 1, P]
    queries = torch.arange(q_start, q_start + S, device=device)[None, :, None] - pad  # [B, S, 1]
    visible = (keys <= queries) & (keys >= 0)
    if window:
        visible &= keys > queries - window
    if chunk:
        visible &= torch.div(keys, chunk, rounding_mode="floor") == torch.div(queries, chunk, rounding_mode="floor")
    return visible | (keys == queries)
