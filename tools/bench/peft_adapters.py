"""Time of moving LoRA adapters between moekit and PEFT folders at real MoE sizes, against PEFT loading the same folder.

    python tools/bench/peft_adapters.py                                   # 2 Qwen3-30B-A3B-sized MoE layers
    python tools/bench/peft_adapters.py --layers 4 --experts 64 --hidden 1024 --ffn 512 --rank 16

Builds a Mixtral-style moekit model (random weights, --dtype) with rank --rank adapters on the attention and both
expert stacks, writes its base as an HF folder and its adapters with ``save_peft`` (per expert), then times, each
from a model already in memory (the checkpoint reads are not counted):

    export   moekit.models.hf.peft.save_peft: the HF factors of every adapter (the family's export rules on index
             probes) and the folder's write
    import   moekit.models.hf.peft_import.load_peft onto the base: the folder's read, every update mapped back to
             moekit's factors (``moekit-convert import-lora``)
    peft     the peer: peft.PeftModel.from_pretrained of the same folder onto transformers' model of the base
             (PEFT converts the per-expert adapters to transformers >= 5's fused experts), when peft is installed

"x peft" = peer time / this time. "same" checks that the import computes the LoRA model's logits.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from moekit.bench.benchlib import BenchParser, check_at_least, check_out, environment, print_table, write_json

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args(argv):
    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048, Qwen3-30B-A3B's)")
    p.add_argument("--ffn", type=int, default=768, help="expert FFN width (default 768)")
    p.add_argument("--experts", type=int, default=128, help="experts per layer (default 128)")
    p.add_argument("--layers", type=int, default=2, help="layers (default 2)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="weights' dtype (default bfloat16)")
    p.add_argument("--out", default="bench-results/peft_adapters.json")
    args = p.parse_args(argv)
    check_at_least(p, args, 1, "hidden", "ffn", "experts", "layers", "rank")
    if args.hidden % 128:
        p.error(f"--hidden {args.hidden} is invalid; use a multiple of 128 (heads of 128)")
    check_out(p, args.out)
    return args


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from moekit.models.config import preset
    from moekit.models.hf import load_hf, save_hf
    from moekit.models.hf.peft import save_peft
    from moekit.models.hf.peft_import import load_peft
    from moekit.models.lora import merge_lora
    from moekit.models.transformer import build_model

    dtype = DTYPES[args.dtype]
    heads = args.hidden // 128
    cfg = dataclasses.replace(preset("mixtral-tiny"), hidden_size=args.hidden, num_heads=heads,
                              num_kv_heads=max(1, heads // 8), head_dim=128, num_layers=args.layers,
                              num_experts=args.experts, top_k=min(8, args.experts), moe_ffn_hidden_size=args.ffn,
                              vocab_size=1024, lora_rank=args.rank, lora_targets="*.attn.*,*.experts.*")
    model = build_model(cfg, seed=0).to(dtype).eval()
    for n, p in model.named_parameters():
        if ".lora_b" in n:
            p.normal_(0.0, 0.02)
    rows = []
    with tempfile.TemporaryDirectory(prefix="moekit-bench-peft-") as tmp:
        tmp = Path(tmp)
        plain = copy.deepcopy(model)
        for n, p in plain.named_parameters():
            if ".lora_b" in n:
                p.zero_()
        save_hf(merge_lora(plain), tmp / "base")
        del plain
        _, export_s = _timed(lambda: save_peft(model, tmp / "adapter"))
        base = load_hf(tmp / "base", dtype=dtype)
        _, import_s = _timed(lambda: load_peft(base, tmp / "adapter"))
        ids = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
        want = model(ids).float()
        same = ((base(ids).float() - want).norm() / want.norm()).item()
        peft_s = None
        try:
            from peft import PeftModel
            from transformers import AutoModelForCausalLM
        except ImportError:
            print("peft / transformers not installed: no peer")
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hf = AutoModelForCausalLM.from_pretrained(tmp / "base", dtype=dtype)
                _, peft_s = _timed(lambda: PeftModel.from_pretrained(hf, str(tmp / "adapter")))
    shape = f"{args.layers} x {args.experts} x [{args.hidden}, {args.ffn}] r{args.rank}"
    for what, seconds in (("export", export_s), ("import", import_s), ("peft", peft_s)):
        if seconds is not None:
            rows.append({"step": what, "shape": shape, "seconds": seconds,
                         "x_peft": peft_s / seconds if peft_s else None,
                         "rel_err": same if what == "import" else None})
    print_table(rows, [("step", "step", "s"), ("shape", "model", "s"), ("seconds", "time s", ".3f"),
                       ("x_peft", "x peft", ".2f"), ("rel_err", "same", ".1e")])
    write_json(args.out, {"benchmark": "peft_adapters", "args": vars(args),
                          "environment": environment(torch.device("cpu")), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
