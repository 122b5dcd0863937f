"""MoE layer forward+backward: moekit vs transformers' Mixtral sparse MoE block, same weights, same routing.

    python tools/bench/moe_layer.py                       # T=4096 H=256, (F=512,E=8,k=2) and (F=128,E=64,k=8)
    python tools/bench/moe_layer.py --tokens 8192 --device cuda --dtype bfloat16 --out bench-results/moe_layer.json

Each implementation runs the same function: top-k softmax routing with renormalised weights (Mixtral),
SwiGLU experts, no capacity dropping, no aux loss (transformers' block computes none inside the block).
Before timing, the outputs of every implementation are checked against transformers' (max abs error in
the table). Ratios are peer time / moekit time, so > 1 means moekit is faster.
"""
from __future__ import annotations

import argparse
import sys

import torch

from benchlib import environment, print_table, time_interleaved, write_json
from moe import MoELayer, build_router

DEFAULT_SHAPES = ["512x8x2", "128x64x8"]  # F x E x k


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        f, e, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shapes entry {text!r} is not FxExk (e.g. 512x8x2)") from None
    if not (0 < k <= e and f > 0):
        raise SystemExit(f"--shapes entry {text!r} needs F > 0 and 0 < k <= E")
    return f, e, k


def hf_block(hidden: int, ffn: int, experts: int, top_k: int, implementation: str):
    """transformers' MixtralSparseMoeBlock, or None when transformers is not installed."""
    try:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    except ImportError:
        return None
    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=ffn, num_local_experts=experts,
                        num_experts_per_tok=top_k, router_jitter_noise=0.0)
    cfg._experts_implementation = implementation
    return MixtralSparseMoeBlock(cfg)


def copy_into_hf(layer: MoELayer, block) -> None:
    """moekit stores x @ w (w_in [E, H, 2F], w_out [E, F, H]); transformers stores linear weights (transposed)."""
    with torch.no_grad():
        block.gate.weight.copy_(layer.router.weight)
        block.experts.gate_up_proj.copy_(layer.experts.w_in.transpose(1, 2))
        block.experts.down_proj.copy_(layer.experts.w_out.transpose(1, 2))


def fwd_bwd(module, x: torch.Tensor, grad: torch.Tensor):
    def step():
        x.grad = None
        module.zero_grad(set_to_none=True)
        module(x).backward(grad)

    return step


def bench_shape(args, ffn: int, experts: int, top_k: int, device, dtype) -> list[dict]:
    torch.manual_seed(args.seed)
    H, T = args.hidden, args.tokens
    router = build_router("topk", H, experts, top_k=top_k, aux_loss_coeff=0.0)
    layer = MoELayer(H, ffn, experts, router).to(device, dtype)
    peers = {}
    for impl in args.hf_impl:
        block = hf_block(H, ffn, experts, top_k, impl)
        if block is not None:
            block = block.to(device, dtype)
            copy_into_hf(layer, block)
            peers[f"transformers[{impl}]"] = block
    impls = {}
    for backend in args.backends:
        try:
            from moe.experts import resolve_backend

            x0 = torch.zeros(1, H, device=device, dtype=dtype)
            chosen = resolve_backend(backend, x0, layer.experts.w_in, layer.experts.w_out).name
        except ValueError as exc:
            print(f"skip moekit[{backend}]: {exc}", file=sys.stderr)
            continue
        clone = MoELayer(H, ffn, experts, build_router("topk", H, experts, top_k=top_k, aux_loss_coeff=0.0),
                         backend=backend).to(device, dtype)
        clone.load_state_dict(layer.state_dict())
        impls[f"moekit[{backend}->{chosen}]" if backend == "auto" else f"moekit[{backend}]"] = clone
    x = torch.randn(1, T, H, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(1, T, H, device=device, dtype=dtype)
    with torch.no_grad():
        ref = next(iter(peers.values()))(x) if peers else layer(x)
    modules = {**impls, **peers}
    errors = {}
    for name, module in modules.items():
        module.train()
        with torch.no_grad():
            errors[name] = (module(x).float() - ref.float()).abs().max().item()  # D2H sync: benchmark check
    timings = time_interleaved({n: fwd_bwd(m, x, grad) for n, m in modules.items()}, device,
                               warmup=args.warmup, repeats=args.repeats)
    rows = [{"shape": f"T{T} H{H} F{ffn} E{experts} k{top_k}", "impl": n, "max_abs_err": errors[n], **timings[n]}
            for n in modules]
    base = next(r["median_ms"] for r in rows if r["impl"].startswith("moekit[auto"))  # what users get
    for r in rows:
        r["moekit_speedup"] = r["median_ms"] / base
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="FxExk entries")
    p.add_argument("--backends", nargs="+", default=["auto", "torch", "loop"],
                   help="moekit expert backends to time ('auto' is always included: ratios are against it)")
    p.add_argument("--hf-impl", nargs="+", default=["eager", "grouped_mm"],
                   help="transformers experts implementations to time (eager = its per-expert loop)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/moe_layer.json")
    args = p.parse_args(argv)
    args.backends = ["auto"] + [b for b in args.backends if b != "auto"]
    if args.tokens <= 0 or args.hidden <= 0 or args.repeats <= 0:
        p.error("--tokens, --hidden and --repeats must be positive")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows = []
    for shape in args.shapes:
        rows += bench_shape(args, *parse_shape(shape), device, dtype)
    print_table(rows, [("shape", "shape", ""), ("impl", "implementation", ""), ("median_ms", "median ms", ".2f"),
                       ("min_ms", "min ms", ".2f"), ("moekit_speedup", "time / moekit", ".2f"),
                       ("max_abs_err", "max |err|", ".1e")])
    write_json(args.out, {"benchmark": "moe_layer_fwd_bwd", "dtype": args.dtype, "environment": environment(device),
                          "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
