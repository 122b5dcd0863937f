"""Shared benchmark plumbing: timing, environment record, table printing, JSON output, and the checks of
the flags every script shares (device, counts, names, output paths), each a one-line error with exit status 2.

torch is imported inside the functions that use it, not here: suite_summary.py (run at the end of every GPU-suite
call) and heatmap_scale.py use this module's parser and checks without torch, which takes seconds to import."""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        import torch

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


def saved_bytes(fn: Callable[..., object], *args, **kwargs) -> int:
    """Bytes of every tensor autograd saves for backward while ``fn(*args, **kwargs)`` runs (saved-tensor hooks:
    the same count on CPU and GPU; a tensor saved twice counts twice)."""
    import torch

    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args, **kwargs)
    return total


def environment(device: torch.device) -> dict:
    import torch

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
    import torch

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
    """The flags every single-device benchmark shares: device, dtype, warm-up, repeats, seed, JSON path
    (check_timing_args checks them)."""
    import torch

    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default: cuda when there is a GPU)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--warmup", type=int, default=warmup, help=f"untimed calls per peer first (default {warmup})")
    p.add_argument("--repeats", type=int, default=repeats, help=f"timed calls per peer (default {repeats})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=out, help=f"the JSON results (default {out})")


class BenchParser(argparse.ArgumentParser):
    """argparse whose errors (its own and the scripts' ``p.error``) are one line on stderr,
    ``prog: error: message (see --help)``, and exit status 2: no usage block. ``prog`` defaults to the file name
    of the script that builds the parser, also when its main() is called from Python."""

    def __init__(self, *args, **kwargs):
        if not args and "prog" not in kwargs:
            caller = sys._getframe(1).f_globals.get("__file__")
            if caller:
                kwargs["prog"] = os.path.basename(caller)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        fail(self.prog, f"{message} (see --help)")


def fail(prog: str, message: str):
    """Print ``prog: error: message`` as one line on stderr and exit with status 2 (bad input)."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(2)


def check_device(p, name: str, flag: str = "--device") -> torch.device:
    """The device ``name`` names; a usage error (p.error) for a name torch does not parse, a device other than
    cpu / cuda, or a CUDA device this machine does not have."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        p.error(f"{flag} {name!r}: not a device; use cpu, cuda or cuda:N")
    if device.type not in ("cpu", "cuda"):
        p.error(f"{flag} {name}: the benchmarks run on cpu or cuda only; use one of those")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            p.error(f"{flag} {name}: this machine has no CUDA GPU (torch.cuda.is_available() is False); "
                    "use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            p.error(f"{flag} {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s); "
                    f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device


def check_at_least(p, args, minimum: int, *names: str) -> None:
    """A usage error naming the flag and value when an ``args`` attribute in ``names`` (or an item of a list
    one) is below ``minimum``; None (a flag left unset) passes."""
    for name in names:
        value = getattr(args, name)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and v < minimum:
                p.error(f"--{name.replace('_', '-')} {v}: must be >= {minimum}")


def check_positive(p, args, *names: str) -> None:
    """A usage error naming the flag and value when an ``args`` attribute in ``names`` (a number) is not > 0;
    None (a flag left unset) passes."""
    for name in names:
        value = getattr(args, name)
        if value is not None and not value > 0:  # NaN too
            p.error(f"--{name.replace('_', '-')} {value}: must be > 0")


def check_names(p, flag: str, values, allowed) -> None:
    """A usage error naming the unknown items of ``values`` and listing ``allowed``."""
    unknown = [v for v in values if v not in allowed]
    if unknown:
        p.error(f"{flag} {' '.join(map(str, unknown))}: unknown; choose from {', '.join(map(str, allowed))}")


def check_out(p, path, flag: str = "--out", example: str = "results.json", folder: bool = False) -> None:
    """Before any work, a usage error naming ``flag`` and ``path`` where it cannot be written: a directory given
    for a file (or a file for a folder, ``folder=True``), a file on the way, or a nearest existing folder that
    refuses a new file (tried with a probe file, removed again). Creates nothing: missing folders are made
    when the results are written. An empty ``flag``: the message names the path alone."""
    from moekit.train import UserError
    from moekit.train.runlock import check_output_path

    path = os.fspath(path)
    if not path:
        p.error(f"{flag} is empty; give a path")
    try:
        check_output_path(path, f"{flag} {path}" if flag else path, example=example, folder=folder)
    except UserError as exc:
        p.error(str(exc))


def check_git_ref(p, ref: str, flag: str = "--baseline") -> None:
    """A usage error naming ``flag`` when ``ref`` is not a commit of this checkout (git rev-parse)."""
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    try:
        ok = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"], cwd=repo,
                            capture_output=True, text=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as exc:
        p.error(f"{flag} {ref}: cannot ask git about it ({exc}); run from a git checkout with git installed")
    if not ok:
        p.error(f"{flag} {ref}: not a commit of {repo}; pass a commit, branch or tag (e.g. HEAD)")


def check_timing_args(p, args) -> torch.device:
    """add_timing_args' flags: the device (check_device), --warmup >= 0, --repeats >= 1, a writable --out."""
    device = check_device(p, args.device)
    check_at_least(p, args, 0, "warmup")
    check_at_least(p, args, 1, "repeats")
    check_out(p, args.out)
    return device


def check_backend(p, backend: str, cfg, device: torch.device, dtype: torch.dtype,
                  flag: str = "--expert-backend") -> None:
    """A usage error, with moe.experts.resolve_backend's reason, when expert backend ``backend`` cannot run the
    experts of model config ``cfg`` on ``device`` in ``dtype`` (e.g. triton on CPU without the interpreter)."""
    import torch

    from moekit.moe.activations import ffn_in_features
    from moekit.moe.experts import resolve_backend

    H, F = cfg.hidden_size, cfg.moe_ffn_hidden_size
    rows = torch.empty(1, H, device=device, dtype=dtype)  # one expert of the real widths: usable() reads shapes
    w_in = torch.empty(1, H, ffn_in_features(cfg.activation, F), device=device, dtype=dtype)
    w_out = torch.empty(1, F, H, device=device, dtype=dtype)
    try:
        resolve_backend(backend, rows, w_in, w_out)
    except ValueError as exc:
        p.error(f"{flag} {backend}: {exc}")


def hf_experts_implementations() -> list[str] | None:
    """The experts implementations transformers' MoE blocks accept ("eager" and its ExpertsInterface's), or
    None when transformers (or that interface) is not installed."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return None
    return ["eager", *ALL_EXPERTS_FUNCTIONS]


def init_bench_process(rank: int, world: int, init_file: str | None, threads: int = 1) -> torch.device:
    """Join a multi-rank benchmark's process group and return this rank's device. ``init_file`` set: a rank
    spawned on CPU (gloo over that file, ``threads`` torch threads); None: a rank started by torchrun (NCCL on
    its LOCAL_RANK's GPU when there is one, else gloo; ``rank`` and ``world`` come from its environment)."""
    from datetime import timedelta

    import torch
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
