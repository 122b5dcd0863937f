"""tools/heatmap.py on real short runs: figures, the summary's numbers, --compare, windows, errors."""
from __future__ import annotations

import builtins
import errno
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
from moekit.train.loop import main as train_main
from moekit.train import heatmap
from moekit.train.records import ExpertLoadRecord
from tests.helpers import one_stderr_line


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
    (["--steps=-5:3"], "--steps '-5:3': steps are >= 0"),
    (["--steps", ":-1"], "--steps ':-1': steps are >= 0"),
    (["--steps", "3"], "--steps '3': the colon is missing; give FIRST:LAST, e.g. 3:3 for step 3 alone"),
])
def test_bad_windows(runs, capsys, argv, expected):
    assert heatmap.main([str(runs["topk"]), *argv, "--text-only"]) == 2
    one_stderr_line(capsys, expected)


def test_not_a_run_dir_and_bad_usage(tmp_path, capsys):
    assert heatmap.main([str(tmp_path), "--text-only"]) == 2
    assert "expert_load.bin: not found (nor expert_load.jsonl)" in capsys.readouterr().err
    assert heatmap.main([str(tmp_path / "nonexist"), "--text-only"]) == 2
    one_stderr_line(capsys, "nonexist: no such directory; give a moekit-train run directory")
    (tmp_path / "tiny.txt").write_text("hi\n")
    assert heatmap.main([str(tmp_path / "tiny.txt")]) == 2
    one_stderr_line(capsys, "tiny.txt: is a file, not a run directory")
    assert heatmap.main(["--compare", str(tmp_path)]) == 2
    assert "at least two" in capsys.readouterr().err
    assert heatmap.main([]) == 2


@pytest.fixture
def read_only(monkeypatch):
    """read_only(folder): creating or writing a file under ``folder`` fails as on a read-only filesystem (EROFS);
    the tests may run as root, whom chmod does not stop."""
    folders = []
    real_open, real_os_open = builtins.open, os.open

    def under(path) -> bool:
        if not isinstance(path, (str, os.PathLike)):
            return False  # a file descriptor
        p = os.path.abspath(os.fspath(path))
        return any(p == f or p.startswith(f + os.sep) for f in folders)

    def refuse(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))

    def fake_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and under(file):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def fake_os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and under(path):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)  # pathlib's write_text
    monkeypatch.setattr(os, "open", fake_os_open)
    return lambda folder: folders.append(os.path.abspath(folder))


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("argv,words", [
    ("{RUN} --out {DIR}", "--out {DIR}: is a directory; give a file path, e.g. {DIR}/expert_load.png"),
    ("{RUN} --out {FILE}/x.png", "--out {FILE}/x.png: {FILE} is a file, not a directory; choose another path"),
    ("{RUN} --out {RO}/x.png", "--out {RO}/x.png: cannot write in {RO} (Read-only file system); choose another"),
    ("{RUN} --out {RO}/sub/x.png", "--out {RO}/sub/x.png: cannot write in {RO} (Read-only file system)"),
    ("{RUN}", "{RUN}/expert_load.png: cannot write in {RUN} (Read-only file system); give --out elsewhere, or "
              "--text-only"),
    ("{RUN} --out {x} --html {DIR}", "--html {DIR}: is a directory; give a file path, e.g. {DIR}/report.html"),
    ("--compare {RUN} {RUN2} --out {DIR}", "--out {DIR}: is a directory"),
    ("--compare {RUN} {RUN2} --out {RO}/c.png", "--out {RO}/c.png: cannot write in {RO} (Read-only file system)"),
    ("--compare {RUN} {RUN2} --html {FILE}/c.html", "--html {FILE}/c.html: {FILE} is a file, not a directory"),
    ("--compare {RUN} {RUN2} --html {DIR}", "--html {DIR}: is a directory"),
    ("--compare {RUN} {RUN2} --html {RO}/c.html", "--html {RO}/c.html: cannot write in {RO} (Read-only file "
                                                  "system)"),
])
def test_unwritable_outputs_are_one_line_before_any_work(runs, tmp_path, monkeypatch, read_only, capsys, argv,
                                                        words):
    """--out, --html and the default figures in a read-only run directory: checked before the runs are read,
    one line naming the flag and the path (never a .partial), nothing left behind."""
    ro_run = tmp_path / "ro_run"
    shutil.copytree(runs["topk"], ro_run)
    for name in ("DIR", "RO"):
        (tmp_path / name).mkdir()
    (tmp_path / "FILE").write_text("a file\n")
    read_only(tmp_path / "RO")
    read_only(ro_run)
    paths = {"RUN": ro_run, "RUN2": runs["hash"], "DIR": tmp_path / "DIR", "FILE": tmp_path / "FILE",
             "RO": tmp_path / "RO", "x": tmp_path / "x.png"}
    before = tree(tmp_path)
    monkeypatch.setattr(heatmap, "read_run", lambda *a: pytest.fail("read a run before checking the outputs"))
    assert heatmap.main(argv.format(**paths).split()) == 2
    line = one_stderr_line(capsys, words.format(**paths))
    assert ".partial" not in line and ".write-probe" not in line
    assert tree(tmp_path) == before


def test_report_write_failure_leaves_no_partial(runs, tmp_path, monkeypatch, capsys):
    """A report whose final rename fails (its path became a directory meanwhile): one line naming --html and the
    path, and no REPORT.partial left."""
    out = tmp_path / "c.html"
    real_replace = os.replace

    def replace(src, dst):
        if str(dst) == str(out):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(src), str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    assert heatmap.main(["--compare", str(runs["topk"]), str(runs["hash"]), "--html", str(out)]) == 2
    line = one_stderr_line(capsys, f"--html {out}: cannot write it (Is a directory)")
    assert ".partial" not in line and tree(tmp_path) == []


def fake_specialisation(run_dir: str) -> dict:
    return {"format": "moekit-specialisation", "version": 1, "tokens": 64, "position_buckets": ["0", "1"],
            "layers": [{"name": "layers.0.ffn", "position_share": [[0.5, 0.5], [0.25, 0.75]],
                        "token_concentration": 0.5,
                        "experts": [{"expert": 0, "share": 0.5, "top_tokens": [
                            {"id": 7, "text": "a", "count": 3, "specificity": 1.0}]}]}]}


def test_specialisation_cache_in_a_read_only_run_is_a_note(runs, tmp_path, monkeypatch, read_only, capsys):
    """--specialisation where one run directory cannot take specialisation.json: a note, the specialisation
    computed without its cache, and the report written."""
    from moekit.train import evaluate

    a, b = tmp_path / "ro_topk", tmp_path / "hash"
    shutil.copytree(runs["topk"], a)
    shutil.copytree(runs["hash"], b)
    monkeypatch.setattr(evaluate, "run", lambda args: {"specialisation": fake_specialisation(args.path),
                                                       "checkpoint": f"{args.path}/checkpoints/step_6",
                                                       "step": 6})
    read_only(a)
    out = tmp_path / "c.html"
    assert heatmap.main(["--compare", str(a), str(b), "--specialisation", "--html", str(out)]) == 0
    one_stderr_line(capsys, "note:", f"{a}/specialisation.json: cannot write in {a} (Read-only file system)",
              "without caching")
    assert not (a / "specialisation.json").exists() and (b / "specialisation.json").exists()
    page = out.read_text()
    assert '<section id="specialisation">' in page and "<h3>ro_topk</h3>" in page and "<h3>hash</h3>" in page


def test_corrupt_run_config_is_one_line(runs, tmp_path, capsys):
    from moekit.train import placement

    bad = tmp_path / "hm2"
    shutil.copytree(runs["topk"], bad)
    (bad / "config.json").write_text("garbage{\n")
    want = [f"{bad}/config.json: corrupt config.json (JSONDecodeError", "restore it"]
    assert heatmap.main([str(bad), "--text-only"]) == 2
    one_stderr_line(capsys, *want)
    assert heatmap.main(["--compare", str(runs["topk"]), str(bad), "--text-only"]) == 2
    one_stderr_line(capsys, *want)
    assert placement.main([str(bad), "--ep", "2", "-o", str(tmp_path / "p.json")]) == 2
    one_stderr_line(capsys, *want)
    (bad / "config.json").write_text("[1, 2]\n")
    assert heatmap.main([str(bad), "--text-only"]) == 2
    one_stderr_line(capsys, "config.json: corrupt config.json (a JSON list, not an object); restore it")


@pytest.mark.parametrize("argv,words", [
    ("{RUN} --text-only --out {x}.png", "--text-only draws nothing, so it cannot take --out; drop one of them"),
    ("{RUN} --text-only --html {x}.html --specialisation", "--text-only draws nothing, so it cannot take --html "
                                                           "or --specialisation"),
    ("--compare {RUN} {RUN2} --text-only --html {x}.html", "--text-only draws nothing, so it cannot take --html"),
    ("{RUN} --specialisation", "--specialisation adds a section to the HTML report, which one run writes only "
                               "with --html REPORT.html; give --html too"),
    ("{RUN} --out {x}.txt", "--out {x}.txt: cannot draw a .txt file; give a path ending in .png, .jpg, .jpeg, "
                            ".pdf or .svg"),
    ("{RUN} --out {x}", "--out {x}: cannot draw a file without a suffix"),
    ("--compare {RUN} {RUN}", "--compare {RUN}: given twice; compare different run directories"),
    ("--compare {RUN} {RUN2} {RUN}/", "--compare {RUN}/: the same run as {RUN}"),
])
def test_inputs_that_would_be_ignored_or_misread_are_refused(runs, tmp_path, capsys, argv, words):
    paths = {"RUN": runs["topk"], "RUN2": runs["hash"], "x": tmp_path / "x"}
    before = tree(runs["topk"])
    assert heatmap.main(argv.format(**paths).split()) == 2
    one_stderr_line(capsys, words.format(**paths))
    assert tree(tmp_path) == [] and tree(runs["topk"]) == before


def test_figures_in_the_format_the_suffix_names(runs, tmp_path, capsys):
    out = tmp_path / "load.jpg"
    assert heatmap.main([str(runs["topk"]), "--out", str(out)]) == 0
    assert f"wrote {out} and {tmp_path / 'load_steps.jpg'}" in capsys.readouterr().out
    assert tree(tmp_path) == ["load.jpg", "load_steps.jpg"]
    for name in tree(tmp_path):
        assert (tmp_path / name).read_bytes()[:3] == b"\xff\xd8\xff"  # JPEG
    assert heatmap.main(["--compare", str(runs["topk"]), str(runs["hash"]), "--out", str(tmp_path / "c.svg")]) == 0
    assert (tmp_path / "c.svg").read_text().lstrip().startswith("<?xml") and (tmp_path / "c.html").exists()


def test_partial_last_record_is_a_note(runs, tmp_path, capsys):
    run = tmp_path / "cut"
    shutil.copytree(runs["topk"], run)
    with open(run / "expert_load.bin", "ab") as f:  # a crash mid-write
        f.write(b"\x01" * 17)
    assert heatmap.main([str(run), "--text-only"]) == 0
    one_stderr_line(capsys, f"note: {run}/expert_load.bin ends in a partial record (17 bytes); read 6 whole records")
    assert heatmap.main([str(runs["topk"]), "--text-only"]) == 0
    assert capsys.readouterr().err == ""


def test_compare_with_a_run_without_config_says_so(runs, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(runs["seed1"], bare)
    (bare / "config.json").unlink()
    assert heatmap.main(["--compare", str(runs["topk"]), str(bare), "--text-only"]) == 0
    out = capsys.readouterr().out
    assert f"note: {bare} has no config.json, so the runs' settings are not compared" in out
    assert "differ in" not in out


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
