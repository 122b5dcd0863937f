"""Shared benchmark plumbing: timing, environment record, table printing, JSON output."""
from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import time
from pathlib import Path
from typing import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(fns: dict[str, Callable[[], object]], device: torch.device, warmup: int = 2,
                     repeats: int = 10, rotate: bool = False) -> dict[str, dict]:
    """Median / min / max milliseconds of each peer, run round-robin (a, b, c, a, b, c, ...) so that
    background load and clock drift hit every peer alike: the ratios between peers are what we report.

    rotate: each round starts one peer later (a, b, c; b, c, a; ...), with at least one round per peer. On
    CPU the peer that runs right after another one's large frees pays the page faults of re-growing the
    heap, which a fixed order would always charge to the same peer."""
    names = list(fns)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in names}
    rounds = max(repeats, len(names)) if rotate and repeats > 1 else repeats
    for r in range(rounds):
        shift = r % len(names) if rotate else 0
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            fns[name]()
            sync(device)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: {"median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t), "repeats": len(t)}
            for name, t in times.items()}


def environment(device: torch.device) -> dict:
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def minor_faults() -> int:
    """This process's minor page faults so far (all threads): memory the kernel mapped in on first touch. Under
    glibc's defaults a tensor of 32 MiB or more costs ~8k of them each time it is allocated and written
    (moekit.train.host_memory); unlike a time, the count does not depend on what else the machine is doing."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format spec). Missing values print as '-'."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([format(r[k], f) if r.get(k) is not None else "-" for k, _, f in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for i, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def write_json(path: str | os.PathLike, payload: dict, quiet: bool = False) -> None:
    """Write ``payload``; benchmarks also call this after every case with ``"partial": True`` (quiet), so
    a run stopped by a time limit keeps what it measured."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    if not quiet:
        print(f"wrote {path}")


def time_events(fns: dict[str, Callable[[], object]], device: torch.device, warmup: int = 2,
                repeats: int = 10) -> dict[str, dict]:
    """Like ``time_interleaved`` (round-robin), but on CUDA each call is timed with device events and
    the host synchronises once per round, not per call: sub-millisecond kernels (a gather, a copy)
    are then measured without the ~10-20 us of a host sync and launch gap each. CPU: perf_counter.

    Fairness: right after the sync the GPU is idle, so whichever call comes first in a round would
    have its host-side launch time counted while the others' hides behind queued work. Each round
    therefore starts with a short device-side sleep (the queue runs ahead of the host) and rotates
    the order, so no peer is always first."""
    if device.type != "cuda":
        return time_interleaved(fns, device, warmup, repeats)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    sleep = getattr(torch.cuda, "_sleep", None)  # spins the GPU for a number of cycles (~0.1 ms here)
    for r in range(repeats):
        marks = []
        if sleep is not None:
            sleep(200_000)
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[name]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            marks.append((name, start, end))
        torch.cuda.synchronize(device)
        for name, start, end in marks:
            times[name].append(start.elapsed_time(end))
    return {name: {"median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t), "repeats": repeats}
            for name, t in times.items()}


def guarded(fn: Callable[[], object]) -> tuple[object, str | None]:
    """(fn(), None), or (None, 'ErrorType: message') when it raises: one peer that cannot run on this
    machine (an older torch, a missing transformers) must not end a run that costs GPU time."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON and printed, never swallowed silently
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def add_timing_args(p, out: str, warmup: int = 2, repeats: int = 10) -> None:
    """The flags every single-device benchmark shares: device, dtype, warm-up, repeats, seed, JSON path."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=out)


def init_bench_process(rank: int, world: int, init_file: str | None, threads: int = 1) -> torch.device:
    """Join a multi-rank benchmark's process group and return this rank's device. ``init_file`` set: a rank
    spawned on CPU (gloo over that file, ``threads`` torch threads); None: a rank started by torchrun (NCCL on
    its LOCAL_RANK's GPU when there is one, else gloo; ``rank`` and ``world`` come from its environment)."""
    from datetime import timedelta

    import torch.distributed as dist

    if init_file:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))
        return torch.device("cpu")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=300))
    if backend == "gloo":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return device


def launch_ranks(worker: Callable, args, world: int) -> None:
    """Run ``worker(rank, world, args, init_file)`` on every rank: under torchrun this process is one rank
    (init_file None: init_bench_process joins torchrun's group); otherwise spawn ``world`` CPU ranks that
    meet through a file in a temporary folder."""
    if "WORLD_SIZE" in os.environ:
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None)
        return
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_spawned_rank, args=(worker, world, args, os.path.join(tmp, "store")), nprocs=world,
                           start_method="spawn")


def _spawned_rank(rank: int, worker: Callable, world: int, args, init_file: str) -> None:
    """A spawned rank: the worker, then an end without interpreter finalization, which races gloo's worker
    threads (moekit.train.distributed.end_process). A worker that raised leaves through torch.multiprocessing,
    which reports its error."""
    from moekit.train.distributed import end_process

    worker(rank, world, args, init_file)
    end_process(0)
