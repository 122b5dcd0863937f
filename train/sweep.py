"""Router sweep: ``moekit-sweep`` (or ``python tools/sweep.py`` in a checkout).

Trains the same model, data and seed once per variant (a set of moekit-train flags: a router, its
options, a capacity factor, ...), one after another, each in its own run directory, then writes one
comparison report (moekit-heatmap --compare's self-contained HTML page) and a table on stdout.

    moekit-sweep --runs-dir runs/sweep --base "--preset mixtral-tiny --steps 200 --seed 0" \\
        --variant topk="--router topk" \\
        --variant switch="--router switch" \\
        --variant sinkhorn="--router sinkhorn" \\
        --variant ec="--router expert_choice --capacity-factor 1"
    moekit-sweep --config sweep.toml [--variant more="..."] [--nproc 4] [--html report.html]

A sweep file (TOML) holds the same settings; flags override it and --variant adds to its variants:

    runs_dir = "runs/sweep"
    base = "--preset mixtral-tiny --steps 200 --seed 0"    # a string, or an array of arguments
    nproc = 1                                               # > 1: each variant under torchrun
    [variants]
    topk = "--router topk"
    switch = ["--router", "switch", "--capacity-factor", "1.25"]

Each variant runs ``python -m moekit.train BASE VARIANT --run-dir RUNS_DIR/NAME`` (with --nproc N:
``python -m torch.distributed.run --standalone --nproc-per-node N -m moekit.train ...``); the variant's
flags come after the base's, so they win. Its output is streamed prefixed with [NAME]. Before anything trains,
every variant's flags go through moekit-train's own checks (config, data, layout for --nproc ranks), so a typo
fails in seconds, not after the variants before it have trained (--dry-run reports it too, exit status 2). A
variant that fails, then or while training, is reported (exit status, last error line) and the sweep goes on;
the report lists it. Written:
RUNS_DIR/NAME/ (each run's records), RUNS_DIR/sweep.json (commands, exit statuses, times),
RUNS_DIR/report.html (or --html). Exit status: 0 when every variant trained, 1 when any failed (the
report still covers the others), 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moekit.train import OneLineParser, UserError, program_name, run_program
from moekit.train.runlock import probe_writable

PROG = program_name("sweep.py")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
RESERVED = ("--run-dir", "--log.run_dir", "--resume", "--overwrite", "--print-config", "--dry-run", "--write-data",
            "--help-config", "--help", "-h")
KINDS = {str: "a string", list: "an array of arguments", int: "an integer", dict: "a table", bool: "true or false"}
SETTINGS = {"runs_dir": str, "base": (str, list), "nproc": int, "variants": dict, "html": str, "specialisation": bool}


@dataclass
class Variant:
    name: str
    args: list[str]
    command: list[str] = field(default_factory=list)
    run_dir: str = ""
    status: str = "pending"  # pending | ok | failed | skipped
    exit_code: int | None = None
    seconds: float = 0.0
    error: str = ""


def _args(value, where: str) -> list[str]:
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise UserError(f"{where}: cannot split {value!r} into arguments ({exc})") from None
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value):
        return [str(v) for v in value]
    raise UserError(f"{where}: expected a string of flags or an array of arguments, got {value!r}")


def _check_args(args: list[str], where: str) -> None:
    for a in args:
        key = a.split("=", 1)[0]
        if key in RESERVED:
            raise UserError(f"{where}: {key} is set by the sweep (each variant gets RUNS_DIR/NAME); leave it out")


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, rest = text.partition("=")
    if not sep:
        raise UserError(f"--variant {text!r}: expected NAME=\"FLAGS\", e.g. --variant switch=\"--router switch\"")
    return name.strip(), _args(rest, f"--variant {name}")


def load_sweep_file(path: str) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise UserError(f"--config {path}: reading TOML needs Python >= 3.11 or the tomli package") from None
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"--config {path}: file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"--config {path}: invalid TOML ({exc})") from None
    unknown = sorted(set(data) - set(SETTINGS))
    if unknown:
        raise UserError(f"--config {path}: unknown setting(s) {unknown}; a sweep file has {sorted(SETTINGS)}")
    if "variants" in data and not isinstance(data["variants"], dict):
        raise UserError(f"--config {path}: [variants] must be a table of NAME = \"FLAGS\"")
    for key, want in SETTINGS.items():
        value = data.get(key)
        if value is not None and (not isinstance(value, want) or (want is int and isinstance(value, bool))):
            kinds = " or ".join(KINDS[t] for t in (want if isinstance(want, tuple) else (want,)))
            raise UserError(f"--config {path}: {key} = {value!r}: expected {kinds}")
    return data


def build_parser() -> argparse.ArgumentParser:
    class Parser(OneLineParser):
        def error(self, message: str):
            if "expected one argument" in message and ("--base" in message or "--variant" in message):
                message += "; a value that starts with '-' goes after '=', e.g. --base=\"--steps\""
            super().error(message)

    p = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
               allow_abbrev=False)
    p.add_argument("--config", metavar="SWEEP.toml", help="a sweep file (see above)")
    p.add_argument("--runs-dir", metavar="DIR", help="where the variants' run directories go (default runs/sweep)")
    p.add_argument("--base", metavar="FLAGS", help="moekit-train flags every variant shares (one quoted string)")
    p.add_argument("--variant", action="append", default=[], metavar='NAME="FLAGS"',
                   help="a variant: its name (its run directory) and its moekit-train flags; repeat for each")
    p.add_argument("--nproc", type=int, metavar="N", help="train each variant under torchrun with N processes")
    p.add_argument("--html", metavar="REPORT", help="the report's path (default RUNS_DIR/report.html)")
    p.add_argument("--specialisation", action="store_true",
                   help="add expert specialisation to the report (needs checkpoints: --checkpoint.every > 0)")
    p.add_argument("--skip-done", action="store_true",
                   help="skip a variant whose run directory holds a finished run of the same command")
    p.add_argument("--quiet", action="store_true", help="do not stream the variants' output, only progress lines")
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    return p


def plan(args) -> tuple[Path, list[Variant], int, str, bool]:
    file = load_sweep_file(args.config) if args.config else {}
    runs_dir = Path(args.runs_dir or file.get("runs_dir") or "runs/sweep")
    base = _args(args.base, "--base") if args.base is not None else _args(file.get("base", []), "base")
    _check_args(base, "--base")
    nproc = args.nproc if args.nproc is not None else file.get("nproc", 1)
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise UserError(f"--nproc {nproc!r}: must be a positive integer")
    variants: dict[str, list[str]] = {}
    for name, value in (file.get("variants") or {}).items():
        variants[name] = _args(value, f"variants.{name}")
    for text in args.variant:
        name, vargs = parse_variant(text)
        if name in variants:
            raise UserError(f"--variant {name}: a variant of that name exists already; names must differ")
        variants[name] = vargs
    if not variants:
        raise UserError("no variants: give --variant NAME=\"FLAGS\" (one per router or setting) or a sweep file's "
                        "[variants] (see --help)")
    out = []
    for name, vargs in variants.items():
        if not NAME_RE.match(name):
            raise UserError(f"variant {name!r}: names are run-directory names: letters, digits, _ . + - only")
        _check_args(vargs, f"variant {name}")
        run_dir = runs_dir / name
        launcher = [sys.executable, "-m", "moekit.train"] if nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
            "moekit.train"]
        # the sweep owns RUNS_DIR/NAME: a variant run again (not --skip-done) replaces what an earlier sweep left
        command = [*launcher, *base, *vargs, "--run-dir", str(run_dir), "--overwrite"]
        out.append(Variant(name, vargs, command, str(run_dir)))
    html = args.html or file.get("html") or str(runs_dir / "report.html")
    return runs_dir, out, nproc, html, bool(args.specialisation or file.get("specialisation", False))


def check_variants(variants: list[Variant], nproc: int) -> None:
    """moekit-train's own checks of each variant's flags (its config, data and layout for ``nproc`` ranks), in this
    process and before anything trains: a refused variant is failed with its one-line error (exit status 2, as
    moekit-train would end), and the sweep goes on with the others."""
    from moekit.train.cli import parse_args

    for v in variants:
        try:
            parse_args([*v.command[v.command.index("moekit.train") + 1:]], world_size=nproc)
        except UserError as exc:
            v.status, v.exit_code, v.error = "failed", 2, f"moekit-train: error: {' '.join(str(exc).split())}"


def finished(v: Variant) -> bool:
    """The run directory holds a finished run started by the same command."""
    d = Path(v.run_dir)
    try:
        saved = json.loads((d / "sweep_command.json").read_text())
        config = json.loads((d / "config.json").read_text())
        lines = (d / "metrics.jsonl").read_text().splitlines()
        last = json.loads(lines[-1]) if lines else {}
    except (OSError, ValueError, IndexError):
        return False
    return saved.get("command") == v.command[1:] and last.get("step") == config.get("train", {}).get("steps")


def run_variant(v: Variant, index: int, count: int, quiet: bool) -> None:
    say = lambda msg: print(f"[sweep {index}/{count}] {v.name}: {msg}", flush=True)  # noqa: E731
    say(f"{shlex.join(['python', *v.command[1:]])}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    tail: deque[str] = deque(maxlen=40)
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(v.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                bufsize=1, errors="replace")
    except OSError as exc:
        v.status, v.error, v.seconds = "failed", f"could not start: {exc}", time.perf_counter() - t0
        say(f"FAILED: {v.error}")
        return
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            if not quiet:
                print(f"[{v.name}] {line}", flush=True)
        proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    v.seconds, v.exit_code = time.perf_counter() - t0, proc.returncode
    if proc.returncode == 0:
        v.status = "ok"
        (Path(v.run_dir) / "sweep_command.json").write_text(json.dumps({"command": v.command[1:]}) + "\n")
        final = next((ln for ln in reversed(tail) if ln.startswith("done:")), "")
        say(f"done in {v.seconds:.1f} s{'; ' + final if final else ''}")
    else:
        v.status = "failed"
        errors = [ln for ln in tail if "error" in ln.lower() or "Error" in ln]
        v.error = (errors[-1] if errors else (tail[-1] if tail else "no output")).strip()[:500]
        say(f"FAILED (exit status {proc.returncode}) after {v.seconds:.1f} s: {v.error}")


def main(argv: list[str] | None = None) -> int:
    def body() -> int:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        runs_dir, variants, nproc, html, spec = plan(args)
        check_variants(variants, nproc)
        refused = [v for v in variants if v.status == "failed"]
        if args.dry_run:
            for v in variants:
                print(shlex.join(["python", *v.command[1:]]))
            for v in refused:
                print(f"{PROG}: variant {v.name}: {v.error}", file=sys.stderr)
            return 2 if refused else 0
        probe_writable(runs_dir, "--runs-dir", keep=True)
        probe_writable(Path(html).parent, "--html", keep=True)  # the report is written after hours of training
        if Path(html).is_dir():
            raise UserError(f"--html {html}: a directory; name the report's file, e.g. {Path(html) / 'report.html'}")
        t0 = time.perf_counter()
        print(f"[sweep] {len(variants)} variants into {runs_dir}"
              f"{f', {nproc} processes each (torchrun)' if nproc > 1 else ''}; report: {html}", flush=True)
        for i, v in enumerate(variants, 1):
            if v.status == "failed":  # refused by check_variants
                print(f"[sweep {i}/{len(variants)}] {v.name}: FAILED before starting: {v.error}", flush=True)
                continue
            if args.skip_done and finished(v):
                v.status = "skipped"
                print(f"[sweep {i}/{len(variants)}] {v.name}: finished already with the same command; skipped",
                      flush=True)
                continue
            run_variant(v, i, len(variants), args.quiet)
        summary = {"runs_dir": str(runs_dir), "nproc": nproc, "seconds": time.perf_counter() - t0,
                   "variants": [asdict(v) for v in variants], "report": html}
        (runs_dir / "sweep.json").write_text(json.dumps(summary, indent=1) + "\n")
        return report(variants, html, spec)

    return run_program(PROG, body, interrupted="interrupted; finished variants keep their run directories "
                                               "(--skip-done skips them next time)")


def report(variants: list[Variant], html: str, specialisation: bool) -> int:
    from moekit.train import heatmap

    failed = [(v.name, f"exit status {v.exit_code}: {v.error}") for v in variants if v.status == "failed"]
    good = [v for v in variants if v.status in ("ok", "skipped")]
    runs = []
    for v in good:
        try:
            runs.append(heatmap.read_run(v.run_dir, (None, None)))
        except UserError as exc:
            failed.append((v.name, f"no records to report: {exc}"))
    print()
    if runs:
        for r in runs:
            print(heatmap.summary_text(r) + "\n")
        print(heatmap.format_table(heatmap.compare_rows(runs)))
        note = heatmap.difference_note(runs)
        if note:
            print(note)
    for name, why in failed:
        print(f"failed: {name}: {why}")
    if not runs:
        print(f"{PROG}: no variant trained; no report", file=sys.stderr)
        return 1
    try:
        heatmap.pyplot()
    except UserError as exc:
        print(f"{PROG}: no report: {exc}", file=sys.stderr)
        return 1
    heatmap.write_html(runs, html, specialisation, failed=failed, title="moekit router sweep")
    print(f"wrote {html}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
