"""Each test starts from a fresh fp8train registry (no amax groups, no regions, zeroed counters).

The test process computes on one thread (FP8TRAIN_TEST_THREADS=N for N), as the ranks do
(fp8train.tools.ranks): the tests' tensors are small, and on a 2-core machine intra-op threads cost more
than they give: each small op waits for both threads (OpenMP spins), so a tiny GPT's training step took
1.2 s on two threads of this shared 2-core machine and 9 ms on one (0.25 s and 9 ms of CPU time). Tests
that care about the thread count set it themselves (test_cast_gemm reads it); subprocesses that the
tests start get OMP_NUM_THREADS unless it is set."""

import os

import pytest
import torch

import fp8train

THREADS = int(os.environ.get("FP8TRAIN_TEST_THREADS", "1"))
torch.set_num_threads(THREADS)
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))  # the tests' subprocesses (CLI, interpreter runs)


@pytest.fixture(autouse=True)
def fresh_fp8_registry():
    fp8train.inspection.reset()
    fp8train.reset_reduction_stats()
    yield
    fp8train.inspection.reset()


def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist (scripts/test.sh: `-n 2 --dist loadfile --no-loadscope-reorder`), where files
    are handed to the workers in collection order: the files holding a slow or multi-rank test first,
    so that the many short files fill the end of both workers instead of one long file running alone
    at the end. A single process (`-n 0`) keeps pytest's order."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    marked = ("slow", "multirank")
    long = {item.path for item in items if any(item.get_closest_marker(m) for m in marked)}
    items.sort(key=lambda item: item.path not in long)  # stable: each file's own order is kept
