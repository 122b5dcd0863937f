import os

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


def pytest_collection_modifyitems(config, items):
    """The GPU tier run on the CPU (``MOEKIT_GPU_TESTS_ON=cpu``, Triton in the interpreter) checks the tier's
    own code: references, tolerances, shapes. There every parameter value of a tier test runs at least once
    (a greedy set cover: few cases that between them hold every value), not every combination, which keeps
    CI's run of the tier to a third of its cases. ``MOEKIT_GPU_TIER_CASES=all`` runs every combination; on CUDA all run."""
    if os.environ.get("MOEKIT_GPU_TESTS_ON", "cuda") == "cuda":
        return
    mode = os.environ.get("MOEKIT_GPU_TIER_CASES", "cover")
    if mode not in ("cover", "all"):
        raise pytest.UsageError(f"MOEKIT_GPU_TIER_CASES={mode!r}: use 'cover' (each parameter value once, the "
                                "default on CPU) or 'all' (every combination)")
    if mode == "all":
        return
    by_test: dict[str, list] = {}
    for item in items:
        if item.get_closest_marker("gpu") is not None and getattr(item, "callspec", None) is not None:
            by_test.setdefault(item.originalname, []).append(item)
    drop = []
    for cases in by_test.values():  # greedy set cover: the case with the most values not yet seen, first
        values = [{(name, repr(v)) for name, v in case.callspec.params.items()} for case in cases]
        uncovered, chosen = set().union(*values), set()
        while uncovered:
            best = max(range(len(cases)), key=lambda i: (len(values[i] & uncovered), -i))
            chosen.add(best)
            uncovered -= values[best]
        drop += [case for i, case in enumerate(cases) if i not in chosen]
    if drop:
        dropped = set(map(id, drop))
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if id(item) not in dropped]
