"""moekit-prepare's tokenizer: which one encodes the inputs (a HuggingFace tokenizer.json or folder, ``bytes``, or
a byte-level BPE trained on the inputs first: ``--tokenizer bpe:N``), its end-of-document id, and the folder's files
that travel with the set (``tokenizer_extras``). moekit.train.prepare runs the preparation with it."""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from dataclasses import dataclass

from moekit.train import UserError, program_name
from moekit.train.documents import Counts, documents
from moekit.train.tokens import TOKENIZER_EXTRAS, sha256_file
from moekit.train.tokenizer import EOS_NAMES

PROG = program_name("prepare.py")
BYTES_EOS = 256
BPE_PREFIX = "bpe:"  # --tokenizer bpe:N: train a byte-level BPE of N ids on the inputs first
BPE_EOS = "<|endoftext|>"


@dataclass(frozen=True)
class TokenizerSpec:
    """What each process needs to encode, and what the metadata records."""

    kind: str  # "hf" | "bytes"
    source: str  # as given (made absolute): the tokenizer.json, the folder, or "bytes"
    file: str | None  # the tokenizer.json (hf)
    sha256: str | None
    vocab_size: int
    eos_id: int | None
    add_special_tokens: bool = False


def load_hf(file: str):
    """A ``tokenizers.Tokenizer`` from ``file`` set up for data: no truncation or padding, special-token
    strings inside a document encoded as text. One-line UserError when it cannot be read."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(file)
    except Exception as exc:  # tokenizers raises plain Exception for unreadable or invalid files
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"--tokenizer {file}: not a valid tokenizer.json ({reason})") from None
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = True
    return tok


def resolve_tokenizer(args: argparse.Namespace) -> TokenizerSpec:
    given = args.tokenizer
    if given == "bytes":
        if args.eos_token is not None or (args.eos_id is not None and args.eos_id != BYTES_EOS):
            raise UserError(f"--tokenizer bytes: the end-of-document id is {BYTES_EOS} (vocab 257), or --no-eos for "
                            f"none (vocab 256); --eos-token / --eos-id choose among a real tokenizer's ids")
        eos = None if args.no_eos else BYTES_EOS
        return TokenizerSpec("bytes", "bytes", None, None, 256 if eos is None else 257, eos, args.add_special_tokens)
    path = os.path.abspath(given)
    if os.path.isdir(path):
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            has_sp = os.path.isfile(os.path.join(path, "tokenizer.model"))
            hint = (" (it has a sentencepiece tokenizer.model: write a tokenizer.json with transformers' "
                    "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))" if has_sp else "")
            raise UserError(f"--tokenizer {given}: the folder holds no tokenizer.json{hint}; pass a tokenizer.json, "
                            f"a folder with one, or 'bytes'")
    elif os.path.isfile(path):
        file = path
    else:
        raise UserError(f"--tokenizer {given}: no such file or folder; pass a tokenizer.json, a folder with one "
                        f"(a HuggingFace checkpoint), or 'bytes'")
    tok = load_hf(file)
    vocab = tok.get_vocab(with_added_tokens=True)
    if not vocab:
        raise UserError(f"--tokenizer {given}: the tokenizer has an empty vocabulary")
    vocab_size = max(vocab.values()) + 1
    try:
        digest = sha256_file(file)
    except OSError as exc:
        raise UserError(f"--tokenizer {given}: cannot read {file} ({exc.strerror})") from None
    return TokenizerSpec("hf", path, file, digest, vocab_size, choose_eos(args, tok, file, vocab_size),
                         args.add_special_tokens)


def train_bpe(args: argparse.Namespace, files: list[str], path: str) -> None:
    """--tokenizer bpe:N: a byte-level BPE tokenizer (GPT-2 style: any text encodes, no unknown token) with
    N ids, EOS ``<|endoftext|>`` = id 0, trained on the non-empty documents of ``files`` with the
    ``tokenizers`` library (one pass over the inputs before the tokenizing pass), saved to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    spec = args.tokenizer[len(BPE_PREFIX):]
    if not spec.isdigit() or not 300 <= int(spec) <= 1_000_000:
        raise UserError(f"--tokenizer {args.tokenizer}: N must be a vocabulary size from 300 to 1000000 (the 256 "
                        f"byte symbols, the EOS and at least a few merges), e.g. bpe:4096")
    if args.eos_token not in (None, BPE_EOS) or args.eos_id not in (None, 0) or args.no_eos:
        raise UserError(f"--tokenizer {args.tokenizer}: a trained BPE tokenizer's end-of-document token is {BPE_EOS} "
                        f"(id 0); drop --eos-token / --eos-id / --no-eos")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=int(spec), special_tokens=[BPE_EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    if not args.quiet:
        print(f"{PROG}: training a byte-level BPE tokenizer of {int(spec):,} ids on {len(files)} file(s)",
              file=sys.stderr, flush=True)
    docs = documents(files, args.field, args.docs_per_line, Counts())
    interruptible(lambda: tok.train_from_iterator(docs, trainer=trainer))
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tok.save(path)
    except Exception as exc:  # tokenizers raises plain Exception on I/O errors
        raise UserError(f"--output {args.output}: cannot write the trained tokenizer beside it ({exc})") from None


def interruptible(work) -> None:
    """``work()`` in a helper thread while this (the main) thread waits, so Ctrl-C stops the program at once: a
    library call that runs for minutes in native code (BPE training) does not see Python's signal handling."""
    failure: list[BaseException] = []

    def target():
        try:
            work()
        except BaseException as exc:  # handed to the main thread, which raises it
            failure.append(exc)

    thread = threading.Thread(target=target, name="moekit-prepare-work", daemon=True)  # left behind on Ctrl-C
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
    if failure:
        raise failure[0]


def choose_eos(args: argparse.Namespace, tok, file: str, vocab_size: int) -> int | None:
    """--eos-id / --eos-token / --no-eos, else the folder's tokenizer_config.json eos_token, else the first of
    EOS_NAMES the tokenizer knows."""
    if args.no_eos:
        return None
    if args.eos_id is not None:
        if not 0 <= args.eos_id < vocab_size or tok.id_to_token(args.eos_id) is None:
            raise UserError(f"--eos-id {args.eos_id}: not an id of the tokenizer {file} (vocab_size {vocab_size})")
        return args.eos_id
    if args.eos_token is not None:
        eos = tok.token_to_id(args.eos_token)
        if eos is None:
            raise UserError(f"--eos-token {args.eos_token!r}: not a token of the tokenizer {file}; "
                            f"its special tokens: {special_tokens(tok)}")
        return eos
    configured = config_eos_token(os.path.dirname(file))
    for name in ([configured] if configured else []) + list(EOS_NAMES):
        eos = tok.token_to_id(name)
        if eos is not None:
            return eos
    raise UserError(f"--tokenizer {args.tokenizer}: found no end-of-document token (tokenizer_config.json's "
                    f"eos_token, or one of {', '.join(EOS_NAMES[:4])}); its special tokens: {special_tokens(tok)}; "
                    f"name it with --eos-token TOKEN or --eos-id ID, or pass --no-eos")


def special_tokens(tok) -> str:
    names = [t.content for _, t in sorted(tok.get_added_tokens_decoder().items()) if t.special]
    return ", ".join(names[:12]) + (f" (+{len(names) - 12} more)" if len(names) > 12 else "") if names else "none"


def config_eos_token(folder: str) -> str | None:
    """eos_token from a HuggingFace folder's tokenizer_config.json or special_tokens_map.json, if any."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                value = json.load(f).get("eos_token")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value:
            return value
    return None


def tokenizer_extras(spec: TokenizerSpec) -> list[tuple[str, str]]:
    """(name, path) of the TOKENIZER_EXTRAS beside an hf tokenizer's tokenizer.json (its folder's), in that order; none
    for a tokenizer trained here (bpe:N) or bytes."""
    if spec.kind != "hf" or not spec.file or spec.source.startswith("bpe:"):
        return []
    folder = os.path.dirname(os.path.abspath(spec.file))
    return [(name, os.path.join(folder, name)) for name in TOKENIZER_EXTRAS if os.path.isfile(os.path.join(folder, name))]
