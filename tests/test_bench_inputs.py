"""Every tools/bench script refuses bad input the same way: one line on stderr naming the flag, the value and the
fix, exit status 2, before anything is written (no JSON, no output folder); the checks live in
tools/bench/benchlib.py (BenchParser, check_device, check_at_least, check_names, check_out)."""
from __future__ import annotations

import errno
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moekit.bench import benchlib
from tests.helpers import one_stderr_line


def exit_status(main, argv) -> int:
    """main(argv)'s status, whether it returns it or exits with it."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def place(tmp_path, monkeypatch):
    """A working folder (default outputs such as bench-results/ land there), paths to put in argv: DIR (a folder),
    FILE (a file), RO (a folder that refuses new files, as a read-only filesystem: the tests may run as root),
    and a check that nothing under tmp_path changed."""
    (tmp_path / "DIR").mkdir()
    (tmp_path / "RO").mkdir()
    (tmp_path / "FILE").write_text("a file\n")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    real = benchlib.tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).resolve() == (tmp_path / "RO").resolve():
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), dir)
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(benchlib.tempfile, "mkstemp", mkstemp)
    paths = {name: str(tmp_path / name) for name in ("DIR", "RO", "FILE")}
    before = tree(tmp_path)
    yield paths
    assert tree(tmp_path) == before, "a refused run wrote something"




NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


@NO_GPU
@pytest.mark.parametrize("script,argv", [
    ("moe_layer", ["--device", "cuda"]),
    ("dispatch_bandwidth", ["--device", "cuda"]),
    ("generate", ["--device", "cuda"]),
    ("profile_step", ["--device", "cuda"]),
    ("ac_memory", ["--device", "cuda"]),
    ("train_mfu", ["--device", "cuda"]),
    ("train_mfu", ["--smoke", "--device", "cuda"]),
    ("moe_layer", ["--device", "cuda:0"]),
])
def test_cuda_without_a_gpu_is_one_line(script, argv, place, capsys):
    """--device cuda on a machine without one: no traceback (AssertionError: Torch not compiled with CUDA), no
    partial JSON (train_mfu wrote a failed configuration), no profile folder (profile_step made one)."""
    main = importlib.import_module(f"moekit.bench.{script}").main
    assert exit_status(main, argv) == 2
    one_stderr_line(capsys, f"{script}.py: error: --device cuda", "no CUDA GPU", "use --device cpu")


@pytest.mark.parametrize("script,argv,words", [
    # names: presets, shapes, backends, peers, implementations
    ("profile_step", ["--preset", "nope"], ["--preset nope: unknown", "auto, mixtral-tiny"]),
    ("profile_step", ["--expert-backend", "nope"], ["--expert-backend nope: unknown", "loop"]),
    ("generate", ["--presets", "mixtral-tiny", "nope"], ["--presets nope: unknown", "switch-tiny"]),
    ("moe_layer", ["--shapes", "32x4x2", "8x2"], ["--shapes entry '8x2' is not FxExk or HxFxExk"]),
    ("moe_layer", ["--shapes", "32x4x8"], ["--shapes entry '32x4x8' needs", "0 < k <= E"]),
    ("moe_layer", ["--backends", "auto", "nope"], ["--backends nope: unknown", "torch"]),
    ("moe_layer", ["--peers", "foo"], ["--peers", "'foo'", "titan"]),
    ("cpu_layer", ["--backends", "nope"], ["--backends nope: unknown"]),
    ("cpu_layer", ["--baseline", "no-such-ref"], ["--baseline no-such-ref: not a commit"]),
    ("cpu_train", ["--baseline", "no-such-ref"], ["--baseline no-such-ref: not a commit"]),
    ("cpu_fusion", ["--compile-backend", "nope"], ["--compile-backend nope: unknown", "inductor"]),
    ("expert_threads", ["--shapes", "0x128"], ["--shapes '0x128' is invalid", "both >= 1"]),
    ("tune_kernels", ["--calls", "nope"], ["--calls nope: unknown"]),
    ("train_mfu", ["--smoke", "--backends", "auto", "nope"], ["--backends nope: unknown"]),
    ("train_mfu", ["--smoke", "--preset", "nope"], ["trainer flags rejected", "unknown preset 'nope'"]),
    # counts that must be positive (or >= 0)
    ("heatmap_scale", ["--layers", "0"], ["--layers 0: must be >= 1"]),
    ("heatmap_scale", ["--experts", "0"], ["--experts 0: must be >= 1"]),
    ("heatmap_scale", ["--steps", "-3"], ["--steps -3: must be >= 1"]),
    ("generate", ["--repeats", "0"], ["--repeats 0: must be >= 1"]),
    ("generate", ["--warmup", "-1"], ["--warmup -1: must be >= 0"]),
    ("dispatch_bandwidth", ["--tokens", "64", "0"], ["--tokens 0: must be >= 1"]),
    ("moe_layer", ["--warmup", "-1"], ["--warmup -1: must be >= 0"]),
    ("moe_layer", ["--repeats", "0"], ["--repeats 0: must be >= 1"]),
    ("profile_step", ["--steps", "0"], ["--steps 0: must be >= 1"]),
    ("ac_memory", ["--layers", "0"], ["--layers 0: must be >= 1"]),
    ("ac_memory", ["--seq-len", "5000"], ["--seq-len 5000: exceeds mixtral-tiny's max_seq_len 256"]),
    ("ep_overlap", ["--tokens", "0"], ["--tokens 0: must be >= 1"]),
    ("ep_overlap", ["--top-k", "17"], ["--top-k 17: must be <= --experts 16"]),
    ("ep_overlap", ["--world", "3"], ["--world 3: must be >= 2 and divide --experts 16"]),
    ("upcycle_memory", ["--layers", "0"], ["--layers 0: must be >= 1"]),
    ("upcycle_memory", ["--granularity", "3"], ["--granularity 3 must divide --ffn 4096 and --experts 8"]),
    ("upcycle_memory", ["--world", "3"], ["--fsdp 2 must divide --world 3"]),
    ("upcycle_memory", ["--out", "{DIR}"], ["--out {DIR}: is a directory"]),
    ("expert_threads", ["--tokens", "0"], ["--tokens 0: must be >= 1"]),
    ("cpu_fusion", ["--warmup", "-1"], ["--warmup -1: must be >= 0"]),
    ("cpu_layer", ["--tokens", "0"], ["--tokens 0: must be >= 1"]),
    ("cpu_layer", ["--threads", "-1"], ["--threads -1: must be >= 0"]),
    ("all_to_all", ["--top-k", "0"], ["--top-k 0: must be >= 1"]),
    ("train_mfu", ["--smoke", "--timeout", "0"], ["--timeout 0.0: must be > 0"]),
    ("train_mfu", ["--smoke", "--peak-tflops", "-1"], ["--peak-tflops -1.0: must be > 0"]),
    # output paths: a directory, a path under a file, a folder that refuses files
    ("dispatch_bandwidth", ["--out", "{DIR}"], ["--out {DIR}: is a directory; give a file path"]),
    ("dispatch_bandwidth", ["--out", "{FILE}/x.json"], ["--out {FILE}/x.json: {FILE} is a file, not a directory"]),
    ("dispatch_bandwidth", ["--out", "{RO}/sub/x.json"], ["--out {RO}/sub/x.json: cannot write in {RO}",
                                                          "Read-only file system"]),
    ("moe_layer", ["--out", "{RO}/x.json"], ["--out {RO}/x.json: cannot write in {RO}"]),
    ("generate", ["--out", "{DIR}"], ["--out {DIR}: is a directory"]),
    ("profile_step", ["--out-dir", "{FILE}"], ["--out-dir {FILE}: is a file; give a folder path"]),
    ("profile_step", ["--out-dir", "{RO}/profile"], ["--out-dir {RO}/profile: cannot write in {RO}"]),
    ("train_mfu", ["--smoke", "--out", "{FILE}/t.json"], ["--out {FILE}/t.json: {FILE} is a file"]),
    ("train_mfu", ["--smoke", "--run-root", "{FILE}"], ["--run-root {FILE}: is a file"]),
    ("heatmap_scale", ["--json", "{DIR}"], ["--json {DIR}: is a directory"]),
    ("heatmap_scale", ["--keep", "{FILE}"], ["--keep {FILE}: is a file"]),
    ("ac_memory", ["--json", "{RO}/a.json"], ["--json {RO}/a.json: cannot write in {RO}"]),
    ("ep_overlap", ["--out", "{DIR}"], ["--out {DIR}: is a directory"]),
    ("all_to_all", ["--out", "{DIR}"], ["--out {DIR}: is a directory"]),
    ("expert_threads", ["--out", "{FILE}/e.json"], ["--out {FILE}/e.json: {FILE} is a file"]),
    ("cpu_fusion", ["--out", "{DIR}"], ["--out {DIR}: is a directory"]),
    ("cpu_layer", ["--out", "{RO}/c.json"], ["--out {RO}/c.json: cannot write in {RO}"]),
    ("cpu_train", ["--json", "{DIR}"], ["--json {DIR}: is a directory", "cpu_train.json"]),
    ("tune_kernels", ["--out", "{FILE}/t.json"], ["--out {FILE}/t.json: {FILE} is a file"]),
])
def test_bad_values_are_one_line_before_any_work(script, argv, words, place, capsys):
    main = importlib.import_module(f"moekit.bench.{script}").main
    assert exit_status(main, [a.format(**place) for a in argv]) == 2
    line = one_stderr_line(capsys, *(w.format(**place) for w in words))
    assert line.startswith(f"{script}.py: error: "), line


def test_all_to_all_checks_ranks_per_node_before_spawning(place, capsys, monkeypatch):
    """--ranks-per-node that does not divide --world: one line from the parent, not one per spawned rank followed
    by torch.multiprocessing's ProcessExitedException traceback."""
    from moekit.bench import all_to_all

    monkeypatch.setattr(all_to_all, "launch_ranks", lambda *a: pytest.fail("ranks spawned before the check"))
    argv = ["--world", "2", "--ranks-per-node", "3", "--experts", "4", "--top-k", "2"]
    assert exit_status(all_to_all.main, argv) == 2
    one_stderr_line(capsys, "--ranks-per-node 3: each must divide --world 2")
    assert exit_status(all_to_all.main, ["--world", "2", "--experts", "3", "--top-k", "2"]) == 2
    one_stderr_line(capsys, "--experts 3 must be divisible by --world 2")


def test_check_out_accepts_a_new_folder_and_creates_nothing(tmp_path):
    """Missing folders on the way are fine (write_json makes them) and the check itself leaves nothing behind."""
    p = benchlib.BenchParser(prog="x.py")
    benchlib.check_out(p, tmp_path / "a" / "b" / "r.json")
    benchlib.check_out(p, tmp_path / "new", "--out-dir", folder=True)
    benchlib.check_out(p, tmp_path, "--out-dir", folder=True)
    assert list(tmp_path.iterdir()) == []


def test_bench_parser_names_the_script_and_prints_one_line(capsys):
    p = benchlib.BenchParser()
    p.add_argument("--n", type=int)
    with pytest.raises(SystemExit) as exc:
        p.parse_args(["--n", "x"])
    assert exc.value.code == 2
    one_stderr_line(capsys, "test_bench_inputs.py: error: argument --n: invalid int value: 'x' (see --help)")


UNUSABLE_BACKEND_SCRIPTS = ["ac_memory", "profile_step"]

# Each script as a program (runpy, __main__, its own argv), its stderr and exit status kept apart: one interpreter
# for all of them instead of one each.
_AS_PROGRAMS = """
import contextlib, io, json, runpy, sys
seen = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--preset", "mixtral-tiny", "--expert-backend", "triton"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
            status = 0
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    seen[path] = [status, err.getvalue()]
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def unusable_backend_runs(tmp_path_factory):
    """--expert-backend triton on CPU without the interpreter, every script of UNUSABLE_BACKEND_SCRIPTS in one
    subprocess (the tests' own process runs Triton in the interpreter), in an empty working folder:
    (script -> (exit status, stderr), the folder)."""
    if torch.cuda.is_available():
        pytest.skip("triton runs here")
    cwd = tmp_path_factory.mktemp("unusable_backend")
    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(repo))
    paths = {script: str(repo / "tools/bench" / f"{script}.py") for script in UNUSABLE_BACKEND_SCRIPTS}
    proc = subprocess.run([sys.executable, "-c", _AS_PROGRAMS, *paths.values()], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stdout[-2000:] + proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    return {script: tuple(seen[path]) for script, path in paths.items()}, cwd


@pytest.mark.parametrize("script", UNUSABLE_BACKEND_SCRIPTS)
def test_unusable_expert_backend_is_one_line(script, unusable_backend_runs):
    """--expert-backend triton on CPU without the interpreter: resolve_backend's reason in one line, exit 2, before
    the model is built (a subprocess: the tests' own process runs Triton in the interpreter)."""
    runs, cwd = unusable_backend_runs
    status, stderr = runs[script]
    err = stderr.strip().splitlines()
    assert status == 2 and len(err) == 1, stderr[-2000:]
    assert err[0].startswith(f"{script}.py: error: --expert-backend triton: expert backend 'triton' cannot run on cpu")
    assert list(cwd.iterdir()) == []
