"""Shared plumbing for the Triton expert kernels: mode detection, validation, autotune wrapping.

Triton decides at *decoration* time whether ``@triton.jit`` builds a compiled ``JITFunction`` or an
``InterpretedFunction`` (``TRITON_INTERPRET=1``). Importing ``moe.kernels`` before the variable is set
(another test module, a notebook) would otherwise pin the wrong mode for the whole process, so
:class:`Kernel` re-decorates the raw Python function for the mode current at *launch* time. That is
also why the kernels call no ``@triton.jit`` helpers: a helper is resolved through module globals and
would keep its import-time mode. Shared index math is repeated inline in each kernel instead.
"""
from __future__ import annotations

import collections
from typing import Callable, Sequence

import torch
import triton

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SUPPORTED_NAMES = "float32/bfloat16/float16"

# Incremented by every launcher right before it launches: tests use it to prove the Triton path (not
# the torch fallback) ran. Keys are kernel names.
LAUNCHES: collections.Counter = collections.Counter()


def interpret_mode() -> bool:
    """True when Triton launches go to the CPU interpreter (reads TRITON_INTERPRET at call time)."""
    return bool(triton.knobs.runtime.interpret)


def why_not_triton_tensors(*tensors: torch.Tensor) -> str:
    """"" when the Triton kernels can run on these tensors, else a short reason naming the fix."""
    t0 = tensors[0]
    for t in tensors[1:]:
        if t.device != t0.device:
            return f"all tensors must be on one device, got {t0.device} and {t.device}"
        if t.dtype != t0.dtype:
            return f"all tensors must share one dtype, got {t0.dtype} and {t.dtype}"
    if t0.dtype not in SUPPORTED_DTYPES:
        return f"dtype {str(t0.dtype).removeprefix('torch.')} is not supported by the Triton kernels; use {_SUPPORTED_NAMES}"
    if t0.device.type == "cuda":
        if t0.dtype == torch.bfloat16 and torch.cuda.get_device_capability(t0.device) < (8, 0):
            return "bfloat16 Triton kernels need an sm80+ GPU; use float16 or float32 here"
        return ""
    if t0.device.type == "cpu":
        if interpret_mode():
            return ""
        return "Triton needs a CUDA device or TRITON_INTERPRET=1 (the slow CPU interpreter, for tests)"
    return f"Triton kernels run on CUDA tensors (or CPU under TRITON_INTERPRET=1), got device {t0.device.type}"


def check_triton_tensors(what: str, *tensors: torch.Tensor) -> None:
    reason = why_not_triton_tensors(*tensors)
    if reason:
        raise ValueError(f"{what}: {reason}")


def check_offs(offs: torch.Tensor, num_groups: int, device: torch.device, what: str) -> torch.Tensor:
    """Validate the cumulative-offsets tensor's metadata (not its values: that would need a sync)."""
    if not isinstance(offs, torch.Tensor):
        raise ValueError(f"{what}: offs must be a tensor of cumulative row ends, got {type(offs).__name__}")
    if offs.dim() != 1 or offs.shape[0] != num_groups:
        raise ValueError(f"{what}: offs must be [E={num_groups}] cumulative row ends, got shape {tuple(offs.shape)}")
    if offs.dtype.is_floating_point or offs.dtype.is_complex or offs.dtype == torch.bool:
        raise ValueError(f"{what}: offs must be an integer tensor (int32), got {offs.dtype}")
    if offs.device != device:
        raise ValueError(f"{what}: offs is on {offs.device} but the operands are on {device}; move it there")
    # The kernels read int32 offsets; converting int64 ones here is a tiny device op, not a sync.
    return offs.to(torch.int32).contiguous()


def dot_precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    """fp32 defaults to exact-ish IEEE products so results match a float64 reference tightly."""
    return "tf32" if (dtype == torch.float32 and allow_tf32) else "ieee"


def upcast_for_interpreter(dtype: torch.dtype) -> bool:
    # The Triton 3.9 interpreter feeds bf16 storage (uint16 bit patterns) straight to np.matmul, which
    # multiplies the bit patterns as integers. Upcasting bf16 operands to fp32 (exact) before tl.dot in
    # interpreter mode only gives the product a GPU computes with fp32 accumulation.
    return dtype == torch.bfloat16 and interpret_mode()


def prune_by_smem(budget_bytes: int, b_tiles: int = 1, a_name: str = "BLOCK_M", b_name: str = "BLOCK_N",
                  k_name: str = "BLOCK_K", elem_arg: str = "X") -> Callable:
    """An ``early_config_prune`` dropping configs whose pipelined tiles overflow shared memory.

    Stage footprint = (A tile + b_tiles * B tile) * element size; fp32 inputs double it, so the bf16
    configs with 4 stages would not fit for fp32 and the autotuner should not waste time on them.
    """

    def prune(configs, named_args, **kwargs):
        elem = named_args[elem_arg].element_size()
        kept = []
        for c in configs:
            kw = c.kwargs
            stage = (kw[a_name] * kw[k_name] + b_tiles * kw[k_name] * kw[b_name]) * elem
            if stage * c.num_stages <= budget_bytes:
                kept.append(c)
        return kept or [min(configs, key=lambda c: c.num_stages)]

    return prune


class Kernel:
    """A ``@triton.jit`` kernel plus its autotune configs, rebuilt for the launch-time Triton mode.

    GPU: ``triton.autotune`` over ``configs`` keyed on ``key``. Interpreter: the single small
    ``interpret_config`` (autotuning there would only multiply the run time of the tests).
    """

    def __init__(self, jitted, configs: Sequence[triton.Config], interpret_config: triton.Config,
                 key: Sequence[str], prune: Callable | None = None):
        self.fn = jitted.fn  # the raw Python function, for re-decoration and offline compile checks
        self.name = self.fn.__name__
        self.configs = list(configs)
        self.interpret_config = interpret_config
        self.key = list(key)
        self.prune = prune
        self._built: dict[bool, object] = {}

    def _build(self, interpret: bool):
        jitted = triton.jit(self.fn)  # decorates for the current mode (see the module docstring)
        if interpret:
            return triton.autotune(configs=[self.interpret_config], key=self.key)(jitted)
        prune = {"early_config_prune": self.prune} if self.prune else None
        return triton.autotune(configs=self.configs, key=self.key, prune_configs_by=prune)(jitted)

    def __getitem__(self, grid):
        mode = interpret_mode()
        if mode not in self._built:
            self._built[mode] = self._build(mode)
        LAUNCHES[self.name] += 1
        return self._built[mode][grid]


def cfg(bm: int, bn: int, bk: int, warps: int, stages: int, group: int = 8, **extra) -> triton.Config:
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, **extra),
                         num_warps=warps, num_stages=stages)
