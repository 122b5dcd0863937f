"""Host memory and time of upcycling a dense HF model into a parallelised MoE model: by slices against whole.

    python tools/bench/upcycle_memory.py                                   # 2 gloo ranks, fsdp 2 x ep 2
    python tools/bench/upcycle_memory.py --hidden 2048 --ffn 8192 --layers 4 --world 4 --fsdp 4 --ep 2

Writes a dense HuggingFace folder (Llama layout, --dtype, random weights) of the given size into a temporary
folder, then upcycles it into an MoE model of --experts experts (granularity --granularity, top-k = 2 x
granularity) on --world CPU ranks over gloo. Every rank builds the MoE model on the meta device, parallelises it
(--fsdp x --ep, as moekit-train does), allocates its shards with to_empty, then upcycles, with one of two peers:

    sliced   moekit-train --init-from-dense: train.upcycle.open_dense(folder), each rank reading only the slices
             its shards are made of (models.hf.sharded.FolderSlices)
    whole    the dense model read whole into every rank first (models.hf.load_hf in the folder's dtype), then
             upcycled from memory: what moekit-train did before it read by slices

Each peer runs in fresh processes, so one peer's peak cannot hide the other's. Measured per rank, above the
level after to_empty: the peak of anonymous resident memory (the process's own: tensors, copies; sampled every
millisecond by a thread reading /proc/self/status; the shards themselves are written once before, so their pages
count in the level) and of file-backed resident memory (the safetensors pages
mapped while they are read: the kernel can drop them, a copy it cannot), and the upcycle's wall time.
"anon x" = whole / sliced peak anonymous memory. "same" checks that both peers fill every rank's shards with
the same values (bit for bit). "bound" is the host memory train.upcycle.dense_read_peak promises for the
sliced peer (the dry run's init: line).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from moekit.bench.benchlib import (BenchParser, check_at_least, check_out, environment, init_bench_process,
                                   launch_ranks, print_table, write_json)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
PEERS = ("sliced", "whole")
MIB = 2**20


def parse_args(argv):
    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--hidden", type=int, default=1024, help="dense hidden size (default 1024)")
    p.add_argument("--ffn", type=int, default=4096, help="dense FFN hidden size F (default 4096)")
    p.add_argument("--layers", type=int, default=8, help="layers (default 8)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    p.add_argument("--heads", type=int, default=16, help="attention heads (default 16; 4 KV heads)")
    p.add_argument("--experts", type=int, default=8, help="MoE experts (default 8)")
    p.add_argument("--granularity", type=int, default=2, help="experts of F / granularity units (default 2)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="the folder's dtype (default bfloat16)")
    p.add_argument("--world", type=int, default=2, help="CPU ranks (default 2)")
    p.add_argument("--fsdp", type=int, default=2, help="FSDP degree (default 2)")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel degree, within FSDP (default 2)")
    p.add_argument("--out", default="bench-results/upcycle_memory.json")
    args = p.parse_args(argv)
    check_at_least(p, args, 1, "hidden", "ffn", "layers", "vocab", "heads", "experts", "granularity", "world",
                   "fsdp", "ep")
    if args.hidden % args.heads or args.heads % 4:
        p.error(f"--heads {args.heads} must divide --hidden {args.hidden} and be a multiple of 4 (4 KV heads)")
    if args.ffn % args.granularity or args.experts % args.granularity:
        p.error(f"--granularity {args.granularity} must divide --ffn {args.ffn} and --experts {args.experts}")
    if args.world % args.fsdp or args.fsdp % args.ep or args.experts % args.ep:
        p.error(f"--fsdp {args.fsdp} must divide --world {args.world}, --ep {args.ep} divide --fsdp and --experts "
                f"{args.experts}")
    check_out(p, args.out)
    return args


class PeakSampler:
    """Peak RssAnon / RssFile of this process (bytes above the level when started), sampled every millisecond."""

    def __init__(self):
        self.base = self.now()
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def now() -> dict[str, int]:
        out = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(("RssAnon:", "RssFile:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
        return out

    def _run(self):
        while not self._stop.is_set():
            for k, v in self.now().items():
                self.peak[k] = max(self.peak[k], v)
            time.sleep(0.001)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        for k, v in self.now().items():
            self.peak[k] = max(self.peak[k], v)
        return {k: self.peak[k] - self.base[k] for k in self.base}


def moe_config(args, dense_config):
    from moekit.models.upcycle import upcycled_config

    return upcycled_config(dense_config, args.experts, 2 * args.granularity, args.granularity)


def rank_worker(rank: int, world: int, args, init_file: str | None) -> None:
    import torch.distributed as dist

    from moekit.comm.topology import Layout, Topology
    from moekit.models.hf import config_from_hf, load_hf
    from moekit.models.parallelize import parallelize
    from moekit.models.transformer import Transformer, meta_device
    from moekit.models.upcycle import upcycle_into
    from moekit.train.upcycle import open_dense

    init_bench_process(rank, world, init_file)
    folder, peer = args.folder, args.peer
    config = moe_config(args, config_from_hf(folder))
    topo = Topology(Layout(fsdp=args.fsdp, ep=args.ep), rank, world).build()
    with meta_device():
        model = Transformer(config)
    parallelize(model, topo)
    model.to_empty(device="cpu")
    with torch.no_grad():  # touch the shards: to_empty's pages become resident only when first written
        for t in model.state_dict().values():
            (t.to_local() if hasattr(t, "to_local") else t).zero_()
    dist.barrier()
    sampler = PeakSampler()
    t0 = time.perf_counter()
    if peer == "sliced":
        upcycle_into(model, open_dense(folder), args.granularity, seed=0)
    else:
        dense = load_hf(folder, dtype=DTYPES[args.dtype])
        upcycle_into(model, dense, args.granularity, seed=0)
        del dense
    seconds = time.perf_counter() - t0
    peak = sampler.stop()
    state = {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in model.state_dict().items()}
    torch.save({"rank": rank, "seconds": seconds, "anon": peak["RssAnon"], "file": peak["RssFile"], "state": state},
               Path(args.results) / f"{peer}-{rank}.pt")
    dist.barrier()


def write_folder(args, folder: Path) -> tuple[object, int]:
    from moekit.models.config import ModelConfig
    from moekit.models.hf import save_hf
    from moekit.models.transformer import build_model

    cfg = ModelConfig(num_experts=0, vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                      num_heads=args.heads, num_kv_heads=4, ffn_hidden_size=args.ffn, max_seq_len=256)
    dense = build_model(cfg, seed=0)
    save_hf(dense, folder, family="llama", dtype=DTYPES[args.dtype])
    return cfg, sum(p.numel() for p in dense.parameters()) * DTYPES[args.dtype].itemsize


def main(argv=None) -> int:
    from moekit.train.upcycle import dense_read_peak

    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        args.folder, args.results = str(Path(tmp) / "dense"), tmp
        print(f"writing the dense folder ({args.layers} layers, hidden {args.hidden}, F {args.ffn}, vocab "
              f"{args.vocab}, {args.dtype}) ...", file=sys.stderr, flush=True)
        dense_cfg, dense_bytes = write_folder(args, Path(args.folder))
        bound = dense_read_peak(moe_config(args, dense_cfg), args.granularity)
        for peer in PEERS:
            print(f"upcycling on {args.world} ranks: {peer} ...", file=sys.stderr, flush=True)
            args.peer = peer
            launch_ranks(rank_worker, args, args.world)
        got = {(p, r): torch.load(Path(tmp) / f"{p}-{r}.pt") for p in PEERS for r in range(args.world)}
    rows = []
    for r in range(args.world):
        a, b = got["sliced", r], got["whole", r]
        same = a["state"].keys() == b["state"].keys() and all(torch.equal(v, b["state"][k])
                                                              for k, v in a["state"].items())
        rows.append({"rank": r, "sliced_anon_mib": a["anon"] / MIB, "whole_anon_mib": b["anon"] / MIB,
                     "anon_ratio": b["anon"] / max(a["anon"], 1), "sliced_file_mib": a["file"] / MIB,
                     "whole_file_mib": b["file"] / MIB, "sliced_s": a["seconds"], "whole_s": b["seconds"],
                     "same": same})
    print(f"dense model {dense_bytes / MIB:,.0f} MiB ({args.dtype}); MoE {args.experts} experts, granularity "
          f"{args.granularity}; fsdp {args.fsdp} x ep {args.ep} on {args.world} ranks; bound for sliced: "
          f"{bound / MIB:,.0f} MiB")
    print_table(rows, [("rank", "rank", "d"), ("sliced_anon_mib", "sliced anon MiB", ".0f"),
                       ("whole_anon_mib", "whole anon MiB", ".0f"), ("anon_ratio", "anon x", ".1f"),
                       ("sliced_file_mib", "sliced file MiB", ".0f"), ("whole_file_mib", "whole file MiB", ".0f"),
                       ("sliced_s", "sliced s", ".2f"), ("whole_s", "whole s", ".2f"), ("same", "same", "")])
    write_json(args.out, {"benchmark": "upcycle_memory", "args": {k: v for k, v in vars(args).items()
                                                                  if k not in ("folder", "results", "peer")},
                          "environment": environment(torch.device("cpu")), "dense_bytes": dense_bytes,
                          "sliced_bound_bytes": bound, "rows": rows})
    if not all(r["same"] for r in rows):
        print("error: the sliced and whole upcycles differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
