"""The routing comparison report: one self-contained HTML page (``moekit-heatmap --compare``, ``moekit-sweep``).

Everything is inside the file: figures as base64 PNG (moekit.train.loadplots, at most 16 MP each), tables
as HTML, the style sheet inline, no script but a JSON block of the numbers (id "moekit-report-data") for
programs; no address outside the page is referenced, so it opens offline and can be mailed or archived.

Sections (element ids): summary, loss, imbalance, drops, experts, throughput, heatmaps, load-over-steps,
per-layer, specialisation (when asked), definitions.
"""
from __future__ import annotations

import base64
import datetime
import html
import json
import math

import numpy as np

from moekit.train import loadplots
from moekit.train.loadstats import HOT

SECTIONS = ("summary", "loss", "imbalance", "drops", "experts", "throughput", "heatmaps", "load-over-steps",
            "per-layer", "definitions")

STYLE = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 1.5em 2em; color: #222;
       max-width: 1800px; }
h1 { font-size: 1.5em; }
h2 { font-size: 1.2em; border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 1.8em; }
table { border-collapse: collapse; font-size: .85em; margin: .5em 0; }
th, td { border: 1px solid #ddd; padding: .25em .5em; text-align: right; }
th { background: #f3f3f3; } td.l, th.l { text-align: left; }
img { max-width: 100%; height: auto; border: 1px solid #eee; margin: .3em 0; }
.note { color: #8a4b00; } .muted { color: #666; font-size: .85em; } .failed { color: #b00020; }
.grid { display: flex; flex-wrap: wrap; gap: 1em; align-items: flex-start; }
.grid > div { flex: 1 1 600px; }
code { background: #f5f5f5; padding: 0 .2em; }
details { margin: .5em 0; }
"""


def _img(fig, alt: str) -> tuple[str, dict]:
    data = loadplots.png_bytes(fig)
    w, h = loadplots.png_size(data)
    tag = (f'<img alt="{html.escape(alt)}" width="{w}" height="{h}" '
           f'src="data:image/png;base64,{base64.b64encode(data).decode("ascii")}">')
    return tag, {"alt": alt, "width": w, "height": h}


def _fmt(v, spec: str = ".2f", pct: bool = False) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{100 * v:{spec}}%" if pct else f"{v:{spec}}"


def _table(header: list[str], rows: list[list[str]], left: int = 2) -> str:
    th = "".join(f'<th class="{"l" if i < left else ""}">{html.escape(h)}</th>' for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(f'<td class="{"l" if i < left else ""}">{c}</td>' for i, c in enumerate(r))
                   + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def summary_rows(runs) -> tuple[list[str], list[list[str]]]:
    """The runs table; a "val_loss EMA" column when any run kept a parameter average (--train.ema_decay)."""
    averaged = any(math.isfinite(r.final("val_loss_ema")) for r in runs)
    header = ["run", "router", "experts", "layers", "steps", "loss", "val_loss", *(["val_loss EMA"] if averaged else []),
              "imb mean", "imb p50", "imb p95", "imb max", "worst-layer p95", "cv mean", "dropped", "dead", "saturated",
              "tokens/s"]
    rows = []
    for r in runs:
        s = r.summary
        rows.append([html.escape(r.name), html.escape(s["router"]), str(s["experts"]), str(s["layers"]),
                     f"{s['steps'][0]}-{s['steps'][1]}", _fmt(r.final("loss"), ".4f"),
                     _fmt(r.final("val_loss"), ".4f"), *([_fmt(r.final("val_loss_ema"), ".4f")] if averaged else []),
                     *(_fmt(s["step_imbalance"][k]) for k in ("mean", "p50", "p95", "max")),
                     _fmt(s["step_imbalance_worst_layer"]["p95"]), _fmt(s["step_cv"]["mean"]),
                     _fmt(s["dropped_fraction"], ".2f", True), _fmt(s["dead_fraction"], ".1f", True),
                     _fmt(s["saturated_fraction"], ".1f", True), _fmt(r.tokens_per_s(), ".0f")])
    return header, rows


def final_tasks(run) -> dict:
    """{task: its last --eval.tasks scores, with the step} of a run (train.task_loop), {} when it scored none."""
    return loadplots.last_tasks(run.metrics)


def tasks_table(runs, names: list[str]) -> str:
    """Each run's last acc_norm (and acc) per task, beside chance."""
    header = ["run", "step"] + [f"{name} acc_norm / acc" for name in names]
    rows = []
    for r in runs:
        last = final_tasks(r)
        step = max((t["step"] for t in last.values()), default=None)
        cells = [f"{100 * last[n]['acc_norm']:.1f}% / {100 * last[n]['acc']:.1f}%" if n in last else "-"
                 for n in names]
        rows.append([html.escape(r.name), "-" if step is None else str(step), *cells])
    chance = {n: t.get("chance") for r in runs for n, t in final_tasks(r).items()}
    rows.append(["chance", "", *(f"{100 * chance[n]:.1f}%" if chance.get(n) is not None else "-" for n in names)])
    return _table(header, rows, left=1)


def per_layer_table(run) -> str:
    header = ["layer", "imb mean", "imb p50", "imb p95", "imb max", "cv mean", "window imb", "dropped", "dead",
              "saturated"]
    rows = [[html.escape(x["layer"]), *(_fmt(x["step_imbalance"][k]) for k in ("mean", "p50", "p95", "max")),
             _fmt(x["step_cv_mean"]), _fmt(x["window_imbalance"]), _fmt(x["dropped_fraction"], ".2f", True),
             _fmt(x["dead_fraction"], ".1f", True), _fmt(x["saturated_fraction"], ".1f", True)]
            for x in run.analysis.per_layer()]
    return _table(header, rows, left=1)


def specialisation_html(name: str, spec: dict, max_experts: int = 16) -> tuple[str, list]:
    """A run's specialisation section: figure of position buckets x experts, and the top-token tables."""
    parts = [f"<h3>{html.escape(name)}</h3>",
             f'<p class="muted">{html.escape(spec.get("source", ""))}: {spec["tokens"]:,} tokens, '
             f'{len(spec["layers"])} MoE layers. Token specificity = the share of that token\'s occurrences routed '
             f'to the expert.</p>']
    images = []
    tag, meta = _img(loadplots.fig_positions(name, spec), f"{name}: expert share by token position")
    parts.append(tag)
    images.append(meta)
    for layer in spec["layers"][:: max(1, len(spec["layers"]) // 4)][:4]:
        rows = []
        for e in layer["experts"][:max_experts]:
            top = ", ".join(f"<code>{html.escape(t['text'])}</code> {t['count']} ({100 * t['specificity']:.0f}%)"
                            for t in e["top_tokens"][:6])
            rows.append([str(e["expert"]), _fmt(e["share"], ".1f", True), top])
        more = len(layer["experts"]) - max_experts
        parts.append(f"<details><summary>{html.escape(layer['name'])}: top tokens per expert (token-id routing "
                     f"concentration {_fmt(layer['token_concentration'])})</summary>"
                     + _table(["expert", "share", "top tokens: count (specificity)"], rows, left=3)
                     + (f'<p class="muted">{more} more experts in the JSON</p>' if more > 0 else "") + "</details>")
    return "".join(parts), images


DEFINITIONS = f"""
<ul>
<li><b>per-step imbalance</b>: in one optimizer step, one MoE layer: max over experts of the kept tokens /
their mean (1 = balanced, E = one expert took everything). Its distribution is over every (step, layer) pair
of the window (mean, p50, p95, max); <i>worst-layer</i> takes the worst layer of each step first. This is
not the imbalance of counts summed over the window, which hides per-step spikes (shown as <i>window imb</i>).</li>
<li><b>cv</b>: std / mean of the kept tokens per expert in a step (population std).</li>
<li><b>dropped</b>: dropped slots / slots the router assigned (capacity routing); 0 for dropless routing.</li>
<li><b>dead</b>: experts that got no token in a step, as a share of the experts (mean over steps and layers).</li>
<li><b>saturated</b>: experts at capacity in a step (they dropped slots: assigned &gt; kept); <b>hot</b>: experts
with at least {HOT:g}x the layer's mean load in a step.</li>
<li><b>heatmaps</b>: colour = the expert's share of its layer's kept tokens (1/E is uniform), one colour scale
shared by every run, so runs with different expert counts compare.</li>
<li><b>downstream tasks</b> (--eval.tasks): acc_norm, the share of items whose right choice has the highest
log-likelihood per character; the right choice's negative log-likelihood per token falls long before a small
model's accuracy rises.</li>
<li><b>tokens/s</b>: median over steps of tokens of the global batch / the step's wall time.</li>
</ul>
"""


def write_report(runs, out: str, title: str = "moekit routing comparison", notes: list[str] | None = None,
                 failed: list[tuple[str, str]] | None = None, specialisation: dict | None = None,
                 flag: str | None = "--html", fix: str = "choose another path") -> dict:
    """Write the HTML report of ``runs`` (heatmap.RunRecords) to ``out``; returns the embedded data. An ``out``
    that cannot be written is a UserError naming ``flag`` and ``out`` and ending in ``fix``, before the figures
    are drawn."""
    loadplots.check_output(out, flag, fix, example="report.html")
    series = [loadplots.Series(r.name, r.analysis, r.metrics, r.window_text()) for r in runs]
    parts, images = [], []

    def figure(fig, alt):
        tag, meta = _img(fig, alt)
        images.append(meta)
        return tag

    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    parts.append(f"<h1>{html.escape(title)}</h1><p class='muted'>{len(runs)} run(s), written {stamp} by "
                 f"moekit-heatmap. Runs: {', '.join(html.escape(r.path) for r in runs)}</p>")
    header, rows = summary_rows(runs)
    sec = [_table(header, rows)]
    for n in notes or []:
        sec.append(f'<p class="note">{html.escape(n)}</p>')
    for name, why in failed or []:
        sec.append(f'<p class="failed">failed: {html.escape(name)}: {html.escape(why)}</p>')
    parts.append(_section("summary", "Summary", "".join(sec)))
    parts.append(_section("loss", "Loss", figure(loadplots.fig_loss(series), "train and validation loss")))
    names = loadplots.task_names(series)
    if names:  # --eval.tasks
        parts.append(_section("tasks", "Downstream tasks", tasks_table(runs, names) + figure(
            loadplots.fig_tasks(series), "downstream task accuracy over steps")))
    if loadplots.grad_part_names(series):  # metrics.jsonl grad_norm_by_part (moekit.train.grad_parts)
        parts.append(_section("gradients", "Gradient norm by part", figure(
            loadplots.fig_grad_parts(series), "gradient norm by part of the model over steps")))
    parts.append(_section("imbalance", "Per-step imbalance",
                          figure(loadplots.fig_imbalance_time(series), "per-step imbalance and cv over steps")
                          + figure(loadplots.fig_imbalance_dist(series), "distribution of per-step imbalance")))
    parts.append(_section("drops", "Drop rate", figure(loadplots.fig_drops(series), "dropped fraction over steps")))
    parts.append(_section("experts", "Dead and saturated experts",
                          figure(loadplots.fig_experts(series), "dead and saturated experts over steps")))
    parts.append(_section("throughput", "Throughput", figure(loadplots.fig_throughput(series), "tokens per second")))
    vmax = loadplots.shared_vmax(series)
    parts.append(_section("heatmaps", "Expert load (window share, shared colour scale)",
                          figure(loadplots.fig_layers(series, vmax), "layers x experts load heatmaps")))
    bands = [loadplots.step_bands(s.analysis)[0] for s in series]
    svmax = max(float(np.nanmax(b)) for b in bands)
    steps = "".join(f"<div>{figure(loadplots.fig_steps(s, svmax), f'{s.label}: load over steps')}</div>"
                    for s in series)
    parts.append(_section("load-over-steps", "Expert load over steps (shared colour scale)", steps))
    parts.append(_section("per-layer", "Per layer", "".join(
        f"<details{' open' if len(runs) <= 2 else ''}><summary>{html.escape(r.name)}</summary>{per_layer_table(r)}"
        f"</details>" for r in runs)))
    if specialisation:
        body = []
        for name, spec in specialisation.items():
            text, metas = specialisation_html(name, spec)
            body.append(text)
            images.extend(metas)
        parts.append(_section("specialisation", "Expert specialisation", "".join(body)))
    parts.append(_section("definitions", "Definitions", DEFINITIONS))
    data = {"format": "moekit-report", "version": 1, "title": title,
            "runs": [{"name": r.name, "path": r.path, "summary": r.summary, "per_layer": r.analysis.per_layer(),
                      "final_loss": r.final("loss"), "final_val_loss": r.final("val_loss"),
                      "final_val_loss_ema": r.final("val_loss_ema"),
                      "final_tasks": final_tasks(r),
                      "tokens_per_s": r.tokens_per_s()} for r in runs],
            "failed": [{"name": n, "error": e} for n, e in failed or []], "notes": notes or [], "images": images}
    blob = json.dumps(_clean(data), indent=None).replace("</", "<\\/")
    page = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{STYLE}</style></head><body>\n" + "\n".join(parts)
            + f'\n<script type="application/json" id="moekit-report-data">{blob}</script>\n</body></html>\n')
    loadplots.write_file(out, page.encode("utf-8"), flag, fix)
    return data


def _section(sid: str, title: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{html.escape(title)}</h2>{body}</section>'


def _clean(x):
    """JSON-safe: NaN and infinities become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, np.generic):
        return _clean(x.item())
    return x


def read_report_data(path: str) -> dict:
    """The JSON block of a report (for tests and programs)."""
    text = open(path, encoding="utf-8").read()
    start = text.index('id="moekit-report-data">') + len('id="moekit-report-data">')
    return json.loads(text[start : text.index("</script>", start)].replace("<\\/", "</"))
