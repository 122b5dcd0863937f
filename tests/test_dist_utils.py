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
