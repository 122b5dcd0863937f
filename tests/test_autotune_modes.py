"""moe.kernels' autotune modes: MOEKIT_AUTOTUNE=full|first and ``Kernel.pinned`` (no GPU needed).

The compiled-mode autotuner is built (not launched) in a subprocess without TRITON_INTERPRET, which
needs no GPU: the test reads which configs it would time for fp32 and bf16 operands. Both variables are read
when a kernel is built (moe.kernels._common.Kernel._build), so one subprocess builds every case below in turn,
each under its own MOEKIT_AUTOTUNE / MOEKIT_KERNEL_CONFIGS, and reports each result or error (one torch +
triton import instead of one per case).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json, os, torch
from moekit.moe.kernels._common import autotune_mode
from moekit.moe.kernels.grouped_mm import GROUPED_MM
from moekit.moe.kernels.grouped_mm_wgrad import GROUPED_MM_WGRAD

def kept(kernel, dtype, arg="X"):
    built = kernel._build(False)
    configs = built.configs
    if built.early_config_prune is not None:
        configs = built.early_config_prune(configs, {arg: torch.empty(1, dtype=dtype)})
    return [kernel.configs.index(c) for c in configs]

def probe():
    out = {"mode": autotune_mode(),
           "fp32": kept(GROUPED_MM, torch.float32), "bf16": kept(GROUPED_MM, torch.bfloat16),
           "wgrad_bf16": kept(GROUPED_MM_WGRAD, torch.bfloat16)}
    out["wgrad_fp32"] = kept(GROUPED_MM_WGRAD, torch.float32)
    pin = GROUPED_MM_WGRAD.configs[1]  # 64x256x128, 4 stages: too big for fp32 tiles
    with GROUPED_MM_WGRAD.pinned(pin):
        out["pinned"] = kept(GROUPED_MM_WGRAD, torch.float32)
    out["after_pin"] = kept(GROUPED_MM_WGRAD, torch.bfloat16)
    return out
"""

TUNED_PROBE = r"""
def spelled(c):
    kw = c.kwargs
    return f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} w{c.num_warps} s{c.num_stages}"

def kept_spelled(kernel):
    built = kernel._build(False)
    configs = built.early_config_prune(built.configs, {"X": torch.empty(1, dtype=torch.bfloat16)}) \
        if built.early_config_prune is not None else built.configs
    return [spelled(c) for c in configs]

def tuned_probe():
    return {"wgrad": kept_spelled(GROUPED_MM_WGRAD), "mm": kept_spelled(GROUPED_MM),
            "own_wgrad": [spelled(c) for c in GROUPED_MM_WGRAD.configs]}
"""

# each case: (name, probe, MOEKIT_AUTOTUNE or None, MOEKIT_KERNEL_CONFIGS file or None); the driver builds it under
# exactly those two variables (the others unset) and prints {name: {"ok": result} | {"error": "Type: message"}}
DRIVER = r"""
import sys, traceback
cases = json.loads(sys.argv[1])
results = {}
for name, fn, mode, tuned in cases:
    for var, value in (("MOEKIT_AUTOTUNE", mode), ("MOEKIT_KERNEL_CONFIGS", tuned)):
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
    for kernel in (GROUPED_MM, GROUPED_MM_WGRAD):  # built afresh under this case's variables
        kernel._built.clear()
    try:
        results[name] = {"ok": globals()[fn]()}
    except Exception as exc:
        results[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
print(json.dumps(results))
"""

BAD_TILE = {"_grouped_mm_wgrad_kernel": ["64x48x32 w4 s3"]}  # BLOCK_N 48 must be a power of two
NEW = "32x64x32 w4 s2"  # not in any default list


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """Every case's result from one compiled-mode subprocess (TRITON_INTERPRET unset). The tuned files:
    tune_kernels.py's own output shape (the winners table inside a bigger payload: NEW and the wgrad kernel's last
    own config, which must then move to second place) and one with a malformed tile."""
    tmp = tmp_path_factory.mktemp("autotune")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOEKIT_AUTOTUNE",
                                                            "MOEKIT_KERNEL_CONFIGS")}

    def run(cases):
        proc = subprocess.run([sys.executable, "-c", PROBE + TUNED_PROBE + DRIVER, json.dumps(cases)], env=env,
                              capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    from moekit.moe.kernels.grouped_mm_wgrad import GROUPED_MM_WGRAD  # the same list in either Triton mode

    c = GROUPED_MM_WGRAD.configs[-1]
    last = f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']}x{c.kwargs['BLOCK_K']} w{c.num_warps} s{c.num_stages}"
    payload = {"benchmark": "tune_kernels", "results": [], "winners": {"_grouped_mm_wgrad_kernel": [NEW, last]}}
    (tmp / "tuned.json").write_text(json.dumps(payload))
    (tmp / "bad.json").write_text(json.dumps(BAD_TILE))
    return run([["full", "probe", None, None], ["first", "probe", "first", None],
                ["fastest", "probe", "fastest", None], ["base", "tuned_probe", None, None],
                ["bad_tile", "tuned_probe", None, str(tmp / "bad.json")],
                ["tuned", "tuned_probe", None, str(tmp / "tuned.json")],
                ["tuned_first", "tuned_probe", "first", str(tmp / "tuned.json")]])


def ok(probes, name):
    res = probes[name]
    assert "ok" in res, res.get("trace")
    return res["ok"]


def test_full_times_every_config_that_fits_and_first_only_one(probes):
    full, first = ok(probes, "full"), ok(probes, "first")
    assert full["mode"] == "full" and first["mode"] == "first"
    # bf16: every candidate fits; fp32 doubles the tiles' bytes and drops the biggest
    assert len(full["bf16"]) > len(full["fp32"]) >= 1
    assert first["bf16"] == full["bf16"][:1] and first["fp32"] == full["fp32"][:1]
    assert first["wgrad_bf16"] == full["wgrad_bf16"][:1]
    # pinned: exactly that config, not pruned away even where fp32 would not fit; then back to normal
    assert 1 not in full["wgrad_fp32"]
    for run in (full, first):
        assert run["pinned"] == [1]
    assert full["after_pin"] == full["wgrad_bf16"] and first["after_pin"] == first["wgrad_bf16"]


def test_bad_mode_names_the_variable_and_the_choices(probes):
    bad = probes["fastest"]
    assert "error" in bad, bad
    assert "MOEKIT_AUTOTUNE='fastest' is invalid" in bad["error"] and "['full', 'first']" in bad["error"]


def test_tuned_config_file_puts_its_winners_first_without_duplicates(probes):
    base = ok(probes, "base")
    own = base["own_wgrad"]
    assert base["wgrad"][0] == own[0]
    assert NEW not in own
    # tune_kernels.py's own output shape: the winners table inside a bigger payload
    got = ok(probes, "tuned")
    assert got["wgrad"][:2] == [NEW, own[-1]]
    assert sorted(got["wgrad"]) == sorted(set(base["wgrad"]) | {NEW})  # the old last one moved, not copied
    assert got["mm"] == base["mm"]  # a kernel the file does not name keeps its list
    assert ok(probes, "tuned_first")["wgrad"] == [NEW]


def test_tuned_config_file_errors_name_the_file_and_the_fix(tmp_path, monkeypatch, probes):
    """Each bad file is refused by the trainer's start-up check (moe.kernels.environment_problem) with the file and
    the fix; a kernel built in compiled mode (a subprocess: the GPU path) fails on it too, before any launch."""
    from moekit.moe import kernels

    cases = [
        ({"_no_such_kernel": ["64x64x32 w4 s3"]}, "no moekit kernel is named _no_such_kernel"),
        ({"_grouped_mm_wgrad_kernel": ["64x64 w4 s3"]}, "'64x64 w4 s3' is not of the form"),
        (BAD_TILE, "BLOCK_N 48 must be a power of two"),
        ("{not json", "not valid JSON"),
        ([1, 2], "expected a mapping of kernel name"),
        (None, "cannot read it"),
    ]
    for n, (content, message) in enumerate(cases):
        path = tmp_path / f"tuned{n}.json"  # one path each: the file is read once per path
        if content is not None:
            path.write_text(content if isinstance(content, str) else json.dumps(content))
        monkeypatch.setenv("MOEKIT_KERNEL_CONFIGS", str(path))
        problem = kernels.environment_problem()
        assert f"MOEKIT_KERNEL_CONFIGS={path}" in problem and message in problem, (content, problem)
    bad = probes["bad_tile"]
    assert "error" in bad and "MOEKIT_KERNEL_CONFIGS=" in bad["error"] and cases[2][1] in bad["error"], bad
