"""Multi-token prediction (DeepSeek-V3, section 2.2): extra depths that predict tokens further ahead.

With ``model.mtp_layers = D``, module k (1 <= k <= D) sits after the main model and sees, at position i, the
previous depth's representation of token i and the embedding of token i + k:

    h^0   = the main model's final hidden states (after its final norm, as vLLM's DeepSeek MTP reads them)
    h^k_i = Block_k( eh_proj_k( [enorm_k(embed(t_{i+k})) ; hnorm_k(h^{k-1}_i)] ) )      i < S - k
    loss_k = cross-entropy of head(norm_k(h^k_i)) against t_{i+k+1}                      (the targets shifted by k)

The embedding and the output head are the main model's (shared, as in the paper); each depth has its own
two input norms, projection [H, 2H], transformer block (an MoE block where the layer pattern puts one at
index num_layers + k - 1) and final norm. Those are the tensors of DeepSeek-V3's checkpoint layer 61
(``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and the block), which models/hf maps.

Training adds ``mtp_loss_coeff * mean_k loss_k`` to the objective through ``LossInjector``: the loss the
model returns (and the trainer reports, and evaluation computes) stays the next-token loss, while backward
gives the MTP loss its gradient. Depths run only when a gradient is wanted (training): evaluation, inference
and generation never compute them. ``Transformer.pop_mtp_loss()`` gives the mean MTP loss of the forwards since
its last call (detached), for the trainer's records (``Pipeline.pop_mtp_loss()`` under pipeline parallelism,
where the depths run on the last stage with a replica of the embedding: models.pipeline).

Under context parallelism (comm.context_parallel) a rank holds two zigzag chunks of each sequence, so the token
k ahead of its last positions sits on another rank: ``context_mtp_loss`` looks the ids k ahead up in the
gathered sequence (ids only, the main model's documents gather them too) and runs each depth on every local
position, as the attention gather needs equal shares. The positions with no token k ahead (the sequence's last
k) change nothing the others compute: attention is causal, so they only feed later ones of their kind; their
FFN / MoE rows are not computed (``Block(ffn_spans=)``: routing, capacity, load counts and the aux loss see the
positions one process sees); their loss is not taken. Each rank's depth loss and aux loss are weighted by its
share of the depth's positions, so the ranks' mean (the data-parallel gradient average) is one process's.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from moekit.models.norms import make_norm


class MTPModule(nn.Module):
    """One prediction depth: the two input norms, the projection back to H, a transformer block, a final norm."""

    def __init__(self, config, layer_id: int):
        super().__init__()
        from moekit.models.transformer import Block  # the main model's block (models.transformer imports this)

        H = config.hidden_size
        self.enorm = make_norm(config, H)
        self.hnorm = make_norm(config, H)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.block = Block(config, layer_id)
        self.norm = make_norm(config, H)

    def forward(self, h: Tensor, emb: Tensor, cos: Tensor, sin: Tensor, tokens: Tensor, kv=None,
                segments: Tensor | None = None, **spans) -> Tensor:
        """h [B, n, H] (the previous depth), emb [B, n, H] (embeddings of the tokens k ahead) -> [B, n, H].
        ``kv``: the depth's attention cache when drafting tokens (a models.kvcache.LayerKV); ``segments``
        [B, n]: the documents of positions 0 .. n-1 (document masking), or None. ``spans``: the block's
        ``ffn_spans`` / ``aux_weight`` (context parallelism: module docstring)."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        return self.block(x, cos, sin, tokens, kv, segments=segments, **spans)


class MTPRecord:
    """Running mean of the MTP losses of the training forwards since the last ``pop`` (detached, on the device:
    recording costs no host sync)."""

    def __init__(self):
        self.sum: Tensor | None = None
        self.count = 0

    def add(self, value: Tensor) -> None:
        value = value.detach()
        self.sum = value if self.sum is None else self.sum + value
        self.count += 1

    def pop(self) -> Tensor | None:
        """The mean since the last call, or None when no forward recorded one; restarts the mean."""
        out = None if self.sum is None else self.sum / self.count
        self.sum, self.count = None, 0
        return out


class LossInjector(torch.autograd.Function):
    """Identity on ``loss``; in backward, ``extra`` gets ``coeff`` times the incoming gradient, as if
    ``loss + coeff * extra`` had been returned (a caller's ``loss / accum`` scales both alike) while the value
    stays ``loss`` exactly."""

    @staticmethod
    def forward(ctx, loss: Tensor, extra: Tensor, coeff: float) -> Tensor:
        ctx.coeff = coeff
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, grad * ctx.coeff, None


def depth_states(model, x: Tensor, emb: Tensor, tokens: Tensor, cos: Tensor, sin: Tensor,
                 segments: Tensor | None = None):
    """Yield (k, depth k's final normed states [B, S - k, H]) for the depths the sequence is long enough for (module
    docstring); position i of depth k predicts the token k + 1 after position i. ``x``: the main model's final
    (normed) hidden states [B, S, H]; ``emb``: embed(tokens) [B, S, H]; ``segments`` [B, S]: the documents of the
    main positions (position i of every depth attends within position i's document), or None."""
    S, h = tokens.shape[1], x
    for k, module in enumerate(model.mtp, start=1):
        n = S - k
        if n <= 0:
            return
        h = module(h[:, :n], emb[:, k:], cos[:n], sin[:n], tokens[:, k:],
                   segments=None if segments is None else segments[:, :n])
        yield k, module.norm(h)


def mtp_loss(model, x: Tensor, emb: Tensor, tokens: Tensor, targets: Tensor, cos: Tensor, sin: Tensor,
             head_loss, segments: Tensor | None = None, normalizers=None) -> Tensor | None:
    """Mean over the depths of their losses (module docstring), or None when the sequence is too short for any
    depth. ``head_loss(hidden, targets, normalizer=None)``: the main model's loss from hidden states (its head,
    chunking, ignore index; the mean over the counted targets, or their sum over ``normalizer``); ``normalizers``:
    with loss masks, depth k's count of a step's counted targets (k ahead) per micro-batch and rank at
    ``normalizers[k - 1]`` (the trainer's, as the main loss's ``loss_normalizer``: the step's loss is then the
    mean over all its counted targets however they fall on micro-batches and ranks), or None: each forward's own
    mean. The other arguments are ``depth_states``'."""
    context = getattr(model, "context_parallel", None)
    if normalizers is not None and len(normalizers) < len(model.mtp):
        raise ValueError(f"{len(normalizers)} loss normalizers for {len(model.mtp)} multi-token-prediction depths")
    if context is not None and context.degree > 1:
        losses = list(context_depth_losses(model, context, x, tokens, targets, cos, sin, head_loss, segments,
                                           normalizers))
    else:
        losses = [head_loss(h, targets[:, k:], None if normalizers is None else normalizers[k - 1])
                  for k, h in depth_states(model, x, emb, tokens, cos, sin, segments)]
    if not losses:
        return None
    return torch.stack(losses).mean()


def ahead_spans(context, local_len: int, seq_len: int, k: int) -> list[tuple[int, int]]:
    """The local position ranges [start, end) of this context-parallel rank whose token ``k`` ahead exists
    (global position + k < ``seq_len``): a prefix of each of its two zigzag chunks, possibly empty (dropped);
    adjacent ranges merged (both chunks whole: [(0, local_len)])."""
    spans = []
    for start, first, n in context.chunks(local_len):
        m = min(n, max(0, seq_len - k - first))
        if m and spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], start + m)
        elif m:
            spans.append((start, start + m))
    return spans


def take_spans(t: Tensor, spans: list[tuple[int, int]], dim: int = 1) -> Tensor:
    """``t``'s positions in ``spans`` along ``dim``, concatenated."""
    if len(spans) == 1:
        a, b = spans[0]
        return t.narrow(dim, a, b - a)
    return torch.cat([t.narrow(dim, a, b - a) for a, b in spans], dim=dim)


def context_depth_losses(model, context, x: Tensor, tokens: Tensor, targets: Tensor, cos: Tensor, sin: Tensor,
                         head_loss, segments: Tensor | None = None, normalizers=None):
    """Yield each depth's loss on this context-parallel rank (module docstring): its mean over the rank's
    positions with a token k + 1 ahead, weighted so that the mean over the CP ranks is the whole sequences'
    (``normalizers``, as mtp_loss's: the rank's summed token losses over the depth's count instead, which counts
    the CP ranks).
    ``x``: the main model's final normed states of the local positions [B, n, H]; ``tokens`` / ``targets``
    [B, n]: the local ids; ``cos`` / ``sin``: RoPE at the local positions; ``segments``: the whole sequences'
    documents or None; ``model.embed`` looks up the ids ahead."""
    from moekit.models.loss import IGNORE_INDEX
    from moekit.models.transformer import embed_tokens  # (models.transformer imports this module)

    B, n = tokens.shape
    whole = context.gather_ids(torch.stack((tokens, targets)), dim=2)  # [2, B, S]: one gather for both
    S = whole.shape[2]
    positions = context.positions(n, tokens.device)  # [n] global position of each local one
    h = x
    for k, module in enumerate(model.mtp, start=1):
        if S - k <= 0:
            return
        spans = ahead_spans(context, n, S, k)
        kept = sum(b - a for a, b in spans)
        ahead = (positions + k).clamp(max=S - 1)  # the last k positions read a stand-in: nothing uses them
        ids, depth_targets = whole[0][:, ahead], whole[1][:, ahead]  # [B, n] each
        h = module(h, embed_tokens(model, ids), cos, sin, ids, segments=segments, ffn_spans=spans,
                   aux_weight=kept * context.degree / (S - k))
        if not kept:  # no position of this rank predicts at depth k: a zero that keeps the graph
            yield module.norm(h).sum() * 0.0
            continue
        wanted = take_spans(depth_targets, spans)  # [B, kept]
        if normalizers is not None:
            yield head_loss(module.norm(take_spans(h, spans)), wanted, normalizers[k - 1])
            continue
        counted = (wanted != IGNORE_INDEX).sum()
        total = (whole[1][:, k:] != IGNORE_INDEX).sum().clamp_min(1)  # the depth's targets on every rank
        yield head_loss(module.norm(take_spans(h, spans)), wanted) * (counted * context.degree / total)
