"""Gated DeltaNet (Qwen3.5's linear attention) against transformers' own layer, and the chunk length's effect.

    python tools/bench/linear_attention.py                                  # CPU: B 2 x S 512 / 2048, H 512
    python tools/bench/linear_attention.py --device cuda --dtype bfloat16 --seq-len 4096 16384 --hidden 2048 \\
        --key-heads 16 --value-heads 32 --head-dim 128                       # Qwen3.5-35B-A3B's layer

Forward + backward of one token mixer on B x S positions of width H (a random cotangent on its output), every
peer with the same weights (moekit's are copied into transformers' layer; their outputs are checked equal before
timing), timed round-robin in one process (tools/bench/benchlib.py):

    moekit              models.linear_attention.GatedDeltaNet: the chunked rule (--chunk positions per chunk),
                        the convolution as one depthwise conv1d, q / k expanded to the value heads
    transformers        Qwen3_5MoeGatedDeltaNet, its torch path (torch_chunk_gated_delta_rule, chunks of 64; with
                        the flash-linear-attention package installed transformers would run its Triton kernels,
                        which this benchmark does not load)
    moekit chunk 2x / 0.5x   the same layer with chunks twice / half as long (the chunk length trades the
                        [L, L] products and the triangular solve against the per-chunk state updates)

"time / transformers" divides each peer's median by transformers' (< 1: faster). "saved MiB" is what autograd
keeps for backward (saved-tensor hooks, a tensor saved twice counted twice).
"""
from __future__ import annotations

import dataclasses
import warnings

import torch

from moekit.bench.benchlib import (BenchParser, add_timing_args, check_at_least, check_timing_args, environment,
                                   print_table, saved_bytes, time_interleaved, write_json)
from moekit.models.config import preset
from moekit.models.linear_attention import GatedDeltaNet


def config(args):
    """A qwen3.5 ModelConfig with the benchmark's layer sizes."""
    return dataclasses.replace(preset("qwen3.5-tiny"), hidden_size=args.hidden, linear_num_key_heads=args.key_heads,
                               linear_num_value_heads=args.value_heads, linear_key_head_dim=args.head_dim,
                               linear_value_head_dim=args.head_dim, linear_chunk=args.chunk)


def transformers_layer(cfg, ours: GatedDeltaNet, device, dtype):
    """transformers' Qwen3_5MoeGatedDeltaNet with moekit's weights, or None without transformers."""
    try:
        from transformers import Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
    except ImportError:
        return None
    hf_cfg = Qwen3_5MoeTextConfig(hidden_size=cfg.hidden_size, linear_num_key_heads=cfg.linear_num_key_heads,
                                  linear_num_value_heads=cfg.linear_num_value_heads,
                                  linear_key_head_dim=cfg.linear_key_head_dim,
                                  linear_value_head_dim=cfg.linear_value_head_dim,
                                  linear_conv_kernel_dim=cfg.linear_conv_kernel, rms_norm_eps=cfg.norm_eps,
                                  num_hidden_layers=1, layer_types=["linear_attention"])
    theirs = Qwen3_5MoeGatedDeltaNet(hf_cfg, 0)
    pairs = {"in_proj_qkv.weight": "wqkv.weight", "in_proj_z.weight": "wz.weight", "in_proj_b.weight": "wb.weight",
             "in_proj_a.weight": "wa.weight", "conv1d.weight": "conv_weight", "dt_bias": "dt_bias", "A_log": "A_log",
             "norm.weight": "norm.weight", "out_proj.weight": "wo.weight"}
    mine = ours.state_dict()
    theirs.load_state_dict({k: mine[v] for k, v in pairs.items()})
    return theirs.to(device=device, dtype=dtype)


def bench_case(args, device, dtype, S: int) -> list[dict]:
    cfg = config(args)
    torch.manual_seed(args.seed)
    layers = {}
    for name, chunk in (("moekit", args.chunk), ("moekit chunk 2x", 2 * args.chunk),
                        ("moekit chunk 0.5x", max(1, args.chunk // 2))):
        layer = GatedDeltaNet(dataclasses.replace(cfg, linear_chunk=chunk))
        layers[name] = layer
    with torch.no_grad():  # one set of weights for every peer
        layers["moekit"].init_weights(lambda t, std: t.normal_(0, std), 0.02, 0.02)
        for name in ("moekit chunk 2x", "moekit chunk 0.5x"):
            layers[name].load_state_dict(layers["moekit"].state_dict())
    hf = transformers_layer(cfg, layers["moekit"], device, dtype)
    if hf is not None:
        layers["transformers"] = hf
    for layer in layers.values():
        layer.to(device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(args.seed + S)
    x = torch.randn(args.batch, S, cfg.hidden_size, generator=gen).to(device=device, dtype=dtype)
    cotangent = torch.randn(args.batch, S, cfg.hidden_size, generator=gen).to(device=device, dtype=dtype)

    def run(name, backward=True):
        inp = x.detach().requires_grad_()
        with warnings.catch_warnings():  # transformers' "flash-linear-attention is not installed" notice
            warnings.simplefilter("ignore")
            y = layers[name](inp)
        if backward:
            (y * cotangent).sum().backward()
        return y

    with torch.no_grad():  # the check: every peer computes the same layer
        want = run("moekit", backward=False).float()
        errors = {name: ((run(name, backward=False).float() - want).norm() / want.norm()).item() for name in layers}
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    bad = {name: err for name, err in errors.items() if not err <= tol}
    if bad:
        raise SystemExit(f"linear_attention: outputs differ from moekit's by {bad} (relative) at S {S}; not timing "
                         f"a wrong result")
    timings = time_interleaved({name: (lambda n=name: run(n)) for name in layers}, device, args.warmup,
                               args.repeats, rotate=True)
    base = timings.get("transformers", timings["moekit"])["median_ms"]
    tokens = args.batch * S
    return [{"seq_len": S, "peer": name, "ms": t["median_ms"], "ratio": t["median_ms"] / base,
             "ktok_s": tokens / t["median_ms"], "saved_mib": saved_bytes(run, name, backward=False) / 2**20,
             "rel_err": errors[name], "timing": t} for name, t in timings.items()]


def main(argv=None) -> int:
    p = BenchParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                    formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    add_timing_args(p, "linear_attention.json", warmup=1, repeats=5)
    p.add_argument("--seq-len", type=int, nargs="+", default=[512, 2048], help="positions S (default 512 2048)")
    p.add_argument("--batch", type=int, default=2, help="sequences B (default 2)")
    p.add_argument("--hidden", type=int, default=512, help="hidden size H (default 512; Qwen3.5-35B-A3B: 2048)")
    p.add_argument("--key-heads", type=int, default=4, help="key heads (default 4; Qwen3.5-35B-A3B: 16)")
    p.add_argument("--value-heads", type=int, default=8, help="value heads (default 8; Qwen3.5-35B-A3B: 32)")
    p.add_argument("--head-dim", type=int, default=64, help="key and value head dim (default 64; Qwen3.5: 128)")
    p.add_argument("--chunk", type=int, default=64, help="moekit's chunk length (default 64, transformers' own)")
    args = p.parse_args(argv)
    device = check_timing_args(p, args)
    check_at_least(p, args, 1, "batch", "hidden", "key_heads", "value_heads", "head_dim", "chunk")
    if any(s < 1 for s in args.seq_len):
        p.error(f"--seq-len {args.seq_len} must all be >= 1")
    if args.value_heads % args.key_heads:
        p.error(f"--key-heads {args.key_heads} must divide --value-heads {args.value_heads}")
    dtype = getattr(torch, args.dtype)
    rows = []
    for S in args.seq_len:
        rows += bench_case(args, device, dtype, S)
        write_json(args.out, {"partial": True, "rows": rows}, quiet=True)
    print(f"Gated DeltaNet fwd+bwd, {args.dtype} on {device}: B {args.batch}, H {args.hidden}, "
          f"{args.key_heads} key / {args.value_heads} value heads of {args.head_dim}, moekit chunk {args.chunk}")
    print_table(rows, [("seq_len", "S", "d"), ("peer", "peer", "s"), ("ms", "ms", ".1f"),
                       ("ratio", "time / transformers", ".2f"), ("ktok_s", "ktok/s", ".1f"),
                       ("saved_mib", "saved MiB", ".1f")])
    write_json(args.out, {"benchmark": "linear_attention", "environment": environment(device), "args": vars(args),
                          "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
