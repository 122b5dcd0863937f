"""Dtype rules shared by the router, the experts and the layer (single-device, no distributed)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def compute_dtype(t: Tensor) -> torch.dtype:
    """The dtype matmuls on ``t`` run in: the autocast dtype for fp32 input under autocast, else t's own."""
    if torch.is_autocast_enabled(t.device.type) and t.dtype == torch.float32:
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


def upcast_linear(x: Tensor, w: Tensor, dtype: torch.dtype) -> Tensor:
    """F.linear(x.to(dtype), w.to(dtype)), keeping x in its own (e.g. bf16) dtype for backward."""
    return _UpcastLinear.apply(x, w, dtype)


class _UpcastLinear(torch.autograd.Function):
    """F.linear(x.to(dtype), w.to(dtype)) that keeps x in its own (bf16) dtype for backward.

    The plain version saves the upcast [T, H] copy: with a bf16 residual stream (FSDP mixed precision)
    that is an fp32 activation twice the size of the layer input. Upcasting again in backward gives
    bitwise the same gradients (the upcast is exact)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, dtype: torch.dtype) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.dtype = dtype
        return F.linear(x.to(dtype), w.to(dtype))

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, w = ctx.saved_tensors
        grad = grad.to(ctx.dtype)
        dx = (grad @ w.to(ctx.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = (grad.t() @ x.to(ctx.dtype)).to(w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None
