"""tools/bench/lm_loss.py --smoke on the CPU: the JSON's structure, the peers checked equal before timing, the fused
column "-" with its reason where the kernel cannot run (no GPU, no TRITON_INTERPRET) and timed where it can (the
interpreter), bad flags refused."""
import importlib
import json

import pytest
import torch

from moekit.bench import lm_loss

try:  # import triton now, while conftest's TRITON_INTERPRET=1 (no GPU) holds: the first import fixes its mode
    importlib.import_module("moekit.moe.kernels.cross_entropy")
except ImportError:  # no triton here: the fused column is "-" in both tests
    pass


def _smoke(tmp_path, *extra):
    out = tmp_path / "lm.json"
    assert lm_loss.main(["--smoke", "--dtype", "float32", "--out", str(out), *extra]) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "lm_loss" and "partial" not in data and data["environment"]["device"] == "cpu"
    rows = {r["peer"]: r for r in data["rows"]}
    assert set(rows) == set(lm_loss.PEERS)
    assert all((r["tokens"], r["hidden"], r["vocab"]) == (48, 16, 100) for r in rows.values())
    assert rows["plain"]["ratio"] == 1.0 and rows["chunked torch"]["ms"] > 0
    assert rows["chunked torch"]["rel_err"] < 1e-4 and rows["plain"]["rel_err"] == 0
    return data, rows


def test_lm_loss_bench_smoke_without_the_kernel(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    data, rows = _smoke(tmp_path)
    assert data["fused_available"] is False
    assert rows["fused"]["ms"] is None and "TRITON_INTERPRET" in rows["fused"]["error"]
    out = capsys.readouterr().out
    assert "time / plain" in out and "fused: not available" in out


def test_lm_loss_bench_smoke_with_the_kernel_in_the_interpreter(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if lm_loss.fused_unavailable(torch.device("cpu"), torch.float32):
        pytest.skip("triton runs compiled in this process (imported without TRITON_INTERPRET=1)")
    data, rows = _smoke(tmp_path)
    assert data["fused_available"] is True and rows["fused"]["error"] is None
    assert rows["fused"]["ms"] > 0 and rows["fused"]["rel_err"] < 1e-4


@pytest.mark.parametrize("args,match", [(["--tokens", "0"], "--tokens 0"), (["--chunk", "0"], "--chunk 0"),
                                        (["--vocab", "8", "0"], "--vocab 0")])
def test_lm_loss_bench_refuses_bad_flags(args, match, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        lm_loss.main([*args, "--out", str(tmp_path / "x.json")])
    assert exit_info.value.code == 2 and match in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
