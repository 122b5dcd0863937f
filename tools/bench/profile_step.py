"""Profile a few training steps of a model preset: a chrome trace and time by category, in one command.

    python tools/bench/profile_step.py --preset mixtral-tiny --batch-size 2 --seq-len 64   # CPU
    python tools/bench/profile_step.py --out-dir bench-results/profile                     # GPU, bf16 autocast

One step = forward under bf16 autocast (GPU; fp32 on CPU), cross-entropy, backward, AdamW step (built
as the trainer builds it unless --optimizer says otherwise). The model comes from
models.transformer.build_model. --preset auto takes mixtral-1b on a GPU (train_mfu.py's model), mixtral-tiny
on the CPU. Warm-up steps (Triton autotuning, allocator growth) run before the
profiler starts.

Time by category: GPU kernel time (CPU op self time on CPU), attributed as a training run's ``--profile.every``
attributes it (moekit.train.profiling: module labels, the head + loss, the optimizer; backward ops by their
forward op). To profile steps of a real run instead, with its data, layout and ranks: ``moekit-train
--profile.every N`` (docs/training.md, "Profiling a run").
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
from torch.autograd.profiler import record_function

from moekit.bench.benchlib import (BenchParser, check_at_least, check_backend, check_device, check_names, check_out,
                                   environment, print_table, sync, write_json)
from moekit.models.config import PRESETS, preset
from moekit.models.transformer import build_model
from moekit.moe.experts import available_backends
from moekit.train.config import TrainConfig
from moekit.train.plan import make_optimizer
# the labels and the attribution are the trainer's (--profile.every)
from moekit.train.profiling import LABEL, Labels, categorize, export_trace, install_labels, top_ops

# --preset auto on a GPU: train_mfu.py's model (matching "1b" in names picked ernie-4.5-21b-a3b once presets grew,
# which ran out of memory on an H100; 2026-11-27)
GPU_PRESET = "mixtral-1b"


def pick_preset(name: str, device: torch.device) -> str:
    if name != "auto":
        return name
    return GPU_PRESET if device.type == "cuda" and GPU_PRESET in PRESETS else "mixtral-tiny"


def train_step(model, opt, tokens, labels: Labels, autocast_dtype) -> torch.Tensor:
    # fp32 (CPU): no autocast context at all, exactly as tools/train.py runs it
    ctx = torch.autocast(tokens.device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    with ctx:
        loss = model(tokens[:, :-1], targets=tokens[:, 1:])  # the trainer's loss (models.loss: no logits kept)
    labels.pop()  # head_loss, opened after the final norm
    loss.backward()
    with record_function(LABEL + "optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss


def parse(argv):
    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="auto", help=f"auto or one of {', '.join(PRESETS)}")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048, help="clamped to the preset's max_seq_len")
    p.add_argument("--warmup", type=int, default=2, help="steps before profiling")
    p.add_argument("--steps", type=int, default=3, help="profiled steps")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default: cuda when there is a GPU)")
    p.add_argument("--expert-backend", default=None,
                   help=f"override the preset's expert backend: {', '.join(available_backends())}")
    p.add_argument("--optimizer", default="trainer", choices=["trainer", "foreach", "fused"],
                   help="AdamW implementation: the trainer's (train.plan.make_optimizer: fused on a GPU, foreach on "
                        "CPU), foreach, or fused")
    p.add_argument("--residual-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the residual stream's dtype, as the trainer's --train.residual_dtype: auto = bf16 on CUDA "
                        "(bf16 autocast there), fp32 on CPU (no autocast); bfloat16 needs CUDA")
    p.add_argument("--out-dir", default="bench-results/profile")
    args = p.parse_args(argv)
    check_names(p, "--preset", [args.preset], ["auto", *PRESETS])
    if args.expert_backend is not None:
        check_names(p, "--expert-backend", [args.expert_backend], available_backends())
    check_at_least(p, args, 1, "batch_size", "seq_len", "steps")
    check_at_least(p, args, 0, "warmup")
    device = check_device(p, args.device)
    if args.residual_dtype == "bfloat16" and device.type != "cuda":
        p.error("--residual-dtype bfloat16 needs bf16 autocast, which this tool runs on CUDA only; use --device cuda")
    if args.expert_backend is not None:
        check_backend(p, args.expert_backend, preset(pick_preset(args.preset, device)), device,
                      torch.bfloat16 if device.type == "cuda" else torch.float32)
    # now, not after minutes of profiling: a file in the way or a read-only parent (created when written)
    check_out(p, args.out_dir, "--out-dir", folder=True)
    return args


def profile_steps(args, model, opt, tokens, labels, autocast_dtype):
    """(unprofiled ms per step, last loss, the profiler over ``args.steps`` further steps)."""
    device = tokens.device
    for _ in range(args.warmup):
        train_step(model, opt, tokens, labels, autocast_dtype)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):  # unprofiled: the step time the profile is a breakdown of
        loss = train_step(model, opt, tokens, labels, autocast_dtype)
    sync(device)
    step_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            train_step(model, opt, tokens, labels, autocast_dtype)
        sync(device)
    return step_ms, loss.item(), prof  # D2H sync: once, after timing


def main(argv=None) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    name = pick_preset(args.preset, device)
    cfg = preset(name)
    if args.expert_backend:
        cfg.expert_backend = args.expert_backend
    seq = min(args.seq_len, cfg.max_seq_len)
    model = build_model(cfg, device)
    if args.optimizer == "trainer":  # AdamW exactly as the trainer builds it (fused on a GPU, foreach on CPU)
        train_cfg = TrainConfig(preset=name, model=cfg)
        train_cfg.train.lr = 1e-4
        opt = make_optimizer(model, train_cfg)
    else:
        impl = {"foreach": dict(foreach=True), "fused": dict(fused=True)}[args.optimizer]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **impl)
    labels = Labels()
    install_labels(model, labels, head_loss_ends_with_forward=False)  # train_step closes "head_loss"
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    model.residual_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                            "auto": autocast_dtype}[args.residual_dtype]  # the trainer's train.residual_dtype
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch_size, seq + 1), generator=gen).to(device)
    step_ms, loss, prof = profile_steps(args, model, opt, tokens, labels, autocast_dtype)
    on_gpu = device.type == "cuda"
    totals = categorize(prof.events(), on_gpu)
    total = sum(totals.values()) or 1.0
    rows = [{"category": c, "ms_per_step": us / 1e3 / args.steps, "share": us / total} for c, us in totals.items()]
    print(f"preset {name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, batch "
          f"{args.batch_size} x {seq} tokens, {step_ms:.1f} ms/step unprofiled, loss {loss:.3f}")
    print_table(rows, [("category", "category", ""), ("ms_per_step", "ms/step", ".2f"), ("share", "share", ".1%")])
    basis = "GPU kernel time" if on_gpu else "CPU op self time"
    print(f"({basis} per step; the categories sum to {total / 1e3 / args.steps:.1f} ms of the {step_ms:.1f} ms step)")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trace = export_trace(prof, out / "trace.json")
    print(f"wrote {trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    write_json(out / "profile_step.json", {
        "benchmark": "profile_step", "preset": name, "config": cfg.to_dict(), "batch_size": args.batch_size,
        "seq_len": seq, "tokens_per_step": args.batch_size * seq, "step_ms": step_ms, "time_basis": basis,
        "optimizer": args.optimizer, "categories": rows, "top_ops": top_ops(prof, on_gpu), "trace": "trace.json.gz",
        "environment": environment(device),
    })
    return 0

if __name__ == "__main__":
    sys.exit(main())
