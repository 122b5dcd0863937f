"""The per-expert loop backend's arithmetic (moe.experts registers it as "loop"): one matmul pair per expert over
its contiguous row block, the obvious reference and, on CPU, the fastest.

Shape legend: N routed rows (expert-major), E experts, H hidden, F expert FFN; ``sizes`` [E] the rows of each
expert's block (moe.experts.loop_mlp computes them from the counts, the one host sync).
"""
from __future__ import annotations

import torch
from torch import Tensor

from moekit.moe import onednn_gemm as onednn
from moekit.moe.activations import get_activation, swiglu_oai_backward_into, swiglu_oai_into
from moekit.moe.expert_threads import choose_workers, for_each_expert


def loop_blocks(rows: Tensor, sizes: list[int], w_in: Tensor, w_out: Tensor, activation: str,
                b_in: Tensor | None = None, b_out: Tensor | None = None) -> Tensor:
    """moe.experts.loop_mlp on row blocks of ``sizes``: _LoopGLU where loop_runs_fused, else the composite."""
    biases = [b for b in (b_in, b_out) if b is not None]
    if loop_runs_fused(activation, rows, w_in, w_out) and all(b.dtype == rows.dtype for b in biases):
        params = (rows, w_in, w_out, *biases)
        if torch.is_grad_enabled() and any(t.requires_grad for t in params):
            return _LoopGLU.apply(rows, w_in, w_out, b_in, b_out, sizes, activation)
        return _loop_glu_forward(rows, w_in, w_out, b_in, b_out, sizes, activation, keep=False)[0]
    return _loop_composite(rows, sizes, w_in, w_out, activation, b_in, b_out)


# Activations the loop backend runs as one hand-written autograd function (_LoopGLU); others compose autograd ops
LOOP_FUSED_ACTIVATIONS = ("swiglu", "swiglu_oai")


def loop_runs_fused(activation: str, rows: Tensor, w_in: Tensor, w_out: Tensor) -> bool:
    """Whether the loop backend computes these experts with _LoopGLU (preallocated outputs, expert threads,
    oneDNN's recurring shapes) rather than the autograd composite: a LOOP_FUSED_ACTIVATIONS entry, one dtype."""
    return activation in LOOP_FUSED_ACTIVATIONS and rows.dtype == w_in.dtype == w_out.dtype


def _blocks(t: Tensor, sizes: list[int], dim: int = 0) -> tuple[Tensor, ...]:
    """Every expert's block of ``t`` along ``dim`` as views, made in one call: per-expert Python slicing
    (``t[start:end]``, ``chunk``, ``.t()``) costs more than the small experts' arithmetic on CPU."""
    return t.narrow(dim, 0, sum(sizes)).split(sizes, dim)


def _zeroed(t: Tensor, experts: list[int]) -> Tensor:
    """``t`` with the blocks of ``experts`` (dim 0) set to 0."""
    if experts:
        t.index_fill_(0, torch.tensor(experts, device=t.device), 0)
    return t


def swiglu_into(gate: Tensor, up: Tensor, out: Tensor) -> Tensor:
    """out = silu(gate) * up, computed into ``out`` without temporaries: the loop backend's forward epilogue
    (also what tools/bench/cpu_fusion.py times against a fused kernel)."""
    return torch.ops.aten.silu.out(gate, out=out).mul_(up)


def _loop_glu_forward(rows: Tensor, w_in: Tensor, w_out: Tensor, b_in: Tensor | None, b_out: Tensor | None,
                      sizes: list[int], activation: str, keep: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(out [N, H], h, a): each expert's block written into ``out``. ``keep``: h [owned, 2F] and
    a = act(h) [owned, F] kept whole for backward; else one expert-sized buffer each per worker,
    reused (inference). Experts may run concurrently on CPU (moe.expert_threads)."""
    N, f_in, owned = rows.shape[0], w_in.shape[-1], sum(sizes)
    F = f_in // 2
    oai = activation == "swiglu_oai"
    out = rows.new_empty(N, w_out.shape[-1])
    xs, outs, wis, wos = _blocks(rows, sizes), _blocks(out, sizes), w_in.unbind(0), w_out.unbind(0)
    bis = b_in.unbind(0) if b_in is not None else None
    bos = b_out.unbind(0) if b_out is not None else None
    h, a = (rows.new_empty(owned, f_in), rows.new_empty(owned, F)) if keep else (None, None)
    if keep:  # views of every expert's h = [gate | up] and a, made once
        hs, gates, ups, acts = _blocks(h, sizes), _blocks(h[:, :F], sizes), _blocks(h[:, F:], sizes), _blocks(a, sizes)
    m = max(sizes) if sizes else 0  # (no default=: torch.compile warns on it)

    def scratch():  # one worker's expert-sized buffers: h and a for inference, swiglu_oai's temporary
        bufs = (None, None) if keep else (rows.new_empty(m, f_in), rows.new_empty(m, F))
        return bufs + ((rows.new_empty(m, F),) if oai else ())

    def expert(e: int, start: int, n: int, bufs) -> None:
        if keep:
            hb, gate, up, ab = hs[e], gates[e], ups[e], acts[e]
        else:
            hb, ab = bufs[0][:n], bufs[1][:n]
            gate, up = hb[:, :F], hb[:, F:]
        onednn.mm(xs[e], wis[e], hb, bis[e] if bis is not None else None)
        if oai:
            swiglu_oai_into(gate, up, ab, bufs[2][:n])
        else:
            swiglu_into(gate, up, ab)
        onednn.mm(ab, wos[e], outs[e], bos[e] if bos is not None else None)

    with torch.autocast(rows.device.type, enabled=False):  # rows and weights are the compute dtype
        for_each_expert(sizes, expert, choose_workers(rows, w_in, sizes), scratch)
    out[owned:].zero_()  # rows nobody owns
    return out, h, a


def _loop_composite(rows: Tensor, sizes: list[int], w_in: Tensor, w_out: Tensor, activation: str,
                    b_in: Tensor | None = None, b_out: Tensor | None = None) -> Tensor:
    """The per-expert loop in autograd ops (with the optional biases [E, F_in] / [E, H]). ``split`` /
    ``unbind`` make one autograd node each, so backward concatenates the per-expert gradients once instead of
    a full-size zero gradient per slice."""
    act = get_activation(activation)
    owned = sum(sizes)
    blocks = rows[:owned].split(sizes)
    E = w_in.shape[0]
    bis = b_in.unbind(0) if b_in is not None else (None,) * E
    bos = b_out.unbind(0) if b_out is not None else (None,) * E

    def mlp(x: Tensor, wi: Tensor, wo: Tensor, bi: Tensor | None, bo: Tensor | None) -> Tensor:
        h = x @ wi if bi is None else torch.addmm(bi, x, wi)  # [n, F_in]
        return act(h) @ wo if bo is None else torch.addmm(bo, act(h), wo)  # [n, H]

    outs = [mlp(*a) for a in zip(blocks, w_in.unbind(0), w_out.unbind(0), bis, bos)]
    if owned < rows.shape[0]:  # rows nobody owns come out as zeros
        outs.append(rows.new_zeros(rows.shape[0] - owned, w_out.shape[-1]))
    return torch.cat(outs)


class _LoopGLU(torch.autograd.Function):
    """The per-expert gated loop (swiglu, swiglu_oai; optional biases) with a hand-written backward: one output
    and one gradient buffer per tensor, each expert's block computed into its slice (``out=``), so nothing is
    concatenated or stacked and the block stays in cache between its GEMM and the elementwise work. Saves rows,
    h = rows @ w_in (+ b_in) [N, 2F] and a = act(h) [N, F], as autograd would. The biases' gradients are the
    column sums of each expert's d h / output-gradient block. A double backward (create_graph) recomputes
    through :func:`_loop_composite` and differentiates that."""

    @staticmethod
    def forward(ctx, rows: Tensor, w_in: Tensor, w_out: Tensor, b_in: Tensor | None, b_out: Tensor | None,
                sizes: list[int], activation: str) -> Tensor:
        out, h, a = _loop_glu_forward(rows, w_in, w_out, b_in, b_out, sizes, activation, keep=True)
        ctx.save_for_backward(rows, w_in, w_out, h, a, b_in, b_out)
        ctx.sizes, ctx.activation = sizes, activation
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        rows, w_in, w_out, h, a, b_in, b_out = ctx.saved_tensors
        sizes, activation = ctx.sizes, ctx.activation
        need_x, need_wi, need_wo, need_bi, need_bo = ctx.needs_input_grad[:5]
        if torch.is_grad_enabled():  # create_graph: differentiate the composite instead
            leaves = (rows, w_in, w_out, b_in, b_out)
            needs = (need_x, need_wi, need_wo, need_bi, need_bo)
            inputs = [t for t, need in zip(leaves, needs) if need]
            with torch.enable_grad():
                y = _loop_composite(rows, sizes, w_in, w_out, activation, b_in, b_out)
            grads = iter(torch.autograd.grad(y, inputs, grad, create_graph=True, allow_unused=True))
            return (*(next(grads) if need else None for need in needs), None, None)
        grad = grad.to(rows.dtype)
        owned, F = sum(sizes), a.shape[-1]
        oai = activation == "swiglu_oai"
        d_x = torch.empty_like(rows) if need_x else None
        if need_x:
            d_x[owned:].zero_()  # rows nobody owns get no gradient
        # every expert with rows overwrites its whole weight-gradient block (mm out=); only the others need zeros
        idle = [e for e, n in enumerate(sizes) if n == 0]
        d_wi = _zeroed(torch.empty_like(w_in), idle) if need_wi else None
        d_wo = _zeroed(torch.empty_like(w_out), idle) if need_wo else None
        d_bi = _zeroed(torch.empty_like(b_in), idle) if need_bi else None
        d_bo = _zeroed(torch.empty_like(b_out), idle) if need_bo else None
        need_dh = need_x or need_wi or need_bi
        biggest = max(sizes) if sizes else 0
        # every per-expert view made once, outside the loop (see _blocks): transposed operands as views too
        gs, gates, ups = _blocks(grad, sizes), _blocks(h[:, :F], sizes), _blocks(h[:, F:], sizes)
        a_t, x_t = _blocks(a.t(), sizes, 1), _blocks(rows.t(), sizes, 1)
        w_out_t, w_in_t = w_out.transpose(1, 2).unbind(0), w_in.transpose(1, 2).unbind(0)
        d_xs = _blocks(d_x, sizes) if need_x else None
        d_wos = d_wo.unbind(0) if need_wo else None
        d_wis = d_wi.unbind(0) if need_wi else None
        d_bis = d_bi.unbind(0) if need_bi else None
        d_bos = d_bo.unbind(0) if need_bo else None

        # oneDNN dtypes (bf16 / fp16 on CPU): the weight gradients reduce over a padded row count, the padding
        # zero rows of one operand, so their GEMM shapes recur across steps (moe.onednn_gemm); exact, one rounding
        pad = onednn.split_rows(rows) and biggest > onednn.PIECE_QUANTA[-1]
        rows_owned = rows[:owned]
        tall = onednn.padded_rows(biggest) if pad else biggest

        def scratch():  # one worker's d_a, d_h (+ zero-padded copies for the weight gradients, swiglu_oai's temporary)
            bufs = (rows.new_empty(tall, F), rows.new_empty(tall, h.shape[-1]))
            if pad:  # the output gradient block, and rows / a near the end
                bufs += (rows.new_empty(tall, grad.shape[-1]), rows.new_empty(tall, F), rows.new_empty(tall, rows.shape[-1]))
            return bufs + ((rows.new_empty(tall, F),) if oai else ())

        def expert(e: int, start: int, n: int, bufs) -> None:
            g = gs[e]
            # the rows the weight gradients reduce over
            m = n if not pad or onednn.runs_whole(a_t[e], g, n) else onednn.padded_rows(n)
            if need_wo:
                if m == n:
                    torch.mm(a_t[e], g, out=d_wos[e])
                else:  # d W_out = a^T g over m rows: g's block over zero rows
                    gp = bufs[2][:m]
                    gp[:n].copy_(g)
                    gp[n:].zero_()
                    torch.mm(onednn.rows_or_copy(a, start, n, m, bufs[3]).t(), gp, out=d_wos[e])
            if need_bo:
                torch.sum(g, 0, out=d_bos[e])  # d b_out: the output gradient's column sums
            if need_dh:
                da, dh = bufs[0][:n], bufs[1][:m]
                gate, up = gates[e], ups[e]
                onednn.mm(g, w_out_t[e], da)
                d_gate, d_up = dh[:n, :F], dh[:n, F:]
                if oai:
                    swiglu_oai_backward_into(da, gate, up, d_gate, d_up, bufs[-1][:n])
                else:
                    torch.ops.aten.silu.out(gate, out=d_up).mul_(da)  # d up = da * silu(gate)
                    # d gate = (da * up) * silu'(gate), torch's fused silu derivative; da is not needed after
                    torch.ops.aten.silu_backward.grad_input(da.mul_(up), gate, grad_input=d_gate)
                if need_bi:
                    torch.sum(dh[:n], 0, out=d_bis[e])
                if need_wi:
                    if m == n:
                        torch.mm(x_t[e], dh, out=d_wis[e])
                    else:  # d W_in = rows^T dh over m rows: dh's rows past n are zero
                        dh[n:].zero_()
                        torch.mm(onednn.rows_or_copy(rows_owned, start, n, m, bufs[4]).t(), dh, out=d_wis[e])
                if need_x:
                    onednn.mm(dh[:n], w_in_t[e], d_xs[e])

        for_each_expert(sizes, expert, choose_workers(rows, w_in, sizes), scratch)
        return d_x, d_wi, d_wo, d_bi, d_bo, None, None
