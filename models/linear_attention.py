"""Gated DeltaNet linear attention (Yang et al. 2025, "Gated Delta Networks"), the token mixer of Qwen3-Next's and
Qwen3.5's linear layers (the rule itself: models.delta_rule).

Shape legend: B batch, S positions, H hidden, Nk key heads, Nv value heads (a multiple of Nk), dk / dv their
widths, C = 2 Nk dk + Nv dv the convolved channels, L the chunk length.

    [q | k | v] = silu(causal depthwise conv_k(wqkv(x)))       per channel, over the last k positions
    q, k        = l2norm per head (q also times dk^-0.5), each key head shared by Nv / Nk value heads
    beta_t      = sigmoid(wb(x))            [Nv]   how much of the error the state corrects
    g_t         = -exp(A_log) * softplus(wa(x) + dt_bias)   [Nv]   log decay, <= 0
    state S [dk, dv] per value head, for each position t:
                  S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t
    y           = wo(RMSNorm(o) * weight * silu(wz(x)))                 (the gated norm, per value head)

Training runs the chunked form (``gated_delta_rule``): within a chunk of L positions the L corrections u solve a
unit lower-triangular system (the WY / UT form of the delta rule), so a chunk is a handful of [L, L] and [L, d]
matmuls, and the state crosses chunks once per chunk. Every exponent in it is a log decay difference that is <= 0
(masked before exp), so nothing overflows. Decoding a few positions runs the recurrence itself
(``gated_delta_steps``), which is also the reference the tests compare the chunked form to (models.delta_rule).

The KV cache of a linear layer (models.kvcache.LayerState) is the last k - 1 convolution inputs and the states S:
a fixed size whatever the length.

Document masking (training on packed documents) starts the state from zero at every document and keeps the
convolution inside it (``gated_delta_rule(segments=)``, ``GatedDeltaNet._conv_documents``).

Context parallelism (comm.context_parallel: each rank holds two zigzag chunks of every sequence): a chunk's outputs
and end state are affine in its starting state (``gated_delta_rule_affine``), so every rank computes its chunks'
maps with no state, the maps of all 2 cp chunks are all-gathered and composed in sequence order, and each chunk
adds its starting state's part (``GatedDeltaNet._rule_context``); the convolution reads the inputs before its
chunk from the other ranks' chunk tails (``_conv_context``). Per layer that is one all-gather of
2 x [B, Nv, dk, dk + dv] floats and one of the last k - 1 projected inputs of each chunk.

Speculative decoding (MTP drafts checked by one forward of a few positions) takes rejected positions back: such a
forward keeps the state and the convolution's inputs after each of its positions (``LayerState.snapshots``).

Tensor parallelism (comm.tensor_parallel) splits the heads: each TP rank computes Nk / tp key heads and the Nv / tp
value heads they serve. wz, wb, wa are sharded column-wise and wo row-wise as attention's projections are; wqkv and
the convolution hold q, k and v rows one after the other, so a contiguous shard would mix them: they stay
replicated and each rank reads its heads' three row blocks (``tp_rows``), as dt_bias, A_log and the gated norm
read its heads'. Their gradients are then partial sums over the TP ranks (comm.grad_sync adds them: ``tp_partial``),
and the input's gradient through wqkv is all-reduced (``_CopyToGroup``), as the sharded projections' is.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moekit.models.config import ModelConfig
from moekit.moe.precision import compute_dtype
from moekit.moe.recompute import recomputed
from moekit.models.delta_rule import (  # noqa: F401  (re-exported: the rule's API)
    RecomputedRule, gated_delta_rule, gated_delta_rule_affine, gated_delta_steps, l2_normalize)


# Positions at or below which a cached forward runs the recurrence instead of the chunks (decoding steps).
STEPS_MAX = 4


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet token mixer (module docstring) with the forward signature of models.attention's modules.
    Parameters, in transformers' Qwen3.5 layout: wqkv [C, H] (q rows, then k, then v), wz [Nv dv, H], wb and wa
    [Nv, H], conv_weight [C, 1, k], dt_bias and A_log [Nv], norm (RMSNorm over dv, the gated one), wo [H, Nv dv]."""

    def __init__(self, config: ModelConfig, layer_id: int = 0):
        super().__init__()
        H = config.hidden_size
        self.nk, self.nv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.kernel, self.chunk = config.linear_conv_kernel, config.linear_chunk
        self.recompute = config.linear_recompute  # backward runs the chunks again (models.delta_rule.RecomputedRule)
        self.channels = 2 * self.nk * self.dk + self.nv * self.dv
        self.wqkv = nn.Linear(H, self.channels, bias=False)
        self.wz = nn.Linear(H, self.nv * self.dv, bias=False)
        self.wb = nn.Linear(H, self.nv, bias=False)
        self.wa = nn.Linear(H, self.nv, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.channels, 1, self.kernel))
        self.dt_bias = nn.Parameter(torch.empty(self.nv))
        self.A_log = nn.Parameter(torch.empty(self.nv))
        self.norm = nn.RMSNorm(self.dv, eps=config.norm_eps)  # never zero-centered (transformers' RMSNormGated)
        self.wo = nn.Linear(self.nv * self.dv, H, bias=False)
        self.context_parallel = None  # comm.context_parallel: this rank's zigzag chunks of every sequence
        self.tp = None  # comm.tensor_parallel: (rank, ranks, group) when the heads are split over TP ranks

    # the parameters whose gradients are partial sums over the TP ranks when ``tp`` is set (comm.grad_sync)
    tp_partial = ("wqkv.weight", "conv_weight", "dt_bias", "A_log", "norm.weight")

    def heads(self) -> tuple[int, int]:
        """(key heads, value heads) this rank computes: all of them, or its 1 / tp share under tensor parallelism."""
        if self.tp is None:
            return self.nk, self.nv
        return self.nk // self.tp[1], self.nv // self.tp[1]

    def tp_rows(self) -> list[slice]:
        """The row blocks of wqkv / conv_weight (q, k, v) this rank's heads read: the whole of each without TP."""
        nk, nv = self.heads()
        r = 0 if self.tp is None else self.tp[0]
        q, kd, vd = nk * self.dk, self.nk * self.dk, nv * self.dv
        return [slice(r * q, (r + 1) * q), slice(kd + r * q, kd + (r + 1) * q),
                slice(2 * kd + r * vd, 2 * kd + (r + 1) * vd)]

    def _local_heads(self, t: Tensor) -> Tensor:
        """This rank's value heads of a per-value-head parameter [Nv, ...] (dt_bias, A_log): a view."""
        if self.tp is None:
            return t
        nv = self.heads()[1]
        return t[self.tp[0] * nv : (self.tp[0] + 1) * nv]

    def _project(self, x: Tensor) -> Tensor:
        """wqkv(x) [B, S, C] of this rank's heads (their q, k, v row blocks under TP: one product each, on views)."""
        if self.tp is None:
            return self.wqkv(x)
        x = _CopyToGroup.apply(x, self.tp[2])  # the other ranks' heads read x too: its gradient is summed
        w = self.wqkv
        if not hasattr(w, "lora_a"):
            return torch.cat([F.linear(x, w.weight[rows]) for rows in self.tp_rows()], dim=-1)
        # a LoRA adapter (models.lora): its [.., r] product once, then each block's rows of B (gradients partial
        # over TP as the weight's: comm.grad_sync gives them its role)
        u = w.lora_input(x, w.lora_a, group=self.tp[2])  # dropout: one mask over the group's replicated x
        return torch.cat([F.linear(x, w.weight[rows]) + recomputed(F.linear, u, w.lora_b[rows]) * w.lora_scale
                          for rows in self.tp_rows()], dim=-1)

    def _conv_weights(self) -> Tensor:
        """conv_weight [C, 1, k] of this rank's channels."""
        if self.tp is None:
            return self.conv_weight
        return torch.cat([self.conv_weight[rows] for rows in self.tp_rows()])

    def forward(self, x: Tensor, cos: Tensor | None = None, sin: Tensor | None = None, kv=None,
                segments: Tensor | None = None) -> Tensor:
        """x [B, S, H] -> [B, S, H]; cos / sin are unused (no RoPE). ``kv``: this layer's models.kvcache.LayerState
        (incremental decoding): the convolution reads its last inputs and the rule starts from its state, both
        then updated."""
        if segments is not None and kv is not None:
            raise ValueError("document masking (segments) is for training forwards; decode without it")
        if kv is not None and self.tp is not None:
            raise ValueError("incremental decoding runs in one process: load the model without tensor parallelism")
        B, S, _ = x.shape
        if kv is not None:
            if kv.state is not None and kv.state.shape[0] != B:
                raise ValueError(f"KV cache was filled with batch {kv.state.shape[0]}, got batch {B}; use one cache "
                                 f"per batch of sequences")
            kv.advance(S)
        x = x.to(compute_dtype(x))  # autocast: one bf16 copy for wqkv, wb, wa and wz (autocast casts per call)
        nk, nv = self.heads()  # this rank's (all, without tensor parallelism)
        mixed = self._project(x)  # [B, S, C]
        real = None  # a left-padded batch (models.kvcache.KVCache's padding): [B, S] whether a slot holds a token
        if kv is not None and kv.padding is not None:
            slots = torch.arange(kv.length - S, kv.length, device=x.device)
            real = slots[None, :] >= kv.padding.to(x.device)[:, None]
            mixed = mixed * real[..., None].to(mixed.dtype)  # fillers: the zeros a fresh convolution starts from
        conv_before = None if kv is None else kv.conv
        context = self.context_parallel if kv is None else None
        local_segments = inputs = None
        if context is not None:  # this rank's two zigzag chunks of every sequence (comm.context_parallel)
            mixed, local_segments = self._conv_context(mixed, segments, context)
        elif segments is None:
            mixed = self._conv(mixed, kv)
            inputs = None if kv is None else kv.inputs  # [B, C, k - 1 + S]: the cached inputs, then the new
        else:
            mixed = self._conv_documents(mixed, segments)
        mixed = F.silu(mixed)
        q, k, v = mixed.split([nk * self.dk, nk * self.dk, nv * self.dv], dim=-1)
        # fp32 copies in the contiguous layout (a bf16 input's cast copied already; an fp32 one was a strided view of
        # the transposed convolution's output, through which Inductor (torch 2.13, CPU) miscomputed the query rows'
        # gradient with one key head: tests/test_compile.py)
        q, k = q.float().contiguous(), k.float().contiguous()
        q = l2_normalize(q.view(B, S, nk, self.dk)) * self.dk**-0.5
        k = l2_normalize(k.view(B, S, nk, self.dk))
        if nv != nk:  # key head h serves value heads h * r .. h * r + r - 1
            q, k = (t.repeat_interleave(nv // nk, dim=2) for t in (q, k))
        v = v.view(B, S, nv, self.dv)
        beta = _ContiguousGrad.apply(torch.sigmoid(self.wb(x).float()))  # [B, S, Nv]
        a_log, dt_bias = self._local_heads(self.A_log), self._local_heads(self.dt_bias)
        g = -a_log.float().exp() * _ContiguousGrad.apply(F.softplus(self.wa(x).float() + dt_bias.float()))
        if real is not None:  # fillers leave the (zero) state as it is: no write, no decay
            beta, g = beta * real[..., None], g * real[..., None]
        start = None if kv is None else kv.state
        trace = None
        if context is not None:
            o, state = self._rule_context(q, k, v, g, beta, local_segments, segments, context), None
        elif kv is not None and S <= STEPS_MAX:  # decoding steps: the state after each is kept (speculation)
            trace = []
            o, state = gated_delta_steps(q, k, v, g, beta, start, trace=trace)
        elif kv is None and self.recompute and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            o, state = RecomputedRule.apply(q, k, v, g, beta, self.chunk, segments), None
        else:
            o, state = gated_delta_rule(q, k, v, g, beta, start, self.chunk, final_state=kv is not None,
                                        segments=segments)
        if kv is not None:
            first = kv.length - S  # the cache's length before this forward
            kv.snapshots = {first: (start, conv_before)}
            if trace is not None:  # the state and the convolution's inputs after each new position
                kv.snapshots.update({first + t + 1: (trace[t].detach(), inputs[:, :, t + 1 : t + self.kernel])
                                     for t in range(S)})
            kv.state = state.detach()
        z = self.wz(x).view(B, S, nv, self.dv)
        y = (self.norm(o.to(x.dtype)) * F.silu(z.float())).to(x.dtype)
        return self.wo(y.reshape(B, S, -1))

    def _conv(self, mixed: Tensor, kv, before: Tensor | None = None) -> Tensor:
        """The causal depthwise convolution of mixed [B, S, C] (position t reads t - k + 1 .. t; before the first
        position: the cache's last inputs, ``before`` [B, k - 1, C], or zeros)."""
        B, S, C = mixed.shape
        x = mixed.transpose(1, 2)  # [B, C, S]
        if before is not None:
            x = torch.cat((before.transpose(1, 2).to(x.dtype), x), dim=-1)
        elif kv is None:
            x = F.pad(x, (self.kernel - 1, 0))
        else:
            held = kv.conv if kv.conv is not None else x.new_zeros(B, C, self.kernel - 1)
            x = torch.cat((held.to(x.dtype), x), dim=-1)
            kv.conv = x[:, :, x.shape[-1] - (self.kernel - 1):].detach()
            # a short forward's inputs make its per-position snapshots (speculation); a prompt's are not kept
            kv.inputs = x.detach() if S <= STEPS_MAX else None
        return F.conv1d(x, self._conv_weights().to(x.dtype), groups=C).transpose(1, 2)  # [B, S, C]

    def _conv_documents(self, mixed: Tensor, segments: Tensor, before: Tensor | None = None,
                        before_segments: Tensor | None = None) -> Tensor:
        """The causal convolution with every tap that reaches into an earlier document dropped (document masking):
        out_t = sum_s w[k - 1 - s] x_(t - s) over the taps s with t - s in t's document. k products of [B, S, C].
        ``before`` [B, k - 1, C] / ``before_segments`` [B, k - 1]: the positions before the first (context
        parallelism), else none (zeros, in no document)."""
        S, k = mixed.shape[1], self.kernel
        if before is None:
            x = F.pad(mixed, (0, 0, k - 1, 0))  # [B, k - 1 + S, C]
            seg = F.pad(segments, (k - 1, 0), value=-1)  # no document before the first position
        else:
            x = torch.cat((before.to(mixed.dtype), mixed), dim=1)
            seg = torch.cat((before_segments.to(segments.dtype), segments), dim=1)
        w = self._conv_weights()[:, 0].to(mixed.dtype)  # [C, k]
        out = None
        for tap in range(k):  # tap k - 1 is the position itself
            same = (seg[:, tap : tap + S] == segments).to(mixed.dtype)[..., None]  # [B, S, 1]
            term = x[:, tap : tap + S] * same * w[:, tap]
            out = term if out is None else out + term
        return out

    def _conv_context(self, mixed: Tensor, segments: Tensor | None, context) -> tuple[Tensor, Tensor | None]:
        """The convolution of this rank's two chunks, each reading the k - 1 positions before it from the chunks
        of other ranks (their last min(c, k - 1) inputs, all-gathered: differentiable); and this rank's positions'
        documents out of the whole sequence's ``segments`` (or None)."""
        B, S, C = mixed.shape
        k, c = self.kernel, S // 2
        positions = context.positions(S, mixed.device)
        local_seg = None if segments is None else segments[:, positions]
        t = min(c, k - 1)
        every = context.gather(torch.stack((mixed[:, c - t:c], mixed[:, S - t:]), 0), 0) if t else None
        parts = []
        for lo, first, n in context.chunks(S):
            j = first // c  # the chunk's index in the whole sequence
            before = None
            if k > 1:  # the k - 1 inputs before the chunk: earlier chunks' tails, zeros before the sequence
                before = torch.cat([mixed.new_zeros(B, k - 1, C), *every[:j].unbind(0)], dim=1)[:, -(k - 1):]
            part = mixed[:, lo:lo + n]
            if segments is None:
                parts.append(self._conv(part, None, before))
                continue
            idx = torch.arange(first - (k - 1), first, device=mixed.device)
            before_seg = torch.where(idx >= 0, segments[:, idx.clamp(min=0)], -1)
            parts.append(self._conv_documents(part, local_seg[:, lo:lo + n], before, before_seg))
        return torch.cat(parts, dim=1), local_seg

    def _rule_context(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, local: Tensor | None,
                      segments: Tensor | None, context) -> Tensor:
        """The rule on this rank's two chunks under context parallelism: each chunk's outputs and end state are
        affine in its starting state (``gated_delta_rule_affine``); the maps of all 2 cp chunks are all-gathered
        (differentiable) and composed in sequence order, which gives each chunk its starting state."""
        S = q.shape[1]
        c = S // 2
        pieces = []
        for lo, first, n in context.chunks(S):
            span = slice(lo, lo + n)
            before = None
            if segments is not None:  # the document of the position before the chunk (-1: none)
                before = segments[:, first - 1] if first else torch.full_like(segments[:, 0], -1)
            pieces.append(gated_delta_rule_affine(q[:, span], k[:, span], v[:, span], g[:, span], beta[:, span],
                                                  self.chunk, None if local is None else local[:, span], before))
        maps = context.gather(torch.stack([p[2] for p in pieces]), 0)  # [2 cp, B, N, dk, dk] in sequence order
        ends = context.gather(torch.stack([p[3] for p in pieces]), 0)  # [2 cp, B, N, dk, dv]
        state, starts = torch.zeros_like(ends[0]), []
        for j in range(maps.shape[0]):
            starts.append(state)
            state = maps[j] @ state + ends[j]
        out = [o + torch.einsum("bsnk,bnkv->bsnv", o_in, starts[first // c])
               for (o, o_in, _, _), (_, first, _) in zip(pieces, context.chunks(S))]
        return torch.cat(out, dim=1)

    @torch.no_grad()
    def init_weights(self, normal_, std: float, std_out: float) -> None:
        """Projections N(0, std), wo N(0, std_out); the convolution N(0, 1 / (3 k)) (the variance of torch's
        default Conv1d init); dt_bias 1 and A 1 .. 16 spread evenly over the value heads (transformers draws A
        uniformly from [0.01, 16]; an even spread is a function of the head alone, so every layout agrees);
        the gated norm 1."""
        for w in (self.wqkv, self.wz, self.wb, self.wa):
            normal_(w.weight, std)
        normal_(self.wo.weight, std_out)
        normal_(self.conv_weight, 1.0 / math.sqrt(3 * self.kernel))
        fill_by_index(self.dt_bias, lambda h: torch.ones_like(h, dtype=torch.float32))
        fill_by_index(self.A_log, lambda h: torch.log(1.0 + 15.0 * (h.float() + 0.5) / self.nv))
        local(self.norm.weight).fill_(1.0)


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over ``group`` (the input of a computation split over the
    group's ranks, each of which adds its share of the input's gradient)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        # the functional collective (a new tensor, no in-place op on a temporary): what torch.compile traces
        from torch.distributed._functional_collectives import all_reduce, wait_tensor

        return wait_tensor(all_reduce(grad.contiguous(), "sum", ctx.group)), None


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous. The rule's gradient for g and beta arrives transposed
    ([B, N, S] strides); under torch.compile (aot_autograd) the sigmoid / softplus backward kept those strides and
    the projection's backward then failed to view them as [B S, N]."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def fill_by_index(t: Tensor, values) -> None:
    """Fill a 1-d parameter from ``values(indices)`` at the indices this rank holds (all of them unless it is a
    sharded DTensor): a function of the index alone, so every layout agrees."""
    from moekit.models.hf.sharded import shard_box

    box = shard_box(t, "")
    idx = torch.tensor(list(box[0]), dtype=torch.long)
    local(t).copy_(values(idx).to(local(t).dtype))
