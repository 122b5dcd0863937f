"""Profile a few training steps of a model preset: a chrome trace and time by category, in one command.

    python tools/bench/profile_step.py --preset mixtral-tiny --batch-size 2 --seq-len 64   # CPU
    python tools/bench/profile_step.py --out-dir bench-results/profile                     # GPU, bf16 autocast

One step = forward under bf16 autocast (GPU; fp32 on CPU), cross-entropy, backward, AdamW step (built
as the trainer builds it unless --optimizer says otherwise). The model comes from
models.transformer.build_model. --preset auto takes mixtral-1b on a GPU (train_mfu.py's model), mixtral-tiny
on the CPU. Warm-up steps (Triton autotuning, allocator growth) run before the
profiler starts.

Time by category: GPU kernel time (CPU op self time on CPU), attributed by where the work was issued.
Forward: the innermost labelled region, from record_function ranges this script opens around modules
(attention, router, experts, norms, ...), around moekit's dispatch and combine, around the head + loss
and around the optimizer. Backward: the forward op whose autograd node ran it (the profiler's sequence
number links the two), so a GEMM in backward counts where its forward ran. Communication kernels and
ops (nccl, c10d) are taken by name first. Everything else is "other".
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import shutil
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.autograd.profiler import record_function

from moekit.bench.benchlib import (BenchParser, check_at_least, check_backend, check_device, check_names, check_out,
                                   environment, print_table, sync, write_json)
from moekit.models.config import PRESETS, preset
from moekit.models.transformer import Attention, build_model
from moekit.moe import DenseMLP, MoELayer, Router
from moekit.moe.experts import GroupedExperts, available_backends
from moekit.train.config import TrainConfig
from moekit.train.plan import make_optimizer

LABEL = "moekit/"
MODULE_CATEGORIES = (  # first match wins, innermost labelled region wins at attribution
    (Attention, "attention"), (GroupedExperts, "expert_gemm"), (Router, "router"), (nn.RMSNorm, "norm"),
    (DenseMLP, "dense_ffn"), (nn.Embedding, "embedding"), (MoELayer, "moe_other"),
)
CATEGORIES = ("attention", "expert_gemm", "router", "permute_unpermute", "norm", "dense_ffn", "moe_other",
              "embedding", "head_loss", "optimizer", "communication", "other")
OPTIMIZER_REGIONS = ("Optimizer.step#", "Optimizer.zero_grad#")
COMM_WORDS = ("nccl", "c10d::", "all_to_all", "allreduce", "all_reduce", "reduce_scatter", "allgather", "all_gather")


class Labels:
    """record_function ranges opened in one hook and closed in another (forward pre / post hooks)."""

    def __init__(self):
        self.stack = []

    def push(self, category: str) -> None:
        rf = record_function(LABEL + category)
        rf.__enter__()
        self.stack.append(rf)

    def pop(self) -> None:
        self.stack.pop().__exit__(None, None, None)


class LabelledDispatcher:
    """Wraps a model's dispatcher so its permute and unpermute show up as labelled categories (one category
    for both by default; tools/bench/cpu_train.py splits them)."""

    def __init__(self, inner, dispatch_label: str = "permute_unpermute", combine_label: str = "permute_unpermute"):
        self.inner, self.dispatch_label, self.combine_label = inner, dispatch_label, combine_label

    def dispatch(self, x, routing):
        with record_function(LABEL + self.dispatch_label):
            return self.inner.dispatch(x, routing)

    def combine(self, rows, meta):
        with record_function(LABEL + self.combine_label):
            return self.inner.combine(rows, meta)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def install_labels(model: nn.Module, labels: Labels, dispatch_labels: tuple[str, str] | None = None) -> None:
    """Label ``model``'s modules (MODULE_CATEGORIES), its MoE dispatchers (``dispatch_labels``: the permute's
    and the combine's category, default one "permute_unpermute") and its output head."""
    for module in model.modules():
        category = next((c for cls, c in MODULE_CATEGORIES if isinstance(module, cls)), None)
        if category is None:
            continue
        module.register_forward_pre_hook(lambda m, a, c=category: labels.push(c))
        module.register_forward_hook(lambda m, a, o: labels.pop())
        if isinstance(module, MoELayer):
            module.dispatcher = LabelledDispatcher(module.dispatcher, *(dispatch_labels or ()))
    # the output projection runs inside Transformer.forward after the final norm: open "head_loss" there,
    # close it once the loss is computed (train_step)
    model.norm.register_forward_hook(lambda m, a, o: labels.push("head_loss"))


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


def _label_of(event) -> str | None:
    while event is not None:
        if event.name.startswith(LABEL):
            return event.name[len(LABEL):]
        if event.name.startswith(OPTIMIZER_REGIONS):  # torch.optim's own ranges: whoever calls step()
            return "optimizer"
        if event.name.startswith("autograd::engine::evaluate_function"):
            return None  # backward: attributed through the sequence number instead
        event = event.cpu_parent
    return None


def _backward_seq(event) -> int | None:
    while event is not None:
        if event.name.startswith("autograd::engine::evaluate_function"):
            return event.sequence_nr
        event = event.cpu_parent
    return None


def attribute(events, on_gpu: bool):
    """Yield (event, category, microseconds of self time) for every op with time (on GPU: the device time
    of the kernels it launched). The category is the raw label (module docstring), "communication" or
    "other"; callers that keep a fixed set of categories map unknown labels themselves."""
    seq_category: dict[int, str] = {}
    for e in sorted(events, key=lambda e: e.time_range.start):  # forward ops: the last op that carries a
        label = _label_of(e)                                    # sequence number created that autograd node
        if label is not None and e.sequence_nr >= 0 and _backward_seq(e) is None:
            seq_category[e.sequence_nr] = label
    for e in events:
        if not str(getattr(e, "device_type", "CPU")).endswith("CPU"):
            continue  # GPU-side copies of record_function ranges: their kernels are already counted on the op
        us = e.self_device_time_total if on_gpu else e.self_cpu_time_total
        if us <= 0:
            continue
        names = [e.name.lower()] + [k.name.lower() for k in getattr(e, "kernels", [])]
        if any(w in n for n in names for w in COMM_WORDS):
            yield e, "communication", us
            continue
        label = _label_of(e)
        seq = _backward_seq(e)
        yield e, label if label is not None else seq_category.get(seq, "other") if seq is not None else "other", us


def categorize(events, on_gpu: bool) -> dict[str, float]:
    """Category (CATEGORIES) -> microseconds of self time (device time of the kernels an op launched, on GPU)."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for _, cat, us in attribute(events, on_gpu):
        totals[cat if cat in totals else "other"] += us
    return totals


def top_ops(prof, on_gpu: bool, n: int = 15) -> list[dict]:
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    ops = [a for a in prof.key_averages() if not a.key.startswith(LABEL)]  # labels would count their contents
    avgs = sorted(ops, key=lambda a: getattr(a, key), reverse=True)[:n]
    return [{"name": a.key[:80], "calls": a.count, "self_ms": getattr(a, key) / 1e3} for a in avgs]


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


def export_trace(prof, out: Path) -> None:
    trace = out / "trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:  # ~10x smaller
        shutil.copyfileobj(src, dst)
    trace.unlink()
    print(f"wrote {trace}.gz (open in https://ui.perfetto.dev or chrome://tracing)")


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
    install_labels(model, labels)
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
    export_trace(prof, out)
    write_json(out / "profile_step.json", {
        "benchmark": "profile_step", "preset": name, "config": cfg.to_dict(), "batch_size": args.batch_size,
        "seq_len": seq, "tokens_per_step": args.batch_size * seq, "step_ms": step_ms, "time_basis": basis,
        "optimizer": args.optimizer, "categories": rows, "top_ops": top_ops(prof, on_gpu), "trace": "trace.json.gz",
        "environment": environment(device),
    })
    return 0

if __name__ == "__main__":
    sys.exit(main())
