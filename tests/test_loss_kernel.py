"""The fused cross-entropy kernel (moe/kernels/cross_entropy.py) and chunked_lm_loss's fused path, on CPU in the
Triton interpreter.

Two references: the torch path (cross_entropy_rows_ref; chunked_lm_loss(fused=False)) and an independent one,
F.cross_entropy on the same (rounded) logits in float64 with autograd for the gradient. Bounds: fp32 arithmetic
(a few 2**-24 relative of the row's logsumexp) plus, for bf16, one rounding of the gradient to bf16 (2**-8
relative); against the torch path, which rounds the same fp32 values once, one bf16 ulp.

The module-level TRITON_INTERPRET handling is test_kernels.py's (see its docstring). In the interpreter the kernel's
tiles are 64 elements with BLOCK_V <= 32, so V = 20 is one ragged tile, V = 33 / 100 several with a ragged last
one, and rows come BLOCK_R > 1 to a program (13 rows: a ragged last row block).
"""
from __future__ import annotations

import importlib
import os
import warnings

_PREV_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
importlib.import_module("triton")  # the first import decides the mode: see the module docstring

import pytest
import torch
import torch.nn.functional as F

import moekit.moe.kernels as K
from moekit.models import loss as loss_mod
from moekit.models import transformer
from moekit.models.config import ModelConfig
from moekit.models.loss import IGNORE_INDEX, chunked_lm_loss
from moekit.moe.kernels import cross_entropy as ce
from moekit.moe.kernels.cross_entropy import cross_entropy_rows, cross_entropy_rows_ref
from tests.helpers import BrokenLauncher, gen

if _PREV_INTERPRET is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _PREV_INTERPRET

KERNEL = "_cross_entropy_kernel"
F32_EPS, BF16_EPS = 2.0 ** -24, 2.0 ** -8


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not K.interpret_mode():
        pytest.fail("triton was imported in compiled mode before this module set TRITON_INTERPRET=1; "
                    "run `TRITON_INTERPRET=1 pytest tests/test_loss_kernel.py`")
    monkeypatch.setattr(loss_mod, "TRITON_LM_LOSS", "auto")
    monkeypatch.setattr(loss_mod, "_BUILD_FAILURE", [])
    torch.set_num_threads(min(2, os.cpu_count() or 1))


def _rows_case(C, V, dtype, key, spread=3.0, ignored=0.25):
    g = gen("rows", C, V, str(dtype), *key)
    x = (torch.randn(C, V, generator=g, dtype=torch.float64) * spread).to(dtype)
    y = torch.randint(0, V, (C,), generator=g)
    y = y.masked_fill(torch.rand(C, generator=g) < ignored, IGNORE_INDEX)
    scale = torch.rand(C, generator=g) + 0.1
    return x, y, scale


def _float64_rows(x, y, scale):
    """(loss [C], grad [C, V]) from F.cross_entropy and autograd in float64 (ignored rows: 0, 0)."""
    x64 = x.double().requires_grad_()
    loss = F.cross_entropy(x64, y, ignore_index=IGNORE_INDEX, reduction="none")
    (loss * scale.double()).sum().backward()
    return loss.detach(), x64.grad


def _check_rows(x, y, scale, block_v=None):
    """Run the kernel on a copy of x and compare with both references."""
    got = x.clone()
    before = K.LAUNCHES[KERNEL]
    loss = cross_entropy_rows(got, y, scale, need_grad=True, block_v=block_v)
    assert K.LAUNCHES[KERNEL] == before + 1
    want_loss, want_grad = _float64_rows(x, y, scale)
    lse = torch.logsumexp(x.double(), -1)
    assert loss.dtype == torch.float32 and got.dtype == x.dtype
    tol = 16 * F32_EPS * (lse.abs() + 1)  # fp32 sums and exps, relative to the row's size
    assert ((loss.double() - want_loss).abs() <= tol).all(), (loss, want_loss)
    rounding = BF16_EPS if x.dtype == torch.bfloat16 else F32_EPS
    # exp(x - lse) carries lse's fp32 error (relative to |lse|) into every entry of the row
    bound = rounding * want_grad.abs() + tol[:, None] * (want_grad.abs() + scale.double()[:, None])
    assert ((got.double() - want_grad).abs() <= bound).all(), (got.double() - want_grad).abs().max()
    ref_loss, ref_grad = cross_entropy_rows_ref(x, y, scale, need_grad=True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    if x.dtype == torch.bfloat16:  # the same fp32 value up to the lse's sum order, rounded once: one ulp at most,
        # which is up to 2^-7 of the value at the bottom of its binade (2 BF16_EPS; the CI run at 4e523ea drew a
        # 2^-18 step on a value in [2^-11, 2^-10), past 2^-8 relative)
        torch.testing.assert_close(got, ref_grad, rtol=2 * BF16_EPS, atol=1e-7)
    else:
        torch.testing.assert_close(got, ref_grad, rtol=1e-5, atol=1e-7)
    assert (got[y == IGNORE_INDEX] == 0).all() and (loss[y == IGNORE_INDEX] == 0).all()
    return loss, got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("V,block_v", [(20, None), (33, None), (100, None), (100, 16), (1, None), (7, 4)])
def test_rows_match_float64_and_the_torch_reference(dtype, V, block_v):
    """V under one tile, ragged last tiles, a forced small tile, a one-column vocabulary; 13 rows (ragged row
    blocks), ignored targets, per-row scales."""
    _check_rows(*_rows_case(13, V, dtype, ("match", block_v)), block_v=block_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_large_logits_stay_finite(dtype):
    """+-1e4 logits: exp(1e4) overflows without the running max; the online max keeps every value finite,
    also when the row's maximum sits in the last tile (after the sum started from the first ones)."""
    x, y, scale = _rows_case(9, 70, dtype, ("large",), spread=1e4, ignored=0.0)
    x[0] = -1e4
    x[0, 69] = 1e4  # max in the ragged last tile
    x[1] = 1e4  # every logit equal and huge: softmax 1/V
    y[0], y[1] = 3, 5
    loss, grad = _check_rows(x, y, scale)
    assert torch.isfinite(loss).all() and torch.isfinite(grad.float()).all()
    assert loss[0] > 1e4  # target 2e4 below the max
    torch.testing.assert_close(loss[1], torch.tensor(70.0).log(), rtol=0, atol=1e4 * F32_EPS)  # lse's fp32 ulp


def test_targets_outside_the_vocabulary_give_nan_not_a_bad_read():
    """A kept target outside [0, V) is never an address: its loss is NaN (a sync-free signal the trainer's
    non-finite check sees), its gradient row lacks the one-hot, the other rows are unaffected."""
    x, y, scale = _rows_case(6, 40, torch.float32, ("oob",), ignored=0.0)
    bad = torch.tensor([40, -1, 10 ** 12])
    y[[1, 3, 5]] = bad
    got = x.clone()
    loss = cross_entropy_rows(got, y, scale, need_grad=True)
    assert torch.isnan(loss[[1, 3, 5]]).all()
    good = torch.tensor([0, 2, 4])
    want_loss, want_grad = _float64_rows(x[good], y[good], scale[good])
    torch.testing.assert_close(loss[good].double(), want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[good].double(), want_grad, rtol=1e-5, atol=1e-7)
    softmax = torch.softmax(x[[1, 3, 5]].double(), -1) * scale[[1, 3, 5]].double()[:, None]
    torch.testing.assert_close(got[[1, 3, 5]].double(), softmax, rtol=1e-5, atol=1e-7)


def test_all_ignored_rows_and_loss_only():
    x, y, scale = _rows_case(5, 30, torch.bfloat16, ("ignored",))
    got = x.clone()
    loss = cross_entropy_rows(got, torch.full((5,), IGNORE_INDEX), scale, need_grad=True)
    assert (loss == 0).all() and (got == 0).all()
    got = x.clone()  # need_grad False: the logits stay as they are
    loss = cross_entropy_rows(got, y, None, need_grad=False)
    assert torch.equal(got, x)
    torch.testing.assert_close(loss, cross_entropy_rows_ref(x, y)[0], rtol=1e-5, atol=1e-5)


def test_a_row_stride_wider_than_v_and_the_argument_checks():
    """Rows of a wider buffer (stride(0) > V) are read and written in place, the columns past V untouched."""
    x, y, scale = _rows_case(6, 24, torch.float32, ("stride",), ignored=0.0)
    buf = torch.full((6, 40), 7.0)
    buf[:, :24] = x
    cross_entropy_rows(buf[:, :24], y, scale, need_grad=True)
    torch.testing.assert_close(buf[:, :24], cross_entropy_rows_ref(x, y, scale, need_grad=True)[1])
    assert (buf[:, 24:] == 7.0).all()
    with pytest.raises(ValueError, match="unit stride"):
        cross_entropy_rows(x.t().contiguous().t(), y, scale, need_grad=True)
    with pytest.raises(ValueError, match="targets must be"):
        cross_entropy_rows(x, y[:5])
    with pytest.raises(ValueError, match="scale must be"):
        cross_entropy_rows(x, y, scale[:5], need_grad=True)
    with pytest.raises(ValueError, match="not supported"):
        cross_entropy_rows(x.double(), y)


# ---------------------------------------------------------------------------------------------------
# chunked_lm_loss: fused against the torch path and float64
# ---------------------------------------------------------------------------------------------------


def _loss_case(N, H, V, key, dtype=torch.float32, ignored=0.3):
    g = gen("loss", N, H, V, *key)
    h = torch.randn(N, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    y = torch.randint(0, V, (N,), generator=g).masked_fill(torch.rand(N, generator=g) < ignored, IGNORE_INDEX)
    return h, w, y


def _run(h, w, y, need_h=True, need_w=True, **kw):
    """(loss, dh or None, dw or None) of chunked_lm_loss(**kw)."""
    h, w = h.detach().clone().requires_grad_(need_h), w.detach().clone().requires_grad_(need_w)
    loss = chunked_lm_loss(h, w, y, **kw)
    if need_h or need_w:
        loss.backward()
    return loss.detach(), h.grad, w.grad


def _float64(h, w, y):
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    loss = F.cross_entropy(h64 @ w64.t(), y, ignore_index=IGNORE_INDEX)
    if (y != IGNORE_INDEX).any():
        loss.backward()
        return loss.detach(), h64.grad, w64.grad
    return torch.zeros((), dtype=torch.float64), torch.zeros_like(h64), torch.zeros_like(w64)


@pytest.mark.parametrize("need_h,need_w", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("chunk", [16, 64])
def test_fused_loss_matches_torch_and_float64_fp32(chunk, need_h, need_w):
    """45 tokens in chunks of 16 (16, 16, 13: a ragged last chunk) or one chunk; a chunk with no counted token."""
    h, w, y = _loss_case(45, 12, 50, ("fp32", chunk))
    y[16:32] = IGNORE_INDEX
    before = K.LAUNCHES[KERNEL]
    got = _run(h, w, y, need_h, need_w, chunk=chunk, fused=True)
    assert K.LAUNCHES[KERNEL] - before == -(-45 // chunk)  # one launch per chunk: the Triton path ran
    torch_path = _run(h, w, y, need_h, need_w, chunk=chunk, fused=False)
    assert K.LAUNCHES[KERNEL] - before == -(-45 // chunk)
    exact = _float64(h, w, y)
    for name, a, b, r, wanted in zip(("loss", "dh", "dw"), got, torch_path, exact, (True, need_h, need_w)):
        if not wanted:
            assert a is None and b is None, name
            continue
        assert a.dtype == b.dtype == torch.float32, name
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, msg=name)
        torch.testing.assert_close(a.double(), r, rtol=2e-5, atol=2e-6, msg=name)
    if need_h:
        assert (got[1][16:32] == 0).all()


def test_fused_loss_bf16_matches_torch_and_float64():
    """bf16 leaves (logits, gradient and GEMMs in bf16), and fp32 leaves under CPU autocast to bf16."""
    h, w, y = _loss_case(40, 16, 70, ("bf16",), torch.bfloat16)
    got = _run(h, w, y, chunk=16, fused=True)
    torch_path = _run(h, w, y, chunk=16, fused=False)
    exact = _float64(h, w, y)
    for name, a, b, r in zip(("loss", "dh", "dw"), got, torch_path, exact):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-3 * float(r.abs().max()), msg=name)
        err, err_torch = (a.double() - r).abs().max(), (b.double() - r).abs().max()
        assert err <= 2 * err_torch + 1e-3 * r.abs().max(), (name, float(err), float(err_torch))
    h32, w32 = h.float(), w.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _run(h32, w32, y, chunk=16, fused=True)
        torch_path = _run(h32, w32, y, chunk=16, fused=False)
    for name, a, b, r in zip(("loss", "dh", "dw"), got, torch_path, exact):
        assert a.dtype == b.dtype == torch.float32, name
        err, err_torch = (a.double() - r).abs().max(), (b.double() - r).abs().max()
        assert err <= 2 * err_torch + 1e-3 * r.abs().max(), (name, float(err), float(err_torch))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_all_ignored_gives_zero_loss_and_gradients(dtype):
    h, w, _ = _loss_case(20, 8, 30, ("all-ignored",), dtype)
    loss, dh, dw = _run(h, w, torch.full((20,), IGNORE_INDEX), chunk=8, fused=True)
    assert loss.item() == 0 and (dh == 0).all() and (dw == 0).all()


def test_fused_large_logits_through_the_head():
    """Hidden states of size 1e3 make logits of ~1e4: the fused loss stays finite and matches float64."""
    h, w, y = _loss_case(24, 8, 40, ("large-head",), ignored=0.0)
    h = h * 1e3
    got = _run(h, w, y, chunk=10, fused=True)
    exact = _float64(h, w, y)
    assert all(torch.isfinite(t).all() for t in got)
    for name, a, r in zip(("loss", "dh", "dw"), got, exact):
        torch.testing.assert_close(a.double(), r, rtol=1e-4, atol=1e-3 * float(r.abs().max()), msg=name)


# ---------------------------------------------------------------------------------------------------
# Which path runs
# ---------------------------------------------------------------------------------------------------


def test_auto_is_torch_on_cpu_and_always_runs_the_kernel(monkeypatch):
    h, w, y = _loss_case(20, 8, 30, ("dispatch",))
    before = K.LAUNCHES[KERNEL]
    auto = _run(h, w, y, chunk=8)  # fused=None, TRITON_LM_LOSS "auto": CUDA only, even in interpret mode
    assert K.LAUNCHES[KERNEL] == before
    monkeypatch.setattr(loss_mod, "TRITON_LM_LOSS", "always")
    always = _run(h, w, y, chunk=8)
    assert K.LAUNCHES[KERNEL] == before + 3
    _run(h, w, y, chunk=8, fused=False)  # the argument wins over the module switch
    assert K.LAUNCHES[KERNEL] == before + 3
    for a, b in zip(auto, always):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)
    monkeypatch.setattr(loss_mod, "TRITON_LM_LOSS", "sometimes")
    with pytest.raises(ValueError, match="TRITON_LM_LOSS='sometimes'"):
        _run(h, w, y)
    with pytest.raises(ValueError, match="fused='yes'"):
        _run(h, w, y, fused="yes")


def test_fused_true_where_the_kernel_cannot_run_says_why(monkeypatch):
    h, w, y = _loss_case(10, 8, 30, ("cannot",))
    with pytest.raises(ValueError, match="fused=True.*float64"):
        _run(h.double(), w.double(), y, fused=True)
    monkeypatch.setattr(loss_mod, "TRITON_LM_LOSS", "always")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_LM_LOSS='always'.*TRITON_INTERPRET=1"):
        _run(h, w, y)


def test_a_kernel_that_fails_to_build_falls_back_to_torch_once(monkeypatch):
    """'always' (here standing for 'auto' on a GPU whose Triton cannot build the kernel): one warning, the torch
    passes for that call and every later one; fused=True raises the build error instead."""
    h, w, y = _loss_case(20, 8, 30, ("broken",))
    want = _run(h, w, y, chunk=8, fused=False)
    monkeypatch.setattr(ce, "CROSS_ENTROPY", BrokenLauncher())
    monkeypatch.setattr(loss_mod, "TRITON_LM_LOSS", "auto")
    monkeypatch.setattr(loss_mod, "_fused_path", lambda device, dtype, fused: fused is not False)
    with pytest.warns(UserWarning, match="failed to build"):
        got = _run(h, w, y, chunk=8)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert loss_mod._BUILD_FAILURE
    with pytest.raises(K._common.BUILD_ERRORS):
        _run(h, w, y, chunk=8, fused=True)


def test_model_targets_entry_with_the_fused_loss(monkeypatch):
    """The model's ``targets=`` loss (tied head) through the fused kernel equals cross-entropy of its logits."""
    cfg = ModelConfig(vocab_size=45, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, ffn_hidden_size=24,
                      num_experts=2, moe_ffn_hidden_size=12, top_k=1, max_seq_len=16, tie_embeddings=True)
    model = transformer.Transformer(cfg)
    model.init_weights(seed=5)
    tokens = torch.randint(0, 45, (2, 10), generator=gen("model-fused"))
    targets = torch.randint(0, 45, (2, 10), generator=gen("model-fused", "y"))
    targets[0, :3] = IGNORE_INDEX
    monkeypatch.setattr(loss_mod, "TRITON_LM_LOSS", "always")
    before = K.LAUNCHES[KERNEL]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = model(tokens, targets=targets)
    assert K.LAUNCHES[KERNEL] > before
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    monkeypatch.setattr(transformer, "LOSS_CHUNKS", "never")
    want = model(tokens, targets=targets)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, model.get_parameter(name).grad, rtol=1e-4, atol=1e-6, msg=name)
