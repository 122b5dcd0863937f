"""Activation checkpointing modes side by side: memory kept for backward, peak memory and step time.

    python tools/bench/ac_memory.py                                   # CPU: mixtral-tiny, 8 x 256 tokens
    python tools/bench/ac_memory.py --preset deepseek-tiny --batch-size 4 --seq-len 512 --json bench-results/ac.json
    python tools/bench/ac_memory.py --device cuda --dtype bfloat16 --preset mixtral-8x7b --layers 2 \\
        --batch-size 1 --seq-len 4096 --json bench-results/ac_memory_gpu.json

Each mode (none, ffn, selective, full: models.parallelize.apply_activation_checkpointing) gets its own copy
of the same model (same seed, ``--layers`` overriding the preset's depth) and runs the trainer's step:
forward, cross-entropy on random targets, backward (no optimizer). Columns:
  saved      bytes alive between forward and backward: every storage an op created during the forward
             that is still referenced when it ends (autograd's saved tensors, checkpoint inputs, SAC's
             cache), whoever holds it; the loss itself aside
  estimate   the dry run's activation estimate for the same workload (moekit.train.planning.memory)
  peak       CUDA: torch.cuda.max_memory_allocated over one step minus what was allocated before it
             (activations + the recompute transient + gradients); CPU has no allocator statistics, so it
             repeats ``saved``
  step_ms    median forward + backward time, the modes run round-robin (benchlib.time_interleaved); also
             the fastest step's ratio ("min x none"), steadier than the median on a loaded machine
and each one's ratio to "none". ``--sac-overhead`` adds "selective-empty", selective checkpointing with a
policy that keeps nothing: full's memory, so its time over full's is what SAC's per-op Python dispatch costs. Same inputs in every mode, so the losses must agree (checked).

``--compile`` compiles every model's blocks (models.compile, inductor) and adds "selective-no-copies": selective
without models.parallelize.KeepCompiledMatmuls, i.e. the compiled graphs' out= matmuls recomputed in backward (what
selective did before), against "selective", which keeps copies of them and writes them back. The saved / estimate
columns then come from an eager forward of the same model (the byte counter is a dispatch mode, under which dynamo
does not run compiled code); on CUDA the peak column is the compiled step's.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from moekit.bench.benchlib import (BenchParser, check_at_least, check_backend, check_device, check_out, environment,
                                   print_table, sync, time_interleaved, write_json)
from moekit.comm.topology import Layout
from moekit.models.config import PRESETS, preset
from moekit.models.compile import apply_compile
from moekit.models.parallelize import (AC_MODES, SkipAnnotations, apply_activation_checkpointing, selective_policy,
                                      subclass)
from moekit.models.transformer import build_model
from moekit.train.planning.memory import Workload, estimate_memory

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class NewStorages(TorchDispatchMode):
    """The storages ops create while active; ``alive()`` sums the bytes of those still referenced."""

    def __init__(self):
        super().__init__()
        self.seen: dict[int, StorageWeakRef] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                old = self.seen.get(s._cdata)
                if old is None or old.expired():  # a freed storage's address can be reused
                    self.seen[s._cdata] = StorageWeakRef(s)
        return out

    def alive(self, exclude: list[torch.Tensor]) -> int:
        gc.collect()  # what only cyclic garbage holds is not kept for backward
        skip = {t.untyped_storage()._cdata for t in exclude}
        return sum(torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
                   for key, ref in self.seen.items() if not ref.expired() and key not in skip)


def keep_nothing(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def keep_nothing_contexts():
    return create_selective_checkpoint_contexts(keep_nothing)


def contexts_without_copies():
    """models.parallelize.selective_contexts without KeepCompiledMatmuls / ReplayCompiledMatmuls: a compiled graph's
    out= matmuls are recomputed."""
    modes = create_selective_checkpoint_contexts(selective_policy)
    for mode in modes:
        mode.__class__ = subclass(SkipAnnotations, type(mode))
    return modes


def parse_args(argv=None) -> argparse.Namespace:
    p = BenchParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="mixtral-tiny", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None, help="override the preset's num_layers")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--expert-backend", default=None, choices=["auto", "loop", "torch", "triton"],
                   help="override the preset's (the loop's SwiGLU and Triton are recomputed whole by selective)")
    p.add_argument("--modes", nargs="+", default=["none", "ffn", "selective", "full"], choices=AC_MODES)
    p.add_argument("--sac-overhead", action="store_true",
                   help="add 'selective-empty': selective checkpointing whose policy keeps nothing (full's memory), "
                        "so its time against full's is the cost of SAC's per-op dispatch alone")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile every block (inductor) and add 'selective-no-copies': selective recomputing "
                        "the compiled graphs' matmuls, as before they were kept by copy")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default: cuda when there is a GPU)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="bfloat16: autocast, fp32 weights")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.modes[0] != "none":
        p.error(f"--modes {' '.join(args.modes)}: the first mode is the baseline of the ratios; start with none")
    check_at_least(p, args, 1, "batch_size", "seq_len", "repeats", "layers")
    check_at_least(p, args, 0, "warmup")
    window = preset(args.preset).max_seq_len
    if args.seq_len > window:
        p.error(f"--seq-len {args.seq_len}: exceeds {args.preset}'s max_seq_len {window}; use at most {window}")
    device = check_device(p, args.device)
    if args.expert_backend is not None:
        check_backend(p, args.expert_backend, preset(args.preset), device, DTYPES[args.dtype])
    if args.json:
        check_out(p, args.json, "--json")
    return args


def step_fn(model, tokens, targets, dtype):
    """One forward + backward as the trainer runs it; returns the loss."""
    device = tokens.device

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(tokens, targets=targets)  # the trainer's loss (models.loss)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def measure(model, tokens, targets, dtype) -> tuple[int, int | None, float]:
    """(saved bytes, CUDA peak bytes or None, loss) of one step."""
    track = NewStorages()
    with track, torch.autocast(tokens.device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = model(tokens, targets=targets)  # as the trainer: the loss from hidden states (models.loss)
    saved = track.alive(list(model.parameters()) + list(model.buffers()) + [tokens, targets, loss])
    loss.backward()
    model.zero_grad(set_to_none=True)
    peak = None
    if tokens.device.type == "cuda":
        sync(tokens.device)
        before = torch.cuda.memory_allocated(tokens.device)
        torch.cuda.reset_peak_memory_stats(tokens.device)
        step_fn(model, tokens, targets, dtype)()
        sync(tokens.device)
        peak = torch.cuda.max_memory_allocated(tokens.device) - before
    return saved, peak, float(loss.detach())


def main(argv=None) -> dict:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    cfg = preset(args.preset)
    over = {"num_layers": args.layers, "expert_backend": args.expert_backend}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in over.items() if v is not None})
    gen = torch.Generator().manual_seed(args.seed)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len), generator=gen).to(device)
                       for _ in range(2))
    models, rows = {}, []
    extra = (["selective-empty"] if args.sac_overhead else []) + (["selective-no-copies"] if args.compile else [])
    for mode in args.modes + extra:
        model = build_model(cfg, device, seed=args.seed)
        if args.compile:
            apply_compile(model)
        apply_activation_checkpointing(model, mode.split("-")[0])
        if mode in ("selective-empty", "selective-no-copies"):
            for block in model.layers:  # an instance attribute before the class's options
                block.checkpoint_options = {"context_fn": keep_nothing_contexts if mode == "selective-empty"
                                            else contexts_without_copies}
        model.train()
        models[mode] = model
        saved, peak, loss = measure(model, tokens, targets, dtype)
        planned = {"selective-empty": "full"}.get(mode, mode.split("-")[0])
        wl = Workload(args.batch_size, args.seq_len, args.dtype, planned,
                      "cpu" if device.type == "cpu" else "cuda")
        est = estimate_memory(cfg, Layout(), wl).activations
        rows.append({"mode": mode, "saved_bytes": saved, "estimate_bytes": est,
                     "peak_bytes": peak if peak is not None else saved, "loss": loss})
    times = time_interleaved({m: step_fn(model, tokens, targets, dtype) for m, model in models.items()}, device,
                             args.warmup, args.repeats, rotate=True)
    base = rows[0]
    for r in rows:
        r["step_ms"], r["step_min_ms"] = times[r["mode"]]["median_ms"], times[r["mode"]]["min_ms"]
        for key in ("saved_bytes", "peak_bytes", "step_ms", "step_min_ms"):
            r[key.replace("_bytes", "").replace("_ms", "") + "_vs_none"] = r[key] / base[key]
        r["saved_mib"], r["estimate_mib"], r["peak_mib"] = (r[k] / 2**20 for k in
                                                            ("saved_bytes", "estimate_bytes", "peak_bytes"))
    worst = max(abs(r["loss"] - base["loss"]) / abs(base["loss"]) for r in rows)
    print(f"{cfg.name}: {cfg.num_layers} layers, {cfg.expert_backend} experts, {args.batch_size} x {args.seq_len} tokens, {args.dtype} on "
          f"{device.type}{', compiled' if args.compile else ''}; "
          f"peak = {'CUDA max allocated over a step' if device.type == 'cuda' else 'saved (CPU)'}; "
          f"losses agree to {worst:.1e}")
    print_table(rows, [("mode", "mode", ""), ("saved_mib", "saved MiB", ".2f"), ("saved_vs_none", "x none", ".3f"),
                       ("estimate_mib", "estimate MiB", ".2f"), ("peak_mib", "peak MiB", ".2f"),
                       ("peak_vs_none", "x none", ".3f"), ("step_ms", "step ms", ".1f"),
                       ("step_vs_none", "x none", ".3f"), ("step_min_vs_none", "min x none", ".3f")])
    if worst > (1e-5 if dtype == torch.float32 else 1e-2):
        raise SystemExit(f"the modes' losses differ by {worst:.2e} (relative): checkpointing changed the math")
    result = {"args": vars(args), "config": cfg.name, "environment": environment(device), "rows": rows,
              "times": times}
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
