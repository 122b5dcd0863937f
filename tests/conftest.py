import os

# Two-core CI box: keep intra-op threads modest so spawned ranks do not oversubscribe.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# Triton reads its mode once, at import: tests run the kernels in the CPU interpreter whenever there
# is no GPU, whichever test module happens to import triton first.
try:
    import torch as _torch_probe  # noqa: F401  (cheap: torch does not import triton eagerly)

    _has_gpu = _torch_probe.cuda.is_available()
except ImportError:  # pragma: no cover
    _has_gpu = False
if not _has_gpu:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import pytest  # noqa: E402

# One fresh seed per test session for the tests that draw their inputs from it (test_seed(...) below):
# new random inputs every run, and the header line tells how to replay a failing one.
os.environ.setdefault("MOEKIT_TEST_SEED", str(int.from_bytes(os.urandom(4), "little") >> 1))


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
