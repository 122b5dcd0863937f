"""Loss- and gradient-spike skipping (--train.spike_skip, moekit.train.spikes): the statistics against numpy, a
drilled spike (MOEKIT_DEBUG_NAN=STEP:LAYER:spike, a finite gradient-norm jump) skipped and leaving no trace
against a clean run, the window carried through a checkpoint, spikes in a row stopping the run, ranks agreeing."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from moekit.train import guard, spikes
from moekit.train.loop import main
from moekit.train.spikes import SpikeGuard
from tests.dist_utils import run_trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model.hidden_size", "32", "--model.num_layers", "2", "--model.num_heads", "2", "--model.num_kv_heads", "1",
        "--model.ffn_hidden_size", "64", "--model.moe_ffn_hidden_size", "32", "--model.max_seq_len", "32",
        "--train.seq_len", "32", "--batch-size", "4", "--eval.sequences", "8", "--eval.every", "0",
        "--log.tensorboard", "false", "--log.every", "1", "--log.progress", "off", "--checkpoint.every", "0"]
SPIKE = ["--train.spike_skip", "4", "--train.spike_window", "6"]
TIMINGS = ("tokens_per_s", "step_s", "elapsed_s", "mem_gb")

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def untimed(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in TIMINGS}


def test_the_verdict_is_a_z_score_over_a_full_window_of_good_steps():
    rng = np.random.default_rng()
    window, z = int(rng.integers(5, 30)), float(rng.uniform(2, 6))
    g = SpikeGuard(z, window)
    history = rng.normal(3.0, 0.2, size=(window, 2)) * [1, 0.5] + [0, 1]
    for i, (loss, norm) in enumerate(history):
        assert g.check(10 * loss, 10 * norm) is None  # never before the window is full
        g.accept(float(loss), float(norm))
    mean, std = history.mean(axis=0), history.std(axis=0, ddof=1)
    assert g.check(*(mean + (z - 0.05) * std)) is None
    what, value, how = g.check(mean[0] + (z + 0.05) * std[0], mean[1])
    assert what == "loss" and value == pytest.approx(mean[0] + (z + 0.05) * std[0])
    assert f"{z + 0.05:.1f} standard deviations above the mean" in how and f"last {window} steps" in how
    assert g.check(mean[0], mean[1] + (z + 0.05) * std[1])[0] == "gradient norm"
    assert g.check(float("nan"), mean[1]) is None  # non-finite: the non-finite guard's
    # the window slides, and survives a checkpoint (meta.json: JSON lists); malformed rows are dropped
    g.accept(100.0, 100.0)
    state = json.loads(json.dumps(g.state()))
    assert len(state) == window and state[-1] == [100.0, 100.0] and state[0] == pytest.approx(list(history[1]))
    back = SpikeGuard(z, window, state + [["x", 1], [1.0]])
    assert back.state() == state
    assert back.check(1e9, 0.0) == g.check(1e9, 0.0)


def test_a_spike_is_skipped_and_leaves_no_trace(tmp_path, monkeypatch, capsys):
    """The drill multiplies layer 1's router gradient by 1000 at step 8: without --train.spike_skip the step
    trains on it (the drill does make a spike); with it, step 8 is recorded as skipped, steps 1-7 equal a clean
    run, and the schedule did not move (step 9 trains at the clean run's step-8 LR)."""
    clean = tmp_path / "clean"
    assert main([*TINY, "--run-dir", str(clean), "--steps", "9", *SPIKE]) == 0
    monkeypatch.setenv(guard.POISON_ENV, "8:1:spike")
    plain = tmp_path / "plain"
    assert main([*TINY, "--run-dir", str(plain), "--steps", "8"]) == 0
    norms = [r["grad_norm"] for r in rows(plain)]
    assert norms[7] > 2 * max(norms[1:7])  # the drilled step's gradient norm jumps
    skip = tmp_path / "skip"
    assert main([*TINY, "--run-dir", str(skip), "--steps", "9", *SPIKE]) == 0
    got, ref = rows(skip), rows(clean)
    assert [untimed(r) for r in got[:7]] == [untimed(r) for r in ref[:7]]
    event = got[7]
    assert event["step"] == 8 and event["skipped"] and event["spike"] == "gradient norm" and "nonfinite" not in event
    assert event["value"] == pytest.approx(norms[7], rel=1e-5)
    assert "standard deviations above the mean" in event["where"] and "last 6 steps" in event["where"]
    assert got[8]["lr"] == ref[7]["lr"] and not got[8].get("skipped")
    parts = event["grad_norm_by_part"]  # the drilled router's gradient is the part that spiked
    assert max(parts, key=parts.get) == "router" and parts["router"] > 10 * got[6]["grad_norm_by_part"]["router"]
    out = capsys.readouterr().out
    assert "step=8 skipped: gradient norm spike (" in out
    assert "; the largest part of the gradient norm: router " in out
    assert "Skipped 1 step(s) (1 spike(s), 0 non-finite)" in out.splitlines()[-1]


def test_the_window_is_carried_through_a_checkpoint(tmp_path, monkeypatch):
    """A checkpoint at step 5, resumed with the drill at step 8: its window (steps 1-5 with the 6 and 7 the
    resumed run adds, a full window of 6) skips step 8 as the uninterrupted run does; an empty window would not
    be full at step 8."""
    monkeypatch.setenv(guard.POISON_ENV, "8:1:spike")
    whole = tmp_path / "whole"
    assert main([*TINY, "--run-dir", str(whole), "--steps", "9", *SPIKE]) == 0
    first = tmp_path / "first"
    assert main([*TINY, "--run-dir", str(first), "--steps", "5", *SPIKE, "--checkpoint.every", "5"]) == 0
    meta = json.loads((first / "checkpoints" / "step_000005" / "meta.json").read_text())
    saved = meta["run"][spikes.STATE_KEY]
    assert [s[0] for s in saved] == [r["loss"] for r in rows(first)] and len(saved) == 5
    assert main([*TINY, "--run-dir", str(first), "--steps", "9", *SPIKE, "--resume"]) == 0
    resumed = rows(first)[5:]
    assert [r["step"] for r in resumed] == [6, 7, 8, 9] and resumed[2].get("spike") == "gradient norm"
    assert [untimed(r) for r in resumed] == [untimed(r) for r in rows(whole)[5:]]


def test_spikes_in_a_row_stop_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(guard, "MAX_CONSECUTIVE_SKIPS", 2)
    monkeypatch.setattr(SpikeGuard, "check", lambda self, loss, norm: ("loss", loss, "drilled")
                        if len(self.values) == self.window else None)
    run = tmp_path / "r"
    assert main([*TINY, "--run-dir", str(run), "--steps", "6", "--train.spike_skip", "3", "--train.spike_window",
                 "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "loss spike" in err[0] and "at step 4 after 2 skipped steps in a row" in err[0]
    assert "has moved, not spiked" in err[0] and "--train.spike_skip" in err[0]
    assert [r.get("skipped", False) for r in rows(run)] == [False, False, True]


@pytest.mark.parametrize("flags, message", [
    (["--train.spike_skip", "-1"], "--train.spike_skip=-1.0 is invalid"),
    (["--train.spike_skip", "nan"], "--train.spike_skip=nan is invalid"),
    (["--train.spike_window", "1"], "--train.spike_window=1 is invalid"),
])
def test_bad_spike_settings_are_one_line(tmp_path, capsys, flags, message):
    assert main([*TINY, "--run-dir", str(tmp_path / "r"), "--steps", "1", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_ranks_skip_a_spike_together(tmp_path):
    """ep 2 on two ranks, the drill on rank 1 alone: the replicated router's gradient is reduced over the ranks,
    so both see the spike and skip step 8 (else the next step's collectives would not match)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), guard.POISON_ENV: "8:1:spike:1"}
    env.pop("WORLD_SIZE", None)
    run = tmp_path / "ep"
    r = run_trainer([*TINY, "--ep", "2", "--run-dir", str(run), "--steps", "9", *SPIKE], 2, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [bool(x.get("skipped")) for x in rows(run)] == [False] * 7 + [True, False]
