"""Instruments of the GPU check (benchmarks/gpu_check.py) that also work on the CPU.

- `HostDataSites`: every place where fp8train's own code reads a device value on the host, makes a
  tensor from host data (`aten.lift_fresh`: `torch.tensor(...)`, a Python number written into a
  tensor element) or copies host memory to the GPU. On a GPU each of them stalls the host or the
  stream; on the CPU nothing stalls, but the same code makes the same calls, so counting them is the
  CPU's view of "no host synchronisation in a steady step". Allowed by design: tensors fp8train marks
  as host memory (`_fp8train_host_mirror`: the failure flag's host copy, the region tokens).
- `SyncDebugSites`: on CUDA, every warning of `torch.cuda.set_sync_debug_mode("warn")` with the call
  stack that raised it.
- `OpCount`: how often given aten ops ran (`torch._scaled_mm` per layer).
- `StandInEvents`: CUDA events for the CPU, which complete only after later events were recorded (a
  GPU running behind the host): the CUDA branch of the reduction's timing, forced on the CPU.
- `DelayedCollective`: `torch.distributed.all_reduce` as a collective of a chosen latency on its own
  stream (a `torch.cuda._sleep` on a side stream; on the CPU, host time), to see on one GPU how much
  of it the asynchronous reduction hides.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
import traceback
import warnings
import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import fp8train

__all__ = [
    "HostDataSites",
    "SyncDebugSites",
    "OpCount",
    "StandInEvents",
    "live_cuda_events",
    "DelayedCollective",
    "sleep_cycles_per_ms",
    "format_exception",
]

PACKAGE_DIR = os.path.dirname(os.path.abspath(fp8train.__file__))
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
}


def _package_frames() -> Optional[list[str]]:
    """The call stack's frames from the first caller outside torch and this file, if that caller is
    fp8train's code ('file:line in function', innermost first, up to the first frame outside it)."""
    frame = sys._getframe(2)
    here = os.path.abspath(__file__)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(TORCH_DIR) and path != here:
            break
        frame = frame.f_back
    if frame is None or not os.path.abspath(frame.f_code.co_filename).startswith(PACKAGE_DIR):
        return None
    frames = []
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        where = os.path.relpath(path, PACKAGE_DIR) if path.startswith(PACKAGE_DIR) else os.path.basename(path)
        frames.append(f"{where}:{frame.f_lineno} in {frame.f_code.co_name}")
        if not path.startswith(PACKAGE_DIR) and not path.startswith(TORCH_DIR):
            break
        frame = frame.f_back
    return frames


class _Reads(TorchFunctionMode):
    def __init__(self, sites: HostDataSites) -> None:
        super().__init__()
        self.sites = sites

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS and isinstance(args[0], torch.Tensor) and self.sites.on_device(args[0]):
            if not getattr(args[0], "_fp8train_host_mirror", False):
                self.sites.note(f"host read ({func.__name__})")
        return func(*args, **kwargs)


class _Creations(TorchDispatchMode):
    def __init__(self, sites: HostDataSites) -> None:
        super().__init__()
        self.sites = sites

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten.lift_fresh.default:
            frames = _package_frames()
            if frames is not None:  # judged at the end: fp8train may mark it as host memory by design
                self.sites.fresh.append((frames, out))
        elif func in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default):
            src, dst = (args[1], args[0]) if func is torch.ops.aten.copy_.default else (args[0], out)
            if src.device.type == "cpu" and dst.device.type == "cuda":
                self.sites.note("host-to-device copy")
        return out


class HostDataSites:
    """`with HostDataSites(device) as sites:` ... `sites.report()`: each site that would make the host
    or the stream wait on `device`, with how often and the fp8train call stack that led there."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sites: dict[str, dict] = {}
        self.fresh: list[tuple[list[str], torch.Tensor]] = []
        self._modes = (_Reads(self), _Creations(self))

    def on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self.device.type

    def note(self, what: str, frames: Optional[list[str]] = None) -> None:
        frames = frames or _package_frames()
        if frames is None:
            return
        key = f"{what} at {frames[0]}"
        entry = self.sites.setdefault(key, {"count": 0, "traceback": frames})
        entry["count"] += 1

    def __enter__(self) -> HostDataSites:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        for frames, tensor in self.fresh:
            if not getattr(tensor, "_fp8train_host_mirror", False):
                self.note("tensor made from host data (aten.lift_fresh)", frames)
        self.fresh.clear()

    def report(self) -> dict:
        return dict(self.sites)


class OpCount(TorchDispatchMode):
    """How many times the aten ops named in `names` (overload packets, e.g. "_scaled_mm") ran."""

    def __init__(self, *names: str) -> None:
        super().__init__()
        self.names = set(names)
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.names:
            self.count += 1
        return func(*args, **(kwargs or {}))


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
