"""``moekit-prepare``: tokenize documents (text, JSONL, Parquet) into a token file the trainer memory-maps.

    moekit-prepare 'data/*.jsonl' --tokenizer path/to/hf-folder -o data/train.bin
    moekit-train --data.path data/train.bin          # vocab, EOS and tokenizer come from the set's metadata

Inputs (several files or globs, read in the order given, globs sorted): ``.jsonl`` / ``.ndjson`` (one
document per record, its ``--field``), ``.parquet`` (one document per row of column ``--field``; needs
pyarrow, the ``data`` extra), anything else UTF-8 text (one document per file, or per line with
``--docs-per-line``). Documents with nothing but whitespace are skipped and counted.

Tokenizer: a HuggingFace ``tokenizers`` tokenizer.json, a folder holding one (a downloaded checkpoint), or
``bytes`` (ids 0-255 are the UTF-8 bytes; EOS 256, so vocab 257, or ``--no-eos`` for vocab 256). Documents
are encoded as plain text: no BOS or template tokens (``--add-special-tokens`` adds the tokenizer's), and
special-token strings inside a document stay text. The end-of-document id follows every document: the
tokenizer's (``tokenizer_config.json``'s eos_token beside it, else a well-known name such as
``<|endoftext|>`` or ``</s>`` in its vocabulary), or ``--eos-token`` / ``--eos-id``.

Output, each written under a ``.partial`` name and renamed when complete:
    OUT                  MOEKTOK token file (moekit.train.data): uint16 ids when vocab <= 65536, else uint32
    OUT.json             metadata (``data.metadata_path``): tokenizer kind / source / sha256 / copy, vocab_size,
                         eos_id, documents, tokens, text_bytes (UTF-8 bytes tokenized: bits per byte), inputs...
    OUT.tokenizer.json   a copy of the tokenizer.json (hf), so the set is self-contained

Documents are tokenized by ``--workers`` processes in chunks; the output is in input order whatever the
number of workers. Bad input is one line on stderr and exit status 2.

``--chat``: the records are conversations instead (moekit.train.chat_data), rendered with the tokenizer folder's
chat template; ``OUT.mask`` (one byte per token, 1 on the assistants' replies) is written beside OUT and named in
the metadata (``loss_mask``), and the trainer's loss counts those targets only (supervised fine-tuning).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import shutil
import sys
import time
from typing import Iterator

import numpy as np

from moekit.train import OneLineParser, UserError, run_program
from moekit.train.chat_data import CHAT_FIELD, ChatEncoder, Packer, chat_encoded
from moekit.train.documents import EMBEDDED, Counts, chunks, documents, expand_inputs, input_kind
from moekit.train.tokens import (PACKED_KEY, TOKENIZER_EXTRAS, TokenFileWriter, metadata_path, tokenizer_copy_path,
                                 tokenizer_extra_path)
from moekit.train.prepare_tokenizer import (BPE_EOS, BPE_PREFIX, PROG, TokenizerSpec, load_hf, resolve_tokenizer,
                                            tokenizer_extras, train_bpe)

PROGRESS_EVERY_S = 30.0  # progress line period when stderr is not a terminal


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Tokenize text / JSONL / Parquet documents into a moekit token file (+ OUT.json metadata "
                            "and OUT.tokenizer.json) for moekit-train --data.path OUT.",
                epilog="docs/training.md, \"Data\", describes the files and how the trainer uses them.")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="files or quoted globs ('data/*.jsonl'): .jsonl/.ndjson, .parquet, anything else is text; "
                        f"{EMBEDDED}: the trainer's embedded corpus (Python stdlib modules, one document each)")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="the token file to write")
    p.add_argument("--tokenizer", required=True, metavar="TOKENIZER",
                   help="a tokenizer.json, a folder holding one (HuggingFace checkpoint), 'bytes', or 'bpe:N': train "
                        f"a byte-level BPE tokenizer of N ids on the inputs first (EOS {BPE_EOS}, saved as "
                        "OUT.tokenizer.json; no download)")
    p.add_argument("--field", default="text", help="the JSONL key / Parquet column holding the text (default text)")
    p.add_argument("--docs-per-line", action="store_true", help="text files: one document per line (default: per file)")
    eos = p.add_mutually_exclusive_group()
    eos.add_argument("--eos-token", metavar="TOKEN", help="end-of-document token (default: the tokenizer's own)")
    eos.add_argument("--eos-id", type=int, metavar="ID", help="end-of-document id")
    eos.add_argument("--no-eos", action="store_true", help="no end-of-document id between documents")
    p.add_argument("--chat", action="store_true",
                   help="the records are conversations (--field, default 'messages': a list of {role, content}): "
                        "rendered with the tokenizer folder's chat template, with a loss mask (OUT.mask) over the "
                        "assistants' replies for supervised fine-tuning; ShareGPT's {from, value} messages too")
    p.add_argument("--pack", type=int, metavar="N", default=None,
                   help="with --chat: whole conversations in sequences of N tokens (best fit, EOS padding the loss "
                        "ignores), so that training at --train.seq_len N (or a multiple) never cuts one; longer "
                        "conversations keep their first N - 1 tokens (counted in the summary)")
    p.add_argument("--add-special-tokens", action="store_true",
                   help="let the tokenizer add its template tokens to each document (e.g. a BOS)")
    p.add_argument("--workers", type=int, metavar="N", default=None,
                   help="tokenizing processes (default: the CPUs available, at most 8)")
    p.add_argument("--quiet", action="store_true", help="no progress and no summary line")
    return p


# ---------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------
# Encoding (in worker processes, or in this one)
# ---------------------------------------------------------------------------------------------------

_ENCODER: tuple[TokenizerSpec, object] | None = None  # (spec, tokenizers.Tokenizer or None), per process


def init_encoder(spec: TokenizerSpec, single_threaded: bool) -> None:
    global _ENCODER
    if single_threaded:  # one of several processes: each encodes on its own core
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _ENCODER = (spec, load_hf(spec.file) if spec.kind == "hf" else None)


def encode_chunk(docs: list[str]) -> tuple[np.ndarray, int]:
    """(ids of every document followed by EOS, UTF-8 bytes of the documents), in document order."""
    spec, tok = _ENCODER
    if spec.kind == "bytes":
        encoded = [d.encode("utf-8") for d in docs]
        pieces = [np.frombuffer(b, dtype=np.uint8) for b in encoded]
        nbytes = sum(len(b) for b in encoded)
    else:
        encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast: no offsets (tokenizers >= 0.20)
        batch = encode(docs, add_special_tokens=spec.add_special_tokens)
        pieces = [np.asarray(e.ids, dtype=np.uint32) for e in batch]
        nbytes = sum(len(d.encode("utf-8")) for d in docs)
    if spec.eos_id is not None:
        eos = np.array([spec.eos_id], dtype=np.uint32)
        pieces = [x for piece in pieces for x in (piece, eos)]
    ids = np.concatenate(pieces).astype(np.uint32) if pieces else np.empty(0, np.uint32)
    return ids, nbytes


# ---------------------------------------------------------------------------------------------------
# Encoding chunks of documents (moekit.train.documents reads them)
# ---------------------------------------------------------------------------------------------------


def encoded(spec: TokenizerSpec, work: Iterator[list[str]], workers: int) -> Iterator[tuple[np.ndarray, int]]:
    """Each chunk's (ids, bytes), in chunk order."""
    return in_order(work, workers, init_encoder, spec, encode_chunk)


def in_order(work: Iterator, workers: int, init, spec: TokenizerSpec, fn) -> Iterator:
    """``fn(chunk)`` of each chunk of ``work``, in chunk order: in this process (after ``init(spec, False)``), or in
    ``workers`` processes (each ``init(spec, True)``) with a bounded number of chunks in flight (reading never
    runs far ahead of writing)."""
    if workers == 1:
        init(spec, False)
        for chunk in work:
            yield fn(chunk)
        return
    import multiprocessing

    # spawn: a fresh interpreter per worker (no fork of a threaded parent: torch, tokenizers' thread pool)
    with multiprocessing.get_context("spawn").Pool(workers, initializer=init, initargs=(spec, True)) as pool:
        pending: collections.deque = collections.deque()
        for chunk in work:
            pending.append(pool.apply_async(fn, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# ---------------------------------------------------------------------------------------------------
# Progress and output
# ---------------------------------------------------------------------------------------------------


class Progress:
    """Documents, tokens and MB/s of text on stderr: redrawn in place on a terminal, else a line every 30 s."""

    def __init__(self, quiet: bool):
        self.enabled = not quiet
        self.tty = sys.stderr.isatty()
        self.t0 = self.last = time.perf_counter()

    def update(self, counts: Counts, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self.last < (0.25 if self.tty else PROGRESS_EVERY_S):
            return
        self.last = now
        elapsed = max(now - self.t0, 1e-9)
        line = (f"{counts.documents:,} documents, {counts.tokens:,} tokens, {counts.text_bytes / 1e6:,.1f} MB "
                f"({counts.text_bytes / 1e6 / elapsed:,.1f} MB/s), {elapsed:.0f}s")
        sys.stderr.write(f"\r\033[K{line}" if self.tty else f"{PROG}: {line}\n")
        sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def moekit_version() -> str:
    try:
        return importlib.metadata.version("moekit")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def metadata(spec: TokenizerSpec, out: str, counts: Counts, files: list[str], args, dtype: np.dtype) -> dict:
    kinds = {input_kind(f) for f in files}
    return {
        "format": "moekit-prepared", "version": 1, "moekit_version": moekit_version(),
        "token_file": os.path.basename(out), "dtype": dtype.name,
        "vocab_size": spec.vocab_size, "eos_id": spec.eos_id,
        "tokenizer": {"kind": spec.kind, "source": spec.source, "sha256": spec.sha256,
                      "file": os.path.basename(tokenizer_copy_path(out)) if spec.kind == "hf" else None,
                      **({"extras": extras} if (extras := [name for name, _ in tokenizer_extras(spec)]) else {})},
        "add_special_tokens": spec.add_special_tokens,
        "documents": counts.documents, "empty_documents": counts.empty, "tokens": counts.tokens,
        "text_bytes": counts.text_bytes,
        "inputs": [os.path.abspath(f) for f in files],
        "field": args.field if kinds & {"jsonl", "parquet"} else None,
        "docs_per_line": bool(args.docs_per_line) if "text" in kinds else None,
    }


def open_output(out: str, vocab_size: int) -> TokenFileWriter:
    """The writer of ``OUT.partial`` (its folder made): refused in one line before any tokenizing."""
    try:
        folder = os.path.dirname(os.path.abspath(out))
        os.makedirs(folder, exist_ok=True)
        if os.path.isdir(out):
            raise IsADirectoryError(21, "Is a directory", out)
        return TokenFileWriter(f"{out}.partial", vocab_size)
    except OSError as exc:
        raise UserError(f"--output {out}: cannot write it ({exc.strerror or exc}); choose another path, free space "
                        f"or fix permissions") from None


def prepare(args: argparse.Namespace) -> int:
    out = args.output
    if not out.strip() or os.path.isdir(out):
        raise UserError(f"--output {out!r}: {'a directory' if out.strip() else 'empty'}; name the token file to "
                        f"write, e.g. {os.path.join(out, 'tokens.bin') if out.strip() else 'data/tokens.bin'}")
    workers = args.workers if args.workers is not None else min(len(os.sched_getaffinity(0)) if hasattr(
        os, "sched_getaffinity") else (os.cpu_count() or 1), 8)
    if workers < 1:
        raise UserError(f"--workers {workers}: must be at least 1")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if workers > cpus:  # tokenizing is CPU-bound: more processes than CPUs only cost their start-up and memory
        if not args.quiet:
            print(f"{PROG}: note: --workers {workers} is more than the {cpus} CPU(s) available; using {cpus}",
                  file=sys.stderr)
        workers = cpus
    files = expand_inputs(args.inputs)
    check_pack_args(args)
    if args.chat:
        check_chat_args(args)
        args = argparse.Namespace(**{**vars(args), "field": CHAT_FIELD if args.field == "text" else args.field})
    elif args.field != "text" and all(input_kind(f) not in ("jsonl", "parquet") for f in files):
        raise UserError(f"--field {args.field!r} names a JSONL key or Parquet column, but the inputs are plain text "
                        f"({', '.join(files[:3])}{' ...' if len(files) > 3 else ''}); leave --field out")
    folder = os.path.dirname(os.path.abspath(out))
    made_folder = not os.path.isdir(folder)
    trained = None
    if args.tokenizer.startswith(BPE_PREFIX):  # trained here, then used like any tokenizer.json
        trained = f"{out}.bpe.partial"
        train_bpe(args, files, trained)
        args = argparse.Namespace(**{**vars(args), "tokenizer": trained})
    try:
        spec = resolve_tokenizer(args)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(trained or "")
        raise
    if trained:
        spec = dataclasses.replace(spec, source=f"bpe:{spec.vocab_size} trained on the inputs by moekit-prepare")
    if args.pack is not None and spec.eos_id is None:
        raise UserError(f"--pack {args.pack} pads with the end-of-document id and ends every sequence with it: the "
                        f"tokenizer has none; give --eos-token TOKEN")
    if os.path.abspath(out) in {os.path.abspath(f) for f in files}:
        raise UserError(f"--output {out}: is also an input; write the tokens elsewhere")
    # --chat: the folder's template, compiled here first: none, or one that does not parse, is one line before any
    # output or worker (each worker compiles its own)
    template = ChatEncoder.template_of(spec.file) if args.chat else None
    writer = open_output(out, spec.vocab_size)
    partials = [f"{out}.partial"] + ([trained] if trained else [])
    done = False
    counts, progress = Counts(), Progress(args.quiet)
    mask_file, replies = None, 0
    packer = None if args.pack is None else Packer(args.pack, spec.eos_id)

    def emit(ids: np.ndarray, mask: np.ndarray | None) -> None:
        nonlocal replies
        writer.write(ids)
        if mask is not None:
            mask_file.write(mask.tobytes())
            replies += int(mask.sum(dtype=np.int64))
        counts.tokens += ids.size

    try:
        if args.chat:  # conversations: ids and the replies' loss mask, in this process
            partials.append(f"{out}.mask.partial")
            mask_file = open(f"{out}.mask.partial", "wb")
            stream = chat_encoded(spec, files, args.field, counts, workers)
        else:
            stream = ((ids, n, None) for ids, n in
                      encoded(spec, chunks(documents(files, args.field, args.docs_per_line, counts)), workers))
        for ids, nbytes, mask in stream:
            if packer is None:
                emit(ids, mask)
            else:
                for packed in packer.add(ids, mask):
                    emit(*packed)
            counts.text_bytes += nbytes
            progress.update(counts)
        if packer is not None:
            for packed in packer.finish():
                emit(*packed)
            if packer.sequences:  # the last sequence's window reads one token past it: an EOS the loss ignores
                emit(np.array([spec.eos_id], np.uint32), np.zeros(1, np.uint8))
        writer.close()
        if mask_file is not None:
            mask_file.close()
        progress.clear()
        if counts.documents == 0:
            raise UserError(f"no documents to tokenize: {', '.join(files[:5])}{' ...' if len(files) > 5 else ''} "
                            f"held {counts.empty} empty document(s) and no text (--field {args.field!r}"
                            f"{', --docs-per-line' if args.docs_per_line else ''})")
        meta = metadata(spec, out, counts, files, args, writer.dtype)
        if args.chat:  # the trainer reads the mask file this names (moekit.train.tokens.read_loss_mask)
            meta.update(loss_mask=f"{os.path.basename(out)}.mask", trained_tokens=replies,
                        chat_template=str(template.source))
            os.replace(f"{out}.mask.partial", f"{out}.mask")
        if packer is not None:  # moekit.train.data reads the sequences at multiples of this length
            meta.update({PACKED_KEY: args.pack, "pad_tokens": packer.pad, "cut_conversations": packer.cut})
        meta_file, tok_copy = metadata_path(out), tokenizer_copy_path(out)
        partials += [f"{meta_file}.partial", f"{tok_copy}.partial"]
        with open(f"{meta_file}.partial", "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
            f.write("\n")
        if spec.kind == "hf":
            shutil.copyfile(spec.file, f"{tok_copy}.partial")
            os.replace(f"{tok_copy}.partial", tok_copy)
        elif os.path.lexists(tok_copy):
            os.unlink(tok_copy)  # a stale copy from an earlier hf preparation of the same OUT
        extras = dict(tokenizer_extras(spec))
        for name in TOKENIZER_EXTRAS:  # the folder's special tokens and chat template, for the run directory
            copy = tokenizer_extra_path(out, name)
            if name in extras:
                partials.append(f"{copy}.partial")
                shutil.copyfile(extras[name], f"{copy}.partial")
                os.replace(f"{copy}.partial", copy)
            elif os.path.lexists(copy):
                os.unlink(copy)
        os.replace(f"{out}.partial", out)
        os.replace(f"{meta_file}.partial", meta_file)  # last: the metadata describes a complete token file
        done = True
    except OSError as exc:
        raise UserError(f"--output {out}: writing failed ({exc.strerror or exc}); nothing was kept; free space or "
                        f"fix permissions and run again") from None
    finally:
        writer.close()
        if mask_file is not None:
            mask_file.close()
        progress.clear()
        for p in partials:
            with contextlib.suppress(OSError):
                os.unlink(p)
        if made_folder and not done:
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # the folder this run made for OUT, when it stayed empty
    if not args.quiet:
        per_byte = counts.tokens / max(counts.text_bytes, 1)
        eos = "no EOS" if spec.eos_id is None else f"EOS {spec.eos_id}"
        if args.chat:
            print(f"wrote {out}.mask: {replies:,} of the {counts.tokens:,} tokens ({replies / max(counts.tokens, 1):.1%}) "
                  f"are the assistants' replies the loss counts")
        if packer is not None:
            cut = (f"; {packer.cut:,} conversation(s) longer than {args.pack} kept their first {args.pack - 1} tokens "
                   f"(train at a longer --pack to keep them whole)" if packer.cut else "")
            print(f"packed {counts.documents:,} conversations into {packer.sequences:,} sequences of {args.pack} tokens "
                  f"({packer.pad / max(packer.sequences * args.pack, 1):.1%} EOS padding){cut}; train with "
                  f"--train.seq_len {args.pack}")
        what = "conversations" if args.chat else "documents"
        skipped = "without a reply" if args.chat else "empty"
        print(f"wrote {out}: {counts.documents:,} {what} ({counts.empty:,} {skipped} skipped), {counts.tokens:,} tokens "
              f"({writer.dtype.name}, {per_byte:.3f} per byte of {counts.text_bytes:,} bytes of text); "
              f"{spec.kind} tokenizer {spec.source}, vocab {spec.vocab_size}, {eos}; metadata {metadata_path(out)}")
    return 0


def check_pack_args(args: argparse.Namespace) -> None:
    """--pack N packs conversations (--chat), in sequences of N >= 2 tokens."""
    if args.pack is None:
        return
    if not args.chat:
        raise UserError(f"--pack {args.pack} packs conversations so that no window cuts one: it needs --chat (plain "
                        f"documents are cut at window ends by design; --data.document_mask keeps attention within each)")
    if args.pack < 2:
        raise UserError(f"--pack {args.pack}: a sequence length of at least 2 tokens (the --train.seq_len to train at)")


def check_chat_args(args: argparse.Namespace) -> None:
    """--chat needs a tokenizer whose folder has a chat template, and no flag that means plain documents."""
    if args.tokenizer == "bytes" or args.tokenizer.startswith(BPE_PREFIX):
        raise UserError(f"--chat renders conversations with the tokenizer folder's chat template; --tokenizer "
                        f"{args.tokenizer} has none: give a HuggingFace tokenizer folder (a chat model's)")
    for flag, on in (("--docs-per-line", args.docs_per_line), ("--add-special-tokens", args.add_special_tokens)):
        if on:
            raise UserError(f"{flag} is for plain documents; with --chat the template writes every special token")


def main(argv: list[str] | None = None) -> int:
    """Entry point (moekit-prepare): 0 when the set was written, 2 on bad input (one line on stderr)."""
    return run_program(PROG, lambda: prepare(build_parser().parse_args(sys.argv[1:] if argv is None else argv)),
                       interrupted="interrupted; nothing was written")


if __name__ == "__main__":  # python -m moekit.train.prepare: the workers unpickle the installed module's functions
    from moekit.train.prepare import main as _main

    sys.exit(_main())
