"""gpt-oss's attention (sinks, sliding window) as moekit runs it, against transformers' and plain SDPA.

    python tools/bench/attention_sinks.py                                 # CPU: S 256, 1024; fp32
    python tools/bench/attention_sinks.py --device cuda --dtype bfloat16 --seqs 1024 4096 8192 --batch 1

Forward + backward of one attention layer (q, k, v and the sinks get gradients), B x N query heads over K
key/value heads of width D, per sequence length S. Peers, timed round-robin in one process
(tools/bench/benchlib.py), every output checked against moekit's before timing:

    sdpa causal         torch's SDPA, causal, no sinks and no window: what attention without gpt-oss's features
                        costs on this device (the floor; not the same function)
    moekit sinks        models.attention.attend with sinks: SDPA over one more key and channel
                        (sink_attention), a full layer of gpt-oss
    moekit sinks+window the same with a --window sliding window: gpt-oss's other layer (queries in blocks of
                        models.attention.WINDOW_BLOCK over the keys their window reaches: local_attention)
    moekit one masked call  the windowed layer as one masked call over every key (WINDOW_BLOCK = 0: what
                        moekit did before the blocks; the same function)
    hf eager sinks+window  transformers' gpt-oss eager attention (modeling_gpt_oss.eager_attention_forward:
                        scores, mask, the sink column, softmax, values), its only non-kernel path

"saved MiB" is what autograd keeps for backward (saved-tensor hooks: the same count on CPU and GPU); on a GPU
"peak MiB" is torch.cuda's peak allocation over one forward + backward above the inputs. "time / moekit" divides
each peer's median by moekit sinks+window's (> 1: moekit is faster).
"""
from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F

from moekit.bench.benchlib import (BenchParser, add_timing_args, check_at_least, check_timing_args, environment,
                                   print_table, saved_bytes, time_interleaved, write_json)
from moekit.models import attention as A


def hf_eager():
    """transformers' gpt-oss eager attention function, or None when transformers (or its gpt-oss) is absent."""
    try:
        from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    except ImportError:
        return None
    return eager_attention_forward


def peers(q, k, v, sinks, window: int) -> dict:
    """name -> fn(q, k, v, sinks) -> [B, N, S, D] for this case."""
    N, K, S = q.shape[1], k.shape[1], q.shape[2]
    out = {
        "sdpa causal": lambda q, k, v, s: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=N != K),
        "moekit sinks": lambda q, k, v, s: A.attend(q, k, v, None, N != K, sinks=s),
        "moekit sinks+window": lambda q, k, v, s: A.attend(q, k, v, None, N != K, window=window, sinks=s),
        "moekit one masked call": lambda q, k, v, s: unblocked(A.attend, q, k, v, None, N != K, window=window, sinks=s),
    }
    eager = hf_eager()
    if eager is not None:
        mask = torch.zeros(S, S, device=q.device, dtype=q.dtype).masked_fill(
            ~A.window_mask(0, S, window, q.device), -math.inf)[None, None]

        def hf(q, k, v, s):
            module = types.SimpleNamespace(num_key_value_groups=N // K, sinks=s, training=False)
            y, _ = eager(module, q, k, v, mask, scaling=q.shape[-1] ** -0.5)
            return y.transpose(1, 2)  # transformers returns [B, S, N, D]

        out["hf eager sinks+window"] = hf
    return out


def unblocked(fn, *args, **kwargs):
    """``fn`` with sliding-window blocks off (models.attention.WINDOW_BLOCK = 0), restored after."""
    before, A.WINDOW_BLOCK = A.WINDOW_BLOCK, 0
    try:
        return fn(*args, **kwargs)
    finally:
        A.WINDOW_BLOCK = before


def peak_bytes(fn, inputs, grad, device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    torch.autograd.backward(fn(*inputs), grad)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def bench_case(args, device, dtype, S: int) -> list[dict]:
    gen = torch.Generator(device="cpu").manual_seed(args.seed + S)
    B, N, K, D = args.batch, args.heads, args.kv_heads, args.head_dim
    make = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype).requires_grad_()  # noqa: E731
    q, k, v, sinks = make(B, N, S, D), make(B, K, S, D), make(B, K, S, D), make(N)
    grad = torch.randn(B, N, S, D, generator=gen).to(device, dtype)
    fns = peers(q, k, v, sinks, args.window)
    inputs = (q, k, v, sinks)
    with torch.no_grad():
        ref = fns["moekit sinks+window"](*inputs).float()
        errs = {name: ((fn(*inputs).float() - ref).abs().max() / ref.abs().max()).item() for name, fn in fns.items()}

    def step(fn):
        def run():
            for t in inputs:
                t.grad = None
            torch.autograd.backward(fn(*inputs), grad)
        return run

    times = time_interleaved({name: step(fn) for name, fn in fns.items()}, device, args.warmup, args.repeats,
                             rotate=True)
    base = times["moekit sinks+window"]["median_ms"]
    rows = []
    for name, fn in fns.items():
        peak = peak_bytes(fn, inputs, grad, device)
        rows.append({"seq": S, "peer": name, "ms": times[name]["median_ms"], "ratio": times[name]["median_ms"] / base,
                     "saved_mib": saved_bytes(fn, *inputs) / 2**20, "peak_mib": None if peak is None else peak / 2**20,
                     "max_err": errs[name] if name.endswith(("window", "call")) else None})
    return rows


def main(argv=None) -> int:
    p = BenchParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                    formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    add_timing_args(p, "attention_sinks.json", warmup=1, repeats=5)
    p.add_argument("--seqs", type=int, nargs="+", default=[256, 1024], help="sequence lengths (default 256 1024)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8, help="query heads N (gpt-oss: 64)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads K, dividing N (gpt-oss: 8)")
    p.add_argument("--head-dim", type=int, default=64, help="D (gpt-oss: 64)")
    p.add_argument("--window", type=int, default=128, help="sliding window of the windowed peers (gpt-oss: 128)")
    args = p.parse_args(argv)
    device = check_timing_args(p, args)
    check_at_least(p, args, 1, "batch", "heads", "kv_heads", "head_dim", "window")
    if any(s < 1 for s in args.seqs):
        p.error(f"--seqs {args.seqs}: every length must be >= 1")
    if args.heads % args.kv_heads:
        p.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    dtype = getattr(torch, args.dtype)
    before = A.EXPLICIT_ATTENTION
    A.EXPLICIT_ATTENTION = "never"  # the SDPA paths, as on a GPU (the CPU bf16 bmm path is its own choice)
    rows = []
    try:
        for S in args.seqs:
            rows += bench_case(args, device, dtype, S)
            write_json(args.out, {"partial": True, "rows": rows}, quiet=True)
    finally:
        A.EXPLICIT_ATTENTION = before
    print(f"attention fwd+bwd, {args.dtype} on {device}: B {args.batch}, heads {args.heads}/{args.kv_heads}, "
          f"D {args.head_dim}, window {args.window}")
    print_table(rows, [("seq", "S", "d"), ("peer", "peer", "s"), ("ms", "ms", ".2f"),
                       ("ratio", "time / moekit", ".2f"), ("saved_mib", "saved MiB", ".1f"),
                       ("peak_mib", "peak MiB", ".1f"), ("max_err", "max err", ".1e")])
    write_json(args.out, {"environment": environment(device), "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
