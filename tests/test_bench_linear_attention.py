"""tools/bench/linear_attention.py at tiny size: the JSON's structure, the peers (transformers' layer with moekit's
weights, checked equal before timing), the memory each keeps (a count, not a timing), bad flags refused."""
import json

import pytest

from moekit.bench import linear_attention

TINY = ["--seq-len", "40", "--batch", "1", "--hidden", "32", "--key-heads", "1", "--value-heads", "2", "--head-dim",
        "8", "--chunk", "16", "--repeats", "1", "--warmup", "0"]


def test_linear_attention_bench_smoke(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "la.json"
    assert linear_attention.main([*TINY, "--out", str(out)]) == 0
    assert "time / transformers" in capsys.readouterr().out
    data = json.loads(out.read_text())
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


def test_gpu_suite_runs_the_opt_in_router_balance_and_linear_attention_steps(tmp_path):
    """gpu_suite.sh's opt-in router_balance and linear_attention steps, at their smoke sizes on the CPU (one suite
    call for both: the suite's start-up is most of the time)."""
    from moekit.bench import router_balance
    from tests.test_bench_gpu_suite import run_suite

    proc = run_suite(tmp_path, "--smoke", "router_balance", "linear_attention", timeout=240)
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0 and "router_balance: ok" in proc.stdout and "linear_attention: ok" in proc.stdout, out
    data = json.loads((tmp_path / "raw" / "router_balance.json").read_text())
    assert {r["peer"] for r in data["rows"]} == set(router_balance.PEERS)
    data = json.loads((tmp_path / "raw" / "linear_attention.json").read_text())
    assert {r["peer"] for r in data["rows"]} >= {"moekit", "transformers"}
