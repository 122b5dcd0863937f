"""tools/bench/optimizer_step.py at tiny size: the JSON's structure, Muon's state half of AdamW's on the matrices,
its Newton-Schulz FLOP count against the formula, and the flags it refuses."""
import json

import pytest

from moekit.bench import optimizer_step


def test_optimizer_step_bench_smoke(tmp_path, capsys):
    out = tmp_path / "opt.json"
    assert optimizer_step.main(["--presets", "deepseek-tiny", "--repeats", "1", "--warmup", "0",
                                "--out", str(out)]) == 0
    assert "time / adamw" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["benchmark"] == "optimizer_step" and "partial" not in data
    rows = {r["peer"]: r for r in data["rows"]}
    assert set(rows) == {"adamw", "muon"} and rows["adamw"]["ratio"] == 1.0
    assert rows["muon"]["state_mib"] < 0.6 * rows["adamw"]["state_mib"]
    assert rows["muon"]["ns_gflop"] > 0 and rows["adamw"]["ns_gflop"] is None


def test_ns_flops_formula():
    import torch
    from torch import nn

    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(4, 6))  # one 4 x 6 matrix: 5 * (2*16*6 + 2*64 + 2*16*6)
    assert optimizer_step.ns_flops(model) == 5 * (2 * 16 * 6 + 2 * 64 + 2 * 16 * 6)


@pytest.mark.parametrize("args,match", [(["--presets", "gpt-9"], "unknown"), (["--dtype", "bfloat16"], "float32")])
def test_optimizer_step_bench_refuses_bad_flags(args, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        optimizer_step.main(args)
    assert exit_info.value.code == 2 and match in capsys.readouterr().err
