"""Preemption, stalls, the run directory's lock and unwritable paths (docs/training.md, "Reliability").

Real processes where the behaviour belongs to the process: SIGTERM to ``python tools/train.py`` and to a
torchrun job, a rank whose checkpoint write hangs, a second trainer on a busy run directory, a lock left
by a SIGKILLed holder. In-process runs (``main(argv)``, about a second each) where the fault is the
filesystem's, simulated by monkeypatching the write: a full disk, an unwritable directory (tests may run
as root, where chmod stops nothing).

Every preempted run is resumed and compared with an uninterrupted one: the losses must be equal bit for bit.
"""
from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemWriter

ROOT = Path(__file__).resolve().parents[1]
from moekit.train import checkpoint, faults, records, runlock
from moekit.train.loop import main

from tests.dist_utils import free_port, run_trainer
from tests.tiny import TINY_MODEL

TRAIN = str(ROOT / "tools" / "train.py")
# Compared across runs: everything but timings.
SAME = ("step", "loss", "aux_loss", "lr", "grad_norm", "tokens", "imbalance", "val_loss")
# two ranks, expert parallel (as tests/test_restart.py)
EP2 = ["--model.hidden_size", "32", "--model.num_layers", "2", "--train.seq_len", "32", "--batch-size", "8",
       "--eval.every", "0", "--eval.sequences", "8", "--log.every", "1000", "--log.progress", "off",
       "--log.tensorboard", "false", "--ep", "2"]


def env(**extra: str) -> dict:
    out = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # see tests/test_restart.py
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                faults.FAULT_STEP_ENV, faults.FAULT_RANK_ENV):
        out.pop(var, None)
    return {**out, **extra}


def launch(args: list, log: Path, **extra: str) -> subprocess.Popen:
    """A process with stdout and stderr in ``log``.out / ``log``.err (files: a full pipe would block it)."""
    with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
        return subprocess.Popen([sys.executable, *map(str, args)], env=env(**extra), stdout=out, stderr=err)


def torchrun(run_dir: Path, log: Path, *flags: str) -> subprocess.Popen:
    return launch(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                   TRAIN, *EP2, "--run-dir", run_dir, "--resume", "auto", *flags], log)


def text(log: Path, stream: str) -> str:
    return Path(f"{log}.{stream}").read_text()


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / records.METRICS
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def same(run_dir: Path) -> list[dict]:
    return [{k: r.get(k) for k in SAME} for r in metrics(run_dir)]


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until metrics.jsonl records ``step``; the process must still be running then."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        rows = metrics(run_dir)
        if rows and rows[-1].get("step", 0) >= step:
            assert proc.poll() is None, "the run ended before it could be interrupted: give it more steps"
            return
        assert proc.poll() is None, f"exited with {proc.returncode} before step {step}"
        time.sleep(0.01)
    raise AssertionError(f"no step {step} in {run_dir} after {timeout}s")


def ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def stopped_at(err: str, run_dir: Path, signame: str = "SIGTERM") -> int:
    """The step named by the preemption line; its checkpoint must verify."""
    lines = [ln for ln in err.splitlines() if "stopped by" in ln]
    assert lines, err[-3000:]
    m = re.search(rf"train.py: stopped by {signame} after step (\d+) of \d+: saved (\S+?)[;( ]", lines[-1])
    assert m, lines[-1]
    step = int(m[1])
    assert Path(m[2]) == ckpt(run_dir, step), lines[-1]
    assert "--resume" in lines[-1]
    assert checkpoint.read_meta(ckpt(run_dir, step))["step"] == step
    return step


def children(pid: int) -> dict[int, int]:
    """{RANK: pid} of torchrun's workers (its direct children)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        rank = next((int(v[5:]) for v in environ if v.startswith(b"RANK=")), None)
        if ppid == pid and rank is not None:
            out[rank] = int(entry.name)
    return out


SIX = [*TINY_MODEL, "--steps", "6", "--checkpoint.every", "2"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """One uninterrupted in-process run of SIX (async saves give the same losses)."""
    run = tmp_path_factory.mktemp("base") / "run"
    assert main([*SIX, "--run-dir", str(run)]) == 0
    return run


def one_error(capsys, rc: int, want_rc: int) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == want_rc and len(err) == 1 and err[0].startswith("train.py: error: "), (rc, err)
    return err[0]


# ---------------------------------------------------------------------------------------------------
# Preemption: SIGTERM / SIGINT
# ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_saves_at_the_step_boundary_and_resume_is_bitwise(tmp_path, capsys):
    """A real SIGTERM (twice, as Slurm plus torchrun's agent would send it) to `python tools/train.py`;
    meanwhile a second trainer on the same run dir is refused, naming the first."""
    flags = [*TINY_MODEL, "--steps", "100", "--checkpoint.every", "0"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    first = launch([TRAIN, *flags, "--run-dir", run], tmp_path / "first")
    wait_for_step(run, 3, first)

    line = one_error(capsys, main([*flags, "--run-dir", str(run)]), 2)
    assert f"--run-dir {run}: in use by another trainer (pid {first.pid} on host {socket.gethostname()}" in line

    first.send_signal(signal.SIGTERM)
    first.send_signal(signal.SIGTERM)  # a second one must not cut the save short
    assert first.wait(60) == 143, text(tmp_path / "first", "err")[-3000:]
    err = text(tmp_path / "first", "err")
    assert "Traceback" not in err, err
    step = stopped_at(err, run)
    assert 3 <= step < 100 and [r["step"] for r in metrics(run)] == list(range(1, step + 1))
    assert (run / runlock.LOCK_FILE).read_text() == ""  # released

    again = launch([TRAIN, *flags, "--run-dir", run, "--resume"], tmp_path / "again")
    assert again.wait(120) == 0, text(tmp_path / "again", "err")[-3000:]
    assert f"resumed from {ckpt(run, step)} at step {step}" in text(tmp_path / "again", "out")
    reference = run_trainer([*flags, "--run-dir", str(ref)], env=env())  # a forked rank: no torch import of its own
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert same(run) == same(ref)  # bitwise


@pytest.mark.slow
def test_torchrun_sigterm_to_one_rank_then_to_the_agent(tmp_path):
    """SIGTERM to rank 1 alone: both ranks agree, save and exit 143, torchrun --max-restarts restarts them
    and --resume auto continues. Then SIGTERM to the agent, which forwards it to every worker: they save
    and exit, and a new launch finishes the run. The records equal an uninterrupted run's bit for bit."""
    if not Path("/proc").is_dir():
        pytest.skip("finds torchrun's workers in /proc (Linux)")
    ref, run = tmp_path / "ref", tmp_path / "run"
    steps = ["--steps", "60", "--checkpoint.every", "0"]
    job = torchrun(run, tmp_path / "job", *steps)
    wait_for_step(run, 3, job)
    workers = children(job.pid)
    assert sorted(workers) == [0, 1], workers
    os.kill(workers[1], signal.SIGTERM)
    first = None
    end = time.monotonic() + 120
    while first is None and time.monotonic() < end:  # the restarted attempt announces its checkpoint
        m = re.search(r"resumed from \S+step_(\d+) at step", text(tmp_path / "job", "out"))
        first = int(m[1]) if m else None
        assert job.poll() is None, text(tmp_path / "job", "err")[-3000:]
        time.sleep(0.02)
    assert first is not None
    assert stopped_at(text(tmp_path / "job", "err"), run) == first
    assert "exitcode: 143" in text(tmp_path / "job", "err")  # torchrun saw the preempted ranks and restarted

    wait_for_step(run, first + 3, job)
    job.send_signal(signal.SIGTERM)  # the agent: it forwards SIGTERM to both workers
    assert job.wait(60) != 0  # torchrun ends itself with SignalException
    second = stopped_at(text(tmp_path / "job", "err"), run)
    assert first + 3 <= second < 60

    rest = torchrun(run, tmp_path / "rest", *steps)
    assert rest.wait(180) == 0, text(tmp_path / "rest", "err")[-3000:]
    assert f"at step {second}" in text(tmp_path / "rest", "out")
    # the uninterrupted reference on forked ranks (tests.dist_utils.run_trainer: torchrun's environment, no
    # interpreters importing torch); its losses are those of ranks that torchrun starts
    reference = run_trainer([*EP2, "--run-dir", str(ref), "--resume", "auto", *steps], 2, env=env())
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert [r["step"] for r in metrics(run)] == list(range(1, 61))
    assert same(run) == same(ref)  # bitwise


@pytest.mark.parametrize("async_save,first", [("false", signal.SIGUSR1), ("true", signal.SIGTERM)])
def test_signal_during_a_save_corrupts_nothing(base, tmp_path, capsys, monkeypatch, async_save, first):
    """Deterministic, in-process: a stop signal at step 3 (SIGUSR1: Slurm's --signal warning; SIGTERM), a
    second one in the middle of the preemption save. With async saves the step-2 save is still in flight
    when the stop comes; both end sealed."""
    flags = [*SIX, "--checkpoint.async_save", async_save]
    run = tmp_path / "run"
    real_inject, real_write = faults.inject_fault, FileSystemWriter.write_data

    def signal_at_step_3(run_dir, step, rank):
        if step == 3:
            os.kill(os.getpid(), first)
        real_inject(run_dir, step, rank)

    def signal_while_writing_step_3(self, *args, **kwargs):
        if "step_000003" in str(self.path):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs in the main thread (sync save: this one)
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(faults, "inject_fault", signal_at_step_3)
    monkeypatch.setattr(FileSystemWriter, "write_data", signal_while_writing_step_3)
    before = [signal.getsignal(s) for s in faults.STOP_SIGNALS]
    capsys.readouterr()
    assert main([*flags, "--run-dir", str(run)]) == 128 + first
    err = capsys.readouterr().err
    assert stopped_at(err, run, first.name) == 3 and "(1 more signal ignored while stopping)" in err
    assert [signal.getsignal(s) for s in faults.STOP_SIGNALS] == before  # handlers restored
    assert [p.name for p in checkpoint.list_checkpoints(run)] == ["step_000002", "step_000003"]
    monkeypatch.undo()
    assert main([*flags, "--run-dir", str(run), "--resume"]) == 0
    assert same(run) == same(base)


# ---------------------------------------------------------------------------------------------------
# Stalls: nothing waits longer than --layout.timeout_s (+ a grace)
# ---------------------------------------------------------------------------------------------------

STALL = """
import os, sys, time
from pathlib import Path
from torch.distributed.checkpoint import FileSystemWriter

real = FileSystemWriter.write_data

def write_data(self, *args, **kwargs):  # a rank whose checkpoint write hangs (a stuck filesystem)
    if os.environ["RANK"] == "1" and "step_000002" in str(self.path):
        Path(os.environ["STALL_MARKER"]).touch()
        time.sleep(3600)
    return real(self, *args, **kwargs)

FileSystemWriter.write_data = write_data
from moekit.train.loop import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_stalled_rank_in_an_async_save_fails_within_the_timeout(tmp_path):
    """Rank 1's background write of the step-2 checkpoint hangs. Rank 0's save waits for it on the async
    save's gloo group, which must time out after --layout.timeout_s (not torch's 30 minutes): it exits 1
    with one line, and rank 1, whose thread cannot be stopped, gives up on it after timeout + grace."""
    timeout, grace = 5, checkpoint.JOIN_GRACE_S
    script, run, marker = tmp_path / "stall.py", tmp_path / "run", tmp_path / "stalled"
    script.write_text(STALL)
    port = str(free_port())
    flags = [*EP2, "--steps", "6", "--checkpoint.every", "2", "--checkpoint.async_save", "true", "--layout.timeout_s",
             str(timeout), "--run-dir", run]
    ranks = [launch([script, *flags], tmp_path / f"rank{r}", RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                    LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, STALL_MARKER=str(marker))
             for r in (0, 1)]
    try:
        end = time.monotonic() + 120
        while not marker.exists():
            assert time.monotonic() < end and all(p.poll() is None for p in ranks), text(tmp_path / "rank0", "err")
            time.sleep(0.01)
        stalled = time.monotonic()
        assert ranks[0].wait(timeout + grace + 10) == 1
        took = time.monotonic() - stalled
        err = [ln for ln in text(tmp_path / "rank0", "err").splitlines() if "error" in ln]
        assert len(err) == 1 and "Traceback" not in text(tmp_path / "rank0", "err"), err
        assert (f"checkpoint of step 2 could not be written to {run}/checkpoints/step_000002.partial: another rank "
                f"did not take part within --layout.timeout_s={timeout} s") in err[0]
        assert "no earlier checkpoint of this run" in err[0]
        assert f"where the ranks were ({run}/stalls/, every thread's stack): " in err[0]  # moekit.train.stalls
        assert " in write_data" in (run / "stalls" / "rank_00001.txt").read_text()  # rank 1's stuck writer thread
        assert took <= timeout + grace + 5, took  # torch's default would be 30 minutes
        assert ranks[1].wait(2 * timeout + grace + 15) == 1  # exits although its save thread still hangs
        assert f"was not written within --layout.timeout_s={timeout} s + {grace:g} s" in text(tmp_path / "rank1", "err")
        assert not checkpoint.list_checkpoints(run)  # nothing unsealed passes for a checkpoint
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()


# ---------------------------------------------------------------------------------------------------
# The run directory's lock
# ---------------------------------------------------------------------------------------------------

HOLD = """
import sys, time
from moekit.train import runlock
runlock.RunLock.acquire(sys.argv[1])
print("locked", flush=True)
time.sleep(600)
"""


def test_lock_of_a_killed_trainer_does_not_block(tmp_path, capsys):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], env=env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        flags = [*TINY_MODEL, "--steps", "2", "--run-dir", str(run)]
        line = one_error(capsys, main(flags), 2)
        assert f"--run-dir {run}: in use by another trainer (pid {holder.pid} on host" in line
        assert "choose another --run-dir" in line
        assert sorted(p.name for p in run.iterdir()) == [runlock.LOCK_FILE]  # refused before touching anything
        holder.kill()  # SIGKILL: the lock file stays, naming a dead process; the kernel dropped the lock
        holder.wait()
        assert f"pid {holder.pid}" in (run / runlock.LOCK_FILE).read_text()
        assert main(flags) == 0
        assert [r["step"] for r in metrics(run)] == [1, 2]
        assert (run / runlock.LOCK_FILE).read_text() == ""
    finally:
        holder.kill()
        holder.wait()


# ---------------------------------------------------------------------------------------------------
# Full disks and unwritable paths
# ---------------------------------------------------------------------------------------------------


def no_space(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.mark.parametrize("async_save", ["false", "true"])
def test_full_disk_during_a_save_names_the_path_and_what_was_kept(base, tmp_path, capsys, monkeypatch, async_save):
    flags = [*SIX, "--checkpoint.async_save", async_save]
    run = tmp_path / "run"
    real_write = FileSystemWriter.write_data

    def disk_full_at_step_4(self, *args, **kwargs):
        if "step_000004" in str(self.path):
            raise no_space(Path(self.path) / "__0_0.distcp")
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "write_data", disk_full_at_step_4)
    capsys.readouterr()
    line = one_error(capsys, main([*flags, "--run-dir", str(run)]), 1)
    partial = ckpt(run, 4).with_name("step_000004.partial")
    assert (f"checkpoint of step 4 could not be written to {partial}: No space left on device "
            f"({partial}/__0_0.distcp); removed the unfinished save; newest checkpoint kept: {ckpt(run, 2)}") in line
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000002"]
    monkeypatch.undo()
    assert main([*flags, "--run-dir", str(run), "--resume"]) == 0
    assert same(run) == same(base)


def test_full_disk_for_the_records_is_one_line(tmp_path, capsys, monkeypatch):
    real_open = open

    class Full:  # metrics.jsonl on a disk that fills up at step 3
        def __init__(self, f):
            self.f = f

        def write(self, s):
            if '"step":3,' in s:
                raise no_space("")  # a buffered write's error names no file
            return self.f.write(s)

        def __getattr__(self, name):
            return getattr(self.f, name)

    def fake_open(path, *args, **kwargs):
        f = real_open(path, *args, **kwargs)
        return Full(f) if str(path).endswith(records.METRICS) else f

    monkeypatch.setattr(records, "open", fake_open, raising=False)
    run = tmp_path / "run"
    line = one_error(capsys, main([*TINY_MODEL, "--steps", "4", "--checkpoint.every", "2", "--run-dir", str(run)]), 1)
    assert (f"No space left on device ({run / records.METRICS}) at step 3; newest checkpoint: {ckpt(run, 2)} "
            f"(--resume continues from it)") in line


def test_unwritable_run_dir_or_export_dir_is_refused_before_training(tmp_path, capsys, monkeypatch):
    real_open = os.open
    denied = tmp_path / "denied"

    def deny(path, *args, **kwargs):
        if Path(path).is_relative_to(denied):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(runlock.os, "open", deny)
    flags = [*TINY_MODEL, "--steps", "2"]
    line = one_error(capsys, main([*flags, "--run-dir", str(denied / "run")]), 2)
    assert f"--run-dir {denied / 'run'}: not writable: Permission denied ({denied / 'run'}/" in line
    run, export = tmp_path / "run", denied / "a" / "hf"
    line = one_error(capsys, main([*flags, "--run-dir", str(run), "--export-hf", str(export)]), 2)
    assert f"--export-hf {export}: not writable: Permission denied" in line and "choose another --export-hf" in line
    assert not denied.exists() and not run.exists()  # refused before training, and nothing left behind
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"not a token file" * 4)
    one_error(capsys, main([*flags, "--run-dir", str(run), "--data.path", str(bad)]), 2)
    assert not run.exists()  # a setup failure after the lock was taken leaves no run dir either


def test_read_only_run_dir_with_chmod(tmp_path, capsys):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        try:
            (parent / "x").touch()
            pytest.skip("chmod does not stop this user's writes (root): the monkeypatched test covers it")
        except PermissionError:
            pass
        line = one_error(capsys, main([*TINY_MODEL, "--steps", "2", "--run-dir", str(parent / "run")]), 2)
        assert f"--run-dir {parent / 'run'}: not writable: Permission denied" in line
    finally:
        parent.chmod(0o700)


def test_failed_export_keeps_the_final_checkpoint_and_says_how_to_export_it(tmp_path, capsys, monkeypatch):
    pytest.importorskip("safetensors")
    import moekit.models.hf as hf

    run, out = tmp_path / "run", tmp_path / "hf"

    def full_disk(model, path, **kwargs):
        raise no_space(Path(path) / "model.safetensors")

    monkeypatch.setattr(hf, "save_hf_sharded", full_disk)
    flags = [*TINY_MODEL, "--steps", "3", "--checkpoint.every", "0", "--run-dir", str(run)]
    line = one_error(capsys, main([*flags, "--export-hf", str(out)]), 1)
    final = ckpt(run, 3)  # saved before the export although checkpoint.every is 0
    assert (f"--export-hf {out}: No space left on device ({out}/model.safetensors); training finished and its final "
            f"checkpoint is {final}") in line
    checkpoint.read_meta(final)
    monkeypatch.undo()
    command = line.split("export it with ", 1)[1].split()
    assert command[:2] == ["train.py", "--resume"]
    assert main([*TINY_MODEL, "--run-dir", str(run), *command[1:]]) == 0  # the command the line gives works
    assert (out / "config.json").is_file()
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]


def test_write_data_to_a_bad_path_is_one_line(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "no" / "such" / "dir" / "tokens.bin"
    line = one_error(capsys, main(["--write-data", str(missing)]), 2)
    assert f"--write-data {missing}: cannot write it: No such file or directory" in line
    out = tmp_path / "tokens.bin"

    def full(path, tokens, vocab):
        Path(path).write_bytes(b"partial")
        raise no_space(path)

    monkeypatch.setattr("moekit.train.tokens.write_token_file", full)
    line = one_error(capsys, main(["--write-data", str(out)]), 2)
    assert f"--write-data {out}: cannot write it: No space left on device" in line
    assert not list(tmp_path.glob("tokens.bin*"))  # no truncated token file left behind
