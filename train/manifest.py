"""A checkpoint's integrity manifest, ``meta.json`` (moekit.train.checkpoint writes and reads checkpoints).

The manifest is written last, after every DCP file is on disk: the format, the step, the model config, the
size and digest (sha256; CRC-32 in format 1) of every file, and the run's expert placement if any. Reading a
checkpoint verifies all of it before DCP reads anything, and a mismatch is a ``UserError`` naming the file and
what is wrong (a truncated, corrupt, extra or missing file; another model).
"""
from __future__ import annotations

import hashlib
import json
import os
import zlib
from pathlib import Path

from moekit.train import UserError

FORMAT = 2  # 2: sha256 per file. 1 (CRC-32 per file, moekit before the manifest) is still verified and read
READABLE_FORMATS = (1, 2)
META = "meta.json"
# DCP's own files: one of these in a checkpoint but not in its manifest means it was tampered with
DCP_FILES = (".metadata", ".distcp")
# Fields that do not change the weights or the math: a run may resume with a different value.
RESUMABLE_MODEL_FIELDS = ("expert_backend",)


def _digest(path: Path, fmt: int) -> str | int:
    """sha256 (hex) for format 2, CRC-32 for format 1."""
    with open(path, "rb") as f:
        if fmt >= 2:
            return hashlib.file_digest(f, "sha256").hexdigest()
        crc = 0
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
        return crc


def _fsync(path: Path) -> None:
    """Flush a file's or a directory's entries to disk: a rename is only durable once its parent is."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_manifest(tmp: Path, step: int, model_config: dict, run: dict | None = None,
                    placement: dict | None = None) -> None:
    """Hash and fsync every file DCP wrote, then write meta.json last. ``run``: the trainer's record of the
    run that saved it (its resolved config and tokens trained; moekit.train.resume reads it back);
    ``placement``: its expert placement (read_placement)."""
    files = {}
    for p in sorted(tmp.iterdir()):
        _fsync(p)
        files[p.name] = {"bytes": p.stat().st_size, "sha256": _digest(p, FORMAT)}
    import torch  # imported already: this runs at the end of a save

    meta = {"format": FORMAT, "step": step, "model": model_config, "files": files, "torch": torch.__version__}
    if run is not None:
        meta["run"] = run
    if placement is not None:
        meta["placement"] = placement
    with open(tmp / META, "w") as f:
        f.write(json.dumps(meta, indent=1))
        f.flush()
        os.fsync(f.fileno())
    _fsync(tmp)


def _load_manifest(path: Path) -> dict:
    meta_path = path / META
    if not path.is_dir():
        raise UserError(f"checkpoint {path}: no such directory")
    try:
        meta = json.loads(meta_path.read_text())
        meta["step"] = int(meta["step"])
        fmt, files = meta.get("format"), meta["files"]
        if fmt in READABLE_FORMATS:
            key = "sha256" if fmt >= 2 else "crc32"
            meta["files"] = {str(n): (int(i["bytes"]), i[key]) for n, i in files.items()}
    except FileNotFoundError:
        raise UserError(f"checkpoint {meta_path}: missing; the save did not finish or this is not a moekit "
                        f"checkpoint") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"checkpoint {meta_path}: corrupt ({type(exc).__name__}: {exc})") from None
    if fmt not in READABLE_FORMATS:
        raise UserError(f"checkpoint {meta_path}: format {fmt!r}; this moekit reads formats "
                        f"{', '.join(map(str, READABLE_FORMATS))}: resume it with the moekit that wrote it")
    return meta


def _verify_files(path: Path, fmt: int, files: dict) -> None:
    listed = set(files)
    if ".metadata" not in listed or any("/" in n or os.sep in n or n.startswith("..") for n in listed):
        raise UserError(f"checkpoint {path / META}: corrupt (its file list {sorted(listed)} is not a DCP checkpoint's)")
    unlisted = sorted(p.name for p in path.iterdir() if p.name.endswith(DCP_FILES) and p.name not in listed)
    if unlisted:
        raise UserError(f"checkpoint {path / unlisted[0]}: not in {META}; the checkpoint was changed after it was "
                        f"saved")
    for name, (size, digest) in files.items():
        f = path / name
        if not f.is_file():
            raise UserError(f"checkpoint {f}: missing")
        if f.stat().st_size != size:
            raise UserError(f"checkpoint {f}: {f.stat().st_size} bytes, saved with {size}; it is truncated "
                            f"or was overwritten")
        if _digest(f, fmt) != digest:
            raise UserError(f"checkpoint {f}: {'sha256' if fmt >= 2 else 'CRC-32'} mismatch; the file changed "
                            f"after it was saved")


def read_meta(path: Path, verify: bool = True) -> dict:
    """meta.json of a checkpoint, after checking every listed file's size and digest (``verify``)."""
    try:
        meta = _load_manifest(path)
        if verify:
            _verify_files(path, meta["format"], meta["files"])
    except OSError as exc:  # permissions, I/O errors: as unusable as a damaged file
        raise UserError(f"checkpoint {exc.filename or path}: unreadable ({exc.strerror or exc})") from None
    return meta


def check_model(path: Path, saved: dict, current: dict) -> None:
    import dataclasses

    from moekit.models.config import ModelConfig

    # a field newer than the checkpoint holds its default there (e.g. lora_rank 0 before LoRA existed)
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.default is not dataclasses.MISSING}
    diffs = [f"{k}={saved.get(k, defaults.get(k))!r} (checkpoint) vs {v!r} (this run)" for k, v in current.items()
             if k not in RESUMABLE_MODEL_FIELDS and saved.get(k, defaults.get(k)) != v]
    if diffs:
        raise UserError(f"checkpoint {path / META}: saved for a different model: {'; '.join(diffs[:3])}; resume "
                        f"with the checkpoint's model settings, or start over (another --run-dir, or --overwrite "
                        f"instead of --resume)")
