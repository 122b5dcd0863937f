import os
import random

# Two-core CI box: keep intra-op threads modest so spawned ranks do not oversubscribe.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# Two pytest-xdist workers of 2 threads share 2 cores, always contended: threads that spin while they wait for a
# descheduled one waste its time slice, so they wait passively (moekit's programs only shorten the spin, which
# keeps an idle machine's speed: docs/training.md, "Host threads on CPU runs")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Triton reads its mode once, at import: tests run the kernels in the CPU interpreter whenever there
# is no GPU, whichever test module happens to import triton first.
try:
    import torch as _torch_probe  # noqa: F401  (cheap: torch does not import triton eagerly)

    _has_gpu = _torch_probe.cuda.is_available()
except ImportError:  # pragma: no cover
    _has_gpu = False
if not _has_gpu:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# the interpreter without its repeated language patching inside a launch (tests/interpreter_speed.py)
from tests import interpreter_speed  # noqa: E402

interpreter_speed.install()

import torch

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import pytest  # noqa: E402

# One fresh seed per test session for the tests that draw their inputs from it (test_seed(...) below):
# new random inputs every run, and the header line tells how to replay a failing one.
os.environ.setdefault("MOEKIT_TEST_SEED", str(int.from_bytes(os.urandom(4), "little") >> 1))

# the rank fork server's environment is this one, complete and before any test changes it (tests/dist_utils.py)
from tests import dist_utils  # noqa: E402,F401


def pytest_report_header(config):
    seed = os.environ["MOEKIT_TEST_SEED"]
    return f"moekit test seed: {seed} (MOEKIT_TEST_SEED={seed} replays this run's random inputs)"


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models, many small ops: one thread is faster than two on a busy two-core box (and less noisy).
    A module opts in with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _mode(name: str, default: str) -> str:
    mode = os.environ.get(name, default)
    if mode not in ("cover", "all"):
        raise pytest.UsageError(f"{name}={mode!r}: use 'cover' (each parameter value once) or 'all' (every "
                                f"combination)")
    return mode


def pytest_collection_modifyitems(config, items):
    """Cross-products run as a cover: a few cases that between them hold every parameter value, not every
    combination (a greedy set cover, ties broken by the session's seed, so each run pairs the values afresh and
    MOEKIT_TEST_SEED replays a run's choice). Where it applies:

    - tests marked ``cover`` (parameters that choose independent paths: each value's path runs every time, and
      over runs every pairing does), unless ``MOEKIT_TEST_CASES=all``;
    - the GPU tier run on the CPU (``MOEKIT_GPU_TESTS_ON=cpu``, Triton in the interpreter), which checks the
      tier's own code (references, tolerances, shapes), unless ``MOEKIT_GPU_TIER_CASES=all``. On CUDA the whole
      tier runs."""
    gpu_cover = os.environ.get("MOEKIT_GPU_TESTS_ON", "cuda") != "cuda" and \
        _mode("MOEKIT_GPU_TIER_CASES", "cover") == "cover"
    marked_cover = _mode("MOEKIT_TEST_CASES", "cover") == "cover"
    seed = int(os.environ.get("MOEKIT_TEST_SEED", "0"))
    by_test: dict[tuple, list] = {}
    for item in items:
        if getattr(item, "callspec", None) is None:
            continue
        if (gpu_cover and item.get_closest_marker("gpu") is not None) or \
                (marked_cover and item.get_closest_marker("cover") is not None):
            by_test.setdefault((str(getattr(item, "path", "")), item.originalname), []).append(item)
    drop = []
    for key, cases in by_test.items():  # greedy set cover: a case with the most values not yet seen, first
        rng = random.Random(f"{seed} {key[1]}")  # per test: its pairing does not depend on what else was collected
        values = [{(name, repr(v)) for name, v in case.callspec.params.items()} for case in cases]
        uncovered, chosen = set().union(*values), set()
        while uncovered:
            gain = [len(v & uncovered) for v in values]
            best = rng.choice([i for i, g in enumerate(gain) if g == max(gain)])
            chosen.add(best)
            uncovered -= values[best]
        drop += [case for i, case in enumerate(cases) if i not in chosen]
    if drop:
        dropped = set(map(id, drop))
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if id(item) not in dropped]
