"""moekit.train.host_memory: keeping freed heap memory, so large tensors stop paying page faults every step."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from moekit.train import host_memory

GLIBC = host_memory._glibc() is not None

# allocate, write and free one tensor of 40 MiB (over glibc's largest mmap threshold, 32 MiB) again and again;
# print the minor page faults of each of the last rounds (resource.getrusage counts them per process)
PROBE = textwrap.dedent("""
    import resource, sys, torch
    from moekit.train import host_memory
    print(host_memory.configure(sys.argv[1]), file=sys.stderr)
    faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    per_round = []
    for _ in range(16):  # glibc's aligned allocations settle into reuse within ~8 rounds (module docstring)
        before = faults()
        torch.empty(40 << 18).fill_(1.0)  # 40 MiB of fp32
        per_round.append(faults() - before)
    print(" ".join(map(str, per_round[-4:])))
""")


def probe_faults(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    return [int(v) for v in out.stdout.split()]


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_retained_memory_is_reused_without_page_faults():
    pages = (40 << 20) // 4096
    system = probe_faults("system")
    retain = probe_faults("retain")
    # glibc's default: a fresh mapping every time, every page faulted in again
    assert all(f >= pages * 0.9 for f in system), system
    # retained: the freed block is reused, already mapped
    assert all(f < pages * 0.05 for f in retain), retain


def test_modes():
    assert host_memory.configure("system") == "host memory: the C library's defaults"
    with pytest.raises(ValueError, match="host_memory='sometimes' is invalid; choose one of"):
        host_memory.configure("sometimes")


@pytest.mark.parametrize("preload, expected", [
    ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "libjemalloc.so.2 is preloaded"),
    ("libtcmalloc_minimal.so.4:/opt/x.so", "libtcmalloc_minimal.so.4 is preloaded"),
])
def test_a_preloaded_allocator_is_left_alone(monkeypatch, preload, expected):
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setenv("LD_PRELOAD", preload)
    monkeypatch.setattr(host_memory, "_glibc", lambda: pytest.fail("mallopt must not be called"))
    assert expected in host_memory.retain_freed_memory()


def test_not_glibc_is_said(monkeypatch):
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setattr(host_memory, "_glibc", lambda: None)
    assert "not glibc" in host_memory.retain_freed_memory()


def test_bad_flag_is_refused_by_the_trainer(tmp_path, capsys):
    from moekit.train.loop import main

    assert main(["--train.host_memory", "lots", "--run-dir", str(tmp_path / "r"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--train.host_memory='lots' is invalid; choose one of ['system', 'retain']" in err


OPENMP_PROBE = "import sys; [__import__(m) for m in sys.argv[1:]]"


def openmp_spincount(*modules: str, **env) -> str:
    """libgomp's spin count as it starts in a fresh process importing ``modules`` in order (OMP_DISPLAY_ENV makes
    it print its settings when torch loads it): 0 = passive waiting, 300000 = its default spinning."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", OPENMP_PROBE, *modules], capture_output=True, text=True, timeout=120,
                         env={**clean, "OMP_DISPLAY_ENV": "VERBOSE", **env})
    assert out.returncode == 0, out.stderr
    found = [line.split("=")[1].strip().strip("'") for line in out.stderr.splitlines() if "GOMP_SPINCOUNT" in line]
    if not found:
        pytest.skip("torch's OpenMP runtime is not GNU libgomp (no GOMP_SPINCOUNT in OMP_DISPLAY_ENV)")
    return found[0]


def test_moekit_programs_shorten_openmp_spinning():
    """Every moekit program imports moekit.train before torch: OpenMP's waiting threads then spin 3000 rounds, not
    300000 (a thread waiting for one another process has taken the core from wastes far less of its time slice),
    unless the environment names a wait policy or a spin count; imported after torch it changes nothing, and sets
    nothing."""
    assert openmp_spincount("torch") == "300000"  # the default it replaces
    assert openmp_spincount("moekit.train.loop", "torch") == "3000"  # moekit-train's console script (moekit.train)
    assert openmp_spincount("moekit.train", "torch", OMP_WAIT_POLICY="PASSIVE") == "0"  # the user's choice stands
    assert openmp_spincount("moekit.train", "torch", GOMP_SPINCOUNT="12345") == "12345"
    out = subprocess.run([sys.executable, "-c", "import os, torch, moekit.train; print(os.environ.get("
                          "'GOMP_SPINCOUNT'))"], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")})
    assert out.stdout.strip() == "None", out
