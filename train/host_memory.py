"""Host memory: keep freed CPU heap memory in the process for the next step instead of returning it.

Why. glibc's malloc hands an allocation of 32 MiB or more (its largest mmap threshold on 64-bit) a fresh
``mmap`` and unmaps it again on free, and it trims freed memory at the top of the heap back to the kernel.
Every such tensor then pays one page fault per 4 KiB page when first written: ~10 ms for a 32 MiB tensor on
the 2-core CI box (``torch.empty(32768, 256).fill_(1)``: 10.2 ms, against 0.35 ms at 24 MiB), more than the
gather that fills it. A CPU training step allocates the same large activations every step (an MoE layer's
routed rows at 4096 tokens x top-8 x H 256 in fp32 are exactly 32 MiB), so it pays them every step, and
unevenly: whether a size is mapped or reused depends on what was freed before, which made the same
benchmark cell vary 1.5x from run to run (tools/bench/cpu_layer.py, docs/benchmarks.md).

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

The trainer calls it at start on a CPU run (``--train.host_memory auto``, the default; ``retain`` on any
device, ``system`` keeps glibc's behaviour), and so do the CPU benchmarks, for every peer in the process
alike. Elsewhere (musl, macOS,
Windows, or an allocator preloaded with LD_PRELOAD) it changes nothing and says why.
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

MODES = ("auto", "retain", "system")  # --train.host_memory

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


def configure(mode: str, device_type: str) -> str:
    """Apply ``--train.host_memory``: ``retain`` calls :func:`retain_freed_memory`, ``system`` changes nothing,
    ``auto`` retains on a CPU run only. A GPU run's large host buffers are transient (a checkpoint staged in
    host memory, say): glibc returning them keeps the process small, and its per-step host work is small."""
    if mode not in MODES:
        raise ValueError(f"host_memory={mode!r} is invalid; choose one of {list(MODES)}")
    if mode == "system" or (mode == "auto" and device_type != "cpu"):
        return f"host memory: the system allocator's defaults (--train.host_memory {mode})"
    return retain_freed_memory()
