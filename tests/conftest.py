"""Each test starts from a fresh fp8train registry (no amax groups, no regions, zeroed counters)."""

import pytest

import fp8train
from fp8train.protocol import REGISTRY


@pytest.fixture(autouse=True)
def fresh_fp8_registry():
    REGISTRY.__init__()
    fp8train.reset_reduction_stats()
    yield
    REGISTRY.__init__()
