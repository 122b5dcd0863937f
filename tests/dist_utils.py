"""Run a function on N real processes over gloo (CPU). Assertions inside ranks fail the test."""
from __future__ import annotations

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


def run_ranks(fn, world_size: int, *args, env: dict | None = None) -> None:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)``; re-raise any rank's error."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        mp.start_processes(_entry, args=(fn, world_size, init_file, env or {}, args), nprocs=world_size,
                           join=True, start_method="spawn")
