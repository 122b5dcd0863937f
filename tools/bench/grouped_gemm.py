"""Benchmark moekit's Triton grouped GEMM / expert MLP against torch baselines on one GPU.

    python tools/bench/grouped_gemm.py --out bench-results/grouped_gemm.json      # full matrix
    python tools/bench/grouped_gemm.py --quick                                    # small subset
    TRITON_INTERPRET=1 python tools/bench/grouped_gemm.py --smoke --out /tmp/s.json  # CPU script check

Workloads (each timed forward, and forward+backward with all gradients):
  gemm1  the first expert projection only: [M, H] @ w_in[e] [H, 2F] (SwiGLU width), M = tokens * k
  mlp    the whole SwiGLU expert MLP: swiglu(x @ w_in[e]) @ w_out[e]
Implementations, timed in the same run:
  triton        moe.kernels (gemm1: grouped_mm; mlp: expert_mlp variant="fused"), the pointer kernels
                (MOEKIT_TMA=never)
  triton_plain  mlp only: expert_mlp variant="plain" (two grouped GEMMs, torch SwiGLU between), pointer kernels
  torch_grouped torch.nn.functional.grouped_mm
  loop          one torch matmul per expert (host sync on the counts, like the "loop" backend)
  dense         one dense matmul (chain) of the same FLOPs: the roofline-ish ceiling
  triton_tma    triton with every TMA kernel variant (MOEKIT_TMA=always; what the default, auto, runs on a
                CUDA device), bf16 / fp16 on sm90+: the persistent forward / dX grouped GEMM (moe.kernels.grouped_mm.GEMM_TMA), the
                weight gradient's (grouped_mm_wgrad.WGRAD_TMA) and the fused up-projection / dact kernels'
                descriptor loads (expert_mlp.MLP_TMA). float32 (--smoke on CPU) runs the weight
                gradient's variant only
  float8        mlp only, with --float8: the "float8" expert backend (moe/float8.py: e4m3 GEMMs with rowwise
                scales, bf16 weight gradients), where its CUDA fp8 path runs (sm90 / sm100); under --smoke
                its CPU emulation, to check the wiring
Ratios are triton's TFLOP/s over each baseline's; "skew/unif" is an implementation's Zipf or one-hot
TFLOP/s over its uniform-routing TFLOP/s. Timing on GPU: --rounds rounds (3), each timing every
implementation once with triton.testing.do_bench (warmup 10 ms, rep 40 ms, median, L2 flushed between
calls) round-robin; the median of the rounds is kept. --smoke: perf_counter of a single call.
Select a subset with --shapes, --tokens, --routings, --workloads (tools/bench/gpu_suite.sh does).
Shapes: Mixtral-8x7B (H 4096, F 14336, E 8, k 2); DeepSeek-V3 under EP8 (H 7168, F 2048, the 32 local
experts of 256, k 8: a rank receives tokens * 8 rows when ranks are balanced); Qwen3-30B-A3B (H 2048,
F 768, E 128, k 8); fine-grained (H 1536, F 256, E 128, k 8). Routing: uniform, Zipf(1.2) over the
(local) experts, one-hot (every row to expert 0).
"""
from __future__ import annotations

import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from moekit.bench.benchlib import BenchParser, check_at_least, check_names, check_out

SHAPES = {  # name: (hidden H, expert ffn F, local experts E, top-k)
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "deepseek-v3-ep8": (7168, 2048, 32, 8),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "fine-grained": (1536, 256, 128, 8),
    "mixtral-1b": (1024, 3072, 8, 2),  # train_mfu's model: its expert GEMMs are ~48% of a training step
}
DEFAULT_SHAPES = ("mixtral-8x7b", "deepseek-v3-ep8", "qwen3-30b-a3b", "fine-grained")  # issue 9's; --shapes adds
TOKENS = (8192, 32768)
ROUTINGS = ("uniform", "zipf1.2", "onehot")
SMOKE_SHAPES = {"smoke": (32, 16, 2, 2)}  # two experts: the interpreter runs a program per row tile and expert
SMOKE_TOKENS = 16


def route_counts(rows: int, experts: int, routing: str, gen: torch.Generator) -> torch.Tensor:
    """Rows per expert summing to ``rows``: exact even split, Zipf(1.2) sample, or all on expert 0."""
    if routing == "uniform":
        counts = torch.full((experts,), rows // experts, dtype=torch.int64)
        counts[: rows % experts] += 1
        return counts
    if routing == "onehot":
        counts = torch.zeros(experts, dtype=torch.int64)
        counts[0] = rows
        return counts
    if routing == "zipf1.2":
        p = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.2
        picks = torch.multinomial(p / p.sum(), rows, replacement=True, generator=gen)
        return torch.bincount(picks, minlength=experts)
    raise ValueError(f"routing={routing!r} is unknown; use one of {ROUTINGS}")


def timer(device: torch.device, smoke: bool):
    if device.type == "cuda" and not smoke:
        import triton.testing

        # one round: do_bench's own warm-up, L2 flush between calls and median; run_case calls this
        # round-robin over the implementations, several rounds, and keeps the median of the rounds
        return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")

    def cpu_bench(fn):  # the interpreter is slow: --smoke times one call, no warmup (nothing to compile)
        if not smoke:
            fn()
        times = []
        for _ in range(1 if smoke else 3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return cpu_bench


def _loop_mm(x, w, counts_list):
    outs, start = [], 0
    for e, n in enumerate(counts_list):
        outs.append(x[start : start + n] @ w[e])
        start += n
    return torch.cat(outs)


def _swiglu(h):
    g, u = h.chunk(2, dim=-1)
    return F.silu(g) * u


def build_impls(workload: str, x, w_in, w_out, counts, has_torch_gmm: bool, float8: bool = False):
    """name -> zero-arg forward closure returning the output tensor. ``float8``: add the float8 backend to
    the mlp workload where its CUDA fp8 path runs (anywhere when x is on CPU: the --smoke check)."""
    from moekit.moe import float8 as fp8
    from moekit.moe import kernels

    offs = counts.cumsum(0).to(torch.int32).to(x.device)
    counts_dev = counts.to(x.device)
    counts_list = counts.tolist()  # D2H sync: done once here, outside the timed region
    m, h = x.shape
    f2 = w_in.shape[-1]
    # dense weights with the same FLOPs as the grouped product (one [H, 2F] and one [F, H] matrix)
    dense_in = w_in[0].detach().clone().requires_grad_(w_in.requires_grad)
    dense_out = w_out[0].detach().clone().requires_grad_(w_out.requires_grad)
    impls = {}
    if workload == "gemm1":
        impls["triton"] = lambda: kernels.grouped_mm(x, w_in, offs, backend="triton")
        tma_fwd = impls["triton"]
        if has_torch_gmm:
            impls["torch_grouped"] = lambda: F.grouped_mm(x, w_in, offs=offs)
        impls["loop"] = lambda: _loop_mm(x, w_in, counts_list)
        impls["dense"] = lambda: x @ dense_in
    else:
        impls["triton"] = lambda: kernels.expert_mlp(x, counts_dev, w_in, w_out, "swiglu", variant="fused")
        tma_fwd = impls["triton"]
        impls["triton_plain"] = lambda: kernels.expert_mlp(x, counts_dev, w_in, w_out, "swiglu", variant="plain")
        if has_torch_gmm:
            impls["torch_grouped"] = lambda: F.grouped_mm(_swiglu(F.grouped_mm(x, w_in, offs=offs)), w_out, offs=offs)
        impls["loop"] = lambda: _loop_mm(_swiglu(_loop_mm(x, w_in, counts_list)), w_out, counts_list)
        impls["dense"] = lambda: _swiglu(x @ dense_in) @ dense_out
        if float8 and fp8.why_not_float8(x, w_in, w_out) == "" and (
                x.device.type == "cpu" or fp8.fast_path_why_not(x, w_in, w_out) == ""):
            impls["float8"] = lambda: fp8.float8_mlp(x, counts_dev, w_in, w_out, "swiglu")
    wgrad = sys.modules[kernels.grouped_mm_wgrad.__module__]
    gmm, mlp = sys.modules[kernels.grouped_mm.__module__], sys.modules[kernels.expert_mlp.__module__]
    for name in ("triton", "triton_plain"):  # the pointer kernels, whatever MOEKIT_TMA says
        if name in impls:
            impls[name] = _InContext(impls[name], lambda: _all_tma(gmm, wgrad, mlp, "never"))
    if not wgrad.why_not_tma(x, x, None):  # the forward-type variants also need 16-bit data: else triton's run
        impls["triton_tma"] = _InContext(tma_fwd, lambda: _all_tma(gmm, wgrad, mlp, "always"))
    assert f2 % 2 == 0 and m >= 0 and h > 0
    return impls


@contextlib.contextmanager
def _all_tma(gmm, wgrad, mlp, mode: str):
    with mock.patch.object(gmm, "GEMM_TMA", mode), mock.patch.object(wgrad, "WGRAD_TMA", mode), \
            mock.patch.object(mlp, "MLP_TMA", mode):
        yield


class _InContext:
    """A peer's forward closure whose whole timed step (forward and backward) runs inside ``context()``."""

    def __init__(self, fn, context):
        self.fn, self.context = fn, context

    def __call__(self):
        return self.fn()


def flops(workload: str, m: int, h: int, f: int, backward: bool) -> float:
    fwd = 2.0 * m * h * 2 * f + (2.0 * m * f * h if workload == "mlp" else 0.0)
    return 3.0 * fwd if backward else fwd  # backward = dX and dW GEMMs, each the forward's FLOPs


def _timed_step(fwd, mode, x, w_in, w_out):
    context = getattr(fwd, "context", contextlib.nullcontext)
    if mode == "fwd":
        def step():
            with torch.no_grad(), context():
                fwd()
    else:
        def step():
            x.grad = w_in.grad = w_out.grad = None
            with context():
                y = fwd()
                y.backward(torch.ones_like(y))
    return step


def run_case(name, shape, tokens, routing, workload, dtype, device, bench, gen, has_torch_gmm, rounds=1,
             float8=False):
    h, f, e, k = shape
    m = tokens * k
    counts = route_counts(m, e, routing, gen)
    x = (torch.randn(m, h, device=device, dtype=dtype) / h**0.25).requires_grad_()
    w_in = (torch.randn(e, h, 2 * f, device=device, dtype=dtype) / h**0.5).requires_grad_()
    w_out = (torch.randn(e, f, h, device=device, dtype=dtype) / f**0.5).requires_grad_()
    row = {"shape": name, "H": h, "F": f, "E": e, "k": k, "tokens": tokens, "rows": m, "routing": routing,
           "workload": workload, "max_rows_per_expert": int(counts.max()), "results": {}}
    impls = build_impls(workload, x, w_in, w_out, counts, has_torch_gmm, float8)
    for mode in ("fwd", "fwd_bwd"):
        # round-robin: every implementation is timed once per round, so drift hits all alike
        times, errors = {impl: [] for impl in impls}, {}
        for _ in range(rounds):
            for impl, fwd in impls.items():
                if impl in errors:
                    continue
                try:
                    times[impl].append(bench(_timed_step(fwd, mode, x, w_in, w_out)))
                except Exception as exc:  # record and keep going: one unsupported baseline must not end the run
                    errors[impl] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        for impl in impls:
            res = row["results"].setdefault(impl, {})
            if impl in errors:
                res[mode] = {"error": errors[impl]}
            else:
                ms = statistics.median(times[impl])
                res[mode] = {"ms": ms, "tflops": flops(workload, m, h, f, mode == "fwd_bwd") / ms / 1e9}
    tri = row["results"].get("triton", {})
    row["ratios"] = {}
    for mode in ("fwd", "fwd_bwd"):
        base = tri.get(mode, {}).get("tflops")
        for impl, res in row["results"].items():
            other = res.get(mode, {}).get("tflops")
            if impl != "triton" and base and other:
                row["ratios"][f"triton/{impl}:{mode}"] = base / other
    del x, w_in, w_out
    return row


def skew_ratios(rows) -> list[dict]:
    """Each implementation's TFLOP/s under skewed routing over its TFLOP/s under uniform routing, same
    shape, tokens, workload and mode (issue 9 asks >= 0.9 for moekit's kernels)."""
    uniform = {(r["shape"], r["tokens"], r["workload"]): r for r in rows if r["routing"] == "uniform"}
    out = []
    for r in rows:
        u = uniform.get((r["shape"], r["tokens"], r["workload"]))
        if u is None or r["routing"] == "uniform":
            continue
        for impl, res in r["results"].items():
            for mode, v in res.items():
                base = u["results"].get(impl, {}).get(mode, {}).get("tflops")
                if base and v.get("tflops"):
                    out.append({"shape": r["shape"], "tokens": r["tokens"], "workload": r["workload"], "mode": mode,
                                "impl": impl, "routing": r["routing"], "skew_over_uniform": v["tflops"] / base})
    return out


def print_targets(rows, skews) -> None:
    """Issue 9's grouped-GEMM ratios, one line per case: triton over torch grouped_mm (>= 1.0 on the
    fine-grained shapes, >= 0.9 on Mixtral), over the per-expert loop (>= 3 fine-grained), and triton's
    skewed / uniform throughput (>= 0.9)."""
    skew = {(s["shape"], s["tokens"], s["workload"], s["mode"], s["routing"]): s["skew_over_uniform"]
            for s in skews if s["impl"] == "triton"}
    print(f"\n{'shape':<16}{'tok':>6} {'routing':<8} {'work':<6}{'mode':<8}{'tri/torch':>10}{'tri/loop':>10}{'skew/unif':>10}")
    for r in rows:
        for mode in ("fwd", "fwd_bwd"):
            cells = [r["ratios"].get(f"triton/torch_grouped:{mode}"), r["ratios"].get(f"triton/loop:{mode}"),
                     skew.get((r["shape"], r["tokens"], r["workload"], mode, r["routing"]))]
            print(f"{r['shape']:<16}{r['tokens']:>6} {r['routing']:<8} {r['workload']:<6}{mode:<8}"
                  + "".join(f"{c:>10.2f}" if c else f"{'-':>10}" for c in cells))
    print("(targets: tri/torch >= 1.0 fine-grained, >= 0.9 mixtral; tri/loop >= 3 fine-grained; skew/unif >= 0.9)")


def print_table(rows):
    impls = ["triton", "triton_plain", "triton_tma", "torch_grouped", "loop", "dense"]
    impls += ["float8"] if any("float8" in r["results"] for r in rows) else []
    head = f"{'shape':<16}{'tok':>6} {'routing':<8} {'work':<6}{'mode':<8}" + "".join(f"{i:>14}" for i in impls)
    print(head + f"{'tri/torch':>10}{'tri/dense':>10}")
    for r in rows:
        for mode in ("fwd", "fwd_bwd"):
            cells = []
            for i in impls:
                res = r["results"].get(i, {}).get(mode)
                cells.append("-" if res is None else ("err" if "error" in res else f"{res['tflops']:.3g}"))
            rt = r["ratios"].get(f"triton/torch_grouped:{mode}")
            rd = r["ratios"].get(f"triton/dense:{mode}")
            print(f"{r['shape']:<16}{r['tokens']:>6} {r['routing']:<8} {r['workload']:<6}{mode:<8}"
                  + "".join(f"{c:>14}" for c in cells)
                  + (f"{rt:>10.2f}" if rt else f"{'-':>10}") + (f"{rd:>10.2f}" if rd else f"{'-':>10}"))
    print("(TFLOP/s; ratios are triton TFLOP/s over the baseline's)")


def _csv(text: str | None) -> list[str]:
    return [t for t in text.split(",") if t] if text else []


def parse(argv):
    """The flags, each checked whether or not --smoke is on (--smoke then replaces shapes, tokens, routings,
    rounds and, on CPU, the dtype; select_cases says so): a bad value is one line and exit status 2."""
    ap = BenchParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--quick", action="store_true", help="subset: 8192 tokens, uniform + zipf, 2 shapes")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="default bfloat16 (--smoke on CPU: float32)")
    ap.add_argument("--workloads", default="gemm1,mlp", help="comma list of gemm1, mlp")
    ap.add_argument("--shapes", default=None, help=f"comma list of {','.join(SHAPES)} (default "
                    f"{','.join(DEFAULT_SHAPES)})")
    ap.add_argument("--tokens", default=None, help=f"comma list of token counts (default {TOKENS})")
    ap.add_argument("--routings", default=None, help=f"comma list of {','.join(ROUTINGS)}")
    ap.add_argument("--rounds", type=int, default=None, help="round-robin rounds per case on GPU (median kept; "
                                                             "default 3)")
    ap.add_argument("--float8", action="store_true",
                    help="also time the float8 expert backend on the mlp workload (CUDA sm90 / sm100)")
    a = ap.parse_args(argv)
    for flag, text in (("--shapes", a.shapes), ("--routings", a.routings), ("--tokens", a.tokens),
                       ("--workloads", a.workloads)):
        if text is not None and not _csv(text):
            ap.error(f"{flag} {text!r}: empty; give a comma list")
    check_names(ap, "--shapes", _csv(a.shapes), list(SHAPES))
    check_names(ap, "--routings", _csv(a.routings), ROUTINGS)
    check_names(ap, "--workloads", _csv(a.workloads), ["gemm1", "mlp"])
    for t in _csv(a.tokens):
        if not t.strip().isdigit() or int(t) < 1:
            ap.error(f"--tokens {t!r}: not a token count; give whole numbers >= 1, e.g. 8192,32768")
    check_at_least(ap, a, 1, "rounds")
    if a.out is not None:
        check_out(ap, a.out)
    return a


def smoke_note(a, device: torch.device) -> str | None:
    """The one note line naming the valid flags --smoke overrides, or None when it overrides none."""
    given = [f"{flag} {v}" for flag, v in (("--shapes", a.shapes), ("--tokens", a.tokens), ("--routings", a.routings),
                                            ("--rounds", a.rounds)) if v is not None]
    given += ["--quick"] if a.quick else []
    if device.type == "cpu" and a.dtype not in (None, "float32"):
        given.append(f"--dtype {a.dtype}")
    if not given:
        return None
    h, f, e, k = SMOKE_SHAPES["smoke"]
    return (f"note: --smoke runs its own tiny case (H {h}, F {f}, E {e}, k {k}, {SMOKE_TOKENS} tokens, uniform and "
            f"zipf1.2 routing, one round{', float32 on CPU' if device.type == 'cpu' else ''}); "
            f"ignoring {', '.join(given)}")


def select_cases(a, kernels):
    """(device, dtype, shapes, tokens, routings, workloads) from flags parse() checked, or an error message for
    stderr; under --smoke, prints smoke_note's line when it overrides a flag."""
    workloads = _csv(a.workloads)
    if a.smoke:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cpu" and not kernels.interpret_mode():
            return "--smoke on CPU needs TRITON_INTERPRET=1 set before launch"
        note = smoke_note(a, device)
        if note:
            print(note, file=sys.stderr)
        shapes, tokens, routings = SMOKE_SHAPES, (SMOKE_TOKENS,), ("uniform", "zipf1.2")
        dtype = torch.float32 if device.type == "cpu" else getattr(torch, a.dtype or "bfloat16")
        return device, dtype, shapes, tokens, routings, workloads
    if not torch.cuda.is_available():
        return ("grouped_gemm benchmark needs a CUDA GPU (found none); use --smoke under TRITON_INTERPRET=1 "
                "to check the script on CPU")
    device, dtype = torch.device("cuda"), getattr(torch, a.dtype or "bfloat16")
    names = _csv(a.shapes) or list(DEFAULT_SHAPES)
    if a.quick:
        names = [n for n in names if n in ("mixtral-8x7b", "qwen3-30b-a3b")] or names[:2]
    shapes = {n: SHAPES[n] for n in names}
    tokens = tuple(int(t) for t in _csv(a.tokens)) or ((8192,) if a.quick else TOKENS)
    routings = tuple(_csv(a.routings)) or (("uniform", "zipf1.2") if a.quick else ROUTINGS)
    return device, dtype, shapes, tokens, routings, workloads


def main(argv=None) -> int:
    a = parse(argv)
    from moekit.moe import kernels

    selected = select_cases(a, kernels)
    if isinstance(selected, str):
        print(f"grouped_gemm.py: error: {selected}", file=sys.stderr)
        return 2
    device, dtype, shapes, tokens, routings, workloads = selected
    import triton

    has_torch_gmm = hasattr(F, "grouped_mm")
    bench = timer(device, a.smoke)
    gen = torch.Generator().manual_seed(0)
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "dtype": str(dtype).removeprefix("torch."), "smoke": a.smoke, "quick": a.quick,
        "interpret": kernels.interpret_mode(),
        "timing": "median of round-robin do_bench medians" if device.type == "cuda" and not a.smoke else "cpu median",
        "gpu_autotuned_configs": "untuned guesses; see docs/kernels.md", "float8_peer": a.float8,
    }

    def save(rows, partial):
        if a.out:  # rewritten after every case, so a run stopped by a time limit keeps what it measured
            a.out.parent.mkdir(parents=True, exist_ok=True)
            payload = {"meta": meta, "partial": partial, "rows": rows, "skew_ratios": skew_ratios(rows)}
            a.out.write_text(json.dumps(payload, indent=1))

    rows = []
    for name, shape in shapes.items():
        for t in tokens:
            for routing in routings:
                for w in workloads:
                    rows.append(run_case(name, shape, t, routing, w, dtype, device, bench, gen, has_torch_gmm,
                                         rounds=1 if a.smoke else a.rounds or 3, float8=a.float8))
                    save(rows, partial=True)
                    print(f"done {name} tokens={t} {routing} {w}", file=sys.stderr, flush=True)
    print_table(rows)
    print_targets(rows, skew_ratios(rows))
    save(rows, partial=False)
    if a.out:
        print(f"wrote {a.out}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
