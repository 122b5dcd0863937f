"""tools/bench/linear_attention.py at tiny size: the JSON's structure, the peers (transformers' layer with moekit's
weights, checked equal before timing), the memory each keeps (a count, not a timing), bad flags refused."""
import json

import pytest

from moekit.bench import linear_attention

TINY = ["--seq-len", "40", "--batch", "1", "--hidden", "32", "--key-heads", "1", "--value-heads", "2", "--head-dim",
        "8", "--chunk", "16", "--repeats", "1", "--warmup", "0"]


@pytest.fixture(scope="module")
def suite_run(tmp_path_factory):
    """gpu_suite.sh's opt-in router_balance and linear_attention steps at their smoke sizes on the CPU, once for the
    module (one suite call for both: the suite's start-up is most of the time). Its linear_attention step runs
    TINY (with --device cpu): the smoke test below reads that run's JSON and log."""
    from tests.test_bench_gpu_suite import run_suite

    tmp_path = tmp_path_factory.mktemp("la_suite")
    return tmp_path, run_suite(tmp_path, "--smoke", "router_balance", "linear_attention", timeout=240)


def test_linear_attention_bench_smoke(suite_run):
    pytest.importorskip("transformers")
    tmp_path, proc = suite_run
    assert proc.returncode == 0 and "linear_attention: ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (tmp_path / "raw" / "linear_attention.log").read_text()
    command = next(ln for ln in proc.stdout.splitlines() if ln.startswith("=== linear_attention ("))
    assert all(f" {flag} {value} " in command for flag, value in zip(TINY[::2], TINY[1::2])), command  # TINY's run
    assert "time / transformers" in log, log[-3000:]
    data = json.loads((tmp_path / "raw" / "linear_attention.json").read_text())
    assert data["benchmark"] == "linear_attention" and "partial" not in data
    rows = {r["peer"]: r for r in data["rows"]}
    assert set(rows) == {"moekit", "moekit chunk 2x", "moekit chunk 0.5x", "transformers"}
    assert rows["transformers"]["ratio"] == 1.0 and all(r["seq_len"] == 40 for r in rows.values())
    assert all(r["rel_err"] < 1e-4 for r in rows.values())  # every peer computed the same layer
    assert all(r["saved_mib"] > 0 for r in rows.values())


@pytest.mark.parametrize("args,match", [(["--key-heads", "3", "--value-heads", "4"], "--key-heads 3 must divide"),
                                        (["--seq-len", "0"], "must all be >= 1"), (["--chunk", "0"], "--chunk")])
def test_linear_attention_bench_refuses_bad_flags(args, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        linear_attention.main(args)
    assert exit_info.value.code == 2 and match in capsys.readouterr().err


def test_gpu_suite_runs_the_opt_in_router_balance_and_linear_attention_steps(suite_run):
    """gpu_suite.sh's opt-in router_balance and linear_attention steps, at their smoke sizes on the CPU (one suite
    call for both: the suite's start-up is most of the time)."""
    from moekit.bench import router_balance

    tmp_path, proc = suite_run
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0 and "router_balance: ok" in proc.stdout and "linear_attention: ok" in proc.stdout, out
    data = json.loads((tmp_path / "raw" / "router_balance.json").read_text())
    assert {r["peer"] for r in data["rows"]} == set(router_balance.PEERS)
    data = json.loads((tmp_path / "raw" / "linear_attention.json").read_text())
    assert {r["peer"] for r in data["rows"]} >= {"moekit", "transformers"}
