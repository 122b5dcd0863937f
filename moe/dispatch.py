"""Token dispatch: permute routed slots into expert-major rows, and combine expert outputs back.

Shape legend: T tokens, k slots per token, E experts, N routed rows, H hidden.

    slots (token-major)          rows (expert-major, what the experts see)
    t0: [e2, e0]                 e0: t0.s1, t1.s0        <- counts[0] = 2
    t1: [e0, e1]       --->      e1: t1.s1, t2.s1        <- counts[1] = 2
    t2: [e2, e1]                 e2: t0.s0, t2.s0        <- counts[2] = 2

``dispatch(x, routing) -> Dispatched(rows, counts, meta)``; ``combine(rows, meta) -> [T, H]``.
All state lives in the frozen ``meta``: nothing is hidden on the dispatcher between the two calls,
so one dispatcher serves every layer and activation checkpointing can replay either call.

Determinism: forward and backward are gathers plus a fixed-order sum over the k slots of a token;
no scatter-add whose result depends on thread order (the CPU path's ``index_add_`` adds in index order).
On CUDA the combine, its backward and the permute's backward run as Triton kernels
(``moe.kernels.combine``: fp32 sums in slot order, each row's gradient written once, no atomics), so
they are bitwise reproducible too; ``TRITON_COMBINE`` selects where those kernels run.
"""
from __future__ import annotations

import platform
import warnings
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from moekit.moe.kernel_choice import why_not_cached
from moekit.moe.router import Routing, check_int


@dataclass(frozen=True)
class RowGather:
    """Expert-major rows left unmade: logical row r is source[index[r]] (ScatterMoE-style fused gather).

    ``slots`` [T*k] or None: the inverse map (source row t's rows are slots[t*k:(t+1)*k], N for none), with
    which the backward sums a token's k row gradients in slot order without a sort."""

    index: Tensor  # [N] int64 source row of each logical row
    slots: Tensor | None  # [T*k] int64 logical row of each slot, or None

    @classmethod
    def over(cls, source: Tensor, index: Tensor, slots: Tensor) -> "RowGather":
        """The gather of ``source``'s rows, keeping ``slots`` where the combine kernels (which sum by them) run on
        ``source``'s device and dtype; else the backward sums by a sort."""
        return cls(index, None if _why_not_combine(source, None) else slots)


@dataclass(frozen=True)
class Dispatched:
    rows: Tensor  # [N, H] expert-major routed rows; with ``gather``: the unpermuted source [T, H]
    counts: Tensor  # [E_local] int64 rows per (local) expert; rows past counts.sum() belong to no expert
    meta: Any  # whatever the dispatcher's combine needs, immutable
    gather: RowGather | None = None  # set only when the caller asked for it (LocalDispatcher.dispatch fuse_gather)


class Dispatcher(Protocol):
    """``expert_range``: the global ids [lo, hi) of the experts this rank computes, in the order of
    ``Dispatched.counts`` (all of them locally; this rank's contiguous block under expert parallelism, or its
    slots' physical ids under an expert placement, comm.placement, whose dispatchers also name the logical
    expert of each slot in ``local_expert_ids``)."""

    expert_range: tuple[int, int]

    def dispatch(self, x: Tensor, routing: Routing) -> Dispatched: ...

    def combine(self, rows: Tensor, meta: Any) -> Tensor: ...


@dataclass(frozen=True)
class PermuteMeta:
    num_tokens: int
    top_k: int
    row_slot: Tensor  # [N] flat slot id (t * k + j) of each row, expert-major
    slot_row: Tensor  # [T * k] row of each slot; N (a zero pad row) for a slot that has none (sort_slots)
    weights: Tensor  # [T, k] combine weights (0 where dropped)
    may_drop: bool = True  # False promises slot_row < N everywhere (dropless), so no pad row is needed


# torch's CPU sort takes its parallel radix sort (FBGEMM's, x86 builds) for an integer key of at least
# at::internal::GRAIN_SIZE = 32768 elements; below that it is std::stable_sort, ~3x slower at 24576 keys
# (0.81 vs 0.30 ms, 2-core box: T 4096 x top-6). Padding the key up to the radix size (pads sort last) pays
# from about 12k keys on. Measured by tools/bench/cpu_layer.py's dispatch phase; results are identical.
_RADIX_MIN_KEYS = 32768
_PAD_FROM_KEYS = 12288


def _cpu_radix_sort() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and "fbgemm" in torch.backends.quantized.supported_engines


_RADIX = _cpu_radix_sort()


def stable_argsort(key: Tensor) -> Tensor:
    """``torch.sort(key, stable=True).indices`` of a 1-D int64 key, on CPU padded into torch's radix path
    where that is faster (above). Same result either way: the pads carry the largest key and sort last."""
    n = key.numel()
    if _RADIX and key.device.type == "cpu" and _PAD_FROM_KEYS <= n < _RADIX_MIN_KEYS:
        pad = key.new_full((_RADIX_MIN_KEYS - n,), torch.iinfo(torch.int64).max)
        return torch.sort(torch.cat([key, pad]), stable=True).indices[:n]
    return torch.sort(key, stable=True).indices


def slot_sort_key(flat: Tensor, narrow: bool) -> Tensor:
    """The expert-major sort key of flat expert ids: the id, dropped slots (< 0) last.

    Clearing the sign bit keeps every expert id and turns a negative id -x into (max + 1) - x, above any
    id: dropped slots (-1) sort after all kept ones, in token order (stable). One op (two with the cast)
    where a sentinel ``where`` took three or four; each is a launch on a GPU.

    ``narrow`` (CUDA): int32 keys. CUDA's radix sort makes one pass per key byte, so half the passes of
    int64 keys; expert ids are far below 2**31. CPU keeps int64 keys, the ones torch's CPU radix path
    (stable_argsort) was measured with."""
    if narrow:
        return flat.to(torch.int32) & torch.iinfo(torch.int32).max
    return flat & torch.iinfo(torch.int64).max


def sort_slots(indices: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """Expert-major order of the slots. Returns (row_slot [N], slot_row [T*k]).

    A stable sort keeps tokens in order inside each expert; dropped slots (-1) sort last. A slot past
    the first ``num_rows`` maps to the pad row N, so it neither reads nor receives anything; a dropped
    slot inside them (dropless local dispatch has a row per slot) keeps its own row, which lies past
    ``counts.sum()`` (no expert's: the backends return zeros there), so even a -1 in a routing that
    promised none (``capacity`` None: no pad row) reads zeros, never out of bounds.
    """
    flat = indices.reshape(-1)
    num_slots = flat.numel()
    order = stable_argsort(slot_sort_key(flat, narrow=flat.device.type == "cuda"))  # [T*k]
    slot_row = torch.empty_like(order).scatter_(0, order, torch.arange(num_slots, device=flat.device))
    if num_rows < num_slots:  # dropless local dispatch has a row per slot: nothing to redirect
        slot_row = torch.where(slot_row >= num_rows, num_rows, slot_row)
    return order[:num_rows], slot_row


# Where the combine kernels (moe.kernels.combine) replace the torch gathers of _Permute.backward and
# _Unpermute: "auto" on CUDA tensors the kernels support (float32/bfloat16/float16; not while torch.compile
# traces, where inductor fuses the torch ops itself); "always" on CPU tensors too, in the Triton
# interpreter (TRITON_INTERPRET=1; tests use it to run this module's Triton path), and a tensor the
# kernels cannot take raises instead of falling back; "never": the torch paths everywhere. A backward
# that builds a graph (create_graph=True, for a double backward) always takes the torch path.
TRITON_COMBINE = "auto"
_TRITON_COMBINE_MODES = ("auto", "always", "never")
_COMBINE_OK: dict = {}  # (device, rows dtype, weights dtype) -> why_not_combine's answer, CUDA only


def _combine_key(rows: Tensor, weights: Tensor | None) -> tuple:
    return rows.device, rows.dtype, None if weights is None else (weights.device, weights.dtype)


def _why_not_combine(rows: Tensor, weights: Tensor | None) -> str:
    """"" when the combine kernels can run on these tensors (whatever TRITON_COMBINE says), else why."""
    return why_not_cached(_COMBINE_OK, _combine_key(rows, weights), rows.device, "combine", "why_not_combine", rows,
                          weights)


def _triton_combine(rows: Tensor, weights: Tensor | None = None) -> bool:
    """Whether the combine kernels run on these tensors (TRITON_COMBINE above)."""
    mode = TRITON_COMBINE
    if mode not in _TRITON_COMBINE_MODES:
        raise ValueError(f"moe.dispatch.TRITON_COMBINE={mode!r}; use one of {', '.join(_TRITON_COMBINE_MODES)}")
    if mode == "never" or (mode == "auto" and (rows.device.type != "cuda" or torch.compiler.is_compiling())):
        return False
    reason = _why_not_combine(rows, weights)
    if reason and mode == "always":
        raise ValueError(f"moe.dispatch.TRITON_COMBINE='always': {reason} (or set it to 'auto')")
    return not reason


def _run_combine_kernel(name: str, rows: Tensor, weights: Tensor | None, *args, **kwargs):
    """moe.kernels.combine.<name>(*args, **kwargs), or None when the kernel cannot be built here (a Triton
    compile error or a config this GPU cannot hold: Triton versions differ from machine to machine). Then
    the torch path runs, now and for every later call on these dtypes, after one warning that says so;
    under TRITON_COMBINE="always" the error is raised instead."""
    from moekit.moe.kernels import combine
    from moekit.moe.kernels._common import BUILD_ERRORS, build_failure

    try:
        return getattr(combine, name)(*args, **kwargs)
    except BUILD_ERRORS as exc:
        if TRITON_COMBINE == "always":
            raise
        reason = f"the Triton combine kernel failed to build here ({build_failure(exc)})"
        _COMBINE_OK[_combine_key(rows, weights)] = reason
        warnings.warn(f"moe.dispatch: {reason}; the torch combine runs instead (slower on GPUs). Set "
                      f"moe.dispatch.TRITON_COMBINE = 'never' to choose that without this warning.", stacklevel=2)
        return None


class _Permute(torch.autograd.Function):
    """rows = x[row_token]; backward gathers each token's k slot gradients and sums them.

    On CPU without a pad row the backward is ``index_add_`` of the row gradients onto their tokens
    instead: no [T, k, H] temporary (CPU index_add_ runs its index in order: deterministic). On CUDA it
    is the combine kernel without weights (moe.kernels.combine_rows): one pass, pad index skipped.
    """

    @staticmethod
    def forward(ctx, x: Tensor, row_token: Tensor, slot_row: Tensor, top_k: int, padded: bool) -> Tensor:
        ctx.save_for_backward(slot_row, row_token)
        ctx.top_k, ctx.num_tokens, ctx.padded = top_k, x.shape[0], padded
        return x.index_select(0, row_token)

    @staticmethod
    def backward(ctx, grad_rows: Tensor):
        slot_row, row_token = ctx.saved_tensors
        grad_x = None
        if not torch.is_grad_enabled() and _triton_combine(grad_rows):  # create_graph needs the torch ops
            grad_x = _run_combine_kernel("combine_rows", grad_rows, None, grad_rows, slot_row, None, ctx.num_tokens,
                                         ctx.top_k)
        if grad_x is None and _cpu_fast_path(grad_rows, ctx.padded):
            grad_x = grad_rows.new_zeros(ctx.num_tokens, grad_rows.shape[-1]).index_add_(0, row_token, grad_rows)
        elif grad_x is None:
            grad_x = _gather_slots(grad_rows, slot_row, ctx.num_tokens, ctx.top_k, ctx.padded).sum(1)
        return grad_x, None, None, None, None


class _Unpermute(torch.autograd.Function):
    """out[t] = sum_j weights[t, j] * rows[slot_row[t*k + j]] (a gather, then a [1,k]x[k,H] matmul).

    On CPU without a pad row: k gathers of [T, H] accumulated with ``addcmul_`` (fp32 or wider
    accumulator), and a backward that gathers the output gradient once per row; no [T, k, H] temporary,
    whose fresh allocation (page faults) costs more than the arithmetic on CPU.

    On CUDA (``TRITON_COMBINE``): moe.kernels.combine's kernels, padded or not (they skip the pad index
    N themselves): the forward reads each slot's row once and writes [T, H]; the backward reads the
    output gradient and the rows once and writes the row gradients and the weight gradients in the same
    pass. The weights stay in their own dtype there (fp32 products, one rounding to rows.dtype).
    """

    @staticmethod
    def forward(ctx, rows: Tensor, weights: Tensor, slot_row: Tensor, row_slot: Tensor, padded: bool) -> Tensor:
        T, k = weights.shape
        ctx.save_for_backward(rows, weights, slot_row, row_slot)
        ctx.padded = padded
        if _triton_combine(rows, weights):
            out = _run_combine_kernel("combine_rows", rows, weights, rows, slot_row, weights, T, k)  # [T, H]
            if out is not None:
                return out
        if _cpu_fast_path(rows, padded):
            acc = torch.promote_types(rows.dtype, torch.float32)
            w = weights.to(acc)
            slot_rows = slot_row.view(T, k)
            first = rows.index_select(0, slot_rows[:, 0])
            # bf16 rows: one promoting multiply into the fp32 accumulator, not a cast pass and then a multiply
            out = first.mul_(w[:, :1]) if first.dtype == acc else torch.mul(first, w[:, :1])
            for j in range(1, k):
                out.addcmul_(rows.index_select(0, slot_rows[:, j]), w[:, j:j + 1])
            return out.to(rows.dtype)  # [T, H]
        slots = _gather_slots(rows, slot_row, T, k, padded)  # [T, k, H]
        with torch.autocast(rows.device.type, enabled=False):  # combine in the experts' output dtype
            return torch.bmm(weights.to(rows.dtype).unsqueeze(1), slots).squeeze(1)  # [T, H]

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        rows, weights, slot_row, row_slot = ctx.saved_tensors
        T, k = weights.shape
        grad_out = grad_out.to(rows.dtype)
        grad_rows = grad_weights = None
        if not torch.is_grad_enabled() and _triton_combine(rows, weights):  # create_graph needs the torch ops
            # sort_slots gives each of the N = len(row_slot) rows one slot; zero-fill anything else
            grads = _run_combine_kernel(
                "combine_rows_backward", rows, weights, grad_out, rows, weights, slot_row,
                need_grad_rows=ctx.needs_input_grad[0], need_grad_weights=ctx.needs_input_grad[1],
                zero_fill_rows=rows.shape[0] != row_slot.shape[0])
            if grads is not None:
                return grads[0], grads[1], None, None, None
        if _cpu_fast_path(rows, ctx.padded):
            g = grad_out.index_select(0, row_slot // k)  # [N, H] each row's token gradient
            if ctx.needs_input_grad[1]:  # d w[slot] = <rows[row of slot], grad_out[token]>
                g_row = torch.linalg.vecdot(g, rows).to(weights.dtype)  # [N]
                grad_weights = torch.empty_like(g_row).index_copy_(0, row_slot, g_row).view(T, k)
            if ctx.needs_input_grad[0]:
                w_row = weights.reshape(-1).index_select(0, row_slot).to(g.dtype)  # [N]
                # in place unless a double backward differentiates this (g is then saved by vecdot)
                grad_rows = g * w_row[:, None] if torch.is_grad_enabled() else g.mul_(w_row[:, None])
            return grad_rows, grad_weights, None, None, None
        if ctx.needs_input_grad[0]:
            # each row came from exactly one slot: d rows[r] = w[slot] * grad_out[token of slot]
            w_row = weights.reshape(-1).index_select(0, row_slot).to(grad_out.dtype)  # [N]
            grad_rows = grad_out.index_select(0, row_slot // k) * w_row[:, None]
        if ctx.needs_input_grad[1]:
            slots = _gather_slots(rows, slot_row, T, k, ctx.padded)  # recomputed, not saved: [T, k, H]
            grad_weights = torch.bmm(slots, grad_out.unsqueeze(2)).squeeze(2).to(weights.dtype)
        return grad_rows, grad_weights, None, None, None


class _SumSlots(torch.autograd.Function):
    """out[t] = sum_j rows[slot_row[t*k + j]]: the combine when the experts applied the weights already
    (moe.experts.FUSED_PERMUTE's row_scale). Backward: each row's gradient is its token's, one gather; nothing of
    rows is kept (the weighted combine keeps them for the weights' gradient)."""

    @staticmethod
    def forward(ctx, rows: Tensor, slot_row: Tensor, row_slot: Tensor, num_tokens: int, top_k: int,
                padded: bool) -> Tensor:
        ctx.save_for_backward(row_slot)
        ctx.top_k = top_k
        if _triton_combine(rows):
            out = _run_combine_kernel("combine_rows", rows, None, rows, slot_row, None, num_tokens, top_k)
            if out is not None:
                return out
        if _cpu_fast_path(rows, padded):
            acc = torch.promote_types(rows.dtype, torch.float32)
            slot_rows = slot_row.view(num_tokens, top_k)
            out = rows.index_select(0, slot_rows[:, 0]).to(acc)
            for j in range(1, top_k):
                out += rows.index_select(0, slot_rows[:, j])
            return out.to(rows.dtype)
        with torch.autocast(rows.device.type, enabled=False):
            return _gather_slots(rows, slot_row, num_tokens, top_k, padded).sum(1, dtype=torch.promote_types(
                rows.dtype, torch.float32)).to(rows.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (row_slot,) = ctx.saved_tensors
        return grad_out.index_select(0, row_slot // ctx.top_k), None, None, None, None, None


def _cpu_fast_path(rows: Tensor, padded: bool) -> bool:
    """CPU, and a row for every slot (no pad row): the combine / permute-backward variants without a
    [T, k, H] temporary. Where neither these nor the combine kernels (TRITON_COMBINE) run: the single
    gather (+ bmm), one kernel each, no atomics."""
    return rows.device.type == "cpu" and not padded


def _gather_slots(rows: Tensor, slot_row: Tensor, num_tokens: int, top_k: int, padded: bool) -> Tensor:
    """[T, k, H] rows of each slot; with ``padded`` a zero row N stands in for dropped slots."""
    if padded:  # only when slots can be dropped: the pad costs a full copy of rows
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[-1])])
    return rows.index_select(0, slot_row).view(num_tokens, top_k, rows.shape[-1])


def permute(x: Tensor, meta: PermuteMeta) -> Tensor:
    """[T, H] -> [N, H] expert-major rows."""
    return _Permute.apply(x, meta.row_slot // meta.top_k, meta.slot_row, meta.top_k, meta.may_drop)


def unpermute(rows: Tensor, meta: PermuteMeta, weighted: bool = True) -> Tensor:
    """[N, H] expert outputs -> [T, H] weighted sum over each token's kept slots; ``weighted=False``: the plain sum
    (the rows carry their weights already: row_weights)."""
    if not weighted:
        return _SumSlots.apply(rows, meta.slot_row, meta.row_slot, meta.num_tokens, meta.top_k, meta.may_drop)
    return _Unpermute.apply(rows, meta.weights, meta.slot_row, meta.row_slot, meta.may_drop)


def row_weights(meta: PermuteMeta) -> Tensor:
    """[N] float32: each row's routing weight (its slot's), differentiable into the routing weights: what experts
    that scale their own output rows take (then ``unpermute(weighted=False)``)."""
    return meta.weights.reshape(-1).index_select(0, meta.row_slot).to(torch.float32)


class LocalDispatcher:
    """All experts on this device: a sort, a gather, and the weighted gather back.

    The number of rows is static (no host sync): T*k when dropless, min(T*k, E*capacity) when a
    capacity bounds it. Rows past ``counts.sum()`` belong to no expert and the expert backends
    return zeros for them.
    """

    # dispatch(fuse_gather=True) can leave the rows to the experts' first GEMM, and combine(weighted=False) the
    # routing weights to their last (row_weights): MoELayer asks when the experts take it (moe.experts.FUSED_PERMUTE)
    fuses_gather = True
    fuses_weights = True

    def __init__(self, num_experts: int):
        check_int("LocalDispatcher num_experts", num_experts, 1)
        self.num_experts = num_experts
        self.expert_range = (0, num_experts)

    def dispatch(self, x: Tensor, routing: Routing, *, fuse_gather: bool = False) -> Dispatched:
        """``fuse_gather``: return x itself as ``rows`` with ``gather`` saying which token each expert-major
        row reads, for experts that gather in their first GEMM (moe.experts.GroupedExperts.takes_gather):
        no [N, H] copy is made, nor kept for backward."""
        T, k = routing.indices.shape
        if x.shape[0] != T:
            raise ValueError(f"dispatch got {x.shape[0]} tokens but routing for {T}")
        counts = routing.tokens_per_expert  # [E]: the routing's number of experts (shape only, no sync)
        if counts.shape != (self.num_experts,):
            raise ValueError(f"dispatch: routing.tokens_per_expert has shape {tuple(counts.shape)} but this "
                             f"LocalDispatcher has num_experts={self.num_experts}; build the dispatcher and the "
                             f"router with the same number of experts")
        num_rows = T * k
        if routing.capacity is not None:
            num_rows = min(num_rows, self.num_experts * routing.capacity)
        row_slot, slot_row = sort_slots(routing.indices, num_rows)
        meta = PermuteMeta(T, k, row_slot, slot_row, routing.weights, may_drop=routing.capacity is not None)
        if fuse_gather:
            return Dispatched(x, routing.tokens_per_expert, meta, RowGather.over(x, row_slot // k, slot_row))
        return Dispatched(permute(x, meta), routing.tokens_per_expert, meta)

    def row_weights(self, meta: PermuteMeta) -> Tensor:
        """[N] float32: each row's routing weight (moe.dispatch.row_weights), for ``combine(weighted=False)``."""
        return row_weights(meta)

    def combine(self, rows: Tensor, meta: PermuteMeta, *, weighted: bool = True) -> Tensor:
        """[N, H] -> [T, H]: each token's rows times their weights, summed; ``weighted=False``: the rows summed as
        they are (they carry row_weights already)."""
        num_rows = meta.row_slot.shape[0]  # N, the rows dispatch produced
        if rows.dim() != 2 or rows.shape[0] != num_rows:
            raise ValueError(f"combine: rows has shape {tuple(rows.shape)} but this dispatch produced "
                             f"[N={num_rows}, H] rows; pass the experts' output for Dispatched.rows (one row each, "
                             f"same order)")
        return unpermute(rows, meta, weighted)
