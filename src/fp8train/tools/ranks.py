"""Real torch.distributed ranks on one machine, for the tests, the benchmarks and the demo.

`run_ranks` runs a function on several gloo ranks (127.0.0.1, a free port, one thread each) with a
timeout; ranks are forked from a forkserver that imported torch once, so a run starts in well under
a second, and that compiled fp8train's CPU kernels once (`rank_warmup`), so a rank's first FP8 step
does not load them (about 7 s a rank before). `AllReduceSpy`, installed inside a rank, wraps
`torch.distributed.all_reduce`: fp8train calls it through the module attribute, so the spy sees every
amax collective of that rank. It can

- count calls (`spy.calls`; take differences per step);
- defer them (`defer=True`): all_reduce does nothing but return a Work-like handle whose `wait()`
  performs the real, blocking all_reduce. The buffer holds this rank's local values until `wait()`,
  which turns any read-before-wait bug into a deterministic cross-rank disagreement;
- add latency (`latency_s=L`): `wait()` returns no earlier than L seconds after the call. The core
  waits right away in blocking mode and later in async mode, so both modes pay the same L per
  collective and only the exposed part differs (a slow interconnect, stood in for on one machine).
  With `latency_after="completion"` the L counts from the moment the real collective completed (the
  last rank joined) instead of this rank's call, as on a real interconnect where the reduction cannot
  start before the slowest rank arrives: a rank that waits for a slower one then pays the wait and L.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_ranks", "run_ranks_outcomes", "assert_ok", "AllReduceSpy"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, env, pg_timeout_s, queue):
    try:
        os.environ.update(env or {})
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        # pickled by value here: tensors sent as they are would be shared through file descriptors,
        # which the parent could no longer fetch once this process has exited
        result = pickle.dumps(fn(rank, world_size, *args))
        queue.put((rank, True, result))
    except BaseException:  # report everything, including KeyboardInterrupt from the function
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _exiting_worker(*args: Any) -> None:
    """The rank body, then a hard exit: skips seconds of interpreter teardown per rank."""
    _worker(*args)
    os._exit(0)


def run_ranks_outcomes(
    fn: Callable,
    world_size: int,
    *args: Any,
    env: Optional[dict] = None,
    timeout_s: float = 120,
    pg_timeout_s: float = 60,
) -> list[tuple[bool, Any]]:
    """Run `fn(rank, world_size, *args)` on each rank; a rank that raises or vanishes is an outcome.

    Returns (ok, payload) per rank: (True, return value), (False, traceback) or (False, "exited with
    code N without a result"). Raises TimeoutError if any rank is still running after `timeout_s`.
    `fn` must be a module-level function (it is pickled by reference into the rank processes).
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "torch.distributed", "fp8train", "fp8train.tools.ranks", "fp8train.tools.rank_warmup"]
    )
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_exiting_worker,
            args=(r, world_size, port, fn, args, env, pg_timeout_s, queue),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcomes) < world_size:
            if not queue.empty():
                rank, ok, payload = queue.get()
                outcomes[rank] = (ok, pickle.loads(payload) if ok else payload)
            elif all(not p.is_alive() for p in procs):
                if queue.empty():
                    break
            elif time.monotonic() > deadline:
                raise TimeoutError(f"ranks still running after {timeout_s}s (finished: {sorted(outcomes)})")
            else:
                time.sleep(0.05)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    for r, p in enumerate(procs):
        outcomes.setdefault(r, (False, f"exited with code {p.exitcode} without a result"))
    return [outcomes[r] for r in range(world_size)]


def assert_ok(outcomes: list[tuple[bool, Any]]) -> list[Any]:
    """The payloads of ranks that all returned; otherwise fail with the first failing rank's traceback."""
    for rank, (ok, payload) in enumerate(outcomes):
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{payload}")
    return [payload for _, payload in outcomes]


def run_ranks(fn: Callable, world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """[fn(rank, world_size, *args) for each rank]; raises with the failing rank's traceback."""
    return assert_ok(run_ranks_outcomes(fn, world_size, *args, **kwargs))


class SpyWork:
    """What the wrapped all_reduce returns: waits (or runs) the real collective, then the latency."""

    def __init__(self, spy: AllReduceSpy, tensor: torch.Tensor, kwargs: dict, inner) -> None:
        self.spy = spy
        self.tensor = tensor
        self.kwargs = kwargs
        self.inner = inner  # the real Work, or None while deferred
        self.launched_at = time.perf_counter()
        self.completed_at: Optional[float] = None
        self.done = False
        if inner is not None and spy.latency_after == "completion":
            inner.get_future().then(self._completed)  # runs when the last rank has joined

    def _completed(self, _future) -> None:
        self.completed_at = time.perf_counter()

    def wait(self, timeout=None) -> bool:
        if not self.done:
            if self.spy.defer:
                self.spy.real(self.tensor, **self.kwargs, async_op=False)
            elif self.inner is not None:
                self.inner.wait()
            start = self.launched_at
            if self.spy.latency_after == "completion":
                start = self.completed_at if self.completed_at is not None else time.perf_counter()
            remaining = start + self.spy.latency_s - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


class AllReduceSpy:
    """Replace `torch.distributed.all_reduce` while installed (a context manager)."""

    def __init__(self, defer: bool = False, latency_s: float = 0.0, latency_after: str = "launch") -> None:
        if latency_after not in ("launch", "completion"):
            raise ValueError(f"latency_after must be 'launch' or 'completion', got {latency_after!r}")
        self.defer = defer
        self.latency_s = latency_s
        self.latency_after = latency_after
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
