"""tools/bench/gpu_suite.sh --smoke runs every issue-9 benchmark end to end on CPU and returns what the
GPU session will read: few enough files for the device tool, each benchmark's JSON with its keys."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "tools" / "bench" / "gpu_suite.sh"


def run_suite(tmp_path: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUT=str(tmp_path / "out"), BENCH_RAW=str(tmp_path / "raw"), PYTHON=sys.executable,
               OMP_NUM_THREADS="1")
    return subprocess.run(["bash", str(SUITE), *args], env=env, capture_output=True, text=True, timeout=timeout)


DEFAULT_STEPS = ["env", "tests", "moe_layer", "grouped_gemm", "dispatch", "profile", "train_mfu"]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One --smoke run of the default steps with train_mfu_tma for train_mfu (the same script, with MOEKIT_TMA=never
    and always; one train_mfu run less keeps CI's time), lm_loss, and the non-default tune step: the tests below read
    its files (one suite start-up, summary and pack instead of one per test)."""
    tmp_path = tmp_path_factory.mktemp("gpu_suite_smoke")
    proc = run_suite(tmp_path, "--smoke", *DEFAULT_STEPS[:-1], "train_mfu_tma", "lm_loss", "tune", timeout=480)
    return tmp_path, proc


def test_gpu_suite_smoke_runs_every_benchmark(tmp_path, smoke_run):
    listing = run_suite(tmp_path, "--list", timeout=60).stdout
    listed = {line.split()[0] for line in listing.splitlines() if line[:1].strip()}
    assert set(DEFAULT_STEPS) | {"train_mfu_tma", "grouped_gemm_quick"} <= listed, listing
    tmp_path, proc = smoke_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out, raw = tmp_path / "out", tmp_path / "raw"
    # the device tool brings back at most 8 files, 2 folders deep: the suite leaves 4 at the top
    assert sorted(p.name for p in out.iterdir()) == ["results.tar.gz", "suite.log", "summary.json", "summary.txt"]
    with tarfile.open(out / "results.tar.gz") as tar:
        packed = set(tar.getnames())
    assert {"./moe_layer.json", "./grouped_gemm.json", "./dispatch_bandwidth.json", "./profile/profile_step.json",
            "./profile/trace.json.gz", "./env.txt", "./lm_loss.json"} <= packed
    summary = (out / "summary.txt").read_text()
    steps = ["env", "moe_layer", "grouped_gemm", "dispatch", "profile"]
    has_mfu = (REPO / "tools" / "bench" / "train_mfu.py").exists()
    for step in steps + (["train_mfu_tma"] if has_mfu else []):
        assert f"  {step}: ok" in summary, summary
    assert "issue 9 target" in summary and "titan-style" in summary
    assert "  lm_loss: ok" in summary and "N 48 H 16 V 100: fused " in summary, summary  # the fused loss's step
    if has_mfu:
        assert "MFU, auto-compile-off-notma " in summary and "MFU, auto-compile-off-tma " in summary, summary
    assert "issue 9 target" in (out / "suite.log").read_text()

    layer = json.loads((raw / "moe_layer.json").read_text())
    assert "partial" not in layer
    impls = {r["impl"] for r in layer["results"]}
    assert {"titan-style", "transformers[eager]"} <= impls and any(i.startswith("moekit[auto->") for i in impls)
    assert all(r["max_abs_err"] < 1e-5 and r["grad_rel_err_vs_fp32"] < 1e-5 for r in layer["results"])
    case = layer["cases"][0]
    assert set(case["phases_ms"]) == {"router", "permute", "experts", "combine"}
    assert case["host_syncs"]["router"] == "not checked (CPU)"
    assert 0.5 < case["activation_bytes"]["titan-style"]["ratio_to_minimum"] < 3

    gg = json.loads((raw / "grouped_gemm.json").read_text())
    assert gg["partial"] is False and gg["skew_ratios"]
    assert {"triton/torch_grouped:fwd_bwd", "triton/loop:fwd"} <= set(gg["rows"][0]["ratios"])
    assert {"device", "torch", "triton"} <= set(gg["meta"])
    assert {r["workload"] for r in gg["rows"]} == {"gemm1", "mlp"}
    for r in gg["rows"]:
        assert "tflops" in r["results"]["triton"]["fwd_bwd"], r["results"]["triton"]
        assert "triton/loop:fwd" in r["ratios"]
        # the weight gradient's TMA variant is a peer wherever it runs (the interpreter models descriptors)
        assert "tflops" in r["results"]["triton_tma"]["fwd_bwd"] and "triton/triton_tma:fwd_bwd" in r["ratios"]

    bw = json.loads((raw / "dispatch_bandwidth.json").read_text())
    ops = {(r["op"], r["impl"]): r for r in bw["results"]}
    assert {op for op, _ in ops} == {"dispatch_fwd", "dispatch_bwd", "combine_fwd", "combine_bwd", "dispatch_meta"}
    assert ops[("dispatch_fwd", "moekit")]["rel_diff_vs_torch"] == 0  # the permute is exactly the gather
    assert ops[("combine_bwd", "copy")]["vs_copy"] == pytest.approx(1.0)

    prof = json.loads((raw / "profile" / "profile_step.json").read_text())
    share = {c["category"]: c["share"] for c in prof["categories"]}
    assert sum(share.values()) == pytest.approx(1.0)
    for cat in ("attention", "expert_gemm", "router", "permute_unpermute", "norm", "optimizer"):
        assert share[cat] > 0, share
    assert share["other"] < 0.1, share  # backward work found its forward category through the sequence number


def test_gpu_suite_budget_skips_what_does_not_fit(tmp_path):
    proc = run_suite(tmp_path, "--smoke", "--budget", "10", "moe_layer", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "moe_layer: skipped (budget" in (tmp_path / "out" / "summary.txt").read_text()


def test_gpu_suite_rejects_bad_arguments(tmp_path):
    proc = run_suite(tmp_path, "--smoke", "no_such_step", timeout=60)
    assert proc.returncode == 2 and "unknown step 'no_such_step'" in proc.stderr
    listing = run_suite(tmp_path, "--list", timeout=60)
    assert listing.returncode == 0 and "train_mfu_full" in listing.stdout
    # the A / B steps of the next device session (run by hand with --smoke when they were added: 28 s together)
    listed = {line.split()[0] for line in listing.stdout.splitlines() if line[:1].strip()}
    assert {"train_mfu_ab", "train_mfu_fused", "linear_attention_scan", "grouped_gemm_mixtral1b", "lm_loss",
            "batch_generate"} <= listed


def test_gpu_suite_without_gpu_asks_for_smoke(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = run_suite(tmp_path, "env", timeout=120)
    assert proc.returncode == 2 and "--smoke" in proc.stderr and not (tmp_path / "raw").exists()


def test_gpu_tier_runs_on_cpu_against_its_references(tmp_path):
    """The GPU tier (tests/test_gpu.py) with MOEKIT_GPU_TESTS_ON=cpu: Triton in the interpreter at tiny sizes.
    CI has no GPU, so this is what keeps the tier's own logic (references, tolerances, shapes) from rotting
    between GPU sessions; the CUDA-only cases (sync debug mode, NCCL FSDP, inductor) stay skipped."""
    env = dict(os.environ, MOEKIT_GPU_TESTS_ON="cpu", TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           str(REPO / "tests" / "test_gpu.py")], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


def test_gpu_tier_on_cpu_runs_each_parameter_value_and_all_on_request(monkeypatch):
    """conftest's sampling of the tier on CPU: per test, a few cases that between them hold every parameter
    value (set cover), tests without parameters and tests outside the tier untouched; 'all' keeps everything;
    on CUDA nothing is sampled; a bad MOEKIT_GPU_TIER_CASES is a usage error that names it."""
    import itertools
    from types import SimpleNamespace

    from tests import conftest

    def item(name, gpu=True, **params):
        return SimpleNamespace(originalname=name, callspec=SimpleNamespace(params=params) if params else None,
                               get_closest_marker=lambda marker: object() if gpu and marker == "gpu" else None)

    grid = [item("t_mm", gather=g, layout=lay, dtype=d)
            for g, lay, d in itertools.product([False, True], ["ragged", "one_hot", "empty"], ["f32", "bf16", "f16"])]
    rest = [item("t_plain"), item("t_case", case=0), item("t_case", case=1), item("t_cpu", gpu=False, x=1),
            item("t_cpu", gpu=False, x=1)]

    def sample(mode, on="cpu"):
        monkeypatch.setenv("MOEKIT_GPU_TESTS_ON", on)
        monkeypatch.setenv("MOEKIT_GPU_TIER_CASES", mode)
        items, deselected = grid + rest, []
        config = SimpleNamespace(hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)))
        conftest.pytest_collection_modifyitems(config, items)
        assert len(items) + len(deselected) == len(grid) + len(rest)
        return items

    kept = sample("cover")
    mm = [i.callspec.params for i in kept if i.originalname == "t_mm"]
    assert len(mm) == 3  # 3 layouts x 3 dtypes x 2 gathers: three cases hold every value
    for name in ("gather", "layout", "dtype"):
        assert {p[name] for p in mm} == {p.callspec.params[name] for p in grid}
    assert [i for i in kept if i.originalname != "t_mm"] == rest
    assert len(sample("all")) == len(sample("cover", on="cuda")) == len(grid) + len(rest)
    with pytest.raises(pytest.UsageError, match="MOEKIT_GPU_TIER_CASES='some'"):
        sample("some")


def test_cover_marked_cross_products_hold_every_value_and_are_repaired_by_the_seed(monkeypatch):
    """tests marked ``cover`` (CPU too): every parameter value in the cases kept, other tests untouched; the same
    seed keeps the same cases, other seeds other pairings (so, over runs, every pairing runs); MOEKIT_TEST_CASES=all
    keeps every case; a bad value is a usage error naming it."""
    import itertools
    from types import SimpleNamespace

    from tests import conftest

    def item(name, cover=True, **params):
        return SimpleNamespace(originalname=name, callspec=SimpleNamespace(params=params),
                               get_closest_marker=lambda marker: object() if cover and marker == "cover" else None)

    grid = [item("t_x", a=a, b=b) for a, b in itertools.product(range(4), "xyz")]
    plain = [item("t_plain", cover=False, a=a) for a in range(3)]

    def kept(seed, mode="cover"):
        monkeypatch.setenv("MOEKIT_TEST_SEED", str(seed))
        monkeypatch.setenv("MOEKIT_TEST_CASES", mode)
        monkeypatch.delenv("MOEKIT_GPU_TESTS_ON", raising=False)
        items = grid + plain
        config = SimpleNamespace(hook=SimpleNamespace(pytest_deselected=lambda items: None))
        conftest.pytest_collection_modifyitems(config, items)
        return [(i.callspec.params["a"], i.callspec.params["b"]) for i in items if i.originalname == "t_x"], items

    pairs, items = kept(1)
    assert len(pairs) == 4 and {a for a, _ in pairs} == set(range(4)) and {b for _, b in pairs} == set("xyz")
    assert items[-3:] == plain and kept(1)[0] == pairs
    assert len({tuple(sorted(kept(seed)[0])) for seed in range(12)}) > 1  # re-paired by the seed
    assert len(kept(1, "all")[0]) == len(grid)
    with pytest.raises(pytest.UsageError, match="MOEKIT_TEST_CASES='most'"):
        kept(1, "most")


def test_gpu_suite_tune_step_sweeps_every_kernel_call(smoke_run):
    """The non-default 'tune' step (tools/bench/tune_kernels.py): every expert-MLP kernel call is timed as
    autotuned today and with pinned candidates; the JSON names the winners per kernel. (It runs last in the module's
    smoke run; the tune JSON is packed too.)"""
    tmp_path, proc = smoke_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "  tune: ok" in summary and "tile-config sweep" in summary and "winners _grouped_mm_wgrad_kernel" in summary
    with tarfile.open(tmp_path / "out" / "results.tar.gz") as tar:
        assert "./tune_kernels.json" in tar.getnames()
    tune = json.loads((tmp_path / "raw" / "tune_kernels.json").read_text())
    assert tune["partial"] is False
    calls = {r["call"] for r in tune["results"]}
    assert calls == {"up_act", "down", "down_dact", "dx", "wgrad_in", "wgrad_out"}
    for r in tune["results"]:
        assert r["current_ms"] > 0 and len(r["candidates"]) == 2 and all("ms" in c for c in r["candidates"]), r
        assert r["best_ms"] == min(c["ms"] for c in r["candidates"])
    assert set(tune["winners"]) == {"_expert_up_act_kernel", "_grouped_mm_kernel", "_expert_down_dact_kernel",
                                    "_grouped_mm_wgrad_kernel"}


def test_tune_kernels_precompile_plan_covers_each_binary_once():
    """The precompile workers' work list: one entry per (expert-count class, call, config), so shapes sharing
    E share binaries, dx (unit-stride transposed weight) is not taken for down, and the workers' row count
    keeps the real rows' divisibility by 16 (Triton specialises integer arguments on it)."""
    import torch

    from moekit.bench import tune_kernels as tk
    from moekit.moe.kernels._common import parse_config

    shapes = {s: tk.SHAPES[s] for s in ("fine-grained", "qwen3-30b-a3b", "mixtral-1b")}
    items = tk.compile_items(shapes, tk.CALLS, torch.bfloat16, wide=False)
    per_call = {c: len(tk.candidates(tk.KERNEL_OF[c], torch.bfloat16, False)) for c in tk.CALLS}
    assert len(items) == 2 * sum(per_call.values())  # two E classes (128, 8); qwen3 adds nothing to fine-grained
    assert {s for s, _, _ in items} == {"fine-grained", "mixtral-1b"}
    assert sum(1 for s, c, _ in items if c == "dx") == sum(1 for s, c, _ in items if c == "down") == 2 * per_call["dx"]
    assert len(set(items)) == len(items)
    for tokens, k in ((8192, 8), (8192, 2), (1001, 2), (1001, 16), (3, 5)):
        t = tk.worker_tokens(tokens, k)
        assert ((t * k) % 16 == 0) == ((tokens * k) % 16 == 0) and t <= tokens
    # the sweep's spelling of a config is what MOEKIT_KERNEL_CONFIGS reads back
    for c in tk.candidates(tk.KERNEL_OF["wgrad_in"], torch.bfloat16, wide=True):
        again = parse_config(tk.describe(c))
        assert again.kwargs == c.kwargs and (again.num_warps, again.num_stages) == (c.num_warps, c.num_stages)


def test_tune_kernels_refuses_bad_flags_and_a_box_without_gpu(tmp_path, capsys, monkeypatch):
    """In this process (the script as a program: the suite's tune step above). Without --smoke the interpreter does
    not count, so the refusal here is the one a box without a GPU gets whatever TRITON_INTERPRET says."""
    from moekit.bench import tune_kernels

    monkeypatch.chdir(tmp_path)  # the default --out, bench-results/tune_kernels.json, is relative
    with pytest.raises(SystemExit) as bad:
        tune_kernels.main(["--shapes", "gpt5"])
    assert bad.value.code == 2 and "--shapes gpt5: unknown" in capsys.readouterr().err
    if not __import__("torch").cuda.is_available():
        assert tune_kernels.main([]) == 2 and "needs a CUDA GPU" in capsys.readouterr().err
        assert list(tmp_path.iterdir()) == []  # refused before anything is written


def test_profile_auto_preset_is_train_mfus_model():
    """profile_step --preset auto profiles the ~1B model train_mfu measures on a GPU (a name match once picked
    ernie-4.5-21b-a3b, which ran out of an H100's memory), mixtral-tiny on the CPU."""
    import torch

    from moekit.bench import profile_step, train_mfu

    assert profile_step.pick_preset("auto", torch.device("cuda")) == train_mfu.GPU["preset"] == "mixtral-1b"
    assert profile_step.pick_preset("auto", torch.device("cpu")) == "mixtral-tiny"
    assert profile_step.pick_preset("deepseek-tiny", torch.device("cuda")) == "deepseek-tiny"
