"""Probes of one MoE layer for tools/bench/moe_layer.py: per-phase times, host syncs, activation memory.

Shape legend: T tokens, H hidden, E experts, k slots per token, N = T * k routed rows, F expert width.

Phases are timed in isolation, each forward + backward from detached inputs, round-robin with the whole
layer in the same run, so "phase / layer" is a share of the same clock:

    router   x [T, H] -> Routing (logits, softmax, top-k, counts, losses); backward into x and the gate
    permute  sort the slots + gather x -> rows [N, H]; backward sums each token's k row gradients
    experts  rows [N, H] -> grouped SwiGLU MLP -> [N, H]; backward: dX, dW_in, dW_out
    combine  [N, H] -> weighted sum of each token's k rows -> [T, H]; backward into rows and weights
    experts_fused, combine_sum   (where the experts take moe.experts.FUSED_PERMUTE: the Triton backend) the
             experts reading their rows from x [T, H] in place (the permute's gather in their first GEMM; backward
             also sums each token's k row gradients) and scaling them by the routing weights in their last
             (backward: the weights' gradient); then the combine as a plain sum. Set them beside permute +
             experts + combine, which they replace.

Those wall-clock shares include each phase's host launch time, which the whole layer overlaps with GPU
work; on a GPU the phases' kernel time alone (``device_times``, torch.profiler) is recorded too.
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref

from typing import Callable

import torch
from torch import Tensor, nn

PHASES = ("router", "permute", "experts", "combine")
FUSED_PHASES = ("experts_fused", "combine_sum")  # where the experts take FUSED_PERMUTE (phase_steps)


@contextlib.contextmanager
def fused_permute_on():
    """moe.experts.FUSED_PERMUTE = "always" inside (MoELayer reads it in forward only)."""
    from moekit.moe import experts

    before, experts.FUSED_PERMUTE = experts.FUSED_PERMUTE, "always"
    try:
        yield
    finally:
        experts.FUSED_PERMUTE = before


def kernel_ms(events, runs: int) -> float:
    """Milliseconds of GPU time per run from a profiler's events (CPU and CUDA activities): the device time
    each host-side op launched (``self_device_time_total``: its kernels, copies and sets, each counted once,
    on the op that launched it; Triton launches included), over ``runs`` runs. The GPU-side copies of
    record_function ranges are skipped, as profile_step.py does, since their kernels are already counted."""
    total_us = sum(e.self_device_time_total for e in events if str(getattr(e, "device_type", "CPU")).endswith("CPU"))
    return total_us / 1e3 / max(runs, 1)


def device_times(steps: dict[str, Callable[[], None]], device: torch.device, runs: int = 3) -> dict[str, float]:
    """name -> GPU kernel milliseconds per call of each step (CUDA only; {} elsewhere), each step profiled
    alone after a warm-up call. Unlike the wall-clock phase times, host launch overhead is not in it: this
    is what a phase costs the GPU when the host keeps ahead of it, as in a training step at scale."""
    return {name: kernel_ms(events, runs) for name, events in _profiled(steps, device, runs)}


def _profiled(steps: dict[str, Callable[[], None]], device: torch.device, runs: int):
    """(name, profiler events of ``runs`` calls) for each step, profiled alone after a warm-up call; CUDA
    only (nothing elsewhere)."""
    if device.type != "cuda":
        return
    from torch.profiler import ProfilerActivity, profile

    for name, step in steps.items():
        step()
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(runs):
                step()
            torch.cuda.synchronize(device)
        yield name, prof.events()


def kernel_table(events, runs: int, top: int = 6) -> list[dict]:
    """The GPU kernels (and copies / memsets) in a profiler's events, by name, most time first: [{"kernel",
    "us" (per run), "launches" (per run)}], the first ``top`` and one "(others)" entry for the rest. Names are
    cut to 80 characters (CUTLASS / CUB template names run to thousands)."""
    by_name: dict[str, list[float]] = {}
    for e in events:
        if str(getattr(e, "device_type", "CPU")).endswith("CPU") or getattr(e, "is_user_annotation", False):
            continue  # host-side ops (their kernels appear as device events of their own), record_function ranges
        us, n = by_name.setdefault(e.name[:80], [0.0, 0])
        by_name[e.name[:80]] = [us + e.device_time_total, n + 1]
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    runs = max(runs, 1)
    out = [{"kernel": k, "us": us / runs, "launches": n / runs} for k, (us, n) in ranked[:top]]
    rest = ranked[top:]
    if rest:
        out.append({"kernel": "(others)", "us": sum(v[0] for _, v in rest) / runs,
                    "launches": sum(v[1] for _, v in rest) / runs})
    return out


def kernel_breakdown(steps: dict[str, Callable[[], None]], device: torch.device, runs: int = 3,
                     top: int = 6) -> dict[str, list[dict]]:
    """name -> kernel_table of each step (CUDA only; {} elsewhere), each profiled alone after a warm-up
    call: which kernels an operation launches and what each costs the GPU. A step whose event-timed
    median is well above its kernels' sum spends the rest between kernels (launches, host work)."""
    return {name: kernel_table(events, runs, top) for name, events in _profiled(steps, device, runs)}


def _fwd_bwd(fn: Callable[[], Tensor | tuple], grads: Callable[[], tuple]) -> Callable[[], None]:
    def step():
        outs = fn()
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads()) if o.requires_grad]  # e.g. a constant aux loss
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    return step


def phase_steps(layer: nn.Module, x: Tensor) -> dict[str, Callable[[], None]]:
    """name -> zero-argument forward+backward of that phase alone (moekit's MoELayer, local dispatch)."""
    T, H = x.shape
    leaf = x.detach().requires_grad_()
    with torch.no_grad():
        routing = layer.router(leaf)
        d = layer.dispatcher.dispatch(leaf, routing)
        expert_out = layer.experts(d.rows, d.counts)
    gen = torch.Generator(device=x.device).manual_seed(1)
    rows = d.rows.detach().requires_grad_()
    out_rows = expert_out.detach().requires_grad_()
    g_rows = torch.randn(rows.shape, device=x.device, dtype=rows.dtype, generator=gen)
    g_out = torch.randn(T, H, device=x.device, dtype=x.dtype, generator=gen)
    w = routing.weights.detach().requires_grad_()
    g_w = torch.randn(w.shape, device=x.device, dtype=w.dtype, generator=gen)
    meta = dataclasses.replace(d.meta, weights=w)  # so combine's backward reaches the weights

    def router():
        r = layer.router(leaf)
        return r.weights, r.aux_loss

    def permute():
        return layer.dispatcher.dispatch(leaf, routing).rows

    steps = {
        "router": _fwd_bwd(router, lambda: (g_w, torch.ones((), device=x.device))),
        "permute": _fwd_bwd(permute, lambda: (g_rows,)),
        "experts": _fwd_bwd(lambda: layer.experts(rows, d.counts), lambda: (g_rows,)),
        "combine": _fwd_bwd(lambda: layer.dispatcher.combine(out_rows, meta), lambda: (g_out.to(out_rows.dtype),)),
    }
    with fused_permute_on():
        gathers = getattr(layer.dispatcher, "fuses_gather", False) and layer.experts.takes_gather(leaf)
        scales = gathers and getattr(layer.dispatcher, "fuses_weights", False) and layer.experts.takes_row_scale(leaf)
    if gathers:
        g = layer.dispatcher.dispatch(leaf, routing, fuse_gather=True)
        g_meta = dataclasses.replace(g.meta, weights=w)  # the weights' gradient comes from the experts' backward

        def fused():
            scale = layer.dispatcher.row_weights(g_meta) if scales else None
            return layer.experts(leaf, g.counts, gather=g.gather, row_scale=scale)

        steps["experts_fused"] = _fwd_bwd(fused, lambda: (g_rows,))
        if scales:
            steps["combine_sum"] = _fwd_bwd(lambda: layer.dispatcher.combine(out_rows, g_meta, weighted=False),
                                            lambda: (g_out.to(out_rows.dtype),))
    return steps


def gemm_floor_step(layer: nn.Module, x: Tensor, backward: bool) -> tuple[Callable[[], None], float]:
    """(step, flop): the layer's matrix multiplies alone, nothing else: the same GEMM shapes as moekit's
    layer runs for this input's routing (router in fp32, each routed expert's block, the shared expert),
    on preallocated contiguous operands with ``torch.mm(out=)``, the experts scheduled as the loop backend
    schedules them (moe.expert_threads). With ``backward`` the two gradient GEMMs of each (dX, dW) too.

    No implementation built on these torch GEMMs runs the layer much faster than this step, so
    "transformers' time / this time" bounds the ratio any such implementation can reach (the ceiling)."""
    from moekit.moe.expert_threads import choose_workers, for_each_expert

    T, H = x.shape
    dev, dt = x.device, layer.experts.w_in.dtype
    with torch.no_grad():
        counts = layer.router(x).tokens_per_expert
    sizes = [int(c) for c in counts.tolist()]
    E, _, f_in = layer.experts.w_in.shape
    F = layer.experts.w_out.shape[1]
    gemms: list[tuple[int, int, int, torch.dtype]] = [(T, H, E, torch.float32)]  # (m, k, n): [m, k] @ [k, n]
    shared = layer.shared_expert
    if shared is not None:
        Fs = shared.w_up.out_features
        gemms += [(T, H, Fs, dt)] * (2 if shared.w_gate is not None else 1) + [(T, Fs, H, dt)]
        if shared.gate is not None:
            gemms.append((T, H, 1, dt))
    if backward:  # d input = dY @ W^T (m, n, k), d weight = X^T @ dY (k, m, n)
        gemms += [g for m, k, n, d in gemms for g in ((m, n, k, d), (k, m, n, d))]
    dense = [(torch.randn(m, k, device=dev, dtype=d), torch.randn(k, n, device=dev, dtype=d),
              torch.empty(m, n, device=dev, dtype=d)) for m, k, n, d in gemms]
    fwd_ops = [(H, f_in), (F, H)]  # (k, n): rows [n_e, H] @ w_in [H, f_in], a [n_e, F] @ w_out [F, H]
    # backward, per expert: dW_out = a^T g, d a = g w_out^T, dW_in = rows^T dh, d rows = dh w_in^T
    bwd_ops = [("t", F, H), ("n", H, F), ("t", H, f_in), ("n", f_in, H)] if backward else []
    m, wide = max(sizes, default=0), max(H, f_in, F)
    X = torch.randn(max(m, 1), wide, device=dev, dtype=dt)  # every expert's operands are slices of these
    W = torch.randn(E, wide, wide, device=dev, dtype=dt)
    flop = 2 * sum(m_ * k * n for m_, k, n, _ in gemms) + 2 * sum(sizes) * H * (f_in + F) * (3 if backward else 1)

    def scratch():  # one worker's output buffer
        return torch.empty(max(m, wide), wide, device=dev, dtype=dt)

    def expert(e: int, start: int, n: int, out: Tensor) -> None:
        for k_, n_ in fwd_ops:  # [n, k] @ [k, n_]
            torch.mm(X[:n, :k_], W[e, :k_, :n_], out=out[:n, :n_])
        for kind, a, b in bwd_ops:
            if kind == "t":  # weight gradient: [a, n] @ [n, b]
                torch.mm(X[:n, :a].t(), X[:n, :b], out=out[:a, :b])
            else:  # input gradient: [n, a] @ [a, b]
                torch.mm(X[:n, :a], W[e, :a, :b], out=out[:n, :b])

    workers = choose_workers(torch.empty(sum(sizes), H, device=dev, dtype=dt), layer.experts.w_in, sizes)

    def step() -> None:
        with torch.no_grad():
            for a, b, out in dense:
                torch.mm(a, b, out=out)
            for_each_expert(sizes, expert, workers, scratch)

    return step, float(flop)


def host_sync_check(steps: dict[str, Callable[[], None]], device: torch.device) -> dict[str, str]:
    """Run each step under torch.cuda.set_sync_debug_mode("error"): "none", or the first syncing call.

    Run after the warm-up, so one-time work (Triton autotuning benchmarks with syncs) is done."""
    if device.type != "cuda":
        return {name: "not checked (CPU)" for name in steps}
    result = {}
    for name, step in steps.items():
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
            result[name] = "none"
        except RuntimeError as exc:
            result[name] = "sync: " + str(exc).splitlines()[0][:200]
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return result


class KeptForBackward:
    """``with KeptForBackward() as kept: out = module(x)``, then ``kept.bytes()``: the bytes of the unique storages
    autograd saved inside the block and still holds (the whole storage when a view is saved, since that is what
    stays allocated). Held weakly: what a graph branch freed during forward saved (an intermediate nothing uses) is
    gone by the end, and its storage's address, which a later tensor may take, is not counted twice."""

    def __enter__(self) -> "KeptForBackward":
        self._saved: list = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: Tensor) -> Tensor:
        self._saved.append(weakref.ref(t))
        return t

    def bytes(self, exclude: set[int] = frozenset()) -> int:
        """Bytes still kept, storages whose data_ptr is in ``exclude`` (e.g. the parameters') left out."""
        seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (r() for r in self._saved) if t is not None}
        return sum(n for ptr, n in seen.items() if ptr not in exclude)


def saved_activation_bytes(module: nn.Module, x: Tensor) -> dict:
    """Bytes kept for backward by one forward of ``module`` (parameters excluded), measured two ways.

    ``saved_tensors_bytes``: KeptForBackward's count. ``cuda_allocated_bytes`` (GPU): the allocator's growth
    across the forward while the graph is alive, minus the output.
    """
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    leaf = x.detach().requires_grad_()
    cuda = x.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(x.device)
        before = torch.cuda.memory_allocated(x.device)
    with KeptForBackward() as kept:
        out = module(leaf)
    result = {"saved_tensors_bytes": kept.bytes(exclude=params)}
    if cuda:
        torch.cuda.synchronize(x.device)
        result["cuda_allocated_bytes"] = torch.cuda.memory_allocated(x.device) - before - out.numel() * out.element_size()
    del out
    return result


def minimum_activation_bytes(tokens: int, hidden: int, ffn: int, experts: int, top_k: int, elem: int) -> dict:
    """What any dropless SwiGLU MoE layer must keep for backward (unless it recomputes), in bytes.

    inputs [T, H]; gathered rows [N, H] (dW_in); expert hidden pre-activation [N, 2F] (SwiGLU backward)
    and its activation [N, F] (dW_out); expert outputs [N, H] (the combine weights' gradient is
    <output row, output gradient>); routing metadata: the fp32 scores [T, E] (softmax backward),
    an int64 row permutation [N] and the fp32 combine weights [T, k]. A fused kernel that recomputes
    the activation from the pre-activation may go below this (ratio < 1).
    """
    n = tokens * top_k
    parts = {
        "inputs": tokens * hidden * elem,
        "gathered_rows": n * hidden * elem,
        "expert_hidden": n * 2 * ffn * elem,
        "expert_activation": n * ffn * elem,
        "expert_outputs": n * hidden * elem,
        "routing_metadata": tokens * experts * 4 + n * 8 + tokens * top_k * 4,
    }
    parts["total"] = sum(parts.values())
    return parts
