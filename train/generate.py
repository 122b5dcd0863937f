"""Generate text from a trained model: ``moekit-generate`` (or ``python tools/generate.py`` in a checkout).

    moekit-generate RUN_DIR|CHECKPOINT|HF_DIR --prompt TEXT [--chat [--system TEXT]] [--max-new-tokens N]
                    [--temperature T] [--top-k K] [--top-p P] [--seed S] [--stop TEXT ...] [--no-cache]
                    [--speculative [--draft-depths N]] [--device D] [--dtype T]
    moekit-generate RUN_DIR|CHECKPOINT|HF_DIR --prompts FILE [--output JSONL] [--batch-size B] [--num-samples N] [...]

stdout: the prompt and its continuation; stderr: what was loaded, and one stats line (tokens/s).

Many prompts (--prompts FILE): a .jsonl file of {"prompt": TEXT} records (with --chat, an optional "system" each, or a
whole conversation {"messages": [{"role", "content"}, ...]} to answer), or any other text file with one prompt per
line (blank lines skipped). Prompts of similar length decode together, --batch-size at a time, over one KV cache
(moekit.train.decoding.generate_batch): each prompt's tokens are those it would get alone, with the same --seed.
One JSON record per prompt, in the file's order, goes to stdout or --output: {"index", "prompt" (or "messages"),
"completion", "prompt_tokens", "new_tokens", "stopped"}; progress and the stats go to stderr. --num-samples N (with
a --temperature above 0) samples N completions of each prompt, with seeds S .. S+N-1, in N records ("sample": j).

Decoding stops after --max-new-tokens tokens or at an end token (not printed): the tokenizer's EOS, and for an HF
folder every eos_token_id of generation_config.json and config.json and tokenizer_config.json's eos_token; or where
a --stop text first appears in the continuation (the text is cut there).

Chat models (--chat): the prompt is one user message (after a system message with --system), laid out by the
folder's chat template (chat_template.jinja, else tokenizer_config.json's chat_template, else chat_template.json)
with the generation prompt added, rendered with jinja2 as transformers' apply_chat_template renders it, and
encoded without added special tokens (the template writes them). stdout then gets the answer only.

Sampling (``next_token``): temperature 0 is greedy (argmax, the lowest id on a tie); otherwise the logits
are divided by the temperature, cut to the top-k most likely tokens (ties: the lower id first), then to
the smallest most-likely set whose probability reaches top-p (renormalised over what top-k kept), and
one token is drawn with a CPU generator seeded by --seed: the same seed gives the same tokens on any
device for the same logits.

Context window: the model attends to at most model.max_seq_len (W) positions. A prompt longer than W
keeps its last W tokens (a note says how many were dropped). When the sequence fills the window, the
oldest tokens are dropped and decoding continues on the newest W/2, re-encoded from position 0 (training
windows start at position 0 too); with the cache that is one prefill every W/2 tokens. --no-cache runs
the model on the whole window at every step and uses the same windows, so greedy decoding gives the same
tokens with and without the cache (the logits agree up to float rounding).

Speculative decoding (--speculative, for models with multi-token-prediction depths: --model.mtp_layers, or a
DeepSeek-V3 / GLM-4.5 checkpoint's MTP layer): the model's D depths draft a chain of D tokens after the next
(depth k the token k after it, from depth k-1's state and depth k-1's draft), and one forward of the main model
checks the whole chain while computing the next token, so one forward gives 1 to D + 1 tokens (the longest
accepted prefix, then the main model's own token). --draft-depths N drafts with the first N depths only (default:
all; 1 = a single draft per forward). Greedy decoding gives the same tokens as without it; sampling keeps the
same distribution (speculative sampling), not the same draws for a seed. The stats line reports the share of
each depth's drafts accepted: a direct measure of how well the MTP depths predict (DeepSeek-V3 reports 85-90%
for its second token).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from moekit.train import OneLineParser, UserError, program_name, run_program
from moekit.train.model_args import add_model_args

PROG = program_name("generate.py")


def _note(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Sampling:
    """How ``moekit.train.decoding.next_token`` picks a token (module docstring); ``check`` names a bad flag."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0  # 1 = no nucleus cut

    def check(self) -> "Sampling":
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError(f"--temperature {self.temperature} is invalid; use 0 (greedy) or a positive number")
        if self.top_k < 0:
            raise UserError(f"--top-k {self.top_k} is invalid; use 0 (off) or a positive number of tokens")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p {self.top_p} is invalid; use a probability in (0, 1] (1 = off)")
        return self


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                      allow_abbrev=False)
    add_model_args(p)
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="the text to continue (with --chat: the user's message)")
    given.add_argument("--prompts", metavar="FILE",
                       help="many prompts: a .jsonl file of {\"prompt\": ...} records, or one prompt per line; "
                            "one JSON record per prompt out (see the top of --help)")
    p.add_argument("--output", metavar="JSONL", help="with --prompts: write the records here instead of stdout")
    p.add_argument("--batch-size", type=int, default=16, metavar="B",
                   help="with --prompts: prompts decoded together (default 16; 1: one at a time)")
    p.add_argument("--num-samples", type=int, default=1, metavar="N",
                   help="with --prompts and a --temperature above 0: N completions of each prompt, sampled with seeds "
                        "S, S+1, ..., S+N-1 (default 1); each record says which (\"sample\")")
    p.add_argument("--chat", action="store_true",
                   help="lay out the prompt as one user turn with the model folder's chat template and print only the "
                        "answer (instruct models; needs jinja2)")
    p.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system message before the prompt")
    p.add_argument("--show-reasoning", action="store_true",
                   help="with --chat on a harmony model (gpt-oss): also print the reasoning channels, on stderr "
                        "(stdout holds the final answer)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="tokens to add (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K most likely (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample among the most likely tokens holding probability P (1 = all)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the sampler (default 0)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the continuation where TEXT first appears, TEXT not printed (repeatable; \\n and \\t "
                        "in TEXT are a newline and a tab): e.g. --stop '\\n\\n' --stop 'Question:'")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole window every step (no KV cache)")
    p.add_argument("--speculative", action="store_true",
                   help="draft the tokens after the next with the model's D multi-token-prediction depths and check "
                        "them in the same forward (up to D + 1 tokens per forward; greedy output unchanged)")
    p.add_argument("--draft-depths", type=int, default=None, metavar="N",
                   help="with --speculative: draft with the first N MTP depths (default: all the model's)")
    return p


def argv_has(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens} is invalid; it must be a positive number of tokens")
    if not 0 <= args.seed < 2**64:
        raise UserError(f"--seed {args.seed} is invalid; it must be in [0, 2**64) (the sampler's seed is 64-bit)")
    args.sampling = Sampling(args.temperature, args.top_k, args.top_p).check()
    args.stop = [text.replace("\\n", "\n").replace("\\t", "\t") for text in args.stop]
    if "" in args.stop:
        raise UserError("--stop '' is invalid; give the text that ends a continuation, e.g. --stop '\\n\\n'")
    if args.show_reasoning and not args.chat:
        raise UserError("--show-reasoning prints a chat model's reasoning channels; add --chat, or drop it")
    if args.system is not None and not args.chat:
        raise UserError("--system sets the system message of a chat; add --chat (the model folder needs a chat "
                        "template), or drop --system")
    if args.prompts is None:
        for flag in ("output", "batch_size", "num_samples"):
            if argv_has(argv, "--" + flag.replace("_", "-")):
                raise UserError(f"--{flag.replace('_', '-')} is for many prompts; give them with --prompts FILE")
    else:
        if args.batch_size < 1:
            raise UserError(f"--batch-size {args.batch_size} is invalid; it must be a positive number of prompts")
        if args.num_samples < 1:
            raise UserError(f"--num-samples {args.num_samples} is invalid; it must be a positive number of "
                            f"completions per prompt")
        if args.num_samples > 1 and args.temperature == 0:
            raise UserError(f"--num-samples {args.num_samples} with --temperature 0 would give {args.num_samples} "
                            f"copies of the one greedy completion; sample with a --temperature above 0, e.g. 0.8")
        if args.seed + args.num_samples > 2**64:
            raise UserError(f"--seed {args.seed} + --num-samples {args.num_samples} passes 2**64 (the sampler's seeds "
                            f"are 64-bit); use a smaller --seed")
        if args.speculative:
            raise UserError("--speculative decodes one sequence; drop it to decode --prompts in batches")
        if args.show_reasoning:
            raise UserError("--show-reasoning prints one answer's reasoning on stderr; use --prompt for that")
        if args.output and Path(args.output).is_dir():
            raise UserError(f"--output {args.output}: a directory; name the file to write, e.g. "
                            f"{Path(args.output) / 'generations.jsonl'}")
    if args.speculative and args.no_cache:
        raise UserError("--speculative checks its drafts against the KV cache; drop --no-cache (or --speculative)")
    if args.draft_depths is not None:
        if not args.speculative:
            raise UserError(f"--draft-depths {args.draft_depths} sets how many MTP depths draft for --speculative; "
                            f"add --speculative, or drop --draft-depths")
        if args.draft_depths < 1:
            raise UserError(f"--draft-depths {args.draft_depths} is invalid; use 1 or more (at most the model's MTP "
                            f"depths), or drop it to draft with all of them")
    return args


def run(args: argparse.Namespace) -> int:
    from moekit.train.decoding import continuation, generate, generate_speculative  # torch, the model: after flags
    from moekit.train.inference import (ChatTemplate, chat_messages, encode_rendered, load_for_inference,
                                        template_folder)

    # the prompts, the template (and jinja2) before the model: a bad one should not cost a large model's load
    many = read_prompts(args.prompts, args.chat) if args.prompts is not None else None
    template = ChatTemplate.load(template_folder(args.path, args.tokenizer)) if args.chat else None
    model, tokenizer, info = load_for_inference(args.path, args.device, args.dtype, warn=_note, averaged=args.ema,
                                                tokenizer=args.tokenizer)
    if many is not None:
        return run_many(args, many, model, tokenizer, info, template)
    if args.speculative and not len(model.mtp):
        raise UserError(f"--speculative drafts with the model's multi-token-prediction depths, and {args.path} has "
                        f"none (model.mtp_layers 0): train with --model.mtp_layers 1, or drop --speculative")
    if args.speculative and (args.draft_depths or 0) > len(model.mtp):
        raise UserError(f"--draft-depths {args.draft_depths} exceeds the {len(model.mtp)} multi-token-prediction "
                        f"depth(s) of {args.path} (model.mtp_layers {len(model.mtp)}); use 1 to {len(model.mtp)}, or "
                        f"drop --draft-depths to draft with all of them")
    if template is not None:
        prompt_ids = encode_rendered(tokenizer, template.render(chat_messages(args.prompt, args.system)))
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:
        raise UserError("--prompt encodes to no tokens; give some text to continue")
    _note(f"{info.describe()}; tokenizer {tokenizer.describe()}"
          + (f"; chat template {template.source} ({len(prompt_ids)} tokens)" if template is not None else ""))
    for line in info.routing:
        _note(f"note: {line}")
    cuts = [f for f, on in (("--top-k", args.top_k), ("--top-p", args.top_p < 1)) if on]
    if cuts and args.sampling.temperature == 0:
        _note(f"note: --temperature 0 decodes greedily (the most likely token), so {' and '.join(cuts)} "
              f"{'has' if len(cuts) == 1 else 'have'} no effect; sample with a --temperature above 0, e.g. 0.8")
    use_cache = not args.no_cache
    if use_cache and info.cache_inexact:  # its routing is not per token: only full forwards are right
        _note(f"note: {info.cache_inexact}, so every step runs the whole window (as --no-cache)"
              + ("; --speculative needs the cache and is off" if args.speculative else ""))
        use_cache = False
    speculative = args.speculative and use_cache
    if speculative:
        out = generate_speculative(model, prompt_ids, args.max_new_tokens, args.sampling, seed=args.seed,
                                   eos_ids=tokenizer.eos_ids, draft_depths=args.draft_depths)
    else:
        out = generate(model, prompt_ids, args.max_new_tokens, args.sampling, seed=args.seed,
                       eos_ids=tokenizer.eos_ids, use_cache=use_cache,
                       stop=stop_check(tokenizer, prompt_ids, args.stop))
    if out.prompt_dropped:
        _note(f"note: the prompt has {len(prompt_ids)} tokens, more than model.max_seq_len="
              f"{model.config.max_seq_len}; the model saw its last {len(prompt_ids) - out.prompt_dropped}")
    # a chat prints the answer alone: the template's layout is not the user's text
    text = cut_at_stop(continuation(tokenizer, prompt_ids, out.new_ids), args.stop)
    if template is not None:
        text = harmony_answer(tokenizer, out.new_ids, args, text)
    print(("" if template is not None else args.prompt) + text, flush=True)
    why = {"eos": "EOS", "stop": "--stop"}.get(out.stopped, f"--max-new-tokens {args.max_new_tokens}")
    moved = f", window moved {out.shifts}x" if out.shifts else ""
    spec = f", {draft_stats(out)}" if speculative else ""
    _note(f"{len(prompt_ids)} prompt + {len(out.new_ids)} new tokens in {out.seconds:.3f} s: {out.tokens_per_s:.1f} "
          f"tokens/s ({'KV cache' if use_cache else 'no cache'}, first token {1e3 * out.first_token_s:.1f} ms"
          f"{moved}{spec}); stopped at {why}")
    return 0


@dataclass(frozen=True)
class Prompt:
    """One --prompts entry: ``text`` (a prompt, or with --chat the user's message) or, with --chat, a whole
    conversation ``messages`` ([{"role", "content"}, ...], answered next); ``system``: its own system message."""

    text: str | None
    system: str | None = None
    messages: tuple | None = None

    def record(self) -> dict:
        """What the output record repeats of it."""
        return {"prompt": self.text} if self.messages is None else {"messages": list(self.messages)}


def _messages(value, chat: bool, where: str) -> tuple:
    if not chat:
        raise UserError(f"{where}: \"messages\" is a conversation for a chat model; add --chat, or give a "
                        f"\"prompt\" instead")
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise UserError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": str, \"content\": str}}, "
                        f"got {json.dumps(value)[:80]}")
    return tuple({"role": m["role"], "content": m["content"]} for m in value)


def read_prompts(path: str, chat: bool) -> list[Prompt]:
    """--prompts: the prompts of a .jsonl file of {"prompt": str} records (with --chat, an optional "system": str, or
    a whole conversation "messages" instead of "prompt"), or of any other file, one prompt per line (blank lines
    skipped)."""
    from moekit.train.runlock import describe_os_error

    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except IsADirectoryError:
        raise UserError(f"--prompts {path}: a directory; give a .jsonl file of {{\"prompt\": ...}} records or a "
                        f"text file of one prompt per line") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"--prompts {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise UserError(f"--prompts {path}: cannot read it: {describe_os_error(exc)}") from None
    prompts = []
    if not path.endswith(".jsonl"):
        prompts = [Prompt(line) for line in lines if line.strip()]
    else:
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"--prompts {path}:{n}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{where}: not JSON ({exc.msg}); each line is one {{\"prompt\": TEXT}} "
                                f"record") from None
            if not isinstance(record, dict):
                raise UserError(f"{where}: a record is a JSON object, {{\"prompt\": TEXT}}; got "
                                f"{json.dumps(record)[:80]}")
            system = record.get("system")
            if system is not None and (not isinstance(system, str) or not chat):
                raise UserError(f"{where}: \"system\" " + ("must be a string" if chat else
                                "sets a chat's system message; add --chat, or drop the field"))
            if "messages" in record:
                if "prompt" in record or system is not None:
                    raise UserError(f"{where}: give \"messages\" (the whole conversation, a system message in it) "
                                    f"or \"prompt\" (and \"system\"), not both")
                prompts.append(Prompt(None, None, _messages(record["messages"], chat, where)))
                continue
            text = record.get("prompt")
            if not isinstance(text, str) or not text:
                raise UserError(f"{where}: needs a non-empty string \"prompt\" field, got {json.dumps(record)[:80]}")
            prompts.append(Prompt(text, system))
    if not prompts:
        raise UserError(f"--prompts {path}: holds no prompt; write one per line, or {{\"prompt\": ...}} records "
                        f"in a .jsonl file")
    return prompts


def run_many(args, many: list[Prompt], model, tokenizer, info, template) -> int:
    """--prompts: every prompt's continuation, decoded in batches (module docstring), as JSON records."""
    from moekit.train.decoding import continuation, generate_many
    from moekit.train.inference import chat_messages, encode_rendered

    if template is not None:
        encoded = [encode_rendered(tokenizer, template.render(
            list(p.messages) if p.messages is not None
            else chat_messages(p.text, args.system if p.system is None else p.system))) for p in many]
    else:
        encoded = [tokenizer.encode(p.text) for p in many]
    empty = [i for i, ids in enumerate(encoded) if not ids]
    if empty:
        raise UserError(f"--prompts {args.prompts}: prompt {empty[0]} encodes to no tokens; give some text to "
                        f"continue")
    W = model.config.max_seq_len
    long = sum(len(ids) + args.max_new_tokens > W for ids in encoded)
    use_cache = not args.no_cache
    _note(f"{info.describe()}; tokenizer {tokenizer.describe()}"
          + (f"; chat template {template.source}" if template is not None else ""))
    for line in info.routing:
        _note(f"note: {line}")
    if use_cache and info.cache_inexact:
        _note(f"note: {info.cache_inexact}, so each prompt decodes alone and every step runs the whole window "
              f"(as --no-cache)")
        use_cache = False
    if long and use_cache and args.batch_size > 1:
        _note(f"note: {long} of {len(encoded)} prompts leave fewer than --max-new-tokens {args.max_new_tokens} "
              f"positions in the window (model.max_seq_len={W}); they decode alone, moving the window as --prompt does")
    out_file = None
    if args.output:
        try:
            out_file = open(args.output, "w", encoding="utf-8")
        except OSError as exc:
            from moekit.train.runlock import describe_os_error

            raise UserError(f"--output {args.output}: cannot write it: {describe_os_error(exc)}") from None
    t0, last = time.perf_counter(), [time.monotonic()]

    N = args.num_samples  # row r: prompt r // N, its sample r % N, seeded --seed + r % N
    rows = [ids for ids in encoded for _ in range(N)]
    what = "completions" if N > 1 else "prompts"

    def progress(done: int) -> None:
        if time.monotonic() - last[0] > 5.0 and done < len(rows):
            _note(f"{done:,}/{len(rows):,} {what} ({done / (time.perf_counter() - t0):.2f}/s)")
            last[0] = time.monotonic()

    checks = [stop_check(tokenizer, ids, args.stop) for ids in encoded]
    seeds = [args.seed + r % N for r in range(len(rows))]
    outs = generate_many(model, rows, args.max_new_tokens, args.sampling, seed=seeds,
                         eos_ids=tuple(tokenizer.eos_ids), batch_size=args.batch_size, use_cache=use_cache,
                         progress=progress, stop=None if not args.stop else (lambda r, new: checks[r // N](new)))
    seconds = time.perf_counter() - t0
    sink = out_file if out_file is not None else sys.stdout
    try:
        for r, out in enumerate(outs):
            i, ids = r // N, encoded[r // N]
            completion = cut_at_stop(continuation(tokenizer, ids, out.new_ids), args.stop)
            if template is not None:
                completion = harmony_answer(tokenizer, out.new_ids, args, completion)
            sample = {"sample": r % N} if N > 1 else {}
            sink.write(json.dumps({"index": i, **sample, **many[i].record(), "completion": completion,
                                   "prompt_tokens": len(ids), "new_tokens": len(out.new_ids),
                                   "stopped": out.stopped}) + "\n")
    finally:
        if out_file is not None:
            out_file.close()
    new = sum(len(out.new_ids) for out in outs)
    ends = {why: sum(out.stopped == why for out in outs) for why in ("eos", "length", "stop")}
    how = f"KV cache, batches of {args.batch_size}" if use_cache else "no cache, one at a time"
    _note(f"{len(encoded):,} prompts" + (f" x {N} samples" if N > 1 else "")
          + f", {sum(map(len, encoded)):,} prompt + {new:,} new tokens in {seconds:.3f} s: "
          f"{new / max(seconds, 1e-9):.1f} new tokens/s ({how}); stopped at EOS {ends['eos']:,}, at "
          f"--max-new-tokens {ends['length']:,}" + (f", at --stop {ends['stop']:,}" if args.stop else "")
          + (f"; wrote {args.output}" if args.output else ""))
    return 0


def stop_check(tokenizer, prompt_ids: list[int], stops: list[str]):
    """decoding's ``stop(new ids)`` for --stop: whether the continuation so far holds a stop text (None without
    --stop)."""
    if not stops:
        return None
    from moekit.train.decoding import continuation

    head = tokenizer.decode(prompt_ids)  # once: the check runs after every new token
    return lambda new: any(s in continuation(tokenizer, prompt_ids, new, head) for s in stops)


def cut_at_stop(text: str, stops: list[str]) -> str:
    """The continuation up to the first --stop text (which is not kept)."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(ends)] if ends else text


def harmony_answer(tokenizer, new_ids: list[int], args, raw: str) -> str:
    """A harmony model's (gpt-oss: moekit.train.harmony) final-channel answer, with the reasoning channels on stderr
    under --show-reasoning; ``raw`` (the plain continuation) for any other model."""
    from moekit.train import harmony

    markers = harmony.marker_ids(tokenizer)
    if markers is None:
        return raw
    found = harmony.messages(tokenizer, new_ids, markers)
    if args.show_reasoning:
        for m in found:
            if m.channel != "final":
                _note(f"[{m.channel or m.header or 'message'}] {m.text.strip()}" + ("" if m.complete else " ..."))
    final = harmony.answer(found)
    if final is None:
        _note(f"note: the model wrote no final answer within --max-new-tokens {args.max_new_tokens} (only "
              f"{', '.join(sorted({m.channel or '?' for m in found})) or 'nothing'}); raise --max-new-tokens"
              + ("" if args.show_reasoning else ", or add --show-reasoning to see its reasoning"))
        return ""
    return final


def draft_stats(out) -> str:
    """The stats line's account of speculative decoding (a Generation): each depth's share of its drafts accepted
    (depth k's draft counts as accepted only when depths 1..k-1's of the same chain were too)."""
    rates = " / ".join("n/a" if math.isnan(r) else f"{r:.0%}" for r in out.acceptance_by_depth)
    by = " by depth" if len(out.acceptance_by_depth) > 1 else ""
    return (f"MTP drafts accepted {rates}{by} ({out.accepted}/{out.drafted}), "
            f"{out.tokens_per_forward:.2f} tokens per forward")


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done; 2 bad input (flags, paths, checkpoints, tokenizer), one line on stderr."""
    return run_program(PROG, lambda: run(parse_args(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
