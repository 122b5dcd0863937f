"""tools/bench/peft_adapters.py at tiny size: its rows (export, import, PEFT's load when installed), the import's
logits the LoRA model's, bad flags one line."""
import importlib.util
import json

import pytest

from moekit.bench import peft_adapters

TINY = ["--hidden", "128", "--ffn", "32", "--experts", "4", "--layers", "1", "--rank", "2", "--dtype", "float32"]


def test_peft_adapters_bench_smoke(tmp_path, capsys):
    out = tmp_path / "pa.json"
    assert peft_adapters.main([*TINY, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {r["step"]: r for r in data["rows"]}
    assert {"export", "import"} <= set(rows) and all(r["seconds"] > 0 for r in rows.values())
    assert rows["import"]["rel_err"] < 1e-5
    if importlib.util.find_spec("peft") is None:
        return
    assert rows["peft"]["x_peft"] == 1.0 and "x peft" in capsys.readouterr().out


@pytest.mark.parametrize("flags, words", [(["--rank", "0"], ["--rank"]), (["--hidden", "100"], ["--hidden 100"])])
def test_peft_adapters_bench_refuses_bad_flags(capsys, flags, words):
    with pytest.raises(SystemExit) as exc:
        peft_adapters.main([*TINY, *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err
