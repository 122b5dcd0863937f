"""Checkpoints with torch.distributed.checkpoint (DCP).

    <run_dir>/checkpoints/step_000100/
        .metadata          DCP: which tensor lives where
        __0_0.distcp       DCP: the tensors and objects (one file per rank)
        meta.json          moekit: step, model config, size and CRC-32 of every file above

State: model (router ``expert_bias`` buffers included), AdamW state, LR scheduler, the sampler's data
position, RNG states. DCP works without a process group in one process (torch warns and assumes a
single process; that warning is silenced here). The same call saves sharded state once comm/ runs
several ranks, which is why DCP and not torch.save.

A save goes to ``step_N.partial`` and is renamed when complete, so a crash mid-save never leaves a
half checkpoint under a final name; ``keep`` newest checkpoints survive. Loading checks meta.json,
the files' sizes and checksums, and the model config before DCP reads anything, and reports the
file and what is wrong as a UserError.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)

from comm.expert_parallel import gather_optimizer_state, slice_optimizer_state
from trainlib import UserError

FORMAT = 1
META = "meta.json"
# Fields that do not change the weights or the math: a run may resume with a different value.
RESUMABLE_MODEL_FIELDS = ("expert_backend",)


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and "." not in p.name)


def _state(model, optimizer, scheduler, sampler, step: int) -> dict:
    """The state tree DCP saves, and (filled with this run's values) the template it loads into."""
    train = {"step": step, "scheduler": scheduler.state_dict(), "data": sampler.state_dict(),
             "rng_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        train["rng_cuda"] = torch.cuda.get_rng_state()
    # expert-parallel shards appear as full [E, ...] tensors (comm.expert_parallel), so a checkpoint
    # is the same whatever the ep degree and loads into any other
    optim = gather_optimizer_state(get_optimizer_state_dict(model, optimizer), model)
    return {"model": get_model_state_dict(model), "optim": optim, "train": train}


def _main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def save(run_dir, step: int, model, optimizer, scheduler, sampler, model_config: dict, keep: int) -> Path:
    final = checkpoint_root(run_dir) / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".partial")
    if _main():
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(_state(model, optimizer, scheduler, sampler, step), checkpoint_id=str(tmp))
    _barrier()  # every rank's files are written before rank 0 seals the checkpoint
    if _main():
        files = {p.name: {"bytes": p.stat().st_size, "crc32": _crc32(p)} for p in sorted(tmp.iterdir())}
        meta = {"format": FORMAT, "step": step, "model": model_config, "files": files, "torch": torch.__version__}
        (tmp / META).write_text(json.dumps(meta, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old)
    _barrier()
    return final


def read_meta(path: Path) -> dict:
    """meta.json of a checkpoint, after checking every listed file's size and checksum."""
    meta_path = path / META
    if not path.is_dir():
        raise UserError(f"checkpoint {path}: no such directory")
    try:
        meta = json.loads(meta_path.read_text())
        files, step = meta["files"], int(meta["step"])
    except FileNotFoundError:
        raise UserError(f"checkpoint {meta_path}: missing; the save did not finish or this is not a moekit "
                        f"checkpoint") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"checkpoint {meta_path}: corrupt ({type(exc).__name__}: {exc})") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"checkpoint {meta_path}: format {meta.get('format')!r}, this moekit reads format {FORMAT}")
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            raise UserError(f"checkpoint {f}: missing")
        if f.stat().st_size != info["bytes"]:
            raise UserError(f"checkpoint {f}: {f.stat().st_size} bytes, saved with {info['bytes']}; it is truncated "
                            f"or was overwritten")
        if _crc32(f) != info["crc32"]:
            raise UserError(f"checkpoint {f}: checksum mismatch; the file changed after it was saved")
    meta["step"] = step
    return meta


def check_model(path: Path, saved: dict, current: dict) -> None:
    diffs = [f"{k}={saved.get(k)!r} (checkpoint) vs {v!r} (this run)" for k, v in current.items()
             if k not in RESUMABLE_MODEL_FIELDS and saved.get(k) != v]
    if diffs:
        raise UserError(f"checkpoint {path / META}: saved for a different model: {'; '.join(diffs[:3])}; resume "
                        f"with the checkpoint's model settings or start a new --run-dir")


def load(path: Path, model, optimizer, scheduler, sampler, model_config: dict) -> int:
    """Restore everything in place; return the step the checkpoint was taken after."""
    meta = read_meta(path)
    check_model(path, meta["model"], model_config)
    state = _state(model, optimizer, scheduler, sampler, 0)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(path))
    except Exception as exc:  # DCP wraps per-rank failures; any of them means this checkpoint is unusable
        reason = str(exc).strip().splitlines()
        raise UserError(f"checkpoint {path}: DCP could not load it ({type(exc).__name__}: "
                        f"{reason[-1] if reason else ''})") from None
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, slice_optimizer_state(state["optim"], model))
    train = state["train"]
    scheduler.load_state_dict(train["scheduler"])
    sampler.load_state_dict(train["data"])
    torch.set_rng_state(train["rng_cpu"])
    if "rng_cuda" in train:
        torch.cuda.set_rng_state(train["rng_cuda"])
    return int(train["step"])


def resolve_resume(run_dir: str, resume: str) -> Path:
    """``resume`` is "latest" (newest checkpoint in run_dir) or a checkpoint directory."""
    if resume != "latest":
        return Path(resume)
    found = list_checkpoints(run_dir)
    if not found:
        raise UserError(f"--resume: no checkpoint in {checkpoint_root(run_dir)}; train without --resume first, "
                        f"or pass --resume PATH/TO/step_N")
    return found[-1]
