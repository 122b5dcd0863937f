"""The non-finite guard under pipeline parallelism, and parameters an optimizer step blew up (issue 14).

Two real ranks (gloo, pp 2) run tools/train.py as separate processes (forked as torchrun starts them:
tests.dist_utils.run_trainer), so each rank's exit code and stderr are its own. The models give the stages
different MoE layers: ``D M | M M`` (first_dense_layers 1: one MoE
layer on stage 0, two on stage 1) and interleaved ``M | M | M | M`` (rank 0 holds layers 0 and 2). Every
rank must name the poisoned layer by its single-process name, take the same branch (no gloo size mismatch,
no hang) and, with ``skip``, train on in lockstep: the losses equal those of one process poisoned alike.
MOEKIT_DEBUG_NAN's LAYER is the global MoE-layer index: 0 = layers.1.ffn, 1 = layers.2.ffn, 2 = layers.3.ffn.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from moekit.train import guard
from moekit.train.loop import main

from tests.dist_utils import run_trainer
from tests.tiny import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
BASE = [*TINY_MODEL, "--checkpoint.every", "0", "--log.progress", "off", "--steps", "3", "--batch-size", "2",
        "--train.micro_batch_size", "1", "--eval.sequences", "2"]  # 2 micro-batches: the fewest 1F1B takes
UNEVEN = ["--model.num_layers", "4", "--model.first_dense_layers", "1"]  # stages: layers 0-1 | 2-3
INTERLEAVED = ["--model.num_layers", "4", "--layout.pp_schedule", "interleaved", "--layout.pp_stages_per_rank", "2"]
FORWARD, BACKWARD = "router output (forward)", "router weight gradient (backward)"


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def pp2(run: Path, args: list[str], poison: str) -> list[subprocess.CompletedProcess]:
    """Both ranks of a pp 2 run, each its own process with its own streams and status; [rank 0, rank 1]
    (forked as torchrun starts them, tests.dist_utils.run_trainer)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), guard.POISON_ENV: poison}
    return run_trainer([*BASE, "--pp", "2", "--layout.timeout_s", "60", "--run-dir", str(run), *args], 2, env=env,
                       timeout=240, per_rank=True)


@pytest.mark.parametrize("model,poison,where", [
    pytest.param(UNEVEN, "2:0:router", f"layers.1.ffn: {FORWARD}", id="stage0-router"),
    pytest.param(UNEVEN, "2:2:grad", f"layers.3.ffn: {BACKWARD}", id="stage1-grad"),
    pytest.param(INTERLEAVED, "2:2:router", f"layers.2.ffn: {FORWARD}", id="interleaved-rank0-stage2",
                 marks=pytest.mark.slow),
])
def test_stop_names_the_global_layer_on_every_rank(tmp_path, model, poison, where):
    """stop (default): both ranks exit 1 at step 2; rank 0 says where in one line, rank 1 says nothing."""
    r0, r1 = pp2(tmp_path, model, poison)
    assert (r0.returncode, r1.returncode) == (1, 1), r0.stderr[-3000:] + r1.stderr[-3000:]
    assert r1.stderr == "", r1.stderr[-3000:]  # no gloo size mismatch, no traceback
    (line,) = r0.stderr.strip().splitlines()
    assert "non-finite" in line and "at step 2;" in line and f"first seen in MoE layer {where}." in line, line
    assert [r["step"] for r in rows(tmp_path)] == [1]


def _skip_case(tmp_path, monkeypatch, model: list[str], poison: str, where: str) -> None:
    """skip: both ranks skip step 2 and go on in lockstep; the records are those of one process poisoned alike."""
    r0, r1 = pp2(tmp_path / "pp", ["--train.on_nonfinite", "skip", *model], poison)
    assert (r0.returncode, r1.returncode) == (0, 0), r0.stderr[-3000:] + r1.stderr[-3000:]
    assert r1.stderr == "" and r0.stderr == "", r0.stderr[-3000:] + r1.stderr[-3000:]
    got = rows(tmp_path / "pp")
    assert [r.get("skipped", False) for r in got] == [False, True, False]
    assert got[1]["where"] == f"MoE layer {where}"
    assert "step=2 skipped: non-finite" in r0.stdout and f"; MoE layer {where}" in r0.stdout
    monkeypatch.setenv(guard.POISON_ENV, poison)  # the single-process reference: LAYER means the same layer
    assert main([*BASE, "--train.on_nonfinite", "skip", *model, "--run-dir", str(tmp_path / "one")]) == 0
    want = rows(tmp_path / "one")
    assert [r.get("where") for r in got] == [r.get("where") for r in want]
    assert [r["loss"] for r in got[::2]] == pytest.approx([r["loss"] for r in want[::2]], rel=1e-5)
    assert [r["lr"] for r in got] == [r["lr"] for r in want]  # the skipped step did not move the schedule


def test_skip_on_the_later_stage_keeps_ranks_in_lockstep(tmp_path, monkeypatch):
    """LAYER 1 is layers.2.ffn, the first MoE layer of stage 1 (index 0 there): named globally; with no
    RANK the drill poisons the rank that holds it."""
    _skip_case(tmp_path, monkeypatch, UNEVEN, "2:1:router", f"layers.2.ffn: {FORWARD}")


@pytest.mark.slow
def test_skip_on_a_gradient_of_the_first_stage(tmp_path, monkeypatch):
    """A NaN router gradient on stage 0 (layers.1.ffn): the deepest bad MoE gradient over both ranks. With
    clipping on (the default): a non-finite norm leaves the gradients unscaled, so the later stage's layers
    stay finite and are not blamed."""
    _skip_case(tmp_path, monkeypatch, UNEVEN, "2:0:grad", f"layers.1.ffn: {BACKWARD}")


@pytest.mark.slow
def test_drill_rank_that_does_not_hold_the_layer_is_refused(tmp_path):
    r0, r1 = pp2(tmp_path, UNEVEN, "2:1:grad:0")
    msg = "MOEKIT_DEBUG_NAN: rank 0 does not hold MoE layer 1 (layers.2.ffn); ranks holding it: [1]"
    for r in (r0, r1):  # every rank refuses alike, before training: nobody waits in a collective
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------
# Parameters that are themselves non-finite or blown up (one process)
# ---------------------------------------------------------------------------------------------------


def test_learning_rate_overflow_blames_the_parameters(tmp_path, monkeypatch, capsys):
    """AdamW moves each weight by about lr: at lr 1e30 (past config validation) step 1 leaves |w| ~1e29-1e30
    and step 2 goes non-finite. The guard names the parameters, not the first MoE layer's input."""
    from moekit.train import trainer

    real = trainer.make_optimizer

    def huge_lr(model, cfg, *args):
        optimizer = real(model, cfg, *args)
        for group in optimizer.param_groups:
            group["lr"] = 1e30
        return optimizer

    monkeypatch.setattr(trainer, "make_optimizer", huge_lr)
    assert main([*BASE, "--run-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    (line,) = err.splitlines()
    assert "at step 2;" in line and "Lower --train.lr" in line, line
    assert "first seen in the parameters themselves: blown up (|w| up to ~1e" in line, line
    assert "after the last optimizer step (learning rate too large)" in line, line


def test_nonfinite_initial_weights_are_named_with_skip_giving_up(tmp_path, monkeypatch, capsys):
    """Non-finite weights before any update (a bad checkpoint or init): skipping cannot repair them, so the
    run gives up after MAX_CONSECUTIVE_SKIPS, naming the parameters."""
    from moekit.train import trainer

    real = trainer.init_weights  # models.init's, as the trainer fills the model it has parallelised

    def bad_init(model, seed=0):
        real(model, seed)
        with torch.no_grad():
            model.norm.weight[0] = math.inf

    monkeypatch.setattr(trainer, "init_weights", bad_init)
    monkeypatch.setattr(guard, "MAX_CONSECUTIVE_SKIPS", 2)
    assert main([*BASE, "--run-dir", str(tmp_path), "--train.on_nonfinite", "skip"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "at step 2 after 2 skipped steps in a row" in line, line
    assert "the parameters themselves: non-finite before any update of this run (the initial or loaded weights)" \
        in line, line
    assert [r["where"] for r in rows(tmp_path)] == [line.split("first seen in ")[1].split(". Last")[0]]
