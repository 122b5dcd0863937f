"""The documents moekit-prepare tokenizes: input files and globs expanded and checked, then read one
document at a time (plain text, whole or per line; JSONL / NDJSON records' text field; a Parquet column; the
embedded corpus), and grouped into chunks of work for the encoding processes.

Every unreadable input is a ``UserError`` naming the file, what is wrong and the fix: not UTF-8, invalid JSON,
a missing field or column, a file that disappeared between listing and reading.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Iterator

from moekit.train import UserError
from moekit.train.tokens import embedded_corpus_files

JSONL_SUFFIXES = (".jsonl", ".ndjson")
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zip")
EMBEDDED = "@embedded"  # input: the trainer's embedded corpus (stdlib modules), one document per module
CHUNK_DOCS, CHUNK_CHARS = 512, 1 << 22  # a chunk of work for one process: whichever limit comes first


def expand_inputs(patterns: list[str]) -> list[str]:
    """Files in the order given; a glob's matches sorted. Missing files, empty globs, folders and files named
    twice are refused."""
    files: list[str] = []
    for pattern in patterns:
        if pattern == EMBEDDED:
            found = embedded_corpus_files()
            if not found:
                raise UserError(f"input {EMBEDDED}: this Python has none of the corpus's stdlib sources; pass files")
            files += found
        elif any(c in pattern for c in "*?["):
            matches = sorted(m for m in glob.glob(pattern, recursive=True) if os.path.isfile(m))
            if not matches:
                raise UserError(f"input {pattern!r}: the pattern matches no file")
            files += matches
        elif os.path.isdir(pattern):
            raise UserError(f"input {pattern}: is a folder; pass its files, e.g. '{os.path.join(pattern, '*.jsonl')}'")
        elif not os.path.isfile(pattern):
            raise UserError(f"input {pattern}: no such file")
        else:
            files.append(pattern)
    seen = set()
    for f in files:
        key = os.path.realpath(f)
        if key in seen:
            raise UserError(f"input {f}: named twice (overlapping files / globs); each file is tokenized once")
        seen.add(key)
    return files


def input_kind(path: str) -> str:
    lower = path.lower()
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if lower.endswith(".parquet"):
        return "parquet"
    return "text"


def _decode(raw: bytes, where: str, path: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        hint = "; decompress it first" if path.lower().endswith(COMPRESSED_SUFFIXES) else "; convert it to UTF-8"
        raise UserError(f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}){hint}") from None


def _vanished(path: str, exc: OSError) -> UserError:
    return UserError(f"input {path}: cannot read it ({exc.strerror or exc}): it disappeared or became unreadable "
                     f"while preparing; restore it and run again")


def read_text(path: str, per_line: bool) -> Iterator[str]:
    try:
        with open(path, "rb") as f:
            if not per_line:
                yield _decode(f.read(), f"input {path}", path).removeprefix("\ufeff")
                return
            for number, line in enumerate(f, 1):
                text = _decode(line, f"input {path} line {number}", path)
                yield (text.removeprefix("\ufeff") if number == 1 else text).rstrip("\r\n")
    except OSError as exc:
        raise _vanished(path, exc) from None


def _kind_of(value) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", list: "an array", dict: "an object"}.get(
        type(value), type(value).__name__)


def read_jsonl(path: str, field: str) -> Iterator[str | None]:
    for where, value in jsonl_values(path, field):
        if value is not None and not isinstance(value, str):
            raise UserError(f"{where}: field {field!r} is {_kind_of(value)}, not a string")
        yield value


def jsonl_values(path: str, field: str, what: str = "text") -> Iterator[tuple[str, object]]:
    """(where, the record's ``field``) of every record of a JSONL file, as JSON gives it; ``what`` the field holds
    (for the message naming --field)."""
    first = True
    try:
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue  # a blank line is no record
                where = f"input {path} line {number}"
                text = _decode(line, where, path)
                try:
                    record = json.loads(text.removeprefix("\ufeff") if number == 1 else text)
                except ValueError as exc:
                    raise UserError(f"{where}: invalid JSON ({exc}); each line must be one JSON object") from None
                if not isinstance(record, dict):
                    raise UserError(f"{where}: expected a JSON object per line, got {_kind_of(record)}")
                if field not in record:
                    fields = ", ".join(repr(k) for k in list(record)[:20]) or "none"
                    which = "the first record" if first else "this record"
                    raise UserError(f"{where}: {which} has no field {field!r}; its fields: {fields}; choose the {what} "
                                    f"field with --field")
                first = False
                yield where, record[field]
    except OSError as exc:
        raise _vanished(path, exc) from None


def read_parquet(path: str, field: str) -> Iterator[str | None]:
    for _, value in parquet_values(path, field):
        yield value


def _is_text(kind) -> bool:
    import pyarrow as pa

    return (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or getattr(pa.types, "is_string_view", lambda t: False)(kind))


def _is_list(kind) -> bool:
    import pyarrow as pa

    return pa.types.is_list(kind) or pa.types.is_large_list(kind)


def parquet_values(path: str, field: str, what: str = "text") -> Iterator[tuple[str, object]]:
    """(where, the row's ``field``) of every row of a Parquet file; the column must hold ``what``: "text" (strings)
    or "conversation" (lists)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"input {path}: reading Parquet needs pyarrow: pip install 'moekit[data]' "
                        f"(or pip install pyarrow)") from None
    try:
        pf = pq.ParquetFile(path)
    except OSError as exc:
        if not os.path.exists(path):
            raise _vanished(path, exc) from None
        raise UserError(f"input {path}: not a Parquet file ({str(exc).splitlines()[0]})") from None
    except pa.ArrowException as exc:
        raise UserError(f"input {path}: not a Parquet file ({str(exc).splitlines()[0]})") from None
    schema = pf.schema_arrow
    if field not in schema.names:
        raise UserError(f"input {path}: no column {field!r}; its columns: {', '.join(map(repr, schema.names[:20]))}; "
                        f"choose the {what} column with --field")
    kind = schema.field(field).type
    if what == "text" and not _is_text(kind):
        raise UserError(f"input {path}: column {field!r} holds {kind}, not text (string)")
    if what != "text" and not _is_list(kind):
        raise UserError(f"input {path}: column {field!r} holds {kind}, not a {what} (a list)")
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=1024, columns=[field]):
            column = batch.column(0)
            try:
                for value in column.to_pylist():
                    row += 1
                    yield f"input {path} row {row}", value
            except UnicodeDecodeError as exc:
                raise UserError(f"input {path}: column {field!r} holds a value that is not UTF-8 "
                                f"({exc.reason})") from None
    except OSError as exc:
        raise _vanished(path, exc) from None
    except pa.ArrowException as exc:
        raise UserError(f"input {path}: cannot read it ({str(exc).splitlines()[0]})") from None


@dataclass
class Counts:
    documents: int = 0
    empty: int = 0
    tokens: int = 0
    text_bytes: int = 0


def documents(files: list[str], field: str, per_line: bool, counts: Counts) -> Iterator[str]:
    """Every non-empty document of ``files`` in order; empty (whitespace-only, null) ones are counted and skipped."""
    for path in files:
        kind = input_kind(path)
        docs = (read_jsonl(path, field) if kind == "jsonl" else read_parquet(path, field) if kind == "parquet"
                else read_text(path, per_line))
        for doc in docs:
            if doc is None or not doc.strip():
                counts.empty += 1
                continue
            counts.documents += 1
            yield doc


def chunks(docs: Iterator[str]) -> Iterator[list[str]]:
    chunk, chars = [], 0
    for doc in docs:
        chunk.append(doc)
        chars += len(doc)
        if len(chunk) >= CHUNK_DOCS or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk
