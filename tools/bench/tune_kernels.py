"""Sweep tile configs of moekit's Triton expert kernels on one GPU: which config is fastest per shape.

    python tools/bench/tune_kernels.py                              # 4 shapes x 6 kernel calls, 8192 tokens
    python tools/bench/tune_kernels.py --shapes mixtral-8x7b --calls wgrad_in wgrad_out --budget 240
    TRITON_INTERPRET=1 python tools/bench/tune_kernels.py --smoke   # CPU script check (timings meaningless)

The autotuner (moe.kernels: triton.autotune keyed on N and K) only chooses among each kernel's
candidate list, and those lists are untuned guesses (docs/kernels.md). This tool times a wider grid of
tile shapes, warps and stages for every kernel call of the fused SwiGLU expert MLP's forward and
backward, each call with its real operands:

    up_act      h, pre = act(x @ w_in[e])            EXPERT_UP_ACT       forward
    down        y = h @ w_out[e]                     GROUPED_MM          forward
    down_dact   dpre = (dy @ w_out[e]^T) * act'(pre) EXPERT_DOWN_DACT    backward
    dx          dx = dpre @ w_in[e]^T                GROUPED_MM          backward
    wgrad_in    dw_in[e] = x_e^T dpre_e              GROUPED_MM_WGRAD    backward
    wgrad_out   dw_out[e] = h_e^T dy_e               GROUPED_MM_WGRAD    backward

For each call: the time of the kernel as moekit runs it today (autotuned over its current list), then
each candidate pinned (``Kernel.pinned``), all with ``triton.testing.do_bench`` (median, L2 flushed).
Candidates that do not fit shared memory are skipped before compiling; one that fails to compile or
launch is recorded with its error. The table lists, per call, the current time, the best candidate, its
speedup over the current time and TFLOP/s; the end prints, per kernel, the configs that won somewhere
(the list to paste into the kernel's ``configs``). JSON: every timing. Nothing here asserts a timing.

--budget SECONDS stops starting new candidates past that time (a call with time left still reports its
best so far), so a run fits a device session; the JSON is rewritten after every call. Each distinct
(kernel, config) compiles once (~1-2 s) and later shapes reuse it, so the first shape costs the most:
the defaults (~180 configs over 4 kernels) need ~5-8 minutes on an H100/H200; order --shapes by
importance.

Compiling is CPU work and the sweep's largest cost (each (kernel, config) compiles once per expert-count
class, since E_POW2 is a constexpr). So before timing anything, --jobs worker processes (default: the
machine's cores less two) compile every candidate once at a small row count into Triton's on-disk cache
(the binary depends on the config and constexprs, and on H, F, rows only through their divisibility by
16, which the workers keep); the timing sweep then loads each binary instead of compiling it. --jobs 0
compiles in the sweep itself, as before.
"""
from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import time

import torch

from moekit.bench.benchlib import BenchParser, check_out, environment, print_table, write_json
from moekit.bench.grouped_gemm import SHAPES
from moekit.moe.kernels._common import cfg, interpret_mode, pow2
from moekit.moe.kernels.expert_mlp import EXPERT_DOWN_DACT, EXPERT_UP_ACT, expert_down_dact, expert_up_act
from moekit.moe.kernels.grouped_mm import GROUPED_MM, grouped_mm_fwd
from moekit.moe.kernels.grouped_mm_wgrad import GROUPED_MM_WGRAD, grouped_mm_wgrad

# name: (hidden H, expert ffn F, local experts E, top-k): grouped_gemm.py's shapes (mixtral-1b among them: the preset
# train_mfu.py trains)
SMOKE_SHAPE = {"smoke": (32, 16, 2, 2)}  # two experts: fewer interpreted programs per launch
CALLS = ("wgrad_in", "wgrad_out", "down_dact", "dx", "up_act", "down")  # backward first: it is the gap
KERNEL_OF = {"up_act": EXPERT_UP_ACT, "down": GROUPED_MM, "down_dact": EXPERT_DOWN_DACT, "dx": GROUPED_MM,
             "wgrad_in": GROUPED_MM_WGRAD, "wgrad_out": GROUPED_MM_WGRAD}
# the operand that the kernel's shared-memory prune reads the element size from
ELEM_ARG = {EXPERT_UP_ACT.name: "X", GROUPED_MM.name: "X", EXPERT_DOWN_DACT.name: "DY", GROUPED_MM_WGRAD.name: "X"}


def candidates(kernel, dtype: torch.dtype, wide: bool) -> list:
    """The grid for one kernel, minus what its own prune says cannot fit shared memory at ``dtype``.

    Tile names: GROUPED_MM / the MLP kernels tile the output [BLOCK_M rows, BLOCK_N cols] and step
    BLOCK_K through the reduction; GROUPED_MM_WGRAD tiles dW as [BLOCK_K, BLOCK_N] and steps BLOCK_M
    through the rows. The fused MLP kernels hold two accumulators, so their N tiles stay <= 128."""
    two_acc = kernel in (EXPERT_UP_ACT, EXPERT_DOWN_DACT)
    bm = (64, 128) if not wide else (32, 64, 128, 256)
    bn = (64, 128) if two_acc else (64, 128, 256)
    bk = (32, 64, 128)
    warps = (4, 8)
    stages = (3, 4) if not wide else (2, 3, 4, 5)
    grid = [cfg(m, n, k, w, s) for m, n, k, w, s in itertools.product(bm, bn, bk, warps, stages)
            if not (w == 8 and m * n < 128 * 64)]  # 8 warps on a small tile: idle warps
    if kernel.prune is None:
        return grid
    return kernel.prune(grid, {ELEM_ARG[kernel.name]: torch.empty(0, dtype=dtype)})


def describe(c) -> str:
    kw = c.kwargs
    return f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} w{c.num_warps} s{c.num_stages}"


def counts_for(rows: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """A realistic router load: multinomial over mildly skewed expert probabilities (the bench's uniform
    split would give every expert the same row count, a case the tile scheduler likes too much)."""
    p = torch.rand(experts, generator=gen) + 0.5
    picks = torch.multinomial(p / p.sum(), rows, replacement=True, generator=gen)
    return torch.bincount(picks, minlength=experts)


def build_calls(shape, tokens: int, dtype, device, gen) -> dict:
    """name -> (kernel, zero-argument launch, FLOPs) for every kernel call of one MLP fwd+bwd."""
    H, F, E, k = shape
    m = tokens * k
    offs = counts_for(m, E, gen).cumsum(0).to(torch.int32).to(device)

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).to(device=device, dtype=dtype)

    x, dy = rnd(m, H), rnd(m, H)
    w_in, w_out = rnd(E, H, 2 * F, scale=H ** -0.5), rnd(E, F, H, scale=F ** -0.5)
    h, pre = expert_up_act(x, w_in, offs, "swiglu", save_pre=True)
    dpre, _, _ = expert_down_dact(dy, w_out, pre, offs, "swiglu", store_h=False)
    two = 2.0 * m
    return {
        "up_act": (EXPERT_UP_ACT, lambda: expert_up_act(x, w_in, offs, "swiglu", save_pre=True), two * H * 2 * F),
        "down": (GROUPED_MM, lambda: grouped_mm_fwd(h, w_out, offs), two * F * H),
        "down_dact": (EXPERT_DOWN_DACT, lambda: expert_down_dact(dy, w_out, pre, offs, "swiglu", store_h=True),
                      two * H * F),
        "dx": (GROUPED_MM, lambda: grouped_mm_fwd(dpre, w_in, offs, transpose_w=True), two * 2 * F * H),
        "wgrad_in": (GROUPED_MM_WGRAD, lambda: grouped_mm_wgrad(x, dpre, offs), two * H * 2 * F),
        "wgrad_out": (GROUPED_MM_WGRAD, lambda: grouped_mm_wgrad(h, dy, offs), two * F * H),
    }


def compile_items(shapes: dict, calls, dtype, wide: bool) -> list:
    """Every distinct compile the sweep needs: (shape name, call, candidate index), one per
    (expert-count class, call, config). Calls stay distinct even on one kernel: dx's transposed weight has
    unit stride where down's has not, which Triton specialises on."""
    items, seen = [], set()
    for shape_name, (_h, _f, e, _k) in shapes.items():
        for call in calls:
            for i, c in enumerate(candidates(KERNEL_OF[call], dtype, wide)):
                key = (pow2(e), call, describe(c))
                if key not in seen:
                    seen.add(key)
                    items.append((shape_name, call, i))
    return items


def worker_tokens(tokens: int, k: int) -> int:
    """A small token count whose rows (tokens x k) have the same divisibility by 16 as the real ones."""
    return min(tokens, 64) if (tokens * k) % 16 == 0 else tokens


def precompile_part(a, part: int, parts: int) -> int:
    """Worker: launch its share of compile_items once each (pinned), filling Triton's cache; errors are the
    sweep's business (it records them), so they are only counted here."""
    device, dtype = torch.device("cuda"), getattr(torch, a.dtype)
    shapes = {s: SHAPES[s] for s in a.shapes}
    mine = compile_items(shapes, a.calls, dtype, a.wide)[part::parts]
    gen, built, failed = torch.Generator().manual_seed(a.seed), {}, 0
    for shape_name, call, i in mine:
        if shape_name not in built:
            built.clear()  # one shape's operands at a time
            shape = shapes[shape_name]
            built[shape_name] = build_calls(shape, worker_tokens(a.tokens, shape[3]), dtype, device, gen)
        kernel, launch, _ = built[shape_name][call]
        try:
            with kernel.pinned(candidates(kernel, dtype, a.wide)[i]):
                launch()
        except Exception:  # out of resources, a compile error
            failed += 1
    torch.cuda.synchronize()
    print(f"precompile part {part}/{parts}: {len(mine)} configs, {failed} failed", flush=True)
    return 0


def precompile(a, jobs: int, limit_s: float) -> None:
    """Run ``jobs`` worker processes of precompile_part and wait (at most ``limit_s``); a worker that fails
    or is cut only means the sweep compiles the rest itself."""
    shapes = {s: SHAPES[s] for s in a.shapes}
    n = len(compile_items(shapes, a.calls, getattr(torch, a.dtype), a.wide))
    jobs = max(1, min(jobs, n))
    print(f"precompiling {n} (kernel call, config, expert-count) variants on {jobs} workers "
          f"(at most {limit_s:.0f}s)...", flush=True)
    t0 = time.monotonic()
    env = dict(os.environ, MOEKIT_AUTOTUNE="first")  # the workers' own operand set-up compiles one default
    base = [sys.executable, os.path.abspath(__file__), "--shapes", *a.shapes, "--calls", *a.calls,
            "--dtype", a.dtype, "--tokens", str(a.tokens), "--seed", str(a.seed)] + (["--wide"] if a.wide else [])
    procs = [subprocess.Popen(base + ["--precompile-part", f"{i}/{jobs}"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(jobs)]
    bad = 0
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, t0 + limit_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            bad += 1
            continue
        if p.returncode != 0:
            bad += 1
            print(f"  a precompile worker exited {p.returncode}: {(out or '').strip().splitlines()[-1:]}", flush=True)
    print(f"precompiled in {time.monotonic() - t0:.0f}s"
          + (f"; {bad} worker(s) failed or were cut, the sweep compiles what they missed" if bad else ""),
          flush=True)


def make_timer(device, smoke: bool):
    if device.type == "cuda" and not smoke:
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")

    def once(fn):  # the interpreter: one call, to exercise the script
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return once


def tune_call(name, kernel, launch, flops, cands, bench, deadline) -> dict:
    res = {"call": name, "kernel": kernel.name, "gflop": flops / 1e9, "candidates": []}
    res["current_ms"] = bench(launch)  # autotuned over today's list (the first call tunes, then cached)
    for c in cands:
        if time.monotonic() > deadline:
            res["stopped_by_budget"] = True
            break
        entry = {"config": describe(c)}
        try:
            with kernel.pinned(c):
                entry["ms"] = bench(launch)
        except Exception as exc:  # out of resources, a compile error: recorded, the sweep goes on
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        res["candidates"].append(entry)
    timed = [e for e in res["candidates"] if "ms" in e]
    if timed:
        best = min(timed, key=lambda e: e["ms"])
        res.update(best_config=best["config"], best_ms=best["ms"], speedup=res["current_ms"] / best["ms"],
                   best_tflops=flops / best["ms"] / 1e9, current_tflops=flops / res["current_ms"] / 1e9)
    return res


def winners(rows) -> dict[str, list[str]]:
    """kernel name -> the configs that were fastest for some call, in order of first win: the list to paste
    into the kernel's configs, or to hand to the autotuner as it is (MOEKIT_KERNEL_CONFIGS=this JSON)."""
    out: dict[str, list[str]] = {}
    for r in rows:
        if r.get("best_config") and r["best_config"] not in out.setdefault(r["kernel"], []):
            out[r["kernel"]].append(r["best_config"])
    return {k: v for k, v in out.items() if v}


def parse(argv):
    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["fine-grained", "mixtral-1b", "qwen3-30b-a3b", "mixtral-8x7b",
                                                  "deepseek-v3-ep8"],
                   help=f"shape names: {', '.join(SHAPES)}")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per expert-parallel rank (rows = tokens x k)")
    p.add_argument("--calls", nargs="+", default=list(CALLS), help=f"kernel calls to sweep: {', '.join(CALLS)}")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--wide", action="store_true", help="a wider grid (BLOCK_M 32-256, 2-5 stages): ~4x the configs")
    p.add_argument("--budget", type=float, default=480.0, help="seconds after which no new candidate starts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 1) - 2),
                   help="worker processes that compile every candidate before the timing sweep "
                        "(default: cores less two; 0: compile inside the sweep)")
    p.add_argument("--precompile-only", action="store_true",
                   help="only fill Triton's cache with every candidate (--jobs workers, at most --budget seconds), "
                        "e.g. while the GPU is busy with something else; a later sweep with --jobs 0 times them")
    p.add_argument("--precompile-part", default=None, help=argparse.SUPPRESS)  # i/N: one worker's share
    p.add_argument("--smoke", action="store_true", help="tiny shape, 2 candidates per call (CPU interpreter)")
    p.add_argument("--out", default="bench-results/tune_kernels.json")
    a = p.parse_args(argv)
    unknown = [s for s in a.shapes if s not in SHAPES]
    if unknown:
        p.error(f"--shapes {' '.join(unknown)}: unknown; choose from {', '.join(SHAPES)}")
    bad = [c for c in a.calls if c not in CALLS]
    if bad:
        p.error(f"--calls {' '.join(bad)}: unknown; choose from {', '.join(CALLS)}")
    if a.tokens <= 0 or a.budget <= 0:
        p.error(f"--tokens {a.tokens} and --budget {a.budget} must be positive")
    if a.jobs < 0:
        p.error(f"--jobs {a.jobs} must be >= 0 (0: no precompile workers)")
    if a.precompile_part is None and not a.precompile_only:  # those write no JSON
        check_out(p, a.out)
    return a


def main(argv=None) -> int:
    a = parse(argv)
    on_gpu = torch.cuda.is_available() and not a.smoke
    if not on_gpu and not (a.smoke and interpret_mode()):
        print("tune_kernels.py: error: needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1 to check the script)",
              file=sys.stderr)
        return 2
    if a.precompile_part is not None:
        part, parts = map(int, a.precompile_part.split("/"))
        return precompile_part(a, part, parts)
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = getattr(torch, a.dtype)
    shapes = SMOKE_SHAPE if a.smoke else {s: SHAPES[s] for s in a.shapes}
    tokens = 8 if a.smoke else a.tokens
    bench = make_timer(device, a.smoke)
    deadline = time.monotonic() + a.budget
    if a.precompile_only:
        if not on_gpu or a.jobs == 0:
            print("tune_kernels.py: error: --precompile-only needs a GPU and --jobs > 0", file=sys.stderr)
            return 2
        precompile(a, a.jobs, limit_s=a.budget)
        return 0
    if on_gpu and a.jobs > 0:
        precompile(a, a.jobs, limit_s=0.6 * a.budget)
    gen = torch.Generator().manual_seed(a.seed)
    payload = {"benchmark": "tune_kernels", "dtype": a.dtype, "tokens": tokens, "wide": a.wide,
               "environment": environment(device), "partial": True, "results": []}
    for shape_name, shape in shapes.items():
        calls = build_calls(shape, tokens, dtype, device, gen)
        for call in a.calls:
            kernel, launch, flops = calls[call]
            cands = candidates(kernel, dtype, a.wide)
            if a.smoke:
                cands = cands[:2]
            res = tune_call(call, kernel, launch, flops, cands, bench, deadline)
            res.update(shape=shape_name, H=shape[0], F=shape[1], E=shape[2], k=shape[3])
            payload["results"].append(res)
            payload["winners"] = winners(payload["results"])  # usable even if the run is cut
            write_json(a.out, payload, quiet=True)
            print(f"done {shape_name} {call}: {len(res['candidates'])} candidates", flush=True)
        if time.monotonic() > deadline:
            print(f"budget of {a.budget:.0f}s spent after {shape_name}; later shapes not started", flush=True)
            break
    payload["partial"] = False
    rows = payload["results"]
    print_table(rows, [("shape", "shape", "s"), ("call", "call", "s"), ("current_ms", "current ms", ".3f"),
                       ("current_tflops", "TFLOP/s", ".0f"), ("best_config", "best config", "s"),
                       ("best_ms", "best ms", ".3f"), ("best_tflops", "TFLOP/s", ".0f"),
                       ("speedup", "current/best", ".2f")])
    payload["winners"] = winners(rows)
    print("\nconfigs that won somewhere (BLOCK_MxBLOCK_NxBLOCK_K, warps, stages), per kernel:")
    for kernel, configs in payload["winners"].items():
        print(f"  {kernel}: {', '.join(configs)}")
    print("(speedup = today's autotuned time / the best candidate's, same run; > 1 means the list is missing a "
          "better config)")
    write_json(a.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
