"""The MoE layer benchmark runs end to end on tiny shapes and checks itself against transformers."""
import json

import pytest
from moekit.bench import moe_layer


def test_moe_layer_benchmark_smoke(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "r.json"
    assert moe_layer.main(["--tokens", "16", "--hidden", "16", "--shapes", "16x4x2", "gpt-oss:16x4x2", "--repeats",
                           "1", "--warmup", "0", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    impls = {r["impl"] for r in data["results"]}
    assert {"moekit[loop]", "transformers[eager]"} <= impls
    oai = [r for r in data["results"] if r["gpt_oss"]]  # gpt-oss's block against GptOssMLP
    assert {"moekit[loop]", "transformers[eager]", "transformers[grouped_mm]"} <= {r["impl"] for r in oai}
    assert "titan-style" in data["cases"][1]["skipped"]  # SwiGLU only: not timed on other work
    assert any(i.startswith("moekit[auto->") for i in impls)
    # same weights, same routing: every implementation computes the same function
    assert all(r["max_abs_err"] < 1e-5 for r in data["results"])
    assert all(r["median_ms"] > 0 and r["moekit_speedup"] > 0 for r in data["results"])
    assert "time / moekit" in capsys.readouterr().out


def test_named_and_gpt_oss_shapes_parse():
    assert moe_layer.parse_entry("gpt-oss-20b") == (2880, 2880, 32, 4, True)
    assert moe_layer.parse_entry("gpt-oss:64x8x2", hidden=16) == (16, 64, 8, 2, True)
    assert moe_layer.parse_entry("8x4x2x1") == (8, 4, 2, 1, False)
    with pytest.raises(ValueError, match="'gpt-oss:8x2' is not FxExk"):
        moe_layer.parse_entry("gpt-oss:8x2")


def test_bad_shape_is_rejected(tmp_path, capsys):
    """parse_shape raises; main checks every --shapes entry before the first case runs: one line, exit 2."""
    with pytest.raises(ValueError, match="FxExk"):
        moe_layer.parse_shape("8x2")
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exc:
        moe_layer.main(["--tokens", "16", "--hidden", "16", "--shapes", "16x4x2", "8x2", "--out", str(out)])
    assert exc.value.code == 2 and not out.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--shapes entry '8x2' is not FxExk" in err[0], err
