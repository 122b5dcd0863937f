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

Split: the token stream is cut into blocks of ``BLOCK`` tokens; every k-th block (k = round(1 /
val_fraction)) is validation, the rest training. Sequences never cross a block boundary, so no
validation text leaks into a training sequence, and the split does not depend on seq_len.
"""
from __future__ import annotations

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


def embedded_corpus() -> tuple[np.ndarray, str]:
    """(uint8 tokens, description) of the standard-library corpus."""
    root = sysconfig.get_paths()["stdlib"]
    parts, found = [], []
    for name in sorted(STDLIB_FILES):
        path = os.path.join(root, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                parts.append(f.read())
            found.append(name)
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
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}); got range [{tokens.min()}, {tokens.max()}]")
    code = 2 if vocab_size <= 1 << 16 else 4
    with open(path, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, vocab_size, code, 0, tokens.size))
        f.write(tokens.astype(DTYPE_CODES[code]).tobytes())


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
                        f"moekit-train --write-data (or moekit.train.data.write_token_file)")
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


def check_ids(tokens: np.ndarray, vocab_size: int, what: str, chunk: int = 1 << 24) -> None:
    """One chunked pass over the ids (memmap-friendly): all must be < vocab_size."""
    for start in range(0, tokens.size, chunk):
        part = tokens[start : start + chunk]
        if part.size and int(part.max()) >= vocab_size:
            pos = start + int(np.argmax(part >= vocab_size))
            raise UserError(f"{what}: token id {int(tokens[pos])} at position {pos:,} is >= vocab_size {vocab_size}")


def load_tokens(path: str, text: str, model_vocab: int) -> tuple[np.ndarray, str]:
    """The configured source: token file, text file, or the embedded corpus; ids checked against the model."""
    if path:
        tokens, vocab = read_token_file(path)
        if vocab > model_vocab:
            raise UserError(f"data file {path}: vocab_size {vocab} exceeds the model's vocab_size {model_vocab}; "
                            f"set --model.vocab_size {vocab}")
        return tokens, f"token file {path}, {tokens.size:,} tokens, vocab {vocab}"
    tokens, desc = text_tokens(text) if text else embedded_corpus()
    if model_vocab < 256:
        raise UserError(f"byte-level data needs model.vocab_size >= 256, got {model_vocab}")
    return tokens, desc


# ---------------------------------------------------------------------------------------------------
# Split and sampling
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    tokens: np.ndarray
    train_starts: np.ndarray  # [n_train] int64 first position of each training sequence window
    val_starts: np.ndarray  # [n_val] likewise, held-out blocks only


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
    """

    def __init__(self, starts: np.ndarray, seed: int):
        self.starts, self.seed = starts, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.starts.size)

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
