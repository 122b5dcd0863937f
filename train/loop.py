"""``moekit-train``: the flags, then the run (moekit.train.trainer.Trainer), and one line for each failure.

This module imports no torch: ``--help``, a bad flag or a bad config value is answered in a fraction of a second,
and torch, the models and checkpointing load only for a run (or a config check that builds the model).
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from pathlib import Path

from moekit.train import UserError, program_name, runlock
from moekit.train.cli import parse_args
from moekit.train.config import TrainConfig, to_toml

PROG = program_name("train.py")  # moekit-train when started as the console script


def main(argv: list[str] | None = None) -> int:
    """Entry point. Exit status: 0 on success; 1 when training stopped on a failure (a non-finite loss, a
    write that failed, a collective or checkpoint that waited past --layout.timeout_s); 2 on bad input
    (flags, data, paths, a run directory in use); 128 + signal (143 SIGTERM, 130 SIGINT) when a signal
    stopped it after saving a checkpoint: non-zero, so torchrun --max-restarts and schedulers retry it.

    A rank of a multi-process run does not return: once the trainer has torn down what it started (saves
    sealed, records closed, the ranks past their last barrier, the groups destroyed), it ends its process
    with that status without finalizing the interpreter, whose finalization races gloo's worker threads
    (moekit.train.distributed.owns_process_group). So does one whose save thread hung (checkpoint.stuck_saves)."""
    try:
        code = _run(argv)
    except Exception:  # a bug: reported as the interpreter would, but a rank must not finalize (below)
        if not _owns_process_group():
            raise
        traceback.print_exc()
        code = 1
    finally:
        runlock.release_all()  # a trainer that failed during setup lets go of its run directory too
    checkpoint = sys.modules.get("moekit.train.checkpoint")  # imported by a run that got past its flags
    stuck = checkpoint is not None and checkpoint.stuck_saves()  # a save thread hung: finalizing would wait
    if stuck or _owns_process_group():
        from moekit.train.distributed import end_process

        end_process(code, run_exit_handlers=not stuck)
    return code


def _run(argv: list[str] | None) -> int:
    cfg = None
    try:
        try:
            cfg, opts = parse_args(sys.argv[1:] if argv is None else argv)
        except UserError:
            _wait_for_local_rank_0()
            raise
        if opts.print_config:
            print(to_toml(cfg), end="")
            return 0
        if opts.write_data:
            return write_data(cfg, opts.write_data)
        if opts.dry_run:  # plan the layout in this one process (fake process group, meta model); no training
            from moekit.train.planning import dryrun
            return dryrun.run(cfg, opts)
        from moekit.train.trainer import Trainer  # torch, the models, checkpoints: after the flags

        return Trainer(cfg, opts).train()
    except UserError as exc:
        if not getattr(exc, "quiet", False):  # RanksDisagree: raised on every rank, printed by rank 0
            print(f"{PROG}: error: {' '.join(str(exc).split())}", file=sys.stderr)  # one line, always
        return getattr(exc, "exit_code", 2)  # RunFailed: 1
    except OSError as exc:  # a file outside the loop's own reporting (records at setup, say): one line
        print(f"{PROG}: error: {runlock.describe_os_error(exc)}; fix that path (free space, permissions) and run "
              f"again", file=sys.stderr)
        return 1
    except RuntimeError as exc:  # the rendezvous or a collective during setup (the loop reports its own)
        from moekit.train.distributed import comm_failure, first_line

        if not comm_failure(exc):
            raise
        print(f"{PROG}: error: starting the ranks failed ({first_line(exc)}): another rank crashed, stalled or was "
              f"launched differently (every wait is bounded by --layout.timeout_s)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # records are flushed per step; checkpoints are renamed only when complete
        saved = cfg is not None and any(p.name.removeprefix("step_").isdigit()  # complete ones, not .partial
                                        for p in Path(cfg.run_dir, "checkpoints").glob("step_*"))
        print(f"\n{PROG}: interrupted{'; --resume continues from the newest checkpoint' if saved else ''}",
              file=sys.stderr)
        return 130


# torchrun starts a node's ranks with one command line, so bad flags fail alike on all of them. A local rank other
# than 0 waits this long before it reports its error: when local rank 0 fails too, it prints first and torchrun
# stops the node's other ranks meanwhile, so the line appears once per node instead of once per rank. A rank still
# running after the wait (rank 0 did not fail: a difference only this rank sees) prints its own message.
LOCAL_ECHO_DELAY_S = 5.0


def _wait_for_local_rank_0() -> None:
    if os.environ.get("LOCAL_RANK", "0") not in ("", "0") and os.environ.get("LOCAL_WORLD_SIZE", "1") != "1":
        time.sleep(LOCAL_ECHO_DELAY_S)


def write_data(cfg: TrainConfig, out: str) -> int:
    if cfg.data.path or cfg.data.blend:
        raise UserError(f"--write-data converts the embedded corpus or a --data.text file; "
                        f"{cfg.data.path or cfg.data.blend} is already token data")
    from moekit.train.tokens import load_tokens, write_token_file

    tokens, desc = load_tokens("", cfg.data.text, cfg.model.vocab_size)
    part = f"{out}.partial"  # renamed when complete: a full disk leaves no truncated token file
    try:
        write_token_file(part, tokens, 256)  # byte-level
        os.replace(part, out)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(part)
        raise UserError(f"--write-data {out}: cannot write it: {runlock.describe_os_error(exc)}; free space, fix "
                        f"permissions or choose another path") from None
    print(f"wrote {out}: {desc}")
    return 0


def _owns_process_group() -> bool:
    """moekit.train.distributed.owns_process_group, without importing torch for a run that never got that far."""
    distributed = sys.modules.get("moekit.train.distributed")
    return distributed is not None and distributed.owns_process_group()
