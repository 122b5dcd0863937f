"""The LM-head loss, forward + backward: chunked with the fused Triton cross-entropy kernel, chunked with torch's
elementwise passes, and the plain logits path.

    python tools/bench/lm_loss.py                                           # CUDA, bf16: N 8192 / 32768,
                                                                            # H 1024 / 4096, V 32000 / 151936
    python tools/bench/lm_loss.py --tokens 32768 --hidden 1024 --vocab 32000 # mixtral-1b's head
    python tools/bench/lm_loss.py --smoke --out /tmp/lm.json                # CPU script check, tiny sizes

Each case is hidden states h [N, H] and a head W [V, H] (both with gradients, in --dtype), targets with a tenth
of the positions IGNORE_INDEX; every peer computes the mean next-token loss and its gradients (dh, dW):

    fused           models.loss.chunked_lm_loss(fused=True): per chunk of --chunk tokens the logits GEMM, one
                    Triton kernel (loss rows, softmax minus one-hot written over the logits), the two gradient GEMMs
    chunked torch   chunked_lm_loss(fused=False): the same chunks, torch's fp32 passes between the GEMMs
    plain           F.cross_entropy(F.linear(h, W).float(), y): all [N, V] logits at once (the peer)

The peers' losses and gradients are checked against plain's (or chunked torch's when plain does not fit) before
anything is timed. "time / plain" divides each median by plain's (< 1: faster); "peak MiB" is the most memory
the call allocated on the GPU above what was allocated before it (CUDA only). A peer that cannot run (the
fused kernel without a GPU or TRITON_INTERPRET=1, plain out of memory) prints "-" and its reason goes to the
JSON. --smoke: N 48, H 16, V 100, chunk 20, one timed call, on the CPU unless --device says otherwise (the fused
column needs TRITON_INTERPRET=1 there).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from moekit.bench.benchlib import (BenchParser, add_timing_args, check_at_least, check_timing_args, environment,
                                   guarded, print_table, sync, time_interleaved, write_json)
from moekit.models.loss import DEFAULT_CHUNK, IGNORE_INDEX, chunked_lm_loss

PEERS = ("fused", "chunked torch", "plain")
SMOKE = dict(tokens=[48], hidden=[16], vocab=[100], chunk=20)


def fused_unavailable(device: torch.device, dtype: torch.dtype) -> str:
    """"" when the fused kernel runs here, else why not."""
    try:
        from moekit.moe.kernels.cross_entropy import why_not_cross_entropy
    except ImportError as exc:
        return f"the Triton kernels cannot be imported ({exc})"
    return why_not_cross_entropy(device, dtype)


def peer_fns(h, w, y, chunk: int) -> dict:
    def call(loss_fn):
        def run():
            h.grad = w.grad = None
            loss = loss_fn()
            loss.backward()
            return loss.detach(), h.grad, w.grad
        return run

    return {"fused": call(lambda: chunked_lm_loss(h, w, y, chunk=chunk, fused=True)),
            "chunked torch": call(lambda: chunked_lm_loss(h, w, y, chunk=chunk, fused=False)),
            "plain": call(lambda: F.cross_entropy(F.linear(h, w).float(), y, ignore_index=IGNORE_INDEX))}


def rel_err(got, want) -> float:
    """The largest relative error (norm of the difference / norm of the reference) over loss, dh and dW."""
    return max(float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)) for a, b in zip(got, want))


def peak_mib(fn, device: torch.device):
    """MiB the call allocates above what is allocated before it (CUDA), None elsewhere."""
    if device.type != "cuda":
        fn()
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def bench_case(args, device, dtype, N: int, H: int, V: int, skip: dict) -> list[dict]:
    gen = torch.Generator().manual_seed(args.seed + N + H + V)
    h = torch.randn(N, H, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    w = (torch.randn(V, H, generator=gen) * H ** -0.5).to(device=device, dtype=dtype).requires_grad_()
    y = torch.randint(0, V, (N,), generator=gen)
    y = y.masked_fill(torch.rand(N, generator=gen) < 0.1, IGNORE_INDEX).to(device)
    fns = peer_fns(h, w, y, args.chunk)
    results, errors = {}, dict(skip)
    for name in PEERS:  # one checked call each; a peer that fails (out of memory) is left out of the timing
        if name in errors:
            continue
        out, err = guarded(fns[name])
        if err is None:
            results[name] = tuple(t.detach().clone() for t in out)
        else:
            errors[name] = err
            if device.type == "cuda":
                torch.cuda.empty_cache()
    ref_name = "plain" if "plain" in results else "chunked torch"
    if ref_name not in results:
        raise SystemExit(f"lm_loss: neither plain nor chunked torch ran at N {N} H {H} V {V}: {errors}")
    errs = {name: rel_err(r, results[ref_name]) for name, r in results.items()}
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    bad = {name: e for name, e in errs.items() if not e <= tol}
    if bad:
        raise SystemExit(f"lm_loss: results differ from {ref_name}'s by {bad} (relative) at N {N} H {H} V {V}; "
                         "not timing a wrong result")
    results.clear()
    # off CUDA there is no peak to read: the call is one more untimed run, which --smoke (a script check) skips
    peaks = ({name: peak_mib(fns[name], device) for name in PEERS if name in errs}
             if device.type == "cuda" or not args.smoke else {})
    timings = time_interleaved({name: fns[name] for name in PEERS if name in errs}, device, args.warmup,
                               args.repeats, rotate=True)
    base = timings["plain"]["median_ms"] if "plain" in timings else None
    rows = []
    for name in PEERS:
        t = timings.get(name)
        rows.append({"tokens": N, "hidden": H, "vocab": V, "peer": name,
                     "ms": t["median_ms"] if t else None,
                     "ratio": t["median_ms"] / base if t and base else None,
                     "peak_mib": peaks.get(name), "rel_err": errs.get(name), "error": errors.get(name),
                     "timing": t})
    return rows


def main(argv=None) -> int:
    p = BenchParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    add_timing_args(p, "lm_loss.json", warmup=2, repeats=10)
    p.set_defaults(dtype="bfloat16")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768], help="tokens N (default 8192 32768)")
    p.add_argument("--hidden", type=int, nargs="+", default=[1024, 4096], help="hidden size H (default 1024 4096)")
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936],
                   help="vocabulary V (default 32000 151936: Mixtral's, Qwen's)")
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK,
                   help=f"tokens per chunk of the chunked peers (default {DEFAULT_CHUNK}, the trainer's)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes (N 48, H 16, V 100, chunk 20), one timed call, CPU unless --device is given; "
                        "the fused column needs a GPU or TRITON_INTERPRET=1")
    if argv is None:
        import sys
        argv = sys.argv[1:]
    device_given = any(a == "--device" or a.startswith("--device=") for a in argv)
    args = p.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
        args.repeats, args.warmup = 1, 0
        if not device_given:
            args.device = "cpu"
    device = check_timing_args(p, args)
    check_at_least(p, args, 1, "tokens", "hidden", "vocab", "chunk")
    dtype = getattr(torch, args.dtype)
    reason = fused_unavailable(device, dtype)
    skip = {"fused": f"not available: {reason}"} if reason else {}
    rows = []
    for N in args.tokens:
        for H in args.hidden:
            for V in args.vocab:
                rows += bench_case(args, device, dtype, N, H, V, skip)
                write_json(args.out, {"partial": True, "rows": rows}, quiet=True)
    print(f"LM-head loss fwd+bwd, {args.dtype} on {device}, chunk {args.chunk}")
    print_table(rows, [("tokens", "N", "d"), ("hidden", "H", "d"), ("vocab", "V", "d"), ("peer", "peer", "s"),
                       ("ms", "ms", ".2f"), ("ratio", "time / plain", ".2f"), ("peak_mib", "peak MiB", ".0f")])
    if reason:
        print(f"  fused: {skip['fused']}")
    for r in rows:
        if r["error"] and not (reason and r["peer"] == "fused"):
            print(f"  {r['peer']} at N {r['tokens']} H {r['hidden']} V {r['vocab']}: {r['error']}")
    write_json(args.out, {"benchmark": "lm_loss", "environment": environment(device), "args": vars(args),
                          "fused_available": not reason, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
