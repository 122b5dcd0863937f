"""CPU: the loop backend's experts one after another (MKL threads inside each GEMM) against experts in
parallel, one thread each (moe/expert_threads.py), over a sweep of expert shapes: where is the crossover?

    python tools/bench/expert_threads.py                          # default sweep, fp32 + bf16, fwd and fwd+bwd
    python tools/bench/expert_threads.py --shapes 64x128 8x512 --dtypes float32 --repeats 9

A shape "ExF" is E experts of FFN width F (SwiGLU, H from --hidden); T tokens routed top-k with k = 8 for
E >= 32 and 2 otherwise, rows spread over the experts at random (ragged). "ratio" = sequential / parallel
over the min of interleaved rounds (> 1: parallel wins). The parallel output is checked bitwise against
the sequential one before timing. ``macs`` is the per-expert GEMM size choose_workers compares.
"""
from __future__ import annotations

import argparse
import sys

import torch

from moekit.bench.benchlib import (BenchParser, check_at_least, check_out, environment, print_table,
                                   time_interleaved, write_json)
from moekit.moe.experts import loop_mlp
from moekit.moe.expert_threads import choose_workers, expert_threads

DEFAULT_SHAPES = ["64x128", "64x256", "32x512", "16x512", "8x512", "8x1024", "8x2048"]


def bench_case(E: int, F: int, dtype: torch.dtype, args) -> list[dict]:
    H, T = args.hidden, args.tokens
    k = 8 if E >= 32 else 2
    N = T * k
    g = torch.Generator().manual_seed(args.seed)
    rows = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    w_in = (torch.randn(E, H, 2 * F, generator=g) * H ** -0.5).to(dtype).requires_grad_()
    w_out = (torch.randn(E, F, H, generator=g) * F ** -0.5).to(dtype).requires_grad_()
    counts = torch.bincount(torch.randint(0, E, (N,), generator=g), minlength=E)
    dy = torch.randn(N, H, generator=g).to(dtype)
    threads = torch.get_num_threads()

    def step(workers: int, backward: bool):
        def run():
            with expert_threads(workers):
                if backward:
                    loop_mlp(rows, counts, w_in, w_out, "swiglu").backward(dy)
                else:
                    with torch.no_grad():
                        loop_mlp(rows, counts, w_in, w_out, "swiglu")
        return run

    with torch.no_grad():  # bitwise: each expert's GEMMs are the same single-expert calls
        with expert_threads(1):
            ref = loop_mlp(rows, counts, w_in, w_out, "swiglu")
        with expert_threads(threads):
            same = torch.equal(ref, loop_mlp(rows, counts, w_in, w_out, "swiglu"))
    out = []
    for mode, backward in (("fwd", False), ("fwd+bwd", True)):
        t = time_interleaved({"sequential": step(1, backward), "parallel": step(threads, backward)},
                             torch.device("cpu"), warmup=args.warmup, repeats=args.repeats, rotate=True)
        auto = choose_workers(rows, w_in, counts.tolist())  # D2H sync: none on CPU; sizes for the choice
        out.append({"shape": f"{E}x{F}", "dtype": str(dtype).removeprefix("torch."), "mode": mode,
                    "macs": N // E * H * 2 * F, "seq_ms": t["sequential"]["min_ms"],
                    "par_ms": t["parallel"]["min_ms"], "ratio": t["sequential"]["min_ms"] / t["parallel"]["min_ms"],
                    "auto": "parallel" if auto > 1 else "sequential", "bitwise": same})
    return out


def main(argv=None) -> int:
    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="ExF: experts x FFN width")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/expert_threads.json")
    args = p.parse_args(argv)
    check_at_least(p, args, 1, "tokens", "hidden", "repeats")
    check_at_least(p, args, 0, "warmup")
    shapes = []
    for s in args.shapes:
        try:
            E, F = (int(v) for v in s.lower().split("x"))
        except ValueError:
            E = F = 0
        if E < 1 or F < 1:
            p.error(f"--shapes {s!r} is invalid; write experts x width, both >= 1, e.g. 64x128")
        shapes.append((E, F))
    check_out(p, args.out)
    if torch.get_num_threads() < 2:
        p.error("torch has 1 thread here: there is nothing to run in parallel (unset OMP_NUM_THREADS=1)")
    rows = []
    for dt in args.dtypes:
        for E, F in shapes:
            rows += bench_case(E, F, getattr(torch, dt), args)
            print(f"done {E}x{F} {dt}", file=sys.stderr, flush=True)
    print_table(rows, [("shape", "shape", ""), ("dtype", "dtype", ""), ("mode", "mode", ""), ("macs", "MACs/GEMM", ".2e"),
                       ("seq_ms", "sequential ms", ".1f"), ("par_ms", "parallel ms", ".1f"),
                       ("ratio", "seq / par", ".2f"), ("auto", "auto", ""), ("bitwise", "bitwise", "")])
    write_json(args.out, {"benchmark": "cpu_expert_threads", "tokens": args.tokens, "hidden": args.hidden,
                          "threads": torch.get_num_threads(), "environment": environment(torch.device("cpu")),
                          "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
