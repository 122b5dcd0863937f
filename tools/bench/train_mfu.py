"""Single-device training throughput and MFU of a preset, measured through the real trainer.

    python tools/bench/train_mfu.py                        # mixtral-1b, bf16 autocast, compile off and on
    python tools/bench/train_mfu.py --backends auto torch  # also time torch's grouped_mm experts
    python tools/bench/train_mfu.py --compile off --tma off on  # the Triton experts with and without TMA
    python tools/bench/train_mfu.py --compile on -- --model.num_experts 16 --model.top_k 4 \
        --model.moe_ffn_hidden_size 1536                   # any trainer flag after `--` goes to train.py
    python tools/bench/train_mfu.py --compile on --variants base legacy:MOEKIT_LM_LOSS=never  # A / B, one run
    python tools/bench/train_mfu.py --smoke                # CPU, mixtral-tiny, a few steps (CI)

Each configuration (expert backend x compile off/on x TMA off/on) runs ``tools/train.py`` as its own process with
``--log.every 1``, and this script reads the run's ``metrics.jsonl``. Why a subprocess, not the model
and an optimizer called from here: the measured step is exactly the one users run (micro-batching,
autocast, the non-finite guard, clipping, AdamW, router-bias update, expert-load records, host syncs),
and every configuration starts with a fresh CUDA allocator (its own peak memory) and compile state.

Timing: the first ``--warmup`` steps (compilation, Triton autotuning, optimizer-state allocation) are
left out. Throughput = tokens of the timed steps / wall time from the end of the warm-up to the end of
the last step (the trainer's ``elapsed_s``, so per-step record writing is included).
``warmup_overhead_s`` = warm-up wall time minus the same number of steady steps: with compile on, that is
the compile time (plus the autotuning eager runs pay as well).

FLOPs per token are the trainer's (``models.stats.model_stats``: 6 x active matmul parameters + 6 L S N D
attention, causal mask counted); ``mfu_palm`` uses PaLM / torchtitan's attention term 12 L S N D (no
causal halving), which reads higher. The peak is ``moekit.train.monitor.peak_flops`` (dense bf16) unless
``--peak-tflops`` is given.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from moekit.bench.benchlib import (BenchParser, check_device, check_names, check_out, check_positive, environment,
                                   fail, print_table, write_json)
from moekit.models.stats import model_stats
from moekit.moe.experts import available_backends
from moekit.train import UserError

PROG = "train_mfu.py"
TRAINER = ("-m", "moekit.train")  # the installed trainer, as moekit-train runs it
TARGET_MFU = 0.45  # issue 9

# Workload defaults: the GPU run (~1 s per step at 45% MFU on an H100) and the CPU smoke run.
GPU = dict(preset="mixtral-1b", seq_len=2048, micro_batch=16, batch_size=128, steps=40, warmup=5, lr=3e-4)
SMOKE = dict(preset="mixtral-tiny", seq_len=64, micro_batch=2, batch_size=4, steps=4, warmup=1, lr=1e-3)


def parse_args(argv):
    p = BenchParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                    allow_abbrev=False)
    p.add_argument("--smoke", action="store_true", help="CPU smoke run: mixtral-tiny, a few steps, compile off")
    p.add_argument("--preset", help=f"model preset (default {GPU['preset']}; smoke {SMOKE['preset']})")
    p.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {GPU['seq_len']})")
    p.add_argument("--micro-batch", type=int, help=f"sequences per forward (default {GPU['micro_batch']})")
    p.add_argument("--batch-size", type=int,
                   help=f"sequences per optimizer step (default {GPU['batch_size']}: 8 micro-batches, 262k tokens)")
    p.add_argument("--steps", type=int, help=f"optimizer steps per configuration (default {GPU['steps']})")
    p.add_argument("--warmup", type=int, help=f"steps left out of the timing (default {GPU['warmup']})")
    p.add_argument("--lr", type=float, help="peak learning rate (low enough that 1B parameters stay finite)")
    p.add_argument("--compile", nargs="+", choices=["off", "on"], help="torch.compile settings to run "
                   "(default: off on; smoke: off)")
    p.add_argument("--backends", nargs="+", default=["auto"],
                   help=f"expert backends (model.expert_backend): {', '.join(available_backends())}")
    p.add_argument("--tma", nargs="+", choices=["auto", "off", "on"], default=["auto"],
                   help="the Triton experts' TMA kernel variants for each configuration (MOEKIT_TMA=auto, never "
                        "for 'off', always for 'on'; they run in bf16 on sm90+ only, where auto turns them on): "
                        "'off on' times both in one run (default auto, what a training run gets)")
    p.add_argument("--variants", nargs="+", default=["base"], metavar="LABEL[:VAR=VALUE,--flag=VALUE,...]",
                   help="variants, each timed as configurations of its own: 'LABEL:VAR=VALUE,--train.key=VALUE' runs "
                        "the trainer with those environment variables set and those trainer flags added (the "
                        "configuration's name ends in -LABEL), a bare LABEL as it is. A / B of one change in one run, "
                        "e.g. --variants base 'legacy:MOEKIT_LM_LOSS=never,--train.residual_dtype=float32' "
                        "(default: base)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto = bf16 autocast on CUDA, fp32 on CPU (the trainer's default)")
    p.add_argument("--activation-checkpointing", default="none", choices=["none", "full", "ffn"])
    p.add_argument("--peak-tflops", type=float, help="device peak to compute MFU against (default: the "
                   "trainer's table of dense bf16 peaks; none on CPU)")
    p.add_argument("--timeout", type=float, default=540.0, help="seconds one configuration may take")
    p.add_argument("--run-root", help="where the runs go (default: a temporary folder, removed afterwards)")
    p.add_argument("--out", default="bench-results/train_mfu.json")
    args, extra = p.parse_known_args(argv)
    if extra and extra[0] == "--":
        extra = extra[1:]
    defaults = SMOKE if args.smoke else GPU
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.smoke and args.device == "auto":
        args.device = "cpu"
    args.compile = args.compile or (["off"] if args.smoke else ["off", "on"])
    if args.warmup < 1 or args.steps < args.warmup + 2:
        p.error(f"--warmup {args.warmup} / --steps {args.steps}: need warmup >= 1 and at least 2 timed steps")
    if min(args.seq_len, args.micro_batch, args.batch_size) < 1 or args.batch_size % args.micro_batch:
        p.error(f"--batch-size {args.batch_size} must be a positive multiple of --micro-batch {args.micro_batch}")
    args.variants = parse_variants(p, args.variants)
    check_positive(p, args, "lr", "peak_tflops", "timeout")
    check_names(p, "--backends", args.backends, available_backends())
    if args.device == "cuda":  # auto: the trainer's choice; cpu needs no check
        check_device(p, args.device)
    check_out(p, args.out)  # before the runs: a run of minutes must not end on an unwritable path
    if args.run_root:
        check_out(p, args.run_root, "--run-root", folder=True)
    return args, extra


def parse_variants(p, specs: list[str]) -> list[tuple[str, dict[str, str], list[str]]]:
    """--variants -> [(label, {VAR: VALUE}, [trainer flag, value, ...])]; labels unique, names of environment
    variables or of trainer flags (--section.key), one '=' each."""
    out, seen = [], set()
    for spec in specs:
        label, _, rest = spec.partition(":")
        if not label or not label.replace("-", "").replace("_", "").isalnum():
            p.error(f"--variants {spec!r}: the label must be letters, digits, '-' or '_' "
                    f"(e.g. legacy:MOEKIT_LM_LOSS=never)")
        if label in seen:
            p.error(f"--variants: the label {label!r} is used twice")
        seen.add(label)
        env, flags = {}, []
        for pair in filter(None, rest.split(",")):
            name, eq, value = pair.partition("=")
            if eq and name.startswith("--") and name[2:].replace("_", "").replace(".", "").replace("-", "").isalnum():
                flags += [name, value]  # the trainer checks the flag and its value, at its start
                continue
            if not eq or not name or not (name.replace("_", "").isalnum() and not name[0].isdigit()):
                p.error(f"--variants {spec!r}: {pair!r} is not VAR=VALUE with VAR an environment variable's name, "
                        f"nor --flag=VALUE with a trainer flag (--train.residual_dtype=float32)")
            env[name] = value
        out.append((label, env, flags))
    return out


def trainer_args(args, extra: list[str], compile_on: bool, backend: str, run_dir: str) -> list[str]:
    """The train.py flags of one configuration; everything but compile and backend is shared."""
    flags = {
        "--preset": args.preset, "--steps": args.steps, "--batch-size": args.batch_size, "--run-dir": run_dir,
        "--train.micro_batch_size": args.micro_batch, "--train.seq_len": args.seq_len,
        "--train.device": args.device, "--train.dtype": args.dtype, "--train.lr": args.lr,
        "--train.compile": "true" if compile_on else "false",
        "--train.activation_checkpointing": args.activation_checkpointing, "--model.expert_backend": backend,
        # one record per step; nothing else that costs time inside the loop or writes large files
        "--log.every": 1, "--log.progress": "off", "--log.tensorboard": "false", "--checkpoint.every": 0,
        "--eval.every": 0, "--eval.sequences": args.micro_batch,
    }
    # --overwrite: the benchmark owns its run directories; a second run with the same --run-root replaces them
    return [str(x) for kv in flags.items() for x in kv] + ["--overwrite"] + list(extra)


def resolve_config(args, extra: list[str]):
    """The TrainConfig the trainer will build from these flags (its own parser: same validation), checked with
    every --backends entry; a rejected flag is one line and exit status 2 (SystemExit)."""
    from moekit.train.cli import parse_args as trainer_parse

    configs = []
    for backend in dict.fromkeys(args.backends):
        try:
            configs.append(trainer_parse(trainer_args(args, extra, False, backend, "unused"))[0])
        except UserError as exc:
            fail(PROG, f"trainer flags rejected: {exc}")
    return configs[0]


def accounting(cfg) -> dict:
    """Parameters and FLOPs per token, both conventions, at the run's sequence length."""
    m, S = cfg.model, cfg.train.seq_len
    stats = model_stats(m, S)
    extra_attention = 6.0 * m.num_layers * S * m.num_heads * m.attn_head_dim  # PaLM: no causal halving
    return {"params": stats.params, "active_params": stats.active_params, "seq_len": S,
            "flops_per_token": stats.train_flops_per_token,
            "flops_per_token_palm": stats.train_flops_per_token + extra_attention}


def memory_estimate_gib(cfg, device: torch.device, dtype: str) -> float:
    """moekit.train.planning.memory's single-rank peak for this workload, to compare with the measured peak."""
    from moekit.comm.topology import Layout
    from moekit.train.planning.memory import Workload, estimate_memory

    wl = Workload(cfg.train.micro_batch_size, cfg.train.seq_len, dtype, cfg.train.activation_checkpointing,
                  device.type, residual=cfg.train.residual_dtype)
    return estimate_memory(cfg.model, Layout(1, 1, 1, 1, 1), wl).peak / 2**30


def run_trainer(argv: list[str], run_dir: Path, timeout: float, env: dict) -> tuple[int, float, str]:
    """(exit status, wall seconds, log text); the trainer's output goes to run_dir/train.log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "train.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run([sys.executable, *TRAINER, *argv], stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout, env=env).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.perf_counter() - t0, log.read_text(errors="replace")


def compile_diagnostics(log: str) -> dict:
    """Recompilations logged by TORCH_LOGS=recompiles. The final evaluation's no-grad forward recompiles
    every graph once (guard: grad_mode), after the timed steps; any other recompile happened while
    training, and past torch's recompile limit a block would silently run eagerly."""
    lines = log.splitlines()
    starts = [i for i, ln in enumerate(lines) if "Recompiling function" in ln]
    in_training = [i for i in starts if not any("grad_mode" in ln for ln in lines[i + 1:i + 4])]
    return {"recompiles": len(starts), "recompiles_in_training": len(in_training),
            "recompile_limit_hit": "recompile_limit" in log or "cache_size_limit" in log}


def summarize(records: list[dict], warmup: int, tokens_per_step: int) -> dict:
    """Steady-state numbers from metrics.jsonl: steps after ``warmup``, timed by elapsed_s."""
    steps = [r for r in records if not r.get("skipped")]
    if len(steps) != len(records):
        raise ValueError(f"{len(records) - len(steps)} steps were skipped (non-finite): lower --lr")
    if len(steps) < warmup + 2:
        raise ValueError(f"only {len(steps)} steps recorded, need warmup {warmup} + 2")
    timed = steps[warmup:]
    steady_s = timed[-1]["elapsed_s"] - steps[warmup - 1]["elapsed_s"]
    warmup_s = steps[warmup - 1]["elapsed_s"]
    step_ms = [1e3 * tokens_per_step / r["tokens_per_s"] for r in timed]  # the trainer's per-step wall time
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {
        "steps_timed": len(timed), "tokens_per_step": tokens_per_step,
        "tokens_per_s": len(timed) * tokens_per_step / steady_s,
        "step_ms_median": statistics.median(step_ms), "step_ms_min": min(step_ms), "step_ms_max": max(step_ms),
        "warmup_s": warmup_s, "warmup_overhead_s": max(warmup_s - warmup * steady_s / len(timed), 0.0),
        "peak_mem_gib": max(r["mem_gb"] for r in steps),
        "trainer_mfu_median": statistics.median(mfus) if mfus else None,
        "loss_first": steps[0]["loss"], "loss_last": steps[-1]["loss"],
    }


def add_rates(row: dict, acct: dict, peak: float | None) -> dict:
    """Achieved TFLOP/s and MFU (both FLOP conventions) from tokens/s."""
    tps = row["tokens_per_s"]
    row["tflops"] = tps * acct["flops_per_token"] / 1e12
    row["mfu"] = tps * acct["flops_per_token"] / peak if peak else None
    row["mfu_palm"] = tps * acct["flops_per_token_palm"] / peak if peak else None
    return row


TMA_ENV_VALUE = {"auto": "auto", "off": "never", "on": "always"}  # --tma -> MOEKIT_TMA
TMA_SUFFIX = {"auto": "", "off": "-notma", "on": "-tma"}  # --tma -> the configuration's name


def finished_steps(run_dir: Path) -> list[dict]:
    """metrics.jsonl of a trainer killed by the timeout: every complete record (the kill may have torn the last)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"it recorded no step ({path} is missing)")
    out = []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise ValueError(f"{path}:{i + 1}: not JSON") from None
    return out


def run_config(args, extra, compile_on: bool, backend: str, root: Path, tma: str = "auto",
               variant: tuple[str, dict[str, str], list[str]] = ("base", {}, [])) -> dict:
    from moekit.train import UserError
    from moekit.train.records import read_metrics

    label, variant_env, variant_flags = variant
    name = f"{backend}-compile-{'on' if compile_on else 'off'}{TMA_SUFFIX[tma]}"
    if len(args.variants) > 1:
        name += f"-{label}"
    run_dir = root / name
    print(f"[train_mfu] {name}: {args.steps} steps of {args.batch_size} x {args.seq_len} tokens ...", flush=True)
    env = dict(os.environ, MOEKIT_TMA=TMA_ENV_VALUE[tma])  # explicit: not inherited from the caller
    env.update(variant_env)
    if compile_on:  # a recompile per block in the timed steps would show in tokens/s: count them
        env["TORCH_LOGS"] = ",".join(filter(None, [env.get("TORCH_LOGS"), "recompiles"]))
    rc, wall, log = run_trainer(trainer_args(args, extra, compile_on, backend, str(run_dir)) + variant_flags, run_dir,
                                args.timeout, env)
    row = {"config": name, "compile": compile_on, "tma": tma, "variant": label, "variant_env": variant_env,
           "variant_flags": variant_flags,
           "expert_backend_requested": backend, "exit_status": rc,
           "wall_s": wall, "run_dir": str(run_dir) if args.run_root else None}  # a temporary one is removed
    try:
        if rc == 124:  # cut by --timeout: the steps it finished still measure, if enough ran past the warm-up
            try:
                row.update(summarize(finished_steps(run_dir), args.warmup, args.batch_size * args.seq_len))
            except (ValueError, OSError, KeyError) as exc:
                raise ValueError(f"train.py exited with status 124 (timeout), and {exc}") from None
            row["status"] = f"partial: timeout after {row['steps_timed'] + args.warmup} of {args.steps} steps"
            print(f"[train_mfu] {name}: --timeout {args.timeout:.0f} s cut the run; its {row['steps_timed']} timed "
                  f"steps are kept", file=sys.stderr, flush=True)
            return row
        if rc != 0:
            raise ValueError(f"train.py exited with status {rc}")
        row.update(summarize(read_metrics(run_dir), args.warmup, args.batch_size * args.seq_len))
        if compile_on:
            row.update(compile_diagnostics(log))
        row["status"] = "ok"
    except (ValueError, OSError, KeyError, UserError) as exc:
        tail = "\n".join(log.strip().splitlines()[-15:])
        print(f"[train_mfu] {name} failed: {exc}\n{tail}", file=sys.stderr, flush=True)
        row.update(status="failed", error=f"{exc}; log tail: {tail[-2000:]}")
    return row


def resolved_backend(cfg, backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """The expert backend the layer picks for this model's shapes (moe.experts.resolve_backend)."""
    from moekit.moe.experts import ffn_in_features, resolve_backend

    m = cfg.model
    H, F = m.hidden_size, m.moe_ffn_hidden_size
    rows = torch.empty(1, H, device=device, dtype=dtype)  # one expert of the real widths: usable() reads shapes
    w_in = torch.empty(1, H, ffn_in_features(m.activation, F), device=device, dtype=dtype)
    w_out = torch.empty(1, F, H, device=device, dtype=dtype)
    try:
        return resolve_backend(backend, rows, w_in, w_out).name
    except ValueError as exc:
        return f"unusable: {exc}"


def device_and_dtype(args) -> tuple[torch.device, torch.dtype]:
    kind = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"auto": torch.bfloat16 if kind == "cuda" else torch.float32, "bfloat16": torch.bfloat16,
             "float32": torch.float32}[args.dtype]
    return torch.device(kind), dtype


COLUMNS = [("config", "configuration", ""), ("expert_backend", "experts", ""), ("tokens_per_s", "tokens/s", ",.0f"),
           ("step_ms_median", "step ms", ".1f"), ("tflops", "TFLOP/s", ".1f"), ("mfu", "MFU", ".1%"),
           ("mfu_palm", "MFU (PaLM)", ".1%"), ("peak_mem_gib", "peak GiB", ".2f"),
           ("warmup_overhead_s", "compile/warm-up s", ".1f"), ("status", "status", "")]


def measured(row: dict) -> bool:
    """A row with numbers: a run that finished, or one its timeout cut after enough steps ("partial: ...")."""
    return row["status"] == "ok" or row["status"].startswith("partial")


def progress_line(row: dict) -> str:
    """One line per finished configuration, so a run cut short still shows what it measured."""
    if not measured(row):
        return f"[train_mfu] {row['config']}: failed ({row['error'].split(';')[0]})"
    mfu = row["trainer_mfu_median"]
    return (f"[train_mfu] {row['config']}: {row['tokens_per_s']:,.0f} tokens/s, step {row['step_ms_median']:.0f} ms, "
            f"trainer MFU {'-' if mfu is None else f'{mfu:.1%}'}, peak {row['peak_mem_gib']:.2f} GiB, warm-up "
            f"overhead {row['warmup_overhead_s']:.1f} s, wall {row['wall_s']:.0f} s"
            + (f", recompiles in training {row['recompiles_in_training']}" if "recompiles" in row else ""))


def finish(rows: list[dict], cfg, acct: dict, args, device: torch.device, dtype: torch.dtype) -> float | None:
    """Backend names, peak, TFLOP/s and MFU: CUDA is first touched here, after the runs, so this process
    holds no GPU memory while they train. Returns the peak FLOP/s used."""
    from moekit.train.monitor import peak_flops

    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(device, dtype)
    for row in rows:
        row["expert_backend"] = resolved_backend(cfg, row["expert_backend_requested"], device, dtype)
        row.update(flops_per_token=acct["flops_per_token"], peak_tflops=peak / 1e12 if peak else None)
        if measured(row):
            add_rates(row, acct, peak)
    return peak


def main(argv=None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = resolve_config(args, extra)  # bad trainer flags stop here, before any run
    acct = accounting(cfg)
    print(f"[train_mfu] {cfg.preset}: {acct['params'] / 1e9:.3f}B parameters, {acct['active_params'] / 1e9:.3f}B "
          f"active, {acct['flops_per_token'] / 1e9:.3f} GFLOP/token trained at seq {acct['seq_len']}", flush=True)
    device, dtype = device_and_dtype(args)
    dtype_name = str(dtype).replace("torch.", "")
    payload = {"benchmark": "train_mfu", "target_mfu": TARGET_MFU, "model": {**cfg.model.to_dict(), **acct},
               "workload": {"preset": cfg.preset, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
                            "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
                            "dtype": dtype_name, "activation_checkpointing": args.activation_checkpointing,
                            "trainer_extra_args": extra,
                            "memory_estimate_gib": memory_estimate_gib(cfg, device, dtype_name)}}
    rows = []
    with tempfile.TemporaryDirectory(prefix="train_mfu-") as tmp:
        root = Path(args.run_root or tmp)
        for backend in args.backends:
            for c, t, v in itertools.product(args.compile, args.tma, args.variants):
                rows.append(run_config(args, extra, c == "on", backend, root, tma=t, variant=v))
                print(progress_line(rows[-1]), flush=True)
                # partial results on disk after every configuration: a run killed later keeps them
                write_json(args.out, {**payload, "partial": True, "results": rows})
    peak = finish(rows, cfg, acct, args, device, dtype)
    print_table(rows, COLUMNS)
    ok = [r["mfu"] for r in rows if r.get("mfu") is not None]
    if ok:
        print(f"best MFU {max(ok):.1%} (target {TARGET_MFU:.0%}: {'met' if max(ok) >= TARGET_MFU else 'not met'})")
    write_json(args.out, {**payload, "partial": False, "peak_tflops": peak / 1e12 if peak else None,
                          "environment": environment(device), "results": rows})
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
