"""moekit-launch slurm (moekit.train.launch): the flags checked as moekit-train checks them for the job's ranks, bad
input in one line, and the written script run for real under a stand-in Slurm (srun starting one torchrun agent per
"node" on this machine, scontrol answering hostnames and recording requeues): two nodes rendezvous and train, the
time-limit signal makes every rank save and the job requeue, and the requeued job finishes the run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moekit.train.launch import main, seconds
from tests.dist_utils import free_port
from tests.tiny import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]

# srun: one task per node of the allocation, each with its node's SLURM_* variables; SIGTERM forwarded to every task
FAKE_SRUN = """#!/bin/bash
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do
    SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 "$@" > "$FAKE_SLURM_DIR/node$i.out" 2> "$FAKE_SLURM_DIR/node$i.err" &
    pids+=($!)
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
status=0
for pid in "${pids[@]}"; do
    while true; do
        wait "$pid"; rc=$?
        kill -0 "$pid" 2>/dev/null || break
    done
    [ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc
done
exit $status
"""
FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
    "show hostnames") for ((i = 0; i < SLURM_NNODES; i++)); do echo localhost; done ;;
    "requeue "*) echo "requeue $2" >> "$FAKE_SLURM_DIR/scontrol.log" ;;
    *) echo "scontrol stand-in: $*" >&2; exit 1 ;;
esac
"""


def one_line(capsys, rc: int) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and " error: " in err[0], err
    return err[0]


@pytest.mark.parametrize("limit, want", [("30", 1800), ("90:30", 5430), ("12:00:00", 43200), ("2-00:00:00", 172800),
                                         ("1-06", 108000), ("3-01:02", 262_920)])
def test_slurm_time_limits(limit, want):
    assert seconds(limit) == want


@pytest.mark.parametrize("argv, expected", [
    (["--nodes", "2", "--gpus-per-node", "3", "--time", "60", "--", "--ep", "4"],
     "the training flags for 2 x 3 = 6 ranks:"),
    (["--nodes", "2", "--gpus-per-node", "2", "--time", "60", "--", "--ep", "3"], "--ep"),
    (["--nodes", "0", "--gpus-per-node", "2", "--time", "60", "--", "--ep", "2"], "--nodes 0: must be at least 1"),
    (["--nodes", "1", "--gpus-per-node", "2", "--time", "5", "--", "--ep", "2"], "--signal-lead 600: must be"),
    (["--nodes", "1", "--gpus-per-node", "2", "--time", "1:2:3:4", "--", "--ep", "2"], "not a Slurm time limit"),
    (["--nodes", "1", "--gpus-per-node", "2", "--time", "60", "--", "--ep", "2", "--dry-run"], "--dry-run is not a"),
    (["--nodes", "1", "--gpus-per-node", "2", "--time", "60", "--", "--resume", "runs/old/checkpoints/step_000010"],
     "the job resumes with --resume auto"),
    (["--nodes", "1", "--gpus-per-node", "2", "--time", "60", "--", "--ranks-per-node", "1"], "the job's nodes are real"),
    (["--nodes", "1", "--gpus-per-node", "2", "--time", "60", "--env", "NOEQUALS", "--", "--ep", "2"],
     "expected KEY=VALUE"),
    (["--nodes", "1", "--gpus-per-node", "2", "--time", "60"], "no training flags"),
    (["--nodes", "1", "--gpus-per-node", "2", "--time", "60", "--", "--router", "nope"], "unknown router 'nope'"),
])
def test_bad_launch_input_is_one_line(capsys, argv, expected):
    assert expected in one_line(capsys, main(["slurm", *argv]))


def test_the_script_states_its_layout_and_passes_the_flags_through(tmp_path, capsys):
    out = tmp_path / "jobs" / "job.sbatch"
    assert main(["slurm", "--nodes", "4", "--gpus-per-node", "8", "--time", "2-00:00:00", "--partition", "gpu",
                 "--setup", "source .venv/bin/activate", "--env", "NCCL_IB_HCA=mlx5 mlx6", "-o", str(out), "--",
                 "--preset", "mixtral-tiny", "--fsdp", "4", "--ep", "8", "--batch-size", "64", "--run-dir", "runs/big",
                 "--resume"]) == 0
    assert f"sbatch {out}" in capsys.readouterr().out
    text = out.read_text()
    assert os.access(out, os.X_OK) and text.startswith("#!/bin/bash\n# 4 node(s) x 8 rank(s) = 32 ranks (dp=8 fsdp=4 ep=8)")
    for line in ("#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8", "#SBATCH --time=2-00:00:00", "#SBATCH --partition=gpu",
                 "#SBATCH --signal=B:USR1@600", "#SBATCH --requeue", "#SBATCH --job-name=moekit-big",
                 "source .venv/bin/activate", "export NCCL_IB_HCA='mlx5 mlx6'", "--nproc-per-node 8",
                 "--max-restarts 3", "--run-dir runs/big --resume auto &"):
        assert line in text, line
    command = text[text.index("-m moekit.train") : text.index(" &\n")]
    assert command.count("--resume") == 1  # the user's --resume became the job's --resume auto
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0  # the shell parses it


def test_check_memory_plans_the_jobs_ranks_and_writes_only_what_fits(tmp_path, capsys):
    """--check-memory: moekit-train's dry run for 2 nodes x 4 ranks (its report on stderr, the nodes the job's: EP
    spans both, so hierarchical dispatch), the script written when the worst rank fits and refused when not."""
    flags = ["slurm", "--nodes", "2", "--gpus-per-node", "4", "--time", "60", "-o", str(tmp_path / "j.sbatch")]
    train = ["--", "--preset", "mixtral-tiny", "--ep", "8", "--layout.hierarchical", "auto"]  # a value "auto" kept
    assert main([*flags, "--check-memory", "80", *train]) == 0
    out = capsys.readouterr()
    assert "dry run: mixtral-tiny" in out.err and "2 node(s) x 4 ranks" in out.err and ": fits" in out.err
    assert "wrote " in out.out and (tmp_path / "j.sbatch").exists()
    (tmp_path / "j.sbatch").unlink()
    rc = main([*flags, "--check-memory", "0.001", *train])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "does NOT fit" in "\n".join(err)
    assert err[-1].startswith("launch.py: error: --check-memory 0.001: the dry run above puts a rank's peak above")
    assert not (tmp_path / "j.sbatch").exists()
    assert "--check-memory 0.0: a GPU's memory in GiB" in one_line(capsys, main([*flags, "--check-memory", "0", *train]))


@pytest.mark.skipif(sys.platform != "linux", reason="bash job control and signals as on the cluster's nodes")
def test_two_nodes_train_save_at_the_time_limit_signal_and_the_requeued_job_finishes(tmp_path):
    """The script under the stand-in Slurm, 2 nodes x 1 rank (expert parallelism across the nodes): at step >= 3 the
    batch shell gets the time-limit signal (USR1); every rank finishes its step and saves, the job asks to be
    requeued and exits 0. Started again, as Slurm requeues it, it resumes from that checkpoint and ends at --steps."""
    fake = tmp_path / "slurm"
    fake.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (fake / name).write_text(body)
        (fake / name).chmod(0o755)
    run = tmp_path / "run"
    job = tmp_path / "job.sbatch"
    steps = 30
    assert main(["slurm", "--nodes", "2", "--gpus-per-node", "1", "--time", "30", "--signal-lead", "60", "--port",
                 str(free_port()), "--python", sys.executable, "--max-restarts", "0", "-o", str(job), "--",
                 *TINY_MODEL, "--ep", "2", "--steps", str(steps), "--checkpoint.every", "0", "--log.every", "1",
                 "--log.progress", "off", "--run-dir", str(run)]) == 0
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "FAKE_SLURM_DIR": str(fake), "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": "4242", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)

    def start():
        return subprocess.Popen(["bash", str(job)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def logs() -> str:
        return "".join(p.read_text() for p in sorted(fake.glob("node*.*")))

    first = start()
    try:
        end = time.monotonic() + 120
        metrics = run / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert time.monotonic() < end and first.poll() is None, logs()[-3000:]
            time.sleep(0.05)
        first.send_signal(signal.SIGUSR1)  # Slurm's --signal=B:USR1@lead, to the batch shell
        out, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, out + logs()[-3000:]
    assert "USR1 received" in out and "requeueing job 4242" in out, out
    assert (fake / "scontrol.log").read_text() == "requeue 4242\n"
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(saved) == 1 and int(saved[0].removeprefix("step_")) < steps, saved
    stopped = int(saved[0].removeprefix("step_"))
    assert "stopped by SIGTERM after step" in logs()

    second = start()  # the requeued job: the same script
    out, _ = second.communicate(timeout=180)
    assert second.returncode == 0, out + logs()[-3000:]
    assert f"at step {stopped}" in logs() and "requeue" not in out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert (fake / "scontrol.log").read_text() == "requeue 4242\n"
