"""Local dispatch (permute) and combine (unpermute) bandwidth against a plain copy of the same bytes.

    python tools/bench/dispatch_bandwidth.py                                   # CPU, small sizes
    python tools/bench/dispatch_bandwidth.py --device cuda --dtype bfloat16 --tokens 16384 \\
        --configs mixtral qwen3-30b-a3b deepseek-v3 --out bench-results/dispatch_bandwidth.json

Shape legend: T tokens, H hidden, E experts, k slots per token, N = T * k routed rows, b bytes per element.

Operations (moe.dispatch.LocalDispatcher on one device, routing from a top-k softmax router) and the
bytes each must move at least, counting a gathered row once per slot that reads it:

    dispatch_fwd   x [T, H] -> rows [N, H]                 read N*H, write N*H
    dispatch_bwd   d rows [N, H] -> dx [T, H] (k-sum)      read N*H, write T*H
    combine_fwd    rows [N, H], w [T, k] -> y [T, H]       read N*H, write T*H
    combine_bwd    dy [T, H] -> d rows [N, H], d w [T, k]  read N*H (dy per row) + N*H (rows), write N*H

Peers of each operation, timed round-robin in one run (CUDA events on GPU):
    moekit   moe.dispatch.permute / unpermute and their autograd backward
    torch    the plain-torch way: index_select for the gather, index_add_ (scatter-add) for the sums,
             autograd through them for combine_bwd
    copy     x.clone() of a buffer holding half the operation's bytes: reads and writes exactly them
"GB/s" is the operation's bytes over its time; "vs copy" is moekit's GB/s over the copy's (issue 9:
>= 0.7). The slot sort that builds the permutation (dispatch_meta) is timed too, without a ratio.
Before timing, moekit's outputs are compared with the torch peer's (max |diff| / max |torch|). On a GPU
each moekit op and both slot sorts are then profiled (torch.profiler): their kernels, GPU time and
launches go into the JSON ("kernels", "kernel_ms", "launches") and a second table.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from moekit.bench.benchlib import (BenchParser, add_timing_args, check_at_least, check_timing_args, environment,
                                   print_table, time_events, write_json)
from moekit.bench.layer_probes import kernel_breakdown
from moekit.moe import LocalDispatcher, build_router
from moekit.moe.dispatch import permute, sort_slots, unpermute

CONFIGS = {  # name: (hidden H, experts E, top-k)
    "mixtral": (4096, 8, 2),
    "qwen3-30b-a3b": (2048, 128, 8),
    "deepseek-v3": (7168, 256, 8),
    "small": (256, 16, 2),
}


def setup(tokens: int, hidden: int, experts: int, top_k: int, dtype, device, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    router = build_router("topk", hidden, experts, top_k=top_k, aux_loss_coeff=0.0).to(device)
    with torch.no_grad():
        routing = router.route(torch.randn(tokens, experts, generator=gen).to(device))
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype).requires_grad_()
    d = LocalDispatcher(experts).dispatch(x, routing)
    n = d.rows.shape[0]
    rows = torch.randn(n, hidden, generator=gen).to(device, dtype).requires_grad_()  # expert outputs
    weights = routing.weights.detach().clone().requires_grad_()
    meta = dataclasses.replace(d.meta, weights=weights)
    return {"x": x, "routing": routing, "rows_out": d.rows, "meta": meta, "rows": rows, "weights": weights,
            "row_token": d.meta.row_slot // top_k, "g_rows": torch.randn(n, hidden, generator=gen).to(device, dtype),
            "g_y": torch.randn(tokens, hidden, generator=gen).to(device, dtype), "n": n}


def torch_combine(rows, weights, row_slot, row_token, tokens):
    """The scatter-add way: scale each row by its slot's weight, index_add_ onto its token."""
    w_row = weights.reshape(-1).index_select(0, row_slot).to(rows.dtype)  # [N]
    return rows.new_zeros(tokens, rows.shape[-1]).index_add_(0, row_token, rows * w_row[:, None])


def op_peers(s: dict, tokens: int, hidden: int, elem: int) -> dict[str, tuple[int, dict]]:
    """op -> (bytes moved, {peer: zero-argument callable returning the op's result})."""
    x, meta, rows, w, n = s["x"], s["meta"], s["rows"], s["weights"], s["n"]
    row_token, row_slot = s["row_token"], meta.row_slot
    T, H = tokens, hidden
    y = unpermute(rows, meta)  # graphs kept alive for the backward peers (retain_graph)
    y_t = torch_combine(rows, w, row_slot, row_token, T)
    nbytes = {
        "dispatch_fwd": 2 * n * H * elem,
        "dispatch_bwd": (n + T) * H * elem,
        "combine_fwd": (n + T) * H * elem,
        "combine_bwd": 3 * n * H * elem,
    }
    grad = torch.autograd.grad
    peers = {
        "dispatch_fwd": {"moekit": lambda: permute(x, meta), "torch": lambda: x.index_select(0, row_token)},
        "dispatch_bwd": {
            "moekit": lambda: grad(s["rows_out"], x, s["g_rows"], retain_graph=True)[0],
            "torch": lambda: torch.zeros_like(x).index_add_(0, row_token, s["g_rows"]),
        },
        "combine_fwd": {"moekit": lambda: unpermute(rows, meta),
                        "torch": lambda: torch_combine(rows, w, row_slot, row_token, T)},
        "combine_bwd": {
            "moekit": lambda: grad(y, (rows, w), s["g_y"], retain_graph=True),
            "torch": lambda: grad(y_t, (rows, w), s["g_y"], retain_graph=True),
        },
    }
    out = {}
    for op, fns in peers.items():
        src = torch.empty(nbytes[op] // (2 * elem), device=x.device, dtype=x.dtype).normal_()
        out[op] = (nbytes[op], {**fns, "copy": lambda src=src: src.clone()})
    return out


def rel_diff(a, b) -> float:
    """max |a - b| / max |b| over the outputs (bf16 sums in another order differ by rounding only)."""
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    diffs = [(p.float() - q.float()).abs().max() / q.float().abs().max().clamp_min(1e-30) for p, q in zip(a, b)]
    return max(d.item() for d in diffs)  # D2H sync: a check before timing


def bench_config(name: str, tokens: int, args, device, dtype) -> list[dict]:
    hidden, experts, top_k = CONFIGS[name]
    s = setup(tokens, hidden, experts, top_k, dtype, device, args.seed)
    elem = s["x"].element_size()
    base = {"config": name, "tokens": tokens, "H": hidden, "E": experts, "k": top_k}
    rows = []
    peers = op_peers(s, tokens, hidden, elem)
    for op, (nbytes, fns) in peers.items():
        diff = rel_diff(fns["moekit"](), fns["torch"]())
        t = time_events(fns, device, warmup=args.warmup, repeats=args.repeats)
        copy_gbps = nbytes / t["copy"]["median_ms"] / 1e6
        for peer, res in t.items():
            gbps = nbytes / res["median_ms"] / 1e6
            rows.append({**base, "op": op, "impl": peer, "bytes": nbytes, "median_ms": res["median_ms"],
                         "GBps": gbps, "vs_copy": gbps / copy_gbps, "rel_diff_vs_torch": diff if peer == "moekit" else None})
    indices = s["routing"].indices
    meta_fns = {"moekit": lambda: sort_slots(indices, s["n"]),
                "torch": lambda: torch.argsort(indices.reshape(-1), stable=True)}
    for peer, res in time_events(meta_fns, device, warmup=args.warmup, repeats=args.repeats).items():
        rows.append({**base, "op": "dispatch_meta", "impl": peer, "median_ms": res["median_ms"]})
    # GPU: the kernels behind each moekit op and both slot sorts (what a gap to the copy or to argsort is made of)
    steps = {(op, "moekit"): fns["moekit"] for op, (_, fns) in peers.items()}
    steps.update({("dispatch_meta", peer): fn for peer, fn in meta_fns.items()})
    tables = kernel_breakdown({f"{op}/{peer}": fn for (op, peer), fn in steps.items()}, device)
    for r in rows:
        table = tables.get(f"{r['op']}/{r['impl']}")
        if table is not None:
            r["kernels"] = table
            r["kernel_ms"] = sum(k["us"] for k in table) / 1e3
            r["launches"] = sum(k["launches"] for k in table)
    return rows


def main(argv=None) -> int:
    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096])
    p.add_argument("--configs", nargs="+", default=["small", "qwen3-30b-a3b"], choices=list(CONFIGS),
                   help="hidden/experts/top-k sets: " + ", ".join(f"{n} {v}" for n, v in CONFIGS.items()))
    add_timing_args(p, out="bench-results/dispatch_bandwidth.json", warmup=3)
    args = p.parse_args(argv)
    check_at_least(p, args, 1, "tokens")
    device, dtype = check_timing_args(p, args), getattr(torch, args.dtype)
    rows = []
    payload = {"benchmark": "dispatch_bandwidth", "dtype": args.dtype, "environment": environment(device)}
    for tokens in args.tokens:
        for name in args.configs:
            rows += bench_config(name, tokens, args, device, dtype)
            write_json(args.out, {**payload, "partial": True, "results": rows}, quiet=True)
            print(f"done {name} T={tokens}", file=sys.stderr, flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print_table(rows, [("config", "config", ""), ("tokens", "T", "d"), ("op", "op", ""), ("impl", "impl", ""),
                       ("median_ms", "median ms", ".3f"), ("GBps", "GB/s", ".1f"), ("vs_copy", "vs copy", ".2f"),
                       ("rel_diff_vs_torch", "rel diff", ".1e")])
    print("(vs copy: GB/s over a plain clone of the same bytes in the same run; issue 9 target >= 0.7 for moekit)")
    profiled = [dict(r, top=f"{r['kernels'][0]['kernel'][:48]} {r['kernels'][0]['us']:.0f} us" if r["kernels"] else "")
                for r in rows if "kernels" in r]
    if profiled:  # GPU only: the profiler's kernel time against the event-timed median
        print_table(profiled, [("config", "config", ""), ("tokens", "T", "d"), ("op", "op", ""), ("impl", "impl", ""),
                               ("median_ms", "median ms", ".3f"), ("kernel_ms", "kernel ms", ".3f"),
                               ("launches", "launches", ".0f"), ("top", "largest kernel", "")])
        print("(kernel ms: GPU time of the op's kernels alone, torch.profiler; median - kernel ms is time between "
              "them. Every kernel per op is in the JSON's 'kernels')")
    write_json(args.out, {**payload, "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
