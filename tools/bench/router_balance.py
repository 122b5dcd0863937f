"""What the balance loss costs the router: batch-wise against DeepSeek-V3's sequence-wise one, and none.

    python tools/bench/router_balance.py                                     # CPU: 4096 / 16384 tokens, E 64 / 256
    python tools/bench/router_balance.py --device cuda --tokens 8192 32768 --experts 64 256 --seq-len 4096

Forward + backward of one top-k router (moe.router.TopKRouter: logits [T, E] in fp32, scores, selection, weights,
counts and the aux loss; a random cotangent on the weights, the aux loss's own gradient), T tokens of hidden size H
as T / seq-len sequences. Peers, timed round-robin in one process (tools/bench/benchlib.py), each on the same
input and router weights:

    no balance loss   aux_loss_coeff 0: the balance loss is only logged, outside autograd (the floor)
    batch             balance="batch": E * sum_i f_i P_i over the whole micro-batch (Switch, GShard, Mixtral)
    sequence          balance="sequence": the same within each sequence, averaged (DeepSeek-V3's complementary
                      loss; moe.losses.sequence_balance_loss: the per-sequence counts, the scores summed per
                      sequence)

"saved KiB" is what autograd keeps for backward (saved-tensor hooks). "time / batch" divides each peer's median by
the batch peer's (< 1: faster than batch-wise balancing). The sequence peer's value is checked against the loss
written out sequence by sequence before timing.
"""
from __future__ import annotations

import torch

from moekit.bench.benchlib import (BenchParser, add_timing_args, check_at_least, check_timing_args, environment,
                                   print_table, saved_bytes, time_interleaved, write_json)
from moekit.moe.losses import Sequences
from moekit.moe.router import build_router

PEERS = {"no balance loss": dict(aux_loss_coeff=0.0), "batch": dict(aux_loss_coeff=0.01),
         "sequence": dict(aux_loss_coeff=0.01, balance="sequence")}


def routers(args, E: int, device, seed: int) -> dict:
    """name -> router, all with the same gate weights."""
    out = {}
    for name, options in PEERS.items():
        torch.manual_seed(seed)
        r = build_router("topk", args.hidden, E, top_k=args.top_k, score=args.score, **options).to(device)
        out[name] = r.train()
    return out


def reference_loss(scores: torch.Tensor, indices: torch.Tensor, B: int) -> torch.Tensor:
    """The sequence-wise loss, one sequence at a time (the check before timing)."""
    T, E = scores.shape
    S, k = T // B, indices.shape[1]
    total = scores.new_zeros(())
    for b in range(B):
        rows = slice(b * S, (b + 1) * S)
        counts = torch.zeros(E, device=scores.device).index_add_(0, indices[rows].flatten(),
                                                                  torch.ones(S * k, device=scores.device))
        total = total + E * (counts / (S * k) * scores[rows].mean(0)).sum()
    return total / B


def bench_case(args, device, dtype, T: int, E: int) -> list[dict]:
    B = max(T // args.seq_len, 1)
    S = T // B
    T = B * S
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(T, args.hidden, generator=gen).to(device=device, dtype=dtype)
    cotangent = torch.randn(T, args.top_k, generator=gen).to(device)
    sequences = Sequences(0, S, B)
    peers = routers(args, E, device, args.seed)

    def run(name, backward=True):
        r = peers[name]
        inp = x.detach().requires_grad_()
        routing = r(inp, sequences=sequences) if name == "sequence" else r(inp)
        loss = (routing.weights * cotangent).sum() + routing.aux_loss
        if backward:
            loss.backward()
        return routing

    with torch.no_grad():  # the check: the sequence peer's loss is the loss written out per sequence
        r = peers["sequence"]
        routing = r(x, sequences=sequences)
        scores = r.balance_scores(r.scores(r.logits(x)))
        want = reference_loss(scores, routing.indices, B)
        err = (routing.stats["load_balance"] - want).abs().item()
    if err > 1e-4 * max(1.0, want.abs().item()):
        raise SystemExit(f"router_balance: the sequence-wise loss is off by {err:.2e} from the per-sequence "
                         f"reference at T {T}, E {E}; not timing a wrong result")
    timings = time_interleaved({name: (lambda n=name: run(n)) for name in peers}, device, args.warmup,
                               args.repeats, rotate=True)
    base = timings["batch"]["median_ms"]
    return [{"tokens": T, "experts": E, "sequences": B, "peer": name, "ms": t["median_ms"],
             "ratio": t["median_ms"] / base, "saved_kib": saved_bytes(run, name, backward=False) / 1024,
             "timing": t, "check_err": err if name == "sequence" else None} for name, t in timings.items()]


def main(argv=None) -> int:
    p = BenchParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                    formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    add_timing_args(p, "router_balance.json", warmup=2, repeats=10)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="tokens T (default 4096 16384)")
    p.add_argument("--experts", type=int, nargs="+", default=[64, 256], help="experts E (default 64 256)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size H (default 1024; DeepSeek-V3: 7168)")
    p.add_argument("--top-k", type=int, default=8, help="experts per token (default 8, DeepSeek-V3's)")
    p.add_argument("--score", default="sigmoid", choices=["softmax", "sigmoid"],
                   help="score function (default sigmoid, DeepSeek-V3's)")
    args = p.parse_args(argv)
    device = check_timing_args(p, args)
    check_at_least(p, args, 1, "seq_len", "hidden", "top_k")
    if any(t < 1 for t in args.tokens) or any(e < 1 for e in args.experts):
        p.error(f"--tokens {args.tokens} and --experts {args.experts} must all be >= 1")
    if args.top_k > min(args.experts):
        p.error(f"--top-k {args.top_k} exceeds --experts {min(args.experts)}; choose top-k <= experts")
    dtype = getattr(torch, args.dtype)
    rows = []
    for E in args.experts:
        for T in args.tokens:
            rows += bench_case(args, device, dtype, T, E)
            write_json(args.out, {"partial": True, "rows": rows}, quiet=True)
    print(f"top-{args.top_k} {args.score} router fwd+bwd, {args.dtype} on {device}: H {args.hidden}, "
          f"sequences of {args.seq_len}")
    print_table(rows, [("experts", "E", "d"), ("tokens", "T", "d"), ("sequences", "B", "d"), ("peer", "peer", "s"),
                       ("ms", "ms", ".2f"), ("ratio", "time / batch", ".2f"), ("saved_kib", "saved KiB", ".0f")])
    write_json(args.out, {"benchmark": "router_balance", "environment": environment(device), "args": vars(args),
                          "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
