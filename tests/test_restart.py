"""Crash and restart under torchrun: a killed rank, ``--max-restarts 1`` and ``--resume auto`` reproduce the
uninterrupted run (gloo, 2 ranks, expert parallel).

The faulty run kills rank 1 at the start of step 4 with the trainer's testing hook
(MOEKIT_FAULT_EXIT_AT_STEP / MOEKIT_FAULT_RANK); torchrun restarts both ranks, which resume from the
step-2 checkpoint and redo step 3. The reference run saves asynchronously, so the same comparison
checks that background saves (on their own gloo group) leave training untouched.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from moekit.train import checkpoint, faults
from moekit.train.records import load_rows
from tests.dist_utils import run_trainer

TINY = ["--model.hidden_size", "32", "--model.num_layers", "2", "--train.seq_len", "32", "--batch-size", "8",
        "--eval.every", "0", "--eval.sequences", "8", "--log.every", "1", "--log.progress", "off",
        "--log.tensorboard", "false",
        "--steps", "6", "--checkpoint.every", "2", "--ep", "2", "--resume", "auto"]
# Compared across the runs: everything but timings.
SAME = ("step", "loss", "aux_loss", "lr", "grad_norm", "tokens", "imbalance", "val_loss")


def launch(run_dir: Path, *flags: str, env_extra: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           # torchrun >= 2.5 shares its rendezvous store with the workers and keeps it across restarts:
           # the restarted ranks could read the dead attempt's gloo addresses (pytorch/pytorch#135712)
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    for var in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", faults.FAULT_STEP_ENV, faults.FAULT_RANK_ENV):
        env.pop(var, None)
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "1", str(ROOT / "tools" / "train.py"), *TINY, "--run-dir", str(run_dir), *flags]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def records(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def test_killed_rank_restarts_from_the_latest_checkpoint(tmp_path):
    faulty, reference = tmp_path / "faulty", tmp_path / "reference"
    # both at once: the restart's waits overlap the reference's work. The reference runs on ranks forked with
    # torchrun's environment (tests.dist_utils.run_trainer), not two more interpreters and an agent
    proc = launch(faulty, env_extra={faults.FAULT_STEP_ENV: "4", faults.FAULT_RANK_ENV: "1"})
    clean = {k: v for k, v in os.environ.items() if k not in (faults.FAULT_STEP_ENV, faults.FAULT_RANK_ENV)}
    ref = run_trainer([*TINY, "--run-dir", str(reference), "--checkpoint.async_save", "true"], 2, env=clean)
    out, err = proc.communicate(timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert proc.returncode == 0, err[-3000:]
    assert (faulty / faults.FAULT_MARKER).exists()  # the hook fired: rank 1 was killed once
    # torchrun saw a worker fail and restarted the group: rank 1's SIGKILL (-9), or rank 0's own exit (1) when
    # it stopped on the broken collective before torchrun's next poll (ranks end with os._exit after their
    # teardown, so that can be quick); the restart itself is checked by the resume below
    assert re.search(r"failed \(exitcode: (-9|1)\) local_rank: [01]", err), err[-3000:]
    assert f"resumed from {faulty / 'checkpoints' / 'step_000002'} at step 2" in out
    assert out.count("step=3 loss=") == 2 and out.count("step=4 loss=") == 1  # step 3 redone

    got, want = records(faulty, "metrics.jsonl"), records(reference, "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]  # no duplicates of the redone step
    assert [{k: r.get(k) for k in SAME} for r in got] == [{k: r.get(k) for k in SAME} for r in want]  # bitwise
    assert load_rows(faulty) == load_rows(reference)
    for run in (faulty, reference):  # every kept checkpoint is sealed and verifies
        assert [p.name for p in checkpoint.list_checkpoints(run)] == ["step_000004", "step_000006"]
        for path in checkpoint.list_checkpoints(run):
            checkpoint.read_meta(path)
        assert not [p for p in (run / "checkpoints").iterdir() if "." in p.name]
