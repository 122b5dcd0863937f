"""tools/bench/lora_dropout.py at tiny size: its rows (moekit, p=0, PEFT's LoRA Linear when installed; the experts),
what each keeps for backward, bad flags one line."""
import importlib.util
import json

import pytest

from moekit.bench import lora_dropout

TINY = ["--tokens", "64", "--hidden", "32", "--out-features", "48", "--ffn", "16", "--experts", "4", "--top-k", "2",
        "--rank", "4", "--warmup", "0", "--repeats", "1", "--device", "cpu"]


def test_lora_dropout_bench_smoke(tmp_path, capsys):
    out = tmp_path / "ld.json"
    assert lora_dropout.main([*TINY, "--out", str(out)]) == 0
    rows = {(r["part"], r["peer"]): r for r in json.loads(out.read_text())["rows"]}
    assert {("linear", "moekit"), ("linear", "p=0"), ("experts", "moekit"), ("experts", "p=0")} <= set(rows)
    assert all(r["ms"] > 0 for r in rows.values())
    # the dropped linear adapter keeps one bool mask more than without dropout: [64, 32] bytes
    assert (rows[("linear", "moekit")]["kept_mib"] - rows[("linear", "p=0")]["kept_mib"]) * 2 ** 20 == 64 * 32
    assert rows[("experts", "moekit")]["kept_mib"] > rows[("experts", "p=0")]["kept_mib"]
    if importlib.util.find_spec("peft") is not None:  # PEFT keeps a dropped copy of the input (and its mask)
        assert rows[("linear", "peft")]["kept_mib"] > rows[("linear", "moekit")]["kept_mib"]
        assert rows[("linear", "peft")]["x_peer"] == 1.0 and "x peer" in capsys.readouterr().out


@pytest.mark.parametrize("flags, words", [(["--p", "1"], ["--p 1"]), (["--rank", "0"], ["--rank"])])
def test_lora_dropout_bench_refuses_bad_flags(capsys, flags, words):
    with pytest.raises(SystemExit) as exc:
        lora_dropout.main([*TINY, *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err
