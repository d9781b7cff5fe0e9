"""Run a function on several real torch.distributed ranks (gloo on 127.0.0.1), with a timeout.

Ranks are forked from a forkserver that imported torch once, so a run starts in well under a second
instead of paying a fresh interpreter and a torch import per rank.
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


def free_port() -> int:
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
    ctx.set_forkserver_preload(["torch", "torch.distributed", "fp8train", "dist_utils"])
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
