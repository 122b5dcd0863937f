"""README's "Real tokens" example, end to end, exactly as written there, at tiny size.

The commands are read from the README block after the ``<!-- real-data-example -->`` marker and run as
the installed console scripts' entry points (the functions ``pip install`` wires the commands to, called in
this process: each command as a fresh interpreter would spend most of its time importing torch) in a fresh
directory: prepare the embedded corpus with a BPE tokenizer trained locally, train, generate, evaluate (the
held-out loss, then a multiple-choice task). Only moekit-train gets the tiny-model flags appended (fewer steps,
and a micro-batch of 32 windows, which the evaluations then score in batches of); the other commands run
unchanged.
"""
from __future__ import annotations

import json
import math
import shlex
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tests.tiny import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- real-data-example -->"


def readme_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert MARKER in text, "README.md lost its real-data example"
    block = text.split(MARKER, 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [shlex.split(line) for line in block.strip().splitlines() if line.strip()]


def test_readme_real_data_example_runs(tmp_path, monkeypatch, capsys):
    bindir = Path(sys.executable).parent
    commands = readme_commands()
    assert [c[0] for c in commands] == ["moekit-prepare", "moekit-train", "moekit-generate", "moekit-eval",
                                        "moekit-eval"]
    monkeypatch.chdir(tmp_path)
    out = {}
    for cmd in commands:
        if not (bindir / cmd[0]).exists():
            pytest.skip(f"{cmd[0]} is not installed next to {sys.executable} (moekit not pip-installed)")
        (script,) = entry_points(group="console_scripts", name=cmd[0])
        args = cmd[1:]
        if cmd[0] == "moekit-train":  # tiny: the flags given later win
            args += [*TINY_MODEL, "--steps", "4", "--batch-size", "32", "--log.progress", "off"]
        capsys.readouterr()
        code = script.load()(args)
        said = capsys.readouterr()
        assert code == 0, f"{shlex.join(cmd)}\n{said.out[-2000:]}\n{said.err[-2000:]}"
        assert "Traceback" not in said.err
        out[cmd[0] if cmd[0] not in out else f"{cmd[0]} {cmd[-1]}"] = said

    meta = json.loads((tmp_path / "data" / "stdlib-bpe.bin.json").read_text())
    tok = Tokenizer.from_file(str(tmp_path / "data" / "stdlib-bpe.bin.tokenizer.json"))
    assert meta["eos_id"] == tok.token_to_id("<|endoftext|>") == 0 and meta["vocab_size"] == tok.get_vocab_size()
    run = tmp_path / "runs" / "bpe"
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["vocab_size"] == meta["vocab_size"]  # the vocabulary came from the data
    info = json.loads((run / "tokenizer_info.json").read_text())
    assert info["kind"] == "hf" and info["sha256"] == meta["tokenizer"]["sha256"]

    # generate: the prompt, then text decoded with the run's tokenizer
    text = out["moekit-generate"].out
    assert text.startswith("def parse_args(") and len(text) > len("def parse_args(")

    # eval: a finite loss, perplexity = exp(loss), bits per byte consistent with the tokens per byte
    said = out["moekit-eval"].out
    line = next(ln for ln in said.splitlines() if ln.startswith("loss "))
    words = line.split()
    loss, ppl, bpb = float(words[1]), float(words[3]), float(words[5])
    assert math.isfinite(loss) and ppl == pytest.approx(math.exp(loss), rel=1e-3)
    assert 0 < bpb < loss / math.log(2)  # BPE tokens hold more than one byte each

    # eval --tasks: the task's row, accuracies within [0, 1] around chance 25%
    table = out["moekit-eval @continuation,@next-line"].out.splitlines()
    for task in ("continuation", "next-line"):
        words = next(ln for ln in table if ln.startswith("@" + task)).split()
        assert words[1] == task and int(words[2]) > 0 and words[-2] == "25.0%"
        assert 0 <= float(words[3]) <= 100 and 0 <= float(words[6]) <= 100
