"""Issue 9's targets next to what the GPU suite measured: reads the suite's JSON files, prints one table.

    python tools/bench/suite_summary.py bench-results/raw            # the folder gpu_suite.sh wrote

Reads, from FOLDER (each optional): grouped_gemm.json, moe_layer.json, dispatch_bandwidth.json,
train_mfu.json, profile/profile_step.json (or profile_step.json), tune_kernels.json, lm_loss.json,
batch_generate.json and gpu_tests.xml (the GPU test tier's JUnit report). Prints one line per target: the worst case over the measured cases
(and the median) and "met" / "missed" / "no data"; then the profile's top categories, the tile-config
sweep's winners and the test tier's counts where those files exist. It reports; it asserts nothing
(timings vary by machine: the ratios are what to compare). Writes FOLDER/summary.json. A file that is
missing leaves its targets at "no data"; one that cannot be read or parsed is named in a note on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from moekit.bench.benchlib import BenchParser, check_out

FINE_GRAINED = ("deepseek-v3-ep8", "qwen3-30b-a3b", "fine-grained")
INPUTS = ("grouped_gemm.json", "moe_layer.json", "dispatch_bandwidth.json", "train_mfu.json", "train_mfu_fused.json",
          "profile/profile_step.json", "profile_step.json", "tune_kernels.json", "gpu_tests.xml")


def load(folder: Path, name: str) -> dict | None:
    """The JSON in ``folder/name``, or None when it is missing; a file that is there but cannot be read or
    parsed is None too, with a note on stderr naming it."""
    path = folder / name
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"note: {path}: cannot be read as JSON ({exc}); its targets read 'no data'", file=sys.stderr)
        return None


def line(target: str, goal: str, values: list[float], higher_is_better: bool, threshold: float, source: str) -> dict:
    if not values:
        return {"target": target, "goal": goal, "worst": None, "median": None, "status": "no data", "source": source}
    worst = min(values) if higher_is_better else max(values)
    ok = worst >= threshold if higher_is_better else worst <= threshold
    return {"target": target, "goal": goal, "worst": worst, "median": statistics.median(values),
            "status": "met" if ok else "missed", "cases": len(values), "source": source}


def grouped_gemm_lines(data: dict | None) -> list[dict]:
    rows = (data or {}).get("rows", [])
    skews = (data or {}).get("skew_ratios", [])

    def ratios(peer: str, shapes) -> list[float]:
        return [v for r in rows if r["shape"] in shapes for k, v in r["ratios"].items() if k.startswith(f"triton/{peer}:")]

    def tma_ratios(shapes, over_torch: bool) -> list[float]:
        """triton_tma / torch grouped_mm (over_torch) or triton_tma / triton, from the rows' triton ratios."""
        out = []
        for r in rows:
            if r["shape"] not in shapes:
                continue
            for key, vs_tma in r["ratios"].items():
                mode = key.split(":", 1)[-1]
                if key.startswith("triton/triton_tma:") and vs_tma:
                    vs_torch = r["ratios"].get(f"triton/torch_grouped:{mode}")
                    if not over_torch:
                        out.append(1.0 / vs_tma)
                    elif vs_torch:
                        out.append(vs_torch / vs_tma)
        return out

    src = "grouped_gemm.json"
    return [
        line("grouped GEMM: triton / torch grouped_mm, fine-grained shapes", ">= 1.0",
             ratios("torch_grouped", FINE_GRAINED), True, 1.0, src),
        line("  with the TMA variants: triton_tma / torch grouped_mm, fine-grained", ">= 1.0",
             tma_ratios(FINE_GRAINED, over_torch=True), True, 1.0, src),
        line("grouped GEMM: triton / torch grouped_mm, Mixtral-8x7B", ">= 0.9",
             ratios("torch_grouped", ("mixtral-8x7b",)), True, 0.9, src),
        line("  with the TMA variants: triton_tma / torch grouped_mm, Mixtral-8x7B", ">= 0.9",
             tma_ratios(("mixtral-8x7b",), over_torch=True), True, 0.9, src),
        line("grouped GEMM: TMA variants / pointer kernels (triton_tma / triton; > 1: make them the default)",
             ">= 1.0", tma_ratios(FINE_GRAINED + ("mixtral-8x7b",), over_torch=False), True, 1.0, src),
        line("grouped GEMM: triton / per-expert loop, fine-grained shapes", ">= 3",
             ratios("loop", FINE_GRAINED), True, 3.0, src),
        line("grouped GEMM: triton Zipf(1.2) / uniform routing", ">= 0.9",
             [s["skew_over_uniform"] for s in skews if s["impl"] == "triton" and s["routing"] == "zipf1.2"], True, 0.9, src),
    ]


def moe_layer_lines(data: dict | None) -> list[dict]:
    results = (data or {}).get("results", [])
    cases = (data or {}).get("cases", [])
    src = "moe_layer.json"

    def speedups(prefix: str) -> list[float]:
        return [r["moekit_speedup"] for r in results if r["impl"].startswith(prefix) and r.get("moekit_speedup")]

    syncs = [v for c in cases for k, v in c.get("host_syncs", {}).items() if k == "router"]
    router_ok = [1.0 if v == "none" else 0.0 for v in syncs if not v.startswith("not checked")]
    memory = [c["activation_bytes"][n]["ratio_to_minimum"] for c in cases for n in c.get("activation_bytes", {})
              if n.startswith("moekit[auto") and "ratio_to_minimum" in c["activation_bytes"][n]]
    return [
        line("MoE layer fwd+bwd: titan-style time / moekit time", ">= 1.2", speedups("titan-style"), True, 1.2, src),
        line("MoE layer fwd+bwd: transformers Mixtral block (eager) / moekit", ">= 5",
             speedups("transformers[eager]"), True, 5.0, src),
        line("MoE layer: router + permute + combine share of layer time", "<= 10%",
             [c["router_permute_combine_share"] for c in cases if "router_permute_combine_share" in c], False, 0.10, src),
        line("  the same share of GPU kernel time (no launch overhead)", "<= 10%",
             [c["router_permute_combine_kernel_share"] for c in cases if "router_permute_combine_kernel_share" in c],
             False, 0.10, src),
        line("MoE layer: router forward+backward free of host syncs (1 = none)", "= 1", router_ok, True, 1.0, src),
        line("MoE layer: saved activations / minimum (moekit[auto])", "<= 1.2", memory, False, 1.2, src),
    ]


def dispatch_lines(data: dict | None) -> list[dict]:
    results = (data or {}).get("results", [])
    out = []
    copy_ms = {(r["config"], r["tokens"], r["op"]): r["median_ms"] for r in results
               if r["impl"] == "copy" and r.get("median_ms")}
    for op in ("dispatch_fwd", "dispatch_bwd", "combine_fwd", "combine_bwd"):
        mine = [r for r in results if r["op"] == op and r["impl"] == "moekit"]
        vals = [r["vs_copy"] for r in mine if r.get("vs_copy")]
        out.append(line(f"local {op}: moekit GB/s / plain copy GB/s", ">= 0.7", vals, True, 0.7, "dispatch_bandwidth.json"))
        # the op's kernels alone (torch.profiler; a clone is one kernel, so its wall time is its kernel time):
        # a small op's wall clock also counts the per-call host time of an isolated call (autograd.grad's
        # hand-off to its device thread), which a training step's queued backward does not pay
        by_kernel = [copy_ms[key] / r["kernel_ms"] for r in mine if r.get("kernel_ms")
                     and (key := (r["config"], r["tokens"], op)) in copy_ms]
        out.append(line("  the same by GPU kernel time (copy ms / moekit kernel ms)", ">= 0.7", by_kernel, True, 0.7,
                        "dispatch_bandwidth.json"))
    return out


def mfu_lines(data: dict | None, fused: dict | None = None) -> list[dict]:
    """The MFU rows of train_mfu.json, then those of train_mfu_fused.json (gpu_suite's train_mfu_fused step:
    the fused permute's run, beside the base one on the same machine) where it is there."""
    out = []
    for source, name in ((data, "train_mfu.json"), (fused, "train_mfu_fused.json")):
        for r in (source or {}).get("results", []):
            vals = [r["mfu"]] if r.get("mfu") is not None else []
            label = r.get("config", "?") + ("-fused" if name == "train_mfu_fused.json" else "")
            out.append(line(f"training MFU, {label}", ">= 45%", vals, True, 0.45, name))
    return out or [line("training MFU (mixtral-1b, bf16)", ">= 45%", [], True, 0.45, "train_mfu.json")]


def lm_loss_lines(data: dict | None) -> list[str]:
    """One line per lm_loss.py case: the fused cross-entropy's time and its speed-up over the other two peers."""
    cases: dict[tuple, dict] = {}
    for r in (data or {}).get("rows", []):
        cases.setdefault((r["tokens"], r["hidden"], r["vocab"]), {})[r["peer"]] = r
    out = []
    for (n, h, v), peers in cases.items():
        fused = (peers.get("fused") or {}).get("ms")
        cells = [f"N {n} H {h} V {v}: fused " + (f"{fused:.2f} ms" if fused else "-")]
        for name in ("chunked torch", "plain"):
            ms = (peers.get(name) or {}).get("ms")
            cells.append(f"{name} {ms / fused:.2f}x" if ms and fused else f"{name} -")
        out.append(", ".join(cells))
    return out


def batch_generate_lines(data: dict | None) -> list[str]:
    """One line per batch_generate.py model: each mode's tokens/s and its ratio to one prompt at a time."""
    by_model: dict[str, list[dict]] = {}
    for r in (data or {}).get("results", []):
        by_model.setdefault(r["preset"], []).append(r)
    out = []
    for name, rows in by_model.items():
        cells = [f"{'alone' if r['batch'] == 1 and r['impl'] == 'moekit' else r['impl'] + ' ' + str(r['batch'])} "
                 f"{r['tok_s']:.0f} tok/s ({r['vs_alone']:.2f}x, tokens = alone {r['agree']:.0%})" for r in rows]
        out.append(f"{name}: " + ", ".join(cells))
    return out


def test_tier(folder: Path) -> dict | None:
    """Counts and failing test names from the GPU tier's JUnit XML (gpu_suite.sh's tests step)."""
    import xml.etree.ElementTree as ET

    path = folder / "gpu_tests.xml"
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        print(f"note: {path}: cannot be read as JUnit XML ({exc}); no test tier counts", file=sys.stderr)
        return None
    cases = root.iter("testcase")
    out = {"passed": 0, "failed": [], "skipped": 0}
    for case in cases:
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            out["failed"].append(name)
        elif case.find("skipped") is not None:
            out["skipped"] += 1
        else:
            out["passed"] += 1
    return out


def fmt(v, goal: str) -> str:
    if v is None:
        return "-"
    return f"{v:.1%}" if "%" in goal else f"{v:.2f}"


def parse(argv):
    p = BenchParser(prog="suite_summary.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", nargs="?", default="bench-results/raw", metavar="FOLDER",
                   help="the folder of the suite's JSON files (default bench-results/raw; gpu_suite.sh passes its own)")
    args = p.parse_args(argv)
    if not os.path.isdir(args.folder):
        what = "is a file, not a folder" if os.path.exists(args.folder) else "no such folder"
        p.error(f"{args.folder}: {what}; give the folder gpu_suite.sh wrote its JSON files to")
    check_out(p, os.path.join(args.folder, "summary.json"), flag="")
    return Path(args.folder)


def main(argv=None) -> int:
    folder = parse(sys.argv[1:] if argv is None else argv)
    if not any((folder / name).exists() for name in INPUTS):
        print(f"note: {folder} holds none of {', '.join(INPUTS)}; every target reads 'no data'", file=sys.stderr)
    lines = (grouped_gemm_lines(load(folder, "grouped_gemm.json")) + moe_layer_lines(load(folder, "moe_layer.json"))
             + dispatch_lines(load(folder, "dispatch_bandwidth.json"))
             + mfu_lines(load(folder, "train_mfu.json"), load(folder, "train_mfu_fused.json")))
    profile = load(folder, "profile/profile_step.json") or load(folder, "profile_step.json")
    width = max(len(ln["target"]) for ln in lines)
    print(f"\n{'issue 9 target':<{width}}  {'goal':>7}  {'worst':>7}  {'median':>7}  status")
    for ln in lines:
        print(f"{ln['target']:<{width}}  {ln['goal']:>7}  {fmt(ln['worst'], ln['goal']):>7}  "
              f"{fmt(ln['median'], ln['goal']):>7}  {ln['status']}")
    if profile:
        top = sorted(profile["categories"], key=lambda c: c["share"], reverse=True)[:5]
        print(f"profile ({profile['preset']}, {profile['step_ms']:.0f} ms/step, {profile['time_basis']}): "
              + ", ".join(f"{c['category']} {c['share']:.0%}" for c in top))
    loss_lines = lm_loss_lines(load(folder, "lm_loss.json"))
    if loss_lines:
        print("LM-head loss fwd+bwd (lm_loss.py): chunked torch passes' time / the fused kernel's, plain logits' / fused")
        for text in loss_lines:
            print("  " + text)
    gen_lines = batch_generate_lines(load(folder, "batch_generate.json"))
    if gen_lines:
        print("batched decoding (batch_generate.py): new tokens/s, x one prompt at a time")
        for text in gen_lines:
            print("  " + text)
    tune = load(folder, "tune_kernels.json")
    if tune and tune.get("results"):
        print("tile-config sweep (tune_kernels.py): today's autotuned time / the best candidate's, per call")
        for r in tune["results"]:
            if r.get("best_config"):
                print(f"  {r['shape']:<16} {r['call']:<10} {r['speedup']:.2f}x  best {r['best_config']} "
                      f"({r['best_tflops']:.0f} vs {r['current_tflops']:.0f} TFLOP/s)")
        for kernel, configs in (tune.get("winners") or {}).items():
            print(f"  winners {kernel}: {', '.join(configs)}")
    tests = test_tier(folder)
    if tests:
        print(f"GPU test tier (pytest -m gpu): {tests['passed']} passed, {len(tests['failed'])} failed, "
              f"{tests['skipped']} skipped" + "".join(f"\n  FAILED {n}" for n in tests["failed"]))
    envs = [d.get("environment", {}) for d in (load(folder, n) for n in ("moe_layer.json", "dispatch_bandwidth.json")) if d]
    if any(e.get("device") == "cpu" for e in envs):
        print("(CPU run: these numbers check the scripts, they are not measurements of the GPU targets)")
    payload = {"targets": lines, "profile_top": profile["categories"] if profile else None, "gpu_tests": tests,
               "tune_winners": tune.get("winners") if tune else None}
    (folder / "summary.json").write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
