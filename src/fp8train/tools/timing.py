"""Step times that can be compared: configurations alternated in blocks of calls, medians.

Timing configurations one after another lets a change of machine load (another job starting on a
shared machine) pass for a difference between them. Alternating short blocks exposes every
configuration to the same load, and medians drop the blocks a burst of load hit. Used by the demo's
timed pass, its telemetry-overhead measurement and the benchmarks.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

__all__ = ["interleaved_times", "medians", "slowest_rank", "quartiles"]


def interleaved_times(
    fns: dict[str, Callable[[], None]],
    rounds: int,
    block: int = 1,
    warmup_blocks: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Seconds of each call of each function, `block` calls at a time, functions alternating.

    First `warmup_blocks` untimed blocks of each function (in order), then `rounds` timed rounds of
    one block each; the order is rotated every round so that no function always follows the same
    one. Every process running the same `fns` runs the same sequence of calls (ranks stay in step)."""
    names = list(fns)
    for _ in range(warmup_blocks):
        for name in names:
            for _ in range(block):
                fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            for _ in range(block):
                start = clock()
                fns[name]()
                times[name].append(clock() - start)
    return times


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(v) for name, v in times.items()}


def slowest_rank(per_rank: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Each step's time as the job sees it: the slowest rank's, step by step (every rank ran the
    same sequence of calls, so the i-th times of the ranks belong to the same step)."""
    return {
        name: [max(r[name][i] for r in per_rank) for i in range(len(v))] for name, v in per_rank[0].items()
    }


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile); all three the value itself for a single sample."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3
