"""Evaluate a trained model on held-out data: ``moekit-eval`` (or ``python tools/evaluate.py`` in a checkout).

    moekit-eval RUN_DIR|CHECKPOINT|HF_DIR [--data FILE] [--split val|all] [--seq-len N] [--batch-size B]
                [--batches N] [--max-tokens N] [--capacity dropless|trained] [--out JSON] [--device D] [--dtype T]
                [--specialisation] [--select-experts FILE [--select-by token|gate] [--select-threshold P]]
                [--tasks FILE|@next-line|@continuation[,...]] [--limit N] [--fewshot K] [--max-new-tokens N]
                [--samples JSONL]

Data: ``--data FILE`` (a token file, or any token data moekit-train's --data.path reads), else the data the
run trained on (its config: path, blend or text, and its --data.val_path file), else (an HF folder) the
embedded corpus, encoded with the folder's tokenizer. The windows are the trainer's (moekit.train.data):
sequences of --seq-len + 1 tokens inside blocks, ``val`` = the held-out blocks (default; a run's validation
file when it had one), ``all`` = every window of the data (of its training data, beside a validation file). Fewer
windows (--batches, --max-tokens; with both, the fewer windows) are spread evenly over the split as the
trainer's evaluation picks them, so ``--batches E/B --batch-size B`` with E = the run's eval.sequences
evaluates the trainer's own windows.

Reported (stdout; ``--out`` writes JSON): mean cross-entropy per predicted token (nats), perplexity
exp(loss), bits per byte = total nats / ln 2 / the UTF-8 bytes the predicted tokens decode to (byte tokens:
one byte each, so loss / ln 2), tokens evaluated (with a loss mask, the targets it counts), the loss of each set
of a blend run (``by_source``: the trainer's val_loss_by_source on its windows), and per MoE layer the expert
load of that data
(moekit.moe.load): imbalance max/mean, coefficient of variation std/mean of the tokens per expert, dead
experts (no token), dropped slots, and how alike the experts' weights are (mean pairwise cosine similarity: 1 =
copies, as plain upcycling starts; ~0 = independent; train.evaluation.expert_similarity). Progress goes to stderr
every few seconds. A model with multi-token-prediction
depths (models.mtp) also gets, per depth k, its loss on the token k + 1 ahead, its top-1 accuracy there, and how
often its top-1 agrees with the main model's top-1 for that same token: depth 1's agreement is the acceptance
rate greedy ``moekit-generate --speculative`` would see on this text.

Expert specialisation (--specialisation, moekit.train.specialisation): the same forward passes also record
which token ids and positions each expert receives: per MoE layer the top tokens per expert (decoded with
the run's tokenizer), the share of each position bucket's slots per expert and how concentrated each
token id's routing is. A table on stdout, and "specialisation" in the --out JSON (what moekit-heatmap
--specialisation shows in its report).

Expert selection for expert-specialised fine-tuning (--select-experts FILE, moekit.train.expert_selection; ESFT,
DeepSeek 2024): the same forward passes also score every routed expert of each MoE layer on this data, by its share
of the layer's routed slots (--select-by token, default) or of its summed gate weights (gate), and FILE gets, per
layer, the fewest experts (highest scores first) whose shares reach --select-threshold P (default 0.2). ESFT scores
the task's training data: ``--data TASK.bin --split all`` scores every window of the task's token file. Then
``moekit-train ... --train.trainable '*.experts.*' --train.train_experts FILE`` trains only those experts. A table
on stdout, and "expert_selection" in the --out JSON.

Downstream tasks (--tasks, moekit.train.tasks and task_eval): instead of the held-out loss, multiple-choice tasks
scored by the log-likelihood of each choice, as lm-evaluation-harness scores them: accuracy (acc), accuracy per
character of the choice (acc_norm), each with its standard error, and chance. Task files: HellaSwag, ARC,
OpenBookQA, PIQA, SciQ, MMLU and Winogrande records as the HuggingFace Hub serves them (.jsonl, .json, .parquet),
or {"context", "choices", "label"}; ``@next-line`` and ``@continuation`` are built from the held-out windows of the
evaluation data (which line comes next, which ending a window has; of 4). --limit N scores the first N items of each
(a built-in task: 500 by default). --fewshot K starts each item of a file with K solved items of the same file (not
the built-in tasks, whose context is the text itself).

Generative tasks (moekit.train.gen_tasks) go in the same --tasks: GSM8K ({question, answer "... #### N"}) and
{prompt, answer}. The model writes each answer (greedy, at most --max-new-tokens, 256 by default, cut at the task's
stop strings) and the answer is compared with the reference: exact_match, and GSM8K's flexible_match (the last
number) or the qa format's contains, each with its standard error.

Routing (--capacity): ``dropless`` (default) evaluates the model as moekit-generate runs it (every slot
kept; moekit.train.inference); ``trained`` keeps the router's capacity factor, as the trainer's
evaluation does, where drops depend on which --batch-size windows share a forward. Both equal the
trainer's val_loss on its windows for dropless models; a capacity model (switch-tiny) matches it with
``trained`` and the run's micro-batch (the default --batch-size).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moekit.train import OneLineParser, UserError, program_name, run_program
from moekit.train.model_args import add_model_args
from moekit.train.runlock import describe_os_error, probe_writable
from moekit.train.tasks import BUILTIN_ITEMS, BUILTINS  # no torch: the task names and formats only

CRITERIA = ("token", "gate", "reap")  # moekit.train.expert_selection's, without importing torch before the flags are read
DEFAULT_THRESHOLD = 0.2

PROG = program_name("evaluate.py")
HF_SEQ_LEN = 1024  # default window of an HF model (its max_seq_len when shorter)


def _note(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                      allow_abbrev=False)
    add_model_args(p)
    p.add_argument("--data", metavar="FILE", help="token data (default: the run's, else the embedded corpus)")
    p.add_argument("--split", choices=("val", "all"), default="val",
                   help="val: the held-out windows (default); all: every window of the data")
    p.add_argument("--seq-len", type=int, metavar="N", help=f"tokens per window (default: the run's train.seq_len; "
                                                            f"an HF model: min(max_seq_len, {HF_SEQ_LEN}))")
    p.add_argument("--batch-size", type=int, metavar="B", help="windows per forward (default: the run's micro-batch, "
                                                               "else 8)")
    p.add_argument("--batches", type=int, metavar="N", help="evaluate N batches (default: every window)")
    p.add_argument("--max-tokens", type=int, metavar="N", help="evaluate at most N predicted tokens")
    p.add_argument("--capacity", choices=("dropless", "trained"), default="dropless",
                   help="dropless (default, as generation runs) or the trained capacity factor (as the trainer "
                        "evaluates)")
    p.add_argument("--document-mask", choices=("auto", "on", "off"), default="auto",
                   help="attention within each document of a window (split at the data's EOS id); auto: as the run "
                        "trained (its data.document_mask), so the loss is the one its validation reported")
    p.add_argument("--out", metavar="JSON", help="also write the results as JSON here")
    p.add_argument("--specialisation", action="store_true",
                   help="also report which tokens and positions each expert receives (module docstring)")
    p.add_argument("--select-experts", metavar="FILE",
                   help="also score the routed experts of each MoE layer on the evaluated windows and write the ESFT "
                        "selection (the experts to fine-tune) here, for moekit-train --train.train_experts FILE; "
                        "--split all --data TASK.bin scores every window of a task's token file")
    p.add_argument("--select-by", choices=CRITERIA, metavar="{token,gate,reap}",
                   help="--select-experts: score an expert by its share of the layer's routed slots (token, default: "
                        "ESFT-Token), of its summed gate weights (gate: ESFT-Gate), or by REAP's mean gate weight x "
                        "output norm over its tokens (reap: the experts run again on their rows to measure it)")
    p.add_argument("--select-threshold", type=float, metavar="P",
                   help=f"--select-experts: per layer, the fewest experts whose shares add up to at least P, in "
                        f"(0, 1] (default {DEFAULT_THRESHOLD})")
    p.add_argument("--tasks", action="append", metavar="TASK[,TASK]",
                   help="score tasks instead of the loss: multiple-choice files (.jsonl / .json / .parquet: "
                        "hellaswag, arc, openbookqa, piqa, sciq, mmlu, winogrande or {context, choices, label}), "
                        "generative ones (gsm8k, {prompt, answer}) and/or @next-line, @continuation (built from the "
                        "held-out data); comma-separated or repeated")
    p.add_argument("--limit", type=int, metavar="N",
                   help=f"--tasks: score the first N items of each task (default: all; a built-in task: "
                        f"{BUILTIN_ITEMS})")
    p.add_argument("--fewshot", type=int, default=0, metavar="K",
                   help="--tasks files: start each item with K solved items of the same file (model cards' 5-shot "
                        "MMLU, 25-shot ARC); default 0")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N",
                   help="generative --tasks (gsm8k, {prompt, answer}): the most tokens an answer may take (default 256)")
    p.add_argument("--gen-batch-size", type=int, default=16, metavar="B",
                   help="generative --tasks: prompts of similar length decoded together, each exactly as alone "
                        "(default 16; 1: one at a time)")
    p.add_argument("--samples", metavar="JSONL",
                   help="--tasks: also write one record per item here (its context, choices, label, each choice's "
                        "log-likelihood and tokens, the picks; a generative task's prompt, generation and verdict), "
                        "to see what the model got wrong")
    p.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)  # no stdout report (library use)
    return p


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise UserError(f"{name} {value} is invalid; it must be a positive integer")


def _run_defaults(run_config: dict | None) -> tuple[int | None, int | None]:
    """(train.seq_len, the per-rank micro-batch) of the run, where its config says."""
    train = (run_config or {}).get("train") or {}
    layout = (run_config or {}).get("layout") or {}
    seq_len = train.get("seq_len") if isinstance(train.get("seq_len"), int) else None
    ranks = max(1, int(layout.get("dp") or 1) * int(layout.get("fsdp") or 1))
    micro = train.get("micro_batch_size") or (train.get("batch_size") or 0) // ranks
    return seq_len, micro if isinstance(micro, int) and micro > 0 else None


def run(args: argparse.Namespace) -> dict:
    """The program's work for parsed flags (also a library call: moekit.train.specialisation): the result dict."""
    # torch, the model and the data: after the flags
    from moekit.train.evaluation import (check_tokenizers, choose_windows, data_section, evaluate, load_split,
                                         window_sources)
    from moekit.train.inference import load_for_inference

    for name in ("--seq-len", "--batch-size", "--batches", "--max-tokens", "--limit", "--max-new-tokens",
                 "--gen-batch-size"):
        _positive(name, getattr(args, name[2:].replace("-", "_")))
    if args.fewshot < 0:
        raise UserError(f"--fewshot {args.fewshot} is invalid; it must be a number of examples >= 0")
    if args.samples and not args.tasks:
        raise UserError("--samples writes the scored items of --tasks; it needs --tasks")
    if args.fewshot and not args.tasks:
        raise UserError("--fewshot adds solved examples to task items; it needs --tasks")
    if args.limit is not None and not args.tasks:
        raise UserError("--limit counts task items; it needs --tasks (for fewer loss windows: --batches or "
                        "--max-tokens)")
    for flag in ("select_by", "select_threshold"):
        if getattr(args, flag) is not None and not args.select_experts:
            raise UserError(f"--{flag.replace('_', '-')} sets how --select-experts chooses experts; it needs "
                            f"--select-experts FILE")
    if args.select_threshold is not None and not (0 < args.select_threshold <= 1):  # NaN too
        raise UserError(f"--select-threshold {args.select_threshold:g} is invalid; it must be a share in (0, 1]: the "
                        f"part of each layer's routing the selected experts hold (e.g. 0.1 or 0.2)")
    specs = None
    if args.tasks:
        from moekit.train.tasks import parse_specs

        specs = parse_specs(args.tasks)  # before the model is loaded
        for flag in ("batches", "max_tokens", "specialisation", "select_experts"):
            if getattr(args, flag):
                raise UserError(f"--{flag.replace('_', '-')} is for the loss evaluation, and --tasks replaces it; "
                                f"run them separately")
    out = Path(args.out) if args.out else None
    if args.samples is not None:  # before the evaluation, not after it
        if Path(args.samples).is_dir():
            raise UserError(f"--samples {args.samples}: a directory; name the file to write, e.g. "
                            f"{Path(args.samples) / 'samples.jsonl'}")
        probe_writable(Path(args.samples).parent, "--samples", keep=True)
    if out is not None:  # before the evaluation, not after it
        if out.is_dir():
            raise UserError(f"--out {out}: a directory; name the JSON file to write, e.g. {out / 'eval.json'}")
        probe_writable(out.parent, "--out", keep=True)  # created if missing; a full or read-only folder refused
    select_path = Path(args.select_experts) if args.select_experts else None
    if select_path is not None:  # before the evaluation, not after it
        if select_path.is_dir():
            raise UserError(f"--select-experts {select_path}: a directory; name the JSON file to write, e.g. "
                            f"{select_path / 'esft.json'}")
        probe_writable(select_path.parent, "--select-experts", keep=True)
    model, tokenizer, info = load_for_inference(args.path, args.device, args.dtype, warn=_note, averaged=args.ema,
                                                tokenizer=args.tokenizer,
                                                dropless=args.capacity == "dropless", require_tokenizer=False)
    cfg = model.config
    run_seq, run_micro = _run_defaults(info.run_config)
    seq_len = args.seq_len or run_seq or min(cfg.max_seq_len, HF_SEQ_LEN)
    if seq_len > cfg.max_seq_len:
        raise UserError(f"--seq-len {seq_len} exceeds the model's max_seq_len {cfg.max_seq_len}; use at most that")
    batch_size = args.batch_size or run_micro or 8
    section = data_section(info.run_config, args.data)
    if specs is not None and not set(BUILTINS) & set(specs):
        split = desc = None  # task files alone: no evaluation data to read
    else:
        split, desc, data_tok = load_split(section, tokenizer, cfg.vocab_size, seq_len)
        where = f"data {section.path or section.blend or section.text or '(embedded corpus)'}" if section else "data"
        check_tokenizers(data_tok, tokenizer, where)
    if specs is not None:
        return finish(args, run_tasks(args, specs, model, tokenizer, info, split, seq_len, batch_size), out)
    masked = document_mask_of(args.document_mask, info.run_config)
    if masked:
        if data_tok.eos_id is None:
            raise UserError(f"--document-mask {args.document_mask}: the {where} marks no document ends (no EOS id); "
                            f"evaluate with --document-mask off, or data prepared with an EOS")
        model.document_eos = data_tok.eos_id
    limits = []  # windows: all of the split unless --batches / --max-tokens ask for fewer
    if args.batches:
        limits.append(args.batches * batch_size)
    if args.max_tokens:
        limits.append(args.max_tokens // seq_len)
    tokens, mask, starts = choose_windows(split, args.split, min(limits) if limits else None)
    if starts.size == 0:
        why = f"--max-tokens {args.max_tokens} is less than one window of {seq_len}" if limits else "the split is empty"
        raise UserError(f"no windows to evaluate: {why}")
    note = (lambda _msg: None) if args.quiet else _note
    note(f"{info.describe()}; tokenizer {tokenizer.describe() if tokenizer else 'none: no bits per byte'}")
    for line in info.routing:
        note(f"note: {line}")
    note(f"data: {desc}; {args.split} split: {starts.size:,} windows of {seq_len} in batches of {batch_size}"
         f"{'; attention within documents' if masked else ''}")
    spec = relevance = None
    if args.specialisation:
        from moekit.train.specialisation import Specialisation

        spec = Specialisation(cfg.vocab_size, seq_len)
    if select_path is not None:
        from moekit.train.expert_selection import ExpertRelevance

        relevance = ExpertRelevance(saliency=args.select_by == "reap")
    observers = [o for o in (spec, relevance) if o is not None]
    try:
        for o in observers:
            o.attach(model)
        result = evaluate(model, tokens, starts, seq_len, batch_size, tokenizer,
                          progress=None if args.quiet else _note, observer=_Observers(observers) if observers else None,
                          mask=mask, eos=data_tok.eos_id, sources=window_sources(split, tokens, starts))
    finally:
        for o in observers:
            o.detach()
    if spec is not None:
        result["specialisation"] = spec.result(tokenizer)
    result = {"path": str(info.path), "checkpoint": str(info.checkpoint) if info.checkpoint else None,
              "step": info.step, "ema": info.averaged, "model": cfg.name, "data": desc, "split": args.split,
              "seq_len": seq_len, "batch_size": batch_size, "capacity": args.capacity, "document_mask": masked,
              "device": str(info.device), "dtype": str(info.dtype).removeprefix("torch."), **result}
    record = None
    if relevance is not None:
        record = write_expert_selection(args, relevance.result(), result, select_path)
    if not args.quiet:
        print(report(result))
        if spec is not None:
            from moekit.train.specialisation import report as specialisation_report

            print(specialisation_report(result["specialisation"]))
        if record is not None:
            from moekit.train.expert_selection import report as selection_report

            print(selection_report(record, select_path))
    return finish(args, result, out)


class _Observers:
    """Several of evaluate()'s observers as one: each is told every batch's input ids."""

    def __init__(self, observers: list):
        self.observers = observers

    def begin_batch(self, x) -> None:
        for o in self.observers:
            o.begin_batch(x)


def write_expert_selection(args, relevance: dict, result: dict, path: Path) -> dict:
    """--select-experts: the selection file (moekit.train.expert_selection) from the experts' scores on the
    evaluated windows; its summary goes into ``result`` as "expert_selection". Returns the file's record."""
    from moekit.train.expert_selection import selection_record, write_selection

    criterion = args.select_by or "token"
    threshold = args.select_threshold if args.select_threshold is not None else DEFAULT_THRESHOLD
    source = {k: result[k] for k in ("path", "checkpoint", "step", "data", "split", "seq_len", "windows", "capacity")}
    record = selection_record(relevance, criterion, threshold, result["model"], source)
    write_selection(path, record)
    _note(f"wrote {path}")
    result["expert_selection"] = {
        "path": str(path), "criterion": criterion, "threshold": threshold, "tokens": record["tokens"],
        "layers": [{"name": layer["name"], "experts_count": layer["experts_count"], "selected": len(layer["selected"]),
                    "covered": layer["covered"]} for layer in record["layers"]]}
    return record


def run_tasks(args, specs: list[str], model, tokenizer, info, split, seq_len: int, batch_size: int) -> dict:
    """--tasks: every task's accuracies (module docstring)."""
    from moekit.train.builtin_tasks import WINDOWS_PER_ITEM, builtin_task, window_texts
    from moekit.train.evaluation import choose_windows
    from moekit.train.gen_tasks import GenTask, generate_answers, report as gen_report
    from moekit.train.task_eval import encode_task, report as task_report, score_requests, task_result, task_samples
    from moekit.train.tasks import read_any

    if tokenizer is None:
        raise UserError(f"--tasks needs the model's tokenizer to encode the tasks' text: {info.no_tokenizer}")
    note = (lambda _msg: None) if args.quiet else _note
    tasks = []
    for spec in specs:
        if spec in BUILTINS:
            count = args.limit or BUILTIN_ITEMS
            # windows spread over the split, enough for the items: a short window may hold no whole line
            tokens, _, starts = choose_windows(split, args.split, WINDOWS_PER_ITEM * count)  # --split: val or all
            tasks.append(builtin_task(spec, window_texts(tokens, starts, seq_len, tokenizer), count))
        else:
            tasks.append(read_any(spec, args.limit, args.fewshot))
    # a moekit run's documents each follow an EOS; an HF folder's tokenizer adds its own BOS
    prefix = [tokenizer.eos_id] if info.kind != "hf" and tokenizer.eos_id is not None else []
    note(f"{info.describe()}; tokenizer {tokenizer.describe()}")
    for line in info.routing:
        note(f"note: {line}")
    results, generated, samples = [], [], []
    device = info.device
    for task in tasks:
        if isinstance(task, GenTask):  # the model writes its answers (moekit.train.gen_tasks)
            note(f"{task.name}: {len(task.items):,} items ({task.format}, generated: at most {args.max_new_tokens} "
                 f"tokens each, {args.gen_batch_size if info.cache_inexact is None else 1} at a time)")
            if info.cache_inexact is not None:
                note(f"note: {info.cache_inexact}, so each answer decodes alone, every step over the whole window")
            result, rows = generate_answers(task, model, tokenizer, prefix, args.max_new_tokens,
                                            progress=None if args.quiet else note, batch_size=args.gen_batch_size,
                                            use_cache=info.cache_inexact is None)
            generated.append(result)
            samples += rows if args.samples else []
            continue
        requests, cut = encode_task(task, tokenizer, seq_len, prefix)
        note(f"{task.name}: {len(task.items):,} items ({task.format}), {len(requests):,} choices, windows up to "
             f"{seq_len} tokens")
        loglik = score_requests(model, requests, batch_size * seq_len, device,
                                progress=None if args.quiet else note)
        results.append(task_result(task, requests, loglik, cut))
        samples += task_samples(task, requests, loglik) if args.samples else []
    result = {"path": str(info.path), "checkpoint": str(info.checkpoint) if info.checkpoint else None,
              "step": info.step, "ema": info.averaged, "model": info.config.name, "seq_len": seq_len,
              "device": str(info.device),
              "dtype": str(info.dtype).removeprefix("torch."), "capacity": args.capacity, "tasks": results + generated}
    if not args.quiet:
        print("\n\n".join(([task_report(results)] if results else []) + ([gen_report(generated)] if generated else [])))
    if args.samples:
        try:
            Path(args.samples).write_text("".join(json.dumps(r) + "\n" for r in samples))
        except OSError as exc:
            raise UserError(f"--samples {args.samples}: cannot write it: {describe_os_error(exc)}") from None
        _note(f"wrote {args.samples} ({len(samples):,} items)")
    return result


def finish(args, result: dict, out: Path | None) -> dict:
    """--out: the result as JSON."""
    if out is not None:
        try:
            out.write_text(json.dumps(result, indent=1) + "\n")
        except OSError as exc:
            raise UserError(f"--out {out}: cannot write it: {describe_os_error(exc)}") from None
        _note(f"wrote {out}")
    return result


def document_mask_of(choice: str, run_config: dict | None) -> bool:
    """--document-mask: on / off, or auto: the run's data.document_mask (off for a folder without a run config)."""
    if choice != "auto":
        return choice == "on"
    return bool(((run_config or {}).get("data") or {}).get("document_mask", False))


def report(r: dict) -> str:
    bpb = f"{r['bits_per_byte']:.4f}" if r["bits_per_byte"] is not None else "n/a"
    nbytes = f", {r['bytes']:,} bytes" if r["bytes"] else ""
    lines = [f"loss {r['loss']:.4f}  perplexity {r['perplexity']:.3f}  bits/byte {bpb}  ({r['tokens']:,} tokens"
             f"{nbytes}, {r['windows']:,} windows of {r['seq_len']})"]
    for name, s in (r.get("by_source") or {}).items():  # a blend: each set's windows
        lines.append(f"  {name}: loss {s['loss']:.4f} ({s['tokens']:,} tokens)")
    for d in r.get("mtp", ()):
        lines.append(f"MTP depth {d['depth']}: loss {d['loss']:.4f}, top-1 accuracy {100 * d['accuracy']:.1f}% on the token "
                     f"{d['depth'] + 1} ahead, agrees with the main model's next-token top-1 at that position "
                     f"{100 * d['agreement']:.1f}% (greedy --speculative acceptance on this text)")
    load = r["expert_load"]
    if load["layers"]:
        lines.append(f"expert load ({r['capacity']}): imbalance mean {load['imbalance_mean']:.2f} max "
                     f"{load['imbalance_max']:.2f}, cv {load['cv_mean']:.2f}, dead experts {load['dead_experts']}, "
                     f"dropped {100 * load['dropped_fraction']:.2f}%")
        lines.append(f"  {'layer':<16} {'imbalance':>9} {'cv':>6} {'dead':>5} {'dropped':>8} {'similarity':>10}")
        for layer in load["layers"]:
            E = len(layer["tokens_per_expert"])
            sim = layer.get("similarity")
            lines.append(f"  {layer['name']:<16} {layer['imbalance']:>9.2f} {layer['cv']:>6.2f} "
                         f"{layer['dead_experts']:>2}/{E:<2} {100 * layer['dropped_fraction']:>7.2f}% "
                         f"{'-' if sim is None else f'{sim:.3f}':>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done; 2 bad input (flags, paths, checkpoints, data), one line on stderr."""

    def body() -> int:
        run(build_parser().parse_args(sys.argv[1:] if argv is None else argv))
        return 0

    return run_program(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
