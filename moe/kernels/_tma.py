"""The TMA (tensor-memory accelerator) variants' shared pieces: the MOEKIT_TMA switch, when descriptors can read
an operand, the launch-with-fallback, the allocator device-side descriptors need, and the descriptor K loop.

The variants (moe.kernels.grouped_mm.GEMM_TMA, grouped_mm_wgrad.WGRAD_TMA, expert_mlp.MLP_TMA) each give their
pointer kernel's bits; docs/kernels.md describes them. On by default on CUDA sm90+ ("auto"), since the first GPU
measurement (session 17: forward 1.07-1.18x the pointer kernels, training +2-5% tokens/s on an H100).
"""
from __future__ import annotations

import os
import warnings
from typing import Callable

import torch
import triton
import triton.language as tl

from ._common import BUILD_ERRORS, build_failure, dot_acc

# The TMA kernel variants' switches (moe.kernels.grouped_mm.GEMM_TMA, moe.kernels.grouped_mm_wgrad.WGRAD_TMA)
# start from this environment variable, so a benchmark or a training run can flip them without code:
# MOEKIT_TMA=never|always. Unset: "auto", the variants on CUDA devices (where why_not_tma_* then asks for sm90+,
# bf16 / fp16 and aligned operands) and the pointer kernels in the CPU interpreter ("always" runs the variants
# there too, for their tests).
TMA_ENV = "MOEKIT_TMA"
TMA_MODES = ("auto", "never", "always")


def tma_default() -> str:
    return os.environ.get(TMA_ENV, "").strip().lower() or "auto"


def tma_wanted(mode: str, device: torch.device) -> bool:
    """Whether a switch in ``mode`` asks for the TMA variant on ``device`` (whether the variant can run there is
    why_not_tma_*'s question)."""
    return mode == "always" or (mode == "auto" and device.type == "cuda")


def check_tma_mode(mode: str, name: str) -> None:
    """A ValueError naming the switch (and the environment variable, where the bad value came from it)."""
    if mode in TMA_MODES:
        return
    env = os.environ.get(TMA_ENV)
    hint = f" (it came from {TMA_ENV}={env!r}: set that to auto, never or always)" if env is not None and \
        env.strip().lower() == mode else ""
    raise ValueError(f"moe.kernels.{name}={mode!r}; use one of {', '.join(TMA_MODES)}{hint}")


def why_not_tma_tensors(**tensors: torch.Tensor) -> str:
    """"" when tensor-memory (TMA) descriptors can read every named 2-D operand, else why not: a Triton with
    device-side descriptors, unit inner strides, 16-byte aligned rows and bases, CUDA sm90+ (or the
    interpreter, which models the descriptors' bounds)."""
    if not hasattr(tl, "make_tensor_descriptor") or not hasattr(triton, "set_allocator"):
        return f"triton {triton.__version__} has no tl.make_tensor_descriptor / triton.set_allocator"
    for name, t in tensors.items():
        if t.stride(-1) != 1 or any((s * t.element_size()) % 16 for s in t.stride()[:-1]) or t.data_ptr() % 16:
            return f"{name} needs a unit inner stride and 16-byte aligned rows, got strides {t.stride()}"
    first = next(iter(tensors.values()))
    if first.device.type == "cuda" and _capability(first.device) < (9, 0):
        return "TMA needs sm90 or newer"
    return ""


_CAPABILITY: dict = {}  # device -> compute capability: asked once, not on every GEMM launch


def _capability(device: torch.device) -> tuple[int, int]:
    if device not in _CAPABILITY:
        _CAPABILITY[device] = torch.cuda.get_device_capability(device)
    return _CAPABILITY[device]


def why_not_variant(reason: str, failures: list[str], gather_index=None) -> str:
    """A variant's why_not_tma from its operand check's ``reason``: a gathered x first (the descriptors read
    contiguous row blocks), then the operands, then a build failure remembered by try_tma_launch."""
    if gather_index is not None:
        return "a gathered x (the descriptors read contiguous row blocks)"
    if reason or not failures:
        return reason
    return f"the TMA kernel failed to build here ({failures[0]})"


def why_not_tma_gemm(**tensors: torch.Tensor) -> str:
    """why_not_tma_tensors for the forward-type TMA kernels (grouped_mm's and the fused expert MLP's), which
    also need 16-bit data: ptxas (sm90) spills 0.4-20 KB a thread for the fp32 (IEEE, FMA) dots on
    descriptor tiles."""
    dtype = next(iter(tensors.values())).dtype
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{dtype} operands (the TMA variants are for bfloat16 / float16)"
    return why_not_tma_tensors(**tensors)


def try_tma_launch(launch: Callable[[], None], failures: list[str], what: str, stacklevel: int = 4) -> bool:
    """Run a TMA variant's ``launch()``; True when it ran. A Triton that cannot build it (BUILD_ERRORS: no
    device-side descriptors, a compile error in that version) is remembered in ``failures`` (the caller's
    why_not_tma reports it from then on: no second try) and warned about once; False, so the caller runs
    its pointer kernel instead."""
    try:
        launch()
        return True
    except (*BUILD_ERRORS, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and not isinstance(exc, BUILD_ERRORS) and "PassManager" not in str(exc):
            raise  # a failing MLIR pass is a build failure too ("PassManager::run failed"); anything else is not
        failures.append(build_failure(exc))
        warnings.warn(f"{what}: the TMA kernel failed to build here ({failures[-1]}); the pointer kernel runs "
                      "instead", stacklevel=stacklevel)
        return False


_ALLOCATORS: dict = {}  # device -> its allocator function (one per device, so the identity is stable)


def set_tma_allocator(device: torch.device) -> None:
    """Device-side descriptors need a global scratch buffer from Triton's allocator hook.

    Triton keeps the allocator in a ContextVar, which every thread sees afresh: one set in the main thread
    is absent from autograd's device thread, where the backward kernels launch ("Kernel requires a runtime
    memory allocation, but no allocator was set", the first GPU run of the TMA variants). So it is set on
    every launch, in the launching thread (a ContextVar set costs far less than the launch)."""
    alloc = _ALLOCATORS.get(device)
    if alloc is None:
        def alloc(size: int, alignment: int, stream):
            return torch.empty(size, dtype=torch.int8, device=device)
        _ALLOCATORS[device] = alloc
    triton.set_allocator(alloc)


@triton.jit
def tile_mm_tma(A, start, rows, stride_am, m0, B, stride_br, n0, N_B, K, B2_COL,
                B_TRANS: tl.constexpr, TWO_B: tl.constexpr, PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """tile_mm through tensor-memory (TMA) descriptors: (acc, acc2) fp32 [BLOCK_M, BLOCK_N] for the tile at
    rows m0: of one expert's block of A and columns n0: of its B, the same K loop and reduction order.

    A: a descriptor over the expert's ``rows`` rows from row ``start`` (unit inner stride), so the hardware
    zero-fills rows past the expert's end and the k tail. B: one expert's matrix as stored, [K, N_B] with row
    stride ``stride_br``, or with B_TRANS its stored [N_B, K] (a transposed view: the tile is transposed in
    registers). TWO_B: acc2 from the columns B2_COL + n0: of the same B (SwiGLU's up half), A read once.
    Columns past n0's strip that still lie inside N_B (the gate tile's last strip reaching into the up half)
    are computed and must be masked by the caller's store, as its own column bound does anyway."""
    a_desc = tl.make_tensor_descriptor(A + start.to(tl.int64) * stride_am, shape=[rows, K], strides=[stride_am, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    if B_TRANS:
        b_desc = tl.make_tensor_descriptor(B, shape=[N_B, K], strides=[stride_br, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(B, shape=[K, N_B], strides=[stride_br, 1], block_shape=[BLOCK_K, BLOCK_N])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([m0, k0])
        if B_TRANS:
            b = tl.trans(b_desc.load([n0, k0]))
        else:
            b = b_desc.load([k0, n0])
        acc = dot_acc(a, b, acc, PRECISION, INTERP_BF16)
        if TWO_B:
            if B_TRANS:
                b2 = tl.trans(b_desc.load([B2_COL + n0, k0]))
            else:
                b2 = b_desc.load([k0, B2_COL + n0])
            acc2 = dot_acc(a, b2, acc2, PRECISION, INTERP_BF16)
    return acc, acc2


@triton.jit
def tile_mm_tma_b(A, a_rows, a_mask, stride_am, stride_ak, B, stride_br, n0, N_B, K, B2_COL,
                  TWO_B: tl.constexpr, PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """tile_mm_tma with A through pointers instead: rows ``a_rows`` of A (gathered, any order; ``a_mask`` off reads
    zeros), B = one expert's [K, N_B] matrix as stored through a descriptor. For an A the descriptors cannot read (a
    gather), the weights still come through TMA. The same K loop and reduction order as tile_mm and tile_mm_tma, so
    the same bits; columns past n0's strip inside N_B are computed, and the caller's store masks them."""
    b_desc = tl.make_tensor_descriptor(B, shape=[K, N_B], strides=[stride_br, 1], block_shape=[BLOCK_K, BLOCK_N])
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=a_mask[:, None] & (offs_k < K - k0)[None, :], other=0.0)
        acc = dot_acc(a, b_desc.load([k0, n0]), acc, PRECISION, INTERP_BF16)
        if TWO_B:
            acc2 = dot_acc(a, b_desc.load([k0, B2_COL + n0]), acc2, PRECISION, INTERP_BF16)
        a_ptrs += BLOCK_K * stride_ak
    return acc, acc2
