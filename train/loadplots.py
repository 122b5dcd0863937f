"""The figures of moekit-heatmap and the comparison report, bounded in size whatever the run's size.

Every figure is drawn from moekit.train.loadstats results (step bins, per-step statistics), never from the
raw [N, L, E] record, and saved at a size capped to MAX_PIXELS (16 megapixels; most are 1-4 MP):

    layers      MoE layers x experts, each cell the expert's share of the layer's tokens over the window;
                runs side by side on one shared colour scale
    steps       per run: step bins (at most loadstats.MAX_BINS columns) x layer bands; within a band the
                experts sorted by window load, hottest on top, in at most STEP_GROUPS rows (group means)
    lines       loss, per-step imbalance over time and its distribution, drops, dead / saturated experts,
                tokens/s: curves of at most MAX_POINTS binned points per run

``save_figure`` writes a figure in the format its path's suffix names (FIGURE_FORMATS); ``check_output`` tells,
before any work, whether a path can be written, and ``write_file`` writes one through a .partial file, both as
one-line UserErrors naming the flag and the path. Needs matplotlib (the ``viz`` extra).
"""
from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass

import numpy as np

from moekit.train import UserError
from moekit.train.runlock import check_output_path
from moekit.train.loadstats import HOT, LoadAnalysis

INSTALL_HINT = 'the heatmaps are drawn with matplotlib, which is not installed: pip install -e ".[viz]" ' \
               '(or pip install matplotlib); --text-only prints the summary without it'
MAX_PIXELS = 16_000_000
STEP_GROUPS = 32  # rows per layer band in the steps heatmap (experts grouped by load rank beyond that)
MAX_POINTS = 600  # points per curve
DPI = 100
FIGURE_FORMATS = ("png", "jpg", "jpeg", "pdf", "svg")  # what --out may name (Agg writes each by suffix)
# no metadata naming matplotlib's web address in the files (jpg carries none)
_NO_METADATA = {"png": {"Software": None}, "pdf": {"Creator": None, "Producer": None}, "svg": {"Creator": None}}


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UserError(INSTALL_HINT) from None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def colour(i: int) -> str:
    return f"C{i % 10}"


def capped_dpi(fig, dpi: float = DPI, max_pixels: int = MAX_PIXELS) -> float:
    w, h = fig.get_size_inches()
    return min(dpi, (max_pixels / max(w * h, 1e-9)) ** 0.5 * 0.999)


def png_bytes(fig, dpi: float = DPI) -> bytes:
    """The figure as PNG bytes (no metadata: nothing in the file names a web address), closed afterwards."""
    plt = pyplot()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=capped_dpi(fig, dpi), metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def check_figure_suffix(path: str, flag: str = "--out") -> str:
    """The figure format ``path``'s suffix asks for (png, jpg, pdf, svg); UserError for any other."""
    fmt = os.path.splitext(path)[1].lower().lstrip(".")
    if fmt not in FIGURE_FORMATS:
        what = f"a .{fmt} file" if fmt else "a file without a suffix"
        raise UserError(f"{flag} {path}: cannot draw {what}; give a path ending in "
                        f"{', '.join('.' + f for f in FIGURE_FORMATS[:-1])} or .{FIGURE_FORMATS[-1]}")
    return fmt


def check_output(path: str, flag: str | None = None, fix: str = "choose another path",
                 example: str = "expert_load.png") -> None:
    """UserError, before any work, where ``path`` cannot become a file (runlock.check_output_path); the message
    names ``flag`` and ``path`` and ends in ``fix``; missing folders are made when the file is written."""
    check_output_path(path, f"{flag} {path}" if flag else path, fix, example)


def write_file(path: str, data: bytes, flag: str | None = None, fix: str = "choose another path") -> None:
    """Write ``data`` to ``path`` (its missing folders made) through ``path``.partial, so no half-written file
    takes its name; an OSError is a UserError naming ``flag`` and ``path``, and leaves no .partial behind."""
    tmp = f"{path}.partial"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        label = f"{flag} {path}" if flag else path
        raise UserError(f"{label}: cannot write it ({exc.strerror or exc}); {fix}") from None


def save_figure(fig, path: str, dpi: float = DPI, flag: str | None = "--out",
                fix: str = "choose another path") -> None:
    """Write the figure in the format its suffix names (check_figure_suffix), closed afterwards."""
    fmt = check_figure_suffix(path, flag or "--out")
    plt = pyplot()
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=capped_dpi(fig, dpi), metadata=_NO_METADATA.get(fmt))
    plt.close(fig)
    write_file(path, buf.getvalue(), flag, fix)


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of PNG bytes."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@dataclass
class Series:
    """One run's data for the figures."""

    label: str
    analysis: LoadAnalysis
    metrics: list[dict]
    window: str = ""


def _short(name: str) -> str:
    return name.replace(".ffn", "").replace("layers.", "L")


def _ticks(n: int, most: int = 24) -> list[int]:
    step = max(1, -(-n // most))
    return list(range(0, n, step))


# ---------------------------------------------------------------------------------------------------
# Heatmaps
# ---------------------------------------------------------------------------------------------------


def shared_vmax(runs: list[Series]) -> float:
    return max(max(float(r.analysis.share.max()), 1.0 / r.analysis.num_experts) for r in runs)


def draw_layers_panel(ax, run: Series, vmax: float, annotate: bool = True):
    """Layers x experts heatmap of the window share; per-layer statistics on the right when they fit."""
    a = run.analysis
    share = a.share  # [L, E]
    L, E = share.shape
    im = ax.imshow(share, aspect="auto", cmap="viridis", vmin=0.0, vmax=vmax, interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_xticks(range(E) if E <= 32 else range(0, E, max(E // 16, 1)))
    rows = _ticks(L, 32)
    ax.set_yticks(rows, [_short(a.layers[i]) for i in rows], fontsize=7 if L > 16 else 9)
    if annotate and L <= 16:
        stats = a.layer_stats()
        right = ax.twinx()  # per-layer statistics as right-hand tick labels, so layouts make room for them
        right.set_ylim(ax.get_ylim())
        right.set_yticks(range(L), [f"imb p95 {s.step_imbalance['p95']:.2f}\ncv {s.cv:.2f} drop {100 * s.dropped:.1f}%"
                                    for s in stats], fontsize=7 if L > 8 else 8)
    ax.set_title(f"{run.label}\n{run.window}, uniform share = {1 / E:.3g}", fontsize=9)
    return im


def fig_layers(runs: list[Series], vmax: float | None = None):
    """The window-share heatmaps of ``runs`` side by side on one colour scale."""
    plt = pyplot()
    vmax = shared_vmax(runs) if vmax is None else vmax
    L = max(len(r.analysis.layers) for r in runs)
    widths = [min(max(5.0, 0.3 * r.analysis.num_experts + 3.5), 14.0) for r in runs]
    height = min(max(3.5, 0.45 * L + 2.5) if L <= 24 else 0.2 * L + 3.0, 18.0)
    fig, axes = plt.subplots(1, len(runs), figsize=(sum(widths), height), squeeze=False, layout="constrained",
                             gridspec_kw={"width_ratios": widths})
    im = None
    for ax, run in zip(axes[0], runs):
        im = draw_layers_panel(ax, run, vmax)
    fig.colorbar(im, ax=list(axes[0]), label="share of the layer's tokens", fraction=0.03 if len(runs) > 1 else 0.05)
    return fig


def step_bands(a: LoadAnalysis, groups: int = STEP_GROUPS) -> tuple[np.ndarray, int]:
    """[L * (G + 1) - 1, B] image: per layer, G rows of experts sorted by window load (hottest first; group
    means of the share when E > G), bands separated by a NaN row. Returns (image, G)."""
    share = a.bin_share  # [B, L, E]
    B, L, E = share.shape
    G = min(E, groups)
    order = np.argsort(-a.totals, axis=1, kind="stable")  # [L, E] experts by window load
    bounds = np.linspace(0, E, G + 1).round().astype(np.int64)
    img = np.full((L * (G + 1) - 1, B), np.nan)
    for i in range(L):
        s = share[:, i, order[i]]  # [B, E] sorted
        grouped = np.add.reduceat(s, bounds[:-1], axis=1) / np.diff(bounds)  # [B, G]
        img[i * (G + 1) : i * (G + 1) + G] = grouped.T
    return img, G


def fig_steps(run: Series, vmax: float | None = None):
    """One run's load over time: step bins x layer bands of experts sorted by load (module doc)."""
    plt = pyplot()
    a = run.analysis
    img, G = step_bands(a)
    L, E = len(a.layers), a.num_experts
    vmax = float(np.nanmax(img)) if vmax is None else vmax
    height = min(max(3.0, 0.012 * img.shape[0] + 2.0, 0.35 * L + 2.0), 30.0)
    fig, ax = plt.subplots(figsize=(12.0, height), layout="constrained")
    import matplotlib

    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    x = a.bin_steps
    lo, hi = float(a.steps[0]), float(a.steps[-1])
    half = (hi - lo) / max(len(x), 1) / 2 if len(x) > 1 else 0.5
    im = ax.imshow(np.ma.masked_invalid(img), aspect="auto", cmap=cmap, vmin=0.0, vmax=max(vmax, 1e-12),
                   interpolation="antialiased" if img.shape[1] > 400 or img.shape[0] > 1500 else "nearest",
                   extent=(lo - half, hi + half, img.shape[0] - 0.5, -0.5))
    rows = _ticks(L, 40)
    ax.set_yticks([i * (G + 1) + (G - 1) / 2 for i in rows], [_short(a.layers[i]) for i in rows],
                  fontsize=7 if L > 16 else 8)
    ax.set_xlabel("step")
    _integer_x(ax)
    grouped = f", experts in {G} groups of {E / G:.3g}" if G < E else ""
    ax.set_ylabel(f"MoE layer (experts by load, hottest on top{grouped})", fontsize=8)
    bins = len(x)
    per = f"{(a.steps.size / bins):.3g} records per column" if bins < a.steps.size else "one record per column"
    ax.set_title(f"{run.label}: expert load over steps ({run.window}; {per})", fontsize=9)
    fig.colorbar(im, ax=ax, label="share of the layer's tokens", fraction=0.03)
    return fig


# ---------------------------------------------------------------------------------------------------
# Curves
# ---------------------------------------------------------------------------------------------------


def binned_curve(x: np.ndarray, y: np.ndarray, points: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most ``points`` (x, y) pairs: means over contiguous bins (NaN-aware)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    ok = ~np.isnan(y)
    x, y = x[ok], y[ok]
    if x.size <= points:
        return x, y
    edges = np.unique(np.linspace(0, x.size, points + 1).round().astype(np.int64))
    n = np.diff(edges)
    return np.add.reduceat(x, edges[:-1]) / n, np.add.reduceat(y, edges[:-1]) / n


def _metric(metrics: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    rows = [(m["step"], m[key]) for m in metrics if isinstance(m.get(key), (int, float)) and not m.get("skipped")]
    if not rows:
        return np.zeros(0), np.zeros(0)
    a = np.array(rows, dtype=np.float64)
    return a[:, 0], a[:, 1]


def _panels(n: int, height: float = 3.4):
    plt = pyplot()
    return plt.subplots(1, n, figsize=(6.2 * n, height), squeeze=False, layout="constrained")


def _legend(ax):
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _integer_x(ax):
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _style(*axes, xlabel: str | None = "step", ylabel: str | None = None, zero: bool = False) -> None:
    """The finish every line panel shares: labels, integer x ticks, grid, legend; ``zero``: y from 0."""
    for ax in axes:
        if xlabel:
            ax.set_xlabel(xlabel)
            _integer_x(ax)
        if ylabel:
            ax.set_ylabel(ylabel)
        if zero:
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        _legend(ax)


SET_STYLES = ("--", ":", "-.")  # a blend's per-set curves beside the run's own


def _by_source(metrics: list[dict], key: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{set file name: (steps, values)} of a per-set metric (``val_loss_by_source``), in the sets' order."""
    from moekit.train.data import set_names

    series: dict[str, list[tuple[int, float]]] = {}
    for m in metrics:
        for path, v in (m.get(key) or {}).items():
            series.setdefault(path, []).append((m["step"], v))
    return {name: (np.array([s for s, _ in rows], dtype=np.float64), np.array([v for _, v in rows]))
            for name, rows in zip(set_names(series), series.values())}


def fig_loss(runs: list[Series]):
    fig, axes = _panels(2)
    tr, va = axes[0]
    for i, r in enumerate(runs):
        x, y = _metric(r.metrics, "loss")
        bx, by = binned_curve(x, y)
        tr.plot(bx, by, color=colour(i), label=r.label, lw=1.2)
        x, y = _metric(r.metrics, "val_loss")
        va.plot(x, y, color=colour(i), marker="o", ms=3, label=r.label, lw=1.2)
        for j, (name, (x, y)) in enumerate(_by_source(r.metrics, "val_loss_by_source").items()):  # a blend's sets
            va.plot(x, y, color=colour(i), ls=SET_STYLES[j % len(SET_STYLES)], lw=0.9, label=f"{r.label}: {name}")
        x, y = _metric(r.metrics, "val_loss_ema")  # --train.ema_decay: the parameter average's loss
        if x.size:
            va.plot(x, y, color=colour(i), marker="^", ms=3, ls=":", lw=1.2, label=f"{r.label}: EMA weights")
    tr.set_title("train loss (LM cross-entropy, binned mean)", fontsize=9)
    va.set_title("validation loss (a blend: each set dashed; EMA weights dotted)", fontsize=9)
    _style(tr, va, ylabel="nats / token")
    return fig


def last_tasks(metrics: list[dict]) -> dict:
    """{task: its last --eval.tasks scores, with the step} of a run's metrics (train.task_loop), {} without any."""
    for m in reversed(metrics):
        if m.get("tasks"):
            return {name: dict(r, step=m["step"]) for name, r in m["tasks"].items()}
    return {}


def task_names(runs: list[Series]) -> list[str]:
    """The --eval.tasks tasks any run scored, in the order first met."""
    names: dict[str, None] = {}
    for r in runs:
        for m in r.metrics:
            names.update(dict.fromkeys(m.get("tasks") or {}))
    return list(names)


def fig_tasks(runs: list[Series]):
    """Each --eval.tasks task's acc_norm over steps (one colour per run, a line style per task; one run: a colour
    per task) with its chance level in grey, and the right choices' negative log-likelihood per token."""
    fig, axes = _panels(2)
    acc, nll = axes[0]
    names = task_names(runs)
    for i, r in enumerate(runs):
        for j, name in enumerate(names):
            rows = [(m["step"], m["tasks"][name]) for m in r.metrics if name in (m.get("tasks") or {})]
            if not rows:
                continue
            x = np.array([s for s, _ in rows], dtype=np.float64)
            style = SET_STYLES[j % len(SET_STYLES)] if len(names) > 1 else "-"
            label = f"{r.label}: {name}" if len(runs) > 1 else name
            acc.plot(x, [100 * t["acc_norm"] for _, t in rows], color=colour(i if len(runs) > 1 else j), ls=style,
                     marker="o", ms=3, lw=1.2, label=label)
            nll.plot(x, [t["correct_nll"] for _, t in rows], color=colour(i if len(runs) > 1 else j), ls=style,
                     marker="o", ms=3, lw=1.2, label=label)
            if i == 0 and rows[-1][1].get("chance") is not None:
                acc.axhline(100 * rows[-1][1]["chance"], color="grey", ls=style, lw=0.8,
                            label=f"chance ({name})" if len(names) > 1 else "chance")
    acc.set_title("downstream tasks: acc_norm (accuracy per character of the choice)", fontsize=9)
    nll.set_title("right choice's negative log-likelihood per token", fontsize=9)
    _style(acc, ylabel="%")
    _style(nll, ylabel="nats / token")
    return fig


def grad_part_names(runs: list[Series]) -> list[str]:
    """The parts any run recorded a gradient norm for (metrics.jsonl grad_norm_by_part), first met first."""
    return list(dict.fromkeys(k for r in runs for m in r.metrics for k in (m.get("grad_norm_by_part") or {})))


def fig_grad_parts(runs: list[Series]):
    """The gradient norm by part (moekit.train.grad_parts), binned over steps, log scale: every part of the first
    run that recorded them beside its global norm, and each run's router part (the usual first sign of an unstable
    MoE run) to compare runs."""
    def part(metrics: list[dict], name: str) -> tuple[np.ndarray, np.ndarray]:  # (steps, norms) binned, as _metric
        rows = [(m["step"], m["grad_norm_by_part"][name]) for m in metrics if not m.get("skipped")
                and (m.get("grad_norm_by_part") or {}).get(name) is not None]
        return binned_curve(np.array([s for s, _ in rows], dtype=np.float64), np.array([v for _, v in rows]))

    fig, axes = _panels(2)
    parts_ax, router_ax = axes[0]
    first = next(r for r in runs if any(m.get("grad_norm_by_part") for m in r.metrics))
    parts_ax.plot(*binned_curve(*_metric(first.metrics, "grad_norm")), color="black", lw=1.4, label="global")
    for j, name in enumerate(grad_part_names([first])):
        parts_ax.plot(*part(first.metrics, name), color=colour(j), lw=1.1, label=name)
    for i, r in enumerate(runs):
        x, y = part(r.metrics, "router")
        if x.size:
            router_ax.plot(x, y, color=colour(i), lw=1.2, label=r.label)
    parts_ax.set_title(f"gradient norm by part before clipping, binned: {first.label}", fontsize=9)
    router_ax.set_title("the routers' gradient norm, binned", fontsize=9)
    for ax in (parts_ax, router_ax):
        if ax.lines:
            ax.set_yscale("log")
    _style(parts_ax, router_ax, ylabel="L2 norm")
    return fig


def fig_imbalance_time(runs: list[Series]):
    fig, axes = _panels(2)
    imb, cv = axes[0]
    for i, r in enumerate(runs):
        a = r.analysis
        x = a.bin_steps
        imb.plot(x, a.binned(a.imbalance.mean(axis=1)), color=colour(i), lw=1.2, label=f"{r.label}: mean of layers")
        imb.plot(x, a.binned(a.imbalance.max(axis=1)), color=colour(i), lw=1.0, ls="--",
                 label=f"{r.label}: worst layer")
        cv.plot(x, a.binned(a.cv.mean(axis=1)), color=colour(i), lw=1.2, label=r.label)
    imb.set_title("per-step imbalance max/mean (1 = balanced), binned over steps", fontsize=9)
    cv.set_title("per-step coefficient of variation std/mean, mean of layers", fontsize=9)
    _style(imb, cv)
    return fig


def fig_imbalance_dist(runs: list[Series]):
    fig, axes = _panels(2)
    cdf, lay = axes[0]
    for i, r in enumerate(runs):
        a = r.analysis
        v = np.sort(a.imbalance.ravel())
        q = np.linspace(0, 1, min(v.size, 2000))
        cdf.plot(np.quantile(v, q), q, color=colour(i), lw=1.2, label=r.label)
        per = np.percentile(a.imbalance, [50, 95], axis=0)  # [2, L]
        x = np.arange(len(a.layers))
        lay.plot(x, per[0], color=colour(i), lw=1.2, marker=".", label=f"{r.label}: p50")
        lay.plot(x, per[1], color=colour(i), lw=1.0, ls="--", label=f"{r.label}: p95")
        lay.plot(x, a.imbalance.max(axis=0), color=colour(i), lw=0.8, ls=":", label=f"{r.label}: max")
    cdf.set_title("distribution of per-step imbalance over (step, layer)", fontsize=9)
    cdf.set_xlabel("max/mean tokens per expert in a step")
    cdf.set_ylabel("fraction of (step, layer) pairs <= x")
    lay.set_title("per-step imbalance by layer: p50, p95, max over steps", fontsize=9)
    _style(cdf, xlabel=None)
    _style(lay, xlabel="MoE layer (index)")
    return fig


def fig_drops(runs: list[Series]):
    fig, axes = _panels(1)
    ax = axes[0][0]
    for i, r in enumerate(runs):
        a = r.analysis
        ax.plot(a.bin_steps, 100 * a.binned(a.dropped.mean(axis=1)), color=colour(i), lw=1.2,
                label=f"{r.label}: mean of layers")
        ax.plot(a.bin_steps, 100 * a.binned(a.dropped.max(axis=1)), color=colour(i), lw=1.0, ls="--",
                label=f"{r.label}: worst layer")
    ax.set_title("dropped slots / assigned slots per step (%)", fontsize=9)
    _style(ax, ylabel="%", zero=True)
    return fig


def fig_experts(runs: list[Series]):
    fig, axes = _panels(2)
    dead, sat = axes[0]
    for i, r in enumerate(runs):
        a = r.analysis
        E = a.num_experts
        dead.plot(a.bin_steps, 100 * a.binned(a.dead.mean(axis=1)) / E, color=colour(i), lw=1.2, label=r.label)
        sat.plot(a.bin_steps, 100 * a.binned(a.saturated.mean(axis=1)) / E, color=colour(i), lw=1.2,
                 label=f"{r.label}: saturated (dropped slots)")
        sat.plot(a.bin_steps, 100 * a.binned(a.hot.mean(axis=1)) / E, color=colour(i), lw=1.0, ls=":",
                 label=f"{r.label}: hot (>= {HOT:g}x mean)")
    dead.set_title("dead experts: no token in the step (% of experts, mean of layers)", fontsize=9)
    sat.set_title("saturated and hot experts (% of experts, mean of layers)", fontsize=9)
    _style(dead, sat, ylabel="% of experts", zero=True)
    return fig


def fig_throughput(runs: list[Series]):
    fig, axes = _panels(1)
    ax = axes[0][0]
    for i, r in enumerate(runs):
        x, y = _metric(r.metrics, "tokens_per_s")
        bx, by = binned_curve(x, y)
        ax.plot(bx, by, color=colour(i), lw=1.2, label=r.label)
    ax.set_title("throughput (tokens/s of the whole job, binned mean)", fontsize=9)
    _style(ax, ylabel="tokens / s")
    return fig


def fig_positions(label: str, spec: dict, layers: int = 4):
    """Specialisation: per layer, the share of each position bucket's slots per expert (rows: buckets)."""
    plt = pyplot()
    chosen = spec["layers"][:: max(1, -(-len(spec["layers"]) // layers))][:layers]
    fig, axes = plt.subplots(1, len(chosen), figsize=(min(4.5 * len(chosen), 18), 3.2), squeeze=False,
                             layout="constrained")
    im = None
    vmax = max(float(np.max(layer["position_share"])) for layer in chosen)
    for ax, layer in zip(axes[0], chosen):
        m = np.asarray(layer["position_share"])  # [buckets, E]
        im = ax.imshow(m, aspect="auto", cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest")
        ax.set_yticks(range(len(spec["position_buckets"])), spec["position_buckets"], fontsize=7)
        ax.set_xlabel("expert")
        ax.set_title(f"{label}\n{layer['name']}", fontsize=8)
    axes[0][0].set_ylabel("token position")
    fig.colorbar(im, ax=list(axes[0]), label="share of the bucket's slots", fraction=0.03)
    return fig
