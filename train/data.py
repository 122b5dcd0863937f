"""Training data: the embedded corpus, token files, the train/validation split and the batch sampler.

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
the run's tokenizer record from it (docs/training.md, "Data" and "The tokenizer of a run").

Split: the token stream is cut into blocks of ``BLOCK`` tokens; every k-th block (k = round(1 /
val_fraction)) is validation, the rest training. Sequences never cross a block boundary, so no
validation text leaks into a training sequence, and the split does not depend on seq_len.

Blends (``--data.blend "a.bin:0.7,b.bin:0.3"``): every set is split on its own; ``BlendSampler`` draws
each window's set so that the counts follow the weights as closely as integers can (the set whose count
lags its share most goes next), and within a set follows that set's own seeded permutation; validation
takes ``eval.sequences`` windows shared among the sets by weight.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sysconfig
from dataclasses import dataclass

import numpy as np

from moekit.train import UserError

MAGIC = b"MOEKTOK\0"
VERSION = 1
HEADER = struct.Struct("<8sIIIIQ")  # magic, version, vocab, dtype code, reserved, count: 32 bytes
DTYPE_CODES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
BLOCK = 16384  # ~16 KB of text: validation samples many modules, < 2% lost at block ends

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
                        f"moekit-prepare or moekit-train --write-data (or moekit.train.data.write_token_file)")
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
    check_ids(tokens, vocab, f"data file {path}")
    return tokens, vocab


def check_ids(tokens: np.ndarray, vocab_size: int, what: str, chunk: int = 1 << 24, fix: str = "") -> None:
    """One chunked pass over the ids (memmap-friendly): all must be in [0, vocab_size)."""
    signed = tokens.dtype.kind == "i"
    for start in range(0, tokens.size, chunk):
        part = tokens[start : start + chunk]
        if not part.size:
            continue
        if int(part.max()) >= vocab_size:
            pos = start + int(np.argmax(part >= vocab_size))
            raise UserError(f"{what}: token id {int(tokens[pos])} at position {pos:,} is >= vocab_size {vocab_size}"
                            f"{'; ' + fix if fix else ''}")
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
    return TokenizerInfo("hf", tok.get("source") or file, digest, vocab, eos, file)


def check_same_tokenizer(sets: list[tuple[str, TokenizerInfo]]) -> None:
    """A blend's sets must share one tokenizer (kind, tokenizer.json digest, vocab, EOS): one line otherwise."""
    first_path, first = sets[0]
    for path, info in sets[1:]:
        if first.kind == info.kind == "unknown" and first.vocab_size == info.vocab_size:
            continue  # no metadata on either: nothing to compare
        if not first.same_as(info):
            raise UserError(f"--data.blend: {first_path} ({first.describe()}) and {path} ({info.describe()}) were "
                            f"not prepared with the same tokenizer; blend sets prepared with one tokenizer "
                            f"(moekit-prepare --tokenizer, the same for every set)")


def parse_blend(spec: str, where: str = "--data.blend") -> list[tuple[str, float]]:
    """``"a.bin:0.7,b.bin:0.3"`` -> [("a.bin", 0.7), ("b.bin", 0.3)]; weights positive, each path once."""
    entries: list[tuple[str, float]] = []
    for item in spec.split(","):
        path, sep, text = item.strip().rpartition(":")
        if not sep or not path.strip():
            raise UserError(f"{where} {spec!r}: entry {item.strip()!r} is not PATH:WEIGHT; write e.g. "
                            f"\"a.bin:0.7,b.bin:0.3\"")
        try:
            weight = float(text)
        except ValueError:
            raise UserError(f"{where} {spec!r}: weight {text!r} of {path} is not a number") from None
        entries.append((path.strip(), weight))
    return check_blend(entries, where)


def check_blend(entries: list[tuple[str, float]], where: str) -> list[tuple[str, float]]:
    if not entries:
        raise UserError(f"{where}: no sets; give at least one PATH:WEIGHT")
    seen = set()
    for path, weight in entries:
        if not (math.isfinite(weight) and weight > 0):
            raise UserError(f"{where}: weight {weight!r} of {path} is invalid; weights must be positive numbers "
                            f"(they are normalised to sum to 1)")
        if path in seen:
            raise UserError(f"{where}: {path} is listed twice; give each set once, with one weight")
        if "," in path:
            raise UserError(f"{where}: path {path!r} contains a comma, which the PATH:WEIGHT list cannot hold; "
                            f"rename or link the file")
        seen.add(path)
    return entries


def blend_spec(value, where: str) -> str:
    """``data.blend`` from the command line ("a.bin:0.7,b.bin:0.3") or a config file (that string, a table
    {"a.bin" = 0.7, ...}, or an array of {path = "a.bin", weight = 0.7}) -> the canonical string form."""
    if isinstance(value, str):
        entries = parse_blend(value, where) if value.strip() else []
    elif isinstance(value, dict):
        entries = [(k, _weight(w, k, where)) for k, w in value.items()]
    elif isinstance(value, list):
        entries = []
        for item in value:
            if not (isinstance(item, dict) and set(item) == {"path", "weight"} and isinstance(item["path"], str)):
                raise UserError(f"{where}: each array entry must be a table {{path = \"a.bin\", weight = 0.7}}, "
                                f"got {item!r}")
            entries.append((item["path"], _weight(item["weight"], item["path"], where)))
    else:
        raise UserError(f"{where}: expected \"PATH:WEIGHT,...\", a table of path = weight, or an array of "
                        f"{{path, weight}} tables; got {value!r}")
    return ",".join(f"{p}:{w!r}" for p, w in check_blend(entries, where)) if entries else ""


def _weight(w, path: str, where: str) -> float:
    if isinstance(w, bool) or not isinstance(w, (int, float)):
        raise UserError(f"{where}: weight {w!r} of {path} must be a number")
    return float(w)


def data_files(section) -> list[str]:
    """The token files a [data] section names: its path, or its blend's paths."""
    if section.blend:
        return [p for p, _ in parse_blend(section.blend)]
    return [section.path] if section.path else []


def prepared_vocab(section) -> tuple[int, str] | None:
    """(vocab_size, file) that the data's metadata declares, for the model to take; None without metadata.
    Also refuses, before any work, a blend whose sets are missing or were prepared with different tokenizers."""
    files = data_files(section)
    sets = []
    for path in files:
        if section.blend and not os.path.isfile(path):
            raise UserError(f"--data.blend: {path}: no such file")
        sets.append((path, tokenizer_of(path, read_metadata(path))))
    if len(sets) > 1:
        check_same_tokenizer(sets)
    return next(((info.vocab_size, path) for path, info in sets if info.vocab_size is not None), None)


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


@dataclass
class Source:
    path: str
    tokens: np.ndarray
    desc: str
    tokenizer: TokenizerInfo


def open_token_data(path: str, raw_dtype: str, model_vocab: int) -> Source:
    """One data file: a MOEKTOK token file, a ``.npy`` array, else headerless ids of ``raw_dtype``; its
    metadata when present (vocab, EOS, tokenizer); every id checked against the vocabulary."""
    info = tokenizer_of(path, read_metadata(path))
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(len(MAGIC))
    except OSError as exc:
        raise UserError(f"data file {path}: cannot read it ({exc.strerror})") from None
    fix = "set --model.vocab_size" if info.vocab_size is None else "prepare the set again"
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
    return Source(path, tokens, f"{kind} {path}, {tokens.size:,} tokens{vocab_text}{tok}", info)


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


@dataclass
class Data:
    """What the run trains on: one source, or a blend (``weights`` set) of token files sharing a tokenizer."""

    sources: list[Source]
    weights: list[float] | None
    desc: str
    tokenizer: TokenizerInfo

    def split(self, seq_len: int, val_fraction: float) -> "Split":
        if self.weights is None:
            return split_windows(self.sources[0].tokens, seq_len, val_fraction)
        return blend_split(self.sources, self.weights, seq_len, val_fraction)

    def fingerprint_tokens(self) -> np.ndarray:
        """What moekit.train.consistency fingerprints to check that every rank reads the same data."""
        if self.weights is None:
            return self.sources[0].tokens
        from moekit.train.consistency import data_fingerprint

        text = "; ".join(data_fingerprint(s.tokens) for s in self.sources)
        return np.frombuffer(text.encode(), dtype=np.uint8)


def load_data(section, model_vocab: int) -> Data:
    """The [data] section's data (moekit.train.config.DataSection): --data.blend, --data.path, --data.text,
    or the embedded corpus."""
    if section.blend:
        entries = parse_blend(section.blend)
        sources = [open_token_data(path, section.dtype, model_vocab) for path, _ in entries]
        check_same_tokenizer([(s.path, s.tokenizer) for s in sources])
        total = math.fsum(w for _, w in entries)
        parts = ", ".join(f"{s.path} x{w / total:.3g} ({s.tokens.size:,} tokens)"
                          for s, (_, w) in zip(sources, entries))
        info = sources[0].tokenizer
        tok = "" if info.kind == "unknown" else f"; {info.describe()}"
        return Data(sources, [w for _, w in entries], f"blend of {len(sources)} sets: {parts}{tok}", info)
    if section.path:
        source = open_token_data(section.path, section.dtype, model_vocab)
        return Data([source], None, source.desc, source.tokenizer)
    tokens, desc = load_tokens("", section.text, model_vocab)
    return Data([Source(section.text, tokens, desc, BYTES)], None, desc, BYTES)


def record_tokenizer(run_dir, info: TokenizerInfo) -> None:
    """Write the run directory's tokenizer record (docs/training.md, "The tokenizer of a run"): ``tokenizer.json``
    (a copy of the set's, kind hf; removed otherwise, so a stale one never decodes) and ``tokenizer_info.json``."""
    import shutil

    run_dir = os.fspath(run_dir)
    target = os.path.join(run_dir, "tokenizer.json")
    if info.kind == "hf" and info.file:
        shutil.copyfile(info.file, target + ".partial")
        os.replace(target + ".partial", target)
    elif os.path.lexists(target):
        os.unlink(target)
    record = os.path.join(run_dir, "tokenizer_info.json")
    with open(record + ".partial", "w") as f:
        json.dump(info.record(), f, indent=1)
        f.write("\n")
    os.replace(record + ".partial", record)


# ---------------------------------------------------------------------------------------------------
# Split and sampling
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    tokens: np.ndarray
    train_starts: np.ndarray  # [n_train] int64 first position of each training sequence window
    val_starts: np.ndarray  # [n_val] likewise, held-out blocks only

    def sampler(self, seed: int) -> "Sampler":
        return Sampler(self.train_starts, seed)

    def validation(self, n: int) -> np.ndarray:
        """The fixed validation windows: ``n`` (at most all) spread evenly over the held-out blocks."""
        n = min(n, self.val_starts.size)
        return self.val_starts[np.linspace(0, self.val_starts.size - 1, n).round().astype(np.int64)]


def split_windows(tokens: np.ndarray, seq_len: int, val_fraction: float) -> Split:
    """Non-overlapping windows of seq_len + 1 tokens inside blocks; every k-th block is validation."""
    k = max(2, round(1 / val_fraction))
    n = tokens.size
    block = min(BLOCK, n // k)  # small data still gets k blocks, hence one validation block
    if block < seq_len + 1:
        raise UserError(f"the data has {n:,} tokens: too few for sequences of {seq_len} with a 1/{k} validation "
                        f"split (need at least {k * (seq_len + 1):,}); use more data or a smaller --train.seq_len")
    per_block = (block - 1) // seq_len
    blocks = np.arange(n // block, dtype=np.int64)
    starts = blocks[:, None] * block + np.arange(per_block, dtype=np.int64)[None, :] * seq_len  # [blocks, w]
    is_val = (blocks % k) == k - 1
    return Split(tokens, starts[~is_val].reshape(-1), starts[is_val].reshape(-1))


class Sampler:
    """Training windows in a fresh seeded permutation per epoch; its state is the data position.

    ``next(n)`` returns the start positions of the next n windows of the global batch; data-parallel
    ranks take contiguous shares of it. ``state_dict()`` / ``load_state_dict()`` resume exactly.
    ``stream``: a blend's set number, so that sets of equal size are not visited in the same order.
    """

    def __init__(self, starts: np.ndarray, seed: int, stream: int | None = None):
        self.starts, self.seed, self.stream = starts, seed, stream
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> np.ndarray:
        key = [self.seed, self.epoch] if self.stream is None else [self.seed, self.epoch, 1 + self.stream]
        return np.random.default_rng(key).permutation(self.starts.size)

    def next(self, n: int) -> np.ndarray:
        out = []
        while n > 0:
            if self.position == self.starts.size:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
            take = min(n, self.starts.size - self.position)
            out.append(self.starts[self._order[self.position : self.position + take]])
            self.position += take
            n -= take
        return np.concatenate(out)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "windows": int(self.starts.size)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if (state["seed"], state["windows"]) != (self.seed, self.starts.size):
            raise UserError(f"the checkpoint's data position is for seed {state['seed']} over {state['windows']} "
                            f"windows, this run has seed {self.seed} over {self.starts.size}; resume with the same "
                            f"data, --seed and --train.seq_len")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation()


# ---------------------------------------------------------------------------------------------------
# Blends
# ---------------------------------------------------------------------------------------------------


class BlendTokens:
    """The sets of a blend seen as one id sequence (set i from ``offsets[i]`` on), without copying: indexing
    with an integer array (``gather``) or a slice reads from each set's memory map."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.offsets = np.cumsum([0] + [p.size for p in parts]).astype(np.int64)
        self.size = int(self.offsets[-1])
        self.dtype = np.result_type(*[p.dtype for p in parts])

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self.size)
            if step != 1:
                raise IndexError("BlendTokens slices take step 1")
            pieces = [np.asarray(p[max(start - off, 0) : max(min(stop - off, p.size), 0)], dtype=self.dtype)
                      for p, off in zip(self.parts, self.offsets.tolist())]
            return np.concatenate(pieces)
        index = np.asarray(index, dtype=np.int64)
        which = np.searchsorted(self.offsets, index, side="right") - 1
        out = np.empty(index.shape, dtype=self.dtype)
        for i, (part, off) in enumerate(zip(self.parts, self.offsets.tolist())):
            mine = which == i
            if mine.any():
                out[mine] = part[index[mine] - off]
        return out


@dataclass(frozen=True)
class BlendSplit(Split):
    """Each set split on its own (``parts``, positions local to the set), seen through ``BlendTokens``:
    ``train_starts`` / ``val_starts`` are the sets' windows at their offsets, in set order."""

    parts: tuple[Split, ...] = ()
    weights: tuple[float, ...] = ()  # normalised to sum to 1
    names: tuple[str, ...] = ()

    def _starts(self, which: str) -> list[np.ndarray]:
        return [getattr(p, which) + off for p, off in zip(self.parts, self.tokens.offsets.tolist())]

    def sampler(self, seed: int) -> "BlendSampler":
        return BlendSampler(self._starts("train_starts"), list(self.weights), seed, list(self.names))

    def validation(self, n: int) -> np.ndarray:
        """``n`` windows shared among the sets by weight (largest remainder; every set gets one when n allows),
        each set's share spread evenly over its held-out blocks: a fixed weighted mix."""
        shares = weighted_shares(n, self.weights)
        return np.concatenate([p.validation(k) + off for p, k, off in
                               zip(self.parts, shares, self.tokens.offsets.tolist())])


def weighted_shares(n: int, weights) -> list[int]:
    """Split n into integers proportional to ``weights`` (largest remainder), each >= 1 when n >= len(weights)."""
    exact = [n * w for w in weights]
    shares = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (shares[i] - exact[i], i))
    for i in by_remainder[: n - sum(shares)]:
        shares[i] += 1
    if n >= len(shares):
        for i in range(len(shares)):
            if shares[i] == 0:
                shares[i] += 1
                shares[max(range(len(shares)), key=lambda j: (shares[j], -j))] -= 1
    return shares


def blend_split(sources: list[Source], weights: list[float], seq_len: int, val_fraction: float) -> BlendSplit:
    parts = []
    for s in sources:
        try:
            parts.append(split_windows(s.tokens, seq_len, val_fraction))
        except UserError as exc:
            raise UserError(f"--data.blend set {s.path}: {exc}") from None
    tokens = BlendTokens([s.tokens for s in sources])
    total = math.fsum(weights)
    split = BlendSplit(tokens, np.empty(0, np.int64), np.empty(0, np.int64), tuple(parts),
                       tuple(w / total for w in weights), tuple(s.path for s in sources))
    object.__setattr__(split, "train_starts", np.concatenate(split._starts("train_starts")))
    object.__setattr__(split, "val_starts", np.concatenate(split._starts("val_starts")))
    return split


class BlendSampler:
    """A weighted mixture of sets, each with its own ``Sampler`` (its own epochs and seeded permutations).

    Which set the k-th window of the run comes from does not depend on the seed or the batch size: the set
    whose count lags its share of k the most (``weight * k - count``, ties to the first set), so after any k
    windows every set's count is within one of ``weight * k``. The state (windows drawn per set, each set's
    epoch and position) resumes exactly, mid-epoch included."""

    def __init__(self, starts: list[np.ndarray], weights: list[float], seed: int, names: list[str]):
        total = math.fsum(weights)
        self.weights = [w / total for w in weights]
        self.seed, self.names = seed, names
        self.samplers = [Sampler(s, seed, stream=i) for i, s in enumerate(starts)]
        self.counts = [0] * len(starts)

    def choose(self, n: int) -> np.ndarray:
        """The sets of the next n windows."""
        out = np.empty(n, dtype=np.int64)
        counts, weights = self.counts, self.weights
        drawn = sum(counts)
        for j in range(n):
            drawn += 1
            best = max(range(len(weights)), key=lambda i: (weights[i] * drawn - counts[i], -i))
            counts[best] += 1
            out[j] = best
        return out

    def next(self, n: int) -> np.ndarray:
        which = self.choose(n)
        out = np.empty(n, dtype=np.int64)
        for i, sampler in enumerate(self.samplers):
            mine = which == i
            if mine.any():
                out[mine] = sampler.next(int(mine.sum()))
        return out

    def tokens_by_source(self, seq_len: int) -> dict[str, int]:
        """Tokens drawn from each set so far (windows x seq_len), for metrics.jsonl."""
        return {name: count * seq_len for name, count in zip(self.names, self.counts)}

    def state_dict(self) -> dict:
        # flat, fixed keys: DCP stores the lists whole, whatever the number of sets
        return {"kind": "blend", "seed": self.seed, "weights": list(self.weights),
                "windows": [int(s.starts.size) for s in self.samplers], "counts": list(self.counts),
                "epochs": [s.epoch for s in self.samplers], "positions": [s.position for s in self.samplers]}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        if state.get("kind") != "blend" or any(state.get(k) != mine[k] for k in ("seed", "weights", "windows")):
            theirs = (f"a blend with weights {state.get('weights')} over {state.get('windows')} windows and seed "
                      f"{state.get('seed')}" if state.get("kind") == "blend" else "one data set")
            raise UserError(f"the checkpoint's data position is for {theirs}; this run blends weights "
                            f"{mine['weights']} over {mine['windows']} windows with seed {self.seed}: resume with "
                            f"the same --data.blend, --seed and --train.seq_len")
        self.counts = [int(c) for c in state["counts"]]
        for sampler, epoch, position in zip(self.samplers, state["epochs"], state["positions"]):
            sampler.load_state_dict({"epoch": int(epoch), "position": int(position), "seed": self.seed,
                                     "windows": int(sampler.starts.size)})


def gather(tokens: np.ndarray, starts: np.ndarray, seq_len: int):
    """inputs, targets [n, seq_len] int64 torch tensors from window starts."""
    import torch

    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]  # [n, S+1]
    windows = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return windows[:, :-1], windows[:, 1:]


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats) of the token frequency distribution: the loss of the best context-free model."""
    counts = np.bincount(np.asarray(tokens), minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
