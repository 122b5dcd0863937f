"""Triton kernels for the grouped experts: grouped GEMM (fwd, dX, dW), gather-in-load, fused activations.

Public API:
    grouped_mm(x, w, offs, gather_index=None, *, backend="auto", allow_tf32=False) -> y
    expert_mlp(rows, counts, w_in, w_out, activation, *, variant="fused", allow_tf32=False) -> y
    why_not_triton(rows, w_in, w_out) -> "" or the reason the Triton path cannot run
    combine_rows(rows, slot_row, weights, num_tokens, top_k) -> out       (moe.dispatch's combine, CUDA)
    combine_rows_backward(grad_out, rows, weights, slot_row) -> (grad_rows, grad_weights)
    environment_problem() -> "" or what is wrong with MOEKIT_AUTOTUNE / MOEKIT_TMA / MOEKIT_KERNEL_CONFIGS
See docs/kernels.md for the design (tile scheduling, gather, fused epilogues, determinism).
"""
from ._common import LAUNCHES, SUPPORTED_DTYPES, environment_problem, interpret_mode
from .combine import combine_rows, combine_rows_backward, combine_rows_backward_ref, combine_rows_ref
from .expert_mlp import expert_mlp, expert_mlp_ref, why_not_triton
from .grouped_mm import grouped_mm, grouped_mm_ref
from .grouped_mm_wgrad import grouped_mm_wgrad, grouped_mm_wgrad_ref
from .scatter_add import scatter_add_rows, scatter_add_rows_ref

__all__ = [
    "LAUNCHES", "SUPPORTED_DTYPES", "environment_problem", "interpret_mode",
    "combine_rows", "combine_rows_ref", "combine_rows_backward", "combine_rows_backward_ref",
    "expert_mlp", "expert_mlp_ref", "why_not_triton",
    "grouped_mm", "grouped_mm_ref",
    "grouped_mm_wgrad", "grouped_mm_wgrad_ref",
    "scatter_add_rows", "scatter_add_rows_ref",
]
