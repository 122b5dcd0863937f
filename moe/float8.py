"""The "float8" expert backend: the experts' GEMMs in float8 e4m3 with rowwise scales (docs/float8.md).

What is quantized, and how (the recipe torchao calls float8 "rowwise", applied to the grouped experts):

    forward   y = x @ w[e]      x per row (amax over K), w[e] per output column (amax over K)
    dgrad     dx = dy @ w[e]^T  dy per row (amax over its K, the output width), w[e]^T per column
    wgrad     dw[e] = x_e^T dy_e   NOT quantized: the input dtype (bf16 / fp16 / fp32), like the
                                   other backends; a ragged reduction over each expert's tokens, which a
                                   rowwise recipe cannot scale along (the scales would run along K)

One scale per row (or column) of the fp8 operand: ``scale = amax / 448`` (448 = e4m3's largest finite
value) in float32, floored at float32's smallest normal number so an all-zero row gets a finite scale
and quantizes to zeros, and ``q = clamp(t / scale, -448, 448)`` cast to ``torch.float8_e4m3fn`` (round
to nearest even; the clamp is what keeps out-of-range values from becoming NaN). The GEMM then computes
``(q_a @ q_w) * scale_a[:, None] * scale_w[e][None, :]``, accumulating in float32, and returns the input
dtype. The activation between the two projections (moe.activations) runs in the input dtype.

Two paths, chosen per call (:func:`fast_path_why_not`):

    CUDA, sm90 / sm100, torch with a grouped fp8 GEMM   torch.nn.functional.scaled_grouped_mm (torch 2.10+)
                                                         or torch._scaled_grouped_mm (older), no host sync
    everywhere else (CPU, other GPUs)                    emulation: the same quantization (real e4m3 casts,
                                                         the same scales), then per-expert float32 GEMMs of
                                                         the e4m3 values and the scales applied after, as
                                                         the GPU kernel's epilogue does. For numerics and
                                                         tests, not speed: slower than the bf16 backends.

Rows past sum(counts) belong to no expert (moe.experts): output 0, gradient 0, as in every backend.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from moekit.moe.activations import get_activation
from moekit.moe.experts import counts_to_offs

FP8 = getattr(torch, "float8_e4m3fn", None)
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_SCALE = torch.finfo(torch.float32).tiny  # the floor of a scale: amax 0 gives q = 0, not 0/0
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# torch's fp8 grouped GEMM (aten/src/ATen/native/cuda/GroupedBlas.cpp, ScaledGroupMM.cu):
ALIGN = 16  # K and N of every fp8 operand multiples of 16
MAX_GROUPS = 1024  # "Can't process more than 1024 groups" (the sm90 CUTLASS kernel)
# Tensor-core fast accumulation on Hopper. torch's grouped fp8 kernel supported only this at first (a later
# torch also builds the slow-accumulation variant); torchao's MoE training path uses it for its grouped GEMMs.
FAST_ACCUM = True

_NAMES = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)


# ---------------------------------------------------------------------------------------------------
# Quantization
# ---------------------------------------------------------------------------------------------------


def rowwise_scale(t: Tensor, dim: int) -> Tensor:
    """float32 dequantization scales of ``t``: amax over ``dim`` / 448, floored at float32's tiny
    (``dim`` removed from the shape)."""
    amax = t.detach().abs().amax(dim=dim).to(torch.float32)
    return (amax / E4M3_MAX).clamp_min_(MIN_SCALE)


def quantize_with_scale(t: Tensor, scale: Tensor, dim: int) -> Tensor:
    """``clamp(t / scale, -448, 448)`` in float32 cast to float8 e4m3 (``scale`` has ``dim`` removed).
    The clamp saturates a value the scale cannot hold at +-448 instead of letting it become NaN."""
    scaled = t.detach().to(torch.float32) / scale.unsqueeze(dim)
    return scaled.clamp_(-E4M3_MAX, E4M3_MAX).to(FP8)


def quantize_rowwise(t: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """(e4m3 tensor of t's shape, float32 scales with ``dim`` removed): one scale per slice along ``dim``
    (the GEMM's reduction dim K), so ``t ~= dequantize(q, scale, dim)`` with at most 2^-4 relative error
    per element in e4m3's normal range (3 mantissa bits, round to nearest)."""
    scale = rowwise_scale(t, dim)
    return quantize_with_scale(t, scale, dim), scale


def dequantize(q: Tensor, scale: Tensor, dim: int) -> Tensor:
    """float32 ``q * scale`` (``scale`` broadcast along ``dim``)."""
    return q.to(torch.float32) * scale.unsqueeze(dim)


# ---------------------------------------------------------------------------------------------------
# Which path, and whether it can run
# ---------------------------------------------------------------------------------------------------


def _scaled_grouped_mm_api() -> str:
    """Name of torch's grouped fp8 GEMM in the running torch, "" when it has none."""
    if hasattr(F, "scaled_grouped_mm") and hasattr(F, "ScalingType"):
        return "torch.nn.functional.scaled_grouped_mm"
    if hasattr(torch, "_scaled_grouped_mm"):
        return "torch._scaled_grouped_mm"
    return ""


def fast_path_why_not(rows: Tensor, w_in: Tensor, w_out: Tensor) -> str:
    """"" when the CUDA fp8 grouped GEMM path runs these tensors, else why the emulation runs instead."""
    if rows.device.type != "cuda":
        return f"tensors on {rows.device.type}, not CUDA"
    if torch.version.hip:
        return "ROCm (its fp8 grouped GEMM takes float8_e4m3fnuz; not wired here)"
    if not _scaled_grouped_mm_api():
        return f"torch {torch.__version__} has no scaled_grouped_mm"
    if not hasattr(F, "grouped_mm"):  # the weight gradients
        return f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
    major, minor = torch.cuda.get_device_capability(rows.device)
    if major not in (9, 10):  # torch builds its grouped fp8 kernels for sm90 (Hopper) and sm100 only
        return f"sm_{major}{minor} GPU (torch's fp8 grouped GEMM runs on sm90 and sm100 only)"
    if w_in.shape[0] == 0:
        return "no local experts"
    if w_in.shape[0] >= MAX_GROUPS:
        return f"{w_in.shape[0]} local experts (torch's fp8 grouped GEMM takes fewer than {MAX_GROUPS})"
    return ""


def why_not_float8(rows: Tensor, w_in: Tensor, w_out: Tensor) -> str:
    """"" when the float8 backend runs these tensors (fast path or emulation), else the reason and fix."""
    if FP8 is None:
        return f"torch {torch.__version__} has no torch.float8_e4m3fn; upgrade torch"
    for name, t in (("rows", rows), ("w_in", w_in), ("w_out", w_out)):
        if t.dtype not in SUPPORTED_DTYPES:
            return (f"{name} has dtype {str(t.dtype).removeprefix('torch.')}; the float8 backend takes {_NAMES} "
                    "(cast the model, e.g. .to(torch.bfloat16), or use backend='loop' for float64)")
    if not rows.dtype == w_in.dtype == w_out.dtype:
        return f"rows, w_in, w_out must share one dtype, got {rows.dtype}, {w_in.dtype}, {w_out.dtype}"
    if not rows.device == w_in.device == w_out.device:
        return f"rows, w_in, w_out must be on one device, got {rows.device}, {w_in.device}, {w_out.device}"
    if fast_path_why_not(rows, w_in, w_out) == "":
        H, F_in, F_ = rows.shape[-1], w_in.shape[-1], w_out.shape[-2]
        if H % ALIGN or F_ % ALIGN or F_in % ALIGN:
            return (f"on the CUDA fp8 path the hidden and expert FFN sizes must be multiples of {ALIGN} "
                    f"(torch's fp8 grouped GEMM), got H={H}, F={F_}; choose sizes that are, or use "
                    "backend='torch'")
    return ""


def _check(rows: Tensor, w_in: Tensor, w_out: Tensor) -> None:
    reason = why_not_float8(rows, w_in, w_out)
    if reason:
        raise ValueError(f"expert backend 'float8': {reason}")


_warned_emulation: set[str] = set()


def _warn_emulation_on_gpu(reason: str) -> None:
    if reason not in _warned_emulation:
        _warned_emulation.add(reason)
        warnings.warn(f"expert backend 'float8' emulates fp8 here ({reason}): same numerics, float32 GEMMs, "
                      "slower than backend='torch' or 'triton'", stacklevel=3)


# ---------------------------------------------------------------------------------------------------
# The grouped fp8 GEMM: out[rows of e] = x[rows of e] @ b[e]
# ---------------------------------------------------------------------------------------------------


class Plan:
    """How one call runs: ``offs`` int32 [E] row ends (moe.experts.counts_to_offs); ``sizes`` the host
    list of rows per expert (emulation only: its loop needs them; the CUDA path makes no host sync)."""

    def __init__(self, offs: Tensor, sizes: list[int] | None):
        self.offs, self.sizes = offs, sizes

    @property
    def fast(self) -> bool:
        return self.sizes is None


def _col_major(q: Tensor) -> Tensor:
    """q [..., K, N] with its last two dims column-major (stride(-2) == 1): a copy unless it already is."""
    return q.transpose(-2, -1).contiguous().transpose(-2, -1)


def scaled_grouped_mm_args(a: Tensor, b: Tensor, offs: Tensor) -> dict:
    """The operands of torch's 2D x 3D rowwise-scaled grouped GEMM for ``a [N, K] @ b[e] [K, M]``:

        mat_a    e4m3 [N, K] row-major, scale_a float32 [N]      (one scale per row, amax over K)
        mat_b    e4m3 [E, K, M] column-major (stride(-2) == 1), scale_b float32 [E, M] contiguous
                 (one scale per expert and output column, amax over K)
        offs     int32 [E], cumulative row ends
    (torch/_meta_registrations.py ``_meta_grouped_mm_common``; GroupedBlas.cpp ``_scaled_grouped_mm_cuda``:
    K and M multiples of 16, bf16 output). ``b`` may be any view, e.g. w.transpose(-2, -1) for dgrad."""
    qa, sa = quantize_rowwise(a, dim=-1)
    qb, sb = quantize_rowwise(b, dim=-2)
    return {"mat_a": qa.contiguous(), "mat_b": _col_major(qb), "scale_a": sa.contiguous(),
            "scale_b": sb.contiguous(), "offs": offs.to(torch.int32).contiguous()}


def _call_scaled_grouped_mm(mat_a: Tensor, mat_b: Tensor, scale_a: Tensor, scale_b: Tensor, offs: Tensor) -> Tensor:
    """torch's grouped fp8 GEMM, bf16 out: out = (mat_a @ mat_b[e]) * scale_a[:, None] * scale_b[e] for
    each group's rows; rows past offs[-1] are left undefined (callers mask them)."""
    if hasattr(F, "scaled_grouped_mm") and hasattr(F, "ScalingType"):
        rowwise = F.ScalingType.RowWise
        return F.scaled_grouped_mm(mat_a, mat_b, scale_a, rowwise, scale_b, rowwise, offs=offs,
                                   output_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM)
    return torch._scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16,
                                    use_fast_accum=FAST_ACCUM)


def _owned_mask(n: int, offs: Tensor) -> Tensor:
    """[n, 1] bool: the row belongs to an expert (device ops only)."""
    return (torch.arange(n, device=offs.device) < offs[-1:].to(torch.int64))[:, None]


def _emulated_mm(a: Tensor, b: Tensor, sizes: list[int]) -> Tensor:
    """The same quantization as the CUDA path, per-expert float32 GEMMs of the e4m3 values (their products
    are exact in float32), the scales applied to the float32 result as the kernel's epilogue does."""
    n, m = a.shape[0], b.shape[-1]
    out = a.new_zeros(n, m)
    owned = sum(sizes)
    if owned == 0:
        return out
    qa, sa = quantize_rowwise(a[:owned], dim=-1)
    qb, sb = quantize_rowwise(b, dim=-2)
    start = 0
    for e, rows_e in enumerate(sizes):
        if rows_e:
            acc = qa[start:start + rows_e].to(torch.float32) @ qb[e].to(torch.float32)
            out[start:start + rows_e] = (acc * sa[start:start + rows_e, None] * sb[e][None, :]).to(a.dtype)
            start += rows_e
    return out


def fp8_grouped_mm(a: Tensor, b: Tensor, plan: Plan) -> Tensor:
    """``a [N, K] @ b[e] [K, M]`` per expert's row block in float8 e4m3 with rowwise scales, output in a's
    dtype (on the CUDA path via torch's bf16 output: fp32 / fp16 inputs get bf16-rounded results, a 2^-9
    rounding next to e4m3's 2^-4); rows past the last block are 0. Not differentiable by itself
    (:class:`Float8GroupedMM` is)."""
    if a.shape[0] == 0:
        return a.new_zeros(0, b.shape[-1])
    with torch.autocast(a.device.type, enabled=False):
        if not plan.fast:
            return _emulated_mm(a, b, plan.sizes)
        out = _call_scaled_grouped_mm(**scaled_grouped_mm_args(a, b, plan.offs))
        return torch.where(_owned_mask(a.shape[0], plan.offs), out, 0).to(a.dtype)


def grouped_wgrad(x: Tensor, dy: Tensor, plan: Plan, num_experts: int) -> Tensor:
    """[E, K, M]: x_e^T @ dy_e per expert, in the inputs' dtype (float32 accumulation), not quantized.
    Experts without rows get zeros; rows past the last block take no part."""
    k, m = x.shape[-1], dy.shape[-1]
    with torch.autocast(x.device.type, enabled=False):
        if plan.fast:  # torch's grouped GEMM, 2D x 2D ragged over the tokens: what torch's autograd does for grouped_mm
            if x.shape[0] == 0:
                return x.new_zeros(num_experts, k, m)
            return F.grouped_mm(x.contiguous().t(), dy.contiguous(), offs=plan.offs)
        dw = x.new_empty(num_experts, k, m)
        start = 0
        for e, rows_e in enumerate(plan.sizes):
            if rows_e:
                torch.mm(x[start:start + rows_e].t(), dy[start:start + rows_e], out=dw[e])
            else:
                dw[e].zero_()
            start += rows_e
        return dw


class Float8GroupedMM(torch.autograd.Function):
    """y = x @ w[e] per expert's rows in fp8 (forward and dgrad), the weight gradient in x's dtype.

    Saves x and w in their own dtype: the weight gradient needs x in high precision, and dgrad quantizes
    w along the other dim than the forward did. Double backward is not supported (once_differentiable)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, plan: Plan) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.plan = plan
        return fp8_grouped_mm(x, w, plan)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        x, w = ctx.saved_tensors
        plan = ctx.plan
        grad = grad.to(x.dtype)
        dx = fp8_grouped_mm(grad, w.transpose(-2, -1), plan) if ctx.needs_input_grad[0] else None
        dw = grouped_wgrad(x, grad, plan, w.shape[0]).to(w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def make_plan(rows: Tensor, counts: Tensor, w_in: Tensor, w_out: Tensor) -> Plan:
    """The path for this call: the CUDA fp8 GEMMs where they run, else the emulation (with a one-time
    warning on a GPU, where the emulation is a slow surprise)."""
    offs = counts_to_offs(counts, rows.shape[0])
    reason = fast_path_why_not(rows, w_in, w_out)
    if reason == "":
        return Plan(offs, None)
    if rows.device.type == "cuda":
        _warn_emulation_on_gpu(reason)
    ends = offs.tolist()  # D2H sync: the emulation loops over the experts' row blocks
    return Plan(offs, [end - start for start, end in zip([0] + ends[:-1], ends)])


def float8_mlp(rows: Tensor, counts: Tensor, w_in: Tensor, w_out: Tensor, activation: str) -> Tensor:
    """The "float8" backend: act(rows_e @ w_in[e]) @ w_out[e] per expert, both GEMMs (and their dgrads) in
    float8 e4m3 with rowwise scales, the activation and the weight gradients in the input dtype."""
    act = get_activation(activation)
    _check(rows, w_in, w_out)
    plan = make_plan(rows, counts, w_in, w_out)
    h = Float8GroupedMM.apply(rows, w_in, plan)  # [N, F_in], rows nobody owns 0
    return Float8GroupedMM.apply(act(h), w_out, plan)  # [N, H], rows nobody owns 0
