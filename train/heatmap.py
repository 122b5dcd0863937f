"""Expert-load analysis of training runs: ``moekit-heatmap`` (or ``python tools/heatmap.py`` in a checkout).

    moekit-heatmap RUN_DIR [--steps FIRST:LAST] [--out PNG] [--html REPORT.html]
        RUN_DIR/expert_load.png        layers x experts: share of each layer's tokens per expert
        RUN_DIR/expert_load_steps.png  load over steps: step bins x layers, experts sorted by load
        stdout                         per layer: per-step imbalance (mean, p50, p95, max), CV, drops, dead
    moekit-heatmap --compare RUN_A RUN_B ... [--html REPORT.html] [--out PNG] [--specialisation]
        REPORT.html (default compare.html, or --out's name with .html): the comparison report, one
        self-contained page (loss, per-step imbalance and its distribution, drops, dead and saturated
        experts, tokens/s, heatmaps on a shared colour scale); --out also writes the heatmaps as a PNG;
        stdout: the comparison table

Per optimizer step and MoE layer, from the kept tokens per expert c_e of that step (moekit.train.loadstats):
    imbalance = max(c) / mean(c)  (1 = balanced, E = one expert takes all)   cv = std(c) / mean(c)
    dropped = dropped slots / assigned slots    dead = experts with no token    saturated = experts that dropped
then their distribution over steps: mean, p50, p95, max. The heatmaps colour each expert by its share
of the layer's tokens. Records of any size (61 layers x 256 experts x 100k steps) are read in chunks and
every figure is binned to at most 16 megapixels. Needs matplotlib (pip install -e ".[viz]"); --text-only
prints the summary without it.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

import numpy as np

from moekit.train import OneLineParser, UserError, program_name
from moekit.train.loadplots import INSTALL_HINT, Series, fig_layers, fig_steps, pyplot, save_png  # noqa: F401
from moekit.train.loadstats import LayerStats, LoadAnalysis, analyse
from moekit.train.records import ExpertLoadRecord, parse_window, read_config, read_expert_load, read_metrics


def layer_stats(rec: ExpertLoadRecord) -> list[LayerStats]:
    """Per-layer statistics of a record's window (summed counts and per-step distributions)."""
    return analyse(rec).layer_stats()


@dataclass
class RunRecords:
    path: str
    config: dict
    metrics: list[dict]
    load: ExpertLoadRecord
    analysis: LoadAnalysis
    summary: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.path))

    @property
    def label(self) -> str:
        return f"{self.name} ({self.load.router})"

    @property
    def stats(self) -> list[LayerStats]:
        return self.analysis.layer_stats()

    def window_text(self) -> str:
        return f"steps {self.load.steps.min()}-{self.load.steps.max()}"

    def final(self, key: str) -> float:
        return last_value(self.metrics, key)

    def tokens_per_s(self) -> float:
        vals = [m["tokens_per_s"] for m in self.metrics if isinstance(m.get("tokens_per_s"), (int, float))]
        return float(np.median(vals)) if vals else float("nan")


def read_run(path: str, window) -> RunRecords:
    load = read_expert_load(path).window(*window)
    analysis = analyse(load)
    metrics = read_metrics(path) if os.path.exists(os.path.join(path, "metrics.jsonl")) else []
    config = read_config(path) if os.path.exists(os.path.join(path, "config.json")) else {}
    return RunRecords(path, config, metrics, load, analysis, analysis.summary())


# ---------------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------------


def summary_text(run: RunRecords) -> str:
    s = run.summary
    si, worst = s["step_imbalance"], s["step_imbalance_worst_layer"]
    lines = [f"{run.path}: router {run.load.router} (top_k {run.load.top_k}), {len(run.load.layers)} MoE layers x "
             f"{run.load.num_experts} experts, {run.window_text()} ({s['records']} records)",
             f"per-step imbalance over (step, layer): mean {si['mean']:.2f}, p50 {si['p50']:.2f}, p95 {si['p95']:.2f}, "
             f"max {si['max']:.2f}; worst layer per step p95 {worst['p95']:.2f}; cv mean {s['step_cv']['mean']:.2f}; "
             f"dropped {100 * s['dropped_fraction']:.2f}%; dead {100 * s['dead_fraction']:.1f}%; saturated "
             f"{100 * s['saturated_fraction']:.1f}%",
             f"{'layer':<16} {'imb_mean':>8} {'p50':>6} {'p95':>6} {'max':>6} {'window':>6} {'cv':>6} {'dropped':>8} "
             f"{'dead':>6}  {'hottest':>12}  {'coldest':>12}"]
    for st in run.stats:
        d = st.step_imbalance
        hot, cold = int(st.share.argmax()), int(st.share.argmin())
        lines.append(f"{st.name:<16} {d['mean']:>8.2f} {d['p50']:>6.2f} {d['p95']:>6.2f} {d['max']:>6.2f} "
                     f"{st.imbalance:>6.2f} {st.cv:>6.2f} {100 * st.dropped:>7.2f}% {100 * st.dead_fraction:>5.1f}%  "
                     f"e{hot:<3}{100 * st.share[hot]:>6.1f}%  e{cold:<3}{100 * st.share[cold]:>6.1f}%")
    return "\n".join(lines)


def last_value(metrics: list[dict], key: str) -> float:
    vals = [m[key] for m in metrics if m.get(key) is not None and not m.get("skipped")]
    return vals[-1] if vals else float("nan")


def compare_rows(runs: list[RunRecords]) -> list[list[str]]:
    header = ["run", "router", "steps", "loss", "val_loss", "imb_mean", "imb_p50", "imb_p95", "imb_max", "cv",
              "dropped", "dead", "tokens/s"]
    rows = [header]
    for r in runs:
        s = r.summary
        si = s["step_imbalance"]
        rows.append([r.name, r.load.router, str(int(r.load.steps.max())), f"{r.final('loss'):.4f}",
                     f"{r.final('val_loss'):.4f}", f"{si['mean']:.2f}", f"{si['p50']:.2f}", f"{si['p95']:.2f}",
                     f"{si['max']:.2f}", f"{s['step_cv']['mean']:.2f}", f"{100 * s['dropped_fraction']:.2f}%",
                     f"{100 * s['dead_fraction']:.1f}%", f"{r.tokens_per_s():.0f}"])
    return rows


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def config_differences(runs: list[RunRecords]) -> list[str]:
    """Settings (other than the router's) that differ between runs: a fair comparison keeps them equal."""
    ignore = {"model.router", "model.router_options", "model.capacity_factor", "log.run_dir", "model.name"}
    flat = [{f"{s}.{k}": v for s, sec in r.config.items() if isinstance(sec, dict) for k, v in sec.items()}
            for r in runs]
    keys = sorted(set().union(*flat) - ignore)
    return [k for k in keys if len({repr(f.get(k)) for f in flat}) > 1]


def difference_note(runs: list[RunRecords]) -> str | None:
    diffs = config_differences(runs)
    if not diffs:
        return None
    return f"note: the runs also differ in {', '.join(diffs)}; a routing comparison should keep them equal"


# ---------------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------------


def series(run: RunRecords) -> Series:
    return Series(run.label, run.analysis, run.metrics, run.window_text())


def draw_run(run: RunRecords, out: str) -> None:
    save_png(fig_layers([series(run)]), out)


def draw_steps(run: RunRecords, out: str) -> None:
    save_png(fig_steps(series(run)), out)


def draw_compare(runs: list[RunRecords], out: str) -> None:
    save_png(fig_layers([series(r) for r in runs]), out)


def write_html(runs: list[RunRecords], out: str, specialisation: bool = False, failed=None, title=None) -> dict:
    from moekit.train.report import write_report

    spec = None
    if specialisation:
        from moekit.train.specialisation import for_run_dir

        spec = {}
        for r in runs:
            try:
                spec[r.name] = for_run_dir(r.path)
            except UserError as exc:
                print(f"{program_name('heatmap.py')}: note: no specialisation for {r.path}: {exc}", file=sys.stderr)
    note = difference_note(runs) if len(runs) > 1 else None
    return write_report(runs, out, title=title or ("moekit routing comparison" if len(runs) > 1 else
                                                  f"moekit expert load: {runs[0].name}"),
                        notes=[note] if note else [], failed=failed, specialisation=spec)


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------


def parse_args(argv):
    p = OneLineParser(prog=program_name("heatmap.py"), description=__doc__, allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", nargs="?", help="a moekit-train run directory")
    p.add_argument("--compare", nargs="+", metavar="RUN", help="compare two or more run directories")
    p.add_argument("--steps", help="step window FIRST:LAST (either side may be empty); default all steps")
    p.add_argument("--out", help="PNG path (default RUN_DIR/expert_load.png; with --compare: also write the "
                                 "side-by-side heatmaps here)")
    p.add_argument("--html", metavar="REPORT", help="write the HTML report here (with --compare the default is "
                                                    "compare.html, or --out's path with .html)")
    p.add_argument("--specialisation", action="store_true",
                   help="add expert specialisation to the report: RUN/specialisation.json, computed from the run's "
                        "newest checkpoint when missing (moekit-eval --specialisation)")
    p.add_argument("--text-only", action="store_true", help="print the summary, draw nothing")
    args = p.parse_args(argv)
    if bool(args.run_dir) == bool(args.compare):
        raise UserError("give one RUN_DIR, or --compare RUN_A RUN_B ... (see --help)")
    if args.compare and len(args.compare) < 2:
        raise UserError("--compare needs at least two run directories")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        window = parse_window(args.steps)
        if not args.text_only:
            pyplot()  # fail on a missing matplotlib before reading anything
        if args.compare:
            runs = [read_run(p, window) for p in args.compare]
            for r in runs:
                print(summary_text(r) + "\n")
            print(format_table(compare_rows(runs)))
            note = difference_note(runs)
            if note:
                print(note)
            if not args.text_only:
                if args.out:
                    draw_compare(runs, args.out)
                    print(f"wrote {args.out}")
                html = args.html or (os.path.splitext(args.out)[0] + ".html" if args.out else "compare.html")
                write_html(runs, html, args.specialisation)
                print(f"wrote {html}")
            return 0
        run = read_run(args.run_dir, window)
        wrote = []
        if not args.text_only:  # figures first: a reader that stops early (| head) does not cost them
            out = args.out or os.path.join(args.run_dir, "expert_load.png")
            steps_out = os.path.splitext(out)[0] + "_steps.png"
            draw_run(run, out)
            draw_steps(run, steps_out)
            wrote += [out, steps_out]
            if args.html:
                write_html([run], args.html, args.specialisation)
                wrote.append(args.html)
        print(summary_text(run))
        if wrote:
            print(f"wrote {', '.join(wrote[:-1])} and {wrote[-1]}" if len(wrote) > 1 else f"wrote {wrote[0]}")
        return 0
    except BrokenPipeError:  # e.g. `moekit-heatmap RUN | head`: the reader has gone, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 0
    except UserError as exc:
        print(f"{program_name('heatmap.py')}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
