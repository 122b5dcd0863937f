"""CPU: would fused kernels beat moekit's eager non-GEMM work? torch.compile (Inductor's C++ code) against it.

    python tools/bench/cpu_fusion.py                                   # 3 shapes x fp32/bf16, all cases, ~3 min
    python tools/bench/cpu_fusion.py --shapes fine --dtypes float32 --cases combine --repeats 15

After the GEMMs, what is left of moekit's MoE layer on CPU (docs/benchmarks.md, issue 19) is memory-bound
elementwise and gather work: the combine, the SwiGLU activation and its derivative. Eager torch fuses none of
it; a fused kernel would read and write each byte once. moekit ships no C++ and no CPU Triton, so the one
fused CPU code generator in its stack is Inductor (torch.compile), which writes vectorised C++ loops. This
bench asks whether that would pay, per case, on the same inputs, timed round-robin in one process:

    combine         [N, H] expert rows -> [T, H] weighted sum of each token's k rows (moe.dispatch.unpermute,
                    the CPU path: k gathers into an fp32 accumulator) against the same sum written as plain
                    torch ops and compiled with static shapes (Inductor's best case), and against a plain
                    copy of the N x H rows (the bytes the combine must read at least once)
    swiglu          h [N, 2F] -> silu(gate) * up [N, F], as the loop backend runs it (silu.out + mul_ over the
                    whole block) against the compiled expression
    swiglu_bwd      d a [N, F], h -> d h [N, 2F] (the loop backend's backward epilogue: silu, two multiplies
                    and silu_backward) against the compiled derivative
    attention       the README main job's attention (B 16, heads 4, S 256, head dim 32, causal), forward +
                    backward: torch's SDPA (flash attention on CPU) against the same attention as explicit
                    bmm + softmax + bmm, eager and compiled. This case found that the explicit form is faster
                    in bf16 at short sequences, which models.attention.EXPLICIT_ATTENTION now uses

Shapes (T from --tokens, H 256): mixtral E 8, F 512, top-2; fine E 64, F 128, top-8; deepseek E 64, F 128,
top-6 (cpu_layer.py's). "time / base" divides by the case's first peer: moekit's eager op, or SDPA for
attention (> 1: the base is faster). Every peer's output is checked against the base's before timing ("max
err", relative to the output's largest magnitude).
"""
from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F

from moekit.bench.benchlib import (BenchParser, check_at_least, check_out, environment, print_table,
                                   time_interleaved, write_json)
from moekit.moe.dispatch import PermuteMeta, sort_slots, unpermute
from moekit.moe.experts import swiglu_into

SHAPES = {"mixtral": (8, 512, 2), "fine": (64, 128, 8), "deepseek": (64, 128, 6)}  # E, F, k (cpu_layer.py's)
CASES = ("combine", "swiglu", "swiglu_bwd", "attention")


def combine_plain(rows: torch.Tensor, slot_row: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * rows[slot_row[t * k + j]] in fp32 (or wider), one rounding: the combine
    as torch ops."""
    T, k = weights.shape
    acc = torch.promote_types(rows.dtype, torch.float32)
    picked = rows.index_select(0, slot_row).view(T, k, rows.shape[-1]).to(acc)
    return (picked * weights.to(acc)[:, :, None]).sum(1).to(rows.dtype)


def swiglu_eager(h: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """moe/experts.py's forward epilogue over the whole block: no temporaries."""
    F_ = a.shape[-1]
    return swiglu_into(h[:, :F_], h[:, F_:], a)


def swiglu_plain(h: torch.Tensor) -> torch.Tensor:
    F_ = h.shape[-1] // 2
    return F.silu(h[:, :F_]) * h[:, F_:]


def swiglu_bwd_eager(da: torch.Tensor, h: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """moe/experts.py's backward epilogue: d up = da * silu(gate), d gate = (da * up) * silu'(gate). The same
    ops, except that da * up goes to a new tensor: the loop overwrites da, which repeated timed calls cannot."""
    F_ = da.shape[-1]
    gate, up = h[:, :F_], h[:, F_:]
    torch.ops.aten.silu.out(gate, out=dh[:, F_:]).mul_(da)
    torch.ops.aten.silu_backward.grad_input(da.mul(up), gate, grad_input=dh[:, :F_])
    return dh


def swiglu_bwd_plain(da: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    F_, acc = da.shape[-1], torch.promote_types(h.dtype, torch.float32)
    gate, up, da = h[:, :F_].to(acc), h[:, F_:].to(acc), da.to(acc)
    s = torch.sigmoid(gate)
    return torch.cat([da * up * s * (1 + gate * (1 - s)), da * gate * s], dim=-1).to(h.dtype)


def attention_explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Causal attention as bmm + softmax + bmm ([B*N, S, S] scores)."""
    B, N, S, D = q.shape
    scores = torch.baddbmm(mask, q.reshape(B * N, S, D), k.reshape(B * N, S, D).transpose(1, 2), alpha=D ** -0.5)
    return torch.bmm(scores.softmax(-1), v.reshape(B * N, S, D)).view(B, N, S, D)


def max_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    scale = ref.abs().max().clamp_min(1e-30)
    return float(((out.float() - ref.float()).abs().max() / scale).item())


def run_case(case: str, shape: str, dtype: torch.dtype, args, compile_fn) -> list[dict]:
    E, F_, k = SHAPES[shape]
    T, H = args.tokens, args.hidden
    N = T * k
    g = torch.Generator().manual_seed(args.seed)
    peers: dict = {}
    outputs: dict = {}
    if case == "combine":
        ids = torch.randint(0, E, (T, k), generator=g)
        row_slot, slot_row = sort_slots(ids, N)
        weights = torch.rand(T, k, generator=g)
        meta = PermuteMeta(T, k, row_slot, slot_row, weights, may_drop=False)
        rows = torch.randn(N, H, generator=g).to(dtype)
        fused = compile_fn(combine_plain)
        peers = {"moekit": lambda: unpermute(rows, meta), "compiled": lambda: fused(rows, slot_row, weights),
                 "copy of the rows (floor)": lambda: rows.clone()}
        outputs = {"moekit": peers["moekit"](), "compiled": peers["compiled"]()}
    elif case == "swiglu":
        h = torch.randn(N, 2 * F_, generator=g).to(dtype)
        a = torch.empty(N, F_, dtype=dtype)
        fused = compile_fn(swiglu_plain)
        peers = {"moekit": lambda: swiglu_eager(h, a), "compiled": lambda: fused(h)}
        outputs = {"moekit": swiglu_eager(h, a).clone(), "compiled": fused(h)}
    elif case == "swiglu_bwd":
        h = torch.randn(N, 2 * F_, generator=g).to(dtype)
        da = torch.randn(N, F_, generator=g).to(dtype)
        dh = torch.empty(N, 2 * F_, dtype=dtype)
        fused = compile_fn(swiglu_bwd_plain)
        peers = {"moekit": lambda: swiglu_bwd_eager(da, h, dh), "compiled": lambda: fused(da, h)}
        outputs = {"moekit": swiglu_bwd_eager(da, h, dh).clone(), "compiled": fused(da, h)}
    elif case == "attention":
        B, heads, S, D = args.attn_batch, 4, args.attn_seq, 32
        q, kk, v = (torch.randn(B, heads, S, D, generator=g).to(dtype).requires_grad_() for _ in range(3))
        dy = torch.randn(B, heads, S, D, generator=g).to(dtype)
        mask = torch.full((S, S), -math.inf, dtype=dtype).triu(1).expand(B * heads, S, S)
        fused = compile_fn(attention_explicit)

        def fwd_bwd(fn):
            def step():
                q.grad = kk.grad = v.grad = None
                out = fn()
                out.backward(dy)
                return out.detach()
            return step

        sdpa = fwd_bwd(lambda: F.scaled_dot_product_attention(q, kk, v, is_causal=True))
        peers = {"SDPA": sdpa, "explicit bmm": fwd_bwd(lambda: attention_explicit(q, kk, v, mask)),
                 "compiled": fwd_bwd(lambda: fused(q, kk, v, mask))}
        outputs = {name: fn() for name, fn in peers.items()}
    else:
        raise ValueError(case)
    timings = time_interleaved(peers, torch.device("cpu"), warmup=args.warmup, repeats=args.repeats, rotate=True)
    base_name = next(iter(peers))  # moekit's eager op, or SDPA for attention
    base = timings[base_name][args.stat]
    where = f"{shape} (T {T})" if case != "attention" else f"main job (B {args.attn_batch}, S {args.attn_seq})"
    rows_out = []
    for name, t in timings.items():
        rows_out.append({"case": case, "shape": where, "dtype": str(dtype).replace("torch.", ""), "impl": name,
                         "min_ms": t["min_ms"], "median_ms": t["median_ms"], "ratio": t[args.stat] / base,
                         "max_err": max_err(outputs[base_name], outputs[name]) if name in outputs else None})
    return rows_out


def main(argv=None) -> int:
    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES),
                   help="routed shapes for combine / swiglu / swiglu_bwd (attention has its own)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--attn-batch", type=int, default=16, help="attention case: sequences (the main job's 16)")
    p.add_argument("--attn-seq", type=int, default=256, help="attention case: sequence length (the main job's 256)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the 'compiled' peers (inductor: fused C++; aot_eager: the "
                        "traced ops unfused, for a quick check of this script)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--stat", choices=["min_ms", "median_ms"], default="min_ms",
                   help="which statistic the ratios use (min: robust on a shared, loaded box)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/cpu_fusion.json")
    args = p.parse_args(argv)
    check_at_least(p, args, 1, "tokens", "hidden", "attn_batch", "attn_seq", "repeats")
    check_at_least(p, args, 0, "warmup")
    if args.compile_backend not in torch._dynamo.list_backends(exclude_tags=()):  # debug backends too
        p.error(f"--compile-backend {args.compile_backend}: unknown; choose from "
                f"{', '.join(torch._dynamo.list_backends())} (or a debug one such as aot_eager)")
    check_out(p, args.out)

    def compile_fn(fn):  # static shapes: each case's shapes never change, Inductor's best case
        return torch.compile(fn, backend=args.compile_backend, dynamic=False)

    results = []
    payload = {"benchmark": "cpu_fusion", "compile_backend": args.compile_backend, "stat": args.stat,
               "threads": torch.get_num_threads(), "environment": environment(torch.device("cpu")), "results": results}
    for dt in args.dtypes:
        for case in args.cases:
            for shape in (args.shapes if case != "attention" else [None]):
                torch._dynamo.reset()  # each case compiles afresh: no recompile limit across cases
                with torch.no_grad() if case != "attention" else torch.enable_grad():  # one grad mode per case
                    results += run_case(case, shape or "mixtral", getattr(torch, dt), args, compile_fn)
                print(f"done {case} {shape or ''} {dt}", file=sys.stderr, flush=True)
                write_json(args.out, {**payload, "partial": True}, quiet=True)
    print_table(results, [("case", "case", ""), ("shape", "shape", ""), ("dtype", "dtype", ""), ("impl", "impl", ""),
                          ("min_ms", "min ms", ".3f"), ("median_ms", "median ms", ".3f"),
                          ("ratio", "time / base", ".2f"), ("max_err", "max err", ".1e")])
    write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
