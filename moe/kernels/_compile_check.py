"""Compile every kernel config for a GPU target without a GPU (Triton's bundled ptxas), to catch
kernels that pass in the interpreter but do not lower to real code (layouts, types, shared memory).

    python -m moe.kernels._compile_check            # all configs, bf16 + fp16 + fp32, sm90
    python -m moe.kernels._compile_check --quick    # smallest config of each kernel, bf16 and fp32

Must run with TRITON_INTERPRET unset. It drives the real launchers with small CPU tensors while
``_common.CAPTURE`` is set, so signatures and constexprs are exactly what a GPU launch would pass.
"""
from __future__ import annotations

import argparse
import inspect
import sys
import time

import torch
import triton
from triton.backends.compiler import GPUTarget

from . import _common
from .expert_mlp import expert_down_dact, expert_up_act
from .grouped_mm import grouped_mm_fwd
from .grouped_mm_wgrad import grouped_mm_wgrad
from .scatter_add import scatter_add_rows

_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int32: "*i32",
        torch.int64: "*i64"}


def capture_launches(dtype: torch.dtype) -> list:
    """Run each launcher once on tiny CPU tensors of ``dtype`` and return what they would launch."""
    _common.CAPTURE = captured = []
    try:
        e, m, h, f = 4, 64, 64, 32
        x = torch.randn(m, h, dtype=dtype)
        w = torch.randn(e, h, 2 * f, dtype=dtype)
        offs = torch.tensor([10, 10, 40, 60], dtype=torch.int32)
        gidx = torch.randint(0, m, (m,))
        grouped_mm_fwd(x, w, offs)
        grouped_mm_fwd(x, w, offs, gidx)
        grouped_mm_fwd(torch.randn(m, 2 * f, dtype=dtype), w, offs, transpose_w=True)
        grouped_mm_wgrad(x, torch.randn(m, 2 * f, dtype=dtype), offs, gidx)
        scatter_add_rows(x, gidx, m)
        for act, f_in in (("swiglu", 2 * f), ("gelu", f)):
            expert_up_act(x, w[..., :f_in], offs, act, save_pre=True)
            expert_down_dact(x, torch.randn(e, f, h, dtype=dtype), torch.randn(m, f_in, dtype=dtype), offs, act,
                             store_h=True)
    finally:
        _common.CAPTURE = None
    return captured


def _signature(kernel, args, kwargs, config):
    jit = triton.runtime.jit.JITFunction(kernel.fn)
    bound = dict(zip([p.name for p in jit.params], args))
    bound.update(kwargs)
    bound.update(config.kwargs)
    sig, constexprs = {}, {}
    for p in jit.params:
        v = bound[p.name]
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            constexprs[p.name] = v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = _PTR[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
        else:
            raise TypeError(f"{kernel.name}: cannot type argument {p.name}={v!r}")
    return jit, sig, constexprs


def compile_captured(captured, arch: int = 90, all_configs: bool = True, verbose: bool = True) -> int:
    target = GPUTarget("cuda", arch, 32)
    n = 0
    seen = set()
    for kernel, args, kwargs in captured:
        variant = (kernel.name, tuple(sorted((k, str(v)) for k, v in kwargs.items())))
        if variant in seen:  # e.g. the transposed-operand launch: same constexprs, only strides differ
            continue
        seen.add(variant)
        named = dict(zip([p for p in inspect.signature(kernel.fn).parameters], args), **kwargs)
        configs = kernel.configs
        if kernel.prune is not None:
            configs = kernel.prune(configs, named)
        for config in configs if all_configs else configs[-1:]:  # the lists end with the smallest tiles
            jit, sig, constexprs = _signature(kernel, args, kwargs, config)
            t0 = time.time()
            src = triton.compiler.ASTSource(fn=jit, signature=sig, constexprs=constexprs)
            compiled = triton.compile(src, target=target,
                                      options={"num_warps": config.num_warps, "num_stages": config.num_stages})
            n += 1
            if verbose:
                smem = compiled.metadata.shared
                print(f"ok {kernel.name} {config} shared={smem}B {time.time() - t0:.1f}s", flush=True)
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smallest config of each kernel, bf16 and fp32 only")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability as an int (90 = H100/H200)")
    a = ap.parse_args(argv)
    if _common.interpret_mode():
        print("unset TRITON_INTERPRET: this compiles real GPU code", file=sys.stderr)
        return 2
    dtypes = (torch.bfloat16, torch.float32) if a.quick else (torch.bfloat16, torch.float16, torch.float32)
    n = sum(compile_captured(capture_launches(dt), a.arch, all_configs=not a.quick) for dt in dtypes)
    print(f"compiled {n} kernel variants for sm{a.arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
