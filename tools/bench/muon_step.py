"""Muon under FSDP: one optimizer step over a preset's matrices cut across the ranks, with the orthogonalisation
spread over them (train.muon, the default) against every rank all-gathering and orthogonalising every matrix.

    python tools/bench/muon_step.py                                   # CPU: spawns 4 gloo ranks
    python tools/bench/muon_step.py --world 2 --presets qwen3.5-tiny
    torchrun --nproc-per-node 8 tools/bench/muon_step.py --presets mixtral-1b   # GPUs (NCCL)

Each of the preset's Muon matrices (train.muon.muon_param_groups: attention, dense and expert weights, routers;
not the embedding, head, norms or biases) is a DTensor cut along dim 0 over the ranks, as FSDP stores it, with a
random gradient. Peers, run round-robin in one process on their own copies (tools/bench/benchlib.py):

    spread      Muon(spread=True): batches of R matrices, one per rank; an all-to-all brings each rank the
                shards of its matrix, it orthogonalises it, a second all-to-all returns every rank its shard
    all-gather  Muon(spread=False): every rank all-gathers every matrix and orthogonalises all of them

"ms" is the median step of the slowest rank; "vs all-gather" the all-gather peer's time over this one's (> 1:
faster). "NS / rank" counts Newton-Schulz calls on one rank per step (a gated expert stack is two; a stack's
experts, cut along dim 0, are whole matrices each rank orthogonalises where they are, in both peers), and
"recv MiB / rank" the bytes rank 0 receives per step (the all-gather: (R-1)/R of every cut matrix; spread: the
other ranks' shards of the matrices it owns, and its shards of the others' updates: 2/R of the all-gather's). On CPU the ranks share the
machine's cores, so the compute saved is real and the exchange is gloo over loopback.
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


def matrices(name: str, seed: int):
    """The preset's Muon matrices (whole, fp32) and their chunk counts (2: a gated expert stack)."""
    from moekit.models.config import preset
    from moekit.models.transformer import Transformer, meta_device
    from moekit.train.muon import muon_param_groups

    with meta_device():  # shapes only: the values are drawn below
        model = Transformer(preset(name))
    group = muon_param_groups(model, 0.0)[0]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen) * 0.02 for p in group["params"]], group["chunks"]


def received_mib(shapes, world: int, spread: bool) -> float:
    """MiB rank 0 receives per step, fp32 on the wire. An expert stack [E, in, out] cut along dim 0 holds whole
    matrices (its experts), so neither peer moves it; every 2-D matrix is cut along its rows."""
    cut = [s for s in shapes if len(s) == 2]
    total = 0
    for i, (rows, cols) in enumerate(cut):
        mine = min(-(-rows // world), rows) * cols  # rank 0's shard: the first ceil chunk of the rows
        if not spread or i % world == 0:  # all-gather: every matrix; spread: rank 0 owns every world-th one
            total += rows * cols - mine
        else:  # its shard of the update, back from the owner
            total += mine
    return total * 4 / 2 ** 20


def measure(args, world: int, rank: int, device) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import moekit.train.muon as muon

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
    rows = []
    for name in args.presets:
        whole, chunks = matrices(name, args.seed)
        gen = torch.Generator().manual_seed(args.seed + 1)
        grads = [torch.randn(w.shape, generator=gen) * 1e-3 for w in whole]
        base = [torch.nn.Parameter(distribute_tensor(w.to(device), mesh, [Shard(0)])) for w in whole]
        opts, calls = {}, {"n": 0}
        for peer, spread in (("spread", True), ("all-gather", False)):
            params = copy.deepcopy(base)
            for p, g in zip(params, grads):
                p.grad = distribute_tensor(g.to(device), mesh, [Shard(0)])
            opts[peer] = muon.Muon([{"params": params, "kind": "muon", "chunks": chunks, "weight_decay": 0.1}],
                                   lr=1e-3, spread=spread)
        counted = {}
        real = muon.orthogonalize
        for peer, opt in opts.items():  # one counted step each (not timed)
            calls["n"] = 0
            muon.orthogonalize = lambda g, *a, **k: calls.__setitem__("n", calls["n"] + 1) or real(g, *a, **k)
            opt.step()
            muon.orthogonalize = real
            counted[peer] = calls["n"]
        stats = time_interleaved({peer: opt.step for peer, opt in opts.items()}, device, args.warmup, args.repeats,
                                 rotate=True)
        mine = torch.tensor([stats[p]["median_ms"] for p in opts], dtype=torch.float64, device=device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the step waits for the slowest rank
        times = dict(zip(opts, mine.tolist()))
        shapes = [tuple(w.shape) for w in whole]
        for peer in opts:
            rows.append({"preset": name, "matrices": len(whole), "peer": peer, "ms": times[peer],
                         "vs_all_gather": times["all-gather"] / times[peer], "ns_per_rank": counted[peer],
                         "recv_mib": received_mib(shapes, world, peer == "spread")})
    return rows


def report(args, world: int, device, rows: list[dict]) -> None:
    print(f"one Muon step, matrices cut along dim 0 over {world} ranks (FSDP), fp32, {device.type}")
    print_table(rows, [("preset", "preset", "s"), ("matrices", "matrices", "d"), ("peer", "peer", "s"),
                       ("ms", "ms", ".2f"), ("vs_all_gather", "vs all-gather", ".2f"),
                       ("ns_per_rank", "NS / rank", "d"), ("recv_mib", "recv MiB / rank", ".2f")])
    write_json(args.out, {"benchmark": "muon_step", "world": world, "config": vars(args),
                          "environment": environment(device), "rows": rows})


def worker(rank: int, world: int, args, init_file: str | None) -> None:
    device = init_bench_process(rank, world, init_file, args.threads)
    rows = measure(args, world, rank, device)
    if rank == 0:
        report(args, world, device, rows)
    dist.destroy_process_group()


def parse(argv=None):
    p = BenchParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4, help="ranks to spawn on CPU (ignored under torchrun)")
    p.add_argument("--presets", nargs="+", default=["deepseek-tiny", "qwen3.5-tiny"],
                   help="model presets whose matrices are stepped (default deepseek-tiny qwen3.5-tiny)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per spawned CPU rank")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each peer first (default 2)")
    p.add_argument("--repeats", type=int, default=10, help="timed steps of each peer, round-robin (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the matrices and their gradients")
    p.add_argument("--out", default="bench-results/muon_step.json", help="the JSON written (default %(default)s)")
    args = p.parse_args(argv)
    check_at_least(p, args, 1, "threads", "repeats")
    check_at_least(p, args, 0, "warmup")
    from moekit.models.config import PRESETS

    unknown = [n for n in args.presets if n not in PRESETS]
    if unknown:
        p.error(f"--presets {unknown}: unknown; choose from {sorted(PRESETS)}")
    spawned = "WORLD_SIZE" not in os.environ  # else torchrun's ranks and world size
    world, where = (args.world, "--world") if spawned else (int(os.environ["WORLD_SIZE"]), "torchrun's world size")
    if world < 2:
        p.error(f"{where} {world}: must be >= 2 (one rank has nothing to spread)")
    check_out(p, args.out)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    launch_ranks(worker, args, args.world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
