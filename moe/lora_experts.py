"""Routed experts with LoRA adapters, computed factored: the merged weights ``w + s A B`` are never formed.

Per expert e, over its contiguous row block x_e [n_e, H] (moe.experts' shape legend), with s = alpha / rank:

    h_e = x_e @ w_in[e]  + s (d(x_e) @ lora_a_in[e])  @ lora_b_in[e]   (+ b_in[e])      [n_e, F_in]
    y_e = act(h_e) @ w_out[e] + s (d(act(h_e)) @ lora_a_out[e]) @ lora_b_out[e]  (+ b_out[e])   [n_e, H]

a side without adapters (``GroupedExperts.add_lora(sides=)``) is the plain projection. ``d``: the identity, or while
training with LoRA dropout p the input times a fresh [N, H] / [N, F] bool mask over all rows (one per side, drawn
before the path is chosen, so every path computes the same function; moe.lora_dropout) over 1 - p.

Why factored: with the base stacks frozen, autograd computes no weight gradient for them (the largest GEMMs of a
full fine-tune's backward), only the input gradients through them and the small [r]-wide adapter products; merging
per step would instead need the full [E, H, F] weight gradient to reach A and B, and keep a merged copy of every
layer's experts for backward.

Two ways to run it, the same math:
 - ``grouped``: torch.nn.functional.grouped_mm over all experts per product (no host sync), where it runs
   (shapes 16-byte aligned, rank included): the GPU's choice, and the CPU's when the layer asks for the "torch"
   backend;
 - ``loop``: one block per expert, anything grouped_mm cannot take and the CPU's default. For the gated
   activations (swiglu, swiglu_oai) with every tensor in one dtype it is one autograd function (``_LoopLoRA``,
   as moe/loop_experts.py's ``_LoopGLU``): each expert's block computed into slices of preallocated outputs and
   gradients, experts run concurrently on CPU threads (moe.expert_threads), and a frozen weight's gradient never
   formed; otherwise autograd ops per expert (``_loop``, the reference).
Rows past sum(counts) belong to no expert: output 0, gradient 0 (as every expert backend). The float8 backend has
no adapter path: experts named to it with adapters are refused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moekit.moe import onednn_gemm as onednn
from moekit.moe.activations import get_activation, swiglu_oai_backward_into, swiglu_oai_into
from moekit.moe.expert_threads import choose_workers, for_each_expert
# moe.experts imports this module only when experts with adapters run: no cycle at import time
from moekit.moe.experts import EXPERT_PARAM_NAMES, _grouped_mm_why_not, add_expert_bias, counts_to_offs
from moekit.moe.lora_dropout import keep_mask, masked_product, process_stream
from moekit.moe.recompute import recomputed
from moekit.moe.loop_experts import LOOP_FUSED_ACTIVATIONS, _blocks, _zeroed, swiglu_into

# _LoopLoRA's tensor arguments after rows, in moe.experts' order: w_in, w_out, b_in, b_out, then the adapters
_ORDER = EXPERT_PARAM_NAMES


def lora_path(rows: Tensor, named: dict[str, Tensor], backend: str) -> str:
    """"grouped" or "loop" (module docstring) for these tensors and the layer's expert backend name."""
    if backend == "float8":
        raise ValueError("expert backend 'float8' has no LoRA adapter path; use 'auto' (or 'torch' / 'loop') for "
                         "experts with adapters")
    if backend == "loop" or (backend != "torch" and rows.device.type != "cuda"):
        return "loop"
    probe = [named["w_in"], named["w_out"]] + [t for k, t in named.items() if k.startswith("lora_")]
    widths_ok = all(_grouped_mm_why_not(rows, w, w) == "" for w in probe)
    return "grouped" if widths_ok else "loop"


def lora_mlp(rows: Tensor, counts: Tensor, named: dict[str, Tensor], activation: str, scale: float,
             backend: str = "auto", dropout: float = 0.0) -> Tensor:
    """rows [N, H] expert-major, counts [E] -> [N, H] (module docstring). ``named``: the local expert tensors by
    name (w_in, w_out, optional b_in / b_out, the lora_* adapters present), all in rows' dtype. ``dropout``: the
    adapters' input dropout rate (0 unless training)."""
    offs = counts_to_offs(counts, rows.shape[0])
    drop = _masks(rows, named, dropout)
    if lora_path(rows, named, backend) == "grouped":
        return _grouped(rows, offs, named, activation, scale, drop)
    if activation in LOOP_FUSED_ACTIVATIONS and all(t.dtype == rows.dtype for t in named.values()):
        ends = offs.tolist()  # D2H sync: the row blocks drive the loop
        sizes = [b - a for a, b in zip([0] + ends[:-1], ends)]
        tensors = [named.get(n) for n in _ORDER]
        keeps = (drop.get("in"), drop.get("out"), dropout if drop else 0.0)
        if torch.is_grad_enabled() and (rows.requires_grad or any(t is not None and t.requires_grad for t in tensors)):
            return _LoopLoRA.apply(rows, *tensors, *keeps, sizes, activation, scale)
        return _lora_forward(rows, *tensors, *keeps, sizes, activation, scale, keep=False)[0]
    return _loop(rows, offs, named, activation, scale, drop)


def _masks(rows: Tensor, named: dict[str, Tensor], p: float) -> dict:
    """{"in": keep [N, H], "out": keep [N, F] for the sides with adapters, "p": p} while dropping, else {}."""
    if p <= 0.0:
        return {}
    out: dict = {"p": p}
    stream = process_stream()  # the rows are this rank's own: its stream
    for side, width in (("in", rows.shape[1]), ("out", named["w_out"].shape[1])):
        if f"lora_a_{side}" in named:
            out[side] = keep_mask((rows.shape[0], width), p, rows.device, stream)
    return out


def _grouped(rows: Tensor, offs: Tensor, named: dict[str, Tensor], activation: str, scale: float,
             drop: dict | None = None) -> Tensor:
    drop = drop or {}
    owned = None
    if rows.shape[0] > 0:  # grouped_mm leaves rows past offs[-1] undefined, forward and backward: mask them
        owned = (torch.arange(rows.shape[0], device=rows.device) < offs[-1])[:, None]
        rows = torch.where(owned, rows, 0)

    def product(x: Tensor, a: Tensor) -> Tensor:
        return F.grouped_mm(x, a, offs=offs)

    def project(x: Tensor, side: str) -> Tensor:
        y = F.grouped_mm(x, named[f"w_{side}"], offs=offs)
        a = named.get(f"lora_a_{side}")
        if a is not None:
            u = masked_product(x, a, drop[side], drop["p"], product) if side in drop else product(x, a)
            y = y + recomputed(F.grouped_mm, u, named[f"lora_b_{side}"], offs=offs) * scale  # moe.recompute
        return add_expert_bias(y, named.get(f"b_{side}"), offs)

    out = project(get_activation(activation)(project(rows, "in")), "out")
    return out if owned is None else torch.where(owned, out, 0)


def _loop(rows: Tensor, offs: Tensor, named: dict[str, Tensor], activation: str, scale: float,
          drop: dict | None = None) -> Tensor:
    drop = drop or {}
    ends = offs.tolist()  # D2H sync: the row blocks drive the loop
    act = get_activation(activation)
    outs, start = [], 0
    for e, end in enumerate(ends):
        if end == start:
            continue
        x = rows[start:end]

        def project(x: Tensor, side: str) -> Tensor:
            y = x @ named[f"w_{side}"][e]
            a = named.get(f"lora_a_{side}")
            if a is not None:
                u = masked_product(x, a[e], drop[side][start:end], drop["p"], torch.matmul) if side in drop else \
                    x @ a[e]
                y = y + recomputed(torch.matmul, u, named[f"lora_b_{side}"][e]) * scale
            b = named.get(f"b_{side}")
            return y if b is None else y + b[e]

        outs.append(project(act(project(x, "in")), "out"))
        start = end
    tail = rows.shape[0] - start
    if tail or not outs:
        outs.append(rows.new_zeros(tail, named["w_out"].shape[-1]))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _lora_forward(rows, w_in, w_out, b_in, b_out, a_in, b_in_l, a_out, b_out_l, keep_in, keep_out, p, sizes,
                  activation, scale, keep):
    """(out [N, H], h [owned, 2F], a [owned, F], u [owned, r], v [owned, r]) of the gated expert MLP with adapters:
    u = d(x) A_in, h = x W_in (+ b_in) + s u B_in, a = act(h), v = d(a) A_out, y = a W_out (+ b_out) + s v B_out,
    every expert's block written into its slice (``keep``: h, a, u, v kept whole for backward; else worker
    scratch). d: x * keep_in / (1 - p) where keep_in is given (LoRA dropout), likewise a with keep_out."""
    N, f_in, owned = rows.shape[0], w_in.shape[-1], sum(sizes)
    F, H = f_in // 2, w_out.shape[-1]
    oai = activation == "swiglu_oai"
    r = (a_in if a_in is not None else a_out).shape[-1]
    out = rows.new_empty(N, H)
    xs, outs = _blocks(rows, sizes), _blocks(out, sizes)
    per = {k: (t.unbind(0) if t is not None else None) for k, t in
           (("wi", w_in), ("wo", w_out), ("bi", b_in), ("bo", b_out), ("ai", a_in), ("Bi", b_in_l), ("ao", a_out),
            ("Bo", b_out_l))}
    kept = tuple(rows.new_empty(owned, w) for w in (f_in, F, r, r)) if keep else None
    views = [_blocks(t, sizes) for t in kept] if keep else None
    ki = _blocks(keep_in, sizes) if keep_in is not None else None
    ko = _blocks(keep_out, sizes) if keep_out is not None else None
    m = max(sizes) if sizes else 0

    def scratch():  # [h, a, u, v] unless kept; the dropped input and activation; swiglu_oai's temporary
        bufs = () if keep else tuple(rows.new_empty(m, w) for w in (f_in, F, r, r))
        drop = (rows.new_empty(m, H) if ki is not None else None, rows.new_empty(m, F) if ko is not None else None)
        return bufs + drop + ((rows.new_empty(m, F),) if oai else ())

    def expert(e: int, start: int, n: int, bufs) -> None:
        hb, ab, ub, vb = (v[e] for v in views) if keep else (b[:n] for b in bufs[:4])
        xd, ad = bufs[-3 if oai else -2], bufs[-2 if oai else -1]
        x = xs[e]
        onednn.mm(x, per["wi"][e], hb, per["bi"][e] if b_in is not None else None)
        if a_in is not None:
            torch.mm(_drop_into(x, ki, e, p, xd), per["ai"][e], out=ub)
            hb.addmm_(ub, per["Bi"][e], alpha=scale)
        if oai:
            swiglu_oai_into(hb[:, :F], hb[:, F:], ab, bufs[-1][:n])
        else:
            swiglu_into(hb[:, :F], hb[:, F:], ab)
        onednn.mm(ab, per["wo"][e], outs[e], per["bo"][e] if b_out is not None else None)
        if a_out is not None:
            torch.mm(_drop_into(ab, ko, e, p, ad), per["ao"][e], out=vb)
            outs[e].addmm_(vb, per["Bo"][e], alpha=scale)

    with torch.autocast(rows.device.type, enabled=False):
        for_each_expert(sizes, expert, choose_workers(rows, w_in, sizes), scratch)
    out[owned:].zero_()
    return (out, *kept) if keep else (out, None, None, None, None)


def _drop_into(x: Tensor, keeps, e: int, p: float, buf) -> Tensor:
    """x itself, or moe.lora_dropout.dropped(x, keep, p) of expert e's block written into ``buf`` (same ops)."""
    if keeps is None:
        return x
    out = torch.mul(x, keeps[e], out=buf[: x.shape[0]])
    return out.mul_(1.0 / (1.0 - p))


class _LoopLoRA(torch.autograd.Function):
    """The gated per-expert loop with LoRA adapters and a hand-written backward (module docstring): inputs rows,
    w_in, w_out, b_in, b_out, lora_a_in, lora_b_in, lora_a_out, lora_b_out (the absent ones None); gradients only for
    those that need them, so frozen stacks cost their input gradient alone. Saves rows, h, a, the r-wide u, v
    and LoRA dropout's bool masks (keep_in, keep_out; the dropped blocks are formed again in backward).
    A double backward (create_graph) differentiates the autograd reference (``_loop``) instead."""

    @staticmethod
    def forward(ctx, rows, w_in, w_out, b_in, b_out, a_in, b_in_l, a_out, b_out_l, keep_in, keep_out, p, sizes,
                activation, scale):
        out, h, a, u, v = _lora_forward(rows, w_in, w_out, b_in, b_out, a_in, b_in_l, a_out, b_out_l, keep_in,
                                        keep_out, p, sizes, activation, scale, keep=True)
        ctx.save_for_backward(rows, w_in, w_out, b_in, b_out, a_in, b_in_l, a_out, b_out_l, h, a, u, v, keep_in,
                              keep_out)
        ctx.sizes, ctx.activation, ctx.scale, ctx.p = sizes, activation, scale, p
        return out

    @staticmethod
    def backward(ctx, grad):
        rows, w_in, w_out, b_in, b_out, a_in, b_in_l, a_out, b_out_l, h, a, u, v, keep_in, keep_out = \
            ctx.saved_tensors
        sizes, activation, s, p = ctx.sizes, ctx.activation, ctx.scale, ctx.p
        inputs = (rows, w_in, w_out, b_in, b_out, a_in, b_in_l, a_out, b_out_l)
        needs = ctx.needs_input_grad[:9]
        tail = (None,) * 6  # keep_in, keep_out, p, sizes, activation, scale
        if torch.is_grad_enabled():  # create_graph: differentiate the composite
            named = {k: t for k, t in zip(_ORDER, inputs[1:]) if t is not None}
            counts = torch.tensor(sizes, device=rows.device)
            drop = {"p": p} | ({"in": keep_in} if keep_in is not None else {}) | \
                ({"out": keep_out} if keep_out is not None else {})
            with torch.enable_grad():
                y = _loop(rows, counts_to_offs(counts, rows.shape[0]), named, activation, s,
                          drop if len(drop) > 1 else None)
            wanted = [t for t, need in zip(inputs, needs) if need]
            got = iter(torch.autograd.grad(y, wanted, grad, create_graph=True, allow_unused=True))
            return (*(next(got) if need else None for need in needs), *tail)
        grad = grad.to(rows.dtype)
        owned, F = sum(sizes), a.shape[-1]
        oai = activation == "swiglu_oai"
        idle = [e for e, n in enumerate(sizes) if n == 0]
        d = [(_zeroed(torch.empty_like(t), idle) if i else torch.empty_like(t)) if need else None
             for i, (t, need) in enumerate(zip(inputs, needs))]
        if needs[0]:
            d[0][owned:].zero_()  # rows nobody owns get no gradient
        d_x, d_wi, d_wo, d_bi, d_bo, d_ai, d_Bi, d_ao, d_Bo = d
        per = lambda t: t.unbind(0) if t is not None else None  # noqa: E731
        gs, xs = _blocks(grad, sizes), _blocks(rows, sizes)
        hs, as_, us, vs = (_blocks(t, sizes) if t is not None else None for t in (h, a, u, v))
        wi_t, wo_t = w_in.transpose(1, 2).unbind(0), w_out.transpose(1, 2).unbind(0)
        ai_t = a_in.transpose(1, 2).unbind(0) if a_in is not None else None
        ao_t = a_out.transpose(1, 2).unbind(0) if a_out is not None else None
        Bi_t = b_in_l.transpose(1, 2).unbind(0) if b_in_l is not None else None
        Bo_t = b_out_l.transpose(1, 2).unbind(0) if b_out_l is not None else None
        outs = {k: per(t) for k, t in (("wi", d_wi), ("wo", d_wo), ("bi", d_bi), ("bo", d_bo), ("ai", d_ai),
                                        ("Bi", d_Bi), ("ao", d_ao), ("Bo", d_Bo))}
        d_xs = _blocks(d_x, sizes) if d_x is not None else None
        need_dh = d_x is not None or any(t is not None for t in (d_wi, d_bi, d_ai, d_Bi))
        m = max(sizes) if sizes else 0
        r = (u if u is not None else v).shape[-1]

        ki = _blocks(keep_in, sizes) if keep_in is not None else None
        ko = _blocks(keep_out, sizes) if keep_out is not None else None

        def scratch():  # d_a, d_h, the adapters' r-wide gradients, swiglu_oai's temporary; with dropout a dropped
            # block of x and of a (or their gradients)
            return (rows.new_empty(m, F), rows.new_empty(m, h.shape[-1]), rows.new_empty(m, r), rows.new_empty(m, r),
                    rows.new_empty(m, F), rows.new_empty(m, rows.shape[1]) if ki is not None else None,
                    rows.new_empty(m, F) if ko is not None else None)

        def expert(e: int, start: int, n: int, bufs) -> None:
            g, x, ab = gs[e], xs[e], as_[e]
            gv = None
            if a_out is not None and (d_ao is not None or d_Bo is not None or need_dh):
                if d_Bo is not None:
                    torch.mm(vs[e].t(), g, out=outs["Bo"][e]).mul_(s)  # d B_out = s v^T g
                gv = torch.mm(g, Bo_t[e], out=bufs[2][:n]).mul_(s)  # d v = s g B_out^T
                if d_ao is not None:  # d A_out = d(a)^T d v
                    torch.mm(_drop_into(ab, ko, e, p, bufs[6]).t(), gv, out=outs["ao"][e])
            if d_wo is not None:
                torch.mm(ab.t(), g, out=outs["wo"][e])
            if d_bo is not None:
                torch.sum(g, 0, out=outs["bo"][e])
            if not need_dh:
                return
            da, dh = bufs[0][:n], bufs[1][:n]
            onednn.mm(g, wo_t[e], da)
            if gv is not None:
                if ko is None:
                    da.addmm_(gv, ao_t[e])
                else:  # d a += d(d v A_out^T): the mask and 1 / (1 - p) again
                    da.add_(_drop_into(torch.mm(gv, ao_t[e], out=bufs[6][:n]), ko, e, p, bufs[6]))
            gate, up = hs[e][:, :F], hs[e][:, F:]
            d_gate, d_up = dh[:, :F], dh[:, F:]
            if oai:
                swiglu_oai_backward_into(da, gate, up, d_gate, d_up, bufs[4][:n])
            else:
                torch.ops.aten.silu.out(gate, out=d_up).mul_(da)
                torch.ops.aten.silu_backward.grad_input(da.mul_(up), gate, grad_input=d_gate)
            if d_bi is not None:
                torch.sum(dh, 0, out=outs["bi"][e])
            if d_wi is not None:
                torch.mm(x.t(), dh, out=outs["wi"][e])
            gu = None
            if a_in is not None:
                if d_Bi is not None:
                    torch.mm(us[e].t(), dh, out=outs["Bi"][e]).mul_(s)  # d B_in = s u^T d h
                gu = torch.mm(dh, Bi_t[e], out=bufs[3][:n]).mul_(s)  # d u = s d h B_in^T
                if d_ai is not None:  # d A_in = d(x)^T d u
                    torch.mm(_drop_into(x, ki, e, p, bufs[5]).t(), gu, out=outs["ai"][e])
            if d_x is not None:
                onednn.mm(dh, wi_t[e], d_xs[e])
                if gu is not None:
                    if ki is None:
                        d_xs[e].addmm_(gu, ai_t[e])
                    else:
                        d_xs[e].add_(_drop_into(torch.mm(gu, ai_t[e], out=bufs[5][:n]), ki, e, p, bufs[5]))

        for_each_expert(sizes, expert, choose_workers(rows, w_in, sizes), scratch)
        return (*d, *tail)
