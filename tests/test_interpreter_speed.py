"""tests/interpreter_speed.py: inside a launch, helper calls do not patch the language again, kernels compute
what they did, and the language is restored after the launch."""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton CPU interpreter")

triton = pytest.importorskip("triton")
tl = triton.language
interp = pytest.importorskip("triton.runtime.interpreter")


@triton.jit
def _scaled(x, s):
    return x * s


@triton.jit
def _repeat_kernel(x_ptr, out_ptr, n, REPEATS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.load(x_ptr + offs, mask=mask, other=0.0)
    for _ in range(REPEATS):  # a helper of this module, then one of Triton's (which sees triton.language.core)
        acc = _scaled(acc, 0.5)
        acc = acc + tl.sum(acc, axis=0) * 0.0
    tl.store(out_ptr + offs, acc, mask=mask)


def _patches(monkeypatch, repeats: int, programs: int = 3) -> int:
    """How many times the language's builtins were walked for one launch; checks the output against torch."""
    real = interp._patch_builtin
    walks = []
    monkeypatch.setattr(interp, "_patch_builtin", lambda *a: walks.append(1) or real(*a))
    x = torch.randn(programs * 16 - 5, generator=torch.Generator().manual_seed(repeats))
    out = torch.empty_like(x)
    _repeat_kernel[(programs,)](x, out, x.numel(), REPEATS=repeats, BLOCK=16)
    torch.testing.assert_close(out, x * 0.5 ** repeats, rtol=0, atol=0)
    return len(walks)


def test_the_speed_up_is_installed_by_the_test_session():
    from tests import interpreter_speed

    assert interpreter_speed.install() is True
    assert interp._patch_lang.__module__ == "tests.interpreter_speed"


def test_helper_calls_inside_a_launch_walk_the_language_once(monkeypatch):
    """Walks per launch do not grow with the helper calls (programs x repeats of them): the launch's own patch and
    the first patch of a module it did not see; without the skip, one walk set per helper call."""
    _patches(monkeypatch, repeats=1, programs=1)  # first launches: the interpreter adds names to the modules' globals
    once = _patches(monkeypatch, repeats=1, programs=1)
    many = _patches(monkeypatch, repeats=6, programs=4)
    assert 0 < once == many, (once, many)


def test_the_language_is_restored_after_a_launch(monkeypatch):
    before = tl.load, tl.tensor.__add__, tl.program_id
    _patches(monkeypatch, repeats=2)
    assert (tl.load, tl.tensor.__add__, tl.program_id) == before

