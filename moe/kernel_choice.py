"""When a Triton path runs instead of its torch twin: the parts every such switch shares.

The switches themselves stay where their path is, as module attributes that tests and benchmarks set
(``moe.dispatch.TRITON_COMBINE``, ``models.loss.TRITON_LM_LOSS``, ``models.delta_rule.TRITON_SCAN``, ...):
"auto" (CUDA tensors, not while torch.compile traces), "always" (CPU too, in the Triton interpreter; errors
raised) and "never". This module holds what is the same in each: reading a switch from its environment variable,
the message for a bad value, and the cached answer to "can the kernel run on these tensors"."""
from __future__ import annotations

import importlib
import os

import torch

MODES = ("auto", "always", "never")


def mode_from_env(env: str, default: str) -> str:
    """The switch's starting value: the environment variable ``env`` (case and spaces ignored), else ``default``."""
    return os.environ.get(env, "").strip().lower() or default


def mode_problem(name: str, mode: str, env: str) -> str:
    """"" or what is wrong with switch ``name`` (e.g. "models.loss.TRITON_LM_LOSS") at ``mode``, set from ``env``."""
    if mode in MODES:
        return ""
    return (f"{name}={mode!r} (environment variable {env}={os.environ.get(env)!r}) is invalid; use one of "
            f"{', '.join(MODES)} or unset it")


def why_not_cached(cache: dict, key, device: torch.device, module: str, function: str, *args) -> str:
    """"" when the kernel can run, else why: ``moekit.moe.kernels.<module>.<function>(*args)``, imported when first
    asked (a platform without Triton: the import error, and "install triton"). Cached under ``key`` on CUDA, where
    the answer is fixed and the question comes every step; on CPU it follows TRITON_INTERPRET, which may change."""
    reason = cache.get(key)
    if reason is None:
        try:
            check = getattr(importlib.import_module(f"moekit.moe.kernels.{module}"), function)
        except ImportError as exc:  # no triton on this platform
            reason = f"the Triton kernels cannot be imported ({exc}); install triton"
        else:
            reason = check(*args)
        if device.type == "cuda":
            cache[key] = reason
    return reason
