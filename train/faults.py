"""Testing hook for crash/restart (docs/training.md): rank $MOEKIT_FAULT_RANK kills itself at the start
of step $MOEKIT_FAULT_EXIT_AT_STEP, once per run dir (the marker file lets the restarted attempt go on)."""
from __future__ import annotations

import os
import signal
from pathlib import Path

from moekit.train import UserError

FAULT_STEP_ENV, FAULT_RANK_ENV, FAULT_MARKER = "MOEKIT_FAULT_EXIT_AT_STEP", "MOEKIT_FAULT_RANK", ".fault_injected"



def inject_fault(run_dir: str | Path, step: int, rank: int) -> None:
    """SIGKILL this rank at the start of ``step`` when $MOEKIT_FAULT_EXIT_AT_STEP / $MOEKIT_FAULT_RANK
    (default 0) ask for it: simulates a crashed rank for torchrun --max-restarts tests. Once per run dir."""
    at = os.environ.get(FAULT_STEP_ENV)
    if not at:
        return
    try:
        at_step, at_rank = int(at), int(os.environ.get(FAULT_RANK_ENV, "0"))
    except ValueError:
        raise UserError(f"{FAULT_STEP_ENV}={at!r} / {FAULT_RANK_ENV}: must be integers (a testing hook; "
                        f"unset them for normal training)") from None
    marker = Path(run_dir) / FAULT_MARKER
    if (at_step, at_rank) != (step, rank) or marker.exists():
        return
    marker.write_text(f"rank {rank} killed itself at the start of step {step} ({FAULT_STEP_ENV})\n")
    os.kill(os.getpid(), signal.SIGKILL)
