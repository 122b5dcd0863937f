"""Products that op-level selective activation checkpointing recomputes although they are matmuls.

models.parallelize.selective_policy keeps every matmul's output: recomputing an [M, N] product costs 2K flops per
element (K: its inner dimension) where an elementwise op costs a few. A LoRA adapter's expansion ``u B^T``
(u = x A^T [M, r], K = r: 4-64) is the exception: at 2r flops per element it is memory-bound, as cheap to run again
as the elementwise add it feeds, yet its output is as wide as the projection's. Kept, it doubled what a projection
with an adapter leaves in the cache (LoRALinear's ``addmm(y, u, B^T)`` output beside the kept base output y; the
routed experts' ``u B`` beside their base product). Recomputed, an adapter adds only its r-wide u to the cache.

Code computing such a product calls it through ``recomputed(fn, ...)``; the policy asks ``marked()`` while the op
runs. The mark is per thread and eager only: it does not reach the matmuls of a compiled graph, which selective keeps
by copy (models.parallelize.KeepCompiledMatmuls) except those whose shape names them expansions (at most 16 deep:
models.parallelize._low_rank_expansion). Nothing changes without checkpointing.
"""
from __future__ import annotations

import threading
from typing import Callable, TypeVar

import torch

T = TypeVar("T")
_local = threading.local()


def recomputed(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)``, its ops marked for selective checkpointing to recompute (module docstring)."""
    if torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        return fn(*args, **kwargs)
    finally:
        _local.depth = depth


def marked() -> bool:
    """Whether the op running now was called through ``recomputed`` (on this thread)."""
    return getattr(_local, "depth", 0) > 0
