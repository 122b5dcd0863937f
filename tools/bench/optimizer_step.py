"""What one optimizer step costs: Muon (train.muon) against AdamW, on a preset's parameters.

    python tools/bench/optimizer_step.py                                  # CPU: deepseek-tiny, mixtral-tiny
    python tools/bench/optimizer_step.py --device cuda --presets mixtral-1b --repeats 20

The parameters of each preset (one process, fp32 master weights, as the trainer builds them) with random
gradients; peers, timed round-robin in one process (tools/bench/benchlib.py), each on its own copy of the
parameters and the same gradients:

    adamw   train.plan.make_optimizer with --train.optimizer adamw (foreach on CPU, fused on a GPU)
    muon    train.plan.make_optimizer with --train.optimizer muon: five Newton-Schulz steps per weight matrix
            (each expert on its own, batched), AdamW for the embedding, head, norms and biases

"time / adamw" divides each peer's median by AdamW's (> 1: slower than AdamW). "state MiB" is the optimizer state
after the first step (Muon: one buffer per matrix, AdamW: two per tensor). "NS GFLOP" counts Muon's matmuls, for a
sense of its cost on a GPU: per m x n matrix (m <= n) and step, 2 m^2 n (X X^T) + 2 m^3 (A A) + 2 m^2 n (B X).
"""
from __future__ import annotations

import copy
import dataclasses

import torch

from moekit.bench.benchlib import (BenchParser, add_timing_args, check_timing_args, environment, print_table,
                                   time_interleaved, write_json)


def ns_flops(model, steps: int = 5) -> float:
    """Muon's Newton-Schulz FLOPs per optimizer step over the model's matrices (module docstring)."""
    from moekit.train.muon import muon_param_groups

    group = muon_param_groups(model, 0.0)[0]
    total = 0.0
    for p, chunks in zip(group["params"], group["chunks"]):
        *batch, rows, cols = p.shape
        cols //= chunks
        m, n = min(rows, cols), max(rows, cols)
        per = 2 * m * m * n + 2 * m ** 3 + 2 * m * m * n
        count = chunks
        for b in batch:
            count *= b
        total += steps * per * count
    return total


def bench_preset(args, device, name: str) -> list[dict]:
    from moekit.models.config import preset
    from moekit.models.transformer import build_model
    from moekit.train.config import TrainConfig
    from moekit.train.plan import make_optimizer

    base = build_model(preset(name), device=device, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    grads = [torch.randn(p.shape, generator=gen).to(device) * 1e-3 for p in base.parameters()]
    peers, states = {}, {}
    for kind in ("adamw", "muon"):
        model = copy.deepcopy(base)
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        cfg = TrainConfig()
        cfg.train = dataclasses.replace(cfg.train, optimizer=kind, lr=1e-3)
        opt = make_optimizer(model, cfg)
        peers[kind] = opt.step
        states[kind] = opt
    timings = time_interleaved(peers, device, args.warmup, args.repeats, rotate=True)
    params = sum(p.numel() for p in base.parameters())
    flops = ns_flops(base)
    rows = []
    for kind, t in timings.items():
        state = sum(v.numel() * v.element_size() for st in states[kind].state.values() for v in st.values()
                    if isinstance(v, torch.Tensor))
        rows.append({"preset": name, "params_m": params / 1e6, "peer": kind, "ms": t["median_ms"],
                     "ratio": t["median_ms"] / timings["adamw"]["median_ms"], "state_mib": state / 2 ** 20,
                     "ns_gflop": flops / 1e9 if kind == "muon" else None, "timing": t})
    return rows


def main(argv=None) -> int:
    p = BenchParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                    formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    add_timing_args(p, "optimizer_step.json", warmup=2, repeats=10)
    p.add_argument("--presets", nargs="+", default=["deepseek-tiny", "mixtral-tiny"],
                   help="model presets whose parameters are stepped (default deepseek-tiny mixtral-tiny)")
    args = p.parse_args(argv)
    device = check_timing_args(p, args)
    from moekit.models.config import PRESETS

    unknown = [n for n in args.presets if n not in PRESETS]
    if unknown:
        p.error(f"--presets {unknown}: unknown; choose from {sorted(PRESETS)}")
    if args.dtype != "float32":
        p.error(f"--dtype {args.dtype}: the optimizer steps the fp32 master weights; leave --dtype float32")
    rows = []
    for name in args.presets:
        rows += bench_preset(args, device, name)
        write_json(args.out, {"partial": True, "rows": rows}, quiet=True)
    print(f"one optimizer step on {device}")
    print_table(rows, [("preset", "preset", "s"), ("params_m", "params M", ".2f"), ("peer", "peer", "s"),
                       ("ms", "ms", ".2f"), ("ratio", "time / adamw", ".2f"), ("state_mib", "state MiB", ".1f"),
                       ("ns_gflop", "NS GFLOP", ".2f")])
    write_json(args.out, {"benchmark": "optimizer_step", "environment": environment(device), "args": vars(args),
                          "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
