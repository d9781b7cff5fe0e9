"""Counters of the amax reduction (`fp8train.reduction_stats()`), the points in time they are measured
between, and host copies of device values that the host never waits for (docs/design.md, section 6)."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Optional

import torch

from . import streams
from .settings import settings

__all__ = ["Mark", "ReductionStats", "HostMirror"]


@dataclass(frozen=True)
class Mark:
    """A point in time where the work that waits runs: the host clock on the CPU, an event on the
    device's current stream on CUDA (where `work.wait()` makes the stream wait and returns at once):
    the device of the FP8 state, which need not be the current device (or `settings.timing_events`'
    stand-ins, anywhere)."""

    host: float
    event: Optional[torch.cuda.Event] = None

    @staticmethod
    def now(device: torch.device) -> Mark:
        event = None
        if settings.timing_events is not None:
            event = settings.timing_events()
        elif device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(streams.current_stream(device))
        return Mark(time.perf_counter(), event)


class ReductionStats:
    """Per-process counters, readable through `fp8train.reduction_stats()` (docs/telemetry.md).

    `exposed_wait_s`: time the waiting side stood still for a collective (the host on the CPU; the
    compute stream on CUDA, measured with events): what the reduction costs. `hidden_s`: the sum over
    reductions of the time from a launch to the start of its wait on the same clock, during which the
    collective overlapped other work: not a cost, and not a share of anything (a forward's and a
    backward's window overlap each other and the step, so the sum can exceed the training time);
    `hidden_s / launched` is each reduction's mean time in flight (docs/telemetry.md)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.launched = 0
        self.bytes_reduced = 0
        self.exposed_wait_s = 0.0
        self.hidden_s = 0.0
        self.updates = 0
        self.nonfinite_amax_events = 0
        self._nonfinite: dict = {}  # device -> (count on the device, its HostMirror)
        self._intervals: collections.deque = collections.deque()  # CUDA event pairs not read yet

    def add_interval(self, name: str, start: Mark, end: Mark) -> None:
        if start.event is None:
            setattr(self, name, getattr(self, name) + end.host - start.host)
        else:
            # Fold the intervals the device has completed (without waiting), so that only those of the
            # last few launches are held: the host runs at most `settings.verdict_lag` launches ahead
            # (channel.py).
            self._read_intervals(block=False)
            self._intervals.append((name, start.event, end.event))

    def count_nonfinite(self, last: torch.Tensor, ok: Optional[torch.Tensor]) -> None:
        count = torch.isinf(last).sum()
        if ok is not None:
            count = count * ok
        if last.device not in self._nonfinite:
            total = torch.zeros((), dtype=torch.int64, device=last.device)
            self._nonfinite[last.device] = (total, HostMirror(total))
        total, mirror = self._nonfinite[last.device]
        total += count
        mirror.publish(total)

    def _read_intervals(self, block: bool) -> None:
        while self._intervals:
            name, start, end = self._intervals[0]
            if not end.query():
                if not block:
                    return
                end.synchronize()
            setattr(self, name, getattr(self, name) + start.elapsed_time(end) / 1e3)
            self._intervals.popleft()

    def as_dict(self, wait: bool = True) -> dict:
        """The counters. `wait=False` reads nothing that would wait for a device: CUDA timings and
        non-finite counts not on the host yet are left for a later read."""
        self._read_intervals(block=wait)
        self.nonfinite_amax_events = sum(
            int(mirror.wait() if wait else mirror.host) for _, mirror in self._nonfinite.values()
        )
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


class HostMirror:
    """A host copy of a small device tensor, refreshed by copies the host never waits for.

    `host` holds the copy as it stands: for a scalar, the newest value whose copy has arrived, which
    is all a sticky flag or a growing count needs. `ready()` says whether the latest copy arrived;
    `wait()` (for host points) waits for it. On the CPU every copy arrives at once."""

    def __init__(self, like: torch.Tensor) -> None:
        self.device = like.device
        cuda = like.is_cuda
        self.host = torch.zeros(like.shape, dtype=like.dtype, pin_memory=cuda)
        self.host._fp8train_host_mirror = True  # host memory: reading it never waits for the device
        self.event = torch.cuda.Event() if cuda else None

    def publish(self, value: torch.Tensor) -> None:
        self.host.copy_(value, non_blocking=True)  # queued on the current stream of value's device
        if self.event is not None:
            self.event.record(streams.current_stream(self.device))

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host
