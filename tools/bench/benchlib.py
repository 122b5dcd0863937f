"""Shared benchmark plumbing: timing, environment record, table printing, JSON output."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(fns: dict[str, Callable[[], object]], device: torch.device, warmup: int = 2,
                     repeats: int = 10) -> dict[str, dict]:
    """Median / min / max milliseconds of each peer, run round-robin (a, b, c, a, b, c, ...) so that
    background load and clock drift hit every peer alike: the ratios between peers are what we report."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            sync(device)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: {"median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t), "repeats": repeats}
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


def write_json(path: str | os.PathLike, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
