"""The decoding side of a run's tokenizer: ``load_tokenizer(folder, model_vocab)`` for moekit-generate and
moekit-eval (moekit.train.inference). The writing side is moekit.train.tokens.record_tokenizer.

Contract, read from one folder (the run directory; an HF folder itself):

    tokenizer.json        present: encode/decode with the ``tokenizers`` library
    tokenizer_info.json   {"kind": "hf" | "bytes", "source", "sha256" (of tokenizer.json), "vocab_size",
                          "eos_id": int | null}: the EOS id, and a check that tokenizer.json is the one
                          the run used
    neither               bytes: vocab 256, encode = UTF-8 bytes, decode = UTF-8 with errors="replace"

A run whose data had no tokenizer metadata records kind "unknown": its ids cannot become text
(``NoTokenizer``). A run folder with tokenizer.json but no tokenizer_info.json (lost, or copied by hand) takes
as EOS the first of EOS_NAMES the tokenizer knows, as moekit-prepare chose it. An HF folder's EOS comes from
generation_config.json, config.json or tokenizer_config.json. Every problem is a UserError naming the path and
the fix.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from moekit.train import UserError
from moekit.train.runlock import describe_os_error

# end-of-document tokens of common tokenizers, most specific first (GPT-2 / Qwen / Phi, Llama 3, Llama 2 /
# Mistral / T5, Gemma, DeepSeek)
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<｜end▁of▁sentence｜>",
             "<|end▁of▁sentence|>")

TOKENIZER_FILE, TOKENIZER_INFO = "tokenizer.json", "tokenizer_info.json"


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255 (what moekit trains on by default); ids from 256 on are special (a
    prepared byte set's EOS is 256, vocab 257) and decode to nothing."""

    kind = "bytes"
    sha256 = None

    def __init__(self, eos_id: int | None = None, vocab_size: int = 256):
        self.vocab_size = vocab_size
        self.eos_ids = () if eos_id is None else (eos_id,)

    @property
    def eos_id(self) -> int | None:
        return self.eos_ids[0] if self.eos_ids else None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def byte_count(self, ids: list[int]) -> int:
        """Bytes of text these tokens stand for (bits per byte): one per byte id."""
        return sum(1 for i in ids if 0 <= i < 256)

    def describe(self) -> str:
        return f"bytes (vocab {self.vocab_size}, EOS {self.eos_id if self.eos_id is not None else 'none'})"


class HFTokenizer:
    """A ``tokenizers`` tokenizer.json. ``add_special_tokens``: whether encode adds BOS and the like (as
    transformers does for an HF folder; a run's token stream is plain text)."""

    kind = "hf"

    def __init__(self, path: Path, add_special_tokens: bool, eos_ids: tuple[int, ...] = ()):
        from tokenizers import Tokenizer  # a moekit dependency; imported only for a tokenizer.json

        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises its own exception type for a malformed file
            raise UserError(f"{path}: not a tokenizers file ({' '.join(str(exc).split())[:200]}); restore the "
                            f"tokenizer.json the model was trained with") from None
        self.path, self.add_special_tokens, self.eos_ids = path, add_special_tokens, eos_ids
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.sha256 = hashlib.sha256(path.read_bytes()).hexdigest()

    @property
    def eos_id(self) -> int | None:
        return self.eos_ids[0] if self.eos_ids else None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=self.add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def byte_count(self, ids: list[int]) -> int:
        return len(self.decode(ids).encode("utf-8"))

    def describe(self) -> str:
        eos = ",".join(map(str, self.eos_ids)) or "none"
        return f"{self.path} (vocab {self.vocab_size}, EOS {eos})"


Tokenizer = ByteTokenizer | HFTokenizer


class NoTokenizer(UserError):
    """The run recorded no tokenizer (its data were ids without metadata): ids cannot become text."""


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: corrupt {what} ({type(exc).__name__}: {exc}); restore it") from None
    except OSError as exc:
        raise UserError(f"{path}: unreadable ({describe_os_error(exc)})") from None


def _eos(values: Any, vocab: int, where: Path) -> tuple[int, ...]:
    """EOS ids from an int, a list of them or None, each checked to be a token id of the model."""
    values = [] if values is None else values if isinstance(values, list) else [values]
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < vocab:
            raise UserError(f"{where}: EOS id {v!r} is not a token id of the model (vocab_size {vocab}); fix it")
    return tuple(values)


def _tokenizer_info(folder: Path) -> dict | None:
    path = folder / TOKENIZER_INFO
    info = read_json(path, "tokenizer info") if path.is_file() else None
    if info is not None and (not isinstance(info, dict) or info.get("kind") not in ("hf", "bytes", "unknown")):
        raise UserError(f"{path}: expected an object with kind \"hf\" or \"bytes\"; restore it")
    if info is not None and info["kind"] == "unknown":
        raise NoTokenizer(f"{path}: the run trained on token ids without tokenizer metadata, so they cannot be "
                          f"turned into text; train on a set made by moekit-prepare (it records the tokenizer)")
    if info is not None and info["kind"] != ("hf" if (folder / TOKENIZER_FILE).is_file() else "bytes"):
        found = "a" if info["kind"] == "bytes" else "no"
        raise UserError(f"{path} says kind {info['kind']!r} but there is {found} {folder / TOKENIZER_FILE}; restore "
                        f"the tokenizer files the run was trained with")
    return info


# An HF folder's tokenizer in a format other than tokenizer.json (sentencepiece, tiktoken, WordPiece / BPE vocab
# files): its model is not a byte model, so ``load_tokenizer`` refuses it rather than falling back to bytes
OTHER_TOKENIZER_FILES = ("tokenizer.model", "spiece.model", "tiktoken.model", "vocab.json", "vocab.txt")


def load_tokenizer(folder: Path, model_vocab: int, hf: bool = False) -> Tokenizer:
    """The tokenizer of ``folder`` by the contract above. ``hf``: an HF model folder (EOS from its configs,
    BOS added by encode as transformers does)."""
    info = _tokenizer_info(folder)
    eos = _eos(info.get("eos_id"), model_vocab, folder / TOKENIZER_INFO) if info is not None else ()
    tok_file = folder / TOKENIZER_FILE
    if not tok_file.is_file():
        others = [name for name in OTHER_TOKENIZER_FILES if (folder / name).is_file()]
        if hf and others:  # the model has a tokenizer, in a format read here only through tokenizer.json
            raise UserError(f"{folder}: the tokenizer is {', '.join(others)} with no {TOKENIZER_FILE}, the one format "
                            f"moekit reads; write one with transformers, AutoTokenizer.from_pretrained(folder)"
                            f".save_pretrained(folder), where the tokenizer has a fast version. Byte tokens would be "
                            f"the wrong tokens for this model")
        if model_vocab < 256:
            raise UserError(f"{folder}: no {TOKENIZER_FILE}, so the text is byte tokens, but the model's vocab_size "
                            f"is {model_vocab} < 256; add the tokenizer.json the model was trained with")
        vocab = info.get("vocab_size") if info is not None else None
        vocab = vocab if isinstance(vocab, int) and 256 <= vocab <= model_vocab else 256
        return ByteTokenizer(eos[0], max(vocab, eos[0] + 1)) if eos else ByteTokenizer(None, vocab)
    tok = HFTokenizer(tok_file, add_special_tokens=hf, eos_ids=eos)
    if hf:
        tok.eos_ids = _hf_eos_ids(folder, tok, model_vocab)
    elif info is None:  # no record of the EOS: moekit-prepare's default choice (module docstring)
        found = (tok.tok.token_to_id(name) for name in EOS_NAMES)
        tok.eos_ids = next(((i,) for i in found if i is not None and i < model_vocab), ())
    if info is not None and isinstance(info.get("sha256"), str) and tok.sha256 != info["sha256"]:
        raise UserError(f"{tok_file}: sha256 {tok.sha256[:12]}... differs from {TOKENIZER_INFO}'s "
                        f"{info['sha256'][:12]}...; this is not the tokenizer the run was trained with: restore that one")
    if tok.vocab_size > model_vocab:
        raise UserError(f"{tok_file}: {tok.vocab_size} token ids but the model's vocab_size is {model_vocab}; "
                        f"this tokenizer does not belong to the model")
    return tok


def _hf_eos_ids(folder: Path, tok: HFTokenizer, vocab: int) -> tuple[int, ...]:
    """An HF folder's EOS: eos_token_id of generation_config.json, else config.json, else the id of
    tokenizer_config.json's eos_token."""
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        value = read_json(path, name).get("eos_token_id") if path.is_file() else None
        if value is not None:
            return _eos(value, vocab, path)
    path = folder / "tokenizer_config.json"
    eos = read_json(path, "tokenizer_config.json").get("eos_token") if path.is_file() else None
    text = eos.get("content") if isinstance(eos, dict) else eos
    eos_id = tok.tok.token_to_id(text) if isinstance(text, str) else None
    return () if eos_id is None else _eos(eos_id, vocab, path)
