"""moe.kernels' autotune modes: MOEKIT_AUTOTUNE=full|first and ``Kernel.pinned`` (no GPU needed).

The compiled-mode autotuner is built (not launched) in a subprocess without TRITON_INTERPRET, which
needs no GPU: the test reads which configs it would time for fp32 and bf16 operands.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

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

out = {"mode": autotune_mode(),
       "fp32": kept(GROUPED_MM, torch.float32), "bf16": kept(GROUPED_MM, torch.bfloat16),
       "wgrad_bf16": kept(GROUPED_MM_WGRAD, torch.bfloat16)}
out["wgrad_fp32"] = kept(GROUPED_MM_WGRAD, torch.float32)
pin = GROUPED_MM_WGRAD.configs[1]  # 64x256x128, 4 stages: too big for fp32 tiles
with GROUPED_MM_WGRAD.pinned(pin):
    out["pinned"] = kept(GROUPED_MM_WGRAD, torch.float32)
out["after_pin"] = kept(GROUPED_MM_WGRAD, torch.bfloat16)
print(json.dumps(out))
"""


def probe(mode: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOEKIT_AUTOTUNE")}
    if mode is not None:
        env["MOEKIT_AUTOTUNE"] = mode
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)


def test_full_times_every_config_that_fits_and_first_only_one():
    full = probe(None)
    assert full.returncode == 0, full.stderr
    full = json.loads(full.stdout)
    first = probe("first")
    assert first.returncode == 0, first.stderr
    first = json.loads(first.stdout)
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


def test_bad_mode_names_the_variable_and_the_choices():
    bad = probe("fastest")
    assert bad.returncode != 0
    assert "MOEKIT_AUTOTUNE='fastest' is invalid" in bad.stderr and "['full', 'first']" in bad.stderr


TUNED_PROBE = r"""
import json, torch
from moekit.moe.kernels.grouped_mm_wgrad import GROUPED_MM_WGRAD
from moekit.moe.kernels.grouped_mm import GROUPED_MM

def spelled(c):
    kw = c.kwargs
    return f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} w{c.num_warps} s{c.num_stages}"

def kept(kernel):
    built = kernel._build(False)
    configs = built.early_config_prune(built.configs, {"X": torch.empty(1, dtype=torch.bfloat16)}) \
        if built.early_config_prune is not None else built.configs
    return [spelled(c) for c in configs]

print(json.dumps({"wgrad": kept(GROUPED_MM_WGRAD), "mm": kept(GROUPED_MM),
                  "own_wgrad": [spelled(c) for c in GROUPED_MM_WGRAD.configs]}))
"""


def tuned_probe(tmp_path, content, mode=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOEKIT_AUTOTUNE")}
    if mode is not None:
        env["MOEKIT_AUTOTUNE"] = mode
    if content is not None:
        path = tmp_path / "tuned.json"
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        env["MOEKIT_KERNEL_CONFIGS"] = str(path)
    return subprocess.run([sys.executable, "-c", TUNED_PROBE], env=env, capture_output=True, text=True, timeout=120)


def test_tuned_config_file_puts_its_winners_first_without_duplicates(tmp_path):
    base = tuned_probe(tmp_path, None)
    assert base.returncode == 0, base.stderr
    base = json.loads(base.stdout)
    own = base["own_wgrad"]
    assert base["wgrad"][0] == own[0]
    new = "32x64x32 w4 s2"  # not in any default list
    assert new not in own
    # tune_kernels.py's own output shape: the winners table inside a bigger payload
    payload = {"benchmark": "tune_kernels", "results": [],
               "winners": {"_grouped_mm_wgrad_kernel": [new, own[-1]]}}
    got = tuned_probe(tmp_path, payload)
    assert got.returncode == 0, got.stderr
    got = json.loads(got.stdout)
    assert got["wgrad"][:2] == [new, own[-1]]
    assert sorted(got["wgrad"]) == sorted(set(base["wgrad"]) | {new})  # the old last one moved, not copied
    assert got["mm"] == base["mm"]  # a kernel the file does not name keeps its list
    first = tuned_probe(tmp_path, payload, mode="first")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["wgrad"] == [new]


def test_tuned_config_file_errors_name_the_file_and_the_fix(tmp_path, monkeypatch):
    """Each bad file is refused by the trainer's start-up check (moe.kernels.environment_problem) with the file and
    the fix; a kernel built in compiled mode (a subprocess: the GPU path) fails on it too, before any launch."""
    from moekit.moe import kernels

    cases = [
        ({"_no_such_kernel": ["64x64x32 w4 s3"]}, "no moekit kernel is named _no_such_kernel"),
        ({"_grouped_mm_wgrad_kernel": ["64x64 w4 s3"]}, "'64x64 w4 s3' is not of the form"),
        ({"_grouped_mm_wgrad_kernel": ["64x48x32 w4 s3"]}, "BLOCK_N 48 must be a power of two"),
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
    bad = tuned_probe(tmp_path, cases[2][0])
    assert bad.returncode != 0 and "MOEKIT_KERNEL_CONFIGS=" in bad.stderr and cases[2][1] in bad.stderr, bad.stderr
