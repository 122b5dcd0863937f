"""The MoE layer benchmark runs end to end on tiny shapes and checks itself against transformers."""
import json
import sys
from pathlib import Path

import pytest
from moekit.bench import moe_layer


def test_moe_layer_benchmark_smoke(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "r.json"
    assert moe_layer.main(["--tokens", "64", "--hidden", "32", "--shapes", "32x4x2", "--repeats", "1",
                           "--warmup", "0", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    impls = {r["impl"] for r in data["results"]}
    assert {"moekit[loop]", "transformers[eager]"} <= impls
    assert any(i.startswith("moekit[auto->") for i in impls)
    # same weights, same routing: every implementation computes the same function
    assert all(r["max_abs_err"] < 1e-5 for r in data["results"])
    assert all(r["median_ms"] > 0 and r["moekit_speedup"] > 0 for r in data["results"])
    assert "time / moekit" in capsys.readouterr().out


def test_bad_shape_is_rejected():
    with pytest.raises(SystemExit, match="FxExk"):
        moe_layer.parse_shape("8x2")
