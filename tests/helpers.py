"""Small pieces several test modules share: per-case random generators, kernel launchers that fail to build, and
the check that a program refused its input in one line."""
from __future__ import annotations

import os
import zlib

import torch


def gen(*key) -> torch.Generator:
    """A generator of its own for each test case: fresh inputs every run (the session's MOEKIT_TEST_SEED, set and
    printed by tests/conftest.py; setting it replays a run's inputs), distinct per ``key``."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()) ^ int(os.environ.get("MOEKIT_TEST_SEED", "0")))


def one_stderr_line(capsys, *words: str) -> str:
    """The program's one line on stderr (captured by ``capsys``), holding every one of ``words``."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for w in words:
        assert w in err[0], (w, err[0])
    return err[0]


class BrokenLauncher:
    """Stands in for a ``Kernel`` (``kernel[grid](*args, **kwargs)``) whose launch fails as a Triton build does
    (``moe.kernels._common.BUILD_ERRORS``): always, or with ``only_tma`` only when launched with ``TMA=True``, the
    other launches going to ``real``."""

    def __init__(self, real=None, only_tma: bool = False):
        self.real, self.only_tma = real, only_tma
        self.name = getattr(real, "name", "broken")

    def __getitem__(self, grid):
        from moekit.moe.kernels._common import BUILD_ERRORS

        def launch(*args, **kwargs):
            if not self.only_tma or kwargs.get("TMA"):
                raise BUILD_ERRORS[0]("no tensor descriptors here (simulated)")
            return self.real[grid](*args, **kwargs)
        return launch
