"""CPU: the README main job (``moekit-train`` with no arguments) as the trainer runs it: tokens/s and the
time of one optimizer step by phase; with ``--baseline REF`` the same measurement of git REF in the same run.

    python tools/bench/cpu_train.py                                   # this tree, about a minute
    python tools/bench/cpu_train.py --baseline HEAD --json bench-results/cpu_train.json
    python tools/bench/cpu_train.py --rounds 3 -- --preset switch-tiny --batch-size 8   # trainer flags after --
    python tools/bench/cpu_train.py --baseline-args "" -- --train.dtype bfloat16      # bf16 vs fp32, same tree
    python tools/bench/cpu_train.py --env GLIBC_TUNABLES=glibc.malloc.mmap_max=0 --baseline-env ""   # same tree

What is measured: the trainer's own loop (``moekit.train.trainer.Trainer``, built from the trainer flags as
moekit-train builds it: data, model, AdamW, records, TensorBoard, load records, guard, grad clipping),
each tree in its own worker process. A worker runs the loop in chunks of ``--steps`` timed steps plus one
untimed step that closes the chunk (the loop evaluates after its last step). A step is the time from one
step's start to the next one's, so it holds everything the user's step holds: batch, forward, backward,
clipping, AdamW, load records, metrics, logging. Not in it: evaluation and checkpoints (``--eval.every 0
--checkpoint.every 0`` are passed before the trainer flags), which the main job runs every 50 / 100 steps.

Before / after: with ``--baseline REF`` a git worktree of REF (``git worktree add`` under a temp folder,
removed afterwards) gets its own worker, its ``moekit`` imported from there (PYTHONPATH, a folder of
links). The workers take turns, one chunk each per round (rotating who goes first), so both see the same
background load; a round's time is its chunk's mean step, and each tree reports its fastest round. Both
run the same steps from the same seed, so their losses must agree up to rounding (``max_rel_loss_diff``).

Phases of a step: ``forward_backward``, the optimizer (``step`` + ``zero_grad``) and the rest (the
trainer's own work) are wall-clock times of the trainer's methods. ``forward_backward`` is split by one
profiled chunk (torch.profiler, CPU self time, categorised as tools/bench/profile_step.py does: modules
labelled in forward, backward ops charged to the forward op that made their autograd node, Python time
to the innermost labelled region) into router, permute, experts, combine, attention, norm, head_loss and
other_model (embedding, data, loss bookkeeping), scaled to the unprofiled ``forward_backward`` time.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.autograd.profiler import record_function

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"moe": "moe", "comm": "comm", "models": "models", "train": "train"}  # moekit.<name> -> folder
BENCH_FLAGS = ["--eval.every", "0", "--eval.sequences", "1", "--checkpoint.every", "0", "--log.progress", "off"]
MODEL_PHASES = ("router", "permute", "experts", "combine", "attention", "norm", "head_loss", "other_model")
PHASES = MODEL_PHASES + ("optimizer", "trainer")
LABEL_PHASE = {"expert_gemm": "experts"}  # profile_step's labels that this table names differently
FWD_BWD = "fwd_bwd"


# ---------------------------------------------------------------------------------------------------
# Worker: one tree's trainer, driven chunk by chunk over stdin / stdout (one JSON line each way)
# ---------------------------------------------------------------------------------------------------


class Probe:
    """Timers and profiler labels around one Trainer's methods; ``serve`` replaces its ``loop``."""

    def __init__(self, trainer, loop):
        from moekit.bench.benchlib import minor_faults
        from moekit.train.profiling import LABEL, Labels, install_labels

        self.t, self.loop, self.label = trainer, loop, LABEL
        self.faults = minor_faults
        self.labels = Labels()
        install_labels(trainer.model, self.labels, ("permute", "combine"), head_loss_ends_with_forward=False)
        self.records: list[dict] = []
        self.current: dict | None = None
        self.prof, self.profile_steps = None, None
        for obj, name, wrap in ((trainer, "forward_loss", self._head_loss),
                                (trainer, "forward_backward", self._fwd_bwd),
                                (trainer.optimizer, "step", self._timed("optimizer")),
                                (trainer.optimizer, "zero_grad", self._timed("optimizer")),
                                (trainer.guard, "begin_step", self._begin), (trainer.guard, "check", self._check)):
            setattr(obj, name, wrap(getattr(obj, name)))

    def _head_loss(self, fn):
        def forward_loss(*a, **k):
            loss = fn(*a, **k)
            self.labels.pop()  # "head_loss", opened by the final norm's hook: closed once the loss exists
            return loss
        return forward_loss

    def _fwd_bwd(self, fn):
        timed = self._timed("fwd_bwd")(fn)

        def forward_backward(*a, **k):
            with record_function(self.label + FWD_BWD):
                return timed(*a, **k)
        return forward_backward

    def _timed(self, key):
        def wrap(fn):
            def timed(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    if self.current is not None:
                        self.current[key] += time.perf_counter() - t0
            return timed
        return wrap

    def _check(self, fn):
        def check(step, loss, grad_norm, *rest):  # rest: what newer trainers pass too (a spike verdict)
            self.current["loss"] = loss
            return fn(step, loss, grad_norm, *rest)
        return check

    def _begin(self, fn):
        def begin_step(step):
            now, faults = time.perf_counter(), self.faults()
            if self.current is not None:  # the previous step ends where this one begins
                self.current["step"] = now - self.current.pop("t0")
                self.current["minor_faults"] = faults - self.current.pop("faults0")
                self.records.append(self.current)
            if self.profile_steps is not None and step == self.profile_steps[1]:
                self.prof.stop()  # before the chunk's closing step (it evaluates)
            if self.profile_steps is not None and step == self.profile_steps[0]:
                self.prof.start()
            self.current = {"t0": time.perf_counter(), "faults0": self.faults(), "step_no": step, "fwd_bwd": 0.0,
                            "optimizer": 0.0}
            return fn(step)
        return begin_step

    def chunk(self, steps: int, profile: bool) -> dict:
        """Run ``steps`` timed steps and the closing one; their records (and phase split when profiled)."""
        t = self.t
        start = t.start_step = getattr(self, "next_start", t.start_step)
        t.cfg.train.steps = self.next_start = start + steps + 1
        self.records, self.current = [], None
        if profile:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profile_steps = (start + 1, start + steps + 1)
        code = self.loop()
        self.profile_steps = None
        if code != 0:
            raise RuntimeError(f"the trainer's loop returned {code} (see the worker log)")
        out = {"records": self.records}
        if profile:
            out["fwd_bwd_split"] = split_forward_backward(self.prof.events(), self.label)
            self.prof = None
        return out

    def serve(self, proto) -> int:
        loop_module = sys.modules[type(self.t).__module__]  # the module the Trainer came from

        send(proto, {"ready": True, "loop_file": str(Path(loop_module.__file__).resolve()),
                     "tokens_per_step": self.t.plan.tokens_per_step, "torch": torch.__version__,
                     "threads": torch.get_num_threads()})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd.get("quit"):
                break
            send(proto, self.chunk(cmd["steps"], cmd.get("profile", False)))
        return 0


def split_forward_backward(events, label: str) -> dict[str, float]:
    """Phase -> share of the self time of the ops inside the trainer's forward_backward (its Python included:
    a labelled region's own self time is the interpreter's work between its ops)."""
    from moekit.train.profiling import attribute

    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == label + FWD_BWD)
    totals = dict.fromkeys(MODEL_PHASES, 0.0)
    for e, cat, us in attribute(events, on_gpu=False):
        start = e.time_range.start
        if not any(a <= start < b for a, b in spans):
            continue  # clipping, guard, optimizer, records: timed by the wrappers instead
        phase = LABEL_PHASE.get(cat, cat)
        totals[phase if phase in totals else "other_model"] += us
    whole = sum(totals.values()) or 1.0
    return {p: us / whole for p, us in totals.items()}


def send(proto, payload: dict) -> None:
    proto.write(json.dumps(payload) + "\n")
    proto.flush()


def worker(trainer_argv: list[str], threads: int) -> int:
    if threads:
        torch.set_num_threads(threads)
    proto = os.fdopen(os.dup(1), "w")  # the protocol keeps the real stdout ...
    os.dup2(2, 1)  # ... and the trainer's console lines go to the worker log
    sys.stdout = os.fdopen(1, "w", buffering=1)
    from moekit.train.cli import parse_args

    try:
        from moekit.train.trainer import Trainer
    except ImportError:  # a tree from before the Trainer left moekit.train.loop (a --baseline checkout)
        from moekit.train.loop import Trainer

    cfg, opts = parse_args(trainer_argv)
    trainer = Trainer(cfg, opts)
    original = trainer.loop
    trainer.loop = lambda: Probe(trainer, original).serve(proto)  # train() does the setup, then calls this
    return trainer.train()


# ---------------------------------------------------------------------------------------------------
# Parent: trees, workers, rounds, table
# ---------------------------------------------------------------------------------------------------


def link_tree(tree: Path, shim: Path) -> Path:
    """A folder ``shim/moekit/`` of links to ``tree``'s packages (moekit.bench stays this checkout's: the
    worker and its profiler labels are the current ones), for PYTHONPATH."""
    pkg = shim / "moekit"
    pkg.mkdir(parents=True)
    for name, folder in PACKAGES.items():
        (pkg / name).symlink_to(tree / folder, target_is_directory=True)
    (pkg / "bench").symlink_to(REPO / "tools" / "bench", target_is_directory=True)
    return shim


@contextlib.contextmanager
def git_worktree(ref: str, parent: Path):
    tree = parent / "tree"
    proc = subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(tree), ref], cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"cpu_train.py: error: --baseline {ref}: git worktree add failed "
                         f"({proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}); "
                         f"pass a commit, branch or tag of {REPO}")
    try:
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)


class Worker:
    def __init__(self, name: str, tree: Path, tmp: Path, trainer_argv: list[str], threads: int,
                 extra_env: dict[str, str] | None = None):
        self.name, self.tree = name, tree
        shim = link_tree(tree, tmp / f"shim-{name}")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")])))
        env.update(extra_env or {})  # before the worker starts: OpenMP and glibc read theirs at load
        self.log_path = tmp / f"{name}.log"
        argv = [*BENCH_FLAGS, *trainer_argv, "--run-dir", str(tmp / f"run-{name}")]
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", "--threads",
                                      str(threads), "--", *argv],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log_path, "w"),
                                     text=True, env=env, cwd=str(tmp))
        self.rounds: list[dict] = []

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = self.log_path.read_text()[-3000:]
            raise SystemExit(f"cpu_train.py: error: the {self.name} worker stopped (exit {self.proc.returncode}); "
                             f"its log ends:\n{tail}")
        return json.loads(line)

    def ready(self) -> dict:
        info = self.read()
        loop_file = Path(info["loop_file"])
        assert loop_file.is_relative_to(self.tree.resolve()), f"{self.name} imported {loop_file}, not {self.tree}"
        return info

    def run(self, steps: int, profile: bool = False) -> dict:
        self.proc.stdin.write(json.dumps({"steps": steps, "profile": profile}) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def summarize(rounds: list[dict], split: dict[str, float], tokens_per_step: int) -> dict:
    """The fastest round's mean step, by phase (ms), and tokens/s."""
    means = [{k: 1e3 * sum(x[k] for x in r["records"]) / len(r["records"]) for k in ("step", "fwd_bwd", "optimizer")}
             for r in rounds]
    best = min(means, key=lambda m: m["step"])
    phases = {p: best["fwd_bwd"] * split[p] for p in MODEL_PHASES}
    phases["optimizer"] = best["optimizer"]
    phases["trainer"] = best["step"] - best["fwd_bwd"] - best["optimizer"]
    steps = sorted(m["step"] for m in means)
    records = [x for r in rounds for x in r["records"]]
    return {"step_ms": best["step"], "median_round_step_ms": steps[len(steps) // 2],
            "minor_faults_per_step": sum(x["minor_faults"] for x in records) / max(len(records), 1),
            "tokens_per_s": tokens_per_step / best["step"] * 1e3, "phases_ms": phases,
            "round_step_ms": [m["step"] for m in means], "fwd_bwd_split": split}


def losses(worker: Worker) -> dict[int, float]:
    return {r["step_no"]: r["loss"] for rnd in worker.rounds for r in rnd["records"]}


def measure(args, tmp: Path) -> dict:
    trees = {"current": REPO}
    argvs = {"current": args.trainer_args}
    envs = {"current": env_pairs(args.env)}
    stack = contextlib.ExitStack()
    with stack:
        if args.baseline or args.baseline_args is not None or args.baseline_env is not None:
            name = f"baseline@{args.baseline or 'tree'}"
            trees[name] = stack.enter_context(git_worktree(args.baseline, tmp)) if args.baseline else REPO
            argvs[name] = args.trainer_args if args.baseline_args is None else shlex.split(args.baseline_args)
            envs[name] = env_pairs(args.env if args.baseline_env is None else args.baseline_env)
        workers = [Worker(n.split("@")[0], t, tmp, argvs[n], args.threads, envs[n]) for n, t in trees.items()]
        for w, n in zip(workers, trees):
            w.label = n
        stack.callback(lambda: [w.close() for w in workers])
        info = [w.ready() for w in workers]
        for w in workers:
            w.run(args.warmup)  # allocator growth, first-step work, lazy imports
        for r in range(args.rounds):  # take turns, rotating who goes first
            for w in workers[r % len(workers):] + workers[: r % len(workers)]:
                w.rounds.append(w.run(args.steps))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{w.label} {1e3 * sum(x['step'] for x in w.rounds[-1]['records']) / args.steps:.0f} ms/step"
                for w in workers), file=sys.stderr, flush=True)
        splits = [w.run(args.steps, profile=True)["fwd_bwd_split"] for w in workers]
    tps = info[0]["tokens_per_step"]
    result = {w.label: summarize(w.rounds, s, tps) for w, s in zip(workers, splits)}
    out = {"trees": result, "tokens_per_step": tps, "torch": info[0]["torch"], "threads": info[0]["threads"]}
    if len(workers) == 2:
        cur, base = (result[w.label] for w in workers)
        out["ratio_tokens_per_s"] = cur["tokens_per_s"] / base["tokens_per_s"]
        a, b = losses(workers[0]), losses(workers[1])
        out["max_rel_loss_diff"] = max(abs(a[s] - b[s]) / max(abs(b[s]), 1e-12) for s in a.keys() & b.keys())
    return out


def print_result(out: dict) -> None:
    from moekit.bench.benchlib import print_table

    names = list(out["trees"])
    rows = [{"phase": p, **{n: out["trees"][n]["phases_ms"][p] for n in names}} for p in PHASES]
    rows.append({"phase": "= step", **{n: out["trees"][n]["step_ms"] for n in names}})
    rows.append({"phase": "tokens/s", **{n: out["trees"][n]["tokens_per_s"] for n in names}})
    if len(names) == 2:  # > 1: faster now (a time that shrank, tokens/s that grew)
        for r in rows:
            after, before = r[names[0]], r[names[1]]
            r["speedup"] = (after / before if r["phase"] == "tokens/s" else before / after) if after > 0 else None
    cols = [("phase", "phase (ms/step)", "")] + [(n, n, ".1f") for n in names]
    if len(names) == 2:
        cols.append(("speedup", "speedup", ".2f"))
    print_table(rows, cols)
    print("minor page faults per step (memory first touched; moekit.train.host_memory): " + ", ".join(
        f"{n} {out['trees'][n]['minor_faults_per_step']:,.0f}" for n in names))
    if "ratio_tokens_per_s" in out:
        print(f"tokens/s after / before: {out['ratio_tokens_per_s']:.2f}x; max relative loss difference over the "
              f"same steps: {out['max_rel_loss_diff']:.1e}")


def env_pairs(items: list[str]) -> dict[str, str]:
    """``VAR=VALUE`` items (an empty item is none) as a dict."""
    return dict(item.split("=", 1) for item in items if item)


def parse(argv):
    from moekit.bench.benchlib import BenchParser, check_git_ref, check_out

    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default="", metavar="GIT_REF", help="also measure this git ref (before / after)")
    p.add_argument("--baseline-args", default=None, metavar="FLAGS",
                   help="the baseline runs these trainer flags instead (one string, e.g. '--train.dtype float32'), "
                        "on --baseline's tree or this one: two configurations in the same run")
    p.add_argument("--env", action="append", default=[], metavar="VAR=VALUE",
                   help="environment for this tree's worker (repeatable), set before it starts: a runtime setting "
                        "such as GLIBC_TUNABLES=... or LD_PRELOAD=libjemalloc.so.2. The workers take turns, so a "
                        "setting that burns CPU while idle (OMP_WAIT_POLICY=ACTIVE spins) slows the other worker")
    p.add_argument("--baseline-env", action="append", default=None, metavar="VAR=VALUE",
                   help="the baseline's environment instead of --env (repeatable; '' for none): with no --baseline "
                        "or --baseline-args, the same tree and flags under two environments in the same run")
    p.add_argument("--rounds", type=int, default=5, help="timed chunks per tree, taken in turns")
    p.add_argument("--steps", type=int, default=4, help="timed steps per chunk (plus one untimed closing step)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the first round")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads in the workers (0: torch's default)")
    p.add_argument("--json", default="", help="write the result here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("trainer_args", nargs="*", help="moekit-train flags (after --); none = the README main job")
    args = p.parse_args(argv)
    if args.worker:
        return args
    if min(args.rounds, args.steps, args.warmup) < 1 or args.threads < 0:
        p.error(f"--rounds {args.rounds}, --steps {args.steps} and --warmup {args.warmup} must all be >= 1, "
                f"--threads {args.threads} >= 0")
    from moekit.train import UserError
    from moekit.train.cli import parse_args

    for flags in (args.trainer_args, None if args.baseline_args is None else shlex.split(args.baseline_args)):
        try:  # here, before any worker starts: a bad trainer flag is one line
            if flags is not None:
                parse_args([*BENCH_FLAGS, *flags])
        except UserError as exc:
            p.error(f"trainer flags {' '.join(flags)}: {exc}")
    for item in args.env + (args.baseline_env or []):
        if item and ("=" not in item or not item.split("=", 1)[0].isidentifier()):
            p.error(f"--env / --baseline-env {item!r}: expected VAR=VALUE, e.g. GLIBC_TUNABLES=glibc.malloc.mmap_max=0")
    if args.json:
        check_out(p, args.json, "--json", example="cpu_train.json")
    if args.baseline:
        check_git_ref(p, args.baseline)
    return args


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return worker(args.trainer_args, args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="moekit-cpu-train-"))
    try:
        out = measure(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    from moekit.bench.benchlib import environment, write_json

    out = {"benchmark": "cpu_train", "trainer_args": args.trainer_args, "threads_flag": args.threads,
           "baseline": args.baseline or None, "baseline_args": args.baseline_args, "env": env_pairs(args.env),
           "baseline_env": None if args.baseline_env is None else env_pairs(args.baseline_env),
           "rounds": args.rounds, "steps_per_round": args.steps, **out,
           "environment": environment(torch.device("cpu"))}
    print_result(out)
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
