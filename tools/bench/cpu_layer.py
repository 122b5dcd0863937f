"""CPU: moekit's MoE layer against transformers' MoE blocks, forward and forward+backward, fp32 and bf16.

    python tools/bench/cpu_layer.py                      # 3 shapes x {fp32, bf16} x {fwd, fwd+bwd}, ~4 min
    python tools/bench/cpu_layer.py --dtypes float32 --shapes fine --repeats 9 --profile
    python tools/bench/cpu_layer.py --baseline HEAD       # also moekit as committed: before/after, same run
    python tools/bench/cpu_layer.py --shapes gpt-oss      # gpt-oss's block (not in the default set), ~2 min

Shapes (T from --tokens, H 256):
    mixtral    E 8,  F 512, top-2                           vs transformers' MixtralSparseMoeBlock
    fine       E 64, F 128, top-8                           vs MixtralSparseMoeBlock
    deepseek   E 64, F 128, top-6, shared expert (F 256,    vs Qwen2MoeSparseMoeBlock (the same function:
               sigmoid-gated)                                  softmax top-k renormalised + gated shared MLP)
    gpt-oss    E 32, F 256, top-4, router bias, expert      vs GptOssMLP (gpt-oss-20b's E / k, H = F as
               biases, swiglu_oai                              there; weights copied with gate / up interleaved)

Every implementation gets the same weights and its output is checked against moekit's before timing. Each
timed call takes the next of a sequence of fresh inputs (the same sequence for every peer; ``--same-input``:
one input throughout), so routing and expert row counts change from call to call as they do in training.
All peers of one (shape, dtype, mode) are timed round-robin in one process (tools/bench/benchlib.py), so
"ratio" = transformers' median / moekit's median is a same-clock comparison (> 1: moekit is faster).
transformers runs both of its experts implementations, "eager" (its per-expert loop, the default) and
"grouped_mm"; "ratio vs best" divides by the faster of the two. "GEMMs alone (floor)" runs only the layer's
matrix multiplies, the same shapes for the same routing, on preallocated operands (tools/bench/layer_probes.py
gemm_floor_step): on a GEMM-bound shape no implementation of these torch GEMMs gets much below it, so
"ceiling" = transformers' best / floor is the most any such layer can be faster than transformers' (gpt-oss:
the floor leaves out the biases, which a GEMM's epilogue can take). Per-phase times of moekit's layer (router,
permute, experts, combine, each forward+backward alone; tools/bench/layer_probes.py) and, with
``--profile``, the torch.profiler top operators of one moekit forward+backward are printed and saved.

Host memory: under glibc's defaults (``--host-memory system``, as ``moekit-train`` runs) every tensor of 32 MiB
or more (fine at T 4096: the routed rows, h, the output, their gradients) is a fresh mmap, paying ~10 ms of
page faults each, every call, for whichever peer allocates it. ``--host-memory retain`` makes the process
keep freed memory instead, for every peer alike (moekit.train.host_memory; docs/benchmarks.md, fourth round).
"""
from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import NamedTuple

# Peers share the process, and oneDNN's primitive cache (CPU bf16 GEMMs, one entry per shape; 1024 by default):
# transformers' ever-new expert shapes would evict the few shapes moekit's loop reuses (moe/onednn_gemm.py), which
# alone in a training run it never loses. A cache that holds every peer's shapes keeps each peer's own behaviour.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16384")

import torch  # noqa: E402

from moekit.bench.benchlib import (BenchParser, check_at_least, check_git_ref, check_names, check_out, environment,
                                   guarded, hf_experts_implementations, minor_faults, print_table, time_interleaved,
                                   write_json)
from moekit.bench.layer_probes import PHASES, gemm_floor_step, phase_steps
from moekit.bench.moe_layer import GPT_OSS_EXPERTS, GPT_OSS_ROUTER, copy_into_hf, gpt_oss_block, randomize_biases
from moekit.moe import MoELayer, build_router
from moekit.moe.experts import available_backends, resolve_backend
from moekit.train import host_memory

FLOOR = "GEMMs alone (floor)"


class Shape(NamedTuple):
    F: int
    E: int
    k: int
    shared: int = 0  # shared expert's F (0: none)
    gpt_oss: bool = False  # gate bias, expert biases, swiglu_oai (transformers' GptOssMLP)


SHAPES = {
    "mixtral": Shape(512, 8, 2),
    "fine": Shape(128, 64, 8),
    "deepseek": Shape(128, 64, 6, shared=256),
    "gpt-oss": Shape(256, 32, 4, gpt_oss=True),  # gpt-oss-20b: E 32 top-4, F = H (2880 there)
}
DEFAULT_SHAPES = ["mixtral", "fine", "deepseek"]  # the rounds in docs/benchmarks.md ran these


def moekit_layer(H, F, E, k, shared, backend="auto", gpt_oss=False) -> MoELayer:
    router = build_router("topk", H, E, top_k=k, aux_loss_coeff=0.0, **(GPT_OSS_ROUTER if gpt_oss else {}))
    return MoELayer(H, F, E, router, shared_ffn_hidden_size=shared, shared_expert_gate=shared > 0, backend=backend,
                    **(GPT_OSS_EXPERTS if gpt_oss else {}))


def baseline_layer(ref: str, layer: MoELayer) -> MoELayer:
    """A copy of ``layer`` computing with moe/dispatch.py and the loop backend of moe/experts.py as they
    were at git ``ref`` (e.g. HEAD before a change): a before/after pair timed in the same process."""
    import copy

    from moekit.moe import experts

    repo = Path(__file__).resolve().parents[2]
    mods = {}
    for path in ("moe/dispatch.py", "moe/experts.py"):
        name = f"_baseline_{ref}_{Path(path).stem}".replace("~", "_").replace("^", "_")
        if name not in sys.modules:
            src = subprocess.check_output(["git", "show", f"{ref}:{path}"], cwd=repo, text=True)
            mod = sys.modules[name] = types.ModuleType(name)
            exec(compile(src, f"{ref}:{path}", "exec"), mod.__dict__)
        mods[path] = sys.modules[name]
    backend = f"loop@{ref}"
    experts._BACKENDS.setdefault(backend, experts.ExpertBackend(backend, mods["moe/experts.py"].loop_mlp,
                                                                lambda *a: True, lambda *a: "",
                                                                bias=layer.experts.bias))  # gpt-oss's biases
    old = copy.deepcopy(layer)
    old.experts.backend = backend
    old.dispatcher = mods["moe/dispatch.py"].LocalDispatcher(layer.num_experts)
    return old


def hf_block(H, F, E, k, shared, impl, gpt_oss=False):
    """transformers' block computing the same function as ``moekit_layer`` (None without transformers)."""
    if gpt_oss:
        return gpt_oss_block(H, F, E, k, impl)
    try:
        if shared:
            from transformers import Qwen2MoeConfig
            from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as Block
            cfg = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=k,
                                 shared_expert_intermediate_size=shared, norm_topk_prob=True)
        else:
            from transformers import MixtralConfig
            from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
            cfg = MixtralConfig(hidden_size=H, intermediate_size=F, num_local_experts=E, num_experts_per_tok=k,
                                router_jitter_noise=0.0)
    except ImportError:
        return None
    cfg._experts_implementation = impl
    return Block(cfg)


def skewed_input(layer: MoELayer, T: int, skew: float, gen: torch.Generator) -> torch.Tensor:
    """[1, T, H] random tokens; with ``skew`` > 0 each token is also pulled toward one expert's router row,
    the expert drawn from a popularity that is itself drawn per input (Dirichlet(0.3)): uneven loads that
    change from input to input, as real text routes (one expert of the main job's got 3481 of 8192 slots)."""
    H, E = layer.hidden_size, layer.num_experts
    x = torch.randn(T, H, generator=gen)
    if skew > 0:
        popularity = torch._standard_gamma(torch.full((E,), 0.3), generator=gen)
        hot = torch.multinomial(popularity / popularity.sum(), T, replacement=True, generator=gen)
        w = layer.router.weight.detach().float()
        x += skew * H ** 0.5 * (w / w.norm(dim=1, keepdim=True))[hot]
    return x[None]


def make_step(module, x, grad, backward: bool):
    """One timed call of ``module``; ``x`` is one input or a list of inputs taken in turn, call after call (the
    same sequence for every peer), so the routing and every expert's row count change as in training."""
    next_input = itertools.cycle(x if isinstance(x, list) else [x]).__next__

    def fwd():
        with torch.no_grad():
            module(next_input())

    def fwd_bwd():
        xi = next_input()
        xi.grad = None
        module.zero_grad(set_to_none=True)
        module(xi).backward(grad)

    return fwd_bwd if backward else fwd


def counting_faults(step, tally: list[int]):
    """``step`` that adds its minor page faults and one call to ``tally`` (both warm-up and timed calls)."""
    def counted():
        before = minor_faults()
        step()
        tally[0] += minor_faults() - before
        tally[1] += 1

    return counted


def profile_ops(step, top: int = 12) -> list[dict]:
    """torch.profiler: the operators of one ``step`` by self CPU time (after one warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3,
             "share": e.self_cpu_time_total / total} for e in events[:top]]


def bench_shape(args, name, dtype) -> tuple[list[dict], dict]:
    F, E, k, shared, oai = SHAPES[name]
    H, T = args.hidden, args.tokens
    torch.manual_seed(args.seed)
    layer = moekit_layer(H, F, E, k, shared, gpt_oss=oai).to(dtype).train()
    if oai:  # biases start at 0, where a peer that dropped one would still match
        randomize_biases(layer, torch.Generator().manual_seed(args.seed))
    chosen = resolve_backend("auto", torch.zeros(1, H, dtype=dtype), layer.experts.w_in, layer.experts.w_out).name
    modules, skipped = {f"moekit[auto->{chosen}]": layer}, {}
    if args.baseline:
        modules[f"moekit@{args.baseline}"] = baseline_layer(args.baseline, layer)
    for b in args.backends:
        m = moekit_layer(H, F, E, k, shared, b, gpt_oss=oai).to(dtype).train()
        m.load_state_dict(layer.state_dict())
        modules[f"moekit[{b}]"] = m
    for impl in args.hf_impl:
        block, err = guarded(lambda: hf_block(H, F, E, k, shared, impl, gpt_oss=oai))
        if block is None:
            skipped[f"transformers[{impl}]"] = err or "transformers is not installed"
            continue
        block = block.to(dtype).train()
        copy_into_hf(layer, block)
        modules[f"transformers[{impl}]"] = block
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(1, T, H, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(1, T, H, generator=gen).to(dtype)
    calls = args.warmup + max(args.repeats, len(modules) + 1)  # time_interleaved's calls per peer (+ the floor)
    inputs = [x] if args.same_input else [x] + [skewed_input(layer, T, args.skew, gen).to(dtype).requires_grad_()
                                                for _ in range(calls - 1)]
    base = next(iter(modules))
    with torch.no_grad():
        y0 = layer(x).float()
    errs = {}
    for n, m in list(modules.items()):
        res, err = guarded(lambda: m(x).detach().float())
        if err:
            skipped[n] = err
            del modules[n]
            continue
        errs[n] = ((res - y0).norm() / y0.norm().clamp_min(1e-30)).item()  # D2H sync: check, outside timing
    rows = []
    for mode, backward in (("fwd", False), ("fwd+bwd", True)):
        steps = {n: make_step(m, inputs, grad, backward) for n, m in modules.items()}
        steps[FLOOR], flop = gemm_floor_step(layer, x.detach().view(T, H), backward)
        faults = {n: [0, 0] for n in steps}  # minor page faults, calls: a count, whatever the box's load
        steps = {n: counting_faults(f, faults[n]) for n, f in steps.items()}
        t = time_interleaved(steps, torch.device("cpu"), warmup=args.warmup, repeats=args.repeats, rotate=True)
        st = f"{args.stat}_ms"
        hf = {n: t[n][st] for n in modules if n.startswith("transformers")}
        common = {"shape": name, "dtype": str(dtype).removeprefix("torch."), "mode": mode}
        for n in modules:
            rows.append({**common, "impl": n, "median_ms": t[n]["median_ms"], "min_ms": t[n]["min_ms"],
                         "rel_err": errs[n], "ratio": t[n][st] / t[base][st],
                         "faults_per_call": faults[n][0] / max(faults[n][1], 1)})
        rows.append({**common, "impl": FLOOR, "median_ms": t[FLOOR]["median_ms"], "min_ms": t[FLOOR]["min_ms"],
                     "ratio": t[FLOOR][st] / t[base][st], "gflops": flop / t[FLOOR][st] / 1e6,
                     "faults_per_call": faults[FLOOR][0] / max(faults[FLOOR][1], 1)})
        rows.append({**common, "impl": "=> transformers best / moekit", "ratio": min(hf.values()) / t[base][st]
                     if hf else None})
        rows.append({**common, "impl": "=> ceiling: transformers best / GEMMs alone",
                     "ratio": min(hf.values()) / t[FLOOR][st] if hf else None})
    case = {"shape": name, "dtype": str(dtype).removeprefix("torch."), "T": T, "H": H, "F": F, "E": E, "k": k,
            "shared": shared, "gpt_oss": oai, "skipped": skipped}
    whole = make_step(layer, x, grad, True)
    steps = {"layer": whole, **phase_steps(layer, x.detach().view(T, H))}
    if args.baseline:
        old = modules[f"moekit@{args.baseline}"]
        steps.update({"baseline:layer": make_step(old, x, grad, True),
                      **{f"baseline:{p}": f for p, f in phase_steps(old, x.detach().view(T, H)).items()}})
    pt = time_interleaved(steps, torch.device("cpu"), warmup=1, repeats=max(3, args.repeats // 2), rotate=True)
    case["phases_ms"] = {p: pt[p][f"{args.stat}_ms"] for p in ("layer", *PHASES)}
    if args.baseline:
        case["baseline_phases_ms"] = {p: pt[f"baseline:{p}"][f"{args.stat}_ms"] for p in ("layer", *PHASES)}
    if args.profile:
        case["profile_top_ops"] = profile_ops(whole)
    return rows, case


def main(argv=None) -> int:
    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, choices=list(SHAPES),
                   help=f"default: {' '.join(DEFAULT_SHAPES)}")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--backends", nargs="*", default=[],
                   help=f"also time moekit with these expert backends ({', '.join(available_backends())})")
    p.add_argument("--hf-impl", nargs="*", default=["eager", "grouped_mm"])
    p.add_argument("--warmup", type=int, default=24,
                   help="untimed calls per peer first, each on a fresh input: a training run's steady state, in "
                        "which shapes that recur are in oneDNN's primitive cache")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skew", type=float, default=0.0,
                   help="pull each token toward an expert drawn from a per-input popularity: uneven expert loads "
                        "that change from call to call, as with real text (0: balanced random routing)")
    p.add_argument("--same-input", action="store_true",
                   help="time every call on one input (default: a new input each call, the same sequence for every "
                        "peer, so expert row counts change as in training: CPU bf16 GEMMs then pay oneDNN's "
                        "per-shape setup unless shapes recur, moe/onednn_gemm.py)")
    p.add_argument("--stat", default="min", choices=["min", "median"],
                   help="which statistic the ratios use: min (default) is the robust one on a shared, loaded box")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    p.add_argument("--baseline", default="", metavar="GIT_REF",
                   help="also time moekit's dispatch + loop backend as of this git ref (before/after in one run)")
    p.add_argument("--profile", action="store_true", help="also record torch.profiler top ops per case")
    p.add_argument("--host-memory", default="system", choices=host_memory.MODES,
                   help="system (default, as moekit-train): glibc's defaults, under which a tensor of 32 MiB or more "
                        "is a fresh mmap, page-faulted in, on every call; retain: this process keeps freed heap "
                        "memory, for every peer alike (moekit.train.host_memory, --train.host_memory retain)")
    p.add_argument("--out", default="bench-results/cpu_layer.json")
    args = p.parse_args(argv)
    check_at_least(p, args, 1, "tokens", "hidden", "repeats")
    check_at_least(p, args, 0, "warmup", "threads")
    if not args.skew >= 0:
        p.error(f"--skew {args.skew}: must be >= 0 (0: balanced random routing)")
    check_names(p, "--backends", args.backends, available_backends())
    check_out(p, args.out)
    if args.baseline:
        check_git_ref(p, args.baseline)
    hf_impls = hf_experts_implementations() if args.hf_impl else None
    if hf_impls is not None:  # without transformers each block is reported as skipped
        check_names(p, "--hf-impl", args.hf_impl, hf_impls)
    if args.threads:
        torch.set_num_threads(args.threads)
    memory = host_memory.configure(args.host_memory)  # every peer in this process alike
    print(memory)
    payload = {"benchmark": "cpu_moe_layer", "tokens": args.tokens, "hidden": args.hidden, "host_memory": memory,
               "environment": environment(torch.device("cpu"))}
    rows, cases = [], []
    for dt in args.dtypes:
        for name in args.shapes:
            res, err = guarded(lambda: bench_shape(args, name, getattr(torch, dt)))
            r, c = res or ([], {"shape": name, "dtype": dt, "error": err})
            rows, cases = rows + r, cases + [c]
            write_json(args.out, {**payload, "partial": True, "results": rows, "cases": cases}, quiet=True)
            print(f"done {name} {dt}" + (f": {err}" if err else ""), file=sys.stderr, flush=True)
    print_table(rows, [("shape", "shape", ""), ("dtype", "dtype", ""), ("mode", "mode", ""), ("impl", "impl", ""),
                       ("median_ms", "median ms", ".1f"), ("min_ms", "min ms", ".1f"),
                       ("ratio", "time / moekit", ".2f"), ("gflops", "GFLOP/s", ".0f"), ("rel_err", "rel err", ".1e"),
                       ("faults_per_call", "page faults", ".0f")])
    print("\nmoekit[auto] phases (each forward+backward alone, ms):")
    for c in cases:
        if "phases_ms" in c:
            print(f"  {c['shape']:9s} {c['dtype']:9s} " + ", ".join(f"{p} {v:.1f}" for p, v in c["phases_ms"].items()))
        if "baseline_phases_ms" in c:
            print(f"  {'':9s} {'@' + args.baseline:9s} " + ", ".join(f"{p} {v:.1f}" for p, v in c["baseline_phases_ms"].items()))
        for op in c.get("profile_top_ops", [])[:8]:
            print(f"      {op['op'][:40]:40s} {op['calls']:5d} calls {op['self_ms']:8.1f} ms {100 * op['share']:4.0f}%")
    write_json(args.out, {**payload, "results": rows, "cases": cases})
    return 0


if __name__ == "__main__":
    sys.exit(main())
