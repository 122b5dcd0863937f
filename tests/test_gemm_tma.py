"""The persistent TMA variant of the grouped GEMM's forward / dX kernel (moe.kernels.grouped_mm.GEMM_TMA)
against the pointer kernel and a float64 loop: the same tiles and reduction order, so the same bits, over
ragged, empty and out-of-range experts, with more tiles than programs (each program walks several); where it
does not apply (a gather, float32, misaligned rows) the pointer kernel runs. CPU: the Triton interpreter,
which models the descriptors' bounds (zero fill past the expert's rows and the k / n tails)."""
from __future__ import annotations

import importlib
import os

import pytest
import torch

from moekit.moe.kernels import LAUNCHES
from moekit.moe.kernels._common import interpret_mode
from tests.helpers import BrokenLauncher, gen

G = importlib.import_module("moekit.moe.kernels.grouped_mm")  # the module (the package exports the function)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TMA, POINTER = "_grouped_mm_tma_kernel", "_grouped_mm_kernel"
pytestmark = pytest.mark.skipif(not (interpret_mode() or torch.cuda.is_available()),
                                reason="needs TRITON_INTERPRET=1 or a GPU")


def launches() -> tuple[int, int]:
    return LAUNCHES[TMA], LAUNCHES[POINTER]


@pytest.fixture
def tma(monkeypatch):
    monkeypatch.setattr(G, "GEMM_TMA", "always")
    monkeypatch.setattr(G, "_TMA_FAILURE", [])


def ref(x, w, offs, transpose_w=False):
    return G.grouped_mm_ref(x.double(), (w.transpose(1, 2) if transpose_w else w).double(), offs)


COUNTS = {"ragged": [5, 0, 133, 17, 0, 100, 1, 0, 44], "all-empty": [0, 0, 0], "one": [300],
          "tail-unowned": [0, 0, 290], "past-the-rows": [40, 400], "decreasing": [50, 20, 300]}


@pytest.mark.parametrize("counts,dtype", [(c, torch.bfloat16) for c in COUNTS.values()] + [(COUNTS["ragged"], torch.float16)],
                         ids=[f"{name}-bf16" for name in COUNTS] + ["ragged-fp16"])
def test_tma_forward_and_dx_equal_the_pointer_kernel_bit_for_bit(tma, monkeypatch, counts, dtype):
    g = gen("tma-fwd", counts, dtype)
    M, K, N = 300, 48, 80  # K, N not multiples of the tiles: the descriptors' bounds zero-fill the tails
    E = len(counts)
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    dy = torch.randn(M, N, generator=g).to(DEV, dtype)
    w = torch.randn(E, K, N, generator=g).to(DEV, dtype)
    if counts == COUNTS["decreasing"]:  # offsets as given, not a cumsum: 50, 20 (clamped to 50), 300
        offs = torch.tensor(counts, dtype=torch.int32, device=DEV)
    else:
        offs = torch.tensor(counts).cumsum(0).to(torch.int32).to(DEV)
    before = launches()
    got_y = G.grouped_mm_fwd(x, w, offs)
    got_dx = G.grouped_mm_fwd(dy, w, offs, transpose_w=True)  # dX reads W[e]^T through the stored [K, N]
    assert launches() == (before[0] + 2, before[1])
    monkeypatch.setattr(G, "GEMM_TMA", "never")
    want_y, want_dx = G.grouped_mm_fwd(x, w, offs), G.grouped_mm_fwd(dy, w, offs, transpose_w=True)
    assert torch.equal(got_y, want_y) and torch.equal(got_dx, want_dx)
    for got, r in ((got_y, ref(x, w, offs)), (got_dx, ref(dy, w, offs, transpose_w=True))):
        assert (got.double() - r).abs().max() <= 1e-2 * max(1.0, float(r.abs().max()))


def test_more_tiles_than_programs_each_tile_written_once(tma, monkeypatch):
    """Every program walks tiles pid, pid + programs, ...: a poisoned output shows any tile skipped, and the
    float64 reference any tile computed twice into the wrong rows. Programs 1, 2, 3, 7 over ~40 tiles."""
    g = gen("stride")
    M, K, N = 200, 32, 64
    counts = [30, 0, 70, 1, 64, 0]
    x = torch.randn(M, K, generator=g).to(DEV, torch.bfloat16)
    w = torch.randn(len(counts), K, N, generator=g).to(DEV, torch.bfloat16)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).to(DEV)
    want = ref(x, w, offs)
    for programs in (1, 2, 3, 7):
        with monkeypatch.context() as m:
            m.setattr(G, "_persistent_programs", lambda device, p=programs: p)
            m.setattr(torch, "empty", _poisoned(torch.empty))
            before = launches()
            got = G.grouped_mm_fwd(x, w, offs)
            assert launches() == (before[0] + 1, before[1])
        assert not torch.isnan(got).any(), programs
        assert (got.double() - want).abs().max() <= 1e-2 * float(want.abs().max()), programs
        assert torch.equal(got[sum(counts):], torch.zeros_like(got[sum(counts):])), programs  # unowned rows: zeros


def _poisoned(empty):
    def fill(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    return fill


def test_autograd_runs_the_tma_kernel_for_y_and_dx(tma, monkeypatch):
    g = gen("autograd")
    counts = [17, 0, 60, 3]
    x = torch.randn(80, 32, generator=g).to(DEV, torch.bfloat16).requires_grad_()
    w = torch.randn(4, 32, 48, generator=g).to(DEV, torch.bfloat16).requires_grad_()
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).to(DEV)
    grad = torch.randn(80, 48, generator=g).to(DEV, torch.bfloat16)
    before = launches()
    y = G.grouped_mm(x, w, offs, backend="triton")
    dx, dw = torch.autograd.grad(y, (x, w), grad)
    assert launches() == (before[0] + 2, before[1])  # forward and dX; dW is the wgrad kernel
    monkeypatch.setattr(G, "GEMM_TMA", "never")
    y2 = G.grouped_mm(x, w, offs, backend="triton")
    dx2, dw2 = torch.autograd.grad(y2, (x, w), grad)
    assert torch.equal(y, y2) and torch.equal(dx, dx2) and torch.equal(dw, dw2)


def test_auto_runs_the_variant_on_cuda_and_the_pointer_kernel_in_the_interpreter(monkeypatch):
    """MOEKIT_TMA unset is "auto": the TMA variants where they measured faster (CUDA; why_not_tma then asks for
    sm90+), the pointer kernels in the CPU interpreter, whose tests cover the variants with "always"."""
    from moekit.moe.kernels._tma import tma_wanted
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert tma_wanted("auto", cuda) and not tma_wanted("auto", cpu)
    assert tma_wanted("always", cpu) and not tma_wanted("never", cuda)
    monkeypatch.setattr(G, "GEMM_TMA", "auto")
    monkeypatch.setattr(G, "_TMA_FAILURE", [])
    g = gen("auto")
    x = torch.randn(40, 32, generator=g).to(DEV, torch.bfloat16)
    w = torch.randn(2, 32, 16, generator=g).to(DEV, torch.bfloat16)
    offs = torch.tensor([15, 40], dtype=torch.int32, device=DEV)
    before = launches()
    got = G.grouped_mm_fwd(x, w, offs)
    on_variant = DEV == "cuda" and torch.cuda.get_device_capability() >= (9, 0)
    assert launches() == ((before[0] + 1, before[1]) if on_variant else (before[0], before[1] + 1))
    want = ref(x, w, offs)
    assert (got.double() - want).abs().max() <= 1e-2 * float(want.abs().max())


def test_where_tma_does_not_apply_the_pointer_kernel_runs(tma):
    g = gen("fallback")
    w = torch.randn(2, 32, 16, generator=g).to(DEV, torch.bfloat16)
    offs = torch.tensor([20, 64], dtype=torch.int32, device=DEV)
    x = torch.randn(64, 32, generator=g).to(DEV, torch.bfloat16)
    gidx = torch.randperm(64, generator=g).to(DEV)
    odd = torch.randn(64, 33, generator=g).to(DEV, torch.bfloat16)[:, :32]  # rows of 66 bytes
    assert "gathered" in G.why_not_tma(x, w, gidx)
    assert "16-byte aligned rows" in G.why_not_tma(odd, w, None)
    assert "float32" in G.why_not_tma(x.float(), w.float(), None)
    for args, kwargs in (((x, w, offs, gidx), {}), ((odd, w, offs), {}), ((x.float(), w.float(), offs), {})):
        before = launches()
        got = G.grouped_mm_fwd(*args, **kwargs)
        assert launches() == (before[0], before[1] + 1)
        a, ww = args[0], args[1]
        want = ref(a if len(args) == 3 else a[args[3]], ww, offs)
        assert (got.double() - want).abs().max() <= 1e-2 * float(want.abs().max())


def test_a_tma_kernel_that_cannot_build_falls_back_once(tma, monkeypatch):
    monkeypatch.setattr(G, "GROUPED_MM_TMA", BrokenLauncher())
    x, w = torch.randn(32, 16).to(DEV, torch.bfloat16), torch.randn(2, 16, 16).to(DEV, torch.bfloat16)
    offs = torch.tensor([10, 32], dtype=torch.int32, device=DEV)
    with pytest.warns(UserWarning, match="TMA kernel failed to build here"):
        got = G.grouped_mm_fwd(x, w, offs)
    assert (got.double() - ref(x, w, offs)).abs().max() <= 1e-2 * float(ref(x, w, offs).abs().max())
    assert "simulated" in G.why_not_tma(x, w, None)  # remembered: no second try


def test_a_bad_mode_is_named(monkeypatch):
    monkeypatch.setattr(G, "GEMM_TMA", "sometimes")
    with pytest.raises(ValueError, match="GEMM_TMA='sometimes'; use one of auto, never, always"):
        G.grouped_mm_fwd(torch.randn(8, 16).to(DEV, torch.bfloat16), torch.randn(1, 16, 16).to(DEV, torch.bfloat16),
                         torch.tensor([8], dtype=torch.int32, device=DEV))


def test_moekit_tma_sets_every_switch_and_a_bad_value_names_the_variable(tmp_path):
    """MOEKIT_TMA=always starts the three TMA switches on (a benchmark or a training run flips them without code);
    a value that is neither never nor always fails on the first GEMM, naming the variable. The variable is read when
    the kernels are imported: one fresh interpreter imports them under each value in turn, the second time after
    dropping every moekit.moe module (torch and Triton, which read neither, stay loaded)."""
    import json
    import subprocess
    import sys

    probe = ("import importlib, json, os, sys, torch\n"
             "seen = {}\n"
             "for value in sys.argv[1:]:\n"
             "    os.environ['MOEKIT_TMA'] = value\n"
             "    for name in [m for m in sys.modules if m == 'moekit.moe' or m.startswith('moekit.moe.')]:\n"
             "        del sys.modules[name]\n"
             "    got, error = None, None\n"
             "    try:\n"
             "        G = importlib.import_module('moekit.moe.kernels.grouped_mm')\n"
             "        W = importlib.import_module('moekit.moe.kernels.grouped_mm_wgrad')\n"
             "        X = importlib.import_module('moekit.moe.kernels.expert_mlp')\n"
             "        got = [G.GEMM_TMA, W.WGRAD_TMA, X.MLP_TMA]\n"
             "        x, w = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(1, 16, 16, dtype=torch.bfloat16)\n"
             "        G.grouped_mm_fwd(x, w, torch.tensor([8], dtype=torch.int32))\n"
             "    except Exception as exc:\n"
             "        error = f'{type(exc).__name__}: {exc}'\n"
             "    seen[value] = {'switches': got, 'error': error}\n"
             "print(json.dumps(seen))\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("MOEKIT_TMA", None)
    out = subprocess.run([sys.executable, "-c", probe, " Always ", "yes"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    good, bad = seen[" Always "], seen["yes"]
    assert good == {"switches": ["always", "always", "always"], "error": None}, good
    assert bad["error"] and "GEMM_TMA='yes'; use one of auto, never, always (it came from MOEKIT_TMA='yes'" in \
        bad["error"], bad
    from moekit.moe.kernels._tma import tma_default  # unset or empty: auto (in this process: no new imports)

    for value in (None, ""):
        env_value = {} if value is None else {"MOEKIT_TMA": value}
        with pytest.MonkeyPatch.context() as m:
            m.delenv("MOEKIT_TMA", raising=False)
            for k, v in env_value.items():
                m.setenv(k, v)
            assert tma_default() == "auto"


# ---------------------------------------------------------------------------------------------------
# The fused expert MLP's kernels (moe.kernels.expert_mlp.MLP_TMA): descriptor loads in the up-projection +
# activation and the dact kernels, one program per tile as before
# ---------------------------------------------------------------------------------------------------

X = importlib.import_module("moekit.moe.kernels.expert_mlp")


def mlp_tma_launches() -> tuple[int, int]:
    return LAUNCHES["_expert_up_act_kernel:tma"], LAUNCHES["_expert_down_dact_kernel:tma"]


MLP_CASES = {"swiglu-24-ragged": ("swiglu", 24, [5, 0, 70, 17, 0, 33]), "swiglu-24-empty": ("swiglu", 24, [0, 0, 0]),
             "swiglu-40-past": ("swiglu", 40, [40, 100]), "gelu-40-ragged": ("gelu", 40, [5, 0, 70, 17, 0, 33]),
             "relu-24-past": ("relu", 24, [40, 100])}


@pytest.mark.cover  # each value's path every run, re-paired each run (tests/conftest.py)
@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gather"])
@pytest.mark.parametrize("activation,F,counts", MLP_CASES.values(), ids=MLP_CASES.keys())
def test_fused_mlp_with_tma_loads_equals_pointer_loads_bit_for_bit(monkeypatch, activation, F, counts, gather):
    """Forward and every gradient, TMA loads in all five GEMM kernels against all pointer loads. F = 24 with
    the interpreter's 32-column tiles: the gate tile's last strip reads into the up half, which the stores
    mask; past: counts beyond the rows. gather: the rows read from a 50-row x in place (gather_index, repeats
    and out-of-range entries), so the up kernel takes the weights alone through descriptors (tile_mm_tma_b), and
    each output row scaled (row_scale: the second GEMM's epilogue, the scale's gradient from the dact kernel's)."""
    monkeypatch.setattr(X, "_TMA_FAILURE", [])
    monkeypatch.setattr(G, "_TMA_FAILURE", [])
    g = gen("mlp", activation, F, counts, gather)
    M, H = 125, 48
    f_in = 2 * F if activation == "swiglu" else F
    index = scale = None
    if gather:
        index = torch.randint(-2, 52, (M,), generator=g).to(DEV)
        scale = torch.rand(M, generator=g).to(DEV).requires_grad_()
    x = torch.randn(50 if gather else M, H, generator=g).to(DEV, torch.bfloat16).requires_grad_()
    w_in = (torch.randn(len(counts), H, f_in, generator=g) * 0.2).to(DEV, torch.bfloat16).requires_grad_()
    w_out = (torch.randn(len(counts), F, H, generator=g) * 0.2).to(DEV, torch.bfloat16).requires_grad_()
    c = torch.tensor(counts, device=DEV)
    dy = torch.randn(M, H, generator=g).to(DEV, torch.bfloat16)
    results = {}
    for mode in ("never", "always"):
        for module, switch in ((X, "MLP_TMA"), (G, "GEMM_TMA"), (W, "WGRAD_TMA")):
            monkeypatch.setattr(module, switch, mode)
        before = mlp_tma_launches()
        y = X.expert_mlp(x, c, w_in, w_out, activation, variant="fused", gather_index=index, row_scale=scale)
        results[mode] = (y, *torch.autograd.grad(y, (x, w_in, w_out) + ((scale,) if gather else ()), dy))
        used = tuple(b - a for a, b in zip(before, mlp_tma_launches()))
        assert used == ((0, 0) if mode == "never" else (1, 1)), used  # no owned rows: it launches to zero them
    for name, a, b in zip(("y", "dx", "dw_in", "dw_out", "d_scale"), results["never"], results["always"]):
        assert torch.equal(a, b), f"{name}: max diff {(a.float() - b.float()).abs().max().item()}"
    rows = x if index is None else torch.cat([x, x.new_zeros(1, H)])[torch.where((index >= 0) & (index < 50), index, 50)]
    with torch.no_grad():
        ref = X.expert_mlp_ref(rows.double(), c, w_in.double(), w_out.double(), activation)
        if scale is not None:
            ref = ref * scale.double()[:, None]
    assert (results["always"][0].detach().double() - ref).abs().max() <= 2e-2 * max(1.0, float(ref.abs().max()))


W = importlib.import_module("moekit.moe.kernels.grouped_mm_wgrad")


def test_fused_mlp_tma_falls_back_where_it_cannot_run(monkeypatch):
    """float32 takes the pointer loads (no TMA launch); a build failure warns once and is remembered."""
    monkeypatch.setattr(X, "MLP_TMA", "always")
    monkeypatch.setattr(X, "_TMA_FAILURE", [])
    g = gen("mlp-fallback")
    x = torch.randn(40, 32, generator=g).to(DEV)
    w_in, w_out = torch.randn(2, 32, 32, generator=g).to(DEV), torch.randn(2, 16, 32, generator=g).to(DEV)
    c = torch.tensor([10, 30], device=DEV)
    before = mlp_tma_launches()
    y = X.expert_mlp(x, c, w_in, w_out, "swiglu", variant="fused")
    assert mlp_tma_launches() == before and "float32" in X.why_not_tma(x, w_in)
    torch.testing.assert_close(y, X.expert_mlp_ref(x, c, w_in, w_out, "swiglu"), rtol=1e-4, atol=1e-4)

    monkeypatch.setattr(X, "EXPERT_UP_ACT", BrokenLauncher(X.EXPERT_UP_ACT, only_tma=True))
    xb, wb_in, wb_out = x.bfloat16(), w_in.bfloat16(), w_out.bfloat16()
    with pytest.warns(UserWarning, match="expert_mlp: the TMA kernel failed to build here"):
        yb = X.expert_mlp(xb, c, wb_in, wb_out, "swiglu", variant="fused")
    assert "simulated" in X.why_not_tma(xb, wb_in)  # remembered: no second try
    ref = X.expert_mlp_ref(xb.double(), c, wb_in.double(), wb_out.double(), "swiglu")
    assert (yb.double() - ref).abs().max() <= 2e-2 * max(1.0, float(ref.abs().max()))


def test_try_tma_launch_treats_a_failing_compiler_pass_as_a_build_failure():
    """Triton reports a failing MLIR pass (a loop it cannot flatten in some version, say) as a RuntimeError
    "PassManager::run failed": the variant is then given up, as for a CompilationError. Any other runtime
    error (a CUDA fault) is not a build failure and propagates."""
    from moekit.moe.kernels._tma import try_tma_launch

    def failing(message):
        def launch():
            raise RuntimeError(message)
        return launch

    failures: list[str] = []
    with pytest.warns(UserWarning, match="demo: the TMA kernel failed to build here"):
        assert try_tma_launch(failing("PassManager::run failed"), failures, "demo") is False
    assert failures == ["RuntimeError: PassManager::run failed"]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        try_tma_launch(failing("CUDA error: an illegal memory access was encountered"), failures, "demo")
    assert try_tma_launch(lambda: None, failures, "demo") is True and len(failures) == 1


def test_the_tma_allocator_is_set_in_every_launching_thread():
    """Triton keeps its allocator in a ContextVar, which a new thread sees unset. On a GPU the backward
    kernels launch in autograd's device thread: an allocator set once in the main thread was missing there
    (the first GPU run of the fused MLP's TMA backward failed so). Each launching thread must get it."""
    import threading

    from triton.runtime import _allocation

    from moekit.moe.kernels._tma import set_tma_allocator
    dev = torch.device("cpu")
    set_tma_allocator(dev)
    assert _allocation._allocator.get()(16, 16, None).numel() == 16
    seen = []

    def launch_thread():
        set_tma_allocator(dev)
        seen.append(_allocation._allocator.get()(32, 16, None))

    t = threading.Thread(target=launch_thread)
    t.start()
    t.join()
    assert len(seen) == 1 and seen[0].numel() == 32 and seen[0].dtype == torch.int8
