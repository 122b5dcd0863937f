"""moekit-heatmap at scale: a synthetic DeepSeek-V3-sized expert-load record, every figure timed and measured.

    python tools/bench/heatmap_scale.py                       # 61 layers x 256 experts x 10,000 steps
    python tools/bench/heatmap_scale.py --steps 100000 --keep runs/synthetic   # 100k steps, kept afterwards
    python tools/bench/heatmap_scale.py --json bench-results/heatmap_scale.json

Writes a synthetic run directory (expert_load.bin of skewed, drifting loads with capacity drops and some
dead experts; metrics.jsonl; config.json), then times each stage: reading + the one-pass analysis
(moekit.train.loadstats), every figure of moekit.train.loadplots, and the whole HTML report of two such
runs. Each row: seconds and the PNG's pixels (the cap is 16 megapixels). A table on stdout, JSON with --json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from moekit.bench.benchlib import BenchParser, check_at_least, check_out
from moekit.train import loadplots, records
from moekit.train.loadplots import MAX_PIXELS, png_bytes, png_size


def synthetic_run(run_dir: str | os.PathLike, layers: int = 61, experts: int = 256, steps: int = 10_000,
                  tokens_per_step: int = 4096, top_k: int = 8, capacity_factor: float = 1.25, seed: int = 0,
                  router: str = "topk", stride: int = 1) -> Path:
    """A run directory with an expert_load.bin of ``steps`` records, metrics.jsonl and config.json."""
    d = Path(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    slots = tokens_per_step * top_k
    names = [f"layers.{i + 3}.ffn" for i in range(layers)]
    w = records.ExpertLoadWriter(d / records.EXPERT_LOAD_BIN, names, router, top_k, experts, stride=stride,
                                 max_count=slots)
    base = rng.dirichlet(np.full(experts, 0.7), size=layers)  # [L, E] skewed shares, one profile per layer
    drift = rng.dirichlet(np.full(experts, 2.0), size=layers)
    cap = int(np.ceil(capacity_factor * slots / experts))
    chunk = max(1, (32 << 20) // (layers * experts * 4))
    kept_steps = [s for s in range(1, steps + 1) if s % stride == 0]
    for i in range(0, len(kept_steps), chunk):
        st = np.asarray(kept_steps[i : i + chunk])
        t = (st / steps)[:, None, None]
        share = (1 - t) * base[None] + t * drift[None]  # [n, L, E] drifting toward a flatter profile
        noise = 1 + 0.25 * rng.standard_normal(share.shape, dtype=np.float32)
        assigned = np.maximum(share * slots * noise, 0).astype(np.int64)
        assigned[rng.random(assigned.shape) < 0.01] = 0  # a few dead experts per step
        tokens = np.minimum(assigned, cap)
        rows = np.zeros(len(st), dtype=w.rec)
        rows["step"], rows["tokens"], rows["assigned"] = st, tokens, assigned
        rows["dropped"] = assigned.sum(-1) - tokens.sum(-1)
        w.write_rows(rows)
    w.close()
    loss = 11.0 * np.exp(-np.arange(1, steps + 1) / (steps / 4)) + 2.0 + 0.02 * rng.standard_normal(steps)
    with open(d / records.METRICS, "w", encoding="utf-8") as f:
        for s in range(1, steps + 1):
            m = {"step": s, "loss": float(loss[s - 1]), "aux_loss": 0.01, "lr": 1e-3, "grad_norm": 1.0,
                 "tokens_per_s": float(1e5 * (1 + 0.05 * rng.standard_normal())), "tokens": s * tokens_per_step,
                 "elapsed_s": s * 0.04, "mem_gb": 1.0, "mfu": None}
            if s % max(1, steps // 20) == 0 or s == steps:
                m["val_loss"] = float(loss[s - 1] + 0.05)
            f.write(json.dumps(m) + "\n")
    (d / records.CONFIG).write_text(json.dumps({"preset": "synthetic", "model": {"router": router,
                                                "num_experts": experts, "top_k": top_k}, "train": {"seed": seed}}))
    return d


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def timed_cpu(fn):
    """(result, wall seconds, CPU seconds of this process): on a shared box the CPU time is the steadier number."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def run(layers: int, experts: int, steps: int, root: Path) -> dict:
    from moekit.train import heatmap, report

    rows = []
    t0 = time.perf_counter()
    a_dir, gen_s = timed(lambda: synthetic_run(root / "a", layers, experts, steps, seed=0, router="topk"))
    b_dir, _ = timed(lambda: synthetic_run(root / "b", layers, experts, steps, seed=1, router="switch"))
    rec_bytes = (a_dir / records.EXPERT_LOAD_BIN).stat().st_size
    run_a, read_s, read_cpu = timed_cpu(lambda: heatmap.read_run(str(a_dir), (None, None)))
    rows.append({"stage": "read + analyse (one run)", "seconds": read_s, "cpu_s": read_cpu})
    s = heatmap.series(run_a)
    for name, make in (("layers heatmap", lambda: loadplots.fig_layers([s])),
                       ("steps heatmap", lambda: loadplots.fig_steps(s)),
                       ("loss", lambda: loadplots.fig_loss([s])),
                       ("imbalance over steps", lambda: loadplots.fig_imbalance_time([s])),
                       ("imbalance distribution", lambda: loadplots.fig_imbalance_dist([s])),
                       ("drops", lambda: loadplots.fig_drops([s])),
                       ("dead / saturated", lambda: loadplots.fig_experts([s])),
                       ("throughput", lambda: loadplots.fig_throughput([s]))):
        data, sec, cpu = timed_cpu(lambda: png_bytes(make()))
        w, h = png_size(data)
        rows.append({"stage": name, "seconds": sec, "cpu_s": cpu, "width": w, "height": h, "megapixels": w * h / 1e6})
    run_b = heatmap.read_run(str(b_dir), (None, None))
    _, rep_s, rep_cpu = timed_cpu(lambda: report.write_report([run_a, run_b], str(root / "report.html")))
    rows.append({"stage": "HTML report (two runs, from analysed records)", "seconds": rep_s, "cpu_s": rep_cpu})
    figures = [r for r in rows if "width" in r]
    total = time.perf_counter() - t0
    return {"layers": layers, "experts": experts, "steps": steps, "record_bytes": rec_bytes,
            "generate_s": gen_s, "rows": rows, "total_s": total,
            "one_run_all_figures_s": read_s + sum(r["seconds"] for r in figures),
            "one_run_all_figures_cpu_s": read_cpu + sum(r["cpu_s"] for r in figures),
            "max_megapixels": max(r.get("megapixels", 0) for r in rows), "cap_megapixels": MAX_PIXELS / 1e6,
            "report_bytes": (root / "report.html").stat().st_size}


def main(argv=None) -> int:
    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=61, help="MoE layers in the synthetic record (default 61)")
    p.add_argument("--experts", type=int, default=256, help="experts per layer (default 256)")
    p.add_argument("--steps", type=int, default=10_000, help="training steps recorded (default 10,000)")
    p.add_argument("--keep", metavar="DIR", help="write the synthetic runs here and keep them")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    check_at_least(p, args, 1, "layers", "experts", "steps")
    if args.json:
        check_out(p, args.json, "--json")
    if args.keep:
        check_out(p, args.keep, "--keep", folder=True)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="moekit-heatmap-scale-"))
    try:
        res = run(args.layers, args.experts, args.steps, root)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{args.layers} layers x {args.experts} experts x {args.steps:,} steps: expert_load.bin "
          f"{res['record_bytes'] / 1e9:.2f} GB (generated in {res['generate_s']:.1f} s)")
    print(f"{'stage':<48} {'wall s':>8} {'cpu s':>8} {'pixels':>12} {'MP':>6}")
    for r in res["rows"]:
        px = f"{r['width']}x{r['height']}" if "width" in r else ""
        mp = f"{r['megapixels']:.2f}" if "megapixels" in r else ""
        print(f"{r['stage']:<48} {r['seconds']:>8.2f} {r['cpu_s']:>8.2f} {px:>12} {mp:>6}")
    print(f"one run, read + every figure: {res['one_run_all_figures_s']:.1f} s wall, "
          f"{res['one_run_all_figures_cpu_s']:.1f} s CPU")
    print(f"total (including generating two runs) {res['total_s']:.1f} s; largest figure {res['max_megapixels']:.2f} MP "
          f"(cap {res['cap_megapixels']:.0f}); report {res['report_bytes'] / 1e6:.2f} MB")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.json}")
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
