"""Where every rank was when a run stalled: the stall report of a multi-rank run (docs/training.md, "Reliability").

A rank that hangs (a deadlocked data read, a stuck filesystem, a GPU that stopped answering) stalls every other rank
at their next collective, and after --layout.timeout_s they fail, naming only the collective they waited in. What an
operator needs is where the hung rank was. So each rank of a multi-rank run keeps a watchdog (``StallWatch``):
Python's faulthandler, armed for --layout.timeout_s and re-armed whenever the trainer makes progress (each step, each
evaluation batch, each save). A rank that goes that long without progress writes the stack of every one of its
threads to ``<run_dir>/stalls/rank_NNNNN.txt``, from faulthandler's own thread, so a rank stuck in C code or holding
the GIL still writes it. The ranks that waited in a collective dump theirs at about the same time (they re-armed at
the same step start and wait in the collective for another --layout.timeout_s before it fails), so when their
collective fails, each reads the reports it can see (``summarize``: every rank's on a shared run directory) and its
one-line error names where each rank was, the odd one out first:

    rank 1: train/data.py:212 (read_windows); ranks 0, 2, 3: train/distributed.py:215 (any_nonfinite)

A healthy phase longer than --layout.timeout_s with nothing re-arming it (a very slow checkpoint save) also writes a
report; the run goes on, and the file keeps it as a record of that phase, marked as followed by progress (``RESUMED``). Reports of a run that did not stall are
removed when it ends. One process has no collective to wait in, so it keeps no watchdog.
"""
from __future__ import annotations

import faulthandler
import os
import re
import threading
import time
from collections import defaultdict
from pathlib import Path

DIR = "stalls"
HEADER = "moekit stall report: rank {rank}, pid {pid}, main thread 0x{ident:016x}\n"
DUMP = "Timeout ("  # how faulthandler starts each dump_traceback_later dump
RESUMED = "(progress again after the dump above: a slow phase, not a stall)\n"
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(.+)", line (\d+) in (\S+)')
# the folders moekit's modules live in (an editable install: the checkout's; a wheel: site-packages/moekit/)
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]
_LAYERS = ("train", "comm", "moe", "models", "tools", "bench")


def report_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / DIR / f"rank_{rank:05d}.txt"


class StallWatch:
    """This rank's watchdog (module docstring): ``pet()`` on progress, ``close()`` at the end (a report without a
    dump is removed). ``enabled=False``: every call does nothing (one process)."""

    def __init__(self, run_dir: str | Path, rank: int, timeout_s: float, enabled: bool = True):
        self.timeout_s, self.file = timeout_s, None
        if not enabled or timeout_s <= 0:
            return
        self.path = report_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "w")  # noqa: SIM115  (faulthandler writes to its descriptor until close())
        self.file.write(HEADER.format(rank=rank, pid=os.getpid(), ident=threading.main_thread().ident))
        self.file.flush()
        self.header_bytes = self.size = self.file.tell()
        self.pet()

    def pet(self) -> None:
        """Progress: the watchdog starts its --layout.timeout_s again (after marking a dump written since the last
        progress as a slow phase)."""
        if self.file is None:
            return
        size = os.fstat(self.file.fileno()).st_size  # faulthandler writes to the descriptor, past Python's buffer
        if size != self.size:
            self.file.seek(0, os.SEEK_END)
            self.file.write(RESUMED)
            self.file.flush()
            self.size = self.file.tell()
        faulthandler.dump_traceback_later(self.timeout_s, repeat=False, file=self.file, exit=False)

    def close(self) -> None:
        if self.file is None:
            return
        faulthandler.cancel_dump_traceback_later()
        self.file.close()
        self.file = None
        try:
            if self.path.stat().st_size <= self.header_bytes:  # never a dump: no record
                self.path.unlink()
                self.path.parent.rmdir()  # the last rank to leave removes the folder (others' files keep it)
        except OSError:
            pass


def _own(path: str) -> Path | None:
    """A moekit module's path relative to the package (``train/data.py``), None for any other file."""
    try:
        rel = Path(path).resolve().relative_to(_PACKAGE_ROOT)
    except ValueError:
        return None
    return rel if rel.parts and rel.parts[0] in _LAYERS else None


def _where(path: str, line: str, func: str) -> str:
    """``train/data.py:212 (read_windows)`` for a moekit module, else the file's last two parts."""
    rel = _own(path)
    return f"{rel if rel is not None else '/'.join(Path(path).parts[-2:])}:{line} ({func})"


def main_thread_location(text: str) -> str | None:
    """Where a report's main thread was: its innermost moekit frame, and the innermost frame when that is elsewhere
    (``train/distributed.py:215 (any_nonfinite) in distributed/distributed_c10d.py:2950 (all_reduce)``); None
    without a dump, or when the rank made progress after its last one."""
    found = _location(text)
    return found[0] if found else None


def _location(text: str) -> tuple[str, bool] | None:
    """(main_thread_location, whether the main thread waits in torch.distributed: a collective)."""
    lines = text.splitlines()
    head = re.search(r"main thread (0x[0-9a-f]+)", lines[0]) if lines else None
    dumps = [i for i, line in enumerate(lines) if line.startswith(DUMP)]
    if head is None or not dumps or RESUMED.strip() in lines[dumps[-1]:]:  # no dump, or only slow phases'
        return None
    main = int(head[1], 16)
    frames, inside = [], False
    for line in lines[dumps[-1] + 1:]:
        thread = _THREAD.match(line)
        if thread:
            if frames:  # the main thread's block ended (a dump lists each thread once)
                break
            inside = int(thread[1], 16) == main
            continue
        frame = _FRAME.match(line) if inside else None
        if frame:
            frames.append(frame.groups())  # innermost first ("most recent call first")
    if not frames:
        return None
    waiting = "torch/distributed/" in Path(frames[0][0]).as_posix()
    own = next((f for f in frames if _own(f[0]) is not None), None)
    if own is None:
        return _where(*frames[0]), waiting
    if own is frames[0]:
        return _where(*own), waiting
    return f"{_where(*own)} in {_where(*frames[0])}", waiting


def summarize(run_dir: str | Path, world: int, wait_s: float = 3.0) -> str | None:
    """One clause naming where each rank was, from the reports this rank can read (waiting up to ``wait_s`` for
    all ``world`` of them: a stalled rank dumps at about the time the others' collective fails); the locations
    outside a collective first (a rank that hung elsewhere keeps the others waiting in one), then those held by the
    fewest ranks. None when no rank wrote a dump."""
    folder = Path(run_dir) / DIR
    deadline = time.monotonic() + wait_s
    while True:
        found = {}
        for rank in range(world):
            try:
                where = _location(report_path(run_dir, rank).read_text(errors="replace"))
            except OSError:
                where = None
            if where is not None:
                found[rank] = where
        if len(found) == world or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if not found:
        return None
    by_place: dict[tuple[str, bool], list[int]] = defaultdict(list)
    for rank, where in sorted(found.items()):
        by_place[where].append(rank)
    parts = []
    for (where, _), ranks in sorted(by_place.items(), key=lambda kv: (kv[0][1], len(kv[1]), kv[1][0])):
        shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
        parts.append(f"{'rank' if len(ranks) == 1 else 'ranks'} {shown}: {where}")
    missing = world - len(found)
    tail = f"; {missing} rank(s) wrote no report here" if missing else ""
    return f"where the ranks were ({folder}/, every thread's stack): {'; '.join(parts)}{tail}"
