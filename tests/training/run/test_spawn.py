"""``training/run/spawn.py``, the ranks the tests and benchmarks start on one host: each rank
runs with one thread (set before torch loads in the spawned child), a failing rank's error
reaches the caller, and rank 0's rows come back in order."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from training.run.spawn import gather_rows, run_ranks


def _threads_and_rows(rank, world, out):
    got = torch.get_num_threads()
    rows = [None] * world
    dist.all_gather_object(rows, (rank, got))
    if rank == 0:
        out.put(rows)
        out.put("second")


def _fails_on_rank_1(rank, world):
    assert rank != 1, "rank 1 fails here"


def test_each_rank_has_one_thread_and_rank_0s_rows_come_back():
    rows, second = gather_rows(_threads_and_rows, 2, rows=2, timeout=120)
    assert rows == [(0, 1), (1, 1)]         # two ranks on two cores: no oversubscribed OpenMP pool
    assert second == "second"


def test_a_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(AssertionError, match=r"(?s)rank 1 failed:.*rank 1 fails here"):
        run_ranks(_fails_on_rank_1, 2, timeout=120)
