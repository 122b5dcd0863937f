"""Triton kernels for the grouped experts: grouped GEMM (fwd, dX, dW), gather-in-load, fused activations.

Public API:
    grouped_mm(x, w, offs, gather_index=None, *, backend="auto", allow_tf32=False) -> y
    expert_mlp(rows, counts, w_in, w_out, activation, *, variant="fused", allow_tf32=False) -> y
    why_not_triton(rows, w_in, w_out) -> "" or the reason the Triton path cannot run
See docs/kernels.md for the design (tile scheduling, gather, fused epilogues, determinism).
"""
from ._common import LAUNCHES, SUPPORTED_DTYPES, interpret_mode
from .expert_mlp import expert_mlp, expert_mlp_ref, why_not_triton
from .grouped_mm import grouped_mm, grouped_mm_ref
from .grouped_mm_wgrad import grouped_mm_wgrad, grouped_mm_wgrad_ref
from .scatter_add import scatter_add_rows, scatter_add_rows_ref

__all__ = [
    "LAUNCHES", "SUPPORTED_DTYPES", "interpret_mode",
    "expert_mlp", "expert_mlp_ref", "why_not_triton",
    "grouped_mm", "grouped_mm_ref",
    "grouped_mm_wgrad", "grouped_mm_wgrad_ref",
    "scatter_add_rows", "scatter_add_rows_ref",
]
