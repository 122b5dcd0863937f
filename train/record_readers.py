"""Readers of a run directory's records (train/records.py describes the files and writes them): metrics,
config and the expert-load record, binary (memory-mapped) or the older JSON lines. moekit-heatmap, the HTML
report, moekit-placement and the analysis tools read runs through these.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from moekit.train import UserError
from moekit.train.records import (CONFIG, EXPERT_LOAD, EXPERT_LOAD_BIN, ExpertLoadWriter, LOAD_FORMAT, LOAD_VERSION,
                                  METRICS, _bin_layout, _jsonl_chunks, _read_bin_header, _read_steps, _sorted,
                                  record_dtype)


@dataclass
class ExpertLoadRecord:
    """A run's expert-load record. From expert_load.bin the arrays are memory-mapped views: slicing a
    window reads nothing, and ``chunks()`` reads the file a chunk at a time (plain reads, so the process
    holds one chunk, not the mapped pages). ``steps`` are ascending."""

    router: str
    top_k: int
    layers: list[str]
    steps: np.ndarray  # [N] int
    tokens: np.ndarray  # [N, L, E] kept slots per expert per step
    assigned: np.ndarray  # [N, L, E]
    dropped: np.ndarray  # [N, L]
    stride: int = 1  # the writer's stride (informational: the steps are in ``steps``)
    source: str = ""  # the file it was read from
    file: tuple | None = None  # expert_load.bin: (path, byte offset of row 0, record dtype) for chunked reads
    partial_bytes: int = 0  # expert_load.bin: bytes of a partial last record after the whole ones, left out

    @property
    def num_experts(self) -> int:
        return int(self.tokens.shape[2])

    def __len__(self) -> int:
        return int(self.steps.shape[0])

    def window(self, first: int | None, last: int | None) -> "ExpertLoadRecord":
        lo = int(self.steps[0]) if first is None else first
        hi = int(self.steps[-1]) if last is None else last
        file = None
        if _sorted(self.steps):
            a, b = int(np.searchsorted(self.steps, lo, "left")), int(np.searchsorted(self.steps, hi, "right"))
            sel = slice(a, b)  # a view: nothing is read
            empty = b <= a
            if self.file is not None:
                path, offset, rec = self.file
                file = (path, offset + a * rec.itemsize, rec)
        else:
            sel = (self.steps >= lo) & (self.steps <= hi)
            empty = not sel.any()
        if empty:
            raise UserError(f"no expert-load records in steps {lo}..{hi} (the run has steps "
                            f"{self.steps.min()}..{self.steps.max()})")
        return ExpertLoadRecord(self.router, self.top_k, self.layers, self.steps[sel], self.tokens[sel],
                                self.assigned[sel], self.dropped[sel], self.stride, self.source, file,
                                self.partial_bytes)

    def chunks(self, rows: int) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
        """(first row index, tokens, assigned, dropped) of at most ``rows`` steps each, as integer arrays (the
        file's int32 or int64: sum with dtype=np.int64)."""
        if self.file is None:
            for i in range(0, len(self), rows):
                yield (i, np.asarray(self.tokens[i : i + rows], dtype=np.int64),
                       np.asarray(self.assigned[i : i + rows], dtype=np.int64),
                       np.asarray(self.dropped[i : i + rows], dtype=np.int64))
            return
        path, offset, rec = self.file
        with open(path, "rb") as f:
            f.seek(offset)
            for i in range(0, len(self), rows):
                n = min(rows, len(self) - i)
                block = np.frombuffer(f.read(n * rec.itemsize), dtype=rec)
                if block.shape[0] != n:
                    raise UserError(f"{path}: ended while reading steps {self.steps[i]}..; was it truncated meanwhile?")
                yield i, block["tokens"], block["assigned"], block["dropped"]


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise UserError(f"{path}: not found; is {path.parent} a moekit run directory (moekit-train --run-dir)?")
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{i}: not JSON ({exc.msg})") from None
    return out


def read_metrics(run_dir: str | Path) -> list[dict]:
    return _read_jsonl(Path(run_dir) / METRICS)


def read_config(run_dir: str | Path) -> dict:
    path = Path(run_dir) / CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: not found; is {run_dir} a moekit run directory?") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: corrupt config.json ({type(exc).__name__}: {exc}); restore it") from None
    except OSError as exc:
        raise UserError(f"{path}: unreadable ({exc.strerror or exc})") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}: corrupt config.json (a JSON {type(config).__name__}, not an object); restore it")
    return config


def parse_window(text: str | None) -> tuple[int | None, int | None]:
    """--steps FIRST:LAST (either side may be empty) -> (first, last); None, None for no window."""
    if not text:
        return None, None
    first, sep, last = text.partition(":")
    try:
        lo, hi = (int(first) if first.strip() else None), (int(last) if last.strip() else None)
    except ValueError:
        raise UserError(f"--steps {text!r}: expected FIRST:LAST step numbers, e.g. 100:200 or 100:") from None
    if (lo is not None and lo < 0) or (hi is not None and hi < 0):
        raise UserError(f"--steps {text!r}: steps are >= 0; give FIRST:LAST, e.g. 100:200 or :200")
    if not sep:  # "--steps 100" may mean step 100 or the first 100 steps: ask
        raise UserError(f"--steps {text!r}: the colon is missing; give FIRST:LAST, e.g. {lo}:{lo} for step {lo} "
                        f"alone, {lo}: from it on, :{lo} up to it")
    if lo is not None and hi is not None and lo > hi:
        raise UserError(f"--steps {text!r}: expected FIRST:LAST with FIRST <= LAST, e.g. 100:200")
    return lo, hi


def expert_load_path(run_dir: str | Path) -> Path:
    """The run's expert-load file: expert_load.bin, else expert_load.jsonl (an older run)."""
    d = Path(run_dir)
    if not d.is_dir():
        what = "is a file, not a run directory" if d.exists() else "no such directory"
        raise UserError(f"{d}: {what}; give a moekit-train run directory (moekit-train --run-dir)")
    binary = d / EXPERT_LOAD_BIN
    if binary.exists():
        return binary
    old = d / EXPERT_LOAD
    if old.exists():
        return old
    raise UserError(f"{binary}: not found (nor {EXPERT_LOAD}); is {d} a moekit run directory (moekit-train "
                    f"--run-dir)?")


def read_expert_load(run_dir: str | Path) -> ExpertLoadRecord:
    """The run's expert-load record, from either format. The binary one is memory-mapped, not read."""
    path = expert_load_path(run_dir)
    return _read_binary(path) if path.suffix == ".bin" else _read_jsonl_load(path)


def _check_header(path: Path, head: dict) -> None:
    if not head["layers"]:
        raise UserError(f"{path}: the model has no MoE layers, so there is no expert load to show")




def _read_binary(path: Path) -> ExpertLoadRecord:
    head, start = _read_bin_header(path)
    _check_header(path, head)
    rec = _bin_layout(path, head)
    n, partial = divmod(path.stat().st_size - start, rec.itemsize)  # a crash mid-write leaves a partial record
    if n == 0:
        raise UserError(f"{path}: no steps recorded yet")
    mm = np.memmap(path, dtype=rec, mode="r", offset=start, shape=(n,))
    steps = _read_steps(path, start, rec, n)  # [N]: small, and the sorted checks want it in memory
    return ExpertLoadRecord(head["router"], head["top_k"], head["layers"], steps, mm["tokens"], mm["assigned"],
                            mm["dropped"], int(head.get("stride", 1)), str(path), (str(path), start, rec), partial)


def _jsonl_header(path: Path, first: dict) -> dict:
    if first.get("format") != LOAD_FORMAT:
        raise UserError(f"{path}: first line is not a {LOAD_FORMAT!r} header")
    if first.get("version") != LOAD_VERSION:
        raise UserError(f"{path}: format version {first.get('version')!r}; this moekit reads {LOAD_VERSION}")
    return first




def _read_jsonl_load(path: Path) -> ExpertLoadRecord:
    lines = _read_jsonl(path)
    if not lines:
        raise UserError(f"{path}: first line is not a {LOAD_FORMAT!r} header")
    head, rows = _jsonl_header(path, lines[0]), lines[1:]
    _check_header(path, head)
    if not rows:
        raise UserError(f"{path}: no steps recorded yet")
    L, E = len(head["layers"]), head["num_experts"]
    tokens = np.array([r["tokens"] for r in rows], dtype=np.int64)
    if tokens.shape[1:] != (L, E):
        raise UserError(f"{path}: records hold {tokens.shape[1:]} counts, the header says {L} layers x {E} experts")
    steps = np.array([r["step"] for r in rows])
    assigned = np.array([r["assigned"] for r in rows], dtype=np.int64)
    dropped = np.array([r["dropped"] for r in rows], dtype=np.int64)
    if not _sorted(steps):
        order = np.argsort(steps, kind="stable")
        steps, tokens, assigned, dropped = steps[order], tokens[order], assigned[order], dropped[order]
    return ExpertLoadRecord(head["router"], head["top_k"], head["layers"], steps, tokens, assigned, dropped, 1,
                            str(path))


def load_rows(run_dir: str | Path) -> list[dict]:
    """The expert-load record as expert_load.jsonl's objects (header first, then one per step), whichever
    format the run wrote: for tests and small tools (it loads everything)."""
    path = expert_load_path(run_dir)
    if path.suffix != ".bin":
        return _read_jsonl(path)
    head, start = _read_bin_header(path)
    rec = _bin_layout(path, head)
    n = (path.stat().st_size - start) // rec.itemsize
    out = [{"format": LOAD_FORMAT, "version": LOAD_VERSION, "router": head["router"], "top_k": head["top_k"],
            "num_experts": head["num_experts"], "layers": head["layers"]}]
    if n:
        mm = np.memmap(path, dtype=rec, mode="r", offset=start, shape=(n,))
        out += [{"step": int(r["step"]), "tokens": r["tokens"].tolist(), "assigned": r["assigned"].tolist(),
                 "dropped": r["dropped"].tolist()} for r in mm]
    return out


def convert_jsonl(run_dir: str | Path, stride: int = 1) -> Path:
    """Rewrite a run's expert_load.jsonl as expert_load.bin (every ``stride``-th recorded step); the JSONL
    file is removed once the binary one is complete. Returns the new file."""
    d = Path(run_dir)
    old = d / EXPERT_LOAD
    lines = _read_jsonl(old)[:1]
    if not lines:
        raise UserError(f"{old}: empty")
    head = _jsonl_header(old, lines[0])
    target = d / EXPERT_LOAD_BIN
    if target.exists():
        raise UserError(f"{target}: exists already; the run has a binary record")
    tmp = d / (EXPERT_LOAD_BIN + ".convert")
    tmp.unlink(missing_ok=True)
    wide = record_dtype(len(head["layers"]), head["num_experts"], "int64")
    peak = max((int(max(c["tokens"].max(), c["assigned"].max(), c["dropped"].max())) for c in _jsonl_chunks(old, wide)),
               default=0)
    w = ExpertLoadWriter(tmp, head["layers"], head["router"], head["top_k"], head["num_experts"], stride=stride,
                         max_count=peak, migrate=False)
    try:
        for chunk in _jsonl_chunks(old, w.rec):
            w.write_rows(chunk[chunk["step"] % stride == 0])
    finally:
        w.close()
    os.replace(tmp, target)
    old.unlink()
    return target
