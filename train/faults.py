"""Faults from outside the run (docs/training.md, "Reliability").

* ``StopSignals``: SIGTERM / SIGINT (what Slurm, Kubernetes and torchrun send before killing) and SIGUSR1
  (Slurm's ``--signal`` warning) become a flag the loop reads at the next step boundary, where every rank
  agrees to save a checkpoint and exit with ``128 + signal`` (143 SIGTERM, 130 SIGINT, 138 SIGUSR1).
* ``RunFailed``: a fault that stops a run already under way (a write that failed, a collective or a
  background save that waited past --layout.timeout_s): one line, exit status 1.
* Testing hook for crash/restart: rank $MOEKIT_FAULT_RANK kills itself at the start of step
  $MOEKIT_FAULT_EXIT_AT_STEP, once per run dir (the marker file lets the restarted attempt go on); with
  $MOEKIT_FAULT_ACTION=hang it hangs there instead (``hang``: a stalled rank, for the stall reports of
  moekit.train.stalls). $MOEKIT_FAULT_EXIT_AT_STEP=resume does it while the run sets up, just before it loads the
  checkpoint it resumes from (a rank stuck in set-up: the others wait in the load's collectives).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from moekit.train import UserError

FAULT_STEP_ENV, FAULT_RANK_ENV, FAULT_MARKER = "MOEKIT_FAULT_EXIT_AT_STEP", "MOEKIT_FAULT_RANK", ".fault_injected"
FAULT_ACTION_ENV = "MOEKIT_FAULT_ACTION"  # kill (default) | hang
# SIGUSR1: what Slurm's --signal=USR1@<seconds> sends ahead of the time limit or a preemption (srun delivers it
# to every rank; torchrun's agent does not forward it, so under torchrun signal the workers or use SIGTERM)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class RunFailed(UserError):
    """Training started and could not go on; the message says what was kept. Exit status 1 (not 2: the
    input was fine), so torchrun --max-restarts retries it."""

    exit_code = 1


class StopSignals:
    """While entered, SIGTERM, SIGINT and SIGUSR1 set ``received`` (the first signal's number) instead of killing.

    Later signals only count in ``repeats``: Slurm signals every process of a job step and torchrun's agent
    forwards its own signal too, so a rank commonly gets two; neither may cut a checkpoint save short
    (SIGKILL still does, and leaves an unsealed ``.partial`` directory that resuming ignores). The handler
    only sets attributes: it runs between bytecodes of the main thread, where printing could re-enter a
    stream that is being written.
    """

    def __init__(self):
        self.received = 0
        self.repeats = 0
        self._previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # signal.signal works only there
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():  # None: a handler installed outside Python
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.received:
            self.repeats += 1
        else:
            self.received = signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def inject_fault(run_dir: str | Path, step: int | str, rank: int) -> None:
    """SIGKILL this rank at the start of ``step`` (or at "resume": before the checkpoint load of a resumed run) when
    $MOEKIT_FAULT_EXIT_AT_STEP / $MOEKIT_FAULT_RANK (default 0) ask for it: simulates a crashed rank for torchrun
    --max-restarts tests. Once per run dir."""
    at = os.environ.get(FAULT_STEP_ENV)
    if not at:
        return
    try:
        at_step, at_rank = (at if at == "resume" else int(at)), int(os.environ.get(FAULT_RANK_ENV, "0"))
    except ValueError:
        raise UserError(f"{FAULT_STEP_ENV}={at!r} / {FAULT_RANK_ENV}: must be integers, or 'resume' for the step "
                        f"(a testing hook; unset them for normal training)") from None
    marker = Path(run_dir) / FAULT_MARKER
    if (at_step, at_rank) != (step, rank) or marker.exists():
        return
    action = os.environ.get(FAULT_ACTION_ENV, "kill")
    if action not in ("kill", "hang"):
        raise UserError(f"{FAULT_ACTION_ENV}={action!r}: use kill or hang (a testing hook; unset it for normal training)")
    when = "before loading the checkpoint to resume from" if step == "resume" else f"at the start of step {step}"
    marker.write_text(f"rank {rank} {'killed itself' if action == 'kill' else 'hung'} {when} ({FAULT_STEP_ENV})\n")
    if action == "hang":
        hang()
    os.kill(os.getpid(), signal.SIGKILL)


def hang() -> None:
    """Never return (the drill of a stalled rank: $MOEKIT_FAULT_ACTION=hang). SIGTERM kills it again, as it would
    a rank stuck in C code, so the launcher that stops the other ranks ends this one without its SIGKILL grace."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        time.sleep(3600)
