"""Test-only wrappers around `torch.distributed.all_reduce`, installed inside one rank.

fp8train calls `dist.all_reduce` through the module attribute, so replacing
`torch.distributed.all_reduce` in a rank intercepts every amax collective of that rank. One
`AllReduceSpy` can count calls, defer them and add latency:

- counting: `spy.calls` is the number of all_reduce calls so far (take differences per step).
- deferred (`defer=True`): all_reduce does nothing but return a Work-like handle whose `wait()`
  performs the real, blocking all_reduce. The buffer therefore holds this rank's local values until
  `wait()`, which turns any read-before-wait bug into a deterministic cross-rank disagreement.
- latency (`latency_s=L`): `wait()` returns no earlier than L seconds after the call was made. The
  core waits right away in blocking mode and later in async mode, so both modes pay the same L per
  collective and only the exposed part differs.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["AllReduceSpy", "SpyWork"]


class SpyWork:
    """What the wrapped all_reduce returns: waits (or runs) the real collective, then the latency."""

    def __init__(self, spy: AllReduceSpy, tensor: torch.Tensor, kwargs: dict, inner) -> None:
        self.spy = spy
        self.tensor = tensor
        self.kwargs = kwargs
        self.inner = inner  # the real Work, or None while deferred
        self.launched_at = time.perf_counter()
        self.done = False

    def wait(self, timeout=None) -> bool:
        if not self.done:
            if self.spy.defer:
                self.spy.real(self.tensor, **self.kwargs, async_op=False)
            elif self.inner is not None:
                self.inner.wait()
            remaining = self.launched_at + self.spy.latency_s - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


class AllReduceSpy:
    """Replace `torch.distributed.all_reduce` while installed (a context manager)."""

    def __init__(self, defer: bool = False, latency_s: float = 0.0) -> None:
        self.defer = defer
        self.latency_s = latency_s
        self.calls = 0
        self.works: list[SpyWork] = []
        self.real = None

    def __enter__(self) -> AllReduceSpy:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def install(self) -> None:
        if self.real is not None:
            raise RuntimeError("AllReduceSpy is already installed")
        self.real = dist.all_reduce
        dist.all_reduce = self._all_reduce

    def uninstall(self) -> None:
        if self.real is not None:
            dist.all_reduce = self.real
            self.real = None

    def unwaited(self) -> int:
        """Collectives returned to the caller and not waited on yet (in flight, from its view)."""
        return sum(not w.done for w in self.works)

    def _all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
        self.calls += 1
        kwargs = {"op": op, "group": group}
        inner: Optional[object] = None
        if not self.defer:
            inner = self.real(tensor, **kwargs, async_op=True)
        work = SpyWork(self, tensor, kwargs, inner)
        self.works.append(work)
        if not async_op:
            work.wait()
            return None
        return work
