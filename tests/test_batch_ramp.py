"""Batch-size ramps (--train.batch_size_start, --train.batch_ramp_steps; moekit.train.plan.ramped_batch): the
schedule against a float formula, a ramped run against a chain of resumed runs that set each step's batch by
hand, and two ranks against one process."""
from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

import pytest

from moekit.comm.topology import Layout
from moekit.train.config import TrainSection
from moekit.train.loop import main
from moekit.train.plan import check_batch_ramp, micro_split, ramped_batch
from tests.dist_utils import run_trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model.hidden_size", "32", "--model.num_layers", "2", "--model.num_heads", "2", "--model.num_kv_heads", "1",
        "--model.ffn_hidden_size", "64", "--model.moe_ffn_hidden_size", "32", "--model.max_seq_len", "32",
        "--train.seq_len", "32", "--eval.sequences", "8", "--eval.every", "0", "--log.tensorboard", "false",
        "--log.every", "1", "--log.progress", "off", "--train.lr_schedule", "constant", "--train.warmup_steps", "0"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_ramp_is_linear_in_multiples_of_its_start_and_whole_micro_batches():
    rng = random.Random()
    for _ in range(200):
        start = rng.randint(1, 64)
        final = start + rng.randint(1, 500)
        steps = rng.randint(1, 40)
        train = TrainSection(batch_size=final, batch_size_start=start, batch_ramp_steps=steps)
        sizes = [ramped_batch(train, s) for s in range(1, steps + 3)]
        assert sizes[0] == start and sizes[steps:] == [final, final]
        assert sizes == sorted(sizes)
        for s, size in enumerate(sizes[:steps], 1):
            want = start + (final - start) * (s - 1) / steps  # the linear ramp, down to a multiple of the start
            assert size == math.floor(want / start + 1e-12) * start, (start, final, steps, s)
        per_rank, micro = rng.randint(1, 200), rng.randint(1, 16)
        m = micro_split(per_rank, micro)
        assert per_rank % m == 0 and m <= micro and not any(per_rank % k == 0 for k in range(m + 1, micro + 1))
    check_batch_ramp(TrainSection(batch_size=16, batch_size_start=4, batch_ramp_steps=2), Layout(dp=4))


def test_a_ramped_run_is_a_chain_of_runs_at_each_steps_batch(tmp_path):
    """Ramp 2 -> 8 over 3 steps with micro-batches of 2 (batches 2, 4, 6, 8: 1 to 4 micro-batches): the same
    losses and gradient norms as four runs, each resuming the last at that step's --batch-size (the sampler
    continues its order, so they draw the same windows)."""
    ramp = tmp_path / "ramp"
    flags = [*TINY, "--train.micro_batch_size", "2", "--checkpoint.every", "0"]
    assert main([*flags, "--run-dir", str(ramp), "--steps", "4", "--batch-size", "8", "--train.batch_size_start", "2",
                 "--train.batch_ramp_steps", "3"]) == 0
    got = rows(ramp)
    assert [r["batch_size"] for r in got] == [2, 4, 6, 8]
    assert [r["tokens"] for r in got] == [64, 192, 384, 640]
    chain = tmp_path / "chain"
    for step, batch in enumerate((2, 4, 6, 8), 1):
        resume = ["--resume"] if step > 1 else []
        assert main([*flags, "--run-dir", str(chain), "--steps", str(step), "--batch-size", str(batch),
                     "--checkpoint.every", "1", *resume]) == 0
    want = rows(chain)
    for key in ("loss", "grad_norm", "aux_loss", "lr"):
        assert [r[key] for r in got] == [r[key] for r in want], key


def test_two_ranks_ramp_as_one_process(tmp_path):
    """dp2 x ep2: the same batches (2, 4, 6, 8), each rank half of each (at step 3, 3 sequences: micro-batches of 1,
    where one process runs 3 of 2), and the curve is one process's. The aux loss is off: its balance statistics
    are per micro-batch over the ranks, which the layouts group differently (tests/test_train_distributed.py)."""
    flags = [*TINY, "--steps", "4", "--batch-size", "8", "--train.micro_batch_size", "2", "--train.batch_size_start",
             "2", "--train.batch_ramp_steps", "3", "--checkpoint.every", "0", "--model.aux_loss_coeff", "0"]
    one = tmp_path / "one"
    assert main([*flags, "--run-dir", str(one)]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    two = tmp_path / "two"
    r = run_trainer([*flags, "--ep", "2", "--run-dir", str(two)], 2, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "batch-size ramp: 2 sequences at step 1 (1 micro-batch(es) of 1 per rank), 8 from step 4" in r.stdout
    assert [x["loss"] for x in rows(two)] == pytest.approx([x["loss"] for x in rows(one)], rel=1e-5, abs=1e-6)
    assert [x["batch_size"] for x in rows(two)] == [2, 4, 6, 8]


def test_a_pipeline_ramps_as_one_process(tmp_path):
    """pp2 (GPipe, 2 ranks): the ramp's batches 2, 4, 6, 8 run 1 to 4 of the pipeline's micro-batches of 2 (a
    schedule for each count), and the curve, aux loss included, is one process's accumulating micro-batches of 2."""
    flags = [*TINY, "--steps", "4", "--batch-size", "8", "--train.micro_batch_size", "2", "--train.batch_size_start",
             "2", "--train.batch_ramp_steps", "3", "--checkpoint.every", "0"]
    one = tmp_path / "one"
    assert main([*flags, "--run-dir", str(one)]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    piped = tmp_path / "pp"
    r = run_trainer([*flags, "--pp", "2", "--layout.pp_schedule", "gpipe", "--run-dir", str(piped)], 2, env=env,
                    timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "batch-size ramp: 2 sequences at step 1 (1 micro-batch(es) of 2 per rank), 8 from step 4" in r.stdout
    assert [x["batch_size"] for x in rows(piped)] == [2, 4, 6, 8]
    for key in ("loss", "aux_loss", "grad_norm"):
        assert [x[key] for x in rows(piped)] == pytest.approx([x[key] for x in rows(one)], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("flags, message", [
    (["--train.batch_size_start", "4"], "a batch-size ramp needs both"),
    (["--train.batch_ramp_steps", "4"], "a batch-size ramp needs both"),
    (["--train.batch_size_start", "8", "--train.batch_ramp_steps", "2"], "the ramp starts below --batch-size 8"),
    (["--train.batch_size_start", "-2", "--train.batch_ramp_steps", "2"], "--train.batch_size_start=-2 is invalid"),
    (["--train.batch_size_start", "3", "--train.batch_ramp_steps", "2"],
     "--train.batch_size_start 3 must split into 2 data-parallel shares"),
    (["--train.batch_size_start", "2", "--train.batch_ramp_steps", "2", "--pp", "2", "--dp", "1",
      "--train.micro_batch_size", "2"],
     "a step of the ramp runs 1 micro-batches of 2: layout.pp_schedule=1f1b needs at least pp=2 micro-batches"),
    (["--train.batch_size_start", "2", "--train.batch_ramp_steps", "2", "--pp", "2", "--dp", "1",
      "--train.micro_batch_size", "4"],
     "every step of the ramp runs the final batch's micro-batches of 4 sequences"),
])
def test_bad_ramps_are_one_line(tmp_path, capsys, flags, message):
    argv = [*TINY, "--run-dir", str(tmp_path / "r"), "--steps", "1", "--batch-size", "8", *flags]
    if "--pp" in flags or "3" in flags:  # a layout of two ranks: checked before anything starts
        argv += ["--dry-run", "--world-size", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
