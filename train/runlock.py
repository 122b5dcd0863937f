"""One trainer per run directory, and output paths checked before training starts.

``RunLock``: an advisory lock (``fcntl.flock``) on ``<run_dir>/.lock``, taken by rank 0 before anything in
the run directory is read for writing or changed, and held for the run's life. The kernel drops a flock
when its holder exits, however it exits (crash, SIGKILL, OOM kill), so a lock file left by a dead trainer
never blocks the next one. While held, the file names the holder (pid, host, start time) for the
refusal message; a clean release empties it again (and removes a run directory the lock created if the run
wrote nothing there: setup failed). flock works on local filesystems and on NFS (Linux maps it to NFS
byte-range locks); where a filesystem refuses locks the run goes on, with a warning.

``probe_writable``: create (and remove) a small file in a directory, so an unwritable or full path is one
line before the first step rather than an exception after hours of training.

No torch here: a test (or a tool) can hold a run directory's lock from a small process.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import tempfile
import time
from pathlib import Path

from moekit.train import UserError

try:
    import fcntl
except ImportError:  # not POSIX: no advisory locks, the run goes unguarded
    fcntl = None

LOCK_FILE = ".lock"
PROBE_BYTES = 4096  # one filesystem block: a full disk refuses it
_held: list["RunLock"] = []  # locks of this process, released by release_all()


# What a moekit-train run directory holds (docs/training.md, "Run directory"); any one of them marks one.
RUN_DIR_MARKERS = ("checkpoints", "metrics.jsonl", "expert_load.bin", "tokenizer_info.json", LOCK_FILE)


def refuse_run_directory(path: str | Path, what: str) -> None:
    """UserError when ``path`` is a moekit-train run directory: an HF export (config.json, tokenizer.json) into
    one would overwrite the run's own config.json and change which tokenizer it reads. ``what`` names the flag."""
    folder = Path(path)
    marker = next((m for m in RUN_DIR_MARKERS if (folder / m).exists()), None) if folder.is_dir() else None
    if marker is not None:
        raise UserError(f"{what} {folder} is a moekit-train run directory (it holds {marker}); writing a HuggingFace "
                        f"folder there would replace the run's config.json; choose another folder, e.g. "
                        f"{folder / 'hf'}")


def refuse_foreign_folder(path: str | Path) -> None:
    """UserError when --run-dir ``path`` holds something other than a moekit run: a HuggingFace (or other) model
    folder, whose config.json and tokenizer a run would replace. Refused even with --overwrite, which deletes
    moekit runs only."""
    folder = Path(path)
    if not folder.is_dir():
        return
    found = []
    config = folder / "config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text())
        except (OSError, ValueError):
            data = None
        if not (isinstance(data, dict) and "model" in data and "train" in data):  # a moekit run's has both
            kind = data.get("model_type") if isinstance(data, dict) else None
            found.append("a config.json that is not a moekit run's"
                         + (f" (a HuggingFace {kind!r} model)" if isinstance(kind, str) else ""))
    weights = sorted(p.name for p in folder.iterdir()  # what HF / llama.cpp folders hold; no moekit run has them
                     if p.suffix in (".safetensors", ".gguf")
                     or (p.name.startswith("pytorch_model") and p.suffix == ".bin"))
    if weights:
        found.append(f"model weights ({', '.join(weights[:2])}{', ...' if len(weights) > 2 else ''})")
    if found:
        raise UserError(f"--run-dir {folder} is not a moekit run directory: it holds {' and '.join(found)}, which a "
                        f"run would replace; choose another --run-dir, e.g. {folder.parent / 'runs' / folder.name}")


def check_output_path(path: str | os.PathLike, label: str, fix: str = "choose another path", example: str = "out",
                      folder: bool = False) -> None:
    """UserError, before any work, where ``path`` cannot be written: a directory given for a file (a file for a
    folder, ``folder=True``), a file on the way, or a nearest existing folder that refuses a new file (tried with
    a probe file, removed again). Creates nothing: the writer makes missing folders. ``label`` (the flag and the
    path) starts the message, ``fix`` ends it."""
    path = os.fspath(path)
    if folder and os.path.lexists(path) and not os.path.isdir(path):
        raise UserError(f"{label}: is a file; give a folder path")
    if not folder and os.path.isdir(path):
        raise UserError(f"{label}: is a directory; give a file path, e.g. {os.path.join(path, example)}")
    parent = path if folder and os.path.isdir(path) else (os.path.dirname(path) or ".")
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent) or "."
    if not os.path.isdir(parent):
        raise UserError(f"{label}: {parent} is a file, not a directory; {fix}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UserError(f"{label}: cannot write in {parent} ({exc.strerror or exc}); {fix}") from None


def describe_os_error(exc: OSError) -> str:
    """'No space left on device (/runs/x/checkpoints/step_000004.partial/__0_0.distcp)'."""
    what = exc.strerror or errno.errorcode.get(exc.errno or 0) or str(exc) or type(exc).__name__
    return f"{what} ({exc.filename})" if exc.filename else what


def _unwritable(what: str, folder: Path, exc: OSError) -> str:
    return (f"{what} {folder}: not writable: {describe_os_error(exc)}; free space, fix its permissions, or choose "
            f"another {what}")


def probe_writable(path: str | Path, what: str, keep: bool = False) -> None:
    """Create ``path`` if missing, write a small file into it and remove it again (and the folders it made,
    unless ``keep``); UserError when that fails. ``what`` names the setting (``--run-dir``) in the message."""
    folder = Path(path)
    created = [] if keep else [p for p in (folder, *folder.parents) if not p.exists()]  # innermost first
    probe = folder / f".write-probe-{os.getpid()}"
    try:
        if folder.exists() and not folder.is_dir():
            raise UserError(f"{what} {folder}: exists and is not a directory; choose a directory")
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\0" * PROBE_BYTES)
            os.fsync(fd)  # a full disk may accept the write into the page cache and refuse it here
        finally:
            os.close(fd)
    except OSError as exc:
        raise UserError(_unwritable(what, folder, exc)) from None
    finally:
        with contextlib.suppress(OSError):  # e.g. NotADirectoryError when path is a file: reported above
            probe.unlink(missing_ok=True)
        _remove_empty(created)  # no trace of the probe: the output is written at the end, if the run gets there


class RunLock:
    """The run directory's lock, held while this object is open."""

    def __init__(self, path: Path, fd: int, made: list[Path]):
        self.path, self._fd = path, fd
        self._made = made  # folders acquire() created, innermost first: removed again if the run wrote nothing

    @classmethod
    def acquire(cls, run_dir: str | Path, warn=None) -> "RunLock":
        """Lock ``run_dir`` (created if missing, then probed for writing) or raise a UserError naming its holder."""
        d = Path(run_dir)
        path = d / LOCK_FILE
        clash = next((p for p in (d, *d.parents) if p.exists() and not p.is_dir()), None)
        if clash is not None:
            raise UserError(f"--run-dir {d}: {clash} is a file, not a directory; choose another --run-dir")
        made = [p for p in (d, *d.parents) if not p.exists()]
        for _ in range(10):  # a lock file unlinked by a failed trainer between our open and flock: open again
            try:
                d.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            except OSError as exc:
                _remove_empty(made)
                raise UserError(_unwritable("--run-dir", d, exc)) from None
            if fcntl is None:
                break
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise UserError(f"--run-dir {d}: in use by another trainer ({holder}); wait for it to end or stop "
                                f"it, or choose another --run-dir") from None
            except OSError as exc:  # ENOLCK, ENOSYS, EOPNOTSUPP: a filesystem without locks (Lustre without -o flock)
                if warn is not None:
                    warn(f"warning: cannot lock {path} ({describe_os_error(exc)}); nothing stops a second trainer "
                         f"from writing into {d}")
                break
            if _same_file(fd, path):
                break
            os.close(fd)
        else:
            raise UserError(f"--run-dir {d}: its lock file {path} keeps being replaced; stop the program deleting it")
        lock = cls(path, fd, made)
        _held.append(lock)
        try:
            probe_writable(d, "--run-dir", keep=True)  # after the lock: a refused trainer leaves no trace
            info = f"pid {os.getpid()} on host {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
            os.ftruncate(fd, 0)
            os.pwrite(fd, info.encode(), 0)
        except UserError:
            lock.release()
            raise
        except OSError as exc:
            lock.release()
            raise UserError(_unwritable("--run-dir", d, exc)) from None
        return lock

    def release(self) -> None:
        """Empty the holder line and let go (the kernel lets go too, without emptying, when the process dies).
        A run directory this lock created and nothing else wrote into (setup failed) is removed again."""
        if self._fd is None:
            return
        try:
            if self._made and [p.name for p in self.path.parent.iterdir()] == [LOCK_FILE]:
                self.path.unlink()  # while still locked; a trainer that opened it meanwhile retries (_same_file)
                _remove_empty(self._made)
            else:
                os.ftruncate(self._fd, 0)
        except OSError:  # a full or vanished disk: stale text is harmless, the lock goes with the fd
            pass
        os.close(self._fd)
        self._fd = None
        if self in _held:
            _held.remove(self)


def _remove_empty(folders: list[Path]) -> None:
    """rmdir ``folders`` (innermost first) until one is not empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file ``fd`` locked (it may have been unlinked in between)."""
    try:
        st, now = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text.splitlines()[0] if text else "holder unknown"


def release_all() -> None:
    """Release every lock this process still holds (a trainer that failed during setup included)."""
    for lock in list(_held):
        lock.release()
