"""Each test starts from a fresh fp8train registry (no amax groups, no regions, zeroed counters)."""

import pytest

import fp8train


@pytest.fixture(autouse=True)
def fresh_fp8_registry():
    fp8train.inspection.reset()
    fp8train.reset_reduction_stats()
    yield
    fp8train.inspection.reset()
