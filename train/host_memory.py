"""Host memory: keep freed CPU heap memory in the process for the next step instead of returning it.

Why. glibc's malloc hands an allocation of 32 MiB or more (its largest mmap threshold on 64-bit) a fresh
``mmap`` and unmaps it again on free, and it trims freed memory at the top of the heap back to the kernel.
Every such tensor then pays one page fault per 4 KiB page when first written: ~10 ms for a 32 MiB tensor on
the 2-core CI box (``torch.empty(32768, 256).fill_(1)``: 10.2 ms, against 0.35 ms at 24 MiB), more than the
gather that fills it. A CPU training step allocates the same large activations every step (an MoE layer's
routed rows at 4096 tokens x top-8 x H 256 in fp32 are exactly 32 MiB), so it pays them every step; below
32 MiB, whether a size is mapped or reused depends on what was freed before (glibc's threshold moves).

What. ``retain_freed_memory()`` sets glibc's ``M_MMAP_MAX`` to 0 (every allocation comes from the heap,
which reuses freed blocks) and ``M_TRIM_THRESHOLD`` to 2 GiB, its largest value (freed memory stays mapped).
This is what the CUDA caching allocator does for device memory, and what the jemalloc / tcmalloc preloads
that PyTorch's CPU launcher (``python -m torch.backends.xeon.run_cpu``) recommends do for host memory.
The cost: resident memory stays at its peak instead of shrinking between steps, and for the first few
steps a freed block may not be reused yet (torch's 64-byte-aligned allocations leave small pieces between
blocks, which glibc's per-thread cache holds for a while), so the peak is above the live size: measured,
+15-27% at a 4096-token layer, nothing at the README main job (docs/training.md).
Threads other than the main one allocate from their own 64 MiB glibc heaps; an allocation larger than
that still gets its own mapping there (glibc falls back to mmap), so nothing fails.

When. It is opt-in (``--train.host_memory retain``; the CPU benchmarks' ``--host-memory retain`` applies it
to every peer in the process alike), because it is not a measured win everywhere. Measured on the 2-core box
(docs/benchmarks.md, issue 19): forward+backward of a fine-grained layer (E 64, F 128, top-8, T 4096, fp32),
whose routed rows, hidden states and gradients are each exactly 32 MiB, 194 -> 149 ms; the same for a
Mixtral-shaped layer (E 8, F 512, top-2), whose largest tensors are 32 MiB too, is not settled: 121 -> 140 ms
in one pair of runs, 138-148 -> 122 ms in another (heap tensors are only 64-byte aligned, and MKL's fp32
GEMMs ran up to ~10% slower on operands that are not page-aligned); the README main job (small tensors)
0.99x. Try it for CPU runs whose per-step tensors reach 32 MiB, and measure (tools/bench/cpu_train.py
--baseline-args "--train.host_memory system" -- --train.host_memory retain ...). A GPU run's host work per
step is small, and a checkpoint staged in host memory would stay resident: keep ``system`` there.
Elsewhere (musl, macOS, Windows, or an allocator preloaded with LD_PRELOAD) it changes nothing and says why.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
RETAIN_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes a C int: trim only a free top of the heap over 2 GiB

MODES = ("system", "retain")  # --train.host_memory

_applied: str | None = None


def _glibc():
    """The C library as a ctypes handle when it is glibc (it has mallopt and gnu_get_libc_version), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not all(hasattr(libc, name) for name in ("mallopt", "gnu_get_libc_version")):
        return None
    return libc


def _preloaded_allocator() -> str:
    """The name of a malloc replacement preloaded into this process (jemalloc, tcmalloc, mimalloc), or ''."""
    for path in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        name = os.path.basename(path)
        if any(a in name for a in ("jemalloc", "tcmalloc", "mimalloc")):
            return name
    return ""


def retain_freed_memory() -> str:
    """Make this process keep freed heap memory (module docstring). Returns one line saying what it did
    (or why it did nothing). Idempotent; affects the whole process and children forked after it."""
    global _applied
    if _applied is not None:
        return _applied
    preloaded = _preloaded_allocator()
    libc = None if preloaded else _glibc()
    if preloaded:
        _applied = f"host memory: {preloaded} is preloaded (LD_PRELOAD); left to it"
    elif libc is None:
        _applied = f"host memory: not glibc ({sys.platform}); the system allocator is left as it is"
    else:
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        version = libc.gnu_get_libc_version().decode()
        ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, RETAIN_TRIM_THRESHOLD) == 1
        _applied = (f"host memory: glibc {version} keeps freed memory for reuse (mmap_max 0, no trimming)" if ok
                    else f"host memory: glibc {version} refused mallopt; the system allocator is left as it is")
    return _applied


def configure(mode: str) -> str:
    """Apply ``--train.host_memory``: ``retain`` calls :func:`retain_freed_memory`; ``system`` changes nothing."""
    if mode not in MODES:
        raise ValueError(f"host_memory={mode!r} is invalid; choose one of {list(MODES)}")
    if mode == "system":
        return "host memory: the C library's defaults"
    return retain_freed_memory()
