"""A Slurm batch script for a multi-node run: ``moekit-launch slurm`` (or ``python tools/launch.py slurm``).

    moekit-launch slurm --nodes 4 --gpus-per-node 8 --time 2-00:00:00 -o job.sbatch -- \\
        --preset mixtral-1b --data.path data/web.bin --fsdp 32 --ep 8 --steps 100000 --run-dir runs/m1b
    sbatch job.sbatch

Everything after ``--`` is moekit-train's flags. They go through moekit-train's own checks first, with the layout
resolved for nodes x GPUs ranks. So a typo, a degree that does not divide the world, or experts that do not divide
the expert-parallel size fail here in one line, not after the job has waited in the queue. The script it writes:

* runs one torchrun agent per node (``srun``, one task per node), which starts the node's ranks; the agents meet at
  the first node of the allocation (c10d rendezvous, keyed by the job id) and restart their ranks from the newest
  checkpoint after a crash (``--max-restarts``, ``--resume auto``: moekit.train.faults);
* asks Slurm for a signal ``--signal-lead`` seconds before the time limit (``#SBATCH --signal=B:USR1@...``). On it,
  or on SIGTERM (a preemption), the script sends SIGTERM to the job step; srun forwards it to every node's agent
  and the agents to their ranks, which finish the step, save a checkpoint and exit (docs/training.md,
  "Preemption"). The script then requeues the job (``scontrol requeue``), and the next start continues from that
  checkpoint with the losses of an uninterrupted run. Set the lead above one step plus one checkpoint save;
* appends to one log per job (``slurm-<name>-<id>.out``) across requeues.

``--check-memory GIB`` runs moekit-train's ``--dry-run`` for the job's ranks first (a fake process group and a meta
model on this machine: every rank's weights, gradients, optimizer state and activations) and writes the script only
when the worst rank fits in GIB of GPU memory; the plan goes to stderr.

``--setup`` lines run before the launch on the batch node (``source .venv/bin/activate``, ``module load``), and
``--env KEY=VALUE`` exports reach every rank (NCCL settings, for example). Exit status: 0 written, 2 bad input.
"""
from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

from moekit.train import OneLineParser, UserError, program_name, run_program

PROG = program_name("launch.py")
# moekit-train flags the script sets itself, or that do something else than train
MODES = ("--print-config", "--help-config", "--write-data", "--dry-run", "--world-size", "--help", "-h")
TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                      allow_abbrev=False)
    sub = p.add_subparsers(dest="scheduler", required=True)
    s = sub.add_parser("slurm", help="an sbatch script: one torchrun agent per node, requeued before the time limit",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    s.error = p.error  # one line, as the parent's
    s.add_argument("--nodes", type=int, required=True, metavar="N", help="nodes to allocate")
    s.add_argument("--gpus-per-node", type=int, required=True, metavar="G", help="ranks per node (one per GPU)")
    s.add_argument("--time", required=True, metavar="T",
                   help="the time limit, as Slurm writes it: MINUTES, HH:MM:SS or D-HH:MM:SS")
    s.add_argument("--signal-lead", type=int, default=600, metavar="S",
                   help="seconds before the time limit at which the ranks save and the job requeues (default 600)")
    s.add_argument("--job-name", default=None, metavar="NAME", help="default: moekit-<run directory's name>")
    s.add_argument("--partition", default=None, metavar="P")
    s.add_argument("--account", default=None, metavar="A")
    s.add_argument("--cpus-per-node", type=int, default=None, metavar="C", help="CPUs for each node's task")
    s.add_argument("--max-restarts", type=int, default=3, metavar="K",
                   help="torchrun restarts of a node's ranks after a failure, within one allocation (default 3)")
    s.add_argument("--port", type=int, default=29500, metavar="PORT", help="rendezvous port on the first node")
    s.add_argument("--setup", action="append", default=[], metavar="LINE",
                   help="a shell line run before the launch (repeatable), e.g. 'source .venv/bin/activate'")
    s.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable for every rank (repeatable), e.g. NCCL_IB_HCA=mlx5")
    s.add_argument("--python", default="python", metavar="EXE",
                   help="the Python that runs torchrun on the nodes (default: python on the PATH after --setup)")
    s.add_argument("--check-memory", type=float, default=None, metavar="GIB",
                   help="first plan every rank's memory for the job's ranks (moekit-train's --dry-run, on this "
                        "machine) and write the script only if the worst rank's peak fits in GIB of GPU memory")
    s.add_argument("-o", "--out", default=None, metavar="FILE", help="write the script here (default: stdout)")
    s.add_argument("train", nargs=argparse.REMAINDER, metavar="-- TRAIN_FLAGS",
                   help="moekit-train's flags, after --")
    return p


def seconds(limit: str) -> int:
    """Slurm's time formats: MINUTES, MINUTES:SECONDS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    m = TIME_RE.match(limit.strip())
    if not m:
        raise UserError(f"--time {limit!r}: not a Slurm time limit; use MINUTES, HH:MM:SS or D-HH:MM:SS")
    days, a, b, c = m.groups()
    parts = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-HH[:MM[:SS]]
        h, mi, s = (parts + [0, 0])[:3]
        return ((int(days) * 24 + h) * 60 + mi) * 60 + s
    if len(parts) == 1:
        return parts[0] * 60  # MINUTES
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]  # MINUTES:SECONDS
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


def train_flags(args):
    """(moekit-train's flags, any --resume taken out, and their TrainConfig), checked as moekit-train checks them for
    nodes x GPUs ranks; the script adds ``--resume auto``."""
    flags = list(args.train)
    if flags[:1] == ["--"]:
        flags = flags[1:]
    for a in flags:
        key = a.split("=", 1)[0]
        if key in MODES:
            raise UserError(f"{key} is not a training run; leave it out of the job's flags (run moekit-train {key} "
                            f"yourself, e.g. --dry-run --world-size {args.nodes * args.gpus_per_node} for the memory "
                            f"of each rank)")
        if key in ("--ranks-per-node", "--layout.ranks_per_node"):
            raise UserError(f"{key}: the job's nodes are real; leave it out (torchrun gives each rank its node's "
                            f"{args.gpus_per_node} ranks)")
    flags = [part for f in flags for part in (f.split("=", 1) if f.startswith("--resume=") else [f])]
    if "--resume" in flags:
        at = flags.index("--resume")
        value = flags[at + 1] if at + 1 < len(flags) and not flags[at + 1].startswith("-") else None
        if value not in (None, "auto"):
            raise UserError(f"--resume {value}: the job resumes with --resume auto, so each requeue and restart "
                            f"continues its own run; start it from another run's weights with --init-from-dense, or "
                            f"copy that checkpoint into the run directory")
        del flags[at : at + (2 if value else 1)]
    from moekit.train.cli import parse_args  # torch and the models: after the launcher's own flags

    world = args.nodes * args.gpus_per_node
    try:
        cfg, _ = parse_args(flags, world_size=world)
    except UserError as exc:
        raise UserError(f"the training flags for {args.nodes} x {args.gpus_per_node} = {world} ranks: {exc}") from None
    return flags, cfg


def check(args) -> None:
    for name in ("nodes", "gpus_per_node", "cpus_per_node"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} {value}: must be at least 1")
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts {args.max_restarts}: must be 0 or more")
    if not 1 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: not a port; use 1-65535")
    limit = seconds(args.time)
    if not 60 <= args.signal_lead < limit:
        raise UserError(f"--signal-lead {args.signal_lead}: must be at least 60 s and below the time limit "
                        f"({limit} s): the ranks need one step and one checkpoint save before Slurm ends the job")
    if args.job_name is not None and not NAME_RE.match(args.job_name):
        raise UserError(f"--job-name {args.job_name!r}: use letters, digits and _ . + -")
    for e in args.env:
        if not ENV_RE.match(e):
            raise UserError(f"--env {e!r}: expected KEY=VALUE")
    if args.check_memory is not None and not args.check_memory > 0:
        raise UserError(f"--check-memory {args.check_memory}: a GPU's memory in GiB, e.g. 80")
    if not [a for a in args.train if a != "--"]:
        raise UserError("no training flags: put moekit-train's flags after --, e.g. -- --preset mixtral-1b --ep 8")


def check_memory(args, flags: list[str]) -> None:
    """--check-memory: moekit-train's dry run for the job's ranks, its report on stderr; a UserError when the worst
    rank's peak does not fit."""
    import contextlib

    from moekit.train.cli import parse_args
    from moekit.train.planning import dryrun

    world = args.nodes * args.gpus_per_node
    cfg, opts = parse_args([*flags, "--dry-run", "--world-size", str(world), "--dry-run-gpu-gb",
                            f"{args.check_memory:g}", "--ranks-per-node", str(args.gpus_per_node)])  # the job's nodes
    with contextlib.redirect_stdout(sys.stderr):
        code = dryrun.run(cfg, opts)
    if code == dryrun.DOES_NOT_FIT:
        raise UserError(f"--check-memory {args.check_memory:g}: the dry run above puts a rank's peak above "
                        f"{args.check_memory:g} GiB at {world} ranks; the script was not written. Shard more (--fsdp, "
                        f"--ep, --tp, --pp), recompute (--train.activation_checkpointing), or a smaller micro-batch")


def script(args, flags: list[str], cfg, argv: list[str]) -> str:
    name = args.job_name or f"moekit-{Path(cfg.run_dir).name}"
    L = cfg.layout
    degrees = " ".join(f"{k}={getattr(L, k)}" for k in ("pp", "dp", "fsdp", "cp", "tp", "ep") if getattr(L, k) > 1)
    world = args.nodes * args.gpus_per_node
    sbatch = [f"--job-name={name}", f"--nodes={args.nodes}", "--ntasks-per-node=1",
              f"--gpus-per-node={args.gpus_per_node}", f"--time={args.time}",
              f"--signal=B:USR1@{args.signal_lead}", "--requeue", "--open-mode=append", "--output=slurm-%x-%j.out"]
    if args.cpus_per_node:
        sbatch.append(f"--cpus-per-task={args.cpus_per_node}")
    if args.partition:
        sbatch.append(f"--partition={args.partition}")
    if args.account:
        sbatch.append(f"--account={args.account}")
    env = "".join(f"export {shlex.quote(e.split('=', 1)[0])}={shlex.quote(e.split('=', 1)[1])}\n" for e in args.env)
    setup = "".join(f"{line}\n" for line in args.setup)
    train = " \\\n    ".join(" ".join(shlex.quote(f) for f in flags[i : i + 6]) for i in range(0, len(flags), 6))
    return f"""#!/bin/bash
# {args.nodes} node(s) x {args.gpus_per_node} rank(s) = {world} ranks ({degrees or "data parallel"}), run directory {cfg.run_dir}
# written by: moekit-launch {shlex.join(argv)}
# moekit-train's own checks passed for these flags at {world} ranks; submit this file with sbatch
""" + "".join(f"#SBATCH {line}\n" for line in sbatch) + f"""
set -uo pipefail
{setup}# torchrun >= 2.5 shares its rendezvous store with the workers; restarted ranks could read the dead attempt's
# addresses (pytorch/pytorch#135712; docs/training.md, "Crash and restart under torchrun")
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
{env}head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
requeue=0
stop() {{  # the time limit is near (USR1, asked for above) or the job is preempted (TERM)
    echo "moekit-launch: $1 received: the ranks save after their current step; the job is then requeued"
    requeue=1
    kill -TERM "$step" 2>/dev/null  # srun forwards it to every node's torchrun, which forwards it to its ranks
}}
trap 'stop USR1' USR1
trap 'stop TERM' TERM

srun {shlex.quote(args.python)} -m torch.distributed.run --nnodes "$SLURM_NNODES" \\
    --nproc-per-node {args.gpus_per_node} --rdzv-backend c10d --rdzv-endpoint "$head_node:{args.port}" \\
    --rdzv-id "$SLURM_JOB_ID" --max-restarts {args.max_restarts} \\
    -m moekit.train {train} &
step=$!
wait "$step"
status=$?
while kill -0 "$step" 2>/dev/null; do  # a trapped signal ends wait early: wait for the ranks' save
    wait "$step"
    status=$?
done
if [ "$requeue" = 1 ]; then
    echo "moekit-launch: requeueing job $SLURM_JOB_ID; it continues from the newest checkpoint (--resume auto)"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$status"
"""


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 written; 2 bad input, one line on stderr."""

    def body() -> int:
        raw = sys.argv[1:] if argv is None else list(argv)
        args = build_parser().parse_args(raw)
        check(args)
        flags, cfg = train_flags(args)
        if args.check_memory is not None:
            check_memory(args, flags)
        text = script(args, [*flags, "--resume", "auto"], cfg, raw)
        if args.out is None:
            sys.stdout.write(text)
            return 0
        out = Path(args.out)
        if out.is_dir():
            raise UserError(f"-o {out}: a directory; name the script to write, e.g. {out / 'job.sbatch'}")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        out.chmod(0o755)
        print(f"wrote {out}: {args.nodes} node(s) x {args.gpus_per_node} rank(s); submit it with: sbatch {out}")
        return 0

    return run_program(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
