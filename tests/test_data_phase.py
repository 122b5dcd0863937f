"""--checkpoint.exclude_from_loading data: resume into new data (an annealing blend, longer or shorter sequences).
The data settings are applied instead of refused, the new data is drawn in a fresh order keyed on the phase's first
step, and a restart inside the new phase continues it exactly (moekit.train.resume, moekit.train.data.Sampler)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from moekit.train.data import Sampler
from moekit.train.loop import main
from tests.tiny import TINY_MODEL, byte_sets

NEW = ["--checkpoint.exclude_from_loading", "data"]


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("phase")
    byte_sets(folder, [("t", 30_000, "abcdefgh ij\n", []), ("u", 20_000, "klmnop qrs\n", [])])
    return folder


def run(run_dir: Path, *flags: str) -> int:
    return main([*TINY_MODEL, "--run-dir", str(run_dir), "--log.progress", "off", "--checkpoint.every", "2", *flags])


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_later_phase_draws_its_own_order_and_resumes_inside_it():
    starts = np.arange(0, 50_000, 33, dtype=np.int64)
    seed = 11
    first = Sampler(starts, seed)
    # a run's first phase keeps the order older checkpoints recorded: numpy's permutation keyed on (seed, epoch)
    assert np.array_equal(first.next(starts.size + 5),
                          np.concatenate([starts[np.random.default_rng([seed, 0]).permutation(starts.size)],
                                          starts[np.random.default_rng([seed, 1]).permutation(starts.size)[:5]]]))
    later = Sampler(starts, seed, phase=40)
    again = Sampler(starts, seed)
    drawn = later.next(100)
    assert not np.array_equal(drawn, again.next(100))  # no replay of the first phase's windows
    resumed = Sampler(starts, seed, phase=40)
    resumed.load_state_dict(later.state_dict())
    assert np.array_equal(resumed.next(starts.size), later.next(starts.size))  # across the epoch boundary too


def test_resuming_into_an_annealing_blend_and_a_restart_inside_it(sets, tmp_path, capsys):
    t, u = str(sets / "t.bin"), str(sets / "u.bin")
    first = tmp_path / "first"
    assert run(first, "--data.path", t, "--steps", "4") == 0
    capsys.readouterr()
    blend = ["--data.blend", f"{t}:0.5,{u}:0.5"]  # phase 2: half new data, as an annealing mix

    refused = tmp_path / "refused"
    shutil.copytree(first, refused)
    assert run(refused, *blend, "--steps", "8", "--resume") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--checkpoint.exclude_from_loading data" in err[0] and "data.blend" in err[0], err

    straight = tmp_path / "straight"
    shutil.copytree(first, straight)
    assert run(straight, *blend, *NEW, "--steps", "8", "--resume") == 0
    out = capsys.readouterr().out
    assert "the checkpoint's data position is not loaded" in out and "data.blend" in out
    got = rows(straight)
    assert [r["step"] for r in got] == list(range(1, 9))
    assert got[:4] == rows(first)  # phase 1's records stay
    window = 4 * 32  # a step's tokens: 4 windows of 32
    assert got[-1]["tokens_by_source"] == {t: 2 * window, u: 2 * window}  # counted from the phase's start
    assert got[-1]["tokens"] == 8 * window
    meta = json.loads((straight / "checkpoints" / "step_000008" / "meta.json").read_text())
    assert meta["run"]["data_phase"] == 4

    # the same command again after a stop at step 6: the data settings equal that checkpoint's, so its position loads
    # and the phase continues bit for bit
    restarted = tmp_path / "restarted"
    shutil.copytree(first, restarted)
    assert run(restarted, *blend, *NEW, "--steps", "6", "--resume") == 0
    assert run(restarted, *blend, *NEW, "--steps", "8", "--resume") == 0
    assert "data position is not loaded" not in capsys.readouterr().out.split("resumed from")[-1]
    assert [r["loss"] for r in rows(restarted)] == [r["loss"] for r in got]
    assert rows(restarted)[-1]["tokens_by_source"] == got[-1]["tokens_by_source"]


def test_a_new_sequence_length_continues_the_token_count(sets, tmp_path, capsys):
    t = str(sets / "t.bin")
    run_dir = tmp_path / "run"
    assert run(run_dir, "--data.path", t, "--steps", "2") == 0
    assert run(run_dir, "--data.path", t, "--steps", "3", "--resume", "--train.seq_len", "16", *NEW) == 0
    got = rows(run_dir)
    assert got[-1]["tokens"] == 2 * 4 * 32 + 4 * 16
    assert "train.seq_len 32 -> 16" in capsys.readouterr().out


def test_only_the_data_can_be_left_unloaded(tmp_path, capsys):
    assert main([*TINY_MODEL, "--steps", "1", "--checkpoint.exclude_from_loading", "optimizer",
                 "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--checkpoint.exclude_from_loading='optimizer' is invalid" in err[0] and "'data'" in err[0]
    assert not (tmp_path / "r").exists()
