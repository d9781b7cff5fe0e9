"""Property-based tests of the delayed-scaling update on adversarial amaxes (hypothesis).

Amaxes include 0 (role did not run), subnormals, values near float32 max, inf, and NaN as the
reduction path presents it (NaN -> inf before the update), over one to three successive steps from
any valid state. The reference (tests/reference.py) works one column at a time in float32,
independently of the library's vectorised torch code.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fp8train
from fp8train import DelayedScaling, Format
from fp8train.amax.reduction import Direction
from fp8train.amax.stats import Mark, ReductionStats
from fp8train.amax.storage import update_scaling
from fp8train.numerics.cast import quantize
from fp8train.recipe import fp8_dtype
from reference import RefScaling

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal
SUBNORMAL_MIN = float(np.nextafter(np.float32(0), np.float32(1)))
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}

SPECIAL = [0.0, SUBNORMAL_MIN, 1e-42, F32_TINY, 1e-30, 1.0, 448.0, 57344.0, 1e30, 3e38, F32_MAX, math.inf]
finite_amax = st.floats(0.0, F32_MAX, allow_nan=False, allow_infinity=False, allow_subnormal=True, width=32)
amax_value = st.one_of(st.sampled_from(SPECIAL), finite_amax)
# What the reduction may deliver as `last`: also NaN (turned into inf before the update).
last_value = st.one_of(amax_value, st.just(math.nan))
# Scales a valid state can hold: finite and positive (the smallest is about fp8_max / F32_MAX / 2**margin).
scale_value = st.floats(float(np.float32(1e-37)), F32_MAX, allow_nan=False, allow_infinity=False, width=32)

COMMON = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def scaling_case(draw):
    h = draw(st.integers(1, 6))
    n = draw(st.integers(1, 5))
    history = [[draw(amax_value) for _ in range(n)] for _ in range(h)]
    scale = [draw(scale_value) for _ in range(n)]
    steps = [[draw(last_value) for _ in range(n)] for _ in range(draw(st.integers(1, 3)))]
    recipe = DelayedScaling(
        margin=draw(st.integers(0, 4)),
        amax_history_len=h,
        amax_compute_algo=draw(st.sampled_from(["max", "most_recent"])),
        fp8_format=Format.HYBRID,
    )
    encoding = draw(st.sampled_from(["e4m3", "e5m2"]))
    return history, scale, steps, recipe, encoding


def reference(history, scale, steps, recipe, fp8_max):
    """(history, scale, scale_inv, the amax each column's scale came from in the last step or None)."""
    ref = RefScaling(len(scale), len(history), history, scale)
    for last in steps:
        used = ref.update(last, recipe, fp8_max)
    return ref.history_tensor(), ref.scale_tensor(), ref.scale_inv_tensor(), used


def run_update(history, scale, steps, recipe, fp8_max):
    hist_t = torch.tensor(history, dtype=torch.float32)
    scale_t = torch.tensor(scale, dtype=torch.float32)
    scale_inv_t = torch.reciprocal(scale_t)
    for last in steps:
        last_t = torch.tensor(last, dtype=torch.float32)
        last_t.masked_fill_(torch.isnan(last_t), math.inf)  # as Direction.launch does
        update_scaling(hist_t, scale_t, scale_inv_t, last_t, recipe, fp8_max)
    return hist_t, scale_t, scale_inv_t


def assert_matches(got, want) -> None:
    for got_t, want_t in zip(got, want[:3]):  # history, scale, scale_inv
        assert torch.equal(got_t, want_t), (got_t, want_t)


@COMMON
@given(scaling_case())
def test_update_matches_per_column_reference_and_keeps_scales_valid(case) -> None:
    history, scale, steps, recipe, encoding = case
    fp8_max = FP8_MAX[encoding]
    got = run_update(history, scale, steps, recipe, fp8_max)
    assert_matches(got, reference(history, scale, steps, recipe, fp8_max))
    _, scale_t, scale_inv_t = got
    assert bool(torch.isfinite(scale_t).all() and (scale_t > 0).all()), scale_t
    assert bool(torch.isfinite(scale_inv_t).all() and (scale_inv_t > 0).all()), scale_inv_t


@COMMON
@given(scaling_case(), st.lists(st.floats(0.0, 1.0, width=32), min_size=1, max_size=8))
def test_values_within_the_amax_never_overflow_with_the_new_scale(case, fractions) -> None:
    """x * scale stays within fp8_max for |x| <= the amax the scale came from; the FP8 cast of it,
    with or without the library's clamp, is finite and within the format's range."""
    history, scale, steps, recipe, encoding = case
    fp8_max = FP8_MAX[encoding]
    _, scale_t, _ = run_update(history, scale, steps, recipe, fp8_max)
    _, _, _, used = reference(history, scale, steps, recipe, fp8_max)
    for c, amax in enumerate(used):
        if amax is None:
            continue  # scale kept: no claim about this step's amax (it may be inf)
        x = torch.tensor([amax] + [amax * f for f in fractions], dtype=torch.float32)
        x = torch.cat([x, -x])
        scaled = x * scale_t[c]
        assert bool((scaled.abs() <= fp8_max * (1 + 2**-20)).all()), (amax, float(scale_t[c]), scaled)
        for q in (scaled.to(fp8_dtype(encoding)), quantize(x, scale_t[c], encoding)):
            qf = q.float()
            assert bool(torch.isfinite(qf).all()) and float(qf.abs().max()) <= fp8_max, (amax, qf)


@COMMON
@given(scaling_case())
def test_group_record_launch_finish_equals_the_reference(case) -> None:
    """The path real modules use (record max into the slot, launch turns NaN into inf, finish updates)
    gives the reference update; a column that recorded nothing (or 0) does not move."""
    history, scale, steps, recipe, encoding = case
    direction = "fwd" if encoding == "e4m3" else "bwd"
    group = Direction(direction, recipe, None, ReductionStats())
    hist_t = torch.tensor(history, dtype=torch.float32)
    scale_t = torch.tensor(scale, dtype=torch.float32)
    group.register("Case()", hist_t, scale_t, torch.reciprocal(scale_t))
    for index, last in enumerate(steps):
        for c, value in enumerate(last):
            group.record(c, torch.tensor(value))
        group.launch(async_op=True, region_index=index)
        group.finish()
    storage = group.storage
    assert_matches(
        (storage.history, storage.scale, storage.scale_inv),
        reference(history, scale, steps, recipe, FP8_MAX[encoding]),
    )
    nonfinite = sum(1 for last in steps for v in last if math.isnan(v) or math.isinf(v))
    assert group.stats.as_dict()["nonfinite_amax_events"] == nonfinite


class _StandInEvent:
    """A completed event at a given time on a simulated device clock (milliseconds)."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _StandInEvent) -> float:
        return end.ms - self.ms


def test_stand_in_timing_events_take_the_cuda_branch_of_the_stats() -> None:
    """`fp8train.amax.settings.timing_events` (the GPU check's seam, on the CPU): each mark holds a
    stand-in event, and the stats time an interval by the events' clock, not the host's; outside the
    override a CPU mark holds none again."""
    clock = iter([1.0, 251.0])
    stats = ReductionStats()
    with fp8train.amax.settings.override(timing_events=lambda: _StandInEvent(next(clock))):
        start, end = Mark.now(torch.device("cpu")), Mark.now(torch.device("cpu"))
    assert isinstance(start.event, _StandInEvent) and end.event.ms == 251.0
    stats.add_interval("exposed_wait_s", start, end)
    assert stats.as_dict()["exposed_wait_s"] == 0.25
    assert Mark.now(torch.device("cpu")).event is None
