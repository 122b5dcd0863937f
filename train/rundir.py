"""The run directory a trainer writes into: claimed by one trainer at a time, an earlier run's never
overwritten by accident (moekit-train's --run-dir, --resume, --overwrite).

    claim(cfg, continuing, warn)   rank 0, before anything in the run dir is touched: lock it (runlock),
                                   refuse an earlier run's records unless continuing, probe the --export-hf
                                   folder, warn when a checkpoint will not fit in the free space
    earlier_run(run_dir)           what a fresh run there would delete that a user may want
"""
from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from moekit.models.stats import model_stats
from moekit.train import UserError, checkpoint, records, runlock
from moekit.train.config import TrainConfig


def earlier_run(run_dir: str | Path) -> str:
    """What a fresh run in ``run_dir`` would delete that a user may want: its checkpoints and its metrics ('' when
    neither is there: an empty folder, or the config / lock of a run that stopped during setup)."""
    found = []
    saved = checkpoint.list_checkpoints(run_dir)
    if saved:
        found.append(f"{len(saved)} checkpoint{'s' if len(saved) > 1 else ''}, the newest at step "
                     f"{checkpoint.step_of(saved[-1])}")
    metrics = Path(run_dir) / records.METRICS
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(f"metrics in {records.METRICS}")
    return "; ".join(found)


def claim(cfg: TrainConfig, continuing: bool, warn: Callable[[str], None]) -> runlock.RunLock:
    """Rank 0: lock the run dir (a second trainer is refused, naming the first), refuse an earlier run's records
    unless ``continuing`` (--resume or --overwrite), probe the export dir for writing, and warn when a checkpoint
    will not fit in the free space. Returns the held lock."""
    runlock.refuse_foreign_folder(cfg.run_dir)  # before the lock: a refused trainer leaves no .lock there
    lock = runlock.RunLock.acquire(cfg.run_dir, warn=warn)
    try:
        earlier = None if continuing else earlier_run(cfg.run_dir)
        if earlier:
            raise UserError(f"--run-dir {cfg.run_dir} holds an earlier run ({earlier}): --resume continues it, "
                            f"--overwrite deletes it and starts over, or choose another --run-dir")
        if cfg.train.export_hf:
            runlock.probe_writable(cfg.train.export_hf, "--export-hf")
    except UserError:
        lock.release()
        raise
    need = 12 * model_stats(cfg.model, cfg.train.seq_len).params  # fp32 weights + AdamW's two moments
    free = shutil.disk_usage(cfg.run_dir).free
    if free < need:
        warn(f"warning: --run-dir {cfg.run_dir} has {free / 1e9:.3g} GB free and a checkpoint takes about "
             f"{need / 1e9:.3g} GB: saves will fail unless space is freed")
    return lock
