"""Many prompts: decoding them in left-padded batches against one at a time, and against transformers' batched
``generate``, in the same run: ``python tools/bench/batch_generate.py``.

    python tools/bench/batch_generate.py                          # CPU, three tiny presets, 24 prompts, ~a minute
    python tools/bench/batch_generate.py --device cuda --dtype bfloat16 --presets mixtral-1b --max-seq-len 2048 \\
        --prompts 256 --prompt-len 64 512 --new-tokens 256 --batch-sizes 16 64 --out bench-results/batch_gen.json

Each case builds the preset (random weights from --seed), routes dropless in eval mode as moekit-generate does,
draws --prompts random prompts with lengths uniform in --prompt-len LO HI, and decodes --new-tokens greedy tokens
after each (no end token: every prompt runs the full length, so the work is the same in every mode):

- ``alone``: ``moekit.train.decoding.generate`` on each prompt in turn (moekit-generate --prompt, or --prompts with
  --batch-size 1);
- ``batch B``: ``generate_many`` with batch size B (moekit-generate --prompts --batch-size B): prompts sorted by
  length, left-padded into batches over one KV cache;
- ``hf B`` (when transformers is installed and the preset exports to an HF family): the model saved with
  ``save_hf`` and loaded by transformers, whose ``generate`` decodes batches of B left-padded prompts (its own KV
  cache, an attention mask) in the same order.

The modes are timed round-robin (benchlib.time_interleaved). "tok/s" counts new tokens over the whole decode,
prefills included; "x alone" = tokens/s over the ``alone`` mode's. "tokens = alone" is the share of a mode's tokens
equal to ``alone``'s, position by position (JSON: ``agree``, and ``same`` when all are). Batching changes only
rounding, so a greedy pick may flip on a near-tie in float32 or bfloat16 and change the rest of that row; in
float64 the tokens are identical (tests/test_batch_generate.py). transformers' rounding differs from moekit's in
the same way.
"""
from __future__ import annotations

import argparse
import sys
import tempfile

import torch

from moekit.bench.benchlib import (BenchParser, check_at_least, check_device, check_names, check_out, environment,
                                   print_table, time_interleaved, write_json)
from moekit.bench.generate import build
from moekit.models.config import PRESETS
from moekit.train.decoding import FILLER_ID, generate_many
from moekit.train.inference import DTYPES

DEFAULT_PRESETS = ["mixtral-tiny", "gpt-oss-tiny", "qwen3.5-tiny"]


def parse_args(argv):
    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--presets", nargs="+", default=DEFAULT_PRESETS,
                   help=f"model presets, of {', '.join(PRESETS)} (default: {' '.join(DEFAULT_PRESETS)})")
    p.add_argument("--prompts", type=int, default=24, help="prompts per case (default 24)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[8, 96], metavar=("LO", "HI"),
                   help="prompt lengths drawn uniformly in [LO, HI] (default 8 96)")
    p.add_argument("--new-tokens", type=int, default=24, help="tokens decoded after each prompt (default 24)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 12], help="batch sizes (default 4 12)")
    p.add_argument("--max-seq-len", type=int, default=256, help="the model's context window (default 256)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default: cuda when there is a GPU)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (default 1)")
    p.add_argument("--warmup", type=int, default=0, help="untimed rounds besides the first (default 0)")
    p.add_argument("--repeats", type=int, default=2, help="timed rounds (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/batch_generate.json")
    args = p.parse_args(argv)
    check_names(p, "--presets", args.presets, PRESETS)
    check_at_least(p, args, 1, "prompts", "new_tokens", "batch_sizes", "threads", "repeats")
    check_at_least(p, args, 0, "warmup")
    lo, hi = args.prompt_len
    if not 1 <= lo <= hi:
        p.error(f"--prompt-len {lo} {hi} is invalid; use 1 <= LO <= HI")
    if hi + args.new_tokens > args.max_seq_len:
        p.error(f"--prompt-len up to {hi} plus --new-tokens {args.new_tokens} exceeds --max-seq-len "
                f"{args.max_seq_len}; every prompt must fit beside its answer (longer ones decode alone)")
    check_device(p, args.device)
    check_out(p, args.out)
    return args


def hf_peer(model, args, device):
    """(transformers' model of the same weights, None) or (None, why not)."""
    if args.no_hf:
        return None, "--no-hf"
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None, "transformers is not installed"
    from moekit.models.hf import check_hf_exportable, save_hf

    try:
        check_hf_exportable(model)
    except Exception as exc:  # noqa: BLE001  (any refusal: no peer for this preset, said in the table's note)
        return None, f"no HF family for it ({str(exc).splitlines()[0][:80]})"
    with tempfile.TemporaryDirectory() as folder:
        save_hf(model, folder)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[args.dtype]).to(device).eval()
    return hf, None


@torch.inference_mode()
def hf_generate(hf, prompts: list[list[int]], new: int, batch_size: int, device) -> list[list[int]]:
    """transformers' greedy batched generate over the prompts sorted by length (as generate_many sorts them),
    left-padded with an attention mask, exactly ``new`` tokens each."""
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    out: list[list[int]] = [[] for _ in prompts]
    for b in range(0, len(order), batch_size):
        rows = order[b : b + batch_size]
        P = max(len(prompts[i]) for i in rows)
        ids = torch.tensor([[FILLER_ID] * (P - len(prompts[i])) + prompts[i] for i in rows], device=device)
        mask = torch.tensor([[0] * (P - len(prompts[i])) + [1] * len(prompts[i]) for i in rows], device=device)
        got = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=FILLER_ID, eos_token_id=None)
        for j, i in enumerate(rows):
            out[i] = got[j, P:].tolist()
    return out


def bench_case(name: str, model, args, device) -> list[dict]:
    gen = torch.Generator().manual_seed(args.seed)
    lo, hi = args.prompt_len
    lengths = torch.randint(lo, hi + 1, (args.prompts,), generator=gen).tolist()
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    new = args.new_tokens
    runs = {"alone": lambda: [g.new_ids for g in generate_many(model, prompts, new, batch_size=1)]}
    for B in args.batch_sizes:
        runs[f"batch{B}"] = lambda B=B: [g.new_ids for g in generate_many(model, prompts, new, batch_size=B)]
    hf, why = hf_peer(model, args, device)
    if hf is not None:
        for B in args.batch_sizes:
            runs[f"hf{B}"] = lambda B=B: hf_generate(hf, prompts, new, B, device)
    first = {mode: run() for mode, run in runs.items()}  # also the first warm-up round
    times = time_interleaved(runs, device, args.warmup, args.repeats)
    total = args.prompts * new
    alone_tok_s = total / (times["alone"]["median_ms"] / 1e3)
    rows = []
    for mode, t in times.items():
        tok_s = total / (t["median_ms"] / 1e3)
        kind = "hf" if mode.startswith("hf") else "moekit"
        B = 1 if mode == "alone" else int(mode.removeprefix("hf").removeprefix("batch"))
        agree = [a == b for x, y in zip(first[mode], first["alone"]) for a, b in zip(x, y)]
        rows.append({"preset": name, "impl": kind, "batch": B, "prompts": args.prompts,
                     "prompt_len": f"{lo}-{hi}", "new_tokens": new, "ms": t["median_ms"], "tok_s": tok_s,
                     "vs_alone": tok_s / alone_tok_s, "same": first[mode] == first["alone"],
                     "agree": sum(agree) / max(len(agree), 1)})
    if why:
        print(f"note: {name}: no transformers peer: {why}", file=sys.stderr)
    return rows


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    rows = []
    payload = {"benchmark": "batch_generate", "environment": environment(device), "args": vars(args),
               "results": rows}
    for name in args.presets:
        rows.extend(bench_case(name, build(name, args, device), args, device))
        write_json(args.out, {**payload, "partial": True}, quiet=True)
    print_table(rows, [("preset", "model", "s"), ("impl", "impl", "s"), ("batch", "batch", "d"),
                       ("prompt_len", "prompt len", "s"), ("new_tokens", "new", "d"), ("tok_s", "tok/s", ".1f"),
                       ("vs_alone", "x alone", ".2f"), ("agree", "tokens = alone", ".1%")])
    write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
