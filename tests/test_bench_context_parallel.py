"""tools/bench/context_parallel.py at tiny size on real gloo ranks: the JSON's structure, the layout's math
(cp = 2 gives cp = 1's loss and gradients), and what context parallelism is for: a cp = 2 rank keeps less for
backward than the one process holding the whole sequence (a count of bytes, not a timing)."""
import json

import pytest

from moekit.bench import context_parallel
from tests.dist_utils import fork_bench_ranks

PRESETS = ["mixtral-tiny", "gpt-oss-tiny"]  # plain causal GQA; sinks with a window on every other layer


@pytest.fixture
def forked_ranks(monkeypatch):
    """The script's ranks forked from the session's fork server instead of spawned (tests.dist_utils.fork_bench_ranks)."""
    monkeypatch.setattr(context_parallel, "launch_ranks", fork_bench_ranks)


def test_context_parallel_bench_smoke(tmp_path, capsys, forked_ranks):
    out = tmp_path / "cp.json"
    assert context_parallel.main(["--presets", *PRESETS, "--seq", "128", "--cps", "1", "2", "--repeats", "1",
                                  "--warmup", "0", "--breakdown", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tok/rank" in printed and "kept by op" in printed
    data = json.loads(out.read_text())
    assert data["benchmark"] == "context_parallel" and "partial" not in data
    assert {"torch", "cpu_count", "device"} <= set(data["environment"])
    # the cases: S 128 at cp 1 and 2 (fixed S), S 64 at cp 1 (tokens/rank view's peer) per preset
    assert sorted((c["preset"], c["seq"], c["cp"]) for c in data["cases"]) == sorted(
        (p, s, cp) for p in PRESETS for s, cp in ((128, 1), (128, 2), (64, 1)))
    rows = {(r["view"], r["preset"], r["cp"]): r for r in data["results"]}
    assert set(rows) == {(v, p, cp) for v in ("fixed S", "tokens/rank") for p in PRESETS for cp in (1, 2)}
    for p in PRESETS:
        one, two = rows[("fixed S", p, 1)], rows[("fixed S", p, 2)]
        assert one["kept_ratio"] == 1 and one["gathered_mib"] == 0 and one["gather_ms"] is None
        assert two["tokens_per_rank"] == 64 and two["world"] == 2
        assert two["kept_mib"] < one["kept_mib"], (p, two["kept_mib"], one["kept_mib"])
        assert two["kept_ratio"] == pytest.approx(two["kept_mib"] / one["kept_mib"])
        # every layer gathers [B, K, S, 2D] fp32: 2 layers x 2 key heads x 128 positions x 2 x 32 x 4 bytes
        assert two["gathered_mib"] == pytest.approx(2 * 2 * 128 * 64 * 4 / 2**20)
        assert two["gather_ms"] > 0 and 0 < two["gather_share"] < 1 and two["step_ms"] > 0
        assert two["loss_diff"] < 1e-5 and two["grad_err"] < 1e-4, (p, two["loss_diff"], two["grad_err"])
        scaled = rows[("tokens/rank", p, 2)]  # the same case, against S 64 at cp 1
        assert scaled["seq"] == 128 and rows[("tokens/rank", p, 1)]["seq"] == 64
        assert scaled["kept_mib"] == two["kept_mib"] and scaled["kept_ratio"] != two["kept_ratio"]
        assert all(isinstance(label, str) and mib > 0 for label, mib in two["top_kept"])
        assert "gathered K/V" in dict(two["top_kept"]) or p == "gpt-oss-tiny"  # sinks keep padded copies


@pytest.mark.parametrize("argv, message", [
    (["--cps", "2", "4"], "start with 1"),
    (["--seq", "100", "--cps", "1", "4"], "multiple of 2 * max(--cps) = 8"),
    (["--presets", "nope"], "invalid choice"),
])
def test_context_parallel_bench_refuses(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        context_parallel.main([*argv, "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2 and message in capsys.readouterr().err
