"""tools/bench/router_balance.py at tiny size: the JSON's structure, the peers, the per-sequence check it runs
before timing, and the bytes each balance loss keeps (a count, not a timing)."""
import json

import pytest

from moekit.bench import router_balance


def test_router_balance_bench_smoke(tmp_path, capsys):
    out = tmp_path / "rb.json"
    assert router_balance.main(["--tokens", "256", "--experts", "8", "--seq-len", "64", "--hidden", "32",
                                "--top-k", "2", "--repeats", "1", "--warmup", "0", "--out", str(out)]) == 0
    assert "time / batch" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["benchmark"] == "router_balance" and "partial" not in data
    rows = {r["peer"]: r for r in data["rows"]}
    assert set(rows) == set(router_balance.PEERS) and rows["batch"]["ratio"] == 1.0
    assert all(r["sequences"] == 4 and r["tokens"] == 256 for r in rows.values())
    assert rows["sequence"]["check_err"] < 1e-5
    # the sequence loss keeps the shares [B, E] and the lengths [B] (4 bytes each) where the batch loss keeps an
    # [E] operand; no balance loss keeps neither (logged outside autograd)
    kib = {name: r["saved_kib"] * 1024 for name, r in rows.items()}
    assert kib["sequence"] - kib["batch"] == 4 * (4 * 8 + 4) - 4 * 8
    assert kib["no balance loss"] < kib["batch"]


@pytest.mark.parametrize("args,match", [(["--top-k", "9", "--experts", "8"], "--top-k 9 exceeds --experts 8"),
                                        (["--tokens", "0"], "must all be >= 1"),
                                        (["--seq-len", "0"], "--seq-len")])
def test_router_balance_bench_refuses_bad_flags(args, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        router_balance.main(args)
    assert exit_info.value.code == 2 and match in capsys.readouterr().err

