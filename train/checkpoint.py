"""Checkpoints with torch.distributed.checkpoint (DCP): integrity manifest, atomic saves, async saves.

    <run_dir>/checkpoints/step_000100/
        .metadata          DCP: which tensor lives where
        __0_0.distcp       DCP: the tensors and objects (one file per rank)
        meta.json          moekit manifest, written last: format, step, model config, and the size and
                           sha256 of every file above; the expert placement of the run that saved it, if
                           any ("placement": a comm.placement document plus the rebalancer's load window)
    <run_dir>/checkpoints/step_000200.partial/   a save in progress (or one a crash interrupted)

State: model (router ``expert_bias`` buffers included), AdamW state (with the parameter average of
--train.ema_decay: moekit.train.ema), LR scheduler, the sampler's data position, RNG states. DCP works without a
process group in one process (torch warns and assumes a single process; that warning is silenced here). The same
call saves sharded state under torchrun, which is why DCP and not torch.save. Experts under a placement
(comm.placement: physical slots, replicas) are saved in logical order, one copy each (comm.relocate.logical_state),
so the files are those of the contiguous layout and resume under any placement, ep degree or in one process.

Life of a save (``Checkpointer``):
    1. every rank writes its DCP files into ``step_N.partial`` (``dcp.save``, or ``dcp.async_save``:
       it copies the state to CPU memory before it returns and writes from a background thread)
    2. rank 0, once DCP reports every rank's files written: hash them, fsync, write meta.json
    3. rename ``step_N.partial`` -> ``step_N`` (the commit: only a sealed directory has a final name)
    4. rotate: retire checkpoints beyond ``keep`` (renamed to ``.stale`` first, so a crash mid-delete
       never leaves a half-deleted directory under a final name), except milestones: steps that are a multiple
       of ``keep_every`` (--checkpoint.keep_every)
Leftover ``.partial`` / ``.stale`` directories of a crashed run are removed when the next run starts
(safe: the run directory's lock, moekit.train.runlock, keeps a second trainer out). A save that fails
(full disk, permissions, a rank that stalls past --layout.timeout_s) ends the run with one line naming
the path and the newest sealed checkpoint (moekit.train.faults.RunFailed, exit status 1).

Loading verifies meta.json and every file's size and digest, and the model config, before DCP reads
anything; a failure is a UserError naming the file and what is wrong. ``--resume`` / ``--resume auto``
skip checkpoints that fail verification (saying which and why) and use the newest that passes.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)

from moekit.comm.relocate import logical_state, physical_state
from moekit.train import UserError
from moekit.train import ema as ema_state
from moekit.train.distributed import comm_failure, first_line
from moekit.train.faults import RunFailed
from moekit.train.manifest import (  # noqa: F401  (META, RESUMABLE_MODEL_FIELDS: this module's API too)
    META, RESUMABLE_MODEL_FIELDS, _fsync, _write_manifest, check_model, read_meta,
)
from moekit.train.runlock import describe_os_error

# Beyond --layout.timeout_s: how long the end of a save may be waited for (thread hand-over, sealing a small one)
JOIN_GRACE_S = 5.0

# DCP in one process warns that it assumes a single process; async saves warn from their own thread,
# where a catch_warnings block around the call would not reach, so the filter is installed once.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Sealed checkpoints, oldest first (a name with a dot is a save in progress or being deleted)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit())


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def _state(model, optimizer, scheduler, sampler, step: int) -> dict:
    """The state tree DCP saves, and (filled with this run's values) the template it loads into."""
    train = {"step": step, "scheduler": scheduler.state_dict(), "data": sampler.state_dict(),
             "rng_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        train["rng_cuda"] = torch.cuda.get_rng_state()
    # TP / EP / FSDP shards are DTensors with their global shapes: DCP writes each piece once and loads
    # them into any other layout (resharding), including one process
    optim = get_optimizer_state_dict(model, optimizer)
    weights = get_model_state_dict(model)
    logical_state(model, weights, optim)  # experts in logical order (a no-op without a placement)
    return {"model": weights, "optim": optim, "train": train}


def _main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


# ---------------------------------------------------------------------------------------------------
# Choosing the checkpoint to resume from
# ---------------------------------------------------------------------------------------------------


def choose_resume(run_dir: str, resume: str | None, model_config: dict, warn=print) -> Path | None:
    """The checkpoint this run starts from, None for a fresh start. Rank 0 decides, every rank gets it.

    ``resume``: None (fresh), a checkpoint directory (it must verify), "latest" (the newest checkpoint
    of run_dir that verifies; there must be one), or "auto" (as latest, but a run dir without any
    checkpoint starts fresh: what a torchrun restart of a run that had not saved yet needs).
    """
    if resume is None:
        return None
    answer: list = [None, None]  # [path, error message]
    if _main():
        try:
            answer[0] = _choose(run_dir, resume, model_config, warn)
        except UserError as exc:
            answer[1] = str(exc)
    if dist.is_initialized():  # one verification, one answer: every rank loads the same checkpoint
        dist.broadcast_object_list(answer, src=0)
    if answer[1] is not None:
        raise UserError(answer[1])
    return answer[0]


def choose_init(source: str, model_config: dict, warn=print) -> tuple[Path, dict]:
    """(checkpoint, its meta.json) a fresh run takes its weights from (--train.init_from): ``source`` a run
    directory (its newest checkpoint that verifies) or one checkpoint (it must verify), checked against the model.
    Rank 0 verifies (a full read), every rank gets the answer."""
    answer: list = [None, None, None]  # [path, meta, error message]
    if _main():
        try:
            answer[0], answer[1] = _choose_init(Path(source), model_config, warn)
        except UserError as exc:
            answer[2] = str(exc)
    if dist.is_initialized():
        dist.broadcast_object_list(answer, src=0)
    if answer[2] is not None:
        raise UserError(answer[2])
    return answer[0], answer[1]


def init_kind(source: Path) -> str:
    """What --train.init_from names: "file" (a moekit model file), "run" (a run directory) or "checkpoint"; a
    UserError for anything else (pointing an HF folder to --init-from-hf)."""
    if source.is_file():
        return "file"
    if (source / "checkpoints").is_dir():
        return "run"
    if (source / META).is_file():
        return "checkpoint"
    hf = "; a HuggingFace folder starts a run with --init-from-hf" if (source / "config.json").is_file() else ""
    raise UserError(f"--train.init_from {source}: not a moekit run directory or checkpoint (no checkpoints/ and no "
                    f"{META}){hf}")


def _choose_init(source: Path, model_config: dict, warn) -> tuple[Path, dict]:
    where = f"--train.init_from {source}"
    kind = init_kind(source)
    if kind == "file":  # a moekit model file (moekit-convert hf-to-moekit / average / prune)
        from moekit.train.modelfiles import read_moekit_config

        try:
            config = read_moekit_config(source)
        except (ValueError, OSError) as exc:
            raise UserError(f"{where}: {exc}") from None
        meta = {"model": config.to_dict(), "step": None, "file": True}
        check_init_model(source, meta["model"], model_config)
        return source, meta
    if kind == "run":
        path, meta, skipped = newest_verified(source)
        if path is None:
            why = " | ".join(skipped) or f"no checkpoint in {checkpoint_root(source)}"
            raise UserError(f"{where}: no checkpoint of the run verifies ({why}); pass a checkpoint that does")
        for reason in skipped:
            warn(f"warning: skipped {reason}; starting from {path}")
    else:
        path = source
        try:
            meta = read_meta(path)
        except UserError as exc:
            raise UserError(f"{where}: {exc}; pass another checkpoint, or its run directory for the newest one that "
                            f"verifies") from None
    check_init_model(path, meta["model"], model_config)
    return path, meta


def check_init_model(path: Path, saved: dict, current: dict) -> None:
    """A fresh run takes a checkpoint's weights (--train.init_from): the model must compute the same math
    (models.hf.check_same_math, as --init-from-hf checks a folder) and hold the same multi-token-prediction depths;
    training-only fields (aux_loss_coeff, capacity_factor, z_loss_coeff, the expert backend, ...) may differ."""
    from moekit.models.config import ModelConfig
    from moekit.models.hf import math_differences

    have, want = ModelConfig.from_dict(current), ModelConfig.from_dict(saved)
    diffs = math_differences(have, want)
    if diffs:
        raise UserError(f"--train.init_from {path}: this run's model computes other math than the checkpoint's: "
                        f"{'; '.join(d.replace('(model)', '(this run)') for d in diffs[:3])}; drop those model flags "
                        f"(without --preset the architecture is the checkpoint's)")
    if have.mtp_layers != want.mtp_layers:
        raise UserError(f"--train.init_from {path}: the checkpoint has {want.mtp_layers} multi-token-prediction "
                        f"depth(s), this run {have.mtp_layers}; use --model.mtp_layers {want.mtp_layers}")
    lora = ("lora_rank", "lora_alpha", "lora_targets", "lora_rslora")
    if want.lora_rank and any(getattr(have, f) != getattr(want, f) for f in lora):
        rs = lambda c: ", rsLoRA" if c.lora_rslora else ""  # noqa: E731
        theirs = f"rank {want.lora_rank}, alpha {want.lora_alpha:g}{rs(want)}, targets {want.lora_targets!r}"
        keep = (f"--model.lora_rank {want.lora_rank} --model.lora_alpha {want.lora_alpha:g} --model.lora_targets "
                f"'{want.lora_targets}'" + (" --model.lora_rslora true" if want.lora_rslora else ""))
        if not have.lora_rank:
            raise UserError(f"--train.init_from {path}: the checkpoint holds LoRA adapters ({theirs}) and this run's "
                            f"model has none; fold them into the weights first (moekit-convert merge-lora {path} -o "
                            f"MERGED.safetensors, then --train.init_from MERGED.safetensors), or go on training them "
                            f"with {keep}")
        raise UserError(f"--train.init_from {path}: the checkpoint's LoRA adapters ({theirs}) differ from this run's "
                        f"(rank {have.lora_rank}, alpha {have.lora_alpha:g}{rs(have)}, targets "
                        f"{have.lora_targets!r}); use "
                        f"{keep}, or fold them first (moekit-convert merge-lora) and start new adapters")


def load_weights(path: Path, model, adapters: bool = True) -> None:
    """The model state of checkpoint ``path`` into ``model`` (any layout: DCP reshards; placed experts from their
    logical rows), nothing else: no optimizer, schedule, data position or RNG state (--train.init_from). A moekit
    model file: every rank reads the whole tensors it holds a share of (``load_file_weights``). ``adapters``
    False: the checkpoint has no LoRA adapters (models.lora), so the model's keep their initial values."""
    if path.is_file():
        return load_file_weights(path, model, adapters)
    weights = get_model_state_dict(model)
    logical_state(model, weights)  # the template in the checkpoint's (logical) expert order
    try:
        dcp.load({"model": _without_adapters(weights) if not adapters else weights}, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:
        comm = _comm_failure_in(exc)
        if comm is not None:
            raise comm from None
        reason = str(exc).strip().splitlines()
        raise UserError(f"checkpoint {path}: DCP could not load its model ({type(exc).__name__}: "
                        f"{reason[-1] if reason else ''})") from None
    physical_state(model, weights)  # back to this run's expert placement
    set_model_state_dict(model, weights)


def _without_adapters(state: dict) -> dict:
    from moekit.models.lora import is_adapter

    return {k: v for k, v in state.items() if not is_adapter(k)}


def load_file_weights(path: Path, model, adapters: bool = True) -> None:
    """A moekit model file's weights into ``model`` (this rank's share of any layout): each tensor this rank holds
    is read whole from the file (memory-mapped or sliced by safetensors), placed experts reordered into their physical
    slots, then torch's state-dict API keeps each rank's shard (a collective over the ranks of each mesh)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from moekit.comm.relocate import placed_layers
    from moekit.train.modelfiles import tensor_source

    shapes, fetch = tensor_source(path)
    wanted = get_model_state_dict(model)  # this rank's parameter and buffer names (a pipeline rank: its stages)
    if not adapters:  # a file without LoRA adapters: the model's stay as initialised
        wanted = _without_adapters(wanted)
    missing = [k for k in wanted if k not in shapes]
    if missing:
        raise UserError(f"--train.init_from {path}: the file lacks {', '.join(missing[:4])}; it was written for "
                        f"another model")
    full = {key: torch.as_tensor(fetch(key)[:]) for key in wanted}
    for name, layer, placement, _, _ in placed_layers(model):  # logical rows -> this run's physical slots
        slots = torch.tensor([e for row in placement.slots for e in row])
        for p in layer.experts.param_names():
            key = f"{name}.experts.{p}"
            if key in full:  # (not the adapters a file lacks)
                full[key] = full[key][slots]
    wrong = [f"{k} {tuple(full[k].shape)} (model {tuple(wanted[k].shape)})" for k in wanted
             if tuple(full[k].shape) != tuple(wanted[k].shape)]
    if wrong:
        raise UserError(f"--train.init_from {path}: shapes differ: {', '.join(wrong[:3])}; the file was written for "
                        f"another model")
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=adapters))


def _choose(run_dir: str, resume: str, model_config: dict, warn) -> Path | None:
    if resume not in ("latest", "auto"):
        path = Path(resume)
        _check_resume_path(path)
        try:
            meta = read_meta(path)
        except UserError as exc:
            raise UserError(f"{exc}; pass another checkpoint, or --resume alone for the newest one that "
                            f"verifies") from None
        check_model(path, meta["model"], model_config)
        return path
    if not list_checkpoints(run_dir):
        if resume == "auto":
            return None
        raise UserError(f"--resume: no checkpoint in {checkpoint_root(run_dir)}; train without --resume first (with "
                        f"--overwrite when the folder holds an earlier run's metrics), or pass --resume PATH/TO/step_N")
    path, meta, skipped = newest_verified(run_dir)
    if path is None:  # all damaged: refuse rather than start fresh, which would delete them
        raise UserError(f"--resume: no checkpoint in {checkpoint_root(run_dir)} verifies: {' | '.join(skipped)}; "
                        f"restore one, or start a fresh run (--overwrite instead of --resume)")
    for reason in skipped:
        warn(f"warning: skipped {reason}; resuming from {path}")
    check_model(path, meta["model"], model_config)
    return path


def _check_resume_path(path: Path) -> None:
    """--resume PATH must name a checkpoint folder: an empty path, a file or a whole run directory is refused
    with the form that was meant."""
    if not str(path).strip() or str(path) == ".":
        raise UserError("--resume needs a checkpoint folder (RUN_DIR/checkpoints/step_N), or no value for the "
                        "newest checkpoint of --run-dir that verifies")
    if path.is_file():
        raise UserError(f"--resume {path}: a file; pass its checkpoint folder ({path.parent})")
    steps = list_checkpoints(path) if (path / "checkpoints").is_dir() else []
    if steps:
        raise UserError(f"--resume {path}: a run directory, not a checkpoint; pass --run-dir {path} --resume (its "
                        f"newest checkpoint that verifies), or one checkpoint, e.g. --resume {steps[-1]}")


def newest_verified(run_dir: str | Path) -> tuple[Path | None, dict | None, list[str]]:
    """(path, meta.json) of the newest checkpoint of ``run_dir`` whose files verify, and why each newer one
    was skipped (an interrupted or damaged save: an older one may still be good). (None, None, reasons)
    when none verifies."""
    found, skipped = newest_verified_many(run_dir, 1)
    return (found[0][0], found[0][1], skipped) if found else (None, None, skipped)


def newest_verified_many(run_dir: str | Path, count: int) -> tuple[list[tuple[Path, dict]], list[str]]:
    """The ``count`` newest checkpoints of ``run_dir`` whose files verify, newest first, as (path, meta.json), and
    why each damaged one among the newer was skipped (fewer when fewer verify)."""
    found, skipped = [], []
    for path in list_checkpoints(run_dir)[::-1]:
        if len(found) == count:
            break
        try:
            found.append((path, read_meta(path)))
        except UserError as exc:
            skipped.append(str(exc))
    return found, skipped


def read_placement(path: Path) -> dict | None:
    """The "placement" record of a checkpoint's meta.json (what the run that saved it used), or None."""
    try:
        meta = json.loads((Path(path) / META).read_text())
    except (OSError, ValueError):
        return None
    found = meta.get("placement") if isinstance(meta, dict) else None
    return found if isinstance(found, dict) else None


def _comm_failure_in(exc: BaseException) -> BaseException | None:
    """The collective failure (a timeout, a lost peer: train.distributed.comm_failure) behind a failed DCP call, or
    None: ``exc`` itself, or one of the ranks' exceptions a CheckpointException gathered (``_causes``)."""
    return next((e for e in (exc, *_causes(exc)) if comm_failure(e)), None)


def load(path: Path, model, optimizer, scheduler, sampler, model_config: dict, verify: bool = True,
         load_data: bool = True, ema: bool = False) -> int:
    """Restore everything in place; return the step the checkpoint was taken after.

    ``verify=False`` when ``choose_resume`` has just verified this checkpoint (hashing is a full read).
    ``load_data=False``: leave ``sampler`` as it is (a resume into new data: --checkpoint.exclude_from_loading data).
    ``ema``: this run keeps a parameter average (moekit.train.ema): the checkpoint's comes back with the optimizer
    state where it holds one; where it holds none, the average starts afresh at the next update.
    """
    meta = read_meta(path, verify)
    check_model(path, meta["model"], model_config)
    if ema:  # average entries in the optimizer state (made first, by a zero step), so the template asks for them
        get_optimizer_state_dict(model, optimizer)
        ema_state.prime(optimizer)
    state = _state(model, optimizer, scheduler, sampler, 0)
    if ema:
        ema_state.drop_unstored(state["optim"], ema_state.stored_keys(path))
    if not load_data:  # the new data's position has another shape than the checkpoint's (a blend, one set)
        del state["train"]["data"]
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:  # any rank's failure (DCP's exception: a BaseException)
        comm = _comm_failure_in(exc)
        if comm is not None:  # a collective that timed out or lost a peer: another rank's fault, not the checkpoint's
            raise comm from None
        reason = str(exc).strip().splitlines()
        raise UserError(f"checkpoint {path}: DCP could not load it ({type(exc).__name__}: "
                        f"{reason[-1] if reason else ''})") from None
    physical_state(model, state["model"], state["optim"])  # back to this run's expert placement
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    train = state["train"]
    scheduler.load_state_dict(train["scheduler"])
    if load_data:
        sampler.load_state_dict(train["data"])
    torch.set_rng_state(train["rng_cpu"])
    if "rng_cuda" in train:
        torch.cuda.set_rng_state(train["rng_cuda"])
    return int(train["step"])


# ---------------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------------


def _retire(path: Path) -> None:
    """Delete a checkpoint directory without ever leaving a half-deleted one under a final name."""
    stale = path.with_name(path.name + ".stale")
    shutil.rmtree(stale, ignore_errors=True)
    os.replace(path, stale)
    shutil.rmtree(stale)


def clean_stale(run_dir: str | Path) -> None:
    """Remove what crashed saves left: ``.partial`` (unsealed) and ``.stale`` (half-deleted) directories."""
    root = checkpoint_root(run_dir)
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p.name.startswith("step_") and "." in p.name:
                shutil.rmtree(p, ignore_errors=True)


def _rotate(run_dir: Path, step: int, keep: int, keep_every: int = 0) -> None:
    found = list_checkpoints(run_dir)
    # newer than the one just saved: left by the timeline this run abandoned when it resumed from an
    # older checkpoint (e.g. after skipping a damaged one); keeping them would crowd out good ones
    abandoned = [p for p in found if step_of(p) > step]
    current = [p for p in found if step_of(p) <= step]
    milestone = (lambda p: step_of(p) % keep_every == 0) if keep_every else (lambda p: False)
    for p in abandoned + [p for p in current[:-keep] if not milestone(p)]:
        _retire(p)


class Checkpointer:
    """Saves of one run: at most one in flight; rank 0 seals each one when DCP reports it written.

    With ``async_save`` DCP copies the state to CPU memory before ``save`` returns, so the next
    optimizer step may change the weights at once; files are written from a background thread.
    ``finalize`` (at the next save and at the end of training) waits until the save is sealed.

    No wait is longer than ``timeout_s`` (--layout.timeout_s) plus ``JOIN_GRACE_S``: the background
    save's collectives run on a gloo group with that timeout, and ``finalize`` / ``close`` give up on a
    save thread that has not ended by then (``stuck``: the thread cannot be stopped, only abandoned). A
    save that fails (a full disk, a permission, a stalled rank) is a ``RunFailed`` naming the path and the
    newest sealed checkpoint, the same on every rank where they can still agree.
    """

    def __init__(self, run_dir: str | Path, keep: int, model_config: dict, async_save: bool = False,
                 last: Path | None = None, timeout_s: float = 600.0, warn=None, keep_every: int = 0):
        self.run_dir, self.keep, self.model_config, self.async_save = Path(run_dir), keep, model_config, async_save
        self.keep_every = keep_every  # milestones: checkpoints at multiples of this step are never rotated out
        self.last = last  # newest sealed checkpoint
        self.timeout_s = timeout_s
        self.warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.saved_step: int | None = None  # step of the newest save started by this run
        self.stuck = False  # a save thread outlived its wait (see _abandon)
        self._pending: tuple[Future, Path, Path, int] | None = None  # (done, tmp, final, step)
        # rank 0 seals in this thread: the hashing (a full read) overlaps training in async mode
        self._sealer = ThreadPoolExecutor(1, thread_name_prefix="moekit-seal") if _main() else None
        self._group = None
        if _main():  # no save of this run is in flight yet: whatever is unsealed was left by a crash
            clean_stale(self.run_dir)

    @property
    def wait_s(self) -> float:
        return self.timeout_s + JOIN_GRACE_S

    def _abandon(self) -> None:
        """A save thread outlived its wait: it cannot be stopped, only left behind (see stuck_saves)."""
        self.stuck = True
        _ABANDONED.append(self)

    def save(self, step: int, model, optimizer, scheduler, sampler, run: dict | None = None,
             placement: dict | None = None) -> Path | None:
        """Start saving after ``step``; return the newest sealed checkpoint (this one unless async).
        ``run`` and ``placement`` go into meta.json as they are (JSON; see _write_manifest)."""
        self.finalize()
        final = checkpoint_root(self.run_dir) / f"step_{step:06d}"
        tmp = final.with_name(final.name + ".partial")
        error = None
        if _main():
            clean_stale(self.run_dir)
            try:
                tmp.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                error = f"checkpoint of step {step} could not be written to {tmp}: {describe_os_error(exc)}"
        error = _agree(error, f"checkpoint of step {step} ({tmp})")  # a barrier too: tmp is empty before any writes
        if error is not None:
            self._fail(error, removed=False)
        state = _state(model, optimizer, scheduler, sampler, step)
        self.saved_step = step
        written: Future = Future()
        try:
            if self.async_save:
                written = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._async_group())
            else:
                dcp.save(state, checkpoint_id=str(tmp))
                written.set_result(None)
        except (Exception, CheckpointException) as exc:  # reported by finalize, the same way as a background failure
            written.set_exception(exc)
        self._pending = (self._after(written, tmp, final, step, run, placement), tmp, final, step)
        if not self.async_save:
            self.finalize()
        return self.last

    def _async_group(self):
        """A gloo group for the background save's collectives: on the default group they would
        interleave with the training step's and deadlock or mismatch. Its timeout is the run's: torch
        would give a new group 30 minutes, and a stalled rank would hold the save (and the exit) that long."""
        if dist.is_initialized() and self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        return self._group

    def _after(self, written: Future, tmp: Path, final: Path, step: int, run: dict | None,
               placement: dict | None) -> Future:
        if self._sealer is None:
            return written
        return self._sealer.submit(self._seal, written, tmp, final, step, run, placement)

    def _seal(self, written: Future, tmp: Path, final: Path, step: int, run: dict | None,
              placement: dict | None) -> None:
        # DCP's save ends with a gather of every rank's write results to rank 0 before it writes
        # .metadata, so rank 0's future done means every rank's files are on disk
        written.result()
        _write_manifest(tmp, step, self.model_config, run, placement)
        if final.exists():  # the same step saved again (a resumed run redoing it)
            _retire(final)
        os.replace(tmp, final)
        _fsync(final.parent)
        try:
            _rotate(self.run_dir, step, self.keep, self.keep_every)
        except OSError as exc:  # the new checkpoint is sealed; only the old ones stay for now
            self.warn(f"warning: could not remove old checkpoints beyond checkpoint.keep={self.keep}: "
                      f"{describe_os_error(exc)}; {final} is saved")

    def finalize(self) -> Path | None:
        """Wait until the save in flight is sealed; every rank returns together. The newest sealed one."""
        if self._pending is None:
            return self.last
        done, tmp, final, step = self._pending
        self._pending = None
        error, lost_peers = None, False
        try:
            done.result(timeout=self.wait_s)  # this rank's files written (rank 0: and the checkpoint sealed)
        except FutureTimeout:
            self._abandon()
            error = (f"checkpoint of step {step} was not written within --layout.timeout_s={self.timeout_s:g} s + "
                     f"{JOIN_GRACE_S:g} s ({tmp}): the filesystem or another rank stalled")
        except (Exception, CheckpointException) as exc:
            cause = _cause(exc)
            lost_peers = comm_failure(cause)
            if not (lost_peers or isinstance(cause, OSError)):  # a bug, not the filesystem or a peer: as it is
                raise
            reason = ("another rank did not take part within --layout.timeout_s="
                      f"{self.timeout_s:g} s ({first_line(cause)})" if lost_peers else describe_os_error(cause))
            error = f"checkpoint of step {step} could not be written to {tmp}: {reason}"
        if not (self.stuck or lost_peers):  # one outcome on every rank (a stalled or lost rank cannot answer)
            error = _agree(error, f"checkpoint of step {step} ({tmp})")
        if error is None:
            self.last = final
            return final
        stalled = self.stuck or lost_peers
        removed = False
        if _main() and not stalled and tmp.exists():  # every rank is done with it; a full disk needs the space
            shutil.rmtree(tmp, ignore_errors=True)
            removed = not tmp.exists()
        self._fail(error, removed, stalled)

    def _fail(self, error: str, removed: bool, stalled: bool = False) -> None:
        kept = f"newest checkpoint kept: {self.last}" if self.last else "no earlier checkpoint of this run"
        fix = ("find the stalled rank or filesystem (raise --layout.timeout_s only if saves legitimately take "
               "longer)" if stalled else "free space or fix permissions")
        failed = RunFailed(f"{error}; {'removed the unfinished save; ' if removed else ''}{kept}; {fix}, then "
                           f"--resume continues from the newest checkpoint")
        failed.stalled = stalled  # the trainer adds where each rank was (moekit.train.stalls)
        raise failed

    def close(self) -> None:
        """Let an unfinished save end before the process group goes, waiting at most ``wait_s`` (no
        collective: the run may be failing)."""
        if self._pending is not None:
            done = self._pending[0]
            self._pending = None
            try:
                done.result(timeout=self.wait_s)
            except FutureTimeout:
                self._abandon()
            except (Exception, CheckpointException):  # the run ends on another error; the next cleans a .partial
                pass
        if self._sealer is not None:
            self._sealer.shutdown(wait=not self.stuck)


_ABANDONED: list[Checkpointer] = []


def stuck_saves() -> bool:
    """Whether a save thread of this process outlived its wait: the interpreter would join it at exit
    and hang with it, so the program ends without joining (os._exit, after its message)."""
    return bool(_ABANDONED)


def _agree(error: str | None, what: str) -> str | None:
    """The first error of any rank (rank order), the same on all; None when every rank succeeded
    (collective, so also a barrier). A rank that does not answer in time is an error about ``what``."""
    if dist.is_initialized():
        errors: list = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(errors, error)
            error = next((e for e in errors if e), None)
        except RuntimeError as exc:
            if not comm_failure(exc):
                raise
            error = error or f"{what}: another rank did not answer within --layout.timeout_s ({first_line(exc)})"
    return error


def _causes(exc: BaseException) -> list[BaseException]:
    """The ranks' exceptions behind DCP's wrapper ({rank: (exception, stack)}), in rank order; [exc] otherwise."""
    if isinstance(exc, CheckpointException) and exc.failures:
        return [inner[0] if isinstance(inner, tuple) else inner for _, inner in sorted(exc.failures.items())]
    return [exc]


def _cause(exc: BaseException) -> BaseException:
    """The exception behind DCP's wrapper: the first failing rank's."""
    return _causes(exc)[0]
