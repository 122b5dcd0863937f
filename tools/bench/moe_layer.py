"""MoE layer forward+backward: moekit vs a torchtitan-style reference and transformers' Mixtral block.

    python tools/bench/moe_layer.py                       # CPU: T=4096 H=256, (F=512,E=8,k=2) and (F=128,E=64,k=8)
    python tools/bench/moe_layer.py --device cuda --dtype bfloat16 --tokens 8192 32768 \\
        --shapes 4096x14336x8x2 2048x768x128x8 1536x256x128x8 --out bench-results/moe_layer.json
    python tools/bench/moe_layer.py --device cuda --dtype bfloat16 --tokens 8192 --shapes gpt-oss-20b

Shapes are FxExk (hidden from --hidden) or HxFxExk. Every implementation runs the same function on the
same weights: top-k softmax routing with renormalised weights (Mixtral), SwiGLU experts, no capacity
dropping, no aux loss. A shape prefixed "gpt-oss:" (e.g. gpt-oss:2880x2880x32x4, which "gpt-oss-20b" names)
is gpt-oss's block instead: a router bias, per-expert biases (random, not the zeros they start at) and
swiglu_oai, against transformers' GptOssMLP. Implementations, timed round-robin in one run:
  moekit[auto->...], moekit[torch], moekit[loop]   MoELayer with each expert backend
  moekit[triton+fused]   the Triton backend with the permute fused into the expert GEMMs, ScatterMoE-style
                (moe.experts.FUSED_PERMUTE "always" for this module): the gather into the first, the routing
                weights into the last; its phases "experts_fused" + "combine_sum" replace permute + experts +
                combine (layer_probes.py)
  titan-style   router + torch argsort/index permute + torch grouped_mm + scatter_add unpermute
                (tools/bench/titan_ref.py; shares the MoELayer's parameters; plain SwiGLU shapes only)
  transformers[eager|grouped_mm]   MixtralSparseMoeBlock (GptOssMLP for gpt-oss) with the weights copied in
"time / moekit" is each peer's median over moekit[auto]'s, so > 1 means moekit is faster. Each case also
records: max |err| against the first peer and the relative error of the output and of dx against an
fp32 moekit[loop] run; moekit's per-phase times (router, permute, experts, combine; layer_probes.py);
host syncs under torch.cuda.set_sync_debug_mode("error") (GPU); activation bytes saved for backward per
implementation against the computed minimum.
"""
from __future__ import annotations

import argparse
import copy
import sys

import torch

from moekit.bench.benchlib import (BenchParser, add_timing_args, check_at_least, check_names, check_timing_args,
                                   environment, guarded, hf_experts_implementations, print_table, time_interleaved,
                                   write_json)
from moekit.bench.layer_probes import (FUSED_PHASES, PHASES, device_times, fused_permute_on, host_sync_check, minimum_activation_bytes,
                                       phase_steps, saved_activation_bytes)
from moekit.moe import MoELayer, build_router
from moekit.moe.experts import available_backends, resolve_backend
from moekit.bench.titan_ref import TitanStyleMoE

DEFAULT_SHAPES = ["512x8x2", "128x64x8"]  # F x E x k
GPT_OSS = "gpt-oss:"  # a shape entry's prefix: gpt-oss's block (biases, swiglu_oai)
NAMED_SHAPES = {"gpt-oss-20b": "gpt-oss:2880x2880x32x4"}  # gpt-oss-20b's MoE layer (H = F = 2880, E 32, top-4)
# gpt-oss's block in moekit's terms (tests/test_expert_bias.py checks it against GptOssMLP)
GPT_OSS_ROUTER = dict(score="softmax", normalize=True, gate_bias=True)
GPT_OSS_EXPERTS = dict(activation="swiglu_oai", ffn_bias=True)


def parse_shape(text: str, hidden: int = 256, entry: str | None = None) -> tuple[int, int, int, int]:
    """'FxExk' (hidden from --hidden) or 'HxFxExk' -> (H, F, E, k); ValueError naming the entry (``entry``, the
    whole --shapes entry ``text`` came from, when that differs) otherwise."""
    entry = text if entry is None else entry
    try:
        vals = [int(v) for v in text.lower().split("x")]
    except ValueError:
        vals = []
    if len(vals) not in (3, 4):
        raise ValueError(f"--shapes entry {entry!r} is not FxExk or HxFxExk (e.g. 512x8x2 or 4096x14336x8x2), "
                         f"optionally prefixed {GPT_OSS!r}, nor one of {sorted(NAMED_SHAPES)}")
    h, f, e, k = vals if len(vals) == 4 else [hidden, *vals]
    if not (0 < k <= e and f > 0 and h > 0):
        raise ValueError(f"--shapes entry {entry!r} needs H, F > 0 and 0 < k <= E")
    return h, f, e, k


def parse_entry(text: str, hidden: int = 256) -> tuple[int, int, int, int, bool]:
    """A --shapes entry -> (H, F, E, k, gpt_oss): a NAMED_SHAPES name, or parse_shape's forms, optionally
    prefixed "gpt-oss:"; ValueError naming the entry otherwise."""
    spec = NAMED_SHAPES.get(text.lower(), text)
    oai = spec.lower().startswith(GPT_OSS)
    return (*parse_shape(spec[len(GPT_OSS):] if oai else spec, hidden, entry=text), oai)


class GptOssPeer(torch.nn.Module):
    """transformers' GptOssMLP returning its hidden states alone (it returns them with the router scores), as
    the other blocks do: the benchmarks call ``block(x)`` and backpropagate from it."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return self.mlp(x)[0]


def gpt_oss_block(hidden: int, ffn: int, experts: int, top_k: int, implementation: str):
    """transformers' GptOssMLP (in a GptOssPeer), or None when transformers (or gpt-oss in it) is missing. Its
    experts take both implementations: transformers registers them has_bias=True, is_transposed=True."""
    try:
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    except ImportError:
        return None
    cfg = GptOssConfig(hidden_size=hidden, intermediate_size=ffn, num_local_experts=experts,
                       num_experts_per_tok=top_k, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=8, vocab_size=32)  # attention fields unused here
    cfg._experts_implementation = implementation
    return GptOssPeer(GptOssMLP(cfg))


def randomize_biases(layer: MoELayer, gen: torch.Generator) -> None:
    """Random router and expert biases: they start at 0, where a peer that dropped one would still agree.
    Magnitudes of the layer's own terms (logits, h ~ 1; the output's expert bias smaller), so routing and
    the clamp of swiglu_oai see realistic values."""
    with torch.no_grad():
        for p, std in ((layer.router.bias, 0.5), (layer.experts.b_in, 0.5), (layer.experts.b_out, 0.1)):
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def hf_block(hidden: int, ffn: int, experts: int, top_k: int, implementation: str, gpt_oss: bool = False):
    """transformers' MixtralSparseMoeBlock (gpt_oss: GptOssMLP), or None when transformers is not installed."""
    if gpt_oss:
        return gpt_oss_block(hidden, ffn, experts, top_k, implementation)
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
    """moekit stores x @ w (w_in [E, H, 2F], w_out [E, F, H]); transformers stores linear weights (transposed).
    A shared expert (and its gate) goes to the block's ``shared_expert`` (Qwen2-MoE's block). GptOssMLP stores
    x @ w as moekit does, with gate and up columns interleaved (gate 2j, up 2j + 1) and biases."""
    if isinstance(block, GptOssPeer):
        _copy_into_gpt_oss(layer, block.mlp)
        return
    with torch.no_grad():
        block.gate.weight.copy_(layer.router.weight)
        block.experts.gate_up_proj.copy_(layer.experts.w_in.transpose(1, 2))
        block.experts.down_proj.copy_(layer.experts.w_out.transpose(1, 2))
        if layer.shared_expert is not None:
            s, b = layer.shared_expert, block.shared_expert
            b.gate_proj.weight.copy_(s.w_gate.weight)
            b.up_proj.weight.copy_(s.w_up.weight)
            b.down_proj.weight.copy_(s.w_out.weight)
            if s.gate is not None:
                block.shared_expert_gate.weight.copy_(s.gate.weight)


def _copy_into_gpt_oss(layer: MoELayer, mlp) -> None:
    ex, hx = layer.experts, mlp.experts
    F = ex.ffn_hidden_size
    with torch.no_grad():
        mlp.router.weight.copy_(layer.router.weight)
        mlp.router.bias.copy_(layer.router.bias)
        for w, b in ((hx.gate_up_proj, ex.w_in), (hx.gate_up_proj_bias, ex.b_in)):  # [gate | up] -> interleaved
            w[..., 0::2].copy_(b[..., :F])
            w[..., 1::2].copy_(b[..., F:])
        hx.down_proj.copy_(ex.w_out)
        hx.down_proj_bias.copy_(ex.b_out)


def fwd_bwd(module, x: torch.Tensor, grad: torch.Tensor):
    def step():
        x.grad = None
        module.zero_grad(set_to_none=True)
        module(x).backward(grad)

    return step


def moekit_layer(H, F, E, k, backend="auto", gpt_oss=False):
    router = build_router("topk", H, E, top_k=k, aux_loss_coeff=0.0, **(GPT_OSS_ROUTER if gpt_oss else {}))
    return MoELayer(H, F, E, router, backend=backend, **(GPT_OSS_EXPERTS if gpt_oss else {}))


class FusedPermute(torch.nn.Module):
    """A MoELayer run with moe.experts.FUSED_PERMUTE = "always" (only its forward reads the switch)."""

    def __init__(self, layer: MoELayer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        with fused_permute_on():
            return self.layer(x)


def build_impls(args, H, F, E, k, device, dtype, gpt_oss=False) -> tuple[MoELayer, dict, dict]:
    """(the moekit[auto] layer, name -> module, name -> why it was skipped)."""
    torch.manual_seed(args.seed)
    layer = moekit_layer(H, F, E, k, gpt_oss=gpt_oss)
    if gpt_oss:
        randomize_biases(layer, torch.Generator().manual_seed(args.seed))
    layer = layer.to(device, dtype)
    modules, skipped = {}, {}
    x0 = torch.zeros(1, H, device=device, dtype=dtype)
    for backend in args.backends:
        chosen, err = guarded(lambda: resolve_backend(backend, x0, layer.experts.w_in, layer.experts.w_out).name)
        if err:
            skipped[f"moekit[{backend}]"] = err
            continue
        name = f"moekit[{backend}->{chosen}]" if backend == "auto" else f"moekit[{backend}]"
        if backend == "auto":
            modules[name] = layer
        else:
            modules[name] = moekit_layer(H, F, E, k, backend, gpt_oss).to(device, dtype)
            modules[name].load_state_dict(layer.state_dict())
    if "fused" in args.peers:
        fused = moekit_layer(H, F, E, k, "triton", gpt_oss).to(device, dtype)
        fused.load_state_dict(layer.state_dict())
        name = "moekit[triton+fused]"
        with fused_permute_on():
            why = "" if fused.experts.takes_gather(x0) else "the triton backend cannot run here"
        if why:
            skipped[name] = why
        else:
            modules[name] = FusedPermute(fused)
    if "titan" in args.peers:
        ref = moekit_layer(H, F, E, k, gpt_oss=gpt_oss).to(device, dtype)
        ref.load_state_dict(layer.state_dict())
        modules["titan-style"], err = guarded(lambda: TitanStyleMoE(ref))
        if err:
            del modules["titan-style"]
            skipped["titan-style"] = err
    for impl in args.hf_impl:
        block, err = guarded(lambda: hf_block(H, F, E, k, impl, gpt_oss))
        if block is None:
            skipped[f"transformers[{impl}]"] = err or "transformers is not installed"
            continue
        block = block.to(device, dtype)
        copy_into_hf(layer, block)
        modules[f"transformers[{impl}]"] = block
    return layer, modules, skipped


def numerics(layer, modules, x, grad) -> tuple[dict, dict]:
    """One forward+backward of each module (the trial run: a module that fails here is dropped from
    timing), compared with the first module and with an fp32 moekit[loop] copy of the layer."""
    ref32 = copy.deepcopy(layer).float()
    ref32.set_backend("loop")
    x32 = x.detach().float().requires_grad_()
    y32 = ref32(x32)
    y32.backward(grad.float())
    checks, failed, first = {}, {}, None
    for name, module in modules.items():
        def run():
            x.grad = None
            y = module(x)
            y.backward(grad)
            return y.detach().float(), x.grad.detach().float()

        res, err = guarded(run)
        if err:
            failed[name] = err
            continue
        y, dx = res
        first = first if first is not None else y
        checks[name] = {  # D2H sync: benchmark check, outside timing
            "max_abs_err": (y - first).abs().max().item(),
            "rel_err_vs_fp32": ((y - y32).norm() / y32.norm().clamp_min(1e-30)).item(),
            "grad_rel_err_vs_fp32": ((dx - x32.grad).norm() / x32.grad.norm().clamp_min(1e-30)).item(),
        }
    del ref32, y32, x32
    return checks, failed


def bench_case(args, tokens, H, F, E, k, device, dtype, gpt_oss=False) -> tuple[list[dict], dict]:
    layer, modules, skipped = build_impls(args, H, F, E, k, device, dtype, gpt_oss)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    x = torch.randn(1, tokens, H, generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(1, tokens, H, generator=gen).to(device, dtype)
    checks, failed = numerics(layer, modules, x, grad)
    skipped.update(failed)
    modules = {n: m for n, m in modules.items() if n in checks}
    for m in modules.values():
        m.train()
    shape = case_name(tokens, H, F, E, k, gpt_oss)
    auto = next((n for n in modules if n.startswith("moekit[auto")), None)
    steps = {n: fwd_bwd(m, x, grad) for n, m in modules.items()}
    phases = phase_steps(layer, x.detach().view(tokens, H)) if auto else {}
    timings = time_interleaved({**steps, **{f"phase:{p}": s for p, s in phases.items()}}, device,
                               warmup=args.warmup, repeats=args.repeats)
    base = timings[auto]["median_ms"] if auto else None
    rows = [{"shape": shape, "tokens": tokens, "H": H, "F": F, "E": E, "k": k, "gpt_oss": gpt_oss, "impl": n,
             **checks[n], **timings[n],
             "moekit_speedup": timings[n]["median_ms"] / base if base else None} for n in modules]
    case = {"shape": shape, "tokens": tokens, "H": H, "F": F, "E": E, "k": k, "gpt_oss": gpt_oss,
            "skipped": skipped,
            "minimum_activation_bytes": minimum_activation_bytes(tokens, H, F, E, k, x.element_size())}
    if auto:
        layer_ms = timings[auto]["median_ms"]
        case["phases_ms"] = {p: timings[f"phase:{p}"]["median_ms"] for p in PHASES}
        case["phases_share_of_layer"] = {p: t / layer_ms for p, t in case["phases_ms"].items()}
        case["router_permute_combine_share"] = sum(case["phases_share_of_layer"][p] for p in ("router", "permute", "combine"))
        if "experts_fused" in phases:  # the fused phases against the permute + experts + combine they replace
            fused = [p for p in FUSED_PHASES if p in phases]
            case["fused_phases_ms"] = {p: timings[f"phase:{p}"]["median_ms"] for p in fused}
            replaced = ("permute", "experts") + (("combine",) if "combine_sum" in fused else ())
            case["fused_vs_replaced"] = sum(case["fused_phases_ms"].values()) / sum(
                case["phases_ms"][p] for p in replaced)
        kernels = device_times({"layer": steps[auto], **phases}, device)  # GPU kernel time, no launch overhead
        if kernels:
            case["phases_kernel_ms"] = {p: kernels[p] for p in (*PHASES, *FUSED_PHASES) if p in kernels} | {
                "layer": kernels["layer"]}
            case["router_permute_combine_kernel_share"] = sum(kernels[p] for p in ("router", "permute", "combine")) / (
                kernels["layer"] or float("nan"))
        sync_steps = {"router": phases["router"], "permute": phases["permute"], "combine": phases["combine"],
                      **{f"layer {n}": s for n, s in steps.items() if n.startswith("moekit")}}
        case["host_syncs"] = host_sync_check(sync_steps, device)
    case["activation_bytes"] = {}
    for n, m in modules.items():
        mem, err = guarded(lambda: saved_activation_bytes(m, x.detach()))
        mem = mem or {"error": err}
        if "saved_tensors_bytes" in mem:
            mem["ratio_to_minimum"] = mem["saved_tensors_bytes"] / case["minimum_activation_bytes"]["total"]
        case["activation_bytes"][n] = mem
    return rows, case


def case_name(tokens, H, F, E, k, gpt_oss=False) -> str:
    return f"T{tokens} H{H} F{F} E{E} k{k}" + (" gpt-oss" if gpt_oss else "")


def print_case_details(cases: list[dict]) -> None:
    for c in cases:
        if "error" in c:  # e.g. out of memory: the other cases still ran
            print(f"\n{c['shape']}: failed: {c['error']}")
            continue
        print(f"\n{c['shape']}: per-phase (moekit[auto], each fwd+bwd alone) and activation memory")
        if "phases_ms" in c:
            cells = [f"{p} {c['phases_ms'][p]:.2f} ms ({100 * c['phases_share_of_layer'][p]:.0f}%)" for p in PHASES]
            print("  " + ", ".join(cells) + f"; router+permute+combine {100 * c['router_permute_combine_share']:.1f}%"
                  " of the layer (target <= 10%)")
            if "phases_kernel_ms" in c:
                km = c["phases_kernel_ms"]
                print("  GPU kernel time (profiler, no launch overhead): " + ", ".join(
                    f"{p} {km[p]:.2f} ms" for p in PHASES) + f", layer {km['layer']:.2f} ms; router+permute+combine "
                    f"{100 * c['router_permute_combine_kernel_share']:.1f}% of the layer's kernel time")
            if "fused_phases_ms" in c:
                fused = c["fused_phases_ms"]
                replaced = ("permute", "experts") + (("combine",) if "combine_sum" in fused else ())
                km = c.get("phases_kernel_ms", {})
                kern = (f"; GPU kernel time {sum(km[p] for p in fused):.2f} against "
                        f"{sum(km[p] for p in replaced):.2f} ms" if all(p in km for p in fused) else "")
                print(f"  fused permute ({' + '.join(fused)}): {sum(fused.values()):.2f} ms = "
                      f"{c['fused_vs_replaced']:.2f}x {' + '.join(replaced)}{kern}")
            print("  host syncs: " + ", ".join(f"{n}: {v}" for n, v in c["host_syncs"].items()))
        minimum = c["minimum_activation_bytes"]["total"]
        for n, m in c["activation_bytes"].items():
            ratio = m.get("ratio_to_minimum")
            extra = f", CUDA allocator {m['cuda_allocated_bytes'] / 2**20:.1f} MiB" if "cuda_allocated_bytes" in m else ""
            print(f"  {n}: saved {m.get('saved_tensors_bytes', 0) / 2**20:.1f} MiB = "
                  f"{ratio:.2f}x the minimum {minimum / 2**20:.1f} MiB{extra}" if ratio else f"  {n}: {m}")
        for n, why in c["skipped"].items():
            print(f"  skipped {n}: {why}")


def main(argv=None) -> int:
    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096])
    p.add_argument("--hidden", type=int, default=256, help="H for FxExk shape entries")
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES,
                   help=f"FxExk or HxFxExk entries, prefixed {GPT_OSS!r} for gpt-oss's block; or one of "
                        f"{sorted(NAMED_SHAPES)}")
    p.add_argument("--backends", nargs="+", default=["auto", "torch", "loop"],
                   help=f"moekit expert backends to time, of {', '.join(available_backends())} ('auto' is always "
                        "included: ratios are against it)")
    p.add_argument("--peers", nargs="*", default=["titan", "fused"], choices=["titan", "fused"],
                   help="'titan' adds the torchtitan-style reference; 'fused' moekit's Triton experts with the "
                        "permute fused into the expert GEMMs, ScatterMoE-style (MOEKIT_FUSED_PERMUTE)")
    p.add_argument("--hf-impl", nargs="*", default=["eager", "grouped_mm"],
                   help="transformers experts implementations to time (eager = its per-expert loop)")
    add_timing_args(p, out="bench-results/moe_layer.json")
    args = p.parse_args(argv)
    check_at_least(p, args, 1, "tokens", "hidden")
    device, dtype = check_timing_args(p, args), getattr(torch, args.dtype)
    check_names(p, "--backends", args.backends, available_backends())
    args.backends = ["auto"] + [b for b in args.backends if b != "auto"]
    shapes = []
    for shape in args.shapes:  # all of them now: a bad entry must not wait for the cases before it
        try:
            shapes.append(parse_entry(shape, args.hidden))
        except ValueError as exc:
            p.error(str(exc))
    hf_impls = hf_experts_implementations() if args.hf_impl else None
    if hf_impls is not None:  # without transformers each block is reported as skipped
        check_names(p, "--hf-impl", args.hf_impl, hf_impls)
    rows, cases = [], []
    payload = {"benchmark": "moe_layer_fwd_bwd", "dtype": args.dtype, "environment": environment(device)}
    for tokens in args.tokens:
        for dims in shapes:
            res, err = guarded(lambda: bench_case(args, tokens, *dims[:4], device, dtype, dims[4]))
            r, c = res or ([], {"shape": case_name(tokens, *dims), "error": err})
            rows, cases = rows + r, cases + [c]
            write_json(args.out, {**payload, "partial": True, "results": rows, "cases": cases}, quiet=True)
            print(f"done {c['shape']}", file=sys.stderr, flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print_table(rows, [("shape", "shape", ""), ("impl", "implementation", ""), ("median_ms", "median ms", ".2f"),
                       ("min_ms", "min ms", ".2f"), ("moekit_speedup", "time / moekit", ".2f"),
                       ("max_abs_err", "max |err|", ".1e"), ("rel_err_vs_fp32", "rel err", ".1e"),
                       ("grad_rel_err_vs_fp32", "dx rel err", ".1e")])
    print_case_details(cases)
    write_json(args.out, {**payload, "results": rows, "cases": cases})
    return 0


if __name__ == "__main__":
    sys.exit(main())
