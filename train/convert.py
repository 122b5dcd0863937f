"""Convert checkpoints between HuggingFace folders and moekit: ``moekit-convert`` (or ``python tools/convert.py``).

    moekit-convert hf-to-moekit HF_DIR OUT.safetensors|OUT.pt [--dtype float32|bfloat16|auto] [--verify]
    moekit-convert moekit-to-hf SRC HF_DIR [--family F] [--tokenizer DIR] [--dtype ...] [--max-shard-size 5GB]
                                           [--layout per_expert|fused] [--fp8] [--ema] [--verify]
    moekit-convert average SRC SRC [...] | RUN_DIR --last K  -o OUT [--weights W,W,...] [--family F]
                                           [--tokenizer DIR] [--dtype ...] [--ema] [--verify]
    moekit-convert prune SRC --scores FILE --keep N -o OUT [--by gate|token|reap] [--family F] [--tokenizer DIR]
                                           [--dtype ...] [--verify]
    moekit-convert merge-lora SRC -o OUT [--family F] [--tokenizer DIR] [--ema] [--verify]
    moekit-convert export-lora SRC OUT [--family F] [--base NAME] [--dtype ...] [--ema] [--layout L] [--verify]
    moekit-convert import-lora BASE ADAPTER -o OUT [--dtype ...] [--verify]

merge-lora folds a LoRA fine-tune's adapters (model.lora_rank > 0, moekit.models.lora) into the weights: OUT is the
plain model (a moekit file to start a full fine-tune from with --train.init_from, or an HF folder; moekit-to-hf
folds them as well). export-lora writes the adapters alone as a PEFT adapter folder (adapter_config.json +
adapter_model.safetensors) for the HF checkpoint of the base weights, the per-expert layout vLLM, SGLang and PEFT load
(moekit.models.hf.peft). import-lora goes the other way: a PEFT LoRA adapter (from the Hub or PEFT's
save_pretrained, per-expert or on transformers >= 5's fused experts) put on the moekit model of BASE, the HF folder
it was trained on, as a moekit file with adapters: fine-tune on with ``moekit-train --train.init_from OUT``, generate,
evaluate, or merge (moekit.models.hf.peft_import).

prune keeps the N experts of every MoE layer that calibration data routes to most (FILE: moekit-eval SRC --data
CALIB.bin --split all --select-experts FILE scores them) and drops the rest with their router rows; a token whose
experts all survive is computed as before (moekit.train.pruning).

average writes the weighted mean of several checkpoints of one model (the last K of a run: checkpoint averaging)
to OUT: a moekit model file (*.safetensors, *.pt) or an HF folder (moekit.train.averaging).

moekit formats (SRC may be any of them; OUT is chosen by its suffix):

    MODEL.safetensors   the model's state_dict; the ModelConfig as JSON in the header metadata
                        under "moekit_config", so the file describes itself
    MODEL.pt            torch.save({"format": "moekit-model", "config": {...}, "model": state_dict})
    run/checkpoints/step_N/   a moekit-train checkpoint (DCP + meta.json); only the model is read (with --ema,
                              the parameter average of a run trained with --train.ema_decay instead)
    run/                      (SRC only) a moekit-train run directory: its newest checkpoint that verifies

HF_DIR is config.json + safetensors (shards with an index when larger than --max-shard-size), as
``save_pretrained`` writes it. hf-to-moekit reads every model type of models.hf.load_hf (mixtral, qwen2_moe,
qwen3_moe, olmoe, deepseek_v3, deepseek_v2, glm4_moe, glm4_moe_lite, dots1, gpt_oss, minimax_m2, ernie4_5_moe,
qwen3_5_moe(_text), qwen3_next, qwen3_5(_text), llama, qwen2, qwen3); the moekit file remembers the family (config name
``hf:<model_type>``). moekit-to-hf writes
that family, or with --family another one, else the nearest family that reproduces the model (models.hf.save_hf;
a model no family reproduces is refused with the reasons).
The tokenizer goes along: a run checkpoint's run directory (its recorded tokenizer), or --tokenizer DIR (an
HF folder, e.g. the one hf-to-moekit read, or a run directory), so AutoTokenizer.from_pretrained(HF_DIR)
works. ``--verify`` reloads what was written and checks the logits match on random tokens.
OUT is checked before any model is read: it must be writable, and moekit-to-hf refuses a moekit-train run
directory (the export would replace the run's config.json).
Exit status: 0 done, 2 bad input (the message names the file, the problem and the fix).
"""
from __future__ import annotations

import argparse
import sys

from moekit.train import OneLineParser, UserError, program_name, run_program

PROG = program_name("convert.py")
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the keys of moekit.train.modelfiles.DTYPES
# The HF model types moekit-to-hf writes: moekit.models.hf.FAMILIES's keys (a test keeps the two equal), named
# here so that --help and a flag error need no torch.
HF_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "deepseek_v2", "glm4_moe", "glm4_moe_lite",
               "dots1", "gpt_oss", "minimax_m2", "ernie4_5_moe", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next",
               "qwen3_5", "qwen3_5_text", "llama4", "llama4_text", "llama", "qwen2", "qwen3")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-moekit", help="HuggingFace folder -> moekit *.safetensors / *.pt")
    a.add_argument("src", help="HuggingFace model folder (config.json + safetensors)")
    a.add_argument("out", help="output file, *.safetensors or *.pt")
    a.add_argument("--dtype", choices=[*DTYPE_NAMES, "auto"], default="float32",
                   help="parameter dtype (default float32; auto = the checkpoint's)")
    b = sub.add_parser("moekit-to-hf", help="moekit model or train.py checkpoint -> HuggingFace folder")
    b.add_argument("src", help="*.safetensors, *.pt, <run_dir>/checkpoints/step_N, or a run directory (its newest "
                               "checkpoint that verifies)")
    b.add_argument("out", help="output folder (not a moekit-train run directory)")
    b.add_argument("--family", choices=HF_FAMILIES, default=None,
                   help="HuggingFace model_type to write (default: the one the model was imported from, else the "
                        "nearest that reproduces it)")
    b.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="copy this tokenizer into the output: an HF folder or a moekit run directory (default: the "
                        "run directory of a checkpoint SRC, when it recorded one)")
    b.add_argument("--dtype", choices=[*DTYPE_NAMES, "auto"], default="auto",
                   help="tensor dtype on disk (default: the model's; bfloat16 for the unquantized tensors with --fp8)")
    b.add_argument("--max-shard-size", default="5GB",
                   help="shard the safetensors above this size: bytes, or e.g. 200MB, 2GiB (default 5GB)")
    b.add_argument("--layout", choices=["per_expert", "fused"], default="per_expert",
                   help="per_expert: experts.N.<proj> tensors, as save_pretrained writes (default); fused: "
                        "mlp.experts.gate_up_proj / down_proj")
    b.add_argument("--fp8", action="store_true",
                   help="write the linear layers' weights in block-wise float8 e4m3, one float32 scale per 128 x 128 "
                        "block (DeepSeek-V3's release format; transformers, vLLM and SGLang read it); the other "
                        "tensors in --dtype (default bfloat16 with --fp8). --verify then checks the logits of that "
                        "rounding and reports what it changed")
    b.add_argument("--mxfp4", action="store_true",
                   help="gpt-oss: write the experts' weights in MXFP4 (4-bit values, one power-of-two scale per 32), "
                        "OpenAI's release format; the other tensors in --dtype (default bfloat16). --verify then "
                        "checks the logits of that rounding and reports what it changed")
    b.add_argument("--ema", action="store_true",
                   help="convert the checkpoint's parameter average (a run trained with --train.ema_decay) instead of "
                        "its trained weights")
    c = sub.add_parser("average", help="the mean of several checkpoints of one model -> a moekit file or HF folder")
    c.add_argument("paths", nargs="+", metavar="SRC",
                   help="checkpoints or moekit model files; or one run directory with --last K")
    c.add_argument("-o", "--out", required=True, metavar="OUT",
                   help="*.safetensors / *.pt (a moekit model file), else an HF folder")
    c.add_argument("--last", type=int, metavar="K", help="average the K newest checkpoints of the run directory SRC")
    c.add_argument("--weights", metavar="W,W,...", help="one weight per source, oldest first (default: equal)")
    c.add_argument("--family", choices=HF_FAMILIES, default=None, help="an HF OUT's model_type (as moekit-to-hf)")
    c.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="an HF OUT's tokenizer (default: the run directory of the newest checkpoint, when recorded)")
    c.add_argument("--dtype", choices=[*DTYPE_NAMES, "auto"], default="auto",
                   help="an HF OUT's tensor dtype (default: the model's)")
    c.add_argument("--ema", action="store_true",
                   help="average the checkpoints' parameter averages (--train.ema_decay) instead of their weights")
    d = sub.add_parser("prune", help="keep the N most-used experts of every MoE layer -> a moekit file or HF folder")
    d.add_argument("src", help="a moekit model file, checkpoint or run directory, or an HF folder")
    d.add_argument("--scores", required=True, metavar="FILE",
                   help="the experts' shares on calibration data: moekit-eval SRC --data CALIB.bin --split all "
                        "--select-experts FILE")
    d.add_argument("--keep", required=True, type=int, metavar="N", help="experts kept in every MoE layer")
    d.add_argument("--by", choices=("token", "gate", "reap"), default="gate",
                   help="rank experts by their share of gate weight (gate, default), of routed slots (token), or by "
                        "REAP's mean gate weight x output norm (reap: scores written with --select-by reap)")
    d.add_argument("-o", "--out", required=True, metavar="OUT",
                   help="*.safetensors / *.pt (a moekit model file), else an HF folder")
    d.add_argument("--family", choices=HF_FAMILIES, default=None, help="an HF OUT's model_type (as moekit-to-hf)")
    d.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="an HF OUT's tokenizer (default: SRC's: an HF folder, or a checkpoint's run directory)")
    d.add_argument("--dtype", choices=[*DTYPE_NAMES, "auto"], default="auto",
                   help="an HF OUT's tensor dtype (default: the model's)")
    e = sub.add_parser("merge-lora", help="fold a LoRA run's adapters into the weights -> a moekit file or HF folder")
    e.add_argument("src", help="a moekit model file, checkpoint or run directory whose model has LoRA adapters")
    e.add_argument("-o", "--out", required=True, metavar="OUT",
                   help="*.safetensors / *.pt (a moekit model file), else an HF folder")
    e.add_argument("--family", choices=HF_FAMILIES, default=None, help="an HF OUT's model_type (as moekit-to-hf)")
    e.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="an HF OUT's tokenizer (default: the run directory of a checkpoint SRC, when recorded)")
    e.add_argument("--ema", action="store_true",
                   help="merge the checkpoint's parameter average (--train.ema_decay) instead of its weights")
    f = sub.add_parser("export-lora", help="a LoRA run's adapters -> a PEFT adapter folder (vLLM, SGLang, PEFT)")
    f.add_argument("src", help="a moekit model file, checkpoint or run directory whose model has LoRA adapters")
    f.add_argument("out", help="output folder: adapter_config.json + adapter_model.safetensors")
    f.add_argument("--family", choices=HF_FAMILIES, default=None,
                   help="the HF model_type of the base checkpoint (default: the one the model was imported from)")
    f.add_argument("--base", default="", metavar="NAME",
                   help="adapter_config's base_model_name_or_path (default: the run's --init-from-hf folder)")
    f.add_argument("--dtype", choices=[*DTYPE_NAMES, "auto"], default="auto",
                   help="the adapters' dtype on disk (default: the model's)")
    f.add_argument("--ema", action="store_true",
                   help="export the checkpoint's parameter average (--train.ema_decay) instead of its weights")
    f.add_argument("--layout", choices=["per_expert", "fused"], default="per_expert",
                   help="routed experts' adapters: per_expert, one per expert Linear (experts.N.gate_proj: vLLM, "
                        "SGLang, PEFT on transformers 4 or converting to 5), or fused, PEFT's target_parameters on "
                        "transformers >= 5's fused expert tensors (the one way for gpt-oss and Llama 4)")
    g = sub.add_parser("import-lora", help="a PEFT LoRA adapter folder + its HF base -> a moekit file with adapters")
    g.add_argument("base", help="the HF folder the adapter was trained on (its base_model_name_or_path, downloaded)")
    g.add_argument("adapter", help="the PEFT adapter folder: adapter_config.json + adapter_model.safetensors")
    g.add_argument("-o", "--out", required=True, metavar="OUT", help="*.safetensors / *.pt (a moekit model file)")
    g.add_argument("--dtype", choices=[*DTYPE_NAMES, "auto"], default="auto",
                   help="parameter dtype of OUT (default auto: the base checkpoint's)")
    for q in (a, b, c, d, e, f):
        q.add_argument("--verify", action="store_true", help="reload the output and compare logits")
    g.add_argument("--verify", action="store_true",
                   help="check the import against the base plus the adapter, tensor by tensor, and (peft installed) "
                        "against PEFT's logits")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done; 2 bad input (flags, files, a model no family reproduces), one line on stderr."""

    def body() -> int:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        from moekit.train.averaging import average  # torch and the models: after the flags
        from moekit.train.modelfiles import (export_lora_command, hf_to_moekit, import_lora_command, merge_lora_command,
                                             moekit_to_hf)
        from moekit.train.pruning import prune_command

        try:
            {"hf-to-moekit": hf_to_moekit, "moekit-to-hf": moekit_to_hf, "average": average,
             "prune": prune_command, "merge-lora": merge_lora_command,
             "export-lora": export_lora_command, "import-lora": import_lora_command}[args.command](args)
        except ValueError as exc:  # the readers' and writers' checks: the message names the file and the fix
            raise UserError(str(exc)) from None
        return 0

    return run_program(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
