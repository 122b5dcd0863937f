"""Expert-load analysis of training runs: ``moekit-heatmap`` (or ``python tools/heatmap.py`` in a checkout).

    moekit-heatmap RUN_DIR [--steps FIRST:LAST] [--out FIGURE] [--html REPORT.html [--specialisation]]
        RUN_DIR/expert_load.png        layers x experts: share of each layer's tokens per expert
        RUN_DIR/expert_load_steps.png  load over steps: step bins x layers, experts sorted by load
                                       (--out names the first, .png, .jpg, .pdf or .svg; OUT_steps the second)
        stdout                         per layer: per-step imbalance (mean, p50, p95, max), CV, drops, dead
    moekit-heatmap --compare RUN_A RUN_B ... [--html REPORT.html] [--out FIGURE] [--specialisation]
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
prints the summary without it. Output paths are checked before any run is read.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, field

import numpy as np

from moekit.train import OneLineParser, UserError, program_name, run_program
from moekit.train.loadplots import (Series, check_figure_suffix, check_output, fig_layers, fig_steps, last_tasks,
                                    pyplot, save_figure)
from moekit.train.loadstats import LayerStats, LoadAnalysis, analyse
from moekit.train.record_readers import (ExpertLoadRecord, expert_load_path, parse_window, read_config,
                                         read_expert_load, read_metrics)
from moekit.train.runlock import describe_os_error


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


def print_note(text: str) -> None:
    print(f"{program_name('heatmap.py')}: note: {text}", file=sys.stderr)


def read_run(path: str, window) -> RunRecords:
    load = read_expert_load(path)
    if load.partial_bytes:  # a crash mid-write, or a run still writing
        n = len(load)
        print_note(f"{load.source} ends in a partial record ({load.partial_bytes} bytes); read {n} whole "
             f"record{'s' if n != 1 else ''}")
    load = load.window(*window)
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
    """The comparison table; runs that scored --eval.tasks get each task's last acc_norm too, and a val_loss_ema
    column comes with any run that kept a parameter average (--train.ema_decay)."""
    names = list(dict.fromkeys(name for r in runs for name in last_tasks(r.metrics)))
    averaged = any(math.isfinite(r.final("val_loss_ema")) for r in runs)
    header = ["run", "router", "steps", "loss", "val_loss", *(["val_loss_ema"] if averaged else []), "imb_mean",
              "imb_p50", "imb_p95", "imb_max", "cv", "dropped", "dead", "tokens/s", *(f"{name} acc_norm" for name in names)]
    rows = [header]
    for r in runs:
        s = r.summary
        si = s["step_imbalance"]
        tasks = last_tasks(r.metrics)
        ema = [f"{r.final('val_loss_ema'):.4f}" if math.isfinite(r.final("val_loss_ema")) else "-"] if averaged else []
        rows.append([r.name, r.load.router, str(int(r.load.steps.max())), f"{r.final('loss'):.4f}",
                     f"{r.final('val_loss'):.4f}", *ema, f"{si['mean']:.2f}", f"{si['p50']:.2f}", f"{si['p95']:.2f}",
                     f"{si['max']:.2f}", f"{s['step_cv']['mean']:.2f}", f"{100 * s['dropped_fraction']:.2f}%",
                     f"{100 * s['dead_fraction']:.1f}%", f"{r.tokens_per_s():.0f}",
                     *(f"{100 * tasks[n]['acc_norm']:.1f}%" if n in tasks else "-" for n in names)])
    return rows


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def _flat(config: dict) -> dict:
    return {f"{s}.{k}": v for s, sec in config.items() if isinstance(sec, dict) for k, v in sec.items()}


def config_differences(runs: list[RunRecords]) -> list[str]:
    """Settings (other than the router's) that differ between runs: a fair comparison keeps them equal. A setting
    missing from a run's config.json (a run of a moekit that predates it) counts as its default, which is how that
    run behaved."""
    from moekit.train.config import TrainConfig

    ignore = {"model.router", "model.router_options", "model.capacity_factor", "log.run_dir", "model.name"}
    defaults = _flat(TrainConfig().to_dict())
    flat = [_flat(r.config) for r in runs]
    keys = sorted(set().union(*flat) - ignore)
    return [k for k in keys if len({repr(f.get(k, defaults.get(k))) for f in flat}) > 1]


def difference_note(runs: list[RunRecords]) -> str | None:
    missing = [r.path for r in runs if not r.config]
    if missing:
        return (f"note: {', '.join(missing)} {'has' if len(missing) == 1 else 'have'} no config.json, so the runs' "
                f"settings are not compared")
    diffs = config_differences(runs)
    if not diffs:
        return None
    return f"note: the runs also differ in {', '.join(diffs)}; a routing comparison should keep them equal"


# ---------------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------------


def series(run: RunRecords) -> Series:
    return Series(run.label, run.analysis, run.metrics, run.window_text())


def draw_run(run: RunRecords, out: str, flag: str | None = "--out", fix: str = "choose another path") -> None:
    save_figure(fig_layers([series(run)]), out, flag=flag, fix=fix)


def draw_steps(run: RunRecords, out: str, flag: str | None = "--out", fix: str = "choose another path") -> None:
    save_figure(fig_steps(series(run)), out, flag=flag, fix=fix)


def draw_compare(runs: list[RunRecords], out: str) -> None:
    save_figure(fig_layers([series(r) for r in runs]), out)


def specialisation_of(run: RunRecords) -> dict | None:
    """The run's expert specialisation (specialisation.for_run_dir: RUN/specialisation.json, computed from the
    newest checkpoint and cached there when missing); where the run directory cannot take that cache, computed
    without it. None, with a note, for a run without one."""
    from moekit.train import specialisation

    cache = os.path.join(run.path, specialisation.SPEC_FILE)
    try:
        if not os.path.exists(cache):
            try:
                check_output(cache, fix="computing it without caching")
            except UserError as exc:
                print_note(str(exc))
                return specialisation.for_run_dir(run.path, cache=False)
        return specialisation.for_run_dir(run.path)
    except UserError as exc:
        print_note(f"no specialisation for {run.path}: {exc}")
    except OSError as exc:  # e.g. the cache's write failed after all (a full disk)
        print_note(f"no specialisation for {run.path}: {describe_os_error(exc)}")
    return None


def write_html(runs: list[RunRecords], out: str, specialisation: bool = False, failed=None, title=None,
               flag: str | None = "--html", fix: str = "choose another path") -> dict:
    from moekit.train.report import write_report

    spec = None
    if specialisation:
        spec = {r.name: s for r in runs if (s := specialisation_of(r)) is not None}
    note = difference_note(runs) if len(runs) > 1 else None
    return write_report(runs, out, title=title or ("moekit routing comparison" if len(runs) > 1 else
                                                  f"moekit expert load: {runs[0].name}"),
                        notes=[note] if note else [], failed=failed, specialisation=spec, flag=flag, fix=fix)


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------


def parse_args(argv):
    p = OneLineParser(prog=program_name("heatmap.py"), description=__doc__, allow_abbrev=False,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", nargs="?", help="a moekit-train run directory")
    p.add_argument("--compare", nargs="+", metavar="RUN", help="compare two or more run directories")
    p.add_argument("--steps", help="step window FIRST:LAST (either side may be empty; 5:5 is step 5 alone); "
                                   "default all steps")
    p.add_argument("--out", help="figure path, .png, .jpg, .pdf or .svg (default RUN_DIR/expert_load.png, and "
                                 "OUT_steps beside it; with --compare: also write the side-by-side heatmaps here)")
    p.add_argument("--html", metavar="REPORT", help="write the HTML report here (with --compare the default is "
                                                    "compare.html, or --out's path with .html)")
    p.add_argument("--specialisation", action="store_true",
                   help="add expert specialisation to the HTML report (so, for one run, with --html): "
                        "RUN/specialisation.json, computed from the run's newest checkpoint when missing "
                        "(moekit-eval --specialisation) and cached there where the run directory is writable")
    p.add_argument("--text-only", action="store_true", help="print the summary, draw nothing (no --out, --html or "
                                                            "--specialisation)")
    args = p.parse_args(argv)
    if bool(args.run_dir) == bool(args.compare):
        raise UserError("give one RUN_DIR, or --compare RUN_A RUN_B ... (see --help)")
    if args.compare and len(args.compare) < 2:
        raise UserError("--compare needs at least two run directories")
    seen = {}
    for path in args.compare or []:
        first = seen.setdefault(os.path.realpath(path), path)
        if first is not path:
            same = "given twice" if first == path else f"the same run as {first}"
            raise UserError(f"--compare {path}: {same}; compare different run directories")
    drawn = [flag for flag, given in (("--out", args.out), ("--html", args.html),
                                      ("--specialisation", args.specialisation)) if given]
    if args.text_only and drawn:
        raise UserError(f"--text-only draws nothing, so it cannot take {' or '.join(drawn)}; drop one of them")
    if args.specialisation and args.run_dir and not args.html:
        raise UserError("--specialisation adds a section to the HTML report, which one run writes only with "
                        "--html REPORT.html; give --html too")
    return args


def outputs(args) -> list[tuple[str, str | None, str, str]]:
    """The files the program will write: (path, its flag or None for a default path, the fix to suggest when it
    cannot be written, an example file name for a path that is a directory); the report last."""
    if args.text_only:
        return []
    another = "choose another path"
    if args.compare:
        figure = [(args.out, "--out", another, "expert_load.png")] if args.out else []
        if args.html:
            return figure + [(args.html, "--html", another, "report.html")]
        html = os.path.splitext(args.out)[0] + ".html" if args.out else "compare.html"
        return figure + [(html, None, "give --html elsewhere, or --text-only", "report.html")]
    flag, fix = ("--out", another) if args.out else (None, "give --out elsewhere, or --text-only")
    out = args.out or os.path.join(args.run_dir, "expert_load.png")
    stem, ext = os.path.splitext(out)
    files = [(out, flag, fix, "expert_load.png"), (f"{stem}_steps{ext}", flag, fix, "expert_load.png")]
    return files + ([(args.html, "--html", another, "report.html")] if args.html else [])


def main(argv: list[str] | None = None) -> int:
    return run_program(program_name("heatmap.py"), lambda: run(parse_args(sys.argv[1:] if argv is None else argv)))


def run(args) -> int:
    try:
        window = parse_window(args.steps)
        for path in args.compare or [args.run_dir]:
            expert_load_path(path)  # a missing or wrong run directory first: the output checks would name it
        files = outputs(args)
        for path, flag, fix, example in files:
            check_output(path, flag, fix, example)
        if args.out:
            check_figure_suffix(args.out)
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
            if files:
                if args.out:
                    draw_compare(runs, args.out)
                    print(f"wrote {args.out}")
                html, flag, fix, _ = files[-1]
                write_html(runs, html, args.specialisation, flag=flag, fix=fix)
                print(f"wrote {html}")
            return 0
        single = read_run(args.run_dir, window)
        wrote = []
        if files:  # figures first: a reader that stops early (| head) does not cost them
            (out, flag, fix, _), (steps_out, *_) = files[:2]
            draw_run(single, out, flag, fix)
            draw_steps(single, steps_out, flag, fix)
            wrote += [out, steps_out]
            if args.html:
                write_html([single], args.html, args.specialisation)
                wrote.append(args.html)
        print(summary_text(single))
        if wrote:
            print(f"wrote {', '.join(wrote[:-1])} and {wrote[-1]}" if len(wrote) > 1 else f"wrote {wrote[0]}")
        return 0
    except BrokenPipeError:  # e.g. `moekit-heatmap RUN | head`: the reader has gone, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 0


if __name__ == "__main__":
    sys.exit(main())
