"""Expert-load records, statistics, figures and the HTML report at scale; the TensorBoard and W&B sinks.

Oracles are recomputed here from the raw counts (numpy, float64), never from moekit.train.loadstats.
"""
from __future__ import annotations

import base64
import json
import os
import re
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from moekit.bench.heatmap_scale import synthetic_run
from moekit.train import heatmap, loadplots, records, report
from moekit.train.loadstats import analyse, layer_load_stats, load_metrics
from moekit.moe.load import LoadSummary

MAX_PIXELS = 16_000_000


def raw_counts(rows: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    body = rows[1:]
    return (np.array([r["step"] for r in body]), np.array([r["tokens"] for r in body], dtype=np.float64),
            np.array([r["assigned"] for r in body], dtype=np.float64), np.array([r["dropped"] for r in body]))


def oracle_step_imbalance(tokens: np.ndarray) -> np.ndarray:
    """[N, L] max/mean of each step's kept tokens per expert (0 for a layer without tokens)."""
    mean = tokens.mean(axis=2)
    return np.where(mean > 0, tokens.max(axis=2) / np.where(mean > 0, mean, 1), 0.0)


def dist(v: np.ndarray) -> dict:
    v = v.ravel()
    return {"mean": v.mean(), "p50": np.percentile(v, 50), "p95": np.percentile(v, 95), "max": v.max()}


def fake_load(tokens, assigned=None, stats=None) -> dict:
    tokens = np.asarray(tokens)
    assigned = tokens if assigned is None else np.asarray(assigned)
    return {f"layers.{i}.ffn": LoadSummary(tokens[i].tolist(), assigned[i].tolist(),
                                           int(assigned[i].sum() - tokens[i].sum()), 1, 0.0, dict(stats or {}))
            for i in range(tokens.shape[0])}


# ---------------------------------------------------------------------------------------------------
# The binary record
# ---------------------------------------------------------------------------------------------------


def test_binary_record_round_trips_with_a_stride(tmp_path):
    rng = np.random.default_rng(0)
    names = ["layers.0.ffn", "layers.1.ffn", "layers.3.ffn"]
    w = records.ExpertLoadWriter(tmp_path / records.EXPERT_LOAD_BIN, names, "switch", 1, 4, stride=3,
                                 max_count=1000)
    written = {}
    for step in range(1, 11):
        assigned = rng.integers(0, 50, (3, 4))
        tokens = np.minimum(assigned, 30)
        load = fake_load(tokens, assigned)
        assert w.write(step, load) == (step % 3 == 0)
        if step % 3 == 0:
            written[step] = (tokens, assigned)
    w.write(10, fake_load(tokens, assigned), force=True)  # the last step, off the stride
    written[10] = (tokens, assigned)
    w.close()
    head = (tmp_path / records.EXPERT_LOAD_BIN).read_bytes()[:4096]
    assert head.endswith(b"\n") and json.loads(head)["format"] == "moekit-expert-load-binary"
    rec = records.read_expert_load(tmp_path)
    assert rec.steps.tolist() == [3, 6, 9, 10] and rec.layers == names and rec.router == "switch"
    assert isinstance(rec.tokens, np.memmap) and rec.tokens.dtype == np.int32  # mapped, not read
    for i, step in enumerate(rec.steps):
        t, a = written[int(step)]
        assert (rec.tokens[i] == t).all() and (rec.assigned[i] == a).all()
        assert (rec.dropped[i] == a.sum(1) - t.sum(1)).all()
    rows = records.load_rows(tmp_path)  # the JSONL shape, from the binary file
    assert rows[0]["layers"] == names and [r["step"] for r in rows[1:]] == [3, 6, 9, 10]
    assert rows[1]["tokens"] == written[3][0].tolist()
    win = rec.window(5, 9)
    assert win.steps.tolist() == [6, 9] and isinstance(win.tokens, np.memmap)


def test_binary_record_resume_truncates_and_cut_records_are_ignored(tmp_path):
    path = tmp_path / records.EXPERT_LOAD_BIN
    w = records.ExpertLoadWriter(path, ["a", "b"], "topk", 2, 3, max_count=100)
    for step in range(1, 6):
        w.write_counts(step, np.full((2, 3), step), np.full((2, 3), step), [0, 0])
    w.close()
    with open(path, "ab") as f:  # a crash mid-write: half a record
        f.write(b"\x01" * 17)
    cut = records.read_expert_load(tmp_path)
    assert cut.steps.tolist() == [1, 2, 3, 4, 5] and cut.partial_bytes == 17 and cut.window(2, 3).partial_bytes == 17
    records.truncate_after(path, 3)  # --resume from step 3
    w = records.ExpertLoadWriter(path, ["a", "b"], "topk", 2, 3, max_count=100)
    w.write_counts(4, np.full((2, 3), 40), np.full((2, 3), 40), [0, 0])
    w.close()
    rec = records.read_expert_load(tmp_path)
    assert rec.steps.tolist() == [1, 2, 3, 4] and rec.tokens[-1, 0, 0] == 40
    with pytest.raises(records.UserError, match="records 2 MoE layers x 3 experts"):
        records.ExpertLoadWriter(path, ["a"], "topk", 2, 3)
    w = records.ExpertLoadWriter(tmp_path / "x.bin", ["a"], "topk", 1, 2, max_count=100)
    with pytest.raises(ValueError, match="does not fit int32"):
        w.write_counts(1, [[2**31, 0]], [[2**31, 0]], [0])
    w.close()


def test_old_jsonl_still_reads_and_converts(tmp_path):
    """A run of an older moekit (expert_load.jsonl) reads as before; resumed with the binary writer, its
    steps move into expert_load.bin; convert_jsonl rewrites one outright."""
    rng = np.random.default_rng(1)
    head = {"format": "moekit-expert-load", "version": 1, "router": "topk", "top_k": 2, "num_experts": 4,
            "layers": ["layers.0.ffn", "layers.1.ffn"]}
    lines = [head]
    for step in range(1, 5):
        t = rng.integers(0, 20, (2, 4))
        lines.append({"step": step, "tokens": t.tolist(), "assigned": t.tolist(), "dropped": [0, 0]})
    for name in ("old", "resumed"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "expert_load.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    rec = records.read_expert_load(tmp_path / "old")
    assert rec.steps.tolist() == [1, 2, 3, 4] and rec.tokens.tolist() == [x["tokens"] for x in lines[1:]]
    assert records.load_rows(tmp_path / "old") == lines
    w = records.ExpertLoadWriter(tmp_path / "resumed" / records.EXPERT_LOAD_BIN, head["layers"], "topk", 2, 4,
                                 max_count=100)
    w.write_counts(5, np.ones((2, 4)), np.ones((2, 4)), [0, 0])
    w.close()
    assert not (tmp_path / "resumed" / "expert_load.jsonl").exists()
    rows = records.load_rows(tmp_path / "resumed")
    assert rows[:5] == lines and rows[5]["step"] == 5
    out = records.convert_jsonl(tmp_path / "old", stride=2)
    assert out.name == "expert_load.bin" and not (tmp_path / "old" / "expert_load.jsonl").exists()
    assert records.read_expert_load(tmp_path / "old").steps.tolist() == [2, 4]
    assert records.auto_stride(61, 256, 100_000, budget_bytes=2 << 30) == 6  # 125 KB per step


# ---------------------------------------------------------------------------------------------------
# Statistics: per step, against a recomputation from the raw counts
# ---------------------------------------------------------------------------------------------------


def test_per_step_statistics_match_raw_records(tmp_path):
    run = synthetic_run(tmp_path / "s", layers=5, experts=16, steps=300, tokens_per_step=64, top_k=2, seed=3)
    step, tokens, assigned, dropped = raw_counts(records.load_rows(run))
    a = analyse(records.read_expert_load(run), max_bins=37, chunk_bytes=5 * 16 * 8 * 7)  # chunks of 7 steps
    imb = oracle_step_imbalance(tokens)
    np.testing.assert_allclose(a.imbalance, imb, rtol=1e-12)
    mean = tokens.mean(axis=2)
    np.testing.assert_allclose(a.cv, np.where(mean > 0, tokens.std(axis=2) / np.where(mean > 0, mean, 1), 0),
                               rtol=1e-9, atol=1e-12)
    assert (a.dead == (tokens == 0).sum(2)).all() and (a.saturated == (assigned > tokens).sum(2)).all()
    np.testing.assert_allclose(a.dropped, dropped / np.maximum(assigned.sum(2), 1))
    s = a.summary()
    for k, v in dist(imb).items():
        assert s["step_imbalance"][k] == pytest.approx(v, rel=1e-12)
    assert s["dropped_fraction"] == pytest.approx(dropped.sum() / assigned.sum())
    assert (a.totals == tokens.sum(0)).all() and a.bin_sums.sum(0).tolist() == tokens.sum(0).tolist()
    assert len(a.bin_edges) - 1 == 37 and a.bin_sums.shape == (37, 5, 16)
    # the window-sum imbalance hides per-step spikes: it is never above the per-step mean
    assert s["window_imbalance"] <= s["step_imbalance"]["mean"] + 1e-9


def test_layer_load_stats_and_metrics_keys():
    load = fake_load([[10, 0, 5, 5], [5, 5, 5, 5]], [[12, 0, 5, 5], [5, 5, 5, 5]],
                     {"load_balance": 1.25, "z_loss": 3.0})
    per = layer_load_stats(load)
    assert per["layers.0.ffn"] == pytest.approx({"imbalance": 2.0, "cv": np.std([10, 0, 5, 5]) / 5, "dropped": 2 / 22,
                                                 "dead": 1, "saturated": 1, "balance_loss": 1.25, "z_loss": 3.0})
    m = load_metrics(load)
    assert m["dead_experts"] == 1 and m["balance_loss"] == 1.25 and m["z_loss"] == 3.0
    assert "balance_loss" not in load_metrics(fake_load([[1, 2]]))  # a router that reports no such term


# ---------------------------------------------------------------------------------------------------
# Scale: a 61 x 256 record renders every figure within the pixel cap
# ---------------------------------------------------------------------------------------------------


def png_dims(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", data[16:24])
    return w, h


def test_deepseek_sized_record_renders_every_figure_under_16_megapixels(tmp_path):
    """61 MoE layers x 256 experts (fewer steps than tools/bench/heatmap_scale.py's 10,000, which times it)."""
    run = synthetic_run(tmp_path / "big", layers=61, experts=256, steps=120)
    rec = records.read_expert_load(run)
    assert rec.tokens.shape == (120, 61, 256)
    r = heatmap.read_run(str(run), (None, None))
    s = heatmap.series(r)
    figs = {"layers": loadplots.fig_layers([s]), "steps": loadplots.fig_steps(s), "loss": loadplots.fig_loss([s]),
            "imbalance": loadplots.fig_imbalance_time([s]), "dist": loadplots.fig_imbalance_dist([s]),
            "drops": loadplots.fig_drops([s]), "experts": loadplots.fig_experts([s]),
            "throughput": loadplots.fig_throughput([s])}
    for name, fig in figs.items():
        w, h = png_dims(loadplots.png_bytes(fig))
        assert 200 < w and 200 < h and w * h <= MAX_PIXELS, (name, w, h)
    img, groups = loadplots.step_bands(r.analysis)
    assert groups == 32 and img.shape == (61 * 33 - 1, 120)  # experts grouped by load rank, 32 rows per layer
    # the CLI's files too
    assert heatmap.main([str(run), "--text-only"]) == 0


# ---------------------------------------------------------------------------------------------------
# The report: self-contained, complete, its numbers from the raw records
# ---------------------------------------------------------------------------------------------------


EXTERNAL = re.compile(r"""(https?:|ftp:|//[a-z0-9])""", re.I)


def check_self_contained(page: str) -> list[bytes]:
    """No address outside the page; every src/href a data: URI or a fragment; returns the decoded images."""
    text = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "data:", page)  # base64 may hold "//"
    assert not EXTERNAL.search(text), EXTERNAL.search(text).group(0)
    for attr in re.findall(r"""\b(?:src|href|action|data)\s*=\s*["']([^"']*)["']""", page, re.I):
        assert attr.startswith("data:") or attr.startswith("#"), attr[:80]
    assert "<link" not in page.lower() and "@import" not in page and "url(" not in page
    scripts = re.findall(r"<script([^>]*)>", page)
    assert all('type="application/json"' in s for s in scripts)  # data only, no code
    images = []
    for b64 in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page):
        data = base64.b64decode(b64, validate=True)
        w, h = png_dims(data)
        assert w * h <= MAX_PIXELS
        # decodes: every IDAT chunk inflates to height rows of (1 + width * channels) bytes
        pos, idat = 8, b""
        while pos < len(data):
            n, kind = struct.unpack(">I4s", data[pos : pos + 8])
            if kind == b"IDAT":
                idat += data[pos + 8 : pos + 8 + n]
            pos += 12 + n
        channels = {2: 3, 6: 4}[data[25]]
        assert len(zlib.decompress(idat)) == h * (1 + w * channels)
        images.append(data)
    return images


def test_report_is_self_contained_complete_and_recomputable(tmp_path, capsys):
    a = synthetic_run(tmp_path / "topk", layers=3, experts=8, steps=60, tokens_per_step=32, top_k=2, seed=0)
    b = synthetic_run(tmp_path / "wide", layers=3, experts=32, steps=60, tokens_per_step=32, top_k=1, seed=1,
                      router="switch")
    out = tmp_path / "r.html"
    assert heatmap.main(["--compare", str(a), str(b), "--html", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert f"wrote {out}" in stdout and "imb_p95" in stdout
    page = out.read_text(encoding="utf-8")
    images = check_self_contained(page)
    for sid in report.SECTIONS:
        assert f'<section id="{sid}">' in page, sid
    assert len(images) >= 9
    data = report.read_report_data(str(out))
    for run_dir, entry in zip((a, b), data["runs"]):
        step, tokens, _, _ = raw_counts(records.load_rows(run_dir))
        imb = oracle_step_imbalance(tokens)
        for k, v in dist(imb).items():
            assert entry["summary"]["step_imbalance"][k] == pytest.approx(v, rel=1e-9)
        for i, layer in enumerate(entry["per_layer"]):
            for k, v in dist(imb[:, i]).items():
                assert layer["step_imbalance"][k] == pytest.approx(v, rel=1e-9)
        # the table row shows the same numbers
        row = next(line for line in stdout.splitlines() if line.startswith(run_dir.name + " "))
        assert float(row.split()[7]) == pytest.approx(dist(imb)["p95"], abs=0.006)


def test_report_from_old_jsonl_run_and_single_run_html(tmp_path, capsys):
    run = synthetic_run(tmp_path / "s", layers=2, experts=4, steps=20, tokens_per_step=16, top_k=1)
    rows = records.load_rows(run)
    (run / records.EXPERT_LOAD_BIN).unlink()
    (run / "expert_load.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "one.html"
    assert heatmap.main([str(run), "--html", str(out)]) == 0
    assert (run / "expert_load.png").exists() and (run / "expert_load_steps.png").exists()
    check_self_contained(out.read_text())


def test_report_to_an_unwritable_path_is_one_line_before_drawing(tmp_path, monkeypatch):
    """write_report (moekit-heatmap, moekit-sweep): a path that is a directory, under a file, or whose final rename
    fails is a UserError naming --html and that path, never its .partial, and leaves no .partial behind."""
    run = heatmap.read_run(str(synthetic_run(tmp_path / "s", layers=2, experts=4, steps=10, tokens_per_step=16,
                                             top_k=1)), (None, None))
    (tmp_path / "f").write_text("a file\n")
    (tmp_path / "d").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    with monkeypatch.context() as m:
        m.setattr(loadplots, "png_bytes", lambda *a, **k: pytest.fail("drew before checking the path"))
        with pytest.raises(records.UserError, match=re.escape(f"--html {tmp_path}/d: is a directory; give a file")):
            report.write_report([run], str(tmp_path / "d"))
        with pytest.raises(records.UserError, match=re.escape(f"--html {tmp_path}/f/r.html: {tmp_path}/f is a file, "
                                                              f"not a directory")):
            report.write_report([run], str(tmp_path / "f" / "r.html"))
    out = tmp_path / "r.html"
    real_replace = os.replace

    def replace(src, dst):  # the path became a directory while the figures were drawn
        if str(dst) == str(out):
            raise IsADirectoryError(21, "Is a directory", str(src), str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(records.UserError) as exc:
        report.write_report([run], str(out))
    assert str(exc.value) == f"--html {out}: cannot write it (Is a directory); choose another path"
    assert sorted(p.name for p in tmp_path.iterdir()) == before


# ---------------------------------------------------------------------------------------------------
# Loggers: TensorBoard and Weights & Biases, read back
# ---------------------------------------------------------------------------------------------------


def test_report_draws_the_downstream_tasks_only_when_a_run_scored_them(tmp_path, capsys):
    """--eval.tasks rows in metrics.jsonl: a "Downstream tasks" section whose figure holds each task's acc_norm
    points (read back from the plotted lines), none without them."""
    run = synthetic_run(tmp_path / "s", layers=2, experts=4, steps=20, tokens_per_step=16, top_k=1)
    plain = tmp_path / "plain.html"
    assert heatmap.main([str(run), "--html", str(plain)]) == 0
    assert '<section id="tasks">' not in plain.read_text()
    assert '<section id="gradients">' not in plain.read_text()  # no grad_norm_by_part in its metrics either
    rng = np.random.default_rng()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scored = {}
    for row in rows[4::5]:  # an evaluation every 5 steps
        scored[row["step"]] = rng.random(2)
        row["tasks"] = {name: {"acc": float(v), "acc_norm": float(v), "correct_nll": 2.0 - float(v), "chance": 0.25,
                               "items": 50} for name, v in zip(("@next-line", "arc"), scored[row["step"]])}
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "tasks.html"
    assert heatmap.main([str(run), "--html", str(out)]) == 0
    page = out.read_text()
    assert '<section id="tasks">' in page
    last = max(scored)
    assert f"{100 * scored[last][1]:.1f}% / {100 * scored[last][1]:.1f}%" in page  # arc's last acc_norm / acc
    other = synthetic_run(tmp_path / "t", layers=2, experts=4, steps=20, tokens_per_step=16, top_k=1)
    capsys.readouterr()
    assert heatmap.main(["--compare", str(run), str(other), "--html", str(tmp_path / "c.html")]) == 0  # the table
    table = [line.split() for line in capsys.readouterr().out.splitlines()]
    head = next(t for t in table if t[:2] == ["run", "router"])
    assert head[-4:] == ["@next-line", "acc_norm", "arc", "acc_norm"]
    assert next(t for t in table if t[:1] == ["s"])[-2:] == [f"{100 * v:.1f}%" for v in scored[last]]
    assert next(t for t in table if t[:1] == ["t"])[-2:] == ["-", "-"]
    data = report.read_report_data(str(out))
    assert data["runs"][0]["final_tasks"]["arc"]["step"] == last
    assert data["runs"][0]["final_tasks"]["@next-line"]["acc_norm"] == pytest.approx(scored[last][0])
    series = [loadplots.Series("s", None, rows, "")]
    assert loadplots.task_names(series) == ["@next-line", "arc"]
    fig = loadplots.fig_tasks(series)
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    steps = sorted(scored)
    for j, name in enumerate(("@next-line", "arc")):
        assert list(lines[name].get_xdata()) == steps
        assert list(lines[name].get_ydata()) == pytest.approx([100 * scored[s][j] for s in steps])
    assert list(lines["chance (arc)"].get_ydata()) == [25.0, 25.0]


def run_monitor(run_dir: Path, steps: int = 4, **kw):
    import torch

    from moekit.train.monitor import Monitor

    m = Monitor(str(run_dir), torch.device("cpu"), steps, 0, 100, True, "off", load_every=2, image_every=2, **kw)
    out = []
    for step in range(1, steps + 1):
        load = fake_load([[10 * step, 0, 5, 5], [5, 5, 5, 5 + step]], [[12 * step, 0, 5, 5], [5, 5, 5, 5 + step]],
                         {"load_balance": 1.0 + step / 10, "z_loss": 2.0 + step})
        row = {"step": step, "loss": 3.0 / step, "aux_loss": 0.01, "lr": 1e-3, "grad_norm": 1.0,
               "tokens_per_s": 100.0, "mem_gb": 0.1, "mfu": None, "imbalance": 1.5, "imbalance_max": 2.0,
               "dropped_fraction": 0.0}
        if step % 2 == 0:  # --eval.tasks scores at an evaluation
            row["tasks"] = {"mc": {"acc": step / 10, "acc_norm": step / 8, "correct_nll": 4.0 / step, "chance": 0.5,
                                   "items": 10}}
        out.append(m.step(row, load))
    m.close()
    return out


def test_tensorboard_per_layer_scalars_image_and_histograms_read_back(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = run_monitor(tmp_path)
    assert metrics[-1]["z_loss"] == pytest.approx(6.0) and metrics[-1]["dead_experts"] == 1
    ea = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "histograms": 0})
    ea.Reload()
    tags = ea.Tags()
    for key in ("loss", "balance_loss", "z_loss", "cv", "dead_experts"):
        assert key in tags["scalars"]
    assert [e.value for e in ea.Scalars("loss")] == pytest.approx([3.0, 1.5, 1.0, 0.75])
    for stat in ("imbalance", "cv", "dropped", "dead_experts", "saturated_experts", "balance_loss", "z_loss"):
        ev = ea.Scalars(f"{stat}/layers.0.ffn")
        assert [e.step for e in ev] == [2, 4]  # every load_every steps
    assert [e.value for e in ea.Scalars("imbalance/layers.0.ffn")] == pytest.approx([20 / 7.5, 40 / 12.5])
    assert [e.value for e in ea.Scalars("z_loss/layers.1.ffn")] == pytest.approx([4.0, 6.0])
    assert [e.value for e in ea.Scalars("dead_experts/layers.0.ffn")] == [1.0, 1.0]
    assert [e.value for e in ea.Scalars("saturated_experts/layers.0.ffn")] == [1.0, 1.0]
    assert tags["images"] == ["expert_load/share"] and [e.step for e in ea.Images("expert_load/share")] == [2, 4]
    img = ea.Images("expert_load/share")[0]
    assert img.width >= 128 and img.encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n"
    hist = ea.Histograms("expert_load/layers.1.ffn")
    assert [h.step for h in hist] == [2, 4] and hist[0].histogram_value.num == 4
    assert hist[0].histogram_value.sum == pytest.approx(4.0)  # relative loads sum to E
    assert [(e.step, e.value) for e in ea.Scalars("tasks/mc/acc_norm")] == [(2, 0.25), (4, 0.5)]
    assert [e.value for e in ea.Scalars("tasks/mc/correct_nll")] == pytest.approx([2.0, 1.0])


def wandb_records(run_dir: Path) -> list:
    """The history records of an offline W&B run file (LevelDB-style log of protobuf Records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, buf, out = path.read_bytes(), 7, b"", []
    block = 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if n == 0 and kind == 0:
            break
        buf += data[pos : pos + n]
        pos += n
        if kind in (1, 4):  # full or last fragment
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def test_wandb_offline_sink_reads_back(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run_monitor(tmp_path, wandb=True, wandb_project="moekit-test", config={"model": {"router": "topk"}})
    deadline = time.monotonic() + 60
    while True:  # wandb's service writes the run file in the background, after finish() returns
        recs = wandb_records(tmp_path)
        if any(r.WhichOneof("record_type") == "exit" for r in recs) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    history = {}
    for rec in recs:
        if rec.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            history[items["_step"]] = items
    assert sorted(history) == [1, 2, 3, 4]
    assert [history[s]["loss"] for s in (1, 2, 3, 4)] == pytest.approx([3.0, 1.5, 1.0, 0.75])
    assert history[4]["z_loss"] == pytest.approx(6.0) and history[4]["z_loss/layers.1.ffn"] == pytest.approx(6.0)
    assert "imbalance/layers.0.ffn" in history[2] and "imbalance/layers.0.ffn" not in history[1]
    assert history[2]["expert_load/share/_type"] == "image-file"
    assert history[4]["expert_load/layers.0.ffn/_type"] == "histogram"


def test_wandb_missing_package_is_a_one_line_error(tmp_path, monkeypatch):
    import builtins

    import torch

    from moekit.train.monitor import Monitor

    real = builtins.__import__

    def fake(name, *a, **k):
        if name == "wandb":
            raise ImportError("no wandb")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(records.UserError, match=r'pip install -e "\.\[wandb\]"'):
        Monitor(str(tmp_path), torch.device("cpu"), 1, 0, 1, False, "off", wandb=True)
    m = Monitor(str(tmp_path), torch.device("cpu"), 1, 0, 1, False, "off")
    assert "wandb off" in m.describe()
    m.close()


def test_console_throughput_covers_the_steps_since_the_last_line(tmp_path, capsys):
    """The console line's tokens_per_s and mfu are the steps' tokens over their summed time since the previous
    line (random step times, one slow step); metrics keep each step's own values."""
    import torch

    from moekit.train.monitor import Monitor

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    seconds = (torch.rand(9, generator=gen) + 0.1).tolist()
    seconds[4] = 7.5  # one slow step in the second window
    m = Monitor(str(tmp_path), torch.device("cpu"), 9, 0, 3, False, "off")
    per_step = 4096
    written = []
    for step, s in enumerate(seconds, 1):
        tps = per_step / s
        written.append(m.step({"step": step, "loss": 1.0, "aux_loss": 0.0, "lr": 1e-3, "grad_norm": 1.0,
                               "tokens_per_s": tps, "step_s": s, "mem_gb": 0.1, "mfu": tps * 1e-6}))
    m.close()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step=")]
    assert [ln.split()[0] for ln in lines] == ["step=3", "step=6", "step=9"]
    for i, line in enumerate(lines):
        want = 3 * per_step / sum(seconds[3 * i : 3 * i + 3])
        fields = dict(f.split("=") for f in line.split())
        assert fields["tokens_per_s"] == f"{want:.0f}" and fields["mfu"] == f"{100 * want * 1e-6:.1f}%", (line, want)
    assert [w["tokens_per_s"] for w in written] == [per_step / s for s in seconds]  # metrics: per step


def test_a_setting_missing_from_an_older_runs_config_counts_as_its_default():
    """A run of a moekit that predates a setting has no such key: it ran as the default does, so only a run that
    set another value differs."""
    from types import SimpleNamespace

    old = SimpleNamespace(config={"eval": {"every": 50}, "train": {"lr": 1e-3}})
    new = SimpleNamespace(config={"eval": {"every": 50, "task_fewshot": 0}, "train": {"lr": 1e-3}})
    assert heatmap.config_differences([old, new]) == []
    shot = SimpleNamespace(config={"eval": {"every": 50, "task_fewshot": 5}, "train": {"lr": 2e-3}})
    assert heatmap.config_differences([old, new, shot]) == ["eval.task_fewshot", "train.lr"]
