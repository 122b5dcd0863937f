"""CPU bf16 / fp16 GEMMs whose shapes recur across steps, for the loop backend's experts (moe/experts.py).

Shape legend: n rows of one expert's GEMM (its routed tokens), which change from step to step.

torch runs CPU bf16 / fp16 matmuls through oneDNN, which builds a primitive for every GEMM shape and keeps
the last 1024 in a cache: a shape it has not seen costs 0.2-0.45 ms to create, about as long as running a
[900, 128] x [128, 512] bf16 GEMM (ONEDNN_VERBOSE=profile_create). Expert row counts change every step, so
nearly every expert GEMM of a training run would be a new shape. The loop splits such a GEMM along its rows
into pieces whose lengths come from a small set (multiples of 1024, then of 64, then a rest < 64): the
same few dozen shapes recur step after step and hit the cache. fp32 runs on MKL (no primitives): not split.
Pieces cost something too (a small rest GEMM, padding): 7-27% of the experts when every shape is cached
anyway. So a GEMM runs whole when its exact shape ran recently (``_recent``: the second time, then cached),
in pieces otherwise: balanced routings whose counts recur run whole, real data's ever-new counts in pieces.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict

import torch
from torch import Tensor

PIECE_QUANTA = (1024, 64)


class _RecentShapes:
    """The GEMM shapes seen lately: an LRU of half oneDNN's primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY,
    1024 by default; other ops share it), so a shape remembered here is likely still built there.
    ``seen(key)`` records the key and says whether it was already there. Thread-safe."""

    def __init__(self, capacity: int | None = None):
        if capacity is None:
            env = os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "")
            capacity = max(16, (int(env) if env.isdigit() else 1024) // 2)
        self.capacity, self.keys, self.lock = capacity, OrderedDict(), threading.Lock()

    def seen(self, key: tuple) -> bool:
        with self.lock:
            if key in self.keys:
                self.keys.move_to_end(key)
                return True
            self.keys[key] = None
            if len(self.keys) > self.capacity:
                self.keys.popitem(last=False)
            return False


_recent = _RecentShapes()


def runs_whole(a: Tensor, b: Tensor, rows: int) -> bool:
    """Run ``a @ b``, whose ``rows`` would be split, as one GEMM: not a oneDNN dtype, too few rows to split,
    or its shape ran recently."""
    if not split_rows(a) or rows <= PIECE_QUANTA[-1]:
        return True
    return _recent.seen((tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), a.dtype, torch.get_num_threads()))


def split_rows(t: Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16)


def pieces(n: int) -> list[tuple[int, int]]:
    """(start, length) of the pieces of n rows: lengths are multiples of 1024, then of 64, then < 64."""
    out, start = [], 0
    for quantum in PIECE_QUANTA:
        length = (n - start) // quantum * quantum
        if length:
            out.append((start, length))
            start += length
    if start < n:
        out.append((start, n - start))
    return out


def mm(a: Tensor, b: Tensor, out: Tensor, bias: Tensor | None = None) -> None:
    """out = a @ b (+ bias [cols], broadcast over the rows: addmm, the bias in the GEMM's accumulator instead of
    a pass of its own), in row pieces where oneDNN runs it (above): the same result row for row."""
    if runs_whole(a, b, a.shape[0]):
        _mm(a, b, out, bias)
        return
    for start, n in pieces(a.shape[0]):
        _mm(a[start:start + n], b, out[start:start + n], bias)


def _mm(a: Tensor, b: Tensor, out: Tensor, bias: Tensor | None) -> None:
    if bias is None:
        torch.mm(a, b, out=out)
    else:
        torch.addmm(bias, a, b, out=out)


def padded_rows(n: int) -> int:
    """The row count a weight-gradient GEMM over n rows is padded to (with zero rows): a multiple of 64, or of
    1/16 of the power of two at or below n when that is more; at most 6.25% more work (or < 64 rows), and 16
    lengths per octave, so its reduction length comes from a small set too (above)."""
    quantum = max(64, (1 << (max(n, 1).bit_length() - 1)) // 16)
    return -(-n // quantum) * quantum


def rows_or_copy(t: Tensor, start: int, n: int, padded: int, scratch: Tensor) -> Tensor:
    """Rows [start, start + padded) of ``t`` as a view when they exist, else its n rows from ``start`` copied
    into ``scratch`` over zero rows. The rows past n are then another expert's (or zeros): they meet zero
    rows of the other operand and add exactly nothing."""
    if start + padded <= t.shape[0]:
        return t[start:start + padded]
    out = scratch[:padded]
    out[:n].copy_(t[start:start + n])
    out[n:].zero_()
    return out
