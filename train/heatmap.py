"""Expert-load analysis of training runs: ``moekit-heatmap`` (or ``python tools/heatmap.py`` in a checkout).

    moekit-heatmap RUN_DIR [--steps FIRST:LAST] [--out PNG]
        RUN_DIR/expert_load.png        layers x experts: share of each layer's tokens per expert
        RUN_DIR/expert_load_steps.png  per MoE layer, experts x steps
        stdout                         per-layer imbalance (max/mean), CV, dropped fraction
    moekit-heatmap --compare RUN_A RUN_B ... [--out PNG]
        side-by-side heatmaps on one colour scale (default compare.png) and a table on stdout

Statistics over the step window, per MoE layer, from tokens per expert c_e (kept slots, summed):
    share_e = c_e / sum(c)     imbalance = max(c) / mean(c)  (1 = balanced, E = one expert takes all)
    cv = std(c) / mean(c)      dropped = dropped slots / assigned slots
Needs matplotlib for the PNGs (pip install -e ".[viz]"); --text-only prints the summary without it.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import numpy as np

from moekit.train import UserError, program_name
from moekit.train.records import ExpertLoadRecord, read_config, read_expert_load, read_metrics

INSTALL_HINT = 'the heatmaps are drawn with matplotlib, which is not installed: pip install -e ".[viz]" ' \
               '(or pip install matplotlib); --text-only prints the summary without it'


@dataclass
class LayerStats:
    name: str
    share: np.ndarray  # [E] fraction of the layer's kept slots per expert
    imbalance: float
    cv: float
    dropped: float


def layer_stats(rec: ExpertLoadRecord) -> list[LayerStats]:
    counts = rec.tokens.sum(axis=0).astype(np.float64)  # [L, E]
    assigned = rec.assigned.sum(axis=(0, 2)).astype(np.float64)  # [L]
    dropped = rec.dropped.sum(axis=0)  # [L]
    out = []
    for i, name in enumerate(rec.layers):
        c = counts[i]
        mean = c.mean()
        share = c / c.sum() if c.sum() > 0 else np.zeros_like(c)
        out.append(LayerStats(name, share, float(c.max() / mean) if mean > 0 else 0.0,
                              float(c.std() / mean) if mean > 0 else 0.0,
                              float(dropped[i] / assigned[i]) if assigned[i] > 0 else 0.0))
    return out


def parse_window(text: str | None) -> tuple[int | None, int | None]:
    if not text:
        return None, None
    first, sep, last = text.partition(":")
    try:
        lo, hi = (int(first) if first else None), (int(last) if last else None)
    except ValueError:
        raise UserError(f"--steps {text!r}: expected FIRST:LAST step numbers, e.g. 100:200 or 100:") from None
    if not sep or (lo is not None and hi is not None and lo > hi):
        raise UserError(f"--steps {text!r}: expected FIRST:LAST with FIRST <= LAST, e.g. 100:200")
    return lo, hi


@dataclass
class RunRecords:
    path: str
    config: dict
    metrics: list[dict]
    load: ExpertLoadRecord
    stats: list[LayerStats]

    @property
    def label(self) -> str:
        return f"{os.path.basename(os.path.normpath(self.path))} ({self.load.router})"

    def window_text(self) -> str:
        return f"steps {self.load.steps.min()}-{self.load.steps.max()}"


def read_run(path: str, window) -> RunRecords:
    load = read_expert_load(path).window(*window)
    return RunRecords(path, read_config(path), read_metrics(path), load, layer_stats(load))


# ---------------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------------


def summary_text(run: RunRecords) -> str:
    lines = [f"{run.path}: router {run.load.router} (top_k {run.load.top_k}), {len(run.load.layers)} MoE layers x "
             f"{run.load.tokens.shape[2]} experts, {run.window_text()}",
             f"{'layer':<16} {'imbalance':>9} {'cv':>6} {'dropped':>8}  {'hottest':>12}  {'coldest':>12}"]
    for s in run.stats:
        hot, cold = int(s.share.argmax()), int(s.share.argmin())
        lines.append(f"{s.name:<16} {s.imbalance:>9.2f} {s.cv:>6.2f} {100 * s.dropped:>7.2f}%  "
                     f"e{hot:<3}{100 * s.share[hot]:>6.1f}%  e{cold:<3}{100 * s.share[cold]:>6.1f}%")
    return "\n".join(lines)


def last_value(metrics: list[dict], key: str) -> float:
    vals = [m[key] for m in metrics if m.get(key) is not None]
    return vals[-1] if vals else float("nan")


def compare_rows(runs: list[RunRecords]) -> list[list[str]]:
    header = ["run", "router", "steps", "loss", "val_loss", "imbalance", "cv", "dropped", "tokens/s"]
    rows = [header]
    for r in runs:
        tps = float(np.median([m["tokens_per_s"] for m in r.metrics])) if r.metrics else float("nan")
        rows.append([os.path.basename(os.path.normpath(r.path)), r.load.router, str(int(r.load.steps.max())),
                     f"{last_value(r.metrics, 'loss'):.4f}", f"{last_value(r.metrics, 'val_loss'):.4f}",
                     f"{np.mean([s.imbalance for s in r.stats]):.2f}", f"{np.mean([s.cv for s in r.stats]):.2f}",
                     f"{100 * np.mean([s.dropped for s in r.stats]):.2f}%", f"{tps:.0f}"])
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


# ---------------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------------


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UserError(INSTALL_HINT) from None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def draw_layers(ax, run: RunRecords, vmax: float):
    """Layers x experts heatmap with per-layer annotations; returns the image for a colour bar."""
    share = np.stack([s.share for s in run.stats])  # [L, E]
    im = ax.imshow(share, aspect="auto", cmap="viridis", vmin=0.0, vmax=vmax, interpolation="nearest")
    E = share.shape[1]
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_xticks(range(E) if E <= 32 else range(0, E, max(E // 16, 1)))
    ax.set_yticks(range(len(run.stats)), [s.name.replace(".ffn", "") for s in run.stats])
    right = ax.twinx()  # per-layer statistics as right-hand tick labels, so layouts make room for them
    right.set_ylim(ax.get_ylim())
    right.set_yticks(range(len(run.stats)), [f"imb {s.imbalance:.2f}\ncv {s.cv:.2f}\ndrop {100 * s.dropped:.1f}%"
                                             for s in run.stats], fontsize=7)
    ax.set_title(f"{run.label}\n{run.window_text()}, uniform share = {1 / E:.3f}", fontsize=9)
    return im


def draw_run(run: RunRecords, out: str) -> None:
    plt = pyplot()
    E = run.load.tokens.shape[2]
    vmax = max(float(max(s.share.max() for s in run.stats)), 1.0 / E)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * E + 3.5), 1.0 + 0.6 * len(run.stats) + 1.5), layout="constrained")
    fig.colorbar(draw_layers(ax, run, vmax), ax=ax, label="share of the layer's tokens")
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)


def draw_steps(run: RunRecords, out: str) -> None:
    """One panel per MoE layer: experts (rows) x steps (columns), share of that step's tokens."""
    plt = pyplot()
    tokens = run.load.tokens.astype(np.float64)  # [N, L, E]
    share = tokens / np.maximum(tokens.sum(axis=2, keepdims=True), 1)  # [N, L, E]
    L, E = share.shape[1], share.shape[2]
    fig, axes = plt.subplots(L, 1, figsize=(10, 0.25 * E * L + 1.5), squeeze=False, sharex=True, layout="constrained")
    steps = run.load.steps
    for i, (ax, s) in enumerate(zip(axes[:, 0], run.stats)):
        im = ax.imshow(share[:, i, :].T, aspect="auto", cmap="viridis", vmin=0.0, interpolation="nearest",
                       extent=(steps.min() - 0.5, steps.max() + 0.5, E - 0.5, -0.5))
        ax.set_ylabel("expert", fontsize=8)
        ax.set_title(f"{s.name}: imbalance {s.imbalance:.2f}, cv {s.cv:.2f}, dropped {100 * s.dropped:.1f}%",
                     fontsize=8)
        fig.colorbar(im, ax=ax, label="share")
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(f"{run.label}: expert load per step", fontsize=10)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def draw_compare(runs: list[RunRecords], out: str) -> None:
    plt = pyplot()
    vmax = max(float(max(s.share.max() for s in r.stats)) for r in runs)
    L = max(len(r.stats) for r in runs)
    fig, axes = plt.subplots(1, len(runs), figsize=(5.6 * len(runs), 1.5 + 0.6 * L + 1.5), squeeze=False,
                             layout="constrained")
    im = None
    for ax, run in zip(axes[0], runs):
        im = draw_layers(ax, run, vmax)
    fig.colorbar(im, ax=list(axes[0]), label="share of the layer's tokens", fraction=0.03)
    rows = compare_rows(runs)
    fig.text(0.01, -0.02, format_table(rows), family="monospace", fontsize=8, va="top")
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UserError(f"{message} (see --help)")


def parse_args(argv):
    p = _Parser(prog=program_name("heatmap.py"), description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("run_dir", nargs="?", help="a moekit-train run directory")
    p.add_argument("--compare", nargs="+", metavar="RUN", help="compare two or more run directories")
    p.add_argument("--steps", help="step window FIRST:LAST (either side may be empty); default all steps")
    p.add_argument("--out", help="PNG path (default RUN_DIR/expert_load.png, or compare.png)")
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
            diffs = config_differences(runs)
            if diffs:
                print(f"note: the runs also differ in {', '.join(diffs)}; a routing comparison should keep them equal")
            if not args.text_only:
                out = args.out or "compare.png"
                draw_compare(runs, out)
                print(f"wrote {out}")
            return 0
        run = read_run(args.run_dir, window)
        wrote = ""
        if not args.text_only:  # figures first: a reader that stops early (| head) does not cost them
            out = args.out or os.path.join(args.run_dir, "expert_load.png")
            steps_out = os.path.splitext(out)[0] + "_steps.png"
            draw_run(run, out)
            draw_steps(run, steps_out)
            wrote = f"wrote {out} and {steps_out}"
        print(summary_text(run))
        if wrote:
            print(wrote)
        return 0
    except BrokenPipeError:  # e.g. `moekit-heatmap RUN | head`: the reader has gone, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 0
    except UserError as exc:
        print(f"{program_name('heatmap.py')}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
