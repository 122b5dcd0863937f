"""Context parallelism (--cp): what each rank keeps for backward, the step time, and what the key/value
all-gather costs, against cp = 1 (one process, the whole sequence).

    python tools/bench/context_parallel.py                          # CPU: gloo ranks, world = cp per degree
    python tools/bench/context_parallel.py --presets mixtral-tiny --seq 8192 --cps 1 2 4 --breakdown 6
    torchrun --nproc-per-node 8 tools/bench/context_parallel.py --seq 32768 --cps 1 2 4 8 --dtype bfloat16

One training step (forward, loss, backward, comm.grad_sync) of each preset (``--layers`` overriding its
depth, batch ``--batch``), parallelised as the trainer does (models.parallelize: each of the cp ranks holds
its zigzag share, S / cp positions, of every sequence; attention all-gathers keys and values). On CPU every
degree is its own spawn of cp ranks (cp = 1: one process); under torchrun all degrees run on the same W ranks
as dp = W / cp x cp (cp = 1 is then plain data parallelism). Two views, each against its own cp = 1 row:

    fixed S        cp = N at --seq S against cp = 1 at S: what turning on --cp saves
    tokens/rank    cp = N at N * S / max(cps) against cp = 1 at S / max(cps): the same tokens per rank, an
                   N-times longer sequence (the long-context scaling question)

Columns (the slowest or largest rank of each degree):
  kept MiB    bytes alive between forward and backward: every storage an op created in the forward that is
              still referenced when it ends (autograd's saved tensors, whoever holds them; ac_memory's
              count), weights, tokens and the loss aside; the same count on CPU and GPU
  gathered    MiB the all-gathers of one step produced (every layer's whole-sequence keys / values, or MLA's
              latent): they do not shrink with cp. Kept for backward as they are (or, with sinks, as the
              padded copies sink_attention makes); the JSON's gathered_kept_mib counts the unpadded ones
  peak MiB    CUDA only: torch.cuda's peak allocation over one step above what was allocated before it
  step ms     median of one step (round-robin with the gather alone, benchlib.time_interleaved)
  gather ms   every layer's all-gather alone, forward + backward (its reduce-scatter), at the shapes the
              step gathered; "% step" is its share of the step
  loss diff   |loss - cp = 1's loss| at the same S; grad err: the largest relative difference of a
              parameter's gradient norm (after comm.grad_sync) from cp = 1's: the layout must not change the math
``--breakdown N`` prints, per case, the N largest kept storages of the largest rank by the op that made them.

CPU numbers: gloo's all-gather is a copy through loopback TCP done by the ranks' own cores; with more ranks than
cores (cp = 4 on 2 cores) the ranks also share cores, so the time ratios say less than the memory ones.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from moekit.bench.ac_memory import NewStorages
from moekit.bench.benchlib import (BenchParser, check_at_least, check_out, environment, init_bench_process,
                                   launch_ranks, print_table, sync, time_interleaved, write_json)
from moekit.comm.context_parallel import check_context_parallel
from moekit.comm.grad_sync import sync_gradients
from moekit.comm.topology import Layout, LayoutError, Topology
from moekit.models.config import PRESETS, preset
from moekit.models.parallelize import parallelize
from moekit.models.transformer import build_model

MiB = 2**20


class LabelledStorages(NewStorages):
    """NewStorages that also remembers which op made each storage (``by_label``: the kept bytes per op)."""

    def __init__(self):
        super().__init__()
        self.labels: dict[int, tuple[StorageWeakRef, str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                old = self.labels.get(s._cdata)
                if old is None or old[0].expired():  # the first op that made it (a freed address is reused)
                    self.labels[s._cdata] = (StorageWeakRef(s), f"{func.__name__} {list(t.shape)} {str(t.dtype)[6:]}")
        return out

    def by_label(self, exclude: list[torch.Tensor], gathered: set[int]) -> Counter:
        skip = {t.untyped_storage()._cdata for t in exclude}
        kept = Counter()
        for key, ref in self.seen.items():
            if not ref.expired() and key not in skip:
                label = "gathered K/V" if key in gathered else self.labels.get(key, (None, "?"))[1]
                kept[label] += torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
        return kept


def build(name: str, args, topology, device):
    cfg = dataclasses.replace(preset(name), num_layers=args.layers or preset(name).num_layers,
                              max_seq_len=max(preset(name).max_seq_len, args.seq))
    model = build_model(cfg, device, seed=args.seed)  # the same weights on every rank and degree
    return model, parallelize(model, topology)


def batch(vocab: int, S: int, args, context) -> tuple[torch.Tensor, torch.Tensor]:
    """The same [B, S] tokens and targets in every degree (every dp group too); this rank's share of them."""
    gen = torch.Generator().manual_seed(args.seed + S)
    tokens, targets = (torch.randint(0, vocab, (args.batch, S), generator=gen) for _ in range(2))
    return (tokens, targets) if context is None else (context.shard(tokens), context.shard(targets))


def kept_memory(model, done, tokens, targets, dtype) -> dict:
    """One step under a storage tracker: kept bytes (total, gathered, top ops), the global loss, the gradient
    norms after the sync, and the shapes the gather saw (for timing it alone)."""
    context, gathered, shapes = done.context, set(), []
    if context is not None:  # the strategy object every attention module calls: note its outputs
        plain = context.gather

        def noting(t, dim):
            out = plain(t, dim)
            gathered.add(out.untyped_storage()._cdata)
            shapes.append((tuple(t.shape), dim, t.dtype, out.numel() * out.element_size()))
            return out

        context.gather = noting
    track = LabelledStorages()
    try:
        with track, torch.autocast(tokens.device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(tokens, targets=targets)
        exclude = list(model.parameters()) + list(model.buffers()) + [tokens, targets, loss]
        kept = track.alive(exclude)
        labels = track.by_label(exclude, gathered)
    finally:
        if context is not None:
            del context.gather  # the class's method again
    loss.backward()
    if done.topology is not None:
        sync_gradients(model, done.topology, done.grad_roles, fsdp=done.fsdp)
        cp = done.topology.group("cp") if context is not None else None
        loss = loss.detach().clone()
        if cp is not None:  # equal tokens per rank: the sequence's mean is the mean of the ranks' means
            dist.all_reduce(loss, group=cp)
            loss /= context.degree
    norms = {n: float(p.grad.float().norm()) for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return {"kept": kept, "gathered": sum(s[3] for s in shapes), "gathered_kept": labels.get("gathered K/V", 0),
            "top": labels.most_common(12), "loss": float(loss.detach()), "grad_norms": norms, "shapes": shapes}


def cuda_peak(step, device) -> int | None:
    if device.type != "cuda":
        return None
    sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    sync(device)
    return torch.cuda.max_memory_allocated(device) - before


def timers(model, done, tokens, targets, shapes, dtype, device) -> tuple[dict, list[float]]:
    """{"step": one training step, "gather": every layer's gather alone (fwd + bwd)}, and the list the step
    appends its gradient sync's milliseconds to."""
    sync_ms: list[float] = []

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(tokens, targets=targets)
        loss.backward()
        start = time.perf_counter()
        if done.topology is not None:
            sync_gradients(model, done.topology, done.grad_roles, fsdp=done.fsdp)
            sync(device)
        sync_ms.append((time.perf_counter() - start) * 1e3)
        model.zero_grad(set_to_none=True)

    fns = {"step": step}
    if done.context is not None:
        xs = [torch.randn(shape, device=device).to(dt).requires_grad_() for shape, _, dt, _ in shapes]
        grads = [torch.randn_like(done.context.gather(x.detach(), dim)) for x, (_, dim, _, _) in zip(xs, shapes)]

        def gather():
            for x, g, (_, dim, _, _) in zip(xs, grads, shapes):
                done.context.gather(x, dim).backward(g)
                x.grad = None

        fns["gather"] = gather
    return fns, sync_ms


def measure_case(model, done, name: str, S: int, args, device, world: int) -> dict:
    dtype = getattr(torch, args.dtype)
    tokens, targets = batch(model.config.vocab_size, S, args, done.context)
    tokens, targets = tokens.to(device), targets.to(device)
    mem = kept_memory(model, done, tokens, targets, dtype)
    fns, sync_ms = timers(model, done, tokens, targets, mem["shapes"], dtype, device)
    peak = cuda_peak(fns["step"], device)
    times = time_interleaved(fns, device, args.warmup, args.repeats, rotate=True)
    mine = {"kept": mem["kept"], "gathered": mem["gathered"], "gathered_kept": mem["gathered_kept"], "top": mem["top"],
            "peak": peak,
            "step_ms": times["step"]["median_ms"], "step_min_ms": times["step"]["min_ms"],
            "gather_ms": times["gather"]["median_ms"] if "gather" in times else None,
            "sync_ms": statistics.median(sync_ms[-args.repeats:])}
    ranks = [mine]
    if dist.is_initialized() and world > 1:
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
    big = max(ranks, key=lambda r: r["kept"])
    cp = done.context.degree if done.context is not None else 1
    slowest = lambda key: None if ranks[0][key] is None else max(r[key] for r in ranks)  # noqa: E731
    return {"preset": name, "seq": S, "cp": cp, "world": world, "tokens_per_rank": args.batch * S // cp,
            "kept_mib": big["kept"] / MiB, "kept_min_mib": min(r["kept"] for r in ranks) / MiB,
            "gathered_mib": big["gathered"] / MiB, "gathered_kept_mib": big["gathered_kept"] / MiB,
            "peak_mib": None if peak is None else slowest("peak") / MiB,
            "step_ms": slowest("step_ms"), "step_min_ms": slowest("step_min_ms"), "gather_ms": slowest("gather_ms"),
            "sync_ms": slowest("sync_ms"), "loss": mem["loss"], "grad_norms": mem["grad_norms"],
            "top_kept": [[label, b / MiB] for label, b in big["top"]]}


def seqs_for(args, cp: int) -> list[int]:
    """The sequence lengths degree ``cp`` runs: --seq (fixed S view), and cp * --seq / max(cps) (tokens/rank)."""
    return sorted({args.seq, cp * args.seq // max(args.cps)})


def measure_degree(args, cp: int, world: int, rank: int, device) -> list[dict]:
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    topology = None if world == 1 else Topology(Layout(dp=world // cp, cp=cp), rank, per_node).build()
    rows = []
    for name in args.presets:
        model, done = build(name, args, topology, device)
        for S in seqs_for(args, cp):
            rows.append(measure_case(model, done, name, S, args, device, world))
            if rank == 0:
                print(f"  {name} S {S} cp {cp}: kept {rows[-1]['kept_mib']:.1f} MiB, step "
                      f"{rows[-1]['step_ms']:.0f} ms", flush=True)
    return rows


def worker(rank: int, world: int, args, init_file: str | None) -> None:
    device = init_bench_process(rank, world, init_file, args.threads)  # spawned on CPU, or under torchrun
    rows = []
    for cp in args.run_cps:  # spawned: this spawn's one degree; torchrun: every degree on the same ranks
        rows += measure_degree(args, cp, world, rank, device)
        if rank == 0 and args.part is None:
            write_json(args.out, {"partial": True, "cases": rows}, quiet=True)
    if rank == 0:
        if args.part is not None:
            write_json(args.part, {"cases": rows, "environment": environment(device)}, quiet=True)
        else:
            finish(args, rows, environment(device))
    dist.destroy_process_group()


def grad_err(case: dict, ref: dict) -> float:
    return max(abs(n - ref["grad_norms"][k]) / max(ref["grad_norms"][k], 1e-30) for k, n in case["grad_norms"].items())


def views(args, cases: list[dict]) -> list[dict]:
    """The table's rows: each case against its view's cp = 1 case (fixed S; same tokens per rank)."""
    at = {(c["preset"], c["seq"], c["cp"]): c for c in cases}
    rows = []
    for view, seq_of in (("fixed S", lambda cp: args.seq), ("tokens/rank", lambda cp: cp * args.seq // max(args.cps))):
        for name in args.presets:
            base = at.get((name, seq_of(1), 1))
            for cp in args.cps:
                case = at.get((name, seq_of(cp), cp))
                if case is None:
                    continue
                same_s = at.get((name, case["seq"], 1))  # cp = 1 at this S, for the math check
                ratio = lambda key: (case[key] / base[key] if base and case[key] is not None  # noqa: E731
                                     and base[key] else None)
                rows.append({"view": view, **{k: v for k, v in case.items() if k != "grad_norms"},
                             "kept_ratio": ratio("kept_mib"), "step_ratio": ratio("step_ms"),
                             "gather_share": case["gather_ms"] / case["step_ms"] if case["gather_ms"] else None,
                             "loss_diff": abs(case["loss"] - same_s["loss"]) if same_s else None,
                             "grad_err": grad_err(case, same_s) if same_s else None})
    return rows


COLUMNS = [("view", "view", ""), ("preset", "preset", ""), ("seq", "S", "d"), ("cp", "cp", "d"),
           ("tokens_per_rank", "tok/rank", "d"), ("kept_mib", "kept MiB", ".1f"), ("kept_ratio", "x cp1", ".2f"),
           ("gathered_mib", "gathered", ".1f"), ("peak_mib", "peak MiB", ".1f"), ("step_ms", "step ms", ".0f"),
           ("step_ratio", "x cp1", ".2f"), ("gather_ms", "gather ms", ".1f"), ("gather_share", "% step", ".1%"),
           ("loss_diff", "loss diff", ".1e"), ("grad_err", "grad err", ".1e")]


def finish(args, cases: list[dict], env: dict) -> None:
    rows = views(args, cases)
    world = max(c["world"] for c in cases)
    ranks = (f"torchrun: {world} ranks, dp = {world} / cp" if "WORLD_SIZE" in os.environ
             else "world = cp per degree (spawned gloo ranks)")
    print(f"context parallel step, {args.dtype} on {env['device']}: batch {args.batch}, layers "
          f"{args.layers or 'preset'}; {ranks}, {env['threads']} thread(s) per rank, {env['cpu_count']} cores")
    print_table(rows, COLUMNS)
    if args.breakdown:
        for c in cases:
            print(f"kept by op, {c['preset']} S {c['seq']} cp {c['cp']} (largest rank):")
            for label, mib in c["top_kept"][:args.breakdown]:
                print(f"  {mib:9.2f} MiB  {label}")
    config = {k: v for k, v in vars(args).items() if k not in ("part", "run_cps")}
    write_json(args.out, {"benchmark": "context_parallel", "config": config, "environment": env,
                          "cases": cases, "results": rows})


def parse_args(argv=None) -> argparse.Namespace:
    p = BenchParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["mixtral-tiny", "gpt-oss-tiny"], choices=sorted(PRESETS),
                   metavar="PRESET", help="model shapes (default mixtral-tiny gpt-oss-tiny)")
    p.add_argument("--layers", type=int, default=2, help="override the presets' depth (0: keep it; default 2)")
    p.add_argument("--seq", type=int, default=4096, help="the sequence of the fixed-S view (default 4096)")
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4], help="degrees; the first must be 1 (the peer)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="bfloat16: autocast")
    p.add_argument("--threads", type=int, default=1, help="torch threads per spawned CPU rank")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--breakdown", type=int, default=0, help="print the N largest kept storages of every case")
    p.add_argument("--out", default="bench-results/context_parallel.json")
    args = p.parse_args(argv)
    check_at_least(p, args, 1, "cps", "seq", "batch", "threads", "repeats")
    check_at_least(p, args, 0, "layers", "warmup", "breakdown")
    if args.cps[0] != 1 or len(set(args.cps)) != len(args.cps):
        p.error(f"--cps {' '.join(map(str, args.cps))}: start with 1 (the peer every ratio divides by), no repeats")
    if args.seq % (2 * max(args.cps)):
        p.error(f"--seq {args.seq}: must be a multiple of 2 * max(--cps) = {2 * max(args.cps)} (zigzag: 2 * cp "
                f"equal chunks, also of the tokens/rank view's shorter sequences)")
    world = int(os.environ.get("WORLD_SIZE", 0))
    if world and any(world % cp for cp in args.cps):
        p.error(f"--cps {' '.join(map(str, args.cps))}: under torchrun every degree must divide the world size "
                f"{world} (the rest of the ranks are data parallel)")
    try:
        for name in args.presets:
            check_context_parallel(preset(name), max(args.cps), args.seq)
    except LayoutError as exc:
        p.error(str(exc))
    check_out(p, args.out)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.part = None
    if "WORLD_SIZE" in os.environ:  # torchrun: every degree on the same ranks, rank 0 writes the results
        args.run_cps = args.cps
        launch_ranks(worker, args, int(os.environ["WORLD_SIZE"]))
        return 0
    cases, env = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for cp in args.cps:  # a spawn of cp ranks per degree (cp = 1: one process)
            args.run_cps, args.part = [cp], os.path.join(tmp, f"cp{cp}.json")
            launch_ranks(worker, args, cp)
            with open(args.part) as f:
                part = json.load(f)
            cases, env = cases + part["cases"], part["environment"]
            write_json(args.out, {"partial": True, "cases": cases}, quiet=True)
    args.part = None
    finish(args, cases, env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
