"""moekit-sweep: a 3-router sweep at tiny size (subprocesses of moekit-train) writes one complete,
self-contained HTML report whose per-step imbalance equals a recomputation from the raw records; a failed
variant is reported and the sweep goes on."""
from __future__ import annotations

import json
import shlex

import numpy as np
import pytest

from moekit.train import report, sweep
from tests.test_heatmap import expected_step_imbalance
from tests.test_report import check_self_contained
from tests.tiny import TINY_MODEL

BASE = shlex.join([*TINY_MODEL, "--steps", "4", "--eval.every", "2", "--checkpoint.every", "4"])


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    sweep_file = root / "sweep.toml"
    sweep_file.write_text(f'base = {json.dumps(BASE)}\n[variants]\ntopk = "--router topk"\n'
                          f'switch = ["--router", "switch", "--capacity-factor", "1.0"]\n')
    # broken: its flags pass moekit-train's checks, but its run directory is locked (below), so the run fails;
    # typo: refused by those checks before anything trains
    argv = ["--config", str(sweep_file), "--runs-dir", str(root / "runs"), "--variant", "hash=--router hash",
            "--variant", "broken=--router topk", "--variant", "typo=--router no_such_router", "--specialisation",
            "--quiet"]
    return root, argv


@pytest.fixture(scope="module")
def result(swept):
    import contextlib
    import io

    from moekit.train import specialisation
    from moekit.train.runlock import RunLock

    root, argv = swept
    out = io.StringIO()
    tokens, specialisation.DEFAULT_TOKENS = specialisation.DEFAULT_TOKENS, 2048  # a small sample: seconds
    lock = RunLock.acquire(root / "runs" / "broken")  # a trainer holds it: the variant's run is refused
    try:
        with contextlib.redirect_stdout(out):
            code = sweep.main(argv)
    finally:
        specialisation.DEFAULT_TOKENS = tokens
        lock.release()
    return root, code, out.getvalue()


def test_sweep_trains_every_variant_and_continues_past_a_failure(result):
    root, code, out = result
    assert code == 1  # two variants failed; the report covers the others
    for i, name in enumerate(("topk", "switch", "hash", "broken", "typo"), 1):
        assert f"[sweep {i}/5] {name}: " in out
    assert "[sweep 4/5] broken: FAILED (exit status 2)" in out and "in use by another trainer" in out
    assert ("[sweep 5/5] typo: FAILED before starting: moekit-train: error:" in out
            and "unknown router 'no_such_router'" in out)
    summary = json.loads((root / "runs" / "sweep.json").read_text())
    assert [(v["name"], v["status"]) for v in summary["variants"]] == [
        ("topk", "ok"), ("switch", "ok"), ("hash", "ok"), ("broken", "failed"), ("typo", "failed")]
    assert not (root / "runs" / "typo").exists()
    assert summary["variants"][1]["command"][-7:] == ["--router", "switch", "--capacity-factor", "1.0", "--run-dir",
                                                      str(root / "runs" / "switch"), "--overwrite"]
    table = out[out.index("run     "):].splitlines()
    assert [row.split()[:2] for row in table[1:4]] == [["topk", "topk"], ["switch", "switch"], ["hash", "hash"]]
    assert "note:" not in out  # the same model, data and seed: only the routers differ
    assert f"wrote {root / 'runs' / 'report.html'}" in out


def test_sweep_report_is_complete_self_contained_and_recomputable(result):
    root, _, _ = result
    html = root / "runs" / "report.html"
    page = html.read_text(encoding="utf-8")
    images = check_self_contained(page)
    for sid in (*report.SECTIONS, "specialisation"):
        assert f'<section id="{sid}">' in page, sid
    assert len(images) >= 10 and "failed: broken: exit status 2" in page
    data = report.read_report_data(str(html))
    assert [r["name"] for r in data["runs"]] == ["topk", "switch", "hash"]
    assert [f["name"] for f in data["failed"]] == ["broken", "typo"]
    for entry in data["runs"]:
        run_dir = root / "runs" / entry["name"]
        imb = expected_step_imbalance(run_dir)  # [steps, layers] from the raw records
        assert imb.shape == (4, 2)
        got = entry["summary"]["step_imbalance"]
        assert [got["mean"], got["p50"], got["p95"], got["max"]] == pytest.approx(
            [imb.mean(), np.percentile(imb, 50), np.percentile(imb, 95), imb.max()], rel=1e-9)
        for i, layer in enumerate(entry["per_layer"]):
            assert layer["step_imbalance"]["max"] == pytest.approx(imb[:, i].max(), rel=1e-9)
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert entry["final_loss"] == pytest.approx(metrics[-1]["loss"])
    # specialisation: the hash router sends every occurrence of a token id to the same experts
    spec = json.loads((root / "runs" / "hash" / "specialisation.json").read_text())
    assert spec["layers"][0]["token_concentration"] == pytest.approx(1.0)
    topk = json.loads((root / "runs" / "topk" / "specialisation.json").read_text())
    assert topk["layers"][0]["token_concentration"] < 1.0
    assert "top tokens per expert" in page


def test_skip_done_and_dry_run(swept, result, capsys):
    root, argv = swept
    assert sweep.main([*argv, "--skip-done", "--dry-run"]) == 2  # typo is refused; every command is still printed
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5 and lines[0].startswith("python -m moekit.train ") and "--run-dir" in lines[0]
    assert sweep.finished(sweep.plan(sweep.build_parser().parse_args(argv))[1][0])  # topk: done, same command
    assert sweep.main(["--runs-dir", "x", "--variant", "a=--steps 2", "--nproc", "2", "--dry-run"]) == 0
    assert "-m torch.distributed.run --standalone --nproc-per-node 2 -m moekit.train --steps 2" in \
        capsys.readouterr().out


@pytest.mark.parametrize("argv,expected", [
    ([], "no variants"),
    (["--variant", "topk"], 'expected NAME="FLAGS"'),
    (["--variant", "a b=--router topk"], "run-directory names"),
    (["--variant", "a=--router topk", "--variant", "a=--router hash"], "names must differ"),
    (["--variant", "a=--run-dir x"], "--run-dir is set by the sweep"),
    (["--base=--log.run_dir=y", "--variant", "a=--steps 1"], "--log.run_dir is set by the sweep"),
    (["--variant", "a=--steps 1", "--nproc", "0"], "positive integer"),
    (["--config", "/nonexistent.toml", "--variant", "a="], "file not found"),
    (["--variant", "a=--router topk", "--variant", "b=--train.lr -1"], "variant b: moekit-train: error: --train.lr=-1"),
    (["--variant", "a=--help-config"], "--help-config is set by the sweep"),
    (["--base", "--steps", "--variant", "a="], "expected one argument; a value that starts with '-' goes after '='"),
])
def test_bad_sweeps_are_one_line_errors(argv, expected, capsys):
    assert sweep.main([*argv, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


def test_eval_specialisation_table_and_json(result, tmp_path, capsys):
    """moekit-eval --specialisation on a sweep's checkpoint: the table on stdout, the numbers in --out's JSON."""
    from moekit.train import evaluate

    root, _, _ = result
    out = tmp_path / "eval.json"
    assert evaluate.main([str(root / "runs" / "topk"), "--specialisation", "--max-tokens", "512", "--out",
                          str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "expert specialisation: 512 tokens, 2 MoE layers" in stdout and "top tokens: count (specificity)" in stdout
    spec = json.loads(out.read_text())["specialisation"]
    assert spec["position_buckets"] == ["0", "1", "2-3", "4-7", "8-15", "16-31"]
    for layer in spec["layers"]:
        slots = np.asarray(layer["position_slots"])  # dropless top-2: every token's 2 slots, once each
        assert slots.sum() == 512 * 2 and slots[0].sum() == 512 // 32 * 2
        assert sum(layer["expert_share"]) == pytest.approx(1.0)
        for e in layer["experts"]:
            assert all(0 < t["specificity"] <= 1 for t in e["top_tokens"])


@pytest.mark.parametrize("line,expected", [
    ("runs_dir = 5", "runs_dir = 5: expected a string"),
    ("html = 5", "html = 5: expected a string"),
    ('specialisation = "no"', "specialisation = 'no': expected true or false"),
    ("nproc = true", "nproc = True: expected an integer"),
])
def test_sweep_file_values_of_the_wrong_type_are_refused(tmp_path, line, expected, capsys):
    """A sweep file's values are checked by type before anything runs (a string "no" is not false)."""
    path = tmp_path / "s.toml"
    path.write_text(f'{line}\n[variants]\ntopk = "--router topk"\n')
    assert sweep.main(["--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


def test_an_unwritable_report_is_refused_before_training(tmp_path, capsys):
    """--html naming a directory or a path under a file fails in one line before any variant trains."""
    (tmp_path / "file").write_text("x")
    for html in (tmp_path, tmp_path / "file" / "r.html"):
        assert sweep.main(["--runs-dir", str(tmp_path / "runs"), "--variant", "a=--steps 1", "--html", str(html)]) == 2
        out, err = capsys.readouterr()
        assert "--html" in err and len(err.strip().splitlines()) == 1 and "[sweep" not in out, (out, err)
    assert not (tmp_path / "runs" / "a").exists()
