"""Collectives launched in one order on every rank, whichever thread gets to each first.

A process group pairs collectives by the order they are issued: every rank must issue them in the
same order. The FP8 hook issues a bucket's second collective (the return trip) from the first one's
completion callback, which runs on a communication thread (gloo) or inline (NCCL), while the
backward issues the next bucket's first collective. `OrderedLauncher` takes each launch with a
sequence number fixed by the caller (the same on every rank) and runs launches strictly in that
order: a launch that is ready early waits for its predecessors; none is ever dropped.
"""

from __future__ import annotations

import threading
from typing import Callable

__all__ = ["OrderedLauncher"]


class OrderedLauncher:
    """Runs `submit(seq, launch)`'s launches in the order of seq (0, 1, 2, ...), each exactly once.

    One thread at a time drains the ready launches, outside the lock: a launch may submit again
    (NCCL runs completion callbacks inline), which then only files its launch for the drainer.
    A launch must not raise (it reports its own errors to its future)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready: dict[int, Callable[[], None]] = {}
        self._next = 0
        self._draining = False

    def submit(self, seq: int, launch: Callable[[], None]) -> None:
        with self._lock:
            if seq < self._next or seq in self._ready:
                raise RuntimeError(f"collective {seq} was submitted twice (next to launch: {self._next})")
            self._ready[seq] = launch
            if self._draining:
                return
            self._draining = True
        while True:
            with self._lock:
                launch = self._ready.pop(self._next, None)
                if launch is None:
                    self._draining = False
                    return
                self._next += 1
            launch()

    def waiting(self) -> int:
        """Launches filed but not run yet (their predecessors are not ready)."""
        with self._lock:
            return len(self._ready)
