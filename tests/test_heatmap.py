"""tools/heatmap.py on real short runs: figures, the summary's numbers, --compare, windows, errors."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
from moekit.train.loop import main as train_main
from moekit.train import heatmap
from moekit.train.records import ExpertLoadRecord


TINY = ("--model.hidden_size 32 --model.num_layers 2 --model.num_heads 2 --model.num_kv_heads 1 "
        "--model.ffn_hidden_size 64 --model.moe_ffn_hidden_size 32 --model.max_seq_len 32 --train.seq_len 32 "
        "--batch-size 4 --eval.sequences 8 --eval.every 3 --log.tensorboard false --checkpoint.every 0 "
        "--steps 6").split()
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name, flags in {"topk": [], "hash": ["--router", "hash"], "seed1": ["--seed", "1"]}.items():
        assert train_main([*TINY, *flags, "--run-dir", str(root / name)]) == 0
        out[name] = root / name
    return out


def raw_steps(run_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """(steps [N], kept tokens [N, L, E]) straight from the run's file: expert_load.jsonl, or expert_load.bin
    parsed here from its header's description (not with moekit.train.records)."""
    if (run_dir / "expert_load.jsonl").exists():
        lines = [json.loads(x) for x in (run_dir / "expert_load.jsonl").read_text().splitlines()[1:]]
        return np.array([x["step"] for x in lines]), np.array([x["tokens"] for x in lines], dtype=np.float64)
    raw = (run_dir / "expert_load.bin").read_bytes()
    end = raw.index(b"\n") + 1
    head = json.loads(raw[:end])
    L, E, d = len(head["layers"]), head["num_experts"], np.dtype(head["dtype"]).newbyteorder("<")
    rec = np.dtype([("step", "<i8"), ("tokens", d, (L, E)), ("assigned", d, (L, E)), ("dropped", d, (L,))])
    n = (len(raw) - end) // rec.itemsize
    rows = np.frombuffer(raw[end : end + n * rec.itemsize], dtype=rec)
    return rows["step"], rows["tokens"].astype(np.float64)


def expected_imbalance(run_dir: Path, first: int = 1, last: int = 10**9) -> list[float]:
    """The oracle: max/mean of summed kept tokens per layer (the window's imbalance)."""
    steps, tokens = raw_steps(run_dir)
    counts = tokens[(steps >= first) & (steps <= last)].sum(0)  # [L, E]
    return list(counts.max(1) / counts.mean(1))


def expected_step_imbalance(run_dir: Path, first: int = 1, last: int = 10**9) -> np.ndarray:
    """The oracle: [N, L] max/mean of each step's kept tokens per layer."""
    steps, tokens = raw_steps(run_dir)
    t = tokens[(steps >= first) & (steps <= last)]
    return t.max(2) / t.mean(2)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_single_run_figures_and_summary(runs, capsys):
    run = runs["topk"]
    assert heatmap.main([str(run)]) == 0
    out = capsys.readouterr().out
    for name in ("expert_load.png", "expert_load_steps.png"):
        w, h = png_size(run / name)
        assert w > 300 and h > 200
    assert "router topk (top_k 2), 2 MoE layers x 8 experts, steps 1-6" in out
    per_step = expected_step_imbalance(run)
    for i, (layer, imb) in enumerate(zip(("layers.0.ffn", "layers.1.ffn"), expected_imbalance(run))):
        row = next(line for line in out.splitlines() if line.startswith(layer)).split()
        assert float(row[1]) == pytest.approx(per_step[:, i].mean(), abs=0.006)  # per-step mean
        assert float(row[3]) == pytest.approx(np.percentile(per_step[:, i], 95), abs=0.006)
        assert float(row[4]) == pytest.approx(per_step[:, i].max(), abs=0.006)
        assert float(row[5]) == pytest.approx(imb, abs=0.006)  # the window's summed counts


def test_step_window(runs, capsys):
    run = runs["topk"]
    out_png = run / "window.png"
    assert heatmap.main([str(run), "--steps", "4:", "--out", str(out_png)]) == 0
    out = capsys.readouterr().out
    assert "steps 4-6" in out and out_png.exists() and (run / "window_steps.png").exists()
    row = next(line for line in out.splitlines() if line.startswith("layers.0.ffn"))
    assert float(row.split()[1]) == pytest.approx(expected_step_imbalance(run, 4)[:, 0].mean(), abs=0.006)
    assert float(row.split()[5]) == pytest.approx(expected_imbalance(run, 4)[0], abs=0.006)


def test_compare_two_routers(runs, tmp_path, capsys):
    out_png = tmp_path / "cmp.png"
    assert heatmap.main(["--compare", str(runs["topk"]), str(runs["hash"]), "--out", str(out_png)]) == 0
    out = capsys.readouterr().out
    w, h = png_size(out_png)
    assert w > 2 * 300  # side by side
    table = out[out.index("run  "):].splitlines()
    assert table[1].split()[:2] == ["topk", "topk"] and table[2].split()[:2] == ["hash", "hash"]
    final_loss = [json.loads(x) for x in (runs["hash"] / "metrics.jsonl").read_text().splitlines()][-1]["loss"]
    assert float(table[2].split()[3]) == pytest.approx(final_loss, abs=1e-4)
    # per-step imbalance, not the window's: mean, p50, p95, max over (step, layer)
    per_step = expected_step_imbalance(runs["hash"])
    assert [float(x) for x in table[2].split()[5:9]] == pytest.approx(
        [per_step.mean(), np.percentile(per_step, 50), np.percentile(per_step, 95), per_step.max()], abs=0.006)
    assert "note:" not in out  # same data, seed and model: only the router differs
    html = tmp_path / "cmp.html"  # the report, by default beside --out
    assert f"wrote {html}" in out and html.read_text().startswith("<!DOCTYPE html>")


def test_compare_notes_unfair_differences(runs, capsys):
    assert heatmap.main(["--compare", str(runs["topk"]), str(runs["seed1"]), "--text-only"]) == 0
    assert "note: the runs also differ in train.seed" in capsys.readouterr().out


def test_layer_stats_oracle():
    tokens = np.array([[[30, 10, 0, 0]], [[10, 10, 0, 20]]])  # 2 steps, 1 layer, 4 experts
    assigned = tokens + np.array([[[5, 0, 0, 0]], [[0, 0, 0, 0]]])
    rec = ExpertLoadRecord("topk", 1, ["l0"], np.array([1, 2]), tokens, assigned, np.array([[5], [0]]))
    (s,) = heatmap.layer_stats(rec)
    c = np.array([40.0, 20, 0, 20])
    assert s.imbalance == pytest.approx(2.0) and s.cv == pytest.approx(c.std() / c.mean())
    assert s.dropped == pytest.approx(5 / 85) and np.allclose(s.share, c / 80)
    # per step: 30/10 = 3.0 and 20/10 = 2.0 (the summed window above says 2.0)
    assert s.step_imbalance == pytest.approx({"mean": 2.5, "p50": 2.5, "p95": 2.95, "max": 3.0})
    assert s.dead_fraction == pytest.approx((2 + 1) / 2 / 4)


@pytest.mark.parametrize("argv,expected", [
    (["--steps", "5:2"], "FIRST <= LAST"),
    (["--steps", "x"], "expected FIRST:LAST"),
    (["--steps", "50:60"], "no expert-load records in steps 50..60"),
])
def test_bad_windows(runs, capsys, argv, expected):
    assert heatmap.main([str(runs["topk"]), *argv, "--text-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0]


def test_not_a_run_dir_and_bad_usage(tmp_path, capsys):
    assert heatmap.main([str(tmp_path), "--text-only"]) == 2
    assert "expert_load.bin: not found (nor expert_load.jsonl)" in capsys.readouterr().err
    assert heatmap.main(["--compare", str(tmp_path)]) == 2
    assert "at least two" in capsys.readouterr().err
    assert heatmap.main([]) == 2


def test_without_matplotlib_says_how_to_install(runs, tmp_path):
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    env = {**os.environ, "PYTHONPATH": str(fake.parent), "OMP_NUM_THREADS": "1"}
    script = str(ROOT / "tools" / "heatmap.py")
    proc = subprocess.run([sys.executable, script, str(runs["topk"])], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert 'pip install -e ".[viz]"' in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    text = subprocess.run([sys.executable, script, str(runs["topk"]), "--text-only"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert text.returncode == 0 and "layers.0.ffn" in text.stdout
