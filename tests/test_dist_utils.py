"""tests/dist_utils.run_ranks itself: every multi-rank test relies on it to fail when a rank fails, and to give
each rank the environment it was handed (``env``) in a real gloo group of the right size."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_ranks


def _rank_fails_unless_zero(rank: int, world: int) -> None:
    dist.barrier()
    assert rank == 0, f"rank {rank} of {world} disagrees"


def test_a_failing_rank_fails_the_caller_with_its_message():
    with pytest.raises(Exception, match="rank 1 of 2 disagrees"):
        run_ranks(_rank_fails_unless_zero, 2)


def _sees(rank: int, world: int, expected: dict) -> None:
    got = {k: os.environ.get(k) for k in expected}
    assert got == expected, got
    assert torch.get_num_threads() == 1 and dist.get_world_size() == world and dist.get_rank() == rank
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    assert total.item() == world * (world + 1) / 2


def test_ranks_get_the_env_they_are_handed_and_a_real_group():
    expected = {"MOEKIT_TEST_HANDED": "yes", "OMP_NUM_THREADS": "1", "WORLD_SIZE": "3"}
    run_ranks(_sees, 3, expected, env={"MOEKIT_TEST_HANDED": "yes"})


SERVER_ENV_PROBE = """
import os, sys
from tests import dist_utils          # the session's environment is taken here (conftest imports it first)
os.environ["MOEKIT_TEST_LATE"] = "set by a test before any rank started"
from tests.dist_utils import run_ranks
from tests.test_dist_utils import _sees
run_ranks(_sees, 2, {"MOEKIT_TEST_LATE": None, "MOEKIT_TEST_HANDED": "yes"}, env={"MOEKIT_TEST_HANDED": "yes"})
print("ranks saw the session's environment")
"""


def test_the_fork_server_keeps_the_sessions_environment():
    """The ranks' fork server starts with the environment of the session's start, not with what a test had changed
    when it first started ranks (which once decided, for the rest of a worker's tests, the variables that moekit
    and Triton read at import). In a fresh interpreter, whose server cannot have started yet."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "MOEKIT_TEST_LATE"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", SERVER_ENV_PROBE], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "session's environment" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
