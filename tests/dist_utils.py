"""Run a function on N real processes over gloo (CPU). Assertions inside ranks fail the test."""
from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moekit.train.distributed import end_process
from tests import interpreter_speed

interpreter_speed.install()  # ranks fork from a server that imported this module: they inherit it


def _entry(rank: int, fn, world_size: int, init_file: str, env: dict, args: tuple):
    os.environ.update({"OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_RANK": str(rank), **env})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    # as the trainer's ranks do (moekit.train.distributed.owns_process_group): interpreter finalization
    # races gloo's worker threads and aborts the process now and then ("terminate called without an active
    # exception"). A rank that raised leaves through torch.multiprocessing, which has recorded its error.
    end_process(0)


# Ranks start from a fork server that has imported torch and moekit once for the whole test session: each rank
# then costs a fork instead of a fresh interpreter importing torch (~2 s of CPU per rank, on a 2-core box). The
# preload is everything a tiny training run imports (torch._dynamo, which the optimizer's constructor imports, the
# kernels and Triton, checkpoint I/O, ...): a forked rank's run of moekit-train then imports 0.15 s instead of 0.8 s.
# The server starts with the environment this module saw at import (conftest imports it at the session's start),
# whatever a test has changed when it starts ranks first: Triton's interpreter mode and moekit's switches read at
# import are the session's in every rank. What a rank needs from its caller travels in ``env`` (applied in _entry),
# never through this process's os.environ. Where there is no fork server (Windows), ranks are spawned as fresh
# interpreters.
START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
if START == "forkserver":
    multiprocessing.get_context("forkserver").set_forkserver_preload([
        "torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch._dynamo",
        "numpy.random", "safetensors.torch", "moekit.moe", "moekit.moe.kernels", "moekit.comm",
        "moekit.comm.expert_parallel", "moekit.models", "moekit.models.hf", "moekit.models.parallelize",
        "moekit.train.trainer", "moekit.train.loop", "moekit.train.modelsource", "moekit.train.planning",
        "moekit.train.profiling", "tests.dist_utils"])
_SERVER_ENV = dict(os.environ)


def _ensure_server() -> None:
    """Start the fork server (once; again if it died) under the session's environment (``_SERVER_ENV``)."""
    if START != "forkserver":
        return
    from multiprocessing import forkserver

    now = dict(os.environ)
    os.environ.clear()
    os.environ.update(_SERVER_ENV)
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(now)


def run_ranks(fn, world_size: int, *args, env: dict | None = None) -> None:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)``; re-raise any rank's error."""
    _ensure_server()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        mp.start_processes(_entry, args=(fn, world_size, init_file, env or {}, args), nprocs=world_size,
                           join=True, start_method=START)


TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "train.py"
TERM_GRACE_S = 30.0  # torchrun's default grace between SIGTERM and SIGKILL when it stops the ranks


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for MASTER_PORT / tcp:// rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer_entry(argv: list[str], env: dict, out_path: str, err_path: str) -> None:
    """One rank of run_trainer: the environment and output streams a rank under torchrun has, then
    moekit-train's main; the process ends with main's status."""
    for fd, path in ((1, out_path), (2, err_path)):
        sys.stdout.flush(), sys.stderr.flush()
        target = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [str(TRAIN_SCRIPT), *argv]
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    code = 1
    try:
        from moekit.train.loop import main

        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then the status
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_trainer(argv: list[str], nproc: int = 1, env: dict | None = None, timeout: float = 600,
                per_rank: bool = False) -> subprocess.CompletedProcess | list[subprocess.CompletedProcess]:
    """``tools/train.py *argv`` on ``nproc`` ranks (one process when 1) started from the fork server, each with
    the environment ``torchrun --standalone --nproc-per-node=nproc`` gives its ranks (RANK, LOCAL_RANK,
    WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT, ...) over ``env`` (default: this process's). A rank then
    costs a fork, not an interpreter that imports torch (with torchrun's agent, ~3 s of CPU each on the 2-core
    box). Tests of the launcher itself (restarts, signals, the agent) start the real torchrun, and compare its
    ranks' losses bit for bit with forked ones (tests/test_preemption.py).

    Default: as under torchrun, all ranks write to one stdout and one stderr, the first rank that fails stops
    the others (SIGTERM, SIGKILL past a grace), and the status is 0 when every rank returned 0, else the first
    failing rank's (torchrun would say 1). ``per_rank``: each rank its own streams and status, none stopped
    early, a list in rank order. Past ``timeout`` every rank is killed and subprocess.TimeoutExpired raised,
    as subprocess.run does."""
    base = dict(os.environ if env is None else env)
    base.setdefault("OMP_NUM_THREADS", "1")
    if START != "forkserver" and not per_rank:  # no fork server: fresh interpreters, as the user starts them
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd = (launch if nproc > 1 else [sys.executable]) + [str(TRAIN_SCRIPT), *argv]
        return subprocess.run(cmd, env=base, capture_output=True, text=True, timeout=timeout)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        base.pop(name, None)
    if nproc > 1:
        base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc),
                    LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(nproc),
                    TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                    TORCHELASTIC_RUN_ID=f"fork-{os.getpid()}-{time.monotonic_ns()}")
    ctx = multiprocessing.get_context(START)
    _ensure_server()
    cmd = ["moekit-train (forked ranks)", f"--nproc={nproc}", *argv]
    with tempfile.TemporaryDirectory() as tmp:
        streams = [(os.path.join(tmp, f"stdout{r}"), os.path.join(tmp, f"stderr{r}"))
                   for r in range(nproc if per_rank else 1)]
        for path in (p for pair in streams for p in pair):
            open(path, "w").close()
        procs = []
        for rank in range(nproc):
            rank_env = dict(base, **({"RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
                                     if nproc > 1 else {}))
            out_path, err_path = streams[rank if per_rank else 0]
            proc = ctx.Process(target=_trainer_entry, args=(list(argv), rank_env, out_path, err_path))
            proc.start()
            procs.append(proc)
        deadline, stop_by = time.monotonic() + timeout, None
        while any(proc.is_alive() for proc in procs) and time.monotonic() < deadline:
            if not per_rank and stop_by is None and any(proc.exitcode not in (None, 0) for proc in procs):
                stop_by = time.monotonic() + TERM_GRACE_S  # as torchrun's agent: a failed rank stops the others
                for proc in procs:
                    if proc.is_alive():
                        proc.terminate()
            if stop_by is not None and time.monotonic() > stop_by:
                break
            time.sleep(0.05)
        timed_out = stop_by is None and any(proc.is_alive() for proc in procs)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        texts = [tuple(Path(p).read_text(errors="replace") for p in pair) for pair in streams]
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=texts[0][0], stderr=texts[0][1])
    codes = [c if c >= 0 else 128 - c for c in (proc.exitcode for proc in procs)]  # -N (signal N): 128 + N
    if per_rank:
        return [subprocess.CompletedProcess(cmd, c, *texts[r]) for r, c in enumerate(codes)]
    return subprocess.CompletedProcess(cmd, next((c for c in codes if c), 0), *texts[0])


def fork_bench_ranks(worker, args, world: int) -> None:
    """A stand-in for moekit.bench.benchlib.launch_ranks whose ranks fork from this module's server (torch and moekit
    already imported) instead of being spawned as fresh interpreters (~3 s of CPU each): the same entry
    (benchlib._spawned_rank), file store and gloo group, the worker and its flags pickled across as a spawn pickles
    them. benchlib.launch_ranks' spawn itself runs in tests/test_upcycle.py's upcycle_memory bench."""
    from moekit.bench import benchlib

    _ensure_server()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(benchlib._spawned_rank, args=(worker, world, args, os.path.join(tmp, "store")),
                           nprocs=world, start_method=START)
