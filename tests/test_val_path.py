"""--data.val_path: validation on a file of its own (nanoGPT's train.bin / val.bin). The training data trains whole,
the validation loss is the file's (checked against a loss computed from the checkpoint directly), moekit-eval reads
the same windows, resume keeps or refuses it, data-parallel ranks agree, and bad files get one line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moekit.train.data import BLOCK, load_data
from moekit.train.loop import main
from moekit.train.prepare import main as prepare
from tests.tiny import TINY_MODEL, byte_sets

S = 32  # TINY_MODEL's train.seq_len


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> Path:
    """Byte-token sets of fresh random text: train (t), two validation files of other letters (v, w), one more
    training set (u), and one prepared without EOS (x: another tokenizer record)."""
    folder = tmp_path_factory.mktemp("valpath")
    byte_sets(folder, [("t", 40_000, "abcdefgh ij\n", []), ("u", 20_000, "abcdefgh ij\n", []),
                       ("v", 6_000, "klmnop qrs\n", []), ("w", 6_000, "tuvwxyz\n", []), ("x", 6_000, "abc\n", ["--no-eos"])])
    return folder


def run(run_dir: Path, *flags: str) -> int:
    return main([*TINY_MODEL, "--run-dir", str(run_dir), "--log.progress", "off", *flags])


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def file_tokens(path: Path) -> np.ndarray:
    from moekit.train.tokens import read_token_file

    return np.asarray(read_token_file(str(path))[0], dtype=np.int64)


def test_split_trains_on_the_whole_data_and_validates_on_the_file(sets):
    """One set and a blend: every block of the training data is training (none held out), and the validation windows
    are the file's non-overlapping windows, ``validation(n)`` spread evenly over them."""
    from moekit.train.config import DataSection

    t, v = file_tokens(sets / "t.bin"), file_tokens(sets / "v.bin")
    for section, train_sizes in ((DataSection(path=str(sets / "t.bin"), val_path=str(sets / "v.bin")), [t.size]),
                                 (DataSection(blend=f"{sets / 't.bin'}:1,{sets / 'u.bin'}:1",
                                              val_path=str(sets / "v.bin")), [t.size, file_tokens(sets / "u.bin").size])):
        data = load_data(section, 257)
        split = data.split(S, 0.05)
        per_block = lambda n: (n // min(BLOCK, n)) * ((min(BLOCK, n) - 1) // S)  # noqa: E731
        assert split.train_starts.size == sum(per_block(n) for n in train_sizes)
        assert np.array_equal(split.val_starts, np.arange((v.size - 1) // S) * S)
        assert split.held_out is split.val_tokens and np.array_equal(np.asarray(split.held_out), v)
        picked = split.validation(7)
        assert picked.size == 7 and picked[0] == 0 and picked[-1] == split.val_starts[-1]
        assert np.all(np.diff(picked) > 0) and np.all(picked + S + 1 <= v.size)
        assert "validation: token file" in data.desc
    held = load_data(DataSection(path=str(sets / "t.bin")), 257).split(S, 0.05)  # without: 1 block in 20 held out
    assert held.val_tokens is None and held.held_out is held.tokens and held.val_starts.size > 0


def test_validation_loss_is_the_files_and_moekit_eval_reads_the_same_windows(sets, tmp_path, capsys):
    from moekit.train.evaluate import main as evaluate
    from moekit.train.inference import load_for_inference

    flags = ["--data.path", str(sets / "t.bin"), "--data.val_path", str(sets / "v.bin"), "--steps", "4",
             "--eval.every", "2", "--checkpoint.every", "4"]
    assert run(tmp_path / "run", *flags) == 0
    assert run(tmp_path / "held", *flags[:2], *flags[4:]) == 0  # the same run, held-out blocks of t instead
    val = rows(tmp_path / "run")[-1]["val_loss"]
    assert val != rows(tmp_path / "held")[-1]["val_loss"]
    assert [r["loss"] for r in rows(tmp_path / "run")] != [r["loss"] for r in rows(tmp_path / "held")]  # more data
    # the loss of the file's 8 evenly spread windows, from the checkpoint, computed here
    model, _, _ = load_for_inference(tmp_path / "run", require_tokenizer=False, warn=lambda _m: None)
    v = file_tokens(sets / "v.bin")
    starts = (np.arange((v.size - 1) // S) * S)[np.linspace(0, (v.size - 1) // S - 1, 8).round().astype(int)]
    windows = torch.from_numpy(v[starts[:, None] + np.arange(S + 1)])
    with torch.no_grad():
        logits = model(windows[:, :-1])
    direct = F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten()).item()
    assert val == pytest.approx(direct, rel=1e-5)
    capsys.readouterr()
    out = tmp_path / "eval.json"
    assert evaluate([str(tmp_path / "run"), "--batches", "2", "--batch-size", "4", "--out", str(out), "--quiet"]) == 0
    assert json.loads(out.read_text())["loss"] == pytest.approx(val, rel=1e-5)
    assert evaluate([str(tmp_path / "run"), "--split", "all", "--batches", "2", "--batch-size", "4", "--out", str(out),
                     "--quiet"]) == 0
    assert json.loads(out.read_text())["loss"] != pytest.approx(val, rel=1e-3)  # the training data's windows


def test_resume_keeps_the_file_takes_another_and_refuses_to_drop_it(sets, tmp_path, capsys):
    t, v, w = (str(sets / f"{n}.bin") for n in "tvw")
    flags = ["--data.path", t, "--steps", "6", "--eval.every", "3", "--checkpoint.every", "3"]
    assert run(tmp_path / "straight", *flags, "--data.val_path", v) == 0
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "straight", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000006")
    assert run(resumed, *flags, "--data.val_path", v, "--resume") == 0
    assert rows(resumed) == [{**r, **{k: r2[k] for k in ("tokens_per_s", "step_s", "elapsed_s", "mfu", "mem_gb")
                                      if k in r2}} for r, r2 in zip(rows(tmp_path / "straight"), rows(resumed))]
    other = tmp_path / "other"
    shutil.copytree(resumed, other)
    shutil.rmtree(other / "checkpoints" / "step_000006")
    capsys.readouterr()
    assert run(other, *flags, "--data.val_path", w, "--resume") == 0  # another file: applied, and said
    assert "data.val_path" in capsys.readouterr().out
    a, b = rows(resumed), rows(other)
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and a[-1]["val_loss"] != b[-1]["val_loss"]
    assert run(other, *flags, "--steps", "7", "--resume") == 2  # dropped: the training windows would change
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.val_path" in err[0] and f"resume with --data.val_path {w}" in err[0], err


def test_data_parallel_ranks_validate_on_the_file_as_one_process(sets, tmp_path):
    from tests.dist_utils import run_trainer

    flags = [*TINY_MODEL, "--data.path", str(sets / "t.bin"), "--data.val_path", str(sets / "v.bin"), "--steps", "2",
             "--checkpoint.every", "0", "--log.progress", "off"]
    assert run(tmp_path / "one", *flags[len(TINY_MODEL):]) == 0
    r = run_trainer([*flags, "--run-dir", str(tmp_path / "dp2")], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert rows(tmp_path / "dp2")[-1]["val_loss"] == pytest.approx(rows(tmp_path / "one")[-1]["val_loss"], rel=1e-5)


def test_bad_validation_files_get_one_line(sets, tmp_path, capsys):
    t = str(sets / "t.bin")
    tiny = tmp_path / "tiny.bin"
    (tmp_path / "tiny.txt").write_text("abcdefgh ij\n" * 2)
    assert prepare([str(tmp_path / "tiny.txt"), "--tokenizer", "bytes", "-o", str(tiny), "--quiet"]) == 0
    cases = [(str(tmp_path / "gone.bin"), "--data.val_path", "no such file"),
             (t, "--data.val_path", "is also training data"),
             (str(tiny), "--data.val_path", "too few for one validation sequence of 32"),
             (str(sets / "x.bin"), "--data.val_path:", "not prepared with the same tokenizer")]
    for path, where, message in cases:
        assert run(tmp_path / "r", "--steps", "1", "--data.path", t, "--data.val_path", path) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and where in err[0] and message in err[0], err
    assert not (tmp_path / "r").exists()
