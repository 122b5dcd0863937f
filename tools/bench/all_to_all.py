"""Flat vs hierarchical expert-parallel dispatch: time and bytes per link class, against the cost model.

DeepSeek-V3-like routing by default (H 7168, 256 experts, top-8), nodes simulated by grouping ranks:

    python tools/bench/all_to_all.py                                  # CPU: spawns 8 gloo ranks
    python tools/bench/all_to_all.py --ranks-per-node 4 2 --node-limit 2 --tokens 64
    torchrun --nproc-per-node 8 tools/bench/all_to_all.py --ranks-per-node 8 4 2   # GPUs (NCCL)

Each row: one (ranks per node, dispatcher) pair. Measured bytes are what every rank sent per token
(dispatch only; combine mirrors it), averaged over ranks; "model" is moekit.train.planning.cost_model's expectation
for uniformly random routing. Time is one dispatch + combine with identity experts (communication and
permutation only), median over repeats, slowest rank. GB/s/rank is the dispatch + combine bytes a rank
sent over that time: a lower bound on link use, since the time includes the permutes and count
exchange (expected rates on NVLink / InfiniBand: docs/benchmarks.md, "Running the GPU suite").
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from moekit.bench.benchlib import (BenchParser, check_at_least, check_out, environment, init_bench_process,
                                   launch_ranks, print_table, write_json)
from moekit.train.planning import cost_model
from moekit.comm.expert_parallel import FlatEPDispatcher
from moekit.comm.hierarchical import HierarchicalEPDispatcher
from moekit.comm.topology import Layout, Topology
from moekit.moe import build_router


def measure(args, world: int, rank: int, per_node: int, device) -> list[dict]:
    topo = Topology(Layout(dp=world, ep=world), rank, per_node).build()
    nodes = world // per_node
    opts = {}
    if args.node_limit and args.node_limit < nodes:  # node-limited routing = groups aligned with nodes
        opts = dict(num_groups=nodes, group_top_k=args.node_limit)
    router = build_router("topk", args.hidden, args.experts, top_k=args.top_k, aux_loss_coeff=0.0, **opts).to(device)
    gen = torch.Generator(device="cpu").manual_seed(args.seed + rank)
    dtype = getattr(torch, args.dtype)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype)
    with torch.no_grad():
        routing = router.route(torch.randn(args.tokens, args.experts, generator=gen).to(device))
    out = []
    dispatchers = {"flat": FlatEPDispatcher(args.experts, topo.group("ep"), topo.members("ep"), topo.node_of)}
    if nodes > 1:
        dispatchers["hierarchical"] = HierarchicalEPDispatcher(args.experts, topo)
    for name, disp in dispatchers.items():
        def step():
            d = disp.dispatch(x, routing)
            disp.combine(d.rows, d.meta)

        step()
        disp.traffic.snapshot(reset=True)
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        sent = disp.traffic.snapshot(reset=True)
        stats = torch.tensor([statistics.median(times), sent.get("dispatch_inter", 0) / args.repeats,
                              sent.get("dispatch_intra", 0) / args.repeats], dtype=torch.float64)
        gathered = [torch.zeros_like(stats) for _ in range(world)]
        dist.all_gather(gathered, stats.to(device) if device.type == "cuda" else stats)
        g = torch.stack([t.cpu() for t in gathered])
        model_fn = cost_model.hierarchical if name == "hierarchical" else cost_model.flat
        pred = model_fn(nodes, per_node, args.experts, args.top_k, args.node_limit or None)
        elem = torch.tensor([], dtype=dtype).element_size()
        pred_inter, pred_intra = pred.bytes(args.hidden, elem)
        sent_per_rank = 2 * float(g[:, 1].mean() + g[:, 2].mean())  # dispatch + combine (mirrored), bytes
        out.append({
            "nodes": nodes, "ranks_per_node": per_node, "dispatcher": name,
            "median_ms": float(g[:, 0].max()),
            # what each rank sent over the slowest rank's time: compare with the link rates (docs/benchmarks.md)
            "send_GBps_per_rank": sent_per_rank / float(g[:, 0].max()) / 1e6,
            "inter_B_per_token": float(g[:, 1].mean()) / args.tokens, "model_inter_B_per_token": pred_inter,
            "intra_B_per_token": float(g[:, 2].mean()) / args.tokens, "model_intra_B_per_token": pred_intra,
        })
    return out


def worker(rank: int, world: int, args, init_file: str | None) -> None:
    device = init_bench_process(rank, world, init_file, 1)  # spawned on CPU, or under torchrun
    rows = []
    for per_node in args.ranks_per_node:  # each divides the world size (main checked, before any rank started)
        rows += measure(args, world, rank, per_node, device)
    if rank == 0:
        print_table(rows, [("nodes", "nodes", "d"), ("ranks_per_node", "ranks/node", "d"), ("dispatcher", "dispatch", ""),
                           ("median_ms", "ms", ".2f"), ("send_GBps_per_rank", "GB/s/rank", ".2f"),
                           ("inter_B_per_token", "inter B/tok", ".0f"),
                           ("model_inter_B_per_token", "model", ".0f"), ("intra_B_per_token", "intra B/tok", ".0f"),
                           ("model_intra_B_per_token", "model", ".0f")])
        write_json(args.out, {"benchmark": "ep_dispatch", "world": world, "config": vars(args),
                              "environment": environment(device), "results": rows})
    dist.destroy_process_group()


def model_table(args) -> list[dict]:
    """The cost model alone, N = 8..128 nodes of --gpus-per-node ranks (no processes)."""
    elem = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    rows = []
    for nodes in (8, 16, 32, 64, 128):
        G, E, k, H = args.gpus_per_node, args.experts, args.top_k, args.hidden
        f = cost_model.flat(nodes, G, E, k).bytes(H, elem)
        h = cost_model.hierarchical(nodes, G, E, k).bytes(H, elem)
        m = cost_model.hierarchical(nodes, G, E, k, node_limit=args.node_limit or 4).bytes(H, elem)
        rows.append({"nodes": nodes, "gpus": nodes * G, "flat_inter_KB": f[0] / 1e3, "hier_inter_KB": h[0] / 1e3,
                     "limited_inter_KB": m[0] / 1e3, "hier_saving": f[0] / h[0], "limited_saving": f[0] / m[0],
                     "hier_intra_KB": h[1] / 1e3})
    print_table(rows, [("nodes", "nodes", "d"), ("gpus", "GPUs", "d"), ("flat_inter_KB", "flat inter KB/tok", ".1f"),
                       ("hier_inter_KB", "hier inter", ".1f"), ("limited_inter_KB", f"hier M={args.node_limit or 4}", ".1f"),
                       ("hier_saving", "flat/hier", ".2f"), ("limited_saving", "flat/limited", ".2f"),
                       ("hier_intra_KB", "hier intra KB/tok", ".1f")])
    return rows


def main(argv=None) -> int:
    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=8, help="ranks to spawn on CPU (ignored under torchrun)")
    p.add_argument("--ranks-per-node", type=int, nargs="+", default=[4, 2], help="simulated node sizes")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--node-limit", type=int, default=0, help="M > 0: experts on at most M nodes per token")
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/all_to_all.json")
    p.add_argument("--model-table", action="store_true", help="print the cost model for 8-128 nodes and exit")
    p.add_argument("--gpus-per-node", type=int, default=8, help="for --model-table")
    args = p.parse_args(argv)
    check_at_least(p, args, 1, "hidden", "experts", "top_k", "gpus_per_node")
    check_at_least(p, args, 0, "node_limit")
    if args.top_k > args.experts:
        p.error(f"--top-k {args.top_k}: must be <= --experts {args.experts}")
    if args.model_table:
        model_table(args)
        return 0
    check_at_least(p, args, 1, "world", "ranks_per_node", "tokens", "repeats")
    # every check before any rank starts: a rank that fails its own check leaves a traceback per rank
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else args.world
    where = "torchrun's world size" if "WORLD_SIZE" in os.environ else "--world"
    if args.experts % world:
        p.error(f"--experts {args.experts} must be divisible by {where} {world}")
    bad = [n for n in args.ranks_per_node if world % n]
    if bad:
        p.error(f"--ranks-per-node {' '.join(map(str, bad))}: each must divide {where} {world}")
    check_out(p, args.out)
    launch_ranks(worker, args, args.world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
