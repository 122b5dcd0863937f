"""Token data on disk: the embedded corpus, moekit token files, raw nanoGPT ``.bin`` / ``.npy`` ids, prepared
sets' metadata and the identity of the tokenizer they were made with (moekit.train.data builds a run's
training data from these).

Embedded corpus: the source of a fixed, sorted list of Python standard-library modules, read from
``sysconfig.get_paths()["stdlib"]``: real text every Python install has, no download. Byte-level
tokens (vocab 256). Module contents vary slightly between Python versions, so losses compare
exactly only on the same interpreter.

Token file (``write_token_file`` / ``read_token_file``), little-endian:

    offset  size  field
    0       8     magic b"MOEKTOK\\0"
    8       4     version (uint32) = 1
    12      4     vocab_size (uint32): every token id is < vocab_size
    16      4     dtype code (uint32): 2 = uint16, 4 = uint32 (bytes per token)
    20      4     reserved (0)
    24      8     token count (uint64)
    32      ...   tokens

The file is memory-mapped; loading checks the magic, version, dtype, that the size matches the
count, and (one pass) that no id reaches vocab_size.

Other inputs of ``--data.path``: a file without that header is read as headerless ids (nanoGPT's
``train.bin``: uint16 by default, ``--data.dtype``), a ``.npy`` file with ``np.load(mmap_mode="r")``.

Prepared sets (``moekit-prepare``, moekit.train.prepare) put a metadata file beside the token file,
``<file>.json`` (``metadata_path``): vocab_size, eos_id and the tokenizer (kind, source, sha256 and the
name of its tokenizer.json copy, ``<file>.tokenizer.json``). The trainer takes the model's vocabulary and
the run's tokenizer record (``record_tokenizer``) from it (docs/training.md, "Data" and "The tokenizer of a
run").
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sysconfig
from dataclasses import dataclass

import numpy as np

from moekit.train import UserError

MAGIC = b"MOEKTOK\0"
VERSION = 1
HEADER = struct.Struct("<8sIIIIQ")  # magic, version, vocab, dtype code, reserved, count: 32 bytes
DTYPE_CODES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


# Large, long-lived modules present (as plain .py files) in CPython 3.10 through 3.13.
STDLIB_FILES = (
    "_pydecimal.py", "argparse.py", "ast.py", "calendar.py", "configparser.py", "dataclasses.py", "difflib.py",
    "enum.py", "fractions.py", "ftplib.py", "functools.py", "gettext.py", "heapq.py", "inspect.py",
    "ipaddress.py", "locale.py", "mailbox.py", "pickle.py", "pickletools.py", "pprint.py", "random.py",
    "shutil.py", "smtplib.py", "socket.py", "statistics.py", "string.py", "subprocess.py", "tarfile.py",
    "textwrap.py", "threading.py", "tokenize.py", "traceback.py", "typing.py", "uuid.py", "weakref.py",
)
MIN_CORPUS_BYTES = 1 << 20


def embedded_corpus_files() -> list[str]:
    """The standard-library modules of the embedded corpus that this Python has, in corpus order."""
    root = sysconfig.get_paths()["stdlib"]
    return [os.path.join(root, n) for n in sorted(STDLIB_FILES) if os.path.isfile(os.path.join(root, n))]


def embedded_corpus() -> tuple[np.ndarray, str]:
    """(uint8 tokens, description) of the standard-library corpus."""
    root = sysconfig.get_paths()["stdlib"]
    parts, found = [], embedded_corpus_files()
    for path in found:
        with open(path, "rb") as f:
            parts.append(f.read())
    data = b"\n\n".join(parts)
    if len(data) < MIN_CORPUS_BYTES:
        raise UserError(f"the embedded corpus needs the Python standard library sources in {root}, but only "
                        f"{len(found)} of {len(STDLIB_FILES)} files are there; pass --data.text FILE instead")
    desc = f"embedded corpus: {len(found)} stdlib modules from {root}, {len(data):,} bytes"
    return np.frombuffer(data, dtype=np.uint8), desc


def text_tokens(path: str) -> tuple[np.ndarray, str]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise UserError(f"--data.text {path}: cannot read it ({exc.strerror})") from None
    return np.frombuffer(data, dtype=np.uint8), f"text file {path}, {len(data):,} bytes as byte tokens"


def write_token_file(path: str, tokens, vocab_size: int) -> None:
    """Write ``tokens`` (any integer array-like) as a token file; uint16 when vocab_size <= 65536."""
    tokens = np.asarray(tokens)
    _check_range(tokens, vocab_size)
    writer = TokenFileWriter(path, vocab_size)
    try:
        writer.write(tokens)
    finally:
        writer.close()


def _check_range(tokens: np.ndarray, vocab_size: int) -> None:
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}); got range [{tokens.min()}, {tokens.max()}]")


class TokenFileWriter:
    """A token file written in pieces (moekit-prepare streams its documents): the header goes first with a
    count of 0, ``write`` appends ids, ``close`` fills in the count and syncs the file to disk."""

    def __init__(self, path: str, vocab_size: int):
        self.vocab_size, self.count = vocab_size, 0
        self.code = 2 if vocab_size <= 1 << 16 else 4
        self.file = open(path, "wb")
        self.file.write(HEADER.pack(MAGIC, VERSION, vocab_size, self.code, 0, 0))

    @property
    def dtype(self) -> np.dtype:
        return DTYPE_CODES[self.code]

    def write(self, tokens) -> None:
        tokens = np.asarray(tokens)
        _check_range(tokens, self.vocab_size)
        self.file.write(tokens.astype(self.dtype).tobytes())
        self.count += tokens.size

    def close(self) -> None:
        if self.file.closed:
            return
        try:
            self.file.seek(0)
            self.file.write(HEADER.pack(MAGIC, VERSION, self.vocab_size, self.code, 0, self.count))
            self.file.flush()
            os.fsync(self.file.fileno())
        finally:
            self.file.close()


def read_token_file(path: str) -> tuple[np.ndarray, int]:
    """(memory-mapped tokens, vocab_size); UserError naming the file and the problem otherwise."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(HEADER.size)
    except OSError as exc:
        raise UserError(f"data file {path}: cannot read it ({exc.strerror})") from None
    if len(head) < HEADER.size:
        raise UserError(f"data file {path}: {size} bytes is too short for the {HEADER.size}-byte token-file header")
    magic, version, vocab, code, _, count = HEADER.unpack(head)
    if magic != MAGIC:
        raise UserError(f"data file {path}: bad magic {magic!r}, expected {MAGIC!r}; write token files with "
                        f"moekit-prepare or moekit-train --write-data (or moekit.train.tokens.write_token_file)")
    if version != VERSION:
        raise UserError(f"data file {path}: format version {version}, this moekit reads version {VERSION}")
    if code not in DTYPE_CODES:
        raise UserError(f"data file {path}: dtype code {code} is invalid; expected 2 (uint16) or 4 (uint32)")
    if vocab < 1 or vocab > (1 << (8 * code)):
        raise UserError(f"data file {path}: vocab_size {vocab} does not fit its {8 * code}-bit tokens")
    if size != HEADER.size + count * code:
        raise UserError(f"data file {path}: header says {count:,} tokens ({HEADER.size + count * code:,} bytes) "
                        f"but the file has {size:,} bytes; it is truncated or not a token file")
    tokens = np.memmap(path, dtype=DTYPE_CODES[code], mode="r", offset=HEADER.size, shape=(count,))
    check_ids(tokens, vocab, f"data file {path}", fix="its header's vocab_size understates its ids: write the file "
                                                       "again (moekit-prepare, or moekit.train.tokens.write_token_file)")
    return tokens, vocab


def check_ids(tokens: np.ndarray, vocab_size: int, what: str, chunk: int = 1 << 24, fix: str = "") -> None:
    """One chunked pass over the ids (memmap-friendly): all must be in [0, vocab_size). A pass is ~10 ms per 100M
    uint16 ids from the page cache, so every data file is checked whole when it is opened, never per batch.
    An id too large names the first one, its position and the largest id; ``fix`` ("{need}": largest id + 1)."""
    signed = tokens.dtype.kind == "i"
    for start in range(0, tokens.size, chunk):
        part = tokens[start : start + chunk]
        if not part.size:
            continue
        if int(part.max()) >= vocab_size:
            pos = start + int(np.argmax(part >= vocab_size))
            need = 1 + max(int(tokens[i : i + chunk].max()) for i in range(start, tokens.size, chunk))
            raise UserError(f"{what}: token id {int(tokens[pos])} at position {pos:,} is >= vocab_size {vocab_size} "
                            f"(the largest id is {need - 1:,}){'; ' + fix.replace('{need}', str(need)) if fix else ''}")
        if signed and int(part.min()) < 0:
            pos = start + int(np.argmax(part < 0))
            raise UserError(f"{what}: token id {int(tokens[pos])} at position {pos:,} is negative")


# ---------------------------------------------------------------------------------------------------
# Other formats (raw .bin, .npy), prepared sets' metadata, the tokenizer a set was made with
# ---------------------------------------------------------------------------------------------------

RAW_DTYPES = {"uint8": np.dtype("u1"), "uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
METADATA_FORMAT = "moekit-prepared"
TOKENIZER_KINDS = ("hf", "bytes", "unknown")


def metadata_path(path: str) -> str:
    """Where a prepared set's metadata lies: beside the token file, its name + ``.json``."""
    return f"{path}.json"


def tokenizer_copy_path(path: str) -> str:
    """Where moekit-prepare copies the tokenizer.json it used: beside the token file, its name + ``.tokenizer.json``."""
    return f"{path}.tokenizer.json"


# The tokenizer folder's other files that chat and export need (special tokens, chat template): moekit-prepare copies
# those present beside the token file (``tokenizer_extra_path``), the metadata lists them ("tokenizer": "extras"), and
# the trainer copies them into the run directory under these names (record_tokenizer), where moekit-generate --chat
# and the HF export find them.
TOKENIZER_EXTRAS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json")


def tokenizer_extra_path(path: str, name: str) -> str:
    """Where moekit-prepare copies the tokenizer folder's file ``name`` (TOKENIZER_EXTRAS): the token file's name + it."""
    return f"{path}.{name}"


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class TokenizerInfo:
    """The tokenizer a token set was made with, as the run directory records it (``record``).

    kind: ``hf`` (a HuggingFace ``tokenizers`` tokenizer.json, ``file``), ``bytes`` (ids 0-255 are the bytes
    of UTF-8 text; ``eos_id`` 256 when the set marks document ends), ``unknown`` (a file without metadata)."""

    kind: str
    source: str | None = None  # what moekit-prepare read: a tokenizer.json, a folder, or "bytes"
    sha256: str | None = None  # of the tokenizer.json (hf)
    vocab_size: int | None = None
    eos_id: int | None = None
    file: str | None = None  # hf: the tokenizer.json beside the data (copied into the run directory)
    extras: tuple[tuple[str, str], ...] = ()  # hf: (name in TOKENIZER_EXTRAS, its copy beside the data)

    def record(self) -> dict:
        return {"kind": self.kind, "source": self.source, "sha256": self.sha256, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id}

    def same_as(self, other: "TokenizerInfo") -> bool:
        return (self.kind, self.sha256, self.vocab_size, self.eos_id) == (
            other.kind, other.sha256, other.vocab_size, other.eos_id)

    def describe(self) -> str:
        if self.kind == "unknown":
            return "no metadata" + (f", vocab {self.vocab_size}" if self.vocab_size else "")
        sha = f" sha256 {self.sha256[:12]}" if self.sha256 else ""
        return f"{self.kind} tokenizer{sha}, vocab {self.vocab_size}, eos {self.eos_id}"


BYTES = TokenizerInfo("bytes", "bytes", None, 256, None)


def read_metadata(path: str) -> dict | None:
    """A prepared set's metadata (``<path>.json``), or None when there is none."""
    meta = metadata_path(path)
    try:
        with open(meta, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UserError(f"data file {path}: cannot read its metadata {meta} ({exc.strerror})") from None
    try:
        values = json.loads(raw)
    except ValueError as exc:  # UnicodeDecodeError included
        raise UserError(f"data file {path}: its metadata {meta} is not valid JSON ({exc}); re-run moekit-prepare, "
                        f"or remove it to train on the ids alone") from None
    if not isinstance(values, dict):
        raise UserError(f"data file {path}: its metadata {meta} must be a JSON object, not {type(values).__name__}")
    return values


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def tokenizer_of(path: str, meta: dict | None) -> TokenizerInfo:
    """The tokenizer that ``meta`` (``read_metadata(path)``) declares, checked: vocab_size, eos_id, and for an
    ``hf`` tokenizer that its tokenizer.json is there with the digest it was prepared with."""
    if meta is None:
        return TokenizerInfo("unknown")
    where = f"data file {path}: metadata {metadata_path(path)}"
    vocab, eos = meta.get("vocab_size"), meta.get("eos_id")
    if not (_is_int(vocab) and 1 <= vocab <= 1 << 32):
        raise UserError(f"{where}: vocab_size {vocab!r} must be a positive integer")
    if eos is not None and not (_is_int(eos) and 0 <= eos < vocab):
        raise UserError(f"{where}: eos_id {eos!r} must be null or an id below vocab_size {vocab}")
    tok = meta.get("tokenizer") or {}
    kind = tok.get("kind", "unknown") if isinstance(tok, dict) else None
    if kind not in TOKENIZER_KINDS:
        raise UserError(f"{where}: tokenizer must be an object whose kind is one of {list(TOKENIZER_KINDS)}, got "
                        f"{tok!r}")
    if kind != "hf":
        return TokenizerInfo(kind, tok.get("source") or (kind if kind == "bytes" else None), None, vocab, eos)
    name = tok.get("file")
    if not isinstance(name, str) or not name:
        raise UserError(f"{where}: an hf tokenizer needs \"file\", the name of its tokenizer.json beside the data")
    file = os.path.join(os.path.dirname(os.path.abspath(path)), name)
    try:
        digest = sha256_file(file)
    except OSError as exc:
        raise UserError(f"{where}: its tokenizer {file} cannot be read ({exc.strerror}); put the tokenizer.json "
                        f"the set was prepared with there, or prepare the set again") from None
    want = tok.get("sha256")
    if want is not None and want != digest:
        raise UserError(f"{where}: {file} has sha256 {digest[:12]}..., the set was prepared with {str(want)[:12]}...: "
                        f"the tokenizer was replaced; restore it or prepare the set again")
    names = tok.get("extras") or []
    if not isinstance(names, list) or any(n not in TOKENIZER_EXTRAS for n in names):
        raise UserError(f"{where}: tokenizer extras {names!r} must list files among {list(TOKENIZER_EXTRAS)}")
    extras = tuple((n, tokenizer_extra_path(os.path.abspath(path), n)) for n in names)
    for name, copy in extras:
        if not os.path.isfile(copy):
            raise UserError(f"{where}: lists the tokenizer's {name}, but its copy {copy} is missing; restore it or "
                            f"prepare the set again")
    return TokenizerInfo("hf", tok.get("source") or file, digest, vocab, eos, file, extras)


def check_same_tokenizer(sets: list[tuple[str, TokenizerInfo]], where: str = "--data.blend",
                         fix: str = "blend sets prepared with one tokenizer") -> None:
    """A blend's sets (or the training data and its --data.val_path file) must share one tokenizer (kind,
    tokenizer.json digest, vocab, EOS): one line otherwise."""
    first_path, first = sets[0]
    for path, info in sets[1:]:
        if first.kind == info.kind == "unknown" and first.vocab_size == info.vocab_size:
            continue  # no metadata on either: nothing to compare
        if not first.same_as(info):
            raise UserError(f"{where}: {first_path} ({first.describe()}) and {path} ({info.describe()}) were "
                            f"not prepared with the same tokenizer; {fix} (moekit-prepare --tokenizer, the same for "
                            f"every set)")


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


@dataclass
class Source:
    path: str
    tokens: np.ndarray
    desc: str
    tokenizer: TokenizerInfo
    mask: np.ndarray | None = None  # [tokens] uint8 loss mask (1: trained on as a target), or None: every token
    packed: int | None = None  # moekit-prepare --pack N: whole conversations in sequences of N tokens from 0


LOSS_MASK_KEY = "loss_mask"  # the metadata entry naming a set's loss-mask file (beside the data file)


def read_loss_mask(path: str, meta: dict | None, size: int, chunk: int = 1 << 24) -> tuple[np.ndarray | None, str]:
    """(the loss mask ``meta`` names for the data file ``path`` of ``size`` tokens, memory-mapped; a description),
    or (None, "") without one. The mask is a headerless file of one byte per token, 1 where the token is a target
    the loss counts (an assistant's reply), 0 where it is context only (a prompt); checked whole, once."""
    name = (meta or {}).get(LOSS_MASK_KEY)
    if name is None:
        return None, ""
    where = f"data file {path}: metadata {metadata_path(path)}"
    if not isinstance(name, str) or not name:
        raise UserError(f"{where}: {LOSS_MASK_KEY} must be the mask file's name, got {name!r}")
    mask_path = os.path.join(os.path.dirname(path), name)
    try:
        got = os.path.getsize(mask_path)
    except OSError as exc:
        raise UserError(f"{where} names the loss mask {mask_path}, which cannot be read ({exc.strerror}); restore it, "
                        f"or remove {LOSS_MASK_KEY} to train on every token") from None
    if got != size:
        raise UserError(f"loss mask {mask_path}: {got:,} bytes for {size:,} tokens of {path}; it must hold one byte per "
                        f"token: prepare the set again")
    mask = np.memmap(mask_path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    counted = 0
    for start in range(0, size, chunk):
        part = mask[start : start + chunk]
        if int(part.max()) > 1:
            pos = start + int(np.argmax(part > 1))
            raise UserError(f"loss mask {mask_path}: byte {int(part[pos - start])} at position {pos:,}; a loss mask "
                            f"holds 0 (context) or 1 (a target the loss counts)")
        counted += int(part.sum(dtype=np.int64))
    return mask, f", loss mask {name}: {counted / max(size, 1):.1%} of the tokens trained"


def open_token_data(path: str, raw_dtype: str, model_vocab: int) -> Source:
    """One data file: a MOEKTOK token file, a ``.npy`` array, else headerless ids of ``raw_dtype``; its
    metadata when present (vocab, EOS, tokenizer); every id checked against the vocabulary."""
    meta = read_metadata(path)
    info = tokenizer_of(path, meta)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(len(MAGIC))
    except OSError as exc:
        raise UserError(f"data file {path}: cannot read it ({exc.strerror})") from None
    fix = ("set --model.vocab_size {need} (or more) if the ids are right, or tokenize the data again for the model's "
           "vocabulary" if info.vocab_size is None else
           f"its metadata {metadata_path(path)} declares vocab_size {info.vocab_size}, fewer than the ids need: "
           "prepare the set again (moekit-prepare), or correct vocab_size there")
    if head == MAGIC:
        tokens, vocab = read_token_file(path)
        if info.vocab_size is not None and info.vocab_size != vocab:
            raise UserError(f"data file {path}: its header says vocab_size {vocab}, its metadata "
                            f"{metadata_path(path)} says {info.vocab_size}; prepare the set again")
        if info.kind == "unknown" and vocab == 256:  # what --write-data writes: byte tokens
            info = TokenizerInfo("bytes", "bytes (a token file of vocab 256)", None, 256, None)
        kind = "token file"
    elif path.lower().endswith(".npy"):
        tokens, vocab, kind = _read_npy(path), info.vocab_size, ".npy file"
        check_ids(tokens, vocab or model_vocab, f"data file {path}", fix=fix)
    else:
        dt = RAW_DTYPES[raw_dtype]
        what = (f"data file {path}: bad magic {head!r} (no MOEKTOK token-file header), so it was read as "
                f"headerless {raw_dtype} ids (a raw .bin as nanoGPT writes; --data.dtype)")
        if size == 0 or size % dt.itemsize:
            raise UserError(f"{what}: its {size:,} bytes are not a whole, non-zero number of {dt.itemsize}-byte ids")
        tokens, vocab, kind = np.memmap(path, dtype=dt, mode="r"), info.vocab_size, f"raw {raw_dtype} file"
        check_ids(tokens, vocab or model_vocab, what, fix=fix)
    if vocab is not None and vocab > model_vocab:
        raise UserError(f"data file {path}: vocab_size {vocab} exceeds the model's vocab_size {model_vocab}; "
                        f"set --model.vocab_size {vocab}")
    tok = "" if info.kind == "unknown" else f", {info.describe()}"
    vocab_text = f", vocab {vocab}" if vocab is not None and info.kind == "unknown" else ""
    mask, mask_text = read_loss_mask(path, meta, tokens.size)
    packed = read_packed(path, meta, tokens.size)
    pack_text = f", packed in sequences of {packed}" if packed else ""
    return Source(path, tokens, f"{kind} {path}, {tokens.size:,} tokens{vocab_text}{tok}{mask_text}{pack_text}", info,
                  mask, packed)


PACKED_KEY = "packed"  # the metadata entry: the sequence length moekit-prepare --pack packed for


def read_packed(path: str, meta: dict | None, size: int) -> int | None:
    """The sequence length N a set was packed for (its sequences at multiples of N, then one EOS), or None."""
    n = (meta or {}).get(PACKED_KEY)
    if n is None:
        return None
    if not isinstance(n, int) or isinstance(n, bool) or n < 2 or size % n != 1:
        raise UserError(f"data file {path}: metadata {metadata_path(path)} says {PACKED_KEY} {n!r}, but the file's "
                        f"{size:,} tokens are not whole sequences of it and one EOS; prepare the set again")
    return n


def _read_npy(path: str) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise UserError(f"data file {path}: not a readable .npy file ({exc})") from None
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or tokens.dtype.kind not in "iu" or not tokens.size:
        shape = getattr(tokens, "shape", "?")
        raise UserError(f"data file {path}: holds {getattr(tokens, 'dtype', '?')} of shape {shape}; a .npy data "
                        f"file must be one non-empty dimension of integer token ids")
    return tokens


def load_tokens(path: str, text: str, model_vocab: int, raw_dtype: str = "uint16") -> tuple[np.ndarray, str]:
    """The configured source: token file, text file, or the embedded corpus; ids checked against the model."""
    if path:
        source = open_token_data(path, raw_dtype, model_vocab)
        return source.tokens, source.desc
    tokens, desc = text_tokens(text) if text else embedded_corpus()
    if model_vocab < 256:
        raise UserError(f"byte-level data needs model.vocab_size >= 256, got {model_vocab}")
    return tokens, desc


def record_tokenizer(run_dir, info: TokenizerInfo) -> None:
    """Write the run directory's tokenizer record (docs/training.md, "The tokenizer of a run"): ``tokenizer.json``
    (a copy of the set's, kind hf; removed otherwise, so a stale one never decodes) and ``tokenizer_info.json``."""
    run_dir = os.fspath(run_dir)
    target = os.path.join(run_dir, "tokenizer.json")
    if info.kind == "hf" and info.file:
        shutil.copyfile(info.file, target + ".partial")
        os.replace(target + ".partial", target)
    elif os.path.lexists(target):
        os.unlink(target)
    extras = dict(info.extras) if info.kind == "hf" else {}
    for name in TOKENIZER_EXTRAS:  # the special tokens and chat template of the set's tokenizer folder
        target = os.path.join(run_dir, name)
        if name in extras:
            shutil.copyfile(extras[name], target + ".partial")
            os.replace(target + ".partial", target)
        elif os.path.lexists(target):
            os.unlink(target)  # a stale one from an earlier tokenizer never lays out a chat
    record = os.path.join(run_dir, "tokenizer_info.json")
    with open(record + ".partial", "w") as f:
        json.dump(info.record(), f, indent=1)
        f.write("\n")
    os.replace(record + ".partial", record)
