"""Run a function on N real processes over gloo (CPU). Assertions inside ranks fail the test."""
from __future__ import annotations

import multiprocessing
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moekit.train.distributed import end_process


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
# server is started by the first run_ranks and keeps the environment of that moment; what a rank needs from
# its caller travels in ``env`` (applied in _entry), never through this process's os.environ. Where there is no
# fork server (Windows), ranks are spawned as fresh interpreters.
START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
if START == "forkserver":
    multiprocessing.get_context("forkserver").set_forkserver_preload([
        "torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp", "moekit.moe",
        "moekit.comm", "moekit.models", "moekit.train.trainer", "tests.dist_utils"])


def run_ranks(fn, world_size: int, *args, env: dict | None = None) -> None:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)``; re-raise any rank's error."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        mp.start_processes(_entry, args=(fn, world_size, init_file, env or {}, args), nprocs=world_size,
                           join=True, start_method=START)
