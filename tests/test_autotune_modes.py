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
pin = GROUPED_MM_WGRAD.configs[1]  # 64x256x128, 3 stages: too big for fp32 tiles
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
