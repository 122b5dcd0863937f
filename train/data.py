"""What a run trains on: the [data] section (one token file, a weighted blend, ``--data.text`` or the
embedded corpus), the train/validation split and the batch samplers. The files themselves, their formats
and metadata are moekit.train.tokens.

Split: the token stream is cut into blocks of ``BLOCK`` tokens; every k-th block (k = round(1 /
val_fraction)) is validation, the rest training. Sequences never cross a block boundary, so no
validation text leaks into a training sequence, and the split does not depend on seq_len.

Blends (``--data.blend "a.bin:0.7,b.bin:0.3"``): every set is split on its own; ``BlendSampler`` draws
each window's set so that the counts follow the weights as closely as integers can (the set whose count
lags its share most goes next), and within a set follows that set's own seeded permutation; validation
takes ``eval.sequences`` windows shared among the sets by weight.

A validation file of its own (``--data.val_path val.bin``, nanoGPT's train.bin / val.bin, Megatron's
--valid-data-path): nothing is held out of the training data (one set or a blend), and validation takes
``eval.sequences`` windows spread evenly over the file's non-overlapping windows. It must be prepared with the
training data's tokenizer.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import numpy as np

from moekit.train import UserError
from moekit.train.tokens import (
    BYTES, Source, TokenizerInfo, check_same_tokenizer, load_tokens, open_token_data, read_metadata, tokenizer_of,
)

BLOCK = 16384  # ~16 KB of text: validation samples many modules, < 2% lost at block ends
PHASE_KEY = 0x5048  # marks a later data phase's permutation keys (Sampler.phase)


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


def set_names(paths) -> list[str]:
    """Short names for a blend's sets in records and figures: their file names, or the paths where two share one."""
    paths = list(paths)
    names = [os.path.basename(p) for p in paths]
    return names if len(set(names)) == len(names) else paths


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


@dataclass
class Data:
    """What the run trains on: one source, or a blend (``weights`` set) of token files sharing a tokenizer;
    ``val``: a validation file of its own (--data.val_path), else None (validation is held out of the sources)."""

    sources: list[Source]
    weights: list[float] | None
    desc: str
    tokenizer: TokenizerInfo
    val: Source | None = None

    def split(self, seq_len: int, val_fraction: float) -> "Split":
        held_out = 0.0 if self.val is not None else val_fraction  # a validation file: the sources train whole
        for s in self.sources + ([self.val] if self.val is not None else []):
            check_packed(s, seq_len)
        if self.weights is None:
            split = source_windows(self.sources[0], seq_len, held_out)
        else:
            split = blend_split(self.sources, self.weights, seq_len, held_out)
        if any(s.mask is not None for s in self.sources):  # loss masks (a blend: sets without one count whole)
            masks = [s.mask if s.mask is not None else np.broadcast_to(np.uint8(1), s.tokens.shape)
                     for s in self.sources]
            split = replace(split, mask=masks[0] if self.weights is None else BlendTokens(masks))
        if self.val is None:
            return split
        return replace(split, val_tokens=self.val.tokens, val_starts=file_windows(self.val, seq_len),
                       val_mask=self.val.mask)


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
        data = Data(sources, [w for _, w in entries], f"blend of {len(sources)} sets: {parts}{tok}", info)
    elif section.path:
        source = open_token_data(section.path, section.dtype, model_vocab)
        data = Data([source], None, source.desc, source.tokenizer)
    else:
        tokens, desc = load_tokens("", section.text, model_vocab)
        data = Data([Source(section.text, tokens, desc, BYTES)], None, desc, BYTES)
    return with_validation_file(data, section, model_vocab)


def with_validation_file(data: Data, section, model_vocab: int) -> Data:
    """``data`` with --data.val_path's file as its validation set (checked: the training data's tokenizer)."""
    if not getattr(section, "val_path", ""):
        return data
    val = open_token_data(section.val_path, section.dtype, model_vocab)
    train = data.sources[0].path or "the embedded corpus"
    check_same_tokenizer([(train, data.tokenizer), (val.path, val.tokenizer)], where="--data.val_path",
                         fix="validate on a file prepared with the training data's tokenizer")
    return replace(data, val=val, desc=f"{data.desc}; validation: {val.desc}")


# ---------------------------------------------------------------------------------------------------
# Split and sampling
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    tokens: np.ndarray
    train_starts: np.ndarray  # [n_train] int64 first position of each training sequence window
    val_starts: np.ndarray  # [n_val] likewise, held-out blocks only (in ``val_tokens`` when that is set)
    val_tokens: np.ndarray | None = None  # a validation file of its own (--data.val_path); None: ``tokens``
    mask: np.ndarray | None = None  # ``tokens``' loss mask (1: a target the loss counts), None: every token counts
    val_mask: np.ndarray | None = None  # ``val_tokens``' loss mask

    @property
    def held_out(self) -> np.ndarray:
        """The tokens ``val_starts`` index: the validation file's, else the training data's own."""
        return self.tokens if self.val_tokens is None else self.val_tokens

    @property
    def held_out_mask(self) -> np.ndarray | None:
        """``held_out``'s loss mask (None: every target counts)."""
        return self.mask if self.val_tokens is None else self.val_mask

    def sampler(self, seed: int, phase: int = 0) -> "Sampler":
        return Sampler(self.train_starts, seed, phase=phase)

    def validation(self, n: int) -> np.ndarray:
        """The fixed validation windows: ``n`` (at most all) spread evenly over the held-out blocks."""
        n = min(n, self.val_starts.size)
        return self.val_starts[np.linspace(0, self.val_starts.size - 1, n).round().astype(np.int64)]

    def validation_groups(self, n: int) -> list[tuple[str | None, np.ndarray]]:
        """``validation(n)`` as (source, windows) groups: one, unnamed, for a single set or a validation file."""
        return [(None, Split.validation(self, n))]  # a blend's validation file too (BlendSplit.validation)


def split_windows(tokens: np.ndarray, seq_len: int, val_fraction: float) -> Split:
    """Non-overlapping windows of seq_len + 1 tokens inside blocks; every k-th block is validation (none with
    ``val_fraction`` 0: a run that validates on a file of its own)."""
    n = tokens.size
    if val_fraction == 0:
        block = min(BLOCK, n)
        if block < seq_len + 1:
            raise UserError(f"the data has {n:,} tokens: too few for one sequence of {seq_len} (need at least "
                            f"{seq_len + 1:,}); use more data, or a smaller --train.seq_len")
        per_block = (block - 1) // seq_len
        starts = np.arange(n // block, dtype=np.int64)[:, None] * block + np.arange(per_block)[None, :] * seq_len
        return Split(tokens, starts.reshape(-1), np.empty(0, np.int64))
    k = max(2, round(1 / val_fraction))
    block = min(BLOCK, n // k)  # small data still gets k blocks, hence one validation block
    if block < seq_len + 1:
        raise UserError(f"the data has {n:,} tokens: too few for sequences of {seq_len} with a 1/{k} validation "
                        f"split (need at least {k * (seq_len + 1):,}); use more data, a smaller --train.seq_len"
                        f"{', or a larger --data.val_fraction' if k > 20 else ''}")
    per_block = (block - 1) // seq_len
    blocks = np.arange(n // block, dtype=np.int64)
    starts = blocks[:, None] * block + np.arange(per_block, dtype=np.int64)[None, :] * seq_len  # [blocks, w]
    is_val = (blocks % k) == k - 1
    return Split(tokens, starts[~is_val].reshape(-1), starts[is_val].reshape(-1))


def check_packed(source: Source, seq_len: int) -> None:
    """A set packed for sequences of N tokens (moekit-prepare --pack N) trains at --train.seq_len N or a multiple,
    whose windows hold whole sequences; any other length would cut its conversations."""
    n = source.packed
    if n and seq_len % n:
        raise UserError(f"data file {source.path} was packed for sequences of {n} tokens (moekit-prepare --pack {n}): "
                        f"--train.seq_len {seq_len} would cut its conversations; use --train.seq_len {n} (or a "
                        f"multiple), or prepare it again with --pack {seq_len}")


def source_windows(source: Source, seq_len: int, val_fraction: float) -> Split:
    """``split_windows`` of a set's tokens, or for a packed set (``source.packed``) its ``packed_windows``."""
    if source.packed:
        return packed_windows(source.tokens, seq_len, val_fraction)
    return split_windows(source.tokens, seq_len, val_fraction)


def packed_windows(tokens: np.ndarray, seq_len: int, val_fraction: float) -> Split:
    """The windows of a packed set (moekit-prepare --pack N, ``seq_len`` a multiple of N): at every multiple of
    ``seq_len`` from the first token, each seq_len + 1 tokens (the last reads the next sequence's first token, or the
    file's closing EOS: context, never a target), so every window holds whole conversations. Validation: every k-th
    group of consecutive windows (about BLOCK tokens each, fewer for small data), as split_windows' blocks."""
    count = (tokens.size - 1) // seq_len
    starts = np.arange(count, dtype=np.int64) * seq_len
    if val_fraction == 0:
        if count < 1:
            raise UserError(f"the packed data has {tokens.size:,} tokens: too few for one sequence of {seq_len}")
        return Split(tokens, starts, np.empty(0, np.int64))
    k = max(2, round(1 / val_fraction))
    if count < k:
        raise UserError(f"the packed data holds {count} sequence(s) of {seq_len}: too few for a 1/{k} validation split "
                        f"(need at least {k}); use more data, or validate on a file of its own (--data.val_path)")
    group = max(1, min(BLOCK // seq_len, count // k))
    is_val = (np.arange(count) // group) % k == k - 1
    return Split(tokens, starts[~is_val], starts[is_val])


def file_windows(source: Source, seq_len: int) -> np.ndarray:
    """The non-overlapping windows of seq_len + 1 tokens of a validation file, from its first token."""
    count = (source.tokens.size - 1) // seq_len
    if count < 1:
        raise UserError(f"--data.val_path {source.path}: {source.tokens.size:,} tokens, too few for one validation "
                        f"sequence of {seq_len} (need at least {seq_len + 1:,}); use a larger file, or a smaller "
                        f"--train.seq_len")
    return np.arange(count, dtype=np.int64) * seq_len


class Sampler:
    """Training windows in a fresh seeded permutation per epoch; its state is the data position.

    ``next(n)`` returns the start positions of the next n windows of the global batch; data-parallel
    ranks take contiguous shares of it. ``state_dict()`` / ``load_state_dict()`` resume exactly.
    ``stream``: a blend's set number, so that sets of equal size are not visited in the same order.
    ``phase``: the step a data phase began at (a resume that changed the data: --checkpoint.exclude_from_loading
    data), so that a phase does not replay an earlier one's order; 0 for a run's first phase.
    """

    def __init__(self, starts: np.ndarray, seed: int, stream: int | None = None, phase: int = 0):
        self.starts, self.seed, self.stream, self.phase = starts, seed, stream, phase
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> np.ndarray:
        key = [self.seed, self.epoch] if self.stream is None else [self.seed, self.epoch, 1 + self.stream]
        if self.phase:
            key += [PHASE_KEY, self.phase]
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

    def sampler(self, seed: int, phase: int = 0) -> "BlendSampler":
        return BlendSampler(self._starts("train_starts"), list(self.weights), seed, list(self.names), phase)

    def validation(self, n: int) -> np.ndarray:
        """``n`` windows shared among the sets by weight (largest remainder; every set gets one when n allows),
        each set's share spread evenly over its held-out blocks: a fixed weighted mix. With a validation file of its
        own: ``n`` windows of that file, as for one set."""
        return np.concatenate([starts for _, starts in self.validation_groups(n)])

    def validation_groups(self, n: int) -> list[tuple[str | None, np.ndarray]]:
        """``validation(n)`` by set: (the set's path, its share of the windows), the sets with a share, in order."""
        if self.val_tokens is not None:
            return super().validation_groups(n)
        shares = weighted_shares(n, self.weights)
        groups = [(name, p.validation(k) + off) for name, p, k, off in
                  zip(self.names, self.parts, shares, self.tokens.offsets.tolist())]
        return [(name, starts) for name, starts in groups if starts.size]


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
            parts.append(source_windows(s, seq_len, val_fraction))
        except UserError as exc:
            raise UserError(f"--data.blend set {s.path}: {exc}") from None
    tokens = BlendTokens([s.tokens for s in sources])
    total = math.fsum(weights)
    split = BlendSplit(tokens, np.empty(0, np.int64), np.empty(0, np.int64), parts=tuple(parts),
                       weights=tuple(w / total for w in weights), names=tuple(s.path for s in sources))
    object.__setattr__(split, "train_starts", np.concatenate(split._starts("train_starts")))
    object.__setattr__(split, "val_starts", np.concatenate(split._starts("val_starts")))
    return split


class BlendSampler:
    """A weighted mixture of sets, each with its own ``Sampler`` (its own epochs and seeded permutations).

    Which set the k-th window of the run comes from does not depend on the seed or the batch size: the set
    whose count lags its share of k the most (``weight * k - count``, ties to the first set), so after any k
    windows every set's count is within one of ``weight * k``. The state (windows drawn per set, each set's
    epoch and position) resumes exactly, mid-epoch included."""

    def __init__(self, starts: list[np.ndarray], weights: list[float], seed: int, names: list[str], phase: int = 0):
        total = math.fsum(weights)
        self.weights = [w / total for w in weights]
        self.seed, self.names = seed, names
        self.samplers = [Sampler(s, seed, stream=i, phase=phase) for i, s in enumerate(starts)]
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


def gather(tokens: np.ndarray, starts: np.ndarray, seq_len: int, mask: np.ndarray | None = None,
           eos: int | None = None):
    """inputs, targets [n, seq_len] int64 torch tensors from window starts; with a loss ``mask``, the targets
    ``counted`` leaves out are models.loss.IGNORE_INDEX."""
    import torch

    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]  # [n, S+1]
    ids = np.asarray(tokens[idx], dtype=np.int64)
    windows = torch.from_numpy(ids)
    x, y = windows[:, :-1], windows[:, 1:]
    if mask is not None:
        from moekit.models.loss import IGNORE_INDEX

        y = y.masked_fill(torch.from_numpy(~counted(tokens, mask, starts, seq_len, eos, ids)), IGNORE_INDEX)
    return x, y


def counted(tokens: np.ndarray, mask: np.ndarray, starts: np.ndarray, seq_len: int, eos: int | None,
            ids: np.ndarray | None = None) -> np.ndarray:
    """[n, S] bool: the targets of the windows at ``starts`` (their ids [n, S+1], read here unless given) that the
    loss counts. Those the
    ``mask`` marks, except, where documents end with ``eos``, the targets of a document that began before its
    window: its replies would be trained without their prompts (a packed chat set's windows cut conversations).

        window   ...reply tail<eos> <prompt> <reply> <eos> <prompt> <rep|    (| the window's end)
        counted   0 0 0 0 0 0 0 0    0 0 0   1 1 1    0     0 0 0    1 1      (the mask's, from the first eos on)
    """
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]  # [n, S+1]
    keep = np.asarray(mask[idx[:, 1:]]) != 0  # [n, S]
    if eos is None or not starts.size:
        return keep
    ids = np.asarray(tokens[idx]) if ids is None else ids
    before = np.asarray(tokens[np.maximum(starts - 1, 0)])
    cut = (starts > 0) & (before != eos)  # the window begins inside a document
    ends = ids == eos  # [n, S+1]
    first = np.where(ends.any(axis=1), ends.argmax(axis=1), seq_len + 1)  # the leading document's end (or none)
    return keep & ~(cut[:, None] & (np.arange(seq_len)[None, :] < first[:, None]))


def counted_targets(mask: np.ndarray | None, starts: np.ndarray, seq_len: int, tokens: np.ndarray | None = None,
                    eos: int | None = None) -> int:
    """How many targets of the windows at ``starts`` a loss ``mask`` counts (``counted``; all without a mask)."""
    if mask is None:
        return int(starts.size) * seq_len
    return int(counted(tokens, mask, starts, seq_len, eos).sum(dtype=np.int64))


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats) of the token frequency distribution: the loss of the best context-free model."""
    counts = np.bincount(np.asarray(tokens), minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
