"""Stall reports (moekit.train.stalls): a rank without progress for --layout.timeout_s writes every thread's stack, a
later progress marks that dump as a slow phase, and a collective that times out names where each rank was: a real
two-rank run with one rank hung by the fault drill, and the report parser on hand-made reports."""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from moekit.train import stalls
from tests.dist_utils import run_trainer
from tests.tiny import TINY_MODEL

ROOT = stalls._PACKAGE_ROOT  # the installed package's files (a checkout elsewhere may run these tests)


def _sleep_here(seconds: float) -> None:
    time.sleep(seconds)


def test_a_rank_without_progress_writes_its_stacks_and_progress_marks_them_a_slow_phase(tmp_path):
    watch = stalls.StallWatch(tmp_path, 3, 0.3)
    path = stalls.report_path(tmp_path, 3)
    try:
        assert path.read_text().startswith("moekit stall report: rank 3, pid ")
        assert stalls.main_thread_location(path.read_text()) is None  # no dump yet
        _sleep_here(0.9)
        text = path.read_text()
        assert "Timeout (" in text and " in _sleep_here" in text
        where = stalls.main_thread_location(text)  # the innermost frame: moekit's own come first, this is not one
        assert where.startswith("tests/test_stalls.py:") and where.endswith("(_sleep_here)"), where
        watch.pet()  # progress: that dump was a slow phase, not a stall
        assert stalls.main_thread_location(path.read_text()) is None
        _sleep_here(0.9)  # and a second stall is reported again
        assert stalls.main_thread_location(path.read_text()).endswith("(_sleep_here)")
        assert path.read_text().count(stalls.RESUMED.strip()) == 1
    finally:
        watch.close()
    assert path.exists()  # it holds dumps: kept as the record
    quiet = stalls.StallWatch(tmp_path / "quiet", 0, 30.0)
    quiet.pet()
    quiet.close()
    assert not (tmp_path / "quiet" / stalls.DIR).exists()  # never a dump: nothing left behind
    off = stalls.StallWatch(tmp_path / "off", 0, 30.0, enabled=False)  # one process: no watchdog
    off.pet()
    off.close()
    assert not (tmp_path / "off").exists()


def _report(folder: Path, rank: int, main: int, frames_by_thread: dict[int, list[tuple[str, int, str]]],
            resumed: bool = False) -> None:
    lines = [stalls.HEADER.format(rank=rank, pid=100 + rank, ident=main).rstrip("\n"), "Timeout (0:00:05)!"]
    for ident, frames in frames_by_thread.items():
        lines.append(f"Thread 0x{ident:016x} (most recent call first):")
        lines += [f'  File "{path}", line {line} in {func}' for path, line, func in frames]
        lines.append("")
    if resumed:
        lines.append(stalls.RESUMED.rstrip("\n"))
    path = stalls.report_path(folder, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def test_the_summary_names_the_odd_rank_out_first(tmp_path):
    """Hand-made reports of 4 ranks: three in the same collective (under torch's frames), one in a data read; a
    save thread's stack is not the main thread's; a report whose dump was followed by progress counts as none."""
    own = str(ROOT / "train" / "distributed.py")
    torch_c10d = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
    waiting = [(torch_c10d, 2950, "all_reduce"), (own, 215, "any_nonfinite"), (str(ROOT / "train" / "trainer.py"),
                                                                                 460, "loop")]
    for rank in (0, 2, 3):
        _report(tmp_path, rank, 0x10 + rank, {0x99: [("/usr/lib/python3.11/threading.py", 320, "wait")],
                                              0x10 + rank: waiting})
    _report(tmp_path, 1, 0x11, {0x11: [(str(ROOT / "train" / "data.py"), 212, "read_windows"), *waiting[2:]]})
    got = stalls.summarize(tmp_path, 4, wait_s=0)
    assert got.startswith(f"where the ranks were ({tmp_path / stalls.DIR}/, every thread's stack): ")
    assert got.endswith("rank 1: train/data.py:212 (read_windows); ranks 0, 2, 3: train/distributed.py:215 "
                        "(any_nonfinite) in distributed/distributed_c10d.py:2950 (all_reduce)"), got
    _report(tmp_path, 2, 0x12, {0x12: waiting}, resumed=True)  # rank 2 went on after its dump
    got = stalls.summarize(tmp_path, 5, wait_s=0.2)
    assert "ranks 0, 3: " in got and got.endswith("; 2 rank(s) wrote no report here")
    assert stalls.summarize(tmp_path / "none", 2, wait_s=0) is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forked ranks")
def test_a_hung_rank_is_named_when_the_collective_times_out(tmp_path):
    """Two ranks, rank 1 hung at the start of step 3 by the fault drill: rank 0's all-reduce times out after
    --layout.timeout_s and its one-line error names where both ranks were: rank 1 in the drill's hang, rank 0 in the
    step's all-reduce; rank 1's report holds every thread's stack."""
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MOEKIT_FAULT_EXIT_AT_STEP": "3",
           "MOEKIT_FAULT_RANK": "1", "MOEKIT_FAULT_ACTION": "hang"}
    env.pop("WORLD_SIZE", None)
    started = time.monotonic()
    r = run_trainer([*TINY_MODEL, "--steps", "6", "--ep", "2", "--checkpoint.every", "2", "--log.progress", "off",
                     "--layout.timeout_s", "6", "--run-dir", str(run)], 2, env=env, timeout=120)
    took = time.monotonic() - started
    assert r.returncode == 1, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if " error: " in line]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line = errors[0]
    assert "rank 0: a collective failed at step 3" in line and "newest checkpoint: " in line, line
    where = re.search(r"where the ranks were \((.+?)/, every thread's stack\): (.*)$", line)
    assert where and where[1] == str(run / stalls.DIR), line
    # the hung rank first (outside any collective), then rank 0 inside the step's first collective (the MoE layer's)
    assert re.fullmatch(r"rank 1: train/faults\.py:\d+ \(hang\); rank 0: (comm|train|moe)/\S+\.py:\d+ \(\w+\) in "
                        r"distributed/distributed_c10d\.py:\d+ \(\w+\)", where[2]), where[2]
    assert (run / "checkpoints" / "step_000002").is_dir()
    report = stalls.report_path(run, 1).read_text()
    assert " in hang" in report and " in inject_fault" in report and " in loop" in report
    assert took < 60, took  # bounded by the timeout, not by torch's 30 minutes


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forked ranks")
def test_a_rank_hung_in_set_up_is_named_when_the_checkpoint_load_times_out(tmp_path):
    """Resuming two ranks, rank 1 hung just before the checkpoint load (the drill's 'resume' point): rank 0 waits in
    the load's collectives, and after --layout.timeout_s its one-line error says the set-up failed and where each
    rank was, rank 1 in the drill's hang."""
    run = tmp_path / "run"
    flags = [*TINY_MODEL, "--ep", "2", "--checkpoint.every", "2", "--log.progress", "off", "--layout.timeout_s", "6",
             "--run-dir", str(run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    r = run_trainer([*flags, "--steps", "2"], 2, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    env.update({"MOEKIT_FAULT_EXIT_AT_STEP": "resume", "MOEKIT_FAULT_RANK": "1", "MOEKIT_FAULT_ACTION": "hang"})
    started = time.monotonic()
    r = run_trainer([*flags, "--steps", "4", "--resume"], 2, env=env, timeout=120)
    took = time.monotonic() - started
    assert r.returncode == 1, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if " error: " in line]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line = errors[0]
    assert "rank 0: a collective failed while the run set up (building the model, loading its checkpoint)" in line, line
    where = re.search(r"where the ranks were \((.+?)/, every thread's stack\): (.*)$", line)
    assert where and re.match(r"rank 1: train/faults\.py:\d+ \(hang\); rank 0: ", where[2]), line
    assert " in checkpoint" not in line or "train/checkpoint.py" in where[2]
    report = stalls.report_path(run, 1).read_text()
    assert " in hang" in report and " in inject_fault" in report and " in build" in report
    assert "before loading the checkpoint" in (run / ".fault_injected").read_text()
    assert took < 60, took
