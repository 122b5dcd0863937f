"""moekit's trainer as a library (``moekit.train``): config, data, checkpoints, records, the loop, and the
command-line programs built on them (``moekit-train``, ``moekit-heatmap``, ``moekit-convert``).

The top layer: it imports ``moekit.models``, ``moekit.comm`` and ``moekit.moe``; none of them imports it.

Importing it before torch (every moekit program does) shortens how long OpenMP's waiting threads spin
(``GOMP_SPINCOUNT=3000``, GNU libgomp's, in torch's Linux wheels) unless the environment names a wait policy or a
spin count: by default a thread that waits for the others spins for 300,000 rounds, and when another process
holds a core, each of torch's thousands of parallel regions per step then waits out a scheduler time slice. On the
2-core CI box with one busy core the README main job ran ~30x slower than idle; with the short spin ~2.7x, at a
~2% cost on an idle box (docs/training.md, "Host threads on CPU runs").
"""
import argparse
import os
import sys

if "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ:  # read once, when torch loads OpenMP
    os.environ.setdefault("GOMP_SPINCOUNT", "3000")


class UserError(Exception):
    """Bad input (flags, config, data, checkpoint): the programs print the message as one line, exit 2."""


class OneLineParser(argparse.ArgumentParser):
    """The programs' flag parser: a bad flag is a UserError (one line naming it, exit status 2), not argparse's
    usage block."""

    def error(self, message: str):
        raise UserError(f"{message} (see --help)")


def run_program(prog: str, body, interrupted: str = "interrupted") -> int:
    """``body() -> exit status`` as a command-line program: a UserError becomes one line ``prog: error: ...``
    and its ``exit_code`` (2 unless it sets one), an OSError one line and 2, Ctrl-C a note and 130."""
    try:
        return body()
    except UserError as exc:
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    except OSError as exc:  # a path the program could not read or write, reported where it was not already
        from moekit.train.runlock import describe_os_error

        print(f"{prog}: error: {describe_os_error(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{prog}: {interrupted}", file=sys.stderr)
        return 130


def program_name(script: str) -> str:
    """The name for usage and error lines: the console script (``moekit-train``) when started as one, ``python -m
    PACKAGE`` when started so, else ``script`` (``train.py``, as from ``python tools/train.py`` or a call of
    ``main()`` from Python)."""
    name = os.path.basename(sys.argv[0]) if sys.argv else ""
    if name.startswith("moekit-"):
        return name
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)  # python -m moekit.train (torchrun -m too)
    if name == "__main__.py" and spec is not None and spec.name.startswith("moekit.") and spec.name.endswith(
            ".__main__"):
        return f"python -m {spec.name.removesuffix('.__main__')}"
    return script
