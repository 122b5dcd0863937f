"""The TMA variant of the grouped weight-gradient kernel (moe.kernels.grouped_mm_wgrad.WGRAD_TMA) against
the pointer kernel and a float64 loop: same tiles and reduction order, so the same bits; ragged and
empty experts, offsets past the rows; where it does not apply (a gathered x, misaligned rows) the
pointer kernel runs. CPU: the Triton interpreter (which models the descriptors' zero fill)."""
from __future__ import annotations

import importlib

import pytest
import torch

from moekit.moe.kernels import LAUNCHES
from moekit.moe.kernels._common import interpret_mode
from tests.helpers import BrokenLauncher, gen

W = importlib.import_module("moekit.moe.kernels.grouped_mm_wgrad")  # the module (the package exports the function)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not (interpret_mode() or torch.cuda.is_available()),
                                reason="needs TRITON_INTERPRET=1 or a GPU")


@pytest.fixture
def tma(monkeypatch):
    monkeypatch.setattr(W, "WGRAD_TMA", "always")
    monkeypatch.setattr(W, "_TMA_FAILURE", [])


@pytest.mark.cover  # each value's path every run, re-paired each run (tests/conftest.py)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("counts", [[5, 0, 133, 17, 0, 100], [0, 0, 0], [300], [0, 0, 290], [40, 400]],
                         ids=["ragged", "all-empty", "one", "tail-unowned", "past-the-rows"])
def test_tma_wgrad_equals_the_pointer_kernel_bit_for_bit(tma, monkeypatch, counts, dtype):
    g = gen("tma", counts, dtype)
    M, K, N = 300, 48, 80  # K, N not multiples of the tiles: the descriptors' bounds zero-fill the tails
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    dy = torch.randn(M, N, generator=g).to(DEV, dtype)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).to(DEV)
    before = LAUNCHES["_grouped_mm_wgrad_tma_kernel"]
    got = W.grouped_mm_wgrad(x, dy, offs)
    assert LAUNCHES["_grouped_mm_wgrad_tma_kernel"] == before + 1
    monkeypatch.setattr(W, "WGRAD_TMA", "never")
    want = W.grouped_mm_wgrad(x, dy, offs)
    assert torch.equal(got, want)
    ref = W.grouped_mm_wgrad_ref(x.double(), dy.double(), offs)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (got.double() - ref).abs().max() <= tol * max(1.0, float(ref.abs().max()))


def test_where_tma_does_not_apply_the_pointer_kernel_runs(tma):
    g = gen("fallback")
    x = torch.randn(64, 32, generator=g).to(DEV)
    dy = torch.randn(64, 16, generator=g).to(DEV)
    offs = torch.tensor([20, 64], dtype=torch.int32, device=DEV)
    gidx = torch.randperm(64, generator=g).to(DEV)
    assert "gathered" in W.why_not_tma(x, dy, gidx)
    odd = torch.randn(64, 33, generator=g).to(DEV)[:, :31]  # rows of 124 bytes: not 16-byte aligned
    assert "16-byte aligned rows" in W.why_not_tma(odd, dy, None)
    before = (LAUNCHES["_grouped_mm_wgrad_tma_kernel"], LAUNCHES["_grouped_mm_wgrad_kernel"])
    got = W.grouped_mm_wgrad(x, dy, offs, gidx)
    assert (LAUNCHES["_grouped_mm_wgrad_tma_kernel"], LAUNCHES["_grouped_mm_wgrad_kernel"]) == (before[0], before[1] + 1)
    torch.testing.assert_close(got, W.grouped_mm_wgrad_ref(x, dy, offs, gidx))


def test_a_tma_kernel_that_cannot_build_falls_back_once(tma, monkeypatch):
    monkeypatch.setattr(W, "GROUPED_MM_WGRAD_TMA", BrokenLauncher())
    x, dy = torch.randn(32, 16).to(DEV), torch.randn(32, 16).to(DEV)
    offs = torch.tensor([10, 32], dtype=torch.int32, device=DEV)
    with pytest.warns(UserWarning, match="TMA kernel failed to build here"):
        got = W.grouped_mm_wgrad(x, dy, offs)
    torch.testing.assert_close(got, W.grouped_mm_wgrad_ref(x, dy, offs))
    assert "simulated" in W.why_not_tma(x, dy, None)  # remembered: no second try


def test_a_bad_mode_is_named(monkeypatch):
    monkeypatch.setattr(W, "WGRAD_TMA", "sometimes")
    with pytest.raises(ValueError, match="WGRAD_TMA='sometimes'; use one of auto, never, always"):
        W.grouped_mm_wgrad(torch.randn(8, 16).to(DEV), torch.randn(8, 16).to(DEV),
                           torch.tensor([8], dtype=torch.int32, device=DEV))
