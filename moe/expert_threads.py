"""CPU: independent experts computed concurrently, one thread each, for the loop backend (issue 19).

Shape legend: N routed rows (expert-major), E experts, H hidden, F expert FFN width.

Why: a fine-grained expert's GEMMs are small (~512 x 256 x 256) and MKL splits each of them across its
threads poorly, so the per-expert loop leaves cores idle between and inside the GEMMs. Running whole
experts concurrently, each on a thread whose torch / OpenMP / MKL width is 1, keeps every core on its own
GEMM. Measured with tools/bench/expert_threads.py (docs/benchmarks.md, issue 19).

How, in PyTorch: ``torch.set_num_threads`` called on a thread sets that thread's OpenMP and MKL width
(thread-local ICVs) and, as a side effect, torch's process-wide default for threads initialised later. The
pool's workers call it with 1 once (after torch's lazy per-thread init), then the creating thread restores
the default. torch releases the
GIL inside every operator, so the workers' GEMMs run in parallel; Python only schedules between them.

Determinism: every expert's work is the same single-threaded calls on its own slices whichever worker
runs it, so results do not depend on the scheduling. The sequential loop (``workers == 1``) stays the
reference; ``expert_threads(1)`` forces it.

    experts, biggest first:  e3 e0 e7 e1 ...   (a shared queue: longest-job-first balances ragged counts)
    worker 0 (1 thread)      e3 ----- e1 --- ...
    worker 1 (1 thread)      e0 --- e7 ---- ...
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import Tensor

# Experts in parallel win over MKL's threads inside each GEMM only for small GEMMs with a wide enough
# hidden size. Measured on an idle 2-core box (tools/bench/expert_threads.py, docs/benchmarks.md issue 19),
# sequential / parallel fwd+bwd: H 256 with per-expert GEMMs (rows per expert * H * F_in) up to 1.3e8 gained
# (E 64 x F 128 1.10, E 16 x F 512 1.09, bf16 fine 1.3x), E 8 x F 512 (2.7e8) lost (0.92); every H 128
# shape lost (E 8 x F 256, the README main job's, 0.83; E 16 x F 256 0.84; E 32 x F 128 0.95): MKL's
# second thread still scales those [~1024, 128] x [128, n] GEMMs almost 2x.
_SMALL_GEMM_MACS = 1 << 28
_MIN_HIDDEN = 256
_local = threading.local()  # per calling thread: the expert_threads() override
_pool_lock = threading.Lock()
_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, workers, executor)


@contextmanager
def expert_threads(workers: int | None) -> Iterator[None]:
    """Within the block (this thread only), the CPU loop backend uses ``workers`` threads; 1 = the
    sequential reference loop, None = choose by shape (the default)."""
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise ValueError(f"expert_threads(workers={workers!r}) is invalid; use a positive integer or None")
    before = getattr(_local, "workers", None)
    _local.workers = workers
    try:
        yield
    finally:
        _local.workers = before


def choose_workers(rows: Tensor, w_in: Tensor, sizes: list[int]) -> int:
    """How many threads compute the experts of ``rows``: 1 (the sequential loop) or torch's thread count.

    Chosen from the static shape, never from the counts' values, so one shape always takes one path:
    CPU, more than one torch thread, at least two experts per thread (so the queue can balance), and
    small GEMMs over a wide hidden size: N / E * H * F_in below ``_SMALL_GEMM_MACS`` with H at least
    ``_MIN_HIDDEN``, where MKL gains little from its threads (measured, above)."""
    override = getattr(_local, "workers", None)
    if override is not None:
        return override
    if rows.device.type != "cpu":
        return 1
    threads = torch.get_num_threads()
    E, H, f_in = w_in.shape
    if threads < 2 or E < 2 * threads or len(sizes) != E or H < _MIN_HIDDEN:
        return 1
    return threads if rows.shape[0] // E * H * f_in < _SMALL_GEMM_MACS else 1


def _one_thread() -> None:
    """A worker's initializer. torch initialises a thread's width lazily, from the process-wide default,
    on its first parallel op: trigger that first, or it would later undo the set_num_threads(1)."""
    torch.get_num_threads()
    torch.set_num_threads(1)


def _executor(workers: int) -> ThreadPoolExecutor:
    """The pool of ``workers`` single-threaded workers (created once per process and size)."""
    global _pool
    with _pool_lock:
        if _pool is not None and _pool[:2] == (os.getpid(), workers):
            return _pool[2]
        if _pool is not None and _pool[0] == os.getpid():
            _pool[2].shutdown(wait=False)  # a forked child must not touch its parent's (absent) threads
        default = torch.get_num_threads()
        pool = ThreadPoolExecutor(workers, thread_name_prefix="moekit-experts", initializer=_one_thread)
        started = threading.Barrier(workers, timeout=60)
        for f in [pool.submit(started.wait) for _ in range(workers)]:  # every worker up and set to 1 thread
            f.result()
        torch.set_num_threads(default)  # the initializer also changed the default for threads made later
        _pool = (os.getpid(), workers, pool)
        return pool


def for_each_expert(sizes: list[int], body: Callable, workers: int, scratch: Callable[[], object] = lambda: None):
    """``body(e, start, n, buffers)`` for every expert with n = sizes[e] > 0 rows starting at ``start``.

    ``scratch()`` makes one worker's reusable buffers (called once per worker). ``body`` must write only
    expert e's own slices: with ``workers`` > 1 experts run concurrently, biggest first, in no fixed order.
    The bodies run outside autograd (they write with ``out=``), in inference mode when the caller is.
    """
    starts, s = [], 0
    for n in sizes:
        starts.append(s)
        s += n
    if workers <= 1:
        buffers = scratch()
        for e, n in enumerate(sizes):
            if n:
                body(e, starts[e], n, buffers)
        return
    queue = iter(sorted((e for e, n in enumerate(sizes) if n), key=lambda e: -sizes[e]))
    lock, inference = threading.Lock(), torch.is_inference_mode_enabled()

    def work() -> None:
        buffers = scratch()
        with torch.inference_mode(inference), torch.no_grad():
            while True:
                with lock:
                    e = next(queue, None)
                if e is None:
                    return
                body(e, starts[e], sizes[e], buffers)

    pool = _executor(workers)
    for f in [pool.submit(work) for _ in range(workers)]:
        f.result()  # re-raises a worker's exception here
