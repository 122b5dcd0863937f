"""Decoding speed with and without the KV cache, in the same run: ``python tools/bench/generate.py``.

    python tools/bench/generate.py                                 # CPU, the three tiny presets, seconds
    python tools/bench/generate.py --device cuda --dtype bfloat16 --presets mixtral-1b --max-seq-len 2048 \\
        --prompt-len 512 --new-tokens 256 1024 --out bench-results/generate.json
    python tools/bench/generate.py --presets --runs runs/ds-mtp    # a trained run: + speculative decoding
    python tools/bench/generate.py --presets --runs runs/ds-mtp2 --draft-depths 1 2   # chains of 1 and 2 drafts

Each case builds the preset (random weights from --seed: speed does not depend on training), routes
dropless in eval mode as moekit-generate does (moekit.train.inference), and decodes --new-tokens greedy
tokens after a random --prompt-len prompt with ``moekit.train.decoding.generate``: once with the KV cache
(the prompt once, then one position per step) and once recomputing the whole window every step
(--no-cache). The two are timed round-robin (benchlib.time_interleaved), so background load hits both
alike; "speedup" = cache tokens/s / no-cache tokens/s. tokens/s counts the new tokens over the whole
decode, the prompt's forward included. "same" checks the greedy tokens agree (they must: the cached
logits equal the full forward's up to rounding).

Models with multi-token-prediction depths (a trained run with --model.mtp_layers, --runs; or a preset with
--mtp-layers N, random weights) also decode with ``generate_speculative`` (moekit-generate --speculative), once
per --draft-depths count N (chains of N drafts; default: all the model's depths; counts above a model's depths
are skipped for it), all timed in the same round-robin as the plain cached decode: one row per count, with
"spec tok/s", "spec x" = speculative / cache tokens/s of the same round-robin, the share of each depth's drafts
accepted and the tokens per main-model forward; "same" then also checks their greedy tokens. Acceptance decides
the speed-up, so random weights only show the drafting overhead: measure trained runs.

--threads (default 1): intra-op threads on CPU. Tiny models gain nothing from more, and on a shared
machine a second thread that waits for a busy core makes every small op slower and the timings noisy.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from moekit.bench.benchlib import (BenchParser, check_at_least, check_device, check_names, check_out, environment,
                                   print_table, time_interleaved, write_json)
from moekit.models.config import PRESETS, preset
from moekit.models.transformer import build_model
from moekit.train.decoding import generate, generate_speculative
from moekit.train.inference import DTYPES, cast_parameters, inference_routing

DEFAULT_PRESETS = ["mixtral-tiny", "switch-tiny", "deepseek-tiny"]


def parse_args(argv):
    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--presets", nargs="*", default=DEFAULT_PRESETS,
                   help=f"model presets, of {', '.join(PRESETS)} (default: the tiny ones; none: only --runs)")
    p.add_argument("--runs", nargs="*", default=[], metavar="PATH",
                   help="trained models too: run directories, checkpoints or HF folders (as moekit-generate reads "
                        "them; their max_seq_len is kept)")
    p.add_argument("--mtp-layers", type=int, default=0, metavar="N",
                   help="build the presets with N multi-token-prediction depths (speculative decoding; default 0)")
    p.add_argument("--draft-depths", type=int, nargs="+", default=None, metavar="N",
                   help="speculative decoding with chains of N drafts, one row per N (default: all the model's depths)")
    p.add_argument("--max-seq-len", type=int, default=256, help="the model's context window (default 256)")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (default 16)")
    p.add_argument("--new-tokens", type=int, nargs="+", default=[32, 96], help="tokens to decode (default 32 96)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default: cuda when there is a GPU)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (default 1; see above)")
    p.add_argument("--warmup", type=int, default=0, help="untimed rounds besides the first (default 0)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/generate.json")
    args = p.parse_args(argv)
    check_names(p, "--presets", args.presets, PRESETS)
    check_at_least(p, args, 1, "new_tokens", "prompt_len", "threads", "repeats", "draft_depths")
    check_at_least(p, args, 2, "max_seq_len")
    check_at_least(p, args, 0, "warmup", "mtp_layers")
    if not args.presets and not args.runs:
        p.error("nothing to measure: name --presets, --runs or both")
    check_device(p, args.device)
    check_out(p, args.out)
    return args


def build(name: str, args, device: torch.device) -> torch.nn.Module:
    """The preset at args.max_seq_len (args.mtp_layers depths, if the flags have it) in args.dtype, random weights from
    args.seed, in eval mode and routed as moekit-generate routes (also tools/bench/batch_generate.py's models)."""
    cfg = preset(name)
    cfg.max_seq_len = args.max_seq_len
    cfg.mtp_layers = getattr(args, "mtp_layers", 0)
    model = build_model(cfg, device, seed=args.seed)
    cast_parameters(model, DTYPES[args.dtype])
    inference_routing(model)  # eval mode, dropless: what moekit-generate runs
    return model


def draft_depth_counts(model, args) -> list[int]:
    """The --draft-depths counts this model can run (all its depths by default; none without MTP depths)."""
    depths = len(model.mtp)
    if args.draft_depths is None:
        return [depths] if depths else []
    return [n for n in args.draft_depths if n <= depths]


def bench_case(model, name: str, prompt: list[int], new: int, args, device) -> list[dict]:
    """One row per draft-depth count (one row without MTP depths), all from one round-robin."""
    runs = {mode: (lambda cache=cache: generate(model, prompt, new, use_cache=cache))
            for mode, cache in (("cache", True), ("no_cache", False))}
    counts = draft_depth_counts(model, args)
    for n in counts:
        runs[f"spec{n}"] = lambda n=n: generate_speculative(model, prompt, new, draft_depths=n)
    first = {mode: run() for mode, run in runs.items()}  # also the first warm-up round
    cached = first["cache"]
    times = time_interleaved(runs, device, args.warmup, args.repeats)
    tok_s = {mode: len(cached.new_ids) / (t["median_ms"] / 1e3) for mode, t in times.items()}
    row = {"preset": name, "prompt": len(prompt), "new_tokens": new, "generated": len(cached.new_ids),
           "same": all(out.new_ids == cached.new_ids for out in first.values())}
    for mode in ("cache", "no_cache"):
        row.update({f"{mode}_ms": times[mode]["median_ms"], f"{mode}_tok_s": tok_s[mode]})
    row["speedup"] = row["cache_tok_s"] / row["no_cache_tok_s"]
    rows = []
    for n in counts:
        spec = first[f"spec{n}"]
        rows.append({**row, "draft_depths": n, "spec_ms": times[f"spec{n}"]["median_ms"],
                     "spec_tok_s": tok_s[f"spec{n}"], "spec_speedup": tok_s[f"spec{n}"] / row["cache_tok_s"],
                     "acceptance": spec.acceptance, "acceptance_by_depth": spec.acceptance_by_depth,
                     "tokens_per_forward": spec.tokens_per_forward})
    return rows or [row]


def load_run(path: str, args) -> torch.nn.Module:
    """A trained model as moekit-generate loads it (its tokenizer is not needed: the prompt is random ids)."""
    from moekit.train.inference import load_for_inference

    model, _, _ = load_for_inference(path, args.device, args.dtype, warn=lambda msg: None)
    return model


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    rows = []
    payload = {"benchmark": "generate", "environment": environment(device), "args": vars(args), "results": rows}
    models = [(name, lambda name=name: build(name, args, device)) for name in args.presets]
    models += [(Path(path).name, lambda path=path: load_run(path, args)) for path in args.runs]
    for name, make in models:
        model = make()
        vocab = model.config.vocab_size
        prompt = torch.randint(0, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(args.seed))
        skipped = sorted(set(args.draft_depths or []) - set(draft_depth_counts(model, args)))
        if skipped:
            print(f"note: {name} has {len(model.mtp)} MTP depths: no chains of {skipped} drafts", file=sys.stderr)
        for new in args.new_tokens:
            rows.extend(bench_case(model, name, prompt.tolist(), new, args, device))
            write_json(args.out, {**payload, "partial": True}, quiet=True)
    columns = [("preset", "model", "s"), ("prompt", "prompt", "d"), ("new_tokens", "new", "d"),
               ("cache_tok_s", "cache tok/s", ".1f"), ("no_cache_tok_s", "no-cache tok/s", ".1f"),
               ("speedup", "speedup", ".2f")]
    shown = rows
    if any("spec_tok_s" in r for r in rows):
        columns += [("draft_depths", "drafts", "d"), ("spec_tok_s", "spec tok/s", ".1f"),
                    ("spec_speedup", "spec x", ".2f"), ("accepted", "accepted by depth", "s"),
                    ("tokens_per_forward", "tok/fwd", ".2f")]
        shown = [{**r, "accepted": " / ".join(f"{a:.0%}" for a in r["acceptance_by_depth"])} if "spec_tok_s" in r
                 else r for r in rows]
    print_table(shown, columns + [("same", "same tokens", "")])
    write_json(args.out, payload)
    if not all(r["same"] for r in rows):
        print("error: cached, uncached (and speculative) greedy decoding disagree", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
