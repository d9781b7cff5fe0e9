"""Each test starts from a fresh fp8train registry (no amax groups, no regions, zeroed counters).

The test process computes on one thread (FP8TRAIN_TEST_THREADS=N for N), as the ranks do
(fp8train.tools.ranks): the tests' tensors are small, and on a 2-core machine intra-op threads cost more
than they give: each small op waits for both threads (OpenMP spins), so a tiny GPT's training step took
1.2 s on two threads of this shared 2-core machine and 9 ms on one (0.25 s and 9 ms of CPU time). Tests
that care about the thread count set it themselves (test_cast_gemm reads it); subprocesses that the
tests start get OMP_NUM_THREADS unless it is set."""

import os
import pathlib

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


# The files that take longest, longest first: each took 20-85 s of one process in a serial run of the
# whole suite (-n 0, pytest --durations summed per file; 2026-12-03, ranks forked from the warmed-up
# server of fp8train.tools.ranks; the suite: about 12 minutes of one process in all).
LONGEST_FIRST = (
    "tools/test_gpu_check.py",
    "modules/test_compile.py",
    "tools/test_demo_cli.py",
    "recipes/test_current_block_scaling.py",
    "parallel/test_pipeline.py",
    "recipes/test_lean_path.py",
    "tools/test_demo_moe.py",
    "device/test_cuda_contract.py",
    "tools/test_bench.py",
    "amax/test_faults.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist (scripts/test.sh: `-n 2 --dist loadfile --no-loadscope-reorder`), where files
    are handed to the workers in collection order: the longest files first (LONGEST_FIRST), then the
    other files holding a slow or multi-rank test, so that the many short files fill the end of both
    workers instead of one long file running alone at the end (longest first: the two workers end
    close together). A single process (`-n 0`) keeps pytest's order."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    marked = ("slow", "multirank")
    long = {item.path for item in items if any(item.get_closest_marker(m) for m in marked)}
    tests = pathlib.Path(__file__).parent
    first = {tests / name: rank for rank, name in enumerate(LONGEST_FIRST)}
    # stable: each file's own order is kept
    items.sort(key=lambda item: first.get(item.path, len(first) + (item.path not in long)))
