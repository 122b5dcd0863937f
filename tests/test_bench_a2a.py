"""The EP dispatch benchmark runs on real gloo ranks and its byte counters agree with the cost model."""
import json

import pytest

from moekit.bench import all_to_all
from tests.dist_utils import fork_bench_ranks


@pytest.fixture
def forked_ranks(monkeypatch):
    """The script's ranks forked from the session's fork server instead of spawned (tests.dist_utils.fork_bench_ranks)."""
    monkeypatch.setattr(all_to_all, "launch_ranks", fork_bench_ranks)


def test_all_to_all_benchmark_smoke(tmp_path, forked_ranks):
    out = tmp_path / "a2a.json"
    assert all_to_all.main(["--world", "4", "--ranks-per-node", "2", "--hidden", "64", "--experts", "32",
                            "--tokens", "256", "--repeats", "1", "--dtype", "float32", "--out", str(out)]) == 0
    rows = {r["dispatcher"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"flat", "hierarchical"}
    for r in rows.values():  # uniform random routing: measured bytes/token near the expectation
        assert abs(r["inter_B_per_token"] - r["model_inter_B_per_token"]) <= 0.1 * r["model_inter_B_per_token"]
        assert abs(r["intra_B_per_token"] - r["model_intra_B_per_token"]) <= 0.1 * r["model_intra_B_per_token"]
    assert rows["hierarchical"]["inter_B_per_token"] < rows["flat"]["inter_B_per_token"]


def test_model_table_prints(capsys):
    assert all_to_all.main(["--model-table"]) == 0
    out = capsys.readouterr().out
    assert "flat/hier" in out and "128" in out
