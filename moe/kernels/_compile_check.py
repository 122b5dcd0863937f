"""Compile every kernel config for a GPU target without a GPU (Triton's bundled ptxas), to catch
kernels that pass in the interpreter but do not lower to real code (layouts, types, shared memory).

    python -m moekit.moe.kernels._compile_check            # all configs, bf16 + fp16 + fp32, sm90
    python -m moekit.moe.kernels._compile_check --quick    # smallest config of each kernel, bf16 and fp32
    python -m moekit.moe.kernels._compile_check --first --dtypes bfloat16 --kernels _expert_down_dact_kernel
    python -m moekit.moe.kernels._compile_check --quick --first-for _grouped_mm_kernel   # the tests' one run

Each line names the kernel, config, dtype, shared memory, whether the K loop is software-pipelined, and
the registers and spill bytes per thread that Triton's ptxas reports (``-v``) for the cubin: spills in a
GEMM's epilogue cost it a large share of its speed (the down_dact epilogue did, docs/kernels.md).

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

from moekit.moe.activations import ACTIVATIONS

from . import _common
from .combine import combine_rows, combine_rows_backward
from .cross_entropy import cross_entropy_rows
from .delta_scan import delta_scan_bwd, delta_scan_fwd
from .expert_mlp import expert_down_dact, expert_up_act
from .grouped_mm import grouped_mm_fwd
from .grouped_mm_wgrad import grouped_colsum, grouped_mm_wgrad

wgrad_mod = sys.modules[grouped_mm_wgrad.__module__]  # the module (the package binds the name to the function)
gmm_mod = sys.modules[grouped_mm_fwd.__module__]
mlp_mod = sys.modules[expert_up_act.__module__]
from . import topk_route as topk_route_mod
from .rope import rope
from .scatter_add import scatter_add_rows
from .topk_route import topk_route

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
        saved = wgrad_mod.WGRAD_TMA, gmm_mod.GEMM_TMA, mlp_mod.MLP_TMA
        wgrad_mod.WGRAD_TMA = gmm_mod.GEMM_TMA = mlp_mod.MLP_TMA = "always"  # the TMA variants (no gather)
        try:
            grouped_mm_wgrad(x, torch.randn(m, 2 * f, dtype=dtype), offs)
            if dtype != torch.float32:  # the forward-type ones are 16-bit only
                grouped_mm_fwd(x, w, offs)
                grouped_mm_fwd(torch.randn(m, 2 * f, dtype=dtype), w, offs, transpose_w=True)
                # swiglu only: the descriptor loads are the same for every activation, and its epilogue (two
                # pre tiles) is the one closest to spilling
                expert_up_act(x, w, offs, "swiglu", save_pre=True)
                expert_up_act(x, w, offs, "swiglu", save_pre=True, gather_index=gidx)  # weights alone by TMA
                expert_down_dact(x, torch.randn(e, f, h, dtype=dtype), torch.randn(m, 2 * f, dtype=dtype), offs,
                                 "swiglu", store_h=True)
                # the routing weights in the last GEMM and the weights' gradient in the dact epilogue (FUSED_PERMUTE)
                grouped_mm_fwd(torch.randn(m, f, dtype=dtype), torch.randn(e, f, h, dtype=dtype), offs,
                               row_scale=torch.rand(m))
                expert_down_dact(x, torch.randn(e, f, h, dtype=dtype), torch.randn(m, 2 * f, dtype=dtype), offs,
                                 "swiglu", store_h=True, row_scale=torch.rand(m))
                # per-expert biases (gpt-oss) in the epilogues: swiglu_oai's up projection, the second GEMM
                expert_up_act(x, w, offs, "swiglu_oai", save_pre=True, bias=torch.randn(e, 2 * f, dtype=dtype))
                grouped_mm_fwd(torch.randn(m, 2 * f, dtype=dtype), w, offs, transpose_w=True,
                               bias=torch.randn(e, h, dtype=dtype))
        finally:
            wgrad_mod.WGRAD_TMA, gmm_mod.GEMM_TMA, mlp_mod.MLP_TMA = saved
        scatter_add_rows(x, gidx, m)
        grouped_colsum(x, offs)  # the biases' gradient
        # with the routing weights in the last GEMM: the output bias's weighted sums and each row's <b_out, dy>
        grouped_colsum(x, offs, row_scale=torch.rand(m), dot_with=torch.randn(e, h, dtype=dtype))
        grouped_mm_fwd(torch.randn(m, 2 * f, dtype=dtype), w, offs, transpose_w=True, bias=torch.randn(e, h, dtype=dtype))
        expert_up_act(x, w, offs, "swiglu_oai", save_pre=True, bias=torch.randn(e, 2 * f, dtype=dtype))
        expert_up_act(x, w, offs, "swiglu", save_pre=True, gather_index=gidx)  # the fused gather, pointer loads
        grouped_mm_fwd(torch.randn(m, f, dtype=dtype), torch.randn(e, f, h, dtype=dtype), offs, row_scale=torch.rand(m))
        expert_down_dact(x, torch.randn(e, f, h, dtype=dtype), torch.randn(m, 2 * f, dtype=dtype), offs, "swiglu",
                         store_h=True, row_scale=torch.rand(m))
        t, k = 16, 2  # the combine: fp32 router weights on rows of this dtype, weighted and plain, backward
        slot_row = torch.randint(-1, m + 2, (t * k,))
        weights = torch.rand(t, k)
        combine_rows(x, slot_row, weights, t, k)
        combine_rows(x, slot_row, None, t, k)
        combine_rows_backward(torch.randn(t, h, dtype=dtype), x, weights, slot_row)
        # the LM-head cross-entropy: several rows per program (V <= 1024) and one (the vocabulary in column tiles),
        # with the gradient and its scale, and the loss alone
        cross_entropy_rows(torch.randn(t, 1000, dtype=dtype), torch.randint(0, 1000, (t,)), torch.rand(t), need_grad=True)
        cross_entropy_rows(torch.randn(t, 5000, dtype=dtype), torch.randint(0, 5000, (t,)), torch.rand(t),
                           need_grad=True)
        cross_entropy_rows(torch.randn(t, 5000, dtype=dtype), torch.randint(0, 5000, (t,)))
        cos, sin = torch.rand(8, 16), torch.rand(8, 16)  # RoPE: both layouts, forward and inverse
        rope(torch.randn(2, 8, 3, 32, dtype=dtype), cos[:, None], sin[:, None])
        rope(torch.randn(2, 8, 3, 32, dtype=dtype).transpose(1, 2), cos, sin, inverse=True)
        if dtype == torch.float32:  # the fused router is float32 whatever the model's dtype
            lg = torch.randn(t, 12)
            topk_route(lg, 3, "softmax", True, 1.0, torch.zeros(12))  # normalised, biased selection
            topk_route(lg, 1, "sigmoid", False, 2.5)
            idx = torch.randint(0, 12, (t, 3))
            cfg = (3, "softmax", True, 1.0)  # backward: every input present, and the weights' alone
            topk_route_mod._backward_kernel(lg, idx, torch.randn(t, 3), torch.randn(t, 12), torch.randn(t), cfg)
            topk_route_mod._backward_kernel(lg, idx, torch.randn(t, 3), None, None, (3, "sigmoid", False, 2.0))
        if dtype == torch.float32:  # the delta-rule scan is float32 whatever the model's dtype
            # Qwen3.5's linear attention (dk = dv = 128, chunks of 64), all options on: initial state, saved states,
            # final state and its gradient, the initial state's gradient
            bn, n_chunks, L, dk, dv = 2, 3, 64, 128, 128
            terms = [torch.randn(1, bn, n_chunks, L, d) for d in (dv, dk, dk, L, dk)] + [torch.rand(1, bn, n_chunks)]
            delta_scan_fwd(*terms, torch.randn(1, bn, dk, dv), final_state=True, save_states=True)
            delta_scan_bwd(*terms, torch.randn(1, bn, n_chunks, dk, dv), torch.randn(1, bn, n_chunks, L, dv),
                           torch.randn(1, bn, dk, dv), need_state_grad=True)
        for act in ACTIVATIONS.values():  # every kernel_code the epilogues branch on
            f_in = act.in_features(f)
            expert_up_act(x, w[..., :f_in], offs, act.name, save_pre=True)
            expert_down_dact(x, torch.randn(e, f, h, dtype=dtype), torch.randn(m, f_in, dtype=dtype), offs, act.name,
                             store_h=True)
    finally:
        _common.CAPTURE = None
    return captured


def _signature(kernel, args, kwargs, config):
    """(JITFunction, signature, constexprs, attrs) exactly as a launch with these arguments would
    specialise them (Triton's own specialiser: ints == 1 become constants, 16-divisible ints and
    16-byte-aligned pointers get tt.divisibility, which gates vectorised and async copies)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    jit = triton.runtime.jit.JITFunction(kernel.fn)
    bound = dict(zip([p.name for p in jit.params], args))
    bound.update(kwargs)
    bound.update(config.kwargs)
    sig, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(jit.params):
        v = bound[p.name]
        if p.is_constexpr:
            sig[p.name], constexprs[p.name] = "constexpr", v
            continue
        ty, attr = native_specialize_impl(BaseBackend, v, False, True, True)
        if ty == "constexpr":
            sig[p.name], constexprs[p.name] = "constexpr", attr
        else:
            sig[p.name] = ty
            if attr:
                attrs[(i,)] = BaseBackend.parse_attr(attr)
    return jit, sig, constexprs, attrs


def _ptxas(arch: int) -> str | None:
    """The ptxas Triton itself runs for ``arch`` (its backend's choice), or None where it cannot say."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(arch).path
    except Exception:  # an older or newer Triton without this helper: no register report
        return None


def register_use(ptx: str, arch: int) -> str:
    """"regs=R spills=S" (per thread, spill stores in bytes) from ptxas -v on this PTX; "" without ptxas."""
    import re
    import subprocess
    import tempfile

    ptxas = _ptxas(arch)
    if ptxas is None:
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        src = f"{tmp}/k.ptx"
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", src, "-o", f"{tmp}/k.cubin"],
                             capture_output=True, text=True)
    text = out.stdout + out.stderr
    regs, spills = re.search(r"Used (\d+) registers", text), re.search(r"(\d+) bytes spill stores", text)
    return f"regs={regs.group(1) if regs else '?'} spills={spills.group(1) if spills else '?'}"


def compile_captured(captured, arch: int = 90, all_configs: bool = True, verbose: bool = True,
                     first: bool = False, kernels: set[str] | None = None, first_for: set[str] = frozenset()) -> int:
    """Compile the captured launches: every config (all_configs), the list's first (first: the tuned
    best, what MOEKIT_AUTOTUNE=first runs) or its last (the smallest tiles); ``kernels`` limits by name;
    ``first_for``: these kernels at their first config, the others as the rest says."""
    target = GPUTarget("cuda", arch, 32)
    n = 0
    seen = set()
    for kernel, args, kwargs in captured:
        if kernels and kernel.name not in kernels:
            continue
        variant = (kernel.name, tuple(sorted((k, str(v)) for k, v in kwargs.items())))
        if variant in seen:  # e.g. the transposed-operand launch: same constexprs, only strides differ
            continue
        seen.add(variant)
        named = dict(zip([p for p in inspect.signature(kernel.fn).parameters], args), **kwargs)
        configs = kernel.configs
        if kernel.prune is not None:
            configs = kernel.prune(configs, named)
        take_first = first or kernel.name in first_for
        for config in configs if all_configs else configs[:1] if take_first else configs[-1:]:  # smallest tiles last
            jit, sig, constexprs, attrs = _signature(kernel, args, kwargs, config)
            t0 = time.time()
            src = triton.compiler.ASTSource(fn=jit, signature=sig, constexprs=constexprs, attrs=attrs)
            compiled = triton.compile(src, target=target,
                                      options={"num_warps": config.num_warps, "num_stages": config.num_stages})
            n += 1
            if verbose:
                smem = compiled.metadata.shared
                ttgir = compiled.asm["ttgir"]  # cp.async (pointer loads) or TMA copies into multi-buffered smem
                pipelined = "async_copy_global_to_local" in ttgir or "async_tma_copy_global_to_local" in ttgir
                print(f"ok {kernel.name} {_short(config)} {kwargs_dtype(args)} shared={smem}B "
                      f"pipelined={pipelined} {register_use(compiled.asm['ptx'], arch)} {time.time() - t0:.1f}s",
                      flush=True)
    return n


def _short(config) -> str:
    kw = " ".join(f"{k}={v}" for k, v in config.kwargs.items())
    return f"[{kw} warps={config.num_warps} stages={config.num_stages}]"


def kwargs_dtype(args) -> str:
    return next((str(a.dtype).removeprefix("torch.") for a in args if isinstance(a, torch.Tensor)), "?")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smallest config of each kernel, bf16 and fp32 only")
    ap.add_argument("--first", action="store_true", help="the first (tuned best) config of each kernel instead")
    ap.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float16", "float32"], default=None,
                    help="operand dtypes (default: bf16 + fp32 with --quick / --first, else all three)")
    ap.add_argument("--kernels", nargs="+", default=None, help="only these kernels (names as printed)")
    ap.add_argument("--first-for", nargs="+", default=[], metavar="KERNEL",
                    help="with --quick: these kernels at their first (tuned best) config instead of the smallest, e.g. "
                         "the GEMMs whose register use the tests check (one compile run for both checks)")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability as an int (90 = H100/H200)")
    a = ap.parse_args(argv)
    if _common.interpret_mode():
        print("unset TRITON_INTERPRET: this compiles real GPU code", file=sys.stderr)
        return 2
    if a.dtypes:
        dtypes = tuple(getattr(torch, d) for d in a.dtypes)
    else:
        dtypes = (torch.bfloat16, torch.float32) if a.quick or a.first else (torch.bfloat16, torch.float16, torch.float32)
    one = a.quick or a.first
    if a.first_for and not a.quick:
        print("--first-for picks configs within --quick; add --quick", file=sys.stderr)
        return 2
    n = sum(compile_captured(capture_launches(dt), a.arch, all_configs=not one, first=a.first,
                             kernels=set(a.kernels) if a.kernels else None, first_for=set(a.first_for))
            for dt in dtypes)
    if n == 0:
        print(f"no kernel compiled: --kernels {a.kernels} names none of the captured launches", file=sys.stderr)
        return 2
    print(f"compiled {n} kernel variants for sm{a.arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
