"""Tooling around moe.kernels, each in a subprocess: the offline sm90 compile check and the GEMM
benchmark's refusal without a GPU (its smoke run: tests/test_bench_gpu_suite.py). Kept apart from
tests/test_kernels.py (the numerics) because these are slower (the first cold sm90 compile is ~20 s)
and test the tools, not the maths."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


GEMMS = ["_grouped_mm_kernel", "_grouped_mm_wgrad_kernel", "_expert_up_act_kernel", "_expert_down_dact_kernel"]


# The combine's launch variants (both dtypes; k in a single chunk and past it; each backward output alone), lowered
# to sm90 as moe.kernels._compile_check does; prints each one's 16-byte load and store counts. Run after the check,
# in its process (tests/test_combine_kernel.py holds the combine's numerics).
_COMBINE_COMPILE = """
import torch, triton
from triton.backends.compiler import GPUTarget
from moekit.moe.kernels import _common
from moekit.moe.kernels._compile_check import _signature
from moekit.moe.kernels.combine import combine_rows, combine_rows_backward

captured = _common.CAPTURE = []
for dtype in (torch.bfloat16, torch.float32):
    for k in (2, 20):
        T, N, H = 64, 100, 2048
        rows, g = torch.randn(N, H, dtype=dtype), torch.randn(T, H, dtype=dtype)
        slots, w = torch.randint(0, N, (T * k,)), torch.rand(T, k)
        combine_rows(rows, slots, w, T, k)
        combine_rows(rows, slots, None, T, k)
        combine_rows_backward(g, rows, w, slots)
        combine_rows_backward(g, rows, w, slots, need_grad_weights=False)
        combine_rows_backward(g, rows, w, slots, need_grad_rows=False)
_common.CAPTURE = None
for kernel, args, kwargs in captured:
    config = kernel.configs[0]
    jit, sig, constexprs, attrs = _signature(kernel, args, kwargs, config)
    src = triton.compiler.ASTSource(fn=jit, signature=sig, constexprs=constexprs, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": config.num_warps}).asm["ptx"]
    print("ok", kernel.name, int(kwargs.get("NEED_GR", 1)), int(kwargs.get("NEED_GW", 1)), ptx.count("ld.global.v4"),
          ptx.count("st.global.v4"))
"""
COMBINE_MARK = "=== the combine's launch variants"

# `python -m moekit.moe.kernels._compile_check --quick --first-for GEMMS`, then the combine's variants, in one process.
# ptxas -v (register_use: a second ptxas run per variant, after the one triton.compile builds the cubin with; most of
# the check's time) runs where a test reads its report, the GEMMs' lines; every other variant is compiled all the
# same, its line without the regs= field.
_SM90_RUN = """
import sys
from moekit.moe.kernels import _compile_check as cc

gemms = sys.argv[1:]
current = []
signature, register_use = cc._signature, cc.register_use

def named_signature(kernel, *args):
    current[:] = [kernel.name]
    return signature(kernel, *args)

cc._signature = named_signature
cc.register_use = lambda ptx, arch: register_use(ptx, arch) if current and current[0] in gemms else ""
rc = cc.main(["--quick", "--first-for", *gemms])
cc._signature, cc.register_use = signature, register_use
if rc:
    sys.exit(rc)
print(%r, flush=True)
""" % COMBINE_MARK + _COMBINE_COMPILE


@pytest.fixture(scope="module")
def sm90_run():
    """One subprocess without TRITON_INTERPRET lowers every kernel to sm90 cubin with Triton's bundled ptxas (no GPU
    needed), bf16 and fp32: the four GEMMs at their first (tuned best) config, the others at their smallest; then the
    combine's launch variants. The tests below read it (one compile run instead of three: a minute less on a cold
    Triton cache, as in CI). Returns (the compile check's output, the combine's)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences Triton 3.9's default-change warning
    proc = subprocess.run([sys.executable, "-c", _SM90_RUN, *GEMMS], env=env, capture_output=True, text=True,
                          timeout=400)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("this Triton build ships no ptxas")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check, mark, combine = proc.stdout.partition(COMBINE_MARK + "\n")
    assert mark, proc.stdout
    return check, combine


@pytest.fixture(scope="module")
def sm90_compile(sm90_run):
    return sm90_run[0]


def test_kernels_compile_for_sm90(sm90_compile):
    """Code the interpreter accepts but the compiler rejects fails here."""
    for name in ("_grouped_mm_kernel", "_grouped_mm_wgrad_kernel", "_segment_sum_rows_kernel",
                 "_expert_up_act_kernel", "_expert_down_dact_kernel", "_combine_fwd_kernel", "_combine_bwd_kernel",
                 "_rope_kernel", "_topk_route_fwd_kernel", "_topk_route_bwd_kernel", "_grouped_colsum_kernel",
                 "_cross_entropy_kernel", "_delta_scan_fwd_kernel", "_delta_scan_bwd_kernel"):
        assert f"ok {name}" in sm90_compile, sm90_compile
    # The GEMM main loops must be software-pipelined (async copies into multi-buffered smem);
    # losing that (e.g. to a pointer/stride pattern Triton cannot prove aligned) costs ~2x on GPU.
    # (The row-copy kernels, segment sum, combine, RoPE, the router, the bias gradient's column sum and the
    # cross-entropy's two passes over a row have no K loop to pipeline; the delta-rule scan's loop over chunks
    # carries its state in registers, with num_stages=1: nothing to pipeline.)
    gemm_lines = [ln for ln in sm90_compile.splitlines()
                  if ln.startswith("ok ")
                  and not any(n in ln for n in ("_segment_sum", "_combine_", "_rope_", "_topk_route_", "_grouped_colsum",
                                               "_cross_entropy_", "_delta_scan_"))]
    assert gemm_lines and all("pipelined=True" in ln for ln in gemm_lines), sm90_compile


def test_tuned_first_configs_do_not_spill_registers(sm90_compile):
    """The first config each GEMM kernel keeps (the tuned best), compiled for sm90: ptxas -v must report at most
    a few bytes of spill stores (bf16: none under Triton 3.9, 8 in down_dact's TMA variant under 3.6, the GPU
    image's version; fp32: up to 56). The down_dact epilogue spilled 830-940 bytes
    per thread at 128 x 128 before it was split into column quarters, and fp32's first configs spilled
    24-41 KB (the FMA dot) before the prune bounded their accumulators; a change that brings spills back
    would cost GPU speed without failing anything the interpreter can see."""
    lines = [ln for ln in sm90_compile.splitlines() if ln.startswith("ok ") and ln.split()[1] in GEMMS]
    assert {ln.split()[1] for ln in lines} == set(GEMMS), sm90_compile
    assert {" bfloat16 ", " float32 "} <= {d for ln in lines for d in (" bfloat16 ", " float32 ") if d in ln}
    if not all("regs=" in ln for ln in lines) or any("regs=?" in ln for ln in lines):
        pytest.skip("this Triton's ptxas gives no register report")

    def spilled(ln: str) -> int:
        return int(ln.split("spills=")[1].split()[0])

    spilling = [ln for ln in lines if spilled(ln) > (64 if " float32 " in ln else 16)]
    assert not spilling, "\n".join(spilling)


def test_combine_kernels_compile_for_sm90_with_vector_loads(sm90_run):
    """Every launch variant of the combine lowered to sm90 (no GPU needed, as the check above does for the
    GEMMs), catching code the interpreter accepts but the compiler rejects; every variant must move rows with
    16-byte vector loads / stores."""
    combine = sm90_run[1]
    lines = [ln.split() for ln in combine.splitlines() if ln.startswith("ok ")]
    assert len(lines) == 20, combine
    for _, name, *counts in lines:  # forward: rows in, out out; backward: rows in (grad_w), grad_rows out
        writes_rows, reads_rows, v4_loads, v4_stores = map(int, counts)
        assert (v4_stores > 0 or not writes_rows) and (v4_loads > 0 or not reads_rows), combine


def test_benchmark_refuses_a_box_without_gpu_unless_smoke():
    """tools/bench/grouped_gemm.py outside --smoke and the interpreter needs CUDA, and says so. (Its --smoke run
    and JSON: tests/test_bench_gpu_suite.py, which runs it as the suite's grouped_gemm step.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    refused = subprocess.run([sys.executable, str(REPO / "tools/bench/grouped_gemm.py")], env=env,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "needs a CUDA GPU" in refused.stderr


@pytest.mark.parametrize("argv,words", [
    (["--shapes", "nope"], "--shapes nope: unknown; choose from mixtral-8x7b"),
    (["--tokens", "0"], "--tokens '0': not a token count"),
    (["--tokens", "8192,abc"], "--tokens 'abc': not a token count"),
    (["--routings", "foo"], "--routings foo: unknown; choose from uniform, zipf1.2, onehot"),
    (["--workloads", "gemm2"], "--workloads gemm2: unknown"),
    (["--rounds", "0"], "--rounds 0: must be >= 1"),
    (["--out", "{tmp}"], "--out {tmp}: is a directory"),
])
@pytest.mark.parametrize("smoke", [True, False])
def test_grouped_gemm_checks_flags_with_or_without_smoke(argv, words, smoke, tmp_path, capsys):
    """A bad --shapes / --tokens / --routings is an error whether or not --smoke (which replaces them) is on, and
    before the GPU check: one line, exit 2, nothing written."""
    from moekit.bench import grouped_gemm

    argv = [a.format(tmp=tmp_path) for a in argv] + ["--smoke"] * smoke
    with pytest.raises(SystemExit) as exc:
        grouped_gemm.main(argv + ([] if "--out" in argv else ["--out", str(tmp_path / "g.json")]))
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and words.format(tmp=tmp_path) in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_grouped_gemm_smoke_notes_the_flags_it_overrides(tmp_path, capsys):
    """Valid --shapes / --tokens / --dtype under --smoke on CPU: the run goes on with its own tiny case and says,
    in one note line, which flags it did not use. (In this process, whose Triton runs in the interpreter where there
    is no GPU, as --smoke on CPU needs; the script as a program: the suite's grouped_gemm step,
    tests/test_bench_gpu_suite.py.)"""
    from moekit.bench import grouped_gemm

    out = tmp_path / "g.json"
    assert grouped_gemm.main(["--smoke", "--shapes", "fine-grained", "--tokens", "64", "--workloads", "gemm1",
                              "--out", str(out)]) == 0
    err = capsys.readouterr().err
    notes = [ln for ln in err.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and "ignoring --shapes fine-grained, --tokens 64" in notes[0], err
    assert "--routings" not in notes[0] and "--dtype" not in notes[0]
    assert {r["shape"] for r in json.loads(out.read_text())["rows"]} == {"smoke"}
