"""LoRA dropout's cost: forward + backward time and the bytes autograd keeps, moekit's against PEFT's and against no
dropout, for one adapted projection and for one layer's routed experts (frozen base weights, as in LoRA training).

    python tools/bench/lora_dropout.py                      # CPU, float32, Qwen3-30B-A3B-like widths
    python tools/bench/lora_dropout.py --device cuda --dtype bfloat16 --tokens 8192

Rows, each timed round-robin against the others of its part:

    linear   moekit   models.lora.LoRALinear with lora_dropout p (moe.lora_dropout: a bool mask saved, the
                      dropped input formed again in backward)
             peft     the peer: peft.tuners.lora.Linear with lora_dropout p (an nn.Dropout in front of A: it keeps
                      the dropped copy and its mask), when peft is installed
             p=0      moekit's adapter without dropout (the floor)
    experts  moekit   GroupedExperts with adapters on both stacks and lora_dropout p, the layer's own path (the CPU's
                      fused loop, the GPU's grouped_mm)
             p=0      the same without dropout

"x peer" = peer time / this time (the peer: peft for linear, p=0 for experts); "kept MiB" = the activations autograd
keeps for backward: the distinct storages of the saved tensors (saved-tensor hooks), parameters left out.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys

import torch

from moekit.bench.benchlib import (BenchParser, add_timing_args, check_at_least, check_timing_args, environment,
                                   print_table, time_interleaved, write_json)
from moekit.bench.layer_probes import KeptForBackward

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv):
    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the micro-batch (default 2048)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048, Qwen3-30B-A3B's)")
    p.add_argument("--out-features", type=int, default=4096, help="the projection's output width (default 4096)")
    p.add_argument("--ffn", type=int, default=768, help="expert FFN width (default 768)")
    p.add_argument("--experts", type=int, default=16, help="local experts (default 16)")
    p.add_argument("--top-k", type=int, default=8, help="experts per token: the expert rows are tokens x top-k")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    p.add_argument("--p", type=float, default=0.05, help="lora_dropout (default 0.05)")
    add_timing_args(p, "bench-results/lora_dropout.json", warmup=1, repeats=5)
    args = p.parse_args(argv)
    check_at_least(p, args, 1, "tokens", "hidden", "out_features", "ffn", "experts", "top_k", "rank")
    if not 0 < args.p < 1:
        p.error(f"--p {args.p} is invalid; give the dropout rate in (0, 1), e.g. 0.05")
    return args, check_timing_args(p, args)


def kept_bytes(fn, x, params) -> int:
    """Bytes autograd keeps for backward of ``fn(x)`` (layer_probes.KeptForBackward), ``params`` left out."""
    with KeptForBackward() as kept:
        out = fn(x)
    n = kept.bytes(exclude={p.untyped_storage().data_ptr() for p in params})  # while out holds the graph
    del out
    return n


def _step(module, x):
    def run():
        x.grad = None
        out = module(x)
        out.backward(torch.ones_like(out))
    return run


def _linear_rows(args, device, dtype) -> list[dict]:
    from moekit.models.lora import add_linear_lora

    g = torch.Generator(device="cpu").manual_seed(args.seed)
    base = torch.nn.Linear(args.hidden, args.out_features, bias=False)
    with torch.no_grad():
        base.weight.copy_(torch.randn(base.weight.shape, generator=g) / args.hidden ** 0.5)
    ours = add_linear_lora(base, args.rank, 2.0 * args.rank, dropout=args.p).to(device, dtype)
    ours.weight.requires_grad_(False)
    with torch.no_grad():
        ours.lora_b.normal_(0.0, 0.02)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(device, dtype).requires_grad_()

    def floor(t):
        ours.lora_dropout = 0.0
        try:
            return ours(t)
        finally:
            ours.lora_dropout = args.p

    peers = {"moekit": ours, "p=0": floor}
    if importlib.util.find_spec("peft") is not None:
        from peft import LoraConfig
        from peft.tuners.lora import Linear as PeftLinear

        plain = torch.nn.Linear(args.hidden, args.out_features, bias=False).to(device, dtype)
        plain.weight.data.copy_(ours.weight.data)
        plain.weight.requires_grad_(False)
        config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=args.p)
        peer = PeftLinear(plain, "default", config, r=args.rank, lora_alpha=2 * args.rank,
                          lora_dropout=args.p).to(device, dtype)
        peer.train()
        peers["peft"] = peer
    times = time_interleaved({k: _step(m, x) for k, m in peers.items()}, device, args.warmup, args.repeats,
                             rotate=True)
    ref = times["peft"]["median_ms"] if "peft" in times else None
    return [{"part": "linear", "peer": k, "shape": f"[{args.tokens}, {args.hidden}] -> {args.out_features} r "
             f"{args.rank}", "ms": times[k]["median_ms"],
             "kept_mib": kept_bytes(m, x, [*ours.parameters(), *(peers["peft"].parameters() if ref else [])]) / 2 ** 20,
             "x_peer": (ref / times[k]["median_ms"]) if ref else None} for k, m in peers.items()]


def _expert_rows(args, device, dtype) -> list[dict]:
    from moekit.moe.experts import GroupedExperts

    g = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    ex = GroupedExperts(args.experts, args.hidden, args.ffn, activation="swiglu")
    ex.add_lora(args.rank, 2.0 * args.rank, dropout=args.p)
    with torch.no_grad():
        for t in ex.parameters():
            t.copy_(torch.randn(t.shape, generator=g) * 0.02)
    ex = ex.to(device, dtype).train()
    ex.w_in.requires_grad_(False)
    ex.w_out.requires_grad_(False)
    rows = args.tokens * args.top_k
    cuts = torch.randint(0, rows + 1, (args.experts - 1,), generator=g).sort().values
    counts = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([rows])])).to(device)
    x = torch.randn(rows, args.hidden, generator=g).to(device, dtype).requires_grad_()

    def run_with(p):
        def fn(t):
            ex.lora_dropout = p
            try:
                return ex(t, counts)
            finally:
                ex.lora_dropout = args.p
        return fn

    peers = {"moekit": run_with(args.p), "p=0": run_with(0.0)}
    times = time_interleaved({k: _step(f, x) for k, f in peers.items()}, device, args.warmup, args.repeats,
                             rotate=True)
    ref = times["p=0"]["median_ms"]
    return [{"part": "experts", "peer": k, "shape": f"{args.experts} x [{args.hidden}, {args.ffn}] rows {rows} r "
             f"{args.rank}", "ms": times[k]["median_ms"],
             "kept_mib": kept_bytes(f, x, list(ex.parameters())) / 2 ** 20, "x_peer": ref / times[k]["median_ms"]}
            for k, f in peers.items()]


def main(argv=None) -> int:
    args, device = parse_args(sys.argv[1:] if argv is None else argv)
    dtype = DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    rows = _linear_rows(args, device, dtype) + _expert_rows(args, device, dtype)
    print(f"LoRA dropout p={args.p:g}, {args.dtype} on {device} (fwd + bwd, frozen base weights)")
    print_table(rows, [("part", "part", "s"), ("peer", "peer", "s"), ("shape", "shape", "s"), ("ms", "ms", ".2f"),
                       ("x_peer", "x peer", ".2f"), ("kept_mib", "kept MiB", ".1f")])
    write_json(args.out, {"benchmark": "lora_dropout", "args": vars(args), "environment": environment(device),
                          "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
