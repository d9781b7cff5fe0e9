"""Instruments of the GPU check (benchmarks/gpu_check.py) that also work on the CPU (its host-sync
counter is the toolbox's: fp8train.tools.host_syncs).

- `SyncDebugSites`: on CUDA, every warning of `torch.cuda.set_sync_debug_mode("warn")` with the call
  stack that raised it.
- `StandInEvents`: CUDA events for the CPU, which complete only after later events were recorded (a
  GPU running behind the host): the CUDA branch of the reduction's timing, forced on the CPU.
- `DelayedCollective`: `torch.distributed.all_reduce` as a collective of a chosen latency on its own
  stream (a `torch.cuda._sleep` on a side stream; on the CPU, host time), to see on one GPU how much
  of it the asynchronous reduction hides.
- `median_seconds`: a step's median time (CUDA events on the GPU, host time on the CPU);
  `env_set`: an environment variable set for a block.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
import traceback
import warnings
import weakref
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from fp8train.tools.host_syncs import PACKAGE_DIR

__all__ = [
    "SyncDebugSites",
    "StandInEvents",
    "live_cuda_events",
    "DelayedCollective",
    "sleep_cycles_per_ms",
    "format_exception",
    "median_seconds",
    "env_set",
]


def median_seconds(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median seconds of `fn` over `reps` runs after `warmup` runs and a synchronisation (each run timed
    by CUDA events on the GPU, by the host's clock on the CPU)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@contextlib.contextmanager
def env_set(name: str, value: str) -> Iterator[None]:
    """`name`=`value` in the environment within the block; the previous value (or none) after it."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


class _StandInEvent:
    def __init__(self, events: StandInEvents) -> None:
        self.events = events
        self.serial: Optional[int] = None
        self.host = 0.0
        events.live.add(self)

    def record(self, stream=None) -> None:
        self.events.recorded += 1
        self.serial = self.events.recorded
        self.host = time.perf_counter()

    def query(self) -> bool:
        return self.serial is not None and self.events.recorded - self.serial >= self.events.lag

    def synchronize(self) -> None:
        if not self.query():
            self.events.waits += 1
            self.serial = -self.events.lag  # done now

    def elapsed_time(self, end: _StandInEvent) -> float:
        return 1e3 * (end.host - self.host)


class StandInEvents:
    """A maker of stand-in CUDA events: each completes once `lag` later events have been recorded.
    `waits` counts the host waits (`synchronize()` on an event not complete yet); `live()` the events
    still referenced."""

    def __init__(self, lag: int = 8) -> None:
        self.lag = lag
        self.recorded = 0
        self.waits = 0
        self.live: weakref.WeakSet = weakref.WeakSet()

    def recorded_event(self) -> _StandInEvent:
        event = _StandInEvent(self)
        event.record()
        return event

    def live_count(self) -> int:
        gc.collect()
        return len(self.live)


def live_cuda_events() -> int:
    """CUDA events still referenced anywhere in this process."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.cuda.Event))


def sleep_cycles_per_ms(device: torch.device) -> float:
    """GPU clock cycles per millisecond of `torch.cuda._sleep`, measured with events."""
    torch.cuda._sleep(1_000_000)  # warm
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / begin.elapsed_time(end)


class _Work:
    def __init__(self, inner, side: Optional[torch.cuda.Stream], ready_at: float) -> None:
        self.inner, self.side, self.ready_at, self.done = inner, side, ready_at, False

    def wait(self, timeout=None) -> bool:
        self.inner.wait()
        if self.side is not None:  # the waiting stream waits for the side stream: the host does not
            torch.cuda.current_stream().wait_stream(self.side)
        else:
            remaining = self.ready_at - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
        self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


class DelayedCollective:
    """Stands in for `torch.distributed.all_reduce` (install with the check's settings helper): the
    real collective, issued `latency_ms` later on a side stream that first waits for the caller's
    stream; the Work it returns makes the waiting stream wait for that side stream. On the CPU, the
    Work's wait returns `latency_ms` after the launch (host time)."""

    def __init__(self, latency_ms: float, device: torch.device, real=None) -> None:
        self.latency_ms = latency_ms
        self.real = real or dist.all_reduce
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.cycles = int(latency_ms * sleep_cycles_per_ms(device)) if device.type == "cuda" else 0
        self.calls = 0

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
        self.calls += 1
        ready_at = time.perf_counter() + self.latency_ms / 1e3
        if self.side is None:
            inner = self.real(tensor, op=op, group=group, async_op=True)
        else:
            self.side.wait_stream(torch.cuda.current_stream())
            tensor.record_stream(self.side)
            with torch.cuda.stream(self.side):
                if self.cycles:
                    torch.cuda._sleep(self.cycles)
                inner = self.real(tensor, op=op, group=group, async_op=True)
        work = _Work(inner, self.side, ready_at)
        if not async_op:
            work.wait()
            return None
        return work


class SyncDebugSites:
    """On CUDA, `torch.cuda.set_sync_debug_mode("warn")` while active, each warning kept with the call
    stack that raised it (its innermost fp8train frame names the site). Nothing on other devices."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.sites: dict[str, dict] = {}
        self._stack = contextlib.ExitStack()

    def _keep(self, message, category, filename, lineno, file=None, line=None) -> None:
        frames = traceback.extract_stack()[:-2]  # without this function and the warnings module's
        ours = [f for f in frames if os.path.abspath(f.filename).startswith(PACKAGE_DIR)]
        site = ours[-1] if ours else frames[-1]
        where = f"{os.path.relpath(site.filename, PACKAGE_DIR)}:{site.lineno}"
        key = f"sync-debug: {str(message).strip()[:80]} at {where}"
        entry = self.sites.setdefault(
            key,
            {
                "count": 0,
                "traceback": [
                    f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}" for f in frames[-12:][::-1]
                ],
            },
        )
        entry["count"] += 1

    def __enter__(self) -> SyncDebugSites:
        if self.cuda:
            self._stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("always")
            previous = warnings.showwarning
            warnings.showwarning = self._keep
            self._stack.callback(setattr, warnings, "showwarning", previous)
            torch.cuda.set_sync_debug_mode("warn")
            self._stack.callback(torch.cuda.set_sync_debug_mode, "default")
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def report(self) -> dict:
        return dict(self.sites)


def format_exception(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
