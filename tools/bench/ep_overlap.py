"""Expert-parallel overlap: one MoE layer's forward + backward with its dispatch / experts / combine in
1, 2 or 4 overlapped chunks (comm.overlap, --layout.ep_overlap_chunks), against chunks = 1.

    python tools/bench/ep_overlap.py                                # CPU: spawns 4 gloo ranks
    python tools/bench/ep_overlap.py --world 4 --ranks-per-node 2   # hierarchical (2 simulated nodes)
    torchrun --nproc-per-node 8 tools/bench/ep_overlap.py           # GPUs (NCCL)

Each row: median milliseconds of one fwd+bwd of the layer (slowest rank), peers run round-robin in one
process so that load hits them alike; "vs 1" is chunks=1's time over this row's (> 1: faster). The row
"local" runs the same layer on the rank's own tokens with all experts and no all-to-all: under balanced
routing each rank then computes as many expert rows as under EP, so it is the floor that hiding every
exchange could approach (the permutes and the count exchange aside).

What CPU numbers mean: gloo's all-to-all is a copy through loopback TCP done by CPU threads, and spawned
ranks share the machine's cores with them; on a box with fewer cores than ranks there is no idle
resource for the exchange to run on, so chunking mostly adds per-chunk overhead there. The overlap pays
where the exchange runs on its own engine (NCCL on GPUs: copy engines and NICs).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist

from moekit.bench.benchlib import (BenchParser, check_at_least, check_out, environment, init_bench_process,
                                   launch_ranks, print_table, time_interleaved, write_json)
from moekit.comm.expert_parallel import apply_expert_parallel
from moekit.comm.topology import Layout, Topology
from moekit.moe import MoELayer, build_router


def measure(args, world: int, rank: int, device) -> list[dict]:
    per_node = args.ranks_per_node or world
    topo = Topology(Layout(dp=world, ep=world), rank, per_node).build()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)  # the same layer on every rank (layout-free init)
    router = build_router("topk", args.hidden, args.experts, top_k=args.top_k)
    base = MoELayer(args.hidden, args.ffn, args.experts, router).to(device)
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(device).requires_grad_()
    grad = torch.randn(args.tokens, args.hidden, generator=gen).to(device)
    layers = {"local": copy.deepcopy(base)}
    for chunks in args.chunks:
        layer = copy.deepcopy(base)
        apply_expert_parallel(layer, topo, hierarchical=per_node < world, overlap_chunks=chunks)
        layers[f"chunks={chunks}"] = layer

    def step(layer):
        def run():
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                y = layer(x)
            y.backward(grad.to(y.dtype))
            x.grad = None
            layer.zero_grad(set_to_none=True)
        return run

    stats = time_interleaved({n: step(layer) for n, layer in layers.items()}, device, args.warmup, args.repeats,
                             rotate=True)
    mine = torch.tensor([[stats[n]["median_ms"], stats[n]["min_ms"]] for n in layers], dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine.to(device) if device.type == "cuda" else mine)
    slowest = torch.stack([g.cpu() for g in gathered]).max(0).values.tolist()  # the step waits for it
    times = dict(zip(layers, slowest))
    base_ms = times[f"chunks={args.chunks[0]}"][0]
    return [{"peer": name, "dispatch": "none" if name == "local" else ("hierarchical" if per_node < world else "flat"),
             "median_ms": med, "min_ms": low, "speedup": base_ms / med} for name, (med, low) in times.items()]


def worker(rank: int, world: int, args, init_file: str | None) -> None:
    device = init_bench_process(rank, world, init_file, args.threads)  # spawned on CPU, or under torchrun
    rows = measure(args, world, rank, device)
    if rank == 0:
        print(f"ep={world}, {args.tokens} tokens/rank, H {args.hidden}, F {args.ffn}, E {args.experts}, "
              f"top-{args.top_k}, {args.dtype}, {device.type}")
        print_table(rows, [("peer", "peer", ""), ("dispatch", "dispatch", ""), ("median_ms", "fwd+bwd ms", ".2f"),
                           ("min_ms", "min ms", ".2f"),
                           ("speedup", f"vs chunks={args.chunks[0]}", ".2f")])
        write_json(args.out, {"benchmark": "ep_overlap", "world": world, "config": vars(args),
                              "environment": environment(device), "results": rows})
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4, help="ranks to spawn on CPU (ignored under torchrun)")
    p.add_argument("--ranks-per-node", type=int, default=0, help="< world: hierarchical dispatch over simulated nodes")
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4], help="the first one is the baseline")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per spawned CPU rank")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/ep_overlap.json")
    args = p.parse_args(argv)
    check_at_least(p, args, 1, "chunks", "hidden", "ffn", "experts", "top_k", "tokens", "threads", "repeats")
    check_at_least(p, args, 0, "ranks_per_node", "warmup")
    if args.top_k > args.experts:
        p.error(f"--top-k {args.top_k}: must be <= --experts {args.experts}")
    # every check before any rank starts: a rank that fails its own check leaves a traceback per rank
    spawned = "WORLD_SIZE" not in os.environ  # else torchrun's ranks and world size
    world, where = (args.world, "--world") if spawned else (int(os.environ["WORLD_SIZE"]), "torchrun's world size")
    if world < 2 or args.experts % world:
        p.error(f"{where} {world}: must be >= 2 and divide --experts {args.experts}")
    if args.ranks_per_node and world % args.ranks_per_node:
        p.error(f"--ranks-per-node {args.ranks_per_node}: must divide {where} {world}")
    check_out(p, args.out)
    launch_ranks(worker, args, args.world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
