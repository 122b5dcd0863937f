"""Generate text from a trained model: ``moekit-generate`` (or ``python tools/generate.py`` in a checkout).

    moekit-generate RUN_DIR|CHECKPOINT|HF_DIR --prompt TEXT [--chat [--system TEXT]] [--max-new-tokens N]
                    [--temperature T] [--top-k K] [--top-p P] [--seed S] [--no-cache]
                    [--speculative [--draft-depths N]] [--device D] [--dtype T]

stdout: the prompt and its continuation; stderr: what was loaded, and one stats line (tokens/s).
Decoding stops after --max-new-tokens tokens or at an end token (not printed): the tokenizer's EOS, and for an HF
folder every eos_token_id of generation_config.json and config.json and tokenizer_config.json's eos_token.

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
import math
import sys
from dataclasses import dataclass

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
    p.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
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
    p.add_argument("--no-cache", action="store_true", help="recompute the whole window every step (no KV cache)")
    p.add_argument("--speculative", action="store_true",
                   help="draft the tokens after the next with the model's D multi-token-prediction depths and check "
                        "them in the same forward (up to D + 1 tokens per forward; greedy output unchanged)")
    p.add_argument("--draft-depths", type=int, default=None, metavar="N",
                   help="with --speculative: draft with the first N MTP depths (default: all the model's)")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens} is invalid; it must be a positive number of tokens")
    if not 0 <= args.seed < 2**64:
        raise UserError(f"--seed {args.seed} is invalid; it must be in [0, 2**64) (the sampler's seed is 64-bit)")
    args.sampling = Sampling(args.temperature, args.top_k, args.top_p).check()
    if args.show_reasoning and not args.chat:
        raise UserError("--show-reasoning prints a chat model's reasoning channels; add --chat, or drop it")
    if args.system is not None and not args.chat:
        raise UserError("--system sets the system message of a chat; add --chat (the model folder needs a chat "
                        "template), or drop --system")
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

    # the template (and jinja2) before the model: a missing one should not cost a large model's load
    template = ChatTemplate.load(template_folder(args.path)) if args.chat else None
    model, tokenizer, info = load_for_inference(args.path, args.device, args.dtype, warn=_note, averaged=args.ema)
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
                       eos_ids=tokenizer.eos_ids, use_cache=use_cache)
    if out.prompt_dropped:
        _note(f"note: the prompt has {len(prompt_ids)} tokens, more than model.max_seq_len="
              f"{model.config.max_seq_len}; the model saw its last {len(prompt_ids) - out.prompt_dropped}")
    # a chat prints the answer alone: the template's layout is not the user's text
    text = continuation(tokenizer, prompt_ids, out.new_ids)
    if template is not None:
        text = harmony_answer(tokenizer, out.new_ids, args, text)
    print(("" if template is not None else args.prompt) + text, flush=True)
    why = "EOS" if out.stopped == "eos" else f"--max-new-tokens {args.max_new_tokens}"
    moved = f", window moved {out.shifts}x" if out.shifts else ""
    spec = f", {draft_stats(out)}" if speculative else ""
    _note(f"{len(prompt_ids)} prompt + {len(out.new_ids)} new tokens in {out.seconds:.3f} s: {out.tokens_per_s:.1f} "
          f"tokens/s ({'KV cache' if use_cache else 'no cache'}, first token {1e3 * out.first_token_s:.1f} ms"
          f"{moved}{spec}); stopped at {why}")
    return 0


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
