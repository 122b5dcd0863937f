"""Triton kernels for the grouped experts: grouped GEMM (fwd, dX, dW), gather-in-load, fused activations.

Public API:
    grouped_mm(x, w, offs, gather_index=None, *, backend="auto", allow_tf32=False) -> y
    expert_mlp(rows, counts, w_in, w_out, activation, *, variant="fused", allow_tf32=False) -> y
    why_not_triton(rows, w_in, w_out) -> "" or the reason the Triton path cannot run
    combine_rows(rows, slot_row, weights, num_tokens, top_k) -> out       (moe.dispatch's combine, CUDA)
    combine_rows_backward(grad_out, rows, weights, slot_row) -> (grad_rows, grad_weights)
    cross_entropy_rows(logits, targets, scale, *, need_grad) -> loss rows   (models.loss's fused step, CUDA;
        with need_grad the gradient (softmax - onehot) * scale is written over the logits in place)
    why_not_cross_entropy(device, dtype) -> "" or the reason cross_entropy_rows cannot run there
    delta_scan(U0, W, q_start, scores, k_end, carry, state, final_state) -> (o, final state)
        (models.delta_rule's scan over the chunks of the gated delta rule, CUDA; differentiable, float32)
    why_not_delta_scan(device) -> "" or the reason delta_scan cannot run there
    environment_problem() -> "" or what is wrong with MOEKIT_AUTOTUNE / MOEKIT_TMA / MOEKIT_KERNEL_CONFIGS
See docs/kernels.md for the design (tile scheduling, gather, fused epilogues, determinism).
"""
from ._common import KERNELS, LAUNCHES, SUPPORTED_DTYPES, autotune_mode, interpret_mode, tuned_configs
from ._tma import TMA_ENV, TMA_MODES, tma_default
from .combine import combine_rows, combine_rows_backward, combine_rows_backward_ref, combine_rows_ref
from .cross_entropy import cross_entropy_rows, cross_entropy_rows_ref, why_not_cross_entropy
from .delta_scan import delta_scan, delta_scan_ref, why_not_delta_scan
from .expert_mlp import expert_mlp, expert_mlp_ref, why_not_triton
from .grouped_mm import grouped_mm, grouped_mm_ref
from .grouped_mm_wgrad import grouped_mm_wgrad, grouped_mm_wgrad_ref
from .scatter_add import scatter_add_rows, scatter_add_rows_ref

__all__ = [
    "LAUNCHES", "SUPPORTED_DTYPES", "environment_problem", "interpret_mode",
    "combine_rows", "combine_rows_ref", "combine_rows_backward", "combine_rows_backward_ref",
    "cross_entropy_rows", "cross_entropy_rows_ref", "why_not_cross_entropy",
    "delta_scan", "delta_scan_ref", "why_not_delta_scan",
    "expert_mlp", "expert_mlp_ref", "why_not_triton",
    "grouped_mm", "grouped_mm_ref",
    "grouped_mm_wgrad", "grouped_mm_wgrad_ref",
    "scatter_add_rows", "scatter_add_rows_ref",
]


def environment_problem() -> str:
    """"" or what is wrong with the kernels' environment variables (MOEKIT_AUTOTUNE, MOEKIT_TMA,
    MOEKIT_KERNEL_CONFIGS), so a trainer refuses them at start-up instead of at its first expert GEMM."""
    import os

    if tma_default() not in TMA_MODES:
        return (f"{TMA_ENV}={os.environ.get(TMA_ENV)!r} is invalid; use one of {list(TMA_MODES)} (auto, the default: "
                "the TMA kernel variants on CUDA sm90+; always: also in the interpreter; never: the pointer kernels) "
                "or unset it")
    try:
        autotune_mode()
        if KERNELS:
            tuned_configs(next(iter(KERNELS)))  # reads and checks the whole file
    except ValueError as exc:
        return str(exc)
    return ""
