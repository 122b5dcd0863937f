"""Dtype rules shared by the router, the experts and the layer (single-device, no distributed)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moekit.moe.kernel_choice import mode_from_env, mode_problem


def compute_dtype(t: Tensor) -> torch.dtype:
    """The dtype matmuls on ``t`` run in: the autocast dtype for fp32 input under autocast, else t's own."""
    if torch.is_autocast_enabled(t.device.type) and t.dtype == torch.float32:
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


# How the router's fp32 logits of a bf16 input are computed (upcast_linear):
#   "auto"    on CUDA by bf16 tensor-core GEMMs on split operands (_SplitLinear), elsewhere by an fp32 GEMM;
#   "never"   always the fp32 GEMM (F.linear on upcast copies: on a GPU the slow non-tensor-core path);
#   "always"  the split form everywhere (tests: off CUDA its bf16 products are summed by an fp32 matmul).
# It starts as the environment variable MOEKIT_SPLIT_ROUTER says (a benchmark's A / B in separate processes).
SPLIT_ROUTER_ENV = "MOEKIT_SPLIT_ROUTER"
SPLIT_ROUTER = mode_from_env(SPLIT_ROUTER_ENV, "auto")


def split_router_problem() -> str:
    """"" or what is wrong with SPLIT_ROUTER (set from MOEKIT_SPLIT_ROUTER): the trainer checks it at start-up."""
    return mode_problem("moe.precision.SPLIT_ROUTER", SPLIT_ROUTER, SPLIT_ROUTER_ENV)


def upcast_linear(x: Tensor, w: Tensor, dtype: torch.dtype) -> Tensor:
    """F.linear(x.to(dtype), w.to(dtype)) [T, E], keeping x in its own (e.g. bf16) dtype for backward. For a
    bf16 x and an fp32 result, on CUDA (SPLIT_ROUTER), by bf16 GEMMs with fp32 accumulation (_SplitLinear)."""
    if split_applies(x, w, dtype):
        return _SplitLinear.apply(x, w)
    return _UpcastLinear.apply(x, w, dtype)


def split_applies(x: Tensor, w: Tensor, dtype: torch.dtype) -> bool:
    """Whether upcast_linear(x, w, dtype) takes the split bf16 form: a plain (not distributed) bf16 x [T, H]
    and a bf16 or fp32 w, an fp32 result, and SPLIT_ROUTER "always", or "auto" with x on CUDA."""
    if split_router_problem():
        raise ValueError(split_router_problem())
    if SPLIT_ROUTER == "never" or (SPLIT_ROUTER == "auto" and x.device.type != "cuda"):
        return False
    return (dtype == torch.float32 and x.dtype == torch.bfloat16 and w.dtype in (torch.bfloat16, torch.float32)
            and x.dim() == 2 and w.dim() == 2 and not _distributed(x) and not _distributed(w))


def _distributed(t: Tensor) -> bool:
    """Whether ``t`` is a DTensor (tensor parallelism's router weight: its mm would need a sharding rule), by its
    device mesh: moe/ is single-device code and imports nothing of torch.distributed (tests/test_packaging.py)."""
    return hasattr(t, "device_mesh")


def _split(t: Tensor) -> tuple[Tensor, Tensor | None]:
    """(hi, lo) bf16 with hi + lo = t to about 16 significant bits (fp32 t); a bf16 t is (t, None), exactly.

    hi is t with its low 16 bits cleared (a bf16 value exactly), lo the rest rounded to bf16. Not hi = t.to(bf16)
    and lo = t - hi.float(): inside a torch.compile graph inductor may keep hi.float() in fp32 without the rounding
    (its emulate_precision_casts is off by default), which makes lo zero and the split a plain bf16 GEMM (measured:
    1.7e-3 relative error compiled, against 2.5e-6 eager). Masking bits is exact whoever runs it."""
    if t.dtype == torch.bfloat16:
        return t, None
    hi = (t.float().contiguous().view(torch.int32) & -65536).view(torch.float32)  # 0xFFFF0000: sign, exponent, 7 bits
    return hi.to(torch.bfloat16), (t - hi).to(torch.bfloat16)


def _mm32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b of two bf16 matrices in fp32: every product exact, summed in fp32 (tensor cores on CUDA)."""
    if a.device.type == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()  # elsewhere torch has no mm(out_dtype): the same products, summed by fp32 GEMM


class _SplitLinear(torch.autograd.Function):
    """x [T, H] (bf16) @ w [E, H]^T in fp32 from bf16 GEMMs: the router's logits on tensor cores.

    A bf16 x times a bf16 w is exact in fp32, so one GEMM with fp32 accumulation gives what the fp32 GEMM of
    the upcast copies gives, up to the order of the sum (FSDP's bf16 parameters). An fp32 w is split into
    bf16 hi + lo (``_split``: 16 of its 24 significant bits): x @ hi^T + x @ lo^T, relative error ~2^-17 per
    term where fp32 has 2^-24, two GEMMs instead of one fp32 GEMM 10-20x slower on a GPU's SIMT units (the
    H200 profile: the fp32 router GEMMs were 1.5-2 ms of a 17 ms MoE layer at E 128). Backward splits the
    fp32 gradient g [T, E] the same way: dx = g_hi w_hi + g_lo w_hi + g_hi w_lo (g_lo w_lo, ~2^-16 of the
    rest, dropped), dw = g_hi^T x + g_lo^T x. Routing decisions can differ from the fp32 GEMM's only
    where two logits agree to ~1e-5, as they can between any two fp32 GEMMs summing in different orders."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        w_hi, w_lo = _split(w)
        out = _mm32(x, w_hi.t())
        if w_lo is not None:
            out = out + _mm32(x, w_lo.t())
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, w = ctx.saved_tensors
        g_hi, g_lo = _split(grad.float())
        dx = dw = None
        if ctx.needs_input_grad[0]:
            w_hi, w_lo = _split(w)
            dx = _mm32(g_hi, w_hi)
            if g_lo is not None:
                dx = dx + _mm32(g_lo, w_hi)
            if w_lo is not None:
                dx = dx + _mm32(g_hi, w_lo)
            dx = dx.to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = _mm32(g_hi.t(), x)
            if g_lo is not None:
                dw = dw + _mm32(g_lo.t(), x)
            dw = dw.to(w.dtype)
        return dx, dw


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
