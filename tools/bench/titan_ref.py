"""A reference MoE layer built the way torchtitan builds its own, written here for the benchmarks.

Shape legend: T tokens, H hidden, E experts, k slots per token, N = T * k routed rows, F expert width.

    x [T, H] --gate (fp32)--> scores [T, E] --top-k, renormalise--> (top_w, top_i) [T, k]
      --argsort(top_i) (stable)--> order [N];  token of row r = order[r] // k
      --x[token]-------------------> rows [N, H]      expert-major: the torch index gather
      --grouped_mm, SwiGLU, grouped_mm--> out [N, H]  offsets from a histogram of top_i (no host sync)
      --out * top_w[order], scatter_add onto token--> y [T, H]

It shares moekit's parameters (router.weight [E, H], experts.w_in [E, H, 2F], experts.w_out [E, F, H])
with the MoELayer it is built from, so both compute the same function on the same weights: the
benchmark times the *recipe* (torch's own grouped matmul plus plain torch index permute /
scatter_add unpermute), not a different model. Routing runs in fp32 like moekit's router, which
keeps the two outputs comparable to rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class TitanStyleMoE(nn.Module):
    """Dropless top-k softmax MoE (Mixtral routing, SwiGLU experts) in plain torch ops."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        if layer.experts.activation != "swiglu":
            raise ValueError(f"the reference implements SwiGLU experts only, got {layer.experts.activation!r}")
        router = layer.router
        if getattr(router, "score", "softmax") != "softmax" or router.capacity_factor is not None:
            raise ValueError("the reference implements dropless softmax top-k routing only")
        self.gate = router.weight  # shared Parameter objects: gradients land on the MoELayer's weights
        self.w_in, self.w_out = layer.experts.w_in, layer.experts.w_out
        self.top_k, self.num_experts = router.top_k, router.num_experts
        self.normalize = getattr(router, "normalize", True)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(top_w [T, k] fp32, top_i [T, k] int64); the gate runs in fp32 outside autocast."""
        with torch.autocast(x.device.type, enabled=False):
            scores = F.linear(x.float(), self.gate.float()).softmax(dim=-1)  # [T, E]
        top_w, top_i = scores.topk(self.top_k, dim=-1)  # [T, k]
        if self.normalize:
            top_w = top_w / top_w.sum(-1, keepdim=True).clamp_min(1e-20)
        return top_w, top_i

    def permute(self, x: Tensor, top_i: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(rows [N, H] expert-major, order [N] slot of each row, counts [E] float) — no host sync:
        histc rather than bincount, whose CUDA version reads the maximum back to size its output."""
        flat = top_i.reshape(-1)  # [N]
        counts = torch.histc(flat.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)  # [E]
        order = torch.argsort(flat, stable=True)  # [N]
        rows = x.index_select(0, order // self.top_k)  # [N, H]
        return rows, order, counts

    def experts(self, rows: Tensor, counts: Tensor) -> Tensor:
        offs = counts.cumsum(0).to(torch.int32)  # [E] cumulative row ends, grouped_mm's convention
        w_in, w_out = self.w_in.to(rows.dtype), self.w_out.to(rows.dtype)
        gate, up = F.grouped_mm(rows, w_in, offs=offs).chunk(2, dim=-1)  # [N, F] each
        return F.grouped_mm(F.silu(gate) * up, w_out, offs=offs)  # [N, H]

    def unpermute(self, out: Tensor, order: Tensor, top_w: Tensor, num_tokens: int) -> Tensor:
        """Scale each row by its slot's weight (in fp32) and scatter_add it onto its token."""
        w_row = top_w.reshape(-1).index_select(0, order)  # [N]
        scaled = (out.float() * w_row[:, None]).to(out.dtype)  # [N, H]
        index = (order // self.top_k)[:, None].expand(-1, out.shape[-1])  # [N, H]
        return out.new_zeros(num_tokens, out.shape[-1]).scatter_add(0, index, scaled)  # [T, H]

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, H]
        top_w, top_i = self.route(x)
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        rows, order, counts = self.permute(x, top_i)
        y = self.unpermute(self.experts(rows, counts), order, top_w, x.shape[0])
        return y.view(shape)
