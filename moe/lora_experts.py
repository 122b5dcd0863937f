"""Routed experts with LoRA adapters, computed factored: the merged weights ``w + s A B`` are never formed.

Per expert e, over its contiguous row block x_e [n_e, H] (moe.experts' shape legend), with s = alpha / rank:

    h_e = x_e @ w_in[e]  + s (x_e @ lora_a_in[e])  @ lora_b_in[e]   (+ b_in[e])      [n_e, F_in]
    y_e = act(h_e) @ w_out[e] + s (act(h_e) @ lora_a_out[e]) @ lora_b_out[e]  (+ b_out[e])   [n_e, H]

a side without adapters (``GroupedExperts.add_lora(sides=)``) is the plain projection. Why factored: with the base
stacks frozen, autograd computes no weight gradient for them (the largest GEMMs of a full fine-tune's backward),
only the input gradients through them and the small [r]-wide adapter products; merging per step would instead
need the full [E, H, F] weight gradient to reach A and B, and keep a merged copy of every layer's experts for
backward.

Two ways to run it, the same math:
 - ``grouped``: torch.nn.functional.grouped_mm over all experts per product (no host sync), where it runs
   (shapes 16-byte aligned, rank included): the GPU's choice, and the CPU's when the layer asks for the "torch"
   backend;
 - ``loop``: one block per expert (torch.split, then matmuls), the reference: CPU, and anything grouped_mm cannot
   take.
Rows past sum(counts) belong to no expert: output 0, gradient 0 (as every expert backend). The float8 backend has
no adapter path: experts named to it with adapters are refused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moekit.moe.activations import get_activation


def lora_path(rows: Tensor, named: dict[str, Tensor], backend: str) -> str:
    """"grouped" or "loop" (module docstring) for these tensors and the layer's expert backend name."""
    from moekit.moe.experts import _grouped_mm_why_not

    if backend == "float8":
        raise ValueError("expert backend 'float8' has no LoRA adapter path; use 'auto' (or 'torch' / 'loop') for "
                         "experts with adapters")
    if backend == "loop" or (backend != "torch" and rows.device.type != "cuda"):
        return "loop"
    probe = [named["w_in"], named["w_out"]] + [t for k, t in named.items() if k.startswith("lora_")]
    widths_ok = all(_grouped_mm_why_not(rows, w, w) == "" for w in probe)
    return "grouped" if widths_ok else "loop"


def lora_mlp(rows: Tensor, counts: Tensor, named: dict[str, Tensor], activation: str, scale: float,
             backend: str = "auto") -> Tensor:
    """rows [N, H] expert-major, counts [E] -> [N, H] (module docstring). ``named``: the local expert tensors by
    name (w_in, w_out, optional b_in / b_out, the lora_* adapters present), all in rows' dtype."""
    from moekit.moe.experts import counts_to_offs

    offs = counts_to_offs(counts, rows.shape[0])
    if lora_path(rows, named, backend) == "grouped":
        return _grouped(rows, offs, named, activation, scale)
    return _loop(rows, offs, named, activation, scale)


def _grouped(rows: Tensor, offs: Tensor, named: dict[str, Tensor], activation: str, scale: float) -> Tensor:
    from moekit.moe.experts import add_expert_bias

    owned = None
    if rows.shape[0] > 0:  # grouped_mm leaves rows past offs[-1] undefined, forward and backward: mask them
        owned = (torch.arange(rows.shape[0], device=rows.device) < offs[-1])[:, None]
        rows = torch.where(owned, rows, 0)

    def project(x: Tensor, side: str) -> Tensor:
        y = F.grouped_mm(x, named[f"w_{side}"], offs=offs)
        a = named.get(f"lora_a_{side}")
        if a is not None:
            y = y + F.grouped_mm(F.grouped_mm(x, a, offs=offs), named[f"lora_b_{side}"], offs=offs) * scale
        return add_expert_bias(y, named.get(f"b_{side}"), offs)

    out = project(get_activation(activation)(project(rows, "in")), "out")
    return out if owned is None else torch.where(owned, out, 0)


def _loop(rows: Tensor, offs: Tensor, named: dict[str, Tensor], activation: str, scale: float) -> Tensor:
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
                y = y + ((x @ a[e]) @ named[f"lora_b_{side}"][e]) * scale
            b = named.get(f"b_{side}")
            return y if b is None else y + b[e]

        outs.append(project(act(project(x, "in")), "out"))
        start = end
    tail = rows.shape[0] - start
    if tail or not outs:
        outs.append(rows.new_zeros(tail, named["w_out"].shape[-1]))
    return torch.cat(outs) if len(outs) > 1 else outs[0]
